//! Where the core routes a turn and how it books KV caches: sticky sessions back to the replica
//! that keeps a trajectory's cache, prefill/decode disaggregation of long contexts, and no
//! replica given more cache than it holds.
#![allow(clippy::unwrap_used)]

mod common;

use rollfleet_core::{
    Command, Core, Discipline, Input, ReplicaId, ServeRole, StageCommand, StageOutcome, StageWork,
    SyncMode, Time,
};

use common::*;

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

#[test]
fn a_first_turn_waits_for_a_decode_replica_taking_its_prefills_weights_instead_of_decoding_on_older_ones()
 {
    // Staleness 1: a first turn decoded on version 0 once version 1 is out would leave its
    // group one step to be trained in instead of two.
    let cfg = config(
        vec![
            replica(ServeRole::Prefill, 10_000),
            replica(ServeRole::Decode, 10_000),
            replica(ServeRole::Decode, 10_000),
        ],
        policy(Discipline::Continuous, 1, 0.0, SyncMode::Rolling),
        1,
        1,
        2,
    );
    let (mut core, resets) = started(cfg);
    let prefill = runs(&finish(&mut core, resets[0].stage, observed(2_000, false)));
    let decode = runs(&finish(
        &mut core,
        prefill[0].stage,
        StageOutcome::Prefilled,
    ));
    let step = runs(&finish(
        &mut core,
        decode[0].stage,
        StageOutcome::Generated { tokens: 10 },
    ));
    let reward = runs(&finish(&mut core, step[0].stage, observed(5, true)));
    let out = finish(
        &mut core,
        reward[0].stage,
        StageOutcome::Rewarded { score: 0.0 },
    );
    let batch = trained_batch(&out);
    // The trainer took the first trajectory, which let the second one start (its reset).
    let second = runs(&out)
        .into_iter()
        .find(|s| matches!(s.work, StageWork::EnvReset { .. }))
        .unwrap();
    core.handle_input(Time(5), Input::TrainFinished { batch });
    // One replica at a time: the prefill replica first, then decode replica 1, while decode
    // replica 2 still serves version 0 and has room.
    let (first, version) = weight_update(&drain(&mut core));
    assert_eq!((first, version), (ReplicaId(0), 1));
    core.handle_input(
        Time(6),
        Input::WeightsUpdated {
            replica: first,
            version,
        },
    );
    let (updating, _) = weight_update(&drain(&mut core));
    assert_eq!(updating, ReplicaId(1));

    let prefill = runs(&finish_when(
        &mut core,
        Time(7),
        second.stage,
        observed(2_000, false),
    ));
    assert!(
        matches!(
            prefill[0].work,
            StageWork::Prefill {
                replica: ReplicaId(0),
                ..
            }
        ),
        "{prefill:?}"
    );
    let waiting = runs(&finish_when(
        &mut core,
        Time(8),
        prefill[0].stage,
        StageOutcome::Prefilled,
    ));
    assert!(
        !waiting
            .iter()
            .any(|s| matches!(s.work, StageWork::Generate { .. })),
        "decoded on version 0 while a decode replica was taking version 1: {waiting:?}"
    );
    core.handle_input(
        Time(9),
        Input::WeightsUpdated {
            replica: updating,
            version: 1,
        },
    );
    let decode = runs(&drain(&mut core));
    let generate = decode
        .iter()
        .find(|s| matches!(s.work, StageWork::Generate { .. }))
        .unwrap_or_else(|| panic!("no decode once replica 1 had version 1: {decode:?}"));
    assert_eq!(generate.version, 1);
    assert!(
        matches!(
            generate.work,
            StageWork::Generate {
                replica: ReplicaId(1),
                kv_from: Some(ReplicaId(0)),
                ..
            }
        ),
        "{generate:?}"
    );
}

#[test]
fn a_trajectory_starts_only_where_it_leaves_a_quarter_of_the_kv_cache_to_those_already_there() {
    // 1,000 tokens of KV, first turns of 200 (a 100-token prompt and up to 100 new): three
    // start (600), the fourth would fill 800 of it, past three quarters, so it waits, though
    // the cache has room for it; without the rule it starts.
    let starts = |leave_room: bool| {
        let mut policy = policy(Discipline::Continuous, 0, 0.0, SyncMode::Rolling);
        policy.start_leaves_kv_room = leave_room;
        let cfg = config(vec![replica(ServeRole::Generate, 1_000)], policy, 4, 4, 1);
        let (mut core, resets) = started(cfg);
        let generations: Vec<Vec<StageCommand>> = resets
            .iter()
            .map(|r| runs(&finish(&mut core, r.stage, observed(100, false))))
            .collect();
        core.check_invariants().unwrap();
        (core, generations)
    };
    let (_, free_for_all) = starts(false);
    assert!(
        free_for_all.iter().all(|g| g.len() == 1),
        "{free_for_all:?}"
    );
    let (mut core, generations) = starts(true);
    assert!(
        generations[..3].iter().all(|g| g.len() == 1),
        "{generations:?}"
    );
    assert!(generations[3].is_empty(), "{generations:?}");
    // The first ends its only turn and its episode: its cache goes, and the fourth starts.
    let step = runs(&finish(
        &mut core,
        generations[0][0].stage,
        StageOutcome::Generated { tokens: 100 },
    ));
    let mut next = runs(&finish(&mut core, step[0].stage, observed(10, true)));
    let mut rounds = 0;
    while !next
        .iter()
        .any(|s| matches!(s.work, StageWork::Generate { .. }))
    {
        rounds += 1;
        assert!(rounds < 4, "{next:?}");
        let stage = next.first().unwrap().stage;
        next = runs(&finish(
            &mut core,
            stage,
            StageOutcome::Rewarded { score: 1.0 },
        ));
    }
    assert_eq!(core.stats().kv_evictions, 0);
    core.check_invariants().unwrap();
}
