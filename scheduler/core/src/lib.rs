//! rollfleet's scheduler core: a sans-IO, deterministic state machine.
//!
//! Facts come in with a timestamp ([`Core::handle_input`], [`Core::handle_timeout`]), commands
//! come out ([`Core::poll_command`]), and the core says when it next wants to be woken
//! ([`Core::poll_timeout`]), in the style of quinn-proto. It has no clock, threads, OS randomness,
//! I/O or hash-order iteration (only `Vec`, `BTreeMap` and `BTreeSet`), and owns a seeded
//! generator ([`rng::SplitMix64`]); the same configuration and the same inputs always give the
//! same commands. The simulator drives it on a virtual clock, the server (a later issue) on the
//! wall clock, with the very same decisions.
//!
//! - [`protocol`]: the plain-data inputs and commands (what the server carries over gRPC);
//! - [`config`]: the numbers the core runs on, and the [`config::Policy`] that turns it into
//!   rollfleet or into one of the baselines;
//! - [`placement`]: the default placement of roles on GPU pools (a pure function a planner can
//!   replace);
//! - `router`: the pure routing function (crate-private);
//! - [`scheduler`]: the state machine itself;
//! - [`slab`]: the id-keyed slab the core keeps its stages in, public because the simulator
//!   keeps its own records in one too; the other utilities (`idset`, `lru`) are crate-private.

pub mod config;
pub(crate) mod idset;
pub(crate) mod lru;
pub mod placement;
pub mod protocol;
/// The seeded generator, re-exported so the simulator draws from the same implementation.
pub use rollfleet_rng as rng;
pub(crate) mod router;
pub mod scheduler;
pub mod slab;
pub mod time;

pub use config::{Config, ConfigError, Discipline, Policy, RewardRoute, TaskLimits};
pub use placement::{
    Placement, PlacementError, ReplicaConfig, ServeRole, TrainerConfig, WorkloadMeans,
    colocated_degrees, colocated_placement, colocated_placement_at, default_placement,
};
pub use protocol::{
    BatchId, Command, GroupId, Input, PoolIndex, ReplicaId, StageCommand, StageId, StageOutcome,
    StageWork, SyncMode, TrajId, Version,
};
pub use scheduler::{AdmissionTerms, Core, Stats, TaskLives};
pub use time::{Span, Time};
