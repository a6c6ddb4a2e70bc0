//! The core's contract with the outside world: identifiers, inputs (facts) and commands.
//!
//! Everything here is plain data (integers, enums, vectors; `serde`-serialisable) so that the
//! real server can carry it over gRPC and the simulator can log it. Inputs are facts that have
//! already happened ("stage 17 finished and produced 212 tokens", "replica 3 is gone"); commands
//! are requests the core makes ("run stage 18 on replica 5", "update replica 3 to version 4").
//! Every command that starts work carries a [`StageId`]; a report about a stage the core no longer
//! expects (a late answer from a replica declared lost, a duplicate) is ignored, which is what
//! makes "no trajectory lost or delivered twice" hold under failures.

use serde::{Deserialize, Serialize};

macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);
    };
}

id!(
    /// A trajectory (one episode of one agent), unique for the job.
    TrajId
);
id!(
    /// A group: the `groupSize` trajectories sampled for one task instance.
    GroupId
);
id!(
    /// An inference replica: a tensor-parallel group of GPUs holding one copy of the weights.
    ReplicaId
);
id!(
    /// One unit of dispatched work; unique for the life of the core, never reused.
    StageId
);
id!(
    /// One training batch (an optimizer update over `trainBatchSize` trajectories).
    BatchId
);

/// A policy version: 0 is the initial weights; the trainer publishes `v + 1` after RL step `v`.
pub type Version = u64;

/// The index of a pool in the job spec's `pools` list.
pub type PoolIndex = u32;

/// What a stage asks a worker to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StageWork {
    /// Create the trajectory's environment instance and return its first observation (the
    /// prompt), on a CPU pool.
    EnvReset {
        /// The CPU pool.
        pool: PoolIndex,
        /// Milli-vCPUs the step occupies while it runs.
        millicpus: u64,
    },
    /// Apply the last action to the environment and return the next observation.
    EnvStep {
        /// The CPU pool holding the trajectory's environment.
        pool: PoolIndex,
        /// Milli-vCPUs the step occupies while it runs.
        millicpus: u64,
        /// Tokens of the action being applied.
        action_tokens: u64,
    },
    /// Prefill only, on a prefill replica; the KV cache stays there until a decode replica
    /// pulls it.
    Prefill {
        /// The replica.
        replica: ReplicaId,
        /// Tokens to compute KV for (the whole context: nothing is cached on a prefill replica).
        tokens: u64,
    },
    /// Generate one turn's action on a decode (or colocated) replica: optionally pull a KV cache
    /// from a prefill replica, prefill `prefill_tokens` on top of `cached_tokens` already held,
    /// then decode up to `max_new_tokens`.
    Generate {
        /// The replica.
        replica: ReplicaId,
        /// Tokens whose KV cache is already there (kept from an earlier turn, or pulled).
        cached_tokens: u64,
        /// Tokens to prefill locally before decoding.
        prefill_tokens: u64,
        /// Most tokens to generate.
        max_new_tokens: u64,
        /// The prefill replica to pull `kv_tokens` of KV cache from, before decoding.
        kv_from: Option<ReplicaId>,
        /// Tokens of KV cache to pull.
        kv_tokens: u64,
    },
    /// Score the finished trajectory.
    Reward {
        /// The pool: a serverless pool, or a CPU pool for local rewards.
        pool: PoolIndex,
        /// Whether `pool` is a serverless pool.
        serverless: bool,
        /// Milli-vCPUs it occupies (local rewards only).
        millicpus: u64,
    },
}

/// A unit of work to run, with what the worker needs to know about its trajectory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageCommand {
    /// The stage.
    pub stage: StageId,
    /// Its trajectory.
    pub traj: TrajId,
    /// The trajectory's group.
    pub group: GroupId,
    /// Index of the trajectory's task in the job spec.
    pub task: u32,
    /// Turn index (0-based) this stage belongs to.
    pub turn: u32,
    /// How many times the trajectory was regenerated so far.
    pub attempt: u32,
    /// Policy version the replica serves (generation stages), stamped on the turn.
    pub version: Version,
    /// The work.
    pub work: StageWork,
}

/// How a replica's weights are moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum SyncMode {
    /// One replica (or a few) at a time, over the cross-pool link, while the rest keep serving.
    Rolling,
    /// Every replica at once in one broadcast, rollout stopped (the synchronous baselines).
    Broadcast,
    /// The trainer and the replicas share GPUs: a resharding copy inside each node.
    Colocated,
}

