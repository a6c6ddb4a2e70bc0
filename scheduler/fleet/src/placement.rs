//! Which placement a job runs on: the planner's (the default, and the one a real run takes), or,
//! in a simulated run, a fixed one to compare with it (`--placement default|uniform|best-gpu|plan`).
//!
//! In the simulator, the `sync` baseline always keeps its own colocated placement (that is what
//! it models); every other policy runs on the chosen one.

use rollfleet_catalog::Catalog;
use rollfleet_core::{Placement, default_placement};
use rollfleet_planner::plan::{self, PlanError};
use rollfleet_planner::predict::predict;
use rollfleet_planner::roofline::Efficiency;
use rollfleet_planner::{Candidate, Prediction, Problem, compare, search};
use rollfleet_spec::JobSpec;

use crate::workload::{mean, workload_means};

/// A placement to simulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
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
    choose_planned(choice, spec, catalog).map(|c| (c.placement, c.prediction))
}

/// A placement chosen, and what the planner needs to predict it again for another admission
/// window (the window is chosen on the placement, so the placement stays).
#[derive(Debug, Clone)]
pub struct Chosen {
    /// The placement.
    pub placement: Placement,
    /// The planner's prediction of it, for the core's rule, when the planner's model made it.
    pub prediction: Option<Prediction>,
    planned: Option<(Problem, Candidate)>,
}

impl Chosen {
    /// The planner's prediction of the placement with the core's admission window widened by
    /// `quarters` quarters of a rollout batch (narrowed when negative:
    /// `Policy::window_widening_quarters`); `None` where the planner's model did not make the
    /// placement.
    pub fn predicted_widened(&self, quarters: i32) -> Option<Prediction> {
        let (problem, candidate) = self.planned.as_ref()?;
        let mut problem = problem.clone();
        problem.workload.window_widening_quarters = quarters;
        predict(&problem, candidate)
    }
}

/// [`choose`], keeping what predicts the placement again ([`Chosen::predicted_widened`]).
pub fn choose_planned(
    choice: PlacementChoice,
    spec: &JobSpec,
    catalog: &Catalog,
) -> Result<Chosen, ChoiceError> {
    if choice == PlacementChoice::Default {
        return Ok(Chosen {
            placement: default_placement(spec, catalog, &workload_means(spec))?,
            prediction: None,
            planned: None,
        });
    }
    let p = plan::problem(spec, catalog, &mean, &Efficiency::default())?;
    let found = match choice {
        PlacementChoice::Uniform => compare::uniform(&p),
        PlacementChoice::BestGpu => compare::best_gpu(&p),
        _ => search::choose(&p),
    }
    .ok_or_else(|| PlanError::Infeasible(format!("no {} placement can run it", choice.name())))?;
    let described = plan::describe(spec, &p, &found.candidate, found.nodes)?;
    Ok(Chosen {
        placement: described.placement,
        prediction: Some(described.prediction),
        planned: Some((p, found.candidate)),
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
    fn the_planners_placement_comes_with_its_prediction_and_the_default_rules_without() {
        let job = job();
        let (planned, prediction) =
            choose(PlacementChoice::Plan, job.spec(), &job.catalog).unwrap();
        assert!(!planned.replicas.is_empty());
        assert!(prediction.is_some_and(|p| p.step_s > 0.0));
        let (default, prediction) =
            choose(PlacementChoice::Default, job.spec(), &job.catalog).unwrap();
        assert!(!default.replicas.is_empty());
        assert!(prediction.is_none());
    }

    #[test]
    fn best_gpu_puts_every_replica_and_the_trainer_on_the_most_powerful_gpus() {
        let job = job();
        let (placement, _) = choose(PlacementChoice::BestGpu, job.spec(), &job.catalog).unwrap();
        // The job's first pool is its H800s, the most powerful GPUs it has.
        assert_eq!(job.spec().pools[0].gpu.as_deref(), Some("H800"));
        assert!(
            placement.replicas.iter().all(|r| r.pool == 0),
            "{placement:?}"
        );
        assert_eq!(placement.trainer.pool, 0);
    }

    #[test]
    fn a_choice_is_named_as_the_command_line_spells_it() {
        let names: Vec<&str> = [
            PlacementChoice::Plan,
            PlacementChoice::Default,
            PlacementChoice::Uniform,
            PlacementChoice::BestGpu,
        ]
        .map(PlacementChoice::name)
        .to_vec();
        assert_eq!(names, ["plan", "default", "uniform", "best-gpu"]);
        assert_eq!(PlacementChoice::default(), PlacementChoice::Plan);
    }
}
