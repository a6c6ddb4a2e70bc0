//! The distributed runtime across real processes on loopback: a `rollfleet scheduler` and
//! several `rollfleet worker`s (emulated GPUs), with workers killed and peers misbehaving.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::worker_service_client::WorkerServiceClient;
use rollfleet_proto::v1::{
    GpuInventory, HardwareInventory, HeartbeatRequest, JobPhase, JobRef, RegisterRequest,
    StageOutput, WorkResult, WorkerHello, WorkerMessage, hardware_inventory, scheduler_message,
    work_result, worker_message,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_rollfleet");
const DEADLINE: Duration = Duration::from_secs(240);

#[path = "common/procs.rs"]
mod procs;
use procs::{Procs, wait_exit};
#[path = "common/refused.rs"]
mod refused;
use refused::assert_job_status_refused_without_token;
#[path = "common/tls.rs"]
mod tls;
use tls::tls_files;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rollfleet-rt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The quick-start job cut to `steps` RL steps.
fn job_file(dir: &Path, steps: u32) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let yaml = std::fs::read_to_string(root.join("examples/jobs/quickstart.yaml")).unwrap();
    assert!(yaml.contains("steps: 5"));
    let yaml = yaml.replace("steps: 5", &format!("steps: {steps}"));
    let path = dir.join("job.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Starts a scheduler on a free port; returns it and its URL.
fn scheduler(job: &Path, report: &Path, expect: usize, extra: &[&str]) -> (Child, String) {
    start_scheduler(job, report, expect, extra, Stdio::inherit())
}

/// [`scheduler`], with its log lines also sent to the receiver returned (and still printed).
fn scheduler_with_log(
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
fn tee_log(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
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
fn start_scheduler(
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
fn spawn_scheduler(
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
fn wait_log(log: &std::sync::mpsc::Receiver<String>, text: &str) {
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
fn worker_declaring_gpus(url: &str, pool: &str, name: &str, gpus: u32) -> Child {
    Command::new(BIN)
        .args(["worker", "--scheduler", url, "--pool", pool, "--name", name])
        .args(["--gpus", &gpus.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn worker(url: &str, pool: &str, name: &str) -> Child {
    Command::new(BIN)
        .args(["worker", "--scheduler", url, "--pool", pool, "--name", name])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Polls the job's status until `done` says so.
fn wait_status(url: &str, what: &str, done: impl Fn(&rollfleet_proto::v1::JobStatus) -> bool) {
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

/// Waits for the scheduler to succeed, checks its report (`steps` steps, at least one worker
/// lost) and returns it with its two re-plans: the loss's and the join's.
fn loss_and_join(scheduler: &mut Child, report: &Path, steps: u64) -> (Value, Value, Value) {
    let status = wait_exit(scheduler, DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    let report = check_report(report, steps, 1);
    let replans = report["replans"].as_array().unwrap();
    assert_eq!(
        replans.len(),
        2,
        "a re-plan on the loss and one on the join: {report:#}"
    );
    let (loss, join) = (replans[0].clone(), replans[1].clone());
    (report, loss, join)
}

/// The trajectories a report says were trained, in order.
fn trained(report: &Value) -> Vec<u64> {
    report["trained"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// Checks that every trajectory of every step was trained exactly once.
fn check_report(report: &Path, steps: u64, min_lost: usize) -> Value {
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

#[test]
fn a_job_completes_with_every_trajectory_once_after_workers_are_killed_mid_run() {
    let dir = temp_dir("kill");
    let job = job_file(&dir, 4);
    let report = dir.join("report.json");
    // One decode worker at the start, so it certainly holds the decode pool's replica; a spare
    // joins once the job runs, and takes the replica over when the first is killed.
    let pools = [
        ("prefill", 1),
        ("decode", 1),
        ("train", 1),
        ("envs", 2),
        ("rewards", 1),
    ];
    let expect: usize = pools.iter().map(|(_, n)| n).sum();
    let (sched, url) = scheduler(&job, &report, expect, &[]);
    let mut procs = Procs(vec![sched]);
    let mut victims = Vec::new();
    for (pool, n) in pools {
        for i in 0..n {
            let child = worker(&url, pool, &format!("{pool}-{i}"));
            if i == 0 && (pool == "decode" || pool == "envs") {
                victims.push(procs.0.len());
            }
            procs.0.push(child);
        }
    }
    wait_status(&url, "the job running", |s| s.phase() == JobPhase::Running);
    procs.0.push(worker(&url, "decode", "decode-1"));
    // Mid-run: trajectories are in flight, the spare is attached, and the job is not over.
    wait_status(&url, "trajectories in flight and the spare attached", |s| {
        s.trajectories_in_flight > 0
            && s.trajectories_completed > 0
            && s.pools.iter().any(|p| p.pool == "decode" && p.workers == 2)
    });
    for v in victims {
        // SIGKILL: no goodbye; the scheduler learns from the broken stream or the lease.
        procs.0[v].kill().unwrap();
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    let report = check_report(&report, 4, 2);
    // The killed decode worker's replica went to the spare (its stages were redone there); the
    // killed environment worker's stages, if it held any at that instant, were retried.
    assert!(
        report["replicas_moved"].as_u64().unwrap() >= 1,
        "killing the decode worker moved no replica: {report:#}"
    );
}

#[test]
fn workers_told_to_stop_mid_run_leave_once_their_work_is_done_and_nothing_of_theirs_is_lost() {
    let dir = temp_dir("leave");
    let job = job_file(&dir, 4);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 6, &[]);
    let mut procs = Procs(vec![sched]);
    // The decode node that will go declares the pool's two GPUs, so it holds the decode replica.
    procs
        .0
        .push(worker_declaring_gpus(&url, "decode", "decode-0", 2));
    let leaving_decode = 1;
    for (pool, name) in [
        ("prefill", "prefill-0"),
        ("train", "train-0"),
        ("envs", "envs-0"),
        ("envs", "envs-1"),
        ("rewards", "rewards-0"),
    ] {
        procs.0.push(worker(&url, pool, name));
    }
    let leaving_envs = 4;
    wait_status(&url, "the job running", |s| s.phase() == JobPhase::Running);
    // A second decode node, with room for the replica.
    procs
        .0
        .push(worker_declaring_gpus(&url, "decode", "decode-1", 2));
    wait_status(
        &url,
        "trajectories in flight and the second decode node attached",
        |s| {
            s.trajectories_in_flight > 0
                && s.trajectories_completed > 0
                && s.pools.iter().any(|p| p.pool == "decode" && p.workers == 2)
        },
    );
    // SIGTERM, as a node drain or a spot instance's notice sends it: the worker says it is
    // leaving, finishes what it runs, and exits 0 when the scheduler releases it.
    for &victim in &[leaving_decode, leaving_envs] {
        let pid = procs.0[victim].id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success());
    }
    for &victim in &[leaving_decode, leaving_envs] {
        let exit = wait_exit(&mut procs.0[victim], DEADLINE);
        assert!(
            exit.success(),
            "a leaving worker was not released: {exit:?}"
        );
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    let report = check_report(&report, 4, 0);
    assert_eq!(
        report["workers_lost"].as_array().unwrap().len(),
        0,
        "a leaving worker was lost: {report:#}"
    );
    let left: Vec<&str> = report["workers_left"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    assert_eq!(left.len(), 2, "{report:#}");
    assert!(
        left.iter().any(|w| w.contains("decode@decode-0"))
            && left.iter().any(|w| w.contains("envs@envs-0")),
        "{left:?}"
    );
    // The decode node's going was planned for: its replica retired, one started on the other.
    let replans = report["replans"].as_array().unwrap();
    assert!(
        replans.iter().any(|r| r["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("is leaving")
            && r["replicas_started"].as_u64().unwrap_or(0) >= 1),
        "{replans:#?}"
    );
}

#[test]
fn the_only_decode_node_leaving_waits_for_the_next_one_which_gets_the_replicas_and_the_job_ends() {
    let dir = temp_dir("leave-alone");
    let job = job_file(&dir, 3);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    procs
        .0
        .push(worker_declaring_gpus(&url, "decode", "decode-0", 2));
    for pool in ["prefill", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    wait_status(&url, "trajectories in flight", |s| {
        s.trajectories_in_flight > 0 && s.trajectories_completed > 0
    });
    let pid = procs.0[1].id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success());
    let exit = wait_exit(&mut procs.0[1], DEADLINE);
    assert!(
        exit.success(),
        "the leaving decode node was not released: {exit:?}"
    );
    // No decode node now: the job waits, and goes on when one joins.
    procs
        .0
        .push(worker_declaring_gpus(&url, "decode", "decode-1", 2));
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    let report = check_report(&report, 3, 0);
    assert_eq!(
        report["workers_lost"].as_array().unwrap().len(),
        0,
        "{report:#}"
    );
    assert_eq!(
        report["workers_left"].as_array().unwrap().len(),
        1,
        "{report:#}"
    );
}

/// The TLS flags of a client (`--tls-ca`, and `--tls-cert`/`--tls-key` when given).
fn tls_flags(ca: Option<&Path>, identity: Option<(&Path, &Path)>) -> Vec<std::ffi::OsString> {
    let mut flags = Vec::new();
    if let Some(ca) = ca {
        flags.extend(["--tls-ca".into(), ca.into()]);
    }
    if let Some((cert, key)) = identity {
        flags.extend([
            "--tls-cert".into(),
            cert.into(),
            "--tls-key".into(),
            key.into(),
        ]);
    }
    flags
}

/// `rollfleet job status quickstart -o json` at `url` with the client TLS `flags`.
fn status_with(url: &str, flags: &[std::ffi::OsString]) -> std::process::Output {
    Command::new(BIN)
        .args(["job", "status", "quickstart", "--scheduler", url])
        .args(["-o", "json"])
        .args(flags)
        .output()
        .unwrap()
}

/// A worker of `pool` for the scheduler at `url`, with the client TLS `flags`.
fn worker_with(url: &str, pool: &str, name: &str, flags: &[std::ffi::OsString]) -> Child {
    Command::new(BIN)
        .args(["worker", "--scheduler", url, "--pool", pool, "--name", name])
        .args(flags)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Starts the five workers of the quick-start with `flags` and waits, reading the status with
/// the same flags, until all are attached (the job, expecting six, has not started).
fn five_workers_attached(procs: &mut Procs, url: &str, flags: &[std::ffi::OsString]) {
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs
            .0
            .push(worker_with(url, pool, &format!("{pool}-0"), flags));
    }
    let start = Instant::now();
    loop {
        let out = status_with(url, flags);
        assert!(out.status.success(), "{out:?}");
        let said: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(said["phase"], "Pending", "{said:#}");
        let workers: u64 = said["pools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["workers"].as_u64().unwrap())
            .sum();
        if workers == 5 {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the workers never attached over TLS: {said:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_scheduler_serving_tls_runs_a_job_for_workers_that_trust_its_ca_and_refuses_other_clients() {
    let dir = temp_dir("tls");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (ca, cert, key) = tls_files(&dir, "good");
    let (other_ca, _, _) = tls_files(&dir, "other");
    // Six workers expected: the job waits for the last one until the clients below are checked.
    let (sched, plain) = scheduler(
        &job,
        &report,
        6,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let url = plain.replace("http://", "https://");
    let mut procs = Procs(vec![sched]);
    // A client that trusts the CA reads the status; the five workers got through too.
    let trusting = tls_flags(Some(&ca), None);
    five_workers_attached(&mut procs, &url, &trusting);
    // One that trusts another CA does not get through the handshake; nor does plain HTTP/2.
    let out = status_with(&url, &tls_flags(Some(&other_ca), None));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach the scheduler"),
        "{out:?}"
    );
    let out = status_with(&plain, &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    // An https:// URL without a CA, or a CA with a plain URL, is the user's mistake, said so.
    let out = status_with(&url, &[]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs --tls-ca"),
        "{out:?}"
    );
    procs.0.push(worker_with(&url, "envs", "envs-1", &trusting));
    let exit = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(exit.success(), "the scheduler failed: {exit:?}");
    check_report(&report, 2, 0);
}

#[test]
fn a_scheduler_requiring_client_certificates_serves_only_the_clients_that_present_one_it_trusts() {
    let dir = temp_dir("mtls");
    let job = job_file(&dir, 1);
    let report = dir.join("report.json");
    let (ca, cert, key) = tls_files(&dir, "good");
    let (client_cert, client_key) = tls::client_files(&dir, "good");
    let _ = tls_files(&dir, "other");
    let (stranger_cert, stranger_key) = tls::client_files(&dir, "other");
    // Six workers expected: the job waits for the last one until the clients below are checked.
    let (sched, plain) = scheduler(
        &job,
        &report,
        6,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--tls-client-ca",
            ca.to_str().unwrap(),
        ],
    );
    let url = plain.replace("http://", "https://");
    let mut procs = Procs(vec![sched]);
    let trusted = tls_flags(Some(&ca), Some((&client_cert, &client_key)));
    five_workers_attached(&mut procs, &url, &trusted);
    // Without a certificate, or with one another CA signed, nothing gets through.
    for identity in [
        None,
        Some((stranger_cert.as_path(), stranger_key.as_path())),
    ] {
        let out = status_with(&url, &tls_flags(Some(&ca), identity));
        assert_eq!(out.status.code(), Some(1), "{identity:?}: {out:?}");
    }
    procs.0.push(worker_with(&url, "envs", "envs-1", &trusted));
    let exit = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(exit.success(), "the scheduler failed: {exit:?}");
    check_report(&report, 1, 0);
}

#[test]
fn under_mutual_tls_a_lease_is_refused_to_a_client_presenting_another_certificate() {
    let dir = temp_dir("mtls-lease");
    let job = job_file(&dir, 1);
    let report = dir.join("report.json");
    let (ca, cert, key) = tls_files(&dir, "good");
    let (made_cert, made_key) = tls::client_files(&dir, "good");
    let (a_cert, a_key) = (dir.join("a.pem"), dir.join("a.key"));
    std::fs::rename(&made_cert, &a_cert).unwrap();
    std::fs::rename(&made_key, &a_key).unwrap();
    // Another certificate the same CA signed: a client the scheduler trusts, but another node.
    let (b_cert, b_key) = tls::client_files(&dir, "good");
    // The job never starts (it waits for 100 workers): only the leases are tested.
    let (sched, plain) = scheduler(
        &job,
        &report,
        100,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--tls-client-ca",
            ca.to_str().unwrap(),
        ],
    );
    let _procs = Procs(vec![sched]);
    let url = plain.replace("http://", "https://");
    rt().block_on(async {
        let connect = |cert: PathBuf, key: PathBuf| {
            let endpoint =
                rollfleet_proto::tls::endpoint(&url, Some(&ca), Some((&cert, &key))).unwrap();
            async move { WorkerServiceClient::new(endpoint.connect().await.unwrap()) }
        };
        let mut a = connect(a_cert.clone(), a_key.clone()).await;
        let lease = register_peer(
            &mut a,
            HardwareInventory {
                hostname: "node-a".into(),
                pool: "envs".into(),
                ..Default::default()
            },
        )
        .await;
        let beat = || HeartbeatRequest {
            worker_id: lease.worker_id.clone(),
            epoch: lease.epoch,
            load: None,
        };
        let mut b = connect(b_cert.clone(), b_key.clone()).await;
        let refused = b.heartbeat(beat()).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
        let number = lease.worker_id.split_once('-').unwrap().0;
        assert!(
            refused.message().contains(&format!(
                "lease {number} is bound to the client certificate"
            )),
            "{refused:?}"
        );
        // Node A, on a new connection with its own certificate (as after a network blip), keeps
        // its lease.
        let mut again = connect(a_cert.clone(), a_key.clone()).await;
        again.heartbeat(beat()).await.unwrap();
    });
}

/// The quick-start job cut to `steps` RL steps, with its decode pool as two nodes of two H20s
/// (one TP2 decode replica on each).
fn two_node_decode_job(dir: &Path, steps: u32) -> PathBuf {
    let job = job_file(dir, steps);
    let yaml = std::fs::read_to_string(&job).unwrap();
    let decode = "      gpu: H20\n      count: 2\n";
    assert!(yaml.contains(decode));
    std::fs::write(
        &job,
        yaml.replace(
            decode,
            "      gpu: H20\n      count: 4\n      gpusPerNode: 2\n",
        ),
    )
    .unwrap();
    job
}

#[test]
fn a_lost_decode_node_is_planned_around_and_a_node_that_joins_gets_replicas_of_the_new_plan() {
    let dir = temp_dir("replan");
    // The quick-start job, long enough to lose a node and gain one mid-run, with its decode
    // pool as two nodes of two H20s: one TP2 decode replica on each.
    let job = two_node_decode_job(&dir, 24);
    let report = dir.join("report.json");
    let pools = [
        ("prefill", 1),
        ("decode", 2),
        ("train", 1),
        ("envs", 1),
        ("rewards", 1),
    ];
    let expect: usize = pools.iter().map(|(_, n)| n).sum();
    // Synced to the disk before each batch is acted on: the same journal, the slower path.
    let journal = dir.join("scheduler.journal");
    let (sched, url) = scheduler(
        &job,
        &report,
        expect,
        &["--journal", journal.to_str().unwrap(), "--journal-sync"],
    );
    let mut procs = Procs(vec![sched]);
    let mut victim = 0;
    for (pool, n) in pools {
        for i in 0..n {
            if (pool, i) == ("decode", 0) {
                victim = procs.0.len();
            }
            procs.0.push(worker(&url, pool, &format!("{pool}-{i}")));
        }
    }
    wait_status(&url, "the first step trained", |s| s.policy_version >= 1);
    procs.0[victim].kill().unwrap();
    wait_status(&url, "the decode node's loss noticed", |s| {
        s.pools.iter().any(|p| p.pool == "decode" && p.workers == 1)
    });
    // The new node says how many GPUs it brings (the first two are counted as an equal share of
    // the pool's four).
    procs
        .0
        .push(worker_declaring_gpus(&url, "decode", "decode-2", 2));
    let (report, loss, join) = loss_and_join(&mut procs.0[0], &report, 24);
    // The loss: two GPUs left, the replica on the lost node retired with it.
    assert_eq!(loss["pool"], "decode");
    assert_eq!(
        (loss["gpus_before"].as_u64(), loss["gpus_after"].as_u64()),
        (Some(4), Some(2))
    );
    assert_eq!(loss["replicas_lost"], 1, "{loss:#}");
    // The join: four GPUs again, and the new plan's replica started on the new node, loaded
    // with the weights, before the job ended.
    assert_eq!(
        (join["gpus_before"].as_u64(), join["gpus_after"].as_u64()),
        (Some(2), Some(4))
    );
    assert!(
        join["planned_step_s"].as_f64().unwrap() < join["running_step_s"].as_f64().unwrap(),
        "{join:#}"
    );
    assert!(join["replicas_started"].as_u64().unwrap() >= 1, "{join:#}");
    assert_eq!(join["waves_done"], join["waves"], "{join:#}");
    let done = join["done_at_s"]
        .as_f64()
        .expect("the move to the new plan ended");
    assert!(done < report["wall_s"].as_f64().unwrap(), "{report:#}");
    // Through the loss, both re-plans, the waves and the join, the journal replays to this
    // very report.
    assert_journal_replays_to(&journal, &report);
}

#[test]
fn a_job_replanned_before_a_scheduler_failover_resumes_and_no_weight_update_fails_on_a_replica_its_worker_never_started()
 {
    let dir = temp_dir("replan-failover");
    // Decode as two nodes of two H20s; one is lost, and the re-plan on a node that joins starts
    // replicas of the new plan there (as in the re-plan test above).
    let job = two_node_decode_job(&dir, 24);
    let report = dir.join("report.json");
    let journal = dir.join("scheduler.journal");
    let journal = journal.to_str().unwrap();
    let flags = ["--journal", journal];
    let (mut sched, url) = start_scheduler(&job, &report, 6, &flags, Stdio::piped());
    let log = tee_log(&mut sched);
    let addr = url.strip_prefix("http://").unwrap().to_owned();
    let mut procs = Procs(vec![sched]);
    let mut victim = 0;
    for (pool, n) in [
        ("prefill", 1),
        ("decode", 2),
        ("train", 1),
        ("envs", 1),
        ("rewards", 1),
    ] {
        for i in 0..n {
            if (pool, i) == ("decode", 0) {
                victim = procs.0.len();
            }
            procs.0.push(worker(&url, pool, &format!("{pool}-{i}")));
        }
    }
    wait_status(&url, "the first step trained", |s| s.policy_version >= 1);
    procs.0[victim].kill().unwrap();
    wait_status(&url, "the decode node's loss noticed", |s| {
        s.pools.iter().any(|p| p.pool == "decode" && p.workers == 1)
    });
    procs
        .0
        .push(worker_declaring_gpus(&url, "decode", "decode-2", 2));
    wait_log(&log, "starts on worker");
    // SIGKILL once a re-plan's replica was started: the restarted scheduler hands it to a
    // decode worker that registers again, which never heard of it from this scheduler.
    procs.0[0].kill().unwrap();
    procs.0[0].wait().unwrap();
    let mut command = Command::new(BIN);
    command.arg("scheduler").arg(&job);
    let mut resume_flags = flags.to_vec();
    resume_flags.extend(["--listen", &addr]);
    let (mut sched, _) = spawn_scheduler(&mut command, &report, 6, &resume_flags, Stdio::piped());
    let log = tee_log(&mut sched);
    procs.0[0] = sched;
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the resumed scheduler failed: {status:?}");
    let lines: Vec<String> = log.try_iter().collect();
    assert!(
        lines.iter().any(|l| l.contains("moves to worker")),
        "no replica was handed to a worker that registered again after the restart"
    );
    let report = check_report(&report, 24, 1);
    // Every replica a worker is sent weights for is one it serves: none fails as unknown to
    // the worker, and none is retried in a loop.
    assert_eq!(report["weight_update_failures"], 0, "{report:#}");
    assert!(
        !lines.iter().any(|l| l.contains("no replica")),
        "a worker was sent work for a replica it was never told to start"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A report without the dispatch latencies, which only a live run measures.
fn decisions(report: &Value) -> Value {
    let mut report = report.clone();
    report["dispatch_p50_us"] = Value::Null;
    report["dispatch_p99_us"] = Value::Null;
    report
}

/// Checks that `rollfleet journal show` replays `journal` offline to `report`, bit for bit but
/// for the dispatch latencies.
fn assert_journal_replays_to(journal: &Path, report: &Value) {
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

#[test]
fn a_lost_node_of_the_pool_the_trainer_shares_shrinks_the_trainer_and_a_node_that_joins_grows_it_back()
 {
    let dir = temp_dir("trainer-resize");
    // The quick-start job with training and generation sharing one pool of 8 H800s, four nodes
    // of two: the plan trains on 6 and generates on 2. The trainer is on no one node, so when a
    // node goes the trainer and the replicas would need 8 of the 6 left. A node that joins
    // later gives the trainer its GPUs back.
    let job = job_file(&dir, 24);
    let yaml = std::fs::read_to_string(&job).unwrap();
    let prefill = "    - name: prefill\n      gpu: H800\n      count: 1\n";
    let train = "    - name: train\n      gpu: H800\n      count: 1\n      roles: [train]\n";
    assert!(yaml.contains(prefill) && yaml.contains(train));
    std::fs::write(
        &job,
        yaml.replace(train, "").replace(
            prefill,
            "    - name: gpu\n      gpu: H800\n      count: 8\n      gpusPerNode: 2\n",
        ),
    )
    .unwrap();
    let report = dir.join("report.json");
    let pools = [("gpu", 4), ("decode", 1), ("envs", 1), ("rewards", 1)];
    let expect: usize = pools.iter().map(|(_, n)| n).sum();
    let (sched, url, log) = scheduler_with_log(&job, &report, expect);
    let mut procs = Procs(vec![sched]);
    for (pool, n) in pools {
        for i in 0..n {
            procs.0.push(worker(&url, pool, &format!("{pool}-{i}")));
        }
    }
    wait_status(&url, "the first step trained", |s| s.policy_version >= 1);
    // The last gpu node to start. Whether it held the pool's generate replica depends on the
    // order the workers registered in: if it did, the move takes a second wave that starts the
    // replica again on the GPUs the trainer freed; either way the trainer shrinks to 4. The
    // join waits for the move to end, so that it does not supersede it.
    procs.0[4].kill().unwrap();
    wait_log(&log, "the move to the new plan is done");
    procs.0.push(worker_declaring_gpus(&url, "gpu", "gpu-4", 2));
    let (_, loss, join) = loss_and_join(&mut procs.0[0], &report, 24);
    assert_eq!(loss["pool"], "gpu", "{loss:#}");
    assert_eq!(
        (loss["gpus_before"].as_u64(), loss["gpus_after"].as_u64()),
        (Some(8), Some(6)),
        "{loss:#}"
    );
    assert_eq!(
        loss["trainer_gpus"], 4,
        "the trainer shrinks from 6 to 4 GPUs: {loss:#}"
    );
    assert_eq!(loss["waves_done"], loss["waves"], "{loss:#}");
    assert!(loss["done_at_s"].as_f64().is_some(), "{loss:#}");
    // The join: eight GPUs again, and the trainer back to six once the move is done.
    assert_eq!(
        (join["gpus_before"].as_u64(), join["gpus_after"].as_u64()),
        (Some(6), Some(8)),
        "{join:#}"
    );
    assert_eq!(
        join["trainer_gpus"], 6,
        "the trainer grows back to 6 GPUs: {join:#}"
    );
    assert_eq!(join["waves_done"], join["waves"], "{join:#}");
}

/// Runs the quick-start for `steps` steps with `--replan-on-drift 0.2` and its decode worker's
/// emulated GPUs at `slowdown` of their modelled rates; returns the checked report.
fn run_watching_drift(name: &str, steps: u32, slowdown: &str) -> Value {
    let dir = temp_dir(name);
    let job = job_file(&dir, steps);
    let report = dir.join("report.json");
    let pools = ["prefill", "decode", "train", "envs", "rewards"];
    let (sched, url) = scheduler(&job, &report, pools.len(), &["--replan-on-drift", "0.2"]);
    let mut procs = Procs(vec![sched]);
    for pool in pools {
        let mut worker = Command::new(BIN);
        worker
            .args([
                "worker",
                "--scheduler",
                &url,
                "--pool",
                pool,
                "--name",
                pool,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if pool == "decode" {
            worker.args(["--emulate-slowdown", slowdown]);
        }
        procs.0.push(worker.spawn().unwrap());
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    check_report(&report, u64::from(steps), 0)
}

#[test]
fn a_decode_node_slower_than_planned_is_measured_and_the_job_is_planned_again_with_its_profile() {
    // The emulated replicas measure the model's own shares of peak: nothing drifts.
    let report = run_watching_drift("drift-none", 6, "1");
    assert_eq!(report["replans"].as_array().unwrap().len(), 0, "{report:#}");
    // A decode node whose GPUs reach a third of the modelled rates: a throttled node.
    let report = run_watching_drift("drift", 12, "0.33");
    let replans = report["replans"].as_array().unwrap();
    let drift = replans
        .first()
        .unwrap_or_else(|| panic!("no re-plan on drift: {report:#}"));
    let reason = drift["reason"].as_str().unwrap();
    assert!(
        reason.contains("drifted") && reason.contains("decode on decode at 26% of peak"),
        "decode measured at 0.33 x the model's 80% of peak bandwidth: {reason}"
    );
    let mut seen = std::collections::BTreeSet::new();
    for replan in replans {
        let reason = replan["reason"].as_str().unwrap();
        // Only the slowed node's pool drifts (its local prefill too, once it has samples).
        assert!(
            !reason.contains("on prefill"),
            "the prefill pool is as planned: {reason}"
        );
        // The measured profile is the reference from then on: a drift re-plans once.
        let (_, drifts) = reason.split_once(": ").unwrap();
        for drift in drifts.split(", ") {
            let what = drift.split(" at ").next().unwrap().to_owned();
            assert!(
                seen.insert(what.clone()),
                "{what} re-planned twice: {report:#}"
            );
        }
        // The running placement is predicted with the measured profile; it is left as is
        // unless the new plan saves 5% of the step.
        let (now, new) = (
            replan["running_step_s"].as_f64().unwrap(),
            replan["planned_step_s"].as_f64().unwrap(),
        );
        assert_eq!(
            replan["waves"].as_u64() == Some(0),
            new >= now * 0.95,
            "{replan:#}"
        );
    }
}

#[test]
fn a_worker_that_reports_a_stage_it_was_never_given_is_cut_off_and_its_work_redone() {
    let dir = temp_dir("rogue");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 7, &[]);
    let mut procs = Procs(vec![sched]);
    // Two of the seven workers are rogues: one in the environment pool takes an assignment, then
    // reports one it was never given; one in the reward pool reports its first assignment twice.
    let reasons = rt().block_on(async {
        let mut client = WorkerServiceClient::connect(url.clone()).await.unwrap();

        // Bad registrations are refused with the field named.
        let bad = client
            .register(RegisterRequest {
                inventory: Some(HardwareInventory {
                    pool: "no-such-pool".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(bad.message().contains("inventory.pool"), "{bad:?}");
        // A node that declares more GPUs than its pool has, or another product.
        for (gpu, field) in [
            (
                GpuInventory {
                    count: 99,
                    ..Default::default()
                },
                "inventory.gpu.count",
            ),
            (
                GpuInventory {
                    product: "B200".into(),
                    count: 1,
                    ..Default::default()
                },
                "inventory.gpu.product",
            ),
        ] {
            let bad = client
                .register(RegisterRequest {
                    inventory: Some(HardwareInventory {
                        pool: "decode".into(),
                        device: Some(hardware_inventory::Device::Gpu(gpu)),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert!(bad.message().contains(field), "{bad:?}");
        }

        // The rogues register before the honest workers: the least-loaded rule breaks ties by
        // registration, so each rogue gets its pool's first assignment (rewards are few).
        let (envs, rewards) = tokio::join!(
            Rogue::attach(&url, "rogue", "envs"),
            Rogue::attach(&url, "echo", "rewards")
        );
        for pool in ["prefill", "decode", "train", "envs", "rewards"] {
            procs.0.push(worker(&url, pool, &format!("{pool}-0")));
        }
        tokio::join!(
            envs.lie(|first| vec![result_for(first + 1_000_000)]),
            rewards.lie(|first| vec![result_for(first), result_for(first)]),
        )
    });
    assert!(reasons.0.contains("never given"), "{reasons:?}");
    assert!(reasons.1.contains("reported already"), "{reasons:?}");
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    let report = check_report(&report, 2, 2);
    let lost = report["workers_lost"].to_string();
    assert!(
        lost.contains("rogue") && lost.contains("never given"),
        "{lost}"
    );
    assert!(
        lost.contains("echo") && lost.contains("reported already"),
        "{lost}"
    );
}

/// A result with an empty output for assignment `id`.
fn result_for(id: u64) -> WorkerMessage {
    WorkerMessage {
        message: Some(worker_message::Message::Result(WorkResult {
            assignment_id: id,
            outcome: Some(work_result::Outcome::Output(StageOutput::default())),
            duration_us: 1,
        })),
    }
}

/// A test peer with an open work stream that misbehaves on request.
struct Rogue {
    client: WorkerServiceClient<tonic::transport::Channel>,
    worker_id: String,
    outbox: tokio::sync::mpsc::UnboundedSender<WorkerMessage>,
    inbound: tonic::Streaming<rollfleet_proto::v1::SchedulerMessage>,
    heartbeats: tokio::task::JoinHandle<()>,
}

impl Rogue {
    /// Registers in `pool`, opens its work stream and keeps its lease.
    async fn attach(url: &str, hostname: &str, pool: &str) -> Rogue {
        let mut client = WorkerServiceClient::connect(url.to_owned()).await.unwrap();
        let lease = register_peer(
            &mut client,
            HardwareInventory {
                hostname: hostname.into(),
                pool: pool.into(),
                ..Default::default()
            },
        )
        .await;
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
        let mut hb = client.clone();
        let id = lease.worker_id.clone();
        let heartbeats = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let _ = hb
                    .heartbeat(HeartbeatRequest {
                        worker_id: id.clone(),
                        epoch: 1,
                        load: None,
                    })
                    .await;
            }
        });
        Rogue {
            client,
            worker_id: lease.worker_id,
            outbox,
            inbound,
            heartbeats,
        }
    }

    /// Serves as an environment worker until its stream ends, answering the first `huge` steps
    /// of the first trajectory it steps with an applied action of `bytes` bytes, and everything
    /// else as a small environment would. Returns how many huge answers it sent.
    async fn serve_env_with_huge_answers(mut self, huge: u32, bytes: usize) -> u32 {
        use rollfleet_proto::v1::work_assignment::Work;
        let mut target = None;
        let mut sent = 0;
        while let Ok(Some(m)) = self.inbound.message().await {
            let a = match m.message {
                Some(scheduler_message::Message::Assign(a)) => a,
                Some(scheduler_message::Message::Drain(_)) => break,
                _ => continue,
            };
            let traj = a.trajectory.as_ref().map_or(0, |t| t.id);
            let output = match &a.work {
                Some(Work::EnvStep(e))
                    if !e.reset && sent < huge && *target.get_or_insert(traj) == traj =>
                {
                    sent += 1;
                    StageOutput {
                        token_count: 60,
                        text: "x".repeat(bytes),
                        observation: "ok".into(),
                        ..Default::default()
                    }
                }
                Some(Work::EnvStep(e)) => StageOutput {
                    token_count: if e.reset { 200 } else { 60 },
                    done: !e.reset && a.turn >= 3,
                    text: "up".into(),
                    observation: "ok".into(),
                    ..Default::default()
                },
                Some(Work::Reward(_)) => StageOutput {
                    reward: 1.0,
                    ..Default::default()
                },
                _ => StageOutput::default(),
            };
            let result = WorkerMessage {
                message: Some(worker_message::Message::Result(WorkResult {
                    assignment_id: a.assignment_id,
                    outcome: Some(work_result::Outcome::Output(output)),
                    duration_us: 1,
                })),
            };
            if self.outbox.send(result).is_err() {
                break;
            }
        }
        self.heartbeats.abort();
        sent
    }

    /// Waits for its first assignment, then sends what `lie` makes of its id; returns why the
    /// scheduler closed its stream, after checking that its lease is gone too.
    async fn lie(mut self, lie: fn(u64) -> Vec<WorkerMessage>) -> String {
        let first = tokio::time::timeout(DEADLINE, async {
            loop {
                let m = self.inbound.message().await.unwrap().unwrap();
                if let Some(scheduler_message::Message::Assign(a)) = m.message {
                    return a.assignment_id;
                }
            }
        })
        .await
        .unwrap();
        for message in lie(first) {
            self.outbox.send(message).unwrap();
        }
        let end = tokio::time::timeout(DEADLINE, async {
            loop {
                match self.inbound.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return "closed without a reason".to_owned(),
                    Err(status) => return status.message().to_owned(),
                }
            }
        })
        .await
        .unwrap();
        self.heartbeats.abort();
        let hb = self
            .client
            .heartbeat(HeartbeatRequest {
                worker_id: self.worker_id.clone(),
                epoch: 1,
                load: None,
            })
            .await
            .unwrap_err();
        assert_eq!(hb.code(), tonic::Code::NotFound);
        end
    }
}

#[test]
fn an_environment_answering_with_megabytes_of_text_fails_its_stages_and_no_worker_or_job_is_wedged()
{
    let dir = temp_dir("huge-env");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url, log) = scheduler_with_log(&job, &report, 6);
    let mut procs = Procs(vec![sched]);
    // The hostile environment registers first, so that it is given the first episodes. Two of
    // its answers carry 2.2 MB each: kept, the episode's history (resent with every step) would
    // pass the 4 MiB a worker takes, and every worker it went to would die on it.
    let (attached, is_attached) = std::sync::mpsc::channel();
    let rogue = {
        let url = url.clone();
        std::thread::spawn(move || {
            rt().block_on(async {
                let rogue = Rogue::attach(&url, "huge", "envs").await;
                attached.send(()).unwrap();
                rogue.serve_env_with_huge_answers(2, 2_200_000).await
            })
        })
    };
    is_attached.recv().unwrap();
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    assert_eq!(rogue.join().unwrap(), 2, "the hostile answers were sent");
    let report = check_report(&report, 2, 0);
    assert_eq!(
        report["workers_lost"],
        serde_json::json!([]),
        "no worker died or was cut off for an environment's answer: {report:#}"
    );
    let lines: Vec<String> = log.try_iter().collect();
    let refused = lines
        .iter()
        .filter(|l| l.contains("bytes of text") && l.contains("over its budget of 131072 bytes"))
        .count();
    assert_eq!(refused, 2, "each huge answer failed its stage, saying why");
    // The honest workers are still alive, and leave with the job.
    for worker in &mut procs.0[1..] {
        assert!(wait_exit(worker, DEADLINE).success());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The quick-start job with 200 more GPU pools of assorted sizes: valid, and a minute or more
/// of planning (the search grows with every pool).
fn slow_to_plan_job(dir: &Path) -> PathBuf {
    let path = job_file(dir, 1);
    let yaml = std::fs::read_to_string(&path).unwrap();
    let pools: String = (0..200)
        .map(|i| {
            let gpu = ["H800", "H20"][i % 2];
            format!(
                "    - name: g{i}\n      gpu: {gpu}\n      count: {}\n",
                8 * (i % 5 + 1)
            )
        })
        .collect();
    assert!(yaml.contains("    - name: envs\n"));
    let yaml = yaml.replace("    - name: envs\n", &format!("{pools}    - name: envs\n"));
    std::fs::write(&path, yaml).unwrap();
    path
}

#[test]
fn a_scheduler_told_to_stop_while_it_plans_a_big_job_exits_within_seconds_with_its_normal_code() {
    let dir = temp_dir("stop-planning");
    let job = slow_to_plan_job(&dir);
    let child = Command::new(BIN)
        .arg("scheduler")
        .arg(&job)
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut procs = Procs(vec![child]);
    // Well into the planning (a plan of this job takes minutes).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        procs.0[0].try_wait().unwrap().is_none(),
        "the scheduler ended before it was told to stop"
    );
    let pid = procs.0[0].id().to_string();
    let signalled = Instant::now();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success());
    let status = wait_exit(&mut procs.0[0], Duration::from_secs(20));
    let took = signalled.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut procs.0[0].stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(0), "{status:?}: {stderr}");
    assert!(
        took < Duration::from_secs(5),
        "it took {took:?} to stop: {stderr}"
    );
    assert!(stderr.contains("stopped while planning"), "{stderr}");
}

#[test]
fn a_silent_worker_loses_its_lease_and_garbage_on_the_port_harms_nothing() {
    let dir = temp_dir("silent");
    let job = job_file(&dir, 1);
    let report = dir.join("report.json");
    // The job never starts (it waits for 100 workers): only the peers' treatment is tested.
    let (sched, url) = scheduler(&job, &report, 100, &[]);
    let _procs = Procs(vec![sched]);
    let addr = url.trim_start_matches("http://").to_owned();
    // Garbage bytes where HTTP/2 is expected.
    {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"\x00\xffthis is not HTTP/2 at all\r\n\r\n\x16\x03\x01")
            .unwrap();
    }
    // A connection that says nothing at all: the scheduler gives it up (within 10 s of it
    // opening), rather than holding it for good.
    let silent = std::net::TcpStream::connect(&addr).unwrap();
    let opened = Instant::now();
    rt().block_on(async {
        let mut client = WorkerServiceClient::connect(url.clone()).await.unwrap();
        // A hostile 100 KB name is refused with the field named and the name cut short: echoed
        // whole, the error overflowed the client's HTTP/2 header limit (found by fuzzing).
        let long = "x".repeat(100_000);
        let refused = client
            .register(RegisterRequest {
                inventory: Some(HardwareInventory {
                    pool: long.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused
                .message()
                .starts_with("inventory.pool: job quickstart has no pool \"xxx")
                && refused.message().contains("... (100000 bytes)"),
            "{refused:?}"
        );
        // A hostname with a newline (it would forge a log line) is refused, quoted escaped.
        let forged = client
            .register(RegisterRequest {
                inventory: Some(HardwareInventory {
                    pool: "decode".into(),
                    hostname: "node\nscheduler: job quickstart ends".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(forged.code(), tonic::Code::InvalidArgument, "{forged:?}");
        assert!(
            forged.message().starts_with("inventory.hostname: ")
                && !forged.message().contains('\n'),
            "{forged:?}"
        );
        let mut jobs = JobServiceClient::connect(url.clone()).await.unwrap();
        let unknown = jobs.status(JobRef { job: long.clone() }).await.unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
        assert!(unknown.message().len() < 300, "{unknown:?}");
        // A submitted job that is not valid is told why; a valid one that is another job is
        // refused as such (this scheduler runs the one it was started with).
        let submit = |job_yaml: String| rollfleet_proto::v1::SubmitJobRequest {
            job_yaml,
            request_id: String::new(),
        };
        let invalid = jobs.submit(submit("spec: [".into())).await.unwrap_err();
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument, "{invalid:?}");
        assert!(invalid.message().starts_with("job_yaml: "), "{invalid:?}");
        // A problem that quotes a 100 KB name is cut short (an error travels in a header).
        let yaml = std::fs::read_to_string(&job).unwrap();
        assert!(yaml.contains("name: quickstart"));
        let long_name = yaml.replace(
            "name: quickstart",
            &format!("name: {}", "X".repeat(100_000)),
        );
        let invalid = jobs.submit(submit(long_name)).await.unwrap_err();
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument, "{invalid:?}");
        assert!(invalid.message().contains("metadata.name"), "{invalid:?}");
        assert!(invalid.message().ends_with("more bytes)"), "{invalid:?}");
        let other = jobs
            .submit(submit(yaml.replace("steps: 1", "steps: 2")))
            .await
            .unwrap_err();
        assert_eq!(other.code(), tonic::Code::FailedPrecondition, "{other:?}");
        let lease = register_peer(
            &mut client,
            HardwareInventory {
                hostname: "silent".into(),
                pool: "envs".into(),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(lease.ttl_ms, 2000);
        // A lease id is a capability: its number alone, or with another secret, is refused as
        // another worker's lease, named by its number only.
        let (number, secret) = lease.worker_id.split_once('-').unwrap();
        assert_eq!(secret.len(), 32, "128 random bits: {}", lease.worker_id);
        for guess in [number.to_owned(), format!("{number}-{}", "0".repeat(32))] {
            let refused = client
                .heartbeat(HeartbeatRequest {
                    worker_id: guess.clone(),
                    epoch: 1,
                    load: None,
                })
                .await
                .unwrap_err();
            assert_eq!(
                refused.code(),
                tonic::Code::PermissionDenied,
                "{guess}: {refused:?}"
            );
            assert!(
                refused.message().contains(&format!("lease {number} "))
                    && !refused.message().contains(secret),
                "{guess}: {refused:?}"
            );
        }
        // A first message that is not a hello is refused.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(WorkerMessage {
            message: Some(worker_message::Message::Load(Default::default())),
        })
        .unwrap();
        let refused = client
            .work(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap_err();
        assert!(refused.message().contains("WorkerHello"), "{refused:?}");
        // A heartbeat within the lease renews it.
        let beat = || HeartbeatRequest {
            worker_id: lease.worker_id.clone(),
            epoch: 1,
            load: None,
        };
        client.heartbeat(beat()).await.unwrap();
        // A load report of 50,000 GPU readings is refused before the scheduler keeps any of it.
        let flood = HeartbeatRequest {
            load: Some(rollfleet_proto::v1::WorkerLoad {
                gpus: vec![Default::default(); 50_000],
                ..Default::default()
            }),
            ..beat()
        };
        let refused = client.heartbeat(flood).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().starts_with("load.gpus: 50000 readings"),
            "{refused:?}"
        );
        // Then silence, twice the lease: the worker is declared lost, and the lease is gone.
        tokio::time::sleep(Duration::from_millis(2 * lease.ttl_ms)).await;
        let late = client.heartbeat(beat()).await.unwrap_err();
        assert_eq!(late.code(), tonic::Code::NotFound, "{late:?}");
    });
    {
        use std::io::Read;
        silent
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        // Whatever the server says first (its HTTP/2 settings, a goodbye), then the end.
        let closed = loop {
            match (&silent).read(&mut [0u8; 256]) {
                Ok(n) if n > 0 => continue,
                other => break other,
            }
        };
        assert!(
            matches!(closed, Ok(0))
                || closed
                    .as_ref()
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "the silent connection was not closed: {closed:?}"
        );
        assert!(
            opened.elapsed() < Duration::from_secs(18),
            "{:?}",
            opened.elapsed()
        );
    }
}

/// Registers a test peer (a gRPC client with no worker process behind it) and returns its
/// lease.
async fn register_peer(
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

/// Reads the feed until `count` trajectories came; returns their (sequence, trajectory id).
async fn read_feed(
    feed: &mut tonic::Streaming<rollfleet_proto::v1::TrainerFeedItem>,
    count: usize,
) -> Vec<(u64, u64)> {
    let mut got = Vec::new();
    while got.len() < count {
        let item = tokio::time::timeout(DEADLINE, feed.message())
            .await
            .expect("the feed went quiet")
            .unwrap()
            .expect("the feed ended early");
        if let Some(rollfleet_proto::v1::trainer_feed_item::Item::Trajectory(t)) = item.item {
            // What a trainer needs of it: the task's prompt, and every turn's action and the
            // environment's answer to it, each with the version that generated it.
            assert!(!t.prompt.is_empty(), "{t:?}");
            assert!(!t.turns.is_empty(), "{t:?}");
            for turn in &t.turns {
                assert!(
                    !turn.action.is_empty() && !turn.observation.is_empty(),
                    "{t:?}"
                );
                assert!(turn.policy_version >= t.oldest_policy_version, "{t:?}");
            }
            got.push((t.sequence, t.trajectory.unwrap().id));
        }
    }
    got
}

fn subscribe(resume_from: u64, window: u32) -> rollfleet_proto::v1::TrainerFeedRequest {
    use rollfleet_proto::v1::{FeedSubscribe, TrainerFeedRequest, trainer_feed_request};
    TrainerFeedRequest {
        message: Some(trainer_feed_request::Message::Subscribe(FeedSubscribe {
            job: "quickstart".into(),
            resume_from,
            window,
        })),
    }
}

fn ack(through: u64) -> rollfleet_proto::v1::TrainerFeedRequest {
    use rollfleet_proto::v1::{TrainerFeedRequest, trainer_feed_request};
    TrainerFeedRequest {
        message: Some(trainer_feed_request::Message::AckThrough(through)),
    }
}

#[test]
fn the_trainer_feed_resends_what_was_not_acknowledged_after_a_reconnect() {
    use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
    let dir = temp_dir("feed");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let (first, second) = rt().block_on(async {
        let mut client = TrainerFeedClient::connect(url.clone()).await.unwrap();
        // A trainer cannot resume past what was ever sent (found by fuzzing: it overflowed the
        // window's arithmetic, and would have dropped every trajectory appended since).
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(u64::MAX, u32::MAX)).unwrap();
        let refused = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("subscribe.resume_from"),
            "{refused:?}"
        );
        // First connection: a window of 8, read 10 (acking 5 opens the window), then leave.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(1, 8)).unwrap();
        let mut feed = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut first = read_feed(&mut feed, 8).await;
        tx.send(ack(5)).unwrap();
        first.extend(read_feed(&mut feed, 2).await);
        drop(tx);
        drop(feed);

        // Reconnect: everything from 6 comes again, then the rest, acknowledged as it comes.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(6, 8)).unwrap();
        let mut feed = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut second = Vec::new();
        while second.len() < 64 - 5 {
            let got = read_feed(&mut feed, 1).await;
            tx.send(ack(got[0].0)).unwrap();
            second.extend(got);
        }
        // Everything is acknowledged: the scheduler ends the feed when it leaves.
        let rest = tokio::time::timeout(DEADLINE, async {
            let mut extra = 0;
            while let Ok(Some(item)) = feed.message().await {
                if let Some(rollfleet_proto::v1::trainer_feed_item::Item::Trajectory(_)) = item.item
                {
                    extra += 1;
                }
            }
            extra
        })
        .await
        .expect("the feed did not end after the job");
        assert_eq!(rest, 0, "nothing beyond the job's trajectories");
        (first, second)
    });
    let seqs: Vec<u64> = first.iter().map(|x| x.0).collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    let seqs: Vec<u64> = second.iter().map(|x| x.0).collect();
    assert_eq!(
        seqs,
        (6..=64).collect::<Vec<_>>(),
        "gap-free from the resume point"
    );
    // What was resent is what was sent before.
    assert_eq!(&first[5..10], &second[..5]);
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success());
    let report = check_report(&report, 2, 0);
    let trained = trained(&report);
    let fed: Vec<u64> = first[..5].iter().chain(&second).map(|x| x.1).collect();
    assert_eq!(
        fed, trained,
        "the feed carries every trained trajectory once, in order"
    );
}

#[test]
fn one_trainer_reads_a_jobs_feed_and_a_resume_that_would_skip_or_acknowledge_unsent_items_is_refused()
 {
    use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
    let dir = temp_dir("feed-readers");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let (first, last) = rt().block_on(async {
        let mut client = TrainerFeedClient::connect(url.clone()).await.unwrap();
        let open = |resume_from: u64| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tx.send(subscribe(resume_from, 8)).unwrap();
            (tx, tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        };
        // Trainer A reads 1-10 and acknowledges 5.
        let (a_tx, a_rx) = open(1);
        let mut a = client.feed(a_rx).await.unwrap().into_inner();
        let mut first = read_feed(&mut a, 8).await;
        a_tx.send(ack(5)).unwrap();
        first.extend(read_feed(&mut a, 2).await);

        // A second trainer while A's stream is open is refused, naming why.
        let (_b_tx, b_rx) = open(1);
        let refused = client.feed(b_rx).await.unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert!(refused.message().contains("another trainer"), "{refused:?}");

        // A leaves. B cannot claim to have consumed items no stream ever sent (A's window had
        // 13 sent: 5 acknowledged and 8 ahead).
        drop(a_tx);
        drop(a);
        let (_b_tx, b_rx) = open(65);
        let refused = client.feed(b_rx).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("subscribe.resume_from")
                && refused.message().contains("sent through 13 only"),
            "{refused:?}"
        );
        // B takes over after 10 (its own account: it consumed 1-10), reads 11 and acknowledges it.
        let (b_tx, b_rx) = open(11);
        let mut b = client.feed(b_rx).await.unwrap().into_inner();
        let eleventh = read_feed(&mut b, 1).await;
        assert_eq!(eleventh[0].0, 11);
        b_tx.send(ack(11)).unwrap();
        // Closing its side ends B's stream once the scheduler has read the acknowledgement.
        drop(b_tx);
        while let Ok(Some(_)) = b.message().await {}

        // A comes back from 6: items 6-11 are acknowledged and gone, and the feed says so
        // instead of carrying on at 12 with a gap.
        let (_a_tx, a_rx) = open(6);
        let refused = client.feed(a_rx).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("resume from 12"), "{refused:?}");

        // From 12, the rest comes gap-free.
        let (tx, rx) = open(12);
        let mut feed = client.feed(rx).await.unwrap().into_inner();
        let mut last = Vec::new();
        while last.len() < 64 - 11 {
            let got = read_feed(&mut feed, 1).await;
            tx.send(ack(got[0].0)).unwrap();
            last.extend(got);
        }
        // Everything is acknowledged: the scheduler ends the feed when it leaves.
        while let Ok(Some(_)) = feed.message().await {}
        drop(tx);
        (first, last)
    });
    let seqs: Vec<u64> = first.iter().map(|x| x.0).collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    let seqs: Vec<u64> = last.iter().map(|x| x.0).collect();
    assert_eq!(seqs, (12..=64).collect::<Vec<_>>());
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A trainer that reads the feed through scheduler restarts: it acknowledges every 8th item
/// and, when the feed breaks, subscribes again from its first unacknowledged item, as a trainer
/// that checkpoints what it consumed does. Checks that items come gap-free and that an item
/// sent again is the item sent before; returns every item consumed, in order (sequence,
/// trajectory), and how many were sent again.
async fn train_through_restarts(url: String, total: usize) -> (Vec<(u64, u64)>, usize) {
    use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
    use rollfleet_proto::v1::trainer_feed_item::Item;
    let start = Instant::now();
    let mut consumed: Vec<(u64, u64)> = Vec::new();
    let mut sent_before = std::collections::BTreeMap::new();
    let mut resent = 0;
    loop {
        assert!(
            start.elapsed() < DEADLINE,
            "the trainer consumed {} of {total} within {DEADLINE:?}",
            consumed.len()
        );
        let Ok(mut client) = TrainerFeedClient::connect(url.clone()).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(consumed.len() as u64 + 1, 16)).unwrap();
        let Ok(feed) = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let mut feed = feed.into_inner();
        let mut unacked = Vec::new();
        while let Ok(Some(item)) = feed.message().await {
            let Some(Item::Trajectory(t)) = item.item else {
                continue;
            };
            let id = t.trajectory.unwrap().id;
            assert_eq!(
                t.sequence,
                (consumed.len() + unacked.len() + 1) as u64,
                "gap-free, from the resume point"
            );
            if let Some(before) = sent_before.insert(t.sequence, id) {
                assert_eq!(before, id, "item {} sent again is another", t.sequence);
                resent += 1;
            }
            unacked.push((t.sequence, id));
            if unacked.len() == 8 || consumed.len() + unacked.len() == total {
                // The call may have ended (the scheduler was killed) while items it received
                // before are still read: then the acknowledgement is not sent, and what it
                // covered comes again after the next subscription.
                if tx.send(ack(t.sequence)).is_err() {
                    break;
                }
                consumed.append(&mut unacked);
            }
            if consumed.len() == total {
                // Everything is acknowledged: the scheduler ends the feed when it leaves.
                while let Ok(Some(_)) = feed.message().await {}
                return (consumed, resent);
            }
        }
    }
}

#[test]
fn a_scheduler_killed_mid_run_resumes_from_its_journal_and_trains_and_feeds_every_trajectory_once()
{
    let dir = temp_dir("journal");
    let steps = 10;
    let job = job_file(&dir, steps);
    let report = dir.join("report.json");
    let journal = dir.join("scheduler.journal");
    let journal = journal.to_str().unwrap();
    let (sched, url) = scheduler(&job, &report, 5, &["--journal", journal]);
    let addr = url.strip_prefix("http://").unwrap().to_owned();
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let trainer = {
        let url = url.clone();
        std::thread::spawn(move || rt().block_on(train_through_restarts(url, 32 * steps as usize)))
    };
    wait_status(&url, "two steps trained", |s| s.policy_version >= 2);
    // SIGKILL: no goodbye, no flush; what the journal holds is what the kernel was handed.
    procs.0[0].kill().unwrap();
    procs.0[0].wait().unwrap();
    // Replayed offline, the journal says where the job stood and how to resume it.
    let out = Command::new(BIN)
        .args(["journal", "show", journal, "-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["phase"], "Running", "{shown:#}");
    let stood_at = shown["policy_version"].as_u64().unwrap();
    let resume = shown["resume"].as_str().unwrap();
    assert!(
        resume.contains("--expect-workers 5") && resume.contains("--lease-ms 2000"),
        "{resume}"
    );

    // The same command on the same address: it replays the journal, and the workers, whose
    // streams broke, register again.
    let mut command = Command::new(BIN);
    command.arg("scheduler").arg(&job);
    let (mut sched, _) = spawn_scheduler(
        &mut command,
        &report,
        5,
        &["--journal", journal, "--listen", &addr],
        Stdio::piped(),
    );
    let log = tee_log(&mut sched);
    procs.0[0] = sched;
    let resumed_at = {
        let start = Instant::now();
        loop {
            let line = log
                .recv_timeout(DEADLINE.saturating_sub(start.elapsed()))
                .expect("the restarted scheduler says where it resumed");
            if let Some(rest) = line.split("resumed job quickstart at version ").nth(1) {
                break rest.split(' ').next().unwrap().parse::<u64>().unwrap();
            }
        }
    };
    assert!(
        (2..u64::from(steps)).contains(&resumed_at),
        "killed mid-run, not at version {resumed_at}"
    );
    assert_eq!(
        resumed_at, stood_at,
        "the offline replay is the scheduler's"
    );
    let (consumed, resent) = trainer.join().unwrap();
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the resumed scheduler failed: {status:?}");
    // Every step trained, every trajectory once, though the five workers of the scheduler
    // before were lost with it.
    let report_value = check_report(&report, u64::from(steps), 5);
    let trained = trained(&report_value);
    let fed: Vec<u64> = consumed.iter().map(|x| x.1).collect();
    assert_eq!(
        fed, trained,
        "the trainer consumed every trained trajectory once, in order, across the restart"
    );
    eprintln!("items sent again after the restart: {resent}");

    // The journal is the job: a scheduler started on it alone (no job file) replays it to the
    // very report the resumed one wrote, bit for bit, but for the dispatch latencies, which
    // are measured live. The journal says a trainer was subscribed, so the scheduler waits for
    // it to say it consumed everything before it leaves.
    let replayed = dir.join("replayed.json");
    let (sched, url) = spawn_scheduler(
        Command::new(BIN).arg("scheduler"),
        &replayed,
        5,
        &["--journal", journal],
        Stdio::inherit(),
    );
    procs.0.push(sched);
    std::thread::sleep(Duration::from_secs(2));
    let sched = procs.0.last_mut().unwrap();
    assert!(
        sched.try_wait().unwrap().is_none(),
        "the scheduler of an ended job left without its trainer's word"
    );
    rt().block_on(async {
        use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
        let mut client = TrainerFeedClient::connect(url).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(u64::from(32 * steps) + 1, 16)).unwrap();
        let mut feed = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        // Nothing is left to send; the feed ends when the scheduler leaves.
        let rest = tokio::time::timeout(DEADLINE, feed.message()).await;
        assert!(matches!(rest, Ok(Ok(None)) | Ok(Err(_))), "{rest:?}");
    });
    let status = wait_exit(procs.0.last_mut().unwrap(), DEADLINE);
    assert!(status.success(), "{status:?}");
    let again: Value = serde_json::from_slice(&std::fs::read(&replayed).unwrap()).unwrap();
    assert_eq!(decisions(&again), decisions(&report_value));
    assert_journal_replays_to(Path::new(journal), &report_value);

    // A scheduler with other settings is refused, naming the setting, and the journal is left
    // as it was.
    let size = std::fs::metadata(journal).unwrap().len();
    let out = Command::new(BIN)
        .args(["scheduler", "--listen", "127.0.0.1:0", "--seed", "1"])
        .args([
            "--time-scale",
            "1",
            "--lease-ms",
            "2000",
            "--expect-workers",
            "5",
        ])
        .args(["--journal", journal])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--seed 0") && stderr.contains("has 1"),
        "{stderr}"
    );
    assert_eq!(std::fs::metadata(journal).unwrap().len(), size);
}

#[test]
fn a_journal_that_cannot_be_written_is_emptied_and_the_job_goes_on_without_it() {
    let dir = temp_dir("journal-full");
    let steps = 6;
    let job = job_file(&dir, steps);
    let report = dir.join("report.json");
    let journal = dir.join("scheduler.journal");
    // A real failed write: the scheduler may grow no file past 128 KiB (RLIMIT_FSIZE, inherited
    // across exec), with SIGXFSZ ignored, so a write past it fails with EFBIG as one to a full
    // disk fails with ENOSPC. The report (about 50 KB) fits; the journal (about 70 KB a step)
    // does not.
    let mut command = Command::new("bash");
    command
        .arg("-c")
        .arg(r#"trap '' XFSZ; ulimit -f 128; exec "$0" "$@""#)
        .arg(BIN)
        .arg("scheduler")
        .arg(&job)
        .arg("--journal")
        .arg(&journal);
    let (mut sched, url) = spawn_scheduler(
        &mut command,
        &report,
        5,
        &["--metrics-addr", "127.0.0.1:0"],
        Stdio::piped(),
    );
    let log = stderr_lines(&mut sched);
    let metrics = metrics_address(&log);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let failed = wait_line(&log, "the job goes on without a journal");
    assert!(
        failed.contains("scheduler.journal")
            && failed.contains("File too large")
            && failed.contains("the file is emptied"),
        "{failed}"
    );
    // Counted once, while the job still runs.
    let start = Instant::now();
    loop {
        let exposition = scrape(&metrics);
        if sample(&exposition, "rollfleet_journal_failures_total") == Some(1.0) {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE && procs.0[0].try_wait().unwrap().is_none(),
            "the failed journal write was not counted while the job ran:\n{exposition}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    // Nothing accepted was lost to the failure: every step trained, every trajectory once.
    check_report(&report, steps.into(), 0);
    // The journal has no gap to resume from: it is empty, and says there is nothing to replay.
    assert_eq!(std::fs::metadata(&journal).unwrap().len(), 0);
    let out = Command::new(BIN)
        .arg("journal")
        .arg("show")
        .arg(&journal)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("nothing to replay"),
        "{out:?}"
    );
}

#[test]
fn rollfleet_run_trains_every_step_and_says_the_gpus_are_emulated() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(BIN)
        .args(["run", "examples/jobs/quickstart.yaml", "--time-scale", "1"])
        .current_dir(&root)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("Succeeded - 5 of 5 RL steps"), "{stdout}");
    assert!(stdout.contains("GPU figures are EMULATED"), "{stdout}");
    assert!(
        stdout.contains("trajectories trained: 160 (0 twice)"),
        "{stdout}"
    );
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(pool)),
            "{pool}: {stdout}"
        );
    }
    assert!(stderr.contains("GPUs are emulated"), "{stderr}");
}

/// The rewards a quick-start task's episodes can end on: a Sokoban move scores -0.1, plus 1 for a
/// box pushed onto a target (-1 off one), plus 10 for the solving one; FrozenLake's goal and a
/// right unit conversion score 1, anything else 0.
fn quickstart_reward_range(task: &str) -> (f64, f64) {
    match task {
        "sokoban" => (-1.1, 10.9),
        "frozenlake" | "unit-conversion" => (0.0, 1.0),
        other => panic!("not a quick-start task: {other}"),
    }
}

#[test]
fn rollfleet_run_ends_with_each_tasks_reward_and_success_and_its_report_carries_the_same() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = temp_dir("outcomes");
    let report_path = dir.join("report.json");
    let out = Command::new(BIN)
        .args(["run", "examples/jobs/quickstart.yaml", "--time-scale", "1"])
        .arg("--report")
        .arg(&report_path)
        .current_dir(&root)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    // The rewards are said to be an emulated policy's, with the success threshold.
    assert!(
        stdout.contains(
            "rewards (policy EMULATED (random legal moves); success: a reward of at least 1)"
        ),
        "{stdout}"
    );
    let outcomes = &report["outcomes"];
    assert_eq!(outcomes["success_reward"], 1.0);
    let tasks = outcomes["tasks"].as_array().unwrap();
    let names: Vec<&str> = tasks.iter().map(|t| t["task"].as_str().unwrap()).collect();
    assert_eq!(names, ["sokoban", "frozenlake", "unit-conversion"]);
    let mut trajectories = 0;
    for t in tasks {
        let name = t["task"].as_str().unwrap();
        let n = t["trajectories"].as_u64().unwrap();
        assert!(n > 0, "{name} trained nothing: {outcomes:#}");
        trajectories += n;
        let (lo, hi) = quickstart_reward_range(name);
        let f = |key: &str| t[key].as_f64().unwrap();
        assert!(
            lo <= f("min_reward") && f("min_reward") <= f("mean_reward"),
            "{t:#}"
        );
        assert!(
            f("mean_reward") <= f("max_reward") && f("max_reward") <= hi,
            "{t:#}"
        );
        let rate = t["successes"].as_u64().unwrap() as f64 / n as f64;
        assert!((f("success_rate") - rate).abs() < 1e-12, "{t:#}");
        // Every trajectory took a turn, read its prompt and generated; no trajectory was more
        // than `maxStaleness: 1` version behind.
        assert!(f("mean_turns") >= 1.0, "{t:#}");
        assert!(
            f("mean_prompt_tokens") > 0.0 && f("mean_action_tokens") > 0.0,
            "{t:#}"
        );
        assert!(t["max_staleness"].as_u64().unwrap() <= 1, "{t:#}");
        assert_eq!(
            t["modelled_rewards"], 0,
            "the environments ran for real: {t:#}"
        );
        // The summary's row of the task shows the report's figures.
        let row = stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}: {stdout}"));
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[1], n.to_string(), "{row}");
        assert_eq!(cells[2], format!("{:.3}", f("mean_reward")), "{row}");
        assert_eq!(
            cells[3],
            format!("{:.0}%", f("success_rate") * 100.0),
            "{row}"
        );
    }
    assert_eq!(trajectories, 160, "{outcomes:#}");
    assert_eq!(outcomes["overall"]["trajectories"], 160);
    let all = stdout
        .lines()
        .find(|l| l.starts_with("all "))
        .unwrap_or_else(|| panic!("no overall row: {stdout}"));
    let overall_mean = outcomes["overall"]["mean_reward"].as_f64().unwrap();
    assert!(all.contains(&format!(" {overall_mean:.3} ")), "{all}");
    // One entry per RL step, each with the step's 32 trajectories.
    let steps = outcomes["steps"].as_array().unwrap();
    assert_eq!(
        steps
            .iter()
            .map(|s| s["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    for s in steps {
        assert_eq!(s["overall"]["trajectories"], 32, "{s:#}");
    }
    assert!(stdout.contains("mean reward by RL step: 0: "), "{stdout}");
}

#[test]
fn the_job_status_over_grpc_and_the_metrics_carry_each_tasks_rewards_and_job_status_prints_them() {
    let dir = temp_dir("status-outcomes");
    let job = job_file(&dir, 50);
    let report = dir.join("report.json");
    let metrics_flag = ["--metrics-addr", "127.0.0.1:0"];
    let (mut sched, url) = start_scheduler(&job, &report, 5, &metrics_flag, Stdio::piped());
    let log = tee_log(&mut sched);
    let metrics = metrics_address(&log);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let seen = std::sync::Mutex::new(None);
    wait_status(&url, "a trained RL step", |s| {
        let done = s.rl_step >= 1;
        if done {
            *seen.lock().unwrap() = Some(s.clone());
        }
        done
    });
    let status = seen.into_inner().unwrap().unwrap();
    assert_eq!(status.success_reward, 1.0);
    let names: Vec<&str> = status.tasks.iter().map(|t| t.task.as_str()).collect();
    assert_eq!(names, ["sokoban", "frozenlake", "unit-conversion"]);
    let overall = status.overall.clone().unwrap();
    // Every trained trajectory is in its task's figures, and in no other.
    assert_eq!(overall.trajectories, status.trajectories_trained);
    assert_eq!(
        status.tasks.iter().map(|t| t.trajectories).sum::<u64>(),
        overall.trajectories
    );
    assert_eq!(
        status.tasks.iter().map(|t| t.successes).sum::<u64>(),
        overall.successes
    );
    for t in status.tasks.iter().filter(|t| t.trajectories > 0) {
        let (lo, hi) = quickstart_reward_range(&t.task);
        assert!(lo <= t.min_reward && t.max_reward <= hi, "{t:?}");
        assert!(
            t.min_reward <= t.mean_reward && t.mean_reward <= t.max_reward,
            "{t:?}"
        );
        assert!(t.mean_turns >= 1.0 && t.mean_action_tokens > 0.0, "{t:?}");
        assert!(t.max_staleness <= 1, "{t:?}");
    }
    let last = status.last_step.clone().unwrap();
    assert!(
        last.trajectories > 0 && last.step <= status.rl_step,
        "{last:?}"
    );

    // The metrics count at least what the status did (they are raised before it is published),
    // a success is a trained trajectory, and the exposition passes promtool's lint.
    let exposition = scrape(&metrics);
    let lint = promtool_check_metrics(exposition.split("\r\n\r\n").nth(1).unwrap());
    assert_eq!(lint, "", "promtool check metrics:\n{lint}");
    for t in &status.tasks {
        let series = |name: &str| {
            sample(&exposition, &format!("{name}{{task=\"{}\"}}", t.task))
                .unwrap_or_else(|| panic!("no {name} of {}: {exposition}", t.task))
        };
        let trained = series("rollfleet_task_trajectories_trained_total");
        assert!(trained >= t.trajectories as f64, "{}: {exposition}", t.task);
        assert!(
            series("rollfleet_task_successes_total") <= trained,
            "{exposition}"
        );
        series("rollfleet_task_cumulative_reward");
        series("rollfleet_task_action_tokens_total");
    }
    assert!(
        exposition.contains("rollfleet_task_last_step_mean_reward{"),
        "{exposition}"
    );

    // The CLI prints them: a row per task in the table, the figures in JSON.
    let table = job_command(&url, &["status", "quickstart"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(table.status.success(), "{table:?}");
    assert!(
        text.contains("rewards (success: a reward of at least 1)"),
        "{text}"
    );
    for task in ["sokoban", "frozenlake", "unit-conversion", "all"] {
        assert!(text.lines().any(|l| l.starts_with(task)), "{task}: {text}");
    }
    let json = job_command(&url, &["status", "quickstart", "-o", "json"]);
    assert!(json.status.success(), "{json:?}");
    let json: Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(json["tasks"].as_array().map(Vec::len), Some(3), "{json:#}");
    assert!(json["overall"]["trajectories"].as_u64().unwrap() >= overall.trajectories);
    assert!(json["last_step"]["step"].is_u64(), "{json:#}");
    let cancelled = job_command(&url, &["cancel", "quickstart"]);
    assert!(cancelled.status.success(), "{cancelled:?}");
    assert_eq!(wait_exit(&mut procs.0[0], DEADLINE).code(), Some(1));
}

#[test]
fn the_workers_replicas_measure_profiles_that_the_planner_then_plans_with() {
    let dir = temp_dir("profiles");
    let job = job_file(&dir, 2);
    let profiles = dir.join("profiles.json");
    let out = Command::new(BIN)
        .arg("run")
        .arg(&job)
        .args(["--time-scale", "1", "--profiles-out"])
        .arg(&profiles)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let store: Value = serde_json::from_slice(&std::fs::read(&profiles).unwrap()).unwrap();
    // Both GPU pools generate (colocated) and sent decode samples of what their replicas did.
    for (kind, pool) in [("decode", "prefill"), ("decode", "decode")] {
        let estimate = &store["measured"][kind][pool];
        assert!(
            estimate["total"].as_u64().unwrap() >= 20,
            "{kind} on {pool}: {store:#}"
        );
        assert_eq!(
            estimate["modelled"], estimate["total"],
            "{kind} on {pool}: emulated samples must be marked as such: {store:#}"
        );
    }
    // Most of the quick-start's prefills are bound by the weight read (short prompts, a 1.5B
    // model) and are no sample of the share of FLOP/s prefill estimates are of; the few that
    // count read the emulated hardware's 60% of peak FLOP/s, never the bandwidth roof's 80%.
    for pool in ["prefill", "decode"] {
        let samples = store["measured"]["prefill"][pool]["samples"].as_array();
        for share in samples.into_iter().flatten() {
            let share = share.as_f64().unwrap();
            assert!((share - 0.6).abs() < 1e-9, "prefill on {pool}: {store:#}");
        }
    }
    // The environment steps ran for real (not modelled) and were timed per task; one reward
    // function (the calculator's exact answer) ran in the reward pool.
    let steps = store["environmentSteps"].as_object().unwrap();
    for task in ["sokoban", "frozenlake", "unit-conversion"] {
        let e = &steps[task];
        assert!(e["total"].as_u64().unwrap() >= 1, "{task}: {store:#}");
        assert_eq!(e["modelled"], 0, "{task} ran for real: {store:#}");
    }
    assert!(
        steps.values().any(|e| e["total"].as_u64().unwrap() >= 20),
        "{store:#}"
    );
    assert!(store["rewards"]["exact-answer"]["total"].as_u64().unwrap() >= 1);
    // The planner takes them as measured figures and says they came from emulated replicas (which
    // measure the model's own figures, so the shares are the model's).
    let out = Command::new(BIN)
        .arg("plan")
        .arg(&job)
        .arg("--profiles")
        .arg(&profiles)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("measured on emulated or simulated hardware"),
        "{stdout}"
    );
}

#[test]
fn rollfleet_run_can_model_the_environments_as_the_simulator_does() {
    let dir = temp_dir("model");
    let job = job_file(&dir, 2);
    let out = Command::new(BIN)
        .arg("run")
        .arg(&job)
        .args(["--time-scale", "1", "--model-environments", "-o", "json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["phase"], "Succeeded");
    assert_eq!(report["trained"].as_array().unwrap().len(), 64);
    assert_eq!(report["emulated_gpus"], true);
    // No reward is modelled: every trained trajectory's is counted as such.
    assert_eq!(report["outcomes"]["overall"]["modelled_rewards"], 64);
    let envs = report["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == "envs")
        .unwrap();
    assert!(envs["assignments_done"].as_u64().unwrap() > 64, "{envs}");
}

/// Runs `rollfleet job ARGS --scheduler URL`.
fn job_command(url: &str, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("job")
        .args(args)
        .args(["--scheduler", url])
        .output()
        .unwrap()
}

fn json_lines(stdout: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

#[test]
fn rollfleet_job_list_and_logs_show_the_job_and_the_schedulers_log_lines_and_follow_new_ones() {
    let dir = temp_dir("list-logs");
    let report = dir.join("report.json");
    let mut command = Command::new(BIN);
    command.arg("scheduler");
    let (idle, idle_url) = spawn_scheduler(&mut command, &report, 5, &[], Stdio::null());
    let mut procs = Procs(vec![idle]);
    let none = job_command(&idle_url, &["list", "-o", "json"]);
    assert!(none.status.success(), "{none:?}");
    assert_eq!(
        serde_json::from_slice::<Value>(&none.stdout).unwrap(),
        serde_json::json!([])
    );

    // Its own log, as JSON lines for a log collector.
    let job = job_file(&dir, 50);
    let mut command = Command::new(BIN);
    command.arg("scheduler").arg(&job);
    let json_log = ["--log-format", "json"];
    let (mut sched, url) = spawn_scheduler(&mut command, &report, 5, &json_log, Stdio::piped());
    let own_log = tee_log(&mut sched);
    procs.0.push(sched);
    let planned = own_log
        .iter()
        .find(|l| l.contains("job quickstart planned"))
        .expect("the scheduler logs that it planned the job");
    let planned: Value = serde_json::from_str(&planned).expect("a JSON log line");
    assert_eq!(planned["level"], "INFO", "{planned}");
    assert_eq!(
        planned["fields"]["message"],
        "scheduler: job quickstart planned"
    );
    let list = job_command(&url, &["list"]);
    let table = String::from_utf8_lossy(&list.stdout);
    assert!(list.status.success(), "{list:?}");
    assert!(
        table
            .lines()
            .nth(1)
            .is_some_and(|row| row.starts_with("quickstart") && row.contains("Pending")),
        "{table}"
    );

    let logs = job_command(&url, &["logs", "quickstart", "--tail", "0", "-o", "json"]);
    assert!(logs.status.success(), "{logs:?}");
    let lines = json_lines(&logs.stdout);
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "scheduler: job quickstart planned" && l["level"] == "INFO"),
        "{lines:?}"
    );
    let seqs: Vec<u64> = lines.iter().map(|l| l["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let unknown = job_command(&url, &["logs", "other"]);
    assert_eq!(unknown.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("\"other\" is not known"));

    // A follower sees a line logged after it started: the job's end, once cancelled.
    let mut follower = Command::new(BIN)
        .args(["job", "logs", "quickstart", "--follow", "--tail", "1"])
        .args(["--scheduler", &url])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = follower.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let first = rx.recv_timeout(DEADLINE).expect("the tail line");
    assert!(first.contains("INFO"), "{first}");
    let cancel = job_command(&url, &["cancel", "quickstart"]);
    assert!(cancel.status.success(), "{cancel:?}");
    wait_log(&rx, "job quickstart ends: Cancelled");
    let _ = follower.kill();
    let _ = follower.wait();
}

#[test]
fn a_scheduler_started_without_a_job_runs_the_first_valid_one_submitted_and_refuses_others() {
    let dir = temp_dir("submit");
    let job = job_file(&dir, 3);
    let report = dir.join("report.json");
    let mut command = Command::new(BIN);
    command.arg("scheduler");
    let (sched, url) = spawn_scheduler(&mut command, &report, 5, &[], Stdio::inherit());
    let mut procs = Procs(vec![sched]);
    // Workers may come first: they wait for the job.
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let early = job_command(&url, &["status", "quickstart"]);
    assert_eq!(early.status.code(), Some(3));
    let said = String::from_utf8_lossy(&early.stderr);
    assert!(said.contains("no job was submitted"), "{said}");

    // An invalid job is refused before it is sent, naming the field; nothing starts.
    let broken = dir.join("broken.yaml");
    let yaml = std::fs::read_to_string(&job).unwrap();
    std::fs::write(&broken, yaml.replace("groupSize: 4", "groupSize: -4")).unwrap();
    let refused = job_command(&url, &["submit", broken.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(3));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("groupSize"), "{said}");

    let submitted = Command::new(BIN)
        .args([
            "job",
            "submit",
            job.to_str().unwrap(),
            "--watch",
            "--every",
            "0",
        ])
        .args(["--scheduler", &url, "-o", "json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&submitted.stderr);
    assert!(submitted.status.success(), "{stderr}");
    let lines = json_lines(&submitted.stdout);
    assert_eq!(lines[0]["job"], "quickstart", "{lines:?}");
    let statuses = &lines[1..];
    let last = statuses.last().unwrap();
    assert_eq!(last["phase"], "Succeeded", "{last:#}");
    assert_eq!(last["rl_step"], 3);
    assert_eq!(last["trajectories_trained"], 3 * 32);
    // Every change was shown (`--every 0`): the step count only grew, through every step.
    let steps: Vec<u64> = statuses
        .iter()
        .map(|s| s["rl_step"].as_u64().unwrap())
        .collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    for step in 0..=3 {
        assert!(steps.contains(&step), "step {step} never shown: {steps:?}");
    }

    // The same job again is recognised; another is refused with the one this scheduler runs.
    let again = job_command(&url, &["submit", job.to_str().unwrap()]);
    assert!(again.status.success(), "{again:?}");
    assert_eq!(
        String::from_utf8_lossy(&again.stdout).trim(),
        format!("job quickstart submitted to {url}")
    );
    let other = dir.join("other.yaml");
    std::fs::write(&other, yaml.replace("name: quickstart", "name: other")).unwrap();
    let busy = job_command(&url, &["submit", other.to_str().unwrap()]);
    assert_eq!(busy.status.code(), Some(1));
    let said = String::from_utf8_lossy(&busy.stderr);
    assert!(said.contains("runs job \"quickstart\""), "{said}");

    let status = job_command(&url, &["status", "quickstart", "-o", "json"]);
    assert!(status.status.success(), "{status:?}");
    let status: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["phase"], "Succeeded");
    assert_eq!(
        status["pools"].as_array().map(Vec::len),
        Some(5),
        "{status:#}"
    );
    let exit = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(exit.success(), "{exit:?}");
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(report["job"], "quickstart");
    assert_eq!(report["phase"], "Succeeded");
}

#[test]
fn rollfleet_job_cancel_stops_a_running_job_and_its_watcher_exits_unsuccessfully() {
    let dir = temp_dir("cancel");
    let job = job_file(&dir, 50);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    wait_status(&url, "a trained batch", |s| s.trajectories_trained > 0);
    let watcher = Command::new(BIN)
        .args(["job", "watch", "quickstart", "--scheduler", &url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let cancelled = job_command(&url, &["cancel", "quickstart"]);
    assert!(cancelled.status.success(), "{cancelled:?}");
    let watched = watcher.wait_with_output().unwrap();
    assert_eq!(watched.status.code(), Some(1), "{watched:?}");
    let lines = String::from_utf8_lossy(&watched.stdout).into_owned();
    let last = lines.lines().last().unwrap_or_default();
    assert!(last.contains("quickstart Cancelled"), "{lines}");
    assert_eq!(wait_exit(&mut procs.0[0], DEADLINE).code(), Some(1));
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(report["phase"], "Cancelled");
    assert!(
        report["trained_twice"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "{report:#}"
    );
}

#[test]
fn a_scheduler_stopped_before_any_job_was_submitted_exits_cleanly_and_says_so() {
    let dir = temp_dir("idle");
    let mut command = Command::new(BIN);
    command.arg("scheduler");
    let (sched, url) = spawn_scheduler(
        &mut command,
        &dir.join("report.json"),
        1,
        &[],
        Stdio::piped(),
    );
    let mut procs = Procs(vec![sched]);
    let unknown = job_command(&url, &["watch", "quickstart"]);
    assert_eq!(unknown.status.code(), Some(3), "{unknown:?}");
    let pid = procs.0[0].id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let exit = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(exit.success(), "{exit:?}");
    let mut said = String::new();
    std::io::Read::read_to_string(&mut procs.0[0].stderr.take().unwrap(), &mut said).unwrap();
    assert!(said.contains("waiting for a job"), "{said}");
    assert!(
        said.contains("stopped before any job was submitted"),
        "{said}"
    );
}

#[test]
fn replicas_are_placed_on_the_nodes_of_a_pool_in_proportion_to_the_gpus_they_declare() {
    let dir = temp_dir("proportion");
    let job = job_file(&dir, 2);
    // Eight H20s in nodes of at most two GPUs: the plan decodes on four two-GPU replicas.
    let yaml = std::fs::read_to_string(&job).unwrap();
    let eight = "gpu: H20\n      count: 8\n      gpusPerNode: 2";
    std::fs::write(&job, yaml.replace("gpu: H20\n      count: 2", eight)).unwrap();
    assert!(std::fs::read_to_string(&job).unwrap().contains(eight));
    let report = dir.join("report.json");
    let (sched, url, log) = scheduler_with_log(&job, &report, 6);
    let mut procs = Procs(vec![sched]);
    procs
        .0
        .push(worker_declaring_gpus(&url, "decode", "big", 6));
    procs
        .0
        .push(worker_declaring_gpus(&url, "decode", "small", 2));
    for pool in ["prefill", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    // Round-robin would give each node two replicas: four GPUs on the two-GPU node.
    let mut seen = (false, false);
    let start = Instant::now();
    while !(seen.0 && seen.1) {
        let line = log
            .recv_timeout(DEADLINE.saturating_sub(start.elapsed()))
            .unwrap_or_else(|e| panic!("no placement lines ({seen:?}): {e}"));
        if line.contains("@big), with 6 GPUs, serves") {
            assert!(
                line.ends_with("serves 3 replicas of pool decode on 6 GPUs"),
                "{line}"
            );
            seen.0 = true;
        }
        if line.contains("@small), with 2 GPUs, serves") {
            assert!(
                line.ends_with("serves 1 replica of pool decode on 2 GPUs"),
                "{line}"
            );
            seen.1 = true;
        }
    }
    let exit = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(exit.success(), "{exit:?}");
    check_report(&report, 2, 0);
}

#[test]
fn a_scheduler_told_to_stop_cancels_the_job_and_drains_its_workers() {
    let dir = temp_dir("term");
    let job = job_file(&dir, 50);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    wait_status(&url, "trajectories in flight", |s| {
        s.trajectories_in_flight > 0
    });
    let pid = procs.0[0].id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success());
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert_eq!(status.code(), Some(1), "a cancelled job is not a success");
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(report["phase"], "Cancelled", "{report:#}");
    // Every worker was drained and left on its own, successfully.
    for w in &mut procs.0[1..] {
        let status = wait_exit(w, DEADLINE);
        assert!(status.success(), "a drained worker failed: {status:?}");
    }
}

#[test]
fn an_environment_served_by_a_remote_python_server_runs_in_a_job() {
    let dir = temp_dir("remote");
    let job = job_file(&dir, 2);
    declare_remote_environment(&job, "frozenlake", "guess");
    let (python, port) = python_environment_server();
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched, python]);
    for pool in ["prefill", "decode", "train", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let remote = format!("guess=http://127.0.0.1:{port}");
    procs.0.push(
        Command::new(BIN)
            .args([
                "worker",
                "--scheduler",
                &url,
                "--pool",
                "envs",
                "--remote-env",
                &remote,
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    check_report(&report, 2, 0);
}

/// Rewrites the job so that the task on `builtin` runs `remote` instead, declared in
/// `spec.environments` as served by a remote environment server (validation requires it).
fn declare_remote_environment(job: &Path, builtin: &str, remote: &str) {
    let yaml = std::fs::read_to_string(job)
        .unwrap()
        .replace(
            &format!("environment: {builtin}"),
            &format!("environment: {remote}"),
        )
        .replace(
            "  rewards:\n",
            &format!("  environments:\n    - {{ name: {remote}, servedBy: remote }}\n  rewards:\n"),
        );
    assert!(yaml.contains("servedBy: remote"), "{yaml}");
    std::fs::write(job, yaml).unwrap();
}

/// The reference remote environment server (it serves `guess`), on a free port: the process
/// and its port.
fn python_environment_server() -> (Child, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut python = Command::new("python3")
        .arg(root.join("examples/remote-env/server.py"))
        .args(["--port", "0", "--slots", "1024"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 must be installed");
    let mut line = String::new();
    BufReader::new(python.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_owned();
    (python, port)
}

#[test]
fn a_declared_remote_environment_its_server_does_not_know_fails_the_job_with_the_servers_reason() {
    // The job passes validation (`wordle` is declared), but the server the environment worker
    // is pointed at serves only `guess`: it answers 404 unknown_environment to every episode.
    let dir = temp_dir("remote-unknown");
    let job = job_file(&dir, 2);
    declare_remote_environment(&job, "frozenlake", "wordle");
    let validated = Command::new(BIN)
        .arg("validate")
        .arg(&job)
        .output()
        .unwrap();
    assert!(validated.status.success(), "{validated:?}");
    let (python, port) = python_environment_server();
    let report_path = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report_path, 5, &[]);
    let mut procs = Procs(vec![sched, python]);
    for pool in ["prefill", "decode", "train", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let remote = format!("wordle=http://127.0.0.1:{port}");
    procs.0.push(
        Command::new(BIN)
            .args(["worker", "--scheduler", &url, "--pool", "envs"])
            .args(["--remote-env", &remote])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert_eq!(
        status.code(),
        Some(1),
        "a misconfigured job is not a success"
    );
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["phase"], "Failed", "{report:#}");
    let failure = report["failure"].as_str().unwrap();
    // The reason names the task, the environment and the server's own answer.
    assert!(
        failure.contains("task \"frozenlake\": its environment \"wordle\""),
        "{failure}"
    );
    assert!(failure.contains("configuration error"), "{failure}");
    assert!(failure.contains("unknown_environment"), "{failure}");
    assert!(failure.contains(&format!("127.0.0.1:{port}")), "{failure}");
    // It ended on the configuration error, before any of the task's groups was given up as
    // an infrastructure failure.
    assert_eq!(
        report["groups_abandoned"],
        serde_json::json!([]),
        "{report:#}"
    );
}

#[test]
fn a_run_whose_declared_environment_no_worker_serves_exits_1_naming_it() {
    let dir = temp_dir("run-unserved");
    let job = job_file(&dir, 1);
    declare_remote_environment(&job, "calculator", "webshop");
    let out = Command::new(BIN)
        .arg("run")
        .arg(&job)
        .args(["--time-scale", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("Failed"), "{stdout}");
    assert!(
        stdout.contains(
            "the job failed: task \"unit-conversion\": its environment \"webshop\" failed"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "unknown environment \"webshop\" (this host runs: calculator, frozenlake, sokoban)"
        ),
        "{stdout}"
    );
}

#[test]
fn a_run_whose_reward_function_refuses_every_payload_exits_1_naming_the_reward() {
    // regex_match is a function the reward workers implement, so the job validates; but it
    // needs a `pattern` the task's payload does not carry, so every call is refused as invalid.
    let dir = temp_dir("run-reward-invalid");
    let job = job_file(&dir, 1);
    let yaml = std::fs::read_to_string(&job)
        .unwrap()
        .replace("function: math_answer", "function: regex_match");
    std::fs::write(&job, yaml).unwrap();
    let out = Command::new(BIN)
        .arg("run")
        .arg(&job)
        .args(["--time-scale", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(
            "the job failed: task \"unit-conversion\": its reward \"exact-answer\" (function \"regex_match\") failed"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("InvalidPayload"), "{stdout}");
}

// ---------------------------------------------------------------- a real (OpenAI-compatible) engine

/// What the fake engine answers at each turn (turn = assistant messages already in the prompt),
/// and the action the agent loop extracts from it. The last one repeats.
const ENGINE_ANSWERS: [(&str, &str); 5] = [
    ("I'll go down. <action>down</action>", "down"),
    ("<action>calc: 6 * 7</action>", "calc: 6 * 7"),
    ("I am not sure.", "I am not sure."),
    ("<action>answer: 42</action>", "answer: 42"),
    ("Right, then. <action>right</action>", "right"),
];

const CHATML_SYSTEM: &str = "<|im_start|>system\n";

/// Where the fake engine's answer pauses (never sent): after its first chunk.
const PAUSE: &str = "\u{0}pause\u{0}";

/// How long the fake engine takes from an answer's first chunk to the rest of it.
const DECODE_STRETCH: Duration = Duration::from_millis(20);
const CHATML_ASSISTANT: &str = "<|im_start|>assistant\n";

/// A deterministic engine speaking vLLM's OpenAI-compatible wire format, byte by byte, over plain
/// TCP: `GET /v1/models`, and `POST /v1/completions` streamed as server-sent events in chunked
/// transfer encoding (text chunks, a usage chunk, `[DONE]`). It records every completion request.
struct FakeEngine {
    url: String,
    requests: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
}

fn fake_engine() -> FakeEngine {
    fake_engine_answering(true)
}

/// vLLM's answer to a prompt longer than the model's context, which retrying cannot fix.
const VLLM_CONTEXT_ERROR: &str = r#"{"object":"error","message":"This model's maximum context length is 32768 tokens. However, you requested 40000 tokens. Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#;

/// The fake engine; when `completes` is false it refuses every completion with HTTP 400.
fn fake_engine_answering(completes: bool) -> FakeEngine {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let seen = seen.clone();
            std::thread::spawn(move || {
                // Keep-alive: answer requests on this connection until the client closes it.
                let mut data = Vec::new();
                let mut buf = [0u8; 8192];
                loop {
                    let head_end = loop {
                        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => data.extend_from_slice(&buf[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&data[..head_end]).to_string();
                    let length: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    while data.len() < head_end + length {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => data.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body: Value = serde_json::from_slice(&data[head_end..head_end + length])
                        .unwrap_or_default();
                    data.drain(..head_end + length);
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                    let answer = if path == "/v1/models" {
                        let body = r#"{"object":"list","data":[{"id":"fake-policy","object":"model","created":1,"owned_by":"vllm","root":"fake-policy","parent":null,"max_model_len":32768}]}"#;
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                    } else if path == "/v1/completions" && !completes {
                        seen.lock().unwrap().push(body);
                        format!(
                            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{VLLM_CONTEXT_ERROR}",
                            VLLM_CONTEXT_ERROR.len()
                        )
                    } else if path == "/v1/completions" {
                        let prompt = body["prompt"].as_str().unwrap_or("").to_owned();
                        seen.lock().unwrap().push(body);
                        let turn = prompt.matches(CHATML_ASSISTANT).count().saturating_sub(1);
                        let text = ENGINE_ANSWERS[turn.min(ENGINE_ANSWERS.len() - 1)].0;
                        let (a, b) = text.split_at(text.len() / 2);
                        let chunk = |text: &str, finish: Option<&str>| {
                            serde_json::json!({
                                "id": "cmpl-fake", "object": "text_completion", "created": 1,
                                "model": "fake-policy",
                                "choices": [{"index": 0, "text": text, "logprobs": null,
                                             "finish_reason": finish, "stop_reason": null}],
                                "usage": null
                            })
                            .to_string()
                        };
                        let usage = serde_json::json!({
                            "id": "cmpl-fake", "object": "text_completion", "created": 1,
                            "model": "fake-policy", "choices": [],
                            "usage": {"prompt_tokens": prompt.len().div_ceil(4),
                                      "completion_tokens": text.split_whitespace().count(),
                                      "total_tokens": 0}
                        })
                        .to_string();
                        let mut out = String::from(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n",
                        );
                        for data in [
                            chunk(a, None),
                            chunk(b, Some("stop")),
                            usage,
                            "[DONE]".into(),
                        ] {
                            let event = format!("data: {data}\n\n");
                            out.push_str(&format!("{:x}\r\n{event}\r\n", event.len()));
                            if out.matches(PAUSE).count() == 0 {
                                // The rest of the answer comes one decode stretch later.
                                out.push_str(PAUSE);
                            }
                        }
                        out.push_str("0\r\n\r\n");
                        out
                    } else {
                        let body = r#"{"object":"error","message":"Not Found","type":"NotFoundError","code":404}"#;
                        format!(
                            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                    };
                    for (i, part) in answer.split(PAUSE).enumerate() {
                        if i > 0 {
                            std::thread::sleep(DECODE_STRETCH);
                        }
                        if stream
                            .write_all(part.as_bytes())
                            .and_then(|()| stream.flush())
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            });
        }
    });
    FakeEngine { url, requests }
}

/// The environment kind whose task opens a prompt (its first user message).
fn task_kind(task: &str) -> &'static str {
    if task.starts_with("Convert ") {
        "calculator"
    } else if task.starts_with("Reach the goal") {
        "frozenlake"
    } else if task.starts_with("Push every box") {
        "sokoban"
    } else {
        panic!("not a task of the job's environments: {task:?}")
    }
}

#[test]
fn workers_with_an_openai_engine_send_the_rendered_turns_and_the_environment_applies_its_text() {
    let engine = fake_engine();
    let dir = temp_dir("openai");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    // Both generation pools drive the fake engine: one names the model, one asks /v1/models.
    for (pool, model) in [("prefill", Some("fake-policy")), ("decode", None)] {
        let mut cmd = Command::new(BIN);
        cmd.args(["worker", "--scheduler", &url, "--pool", pool])
            .args(["--name", &format!("{pool}-0")])
            .args(["--engine", "openai", "--engine-url", &engine.url]);
        if let Some(model) = model {
            cmd.args(["--model", model]);
        }
        procs.0.push(
            cmd.stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
    }
    for pool in ["train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    let report = check_report(&report, 2, 0);
    let generations = report["engine_generations"].as_u64().unwrap();
    assert!(generations >= 64, "{report:#}");
    assert_eq!(report["emulated_gpus"], false);
    // The engine's timings came back as decode samples, marked as measured on an engine (not
    // modelled), each under the hardware's peak.
    let decode = report["profiles"]["measured"]["decode"]
        .as_object()
        .unwrap();
    assert!(!decode.is_empty(), "no decode samples: {report:#}");
    for (pool, estimate) in decode {
        let samples = estimate["samples"].as_array().unwrap();
        assert!(!samples.is_empty(), "{pool}: {estimate}");
        assert_eq!(estimate["modelled"], 0, "{pool}: {estimate}");
        for share in samples {
            let share = share.as_f64().unwrap();
            assert!(share > 0.0 && share <= 1.0, "{pool}: {share}");
        }
    }
    for pool in report["pools"].as_array().unwrap() {
        if pool["pool"] == "prefill" || pool["pool"] == "decode" {
            assert!(pool["kind"].as_str().unwrap().contains("openai"), "{pool}");
        }
    }

    let requests = engine.requests.lock().unwrap().clone();
    assert!(requests.len() as u64 >= generations, "{}", requests.len());
    let (mut invalid_seen, mut applied_seen, mut deepest) = (0, 0, 0);
    for request in &requests {
        assert_eq!(request["model"], "fake-policy", "{request}");
        assert_eq!(request["stream"], true);
        assert!(request["max_tokens"].as_u64().unwrap() > 0);
        let prompt = request["prompt"].as_str().unwrap();
        // The agent's ChatML template: system, the task, then each turn's output and
        // observation, ending with the assistant marker.
        assert!(prompt.starts_with(CHATML_SYSTEM), "{prompt}");
        assert!(prompt.ends_with(CHATML_ASSISTANT), "{prompt}");
        let messages: Vec<(&str, &str)> = prompt
            .split("<|im_start|>")
            .skip(1)
            .map(|m| {
                let (role, body) = m.split_once('\n').unwrap();
                (
                    role,
                    body.trim_end_matches("<|im_end|>\n").trim_end_matches('\n'),
                )
            })
            .collect();
        assert_eq!(messages[0].0, "system");
        assert_eq!(messages[1].0, "user");
        let kind = task_kind(messages[1].1);
        assert_eq!(messages.last().unwrap(), &("assistant", ""));
        let turns = &messages[2..messages.len() - 1];
        assert_eq!(turns.len() % 2, 0, "{prompt}");
        deepest = deepest.max(turns.len() / 2);
        for (t, pair) in turns.chunks(2).enumerate() {
            let ((r1, output), (r2, observation)) = (pair[0], pair[1]);
            assert_eq!((r1, r2), ("assistant", "user"), "{prompt}");
            // The text the engine generated came back as the turn's output...
            let (answer, action) = ENGINE_ANSWERS[t.min(ENGINE_ANSWERS.len() - 1)];
            assert_eq!(output, answer, "turn {t} of {prompt}");
            // ...and the environment applied the action in it: a move it understands, or an
            // invalid action by its own rules (an observation, not a failure).
            let valid = match kind {
                "calculator" => action.starts_with("calc:") || action.starts_with("answer:"),
                _ => ["up", "down", "left", "right"].contains(&action),
            };
            let invalid = format!("Invalid action {action:?}");
            if valid {
                assert!(!observation.contains("Invalid action"), "{observation}");
                applied_seen += 1;
                if action == "calc: 6 * 7" {
                    assert!(observation.contains("calc: 6 * 7 = 42"), "{observation}");
                }
            } else {
                assert!(observation.contains(&invalid), "{kind}: {observation}");
                invalid_seen += 1;
            }
        }
    }
    eprintln!(
        "fake engine: {} completion requests, {generations} generations used; turns applied: \
         {applied_seen} understood, {invalid_seen} invalid; deepest prompt: {deepest} turns",
        requests.len()
    );
    assert!(deepest >= 3, "no episode went past its third turn");
    assert!(
        invalid_seen > 0 && applied_seen > 0,
        "{invalid_seen} {applied_seen}"
    );
}

#[test]
fn rollfleet_run_drives_an_openai_engine_when_told_to() {
    let engine = fake_engine();
    let dir = temp_dir("run-openai");
    let job = job_file(&dir, 1);
    let out = Command::new(BIN)
        .arg("run")
        .arg(&job)
        .args([
            "--time-scale",
            "1",
            "--engine",
            "openai",
            "--engine-url",
            &engine.url,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("Succeeded - 1 of 1 RL steps"), "{stdout}");
    assert!(
        stdout.contains("generations by a real OpenAI-compatible engine"),
        "{stdout}"
    );
    assert!(!stdout.contains("GPU figures are EMULATED"), "{stdout}");
    assert!(stderr.contains(&engine.url), "{stderr}");
    let requests = engine.requests.lock().unwrap().len();
    assert!(
        requests >= 32,
        "{requests} completion requests for 32 trajectories"
    );
}

#[test]
fn an_engine_that_refuses_every_request_fails_the_job_with_its_reason_instead_of_retrying_forever()
{
    let engine = fake_engine_answering(false);
    let dir = temp_dir("refusing-engine");
    let job = job_file(&dir, 2);
    let report_path = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report_path, 5, &[]);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode"] {
        procs.0.push(
            Command::new(BIN)
                .args(["worker", "--scheduler", &url, "--pool", pool])
                .args(["--name", &format!("{pool}-0")])
                .args(["--engine", "openai", "--engine-url", &engine.url])
                .args(["--model", "fake-policy"])
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
    }
    for pool in ["train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(!status.success(), "a job that trained nothing succeeded");
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["phase"], "Failed", "{report:#}");
    let failure = report["failure"].as_str().unwrap();
    // The reason names the refusal as the engine put it.
    assert!(failure.contains("HTTP 400"), "{failure}");
    assert!(failure.contains("maximum context length"), "{failure}");
    let abandoned = report["groups_abandoned"].as_array().unwrap();
    assert!(!abandoned.is_empty(), "{report:#}");
    assert_eq!(report["trained"].as_array().unwrap().len(), 0, "{report:#}");
    // Each trajectory given up was tried as often as the limit says, not once and not forever.
    let requests = engine.requests.lock().unwrap().len() as u64;
    let limit = u64::from(rollfleet_core::config::DEFAULT_STAGE_FAILURE_LIMIT);
    assert!(
        requests >= limit * abandoned.len() as u64,
        "{requests} requests for {} groups",
        abandoned.len()
    );
}

// ---------------------------------------------------------------- GPU telemetry

/// Lines a child writes on stderr, echoed to ours and kept for the test.
fn stderr_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
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
fn wait_line(lines: &std::sync::mpsc::Receiver<String>, needle: &str) -> String {
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
fn metrics_address(log: &std::sync::mpsc::Receiver<String>) -> String {
    let line = wait_line(log, "Prometheus metrics on http://");
    line.split("http://")
        .nth(1)
        .unwrap()
        .trim_end_matches("/metrics")
        .to_owned()
}

/// A test peer `gpu-peer` of the decode pool that declares two GPUs of `name` with telemetry.
fn gpu_peer(name: &str, memory_bytes: u64) -> HardwareInventory {
    use rollfleet_proto::v1::{GpuDevice, GpuTelemetryInfo};
    let device = |index: u32| GpuDevice {
        index,
        name: name.into(),
        uuid: format!("GPU-test-{index}"),
        memory_bytes,
    };
    HardwareInventory {
        hostname: "gpu-peer".into(),
        pool: "decode".into(),
        gpu_telemetry: Some(GpuTelemetryInfo {
            available: true,
            unavailable_reason: String::new(),
            devices: vec![device(0), device(1)],
        }),
        ..Default::default()
    }
}

/// The scheduler's Prometheus exposition.
fn scrape(addr: &str) -> String {
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
fn sample(exposition: &str, series: &str) -> Option<f64> {
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
fn without_job_labels(line: &str) -> String {
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

#[test]
fn gpu_telemetry_is_exported_as_workers_report_it_and_absent_where_there_is_no_driver() {
    use rollfleet_proto::v1::{GpuReading, GpuTelemetryInfo, WorkerLoad};
    let dir = temp_dir("telemetry");
    let job = job_file(&dir, 1);
    let report = dir.join("report.json");
    // The job never starts (it waits for 100 workers): only registration, heartbeats and the
    // exposition are tested.
    let mut sched = Command::new(BIN)
        .arg("scheduler")
        .arg(&job)
        .args(["--listen", "127.0.0.1:0", "--lease-ms", "2000"])
        .args(["--expect-workers", "100", "--metrics-addr", "127.0.0.1:0"])
        .arg("--report")
        .arg(&report)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(sched.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = format!(
        "http://{}",
        line.trim().strip_prefix("listening on ").unwrap()
    );
    let sched_log = stderr_lines(&mut sched);
    let metrics = metrics_address(&sched_log);
    let mut procs = Procs(vec![sched]);

    // A real worker on this machine. With no NVIDIA driver (this project's machines) it says so
    // once, and its heartbeats carry no GPU figure.
    let no_driver = rollfleet_gpu::discover().err();
    let mut real = Command::new(BIN)
        .args(["worker", "--scheduler", &url, "--pool", "decode"])
        .args(["--name", "real-node"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let real_log = stderr_lines(&mut real);
    procs.0.push(real);
    let said = wait_line(&real_log, "GPU telemetry");
    if let Some(reason) = &no_driver {
        assert!(said.contains("no GPU telemetry"), "{said}");
        assert!(said.contains(&reason.0), "{said} / {reason}");
        let told = wait_line(&sched_log, "(decode@real-node) has no GPU telemetry");
        assert!(told.contains("NVML"), "{told}");
    }

    let lease_ms = rt().block_on(async {
        let mut client = WorkerServiceClient::connect(url.clone()).await.unwrap();
        // A peer that reads two GPUs: it declares them, then reports them with a heartbeat.
        let lease = register_peer(&mut client, gpu_peer("NVIDIA H800", 85_899_345_920)).await;
        let reading = |index, utilization, memory_used_bytes| GpuReading {
            index,
            utilization,
            memory_used_bytes,
        };
        client
            .heartbeat(HeartbeatRequest {
                worker_id: lease.worker_id.clone(),
                epoch: 1,
                load: Some(WorkerLoad {
                    gpus: vec![reading(0, 0.42, 1_234_567), reading(1, 0.9, 7_654_321)],
                    gpu_utilization: Some(0.66),
                    gpu_memory_used_bytes: Some(8_888_888.0),
                    ..Default::default()
                }),
            })
            .await
            .unwrap();

        // A peer that registered without GPU telemetry and then sends readings (made up: it has
        // no driver to read them from) is refused and cut off.
        let liar = register_peer(
            &mut client,
            HardwareInventory {
                hostname: "liar".into(),
                pool: "decode".into(),
                gpu_telemetry: Some(GpuTelemetryInfo {
                    available: false,
                    unavailable_reason: "no driver".into(),
                    devices: vec![],
                }),
                ..Default::default()
            },
        )
        .await;
        let zeros = HeartbeatRequest {
            worker_id: liar.worker_id.clone(),
            epoch: 1,
            load: Some(WorkerLoad {
                gpus: vec![reading(0, 0.0, 0)],
                ..Default::default()
            }),
        };
        let refused = client.heartbeat(zeros.clone()).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("without GPU telemetry"),
            "{refused:?}"
        );
        let gone = client.heartbeat(zeros).await.unwrap_err();
        assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");

        // A peer whose profile sample is not a number is refused and cut off, naming the
        // sample and the field.
        let nan = register_peer(
            &mut client,
            HardwareInventory {
                hostname: "nan".into(),
                pool: "decode".into(),
                ..Default::default()
            },
        )
        .await;
        let sample = |seconds: f64| rollfleet_proto::v1::ProfileSample {
            kind: rollfleet_proto::v1::ProfileKind::Decode as i32,
            flops: 1e12,
            bytes: 1e9,
            seconds,
            gpus: 2,
            emulated: true,
        };
        let bad = HeartbeatRequest {
            worker_id: nan.worker_id.clone(),
            epoch: 1,
            load: Some(WorkerLoad {
                samples: vec![sample(0.01), sample(f64::NAN)],
                ..Default::default()
            }),
        };
        let refused = client.heartbeat(bad.clone()).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("load.samples[1]"), "{refused:?}");
        let gone = client.heartbeat(bad).await.unwrap_err();
        assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
        (lease.ttl_ms, lease.worker_id)
    });
    // Metrics name a worker by its number, never by its lease's secret.
    let (ttl_ms, lease_id) = lease_ms;
    let peer = lease_id.split('-').next().unwrap().to_owned();
    assert!(
        peer.starts_with('w') && peer.len() < lease_id.len(),
        "{lease_id}"
    );

    // Two of the real worker's heartbeats (every ttl/4) have come and gone.
    std::thread::sleep(Duration::from_millis(ttl_ms / 2 + 300));
    let exposition = scrape(&metrics);
    let series = |name: &str, gpu: u32| {
        format!(
            "rollfleet_{name}{{gpu=\"{gpu}\",host=\"gpu-peer\",pool=\"decode\",worker=\"{peer}\"}}"
        )
    };
    assert_eq!(
        sample(&exposition, &series("gpu_utilization_ratio", 0)),
        Some(0.42),
        "{exposition}"
    );
    assert_eq!(
        sample(&exposition, &series("gpu_utilization_ratio", 1)),
        Some(0.9)
    );
    assert_eq!(
        sample(&exposition, &series("gpu_memory_used_bytes", 0)),
        Some(1_234_567.0)
    );
    assert_eq!(
        sample(&exposition, &series("gpu_memory_used_bytes", 1)),
        Some(7_654_321.0)
    );
    assert_eq!(
        sample(&exposition, &series("gpu_memory_total_bytes", 1)),
        Some(85_899_345_920.0)
    );
    assert!(exposition.contains("name=\"NVIDIA H800\""), "{exposition}");
    // Nothing, not zeros, for the workers without a driver (the real one here, and the liar).
    let gpu_lines: Vec<&str> = exposition
        .lines()
        .filter(|l| l.starts_with("rollfleet_gpu_"))
        .collect();
    assert!(
        gpu_lines.iter().all(|l| l.contains("host=\"gpu-peer\"")),
        "{gpu_lines:#?}"
    );
    // Per GPU: utilisation, memory used, memory total, info.
    assert_eq!(gpu_lines.len(), 2 * 4, "{gpu_lines:#?}");
    if no_driver.is_some() {
        assert_eq!(
            sample(
                &exposition,
                "rollfleet_workers_without_gpu_telemetry{pool=\"decode\"}"
            ),
            Some(1.0),
            "the real worker (the liar is cut off): {exposition}"
        );
    }

    // The peer goes silent: its lease runs out and its GPUs leave the exposition.
    let start = Instant::now();
    while scrape(&metrics).contains("host=\"gpu-peer\"") {
        assert!(start.elapsed() < DEADLINE, "the silent peer's GPUs stayed");
        std::thread::sleep(Duration::from_millis(200));
    }

    // Stop: the report says what each worker said; the real worker said it once.
    let pid = procs.0[0].id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert_eq!(status.code(), Some(1));
    assert!(wait_exit(&mut procs.0[1], DEADLINE).success());
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let said: Vec<&Value> = report["gpu_telemetry"].as_array().unwrap().iter().collect();
    let of = |host: &str| {
        *said
            .iter()
            .find(|t| {
                t["worker"]
                    .as_str()
                    .unwrap()
                    .ends_with(&format!("@{host})"))
            })
            .unwrap()
    };
    assert_eq!(of("gpu-peer")["gpu_telemetry"], "available");
    assert_eq!(of("gpu-peer")["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(of("liar")["gpu_telemetry"], "unavailable");
    if let Some(reason) = &no_driver {
        assert_eq!(of("real-node")["gpu_telemetry"], "unavailable");
        assert_eq!(of("real-node")["reason"], reason.0.as_str());
        // Everything else it wrote, to its exit.
        let lines: Vec<String> = real_log.iter().collect();
        let again = lines.iter().filter(|l| l.contains("GPU telemetry")).count();
        assert_eq!(again, 0, "the absence is said once: {lines:#?}");
    }
}

// ---------------------------------------------------------------- a real Prometheus

/// The monitoring manifests: `manifests/monitoring/NAME`.
fn monitoring_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../manifests/monitoring")
        .join(name)
}

/// A `prometheus` server on loopback, run from the shipped `prometheus.yml` and rules with the
/// scrape target, the intervals and the rules' path changed for the test.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Prometheus {
    fn start(dir: &Path, target: &str) -> Prometheus {
        let shipped = std::fs::read_to_string(monitoring_file("prometheus.yml")).unwrap();
        let rules = monitoring_file("rollfleet-rules.yaml");
        let config = shipped
            .replace("scrape_interval: 15s", "scrape_interval: 200ms")
            .replace("evaluation_interval: 15s", "evaluation_interval: 500ms")
            .replace("- rollfleet-rules.yaml", &format!("- {}", rules.display()))
            .replace("rollfleet-scheduler:9464", target);
        assert!(
            config.contains(target) && config.contains("200ms"),
            "{config}"
        );
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        // A free port: bound, read and let go (Prometheus cannot report a port it picked).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `prometheus` ({e}): install Prometheus 2.x (Debian: `apt-get install \
                     prometheus`; .ci/run does)"
                )
            });
        let prometheus = Prometheus { child, addr };
        let start = Instant::now();
        while !prometheus.get("/-/ready").starts_with("HTTP/1.0 200") {
            assert!(start.elapsed() < DEADLINE, "Prometheus never became ready");
            std::thread::sleep(Duration::from_millis(200));
        }
        prometheus
    }

    /// The whole answer (head and body) to `GET path`. HTTP/1.0, so the body is never chunked;
    /// an empty string while nothing listens.
    fn get(&self, path: &str) -> String {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(&self.addr) else {
            return String::new();
        };
        let request = format!("GET {path} HTTP/1.0\r\nHost: prometheus\r\n\r\n");
        let mut out = String::new();
        if s.write_all(request.as_bytes()).is_err() || s.read_to_string(&mut out).is_err() {
            return String::new();
        }
        out
    }

    /// The JSON body of an API answer, checked for `"status": "success"`.
    fn api(&self, path: &str) -> Value {
        let answer = self.get(path);
        let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
        assert_eq!(v["status"], "success", "{path}: {v:#}");
        v["data"].clone()
    }

    /// An instant query evaluated at `time` (Unix seconds): the result's series.
    fn query(&self, promql: &str, time: f64) -> Vec<Value> {
        let data = self.api(&format!(
            "/api/v1/query?query={}&time={time:.3}",
            percent_encoded(promql)
        ));
        data["result"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn percent_encoded(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every query of the shipped Grafana dashboard, with its panel's title, as Prometheus would get
/// it from Grafana with the job `rljob` of `namespace` and every pool selected.
fn dashboard_queries(rljob: &str, namespace: &str) -> Vec<(String, String)> {
    let dashboard: Value =
        serde_json::from_slice(&std::fs::read(monitoring_file("grafana-dashboard.json")).unwrap())
            .unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            queries.push((
                panel["title"].as_str().unwrap().to_owned(),
                expr.replace("$pool", ".*")
                    .replace("$rljob", rljob)
                    .replace("$namespace", namespace)
                    .replace("$__rate_interval", "1m"),
            ));
        }
    }
    queries
}

#[test]
fn a_real_prometheus_scrapes_the_scheduler_runs_the_shipped_rules_and_answers_every_dashboard_query()
 {
    use rollfleet_proto::v1::{GpuReading, WorkerLoad};
    let dir = temp_dir("prometheus");
    let job = job_file(&dir, 5);
    // In a namespace, as the operator's jobs are: every series carries it.
    let yaml = std::fs::read_to_string(&job).unwrap();
    assert!(yaml.contains("\n  name: quickstart\n"));
    let yaml = yaml.replace(
        "\n  name: quickstart\n",
        "\n  name: quickstart\n  namespace: rl-team\n",
    );
    std::fs::write(&job, yaml).unwrap();
    let report = dir.join("report.json");
    let (mut sched, url) = start_scheduler(
        &job,
        &report,
        5,
        &["--metrics-addr", "127.0.0.1:0"],
        Stdio::piped(),
    );
    let sched_log = stderr_lines(&mut sched);
    let metrics = metrics_address(&sched_log);
    let mut procs = Procs(vec![sched]);
    let prometheus = Prometheus::start(&dir, &metrics);
    // Scraped before the job starts, so that every rate has samples on both sides of it.
    let start = Instant::now();
    loop {
        let targets = prometheus.api("/api/v1/targets");
        if targets["activeTargets"][0]["health"] == "up" {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "never scraped: {targets:#}");
        std::thread::sleep(Duration::from_millis(200));
    }

    // A peer reading two GPUs (this machine has none), so that the GPU panels have series too.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peer = {
        let (url, stop) = (url.clone(), stop.clone());
        std::thread::spawn(move || {
            rt().block_on(async {
                let mut client = WorkerServiceClient::connect(url).await.unwrap();
                let lease =
                    register_peer(&mut client, gpu_peer("NVIDIA H20", 103_079_215_104)).await;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let reading = |index, utilization| GpuReading {
                        index,
                        utilization,
                        memory_used_bytes: 60_000_000_000,
                    };
                    let beat = HeartbeatRequest {
                        worker_id: lease.worker_id.clone(),
                        epoch: 1,
                        load: Some(WorkerLoad {
                            gpus: vec![reading(0, 0.7), reading(1, 0.8)],
                            ..Default::default()
                        }),
                    };
                    if client.heartbeat(beat).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            });
        })
    };
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }

    // A time when trajectories had been trained for three scrapes (a rate needs two samples of
    // a series, and the staleness counters are born with the first trajectory trained): the
    // queries are evaluated at it, so the job may end (and its series go stale) before they are.
    let start = Instant::now();
    let at = loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let trained = prometheus.query(
            "min(count_over_time(rollfleet_trajectories_trained_by_staleness_total[1m])) >= 3",
            now,
        );
        if let Some(sample) = trained.first() {
            break sample["value"][0].as_f64().unwrap();
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no trajectory trained was scraped"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    // A scrape mid-job passes Prometheus's own linter, histograms included, and every sample
    // names the job.
    let exposition = scrape(&metrics);
    let body = exposition.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let lint = promtool_check_metrics(body);
    assert_eq!(lint, "", "promtool check metrics:\n{lint}");
    assert_eq!(
        sample(&exposition, "rollfleet_job_phase{phase=\"Running\"}"),
        Some(1.0),
        "{body}"
    );
    for present in [
        "rollfleet_stage_duration_seconds_bucket{kind=\"decode\"",
        "rollfleet_stage_duration_seconds_bucket{kind=\"environment_step\"",
        "rollfleet_stage_queue_wait_seconds_bucket{kind=\"decode\"",
        "rollfleet_rl_step_duration_seconds_bucket{",
        "rollfleet_pool_busy_seconds_total{pool=\"decode\"",
        "rollfleet_build_info{version=",
        "process_cpu_seconds_total{",
        "process_resident_memory_bytes{",
        "process_open_fds{",
    ] {
        assert!(body.contains(present), "{present} not in {body}");
    }
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            line.contains("rljob=\"quickstart\"") && line.contains("namespace=\"rl-team\""),
            "{line}"
        );
    }
    for (panel, expr) in dashboard_queries("quickstart", "rl-team") {
        let series = prometheus.query(&expr, at);
        assert!(
            !series.is_empty(),
            "panel {panel:?}: {expr} returned nothing"
        );
        if expr.contains("rollfleet_gpu_") {
            let text = Value::Array(series).to_string();
            assert!(text.contains("gpu-peer"), "panel {panel:?}: {text}");
        }
    }
    // Trained trajectories are within the job's staleness bound (maxStaleness 1).
    for series in prometheus.query("rollfleet_trajectories_trained_by_staleness_total", at) {
        let versions: u64 = series["metric"]["versions"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(versions <= 1, "{series}");
    }
    // Each pool's busy share, as the scheduler computed it.
    let pools: Vec<String> = prometheus
        .query("rollfleet_pool_busy_ratio", at)
        .iter()
        .map(|s| s["metric"]["pool"].as_str().unwrap().to_owned())
        .collect();
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        assert!(pools.iter().any(|p| p == pool), "{pool} not in {pools:?}");
    }

    // The shipped rules loaded and evaluated without an error, and the recording rules recorded.
    let start = Instant::now();
    loop {
        let groups = prometheus.api("/api/v1/rules")["groups"].clone();
        let rules: Vec<&Value> = groups
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap())
            .collect();
        assert_eq!(rules.len(), 15, "{groups:#}");
        for rule in &rules {
            assert_ne!(rule["health"], "err", "{rule:#}");
        }
        if rules.iter().all(|r| r["health"] == "ok") {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "rules never evaluated: {groups:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for record in [
        "rollfleet:pool_busy_ratio:avg5m",
        "rollfleet:trajectories_trained:rate5m",
        "rollfleet:stage_completions:rate5m",
        "rollfleet:gpu_memory_used:ratio",
    ] {
        let recorded = prometheus.query(&format!("last_over_time({record}[5m])"), at + 5.0);
        assert!(!recorded.is_empty(), "{record} was never recorded");
    }

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    peer.join().unwrap();
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    check_report(&report, 5, 0);

    // The job ended normally and its scheduler exited: Prometheus scraped its end before it
    // went, and the alert on a scheduler that stops answering holds its peace.
    let start = Instant::now();
    let now = loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        if !prometheus
            .query("up{job=\"rollfleet\"} == 0", now)
            .is_empty()
        {
            break now;
        }
        assert!(start.elapsed() < DEADLINE, "the exit was never scraped");
        std::thread::sleep(Duration::from_millis(200));
    };
    let ended = prometheus.query(
        "last_over_time(rollfleet_job_end_time_seconds{phase=\"Succeeded\", rljob=\"quickstart\", namespace=\"rl-team\"}[5m])",
        now,
    );
    assert_eq!(ended.len(), 1, "the end was not scraped: {ended:?}");
    let down = alert_expr("RollfleetSchedulerDown");
    let fired = prometheus.query(&down, now);
    assert!(fired.is_empty(), "{down} after a normal end: {fired:?}");
}

/// The expression of the shipped alert `name`.
fn alert_expr(name: &str) -> String {
    let rules: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(monitoring_file("rollfleet-rules.yaml")).unwrap(),
    )
    .unwrap();
    let groups = rules["groups"].as_sequence().unwrap();
    let rule = groups
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap())
        .find(|r| r["alert"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no alert {name}"));
    rule["expr"].as_str().unwrap().to_owned()
}

/// What `promtool check metrics` says of an exposition (nothing: it is clean); fails the test if
/// promtool cannot run.
fn promtool_check_metrics(exposition: &str) -> String {
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

/// A `rollfleet` command with `ROLLFLEET_TOKEN` set to `token` (or removed).
fn with_token(args: &[&str], token: Option<&str>) -> Command {
    let mut command = Command::new(BIN);
    command.args(args);
    match token {
        Some(t) => command.env("ROLLFLEET_TOKEN", t),
        None => command.env_remove("ROLLFLEET_TOKEN"),
    };
    command
}

#[test]
fn a_scheduler_with_a_token_serves_only_the_peers_that_carry_it() {
    use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
    const TOKEN: &str = "job-secret-0123456789abcdef";
    let dir = temp_dir("token");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let token_arg = token_file.to_str().unwrap();
    let (mut sched, url) = start_scheduler(
        &job,
        &report,
        5,
        &["--token-file", token_arg, "--metrics-addr", "127.0.0.1:0"],
        Stdio::piped(),
    );
    let log = stderr_lines(&mut sched);
    let metrics = metrics_address(&log);
    let mut procs = Procs(vec![sched]);

    // Workers without the token, or with another, are refused at registration and say why.
    for (token, why) in [
        (None, "none was sent"),
        (Some("another-token-0123456789"), "not this scheduler's"),
    ] {
        let mut intruder = with_token(&["worker", "--scheduler", &url, "--pool", "envs"], token)
            .args(["--name", "intruder"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Bounded: a scheduler that let it in would keep it waiting for the job to start.
        let exit = wait_exit(&mut intruder, Duration::from_secs(60));
        let mut said = String::new();
        std::io::Read::read_to_string(&mut intruder.stderr.take().unwrap(), &mut said).unwrap();
        assert_eq!(exit.code(), Some(1), "{said}");
        assert!(said.contains(why), "{said}");
    }
    // Neither the job service nor the trainer feed answers a call without it.
    rt().block_on(async {
        let mut jobs = JobServiceClient::connect(url.clone()).await.unwrap();
        let refused = jobs
            .cancel(JobRef {
                job: "quickstart".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
        let mut feed = TrainerFeedClient::connect(url.clone()).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(1, 8)).unwrap();
        let refused = feed
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    });
    assert_job_status_refused_without_token(BIN, &url);
    // Every refusal is counted by why (no token: the first worker, the cancel, the feed and the
    // status; another token: the second worker), and the first is in the log with its peer.
    let exposition = scrape(&metrics);
    let refused = |reason: &str| {
        sample(
            &exposition,
            &format!("rollfleet_unauthenticated_calls_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(
        (refused("missing"), refused("wrong")),
        (Some(4.0), Some(1.0)),
        "{exposition}"
    );
    wait_line(&log, "refused a call from 127.0.0.1:");

    // Workers with the token (from the file, or from the environment) run the job to the end;
    // the refused calls changed nothing (the cancel above did not cancel it).
    for (i, pool) in ["prefill", "decode", "train", "envs", "rewards"]
        .into_iter()
        .enumerate()
    {
        let mut command = if i % 2 == 0 {
            with_token(&["worker", "--token-file", token_arg], None)
        } else {
            with_token(&["worker"], Some(TOKEN))
        };
        let child = command
            .args(["--scheduler", &url, "--pool", pool, "--name", pool])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        procs.0.push(child);
    }
    let watched = with_token(
        &[
            "job",
            "watch",
            "quickstart",
            "--scheduler",
            &url,
            "-o",
            "json",
        ],
        Some(TOKEN),
    )
    .output()
    .unwrap();
    assert_eq!(watched.status.code(), Some(0), "{watched:?}");
    let exit = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(exit.success(), "{exit:?}");
    let report = check_report(&report, 2, 0);
    // Every worker that registered is listed with what it said of its GPUs: the five, no
    // intruder.
    let registered: Vec<&str> = report["gpu_telemetry"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker"].as_str().unwrap())
        .collect();
    assert_eq!(registered.len(), 5, "{report:#}");
    assert!(
        registered.iter().all(|w| !w.contains("intruder")),
        "a refused worker was registered: {registered:?}"
    );
}
