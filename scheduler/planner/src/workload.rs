//! The workload as the planner sees it: per task, the mean tokens and latencies of a trajectory,
//! and how long the slowest member of a group takes.
//!
//! The planner is pure and owns no traces, so the caller supplies the mean of each distribution
//! (the simulator's `workload::mean` reads trace means from the bundled trace); everything else
//! is closed-form from the spec.

use rollfleet_spec::{Distribution, JobSpec, RewardPlacement, lognormal_sigma};
use serde::Serialize;

use crate::profile::{ProfileStore, Timed};

/// One task's averages.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TaskLoad {
    /// Task name.
    pub name: String,
    /// Share of trajectories (normalised to sum to 1).
    pub share: f64,
    /// Mean turns per trajectory.
    pub turns: f64,
    /// Mean turns of the longest of a group's `groupSize` trajectories (a group is trained on
    /// only when its slowest member is done).
    pub group_turns: f64,
    /// Variance of the turns per trajectory.
    pub turns_var: f64,
    /// The most turns a trajectory may take (`maxTurns`).
    pub max_turns: f64,
    /// Variance of one environment step, seconds squared.
    pub env_step_var: f64,
    /// Variance of the action tokens of one turn.
    pub action_var: f64,
    /// Third cumulant (central moment) of one environment step, seconds cubed: how far its
    /// right tail reaches ([`third_cumulant`]).
    pub env_step_k3: f64,
    /// Third cumulant of the action tokens of one turn.
    pub action_k3: f64,
    /// Mean prompt tokens.
    pub prompt: f64,
    /// Mean action tokens per turn.
    pub action: f64,
    /// Mean observation tokens per turn.
    pub observation: f64,
    /// Mean context (tokens already in the KV cache) while a token is decoded.
    pub decode_context: f64,
    /// The most tokens a trajectory's context may hold (`contextLimit`).
    pub context_limit: f64,
    /// Mean environment step, seconds.
    pub env_step_s: f64,
    /// vCPUs per environment instance.
    pub env_cpus: f64,
    /// Mean reward latency, seconds.
    pub reward_s: f64,
    /// Index (in the spec's pools) of the serverless pool that runs its reward, if any.
    pub serverless_pool: Option<usize>,
    /// Whether its reward runs on the CPU pool.
    pub local_reward: bool,
}

/// The whole job's workload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Workload {
    /// Tasks, in spec order.
    pub tasks: Vec<TaskLoad>,
    /// Trajectories per RL step.
    pub batch: f64,
    /// Trajectories per group.
    pub group_size: f64,
    /// Trajectories per optimizer batch.
    pub train_batch: f64,
    /// Staleness bound, versions.
    pub max_staleness: f64,
    /// Over-provisioning fraction.
    pub over_provisioning: f64,
    /// Share of peak FLOP/s training achieves.
    pub train_mfu: f64,
    /// RL steps the job runs.
    pub steps: f64,
    /// Mean of the largest of `groupSize` standard normal draws (Blom's approximation): how many
    /// standard deviations the slowest member of a group lags the mean.
    pub group_max_z: f64,
    /// Standard deviation of the largest of `groupSize` standard normal draws: how much the
    /// slowest member's lag varies from one group (or one attempt) to the next.
    pub group_max_sd: f64,
    /// Quarters of a rollout batch the core's admission window is widened by, or narrowed by
    /// when negative (`Policy::window_widening_quarters`): none unless a simulation of the job
    /// chose it.
    pub window_widening_quarters: i32,
}

impl Workload {
    /// Takes the measured mean of each task's environment step and of each reward function's
    /// latency in place of the job spec's distribution, where `profiles` has enough samples of
    /// it. (Their variances and skews stay the spec's: a window of a few hundred samples of a
    /// heavy tail says little about it.)
    pub fn measured(&mut self, spec: &JobSpec, profiles: &ProfileStore) {
        for (t, task) in self.tasks.iter_mut().zip(&spec.tasks) {
            if let Some(s) = profiles.timed_mean(Timed::EnvironmentStep, &task.name) {
                t.env_step_s = s;
            }
            if let Some(s) = profiles.timed_mean(Timed::Reward, &task.reward) {
                t.reward_s = s;
            }
        }
    }

