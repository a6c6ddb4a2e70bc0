//! The step-time predictor: how long one RL step takes under a candidate placement.
//!
//! rollfleet runs rollout and training concurrently, so a step takes as long as the slowest of:
//!
//! - each resource's work over its capacity (training on the trainer's GPUs; prefill on the
//!   prefill and on the decode replicas, counting the refills below; decode tokens against the
//!   decode replicas' bandwidth, KV memory and batch slots; environment vCPU-seconds; serverless
//!   concurrency-seconds);
//! - the latency term: the core keeps at most `N` trajectories started and not yet trained on
//!   (its admission window, [`Workload::window`]), and a trajectory holds its slot until its whole
//!   group is taken by the trainer. The window's groups circulate between generation and the
//!   trainer, a closed network solved by mean value analysis: at least Little's law, `B x L /
//!   N` for a mean slot lifetime `L`, and at least the trainer's capacity.
//!
//! The slot lifetime `L` is built from the job's distributions:
//!
//! - a group is done when its slowest member is (mean lifetime plus `E[max of n normals]`
//!   standard deviations), then waits for a training batch to fill;
//! - each turn decodes at the per-token time of the replica it is on: replicas batch every
//!   running sequence, so each token takes `max((W + b x KV x c) / bandwidth, b x FLOPs /
//!   FLOP/s)` for a batch of `b`. The core's router fills replicas by their room (batch slots
//!   and KV memory), not their speed, and keeps a trajectory on its replica until a weight
//!   update drops its KV cache ([`routed`]): each kind of replica holds its share of the
//!   trajectories alive, decodes them at its own per-token time, and the load level is the one
//!   that decodes the tokens asked for. A trajectory's decode time is the token-weighted mean
//!   of those times, and varies by their spread (a group's slowest member is often the one on
//!   the slowest replica); a sequence sees one more KV cache than the mean batch (Poisson
//!   occupancy);
//! - once a step each replica is drained and loads new weights, dropping its KV caches: every
//!   trajectory alive then prefills its whole context again (a refill). A turn arriving during
//!   the drain goes to another replica, unless every replica updates at once (no more decode
//!   replicas than trainer nodes) or it is a first turn that must start on the newest weights
//!   (`maxStaleness: 1`): then it waits. Prefills queue (M/G/1) where they run;
//! - the staleness bound: a group must be taken by the trainer within `maxStaleness + 1`
//!   versions of its start, less the share of a step it started into; an attempt that misses is
//!   thrown away and the group starts again (regeneration), so by Wald's identity it holds its
//!   slot for its expected attempts times its mean attempt.
//!
//! The step time is the smallest `T` at least every term evaluated at the throughput `B / T`
//! (bisection). The job's average ([`job_average`]) is that step over every step of a job of
//! several (the core keeps its window full through the last step, so the last batch takes the
//! first groups to finish, as every other does), the slowest groups of its one batch for a job of
//! one step, and at least the trainer's work after the first groups are done.
//!
//! The staleness term does not model the core's regeneration of a lone expired finished member
//! at a publication (`Core::regenerate_lone_expired`): in the simulator a miss regenerates
//! members that had finished too (their first turns expire with the slowest's), and the rule acts
//! on groups already regenerated, whose members the retries left at different versions. The
//! whole-group restart modelled here predicts the simulated steady step of the RollArt-like job
//! within 3% at its bound of 2; modelled as a one-member retry, the rule put it 6-9% low and
//! moved the trainer scan to placements that simulate up to 4% slower (docs/planner.md).
//!
//! The search does not compare placements by this prediction but by [`step_time`], the
//! first-order model without regeneration, drains or the closed loop (it counts refills as load
//! on the prefill queues, and the burst they arrive in as a wait), whose decode is
//! still split by water-filling (every busy replica at one per-token time, a replica too slow
//! to beat it alone getting nothing): the full model ranks a single decode replica too well,
//! and a router-faithful objective chose a placement that simulates worse for the same reason
//! (docs/planner.md). Every term of [`step_time`] only shrinks as capacity is added (a faster
//! or an extra replica never slows it), which is what lets the search bound partial placements
//! by relaxing the rest. A move the search proposes is judged by this prediction
//! (`rollfleet sim --replan-on-drift`).

use serde::Serialize;

use crate::roofline::{self, GpuRates};
use crate::workload::{Workload, normal_cdf, normal_pdf, normal_quantile};

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

impl Candidate {
    /// Its serving replicas of `role`, over every pool.
    pub fn replicas(&self, role: Role) -> u32 {
        self.groups
            .iter()
            .filter(|g| g.role == role)
            .map(|g| g.replicas)
            .sum()
    }
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
    /// Prefills shorter than this many tokens (context plus new) stay on the decode replica
    /// even when there are prefill replicas (the core's rule).
    pub pd_min_prefill_tokens: f64,
    /// Share of device memory usable for weights and KV cache.
    pub usable_memory: f64,
    /// Mean longest context a decoding sequence reserves (context plus its longest action).
    pub reserved_context: f64,
    /// Memory bytes each serverless task's reward uses, per spec pool, times its seconds: the
    /// GB-seconds a step is billed for.
    pub serverless_gb_s_per_step: f64,
    /// A trainer every placement must keep, as `(index in gpu_pools, GPUs)`, with its GPUs not
    /// free for serving replicas: re-planning a running job whose trainer is not to change (no
    /// trainer moves between pools mid-run, and the server cannot resize one). `None`: the
    /// search chooses the trainer too.
    pub pinned_trainer: Option<(usize, u32)>,
}

impl Problem {
    /// The same problem with its trainer pinned to `(pool, gpus)` ([`Problem::pinned_trainer`]).
    pub fn with_trainer(mut self, pool: usize, gpus: u32) -> Problem {
        self.pinned_trainer = Some((pool, gpus));
        self
    }
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
    /// The staleness bound on a group's lifetime (the search objective's term; the prediction
    /// counts what the bound costs inside the latency term, as regeneration).
    Staleness,
}

/// What the predictor says about a candidate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Seconds per RL step, in steady state.
    pub step_s: f64,
    /// Seconds per RL step averaged over the job's steps, what a finite run measures
    /// (`job_average`): the steady step, the slowest groups of the batch for a job of one
    /// step, and at least the trainer's work after the first groups are done.
    pub job_step_s: f64,
    /// Trajectories per second.
    pub trajectories_per_s: f64,
    /// The term that sets it.
    pub binding: Binding,
    /// Each term at the solution, seconds.
    pub terms: Terms,
    /// Seconds per decoded token at the operating point (the mean over the tokens: each kind of
    /// replica decodes its share at its own pace).
    pub token_s: f64,
    /// Mean sequences one replica of each serving group decodes at once, as the router fills
    /// them (parallel to the candidate's groups; 0 for prefill groups and empty ones).
    pub decode_batch: Vec<f64>,
    /// Mean lifetime of a group's slot (all its attempts, slowest member plus waiting for a
    /// training batch), seconds.
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
    /// Latency through the window (the closed loop with the trainer).
    pub latency_s: f64,
    /// The part of the latency term owed to regeneration (attempts thrown away because they
    /// missed the staleness bound).
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
    /// Trajectories the core's router puts on one replica of this kind per unit of load (see
    /// [`router_weight`]).
    weight: f64,
}

