//! The simulation report as the table `rollfleet sim` prints: the policies side by side, the
//! fixed yardstick, the placement and checks line, and the sections on steps, decode and how
//! rollfleet's groups lived.

use super::{GroupLives, PolicyReport, SimReport, steady_steps};

/// "rollfleet ran ... before, ... after; the CLUSTER cluster on its own plan ...": a run
/// against the changed cluster's own run, ending with how soon it kept up.
fn versus_text(v: &crate::loss::Versus, cluster: &str, change: &str) -> String {
    let speed = match v.recovered_after_s {
        Some(t) => format!(
            ">= {:.0}% of it from {t:.0} s after the {change} on",
            crate::loss::RECOVERED * 100.0
        ),
        None => format!(
            "never >= {:.0}% of it for good within the run",
            crate::loss::RECOVERED * 100.0
        ),
    };
    format!(
        "rollfleet ran {:.1} s per step before, {:.1} s after; the {cluster} cluster on its own \
         plan {:.1} s over the same steps (bound {:.1} s): {:.0}% of it ({:.0}% of its bound); \
         {speed}\n",
        v.step_s_before,
        v.step_s_after,
        v.reference_step_s,
        v.reference_bound_s,
        v.share_of_reference * 100.0,
        v.share_of_bound * 100.0
    )
}

/// The fixed yardstick and, per policy, its efficiency against it, its training bias and cost.
fn render_yardstick(report: &SimReport) -> String {
    let r = &report.reference;
    let mut out = format!(
        "\nfixed yardstick (the same for every policy): the episodes as first sampled bound a \
         step at {:.1} s ({} binds; staleness {}), {:.0} tokens and {:.1} environment vCPU-s \
         per trajectory\n",
        r.bound.step_s,
        r.bound.binding,
        r.bound.max_staleness,
        r.mix.tokens_per_trajectory,
        r.mix.env_cpu_s_per_trajectory
    );
    out.push_str(&format!(
        "{:<20} {:<10} {:>9} {:>9} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>12}\n",
        "policy",
        "placement",
        "staleness",
        "step (s)",
        "steady (s)",
        "ref eff",
        "tok bias",
        "env bias",
        "task pts",
        "$ / step",
        "per $ vs sync"
    ));
    let sync_usd = report
        .policies
        .iter()
        .find(|p| p.policy == "sync")
        .map(|p| p.usd_per_step);
    for p in &report.policies {
        let usd = if p.usd_per_step < 10.0 {
            format!("{:.4}", p.usd_per_step)
        } else {
            format!("{:.2}", p.usd_per_step)
        };
        out.push_str(&format!(
            "{:<20} {:<10} {:>9} {:>9.1} {:>10} {:>8.2} {:>9.1}% {:>9.1}% {:>10.1} {:>10} {:>12}\n",
            p.policy,
            truncate(&p.placement, 10),
            p.max_staleness,
            p.step_time_s,
            p.steady_step_time_s
                .map_or("-".to_owned(), |s| format!("{s:.1}")),
            p.reference_efficiency,
            p.bias.tokens * 100.0,
            p.bias.env_time * 100.0,
            p.bias.task_share * 100.0,
            usd,
            sync_usd.map_or("-".to_owned(), |s| format!(
                "{:.2}x",
                s / p.usd_per_step.max(1e-12)
            )),
        ));
    }
    out.push_str(&render_decode_split(report));
    out
}

/// How much of each policy's distance from the yardstick its decode speed explains: the
/// yardstick's chains decode every token as a lone sequence, and a run's batches are slower.
fn render_decode_split(report: &SimReport) -> String {
    let r = &report.reference;
    if !report
        .policies
        .iter()
        .any(|p| p.yardstick_at_its_decode_s.is_some())
    {
        return String::new();
    }
    let mut out = format!(
        "\nthe yardstick's chains decode every token as a lone sequence on the largest replica \
         ({:.2} ms a token on average); replayed at each run's own decode speed (a diagnostic, \
         not a bound: a schedule could decode a critical chain alone):\n",
        r.lone_decode_s_per_token * 1000.0
    );
    out.push_str(&format!(
        "{:<20} {:>17} {:>19} {:>10}\n",
        "policy", "decode (ms/token)", "yardstick at it (s)", "eff at it"
    ));
    for p in &report.policies {
        let (Some(token), Some(at)) = (p.decode_s_per_token, p.yardstick_at_its_decode_s) else {
            continue;
        };
        out.push_str(&format!(
            "{:<20} {:>17.2} {:>19.1} {:>10.2}\n",
            p.policy,
            token * 1000.0,
            at,
            if p.step_time_s > 0.0 {
                at / p.step_time_s
            } else {
                0.0
            }
        ));
    }
    out
}

