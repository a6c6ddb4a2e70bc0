//! Validation of a parsed job: every problem at once, each with its field path and reason.
//!
//! Validation never stops at the first problem and never panics: it walks the whole spec, looks
//! every name up in the catalogue (the built-in one plus the job's own additions) and checks the
//! cross-references (task to reward, reward to pool) and the one global constraint that most
//! often goes wrong in practice: that a replica of the model fits in some GPU pool at all.

use std::collections::BTreeSet;

use rollfleet_catalog::Catalog;
use serde::Serialize;

use crate::distribution::Distribution;
use crate::manifest::{
    API_VERSION, JobManifest, JobSpec, KIND, PoolKind, PoolSpec, RewardPlacement, Role,
};
use crate::names::{BUILTIN_ENVIRONMENTS, BUILTIN_REWARD_FUNCTIONS, did_you_mean};

/// One problem (or warning) in a job spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// Field path, e.g. `spec.pools[1].gpu`.
    pub path: String,
    /// What is wrong and, where it helps, what would be right.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Share of a GPU's memory usable for weights and KV cache (the rest: CUDA context,
/// activations, allocator fragmentation). vLLM's default `gpu_memory_utilization` is 0.9.
pub const USABLE_MEMORY_FRACTION: f64 = 0.9;

/// How far shares may stray from summing to 1 (they are usually written with two decimals).
const SHARE_TOLERANCE: f64 = 1e-6;

/// The longest `contextLimit` a task may ask for: 10 Mi tokens, the longest context window
/// published for an open model (Llama 4 Scout). Far beyond it a limit is a typo, and the
/// simulator and the planner would size books and KV reservations for it.
pub const MAX_CONTEXT_LIMIT: i64 = 10 * 1024 * 1024;

/// The most GPUs or nodes one pool may count: a million, several times the largest cluster
/// built. The simulator and the planner keep books per GPU, so a count far beyond it (a typo)
/// would exhaust memory or time instead of failing.
pub const MAX_POOL_COUNT: i64 = 1_000_000;

// Upper bounds on every other figure of a job. Each is far beyond any real job, so only a typo
// or a hostile file meets one; without them a spec of a few bytes (a batch of 4e12, a token
// count of 1e300) validates and then keeps the planner or the simulator busy for hours, or
// overflows their arithmetic. Each error message carries the bound's reason.
//
// Figures with no bound among these, and why none is needed: `dtypeBytes` is one of 1, 2 or 4;
// `overProvisioning`, `trainMfu`, `share`, `envCpus` and `envFailureRate` already have fixed
// ranges; `activeParameters` is at most `parameters`; `contextLimit` and a pool's `count` have
// the bounds above.

/// Trajectories per RL step or per update: a million, over ten times the scale benchmark's
/// 80,000 and far past published RL batches. The simulator and the planner's queueing model
/// walk through every trajectory and group of a step.
pub const MAX_BATCH_SIZE: i64 = 1 << 20;

/// Trajectories per group: GRPO groups hold 4 to 64; 4,096 leaves room for any variant.
pub const MAX_GROUP_SIZE: i64 = 4096;

/// Policy versions a turn may lag: asynchronous RL stays within a handful; a thousand versions
/// back is off-policy by any measure.
pub const MAX_STALENESS: i64 = 1000;

/// RL steps: ten million; published RL runs take hundreds to thousands.
pub const MAX_STEPS: i64 = 10_000_000;

/// Turns of one episode: agentic tasks take tens to hundreds; ten thousand is far past any.
pub const MAX_TURNS: i64 = 10_000;

/// Latency of one environment step or reward call, ms: a day. Longer is a unit slip.
pub const MAX_LATENCY_MS: f64 = 86_400_000.0;

/// A log-normal's 99th percentile over its median: ten thousand (a sigma of about 4). Up to
/// about fifty thousand the mean stays below the 99th percentile; far past it the mean, which
/// the planner plans with, is astronomically larger than any figure in the spec, or infinite.
pub const MAX_LOGNORMAL_SPREAD: f64 = 10_000.0;

/// Multiplier on a trace's samples: 1 to 10 stretches serving traffic to RL lengths; at 100
/// the Azure trace's longest prompt (14,050 tokens) is already 1.4 M tokens.
pub const MAX_TRACE_SCALE: f64 = 100.0;

/// Model parameters: ten trillion, five times the largest models announced.
pub const MAX_PARAMETERS: f64 = 1e13;

/// Transformer layers: published models have up to about 130.
pub const MAX_LAYERS: i64 = 10_000;

/// Hidden size: published models have up to about 20,000.
pub const MAX_HIDDEN_SIZE: i64 = 1 << 20;

/// KV heads, and the dimension of a head: published models have at most 128 KV heads and
/// heads of at most 512 dimensions.
pub const MAX_ATTENTION_SIZE: i64 = 8192;

/// Tasks in the mix, and reward functions: task suites run to about a hundred kinds; the
/// planner and the simulator model each task separately.
pub const MAX_TASKS: usize = 1024;

/// Pools in a job, and GPU products or CPU shapes a job adds to the catalogue: real inventories
/// have a few to a few dozen. The planner's search grows with the number of pools (256 pools
/// take seconds to a minute to plan, depending on their sizes and the task mix).
pub const MAX_POOLS: usize = 256;

