//! `rollfleet scheduler`, `rollfleet worker` and `rollfleet run`: the distributed runtime.
//!
//! `scheduler` serves one job over gRPC; `worker` is the node daemon; `run` starts both as real
//! child processes on loopback (one scheduler, one worker per pool, or more), shows live
//! progress, and prints a summary when the job ends. GPU work runs on emulated engines (the
//! simulator's roofline on the real clock, time-scaled), so `run` needs no GPU.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use rollfleet_proto::auth::{ClientAuth, TOKEN_ENV, Token};
use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::{JobPhase, JobRef};
use rollfleet_server::actor::{OutcomeFigures, StepOutcomes};
use rollfleet_server::{Report, ServerOptions};
use tonic::transport::Endpoint;

use crate::commands::{SchedulerArg, TlsClientArgs, TokenArgs};
use crate::output::{OutputFormat, Table, counted, exit, write_structured};

/// Wall seconds per modelled second that `run` uses unless told otherwise.
pub const DEFAULT_TIME_SCALE: f64 = 4.0;

/// `rollfleet scheduler`.
#[derive(Debug, clap::Args)]
pub struct SchedulerArgs {
    /// The job file; without one, the scheduler waits for `rollfleet job submit`.
    pub job: Option<PathBuf>,
    /// Address to serve gRPC on (port 0: any free port; the address is printed on stdout as
    /// `listening on ADDR`).
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Wall seconds per modelled second of the emulated hardware.
    #[arg(long, default_value_t = DEFAULT_TIME_SCALE)]
    pub time_scale: f64,
    /// Seed of the core's decisions and of the environment episodes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Workers to wait for before the job starts (at least one per pool it needs).
    #[arg(long, default_value_t = 0)]
    pub expect_workers: usize,
    /// Worker lease, milliseconds: a worker silent this long is declared lost.
    #[arg(long, default_value_t = 3000)]
    pub lease_ms: u64,
    /// Seconds of wall time after which an unanswered stage is presumed lost and redone.
    #[arg(long = "stage-timeout", default_value_t = 120)]
    pub stage_timeout_s: u64,
    /// Write the final report (JSON) here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Serve Prometheus metrics here (e.g. 127.0.0.1:9464).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Also re-plan when a share of peak the workers measure (prefill FLOP/s, decode
    /// bandwidth) drifts from the one the running plan assumed by more than this relative
    /// margin, e.g. 0.2; replicas move only if the new plan saves 5% of the predicted step.
    /// (GPUs that come or go always re-plan.)
    #[arg(long, value_name = "MARGIN")]
    pub replan_on_drift: Option<f64>,
    /// Record every event here before acting on it. Started again on the same file (with the
    /// same settings; the job file may be left out, the journal holds it), the scheduler
    /// replays it, resumes the job where the killed one stopped, and the workers that register
    /// again carry on: no trajectory lost, none handed to the trainer twice
    /// (docs/runtime.md, "Failover"). A file that does not exist or is empty starts a new journal.
    #[arg(long, value_name = "FILE")]
    pub journal: Option<PathBuf>,
    /// Wait for every batch of journal records to reach the disk (`fdatasync`) before acting on
    /// it, so that the journal survives the machine losing power (use it with a journal on
    /// storage that outlives the machine). Without it a killed scheduler loses nothing, but a
    /// power loss can.
    #[arg(long, requires = "journal")]
    pub journal_sync: bool,
    /// After the job ends, keep serving its status (and the trainer feed) until stopped
    /// (SIGTERM, Ctrl-C), instead of exiting: what a scheduler run by a Kubernetes Deployment
    /// needs (the operator sets it), so that the end is read and the Deployment scaled down
    /// rather than the scheduler started again. The exit status is still the job's.
    #[arg(long)]
    pub until_stopped: bool,
    /// With an external trainer (`rl.trainer: external`): the directory every published version's
    /// weights must be inside (a publication naming a path outside it is refused). Without it,
    /// any absolute path the scheduler can read is taken.
    #[arg(long, value_name = "DIR")]
    pub weights_dir: Option<PathBuf>,
    /// Serve gRPC over TLS with this certificate (PEM; its chain may follow it), so that the
    /// token and the trajectories do not cross the network in clear; clients then use an
    /// https:// URL and --tls-ca. Needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require every worker and client to present a certificate signed by this CA (PEM):
    /// mutual TLS, a key per node besides the shared token. Needs --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    #[command(flatten)]
    pub token: TokenArgs,
}

