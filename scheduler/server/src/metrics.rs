//! Prometheus metrics of the scheduler, and the small HTTP endpoint that serves them.
//!
//! The endpoint answers every request on its address with the text exposition format; it is a
//! few lines over a `TcpListener` rather than an HTTP framework, because scraping is its only job.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The scheduler's metrics.
pub struct Metrics {
    /// Where they are registered.
    pub registry: Registry,
    /// Stages completed, per pool.
    pub stage_completions: IntCounterVec,
    /// Trajectories handed to the trainer.
    pub trajectories_trained: IntCounter,
    /// Groups given up as infrastructure failures.
    pub groups_abandoned: IntCounter,
    /// Generations whose engine reported other weights than the version the turn is stamped
    /// with (failed and redone, never trained on).
    pub engine_version_mismatches: IntCounter,
    /// Weight updates an engine failed (or timed out, or did not apply): the replica left
    /// service and is updated again after a backoff.
    pub weight_update_failures: IntCounter,
    /// Environment answers refused for their size (an observation longer than the task's
    /// context, or more text than a trajectory may hold): the stage failed, the worker stayed.
    pub oversized_environment_steps: IntCounter,
    /// Workers that registered.
    pub workers_registered: IntCounter,
    /// Workers lost or cut off.
    pub workers_lost: IntCounter,
    /// Workers that said they were leaving and were released with nothing lost.
    pub workers_left: IntCounter,
    /// Re-plans while the job runs (nodes came or went, or profiles drifted).
    pub replans: IntCounter,
    /// Workers with an open work stream, per pool.
    pub workers: IntGaugeVec,
    /// Trajectories started and not yet trained on, by state.
    pub trajectories: IntGaugeVec,
    /// Trajectories trained on, by how many versions older than the trainer's their oldest
    /// turn was.
    pub trained_by_staleness: IntCounterVec,
    /// Turns thrown away to keep the staleness bound.
    pub regenerated_turns: IntCounter,
    /// Groups restarted on the weights just published, having started too late in a step.
    pub groups_restarted: IntCounter,
    /// Journal writes that failed (the job went on without its journal).
    pub journal_failures: IntCounter,
    /// Journal records replayed when the scheduler resumed a job.
    pub journal_replayed: IntCounter,
    /// gRPC calls refused for want of the scheduler's token, by `reason` (`missing`, `wrong`).
    pub unauthenticated_calls: IntCounterVec,
    /// Stages waiting for a worker of their pool to attach, per pool.
    pub pending_stages: IntGaugeVec,
    /// Share of the pool's capacity in use over the last second, per pool.
    pub pool_busy: GaugeVec,
    /// The policy version (= RL steps trained).
    pub policy_version: IntGauge,
    /// GPU utilisation as a worker last reported it (NVML), per GPU: only for GPUs a worker
    /// reads; absent, never zero, where it has no driver.
    pub gpu_utilization: GaugeVec,
    /// Device memory in use as a worker last reported it, per GPU.
    pub gpu_memory_used: GaugeVec,
    /// Device memory of each GPU a worker reads, from its registration.
    pub gpu_memory_total: GaugeVec,
    /// 1 per GPU a worker reads, labelled with its driver name and UUID.
    pub gpu_info: GaugeVec,
    /// Live workers that registered saying they have no GPU telemetry, per pool.
    pub workers_without_gpu_telemetry: IntGaugeVec,
}

