//! Validation of a parsed job: every problem at once, each with its field path and reason.
//!
//! Validation never stops at the first problem and never panics: it walks the whole spec, looks
//! every name up in the catalogue (the built-in one plus the job's own additions) and checks the
//! cross-references (task to reward, reward to pool) and the one global constraint that most
//! often goes wrong in practice: that a replica of the model fits in some GPU pool at all.

use std::collections::BTreeSet;

use rollfleet_catalog::Catalog;
use serde::Serialize;

use crate::manifest::{
    API_VERSION, JobManifest, JobSpec, KIND, PoolKind, PoolSpec, RewardPlacement, Role,
};

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
    check_tasks(spec, &mut problems);
    check_rewards(spec, &mut problems);
    check_pools(spec, &catalog, &mut problems);
    if problems.errors.is_empty() {
        // The fit check needs valid numbers everywhere; with other errors it would only add noise.
        check_model_fits(spec, &catalog, &mut problems);
    }
    if !spec.network.cross_pool_gbps.is_finite() || spec.network.cross_pool_gbps <= 0.0 {
        problems.error(
            "spec.network.crossPoolGBps",
            format!("must be > 0, got {}", spec.network.cross_pool_gbps),
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
    for (i, gpu) in spec.catalog.gpus.iter().enumerate() {
        let path = format!("spec.catalog.gpus[{i}]");
        let figures = [
            ("bf16DenseTflops", gpu.bf16_dense_tflops),
            ("memoryGb", gpu.memory_gb),
            ("memoryBandwidthGBps", gpu.memory_bandwidth_gbps),
            ("interconnectGBps", gpu.interconnect_gbps),
        ];
        let mut valid = !gpu.name.trim().is_empty();
        if !valid {
            problems.error(format!("{path}.name"), "must not be empty");
        }
        for (field, value) in figures {
            if !value.is_finite() || value <= 0.0 {
                problems.error(
                    format!("{path}.{field}"),
                    format!("must be > 0, got {value}"),
                );
                valid = false;
            }
        }
        if !gpu.price_per_hour_usd.is_finite() || gpu.price_per_hour_usd < 0.0 {
            problems.error(
                format!("{path}.pricePerHourUsd"),
                format!("must be >= 0, got {}", gpu.price_per_hour_usd),
            );
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
        }
        if !shape.memory_gib.is_finite() || shape.memory_gib <= 0.0 {
            problems.error(
                format!("{path}.memoryGib"),
                format!("must be > 0, got {}", shape.memory_gib),
            );
            valid = false;
        }
        if valid {
            catalog.add_cpu_shape(shape.clone());
        }
    }
    catalog
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
    problems.at_least("spec.model.layers", model.layers, 1);
    problems.at_least("spec.model.hiddenSize", model.hidden_size, 1);
    problems.at_least("spec.model.kvHeads", model.kv_heads, 1);
    problems.at_least("spec.model.headDim", model.head_dim, 1);
    if ![1, 2, 4].contains(&model.dtype_bytes) {
        problems.error(
            "spec.model.dtypeBytes",
            format!("must be 1, 2 or 4, got {}", model.dtype_bytes),
        );
    }
}

fn check_rl(spec: &JobSpec, problems: &mut Problems) {
    let rl = &spec.rl;
    problems.at_least("spec.rl.groupSize", rl.group_size, 1);
    problems.at_least("spec.rl.rolloutBatchSize", rl.rollout_batch_size, 1);
    problems.at_least("spec.rl.trainBatchSize", rl.train_batch_size, 1);
    problems.at_least("spec.rl.maxStaleness", rl.max_staleness, 0);
    problems.at_least("spec.rl.steps", rl.steps, 1);
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

fn check_tasks(spec: &JobSpec, problems: &mut Problems) {
    if spec.tasks.is_empty() {
        problems.error("spec.tasks", "must list at least one task");
        return;
    }
    let rewards: BTreeSet<&str> = spec.rewards.iter().map(|r| r.name.as_str()).collect();
    let mut names = BTreeSet::new();
    let mut share_sum = 0.0;
    let mut shares_valid = true;
    for (i, task) in spec.tasks.iter().enumerate() {
        let path = format!("spec.tasks[{i}]");
        problems.name(format!("{path}.name"), &task.name, &mut names, "task");
        if task.environment.trim().is_empty() {
            problems.error(format!("{path}.environment"), "must not be empty");
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
        problems.at_least(format!("{path}.maxTurns"), task.max_turns, 1);
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
            ("turns", task.turns.as_deref()),
            ("promptTokens", Some(&*task.prompt_tokens)),
            ("actionTokens", Some(&*task.action_tokens)),
            ("observationTokens", Some(&*task.observation_tokens)),
            ("envStepMs", Some(&*task.env_step_ms)),
        ];
        for (field, distribution) in distributions {
            for (parameter, reason) in distribution.map(|d| d.problems()).unwrap_or_default() {
                problems.error(format!("{path}.{field}.{parameter}"), reason);
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
            problems.error(
                format!("{path}.reward"),
                format!(
                    "unknown reward \"{}\" (known: {})",
                    task.reward,
                    rewards.iter().copied().collect::<Vec<_>>().join(", ")
                ),
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
    let mut names = BTreeSet::new();
    for (i, reward) in spec.rewards.iter().enumerate() {
        let path = format!("spec.rewards[{i}]");
        problems.name(format!("{path}.name"), &reward.name, &mut names, "reward");
        for (parameter, reason) in reward.latency_ms.problems() {
            problems.error(format!("{path}.latencyMs.{parameter}"), reason);
        }
        problems.at_least(format!("{path}.memoryMb"), reward.memory_mb, 128);
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
                        format!(
                            "unknown pool \"{pool_name}\" (known: {})",
                            spec.pools
                                .iter()
                                .map(|p| p.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
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
    let mut names = BTreeSet::new();
    for (i, pool) in spec.pools.iter().enumerate() {
        let path = format!("spec.pools[{i}]");
        problems.name(format!("{path}.name"), &pool.name, &mut names, "pool");
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
                problems.at_least(format!("{path}.gpusPerNode"), pool.gpus_per_node(), 1);
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
                        problems.at_least(format!("{path}.concurrency"), concurrency, 1);
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
                    format!("must be at most {MAX_POOL_COUNT} {unit}, got {count}"),
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