/// `rollfleet worker`.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub at: SchedulerArg,
    /// The pool to join, as named in the job.
    #[arg(long)]
    pub pool: String,
    /// This node's name (default: the host name and process id).
    #[arg(long)]
    pub name: Option<String>,
    /// Environment instances this node runs at once.
    #[arg(long, default_value_t = 1024)]
    pub env_slots: usize,
    /// Model environment steps and rewards from the job spec's distributions (as the simulator
    /// does) instead of running the real environments and reward functions.
    #[arg(long)]
    pub model_environments: bool,
    /// An environment kind served by a remote environment server, as KIND=URL (repeatable), e.g.
    /// `guess=http://127.0.0.1:8765` (protocol: docs/remote-environments.md).
    #[arg(long = "remote-env", value_parser = parse_remote_env)]
    pub remote_envs: Vec<(String, String)>,
    /// Emulated GPUs achieve only this share of the rates the model gives them, in (0, 1], as
    /// a throttled or badly driven node would (their profile samples show it). Default: 1.
    #[arg(long, value_name = "SHARE", default_value_t = 1.0)]
    pub emulate_slowdown: f64,
    /// GPUs this node offers its pool (at most the pool's count). Re-planning counts a pool's
    /// GPUs by what its nodes declare; without it, a node counts as an equal share of the pool.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub gpus: Option<u32>,
    /// Seconds to keep trying to register again when the scheduler goes away mid-job (a
    /// scheduler restarted on its `--journal` resumes the job with the workers that come back);
    /// 0: exit instead.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub rejoin_for: u64,
    /// Once the job is over (drained), wait to be stopped (SIGTERM, Ctrl-C) instead of exiting:
    /// what a worker a Kubernetes Deployment runs needs (the operator sets it), or it is started
    /// again only to be told the job has ended.
    #[arg(long)]
    pub until_stopped: bool,
    /// Stopped mid-job (SIGTERM, Ctrl-C: a node drain, a spot instance's notice), the worker
    /// tells the scheduler it is leaving, finishes what it runs while it gets nothing new, and
    /// exits 0 when the scheduler releases it; after this many seconds, or at a second signal,
    /// it exits at once (its work is then redone elsewhere, as for a lost worker).
    #[arg(long, value_name = "SECS", default_value_t = 25)]
    pub leave_timeout: u64,
    #[command(flatten)]
    pub token: TokenArgs,
    #[command(flatten)]
    pub tls: TlsClientArgs,
    /// Which LLM engine generates.
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// The LLM engine flags of `rollfleet worker` and `rollfleet run`.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// The LLM engine of a GPU pool's generation stages: `emulated` (the simulator's roofline on
    /// the scaled clock, synthetic tokens, no GPU), `openai` (a real engine behind the OpenAI
    /// completions API, such as vLLM or SGLang, at --engine-url, text in and out; its weights
    /// stay as they are, for the emulated trainer), or `sglang` / `vllm` (real engines driven
    /// token-in, token-out with log-probabilities through their native APIs, one --engine-url
    /// per replica the node serves, loading each version an external trainer publishes).
    #[arg(long, value_enum, default_value_t = EngineKind::Emulated)]
    pub engine: EngineKind,
    /// An engine's base URL (plain HTTP), e.g. `http://127.0.0.1:8000`; its API key, if it wants
    /// one, is read from ROLLFLEET_ENGINE_API_KEY. `sglang` and `vllm` take it once per engine:
    /// each replica the scheduler places on the node takes the next free one.
    #[arg(long)]
    pub engine_url: Vec<String>,
    /// With `--engine sglang`: a vLLM-style chat-aware `/tokenize` (messages in, ids out) for
    /// the same model, which applies the model's chat template (SGLang's own `/tokenize` takes
    /// text only). Default: each engine's own URL.
    #[arg(long, value_name = "URL")]
    pub chat_tokenizer_url: Option<String>,
    /// The model name the engine serves (default: the first one its /v1/models lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Sampling temperature of the OpenAI-compatible engine.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// With `--engine sglang` or `vllm`: seconds the engine's weight-loading call may take
    /// (SGLang's `/update_weights_from_disk`, vLLM's `/update_weights`) before the update counts
    /// as failed; the scheduler then takes the replica out of service and updates it again after
    /// a backoff. The other calls of an update keep the request timeout.
    #[arg(long, value_name = "SECS", default_value_t = 1800)]
    pub engine_update_timeout: u64,
}

impl EngineArgs {
    /// The same flags, to hand to a child `rollfleet worker`.
    fn to_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        let kind = match self.engine {
            EngineKind::Emulated => return args,
            EngineKind::Openai => "openai",
            EngineKind::Sglang => "sglang",
            EngineKind::Vllm => "vllm",
        };
        args.extend(["--engine".into(), kind.into()]);
        for url in &self.engine_url {
            args.extend(["--engine-url".into(), url.clone()]);
        }
        if let Some(url) = &self.chat_tokenizer_url {
            args.extend(["--chat-tokenizer-url".into(), url.clone()]);
        }
        if let Some(model) = &self.model {
            args.extend(["--model".into(), model.clone()]);
        }
        args.extend(["--temperature".into(), self.temperature.to_string()]);
        args.extend([
            "--engine-update-timeout".into(),
            self.engine_update_timeout.to_string(),
        ]);
        args
    }
}

/// `rollfleet worker --engine`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    /// The emulated engine.
    Emulated,
    /// An OpenAI-compatible engine (vLLM, SGLang), text in and out.
    Openai,
    /// SGLang's native API, token-in, token-out, one engine per replica.
    Sglang,
    /// vLLM, token-in, token-out, one engine per replica.
    Vllm,
}

/// The engine the flags choose, or what is wrong with them.
fn engine_choice(args: &EngineArgs) -> std::result::Result<rollfleet_node::EngineChoice, String> {
    if let Some(url) = args.engine_url.iter().find(|u| !u.starts_with("http://")) {
        return Err(format!(
            "--engine-url must be a plain http:// URL (TLS is not compiled in), got {url:?}"
        ));
    }
    let urls = args.engine_url.clone();
    if args.engine_update_timeout == 0 {
        return Err("--engine-update-timeout must be at least 1 second".into());
    }
    let update_timeout = Duration::from_secs(args.engine_update_timeout);
    match args.engine {
        EngineKind::Emulated if urls.is_empty() && args.chat_tokenizer_url.is_none() => {
            Ok(rollfleet_node::EngineChoice::Emulated)
        }
        EngineKind::Emulated => Err(
            "--engine-url is for a real engine (--engine openai, sglang or vllm); the \
                 emulated engine needs none"
                .into(),
        ),
        _ if urls.is_empty() => Err("a real engine needs --engine-url".into()),
        EngineKind::Openai if urls.len() > 1 => Err(format!(
            "--engine openai takes one --engine-url (it serves every replica of the node), got {}",
            urls.len()
        )),
        EngineKind::Openai => Ok(rollfleet_node::EngineChoice::OpenAi {
            url: urls[0].clone(),
            model: args.model.clone(),
            temperature: args.temperature,
        }),
        EngineKind::Sglang => Ok(rollfleet_node::EngineChoice::Sglang {
            urls,
            chat_tokenizer: args.chat_tokenizer_url.clone(),
            temperature: args.temperature,
            update_timeout,
        }),
        EngineKind::Vllm => Ok(rollfleet_node::EngineChoice::Vllm {
            urls,
            model: args.model.clone(),
            temperature: args.temperature,
            update_timeout,
        }),
    }
}

