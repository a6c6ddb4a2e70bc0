//! The core's configuration: plain numbers derived once from the job spec, the placement and the
//! scheduling policy.
//!
//! The core never looks at YAML, the catalogue or distributions while it runs; [`Config`] is all
//! it knows, which keeps every decision a function of `(Config, inputs)`. The [`Policy`] is what
//! distinguishes rollfleet from the baselines it is measured against: the same core, run with a
//! synchronous or one-step-off discipline, behaves like those systems (see `docs/baselines.md`).

use rollfleet_catalog::Catalog;
use rollfleet_spec::{JobSpec, PoolKind, RewardPlacement, Role};
use serde::{Deserialize, Serialize};

use crate::placement::{Placement, ReplicaConfig, TrainerConfig};
use crate::protocol::{PoolIndex, SyncMode};
use crate::time::Span;

/// When new trajectories may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Discipline {
    /// Trajectory-level asynchrony: trajectories start whenever the staleness budget allows
    /// (AReaL's rule: at most `(version + maxStaleness + 1) * rolloutBatchSize` started, plus the
    /// over-provisioning), and the trainer takes whole groups as soon as `trainBatchSize` of them
    /// are ready.
    Continuous,
    /// Batches with a barrier: batch `k` (exactly `rolloutBatchSize` trajectories) starts when
    /// batch `k - 1` is fully generated and the replicas serve version `k - lag`; step `k` trains
    /// on batch `k` once it is complete. `lag = 0` is synchronous RL, `lag = 1` one-step-off.
    Batched {
        /// How many versions behind the trainer a batch is generated.
        lag: u64,
    },
}

/// A scheduling policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    /// When trajectories start and when the trainer consumes them.
    pub discipline: Discipline,
    /// Hard staleness bound (versions).
    pub max_staleness: u64,
    /// Extra fraction of a batch started beyond need (continuous discipline only).
    pub over_provisioning: f64,
    /// How weights reach the replicas.
    pub weight_sync: SyncMode,
    /// Replicas updated at once in rolling mode (0: one per trainer node).
    pub max_concurrent_updates: u32,
    /// Whether later turns go back to the replica holding the trajectory's KV cache.
    pub sticky_sessions: bool,
    /// Whether the trainer briefly holds the batch that publishes a version while unfinished
    /// groups would fall out of the staleness bound by it (continuous discipline only).
    pub expiry_aware_publish: bool,
    /// Whether a replica picked for a rolling update interrupts its generations instead of
    /// waiting for them: each resumes from the tokens it had, on new weights (partial rollout,
    /// as AReaL's interruptible generation).
    pub interrupt_generation: bool,
    /// Whether a group that will most likely miss the staleness bound is restarted on the
    /// weights just published instead of being found out a chain later (continuous discipline
    /// with a staleness bound only; see `Core::restart_late_groups`).
    pub restart_late_groups: bool,
    /// Whether over-provisioning stops at `maxStaleness` batches (at least one) started and not
    /// yet trained, admission window included (continuous discipline; see
    /// `Core::admission_terms`). Off, every over-provisioned trajectory starts.
    #[serde(default)]
    pub cap_over_provisioning: bool,
    /// Whether the job as a whole starts at most its steps' rollout batches plus one
    /// over-provisioning margin (continuous discipline; see `Core::admit_groups`). Off, the
    /// window stays full until the last batch goes to the trainer, and the groups still running
    /// then, the slowest ones, are dropped untrained.
    #[serde(default)]
    pub sample_within_job_budget: bool,
    /// Whether finished groups waiting for the trainer, up to one training batch, leave the
    /// admission window to running ones, within the cap of `maxStaleness` batches (continuous
    /// discipline; see `Core::admit_groups`). Off, every started and untrained trajectory holds
    /// its place.
    #[serde(default)]
    pub window_excludes_waiting_batch: bool,
    /// Whether a turn without its KV cache goes only to a serving replica holding fewer than
    /// twice its share of the turns running and waiting, by batch slots (see
    /// `Core::cold_slot_limit`). Off, the least loaded replica that fits takes it, however many
    /// it already took.
    #[serde(default)]
    pub spread_cold_turns: bool,
    /// Whether a finished group found past the staleness bound when the trainer takes it is
    /// restarted on the current weights (every turn older than them generated again) rather
    /// than rewound to the bound's floor (see `Core::dispatch_train`). Continuous discipline.
    #[serde(default)]
    pub restart_expired_groups: bool,
    /// Quarters of a rollout batch by which the continuous discipline's admission window is
    /// wider than its rule (its cap widened to match), or narrower when negative, down to one
    /// training batch (see `Core::admission_window`): chosen per job by simulating it, as the
    /// rule alone cannot tell whether a job's lives are tight against the staleness bound, nor
    /// whether its pools can serve the window at all.
    #[serde(default)]
    pub window_widening_quarters: i32,
    /// Whether the trainer takes finished groups cheapest to train first (fewest tokens), after
    /// those the next publication would put past the staleness bound (continuous discipline;
    /// see `Core::training_order`). Off, it takes them oldest version first, in admission
    /// order.
    #[serde(default)]
    pub cheapest_training_first: bool,
    /// Whether a trajectory starts only where it leaves the replica's KV caches room for the
    /// growth of those already there (`Core::dispatch_gen`). Off, a first turn takes any room
    /// the router finds, evicting idle caches if it must.
    #[serde(default)]
    pub start_leaves_kv_room: bool,
    /// Whether a rolling update keeps at least half of the decoding replicas serving (one may
    /// always update), however many the trainer's nodes could feed at once (see
    /// `Core::rolling_sync`). Off, as many update at once as the update limit allows.
    #[serde(default)]
    pub updates_keep_half_decoding: bool,
}

