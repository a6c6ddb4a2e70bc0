//! `rollfleet plan JOB.yaml [--inventory cluster.yaml]`: the planner's placement for a job, with
//! its predicted per-pool utilisation, step time and cost, and why each role goes where it goes.
//!
//! The inventory file, when given, is a YAML document `pools: [...]` in the job spec's own pool
//! format; it replaces the job's pools (rewards still refer to pools by name).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use rollfleet_planner::plan::{self, Plan};
use rollfleet_planner::roofline::Efficiency;
use rollfleet_planner::{compare, search};
use rollfleet_sim::SimOptions;
use rollfleet_sim::hardware::HardwareModel;
use rollfleet_sim::window::{
    TUNING_SEEDS, WIDENINGS, WindowChoice, choose_rollfleet_window, widening_label,
};
use rollfleet_sim::workload::mean;
use rollfleet_spec::load_job_file;
use serde::Serialize;

use crate::output::{OutputFormat, Table, counted, exit, write_structured};

/// Arguments of `rollfleet plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The job spec (YAML).
    #[arg(value_name = "JOB")]
    pub job: PathBuf,
    /// A cluster inventory (`pools: [...]`, as in a job spec) to plan on instead of the job's
    /// own pools.
    #[arg(long, value_name = "PATH")]
    pub inventory: Option<PathBuf>,
    /// Also predict the `uniform` and `best-gpu` placements, to compare.
    #[arg(long)]
    pub compare: bool,
    /// A profile store (JSON, from `rollfleet profile export|import`): measured and probed
    /// shares of peak replace the model's where the store has them.
    #[arg(long, value_name = "FILE")]
    pub profiles: Option<PathBuf>,
}

/// The fixed yardstick `rollfleet sim` measures every policy against (seed 0, the simulator's
/// default shares of peak): a bound on any schedule of the job's trajectories as first sampled.
#[derive(Serialize)]
struct Yardstick {
    /// The bound, seconds per step.
    step_s: f64,
    /// What binds it: `gpu`, `cpu`, `serverless` or `latency`.
    binding: String,
}

#[derive(Serialize)]
struct Comparison {
    placement: &'static str,
    step_s: f64,
    trajectories_per_s: f64,
    plan_speedup: f64,
}

#[derive(Serialize)]
struct Output<'a> {
    job: String,
    /// The plan's predicted step, seconds: the model's, raised to the yardstick when below it.
    predicted_step_s: f64,
    /// The model's own figure, when it was below the yardstick and raised to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    predicted_below_yardstick: Option<f64>,
    /// Seconds per step averaged over the job's steps, its start and its last step's drain
    /// included (what `rollfleet sim` measures), held at the yardstick too.
    predicted_job_step_s: f64,
    /// The job's steps.
    steps: u64,
    /// The job's tasks, in the order of the prediction's `task_lives`.
    tasks: Vec<String>,
    /// Left out when the prediction uses measured or probed shares of peak, which the
    /// yardstick's assumed ones would not match.
    #[serde(skip_serializing_if = "Option::is_none")]
    yardstick: Option<Yardstick>,
    plan: &'a Plan,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    compared: Vec<Comparison>,
    /// When the plan is RollArt's affinity placement rather than the search's own optimum (its
    /// degrees checked by the full prediction): the full predictions the choice compared,
    /// seconds per step, with refills as a Poisson stream (`predict::RefillArrivals`): the
    /// optimum's, and the plan's (lower).
    #[serde(skip_serializing_if = "Option::is_none")]
    affinity_over_search_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    affinity_plan_s: Option<f64>,
    /// When a compared placement (`uniform`, `best-gpu`) was predicted faster than the search's
    /// choice by more than the prediction can rank and taken instead: its name, and the
    /// predictions of the placement it replaced and of the plan, seconds per step.
    #[serde(skip_serializing_if = "Option::is_none")]
    replaced: Option<Replaced>,
    /// The core's admission window, chosen by simulating the job at each width
    /// (`rollfleet_sim::window`); the prediction is made for it.
    admission_window: WindowChoice,
}

