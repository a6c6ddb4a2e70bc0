//! Workers across real processes: killed mid-run or told to stop, with no trajectory lost or
//! trained twice; the only decode node leaving and the next one joining; replicas placed in
//! proportion to the GPUs each node declares.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::process::Command;
use std::time::Instant;

use rollfleet_proto::v1::JobPhase;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

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
