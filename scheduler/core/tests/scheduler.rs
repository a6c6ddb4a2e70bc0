//! Behaviour of the scheduler core, driven by hand and by a random world.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use rollfleet_core::config::{CpuPoolConfig, ServerlessPoolConfig};
use rollfleet_core::rng::SplitMix64;
use rollfleet_core::{
    BatchId, Command, Config, Core, Discipline, Input, Policy, ReplicaConfig, ReplicaId,
    RewardRoute, ServeRole, Span, StageCommand, StageId, StageOutcome, StageWork, SyncMode,
    TaskLimits, Time, TrainerConfig, TrajId, Version,
};

fn policy(discipline: Discipline, max_staleness: u64, over: f64, sync: SyncMode) -> Policy {
    Policy {
        discipline,
        max_staleness,
        over_provisioning: over,
        weight_sync: sync,
        max_concurrent_updates: 1,
        sticky_sessions: true,
        expiry_aware_publish: false,
        interrupt_generation: false,
        restart_late_groups: true,
    }
}

fn replica(role: ServeRole, kv: u64) -> ReplicaConfig {
    ReplicaConfig {
        pool: 0,
        role,
        gpus: 1,
        kv_capacity_tokens: kv,
        max_seqs: 4,
    }
}

fn config(
    replicas: Vec<ReplicaConfig>,
    policy: Policy,
    group: u32,
    batch: u32,
    steps: u64,
) -> Config {
    Config {
        seed: 1,
        policy,
        group_size: group,
        rollout_batch_size: batch,
        train_batch_size: group,
        steps,
        tasks: vec![TaskLimits {
            share: 1.0,
            max_turns: 4,
            context_limit: 10_000,
            max_action_tokens: 100,
            env_millicpus: 1000,
            reward: RewardRoute::Serverless(0),
        }],
        replicas,
        trainer: TrainerConfig {
            pool: 1,
            gpus: 8,
            nodes: 1,
        },
        colocated: false,
        cpu_pools: vec![CpuPoolConfig {
            pool: 2,
            millicpus: 4000,
            environments: true,
        }],
        serverless_pools: vec![ServerlessPoolConfig {
            pool: 3,
            concurrency: 2,
        }],
        weight_bytes: 1_000_000,
        pd_min_prefill_tokens: 1_000,
        stage_timeout: Span::from_secs_f64(3600.0),
        stage_failure_limit: rollfleet_core::config::DEFAULT_STAGE_FAILURE_LIMIT,
    }
}

/// A core on `cfg`, started: it and the stages it ran first (the first trajectories' resets).
fn started(cfg: Config) -> (Core, Vec<StageCommand>) {
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let resets = runs(&drain(&mut core));
    (core, resets)
}

fn drain(core: &mut Core) -> Vec<Command> {
    std::iter::from_fn(|| core.poll_command()).collect()
}

fn runs(commands: &[Command]) -> Vec<StageCommand> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Run(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

fn finish(core: &mut Core, stage: StageId, outcome: StageOutcome) -> Vec<Command> {
    finish_when(core, Time(1), stage, outcome)
}

/// Feeds a stage's outcome at `now`; the commands it caused.
fn finish_when(core: &mut Core, now: Time, stage: StageId, outcome: StageOutcome) -> Vec<Command> {
    core.handle_input(now, Input::StageFinished { stage, outcome });
    drain(core)
}

/// The batch of the training command among `out`.
fn trained_batch(out: &[Command]) -> BatchId {
    match out.iter().find(|c| matches!(c, Command::Train { .. })) {
        Some(Command::Train { batch, .. }) => *batch,
        _ => panic!("no training command in {out:?}"),
    }
}

/// The replica and version of the weight update among `out`.
fn weight_update(out: &[Command]) -> (ReplicaId, Version) {
    match out
        .iter()
        .find(|c| matches!(c, Command::UpdateWeights { .. }))
    {
        Some(Command::UpdateWeights {
            replica, version, ..
        }) => (*replica, *version),
        _ => panic!("no weight update in {out:?}"),
    }
}

fn observed(tokens: u64, done: bool) -> StageOutcome {
    StageOutcome::Observed { tokens, done }
}

#[test]
fn a_trajectory_goes_from_reset_through_its_turns_to_its_reward_and_is_trained_once() {
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        1,
    );
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let reset = runs(&drain(&mut core));
    assert_eq!(reset.len(), 1);
    assert!(matches!(reset[0].work, StageWork::EnvReset { .. }));

    let generate = runs(&finish(&mut core, reset[0].stage, observed(300, false)));
    let StageWork::Generate {
        prefill_tokens,
        cached_tokens,
        max_new_tokens,
        ..
    } = generate[0].work
    else {
        panic!("{generate:?}")
    };
    assert_eq!(
        (prefill_tokens, cached_tokens, max_new_tokens),
        (300, 0, 100)
    );
    assert_eq!(generate[0].version, 0);

    let step = runs(&finish(
        &mut core,
        generate[0].stage,
        StageOutcome::Generated { tokens: 40 },
    ));
    assert!(matches!(
        step[0].work,
        StageWork::EnvStep {
            action_tokens: 40,
            ..
        }
    ));

    let reward = finish(&mut core, step[0].stage, observed(20, true));
    assert!(
        reward
            .iter()
            .any(|c| matches!(c, Command::ReleaseKv { .. })),
        "{reward:?}"
    );
    let reward = runs(&reward);
    assert!(matches!(
        reward[0].work,
        StageWork::Reward {
            serverless: true,
            ..
        }
    ));

    let train = finish(
        &mut core,
        reward[0].stage,
        StageOutcome::Rewarded { score: 1.0 },
    );
    let Some(Command::Train {
        batch,
        trajectories,
        tokens,
        publishes,
        ..
    }) = train.last().cloned()
    else {
        panic!("{train:?}")
    };
    assert_eq!(trajectories, vec![TrajId(0)]);
    assert_eq!(tokens, 340);
    assert!(publishes);
    core.handle_input(Time(2), Input::TrainFinished { batch });
    assert!(core.finished());
    assert_eq!(core.trajectory_counts(), (0, 0, 1));
}

#[test]
fn a_loose_staleness_bound_keeps_at_most_two_batches_started_and_untrained() {
    let started = |max_staleness: u64| {
        let cfg = config(
            vec![replica(ServeRole::Generate, 10_000)],
            policy(
                Discipline::Continuous,
                max_staleness,
                0.0,
                SyncMode::Rolling,
            ),
            1,
            4,
            10,
        );
        let mut core = Core::new(cfg);
        core.handle_timeout(Time::ZERO);
        drain(&mut core);
        core.stats().groups_started
    };
    // `S x B / 2` while that is under two batches ...
    assert_eq!(started(2), 4);
    assert_eq!(started(3), 6);
    // ... and two batches however loose the bound: more would only wait for the trainer,
    // losing their KV caches at every weight update.
    assert_eq!(started(4), 8);
    assert_eq!(started(8), 8);
    assert_eq!(started(100), 8);
}

