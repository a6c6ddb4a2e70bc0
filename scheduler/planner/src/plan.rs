//! From a job to a plan: the planning problem built from the spec and the catalogue, the search,
//! and the result as the core's [`Placement`] with its predicted figures and an explanation.

use rollfleet_catalog::Catalog;
use rollfleet_core::{Placement, ReplicaConfig, ServeRole, TrainerConfig};
use rollfleet_spec::{Distribution, JobSpec, PoolKind, Role as SpecRole};
use serde::Serialize;

use crate::predict::{self, Candidate, GpuPool, Group, Prediction, Problem, Role, ServerlessPool};
use crate::profile::ProfileStore;
use crate::roofline::{self, Bound, Efficiency, GpuRates, WorkKind};
use crate::search;
use crate::workload::Workload;

/// Share of device memory the planner lets weights and KV cache use (as the job spec's
/// validation does).
pub use rollfleet_spec::USABLE_MEMORY_FRACTION;

/// Bytes of device memory training needs per parameter: BF16 weights and gradients (2 + 2), FP32
/// master weights and two Adam moments (4 + 4 + 4), sharded over the trainer's GPUs as FSDP /
/// ZeRO-3 do. Activations are not counted.
pub const TRAIN_BYTES_PER_PARAMETER: f64 = 16.0;

/// A cluster inventory: pools in the job spec's own format, replacing the job's pools.
pub use rollfleet_spec::Inventory;

/// Why no plan was made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The planning was asked to stop ([`crate::cancel`]).
    #[error("planning was stopped before it found a placement")]
    Cancelled,
    /// The job has no GPU pool.
    #[error("no GPU pool: the policy needs GPUs to serve and train")]
    NoGpuPool,
    /// A pool names a GPU the catalogue does not know.
    #[error("pool \"{pool}\": {message}")]
    UnknownGpu {
        /// The pool.
        pool: String,
        /// The catalogue's message.
        message: String,
    },
    /// No GPU pool can hold one serving replica within a node.
    #[error(
        "the model fits no GPU pool: one replica needs {needed_gb:.1} GB ({weights_gb:.1} GB of \
         weights + {context_gb:.1} GB of KV cache for one {context}-token context); the closest, \
         pool \"{pool}\" ({gpus} x {gpu} in one node), has {usable_gb:.1} GB usable: \
         {short_gb:.1} GB short"
    )]
    DoesNotFit {
        /// The pool that came closest.
        pool: String,
        /// Its GPU product.
        gpu: String,
        /// GPUs of one node of it.
        gpus: u32,
        /// Bytes one replica needs, GB.
        needed_gb: f64,
        /// Weights, GB.
        weights_gb: f64,
        /// KV cache of one longest context, GB.
        context_gb: f64,
        /// Longest context, tokens.
        context: u64,
        /// Usable memory of one node, GB.
        usable_gb: f64,
        /// How much is missing, GB.
        short_gb: f64,
    },
    /// No pool can hold the training state.
    #[error(
        "no GPU pool can train: training needs {needed_gb:.1} GB ({bytes_per_param} bytes per \
         parameter); the largest, pool \"{pool}\", has {usable_gb:.1} GB usable: {short_gb:.1} \
         GB short"
    )]
    NoTrainer {
        /// The pool that came closest.
        pool: String,
        /// Bytes training needs, GB.
        needed_gb: f64,
        /// Bytes per parameter assumed.
        bytes_per_param: f64,
        /// Its usable memory, GB.
        usable_gb: f64,
        /// How much is missing, GB.
        short_gb: f64,
    },
    /// No CPU pool for environments.
    #[error("no CPU pool with vCPUs for environments")]
    NoEnvironmentPool,
    /// Nothing in the space can run the job.
    #[error("no placement can run the job: {0}")]
    Infeasible(String),
}

