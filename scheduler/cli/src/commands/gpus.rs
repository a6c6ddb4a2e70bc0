//! `rollfleet gpus`: the GPUs of this node as the driver reports them, optionally probed.
//!
//! On a machine without an NVIDIA driver it says so and why, and reports no figures at all:
//! an absent GPU is not a GPU with zero FLOP/s.

use std::io::Write;

use anyhow::Result;
use rollfleet_gpu::{GpuInfo, ProbeResult, Unavailable, discover, probe};
use serde::Serialize;

use crate::output::{OutputFormat, Table, exit, si, write_structured};

/// Arguments of `rollfleet gpus`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:\n  \
    rollfleet gpus\n  \
    rollfleet gpus --probe -o json   # measured BF16 GEMM FLOP/s and memory bandwidth")]
pub struct GpusArgs {
    /// Also measure each GPU's achieved BF16 GEMM throughput and memory bandwidth (takes a few
    /// seconds per GPU and uses it fully meanwhile).
    #[arg(long)]
    pub probe: bool,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Report {
    available: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    gpus: Vec<GpuInfo>,
    probes: Vec<ProbeResult>,
    probe_failures: Vec<String>,
}

/// Runs the command; returns the exit code.
pub fn run(
    args: &GpusArgs,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let report = match discover() {
        Err(Unavailable(reason)) => Report {
            available: false,
            reason: Some(reason),
            gpus: vec![],
            probes: vec![],
            probe_failures: vec![],
        },
        Ok(gpus) => {
            let mut probes = Vec::new();
            let mut probe_failures = Vec::new();
            if args.probe {
                for gpu in &gpus {
                    writeln!(stderr, "probing GPU {} ({})...", gpu.index, gpu.name)?;
                    match probe(gpu.index) {
                        Ok(result) => probes.push(result),
                        Err(Unavailable(reason)) => probe_failures.push(reason),
                    }
                }
            }
            Report {
                available: true,
                reason: None,
                gpus,
                probes,
                probe_failures,
            }
        }
    };
    if format != OutputFormat::Table {
        write_structured(format, &report, stdout)?;
    } else if let Some(reason) = &report.reason {
        writeln!(stdout, "no GPU on this node: {reason}")?;
    } else {
        let mut table = Table::new(&[
            "GPU>",
            "NAME",
            "CATALOGUE",
            "MEMORY>",
            "PEAK MEM BW>",
            "GEMM BF16 (MEASURED)>",
            "MEM BW (MEASURED)>",
        ]);
        for gpu in &report.gpus {
            let measured = report.probes.iter().find(|p| p.index == gpu.index);
            table.row(vec![
                gpu.index.to_string(),
                gpu.name.clone(),
                gpu.catalog_name.clone().unwrap_or_else(|| "?".to_owned()),
                si(gpu.memory_bytes as f64, "B"),
                gpu.peak_memory_bandwidth_bytes_per_s
                    .map(|b| si(b, "B/s"))
                    .unwrap_or_default(),
                measured
                    .map(|p| si(p.gemm_flops, "FLOP/s"))
                    .unwrap_or_default(),
                measured
                    .map(|p| si(p.memory_bandwidth_bytes_per_s, "B/s"))
                    .unwrap_or_default(),
            ]);
        }
        table.write(stdout)?;
    }
    for failure in &report.probe_failures {
        writeln!(stderr, "probe failed: {failure}")?;
    }
    Ok(if report.probe_failures.is_empty() {
        exit::OK
    } else {
        exit::FAILED
    })
}
