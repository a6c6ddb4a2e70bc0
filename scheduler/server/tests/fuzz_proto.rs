//! Seeded fuzzing of every `rollfleet.v1` message decoder and of the checks the server applies
//! before its actor sees a message: random bytes and mutations of the seed corpus
//! (`tests/fuzz-corpus/proto/`, plausible encodings of the messages peers send) are decoded as
//! every message type. Whatever decodes must encode again to bytes that decode to the same
//! message, and then go through the server's checks without a panic: the inventory check of a
//! registration, the load limits of a heartbeat or a work stream's load report, the unpacking
//! of a result's packed token ids and log-probabilities, the job spec parser of a submission and
//! the publication check of the trainer feed. (The actor's handlers behind those checks are
//! fuzzed through its journal by `actor_fuzz.rs`.)
//!
//! `ROLLFLEET_FUZZ_CASES` (default 20,000) sets the number of seeds, `ROLLFLEET_FUZZ_SEED` runs
//! one seed alone: a failing case prints the command that reproduces it. The corpus is written
//! by `ROLLFLEET_FUZZ_WRITE_CORPUS=1 cargo test -p rollfleet-server --test fuzz_proto
//! -- --ignored`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may fail loudly

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::Instant;

use prost::Message;
use rollfleet_proto::v1::*;
use rollfleet_rng::SplitMix64;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus/proto")
}