/// One role's placement and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolePlan {
    /// `train`, `prefill`, `decode` or `generate`.
    pub role: String,
    /// The pool.
    pub pool: String,
    /// Its GPU product.
    pub gpu: String,
    /// Replicas (1 for the trainer).
    pub replicas: u32,
    /// GPUs per replica (the trainer: all its GPUs).
    pub tp: u32,
    /// The explanation: what bounds the work on each candidate GPU, and why this one wins.
    pub why: String,
}

/// Per-pool predicted use.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolPlan {
    /// Pool name.
    pub pool: String,
    /// `gpu`, `cpu` or `serverless`.
    pub kind: String,
    /// What it does.
    pub does: String,
    /// Predicted busy share.
    pub utilisation: f64,
    /// Environment slots (CPU pools) or serverless concurrency the plan wants (serverless).
    pub slots: Option<u64>,
}

/// A plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The placement the core runs.
    pub placement: Placement,
    /// The candidate, as the predictor saw it.
    pub candidate: Candidate,
    /// The prediction.
    pub prediction: Prediction,
    /// One entry per role and pool.
    pub roles: Vec<RolePlan>,
    /// One entry per pool.
    pub pools: Vec<PoolPlan>,
    /// Search nodes whose bound was computed.
    pub search_nodes: u64,
    /// The shares of peak the prediction used per GPU pool and work kind, and their sources.
    pub profiles: Vec<ProfileFigure>,
}

/// One share of peak the prediction used, and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProfileFigure {
    /// The GPU pool.
    pub pool: String,
    /// `prefill` (share of peak FLOP/s) or `decode` (share of peak memory bandwidth).
    pub kind: WorkKind,
    /// The share.
    pub share: f64,
    /// `model`, `measured` or `probed`.
    pub source: crate::profile::Source,
    /// Samples behind a measured figure (0 otherwise).
    pub samples: usize,
    /// Median absolute deviation of a measured figure.
    pub spread: Option<f64>,
    /// Whether a measured figure came from emulated or simulated hardware (the model's own
    /// durations), not a GPU.
    pub modelled: bool,
}

fn longest_context(spec: &JobSpec) -> u64 {
    spec.tasks
        .iter()
        .map(|t| t.context_limit.max(0) as u64)
        .max()
        .unwrap_or(0)
}

/// Builds the planning problem of a job: tensor-parallel degrees searched on small inventories,
/// set by the core's rule on large ones (see [`problem_with`], [`SEARCH_TP_MAX_POOLS`]).
pub fn problem(
    spec: &JobSpec,
    catalog: &Catalog,
    mean: &dyn Fn(&Distribution) -> f64,
    eff: &Efficiency,
) -> Result<Problem, PlanError> {
    problem_profiled(spec, catalog, mean, eff, &ProfileStore::default())
}

/// [`problem`] with measured and probed profiles: each pool's achieved shares of peak come
/// from the store where it has them (probed, then measured once ready), else from `eff`.
pub fn problem_profiled(
    spec: &JobSpec,
    catalog: &Catalog,
    mean: &dyn Fn(&Distribution) -> f64,
    eff: &Efficiency,
    profiles: &ProfileStore,
) -> Result<Problem, PlanError> {
    let gpu_pools = spec
        .pools
        .iter()
        .filter(|p| p.kind() == Some(PoolKind::Gpu))
        .count();
    problem_with(
        spec,
        catalog,
        mean,
        eff,
        gpu_pools <= SEARCH_TP_MAX_POOLS,
        profiles,
    )
}

/// Inventories with at most this many GPU pools have their tensor-parallel degrees searched
/// too (exactly, in milliseconds); larger ones use the core's rule per pool, which keeps the
/// exact search over thousands of GPUs in tens of milliseconds (see `benches/plan.rs`).
pub const SEARCH_TP_MAX_POOLS: usize = 4;

