//! Every policy at its best under its own rules: the placements each may choose from, and the
//! choice among them by simulating the job's first steps.
//!
//! A comparison is only fair if each baseline runs as well as its own rules allow, not on a
//! placement tuned for rollfleet. The rules:
//! - `sync` is colocated on the GPU pool with the most FLOP/s; it chooses its tensor-parallel
//!   degree, from the smallest that fits the model up to a node ([`colocated_degrees`]);
//! - `sync-disaggregated` and `one-step-off` choose the best of the disaggregated placements
//!   the simulator knows: the one `--placement` names, the core's default rule, and the
//!   planner's best uniform placement;
//! - `areal-like` generates on the planner's best uniform placement (AReaL has no placement by
//!   work kind) and chooses its staleness bound, from 1 up to the job's (at most
//!   [`MAX_STALENESS_PROBED`] values): AReaL's window of trajectories in flight grows with the
//!   bound, and a wider one can be slower (every replica updates at once and each trajectory
//!   alive then recomputes its KV cache), so a user of AReaL would tune it;
//! - `rollfleet` runs on the placement `--placement` names (the planner's, by default).
//!
//! Where a policy has several candidates, each is simulated for the job's first
//! [`PROBE_STEPS`] steps ([`STALENESS_PROBE_STEPS`] when they differ in staleness) with the
//! run's seed, and the fastest per step between its first and
//! last publication is kept (the first on a tie). The probes are part of the report, so the choice can be checked.

use rollfleet_catalog::Catalog;
use rollfleet_core::{
    Placement, PlacementError, colocated_degrees, colocated_placement_at, default_placement,
};
use rollfleet_spec::JobSpec;
use serde::Serialize;

use crate::baseline::Baseline;
use crate::sim::{RunError, SimOptions, simulate, workload_means};

/// Steps each candidate placement is simulated for before a policy chooses.
pub const PROBE_STEPS: i64 = 3;

/// Staleness bounds `areal-like` probes at most (1 and up).
pub const MAX_STALENESS_PROBED: i64 = 4;

/// Steps each staleness bound is simulated for: a bound shows in the steps after the window
/// has filled, which the first [`PROBE_STEPS`] do not reach (on the RollArt-like job they ranked
/// a bound of 2 ahead of 1, and 20 steps ran 45% slower at 2).
pub const STALENESS_PROBE_STEPS: i64 = 8;

/// One placement a policy may run on.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// How reports name it (`tp 8`, `plan`, `default`, `uniform`).
    pub label: String,
    /// The placement.
    pub placement: Placement,
    /// A staleness bound tighter than the job's that the policy runs at (`None`: the job's).
    pub max_staleness: Option<i64>,
}

/// A candidate's probe: its seconds per step over the first [`PROBE_STEPS`] steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Probe {
    /// The candidate's label.
    pub label: String,
    /// Simulated seconds per step over the probe, between its first and last publication.
    pub step_s: f64,
    /// Simulated seconds the whole probe took.
    pub total_s: f64,
}

