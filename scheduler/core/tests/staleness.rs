//! The staleness bound: where a new turn may start, and the regeneration of turns (and the restart
//! of groups) a publication puts, or is about to put, out of the bound.
#![allow(clippy::unwrap_used)]

mod common;

use rollfleet_core::{
    Command, Core, Discipline, Input, ServeRole, StageCommand, StageOutcome, StageWork, SyncMode,
    Time, TrajId,
};

use common::*;

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
    // Over-provisioned past the bound on purpose, so that a trajectory expires.
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        uncapped(policy(Discipline::Continuous, 0, 1.0, SyncMode::Rolling)),
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
    // Over-provisioned past the bound on purpose, so that a trajectory expires.
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        uncapped(policy(Discipline::Continuous, 0, 1.0, SyncMode::Rolling)),
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

#[test]
fn a_long_group_that_started_late_on_weights_a_publication_makes_old_starts_over_on_the_new_ones() {
    let (again, restarted) = late_group_after_the_first_publication(10);
    assert_eq!((again.turn, again.attempt, again.version), (0, 1, 1));
    assert_eq!(restarted, 1);
}

#[test]
fn a_late_group_carries_on_where_the_job_has_no_batch_left_that_it_could_miss() {
    // Two steps: trajectory 2's version-0 turn may be trained in the second and last batch
    // (bound 1), which waits for it anyway; started over, it would only lose its turns.
    let (again, restarted) = late_group_after_the_first_publication(2);
    assert_eq!((again.turn, again.attempt, again.version), (1, 0, 1));
    assert_eq!(restarted, 0);
}