fn parse_remote_env(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((kind, url)) if !kind.is_empty() && url.starts_with("http://") => {
            Ok((kind.to_owned(), url.to_owned()))
        }
        _ => Err(format!("expected KIND=http://HOST:PORT, got {s:?}")),
    }
}

/// `rollfleet run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The job file.
    pub job: PathBuf,
    /// Wall seconds per modelled second of the emulated hardware.
    #[arg(long, default_value_t = DEFAULT_TIME_SCALE)]
    pub time_scale: f64,
    /// Worker processes per pool.
    #[arg(long, default_value_t = 1)]
    pub workers_per_pool: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Serve the scheduler's Prometheus metrics here (e.g. 127.0.0.1:9464).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Model environment steps and rewards from the job spec's distributions (as the simulator
    /// does) instead of running the real environments and reward functions: the same scenario as
    /// `rollfleet sim`, for comparing the two.
    #[arg(long)]
    pub model_environments: bool,
    /// Which LLM engine the GPU pools' workers drive (`--engine openai --engine-url URL`: a
    /// real vLLM or SGLang for generation; training and weight syncs stay emulated).
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Write what the workers' replicas measured (prefill batches, decode iterations) as a
    /// profile file, for `rollfleet plan --profiles` and `rollfleet profile`.
    #[arg(long, value_name = "FILE")]
    pub profiles_out: Option<PathBuf>,
    /// Re-plan when a measured share of peak drifts by more than this relative margin (passed
    /// to the scheduler; see `rollfleet scheduler --replan-on-drift`).
    #[arg(long, value_name = "MARGIN")]
    pub replan_on_drift: Option<f64>,
    /// A GPU pool whose emulated GPUs reach only SHARE of their modelled rates, as POOL=SHARE
    /// (repeatable): its workers run with `--emulate-slowdown SHARE`, to watch a drift.
    #[arg(long = "emulate-slowdown", value_name = "POOL=SHARE", value_parser = parse_slowdown)]
    pub emulate_slowdown: Vec<(String, f64)>,
    /// Also write the scheduler's report (what `-o json` prints) to FILE, whatever the output
    /// format: the summary on the terminal and the figures for a script, from one run.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
}

fn parse_slowdown(s: &str) -> std::result::Result<(String, f64), String> {
    let (pool, share) = s
        .split_once('=')
        .ok_or_else(|| format!("expected POOL=SHARE, got {s:?}"))?;
    match share.parse::<f64>() {
        Ok(x) if !pool.is_empty() && x > 0.0 && x <= 1.0 => Ok((pool.to_owned(), x)),
        _ => Err(format!(
            "expected POOL=SHARE with SHARE in (0, 1], got {s:?}"
        )),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// What is wrong with a `--replan-on-drift` margin, if anything.
fn bad_drift_margin(margin: Option<f64>) -> Option<String> {
    margin
        .filter(|m| !(m.is_finite() && *m > 0.0))
        .map(|m| format!("--replan-on-drift {m}: the margin must be a positive share, e.g. 0.2"))
}

/// Runs `rollfleet scheduler`.
pub fn scheduler(args: &SchedulerArgs, stderr: &mut dyn Write) -> Result<u8> {
    if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
        writeln!(stderr, "error: --time-scale must be a positive number")?;
        return Ok(exit::INVALID_INPUT);
    }
    if let Some(problem) = bad_drift_margin(args.replan_on_drift) {
        writeln!(stderr, "error: {problem}")?;
        return Ok(exit::INVALID_INPUT);
    }
    let token = match args.token.token() {
        Ok(token) => token,
        Err(e) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    };
    let tls = args.tls_cert.clone().zip(args.tls_key.clone());
    // Checked before the address is taken: a scheduler that cannot serve TLS serves nothing.
    if let Some((cert, key)) = &tls {
        let checked = rollfleet_proto::tls::server_config(cert, key).and_then(|config| match &args
            .tls_client_ca
        {
            Some(ca) => rollfleet_proto::tls::require_client_certificates(config, ca),
            None => Ok(config),
        });
        if let Err(e) = checked {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    }
    let rt = runtime()?;
    // Installed before the job is planned (a big job plans for long) and before the address is
    // announced (whoever reads it may signal at once): a signal finds the handler there rather
    // than the default action, and stops the scheduler whatever it is doing.
    let mut stop = {
        let _entered = rt.enter();
        Box::pin(shutdown_signal()?)
    };
    let (job_yaml, origin) = match &args.job {
        Some(path) => {
            let origin = path.display().to_string();
            let planned = rt.block_on(async {
                let flag = Arc::new(AtomicBool::new(false));
                let (f, p, o, seed) = (flag.clone(), path.clone(), origin.clone(), args.seed);
                let mut planning = tokio::task::spawn_blocking(move || {
                    rollfleet_planner::cancel::within(&f, || read_job(&p, &o, seed))
                });
                tokio::select! {
                    planned = &mut planning => Some(planned),
                    () = &mut stop => {
                        // The planner gives up at its next step.
                        flag.store(true, Ordering::Relaxed);
                        let _ = planning.await;
                        None
                    }
                }
            });
            match planned {
                None => {
                    writeln!(stderr, "scheduler: stopped while planning the job")?;
                    return Ok(exit::OK);
                }
                Some(Ok(Ok(yaml))) => (Some(yaml), origin),
                Some(Ok(Err(e))) => {
                    writeln!(stderr, "error: {e}")?;
                    return Ok(exit::INVALID_INPUT);
                }
                Some(Err(e)) => return Err(anyhow!("planning {origin}: {e}")),
            }
        }
        None => (None, "job_yaml".to_owned()),
    };
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("--listen {}", args.listen))?;
        let addr = listener.local_addr()?;
        // The parent of `rollfleet run` reads this line to find the port.
        announce(&format!("listening on {addr}"))?;
        let opts = ServerOptions {
            job_yaml,
            origin,
            seed: args.seed,
            time_scale: args.time_scale,
            lease_ttl: Duration::from_millis(args.lease_ms.max(100)),
            expect_workers: args.expect_workers,
            stage_timeout: Duration::from_secs(args.stage_timeout_s.max(1)),
            report: args.report.clone(),
            metrics_addr: args.metrics_addr,
            replan_on_drift: args.replan_on_drift,
            token,
            journal: args.journal.clone(),
            tls,
            tls_client_ca: args.tls_client_ca.clone(),
            journal_sync: args.journal_sync,
            until_stopped: args.until_stopped,
            weights_root: args.weights_dir.clone(),
        };
        let (cancel, cancelled) = tokio::sync::oneshot::channel();
        // Ctrl-C or SIGTERM cancels the job: workers are drained and the report written.
        tokio::spawn(async move {
            stop.await;
            let _ = cancel.send(());
        });
        anyhow::Ok(rollfleet_server::serve_until(listener, opts, cancelled).await)
    })?;
    let report = match served {
        Ok(report) => report,
        // A journal of another job or settings, or not a journal: the user's input.
        Err(
            e @ (rollfleet_server::ServerError::Journal(_) | rollfleet_server::ServerError::Tls(_)),
        ) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
        Err(e) => return Err(e.into()),
    };
    let Some(report) = report else {
        writeln!(stderr, "scheduler: stopped before any job was submitted")?;
        return Ok(exit::OK);
    };
    writeln!(
        stderr,
        "scheduler: {} {} at version {}/{} in {:.1} s",
        report.job, report.phase, report.policy_version, report.steps, report.wall_s
    )?;
    Ok(if report.phase == "Succeeded" {
        exit::OK
    } else {
        exit::FAILED
    })
}

