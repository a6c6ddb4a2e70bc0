//! Dispatch benchmark: the scheduler server under a load of instant workers over gRPC on loopback.
//!
//! The server runs the quick-start job stretched to many RL steps; one in-process client per pool
//! registers, opens its work stream and answers every assignment at once with a plausible outcome
//! (tokens generated, an observation, episodes of six turns, a reward), so the only limit is the
//! scheduler: the core, the actor, tonic and the loopback. Server and clients share the machine's
//! cores, on their own threads. Prints stage completions per second, the server's dispatch
//! latency (a worker message off the wire to every command it caused handed to the outboxes) and
//! the CPU time the scheduler's threads ran per completion (not the clients'), per run and the
//! median of
//! three runs (`ROLLFLEET_BENCH_RUNS` for more), without a journal, with one (`--journal`: every
//! event written to a file before it is acted on), with one synced to the disk before each
//! batch is acted on (`--journal-sync`), and over TLS (`--tls-cert`; its certificates made by
//! the `openssl` command, the runs left out without one), and with token-level payloads (every
//! generation answered with its token ids, log-probabilities and prompt ids, as the emulated
//! engine and real engines now answer; the other modes send counts only), the five interleaved
//! so that all see the same machine. Each journal is then replayed into a fresh actor, as a restarted scheduler does: how
//! fast, and whether it ends with the very report the live run wrote. `ROLLFLEET_BENCH_MODES`
//! (indices into the modes, e.g. `0,4`) runs only some of them.

/// The allocator the `rollfleet` binary runs the scheduler with.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use rollfleet_proto::v1::worker_service_client::WorkerServiceClient;
use rollfleet_proto::v1::{
    HardwareInventory, HeartbeatRequest, RegisterRequest, StageOutput, WorkResult, WorkerHello,
    WorkerMessage, scheduler_message, work_assignment::Work, work_result, worker_message,
};
use rollfleet_server::{Report, ServerOptions, serve};

const STEPS: u32 = 150;
/// The longest answer and prompt an instant worker sends token ids for.
const MAX_ANSWER: u32 = 48;
const MAX_PROMPT: u32 = 4096;

/// The packed token ids and log-probabilities an instant worker answers with (prefixes of these).
struct Payloads {
    tokens: prost::bytes::Bytes,
    logprobs: prost::bytes::Bytes,
    prompt: prost::bytes::Bytes,
}

impl Payloads {
    fn new() -> Payloads {
        use rollfleet_proto::packed::{pack_f32, pack_u32};
        let ids = |n: u32, stride: u32| (0..n).map(|i| i * stride % 151_936).collect::<Vec<_>>();
        let logprobs: Vec<f32> = (0..MAX_ANSWER).map(|i| -(i as f32) / 64.0).collect();
        Payloads {
            tokens: pack_u32(&ids(MAX_ANSWER, 7919)).into(),
            logprobs: pack_f32(&logprobs).into(),
            prompt: pack_u32(&ids(MAX_PROMPT, 104_729)).into(),
        }
    }
}