/// Why a policy could not choose its placement.
#[derive(Debug, thiserror::Error)]
pub enum ChoiceFailed {
    /// A candidate placement could not be made or set up.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// A probe run failed.
    #[error("probing a placement: {0}")]
    Run(#[from] RunError),
}

/// The placements `baseline` may choose from, under its own rules (see the module docs).
/// `chosen` is the placement `--placement` names, labelled `chosen_label`; `uniform` is the
/// planner's best uniform placement.
pub fn candidates(
    baseline: Baseline,
    spec: &JobSpec,
    catalog: &Catalog,
    (chosen_label, chosen): (&str, &Placement),
    uniform: &Placement,
) -> Result<Vec<Candidate>, PlacementError> {
    let candidate = |label: &str, placement: &Placement| Candidate {
        label: label.to_owned(),
        placement: placement.clone(),
        max_staleness: None,
    };
    let mut out = match baseline {
        Baseline::Sync => colocated_degrees(spec, catalog)?
            .into_iter()
            .map(|tp| {
                Ok(Candidate {
                    label: format!("tp {tp}"),
                    placement: colocated_placement_at(spec, catalog, tp)?,
                    max_staleness: None,
                })
            })
            .collect::<Result<Vec<_>, PlacementError>>()?,
        Baseline::SyncDisaggregated | Baseline::OneStepOff => vec![
            candidate(chosen_label, chosen),
            candidate(
                "default",
                &default_placement(spec, catalog, &workload_means(spec))?,
            ),
            candidate("uniform", uniform),
        ],
        Baseline::ArealLike => {
            let bound = spec.rl.max_staleness;
            let mut tighter: Vec<Candidate> = (1..bound.min(MAX_STALENESS_PROBED + 1))
                .map(|s| Candidate {
                    label: format!("uniform at staleness {s}"),
                    max_staleness: Some(s),
                    ..candidate("uniform", uniform)
                })
                .collect();
            tighter.push(candidate("uniform", uniform));
            tighter
        }
        Baseline::Rollfleet => vec![candidate(chosen_label, chosen)],
    };
    // The same placement under two names is probed once, under its first name.
    let mut unique: Vec<Candidate> = Vec::with_capacity(out.len());
    for c in out.drain(..) {
        if !unique
            .iter()
            .any(|u| u.placement == c.placement && u.max_staleness == c.max_staleness)
        {
            unique.push(c);
        }
    }
    Ok(unique)
}

/// Steps each of `candidates` is probed for (at most; fewer when the job has fewer).
pub fn probe_steps(candidates: &[Candidate]) -> i64 {
    if candidates.iter().any(|c| c.max_staleness.is_some()) {
        STALENESS_PROBE_STEPS
    } else {
        PROBE_STEPS
    }
}

/// A probe's seconds per step: between its first publication and its last, so that the start
/// (the same for every candidate, and longest where the window is widest) does not decide;
/// over the whole run when it published once.
fn probe_step_s(makespan_s: f64, publish_times_s: &[f64]) -> f64 {
    match publish_times_s {
        [first, .., last] => (last - first) / (publish_times_s.len() - 1) as f64,
        _ => makespan_s / publish_times_s.len().max(1) as f64,
    }
}

/// The fastest of `candidates` for `baseline` over the job's first steps, and every probe (none
/// when there is only one candidate: nothing to choose).
pub fn pick(
    baseline: Baseline,
    spec: &JobSpec,
    catalog: &Catalog,
    candidates: Vec<Candidate>,
    opts: &SimOptions,
) -> Result<(Candidate, Vec<Probe>), ChoiceFailed> {
    if candidates.len() <= 1 {
        let only = candidates
            .into_iter()
            .next()
            .ok_or(PlacementError::NoServing)?;
        return Ok((only, Vec::new()));
    }
    let mut probe_spec = spec.clone();
    probe_spec.rl.steps = spec.rl.steps.clamp(1, probe_steps(&candidates));
    let probe_opts = SimOptions {
        pool_loss: None,
        migration: None,
        slowdown: None,
        replan_on_drift: None,
        ..opts.clone()
    };
    let mut probes = Vec::with_capacity(candidates.len());
    let mut best: Option<(usize, f64)> = None;
    for (i, c) in candidates.iter().enumerate() {
        let mut probe_spec = probe_spec.clone();
        if let Some(bound) = c.max_staleness {
            probe_spec.rl.max_staleness = bound;
        }
        let (placement, policy) = baseline.setup_with(&probe_spec, catalog, c.placement.clone())?;
        let run = simulate(
            &probe_spec,
            catalog,
            placement,
            policy,
            &probe_opts,
            &mut |_, _| {},
        )?;
        let step_s = probe_step_s(run.makespan_s, &run.publish_times_s);
        if best.is_none_or(|(_, b)| step_s < b) {
            best = Some((i, step_s));
        }
        probes.push(Probe {
            label: c.label.clone(),
            step_s,
            total_s: run.makespan_s,
        });
    }
    let (i, _) = best.unwrap_or((0, 0.0));
    let chosen = candidates
        .into_iter()
        .nth(i)
        .ok_or(PlacementError::NoServing)?;
    Ok((chosen, probes))
}