/// How many trajectories the core's router puts on a replica, relative to the others. It
/// sends a trajectory that has no KV cache anywhere to the replica with the least load key,
/// `running / max_seqs + KV reserved / KV capacity` (`rollfleet_core::router::load_key`), and
/// later turns back to the same replica: so it fills replicas in proportion to their room, not
/// their speed, and `n` trajectories load a replica by `n (1 / max_seqs + reserved / kv)`.
/// A replica's share is the inverse of that (counting every held trajectory as running: the
/// batch-slot half weighs little beside the KV half on small replicas, where it matters).
fn router_weight(max_seqs: f64, reserved_context: f64, kv_tokens: f64) -> f64 {
    if kv_tokens <= 0.0 || max_seqs <= 0.0 {
        return 0.0;
    }
    1.0 / (1.0 / max_seqs + reserved_context.max(1.0) / kv_tokens)
}

/// Per-token time of one replica holding `alive` trajectories, each decoding a share `tau / (tau
/// + other)` of the time it is alive (`other`: seconds it spends on anything but decoding, per
/// token it decodes). An iteration takes `max((W + b kv) / bandwidth, b flops / FLOP/s)` for a
/// batch of `b = alive tau / (tau + other)`: the fixed point of each roof is a root of a
/// quadratic (bandwidth) or linear (compute) equation in `tau`, and the time is the larger.
fn replica_token_time(
    k: &DecodeKind,
    alive: f64,
    other: f64,
    weights: f64,
    kv_per_seq: f64,
    flops_per_seq: f64,
) -> f64 {
    let bw = k.bandwidth.max(1e-30);
    // bw tau^2 + (bw o - W - kv n) tau - W o = 0; the positive root, computed without the
    // cancellation of its textbook form when `b` is positive.
    let b = bw * other - weights - kv_per_seq * alive;
    let disc = (b * b + 4.0 * bw * weights * other).sqrt();
    let by_bandwidth = if b >= 0.0 {
        if b + disc > 0.0 {
            2.0 * weights * other / (b + disc)
        } else {
            0.0
        }
    } else {
        (disc - b) / (2.0 * bw)
    };
    let by_compute = alive * flops_per_seq / k.flops.max(1e-30) - other;
    by_bandwidth.max(by_compute)
}

/// Where the router puts the decoding sequences, and what each kind of replica then runs at.
#[derive(Debug, Clone, PartialEq)]
struct Served {
    /// Per kind: trajectories alive on one replica, its decoding batch, its per-token time.
    kinds: Vec<(f64, f64, f64)>,
    /// Per kind: its share of the tokens decoded (and so of the trajectories, which all decode
    /// alike wherever they are).
    token_share: Vec<f64>,
    /// Token-weighted mean per-token time (`decoding sequences / tokens per second`).
    tau: f64,
}

/// The router's split of a decode load over the replicas (in proportion to [`router_weight`],
/// every kind capped by its batch), at the load level that decodes `rate` tokens a second;
/// `None` if even full replicas cannot. `other` is the seconds a trajectory is alive without
/// decoding, per token it decodes: each trajectory alive on a replica makes a token every
/// `tau + other` seconds, so `sum_i replicas_i n_i / (tau_i + other) = rate`, which is
/// increasing in the load level; bisection on it.
fn routed(
    kinds: &[DecodeKind],
    rate: f64,
    other: f64,
    weights: f64,
    kv_per_seq: f64,
    flops_per_seq: f64,
) -> Option<Served> {
    let other = other.max(0.0);
    let at = |level: f64| -> (Vec<(f64, f64, f64)>, f64) {
        let mut made = 0.0;
        let per: Vec<(f64, f64, f64)> = kinds
            .iter()
            .map(|k| {
                if k.replicas <= 0.0 || k.weight <= 0.0 || k.bandwidth <= 0.0 {
                    return (0.0, 0.0, 0.0);
                }
                let alive = (level * k.weight).min(k.cap.max(0.0));
                let tau = replica_token_time(k, alive, other, weights, kv_per_seq, flops_per_seq);
                let batch = if tau + other > 0.0 {
                    alive * tau / (tau + other)
                } else {
                    alive
                };
                if tau > 0.0 {
                    made += k.replicas * alive / (tau + other);
                }
                (alive, batch, tau)
            })
            .collect();
        (per, made)
    };
    // The level at which every kind is full: no higher level adds a sequence.
    let full = kinds
        .iter()
        .filter(|k| k.weight > 0.0 && k.replicas > 0.0)
        .map(|k| k.cap / k.weight)
        .fold(0.0_f64, f64::max);
    if full <= 0.0 {
        return None;
    }
    let (mut lo, mut hi) = (0.0, full);
    if rate > 0.0 {
        if at(hi).1 < rate * (1.0 - 1e-9) {
            return None;
        }
        for _ in 0..100 {
            let mid = 0.5 * (lo + hi);
            if at(mid).1 >= rate {
                hi = mid;
            } else {
                lo = mid;
            }
            if hi - lo <= 1e-12 * hi {
                break;
            }
        }
    } else {
        // Nothing to decode: one lone sequence, wherever the router would put it.
        hi = 1e-9 * full;
    }
    let (per, made) = at(hi);
    let token_share: Vec<f64> = kinds
        .iter()
        .zip(&per)
        .map(|(k, &(alive, _, tau))| {
            if made > 0.0 && tau > 0.0 {
                k.replicas * alive / (tau + other) / made
            } else {
                0.0
            }
        })
        .collect();
    let tau = per
        .iter()
        .zip(&token_share)
        .map(|(&(_, _, t), q)| q * t)
        .sum();
    Some(Served {
        kinds: per,
        token_share,
        tau,
    })
}

impl Served {
    /// The token-weighted mean and variance of the per-token time a sequence sees: its replica's
    /// at the mean batch, plus its own KV cache read (Poisson occupancy: an arriving sequence
    /// sees one more than the mean batch).
    fn seen(&self, kinds: &[DecodeKind], kv_per_seq: f64, flops_per_seq: f64) -> (f64, f64) {
        let (mut mean, mut second) = (0.0, 0.0);
        for ((k, &(_, _, tau)), q) in kinds.iter().zip(&self.kinds).zip(&self.token_share) {
            let own = (kv_per_seq / k.bandwidth.max(1e-30)).max(flops_per_seq / k.flops.max(1e-30));
            let seen = tau + own;
            mean += q * seen;
            second += q * seen * seen;
        }
        (mean, (second - mean * mean).max(0.0))
    }

    /// Mean sequences decoding on a replica that holds any.
    fn batch_per_replica(&self, kinds: &[DecodeKind]) -> f64 {
        let (mut held, mut replicas) = (0.0, 0.0);
        for (k, &(_, b, _)) in kinds.iter().zip(&self.kinds) {
            if b > 0.0 {
                held += k.replicas * b;
                replicas += k.replicas;
            }
        }
        held / replicas.max(1e-12)
    }
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

/// The token-weighted mean and standard deviation of one turn's action, over the tasks.
fn action_spread(w: &Workload) -> (f64, f64) {
    let weight: f64 = w.tasks.iter().map(|k| k.share * k.turns).sum();
    if weight <= 0.0 {
        return (0.0, 0.0);
    }
    let mean = w
        .tasks
        .iter()
        .map(|k| k.share * k.turns * k.action)
        .sum::<f64>()
        / weight;
    let second = w
        .tasks
        .iter()
        .map(|k| k.share * k.turns * (k.action_var + k.action * k.action))
        .sum::<f64>()
        / weight;
    (mean, (second - mean * mean).max(0.0).sqrt())
}

/// How many standard deviations the largest of `n` normal draws lies above their mean (Blom's
/// plotting position; 0 for one draw or fewer).
fn expected_max_z(n: f64) -> f64 {
    if n <= 1.0 {
        0.0
    } else {
        normal_quantile((n - 0.375) / (n + 0.25))
    }
}

/// FLOPs of prefilling a whole context of `c` tokens from nothing.
fn context_prefill_flops(p: &Problem, c: f64) -> f64 {
    p.flops_per_token * c + p.attention_flops * c * c / 2.0
}

/// What a set of replicas' prefill queues do to a prefill.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PrefillQueue {
    /// Seconds of all their compute a step's prefill takes (the capacity term).
    load_s: f64,
    /// Mean seconds per FLOP of prefill on the replica a prefill runs on.
    s_per_flop: f64,
    /// Mean wait behind the prefills ahead, seconds.
    wait_s: f64,
}

