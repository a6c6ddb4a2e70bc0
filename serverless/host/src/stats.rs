//! Counters kept by the host while it serves, readable by the embedder (tests, the CLI's
//! shutdown summary). The invoker keeps its own, client-side accounting; these are the host's
//! view, useful to check that what a client counted really happened.

use std::sync::atomic::{AtomicU64, Ordering};

/// Host-side counters; all monotonic.
#[derive(Debug, Default)]
pub struct HostStats {
    invocations: AtomicU64,
    cold_starts: AtomicU64,
    throttles: AtomicU64,
    function_errors: AtomicU64,
    timeouts: AtomicU64,
    service_errors: AtomicU64,
    events_completed: AtomicU64,
}

/// A point-in-time copy of [`HostStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostStatsSnapshot {
    /// Invocations that ran the function (synchronous and asynchronous).
    pub invocations: u64,
    pub cold_starts: u64,
    pub throttles: u64,
    pub function_errors: u64,
    pub timeouts: u64,
    pub service_errors: u64,
    /// Event (asynchronous) invocations that have finished running.
    pub events_completed: u64,
}

impl HostStats {
    pub fn snapshot(&self) -> HostStatsSnapshot {
        HostStatsSnapshot {
            invocations: self.invocations.load(Ordering::Relaxed),
            cold_starts: self.cold_starts.load(Ordering::Relaxed),
            throttles: self.throttles.load(Ordering::Relaxed),
            function_errors: self.function_errors.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            service_errors: self.service_errors.load(Ordering::Relaxed),
            events_completed: self.events_completed.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn invocation(&self) {
        self.invocations.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn cold_start(&self) {
        self.cold_starts.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn throttle(&self) {
        self.throttles.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn function_error(&self) {
        self.function_errors.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn timeout(&self) {
        self.timeouts.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn service_error(&self) {
        self.service_errors.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn event_completed(&self) {
        self.events_completed.fetch_add(1, Ordering::Relaxed);
    }
}
