//! Dispatch: booking queued work on a resource (environment steps on CPU pools, generation
//! routed to serving replicas, prefill then decode, rewards, training batches) and taking the
//! results of finished stages back, which moves a trajectory to its next queue or completes it.

use crate::config::{Discipline, RewardRoute};
use crate::placement::ServeRole;
use crate::protocol::{
    BatchId, Command, GroupId, ReplicaId, StageId, StageOutcome, StageWork, TrajId, Version,
};
use crate::router::{Route, RouteRequest, RouterView};

use super::books::{
    Kv, PartialTurn, Phase, Queue, Replicas, StageKind, StageRec, TrainBatch, TurnRec, Visit,
};
use super::{Core, TaskLives};

/// How far past a blocked head the admission pass looks for work of another kind.
const LOOKAHEAD: usize = 16;

/// The share of a serving replica's KV capacity, in percent, past which no trajectory starts
/// on it ([`Core::dispatch_gen`]).
const START_KV_PERCENT: u64 = 75;

/// How many times its even share of the turns running and waiting a serving replica may hold
/// and still take a turn without its KV cache (`Core::cold_slot_limit`). Twice: three times let
/// part of the herd back on the Mixtral held-out job (mean step 28.3 s against 27.6 s over eight
/// seeds), and 1 to 1.5 times changed no example job's mean beyond its seed-to-seed noise.
const COLD_SLOT_SLACK: u64 = 2;

/// Where a prefilled turn decodes ([`Core::pick_decode`]).
enum DecodePick {
    /// On this replica, evicting retained caches first when the flag says so.
    Replica(ReplicaId, bool),
    /// Not yet: a decode replica is taking the prefill's weights.
    WaitForNewWeights,
    /// Nowhere: no decode replica has room.
    Full,
}

impl Core {
    /// The queued trajectory after `after` (the first one for `None`).
    pub(super) fn queue_next(&self, q: Queue, after: Option<TrajId>) -> Option<TrajId> {
        let set = &self.queues[q as usize];
        match after {
            None => set.first(),
            Some(t) => set.after(t.0),
        }
        .map(TrajId)
    }

    /// Runs `f` with a read-only view of the replicas for the router (selection has no side
    /// effects; the caller books what it picks).
    pub(super) fn with_router<R>(
        &mut self,
        f: impl FnOnce(&RouterView<'_, Replicas<'_>>) -> R,
    ) -> R {
        self.refile();
        f(&RouterView {
            lookup: &Replicas {
                replicas: &self.replicas,
                latest: self.version,
            },
            prefill: &self.prefill_set,
            decode: &self.decode_set,
        })
    }

    /// Offers the queued trajectories of `queue`, oldest group first, to `visit`, until the
    /// queue is exhausted, `visit` says to stop, or `LOOKAHEAD` of them in a row could not be
    /// placed (the rest would not fit either, and looking at them all would make a pass cost
    /// as much as the queue is long).
    pub(super) fn scan(&mut self, queue: Queue, mut visit: impl FnMut(&mut Self, TrajId) -> Visit) {
        let mut cursor = None;
        let mut misses = 0;
        while misses < LOOKAHEAD {
            let Some(t) = self.queue_next(queue, cursor) else {
                return;
            };
            cursor = Some(t);
            match visit(self, t) {
                Visit::Progressed => {}
                Visit::Missed => misses += 1,
                Visit::Waits => {}
                Visit::Stop => return,
            }
        }
    }

    pub(super) fn gpu_gate_closed(&self) -> bool {
        self.cfg.colocated && self.trainer.is_some()
    }

    pub(super) fn dispatch_env(&mut self) {
        self.scan(Queue::Env, |core, t| {
            let traj = &core.trajs[t.0 as usize];
            let need = core.cfg.tasks[traj.task as usize].env_millicpus;
            let pool = match traj.env_pool {
                Some(p) => Some(p),
                None => (0..core.cfg.cpu_pools.len())
                    .filter(|&i| core.cfg.cpu_pools[i].environments)
                    .max_by_key(|&i| (core.cpu_free[i], std::cmp::Reverse(i)))
                    .map(|i| i as u32),
            };
            let Some(pool) = pool else { return Visit::Stop };
            // An environment needing more than a whole pool is clamped to the pool.
            let need = need.min(core.cfg.cpu_pools[pool as usize].millicpus).max(1);
            if core.cpu_free[pool as usize] < need {
                return Visit::Missed;
            }
            core.cpu_free[pool as usize] -= need;
            let stage = core.stage_id();
            let traj = &mut core.trajs[t.0 as usize];
            traj.env_pool = Some(pool);
            let spec_pool = core.cfg.cpu_pools[pool as usize].pool;
            let (kind, work) = if traj.reset_done {
                (
                    StageKind::EnvStep,
                    StageWork::EnvStep {
                        pool: spec_pool,
                        millicpus: need,
                        action_tokens: traj.pending_action,
                    },
                )
            } else {
                (
                    StageKind::EnvReset,
                    StageWork::EnvReset {
                        pool: spec_pool,
                        millicpus: need,
                    },
                )
            };
            core.dequeue(t);
            core.trajs[t.0 as usize].phase = Phase::Env;
            let cmd = core.stage_command(stage, t, core.version, work);
            let rec = StageRec {
                traj: t,
                kind,
                replica: None,
                kv_tokens: 0,
                kv_from: None,
                cpu: Some((pool, need)),
                serverless: None,
                deadline: core.now.plus(core.cfg.stage_timeout),
                interrupted: false,
            };
            core.new_stage(rec, cmd);
            Visit::Progressed
        });
    }