/// How long prefills wait on a set of replicas, given a step's prefills (`jobs`: how many, FLOPs
/// each) and, per kind of replica, `(replicas, FLOP/s each, share of the prefills it gets)`.
/// Prefills are served one batch at a time, so a kind's wait is M/G/1's: `rho / (1 - rho) x
/// E[S^2] / (2 E[S])`, `S` the time one prefill takes there; long prefills dominate it.
fn prefill_queue(kinds: &[(f64, f64, f64)], jobs: &[(f64, f64)], t: f64) -> PrefillQueue {
    // Folded from +0.0: an empty `sum` of floats is -0.0, which tables print as "-0.0".
    let flops = jobs.iter().fold(0.0, |acc, &(n, f)| acc + n * f);
    let flops_sq = jobs.iter().fold(0.0, |acc, &(n, f)| acc + n * f * f);
    let capacity: f64 = kinds.iter().map(|&(r, f, _)| r * f).sum();
    let (mut s_per_flop, mut wait_s) = (0.0, 0.0);
    for &(replicas, replica_flops, share) in kinds.iter().filter(|k| k.0 > 0.0 && k.1 > 0.0) {
        if share <= 0.0 {
            continue;
        }
        let rho = (flops * share / (replicas * replica_flops) / t).clamp(0.0, 0.999);
        let residual = if flops > 0.0 {
            flops_sq / (2.0 * flops) / replica_flops
        } else {
            0.0
        };
        s_per_flop += share / replica_flops;
        wait_s += share * rho / (1.0 - rho) * residual;
    }
    PrefillQueue {
        load_s: flops / capacity.max(1e-30),
        s_per_flop,
        wait_s,
    }
}

/// A step's prefills of one kind: how many, and the FLOPs of each.
type Prefills = Vec<(f64, f64)>;

/// Whether a prefill of `tokens` (context plus new) without a KV cache runs on a prefill
/// replica: when there are any and it is long enough to be worth a KV transfer.
fn remote_prefill(p: &Problem, disaggregated: bool, tokens: f64) -> bool {
    disaggregated && tokens >= p.pd_min_prefill_tokens
}

/// The prefills of a step, by where they run: `(local, remote)`, each a list of `(how many, FLOPs
/// each)`.
///
/// Each later turn's observation is prefilled where its KV cache is (locally, on top of the
/// cached context). Each first turn's prompt is prefilled on the prefill replicas when there are
/// any, locally otherwise. And every trajectory alive when its replica takes new weights (once
/// a step) loses its KV cache, so its next turn prefills its whole context again, routed as a
/// turn without a cache is: to the prefill replicas when there are any. `alive_s[k]` is how long
/// a trajectory of task `k` is alive, so by Little's law `B / T x share x alive` are.
fn step_prefills(
    p: &Problem,
    disaggregated: bool,
    alive_s: &[f64],
    t: f64,
) -> (Prefills, Prefills) {
    let w = &p.workload;
    let (mut local, mut remote) = (Vec::new(), Vec::new());
    for (task, alive) in w.tasks.iter().zip(alive_s) {
        let n = w.batch * task.share;
        let obs = task.observation;
        local.push((
            n * (task.turns - 1.0).max(0.0),
            p.flops_per_token * obs + p.attention_flops * obs * task.decode_context,
        ));
        let first = (n, context_prefill_flops(p, task.prompt));
        if remote_prefill(p, disaggregated, task.prompt) {
            remote.push(first);
        } else {
            local.push(first);
        }
        let refill = (n / t * alive, context_prefill_flops(p, task.decode_context));
        if remote_prefill(p, disaggregated, task.decode_context) {
            remote.push(refill);
        } else {
            local.push(refill);
        }
    }
    (local, remote)
}

/// What the staleness bound costs a group of a task, averaged over its groups.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Regeneration {
    /// Mean seconds a group holds its slot, over all its attempts.
    slot_s: f64,
    /// Mean attempts a group makes (1 if none is ever thrown away).
    attempts: f64,
}

/// Equal-probability points of a group's lasting lag (its members' turn counts, which a
/// regeneration does not redraw), for averaging over groups.
const LAG_POINTS: usize = 16;

/// The mean of the standard normal survival function `Q(x) = 1 - Phi(x)` over `[a, b]`:
/// `x Q(x) - phi(x)` is its antiderivative.
fn mean_survival(a: f64, b: f64) -> f64 {
    let antiderivative = |x: f64| x * (1.0 - normal_cdf(x)) - normal_pdf(x);
    if b - a < 1e-12 {
        return 1.0 - normal_cdf(a);
    }
    ((antiderivative(b) - antiderivative(a)) / (b - a)).clamp(0.0, 1.0)
}

/// The cost of the staleness bound to a task's groups. An attempt (first turn to being taken by
/// the trainer) lasts `mean + lasting x Zg + fresh x Za`: `Zg` is the group's own lag (the turn
/// counts of its members, the same on every attempt), `Za` is drawn afresh on each attempt
/// (environment steps, actions), both standard normal. A group started a share `phi` into a
/// version's step (uniform) must be taken by the trainer before `maxStaleness + 1` more versions
/// are published, `(S + 1 - phi) T` after it started; an attempt that misses is thrown away
/// whole (every member's first turn is then too old) and the group starts again. Each attempt
/// holds the slot for its own length, so by Wald's identity a group holds it for its expected
/// attempts `1 / (1 - miss)` times its mean attempt; a group that almost never makes it holds
/// its slot until the job ends, on average half of the job (`hold_limit_s`). The core's
/// regeneration of a lone expired finished member at a publication is left out on purpose (the
/// module doc says why).
fn regeneration(
    mean: f64,
    lasting: f64,
    fresh: f64,
    max_staleness: f64,
    t: f64,
    hold_limit_s: f64,
) -> Regeneration {
    let (mut slot_s, mut attempts) = (0.0, 0.0);
    for j in 0..LAG_POINTS {
        let lag = if lasting > 0.0 {
            lasting * normal_quantile((j as f64 + 0.5) / LAG_POINTS as f64)
        } else {
            0.0
        };
        let attempt = (mean + lag).max(0.0);
        let (earliest, latest) = (max_staleness * t, (max_staleness + 1.0) * t);
        let miss = if fresh > 0.0 {
            mean_survival((earliest - attempt) / fresh, (latest - attempt) / fresh)
        } else {
            ((attempt - earliest) / (latest - earliest).max(1e-12)).clamp(0.0, 1.0)
        };
        let expected = if miss < 1.0 {
            1.0 / (1.0 - miss)
        } else {
            f64::INFINITY
        };
        let held = (attempt * expected).min(hold_limit_s.max(attempt));
        slot_s += held;
        attempts += held / attempt.max(1e-12);
    }
    Regeneration {
        slot_s: slot_s / LAG_POINTS as f64,
        attempts: attempts / LAG_POINTS as f64,
    }
}