/// Builds the planning problem of a job. With `search_tp`, every power-of-two degree within a
/// node that holds the weights and one longest context is a choice of the search; without, each
/// pool gets one degree by the core's rule (the smallest that leaves as much memory for KV cache
/// as the weights take), which keeps the search over thousands of GPUs well under a second.
pub fn problem_with(
    spec: &JobSpec,
    catalog: &Catalog,
    mean: &dyn Fn(&Distribution) -> f64,
    eff: &Efficiency,
    search_tp: bool,
    profiles: &ProfileStore,
) -> Result<Problem, PlanError> {
    let model = &spec.model;
    let weights = model.weight_bytes();
    let kv = model.kv_bytes_per_token().max(1.0);
    let context = longest_context(spec);
    let replica_bytes = weights + kv * context as f64;
    let train_memory = TRAIN_BYTES_PER_PARAMETER * model.parameters;
    let mut gpu_pools = Vec::new();
    let mut closest: Option<(f64, String, String, u32)> = None;
    // As in the spec: a pool pinned to `train` keeps training to itself; otherwise any unpinned
    // pool may train.
    let train_pinned = spec
        .pools
        .iter()
        .any(|p| p.roles.contains(&SpecRole::Train));
    let mut vcpus = 0.0;
    let mut cpu_price = 0.0;
    let mut serverless = Vec::new();
    for (i, pool) in spec.pools.iter().enumerate() {
        match pool.kind() {
            Some(PoolKind::Gpu) => {
                let name = pool.gpu.as_deref().unwrap_or_default();
                let gpu = catalog.gpu(name).map_err(|e| PlanError::UnknownGpu {
                    pool: pool.name.clone(),
                    message: e.to_string(),
                })?;
                let count = u32::try_from(pool.count.unwrap_or(0).max(0)).unwrap_or(u32::MAX);
                let per_node = u32::try_from(pool.gpus_per_node().max(1)).unwrap_or(8);
                let share = |kind| {
                    profiles.effective(
                        kind,
                        &pool.name,
                        &gpu.name,
                        gpu.peak_flops(),
                        gpu.memory_bandwidth_bytes_per_s(),
                        eff,
                    )
                };
                let profile = [share(WorkKind::Prefill), share(WorkKind::Decode)];
                let pool_eff = Efficiency {
                    compute: profile[0].share,
                    bandwidth: profile[1].share,
                    link: eff.link,
                };
                let rates = GpuRates::of(gpu, &pool_eff);
                let limit = per_node.min(count).max(1);
                let fitting: Vec<u32> = (0..7)
                    .map(|s| 1u32 << s)
                    .filter(|&t| t <= limit)
                    .filter(|&t| t as f64 * rates.memory * USABLE_MEMORY_FRACTION >= replica_bytes)
                    .collect();
                let tps = if search_tp {
                    fitting
                } else {
                    // The core's rule: the smallest degree that leaves at least as much memory
                    // for KV cache as the weights take (so batches amortise the weight reads),
                    // else the smallest that fits.
                    let roomy = fitting.iter().copied().find(|&t| {
                        t as f64 * rates.memory * USABLE_MEMORY_FRACTION - weights
                            >= weights.max(kv * context as f64)
                    });
                    roomy.or(fitting.first().copied()).into_iter().collect()
                };
                let node_usable = limit as f64 * rates.memory * USABLE_MEMORY_FRACTION;
                if closest.as_ref().is_none_or(|(u, ..)| node_usable > *u) {
                    closest = Some((node_usable, pool.name.clone(), gpu.name.clone(), limit));
                }
                let pinned = &pool.roles;
                let serve_roles: Vec<Role> = if pinned.is_empty() {
                    vec![Role::Prefill, Role::Decode, Role::Generate]
                } else {
                    pinned
                        .iter()
                        .filter_map(|r| match r {
                            SpecRole::Prefill => Some(Role::Prefill),
                            SpecRole::Decode => Some(Role::Decode),
                            SpecRole::Generate => Some(Role::Generate),
                            _ => None,
                        })
                        .collect()
                };
                gpu_pools.push(GpuPool {
                    name: pool.name.clone(),
                    spec_index: i,
                    rates,
                    peak_flops: gpu.peak_flops(),
                    peak_bandwidth: gpu.memory_bandwidth_bytes_per_s(),
                    count,
                    per_node,
                    tps,
                    serve_roles,
                    may_train: if train_pinned {
                        pinned.contains(&SpecRole::Train)
                    } else {
                        pinned.is_empty()
                    },
                    profile,
                });
            }
            Some(PoolKind::Cpu) => {
                if let Some(shape) = pool.cpu.as_deref().and_then(|c| catalog.cpu_shape(c).ok()) {
                    let nodes = pool.count.unwrap_or(0).max(0) as f64;
                    if pool.roles.is_empty() || pool.roles.contains(&SpecRole::Environment) {
                        vcpus += shape.vcpus as f64 * nodes;
                    }
                    cpu_price += shape.price_per_hour_usd * nodes;
                }
            }
            Some(PoolKind::Serverless) => {
                let platform = pool
                    .serverless
                    .as_deref()
                    .and_then(|s| catalog.serverless(s).ok());
                let default = platform.map_or(1, |p| p.default_concurrency as i64);
                serverless.push(ServerlessPool {
                    spec_index: i,
                    concurrency: pool.concurrency.unwrap_or(default).max(1) as f64,
                    price_per_gb_s: platform.map_or(0.0, |p| p.price_per_gb_second_usd),
                });
            }
            None => {}
        }
    }
    if gpu_pools.is_empty() {
        return Err(PlanError::NoGpuPool);
    }
    if gpu_pools.iter().all(|p| p.tps.is_empty()) {
        let (usable, pool, gpu, gpus) = closest.unwrap_or((0.0, String::new(), String::new(), 0));
        return Err(PlanError::DoesNotFit {
            pool,
            gpu,
            gpus,
            needed_gb: replica_bytes / 1e9,
            weights_gb: weights / 1e9,
            context_gb: kv * context as f64 / 1e9,
            context,
            usable_gb: usable / 1e9,
            short_gb: (replica_bytes - usable) / 1e9,
        });
    }
    let trainable = gpu_pools
        .iter()
        .filter(|p| p.may_train)
        .map(|p| (p.count as f64 * p.rates.memory * USABLE_MEMORY_FRACTION, p))
        .fold(None, |best: Option<(f64, &GpuPool)>, x| match best {
            Some(b) if b.0 >= x.0 => Some(b),
            _ => Some(x),
        });
    match trainable {
        Some((usable, _)) if usable >= train_memory => {}
        Some((usable, pool)) => {
            return Err(PlanError::NoTrainer {
                pool: pool.name.clone(),
                needed_gb: train_memory / 1e9,
                bytes_per_param: TRAIN_BYTES_PER_PARAMETER,
                usable_gb: usable / 1e9,
                short_gb: (train_memory - usable) / 1e9,
            });
        }
        None => {
            return Err(PlanError::Infeasible(
                "every GPU pool is pinned to roles without `train`".into(),
            ));
        }
    }
    if vcpus <= 0.0 {
        return Err(PlanError::NoEnvironmentPool);
    }
    let mut workload = Workload::from_spec(spec, mean);
    workload.measured(spec, profiles);
    let reserved_context = {
        let mut total = 0.0;
        for (t, task) in workload.tasks.iter().zip(&spec.tasks) {
            let max_action = task
                .action_tokens
                .upper_bound()
                .unwrap_or(t.action)
                .min(task.context_limit.max(1) as f64);
            total += t.share * (t.decode_context + max_action);
        }
        total
    };
    let mut gb_s = 0.0;
    for (t, task) in workload.tasks.iter().zip(&spec.tasks) {
        if t.serverless_pool.is_some()
            && let Some(r) = spec.rewards.iter().find(|r| r.name == task.reward)
        {
            gb_s += workload.batch * t.share * t.reward_s * r.memory_mb.max(0) as f64 / 1024.0;
        }
    }
    Ok(Problem {
        gpu_pools,
        vcpus,
        cpu_price_per_hour: cpu_price,
        serverless,
        workload,
        active_weight_bytes: model.active_weight_bytes(),
        weight_reads: model.weight_reads(),
        weight_bytes: weights,
        kv_bytes_per_token: kv,
        flops_per_token: model.forward_flops_per_token(),
        attention_flops: model.attention_flops_per_token(1.0),
        train_flops_per_token: model.train_flops_per_token(),
        train_memory_bytes: train_memory,
        link_bytes_per_s: spec.network.cross_pool_gbps * 1e9 * eff.link,
        max_seqs: rollfleet_core::placement::MAX_SEQS_PER_REPLICA as f64,
        pd_min_prefill_tokens: rollfleet_core::config::PD_MIN_PREFILL_TOKENS as f64,
        usable_memory: USABLE_MEMORY_FRACTION,
        reserved_context,
        serverless_gb_s_per_step: gb_s,
        pinned_trainer: None,
    })
}