    /// The workload of a job; `mean` gives the mean of any distribution (including traces).
    pub fn from_spec(spec: &JobSpec, mean: &dyn Fn(&Distribution) -> f64) -> Workload {
        let total: f64 = spec
            .tasks
            .iter()
            .map(|t| t.share.max(0.0))
            .sum::<f64>()
            .max(1e-12);
        let group = spec.rl.group_size.max(1) as f64;
        let tasks = spec
            .tasks
            .iter()
            .map(|task| {
                let max_turns = task.max_turns.max(1) as f64;
                let (turns, group_turns, turns_var) = match task.turns.as_deref() {
                    None => (max_turns, max_turns, 0.0),
                    Some(d) => (
                        mean(d).clamp(1.0, max_turns),
                        expected_max(d, group, mean).clamp(1.0, max_turns),
                        variance(d, mean),
                    ),
                };
                let prompt = mean(&task.prompt_tokens).max(0.0);
                let action = mean(&task.action_tokens).max(1.0);
                let observation = mean(&task.observation_tokens).max(0.0);
                // Decode of turn j starts after the prompt and j - 1 earlier turns; averaged over
                // the turns and over the action's own tokens.
                let limit = task.context_limit.max(1) as f64;
                let decode_context =
                    (prompt + (turns - 1.0) * (action + observation) / 2.0 + action / 2.0)
                        .min(limit);
                let reward = spec.rewards.iter().find(|r| r.name == task.reward);
                let reward_s = reward.map_or(0.0, |r| mean(&r.latency_ms) / 1000.0);
                let serverless_pool = reward
                    .filter(|r| r.runs_on == RewardPlacement::Serverless)
                    .and_then(|r| r.pool.as_deref())
                    .and_then(|name| spec.pools.iter().position(|p| p.name == name));
                TaskLoad {
                    name: task.name.clone(),
                    share: task.share.max(0.0) / total,
                    turns,
                    group_turns,
                    turns_var,
                    max_turns,
                    env_step_var: variance(&task.env_step_ms, mean) / 1e6,
                    action_var: variance(&task.action_tokens, mean),
                    env_step_k3: third_cumulant(&task.env_step_ms) / 1e9,
                    action_k3: third_cumulant(&task.action_tokens),
                    prompt,
                    action,
                    observation,
                    decode_context,
                    context_limit: limit,
                    env_step_s: mean(&task.env_step_ms).max(0.0) / 1000.0,
                    env_cpus: task.env_cpus.max(0.001),
                    reward_s,
                    serverless_pool,
                    local_reward: reward.is_some_and(|r| r.runs_on == RewardPlacement::Local),
                }
            })
            .collect();
        Workload {
            tasks,
            batch: spec.rl.rollout_batch_size.max(1) as f64,
            group_size: group,
            train_batch: spec.rl.train_batch_size.max(1) as f64,
            max_staleness: spec.rl.max_staleness.max(0) as f64,
            over_provisioning: spec.rl.over_provisioning.max(0.0),
            train_mfu: spec.rl.train_mfu.clamp(0.01, 1.0),
            steps: spec.rl.steps.max(1) as f64,
            group_max_z: if group > 1.0 {
                normal_quantile((group - 0.375) / (group + 0.25))
            } else {
                0.0
            },
            group_max_sd: max_of_normals_sd(group),
            window_widening_quarters: 0,
        }
    }