/// GPUs per node, the most a tensor-parallel replica may span: NVLink domains hold 8 to 72.
pub const MAX_GPUS_PER_NODE: i64 = 1024;

/// Concurrent executions of a serverless pool: account quotas reach tens of thousands.
pub const MAX_CONCURRENCY: i64 = 1_000_000;

/// Memory of a serverless function, MB: a hundred times AWS Lambda's largest (10,240 MB).
pub const MAX_FUNCTION_MEMORY_MB: i64 = 1 << 20;

/// A GPU's dense BF16 TFLOP/s: a few hundred times the fastest GPU's (B200: 2,250).
pub const MAX_GPU_TFLOPS: f64 = 1e6;

/// A GPU's memory, GB: several hundred times the largest (B200: 192 GB).
pub const MAX_GPU_MEMORY_GB: f64 = 1e5;

/// A bandwidth, GB/s (a GPU's memory or interconnect, or the network between pools): over a
/// hundred times the highest (B200 HBM: 8,000 GB/s).
pub const MAX_BANDWIDTH_GBPS: f64 = 1e6;

/// A price per GPU-hour or node-hour, USD: far past any (GPUs rent for a few dollars an hour).
pub const MAX_PRICE_PER_HOUR_USD: f64 = 1e6;

/// vCPUs of a CPU node shape: fifty times the largest instances (under two thousand).
pub const MAX_VCPUS: u32 = 100_000;

/// Memory of a CPU node shape, GiB: thirty times the largest instances (32 TiB).
pub const MAX_CPU_MEMORY_GIB: f64 = 1e6;

/// `unknown {what} "{name}" ({known})`, with a suggestion when a known name is close.
fn unknown_name<'a>(
    what: &str,
    name: &str,
    known: impl IntoIterator<Item = &'a str>,
    listed: &str,
) -> String {
    let mut message = format!("unknown {what} \"{name}\" ({listed})");
    if let Some(close) = did_you_mean(name, known) {
        message.push_str(&format!("; did you mean `{close}`?"));
    }
    message
}

/// What a distribution measures: the most any of its parameters may be, the unit, and why.
struct Quantity {
    max: f64,
    unit: &'static str,
    reason: &'static str,
}

const TOKENS: Quantity = Quantity {
    max: MAX_CONTEXT_LIMIT as f64,
    unit: "tokens",
    reason: "the longest context window accepted",
};

const TURNS: Quantity = Quantity {
    max: MAX_TURNS as f64,
    unit: "turns",
    reason: "agentic episodes take tens to hundreds",
};

const MILLISECONDS: Quantity = Quantity {
    max: MAX_LATENCY_MS,
    unit: "ms",
    reason: "a day",
};

/// A float as a person reads it: plain up to a quadrillion, in exponent form beyond
/// (`1e300` rather than three hundred digits).
fn show(value: f64) -> String {
    if value.is_finite() && value.abs() >= 1e15 {
        format!("{value:e}")
    } else {
        value.to_string()
    }
}

#[derive(Default)]
struct Problems {
    errors: Vec<Problem>,
    warnings: Vec<Problem>,
}

impl Problems {
    fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    fn at_least(&mut self, path: impl Into<String>, value: i64, min: i64) {
        if value < min {
            self.error(path, format!("must be at least {min}, got {value}"));
        }
    }

    /// At least `min` and at most `max` `what` (a unit, then the bound's reason).
    fn within(&mut self, path: impl Into<String>, value: i64, min: i64, max: i64, what: &str) {
        if value < min {
            self.error(path, format!("must be at least {min}, got {value}"));
        } else if value > max {
            self.error(path, format!("must be at most {max} {what}, got {value}"));
        }
    }

    /// Finite and at most `max` `what`; the lower bound is checked by the caller.
    fn finite_at_most(&mut self, path: impl Into<String>, value: f64, max: f64, what: &str) {
        if !value.is_finite() {
            self.error(path, format!("must be a finite number, got {value}"));
        } else if value > max {
            self.error(
                path,
                format!("must be at most {} {what}, got {}", show(max), show(value)),
            );
        }
    }

    /// At most `max` entries of a list.
    fn at_most_entries(&mut self, path: &str, len: usize, max: usize, what: &str) {
        if len > max {
            self.error(path, format!("must list at most {max} {what}, got {len}"));
        }
    }

    fn finite_in(&mut self, path: impl Into<String>, value: f64, min: f64, max: f64) {
        if !value.is_finite() || value < min || value > max {
            self.error(
                path,
                format!("must be between {min} and {max}, got {value}"),
            );
        }
    }

    fn name(&mut self, path: String, name: &str, seen: &mut BTreeSet<String>, what: &str) {
        if name.trim().is_empty() {
            self.error(path, "must not be empty");
        } else if !seen.insert(name.to_owned()) {
            self.error(path, format!("duplicate {what} name \"{name}\""));
        }
    }
}

/// The outcome of validating a manifest whose syntax was already accepted.
pub(crate) struct Outcome {
    pub errors: Vec<Problem>,
    pub warnings: Vec<Problem>,
    pub catalog: Catalog,
}

