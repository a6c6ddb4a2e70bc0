//! The harness the runtime tests (`tests/runtime_*.rs`) share: a scheduler and workers spawned
//! as real `rollfleet` processes on loopback, the quick-start job cut to a few steps, bounded
//! waits on the scheduler's log, on a job's status over gRPC and on its metrics, a bare gRPC peer
//! and the trainer feed's calls, and the checks of a finished job's report and journal.

#![allow(dead_code)] // each test file includes this module and uses part of it

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::worker_service_client::WorkerServiceClient;
use rollfleet_proto::v1::{HardwareInventory, JobRef, RegisterRequest};
use serde_json::Value;

#[path = "procs.rs"]
pub mod procs;
pub use procs::{Procs, wait_exit};

pub const BIN: &str = env!("CARGO_BIN_EXE_rollfleet");

pub const DEADLINE: Duration = Duration::from_secs(240);

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rollfleet-rt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The quick-start job cut to `steps` RL steps.
pub fn job_file(dir: &Path, steps: u32) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let yaml = std::fs::read_to_string(root.join("examples/jobs/quickstart.yaml")).unwrap();
    assert!(yaml.contains("steps: 5"));
    let yaml = yaml.replace("steps: 5", &format!("steps: {steps}"));
    let path = dir.join("job.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

include!("pools.rs");

/// Adds `extra` GPU pools to the quick-start job at `job` ([`with_gpu_pools`]).
pub fn add_gpu_pools(job: &Path, extra: usize) {
    let yaml = std::fs::read_to_string(job).unwrap();
    std::fs::write(job, with_gpu_pools(&yaml, extra)).unwrap();
}

/// Starts a scheduler on a free port; returns it and its URL.
pub fn scheduler(job: &Path, report: &Path, expect: usize, extra: &[&str]) -> (Child, String) {
    start_scheduler(job, report, expect, extra, Stdio::inherit())
}

/// [`scheduler`], with its log lines also sent to the receiver returned (and still printed).
pub fn scheduler_with_log(
    job: &Path,
    report: &Path,
    expect: usize,
) -> (Child, String, std::sync::mpsc::Receiver<String>) {
    let (mut child, url) = start_scheduler(job, report, expect, &[], Stdio::piped());
    let rx = tee_log(&mut child);
    (child, url, rx)
}

/// The log lines of a child spawned with its stderr piped, sent to the receiver returned (and
/// still printed).
pub fn tee_log(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Spawns `rollfleet scheduler` with its log going to `stderr`, and reads the address it
/// listens on from the first line of its output.
pub fn start_scheduler(
    job: &Path,
    report: &Path,
    expect: usize,
    extra: &[&str],
    stderr: Stdio,
) -> (Child, String) {
    let mut command = Command::new(BIN);
    command.arg("scheduler").arg(job);
    spawn_scheduler(&mut command, report, expect, extra, stderr)
}

/// Spawns the `rollfleet scheduler` command (its job, if any, already given) on a free port,
/// unless `extra` says `--listen`.
pub fn spawn_scheduler(
    command: &mut Command,
    report: &Path,
    expect: usize,
    extra: &[&str],
    stderr: Stdio,
) -> (Child, String) {
    if !extra.contains(&"--listen") {
        command.args(["--listen", "127.0.0.1:0"]);
    }
    let mut child = command
        .args(["--time-scale", "1", "--lease-ms", "2000"])
        .args(["--expect-workers", &expect.to_string()])
        .arg("--report")
        .arg(report)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_owned();
    (child, format!("http://{addr}"))
}

/// Waits for a log line containing `text`.
pub fn wait_log(log: &std::sync::mpsc::Receiver<String>, text: &str) {
    let start = Instant::now();
    loop {
        let left = DEADLINE.saturating_sub(start.elapsed());
        match log.recv_timeout(left) {
            Ok(line) if line.contains(text) => return,
            Ok(_) => {}
            Err(e) => panic!("no log line with {text:?} within {DEADLINE:?}: {e}"),
        }
    }
}

/// A worker that declares how many GPUs its node brings (`--gpus`).
pub fn worker_declaring_gpus(url: &str, pool: &str, name: &str, gpus: u32) -> Child {
    Command::new(BIN)
        .args(["worker", "--scheduler", url, "--pool", pool, "--name", name])
        .args(["--gpus", &gpus.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

pub fn worker(url: &str, pool: &str, name: &str) -> Child {
    Command::new(BIN)
        .args(["worker", "--scheduler", url, "--pool", pool, "--name", name])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Polls the job's status until `done` says so.
pub fn wait_status(url: &str, what: &str, done: impl Fn(&rollfleet_proto::v1::JobStatus) -> bool) {
    rt().block_on(async {
        let start = Instant::now();
        let mut client = loop {
            match JobServiceClient::connect(url.to_owned()).await {
                Ok(c) => break c,
                Err(_) if start.elapsed() < DEADLINE => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("cannot reach {url}: {e}"),
            }
        };
        loop {
            let status = client
                .status(JobRef {
                    job: "quickstart".into(),
                })
                .await
                .unwrap()
                .into_inner();
            if done(&status) {
                return;
            }
            assert!(start.elapsed() < DEADLINE, "never saw {what}: {status:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// The trajectories a report says were trained, in order.
pub fn trained(report: &Value) -> Vec<u64> {
    report["trained"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// Checks that every trajectory of every step was trained exactly once.
pub fn check_report(report: &Path, steps: u64, min_lost: usize) -> Value {
    let report: Value = serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap();
    assert_eq!(report["phase"], "Succeeded", "{report:#}");
    assert_eq!(report["policy_version"], steps);
    let trained = trained(&report);
    // rolloutBatchSize 32 per step.
    assert_eq!(trained.len() as u64, 32 * steps, "{report:#}");
    let mut unique = trained.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        trained.len(),
        "a trajectory was trained twice"
    );
    assert_eq!(report["trained_twice"].as_array().unwrap().len(), 0);
    let lost = report["workers_lost"].as_array().unwrap();
    assert!(lost.len() >= min_lost, "{report:#}");
    report
}

/// A report without the dispatch latencies, which only a live run measures.
pub fn decisions(report: &Value) -> Value {
    let mut report = report.clone();
    report["dispatch_p50_us"] = Value::Null;
    report["dispatch_p99_us"] = Value::Null;
    report
}

/// Checks that `rollfleet journal show` replays `journal` offline to `report`, bit for bit but
/// for the dispatch latencies.
pub fn assert_journal_replays_to(journal: &Path, report: &Value) {
    let out = Command::new(BIN)
        .args(["journal", "show"])
        .arg(journal)
        .args(["-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(decisions(&shown["report"]), decisions(report));
}

/// Registers a test peer (a gRPC client with no worker process behind it) and returns its
/// lease.
pub async fn register_peer(
    client: &mut WorkerServiceClient<tonic::transport::Channel>,
    inventory: HardwareInventory,
) -> rollfleet_proto::v1::Lease {
    client
        .register(RegisterRequest {
            inventory: Some(inventory),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap()
}

/// Opens the work stream of the lease `client` registered: says hello with the lease, and gives
/// the sender of the peer's messages and the stream of the scheduler's.
pub async fn open_work_stream(
    client: &mut WorkerServiceClient<tonic::transport::Channel>,
    lease: &rollfleet_proto::v1::Lease,
) -> (
    tokio::sync::mpsc::UnboundedSender<rollfleet_proto::v1::WorkerMessage>,
    tonic::Streaming<rollfleet_proto::v1::SchedulerMessage>,
) {
    use rollfleet_proto::v1::{WorkerHello, WorkerMessage, worker_message};
    let (outbox, rx) = tokio::sync::mpsc::unbounded_channel();
    outbox
        .send(WorkerMessage {
            message: Some(worker_message::Message::Hello(WorkerHello {
                worker_id: lease.worker_id.clone(),
                epoch: lease.epoch,
            })),
        })
        .unwrap();
    let inbound = client
        .work(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (outbox, inbound)
}

pub fn subscribe(resume_from: u64, window: u32) -> rollfleet_proto::v1::TrainerFeedRequest {
    use rollfleet_proto::v1::{FeedSubscribe, TrainerFeedRequest, trainer_feed_request};
    TrainerFeedRequest {
        message: Some(trainer_feed_request::Message::Subscribe(FeedSubscribe {
            job: "quickstart".into(),
            resume_from,
            window,
        })),
    }
}

pub fn ack(through: u64) -> rollfleet_proto::v1::TrainerFeedRequest {
    use rollfleet_proto::v1::{TrainerFeedRequest, trainer_feed_request};
    TrainerFeedRequest {
        message: Some(trainer_feed_request::Message::AckThrough(through)),
    }
}

/// Runs `rollfleet job ARGS --scheduler URL`.
pub fn job_command(url: &str, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("job")
        .args(args)
        .args(["--scheduler", url])
        .output()
        .unwrap()
}

// ---------------------------------------------------------------- GPU telemetry

/// Lines a child writes on stderr, echoed to ours and kept for the test.
pub fn stderr_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            eprintln!("{line}");
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// Waits for a line containing `needle`; returns it.
pub fn wait_line(lines: &std::sync::mpsc::Receiver<String>, needle: &str) -> String {
    let start = Instant::now();
    loop {
        let left = DEADLINE.saturating_sub(start.elapsed());
        match lines.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return line,
            Ok(_) => {}
            Err(e) => panic!("never saw a line with {needle:?}: {e}"),
        }
    }
}

/// The address of the scheduler's metrics endpoint, from its log.
pub fn metrics_address(log: &std::sync::mpsc::Receiver<String>) -> String {
    let line = wait_line(log, "Prometheus metrics on http://");
    line.split("http://")
        .nth(1)
        .unwrap()
        .trim_end_matches("/metrics")
        .to_owned()
}

/// The scheduler's Prometheus exposition.
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: scheduler\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The value of the exposition's sample `name{labels}` (labels in the encoder's order), the
/// job's labels (`rljob`, `namespace`), which every sample carries, left out.
pub fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|l| {
        without_job_labels(l)
            .strip_prefix(series)?
            .strip_prefix(' ')?
            .parse()
            .ok()
    })
}

/// An exposition line without its `rljob` and `namespace` labels (no label value in these
/// tests holds a comma).
pub fn without_job_labels(line: &str) -> String {
    let (Some(open), Some(close)) = (line.find('{'), line.rfind('}')) else {
        return line.to_owned();
    };
    let kept: Vec<&str> = line[open + 1..close]
        .split(',')
        .filter(|pair| !pair.starts_with("rljob=") && !pair.starts_with("namespace="))
        .collect();
    let labels = if kept.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", kept.join(","))
    };
    format!("{}{labels}{}", &line[..open], &line[close + 1..])
}

/// What `promtool check metrics` says of an exposition (nothing: it is clean); fails the test if
/// promtool cannot run.
pub fn promtool_check_metrics(exposition: &str) -> String {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `promtool` ({e}): install Prometheus 2.x (Debian: `apt-get install \
                 prometheus`; .ci/run does)"
            )
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{said}"
    );
    said.trim().to_owned()
}
