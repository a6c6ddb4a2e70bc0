//! Losing part of a pool mid-run (`rollfleet sim --lose POOL:FRACTION@STEP`), the planner's
//! re-plan for the smaller cluster, and how fast throughput comes back.
//!
//! The loss is deterministic: as version `STEP` is published, the pool's serving replicas go,
//! highest-numbered first, until they cover `FRACTION` of its GPUs; the core is told
//! (`Input::ReplicaLost`) and reschedules their work on the survivors. The reference is the
//! smaller cluster run on its own from the start, on the planner's plan for it (the best
//! placement the planner knows for the smaller inventory), and its lower bound. Recovery is the
//! first step after the loss from which every step runs at least at [`RECOVERED`] of the
//! reference's throughput over the same steps.

use rollfleet_catalog::Catalog;
use rollfleet_planner::plan;
use rollfleet_planner::replan;
use rollfleet_planner::roofline::Efficiency;
use rollfleet_planner::search;
use rollfleet_spec::{JobSpec, PoolKind};
use serde::Serialize;

use crate::report::step_times;
use crate::sim::{LossReport, PoolLoss, RunResult};
use crate::workload::mean;

/// Share of the reference's throughput that counts as recovered.
pub const RECOVERED: f64 = 0.9;

/// Steps over which throughput is compared to call it recovered.
pub const WINDOW: usize = 3;

pub use rollfleet_fleet::migration::PER_WAVE;

/// Splits `POOL:AMOUNT@STEP` (the argument of `flag`) against a job: the index of a GPU pool
/// named so, the amount as written, and a step in 1..steps; errors name the flag, the argument
/// and the form `expected`.
pub(crate) fn pool_amount_step<'a>(
    flag: &str,
    arg: &'a str,
    expected: &str,
    spec: &JobSpec,
) -> Result<(usize, &'a str, u64), String> {
    let bad = |why: &str| format!("{flag} {arg}: {why} (expected {expected})");
    let (pool, rest) = arg.split_once(':').ok_or_else(|| bad("no ':'"))?;
    let (amount, step) = rest.split_once('@').ok_or_else(|| bad("no '@'"))?;
    let index = spec
        .pools
        .iter()
        .position(|p| p.name == pool)
        .ok_or_else(|| bad(&format!("the job has no pool \"{pool}\"")))?;
    if spec.pools[index].kind() != Some(PoolKind::Gpu) {
        return Err(bad(&format!("pool \"{pool}\" is not a GPU pool")));
    }
    let at_step: u64 = step
        .parse()
        .map_err(|_| bad(&format!("step \"{step}\" is not a whole number")))?;
    let steps = spec.rl.steps.max(0) as u64;
    if at_step == 0 || at_step >= steps {
        return Err(bad(&format!(
            "step {at_step} is not in 1..{steps} (the job's steps)"
        )));
    }
    Ok((index, amount, at_step))
}

/// Parses `POOL:FRACTION@STEP` against a job: a GPU pool's name, a share of its GPUs in (0, 1),
/// a step in 1..steps.
pub fn parse(arg: &str, spec: &JobSpec) -> Result<PoolLoss, String> {
    const FORM: &str = "POOL:FRACTION@STEP";
    let (index, fraction, at_step) = pool_amount_step("--lose", arg, FORM, spec)?;
    let bad = |why: &str| format!("--lose {arg}: {why} (expected {FORM})");
    let fraction: f64 = fraction
        .parse()
        .map_err(|_| bad(&format!("fraction \"{fraction}\" is not a number")))?;
    if !(fraction > 0.0 && fraction < 1.0) {
        return Err(bad(&format!("fraction {fraction} is not in (0, 1)")));
    }
    Ok(PoolLoss {
        pool: index as u32,
        fraction,
        at_step,
    })
}

