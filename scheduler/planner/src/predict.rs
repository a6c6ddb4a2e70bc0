//! The step-time predictor: how long one RL step takes under a candidate placement.
//!
//! rollfleet runs rollout and training concurrently, so a step takes as long as the slowest of:
//!
//! - each resource's work over its capacity (training on the trainer's GPUs; prefill on the
//!   prefill replicas; decode tokens against the decode replicas' bandwidth, KV memory and batch
//!   slots; environment vCPU-seconds; serverless concurrency-seconds);
//! - the latency term: the core keeps at most `N` trajectories started and not yet trained on
//!   (its admission window, [`Workload::window`]), and a trajectory holds its slot until its whole
//!   group is trained, so by Little's law a step of `B` trajectories takes `B x L / N`, where `L`
//!   is the mean lifetime of the slowest member of a group;
//! - the staleness term: a group must finish within `maxStaleness` versions.
//!
//! Latency depends on the throughput asked for: decode replicas batch every running sequence,
//! so each token takes `(W + b x KV x c) / bandwidth` for a batch of `b`, and the more tokens a
//! second are asked for, the larger `b` and the slower each token. The router balances replicas
//! so that every busy one runs at the same per-token time `tau` (water-filling: a replica too
//! slow to beat `tau` even alone gets nothing), and Little's law on decoding sequences gives
//! `sum_i b_i(tau) = tokens per second x tau`. Queues at prefill replicas add the M/D/1 wait.
//! The step time is the smallest `T` that is at least every term evaluated at the throughput `B /
//! T`; every term only shrinks as `T` grows, so bisection finds it.
//!
//! Every term only shrinks as capacity is added (a faster or an extra replica never slows the
//! predicted step), which is what lets the search bound partial placements by relaxing the rest.

use serde::Serialize;

use crate::roofline::{self, GpuRates};
use crate::workload::Workload;

/// What a group of serving replicas does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Prefill only (first turns), handing KV caches to decode replicas.
    Prefill,
    /// Decode, prefilling later turns' observations locally (their KV cache is already there).
    Decode,
    /// Prefill and decode colocated.
    Generate,
}

impl Role {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Generate => "generate",
        }
    }
}

/// Identical replicas on one pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Group {
    /// Index into [`Problem::gpu_pools`].
    pub pool: usize,
    /// What they do.
    pub role: Role,
    /// GPUs per replica (tensor-parallel degree).
    pub tp: u32,
    /// How many.
    pub replicas: u32,
}

/// A placement as the predictor sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Candidate {
    /// Serving replicas.
    pub groups: Vec<Group>,
    /// The pool that trains (index into [`Problem::gpu_pools`]).
    pub trainer_pool: usize,
    /// GPUs it trains on.
    pub trainer_gpus: u32,
}

/// A GPU pool the planner may use.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuPool {
    /// Pool name.
    pub name: String,
    /// Index of the pool in the job spec (or inventory).
    pub spec_index: usize,
    /// Achieved rates per GPU.
    pub rates: GpuRates,
    /// Peak dense FLOP/s per GPU (training runs at `trainMfu` of it).
    pub peak_flops: f64,
    /// Peak memory bytes/s per GPU.
    pub peak_bandwidth: f64,
    /// GPUs.
    pub count: u32,
    /// GPUs per node.
    pub per_node: u32,
    /// Tensor-parallel degrees whose replica holds the weights and one longest context.
    pub tps: Vec<u32>,
    /// Roles it may serve (all of them unless the spec pins roles).
    pub serve_roles: Vec<Role>,
    /// Whether it may train.
    pub may_train: bool,
    /// The shares of peak behind `rates` for prefill (compute) and decode (bandwidth), and
    /// where each comes from (model, measured or probed).
    pub profile: [crate::profile::Effective; 2],
}

/// A serverless pool.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServerlessPool {
    /// Index in the spec.
    pub spec_index: usize,
    /// Concurrent executions.
    pub concurrency: f64,
    /// USD per GB-second.
    pub price_per_gb_s: f64,
}