    /// Routes the queued turns that generate (or prefill first). A first turn starts only where
    /// it leaves the serving replica's KV caches at most [`START_KV_PERCENT`] full: the rest is
    /// for the trajectories already there, whose contexts grow by an observation and an action
    /// a turn. Without that room a later turn no longer fits beside its own cache, goes
    /// elsewhere without it, evicts idle caches to fit, and every evicted trajectory prefills
    /// its whole context again: on a fleet whose decode KV held a fraction of the window the
    /// simulator measured 17 evictions a trajectory and a third of the job's fixed yardstick,
    /// against 4-5 and half of it with the room kept. A fleet whose KV holds its window never
    /// comes near the mark (no example job's run changed).
    pub(super) fn dispatch_gen(&mut self) {
        if self.gpu_gate_closed() {
            return;
        }
        let mut prefill_blocked = !self.disaggregated;
        let mut decode_blocked = false;
        let mut starts_blocked = false;
        let cold_slot_limit = self.cold_slot_limit();
        self.scan(Queue::Gen, |core, t| {
            if prefill_blocked && decode_blocked {
                return Visit::Stop;
            }
            if core.check_admission(t) {
                // Rewound (and re-queued, maybe elsewhere): look again in another pass.
                core.repump = true;
                return Visit::Progressed;
            }
            let traj = &core.trajs[t.0 as usize];
            let task = &core.cfg.tasks[traj.task as usize];
            if traj.context + traj.input >= task.context_limit {
                core.finish_rollout(t);
                return Visit::Progressed;
            }
            let first_turn = traj.on_first_turn();
            if first_turn && starts_blocked {
                return Visit::Waits;
            }
            if first_turn && !matches!(traj.kv, Kv::None) {
                // A group started again has no use for the cache of its last attempt.
                core.drop_kv(t, true);
            }
            let traj = &core.trajs[t.0 as usize];
            let task = &core.cfg.tasks[traj.task as usize];
            let resumed = traj.partial.map_or(0, |p| p.tokens);
            let max_new = task
                .max_action_tokens
                .saturating_sub(resumed)
                .min(task.context_limit - traj.context - traj.input)
                .max(1);
            let sticky = match traj.kv {
                Kv::Retained(r, _, _) => Some(r),
                _ => None,
            };
            let req = RouteRequest {
                context: traj.context,
                input: traj.input,
                max_new,
                sticky,
                floor: core.start_floor(t),
                pd_min_prefill_tokens: core.cfg.pd_min_prefill_tokens,
                sticky_sessions: core.cfg.policy.sticky_sessions,
                disaggregated: core.disaggregated,
                cold_slot_limit,
            };
            let wants_prefill =
                core.disaggregated && req.context + req.input >= req.pd_min_prefill_tokens;
            if (wants_prefill && prefill_blocked) || (!wants_prefill && decode_blocked) {
                // Still worth trying the sticky replica.
                if sticky.is_none() {
                    return Visit::Missed;
                }
            }
            let route = core.with_router(|router| router.route(&req, true));
            if first_turn
                && core.cfg.policy.start_leaves_kv_room
                && !core.has_room_to_start(route, &req)
            {
                starts_blocked = true;
                return Visit::Waits;
            }
            match route {
                Some(route) => {
                    core.book_gen(t, route, &req);
                    Visit::Progressed
                }
                None => {
                    if wants_prefill {
                        prefill_blocked = true;
                    } else {
                        decode_blocked = true;
                    }
                    // The next look would stop before doing anything: stop now, without looking
                    // the next trajectory up in the queue.
                    if prefill_blocked && decode_blocked {
                        Visit::Stop
                    } else {
                        Visit::Missed
                    }
                }
            }
        });
    }