/// The core's placement for a candidate.
pub fn placement(p: &Problem, c: &Candidate) -> Placement {
    let disaggregated = c
        .groups
        .iter()
        .any(|g| g.role == Role::Prefill && g.replicas > 0);
    let mut groups: Vec<&Group> = c.groups.iter().filter(|g| g.replicas > 0).collect();
    groups.sort_by_key(|g| (p.gpu_pools.get(g.pool).map_or(0, |x| x.spec_index), g.role));
    let mut replicas = Vec::new();
    for g in groups {
        let Some(pool) = p.gpu_pools.get(g.pool) else {
            continue;
        };
        let role = match g.role {
            Role::Prefill => ServeRole::Prefill,
            Role::Decode if disaggregated => ServeRole::Decode,
            Role::Decode | Role::Generate => ServeRole::Generate,
        };
        let kv = ((g.tp as f64 * pool.rates.memory * p.usable_memory - p.weight_bytes)
            / p.kv_bytes_per_token)
            .max(0.0) as u64;
        for _ in 0..g.replicas {
            replicas.push(ReplicaConfig {
                pool: pool.spec_index as u32,
                role,
                gpus: g.tp,
                kv_capacity_tokens: kv,
                max_seqs: p.max_seqs as u32,
            });
        }
    }
    let trainer = p.gpu_pools.get(c.trainer_pool);
    Placement {
        replicas,
        trainer: TrainerConfig {
            pool: trainer.map_or(0, |t| t.spec_index as u32),
            gpus: c.trainer_gpus,
            nodes: trainer.map_or(1, |t| c.trainer_gpus.div_ceil(t.per_node.max(1)).max(1)),
        },
        colocated: false,
    }
}

