//! `rollfleet scheduler`, `rollfleet worker` and `rollfleet run`: the distributed runtime.
//!
//! `scheduler` serves one job over gRPC; `worker` is the node daemon; `run` starts both as real
//! child processes on loopback (one scheduler, one worker per pool, or more), shows live
//! progress, and prints a summary when the job ends. GPU work runs on emulated engines (the
//! simulator's roofline on the real clock, time-scaled), so `run` needs no GPU.
//!
//! This file holds the commands' arguments, `scheduler` and `worker`; `run` and its summary are
//! in `run` and `summary`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use rollfleet_server::ServerOptions;

use crate::commands::{SchedulerArg, TlsClientArgs, TokenArgs};
use crate::output::exit;

mod run;
mod summary;

pub use run::run;
pub(crate) use summary::write_outcome_table;

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
            window_chooser: Some(std::sync::Arc::new(crate::window::SimulatedWindow)),
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
                    tracing::info!("worker: the job is over; waiting to be stopped (--until-stopped)");
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
