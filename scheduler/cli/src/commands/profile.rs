//! `rollfleet profile show|export|import`: the profiles the planner uses, from the model,
//! measured online and probed on the node, saved and loaded as JSON files.
//!
//! - `show JOB [--profiles FILE]`: per GPU pool and kind of work, the roofline (arithmetic
//!   intensity against the ridge point, the binding roof, seconds and dollars for a typical shape
//!   of the job) and the achieved share of peak in effect, with its source;
//! - `export --to FILE [--profiles FILE] [--probe]`: writes a profile store; `--probe` adds this
//!   node's probed GPUs (on a machine without a GPU it says so and adds nothing);
//! - `import FILE [--into FILE]`: checks a store and prints what it holds; with `--into`, merges
//!   it into another store file (measured samples appended, probes replaced).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rollfleet_planner::profile::{Estimate, Origin, Probed, ProfileStore};
use rollfleet_planner::roofline::{Efficiency, GpuRates, Shapes, WorkKind, profile_rows};
use rollfleet_planner::workload::Workload;
use rollfleet_sim::workload::mean;
use rollfleet_spec::{PoolKind, load_job_file};
use serde::Serialize;

use crate::output::{OutputFormat, Table, counted, exit, write_structured};

/// `rollfleet profile`.
#[derive(Debug, clap::Subcommand)]
pub enum ProfileCommand {
    /// The profiles of a job's GPU pools: roofline and the achieved share of peak in effect.
    #[command(after_help = "Examples:\n  \
        rollfleet profile show examples/jobs/rollart-agentic.yaml\n  \
        rollfleet profile show JOB.yaml --profiles cluster-profiles.json -o json")]
    Show {
        /// The job spec (YAML).
        #[arg(value_name = "JOB")]
        job: PathBuf,
        /// A profile store (JSON) with measured or probed figures.
        #[arg(long, value_name = "FILE")]
        profiles: Option<PathBuf>,
    },
    /// Write a profile store (JSON), optionally with this node's probed GPUs.
    #[command(after_help = "Examples:\n  \
        rollfleet profile export --to profiles.json --probe\n  \
        rollfleet profile export --profiles old.json --to new.json")]
    Export {
        /// Where to write it.
        #[arg(long, value_name = "FILE")]
        to: PathBuf,
        /// Start from this store.
        #[arg(long, value_name = "FILE")]
        profiles: Option<PathBuf>,
        /// Probe this node's GPUs (CUDA GEMM and copy) and add their figures.
        #[arg(long)]
        probe: bool,
    },
    /// Check a profile store and print what it holds; `--into` merges it into another.
    #[command(after_help = "Examples:\n  \
        rollfleet profile import shared.json\n  \
        rollfleet profile import shared.json --into profiles.json")]
    Import {
        /// The store to read.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Merge into this store file (created if missing).
        #[arg(long, value_name = "FILE")]
        into: Option<PathBuf>,
    },
}

/// Largest profile file accepted: a store of every pool and kind at full windows is well below.
const MAX_PROFILE_BYTES: u64 = 64 * 1024 * 1024;