#[test]
fn a_later_turn_returns_to_the_replica_holding_its_kv_cache_and_prefills_only_the_new_tokens() {
    let cfg = config(
        vec![
            replica(ServeRole::Decode, 10_000),
            replica(ServeRole::Decode, 10_000),
        ],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        2,
        2,
        1,
    );
    let (mut core, resets) = started(cfg);
    let g0 = runs(&finish(&mut core, resets[0].stage, observed(300, false)));
    let g1 = runs(&finish(&mut core, resets[1].stage, observed(300, false)));
    let replica_of = |s: &StageCommand| match s.work {
        StageWork::Generate { replica, .. } => replica,
        _ => panic!(),
    };
    // Load-aware: the second trajectory goes to the idle replica.
    assert_ne!(replica_of(&g0[0]), replica_of(&g1[0]));
    let step = runs(&finish(
        &mut core,
        g0[0].stage,
        StageOutcome::Generated { tokens: 50 },
    ));
    let turn2 = runs(&finish(&mut core, step[0].stage, observed(25, false)));
    let StageWork::Generate {
        replica,
        cached_tokens,
        prefill_tokens,
        ..
    } = turn2[0].work
    else {
        panic!("{turn2:?}")
    };
    assert_eq!(replica, replica_of(&g0[0]));
    assert_eq!((cached_tokens, prefill_tokens), (350, 25));
    assert_eq!(core.stats().sticky_hits, 1);
}

#[test]
fn a_long_context_is_prefilled_on_the_prefill_pool_and_its_kv_cache_pulled_by_a_decode_replica() {
    let cfg = config(
        vec![
            replica(ServeRole::Prefill, 10_000),
            replica(ServeRole::Decode, 10_000),
        ],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        1,
    );
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let reset = runs(&drain(&mut core));
    let prefill = runs(&finish(&mut core, reset[0].stage, observed(2_000, false)));
    assert!(matches!(
        prefill[0].work,
        StageWork::Prefill {
            replica: ReplicaId(0),
            tokens: 2_000
        }
    ));
    let decode = runs(&finish(
        &mut core,
        prefill[0].stage,
        StageOutcome::Prefilled,
    ));
    assert!(
        matches!(
            decode[0].work,
            StageWork::Generate {
                replica: ReplicaId(1),
                kv_from: Some(ReplicaId(0)),
                kv_tokens: 2_000,
                prefill_tokens: 0,
                ..
            }
        ),
        "{decode:?}"
    );
}

#[test]
fn with_its_last_prefill_replica_retired_a_long_input_is_prefilled_where_it_decodes() {
    let cfg = config(
        vec![
            replica(ServeRole::Prefill, 10_000),
            replica(ServeRole::Decode, 10_000),
        ],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        1,
    );
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let reset = runs(&drain(&mut core));
    core.handle_input(
        Time(1),
        Input::RetireReplica {
            replica: ReplicaId(0),
        },
    );
    let retired = drain(&mut core);
    assert!(
        retired.iter().any(|c| matches!(
            c,
            Command::ReplicaRetired {
                replica: ReplicaId(0)
            }
        )),
        "{retired:?}"
    );
    // 2,000 tokens is over `pd_min_prefill_tokens`: with a prefill replica it would go there.
    let generate = runs(&finish(&mut core, reset[0].stage, observed(2_000, false)));
    assert!(
        matches!(
            generate[0].work,
            StageWork::Generate {
                replica: ReplicaId(1),
                cached_tokens: 0,
                prefill_tokens: 2_000,
                ..
            }
        ),
        "{generate:?}"
    );
}

#[test]
fn no_replica_is_given_more_kv_cache_than_it_holds() {
    // 300 tokens of KV: one 100-token prompt plus a 100-token action fits, two do not.
    let cfg = config(
        vec![replica(ServeRole::Generate, 300)],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        2,
        2,
        1,
    );
    let (mut core, resets) = started(cfg);
    let first = runs(&finish(&mut core, resets[0].stage, observed(100, false)));
    let second = runs(&finish(&mut core, resets[1].stage, observed(100, false)));
    assert_eq!(first.len(), 1);
    assert!(second.is_empty(), "{second:?}");
    core.check_invariants().unwrap();
    // When the first turn ends without keeping room, the second gets the replica.
    let after = runs(&finish(
        &mut core,
        first[0].stage,
        StageOutcome::Generated { tokens: 100 },
    ));
    assert!(
        after
            .iter()
            .any(|s| matches!(s.work, StageWork::Generate { .. })),
        "{after:?}"
    );
    assert!(core.stats().kv_evictions <= 1);
}

/// Fails the environment reset of `stage`'s trajectory `times` times in a row; returns the
/// commands of the last failure.
fn fail_reset_repeatedly(core: &mut Core, mut stage: StageId, times: u32) -> Vec<Command> {
    let mut last = Vec::new();
    for _ in 0..times {
        core.handle_input(Time(1), Input::StageFailed { stage });
        last = drain(core);
        if let Some(retry) = runs(&last)
            .into_iter()
            .find(|s| matches!(s.work, StageWork::EnvReset { .. }) && s.stage != stage)
        {
            stage = retry.stage;
        }
    }
    last
}

#[test]
fn a_trajectory_that_fails_the_limit_in_a_row_gives_up_its_group_and_a_fresh_group_replaces_it() {
    let mut cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        2,
        2,
        1,
    );
    cfg.stage_failure_limit = 3;
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 2);
    let (doomed, sibling) = (&resets[0], &resets[1]);

    // Two failures are retried like any other.
    let second = fail_reset_repeatedly(&mut core, doomed.stage, 2);
    assert!(
        !second
            .iter()
            .any(|c| matches!(c, Command::AbandonGroup { .. })),
        "{second:?}"
    );
    let retry = runs(&second)[0].clone();
    assert_eq!(retry.traj, doomed.traj);

    // The third gives the group up: the sibling's stage is cancelled, and a fresh group starts.
    let third = fail_reset_repeatedly(&mut core, retry.stage, 1);
    let abandoned: Vec<_> = third
        .iter()
        .filter_map(|c| match c {
            Command::AbandonGroup {
                group,
                trajectories,
                failed,
            } => Some((*group, trajectories.clone(), *failed)),
            _ => None,
        })
        .collect();
    assert_eq!(
        abandoned,
        vec![(doomed.group, vec![doomed.traj, sibling.traj], doomed.traj)]
    );
    assert!(third.contains(&Command::Cancel {
        stage: sibling.stage
    }));
    let fresh = runs(&third);
    assert_eq!(fresh.len(), 2, "{third:?}");
    assert!(fresh.iter().all(|s| s.group != doomed.group));
    assert_eq!(core.stats().groups_abandoned, 1);
    assert_eq!(core.trajectory_counts(), (2, 0, 0));
    core.check_invariants().unwrap();

    // The sibling's late answer is ignored, not turned into a turn.
    let ignored = core.stats().ignored_reports;
    finish(&mut core, sibling.stage, observed(10, false));
    assert_eq!(core.stats().ignored_reports, ignored + 1);
}

