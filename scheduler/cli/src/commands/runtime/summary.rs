//! The summary `rollfleet run` prints when its job ends, and the per-task outcome table that
//! `rollfleet job status` prints too.

use std::io::Write;

use anyhow::Result;
use rollfleet_server::Report;
use rollfleet_server::actor::{OutcomeFigures, StepOutcomes};

use crate::output::{Table, counted};

pub(super) fn write_summary(report: &Report, out: &mut dyn Write) -> Result<()> {
    writeln!(
        out,
        "job {}: {} - {} of {} RL steps in {:.1} s of wall time",
        report.job, report.phase, report.policy_version, report.steps, report.wall_s
    )?;
    if report.emulated_gpus {
        writeln!(
            out,
            "GPU figures are EMULATED (roofline model, time scale {}: one modelled second took {})",
            report.time_scale,
            counted(report.time_scale, "wall second", "wall seconds")
        )?;
    } else {
        writeln!(
            out,
            "{} by a real OpenAI-compatible engine; training and weight syncs are EMULATED (time \
             scale {}), and so are the busy shares of GPU pools",
            counted(report.engine_generations, "generation", "generations"),
            report.time_scale
        )?;
    }
    let mut t = Table::new(&[
        "pool",
        "kind",
        "workers>",
        "assignments done>",
        "busy share>",
    ]);
    for p in &report.pools {
        t.row(vec![
            p.pool.clone(),
            p.kind.clone(),
            p.workers.to_string(),
            p.assignments_done.to_string(),
            format!("{:.0}%", p.busy_share * 100.0),
        ]);
    }
    t.write(out)?;
    write_outcomes(report, out)?;
    writeln!(
        out,
        "trajectories trained: {} ({} twice); stages completed: {}; retried: {}; turns regenerated \
         for staleness: {} ({} finished groups expired waiting for the trainer); workers lost: {}",
        report.trained.len(),
        report.trained_twice.len(),
        report.stages_completed,
        report.stage_retries,
        report.regenerated_turns,
        report.groups_expired_waiting,
        report.workers_lost.len()
    )?;
    for r in &report.replans {
        writeln!(
            out,
            "re-plan at {:.1} s: {}; pool {} {} -> {}; predicted step (modelled) {} as it \
             ran, {:.2} s planned; {} of {}, {} started, {} retired",
            r.at_s,
            r.reason,
            r.pool,
            r.gpus_before,
            counted(r.gpus_after, "GPU", "GPUs"),
            r.running_step_s
                .map_or_else(|| "none".to_owned(), |s| format!("{s:.2} s")),
            r.planned_step_s,
            r.waves_done,
            counted(r.waves, "wave", "waves"),
            counted(r.replicas_started, "replica", "replicas"),
            r.replicas_retired + r.replicas_lost
        )?;
    }
    if !report.groups_abandoned.is_empty() {
        writeln!(
            out,
            "groups given up as infrastructure failures (never trained on, never scored): {}",
            report.groups_abandoned.len()
        )?;
        for g in &report.groups_abandoned {
            writeln!(
                out,
                "  group {}: trajectory {} kept failing; last: {}",
                g.group,
                g.failed,
                if g.last_failure.is_empty() {
                    "a timeout"
                } else {
                    &g.last_failure
                }
            )?;
        }
    }
    if let Some(reason) = &report.failure {
        writeln!(out, "the job failed: {reason}")?;
    }
    let secs = report.wall_s.max(1e-9);
    writeln!(
        out,
        "scheduler: {:.0} stage completions/s over gRPC; dispatch latency (message off the wire to \
         commands handed to the outboxes) p50 {} us, p99 {} us",
        report.stages_completed as f64 / secs,
        report.dispatch_p50_us,
        report.dispatch_p99_us
    )?;
    Ok(())
}