/// A request from the core.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// Run a stage.
    Run(StageCommand),
    /// Load version `version` on `replica` (`bytes` of weights). The replica drops its KV cache.
    UpdateWeights {
        /// The replica.
        replica: ReplicaId,
        /// The version to load.
        version: Version,
        /// Bytes of weights to move.
        bytes: u64,
        /// How.
        mode: SyncMode,
    },
    /// Forget the KV cache a replica keeps for a trajectory (it will be recomputed if needed).
    ReleaseKv {
        /// The replica.
        replica: ReplicaId,
        /// The trajectory.
        traj: TrajId,
    },
    /// Stop a generation where it is and report what it generated
    /// ([`StageOutcome::Interrupted`]): its replica is about to load new weights
    /// (`rl.interruptGeneration`). A generation that finished before the interrupt arrived
    /// reports as usual.
    Interrupt {
        /// The stage.
        stage: StageId,
    },
    /// Abandon a stage the core has given up on (timed out, or its KV source was lost); any
    /// later report about it is ignored.
    Cancel {
        /// The stage.
        stage: StageId,
    },
    /// A group was given up as an infrastructure failure: one of its trajectories failed
    /// [`crate::Config::stage_failure_limit`] times in a row. None of its trajectories will be
    /// trained on (a GRPO group is only usable whole), none is scored, and a fresh group takes
    /// its place.
    AbandonGroup {
        /// The group.
        group: GroupId,
        /// Its trajectories.
        trajectories: Vec<TrajId>,
        /// The trajectory whose failures gave the group up.
        failed: TrajId,
    },
    /// A replica told to retire has drained: nothing runs on it or waits for it any more, and
    /// its GPUs are free.
    ReplicaRetired {
        /// The replica.
        replica: ReplicaId,
    },
    /// Train on whole groups of finished trajectories.
    Train {
        /// The batch.
        batch: BatchId,
        /// The RL step (= the policy version being trained from).
        step: u64,
        /// Whether the trainer publishes version `step + 1` when this batch is done.
        publishes: bool,
        /// The trajectories, group by group.
        trajectories: Vec<TrajId>,
        /// Tokens in them (prompt, actions, observations).
        tokens: u64,
        /// The query-key pairs of their causal attention: `L (L + 1) / 2` summed over
        /// trajectories of `L` tokens, what training's attention FLOPs scale with.
        #[serde(default)]
        causal_pairs: u64,
    },
}

/// What a finished stage produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StageOutcome {
    /// The environment answered (reset or step).
    Observed {
        /// Tokens of the observation (the prompt, for a reset).
        tokens: u64,
        /// Whether the episode ended.
        done: bool,
    },
    /// Prefill finished; the KV cache waits on the prefill replica.
    Prefilled,
    /// Generation finished.
    Generated {
        /// Tokens generated.
        tokens: u64,
    },
    /// A generation stopped by [`Command::Interrupt`] before it finished: `tokens` were
    /// generated, and the turn resumes from them on the replica's next weights.
    Interrupted {
        /// Tokens generated before the interrupt.
        tokens: u64,
    },
    /// The reward was computed.
    Rewarded {
        /// The score.
        score: f64,
    },
}

/// A fact reported to the core.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Input {
    /// A stage finished.
    StageFinished {
        /// The stage.
        stage: StageId,
        /// Its result.
        outcome: StageOutcome,
    },
    /// A stage failed for an infrastructure reason (sandbox crash, function error, OOM); it is
    /// retried, never scored as a zero reward.
    StageFailed {
        /// The stage.
        stage: StageId,
    },
    /// A replica is gone (node lost, process crashed); its work is rescheduled.
    ReplicaLost {
        /// The replica.
        replica: ReplicaId,
    },
    /// A lost replica is back, with no weights loaded and an empty cache.
    ReplicaRecovered {
        /// The replica.
        replica: ReplicaId,
    },
    /// A new serving replica is up (a re-plan starts it, or more GPUs arrived); it takes the next
    /// [`ReplicaId`] (the number of replicas so far) and is given the current weights first.
    ReplicaAdded {
        /// What it is.
        config: crate::placement::ReplicaConfig,
    },
    /// Take a replica out of service for good (a re-plan moves its GPUs elsewhere): it gets no
    /// new work, drops the KV caches it keeps between turns, finishes what it runs, and is then
    /// handed back with [`Command::ReplicaRetired`]. Rollout never stops as a whole.
    RetireReplica {
        /// The replica.
        replica: ReplicaId,
    },
    /// A replica finished loading a version.
    WeightsUpdated {
        /// The replica.
        replica: ReplicaId,
        /// The version it now serves.
        version: Version,
    },
    /// The trainer finished a batch (and published the next version if the batch said so).
    TrainFinished {
        /// The batch.
        batch: BatchId,
    },
    /// An external trainer published `version`: the same publication as a [`Input::TrainFinished`]
    /// of the batch that publishes it, taken only when that batch was handed out and `version` is
    /// the next one ([`crate::Core::publication_refusal`] says why not, and nothing changes).
    Published {
        /// The version published.
        version: Version,
    },
}
