//! Seeded fuzzing of the scheduler's actor through its journal: every case writes a journal of
//! plausible and hostile events (registrations for real and unknown pools, streams that attach
//! with right and wrong leases, results for assignments that exist and that do not, with token
//! ids, non-finite rewards, failures of every cause, oversized loads, publications, detaches,
//! ticks, clocks that go backwards), then replays it as a restarted scheduler does. The replay
//! drives the actor's handlers exactly as live events do; it may refuse the journal or end the
//! job, but it must never panic and must finish. Results here name assignments at random, so
//! they reach the actor's checks (a result for an assignment a stream does not hold cuts the
//! stream off) rather than its bookkeeping of completed stages: `fault_harness.rs` drives that
//! part with workers that answer what they were given.
//!
//! `ROLLFLEET_FUZZ_CASES` (default 60) sets the number of seeds, `ROLLFLEET_FUZZ_SEED` runs one
//! seed alone: a failing case prints the command that reproduces it.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rollfleet_proto::v1::{
    CpuInventory, GpuInventory, GpuReading, HardwareInventory, JournalDetach, JournalHeader,
    JournalHeartbeat, JournalMessage, JournalRecord, JournalRegister, PublishWeights,
    ServerlessInventory, StageFailure, StageOutput, WorkResult, WorkerHello, WorkerLeaving,
    WorkerLoad, WorkerMessage, hardware_inventory, journal_record, work_result, worker_message,
};
use rollfleet_server::journal::{FORMAT, JournalWriter};

mod common;
use common::{Rng, quickstart_yaml};

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// A number that is usually ordinary and sometimes hostile.
    fn float(&mut self) -> f64 {
        *self.pick(&[
            0.0,
            1.0,
            0.5,
            -1.0,
            1e300,
            -1e300,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MIN_POSITIVE,
        ])
    }

    fn text(&mut self) -> String {
        let n = *self.pick(&[0usize, 1, 8, 300, 70_000]);
        let alphabet = ['a', 'Z', '0', ' ', '\n', 'é', '\u{0}', '<', '"'];
        (0..n).map(|_| *self.pick(&alphabet)).collect()
    }
}

const POOLS: [&str; 7] = [
    "prefill", "decode", "train", "envs", "rewards", "nowhere", "",
];

fn inventory(rng: &mut Rng) -> HardwareInventory {
    let pool = (*rng.pick(&POOLS)).to_owned();
    let device = match rng.below(4) {
        0 => Some(hardware_inventory::Device::Gpu(GpuInventory {
            product: (*rng.pick(&["H800", "H20", "A100-80GB", "no-such-gpu", ""])).to_owned(),
            count: *rng.pick(&[0, 1, 2, 8, 65, u32::MAX]),
            memory_bytes: rng.next() >> rng.below(64),
            emulated: rng.chance(80),
            interconnect_gbps: rng.float(),
            tensor_parallel: *rng.pick(&[0, 1, 2, 3, 8, u32::MAX]),
        })),
        1 => Some(hardware_inventory::Device::Cpu(CpuInventory {
            shape: "c7i.8xlarge".into(),
            vcpus: *rng.pick(&[0, 1, 32, u32::MAX]),
            memory_bytes: rng.next(),
            environments: vec![(*rng.pick(&["sokoban", "frozenlake", "calculator", "x"])).into()],
            slots: *rng.pick(&[0, 1, 64, u32::MAX]),
        })),
        2 => Some(hardware_inventory::Device::Serverless(
            ServerlessInventory {
                platform: "aws-lambda".into(),
                functions: vec![rng.text()],
                concurrency: *rng.pick(&[0, 1, 1000, u32::MAX]),
            },
        )),
        _ => None,
    };
    HardwareInventory {
        hostname: format!("node-{}", rng.below(8)),
        pool,
        device,
        backend: (*rng.pick(&["", "emulated", "sglang", "vllm", "openai", "bogus"])).to_owned(),
        ..Default::default()
    }
}

