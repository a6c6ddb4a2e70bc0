//! A scheduler's guards across real processes: TLS (server and client certificates) and the
//! bearer token, with clients that lack them refused.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::worker_service_client::WorkerServiceClient;
use rollfleet_proto::v1::{HardwareInventory, HeartbeatRequest, JobRef};
use serde_json::Value;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;
#[path = "common/tls.rs"]
mod tls;
use tls::tls_files;
#[path = "common/refused.rs"]
mod refused;
use refused::assert_job_status_refused_without_token;

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
