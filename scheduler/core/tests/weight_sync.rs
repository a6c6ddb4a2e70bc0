//! Weight sync: replicas take new weights one at a time while the others keep serving (never
//! more than half of the decoding ones at once under rollfleet's policy), a
//! generation interrupted for new weights resumes from its tokens on them, and the first replica
//! back on new weights does not take every turn waiting for them.
#![allow(clippy::unwrap_used)]

mod common;

use rollfleet_core::{
    Command, Core, Discipline, Input, ReplicaConfig, ReplicaId, ServeRole, StageOutcome, StageWork,
    SyncMode, Time,
};

use common::*;

#[test]
fn weights_are_updated_one_replica_at_a_time_while_the_others_keep_serving() {
    // Bound 2: at version 1 a new trajectory may still start on a version-0 replica (it has two
    // more steps to finish in); with bound 1 it would wait for new weights (next test). Three
    // steps, so that the job's last trajectories do not all start at once.
    let cfg = config(
        vec![
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
            replica(ServeRole::Generate, 10_000),
        ],
        policy(Discipline::Continuous, 2, 0.0, SyncMode::Rolling),
        1,
        1,
        3,
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
fn with_interrupts_a_replica_due_for_new_weights_cuts_its_generation_which_resumes_from_its_tokens_on_them()
 {
    // Over-provisioned past the staleness budget of one batch, so that a second trajectory
    // runs beside the one trained first.
    let mut policy = policy(Discipline::Continuous, 1, 1.0, SyncMode::Rolling);
    policy.cap_over_provisioning = false;
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

/// A staleness-1 job of one group of six a step on `roles` (16 batch slots each), with the
/// cold-turn rule on or off, run until the trainer has published version 1 and the next group
/// has reset with prompts of `prompt` tokens. The core, and the replicas the rolling update
/// takes first.
fn published_with_the_next_group_reset(
    roles: &[ServeRole],
    spread: bool,
    prompt: u64,
) -> (Core, Vec<ReplicaId>) {
    let mut policy = policy(Discipline::Continuous, 1, 0.0, SyncMode::Rolling);
    policy.spread_cold_turns = spread;
    let roomy = |&role: &ServeRole| ReplicaConfig {
        max_seqs: 16,
        ..replica(role, 100_000)
    };
    let cfg = config(roles.iter().map(roomy).collect(), policy, 6, 6, 3);
    let (mut core, resets) = started(cfg);
    let trained = run_until_trained(&mut core, resets);
    let mut resets: Vec<_> = runs(&trained)
        .into_iter()
        .filter(|s| matches!(s.work, StageWork::EnvReset { .. }))
        .collect();
    core.handle_input(
        Time(100),
        Input::TrainFinished {
            batch: trained_batch(&trained),
        },
    );
    let updates: Vec<ReplicaId> = drain(&mut core)
        .iter()
        .filter_map(|c| match c {
            Command::UpdateWeights {
                replica,
                version: 1,
                ..
            } => Some(*replica),
            _ => None,
        })
        .collect();
    assert!(
        !updates.is_empty(),
        "no weight update after the publication"
    );
    // The next group's six resets (four at a time on the four vCPUs) end, and no first turn
    // starts on the old weights.
    let mut ended = 0;
    while let Some(reset) = resets.pop() {
        ended += 1;
        for next in finish_at(&mut core, 101.0, reset.stage, observed(prompt, false)) {
            assert!(
                matches!(next.work, StageWork::EnvReset { .. }),
                "a first turn started on old weights: {next:?}"
            );
            resets.push(next);
        }
    }
    assert_eq!(ended, 6);
    (core, updates)
}

/// At staleness 1 the first turns of the groups started after a publication wait for a replica
/// on the new weights; the replica updated first takes them. How many it takes, with the rule
/// spreading turns without a KV cache on or off.
fn first_turns_taken_by_the_replica_updated_first(spread: bool) -> (usize, usize) {
    let (mut core, updates) =
        published_with_the_next_group_reset(&[ServeRole::Generate; 3], spread, 300);
    let first = updates[0];
    core.handle_input(
        Time::from_secs_f64(102.0),
        Input::WeightsUpdated {
            replica: first,
            version: 1,
        },
    );
    let generated: Vec<_> = runs(&drain(&mut core))
        .into_iter()
        .filter(|s| matches!(s.work, StageWork::Generate { .. }))
        .collect();
    let on_first = generated
        .iter()
        .filter(|s| matches!(s.work, StageWork::Generate { replica, .. } if replica == first))
        .count();
    (on_first, generated.len())
}

#[test]
fn a_replica_back_from_a_weight_update_takes_at_most_twice_its_share_of_the_turns_waiting_for_it() {
    // Six first turns wait and none runs; the fleet has 48 batch slots, so a replica's even
    // share is 2 of its 16, and it takes turns while it holds fewer than twice that.
    assert_eq!(first_turns_taken_by_the_replica_updated_first(true), (4, 4));
    // Without the rule it takes them all, though the other two replicas follow it at once.
    assert_eq!(
        first_turns_taken_by_the_replica_updated_first(false),
        (6, 6)
    );
}

/// The same on a disaggregated placement: the first turns are prefilled on the prefill replica
/// once it has the new weights, and wait to decode on a decode replica that has them too. How
/// many decode on the decode replica updated first, and how many decode in all.
fn prefilled_first_turns_decoded_by_the_decode_replica_updated_first(
    spread: bool,
) -> (usize, usize) {
    let roles = [
        ServeRole::Prefill,
        ServeRole::Decode,
        ServeRole::Decode,
        ServeRole::Decode,
    ];
    // Prompts long enough for the prefill replica.
    let (mut core, mut updates) = published_with_the_next_group_reset(&roles, spread, 2_000);
    // The replicas take the new weights one at a time; every prefill ends at once, and the
    // decodes are counted where they go until the first decode replica on the new weights has
    // taken what it will take.
    let mut decoded: Vec<ReplicaId> = Vec::new();
    let mut first_decode_replica = None;
    let mut now = 102.0;
    while let Some(replica) = updates.pop() {
        now += 1.0;
        core.handle_input(
            Time::from_secs_f64(now),
            Input::WeightsUpdated {
                replica,
                version: 1,
            },
        );
        let mut out = drain(&mut core);
        loop {
            let mut more = Vec::new();
            for c in &out {
                match c {
                    Command::UpdateWeights { replica, .. } => updates.insert(0, *replica),
                    Command::Run(s) => match s.work {
                        StageWork::Prefill { .. } => more.extend(finish_when(
                            &mut core,
                            Time::from_secs_f64(now),
                            s.stage,
                            StageOutcome::Prefilled,
                        )),
                        StageWork::Generate { replica, .. } => decoded.push(replica),
                        _ => {}
                    },
                    _ => {}
                }
            }
            if more.is_empty() {
                break;
            }
            out = more;
        }
        if first_decode_replica.is_none() {
            first_decode_replica = decoded.first().copied();
        }
        if first_decode_replica.is_some() {
            break;
        }
    }
    let first = first_decode_replica.expect("no first turn was decoded");
    (
        decoded.iter().filter(|&&r| r == first).count(),
        decoded.len(),
    )
}

#[test]
fn a_decode_replica_back_from_a_weight_update_takes_at_most_twice_its_share_of_the_prefilled_turns()
{
    // Six prefilled turns wait to decode; the decode replicas have 48 slots, so a replica's
    // even share is 2 of its 16: it takes four, and the other two wait for the next replica.
    assert_eq!(
        prefilled_first_turns_decoded_by_the_decode_replica_updated_first(true),
        (4, 4)
    );
    assert_eq!(
        prefilled_first_turns_decoded_by_the_decode_replica_updated_first(false),
        (6, 6)
    );
}

/// The replicas a publication's rolling update starts at once, by role.
fn updates_started(keep_half_decoding: bool) -> (Core, Vec<ReplicaId>) {
    let mut replicas = vec![replica(ServeRole::Prefill, 10_000); 2];
    replicas.extend(vec![replica(ServeRole::Decode, 10_000); 4]);
    let mut policy = policy(Discipline::Continuous, 2, 0.0, SyncMode::Rolling);
    // A trainer that could feed every replica at once.
    policy.max_concurrent_updates = 8;
    policy.updates_keep_half_decoding = keep_half_decoding;
    let (mut core, resets) = started(config(replicas, policy, 1, 1, 3));
    let before = complete_one(&mut core, &resets[0]);
    core.handle_input(
        Time(5),
        Input::TrainFinished {
            batch: trained_batch(&before),
        },
    );
    let updated = drain(&mut core)
        .iter()
        .filter_map(|c| match c {
            Command::UpdateWeights { replica, .. } => Some(*replica),
            _ => None,
        })
        .collect();
    (core, updated)
}

#[test]
fn a_rolling_update_keeps_half_of_the_decoding_replicas_serving_however_many_the_trainer_could_feed()
 {
    // Replicas 0 and 1 prefill, 2 to 5 decode.
    let decoding = |ids: &[ReplicaId]| ids.iter().filter(|r| r.0 >= 2).count();
    let (_, all_at_once) = updates_started(false);
    assert_eq!(all_at_once.len(), 6, "{all_at_once:?}");
    let (mut core, updated) = updates_started(true);
    // Both prefill replicas (they hold no trajectory) and two of the four decoding ones.
    assert_eq!(decoding(&updated), 2, "{updated:?}");
    assert!(updated.contains(&ReplicaId(0)) && updated.contains(&ReplicaId(1)));
    // One decoding replica back on the new weights lets the next one go.
    let back = *updated.iter().find(|r| r.0 >= 2).unwrap();
    core.handle_input(
        Time(6),
        Input::WeightsUpdated {
            replica: back,
            version: 1,
        },
    );
    let next: Vec<ReplicaId> = drain(&mut core)
        .iter()
        .filter_map(|c| match c {
            Command::UpdateWeights { replica, .. } => Some(*replica),
            _ => None,
        })
        .collect();
    assert_eq!(next.len(), 1, "{next:?}");
    assert!(next[0].0 >= 2 && !updated.contains(&next[0]), "{next:?}");
}
