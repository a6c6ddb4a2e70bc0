//! The operator's own Prometheus metrics, served over HTTP on `--metrics-addr` (every path gets
//! them, as the scheduler's metrics endpoint does):
//!
//! - `rollfleet_operator_reconciles_total{result="ok"|"error"}`: reconciliation passes;
//! - `rollfleet_operator_reconcile_errors_total`: passes that failed (and are retried);
//! - `rollfleet_operator_reconcile_duration_seconds`: how long a pass took (a histogram);
//! - `rollfleet_operator_jobs{phase}`: the RLJobs this replica reconciled, by the phase it last
//!   wrote or read (an RLJob that is deleted leaves the count).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};
use tokio::net::TcpListener;

use crate::crd::RLJob;

/// The operator's metrics and the registry they are gathered from.
pub struct Metrics {
    registry: Registry,
    /// Passes, by result.
    pub reconciles: IntCounterVec,
    /// Passes that failed.
    pub errors: IntCounter,
    /// How long each pass took.
    pub duration: Histogram,
    jobs: IntGaugeVec,
    /// Each RLJob's (`namespace/name`) phase, from which `jobs` is counted.
    phases: Mutex<BTreeMap<String, String>>,
    /// The phases `jobs` has a series for.
    shown: Mutex<BTreeSet<String>>,
}

impl Metrics {
    /// Fresh metrics in a registry of their own.
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(
                "rollfleet_operator_reconciles_total",
                "Reconciliation passes of RLJobs, by result (ok or error).",
            ),
            &["result"],
        )?;
        let errors = IntCounter::new(
            "rollfleet_operator_reconcile_errors_total",
            "Reconciliation passes that failed (each is retried in 30 s).",
        )?;
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "rollfleet_operator_reconcile_duration_seconds",
                "How long a reconciliation pass took, its API requests and scheduler call included.",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        )?;
        let jobs = IntGaugeVec::new(
            Opts::new(
                "rollfleet_operator_jobs",
                "RLJobs this operator reconciles, by the phase of their status.",
            ),
            &["phase"],
        )?;
        registry.register(Box::new(reconciles.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(jobs.clone()))?;
        Ok(Metrics {
            registry,
            reconciles,
            errors,
            duration,
            jobs,
            phases: Mutex::default(),
            shown: Mutex::default(),
        })
    }

    /// Counts one pass that took `took`.
    pub fn observe(&self, took: Duration, ok: bool) {
        self.duration.observe(took.as_secs_f64());
        let result = if ok { "ok" } else { "error" };
        self.reconciles.with_label_values(&[result]).inc();
        if !ok {
            self.errors.inc();
        }
    }

    /// Records `job`'s phase (`None`: the RLJob is gone).
    pub fn set_phase(&self, job: &RLJob, phase: Option<&str>) {
        let key = format!("{}/{}", job.namespace(), job.name());
        let mut phases = self
            .phases
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match phase {
            Some(phase) => phases.insert(key, phase.to_owned()),
            None => phases.remove(&key),
        };
        let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
        for phase in phases.values() {
            *counts.entry(phase.as_str()).or_default() += 1;
        }
        // A phase no job is in any more shows 0 rather than its last count.
        let mut shown = self
            .shown
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for phase in shown.iter() {
            if !counts.contains_key(phase.as_str()) {
                self.jobs.with_label_values(&[phase.as_str()]).set(0);
            }
        }
        for (phase, count) in counts {
            self.jobs.with_label_values(&[phase]).set(count);
            shown.insert(phase.to_owned());
        }
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

/// Scrapes answered at once; more wait in the kernel's backlog.
const MAX_SCRAPES: usize = 16;

impl rollfleet_scrape::Page for Metrics {
    type Rendered = ();

    fn render(&self) -> (String, ()) {
        (Metrics::render(self), ())
    }
}

/// Serves `metrics` over HTTP on `listener` (every path, plain text) until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    rollfleet_scrape::serve(listener, metrics, MAX_SCRAPES).await;
}