pub(crate) fn validate(manifest: &JobManifest) -> Outcome {
    let mut problems = Problems::default();
    if manifest.api_version != API_VERSION {
        problems.error(
            "apiVersion",
            format!(
                "must be \"{API_VERSION}\", got \"{}\"",
                manifest.api_version
            ),
        );
    }
    if manifest.kind != KIND {
        problems.error(
            "kind",
            format!("must be \"{KIND}\", got \"{}\"", manifest.kind),
        );
    }
    if !is_dns_label(&manifest.metadata.name) {
        problems.error(
            "metadata.name",
            format!(
                "\"{}\" is not a DNS-1123 label (lower-case letters, digits and '-', starting \
                 and ending with a letter or digit, at most 63 characters)",
                manifest.metadata.name
            ),
        );
    }

    let spec = &manifest.spec;
    let catalog = catalog_with_additions(spec, &mut problems);
    check_model(spec, &mut problems);
    check_rl(spec, &mut problems);
    check_environments(spec, &mut problems);
    check_tasks(spec, &mut problems);
    check_rewards(spec, &mut problems);
    check_pools(spec, &catalog, &mut problems);
    problems
        .errors
        .extend(crate::kubernetes::job_problems(spec.kubernetes.as_ref()));
    problems
        .errors
        .extend(crate::platform_limits::reward_timeout_problems(
            spec, &catalog,
        ));
    if problems.errors.is_empty() {
        // The fit check needs valid numbers everywhere; with other errors it would only add noise.
        check_model_fits(spec, &catalog, &mut problems);
    }
    if !spec.network.cross_pool_gbps.is_finite() || spec.network.cross_pool_gbps <= 0.0 {
        problems.error(
            "spec.network.crossPoolGBps",
            format!("must be > 0, got {}", spec.network.cross_pool_gbps),
        );
    } else {
        problems.finite_at_most(
            "spec.network.crossPoolGBps",
            spec.network.cross_pool_gbps,
            MAX_BANDWIDTH_GBPS,
            "GB/s (a thousand times eight 800 Gb/s NICs)",
        );
    }
    Outcome {
        errors: problems.errors,
        warnings: problems.warnings,
        catalog,
    }
}

fn is_dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    let allowed = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-';
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.iter().all(allowed)
        && bytes.first() != Some(&b'-')
        && bytes.last() != Some(&b'-')
}

fn catalog_with_additions(spec: &JobSpec, problems: &mut Problems) -> Catalog {
    let mut catalog = Catalog::builtin();
    problems.at_most_entries(
        "spec.catalog.gpus",
        spec.catalog.gpus.len(),
        MAX_POOLS,
        "GPU products (at most one per pool)",
    );
    problems.at_most_entries(
        "spec.catalog.cpuShapes",
        spec.catalog.cpu_shapes.len(),
        MAX_POOLS,
        "CPU shapes (at most one per pool)",
    );
    for (i, gpu) in spec.catalog.gpus.iter().enumerate() {
        let path = format!("spec.catalog.gpus[{i}]");
        let figures = [
            (
                "bf16DenseTflops",
                gpu.bf16_dense_tflops,
                MAX_GPU_TFLOPS,
                "TFLOP/s (a few hundred times the fastest GPU's)",
            ),
            (
                "memoryGb",
                gpu.memory_gb,
                MAX_GPU_MEMORY_GB,
                "GB (several hundred times the largest GPU's)",
            ),
            (
                "memoryBandwidthGBps",
                gpu.memory_bandwidth_gbps,
                MAX_BANDWIDTH_GBPS,
                "GB/s (over a hundred times the highest GPU's)",
            ),
            (
                "interconnectGBps",
                gpu.interconnect_gbps,
                MAX_BANDWIDTH_GBPS,
                "GB/s (over a hundred times the highest GPU's)",
            ),
        ];
        let mut valid = !gpu.name.trim().is_empty();
        if !valid {
            problems.error(format!("{path}.name"), "must not be empty");
        }
        for (field, value, max, what) in figures {
            if !value.is_finite() || value <= 0.0 {
                problems.error(
                    format!("{path}.{field}"),
                    format!("must be > 0, got {value}"),
                );
                valid = false;
            } else if value > max {
                problems.finite_at_most(format!("{path}.{field}"), value, max, what);
                valid = false;
            }
        }
        if !price_valid(
            &format!("{path}.pricePerHourUsd"),
            gpu.price_per_hour_usd,
            problems,
        ) {
            valid = false;
        }
        if valid {
            catalog.add_gpu(gpu.clone());
        }
    }
    for (i, shape) in spec.catalog.cpu_shapes.iter().enumerate() {
        let path = format!("spec.catalog.cpuShapes[{i}]");
        let mut valid = true;
        if shape.name.trim().is_empty() {
            problems.error(format!("{path}.name"), "must not be empty");
            valid = false;
        }
        if shape.vcpus == 0 {
            problems.error(format!("{path}.vcpus"), "must be at least 1, got 0");
            valid = false;
        } else if shape.vcpus > MAX_VCPUS {
            problems.error(
                format!("{path}.vcpus"),
                format!(
                    "must be at most {MAX_VCPUS} vCPUs (fifty times the largest \
                     instances'), got {}",
                    shape.vcpus
                ),
            );
            valid = false;
        }
        if !shape.memory_gib.is_finite() || shape.memory_gib <= 0.0 {
            problems.error(
                format!("{path}.memoryGib"),
                format!("must be > 0, got {}", shape.memory_gib),
            );
            valid = false;
        } else if shape.memory_gib > MAX_CPU_MEMORY_GIB {
            problems.finite_at_most(
                format!("{path}.memoryGib"),
                shape.memory_gib,
                MAX_CPU_MEMORY_GIB,
                "GiB (thirty times the largest instances')",
            );
            valid = false;
        }
        if !price_valid(
            &format!("{path}.pricePerHourUsd"),
            shape.price_per_hour_usd,
            problems,
        ) {
            valid = false;
        }
        if valid {
            catalog.add_cpu_shape(shape.clone());
        }
    }
    catalog
}