/// Writes a server's line on stdout. Not through `output::Stdout`: a reader that has gone (a
/// parent that read the port and closed the pipe) is no reason for a server to stop serving, nor
/// to exit 0 whatever became of its job.
fn announce(line: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Reads a job file (size-limited, so a huge file is refused before it is read) and checks that
/// it can be planned.
fn read_job(path: &Path, origin: &str, seed: u64) -> Result<String> {
    let bytes = rollfleet_spec::read_limited(path)?;
    let yaml = String::from_utf8(bytes).map_err(|e| rollfleet_spec::SpecError::NotUtf8 {
        origin: origin.to_owned(),
        offset: e.utf8_error().valid_up_to(),
    })?;
    rollfleet_server::JobPlan::from_yaml(&yaml, origin, seed)?;
    Ok(yaml)
}

/// Ctrl-C and SIGTERM, as many times as they come.
struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs both handlers (from now on neither signal ends the process by itself).
    fn new() -> Result<StopSignals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(StopSignals {
            interrupt: signal(SignalKind::interrupt()).context("installing a SIGINT handler")?,
            term: signal(SignalKind::terminate()).context("installing a SIGTERM handler")?,
        })
    }

    /// Completes at the next of either.
    async fn next(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}

/// Completes on Ctrl-C or SIGTERM. Both handlers are installed when this returns, not when the
/// future is first polled.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = term.recv() => {}
        }
    })
}

/// Runs `rollfleet worker`.
pub fn worker(args: &WorkerArgs, stderr: &mut dyn Write) -> Result<u8> {
    let slowdown = args.emulate_slowdown;
    if !(slowdown.is_finite() && slowdown > 0.0 && slowdown <= 1.0) {
        writeln!(
            stderr,
            "error: --emulate-slowdown {slowdown}: the share must be in (0, 1]"
        )?;
        return Ok(exit::INVALID_INPUT);
    }
    let token = match args.token.token() {
        Ok(token) => token,
        Err(e) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    };
    // The TLS files are read here once, only to check them: a missing CA or key is the user's
    // input (exit 3, naming the file) rather than a worker that fails to connect.
    if let Err(e) = rollfleet_proto::tls::endpoint(
        &args.at.scheduler,
        args.tls.tls_ca.as_deref(),
        args.tls.identity(),
    ) {
        writeln!(stderr, "error: {e}")?;
        return Ok(exit::INVALID_INPUT);
    }
    let name = args.name.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "node".into());
        format!("{host}-{}", std::process::id())
    });
    let opts = rollfleet_node::WorkerOptions {
        scheduler: args.at.scheduler.clone(),
        pool: args.pool.clone(),
        hostname: name,
        lease_ms: 3000,
        env_slots: args.env_slots,
        connect_timeout: Duration::from_secs(30),
        model_environments: args.model_environments,
        remote_envs: args.remote_envs.clone(),
        slowdown: args.emulate_slowdown,
        gpus: args.gpus,
        token,
        rejoin_for: Duration::from_secs(args.rejoin_for),
        leave: None,
        leave_timeout: Duration::from_secs(args.leave_timeout),
        tls_ca: args.tls.tls_ca.clone(),
        tls_identity: args.tls.tls_cert.clone().zip(args.tls.tls_key.clone()),
        engine: match engine_choice(&args.engine) {
            Ok(choice) => choice,
            Err(message) => {
                writeln!(stderr, "error: {message}")?;
                return Ok(exit::INVALID_INPUT);
            }
        },
    };
    let rt = runtime()?;
    let until_stopped = args.until_stopped;
    let worked: Result<()> = rt.block_on(async move {
        let mut stops = StopSignals::new()?;
        let (leave, leave_rx) = tokio::sync::watch::channel(false);
        let opts = rollfleet_node::WorkerOptions {
            leave: Some(leave_rx),
            ..opts
        };
        let run = rollfleet_node::run(opts);
        tokio::pin!(run);
        tokio::select! {
            worked = &mut run => {
                worked?;
                if until_stopped {
                    eprintln!("worker: the job is over; waiting to be stopped (--until-stopped)");
                    stops.next().await;
                }
                return Ok(());
            }
            () = stops.next() => {}
        }
        let _ = leave.send(true);
        tokio::select! {
            worked = &mut run => Ok(worked.map(|_| ())?),
            () = stops.next() => Err(anyhow::anyhow!(
                "stopped again before the scheduler released this node"
            )),
        }
    });
    match worked {
        Ok(()) => Ok(exit::OK),
        Err(e) => {
            writeln!(stderr, "worker: {e}")?;
            Ok(exit::FAILED)
        }
    }
}

