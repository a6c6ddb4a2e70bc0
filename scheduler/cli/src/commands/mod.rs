//! One module per subcommand; each exposes its clap `Args` and a `run` that returns an exit code.

pub mod catalog;
pub mod gpus;
pub mod job;
pub mod plan;
pub mod profile;
pub mod runtime;
pub mod serverless;
pub mod sim;
pub mod validate;
