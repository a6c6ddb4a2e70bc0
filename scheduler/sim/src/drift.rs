//! Re-planning when measured profiles drift (`rollfleet sim --replan-on-drift MARGIN`), and a
//! way to make them drift (`--slow POOL:SHARE@STEP`: from that step on, the pool's GPUs achieve
//! only that share of the rates the simulator models, as a throttled or badly-driven node
//! would).
//!
//! At every published version, the share of peak each GPU pool achieved for prefill and decode
//! (the profiles the simulated replicas measured, kept as robust estimates) is compared with the
//! one the running plan assumed ([`rollfleet_planner::replan::drift`]). Past the margin, the
//! planner plans again with the measured profiles and the run moves to the new plan in waves, as
//! for a pool that grows ([`crate::growth`]); the new plan's assumptions are then the reference
//! for the next check. The trainer keeps its GPUs.

use rollfleet_catalog::Catalog;
use rollfleet_planner::plan;
use rollfleet_planner::predict::{Candidate, Problem};
use rollfleet_planner::profile::ProfileStore;
use rollfleet_planner::replan;
use rollfleet_planner::roofline::Efficiency;
use rollfleet_planner::search;
use rollfleet_spec::JobSpec;
use serde::Serialize;

use crate::loss::PER_WAVE;
use crate::sim::{MigrationReport, MigrationWave};
use crate::workload::mean;

/// Share of the predicted step a new plan must save to be worth moving to: a plan that only
/// ties (the search often finds another placement of the same predicted step) moves replicas
/// for nothing.
pub const MIN_GAIN: f64 = 0.05;

/// A pool whose GPUs slow down mid-run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slowdown {
    /// The pool (index in the spec).
    pub pool: u32,
    /// Share of the modelled rates its GPUs achieve from then on, in (0, 1).
    pub share: f64,
    /// It starts as this version is published.
    pub at_step: u64,
}

/// Parses `POOL:SHARE@STEP` against a job: a GPU pool's name, a share in (0, 1), a step in
/// 1..steps.
pub fn parse(arg: &str, spec: &JobSpec) -> Result<Slowdown, String> {
    const FORM: &str = "POOL:SHARE@STEP";
    let (index, share, at_step) = crate::loss::pool_amount_step("--slow", arg, FORM, spec)?;
    let share: f64 = share
        .parse()
        .ok()
        .filter(|s: &f64| *s > 0.0 && *s < 1.0)
        .ok_or_else(|| {
            format!("--slow {arg}: share \"{share}\" is not in (0, 1) (expected {FORM})")
        })?;
    Ok(Slowdown {
        pool: index as u32,
        share,
        at_step,
    })
}

/// One re-plan on drift.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DriftReplan {
    /// The version whose publication triggered it.
    pub step: u64,
    /// Virtual seconds.
    pub at_s: f64,
    /// What drifted: pool, kind of work, the share the plan assumed and the measured one.
    pub drifts: Vec<replan::Drift>,
    /// Predicted seconds per step of the running placement, with the measured profiles (the
    /// planner's full prediction).
    pub running_step_s: Option<f64>,
    /// Predicted seconds per step of the new plan, the same way.
    pub new_plan_step_s: f64,
    /// Waves to the new plan (0: the running placement is still the best).
    pub waves: usize,
    /// What the migration did (filled in at the end of the run).
    pub migration: Option<MigrationReport>,
}

/// Watches the measured profiles against the running plan's assumptions.
#[derive(Debug, Clone)]
pub struct DriftWatch {
    margin: f64,
    planned: Problem,
    running: Candidate,
    /// The re-plans so far.
    pub replans: Vec<DriftReplan>,
}

impl DriftWatch {
    /// Watches the plan of `spec` (the placement the run starts on must be that plan), with a
    /// relative `margin`.
    pub fn new(spec: &JobSpec, catalog: &Catalog, margin: f64) -> Result<DriftWatch, String> {
        let planned = plan::problem(spec, catalog, &mean, &Efficiency::default())
            .map_err(|e| e.to_string())?;
        let running = search::choose(&planned)
            .ok_or("no placement can run the job")?
            .candidate;
        Ok(DriftWatch {
            margin,
            planned,
            running,
            replans: Vec::new(),
        })
    }