impl Policy {
    /// rollfleet's own policy with the job's RL settings.
    pub fn rollfleet(spec: &JobSpec) -> Policy {
        Policy {
            discipline: Discipline::Continuous,
            max_staleness: spec.rl.max_staleness.max(0) as u64,
            over_provisioning: spec.rl.over_provisioning.max(0.0),
            weight_sync: SyncMode::Rolling,
            max_concurrent_updates: 0,
            sticky_sessions: true,
            expiry_aware_publish: false,
            interrupt_generation: spec.rl.interrupt_generation,
            restart_late_groups: true,
            cap_over_provisioning: true,
            sample_within_job_budget: true,
            window_excludes_waiting_batch: true,
            spread_cold_turns: true,
            restart_expired_groups: true,
            window_widening_quarters: 0,
            cheapest_training_first: true,
            start_leaves_kv_room: true,
            updates_keep_half_decoding: true,
        }
    }
}

/// Where a task's reward is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RewardRoute {
    /// By the environment on its last step: no separate stage.
    Environment,
    /// On a serverless pool (index into [`Config::serverless_pools`]).
    Serverless(u32),
    /// On a CPU pool (index into [`Config::cpu_pools`]).
    Local(u32),
}

/// What the core needs to know about a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskLimits {
    /// Share of groups that sample this task.
    pub share: f64,
    /// Most turns.
    pub max_turns: u32,
    /// Longest context.
    pub context_limit: u64,
    /// Most tokens one action may take (KV reserved for it at admission).
    pub max_action_tokens: u64,
    /// Milli-vCPUs an environment step occupies.
    pub env_millicpus: u64,
    /// Where its reward is computed.
    pub reward: RewardRoute,
}

/// A CPU pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpuPoolConfig {
    /// Index in the spec.
    pub pool: PoolIndex,
    /// Milli-vCPUs in the pool.
    pub millicpus: u64,
    /// Whether it hosts environments.
    pub environments: bool,
}

/// A serverless pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerlessPoolConfig {
    /// Index in the spec.
    pub pool: PoolIndex,
    /// Concurrent executions.
    pub concurrency: u64,
}