/// Whether a price per hour is a finite figure from 0 to [`MAX_PRICE_PER_HOUR_USD`], reporting
/// it if not.
fn price_valid(path: &str, price: f64, problems: &mut Problems) -> bool {
    if !price.is_finite() || price < 0.0 {
        problems.error(path, format!("must be >= 0, got {price}"));
        false
    } else if price > MAX_PRICE_PER_HOUR_USD {
        problems.finite_at_most(
            path,
            price,
            MAX_PRICE_PER_HOUR_USD,
            "USD (GPUs rent for a few dollars an hour)",
        );
        false
    } else {
        true
    }
}

fn check_model(spec: &JobSpec, problems: &mut Problems) {
    let model = &spec.model;
    if model.name.trim().is_empty() {
        problems.error("spec.model.name", "must not be empty");
    }
    if !model.parameters.is_finite() || model.parameters < 1.0 {
        problems.error(
            "spec.model.parameters",
            format!(
                "must be a positive parameter count, got {}",
                model.parameters
            ),
        );
    } else {
        problems.finite_at_most(
            "spec.model.parameters",
            model.parameters,
            MAX_PARAMETERS,
            "(five times the largest models announced)",
        );
    }
    if let Some(active) = model.active_parameters
        && (!active.is_finite() || active < 1.0 || active > model.parameters)
    {
        problems.error(
            "spec.model.activeParameters",
            format!(
                "must be between 1 and parameters ({}), got {active}",
                model.parameters
            ),
        );
    }
    problems.within(
        "spec.model.layers",
        model.layers,
        1,
        MAX_LAYERS,
        "(published models have up to about 130)",
    );
    problems.within(
        "spec.model.hiddenSize",
        model.hidden_size,
        1,
        MAX_HIDDEN_SIZE,
        "(published models have up to about 20,000)",
    );
    problems.within(
        "spec.model.kvHeads",
        model.kv_heads,
        1,
        MAX_ATTENTION_SIZE,
        "(published models have up to 128)",
    );
    problems.within(
        "spec.model.headDim",
        model.head_dim,
        1,
        MAX_ATTENTION_SIZE,
        "(published models have up to 512)",
    );
    if ![1, 2, 4].contains(&model.dtype_bytes) {
        problems.error(
            "spec.model.dtypeBytes",
            format!("must be 1, 2 or 4, got {}", model.dtype_bytes),
        );
    }
}

fn check_rl(spec: &JobSpec, problems: &mut Problems) {
    let rl = &spec.rl;
    let batch = "trajectories (far past published RL batches; the simulator and the planner work \
                 through every trajectory of a step)";
    problems.within(
        "spec.rl.groupSize",
        rl.group_size,
        1,
        MAX_GROUP_SIZE,
        "trajectories (GRPO groups hold 4 to 64)",
    );
    problems.within(
        "spec.rl.rolloutBatchSize",
        rl.rollout_batch_size,
        1,
        MAX_BATCH_SIZE,
        batch,
    );
    problems.within(
        "spec.rl.trainBatchSize",
        rl.train_batch_size,
        1,
        MAX_BATCH_SIZE,
        batch,
    );
    problems.within(
        "spec.rl.maxStaleness",
        rl.max_staleness,
        0,
        MAX_STALENESS,
        "policy versions (asynchronous RL stays within a handful)",
    );
    problems.within(
        "spec.rl.steps",
        rl.steps,
        1,
        MAX_STEPS,
        "steps (published RL runs take hundreds to thousands)",
    );
    problems.finite_in("spec.rl.overProvisioning", rl.over_provisioning, 0.0, 4.0);
    if !rl.train_mfu.is_finite() || rl.train_mfu <= 0.0 || rl.train_mfu > 1.0 {
        problems.error(
            "spec.rl.trainMfu",
            format!("must be in (0, 1], got {}", rl.train_mfu),
        );
    }
    if rl.group_size >= 1 && rl.rollout_batch_size >= 1 && rl.train_batch_size >= 1 {
        if rl.rollout_batch_size % rl.group_size != 0 {
            problems.error(
                "spec.rl.rolloutBatchSize",
                format!(
                    "must be a multiple of groupSize ({}) so that every group is complete, got {}",
                    rl.group_size, rl.rollout_batch_size
                ),
            );
        }
        if rl.train_batch_size % rl.group_size != 0 {
            problems.error(
                "spec.rl.trainBatchSize",
                format!(
                    "must be a multiple of groupSize ({}), got {}",
                    rl.group_size, rl.train_batch_size
                ),
            );
        }
        if rl.rollout_batch_size % rl.train_batch_size != 0 {
            problems.error(
                "spec.rl.trainBatchSize",
                format!(
                    "must divide rolloutBatchSize ({}), got {}",
                    rl.rollout_batch_size, rl.train_batch_size
                ),
            );
        }
    }
}

