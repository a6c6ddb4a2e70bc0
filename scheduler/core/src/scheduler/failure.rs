//! Failures and the fleet's changes: a stage that fails or times out (retried, or its group
//! given up), and a serving replica lost, recovered, added or retired.

use std::collections::BTreeSet;

use crate::config::Discipline;
use crate::placement::ServeRole;
use crate::protocol::{Command, ReplicaId, StageId, StageWork, SyncMode, TrajId};

use super::Core;
use super::books::{Phase, Queue, Replica, StageKind};

impl Core {
    /// A stage failed or timed out: retried, unless its trajectory has now failed
    /// [`Config::stage_failure_limit`] times in a row, which gives up its group.
    pub(super) fn stage_failed(&mut self, stage: StageId, cancel: bool) {
        let Some(t) = self.stages.get(stage.0).map(|s| s.traj) else {
            self.stats.ignored_reports += 1;
            return;
        };
        let traj = &mut self.trajs[t.0 as usize];
        traj.failures_in_a_row = traj.failures_in_a_row.saturating_add(1);
        if traj.failures_in_a_row >= self.cfg.stage_failure_limit.max(1) {
            if cancel {
                self.commands.push_back(Command::Cancel { stage });
            }
            self.take_stage(stage);
            self.abandon_group(t);
        } else {
            self.fail_stage(stage, cancel);
        }
    }

    /// Gives up `failed`'s group: cancels its members' stages, frees their KV caches, takes
    /// the group out of every queue and of the trainer's ready set, and makes room for a fresh
    /// group (the continuous window counts live groups only; a batched step starts one in the
    /// same batch).
    pub(super) fn abandon_group(&mut self, failed: TrajId) {
        let g = self.trajs[failed.0 as usize].group;
        let members = self.groups[g.0 as usize].members.clone();
        let doomed: Vec<StageId> = self
            .stages
            .iter()
            .filter(|(_, s)| members.contains(&s.traj))
            .map(|(id, _)| StageId(id))
            .collect();
        // A stage whose `Run` is still unpolled is simply not sent; the others are cancelled.
        let mut unsent = BTreeSet::new();
        self.commands.retain(|c| match c {
            Command::Run(s) if doomed.contains(&s.stage) => {
                unsent.insert(s.stage);
                false
            }
            _ => true,
        });
        for stage in doomed {
            self.take_stage(stage);
            if !unsent.contains(&stage) {
                self.commands.push_back(Command::Cancel { stage });
            }
        }
        for &t in &members {
            self.dequeue(t);
            self.drop_kv(t, true);
            let traj = &mut self.trajs[t.0 as usize];
            if !matches!(traj.phase, Phase::Complete | Phase::Consumed) {
                self.active = self.active.saturating_sub(1);
            }
            traj.phase = Phase::Abandoned;
        }
        let group = &mut self.groups[g.0 as usize];
        let batch = group.batch;
        if let Some(key) = group.ready_key.take() {
            self.ready.remove(&key);
            for count in [&mut self.batch_complete, &mut self.batch_done] {
                if let Some(c) = count.get_mut(&batch) {
                    *c = c.saturating_sub(1);
                }
            }
        }
        if self.open_groups.remove(&g) {
            self.groups_closed += 1;
        }
        self.stats.groups_abandoned += 1;
        self.commands.push_back(Command::AbandonGroup {
            group: g,
            trajectories: members,
            failed,
        });
        if let Discipline::Batched { .. } = self.cfg.policy.discipline {
            self.start_group(batch);
        }
        self.repump = true;
    }

    /// Puts a failed (or lost, or timed-out) stage's trajectory back in the right queue;
    /// `cancel`: tell the worker to abandon it (the core, not the worker, gave up on it).
    pub(super) fn fail_stage(&mut self, stage: StageId, cancel: bool) {
        let Some(rec) = self.take_stage(stage) else {
            self.stats.ignored_reports += 1;
            return;
        };
        if cancel {
            self.commands.push_back(Command::Cancel { stage });
        }
        self.stats.stage_retries += 1;
        let t = rec.traj;
        match rec.kind {
            StageKind::EnvReset | StageKind::EnvStep => {
                self.enqueue(t, Queue::Env, Phase::QueuedEnv);
            }
            StageKind::Prefill | StageKind::Gen { .. } => {
                self.drop_kv(t, true);
                self.enqueue(t, Queue::Gen, Phase::QueuedGen);
            }
            StageKind::Reward => self.enqueue(t, Queue::Reward, Phase::QueuedReward),
        }
    }