/// A token for one run's processes: 192 bits from the OS, as 48 hex digits.
fn fresh_token() -> Result<Token> {
    let mut bytes = [0u8; 24];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").context("opening /dev/urandom")?,
        &mut bytes,
    )
    .context("reading /dev/urandom")?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(Token::parse(&hex, "a fresh token")?)
}

/// Child processes that are killed when dropped.
struct Children(Vec<(String, Child)>);

impl Children {
    /// The first worker that has exited unsuccessfully, with how. (Workers leave with success
    /// once the job ends; the scheduler, first in the list, is watched apart.)
    fn failed_worker(&mut self) -> Option<String> {
        self.0
            .iter_mut()
            .skip(1)
            .find_map(|(name, child)| match child.try_wait() {
                Ok(Some(status)) if !status.success() => Some(format!("{name} exited ({status})")),
                _ => None,
            })
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// Runs `rollfleet run`.
pub fn run(
    args: &RunArgs,
    output: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let job = match rollfleet_spec::load_job_file(&args.job) {
        Ok(job) => job,
        Err(e) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    };
    if matches!(args.engine.engine, EngineKind::Sglang | EngineKind::Vllm) {
        writeln!(
            stderr,
            "error: rollfleet run starts one worker per pool; --engine sglang and vllm take one \
             engine per replica: start the scheduler, workers and trainer yourself (as \
             examples/external-trainer/run.sh does)"
        )?;
        return Ok(exit::INVALID_INPUT);
    }
    if job.manifest.spec.rl.trainer == rollfleet_spec::TrainerMode::External {
        writeln!(
            stderr,
            "error: {}: the job's trainer is external (rl.trainer: external): rollfleet run \
             starts no trainer; start the scheduler and workers yourself and the trainer with \
             `rollfleet train {} --scheduler URL --checkpoints DIR` (examples/external-trainer/run.sh)",
            args.job.display(),
            args.job.display()
        )?;
        return Ok(exit::INVALID_INPUT);
    }
    let yaml = std::fs::read_to_string(&args.job)?;
    let plan =
        rollfleet_server::JobPlan::from_yaml(&yaml, &args.job.display().to_string(), args.seed)
            .map_err(|e| anyhow!("{e}"))?;
    let name = job.manifest.metadata.name.clone();
    let exe = std::env::current_exe().context("finding the rollfleet binary")?;
    // The processes' own logs go to one file, so they do not scribble over the progress bars.
    let log_path = std::env::temp_dir().join(format!(
        "rollfleet-run-{}-{}.log",
        job.manifest.metadata.name,
        std::process::id()
    ));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating the log {}", log_path.display()))?;
    let report_path = std::env::temp_dir().join(format!(
        "rollfleet-run-{}-{}.json",
        name,
        std::process::id()
    ));
    for (pool, _) in &args.emulate_slowdown {
        let gpu = plan
            .pool_index(pool)
            .is_some_and(|p| plan.pool_role(p) == Some(rollfleet_server::PoolRole::Gpu));
        if !gpu {
            writeln!(
                stderr,
                "error: --emulate-slowdown {pool}=...: job {} has no GPU pool {pool:?}",
                job.manifest.metadata.name
            )?;
            return Ok(exit::INVALID_INPUT);
        }
    }
    if let Some(problem) = bad_drift_margin(args.replan_on_drift) {
        writeln!(stderr, "error: {problem}")?;
        return Ok(exit::INVALID_INPUT);
    }
    let pools = plan.pools_needed();
    let per_pool = args.workers_per_pool.max(1);
    let mut children = Children(Vec::new());
    // The scheduler listens on loopback, where any local user could reach it: the run's
    // processes share a token of their own (one given in ROLLFLEET_TOKEN is used as it is). It
    // travels in their environment, which other users cannot read, not on their command lines.
    let token = match Token::configured(None)? {
        Some(token) => token,
        None => fresh_token()?,
    };

    let mut scheduler = Command::new(&exe);
    scheduler
        .arg("scheduler")
        .arg(&args.job)
        .args(["--listen", "127.0.0.1:0"])
        .args(["--time-scale", &args.time_scale.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .args(["--expect-workers", &(pools.len() * per_pool).to_string()])
        .arg("--report")
        .arg(&report_path)
        .env(TOKEN_ENV, token.expose())
        .stdout(Stdio::piped())
        .stderr(log.try_clone()?);
    if let Some(m) = args.metrics_addr {
        scheduler.args(["--metrics-addr", &m.to_string()]);
    }
    if let Some(margin) = args.replan_on_drift {
        scheduler.args(["--replan-on-drift", &margin.to_string()]);
    }
    let mut child = scheduler.spawn().context("starting the scheduler")?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("no scheduler stdout"))?;
    children.0.push(("scheduler".into(), child));
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .ok_or_else(|| anyhow!("the scheduler did not say where it listens (got {line:?})"))?
        .to_owned();
    let url = format!("http://{addr}");
    match args.engine.engine_url.first() {
        Some(engine) if args.engine.engine == EngineKind::Openai => writeln!(
            stderr,
            "rollfleet run: scheduler on {url}; generation by the OpenAI-compatible engine at \
             {engine}; training and weight syncs are emulated, time scale {}",
            args.time_scale
        )?,
        _ => writeln!(
            stderr,
            "rollfleet run: scheduler on {url}; GPUs are emulated (roofline model), time scale {} \
             (one modelled second takes {})",
            args.time_scale,
            counted(args.time_scale, "wall second", "wall seconds")
        )?,
    }
    for &p in &pools {
        for i in 0..per_pool {
            let pool = plan.pool_name(p).to_owned();
            let mut worker = Command::new(&exe);
            if args.model_environments {
                worker.arg("worker").arg("--model-environments");
            } else {
                worker.arg("worker");
            }
            if plan.pool_role(p) == Some(rollfleet_server::PoolRole::Gpu) {
                worker.args(args.engine.to_args());
            }
            if let Some((_, share)) = args.emulate_slowdown.iter().find(|(name, _)| *name == pool) {
                worker.args(["--emulate-slowdown", &share.to_string()]);
            }
            let child = worker
                .args(["--scheduler", &url])
                .args(["--pool", &pool])
                .args(["--name", &format!("{pool}-{i}")])
                .env(TOKEN_ENV, token.expose())
                .stdout(Stdio::null())
                .stderr(log.try_clone()?)
                .spawn()
                .with_context(|| format!("starting a worker for pool {pool}"))?;
            children.0.push((format!("worker {pool}-{i}"), child));
        }
    }
    writeln!(
        stderr,
        "rollfleet run: processes log to {}",
        log_path.display()
    )?;
    writeln!(
        stderr,
        "rollfleet run: {} for {} {}",
        counted(pools.len() * per_pool, "worker process", "worker processes"),
        if pools.len() == 1 { "pool" } else { "pools" },
        pools
            .iter()
            .map(|&p| plan.pool_name(p))
            .collect::<Vec<_>>()
            .join(", ")
    )?;

    let rt = runtime()?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    let steps = plan.config.steps;
    let trajectories = steps * u64::from(plan.config.rollout_batch_size);
    let watched = rt.block_on(watch(
        &url,
        &token,
        &name,
        steps,
        trajectories,
        deadline,
        &mut children,
    ));
    // The scheduler writes its report and exits once the job ends.
    let (_, sched) = &mut children.0[0];
    let status = loop {
        if let Some(s) = sched.try_wait()? {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if let Err(e) = watched.as_ref() {
        writeln!(stderr, "rollfleet run: {e}")?;
    }
    if watched.is_err() || status.is_none_or(|s| !s.success()) {
        writeln!(
            stderr,
            "rollfleet run: the last lines of {}:",
            log_path.display()
        )?;
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        for line in &lines[lines.len().saturating_sub(20)..] {
            writeln!(stderr, "  {line}")?;
        }
    }
    watched?;
    if status.is_none() {
        bail!(
            "the scheduler did not finish within --timeout {} s",
            args.timeout
        );
    }
    let report: Report = {
        let bytes = std::fs::read(&report_path)
            .with_context(|| format!("reading the report {}", report_path.display()))?;
        let _ = std::fs::remove_file(&report_path);
        serde_json::from_slice::<Report>(&bytes).context("parsing the scheduler's report")?
    };
    if let Some(path) = &args.report {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json)
            .with_context(|| format!("writing the report {}", path.display()))?;
    }
    if let Some(path) = &args.profiles_out {
        let json = serde_json::to_string_pretty(&report.profiles)?;
        std::fs::write(path, json)
            .with_context(|| format!("writing the profiles {}", path.display()))?;
        writeln!(
            stderr,
            "rollfleet run: {} from the workers' replicas written to {} (emulated \
             replicas measure the roofline model's own figures); plan with them: rollfleet plan \
             {} --profiles {}",
            counted(report.profile_samples, "profile sample", "profile samples"),
            path.display(),
            args.job.display(),
            path.display()
        )?;
    }
    match output {
        OutputFormat::Table => write_summary(&report, stdout)?,
        other => write_structured(other, &report, stdout)?,
    }
    Ok(
        if report.phase == "Succeeded" && report.trained_twice.is_empty() {
            exit::OK
        } else {
            exit::FAILED
        },
    )
}

async fn watch(
    url: &str,
    token: &Token,
    job: &str,
    steps: u64,
    trajectories: u64,
    deadline: Instant,
    children: &mut Children,
) -> Result<()> {
    let endpoint = Endpoint::from_shared(url.to_owned())?;
    let mut client = loop {
        match endpoint.connect().await {
            Ok(channel) => {
                break JobServiceClient::with_interceptor(channel, ClientAuth::new(Some(token)));
            }
            Err(e) if Instant::now() > deadline => bail!("cannot reach the scheduler: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let mut stream = client
        .watch(JobRef {
            job: job.to_owned(),
        })
        .await?
        .into_inner();
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(4));
    let bar_style = ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos}/{len} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let step_bar = multi.add(ProgressBar::new(steps));
    step_bar.set_style(bar_style.clone());
    step_bar.set_prefix("RL step");
    let traj_bar = multi.add(ProgressBar::new(trajectories));
    traj_bar.set_style(bar_style.clone());
    traj_bar.set_prefix("trajectories");
    let mut pool_bars: Vec<ProgressBar> = Vec::new();
    let hidden = multi.is_hidden();
    let mut last_print = Instant::now();
    loop {
        // A worker that dies (a bad flag, a crash) would leave the job waiting for its pool
        // until the deadline: look at the children between status updates.
        if let Some(failed) = children.failed_worker() {
            bail!("{failed} before the job ended");
        }
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_secs(1));
        let next = tokio::time::timeout(remaining, stream.message()).await;
        let status = match next {
            Err(_) if Instant::now() < deadline => continue,
            Err(_) => bail!("the job did not finish in time"),
            Ok(Err(e)) => bail!("watching the job: {}", e.message()),
            Ok(Ok(None)) => break,
            Ok(Ok(Some(s))) => s,
        };
        step_bar.set_position(status.rl_step);
        traj_bar.set_position(status.trajectories_trained);
        traj_bar.set_message(format!(
            "trained, {} in flight",
            status.trajectories_in_flight
        ));
        while pool_bars.len() < status.pools.len() {
            let b = multi.add(ProgressBar::new(100));
            b.set_style(
                ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos:>3}% busy {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            pool_bars.push(b);
        }
        for (bar, pool) in pool_bars.iter().zip(&status.pools) {
            bar.set_prefix(pool.pool.clone());
            bar.set_position((pool.busy * 100.0).round() as u64);
            bar.set_message(format!("({})", counted(pool.workers, "worker", "workers")));
        }
        // Without a terminal the bars are hidden: print a plain line every few seconds instead.
        if hidden && last_print.elapsed() > Duration::from_secs(5) {
            last_print = Instant::now();
            eprintln!(
                "step {}/{} trajectories trained {}/{} busy: {}",
                status.rl_step,
                steps,
                status.trajectories_trained,
                trajectories,
                super::job::busy_line(&status.pools)
            );
        }
        if matches!(
            status.phase(),
            JobPhase::Succeeded | JobPhase::Failed | JobPhase::Cancelled
        ) {
            break;
        }
    }
    // `abandon`, not `finish`: finishing fills a bar to its length, which would show every
    // pool 100% busy, and a failed job's steps all done, above a summary that says otherwise.
    step_bar.abandon();
    traj_bar.abandon();
    for b in pool_bars {
        b.abandon();
    }
    Ok(())
}

fn write_summary(report: &Report, out: &mut dyn Write) -> Result<()> {
    writeln!(
        out,
        "job {}: {} - {} of {} RL steps in {:.1} s of wall time",
        report.job, report.phase, report.policy_version, report.steps, report.wall_s
    )?;
    if report.emulated_gpus {
        writeln!(
            out,
            "GPU figures are EMULATED (roofline model, time scale {}: one modelled second took {})",
            report.time_scale,
            counted(report.time_scale, "wall second", "wall seconds")
        )?;
    } else {
        writeln!(
            out,
            "{} by a real OpenAI-compatible engine; training and weight syncs are EMULATED (time \
             scale {}), and so are the busy shares of GPU pools",
            counted(report.engine_generations, "generation", "generations"),
            report.time_scale
        )?;
    }
    let mut t = Table::new(&[
        "pool",
        "kind",
        "workers>",
        "assignments done>",
        "busy share>",
    ]);
    for p in &report.pools {
        t.row(vec![
            p.pool.clone(),
            p.kind.clone(),
            p.workers.to_string(),
            p.assignments_done.to_string(),
            format!("{:.0}%", p.busy_share * 100.0),
        ]);
    }
    t.write(out)?;
    write_outcomes(report, out)?;
    writeln!(
        out,
        "trajectories trained: {} ({} twice); stages completed: {}; retried: {}; turns regenerated \
         for staleness: {}; workers lost: {}",
        report.trained.len(),
        report.trained_twice.len(),
        report.stages_completed,
        report.stage_retries,
        report.regenerated_turns,
        report.workers_lost.len()
    )?;
    for r in &report.replans {
        writeln!(
            out,
            "re-plan at {:.1} s: {}; pool {} {} -> {}; predicted step (modelled) {} as it \
             ran, {:.2} s planned; {} of {}, {} started, {} retired",
            r.at_s,
            r.reason,
            r.pool,
            r.gpus_before,
            counted(r.gpus_after, "GPU", "GPUs"),
            r.running_step_s
                .map_or_else(|| "none".to_owned(), |s| format!("{s:.2} s")),
            r.planned_step_s,
            r.waves_done,
            counted(r.waves, "wave", "waves"),
            counted(r.replicas_started, "replica", "replicas"),
            r.replicas_retired + r.replicas_lost
        )?;
    }
    if !report.groups_abandoned.is_empty() {
        writeln!(
            out,
            "groups given up as infrastructure failures (never trained on, never scored): {}",
            report.groups_abandoned.len()
        )?;
        for g in &report.groups_abandoned {
            writeln!(
                out,
                "  group {}: trajectory {} kept failing; last: {}",
                g.group,
                g.failed,
                if g.last_failure.is_empty() {
                    "a timeout"
                } else {
                    &g.last_failure
                }
            )?;
        }
    }
    if let Some(reason) = &report.failure {
        writeln!(out, "the job failed: {reason}")?;
    }
    let secs = report.wall_s.max(1e-9);
    writeln!(
        out,
        "scheduler: {:.0} stage completions/s over gRPC; dispatch latency (message off the wire to \
         commands handed to the outboxes) p50 {} us, p99 {} us",
        report.stages_completed as f64 / secs,
        report.dispatch_p50_us,
        report.dispatch_p99_us
    )?;
    Ok(())
}

/// What the trained trajectories scored and cost: a line saying where the rewards came from, a
/// row per task and one over them all, then the mean reward of each RL step.
fn write_outcomes(report: &Report, out: &mut dyn Write) -> Result<()> {
    let o = &report.outcomes;
    if o.overall.trajectories == 0 {
        return Ok(());
    }
    // The policy is emulated unless a real engine generated: its rewards are those of random
    // legal moves, which no one should read as a model's learning. Modelled environments score
    // nothing at all (the job spec gives no reward distribution).
    let source = if o.overall.modelled_rewards == o.overall.trajectories {
        "environments and rewards MODELLED from the job spec, which gives no reward \
         distribution: each reward is 0"
            .to_owned()
    } else {
        let policy = if report.engine_generations == 0 {
            "policy EMULATED (random legal moves)"
        } else {
            "policy: a real OpenAI-compatible engine"
        };
        if o.overall.modelled_rewards > 0 {
            format!(
                "{policy}; {} of {} MODELLED from the job spec, each 0",
                o.overall.modelled_rewards, o.overall.trajectories
            )
        } else {
            policy.to_owned()
        }
    };
    writeln!(
        out,
        "rewards ({source}; success: a reward of at least {}):",
        o.success_reward
    )?;
    write_outcome_table(&o.tasks, &o.overall, out)?;
    if !o.steps.is_empty() {
        writeln!(out, "mean reward by RL step: {}", step_line(&o.steps))?;
    }
    Ok(())
}

/// A row per task and one over them all (`all`): trajectories trained, mean reward, success
/// rate, mean turns, mean tokens read (prompt and observations) and generated (actions), and the
/// staleness at training (mean and most versions behind).
pub(crate) fn write_outcome_table(
    tasks: &[OutcomeFigures],
    overall: &OutcomeFigures,
    out: &mut dyn Write,
) -> Result<()> {
    let mut t = Table::new(&[
        "task",
        "trajectories>",
        "mean reward>",
        "success>",
        "turns>",
        "tokens in/out>",
        "staleness mean/max>",
    ]);
    for f in tasks.iter().chain(std::iter::once(overall)) {
        t.row(vec![
            if f.task.is_empty() {
                "all".to_owned()
            } else {
                f.task.clone()
            },
            f.trajectories.to_string(),
            format!("{:.3}", f.mean_reward),
            format!("{:.0}%", f.success_rate * 100.0),
            format!("{:.1}", f.mean_turns),
            format!("{:.0}/{:.0}", f.mean_prompt_tokens, f.mean_action_tokens),
            format!("{:.2}/{}", f.mean_staleness, f.max_staleness),
        ]);
    }
    t.write(out)?;
    Ok(())
}

/// Each step's mean reward (`0: 0.412`), the first and last few of a long run.
fn step_line(steps: &[StepOutcomes]) -> String {
    const EACH_END: usize = 6;
    let cell = |s: &StepOutcomes| format!("{}: {:.3}", s.step, s.overall.mean_reward);
    if steps.len() <= 2 * EACH_END {
        return steps.iter().map(cell).collect::<Vec<_>>().join(", ");
    }
    let head: Vec<String> = steps[..EACH_END].iter().map(cell).collect();
    let tail: Vec<String> = steps[steps.len() - EACH_END..].iter().map(cell).collect();
    format!("{}, ..., {}", head.join(", "), tail.join(", "))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_long_runs_step_line_shows_its_first_and_last_six_steps_and_a_short_ones_every_step() {
        let steps = |n: u64| -> Vec<StepOutcomes> {
            (0..n)
                .map(|step| StepOutcomes {
                    step,
                    overall: OutcomeFigures {
                        mean_reward: step as f64 / 4.0,
                        ..Default::default()
                    },
                    tasks: Vec::new(),
                })
                .collect()
        };
        assert_eq!(step_line(&steps(3)), "0: 0.000, 1: 0.250, 2: 0.500");
        let long = step_line(&steps(100));
        assert!(long.starts_with("0: 0.000, 1: 0.250,"), "{long}");
        assert!(long.contains("5: 1.250, ..., 94: 23.500"), "{long}");
        assert!(long.ends_with("99: 24.750"), "{long}");
        assert_eq!(long.matches(": ").count(), 12, "{long}");
    }

    #[test]
    fn a_worker_that_exits_unsuccessfully_is_named_and_one_that_succeeds_is_not() {
        let spawn =
            |program: &str, args: &[&str]| Command::new(program).args(args).spawn().unwrap();
        let mut children = Children(vec![
            ("scheduler".into(), spawn("sh", &["-c", "exit 3"])),
            ("worker train-0".into(), spawn("true", &[])),
            (
                "worker envs-0".into(),
                spawn("sh", &["-c", "sleep 0.2; exit 2"]),
            ),
        ]);
        let start = Instant::now();
        let failed = loop {
            if let Some(f) = children.failed_worker() {
                break f;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "never noticed");
            std::thread::sleep(Duration::from_millis(20));
        };
        // The scheduler's own exit is watched apart; a worker that left cleanly is no failure.
        assert!(failed.starts_with("worker envs-0 exited"), "{failed}");
        assert!(failed.contains('2'), "{failed}");
    }
}
