//! The environments and tasks: their names looked up, their turns and token counts, and the
//! distributions they draw from.

use super::*;

pub(super) fn check_environments(spec: &JobSpec, problems: &mut Problems) {
    problems.at_most_entries(
        "spec.environments",
        spec.environments.len(),
        MAX_TASKS,
        "environments (at most one per task)",
    );
    let mut names = BTreeSet::new();
    for (i, environment) in spec.environments.iter().enumerate() {
        problems.name(
            format!("spec.environments[{i}].name"),
            &environment.name,
            &mut names,
            "environment",
        );
    }
}

pub(super) fn check_tasks(spec: &JobSpec, problems: &mut Problems) {
    if spec.tasks.is_empty() {
        problems.error("spec.tasks", "must list at least one task");
        return;
    }
    problems.at_most_entries(
        "spec.tasks",
        spec.tasks.len(),
        MAX_TASKS,
        "tasks (task suites run to about a hundred kinds)",
    );
    let rewards: BTreeSet<&str> = spec.rewards.iter().map(|r| r.name.as_str()).collect();
    let declared: BTreeSet<&str> = spec.environments.iter().map(|e| e.name.as_str()).collect();
    let mut names = BTreeSet::new();
    let mut share_sum = 0.0;
    let mut shares_valid = true;
    for (i, task) in spec.tasks.iter().enumerate() {
        let path = format!("spec.tasks[{i}]");
        problems.name(format!("{path}.name"), &task.name, &mut names, "task");
        if task.environment.trim().is_empty() {
            problems.error(format!("{path}.environment"), "must not be empty");
        } else if !BUILTIN_ENVIRONMENTS.contains(&task.environment.as_str())
            && !declared.contains(task.environment.as_str())
        {
            // A worker given this task would refuse every episode of it: caught here, before
            // the job takes any hardware, and the same for the simulator and the planner, so
            // that a job they accept is one the workers can run.
            let listed = format!(
                "built in: {}; declared in spec.environments: {}",
                BUILTIN_ENVIRONMENTS.join(", "),
                if declared.is_empty() {
                    "none".to_owned()
                } else {
                    declared.iter().copied().collect::<Vec<_>>().join(", ")
                }
            );
            let known = || {
                BUILTIN_ENVIRONMENTS
                    .iter()
                    .copied()
                    .chain(declared.iter().copied())
            };
            let mut message = unknown_name("environment", &task.environment, known(), &listed);
            // Without a close name it is more likely a remote environment left undeclared
            // than a typo: say how to declare one.
            if did_you_mean(&task.environment, known()).is_none() {
                message.push_str(
                    "; an environment served by a remote environment server is declared in \
                     spec.environments with `servedBy: remote`",
                );
            }
            problems.error(format!("{path}.environment"), message);
        }
        if !task.share.is_finite() || task.share <= 0.0 || task.share > 1.0 {
            problems.error(
                format!("{path}.share"),
                format!("must be in (0, 1], got {}", task.share),
            );
            shares_valid = false;
        } else {
            share_sum += task.share;
        }
        problems.within(
            format!("{path}.maxTurns"),
            task.max_turns,
            1,
            MAX_TURNS,
            "turns (agentic episodes take tens to hundreds)",
        );
        problems.at_least(format!("{path}.contextLimit"), task.context_limit, 1);
        if task.context_limit > MAX_CONTEXT_LIMIT {
            problems.error(
                format!("{path}.contextLimit"),
                format!(
                    "must be at most {MAX_CONTEXT_LIMIT} tokens (the longest published context \
                     window), got {}",
                    task.context_limit
                ),
            );
        }
        // Every turn adds at least one action token to the context, so an episode ends at its
        // context limit whatever maxTurns says: a larger maxTurns is a typo, not a longer episode.
        if task.context_limit >= 1 && task.max_turns > task.context_limit {
            problems.error(
                format!("{path}.maxTurns"),
                format!(
                    "must be at most contextLimit ({}): every turn adds at least one token, got {}",
                    task.context_limit, task.max_turns
                ),
            );
        }
        let distributions = [
            ("turns", task.turns.as_deref(), &TURNS),
            ("promptTokens", Some(&*task.prompt_tokens), &TOKENS),
            ("actionTokens", Some(&*task.action_tokens), &TOKENS),
            (
                "observationTokens",
                Some(&*task.observation_tokens),
                &TOKENS,
            ),
            ("envStepMs", Some(&*task.env_step_ms), &MILLISECONDS),
        ];
        for (field, distribution, quantity) in distributions {
            if let Some(distribution) = distribution {
                check_distribution(&format!("{path}.{field}"), distribution, quantity, problems);
            }
        }
        if let Some(turns) = task.turns.as_ref().and_then(|t| t.upper_bound())
            && turns > task.max_turns as f64
        {
            problems.error(
                format!("{path}.turns"),
                format!("can reach {turns}, above maxTurns ({})", task.max_turns),
            );
        }
        if let Some(prompt) = task.prompt_tokens.upper_bound()
            && task.context_limit >= 1
            && prompt >= task.context_limit as f64
        {
            problems.error(
                format!("{path}.promptTokens"),
                format!(
                    "the prompt alone ({prompt} tokens) reaches contextLimit ({})",
                    task.context_limit
                ),
            );
        }
        problems.finite_in(format!("{path}.envCpus"), task.env_cpus, 0.01, 1024.0);
        problems.finite_in(
            format!("{path}.envFailureRate"),
            task.env_failure_rate,
            0.0,
            0.99,
        );
        if !rewards.contains(task.reward.as_str()) {
            let listed = format!(
                "known: {}",
                rewards.iter().copied().collect::<Vec<_>>().join(", ")
            );
            problems.error(
                format!("{path}.reward"),
                unknown_name("reward", &task.reward, rewards.iter().copied(), &listed),
            );
        }
    }
    if shares_valid && (share_sum - 1.0).abs() > SHARE_TOLERANCE {
        problems.error(
            "spec.tasks",
            format!("shares must sum to 1, they sum to {share_sum}"),
        );
    }
}

