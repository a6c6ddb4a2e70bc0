//! The core's books: the state it keeps on trajectories, groups, replicas and stages, the
//! helpers that keep those books (queues, stage records, KV caches kept or held on replicas, the
//! router's load-ordered sets) and the check that they balance.

use std::collections::BTreeSet;

use crate::lru::{LruList, Slot};
use crate::placement::ServeRole;
use crate::protocol::{
    BatchId, Command, GroupId, ReplicaId, StageCommand, StageId, StageWork, TrajId, Version,
};
use crate::router::{ReplicaLookup, ReplicaView, load_key};
use crate::time::Time;

use super::Core;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    QueuedEnv,
    Env,
    QueuedGen,
    Prefill,
    QueuedDecode,
    Gen,
    QueuedReward,
    Reward,
    Complete,
    Consumed,
    /// Given up with its group (infrastructure failure); never trained on, never scored.
    Abandoned,
}

/// What one look at a queued trajectory in [`Core::scan`] achieved.
pub(super) enum Visit {
    /// It was dispatched, finished or re-queued.
    Progressed,
    /// It could not be placed now; keep looking past it.
    Missed,
    /// It waits on purpose (a first turn while the KV caches have no room for starts): keep
    /// looking past it without counting it against the scan's lookahead, or the later turns
    /// queued behind the first turns of older groups would never be looked at.
    Waits,
    /// Nothing behind it can be placed either; end the scan.
    Stop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Queue {
    Env,
    Gen,
    Decode,
    Reward,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kv {
    None,
    /// Kept on a decode/generate replica between turns (evictable), with its slot in the
    /// replica's [`Replica::retained`] list.
    Retained(ReplicaId, u64, Slot),
    /// Prefilled on a prefill replica, waiting to be pulled; with the prefill's version.
    Held(ReplicaId, u64, Version),
}

#[derive(Debug, Clone)]
pub(super) struct TurnRec {
    pub(super) version: Version,
    pub(super) context_before: u64,
    pub(super) input: u64,
}

#[derive(Debug, Clone)]
pub(super) struct Traj {
    pub(super) group: GroupId,
    pub(super) task: u32,
    pub(super) attempt: u32,
    pub(super) turns: Vec<TurnRec>,
    pub(super) context: u64,
    pub(super) input: u64,
    pub(super) pending_action: u64,
    pub(super) reset_done: bool,
    pub(super) phase: Phase,
    pub(super) env_pool: Option<u32>,
    pub(super) kv: Kv,
    pub(super) queued: Option<Queue>,
    /// Oldest version among `turns` (`Version::MAX` when there are none).
    pub(super) min_version: Version,
    /// Its stages' failures and timeouts since its last stage that finished.
    pub(super) failures_in_a_row: u32,
    /// When its current turn became ready to generate (after the reset or the last environment
    /// step); `None` after a rewind, whose next turn is not a whole turn's cycle.
    pub(super) turn_start: Option<Time>,
    /// What its current turn generated before an interrupt, to resume from. Those tokens are
    /// counted in `input` too (the resumed generation prefills them).
    pub(super) partial: Option<PartialTurn>,
    /// When it last finished (its reward in); read when the trainer takes its group.
    pub(super) finished: Option<Time>,
}

/// The part of a turn generated before its generation was interrupted.
#[derive(Debug, Clone, Copy)]
pub(super) struct PartialTurn {
    /// The oldest version that generated part of it.
    pub(super) oldest: Version,
    /// Tokens generated so far.
    pub(super) tokens: u64,
}

impl Traj {
    /// Whether its next turn is its first: nothing of its own is cached anywhere yet.
    pub(super) fn on_first_turn(&self) -> bool {
        self.turns.is_empty() && self.partial.is_none()
    }

    pub(super) fn oldest(&self) -> Option<Version> {
        (self.min_version != Version::MAX).then_some(self.min_version)
    }

    /// The first turn generated (in part, for the current turn's interrupted part, which is
    /// turn `turns.len()`) by a version older than `floor`.
    pub(super) fn first_older_than(&self, floor: Version) -> Option<usize> {
        if self.min_version >= floor {
            return None;
        }
        self.turns
            .iter()
            .position(|turn| turn.version < floor)
            .or_else(|| {
                self.partial
                    .filter(|p| p.oldest < floor)
                    .map(|_| self.turns.len())
            })
    }
}

#[derive(Debug, Clone)]
pub(super) struct Group {
    pub(super) members: Vec<TrajId>,
    pub(super) batch: u64,
    pub(super) complete: u32,
    pub(super) ready_key: Option<(Version, GroupId)>,
    /// Oldest turn version among its members (`Version::MAX` when none has a turn).
    pub(super) oldest: Version,
    /// When the first generation of its current attempt was booked (`None` before that, and
    /// again once it is restarted).
    pub(super) first_turn: Option<Time>,
    /// Oldest version its turns may come from, on top of the bound's floor: the version it was
    /// restarted on ([`Core::restart_late_groups`]; 0 otherwise).
    pub(super) restart_floor: Version,
    /// When it was admitted (took its slot in the window).
    pub(super) admitted: Time,
}

#[derive(Debug, Clone)]
pub(super) struct Replica {
    pub(super) role: ServeRole,
    pub(super) max_seqs: u32,
    pub(super) kv_capacity: u64,
    pub(super) healthy: bool,
    pub(super) version: Option<Version>,
    pub(super) draining: bool,
    pub(super) updating: bool,
    pub(super) in_flight: u32,
    pub(super) kv_reserved: u64,
    /// Idle KV caches kept between turns, least recently used first (ties by trajectory): the
    /// eviction order. Each trajectory's `Kv::Retained` holds its slot.
    pub(super) retained: LruList<(Time, TrajId), u64>,
    pub(super) retained_tokens: u64,
    pub(super) held: BTreeSet<TrajId>,
    pub(super) failures: u32,
    pub(super) key: Option<u64>,
    /// Changed since it was last filed in the router's sets (it is in `Core::dirty`).
    pub(super) dirty: bool,
    /// Told to retire: no new work; retired once nothing runs on it or waits for it.
    pub(super) retiring: bool,
    /// Out of service for good (retired); a later recovery report is ignored.
    pub(super) retired: bool,
}

impl Replica {
    /// The trajectories whose caches it keeps, by id (the order a map by trajectory walked
    /// them in, which the commands dropping them follow).
    pub(super) fn retained_by_id(&self) -> Vec<TrajId> {
        let mut ids: Vec<TrajId> = self.retained.iter().map(|((_, t), _)| t).collect();
        ids.sort_unstable();
        ids
    }

    pub(super) fn new(config: &crate::placement::ReplicaConfig) -> Replica {
        Replica {
            role: config.role,
            max_seqs: config.max_seqs.max(1),
            kv_capacity: config.kv_capacity_tokens,
            healthy: true,
            version: Some(0),
            draining: false,
            updating: false,
            in_flight: 0,
            kv_reserved: 0,
            retained: LruList::new(),
            retained_tokens: 0,
            held: BTreeSet::new(),
            failures: 0,
            key: None,
            dirty: false,
            retiring: false,
            retired: false,
        }
    }
}

/// The replica table as the router looks it up: a named type (not a closure), so the router's
/// walk over candidates is compiled for it and inlines each lookup.
pub(super) struct Replicas<'a> {
    pub(super) replicas: &'a [Replica],
    pub(super) latest: Version,
}

impl ReplicaLookup for Replicas<'_> {
    #[inline]
    fn view(&self, id: ReplicaId) -> Option<ReplicaView> {
        self.replicas
            .get(id.0 as usize)
            .map(|r| Core::view(r, self.latest))
    }
}