/// The labels of every per-GPU metric.
pub const GPU_LABELS: [&str; 4] = ["pool", "worker", "host", "gpu"];

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new_custom(Some("rollfleet".into()), None)?;
        let stage_completions = IntCounterVec::new(
            Opts::new("stage_completions_total", "Stages completed, per pool."),
            &["pool"],
        )?;
        let trajectories_trained = IntCounter::new(
            "trajectories_trained_total",
            "Trajectories handed to the trainer.",
        )?;
        let groups_abandoned = IntCounter::new(
            "groups_abandoned_total",
            "Groups given up as infrastructure failures: one trajectory's stages failed too often \
             in a row. Never trained on, never scored.",
        )?;
        let engine_version_mismatches = IntCounter::new(
            "engine_version_mismatches_total",
            "Generations whose engine reported other weights than the policy version the turn is \
             stamped with: failed and redone, never trained on.",
        )?;
        let weight_update_failures = IntCounter::new(
            "weight_update_failures_total",
            "Weight updates a replica's engine failed, timed out or did not apply: the replica \
             left service and is updated again after a backoff.",
        )?;
        let oversized_environment_steps = IntCounter::new(
            "oversized_environment_steps_total",
            "Environment answers refused for their size (an observation longer than the task's \
             context, or more text than a trajectory may hold): the stage failed and is retried.",
        )?;
        let workers_registered =
            IntCounter::new("workers_registered_total", "Workers that registered.")?;
        let workers_lost = IntCounter::new(
            "workers_lost_total",
            "Workers lost (stream closed, lease expired) or cut off (protocol violation).",
        )?;
        let workers_left = IntCounter::new(
            "workers_left_total",
            "Workers that said they were leaving (SIGTERM: a node drain or preemption) and were \
             released once what they ran was done, nothing of theirs lost.",
        )?;
        let replans = IntCounter::new(
            "replans_total",
            "Re-plans mid-run: a GPU pool's nodes came or went, or (with --replan-on-drift) the \
             measured profiles drifted; replicas move to the new plan in waves when it is worth it.",
        )?;
        let workers = IntGaugeVec::new(
            Opts::new("workers", "Workers with an open work stream, per pool."),
            &["pool"],
        )?;
        let trajectories = IntGaugeVec::new(
            Opts::new(
                "trajectories",
                "Trajectories started and not yet trained on: `generating` (a stage running or \
                 queued) or `waiting` (complete, waiting for their group or the trainer).",
            ),
            &["state"],
        )?;
        let trained_by_staleness = IntCounterVec::new(
            Opts::new(
                "trajectories_trained_by_staleness_total",
                "Trajectories trained on, by staleness: how many versions older than the \
                 trainer's their oldest turn was (at most the job's maxStaleness).",
            ),
            &["versions"],
        )?;
        let regenerated_turns = IntCounter::new(
            "regenerated_turns_total",
            "Turns thrown away and generated again to keep the staleness bound.",
        )?;
        let groups_restarted = IntCounter::new(
            "groups_restarted_total",
            "Groups restarted on the weights just published: they started so late in a step that \
             a long chain of their task would not finish before their weights expire.",
        )?;
        let journal_failures = IntCounter::new(
            "journal_failures_total",
            "Journal writes that failed: the job went on without its journal, and a restart cannot \
             resume it.",
        )?;
        let journal_replayed = IntCounter::new(
            "journal_replayed_records_total",
            "Journal records replayed when this scheduler resumed the job of one that was killed.",
        )?;
        let unauthenticated_calls = IntCounterVec::new(
            Opts::new(
                "unauthenticated_calls_total",
                "gRPC calls refused because they did not carry the scheduler's token: none \
                 (reason=missing) or another (reason=wrong).",
            ),
            &["reason"],
        )?;
        let pending_stages = IntGaugeVec::new(
            Opts::new(
                "pool_pending_stages",
                "Stages waiting for a worker of the pool to attach (none is).",
            ),
            &["pool"],
        )?;
        let pool_busy = GaugeVec::new(
            Opts::new(
                "pool_busy_ratio",
                "Share of the pool's capacity in use over the last second (GPU figures are \
                 emulated).",
            ),
            &["pool"],
        )?;
        let policy_version = IntGauge::new("policy_version", "Policy version (RL steps trained).")?;
        let gpu_utilization = GaugeVec::new(
            Opts::new(
                "gpu_utilization_ratio",
                "GPU utilisation (NVML: share of the sample period a kernel ran) as the worker \
                 last reported it; only GPUs a worker reads, never a zero for a missing driver.",
            ),
            &GPU_LABELS,
        )?;
        let gpu_memory_used = GaugeVec::new(
            Opts::new(
                "gpu_memory_used_bytes",
                "GPU device memory in use (NVML) as the worker last reported it.",
            ),
            &GPU_LABELS,
        )?;
        let gpu_memory_total = GaugeVec::new(
            Opts::new(
                "gpu_memory_total_bytes",
                "GPU device memory (NVML), from the worker's registration.",
            ),
            &GPU_LABELS,
        )?;
        let info_labels = ["pool", "worker", "host", "gpu", "name", "uuid"];
        let gpu_info = GaugeVec::new(
            Opts::new(
                "gpu_info",
                "1 per GPU a worker reads, with the driver's name and UUID.",
            ),
            &info_labels,
        )?;
        let workers_without_gpu_telemetry = IntGaugeVec::new(
            Opts::new(
                "workers_without_gpu_telemetry",
                "Live workers that said at registration they have no GPU telemetry (no driver), \
                 per pool.",
            ),
            &["pool"],
        )?;
        registry.register(Box::new(stage_completions.clone()))?;
        registry.register(Box::new(trajectories_trained.clone()))?;
        registry.register(Box::new(groups_abandoned.clone()))?;
        registry.register(Box::new(engine_version_mismatches.clone()))?;
        registry.register(Box::new(weight_update_failures.clone()))?;
        registry.register(Box::new(oversized_environment_steps.clone()))?;
        registry.register(Box::new(workers_registered.clone()))?;
        registry.register(Box::new(workers_lost.clone()))?;
        registry.register(Box::new(workers_left.clone()))?;
        registry.register(Box::new(replans.clone()))?;
        registry.register(Box::new(workers.clone()))?;
        registry.register(Box::new(trajectories.clone()))?;
        registry.register(Box::new(trained_by_staleness.clone()))?;
        registry.register(Box::new(regenerated_turns.clone()))?;
        registry.register(Box::new(groups_restarted.clone()))?;
        registry.register(Box::new(journal_failures.clone()))?;
        registry.register(Box::new(journal_replayed.clone()))?;
        registry.register(Box::new(unauthenticated_calls.clone()))?;
        registry.register(Box::new(pending_stages.clone()))?;
        registry.register(Box::new(pool_busy.clone()))?;
        registry.register(Box::new(policy_version.clone()))?;
        registry.register(Box::new(gpu_utilization.clone()))?;
        registry.register(Box::new(gpu_memory_used.clone()))?;
        registry.register(Box::new(gpu_memory_total.clone()))?;
        registry.register(Box::new(gpu_info.clone()))?;
        registry.register(Box::new(workers_without_gpu_telemetry.clone()))?;
        Ok(Metrics {
            registry,
            stage_completions,
            trajectories_trained,
            groups_abandoned,
            engine_version_mismatches,
            weight_update_failures,
            oversized_environment_steps,
            workers_registered,
            workers_lost,
            workers_left,
            replans,
            workers,
            trajectories,
            trained_by_staleness,
            regenerated_turns,
            groups_restarted,
            journal_failures,
            journal_replayed,
            unauthenticated_calls,
            pending_stages,
            pool_busy,
            policy_version,
            gpu_utilization,
            gpu_memory_used,
            gpu_memory_total,
            gpu_info,
            workers_without_gpu_telemetry,
        })
    }

    /// The metrics in the text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let encoder = prometheus::TextEncoder::new();
        if let Err(e) = encoder.encode_utf8(&self.registry.gather(), &mut out) {
            out = format!("# encoding failed: {e}\n");
        }
        out
    }
}

