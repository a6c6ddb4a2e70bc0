//! The discrete-event simulation: the core on a virtual clock, against the hardware models.
//!
//! The loop is the one any driver of a sans-IO core runs: hand the core's commands to the
//! (simulated) workers, advance the clock to the earlier of the next worker event and the core's
//! own timeout, feed the resulting fact back, repeat until the core has trained every step.
//!
//! Besides running the workload, the simulation keeps its own independent books and records
//! every breach of the invariants the core promises: a trajectory trained on twice, a group
//! trained on incomplete, a turn older than the staleness bound (by the versions the simulated
//! replicas actually served), a pool given more than its capacity (KV cache, batch slots, vCPUs,
//! serverless concurrency), a sticky turn sent where its KV cache is not.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::BuildHasherDefault;

use rollfleet_catalog::Catalog;
use rollfleet_core::rng::SplitMix64;
use rollfleet_core::slab::IdSlab;
use rollfleet_core::{
    BatchId, Command, Config, Core, Input, Placement, Policy, ReplicaConfig, ReplicaId, ServeRole,
    Span, StageCommand, StageId, StageOutcome, StageWork, SyncMode, Time, TrajId,
};
use rollfleet_planner::profile::{Estimate, Origin, ProfileStore};
use rollfleet_planner::roofline::WorkKind;
use rollfleet_spec::{JobSpec, PoolKind};

use crate::bound::{LatencyRates, StepChain, TurnTrace, trajectory_latency};
use crate::hardware::{Engine, EngineDone, HardwareModel, IdHasher, Meter, ModelCosts, PrefillJob};
use crate::queue::EventQueue;
use crate::report::latency_rates;
use crate::workload::{Sampler, sample, stream};

pub use rollfleet_fleet::hardware::model_costs;
pub use rollfleet_fleet::migration::{MigrationWave, RetireGroup};
pub use rollfleet_fleet::workload::workload_means;

/// Turns of an episode its books make room for when it starts (the longest tasks measured run
/// 30); longer episodes grow them as they go.
const MAX_TURNS_RESERVED: u32 = 256;

/// Options of one simulated run.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Seed of every random draw.
    pub seed: u64,
    /// The hardware model.
    pub hardware: HardwareModel,
    /// Mean time between replica failures across the fleet, seconds (`None`: no failures).
    pub failure_mtbf_s: Option<f64>,
    /// How long a failed replica stays down, seconds.
    pub repair_s: f64,
    /// Give up after this much virtual time, seconds.
    pub max_virtual_s: f64,
    /// Lose part of a pool for good mid-run (`None`: no such loss).
    pub pool_loss: Option<PoolLoss>,
    /// Move to a new placement mid-run, wave by wave (`None`: keep the placement).
    pub migration: Option<Migration>,
    /// Slow a pool's GPUs down mid-run (`None`: no such thing).
    pub slowdown: Option<crate::drift::Slowdown>,
    /// Re-plan when a measured profile drifts from the plan's by more than this relative margin
    /// (`None`: never). The run must start on the plan's placement.
    pub replan_on_drift: Option<f64>,
}

/// A re-plan applied mid-run: after version `at_step` is published (and after a pool loss at
/// the same step), GPU pools grow by `added_gpus`, then the waves run one after the other, each
/// starting its replicas (they load the current weights) and retiring its others (drained by the
/// core), the next one once every replica of the last has loaded or been handed back.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Migration {
    /// The step after which it starts.
    pub at_step: u64,
    /// GPUs that arrive, per spec pool index.
    pub added_gpus: Vec<(u32, u32)>,
    /// The waves.
    pub waves: Vec<MigrationWave>,
}

/// What a [`Migration`] did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MigrationReport {
    /// Virtual seconds at which it started.
    pub at_s: f64,
    /// Waves run to the end.
    pub waves_done: usize,
    /// Replicas started.
    pub started: u32,
    /// Replicas retired (handed back by the core).
    pub retired: u32,
    /// Virtual seconds at which the last wave ended (`None`: still going when the run ended).
    pub done_at_s: Option<f64>,
    /// The trainer's GPUs after the migration, when it resized the trainer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trainer_gpus: Option<u32>,
}

/// A deterministic, permanent loss of part of a GPU pool's serving replicas.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PoolLoss {
    /// The pool (index in the spec).
    pub pool: u32,
    /// Share of the pool's GPUs lost, in (0, 1).
    pub fraction: f64,
    /// The loss happens as this version is published (after this many steps).
    pub at_step: u64,
}

/// What a [`PoolLoss`] took away.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LossReport {
    /// Virtual seconds at which it happened.
    pub at_s: f64,
    /// Replicas lost (highest-numbered serving replicas of the pool first).
    pub replicas: Vec<u32>,
    /// GPUs those replicas had.
    pub gpus: u32,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            seed: 0,
            hardware: HardwareModel::default(),
            failure_mtbf_s: None,
            repair_s: 60.0,
            max_virtual_s: 30.0 * 86_400.0,
            pool_loss: None,
            migration: None,
            slowdown: None,
            replan_on_drift: None,
        }
    }
}

/// Useful work of trained trajectories, the input of the lower bound.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Work {
    /// Prefill FLOPs (prompt and observations, with perfect KV reuse).
    pub prefill_flops: f64,
    /// Decode FLOPs.
    pub decode_flops: f64,
    /// Decode KV-cache bytes read.
    pub decode_kv_bytes: f64,
    /// Tokens decoded.
    pub decode_tokens: f64,
    /// Training FLOPs.
    pub train_flops: f64,
    /// Tokens trained on.
    pub train_tokens: f64,
    /// Environment vCPU-seconds.
    pub env_cpu_seconds: f64,
    /// Local reward vCPU-seconds.
    pub local_reward_cpu_seconds: f64,
    /// Serverless seconds, per spec pool index.
    pub serverless_seconds: BTreeMap<u32, f64>,
    /// Per RL step, what the latency term of the bound needs (see [`crate::bound`]).
    pub steps: Vec<StepChain>,
    /// Trajectories trained on.
    pub trajectories: u64,
    /// Trajectories trained on, per task (the job's order).
    pub trajectories_per_task: Vec<u64>,
}

impl Work {
    /// Adds one trained trajectory, trained at step `step`: its prefill, decode and training
    /// work, its environment and reward time, and its chain for the latency term.
    pub(crate) fn add_trajectory(
        &mut self,
        spec: &JobSpec,
        costs: &ModelCosts,
        rates: &LatencyRates,
        step: usize,
        l: &TrajLedger,
        traces: &mut Vec<TurnTrace>,
    ) {
        self.trajectories += 1;
        let task = l.task as usize;
        if self.trajectories_per_task.len() <= task {
            self.trajectories_per_task.resize(task + 1, 0);
        }
        self.trajectories_per_task[task] += 1;
        self.env_cpu_seconds += l.reset_cpu_s;
        let mut context = 0.0;
        for turn in &l.turns {
            let before = turn.context_before as f64;
            let input = turn.input as f64;
            let action = turn.action as f64;
            self.prefill_flops += costs.flops_per_token * input
                + costs.attention_flops_per_context * input * (before + input / 2.0);
            let ctx = before + input;
            self.decode_flops += costs.flops_per_token * action
                + costs.attention_flops_per_context * action * (ctx + action / 2.0);
            self.decode_kv_bytes += costs.kv_bytes_per_token * action * (ctx + action / 2.0);
            self.decode_tokens += action;
            self.env_cpu_seconds += turn.env_cpu_s;
            context = ctx + action;
        }
        self.train_tokens += context;
        self.train_flops += 3.0 * costs.flops_per_token * context;
        traces.clear();
        traces.extend(l.turns.iter().map(|turn| TurnTrace {
            context_before: turn.context_before,
            input: turn.input,
            action: turn.action,
            env_s: turn.env_s,
        }));
        if self.steps.len() <= step {
            self.steps.resize(step + 1, StepChain::default());
        }
        let train_s = 3.0 * costs.flops_per_token * context / rates.train_flops.max(1.0);
        let chain = &mut self.steps[step];
        chain.train_s += train_s;
        // A trajectory with no turns has no version to wait for (and is a violation anyway).
        if !l.turns.is_empty() {
            let latency = trajectory_latency(rates, traces, l.reward_s);
            chain.longest_s = chain.longest_s.max(latency + train_s);
        }
        if let Some(task) = spec.tasks.get(task)
            && let Some(reward) = spec.rewards.iter().find(|r| r.name == task.reward)
        {
            match reward.runs_on {
                rollfleet_spec::RewardPlacement::Serverless => {
                    let pool = reward
                        .pool
                        .as_deref()
                        .and_then(|n| spec.pools.iter().position(|p| p.name == n))
                        .unwrap_or(0) as u32;
                    *self.serverless_seconds.entry(pool).or_default() += l.reward_s;
                }
                rollfleet_spec::RewardPlacement::Local => {
                    self.local_reward_cpu_seconds += l.reward_s
                }
                rollfleet_spec::RewardPlacement::Environment => {}
            }
        }
    }
}

