//! The reward functions: their names looked up, where they run, and their latencies against
//! what their platform allows.

use super::*;

pub(super) fn check_rewards(spec: &JobSpec, problems: &mut Problems) {
    problems.at_most_entries(
        "spec.rewards",
        spec.rewards.len(),
        MAX_TASKS,
        "rewards (at most one per task)",
    );
    let mut names = BTreeSet::new();
    for (i, reward) in spec.rewards.iter().enumerate() {
        let path = format!("spec.rewards[{i}]");
        problems.name(format!("{path}.name"), &reward.name, &mut names, "reward");
        check_distribution(
            &format!("{path}.latencyMs"),
            &reward.latency_ms,
            &MILLISECONDS,
            problems,
        );
        problems.within(
            format!("{path}.memoryMb"),
            reward.memory_mb,
            128,
            MAX_FUNCTION_MEMORY_MB,
            "MB (a hundred times AWS Lambda's largest function)",
        );
        let wanted_kind = match reward.runs_on {
            RewardPlacement::Serverless => Some(PoolKind::Serverless),
            RewardPlacement::Local => Some(PoolKind::Cpu),
            RewardPlacement::Environment => None,
        };
        match (wanted_kind, &reward.pool) {
            (Some(_), None) => problems.error(
                format!("{path}.pool"),
                format!("is required for runsOn: {}", placement_name(reward.runs_on)),
            ),
            (Some(kind_wanted), Some(pool_name)) => {
                match spec.pools.iter().find(|p| &p.name == pool_name) {
                    None => problems.error(
                        format!("{path}.pool"),
                        unknown_name(
                            "pool",
                            pool_name,
                            spec.pools.iter().map(|p| p.name.as_str()),
                            &format!(
                                "known: {}",
                                spec.pools
                                    .iter()
                                    .map(|p| p.name.as_str())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        ),
                    ),
                    Some(pool) if pool.kind().is_some_and(|k| k != kind_wanted) => problems.error(
                        format!("{path}.pool"),
                        format!(
                            "pool \"{pool_name}\" is not a {} pool, which runsOn: {} needs",
                            kind_name(kind_wanted),
                            placement_name(reward.runs_on)
                        ),
                    ),
                    Some(_) => {}
                }
            }
            (None, Some(_)) => problems.warn(
                format!("{path}.pool"),
                "is ignored for runsOn: environment (the environment computes the reward)",
            ),
            (None, None) => {}
        }
        if reward.runs_on == RewardPlacement::Serverless
            && reward
                .function
                .as_deref()
                .is_none_or(|f| f.trim().is_empty())
        {
            problems.error(
                format!("{path}.function"),
                "is required for runsOn: serverless",
            );
        }
        // The reward workers run a function by this name (a local reward without one runs
        // exact_match); a name they do not implement would fail every call of the job.
        if reward.runs_on == RewardPlacement::Local
            && reward
                .function
                .as_deref()
                .is_some_and(|f| f.trim().is_empty())
        {
            problems.error(
                format!("{path}.function"),
                "must not be empty (left out, a local reward runs exact_match)",
            );
        } else if let Some(function) = reward.function.as_deref()
            && !function.trim().is_empty()
            && reward.runs_on != RewardPlacement::Environment
            && !BUILTIN_REWARD_FUNCTIONS.contains(&function)
        {
            problems.error(
                format!("{path}.function"),
                unknown_name(
                    "reward function",
                    function,
                    BUILTIN_REWARD_FUNCTIONS.iter().copied(),
                    &format!(
                        "the reward workers implement: {}",
                        BUILTIN_REWARD_FUNCTIONS.join(", ")
                    ),
                ),
            );
        }
    }
}