/// Scrapes answered at once; more wait in the kernel's backlog (Prometheus scrapes one at a time).
const MAX_SCRAPES: usize = 64;

/// How long one scrape may take, reading the request and writing the page: a client that stops
/// reading does not hold its connection for good.
const SCRAPE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the metrics over HTTP on `listener` until the task is dropped.
pub async fn serve_metrics(listener: TcpListener, metrics: Arc<Metrics>) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_SCRAPES));
    let mut backoff = std::time::Duration::ZERO;
    loop {
        let Ok(permit) = open.clone().acquire_owned().await else {
            return;
        };
        let mut socket = match listener.accept().await {
            Ok((socket, _)) => {
                backoff = std::time::Duration::ZERO;
                socket
            }
            Err(_) => {
                // Out of descriptors: retrying at once would spin.
                backoff = (backoff * 2).clamp(
                    std::time::Duration::from_millis(10),
                    std::time::Duration::from_secs(1),
                );
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let scrape = async {
                // Read the request head (its content does not matter: every path gets the
                // metrics).
                let mut buf = [0u8; 2048];
                let _ =
                    tokio::time::timeout(std::time::Duration::from_secs(2), socket.read(&mut buf))
                        .await;
                let body = metrics.render();
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(body.as_bytes()).await;
                let _ = socket.shutdown().await;
            };
            let _ = tokio::time::timeout(SCRAPE_WITHIN, scrape).await;
        });
    }
}

/// Binds the metrics endpoint.
pub async fn bind_metrics(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
