//! rollfleet's reward functions: pure, stateless scorers for agentic RL trajectories.
//!
//! - [`math`]: exact and normalised answer matching (numbers, fractions, LaTeX `\boxed{}`);
//! - [`format`]: format and regex rewards;
//! - [`sandbox`]: running model-written Python against unit tests in a limited subprocess;
//! - [`functions`]: the same rewards as named Lambda-style handlers (JSON in, JSON out), used by
//!   the local Lambda host and by the AWS custom-runtime `bootstrap`.
//!
//! No async runtime and no AWS dependency here, so the rewards can be embedded anywhere.

pub mod format;
pub mod functions;
pub mod math;
pub mod sandbox;

pub use functions::{FunctionError, Handler, RewardFunction};
pub use sandbox::{Sandbox, SandboxLimits};
