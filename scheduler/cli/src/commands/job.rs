//! `rollfleet job submit|status|watch|cancel`: the client of a running scheduler's JobService.
//!
//! A scheduler runs one job: the one it was started with (`rollfleet scheduler JOB.yaml`), or the
//! first valid one submitted to it (`rollfleet scheduler`, then `rollfleet job submit`). A job is
//! checked here before it is sent, so an invalid spec is reported with its field paths, as
//! `rollfleet validate` would, without reaching the scheduler.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::{JobPhase, JobRef, JobStatus, SubmitJobRequest};
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};

use crate::output::{OutputFormat, Table, exit, write_structured};

/// Where the scheduler listens unless told otherwise (`rollfleet scheduler`'s default).
const DEFAULT_SCHEDULER: &str = "http://127.0.0.1:7070";

/// `rollfleet job`.
#[derive(Debug, clap::Subcommand)]
pub enum JobCommand {
    /// Submit a job to a scheduler started without one; prints the job's name.
    #[command(after_help = "Examples:\n  \
        rollfleet scheduler --listen 127.0.0.1:7070 &\n  \
        rollfleet job submit examples/jobs/quickstart.yaml --watch\n\n\
        The job is validated here first: an invalid one exits 3 with its problems and is not sent.\n\
        Submitting the job a scheduler already runs again answers with its name and changes nothing.")]
    Submit {
        /// The job spec (YAML).
        #[arg(value_name = "JOB")]
        job: PathBuf,
        #[command(flatten)]
        target: Target,
        /// Then watch it until it ends (as `rollfleet job watch`).
        #[arg(long)]
        watch: bool,
        /// With `--watch`: seconds between progress lines (phase changes and the end are always
        /// shown).
        #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
        every: f64,
    },
    /// Print a job's status: phase, RL step, trajectories, and every pool's workers and load.
    #[command(after_help = "Examples:\n  \
        rollfleet job status quickstart\n  \
        rollfleet job status quickstart --scheduler http://10.0.0.5:7070 -o json")]
    Status {
        /// The job's name (`metadata.name` of its spec).
        name: String,
        #[command(flatten)]
        target: Target,
    },
    /// Follow a job until it ends: a line per change (at most one every `--every` seconds),
    /// or with `-o json` one JSON object per line; exits 0 when it succeeded, 1 otherwise.
    #[command(after_help = "Examples:\n  \
        rollfleet job watch quickstart\n  \
        rollfleet job watch quickstart -o json | jq .rl_step")]
    Watch {
        /// The job's name.
        name: String,
        #[command(flatten)]
        target: Target,
        /// Seconds between progress lines (phase changes and the end are always shown).
        #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
        every: f64,
    },
    /// Cancel a job: its workers are drained, nothing already trained is lost.
    Cancel {
        /// The job's name.
        name: String,
        #[command(flatten)]
        target: Target,
    },
}

/// Which scheduler to ask.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The scheduler's URL.
    #[arg(long, default_value = DEFAULT_SCHEDULER, value_name = "URL")]
    scheduler: String,
}

/// A job's status as printed (`-o json|yaml`), with the phase by name.
#[derive(Debug, Serialize)]
struct StatusView {
    job: String,
    phase: &'static str,
    policy_version: u64,
    rl_step: u64,
    rl_steps_total: u64,
    trajectories_in_flight: u64,
    trajectories_completed: u64,
    trajectories_trained: u64,
    pools: Vec<PoolView>,
    message: String,
}

#[derive(Debug, Serialize)]
struct PoolView {
    pool: String,
    workers: u32,
    /// Share of the last interval the pool was busy, 0..1.
    busy: f64,
    queued_stages: u32,
}

fn phase_name(phase: JobPhase) -> &'static str {
    match phase {
        JobPhase::Unspecified => "Unspecified",
        JobPhase::Pending => "Pending",
        JobPhase::Running => "Running",
        JobPhase::Succeeded => "Succeeded",
        JobPhase::Failed => "Failed",
        JobPhase::Cancelled => "Cancelled",
    }
}

fn ended(phase: JobPhase) -> bool {
    matches!(
        phase,
        JobPhase::Succeeded | JobPhase::Failed | JobPhase::Cancelled
    )
}

impl From<&JobStatus> for StatusView {
    fn from(s: &JobStatus) -> StatusView {
        StatusView {
            job: s.job.clone(),
            phase: phase_name(s.phase()),
            policy_version: s.policy_version,
            rl_step: s.rl_step,
            rl_steps_total: s.rl_steps_total,
            trajectories_in_flight: s.trajectories_in_flight,
            trajectories_completed: s.trajectories_completed,
            trajectories_trained: s.trajectories_trained,
            pools: s
                .pools
                .iter()
                .map(|p| PoolView {
                    pool: p.pool.clone(),
                    workers: p.workers,
                    busy: p.busy,
                    queued_stages: p.queued_stages,
                })
                .collect(),
            message: s.message.clone(),
        }
    }
}

