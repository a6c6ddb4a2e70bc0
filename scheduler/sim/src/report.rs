//! Reports: what a run measured and the lower bound, serialised as JSON (`render` prints them as
//! the table).
//!
//! The JSON is a serialisation of [`SimReport`]; it contains no wall-clock figures, only virtual
//! time and counts, so the same job and seed give byte-identical output.

use rollfleet_catalog::Catalog;
use rollfleet_core::{Placement, ServeRole};
use rollfleet_spec::{JobSpec, PoolKind};
use serde::Serialize;

use crate::bound::{LatencyRates, latency_makespan, min_makespan};
use crate::hardware::HardwareModel;
use crate::reference::{Bias, Mix, Reference};
use crate::sim::{ReplicaDecode, RunResult, Work, model_costs};

mod render;
pub use render::render_table;

/// The lower bound on one RL step (see [`crate::bound`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoundReport {
    /// The bound: the largest of the capacity terms and the latency term, seconds per step.
    pub step_s: f64,
    /// The largest capacity term (work over capacity), seconds per step.
    pub capacity_s: f64,
    /// The staleness-aware latency term, seconds per step.
    pub latency_s: f64,
    /// The staleness bound the latency term assumes (versions).
    pub max_staleness: u64,
    /// GPU pools under the best fractional placement, seconds per step.
    pub gpu_s: f64,
    /// CPU pools (environments and local rewards), seconds per step.
    pub cpu_s: f64,
    /// The busiest serverless pool, seconds per step.
    pub serverless_s: f64,
    /// What binds: `gpu`, `cpu`, `serverless` or `latency`.
    pub binding: String,
    /// Which resource binds among the capacity terms alone.
    pub capacity_binding: String,
    /// Per GPU pool: seconds per step of each kind of work under the best placement.
    pub gpu_pools: Vec<BoundPool>,
}

/// One GPU pool's share of the bound.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoundPool {
    /// Pool name.
    pub pool: String,
    /// Prefill seconds per step.
    pub prefill_s: f64,
    /// Decode seconds per step.
    pub decode_s: f64,
    /// Training seconds per step.
    pub train_s: f64,
}

/// The fastest rates of the job's hardware, for the latency term (see [`LatencyRates`]).
pub fn latency_rates(spec: &JobSpec, catalog: &Catalog, hw: &HardwareModel) -> LatencyRates {
    let costs = model_costs(spec);
    let mfu = spec.rl.train_mfu.clamp(0.01, 1.0);
    let mut rates = LatencyRates {
        replica_bandwidth: 0.0,
        replica_compute: 0.0,
        train_flops: 0.0,
        weight_bytes: costs.active_weight_bytes,
        kv_bytes_per_token: costs.kv_bytes_per_token,
        flops_per_token: costs.flops_per_token,
        attention_flops_per_context: costs.attention_flops_per_context,
        decode_slowdown: 1.0,
    };
    for pool in &spec.pools {
        if pool.kind() != Some(PoolKind::Gpu) {
            continue;
        }
        let Some(gpu) = pool.gpu.as_deref().and_then(|g| catalog.gpu(g).ok()) else {
            continue;
        };
        let n = pool.count.unwrap_or(0).max(0) as f64;
        // The largest replica: every GPU of a node (or of the pool, if smaller), with tensor
        // parallelism assumed perfect, as the simulator assumes it.
        let per_replica = n.min(pool.gpus_per_node().max(1) as f64);
        rates.replica_bandwidth = rates
            .replica_bandwidth
            .max(per_replica * gpu.memory_bandwidth_bytes_per_s() * hw.bandwidth_efficiency);
        rates.replica_compute = rates
            .replica_compute
            .max(per_replica * gpu.peak_flops() * hw.compute_efficiency);
        rates.train_flops += n * gpu.peak_flops() * mfu;
    }
    rates
}