/// Renders the report as a plain-text table.
pub fn render_table(report: &SimReport) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "job {} (seed {}): simulated on a virtual clock; GPU times are modelled from published \
         peaks (roofline at {:.0}% of compute, {:.0}% of bandwidth), not measured\n\n",
        report.job,
        report.seed,
        report.hardware.compute_efficiency * 100.0,
        report.hardware.bandwidth_efficiency * 100.0
    ));
    out.push_str(&format!("placement: {}", report.placement));
    if let Some(t) = report.predicted_step_s {
        out.push_str(&format!(
            " (the planner predicts {t:.1} s per step for rollfleet"
        ));
        if let Some(model) = report.predicted_below_yardstick {
            out.push_str(&format!(
                ": its model gave {model:.1} s, below the fixed yardstick, which no schedule of \
                 these trajectories beats"
            ));
        }
        out.push(')');
    }
    out.push_str("\n\n");
    let pool_names: Vec<String> = report
        .policies
        .first()
        .map(|p| p.pools.iter().map(|x| x.name.clone()).collect())
        .unwrap_or_default();
    let mut header = format!(
        "{:<20} {:>9} {:>8} {:>8} {:>10} {:>9} {:>6} {:>7} {:>7} {:>9}",
        "policy",
        "step (s)",
        "vs sync",
        "traj/s",
        "tok/s",
        "bound (s)",
        "eff",
        "cap (s)",
        "cap eff",
        "env util"
    );
    for name in &pool_names {
        header.push_str(&format!(" {:>10}", truncate(name, 10)));
    }
    header.push_str("  staleness");
    out.push_str(&header);
    out.push('\n');
    for p in &report.policies {
        let mut line = format!(
            "{:<20} {:>9.1} {:>8} {:>8.2} {:>10.0} {:>9.1} {:>6.2} {:>7.1} {:>7.2} {:>8.0}%",
            p.policy,
            p.step_time_s,
            p.speedup_vs_sync
                .map_or("-".to_owned(), |s| format!("{s:.2}x")),
            p.trajectories_per_s,
            p.trained_tokens_per_s,
            p.bound.step_s,
            p.efficiency,
            p.bound.capacity_s,
            p.capacity_efficiency,
            p.environment_utilisation * 100.0
        );
        for pool in &p.pools {
            line.push_str(&format!(" {:>9.0}%", pool.utilisation * 100.0));
        }
        let hist: Vec<String> = p
            .staleness_histogram
            .iter()
            .enumerate()
            .filter(|(_, c)| **c > 0)
            .map(|(s, c)| format!("{s}:{c}"))
            .collect();
        line.push_str(&format!("  {}", hist.join(" ")));
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str(&render_yardstick(report));
    if let Some(r) = &report.loss_recovery {
        out.push_str(&format!(
            "\npool loss (simulated): {} lost {} replicas ({} GPUs, asked {:.1}%) after step {} at \
             {:.0} s; {}",
            r.pool,
            r.replicas_lost,
            r.gpus_lost,
            r.fraction * 100.0,
            r.at_step,
            r.at_s,
            versus_text(&r.versus, "smaller", "loss")
        ));
        if let Some(p) = &r.replan {
            out.push_str(&format!(
                "  re-plan (planner's model): {:.1} s per step before the loss, {} survivors, new \
                 plan for the smaller cluster {:.1} s{}\n",
                p.before_step_s,
                p.survivor_step_s
                    .map_or("no prediction for the".into(), |s| format!(
                        "{s:.1} s for the"
                    )),
                p.new_plan_step_s,
                if p.changes {
                    format!(
                        ", {} waves of at most {} replicas away, applied after the loss (on the \
                         plan's placement)",
                        p.waves,
                        crate::loss::PER_WAVE
                    )
                } else {
                    ", the same placement: the survivors keep running".into()
                }
            ));
        }
    }
    if let Some(g) = &report.growth {
        let m = &g.migration;
        out.push_str(&format!(
            "\npool growth (simulated): {} gained {} GPUs after step {} at {:.0} s; the planner \
             re-planned ({:.1} s per step predicted before, {:.1} s for the bigger cluster) and \
             the run moved in {} waves of at most {} replicas: {} started, {} retired, {}; {}",
            g.pool,
            g.gpus,
            g.at_step,
            m.at_s,
            g.replan.before_step_s,
            g.replan.new_plan_step_s,
            g.replan.waves.len(),
            crate::loss::PER_WAVE,
            m.started,
            m.retired,
            match m.done_at_s {
                Some(t) => format!("done {:.0} s after the growth", t - m.at_s),
                None => "not done when the run ended".into(),
            },
            versus_text(&g.versus, "bigger", "growth")
        ));
    }
    for d in &report.drift_replans {
        let drifts: Vec<String> = d
            .drifts
            .iter()
            .map(|x| {
                format!(
                    "{} {} at {:.0}% of peak (planned {:.0}%)",
                    x.pool,
                    x.kind.name(),
                    x.now * 100.0,
                    x.planned * 100.0
                )
            })
            .collect();
        out.push_str(&format!(
            "\nre-plan on drift (simulated) after step {} at {:.0} s: {}; predicted {} for the \
             running placement, {:.1} s for the new plan; {}\n",
            d.step,
            d.at_s,
            drifts.join(", "),
            d.running_step_s
                .map_or_else(|| "nothing".into(), |s| format!("{s:.1} s")),
            d.new_plan_step_s,
            match &d.migration {
                Some(m) => format!(
                    "{} waves: {} replicas started, {} retired, {}",
                    d.waves,
                    m.started,
                    m.retired,
                    m.done_at_s.map_or_else(
                        || "not done when the run ended".into(),
                        |t| format!("done {:.0} s later", t - m.at_s)
                    )
                ),
                None if d.waves == 0 => format!(
                    "the new plan does not save {:.0}% of the step: nothing moves",
                    crate::drift::MIN_GAIN * 100.0
                ),
                None => format!("{} waves, not started when the run ended", d.waves),
            }
        ));
    }
    out.push_str("\nplacement and checks:\n");
    for p in &report.policies {
        let uses: Vec<String> = p
            .pools
            .iter()
            .filter(|x| x.kind == "gpu")
            .map(|x| format!("{}: {}", x.name, x.use_))
            .collect();
        let window = p.admission_window.as_ref().map_or_else(String::new, |w| {
            format!(
                "; admission window {}",
                crate::window::widening_label(w.widening_quarters)
            )
        });
        out.push_str(&format!(
            "  {:<20} {}{window}; bound binds on {} (capacity: {}; latency term {:.1} s at staleness {}); {} regenerated turns{}{}{}; invariants {}\n",
            p.policy,
            uses.join("; "),
            p.bound.binding,
            p.bound.capacity_binding,
            p.bound.latency_s,
            p.bound.max_staleness,
            p.core.regenerated_turns,
            expired_waiting(p),
            evicted_caches(p),
            trainer_load(p),
            if p.invariant_violations.is_empty() {
                "held".to_owned()
            } else {
                format!("BROKEN: {}", p.invariant_violations.join("; "))
            }
        ));
    }
    out.push_str(&render_steps(&report.policies));
    out.push_str(&render_decode(&report.policies));
    out.push_str(&render_group_lives(&report.group_lives));
    if let Some(attribution) = &report.data_attribution {
        out.push_str(&format!("\nworkload samples: {attribution}\n"));
    }
    out
}

