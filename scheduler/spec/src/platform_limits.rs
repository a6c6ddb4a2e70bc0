//! What a serverless platform's catalogue entry says a reward may not do: run longer than the
//! platform lets one invocation run (AWS Lambda stops a call at 900 s).
//!
//! A reward whose stated latency exceeds that limit would time out on every such call on the
//! real platform, while the simulator and the planner would happily wait for it; the job is
//! refused instead, naming the latency field and the limit.

use rollfleet_catalog::Catalog;

use crate::distribution::Distribution;
use crate::manifest::{JobSpec, RewardPlacement};
use crate::validate::Problem;

/// The largest latency a distribution states, ms, and the field that states it.
fn stated_longest(dist: &Distribution) -> (f64, &'static str) {
    match *dist {
        Distribution::Fixed { value } => (value, ""),
        Distribution::Uniform { max, .. } => (max, ".max"),
        Distribution::LogNormal { max: Some(max), .. }
        | Distribution::Trace { max: Some(max), .. } => (max, ".max"),
        Distribution::LogNormal { p99, max: None, .. } => (p99, ".p99"),
        // A trace without a cap is scaled from real data: nothing is stated to check.
        Distribution::Trace { max: None, .. } => (0.0, ""),
        // A CSV column's rows are all known: its largest (scaled) is what a call may take.
        Distribution::Csv { max: None, .. } => (dist.upper_bound().unwrap_or(0.0), ".path"),
        Distribution::Csv { max: Some(max), .. } => (max, ".max"),
    }
}

/// Every serverless reward whose stated latency exceeds its platform's time limit per call.
pub(crate) fn reward_timeout_problems(spec: &JobSpec, catalog: &Catalog) -> Vec<Problem> {
    let mut out = Vec::new();
    for (i, reward) in spec.rewards.iter().enumerate() {
        if reward.runs_on != RewardPlacement::Serverless {
            continue;
        }
        let Some(platform) = reward
            .pool
            .as_deref()
            .and_then(|name| spec.pools.iter().find(|p| p.name == name))
            .and_then(|pool| pool.serverless.as_deref())
            .and_then(|name| catalog.serverless(name).ok())
        else {
            // An unknown pool or platform is reported where the pool is checked.
            continue;
        };
        let limit_ms = f64::from(platform.max_timeout_s) * 1000.0;
        let (longest, field) = stated_longest(&reward.latency_ms);
        if limit_ms > 0.0 && longest > limit_ms {
            out.push(Problem {
                path: format!("spec.rewards[{i}].latencyMs{field}"),
                message: format!(
                    "{longest} ms is longer than {} lets one invocation run ({} s): such calls \
                     would time out on every attempt",
                    platform.name, platform.max_timeout_s
                ),
            });
        }
    }
    out
}