fn output(rng: &mut Rng) -> StageOutput {
    let tokens = rng.below(5) as usize * 7;
    let logprobs = if rng.chance(80) { tokens } else { tokens + 1 };
    let mut packed = vec![0u8; rng.below(3) as usize * 4 + usize::from(rng.chance(10))];
    for (i, b) in packed.iter_mut().enumerate() {
        *b = (rng.next() >> (i % 8)) as u8;
    }
    StageOutput {
        tokens: (0..tokens as u32).collect(),
        text: rng.text(),
        observation: rng.text(),
        done: rng.chance(30),
        reward: rng.float(),
        policy_version: rng.below(4),
        emulated: rng.chance(70),
        token_count: *rng.pick(&[0, 1, 40, u64::MAX]),
        logprobs: (0..logprobs).map(|_| rng.float() as f32).collect(),
        prompt_tokens: (0..rng.below(20) as u32).collect(),
        engine_weight_version: rng.chance(20).then(|| rng.below(4)),
        interrupted: rng.chance(10),
        packed_tokens: if rng.chance(10) {
            packed.into()
        } else {
            Default::default()
        },
        ..Default::default()
    }
}

fn worker_message(rng: &mut Rng, leases: &[String]) -> worker_message::Message {
    match rng.below(10) {
        0 => worker_message::Message::Hello(hello(rng, leases)),
        1 => worker_message::Message::Load(WorkerLoad {
            queued_stages: rng.below(100) as u32,
            kv_cache_used_bytes: rng.next(),
            kv_cache_capacity_bytes: rng.next() >> rng.below(64),
            batch_size: rng.below(300) as u32,
            gpu_utilization: Some(rng.float()),
            gpus: (0..*rng.pick(&[0u32, 1, 8, 65]))
                .map(|index| GpuReading {
                    index,
                    utilization: rng.float(),
                    memory_used_bytes: rng.next(),
                })
                .collect(),
            ..Default::default()
        }),
        2 => worker_message::Message::Leaving(WorkerLeaving { reason: rng.text() }),
        _ => worker_message::Message::Result(WorkResult {
            assignment_id: rng.below(400),
            outcome: match rng.below(5) {
                0 => None,
                1 => Some(work_result::Outcome::Failure(StageFailure {
                    cause: rng.below(6) as i32,
                    message: rng.text(),
                })),
                _ => Some(work_result::Outcome::Output(output(rng))),
            },
            duration_us: rng.next() >> rng.below(64),
        }),
    }
}

fn hello(rng: &mut Rng, leases: &[String]) -> WorkerHello {
    let worker_id = if !leases.is_empty() && rng.chance(80) {
        rng.pick(leases).clone()
    } else {
        format!("w{}-{}", rng.below(10), rng.text())
    };
    WorkerHello {
        worker_id,
        epoch: rng.below(3),
    }
}

/// A journal of `events` records for the case `seed`: the header of the quick-start job, then a
/// mix of events that a real run, a faulty worker and a hostile one would produce.
fn journal(seed: u64, events: usize) -> (JournalHeader, Vec<JournalRecord>) {
    let mut rng = Rng::new(seed);
    let header = JournalHeader {
        format: FORMAT.into(),
        job_yaml: quickstart_yaml(),
        seed,
        time_scale: *rng.pick(&[1.0, 0.25, 4.0]),
        lease_ttl_ms: *rng.pick(&[500, 3000]),
        expect_workers: rng.below(7),
        replan_on_drift: None,
        stage_timeout_ms: *rng.pick(&[100, 60_000]),
    };
    let mut at_ns: u64 = 0;
    let mut leases: Vec<String> = Vec::new();
    let mut records = Vec::with_capacity(events);
    for _ in 0..events {
        // Mostly forward, sometimes a long gap, sometimes backwards.
        at_ns = match rng.below(20) {
            0 => at_ns.saturating_sub(rng.below(1_000_000_000)),
            1 => at_ns.saturating_add(rng.below(120_000_000_000)),
            _ => at_ns.saturating_add(rng.below(50_000_000)),
        };
        let event = match rng.below(16) {
            0 | 1 => {
                let secret = format!(
                    "{:032x}",
                    u128::from(rng.next()) << 64 | u128::from(rng.next())
                );
                leases.push(format!("w{}-{secret}", leases.len() + 1));
                journal_record::Event::Register(JournalRegister {
                    inventory: Some(inventory(&mut rng)),
                    lease_secret: if rng.chance(90) { secret } else { rng.text() },
                })
            }
            2 | 3 => journal_record::Event::Attach(hello(&mut rng, &leases)),
            4 => journal_record::Event::Heartbeat(JournalHeartbeat {
                worker_id: hello(&mut rng, &leases).worker_id,
                epoch: rng.below(3),
                load: None,
                heard_at_ns: if rng.chance(50) {
                    0
                } else {
                    rng.below(u64::MAX)
                },
            }),
            5 => journal_record::Event::Detach(JournalDetach {
                worker: rng.below(8),
                reason: rng.text(),
            }),
            6 => journal_record::Event::Tick(true),
            7 => journal_record::Event::Wake(true),
            8 if rng.chance(10) => journal_record::Event::Cancel(true),
            9 if rng.chance(20) => journal_record::Event::Recovered(true),
            10 if rng.chance(20) => journal_record::Event::FeedSubscribed(true),
            11 if rng.chance(30) => journal_record::Event::Publish(PublishWeights {
                version: rng.below(5),
                uri: (*rng.pick(&["file:///nonexistent/w.gguf", "", "s3://x/../y"])).into(),
                format: "gguf".into(),
                sha256: rng.text(),
                bytes: rng.next(),
            }),
            _ => journal_record::Event::Message(JournalMessage {
                worker: rng.below(8),
                message: Some(WorkerMessage {
                    message: Some(worker_message(&mut rng, &leases)),
                }),
            }),
        };
        records.push(JournalRecord {
            at_ns,
            event: Some(event),
        });
    }
    (header, records)
}

