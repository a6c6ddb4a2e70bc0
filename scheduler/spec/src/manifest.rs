//! The job spec's types: one YAML document per RL job.
//!
//! The file is a Kubernetes-style object (`apiVersion`, `kind`, `metadata`, `spec`) so that the
//! very same file is accepted by `rollfleet validate|sim|run` and, later, by `kubectl apply`
//! against the operator's `RLJob` custom resource, whose `spec` is [`JobSpec`].
//!
//! Numbers that validation checks for sign or range are read as wide types (`i64`, `f64`) on
//! purpose: a negative count then reaches validation, which reports it together with every other
//! problem, instead of stopping the parse at the first one.

use std::collections::BTreeMap;

use rollfleet_catalog::{CpuShape, GpuProduct};
use serde::{Deserialize, Serialize};

use crate::distribution::Dist;
use crate::model::ModelSpec;

/// The `apiVersion` this crate reads.
pub const API_VERSION: &str = "rollfleet.dev/v1alpha1";
/// The `kind` of a job.
pub const KIND: &str = "RLJob";

/// A whole job file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobManifest {
    /// Must be [`API_VERSION`].
    pub api_version: String,
    /// Must be [`KIND`].
    pub kind: String,
    /// Name and labels.
    pub metadata: Metadata,
    /// What to run and on what.
    pub spec: JobSpec,
}

/// Object metadata, a subset of Kubernetes' `ObjectMeta`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Metadata {
    /// Job name: a DNS-1123 label (lower-case letters, digits, `-`; at most 63 characters).
    pub name: String,
    /// Kubernetes namespace, when applied to a cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Free-form labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// The job itself: model, RL settings, task mix, rewards and hardware.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobSpec {
    /// The policy model.
    pub model: ModelSpec,
    /// RL algorithm settings.
    pub rl: RlSpec,
    /// The task mix; shares sum to 1.
    pub tasks: Vec<TaskSpec>,
    /// Environments the tasks may name besides the built-in ones (each served by a remote
    /// environment server the workers are pointed at).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub environments: Vec<EnvironmentSpec>,
    /// Reward functions the tasks refer to by name.
    pub rewards: Vec<RewardSpec>,
    /// Hardware pools.
    pub pools: Vec<PoolSpec>,
    /// Network figures used for weight sync and KV-cache transfer.
    #[serde(default)]
    pub network: NetworkSpec,
    /// Catalogue entries added or overridden for this job.
    #[serde(default, skip_serializing_if = "CatalogAdditions::is_empty")]
    pub catalog: CatalogAdditions,
    /// How the Kubernetes operator runs the job (an inference engine, Secrets, a claim for the
    /// journal); every other entry point ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<crate::kubernetes::KubernetesJob>,
}

/// RL settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RlSpec {
    /// Trajectories sampled per task instance (GRPO group size, `n`).
    pub group_size: i64,
    /// Trajectories the trainer consumes per RL step; a multiple of `groupSize`.
    pub rollout_batch_size: i64,
    /// Trajectories per optimizer update (mini-batch); a multiple of `groupSize` that divides
    /// `rolloutBatchSize`.
    pub train_batch_size: i64,
    /// Hard bound on how many policy versions behind the trainer any turn of a consumed
    /// trajectory may be (0 = fully on-policy).
    pub max_staleness: i64,
    /// Extra fraction of a rollout batch started beyond what the trainer needs (APRIL-style),
    /// e.g. 0.25: a margin of the job, whose last groups still running are dropped.
    #[serde(default)]
    pub over_provisioning: f64,
    /// RL steps to run.
    #[serde(default = "default_steps")]
    pub steps: i64,
    /// Share of peak FLOP/s a training step achieves (model FLOPs utilisation).
    #[serde(default = "default_train_mfu")]
    pub train_mfu: f64,
    /// Who trains: the emulated trainer on the train pool (the default), or an external trainer
    /// process that reads the trainer feed and publishes the policy versions itself.
    #[serde(default, skip_serializing_if = "TrainerMode::is_emulated")]
    pub trainer: TrainerMode,
    /// Partial rollout: a replica about to load new weights interrupts its generations instead
    /// of waiting for them to finish; each resumes from the tokens it had, on the new weights,
    /// and its turn counts as old as its oldest part for the staleness bound.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interrupt_generation: bool,
}

/// Who trains the policy and publishes its versions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum TrainerMode {
    /// The emulated trainer: a batch takes the modelled training time on the train pool, and the
    /// next version is published when it ends (no weights exist).
    #[default]
    Emulated,
    /// A trainer outside rollfleet (PyTorch, JAX, ...): it reads finished trajectories from the
    /// trainer feed and publishes each new version (`PublishWeights`) when its weights are
    /// durable; the scheduler dispatches no training work.
    External,
}

impl TrainerMode {
    /// Whether this is the emulated trainer.
    pub fn is_emulated(&self) -> bool {
        *self == TrainerMode::Emulated
    }
}

fn default_steps() -> i64 {
    10
}

fn default_train_mfu() -> f64 {
    0.4
}