#[test]
fn failures_broken_by_a_success_do_not_give_a_trajectory_up() {
    let mut cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        1,
    );
    cfg.stage_failure_limit = 2;
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let reset = runs(&drain(&mut core));
    let retry = runs(&fail_reset_repeatedly(&mut core, reset[0].stage, 1));
    let generate = runs(&finish(&mut core, retry[0].stage, observed(100, false)));
    let step = runs(&finish(
        &mut core,
        generate[0].stage,
        StageOutcome::Generated { tokens: 10 },
    ));
    assert!(matches!(step[0].work, StageWork::EnvStep { .. }));
    let after = fail_reset_repeatedly(&mut core, step[0].stage, 1);
    assert!(
        !after
            .iter()
            .any(|c| matches!(c, Command::AbandonGroup { .. })),
        "{after:?}"
    );
    assert_eq!(core.stats().groups_abandoned, 0);
}

#[test]
fn a_failed_environment_step_is_retried_not_scored() {
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        1,
    );
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let reset = runs(&drain(&mut core));
    core.handle_input(
        Time(1),
        Input::StageFailed {
            stage: reset[0].stage,
        },
    );
    let retry = runs(&drain(&mut core));
    assert!(matches!(retry[0].work, StageWork::EnvReset { .. }));
    assert_ne!(retry[0].stage, reset[0].stage);
    assert_eq!(core.stats().stage_retries, 1);
}

#[test]
fn a_replica_added_mid_run_loads_the_current_weights_before_it_takes_work() {
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 0.5, SyncMode::Rolling),
        1,
        2,
        1,
    );
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 2);
    core.handle_input(
        Time(1),
        Input::ReplicaAdded {
            config: replica(ServeRole::Generate, 10_000),
        },
    );
    assert_eq!(
        drain(&mut core),
        vec![Command::UpdateWeights {
            replica: ReplicaId(1),
            version: 0,
            bytes: 1_000_000,
            mode: SyncMode::Rolling,
        }]
    );
    // While it loads, generation goes to the old replica only.
    let first = runs(&finish(&mut core, resets[0].stage, observed(100, false)));
    assert!(
        matches!(first[0].work, StageWork::Generate { replica, .. } if replica == ReplicaId(0)),
        "{first:?}"
    );
    core.handle_input(
        Time(2),
        Input::WeightsUpdated {
            replica: ReplicaId(1),
            version: 0,
        },
    );
    drain(&mut core);
    // Loaded: the next generation goes to the idle new replica, not the busy old one.
    let second = runs(&finish(&mut core, resets[1].stage, observed(100, false)));
    assert!(
        matches!(second[0].work, StageWork::Generate { replica, .. } if replica == ReplicaId(1)),
        "{second:?}"
    );
    assert_eq!(core.stats().replicas_added, 1);
    core.check_invariants().unwrap();
}

#[test]
fn a_retiring_replica_gets_no_new_work_finishes_what_it_runs_and_is_handed_back() {
    let cfg = config(
        vec![
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
        ],
        policy(Discipline::Continuous, 0, 0.5, SyncMode::Rolling),
        1,
        2,
        1,
    );
    let (mut core, resets) = started(cfg);
    let running = runs(&finish(&mut core, resets[0].stage, observed(100, false)));
    let StageWork::Generate { replica: busy, .. } = running[0].work else {
        panic!("{running:?}")
    };
    core.handle_input(Time(1), Input::RetireReplica { replica: busy });
    // It runs a stage: not handed back yet.
    assert!(drain(&mut core).is_empty());
    // New work goes elsewhere.
    let other = runs(&finish(&mut core, resets[1].stage, observed(100, false)));
    assert!(
        matches!(other[0].work, StageWork::Generate { replica, .. } if replica != busy),
        "{other:?}"
    );
    // Its stage finishes: it keeps no KV cache for the trajectory, and it is handed back.
    let after = finish(
        &mut core,
        running[0].stage,
        StageOutcome::Generated { tokens: 10 },
    );
    assert!(
        after.contains(&Command::ReplicaRetired { replica: busy }),
        "{after:?}"
    );
    assert!(
        after.contains(&Command::ReleaseKv {
            replica: busy,
            traj: running[0].traj
        }),
        "{after:?}"
    );
    // A recovery report for it changes nothing: it is gone for good.
    let ignored = core.stats().ignored_reports;
    core.handle_input(Time(3), Input::ReplicaRecovered { replica: busy });
    assert!(drain(&mut core).is_empty());
    assert_eq!(core.stats().ignored_reports, ignored + 1);
    assert_eq!(core.stats().replicas_retired, 1);
    core.check_invariants().unwrap();
}

#[test]
fn a_lost_replica_loses_no_trajectory_and_its_late_report_is_ignored() {
    let cfg = config(
        vec![
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
        ],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        1,
    );
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let reset = runs(&drain(&mut core));
    let generate = runs(&finish(&mut core, reset[0].stage, observed(100, false)));
    let StageWork::Generate { replica: lost, .. } = generate[0].work else {
        panic!()
    };
    core.handle_input(Time(2), Input::ReplicaLost { replica: lost });
    let again = runs(&drain(&mut core));
    let StageWork::Generate { replica, .. } = again[0].work else {
        panic!("{again:?}")
    };
    assert_ne!(replica, lost);
    // The lost replica's answer arrives late: ignored, nothing is duplicated.
    let late = finish(
        &mut core,
        generate[0].stage,
        StageOutcome::Generated { tokens: 10 },
    );
    assert!(late.is_empty());
    assert_eq!(core.stats().ignored_reports, 1);
    assert_eq!(core.trajectory_counts(), (1, 0, 0));
}

#[test]
fn a_replica_lost_before_its_commands_were_polled_is_sent_none_of_them() {
    let cfg = config(
        vec![
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
        ],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        1,
    );
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let reset = runs(&drain(&mut core));
    // The environment answers and, before the driver polls the generation it caused, the
    // replica that generation went to is reported lost (two facts handled in one event).
    core.handle_input(
        Time(1),
        Input::StageFinished {
            stage: reset[0].stage,
            outcome: observed(100, false),
        },
    );
    let mut probe = core.clone();
    let Some(StageWork::Generate { replica: lost, .. }) =
        runs(&drain(&mut probe)).first().map(|s| s.work.clone())
    else {
        panic!("no generation was dispatched")
    };
    core.handle_input(Time(2), Input::ReplicaLost { replica: lost });
    let sent = drain(&mut core);
    for command in &sent {
        match command {
            Command::Run(s) => match s.work {
                StageWork::Generate {
                    replica, kv_from, ..
                } => assert!(replica != lost && kv_from != Some(lost), "{sent:?}"),
                StageWork::Prefill { replica, .. } => assert_ne!(replica, lost, "{sent:?}"),
                _ => {}
            },
            Command::UpdateWeights { replica, .. } | Command::ReleaseKv { replica, .. } => {
                assert_ne!(*replica, lost, "{sent:?}")
            }
            Command::Cancel { .. } => panic!("a cancel for a stage never sent: {sent:?}"),
            Command::Interrupt { .. } => panic!("interrupts are off: {sent:?}"),
            Command::Train { .. } => {}
            Command::AbandonGroup { .. } => panic!("nothing failed: {sent:?}"),
            Command::ReplicaRetired { .. } => panic!("nothing was retired: {sent:?}"),
        }
    }
    // The trajectory is not lost: its generation went to the other replica instead.
    assert_eq!(runs(&sent).len(), 1, "{sent:?}");
}