/// What went wrong talking to the scheduler, and the exit code it deserves.
struct Refusal {
    code: u8,
    message: String,
}

/// Maps a scheduler's error answer: a job it does not know or a spec it refuses is the user's
/// input; anything else is a failure while running.
fn refusal(url: &str, what: &str, status: &tonic::Status) -> Refusal {
    let code = match status.code() {
        tonic::Code::NotFound | tonic::Code::InvalidArgument => exit::INVALID_INPUT,
        _ => exit::FAILED,
    };
    let message = match status.code() {
        tonic::Code::Unavailable => format!(
            "{what}: the scheduler at {url} is unavailable: {}",
            status.message()
        ),
        _ => format!("{what}: the scheduler at {url} says: {}", status.message()),
    };
    Refusal { code, message }
}

/// Runs the command; returns the exit code.
pub fn run(
    command: &JobCommand,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    if let JobCommand::Submit { every, .. } | JobCommand::Watch { every, .. } = command
        && !(every.is_finite() && *every >= 0.0)
    {
        writeln!(
            stderr,
            "error: --every {every}: must be a number of seconds, 0 or more"
        )?;
        return Ok(exit::INVALID_INPUT);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let outcome = rt.block_on(async {
        match command {
            JobCommand::Submit {
                job,
                target,
                watch: follow,
                every,
            } => {
                let Some(yaml) = checked_yaml(job, stderr)? else {
                    return Ok(Ok(exit::INVALID_INPUT));
                };
                let mut client = match connect(&target.scheduler).await {
                    Ok(c) => c,
                    Err(r) => return Ok(Err(r)),
                };
                // No request key: a scheduler takes one job ever, and recognises it resubmitted.
                let request = SubmitJobRequest {
                    job_yaml: yaml,
                    request_id: String::new(),
                };
                let name = match client.submit(request).await {
                    Ok(answer) => answer.into_inner().job,
                    Err(s) => return Ok(Err(refusal(&target.scheduler, "submit", &s))),
                };
                match format {
                    OutputFormat::Table => {
                        writeln!(stdout, "job {name} submitted to {}", target.scheduler)?
                    }
                    // One line, so that with `--watch` the output is one JSON object per line.
                    OutputFormat::Json => writeln!(
                        stdout,
                        "{}",
                        serde_json::json!({ "job": name, "scheduler": target.scheduler })
                    )?,
                    OutputFormat::Yaml => write_structured(
                        OutputFormat::Yaml,
                        &serde_json::json!({ "job": name, "scheduler": target.scheduler }),
                        stdout,
                    )?,
                }
                if !follow {
                    writeln!(
                        stderr,
                        "watch it: rollfleet job watch {name} --scheduler {}",
                        target.scheduler
                    )?;
                    return Ok(Ok(exit::OK));
                }
                watch(
                    &mut client,
                    &target.scheduler,
                    &name,
                    *every,
                    format,
                    stdout,
                )
                .await
            }
            JobCommand::Status { name, target } => {
                let mut client = match connect(&target.scheduler).await {
                    Ok(c) => c,
                    Err(r) => return Ok(Err(r)),
                };
                match client.status(job_ref(name)).await {
                    Ok(s) => {
                        write_status(&s.into_inner(), format, stdout)?;
                        Ok(Ok(exit::OK))
                    }
                    Err(s) => Ok(Err(refusal(&target.scheduler, "status", &s))),
                }
            }
            JobCommand::Watch {
                name,
                target,
                every,
            } => {
                let mut client = match connect(&target.scheduler).await {
                    Ok(c) => c,
                    Err(r) => return Ok(Err(r)),
                };
                watch(&mut client, &target.scheduler, name, *every, format, stdout).await
            }
            JobCommand::Cancel { name, target } => {
                let mut client = match connect(&target.scheduler).await {
                    Ok(c) => c,
                    Err(r) => return Ok(Err(r)),
                };
                match client.cancel(job_ref(name)).await {
                    Ok(answer) => {
                        writeln!(
                            stderr,
                            "job {name}: cancelling (its workers are drained; `rollfleet job \
                             watch {name}` follows it to the end)"
                        )?;
                        if let Some(status) = answer.into_inner().status {
                            write_status(&status, format, stdout)?;
                        }
                        Ok(Ok(exit::OK))
                    }
                    Err(s) => Ok(Err(refusal(&target.scheduler, "cancel", &s))),
                }
            }
        }
    });
    match outcome {
        Ok(Ok(code)) => Ok(code),
        Ok(Err(refused)) => {
            writeln!(stderr, "error: {}", refused.message)?;
            Ok(refused.code)
        }
        Err(e) => Err(e),
    }
}

fn job_ref(name: &str) -> JobRef {
    JobRef {
        job: name.to_owned(),
    }
}

/// The job's YAML when it is a valid job; its problems on `stderr` and `None` otherwise.
fn checked_yaml(path: &Path, stderr: &mut dyn Write) -> Result<Option<String>> {
    if let Err(e) = rollfleet_spec::load_job_file(path) {
        writeln!(stderr, "error: {e}")?;
        return Ok(None);
    }
    let bytes = rollfleet_spec::read_limited(path)?;
    Ok(Some(String::from_utf8(bytes).with_context(|| {
        format!("{}: not UTF-8", path.display())
    })?))
}

async fn connect(url: &str) -> Result<JobServiceClient<Channel>, Refusal> {
    let endpoint = Endpoint::from_shared(url.to_owned()).map_err(|e| Refusal {
        code: exit::INVALID_INPUT,
        message: format!("--scheduler {url:?}: not a URL ({e})"),
    })?;
    let channel = endpoint
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| Refusal {
            code: exit::FAILED,
            message: format!(
                "cannot reach the scheduler at {url}: {e}{}",
                std::error::Error::source(&e)
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default()
            ),
        })?;
    Ok(JobServiceClient::new(channel))
}