/// Reads and checks a profile store.
pub fn read_store(path: &Path) -> Result<ProfileStore> {
    let size = std::fs::metadata(path)
        .with_context(|| format!("{}: cannot read", path.display()))?
        .len();
    if size > MAX_PROFILE_BYTES {
        anyhow::bail!(
            "{}: {size} bytes is too large for a profile store",
            path.display()
        );
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let store: ProfileStore =
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(&text))
            .map_err(|e| anyhow::anyhow!("{}: {}: {}", path.display(), e.path(), e.inner()))?;
    for (kind, pools) in &store.measured {
        for (pool, e) in pools {
            if let Some(bad) = e
                .samples
                .iter()
                .find(|v| !(v.is_finite() && **v > 0.0 && **v <= 1.5))
            {
                anyhow::bail!(
                    "{}: measured.{}.{pool}: sample {bad} is not a share of peak in (0, 1.5]",
                    path.display(),
                    kind.name()
                );
            }
        }
    }
    use rollfleet_planner::profile::MAX_TIMED_SECONDS as MAX_TIMED_S;
    for (section, map) in [
        ("environmentSteps", &store.environment_steps),
        ("rewards", &store.rewards),
    ] {
        for (name, e) in map {
            let seconds = |v: f64| v.is_finite() && v > 0.0 && v <= MAX_TIMED_S;
            if let Some(bad) = e.samples.iter().find(|v| !seconds(**v)) {
                anyhow::bail!(
                    "{}: {section}.{name}: sample {bad} is not a duration in (0, {MAX_TIMED_S}] s",
                    path.display()
                );
            }
            let mean_ok = e.lifetime_mean().is_none_or(seconds);
            if !(e.sum.is_finite() && e.sum >= 0.0 && mean_ok) {
                anyhow::bail!(
                    "{}: {section}.{name}: sum {} over {} is not a mean duration in (0, \
                     {MAX_TIMED_S}] s",
                    path.display(),
                    e.sum,
                    counted(e.total, "sample", "samples")
                );
            }
        }
    }
    for (gpu, p) in &store.probed {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !(positive(p.gemm_flops) && positive(p.memory_bandwidth_bytes_per_s)) {
            anyhow::bail!("{}: probed.{gpu}: figures must be positive", path.display());
        }
    }
    Ok(store)
}

#[derive(Serialize)]
struct Row {
    pool: String,
    gpu: String,
    kind: WorkKind,
    shape: String,
    intensity: f64,
    ridge: f64,
    bound: &'static str,
    seconds: f64,
    cost_usd: f64,
    share_of_peak: f64,
    source: rollfleet_planner::profile::Source,
    /// `source` as users read it (says when a measured figure came from emulated hardware).
    label: &'static str,
    spread: Option<f64>,
    samples: usize,
}

/// A duration profile of `rollfleet profile show`: an environment step of a task or a reward of
/// a reward function, from the job spec or measured.
#[derive(Debug, Serialize)]
struct TimedRow {
    /// `environment-step` or `reward`.
    work: &'static str,
    /// The task or reward function.
    name: String,
    /// Mean seconds of the job spec's distribution.
    spec_mean_s: f64,
    /// Mean seconds of the measured window, once it has enough samples.
    measured_mean_s: Option<f64>,
    /// Median and median absolute deviation of the measured window.
    measured_median_s: Option<f64>,
    spread_s: Option<f64>,
    samples: usize,
    /// What the planner uses: the measured mean once there are enough samples, else the spec's.
    in_effect_s: f64,
    source: &'static str,
}

/// The timed profiles of a job: every task's environment step, every reward function.
fn timed_rows(spec: &rollfleet_spec::JobSpec, store: &ProfileStore) -> Vec<TimedRow> {
    use rollfleet_planner::profile::{Estimate, Timed};
    let row = |work, what, name: &str, spec_mean_s: f64, e: Option<&Estimate>| {
        let measured = store.timed_mean(what, name);
        let samples = e.map_or(0, |e| e.samples.len());
        let source = match measured {
            None if samples > 0 => "job spec (too few samples)",
            None => "job spec",
            Some(_) if e.is_some_and(Estimate::modelled) => "measured (emulated or simulated)",
            Some(_) => "measured",
        };
        TimedRow {
            work,
            name: name.to_owned(),
            spec_mean_s,
            measured_mean_s: measured,
            measured_median_s: e.and_then(Estimate::median),
            spread_s: e.and_then(Estimate::mad),
            samples,
            in_effect_s: measured.unwrap_or(spec_mean_s),
            source,
        }
    };
    let mut rows: Vec<TimedRow> = spec
        .tasks
        .iter()
        .map(|t| {
            row(
                "environment-step",
                Timed::EnvironmentStep,
                &t.name,
                mean(&t.env_step_ms) / 1000.0,
                store.environment_steps.get(&t.name),
            )
        })
        .collect();
    rows.extend(spec.rewards.iter().map(|r| {
        row(
            "reward",
            Timed::Reward,
            &r.name,
            mean(&r.latency_ms) / 1000.0,
            store.rewards.get(&r.name),
        )
    }));
    rows
}

