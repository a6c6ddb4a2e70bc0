//! `rollfleet job submit|status|watch|cancel|list|logs`: the client of a running scheduler's JobService.
//!
//! A scheduler runs one job: the one it was started with (`rollfleet scheduler JOB.yaml`), or the
//! first valid one submitted to it (`rollfleet scheduler`, then `rollfleet job submit`). A job is
//! checked here before it is sent, so an invalid spec is reported with its field paths, as
//! `rollfleet validate` would, without reaching the scheduler.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use rollfleet_proto::auth::{AuthChannel, ClientAuth};
use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::{
    JobLogsRequest, JobPhase, JobRef, JobStatus, ListJobsRequest, LogLine, PoolStatus,
    SubmitJobRequest, TrajectoryOutcomes,
};
use rollfleet_server::actor::OutcomeFigures;
use serde::Serialize;

use crate::commands::{SchedulerArg, TlsClientArgs, TokenArgs};
use crate::output::{OutputFormat, Table, counted, exit, write_structured};

/// Where the scheduler listens unless told otherwise (`rollfleet scheduler`'s default).
pub const DEFAULT_SCHEDULER: &str = "http://127.0.0.1:7070";

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
    /// List the jobs a scheduler runs (one at most; none while it waits for a submission).
    #[command(after_help = "Examples:\n  \
        rollfleet job list\n  \
        ROLLFLEET_SCHEDULER=http://10.0.0.5:7070 rollfleet job list -o json")]
    List {
        #[command(flatten)]
        target: Target,
    },
    /// Print the scheduler's newest log lines for a job (it keeps a few thousand), and with
    /// `--follow` every new one until interrupted.
    #[command(after_help = "Examples:\n  \
        rollfleet job logs quickstart --tail 50\n  \
        rollfleet job logs quickstart --follow -o json | jq -r .message")]
    Logs {
        /// The job's name.
        name: String,
        #[command(flatten)]
        target: Target,
        /// Only the newest N lines (0: every line kept).
        #[arg(long, default_value_t = 100, value_name = "N")]
        tail: u32,
        /// Keep printing new lines as the scheduler logs them.
        #[arg(short = 'f', long)]
        follow: bool,
    },
}

/// Which scheduler to ask.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    #[command(flatten)]
    at: SchedulerArg,
    #[command(flatten)]
    token: TokenArgs,
    #[command(flatten)]
    tls: TlsClientArgs,
}

/// A job's status as printed (`-o json|yaml`), with the phase by name.
#[derive(Debug, Serialize)]
struct StatusView {
    job: String,
    phase: String,
    policy_version: u64,
    rl_step: u64,
    rl_steps_total: u64,
    trajectories_in_flight: u64,
    trajectories_completed: u64,
    trajectories_trained: u64,
    pools: Vec<PoolView>,
    message: String,
    /// The reward at or above which a trajectory counts as a success.
    success_reward: f64,
    /// What the trained trajectories scored and cost, per task, over every task, and in the RL
    /// step trained last.
    tasks: Vec<OutcomeFigures>,
    overall: OutcomeFigures,
    last_step: StepView,
}

/// The figures of the RL step trained last.
#[derive(Debug, Serialize)]
struct StepView {
    step: u64,
    #[serde(flatten)]
    figures: OutcomeFigures,
}

/// The status's figures as the report has them (one shape for `rollfleet run` and `job`).
fn figures(o: Option<&TrajectoryOutcomes>) -> OutcomeFigures {
    let o = o.cloned().unwrap_or_default();
    OutcomeFigures {
        task: o.task,
        trajectories: o.trajectories,
        mean_reward: o.mean_reward,
        min_reward: o.min_reward,
        max_reward: o.max_reward,
        successes: o.successes,
        success_rate: o.success_rate,
        mean_turns: o.mean_turns,
        mean_prompt_tokens: o.mean_prompt_tokens,
        mean_action_tokens: o.mean_action_tokens,
        mean_staleness: o.mean_staleness,
        max_staleness: o.max_staleness,
        modelled_rewards: o.modelled_rewards,
    }
}

#[derive(Debug, Serialize)]
struct PoolView {
    pool: String,
    workers: u32,
    /// Share of the last interval the pool was busy, 0..1.
    busy: f64,
    queued_stages: u32,
}

/// Every pool's busy share in one line: `prefill 62%, decode 61%`.
pub fn busy_line(pools: &[PoolStatus]) -> String {
    pools
        .iter()
        .map(|p| format!("{} {:.0}%", p.pool, p.busy * 100.0))
        .collect::<Vec<_>>()
        .join(", ")
}