/// Computes the bound from the useful work of `steps` steps, for a policy keeping turns at most
/// `max_staleness` versions old.
pub fn lower_bound(
    spec: &JobSpec,
    catalog: &Catalog,
    hw: &HardwareModel,
    work: &Work,
    steps: u64,
    max_staleness: u64,
) -> BoundReport {
    let steps = steps.max(1) as f64;
    let costs = model_costs(spec);
    let mfu = spec.rl.train_mfu.clamp(0.01, 1.0);
    let mut names = Vec::new();
    let mut cost = vec![Vec::new(), Vec::new(), Vec::new()];
    let mut vcpus = 0.0;
    for pool in &spec.pools {
        match pool.kind() {
            Some(PoolKind::Gpu) => {
                let Some(gpu) = pool.gpu.as_deref().and_then(|g| catalog.gpu(g).ok()) else {
                    continue;
                };
                let n = pool.count.unwrap_or(0).max(0) as f64;
                if n == 0.0 {
                    continue;
                }
                let flops = n * gpu.peak_flops() * hw.compute_efficiency;
                let bw = n * gpu.memory_bandwidth_bytes_per_s() * hw.bandwidth_efficiency;
                // At best every iteration runs a full batch, which reads the weights its tokens
                // route to (all of a dense model's) once.
                let full = rollfleet_core::placement::MAX_SEQS_PER_REPLICA as f64;
                let weight_reads = work.decode_tokens * costs.weight_reads.bytes(full) / full;
                names.push(pool.name.clone());
                cost[0].push(work.prefill_flops / flops);
                cost[1].push(
                    (work.decode_flops / flops).max((work.decode_kv_bytes + weight_reads) / bw),
                );
                cost[2].push(work.train_flops / (n * gpu.peak_flops() * mfu));
            }
            Some(PoolKind::Cpu) => {
                let shape = pool.cpu.as_deref().and_then(|c| catalog.cpu_shape(c).ok());
                vcpus +=
                    shape.map_or(0.0, |s| s.vcpus as f64) * pool.count.unwrap_or(0).max(0) as f64;
            }
            _ => {}
        }
    }
    let (gpu_total, x) = min_makespan(&cost).unwrap_or((0.0, vec![vec![]; 3]));
    let gpu_pools = names
        .iter()
        .enumerate()
        .map(|(p, name)| BoundPool {
            pool: name.clone(),
            prefill_s: x[0].get(p).copied().unwrap_or(0.0) * cost[0][p] / steps,
            decode_s: x[1].get(p).copied().unwrap_or(0.0) * cost[1][p] / steps,
            train_s: x[2].get(p).copied().unwrap_or(0.0) * cost[2][p] / steps,
        })
        .collect();
    let cpu_s = if vcpus > 0.0 {
        (work.env_cpu_seconds + work.local_reward_cpu_seconds) / vcpus / steps
    } else {
        0.0
    };
    let serverless_s = work
        .serverless_seconds
        .iter()
        .map(|(&pool, &secs)| {
            let conc = spec
                .pools
                .get(pool as usize)
                .and_then(|p| p.concurrency)
                .unwrap_or(1)
                .max(1) as f64;
            secs / conc / steps
        })
        .fold(0.0, f64::max);
    let gpu_s = gpu_total / steps;
    let (capacity_s, capacity_binding) =
        [(gpu_s, "gpu"), (cpu_s, "cpu"), (serverless_s, "serverless")]
            .into_iter()
            .fold((0.0, "gpu"), |best, c| if c.0 > best.0 { c } else { best });
    let latency_s = latency_makespan(&work.steps, max_staleness) / steps;
    let (step_s, binding) = if latency_s > capacity_s {
        (latency_s, "latency")
    } else {
        (capacity_s, capacity_binding)
    };
    BoundReport {
        step_s,
        capacity_s,
        latency_s,
        max_staleness,
        gpu_s,
        cpu_s,
        serverless_s,
        binding: binding.to_owned(),
        capacity_binding: capacity_binding.to_owned(),
        gpu_pools,
    }
}

/// How one pool was used.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolReport {
    /// Pool name.
    pub name: String,
    /// `gpu`, `cpu` or `serverless`.
    pub kind: String,
    /// What it did in this run.
    pub use_: String,
    /// Busy share of its capacity over the run (GPU-seconds busy over GPU-seconds, vCPU-seconds
    /// over vCPU-seconds, executions over concurrency).
    pub utilisation: f64,
    /// Share of its GPU-seconds spent loading weights.
    pub weight_sync_share: f64,
    /// How its serving replicas decoded (none for a pool without one that decoded).
    pub decode: Option<PoolDecode>,
}

