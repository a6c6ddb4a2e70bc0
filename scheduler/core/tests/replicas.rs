//! The serving fleet changing under the core: replicas added mid-run, retired, or lost (with
//! their commands not yet polled), without a trajectory lost.
#![allow(clippy::unwrap_used)]

mod common;

use rollfleet_core::{
    Command, Core, Discipline, Input, ReplicaId, ServeRole, StageOutcome, StageWork, SyncMode, Time,
};

use common::*;

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