impl From<&JobStatus> for StatusView {
    fn from(s: &JobStatus) -> StatusView {
        StatusView {
            job: s.job.clone(),
            phase: s.phase().name().to_string(),
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
            success_reward: s.success_reward,
            tasks: s.tasks.iter().map(|t| figures(Some(t))).collect(),
            overall: figures(s.overall.as_ref()),
            last_step: StepView {
                step: s.last_step.as_ref().map_or(0, |l| l.step),
                figures: figures(s.last_step.as_ref()),
            },
        }
    }
}

/// Why a command stopped short, and the exit code that says so.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn input(message: String) -> Failure {
        Failure {
            code: exit::INVALID_INPUT,
            message,
        }
    }

    fn running(message: String) -> Failure {
        Failure {
            code: exit::FAILED,
            message,
        }
    }

    /// A scheduler's error answer: a job it does not know or a spec it refuses is the user's
    /// input; anything else is a failure while running.
    fn answer(url: &str, what: &str, status: &tonic::Status) -> Failure {
        let code = match status.code() {
            tonic::Code::NotFound | tonic::Code::InvalidArgument => exit::INVALID_INPUT,
            _ => exit::FAILED,
        };
        let message = match status.code() {
            tonic::Code::Unavailable => format!(
                "{what}: the scheduler at {url} is unavailable: {}",
                status.message()
            ),
            tonic::Code::Unauthenticated => format!(
                "{what}: the scheduler at {url} refused the call: {}",
                status.message()
            ),
            // What tonic reports when the peer is not a gRPC server (a plain HTTP/1 server, a
            // proxy, another service on the port): no scheduler said anything.
            tonic::Code::Unknown | tonic::Code::Internal
                if status.message().contains("transport error")
                    || status.message().contains("protocol error") =>
            {
                format!(
                    "{what}: {url} did not answer as a rollfleet scheduler (gRPC over HTTP/2): \
                     {}; is that the scheduler's address and port?",
                    status.message()
                )
            }
            _ => format!("{what}: the scheduler at {url} says: {}", status.message()),
        };
        Failure { code, message }
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Failure {
        Failure::running(e.to_string())
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Failure {
        Failure::running(format!("{e:#}"))
    }
}

/// Runs the command; returns the exit code.
pub fn run(
    command: &JobCommand,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
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
                let every = interval(*every)?;
                submit(job, target, *follow, every, format, stdout, stderr).await
            }
            JobCommand::Status { name, target } => {
                let mut client = connect(target).await?;
                let status = client
                    .status(job_ref(name))
                    .await
                    .map_err(|s| Failure::answer(&target.at.scheduler, "status", &s))?;
                write_status(&status.into_inner(), format, stdout)?;
                Ok(exit::OK)
            }
            JobCommand::Watch {
                name,
                target,
                every,
            } => {
                let every = interval(*every)?;
                let mut client = connect(target).await?;
                watch(
                    &mut client,
                    &target.at.scheduler,
                    name,
                    every,
                    format,
                    stdout,
                )
                .await
            }
            JobCommand::Cancel { name, target } => {
                let mut client = connect(target).await?;
                let answer = client
                    .cancel(job_ref(name))
                    .await
                    .map_err(|s| Failure::answer(&target.at.scheduler, "cancel", &s))?;
                writeln!(
                    stderr,
                    "job {name}: cancelling (its workers are drained; `rollfleet job watch \
                     {name}` follows it to the end)"
                )?;
                if let Some(status) = answer.into_inner().status {
                    write_status(&status, format, stdout)?;
                }
                Ok(exit::OK)
            }
            JobCommand::List { target } => {
                let mut client = connect(target).await?;
                let list = client
                    .list(ListJobsRequest {})
                    .await
                    .map_err(|s| Failure::answer(&target.at.scheduler, "list", &s))?;
                write_list(&list.into_inner().jobs, format, stdout)?;
                Ok(exit::OK)
            }
            JobCommand::Logs {
                name,
                target,
                tail,
                follow,
            } => {
                let mut client = connect(target).await?;
                let request = JobLogsRequest {
                    job: name.clone(),
                    tail: *tail,
                    follow: *follow,
                };
                let mut lines = client
                    .logs(request)
                    .await
                    .map_err(|s| Failure::answer(&target.at.scheduler, "logs", &s))?
                    .into_inner();
                loop {
                    match lines.message().await {
                        Ok(Some(line)) => write_log_line(&line, format, stdout)?,
                        Ok(None) => break,
                        Err(s) => return Err(Failure::answer(&target.at.scheduler, "logs", &s)),
                    }
                }
                Ok(exit::OK)
            }
        }
    });
    match outcome {
        Ok(code) => Ok(code),
        // The reader of stdout left (`rollfleet job watch NAME -o json | head -1`): a clean end.
        Err(_) if crate::output::stdout_closed() => Ok(exit::OK),
        Err(failure) => {
            if !failure.message.is_empty() {
                writeln!(stderr, "error: {}", failure.message)?;
            }
            Ok(failure.code)
        }
    }
}