/// How a GPU pool's serving replicas decoded over a run: the pool as a whole, and its busiest
/// and slowest replica. Replicas of one kind that the router fills alike decode alike; one far
/// from the pool's mean took more than its share (on the held-out MoE job, the replicas that
/// take new weights first: `docs/planner.md`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolDecode {
    /// Replicas that decoded.
    pub replicas: usize,
    /// Sequences decoding at once while any did, over the pool's replicas.
    pub batch: f64,
    /// The largest of its replicas' own figure.
    pub busiest_replica_batch: f64,
    /// Seconds a decoded token took, over the tokens (its batch's iteration time).
    pub s_per_token: f64,
    /// The largest of its replicas' own figure.
    pub slowest_replica_s_per_token: f64,
}

impl PoolDecode {
    /// The decoding of the replicas in `replicas` (`None` if none decoded).
    pub fn of<'a>(replicas: impl IntoIterator<Item = &'a ReplicaDecode>) -> Option<PoolDecode> {
        let decoded: Vec<&ReplicaDecode> = replicas
            .into_iter()
            .filter(|r| r.decoding_s > 0.0 && r.tokens > 0.0)
            .collect();
        if decoded.is_empty() {
            return None;
        }
        let sum = |f: fn(&ReplicaDecode) -> f64| decoded.iter().map(|r| f(r)).sum::<f64>();
        let largest =
            |f: fn(&ReplicaDecode) -> f64| decoded.iter().map(|r| f(r)).fold(0.0_f64, f64::max);
        Some(PoolDecode {
            replicas: decoded.len(),
            batch: sum(|r| r.sequence_s) / sum(|r| r.decoding_s),
            busiest_replica_batch: largest(|r| r.sequence_s / r.decoding_s),
            s_per_token: sum(|r| r.sequence_s) / sum(|r| r.tokens),
            slowest_replica_s_per_token: largest(|r| r.sequence_s / r.tokens),
        })
    }
}

/// How the trainer was loaded over a run: its batches, the share of the run it spent training,
/// and how long a batch took. A batch's training follows its tokens, so a batch of long groups
/// takes well over the mean; a run of them keeps the trainer busy while finished groups wait.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainerLoad {
    /// Training batches.
    pub batches: usize,
    /// Seconds spent training over the run's seconds.
    pub busy_share: f64,
    /// The shortest, mean and longest seconds a batch took.
    pub batch_s_min: f64,
    pub batch_s_mean: f64,
    pub batch_s_max: f64,
}

impl TrainerLoad {
    /// The load of batches that took `batch_s` seconds each over a run of `total_s` (`None` if
    /// nothing was trained).
    pub fn of(batch_s: &[f64], total_s: f64) -> Option<TrainerLoad> {
        if batch_s.is_empty() {
            return None;
        }
        let busy: f64 = batch_s.iter().sum();
        Some(TrainerLoad {
            batches: batch_s.len(),
            busy_share: if total_s > 0.0 { busy / total_s } else { 0.0 },
            batch_s_min: batch_s.iter().copied().fold(f64::INFINITY, f64::min),
            batch_s_mean: busy / batch_s.len() as f64,
            batch_s_max: batch_s.iter().copied().fold(0.0_f64, f64::max),
        })
    }
}

