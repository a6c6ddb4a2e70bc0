//! rollfleet's discrete-event simulator: the scheduler core on a virtual clock.
//!
//! `rollfleet sim JOB.yaml` answers "what would this hardware do for my workload, and how much
//! better is rollfleet than the usual ways of running RL?" It drives the very same
//! [`rollfleet_core::Core`] the server runs, against hardware models of its own
//! ([`hardware`]), a workload sampled from the job spec and real traces ([`workload`]), and
//! compares rollfleet with the synchronous, one-step-off and AReaL-like baselines ([`baseline`]),
//! with each run's lower bound ([`bound`]) and with one fixed bound per job and seed
//! ([`reference`]). [`report`] turns runs into tables, JSON and an SVG timeline; [`cli`]
//! is the entry point the `rollfleet` binary calls.

pub mod baseline;
pub mod best;
pub mod bound;
pub mod cli;
pub mod drift;
pub mod growth;
pub mod loss;
mod queue;
pub mod reference;
pub mod report;
pub mod sim;
pub mod svg;
pub mod window;

// The hardware model, the placement choice and the workload model are shared with the scheduler
// and the workers (`rollfleet-fleet`); re-exported here for the simulator's own
// callers.
pub use rollfleet_fleet::{hardware, placement, workload};

pub use baseline::Baseline;
pub use cli::{OutputFormat, SimArgs, SimError, run};
pub use placement::PlacementChoice;
pub use report::{PolicyReport, SimReport};
pub use sim::{RunError, RunResult, SimOptions, simulate};
