//! Moves to a new plan: re-plans when a pool's GPUs change or the measured profiles drift, and
//! the migration waves that start replicas on free GPUs before retiring others.
//!
//! It also adopts the replicas a lost worker left behind, and keeps each re-plan's record for
//! the report.

use super::*;

/// One re-plan of a running job, and how far moving to it got.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplanRecord {
    /// Wall seconds after the start.
    pub at_s: f64,
    /// What changed.
    pub reason: String,
    /// The pool whose GPUs changed (on drift: the first pool that drifted).
    pub pool: String,
    /// Its GPUs the running plan was made for.
    pub gpus_before: u32,
    /// Its GPUs present now.
    pub gpus_after: u32,
    /// The planner's full prediction of the step (modelled seconds) for the replicas that were
    /// still running; `None` when they could not run the job.
    pub running_step_s: Option<f64>,
    /// The same for the new plan.
    pub planned_step_s: f64,
    /// Replicas retired because their node was gone.
    pub replicas_lost: u32,
    /// Waves of the move to the new plan (0: the replicas that run are the plan).
    pub waves: usize,
    /// Waves finished.
    pub waves_done: usize,
    /// Replicas started by the waves.
    pub replicas_started: u32,
    /// Replicas retired by the waves.
    pub replicas_retired: u32,
    /// Wall seconds after the start at which the last wave ended (`None`: still under way, or
    /// superseded by a later re-plan).
    pub done_at_s: Option<f64>,
    /// The trainer's GPUs after the move resized it on its pool (`None`: not resized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer_gpus: Option<u32>,
}

impl ReplanRecord {
    /// The record of `decision`, made at `at_s` for `reason` on `pool`, whose GPUs went from
    /// `gpus.0` to `gpus.1`, with `replicas_lost` retired with their node; nothing moved yet.
    pub(super) fn new(
        at_s: f64,
        reason: String,
        pool: String,
        (gpus_before, gpus_after): (u32, u32),
        replicas_lost: u32,
        decision: &crate::replan::Decision,
    ) -> ReplanRecord {
        ReplanRecord {
            at_s,
            reason,
            pool,
            gpus_before,
            gpus_after,
            running_step_s: decision.running_step_s,
            planned_step_s: decision.planned_step_s,
            replicas_lost,
            waves: decision.waves.len(),
            waves_done: 0,
            replicas_started: 0,
            replicas_retired: 0,
            done_at_s: None,
            trainer_gpus: None,
        }
    }
}

/// A move to a new plan under way.
pub(super) struct Migration {
    waves: Vec<MigrationWave>,
    /// The next wave to start.
    next: usize,
    /// Replicas of the wave under way still loading their weights or draining.
    waiting: BTreeSet<u64>,
    /// Its record in `Actor::replans`.
    record: usize,
    /// The trainer's GPUs once the wave under way is over, when it resizes the trainer.
    resize_trainer: Option<u32>,
}

impl Actor {
    /// GPUs the job gives a pool.
    pub(super) fn pool_gpus(&self, pool: u32) -> u32 {
        self.plan
            .spec()
            .pools
            .get(pool as usize)
            .and_then(|p| p.count)
            .map_or(0, |c| u32::try_from(c.max(0)).unwrap_or(u32::MAX))
    }

    /// GPUs a worker stands for: what it declared, else its pool's share.
    pub(super) fn worker_gpus(&self, w: &Worker) -> u32 {
        if w.gpus > 0 {
            w.gpus
        } else {
            self.gpu_share.get(&w.pool).copied().unwrap_or(1)
        }
    }

    /// GPUs of a pool its attached workers stand for, at most what the job gives it.
    pub(super) fn gpus_present(&self, pool: u32) -> u32 {
        let sum: u32 = self
            .attached(pool)
            .map(|(_, w)| self.worker_gpus(w))
            .fold(0u32, u32::saturating_add);
        sum.min(self.pool_gpus(pool))
    }

    /// Whether replica `r` still serves or will (not retiring, not retired).
    pub(super) fn in_service(&self, r: usize) -> bool {
        let id = r as u64;
        !self.retiring.contains(&id) && !self.retired.contains(&id)
    }

