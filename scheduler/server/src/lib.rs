//! The rollfleet scheduler server: the sans-IO core driven on the wall clock, behind gRPC.
//!
//! - [`plan`]: the job as the scheduler and the workers both see it (placement, core config,
//!   modelled hardware figures), from `rollfleet-fleet`, which the workers build it with too;
//! - [`job`]: the one job a scheduler serves, given at start or by the first valid `Submit`;
//! - [`actor`]: the single task that owns the core, the workers' leases and every assignment;
//! - [`grpc`]: `WorkerService` (register, heartbeat, the bidirectional work stream) and
//!   `JobService` (submit, status, cancel, watch) in front of the actor;
//! - [`feed`]: the trainer feed (`TrainerFeed`): trajectories handed to training, sequenced,
//!   resent until acknowledged;
//! - [`metrics`]: Prometheus metrics and their HTTP endpoint;
//! - [`replan`]: what to run when a GPU pool's nodes come or go mid-run;
//! - [`journal`]: the record of every event that lets a restarted scheduler resume its job;
//! - `tokens`: a trajectory's tokens, from the engines' answers to the trainer feed.

pub mod actor;
pub mod feed;
pub mod grpc;
pub mod inventory;
pub mod job;
pub mod journal;
pub mod listener;
pub mod logs;
pub mod metrics;
pub mod replan;
mod tokens;

pub use rollfleet_fleet::plan;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rollfleet_proto::auth::{Refusal, ServerAuth, TOKEN_ENV, Token};
use rollfleet_proto::v1::job_service_server::JobServiceServer;
use rollfleet_proto::v1::trainer_feed_server::TrainerFeedServer;
use rollfleet_proto::v1::worker_service_server::WorkerServiceServer;
use rollfleet_proto::v1::{JobPhase, JobStatus};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tonic_health::ServingStatus;

pub use actor::Report;
pub use plan::{JobPlan, PlanError, PoolRole};

pub use rollfleet_proto::peer::{
    MAX_PROFILE_SAMPLES_PER_REPORT, QUOTED_CHARS, first_chars, quoted,
};