fn check_environments(spec: &JobSpec, problems: &mut Problems) {
    problems.at_most_entries(
        "spec.environments",
        spec.environments.len(),
        MAX_TASKS,
        "environments (at most one per task)",
    );
    let mut names = BTreeSet::new();
    for (i, environment) in spec.environments.iter().enumerate() {
        problems.name(
            format!("spec.environments[{i}].name"),
            &environment.name,
            &mut names,
            "environment",
        );
    }
}

fn check_tasks(spec: &JobSpec, problems: &mut Problems) {
    if spec.tasks.is_empty() {
        problems.error("spec.tasks", "must list at least one task");
        return;
    }
    problems.at_most_entries(
        "spec.tasks",
        spec.tasks.len(),
        MAX_TASKS,
        "tasks (task suites run to about a hundred kinds)",
    );
    let rewards: BTreeSet<&str> = spec.rewards.iter().map(|r| r.name.as_str()).collect();
    let declared: BTreeSet<&str> = spec.environments.iter().map(|e| e.name.as_str()).collect();
    let mut names = BTreeSet::new();
    let mut share_sum = 0.0;
    let mut shares_valid = true;
    for (i, task) in spec.tasks.iter().enumerate() {
        let path = format!("spec.tasks[{i}]");
        problems.name(format!("{path}.name"), &task.name, &mut names, "task");
        if task.environment.trim().is_empty() {
            problems.error(format!("{path}.environment"), "must not be empty");
        } else if !BUILTIN_ENVIRONMENTS.contains(&task.environment.as_str())
            && !declared.contains(task.environment.as_str())
        {
            // A worker given this task would refuse every episode of it: caught here, before
            // the job takes any hardware, and the same for the simulator and the planner, so
            // that a job they accept is one the workers can run.
            let listed = format!(
                "built in: {}; declared in spec.environments: {}",
                BUILTIN_ENVIRONMENTS.join(", "),
                if declared.is_empty() {
                    "none".to_owned()
                } else {
                    declared.iter().copied().collect::<Vec<_>>().join(", ")
                }
            );
            let known = || {
                BUILTIN_ENVIRONMENTS
                    .iter()
                    .copied()
                    .chain(declared.iter().copied())
            };
            let mut message = unknown_name("environment", &task.environment, known(), &listed);
            // Without a close name it is more likely a remote environment left undeclared
            // than a typo: say how to declare one.
            if did_you_mean(&task.environment, known()).is_none() {
                message.push_str(
                    "; an environment served by a remote environment server is declared in \
                     spec.environments with `servedBy: remote`",
                );
            }
            problems.error(format!("{path}.environment"), message);
        }
        if !task.share.is_finite() || task.share <= 0.0 || task.share > 1.0 {
            problems.error(
                format!("{path}.share"),
                format!("must be in (0, 1], got {}", task.share),
            );
            shares_valid = false;
        } else {
            share_sum += task.share;
        }
        problems.within(
            format!("{path}.maxTurns"),
            task.max_turns,
            1,
            MAX_TURNS,
            "turns (agentic episodes take tens to hundreds)",
        );
        problems.at_least(format!("{path}.contextLimit"), task.context_limit, 1);
        if task.context_limit > MAX_CONTEXT_LIMIT {
            problems.error(
                format!("{path}.contextLimit"),
                format!(
                    "must be at most {MAX_CONTEXT_LIMIT} tokens (the longest published context \
                     window), got {}",
                    task.context_limit
                ),
            );
        }
        // Every turn adds at least one action token to the context, so an episode ends at its
        // context limit whatever maxTurns says: a larger maxTurns is a typo, not a longer episode.
        if task.context_limit >= 1 && task.max_turns > task.context_limit {
            problems.error(
                format!("{path}.maxTurns"),
                format!(
                    "must be at most contextLimit ({}): every turn adds at least one token, got {}",
                    task.context_limit, task.max_turns
                ),
            );
        }
        let distributions = [
            ("turns", task.turns.as_deref(), &TURNS),
            ("promptTokens", Some(&*task.prompt_tokens), &TOKENS),
            ("actionTokens", Some(&*task.action_tokens), &TOKENS),
            (
                "observationTokens",
                Some(&*task.observation_tokens),
                &TOKENS,
            ),
            ("envStepMs", Some(&*task.env_step_ms), &MILLISECONDS),
        ];
        for (field, distribution, quantity) in distributions {
            if let Some(distribution) = distribution {
                check_distribution(&format!("{path}.{field}"), distribution, quantity, problems);
            }
        }
        if let Some(turns) = task.turns.as_ref().and_then(|t| t.upper_bound())
            && turns > task.max_turns as f64
        {
            problems.error(
                format!("{path}.turns"),
                format!("can reach {turns}, above maxTurns ({})", task.max_turns),
            );
        }
        if let Some(prompt) = task.prompt_tokens.upper_bound()
            && task.context_limit >= 1
            && prompt >= task.context_limit as f64
        {
            problems.error(
                format!("{path}.promptTokens"),
                format!(
                    "the prompt alone ({prompt} tokens) reaches contextLimit ({})",
                    task.context_limit
                ),
            );
        }
        problems.finite_in(format!("{path}.envCpus"), task.env_cpus, 0.01, 1024.0);
        problems.finite_in(
            format!("{path}.envFailureRate"),
            task.env_failure_rate,
            0.0,
            0.99,
        );
        if !rewards.contains(task.reward.as_str()) {
            let listed = format!(
                "known: {}",
                rewards.iter().copied().collect::<Vec<_>>().join(", ")
            );
            problems.error(
                format!("{path}.reward"),
                unknown_name("reward", &task.reward, rewards.iter().copied(), &listed),
            );
        }
    }
    if shares_valid && (share_sum - 1.0).abs() > SHARE_TOLERANCE {
        problems.error(
            "spec.tasks",
            format!("shares must sum to 1, they sum to {share_sum}"),
        );
    }
}

