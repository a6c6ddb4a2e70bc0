//! Jobs on a running scheduler across real processes: `rollfleet job list`, `logs`, `cancel`, a
//! scheduler started without a job taking the first valid one submitted, and schedulers told
//! to stop.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use serde_json::Value;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

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
    // Its first task's actions come from a CSV file beside the job, named by a relative path:
    // the scheduler, whose working directory is elsewhere, must read that file.
    std::fs::write(dir.join("actions.csv"), "tokens\n20\n48\n64\n120\n").unwrap();
    let yaml = std::fs::read_to_string(&job).unwrap();
    let from_csv = "actionTokens: { distribution: csv, path: actions.csv, column: tokens }";
    let lognormal = "actionTokens: { distribution: lognormal, median: 48, p99: 200, max: 256 }";
    assert!(yaml.contains(lognormal));
    std::fs::write(&job, yaml.replacen(lognormal, from_csv, 1)).unwrap();
    assert_ne!(std::env::current_dir().unwrap(), dir);
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
