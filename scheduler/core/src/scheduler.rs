//! The scheduler state machine: trajectories, replicas, pools, the trainer and weight sync.
//!
//! [`Core`] follows quinn-proto's shape: [`Core::handle_input`] and [`Core::handle_timeout`] feed
//! it facts, [`Core::poll_command`] drains the commands they caused, and [`Core::poll_timeout`]
//! says when it next wants [`Core::handle_timeout`]. After every input the core runs one admission
//! pass (`pump`), the single place where work is booked on a resource:
//!
//! 1. rolling weight sync (drain a replica, then update it) or the global sync of the batched
//!    baselines;
//! 2. new groups, as the discipline allows;
//! 3. environment resets and steps, on CPU pools with free vCPUs;
//! 4. generation: routed by [`crate::router`], after the staleness check at admission;
//! 5. decode of prefilled contexts (the second half of prefill/decode disaggregation);
//! 6. rewards, within serverless concurrency or local vCPUs;
//! 7. training, on whole groups, after the staleness check at consumption.
//!
//! A trajectory's life: `EnvReset` (prompt) → for each turn: generation (sticky `Generate`, or
//! `Prefill` then `Generate` with a KV pull, or local `Generate`) → `EnvStep` → ... → `Reward` →
//! complete → trained once, with its whole group. Each generated turn is stamped with the version
//! that produced it; a trajectory whose oldest turn falls out of the bound is regenerated from
//! that turn, at admission or at consumption, and never trained on.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::config::{Config, Discipline, RewardRoute};
use crate::idset::IdSet;
use crate::lru::{LruList, Slot};
use crate::placement::ServeRole;
use crate::protocol::{
    BatchId, Command, GroupId, Input, ReplicaId, StageCommand, StageId, StageOutcome, StageWork,
    SyncMode, TrajId, Version,
};
use crate::rng::SplitMix64;
use crate::router::{
    LoadOrder, ReplicaLookup, ReplicaView, Route, RouteRequest, RouterView, load_key,
};
use crate::slab::IdSlab;
use crate::time::Time;

/// How far past a blocked head the admission pass looks for work of another kind.
const LOOKAHEAD: usize = 16;