/// Runs the command; returns the exit code.
pub fn run(
    command: &ProfileCommand,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    match command {
        ProfileCommand::Show { job, profiles } => {
            show(job, profiles.as_deref(), format, stdout, stderr)
        }
        ProfileCommand::Export {
            to,
            profiles,
            probe,
        } => {
            let mut store = match profiles {
                Some(p) => match read_store(p) {
                    Ok(s) => s,
                    Err(e) => {
                        writeln!(stderr, "error: {e:#}")?;
                        return Ok(exit::INVALID_INPUT);
                    }
                },
                None => ProfileStore::default(),
            };
            if *probe {
                probe_into(&mut store, stderr)?;
            }
            let json = serde_json::to_string_pretty(&store)?;
            std::fs::write(to, json + "\n")
                .with_context(|| format!("{}: cannot write", to.display()))?;
            let estimates = store.measured.values().map(|m| m.len()).sum::<usize>();
            writeln!(
                stderr,
                "wrote {}: {estimates} measured (kind, pool) {}, {}",
                to.display(),
                if estimates == 1 {
                    "estimate"
                } else {
                    "estimates"
                },
                counted(
                    store.probed.len(),
                    "probed GPU product",
                    "probed GPU products"
                )
            )?;
            Ok(exit::OK)
        }
        ProfileCommand::Import { file, into } => {
            let incoming = match read_store(file) {
                Ok(s) => s,
                Err(e) => {
                    writeln!(stderr, "error: {e:#}")?;
                    return Ok(exit::INVALID_INPUT);
                }
            };
            let mut summary = Table::new(&[
                "source",
                "kind",
                "pool, gpu, task or function",
                "samples>",
                "median share or s>",
                "spread>",
            ]);
            for (kind, pools) in &incoming.measured {
                for (pool, e) in pools {
                    summary.row(vec![
                        if e.modelled() {
                            "measured (emulated or simulated)".into()
                        } else {
                            "measured".into()
                        },
                        kind.name().into(),
                        pool.clone(),
                        e.samples.len().to_string(),
                        e.median().map_or("-".into(), |m| format!("{m:.3}")),
                        e.mad().map_or("-".into(), |m| format!("{m:.3}")),
                    ]);
                }
            }
            for (kind, map) in [
                ("environment step", &incoming.environment_steps),
                ("reward", &incoming.rewards),
            ] {
                for (name, e) in map {
                    summary.row(vec![
                        if e.modelled() {
                            "measured (emulated or simulated)".into()
                        } else {
                            "measured".into()
                        },
                        kind.into(),
                        name.clone(),
                        e.samples.len().to_string(),
                        e.median().map_or("-".into(), |m| format!("{m:.3} s")),
                        e.mad().map_or("-".into(), |m| format!("{m:.3} s")),
                    ]);
                }
            }
            for (gpu, p) in &incoming.probed {
                summary.row(vec![
                    "probed".into(),
                    "gemm / copy".into(),
                    gpu.clone(),
                    "-".into(),
                    format!("{:.0} TFLOP/s", p.gemm_flops / 1e12),
                    format!("{:.0} GB/s", p.memory_bandwidth_bytes_per_s / 1e9),
                ]);
            }
            match format {
                OutputFormat::Table => summary.write(stdout)?,
                _ => write_structured(format, &incoming, stdout)?,
            }
            if let Some(target) = into {
                let mut base = if target.exists() {
                    match read_store(target) {
                        Ok(s) => s,
                        Err(e) => {
                            writeln!(stderr, "error: {e:#}")?;
                            return Ok(exit::INVALID_INPUT);
                        }
                    }
                } else {
                    ProfileStore::default()
                };
                merge(&mut base, incoming);
                std::fs::write(target, serde_json::to_string_pretty(&base)? + "\n")
                    .with_context(|| format!("{}: cannot write", target.display()))?;
                writeln!(stderr, "merged into {}", target.display())?;
            }
            Ok(exit::OK)
        }
    }
}