async fn instant_worker(
    url: String,
    pool: &'static str,
    ca: Option<std::path::PathBuf>,
    token_payloads: bool,
) {
    let channel = rollfleet_proto::tls::endpoint(&url, ca.as_deref(), None)
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut client = WorkerServiceClient::new(channel);
    let lease = client
        .register(RegisterRequest {
            inventory: Some(HardwareInventory {
                hostname: format!("bench-{pool}"),
                pool: pool.into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("register")
        .into_inner()
        .lease
        .expect("lease");
    let mut hb = client.clone();
    let id = lease.worker_id.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let beat = HeartbeatRequest {
                worker_id: id.clone(),
                epoch: 1,
                load: None,
            };
            if hb.heartbeat(beat).await.is_err() {
                return;
            }
        }
    });
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let hello = WorkerHello {
        worker_id: lease.worker_id,
        epoch: lease.epoch,
    };
    let _ = tx.send(WorkerMessage {
        message: Some(worker_message::Message::Hello(hello)),
    });
    let mut inbound = client
        .work(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .expect("work stream")
        .into_inner();
    let payloads = Payloads::new();
    while let Ok(Some(m)) = inbound.message().await {
        let a = match m.message {
            Some(scheduler_message::Message::Assign(a)) => a,
            Some(scheduler_message::Message::Drain(_)) => return,
            _ => continue,
        };
        let output = match &a.work {
            Some(Work::Generation(g)) => {
                let n = g.max_new_tokens.clamp(1, MAX_ANSWER);
                let mut output = StageOutput {
                    token_count: u64::from(n),
                    emulated: true,
                    ..Default::default()
                };
                if token_payloads {
                    // Packed, as the node worker sends them; slices of payloads made once, so
                    // that the worker's own cost stays out of the scheduler's figure.
                    let prompt = g.new_message_tokens.min(u64::from(MAX_PROMPT)) as usize;
                    output.packed_tokens = payloads.tokens.slice(..4 * n as usize);
                    output.packed_logprobs = payloads.logprobs.slice(..4 * n as usize);
                    output.packed_prompt_tokens = payloads.prompt.slice(..4 * prompt);
                }
                output
            }
            Some(Work::EnvStep(e)) => StageOutput {
                token_count: if e.reset { 200 } else { 60 },
                done: !e.reset && a.turn >= 5,
                text: "up".into(),
                ..Default::default()
            },
            Some(Work::Reward(_)) => StageOutput {
                reward: 1.0,
                ..Default::default()
            },
            _ => StageOutput::default(),
        };
        let result = WorkResult {
            assignment_id: a.assignment_id,
            outcome: Some(work_result::Outcome::Output(output)),
            duration_us: 0,
        };
        if tx
            .send(WorkerMessage {
                message: Some(worker_message::Message::Result(result)),
            })
            .is_err()
        {
            return;
        }
    }
}

/// Replays the journal at `path` as a scheduler restarted on it does; returns the records
/// replayed, the seconds it took, and the report the replay leaves.
fn replay(path: &std::path::Path) -> (u64, f64, Report) {
    let started = Instant::now();
    let replayed = rollfleet_server::replay_journal(path, None).expect("the journal replays");
    (
        replayed.records,
        started.elapsed().as_secs_f64(),
        replayed.report,
    )
}

/// A report as JSON without the dispatch latencies, which only a live run measures.
fn decisions(report: &Report) -> serde_json::Value {
    let mut value = serde_json::to_value(report).expect("a report is JSON");
    value["dispatch_p50_us"] = serde_json::Value::Null;
    value["dispatch_p99_us"] = serde_json::Value::Null;
    value
}

/// The five ways the benchmark runs the scheduler.
const MODES: [&str; 5] = [
    "no journal",
    "journal",
    "journal, synced",
    "TLS, no journal",
    "no journal, token payloads",
];

/// A TLS identity for the scheduler and the CA its clients trust.
struct TlsFiles {
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    ca: std::path::PathBuf,
}

/// A CA and a certificate for 127.0.0.1 made by the `openssl` command in `dir`; `None` when
/// there is no such command (the TLS runs are then left out, and the output says so).
fn tls_files(dir: &std::path::Path) -> Option<TlsFiles> {
    let run = |args: &[&str]| {
        std::process::Command::new("openssl")
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let p = |name: &str| dir.join(name).display().to_string();
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .ok()?;
    let ec = "ec_paramgen_curve:prime256v1";
    let made = run(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        ec,
        "-nodes",
        "-keyout",
        &p("ca.key"),
        "-out",
        &p("ca.pem"),
        "-days",
        "1",
        "-subj",
        "/CN=bench CA",
    ]) && run(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        ec,
        "-nodes",
        "-keyout",
        &p("server.key"),
        "-out",
        &p("server.csr"),
        "-subj",
        "/CN=scheduler",
    ]) && run(&[
        "x509",
        "-req",
        "-in",
        &p("server.csr"),
        "-CA",
        &p("ca.pem"),
        "-CAkey",
        &p("ca.key"),
        "-CAcreateserial",
        "-out",
        &p("server.pem"),
        "-days",
        "1",
        "-extfile",
        &p("san.ext"),
    ]);
    made.then(|| TlsFiles {
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
        ca: dir.join("ca.pem"),
    })
}

/// The names of the threads the scheduler runs on, and of the load generator's.
const SCHEDULER_THREADS: &str = "rf-scheduler";
const WORKER_THREADS: &str = "rf-bench-worker";

/// CPU time (ns) the threads of this process named `name` have run so far, from
/// `/proc/self/task/*/schedstat` (Linux; `None` elsewhere).
fn threads_cpu_ns(name: &str) -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        total += stat
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(total)
}