/// Everything fixed about a planning problem.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Problem {
    /// GPU pools.
    pub gpu_pools: Vec<GpuPool>,
    /// vCPUs for environments (all CPU pools).
    pub vcpus: f64,
    /// USD per hour of every CPU node.
    pub cpu_price_per_hour: f64,
    /// Serverless pools.
    pub serverless: Vec<ServerlessPool>,
    /// The workload.
    pub workload: Workload,
    /// Bytes of active weights read per forward pass.
    pub active_weight_bytes: f64,
    /// Bytes of one copy of the weights.
    pub weight_bytes: f64,
    /// KV bytes per token.
    pub kv_bytes_per_token: f64,
    /// Forward FLOPs per token (dense part).
    pub flops_per_token: f64,
    /// Attention FLOPs per token per token of context.
    pub attention_flops: f64,
    /// Training FLOPs per token.
    pub train_flops_per_token: f64,
    /// Bytes of device memory training needs in all (weights, gradients, optimizer state).
    pub train_memory_bytes: f64,
    /// Achieved cross-pool bytes/s (KV transfers, weight sync).
    pub link_bytes_per_s: f64,
    /// Sequences a replica batches at most.
    pub max_seqs: f64,
    /// Share of device memory usable for weights and KV cache.
    pub usable_memory: f64,
    /// Mean longest context a decoding sequence reserves (context plus its longest action).
    pub reserved_context: f64,
    /// Memory bytes each serverless task's reward uses, per spec pool, times its seconds: the
    /// GB-seconds a step is billed for.
    pub serverless_gb_s_per_step: f64,
}

/// Which term sets the step time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Binding {
    /// Training on the trainer's GPUs.
    Train,
    /// Prefill capacity.
    Prefill,
    /// Decode capacity (bandwidth, KV memory or batch slots).
    Decode,
    /// Environment vCPUs.
    Environment,
    /// Serverless concurrency.
    Serverless,
    /// Trajectory latency through the admission window (Little's law).
    Latency,
    /// The staleness bound on a group's lifetime.
    Staleness,
}

/// What the predictor says about a candidate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Seconds per RL step, in steady state.
    pub step_s: f64,
    /// Seconds per RL step averaged over the job's steps, counting the first step's warm-up
    /// (the first batch takes a whole slot lifetime): what a finite run measures.
    pub job_step_s: f64,
    /// Trajectories per second.
    pub trajectories_per_s: f64,
    /// The term that sets it.
    pub binding: Binding,
    /// Each term at the solution, seconds.
    pub terms: Terms,
    /// Seconds per decoded token at the operating point.
    pub token_s: f64,
    /// Mean lifetime of a group's slot (slowest member plus waiting to be trained), seconds.
    pub slot_lifetime_s: f64,
    /// Predicted busy share per GPU pool (parallel to [`Problem::gpu_pools`]).
    pub gpu_utilisation: Vec<f64>,
    /// Predicted busy share of the environment vCPUs.
    pub env_utilisation: f64,
    /// USD per step (every pool's GPUs and nodes for the step, plus serverless billing).
    pub cost_per_step_usd: f64,
}

/// The terms of the step time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Terms {
    /// Training.
    pub train_s: f64,
    /// Prefill capacity (first turns on prefill replicas).
    pub prefill_s: f64,
    /// Local prefill on decode/generate replicas.
    pub local_prefill_s: f64,
    /// Decode capacity.
    pub decode_s: f64,
    /// Environments.
    pub env_s: f64,
    /// Serverless.
    pub serverless_s: f64,
    /// Latency through the window.
    pub latency_s: f64,
    /// Staleness.
    pub staleness_s: f64,
}

/// Per-step work of the job, independent of the placement.
#[derive(Debug, Clone, Copy)]
struct StepWork {
    first_prefill_flops: f64,
    later_prefill_flops: f64,
    decode_tokens: f64,
    decode_context: f64,
    train_flops: f64,
    env_cpu_s: f64,
}

fn step_work(p: &Problem) -> StepWork {
    let w = &p.workload;
    let model = |tokens: f64, cached: f64| {
        tokens * p.flops_per_token + tokens * p.attention_flops * (cached + tokens / 2.0)
    };
    let mut s = StepWork {
        first_prefill_flops: 0.0,
        later_prefill_flops: 0.0,
        decode_tokens: 0.0,
        decode_context: 0.0,
        train_flops: 0.0,
        env_cpu_s: 0.0,
    };
    let mut weighted_context = 0.0;
    for t in &w.tasks {
        let n = w.batch * t.share;
        s.first_prefill_flops += n * model(t.prompt, 0.0);
        s.later_prefill_flops += n * (t.turns - 1.0) * model(t.observation, t.decode_context);
        let tokens = n * t.turns * t.action;
        s.decode_tokens += tokens;
        weighted_context += tokens * t.decode_context;
        s.env_cpu_s += n * (t.turns + 1.0) * t.env_step_s * t.env_cpus;
        if t.local_reward {
            s.env_cpu_s += n * t.reward_s;
        }
    }
    s.decode_context = weighted_context / s.decode_tokens.max(1e-12);
    s.train_flops = p.train_flops_per_token * w.batch * w.train_tokens();
    s
}

