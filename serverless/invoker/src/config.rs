//! Invoker settings: where the functions are (a local endpoint or AWS), per-function timeouts
//! and memory sizes, the retry policy, and the concurrency limit.

use std::collections::HashMap;
use std::time::Duration;

/// What the invoker knows about one deployed function.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FunctionSettings {
    /// The function's own timeout (Lambda `Timeout`); the per-call timeout is this plus
    /// [`InvokerConfig::call_timeout_margin`].
    pub timeout: Duration,
    /// Lambda `MemorySize`, for GB-seconds when the response carries no `REPORT` line.
    pub memory_mb: u32,
}

impl Default for FunctionSettings {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            memory_mb: 512,
        }
    }
}

/// Retry policy: capped exponential backoff with full jitter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Total tries per reward, the first included.
    pub max_attempts: u32,
    /// Backoff before the second try is drawn from `[0, base]`, then `[0, 2 base]`, ...
    pub base: Duration,
    /// Upper bound of any single backoff, including one asked for by `Retry-After`.
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 6,
            base: Duration::from_millis(50),
            cap: Duration::from_secs(5),
        }
    }
}

/// Everything [`crate::RewardInvoker`] needs.
#[derive(Debug, Clone)]
pub struct InvokerConfig {
    /// `Some("http://127.0.0.1:9001")` for the local host or another Lambda-compatible server;
    /// `None` for AWS Lambda itself (endpoint from the region, credentials from the default
    /// chain: environment, profile, SSO, web identity, container and instance metadata).
    pub endpoint_url: Option<String>,
    pub region: String,
    /// Per-function settings; functions not listed use `default_function`.
    pub functions: HashMap<String, FunctionSettings>,
    pub default_function: FunctionSettings,
    /// Added to a function's timeout to get the client-side per-call timeout, so the function
    /// reports its own timeout (a function error we can classify) before the client gives up.
    pub call_timeout_margin: Duration,
    pub retry: RetryPolicy,
    /// Invocations in flight at once, across all functions.
    pub max_concurrency: usize,
    /// Ask for `LogType: Tail` so the `REPORT` line tells cold starts and billed duration.
    pub request_log_tail: bool,
    /// Seed for the backoff jitter; `None` seeds from the OS.
    pub jitter_seed: Option<u64>,
}

impl Default for InvokerConfig {
    fn default() -> Self {
        Self {
            endpoint_url: None,
            region: "us-east-1".to_owned(),
            functions: HashMap::new(),
            default_function: FunctionSettings::default(),
            call_timeout_margin: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            max_concurrency: 256,
            request_log_tail: true,
            jitter_seed: None,
        }
    }
}

impl InvokerConfig {
    /// Settings for a local (or other Lambda-compatible) endpoint.
    pub fn local(endpoint_url: impl Into<String>) -> Self {
        Self {
            endpoint_url: Some(endpoint_url.into()),
            ..Self::default()
        }
    }

    pub fn function(&self, name: &str) -> FunctionSettings {
        self.functions
            .get(name)
            .copied()
            .unwrap_or(self.default_function)
    }

    pub fn call_timeout(&self, name: &str) -> Duration {
        self.function(name).timeout + self.call_timeout_margin
    }
}