    /// The most batch slots in use, in parts per million of its own, that a serving replica
    /// may have to take a turn without its KV cache there (a first turn, one whose cache went
    /// with old weights, or a turn prefilled on a prefill replica): twice the share every
    /// serving replica would have if the turns running and waiting (to generate or to decode)
    /// were spread over all of them by their slots, those loading new weights included.
    ///
    /// Without it the first replica back from a weight update is both the least loaded and the
    /// only one on the newest weights, and takes every turn waiting: at `maxStaleness: 1` a
    /// whole batch of first turns, whose prefills (or decodes) then queue behind one another
    /// while the replicas updated a moment later take none. Held back, those turns go to the
    /// next replicas as they come back (`docs/simulator.md` has what it changes).
    fn cold_slot_limit(&self) -> u64 {
        if !self.cfg.policy.spread_cold_turns {
            return u64::MAX;
        }
        let (mut slots, mut running) = (0u64, 0u64);
        for r in &self.replicas {
            let serving = matches!(r.role, ServeRole::Decode | ServeRole::Generate);
            if serving && r.healthy && !r.retired && !r.retiring {
                slots += u64::from(r.max_seqs);
                running += u64::from(r.in_flight);
            }
        }
        if slots == 0 {
            return u64::MAX;
        }
        let waiting = (self.queues[Queue::Gen as usize].len()
            + self.queues[Queue::Decode as usize].len()) as u64;
        ((running + waiting) * COLD_SLOT_SLACK * 1_000_000).div_ceil(slots)
    }

    pub(super) fn book_gen(&mut self, t: TrajId, route: Route, req: &RouteRequest) {
        let group = &mut self.groups[self.trajs[t.0 as usize].group.0 as usize];
        if group.first_turn.is_none() {
            group.first_turn = Some(self.now);
        }
        let stage = self.stage_id();
        let deadline = self.now.plus(self.cfg.stage_timeout);
        let (replica, kind, work, kv_tokens) = match route {
            Route::Sticky(r) => {
                // The retained cache becomes part of this stage's reservation.
                let (kept, slot) = match self.trajs[t.0 as usize].kv {
                    Kv::Retained(_, n, slot) => (n, Some(slot)),
                    _ => (0, None),
                };
                if let Some(rep) = self.replicas.get_mut(r.0 as usize)
                    && let Some(slot) = slot
                    && rep
                        .retained
                        .get(slot)
                        .is_some_and(|((_, kept), _)| kept == t)
                {
                    rep.retained.remove(slot);
                    rep.retained_tokens = rep.retained_tokens.saturating_sub(kept);
                    rep.kv_reserved = rep.kv_reserved.saturating_sub(kept);
                }
                self.trajs[t.0 as usize].kv = Kv::None;
                self.stats.sticky_hits += 1;
                let version = self.replicas[r.0 as usize].version.unwrap_or(0);
                (
                    r,
                    StageKind::Gen { version },
                    StageWork::Generate {
                        replica: r,
                        cached_tokens: req.context,
                        prefill_tokens: req.input,
                        max_new_tokens: req.max_new,
                        kv_from: None,
                        kv_tokens: 0,
                    },
                    req.context + req.input + req.max_new,
                )
            }
            Route::Prefill(p) => {
                self.drop_kv(t, true);
                self.stats.disaggregated_prefills += 1;
                let tokens = req.context + req.input;
                (
                    p,
                    StageKind::Prefill,
                    StageWork::Prefill { replica: p, tokens },
                    tokens,
                )
            }
            Route::Generate(r, evict) => {
                self.drop_kv(t, true);
                let full = req.context + req.input + req.max_new;
                if evict {
                    self.evict(r, full);
                }
                let version = self.replicas[r.0 as usize].version.unwrap_or(0);
                (
                    r,
                    StageKind::Gen { version },
                    StageWork::Generate {
                        replica: r,
                        cached_tokens: 0,
                        prefill_tokens: req.context + req.input,
                        max_new_tokens: req.max_new,
                        kv_from: None,
                        kv_tokens: 0,
                    },
                    full,
                )
            }
        };
        let version = match kind {
            StageKind::Gen { version } => version,
            _ => self.replicas[replica.0 as usize].version.unwrap_or(0),
        };
        if let Some(rep) = self.replicas.get_mut(replica.0 as usize) {
            rep.in_flight += 1;
            rep.kv_reserved += kv_tokens;
        }
        self.touch(replica);
        self.dequeue(t);
        self.trajs[t.0 as usize].phase = match kind {
            StageKind::Prefill => Phase::Prefill,
            _ => Phase::Gen,
        };
        let cmd = self.stage_command(stage, t, version, work);
        let rec = StageRec {
            traj: t,
            kind,
            replica: Some(replica),
            kv_tokens,
            kv_from: None,
            cpu: None,
            serverless: None,
            deadline,
            interrupted: false,
        };
        self.new_stage(rec, cmd);
    }

