//! Environments and reward functions across real processes: an environment served by a remote
//! Python server, and runs that fail (exit 1) naming the environment or reward at fault.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

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
