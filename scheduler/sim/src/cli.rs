//! The `rollfleet sim` command: arguments, and the function that runs it.
//!
//! The `rollfleet` binary flattens [`SimArgs`] into its `sim` subcommand and calls [`run`] with
//! its global `-o/--output` format. Progress goes to `stderr`; the table or JSON to `stdout`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use rollfleet_spec::{Distribution, load_job_file};

use crate::baseline::Baseline;
use crate::hardware::HardwareModel;
use crate::placement::{ChoiceError, PlacementChoice, choose, choose_planned};
use crate::report::{SimReport, policy_report, render_table};
use crate::sim::{RunError, SimOptions, simulate};
use crate::window::{WindowChoice, choose_window, widening_label};
use crate::workload::AZURE_ATTRIBUTION;

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OutputFormat {
    /// A table for people.
    #[default]
    Table,
    /// JSON for programs (byte-identical for the same job and seed).
    Json,
}

/// Arguments of `rollfleet sim`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// The job spec (YAML).
    #[arg(value_name = "JOB")]
    pub job: PathBuf,
    /// Policy to simulate; repeat for several (default: all of them).
    #[arg(long = "baseline", value_enum, value_name = "NAME")]
    pub baselines: Vec<Baseline>,
    /// Seed of every random draw.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write a per-pool utilisation timeline (SVG) here.
    #[arg(long, value_name = "PATH")]
    pub timeline: Option<PathBuf>,
    /// A cluster inventory (`pools: [...]`, as in a job spec) to run the job on instead of its
    /// own pools.
    #[arg(long, value_name = "PATH")]
    pub inventory: Option<PathBuf>,
    /// Override the number of RL steps of the job.
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Override the job's staleness bound (`maxStaleness`), which rollfleet and `areal-like`
    /// keep: `--max-staleness 1` compares them with `one-step-off` at equal staleness.
    #[arg(long, value_name = "VERSIONS")]
    pub max_staleness: Option<u64>,
    /// Inject replica failures with this mean time between failures across the fleet (seconds).
    #[arg(long, value_name = "SECONDS")]
    pub failure_mtbf: Option<f64>,
    /// Placement of every policy but `sync` (which keeps its colocated one): the planner's
    /// (`plan`), the core's stand-in rule (`default`), every role spread evenly (`uniform`), or
    /// everything on the most powerful GPU (`best-gpu`).
    #[arg(long, value_enum, default_value_t = PlacementChoice::Plan, value_name = "NAME")]
    pub placement: PlacementChoice,
    /// Write the `rollfleet` policy's measured profiles (every simulated prefill batch and
    /// decode iteration, as shares of peak per work kind and pool) here, as a profile store
    /// (`rollfleet plan --profiles`, `rollfleet profile show|import` read it).
    #[arg(long, value_name = "FILE")]
    pub profiles_out: Option<PathBuf>,
    /// Share of peak FLOP/s the simulated GPUs achieve (default 0.6, as the planner assumes);
    /// set it apart from the planner's assumption to see a measured profile correct the plan.
    #[arg(long, value_name = "SHARE")]
    pub sim_compute_efficiency: Option<f64>,
    /// Share of peak memory bandwidth the simulated GPUs achieve (default 0.8, as the planner
    /// assumes).
    #[arg(long, value_name = "SHARE")]
    pub sim_bandwidth_efficiency: Option<f64>,
    /// Lose part of a GPU pool for good as a step is published, e.g. `h20:0.333@10`: the
    /// pool's serving replicas covering that share of its GPUs go (highest-numbered first), and
    /// the report compares the steps after with the smaller cluster run on its own plan.
    #[arg(long, value_name = "POOL:FRACTION@STEP")]
    pub lose: Option<String>,
    /// Add GPUs to a pool as a step is published, e.g. `h20:80@10`: the planner plans for the
    /// bigger cluster and the run moves to the new plan in waves (replicas started and retired
    /// mid-run, rollout never stopped); the report compares the steps after with the bigger
    /// cluster run on its own plan.
    #[arg(long, value_name = "POOL:GPUS@STEP")]
    pub grow: Option<String>,
    /// Slow a GPU pool down as a step is published, e.g. `h20:0.4@5`: from then on its GPUs
    /// achieve that share of the rates the simulator models (a throttled node, a bad driver).
    #[arg(long, value_name = "POOL:SHARE@STEP")]
    pub slow: Option<String>,
    /// Re-plan (rollfleet's run, on the plan's placement) whenever the prefill or decode share
    /// of peak a pool's replicas measure drifts from the one the running plan assumed by more
    /// than this relative margin (e.g. 0.2), once the pool's other kind of work is measured
    /// afresh, and move to the new plan in waves when the planner predicts it saves at least 5%
    /// of the step (docs/planner.md, re-planning on drift).
    #[arg(long, value_name = "MARGIN")]
    pub replan_on_drift: Option<f64>,
}