/// Follows the job until it ends; exit code 0 when it succeeded.
async fn watch(
    client: &mut JobServiceClient<Channel>,
    url: &str,
    name: &str,
    every: f64,
    format: OutputFormat,
    out: &mut dyn Write,
) -> Result<Result<u8, Refusal>> {
    let mut stream = match client.watch(job_ref(name)).await {
        Ok(s) => s.into_inner(),
        Err(s) => return Ok(Err(refusal(url, "watch", &s))),
    };
    let every = Duration::from_secs_f64(every);
    let start = Instant::now();
    let mut last: Option<(Instant, JobPhase)> = None;
    let mut held: Option<JobStatus> = None;
    loop {
        let status = match stream.message().await {
            Ok(Some(s)) => s,
            Ok(None) => break,
            Err(s) => return Ok(Err(refusal(url, "watch", &s))),
        };
        let phase = status.phase();
        let due = last.is_none_or(|(at, seen)| seen != phase || at.elapsed() >= every);
        if due || ended(phase) {
            write_progress(&status, start.elapsed(), format, out)?;
            last = Some((Instant::now(), phase));
            held = None;
        } else {
            held = Some(status.clone());
        }
        if ended(phase) {
            return Ok(Ok(if phase == JobPhase::Succeeded {
                exit::OK
            } else {
                exit::FAILED
            }));
        }
    }
    if let Some(status) = held {
        write_progress(&status, start.elapsed(), format, out)?;
    }
    Ok(Err(Refusal {
        code: exit::FAILED,
        message: format!("watch: the scheduler at {url} ended the stream before job {name} ended"),
    }))
}

/// One progress line (table) or one JSON object per line; YAML as a stream of documents.
fn write_progress(
    status: &JobStatus,
    elapsed: Duration,
    format: OutputFormat,
    out: &mut dyn Write,
) -> Result<()> {
    match format {
        OutputFormat::Table => {
            let busy: Vec<String> = status
                .pools
                .iter()
                .map(|p| format!("{} {:.0}%", p.pool, p.busy * 100.0))
                .collect();
            write!(
                out,
                "[{:>7.1} s] {} {:<9} step {}/{}, {} trained, {} in flight",
                elapsed.as_secs_f64(),
                status.job,
                phase_name(status.phase()),
                status.rl_step,
                status.rl_steps_total,
                status.trajectories_trained,
                status.trajectories_in_flight
            )?;
            if !busy.is_empty() {
                write!(out, "; busy: {}", busy.join(", "))?;
            }
            if !status.message.is_empty() {
                write!(out, "; {}", status.message)?;
            }
            writeln!(out)?;
        }
        OutputFormat::Json => {
            serde_json::to_writer(&mut *out, &StatusView::from(status))?;
            writeln!(out)?;
        }
        OutputFormat::Yaml => {
            writeln!(out, "---")?;
            write_structured(OutputFormat::Yaml, &StatusView::from(status), out)?;
        }
    }
    out.flush()?;
    Ok(())
}

fn write_status(status: &JobStatus, format: OutputFormat, out: &mut dyn Write) -> Result<()> {
    if format != OutputFormat::Table {
        return write_structured(format, &StatusView::from(status), out);
    }
    writeln!(
        out,
        "job {}: {}, RL step {}/{} (policy version {})",
        status.job,
        phase_name(status.phase()),
        status.rl_step,
        status.rl_steps_total,
        status.policy_version
    )?;
    writeln!(
        out,
        "trajectories: {} in flight, {} completed, {} trained",
        status.trajectories_in_flight, status.trajectories_completed, status.trajectories_trained
    )?;
    if !status.pools.is_empty() {
        let mut table = Table::new(&["pool", "workers>", "busy>", "queued stages>"]);
        for p in &status.pools {
            table.row(vec![
                p.pool.clone(),
                p.workers.to_string(),
                format!("{:.0}%", p.busy * 100.0),
                p.queued_stages.to_string(),
            ]);
        }
        table.write(out)?;
    }
    if !status.message.is_empty() {
        writeln!(out, "message: {}", status.message)?;
    }
    Ok(())
}