    pub(super) fn dispatch_decode(&mut self) {
        if self.gpu_gate_closed() {
            return;
        }
        let cold_slot_limit = self.cold_slot_limit();
        self.scan(Queue::Decode, |core, t| {
            if core.check_admission(t) {
                // Rewound (and re-queued, maybe elsewhere): look again in another pass.
                core.repump = true;
                return Visit::Progressed;
            }
            let traj = &core.trajs[t.0 as usize];
            let Kv::Held(p, held_tokens, p_version) = traj.kv else {
                // Not held any more (lost replica): start the turn over.
                core.enqueue(t, Queue::Gen, Phase::QueuedGen);
                core.repump = true;
                return Visit::Progressed;
            };
            let task = &core.cfg.tasks[traj.task as usize];
            let context = traj.context + traj.input;
            let max_new = task
                .max_action_tokens
                .min(task.context_limit.saturating_sub(context))
                .max(1);
            let need = context + max_new;
            let (d, evict) = match core.pick_decode(t, need, p_version, cold_slot_limit) {
                DecodePick::Replica(d, evict) => (d, evict),
                DecodePick::WaitForNewWeights => return Visit::Missed,
                DecodePick::Full => return Visit::Stop,
            };
            if evict {
                core.evict(d, need);
            }
            let d_version = core.replicas[d.0 as usize].version.unwrap_or(0);
            let version = d_version.min(p_version);
            let stage = core.stage_id();
            if let Some(rep) = core.replicas.get_mut(d.0 as usize) {
                rep.in_flight += 1;
                rep.kv_reserved += need;
            }
            core.touch(d);
            core.dequeue(t);
            // The held cache is released when the pull is done (the stage ends).
            core.trajs[t.0 as usize].kv = Kv::None;
            core.trajs[t.0 as usize].phase = Phase::Gen;
            let cmd = core.stage_command(
                stage,
                t,
                version,
                StageWork::Generate {
                    replica: d,
                    cached_tokens: context,
                    prefill_tokens: 0,
                    max_new_tokens: max_new,
                    kv_from: Some(p),
                    kv_tokens: held_tokens,
                },
            );
            let rec = StageRec {
                traj: t,
                kind: StageKind::Gen { version },
                replica: Some(d),
                kv_tokens: need,
                kv_from: Some((p, held_tokens)),
                cpu: None,
                serverless: None,
                deadline: core.now.plus(core.cfg.stage_timeout),
                interrupted: false,
            };
            core.new_stage(rec, cmd);
            Visit::Progressed
        });
    }

    /// Whether a first turn routed to `route` leaves the serving replica it decodes on at most
    /// [`START_KV_PERCENT`] full ([`Core::dispatch_gen`]); a turn prefilled elsewhere first
    /// asks it of the decode replica the router would pick for it now.
    fn has_room_to_start(&mut self, route: Option<Route>, req: &RouteRequest) -> bool {
        let full = req.context + req.input + req.max_new;
        let replica = match route {
            Some(Route::Generate(r, _) | Route::Sticky(r)) => Some(r),
            // Any version will do: only its room is asked. Where none has room the decode waits
            // for one as it always does.
            Some(Route::Prefill(_)) => self
                .with_router(|router| router.least_loaded(router.decode, full, 0, false))
                .map(|(r, _)| r),
            None => None,
        };
        replica
            .and_then(|r| self.replicas.get(r.0 as usize))
            .is_none_or(|r| {
                (r.kv_reserved + full).saturating_mul(100)
                    <= START_KV_PERCENT.saturating_mul(r.kv_capacity)
            })
    }

    /// The decode replica for `t`'s prefilled turn (`need` tokens of KV, prefilled on weights
    /// `p_version`).
    ///
    /// The hard bound is the floor, not [`Core::start_floor`]: this context is already
    /// prefilled and its KV cache pins a prefill replica, which a rolling update may be
    /// draining; holding the decode back for newer weights could then wait on that very update.
    /// But a turn's version is the older of its prefill's and its decode's, and a turn that
    /// would become its group's oldest sets when the whole group expires: decoded on the
    /// weights before the prefill's, a group started just after a publication (the commonest
    /// moment: the trainer takes a batch and frees the window then) loses a whole step of its
    /// budget, which at `maxStaleness: 1` is half of it. So such a turn goes to a decode
    /// replica already on the prefill's weights when one has room, and waits for one when the
    /// prefill's weights are the latest and a decode replica is taking them now: the prefill
    /// replica then has no update to drain for, so the wait cannot close on itself. Only when
    /// no decode replica will have them does it take an older one. Held-out math and code job
    /// (disaggregated, `maxStaleness: 1`), seeds 0-2: 51.9 / 54.9 / 50.6 s per step against
    /// 56.3 / 58.7 / 54.9 s, with 15 groups regenerated at consumption at seed 0 against 31;
    /// the RollArt-like job within 1% (staleness 2) and 197.7 against 196.4 s on average at
    /// staleness 1, when the rule was chosen. Such a turn also skips a decode replica past the
    /// cold-turn limit ([`Core::cold_slot_limit`]) while others are taking the new weights.
    fn pick_decode(
        &mut self,
        t: TrajId,
        need: u64,
        p_version: Version,
        cold_slot_limit: u64,
    ) -> DecodePick {
        let floor = self.floor();
        let group_oldest = self.groups[self.trajs[t.0 as usize].group.0 as usize].oldest;
        let wanted = p_version.min(group_oldest);
        if wanted > floor {
            let pick = self.with_router(|router| {
                router.least_loaded_within(router.decode, need, wanted, true, cold_slot_limit)
            });
            if let Some((d, evict)) = pick {
                return DecodePick::Replica(d, evict);
            }
            let taking_new_weights = self.replicas.iter().enumerate().any(|(i, r)| {
                r.healthy
                    && !r.retiring
                    && r.role == ServeRole::Decode
                    && (r.updating || self.pending_update.contains(&ReplicaId(i as u64)))
            });
            if p_version == self.version && taking_new_weights {
                return DecodePick::WaitForNewWeights;
            }
        }
        match self.with_router(|router| router.least_loaded(router.decode, need, floor, true)) {
            Some((d, evict)) => DecodePick::Replica(d, evict),
            None => DecodePick::Full,
        }
    }

