//! The reward invoker used by the scheduler: reward requests turned into AWS Lambda Invoke
//! calls through the real aws-sdk-lambda, against AWS Lambda or any server that speaks the
//! Invoke API (the local `rollfleet serverless serve` host, serverless-offline).
//!
//! - [`config`]: endpoint, per-function timeouts and memory, retry policy, concurrency;
//! - [`invoker`]: [`RewardInvoker::invoke`], with retries, idempotency and accounting;
//! - [`metrics`]: Prometheus metrics and the run-summary totals;
//! - [`report`]: the `REPORT` log line (cold starts, billed duration).

pub mod config;
pub mod invoker;
pub mod metrics;
pub mod report;

pub use config::{FunctionSettings, InvokerConfig, RetryPolicy};
pub use invoker::{
    Delivery, InvokeError, InvokerError, Reward, RewardInvoker, RewardOutcome, RewardRequest,
    lambda_client,
};
pub use metrics::{InvocationSummary, InvokerMetrics};