/// Counters the core keeps about its own decisions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Groups started.
    pub groups_started: u64,
    /// Trajectories completed (rewarded), counting regenerated ones again.
    pub trajectories_completed: u64,
    /// Trajectories handed to the trainer.
    pub trajectories_consumed: u64,
    /// Staleness at consumption: index = versions behind, value = trajectories.
    pub staleness_histogram: Vec<u64>,
    /// Turns thrown away to keep the staleness bound.
    pub regenerated_turns: u64,
    /// Trajectories regenerated at admission.
    pub regenerated_at_admission: u64,
    /// Trajectories regenerated at consumption.
    pub regenerated_at_consumption: u64,
    /// Finished trajectories regenerated at the publication that expired them, being all that
    /// kept their group from training.
    pub regenerated_at_publish: u64,
    /// Groups restarted on the weights just published, having started too late on the previous
    /// ones to finish before those expire ([`Core::restart_late_groups`]).
    #[serde(default)]
    pub groups_restarted: u64,
    /// Turns that reused a KV cache kept on their replica.
    pub sticky_hits: u64,
    /// Prefills done on a prefill replica (with a KV transfer after).
    pub disaggregated_prefills: u64,
    /// Idle KV caches evicted to make room.
    pub kv_evictions: u64,
    /// Stages retried after a failure, a timeout or a lost replica.
    pub stage_retries: u64,
    /// Groups given up after a trajectory's stages failed too often in a row.
    pub groups_abandoned: u64,
    /// Serving replicas added mid-run.
    pub replicas_added: u64,
    /// Serving replicas retired mid-run.
    pub replicas_retired: u64,
    /// Reports about stages the core no longer expected (ignored).
    pub ignored_reports: u64,
    /// Weight updates issued.
    pub weight_updates: u64,
    /// Generations interrupted by their replica's weight update, to resume on the new weights.
    pub interrupted_generations: u64,
    /// Training batches issued.
    pub train_batches: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
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
enum Visit {
    /// It was dispatched, finished or re-queued.
    Progressed,
    /// It could not be placed now; keep looking past it.
    Missed,
    /// Nothing behind it can be placed either; end the scan.
    Stop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Queue {
    Env,
    Gen,
    Decode,
    Reward,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kv {
    None,
    /// Kept on a decode/generate replica between turns (evictable), with its slot in the
    /// replica's [`Replica::retained`] list.
    Retained(ReplicaId, u64, Slot),
    /// Prefilled on a prefill replica, waiting to be pulled; with the prefill's version.
    Held(ReplicaId, u64, Version),
}

#[derive(Debug, Clone)]
struct TurnRec {
    version: Version,
    context_before: u64,
    input: u64,
}

#[derive(Debug, Clone)]
struct Traj {
    group: GroupId,
    task: u32,
    attempt: u32,
    turns: Vec<TurnRec>,
    context: u64,
    input: u64,
    pending_action: u64,
    reset_done: bool,
    phase: Phase,
    env_pool: Option<u32>,
    kv: Kv,
    queued: Option<Queue>,
    /// Oldest version among `turns` (`Version::MAX` when there are none).
    min_version: Version,
    /// Its stages' failures and timeouts since its last stage that finished.
    failures_in_a_row: u32,
    /// When its current turn became ready to generate (after the reset or the last environment
    /// step); `None` after a rewind, whose next turn is not a whole turn's cycle.
    turn_start: Option<Time>,
    /// What its current turn generated before an interrupt, to resume from. Those tokens are
    /// counted in `input` too (the resumed generation prefills them).
    partial: Option<PartialTurn>,
}

/// The part of a turn generated before its generation was interrupted.
#[derive(Debug, Clone, Copy)]
struct PartialTurn {
    /// The oldest version that generated part of it.
    oldest: Version,
    /// Tokens generated so far.
    tokens: u64,
}

impl Traj {
    fn oldest(&self) -> Option<Version> {
        (self.min_version != Version::MAX).then_some(self.min_version)
    }

    /// The first turn generated (in part, for the current turn's interrupted part, which is
    /// turn `turns.len()`) by a version older than `floor`.
    fn first_older_than(&self, floor: Version) -> Option<usize> {
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
struct Group {
    members: Vec<TrajId>,
    batch: u64,
    complete: u32,
    ready_key: Option<(Version, GroupId)>,
    /// Oldest turn version among its members (`Version::MAX` when none has a turn).
    oldest: Version,
    /// When the first generation of its current attempt was booked (`None` before that, and
    /// again once it is restarted).
    first_turn: Option<Time>,
    /// Oldest version its turns may come from, on top of the bound's floor: the version it was
    /// restarted on ([`Core::restart_late_groups`]; 0 otherwise).
    restart_floor: Version,
}

#[derive(Debug, Clone)]
struct Replica {
    role: ServeRole,
    max_seqs: u32,
    kv_capacity: u64,
    healthy: bool,
    version: Option<Version>,
    draining: bool,
    updating: bool,
    in_flight: u32,
    kv_reserved: u64,
    /// Idle KV caches kept between turns, least recently used first (ties by trajectory): the
    /// eviction order. Each trajectory's `Kv::Retained` holds its slot.
    retained: LruList<(Time, TrajId), u64>,
    retained_tokens: u64,
    held: BTreeSet<TrajId>,
    failures: u32,
    key: Option<u64>,
    /// Changed since it was last filed in the router's sets (it is in `Core::dirty`).
    dirty: bool,
    /// Told to retire: no new work; retired once nothing runs on it or waits for it.
    retiring: bool,
    /// Out of service for good (retired); a later recovery report is ignored.
    retired: bool,
}

impl Replica {
    /// The trajectories whose caches it keeps, by id (the order a map by trajectory walked
    /// them in, which the commands dropping them follow).
    fn retained_by_id(&self) -> Vec<TrajId> {
        let mut ids: Vec<TrajId> = self.retained.iter().map(|((_, t), _)| t).collect();
        ids.sort_unstable();
        ids
    }

    fn new(config: &crate::placement::ReplicaConfig) -> Replica {
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
struct Replicas<'a> {
    replicas: &'a [Replica],
    latest: Version,
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
enum StageKind {
    EnvReset,
    EnvStep,
    Prefill,
    Gen { version: Version },
    Reward,
}

#[derive(Debug, Clone)]
struct StageRec {
    traj: TrajId,
    kind: StageKind,
    replica: Option<ReplicaId>,
    kv_tokens: u64,
    kv_from: Option<(ReplicaId, u64)>,
    cpu: Option<(u32, u64)>,
    serverless: Option<u32>,
    deadline: Time,
    /// Whether [`Command::Interrupt`] was sent for it.
    interrupted: bool,
}

/// A task's turns as measured: how many, and their durations' sum and sum of squares (ns).
#[derive(Debug, Clone, Default)]
struct TurnBooks {
    turns: u64,
    sum: u128,
    squares: u128,
}

impl TurnBooks {
    fn add(&mut self, nanos: u64) {
        self.turns += 1;
        self.sum += nanos as u128;
        self.squares += nanos as u128 * nanos as u128;
    }

    /// A long chain of `turns` such turns (ns): one standard deviation above the mean of their
    /// sum, as for the slowest of a group's members (a group waits for it).
    fn long_chain(&self, turns: u32) -> f64 {
        let n = self.turns.max(1) as f64;
        let mean = self.sum as f64 / n;
        let var = (self.squares as f64 / n - mean * mean).max(0.0);
        turns as f64 * mean + (turns as f64 * var).sqrt()
    }
}

#[derive(Debug, Clone)]
struct TrainBatch {
    id: BatchId,
    publishes: bool,
}

/// The scheduler core. See the module docs.
#[derive(Debug, Clone)]
pub struct Core {
    cfg: Config,
    /// [`Core::admission_terms`] of `cfg`: `(window, over-provisioning)`, in trajectories
    /// (continuous discipline; zeros, unused, otherwise).
    admission_terms: (u64, u64),
    now: Time,
    version: Version,
    trajs: Vec<Traj>,
    groups: Vec<Group>,
    replicas: Vec<Replica>,
    prefill_set: LoadOrder,
    decode_set: LoadOrder,
    disaggregated: bool,
    cpu_free: Vec<u64>,
    serverless_free: Vec<u64>,
    stages: IdSlab<StageRec>,
    next_stage: u64,
    /// The queues, indexed by [`Queue`] (an array: one is looked up on every enqueue).
    /// Each holds trajectory ids, so it is walked oldest group first: trajectories are numbered
    /// group by group, in the order groups start ([`Core::start_group`]).
    queues: [IdSet; 4],
    ready: BTreeSet<(Version, GroupId)>,
    batch_complete: BTreeMap<u64, u32>,
    batch_done: BTreeMap<u64, u32>,
    batches_admitted: u64,
    active: u64,
    gpu_stages: u64,
    trainer: Option<TrainBatch>,
    minibatches_in_step: u32,
    next_batch: u64,
    pending_update: BTreeSet<ReplicaId>,
    /// Replicas changed since the router's sets were last brought up to date.
    dirty: Vec<ReplicaId>,
    draining: BTreeSet<ReplicaId>,
    updating: u32,
    /// Replicas told to retire and not retired yet: while there are none, the admission pass
    /// need not look for drained ones (it runs on every input, and fleets have many replicas).
    retiring: u32,
    commands: VecDeque<Command>,
    repump: bool,
    open_groups: BTreeSet<GroupId>,
    groups_closed: u64,
    hold_checked: u64,
    hold_until: Option<Time>,
    last_publish: Time,
    last_step: crate::time::Span,
    /// Per task: the time its turns took, from ready to generate to the environment's next
    /// observation, summed, and how many turns that is (for [`Core::restart_late_groups`]).
    turn_time: Vec<TurnBooks>,
    stats: Stats,
}

impl Core {
    /// A core for a job; it starts working on the first input or timeout.
    pub fn new(cfg: Config) -> Core {
        let replicas: Vec<Replica> = cfg.replicas.iter().map(Replica::new).collect();
        let disaggregated = replicas.iter().any(|r| r.role == ServeRole::Prefill);
        // Worked out for the discipline that uses them only, as before they were kept.
        let admission_terms = match cfg.policy.discipline {
            Discipline::Continuous => Self::admission_terms(&cfg),
            Discipline::Batched { .. } => (0, 0),
        };
        let turn_time = vec![TurnBooks::default(); cfg.tasks.len()];
        let mut core = Core {
            admission_terms,
            cpu_free: cfg.cpu_pools.iter().map(|p| p.millicpus).collect(),
            serverless_free: cfg.serverless_pools.iter().map(|p| p.concurrency).collect(),
            cfg,
            now: Time::ZERO,
            version: 0,
            trajs: Vec::new(),
            groups: Vec::new(),
            replicas,
            prefill_set: LoadOrder::new(),
            decode_set: LoadOrder::new(),
            disaggregated,
            stages: IdSlab::new(),
            next_stage: 0,
            queues: Default::default(),
            ready: BTreeSet::new(),
            batch_complete: BTreeMap::new(),
            batch_done: BTreeMap::new(),
            batches_admitted: 0,
            active: 0,
            gpu_stages: 0,
            trainer: None,
            minibatches_in_step: 0,
            next_batch: 0,
            pending_update: BTreeSet::new(),
            dirty: Vec::new(),
            draining: BTreeSet::new(),
            updating: 0,
            retiring: 0,
            commands: VecDeque::new(),
            repump: false,
            open_groups: BTreeSet::new(),
            groups_closed: 0,
            hold_checked: u64::MAX,
            hold_until: None,
            last_publish: Time::ZERO,
            last_step: crate::time::Span::ZERO,
            turn_time,
            stats: Stats::default(),
        };
        for i in 0..core.replicas.len() {
            core.touch(ReplicaId(i as u64));
        }
        core
    }

    /// Its configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The latest published policy version (= RL steps trained).
    #[inline]
    pub fn version(&self) -> Version {
        self.version
    }

    /// Its counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Whether every RL step has been trained.
    #[inline]
    pub fn finished(&self) -> bool {
        self.version >= self.cfg.steps
    }

    /// Feeds a fact.
    pub fn handle_input(&mut self, now: Time, input: Input) {
        self.now = self.now.max(now);
        match input {
            Input::StageFinished { stage, outcome } => self.stage_finished(stage, outcome),
            Input::StageFailed { stage } => self.stage_failed(stage, false),
            Input::ReplicaLost { replica } => self.replica_lost(replica),
            Input::ReplicaRecovered { replica } => self.replica_recovered(replica),
            Input::ReplicaAdded { config } => self.replica_added(config),
            Input::RetireReplica { replica } => self.retire_replica(replica),
            Input::WeightsUpdated { replica, version } => self.weights_updated(replica, version),
            Input::TrainFinished { batch } => self.train_finished(batch),
            Input::Published { version } => match self.trainer.as_ref() {
                Some(b) if self.publication_refusal(version).is_none() => {
                    let batch = b.id;
                    self.train_finished(batch);
                }
                _ => self.stats.ignored_reports += 1,
            },
        }
        self.pump();
    }

    /// Why an external trainer's publication of `version` cannot be taken now, or `None` when it
    /// can: it must be the next version, and the batch that completes the step it comes from must
    /// have been handed out (a trainer cannot have trained on trajectories it was never given).
    pub fn publication_refusal(&self, version: Version) -> Option<String> {
        let next = self.version + 1;
        if version <= self.version {
            return Some(format!(
                "version {version} is already published (the policy is at version {})",
                self.version
            ));
        }
        if version > next {
            return Some(format!(
                "version {version} skips a version: the next one is {next}"
            ));
        }
        if self.finished() {
            return Some(format!(
                "the job has trained all its {} steps",
                self.cfg.steps
            ));
        }
        match &self.trainer {
            Some(b) if b.publishes => None,
            _ => Some(format!(
                "version {next} comes from step {}, whose last batch has not been handed to \
                 the trainer yet ({} of {} batches of the step so far)",
                self.version,
                self.minibatches_in_step,
                (self.cfg.rollout_batch_size / self.cfg.train_batch_size).max(1)
            )),
        }
    }

    /// Wakes the core at (or after) the time [`Core::poll_timeout`] asked for; also starts the
    /// job when called first.
    pub fn handle_timeout(&mut self, now: Time) {
        self.now = self.now.max(now);
        // Every stage gets the same timeout and the clock never goes back, so deadlines grow
        // with stage ids: the oldest live stage has the earliest one.
        loop {
            let Some((id, deadline)) = self.stages.iter().next().map(|(id, s)| (id, s.deadline))
            else {
                break;
            };
            let stage = StageId(id);
            if deadline > self.now {
                break;
            }
            if let Some(replica) = self.stages.get(stage.0).and_then(|s| s.replica) {
                if let Some(r) = self.replicas.get_mut(replica.0 as usize) {
                    r.failures = r.failures.saturating_add(1);
                }
                self.touch(replica);
            }
            self.stage_failed(stage, true);
        }
        self.pump();
    }

    /// The next command, if any.
    #[inline]
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// When the core next needs [`Core::handle_timeout`], if ever.
    #[inline]
    pub fn poll_timeout(&self) -> Option<Time> {
        let stage = self.stages.iter().next().map(|(_, s)| s.deadline);
        match (stage, self.hold_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Trajectories by state: `(in flight, complete and waiting for the trainer, consumed)`.
    pub fn trajectory_counts(&self) -> (u64, u64, u64) {
        let mut counts = (0, 0, 0);
        for t in &self.trajs {
            match t.phase {
                Phase::Consumed => counts.2 += 1,
                Phase::Complete => counts.1 += 1,
                Phase::Abandoned => {}
                _ => counts.0 += 1,
            }
        }
        counts
    }

    /// A one-line summary of where everything is, for diagnostics (e.g. a stalled run).
    pub fn summary(&self) -> String {
        let mut phases: BTreeMap<String, u64> = BTreeMap::new();
        for t in &self.trajs {
            *phases.entry(format!("{:?}", t.phase)).or_default() += 1;
        }
        let replicas: Vec<String> = self
            .replicas
            .iter()
            .map(|r| {
                format!(
                    "{:?}/v{:?}/{}{}{}/seq{}/kv{}+{}",
                    r.role,
                    r.version,
                    if r.healthy { "" } else { "lost," },
                    if r.draining { "draining," } else { "" },
                    if r.updating { "updating" } else { "" },
                    r.in_flight,
                    r.kv_reserved,
                    r.held.len()
                )
            })
            .collect();
        format!(
            "version {} trainer {:?} phases {:?} ready {} pending_update {} updating {} replicas [{}]",
            self.version,
            self.trainer.as_ref().map(|b| b.id),
            phases,
            self.ready.len(),
            self.pending_update.len(),
            self.updating,
            replicas.join(" ")
        )
    }

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

    // ----- bookkeeping helpers -----

    fn view(r: &Replica, latest: Version) -> ReplicaView {
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
    fn touch(&mut self, id: ReplicaId) {
        let Some(r) = self.replicas.get_mut(id.0 as usize) else {
            return;
        };
        if !r.dirty {
            r.dirty = true;
            self.dirty.push(id);
        }
    }

    /// Re-files every replica changed since the last call in the router's sets.
    fn refile(&mut self) {
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

    fn floor(&self) -> Version {
        self.version.saturating_sub(self.cfg.policy.max_staleness)
    }

    fn enqueue(&mut self, t: TrajId, queue: Queue, phase: Phase) {
        self.dequeue(t);
        // Oldest group first, everywhere: a straggler of an old group overtakes fresh work, so
        // groups complete (and can be trained on) before their first turns fall out of the bound.
        // Ids follow groups, so the id order of the queue is that order.
        self.queues[queue as usize].insert(t.0);
        let traj = &mut self.trajs[t.0 as usize];
        traj.queued = Some(queue);
        traj.phase = phase;
    }

    fn dequeue(&mut self, t: TrajId) {
        if let Some(q) = self.trajs[t.0 as usize].queued.take() {
            self.queues[q as usize].remove(t.0);
        }
    }

    fn new_stage(&mut self, rec: StageRec, cmd: StageCommand) {
        if rec.replica.is_some() {
            self.gpu_stages += 1;
        }
        self.stages.insert(cmd.stage.0, rec);
        self.commands.push_back(Command::Run(cmd));
    }

    fn stage_id(&mut self) -> StageId {
        let id = StageId(self.next_stage);
        self.next_stage += 1;
        id
    }

    fn stage_command(
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
    fn release_stage(&mut self, rec: &StageRec) {
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

    fn take_stage(&mut self, stage: StageId) -> Option<StageRec> {
        let rec = self.stages.remove(stage.0)?;
        self.release_stage(&rec);
        Some(rec)
    }

    /// Drops a trajectory's retained or held KV cache (telling the replica).
    fn drop_kv(&mut self, t: TrajId, tell: bool) {
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
    fn evict(&mut self, replica: ReplicaId, needed: u64) {
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

    // ----- inputs -----

    fn stage_finished(&mut self, stage: StageId, outcome: StageOutcome) {
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

    fn finish_rollout(&mut self, t: TrajId) {
        self.drop_kv(t, true);
        let task = &self.cfg.tasks[self.trajs[t.0 as usize].task as usize];
        if task.reward == RewardRoute::Environment {
            self.complete(t);
        } else {
            self.enqueue(t, Queue::Reward, Phase::QueuedReward);
        }
    }

    fn complete(&mut self, t: TrajId) {
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

    /// A stage failed or timed out: retried, unless its trajectory has now failed
    /// [`Config::stage_failure_limit`] times in a row, which gives up its group.
    fn stage_failed(&mut self, stage: StageId, cancel: bool) {
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
    fn abandon_group(&mut self, failed: TrajId) {
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
    fn fail_stage(&mut self, stage: StageId, cancel: bool) {
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

    fn replica_lost(&mut self, id: ReplicaId) {
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
    fn forget_unsent_commands_to(&mut self, id: ReplicaId) {
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

    fn replica_recovered(&mut self, id: ReplicaId) {
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

    fn replica_added(&mut self, config: crate::placement::ReplicaConfig) {
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

    fn retire_replica(&mut self, id: ReplicaId) {
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
    fn retire_drained(&mut self) {
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

    fn weights_updated(&mut self, id: ReplicaId, version: Version) {
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

    fn train_finished(&mut self, batch: BatchId) {
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

    /// At a publication: a finished trajectory whose turn the new floor expires is regenerated
    /// now, from its offending turn, when it is the only thing keeping its group from being
    /// trained: every other member is inside the bound and stays inside it through the next
    /// publication. Left waiting, it would be found out only when the group's last member
    /// finished, and the group would then wait a whole chain more for it. When another member
    /// is expired or about to be, the group waits as before and is regenerated together when
    /// it is taken: regenerating its members one publication at a time kept such groups
    /// cycling (up to 9 attempts) on colocated placements. RollArt-like job, seeds 0-5:
    /// 108.8-111.9 s per step against 111.8-116.9 s at `maxStaleness: 2`; elsewhere within 1%
    /// either way or faster (docs/simulator.md). The batched baselines keep their own rule.
    fn regenerate_lone_expired(&mut self) {
        if self.cfg.policy.discipline != Discipline::Continuous {
            return;
        }
        let floor = self.floor();
        let open: Vec<GroupId> = self.open_groups.iter().copied().collect();
        for g in open {
            let members = &self.groups[g.0 as usize].members;
            let expired: Vec<TrajId> = members
                .iter()
                .copied()
                .filter(|m| self.trajs[m.0 as usize].min_version < floor.saturating_add(1))
                .collect();
            let [t] = expired[..] else {
                continue;
            };
            let traj = &self.trajs[t.0 as usize];
            if traj.phase != Phase::Complete || traj.min_version >= floor {
                continue;
            }
            if let Some(k) = traj.turns.iter().position(|turn| turn.version < floor) {
                self.regenerate(t, k);
                self.stats.regenerated_at_publish += 1;
                self.repump = true;
            }
        }
    }

    /// At a publication: a prefilled context waiting for its decode that the new floor expires
    /// can no longer be decoded inside the bound, so its cache is released now and the turn goes
    /// back to be prefilled on current weights. Left held until the decode queue reaches it, it
    /// pins its prefill replica: a rolling update draining that replica waits for the cache to
    /// go, while the decode queue, blocked on a decode replica that waits for the same update
    /// slot, never reaches it (a stall seen with `maxStaleness: 0` after a decode replica was
    /// lost).
    fn release_expired_held_kv(&mut self) {
        let floor = self.floor();
        for i in 0..self.replicas.len() {
            let expired: Vec<TrajId> = self.replicas[i]
                .held
                .iter()
                .copied()
                .filter(|t| matches!(self.trajs[t.0 as usize].kv, Kv::Held(_, _, v) if v < floor))
                .collect();
            for t in expired {
                self.drop_kv(t, true);
                self.enqueue(t, Queue::Gen, Phase::QueuedGen);
                self.repump = true;
            }
        }
    }

    /// Turns of a task measured before [`Core::restart_late_groups`] trusts their mean.
    const MIN_TURN_SAMPLES: u64 = 16;

    /// At a publication: a group whose oldest turn has just become one version old expires in
    /// `maxStaleness` more steps. When a long chain of its task (`maxTurns` turns, one standard
    /// deviation above the mean of the turns measured so far: a group waits for its slowest
    /// member) does not fit in its age plus that many mean steps, it will most likely miss the
    /// bound and be regenerated whole when found out, a chain later; restarted now on the weights
    /// just published, it gains a step and loses only its age. Not when such a chain would not
    /// fit in `maxStaleness + 1` steps either (early in a job, when the mean step is still
    /// short). Its members waiting for work or finished start over at once; the running ones at
    /// their next generation or when they finish (the group's `restart_floor`), and its turns
    /// then wait for the new weights. On the RollArt-like job this takes the `swe-bench-style`
    /// groups that started in the last 40-60 s of a step (about 15-30 groups a step), and no
    /// group of the shorter tasks; simulated, seeds 0-5: 103.5 / 108.2 / 101.7 / 103.1 / 104.6 /
    /// 99.8 s per step against 108.8 / 111.9 / 109.1 / 111.5 / 110.1 / 108.8 s, the quick-start
    /// unchanged, `uniform` and `best-gpu` 3% and 8-11% faster. Continuous discipline only.
    fn restart_late_groups(&mut self) {
        let v = self.version;
        let s = self.cfg.policy.max_staleness;
        if !self.cfg.policy.restart_late_groups
            || self.cfg.policy.discipline != Discipline::Continuous
            || v == 0
            || s == 0
        {
            return;
        }
        // The mean step so far (publication `v` at `now`, version 0 at time zero).
        let step = self.now.0 / v;
        let open: Vec<GroupId> = self.open_groups.iter().copied().collect();
        for g in open {
            let group = &self.groups[g.0 as usize];
            let Some(first) = group.first_turn else {
                continue;
            };
            if group.oldest.saturating_add(1) != v {
                continue;
            }
            let task = self.trajs[group.members[0].0 as usize].task as usize;
            let books = &self.turn_time[task];
            if books.turns < Self::MIN_TURN_SAMPLES {
                continue;
            }
            let longest = books.long_chain(self.cfg.tasks[task].max_turns);
            let left = self.now.since(first).0 as f64 + s as f64 * step as f64;
            if longest <= left {
                continue;
            }
            // Restarted, it would miss the bound anyway: let it run.
            if longest > (s + 1) as f64 * step as f64 {
                continue;
            }
            let group = &mut self.groups[g.0 as usize];
            group.restart_floor = v;
            group.first_turn = None;
            self.stats.groups_restarted += 1;
            let members = group.members.clone();
            for t in members {
                let traj = &self.trajs[t.0 as usize];
                if !matches!(
                    traj.phase,
                    Phase::QueuedGen | Phase::QueuedDecode | Phase::Complete
                ) {
                    continue;
                }
                if let Some(k) = traj.first_older_than(v) {
                    self.regenerate(t, k);
                    self.repump = true;
                }
            }
        }
    }

    // ----- the admission pass -----

    fn pump(&mut self) {
        if self.finished() {
            return;
        }
        // A pass can unblock work an earlier stage of the same pass already looked at (training
        // opens a batch or a sync; a rewind re-queues a trajectory): repeat while that happens.
        for _ in 0..8 {
            self.repump = false;
            self.retire_drained();
            self.sync_weights();
            self.admit_groups();
            self.dispatch_env();
            self.dispatch_gen();
            self.dispatch_decode();
            self.dispatch_reward();
            self.dispatch_train();
            if !self.repump {
                break;
            }
        }
    }

    fn sync_weights(&mut self) {
        match self.cfg.policy.weight_sync {
            SyncMode::Rolling => self.rolling_sync(),
            mode => self.global_sync(mode),
        }
    }

    fn rolling_sync(&mut self) {
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
            let pick = self.pending_update.iter().copied().min_by_key(|id| {
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

    /// Asks every generation running on `id` to stop where it is, so that the replica drains
    /// now rather than when its longest answer ends.
    fn interrupt_generations(&mut self, id: ReplicaId) {
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

    fn start_update(&mut self, id: ReplicaId, mode: SyncMode) {
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

    fn global_sync(&mut self, mode: SyncMode) {
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

    /// The most rollout batches the continuous discipline keeps started and not yet trained on,
    /// however loose the staleness bound. Every trajectory alive when its replica takes new
    /// weights (once a step) loses its KV cache and prefills its whole context again, so a
    /// trajectory that waits more steps for the trainer costs more prefill and buys no
    /// throughput once the trainer is fed (measured on the RollArt-like job with `maxStaleness:
    /// 8`, on the placement planned for 2: 95.4 s per step with a window of 4 batches, 75.0 s
    /// with 2; docs/simulator.md).
    pub const MAX_WINDOW_BATCHES: u64 = 2;

    /// The continuous discipline's admission window and over-provisioning, in trajectories
    /// (see [`Core::admit_groups`]): they depend on the configuration alone, so they are worked
    /// out once, not on every admission pass (which runs on every input).
    fn admission_terms(cfg: &Config) -> (u64, u64) {
        let n = cfg.group_size as u64;
        let b = cfg.rollout_batch_size as u64;
        let extra = (cfg.policy.over_provisioning * b as f64).ceil().max(0.0) as u64;
        // Little's law: with N trajectories generating, a step takes about B / (N / L) for a
        // lifetime L, so a trajectory spans N / B versions; to finish within the bound, N must
        // stay below S * B, and a group lives as long as the slowest of its members (about
        // twice the mean), hence half of that, but at least three quarters of a batch so that a
        // small bound still keeps the trainer fed (both measured: docs/simulator.md), and never
        // less than one training batch, or the trainer would wait for trajectories that are
        // never started. A loose bound does not widen it past `MAX_WINDOW_BATCHES`: see there.
        let window = (cfg.policy.max_staleness * b / 2)
            .min(Self::MAX_WINDOW_BATCHES * b)
            .max(3 * b / 4)
            .max(cfg.train_batch_size as u64)
            .max(n);
        (window, extra)
    }

    fn admit_groups(&mut self) {
        let n = self.cfg.group_size as u64;
        let b = self.cfg.rollout_batch_size as u64;
        let groups_per_batch = (b / n).max(1);
        match self.cfg.policy.discipline {
            Discipline::Continuous => {
                // Started but not consumed: a window of batches plus the
                // over-provisioning, in the spirit of AReaL's `(version + maxStaleness + 1) *
                // batch`. The window stays full through the last step too: the last batches
                // then take the first groups to finish, as every earlier one does, instead of
                // waiting for the slowest ones the job happened to start (measured: the last
                // step of the RollArt-like job took 258 s instead of about 120, docs/simulator.md).
                // Nothing new starts once the last batch went to the trainer; groups still
                // running then are dropped untrained.
                let (window, extra) = self.admission_terms;
                if self.stats.trajectories_consumed >= self.cfg.steps * b {
                    return;
                }
                let budget = self.stats.trajectories_consumed + window + extra;
                let live = |core: &Core| core.groups.len() as u64 - core.stats.groups_abandoned;
                while (live(self) + 1) * n <= budget {
                    self.start_group(0);
                }
            }
            Discipline::Batched { lag } => {
                let k = self.batches_admitted;
                if k >= self.cfg.steps || self.updating > 0 {
                    return;
                }
                if self.cfg.colocated && self.trainer.is_some() {
                    return;
                }
                let previous_done = k == 0
                    || self.batch_done.get(&(k - 1)).copied().unwrap_or(0) as u64
                        >= groups_per_batch;
                let floor = k.saturating_sub(lag);
                let replicas_ready = self
                    .replicas
                    .iter()
                    .filter(|r| r.healthy)
                    .all(|r| r.version.is_some_and(|v| v >= floor));
                if previous_done && self.version >= floor && replicas_ready {
                    for _ in 0..groups_per_batch {
                        self.start_group(k);
                    }
                    self.batches_admitted += 1;
                }
            }
        }
    }

    fn start_group(&mut self, batch: u64) {
        let g = GroupId(self.groups.len() as u64);
        let shares: Vec<f64> = self.cfg.tasks.iter().map(|t| t.share).collect();
        let task = SplitMix64::keyed(self.cfg.seed, &[1, g.0]).weighted(&shares) as u32;
        let mut members = Vec::new();
        for _ in 0..self.cfg.group_size {
            let t = TrajId(self.trajs.len() as u64);
            self.trajs.push(Traj {
                group: g,
                task,
                attempt: 0,
                turns: Vec::new(),
                context: 0,
                input: 0,
                pending_action: 0,
                reset_done: false,
                phase: Phase::QueuedEnv,
                env_pool: None,
                kv: Kv::None,
                queued: None,
                min_version: Version::MAX,
                failures_in_a_row: 0,
                turn_start: None,
                partial: None,
            });
            members.push(t);
            self.active += 1;
        }
        self.groups.push(Group {
            members: members.clone(),
            batch,
            complete: 0,
            ready_key: None,
            oldest: Version::MAX,
            first_turn: None,
            restart_floor: 0,
        });
        self.stats.groups_started += 1;
        self.open_groups.insert(g);
        for t in members {
            self.enqueue(t, Queue::Env, Phase::QueuedEnv);
        }
    }

    /// The queued trajectory after `after` (the first one for `None`).
    fn queue_next(&self, q: Queue, after: Option<TrajId>) -> Option<TrajId> {
        let set = &self.queues[q as usize];
        match after {
            None => set.first(),
            Some(t) => set.after(t.0),
        }
        .map(TrajId)
    }

    /// Runs `f` with a read-only view of the replicas for the router (selection has no side
    /// effects; the caller books what it picks).
    fn with_router<R>(&mut self, f: impl FnOnce(&RouterView<'_, Replicas<'_>>) -> R) -> R {
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
    fn scan(&mut self, queue: Queue, mut visit: impl FnMut(&mut Self, TrajId) -> Visit) {
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
                Visit::Stop => return,
            }
        }
    }

    fn dispatch_env(&mut self) {
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

    /// The staleness check at admission: regenerates from the first turn older than the bound.
    /// Returns whether the trajectory was rewound.
    fn check_admission(&mut self, t: TrajId) -> bool {
        let traj = &self.trajs[t.0 as usize];
        let floor = self
            .floor()
            .max(self.groups[traj.group.0 as usize].restart_floor);
        if floor == 0
            || (traj.turns.is_empty() && traj.partial.is_none() && !matches!(traj.kv, Kv::Held(..)))
        {
            return false;
        }
        // `min_version` is the oldest turn's version: when it is inside the bound, no turn is
        // out of it and the turns need not be walked (this runs on every look at a queued turn).
        let first_bad = traj.first_older_than(floor);
        let held_bad = matches!(traj.kv, Kv::Held(_, _, v) if v < floor);
        match first_bad {
            Some(k) => {
                self.regenerate(t, k);
                self.stats.regenerated_at_admission += 1;
                true
            }
            None if held_bad => {
                self.drop_kv(t, true);
                self.enqueue(t, Queue::Gen, Phase::QueuedGen);
                true
            }
            None => false,
        }
    }

    /// Rewinds a (queued or complete) trajectory to turn `k` and queues it for generation.
    fn regenerate(&mut self, t: TrajId, k: usize) {
        let ti = t.0 as usize;
        if self.trajs[ti].phase == Phase::Complete {
            let g = self.trajs[ti].group;
            let group = &mut self.groups[g.0 as usize];
            if let Some(key) = group.ready_key.take() {
                self.ready.remove(&key);
                let batch = group.batch;
                if let Some(c) = self.batch_complete.get_mut(&batch) {
                    *c = c.saturating_sub(1);
                }
                if let Some(c) = self.batch_done.get_mut(&batch) {
                    *c = c.saturating_sub(1);
                }
            }
            group.complete = group.complete.saturating_sub(1);
            self.active += 1;
            self.open_groups.insert(g);
        }
        self.drop_kv(t, true);
        let traj = &mut self.trajs[ti];
        let turn = match (traj.turns.get(k).cloned(), traj.partial) {
            (Some(turn), _) => turn,
            // The current turn's interrupted part, generated by weights now too old.
            (None, Some(p)) if k == traj.turns.len() => TurnRec {
                version: p.oldest,
                context_before: traj.context,
                input: traj.input.saturating_sub(p.tokens),
            },
            (None, _) => return,
        };
        traj.partial = None;
        // A discarded interrupted part counts as a turn regenerated.
        self.stats.regenerated_turns += (traj.turns.len() - k).max(1) as u64;
        traj.turns.truncate(k);
        traj.min_version = traj
            .turns
            .iter()
            .map(|t| t.version)
            .min()
            .unwrap_or(Version::MAX);
        traj.context = turn.context_before;
        traj.input = turn.input;
        traj.attempt += 1;
        traj.turn_start = None;
        let g = traj.group.0 as usize;
        self.groups[g].oldest = self.groups[g]
            .members
            .iter()
            .map(|m| self.trajs[m.0 as usize].min_version)
            .min()
            .unwrap_or(Version::MAX);
        self.enqueue(t, Queue::Gen, Phase::QueuedGen);
    }

    /// The oldest version a replica may serve to generate `t`'s next turn. Normally the bound's
    /// floor; but a turn that would become the oldest of its group (its first, when no member
    /// of the group has an older one) sets when the whole group expires, and one generated at
    /// version `latest - maxStaleness` would leave the group only the current step to finish in
    /// and be trained, which a multi-turn group rarely manages: it would be thrown away. So such
    /// a turn waits for a replica of version `latest - maxStaleness + 1` or newer (capped at the
    /// latest). Continuous discipline only; the batched baselines keep their own rule.
    fn start_floor(&self, t: TrajId) -> Version {
        let floor = self.floor();
        // A restarted group's turns come from the weights it was restarted on, or newer.
        let restart_floor = self.groups[self.trajs[t.0 as usize].group.0 as usize].restart_floor;
        if restart_floor > floor {
            return restart_floor.min(self.version);
        }
        let strict = (self.version + 1)
            .saturating_sub(self.cfg.policy.max_staleness)
            .min(self.version);
        if self.cfg.policy.discipline != Discipline::Continuous || strict <= floor {
            return floor;
        }
        let traj = &self.trajs[t.0 as usize];
        if traj.min_version < strict {
            return floor;
        }
        if self.groups[traj.group.0 as usize].oldest < strict {
            floor
        } else {
            strict
        }
    }

    fn gpu_gate_closed(&self) -> bool {
        self.cfg.colocated && self.trainer.is_some()
    }

    fn dispatch_gen(&mut self) {
        if self.gpu_gate_closed() {
            return;
        }
        let mut prefill_blocked = !self.disaggregated;
        let mut decode_blocked = false;
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

    fn book_gen(&mut self, t: TrajId, route: Route, req: &RouteRequest) {
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

    fn dispatch_decode(&mut self) {
        if self.gpu_gate_closed() {
            return;
        }
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
            // The hard bound only, not `start_floor`: this context is already prefilled and its
            // KV cache pins a prefill replica, which a rolling update may be draining; holding
            // the decode back for newer weights could then wait on that very update forever.
            let floor = core.floor();
            let pick =
                core.with_router(|router| router.least_loaded(router.decode, need, floor, true));
            let Some((d, evict)) = pick else {
                return Visit::Stop;
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

    fn dispatch_reward(&mut self) {
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

    /// Expiry-aware publishing: whether to hold the batch that would publish the next version
    /// because some unfinished group would fall out of the staleness bound the moment it is
    /// published (and be regenerated). The hold lasts until no such group is left or for half the
    /// previous step's duration, whichever comes first; the trainer is rarely the bottleneck of
    /// agentic RL, so a short wait costs less than regenerating whole groups.
    fn hold_publish(&mut self) -> bool {
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

    fn dispatch_train(&mut self) {
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
        for (_, g) in stale {
            let members = self.groups[g.0 as usize].members.clone();
            for t in members {
                let first_bad = self.trajs[t.0 as usize]
                    .turns
                    .iter()
                    .position(|turn| turn.version < floor);
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
            Discipline::Continuous => self.ready.iter().take(per_batch).map(|&(_, g)| g).collect(),
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
        for g in &chosen {
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
        });
    }
}