    /// Trajectories the core lets be started and not yet consumed: the core's admission rule
    /// (`Core::admit_groups`: `max(min(S x B / 2, 2 B), 3 B / 4, trainBatch, groupSize)`, widened
    /// by its quarters of a batch, plus the over-provisioning), rounded down to whole groups as
    /// the core admits them.
    pub fn window(&self) -> f64 {
        let (core, extra) = self.admission_terms();
        let n = self.group_size.max(1.0);
        (((core + extra) / n).floor() * n).max(n)
    }

    /// The core's admission window and the over-provisioning it admits beyond it, in
    /// trajectories, by the core's own rule (`Core::admission_window`, rollfleet's policy): the
    /// over-provisioning stops at the cap (`maxStaleness` batches, at least one, unless the
    /// window is widened).
    pub fn admission_terms(&self) -> (f64, f64) {
        let terms = self.core_terms();
        (terms.window as f64, terms.extra as f64)
    }

    fn core_terms(&self) -> rollfleet_core::AdmissionTerms {
        rollfleet_core::Core::admission_window(
            self.batch as u64,
            self.train_batch as u64,
            self.group_size as u64,
            self.max_staleness as u64,
            self.over_provisioning,
            true,
            self.window_widening_quarters,
        )
    }

    /// Trajectories finished and waiting for a training batch that the core does not count in
    /// its window (`Policy::window_excludes_waiting_batch`): up to one training batch of them,
    /// within the core's cap on trajectories started and not yet trained. A finished group
    /// waits half the time a training batch takes to fill, so half a training batch of
    /// trajectories waits on average (Little's law), and the room under the cap bounds how many
    /// of those the window leaves out.
    pub fn waiting_outside_window(&self) -> f64 {
        let terms = self.core_terms();
        let room = (terms.cap as f64 - terms.window as f64 - terms.extra as f64).max(0.0);
        room.min(self.train_batch / 2.0)
    }

    /// [`rollfleet_core::Core::last_starts`]: trajectories started and not yet trained once the
    /// job's last ones start.
    pub fn last_starts(&self) -> f64 {
        rollfleet_core::Core::last_starts(self.core_terms()) as f64
    }

    /// Mean tokens trained on per trajectory.
    pub fn train_tokens(&self) -> f64 {
        self.tasks
            .iter()
            .map(|t| t.share * (t.prompt + t.turns * t.action + (t.turns - 1.0) * t.observation))
            .sum()
    }
}

/// The mean of the largest of `n` draws. Closed form for fixed and uniform distributions; for a
/// log-normal, its quantile at `(n - 0.375) / (n + 0.25)` (Blom's plotting position); a trace
/// or a CSV column falls back to its mean.
pub fn expected_max(dist: &Distribution, n: f64, mean: &dyn Fn(&Distribution) -> f64) -> f64 {
    let n = n.max(1.0);
    match *dist {
        Distribution::Fixed { value } => value,
        Distribution::Uniform { min, max } => min + (max - min) * n / (n + 1.0),
        Distribution::LogNormal { median, p99, max } => {
            let sigma = lognormal_sigma(median, p99);
            let p = (n - 0.375) / (n + 0.25);
            let v = median * (sigma * normal_quantile(p)).exp();
            max.map_or(v, |m| v.min(m))
        }
        Distribution::Trace { .. } | Distribution::Csv { .. } => mean(dist),
    }
}

/// The variance of a distribution. Closed form for fixed, uniform and log-normal (of the
/// clipped values the sampler draws, [`Distribution::variance`]); a trace is taken to have a
/// coefficient of variation of 1 (its variance is its mean squared), about what token-count
/// traces show.
pub fn variance(dist: &Distribution, mean: &dyn Fn(&Distribution) -> f64) -> f64 {
    match dist.variance() {
        Some(v) => v,
        None => mean(dist).powi(2),
    }
}

/// The third cumulant of a distribution ([`Distribution::third_cumulant`]); none for a trace,
/// whose variance the planner does not know either.
pub fn third_cumulant(dist: &Distribution) -> f64 {
    dist.third_cumulant().unwrap_or(0.0)
}