/// The serving replicas a loss takes, given every replica's (pool, GPUs, alive) in order: the
/// pool's live ones from the highest-numbered down until they cover the lost share of its
/// `count` GPUs (a replica with any lost GPU is lost whole); with the GPUs they had.
pub fn replicas_lost(serving: &[(u32, u32, bool)], loss: &PoolLoss, count: f64) -> (Vec<u32>, u32) {
    let to_lose = (loss.fraction * count).floor() as u32;
    let mut gpus = 0;
    let mut replicas = Vec::new();
    for (r, &(pool, g, alive)) in serving.iter().enumerate().rev() {
        if gpus >= to_lose {
            break;
        }
        if pool != loss.pool || !alive {
            continue;
        }
        gpus += g;
        replicas.push(r as u32);
    }
    (replicas, gpus)
}

/// The job with the lost GPUs taken out of the pool: the smaller cluster.
pub fn smaller_spec(spec: &JobSpec, loss: &PoolLoss, gpus_lost: u32) -> JobSpec {
    let mut smaller = spec.clone();
    if let Some(p) = smaller.pools.get_mut(loss.pool as usize) {
        p.count = p.count.map(|c| (c - gpus_lost as i64).max(0));
    }
    smaller
}

/// The planner's view of the loss: the placement that survives it, the new plan for the smaller
/// cluster, and the waves between them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Replan {
    /// Predicted seconds per step of the full cluster's plan.
    pub before_step_s: f64,
    /// Predicted seconds per step of what survives the loss.
    pub survivor_step_s: Option<f64>,
    /// Predicted seconds per step of the new plan for the smaller cluster.
    pub new_plan_step_s: f64,
    /// Whether the new plan differs from the survivors (a replica or the trainer changes).
    pub changes: bool,
    /// Waves of at most [`PER_WAVE`] serving replicas from the survivors to the new plan.
    pub waves: usize,
}

/// Re-plans after the loss (GPUs as the simulator lost them, whole replicas).
pub fn replan(
    spec: &JobSpec,
    catalog: &Catalog,
    loss: &PoolLoss,
    gpus_lost: u32,
) -> Option<Replan> {
    let p = plan::problem(spec, catalog, &mean, &Efficiency::default()).ok()?;
    let found = search::choose(&p)?;
    let pool = p
        .gpu_pools
        .iter()
        .position(|g| g.spec_index == loss.pool as usize)?;
    let (smaller, survivor, new, waves) =
        replan::replan_after_loss(&p, &found.candidate, pool, gpus_lost, PER_WAVE)?;
    Some(Replan {
        before_step_s: crate::growth::full_prediction(&p, &found.candidate).unwrap_or(found.step_s),
        survivor_step_s: crate::growth::full_prediction(&smaller, &survivor),
        new_plan_step_s: crate::growth::full_prediction(&smaller, &new.candidate)
            .unwrap_or(new.step_s),
        // The candidates may list the same replicas in another order (or with empty groups):
        // what counts is whether any replica or the trainer has to change.
        changes: !waves.is_empty()
            || (new.candidate.trainer_pool, new.candidate.trainer_gpus)
                != (survivor.trainer_pool, survivor.trainer_gpus),
        waves: waves.len(),
    })
}

/// How a run's steps after a change of its cluster compare with the changed cluster run on its
/// own plan from the start (the reference), over the same steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Versus {
    /// Seconds per step before the change (steps 2..=at_step; the first is warm-up).
    pub step_s_before: f64,
    /// Seconds per step after the change (every later step).
    pub step_s_after: f64,
    /// Seconds per step of the reference over the same steps.
    pub reference_step_s: f64,
    /// Lower bound of the reference's run, seconds per step.
    pub reference_bound_s: f64,
    /// Throughput after the change over the reference's, over the same steps.
    pub share_of_reference: f64,
    /// Throughput after the change over the reference's lower bound.
    pub share_of_bound: f64,
    /// Seconds from the change to the end of the first step from which the throughput over
    /// every window of [`WINDOW`] steps is at least [`RECOVERED`] of the reference's over the
    /// same steps (`None`: never within the run).
    pub recovered_after_s: Option<f64>,
    /// Seconds of each step after the change.
    pub steps_after_s: Vec<f64>,
    /// Seconds of the same steps in the reference's run.
    pub reference_steps_after_s: Vec<f64>,
}