    /// GPUs a pool's replicas in service (those no worker holds included) and its trainer take.
    fn gpus_wanted(&self, pool: u32) -> u32 {
        let replicas: u32 = (0..self.replicas.len())
            .filter(|&r| self.replicas[r].pool == pool && self.in_service(r))
            .map(|r| self.replicas[r].gpus)
            .sum();
        let trainer = &self.plan.placement.trainer;
        replicas
            + if trainer.pool == pool {
                trainer.gpus
            } else {
                0
            }
    }

    /// A worker of `pool` came or went. If the GPUs present are still those the running plan was
    /// made for (a spare covers a lost node, a node comes back), replicas no worker holds move to
    /// a worker of the pool as they are; otherwise the planner plans again.
    pub(super) fn pool_changed(&mut self, pool: u32, why: &str) {
        let present = self.gpus_present(pool);
        let changed = self.plan.pool_role(pool) == Some(PoolRole::Gpu)
            && self.replanner.is_some()
            && self.planned_gpus.get(&pool).is_some_and(|&p| p != present);
        if changed {
            self.replan(pool, present, why, 0);
        } else {
            self.adopt_orphans(pool);
        }
    }

    /// Plans again for `present` GPUs in `pool`: replicas on a node that is gone are retired,
    /// and the move to the new plan starts (superseding one under way). When no placement fits
    /// what is left, nothing is re-planned: as before, the lost node's replicas move as they are
    /// to the pool's other workers, or wait for a node if none is left.
    /// `leaving`: replicas already retiring because their worker is leaving (counted with those
    /// retired here, as replicas that went with their node).
    pub(super) fn replan(&mut self, pool: u32, present: u32, why: &str, leaving: u32) {
        let before = self.planned_gpus.get(&pool).copied().unwrap_or(0);
        if present >= self.gpus_wanted(pool) {
            self.adopt_orphans(pool);
        }
        let mut gpus = self.planned_gpus.clone();
        gpus.insert(pool, present);
        let running = self.running_replicas();
        let name = self.plan.pool_name(pool).to_owned();
        let Some(decided) = self.stoppable(|actor| {
            actor
                .replanner
                .as_ref()
                .and_then(|p| p.decide(&gpus, &running, 0.0))
        }) else {
            return;
        };
        let Some(decision) = decided else {
            log!(
                self,
                "scheduler: {why}; no placement fits the {present} GPUs of pool {name} left, so \
                 nothing is re-planned: its replicas move as they are to the pool's other \
                 workers, or wait for a node"
            );
            self.adopt_orphans(pool);
            return;
        };
        self.planned_gpus.insert(pool, present);
        // Replicas of the pool that no worker holds now were on the GPUs that are gone.
        let orphans: Vec<usize> = (0..self.replicas.len())
            .filter(|&r| {
                self.replicas[r].pool == pool && self.owner[r].is_none() && self.in_service(r)
            })
            .collect();
        for &r in &orphans {
            self.retiring.insert(r as u64);
            self.deferred.push_back(Input::RetireReplica {
                replica: ReplicaId(r as u64),
            });
        }
        let record = ReplanRecord::new(
            self.now().as_secs_f64(),
            why.to_owned(),
            name,
            (before, present),
            orphans.len() as u32 + leaving,
            &decision,
        );
        self.begin_move(record, decision.waves);
    }

    /// The replicas in service that a live worker holds.
    fn running_replicas(&self) -> Vec<ReplicaConfig> {
        (0..self.replicas.len())
            .filter(|&r| self.in_service(r) && self.owner[r].is_some())
            .map(|r| self.replicas[r].clone())
            .collect()
    }