#[derive(Serialize)]
struct Replaced {
    by: &'static str,
    replaced_s: f64,
    plan_s: f64,
}

/// Runs the command; returns the exit code.
pub fn run(
    args: &PlanArgs,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let job = match load_job_file(&args.job) {
        Ok(job) => job,
        Err(e) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    };
    // The inventory's pools are checked as the job's own are (names, products, counts, and
    // what the job's rewards and tasks need of them).
    let job = match &args.inventory {
        Some(path) => match job.with_inventory_file(path) {
            Ok(job) => job,
            Err(e) => {
                // Each error names its cause itself; the alternate form would print the I/O one twice.
                writeln!(stderr, "error: {e}")?;
                return Ok(exit::INVALID_INPUT);
            }
        },
        None => job,
    };
    let spec = job.spec().clone();
    let store = match &args.profiles {
        Some(path) => match crate::commands::profile::read_store(path) {
            Ok(s) => s,
            Err(e) => {
                writeln!(stderr, "error: {e:#}")?;
                return Ok(exit::INVALID_INPUT);
            }
        },
        None => Default::default(),
    };
    let mut problem =
        match plan::problem_profiled(&spec, &job.catalog, &mean, &Efficiency::default(), &store) {
            Ok(p) => p,
            Err(e) => {
                writeln!(stderr, "error: {e}")?;
                return Ok(exit::INVALID_INPUT);
            }
        };
    let Some((found, choice)) = search::choose_with_reason(&problem) else {
        writeln!(stderr, "error: no placement can run the job")?;
        return Ok(exit::INVALID_INPUT);
    };
    let describe = |problem: &rollfleet_planner::Problem| {
        plan::describe(&spec, problem, &found.candidate, found.nodes)
    };
    let planned = match describe(&problem) {
        Ok(p) => p,
        Err(e) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    };
    // The core's admission window for this placement, chosen by simulating the job as the
    // scheduler does when it takes it; the prediction is then made for that window.
    writeln!(
        stderr,
        "choosing the admission window: simulating {} widths or more on {} seeds...",
        WIDENINGS.len(),
        TUNING_SEEDS
    )?;
    let window = choose_rollfleet_window(
        &spec,
        &job.catalog,
        &planned.placement,
        &SimOptions::default(),
    )?;
    problem.workload.window_widening_quarters = window.widening_quarters;
    let planned = if window.widening_quarters != 0 {
        describe(&problem)?
    } else {
        planned
    };
    // No schedule of the job's trajectories beats the yardstick, so a model figure below it is
    // wrong by at least the gap: it is raised to it, as `rollfleet sim` does. The yardstick
    // assumes the simulator's shares of peak, so a plan on measured ones is left as it is.
    let measured = planned
        .profiles
        .iter()
        .any(|f| f.source != rollfleet_planner::profile::Source::Model);
    let yardstick = (!measured).then(|| {
        let reference =
            rollfleet_sim::reference::reference(&spec, &job.catalog, &HardwareModel::default(), 0);
        Yardstick {
            step_s: reference.bound.step_s,
            binding: reference.bound.binding,
        }
    });
    let floor = yardstick.as_ref().map_or(0.0, |y| y.step_s);
    let model_step_s = planned.prediction.step_s;
    let predicted_step_s = model_step_s.max(floor);
    let mut compared = Vec::new();
    if args.compare {
        for (name, other) in [
            ("uniform", compare::uniform(&problem)),
            ("best-gpu", compare::best_gpu(&problem)),
        ] {
            // Compared by the same prediction as the plan's, not by the search's objective.
            if let Some(step_s) = other
                .and_then(|o| rollfleet_planner::predict::predict(&problem, &o.candidate))
                .map(|prediction| prediction.step_s.max(floor))
            {
                compared.push(Comparison {
                    placement: name,
                    step_s,
                    trajectories_per_s: problem.workload.batch / step_s,
                    plan_speedup: step_s / predicted_step_s,
                });
            }
        }
    }
    // `choose` took the affinity placement over the search's optimum: say so, with both figures.
    let (affinity_over_search_s, affinity_plan_s) = match choice.compared {
        Some((search_s, affinity_s)) if choice.affinity => (Some(search_s), Some(affinity_s)),
        _ => (None, None),
    };
    let replaced = choice.replaced_by.map(|(by, replaced_s, plan_s)| Replaced {
        by,
        replaced_s,
        plan_s,
    });
    let output = Output {
        job: job.manifest.metadata.name.clone(),
        predicted_step_s,
        predicted_below_yardstick: (model_step_s < floor).then_some(model_step_s),
        predicted_job_step_s: planned.prediction.job_step_s.max(floor),
        steps: spec.rl.steps.max(1) as u64,
        tasks: spec.tasks.iter().map(|t| t.name.clone()).collect(),
        yardstick,
        plan: &planned,
        compared,
        affinity_over_search_s,
        affinity_plan_s,
        replaced,
        admission_window: window,
    };
    match format {
        OutputFormat::Json | OutputFormat::Yaml => write_structured(format, &output, stdout)?,
        OutputFormat::Table => render(&output, stdout)?,
    }
    Ok(exit::OK)
}

