//! What a rollfleet run and its simulation must decide alike, in one sans-IO crate.
//!
//! The scheduler server, the node and engine workers and the simulator all build on these pure,
//! deterministic functions, so that a real run and `rollfleet sim` of the same job and seed make
//! the same decisions, and so that the production binaries need not link the simulator:
//!
//! - [`hardware`]: the roofline model of inference replicas ([`hardware::Engine`]) and the
//!   model's per-token costs ([`hardware::model_costs`]), which emulated engines run too;
//! - [`workload`]: the distributions of the job spec, their means and draws;
//! - [`placement`]: which placement a job runs on ([`placement::choose`]);
//! - [`plan`]: the planned job, as the scheduler and every worker derive it from the job YAML;
//! - [`migration`]: the waves that move a running placement to a new plan.
//!
//! No I/O, no wall clock, no threads: like the core, it builds and tests in seconds.

pub mod failure;
pub mod hardware;
pub mod migration;
pub mod placement;
pub mod plan;
pub mod workload;

pub use placement::{ChoiceError, Chosen, PlacementChoice, choose, choose_planned};
pub use plan::{JobPlan, PlanError, PoolRole};