/// Prefills shorter than this (context plus new tokens) run on the decode replica even when
/// there are prefill replicas: a KV transfer would cost more than it saves.
pub const PD_MIN_PREFILL_TOKENS: u64 = 256;

/// Everything the core knows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Seed of the core's own random decisions (task sampling).
    pub seed: u64,
    /// The scheduling policy.
    pub policy: Policy,
    /// Trajectories per group.
    pub group_size: u32,
    /// Trajectories per RL step.
    pub rollout_batch_size: u32,
    /// Trajectories per training batch.
    pub train_batch_size: u32,
    /// RL steps to run.
    pub steps: u64,
    /// Tasks, in spec order.
    pub tasks: Vec<TaskLimits>,
    /// Serving replicas.
    pub replicas: Vec<ReplicaConfig>,
    /// The trainer.
    pub trainer: TrainerConfig,
    /// Whether the trainer shares the serving GPUs.
    pub colocated: bool,
    /// CPU pools.
    pub cpu_pools: Vec<CpuPoolConfig>,
    /// Serverless pools.
    pub serverless_pools: Vec<ServerlessPoolConfig>,
    /// Bytes of one copy of the weights.
    pub weight_bytes: u64,
    /// Inputs at least this long are prefilled on a prefill replica (when there is one); shorter
    /// ones are prefilled by the decode replica itself, where a KV transfer is not worth it.
    pub pd_min_prefill_tokens: u64,
    /// A stage with no answer after this long is presumed lost and rescheduled.
    pub stage_timeout: Span,
    /// A trajectory whose stages fail (or time out) this many times in a row is given up with
    /// its whole group, as an infrastructure failure: a deterministic fault (an environment that
    /// crashes on one seed, a request the engine always refuses) must not retry forever. Lost
    /// replicas do not count: that is the node's fault, not the trajectory's.
    pub stage_failure_limit: u32,
}

/// Failures in a row after which a trajectory's group is given up (see
/// [`Config::stage_failure_limit`]).
pub const DEFAULT_STAGE_FAILURE_LIMIT: u32 = 4;

/// Why a configuration could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The RL settings are unusable.
    #[error("invalid RL settings: {0}")]
    Rl(String),
    /// No CPU pool hosts environments.
    #[error("no CPU pool hosts environments")]
    NoEnvironmentPool,
    /// A reward refers to a pool that is not there.
    #[error("reward \"{0}\" has no usable pool")]
    RewardPool(String),
    /// A task refers to an unknown reward.
    #[error("task \"{0}\" refers to an unknown reward")]
    UnknownReward(String),
}