/// Plausible messages of the kinds peers send, as the corpus is written from them.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let inventory = HardwareInventory {
        hostname: "decode-0.cluster".into(),
        pool: "decode".into(),
        device: Some(hardware_inventory::Device::Gpu(GpuInventory {
            product: "H20".into(),
            count: 2,
            memory_bytes: 96 << 30,
            emulated: false,
            interconnect_gbps: 400.0,
            tensor_parallel: 2,
        })),
        backend: "sglang".into(),
        ..Default::default()
    };
    let load = WorkerLoad {
        queued_stages: 3,
        running_stages: 8,
        gpus: vec![GpuReading {
            index: 0,
            utilization: 0.9,
            memory_used_bytes: 1 << 30,
        }],
        samples: vec![ProfileSample {
            flops: 1e12,
            seconds: 0.01,
            gpus: 2,
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut output = StageOutput {
        tokens: vec![1, 2, 151_935],
        logprobs: vec![-0.1, -2.5, -0.0],
        prompt_tokens: vec![7, 8],
        text: "the answer is 42".into(),
        token_count: 3,
        policy_version: 2,
        engine_weight_version: Some(2),
        ..Default::default()
    };
    rollfleet_proto::packed::pack(&mut output);
    let result = WorkerMessage {
        message: Some(worker_message::Message::Result(WorkResult {
            assignment_id: 17,
            outcome: Some(work_result::Outcome::Output(output)),
            duration_us: 1500,
        })),
    };
    let failure = WorkerMessage {
        message: Some(worker_message::Message::Result(WorkResult {
            assignment_id: 18,
            outcome: Some(work_result::Outcome::Failure(StageFailure {
                cause: stage_failure::Cause::Infrastructure as i32,
                message: "engine restarted".into(),
            })),
            duration_us: 0,
        })),
    };
    let hello = WorkerMessage {
        message: Some(worker_message::Message::Hello(WorkerHello {
            worker_id: "w3-00112233445566778899aabbccddeeff".into(),
            epoch: 1,
        })),
    };
    let publish = PublishWeights {
        version: 3,
        uri: "file:///weights/v3".into(),
        format: "safetensors".into(),
        sha256: "0".repeat(64),
        bytes: 1 << 20,
    };
    vec![
        (
            "register",
            RegisterRequest {
                inventory: Some(inventory.clone()),
                requested_lease_ms: 10_000,
                previous_worker_id: String::new(),
            }
            .encode_to_vec(),
        ),
        (
            "heartbeat",
            HeartbeatRequest {
                worker_id: "w3-00112233445566778899aabbccddeeff".into(),
                epoch: 1,
                load: Some(load.clone()),
            }
            .encode_to_vec(),
        ),
        ("work-result", result.encode_to_vec()),
        ("work-failure", failure.encode_to_vec()),
        ("work-hello", hello.encode_to_vec()),
        (
            "submit",
            SubmitJobRequest {
                job_yaml: common_yaml(),
                request_id: "r1".into(),
                job_dir: "/jobs".into(),
            }
            .encode_to_vec(),
        ),
        (
            "feed-subscribe",
            TrainerFeedRequest {
                message: Some(trainer_feed_request::Message::Subscribe(FeedSubscribe {
                    job: "quickstart".into(),
                    resume_from: 6,
                    window: 64,
                })),
            }
            .encode_to_vec(),
        ),
        (
            "feed-publish",
            TrainerFeedRequest {
                message: Some(trainer_feed_request::Message::Publish(publish)),
            }
            .encode_to_vec(),
        ),
        (
            "journal-register",
            JournalRecord {
                at_ns: 5,
                event: Some(journal_record::Event::Register(JournalRegister {
                    inventory: Some(inventory),
                    lease_secret: "00".repeat(16),
                })),
            }
            .encode_to_vec(),
        ),
    ]
}

fn common_yaml() -> String {
    "name: fuzz\nsteps: 2\n".into()
}

fn corpus() -> Vec<Vec<u8>> {
    let mut paths: Vec<_> = std::fs::read_dir(corpus_dir())
        .expect("the seed corpus exists")
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// Random bytes, or a corpus entry with 1 or 2 mutations.
fn input(rng: &mut SplitMix64, corpus: &[Vec<u8>]) -> Vec<u8> {
    if rng.index(8) == 0 {
        let n = rng.index(64);
        return (0..n).map(|_| rng.next_u64() as u8).collect();
    }
    let mut bytes = corpus[rng.index(corpus.len())].clone();
    for _ in 0..1 + rng.index(2) {
        let len = bytes.len().max(1);
        match rng.index(7) {
            0 => {
                let i = rng.index(len).min(bytes.len().saturating_sub(1));
                if let Some(b) = bytes.get_mut(i) {
                    *b ^= 1 << rng.index(8);
                }
            }
            1 => {
                let i = rng.index(len + 1).min(bytes.len());
                // Bytes that are tags, wire types and varint continuations.
                let b = [0x08, 0x0a, 0x12, 0x1a, 0x80, 0xff, 0x00, 0x7f][rng.index(8)];
                bytes.insert(i, b);
            }
            2 => {
                let i = rng.index(len).min(bytes.len());
                let n = rng.index(8).min(bytes.len() - i);
                bytes.drain(i..i + n);
            }
            3 => bytes.truncate(rng.index(len)),
            4 => {
                // A length-delimited field claiming far more than there is.
                let at = rng.index(len + 1).min(bytes.len());
                bytes.splice(at..at, [0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f]);
            }
            5 => {
                let i = rng.index(len).min(bytes.len());
                let n = rng.index(32).min(bytes.len() - i);
                let copy = bytes[i..i + n].to_vec();
                let at = rng.index(bytes.len() + 1);
                bytes.splice(at..at, copy);
            }
            _ => {
                let other = &corpus[rng.index(corpus.len())];
                let cut = rng.index(other.len().max(1)).min(other.len());
                bytes.extend_from_slice(&other[cut..]);
            }
        }
    }
    bytes
}

/// Decodes `bytes` as `T`; whatever decodes encodes to bytes that decode to the same encoding.
/// Returns the message for the server's checks.
fn decode<T: Message + Default>(bytes: &[u8]) -> Option<T> {
    let message = T::decode(bytes).ok()?;
    let encoded = message.encode_to_vec();
    let again = T::decode(encoded.as_slice()).expect("a message's own encoding decodes");
    assert_eq!(
        again.encode_to_vec(),
        encoded,
        "{} does not round-trip",
        std::any::type_name::<T>()
    );
    Some(message)
}

/// The checks the server makes before its actor; counts the messages that reached one.
fn server_checks(bytes: &[u8], weights_root: &std::path::Path) -> usize {
    let mut checked = 0;
    if let Some(r) = decode::<RegisterRequest>(bytes)
        && let Some(inventory) = &r.inventory
    {
        let _ = rollfleet_server::inventory::check(inventory);
        checked += 1;
    }
    if let Some(h) = decode::<HeartbeatRequest>(bytes)
        && let Some(load) = &h.load
    {
        let _ = rollfleet_server::grpc::oversized_load(load);
        checked += 1;
    }
    if let Some(m) = decode::<WorkerMessage>(bytes) {
        match m.message {
            Some(worker_message::Message::Load(load)) => {
                let _ = rollfleet_server::grpc::oversized_load(&load);
                checked += 1;
            }
            Some(worker_message::Message::Result(WorkResult {
                outcome: Some(work_result::Outcome::Output(mut o)),
                ..
            })) => {
                if rollfleet_proto::packed::unpack(&mut o).is_ok() {
                    assert!(o.packed_tokens.is_empty() && o.packed_logprobs.is_empty());
                }
                checked += 1;
            }
            _ => {}
        }
    }
    if let Some(s) = decode::<SubmitJobRequest>(bytes) {
        let _ = rollfleet_spec::parse_job(s.job_yaml.as_bytes(), "job_yaml");
        checked += 1;
    }
    if let Some(TrainerFeedRequest {
        message: Some(trainer_feed_request::Message::Publish(p)),
    }) = decode::<TrainerFeedRequest>(bytes)
    {
        let _ = rollfleet_server::feed::check_publication(p, Some(weights_root));
        checked += 1;
    }
    checked
}

/// Decodes `bytes` as every message type of `rollfleet.v1`.
fn decode_as_every_type(bytes: &[u8]) -> usize {
    macro_rules! every {
        ($($t:ty),* $(,)?) => {{
            let mut decoded = 0;
            $(decoded += usize::from(decode::<$t>(bytes).is_some());)*
            decoded
        }};
    }
    every!(
        TrajectoryId,
        HardwareInventory,
        GpuTelemetryInfo,
        GpuDevice,
        GpuInventory,
        CpuInventory,
        ServerlessInventory,
        RegisterRequest,
        Lease,
        RegisterResponse,
        HeartbeatRequest,
        HeartbeatResponse,
        WorkerLoad,
        ProfileSample,
        GpuReading,
        WorkAssignment,
        GenerationWork,
        ChatMessage,
        EnvStepWork,
        RewardWork,
        TrainWork,
        WeightSyncWork,
        WorkResult,
        StageOutput,
        StageFailure,
        WorkerMessage,
        WorkerLeaving,
        WorkerHello,
        SchedulerMessage,
        ReplicaStart,
        SubmitJobRequest,
        SubmitJobResponse,
        JobRef,
        PoolStatus,
        JobStatus,
        TrajectoryOutcomes,
        CancelJobResponse,
        ListJobsRequest,
        JobList,
        JobLogsRequest,
        LogLine,
        Turn,
        Segment,
        CompletedTrajectory,
        TrainerFeedRequest,
        PublishWeights,
        FeedSubscribe,
        TrainerFeedItem,
        PublicationAnswer,
        JournalHeader,
        JournalRecord,
        JournalRegister,
        JournalHeartbeat,
        JournalMessage,
        JournalDetach,
    )
}

#[test]
fn random_and_mutated_bytes_decode_as_every_message_or_are_refused_and_pass_the_checks_without_a_panic()
 {
    let seeds = rollfleet_rng::test_seeds("ROLLFLEET_FUZZ", 20_000);
    let corpus = corpus();
    assert!(
        corpus.len() >= 5,
        "the seed corpus has {} entries",
        corpus.len()
    );
    let weights_root = std::env::temp_dir().join("rollfleet-fuzz-proto-no-weights-here");
    let started = Instant::now();
    let (mut decoded, mut checked) = (0, 0);
    for &seed in &seeds {
        let bytes = input(&mut SplitMix64::new(seed), &corpus);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            (
                decode_as_every_type(&bytes),
                server_checks(&bytes, &weights_root),
            )
        }));
        let Ok((d, c)) = outcome else {
            panic!(
                "case {seed} panicked; reproduce with: ROLLFLEET_FUZZ_SEED={seed} cargo test -p \
                 rollfleet-server --test fuzz_proto"
            );
        };
        decoded += d;
        checked += c;
    }
    eprintln!(
        "{} cases in {:?}: {decoded} decodes, {checked} through a server check",
        seeds.len(),
        started.elapsed()
    );
    if seeds.len() >= 100 {
        // A mutator whose every input fails to decode reaches none of the checks. (Most
        // mutations break a message: a flipped high bit in a string is not UTF-8, a length
        // past the end is refused.)
        assert!(
            checked >= seeds.len() / 20,
            "only {checked} messages of {} cases reached a server check",
            seeds.len()
        );
    }
}

#[test]
fn the_seed_corpus_holds_what_the_seed_messages_encode_to_and_each_reaches_a_server_check() {
    let written = corpus();
    let weights_root = std::env::temp_dir().join("rollfleet-fuzz-proto-no-weights-here");
    for (name, bytes) in seeds() {
        let checks = server_checks(&bytes, &weights_root);
        // The journal's record is decoded, not checked: the replay checks it.
        assert!(
            checks >= 1 || name.starts_with("journal"),
            "{name} reaches no server check"
        );
        assert!(
            written.contains(&bytes),
            "tests/fuzz-corpus/proto/{name}.bin is missing or stale; rewrite it with \
             ROLLFLEET_FUZZ_WRITE_CORPUS=1 cargo test -p rollfleet-server --test fuzz_proto -- \
             --ignored"
        );
    }
}

#[test]
#[ignore = "writes the seed corpus"]
fn write_the_seed_corpus() {
    if std::env::var_os("ROLLFLEET_FUZZ_WRITE_CORPUS").is_none() {
        return;
    }
    std::fs::create_dir_all(corpus_dir()).unwrap();
    for (name, bytes) in seeds() {
        std::fs::write(corpus_dir().join(format!("{name}.bin")), bytes).unwrap();
    }
}
