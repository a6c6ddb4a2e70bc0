//! rollfleet's profiler and hardware-affinity planner: which work goes on which hardware, and how
//! much of it.
//!
//! - [`roofline`]: model-based profiles, the FLOPs and bytes of prefill, decode, training and
//!   weight transfer against each GPU's ridge point, which say why decode goes to an H20 and
//!   prefill to an H800;
//! - [`workload`]: the job's per-task averages (and the slowest member of a group);
//! - [`predict`]: the predicted RL step time of a placement (capacity, latency through the core's
//!   admission window, staleness), per-pool utilisation and cost;
//! - [`search`]: the exact branch-and-bound search for the placement with the shortest predicted
//!   step, and the brute force it is tested against;
//! - [`plan`]: the problem built from a job spec, the plan as the core's `Placement`, and the
//!   explanation of every role;
//! - [`compare`]: the `uniform` and `best-gpu` placements the plan is measured against;
//! - [`profile`]: measured and probed profiles, their precedence over the model, and the store
//!   `rollfleet profile` saves and loads;
//! - [`cancel`]: giving up on a plan midway, when its caller has to stop;
//! - [`replan`]: drift detection, the placement that survives a pool's loss, the new plan, and
//!   the gradual migration between them.
//!
//! The crate is pure and deterministic (no clock, no randomness, no hash-order iteration): the
//! same job gives the same plan, byte for byte.

pub mod cancel;
pub mod compare;
pub mod plan;
pub mod predict;
pub mod profile;
pub mod replan;
pub mod roofline;
pub mod search;
pub mod workload;

pub use plan::{Inventory, Plan, PlanError, plan};
pub use predict::{Candidate, Prediction, Problem};