/// One run: its stage completions per second, the scheduler's CPU per completion (µs, its own
/// threads only: not the load generator's, which shares the machine), and its report.
fn run_once(
    journal: Option<std::path::PathBuf>,
    journal_sync: bool,
    tls: Option<&TlsFiles>,
    token_payloads: bool,
) -> (f64, Option<f64>, Report) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(SCHEDULER_THREADS)
        .enable_all()
        .build()
        .expect("runtime");
    // The instant workers run on their own threads, so that the scheduler's CPU can be told
    // from theirs.
    let workers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(WORKER_THREADS)
        .enable_all()
        .build()
        .expect("runtime");
    let root = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/jobs/quickstart.yaml"
    );
    let yaml = std::fs::read_to_string(root)
        .expect("quickstart.yaml")
        .replace("steps: 5", &format!("steps: {STEPS}"));
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!(
            "{}://{}",
            if tls.is_some() { "https" } else { "http" },
            listener.local_addr().expect("addr")
        );
        let pools = ["prefill", "decode", "train", "envs", "rewards"];
        let opts = ServerOptions {
            job_yaml: Some(yaml),
            origin: "bench".into(),
            seed: 0,
            time_scale: 1.0,
            lease_ttl: Duration::from_secs(10),
            expect_workers: pools.len(),
            stage_timeout: Duration::from_secs(120),
            report: None,
            metrics_addr: None,
            replan_on_drift: None,
            token: None,
            journal,
            tls: tls.map(|t| (t.cert.clone(), t.key.clone())),
            tls_client_ca: None,
            journal_sync,
            until_stopped: false,
            weights_root: None,
            window_chooser: None,
        };
        let server = tokio::spawn(serve(listener, opts));
        for pool in pools {
            workers.spawn(instant_worker(
                url.clone(),
                pool,
                tls.map(|t| t.ca.clone()),
                token_payloads,
            ));
        }
        let report = server
            .await
            .expect("server task")
            .expect("server")
            .expect("a report: the job was given at start");
        let rate = report.stages_completed as f64 / report.wall_s.max(1e-9);
        let cpu_us = threads_cpu_ns(SCHEDULER_THREADS)
            .map(|ns| ns as f64 / 1e3 / report.stages_completed.max(1) as f64);
        (rate, cpu_us, report)
    })
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` run does one short pass.
    // `ROLLFLEET_BENCH_RUNS` asks for more runs of each.
    let runs = if std::env::args().any(|a| a == "--bench") {
        std::env::var("ROLLFLEET_BENCH_RUNS")
            .ok()
            .and_then(|r| r.parse::<usize>().ok())
            .filter(|&r| r > 0)
            .unwrap_or(3)
    } else {
        1
    };
    let dir = std::env::temp_dir().join(format!("rollfleet-dispatch-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let tls = tls_files(&dir);
    if tls.is_none() {
        println!("no openssl command: the TLS runs are left out");
    }
    // `ROLLFLEET_BENCH_MODES=0,4` runs only those modes (indices into `MODES`), e.g. to profile
    // one.
    let only: Option<Vec<usize>> = std::env::var("ROLLFLEET_BENCH_MODES")
        .ok()
        .map(|m| m.split(',').filter_map(|i| i.trim().parse().ok()).collect());
    let mut results: [(Vec<f64>, Vec<u32>, Vec<f64>); 5] = Default::default();
    for i in 0..runs {
        for (mode, (rates, p99s, cpus)) in results.iter_mut().enumerate() {
            if (mode == 3 && tls.is_none()) || only.as_ref().is_some_and(|o| !o.contains(&mode)) {
                continue;
            }
            let journal =
                (mode == 1 || mode == 2).then(|| dir.join(format!("run-{i}-{mode}.journal")));
            let (rate, cpu_us, r) = run_once(
                journal.clone(),
                mode == 2,
                tls.as_ref().filter(|_| mode == 3),
                mode == 4,
            );
            let journal_bytes = journal
                .as_ref()
                .and_then(|p| std::fs::metadata(p).ok())
                .map_or(String::new(), |m| {
                    format!("; journal {:.1} MB", m.len() as f64 / 1e6)
                });
            let cpu = cpu_us.map_or(String::new(), |us| {
                format!("; the scheduler's threads ran {us:.2} us of CPU per completion")
            });
            println!(
                "run {} ({}): {} stages in {:.2} s = {:.0} stage completions/s over gRPC; dispatch latency p50 {} us, p99 {} us; {} trajectories trained ({} twice){journal_bytes}{cpu}",
                i + 1,
                MODES[mode],
                r.stages_completed,
                r.wall_s,
                rate,
                r.dispatch_p50_us,
                r.dispatch_p99_us,
                r.trained.len(),
                r.trained_twice.len()
            );
            rates.push(rate);
            p99s.push(r.dispatch_p99_us);
            cpus.extend(cpu_us);
            if let Some(path) = &journal {
                let (records, seconds, again) = replay(path);
                assert_eq!(
                    decisions(&again),
                    decisions(&r),
                    "the replayed journal ends with another report than the live run's"
                );
                println!(
                    "run {} ({}): planned the job and replayed {records} records in {seconds:.3} s = {:.0} records/s, to the live run's report",
                    i + 1,
                    MODES[mode],
                    records as f64 / seconds.max(1e-9)
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    for (mode, (rates, p99s, cpus)) in results.iter_mut().enumerate() {
        if rates.is_empty() {
            continue;
        }
        rates.sort_by(f64::total_cmp);
        p99s.sort_unstable();
        cpus.sort_by(f64::total_cmp);
        let cpu = cpus.get(cpus.len() / 2).map_or(String::new(), |us| {
            format!(", scheduler CPU {us:.2} us per completion")
        });
        println!(
            "median of {runs} ({}): {:.0} stage completions/s, dispatch p99 {} us{cpu}",
            MODES[mode],
            rates[rates.len() / 2],
            p99s[p99s.len() / 2]
        );
    }
}
