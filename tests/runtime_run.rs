//! `rollfleet run` across real processes: every step trained on emulated GPUs, each task's
//! reward and success in its report, status and metrics, measured profiles, and environments
//! modelled as the simulator does.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

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
    // What the staleness bound cost: the turns generated again, and the finished groups among
    // them that expired waiting for the trainer.
    assert!(
        stdout.contains(" finished groups expired waiting for the trainer); workers lost: "),
        "{stdout}"
    );
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(pool)),
            "{pool}: {stdout}"
        );
    }
    assert!(stderr.contains("GPUs are emulated"), "{stderr}");
    // The scheduler chose the job's admission window by simulating it, as `rollfleet sim` does.
    let log = stderr
        .lines()
        .find_map(|l| l.strip_prefix("rollfleet run: processes log to "))
        .unwrap_or_default();
    let log = std::fs::read_to_string(log.trim()).unwrap_or_default();
    assert!(
        log.contains("admission window: ") && log.contains("(chosen)"),
        "{log}"
    );
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
