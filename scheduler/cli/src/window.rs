//! The scheduler's admission-window chooser: the simulator's choice (`rollfleet_sim::window`),
//! given to the scheduler server, which does not link the simulator itself.

use rollfleet_server::JobPlan;
use rollfleet_server::job::WindowChooser;
use rollfleet_sim::SimOptions;
use rollfleet_sim::window::{TUNING_SEEDS, WIDENINGS, choose_window, widening_label};

/// Chooses a job's admission window by simulating it on its plan, with the plan's seed and
/// modelled hardware, as `rollfleet sim` and `rollfleet plan` do.
#[derive(Debug)]
pub struct SimulatedWindow;

impl WindowChooser for SimulatedWindow {
    fn widening_quarters(&self, plan: &JobPlan) -> Result<i32, String> {
        let opts = SimOptions {
            seed: plan.config.seed,
            hardware: plan.hardware,
            ..SimOptions::default()
        };
        tracing::info!(
            job = plan.name(),
            "choosing the admission window: simulating the job at {} widths or more on {} seeds",
            WIDENINGS.len(),
            TUNING_SEEDS
        );
        let choice = choose_window(
            plan.spec(),
            plan.catalog(),
            &plan.placement,
            plan.policy(),
            &opts,
        )
        .map_err(|e| format!("simulating the job to choose it: {e}"))?;
        tracing::info!(
            job = plan.name(),
            "admission window: {} (simulated seconds per step: {})",
            widening_label(choice.widening_quarters),
            choice.describe()
        );
        Ok(choice.widening_quarters)
    }
}