/// `, N finished groups (P% of those trained) expired waiting for the trainer`, or nothing when
/// none did.
fn expired_waiting(p: &PolicyReport) -> String {
    let expired = p.core.groups_expired_waiting;
    if expired == 0 {
        return String::new();
    }
    let trained: u64 = p.core.task_lives.iter().map(|l| l.groups).sum();
    format!(
        ", {expired} finished groups ({:.0}% of those trained) expired waiting for the trainer",
        100.0 * expired as f64 / trained.max(1) as f64
    )
}

/// `; N KV caches evicted (E a finished trajectory: ...)`, or nothing when none was. Evictions
/// are a fleet whose decode replicas cannot hold the contexts of the trajectories in flight:
/// each evicted trajectory prefills its whole context again at its next turn, so a run that
/// evicts more than about one cache a trajectory is bound by that recompute, not by the job.
fn evicted_caches(p: &PolicyReport) -> String {
    let evicted = p.core.kv_evictions;
    if evicted == 0 {
        return String::new();
    }
    format!(
        "; {evicted} KV caches evicted ({:.1} a finished trajectory: the decode replicas cannot \
         hold the contexts in flight, and each evicted one is prefilled whole again)",
        evicted as f64 / p.core.trajectories_completed.max(1) as f64
    )
}

