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

use rollfleet_fleet::failure::GroupsGivenUp;
pub use rollfleet_fleet::hardware::model_costs;
pub use rollfleet_fleet::migration::{MigrationWave, RetireGroup};
pub use rollfleet_fleet::workload::workload_means;

mod engines;
mod events;
mod failures;
mod stages;
mod training;
mod work;

use work::PartialWork;
pub use work::Work;
pub(crate) use work::{TrajLedger, TurnWork};

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
    /// The job failed as the scheduler server would fail it (groups given up in a row).
    #[error("the job failed: {0}")]
    JobFailed(String),
}

/// How one serving replica decoded over a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaDecode {
    /// The replica's pool (index into the spec's pools).
    pub pool: u32,
    /// Seconds sequences spent in its decode batches, summed over the sequences.
    pub sequence_s: f64,
    /// Seconds it had at least one sequence decoding.
    pub decoding_s: f64,
    /// Tokens it decoded over those seconds.
    pub tokens: f64,
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
    /// The mean seconds a decoded token took, as the sequence decoding it saw it (over the
    /// tokens: a token in a batch of 20 counts its batch's iteration time); `None` if nothing
    /// decoded.
    pub decode_s_per_token: Option<f64>,
    /// Every replica's decoding, by its pool.
    pub replica_decode: Vec<ReplicaDecode>,
    /// Seconds each training batch took, in the order they were trained.
    pub train_batch_s: Vec<f64>,
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
    /// Seconds each training batch took, in the order they were trained.
    train_batch_s: Vec<f64>,
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
    /// Groups the core gave up, by the rule the scheduler server applies.
    groups_given_up: GroupsGivenUp,
    /// Why the job failed, once that rule says it has.
    failure: Option<String>,
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
    let groups_given_up = GroupsGivenUp::new(cfg.rollout_batch_size, cfg.group_size);
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
        train_batch_s: Vec::new(),
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
        groups_given_up,
        failure: None,
    };
    sim.schedule_failure();
    sim.scheduler_events += 1;
    sim.core.handle_timeout(Time::ZERO);
    let mut reported = 0;
    loop {
        while let Some(command) = sim.core.poll_command() {
            sim.execute(command);
        }
        if let Some(reason) = sim.failure.take() {
            return Err(RunError::JobFailed(reason));
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
    let replica_decode: Vec<ReplicaDecode> = sim
        .engines
        .iter()
        .zip(&sim.engine_pool)
        .map(|(e, &pool)| ReplicaDecode {
            pool,
            sequence_s: e.decode_sequence_s,
            decoding_s: e.decoding_s,
            tokens: e.decode_tokens_timed,
        })
        .collect();
    // The run's time a token over every replica's, as each pool's is over its own.
    let decode_sequence_s: f64 = replica_decode.iter().map(|r| r.sequence_s).sum();
    let decode_tokens: f64 = replica_decode.iter().map(|r| r.tokens).sum();
    let decode_s_per_token = (decode_tokens > 0.0).then(|| decode_sequence_s / decode_tokens);
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
        decode_s_per_token,
        replica_decode,
        train_batch_s: sim.train_batch_s,
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