fn interval(seconds: f64) -> Result<Duration, Failure> {
    if seconds.is_finite() && seconds >= 0.0 {
        Ok(Duration::from_secs_f64(seconds))
    } else {
        Err(Failure::input(format!(
            "--every {seconds}: must be a number of seconds, 0 or more"
        )))
    }
}

fn job_ref(name: &str) -> JobRef {
    JobRef {
        job: name.to_owned(),
    }
}

async fn submit(
    job: &Path,
    target: &Target,
    follow: bool,
    every: Duration,
    format: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8, Failure> {
    // Checked here first: an invalid job is reported as `rollfleet validate` would, unsent.
    // The file is read once: parsed as `rollfleet_spec::load_job_file` does, and sent as read
    // but for its CSV paths (below).
    let bytes = rollfleet_spec::read_limited(job).map_err(|e| Failure::input(e.to_string()))?;
    let dir = job.parent().unwrap_or(Path::new(""));
    // A CSV file the job names by a relative path is next to the job file, not in the
    // scheduler's working directory: such a job is sent with the paths made absolute (the
    // scheduler reads them from its own file system), any other exactly as written.
    let yaml = rollfleet_spec::job_yaml_for_dir(&bytes, &job.display().to_string(), dir)
        .map_err(|e| Failure::input(e.to_string()))?;
    let url = target.at.scheduler.as_str();
    let mut client = connect(target).await?;
    // No request key: a scheduler takes one job ever, and recognises it resubmitted.
    let request = SubmitJobRequest {
        job_yaml: yaml,
        request_id: String::new(),
        // The paths are absolute already.
        job_dir: String::new(),
    };
    let name = client
        .submit(request)
        .await
        .map_err(|s| Failure::answer(url, "submit", &s))?
        .into_inner()
        .job;
    let said = serde_json::json!({ "job": name, "scheduler": url });
    match format {
        OutputFormat::Table => writeln!(stdout, "job {name} submitted to {url}")?,
        // One line, so that with `--watch` the output is one JSON object per line.
        OutputFormat::Json => writeln!(stdout, "{said}")?,
        OutputFormat::Yaml => write_structured(OutputFormat::Yaml, &said, stdout)?,
    }
    if !follow {
        writeln!(
            stderr,
            "watch it: rollfleet job watch {name} --scheduler {url}"
        )?;
        return Ok(exit::OK);
    }
    watch(&mut client, url, &name, every, format, stdout).await
}

async fn connect(target: &Target) -> Result<JobServiceClient<AuthChannel>, Failure> {
    let url = target.at.scheduler.as_str();
    // A token that cannot be read stops the command before anything is sent.
    let token = target
        .token
        .token()
        .map_err(|e| Failure::input(e.to_string()))?;
    let endpoint =
        rollfleet_proto::tls::endpoint(url, target.tls.tls_ca.as_deref(), target.tls.identity())
            .map_err(|e| Failure::input(e.to_string()))?;
    let channel = endpoint
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| {
            Failure::running(format!(
                "cannot reach the scheduler at {url}: {e}{}",
                std::error::Error::source(&e)
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default()
            ))
        })?;
    Ok(JobServiceClient::with_interceptor(
        channel,
        ClientAuth::new(token.as_ref()),
    ))
}