    /// At a new policy version, with `--replan-on-drift`: if a share of peak the workers
    /// measured drifted past the margin from the one the running plan assumed, plans again with
    /// the measured profiles, which are from then on what the next check compares with. Not
    /// while a move is under way.
    pub(super) fn check_drift(&mut self) {
        let Some(margin) = self.opts.replan_on_drift else {
            return;
        };
        let version = self.core.version();
        let idle = self.started.is_some() && self.ended.is_none() && self.migration.is_none();
        if !idle || version <= self.drift_checked {
            return;
        }
        self.drift_checked = version;
        let Some(replanner) = &self.replanner else {
            return;
        };
        let drifts = replanner.drift(&self.profiles, margin);
        match self.settling.check(&drifts, &self.profiles, version) {
            Settle::Quiet | Settle::Waiting => return,
            Settle::Restart { forget, wait } => {
                // Estimates of the pool's other kinds of work may still describe the hardware
                // as it was (they are measured at different rates): forget them, and plan once
                // those that were trusted are measured again.
                for (pool, kinds) in &forget {
                    for &kind in kinds {
                        self.profiles.restart(kind, pool);
                    }
                }
                if wait {
                    let pools: Vec<&str> = forget.iter().map(|(p, _)| p.as_str()).collect();
                    log!(
                        self,
                        "scheduler: measured profiles drifted at version {version} ({}); \
                         re-planning once the other kinds of work on {} are measured afresh",
                        describe_drifts(&drifts),
                        pools.join(", ")
                    );
                    return;
                }
            }
            Settle::Ready => {}
        }
        // Measured again where samples were forgotten.
        let drifts = replanner.drift(&self.profiles, margin);
        let Some(first) = drifts.first() else {
            return;
        };
        let Some(remeasured) =
            replanner.remeasured(self.plan.spec(), self.plan.catalog(), &self.profiles)
        else {
            return;
        };
        let why = match self.settling.take_seen().filter(|&seen| seen < version) {
            Some(seen) => format!(
                "measured profiles drifted at version {version} (seen at version {seen}, \
                 measured afresh since): {}",
                describe_drifts(&drifts)
            ),
            None => format!(
                "measured profiles drifted at version {version}: {}",
                describe_drifts(&drifts)
            ),
        };
        let pool = first.pool.clone();
        let gpus = self
            .plan
            .pool_index(&pool)
            .and_then(|p| self.planned_gpus.get(&p).copied())
            .unwrap_or(0);
        let running = self.running_replicas();
        let Some(decision) = self.stoppable(|actor| {
            remeasured.decide(&actor.planned_gpus, &running, crate::replan::MIN_GAIN)
        }) else {
            return;
        };
        self.replanner = Some(remeasured);
        let Some(decision) = decision else {
            log!(
                self,
                "scheduler: {why}; no placement fits with the measured profiles"
            );
            return;
        };
        let record = ReplanRecord::new(
            self.now().as_secs_f64(),
            why,
            pool,
            (gpus, gpus),
            0,
            &decision,
        );
        self.begin_move(record, decision.waves);
    }

    /// Records a re-plan and starts moving to it in `waves` (superseding a move under way).
    fn begin_move(&mut self, record: ReplanRecord, waves: Vec<MigrationWave>) {
        let running = record.running_step_s.map_or_else(
            || "none as it runs (it no longer fits the GPUs or cannot decode)".to_owned(),
            |s| format!("{s:.1} s as it runs"),
        );
        log!(
            self,
            "scheduler: {}: pool {} has {} GPUs (the plan had {}); re-plan: replicas retired \
             with their node: {}; predicted step (modelled) {}, {:.1} s on the new plan; {}",
            record.reason,
            record.pool,
            record.gpus_after,
            record.gpus_before,
            record.replicas_lost,
            running,
            record.planned_step_s,
            match waves.len() {
                0 => "nothing moves".to_owned(),
                n => format!("moving in {n} waves"),
            }
        );
        self.metrics.replans.inc();
        self.replans.push(record);
        self.migration = Some(Migration {
            waves,
            next: 0,
            waiting: BTreeSet::new(),
            record: self.replans.len() - 1,
            resize_trainer: None,
        });
        self.start_wave();
    }