/// Bound 1, groups of one, three in flight, a task of up to 40 turns, a job of `steps` steps.
/// Trajectory 0 takes turns of exactly 1 s (so 40 turns take 40 s by the core's measure);
/// trajectory 1 finishes at 30 s and publishes version 1 (a mean step of 30 s); trajectory 2
/// starts its first turn at 27 s. With one step left before its version-0 turn expires,
/// trajectory 2 (3 s old) would need 37 s more: it starts over on version 1 (two steps to
/// finish in) if a batch after the next is left. Trajectory 0 (30 s old, 10 s to go at most)
/// carries on. Returns trajectory 2's next generation and the groups restarted.
fn late_group_after_the_first_publication(steps: u64) -> (StageCommand, u64) {
    let mut cfg = config(
        vec![replica(ServeRole::Generate, 1_000_000)],
        uncapped(policy(Discipline::Continuous, 1, 2.0, SyncMode::Rolling)),
        1,
        1,
        steps,
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
    let again = stage_of(
        &finish_at(&mut core, 32.0, s2.stage, observed(100, false)),
        2,
    );
    (again, core.stats().groups_restarted)
}

/// `policy` with every over-provisioned trajectory started, past the staleness budget.
fn uncapped(policy: rollfleet_core::Policy) -> rollfleet_core::Policy {
    rollfleet_core::Policy {
        cap_over_provisioning: false,
        ..policy
    }
}

/// Bound 1, groups of two, one replica. Group 1 (trajectories 2 and 3) runs across two
/// publications: trajectory 2's only turn comes from version 0, trajectory 3's from version 1;
/// group 2 finishes first and publishes version 2, which puts trajectory 2's turn out of the
/// bound while both are in their environment steps. Then both finish. Returns the core then,
/// with `restart` as its policy's `restart_expired_groups`, and the commands of both finishes.
fn a_group_expired_while_running(restart: bool) -> (Core, Vec<Command>) {
    let cfg = config(
        vec![replica(ServeRole::Generate, 10_000)],
        rollfleet_core::Policy {
            restart_expired_groups: restart,
            ..uncapped(policy(Discipline::Continuous, 1, 1.0, SyncMode::Rolling))
        },
        2,
        2,
        10,
    );
    let (mut core, resets) = started(cfg);
    assert_eq!(resets.len(), 4, "two groups started: {resets:?}");
    // Trajectory 2 generates its only turn on version 0; its environment step stays open.
    let g2 = stage_of(
        &finish_at(&mut core, 1.0, resets[2].stage, observed(100, false)),
        2,
    );
    assert_eq!(g2.version, 0);
    let step2 = generated_at(&mut core, 2.0, g2.stage, 2);
    // Group 0 is trained on: version 1, and group 2 (trajectories 4 and 5) starts.
    complete_one(&mut core, &resets[0]);
    let taken = complete_one(&mut core, &resets[1]);
    let batch = trained_batch(&taken);
    core.handle_input(Time::from_secs_f64(3.0), Input::TrainFinished { batch });
    let (replica, version) = weight_update(&drain(&mut core));
    assert_eq!(version, 1);
    let group2: Vec<StageCommand> = runs(&taken)
        .into_iter()
        .filter(|s| matches!(s.work, StageWork::EnvReset { .. }))
        .collect();
    assert_eq!(
        group2.iter().map(|s| s.traj).collect::<Vec<_>>(),
        [TrajId(4), TrajId(5)]
    );
    core.handle_input(
        Time::from_secs_f64(4.0),
        Input::WeightsUpdated { replica, version },
    );
    drain(&mut core);
    // Trajectory 3 generates its only turn on version 1; its environment step stays open.
    let g3 = stage_of(
        &finish_at(&mut core, 5.0, resets[3].stage, observed(100, false)),
        3,
    );
    assert_eq!(g3.version, 1);
    let step3 = generated_at(&mut core, 6.0, g3.stage, 3);
    // Group 2 is trained on: version 2, which puts trajectory 2's turn out of the bound.
    complete_one(&mut core, &group2[0]);
    let batch = trained_batch(&complete_one(&mut core, &group2[1]));
    core.handle_input(Time::from_secs_f64(7.0), Input::TrainFinished { batch });
    let (replica, version) = weight_update(&drain(&mut core));
    assert_eq!(version, 2);
    core.handle_input(
        Time::from_secs_f64(8.0),
        Input::WeightsUpdated { replica, version },
    );
    drain(&mut core);
    // Group 1 finishes.
    let mut out = Vec::new();
    for (t, step) in [(2, step2), (3, step3)] {
        let reward = stage_of(&finish_at(&mut core, 9.0, step.stage, observed(5, true)), t);
        out.extend(finish_when(
            &mut core,
            Time::from_secs_f64(10.0),
            reward.stage,
            StageOutcome::Rewarded { score: 0.0 },
        ));
    }
    (core, out)
}

#[test]
fn a_group_past_the_bound_starts_over_on_the_current_weights_at_the_publication_not_when_taken() {
    // Rewound to the bound's floor (version 1), the group would keep trajectory 3's version-1
    // turn and have only the current step to finish in; restarted, both members start over on
    // version 2, each as it finishes, and the trainer never finds the group past the bound.
    let (core, out) = a_group_expired_while_running(true);
    assert_eq!(core.stats().groups_restarted, 1);
    assert_eq!(core.stats().groups_expired_waiting, 0);
    assert_eq!(core.stats().regenerated_at_consumption, 0);
    let again = runs(&out);
    for t in [2, 3] {
        let regen = stage_of(&again, t);
        assert_eq!(
            (regen.turn, regen.attempt, regen.version),
            (0, 1, 2),
            "{again:?}"
        );
    }
    // Without the rule, the group is found past the bound when the trainer takes it, and only
    // the member with a turn out of the bound is rewound.
    let (core, out) = a_group_expired_while_running(false);
    assert_eq!(core.stats().regenerated_at_consumption, 1);
    assert_eq!(core.stats().groups_expired_waiting, 1);
    let again = runs(&out);
    assert_eq!(stage_of(&again, 2).attempt, 1, "{again:?}");
    assert!(!again.iter().any(|s| s.traj == TrajId(3)), "{again:?}");
}
