//! Re-planning across real processes: a lost node planned around and a joining one given
//! replicas, a re-plan surviving a scheduler failover, a trainer's pool shrinking and growing
//! back, nodes measured slower than planned (or profiled by their replicas) planned with, and a
//! scheduler stopped mid re-plan that exits at once and re-plans when restarted on its journal.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use rollfleet_proto::v1::JobRef;
use rollfleet_proto::v1::job_service_client::JobServiceClient;
use serde_json::Value;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

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

/// The quick-start job with `extra` more GPU pools of assorted sizes: every plan of it, a re-plan
/// included, takes seconds or more (the search grows with every pool).
fn slow_to_replan_job(dir: &Path, extra: usize) -> (PathBuf, Vec<String>) {
    let job = job_file(dir, 24);
    add_gpu_pools(&job, extra);
    let names = ["prefill", "decode", "train", "envs", "rewards"]
        .into_iter()
        .map(str::to_owned)
        .chain((0..extra).map(|i| format!("g{i}")))
        .collect();
    (job, names)
}

/// A test peer holding a lease in a pool (registered, its work stream open) that does no work;
/// dropped, its stream ends and the scheduler loses it.
struct IdlePeer {
    _outbox: tokio::sync::mpsc::UnboundedSender<rollfleet_proto::v1::WorkerMessage>,
    _inbound: tonic::Streaming<rollfleet_proto::v1::SchedulerMessage>,
}

impl IdlePeer {
    async fn attach(channel: tonic::transport::Channel, name: &str, pool: &str) -> IdlePeer {
        use rollfleet_proto::v1::HardwareInventory;
        use rollfleet_proto::v1::worker_service_client::WorkerServiceClient;
        let mut client = WorkerServiceClient::new(channel);
        let lease = register_peer(
            &mut client,
            HardwareInventory {
                hostname: name.into(),
                pool: pool.into(),
                ..Default::default()
            },
        )
        .await;
        let (outbox, inbound) = open_work_stream(&mut client, &lease).await;
        IdlePeer {
            _outbox: outbox,
            _inbound: inbound,
        }
    }
}

/// Spawns `rollfleet scheduler JOB --journal JOURNAL` on `listen` with leases of ten minutes (a
/// re-plan of a job of a hundred pools holds the scheduler longer than the harness's two
/// seconds, and the peers here do not heartbeat); returns it, its address and its log.
fn long_lease_scheduler(
    job: &Path,
    report: &Path,
    journal: &Path,
    expect: usize,
    listen: &str,
) -> (Child, String, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut child = Command::new(BIN)
        .arg("scheduler")
        .arg(job)
        .args([
            "--listen",
            listen,
            "--time-scale",
            "1",
            "--lease-ms",
            "600000",
        ])
        .args(["--expect-workers", &expect.to_string()])
        .arg("--report")
        .arg(report)
        .arg("--journal")
        .arg(journal)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_owned();
    let log = tee_log(&mut child);
    (child, addr, log)
}

/// Sends SIGTERM to `child`, waits for it to exit and returns its exit code and how long that
/// took.
fn terminate(child: &mut Child) -> (Option<i32>, std::time::Duration) {
    let pid = child.id().to_string();
    let signalled = std::time::Instant::now();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success());
    let status = wait_exit(child, DEADLINE);
    (status.code(), signalled.elapsed())
}

#[test]
fn a_scheduler_told_to_stop_while_it_re_plans_exits_within_seconds_and_a_restart_on_its_journal_makes_the_re_plan()
 {
    use std::time::Duration;
    let dir = temp_dir("stop-replanning");
    // 100 more pools: the plan, and each re-plan, take seconds to a minute on a loaded machine.
    let (job, pools) = slow_to_replan_job(&dir, 100);
    let report = dir.join("report.json");
    let journal = dir.join("scheduler.journal");
    let (sched, addr, log) =
        long_lease_scheduler(&job, &report, &journal, pools.len(), "127.0.0.1:0");
    let url = format!("http://{addr}");
    let mut procs = Procs(vec![sched]);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut peers = runtime.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut peers = Vec::new();
        for pool in &pools {
            peers.push(IdlePeer::attach(channel.clone(), &format!("{pool}-0"), pool).await);
        }
        peers
    });
    wait_log(&log, "scheduler: job quickstart starts");
    // The node of pool g4 (40 GPUs, all of them serving) goes: the pool is planned again.
    let victim = pools.iter().position(|p| p == "g4").unwrap();
    drop(peers.remove(victim));
    wait_log(&log, "(g4@g4-0) is cut off");
    // Well into the re-plan, which takes as long as a plan of the job.
    std::thread::sleep(Duration::from_millis(1000));
    // The scheduler serves while the actor re-plans: the re-plan holds no thread that polls
    // the network or the stop signal.
    let answered = runtime.block_on(async {
        let call = async {
            let mut client = JobServiceClient::connect(url.clone()).await?;
            let job = JobRef {
                job: "quickstart".into(),
            };
            anyhow::Ok(client.status(job).await?.into_inner())
        };
        tokio::time::timeout(Duration::from_secs(5), call).await
    });
    assert!(
        matches!(answered, Ok(Ok(_))),
        "no status within 5 s while the scheduler re-plans: {answered:?}"
    );
    let (code, took) = terminate(&mut procs.0[0]);
    drop(peers);
    let lines: Vec<String> = log.try_iter().collect();
    assert!(
        !lines.iter().any(|l| l.contains("re-plan:")),
        "the re-plan ended before the stop: the test did not stop a re-plan: {lines:#?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "it took {took:?} to stop mid re-plan"
    );
    // A stop mid-job exits 1 (the job did not succeed), as a stop at any other moment does.
    assert_eq!(code, Some(1));
    assert!(
        lines
            .iter()
            .any(|l| l.contains("stopped while re-planning")),
        "{lines:#?}"
    );
    // The job was not cancelled: no report, and the journal ends before the step that caused
    // the re-plan was acted on.
    assert!(
        !report.exists(),
        "a report was written for a job that was not cancelled"
    );
    // A scheduler restarted on the journal replays that step whole, re-plan included, and
    // resumes the job; stopped then, it cancels the job as usual.
    let (sched, _, log) = long_lease_scheduler(&job, &report, &journal, pools.len(), &addr);
    procs.0[0] = sched;
    wait_log(&log, "scheduler: resumed job quickstart");
    let (code, _) = terminate(&mut procs.0[0]);
    assert_eq!(code, Some(1), "a cancelled job is not a success");
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(report["phase"], "Cancelled", "{report:#}");
    let replans = report["replans"].as_array().unwrap();
    assert_eq!(replans.len(), 1, "{report:#}");
    assert_eq!(replans[0]["pool"], "g4", "{report:#}");
    assert_eq!(
        (
            replans[0]["gpus_before"].as_u64(),
            replans[0]["gpus_after"].as_u64()
        ),
        (Some(40), Some(0)),
        "{report:#}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