#[test]
fn a_stage_without_an_answer_times_out_and_is_cancelled_and_retried() {
    let mut cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        1,
    );
    cfg.stage_timeout = Span::from_secs_f64(10.0);
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let reset = runs(&drain(&mut core));
    assert_eq!(core.poll_timeout(), Some(Time::from_secs_f64(10.0)));
    core.handle_timeout(Time::from_secs_f64(10.0));
    let out = drain(&mut core);
    assert!(
        out.contains(&Command::Cancel {
            stage: reset[0].stage
        }),
        "{out:?}"
    );
    assert!(
        runs(&out)
            .iter()
            .any(|s| matches!(s.work, StageWork::EnvReset { .. }))
    );
}

/// Drives one trajectory of a group-of-one job through a single-turn episode.
fn complete_one(core: &mut Core, reset: &StageCommand) -> Vec<Command> {
    let generate = runs(&finish(core, reset.stage, observed(100, false)));
    let step = runs(&finish(
        core,
        generate[0].stage,
        StageOutcome::Generated { tokens: 10 },
    ));
    let reward = runs(&finish(core, step[0].stage, observed(5, true)));
    finish(core, reward[0].stage, StageOutcome::Rewarded { score: 0.0 })
}

#[test]
fn weights_are_updated_one_replica_at_a_time_while_the_others_keep_serving() {
    // Bound 2: at version 1 a new trajectory may still start on a version-0 replica (it has two
    // more steps to finish in); with bound 1 it would wait for new weights (next test).
    let cfg = config(
        vec![
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
        ],
        policy(Discipline::Continuous, 2, 0.0, SyncMode::Rolling),
        1,
        1,
        2,
    );
    let (mut core, resets) = started(cfg);
    let before = complete_one(&mut core, &resets[0]);
    let batch = trained_batch(&before);
    core.handle_input(Time(5), Input::TrainFinished { batch });
    let mut out = drain(&mut core);
    let updates: Vec<_> = out
        .iter()
        .filter(|c| matches!(c, Command::UpdateWeights { .. }))
        .collect();
    assert_eq!(updates.len(), 1, "{out:?}");
    let Command::UpdateWeights {
        replica: first,
        version: 1,
        mode: SyncMode::Rolling,
        ..
    } = updates[0].clone()
    else {
        panic!()
    };
    // The rollout goes on meanwhile: a new trajectory starts and is served by another replica.
    out.extend(before);
    let reset = runs(&out);
    let reset = reset
        .iter()
        .find(|s| matches!(s.work, StageWork::EnvReset { .. }))
        .unwrap()
        .clone();
    let generate = runs(&finish(&mut core, reset.stage, observed(100, false)));
    let StageWork::Generate { replica, .. } = generate[0].work else {
        panic!()
    };
    assert_ne!(replica, first);
    core.handle_input(
        Time(6),
        Input::WeightsUpdated {
            replica: first,
            version: 1,
        },
    );
    let next = drain(&mut core);
    assert_eq!(
        next.iter()
            .filter(|c| matches!(c, Command::UpdateWeights { .. }))
            .count(),
        1,
        "{next:?}"
    );
}

#[test]
fn a_new_trajectory_does_not_start_on_weights_it_would_have_to_be_trained_on_at_once() {
    // Bound 1, one replica per update: after version 1 is published, a first turn generated
    // by version 0 would have to be trained within the current step; it waits for a replica
    // serving version 1 and goes there.
    let cfg = config(
        vec![
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
        ],
        policy(Discipline::Continuous, 1, 0.0, SyncMode::Rolling),
        1,
        1,
        2,
    );
    let (mut core, resets) = started(cfg);
    let before = complete_one(&mut core, &resets[0]);
    let batch = trained_batch(&before);
    core.handle_input(Time(5), Input::TrainFinished { batch });
    let mut out = drain(&mut core);
    let Some(Command::UpdateWeights {
        replica: first,
        version: 1,
        ..
    }) = out
        .iter()
        .find(|c| matches!(c, Command::UpdateWeights { .. }))
        .cloned()
    else {
        panic!("{out:?}")
    };
    out.extend(before);
    let reset = runs(&out)
        .into_iter()
        .find(|s| matches!(s.work, StageWork::EnvReset { .. }))
        .unwrap();
    // The other replica still serves version 0: nothing is generated yet.
    let waiting = finish(&mut core, reset.stage, observed(100, false));
    assert!(
        !waiting.iter().any(|c| matches!(c, Command::Run(_))),
        "{waiting:?}"
    );
    core.handle_input(
        Time(6),
        Input::WeightsUpdated {
            replica: first,
            version: 1,
        },
    );
    let generate = runs(&drain(&mut core));
    let Some(StageWork::Generate { replica, .. }) = generate.first().map(|s| s.work.clone()) else {
        panic!("{generate:?}")
    };
    assert_eq!(replica, first);
    assert_eq!(generate[0].version, 1);
}

#[test]
fn a_trajectory_too_stale_to_continue_is_regenerated_from_the_offending_turn() {
    // Fully on-policy (bound 0), two trajectories in flight thanks to over-provisioning.
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 1.0, SyncMode::Rolling),
        1,
        1,
        3,
    );
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 2);
    // Trajectory 1 generates its first turn at version 0 and goes to its environment.
    let gen1 = runs(&finish(&mut core, resets[1].stage, observed(100, false)));
    let step1 = runs(&finish(
        &mut core,
        gen1[0].stage,
        StageOutcome::Generated { tokens: 10 },
    ));
    // Trajectory 0 completes and is trained on: version 1.
    let out = complete_one(&mut core, &resets[0]);
    let batch = trained_batch(&out);
    core.handle_input(Time(5), Input::TrainFinished { batch });
    let out = drain(&mut core);
    if let Some(Command::UpdateWeights {
        replica, version, ..
    }) = out
        .iter()
        .find(|c| matches!(c, Command::UpdateWeights { .. }))
        .cloned()
    {
        core.handle_input(Time(6), Input::WeightsUpdated { replica, version });
        drain(&mut core);
    }
    // Trajectory 1's second turn would train on a version-0 turn: it restarts at turn 0.
    let again = runs(&finish(&mut core, step1[0].stage, observed(20, false)));
    let regen = again.iter().find(|s| s.traj == TrajId(1)).unwrap();
    assert_eq!((regen.turn, regen.attempt, regen.version), (0, 1, 1));
    assert!(matches!(
        regen.work,
        StageWork::Generate {
            cached_tokens: 0,
            prefill_tokens: 100,
            ..
        }
    ));
    assert!(core.stats().regenerated_turns >= 1);
}

