//! `rollfleet sim JOB.yaml`: run the job through the discrete-event simulator under rollfleet's
//! policy and the baselines, and compare them with the lower bound.
//!
//! The simulator lives in `rollfleet-sim`; this module only maps the global output format and
//! the exit codes onto it. YAML output is the JSON report re-encoded, so the two never differ.

use std::io::Write;

use anyhow::Result;
use rollfleet_sim::cli::{OutputFormat as SimFormat, SimArgs, SimError, run as simulate};

use crate::output::{OutputFormat, exit, write_structured};

/// Runs the command; returns the exit code.
pub fn run(
    args: &SimArgs,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let outcome = match format {
        OutputFormat::Table => simulate(args, SimFormat::Table, stdout, stderr),
        OutputFormat::Json => simulate(args, SimFormat::Json, stdout, stderr),
        OutputFormat::Yaml => {
            let mut json = Vec::new();
            let outcome = simulate(args, SimFormat::Json, &mut json, stderr);
            if outcome.is_ok() {
                let report: serde_json::Value = serde_json::from_slice(&json)?;
                write_structured(OutputFormat::Yaml, &report, stdout)?;
            }
            outcome
        }
    };
    match outcome {
        Ok(()) => Ok(exit::OK),
        // The reader of stdout left (`rollfleet sim JOB -o json | head -1`): a clean end.
        Err(_) if crate::output::stdout_closed() => Ok(exit::OK),
        Err(error) => {
            writeln!(stderr, "error: {error}")?;
            // A job file that cannot be read is input, as a malformed one is; writing the
            // report or the timeline, and the run itself, fail while running.
            Ok(match error {
                SimError::Io(_) | SimError::Json(_) | SimError::Run { .. } => exit::FAILED,
                _ => exit::INVALID_INPUT,
            })
        }
    }
}