    /// At a publication: if a profile drifted past the margin, plans again with the measured
    /// profiles and returns the waves to the new plan (none if it does not save [`MIN_GAIN`] of
    /// the running placement's predicted step); `None` if nothing drifted.
    pub fn check(
        &mut self,
        spec: &JobSpec,
        catalog: &Catalog,
        profiles: &ProfileStore,
        step: u64,
        at_s: f64,
    ) -> Option<Vec<MigrationWave>> {
        let drifts = replan::drift(&self.planned, profiles, self.margin);
        if drifts.is_empty() {
            return None;
        }
        let measured =
            plan::problem_profiled(spec, catalog, &mean, &Efficiency::default(), profiles).ok()?;
        let found = search::choose(&measured)?;
        let target = Candidate {
            trainer_pool: self.running.trainer_pool,
            trainer_gpus: self.running.trainer_gpus,
            ..found.candidate
        };
        // The search ranks by its first-order objective; whether moving is worth it is judged
        // by the full prediction of both placements (regeneration, refills, drains, the loop
        // with the trainer), which a placement the first-order objective favours can lose.
        let full = |c: &Candidate| crate::growth::full_prediction(&measured, c);
        let running_step_s = full(&self.running);
        let new_plan_step_s = full(&target).unwrap_or(found.step_s);
        let worth_it = running_step_s.is_none_or(|r| new_plan_step_s < r * (1.0 - MIN_GAIN));
        let waves = if worth_it {
            let plan_waves = replan::migration(&measured, &self.running, &target, PER_WAVE);
            crate::growth::sim_waves(&measured, &self.running, &target, &plan_waves)
        } else {
            Vec::new()
        };
        self.replans.push(DriftReplan {
            step,
            at_s,
            drifts,
            running_step_s,
            new_plan_step_s,
            waves: waves.len(),
            migration: None,
        });
        // The measured shares are what the next check compares with; what runs is the new
        // plan once the waves are done (or still the old one, if it was not worth moving).
        self.planned = measured;
        if worth_it {
            self.running = target;
        }
        Some(waves)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use rollfleet_planner::profile::Origin;

    #[test]
    fn a_malformed_slowdown_is_refused_naming_what_is_wrong() {
        let text = include_str!("../../../examples/jobs/rollart-agentic.yaml");
        let job = rollfleet_spec::parse_job(text.as_bytes(), "rollart-agentic.yaml").unwrap();
        let spec = job.spec();
        assert!(
            parse("h20:1.5@3", spec)
                .unwrap_err()
                .contains("not in (0, 1)")
        );
        assert!(
            parse("h20:0@3", spec)
                .unwrap_err()
                .contains("not in (0, 1)")
        );
        assert!(parse("nope:0.5@3", spec).unwrap_err().contains("no pool"));
        let ok = parse("h20:0.5@3", spec).unwrap();
        assert_eq!((ok.share, ok.at_step), (0.5, 3));
    }

    #[test]
    fn profiles_as_planned_trigger_nothing_and_a_slower_pool_triggers_a_re_plan() {
        use rollfleet_planner::roofline::{Work, WorkKind};
        let text = include_str!("../../../examples/jobs/rollart-agentic.yaml");
        let job = rollfleet_spec::parse_job(text.as_bytes(), "rollart-agentic.yaml").unwrap();
        let mut watch = DriftWatch::new(job.spec(), &job.catalog, 0.2).unwrap();
        let work = Work {
            flops: 0.0,
            bytes: 1e9,
        };
        // Decode on the H20s at the model's 80% of peak bandwidth: no drift.
        let (peak_flops, peak_bandwidth) = (1e15, 1e12);
        let at_peak = 1e9 / peak_bandwidth;
        let mut profiles = ProfileStore::default();
        for _ in 0..64 {
            profiles.record(
                WorkKind::Decode,
                "h20",
                work,
                peak_flops,
                peak_bandwidth,
                at_peak / 0.8,
                Origin::Hardware,
            );
        }
        assert!(
            watch
                .check(job.spec(), &job.catalog, &profiles, 3, 10.0)
                .is_none()
        );
        // At 40%: the plan is made again with the measured share.
        let mut slow = ProfileStore::default();
        for _ in 0..64 {
            slow.record(
                WorkKind::Decode,
                "h20",
                work,
                peak_flops,
                peak_bandwidth,
                at_peak / 0.4,
                Origin::Hardware,
            );
        }
        assert!(
            watch
                .check(job.spec(), &job.catalog, &slow, 4, 20.0)
                .is_some()
        );
        let replan = &watch.replans[0];
        assert_eq!(replan.step, 4);
        assert_eq!(replan.drifts.len(), 1);
        assert_eq!(replan.drifts[0].pool, "h20");
        assert!((replan.drifts[0].now - 0.4).abs() < 1e-9);
        // The same measured profiles again: the new plan assumed them, so no more drift.
        assert!(
            watch
                .check(job.spec(), &job.catalog, &slow, 5, 30.0)
                .is_none()
        );
    }
}