/// `; trainer busy P% of the run over N batches, a batch S / M / L s (shortest / mean /
/// longest)`, or nothing when nothing was trained.
fn trainer_load(p: &PolicyReport) -> String {
    let Some(t) = &p.trainer else {
        return String::new();
    };
    format!(
        "; trainer busy {:.0}% of the run over {} batches, a batch {:.1} / {:.1} / {:.1} s \
         (shortest / mean / longest)",
        100.0 * t.busy_share,
        t.batches,
        t.batch_s_min,
        t.batch_s_mean,
        t.batch_s_max
    )
}

/// Each policy's first step, the shortest, mean and longest of its steady ones, and its last:
/// how far the job's average is from a steady step, and how evenly the steady steps run.
fn render_steps(policies: &[PolicyReport]) -> String {
    let rows: Vec<String> = policies
        .iter()
        .filter_map(|p| {
            let steady = steady_steps(p.step_times_s.len())?;
            let steps = &p.step_times_s[steady];
            let shortest = steps.iter().copied().fold(f64::INFINITY, f64::min);
            let longest = steps.iter().copied().fold(0.0_f64, f64::max);
            Some(format!(
                "  {:<20} {:>9.1} {:>11.1} {:>11.1} {:>11.1} {:>9.1}\n",
                p.policy,
                p.step_times_s.first().copied().unwrap_or(0.0),
                shortest,
                p.steady_step_time_s.unwrap_or(0.0),
                longest,
                p.step_times_s.last().copied().unwrap_or(0.0),
            ))
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\nsteps (seconds; steady: between the warm-up and the drain, a tenth of the steps each):\n",
    );
    out.push_str(&format!(
        "  {:<20} {:>9} {:>11} {:>11} {:>11} {:>9}\n",
        "policy", "first", "steady min", "steady mean", "steady max", "last"
    ));
    for row in rows {
        out.push_str(&row);
    }
    out
}

/// Each policy's decoding per GPU pool: the batch while any sequence decoded and the time a
/// token took, the pool's and its busiest or slowest replica's.
fn render_decode(policies: &[PolicyReport]) -> String {
    let mut rows = String::new();
    for p in policies {
        for pool in &p.pools {
            let Some(d) = &pool.decode else { continue };
            rows.push_str(&format!(
                "  {:<20} {:<10} {:>8} {:>7.1} {:>8.1} {:>9.2} {:>8.2}\n",
                p.policy,
                truncate(&pool.name, 10),
                d.replicas,
                d.batch,
                d.busiest_replica_batch,
                d.s_per_token * 1000.0,
                d.slowest_replica_s_per_token * 1000.0,
            ));
        }
    }
    if rows.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\ndecode per GPU pool (batch: sequences decoding at once while any did; ms a decoded token took, \
         its batch's iteration time; the pool's, and its busiest or slowest replica's):\n",
    );
    out.push_str(&format!(
        "  {:<20} {:<10} {:>8} {:>7} {:>8} {:>9} {:>8}\n",
        "policy", "pool", "replicas", "batch", "busiest", "ms/token", "slowest"
    ));
    out.push_str(&rows);
    out
}

/// The group-lives table: simulated, and the planner's model with its error where it has one.
fn render_group_lives(lives: &[GroupLives]) -> String {
    if lives.is_empty() {
        return String::new();
    }
    let with_model = lives.iter().any(|l| l.model.is_some());
    let mut out = format!(
        "\nhow rollfleet's groups lived (seconds, means over the groups trained{}):\n",
        if with_model {
            "; simulated / the planner's model and its error; the model's trainer wait is half a training batch's fill and its closed loop's queue at the trainer, the same for every task"
        } else {
            ""
        }
    );
    out.push_str(&format!(
        "  {:<18} {:>7} {:>24} {:>24} {:>24} {:>24}\n",
        "task", "groups", "member life", "slowest member", "admitted to done", "trainer wait"
    ));
    let cell = |simulated: f64, model: Option<f64>| match model {
        Some(m) if simulated > 0.0 => format!(
            "{simulated:.1} / {m:.1} {:+.0}%",
            100.0 * (m - simulated) / simulated
        ),
        _ => format!("{simulated:.1}"),
    };
    for l in lives {
        out.push_str(&format!(
            "  {:<18} {:>7} {:>24} {:>24} {:>24} {:>24}\n",
            truncate(&l.task, 18),
            l.groups,
            cell(l.member_s, l.model.map(|m| m.member_s)),
            cell(l.group_s, l.model.map(|m| m.group_s)),
            cell(l.until_done_s, l.model.map(|m| m.until_done_s)),
            cell(l.trainer_wait_s, l.model.map(|m| m.trainer_wait_s)),
        ));
    }
    out
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}