fn check_rewards(spec: &JobSpec, problems: &mut Problems) {
    problems.at_most_entries(
        "spec.rewards",
        spec.rewards.len(),
        MAX_TASKS,
        "rewards (at most one per task)",
    );
    let mut names = BTreeSet::new();
    for (i, reward) in spec.rewards.iter().enumerate() {
        let path = format!("spec.rewards[{i}]");
        problems.name(format!("{path}.name"), &reward.name, &mut names, "reward");
        check_distribution(
            &format!("{path}.latencyMs"),
            &reward.latency_ms,
            &MILLISECONDS,
            problems,
        );
        problems.within(
            format!("{path}.memoryMb"),
            reward.memory_mb,
            128,
            MAX_FUNCTION_MEMORY_MB,
            "MB (a hundred times AWS Lambda's largest function)",
        );
        let wanted_kind = match reward.runs_on {
            RewardPlacement::Serverless => Some(PoolKind::Serverless),
            RewardPlacement::Local => Some(PoolKind::Cpu),
            RewardPlacement::Environment => None,
        };
        match (wanted_kind, &reward.pool) {
            (Some(_), None) => problems.error(
                format!("{path}.pool"),
                format!("is required for runsOn: {}", placement_name(reward.runs_on)),
            ),
            (Some(kind_wanted), Some(pool_name)) => {
                match spec.pools.iter().find(|p| &p.name == pool_name) {
                    None => problems.error(
                        format!("{path}.pool"),
                        unknown_name(
                            "pool",
                            pool_name,
                            spec.pools.iter().map(|p| p.name.as_str()),
                            &format!(
                                "known: {}",
                                spec.pools
                                    .iter()
                                    .map(|p| p.name.as_str())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        ),
                    ),
                    Some(pool) if pool.kind().is_some_and(|k| k != kind_wanted) => problems.error(
                        format!("{path}.pool"),
                        format!(
                            "pool \"{pool_name}\" is not a {} pool, which runsOn: {} needs",
                            kind_name(kind_wanted),
                            placement_name(reward.runs_on)
                        ),
                    ),
                    Some(_) => {}
                }
            }
            (None, Some(_)) => problems.warn(
                format!("{path}.pool"),
                "is ignored for runsOn: environment (the environment computes the reward)",
            ),
            (None, None) => {}
        }
        if reward.runs_on == RewardPlacement::Serverless
            && reward
                .function
                .as_deref()
                .is_none_or(|f| f.trim().is_empty())
        {
            problems.error(
                format!("{path}.function"),
                "is required for runsOn: serverless",
            );
        }
        // The reward workers run a function by this name (a local reward without one runs
        // exact_match); a name they do not implement would fail every call of the job.
        if reward.runs_on == RewardPlacement::Local
            && reward
                .function
                .as_deref()
                .is_some_and(|f| f.trim().is_empty())
        {
            problems.error(
                format!("{path}.function"),
                "must not be empty (left out, a local reward runs exact_match)",
            );
        } else if let Some(function) = reward.function.as_deref()
            && !function.trim().is_empty()
            && reward.runs_on != RewardPlacement::Environment
            && !BUILTIN_REWARD_FUNCTIONS.contains(&function)
        {
            problems.error(
                format!("{path}.function"),
                unknown_name(
                    "reward function",
                    function,
                    BUILTIN_REWARD_FUNCTIONS.iter().copied(),
                    &format!(
                        "the reward workers implement: {}",
                        BUILTIN_REWARD_FUNCTIONS.join(", ")
                    ),
                ),
            );
        }
    }
}

/// A distribution's own problems, then each parameter beyond what `quantity` allows, a
/// log-normal spread so wide its mean runs away, and a trace stretched too far.
fn check_distribution(
    path: &str,
    distribution: &Distribution,
    quantity: &Quantity,
    problems: &mut Problems,
) {
    let own = distribution.problems();
    let reported: BTreeSet<&str> = own.iter().map(|(parameter, _)| *parameter).collect();
    for (parameter, reason) in &own {
        problems.error(format!("{path}.{parameter}"), reason.clone());
    }
    let parameters: Vec<(&str, f64)> = match *distribution {
        Distribution::Fixed { value } => vec![("value", value)],
        Distribution::Uniform { min, max } => vec![("min", min), ("max", max)],
        Distribution::LogNormal { median, p99, max } => [("median", median), ("p99", p99)]
            .into_iter()
            .chain(max.map(|max| ("max", max)))
            .collect(),
        Distribution::Trace { max, .. } => max.map(|max| ("max", max)).into_iter().collect(),
    };
    let mut beyond = BTreeSet::new();
    for (parameter, value) in parameters {
        if !reported.contains(parameter) && value > quantity.max {
            problems.error(
                format!("{path}.{parameter}"),
                format!(
                    "must be at most {} {} ({}), got {}",
                    show(quantity.max),
                    quantity.unit,
                    quantity.reason,
                    show(value)
                ),
            );
            beyond.insert(parameter);
        }
    }
    match *distribution {
        Distribution::LogNormal { median, p99, .. }
            if !reported.contains("p99")
                && !reported.contains("median")
                && !beyond.contains("p99")
                && p99 > median * MAX_LOGNORMAL_SPREAD =>
        {
            problems.error(
                format!("{path}.p99"),
                format!(
                    "must be at most {} times the median ({}): a wider spread puts the mean \
                     above the 99th percentile, got {}",
                    show(MAX_LOGNORMAL_SPREAD),
                    show(median),
                    show(p99)
                ),
            );
        }
        Distribution::Trace { scale, .. }
            if !reported.contains("scale") && scale > MAX_TRACE_SCALE =>
        {
            problems.error(
                format!("{path}.scale"),
                format!(
                    "must be at most {} (1 to 10 stretches serving traffic to RL lengths), got {}",
                    show(MAX_TRACE_SCALE),
                    show(scale)
                ),
            );
        }
        _ => {}
    }
}

fn placement_name(placement: RewardPlacement) -> &'static str {
    match placement {
        RewardPlacement::Serverless => "serverless",
        RewardPlacement::Local => "local",
        RewardPlacement::Environment => "environment",
    }
}