/// The standard deviation of the largest of `n` standard normal draws, by integrating its density
/// `n phi(x) Phi(x)^(n-1)` on a fixed grid (the planner is deterministic: no sampling).
pub fn max_of_normals_sd(n: f64) -> f64 {
    if n <= 1.0 {
        return 1.0;
    }
    let (lo, hi, steps) = (-8.0_f64, 8.0_f64, 1600);
    let h = (hi - lo) / steps as f64;
    let (mut m0, mut m1, mut m2) = (0.0, 0.0, 0.0);
    for i in 0..steps {
        let x = lo + (i as f64 + 0.5) * h;
        let density = n * normal_pdf(x) * normal_cdf(x).powf(n - 1.0);
        m0 += density * h;
        m1 += density * x * h;
        m2 += density * x * x * h;
    }
    let mean = m1 / m0;
    (m2 / m0 - mean * mean).max(0.0).sqrt()
}

/// The standard normal density.
pub fn normal_pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// The standard normal distribution function: the job spec's, which its clipped means use too.
pub use rollfleet_spec::normal_cdf;

/// The standard normal quantile (Acklam's rational approximation, relative error < 1.2e-9).
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let low = 0.02425;
    if p < low {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - low {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        let q = (-2.0 * (1.0 - p).ln()).sqrt();
        -(((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_trace(d: &Distribution) -> f64 {
        d.mean().unwrap_or(0.0)
    }

    #[test]
    fn the_longest_of_eight_uniform_draws_is_eight_ninths_of_the_way_up() {
        // Uniform(8, 30), n = 8: 8 + 22 x 8/9 = 27.56.
        let d = Distribution::Uniform {
            min: 8.0,
            max: 30.0,
        };
        let m = expected_max(&d, 8.0, &no_trace);
        assert!((m - (8.0 + 22.0 * 8.0 / 9.0)).abs() < 1e-12, "{m}");
    }

    #[test]
    fn variances_match_their_closed_forms() {
        let u = Distribution::Uniform {
            min: 8.0,
            max: 30.0,
        };
        assert!((variance(&u, &no_trace) - 484.0 / 12.0).abs() < 1e-12);
        // Log-normal with median 1 and sigma 1 (p99 = e^2.326): mean e^0.5, variance e (e - 1).
        let l = Distribution::LogNormal {
            median: 1.0,
            p99: 2.326_347_874_040_841_f64.exp(),
            max: None,
        };
        let e = std::f64::consts::E;
        assert!((variance(&l, &no_trace) - e * (e - 1.0)).abs() < 1e-9);
        assert_eq!(
            variance(&Distribution::Fixed { value: 3.0 }, &no_trace),
            0.0
        );
    }

    #[test]
    fn the_normal_distribution_function_matches_known_values() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.959_963_985) - 0.975).abs() < 1e-7);
        assert!((normal_cdf(-2.326_347_874) - 0.01).abs() < 1e-7);
    }

    #[test]
    fn the_spread_of_the_largest_of_n_normals_matches_tables() {
        // One draw is the standard normal itself; the largest of two has variance 1 - 1/pi
        // (its mean is 1/sqrt(pi)); tables of normal order statistics give the largest of eight
        // a variance of 0.3729.
        assert_eq!(max_of_normals_sd(1.0), 1.0);
        let two = (1.0 - 1.0 / std::f64::consts::PI).sqrt();
        assert!(
            (max_of_normals_sd(2.0) - two).abs() < 1e-4,
            "{}",
            max_of_normals_sd(2.0)
        );
        let eight = max_of_normals_sd(8.0);
        assert!((eight * eight - 0.3729).abs() < 5e-4, "{eight}");
    }

    /// No tasks: what the core's admission rule alone makes of a batch of 1024 in groups of 8,
    /// training batches of 256, staleness bound 2 and a quarter batch of over-provisioning.
    fn admission_workload() -> Workload {
        Workload {
            tasks: Vec::new(),
            batch: 1024.0,
            group_size: 8.0,
            train_batch: 256.0,
            max_staleness: 2.0,
            over_provisioning: 0.25,
            train_mfu: 0.4,
            steps: 20.0,
            group_max_z: 0.0,
            group_max_sd: 1.0,
            window_widening_quarters: 0,
        }
    }

    #[test]
    fn the_window_follows_the_cores_admission_rule() {
        let mut w = admission_workload();
        // max(2 x 1024 / 2, 768, 256, 8) + 256.
        assert_eq!(w.window(), 1280.0);
        // A loose bound keeps two batches, not `S / 2` of them.
        w.max_staleness = 8.0;
        assert_eq!(w.window(), 2048.0 + 256.0);
        // A staleness bound of 1 keeps three quarters of a batch, not a whole one.
        w.max_staleness = 1.0;
        assert_eq!(w.window(), 768.0 + 256.0);
        // Over-provisioning past `maxStaleness` batches in all is cut there.
        w.max_staleness = 2.0;
        w.over_provisioning = 4.0;
        assert_eq!(w.window(), 2048.0);
        w.max_staleness = 1.0;
        w.over_provisioning = 0.25;
        // Never less than a training batch.
        w.train_batch = 1024.0;
        w.over_provisioning = 0.0;
        assert_eq!(w.window(), 1024.0);
    }

    #[test]
    fn half_a_training_batch_waits_outside_the_window_where_the_cap_leaves_room() {
        let mut w = admission_workload();
        // The cap of 2048 leaves 768 over the window of 1280: half of 256 fits.
        assert_eq!(w.waiting_outside_window(), 128.0);
        // At staleness 1 the window (768) and its margin (256) fill the cap.
        w.max_staleness = 1.0;
        assert_eq!(w.waiting_outside_window(), 0.0);
        // Without a margin, 256 of room are left, more than half a training batch.
        w.over_provisioning = 0.0;
        assert_eq!(w.waiting_outside_window(), 128.0);
        // With a margin of a tenth of a batch (103 trajectories), 153 are left, and a larger
        // training batch's half no longer fits.
        w.over_provisioning = 0.1;
        w.train_batch = 512.0;
        assert_eq!(w.waiting_outside_window(), 1024.0 - 768.0 - 103.0);
    }

    #[test]
    fn a_widened_window_admits_its_quarters_of_a_batch_and_its_cap_keeps_room_for_the_margin_and_a_training_batch()
     {
        let mut w = admission_workload();
        w.max_staleness = 1.0;
        // The rule's 768, its margin of 256 and no room under the cap of one batch.
        assert_eq!(w.admission_terms(), (768.0, 256.0));
        assert_eq!(w.last_starts(), 1024.0);
        w.window_widening_quarters = 1;
        // 768 + 1024 / 4; the cap is 1024 + 256 + 256 = 1536, so the margin keeps its 256.
        assert_eq!(w.admission_terms(), (1024.0, 256.0));
        assert_eq!(w.window(), 1280.0);
        // The 256 left under the cap hold half a training batch waiting.
        assert_eq!(w.waiting_outside_window(), 128.0);
        // The job's last starts stop at the cap, not one batch past the window and margin.
        assert_eq!(w.last_starts(), 1536.0);
        // At a loose bound the cap of `maxStaleness` batches still holds the widened window.
        w.max_staleness = 4.0;
        w.window_widening_quarters = 2;
        assert_eq!(w.admission_terms(), (2048.0 + 512.0, 256.0));
        assert_eq!(w.last_starts(), 2048.0 + 512.0 + 256.0 + 1024.0);
    }

    #[test]
    fn the_normal_quantile_matches_known_values() {
        assert!(normal_quantile(0.5).abs() < 1e-9);
        assert!((normal_quantile(0.99) - 2.326_347_874).abs() < 1e-8);
        assert!((normal_quantile(0.025) + 1.959_963_985).abs() < 1e-8);
    }
}
