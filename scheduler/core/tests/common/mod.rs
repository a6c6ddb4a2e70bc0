//! The scheduler core's test fixtures, shared by its test files: a small job's configuration,
//! a started core, and helpers that feed it stage outcomes and read the commands it answers with.

#![allow(dead_code)] // each test file includes this module and uses part of it

use rollfleet_core::config::{CpuPoolConfig, ServerlessPoolConfig};
use rollfleet_core::{
    BatchId, Command, Config, Core, Discipline, Input, Policy, ReplicaConfig, ReplicaId,
    RewardRoute, ServeRole, Span, StageCommand, StageId, StageOutcome, StageWork, SyncMode,
    TaskLimits, Time, TrainerConfig, TrajId, Version,
};

pub fn policy(discipline: Discipline, max_staleness: u64, over: f64, sync: SyncMode) -> Policy {
    Policy {
        discipline,
        max_staleness,
        over_provisioning: over,
        weight_sync: sync,
        max_concurrent_updates: 1,
        sticky_sessions: true,
        expiry_aware_publish: false,
        interrupt_generation: false,
        restart_late_groups: true,
        cap_over_provisioning: true,
        sample_within_job_budget: true,
        window_excludes_waiting_batch: true,
        spread_cold_turns: true,
        restart_expired_groups: false,
        window_widening_quarters: 0,
        cheapest_training_first: false,
        start_leaves_kv_room: false,
        updates_keep_half_decoding: false,
    }
}

pub fn replica(role: ServeRole, kv: u64) -> ReplicaConfig {
    ReplicaConfig {
        pool: 0,
        role,
        gpus: 1,
        kv_capacity_tokens: kv,
        max_seqs: 4,
    }
}

pub fn config(
    replicas: Vec<ReplicaConfig>,
    policy: Policy,
    group: u32,
    batch: u32,
    steps: u64,
) -> Config {
    Config {
        seed: 1,
        policy,
        group_size: group,
        rollout_batch_size: batch,
        train_batch_size: group,
        steps,
        tasks: vec![TaskLimits {
            share: 1.0,
            max_turns: 4,
            context_limit: 10_000,
            max_action_tokens: 100,
            env_millicpus: 1000,
            reward: RewardRoute::Serverless(0),
        }],
        replicas,
        trainer: TrainerConfig {
            pool: 1,
            gpus: 8,
            nodes: 1,
        },
        colocated: false,
        cpu_pools: vec![CpuPoolConfig {
            pool: 2,
            millicpus: 4000,
            environments: true,
        }],
        serverless_pools: vec![ServerlessPoolConfig {
            pool: 3,
            concurrency: 2,
        }],
        weight_bytes: 1_000_000,
        pd_min_prefill_tokens: 1_000,
        stage_timeout: Span::from_secs_f64(3600.0),
        stage_failure_limit: rollfleet_core::config::DEFAULT_STAGE_FAILURE_LIMIT,
    }
}

/// A core on `cfg`, started: it and the stages it ran first (the first trajectories' resets).
pub fn started(cfg: Config) -> (Core, Vec<StageCommand>) {
    let mut core = Core::new(cfg);
    core.handle_timeout(Time::ZERO);
    let resets = runs(&drain(&mut core));
    (core, resets)
}

pub fn drain(core: &mut Core) -> Vec<Command> {
    std::iter::from_fn(|| core.poll_command()).collect()
}

pub fn runs(commands: &[Command]) -> Vec<StageCommand> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Run(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

pub fn finish(core: &mut Core, stage: StageId, outcome: StageOutcome) -> Vec<Command> {
    finish_when(core, Time(1), stage, outcome)
}

/// Feeds a stage's outcome at `now`; the commands it caused.
pub fn finish_when(
    core: &mut Core,
    now: Time,
    stage: StageId,
    outcome: StageOutcome,
) -> Vec<Command> {
    core.handle_input(now, Input::StageFinished { stage, outcome });
    drain(core)
}

/// The batch of the training command among `out`.
pub fn trained_batch(out: &[Command]) -> BatchId {
    match out.iter().find(|c| matches!(c, Command::Train { .. })) {
        Some(Command::Train { batch, .. }) => *batch,
        _ => panic!("no training command in {out:?}"),
    }
}

/// The replica and version of the weight update among `out`.
pub fn weight_update(out: &[Command]) -> (ReplicaId, Version) {
    match out
        .iter()
        .find(|c| matches!(c, Command::UpdateWeights { .. }))
    {
        Some(Command::UpdateWeights {
            replica, version, ..
        }) => (*replica, *version),
        _ => panic!("no weight update in {out:?}"),
    }
}

pub fn observed(tokens: u64, done: bool) -> StageOutcome {
    StageOutcome::Observed { tokens, done }
}

/// Drives one trajectory of a group-of-one job through a single-turn episode.
pub fn complete_one(core: &mut Core, reset: &StageCommand) -> Vec<Command> {
    let generate = runs(&finish(core, reset.stage, observed(100, false)));
    let step = runs(&finish(
        core,
        generate[0].stage,
        StageOutcome::Generated { tokens: 10 },
    ));
    let reward = runs(&finish(core, step[0].stage, observed(5, true)));
    finish(core, reward[0].stage, StageOutcome::Rewarded { score: 0.0 })
}

/// Feeds a stage's outcome at `secs` seconds; the stages it started.
pub fn finish_at(
    core: &mut Core,
    secs: f64,
    stage: StageId,
    outcome: StageOutcome,
) -> Vec<StageCommand> {
    runs(&finish_when(
        core,
        Time::from_secs_f64(secs),
        stage,
        outcome,
    ))
}

/// Ends generation stage `stage` of trajectory `t` at `secs` seconds with a 10-token action; the
/// environment step it started.
pub fn generated_at(core: &mut Core, secs: f64, stage: StageId, t: u64) -> StageCommand {
    stage_of(
        &finish_at(core, secs, stage, StageOutcome::Generated { tokens: 10 }),
        t,
    )
}

/// The stage of trajectory `t` among `stages`.
pub fn stage_of(stages: &[StageCommand], t: u64) -> StageCommand {
    stages
        .iter()
        .find(|s| s.traj == TrajId(t))
        .cloned()
        .unwrap()
}

/// Runs every stage the core asks for with a canned outcome (one-turn episodes) until it hands
/// out a training batch; the commands of that last step.
pub fn run_until_trained(core: &mut Core, mut pending: Vec<StageCommand>) -> Vec<Command> {
    let mut now = 1;
    while let Some(cmd) = pending.pop() {
        let outcome = match cmd.work {
            StageWork::EnvReset { .. } => observed(300, false),
            StageWork::EnvStep { .. } => observed(20, true),
            StageWork::Prefill { .. } => StageOutcome::Prefilled,
            StageWork::Generate { .. } => StageOutcome::Generated { tokens: 40 },
            StageWork::Reward { .. } => StageOutcome::Rewarded { score: 1.0 },
        };
        now += 1;
        let out = finish_when(core, Time(now), cmd.stage, outcome);
        if out.iter().any(|c| matches!(c, Command::Train { .. })) {
            return out;
        }
        pending.extend(runs(&out));
    }
    panic!("the core never handed out a training batch");
}