fn kind_name(kind: PoolKind) -> &'static str {
    match kind {
        PoolKind::Gpu => "gpu",
        PoolKind::Cpu => "cpu",
        PoolKind::Serverless => "serverless",
    }
}

fn check_pools(spec: &JobSpec, catalog: &Catalog, problems: &mut Problems) {
    if spec.pools.is_empty() {
        problems.error("spec.pools", "must list at least one pool");
        return;
    }
    problems.at_most_entries(
        "spec.pools",
        spec.pools.len(),
        MAX_POOLS,
        "pools (real inventories have a few dozen at most; the planner's search grows with \
         each one)",
    );
    let mut names = BTreeSet::new();
    for (i, pool) in spec.pools.iter().enumerate() {
        let path = format!("spec.pools[{i}]");
        problems.name(format!("{path}.name"), &pool.name, &mut names, "pool");
        let placement = crate::kubernetes::problems(pool.kubernetes.as_ref(), &path);
        problems.errors.extend(placement);
        let Some(kind) = pool.kind() else {
            problems.error(
                path,
                "must set exactly one of `gpu`, `cpu` and `serverless`".to_owned(),
            );
            continue;
        };
        match kind {
            PoolKind::Gpu => {
                if let Some(Err(unknown)) = pool.gpu.as_deref().map(|g| catalog.gpu(g)) {
                    problems.error(format!("{path}.gpu"), unknown.to_string());
                }
                check_count(pool, &path, "GPUs", problems);
                problems.within(
                    format!("{path}.gpusPerNode"),
                    pool.gpus_per_node(),
                    1,
                    MAX_GPUS_PER_NODE,
                    "GPUs (NVLink domains hold 8 to 72)",
                );
            }
            PoolKind::Cpu => {
                if let Some(Err(unknown)) = pool.cpu.as_deref().map(|c| catalog.cpu_shape(c)) {
                    problems.error(format!("{path}.cpu"), unknown.to_string());
                }
                check_count(pool, &path, "nodes", problems);
            }
            PoolKind::Serverless => {
                let platform = pool.serverless.as_deref().map(|s| catalog.serverless(s));
                if let Some(Err(unknown)) = &platform {
                    problems.error(format!("{path}.serverless"), unknown.to_string());
                }
                match pool.concurrency {
                    None => problems.error(
                        format!("{path}.concurrency"),
                        "is required for a serverless pool",
                    ),
                    Some(concurrency) => {
                        problems.within(
                            format!("{path}.concurrency"),
                            concurrency,
                            1,
                            MAX_CONCURRENCY,
                            "executions (account quotas reach tens of thousands)",
                        );
                        if let Some(Ok(platform)) = platform
                            && concurrency > i64::from(platform.default_concurrency)
                        {
                            problems.warn(
                                format!("{path}.concurrency"),
                                format!(
                                    "{concurrency} is above {}'s default account limit of {}; \
                                     make sure the quota was raised",
                                    platform.name, platform.default_concurrency
                                ),
                            );
                        }
                    }
                }
                if pool.count.is_some() {
                    problems.error(
                        format!("{path}.count"),
                        "does not apply to a serverless pool; set `concurrency`",
                    );
                }
            }
        }
        if kind != PoolKind::Gpu && pool.gpus_per_node.is_some() {
            problems.error(format!("{path}.gpusPerNode"), "only applies to a GPU pool");
        }
        for (r, role) in pool.roles.iter().enumerate() {
            let fits = match kind {
                PoolKind::Gpu => role.is_gpu_role(),
                PoolKind::Cpu => matches!(role, Role::Environment | Role::Reward),
                PoolKind::Serverless => *role == Role::Reward,
            };
            if !fits {
                problems.error(
                    format!("{path}.roles[{r}]"),
                    format!("a {} pool cannot take role {role:?}", kind_name(kind)),
                );
            }
        }
    }
    for (kind, unit) in [(PoolKind::Gpu, "GPUs"), (PoolKind::Cpu, "nodes")] {
        // Each pool is bounded on its own; together they are bounded the same, since the
        // simulator's books and the planner's search grow with the total.
        let total = spec
            .pools
            .iter()
            .filter(|p| p.kind() == Some(kind))
            .filter_map(|p| p.count)
            .filter(|&count| (1..=MAX_POOL_COUNT).contains(&count))
            .fold(0_i64, i64::saturating_add);
        if total > MAX_POOL_COUNT {
            problems.error(
                "spec.pools",
                format!(
                    "the {} pools must count at most {MAX_POOL_COUNT} {unit} together \
                     (several times the largest cluster built), got {total}",
                    kind_name(kind)
                ),
            );
        }
    }
    if !spec.pools.iter().any(|p| p.kind() == Some(PoolKind::Gpu)) {
        problems.error(
            "spec.pools",
            "must include at least one GPU pool for the policy model",
        );
    }
    if !spec.pools.iter().any(|p| p.kind() == Some(PoolKind::Cpu)) {
        problems.error(
            "spec.pools",
            "must include at least one CPU pool for environments",
        );
    }
}

