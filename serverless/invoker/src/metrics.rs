//! Prometheus metrics of reward invocations, registered into a caller-supplied registry, and
//! the plain-number summary that goes into a run summary.
//!
//! Cost is counted the way Lambda bills it: billed duration (from the `REPORT` line when the
//! server sends one, else the client-observed duration rounded up to the millisecond) times
//! memory size, in GB-seconds.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

/// Invocation metrics, labelled by function name.
#[derive(Debug, Clone)]
pub struct InvokerMetrics {
    /// Every HTTP call made, by `outcome`: `success`, `function_error`, `throttled`,
    /// `timeout`, `transient_error`, `permanent_error`.
    pub calls: IntCounterVec,
    /// Rewards delivered (once per idempotency key).
    pub rewards: IntCounterVec,
    pub cold_starts: IntCounterVec,
    pub throttles: IntCounterVec,
    pub errors: IntCounterVec,
    pub retries: IntCounterVec,
    /// Calls for an idempotency key that already had a reward, answered from the ledger.
    pub duplicates: IntCounterVec,
    pub billed_ms: IntCounterVec,
    /// GB-seconds, in micro-GB-seconds so an integer counter keeps full precision.
    pub micro_gb_seconds: IntCounterVec,
    /// Client-observed duration of each call, all functions.
    pub call_seconds: Histogram,
}

impl InvokerMetrics {
    /// Creates the metrics and registers them into `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter =
            |name: &str, help: &str, labels: &[&str]| -> Result<IntCounterVec, prometheus::Error> {
                let c = IntCounterVec::new(Opts::new(name, help), labels)?;
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            };
        let f = &["function"];
        let metrics = Self {
            calls: counter(
                "rollfleet_reward_calls_total",
                "Lambda Invoke calls made for rewards, by outcome",
                &["function", "outcome"],
            )?,
            rewards: counter(
                "rollfleet_reward_delivered_total",
                "Rewards delivered to trajectories (once per trajectory attempt)",
                f,
            )?,
            cold_starts: counter(
                "rollfleet_reward_cold_starts_total",
                "Invocations that started a new execution environment",
                f,
            )?,
            throttles: counter(
                "rollfleet_reward_throttles_total",
                "Invocations answered with TooManyRequestsException",
                f,
            )?,
            errors: counter(
                "rollfleet_reward_errors_total",
                "Failed invocations (function errors, timeouts, service and transport errors)",
                f,
            )?,
            retries: counter(
                "rollfleet_reward_retries_total",
                "Invocations retried after a throttle or a transient error",
                f,
            )?,
            duplicates: counter(
                "rollfleet_reward_duplicates_suppressed_total",
                "Reward requests for an idempotency key that already had a reward",
                f,
            )?,
            billed_ms: counter(
                "rollfleet_reward_billed_milliseconds_total",
                "Billed duration of reward invocations",
                f,
            )?,
            micro_gb_seconds: counter(
                "rollfleet_reward_micro_gb_seconds_total",
                "Cost of reward invocations in GB-seconds times 1e6",
                f,
            )?,
            call_seconds: {
                let h = Histogram::with_opts(
                    HistogramOpts::new(
                        "rollfleet_reward_call_duration_seconds",
                        "Client-observed duration of one Lambda Invoke call",
                    )
                    .buckets(prometheus::exponential_buckets(0.0001, 2.5, 16)?),
                )?;
                registry.register(Box::new(h.clone()))?;
                h
            },
        };
        Ok(metrics)
    }
}

/// Totals across all functions, for the run summary.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct InvocationSummary {
    pub calls: u64,
    pub rewards_delivered: u64,
    pub cold_starts: u64,
    pub throttles: u64,
    pub errors: u64,
    pub retries: u64,
    pub duplicates_suppressed: u64,
    pub billed_seconds: f64,
    pub gb_seconds: f64,
    pub call_seconds_total: f64,
}

fn sum(c: &IntCounterVec) -> u64 {
    use prometheus::core::Collector;
    c.collect()
        .iter()
        .flat_map(|family| family.get_metric().iter())
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

impl InvokerMetrics {
    pub fn summary(&self) -> InvocationSummary {
        InvocationSummary {
            calls: sum(&self.calls),
            rewards_delivered: sum(&self.rewards),
            cold_starts: sum(&self.cold_starts),
            throttles: sum(&self.throttles),
            errors: sum(&self.errors),
            retries: sum(&self.retries),
            duplicates_suppressed: sum(&self.duplicates),
            billed_seconds: sum(&self.billed_ms) as f64 / 1000.0,
            gb_seconds: sum(&self.micro_gb_seconds) as f64 / 1e6,
            call_seconds_total: self.call_seconds.get_sample_sum(),
        }
    }
}