    pub(super) fn dispatch_reward(&mut self) {
        self.scan(Queue::Reward, |core, t| {
            let task = &core.cfg.tasks[core.trajs[t.0 as usize].task as usize];
            let (work, cpu, serverless) = match task.reward {
                RewardRoute::Environment => {
                    core.complete(t);
                    return Visit::Progressed;
                }
                RewardRoute::Serverless(s) => {
                    if core.serverless_free[s as usize] == 0 {
                        return Visit::Missed;
                    }
                    core.serverless_free[s as usize] -= 1;
                    let pool = core.cfg.serverless_pools[s as usize].pool;
                    (
                        StageWork::Reward {
                            pool,
                            serverless: true,
                            millicpus: 0,
                        },
                        None,
                        Some(s),
                    )
                }
                RewardRoute::Local(c) => {
                    let need = 1000u64.min(core.cfg.cpu_pools[c as usize].millicpus).max(1);
                    if core.cpu_free[c as usize] < need {
                        return Visit::Missed;
                    }
                    core.cpu_free[c as usize] -= need;
                    let pool = core.cfg.cpu_pools[c as usize].pool;
                    (
                        StageWork::Reward {
                            pool,
                            serverless: false,
                            millicpus: need,
                        },
                        Some((c, need)),
                        None,
                    )
                }
            };
            let stage = core.stage_id();
            core.dequeue(t);
            core.trajs[t.0 as usize].phase = Phase::Reward;
            let cmd = core.stage_command(stage, t, core.version, work);
            let rec = StageRec {
                traj: t,
                kind: StageKind::Reward,
                replica: None,
                kv_tokens: 0,
                kv_from: None,
                cpu,
                serverless,
                deadline: core.now.plus(core.cfg.stage_timeout),
                interrupted: false,
            };
            core.new_stage(rec, cmd);
            Visit::Progressed
        });
    }

