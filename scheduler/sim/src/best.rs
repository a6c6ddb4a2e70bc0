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
//!   work kind);
//! - `rollfleet` runs on the placement `--placement` names (the planner's, by default).
//!
//! Where a policy has several candidates, each is simulated for the job's first
//! [`PROBE_STEPS`] steps with the run's seed, and the fastest per step is kept (the first on a
//! tie). The probes are part of the report, so the choice can be checked.

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

/// One placement a policy may run on.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// How reports name it (`tp 8`, `plan`, `default`, `uniform`).
    pub label: String,
    /// The placement.
    pub placement: Placement,
}

/// A candidate's probe: its seconds per step over the first [`PROBE_STEPS`] steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Probe {
    /// The candidate's label.
    pub label: String,
    /// Simulated seconds per step over the probe.
    pub step_s: f64,
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
    };
    let mut out = match baseline {
        Baseline::Sync => colocated_degrees(spec, catalog)?
            .into_iter()
            .map(|tp| {
                Ok(Candidate {
                    label: format!("tp {tp}"),
                    placement: colocated_placement_at(spec, catalog, tp)?,
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
        Baseline::ArealLike => vec![candidate("uniform", uniform)],
        Baseline::Rollfleet => vec![candidate(chosen_label, chosen)],
    };
    // The same placement under two names is probed once, under its first name.
    let mut unique: Vec<Candidate> = Vec::with_capacity(out.len());
    for c in out.drain(..) {
        if !unique.iter().any(|u| u.placement == c.placement) {
            unique.push(c);
        }
    }
    Ok(unique)
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
    probe_spec.rl.steps = spec.rl.steps.clamp(1, PROBE_STEPS);
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
        let (placement, policy) = baseline.setup_with(&probe_spec, catalog, c.placement.clone())?;
        let run = simulate(
            &probe_spec,
            catalog,
            placement,
            policy,
            &probe_opts,
            &mut |_, _| {},
        )?;
        let step_s = run.makespan_s / run.publish_times_s.len().max(1) as f64;
        if best.is_none_or(|(_, b)| step_s < b) {
            best = Some((i, step_s));
        }
        probes.push(Probe {
            label: c.label.clone(),
            step_s,
        });
    }
    let (i, _) = best.unwrap_or((0, 0.0));
    let chosen = candidates
        .into_iter()
        .nth(i)
        .ok_or(PlacementError::NoServing)?;
    Ok((chosen, probes))
}