impl SimArgs {
    /// `rollfleet sim JOB` with every option at its default: every policy, seed 0, the
    /// planner's placement.
    pub fn new(job: PathBuf) -> SimArgs {
        SimArgs {
            job,
            baselines: Vec::new(),
            seed: 0,
            timeline: None,
            inventory: None,
            steps: None,
            max_staleness: None,
            failure_mtbf: None,
            placement: PlacementChoice::Plan,
            profiles_out: None,
            sim_compute_efficiency: None,
            sim_bandwidth_efficiency: None,
            lose: None,
            grow: None,
            slow: None,
            replan_on_drift: None,
        }
    }
}

/// Why `rollfleet sim` failed.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The job spec is invalid.
    #[error(transparent)]
    Spec(#[from] rollfleet_spec::SpecError),
    /// No placement fits the job.
    #[error("{policy}: {source}")]
    Placement {
        /// The policy.
        policy: String,
        /// Why.
        source: rollfleet_core::PlacementError,
    },
    /// A policy could not choose its placement.
    #[error("{policy}: choosing its placement: {source}")]
    Choose {
        /// The policy.
        policy: String,
        /// Why.
        source: crate::best::ChoiceFailed,
    },
    /// A run failed.
    #[error("{policy}: {source}")]
    Run {
        /// The policy.
        policy: String,
        /// Why.
        source: RunError,
    },
    /// The chosen placement could not be made.
    #[error("--placement {choice}: {source}")]
    Choice {
        /// The choice.
        choice: &'static str,
        /// Why.
        source: ChoiceError,
    },
    /// An argument is out of range.
    #[error("{0}")]
    Argument(String),
    /// Writing output failed.
    #[error("cannot write output: {0}")]
    Io(#[from] std::io::Error),
    /// JSON serialisation failed.
    #[error("cannot serialise the report: {0}")]
    Json(#[from] serde_json::Error),
}

fn uses_trace(spec: &rollfleet_spec::JobSpec) -> bool {
    spec.tasks.iter().any(|t| {
        [
            &t.prompt_tokens,
            &t.action_tokens,
            &t.observation_tokens,
            &t.env_step_ms,
        ]
        .into_iter()
        .chain(t.turns.as_ref())
        .any(|d| matches!(**d, Distribution::Trace { .. }))
    })
}

/// Simulates `spec` (the cluster after a loss or a growth) on its own plan from the start, as
/// the reference of a run whose cluster changed mid-run; returns the run and its lower bound.
fn reference_run(
    spec: &rollfleet_spec::JobSpec,
    catalog: &rollfleet_catalog::Catalog,
    opts: &SimOptions,
    cluster: &'static str,
    stderr: &mut dyn Write,
) -> Result<(crate::sim::RunResult, f64), SimError> {
    let policy_name = || format!("rollfleet ({cluster} cluster)");
    let (placement, _) =
        choose(PlacementChoice::Plan, spec, catalog).map_err(|source| SimError::Choice {
            choice: "plan (of the changed cluster)",
            source,
        })?;
    let (placement, policy) = Baseline::Rollfleet
        .setup_with(spec, catalog, placement)
        .map_err(|source| SimError::Placement {
            policy: policy_name(),
            source,
        })?;
    let reference_opts = SimOptions {
        pool_loss: None,
        migration: None,
        ..opts.clone()
    };
    let policy = tuned(spec, catalog, &placement, policy, &reference_opts)?.0;
    let _ = writeln!(
        stderr,
        "simulating the {cluster} cluster on its own plan, for reference"
    );
    let reference = simulate(
        spec,
        catalog,
        placement,
        policy,
        &reference_opts,
        &mut |_, _| {},
    )
    .map_err(|source| SimError::Run {
        policy: policy_name(),
        source,
    })?;
    let bound = crate::report::run_bound(spec, catalog, &opts.hardware, &reference).step_s;
    Ok((reference, bound))
}

/// `policy` with its admission window chosen for `placement` by simulation (`crate::window`),
/// and the choice.
fn tuned(
    spec: &rollfleet_spec::JobSpec,
    catalog: &rollfleet_catalog::Catalog,
    placement: &rollfleet_core::Placement,
    policy: rollfleet_core::Policy,
    opts: &SimOptions,
) -> Result<(rollfleet_core::Policy, WindowChoice), SimError> {
    let window =
        choose_window(spec, catalog, placement, &policy, opts).map_err(|source| SimError::Run {
            policy: "rollfleet (choosing its admission window)".into(),
            source,
        })?;
    let policy = rollfleet_core::Policy {
        window_widening_quarters: window.widening_quarters,
        ..policy
    };
    Ok((policy, window))
}

/// Simulates the smaller cluster on its own plan and compares the run that lost part of a pool
/// with it.
fn recover(
    spec: &rollfleet_spec::JobSpec,
    catalog: &rollfleet_catalog::Catalog,
    loss: &crate::sim::PoolLoss,
    run: &crate::sim::RunResult,
    opts: &SimOptions,
    stderr: &mut dyn Write,
) -> Result<Option<crate::loss::Recovery>, SimError> {
    let Some(lost) = &run.loss else {
        return Ok(None);
    };
    let smaller = crate::loss::smaller_spec(spec, loss, lost.gpus);
    let (reference, bound) = reference_run(&smaller, catalog, opts, "smaller", stderr)?;
    let replan = crate::loss::replan(spec, catalog, loss, lost.gpus);
    Ok(crate::loss::recovery(
        spec, loss, run, &reference, bound, replan,
    ))
}

/// Simulates the bigger cluster on its own plan and compares the run that grew with it.
fn catch_up(
    spec: &rollfleet_spec::JobSpec,
    catalog: &rollfleet_catalog::Catalog,
    growth: &crate::growth::PoolGrowth,
    replan: crate::growth::Replan,
    run: &crate::sim::RunResult,
    opts: &SimOptions,
    stderr: &mut dyn Write,
) -> Result<Option<crate::growth::GrowthReport>, SimError> {
    let bigger = crate::growth::bigger_spec(spec, growth);
    let (reference, bound) = reference_run(&bigger, catalog, opts, "bigger", stderr)?;
    Ok(crate::growth::compare(
        spec, growth, replan, run, &reference, bound,
    ))
}

/// Runs the simulation the arguments describe and prints its report.
pub fn run(
    args: &SimArgs,
    output: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<(), SimError> {
    let job = load_job_file(&args.job)?;
    let job = match &args.inventory {
        Some(path) => job.with_inventory_file(path)?,
        None => job,
    };
    let mut spec = job.spec().clone();
    if let Some(steps) = args.steps {
        if steps == 0 || steps > 1_000_000 {
            return Err(SimError::Argument(format!(
                "--steps must be in 1..=1000000, got {steps}"
            )));
        }
        spec.rl.steps = steps as i64;
    }
    if let Some(staleness) = args.max_staleness {
        if staleness > 64 {
            return Err(SimError::Argument(format!(
                "--max-staleness must be in 0..=64 versions, got {staleness}"
            )));
        }
        spec.rl.max_staleness = staleness as i64;
    }
    if let Some(m) = args.failure_mtbf
        && !(m.is_finite() && m > 0.0)
    {
        return Err(SimError::Argument(format!(
            "--failure-mtbf must be a positive number, got {m}"
        )));
    }
    let baselines: Vec<Baseline> = if args.baselines.is_empty() {
        Baseline::ALL.to_vec()
    } else {
        let mut b = args.baselines.clone();
        b.sort();
        b.dedup();
        b
    };
    if args.profiles_out.is_some() && !baselines.contains(&Baseline::Rollfleet) {
        return Err(SimError::Argument(
            "--profiles-out writes the rollfleet policy's profiles: add --baseline rollfleet"
                .into(),
        ));
    }
    let mut hw = HardwareModel::default();
    for (flag, value, field) in [
        (
            "--sim-compute-efficiency",
            args.sim_compute_efficiency,
            &mut hw.compute_efficiency,
        ),
        (
            "--sim-bandwidth-efficiency",
            args.sim_bandwidth_efficiency,
            &mut hw.bandwidth_efficiency,
        ),
    ] {
        if let Some(v) = value {
            if !(v.is_finite() && v > 0.0 && v <= 1.0) {
                return Err(SimError::Argument(format!(
                    "{flag} must be a share of peak in (0, 1], got {v}"
                )));
            }
            *field = v;
        }
    }
    let pool_loss = match &args.lose {
        Some(arg) => Some(crate::loss::parse(arg, &spec).map_err(SimError::Argument)?),
        None => None,
    };
    if pool_loss.is_some() && args.grow.is_some() {
        return Err(SimError::Argument(
            "--lose and --grow each compare with a cluster of their own: give one".into(),
        ));
    }
    let growth = match &args.grow {
        Some(arg) => {
            let growth = crate::growth::parse(arg, &spec).map_err(SimError::Argument)?;
            let (migration, replan) = crate::growth::replan_growth(&spec, &job.catalog, &growth)
                .map_err(|e| SimError::Argument(format!("--grow {arg}: {e}")))?;
            Some((growth, migration, replan))
        }
        None => None,
    };
    let planned =
        choose_planned(args.placement, &spec, &job.catalog).map_err(|source| SimError::Choice {
            choice: args.placement.name(),
            source,
        })?;
    let chosen = planned.placement.clone();
    // After a loss, the planner's re-plan for the smaller cluster, applied in waves (on the
    // plan's placement only: the waves start from the plan).
    let loss_migration = match &pool_loss {
        Some(loss) if args.placement == PlacementChoice::Plan => {
            let count = spec
                .pools
                .get(loss.pool as usize)
                .and_then(|p| p.count)
                .unwrap_or(0)
                .max(0) as f64;
            let serving: Vec<(u32, u32, bool)> = chosen
                .replicas
                .iter()
                .map(|r| (r.pool, r.gpus, true))
                .collect();
            let (_, gpus) = crate::loss::replicas_lost(&serving, loss, count);
            crate::growth::loss_waves(&spec, &job.catalog, loss.pool, gpus)
                .filter(|waves| !waves.is_empty())
                .map(|waves| crate::sim::Migration {
                    at_step: loss.at_step,
                    added_gpus: Vec::new(),
                    waves,
                })
        }
        _ => None,
    };
    let slowdown = match &args.slow {
        Some(arg) => Some(crate::drift::parse(arg, &spec).map_err(SimError::Argument)?),
        None => None,
    };
    if let Some(margin) = args.replan_on_drift {
        if !(margin.is_finite() && margin > 0.0) {
            return Err(SimError::Argument(format!(
                "--replan-on-drift must be a positive relative margin, got {margin}"
            )));
        }
        if args.placement != PlacementChoice::Plan {
            return Err(SimError::Argument(
                "--replan-on-drift re-plans from the plan: use --placement plan".into(),
            ));
        }
    }
    let opts = SimOptions {
        seed: args.seed,
        failure_mtbf_s: args.failure_mtbf,
        hardware: hw,
        pool_loss,
        slowdown,
        migration: growth
            .as_ref()
            .map(|(_, m, _)| m.clone())
            .or(loss_migration),
        ..SimOptions::default()
    };
    // rollfleet's admission window, chosen on its placement (its only candidate) before the
    // runs, so that the planner's prediction is made for the window it runs with.
    let rollfleet_window = if baselines.contains(&Baseline::Rollfleet) {
        let policy = rollfleet_core::Policy::rollfleet(&spec);
        let (_, window) = tuned(&spec, &job.catalog, &chosen, policy, &opts)?;
        let _ = writeln!(
            stderr,
            "rollfleet: admission window {} (per step over the first {} steps on {} seeds of its own: {})",
            widening_label(window.widening_quarters),
            spec.rl.steps.clamp(1, crate::window::TUNING_STEPS),
            crate::window::TUNING_SEEDS,
            window.describe()
        );
        Some(window)
    } else {
        None
    };
    // The prediction is made for the window rollfleet runs with, on the same placement.
    let predicted = match &rollfleet_window {
        Some(window) if window.widening_quarters != 0 => {
            planned.predicted_widened(window.widening_quarters)
        }
        _ => planned.prediction,
    };
    if let Some(p) = &predicted {
        let _ = writeln!(
            stderr,
            "placement {}: the planner predicts {:.1} s per step in steady state, {:.1} s averaged over the job's steps ({:.2} trajectories/s) for rollfleet",
            args.placement.name(),
            p.step_s,
            p.job_step_s,
            p.trajectories_per_s
        );
    }
    // The planner's best uniform placement: AReaL's (it has no placement by work kind), and a
    // candidate of the batched disaggregated baselines.
    let uniform = if args.placement == PlacementChoice::Uniform {
        chosen.clone()
    } else {
        choose(PlacementChoice::Uniform, &spec, &job.catalog)
            .map_err(|source| SimError::Choice {
                choice: PlacementChoice::Uniform.name(),
                source,
            })?
            .0
    };
    let mut runs = Vec::new();
    let mut choices = Vec::new();
    for baseline in &baselines {
        let name = baseline.name();
        let candidates = crate::best::candidates(
            *baseline,
            &spec,
            &job.catalog,
            (args.placement.name(), &chosen),
            &uniform,
        )
        .map_err(|source| SimError::Placement {
            policy: name.into(),
            source,
        })?;
        let (candidate, probes) =
            crate::best::pick(*baseline, &spec, &job.catalog, candidates, &opts).map_err(
                |source| SimError::Choose {
                    policy: name.into(),
                    source,
                },
            )?;
        if !probes.is_empty() {
            let tried: Vec<String> = probes
                .iter()
                .map(|p| format!("{} {:.1} s", p.label, p.step_s))
                .collect();
            let _ = writeln!(
                stderr,
                "{name}: runs on {} (per step over the first {} steps: {})",
                candidate.label,
                crate::best::PROBE_STEPS,
                tried.join(", ")
            );
        }
        choices.push((candidate.label.clone(), probes));
        let (placement, mut policy) = baseline
            .setup_with(&spec, &job.catalog, candidate.placement)
            .map_err(|source| SimError::Placement {
                policy: name.into(),
                source,
            })?;
        if let (Baseline::Rollfleet, Some(window)) = (baseline, &rollfleet_window) {
            policy.window_widening_quarters = window.widening_quarters;
        }
        let started = Instant::now();
        let steps = spec.rl.steps;
        let mut progress = |step: u64, at: f64| {
            let _ = writeln!(stderr, "  {name}: step {step}/{steps} at {at:.0} virtual s");
        };
        // Only rollfleet's own run re-plans on drift.
        let run_opts = SimOptions {
            replan_on_drift: args
                .replan_on_drift
                .filter(|_| *baseline == Baseline::Rollfleet),
            ..opts.clone()
        };
        let result = simulate(
            &spec,
            &job.catalog,
            placement,
            policy,
            &run_opts,
            &mut progress,
        )
        .map_err(|source| SimError::Run {
            policy: name.into(),
            source,
        })?;
        let wall = started.elapsed().as_secs_f64().max(1e-9);
        let _ = writeln!(
            stderr,
            "{name}: {:.0} virtual s in {wall:.2} s wall; {} scheduler events ({:.2} M/s), {} sim events",
            result.makespan_s,
            result.scheduler_events,
            result.scheduler_events as f64 / wall / 1e6,
            result.sim_events
        );
        runs.push((name.to_owned(), result));
    }
    let reference = crate::reference::reference(&spec, &job.catalog, &hw, args.seed);
    let mut policies: Vec<_> = runs
        .iter()
        .zip(choices)
        .map(|((name, r), (label, probes))| {
            let mut report = policy_report(name, &spec, &job.catalog, &hw, r, &reference);
            report.placement = label;
            report.placement_probes = probes;
            if name == Baseline::Rollfleet.name() {
                report.admission_window = rollfleet_window.clone();
            }
            report
        })
        .collect();
    if let Some(sync) = policies
        .iter()
        .find(|p| p.policy == "sync")
        .map(|p| p.step_time_s)
    {
        for p in &mut policies {
            p.speedup_vs_sync = Some(sync / p.step_time_s.max(1e-12));
        }
    }
    let loss_recovery = match (&pool_loss, runs.iter().find(|(n, _)| n == "rollfleet")) {
        (Some(loss), Some((_, run))) => recover(&spec, &job.catalog, loss, run, &opts, stderr)?,
        _ => None,
    };
    let growth = match (growth, runs.iter().find(|(n, _)| n == "rollfleet")) {
        (Some((growth, _, replan)), Some((_, run))) => {
            catch_up(&spec, &job.catalog, &growth, replan, run, &opts, stderr)?
        }
        _ => None,
    };
    let attribution = uses_trace(&spec).then(|| AZURE_ATTRIBUTION.to_owned());
    let group_lives = runs
        .iter()
        .find(|(n, _)| n == Baseline::Rollfleet.name())
        .map(|(_, r)| {
            crate::report::group_lives(
                &spec,
                &r.core,
                predicted.as_ref().map(|p| p.task_lives.as_slice()),
            )
        })
        .unwrap_or_default();
    // No schedule of the job's trajectories beats the fixed yardstick, so a prediction below it
    // is wrong by at least the gap: it is raised to the yardstick, and the report says so.
    let model_step_s = predicted.map(|p| p.job_step_s);
    let predicted_step_s = model_step_s.map(|t| t.max(reference.bound.step_s));
    let report = SimReport {
        job: job.manifest.metadata.name.clone(),
        placement: args.placement.name().to_owned(),
        predicted_step_s,
        predicted_below_yardstick: model_step_s.filter(|&t| t < reference.bound.step_s),
        seed: args.seed,
        hardware: hw,
        data_attribution: attribution.clone(),
        reference,
        policies,
        group_lives,
        loss_recovery,
        growth,
        drift_replans: runs
            .iter()
            .find(|(n, _)| n == "rollfleet")
            .map(|(_, r)| r.drift_replans.clone())
            .unwrap_or_default(),
    };
    if let Some(path) = &args.timeline {
        let refs: Vec<(String, &crate::sim::RunResult)> =
            runs.iter().map(|(n, r)| (n.clone(), r)).collect();
        std::fs::write(
            path,
            crate::svg::timeline(
                &job.manifest.metadata.name,
                &spec,
                &refs,
                attribution.as_deref(),
            ),
        )?;
    }
    if let Some(path) = &args.profiles_out
        && let Some((_, r)) = runs.iter().find(|(n, _)| n == Baseline::Rollfleet.name())
    {
        let mut text = serde_json::to_string_pretty(&r.profiles)?;
        text.push('\n');
        std::fs::write(path, text)?;
        let _ = writeln!(
            stderr,
            "wrote the simulated rollfleet run's measured profiles to {}",
            path.display()
        );
    }
    match output {
        OutputFormat::Table => stdout.write_all(render_table(&report).as_bytes())?,
        OutputFormat::Json => {
            serde_json::to_writer_pretty(&mut *stdout, &report)?;
            stdout.write_all(b"\n")?;
        }
    }
    Ok(())
}