fn explain_role(
    p: &Problem,
    role: &str,
    work: roofline::Work,
    shape: &str,
    chosen: usize,
) -> String {
    let mut parts = Vec::new();
    let mut products: Vec<&GpuPool> = Vec::new();
    for pool in &p.gpu_pools {
        if !products.iter().any(|x| x.rates.gpu == pool.rates.gpu) {
            products.push(pool);
        }
    }
    let intensity = work.intensity();
    for pool in &products {
        parts.push(format!(
            "{} ridge {:.0}: {}",
            pool.rates.gpu,
            pool.rates.ridge,
            work.bound_on(pool.rates.ridge).name()
        ));
    }
    let Some(chosen) = p.gpu_pools.get(chosen) else {
        return String::new();
    };
    let bound = work.bound_on(chosen.rates.ridge);
    let figure = |g: &GpuPool| match bound {
        Bound::Compute => g.rates.flops / 1e12 / g.rates.price_per_hour.max(1e-9),
        Bound::Bandwidth => g.rates.bandwidth / 1e9 / g.rates.price_per_hour.max(1e-9),
    };
    let unit = match bound {
        Bound::Compute => "achieved TFLOP/s per $/h",
        Bound::Bandwidth => "achieved GB/s per $/h",
    };
    let mut per_dollar: Vec<String> = products
        .iter()
        .map(|g| format!("{} {:.0}", g.rates.gpu, figure(g)))
        .collect();
    per_dollar.dedup();
    format!(
        "{role} of {shape} runs at {intensity:.1} FLOP/byte ({}); on {} it is {}, so {} decides: {unit}: {}",
        parts.join(", "),
        chosen.rates.gpu,
        bound.name(),
        match bound {
            Bound::Compute => "FLOP/s",
            Bound::Bandwidth => "memory bandwidth",
        },
        per_dollar.join(" vs "),
    )
}

