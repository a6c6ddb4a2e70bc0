//! Counters kept by the host while it serves, readable by the embedder (tests, the CLI's
//! shutdown summary). The invoker keeps its own, client-side accounting; these are the host's
//! view, useful to check that what a client counted really happened, and that the host's limits
//! held (what was refused, discarded or disconnected, and how full the event queue got).

use std::sync::atomic::{AtomicU64, Ordering};

/// Host-side counters; all monotonic except the two `event_queue_*` gauges.
#[derive(Debug, Default)]
pub struct HostStats {
    invocations: AtomicU64,
    cold_starts: AtomicU64,
    throttles: AtomicU64,
    function_errors: AtomicU64,
    timeouts: AtomicU64,
    service_errors: AtomicU64,
    events_completed: AtomicU64,
    events_queued: AtomicU64,
    events_refused: AtomicU64,
    events_expired: AtomicU64,
    payloads_too_large: AtomicU64,
    header_read_timeouts: AtomicU64,
    body_read_timeouts: AtomicU64,
    connection_cap_waits: AtomicU64,
    event_queue_events: AtomicU64,
    event_queue_bytes: AtomicU64,
    event_queue_peak_events: AtomicU64,
    event_queue_peak_bytes: AtomicU64,
}

/// A point-in-time copy of [`HostStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostStatsSnapshot {
    /// Invocations that ran the function (synchronous and asynchronous).
    pub invocations: u64,
    pub cold_starts: u64,
    /// Every 429 answer: concurrency limits, a full event queue, injected throttles.
    pub throttles: u64,
    pub function_errors: u64,
    pub timeouts: u64,
    pub service_errors: u64,
    /// Event (asynchronous) invocations that have finished running.
    pub events_completed: u64,
    /// Event invocations accepted into the asynchronous queue (answered 202).
    pub events_queued: u64,
    /// Event invocations refused with 429 because the queue was full (also in `throttles`).
    pub events_refused: u64,
    /// Queued events discarded, without running, for waiting longer than the maximum age.
    pub events_expired: u64,
    /// Requests refused with 413 for a body over the payload limit of their invocation type.
    pub payloads_too_large: u64,
    /// Connections closed for not sending a whole request head in time (idle keep-alive
    /// connections included).
    pub header_read_timeouts: u64,
    /// Requests answered 408 for not sending their whole body in time.
    pub body_read_timeouts: u64,
    /// Times the host stopped accepting because every connection slot was taken.
    pub connection_cap_waits: u64,
    /// Events in the asynchronous queue now (being received or waiting to run).
    pub event_queue_events: u64,
    /// Payload bytes held by the asynchronous queue now.
    pub event_queue_bytes: u64,
    /// Most events the queue has held at once.
    pub event_queue_peak_events: u64,
    /// Most payload bytes the queue has held at once.
    pub event_queue_peak_bytes: u64,
}

impl HostStats {
    pub fn snapshot(&self) -> HostStatsSnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        HostStatsSnapshot {
            invocations: load(&self.invocations),
            cold_starts: load(&self.cold_starts),
            throttles: load(&self.throttles),
            function_errors: load(&self.function_errors),
            timeouts: load(&self.timeouts),
            service_errors: load(&self.service_errors),
            events_completed: load(&self.events_completed),
            events_queued: load(&self.events_queued),
            events_refused: load(&self.events_refused),
            events_expired: load(&self.events_expired),
            payloads_too_large: load(&self.payloads_too_large),
            header_read_timeouts: load(&self.header_read_timeouts),
            body_read_timeouts: load(&self.body_read_timeouts),
            connection_cap_waits: load(&self.connection_cap_waits),
            event_queue_events: load(&self.event_queue_events),
            event_queue_bytes: load(&self.event_queue_bytes),
            event_queue_peak_events: load(&self.event_queue_peak_events),
            event_queue_peak_bytes: load(&self.event_queue_peak_bytes),
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
    pub(crate) fn event_queued(&self) {
        self.events_queued.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn event_refused(&self) {
        self.events_refused.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn event_expired(&self) {
        self.events_expired.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn payload_too_large(&self) {
        self.payloads_too_large.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn header_read_timeout(&self) {
        self.header_read_timeouts.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn body_read_timeout(&self) {
        self.body_read_timeouts.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn connection_cap_wait(&self) {
        self.connection_cap_waits.fetch_add(1, Ordering::Relaxed);
    }

    /// Records the queue's current size; called under the queue's lock, so the stores of
    /// successive calls do not interleave.
    pub(crate) fn event_queue_size(&self, events: usize, bytes: usize) {
        let (events, bytes) = (events as u64, bytes as u64);
        self.event_queue_events.store(events, Ordering::Relaxed);
        self.event_queue_bytes.store(bytes, Ordering::Relaxed);
        self.event_queue_peak_events
            .fetch_max(events, Ordering::Relaxed);
        self.event_queue_peak_bytes
            .fetch_max(bytes, Ordering::Relaxed);
    }
}