/// One generated turn of a trajectory, as the books of useful work keep it.
#[derive(Debug, Clone, Default)]
pub(crate) struct TurnWork {
    pub(crate) version: u64,
    pub(crate) context_before: u64,
    pub(crate) input: u64,
    pub(crate) action: u64,
    pub(crate) env_cpu_s: f64,
    pub(crate) env_s: f64,
}

/// What the simulator knows of one trajectory: its group, task, turns and times.
#[derive(Debug, Clone, Default)]
pub(crate) struct TrajLedger {
    pub(crate) group: u64,
    pub(crate) task: u32,
    pub(crate) reset_cpu_s: f64,
    pub(crate) turns: Vec<TurnWork>,
    pub(crate) reward_s: f64,
    inputs: Vec<u64>,
    consumed: bool,
    /// Turns the episode lasts (drawn on its first environment stage, the reset).
    turns_wanted: Option<u32>,
    /// The context after the last of `turns` (0 with none), kept here so that generating the
    /// next turn does not read the turns back (a cache miss per turn).
    context_end: u64,
    /// The last of `inputs` (0 with none), for the same reason.
    last_input: u64,
    /// The part of a turn generated before an interrupt: its turn and attempt (a rewind
    /// discards it), its oldest version and its tokens.
    partial: Option<PartialWork>,
}

#[derive(Debug, Clone, Copy)]
struct PartialWork {
    turn: u32,
    attempt: u32,
    version: u64,
    tokens: u64,
}

impl TrajLedger {
    /// The tokens of turn `turn` generated before an interrupt in attempt `attempt`.
    fn partial_tokens(&self, turn: u32, attempt: u32) -> u64 {
        self.partial
            .filter(|p| p.turn == turn && p.attempt == attempt)
            .map_or(0, |p| p.tokens)
    }
}

impl TrajLedger {
    /// Drops the turns from `k` on (they belong to an attempt that was thrown away).
    fn truncate_turns(&mut self, k: usize) {
        if self.turns.len() > k {
            self.turns.truncate(k);
            self.context_end = self
                .turns
                .last()
                .map_or(0, |w| w.context_before + w.input + w.action);
        }
    }

    fn push_turn(&mut self, turn: TurnWork) {
        self.context_end = turn.context_before + turn.input + turn.action;
        self.turns.push(turn);
    }

    /// Keeps the inputs before turn `k` and appends turn `k`'s.
    fn set_input(&mut self, k: usize, tokens: u64) {
        self.inputs.truncate(k);
        self.inputs.push(tokens);
        self.last_input = tokens;
    }

    /// The input of turn `k` (0 if none was recorded).
    fn input(&self, k: usize) -> u64 {
        if self.inputs.len() == k + 1 {
            self.last_input
        } else {
            self.inputs.get(k).copied().unwrap_or(0)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Loc {
    Engine(u32),
    Transfer(u32),
    Cpu(u32, u64),
    Serverless(u32),
}

#[derive(Debug, Clone)]
enum Event {
    Wake(u32, u64),
    Done(StageId, StageOutcome),
    Failed(StageId),
    KvArrived(Box<KvArrival>),
    TrainDone(BatchId, bool),
    WeightsDone(u32, u64, u64),
    Fail,
    Recover(u32),
    LosePool,
    LoseReplica(u32),
    Migrate,
}

#[derive(Debug, Clone)]
struct KvArrival {
    replica: u32,
    epoch: u64,
    stage: StageId,
    traj: TrajId,
    from: u32,
    context: u64,
    prefill: u64,
    action: u64,
}

#[derive(Debug, Clone, Default)]
struct ServerlessState {
    in_use: u64,
    concurrency: u64,
    idle: Vec<Time>,
    cold_starts: u64,
    invocations: u64,
    cold_start_s: f64,
}

/// Why a run could not complete.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The core could not be configured.
    #[error(transparent)]
    Config(#[from] rollfleet_core::ConfigError),
    /// Nothing left to happen, yet steps remain.
    #[error("the simulation stalled at {at:.1} s with {trained} of {steps} steps trained: {state}")]
    Stalled {
        /// Where the core's work was.
        state: String,
        /// Virtual time.
        at: f64,
        /// Steps trained.
        trained: u64,
        /// Steps wanted.
        steps: u64,
    },
    /// The re-planner could not start.
    #[error("re-planning on drift: {0}")]
    Replan(String),
    /// The virtual-time limit was reached.
    #[error("the simulation passed its limit of {0:.0} virtual seconds")]
    TooLong(f64),
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Virtual seconds from start to the last published version.
    pub makespan_s: f64,
    /// Times at which each version was published.
    pub publish_times_s: Vec<f64>,
    /// The core's counters.
    pub core: rollfleet_core::Stats,
    /// Busy GPU-seconds (or vCPU-seconds, or concurrency-seconds) per spec pool, with timeline.
    pub meters: BTreeMap<u32, Meter>,
    /// Capacity per spec pool (GPUs, vCPUs, concurrency) for utilisation.
    pub capacity: BTreeMap<u32, f64>,
    /// Seconds replicas spent loading weights, per spec pool.
    pub sync_seconds: BTreeMap<u32, f64>,
    /// Useful work of the trained trajectories.
    pub work: Work,
    /// Trajectories trained on.
    pub trajectories: u64,
    /// Tokens trained on.
    pub trained_tokens: u64,
    /// Tokens generated (including thrown-away ones).
    pub generated_tokens: u64,
    /// Staleness histogram by the simulator's own books.
    pub staleness_histogram: Vec<u64>,
    /// Invariant breaches seen (empty when all held).
    pub violations: Vec<String>,
    /// Inputs and timeouts handled by the core.
    pub scheduler_events: u64,
    /// All simulation events processed.
    pub sim_events: u64,
    /// Serverless cold starts.
    pub cold_starts: u64,
    /// The placement used.
    pub placement: Placement,
    /// Trajectories started, in flight at the end, complete but untrained at the end.
    pub lifecycle: (u64, u64, u64),
    /// The staleness bound the policy kept (versions).
    pub max_staleness: u64,
    /// Every prefill batch and decode iteration the simulated replicas ran, as measured
    /// profile samples per (work kind, pool): what workers would report.
    pub profiles: ProfileStore,
    /// The pool loss, if one was asked for and happened.
    pub loss: Option<LossReport>,
    /// The migration, if one was asked for and started.
    pub migration: Option<MigrationReport>,
    /// The re-plans on drift, in order.
    pub drift_replans: Vec<crate::drift::DriftReplan>,
}

struct Sim<'a> {
    spec: &'a JobSpec,
    opts: &'a SimOptions,
    core: Core,
    now: Time,
    heap: EventQueue<Event>,
    engines: Vec<Engine>,
    engine_pool: Vec<u32>,
    engine_max_seqs: Vec<u32>,
    engine_running: Vec<u32>,
    engine_scheduled: Vec<Option<Time>>,
    engine_busy: Vec<bool>,
    engine_alive: Vec<bool>,
    engine_role: Vec<ServeRole>,
    /// Replicas the core was told to retire (never chosen again).
    engine_retiring: Vec<bool>,
    /// Peak FLOP/s and bytes/s of one GPU, per GPU pool (for replicas started mid-run).
    pool_peaks: BTreeMap<u32, (f64, f64)>,
    /// The wave under way and the replicas it waits for.
    migration_wave: Option<(usize, BTreeSet<u32>)>,
    /// The waves of the migration under way.
    active_waves: Vec<MigrationWave>,
    /// Every migration started, in order; the one under way; the one of the options.
    migrations: Vec<MigrationReport>,
    active_migration: Option<usize>,
    options_migration: Option<usize>,
    catalog: &'a Catalog,
    drift: Option<crate::drift::DriftWatch>,
    /// Which migration each re-plan on drift started.
    drift_migrations: Vec<(usize, usize)>,
    /// The version that prefilled a trajectory's pulled KV cache, until its generation starts
    /// (looked up, never iterated: a hash map, see [`IdHasher`]).
    prefill_versions: HashMap<TrajId, u64, BuildHasherDefault<IdHasher>>,
    /// Every stage the simulated workers were given, by id: one slab, so that a stage's
    /// start and end each touch one entry.
    stages: IdSlab<StageState>,
    /// Busy level per spec pool, indexed by pool (looked up on most events; a map only in the
    /// result).
    meters: Vec<Meter>,
    capacity: BTreeMap<u32, f64>,
    sync_seconds: BTreeMap<u32, f64>,
    /// Milli-vCPUs in use per spec pool, indexed by pool (grown on first use).
    cpu_in_use: Vec<u64>,
    serverless: BTreeMap<u32, ServerlessState>,
    ledger: Vec<TrajLedger>,
    version: u64,
    publish_times: Vec<f64>,
    work: Work,
    trained_tokens: u64,
    trajectories: u64,
    staleness: Vec<u64>,
    violations: Vec<String>,
    scheduler_events: u64,
    sim_events: u64,
    trainer_pool: u32,
    /// GPUs the trainer runs its next batch on (a migration can resize it).
    trainer_gpus: f64,
    /// GPUs the batch in training runs on.
    training_gpus: f64,
    train_peak: f64,
    costs: ModelCosts,
    link_bytes_per_s: f64,
    interconnect: f64,
    cold_start_s: BTreeMap<u32, f64>,
    failure_rng: SplitMix64,
    rates: LatencyRates,
    traces: Vec<TurnTrace>,
    /// Per task (spec order), its distributions ready to draw from.
    samplers: Vec<TaskSamplers<'a>>,
    /// What an engine's wake-up finished (kept between wake-ups for its allocation).
    done: Vec<EngineDone>,
    /// Distinct names of the engines' pools (`""` for an unknown pool), and each engine's.
    pool_names: Vec<String>,
    engine_pool_name: Vec<usize>,
    /// Measured shares of peak by work kind and index in `pool_names`: a short list in place
    /// of the profile store's maps of names, in the order of their first samples.
    estimates: Vec<(WorkKind, usize, Estimate)>,
    /// Per pool name and work kind (`name * WorkKind::ALL.len() + kind`), the index of its
    /// entry in `estimates` (`u32::MAX` before its first sample): one look per sample instead
    /// of a search of the list.
    estimate_index: Vec<u32>,
    /// Measured seconds of an environment step, per task (spec order), and of a reward, per
    /// reward function (spec order): the profiles' timed work.
    env_step_estimates: Vec<Estimate>,
    reward_estimates: Vec<Estimate>,
    loss: Option<LossReport>,
}

/// The index of spec pool `pool`'s name in `names`, added if it is not there yet.
fn pool_name_index(names: &mut Vec<String>, spec: &JobSpec, pool: u32) -> usize {
    let name = spec
        .pools
        .get(pool as usize)
        .map_or("", |p| p.name.as_str());
    match names.iter().position(|n| n == name) {
        Some(i) => i,
        None => {
            names.push(name.to_owned());
            names.len() - 1
        }
    }
}

/// A replica's engine, from its configuration and its pool's GPU.
fn engine_for(
    rc: &ReplicaConfig,
    peaks: (f64, f64),
    hardware: &HardwareModel,
    costs: ModelCosts,
) -> Engine {
    Engine::new(
        rc.gpus,
        peaks.0,
        peaks.1,
        hardware,
        costs,
        rc.kv_capacity_tokens,
    )
}

/// A task's distributions drawn from on every turn, ready to draw from.
#[derive(Debug, Clone, Copy)]
struct TaskSamplers<'a> {
    env_step: Sampler<'a>,
    prompt: Sampler<'a>,
    observation: Sampler<'a>,
    action: Sampler<'a>,
}

#[derive(Debug, Clone, Copy)]
struct StageInfo {
    traj: TrajId,
    turn: u32,
    attempt: u32,
    version: u64,
}

/// A stage as the simulator tracks it: what it is, and where it runs (`None` until it was
/// placed, or when it never was: a stage naming an unknown task or replica).
#[derive(Debug, Clone, Copy)]
struct StageState {
    info: StageInfo,
    loc: Option<Loc>,
}

impl<'a> Sim<'a> {
    fn push(&mut self, at: Time, event: Event) {
        self.heap.push(at, event);
    }

