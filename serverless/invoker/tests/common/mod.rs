//! Shared test harness: starts the local Lambda host on a free loopback port inside the test's
//! runtime and builds real aws-sdk-lambda clients and invokers pointed at it.

// Test helpers outside #[test] functions panic on setup failures too; clippy.toml's
// allow-unwrap-in-tests does not reach them.
#![allow(clippy::unwrap_used)]
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rollfleet_lambda_host::{FunctionCode, FunctionConfig, HostConfig, HostStats, LocalHost};
use rollfleet_lambda_invoker::{InvokerConfig, RetryPolicy, RewardInvoker, lambda_client};
use rollfleet_rewards::FunctionError;

/// A running host; dropping it shuts the host down.
pub struct RunningHost {
    pub addr: SocketAddr,
    pub stats: Arc<HostStats>,
    _host: LocalHost,
}

impl RunningHost {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

pub async fn start_host(config: HostConfig) -> RunningHost {
    let host = LocalHost::start(([127, 0, 0, 1], 0).into(), config)
        .await
        .unwrap();
    RunningHost {
        addr: host.addr(),
        stats: host.stats().clone(),
        _host: host,
    }
}

/// A custom function that sleeps, then answers a reward of 1.
pub fn sleeper(delay: Duration) -> FunctionCode {
    FunctionCode::Custom(Arc::new(move |payload| {
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            let v: serde_json::Value = serde_json::from_slice(&payload)
                .map_err(|e| FunctionError::new("InvalidPayload", e.to_string()))?;
            Ok(
                serde_json::json!({"reward": 1.0, "idempotency_key": v.get("idempotency_key")})
                    .to_string()
                    .into_bytes(),
            )
        })
    }))
}

pub fn host_with(extra: &[(&str, FunctionConfig)]) -> HostConfig {
    let mut config = HostConfig::with_reward_functions();
    for (name, f) in extra {
        config.add(name, f.clone());
    }
    config
}

pub async fn sdk(url: &str) -> aws_sdk_lambda::Client {
    lambda_client(&InvokerConfig::local(url)).await
}

pub fn fast_retries(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        base: Duration::from_millis(5),
        cap: Duration::from_millis(100),
    }
}

pub async fn invoker(
    url: &str,
    tweak: impl FnOnce(&mut InvokerConfig),
) -> (RewardInvoker, prometheus::Registry) {
    let mut config = InvokerConfig::local(url);
    config.retry = fast_retries(4);
    config.jitter_seed = Some(7);
    tweak(&mut config);
    let registry = prometheus::Registry::new();
    let invoker = RewardInvoker::connect(config, &registry).await.unwrap();
    (invoker, registry)
}
