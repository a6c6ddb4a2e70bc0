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
//! for the next check. The trainer stays on its pool and may be resized there.

use rollfleet_catalog::Catalog;
use rollfleet_planner::plan;
use rollfleet_planner::predict::{Candidate, Problem};
use rollfleet_planner::profile::ProfileStore;
use rollfleet_planner::replan;
use rollfleet_planner::roofline::{Efficiency, WorkKind};
use rollfleet_planner::search;
use rollfleet_spec::JobSpec;
use serde::Serialize;

use crate::loss::PER_WAVE;
use crate::sim::{MigrationReport, MigrationWave};
use crate::workload::mean;

pub use rollfleet_fleet::migration::MIN_GAIN;

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

/// What a drift check at a publication found ([`DriftWatch::check`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DriftCheck {
    /// Per pool that drifted for the first time, the kinds of work whose measured samples to
    /// forget (they may describe the hardware as it was).
    pub forget: Vec<(String, Vec<WorkKind>)>,
    /// Planned again: the waves to the new plan (empty when moving is not worth it). `None`:
    /// no re-plan (nothing drifted, or waiting for fresh samples).
    pub waves: Option<Vec<MigrationWave>>,
}

/// One re-plan on drift.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DriftReplan {
    /// The version whose publication triggered it (fresh samples were in).
    pub step: u64,
    /// The version at which the drift was first seen, and the drifted pools' samples forgotten.
    pub seen_at_step: u64,
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
    settling: replan::Settling,
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
            settling: replan::Settling::default(),
            replans: Vec::new(),
        })
    }

    /// At a publication: if a profile drifted past the margin, the estimates of the drifted
    /// pools' other kinds of work are forgotten first ([`DriftCheck::forget`]: the caller
    /// forgets them in its own store) and the re-plan waits for fresh samples of those that
    /// were trusted ([`replan::Settling`]); then, if the drift is still there, the planner
    /// plans again with the measured profiles and the waves to the new plan are returned (none
    /// if it does not save [`MIN_GAIN`] of the running placement's predicted step).
    pub fn check(
        &mut self,
        spec: &JobSpec,
        catalog: &Catalog,
        profiles: &ProfileStore,
        step: u64,
        at_s: f64,
    ) -> DriftCheck {
        let mut out = DriftCheck::default();
        let drifts = replan::drift(&self.planned, profiles, self.margin);
        let restarted;
        let profiles = match self.settling.check(&drifts, profiles, step) {
            replan::Settle::Quiet | replan::Settle::Waiting => return out,
            replan::Settle::Restart { forget, wait } => {
                let mut store = profiles.clone();
                for (pool, kinds) in &forget {
                    for &kind in kinds {
                        store.restart(kind, pool);
                    }
                }
                out.forget = forget;
                if wait {
                    return out;
                }
                restarted = store;
                &restarted
            }
            replan::Settle::Ready => profiles,
        };
        let seen_at_step = self.settling.take_seen().unwrap_or(step);
        let drifts = replan::drift(&self.planned, profiles, self.margin);
        if drifts.is_empty() {
            return out;
        }
        let Ok(measured) =
            plan::problem_profiled(spec, catalog, &mean, &Efficiency::default(), profiles)
        else {
            return out;
        };
        let Some(found) = search::choose(&measured)
            .and_then(|found| replan::on_trainer_pool(&measured, &self.running, found))
        else {
            return out;
        };
        let target = found.candidate;
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
            seen_at_step,
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
        out.waves = Some(waves);
        out
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

    fn rollart_job() -> rollfleet_spec::ValidatedJob {
        let text = include_str!("../../../examples/jobs/rollart-agentic.yaml");
        rollfleet_spec::parse_job(text.as_bytes(), "rollart-agentic.yaml").unwrap()
    }

    /// 64 samples on the H20s (peaks of 1 PFLOP/s and 1 TB/s): decode at `decode` of peak
    /// bandwidth and, if given, prefill at `prefill` of peak FLOP/s.
    fn h20_samples(decode: f64, prefill: Option<f64>) -> ProfileStore {
        use rollfleet_planner::roofline::Work;
        let (peak_flops, peak_bandwidth) = (1e15, 1e12);
        let mut store = ProfileStore::default();
        for _ in 0..64 {
            let bytes = Work {
                flops: 0.0,
                bytes: 1e9,
            };
            let seconds = 1e9 / peak_bandwidth / decode;
            let kind = WorkKind::Decode;
            store.record(
                kind,
                "h20",
                bytes,
                peak_flops,
                peak_bandwidth,
                seconds,
                Origin::Hardware,
            );
            if let Some(share) = prefill {
                let flops = Work {
                    flops: 1e15,
                    bytes: 1.0,
                };
                let seconds = 1e15 / peak_flops / share;
                let kind = WorkKind::Prefill;
                store.record(
                    kind,
                    "h20",
                    flops,
                    peak_flops,
                    peak_bandwidth,
                    seconds,
                    Origin::Hardware,
                );
            }
        }
        store
    }

    #[test]
    fn profiles_as_planned_trigger_nothing_and_a_slower_pool_re_plans_once_fresh_samples_are_in() {
        let job = rollart_job();
        let mut watch = DriftWatch::new(job.spec(), &job.catalog, 0.2).unwrap();
        // Decode on the H20s at the model's 80% of peak bandwidth: no drift.
        assert_eq!(
            watch.check(job.spec(), &job.catalog, &h20_samples(0.8, None), 3, 10.0),
            DriftCheck::default()
        );
        // At 40%, with a trusted prefill estimate from before: the prefill samples are
        // forgotten, and the plan waits for fresh ones.
        let slow = h20_samples(0.4, Some(0.6));
        let checked = watch.check(job.spec(), &job.catalog, &slow, 4, 20.0);
        assert_eq!(
            checked,
            DriftCheck {
                forget: vec![("h20".into(), vec![WorkKind::Prefill])],
                waves: None
            }
        );
        assert_eq!(
            watch.check(job.spec(), &job.catalog, &h20_samples(0.4, None), 5, 25.0),
            DriftCheck::default()
        );
        assert!(watch.replans.is_empty());
        // Fresh prefill samples, slowed alike: the plan is made again with both measured shares.
        let fresh = h20_samples(0.4, Some(0.24));
        assert!(
            watch
                .check(job.spec(), &job.catalog, &fresh, 6, 30.0)
                .waves
                .is_some()
        );
        let replan = &watch.replans[0];
        assert_eq!((replan.seen_at_step, replan.step), (4, 6));
        let kinds: Vec<(&str, WorkKind)> = replan
            .drifts
            .iter()
            .map(|d| (d.pool.as_str(), d.kind))
            .collect();
        assert_eq!(
            kinds,
            vec![("h20", WorkKind::Prefill), ("h20", WorkKind::Decode)]
        );
        // The same measured profiles again: the new plan assumed them, so no more drift.
        assert_eq!(
            watch.check(job.spec(), &job.catalog, &fresh, 7, 40.0),
            DriftCheck::default()
        );
    }

    #[test]
    fn a_pool_that_drifts_with_nothing_else_measured_re_plans_at_once() {
        let job = rollart_job();
        let mut watch = DriftWatch::new(job.spec(), &job.catalog, 0.2).unwrap();
        let checked = watch.check(job.spec(), &job.catalog, &h20_samples(0.4, None), 2, 1.0);
        assert!(checked.waves.is_some(), "{checked:?}");
        assert_eq!(watch.replans.len(), 1);
        assert_eq!(watch.replans[0].seen_at_step, 2);
    }
}
