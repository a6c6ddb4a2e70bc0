//! Re-planning in the running scheduler: when a GPU pool's nodes come or go mid-run, plan again
//! for the GPUs that are there, and move from the replicas that run to the new plan in waves.
//!
//! It also re-plans when the profiles the workers measure drift from those the running plan
//! assumed (`rollfleet scheduler --replan-on-drift MARGIN`, as `rollfleet sim
//! --replan-on-drift`).
//!
//! This is the decision only (pure, deterministic); the actor carries it out. It is the
//! simulator's re-plan after a loss or a growth (`rollfleet sim --lose/--grow`) applied to what
//! actually runs: the running placement is read off the live replicas instead of being assumed,
//! the planner's search picks the plan for the GPUs present, and the planner's full prediction
//! decides whether moving is worth it at all (the survivors are often the new plan). The trainer
//! keeps its pool, as in the simulator, and the waves may resize it there: a training batch
//! carries the trainer's GPUs (`TrainWork.trainer_gpus`), so the batches after a resize train
//! on the new size.

use std::collections::BTreeMap;

use rollfleet_catalog::Catalog;
use rollfleet_core::{ReplicaConfig, ServeRole, TrainerConfig};
use rollfleet_fleet::migration::{self, MigrationWave};
use rollfleet_fleet::workload::mean;
use rollfleet_planner::plan;
use rollfleet_planner::predict::{self, Candidate, Group, Problem, Role};
use rollfleet_planner::profile::ProfileStore;
use rollfleet_planner::replan::{self, Drift};
use rollfleet_planner::roofline::Efficiency;
use rollfleet_planner::search;
use rollfleet_spec::JobSpec;

/// Serving replicas changed per wave, at most: the figure the simulator uses too.
pub use rollfleet_fleet::migration::PER_WAVE;

/// What the planner decided for the GPUs present.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The waves from the running replicas to the new plan (empty: keep what runs).
    pub waves: Vec<MigrationWave>,
    /// The full prediction's step for what runs (`None`: it cannot run the job, e.g. no replica
    /// left to decode).
    pub running_step_s: Option<f64>,
    /// The full prediction's step for the new plan.
    pub planned_step_s: f64,
}

/// Share of the predicted step a new plan must save for a drift to move replicas (the figure the
/// simulator uses too): on drift the search often finds another placement of the same step.
pub use rollfleet_fleet::migration::MIN_GAIN;

/// The planning problem of a job, kept for re-planning while it runs.
#[derive(Debug, Clone)]
pub struct Replanner {
    problem: Problem,
    trainer_pool: usize,
    trainer_gpus: u32,
}

impl Replanner {
    /// The job's problem on its full inventory, with the model's profiles (as the plan it
    /// started with was made); `None` if the planner cannot pose it or the trainer's pool is not
    /// one of its GPU pools.
    pub fn new(spec: &JobSpec, catalog: &Catalog, trainer: &TrainerConfig) -> Option<Replanner> {
        let problem = plan::problem(spec, catalog, &mean, &Efficiency::default()).ok()?;
        let trainer_pool = problem
            .gpu_pools
            .iter()
            .position(|g| g.spec_index == trainer.pool as usize)?;
        Some(Replanner {
            problem,
            trainer_pool,
            trainer_gpus: trainer.gpus,
        })
    }

    /// The trainer was resized to `gpus` by a wave of a move (it stays on its pool).
    pub fn trainer_resized(&mut self, gpus: u32) {
        self.trainer_gpus = gpus;
    }

    /// The pools whose share of peak in `profiles` moved from the one this plan assumed by
    /// more than `margin` (relative).
    pub fn drift(&self, profiles: &ProfileStore, margin: f64) -> Vec<Drift> {
        replan::drift(&self.problem, profiles, margin)
    }

    /// The same job with the shares of peak `profiles` measured (where they have enough
    /// samples) instead of the model's.
    pub fn remeasured(
        &self,
        spec: &JobSpec,
        catalog: &Catalog,
        profiles: &ProfileStore,
    ) -> Option<Replanner> {
        let problem =
            plan::problem_profiled(spec, catalog, &mean, &Efficiency::default(), profiles).ok()?;
        Some(Replanner { problem, ..*self })
    }