    /// Starts the next wave of the move under way (ending the move when there is none): its
    /// replicas are started, then its others retired; the wave lasts until each new one has
    /// loaded the weights and each retired one has drained.
    fn start_wave(&mut self) {
        loop {
            let Some(m) = self.migration.as_mut() else {
                return;
            };
            let record = m.record;
            let Some(wave) = m.waves.get(m.next).cloned() else {
                let moved = m.next > 0;
                self.migration = None;
                let now = self.now().as_secs_f64();
                if let Some(r) = self.replans.get_mut(record) {
                    r.done_at_s = Some(now);
                }
                if moved {
                    log!(self, "scheduler: the move to the new plan is done");
                }
                return;
            };
            m.next += 1;
            m.resize_trainer = wave.trainer_gpus;
            let mut waiting = BTreeSet::new();
            for config in wave.start {
                if let Some(r) = self.start_replica(config) {
                    waiting.insert(r);
                }
            }
            let started = waiting.len() as u32;
            let mut retired = 0;
            for group in &wave.stop {
                let mut left = group.replicas;
                for r in (0..self.replicas.len()).rev() {
                    if left == 0 {
                        break;
                    }
                    let rc = &self.replicas[r];
                    let fits =
                        rc.pool == group.pool && rc.role == group.role && rc.gpus == group.gpus;
                    let id = r as u64;
                    if !fits
                        || self.owner[r].is_none()
                        || !self.in_service(r)
                        || waiting.contains(&id)
                    {
                        continue;
                    }
                    self.retiring.insert(id);
                    waiting.insert(id);
                    left -= 1;
                    retired += 1;
                    self.deferred.push_back(Input::RetireReplica {
                        replica: ReplicaId(id),
                    });
                }
            }
            if let Some(r) = self.replans.get_mut(record) {
                r.replicas_started += started;
                r.replicas_retired += retired;
            }
            if let Some(m) = self.migration.as_mut()
                && !waiting.is_empty()
            {
                m.waiting = waiting;
                return;
            }
            // A wave with nothing to wait for is over at once.
            self.wave_over();
        }
    }

    /// The wave under way is over: counted, and the trainer takes its new size if the wave
    /// resizes it (training batches dispatched from now on carry it; one running finishes on
    /// the GPUs it started on). `replan::migration` shrinks the trainer in a wave whose end
    /// comes before the next wave starts replicas on the GPUs it frees, and grows it only once
    /// retirements left it room.
    fn wave_over(&mut self) {
        let Some(m) = self.migration.as_mut() else {
            return;
        };
        let record = m.record;
        let resize = m.resize_trainer.take();
        if let Some(r) = self.replans.get_mut(record) {
            r.waves_done += 1;
        }
        if let Some(gpus) = resize {
            let before = self.plan.placement.trainer.gpus;
            if gpus != before {
                Arc::make_mut(&mut self.plan).placement.trainer.gpus = gpus;
                if let Some(replanner) = self.replanner.as_mut() {
                    replanner.trainer_resized(gpus);
                }
                if let Some(r) = self.replans.get_mut(record) {
                    r.trainer_gpus = Some(gpus);
                }
                log!(
                    self,
                    "scheduler: the trainer now trains on {gpus} GPUs (was {before})"
                );
            }
        }
    }

    /// Replica `r` loaded its weights or was handed back: the wave it belongs to may be over.
    pub(super) fn migration_progress(&mut self, r: u64) {
        let Some(m) = self.migration.as_mut() else {
            return;
        };
        if !m.waiting.remove(&r) || !m.waiting.is_empty() {
            return;
        }
        self.wave_over();
        self.start_wave();
    }

    /// GPUs a worker's replicas use.
    pub(super) fn used_gpus(&self, w: &Worker) -> u32 {
        w.replicas
            .iter()
            .filter_map(|&r| self.replicas.get(r as usize))
            .map(|rc| rc.gpus)
            .sum()
    }

    /// GPUs of a worker that none of its replicas use.
    pub(super) fn free_gpus(&self, w: &Worker) -> u32 {
        self.worker_gpus(w).saturating_sub(self.used_gpus(w))
    }

    /// The attached worker of `pool` with the most GPUs free, at least `gpus` (the lowest id
    /// among equals, so the choice does not depend on map order).
    pub(super) fn roomiest_worker(&self, pool: u32, gpus: u32) -> Option<u64> {
        self.attached(pool)
            .map(|(id, w)| (self.free_gpus(w), id))
            .filter(|&(free, _)| free >= gpus)
            .max_by_key(|&(free, id)| (free, std::cmp::Reverse(id)))
            .map(|(_, id)| id)
    }