/// Appends measured samples (keeping each window's limit) and replaces probes.
fn merge(base: &mut ProfileStore, incoming: ProfileStore) {
    for (kind, pools) in incoming.measured {
        for (pool, e) in pools {
            let target: &mut Estimate = base
                .measured
                .entry(kind)
                .or_default()
                .entry(pool)
                .or_default();
            // Each sample is added once; the count of modelled ones carries over as it stood.
            for v in e.samples {
                target.add(v, Origin::Hardware);
            }
            target.modelled += e.modelled;
        }
    }
    base.probed.extend(incoming.probed);
    for (name, e) in incoming.environment_steps {
        base.environment_steps.entry(name).or_default().absorb(&e);
    }
    for (name, e) in incoming.rewards {
        base.rewards.entry(name).or_default().absorb(&e);
    }
}

fn probe_into(store: &mut ProfileStore, stderr: &mut dyn Write) -> Result<()> {
    let gpus = match rollfleet_gpu::discover() {
        Ok(g) => g,
        Err(e) => {
            writeln!(stderr, "no probe: {e}; no probed figures added")?;
            return Ok(());
        }
    };
    if gpus.is_empty() {
        writeln!(
            stderr,
            "no probe: no GPU on this node; no probed figures added"
        )?;
    }
    for gpu in gpus {
        match rollfleet_gpu::probe(gpu.index) {
            Ok(r) => match r.catalog_name {
                Some(name) => {
                    writeln!(stderr, "probed GPU {} ({name})", r.index)?;
                    store.probed.insert(
                        name,
                        Probed {
                            gemm_flops: r.gemm_flops,
                            memory_bandwidth_bytes_per_s: r.memory_bandwidth_bytes_per_s,
                        },
                    );
                }
                None => writeln!(
                    stderr,
                    "GPU {} ({}) is not in the catalogue; skipped",
                    r.index, r.name
                )?,
            },
            Err(e) => writeln!(stderr, "GPU {}: probe failed: {e}", gpu.index)?,
        }
    }
    Ok(())
}

