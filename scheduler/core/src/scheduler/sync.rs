//! Weight sync and publication: the rolling sync (drain a replica, then update it) and the
//! global sync of the batched baselines, a replica's report that it loaded new weights, the
//! trainer's report that publishes a version, and the expiry-aware hold before a publication.

use crate::protocol::{BatchId, Command, ReplicaId, StageId, SyncMode, Version};

use super::Core;
use super::books::StageKind;
use crate::placement::ServeRole;

impl Core {
    pub(super) fn sync_weights(&mut self) {
        match self.cfg.policy.weight_sync {
            SyncMode::Rolling => self.rolling_sync(),
            mode => self.global_sync(mode),
        }
    }

    pub(super) fn rolling_sync(&mut self) {
        let limit = match self.cfg.policy.max_concurrent_updates {
            0 => self.cfg.trainer.nodes.max(1),
            n => n,
        };
        // Start draining replicas while there are free update slots.
        loop {
            let draining = self.draining.len() as u32;
            if self.updating + draining >= limit || self.pending_update.is_empty() {
                break;
            }
            // Counted once per pick, not per candidate: the pending set can hold every replica.
            let decoding_may_leave =
                !self.cfg.policy.updates_keep_half_decoding || self.fewer_than_half_decoding_out();
            let pick = self
                .pending_update
                .iter()
                .copied()
                .filter(|id| {
                    decoding_may_leave || self.replicas[id.0 as usize].role == ServeRole::Prefill
                })
                .min_by_key(|id| {
                    let r = &self.replicas[id.0 as usize];
                    (r.version, r.in_flight, r.held.len(), *id)
                });
            let Some(id) = pick else { break };
            self.pending_update.remove(&id);
            self.replicas[id.0 as usize].draining = true;
            self.draining.insert(id);
            self.touch(id);
            if self.cfg.policy.interrupt_generation {
                self.interrupt_generations(id);
            }
        }
        let drained: Vec<ReplicaId> = self
            .draining
            .iter()
            .copied()
            .filter(|id| {
                let r = &self.replicas[id.0 as usize];
                r.draining && !r.updating && r.in_flight == 0 && r.held.is_empty()
            })
            .collect();
        for id in drained {
            self.draining.remove(&id);
            self.start_update(id, SyncMode::Rolling);
        }
    }

    /// Whether a decoding replica may leave service for an update now under
    /// `Policy::updates_keep_half_decoding`: only while fewer than half of the decoding replicas
    /// (at least one) are out. A prefill replica always may: it holds no trajectory, and the
    /// turns it would prefill go to the others. Why: the core updates as many replicas at once as
    /// the trainer has nodes, and a trainer of as many nodes as there are decode replicas took
    /// them all out together, so every trajectory's next turn waited for the whole sync and the
    /// planner had to keep trainers small to avoid it. Capping the prefill replicas as well
    /// slowed the RollArt-like job (its prefill replicas came back a few at a time).
    fn fewer_than_half_decoding_out(&self) -> bool {
        let (mut serving, mut out) = (0u32, 0u32);
        for r in &self.replicas {
            if r.role == ServeRole::Prefill || !r.healthy || r.retired {
                continue;
            }
            serving += 1;
            if r.draining || r.updating {
                out += 1;
            }
        }
        out < (serving / 2).max(1)
    }

    /// Asks every generation running on `id` to stop where it is, so that the replica drains
    /// now rather than when its longest answer ends.
    pub(super) fn interrupt_generations(&mut self, id: ReplicaId) {
        let running: Vec<u64> = self
            .stages
            .iter()
            .filter(|(_, rec)| {
                rec.replica == Some(id)
                    && matches!(rec.kind, StageKind::Gen { .. })
                    && !rec.interrupted
            })
            .map(|(sid, _)| sid)
            .collect();
        for sid in running {
            if let Some(rec) = self.stages.get_mut(sid) {
                rec.interrupted = true;
            }
            self.commands.push_back(Command::Interrupt {
                stage: StageId(sid),
            });
        }
    }

