//! A local function host that speaks the AWS Lambda Invoke API, serving rollfleet's reward
//! functions. It is the embedded default for rewards (`rollfleet serverless serve`), and lets
//! the same invoker code talk to a laptop, CI, or real AWS Lambda by changing one endpoint URL.
//!
//! - [`config`]: functions, limits (payload, concurrency, event queue, connections), faults, and
//!   the CLI arguments ([`ServeArgs`]);
//! - [`server`]: the HTTP server ([`serve`], [`run`], and [`LocalHost`] for embedding);
//! - [`stats`]: host-side counters.
//!
//! The host does not verify SigV4 signatures (any credentials are accepted), so it listens on
//! loopback by default.

pub mod config;
pub mod server;
pub mod stats;

pub use config::{
    CustomFunction, DEFAULT_BODY_READ_TIMEOUT, DEFAULT_CONCURRENCY_PER_FUNCTION,
    DEFAULT_EVENT_MAX_AGE, DEFAULT_EVENT_QUEUE_BYTES, DEFAULT_EVENT_QUEUE_EVENTS,
    DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_MAX_CONNECTIONS, FaultConfig, FunctionCode,
    FunctionConfig, FunctionFuture, HostConfig, MAX_EVENT_PAYLOAD, MAX_SYNC_PAYLOAD, ServeArgs,
};
pub use server::{HostError, LocalHost, run, serve};
pub use stats::{HostStats, HostStatsSnapshot};