/// Follows the job until it ends; exit code 0 when it succeeded.
async fn watch(
    client: &mut JobServiceClient<AuthChannel>,
    url: &str,
    name: &str,
    every: Duration,
    format: OutputFormat,
    out: &mut dyn Write,
) -> Result<u8, Failure> {
    let mut stream = client
        .watch(job_ref(name))
        .await
        .map_err(|s| Failure::answer(url, "watch", &s))?
        .into_inner();
    let start = Instant::now();
    let mut last: Option<(Instant, JobPhase)> = None;
    let mut held: Option<JobStatus> = None;
    while let Some(status) = stream
        .message()
        .await
        .map_err(|s| Failure::answer(url, "watch", &s))?
    {
        let phase = status.phase();
        let due = last.is_none_or(|(at, seen)| seen != phase || at.elapsed() >= every);
        if due || phase.ended() {
            write_progress(&status, start.elapsed(), format, out)?;
            last = Some((Instant::now(), phase));
            held = None;
        } else {
            held = Some(status);
        }
        if phase.ended() {
            return Ok(if phase == JobPhase::Succeeded {
                exit::OK
            } else {
                exit::FAILED
            });
        }
    }
    if let Some(status) = held {
        write_progress(&status, start.elapsed(), format, out)?;
    }
    Err(Failure::running(format!(
        "watch: the scheduler at {url} ended the stream before job {name} ended"
    )))
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
            write!(
                out,
                "[{:>7.1} s] {} {:<9} step {}/{}, {} trained, {} in flight",
                elapsed.as_secs_f64(),
                status.job,
                status.phase().name(),
                status.rl_step,
                status.rl_steps_total,
                status.trajectories_trained,
                status.trajectories_in_flight
            )?;
            if let Some(all) = status.overall.as_ref().filter(|o| o.trajectories > 0) {
                write!(
                    out,
                    "; reward {:.3}, success {:.0}%",
                    all.mean_reward,
                    all.success_rate * 100.0
                )?;
                if let Some(last) = &status.last_step {
                    write!(out, " (step {}: {:.3})", last.step, last.mean_reward)?;
                }
            }
            if !status.pools.is_empty() {
                write!(out, "; busy: {}", busy_line(&status.pools))?;
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
        status.phase().name(),
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
    let overall = figures(status.overall.as_ref());
    if overall.trajectories > 0 {
        writeln!(
            out,
            "rewards (success: a reward of at least {}):",
            status.success_reward
        )?;
        let tasks: Vec<OutcomeFigures> = status.tasks.iter().map(|t| figures(Some(t))).collect();
        super::runtime::write_outcome_table(&tasks, &overall, out)?;
        if let Some(last) = &status.last_step {
            writeln!(
                out,
                "RL step {} so far: {} trained, mean reward {:.3}, success {:.0}%",
                last.step,
                counted(last.trajectories, "trajectory", "trajectories"),
                last.mean_reward,
                last.success_rate * 100.0
            )?;
        }
    }
    if !status.message.is_empty() {
        writeln!(out, "message: {}", status.message)?;
    }
    Ok(())
}

/// One row per job: name, phase, step, trajectories and message.
fn write_list(jobs: &[JobStatus], format: OutputFormat, out: &mut dyn Write) -> Result<()> {
    if format != OutputFormat::Table {
        let views: Vec<StatusView> = jobs.iter().map(StatusView::from).collect();
        return write_structured(format, &views, out);
    }
    let mut table = Table::new(&["job", "phase", "RL step>", "trained>", "message"]);
    for job in jobs {
        table.row(vec![
            job.job.clone(),
            job.phase().name().to_string(),
            format!("{}/{}", job.rl_step, job.rl_steps_total),
            job.trajectories_trained.to_string(),
            job.message.clone(),
        ]);
    }
    table.write(out)?;
    Ok(())
}

/// A log line as printed: `time LEVEL message` for people, one JSON object per line otherwise.
#[derive(Debug, Serialize)]
struct LogLineView<'a> {
    seq: u64,
    unix_ms: i64,
    level: &'a str,
    target: &'a str,
    message: &'a str,
}

fn write_log_line(line: &LogLine, format: OutputFormat, out: &mut dyn Write) -> Result<()> {
    if format == OutputFormat::Table {
        writeln!(
            out,
            "{} {:>5} {}",
            utc_time(line.unix_ms),
            line.level,
            line.message
        )?;
    } else {
        let view = LogLineView {
            seq: line.seq,
            unix_ms: line.unix_ms,
            level: &line.level,
            target: &line.target,
            message: &line.message,
        };
        // One object per line whatever the format, so that `--follow` output can be read as
        // it comes (YAML documents would need a separator per line).
        writeln!(out, "{}", serde_json::to_string(&view)?)?;
    }
    out.flush()?;
    Ok(())
}

/// `unix_ms` as `HH:MM:SS.mmm` UTC.
fn utc_time(unix_ms: i64) -> String {
    let ms = unix_ms.rem_euclid(86_400_000);
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}