    pub(super) fn start_update(&mut self, id: ReplicaId, mode: SyncMode) {
        // Loading weights drops the replica's KV cache.
        for t in self.replicas[id.0 as usize].retained_by_id() {
            self.drop_kv(t, false);
        }
        let r = &mut self.replicas[id.0 as usize];
        r.updating = true;
        self.updating += 1;
        self.stats.weight_updates += 1;
        self.commands.push_back(Command::UpdateWeights {
            replica: id,
            version: self.version,
            bytes: self.cfg.weight_bytes,
            mode,
        });
        self.touch(id);
    }

    pub(super) fn global_sync(&mut self, mode: SyncMode) {
        if self.updating > 0 || self.active > 0 || self.trainer.is_some() {
            return;
        }
        let stale: Vec<ReplicaId> = (0..self.replicas.len())
            .map(|i| ReplicaId(i as u64))
            .filter(|id| {
                let r = &self.replicas[id.0 as usize];
                r.healthy && r.version != Some(self.version)
            })
            .collect();
        for id in stale {
            self.start_update(id, mode);
        }
    }

    pub(super) fn weights_updated(&mut self, id: ReplicaId, version: Version) {
        let Some(r) = self.replicas.get_mut(id.0 as usize) else {
            self.stats.ignored_reports += 1;
            return;
        };
        if !r.updating || !r.healthy {
            self.stats.ignored_reports += 1;
            return;
        }
        r.updating = false;
        r.draining = false;
        r.version = Some(version);
        self.updating = self.updating.saturating_sub(1);
        if version < self.version && self.cfg.policy.weight_sync == SyncMode::Rolling && !r.retiring
        {
            self.pending_update.insert(id);
        }
        self.touch(id);
    }

    pub(super) fn train_finished(&mut self, batch: BatchId) {
        let Some(current) = self.trainer.as_ref() else {
            self.stats.ignored_reports += 1;
            return;
        };
        if current.id != batch {
            self.stats.ignored_reports += 1;
            return;
        }
        let publishes = current.publishes;
        self.trainer = None;
        if publishes {
            self.version += 1;
            self.minibatches_in_step = 0;
            self.last_step = self.now.since(self.last_publish);
            self.last_publish = self.now;
            self.hold_until = None;
            for i in 0..self.replicas.len() {
                self.touch(ReplicaId(i as u64));
            }
            self.regenerate_lone_expired();
            self.restart_expired_open_groups();
            self.restart_late_groups();
            self.release_expired_held_kv();
            if self.cfg.policy.weight_sync == SyncMode::Rolling {
                for (i, r) in self.replicas.iter().enumerate() {
                    if r.healthy
                        && !r.updating
                        && !r.retiring
                        && r.version.is_some_and(|v| v < self.version)
                    {
                        self.pending_update.insert(ReplicaId(i as u64));
                    }
                }
            }
        }
    }

    /// Expiry-aware publishing: whether to hold the batch that would publish the next version
    /// because some unfinished group would fall out of the staleness bound the moment it is
    /// published (and be regenerated). The hold lasts until no such group is left or for half the
    /// previous step's duration, whichever comes first; the trainer is rarely the bottleneck of
    /// agentic RL, so a short wait costs less than regenerating whole groups.
    pub(super) fn hold_publish(&mut self) -> bool {
        if let Some(until) = self.hold_until {
            if self.now >= until {
                return false;
            }
            if self.hold_checked == self.groups_closed {
                return true;
            }
        }
        self.hold_checked = self.groups_closed;
        let s = self.cfg.policy.max_staleness;
        let v = self.version;
        let at_risk = self.open_groups.iter().any(|g| {
            self.groups[g.0 as usize]
                .members
                .iter()
                .filter_map(|m| self.trajs[m.0 as usize].oldest())
                .min()
                .is_some_and(|oldest| oldest + s <= v)
        });
        if !at_risk {
            self.hold_until = None;
            return false;
        }
        if self.hold_until.is_none() {
            let limit = crate::time::Span(self.last_step.0 / 2);
            if limit == crate::time::Span::ZERO {
                return false;
            }
            self.hold_until = Some(self.now.plus(limit));
        }
        true
    }
}