    /// Plans for `gpus` GPUs present per spec pool (pools not named keep the job's count; no pool
    /// gets more than the job gives it), from the `running` serving replicas. The new plan is
    /// moved to only if its predicted step is shorter than what runs by more than `min_gain`
    /// (a share). `None` when no placement fits the GPUs present.
    pub fn decide(
        &self,
        gpus: &BTreeMap<u32, u32>,
        running: &[ReplicaConfig],
        min_gain: f64,
    ) -> Option<Decision> {
        let mut present = self.problem.clone();
        for pool in &mut present.gpu_pools {
            if let Some(&n) = gpus.get(&(pool.spec_index as u32)) {
                pool.count = pool.count.min(n);
            }
        }
        let running = self.candidate(&present, running);
        // The trainer keeps its pool (its weights and optimizer state stay where they are) but
        // may be resized there: the waves shrink it before others start on the GPUs it frees,
        // and grow it once retirements left it room.
        let found = replan::on_trainer_pool(&present, &running, search::choose(&present)?)?;
        let target = colocated_as_generate(found.candidate);
        let full = |c: &Candidate| predict::predict(&present, c).map(|p| p.step_s);
        let planned_step_s = full(&target)?;
        // What runs cannot go on as it is when it needs more GPUs than are left (a node of the
        // trainer's pool is gone: the trainer is not on one node, so none of its GPUs went with
        // it), whatever the model predicts for it.
        let running_step_s = full(&running).filter(|_| fits(&present, &running));
        let waves = match running_step_s {
            Some(now) if planned_step_s >= now * (1.0 - min_gain) => Vec::new(),
            _ => {
                let waves = replan::migration(&present, &running, &target, PER_WAVE);
                migration::sim_waves(&present, &running, &target, &waves)
            }
        };
        Some(Decision {
            waves,
            running_step_s,
            planned_step_s,
        })
    }

    /// The running replicas as the planner sees a placement.
    fn candidate(&self, present: &Problem, running: &[ReplicaConfig]) -> Candidate {
        let mut counts: BTreeMap<(usize, Role, u32), u32> = BTreeMap::new();
        for rc in running {
            let Some(pool) = present
                .gpu_pools
                .iter()
                .position(|g| g.spec_index == rc.pool as usize)
            else {
                continue;
            };
            let role = match rc.role {
                ServeRole::Prefill => Role::Prefill,
                ServeRole::Decode => Role::Decode,
                ServeRole::Generate => Role::Generate,
            };
            *counts.entry((pool, role, rc.gpus)).or_default() += 1;
        }
        Candidate {
            groups: counts
                .into_iter()
                .map(|((pool, role, tp), replicas)| Group {
                    pool,
                    role,
                    tp,
                    replicas,
                })
                .collect(),
            trainer_pool: self.trainer_pool,
            trainer_gpus: self.trainer_gpus,
        }
    }
}

/// Whether `c`'s serving replicas and trainer fit in every pool's GPUs.
fn fits(p: &Problem, c: &Candidate) -> bool {
    p.gpu_pools.iter().enumerate().all(|(pool, g)| {
        let serving: u64 = c
            .groups
            .iter()
            .filter(|x| x.pool == pool)
            .map(|x| u64::from(x.tp) * u64::from(x.replicas))
            .sum();
        let trainer = if c.trainer_pool == pool {
            u64::from(c.trainer_gpus)
        } else {
            0
        };
        serving + trainer <= u64::from(g.count)
    })
}

