//! The core's promises in a random world: a world that answers every command after a random
//! delay, with random lengths, failures and replica losses, keeps its own books, and checks
//! the core against them (the cases proptest once found are replayed from
//! `scheduler.proptest-regressions`).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use rollfleet_core::rng::SplitMix64;
use rollfleet_core::{
    Command, Core, Discipline, Input, ReplicaId, ServeRole, Span, StageId, StageOutcome, StageWork,
    SyncMode, Time, TrajId,
};

use common::*;

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