/// Plans a job: the placement [`crate::search::choose`] picks, with explanations.
pub fn plan(
    spec: &JobSpec,
    catalog: &Catalog,
    mean: &dyn Fn(&Distribution) -> f64,
) -> Result<Plan, PlanError> {
    let p = problem(spec, catalog, mean, &Efficiency::default())?;
    let found = search::choose(&p);
    if crate::cancel::requested() {
        return Err(PlanError::Cancelled);
    }
    let found = found.ok_or_else(|| {
        PlanError::Infeasible(
            "no combination of trainer and serving replicas leaves room to decode".into(),
        )
    })?;
    describe(spec, &p, &found.candidate, found.nodes)
}

/// The figures and explanations of a candidate (the plan's, or a fixed one to compare).
pub fn describe(
    spec: &JobSpec,
    p: &Problem,
    c: &Candidate,
    search_nodes: u64,
) -> Result<Plan, PlanError> {
    let prediction = predict::predict(p, c)
        .ok_or_else(|| PlanError::Infeasible("the placement cannot decode at all".into()))?;
    let w = &p.workload;
    let mut roles = Vec::new();
    if let Some(t) = p.gpu_pools.get(c.trainer_pool) {
        let train = roofline::train(&spec.model, w.batch * w.train_tokens());
        roles.push(RolePlan {
            role: "train".into(),
            pool: t.name.clone(),
            gpu: t.rates.gpu.clone(),
            replicas: 1,
            tp: c.trainer_gpus,
            why: format!(
                "{}; {} GPUs train a step in {:.1} s (the trainer size the planner predicts fastest with the serving replicas it leaves)",
                explain_role(p, "training", train, "one step's tokens", c.trainer_pool),
                c.trainer_gpus,
                prediction.terms.train_s
            ),
        });
    }
    let mean_prompt: f64 = w.tasks.iter().map(|t| t.share * t.prompt).sum();
    let context: f64 = {
        let tokens: f64 = w.tasks.iter().map(|t| t.share * t.turns * t.action).sum();
        w.tasks
            .iter()
            .map(|t| t.share * t.turns * t.action * t.decode_context)
            .sum::<f64>()
            / tokens.max(1e-12)
    };
    for (i, g) in c.groups.iter().enumerate().filter(|(_, g)| g.replicas > 0) {
        let Some(pool) = p.gpu_pools.get(g.pool) else {
            continue;
        };
        let why = match g.role {
            Role::Prefill => explain_role(
                p,
                "prefill",
                roofline::prefill(&spec.model, mean_prompt, 0.0),
                &format!("a {mean_prompt:.0}-token prompt"),
                g.pool,
            ),
            Role::Decode | Role::Generate => {
                // The batch the router gives this group's replicas (at least one sequence, as
                // a replica that decodes at all does).
                let b = prediction
                    .decode_batch
                    .get(i)
                    .copied()
                    .unwrap_or(1.0)
                    .clamp(1.0, p.max_seqs);
                explain_role(
                    p,
                    "decode",
                    predict::decode_work_at(p, b, context),
                    &format!("one token for a batch of {b:.0} at {context:.0} context"),
                    g.pool,
                )
            }
        };
        let source = |i: usize, what: &str| {
            let e = pool.profile[i];
            match e.source {
                crate::profile::Source::Measured => format!(
                    "{what} at {:.0}% of peak (measured: median of {} samples, spread {:.1} points)",
                    e.share * 100.0,
                    e.samples,
                    e.spread.unwrap_or(0.0) * 100.0
                ),
                crate::profile::Source::Probed => {
                    format!("{what} at {:.0}% of peak (probed)", e.share * 100.0)
                }
                crate::profile::Source::Model => {
                    format!(
                        "{what} at {:.0}% of peak (model assumption)",
                        e.share * 100.0
                    )
                }
            }
        };
        let figures = match g.role {
            Role::Prefill => source(0, "prefill"),
            Role::Decode | Role::Generate => {
                format!("{}, {}", source(1, "decode"), source(0, "prefill"))
            }
        };
        let why = format!("{why}; on {}: {figures}", pool.name);
        roles.push(RolePlan {
            role: g.role.name().into(),
            pool: pool.name.clone(),
            gpu: pool.rates.gpu.clone(),
            replicas: g.replicas,
            tp: g.tp,
            why,
        });
    }
    let mut pools = Vec::new();
    let rate = w.batch / prediction.step_s;
    for (i, pool) in spec.pools.iter().enumerate() {
        match pool.kind() {
            Some(PoolKind::Gpu) => {
                let index = p.gpu_pools.iter().position(|g| g.spec_index == i);
                let mut does: Vec<String> = Vec::new();
                if let Some(k) = index {
                    if c.trainer_pool == k {
                        does.push(format!("train x{}", c.trainer_gpus));
                    }
                    for g in c.groups.iter().filter(|g| g.pool == k && g.replicas > 0) {
                        does.push(format!("{} {} x TP{}", g.role.name(), g.replicas, g.tp));
                    }
                }
                pools.push(PoolPlan {
                    pool: pool.name.clone(),
                    kind: "gpu".into(),
                    does: if does.is_empty() {
                        "idle".into()
                    } else {
                        does.join(", ")
                    },
                    utilisation: index
                        .and_then(|k| prediction.gpu_utilisation.get(k).copied())
                        .unwrap_or(0.0),
                    slots: None,
                });
            }
            Some(PoolKind::Cpu) => {
                let env_cpus: f64 = w.tasks.iter().map(|t| t.share * t.env_cpus).sum();
                let nodes = pool.count.unwrap_or(0).max(0) as f64;
                let vcpus = nodes * p.vcpus
                    / spec
                        .pools
                        .iter()
                        .filter(|q| q.kind() == Some(PoolKind::Cpu))
                        .map(|q| q.count.unwrap_or(0).max(0) as f64)
                        .sum::<f64>()
                        .max(1.0);
                pools.push(PoolPlan {
                    pool: pool.name.clone(),
                    kind: "cpu".into(),
                    does: "environments".into(),
                    utilisation: prediction.env_utilisation,
                    slots: Some((vcpus / env_cpus.max(1e-3)).floor() as u64),
                });
            }
            Some(PoolKind::Serverless) => {
                let busy: f64 = w
                    .tasks
                    .iter()
                    .filter(|t| t.serverless_pool == Some(i))
                    .map(|t| rate * t.share * t.reward_s)
                    .sum();
                let conc = p
                    .serverless
                    .iter()
                    .find(|s| s.spec_index == i)
                    .map_or(1.0, |s| s.concurrency);
                // Rewards arrive in bursts as groups finish: ask for twice the mean concurrency,
                // within the pool's limit.
                pools.push(PoolPlan {
                    pool: pool.name.clone(),
                    kind: "serverless".into(),
                    does: "rewards".into(),
                    utilisation: (busy / conc).min(1.0),
                    slots: Some((2.0 * busy).ceil().clamp(1.0, conc) as u64),
                });
            }
            None => {}
        }
    }
    let profiles = p
        .gpu_pools
        .iter()
        .flat_map(|g| {
            [WorkKind::Prefill, WorkKind::Decode]
                .into_iter()
                .zip(g.profile)
                .map(|(kind, e)| ProfileFigure {
                    pool: g.name.clone(),
                    kind,
                    share: e.share,
                    source: e.source,
                    samples: e.samples,
                    spread: e.spread,
                    modelled: e.modelled,
                })
        })
        .collect();
    Ok(Plan {
        placement: placement(p, c),
        candidate: c.clone(),
        prediction,
        roles,
        pools,
        search_nodes,
        profiles,
    })
}