fn check_count(pool: &PoolSpec, path: &str, unit: &str, problems: &mut Problems) {
    match pool.count {
        None => problems.error(
            format!("{path}.count"),
            format!("is required: number of {unit}"),
        ),
        Some(count) => {
            problems.at_least(format!("{path}.count"), count, 1);
            if count > MAX_POOL_COUNT {
                problems.error(
                    format!("{path}.count"),
                    format!(
                        "must be at most {MAX_POOL_COUNT} {unit} (several times the largest \
                         cluster built), got {count}"
                    ),
                );
            }
        }
    }
}

/// Bytes one serving replica needs: the weights plus the KV cache of one full context, the least
/// that lets it make progress on the longest trajectory.
pub fn replica_bytes(spec: &JobSpec) -> (f64, f64) {
    let longest_context = spec
        .tasks
        .iter()
        .map(|t| t.context_limit)
        .max()
        .unwrap_or(0);
    let kv = spec.model.kv_bytes_per_token() * longest_context as f64;
    (spec.model.weight_bytes(), kv)
}

fn check_model_fits(spec: &JobSpec, catalog: &Catalog, problems: &mut Problems) {
    let (weights, kv) = replica_bytes(spec);
    let needed = weights + kv;
    let mut shortfalls = Vec::new();
    let mut any_fits = false;
    for (i, pool) in spec.pools.iter().enumerate() {
        let (Some(gpu_name), Some(count)) = (&pool.gpu, pool.count) else {
            continue;
        };
        let Ok(gpu) = catalog.gpu(gpu_name) else {
            continue;
        };
        // A replica may span at most one node (tensor parallelism across nodes is too slow
        // for decode), and at most the pool.
        let gpus = count.min(pool.gpus_per_node());
        let usable = gpus as f64 * gpu.memory_bytes() * USABLE_MEMORY_FRACTION;
        if usable >= needed {
            any_fits = true;
        } else {
            shortfalls.push(format!(
                "\"{}\" ({gpus} x {} = {:.1} GB usable) is {:.1} GB short",
                pool.name,
                gpu.name,
                usable / 1e9,
                (needed - usable) / 1e9
            ));
            let pinned_to_model_work = pool.roles.iter().any(|r| r.is_gpu_role());
            let message = format!(
                "one replica needs {:.1} GB, but {gpus} x {} hold {:.1} GB usable",
                needed / 1e9,
                gpu.name,
                usable / 1e9
            );
            if pinned_to_model_work {
                problems.error(format!("spec.pools[{i}].roles"), message);
            } else {
                problems.warn(format!("spec.pools[{i}]"), message);
            }
        }
    }
    if !any_fits {
        problems.error(
            "spec.model",
            format!(
                "one replica needs {:.1} GB (weights {:.1} GB + KV cache of one {}-token context \
                 {:.1} GB), and no GPU pool can hold it within one node: {}",
                needed / 1e9,
                weights / 1e9,
                spec.tasks
                    .iter()
                    .map(|t| t.context_limit)
                    .max()
                    .unwrap_or(0),
                kv / 1e9,
                shortfalls.join("; ")
            ),
        );
    }
}