/// A distribution's own problems, then each parameter beyond what `quantity` allows, a
/// log-normal spread so wide its mean runs away, a trace stretched too far, and a CSV column
/// whose largest row (scaled) is beyond what `quantity` allows, or that was never read.
pub(super) fn check_distribution(
    field: &str,
    distribution: &Distribution,
    quantity: &Quantity,
    problems: &mut Problems,
) {
    let own = distribution.problems();
    let reported: BTreeSet<&str> = own.iter().map(|(parameter, _)| *parameter).collect();
    for (parameter, reason) in &own {
        problems.error(format!("{field}.{parameter}"), reason.clone());
    }
    let parameters: Vec<(&str, f64)> = match *distribution {
        Distribution::Fixed { value } => vec![("value", value)],
        Distribution::Uniform { min, max } => vec![("min", min), ("max", max)],
        Distribution::LogNormal { median, p99, max } => [("median", median), ("p99", p99)]
            .into_iter()
            .chain(max.map(|max| ("max", max)))
            .collect(),
        Distribution::Trace { max, .. } | Distribution::Csv { max, .. } => {
            max.map(|max| ("max", max)).into_iter().collect()
        }
    };
    let mut beyond = BTreeSet::new();
    for (parameter, value) in parameters {
        if !reported.contains(parameter) && value > quantity.max {
            problems.error(
                format!("{field}.{parameter}"),
                format!(
                    "must be at most {} {} ({}), got {}",
                    show(quantity.max),
                    quantity.unit,
                    quantity.reason,
                    show(value)
                ),
            );
            beyond.insert(parameter);
        }
    }
    match *distribution {
        Distribution::LogNormal { median, p99, .. }
            if !reported.contains("p99")
                && !reported.contains("median")
                && !beyond.contains("p99")
                && p99 > median * MAX_LOGNORMAL_SPREAD =>
        {
            problems.error(
                format!("{field}.p99"),
                format!(
                    "must be at most {} times the median ({}): a wider spread puts the mean \
                     above the 99th percentile, got {}",
                    show(MAX_LOGNORMAL_SPREAD),
                    show(median),
                    show(p99)
                ),
            );
        }
        Distribution::Trace { scale, .. }
            if !reported.contains("scale") && scale > MAX_TRACE_SCALE =>
        {
            problems.error(
                format!("{field}.scale"),
                format!(
                    "must be at most {} (1 to 10 stretches serving traffic to RL lengths), got {}",
                    show(MAX_TRACE_SCALE),
                    show(scale)
                ),
            );
        }
        Distribution::Csv {
            path: ref file,
            ref column,
            ref rows,
            scale,
            max,
        } if !reported.contains("scale") => {
            let Some((largest, row)) = rows.largest() else {
                problems.error(format!("{field}.path"), crate::csv_column::NOT_READ);
                return;
            };
            let drawn = max.map_or(largest * scale, |m| m.min(largest * scale));
            if drawn > quantity.max {
                problems.error(
                    format!("{field}.path"),
                    format!(
                        "{file}: row {row} of \"{column}\" is {} (times scale {}: {}), above the \
                         largest allowed, {} {} ({})",
                        show(largest),
                        show(scale),
                        show(largest * scale),
                        show(quantity.max),
                        quantity.unit,
                        quantity.reason
                    ),
                );
            }
        }
        _ => {}
    }
}
