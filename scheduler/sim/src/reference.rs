//! The fixed yardstick: one lower bound per job and seed, the same for every policy.
//!
//! A run's own bound ([`crate::report::lower_bound`]) is computed from what that run trained, and
//! that moves with the policy: restarted groups redraw their lengths and latencies, groups still
//! unfinished at the end are dropped, and with over-provisioning the first groups to finish are
//! the ones trained. A policy that trains a lighter mix lowers its own yardstick. The reference
//! here is computed once, without running anything, from the episodes **as first sampled**: the
//! groups the job's steps need (`steps x rolloutBatchSize` trajectories, in group order), each
//! trajectory's draws at attempt 0 of the simulator's own random streams (its task, number of
//! turns, prompt, observations, action lengths, environment and reward latencies), played
//! through the task's limits as the core plays them (`maxTurns`, `contextLimit`,
//! `maxActionTokens`). Batch `k` is step `k`'s work. The same capacity and staleness-latency
//! terms then give one bound, at the job's `maxStaleness`, that every policy is measured against.
//!
//! Beside it, the reference's mix (tokens and environment time per trajectory, each task's
//! share) is what each policy's training bias is measured from: a step time bought by training
//! a lighter mix shows as bias.

use rollfleet_catalog::Catalog;
use rollfleet_core::rng::SplitMix64;
use rollfleet_spec::{JobSpec, RewardPlacement};
use serde::Serialize;

use crate::bound::LatencyRates;
use crate::hardware::HardwareModel;
use crate::report::{BoundReport, latency_rates, lower_bound};
use crate::sim::{TrajLedger, TurnWork, Work, model_costs};
use crate::workload::{Sampler, stream};

/// The mix of what was trained (or, for the reference, sampled): what training bias compares.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mix {
    /// Trajectories in it.
    pub trajectories: u64,
    /// Tokens trained on per trajectory (its final context).
    pub tokens_per_trajectory: f64,
    /// Environment vCPU-seconds per trajectory (reset and steps).
    pub env_cpu_s_per_trajectory: f64,
    /// Each task's share of the trajectories, in the job's task order.
    pub task_shares: Vec<f64>,
}

impl Mix {
    /// The mix of the work in `work`, for a job of `tasks` tasks.
    pub fn of(work: &Work, tasks: usize) -> Mix {
        let n = work.trajectories.max(1) as f64;
        Mix {
            trajectories: work.trajectories,
            tokens_per_trajectory: work.train_tokens / n,
            env_cpu_s_per_trajectory: work.env_cpu_seconds / n,
            task_shares: (0..tasks)
                .map(|t| work.trajectories_per_task.get(t).copied().unwrap_or(0) as f64 / n)
                .collect(),
        }
    }
}

/// How a policy's trained mix differs from the reference's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bias {
    /// Trained tokens per trajectory over the reference's, minus one (negative: lighter).
    pub tokens: f64,
    /// Environment time per trajectory over the reference's, minus one.
    pub env_time: f64,
    /// The largest difference of a task's share from its reference share, in share points
    /// (0.05 is five points).
    pub task_share: f64,
}

impl Bias {
    /// The bias of `trained` against `reference`.
    pub fn between(trained: &Mix, reference: &Mix) -> Bias {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b - 1.0 } else { 0.0 };
        Bias {
            tokens: ratio(
                trained.tokens_per_trajectory,
                reference.tokens_per_trajectory,
            ),
            env_time: ratio(
                trained.env_cpu_s_per_trajectory,
                reference.env_cpu_s_per_trajectory,
            ),
            task_share: trained
                .task_shares
                .iter()
                .zip(&reference.task_shares)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max),
        }
    }

    /// The largest of the three, in absolute value.
    pub fn worst(&self) -> f64 {
        self.tokens
            .abs()
            .max(self.env_time.abs())
            .max(self.task_share)
    }
}

/// The fixed yardstick of a job and seed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reference {
    /// The seed the episodes were sampled with.
    pub seed: u64,
    /// The bound on the episodes as first sampled, at the job's staleness bound.
    pub bound: BoundReport,
    /// Their mix.
    pub mix: Mix,
    /// The mean seconds a decoded token takes in the bound's chains (a lone sequence on the
    /// largest replica, over the episodes' tokens).
    pub lone_decode_s_per_token: f64,
}

impl Reference {
    /// The same bound with every token of the chains decoded `decode_s_per_token /
    /// lone_decode_s_per_token` times slower (never faster): the yardstick replayed at a run's
    /// own decode speed. It is not a bound on every schedule (one could decode a group's critical
    /// chain alone while batching the rest); it splits a run's distance from the yardstick into
    /// what its decode speed costs the chains and what the rest of its schedule costs.
    pub fn at_decode(
        &self,
        spec: &JobSpec,
        catalog: &Catalog,
        hw: &HardwareModel,
        decode_s_per_token: f64,
    ) -> BoundReport {
        let slowdown = if self.lone_decode_s_per_token > 0.0 {
            (decode_s_per_token / self.lone_decode_s_per_token).max(1.0)
        } else {
            1.0
        };
        let work = sampled_work(spec, catalog, hw, self.seed, slowdown);
        lower_bound(
            spec,
            catalog,
            hw,
            &work,
            spec.rl.steps.max(1) as u64,
            self.bound.max_staleness,
        )
    }
}