/// Decode groups of a placement without prefill replicas are colocated generation (as
/// `plan::placement` starts them): named so, a migration does not swap them for themselves.
fn colocated_as_generate(mut c: Candidate) -> Candidate {
    if c.replicas(Role::Prefill) > 0 {
        return c;
    }
    let mut counts: BTreeMap<(usize, u32), u32> = BTreeMap::new();
    for g in &c.groups {
        *counts.entry((g.pool, g.tp)).or_default() += g.replicas;
    }
    c.groups = counts
        .into_iter()
        .map(|((pool, tp), replicas)| Group {
            pool,
            role: Role::Generate,
            tp,
            replicas,
        })
        .collect();
    c
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::plan::JobPlan;

    /// The quick-start job with its decode pool as two nodes of two H20s.
    fn two_node_decode_job() -> JobPlan {
        let yaml = include_str!("../../../examples/jobs/quickstart.yaml");
        let decode = "      gpu: H20\n      count: 2\n";
        assert!(yaml.contains(decode));
        let yaml = yaml.replace(
            decode,
            "      gpu: H20\n      count: 4\n      gpusPerNode: 2\n",
        );
        JobPlan::from_yaml(&yaml, "test", 0).unwrap()
    }

    fn replanner(plan: &JobPlan) -> Replanner {
        Replanner::new(plan.spec(), plan.catalog(), &plan.placement.trainer).unwrap()
    }

    fn decode_pool(plan: &JobPlan) -> u32 {
        plan.pool_index("decode").unwrap()
    }

    /// GPUs of `pool` the waves of `decision` start replicas on, and those they stop, in all.
    fn gpus_started_and_stopped(decision: &Decision, pool: u32) -> (u32, u32) {
        let started = decision
            .waves
            .iter()
            .flat_map(|w| &w.start)
            .filter(|r| r.pool == pool)
            .map(|r| r.gpus)
            .sum();
        let stopped = decision
            .waves
            .iter()
            .flat_map(|w| &w.stop)
            .filter(|g| g.pool == pool)
            .map(|g| g.gpus * g.replicas)
            .sum();
        (started, stopped)
    }

    /// The placement's replicas but the last decode one, and that one.
    fn without_the_last_decode_replica(plan: &JobPlan) -> (Vec<ReplicaConfig>, ReplicaConfig) {
        let decode = decode_pool(plan);
        let mut replicas = plan.placement.replicas.clone();
        let last = replicas.iter().rposition(|r| r.pool == decode).unwrap();
        let gone = replicas.remove(last);
        (replicas, gone)
    }

    #[test]
    fn with_every_gpu_present_the_running_placement_is_the_plan_and_nothing_moves() {
        let plan = two_node_decode_job();
        let decision = replanner(&plan)
            .decide(&BTreeMap::new(), &plan.placement.replicas, 0.0)
            .unwrap();
        assert!(decision.waves.is_empty(), "{decision:?}");
        assert_eq!(decision.running_step_s, Some(decision.planned_step_s));
    }

    #[test]
    fn after_a_lost_node_the_plan_fits_the_gpus_left_and_starts_nothing_on_gpus_that_are_gone() {
        let plan = two_node_decode_job();
        let decode = decode_pool(&plan);
        let on_decode: Vec<&ReplicaConfig> = plan
            .placement
            .replicas
            .iter()
            .filter(|r| r.pool == decode)
            .collect();
        assert_eq!(on_decode.len(), 2, "the plan serves decode as 2 x TP2");
        // The node holding the last decode replica is gone.
        let (survivors, _) = without_the_last_decode_replica(&plan);
        let full = replanner(&plan)
            .decide(&BTreeMap::new(), &plan.placement.replicas, 0.0)
            .unwrap();
        let gpus = BTreeMap::from([(decode, 2)]);
        let decision = replanner(&plan).decide(&gpus, &survivors, 0.0).unwrap();
        assert!(
            decision.planned_step_s >= full.planned_step_s,
            "{decision:?}"
        );
        // Moving is only worth it for a shorter predicted step than the survivors give.
        let running = decision.running_step_s.unwrap();
        assert_eq!(
            decision.waves.is_empty(),
            running <= decision.planned_step_s,
            "{decision:?}"
        );
        let (started, stopped) = gpus_started_and_stopped(&decision, decode);
        assert!(
            2 + started - stopped <= 2,
            "the decode pool would use more than its 2 GPUs left: {decision:?}"
        );
    }

    #[test]
    fn when_the_node_comes_back_the_new_plan_starts_a_replica_on_its_gpus() {
        let plan = two_node_decode_job();
        let decode = decode_pool(&plan);
        let (survivors, gone) = without_the_last_decode_replica(&plan);
        let gpus = BTreeMap::from([(decode, 4)]);
        let decision = replanner(&plan).decide(&gpus, &survivors, 0.0).unwrap();
        assert!(
            decision.planned_step_s < decision.running_step_s.unwrap(),
            "{decision:?}"
        );
        let first = decision.waves.first().expect("a wave");
        assert_eq!(first.start, vec![gone], "{decision:?}");
        assert!(first.stop.is_empty(), "{decision:?}");
    }

    /// The quick-start job with training and generation sharing one pool of 8 H800s (four
    /// nodes of two) instead of a prefill and a train pool.
    fn shared_trainer_pool_job() -> JobPlan {
        let yaml = include_str!("../../../examples/jobs/quickstart.yaml");
        let pools = "    - name: prefill\n      gpu: H800\n      count: 1\n";
        let train = "    - name: train\n      gpu: H800\n      count: 1\n      roles: [train]\n";
        assert!(yaml.contains(pools) && yaml.contains(train));
        let yaml = yaml.replace(train, "").replace(
            pools,
            "    - name: gpu\n      gpu: H800\n      count: 8\n      gpusPerNode: 2\n",
        );
        JobPlan::from_yaml(&yaml, "test", 0).unwrap()
    }

    #[test]
    fn a_node_of_the_trainers_pool_lost_shrinks_the_trainer_to_what_the_pool_has_left() {
        let plan = shared_trainer_pool_job();
        let gpu = plan.pool_index("gpu").unwrap();
        let trainer = plan.placement.trainer.clone();
        assert_eq!(trainer.pool, gpu);
        let serving: u32 = plan
            .placement
            .replicas
            .iter()
            .filter(|r| r.pool == gpu)
            .map(|r| r.gpus)
            .sum();
        assert_eq!(trainer.gpus + serving, 8, "{:?}", plan.placement);
        // A node without a serving replica is gone: the trainer and the replicas on the six
        // GPUs left would need eight.
        let gpus = BTreeMap::from([(gpu, 6)]);
        let decision = replanner(&plan)
            .decide(&gpus, &plan.placement.replicas, 0.0)
            .unwrap();
        let resized = decision.waves.iter().rev().find_map(|w| w.trainer_gpus);
        let (started, stopped) = gpus_started_and_stopped(&decision, gpu);
        let trainer_after = resized.unwrap_or(trainer.gpus);
        assert!(trainer_after < trainer.gpus, "{decision:?}");
        assert!(
            trainer_after + serving + started - stopped <= 6,
            "the trainer's {trainer_after} and {} serving GPUs on the 6 left: {decision:?}",
            serving + started - stopped
        );
    }

    #[test]
    fn a_re_plan_may_resize_the_trainer_on_its_pool_and_its_waves_never_ask_the_pool_for_more_gpus_than_it_has()
     {
        // The RollArt-like job down to 32 H20s: the planner trains on 104 of the 192 H800s and
        // generates on 11 replicas of 8 of them (training pays its attention FLOPs, so the
        // trainer is larger than when it did not). The trainer, running on 112, shrinks at the
        // end of a wave and the replicas start on
        // the GPUs it freed in the waves after; at no point do the replicas started and the
        // trainer's size of that moment ask for more than the pool's 192.
        let yaml = include_str!("../../../examples/jobs/rollart-agentic.yaml");
        let plan = JobPlan::from_yaml(yaml, "test", 0).unwrap();
        let trainer = plan.placement.trainer.clone();
        assert_eq!(trainer.gpus, 112, "the plan the job starts with");
        let h20 = plan.pool_index("h20").unwrap();
        let lost: Vec<ReplicaConfig> = plan
            .placement
            .replicas
            .iter()
            .filter(|r| r.pool != h20)
            .cloned()
            .chain(
                plan.placement
                    .replicas
                    .iter()
                    .filter(|r| r.pool == h20)
                    .take(4)
                    .cloned(),
            )
            .collect();
        let gpus = BTreeMap::from([(h20, 32)]);
        let decision = replanner(&plan).decide(&gpus, &lost, 0.0).unwrap();
        let mut serving: u32 = lost
            .iter()
            .filter(|r| r.pool == trainer.pool)
            .map(|r| r.gpus)
            .sum();
        let mut trainer_gpus = trainer.gpus;
        let count = plan.spec().pools[trainer.pool as usize].count.unwrap() as u32;
        for (k, wave) in decision.waves.iter().enumerate() {
            serving += wave
                .start
                .iter()
                .filter(|r| r.pool == trainer.pool)
                .map(|r| r.gpus)
                .sum::<u32>();
            assert!(
                serving + trainer_gpus <= count,
                "wave {k}: {serving} serving GPUs and the trainer's {trainer_gpus} on a pool of \
                 {count}: {decision:?}"
            );
            serving -= wave
                .stop
                .iter()
                .filter(|g| g.pool == trainer.pool)
                .map(|g| g.gpus * g.replicas)
                .sum::<u32>();
            if let Some(resized) = wave.trainer_gpus {
                trainer_gpus = resized;
                assert!(
                    serving + trainer_gpus <= count,
                    "wave {k} grew the trainer to {trainer_gpus} beside {serving} serving GPUs \
                     on a pool of {count}: {decision:?}"
                );
            }
        }
        assert_eq!(trainer_gpus, 104, "{decision:?}");
        let generate_started: usize = decision
            .waves
            .iter()
            .flat_map(|w| &w.start)
            .filter(|r| r.pool == trainer.pool && r.role == ServeRole::Generate)
            .count();
        assert_eq!(generate_started, 11, "{decision:?}");
    }
}
