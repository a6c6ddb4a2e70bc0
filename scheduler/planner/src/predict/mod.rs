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
//!   group is taken by the trainer, but for the finished groups waiting for a training batch that
//!   the core leaves out of it ([`Workload::waiting_outside_window`]). The window's groups
//!   circulate between generation and the trainer, a closed network solved by mean value
//!   analysis: at least Little's law, `B x L / N` for a mean slot lifetime `L`, and at least the
//!   trainer's capacity.
//!
//! The slot lifetime `L` is built from the job's distributions:
//!
//! - a group is done when its slowest member is (the largest of `n` lifetimes of their mean,
//!   spread and skew: [`model::skewed_expected_max`]), then waits for a training batch to fill;
//! - each turn decodes at the per-token time of the replica it is on: replicas batch every
//!   running sequence, so each token takes `max((W + b x KV x c) / bandwidth, b x FLOPs /
//!   FLOP/s)` for a batch of `b`. The core's router fills replicas by their room (batch slots
//!   and KV memory), not their speed, and keeps a trajectory on its replica until a weight
//!   update drops its KV cache ([`model::routed`]): each kind of replica holds its share of the
//!   trajectories alive, decodes them at its own per-token time, and the load level is the one
//!   that decodes the tokens asked for. A trajectory's decode time is the token-weighted mean
//!   of those times, and varies by their spread (a group's slowest member is often the one on
//!   the slowest replica). A replica's batch is a random variable ([`model::replica_occupancy`]:
//!   the product form of a processor-sharing station whose iteration time grows with its batch),
//!   and a token takes its mean batch over its throughput, which counts the sequence's own KV
//!   read and the experts it routes to, and the slow busy states a mixture of experts spends its
//!   time in;
//! - once a step each replica is drained and loads new weights, dropping its KV caches: every
//!   trajectory alive then prefills its whole context again (a refill). A turn arriving during
//!   the drain goes to another replica, unless every replica updates at once (no more decode
//!   replicas than trainer nodes) or it is a first turn that must start on the newest weights
//!   (`maxStaleness: 1`): then it waits. Prefills queue (M/G/1) where they run, the refills
//!   weighed by the square of their cost; the refills also arrive in a burst, as the rest of
//!   the turns their sequences were caught in ends, whose backlog the refills and the first
//!   turns wait for ([`prefill::refill_backlog`]); a prefill on a cached context waits behind the
//!   other prefills between bursts, or behind the rest of the burst its sequence was refilled
//!   in ([`prefill::Backlog::cached_s`]);
//! - the staleness bound: a group must be taken by the trainer within `maxStaleness + 1`
//!   versions of its start, less the share of a step it started into; an attempt that misses is
//!   thrown away and the group starts again (regeneration). A group of a multi-turn task whose
//!   long chain does not fit its deadline is restarted at the first publication after its start,
//!   as the core does (`Core::restart_late_groups`), and then has the whole bound; by renewal
//!   over its attempts it holds its slot for the time each attempt held it.
//!
//! The step time is the smallest `T` at least every term evaluated at the throughput `B / T`
//! (bisection). The job's average ([`model::job_average`]) is that step over every step of a job of
//! several plus the wait of its last step for the groups the job started last
//! ([`model::drain_wait`]), the slowest groups of its one batch for a job of one step, and at
//! least the time the trainer needs when it can train a group only once the group is done
//! ([`model::trainer_done`]).
//!
//! The staleness term does not model the core's regeneration of a lone expired finished member
//! at a publication (`Core::regenerate_lone_expired`): in the simulator a miss regenerates
//! members that had finished too (their first turns expire with the slowest's), and the rule acts
//! on groups already regenerated, whose members the retries left at different versions. The
//! whole-group restart modelled here predicts the simulated steady step of the RollArt-like job
//! within 3% at its bound of 2; modelled as a one-member retry, the rule put it 6-9% low and
//! moved the trainer scan to placements that simulate up to 4% slower, when the rule was chosen.
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
use crate::workload::Workload;

mod model;
mod prefill;
mod solve;

pub use model::DECODE_COMPUTE_SHARE_MAX;

#[cfg(test)]
use model::Occupancy;
use model::{DecodeKind, StepWork, router_weight, step_work};
use solve::{objective_caps, predict_caps};

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
    /// Bytes of active weights one token's forward pass reads.
    pub active_weight_bytes: f64,
    /// Bytes of weights a forward pass reads as a function of its tokens (a mixture of experts
    /// reads the union of the experts its tokens route to; the simulator's formula).
    pub weight_reads: rollfleet_spec::WeightReads,
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
    /// Forward FLOPs of prefilling `tokens` new tokens after `cached` ones: the dense part and
    /// causal attention over every position (the simulator's formula).
    pub fn prefill_flops(&self, tokens: f64, cached: f64) -> f64 {
        tokens * self.flops_per_token
            + rollfleet_spec::causal_attention_flops(self.attention_flops, cached, tokens)
    }

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
    /// The staleness bound on a step's longest chain ([`Terms::chain_s`]; in the search
    /// objective, on a group's lifetime).
    Staleness,
}

/// How the model says one task's groups live, in seconds: what `rollfleet sim` compares with
/// the core's measured `TaskLives`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TaskLife {
    /// A member's mean life, from its group's first turn to its reward (one attempt).
    pub member_s: f64,
    /// The slowest member's life: when the group is done (one attempt).
    pub group_s: f64,
    /// From its admission to the end of the attempt the trainer takes: every attempt,
    /// restarted ones included, but not the wait for the trainer after (the closed loop of
    /// groups and trainer adds that to the step).
    pub until_done_s: f64,
    /// From the end of that attempt to the trainer taking the group: half the time a training
    /// batch takes to fill, and the closed loop's queue at the trainer (the same for every task).
    pub trainer_wait_s: f64,
}

/// What the predictor says about a candidate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Seconds per RL step, in steady state.
    pub step_s: f64,
    /// Seconds per RL step averaged over the job's steps, what a finite run measures
    /// (`job_average`): the steady step and the last step's wait for the groups the job
    /// started last, the slowest groups of the batch for a job of one step, and at least the
    /// trainer's work after the first groups are done.
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
    /// How each task's groups live (parallel to the workload's tasks).
    pub task_lives: Vec<TaskLife>,
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
    /// The longest chain of a step's trajectories (its expected maximum, at the predicted
    /// per-token times and queues) plus the training of its mini-batch, over `maxStaleness + 1`
    /// steps: a trajectory trained at step `v` cannot start before version `v - maxStaleness` is
    /// published, so no step is shorter (the lower bound's staleness-latency term).
    pub chain_s: f64,
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

/// What the search compares: [`solve::objective_caps`]'s step time, not [`predict`]'s.
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
    /// Nodes the trainer spans: the core updates at most that many replicas' weights at once
    /// (its default `max_concurrent_updates`), each node feeding one.
    trainer_nodes: f64,
}

/// How many decoding replicas rollfleet's rolling update takes out of service at once: one per
/// trainer node, but never more than half of them (at least one), as the core's
/// `Policy::updates_keep_half_decoding` rule has it.
pub fn decoding_updated_at_once(trainer_nodes: u32, decode_replicas: u32) -> u32 {
    trainer_nodes.min((decode_replicas / 2).max(1)).max(1)
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
        bytes: p.weight_reads.bytes(batch) + batch * p.kv_bytes_per_token * context,
    }
}

#[cfg(test)]
mod tests;