    /// Where a stage runs.
    fn set_loc(&mut self, stage: StageId, loc: Loc) {
        if let Some(s) = self.stages.get_mut(stage.0) {
            s.loc = Some(loc);
        }
    }

    /// Whether a stage is placed and not yet over.
    fn placed(&self, stage: StageId) -> bool {
        self.stages.get(stage.0).is_some_and(|s| s.loc.is_some())
    }

    /// Ends a placed stage: forgets it and returns where it ran with what it was (`None` if it
    /// is not placed, e.g. already over).
    fn end_stage(&mut self, stage: StageId) -> Option<(Loc, StageInfo)> {
        let s = self.stages.remove_if(stage.0, |s| s.loc.is_some())?;
        Some((s.loc?, s.info))
    }

    /// A trajectory's books (made on first use). Inlined where it is called, several times
    /// per stage, with the rare growth of the table kept out of line.
    #[inline]
    fn ledger_mut(&mut self, traj: TrajId) -> &mut TrajLedger {
        let i = traj.0 as usize;
        if self.ledger.len() <= i {
            self.grow_ledger(i);
        }
        &mut self.ledger[i]
    }

    #[cold]
    #[inline(never)]
    fn grow_ledger(&mut self, i: usize) {
        self.ledger.resize_with(i + 1, TrajLedger::default);
    }

    fn violation(&mut self, what: String) {
        if self.violations.len() < 20 {
            self.violations.push(what);
        } else if self.violations.len() == 20 {
            self.violations.push("(more violations not listed)".into());
        }
    }

    fn rng(&self, keys: &[u64]) -> SplitMix64 {
        SplitMix64::keyed(self.opts.seed, keys)
    }

    fn task(&self, index: u32) -> Option<(&'a rollfleet_spec::TaskSpec, TaskSamplers<'a>)> {
        Some((
            self.spec.tasks.get(index as usize)?,
            *self.samplers.get(index as usize)?,
        ))
    }

    fn input(&mut self, input: Input) {
        self.scheduler_events += 1;
        self.core.handle_input(self.now, input);
    }

    /// Moves the engine's measured durations into the estimates of its pool (the profile
    /// store is built from them at the end, see [`Sim::profiles`]).
    fn drain_samples(&mut self, r: usize) {
        let e = &mut self.engines[r];
        if e.measured.is_empty() {
            return;
        }
        let name = self.engine_pool_name[r];
        for m in e.measured.drain(..) {
            // Created by the first usable sample, as `ProfileStore::record` does.
            if !(m.seconds.is_finite() && m.seconds > 0.0) {
                continue;
            }
            let at = name * WorkKind::ALL.len() + m.kind as usize;
            if self.estimate_index.len() <= at {
                self.estimate_index.resize(at + 1, u32::MAX);
            }
            let i = match self.estimate_index[at] {
                u32::MAX => {
                    self.estimates.push((m.kind, name, Estimate::default()));
                    self.estimate_index[at] = (self.estimates.len() - 1) as u32;
                    self.estimates.len() - 1
                }
                i => i as usize,
            };
            self.estimates[i].2.add_measured(
                m.kind,
                m.work,
                e.peak_flops,
                e.peak_bandwidth,
                m.seconds,
                // The simulator's durations are its own roofline's.
                Origin::Modelled,
            );
        }
    }

    /// The measured durations of environment steps and rewards, by task and reward function.
    fn timed_profiles(&self, store: &mut ProfileStore) {
        let named = |estimates: &[Estimate], names: Vec<&String>| {
            names
                .into_iter()
                .zip(estimates)
                .filter(|(_, e)| e.total > 0)
                .map(|(n, e)| (n.clone(), e.clone()))
                .collect()
        };
        let tasks = self.spec.tasks.iter().map(|t| &t.name).collect();
        store.environment_steps = named(&self.env_step_estimates, tasks);
        let rewards = self.spec.rewards.iter().map(|r| &r.name).collect();
        store.rewards = named(&self.reward_estimates, rewards);
    }

    /// The measured profiles so far (the estimates stay).
    fn profiles_now(&self) -> ProfileStore {
        let mut store = ProfileStore::default();
        self.timed_profiles(&mut store);
        for (kind, name, estimate) in &self.estimates {
            let pool = self.pool_names.get(*name).map_or("", String::as_str);
            store
                .measured
                .entry(*kind)
                .or_default()
                .insert(pool.to_owned(), estimate.clone());
        }
        store
    }

    /// The measured profiles, by work kind and pool name: what `ProfileStore::record` of every
    /// sample in turn would have built (the samples of a kind and pool reach one estimate in the
    /// same order).
    fn profiles(&mut self) -> ProfileStore {
        let mut store = ProfileStore::default();
        self.timed_profiles(&mut store);
        self.estimate_index.clear();
        for (kind, name, estimate) in self.estimates.drain(..) {
            let pool = self.pool_names.get(name).map_or("", String::as_str);
            store
                .measured
                .entry(kind)
                .or_default()
                .insert(pool.to_owned(), estimate);
        }
        store
    }