/// Everything measured for one policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    /// The policy.
    pub policy: String,
    /// RL steps trained.
    pub steps: u64,
    /// Virtual seconds to train them all.
    pub total_s: f64,
    /// Seconds per RL step (total over steps).
    pub step_time_s: f64,
    /// Seconds per RL step in steady state: between the end of the warm-up and the start of
    /// the drain, each a tenth of the steps (at least one), when the job has five steps or more.
    pub steady_step_time_s: Option<f64>,
    /// How long each step took, first to last: from the start (or the previous publication) to
    /// the publication that ended it.
    pub step_times_s: Vec<f64>,
    /// `sync`'s step time over this one's, when `sync` was run too.
    pub speedup_vs_sync: Option<f64>,
    /// Trajectories trained on per second.
    pub trajectories_per_s: f64,
    /// Tokens trained on per second.
    pub trained_tokens_per_s: f64,
    /// Tokens generated per second (including regenerated ones).
    pub generated_tokens_per_s: f64,
    /// Every pool's utilisation.
    pub pools: Vec<PoolReport>,
    /// How the trainer was loaded (`None` if nothing was trained).
    pub trainer: Option<TrainerLoad>,
    /// Environment (CPU pools) utilisation.
    pub environment_utilisation: f64,
    /// Trajectories trained on, by how many versions their oldest turn was behind.
    pub staleness_histogram: Vec<u64>,
    /// The staleness bound the policy kept (versions).
    pub max_staleness: u64,
    /// The placement it ran on, as its rules chose it (`crate::best`): `tp N` for `sync`, the
    /// placement's name for the others.
    pub placement: String,
    /// The candidates it chose from, each simulated for the job's first steps (empty when its
    /// rules allow one placement).
    pub placement_probes: Vec<crate::best::Probe>,
    /// rollfleet's admission window, chosen by simulating the job at each width on seeds of its
    /// own (`crate::window`); none for the other policies.
    pub admission_window: Option<crate::window::WindowChoice>,
    /// The lower bound for this run's trained work.
    pub bound: BoundReport,
    /// Bound over achieved step time.
    pub efficiency: f64,
    /// The job's fixed reference bound (the same for every policy) over achieved step time.
    pub reference_efficiency: f64,
    /// The mean seconds a decoded token took, as the sequence decoding it saw it (its batch's
    /// iteration time, over the tokens); `None` if nothing decoded.
    pub decode_s_per_token: Option<f64>,
    /// The fixed yardstick replayed with every token of its chains decoded at this run's own
    /// speed ([`Reference::at_decode`]): what is left between it and the step is the rest of
    /// the schedule (queueing, waits for the trainer and the weights, regeneration). Not a
    /// bound on every schedule.
    pub yardstick_at_its_decode_s: Option<f64>,
    /// What it trained: tokens and environment time per trajectory, task shares.
    pub mix: Mix,
    /// How that mix differs from the episodes as first sampled.
    pub bias: Bias,
    /// Indicative cost of a step, USD: the catalogue prices of the GPU pools it used and of
    /// the CPU pools for the step's time, plus the serverless reward calls of its trajectories.
    pub usd_per_step: f64,
    /// The capacity terms alone over achieved step time (a bound blind to latency).
    pub capacity_efficiency: f64,
    /// Serverless cold starts.
    pub serverless_cold_starts: u64,
    /// The core's counters.
    pub core: rollfleet_core::Stats,
    /// Invariant breaches the simulator saw (empty when all held).
    pub invariant_violations: Vec<String>,
    /// Inputs and timeouts the core handled.
    pub scheduler_events: u64,
    /// Events the simulator processed.
    pub sim_events: u64,
}

/// How rollfleet's groups of one task lived in a run (means over the groups the trainer took,
/// seconds), beside the planner's model of them: where a predicted step and a simulated one part.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupLives {
    /// The task.
    pub task: String,
    /// Its groups the trainer took.
    pub groups: u64,
    /// A member's life, from its group's first turn (of the attempt trained) to its reward.
    pub member_s: f64,
    /// The slowest member's life: when the group was done.
    pub group_s: f64,
    /// From its admission to being done: every attempt, restarted ones included.
    pub until_done_s: f64,
    /// The slot the group held in the admission window, from its admission to the trainer
    /// taking it: `until_done_s` and `trainer_wait_s`.
    pub slot_s: f64,
    /// From the group being done to the trainer taking it.
    pub trainer_wait_s: f64,
    /// The planner's model of the same, when it predicted the run's placement.
    pub model: Option<rollfleet_planner::predict::TaskLife>,
}

/// Each task's [`GroupLives`] in a run of `spec`, with the planner's model of them when given
/// (parallel to the job's tasks, as the planner's workload lists them).
pub fn group_lives(
    spec: &JobSpec,
    stats: &rollfleet_core::Stats,
    model: Option<&[rollfleet_planner::predict::TaskLife]>,
) -> Vec<GroupLives> {
    let model = model.filter(|m| m.len() == spec.tasks.len());
    spec.tasks
        .iter()
        .enumerate()
        .filter_map(|(i, task)| {
            let lives = stats.task_lives.get(i)?;
            let [slot_s, group_s, member_s, trainer_wait_s] = lives.means()?;
            Some(GroupLives {
                task: task.name.clone(),
                groups: lives.groups,
                member_s,
                group_s,
                until_done_s: slot_s - trainer_wait_s,
                slot_s,
                trainer_wait_s,
                model: model.map(|m| m[i]),
            })
        })
        .collect()
}