fn render(o: &Output, out: &mut dyn Write) -> Result<()> {
    let p = o.plan;
    let pr = &p.prediction;
    // A prediction raised to the yardstick runs fewer trajectories a second, each step costing
    // more GPU time.
    let raised = pr.step_s / o.predicted_step_s.max(1e-12);
    if o.yardstick.is_none() {
        writeln!(
            out,
            "job {}: planned placement (predicted by the planner's roofline model, with the \
             measured or probed shares of peak listed under \"profiles\" in place of its \
             assumptions)\n",
            o.job
        )?;
    } else {
        writeln!(
            out,
            "job {}: planned placement (predicted by the planner's roofline model of published \
             peaks, not measured)\n",
            o.job
        )?;
    }
    let mut roles = Table::new(&["role", "pool", "gpu", "replicas>", "GPUs each>"]);
    for r in &p.roles {
        roles.row(vec![
            r.role.clone(),
            r.pool.clone(),
            r.gpu.clone(),
            r.replicas.to_string(),
            r.tp.to_string(),
        ]);
    }
    roles.write(out)?;
    writeln!(out)?;
    let mut pools = Table::new(&["pool", "kind", "does", "utilisation>", "slots>"]);
    for pool in &p.pools {
        pools.row(vec![
            pool.pool.clone(),
            pool.kind.clone(),
            pool.does.clone(),
            format!("{:.0}%", pool.utilisation * 100.0),
            pool.slots.map_or("-".into(), |s| s.to_string()),
        ]);
    }
    pools.write(out)?;
    writeln!(
        out,
        "\npredicted step: {:.1} s ({:.2} trajectories/s), bound by {:?}; {:.1} ms per decoded \
         token; ${:.2} per step",
        o.predicted_step_s,
        pr.trajectories_per_s * raised,
        pr.binding,
        pr.token_s * 1e3,
        pr.cost_per_step_usd / raised
    )?;
    writeln!(
        out,
        "over the job's {} steps: {:.1} s a step on average, its start and the last step's \
         wait for the groups it started last included (what `rollfleet sim` measures)",
        o.steps, o.predicted_job_step_s
    )?;
    match (&o.yardstick, o.predicted_below_yardstick) {
        (Some(y), Some(model)) => writeln!(
            out,
            "raised to the fixed yardstick ({} binds it): no schedule that trains the job's \
             trajectories as first sampled beats {:.1} s a step, and the model said {model:.1} s",
            y.binding, y.step_s
        )?,
        (Some(y), None) => writeln!(
            out,
            "fixed yardstick: {:.1} s a step ({} binds it), what no schedule that trains the \
             job's trajectories as first sampled beats",
            y.step_s, y.binding
        )?,
        (None, _) => writeln!(
            out,
            "no fixed yardstick: it assumes the simulator's shares of peak, and this plan uses \
             measured or probed ones"
        )?,
    }
    let t = &pr.terms;
    writeln!(
        out,
        "terms (s): train {:.1}, prefill {:.1}, local prefill {:.1}, decode capacity {:.1}, \
         environments {:.1}, serverless {:.1}, latency {:.1}, staleness {:.1}, longest chain {:.1}",
        t.train_s,
        t.prefill_s,
        t.local_prefill_s,
        t.decode_s,
        t.env_s,
        t.serverless_s,
        t.latency_s,
        t.staleness_s,
        t.chain_s
    )?;
    if pr.task_lives.len() == o.tasks.len() && !o.tasks.is_empty() {
        let lives: Vec<String> = o
            .tasks
            .iter()
            .zip(&pr.task_lives)
            .map(|(task, l)| {
                format!(
                    "{task} {:.1} / {:.1} / {:.1} / {:.1}",
                    l.member_s, l.group_s, l.until_done_s, l.trainer_wait_s
                )
            })
            .collect();
        writeln!(
            out,
            "group lives (s; a member, the slowest member, admission to done with every \
             attempt, then the wait for the trainer): {}",
            lives.join(", ")
        )?;
    }
    writeln!(
        out,
        "admission window: {} (simulated seconds per step over the job's first steps, on seeds \
         of the window's own: {})",
        widening_label(o.admission_window.widening_quarters),
        o.admission_window.describe()
    )?;
    writeln!(
        out,
        "\nprofiles (share of peak each GPU pool's prediction used):"
    )?;
    for f in &p.profiles {
        let what = match f.kind {
            rollfleet_planner::roofline::WorkKind::Prefill => "prefill (of peak FLOP/s)",
            _ => "decode (of peak bandwidth)",
        };
        let source = match f.source {
            rollfleet_planner::profile::Source::Model => "model assumption".to_owned(),
            rollfleet_planner::profile::Source::Probed => "probed".to_owned(),
            rollfleet_planner::profile::Source::Measured => format!(
                "{}: median of {}, spread {:.1} points",
                if f.modelled {
                    "measured on emulated or simulated hardware (the model's own figures)"
                } else {
                    "measured"
                },
                counted(f.samples, "sample", "samples"),
                f.spread.unwrap_or(0.0) * 100.0
            ),
        };
        writeln!(
            out,
            "  {:<10} {:<26} {:>5.1}%  {source}",
            f.pool,
            what,
            f.share * 100.0
        )?;
    }
    writeln!(out, "\nwhy:")?;
    for r in &p.roles {
        writeln!(out, "  {} on {}: {}", r.role, r.pool, r.why)?;
    }
    if let (Some(search_s), Some(plan_s)) = (o.affinity_over_search_s, o.affinity_plan_s) {
        writeln!(
            out,
            "\nplacement: RollArt's affinity mapping (prefill on the compute-rich pools, decode on \
             the others), its trainer sized by the full prediction; compared with the exact \
             search's optimum by its first-order objective (each degree checked by the full \
             prediction) as the full prediction without the \
             refills' burst (which it still misses on replicas that also decode): {plan_s:.1} s \
             per step against {search_s:.1} s"
        )?;
    }
    if let Some(r) = &o.replaced {
        writeln!(
            out,
            "\nplacement: the {} placement, predicted faster than the search's choice by more \
             than the prediction can rank ({:.0}%): {:.1} s per step against {:.1} s",
            r.by,
            search::PREDICTION_TIE * 100.0,
            r.plan_s,
            r.replaced_s
        )?;
    }
    if !o.compared.is_empty() {
        writeln!(out, "\ncompared (predicted):")?;
        for c in &o.compared {
            writeln!(
                out,
                "  {:<9} {:.1} s per step, {:.2} trajectories/s: the plan is {:.2}x faster{}",
                c.placement,
                c.step_s,
                c.trajectories_per_s,
                c.plan_speedup,
                if c.plan_speedup < 1.0 {
                    " (a tie: closer than the prediction can rank)"
                } else {
                    ""
                }
            )?;
        }
    }
    Ok(())
}