fn show(
    job_path: &Path,
    profiles: Option<&Path>,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let job = match load_job_file(job_path) {
        Ok(job) => job,
        Err(e) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    };
    let store = match profiles {
        Some(p) => match read_store(p) {
            Ok(s) => s,
            Err(e) => {
                writeln!(stderr, "error: {e:#}")?;
                return Ok(exit::INVALID_INPUT);
            }
        },
        None => ProfileStore::default(),
    };
    let spec = job.spec();
    let w = Workload::from_spec(spec, &mean);
    let context: f64 = {
        let tokens: f64 = w.tasks.iter().map(|t| t.share * t.turns * t.action).sum();
        w.tasks
            .iter()
            .map(|t| t.share * t.turns * t.action * t.decode_context)
            .sum::<f64>()
            / tokens.max(1e-12)
    };
    let shapes = Shapes {
        prefill_tokens: w
            .tasks
            .iter()
            .map(|t| t.share * t.prompt)
            .sum::<f64>()
            .max(1.0),
        batch: 64.0,
        context,
        train_tokens: w.batch * w.train_tokens(),
    };
    let model_eff = Efficiency::default();
    let mut rows = Vec::new();
    for pool in spec
        .pools
        .iter()
        .filter(|p| p.kind() == Some(PoolKind::Gpu))
    {
        let Some(gpu) = pool.gpu.as_deref().and_then(|g| job.catalog.gpu(g).ok()) else {
            continue;
        };
        let link = spec.network.cross_pool_gbps * 1e9 * model_eff.link;
        for kind in WorkKind::ALL {
            let mut eff = store.effective(
                kind,
                &pool.name,
                &gpu.name,
                gpu.peak_flops(),
                gpu.memory_bandwidth_bytes_per_s(),
                &model_eff,
            );
            // Training runs at the job's `trainMfu` unless measured or probed.
            if kind == WorkKind::Train && eff.source == rollfleet_planner::profile::Source::Model {
                eff.share = spec.rl.train_mfu.clamp(0.01, 1.0);
            }
            let pool_eff = Efficiency {
                compute: if matches!(kind, WorkKind::Prefill | WorkKind::Train) {
                    eff.share
                } else {
                    model_eff.compute
                },
                bandwidth: if kind == WorkKind::Decode {
                    eff.share
                } else {
                    model_eff.bandwidth
                },
                link: model_eff.link,
            };
            let rates = GpuRates::of(gpu, &pool_eff);
            let Some(r) = profile_rows(&spec.model, &rates, &shapes, link)
                .into_iter()
                .find(|r| r.kind == kind)
            else {
                continue;
            };
            rows.push(Row {
                pool: pool.name.clone(),
                gpu: gpu.name.clone(),
                kind,
                shape: r.shape,
                intensity: r.intensity,
                ridge: r.ridge,
                bound: r.bound.name(),
                seconds: r.seconds,
                cost_usd: r.cost_usd,
                share_of_peak: if kind == WorkKind::WeightTransfer {
                    model_eff.link
                } else {
                    eff.share
                },
                source: eff.source,
                label: eff.label(),
                spread: eff.spread,
                samples: eff.samples,
            });
        }
    }
    let timed = timed_rows(spec, &store);
    match format {
        OutputFormat::Table => {
            writeln!(
                stdout,
                "job {}: profiles per GPU pool (model: roofline of published peaks, not measured; \
                 precedence probed > measured > model)\n",
                job.manifest.metadata.name
            )?;
            let mut t = Table::new(&[
                "pool",
                "gpu",
                "work",
                "shape",
                "FLOP/byte>",
                "ridge>",
                "bound",
                "seconds>",
                "USD>",
                "share of peak>",
                "source",
            ]);
            for r in &rows {
                t.row(vec![
                    r.pool.clone(),
                    r.gpu.clone(),
                    r.kind.name().into(),
                    r.shape.clone(),
                    if r.intensity.is_finite() {
                        format!("{:.1}", r.intensity)
                    } else {
                        "-".into()
                    },
                    format!("{:.0}", r.ridge),
                    r.bound.into(),
                    format!("{:.4}", r.seconds),
                    format!("{:.6}", r.cost_usd),
                    match r.spread {
                        Some(s) => format!("{:.2} +- {s:.2}", r.share_of_peak),
                        None => format!("{:.2}", r.share_of_peak),
                    },
                    r.label.into(),
                ]);
            }
            t.write(stdout)?;
            writeln!(
                stdout,
                "\nenvironment steps and rewards (seconds; the planner takes the measured mean \
                 once there are {} samples, else the job spec's)\n",
                rollfleet_planner::profile::MIN_SAMPLES
            )?;
            let mut t = Table::new(&[
                "work",
                "name",
                "spec mean>",
                "measured mean>",
                "median>",
                "samples>",
                "in effect>",
                "source",
            ]);
            let secs = |s: Option<f64>| s.map_or_else(|| "-".to_owned(), |s| format!("{s:.4}"));
            for r in &timed {
                t.row(vec![
                    r.work.into(),
                    r.name.clone(),
                    format!("{:.4}", r.spec_mean_s),
                    secs(r.measured_mean_s),
                    match (r.measured_median_s, r.spread_s) {
                        (Some(m), Some(s)) => format!("{m:.4} +- {s:.4}"),
                        (m, _) => secs(m),
                    },
                    r.samples.to_string(),
                    format!("{:.4}", r.in_effect_s),
                    r.source.into(),
                ]);
            }
            t.write(stdout)?;
        }
        _ => {
            #[derive(Serialize)]
            struct Shown<'a> {
                gpu: &'a [Row],
                timed: &'a [TimedRow],
            }
            write_structured(
                format,
                &Shown {
                    gpu: &rows,
                    timed: &timed,
                },
                stdout,
            )?
        }
    }
    Ok(exit::OK)
}