/// A whole simulation: one job, one seed, several policies.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimReport {
    /// Job name.
    pub job: String,
    /// The seed.
    pub seed: u64,
    /// The placement every policy but `sync` ran on (`plan`, `default`, `uniform`, `best-gpu`).
    pub placement: String,
    /// The planner's predicted step time for rollfleet on it, averaged over the job's steps
    /// (warm-up included, as the simulated figure is), seconds, when the planner's model made
    /// the placement. Never below the fixed yardstick (`reference`): see
    /// `predicted_below_yardstick`.
    pub predicted_step_s: Option<f64>,
    /// The planner's own figure when its model put the step below the fixed yardstick, which no
    /// schedule of the job's trajectories beats (`predicted_step_s` is then the yardstick).
    pub predicted_below_yardstick: Option<f64>,
    /// The hardware model's constants.
    pub hardware: HardwareModel,
    /// Attribution of real data the workload sampled, if any.
    pub data_attribution: Option<String>,
    /// The fixed yardstick: one bound per job and seed, on the episodes as first sampled.
    pub reference: Reference,
    /// One report per policy.
    pub policies: Vec<PolicyReport>,
    /// How rollfleet's groups lived, per task, beside the planner's model (empty when rollfleet
    /// did not run).
    pub group_lives: Vec<GroupLives>,
    /// With `--lose`: how rollfleet's throughput after the loss compares with the smaller
    /// cluster run on its own plan.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_recovery: Option<crate::loss::Recovery>,
    /// With `--grow`: the re-plan applied mid-run, and how rollfleet's throughput after it
    /// compares with the bigger cluster's own run.
    pub growth: Option<crate::growth::GrowthReport>,
    /// With `--replan-on-drift`: rollfleet's re-plans on drift, in order.
    #[serde(default)]
    pub drift_replans: Vec<crate::drift::DriftReplan>,
}

fn describe_use(spec: &JobSpec, placement: &Placement, pool: u32) -> String {
    let mut parts = Vec::new();
    for role in [ServeRole::Prefill, ServeRole::Decode, ServeRole::Generate] {
        let replicas: Vec<_> = placement
            .replicas
            .iter()
            .filter(|r| r.pool == pool && r.role == role)
            .collect();
        if let Some(first) = replicas.first() {
            let name = match role {
                ServeRole::Prefill => "prefill",
                ServeRole::Decode => "decode",
                ServeRole::Generate => "generate",
            };
            parts.push(format!("{name} {}x{}", replicas.len(), first.gpus));
        }
    }
    if placement.trainer.pool == pool {
        parts.push(format!("train {}", placement.trainer.gpus));
    }
    match spec.pools.get(pool as usize).and_then(|p| p.kind()) {
        Some(PoolKind::Cpu) => "environments".into(),
        Some(PoolKind::Serverless) => "rewards".into(),
        _ if parts.is_empty() => "idle".into(),
        _ => parts.join(", "),
    }
}

/// The lower bound of what `run` trained. Every policy is allowed the job's staleness bound, or
/// its own when that is looser.
pub fn run_bound(
    spec: &JobSpec,
    catalog: &Catalog,
    hw: &HardwareModel,
    run: &RunResult,
) -> BoundReport {
    let steps = run.publish_times_s.len() as u64;
    let max_staleness = run.max_staleness.max(spec.rl.max_staleness.max(0) as u64);
    lower_bound(spec, catalog, hw, &run.work, steps, max_staleness)
}