/// Bound 0, groups of two, two groups in flight: trajectory 2 finishes at version 0 while its
/// group's other member, trajectory 3, has generated `turns_of_3` turns (0 or 1) at version 0;
/// then the first group is trained on and publishes version 1. Returns the core just after.
fn publish_while_a_finished_trajectory_waits(turns_of_3: usize) -> Core {
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 1.0, SyncMode::Rolling),
        2,
        2,
        3,
    );
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 4);
    complete_one(&mut core, &resets[2]);
    if turns_of_3 > 0 {
        let generate = runs(&finish(&mut core, resets[3].stage, observed(100, false)));
        finish(
            &mut core,
            generate[0].stage,
            StageOutcome::Generated { tokens: 10 },
        );
    }
    assert_eq!(core.trajectory_counts(), (3, 1, 0));
    complete_one(&mut core, &resets[0]);
    let out = complete_one(&mut core, &resets[1]);
    let batch = trained_batch(&out);
    core.handle_input(Time(5), Input::TrainFinished { batch });
    core
}

#[test]
fn a_finished_trajectory_that_alone_keeps_its_group_from_training_is_regenerated_when_a_publication_expires_it()
 {
    // Trajectory 3 has not even reset: trajectory 2's expired turn is all that stands between
    // the group and the trainer, so it starts again now rather than when trajectory 3 finishes.
    let mut core = publish_while_a_finished_trajectory_waits(0);
    assert_eq!(core.stats().regenerated_at_publish, 1);
    assert_eq!(core.trajectory_counts().1, 0, "no longer waiting");
    let out = drain(&mut core);
    let (replica, version) = weight_update(&out);
    core.handle_input(Time(6), Input::WeightsUpdated { replica, version });
    let again = runs(&drain(&mut core));
    let regen = again.iter().find(|s| s.traj == TrajId(2)).unwrap();
    assert_eq!((regen.turn, regen.attempt, regen.version), (0, 1, 1));
    assert!(!again.iter().any(|s| s.traj == TrajId(3)), "{again:?}");
}

#[test]
fn a_finished_trajectory_whose_group_has_another_expired_member_waits_to_be_regenerated_with_it() {
    // Trajectory 3 generated a turn at version 0 too: the group needs regenerating either way,
    // and trajectory 2 waits for it, as at consumption, instead of starting alone.
    let core = publish_while_a_finished_trajectory_waits(1);
    assert_eq!(core.stats().regenerated_at_publish, 0);
    assert_eq!(core.trajectory_counts().1, 1, "still waiting");
}

/// Feeds a stage's outcome at `secs` seconds; the stages it started.
fn finish_at(
    core: &mut Core,
    secs: f64,
    stage: StageId,
    outcome: StageOutcome,
) -> Vec<StageCommand> {
    runs(&finish_when(
        core,
        Time::from_secs_f64(secs),
        stage,
        outcome,
    ))
}

/// Ends generation stage `stage` of trajectory `t` at `secs` seconds with a 10-token action; the
/// environment step it started.
fn generated_at(core: &mut Core, secs: f64, stage: StageId, t: u64) -> StageCommand {
    stage_of(
        &finish_at(core, secs, stage, StageOutcome::Generated { tokens: 10 }),
        t,
    )
}

/// The stage of trajectory `t` among `stages`.
fn stage_of(stages: &[StageCommand], t: u64) -> StageCommand {
    stages
        .iter()
        .find(|s| s.traj == TrajId(t))
        .cloned()
        .unwrap()
}

#[test]
fn a_long_group_that_started_late_on_weights_a_publication_makes_old_starts_over_on_the_new_ones() {
    // Bound 1, groups of one, three in flight, a task of up to 40 turns. Trajectory 0 takes
    // turns of exactly 1 s (so 40 turns take 40 s by the core's measure); trajectory 1 finishes at
    // 30 s and publishes version 1 (a mean step of 30 s); trajectory 2 starts its first turn at
    // 27 s. With one step left before its version-0 turn expires, trajectory 2 (3 s old) would
    // need 37 s more: it starts over on version 1 (two steps to finish in). Trajectory 0 (30 s
    // old, 10 s to go at most) carries on.
    let mut cfg = config(
        vec![replica(ServeRole::Generate, 1_000_000)],
        policy(Discipline::Continuous, 1, 2.0, SyncMode::Rolling),
        1,
        1,
        10,
    );
    cfg.tasks[0].max_turns = 40;
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 3);
    // Trajectory 0: 16 turns of 1 s measured, its 17th in its environment past the publication.
    let mut generate = stage_of(
        &finish_at(&mut core, 0.0, resets[0].stage, observed(100, false)),
        0,
    );
    for turn in 0..17 {
        let t = turn as f64;
        let step = generated_at(&mut core, t + 0.5, generate.stage, 0);
        if turn < 16 {
            generate = stage_of(
                &finish_at(&mut core, t + 1.0, step.stage, observed(100, false)),
                0,
            );
        }
    }
    // Trajectory 1: one turn, done at 29 s, rewarded at 30 s, trained: version 1 at 30 s.
    let g1 = stage_of(
        &finish_at(&mut core, 18.0, resets[1].stage, observed(100, false)),
        1,
    );
    let s1 = generated_at(&mut core, 18.5, g1.stage, 1);
    let r1 = stage_of(&finish_at(&mut core, 29.0, s1.stage, observed(5, true)), 1);
    // Trajectory 2: its first turn at 27 s, its environment step still running at 30 s.
    let g2 = stage_of(
        &finish_at(&mut core, 27.0, resets[2].stage, observed(100, false)),
        2,
    );
    assert_eq!((g2.turn, g2.version), (0, 0));
    let s2 = generated_at(&mut core, 28.0, g2.stage, 2);
    let batch = trained_batch(&finish_when(
        &mut core,
        Time::from_secs_f64(30.0),
        r1.stage,
        StageOutcome::Rewarded { score: 0.0 },
    ));
    core.handle_input(Time::from_secs_f64(30.0), Input::TrainFinished { batch });
    let (replica, version) = weight_update(&drain(&mut core));
    assert_eq!(version, 1);
    core.handle_input(
        Time::from_secs_f64(31.0),
        Input::WeightsUpdated { replica, version },
    );
    drain(&mut core);
    // Trajectory 2's next turn is its first again, generated by version 1.
    let again = stage_of(
        &finish_at(&mut core, 32.0, s2.stage, observed(100, false)),
        2,
    );
    assert_eq!((again.turn, again.attempt, again.version), (0, 1, 1));
    assert_eq!(core.stats().groups_restarted, 1);
}