/// Compares a run whose cluster changed as version `at_step` was published (at `at_s`) with
/// the reference; `None` if either run is too short to compare step for step.
pub fn versus(
    publish_times_s: &[f64],
    reference_publish_times_s: &[f64],
    at_step: u64,
    at_s: f64,
    reference_bound_s: f64,
) -> Option<Versus> {
    let at = at_step as usize;
    let steps = step_times(publish_times_s);
    let reference_steps = step_times(reference_publish_times_s);
    let after = steps.get(at..)?;
    let reference_after = reference_steps.get(at..)?;
    // Both runs train the job's steps; a shorter reference cannot be compared step for step.
    if after.is_empty() || reference_after.len() < after.len() {
        return None;
    }
    let step_s_after = mean_of(after);
    let reference_step_s = mean_of(reference_after);
    Some(Versus {
        step_s_before: mean_of(steps.get(1..at).unwrap_or(&[])),
        step_s_after,
        reference_step_s,
        reference_bound_s,
        share_of_reference: reference_step_s / step_s_after.max(1e-12),
        share_of_bound: reference_bound_s / step_s_after.max(1e-12),
        recovered_after_s: at_speed_from(after, reference_after)
            .and_then(|k| publish_times_s.get(at + k))
            .map(|t| t - at_s),
        steps_after_s: after.to_vec(),
        reference_steps_after_s: reference_after.to_vec(),
    })
}

/// How the run with the loss compares with the smaller cluster's own run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recovery {
    /// The pool.
    pub pool: String,
    /// Share of its GPUs asked to be lost.
    pub fraction: f64,
    /// The step after which it was lost.
    pub at_step: u64,
    /// Virtual seconds at which it was lost.
    pub at_s: f64,
    /// Serving replicas lost.
    pub replicas_lost: usize,
    /// GPUs they had.
    pub gpus_lost: u32,
    /// Against the smaller cluster run on its own plan.
    #[serde(flatten)]
    pub versus: Versus,
    /// The planner's re-plan.
    pub replan: Option<Replan>,
}

/// The first step (index into `after`) from which the run keeps up with the reference for good:
/// step k is at speed if the run's throughput over the last [`WINDOW`] steps up to it is at least
/// [`RECOVERED`] of the reference's over the same steps (a window, because the two runs'
/// step-to-step noise is independent; the same steps, because the last step of either run is
/// long: nothing is left to overlap it with).
fn at_speed_from(after: &[f64], reference_after: &[f64]) -> Option<usize> {
    let ok: Vec<bool> = (0..after.len().min(reference_after.len()))
        .map(|k| {
            let from = k.saturating_sub(WINDOW - 1);
            let run: f64 = after[from..=k].iter().sum();
            let reference: f64 = reference_after[from..=k].iter().sum();
            reference >= RECOVERED * run
        })
        .collect();
    (0..ok.len()).find(|&k| ok[k..].iter().all(|&b| b))
}