/// A count with its noun in the number the count needs: `counted(1, "worker", "workers") ==
/// "1 worker"`, `counted(3, "worker", "workers") == "3 workers"`.
pub fn counted<N>(n: N, one: &str, many: &str) -> String
where
    N: std::fmt::Display + PartialEq + From<u8>,
{
    if n == N::from(1) {
        format!("{n} {one}")
    } else {
        format!("{n} {many}")
    }
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The job could not be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The metrics could not be set up.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// A socket failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The journal could not be read, written or resumed from.
    #[error(transparent)]
    Journal(#[from] journal::JournalError),
    /// The TLS certificate or key could not be used.
    #[error(transparent)]
    Tls(#[from] rollfleet_proto::tls::TlsError),
}

/// Settings of a scheduler server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The job, as YAML; `None`: the scheduler waits for the first valid `Submit`.
    pub job_yaml: Option<String>,
    /// Where the YAML came from (for error messages).
    pub origin: String,
    /// Seed of the core's decisions and of the environment episodes.
    pub seed: u64,
    /// Wall seconds per modelled second of emulated hardware.
    pub time_scale: f64,
    /// Worker lease length.
    pub lease_ttl: Duration,
    /// Workers to wait for before starting.
    pub expect_workers: usize,
    /// A stage unanswered this long (wall time) is presumed lost and redone elsewhere.
    pub stage_timeout: Duration,
    /// Where to write the final report (JSON).
    pub report: Option<PathBuf>,
    /// Where to serve Prometheus metrics.
    pub metrics_addr: Option<SocketAddr>,
    /// Re-plan when a share of peak the workers measure drifts from the running plan's by more
    /// than this (relative); `None`: re-plan only when GPUs come or go.
    pub replan_on_drift: Option<f64>,
    /// The bearer token every call must carry ([`rollfleet_proto::auth`]); `None`: any peer
    /// that reaches the address is served.
    pub token: Option<Token>,
    /// Where every event is recorded before it is acted on ([`journal`]); a scheduler started on
    /// a journal that has records resumes its job (`None`: no journal, a lost scheduler loses
    /// the job).
    pub journal: Option<PathBuf>,
    /// Serve TLS with this certificate chain and private key (PEM files,
    /// [`rollfleet_proto::tls::server_config`]); `None`: plain HTTP/2.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// With `tls`: require every client to present a certificate signed by this CA (PEM file;
    /// [`rollfleet_proto::tls::require_client_certificates`]).
    pub tls_client_ca: Option<PathBuf>,
    /// Wait for every batch of journal records to reach the disk before acting on it
    /// ([`journal::JournalWriter::syncing`]): a journal that survives the machine losing power.
    pub journal_sync: bool,
    /// After the job ends, keep serving until `cancel` completes (a stop), instead of exiting
    /// once a trainer has everything: for a scheduler a Deployment runs, whose end must be read
    /// (by the operator) rather than restarted.
    pub until_stopped: bool,
    /// Where an external trainer's published weights must be (`--weights-dir`); `None`: any
    /// absolute path the scheduler can read ([`feed::check_publication`]).
    pub weights_root: Option<PathBuf>,
    /// Chooses the job's admission window ([`job::WindowChooser`]); `None`: the core's rule.
    pub window_chooser: Option<Arc<dyn job::WindowChooser>>,
}

/// Counts a call refused for want of the token, and says so in the log at the 1st, 10th, 100th,
/// ... refusal (a peer probing the port must not flood the log).
fn refused(metrics: &metrics::Metrics, refusal: Refusal, peer: Option<SocketAddr>) {
    metrics
        .unauthenticated_calls
        .with_label_values(&[refusal.label()])
        .inc();
    let total: u64 = [Refusal::Missing, Refusal::Wrong]
        .iter()
        .map(|r| {
            metrics
                .unauthenticated_calls
                .with_label_values(&[r.label()])
                .get()
        })
        .sum();
    let mut power = 1;
    while power < total {
        power *= 10;
    }
    if power == total {
        tracing::warn!(
            "scheduler: refused a call from {}: {} token ({total} refused so far)",
            peer.map_or_else(|| "an unknown peer".to_owned(), |p| p.to_string()),
            match refusal {
                Refusal::Missing => "no",
                Refusal::Wrong => "another",
            }
        );
    }
}

/// How long a peer watching `grpc.health.v1` has to see NOT_SERVING before its stream is ended
/// so that the server can stop.
const HEALTH_WATCH_GRACE: Duration = Duration::from_secs(1);

/// How long the server's shutdown may wait, once the job's actor has stopped, for peers to end
/// the calls they hold open (a worker that ignores the end of its stream, a status watcher);
/// past it they are cut off, so that a stop never hangs on a peer.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Sets the whole server's health (service `""`) and each named service's to `status`.
async fn set_health(
    health: &tonic_health::server::HealthReporter,
    names: &[&str],
    status: ServingStatus,
) {
    for name in [""].iter().chain(names) {
        health.set_service_status(name, status).await;
    }
}

/// Serves the job on `listener` until it ends (or is cancelled); returns its report, or `None`
/// when the scheduler was cancelled before any job was submitted.
pub async fn serve(
    listener: TcpListener,
    opts: ServerOptions,
) -> Result<Option<Report>, ServerError> {
    serve_until(listener, opts, std::future::pending::<()>()).await
}

/// Like [`serve`], and cancels the job (draining the workers) when `cancel` completes.
pub async fn serve_until(
    listener: TcpListener,
    opts: ServerOptions,
    cancel: impl std::future::Future + Send + 'static,
) -> Result<Option<Report>, ServerError> {
    let tls = match &opts.tls {
        Some((cert, key)) => {
            let config = rollfleet_proto::tls::server_config(cert, key)?;
            Some(match &opts.tls_client_ca {
                Some(ca) => rollfleet_proto::tls::require_client_certificates(config, ca)?,
                None => config,
            })
        }
        None => None,
    };
    let resumed = match &opts.journal {
        Some(path) => journal::JournalReader::open(path)?,
        None => None,
    };
    // A journal with records holds its job: a scheduler started on it alone resumes that job.
    let (job_yaml, origin) = match (&opts.job_yaml, &resumed, &opts.journal) {
        (Some(yaml), _, _) => (Some(yaml.clone()), opts.origin.clone()),
        (None, Some((header, _)), Some(path)) => (
            Some(header.job_yaml.clone()),
            format!("the job of journal {}", path.display()),
        ),
        _ => (None, opts.origin.clone()),
    };
    // Told to stop, the scheduler stops whatever it does, planning included: `stopping` is the
    // planner's cancellation flag ([`rollfleet_planner::cancel`]) for every plan made here.
    let stopping = Arc::new(AtomicBool::new(false));
    let (cancelled_tx, mut cancelled) = watch::channel(false);
    {
        let stopping = stopping.clone();
        tokio::spawn(async move {
            cancel.await;
            stopping.store(true, Ordering::Relaxed);
            let _ = cancelled_tx.send(true);
        });
    }
    let slot = Arc::new(match &job_yaml {
        Some(yaml) => {
            // A big job plans for seconds or more: off the async threads, and stopped with the
            // scheduler.
            let empty = job::JobSlot::new(opts.seed, opts.stage_timeout)
                .choosing_window(opts.window_chooser.clone());
            let (yaml, from, flag) = (yaml.clone(), origin.clone(), stopping.clone());
            let planned = tokio::task::spawn_blocking(move || {
                rollfleet_planner::cancel::within(&flag, || empty.with_job(&yaml, &from))
            })
            .await
            .map_err(|e| ServerError::Io {
                what: "planning the job".into(),
                source: std::io::Error::other(e.to_string()),
            })?;
            if stopping.load(Ordering::Relaxed) {
                tracing::info!("scheduler: stopped while planning the job");
                return Ok(None);
            }
            planned?
        }
        None => job::JobSlot::new(opts.seed, opts.stage_timeout)
            .choosing_window(opts.window_chooser.clone()),
    });
    let metrics = Arc::new(metrics::Metrics::new()?);
    if let Some(job) = slot.job() {
        metrics.set_job(
            job.plan.name(),
            job.plan.job.manifest.metadata.namespace.as_deref(),
        );
    }
    // Kept to wait, at the end, for the scrapes that show it.
    let served_metrics = opts.metrics_addr.map(|_| metrics.clone());
    if let Some(addr) = opts.metrics_addr {
        let l = metrics::bind_metrics(addr)
            .await
            .map_err(|source| ServerError::Io {
                what: format!("metrics address {addr}"),
                source,
            })?;
        tracing::info!(
            "scheduler: Prometheus metrics on http://{}/metrics",
            l.local_addr().unwrap_or(addr)
        );
        tokio::spawn(metrics::serve_metrics(l, metrics.clone()));
    }
    let status = Arc::new(
        watch::channel(JobStatus {
            job: slot.name().unwrap_or_default(),
            phase: JobPhase::Pending as i32,
            ..Default::default()
        })
        .0,
    );
    // Bounded: a handler that finds the actor's inbox full waits for room (backpressure on its
    // peer), and the actor never falls behind by more than a few batches.
    let (inbox, events) = mpsc::channel(actor::INBOX_CAPACITY);
    let feed_log = Arc::new(feed::FeedLog::default());
    let canceller = inbox.clone();
    let mut stopped = cancelled.clone();
    tokio::spawn(async move {
        if stopped.wait_for(|c| *c).await.is_ok() {
            let _ = canceller.send(actor::Event::Cancel).await;
        }
    });
    let auth = ServerAuth::new(opts.token.as_ref());
    if let Ok(addr) = listener.local_addr()
        && !addr.ip().is_loopback()
    {
        if !auth.required() {
            tracing::warn!(
                "scheduler: no token (--token-file or {TOKEN_ENV}); any peer that \
                 reaches {addr} may register workers, submit or cancel the job and read the \
                 trainer feed"
            );
        } else if tls.is_none() {
            tracing::warn!(
                "scheduler: no TLS (--tls-cert, --tls-key): the token and every \
                 trajectory cross the network to {addr} in clear"
            );
        }
    }
    let guard = {
        let metrics = metrics.clone();
        move |request: tonic::Request<()>| match auth.check(&request) {
            Ok(()) => Ok(request),
            Err(refusal) => {
                refused(&metrics, refusal, request.remote_addr());
                Err(refusal.status())
            }
        }
    };
    let workers = tonic::service::interceptor::InterceptedService::new(
        WorkerServiceServer::new(grpc::Workers {
            inbox: inbox.clone(),
        })
        .max_decoding_message_size(rollfleet_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(rollfleet_proto::MAX_MESSAGE_BYTES),
        guard.clone(),
    );
    let jobs = JobServiceServer::with_interceptor(
        grpc::Jobs {
            inbox: inbox.clone(),
            status: status.clone(),
            slot: slot.clone(),
            stopping: stopping.clone(),
        },
        guard.clone(),
    );
    // `grpc.health.v1`, outside the token guard: a kubelet's probe carries no token, and the
    // health service tells nothing but whether the scheduler serves.
    let (health, health_service) = tonic_health::server::health_reporter();
    let service_names = [
        <WorkerServiceServer<grpc::Workers> as tonic::server::NamedService>::NAME,
        <JobServiceServer<grpc::Jobs> as tonic::server::NamedService>::NAME,
        <TrainerFeedServer<feed::Feed> as tonic::server::NamedService>::NAME,
    ];
    let trainer_feed = TrainerFeedServer::with_interceptor(
        feed::Feed {
            log: feed_log.clone(),
            slot: slot.clone(),
            actor: inbox,
            weights_root: opts.weights_root.clone(),
        },
        guard,
    );
    if slot.job().is_none() {
        tracing::info!(
            "scheduler: waiting for a job (rollfleet job submit JOB.yaml --scheduler http://{})",
            listener
                .local_addr()
                .map_or_else(|_| "ADDR".to_owned(), |a| a.to_string())
        );
    }
    let actor_options = actor::ActorOptions {
        time_scale: opts.time_scale,
        lease_ttl: opts.lease_ttl,
        expect_workers: opts.expect_workers,
        report: opts.report.clone(),
        replan_on_drift: opts.replan_on_drift,
        until_stopped: opts.until_stopped,
    };
    // With a journal and the job known now, the actor is made (and a journal with records
    // replayed) before anything is served: a trainer resuming its feed must find every item it
    // had before.
    let mut prepared = None;
    if let (Some(path), Some(job)) = (&opts.journal, slot.job()) {
        let header = journal_header(&opts, &job.plan.yaml);
        let mut actor = actor::Actor::new(
            job.plan.clone(),
            actor_options.clone(),
            status.clone(),
            metrics.clone(),
            feed_log.clone(),
        );
        // Re-plans, those a replay makes included, stop with the scheduler.
        actor.stop_with(stopping.clone());
        match resumed {
            Some((found, mut reader)) => {
                journal::check_header(path, &found, &header)?;
                // A long job's journal takes seconds to replay (about 600,000 records a second).
                tracing::info!(
                    "scheduler: journal {}: replaying {:.1} MB to resume job {}",
                    path.display(),
                    std::fs::metadata(path).map_or(0.0, |m| m.len() as f64 / 1e6),
                    job.plan.name()
                );
                // A replay re-plans where the scheduler before did (for as long as it took),
                // so it stops with the scheduler too: replayed off the async threads.
                let (replayed, actor_back, reader) = tokio::task::spawn_blocking(move || {
                    let replayed = actor.replay(&mut reader);
                    (replayed, actor, reader)
                })
                .await
                .map_err(|e| ServerError::Io {
                    what: "replaying the journal".into(),
                    source: std::io::Error::other(e.to_string()),
                })?;
                actor = actor_back;
                let replayed = replayed?;
                if actor.interrupted() {
                    tracing::info!(
                        "scheduler: stopped while replaying journal {} (in a re-plan); the \
                         journal is as it was",
                        path.display()
                    );
                    return Ok(None);
                }
                metrics.journal_replayed.inc_by(replayed);
                if reader.torn_bytes() > 0 {
                    tracing::warn!(
                        "scheduler: journal {}: the last {} bytes are a record the scheduler \
                         before was killed while writing (before acting on it); cut off",
                        path.display(),
                        reader.torn_bytes()
                    );
                }
                tracing::info!(
                    "scheduler: journal {}: {replayed} records replayed",
                    path.display()
                );
                actor.set_journal(
                    journal::JournalWriter::append(path, reader.valid_bytes())?
                        .syncing(opts.journal_sync)?,
                );
            }
            None => actor.set_journal(
                journal::JournalWriter::create(path, &header)?.syncing(opts.journal_sync)?,
            ),
        }
        prepared = Some(actor);
    }
    // A submitted job's journal starts with it: the header is these settings and its file.
    let journal_path = opts.journal.clone();
    let journal_sync = opts.journal_sync;
    let header_settings = journal_header(&opts, "");
    let given = job_yaml.is_some();
    let accepted = slot.clone();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<Report>();
    // The actor starts with the job; until then, workers that register wait in its inbox. The
    // server stops when the actor does, or when it is cancelled before a job came.
    let run_job = async move {
        let job = tokio::select! {
            biased;
            job = slot.taken() => job,
            _ = cancelled.wait_for(|c| *c) => return,
        };
        if given {
            tracing::info!("scheduler: job {} planned", job.plan.name());
        } else {
            tracing::info!("scheduler: job {} submitted", job.plan.name());
        }
        status.send_modify(|s| s.job = job.plan.name().to_owned());
        metrics.set_job(
            job.plan.name(),
            job.plan.job.manifest.metadata.namespace.as_deref(),
        );
        let actor = match prepared {
            Some(actor) => actor,
            None => {
                let mut actor =
                    actor::Actor::new(job.plan.clone(), actor_options, status, metrics, feed_log);
                actor.stop_with(stopping);
                if let Some(path) = &journal_path {
                    let header = rollfleet_proto::v1::JournalHeader {
                        job_yaml: job.plan.yaml.clone(),
                        ..header_settings
                    };
                    match journal::JournalWriter::create(path, &header)
                        .and_then(|writer| writer.syncing(journal_sync))
                    {
                        Ok(writer) => actor.set_journal(writer),
                        Err(e) => tracing::error!(
                            "scheduler: {e}; the job runs without a journal (a restart cannot \
                             resume it)"
                        ),
                    }
                }
                actor
            }
        };
        // The actor acts on a step at a time, synchronously, and a step can hold it for long (a
        // re-plan of a big job plans for seconds or more). On a thread of its own, it never
        // holds one of the runtime's workers: those keep polling the network and the stop
        // signal, so peers are served and a stop reaches the re-plan meanwhile.
        let runtime = tokio::runtime::Handle::current();
        let acting = tokio::task::spawn_blocking(move || runtime.block_on(actor.run(events)));
        if let Ok(report) = acting.await {
            let _ = done_tx.send(report);
        }
    };
    let stopping_health = health.clone();
    let (shutting_down, shutdown_started) = tokio::sync::oneshot::channel::<()>();
    let run_job = async move {
        run_job.await;
        let _ = shutting_down.send(());
        // The server stops accepting: probes see NOT_SERVING until it is gone.
        set_health(&stopping_health, &service_names, ServingStatus::NotServing).await;
        // A peer watching the health stream would hold the graceful shutdown open: its
        // stream ends (the statuses are dropped) once it has had time to see NOT_SERVING.
        let mut cleared = stopping_health;
        tokio::spawn(async move {
            tokio::time::sleep(HEALTH_WATCH_GRACE).await;
            for name in [""].into_iter().chain(service_names) {
                cleared.clear_service_status(name).await;
            }
        });
    };
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(listener::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(listener::KEEPALIVE_TIMEOUT))
        .initial_stream_window_size(rollfleet_proto::HTTP2_WINDOW_BYTES)
        .initial_connection_window_size(rollfleet_proto::HTTP2_WINDOW_BYTES);
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(rollfleet_proto::tls::TlsError::from)?;
    }
    let server = builder
        .add_service(health_service)
        .add_service(workers)
        .add_service(jobs)
        .add_service(trainer_feed)
        .serve_with_incoming_shutdown(
            listener::bounded(listener, listener::Limits::default()),
            run_job,
        );
    // Anything that answers a health check is the server accepting: SERVING from here on,
    // until `run_job` ends and the shutdown starts.
    set_health(&health, &service_names, ServingStatus::Serving).await;
    let cut_off = async {
        if shutdown_started.await.is_ok() {
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        served = server => served?,
        () = cut_off => tracing::warn!(
            "scheduler: peers still held calls open {} s after the job's actor stopped; they \
             are cut off",
            SHUTDOWN_GRACE.as_secs()
        ),
    }
    // Each regular scraper sees the job's end before the scheduler exits: the alert on a
    // scheduler that stops answering tells a job that ended from a scheduler that died by it.
    if let Some(m) = &served_metrics
        && accepted.job().is_some()
    {
        m.wait_for_last_scrapes(metrics::LAST_SCRAPE_WAIT).await;
    }
    match done_rx.await {
        Ok(report) => Ok(Some(report)),
        Err(_) if accepted.job().is_none() => Ok(None),
        Err(_) => Err(ServerError::Io {
            what: "scheduler actor".into(),
            source: std::io::Error::other("the actor stopped without a report"),
        }),
    }
}

/// What a journal holds, replayed without serving anything ([`replay_journal`]).
pub struct Replayed {
    /// The job and the settings it was written with.
    pub header: rollfleet_proto::v1::JournalHeader,
    /// Records replayed.
    pub records: u64,
    /// Bytes of a record torn at the end (0: none).
    pub torn_bytes: u64,
    /// The report the job wrote at its end, or, when it had not ended, where it stood (a live
    /// run's dispatch latencies excepted).
    pub report: Report,
}

/// Replays the journal at `path` into a fresh actor, as a scheduler restarted on it would, but
/// serving nothing and writing nothing: what the job had done when its scheduler stopped. Give
/// it the window chooser the scheduler ran with (`ServerOptions::window_chooser`), or the job is
/// planned with another admission window and the replay diverges.
pub fn replay_journal(
    path: &std::path::Path,
    window_chooser: Option<Arc<dyn job::WindowChooser>>,
) -> Result<Replayed, ServerError> {
    let (header, mut reader) =
        journal::JournalReader::open(path)?.ok_or_else(|| journal::JournalError::Empty {
            path: path.to_owned(),
        })?;
    // Planned as a scheduler started with the journal's settings plans it.
    let plan = job::JobSlot::new(header.seed, Duration::from_millis(header.stage_timeout_ms))
        .choosing_window(window_chooser)
        .plan(
            &header.job_yaml,
            &format!("the job of journal {}", path.display()),
        )?;
    let options = actor::ActorOptions {
        time_scale: header.time_scale,
        lease_ttl: Duration::from_millis(header.lease_ttl_ms),
        expect_workers: usize::try_from(header.expect_workers).unwrap_or(usize::MAX),
        report: None,
        replan_on_drift: header.replan_on_drift,
        until_stopped: false,
    };
    let status = Arc::new(watch::channel(JobStatus::default()).0);
    let metrics = Arc::new(metrics::Metrics::new()?);
    let feed = Arc::new(feed::FeedLog::default());
    let mut actor = actor::Actor::new(Arc::new(plan), options, status, metrics, feed);
    let records = actor.replay(&mut reader)?;
    Ok(Replayed {
        records,
        torn_bytes: reader.torn_bytes(),
        report: actor
            .final_report()
            .cloned()
            .unwrap_or_else(|| actor.report()),
        header,
    })
}

/// The header a journal of `job_yaml` gets under `opts`: the settings that steer decisions.
fn journal_header(opts: &ServerOptions, job_yaml: &str) -> rollfleet_proto::v1::JournalHeader {
    rollfleet_proto::v1::JournalHeader {
        format: journal::FORMAT.to_owned(),
        job_yaml: job_yaml.to_owned(),
        seed: opts.seed,
        time_scale: opts.time_scale,
        lease_ttl_ms: opts.lease_ttl.as_millis().min(u128::from(u64::MAX)) as u64,
        expect_workers: opts.expect_workers as u64,
        replan_on_drift: opts.replan_on_drift,
        stage_timeout_ms: opts.stage_timeout.as_millis().min(u128::from(u64::MAX)) as u64,
    }
}