#[derive(Debug, Clone)]
pub(super) enum StageKind {
    EnvReset,
    EnvStep,
    Prefill,
    Gen { version: Version },
    Reward,
}

#[derive(Debug, Clone)]
pub(super) struct StageRec {
    pub(super) traj: TrajId,
    pub(super) kind: StageKind,
    pub(super) replica: Option<ReplicaId>,
    pub(super) kv_tokens: u64,
    pub(super) kv_from: Option<(ReplicaId, u64)>,
    pub(super) cpu: Option<(u32, u64)>,
    pub(super) serverless: Option<u32>,
    pub(super) deadline: Time,
    /// Whether [`Command::Interrupt`] was sent for it.
    pub(super) interrupted: bool,
}

/// A task's turns as measured: how many, and their durations' sum and sum of squares (ns).
#[derive(Debug, Clone, Default)]
pub(super) struct TurnBooks {
    pub(super) turns: u64,
    pub(super) sum: u128,
    pub(super) squares: u128,
}

impl TurnBooks {
    pub(super) fn add(&mut self, nanos: u64) {
        self.turns += 1;
        self.sum += nanos as u128;
        self.squares += nanos as u128 * nanos as u128;
    }

    /// A long chain of `turns` such turns (ns): one standard deviation above the mean of their
    /// sum, as for the slowest of a group's members (a group waits for it).
    pub(super) fn long_chain(&self, turns: u32) -> f64 {
        let n = self.turns.max(1) as f64;
        let mean = self.sum as f64 / n;
        let var = (self.squares as f64 / n - mean * mean).max(0.0);
        turns as f64 * mean + (turns as f64 * var).sqrt()
    }
}