#[test]
fn the_synchronous_discipline_starts_a_batch_only_after_training_and_a_global_sync() {
    let cfg = config(
        vec![
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
        ],
        policy(Discipline::Batched { lag: 0 }, 0, 0.0, SyncMode::Broadcast),
        1,
        1,
        2,
    );
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 1);
    let out = complete_one(&mut core, &resets[0]);
    let batch = trained_batch(&out);
    assert!(runs(&out).is_empty(), "no rollout while training: {out:?}");
    core.handle_input(Time(5), Input::TrainFinished { batch });
    let out = drain(&mut core);
    let updates = out
        .iter()
        .filter(|c| {
            matches!(
                c,
                Command::UpdateWeights {
                    mode: SyncMode::Broadcast,
                    ..
                }
            )
        })
        .count();
    assert_eq!(updates, 2);
    assert!(runs(&out).is_empty(), "no rollout during the sync: {out:?}");
    core.handle_input(
        Time(6),
        Input::WeightsUpdated {
            replica: ReplicaId(0),
            version: 1,
        },
    );
    assert!(runs(&drain(&mut core)).is_empty());
    core.handle_input(
        Time(7),
        Input::WeightsUpdated {
            replica: ReplicaId(1),
            version: 1,
        },
    );
    assert_eq!(runs(&drain(&mut core)).len(), 1);
}

