//! Stages that fail or never answer: retried, and a trajectory that fails too often in a row
//! gives up its group, which a fresh group replaces.
#![allow(clippy::unwrap_used)]

mod common;

use rollfleet_core::{
    Command, Core, Discipline, Input, ServeRole, Span, StageId, StageOutcome, StageWork, SyncMode,
    Time,
};

use common::*;

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
