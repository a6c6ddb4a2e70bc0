//! A trajectory's life in the core, from its reset to the batch it is trained in, and how the
//! core hands batches to the trainer: the continuous discipline's admission window, the
//! synchronous discipline's step-by-step batches, and an external trainer's publications.
#![allow(clippy::unwrap_used)]

mod common;

use rollfleet_core::{
    Command, Core, Discipline, Input, ReplicaId, ServeRole, StageCommand, StageOutcome, StageWork,
    SyncMode, Time, TrajId,
};

use common::*;

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
fn a_trained_groups_life_is_booked_from_its_admission_first_turn_and_members_finishes() {
    // One group of two, admitted at 0, both members reset by 1 and generating from 1. One
    // member is rewarded at 4, the other at 10, when the trainer takes the group at once: a
    // slot of 10 s, a group done 9 s after its first turn, members living 3 and 9 s.
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling),
        2,
        2,
        1,
    );
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 2);
    let generations: Vec<StageCommand> = resets
        .iter()
        .map(|reset| {
            stage_of(
                &finish_at(&mut core, 1.0, reset.stage, observed(100, false)),
                reset.traj.0,
            )
        })
        .collect();
    let mut live = |t: u64, generated: f64, stepped: f64, rewarded: f64| {
        let step = generated_at(&mut core, generated, generations[t as usize].stage, t);
        let reward = stage_of(
            &finish_at(&mut core, stepped, step.stage, observed(5, true)),
            t,
        );
        finish_when(
            &mut core,
            Time::from_secs_f64(rewarded),
            reward.stage,
            StageOutcome::Rewarded { score: 1.0 },
        )
    };
    live(0, 2.0, 3.0, 4.0);
    let out = live(1, 5.0, 8.0, 10.0);
    trained_batch(&out);
    let lives = &core.stats().task_lives;
    assert_eq!(lives.len(), 1);
    assert_eq!(lives[0].groups, 1);
    assert_eq!(lives[0].members, 2);
    let [slot, group, member, trainer_wait] = lives[0].means().unwrap();
    assert!((slot - 10.0).abs() < 1e-9, "{slot}");
    assert!((group - 9.0).abs() < 1e-9, "{group}");
    assert!((member - 6.0).abs() < 1e-9, "{member}");
    assert!(trainer_wait.abs() < 1e-9, "{trainer_wait}");
}