/// One kind of decode-capable replica, as the water-filling sees it.
#[derive(Debug, Clone, Copy)]
struct DecodeKind {
    replicas: f64,
    bandwidth: f64,
    flops: f64,
    cap: f64,
}

/// Sequences one replica batches at per-token time `tau`.
fn batch_at(k: &DecodeKind, tau: f64, weights: f64, kv_per_seq: f64, flops_per_seq: f64) -> f64 {
    let by_bandwidth = (k.bandwidth * tau - weights) / kv_per_seq.max(1e-30);
    let by_compute = tau * k.flops / flops_per_seq.max(1e-30);
    by_bandwidth.min(by_compute).clamp(0.0, k.cap)
}

/// The smallest per-token time at which the replicas decode `rate` tokens a second, if any.
fn token_time(
    kinds: &[DecodeKind],
    rate: f64,
    weights: f64,
    kv_per_seq: f64,
    flops_per_seq: f64,
) -> Option<f64> {
    let g = |tau: f64| {
        kinds
            .iter()
            .map(|k| k.replicas * batch_at(k, tau, weights, kv_per_seq, flops_per_seq))
            .sum::<f64>()
            - rate * tau
    };
    // The batch of each kind is piecewise linear in tau; its corners are where it starts, where
    // compute takes over from bandwidth, and where it hits its cap. Between corners g is linear.
    let mut corners = Vec::with_capacity(kinds.len() * 4);
    for k in kinds
        .iter()
        .filter(|k| k.replicas > 0.0 && k.bandwidth > 0.0)
    {
        let start = weights / k.bandwidth;
        corners.push(start);
        let slope_b = k.bandwidth / kv_per_seq.max(1e-30);
        let slope_c = k.flops / flops_per_seq.max(1e-30);
        if slope_b > slope_c {
            corners.push(weights / kv_per_seq.max(1e-30) / (slope_b - slope_c));
        }
        corners.push((k.cap * kv_per_seq + weights) / k.bandwidth);
        corners.push(k.cap / slope_c.max(1e-30));
    }
    corners.retain(|c| c.is_finite() && *c > 0.0);
    corners.sort_by(f64::total_cmp);
    corners.dedup();
    let mut prev = (0.0, 0.0);
    for &c in &corners {
        let v = g(c);
        if v >= 0.0 && c > prev.0 {
            if rate <= 0.0 {
                // Nothing to decode: a lone sequence's time on the fastest replica.
                return Some(corners.first().copied().unwrap_or(c));
            }
            // g is linear on [prev, c], negative at prev: interpolate the root.
            let (x0, y0) = prev;
            return Some(if v > y0 {
                x0 + (c - x0) * (-y0) / (v - y0)
            } else {
                c
            });
        }
        prev = (c, v);
    }
    None
}

/// M/D/1 sojourn factor: service time times `1 + rho / (2 (1 - rho))`.
fn queue(rho: f64) -> f64 {
    let rho = rho.clamp(0.0, 0.999);
    1.0 + rho / (2.0 * (1.0 - rho))
}

/// Predicts a candidate's step time; `None` if it cannot run the job at any speed (no replica
/// to decode, no trainer, or the decode replicas cannot hold a single sequence).
pub fn predict(p: &Problem, c: &Candidate) -> Option<Prediction> {
    predict_with(p, c, true)
}

/// The step time alone (what the search compares), without the figures only reports need.
pub fn step_time(p: &Problem, c: &Candidate) -> Option<f64> {
    predict_with(p, c, false).map(|x| x.step_s)
}

fn predict_with(p: &Problem, c: &Candidate, detail: bool) -> Option<Prediction> {
    let caps = capacities(p, c)?;
    predict_caps(p, &caps, if detail { Some(c) } else { None })
}