    /// Starts a replica of a new plan on the worker of its pool with the most free GPUs (at
    /// least the replica's): the worker hears of it before any work for it, the core books it.
    /// `None` when no worker has the room.
    fn start_replica(&mut self, config: ReplicaConfig) -> Option<u64> {
        let Some(worker) = self.roomiest_worker(config.pool, config.gpus) else {
            log!(
                self,
                "scheduler: no worker of pool {} has {} GPUs free: a replica of the new plan is not \
                 started",
                self.plan.pool_name(config.pool),
                config.gpus
            );
            return None;
        };
        let id = self.replicas.len() as u64;
        let (role, message) = start_message(id, &config);
        self.replicas.push(config.clone());
        self.owner.push(Some(worker));
        self.replica_running.push(0);
        if let Some(w) = self.workers.get_mut(&worker) {
            w.replicas.insert(id);
            // A closed stream is noticed by its reader, which reports the worker lost.
            if let Some(outbox) = &w.outbox {
                outbox.send(Ok(message));
            }
            log!(
                self,
                "scheduler: replica {id} ({role}, {} GPUs) starts on worker {}",
                config.gpus,
                w.name
            );
        }
        self.deferred.push_back(Input::ReplicaAdded { config });
        Some(id)
    }

    /// The core handed a retired replica back: its worker stops serving it.
    pub(super) fn replica_retired(&mut self, r: u64) {
        self.retiring.remove(&r);
        self.retired.insert(r);
        if let Some(owner) = self.owner.get_mut(r as usize).and_then(Option::take)
            && let Some(w) = self.workers.get_mut(&owner)
        {
            w.replicas.remove(&r);
            let message = SchedulerMessage {
                message: Some(scheduler_message::Message::StopReplica(r)),
            };
            if let Some(outbox) = &w.outbox {
                outbox.send(Ok(message));
            }
        }
        self.migration_progress(r);
    }

    /// Gives the orphaned replicas of `pool` (their worker was lost) to its attached workers,
    /// the least loaded first. A replica a re-plan started is not in the plan the workers know,
    /// so its new worker is told to start it, as its first worker was.
    fn adopt_orphans(&mut self, pool: u32) {
        for r in 0..self.owner.len() {
            let gone = self.retiring.contains(&(r as u64)) || self.retired.contains(&(r as u64));
            if self.owner[r].is_some() || self.replicas[r].pool != pool || gone {
                continue;
            }
            let Some(id) = self
                .attached(pool)
                .min_by_key(|(id, w)| (w.replicas.len(), *id))
                .map(|(id, _)| id)
            else {
                return;
            };
            self.owner[r] = Some(id);
            let started_by_a_replan = r >= self.plan.placement.replicas.len();
            let start = started_by_a_replan.then(|| start_message(r as u64, &self.replicas[r]).1);
            if let Some(w) = self.workers.get_mut(&id) {
                w.replicas.insert(r as u64);
                if let (Some(message), Some(outbox)) = (start, &w.outbox) {
                    outbox.send(Ok(message));
                }
            }
            log!(self, "scheduler: replica {r} moves to worker w{id}");
            self.replicas_moved += 1;
            self.update_retries.remove(&(r as u64));
            self.deferred.push_back(Input::ReplicaRecovered {
                replica: ReplicaId(r as u64),
            });
        }
    }
}

/// The message that has a worker start replica `id` of a re-plan (the worker knows only the
/// replicas of the first plan), and the replica's role by name.
fn start_message(id: u64, config: &ReplicaConfig) -> (&'static str, SchedulerMessage) {
    let role = match config.role {
        ServeRole::Prefill => "prefill",
        ServeRole::Decode => "decode",
        ServeRole::Generate => "generate",
    };
    let message = SchedulerMessage {
        message: Some(scheduler_message::Message::StartReplica(ReplicaStart {
            replica: id,
            gpus: config.gpus,
            kv_capacity_tokens: config.kv_capacity_tokens,
            max_seqs: config.max_seqs,
            role: role.into(),
        })),
    };
    (role, message)
}

/// The drifts as a line of the log: each kind and pool at its measured share against the plan's.
fn describe_drifts(drifts: &[Drift]) -> String {
    drifts
        .iter()
        .map(|d| {
            format!(
                "{} on {} at {:.0}% of peak (the plan assumed {:.0}%)",
                d.kind.name(),
                d.pool,
                d.now * 100.0,
                d.planned * 100.0
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}
