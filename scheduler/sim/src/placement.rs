//! Which placement a simulated run uses: the planner's (the default), or a fixed one to compare
//! with it (`--placement default|uniform|best-gpu|plan`).
//!
//! The `sync` baseline always keeps its own colocated placement (that is what it models); every
//! other policy runs on the chosen one.

use rollfleet_catalog::Catalog;
use rollfleet_core::{Placement, default_placement};
use rollfleet_planner::plan::{self, PlanError};
use rollfleet_planner::roofline::Efficiency;
use rollfleet_planner::{Prediction, compare, search};
use rollfleet_spec::JobSpec;

use crate::sim::workload_means;
use crate::workload::mean;

/// A placement to simulate.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum PlacementChoice {
    /// The planner's choice: the exact optimum of its search's objective, or RollArt's affinity
    /// placement when the full prediction says it is faster (`search::choose`).
    #[default]
    Plan,
    /// The core's stand-in rule: the highest ridge point prefills and trains, the rest decode.
    Default,
    /// Every role spread evenly over all GPUs (the best such placement by the planner's model).
    Uniform,
    /// Everything on the most powerful GPU product; the other GPU pools idle.
    BestGpu,
}

impl PlacementChoice {
    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            PlacementChoice::Plan => "plan",
            PlacementChoice::Default => "default",
            PlacementChoice::Uniform => "uniform",
            PlacementChoice::BestGpu => "best-gpu",
        }
    }
}

/// Why no placement was found.
#[derive(Debug, thiserror::Error)]
pub enum ChoiceError {
    /// The planner found none.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The default rule found none.
    #[error(transparent)]
    Default(#[from] rollfleet_core::PlacementError),
}

/// The placement, and the planner's prediction for it when the planner's model made it.
pub fn choose(
    choice: PlacementChoice,
    spec: &JobSpec,
    catalog: &Catalog,
) -> Result<(Placement, Option<Prediction>), ChoiceError> {
    if choice == PlacementChoice::Default {
        return Ok((
            default_placement(spec, catalog, &workload_means(spec))?,
            None,
        ));
    }
    let p = plan::problem(spec, catalog, &mean, &Efficiency::default())?;
    let found = match choice {
        PlacementChoice::Uniform => compare::uniform(&p),
        PlacementChoice::BestGpu => compare::best_gpu(&p),
        _ => search::choose(&p),
    }
    .ok_or_else(|| PlanError::Infeasible(format!("no {} placement can run it", choice.name())))?;
    let described = plan::describe(spec, &p, &found.candidate, found.nodes)?;
    Ok((described.placement, Some(described.prediction)))
}