/// What a placement offers, summed: all the predictor needs besides the problem.
#[derive(Debug, Clone)]
pub(crate) struct Caps {
    disaggregated: bool,
    prefill_flops: f64,
    prefill_fastest: f64,
    local_flops: f64,
    local_fastest: f64,
    kinds: Vec<DecodeKind>,
    trainer_flops: f64,
}

fn kv_cap(p: &Problem, pool: &GpuPool, tp: f64) -> f64 {
    let kv_tokens = ((tp * pool.rates.memory * p.usable_memory - p.weight_bytes)
        / p.kv_bytes_per_token)
        .max(0.0);
    (kv_tokens / p.reserved_context.max(1.0))
        .floor()
        .min(p.max_seqs)
}

fn capacities(p: &Problem, c: &Candidate) -> Option<Caps> {
    let trainer = p.gpu_pools.get(c.trainer_pool)?;
    let mut caps = Caps {
        disaggregated: c
            .groups
            .iter()
            .any(|g| g.role == Role::Prefill && g.replicas > 0),
        prefill_flops: 0.0,
        prefill_fastest: 0.0,
        local_flops: 0.0,
        local_fastest: 0.0,
        kinds: Vec::new(),
        trainer_flops: c.trainer_gpus as f64 * trainer.peak_flops,
    };
    for g in c.groups.iter().filter(|g| g.replicas > 0) {
        let pool = p.gpu_pools.get(g.pool)?;
        let tp = g.tp as f64;
        let n = g.replicas as f64;
        let f = pool.rates.flops * tp;
        match g.role {
            Role::Prefill => {
                caps.prefill_flops += n * f;
                caps.prefill_fastest = caps.prefill_fastest.max(f);
            }
            Role::Decode | Role::Generate => {
                caps.local_flops += n * f;
                caps.local_fastest = caps.local_fastest.max(f);
                caps.kinds.push(DecodeKind {
                    replicas: n,
                    bandwidth: pool.rates.bandwidth * tp,
                    flops: f,
                    cap: kv_cap(p, pool, tp),
                });
            }
        }
    }
    Some(caps)
}