/// One kind of task in the mix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TaskSpec {
    /// Task name, unique in the job.
    pub name: String,
    /// Environment kind that runs it (e.g. `sokoban`, `frozenlake`, `calculator`, `swe-sandbox`).
    pub environment: String,
    /// Share of trajectories that are this task; all shares sum to 1.
    pub share: f64,
    /// Most turns a trajectory may take.
    pub max_turns: i64,
    /// Turns a trajectory actually takes before it ends (defaults to `maxTurns`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<Dist>,
    /// Tokens of the initial prompt.
    pub prompt_tokens: Dist,
    /// Tokens the policy generates per turn (the action).
    pub action_tokens: Dist,
    /// Tokens of the observation the environment returns per turn.
    pub observation_tokens: Dist,
    /// Longest context (prompt plus every turn) a trajectory may reach.
    pub context_limit: i64,
    /// Latency of one environment step, ms.
    pub env_step_ms: Dist,
    /// vCPUs one environment instance occupies.
    #[serde(default = "one_f64")]
    pub env_cpus: f64,
    /// Share of environment steps that fail for infrastructure reasons (to be retried, never
    /// scored as a zero reward).
    #[serde(default)]
    pub env_failure_rate: f64,
    /// Name of the reward function (in `spec.rewards`) that scores it.
    pub reward: String,
}

fn one_f64() -> f64 {
    1.0
}

/// An environment kind the job declares, so that its tasks may name it: one no worker runs
/// built in, served by a program of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnvironmentSpec {
    /// The kind, as tasks name it in `environment` and as the server knows it.
    pub name: String,
    /// What serves it.
    pub served_by: EnvironmentServer,
}

/// What serves a declared environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum EnvironmentServer {
    /// A remote environment server over rollfleet's HTTP protocol
    /// (`docs/remote-environments.md`); the workers that run the job's environments are started
    /// with `--remote-env NAME=URL`, which says where it listens.
    Remote,
}

/// Where a reward function runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum RewardPlacement {
    /// A serverless function (AWS Lambda API), in a `serverless` pool.
    Serverless,
    /// In-process on the CPU pool, next to the scheduler's reward workers.
    Local,
    /// Computed by the environment itself on its last step.
    Environment,
}

/// A reward function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RewardSpec {
    /// Reward name, unique in the job.
    pub name: String,
    /// Where it runs.
    pub runs_on: RewardPlacement,
    /// The pool that runs it: a `serverless` pool for `serverless`, a `cpu` pool for `local`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Function name on the serverless platform (for `serverless`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    /// Execution time of one call, ms (without cold start).
    pub latency_ms: Dist,
    /// Memory configured for the function, MB (for `serverless`; drives GB-second cost).
    #[serde(default = "default_function_memory_mb")]
    pub memory_mb: i64,
}

fn default_function_memory_mb() -> i64 {
    1024
}

/// What a pool may be used for. Left empty, the planner decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum Role {
    /// Prefill (prompt and new observations): compute-bound.
    Prefill,
    /// Decode (token generation): bandwidth-bound.
    Decode,
    /// Prefill and decode colocated on the same replicas.
    Generate,
    /// Training steps.
    Train,
    /// Environment steps.
    Environment,
    /// Reward computation.
    Reward,
}

impl Role {
    /// Whether this role runs on GPUs.
    pub fn is_gpu_role(self) -> bool {
        matches!(
            self,
            Role::Prefill | Role::Decode | Role::Generate | Role::Train
        )
    }
}

/// A pool of identical devices: GPUs of one product, CPU nodes of one shape, or a serverless
/// platform. Exactly one of `gpu`, `cpu` and `serverless` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolSpec {
    /// Pool name, unique in the job.
    pub name: String,
    /// GPU product (a catalogue name), for a GPU pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// CPU node shape (a catalogue name), for an environment pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<String>,
    /// Serverless platform (a catalogue name, e.g. `aws-lambda`), for a reward pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serverless: Option<String>,
    /// GPUs (GPU pool) or nodes (CPU pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<i64>,
    /// GPUs per node, the most a tensor-parallel group may span (GPU pool; default 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_per_node: Option<i64>,
    /// Concurrent executions (serverless pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<i64>,
    /// Roles this pool is pinned to; empty lets the planner decide.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<Role>,
    /// Where the pool's pods go on Kubernetes and what they ask for (the operator's defaults
    /// when unset); every other entry point ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<crate::kubernetes::KubernetesPlacement>,
}

/// The kind of a pool, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum PoolKind {
    /// GPUs.
    Gpu,
    /// CPU nodes.
    Cpu,
    /// A serverless platform.
    Serverless,
}

impl PoolSpec {
    /// The pool's kind, if exactly one of `gpu`, `cpu`, `serverless` is set.
    pub fn kind(&self) -> Option<PoolKind> {
        match (&self.gpu, &self.cpu, &self.serverless) {
            (Some(_), None, None) => Some(PoolKind::Gpu),
            (None, Some(_), None) => Some(PoolKind::Cpu),
            (None, None, Some(_)) => Some(PoolKind::Serverless),
            _ => None,
        }
    }

    /// GPUs per node, with its default.
    pub fn gpus_per_node(&self) -> i64 {
        self.gpus_per_node.unwrap_or(8)
    }
}

/// Network figures between pools.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkSpec {
    /// Bandwidth between nodes of different pools, GB/s per node (e.g. 8 x 400 Gb/s RDMA NICs
    /// = 400 GB/s; one 200 Gb/s NIC = 25 GB/s). Weight sync and KV-cache transfer use it.
    #[serde(rename = "crossPoolGBps", default = "default_cross_pool_gbps")]
    pub cross_pool_gbps: f64,
}

fn default_cross_pool_gbps() -> f64 {
    25.0
}

impl Default for NetworkSpec {
    fn default() -> Self {
        NetworkSpec {
            cross_pool_gbps: default_cross_pool_gbps(),
        }
    }
}

/// Catalogue entries a job adds or overrides.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CatalogAdditions {
    /// GPU products.
    #[serde(default)]
    pub gpus: Vec<GpuProduct>,
    /// CPU node shapes.
    #[serde(default)]
    pub cpu_shapes: Vec<CpuShape>,
}

impl CatalogAdditions {
    /// Whether nothing is added.
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty() && self.cpu_shapes.is_empty()
    }
}
