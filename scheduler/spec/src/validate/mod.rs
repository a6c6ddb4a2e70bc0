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

mod model_fit;
mod pools;
mod problems;
mod rewards;
mod rl;
mod tasks;

pub use model_fit::replica_bytes;
use model_fit::{check_model, check_model_fits};
use pools::{check_pools, kind_name, placement_name, price_valid};
pub use problems::Problem;
use problems::{MILLISECONDS, Problems, Quantity, TOKENS, TURNS, show, unknown_name};
use rewards::check_rewards;
use rl::check_rl;
use tasks::{check_distribution, check_environments, check_tasks};

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

/// Routed experts per MoE layer: published models have up to 384 (Kimi K2), far below this.
pub const MAX_EXPERTS: i64 = 4096;

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