    pub(super) fn dispatch_train(&mut self) {
        if self.trainer.is_some() || self.finished() || (self.updating > 0 && self.cfg.colocated) {
            return;
        }
        if self.cfg.colocated && self.gpu_stages > 0 {
            return;
        }
        let n = self.cfg.group_size as u64;
        let per_batch = (self.cfg.train_batch_size as u64 / n).max(1) as usize;
        let groups_per_step = (self.cfg.rollout_batch_size as u64 / n).max(1);
        let floor = self.floor();
        let any_stale = self.ready.first().is_some_and(|(v, _)| *v < floor);
        if !any_stale && self.ready.len() < per_batch {
            return;
        }
        // Consumption check: groups with a turn older than the bound are regenerated.
        let stale: Vec<(Version, GroupId)> = self
            .ready
            .iter()
            .take_while(|(v, _)| *v < floor)
            .copied()
            .collect();
        // Rewound only to the bound's floor, a group keeps turns of the floor's version, the
        // oldest the current step may train: it has what is left of that step to finish in
        // again, which a multi-turn group rarely does, so it is rewound again a step later, and
        // again (a coding group of the held-out math and code job went round eight times).
        // Restarted on the current weights, it has the whole bound. Eight seeds, mean step:
        // RollArt-like -2.6%, held-out MoE -2.7%, math and code -1.2%, web agent -0.9%,
        // Mixtral unchanged, when the rule was chosen.
        let restart = self.cfg.policy.restart_expired_groups
            && self.cfg.policy.discipline == Discipline::Continuous;
        let keep_from = if restart { self.version } else { floor };
        self.stats.groups_expired_waiting += stale.len() as u64;
        for (_, g) in stale {
            if restart {
                let group = &mut self.groups[g.0 as usize];
                group.restart_floor = group.restart_floor.max(self.version);
                group.first_turn = None;
            }
            let members = self.groups[g.0 as usize].members.clone();
            for t in members {
                let first_bad = self.trajs[t.0 as usize]
                    .turns
                    .iter()
                    .position(|turn| turn.version < keep_from);
                if let Some(k) = first_bad {
                    self.regenerate(t, k);
                    self.stats.regenerated_at_consumption += 1;
                    self.repump = true;
                }
            }
        }
        let per_step = (self.cfg.rollout_batch_size / self.cfg.train_batch_size).max(1);
        if self.cfg.policy.expiry_aware_publish
            && self.cfg.policy.discipline == Discipline::Continuous
            && self.minibatches_in_step + 1 >= per_step
            && self.ready.len() >= per_batch
            && self.hold_publish()
        {
            return;
        }
        let chosen: Vec<GroupId> = match self.cfg.policy.discipline {
            Discipline::Continuous => self.training_order(per_batch),
            Discipline::Batched { .. } => {
                let step = self.version;
                let complete = self.batch_complete.get(&step).copied().unwrap_or(0) as u64;
                let consumed = self.minibatches_in_step as u64 * per_batch as u64;
                if complete + consumed < groups_per_step {
                    return;
                }
                self.ready
                    .iter()
                    .filter(|(_, g)| self.groups[g.0 as usize].batch == step)
                    .take(per_batch)
                    .map(|&(_, g)| g)
                    .collect()
            }
        };
        if chosen.len() < per_batch {
            return;
        }
        let mut trajectories = Vec::new();
        let mut tokens = 0;
        let mut causal_pairs: u64 = 0;
        for g in &chosen {
            self.record_life(*g);
            let group = &mut self.groups[g.0 as usize];
            if let Some(key) = group.ready_key.take() {
                self.ready.remove(&key);
                if let Some(c) = self.batch_complete.get_mut(&group.batch) {
                    *c = c.saturating_sub(1);
                }
            }
            for &t in &group.members {
                let traj = &mut self.trajs[t.0 as usize];
                traj.phase = Phase::Consumed;
                tokens += traj.context;
                causal_pairs =
                    causal_pairs.saturating_add(traj.context.saturating_mul(traj.context + 1) / 2);
                let staleness =
                    traj.oldest().map_or(0, |v| self.version.saturating_sub(v)) as usize;
                // Nothing reads a consumed trajectory's turns again: freed now, their memory
                // goes to the turns of trajectories started later instead of the heap growing
                // (and page-faulting) through the whole run.
                traj.turns = Vec::new();
                if self.stats.staleness_histogram.len() <= staleness {
                    self.stats.staleness_histogram.resize(staleness + 1, 0);
                }
                self.stats.staleness_histogram[staleness] += 1;
                self.stats.trajectories_consumed += 1;
                trajectories.push(t);
            }
        }
        self.minibatches_in_step += 1;
        let publishes = self.minibatches_in_step >= per_step;
        if publishes {
            self.hold_until = None;
            self.hold_checked = u64::MAX;
        }
        let id = BatchId(self.next_batch);
        self.next_batch += 1;
        self.trainer = Some(TrainBatch { id, publishes });
        // Consumption opens the admission budget (an earlier step of the pass).
        self.repump = true;
        self.stats.train_batches += 1;
        self.commands.push_back(Command::Train {
            batch: id,
            step: self.version,
            publishes,
            trajectories,
            tokens,
            causal_pairs,
        });
    }

    /// The finished groups the trainer takes next under the continuous discipline, at most
    /// `per_batch`: oldest version first, in admission order; or, with
    /// `Policy::cheapest_training_first`, those the next publication would put past the
    /// staleness bound first (oldest first, in admission order), then the cheapest to train
    /// (fewest tokens; ties by version, then admission).
    ///
    /// Why cheapest first: a take frees its groups' window places, and the trainer takes
    /// nothing else until it is done, so short trainings first free more places sooner
    /// (shortest-processing-time order minimises the mean wait). Taken oldest first, the long
    /// groups, which are the old ones, fill the same batches: on the held-out MoE job a run of
    /// them kept the trainer busy for a whole step while 60 finished groups waited
    /// (`docs/simulator.md` has what it changes).
    pub(super) fn training_order(&self, per_batch: usize) -> Vec<GroupId> {
        if !self.cfg.policy.cheapest_training_first {
            return self.ready.iter().take(per_batch).map(|&(_, g)| g).collect();
        }
        let next_floor = (self.version + 1).saturating_sub(self.cfg.policy.max_staleness);
        let mut chosen: Vec<GroupId> = Vec::with_capacity(per_batch);
        let mut rest: Vec<(u64, Version, GroupId)> = Vec::new();
        for &(version, g) in &self.ready {
            if version < next_floor {
                if chosen.len() < per_batch {
                    chosen.push(g);
                }
            } else {
                let tokens = self.groups[g.0 as usize]
                    .members
                    .iter()
                    .map(|m| self.trajs[m.0 as usize].context)
                    .fold(0u64, u64::saturating_add);
                rest.push((tokens, version, g));
            }
        }
        let room = per_batch.saturating_sub(chosen.len());
        if room > 0 && !rest.is_empty() {
            let cut = room.min(rest.len());
            rest.select_nth_unstable(cut - 1);
            rest.truncate(cut);
            rest.sort_unstable();
            chosen.extend(rest.into_iter().map(|(_, _, g)| g));
        }
        chosen
    }

