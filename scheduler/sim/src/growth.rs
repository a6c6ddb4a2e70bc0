//! Re-planning applied mid-run: a pool that grows (`rollfleet sim --grow POOL:GPUS@STEP`), the
//! planner's new plan for the bigger cluster, and the waves that take the running placement to
//! it without stopping rollout; the same waves after a pool loss, when the new plan differs from
//! what survived.
//!
//! The planner decides ([`rollfleet_planner::replan::migration`]: at most [`PER_WAVE`] serving
//! replicas per wave, starting before stopping); the simulator carries the waves out through the
//! core's `Input::ReplicaAdded` and `Input::RetireReplica` ([`crate::sim::Migration`]). The
//! trainer stays on its pool ([`replan::on_trainer_pool`]) and may be resized there: a wave
//! that resizes it says so ([`MigrationWave::trainer_gpus`]), and training batches dispatched
//! after the wave run on the new size.

use rollfleet_catalog::Catalog;
use rollfleet_planner::plan;
use rollfleet_planner::predict::{Candidate, Problem};
use rollfleet_planner::replan;
use rollfleet_planner::roofline::Efficiency;
use rollfleet_planner::search;
use rollfleet_spec::JobSpec;
use serde::Serialize;

use crate::loss::{PER_WAVE, Versus, versus};
use crate::sim::{Migration, MigrationReport, MigrationWave, RunResult};
use crate::workload::mean;

/// The planner's waves in the core's terms (moved to the crate both the scheduler and the
/// simulator build on).
pub use rollfleet_fleet::migration::sim_waves;

/// GPUs that arrive in a pool mid-run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PoolGrowth {
    /// The pool (index in the spec).
    pub pool: u32,
    /// GPUs added.
    pub gpus: u32,
    /// They arrive as this version is published.
    pub at_step: u64,
}

/// Parses `POOL:GPUS@STEP` against a job: a GPU pool's name, a whole number of GPUs of at least
/// one, a step in 1..steps.
pub fn parse(arg: &str, spec: &JobSpec) -> Result<PoolGrowth, String> {
    const FORM: &str = "POOL:GPUS@STEP";
    let (index, gpus, at_step) = crate::loss::pool_amount_step("--grow", arg, FORM, spec)?;
    let gpus: u32 = gpus.parse().ok().filter(|&g| g >= 1).ok_or_else(|| {
        format!(
            "--grow {arg}: GPUs \"{gpus}\" is not a whole number of at least 1 (expected {FORM})"
        )
    })?;
    Ok(PoolGrowth {
        pool: index as u32,
        gpus,
        at_step,
    })
}

/// The job with the GPUs added: the bigger cluster.
pub fn bigger_spec(spec: &JobSpec, growth: &PoolGrowth) -> JobSpec {
    let mut bigger = spec.clone();
    if let Some(p) = bigger.pools.get_mut(growth.pool as usize) {
        p.count = Some(p.count.unwrap_or(0) + i64::from(growth.gpus));
    }
    bigger
}

/// The planner's re-plan, as the report shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Replan {
    /// Predicted seconds per step of the running plan (the planner's full prediction).
    pub before_step_s: f64,
    /// Predicted seconds per step of the new plan (the trainer on its pool), the same way.
    pub new_plan_step_s: f64,
    /// The waves, as the simulator applies them.
    pub waves: Vec<MigrationWave>,
}

/// Re-plans for the bigger cluster: the new plan, and the waves from the running plan (the
/// plan of `spec`) to it, the trainer on its pool.
pub fn replan_growth(
    spec: &JobSpec,
    catalog: &Catalog,
    growth: &PoolGrowth,
) -> Result<(Migration, Replan), String> {
    let p =
        plan::problem(spec, catalog, &mean, &Efficiency::default()).map_err(|e| e.to_string())?;
    let running = search::choose(&p).ok_or("no placement can run the job")?;
    let bigger = bigger_spec(spec, growth);
    let p2 = plan::problem(&bigger, catalog, &mean, &Efficiency::default())
        .map_err(|e| e.to_string())?;
    let new = search::choose(&p2)
        .and_then(|found| replan::on_trainer_pool(&p2, &running.candidate, found))
        .ok_or("no placement can run the job on the bigger cluster")?;
    let target = new.candidate.clone();
    let waves = replan::migration(&p2, &running.candidate, &target, PER_WAVE);
    let waves = sim_waves(&p2, &running.candidate, &target, &waves);
    Ok((
        Migration {
            at_step: growth.at_step,
            added_gpus: vec![(growth.pool, growth.gpus)],
            waves: waves.clone(),
        },
        Replan {
            before_step_s: full_prediction(&p, &running.candidate).unwrap_or(running.step_s),
            new_plan_step_s: full_prediction(&p2, &target).unwrap_or(new.step_s),
            waves,
        },
    ))
}

