//! The job as both ends of the wire see it: the core's configuration, where the replicas and the
//! trainer sit, and the figures an emulated worker needs to model its hardware.
//!
//! The scheduler and every node worker build this from the same job YAML (the scheduler sends it
//! in `RegisterResponse.job_yaml`) with the same pure functions as `rollfleet sim`, so an
//! emulated replica holds the KV capacity the core plans with and a trainer takes the time the
//! simulator would charge. The placement is the planner's, as it is by default in `rollfleet sim`,
//! so that a run and its simulation make the same decisions for the same job and seed.

use rollfleet_catalog::Catalog;
use rollfleet_core::{Config, Placement, Policy, ReplicaConfig};
use rollfleet_spec::{JobSpec, PoolKind, ValidatedJob};

use crate::hardware::{HardwareModel, ModelCosts, model_costs};
use crate::placement::{ChoiceError, PlacementChoice, choose};

/// Why a job could not be planned.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The YAML is not a valid job.
    #[error("job: {0}")]
    Spec(#[from] rollfleet_spec::SpecError),
    /// No placement fits.
    #[error("placement: {0}")]
    Placement(#[from] rollfleet_core::PlacementError),
    /// The planner found no placement.
    #[error("placement: {0}")]
    Plan(#[from] ChoiceError),
    /// The core refused the configuration.
    #[error("configuration: {0}")]
    Config(#[from] rollfleet_core::ConfigError),
}

/// What a pool is, as the runtime cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolRole {
    /// GPUs: serving replicas and/or the trainer.
    Gpu,
    /// CPU nodes: environments (and local rewards).
    Cpu,
    /// Serverless functions: rewards.
    Serverless,
}

/// A planned job.
#[derive(Debug, Clone)]
pub struct JobPlan {
    /// The job's YAML as given (sent to workers as is).
    pub yaml: String,
    /// The validated job.
    pub job: ValidatedJob,
    /// Where everything runs.
    pub placement: Placement,
    /// The core's configuration (rollfleet's own policy).
    pub config: Config,
    /// The model's per-token costs.
    pub costs: ModelCosts,
    /// The modelled hardware's achieved fractions of peak.
    pub hardware: HardwareModel,
}

impl JobPlan {
    /// Plans a job from its YAML text, with the core seeded by `seed`.
    pub fn from_yaml(yaml: &str, origin: &str, seed: u64) -> Result<JobPlan, PlanError> {
        let job = rollfleet_spec::parse_job(yaml.as_bytes(), origin)?;
        let spec = job.spec();
        let (planned, _) = choose(PlacementChoice::Plan, spec, &job.catalog)?;
        // rollfleet's own policy on the planner's placement: what `rollfleet sim` runs as its
        // `rollfleet` policy, so that a run and its simulation decide alike.
        let (placement, policy) = (planned, Policy::rollfleet(spec));
        let config = Config::new(spec, &job.catalog, &placement, policy, seed)?;
        let costs = model_costs(spec);
        Ok(JobPlan {
            yaml: yaml.to_owned(),
            job,
            placement,
            config,
            costs,
            hardware: HardwareModel::default(),
        })
    }

    /// The plan with the core's admission window widened by `quarters` quarters of a rollout
    /// batch (narrowed when negative: `Policy::window_widening_quarters`), as a simulation of
    /// the job chose.
    pub fn with_window_widening(mut self, quarters: i32) -> JobPlan {
        self.config.policy.window_widening_quarters = quarters;
        self
    }

    /// The job spec.
    pub fn spec(&self) -> &JobSpec {
        self.job.spec()
    }

    /// The catalogue.
    pub fn catalog(&self) -> &Catalog {
        &self.job.catalog
    }

    /// The job's name.
    pub fn name(&self) -> &str {
        &self.job.manifest.metadata.name
    }

    /// The scheduling policy.
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }

    /// A pool's index by name.
    pub fn pool_index(&self, name: &str) -> Option<u32> {
        self.spec()
            .pools
            .iter()
            .position(|p| p.name == name)
            .map(|i| i as u32)
    }

    /// A pool's name.
    pub fn pool_name(&self, pool: u32) -> &str {
        self.spec()
            .pools
            .get(pool as usize)
            .map_or("?", |p| p.name.as_str())
    }

    /// What a pool is.
    pub fn pool_role(&self, pool: u32) -> Option<PoolRole> {
        match self.spec().pools.get(pool as usize)?.kind()? {
            PoolKind::Gpu => Some(PoolRole::Gpu),
            PoolKind::Cpu => Some(PoolRole::Cpu),
            PoolKind::Serverless => Some(PoolRole::Serverless),
        }
    }

    /// Replica `r`'s configuration.
    pub fn replica(&self, r: u64) -> Option<&ReplicaConfig> {
        self.placement.replicas.get(r as usize)
    }

    /// Peak FLOP/s and HBM bytes/s of one GPU of a pool (a neutral default if the pool has none).
    pub fn gpu_peaks(&self, pool: u32) -> (f64, f64) {
        self.spec()
            .pools
            .get(pool as usize)
            .and_then(|p| p.gpu.as_deref())
            .and_then(|g| self.catalog().gpu(g).ok())
            .map_or((1e15, 1e12), |g| {
                (g.peak_flops(), g.memory_bandwidth_bytes_per_s())
            })
    }

    /// Bytes/s a bulk transfer between pools achieves (weights, KV caches).
    pub fn link_bytes_per_s(&self) -> f64 {
        (self.spec().network.cross_pool_gbps * 1e9 * self.hardware.link_efficiency).max(1.0)
    }

    /// Modelled seconds the trainer takes for a batch of `tokens` whose causal attention spans
    /// `causal_pairs` query-key pairs, on `gpus` of its pool, at the train MFU of those GPUs:
    /// the simulator's formula, `6 x active parameters` a token plus three times the forward
    /// attention (`rollfleet_spec::train_attention_flops`); `gpus` 0 means the size the job was
    /// planned with.
    pub fn train_seconds(&self, tokens: u64, causal_pairs: u64, gpus: u32) -> f64 {
        let spec = self.spec();
        let (peak, _) = self.gpu_peaks(self.placement.trainer.pool);
        let gpus = if gpus == 0 {
            self.placement.trainer.gpus
        } else {
            gpus
        };
        let gpus = gpus.max(1) as f64;
        let mfu = spec.rl.train_mfu.clamp(0.01, 1.0);
        let attention = 3.0 * spec.model.attention_flops_per_token(1.0) * causal_pairs as f64;
        (spec.model.train_flops_per_token() * tokens as f64 + attention) / (gpus * peak * mfu)
    }

    /// Every pool the job needs a worker in before it can start.
    pub fn pools_needed(&self) -> Vec<u32> {
        let mut pools: Vec<u32> = self.placement.replicas.iter().map(|r| r.pool).collect();
        pools.push(self.placement.trainer.pool);
        pools.extend(
            self.config
                .cpu_pools
                .iter()
                .filter(|p| p.environments && p.millicpus > 0)
                .map(|p| p.pool),
        );
        for task in &self.config.tasks {
            match task.reward {
                rollfleet_core::RewardRoute::Serverless(s) => {
                    if let Some(p) = self.config.serverless_pools.get(s as usize) {
                        pools.push(p.pool);
                    }
                }
                rollfleet_core::RewardRoute::Local(c) => {
                    if let Some(p) = self.config.cpu_pools.get(c as usize) {
                        pools.push(p.pool);
                    }
                }
                rollfleet_core::RewardRoute::Environment => {}
            }
        }
        pools.sort_unstable();
        pools.dedup();
        pools
    }
}

/// The seed of a trajectory's environment episode: a pure function of the job seed and the
/// trajectory, so any worker rebuilds the same episode. A regenerated trajectory (a new attempt)
/// keeps its episode: the core regenerates it from a turn, whose state is rebuilt by replaying
/// the actions before it. (The trailing 0 is where earlier versions keyed the attempt.)
pub fn episode_seed(job_seed: u64, traj: u64) -> u64 {
    rollfleet_core::rng::SplitMix64::keyed(job_seed, &[0x656e_7673, traj, 0]).next_u64()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const QUICKSTART: &str = include_str!("../../../examples/jobs/quickstart.yaml");

    #[test]
    fn a_job_runs_rollfleets_policy_on_the_placement_the_planner_chooses() {
        let plan = JobPlan::from_yaml(QUICKSTART, "quickstart.yaml", 7).unwrap();
        let (planned, _) = choose(PlacementChoice::Plan, plan.spec(), plan.catalog()).unwrap();
        assert_eq!(plan.placement, planned);
        assert_eq!(*plan.policy(), Policy::rollfleet(plan.spec()));
        assert_eq!(plan.config.seed, 7);
        assert_eq!(plan.costs, model_costs(plan.spec()));
        assert_eq!(plan.yaml, QUICKSTART);
    }

    #[test]
    fn a_text_that_is_not_a_job_is_refused_as_a_spec_error() {
        let refused = JobPlan::from_yaml("kind: NotAJob\n", "broken.yaml", 0).unwrap_err();
        assert!(matches!(refused, PlanError::Spec(_)), "{refused:?}");
    }

    #[test]
    fn a_job_whose_csv_file_the_planning_process_cannot_find_is_refused_naming_the_field() {
        // What the scheduler and the operator meet when the file is not in their image.
        let yaml = QUICKSTART.replacen(
            "latencyMs: { distribution: lognormal, median: 3, p99: 20 }",
            "latencyMs: { distribution: csv, path: /no/such/dir/latency.csv, column: ms }",
            1,
        );
        assert_ne!(yaml, QUICKSTART);
        let refused = JobPlan::from_yaml(&yaml, "rljob/quickstart", 0).unwrap_err();
        let message = refused.to_string();
        assert!(
            message
                .contains("spec.rewards[1].latencyMs.path: /no/such/dir/latency.csv: no such file"),
            "{message}"
        );
    }

    #[test]
    fn every_pool_with_a_replica_or_the_trainer_is_needed_and_named_by_its_index() {
        let plan = JobPlan::from_yaml(QUICKSTART, "quickstart.yaml", 0).unwrap();
        let needed = plan.pools_needed();
        assert!(needed.contains(&plan.placement.trainer.pool));
        for replica in &plan.placement.replicas {
            assert!(needed.contains(&replica.pool));
            assert_eq!(plan.pool_role(replica.pool), Some(PoolRole::Gpu));
            let name = plan.pool_name(replica.pool);
            assert_eq!(plan.pool_index(name), Some(replica.pool));
        }
        assert!(
            needed.windows(2).all(|w| w[0] < w[1]),
            "sorted, no repeats: {needed:?}"
        );
        assert_eq!(plan.pool_role(u32::MAX), None);
    }

    #[test]
    fn training_on_twice_the_gpus_takes_half_the_time() {
        let plan = JobPlan::from_yaml(QUICKSTART, "quickstart.yaml", 0).unwrap();
        let planned = plan.placement.trainer.gpus;
        let on_planned = plan.train_seconds(1_000_000, 5_000_000_000, 0);
        assert_eq!(
            on_planned,
            plan.train_seconds(1_000_000, 5_000_000_000, planned)
        );
        let doubled = plan.train_seconds(1_000_000, 5_000_000_000, 2 * planned);
        assert!((doubled * 2.0 - on_planned).abs() <= 1e-9 * on_planned);
    }

    #[test]
    fn training_pays_the_causal_attention_of_its_trajectories_as_the_simulator_charges_it() {
        let plan = JobPlan::from_yaml(QUICKSTART, "quickstart.yaml", 0).unwrap();
        let model = &plan.spec().model;
        let tokens = 4096_u64;
        let dense = plan.train_seconds(tokens, 0, 0);
        let with_attention = plan.train_seconds(tokens, tokens * (tokens + 1) / 2, 0);
        // One trajectory of 4,096 tokens: attention adds what the simulator's training charges
        // for it, relative to the dense 6 FLOPs a parameter a token.
        let expected = rollfleet_spec::train_attention_flops(
            model.attention_flops_per_token(1.0),
            tokens as f64,
        ) / (model.train_flops_per_token() * tokens as f64);
        let added = (with_attention - dense) / dense;
        assert!(expected > 0.01, "{expected}");
        assert!(
            (added - expected).abs() <= 1e-9 * expected,
            "{added} {expected}"
        );
    }

    #[test]
    fn an_episode_seed_depends_on_the_job_seed_and_the_trajectory_alone() {
        assert_eq!(episode_seed(1, 2), episode_seed(1, 2));
        assert_ne!(episode_seed(1, 2), episode_seed(1, 3));
        assert_ne!(episode_seed(1, 2), episode_seed(2, 2));
    }
}