    pub(super) fn replica_lost(&mut self, id: ReplicaId) {
        let Some(r) = self.replicas.get_mut(id.0 as usize) else {
            self.stats.ignored_reports += 1;
            return;
        };
        if !r.healthy {
            return;
        }
        r.healthy = false;
        if r.updating {
            r.updating = false;
            self.updating = self.updating.saturating_sub(1);
        }
        r.draining = false;
        self.pending_update.remove(&id);
        self.draining.remove(&id);
        self.touch(id);
        let doomed: Vec<StageId> = self
            .stages
            .iter()
            .filter(|(_, s)| s.replica == Some(id) || s.kv_from.is_some_and(|(p, _)| p == id))
            .map(|(sid, _)| StageId(sid))
            .collect();
        for sid in doomed {
            self.fail_stage(sid, true);
        }
        let r = &self.replicas[id.0 as usize];
        let mut cached = r.retained_by_id();
        cached.extend(r.held.iter().copied());
        for t in cached {
            self.drop_kv(t, false);
            if self.trajs[t.0 as usize].phase == Phase::QueuedDecode {
                self.enqueue(t, Queue::Gen, Phase::QueuedGen);
            }
        }
        let r = &mut self.replicas[id.0 as usize];
        r.kv_reserved = 0;
        r.in_flight = 0;
        r.version = None;
        self.forget_unsent_commands_to(id);
    }

    /// Drops the commands not yet polled that address a replica just lost. Their stages were
    /// failed and re-queued above, so sending them would start work the core has already given
    /// up on (on a replica that is gone); a `Cancel` for such a stage would name one never sent.
    pub(super) fn forget_unsent_commands_to(&mut self, id: ReplicaId) {
        let mut unsent = BTreeSet::new();
        self.commands.retain(|c| match c {
            Command::Run(s) => {
                let addressed = match s.work {
                    StageWork::Prefill { replica, .. } => replica == id,
                    StageWork::Generate {
                        replica, kv_from, ..
                    } => replica == id || kv_from == Some(id),
                    _ => false,
                };
                if addressed {
                    unsent.insert(s.stage);
                }
                !addressed
            }
            Command::UpdateWeights { replica, .. } | Command::ReleaseKv { replica, .. } => {
                *replica != id
            }
            // Moot for a stage failed with the replica.
            Command::Interrupt { stage } => self.stages.contains(stage.0),
            Command::Cancel { .. }
            | Command::Train { .. }
            | Command::AbandonGroup { .. }
            | Command::ReplicaRetired { .. } => true,
        });
        if !unsent.is_empty() {
            self.commands
                .retain(|c| !matches!(c, Command::Cancel { stage } if unsent.contains(stage)));
        }
    }

    pub(super) fn replica_recovered(&mut self, id: ReplicaId) {
        let Some(r) = self.replicas.get_mut(id.0 as usize) else {
            self.stats.ignored_reports += 1;
            return;
        };
        if r.retired {
            self.stats.ignored_reports += 1;
            return;
        }
        if r.healthy {
            return;
        }
        r.healthy = true;
        r.version = None;
        r.failures = 0;
        // A recovered replica gets the current weights straight away, whatever the discipline
        // (it holds no KV cache: its caches went when it was lost).
        self.start_update(id, SyncMode::Rolling);
    }

    pub(super) fn replica_added(&mut self, config: crate::placement::ReplicaConfig) {
        let id = ReplicaId(self.replicas.len() as u64);
        let mut r = Replica::new(&config);
        // Like a recovered replica: no weights until it has loaded the current ones.
        r.version = None;
        self.stats.replicas_added += 1;
        self.disaggregated |= config.role == ServeRole::Prefill;
        self.replicas.push(r);
        self.cfg.replicas.push(config);
        self.start_update(id, SyncMode::Rolling);
    }

    pub(super) fn retire_replica(&mut self, id: ReplicaId) {
        let Some(r) = self.replicas.get_mut(id.0 as usize) else {
            self.stats.ignored_reports += 1;
            return;
        };
        if r.retiring || r.retired {
            return;
        }
        r.retiring = true;
        self.retiring += 1;
        // With the last prefill replica going, long inputs are prefilled where they decode, as
        // on a colocated placement; otherwise they would wait for a prefill replica forever.
        self.disaggregated = self
            .replicas
            .iter()
            .any(|r| r.role == ServeRole::Prefill && !r.retiring && !r.retired);
        let r = &mut self.replicas[id.0 as usize];
        // A rolling update it was waiting for or draining for is moot.
        r.draining = false;
        self.pending_update.remove(&id);
        self.draining.remove(&id);
        // The caches it keeps between turns would pin trajectories to it: their next turns
        // prefill elsewhere instead.
        for t in r.retained_by_id() {
            self.drop_kv(t, true);
        }
        self.touch(id);
        self.repump = true;
    }

    /// Hands back every retiring replica that nothing runs on or waits for any more (a lost one
    /// at once: its work was rescheduled when it was lost).
    pub(super) fn retire_drained(&mut self) {
        if self.retiring == 0 {
            return;
        }
        for i in 0..self.replicas.len() {
            let r = &self.replicas[i];
            let idle = r.in_flight == 0 && r.held.is_empty() && !r.updating;
            if !r.retiring || (r.healthy && !idle) {
                continue;
            }
            let id = ReplicaId(i as u64);
            for t in r.retained_by_id() {
                self.drop_kv(t, true);
            }
            let r = &mut self.replicas[i];
            r.retiring = false;
            self.retiring = self.retiring.saturating_sub(1);
            r.retired = true;
            r.healthy = false;
            r.version = None;
            self.stats.replicas_retired += 1;
            self.touch(id);
            self.commands
                .push_back(Command::ReplicaRetired { replica: id });
        }
    }
}
