//! `rollfleet catalog`: print the hardware catalogue the planner and simulator use.
//!
//! With `--job`, the job's own additions and overrides (`spec.catalog`) are included, so a user
//! can check what their spec changed.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use rollfleet_catalog::{Catalog, CpuShape, GpuProduct, ServerlessPlatform};
use serde::Serialize;

use crate::output::{OutputFormat, Table, exit, write_structured};

/// Arguments of `rollfleet catalog`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:\n  \
    rollfleet catalog\n  \
    rollfleet catalog -o json | jq '.gpus[] | {name, ridge: (.bf16DenseTflops * 1000 / .memoryBandwidthGBps)}'\n  \
    rollfleet catalog --job my-job.yaml   # with the job's own additions")]
pub struct CatalogArgs {
    /// Include the additions and overrides of this job spec.
    #[arg(long)]
    pub job: Option<PathBuf>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Listing<'a> {
    gpus: Vec<&'a GpuProduct>,
    cpu_shapes: Vec<&'a CpuShape>,
    serverless: Vec<&'a ServerlessPlatform>,
}

/// Runs the command; returns the exit code.
pub fn run(
    args: &CatalogArgs,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let catalog = match &args.job {
        Some(path) => match rollfleet_spec::load_job_file(path) {
            Ok(job) => job.catalog,
            Err(e) => {
                writeln!(
                    stderr,
                    "error: {e}\n(the job's catalogue additions are only read from a valid job)"
                )?;
                return Ok(exit::INVALID_INPUT);
            }
        },
        None => Catalog::builtin(),
    };
    let listing = Listing {
        gpus: catalog.gpus().collect(),
        cpu_shapes: catalog.cpu_shapes().collect(),
        serverless: catalog.serverless_platforms().collect(),
    };
    if format != OutputFormat::Table {
        write_structured(format, &listing, stdout)?;
        return Ok(exit::OK);
    }
    let mut gpus = Table::new(&[
        "GPU",
        "BF16 TFLOP/S>",
        "MEMORY GB>",
        "MEM GB/S>",
        "LINK GB/S>",
        "RIDGE F/B>",
        "$/HOUR>",
        "SOURCE",
    ]);
    for gpu in &listing.gpus {
        gpus.row(vec![
            gpu.name.clone(),
            format!("{}", gpu.bf16_dense_tflops),
            format!("{}", gpu.memory_gb),
            format!("{}", gpu.memory_bandwidth_gbps),
            format!("{}", gpu.interconnect_gbps),
            format!("{:.0}", gpu.ridge_point_flop_per_byte()),
            format!("{:.2}", gpu.price_per_hour_usd),
            gpu.source.clone(),
        ]);
    }
    gpus.write(stdout)?;
    writeln!(stdout)?;
    let mut shapes = Table::new(&["CPU SHAPE", "VCPUS>", "MEMORY GIB>", "$/HOUR>", "SOURCE"]);
    for shape in &listing.cpu_shapes {
        shapes.row(vec![
            shape.name.clone(),
            shape.vcpus.to_string(),
            format!("{}", shape.memory_gib),
            format!("{:.4}", shape.price_per_hour_usd),
            shape.source.clone(),
        ]);
    }
    shapes.write(stdout)?;
    writeln!(stdout)?;
    let mut platforms = Table::new(&[
        "SERVERLESS",
        "COLD START MS>",
        "$/GB-S>",
        "$/1M REQ>",
        "CONCURRENCY>",
        "SOURCE",
    ]);
    for platform in &listing.serverless {
        platforms.row(vec![
            platform.name.clone(),
            format!("{}", platform.cold_start_ms),
            format!("{}", platform.price_per_gb_second_usd),
            format!("{:.2}", platform.price_per_million_requests_usd),
            platform.default_concurrency.to_string(),
            platform.source.clone(),
        ]);
    }
    platforms.write(stdout)?;
    writeln!(stdout, "\nsources: docs/hardware-catalogue.md")?;
    Ok(exit::OK)
}