fn predict_caps(p: &Problem, caps: &Caps, detail: Option<&Candidate>) -> Option<Prediction> {
    let s = step_work(p);
    let w = &p.workload;
    if caps.trainer_flops <= 0.0 {
        return None;
    }
    let disaggregated = caps.disaggregated;
    let prefill_flops = caps.prefill_flops;
    let prefill_fastest = caps.prefill_fastest;
    let local_flops = caps.local_flops;
    let local_fastest = caps.local_fastest;
    let kinds = &caps.kinds;
    if kinds.iter().all(|k| k.cap < 1.0) {
        return None;
    }
    let (first_remote, first_local) = if disaggregated {
        (s.first_prefill_flops, 0.0)
    } else {
        (0.0, s.first_prefill_flops)
    };
    let local_work = s.later_prefill_flops + first_local;
    let train_s = s.train_flops / (caps.trainer_flops * w.train_mfu);
    let prefill_s = if first_remote > 0.0 {
        first_remote / prefill_flops.max(1e-30)
    } else {
        0.0
    };
    let local_prefill_s = local_work / local_flops.max(1e-30);
    let env_s = if s.env_cpu_s > 0.0 {
        s.env_cpu_s / p.vcpus.max(1e-30)
    } else {
        0.0
    };
    let mut serverless_s: f64 = 0.0;
    for pool in &p.serverless {
        let secs: f64 = w
            .tasks
            .iter()
            .filter(|t| t.serverless_pool == Some(pool.spec_index))
            .map(|t| w.batch * t.share * t.reward_s)
            .sum();
        serverless_s = serverless_s.max(secs / pool.concurrency.max(1e-30));
    }
    let kv_per_seq = p.kv_bytes_per_token * s.decode_context;
    let flops_per_seq = p.flops_per_token + p.attention_flops * s.decode_context;
    let weights = p.active_weight_bytes;
    // Weight sync takes each replica offline once a step for a transfer; fold it in as a share
    // of the step the replica cannot serve.
    let sync_s = p.weight_bytes / p.link_bytes_per_s.max(1.0);
    let window = w.window();
    let transfer_per_token = p.kv_bytes_per_token / p.link_bytes_per_s.max(1.0);

    // Everything that depends on the step time T (through the throughput asked for).
    let evaluate = |t: f64| -> Option<(Terms, f64, f64)> {
        let online = (1.0 - sync_s / t).clamp(0.05, 1.0);
        let scaled: Vec<DecodeKind> = kinds
            .iter()
            .map(|k| DecodeKind {
                replicas: k.replicas * online,
                ..*k
            })
            .collect();
        let tau = token_time(
            &scaled,
            s.decode_tokens / t,
            weights,
            kv_per_seq,
            flops_per_seq,
        )?;
        let q_first = queue(prefill_s / t);
        let q_local = queue(local_prefill_s / t);
        let mut slots = 0.0;
        let mut longest: f64 = 0.0;
        let fill = w.train_batch / w.batch;
        for task in &w.tasks {
            let first_tokens = task.prompt;
            let first = p.flops_per_token * first_tokens
                + p.attention_flops * first_tokens * first_tokens / 2.0;
            let first_s = if disaggregated {
                first / prefill_fastest.max(1e-30) * q_first + first_tokens * transfer_per_token
            } else {
                first / local_fastest.max(1e-30) * q_local
            };
            let obs = task.observation;
            let later = p.flops_per_token * obs + p.attention_flops * obs * task.decode_context;
            let later_s = later / local_fastest.max(1e-30) * q_local;
            // A group is trained when its slowest member is done: the mean lifetime plus
            // `group_max_z` standard deviations of it (turns vary, and so does every step).
            let turns = task.turns;
            let per_turn = task.env_step_s + later_s + task.action * tau;
            let mean_life = (turns + 1.0) * task.env_step_s
                + first_s
                + (turns - 1.0).max(0.0) * later_s
                + turns * task.action * tau
                + task.reward_s;
            let var_life = turns * (task.env_step_var + tau * tau * task.action_var)
                + task.turns_var * per_turn * per_turn;
            let life = mean_life + w.group_max_z * var_life.sqrt();
            longest = longest.max(life);
            slots += task.share * life;
        }
        // A finished group waits for a training batch to fill and for the trainer, which
        // queues batches like any server: a trainer busy nearly all the step makes every group
        // wait (M/D/1), holding its slot and ageing towards the staleness bound.
        let wait = fill * (t / 2.0 + train_s * queue(train_s / t));
        let latency_s = w.batch * (slots + wait) / window.max(1.0);
        let staleness_s = longest / w.max_staleness.max(1.0);
        let terms = Terms {
            train_s,
            prefill_s,
            local_prefill_s,
            decode_s: 0.0,
            env_s,
            serverless_s,
            latency_s,
            staleness_s,
        };
        Some((terms, tau, slots + wait))
    };
    let fixed = [train_s, prefill_s, local_prefill_s, env_s, serverless_s]
        .into_iter()
        .fold(0.0_f64, f64::max);
    let fits = |t: f64| -> bool {
        evaluate(t)
            .is_some_and(|(terms, _, _)| terms.latency_s.max(terms.staleness_s).max(fixed) <= t)
    };
    let mut hi = fixed.max(1.0);
    let mut tries = 0;
    while !fits(hi) {
        hi *= 2.0;
        tries += 1;
        if tries > 60 {
            return None;
        }
    }
    let mut lo = fixed.max(hi / 1e6);
    if fits(lo) {
        hi = lo;
    }
    for _ in 0..60 {
        if hi - lo <= 1e-7 * hi {
            break;
        }
        let mid = 0.5 * (lo + hi);
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let t = hi;
    let (mut terms, tau, slot) = evaluate(t)?;
    let Some(c) = detail else {
        return Some(Prediction {
            step_s: t,
            job_step_s: t,
            trajectories_per_s: w.batch / t,
            binding: Binding::Latency,
            terms,
            token_s: tau,
            slot_lifetime_s: slot,
            gpu_utilisation: Vec::new(),
            env_utilisation: 0.0,
            cost_per_step_usd: 0.0,
        });
    };
    // The decode capacity term: the step time below which no per-token time serves the tokens.
    let mut dlo = 0.0;
    let mut dhi = t;
    if token_time(
        kinds,
        s.decode_tokens / dhi,
        weights,
        kv_per_seq,
        flops_per_seq,
    )
    .is_some()
    {
        for _ in 0..50 {
            let mid = 0.5 * (dlo + dhi);
            if mid <= 0.0 {
                break;
            }
            if token_time(
                kinds,
                s.decode_tokens / mid,
                weights,
                kv_per_seq,
                flops_per_seq,
            )
            .is_some()
            {
                dhi = mid;
            } else {
                dlo = mid;
            }
        }
        terms.decode_s = dhi;
    }
    let binding = [
        (terms.train_s, Binding::Train),
        (terms.prefill_s, Binding::Prefill),
        (terms.local_prefill_s, Binding::Prefill),
        (terms.env_s, Binding::Environment),
        (terms.serverless_s, Binding::Serverless),
        (terms.latency_s, Binding::Latency),
        (terms.staleness_s, Binding::Staleness),
    ]
    .into_iter()
    .fold(
        (0.0, Binding::Latency),
        |best, x| {
            if x.0 > best.0 { x } else { best }
        },
    )
    .1;
    let binding = if terms.decode_s >= 0.98 * t {
        Binding::Decode
    } else {
        binding
    };
    // Utilisation per pool.
    let mut busy = vec![0.0; p.gpu_pools.len()];
    if let Some(b) = busy.get_mut(c.trainer_pool) {
        *b += c.trainer_gpus as f64 * (train_s / t).min(1.0);
    }
    for g in c.groups.iter().filter(|g| g.replicas > 0) {
        let Some(pool) = p.gpu_pools.get(g.pool) else {
            continue;
        };
        let gpus = (g.tp * g.replicas) as f64;
        let share = match g.role {
            Role::Prefill => (prefill_s / t).min(1.0),
            Role::Decode | Role::Generate => {
                let tp = g.tp as f64;
                let k = DecodeKind {
                    replicas: 1.0,
                    bandwidth: pool.rates.bandwidth * tp,
                    flops: pool.rates.flops * tp,
                    cap: kv_cap(p, pool, tp),
                };
                let b = batch_at(&k, tau, weights, kv_per_seq, flops_per_seq);
                // A replica is busy whenever it holds a sequence (Poisson occupancy).
                1.0 - (-b).exp()
            }
        };
        if let Some(x) = busy.get_mut(g.pool) {
            *x += gpus * share;
        }
    }
    let gpu_utilisation: Vec<f64> = busy
        .iter()
        .zip(&p.gpu_pools)
        .map(|(b, pool)| (b / pool.count.max(1) as f64).min(1.0))
        .collect();
    let gpu_cost_per_s: f64 = p
        .gpu_pools
        .iter()
        .map(|pool| pool.count as f64 * pool.rates.price_per_hour / 3600.0)
        .sum();
    let cost_per_step_usd = (gpu_cost_per_s + p.cpu_price_per_hour / 3600.0) * t
        + p.serverless_gb_s_per_step * p.serverless.first().map_or(0.0, |s| s.price_per_gb_s);
    let steps = w.steps.max(1.0);
    Some(Prediction {
        step_s: t,
        job_step_s: (slot.max(t) + (steps - 1.0) * t) / steps,
        trajectories_per_s: w.batch / t,
        binding,
        terms,
        token_s: tau,
        slot_lifetime_s: slot,
        gpu_utilisation,
        env_utilisation: (env_s / t).min(1.0),
        cost_per_step_usd,
    })
}

/// A lower bound on the predicted step time of every completion of a partial candidate. Each
/// pool not yet decided (`free`, with the GPUs it may still use) is counted as prefill and as
/// decode capacity at once, with all its GPUs' FLOP/s, and as many decode replicas as its
/// smallest tensor-parallel degree gives, each as fast and as roomy as its largest degree makes
/// one: any completion's replicas are no more, no faster and no roomier, and the predictor never
/// gets slower when capacity is added, so no completion is faster than this.
pub fn relaxed(
    p: &Problem,
    partial: &Candidate,
    free: &[(usize, u32)],
    disaggregated: bool,
) -> Option<f64> {
    let mut caps = capacities(p, partial)?;
    caps.disaggregated = disaggregated;
    for &(pool, gpus) in free {
        let Some(gp) = p.gpu_pools.get(pool) else {
            continue;
        };
        let mut fitting = gp.tps.iter().copied().filter(|&t| t <= gpus);
        let Some(smallest) = fitting.next() else {
            continue;
        };
        let largest = fitting.next_back().unwrap_or(smallest);
        let all = gpus as f64 * gp.rates.flops;
        let fastest = largest as f64 * gp.rates.flops;
        let prefills = disaggregated && gp.serve_roles.contains(&Role::Prefill);
        let decodes = if disaggregated {
            gp.serve_roles.contains(&Role::Decode)
        } else {
            gp.serve_roles.contains(&Role::Generate)
        };
        if prefills {
            caps.prefill_flops += all;
            caps.prefill_fastest = caps.prefill_fastest.max(fastest);
        }
        if decodes {
            caps.local_flops += all;
            caps.local_fastest = caps.local_fastest.max(fastest);
            caps.kinds.push(DecodeKind {
                replicas: (gpus / smallest) as f64,
                bandwidth: gp.rates.bandwidth * largest as f64,
                flops: fastest,
                cap: kv_cap(p, gp, largest as f64),
            });
        }
    }
    predict_caps(p, &caps, None).map(|x| x.step_s)
}

/// The training term alone for a trainer, seconds per step: no placement with this trainer can
/// be faster.
pub fn train_time(p: &Problem, pool: usize, gpus: u32) -> f64 {
    let s = step_work(p);
    let flops = p.gpu_pools.get(pool).map_or(0.0, |g| g.peak_flops) * gpus as f64;
    s.train_flops / (flops * p.workload.train_mfu).max(1e-30)
}

/// Training GPUs needed to hold the model's training state in a pool's memory.
pub fn min_train_gpus(p: &Problem, pool: &GpuPool) -> u32 {
    let per_gpu = pool.rates.memory * p.usable_memory;
    if per_gpu <= 0.0 {
        return u32::MAX;
    }
    (p.train_memory_bytes / per_gpu).ceil().max(1.0) as u32
}

/// The roofline of a decode iteration at the operating point, for explanations.
pub fn decode_work_at(p: &Problem, batch: f64, context: f64) -> roofline::Work {
    roofline::Work {
        flops: batch * (p.flops_per_token + p.attention_flops * context),
        bytes: p.active_weight_bytes + batch * p.kv_bytes_per_token * context,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(replicas: f64, bandwidth: f64) -> DecodeKind {
        DecodeKind {
            replicas,
            bandwidth,
            flops: 1e18,
            cap: 1e9,
        }
    }

    #[test]
    fn token_time_solves_littles_law_on_decoding_sequences() {
        // One replica, 1 TB/s, 1 GB of weights, 1 MB of KV per sequence. At tau, a batch of
        // (1e12 tau - 1e9) / 1e6 sequences; asked for 1e5 tokens/s, b = 1e5 tau:
        // 1e6 tau - 1e3 = 1e5 tau  =>  tau = 1e3 / 9e5 = 1.111 ms.
        let tau = token_time(&[kind(1.0, 1e12)], 1e5, 1e9, 1e6, 1.0).unwrap();
        assert!((tau - 1e3 / 9e5).abs() < 1e-12, "{tau}");
    }

    #[test]
    fn a_replica_too_slow_to_help_gets_no_sequences() {
        // The fast replica alone: (1e12 tau - 1e9)/1e6 = 1e3 tau => tau = 1e3/(1e6 - 1e3).
        // A 1 GB/s replica needs tau >= 1 s to read its weights once: it stays empty.
        let alone = token_time(&[kind(1.0, 1e12)], 1e3, 1e9, 1e6, 1.0).unwrap();
        let both = token_time(&[kind(1.0, 1e12), kind(1.0, 1e9)], 1e3, 1e9, 1e6, 1.0).unwrap();
        assert!((alone - both).abs() < 1e-15);
    }

    #[test]
    fn asking_for_more_tokens_than_bandwidth_allows_has_no_token_time() {
        // The limit is 1e12 / 1e6 = 1e6 tokens/s (the weights' share vanishes as the batch grows).
        assert!(token_time(&[kind(1.0, 1e12)], 1.01e6, 1e9, 1e6, 1.0).is_none());
        assert!(token_time(&[kind(1.0, 1e12)], 0.99e6, 1e9, 1e6, 1.0).is_some());
    }

    #[test]
    fn the_mdl_queue_factor_is_one_when_idle_and_grows_with_load() {
        assert_eq!(queue(0.0), 1.0);
        assert!((queue(0.5) - 1.5).abs() < 1e-12);
        assert!(queue(0.9) > queue(0.5));
    }
}
