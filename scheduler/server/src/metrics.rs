//! Prometheus metrics of the scheduler, and the small HTTP endpoint that serves them.
//!
//! The endpoint answers every request on its address with the text exposition format; it is a
//! few lines over a `TcpListener` rather than an HTTP framework, because scraping is its only job.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use prometheus::{
    CounterVec, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry,
};
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
    /// Training batches and weight updates a live worker held without answering past the
    /// bound: aborted there, the batch given again, the update counted as failed.
    pub hung_assignments: IntCounterVec,
    /// Environment answers refused for their size (an observation longer than the task's
    /// context, or more text than a trajectory may hold): the stage failed, the worker stayed.
    pub oversized_environment_steps: IntCounter,
    /// Generation results refused for carrying more token ids, log-probabilities or prompt ids
    /// than the task's whole context: the stage failed, the worker stayed.
    pub oversized_results: IntCounter,
    /// Workers that registered.
    pub workers_registered: IntCounter,
    /// Workers lost or cut off.
    pub workers_lost: IntCounter,
    /// Workers that said they were leaving and were released with nothing lost.
    pub workers_left: IntCounter,
    /// Load reports dropped for coming faster than a worker's rate.
    pub load_reports_dropped: IntCounter,
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
    /// Finished groups found past the staleness bound when the trainer came to take them.
    pub groups_expired_waiting: IntCounter,
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

    // Latencies, busy time, the build and the job's end ([`Metrics::set_job`] labels them all).
    /// How long a worker took for a stage, a training step or a weight update, in the job's
    /// seconds, by kind ([`STAGE_KINDS`]).
    pub stage_duration: HistogramVec,
    /// How long a stage waited from ready (its trajectory's previous stage answered) to sent to
    /// a worker, in the job's seconds, by kind.
    pub stage_queue_wait: HistogramVec,
    /// Time between one policy version and the next (the first: from the job's start), in the
    /// job's seconds.
    pub rl_step_duration: Histogram,
    /// The pool's whole capacity busy, in seconds (wall): `rate()` of it is the busy share.
    pub pool_busy_seconds: CounterVec,
    /// 1 for the job's phase, 0 for the others.
    pub job_phase: IntGaugeVec,
    /// When the job ended (Unix seconds), by the phase it ended in; absent while it runs.
    pub job_end_time: GaugeVec,
    /// The process's own metrics (`process_*`), kept apart so that the registry's `rollfleet`
    /// prefix does not rename them.
    process: Registry,
    /// The labels every exported sample carries once the job is known ([`Metrics::set_job`]).
    job_labels: OnceLock<Vec<(String, String)>>,
    /// Who scrapes the endpoint, and how often ([`Metrics::wait_for_last_scrapes`]).
    scrapers: Mutex<HashMap<IpAddr, Scraper>>,
    /// The job ended: a scrape rendered after this was set shows its end.
    ended: AtomicBool,
    /// What trained trajectories scored and cost, per task ([`TaskOutcomeMetrics`]).
    pub outcomes: TaskOutcomeMetrics,
}

/// The values of the `kind` label of [`Metrics::stage_duration`] and
/// [`Metrics::stage_queue_wait`] (training and weight updates are not queued stages: only the
/// first five occur in the wait).
pub const STAGE_KINDS: [&str; 7] = [
    "prefill",
    "decode",
    "environment_reset",
    "environment_step",
    "reward",
    "train",
    "weight_sync",
];

/// The label naming the job on every sample. Not `job`: Prometheus's own target label `job`
/// would clash with it (and rename the scheduler's to `exported_job`).
pub const JOB_LABEL: &str = "rljob";

/// The label naming the job's Kubernetes namespace on every sample, when it has one.
pub const NAMESPACE_LABEL: &str = "namespace";

/// Buckets of [`Metrics::stage_duration`], seconds: 1 ms (a reward function, an environment
/// step) to 1000 s (a large model's training step), 1-2.5-5 per decade.
const STAGE_SECONDS: [f64; 19] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
    100.0, 250.0, 500.0, 1000.0,
];