/// Visits the episodes a job's steps need, as first sampled with `seed`, in trajectory order
/// (one at a time: a big job's episodes are never all held at once).
pub(crate) fn first_sampled(spec: &JobSpec, seed: u64, mut visit: impl FnMut(u64, &TrajLedger)) {
    let group_size = spec.rl.group_size.max(1) as u64;
    let trajectories = (spec.rl.steps.max(0) as u64)
        .saturating_mul(spec.rl.rollout_batch_size.max(0) as u64)
        // The simulator's own cap on a job's size keeps this finite; so does this.
        .min(10_000_000);
    let shares: Vec<f64> = spec.tasks.iter().map(|t| t.share.max(0.0)).collect();
    let rng = |keys: &[u64]| SplitMix64::keyed(seed, keys);
    for t in 0..trajectories {
        let group = t / group_size;
        // The core's draw of a group's task (`Core::start_group`).
        let task = SplitMix64::keyed(seed, &[1, group]).weighted(&shares);
        let Some(spec_task) = spec.tasks.get(task) else {
            continue;
        };
        let context_limit = spec_task.context_limit.max(1) as u64;
        let max_turns = u32::try_from(spec_task.max_turns.max(1)).unwrap_or(u32::MAX) as u64;
        let max_action = rollfleet_core::config::max_action_tokens(spec_task);
        let millicpus = (spec_task.env_cpus.max(0.001) * 1000.0).round();
        let env_step = Sampler::new(&spec_task.env_step_ms);
        let env_ms = |turn: u64, reset: bool| {
            env_step.sample(&mut rng(&[stream::ENV_LATENCY, t, turn, 0, reset as u64]))
        };
        let wanted = spec_task.turns.as_ref().map_or(max_turns as f64, |d| {
            Sampler::new(d)
                .sample(&mut rng(&[stream::TURNS, t]))
                .round()
        });
        let wanted = wanted.clamp(1.0, max_turns as f64) as u64;
        let prompt = Sampler::new(&spec_task.prompt_tokens)
            .sample(&mut rng(&[stream::PROMPT, group]))
            .round()
            .max(1.0) as u64;
        let observation = Sampler::new(&spec_task.observation_tokens);
        let action = Sampler::new(&spec_task.action_tokens);
        let mut ledger = TrajLedger::default();
        ledger.group = group;
        ledger.task = task as u32;
        ledger.reset_cpu_s = env_ms(0, true) / 1000.0 * millicpus / 1000.0;
        let mut context = 0u64;
        let mut input = prompt.min(context_limit).max(1);
        for turn in 0u64.. {
            // The core's room for the answer, and the simulator's draw of its length.
            let room = max_action
                .min(context_limit.saturating_sub(context + input))
                .max(1);
            let tokens = action
                .sample(&mut rng(&[stream::ACTION, t, turn, 0]))
                .round()
                .clamp(1.0, room as f64) as u64;
            let ms = env_ms(turn + 1, false);
            ledger.turns.push(TurnWork {
                version: 0,
                context_before: context,
                input,
                action: tokens,
                env_cpu_s: ms / 1000.0 * millicpus / 1000.0,
                env_s: ms / 1000.0,
            });
            context += input + tokens;
            let next = observation
                .sample(&mut rng(&[stream::OBSERVATION, t, turn + 1]))
                .round()
                .max(0.0) as u64;
            let next = next.min(context_limit);
            let turns = turn + 1;
            if turns >= wanted || turns >= max_turns || context + next >= context_limit {
                break;
            }
            input = next;
        }
        let reward = spec.rewards.iter().find(|r| r.name == spec_task.reward);
        ledger.reward_s = match reward {
            Some(r) if r.runs_on != RewardPlacement::Environment => {
                Sampler::new(&r.latency_ms).sample(&mut rng(&[stream::REWARD, t, 0])) / 1000.0
            }
            _ => 0.0,
        };
        visit(t, &ledger);
    }
}

/// The fixed yardstick of `spec` with `seed`: the bound and mix of the episodes as first sampled.
pub fn reference(spec: &JobSpec, catalog: &Catalog, hw: &HardwareModel, seed: u64) -> Reference {
    let work = sampled_work(spec, catalog, hw, seed, 1.0);
    let steps = spec.rl.steps.max(1) as u64;
    let max_staleness = spec.rl.max_staleness.max(0) as u64;
    Reference {
        seed,
        bound: lower_bound(spec, catalog, hw, &work, steps, max_staleness),
        mix: Mix::of(&work, spec.tasks.len()),
        lone_decode_s_per_token: if work.decode_tokens > 0.0 {
            work.chain_decode_s / work.decode_tokens
        } else {
            0.0
        },
    }
}

/// The work of the episodes as first sampled, their chains decoding `decode_slowdown` times
/// slower than a lone sequence.
fn sampled_work(
    spec: &JobSpec,
    catalog: &Catalog,
    hw: &HardwareModel,
    seed: u64,
    decode_slowdown: f64,
) -> Work {
    let costs = model_costs(spec);
    let rates = LatencyRates {
        decode_slowdown,
        ..latency_rates(spec, catalog, hw)
    };
    let per_step = spec.rl.rollout_batch_size.max(1) as u64;
    let mut work = Work::default();
    let mut traces = Vec::new();
    first_sampled(spec, seed, |t, episode| {
        let step = (t / per_step) as usize;
        work.add_trajectory(spec, &costs, &rates, step, episode, &mut traces);
    });
    work
}