/// A world that answers every command after a random delay, with random lengths, random
/// failures and random replica losses; it keeps its own books to check the core's promises.
fn random_world(
    seed: u64,
    discipline: Discipline,
    staleness: u64,
    pd: bool,
    hold: bool,
    interrupt: bool,
) -> Result<(), String> {
    let mut rng = SplitMix64::new(seed);
    let replicas = if pd {
        vec![
            replica(ServeRole::Prefill, 3_000),
            replica(ServeRole::Decode, 2_000),
            replica(ServeRole::Decode, 2_000),
        ]
    } else {
        vec![
            replica(ServeRole::Generate, 2_000),
            replica(ServeRole::Generate, 2_000),
        ]
    };
    let mut cfg = config(
        replicas,
        policy(
            discipline,
            staleness,
            0.5,
            if matches!(discipline, Discipline::Continuous) {
                SyncMode::Rolling
            } else {
                SyncMode::Broadcast
            },
        ),
        2,
        4,
        4,
    );
    cfg.pd_min_prefill_tokens = 150;
    cfg.policy.expiry_aware_publish = hold;
    cfg.policy.interrupt_generation = interrupt;
    cfg.stage_timeout = Span::from_secs_f64(50.0);
    let group = cfg.group_size;
    let mut core = Core::new(cfg);
    let mut now = Time::ZERO;
    let mut pending: BTreeMap<(Time, u64), Input> = BTreeMap::new();
    let mut seq = 0u64;
    let mut replica_version: BTreeMap<u64, u64> = (0..3).map(|r| (r, 0)).collect();
    // Serving replicas by role, as the world started, added and retired them.
    let mut roles: Vec<ServeRole> = if pd {
        vec![ServeRole::Prefill, ServeRole::Decode, ServeRole::Decode]
    } else {
        vec![ServeRole::Generate, ServeRole::Generate]
    };
    // Asked to retire (when the world decided), retiring (once the core was told), retired.
    let mut retire_asked: BTreeSet<u64> = BTreeSet::new();
    let mut retiring: BTreeSet<u64> = BTreeSet::new();
    let mut retired: BTreeSet<u64> = BTreeSet::new();
    let mut stage_version: BTreeMap<StageId, (TrajId, u32, u64, u32)> = BTreeMap::new();
    // The oldest version of the interrupted part of a trajectory's turn (with the turn and the
    // attempt: a rewind discards it).
    let mut partial: BTreeMap<TrajId, (u32, u32, u64)> = BTreeMap::new();
    let mut prefill_version: BTreeMap<TrajId, u64> = BTreeMap::new();
    let mut turns: BTreeMap<TrajId, Vec<u64>> = BTreeMap::new();
    let mut groups: BTreeMap<TrajId, u64> = BTreeMap::new();
    let mut trained: BTreeSet<TrajId> = BTreeSet::new();
    let mut abandoned: BTreeSet<TrajId> = BTreeSet::new();
    // Failures the world reported per trajectory since its last stage that finished.
    let mut live: BTreeMap<StageId, TrajId> = BTreeMap::new();
    let mut failures_in_a_row: BTreeMap<TrajId, u32> = BTreeMap::new();
    let mut version = 0u64;
    core.handle_timeout(now);
    for _ in 0..200_000 {
        while let Some(cmd) = core.poll_command() {
            let delay = Time(now.0 + 1 + rng.below(1_000_000_000));
            seq += 1;
            match cmd {
                Command::Run(s) => {
                    if abandoned.contains(&s.traj) {
                        return Err(format!("{:?} of abandoned {:?} was run", s.stage, s.traj));
                    }
                    live.insert(s.stage, s.traj);
                    groups.insert(s.traj, s.group.0);
                    if let StageWork::Prefill { replica, .. } | StageWork::Generate { replica, .. } =
                        s.work
                        && (retiring.contains(&replica.0) || retired.contains(&replica.0))
                    {
                        return Err(format!("{:?} sent to retiring {replica:?}", s.stage));
                    }
                    let outcome = match s.work {
                        StageWork::EnvReset { .. } => observed(50 + rng.below(300), false),
                        StageWork::EnvStep { .. } => {
                            observed(1 + rng.below(100), rng.below(3) == 0)
                        }
                        StageWork::Prefill { replica, .. } => {
                            stage_version.insert(
                                s.stage,
                                (s.traj, s.turn, replica_version[&replica.0], s.attempt),
                            );
                            StageOutcome::Prefilled
                        }
                        StageWork::Generate {
                            replica,
                            max_new_tokens,
                            kv_from,
                            ..
                        } => {
                            let mut v = replica_version[&replica.0];
                            if kv_from.is_some() {
                                v = v.min(prefill_version.remove(&s.traj).unwrap_or(v));
                            }
                            if v != s.version {
                                return Err(format!(
                                    "stage stamped {} but served by {v}",
                                    s.version
                                ));
                            }
                            stage_version.insert(s.stage, (s.traj, s.turn, v, s.attempt));
                            StageOutcome::Generated {
                                tokens: 1 + rng.below(max_new_tokens),
                            }
                        }
                        StageWork::Reward { .. } => StageOutcome::Rewarded { score: 0.0 },
                    };
                    // One group in 16 is cursed: its environment always crashes, so the core
                    // must give it up rather than retry forever.
                    let cursed = s.group.0 % 16 == 5 && matches!(s.work, StageWork::EnvStep { .. });
                    let input = if (cursed || rng.below(20) == 0)
                        && !matches!(
                            outcome,
                            StageOutcome::Generated { .. } | StageOutcome::Prefilled
                        ) {
                        Input::StageFailed { stage: s.stage }
                    } else {
                        Input::StageFinished {
                            stage: s.stage,
                            outcome,
                        }
                    };
                    pending.insert((delay, seq), input);
                }
                Command::UpdateWeights {
                    replica,
                    version: v,
                    ..
                } => {
                    replica_version.insert(replica.0, u64::MAX);
                    pending.insert(
                        (delay, seq),
                        Input::WeightsUpdated {
                            replica,
                            version: v,
                        },
                    );
                }
                Command::Train {
                    batch,
                    trajectories,
                    publishes,
                    ..
                } => {
                    let mut per_group: BTreeMap<u64, u32> = BTreeMap::new();
                    for t in &trajectories {
                        if abandoned.contains(t) {
                            return Err(format!("abandoned {t:?} trained"));
                        }
                        if !trained.insert(*t) {
                            return Err(format!("{t:?} trained twice"));
                        }
                        *per_group.entry(groups[t]).or_default() += 1;
                        let oldest = turns
                            .get(t)
                            .and_then(|v| v.iter().min().copied())
                            .ok_or("no turns")?;
                        if version.saturating_sub(oldest) > staleness {
                            return Err(format!(
                                "{t:?} has a turn of version {oldest} at {version}"
                            ));
                        }
                    }
                    if per_group.values().any(|&n| n != group) {
                        return Err(format!("incomplete group in {per_group:?}"));
                    }
                    if publishes {
                        version += 1;
                    }
                    pending.insert((delay, seq), Input::TrainFinished { batch });
                }
                Command::ReleaseKv { .. } => {}
                // Three times in four the interrupt arrives before the generation ends: it
                // reports part of its tokens instead.
                Command::Interrupt { stage } => {
                    if !interrupt {
                        return Err(format!("{stage:?} interrupted with interrupts off"));
                    }
                    let key = pending.iter().find_map(|(k, input)| match input {
                        Input::StageFinished {
                            stage: s,
                            outcome: StageOutcome::Generated { .. },
                        } if *s == stage => Some(*k),
                        _ => None,
                    });
                    if let Some(k) = key
                        && rng.below(4) != 0
                        && let Some(Input::StageFinished {
                            outcome: StageOutcome::Generated { tokens },
                            ..
                        }) = pending.remove(&k)
                    {
                        pending.insert(
                            (Time(now.0 + 1), k.1),
                            Input::StageFinished {
                                stage,
                                outcome: StageOutcome::Interrupted { tokens: tokens / 2 },
                            },
                        );
                    }
                }
                // The core has given the stage up: its late report will be ignored, so the
                // version it would carry is no turn of the trajectory.
                Command::Cancel { stage } => {
                    stage_version.remove(&stage);
                    live.remove(&stage);
                }
                Command::ReplicaRetired { replica } => {
                    if !retiring.remove(&replica.0) || !retired.insert(replica.0) {
                        return Err(format!("{replica:?} retired unasked or twice"));
                    }
                }
                Command::AbandonGroup {
                    trajectories,
                    failed,
                    ..
                } => {
                    if failures_in_a_row.get(&failed).copied().unwrap_or(0) == 0 {
                        return Err(format!("{failed:?} given up with no failure reported"));
                    }
                    for t in trajectories {
                        if trained.contains(&t) {
                            return Err(format!("trained {t:?} given up"));
                        }
                        abandoned.insert(t);
                    }
                }
            }
        }
        core.check_invariants()?;
        if core.finished() {
            return Ok(());
        }
        // Now and then a re-plan adds a serving replica, or retires one while another of its role
        // still serves.
        if rng.below(250) == 0 {
            let role = if pd && rng.below(3) == 0 {
                ServeRole::Prefill
            } else if pd {
                ServeRole::Decode
            } else {
                ServeRole::Generate
            };
            replica_version.insert(roles.len() as u64, u64::MAX);
            roles.push(role);
            seq += 1;
            pending.insert(
                (Time(now.0 + 1), seq),
                Input::ReplicaAdded {
                    config: replica(
                        role,
                        if role == ServeRole::Prefill {
                            3_000
                        } else {
                            2_000
                        },
                    ),
                },
            );
        } else if rng.below(250) == 0 {
            let r = rng.below(roles.len() as u64);
            let serving = |role: ServeRole| {
                (0..roles.len() as u64)
                    .filter(|i| roles[*i as usize] == role)
                    .filter(|i| !retire_asked.contains(i))
                    .count()
            };
            if !retire_asked.contains(&r) && serving(roles[r as usize]) >= 2 {
                retire_asked.insert(r);
                seq += 1;
                pending.insert(
                    (Time(now.0 + 1), seq),
                    Input::RetireReplica {
                        replica: ReplicaId(r),
                    },
                );
            }
        }
        // Now and then a replica is lost, and comes back later.
        if rng.below(400) == 0 {
            let r = rng.below(3);
            seq += 1;
            pending.insert(
                (Time(now.0 + 1), seq),
                Input::ReplicaLost {
                    replica: ReplicaId(r),
                },
            );
            seq += 1;
            pending.insert(
                (Time(now.0 + 2_000_000_000), seq),
                Input::ReplicaRecovered {
                    replica: ReplicaId(r),
                },
            );
        }
        let next = pending.keys().next().copied();
        let timeout = core.poll_timeout();
        match (next, timeout) {
            (Some(k), t) if t.is_none_or(|t| k.0 <= t) => {
                let k: (Time, u64) = k;
                let input = pending.remove(&k).ok_or("gone")?;
                now = now.max(k.0);
                match &input {
                    Input::StageFailed { stage } => {
                        if let Some(traj) = live.remove(stage) {
                            *failures_in_a_row.entry(traj).or_default() += 1;
                        }
                    }
                    Input::StageFinished { stage, outcome } => {
                        if let Some(traj) = live.remove(stage) {
                            failures_in_a_row.insert(traj, 0);
                        }
                        if let Some((traj, turn, v, attempt)) = stage_version.remove(stage) {
                            // The part generated before an interrupt, if the core kept it.
                            let earlier = partial
                                .remove(&traj)
                                .filter(|&(t, a, _)| t == turn && a == attempt)
                                .map(|(_, _, v)| v);
                            match outcome {
                                StageOutcome::Prefilled => {
                                    prefill_version.insert(traj, v);
                                    if let Some(e) = earlier {
                                        partial.insert(traj, (turn, attempt, e));
                                    }
                                }
                                StageOutcome::Generated { .. } => {
                                    let list = turns.entry(traj).or_default();
                                    list.truncate(turn as usize);
                                    list.push(earlier.map_or(v, |e| e.min(v)));
                                }
                                // An interrupt that came before the first token leaves
                                // nothing of this version in the turn (the core keeps no part
                                // of it either): only what was generated counts.
                                StageOutcome::Interrupted { tokens } => {
                                    let oldest = if *tokens > 0 {
                                        Some(earlier.map_or(v, |e| e.min(v)))
                                    } else {
                                        earlier
                                    };
                                    if let Some(oldest) = oldest {
                                        partial.insert(traj, (turn, attempt, oldest));
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                    Input::WeightsUpdated {
                        replica,
                        version: v,
                    } => {
                        replica_version.insert(replica.0, *v);
                    }
                    Input::ReplicaLost { replica } => {
                        replica_version.insert(replica.0, u64::MAX);
                    }
                    Input::RetireReplica { replica } => {
                        retiring.insert(replica.0);
                    }
                    _ => {}
                }
                core.handle_input(now, input);
            }
            (_, Some(t)) => {
                now = now.max(t);
                core.handle_timeout(now);
            }
            (None, None) | (Some(_), None) => return Err(format!("stalled: {}", core.summary())),
        }
    }
    Err("did not finish".into())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Over many seeds and disciplines, with failures, losses and random timings: no trajectory
    /// trained twice, every trained group whole, no trained turn beyond the bound (by the
    /// world's own record of which version served it), no pool over capacity, and every step
    /// trained.
    #[test]
    fn the_core_keeps_its_promises_in_a_random_world(
        seed in any::<u64>(),
        discipline in prop_oneof![
            Just(Discipline::Continuous),
            Just(Discipline::Batched { lag: 0 }),
            Just(Discipline::Batched { lag: 1 }),
        ],
        staleness in 0u64..3,
        pd in any::<bool>(),
        hold in any::<bool>(),
        interrupt in any::<bool>(),
    ) {
        let staleness = match discipline {
            Discipline::Batched { lag } => lag,
            Discipline::Continuous => staleness,
        };
        // Interrupts come with rolling updates, which only the continuous discipline uses.
        let interrupt = interrupt && discipline == Discipline::Continuous;
        prop_assert_eq!(random_world(seed, discipline, staleness, pd, hold, interrupt), Ok(()));
    }
}

/// Runs every stage the core asks for with a canned outcome (one-turn episodes) until it hands
/// out a training batch; the commands of that last step.
fn run_until_trained(core: &mut Core, mut pending: Vec<StageCommand>) -> Vec<Command> {
    let mut now = 1;
    while let Some(cmd) = pending.pop() {
        let outcome = match cmd.work {
            StageWork::EnvReset { .. } => observed(300, false),
            StageWork::EnvStep { .. } => observed(20, true),
            StageWork::Prefill { .. } => StageOutcome::Prefilled,
            StageWork::Generate { .. } => StageOutcome::Generated { tokens: 40 },
            StageWork::Reward { .. } => StageOutcome::Rewarded { score: 1.0 },
        };
        now += 1;
        let out = finish_when(core, Time(now), cmd.stage, outcome);
        if out.iter().any(|c| matches!(c, Command::Train { .. })) {
            return out;
        }
        pending.extend(runs(&out));
    }
    panic!("the core never handed out a training batch");
}

#[test]
fn an_external_trainers_publication_moves_the_version_only_after_its_steps_batch_was_handed_out() {
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        1,
        1,
        2,
    );
    let (mut core, resets) = started(cfg);
    let refusal = core.publication_refusal(1).unwrap();
    assert!(refusal.contains("has not been handed"), "{refusal}");
    // Refused facts change nothing.
    core.handle_input(Time(1), Input::Published { version: 1 });
    assert_eq!(core.version(), 0);

    let out = run_until_trained(&mut core, resets);
    let Some(Command::Train { publishes, .. }) =
        out.iter().find(|c| matches!(c, Command::Train { .. }))
    else {
        unreachable!()
    };
    assert!(publishes);
    let skip = core.publication_refusal(2).unwrap();
    assert!(
        skip.contains("skips a version: the next one is 1"),
        "{skip}"
    );
    core.handle_input(Time(100), Input::Published { version: 2 });
    assert_eq!(core.version(), 0);

    assert_eq!(core.publication_refusal(1), None);
    core.handle_input(Time(101), Input::Published { version: 1 });
    assert_eq!(core.version(), 1);
    // The same path as the emulated trainer's: the replica is updated to the new version.
    let (_, version) = weight_update(&drain(&mut core));
    assert_eq!(version, 1);
    let again = core.publication_refusal(1).unwrap();
    assert!(again.contains("already published"), "{again}");
    core.handle_input(Time(102), Input::Published { version: 1 });
    assert_eq!(core.version(), 1);
}

#[test]
fn with_interrupts_a_replica_due_for_new_weights_cuts_its_generation_which_resumes_from_its_tokens_on_them()
 {
    // Over-provisioned, so that a second trajectory runs beside the one trained first.
    let mut policy = policy(Discipline::Continuous, 1, 1.0, SyncMode::Rolling);
    policy.interrupt_generation = true;
    let cfg = config(vec![replica(ServeRole::Generate, 10_000)], policy, 1, 1, 3);
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 2, "{resets:?}");
    // The second trajectory's first turn is generating when the first one's step publishes.
    let running = runs(&finish(&mut core, resets[1].stage, observed(100, false)));
    let StageWork::Generate { .. } = running[0].work else {
        panic!("{running:?}")
    };
    let trained = complete_one(&mut core, &resets[0]);
    core.handle_input(
        Time(5),
        Input::TrainFinished {
            batch: trained_batch(&trained),
        },
    );
    let out = drain(&mut core);
    assert!(
        out.contains(&Command::Interrupt {
            stage: running[0].stage
        }),
        "{out:?}"
    );
    assert!(
        !out.iter()
            .any(|c| matches!(c, Command::UpdateWeights { .. })),
        "the replica updated before its generation stopped: {out:?}"
    );
    // It stops after 30 tokens: the replica drains and loads version 1.
    let out = finish(
        &mut core,
        running[0].stage,
        StageOutcome::Interrupted { tokens: 30 },
    );
    assert_eq!(weight_update(&out), (ReplicaId(0), 1));
    assert!(runs(&out).is_empty(), "{out:?}");
    core.handle_input(
        Time(6),
        Input::WeightsUpdated {
            replica: ReplicaId(0),
            version: 1,
        },
    );
    // The turn resumes on version 1: it prefills its input and the 30 tokens again (the cache
    // went with the old weights) and may generate what is left of the action's 100.
    let resumed = runs(&drain(&mut core));
    let resume = resumed
        .iter()
        .find(|s| s.traj == running[0].traj)
        .unwrap_or_else(|| panic!("{resumed:?}"));
    assert_eq!(resume.turn, 0);
    assert_eq!(resume.attempt, running[0].attempt);
    assert_eq!(resume.version, 1);
    let StageWork::Generate {
        cached_tokens,
        prefill_tokens,
        max_new_tokens,
        ..
    } = resume.work
    else {
        panic!("{resume:?}")
    };
    assert_eq!(
        (cached_tokens, prefill_tokens, max_new_tokens),
        (0, 130, 70)
    );
    assert_eq!(core.stats().interrupted_generations, 1);
    // Its turn is as old as its oldest part: version 0, trained one version behind.
    let step = runs(&finish(
        &mut core,
        resume.stage,
        StageOutcome::Generated { tokens: 20 },
    ));
    let reward = runs(&finish(&mut core, step[0].stage, observed(5, true)));
    let out = finish(
        &mut core,
        reward[0].stage,
        StageOutcome::Rewarded { score: 1.0 },
    );
    let Some(Command::Train {
        trajectories,
        tokens,
        ..
    }) = out.iter().find(|c| matches!(c, Command::Train { .. }))
    else {
        panic!("{out:?}")
    };
    assert_eq!(trajectories, &vec![running[0].traj]);
    // The prompt and one action of 30 + 20 tokens (the observation that ends the episode is
    // not part of what is trained).
    assert_eq!(*tokens, 100 + 50);
    assert_eq!(core.stats().staleness_histogram, vec![1, 1]);
}