/// Builds a policy's report from its run, measured against the job's fixed `reference` too.
pub fn policy_report(
    name: &str,
    spec: &JobSpec,
    catalog: &Catalog,
    hw: &HardwareModel,
    run: &RunResult,
    reference: &Reference,
) -> PolicyReport {
    let steps = run.publish_times_s.len() as u64;
    let total = run.makespan_s.max(1e-9);
    let step_time = total / steps.max(1) as f64;
    let bound = run_bound(spec, catalog, hw, run);
    let mut pools = Vec::new();
    let mut env_busy = 0.0;
    let mut env_cap = 0.0;
    for (i, pool) in spec.pools.iter().enumerate() {
        let i = i as u32;
        let cap = run.capacity.get(&i).copied().unwrap_or(0.0);
        let busy = run.meters.get(&i).map_or(0.0, |m| m.total);
        let kind = match pool.kind() {
            Some(PoolKind::Gpu) => "gpu",
            Some(PoolKind::Cpu) => {
                env_busy += busy;
                env_cap += cap;
                "cpu"
            }
            Some(PoolKind::Serverless) => "serverless",
            None => "unknown",
        };
        let denom = (cap * total).max(1e-9);
        pools.push(PoolReport {
            name: pool.name.clone(),
            kind: kind.into(),
            use_: describe_use(spec, &run.placement, i),
            utilisation: busy / denom,
            weight_sync_share: run.sync_seconds.get(&i).copied().unwrap_or(0.0) / denom,
            decode: PoolDecode::of(run.replica_decode.iter().filter(|r| r.pool == i)),
        });
    }
    let mix = Mix::of(&run.work, spec.tasks.len());
    PolicyReport {
        policy: name.to_owned(),
        max_staleness: run.max_staleness,
        placement: String::new(),
        placement_probes: Vec::new(),
        admission_window: None,
        reference_efficiency: if step_time > 0.0 {
            reference.bound.step_s / step_time
        } else {
            0.0
        },
        bias: Bias::between(&mix, &reference.mix),
        decode_s_per_token: run.decode_s_per_token,
        yardstick_at_its_decode_s: run
            .decode_s_per_token
            .map(|t| reference.at_decode(spec, catalog, hw, t).step_s),
        mix,
        usd_per_step: usd_per_step(spec, catalog, run, step_time),
        steps,
        total_s: total,
        step_time_s: step_time,
        steady_step_time_s: steady_step_time(&run.publish_times_s),
        step_times_s: step_times(&run.publish_times_s),
        trainer: TrainerLoad::of(&run.train_batch_s, total),
        speedup_vs_sync: None,
        trajectories_per_s: run.trajectories as f64 / total,
        trained_tokens_per_s: run.trained_tokens as f64 / total,
        generated_tokens_per_s: run.generated_tokens as f64 / total,
        pools,
        environment_utilisation: if env_cap > 0.0 {
            env_busy / (env_cap * total)
        } else {
            0.0
        },
        staleness_histogram: run.staleness_histogram.clone(),
        efficiency: if step_time > 0.0 {
            bound.step_s / step_time
        } else {
            0.0
        },
        capacity_efficiency: if step_time > 0.0 {
            bound.capacity_s / step_time
        } else {
            0.0
        },
        bound,
        serverless_cold_starts: run.cold_starts,
        core: run.core.clone(),
        invariant_violations: run.violations.clone(),
        scheduler_events: run.scheduler_events,
        sim_events: run.sim_events,
    }
}

/// Each step's duration, from the times each version was published.
pub fn step_times(publish_times_s: &[f64]) -> Vec<f64> {
    let mut start = 0.0;
    publish_times_s
        .iter()
        .map(|&end| {
            let step = end - start;
            start = end;
            step
        })
        .collect()
}

/// The steps of a job of `steps` that lie between the warm-up and the drain, each a tenth of
/// the steps (at least one); none for fewer than five steps.
fn steady_steps(steps: usize) -> Option<std::ops::Range<usize>> {
    (steps >= 5).then(|| {
        let edge = (steps / 10).max(1);
        edge..steps - edge
    })
}

/// Seconds per step between the warm-up and the drain (see
/// [`PolicyReport::steady_step_time_s`]), from the times each version was published.
pub fn steady_step_time(publish_times_s: &[f64]) -> Option<f64> {
    let steady = steady_steps(publish_times_s.len())?;
    // Step `k` ends at `publish_times_s[k]`, and starts at the publication before it.
    let from = publish_times_s[steady.start - 1];
    let to = publish_times_s[steady.end - 1];
    Some((to - from) / steady.len() as f64)
}

