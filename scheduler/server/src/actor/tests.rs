//! Unit tests of the actor: outcome figures per task and step, success thresholds, the report's
//! JSON, and forgetting workers whose lease expired or that left.

use super::report::{TrajectoryOutcome, outcomes};
use super::*;

fn trajectory(reward: f64, turns: u64, staleness: u64) -> TrajectoryOutcome {
    TrajectoryOutcome {
        reward,
        modelled: false,
        turns,
        prompt_tokens: 100 * turns,
        action_tokens: 10 * turns,
        staleness,
    }
}

/// An actor of the quick-start job that waits for 100 workers (the job never starts).
fn waiting_actor() -> Actor {
    let yaml = include_str!("../../../../examples/jobs/quickstart.yaml");
    let plan = crate::job::JobSlot::new(7, Duration::from_secs(60))
        .plan(yaml, "quickstart.yaml")
        .expect("the quick-start job plans");
    let options = ActorOptions {
        time_scale: 1.0,
        lease_ttl: Duration::from_secs(2),
        expect_workers: 100,
        report: None,
        replan_on_drift: None,
        until_stopped: false,
    };
    Actor::new(
        Arc::new(plan),
        options,
        Arc::new(watch::channel(JobStatus::default()).0),
        Arc::new(Metrics::new().expect("metrics")),
        Arc::new(FeedLog::default()),
    )
}

#[test]
fn a_worker_whose_lease_expired_or_that_left_is_forgotten_with_its_hostname_and_gpu_series() {
    let mut actor = waiting_actor();
    let host = |i: usize| format!("node-{i}-{}", "x".repeat(200));
    let device = |index: u32| rollfleet_proto::v1::GpuDevice {
        index,
        name: "NVIDIA H20".into(),
        uuid: format!("GPU-{index}"),
        memory_bytes: 96 << 30,
    };
    for i in 0..100 {
        let inventory = HardwareInventory {
            hostname: host(i),
            pool: "decode".into(),
            gpu_telemetry: Some(GpuTelemetryInfo {
                available: true,
                unavailable_reason: String::new(),
                devices: vec![device(0), device(1)],
            }),
            ..Default::default()
        };
        actor
            .register(inventory, format!("{i:032x}"))
            .expect("registered");
    }
    assert_eq!(actor.workers.len(), 100);
    assert!(actor.metrics.render().contains(&host(99)));
    // One says it is leaving (it holds nothing, so it is released at once)...
    actor.worker_leaving(1, "node drain");
    // ... and the others' leases run out.
    actor.at += Duration::from_secs(3);
    actor.on_tick();
    assert!(
        actor.workers.is_empty(),
        "{} gone workers still kept",
        actor.workers.len()
    );
    assert!(!actor.metrics.render().contains("node-"));
    // Worker w6 was the sixth to register (secret 5).
    let lease = format!("w6-{:032x}", 5);
    let at = actor.at;
    let refused = actor.heartbeat(&lease, 1, None, at).unwrap_err();
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
    let report = actor.report();
    assert_eq!(report.workers_left.len(), 1, "{:?}", report.workers_left);
    assert_eq!(report.workers_lost.len(), 99);
}

#[test]
fn a_heartbeat_the_actor_gets_to_late_renews_the_lease_from_when_it_was_heard() {
    let mut actor = waiting_actor();
    let inventory = HardwareInventory {
        hostname: "node-0".into(),
        pool: "decode".into(),
        ..Default::default()
    };
    let lease = actor
        .register(inventory, format!("{:032x}", 0))
        .expect("registered")
        .lease
        .expect("a lease")
        .worker_id;
    // Leases of 2 s from 0. A heartbeat heard at 1.5 s reaches the actor only at 3 s (it was
    // busy re-planning): the lease runs on from 1.5 s, and the tick at 3 s keeps the worker.
    actor.at = Duration::from_secs(3);
    actor
        .heartbeat(&lease, 1, None, Duration::from_millis(1500))
        .expect("renewed from when it was heard");
    actor.on_tick();
    assert_eq!(actor.workers.len(), 1, "the worker was cut off");
    // By 3.6 s, with nothing heard since 1.5 s, it has run out; a heartbeat heard after that
    // is refused, however soon the actor takes it.
    actor.at = Duration::from_millis(3600);
    let refused = actor
        .heartbeat(&lease, 1, None, Duration::from_millis(3600))
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
}