/// Seconds per step averaged over a job of `steps` steps, what a finite run measures, from the
/// steady step `t`. The core keeps its window full through the last step (`Core::admit_groups`),
/// so the last batch takes the first groups to finish, as every earlier one does: the last step
/// of a job of several steps is a steady one (simulated on the RollArt-like job at
/// `maxStaleness` 2 to 8 and on its uniform placement, seeds 0 and 1: last steps of 56-143 s
/// against steady steps of 67-130 s). Charging it as the wait for the slowest groups admitted,
/// `one_batch` (the core's rule before that change: 258 s against about 120 s simulated), put
/// the prediction 6-10% high there (docs/planner.md). A job of one step is all start: its batch
/// is started at once, so it waits for `one_batch`. The first step is taken as a steady one
/// (not quite: with a window of two batches or more, at `maxStaleness` 4 and 8, it simulates
/// twice as long, the whole window starting at once; not modelled); but the trainer, idle until
/// the first groups are done (`first_ready`), must still train every step after.
fn job_average(t: f64, steps: f64, one_batch: f64, first_ready: f64, train_s: f64) -> f64 {
    let steps = steps.max(1.0);
    let last = if steps > 1.0 { t } else { one_batch.max(t) };
    ((steps - 1.0) * t + last).max(first_ready + steps * train_s) / steps
}

/// Seconds per step of a closed network of `customers` groups, each spending `think_s` in
/// generation (an infinite server: every group generates at once) and `service_s` at a single
/// FIFO server, by exact mean value analysis (Reiser and Lavenberg): the response time at the
/// server with `k` customers is `service x (1 + queue with k - 1)`, the throughput `k / (think +
/// response)`, the queue `throughput x response`.
fn closed_loop_step(customers: f64, think_s: f64, service_s: f64, per_step: f64) -> f64 {
    let n = customers.floor().max(1.0) as usize;
    let (mut queued, mut throughput) = (0.0, 0.0);
    for k in 1..=n {
        let response = service_s * (1.0 + queued);
        throughput = k as f64 / (think_s + response).max(1e-12);
        queued = throughput * response;
    }
    per_step / throughput.max(1e-12)
}

/// M/D/1 sojourn factor: service time times `1 + rho / (2 (1 - rho))`.
fn queue(rho: f64) -> f64 {
    let rho = rho.clamp(0.0, 0.999);
    1.0 + rho / (2.0 * (1.0 - rho))
}

/// Predicts a candidate's step time; `None` if it cannot run the job at any speed (no replica
/// to decode, no trainer, or the decode replicas cannot hold a single sequence).
pub fn predict(p: &Problem, c: &Candidate) -> Option<Prediction> {
    predict_caps(p, &capacities(p, c)?, c, RefillArrivals::Burst)
}

/// How the prediction lets the refills after a weight update arrive at the prefill queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefillArrivals {
    /// As the Poisson stream of M/G/1 alone.
    Poisson,
    /// In a burst as the rolling update reaches every replica ([`predict`]'s).
    Burst,
}

/// [`predict`] with the refills arriving as `arrivals` says. `search::choose` compares the
/// colocated and the affinity families with [`RefillArrivals::Poisson`]: the burst is right
/// for the few prefill replicas that take every replica's refills, but on colocated replicas
/// the model still misses the decode stalls the refills cause (docs/planner.md), and with the
/// burst on both a colocated placement came out ahead where it simulates 10% slower.
pub fn predict_with(p: &Problem, c: &Candidate, arrivals: RefillArrivals) -> Option<Prediction> {
    predict_caps(p, &capacities(p, c)?, c, arrivals)
}

/// What the search compares: [`objective_caps`]'s step time, not [`predict`]'s.
pub fn step_time(p: &Problem, c: &Candidate) -> Option<f64> {
    objective_caps(p, &capacities(p, c)?)
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
    /// Nodes the trainer spans: the core updates that many replicas' weights at once (its
    /// default `max_concurrent_updates`), each node feeding one.
    trainer_nodes: f64,
}

/// KV tokens a replica of `tp` GPUs of a pool holds besides the weights (the core's rule).
fn kv_tokens(p: &Problem, pool: &GpuPool, tp: f64) -> f64 {
    ((tp * pool.rates.memory * p.usable_memory - p.weight_bytes) / p.kv_bytes_per_token).max(0.0)
}

fn kv_cap(p: &Problem, pool: &GpuPool, tp: f64) -> f64 {
    (kv_tokens(p, pool, tp) / p.reserved_context.max(1.0))
        .floor()
        .min(p.max_seqs)
}

/// One replica of `tp` GPUs of a pool, as the decode model sees it.
fn decode_kind(p: &Problem, pool: &GpuPool, tp: f64, replicas: f64) -> DecodeKind {
    DecodeKind {
        replicas,
        bandwidth: pool.rates.bandwidth * tp,
        flops: pool.rates.flops * tp,
        cap: kv_cap(p, pool, tp),
        weight: router_weight(p.max_seqs, p.reserved_context, kv_tokens(p, pool, tp)),
    }
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
        trainer_nodes: c.trainer_gpus.div_ceil(trainer.per_node.max(1)).max(1) as f64,
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
                caps.kinds.push(decode_kind(p, pool, tp, n));
            }
        }
    }
    Some(caps)
}

/// The token-weighted mean per-token time, and each decode kind's mean batch.
type TokenTimes = (f64, Vec<f64>);

/// The step's environment time over every vCPU, and its rewards' time over the busiest serverless
/// pool's concurrency, seconds: the terms no GPU placement changes.
fn cpu_terms(p: &Problem, s: &StepWork) -> (f64, f64) {
    let w = &p.workload;
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
    (env_s, serverless_s)
}