/// Groups of one started at once on one idle replica, for a rollout batch of 4 under the
/// continuous discipline: how many the admission window lets start.
fn groups_started_at_once(max_staleness: u64, over_provisioning: f64) -> u64 {
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        policy(
            Discipline::Continuous,
            max_staleness,
            over_provisioning,
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
}

#[test]
fn a_loose_staleness_bound_keeps_at_most_two_batches_started_and_untrained() {
    let started = |max_staleness: u64| groups_started_at_once(max_staleness, 0.0);
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
fn over_provisioning_never_starts_more_than_max_staleness_batches_ahead_of_the_trainer() {
    let started = groups_started_at_once;
    // A window of one batch plus a quarter of one over-provisioned: under the budget of two.
    assert_eq!(started(2, 0.25), 5);
    // Four batches over-provisioned would put the mean trajectory past the bound: cut at two.
    assert_eq!(started(2, 4.0), 8);
    // At a bound of 1, three quarters of a batch and one more trajectory make the one batch.
    assert_eq!(started(1, 4.0), 4);
    assert_eq!(started(3, 4.0), 12);
}

#[test]
fn a_finished_group_waiting_for_a_training_batch_leaves_its_place_in_the_window_to_a_new_one() {
    // Groups of one, a rollout batch of 4, training batches of 2, bound 2: a window of 4 and
    // room for 4 more under the bound's budget of two batches.
    let started_after_one_finishes = |excludes_waiting: bool| {
        let mut cfg = config(
            vec![replica(ServeRole::Generate, 10_000)],
            policy(Discipline::Continuous, 2, 0.0, SyncMode::Rolling),
            1,
            4,
            10,
        );
        cfg.train_batch_size = 2;
        cfg.policy.window_excludes_waiting_batch = excludes_waiting;
        let (mut core, resets) = started(cfg);
        assert_eq!(core.stats().groups_started, 4);
        let out = complete_one(&mut core, &resets[0]);
        assert!(
            !out.iter().any(|c| matches!(c, Command::Train { .. })),
            "one finished group is half a training batch: {out:?}"
        );
        let new_resets = runs(&out)
            .iter()
            .filter(|s| matches!(s.work, StageWork::EnvReset { .. }))
            .count() as u64;
        assert_eq!(core.stats().groups_started, 4 + new_resets);
        core.stats().groups_started
    };
    assert_eq!(started_after_one_finishes(true), 5);
    // Counted in the window, it holds its place until the trainer takes it.
    assert_eq!(started_after_one_finishes(false), 4);
}

#[test]
fn the_jobs_last_groups_all_start_once_what_is_left_fits_within_one_batch_more_than_the_window() {
    // Groups of one, rollout and training batches of 4, bound 2: a window of 4, and one batch
    // more is 8, the cap of two batches started and not yet trained.
    let job = |steps: u64, within_budget: bool| {
        let mut cfg = config(
            vec![replica(ServeRole::Generate, 10_000)],
            policy(Discipline::Continuous, 2, 0.0, SyncMode::Rolling),
            1,
            4,
            steps,
        );
        cfg.train_batch_size = 4;
        cfg.policy.sample_within_job_budget = within_budget;
        cfg.policy.window_excludes_waiting_batch = false;
        started(cfg)
    };
    // Two steps are 8 trajectories: all of the job fits, so all of it starts.
    assert_eq!(job(2, true).0.stats().groups_started, 8);
    // Three steps are 12: the window's 4 start, and the job's last 8 once a batch is trained.
    let (mut core, resets) = job(3, true);
    assert_eq!(core.stats().groups_started, 4);
    for reset in &resets[..3] {
        complete_one(&mut core, reset);
    }
    assert_eq!(core.stats().groups_started, 4);
    let out = complete_one(&mut core, &resets[3]);
    trained_batch(&out);
    assert_eq!(core.stats().groups_started, 12);
    // Without the job's budget the window alone decides, whatever is left.
    assert_eq!(job(2, false).0.stats().groups_started, 4);
}

#[test]
fn a_widened_window_starts_its_quarters_of_a_batch_more_with_its_margin_past_the_staleness_cap() {
    // Groups of one, rollout batches of 8, training batches of 2, bound 1, a quarter batch (2)
    // of over-provisioning: the rule's window is 6, and the cap of one batch leaves its margin
    // 2, so 8 start. Widened, the window grows by its quarters of a batch and the cap makes room
    // for the margin and a training batch beside it, so the margin still starts.
    let started_with = |quarters: i32| {
        let mut cfg = config(
            vec![replica(ServeRole::Generate, 10_000)],
            policy(Discipline::Continuous, 1, 0.25, SyncMode::Rolling),
            1,
            8,
            100,
        );
        cfg.train_batch_size = 2;
        cfg.policy.window_excludes_waiting_batch = false;
        cfg.policy.window_widening_quarters = quarters;
        started(cfg).0.stats().groups_started
    };
    assert_eq!(started_with(0), 8);
    assert_eq!(started_with(1), 10);
    assert_eq!(started_with(2), 12);
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

/// Runs trajectory `reset.traj` through a one-turn episode whose reset observes `prompt` tokens;
/// the commands its reward caused.
fn one_turn_episode(core: &mut Core, reset: &StageCommand, prompt: u64) -> Vec<Command> {
    let t = reset.traj.0;
    let generate = stage_of(
        &runs(&finish(core, reset.stage, observed(prompt, false))),
        t,
    );
    let step = stage_of(
        &runs(&finish(
            core,
            generate.stage,
            StageOutcome::Generated { tokens: 10 },
        )),
        t,
    );
    let reward = stage_of(&runs(&finish(core, step.stage, observed(5, true))), t);
    finish(core, reward.stage, StageOutcome::Rewarded { score: 0.0 })
}

/// The trajectories of the training command among `out`, if any.
fn taken(out: &[Command]) -> Option<(rollfleet_core::BatchId, Vec<TrajId>)> {
    out.iter().find_map(|c| match c {
        Command::Train {
            batch,
            trajectories,
            ..
        } => Some((*batch, trajectories.clone())),
        _ => None,
    })
}

#[test]
fn the_trainer_takes_the_cheapest_finished_group_first_unless_the_next_publication_expires_it() {
    // Groups of one, trained one at a time, four a step: trajectory 0 keeps the trainer busy
    // while 1 (a 5,000-token prompt) and then 2 (50 tokens) finish. With cheapest-first
    // training at a staleness bound of 2 the trainer takes 2 next; without it, 1, admitted
    // first. At a bound of 0 the next publication would put both past the bound, so the
    // trainer takes them in admission order whatever the policy.
    for (cheapest, max_staleness, expected) in [(true, 2, 2), (false, 2, 1), (true, 0, 1)] {
        let mut policy = policy(
            Discipline::Continuous,
            max_staleness,
            0.0,
            SyncMode::Rolling,
        );
        policy.cheapest_training_first = cheapest;
        let mut cfg = config(vec![replica(ServeRole::Generate, 100_000)], policy, 1, 4, 2);
        // Room for every environment at once: no step waits for a CPU.
        cfg.cpu_pools[0].millicpus = 64_000;
        let (mut core, resets) = started(cfg);
        assert!(resets.len() >= 3, "{resets:?}");
        let (first, trained) = taken(&one_turn_episode(&mut core, &resets[0], 100)).unwrap();
        assert_eq!(trained, vec![TrajId(0)]);
        assert_eq!(taken(&one_turn_episode(&mut core, &resets[1], 5_000)), None);
        assert_eq!(taken(&one_turn_episode(&mut core, &resets[2], 50)), None);
        core.handle_input(Time(5), Input::TrainFinished { batch: first });
        let (_, next) = taken(&drain(&mut core)).unwrap();
        assert_eq!(
            next,
            vec![TrajId(expected)],
            "cheapest first: {cheapest}, staleness bound {max_staleness}"
        );
    }
}

#[test]
fn a_narrowed_window_stops_at_one_training_batch_and_the_jobs_last_starts_add_no_more_than_it() {
    // Batches of 1024, training batches of 256, groups of 8, a bound of 2, a margin of a quarter:
    // a rule of one batch.
    let terms = |quarters| Core::admission_window(1024, 256, 8, 2, 0.25, true, quarters);
    assert_eq!(terms(0).window, 1024);
    // A batch more than the window and margin, within the cap of two batches.
    assert_eq!(Core::last_starts(terms(0)), 2048);
    assert_eq!(terms(-1).window, 768);
    assert_eq!(terms(-3).window, 256);
    assert_eq!(terms(-8).window, 256, "never below one training batch");
    // The margin and the cap stay the rule's.
    assert_eq!((terms(-3).extra, terms(-3).cap), (256, 2048));
    // Narrowed, the job's last starts add the window's worth, not a whole batch.
    assert_eq!(Core::last_starts(terms(-3)), 256 + 256 + 256);
    assert_eq!(Core::last_starts(terms(-1)), 768 + 256 + 768);
}