impl Config {
    /// Builds the core's configuration.
    pub fn new(
        spec: &JobSpec,
        catalog: &Catalog,
        placement: &Placement,
        policy: Policy,
        seed: u64,
    ) -> Result<Config, ConfigError> {
        let rl = &spec.rl;
        let positive = |v: i64, what: &str| {
            u32::try_from(v)
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| ConfigError::Rl(format!("{what} must be positive, got {v}")))
        };
        let group_size = positive(rl.group_size, "groupSize")?;
        let rollout_batch_size = positive(rl.rollout_batch_size, "rolloutBatchSize")?;
        let train_batch_size = positive(rl.train_batch_size, "trainBatchSize")?;
        if rollout_batch_size % group_size != 0
            || train_batch_size % group_size != 0
            || rollout_batch_size % train_batch_size != 0
        {
            return Err(ConfigError::Rl(
                "batch sizes must be multiples of groupSize, and trainBatchSize must divide \
                 rolloutBatchSize"
                    .into(),
            ));
        }
        let mut cpu_pools = Vec::new();
        let mut serverless_pools = Vec::new();
        for (i, pool) in spec.pools.iter().enumerate() {
            match pool.kind() {
                Some(PoolKind::Cpu) => {
                    let vcpus = pool
                        .cpu
                        .as_deref()
                        .and_then(|c| catalog.cpu_shape(c).ok())
                        .map_or(0, |s| s.vcpus as u64);
                    let nodes = pool.count.unwrap_or(0).max(0) as u64;
                    cpu_pools.push(CpuPoolConfig {
                        pool: i as PoolIndex,
                        millicpus: vcpus * nodes * 1000,
                        environments: pool.roles.is_empty()
                            || pool.roles.contains(&Role::Environment),
                    });
                }
                Some(PoolKind::Serverless) => {
                    let default = pool
                        .serverless
                        .as_deref()
                        .and_then(|s| catalog.serverless(s).ok())
                        .map_or(1, |p| p.default_concurrency as u64);
                    serverless_pools.push(ServerlessPoolConfig {
                        pool: i as PoolIndex,
                        concurrency: pool.concurrency.map_or(default, |c| c.max(1) as u64),
                    });
                }
                _ => {}
            }
        }
        if spec.tasks.is_empty() || !spec.tasks.iter().any(|t| t.share > 0.0) {
            return Err(ConfigError::Rl(
                "the job needs at least one task with a positive share".into(),
            ));
        }
        if !cpu_pools.iter().any(|p| p.environments && p.millicpus > 0) {
            return Err(ConfigError::NoEnvironmentPool);
        }
        let mut tasks = Vec::new();
        for task in &spec.tasks {
            let reward = spec
                .rewards
                .iter()
                .find(|r| r.name == task.reward)
                .ok_or_else(|| ConfigError::UnknownReward(task.name.clone()))?;
            let pool_index = reward
                .pool
                .as_deref()
                .and_then(|name| spec.pools.iter().position(|p| p.name == name));
            let route = match reward.runs_on {
                RewardPlacement::Environment => RewardRoute::Environment,
                RewardPlacement::Serverless => pool_index
                    .and_then(|p| serverless_pools.iter().position(|s| s.pool as usize == p))
                    .map(|s| RewardRoute::Serverless(s as u32))
                    .ok_or_else(|| ConfigError::RewardPool(reward.name.clone()))?,
                RewardPlacement::Local => pool_index
                    .and_then(|p| cpu_pools.iter().position(|c| c.pool as usize == p))
                    .or_else(|| cpu_pools.iter().position(|c| c.millicpus > 0))
                    .map(|c| RewardRoute::Local(c as u32))
                    .ok_or_else(|| ConfigError::RewardPool(reward.name.clone()))?,
            };
            let context_limit = task.context_limit.max(1) as u64;
            let max_action = max_action_tokens(task);
            tasks.push(TaskLimits {
                share: task.share.max(0.0),
                max_turns: u32::try_from(task.max_turns.max(1)).unwrap_or(u32::MAX),
                context_limit,
                max_action_tokens: max_action,
                env_millicpus: (task.env_cpus.max(0.001) * 1000.0).round() as u64,
                reward: route,
            });
        }
        Ok(Config {
            seed,
            policy,
            group_size,
            rollout_batch_size,
            train_batch_size,
            steps: rl.steps.max(0) as u64,
            tasks,
            replicas: placement.replicas.clone(),
            trainer: placement.trainer.clone(),
            colocated: placement.colocated,
            cpu_pools,
            serverless_pools,
            weight_bytes: spec.model.weight_bytes().max(0.0) as u64,
            pd_min_prefill_tokens: PD_MIN_PREFILL_TOKENS,
            stage_timeout: Span::from_secs_f64(3600.0),
            stage_failure_limit: DEFAULT_STAGE_FAILURE_LIMIT,
        })
    }
}

/// The longest answer a task's turn may generate: its action distribution's upper bound, within
/// its context limit (the whole context limit when the distribution has no bound).
pub fn max_action_tokens(task: &rollfleet_spec::TaskSpec) -> u64 {
    let context_limit = task.context_limit.max(1) as u64;
    task.action_tokens.upper_bound().map_or(context_limit, |b| {
        (b.ceil().max(1.0) as u64).min(context_limit)
    })
}