fn mean_of(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Compares a run that lost part of a pool with the smaller cluster's own run.
pub fn recovery(
    spec: &JobSpec,
    loss: &PoolLoss,
    run: &RunResult,
    reference: &RunResult,
    reference_bound_s: f64,
    replan: Option<Replan>,
) -> Option<Recovery> {
    recovery_of(
        spec,
        loss,
        run.loss.as_ref()?,
        &run.publish_times_s,
        &reference.publish_times_s,
        reference_bound_s,
        replan,
    )
}

fn recovery_of(
    spec: &JobSpec,
    loss: &PoolLoss,
    lost: &LossReport,
    publish_times_s: &[f64],
    reference_publish_times_s: &[f64],
    reference_bound_s: f64,
    replan: Option<Replan>,
) -> Option<Recovery> {
    Some(Recovery {
        pool: spec
            .pools
            .get(loss.pool as usize)
            .map_or_else(String::new, |p| p.name.clone()),
        fraction: loss.fraction,
        at_step: loss.at_step,
        at_s: lost.at_s,
        replicas_lost: lost.replicas.len(),
        gpus_lost: lost.gpus,
        versus: versus(
            publish_times_s,
            reference_publish_times_s,
            loss.at_step,
            lost.at_s,
            reference_bound_s,
        )?,
        replan,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn recovery_is_the_first_step_from_which_every_later_step_keeps_up() {
        assert_eq!(step_times(&[10.0, 25.0, 31.0]), vec![10.0, 15.0, 6.0]);
        // Steps of 10 s, the loss after step 2 (at 20 s), then 20, 12, 10.5, 10 s.
        let publish = [10.0, 20.0, 40.0, 52.0, 62.5, 72.5];
        let lost = LossReport {
            at_s: 20.0,
            replicas: vec![7, 6],
            gpus: 16,
        };
        // The smaller cluster alone: 10 s per step.
        let reference = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
        let loss = PoolLoss {
            pool: 0,
            fraction: 0.25,
            at_step: 2,
        };
        let spec_text = include_str!("../../../examples/jobs/quickstart.yaml");
        let job = rollfleet_spec::parse_job(spec_text.as_bytes(), "quickstart.yaml").unwrap();
        let r = recovery_of(job.spec(), &loss, &lost, &publish, &reference, 8.0, None).unwrap();
        // Windows of up to 3 steps after the loss, reference over run: 10 / 20, 20 / 32, 30 /
        // 42.5 (0.71), then 30 / 32.5 (0.92 >= 0.9): recovered at the end of the sixth step,
        // 72.5 - 20 = 52.5 s after the loss.
        assert_eq!(r.versus.recovered_after_s, Some(52.5));
        assert!((r.versus.step_s_after - 52.5 / 4.0).abs() < 1e-12);
        assert!((r.versus.share_of_reference - 10.0 / (52.5 / 4.0)).abs() < 1e-12);
        assert!((r.versus.share_of_bound - 8.0 / (52.5 / 4.0)).abs() < 1e-12);
        assert_eq!(r.gpus_lost, 16);
        assert_eq!(r.versus.step_s_before, 10.0);
    }

    #[test]
    fn a_malformed_loss_is_refused_naming_what_is_wrong() {
        let spec_text = include_str!("../../../examples/jobs/quickstart.yaml");
        let job = rollfleet_spec::parse_job(spec_text.as_bytes(), "quickstart.yaml").unwrap();
        let spec = job.spec();
        let gpu = spec
            .pools
            .iter()
            .find(|p| p.kind() == Some(PoolKind::Gpu))
            .unwrap()
            .name
            .clone();
        let cpu = spec
            .pools
            .iter()
            .find(|p| p.kind() == Some(PoolKind::Cpu))
            .unwrap()
            .name
            .clone();
        assert!(parse("nope", spec).unwrap_err().contains("no ':'"));
        assert!(
            parse("x:0.3@2", spec)
                .unwrap_err()
                .contains("no pool \"x\"")
        );
        assert!(
            parse(&format!("{cpu}:0.3@2"), spec)
                .unwrap_err()
                .contains("not a GPU pool")
        );
        assert!(
            parse(&format!("{gpu}:1.5@2"), spec)
                .unwrap_err()
                .contains("not in (0, 1)")
        );
        assert!(
            parse(&format!("{gpu}:0.3@0"), spec)
                .unwrap_err()
                .contains("step 0")
        );
        let ok = parse(&format!("{gpu}:0.5@2"), spec).unwrap();
        assert_eq!(ok.fraction, 0.5);
        assert_eq!(ok.at_step, 2);
    }
}