/// What the trained trajectories scored and cost: a line saying where the rewards came from, a
/// row per task and one over them all, then the mean reward of each RL step.
fn write_outcomes(report: &Report, out: &mut dyn Write) -> Result<()> {
    let o = &report.outcomes;
    if o.overall.trajectories == 0 {
        return Ok(());
    }
    // The policy is emulated unless a real engine generated: its rewards are those of random
    // legal moves, which no one should read as a model's learning. Modelled environments score
    // nothing at all (the job spec gives no reward distribution).
    let source = if o.overall.modelled_rewards == o.overall.trajectories {
        "environments and rewards MODELLED from the job spec, which gives no reward \
         distribution: each reward is 0"
            .to_owned()
    } else {
        let policy = if report.engine_generations == 0 {
            "policy EMULATED (random legal moves)"
        } else {
            "policy: a real OpenAI-compatible engine"
        };
        if o.overall.modelled_rewards > 0 {
            format!(
                "{policy}; {} of {} MODELLED from the job spec, each 0",
                o.overall.modelled_rewards, o.overall.trajectories
            )
        } else {
            policy.to_owned()
        }
    };
    writeln!(
        out,
        "rewards ({source}; success: a reward of at least {}):",
        o.success_reward
    )?;
    write_outcome_table(&o.tasks, &o.overall, out)?;
    if !o.steps.is_empty() {
        writeln!(out, "mean reward by RL step: {}", step_line(&o.steps))?;
    }
    Ok(())
}

/// A row per task and one over them all (`all`): trajectories trained, mean reward, success
/// rate, mean turns, mean tokens read (prompt and observations) and generated (actions), and the
/// staleness at training (mean and most versions behind).
pub(crate) fn write_outcome_table(
    tasks: &[OutcomeFigures],
    overall: &OutcomeFigures,
    out: &mut dyn Write,
) -> Result<()> {
    let mut t = Table::new(&[
        "task",
        "trajectories>",
        "mean reward>",
        "success>",
        "turns>",
        "tokens in/out>",
        "staleness mean/max>",
    ]);
    for f in tasks.iter().chain(std::iter::once(overall)) {
        t.row(vec![
            if f.task.is_empty() {
                "all".to_owned()
            } else {
                f.task.clone()
            },
            f.trajectories.to_string(),
            format!("{:.3}", f.mean_reward),
            format!("{:.0}%", f.success_rate * 100.0),
            format!("{:.1}", f.mean_turns),
            format!("{:.0}/{:.0}", f.mean_prompt_tokens, f.mean_action_tokens),
            format!("{:.2}/{}", f.mean_staleness, f.max_staleness),
        ]);
    }
    t.write(out)?;
    Ok(())
}

/// Each step's mean reward (`0: 0.412`), the first and last few of a long run.
fn step_line(steps: &[StepOutcomes]) -> String {
    const EACH_END: usize = 6;
    let cell = |s: &StepOutcomes| format!("{}: {:.3}", s.step, s.overall.mean_reward);
    if steps.len() <= 2 * EACH_END {
        return steps.iter().map(cell).collect::<Vec<_>>().join(", ");
    }
    let head: Vec<String> = steps[..EACH_END].iter().map(cell).collect();
    let tail: Vec<String> = steps[steps.len() - EACH_END..].iter().map(cell).collect();
    format!("{}, ..., {}", head.join(", "), tail.join(", "))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_long_runs_step_line_shows_its_first_and_last_six_steps_and_a_short_ones_every_step() {
        let steps = |n: u64| -> Vec<StepOutcomes> {
            (0..n)
                .map(|step| StepOutcomes {
                    step,
                    overall: OutcomeFigures {
                        mean_reward: step as f64 / 4.0,
                        ..Default::default()
                    },
                    tasks: Vec::new(),
                })
                .collect()
        };
        assert_eq!(step_line(&steps(3)), "0: 0.000, 1: 0.250, 2: 0.500");
        let long = step_line(&steps(100));
        assert!(long.starts_with("0: 0.000, 1: 0.250,"), "{long}");
        assert!(long.contains("5: 1.250, ..., 94: 23.500"), "{long}");
        assert!(long.ends_with("99: 24.750"), "{long}");
        assert_eq!(long.matches(": ").count(), 12, "{long}");
    }
}