    /// Adds the life of a group the trainer takes now to its task's [`TaskLives`].
    fn record_life(&mut self, g: GroupId) {
        let group = &self.groups[g.0 as usize];
        let Some(&first) = group.members.first() else {
            return;
        };
        let task = self.trajs[first.0 as usize].task as usize;
        let finishes = || {
            group
                .members
                .iter()
                .filter_map(|m| self.trajs[m.0 as usize].finished)
        };
        let last = finishes().max().unwrap_or(self.now);
        let (mut member_s, mut members) = (0.0, 0);
        if let Some(start) = group.first_turn {
            for finish in finishes() {
                member_s += finish.since(start).as_secs_f64();
                members += 1;
            }
        }
        let group_s = group
            .first_turn
            .map(|start| last.since(start).as_secs_f64());
        let slot_s = self.now.since(group.admitted).as_secs_f64();
        let lives = &mut self.stats.task_lives;
        if lives.len() <= task {
            lives.resize(task + 1, TaskLives::default());
        }
        let life = &mut lives[task];
        life.groups += 1;
        life.slot_s += slot_s;
        life.trainer_wait_s += self.now.since(last).as_secs_f64();
        life.group_s += group_s.unwrap_or(0.0);
        life.member_s += member_s;
        life.members += members;
    }

    pub(super) fn stage_finished(&mut self, stage: StageId, outcome: StageOutcome) {
        let Some(rec) = self.stages.get(stage.0) else {
            self.stats.ignored_reports += 1;
            return;
        };
        let matches = matches!(
            (&rec.kind, &outcome),
            (
                StageKind::EnvReset | StageKind::EnvStep,
                StageOutcome::Observed { .. }
            ) | (StageKind::Prefill, StageOutcome::Prefilled)
                | (StageKind::Gen { .. }, StageOutcome::Generated { .. })
                | (StageKind::Gen { .. }, StageOutcome::Interrupted { .. })
                | (StageKind::Reward, StageOutcome::Rewarded { .. })
        );
        if !matches {
            // A report that does not fit the stage is treated as a failure of the stage.
            self.stats.ignored_reports += 1;
            self.fail_stage(stage, true);
            return;
        }
        let Some(rec) = self.take_stage(stage) else {
            return;
        };
        let t = rec.traj;
        let ti = t.0 as usize;
        // A prefill is not progress of its own: a generation that fails after every prefill
        // must still run into the failure limit, not loop.
        if !matches!(
            outcome,
            StageOutcome::Prefilled | StageOutcome::Interrupted { tokens: 0 }
        ) {
            self.trajs[ti].failures_in_a_row = 0;
        }
        let task = self.cfg.tasks[self.trajs[ti].task as usize].clone();
        match (rec.kind, outcome) {
            // Reported lengths are clamped to the context limit, so no sum can overflow.
            (StageKind::EnvReset, StageOutcome::Observed { tokens, .. }) => {
                let tokens = tokens.min(task.context_limit);
                let traj = &mut self.trajs[ti];
                traj.reset_done = true;
                traj.context = 0;
                traj.input = tokens.max(1);
                traj.turn_start = Some(self.now);
                self.enqueue(t, Queue::Gen, Phase::QueuedGen);
            }
            (StageKind::EnvStep, StageOutcome::Observed { tokens, done }) => {
                let tokens = tokens.min(task.context_limit);
                let traj = &mut self.trajs[ti];
                let turns = traj.turns.len() as u32;
                let over = traj.context + tokens >= task.context_limit;
                if done || turns >= task.max_turns || over {
                    self.finish_rollout(t);
                } else {
                    traj.input = tokens;
                    if let Some(start) = traj.turn_start.replace(self.now) {
                        self.turn_time[traj.task as usize].add(self.now.since(start).0);
                    }
                    self.enqueue(t, Queue::Gen, Phase::QueuedGen);
                }
            }
            (StageKind::Prefill, StageOutcome::Prefilled) => {
                let replica = rec.replica.unwrap_or(ReplicaId(0));
                let version = self.replicas[replica.0 as usize].version.unwrap_or(0);
                // The stage's reservation becomes the held cache.
                if let Some(rep) = self.replicas.get_mut(replica.0 as usize) {
                    rep.kv_reserved += rec.kv_tokens;
                    rep.held.insert(t);
                }
                self.touch(replica);
                self.trajs[ti].kv = Kv::Held(replica, rec.kv_tokens, version);
                if version < self.floor() {
                    // Weights published while it ran put it out of the bound: held, it would
                    // pin a replica that a rolling update may be draining (see
                    // `release_expired_held_kv`).
                    self.drop_kv(t, true);
                    self.enqueue(t, Queue::Gen, Phase::QueuedGen);
                } else {
                    self.enqueue(t, Queue::Decode, Phase::QueuedDecode);
                }
            }
            (StageKind::Gen { version }, StageOutcome::Interrupted { tokens })
                if self.trajs[ti]
                    .partial
                    .map_or(0, |p| p.tokens)
                    .saturating_add(tokens)
                    < task.max_action_tokens =>
            {
                self.stats.interrupted_generations += 1;
                let traj = &mut self.trajs[ti];
                if tokens > 0 {
                    let partial = traj.partial.get_or_insert(PartialTurn {
                        oldest: version,
                        tokens: 0,
                    });
                    partial.oldest = partial.oldest.min(version);
                    partial.tokens += tokens;
                    traj.input += tokens;
                    traj.min_version = traj.min_version.min(version);
                    let g = traj.group.0 as usize;
                    self.groups[g].oldest = self.groups[g].oldest.min(version);
                }
                // The replica is loading new weights: nothing of this turn stays cached there.
                if let Some(replica) = rec.replica {
                    self.commands
                        .push_back(Command::ReleaseKv { replica, traj: t });
                }
                self.enqueue(t, Queue::Gen, Phase::QueuedGen);
            }
            (
                StageKind::Gen { version },
                StageOutcome::Generated { tokens } | StageOutcome::Interrupted { tokens },
            ) => {
                let replica = rec.replica.unwrap_or(ReplicaId(0));
                let traj = &mut self.trajs[ti];
                let before = traj.context;
                // A resumed turn: its first part counts in its tokens and its version, not in
                // its input.
                let (version, input, tokens) = match traj.partial.take() {
                    Some(p) => (
                        version.min(p.oldest),
                        traj.input.saturating_sub(p.tokens),
                        p.tokens.saturating_add(tokens),
                    ),
                    None => (version, traj.input, tokens),
                };
                let tokens = tokens.min(task.max_action_tokens);
                if traj.turns.capacity() == 0 {
                    // A trajectory never has more turns than its task allows: room for them all
                    // at once (up to a sane cap), instead of the vector moving as it doubles.
                    traj.turns
                        .reserve_exact((task.max_turns as usize).clamp(1, 64));
                }
                traj.turns.push(TurnRec {
                    version,
                    context_before: before,
                    input,
                });
                traj.min_version = traj.min_version.min(version);
                let g = traj.group.0 as usize;
                self.groups[g].oldest = self.groups[g].oldest.min(version);
                traj.context = before + input + tokens;
                traj.input = 0;
                traj.pending_action = tokens;
                let keep = traj.context;
                if self.cfg.policy.sticky_sessions
                    && let Some(rep) = self.replicas.get_mut(replica.0 as usize)
                    && rep.healthy
                    && !rep.updating
                    && !rep.draining
                    && !rep.retiring
                    && rep.kv_reserved + keep <= rep.kv_capacity
                {
                    rep.kv_reserved += keep;
                    let slot = rep.retained.insert((self.now, t), keep);
                    rep.retained_tokens += keep;
                    self.trajs[ti].kv = Kv::Retained(replica, keep, slot);
                    self.touch(replica);
                } else {
                    self.commands
                        .push_back(Command::ReleaseKv { replica, traj: t });
                }
                self.enqueue(t, Queue::Env, Phase::QueuedEnv);
            }
            (StageKind::Reward, StageOutcome::Rewarded { .. }) => self.complete(t),
            _ => {}
        }
    }