/// Buckets of [`Metrics::stage_queue_wait`], seconds: 1 ms (dispatched at once) to 10 minutes
/// (a pool without workers, or generation held back by the staleness bound).
const QUEUE_SECONDS: [f64; 18] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
    150.0, 300.0, 600.0,
];

/// Buckets of [`Metrics::rl_step_duration`], seconds: 0.1 s (a small emulated job) to about
/// 2.8 hours (a large model's step with long agentic rollouts).
const STEP_SECONDS: [f64; 15] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 10000.0,
];

/// A peer that scrapes the endpoint.
struct Scraper {
    /// When its last scrape was answered.
    last: Instant,
    /// Between its last two scrapes.
    interval: Option<Duration>,
    /// Its last scrape was rendered after the job ended.
    saw_end: bool,
}

/// The longest a scheduler whose job ended waits for its scrapers' next scrape.
pub const LAST_SCRAPE_WAIT: Duration = Duration::from_secs(60);

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
        let hung_assignments = IntCounterVec::new(
            Opts::new(
                "hung_assignments_total",
                "Training batches and weight updates a live worker held without an answer past \
                 the bound (10 minutes, or the stage timeout when longer): aborted there; the \
                 batch is given again, the update counts as failed. Per kind: `training` or \
                 `weights`.",
            ),
            &["kind"],
        )?;
        let oversized_environment_steps = IntCounter::new(
            "oversized_environment_steps_total",
            "Environment answers refused for their size (an observation longer than the task's \
             context, or more text than a trajectory may hold): the stage failed and is retried.",
        )?;
        let oversized_results = IntCounter::new(
            "oversized_results_total",
            "Generation results refused for carrying more token ids, log-probabilities or prompt \
             ids than the task's whole context: the stage failed and is retried.",
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
        let load_reports_dropped = IntCounter::new(
            "load_reports_dropped_total",
            "Worker load reports dropped, unread and unjournaled, for coming faster than the \
             worker's rate (a heartbeat that carried one still renews its lease).",
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
        let groups_expired_waiting = IntCounter::new(
            "groups_expired_waiting_total",
            "Finished groups found past the staleness bound when the trainer came to take them: \
             their whole attempt is lost and they generate again.",
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
        registry.register(Box::new(hung_assignments.clone()))?;
        registry.register(Box::new(oversized_environment_steps.clone()))?;
        registry.register(Box::new(oversized_results.clone()))?;
        registry.register(Box::new(workers_registered.clone()))?;
        registry.register(Box::new(workers_lost.clone()))?;
        registry.register(Box::new(workers_left.clone()))?;
        registry.register(Box::new(load_reports_dropped.clone()))?;
        registry.register(Box::new(replans.clone()))?;
        registry.register(Box::new(workers.clone()))?;
        registry.register(Box::new(trajectories.clone()))?;
        registry.register(Box::new(trained_by_staleness.clone()))?;
        registry.register(Box::new(regenerated_turns.clone()))?;
        registry.register(Box::new(groups_restarted.clone()))?;
        registry.register(Box::new(groups_expired_waiting.clone()))?;
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

        // Latencies, busy time, the build and the job's end.
        let in_job_seconds = "in the job's seconds: wall seconds over the time scale of emulated \
                              hardware (`rollfleet run`: 4), wall seconds otherwise";
        let stage_duration = HistogramVec::new(
            HistogramOpts::new(
                "stage_duration_seconds",
                format!(
                    "How long a worker took for a stage (prefill, decode, environment_reset, \
                     environment_step, reward), a training step (train) or a weight update \
                     (weight_sync), {in_job_seconds}."
                ),
            )
            .buckets(STAGE_SECONDS.to_vec()),
            &["kind"],
        )?;
        let stage_queue_wait = HistogramVec::new(
            HistogramOpts::new(
                "stage_queue_wait_seconds",
                format!(
                    "How long a stage waited from ready (its trajectory's previous stage \
                     answered) until it was sent to a worker, {in_job_seconds}. A trajectory's \
                     first stage is not counted."
                ),
            )
            .buckets(QUEUE_SECONDS.to_vec()),
            &["kind"],
        )?;
        let rl_step_duration = Histogram::with_opts(
            HistogramOpts::new(
                "rl_step_duration_seconds",
                format!(
                    "Time from one policy version to the next (the first: from the job's \
                     start), {in_job_seconds}."
                ),
            )
            .buckets(STEP_SECONDS.to_vec()),
        )?;
        let pool_busy_seconds = CounterVec::new(
            Opts::new(
                "pool_busy_seconds_total",
                "The pool's whole capacity in use, in wall seconds (half the pool busy for one \
                 second adds 0.5): rate() of it is the busy share over any window (GPU figures \
                 are emulated).",
            ),
            &["pool"],
        )?;
        let job_phase = IntGaugeVec::new(
            Opts::new(
                "job_phase",
                "1 for the job's phase (Pending, Running, Succeeded, Failed, Cancelled), 0 for \
                 the others.",
            ),
            &["phase"],
        )?;
        let job_end_time = GaugeVec::new(
            Opts::new(
                "job_end_time_seconds",
                "When the job ended (Unix seconds), labelled with the phase it ended in; absent \
                 while it runs. A scheduler whose job ended waits for the next scrape of each \
                 regular scraper before it exits, so that this is seen.",
            ),
            &["phase"],
        )?;
        let build_info = IntGaugeVec::new(
            Opts::new("build_info", "1, labelled with the scheduler's version."),
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        // Every kind's series from the start (at 0), so that rate() counts its first samples.
        for kind in STAGE_KINDS {
            stage_duration.with_label_values(&[kind]);
        }
        for kind in &STAGE_KINDS[..5] {
            stage_queue_wait.with_label_values(&[kind]);
        }
        registry.register(Box::new(stage_duration.clone()))?;
        registry.register(Box::new(stage_queue_wait.clone()))?;
        registry.register(Box::new(rl_step_duration.clone()))?;
        registry.register(Box::new(pool_busy_seconds.clone()))?;
        registry.register(Box::new(job_phase.clone()))?;
        registry.register(Box::new(job_end_time.clone()))?;
        registry.register(Box::new(build_info))?;
        let outcomes = TaskOutcomeMetrics::register(&registry)?;
        let process = Registry::new();
        // CPU seconds, resident and virtual memory, open and maximum descriptors, start time:
        // read from /proc, so only on Linux.
        #[cfg(target_os = "linux")]
        process.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        Ok(Metrics {
            registry,
            stage_completions,
            trajectories_trained,
            groups_abandoned,
            engine_version_mismatches,
            weight_update_failures,
            hung_assignments,
            oversized_environment_steps,
            oversized_results,
            workers_registered,
            workers_lost,
            workers_left,
            load_reports_dropped,
            replans,
            workers,
            trajectories,
            trained_by_staleness,
            regenerated_turns,
            groups_restarted,
            groups_expired_waiting,
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
            stage_duration,
            stage_queue_wait,
            rl_step_duration,
            pool_busy_seconds,
            job_phase,
            job_end_time,
            process,
            job_labels: OnceLock::new(),
            scrapers: Mutex::new(HashMap::new()),
            ended: AtomicBool::new(false),
            outcomes,
        })
    }

    /// Labels every sample with the job (`rljob`) and its namespace, if it has one. The
    /// registry exists before a scheduler started without a job is given one (its refusals are
    /// counted from the start), so the labels are added when samples are gathered, as a
    /// registry's constant labels are, rather than fixed when it is made. The first call wins:
    /// a scheduler serves one job.
    pub fn set_job(&self, name: &str, namespace: Option<&str>) {
        let mut labels = vec![(JOB_LABEL.to_owned(), name.to_owned())];
        if let Some(ns) = namespace.filter(|ns| !ns.is_empty()) {
            labels.push((NAMESPACE_LABEL.to_owned(), ns.to_owned()));
        }
        let _ = self.job_labels.set(labels);
    }

    /// Every metric family, the process's included, with the job's labels.
    fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        let mut families = self.registry.gather();
        families.extend(self.process.gather());
        let Some(labels) = self.job_labels.get() else {
            return families;
        };
        for family in &mut families {
            for metric in family.mut_metric().iter_mut() {
                let mut pairs = metric.take_label();
                for (name, value) in labels {
                    // A metric of its own with the same label keeps its value.
                    if pairs.iter().all(|p| p.name() != name) {
                        let mut pair = prometheus::proto::LabelPair::default();
                        pair.set_name(name.clone());
                        pair.set_value(value.clone());
                        pairs.push(pair);
                    }
                }
                metric.set_label(pairs);
            }
        }
        families
    }

    /// Waits, after the job ended, until every peer that scrapes the endpoint regularly has
    /// scraped it once more, so that the job's end ([`Metrics::job_end_time`]) is in its
    /// time series before the scheduler exits; for each at most 1.5 of its interval and a
    /// second, and never longer than `at_most`. Returns at once when nobody scrapes.
    pub async fn wait_for_last_scrapes(&self, at_most: Duration) {
        self.ended.store(true, Ordering::SeqCst);
        let now = Instant::now();
        let deadline = {
            let mut scrapers = self
                .scrapers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // Only a peer that scraped at least twice, the last time recently, is waited for:
            // a person's one `curl` is not.
            scrapers.retain(|_, s| {
                s.interval.is_some_and(|i| {
                    now.saturating_duration_since(s.last) <= i * 2 + Duration::from_secs(1)
                })
            });
            scrapers
                .values()
                .filter_map(|s| s.interval)
                .map(|i| i.mul_f64(1.5) + Duration::from_secs(1))
                .max()
                .map(|wait| now + wait.min(at_most))
        };
        let Some(deadline) = deadline else {
            return;
        };
        tracing::info!(target: "rollfleet::scheduler",
            "scheduler: waiting up to {:.1} s for the next scrape of the metrics, so that the \
             job's end is recorded",
            deadline.saturating_duration_since(now).as_secs_f64()
        );
        loop {
            let waiting = self
                .scrapers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .values()
                .any(|s| !s.saw_end);
            if !waiting || Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Notes a scrape by `peer` answered whole; `saw_end`: it was rendered after the job ended.
    fn scraped(&self, peer: IpAddr, saw_end: bool) {
        let now = Instant::now();
        let mut scrapers = self
            .scrapers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let s = scrapers.entry(peer).or_insert(Scraper {
            last: now,
            interval: None,
            saw_end,
        });
        if s.last < now {
            s.interval = Some(now - s.last);
        }
        s.last = now;
        s.saw_end = saw_end;
    }

    /// The metrics in the text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let encoder = prometheus::TextEncoder::new();
        if let Err(e) = encoder.encode_utf8(&self.gather(), &mut out) {
            out = format!("# encoding failed: {e}\n");
        }
        out
    }
}

/// Scrapes answered at once; more wait in the kernel's backlog (Prometheus scrapes one at a time).
const MAX_SCRAPES: usize = 64;

impl rollfleet_scrape::Page for Metrics {
    /// Whether the job had ended when the page was rendered.
    type Rendered = bool;

    fn render(&self) -> (String, bool) {
        let saw_end = self.ended.load(Ordering::SeqCst);
        (Metrics::render(self), saw_end)
    }

    fn served(&self, peer: IpAddr, saw_end: bool) {
        self.scraped(peer, saw_end);
    }
}

/// Serves the metrics over HTTP on `listener` until the task is dropped.
pub async fn serve_metrics(listener: TcpListener, metrics: Arc<Metrics>) {
    rollfleet_scrape::serve(listener, metrics, MAX_SCRAPES).await;
}

/// Binds the metrics endpoint.
pub async fn bind_metrics(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// What the trained trajectories scored and cost, per task (label `task`): the RL figures a
/// practitioner watches next to the scheduler's own. Means over a window are a sum's increase
/// over the count's, e.g. turns per trajectory:
/// `increase(rollfleet_task_turns_total[5m]) /
/// increase(rollfleet_task_trajectories_trained_total[5m])`.
pub struct TaskOutcomeMetrics {
    /// Trajectories of the task handed to the trainer.
    pub trajectories: IntCounterVec,
    /// The sum of their rewards (`rollfleet_task_cumulative_reward`). A gauge, not a counter:
    /// rewards may be negative (an unsolved Sokoban level ends on -0.1), so the sum may fall,
    /// which a counter's must not; the mean over a window is `delta()` of it over `increase()`
    /// of the trajectories. Not named `_sum`: that suffix is a histogram's or a summary's.
    pub reward_sum: GaugeVec,
    /// Those whose reward reached the success threshold.
    pub successes: IntCounterVec,
    /// Their turns.
    pub turns: IntCounterVec,
    /// Their prompt and observation tokens (what the policy read).
    pub prompt_tokens: IntCounterVec,
    /// Their action tokens (what the policy generated).
    pub action_tokens: IntCounterVec,
    /// The policy versions each was behind at training (its oldest turn's), summed.
    pub staleness_versions: IntCounterVec,
    /// Mean reward of the task's trajectories in the RL step trained last (so far, while its
    /// batches come in).
    pub last_step_mean_reward: GaugeVec,
    /// Share of them that succeeded, 0..1.
    pub last_step_success_ratio: GaugeVec,
}

impl TaskOutcomeMetrics {
    fn register(registry: &Registry) -> Result<TaskOutcomeMetrics, prometheus::Error> {
        let counter = |name: &str, help: &str| IntCounterVec::new(Opts::new(name, help), &["task"]);
        let gauge = |name: &str, help: &str| GaugeVec::new(Opts::new(name, help), &["task"]);
        let m = TaskOutcomeMetrics {
            trajectories: counter(
                "task_trajectories_trained_total",
                "Trajectories of the task handed to the trainer.",
            )?,
            reward_sum: gauge(
                "task_cumulative_reward",
                "Sum of the rewards of the task's trained trajectories (a gauge: rewards may be \
                 negative); mean reward over a window: delta() of it over increase() of \
                 rollfleet_task_trajectories_trained_total.",
            )?,
            successes: counter(
                "task_successes_total",
                "Trained trajectories of the task whose reward reached the success threshold \
                 (1: what the built-in environments and reward functions give a solved episode).",
            )?,
            turns: counter(
                "task_turns_total",
                "Turns of the task's trained trajectories.",
            )?,
            prompt_tokens: counter(
                "task_prompt_tokens_total",
                "Prompt and observation tokens of the task's trained trajectories.",
            )?,
            action_tokens: counter(
                "task_action_tokens_total",
                "Action (generated) tokens of the task's trained trajectories.",
            )?,
            staleness_versions: counter(
                "task_staleness_versions_total",
                "Policy versions the task's trained trajectories were behind the trainer (their \
                 oldest turn's), summed.",
            )?,
            last_step_mean_reward: gauge(
                "task_last_step_mean_reward",
                "Mean reward of the task's trajectories in the RL step trained last.",
            )?,
            last_step_success_ratio: gauge(
                "task_last_step_success_ratio",
                "Share of the task's trajectories in the RL step trained last that succeeded.",
            )?,
        };
        for c in [
            &m.trajectories,
            &m.successes,
            &m.turns,
            &m.prompt_tokens,
            &m.action_tokens,
            &m.staleness_versions,
        ] {
            registry.register(Box::new(c.clone()))?;
        }
        for g in [
            &m.reward_sum,
            &m.last_step_mean_reward,
            &m.last_step_success_ratio,
        ] {
            registry.register(Box::new(g.clone()))?;
        }
        Ok(m)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test fails loudly
mod job_labels_and_last_scrapes {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The sample lines of an exposition (no comments).
    fn samples(exposition: &str) -> Vec<&str> {
        exposition
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .collect()
    }

    #[test]
    fn every_sample_carries_the_job_and_its_namespace_once_the_job_is_known() {
        let m = Metrics::new().unwrap();
        m.stage_duration.with_label_values(&["decode"]).observe(0.3);
        let before = m.render();
        assert!(!before.contains("rljob="), "{before}");
        m.set_job("quickstart", Some("rl-team"));
        // A scheduler serves one job: a second name changes nothing.
        m.set_job("other", None);
        let after = m.render();
        for line in samples(&after) {
            assert!(
                line.contains("rljob=\"quickstart\"") && line.contains("namespace=\"rl-team\""),
                "{line}"
            );
        }
        assert!(
            after.contains(&format!(
                "rollfleet_build_info{{version=\"{}\",rljob=\"quickstart\",namespace=\"rl-team\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{after}"
        );
        assert!(
            after.contains("rollfleet_stage_duration_seconds_bucket{kind=\"decode\",rljob=\"quickstart\",namespace=\"rl-team\",le=\"0.5\"} 1"),
            "{after}"
        );
        // Every kind is there from the start, at 0.
        for kind in STAGE_KINDS {
            assert!(
                after.contains(&format!(
                    "rollfleet_stage_duration_seconds_count{{kind=\"{kind}\""
                )),
                "{kind}: {after}"
            );
        }
        if cfg!(target_os = "linux") {
            // The process's own metrics keep their standard names.
            assert!(
                after.contains("\nprocess_cpu_seconds_total{rljob=\"quickstart\""),
                "{after}"
            );
            assert!(
                after.contains("\nprocess_resident_memory_bytes{"),
                "{after}"
            );
            assert!(after.contains("\nprocess_open_fds{"), "{after}");
        }
    }

    #[test]
    fn a_job_without_a_namespace_is_labelled_with_its_name_alone() {
        let m = Metrics::new().unwrap();
        m.set_job("quickstart", None);
        let out = m.render();
        for line in samples(&out) {
            assert!(line.contains("rljob=\"quickstart\""), "{line}");
            assert!(!line.contains("namespace="), "{line}");
        }
    }

    #[test]
    fn the_bucket_bounds_rise() {
        for buckets in [&STAGE_SECONDS[..], &QUEUE_SECONDS[..], &STEP_SECONDS[..]] {
            assert!(buckets.windows(2).all(|w| w[0] < w[1]), "{buckets:?}");
        }
    }

    async fn scrape(addr: SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn an_ended_job_waits_for_the_next_scrape_of_a_regular_scraper_and_for_nobody_else() {
        let m = Arc::new(Metrics::new().unwrap());
        let listener = bind_metrics("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_metrics(listener, m.clone()));

        // Scraped once: nobody scrapes regularly, and the end waits for nothing.
        scrape(addr).await;
        let start = Instant::now();
        m.wait_for_last_scrapes(Duration::from_secs(30)).await;
        assert!(start.elapsed() < Duration::from_secs(1));

        // Scraped every 200 ms: the end waits for the next scrape, which shows it.
        let m = Arc::new(Metrics::new().unwrap());
        let listener = bind_metrics("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_metrics(listener, m.clone()));
        scrape(addr).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        scrape(addr).await;
        let scraper = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            scrape(addr).await
        });
        m.job_end_time.with_label_values(&["Succeeded"]).set(1.0);
        let start = Instant::now();
        m.wait_for_last_scrapes(Duration::from_secs(30)).await;
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(250) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        let last = scraper.await.unwrap();
        assert!(
            last.contains("rollfleet_job_end_time_seconds{phase=\"Succeeded\"} 1"),
            "{last}"
        );

        // A scraper that stops: the end waits at most 1.5 of its interval and a second.
        let m = Arc::new(Metrics::new().unwrap());
        let listener = bind_metrics("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_metrics(listener, m.clone()));
        scrape(addr).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        scrape(addr).await;
        let start = Instant::now();
        m.wait_for_last_scrapes(Duration::from_secs(30)).await;
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(1100) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
    }
}
