//! `rollfleet validate JOB.yaml`: check a job spec and print what it implies.
//!
//! On success it prints the figures every later decision starts from (model cost per token,
//! per-pool peak compute, memory and bandwidth, the smallest tensor-parallel group that holds a
//! replica, the hourly price), so a user sees at once whether the spec says what they meant.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use rollfleet_catalog::Catalog;
use rollfleet_spec::{
    JobManifest, JobSpec, PoolKind, Problem, USABLE_MEMORY_FRACTION, load_job_file, replica_bytes,
};
use serde::Serialize;

use crate::output::{OutputFormat, Table, count, counted, exit, si, write_structured};

/// Arguments of `rollfleet validate`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:\n  \
    rollfleet validate examples/jobs/quickstart.yaml\n  \
    rollfleet validate -o json examples/jobs/rollart-agentic.yaml | jq .derived.pools")]
pub struct ValidateArgs {
    /// The job spec (YAML).
    pub job: PathBuf,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Report<'a> {
    valid: bool,
    file: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    job: Option<&'a JobManifest>,
    #[serde(skip_serializing_if = "Option::is_none")]
    derived: Option<Derived>,
    warnings: Vec<Problem>,
    errors: Vec<Problem>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Derived {
    weight_bytes: f64,
    forward_flops_per_token: f64,
    train_flops_per_token: f64,
    kv_bytes_per_token: f64,
    groups_per_step: i64,
    optimizer_updates_per_step: i64,
    trajectories_started_per_step: i64,
    hourly_price_usd: f64,
    pools: Vec<PoolFigures>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PoolFigures {
    name: String,
    kind: PoolKind,
    device: String,
    count: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_flops: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_bytes: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_bandwidth_bytes_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ridge_point_flop_per_byte: Option<f64>,
    /// Smallest tensor-parallel group (GPUs within one node) that holds one replica.
    #[serde(skip_serializing_if = "Option::is_none")]
    min_tensor_parallel: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    vcpus: Option<i64>,
    hourly_price_usd: f64,
    roles: Vec<String>,
}

/// Runs the command; returns the exit code.
pub fn run(
    args: &ValidateArgs,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let file = args.job.display().to_string();
    match load_job_file(&args.job) {
        Ok(job) => {
            let derived = derive(job.spec(), &job.catalog);
            let report = Report {
                valid: true,
                file,
                job: Some(&job.manifest),
                derived: Some(derived),
                warnings: job.warnings.clone(),
                errors: vec![],
            };
            match format {
                OutputFormat::Table => write_table(&report, stdout)?,
                _ => write_structured(format, &report, stdout)?,
            }
            for warning in &job.warnings {
                writeln!(stderr, "warning: {warning}")?;
            }
            Ok(exit::OK)
        }
        Err(error) => {
            writeln!(stderr, "error: {error}")?;
            if format != OutputFormat::Table {
                let report = Report {
                    valid: false,
                    file,
                    job: None,
                    derived: None,
                    warnings: vec![],
                    errors: error.problems(),
                };
                write_structured(format, &report, stdout)?;
            }
            // A file that cannot be read is input the command cannot use, as a malformed one.
            Ok(exit::INVALID_INPUT)
        }
    }
}

fn derive(spec: &JobSpec, catalog: &Catalog) -> Derived {
    let model = &spec.model;
    let (weights, kv) = replica_bytes(spec);
    let rl = &spec.rl;
    let groups = rl.rollout_batch_size / rl.group_size.max(1);
    let started_groups = (groups as f64 * (1.0 + rl.over_provisioning)).ceil() as i64;
    let mut pools = Vec::new();
    for pool in &spec.pools {
        let roles = if pool.roles.is_empty() {
            vec!["auto".to_owned()]
        } else {
            pool.roles
                .iter()
                .map(|r| format!("{r:?}").to_lowercase())
                .collect()
        };
        let count = pool.count.unwrap_or(0);
        let mut figures = PoolFigures {
            name: pool.name.clone(),
            kind: pool.kind().unwrap_or(PoolKind::Gpu),
            device: String::new(),
            count,
            peak_flops: None,
            memory_bytes: None,
            memory_bandwidth_bytes_per_s: None,
            ridge_point_flop_per_byte: None,
            min_tensor_parallel: None,
            vcpus: None,
            hourly_price_usd: 0.0,
            roles,
        };
        if let Some(gpu) = pool.gpu.as_deref().and_then(|g| catalog.gpu(g).ok()) {
            let per_gpu = gpu.memory_bytes() * USABLE_MEMORY_FRACTION;
            let tp = (1..=pool.gpus_per_node().min(count))
                .find(|tp| *tp as f64 * per_gpu >= weights + kv);
            figures.device = gpu.name.clone();
            figures.peak_flops = Some(gpu.peak_flops() * count as f64);
            figures.memory_bytes = Some(gpu.memory_bytes() * count as f64);
            figures.memory_bandwidth_bytes_per_s =
                Some(gpu.memory_bandwidth_bytes_per_s() * count as f64);
            figures.ridge_point_flop_per_byte = Some(gpu.ridge_point_flop_per_byte());
            figures.min_tensor_parallel = tp;
            figures.hourly_price_usd = gpu.price_per_hour_usd * count as f64;
        } else if let Some(shape) = pool.cpu.as_deref().and_then(|c| catalog.cpu_shape(c).ok()) {
            figures.device = shape.name.clone();
            figures.vcpus = Some(i64::from(shape.vcpus) * count);
            figures.memory_bytes = Some(shape.memory_gib * 1024f64.powi(3) * count as f64);
            figures.hourly_price_usd = shape.price_per_hour_usd * count as f64;
        } else if let Some(platform) = &pool.serverless {
            figures.device = platform.clone();
            figures.count = pool.concurrency.unwrap_or(0);
        }
        pools.push(figures);
    }
    Derived {
        weight_bytes: model.weight_bytes(),
        forward_flops_per_token: model.forward_flops_per_token(),
        train_flops_per_token: model.train_flops_per_token(),
        kv_bytes_per_token: model.kv_bytes_per_token(),
        groups_per_step: groups,
        optimizer_updates_per_step: rl.rollout_batch_size / rl.train_batch_size.max(1),
        trajectories_started_per_step: started_groups * rl.group_size,
        hourly_price_usd: pools.iter().map(|p| p.hourly_price_usd).sum(),
        pools,
    }
}

fn write_table(report: &Report, out: &mut dyn Write) -> Result<()> {
    let (Some(job), Some(derived)) = (report.job, &report.derived) else {
        return Ok(());
    };
    let spec = &job.spec;
    let model = &spec.model;
    writeln!(out, "{}: valid job \"{}\"", report.file, job.metadata.name)?;
    writeln!(out)?;
    let moe = match model.active_parameters {
        Some(active) => format!(", {} active (MoE)", count(active)),
        None => " (dense)".to_owned(),
    };
    writeln!(
        out,
        "model  {}: {} parameters{moe}",
        model.name,
        count(model.parameters)
    )?;
    writeln!(
        out,
        "       weights {}, forward {}/token, training {}/token, KV cache {}/token",
        si(derived.weight_bytes, "B"),
        si(derived.forward_flops_per_token, "FLOP"),
        si(derived.train_flops_per_token, "FLOP"),
        si(derived.kv_bytes_per_token, "B"),
    )?;
    let rl = &spec.rl;
    writeln!(
        out,
        "rl     {} of {} = {} per step ({} started with {:.0}% over-provisioning), {} per \
         step, max staleness {}, {}",
        counted(derived.groups_per_step, "group", "groups"),
        rl.group_size,
        counted(rl.rollout_batch_size, "trajectory", "trajectories"),
        derived.trajectories_started_per_step,
        rl.over_provisioning * 100.0,
        counted(
            derived.optimizer_updates_per_step,
            "optimizer update",
            "optimizer updates"
        ),
        rl.max_staleness,
        counted(rl.steps, "step", "steps"),
    )?;
    writeln!(out)?;

    let mut pools = Table::new(&[
        "POOL",
        "KIND",
        "DEVICE",
        "COUNT>",
        "PEAK BF16>",
        "MEMORY>",
        "MEM BW>",
        "RIDGE>",
        "MIN TP>",
        "$/HOUR>",
        "ROLES",
    ]);
    for pool in &derived.pools {
        let kind = match pool.kind {
            PoolKind::Gpu => "gpu",
            PoolKind::Cpu => "cpu",
            PoolKind::Serverless => "serverless",
        };
        let count = match pool.kind {
            PoolKind::Serverless => format!("{} conc.", pool.count),
            PoolKind::Cpu => format!("{} ({} vCPU)", pool.count, pool.vcpus.unwrap_or(0)),
            PoolKind::Gpu => pool.count.to_string(),
        };
        let opt = |v: Option<f64>, unit: &str| v.map(|v| si(v, unit)).unwrap_or_default();
        pools.row(vec![
            pool.name.clone(),
            kind.to_owned(),
            pool.device.clone(),
            count,
            opt(pool.peak_flops, "FLOP/s"),
            opt(pool.memory_bytes, "B"),
            opt(pool.memory_bandwidth_bytes_per_s, "B/s"),
            pool.ridge_point_flop_per_byte
                .map(|r| format!("{r:.0} F/B"))
                .unwrap_or_default(),
            match (pool.kind, pool.min_tensor_parallel) {
                (PoolKind::Gpu, Some(tp)) => tp.to_string(),
                (PoolKind::Gpu, None) => "no fit".to_owned(),
                _ => String::new(),
            },
            if pool.kind == PoolKind::Serverless {
                "per call".to_owned()
            } else {
                format!("{:.2}", pool.hourly_price_usd)
            },
            pool.roles.join(","),
        ]);
    }
    pools.write(out)?;
    writeln!(
        out,
        "hardware price: ${:.2}/hour (serverless billed per call)",
        derived.hourly_price_usd
    )?;
    writeln!(out)?;

    let mut tasks = Table::new(&[
        "TASK",
        "ENVIRONMENT",
        "SHARE>",
        "MAX TURNS>",
        "CONTEXT>",
        "ACTION/TURN>",
        "ENV STEP>",
        "REWARD",
    ]);
    for task in &spec.tasks {
        let mean = |d: &rollfleet_spec::Dist, unit: &str| match d.mean() {
            Some(m) => format!("~{m:.0}{unit}"),
            None => "trace".to_owned(),
        };
        tasks.row(vec![
            task.name.clone(),
            task.environment.clone(),
            format!("{:.0}%", task.share * 100.0),
            task.max_turns.to_string(),
            task.context_limit.to_string(),
            mean(&task.action_tokens, " tok"),
            mean(&task.env_step_ms, " ms"),
            task.reward.clone(),
        ]);
    }
    tasks.write(out)?;
    Ok(())
}
