//! The books of useful work: what each trajectory generated, turn by turn, and the work of
//! the trained ones, the input of the lower bound.

use super::*;

/// Useful work of trained trajectories, the input of the lower bound.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Work {
    /// Prefill FLOPs (prompt and observations, with perfect KV reuse).
    pub prefill_flops: f64,
    /// Decode FLOPs.
    pub decode_flops: f64,
    /// Decode KV-cache bytes read.
    pub decode_kv_bytes: f64,
    /// Tokens decoded.
    pub decode_tokens: f64,
    /// Seconds the trajectories' chains spend decoding at the latency term's rates (a lone
    /// sequence on the largest replica, see [`crate::bound::LatencyRates::decode_token_s`]).
    pub chain_decode_s: f64,
    /// Training FLOPs.
    pub train_flops: f64,
    /// Tokens trained on.
    pub train_tokens: f64,
    /// Environment vCPU-seconds.
    pub env_cpu_seconds: f64,
    /// Local reward vCPU-seconds.
    pub local_reward_cpu_seconds: f64,
    /// Serverless seconds, per spec pool index.
    pub serverless_seconds: BTreeMap<u32, f64>,
    /// Per RL step, what the latency term of the bound needs (see [`crate::bound`]).
    pub steps: Vec<StepChain>,
    /// Trajectories trained on.
    pub trajectories: u64,
    /// Trajectories trained on, per task (the job's order).
    pub trajectories_per_task: Vec<u64>,
}

impl Work {
    /// Adds one trained trajectory, trained at step `step`: its prefill, decode and training
    /// work, its environment and reward time, and its chain for the latency term.
    pub(crate) fn add_trajectory(
        &mut self,
        spec: &JobSpec,
        costs: &ModelCosts,
        rates: &LatencyRates,
        step: usize,
        l: &TrajLedger,
        traces: &mut Vec<TurnTrace>,
    ) {
        self.trajectories += 1;
        let task = l.task as usize;
        if self.trajectories_per_task.len() <= task {
            self.trajectories_per_task.resize(task + 1, 0);
        }
        self.trajectories_per_task[task] += 1;
        self.env_cpu_seconds += l.reset_cpu_s;
        let mut context = 0.0;
        for turn in &l.turns {
            let before = turn.context_before as f64;
            let input = turn.input as f64;
            let action = turn.action as f64;
            self.prefill_flops += costs.flops_per_token * input
                + rollfleet_spec::causal_attention_flops(
                    costs.attention_flops_per_context,
                    before,
                    input,
                );
            let ctx = before + input;
            self.decode_flops += costs.flops_per_token * action
                + costs.attention_flops_per_context * action * (ctx + action / 2.0);
            self.decode_kv_bytes += costs.kv_bytes_per_token * action * (ctx + action / 2.0);
            self.decode_tokens += action;
            self.env_cpu_seconds += turn.env_cpu_s;
            context = ctx + action;
        }
        self.train_tokens += context;
        let train_flops = 3.0 * costs.flops_per_token * context
            + rollfleet_spec::train_attention_flops(costs.attention_flops_per_context, context);
        self.train_flops += train_flops;
        traces.clear();
        traces.extend(l.turns.iter().map(|turn| TurnTrace {
            context_before: turn.context_before,
            input: turn.input,
            action: turn.action,
            env_s: turn.env_s,
        }));
        if self.steps.len() <= step {
            self.steps.resize(step + 1, StepChain::default());
        }
        let train_s = train_flops / rates.train_flops.max(1.0);
        let chain = &mut self.steps[step];
        chain.train_s += train_s;
        // A trajectory with no turns has no version to wait for (and is a violation anyway).
        self.chain_decode_s += traces
            .iter()
            .map(|t| t.action as f64 * rates.decode_token_s((t.context_before + t.input) as f64))
            .sum::<f64>();
        if !l.turns.is_empty() {
            let latency = trajectory_latency(rates, traces, l.reward_s);
            chain.longest_s = chain.longest_s.max(latency + train_s);
        }
        if let Some(task) = spec.tasks.get(task)
            && let Some(reward) = spec.rewards.iter().find(|r| r.name == task.reward)
        {
            match reward.runs_on {
                rollfleet_spec::RewardPlacement::Serverless => {
                    let pool = reward
                        .pool
                        .as_deref()
                        .and_then(|n| spec.pools.iter().position(|p| p.name == n))
                        .unwrap_or(0) as u32;
                    *self.serverless_seconds.entry(pool).or_default() += l.reward_s;
                }
                rollfleet_spec::RewardPlacement::Local => {
                    self.local_reward_cpu_seconds += l.reward_s
                }
                rollfleet_spec::RewardPlacement::Environment => {}
            }
        }
    }
}

/// One generated turn of a trajectory, as the books of useful work keep it.
#[derive(Debug, Clone, Default)]
pub(crate) struct TurnWork {
    pub(crate) version: u64,
    pub(crate) context_before: u64,
    pub(crate) input: u64,
    pub(crate) action: u64,
    pub(crate) env_cpu_s: f64,
    pub(crate) env_s: f64,
}

/// What the simulator knows of one trajectory: its group, task, turns and times.
#[derive(Debug, Clone, Default)]
pub(crate) struct TrajLedger {
    pub(crate) group: u64,
    pub(crate) task: u32,
    pub(crate) reset_cpu_s: f64,
    pub(crate) turns: Vec<TurnWork>,
    pub(crate) reward_s: f64,
    pub(super) inputs: Vec<u64>,
    pub(super) consumed: bool,
    /// Turns the episode lasts (drawn on its first environment stage, the reset).
    pub(super) turns_wanted: Option<u32>,
    /// The context after the last of `turns` (0 with none), kept here so that generating the
    /// next turn does not read the turns back (a cache miss per turn).
    pub(super) context_end: u64,
    /// The last of `inputs` (0 with none), for the same reason.
    pub(super) last_input: u64,
    /// The part of a turn generated before an interrupt: its turn and attempt (a rewind
    /// discards it), its oldest version and its tokens.
    pub(super) partial: Option<PartialWork>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct PartialWork {
    pub(super) turn: u32,
    pub(super) attempt: u32,
    pub(super) version: u64,
    pub(super) tokens: u64,
}

impl TrajLedger {
    /// The tokens of turn `turn` generated before an interrupt in attempt `attempt`.
    pub(super) fn partial_tokens(&self, turn: u32, attempt: u32) -> u64 {
        self.partial
            .filter(|p| p.turn == turn && p.attempt == attempt)
            .map_or(0, |p| p.tokens)
    }
}

impl TrajLedger {
    /// Drops the turns from `k` on (they belong to an attempt that was thrown away).
    pub(super) fn truncate_turns(&mut self, k: usize) {
        if self.turns.len() > k {
            self.turns.truncate(k);
            self.context_end = self
                .turns
                .last()
                .map_or(0, |w| w.context_before + w.input + w.action);
        }
    }

    pub(super) fn push_turn(&mut self, turn: TurnWork) {
        self.context_end = turn.context_before + turn.input + turn.action;
        self.turns.push(turn);
    }

    /// Keeps the inputs before turn `k` and appends turn `k`'s.
    pub(super) fn set_input(&mut self, k: usize, tokens: u64) {
        self.inputs.truncate(k);
        self.inputs.push(tokens);
        self.last_input = tokens;
    }

    /// The input of turn `k` (0 if none was recorded).
    pub(super) fn input(&self, k: usize) -> u64 {
        if self.inputs.len() == k + 1 {
            self.last_input
        } else {
            self.inputs.get(k).copied().unwrap_or(0)
        }
    }
}