    fn refresh_engine(&mut self, r: usize) {
        self.drain_samples(r);
        let busy = self.engines[r].busy();
        if busy != self.engine_busy[r] {
            self.engine_busy[r] = busy;
            let gpus = self.engines[r].gpus as f64;
            let now = self.now;
            if let Some(m) = self.meters.get_mut(self.engine_pool[r] as usize) {
                m.add(now, if busy { gpus } else { -gpus });
            }
        }
        // At most one live wake-up per engine, the earliest needed: a later one is pushed when
        // the earlier one fires, so superseded wake-ups do not pile up in the event queue.
        let next = self.engines[r].next_wake();
        let push = match (next, self.engine_scheduled[r]) {
            (Some(n), Some(s)) => n < s,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if push && let Some(at) = next {
            self.engine_scheduled[r] = next;
            let epoch = self.engines[r].epoch;
            self.push(at.max(self.now), Event::Wake(r as u32, epoch));
        }
    }

    fn execute(&mut self, command: Command) {
        match command {
            Command::Run(cmd) => self.run_stage(cmd),
            Command::UpdateWeights {
                replica,
                version,
                bytes,
                mode,
            } => {
                let r = replica.0 as usize;
                if r >= self.engines.len() {
                    return;
                }
                if self.engine_running[r] > 0 {
                    self.violation(format!("replica {r} updated while running stages"));
                }
                let now = self.now;
                self.engines[r].wipe(now);
                self.engine_scheduled[r] = None;
                self.engines[r].version = None;
                self.refresh_engine(r);
                let secs = match mode {
                    SyncMode::Rolling | SyncMode::Broadcast => bytes as f64 / self.link_bytes_per_s,
                    SyncMode::Colocated => {
                        // Resharding inside the node over NVLink.
                        bytes as f64 / self.interconnect.max(1.0)
                    }
                };
                *self.sync_seconds.entry(self.engine_pool[r]).or_default() +=
                    secs * self.engines[r].gpus as f64;
                let epoch = self.engines[r].epoch;
                self.push(
                    now.plus(Span::from_secs_f64(secs)),
                    Event::WeightsDone(r as u32, version, epoch),
                );
            }
            Command::ReleaseKv { replica, traj } => {
                if let Some(e) = self.engines.get_mut(replica.0 as usize) {
                    e.release_kv(traj);
                }
            }
            Command::Cancel { stage } => self.cancel(stage),
            Command::Interrupt { stage } => self.interrupt(stage),
            // The simulator fails no stage of its own accord, so no group is ever given up;
            // were one, its stages' cancels above already freed what they held.
            Command::AbandonGroup { .. } => {}
            Command::ReplicaRetired { replica } => {
                let r = replica.0 as usize;
                if r < self.engines.len() {
                    // Its GPUs are free; nothing of it is chosen again.
                    self.engine_alive[r] = false;
                    if let Some(m) = self.migration_report() {
                        m.retired += 1;
                    }
                    self.migration_progress(r as u32);
                }
            }
            Command::Train {
                batch,
                publishes,
                trajectories,
                tokens,
                ..
            } => self.train(batch, publishes, trajectories, tokens),
        }
    }

    /// Cuts a generation where it is (its replica is due for new weights) and reports the
    /// tokens it had generated; one still pulling its KV cache had generated none.
    fn interrupt(&mut self, stage: StageId) {
        let on_engine = self
            .stages
            .get(stage.0)
            .is_some_and(|s| matches!(s.loc, Some(Loc::Engine(_) | Loc::Transfer(_))));
        if !on_engine {
            return;
        }
        let Some((Loc::Engine(r) | Loc::Transfer(r), info)) = self.end_stage(stage) else {
            return;
        };
        let r = r as usize;
        let now = self.now;
        let tokens = self.engines[r].cancel(now, stage).unwrap_or(0);
        self.engines[r].release_kv(info.traj);
        self.engine_running[r] = self.engine_running[r].saturating_sub(1);
        self.refresh_engine(r);
        let l = self.ledger_mut(info.traj);
        let kept = match l.partial {
            Some(p) if p.turn == info.turn && p.attempt == info.attempt => p,
            _ => PartialWork {
                turn: info.turn,
                attempt: info.attempt,
                version: info.version,
                tokens: 0,
            },
        };
        l.partial = Some(PartialWork {
            version: kept.version.min(info.version),
            tokens: kept.tokens + tokens,
            ..kept
        });
        self.input(Input::StageFinished {
            stage,
            outcome: StageOutcome::Interrupted { tokens },
        });
    }

    fn cancel(&mut self, stage: StageId) {
        let Some((loc, info)) = self.end_stage(stage) else {
            return;
        };
        let now = self.now;
        match loc {
            Loc::Engine(r) | Loc::Transfer(r) => {
                let r = r as usize;
                self.engines[r].cancel(now, stage);
                self.engines[r].release_kv(info.traj);
                self.engine_running[r] = self.engine_running[r].saturating_sub(1);
                self.refresh_engine(r);
            }
            cpu_or_serverless => self.release_loc(cpu_or_serverless),
        }
    }

    fn cpu_take(&mut self, pool: u32, millicpus: u64) {
        let p = pool as usize;
        if self.cpu_in_use.len() <= p {
            self.cpu_in_use.resize(p + 1, 0);
        }
        self.cpu_in_use[p] += millicpus;
        let used = self.cpu_in_use[p];
        let cap = self.capacity.get(&pool).copied().unwrap_or(0.0);
        if used as f64 > cap * 1000.0 + 0.5 {
            self.violation(format!(
                "CPU pool {pool}: {used} millicpus in use > {cap} vCPUs"
            ));
        }
        let now = self.now;
        if let Some(m) = self.meters.get_mut(pool as usize) {
            m.add(now, millicpus as f64 / 1000.0);
        }
    }

    fn cpu_release(&mut self, pool: u32, millicpus: u64) {
        if let Some(used) = self.cpu_in_use.get_mut(pool as usize) {
            *used = used.saturating_sub(millicpus);
        }
        let now = self.now;
        if let Some(m) = self.meters.get_mut(pool as usize) {
            m.add(now, -(millicpus as f64) / 1000.0);
        }
    }

    fn run_stage(&mut self, cmd: StageCommand) {
        let StageCommand {
            stage,
            traj,
            group,
            task,
            turn,
            attempt,
            work,
            ..
        } = cmd;
        self.stages.insert(
            stage.0,
            StageState {
                info: StageInfo {
                    traj,
                    turn,
                    attempt,
                    version: 0,
                },
                loc: None,
            },
        );
        let ledger = self.ledger_mut(traj);
        ledger.group = group.0;
        ledger.task = task;
        let Some((task_spec, samplers)) = self.task(task) else {
            self.violation(format!("stage {} names unknown task {task}", stage.0));
            return;
        };
        let now = self.now;
        match work {
            StageWork::EnvReset { pool, millicpus }
            | StageWork::EnvStep {
                pool, millicpus, ..
            } => {
                let reset = matches!(work, StageWork::EnvReset { .. });
                self.cpu_take(pool, millicpus);
                self.set_loc(stage, Loc::Cpu(pool, millicpus));
                let ms = samplers.env_step.sample(&mut self.rng(&[
                    stream::ENV_LATENCY,
                    traj.0,
                    turn as u64,
                    attempt as u64,
                    reset as u64,
                ]));
                let at = now.plus(Span::from_secs_f64(ms / 1000.0));
                let fails = self.rng(&[stream::ENV_FAILURE, stage.0]).next_f64()
                    < task_spec.env_failure_rate.clamp(0.0, 1.0);
                if fails {
                    self.push(at, Event::Failed(stage));
                    return;
                }
                if !reset && let Some(e) = self.env_step_estimates.get_mut(task as usize) {
                    e.add_seconds(ms / 1000.0, Origin::Modelled);
                }
                let cpu_s = ms / 1000.0 * millicpus as f64 / 1000.0;
                // The episode's length is a draw of its own stream (by trajectory only), the same
                // whenever it is drawn: drawn at the reset, it sizes the books before their
                // first entries instead of moving them once they have some.
                let seed = self.opts.seed;
                let wanted = *self.ledger_mut(traj).turns_wanted.get_or_insert_with(|| {
                    let max = task_spec.max_turns.max(1) as f64;
                    let t = task_spec.turns.as_ref().map_or(max, |d| {
                        sample(d, &mut SplitMix64::keyed(seed, &[stream::TURNS, traj.0])).round()
                    });
                    t.clamp(1.0, max) as u32
                });
                // Room for every turn the episode will have, so its books grow once; an episode
                // longer than any measured one grows them as it goes instead of asking up front.
                if let Some(l) = Some(self.ledger_mut(traj)) {
                    let wanted = wanted.min(MAX_TURNS_RESERVED);
                    let more = (wanted as usize + 1).saturating_sub(l.turns.len());
                    l.turns.reserve(more);
                    let more = (wanted as usize + 1).saturating_sub(l.inputs.len());
                    l.inputs.reserve(more);
                }
                let outcome = if reset {
                    let tokens = samplers
                        .prompt
                        .sample(&mut self.rng(&[stream::PROMPT, group.0]))
                        .round()
                        .max(1.0) as u64;
                    if let Some(l) = Some(self.ledger_mut(traj)) {
                        l.reset_cpu_s = cpu_s;
                        l.set_input(0, tokens);
                    }
                    StageOutcome::Observed {
                        tokens,
                        done: false,
                    }
                } else {
                    let tokens = samplers
                        .observation
                        .sample(&mut self.rng(&[stream::OBSERVATION, traj.0, turn as u64]))
                        .round() as u64;
                    if let Some(l) = Some(self.ledger_mut(traj)) {
                        // Turns beyond this one belong to an attempt that was thrown away.
                        l.truncate_turns(turn as usize);
                        if let Some(last) = (turn as usize)
                            .checked_sub(1)
                            .and_then(|k| l.turns.get_mut(k))
                        {
                            last.env_cpu_s = cpu_s;
                            last.env_s = ms / 1000.0;
                        }
                        l.set_input(turn as usize, tokens);
                    }
                    StageOutcome::Observed {
                        tokens,
                        done: turn >= wanted,
                    }
                };
                self.push(at, Event::Done(stage, outcome));
            }
            StageWork::Prefill { replica, tokens } => {
                let r = replica.0 as usize;
                if !self.engine_ok(r, stage) {
                    return;
                }
                self.engine_running[r] += 1;
                self.check_slots(r);
                if !self.engines[r].hold_kv(traj, tokens) {
                    self.violation(format!("replica {r}: KV over capacity after a prefill"));
                }
                self.set_loc(stage, Loc::Engine(r as u32));
                self.engines[r].add_prefill(
                    now,
                    PrefillJob {
                        stage,
                        traj,
                        cached: 0,
                        tokens,
                        decode: None,
                    },
                );
                self.refresh_engine(r);
            }
            StageWork::Generate {
                replica,
                cached_tokens,
                prefill_tokens,
                max_new_tokens,
                kv_from,
                kv_tokens,
            } => {
                let r = replica.0 as usize;
                if !self.engine_ok(r, stage) {
                    return;
                }
                // A resumed turn generates what its draw has left after its interrupted part.
                let already = self.ledger_mut(traj).partial_tokens(turn, attempt) as f64;
                let action = (samplers
                    .action
                    .sample(&mut self.rng(&[stream::ACTION, traj.0, turn as u64, attempt as u64]))
                    .round()
                    - already)
                    .clamp(1.0, max_new_tokens.max(1) as f64) as u64;
                if kv_from.is_none()
                    && cached_tokens > 0
                    && !self.engines[r].kv_held.contains_key(&traj)
                {
                    self.violation(format!("replica {r}: sticky turn without its KV cache"));
                }
                self.engine_running[r] += 1;
                self.check_slots(r);
                if !self.engines[r].hold_kv(traj, cached_tokens + prefill_tokens + action) {
                    self.violation(format!(
                        "replica {r}: KV over capacity ({} > {})",
                        self.engines[r].kv_used, self.engines[r].kv_capacity
                    ));
                }
                match kv_from {
                    Some(p) => {
                        self.set_loc(stage, Loc::Transfer(r as u32));
                        let secs = kv_tokens as f64 * self.costs.kv_bytes_per_token
                            / self.link_bytes_per_s;
                        let epoch = self.engines[r].epoch;
                        self.push(
                            now.plus(Span::from_secs_f64(secs)),
                            Event::KvArrived(Box::new(KvArrival {
                                replica: r as u32,
                                epoch,
                                stage,
                                traj,
                                from: p.0 as u32,
                                context: cached_tokens,
                                prefill: prefill_tokens,
                                action,
                            })),
                        );
                    }
                    None => {
                        self.set_loc(stage, Loc::Engine(r as u32));
                        self.start_generation(
                            r,
                            stage,
                            traj,
                            cached_tokens,
                            prefill_tokens,
                            action,
                            false,
                        );
                    }
                }
            }
            StageWork::Reward {
                pool,
                serverless,
                millicpus,
            } => {
                let reward = self
                    .spec
                    .rewards
                    .iter()
                    .position(|rw| rw.name == task_spec.reward);
                let latency = reward.map_or(0.0, |i| {
                    sample(
                        &self.spec.rewards[i].latency_ms,
                        &mut self.rng(&[stream::REWARD, traj.0, attempt as u64]),
                    ) / 1000.0
                });
                // The function's own latency; a cold start is modelled apart (below).
                if let Some(e) = reward.and_then(|i| self.reward_estimates.get_mut(i)) {
                    e.add_seconds(latency, Origin::Modelled);
                }
                let mut secs = latency;
                if serverless {
                    let keepalive = self.opts.hardware.serverless_keepalive_s;
                    let cold = self.serverless_cold_start(pool);
                    let mut violation = None;
                    if let Some(s) = self.serverless.get_mut(&pool) {
                        s.in_use += 1;
                        s.invocations += 1;
                        if s.in_use > s.concurrency {
                            violation =
                                Some(format!("serverless pool {pool} over its concurrency"));
                        }
                        // Reuse the most recently idle warm instance, if still warm.
                        s.idle.retain(|&t| now.since(t).as_secs_f64() <= keepalive);
                        if s.idle.pop().is_none() {
                            s.cold_starts += 1;
                            s.cold_start_s += cold;
                            secs += cold;
                        }
                    }
                    if let Some(v) = violation {
                        self.violation(v);
                    }
                    if let Some(m) = self.meters.get_mut(pool as usize) {
                        m.add(now, 1.0);
                    }
                    self.set_loc(stage, Loc::Serverless(pool));
                } else {
                    self.cpu_take(pool, millicpus);
                    self.set_loc(stage, Loc::Cpu(pool, millicpus));
                }
                if let Some(l) = Some(self.ledger_mut(traj)) {
                    l.reward_s = latency;
                }
                self.push(
                    now.plus(Span::from_secs_f64(secs)),
                    Event::Done(stage, StageOutcome::Rewarded { score: 0.0 }),
                );
            }
        }
    }

    fn serverless_cold_start(&self, pool: u32) -> f64 {
        self.cold_start_s.get(&pool).copied().unwrap_or(0.25)
    }

    fn engine_ok(&mut self, r: usize, stage: StageId) -> bool {
        if r >= self.engines.len() {
            self.violation(format!("stage {} sent to unknown replica {r}", stage.0));
            return false;
        }
        if !self.engine_alive[r] || self.engines[r].version.is_none() {
            self.violation(format!(
                "stage {} sent to replica {r}, which cannot serve",
                stage.0
            ));
        }
        true
    }

    fn check_slots(&mut self, r: usize) {
        if self.engine_running[r] > self.engine_max_seqs[r] {
            self.violation(format!("replica {r}: more stages than batch slots"));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start_generation(
        &mut self,
        r: usize,
        stage: StageId,
        traj: TrajId,
        cached: u64,
        prefill: u64,
        action: u64,
        pulled: bool,
    ) {
        let now = self.now;
        let version = self.engines[r].version.unwrap_or(0);
        // A pulled KV cache was computed by the prefill replica's version.
        let prefilled = self.prefill_versions.remove(&traj);
        let v = if pulled {
            prefilled.map_or(version, |p| p.min(version))
        } else {
            version
        };
        if let Some(s) = self.stages.get_mut(stage.0) {
            s.info.version = v;
        }
        if prefill > 0 {
            self.engines[r].add_prefill(
                now,
                PrefillJob {
                    stage,
                    traj,
                    cached,
                    tokens: prefill,
                    decode: Some(action),
                },
            );
        } else {
            self.engines[r].add_decode(now, stage, cached, action);
        }
        self.refresh_engine(r);
    }

    fn train(&mut self, batch: BatchId, publishes: bool, trajectories: Vec<TrajId>, tokens: u64) {
        // Independent checks: no trajectory twice, whole groups, staleness by our own books.
        let floor = self
            .version
            .saturating_sub(self.core.config().policy.max_staleness);
        let mut groups: BTreeMap<u64, u32> = BTreeMap::new();
        let costs = self.costs;
        let mut violations = Vec::new();
        for &t in &trajectories {
            let Some(l) = self.ledger.get_mut(t.0 as usize) else {
                violations.push(format!("trajectory {} trained but never run", t.0));
                continue;
            };
            if l.consumed {
                violations.push(format!("trajectory {} trained twice", t.0));
            }
            l.consumed = true;
            *groups.entry(l.group).or_default() += 1;
            let oldest = l.turns.iter().map(|w| w.version).min();
            match oldest {
                Some(v) if v < floor => violations.push(format!(
                    "trajectory {} trained with a turn of version {v} at version {}",
                    t.0, self.version
                )),
                None => violations.push(format!("trajectory {} trained with no turns", t.0)),
                _ => {}
            }
            let staleness = oldest.map_or(0, |v| self.version.saturating_sub(v)) as usize;
            if self.staleness.len() <= staleness {
                self.staleness.resize(staleness + 1, 0);
            }
            self.staleness[staleness] += 1;
            // Useful work, for the bound.
            self.work.add_trajectory(
                self.spec,
                &costs,
                &self.rates,
                self.version as usize,
                l,
                &mut self.traces,
            );
        }
        let n = self.core.config().group_size;
        for (g, count) in groups {
            if count != n {
                violations.push(format!(
                    "group {g} trained with {count} of {n} trajectories"
                ));
            }
        }
        for v in violations {
            self.violation(v);
        }
        self.trajectories += trajectories.len() as u64;
        self.trained_tokens += tokens;
        let mfu = self.spec.rl.train_mfu.clamp(0.01, 1.0);
        let secs = 6.0 * self.spec.model.active() * tokens as f64
            / (self.trainer_gpus * self.train_peak * mfu);
        let now = self.now;
        let gpus = self.trainer_gpus;
        self.training_gpus = gpus;
        if let Some(m) = self.meters.get_mut(self.trainer_pool as usize) {
            m.add(now, gpus);
        }
        self.push(
            now.plus(Span::from_secs_f64(secs)),
            Event::TrainDone(batch, publishes),
        );
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Wake(r, epoch) => {
                let r = r as usize;
                if self.engines[r].epoch != epoch || self.engine_scheduled[r] != Some(self.now) {
                    return;
                }
                self.engine_scheduled[r] = None;
                if self.engines[r].next_wake().is_none_or(|n| n > self.now) {
                    // Woken early (its work moved later): just ask again for the right time.
                    self.refresh_engine(r);
                    return;
                }
                // One buffer for every wake-up, instead of a fresh vector each time.
                let mut done = std::mem::take(&mut self.done);
                self.engines[r].wake_into(self.now, &mut done);
                self.refresh_engine(r);
                for d in done.drain(..) {
                    let (stage, outcome) = match d {
                        EngineDone::Prefilled(stage) => {
                            if let Some(info) = self.stages.get(stage.0).map(|s| s.info) {
                                let v = self.engines[r].version.unwrap_or(0);
                                self.prefill_versions.insert(info.traj, v);
                            }
                            (stage, StageOutcome::Prefilled)
                        }
                        EngineDone::Generated(stage, tokens) => {
                            if let Some(info) = self
                                .stages
                                .get(stage.0)
                                .filter(|s| s.loc.is_some())
                                .map(|s| s.info)
                            {
                                let l = self.ledger_mut(info.traj);
                                let k = info.turn as usize;
                                l.truncate_turns(k);
                                // Each turn's context is the one before it plus what it added;
                                // a resumed turn is as old as its oldest part.
                                let context_before = l.context_end;
                                let input = l.input(k);
                                let (version, action) = match l.partial.take() {
                                    Some(p) if p.turn == info.turn && p.attempt == info.attempt => {
                                        (p.version.min(info.version), p.tokens + tokens)
                                    }
                                    _ => (info.version, tokens),
                                };
                                l.push_turn(TurnWork {
                                    version,
                                    context_before,
                                    input,
                                    action,
                                    env_cpu_s: 0.0,
                                    env_s: 0.0,
                                });
                            }
                            (stage, StageOutcome::Generated { tokens })
                        }
                    };
                    if self.end_stage(stage).is_some() {
                        self.engine_running[r] = self.engine_running[r].saturating_sub(1);
                        self.input(Input::StageFinished { stage, outcome });
                    }
                }
                self.done = done;
            }
            Event::Done(stage, outcome) => {
                let Some((loc, _)) = self.end_stage(stage) else {
                    return;
                };
                self.release_loc(loc);
                self.input(Input::StageFinished { stage, outcome });
            }
            Event::Failed(stage) => {
                let Some((loc, _)) = self.end_stage(stage) else {
                    return;
                };
                self.release_loc(loc);
                self.input(Input::StageFailed { stage });
            }
            Event::KvArrived(arrival) => {
                let KvArrival {
                    replica,
                    epoch,
                    stage,
                    traj,
                    from,
                    context,
                    prefill,
                    action,
                } = *arrival;
                let r = replica as usize;
                if self.engines[r].epoch != epoch || !self.placed(stage) {
                    return;
                }
                if let Some(p) = self.engines.get_mut(from as usize) {
                    p.release_kv(traj);
                }
                self.set_loc(stage, Loc::Engine(replica));
                self.start_generation(r, stage, traj, context, prefill, action, true);
            }
            Event::TrainDone(batch, publishes) => {
                let now = self.now;
                let gpus = self.training_gpus;
                if let Some(m) = self.meters.get_mut(self.trainer_pool as usize) {
                    m.add(now, -gpus);
                }
                if publishes {
                    self.version += 1;
                    self.publish_times.push(now.as_secs_f64());
                }
                self.input(Input::TrainFinished { batch });
                if publishes {
                    self.on_publish();
                }
                // Its own event, so that the core's answer to the publication is carried out
                // before it hears of the loss, as with any other failure.
                if publishes
                    && self
                        .opts
                        .pool_loss
                        .is_some_and(|l| l.at_step == self.version)
                {
                    self.push(now, Event::LosePool);
                }
                // With a loss at the same step, the loss starts the migration once its replicas
                // are gone (`maybe_lose_pool`).
                let loss_now = self
                    .opts
                    .pool_loss
                    .is_some_and(|l| l.at_step == self.version);
                if publishes
                    && !loss_now
                    && self
                        .opts
                        .migration
                        .as_ref()
                        .is_some_and(|m| m.at_step == self.version)
                {
                    self.push(now, Event::Migrate);
                }
            }
            Event::WeightsDone(r, version, epoch) => {
                let ri = r as usize;
                if self.engines[ri].epoch != epoch || !self.engine_alive[ri] {
                    return;
                }
                self.engines[ri].version = Some(version);
                self.input(Input::WeightsUpdated {
                    replica: ReplicaId(r as u64),
                    version,
                });
                self.migration_progress(r);
            }
            Event::Fail => {
                let alive: Vec<usize> = (0..self.engines.len())
                    .filter(|&r| self.engine_alive[r])
                    .collect();
                if alive.len() > 1 {
                    let r = alive[self.failure_rng.below(alive.len() as u64) as usize];
                    let now = self.now;
                    self.lose_replica(r);
                    let back = now.plus(Span::from_secs_f64(self.opts.repair_s));
                    self.push(back, Event::Recover(r as u32));
                }
                self.schedule_failure();
            }
            Event::LosePool => self.maybe_lose_pool(),
            Event::Migrate => self.start_migration(),
            Event::LoseReplica(r) => {
                if self.engine_alive[r as usize] {
                    self.lose_replica(r as usize);
                }
            }
            Event::Recover(r) => {
                // A replica retired while it was down stays gone (the core ignores its return).
                if self.engine_retiring[r as usize] {
                    return;
                }
                self.engine_alive[r as usize] = true;
                self.input(Input::ReplicaRecovered {
                    replica: ReplicaId(r as u64),
                });
            }
        }
    }

    /// Takes replica `r` away: its engine forgets everything, its stages are gone, and the core
    /// is told (it reschedules the work).
    fn lose_replica(&mut self, r: usize) {
        let now = self.now;
        self.engine_alive[r] = false;
        self.engines[r].wipe(now);
        self.engine_scheduled[r] = None;
        self.engines[r].version = None;
        self.engine_running[r] = 0;
        let lost: Vec<StageId> = self
            .stages
            .iter()
            .filter(|(_, s)| {
                matches!(s.loc, Some(Loc::Engine(x) | Loc::Transfer(x)) if x as usize == r)
            })
            .map(|(s, _)| StageId(s))
            .collect();
        for s in lost {
            self.stages.remove(s.0);
        }
        self.refresh_engine(r);
        self.input(Input::ReplicaLost {
            replica: ReplicaId(r as u64),
        });
    }

    /// The pool loss of the options, if this publication is its step: the pool's serving
    /// replicas from the highest-numbered down, until they cover the lost share of its GPUs (a
    /// replica with any lost GPU is lost whole). They never come back (a replica down from an
    /// injected failure at that moment is skipped and does come back).
    fn maybe_lose_pool(&mut self) {
        let Some(loss) = self.opts.pool_loss else {
            return;
        };
        if self.version != loss.at_step || self.loss.is_some() {
            return;
        }
        let count = self
            .spec
            .pools
            .get(loss.pool as usize)
            .and_then(|p| p.count)
            .unwrap_or(0)
            .max(0) as f64;
        let serving: Vec<(u32, u32, bool)> = (0..self.engines.len())
            .map(|r| {
                (
                    self.engine_pool[r],
                    self.engines[r].gpus,
                    self.engine_alive[r],
                )
            })
            .collect();
        let (replicas, gpus) = crate::loss::replicas_lost(&serving, &loss, count);
        let now = self.now;
        for &r in &replicas {
            // One event each: the core's answer to one loss (work moved to the survivors) is
            // carried out before it hears of the next, as a real driver's would be.
            self.push(now, Event::LoseReplica(r));
        }
        // The re-plan after the loss, once its replicas are gone.
        if self
            .opts
            .migration
            .as_ref()
            .is_some_and(|m| m.at_step == self.version)
        {
            self.push(now, Event::Migrate);
        }
        self.loss = Some(LossReport {
            at_s: self.now.as_secs_f64(),
            replicas,
            gpus,
        });
    }

    /// Starts the migration of the options: the pools grow, and the first wave begins.
    fn start_migration(&mut self) {
        let Some(m) = self.opts.migration.as_ref() else {
            return;
        };
        if self.options_migration.is_some() {
            return;
        }
        // One migration at a time: a re-plan on drift under way finishes first.
        if self.active_migration.is_some() {
            let later = self.now.plus(Span::from_secs_f64(1.0));
            self.push(later, Event::Migrate);
            return;
        }
        for &(pool, gpus) in &m.added_gpus {
            *self.capacity.entry(pool).or_default() += gpus as f64;
        }
        let waves = m.waves.clone();
        self.options_migration = Some(self.begin_migration(waves));
    }

    /// Starts moving to a new placement by `waves`; returns the migration's index.
    fn begin_migration(&mut self, waves: Vec<MigrationWave>) -> usize {
        self.migrations.push(MigrationReport {
            at_s: self.now.as_secs_f64(),
            waves_done: 0,
            started: 0,
            retired: 0,
            done_at_s: None,
            trainer_gpus: None,
        });
        let index = self.migrations.len() - 1;
        self.active_migration = Some(index);
        self.active_waves = waves;
        self.start_wave(0);
        index
    }

    /// The migration under way.
    fn migration_report(&mut self) -> Option<&mut MigrationReport> {
        self.migrations.get_mut(self.active_migration?)
    }

    /// At a publication: slows the pool down if this is its step, and re-plans if a measured
    /// profile drifted (while no migration is under way).
    fn on_publish(&mut self) {
        let now = self.now;
        if let Some(slow) = self.opts.slowdown.filter(|s| s.at_step == self.version) {
            for r in 0..self.engines.len() {
                if self.engine_pool[r] == slow.pool {
                    self.engines[r].slow_down(now, slow.share);
                    self.refresh_engine(r);
                }
            }
        }
        if self.active_migration.is_some() {
            return;
        }
        let Some(mut watch) = self.drift.take() else {
            return;
        };
        for r in 0..self.engines.len() {
            self.drain_samples(r);
        }
        let profiles = self.profiles_now();
        let checked = watch.check(
            self.spec,
            self.catalog,
            &profiles,
            self.version,
            now.as_secs_f64(),
        );
        let replan = watch.replans.len().saturating_sub(1);
        self.drift = Some(watch);
        for (pool, kinds) in &checked.forget {
            for (kind, name, estimate) in &mut self.estimates {
                if kinds.contains(kind) && self.pool_names.get(*name) == Some(pool) {
                    estimate.restart();
                }
            }
        }
        if let Some(waves) = checked.waves.filter(|w| !w.is_empty()) {
            let index = self.begin_migration(waves);
            self.drift_migrations.push((replan, index));
        }
    }

    /// Starts wave `index` (or ends the migration if there is none): its replicas are added
    /// and its others retired; the wave waits for every one of them.
    fn start_wave(&mut self, index: usize) {
        let Some(wave) = self.active_waves.get(index).cloned() else {
            self.migration_wave = None;
            let now = self.now.as_secs_f64();
            if let Some(report) = self.migration_report() {
                report.done_at_s = Some(now);
            }
            self.active_migration = None;
            return;
        };
        let mut waiting = BTreeSet::new();
        for rc in &wave.start {
            let r = self.engines.len();
            let peaks = self
                .pool_peaks
                .get(&rc.pool)
                .copied()
                .unwrap_or((1e15, 1e12));
            self.engines
                .push(engine_for(rc, peaks, &self.opts.hardware, self.costs));
            self.engines[r].version = None;
            // A replica started on a slowed pool is as slow as the rest of it.
            if let Some(slow) = self
                .opts
                .slowdown
                .filter(|s| s.pool == rc.pool && self.version >= s.at_step)
            {
                let now = self.now;
                self.engines[r].slow_down(now, slow.share);
            }
            self.engine_pool.push(rc.pool);
            let name = pool_name_index(&mut self.pool_names, self.spec, rc.pool);
            self.engine_pool_name.push(name);
            self.engine_max_seqs.push(rc.max_seqs);
            self.engine_running.push(0);
            self.engine_scheduled.push(None);
            self.engine_busy.push(false);
            self.engine_alive.push(true);
            self.engine_role.push(rc.role);
            self.engine_retiring.push(false);
            waiting.insert(r as u32);
            if let Some(report) = self.migration_report() {
                report.started += 1;
            }
            self.input(Input::ReplicaAdded { config: rc.clone() });
        }
        for group in &wave.stop {
            let mut left = group.replicas;
            for r in (0..self.engines.len()).rev() {
                if left == 0 {
                    break;
                }
                let fits = self.engine_pool[r] == group.pool
                    && self.engine_role[r] == group.role
                    && self.engines[r].gpus == group.gpus;
                if !fits || self.engine_retiring[r] || waiting.contains(&(r as u32)) {
                    continue;
                }
                // A replica down from an injected failure comes back: retire a live one.
                if !self.engine_alive[r] {
                    continue;
                }
                self.engine_retiring[r] = true;
                waiting.insert(r as u32);
                left -= 1;
                self.input(Input::RetireReplica {
                    replica: ReplicaId(r as u64),
                });
            }
        }
        self.migration_wave = Some((index, waiting));
        // A wave with nothing to wait for ends at once.
        self.migration_progress(u32::MAX);
    }

    /// Replica `r` loaded its weights or was handed back: the wave may be over.
    fn migration_progress(&mut self, r: u32) {
        let Some((index, waiting)) = self.migration_wave.as_mut() else {
            return;
        };
        waiting.remove(&r);
        if waiting.is_empty() {
            let next = *index + 1;
            let resize = self.active_waves.get(*index).and_then(|w| w.trainer_gpus);
            if let Some(gpus) = resize {
                // Its GPUs change hands between training batches: the one running (if any)
                // finishes on the GPUs it started on.
                self.trainer_gpus = f64::from(gpus.max(1));
            }
            if let Some(report) = self.migration_report() {
                report.waves_done = next;
                if resize.is_some() {
                    report.trainer_gpus = resize;
                }
            }
            self.start_wave(next);
        }
    }

    fn release_loc(&mut self, loc: Loc) {
        let now = self.now;
        match loc {
            Loc::Cpu(pool, m) => self.cpu_release(pool, m),
            Loc::Serverless(pool) => {
                if let Some(s) = self.serverless.get_mut(&pool) {
                    s.in_use = s.in_use.saturating_sub(1);
                    s.idle.push(now);
                }
                if let Some(m) = self.meters.get_mut(pool as usize) {
                    m.add(now, -1.0);
                }
            }
            Loc::Engine(_) | Loc::Transfer(_) => {}
        }
    }

    fn schedule_failure(&mut self) {
        if let Some(mtbf) = self.opts.failure_mtbf_s.filter(|m| *m > 0.0) {
            let u = self.failure_rng.next_f64().max(1e-12);
            let at = self.now.plus(Span::from_secs_f64(-u.ln() * mtbf));
            self.push(at, Event::Fail);
        }
    }
}

/// Simulates one policy on a job.
pub fn simulate(
    spec: &JobSpec,
    catalog: &Catalog,
    placement: Placement,
    policy: Policy,
    opts: &SimOptions,
    progress: &mut dyn FnMut(u64, f64),
) -> Result<RunResult, RunError> {
    let cfg = Config::new(spec, catalog, &placement, policy, opts.seed)?;
    let steps = cfg.steps;
    let costs = model_costs(spec);
    let pool_peaks: BTreeMap<u32, (f64, f64)> = spec
        .pools
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let g = catalog.gpu(p.gpu.as_deref()?).ok()?;
            Some((i as u32, (g.peak_flops(), g.memory_bandwidth_bytes_per_s())))
        })
        .collect();
    let mut engines = Vec::new();
    let mut engine_pool = Vec::new();
    let mut engine_max_seqs = Vec::new();
    let mut engine_role = Vec::new();
    for rc in &placement.replicas {
        let peaks = pool_peaks.get(&rc.pool).copied().unwrap_or((1e15, 1e12));
        engines.push(engine_for(rc, peaks, &opts.hardware, costs));
        engine_pool.push(rc.pool);
        engine_max_seqs.push(rc.max_seqs);
        engine_role.push(rc.role);
    }
    let trainer_gpu = spec
        .pools
        .get(placement.trainer.pool as usize)
        .and_then(|p| p.gpu.as_deref())
        .and_then(|g| catalog.gpu(g).ok());
    let train_peak = trainer_gpu.map_or(1e15, |g| g.peak_flops());
    let interconnect = trainer_gpu.map_or(400e9, |g| g.interconnect_gbps * 1e9);
    let mut meters = Vec::new();
    let mut capacity = BTreeMap::new();
    let mut serverless = BTreeMap::new();
    for (i, pool) in spec.pools.iter().enumerate() {
        let i = i as u32;
        let cap = match pool.kind() {
            Some(PoolKind::Gpu) => pool.count.unwrap_or(0).max(0) as f64,
            Some(PoolKind::Cpu) => {
                let vcpus = pool
                    .cpu
                    .as_deref()
                    .and_then(|c| catalog.cpu_shape(c).ok())
                    .map_or(0, |s| s.vcpus);
                (vcpus as i64 * pool.count.unwrap_or(0).max(0)) as f64
            }
            Some(PoolKind::Serverless) => {
                let conc = cfg
                    .serverless_pools
                    .iter()
                    .find(|s| s.pool == i)
                    .map_or(1, |s| s.concurrency);
                serverless.insert(
                    i,
                    ServerlessState {
                        concurrency: conc,
                        ..ServerlessState::default()
                    },
                );
                conc as f64
            }
            None => 0.0,
        };
        capacity.insert(i, cap);
        meters.push(Meter::default());
    }
    let cold_start_s: BTreeMap<u32, f64> = spec
        .pools
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let platform = catalog.serverless(p.serverless.as_deref()?).ok()?;
            Some((i as u32, platform.cold_start_ms / 1000.0))
        })
        .collect();
    let n = engines.len();
    let mut pool_names: Vec<String> = Vec::new();
    let engine_pool_name: Vec<usize> = engine_pool
        .iter()
        .map(|&pool| pool_name_index(&mut pool_names, spec, pool))
        .collect();
    let mut sim = Sim {
        spec,
        opts,
        core: Core::new(cfg),
        now: Time::ZERO,
        heap: EventQueue::default(),
        engines,
        engine_pool,
        engine_max_seqs,
        engine_running: vec![0; n],
        engine_scheduled: vec![None; n],
        engine_busy: vec![false; n],
        engine_alive: vec![true; n],
        engine_role,
        engine_retiring: vec![false; n],
        pool_peaks,
        migration_wave: None,
        active_waves: Vec::new(),
        migrations: Vec::new(),
        active_migration: None,
        options_migration: None,
        catalog,
        drift: match opts.replan_on_drift {
            Some(margin) => Some(
                crate::drift::DriftWatch::new(spec, catalog, margin).map_err(RunError::Replan)?,
            ),
            None => None,
        },
        drift_migrations: Vec::new(),
        prefill_versions: HashMap::default(),
        stages: IdSlab::new(),
        meters,
        capacity,
        sync_seconds: BTreeMap::new(),
        cpu_in_use: Vec::new(),
        serverless,
        ledger: Vec::new(),
        version: 0,
        publish_times: Vec::new(),
        work: Work::default(),
        trained_tokens: 0,
        trajectories: 0,
        staleness: Vec::new(),
        violations: Vec::new(),
        scheduler_events: 0,
        sim_events: 0,
        trainer_pool: placement.trainer.pool,
        trainer_gpus: placement.trainer.gpus.max(1) as f64,
        training_gpus: 0.0,
        train_peak,
        costs,
        link_bytes_per_s: (spec.network.cross_pool_gbps * 1e9 * opts.hardware.link_efficiency)
            .max(1.0),
        failure_rng: SplitMix64::keyed(opts.seed, &[stream::FAILURES]),
        interconnect,
        cold_start_s,
        rates: latency_rates(spec, catalog, &opts.hardware),
        traces: Vec::new(),
        done: Vec::new(),
        samplers: spec
            .tasks
            .iter()
            .map(|t| TaskSamplers {
                env_step: Sampler::new(&t.env_step_ms),
                prompt: Sampler::new(&t.prompt_tokens),
                observation: Sampler::new(&t.observation_tokens),
                action: Sampler::new(&t.action_tokens),
            })
            .collect(),
        pool_names,
        engine_pool_name,
        estimates: Vec::new(),
        estimate_index: Vec::new(),
        env_step_estimates: vec![Estimate::default(); spec.tasks.len()],
        reward_estimates: vec![Estimate::default(); spec.rewards.len()],
        loss: None,
    };
    sim.schedule_failure();
    sim.scheduler_events += 1;
    sim.core.handle_timeout(Time::ZERO);
    let mut reported = 0;
    loop {
        while let Some(command) = sim.core.poll_command() {
            sim.execute(command);
        }
        if sim.core.finished() {
            break;
        }
        if sim.core.version() > reported {
            reported = sim.core.version();
            progress(reported, sim.now.as_secs_f64());
        }
        let next_event = sim.heap.next_time();
        let timeout = sim.core.poll_timeout();
        // Only the failure injector left to happen means nothing will ever finish.
        let only_failures = sim.heap.len() == 1
            && sim
                .heap
                .peek()
                .is_some_and(|(_, e)| matches!(e, Event::Fail));
        match (next_event, timeout) {
            (None, None) => {
                return Err(RunError::Stalled {
                    state: sim.core.summary(),
                    at: sim.now.as_secs_f64(),
                    trained: sim.core.version(),
                    steps,
                });
            }
            (Some(_), None) if only_failures => {
                return Err(RunError::Stalled {
                    state: sim.core.summary(),
                    at: sim.now.as_secs_f64(),
                    trained: sim.core.version(),
                    steps,
                });
            }
            (e, t) if t.is_some() && e.is_none_or(|e| t.is_some_and(|t| t < e)) => {
                let at = t.unwrap_or(sim.now);
                sim.now = sim.now.max(at);
                sim.scheduler_events += 1;
                sim.sim_events += 1;
                let now = sim.now;
                sim.core.handle_timeout(now);
            }
            _ => {
                let Some((at, event)) = sim.heap.pop() else {
                    continue;
                };
                sim.now = sim.now.max(at);
                sim.sim_events += 1;
                sim.handle(event);
            }
        }
        if sim.now.as_secs_f64() > opts.max_virtual_s {
            return Err(RunError::TooLong(opts.max_virtual_s));
        }
    }
    let end = sim.now;
    for r in 0..sim.engines.len() {
        sim.drain_samples(r);
    }
    for m in &mut sim.meters {
        m.flush(end);
    }
    if let Err(e) = sim.core.check_invariants() {
        sim.violation(format!("core books: {e}"));
    }
    let (in_flight, complete, consumed) = sim.core.trajectory_counts();
    // Groups given up (never trained on) are accounted apart.
    let started = (sim.core.stats().groups_started - sim.core.stats().groups_abandoned)
        * sim.core.config().group_size as u64;
    if in_flight + complete + consumed != started || consumed != sim.trajectories {
        sim.violation(format!(
            "trajectories lost: {started} started, {in_flight} in flight, {complete} waiting, {consumed} consumed, {} trained",
            sim.trajectories
        ));
    }
    let profiles = sim.profiles();
    let mut drift_replans = sim.drift.take().map(|w| w.replans).unwrap_or_default();
    for &(replan, migration) in &sim.drift_migrations {
        if let Some(r) = drift_replans.get_mut(replan) {
            r.migration = sim.migrations.get(migration).cloned();
        }
    }
    let cold_starts = sim.serverless.values().map(|s| s.cold_starts).sum();
    let max_staleness = sim.core.config().policy.max_staleness;
    let generated_tokens = sim.engines.iter().map(|e| e.tokens_generated).sum();
    Ok(RunResult {
        makespan_s: end.as_secs_f64(),
        publish_times_s: sim.publish_times,
        core: sim.core.stats().clone(),
        meters: sim
            .meters
            .into_iter()
            .enumerate()
            .map(|(i, m)| (i as u32, m))
            .collect(),
        capacity: sim.capacity,
        sync_seconds: sim.sync_seconds,
        work: sim.work,
        trajectories: sim.trajectories,
        trained_tokens: sim.trained_tokens,
        generated_tokens,
        staleness_histogram: sim.staleness,
        violations: sim.violations,
        scheduler_events: sim.scheduler_events,
        sim_events: sim.sim_events,
        cold_starts,
        placement,
        lifecycle: (started, in_flight, complete),
        max_staleness,
        profiles,
        loss: sim.loss,
        migration: sim
            .options_migration
            .and_then(|i| sim.migrations.get(i).cloned()),
        drift_replans,
    })
}
