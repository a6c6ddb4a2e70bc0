//! `rollfleet journal show FILE`: what a scheduler's journal holds, replayed offline.
//!
//! The journal (`rollfleet scheduler --journal FILE`) is replayed into a fresh scheduler actor
//! that serves nothing and writes nothing, exactly as a scheduler restarted on the file would
//! replay it; the command prints where the job stood when its scheduler stopped, and the
//! command line that resumes it (the journal refuses other settings).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Result;
use rollfleet_proto::v1::JournalHeader;
use serde::Serialize;

use crate::output::{OutputFormat, counted, exit, write_structured};

/// `rollfleet journal`.
#[derive(Debug, clap::Subcommand)]
pub enum JournalCommand {
    /// Replay a journal offline: where the job stood when its scheduler stopped, and how to
    /// resume it.
    #[command(after_help = "Examples:\n  \
        rollfleet journal show /var/lib/rollfleet/job.journal\n  \
        rollfleet journal show job.journal -o json")]
    Show {
        /// The journal file.
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
}

/// What `show` prints.
#[derive(Debug, Serialize)]
struct Shown {
    journal: String,
    records: u64,
    bytes: u64,
    /// Bytes of a record torn at the end (cut off when a scheduler resumes from it).
    torn_bytes: u64,
    job: String,
    phase: String,
    policy_version: u64,
    steps: u64,
    trajectories_trained: usize,
    trajectories_trained_twice: usize,
    /// Seconds on the job's clock from the start to the last record (or to the end).
    job_clock_s: f64,
    workers_lost: usize,
    failure: Option<String>,
    /// The command that resumes the job (the journal's own settings).
    resume: String,
    /// The job's report as the replay leaves it (`--report` of `rollfleet scheduler`; the
    /// dispatch latencies, which only a live run measures, are 0).
    report: rollfleet_server::Report,
}

/// Runs `rollfleet journal`.
pub fn run(
    command: &JournalCommand,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let JournalCommand::Show { file } = command;
    let replayed = match rollfleet_server::replay_journal(
        file,
        Some(std::sync::Arc::new(crate::window::SimulatedWindow)),
    ) {
        Ok(r) => r,
        Err(e) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    };
    let report = &replayed.report;
    // Only JSON and YAML carry the whole report; the table says what it holds.
    let shown = Shown {
        journal: file.display().to_string(),
        records: replayed.records,
        bytes: std::fs::metadata(file).map_or(0, |m| m.len()),
        torn_bytes: replayed.torn_bytes,
        job: report.job.clone(),
        phase: report.phase.clone(),
        policy_version: report.policy_version,
        steps: report.steps,
        trajectories_trained: report.trained.len(),
        trajectories_trained_twice: report.trained_twice.len(),
        job_clock_s: report.wall_s,
        workers_lost: report.workers_lost.len(),
        failure: report.failure.clone(),
        resume: resume_command(file, &replayed.header),
        report: replayed.report.clone(),
    };
    if format != OutputFormat::Table {
        write_structured(format, &shown, stdout)?;
        return Ok(exit::OK);
    }
    let ended = shown.phase != "Running";
    let torn = if shown.torn_bytes > 0 {
        format!(
            "; the last {} {} a record torn when its scheduler was killed (cut off on resume)",
            counted(shown.torn_bytes, "byte", "bytes"),
            if shown.torn_bytes == 1 { "is" } else { "are" }
        )
    } else {
        String::new()
    };
    let mut lines = vec![
        (
            "journal",
            format!(
                "{} ({}, {:.1} MB{torn})",
                shown.journal,
                counted(shown.records, "record", "records"),
                shown.bytes as f64 / 1e6
            ),
        ),
        ("job", shown.job.clone()),
        (
            "where it stood",
            format!(
                "{} at version {} of {}; {} trained ({} twice)",
                shown.phase,
                shown.policy_version,
                counted(shown.steps, "RL step", "RL steps"),
                counted(shown.trajectories_trained, "trajectory", "trajectories"),
                shown.trajectories_trained_twice
            ),
        ),
        (
            "job clock",
            format!(
                "{:.1} s from the job's start to {}",
                shown.job_clock_s,
                if ended { "its end" } else { "the last record" }
            ),
        ),
        ("workers lost", shown.workers_lost.to_string()),
    ];
    if let Some(failure) = &shown.failure {
        lines.push(("failure", failure.clone()));
    }
    if ended {
        lines.push((
            "resume",
            "nothing to resume: the job ended (a scheduler started on the journal says so and \
             exits once its trainer has every trajectory)"
                .to_owned(),
        ));
    } else {
        lines.push(("resume with", shown.resume.clone()));
    }
    for (key, value) in lines {
        writeln!(stdout, "{key:<14}  {value}")?;
    }
    Ok(exit::OK)
}

/// The `rollfleet scheduler` command line whose settings the journal was written with.
fn resume_command(file: &Path, h: &JournalHeader) -> String {
    let mut command = format!(
        "rollfleet scheduler --journal {} --seed {} --time-scale {} --lease-ms {} \
         --expect-workers {} --stage-timeout {}",
        file.display(),
        h.seed,
        h.time_scale,
        h.lease_ttl_ms,
        h.expect_workers,
        h.stage_timeout_ms / 1000
    );
    if let Some(margin) = h.replan_on_drift {
        command.push_str(&format!(" --replan-on-drift {margin}"));
    }
    command
}