    pub(super) fn finish_rollout(&mut self, t: TrajId) {
        self.drop_kv(t, true);
        let task = &self.cfg.tasks[self.trajs[t.0 as usize].task as usize];
        if task.reward == RewardRoute::Environment {
            self.complete(t);
        } else {
            self.enqueue(t, Queue::Reward, Phase::QueuedReward);
        }
    }

    pub(super) fn complete(&mut self, t: TrajId) {
        // A member of a restarted group that finished on the old weights starts over too.
        let restart_floor = self.groups[self.trajs[t.0 as usize].group.0 as usize].restart_floor;
        if self.trajs[t.0 as usize].min_version < restart_floor
            && let Some(k) = self.trajs[t.0 as usize]
                .turns
                .iter()
                .position(|turn| turn.version < restart_floor)
        {
            self.regenerate(t, k);
            self.repump = true;
            return;
        }
        self.dequeue(t);
        self.trajs[t.0 as usize].phase = Phase::Complete;
        self.trajs[t.0 as usize].finished = Some(self.now);
        self.active = self.active.saturating_sub(1);
        self.stats.trajectories_completed += 1;
        // A finished batch can open the next one (an earlier step of the pass).
        self.repump = true;
        let g = self.trajs[t.0 as usize].group;
        let group = &mut self.groups[g.0 as usize];
        group.complete += 1;
        if group.complete as usize == group.members.len() {
            let batch = group.batch;
            let oldest = group
                .members
                .iter()
                .filter_map(|m| self.trajs[m.0 as usize].oldest())
                .min()
                .unwrap_or(0);
            let key = (oldest, g);
            self.open_groups.remove(&g);
            self.groups_closed += 1;
            self.groups[g.0 as usize].ready_key = Some(key);
            self.ready.insert(key);
            *self.batch_complete.entry(batch).or_default() += 1;
            *self.batch_done.entry(batch).or_default() += 1;
        }
    }
}