/// The indicative cost of one step of `run`: GPU pools it placed work on and every CPU pool,
/// for `step_time` seconds at catalogue prices, plus its serverless rewards' GB-seconds and
/// requests per step.
fn usd_per_step(spec: &JobSpec, catalog: &Catalog, run: &RunResult, step_time: f64) -> f64 {
    let mut per_hour = 0.0;
    for (i, pool) in spec.pools.iter().enumerate() {
        let count = pool.count.unwrap_or(0).max(0) as f64;
        let used = run.placement.replicas.iter().any(|r| r.pool as usize == i)
            || run.placement.trainer.pool as usize == i;
        match pool.kind() {
            Some(PoolKind::Gpu) if used => {
                if let Some(gpu) = pool.gpu.as_deref().and_then(|g| catalog.gpu(g).ok()) {
                    per_hour += count * gpu.price_per_hour_usd;
                }
            }
            Some(PoolKind::Cpu) => {
                if let Some(shape) = pool.cpu.as_deref().and_then(|c| catalog.cpu_shape(c).ok()) {
                    per_hour += count * shape.price_per_hour_usd;
                }
            }
            _ => {}
        }
    }
    // Serverless: each trained trajectory's reward call, billed by its GB-seconds and request.
    let steps = run.publish_times_s.len().max(1) as f64;
    let mut serverless = 0.0;
    for (task, &calls) in spec.tasks.iter().zip(&run.work.trajectories_per_task) {
        let Some(reward) = spec.rewards.iter().find(|r| r.name == task.reward) else {
            continue;
        };
        if reward.runs_on != rollfleet_spec::RewardPlacement::Serverless {
            continue;
        }
        let Some(platform) = reward
            .pool
            .as_deref()
            .and_then(|name| spec.pools.iter().find(|p| p.name == name))
            .and_then(|p| p.serverless.as_deref())
            .and_then(|name| catalog.serverless(name).ok())
        else {
            continue;
        };
        let memory_gb = reward.memory_mb.max(0) as f64 / 1024.0;
        let seconds = crate::workload::mean(&reward.latency_ms) / 1000.0;
        serverless += calls as f64
            * (seconds * memory_gb * platform.price_per_gb_second_usd
                + platform.price_per_million_requests_usd / 1e6);
    }
    per_hour * step_time / 3600.0 + serverless / steps
}

#[cfg(test)]
mod tests {
    use super::{PoolDecode, TrainerLoad, steady_step_time, step_times};
    use crate::sim::ReplicaDecode;

    #[test]
    fn the_trainers_load_is_its_batches_its_busy_share_and_how_long_a_batch_took() {
        let load = TrainerLoad::of(&[1.0, 3.0, 2.0], 12.0).unwrap();
        assert_eq!(load.batches, 3);
        assert!((load.busy_share - 0.5).abs() < 1e-12);
        assert_eq!(
            (load.batch_s_min, load.batch_s_mean, load.batch_s_max),
            (1.0, 2.0, 3.0)
        );
        assert_eq!(TrainerLoad::of(&[], 12.0), None);
    }

    #[test]
    fn a_pools_decode_is_its_replicas_together_beside_its_busiest_and_slowest() {
        let replica = |sequence_s, tokens| ReplicaDecode {
            pool: 0,
            sequence_s,
            decoding_s: 5.0,
            tokens,
        };
        // Two sequences at once for 5 s making 100 tokens, and six at once making 100.
        let d = PoolDecode::of(&[replica(10.0, 100.0), replica(30.0, 100.0)]).unwrap();
        assert_eq!(d.replicas, 2);
        assert!((d.batch - 4.0).abs() < 1e-12);
        assert!((d.busiest_replica_batch - 6.0).abs() < 1e-12);
        assert!((d.s_per_token - 0.2).abs() < 1e-12);
        assert!((d.slowest_replica_s_per_token - 0.3).abs() < 1e-12);
        // A replica that never decoded is not one of the pool's decoding replicas.
        let idle = ReplicaDecode {
            pool: 0,
            sequence_s: 0.0,
            decoding_s: 0.0,
            tokens: 0.0,
        };
        assert_eq!(PoolDecode::of(&[idle]), None);
        assert_eq!(
            PoolDecode::of(&[idle, replica(10.0, 100.0)])
                .unwrap()
                .replicas,
            1
        );
    }

    #[test]
    fn each_step_runs_from_the_publication_before_it_to_its_own() {
        assert_eq!(step_times(&[50.0, 70.0, 80.0]), vec![50.0, 20.0, 10.0]);
        assert!(step_times(&[]).is_empty());
    }

    #[test]
    fn the_steady_state_leaves_out_a_tenth_of_the_steps_at_each_end() {
        // Twenty steps: a slow first one and a slow last one; steps 2..18 take 10 s each.
        let mut times = vec![50.0, 70.0];
        for _ in 2..19 {
            times.push(times[times.len() - 1] + 10.0);
        }
        times.push(times[times.len() - 1] + 40.0);
        assert_eq!(times.len(), 20);
        assert_eq!(steady_step_time(&times), Some(10.0));
        assert_eq!(steady_step_time(&times[..4]), None);
    }
}
