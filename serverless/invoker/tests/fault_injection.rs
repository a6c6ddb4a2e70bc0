//! Fault injection: the host fails, throttles or times out 20% of invocations, and the
//! scheduler-side invoker must still deliver every trajectory's reward exactly once, and the
//! right reward to the right trajectory, even when the scheduler asks twice for some of them.

// Test helpers outside #[test] functions panic on setup failures too; clippy.toml's
// allow-unwrap-in-tests does not reach them.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rollfleet_lambda_host::{FaultConfig, FunctionCode, FunctionConfig, HostConfig};
use rollfleet_lambda_invoker::{Delivery, RetryPolicy, RewardRequest};
use rollfleet_rewards::RewardFunction;
use serde_json::json;

const TRAJECTORIES: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_20_percent_faults_every_reward_is_delivered_exactly_once_to_its_trajectory() {
    let mut config = HostConfig::with_reward_functions();
    config.add(
        "math_answer",
        FunctionConfig::new(FunctionCode::Reward(RewardFunction::MathAnswer))
            .timeout(Duration::from_millis(250)),
    );
    config.faults = FaultConfig {
        service_error_rate: 0.07,
        throttle_rate: 0.07,
        timeout_rate: 0.06,
        seed: 2026,
    };
    let host = start_host(config).await;
    let (invoker, _) = invoker(&host.url(), |c| {
        c.retry = RetryPolicy {
            max_attempts: 12,
            base: Duration::from_millis(5),
            cap: Duration::from_millis(50),
        };
        c.max_concurrency = 32;
        c.call_timeout_margin = Duration::from_secs(2);
        c.jitter_seed = Some(11);
    })
    .await;
    let invoker = Arc::new(invoker);

    // Even trajectories answer correctly, odd ones do not; every 7th is asked for twice,
    // concurrently, as a scheduler re-issuing work after a failover would.
    let mut tasks = Vec::new();
    for i in 0..TRAJECTORIES {
        let copies = if i % 7 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            let invoker = invoker.clone();
            tasks.push(tokio::spawn(async move {
                let answer = if i % 2 == 0 { i * 3 } else { i * 3 + 1 };
                let request = RewardRequest {
                    function: "math_answer".to_owned(),
                    trajectory_id: format!("traj-{i}"),
                    attempt: 0,
                    payload: json!({
                        "response": format!("<think>...</think> \\boxed{{{answer}}}"),
                        "reference": (i * 3).to_string(),
                    }),
                };
                (i, invoker.invoke(request).await)
            }));
        }
    }

    let mut first_deliveries: HashMap<usize, usize> = HashMap::new();
    let mut rewards: HashMap<usize, f64> = HashMap::new();
    for task in tasks {
        let (i, outcome) = task.await.unwrap();
        let outcome = outcome.unwrap_or_else(|e| panic!("trajectory {i} got no reward: {e}"));
        assert_eq!(outcome.reward.idempotency_key, format!("traj-{i}#0"));
        if let Some(previous) = rewards.insert(i, outcome.reward.reward) {
            assert_eq!(
                previous, outcome.reward.reward,
                "trajectory {i}: two different rewards"
            );
        }
        if outcome.delivery == Delivery::First {
            *first_deliveries.entry(i).or_default() += 1;
        }
    }

    assert_eq!(first_deliveries.len(), TRAJECTORIES);
    assert!(
        first_deliveries.values().all(|&n| n == 1),
        "a reward was delivered twice"
    );
    for (i, reward) in &rewards {
        let expected = if i % 2 == 0 { 1.0 } else { 0.0 };
        assert_eq!(
            *reward, expected,
            "trajectory {i} got another trajectory's reward"
        );
    }

    let host_stats = host.stats.snapshot();
    assert!(host_stats.service_errors > 0, "{host_stats:?}");
    assert!(host_stats.throttles > 0, "{host_stats:?}");
    assert!(host_stats.timeouts > 0, "{host_stats:?}");
    let summary = invoker.summary();
    assert_eq!(summary.rewards_delivered, TRAJECTORIES as u64);
    assert_eq!(
        summary.duplicates_suppressed,
        TRAJECTORIES.div_ceil(7) as u64
    );
    assert!(summary.retries > 0);
    // Every call that ran the function to a good answer is one reward: no reward was computed
    // twice for the same trajectory.
    let successes = invoker
        .metrics()
        .calls
        .with_label_values(&["math_answer", "success"])
        .get();
    assert_eq!(successes, TRAJECTORIES as u64);
    // The faults the host injected are what the invoker saw and retried.
    assert_eq!(summary.throttles, host_stats.throttles);
    assert_eq!(
        summary.retries,
        host_stats.throttles + host_stats.service_errors + host_stats.timeouts
    );
}