fn scratch(seed: u64) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rollfleet-actor-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("case-{seed}.journal"))
}

/// How a case ended: replayed to its last record (with the stages the actor saw completed), or
/// refused with a reason; and the wall time of the replay.
struct Case {
    replayed: Option<u64>,
    took: Duration,
}

/// Writes and replays case `seed`.
fn run_case(seed: u64) -> Case {
    let (header, records) = journal(seed, 400);
    let path = scratch(seed);
    let mut writer = JournalWriter::create(&path, &header).unwrap();
    for record in &records {
        writer.write(record).unwrap();
    }
    writer.flush().unwrap();
    drop(writer);
    let started = Instant::now();
    let outcome = std::panic::catch_unwind(|| rollfleet_server::replay_journal(&path, None));
    let took = started.elapsed();
    let _ = std::fs::remove_file(&path);
    match outcome {
        // Refused (a record the actor cannot take) or replayed: both are answers.
        Ok(replayed) => Case {
            replayed: replayed.ok().map(|r| r.report.stages_completed),
            took,
        },
        Err(_) => panic!(
            "case {seed} panicked; reproduce with: ROLLFLEET_FUZZ_SEED={seed} cargo test -p \
             rollfleet-server --test actor_fuzz"
        ),
    }
}

#[test]
fn replaying_journals_of_random_hostile_events_never_panics_and_always_finishes() {
    let seeds = rollfleet_rng::test_seeds("ROLLFLEET_FUZZ", 60);
    let mut slowest = (Duration::ZERO, 0);
    let (mut replayed, mut completed) = (0, 0);
    for &seed in &seeds {
        let case = run_case(seed);
        if case.took > slowest.0 {
            slowest = (case.took, seed);
        }
        if let Some(stages) = case.replayed {
            replayed += 1;
            completed += stages;
        }
    }
    eprintln!(
        "{} cases: {replayed} replayed to the end ({completed} stages completed in all), the \
         rest refused; slowest {:?} (case {})",
        seeds.len(),
        slowest.0,
        slowest.1
    );
    // A harness whose every journal is refused at its first record tests nothing of the
    // actor's handlers.
    if seeds.len() >= 20 {
        assert!(
            replayed * 2 >= seeds.len(),
            "only {replayed} of {} cases replayed",
            seeds.len()
        );
    }
    // A replay of 400 events that takes this long is a loop, not work.
    assert!(
        slowest.0 < Duration::from_secs(30),
        "case {} took {:?} to replay 400 events",
        slowest.1,
        slowest.0
    );
}

#[test]
fn the_fuzz_cases_are_the_same_for_the_same_seed() {
    // Compared encoded: the cases carry NaNs, which are never equal to themselves.
    let bytes = |seed| -> Vec<Vec<u8>> {
        journal(seed, 50)
            .1
            .iter()
            .map(prost::Message::encode_to_vec)
            .collect()
    };
    assert_eq!(bytes(11), bytes(11));
    assert_ne!(bytes(11), bytes(12));
}