fn predict_caps(
    p: &Problem,
    caps: &Caps,
    c: &Candidate,
    arrivals: RefillArrivals,
) -> Option<Prediction> {
    let s = step_work(p);
    let w = &p.workload;
    if caps.trainer_flops <= 0.0 {
        return None;
    }
    let disaggregated = caps.disaggregated;
    let prefill_flops = caps.prefill_flops;
    let prefill_fastest = caps.prefill_fastest;
    let kinds = &caps.kinds;
    if kinds.iter().all(|k| k.cap < 1.0) {
        return None;
    }
    let train_s = s.train_flops / (caps.trainer_flops * w.train_mfu);
    let (env_s, serverless_s) = cpu_terms(p, &s);
    let kv_per_seq = p.kv_bytes_per_token * s.decode_context;
    let flops_per_seq = p.flops_per_token + p.attention_flops * s.decode_context;
    let weights = p.active_weight_bytes;
    // Weight sync takes each replica offline once a step for a transfer; fold it in as a share
    // of the step the replica cannot serve.
    let sync_s = p.weight_bytes / p.link_bytes_per_s.max(1.0);
    let window = w.window();
    let transfer_per_token = p.kv_bytes_per_token / p.link_bytes_per_s.max(1.0);
    let decode_replicas: f64 = kinds.iter().map(|k| k.replicas).sum();

    // Seconds a trajectory is alive but not decoding, per token it decodes: at first its
    // environment steps and reward alone; each round of the fixed point below then counts its
    // prefills, queues and refills too.
    let plain_tokens_per_traj: f64 = w.tasks.iter().map(|k| k.share * k.turns * k.action).sum();
    let other_first = w
        .tasks
        .iter()
        .map(|k| k.share * ((k.turns + 1.0) * k.env_step_s + k.reward_s))
        .sum::<f64>()
        / plain_tokens_per_traj.max(1e-12);
    // Everything that depends on the step time T (through the throughput asked for).
    let (action_mean, action_sd) = action_spread(w);
    let evaluate = |t: f64| -> Option<(Terms, TokenTimes, f64, (f64, f64))> {
        let prefill_kinds = [(
            prefill_flops / prefill_fastest.max(1e-30),
            prefill_fastest,
            1.0,
        )];
        let fill = w.train_batch / w.batch;
        // A finished group waits for a training batch to fill: half the time one takes to
        // arrive. Its wait for the trainer itself is the closed loop's (below); the slot is
        // freed when the trainer takes the group, not when training ends.
        let wait = fill * t / 2.0;
        // Regenerated attempts decode their tokens again, which slows every token, which makes
        // more groups miss their deadline; and the trajectories alive set how much context the
        // weight updates make the replicas prefill again, which sets how long every prefill
        // queues, which sets how long they live. Four rounds of that fixed point, from the
        // lifetimes without regeneration or refills.
        let mut attempts_per_token = 1.0;
        let mut alive_s: Vec<f64> = vec![0.0; w.tasks.len()];
        let mut outcome = None;
        let mut offline_s = sync_s;
        let mut other = other_first;
        for _ in 0..4 {
            // Once a step each replica is drained and loads new weights: it serves nothing for
            // `offline_s`, a share of the step no sequence decodes on it.
            let online = (1.0 - offline_s / t).clamp(0.05, 1.0);
            let scaled: Vec<DecodeKind> = kinds
                .iter()
                .map(|k| DecodeKind {
                    replicas: k.replicas * online,
                    ..*k
                })
                .collect();
            // The router fills replicas by room, not speed: each kind decodes at its own
            // per-token time under the batch it is given, and a trajectory decodes at the time
            // of the replica it lands on.
            let served = routed(
                &scaled,
                s.decode_tokens * attempts_per_token / t,
                other,
                weights,
                kv_per_seq,
                flops_per_seq,
            )?;
            let tau = served.tau;
            // A sequence decodes alongside the others on its replica: Poisson occupancy makes
            // the batch it sees one larger than the mean (PASTA), one more KV cache to read per
            // token than the mean batch pays.
            let (seen_tau, seen_var) = served.seen(&scaled, kv_per_seq, flops_per_seq);
            // Draining waits for the longest of the replica's running actions, caught on
            // average half-way; a turn that arrives meanwhile (probability `offline / T`) waits
            // half of it.
            let per_replica = served.batch_per_replica(&scaled);
            let longest_action = action_mean + expected_max_z(per_replica) * action_sd;
            offline_s = sync_s + longest_action * seen_tau / 2.0;
            let update_wait = offline_s * offline_s / (2.0 * t);
            // The core updates replicas a trainer node's worth at a time, and a turn whose
            // replica is draining goes to another one (paying the refill counted below), so a
            // later turn waits only when every replica updates at once. A first turn under a
            // staleness bound of 1 must start on the newest weights, which no replica has until
            // the first of them is updated, so it waits either way.
            let together = decode_replicas <= caps.trainer_nodes;
            let later_wait = if together { update_wait } else { 0.0 };
            let first_wait = if together || w.max_staleness <= 1.0 {
                update_wait
            } else {
                0.0
            };
            // A sequence's own prefills run where it decodes: each kind of replica gets the
            // share of the trajectories' turns it serves, its share of the tokens (by compute
            // while none decodes).
            let sequences: f64 = served.token_share.iter().sum();
            let local_capacity: f64 = scaled.iter().map(|k| k.replicas * k.flops).sum();
            let at_tau: Vec<(f64, f64, f64)> = scaled
                .iter()
                .zip(&served.token_share)
                .map(|(k, q)| {
                    let share = if sequences > 0.0 {
                        q / sequences
                    } else {
                        k.replicas * k.flops / local_capacity.max(1e-30)
                    };
                    (k.replicas, k.flops, share)
                })
                .collect();
            let (local_jobs, remote_jobs) = step_prefills(p, disaggregated, &alive_s, t);
            let local = prefill_queue(&at_tau, &local_jobs, t);
            let remote = prefill_queue(&prefill_kinds, &remote_jobs, t);
            let (local_load, local_wait) = (local.load_s, local.wait_s);
            // Refills do not arrive as M/G/1's Poisson stream: they come in a burst as the
            // rolling update reaches every replica within seconds of a publish, so a refill also
            // queues behind about half of the step's refills on the replicas it goes to (the
            // search's objective counts the same burst). Without it the prediction ranked a
            // smaller prefill pool well at `maxStaleness` 3 and above, where the window holds
            // two batches, and was 11-21% low there (docs/planner.md).
            let (mut burst_remote, mut burst_local) = (0.0, 0.0);
            for (task, alive) in w.tasks.iter().zip(&alive_s) {
                let refills = w.batch * task.share / t * alive;
                let work = refills * context_prefill_flops(p, task.decode_context);
                if remote_prefill(p, disaggregated, task.decode_context) {
                    burst_remote += work;
                } else {
                    burst_local += work;
                }
            }
            let burst_remote = burst_remote / prefill_flops.max(1e-30) / 2.0;
            let burst_local = burst_local / local_capacity.max(1e-30) / 2.0;
            let (burst_remote, burst_local) = match arrivals {
                RefillArrivals::Burst => (burst_remote, burst_local),
                RefillArrivals::Poisson => (0.0, 0.0),
            };
            let mut slots = 0.0;
            let mut regenerated = 0.0;
            let mut tokens_with_retries = 0.0;
            let mut tail: f64 = 0.0;
            let mut first_ready = f64::INFINITY;
            let mut not_decoding = 0.0;
            for (task, alive) in w.tasks.iter().zip(alive_s.iter_mut()) {
                let first_tokens = task.prompt;
                let first = p.flops_per_token * first_tokens
                    + p.attention_flops * first_tokens * first_tokens / 2.0;
                let first_s = first_wait
                    + if remote_prefill(p, disaggregated, first_tokens) {
                        first * remote.s_per_flop
                            + remote.wait_s
                            + first_tokens * transfer_per_token
                    } else {
                        first * local.s_per_flop + local_wait
                    };
                let obs = task.observation;
                let later = p.flops_per_token * obs + p.attention_flops * obs * task.decode_context;
                let later_s = later * local.s_per_flop + local_wait + later_wait;
                // Once a step its replica takes new weights and drops its KV cache: its next
                // turn prefills the whole context again, and queues for it.
                let whole = context_prefill_flops(p, task.decode_context);
                let refill_s = if remote_prefill(p, disaggregated, task.decode_context) {
                    whole * remote.s_per_flop
                        + remote.wait_s
                        + burst_remote
                        + task.decode_context * transfer_per_token
                } else {
                    whole * local.s_per_flop + local_wait + burst_local
                };
                // A group is trained when its slowest member is done: the mean lifetime plus
                // `group_max_z` standard deviations of it (turns vary, and so does every step);
                // that maximum itself varies by `group_max_sd` standard deviations.
                let turns = task.turns;
                let per_turn = task.env_step_s + later_s + task.action * seen_tau;
                let plain_life = (turns + 1.0) * task.env_step_s
                    + first_s
                    + (turns - 1.0).max(0.0) * later_s
                    + turns * task.action * seen_tau
                    + task.reward_s;
                // One refill per step lived: `life = plain + refill x life / T`.
                let refill_share = (refill_s / t).min(0.9);
                let stretch = 1.0 / (1.0 - refill_share);
                let mean_life = plain_life * stretch;
                // Where a trajectory decodes is drawn by the router, again after every
                // weight update (its KV cache is gone, so it is routed afresh): its decode time
                // varies by the spread of per-token times over the replicas it may land on,
                // averaged over the steps it lives through.
                let tokens = turns * task.action;
                let placements = 1.0 + plain_life * stretch / t;
                let fresh_var = (turns
                    * (task.env_step_var + seen_tau * seen_tau * task.action_var)
                    + tokens * tokens * seen_var / placements)
                    * stretch
                    * stretch;
                let lasting_var = task.turns_var * per_turn * per_turn * stretch * stretch;
                let var_life = fresh_var + lasting_var;
                let attempt = mean_life + w.group_max_z * var_life.sqrt() + wait;
                let regen = regeneration(
                    attempt,
                    w.group_max_sd * lasting_var.sqrt(),
                    w.group_max_sd * fresh_var.sqrt(),
                    w.max_staleness,
                    t,
                    w.steps * t / 2.0,
                );
                slots += task.share * regen.slot_s;
                regenerated += task.share * (regen.slot_s - attempt).max(0.0);
                tokens_with_retries += task.share * turns * task.action * regen.attempts;
                tail = tail.max(attempt);
                first_ready = first_ready.min(attempt - wait);
                *alive = mean_life * regen.attempts;
                not_decoding += task.share * (mean_life - tokens * seen_tau).max(0.0);
            }
            other = not_decoding / plain_tokens_per_traj.max(1e-12);
            let plain_tokens: f64 = w.tasks.iter().map(|k| k.share * k.turns * k.action).sum();
            attempts_per_token = (tokens_with_retries / plain_tokens.max(1e-12)).max(1.0);
            outcome = Some((
                (tau, served.kinds.iter().map(|k| k.1).collect::<Vec<f64>>()),
                slots,
                regenerated,
                tail,
                first_ready,
                local_load,
                remote.load_s,
            ));
        }
        let (tau, slots, regenerated, tail, first_ready, local_load, remote_load) = outcome?;
        // The window's groups circulate between generation (each holds its slot `slots`, the
        // fill wait included) and the trainer, a single server taking `train_s / (B / n)` per
        // group: a closed network, solved exactly by mean value analysis. It is at least both
        // Little's law through the window (`B x slots / N`) and the trainer's capacity, and
        // above both near the knee, where the trainer sometimes waits for data and groups
        // sometimes wait for the trainer.
        let groups_per_step = w.batch / w.group_size.max(1.0);
        let latency_s = closed_loop_step(
            window / w.group_size.max(1.0),
            slots,
            train_s / groups_per_step.max(1e-12),
            groups_per_step,
        );
        let terms = Terms {
            train_s,
            prefill_s: remote_load,
            local_prefill_s: local_load,
            decode_s: 0.0,
            env_s,
            serverless_s,
            latency_s,
            staleness_s: w.batch * regenerated / window.max(1.0),
        };
        // A batch whose groups all start at once waits for the slowest of them and is then
        // trained: what a job of one step takes ([`job_average`]).
        let one_batch = tail + fill * train_s;
        // Nor can the trainer start before the first groups are done (the quickest task's),
        // and then it has every step's training still to do.
        let first_ready = if first_ready.is_finite() {
            first_ready
        } else {
            0.0
        };
        Some((terms, tau, slots, (one_batch, first_ready)))
    };
    let fixed = [train_s, env_s, serverless_s]
        .into_iter()
        .fold(0.0_f64, f64::max);
    let fits = |t: f64| -> bool {
        evaluate(t).is_some_and(|(terms, _, _, _)| {
            terms
                .latency_s
                .max(terms.local_prefill_s)
                .max(terms.prefill_s)
                .max(fixed)
                <= t
        })
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
    let (mut terms, (tau, batches), slot, (one_batch, first_ready)) = evaluate(t)?;

    let job_step_s = job_average(t, w.steps, one_batch, first_ready, train_s);
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
    let mut decode_index = 0;
    let mut decode_batch = vec![0.0; c.groups.len()];
    for (g, batch) in c.groups.iter().zip(decode_batch.iter_mut()) {
        if g.replicas == 0 || p.gpu_pools.get(g.pool).is_none() {
            continue;
        }
        let gpus = (g.tp * g.replicas) as f64;
        let share = match g.role {
            Role::Prefill => (terms.prefill_s / t).min(1.0),
            Role::Decode | Role::Generate => {
                // The decode kinds are the serving groups in order (`capacities`).
                let b = batches.get(decode_index).copied().unwrap_or(0.0);
                decode_index += 1;
                *batch = b;
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
    Some(Prediction {
        step_s: t,
        job_step_s,
        trajectories_per_s: w.batch / t,
        binding,
        terms,
        token_s: tau,
        decode_batch,
        slot_lifetime_s: slot,
        gpu_utilisation,
        env_utilisation: (env_s / t).min(1.0),
        cost_per_step_usd,
    })
}

/// The search's objective: the steady-state step time of the first-order model (Little's law
/// through the window with an M/D/1 trainer queue, and the slowest group inside `maxStaleness`
/// steps), with the refills after weight updates as prefill load and a burst wait, and without
/// the other terms [`predict`] adds (regeneration, the refills' own queueing model, drains, the
/// closed loop with the trainer). Those bring the prediction closer to the
/// simulated step on every placement checked, but rank one pair the wrong way round (a single
/// decode replica, whose stalls they underrate: docs/planner.md), so the search keeps this one.
fn objective_caps(p: &Problem, caps: &Caps) -> Option<f64> {
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
    let (env_s, serverless_s) = cpu_terms(p, &s);
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
        // Every trajectory alive when its replica takes new weights (once a step) loses its KV
        // cache and prefills its whole context again (a refill), where a turn without a cache
        // goes: by Little's law `B / T x life` are alive. Refills load the prefill queues, which
        // lengthen lives, which make more refills: two rounds, from none.
        let refill_flops = context_prefill_flops(p, s.decode_context);
        let refills_remote = remote_prefill(p, disaggregated, s.decode_context);
        let own_refill = refill_flops
            / if refills_remote {
                prefill_fastest
            } else {
                local_fastest
            }
            .max(1e-30);
        let mut refill = (0.0, 0.0);
        let mut outcome = (0.0, 0.0);
        for _ in 0..2 {
            let (refill_remote_s, refill_local_s) = refill;
            let q_first = queue((prefill_s + refill_remote_s) / t);
            let q_local = queue((local_prefill_s + refill_local_s) / t);
            // Refills come in a burst as each wave of replicas loads new weights, so a
            // trajectory alive at an update queues behind about half of the step's refills as
            // well as paying for its own, once for every step it lives.
            let burst = refill_remote_s.max(refill_local_s) / 2.0;
            let stretch = 1.0 / (1.0 - ((own_refill + burst) / t).min(0.9));
            let mut slots = 0.0;
            let mut longest: f64 = 0.0;
            let mut alive = 0.0;
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
                let mean_life = mean_life * stretch;
                let var_life = (turns * (task.env_step_var + tau * tau * task.action_var)
                    + task.turns_var * per_turn * per_turn)
                    * stretch
                    * stretch;
                let life = mean_life + w.group_max_z * var_life.sqrt();
                longest = longest.max(life);
                slots += task.share * life;
                alive += task.share * mean_life;
            }
            let refill_work = w.batch / t * alive * refill_flops;
            refill = if refills_remote {
                (refill_work / prefill_flops.max(1e-30), 0.0)
            } else {
                (0.0, refill_work / local_flops.max(1e-30))
            };
            outcome = (slots, longest);
        }
        let (slots, longest) = outcome;
        let (refill_remote_s, refill_local_s) = refill;
        let fill = w.train_batch / w.batch;
        // A finished group waits for a training batch to fill and for the trainer, which
        // queues batches like any server: a trainer busy nearly all the step makes every group
        // wait (M/D/1), holding its slot and ageing towards the staleness bound.
        let wait = fill * (t / 2.0 + train_s * queue(train_s / t));
        let latency_s = w.batch * (slots + wait) / window.max(1.0);
        let staleness_s = longest / w.max_staleness.max(1.0);
        let terms = Terms {
            train_s,
            prefill_s: prefill_s + refill_remote_s,
            local_prefill_s: local_prefill_s + refill_local_s,
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
        evaluate(t).is_some_and(|(terms, _, _)| {
            let refilled = terms.prefill_s.max(terms.local_prefill_s);
            terms
                .latency_s
                .max(terms.staleness_s)
                .max(refilled)
                .max(fixed)
                <= t
        })
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
    Some(hi)
}

/// A lower bound on the search objective of every completion of a partial candidate. Each
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
            caps.kinds
                .push(decode_kind(p, gp, largest as f64, (gpus / smallest) as f64));
        }
    }
    objective_caps(p, &caps)
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
            weight: 1.0,
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
    fn the_router_fills_replicas_by_room_so_a_slow_one_decodes_its_share_at_its_own_pace() {
        // Equal room, 1 GB of weights, 1 MB of KV per sequence, nothing but decoding. At 100
        // sequences each, the 1 TB/s replica takes (1e9 + 1e8) / 1e12 = 1.1 ms a token and the
        // 0.1 TB/s one 11 ms: 100 / 1.1e-3 + 100 / 1.1e-2 = 100,000 tokens/s, 10/11 of them
        // fast. Token-weighted: 10/11 x 1.1 + 1/11 x 11 = 2 ms (= 200 sequences / 1e5 tokens/s),
        // where water-filling gave the slow replica nothing and 1.11 ms.
        let served = routed(&[kind(1.0, 1e12), kind(1.0, 1e11)], 1e5, 0.0, 1e9, 1e6, 1.0).unwrap();
        assert!((served.tau - 2e-3).abs() < 1e-9, "{served:?}");
        assert!(
            (served.token_share[0] - 10.0 / 11.0).abs() < 1e-6,
            "{served:?}"
        );
        assert!((served.kinds[1].2 - 1.1e-2).abs() < 1e-8, "{served:?}");
        let filled = token_time(&[kind(1.0, 1e12), kind(1.0, 1e11)], 1e5, 1e9, 1e6, 1.0).unwrap();
        assert!((filled - 1e3 / 9e5).abs() < 1e-12, "{filled}");
    }

    #[test]
    fn one_gpu_replicas_that_the_router_still_fills_decode_their_share_far_slower_than_tp8() {
        // 1 GB of weights, 1 MB of KV per sequence. A fast replica (8 TB/s, room for 100 per
        // unit of load) beside a slow pool's eight GPUs at 0.25 TB/s each, either as one TP8
        // replica (2 TB/s, room 100) or as eight TP1 ones (room 5 each: the weights fill their
        // memory). TP8 at load 1: the fast one takes (1e9 + 1e8) / 8e12 = 0.1375 ms a token,
        // the slow one 1.1e9 / 2e12 = 0.55 ms; 100 / 0.1375e-3 + 100 / 0.55e-3 = 909,090.9
        // tokens/s, 200 sequences: 0.22 ms a token on average, 0.8 of the tokens fast.
        let fast = DecodeKind {
            weight: 100.0,
            ..kind(1.0, 8e12)
        };
        let tp8 = DecodeKind {
            weight: 100.0,
            ..kind(1.0, 2e12)
        };
        let rate = 100.0 / 0.1375e-3 + 100.0 / 0.55e-3;
        let a = routed(&[fast, tp8], rate, 0.0, 1e9, 1e6, 1.0).unwrap();
        assert!((a.tau - 0.22e-3).abs() < 1e-12, "{a:?}");
        assert!((a.token_share[0] - 0.8).abs() < 1e-9, "{a:?}");
        // A sequence also reads its own KV cache (1e6 / 8e12 and 1e6 / 2e12 s): it sees
        // 0.8 x 0.1375 + 0.2 x 0.55 + 0.8 x 0.000125 + 0.2 x 0.0005 = 0.2202 ms, with a
        // variance of 0.8 x 0.137625^2 + 0.2 x 0.5505^2 - 0.2202^2 = 0.027270 ms^2.
        let (seen_a, var_a) = a.seen(&[fast, tp8], 1e6, 1.0);
        assert!((seen_a - 0.2202e-3).abs() < 1e-12, "{seen_a}");
        let hand =
            0.8 * 0.137625e-3_f64.powi(2) + 0.2 * 0.5505e-3_f64.powi(2) - 0.2202e-3_f64.powi(2);
        assert!((var_a - hand).abs() < 1e-18, "{var_a} {hand}");
        // TP1: each replica reads the whole weights at a quarter of that bandwidth, more than
        // 4 ms a token (7.3 times the TP8 replica's pace), and the router still gives them
        // 40 / 140 of the trajectories: the per-token times a group's members see spread out.
        let tp1 = DecodeKind {
            weight: 5.0,
            ..kind(8.0, 0.25e12)
        };
        let b = routed(&[fast, tp1], rate, 0.0, 1e9, 1e6, 1.0).unwrap();
        assert!(b.kinds[1].2 > 4e-3, "{b:?}");
        assert!(b.token_share[1] > 0.0, "{b:?}");
        let (_, var_b) = b.seen(&[fast, tp1], 1e6, 1.0);
        // 1.4% of the tokens at 4.0 ms: a standard deviation of 0.45 ms against 0.165.
        assert!(var_b.sqrt() > 2.5 * var_a.sqrt(), "{b:?}");
        // Water-filling gave the slow replicas nothing either way.
        let wa = token_time(&[fast, tp8], rate, 1e9, 1e6, 1.0).unwrap();
        let wb = token_time(&[fast, tp1], rate, 1e9, 1e6, 1.0).unwrap();
        assert!(wb <= a.tau && wa <= a.tau, "{wa} {wb}");
    }

    #[test]
    fn a_trajectory_that_is_not_always_decoding_batches_only_while_it_decodes() {
        // 100 trajectories alive, each 1 ms of other work per token: the batch is 100 tau /
        // (tau + 1e-3), and (1e9 + 1e6 b) / 1e12 = tau gives tau^2 - 1e-4 tau - 1e-6 = 0:
        // tau = (1e-4 + sqrt(4.01e-6)) / 2 = 1.051249 ms, a batch of 51.25.
        let tau = replica_token_time(&kind(1.0, 1e12), 100.0, 1e-3, 1e9, 1e6, 1.0);
        assert!(
            (tau - (1e-4 + 4.01e-6_f64.sqrt()) / 2.0).abs() < 1e-12,
            "{tau}"
        );
        let batch = 100.0 * tau / (tau + 1e-3);
        assert!(((1e9 + 1e6 * batch) / 1e12 - tau).abs() < 1e-12);
        // Always decoding, it is the plain roofline of the whole batch.
        let plain = replica_token_time(&kind(1.0, 1e12), 100.0, 0.0, 1e9, 1e6, 1.0);
        assert!((plain - 1.1e-3).abs() < 1e-12, "{plain}");
    }

    #[test]
    fn the_router_gives_a_replica_trajectories_in_proportion_to_its_room() {
        // 256 batch slots; 10,000 tokens reserved per trajectory. 2.56 M KV tokens: load
        // 1/256 + 1/256 per trajectory, weight 128; 100,000 KV tokens: 1/256 + 1/10, 9.624.
        assert!((router_weight(256.0, 10_000.0, 2.56e6) - 128.0).abs() < 1e-9);
        let small = router_weight(256.0, 10_000.0, 1e5);
        assert!((small - 1.0 / (1.0 / 256.0 + 0.1)).abs() < 1e-12, "{small}");
        assert_eq!(router_weight(256.0, 10_000.0, 0.0), 0.0);
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

    #[test]
    fn a_group_whose_attempt_fits_the_earliest_deadline_is_never_regenerated() {
        // S = 2, T = 100 s: deadlines fall in [200, 300] s; a fixed 150 s attempt makes all.
        let r = regeneration(150.0, 0.0, 0.0, 2.0, 100.0, 1e9);
        assert_eq!(r.attempts, 1.0);
        assert_eq!(r.slot_s, 150.0);
    }

    #[test]
    fn a_fixed_attempt_misses_the_share_of_deadlines_it_outlives_and_retries_by_wald() {
        // A 250 s attempt outlives deadlines in [200, 250): half of them. Expected attempts
        // 1 / (1 - 0.5) = 2, each holding the slot 250 s: 500 s.
        let r = regeneration(250.0, 0.0, 0.0, 2.0, 100.0, 1e9);
        assert!((r.attempts - 2.0).abs() < 1e-12, "{r:?}");
        assert!((r.slot_s - 500.0).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn a_group_that_never_makes_its_deadline_holds_its_slot_until_the_limit() {
        // S = 0, T = 100: every deadline is under 100 s; a 1,000 s attempt always misses.
        let r = regeneration(1000.0, 0.0, 0.0, 0.0, 100.0, 5000.0);
        assert!((r.slot_s - 5000.0).abs() < 1e-9, "{r:?}");
        assert!((r.attempts - 5.0).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn a_fresh_spread_misses_by_the_mean_normal_survival_over_the_deadlines() {
        // Attempt Normal(250, 50) against deadlines uniform on [200, 300]: the mean of Q(x) for
        // x in [-1, 1] is 1/2 by symmetry, so 2 attempts of 250 s on average.
        let r = regeneration(250.0, 0.0, 50.0, 2.0, 100.0, 1e9);
        assert!((r.attempts - 2.0).abs() < 1e-6, "{r:?}");
        assert!((r.slot_s - 500.0).abs() < 1e-4, "{r:?}");
    }

    #[test]
    fn a_job_of_several_steps_averages_its_steady_step_because_the_window_stays_full_to_the_end() {
        // 20 steps of 110 s: the slowest groups of a batch started at once (260 s) do not set
        // the last step, whose batch takes the first groups to finish (charging them made it
        // (19 x 110 + 260) / 20 = 117.5 s). The trainer's floor, 20 + 20 x 70 = 1,420 s, is
        // under 20 x 110 = 2,200 s.
        assert_eq!(job_average(110.0, 20.0, 260.0, 20.0, 70.0), 110.0);
    }

    #[test]
    fn a_job_of_one_step_waits_for_the_slowest_groups_of_its_batch() {
        // Its one batch is started at once: 260 s, not the steady 110 s.
        assert_eq!(job_average(110.0, 1.0, 260.0, 20.0, 70.0), 260.0);
        // A batch quicker than the steady step still takes a steady step.
        assert_eq!(job_average(110.0, 1.0, 90.0, 20.0, 70.0), 110.0);
    }

    #[test]
    fn a_trainer_idle_until_the_first_groups_are_done_can_set_the_jobs_average() {
        // 5 steps of 0.9 s, training 0.8 s a step: with the first groups done at 0.5 s the
        // trainer's 5 x 0.8 s after them end at 4.5 s, 0.9 s a step; done at 0.6 s, they end at
        // 4.6 s, 0.92 s a step, above the steady 0.9 s.
        assert!((job_average(0.9, 5.0, 1.2, 0.5, 0.8) - 0.9).abs() < 1e-12);
        assert!((job_average(0.9, 5.0, 1.2, 0.6, 0.8) - 0.92).abs() < 1e-12);
    }

    #[test]
    fn the_mean_survival_function_matches_its_antiderivative_by_hand() {
        // Over [0, 1]: (1 x Q(1) - phi(1)) - (0 - phi(0)) = 0.158655 - 0.241971 + 0.398942.
        assert!((mean_survival(0.0, 1.0) - 0.315_626).abs() < 1e-5);
        assert!((mean_survival(-1.0, 1.0) - 0.5).abs() < 1e-7);
        assert!((mean_survival(0.0, 0.0) - 0.5).abs() < 1e-7);
    }

    #[test]
    fn one_group_in_the_closed_loop_takes_its_generation_plus_its_training() {
        // One customer: never queues, cycle = 3 s + 1 s; 2 groups a step take two cycles.
        assert!((closed_loop_step(1.0, 3.0, 1.0, 2.0) - 8.0).abs() < 1e-12);
    }

    #[test]
    fn two_groups_in_the_closed_loop_follow_mean_value_analysis_by_hand() {
        // k = 1: R = 1, X = 1/4, Q = 1/4. k = 2: R = 1 x (1 + 1/4) = 1.25, X = 2 / 4.25.
        // One group a step: 4.25 / 2 = 2.125 s.
        assert!((closed_loop_step(2.0, 3.0, 1.0, 1.0) - 2.125).abs() < 1e-12);
    }

    #[test]
    fn a_crowded_closed_loop_runs_at_the_trainers_pace_and_a_sparse_one_at_littles_law() {
        // 1,000 groups, 3 s each in generation, 1 s each at the trainer: the trainer binds.
        assert!((closed_loop_step(1000.0, 3.0, 1.0, 1.0) - 1.0).abs() < 1e-6);
        // A trainer far faster than generation: Little's law, 100 groups per 50 s cycle.
        let sparse = closed_loop_step(100.0, 50.0, 1e-6, 100.0);
        assert!((sparse - 50.0).abs() < 1e-3, "{sparse}");
    }

    #[test]
    fn a_prefill_waits_as_in_an_mg1_queue_by_hand() {
        // One replica of 1 PFLOP/s; per 100 s step, 10 prefills of 1 PFLOP and 10 of 3 PFLOP.
        // Load 40 s, rho 0.4; E[S^2] / (2 E[S]) = (10 + 90) / (2 x 40) = 1.25 s;
        // wait = 0.4 / 0.6 x 1.25 = 0.8333 s.
        let q = prefill_queue(&[(1.0, 1e15, 1.0)], &[(10.0, 1e15), (10.0, 3e15)], 100.0);
        assert!((q.load_s - 40.0).abs() < 1e-9, "{q:?}");
        assert!((q.wait_s - 0.4 / 0.6 * 1.25).abs() < 1e-9, "{q:?}");
        assert!((q.s_per_flop - 1e-15).abs() < 1e-27, "{q:?}");
    }

    #[test]
    fn the_action_spread_pools_the_tasks_by_their_turns() {
        // Task a: 1 turn of 100 +- 0 tokens; task b: 3 turns of 200 +- 10. Weights 1 and 3:
        // mean 175; second moment (1 x 10,000 + 3 x 40,100) / 4 = 32,575; sd sqrt(1,950).
        let task = |turns: f64, action: f64, action_var: f64| crate::workload::TaskLoad {
            name: String::new(),
            share: 0.5,
            turns,
            group_turns: turns,
            turns_var: 0.0,
            env_step_var: 0.0,
            action_var,
            prompt: 0.0,
            action,
            observation: 0.0,
            decode_context: 0.0,
            env_step_s: 0.0,
            env_cpus: 1.0,
            reward_s: 0.0,
            serverless_pool: None,
            local_reward: false,
        };
        let w = Workload {
            tasks: vec![task(1.0, 100.0, 0.0), task(3.0, 200.0, 100.0)],
            batch: 8.0,
            group_size: 1.0,
            train_batch: 8.0,
            max_staleness: 1.0,
            over_provisioning: 0.0,
            train_mfu: 0.5,
            steps: 1.0,
            group_max_z: 0.0,
            group_max_sd: 1.0,
        };
        let (mean, sd) = action_spread(&w);
        assert!((mean - 175.0).abs() < 1e-9);
        assert!((sd - 1950.0_f64.sqrt()).abs() < 1e-9);
    }
}