#[derive(Debug, Clone)]
pub(super) struct TrainBatch {
    pub(super) id: BatchId,
    pub(super) publishes: bool,
}

impl Core {
    /// Checks the core's own books: no replica or pool holds more than its capacity, and every
    /// counter matches a recount. Meant for tests; returns the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (i, r) in self.replicas.iter().enumerate() {
            if r.kv_reserved > r.kv_capacity {
                return Err(format!(
                    "replica {i}: KV {} > {}",
                    r.kv_reserved, r.kv_capacity
                ));
            }
            if r.in_flight > r.max_seqs {
                return Err(format!(
                    "replica {i}: {} seqs > {}",
                    r.in_flight, r.max_seqs
                ));
            }
        }
        let mut cpu_used = vec![0u64; self.cpu_free.len()];
        let mut fn_used = vec![0u64; self.serverless_free.len()];
        let mut seqs = vec![0u32; self.replicas.len()];
        for (_, s) in self.stages.iter() {
            if let Some((p, m)) = s.cpu {
                cpu_used[p as usize] += m;
            }
            if let Some(p) = s.serverless {
                fn_used[p as usize] += 1;
            }
            if let Some(r) = s.replica {
                seqs[r.0 as usize] += 1;
            }
        }
        for (i, p) in self.cfg.cpu_pools.iter().enumerate() {
            if cpu_used[i] + self.cpu_free[i] != p.millicpus {
                return Err(format!("cpu pool {i}: books do not balance"));
            }
        }
        for (i, p) in self.cfg.serverless_pools.iter().enumerate() {
            if fn_used[i] + self.serverless_free[i] != p.concurrency {
                return Err(format!("serverless pool {i}: books do not balance"));
            }
        }
        for (i, r) in self.replicas.iter().enumerate() {
            if seqs[i] != r.in_flight {
                return Err(format!("replica {i}: in-flight count is off"));
            }
        }
        Ok(())
    }

    pub(super) fn view(r: &Replica, latest: Version) -> ReplicaView {
        ReplicaView {
            role: r.role,
            available: r.healthy
                && !r.draining
                && !r.retiring
                && !r.updating
                && r.version.is_some(),
            version: r.version,
            in_flight: r.in_flight,
            max_seqs: r.max_seqs,
            kv_reserved: r.kv_reserved,
            kv_capacity: r.kv_capacity,
            kv_evictable: r.retained_tokens,
            failures: r.failures,
            behind: r.version.map_or(0, |v| latest.saturating_sub(v)),
        }
    }

    /// Notes a change to a replica; it is re-filed in the router's load-ordered sets before the
    /// router next looks at them ([`Core::refile`]). A replica often changes several times
    /// between two routing decisions (a stage ends, its KV cache is kept, the next is booked),
    /// and re-filing it once gives the same sets as re-filing it every time.
    pub(super) fn touch(&mut self, id: ReplicaId) {
        let Some(r) = self.replicas.get_mut(id.0 as usize) else {
            return;
        };
        if !r.dirty {
            r.dirty = true;
            self.dirty.push(id);
        }
    }

    /// Re-files every replica changed since the last call in the router's sets.
    pub(super) fn refile(&mut self) {
        // Taken and put back, so the list keeps its allocation from one routing decision to the
        // next.
        let mut dirty = std::mem::take(&mut self.dirty);
        for &id in &dirty {
            let Some(r) = self.replicas.get_mut(id.0 as usize) else {
                continue;
            };
            r.dirty = false;
            let set = match r.role {
                ServeRole::Prefill => &mut self.prefill_set,
                _ => &mut self.decode_set,
            };
            let view = Self::view(r, self.version);
            let key = view.available.then(|| load_key(&view));
            if key == r.key {
                continue;
            }
            set.refile(r.key.map(|old| (old, id)), key.map(|new| (new, id)));
            r.key = key;
        }
        dirty.clear();
        self.dirty = dirty;
    }

    pub(super) fn enqueue(&mut self, t: TrajId, queue: Queue, phase: Phase) {
        self.dequeue(t);
        // Oldest group first, everywhere: a straggler of an old group overtakes fresh work, so
        // groups complete (and can be trained on) before their first turns fall out of the bound.
        // Ids follow groups, so the id order of the queue is that order.
        self.queues[queue as usize].insert(t.0);
        let traj = &mut self.trajs[t.0 as usize];
        traj.queued = Some(queue);
        traj.phase = phase;
    }

    pub(super) fn dequeue(&mut self, t: TrajId) {
        if let Some(q) = self.trajs[t.0 as usize].queued.take() {
            self.queues[q as usize].remove(t.0);
        }
    }

    pub(super) fn new_stage(&mut self, rec: StageRec, cmd: StageCommand) {
        if rec.replica.is_some() {
            self.gpu_stages += 1;
        }
        self.stages.insert(cmd.stage.0, rec);
        self.commands.push_back(Command::Run(cmd));
    }

    pub(super) fn stage_id(&mut self) -> StageId {
        let id = StageId(self.next_stage);
        self.next_stage += 1;
        id
    }

    pub(super) fn stage_command(
        &self,
        stage: StageId,
        t: TrajId,
        version: Version,
        work: StageWork,
    ) -> StageCommand {
        let traj = &self.trajs[t.0 as usize];
        StageCommand {
            stage,
            traj: t,
            group: traj.group,
            task: traj.task,
            turn: traj.turns.len() as u32,
            attempt: traj.attempt,
            version,
            work,
        }
    }

    /// Frees everything a stage holds (not the trajectory's retained/held KV).
    pub(super) fn release_stage(&mut self, rec: &StageRec) {
        if let Some(r) = rec.replica {
            self.gpu_stages = self.gpu_stages.saturating_sub(1);
            if let Some(rep) = self.replicas.get_mut(r.0 as usize) {
                rep.in_flight = rep.in_flight.saturating_sub(1);
                rep.kv_reserved = rep.kv_reserved.saturating_sub(rec.kv_tokens);
            }
            self.touch(r);
        }
        if let Some((p, tokens)) = rec.kv_from {
            if let Some(rep) = self.replicas.get_mut(p.0 as usize) {
                rep.kv_reserved = rep.kv_reserved.saturating_sub(tokens);
                rep.held.remove(&rec.traj);
            }
            self.touch(p);
        }
        if let Some((pool, m)) = rec.cpu {
            self.cpu_free[pool as usize] += m;
        }
        if let Some(pool) = rec.serverless {
            self.serverless_free[pool as usize] += 1;
        }
    }

    pub(super) fn take_stage(&mut self, stage: StageId) -> Option<StageRec> {
        let rec = self.stages.remove(stage.0)?;
        self.release_stage(&rec);
        Some(rec)
    }

    /// Drops a trajectory's retained or held KV cache (telling the replica).
    pub(super) fn drop_kv(&mut self, t: TrajId, tell: bool) {
        let kv = std::mem::replace(&mut self.trajs[t.0 as usize].kv, Kv::None);
        let (replica, tokens) = match kv {
            Kv::None => return,
            Kv::Retained(r, n, slot) => {
                if let Some(rep) = self.replicas.get_mut(r.0 as usize)
                    && rep
                        .retained
                        .get(slot)
                        .is_some_and(|((_, kept), _)| kept == t)
                {
                    rep.retained.remove(slot);
                    rep.retained_tokens = rep.retained_tokens.saturating_sub(n);
                }
                (r, n)
            }
            Kv::Held(r, n, _) => {
                if let Some(rep) = self.replicas.get_mut(r.0 as usize) {
                    rep.held.remove(&t);
                }
                (r, n)
            }
        };
        if let Some(rep) = self.replicas.get_mut(replica.0 as usize) {
            rep.kv_reserved = rep.kv_reserved.saturating_sub(tokens);
        }
        self.touch(replica);
        if tell {
            self.commands
                .push_back(Command::ReleaseKv { replica, traj: t });
        }
    }

    /// Evicts least-recently-used idle KV caches on `replica` until `needed` tokens are free.
    pub(super) fn evict(&mut self, replica: ReplicaId, needed: u64) {
        loop {
            let Some(r) = self.replicas.get(replica.0 as usize) else {
                return;
            };
            if r.kv_capacity.saturating_sub(r.kv_reserved) >= needed {
                return;
            }
            let Some((_, (_, victim), _)) = r.retained.first() else {
                return;
            };
            self.drop_kv(victim, true);
            self.stats.kv_evictions += 1;
        }
    }
}