#[test]
fn each_task_averages_its_own_trajectories_and_the_overall_figures_average_them_all() {
    let names = [
        "sokoban".to_owned(),
        "frozenlake".to_owned(),
        "idle".to_owned(),
    ];
    let mut by_step: BTreeMap<u64, BTreeMap<u32, Tally>> = BTreeMap::new();
    // Step 0: a solved Sokoban level (10.9) and an unsolved one (-0.1); a FrozenLake goal.
    for (task, o) in [
        (0, trajectory(10.9, 4, 0)),
        (0, trajectory(-0.1, 8, 0)),
        (1, trajectory(1.0, 2, 0)),
    ] {
        by_step
            .entry(0)
            .or_default()
            .entry(task)
            .or_default()
            .add(&o);
    }
    // Step 1: a hole in FrozenLake, one version stale.
    by_step
        .entry(1)
        .or_default()
        .entry(1)
        .or_default()
        .add(&trajectory(0.0, 6, 1));
    let o = outcomes(&by_step, &names);

    assert_eq!(o.success_reward, SUCCESS_REWARD);
    assert_eq!(o.tasks.len(), 3, "every task, trained or not: {o:?}");
    let sokoban = &o.tasks[0];
    assert_eq!(sokoban.task, "sokoban");
    assert_eq!((sokoban.trajectories, sokoban.successes), (2, 1));
    assert!((sokoban.mean_reward - 5.4).abs() < 1e-9, "{sokoban:?}");
    assert_eq!((sokoban.min_reward, sokoban.max_reward), (-0.1, 10.9));
    assert_eq!(sokoban.success_rate, 0.5);
    assert_eq!(sokoban.mean_turns, 6.0);
    assert_eq!(sokoban.mean_prompt_tokens, 600.0);
    assert_eq!(sokoban.mean_action_tokens, 60.0);
    let frozenlake = &o.tasks[1];
    assert_eq!((frozenlake.trajectories, frozenlake.successes), (2, 1));
    assert_eq!(frozenlake.mean_reward, 0.5);
    assert_eq!(frozenlake.mean_staleness, 0.5);
    assert_eq!(frozenlake.max_staleness, 1);
    let idle = &o.tasks[2];
    assert_eq!(
        (idle.trajectories, idle.mean_reward, idle.success_rate),
        (0, 0.0, 0.0)
    );

    assert_eq!(o.overall.task, "");
    assert_eq!((o.overall.trajectories, o.overall.successes), (4, 2));
    assert!((o.overall.mean_reward - 11.8 / 4.0).abs() < 1e-9, "{o:?}");
    assert_eq!(o.overall.mean_turns, 5.0);
    assert_eq!(
        (o.overall.mean_staleness, o.overall.max_staleness),
        (0.25, 1)
    );

    // Per step: each step's own trajectories.
    assert_eq!(o.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(o.steps[0].overall.trajectories, 3);
    assert_eq!(o.steps[0].tasks[1].mean_reward, 1.0);
    assert_eq!(o.steps[1].overall.trajectories, 1);
    assert_eq!(o.steps[1].tasks[0].trajectories, 0);
    assert_eq!(o.steps[1].overall.success_rate, 0.0);
}

#[test]
fn a_reward_counts_as_a_success_from_the_threshold_on_and_a_modelled_one_is_counted_apart() {
    let mut tally = Tally::default();
    for reward in [SUCCESS_REWARD, SUCCESS_REWARD - 1e-9, 0.9, 10.9] {
        tally.add(&trajectory(reward, 1, 0));
    }
    tally.add(&TrajectoryOutcome {
        modelled: true,
        ..trajectory(0.0, 1, 0)
    });
    let f = tally.figures("t");
    assert_eq!((f.trajectories, f.successes, f.modelled_rewards), (5, 2, 1));
    assert_eq!(f.success_rate, 0.4);
}

#[test]
fn the_figures_read_back_from_their_json_as_they_were_written() {
    let mut by_step: BTreeMap<u64, BTreeMap<u32, Tally>> = BTreeMap::new();
    by_step
        .entry(0)
        .or_default()
        .entry(0)
        .or_default()
        .add(&trajectory(1.0, 3, 0));
    let o = outcomes(&by_step, &["calc".to_owned()]);
    let json = serde_json::to_string(&o).expect("figures encode");
    let back: Outcomes = serde_json::from_str(&json).expect("figures decode");
    assert_eq!(back, o);
    // The overall figures name no task.
    assert!(!json.contains("\"task\":\"\""), "{json}");
}

#[test]
fn registering_again_and_again_stops_at_the_pools_cap_naming_the_pool_and_frees_places_as_leases_expire()
 {
    let mut actor = waiting_actor();
    let node = |pool: &str, i: usize| HardwareInventory {
        hostname: format!("{pool}-{i}"),
        pool: pool.into(),
        ..Default::default()
    };
    // The quick-start's decode pool has 2 GPUs; the actor waits for 100 workers.
    let cap = actor.worker_cap(1);
    assert_eq!(actor.plan.pool_name(1), "decode");
    assert_eq!(cap, 100);
    let mut refused = Vec::new();
    for i in 0..1_000 {
        match actor.register(node("decode", i), format!("{i:032x}")) {
            Ok(_) => {}
            Err(status) => refused.push(status),
        }
    }
    assert_eq!(
        refused.len(),
        1_000 - cap,
        "registrations past the cap are refused"
    );
    assert_eq!(
        actor.workers.len(),
        cap,
        "the scheduler holds no more than the cap"
    );
    let status = &refused[0];
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status
            .message()
            .contains("pool \"decode\" already has 100 workers registered, at most 100"),
        "{}",
        status.message()
    );
    // Another pool has places of its own.
    actor
        .register(node("envs", 0), format!("{:032x}", 5_000))
        .expect("a worker of another pool registers");
    // Leases that run out free their places.
    actor.at += Duration::from_secs(3);
    actor.on_tick();
    actor
        .register(node("decode", 5_001), format!("{:032x}", 5_001))
        .expect("a place freed by an expired lease is given again");
}
