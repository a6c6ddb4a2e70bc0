//! The policies compared by the simulator: rollfleet and the baselines it is measured against.
//!
//! Each baseline is the same core run with a different placement and [`Policy`]; what each one
//! models, and its published source, is in `docs/baselines.md`:
//! - `sync`: verl's default synchronous, colocated PPO/GRPO loop (generate the batch, reward,
//!   train, reshard the weights in place) on the GPU pool with the most compute;
//! - `sync-disaggregated`: the same loop on rollfleet's disaggregated pools, with a barrier and a
//!   global weight broadcast at every step;
//! - `one-step-off`: verl's / slime's one-step-off-policy pipeline: batch `k + 1` is generated
//!   while step `k` trains, weights are broadcast between batches;
//! - `areal-like`: AReaL's fully asynchronous loop: trajectory-level asynchrony under the same
//!   staleness bound, generation and training on separate GPUs, interruptible generation (every
//!   rollout replica stops, loads the new weights and resumes its requests on them), on one
//!   uniform generation placement (no hardware affinity), without over-provisioning or
//!   late-group restarts;
//! - `rollfleet`: trajectory-level asynchrony, bounded staleness, over-provisioning with partial
//!   rollout, streaming training and rolling weight sync.

use rollfleet_catalog::Catalog;
use rollfleet_core::{
    Discipline, Placement, PlacementError, Policy, SyncMode, WorkloadMeans, colocated_placement,
    default_placement,
};
use rollfleet_spec::JobSpec;
use serde::Serialize;

/// A policy to simulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Baseline {
    /// Synchronous and colocated, one GPU type (verl's default loop).
    Sync,
    /// Synchronous on disaggregated pools: a barrier at every step.
    SyncDisaggregated,
    /// Rollout of step k+1 overlaps training of step k (verl/slime one-step-off).
    OneStepOff,
    /// Fully asynchronous with interruptible generation on a uniform placement (AReaL).
    #[value(name = "areal-like")]
    #[serde(rename = "areal-like")]
    ArealLike,
    /// rollfleet: everything.
    Rollfleet,
}

impl Baseline {
    /// Every policy, in the order reports list them.
    pub const ALL: [Baseline; 5] = [
        Baseline::Sync,
        Baseline::SyncDisaggregated,
        Baseline::OneStepOff,
        Baseline::ArealLike,
        Baseline::Rollfleet,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Sync => "sync",
            Baseline::SyncDisaggregated => "sync-disaggregated",
            Baseline::OneStepOff => "one-step-off",
            Baseline::ArealLike => "areal-like",
            Baseline::Rollfleet => "rollfleet",
        }
    }

    /// Its policy for a job, on a placement chosen by its rules (`crate::best`).
    pub fn setup_with(
        self,
        spec: &JobSpec,
        _catalog: &Catalog,
        placement: Placement,
    ) -> Result<(Placement, Policy), PlacementError> {
        Ok((placement, self.policy(spec)))
    }

    fn policy(self, spec: &JobSpec) -> Policy {
        let batched = |lag: u64, max_staleness: u64, weight_sync: SyncMode| Policy {
            discipline: Discipline::Batched { lag },
            max_staleness,
            over_provisioning: 0.0,
            weight_sync,
            max_concurrent_updates: 0,
            sticky_sessions: true,
            expiry_aware_publish: false,
            interrupt_generation: false,
            restart_late_groups: false,
            cap_over_provisioning: false,
            sample_within_job_budget: false,
            window_excludes_waiting_batch: false,
            spread_cold_turns: false,
            restart_expired_groups: false,
            window_widening_quarters: 0,
            cheapest_training_first: false,
            start_leaves_kv_room: false,
            updates_keep_half_decoding: false,
        };
        match self {
            Baseline::Sync => batched(0, 0, SyncMode::Colocated),
            Baseline::SyncDisaggregated => batched(0, 0, SyncMode::Broadcast),
            Baseline::OneStepOff => batched(1, 1, SyncMode::Broadcast),
            Baseline::ArealLike => Policy {
                discipline: Discipline::Continuous,
                max_staleness: spec.rl.max_staleness.max(0) as u64,
                over_provisioning: 0.0,
                weight_sync: SyncMode::Rolling,
                // Every replica at once: AReaL pauses all of its rollout servers, loads the new
                // weights on each and resumes the interrupted requests.
                max_concurrent_updates: u32::MAX,
                sticky_sessions: true,
                expiry_aware_publish: false,
                interrupt_generation: true,
                restart_late_groups: false,
                cap_over_provisioning: false,
                // AReaL's rollout keeps generating until training ends, and what is still
                // running then is never trained.
                sample_within_job_budget: false,
                // AReaL counts every started trajectory against its budget.
                window_excludes_waiting_batch: false,
                // Its weight updates reach every replica at once: none comes back first to
                // take every waiting turn.
                spread_cold_turns: false,
                restart_expired_groups: false,
                window_widening_quarters: 0,
                cheapest_training_first: false,
                start_leaves_kv_room: false,
                updates_keep_half_decoding: false,
            },
            Baseline::Rollfleet => Policy::rollfleet(spec),
        }
    }

    /// Its placement and policy for a job.
    pub fn setup(
        self,
        spec: &JobSpec,
        catalog: &Catalog,
        means: &WorkloadMeans,
    ) -> Result<(Placement, Policy), PlacementError> {
        let batched = |lag: u64, max_staleness: u64, weight_sync: SyncMode| Policy {
            discipline: Discipline::Batched { lag },
            max_staleness,
            over_provisioning: 0.0,
            weight_sync,
            max_concurrent_updates: 0,
            sticky_sessions: true,
            expiry_aware_publish: false,
            interrupt_generation: false,
            restart_late_groups: false,
            cap_over_provisioning: false,
            sample_within_job_budget: false,
            window_excludes_waiting_batch: false,
            spread_cold_turns: false,
            restart_expired_groups: false,
            window_widening_quarters: 0,
            cheapest_training_first: false,
            start_leaves_kv_room: false,
            updates_keep_half_decoding: false,
        };
        Ok(match self {
            Baseline::Sync => (
                colocated_placement(spec, catalog)?,
                batched(0, 0, SyncMode::Colocated),
            ),
            Baseline::SyncDisaggregated => (
                default_placement(spec, catalog, means)?,
                batched(0, 0, SyncMode::Broadcast),
            ),
            Baseline::OneStepOff => (
                default_placement(spec, catalog, means)?,
                batched(1, 1, SyncMode::Broadcast),
            ),
            Baseline::ArealLike => (default_placement(spec, catalog, means)?, self.policy(spec)),
            Baseline::Rollfleet => (
                default_placement(spec, catalog, means)?,
                Policy::rollfleet(spec),
            ),
        })
    }
}