/// The planner's waves after a pool loss (from the surviving placement to the new plan for the
/// smaller cluster), as the simulator applies them; empty when the new plan is what survived.
pub fn loss_waves(
    spec: &JobSpec,
    catalog: &Catalog,
    pool: u32,
    gpus_lost: u32,
) -> Option<Vec<MigrationWave>> {
    let p = plan::problem(spec, catalog, &mean, &Efficiency::default()).ok()?;
    let running = search::choose(&p)?;
    let index = p
        .gpu_pools
        .iter()
        .position(|g| g.spec_index == pool as usize)?;
    let (smaller, survivor, new, waves) =
        replan::replan_after_loss(&p, &running.candidate, index, gpus_lost, PER_WAVE)?;
    Some(sim_waves(&smaller, &survivor, &new.candidate, &waves))
}

/// The planner's full prediction of a placement's steady-state step (the search ranks by its
/// first-order objective; reports quote this one).
pub(crate) fn full_prediction(p: &Problem, c: &Candidate) -> Option<f64> {
    rollfleet_planner::predict::predict(p, c).map(|x| x.step_s)
}

/// How the run that grew compares with the bigger cluster's own run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GrowthReport {
    /// The pool.
    pub pool: String,
    /// GPUs added.
    pub gpus: u32,
    /// The step after which they arrived.
    pub at_step: u64,
    /// What the migration did in the run.
    pub migration: MigrationReport,
    /// The planner's re-plan.
    pub replan: Replan,
    /// Against the bigger cluster run on its own plan.
    #[serde(flatten)]
    pub versus: Versus,
}

/// Compares the run that grew mid-run with the bigger cluster's own run.
pub fn compare(
    spec: &JobSpec,
    growth: &PoolGrowth,
    replan: Replan,
    run: &RunResult,
    reference: &RunResult,
    reference_bound_s: f64,
) -> Option<GrowthReport> {
    let migration = run.migration.clone()?;
    Some(GrowthReport {
        pool: spec
            .pools
            .get(growth.pool as usize)
            .map_or_else(String::new, |p| p.name.clone()),
        gpus: growth.gpus,
        at_step: growth.at_step,
        versus: versus(
            &run.publish_times_s,
            &reference.publish_times_s,
            growth.at_step,
            migration.at_s,
            reference_bound_s,
        )?,
        migration,
        replan,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn job() -> rollfleet_spec::ValidatedJob {
        let text = include_str!("../../../examples/jobs/rollart-agentic.yaml");
        rollfleet_spec::parse_job(text.as_bytes(), "rollart-agentic.yaml").unwrap()
    }

    #[test]
    fn a_malformed_growth_is_refused_naming_what_is_wrong() {
        let job = job();
        let spec = job.spec();
        assert!(parse("h20", spec).unwrap_err().contains("no ':'"));
        assert!(parse("h20:8", spec).unwrap_err().contains("no '@'"));
        assert!(parse("x:8@2", spec).unwrap_err().contains("no pool \"x\""));
        assert!(parse("h20:0@2", spec).unwrap_err().contains("at least 1"));
        assert!(
            parse("h20:eight@2", spec)
                .unwrap_err()
                .contains("at least 1")
        );
        assert!(parse("h20:8@0", spec).unwrap_err().contains("step 0"));
        let ok = parse("h20:80@5", spec).unwrap();
        assert_eq!((ok.gpus, ok.at_step), (80, 5));
        assert_eq!(
            bigger_spec(spec, &ok).pools[ok.pool as usize].count,
            spec.pools[ok.pool as usize].count.map(|c| c + 80)
        );
    }

    #[test]
    fn new_gpus_become_replicas_of_the_new_plan_in_waves_of_at_most_four() {
        let job = job();
        let growth = parse("h20:80@5", job.spec()).unwrap();
        let (migration, replan) = replan_growth(job.spec(), &job.catalog, &growth).unwrap();
        assert_eq!(migration.added_gpus, vec![(growth.pool, 80)]);
        let started: usize = migration.waves.iter().map(|w| w.start.len()).sum();
        assert!(started > 0, "{migration:?}");
        for wave in &migration.waves {
            let changed =
                wave.start.len() as u32 + wave.stop.iter().map(|s| s.replicas).sum::<u32>();
            assert!(changed <= 2 * PER_WAVE, "{wave:?}");
        }
        // The new GPUs are used: no more than 80 GPUs' worth started on the grown pool beyond
        // what was stopped there, and at least one replica's worth.
        let grown: u32 = migration
            .waves
            .iter()
            .flat_map(|w| &w.start)
            .filter(|r| r.pool == growth.pool)
            .map(|r| r.gpus)
            .sum();
        let stopped: u32 = migration
            .waves
            .iter()
            .flat_map(|w| &w.stop)
            .filter(|s| s.pool == growth.pool)
            .map(|s| s.gpus * s.replicas)
            .sum();
        assert!(
            grown > stopped && grown - stopped <= 80,
            "{grown} {stopped}"
        );
        assert!(replan.new_plan_step_s <= replan.before_step_s);
    }
}
