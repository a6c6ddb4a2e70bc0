//! Reporting to the scheduler: the node's load with its GPU readings, the decode samples timed
//! from a real engine's streamed answers, and the requests in flight.

use super::*;

/// Profile samples one load report carries at most (the scheduler refuses more).
pub(crate) const MAX_SAMPLES_PER_REPORT: usize =
    rollfleet_proto::peer::MAX_PROFILE_SAMPLES_PER_REPORT;

/// When a real engine's streamed answer arrived, chunk by chunk, and how many of this worker's
/// requests were in flight meanwhile: enough for one decode sample per generation.
///
/// An engine that streams a token a chunk (vLLM, SGLang) decodes the tokens after the first
/// one iteration apart, so the time from the first chunk to the last over the tokens after the
/// first is the iteration time of the batch it ran in. The batch is taken as this worker's
/// requests in flight, averaged over the chunks: right when the engine serves this worker
/// alone, as one engine per replica does, and too small (so the share of peak too low) when it
/// serves others too. Time to the first chunk (queueing plus prefill) gives no prefill sample:
/// behind other requests it is not the prefill's.
#[derive(Debug, Default)]
pub(crate) struct DecodeTiming {
    first: Option<tokio::time::Instant>,
    last: Option<tokio::time::Instant>,
    chunks: u32,
    in_flight_sum: u64,
}

impl DecodeTiming {
    pub(crate) fn chunk(&mut self, at: tokio::time::Instant, in_flight: u32) {
        self.first.get_or_insert(at);
        self.last = Some(at);
        self.chunks += 1;
        self.in_flight_sum += u64::from(in_flight.max(1));
    }

    /// The decode sample of a generation of `tokens` tokens after a `prompt`-token context, on a
    /// replica of `gpus` GPUs: one iteration's work at the mean batch and mean context, by the
    /// model's own accounting (as the emulated engine's), and its measured duration. `None`
    /// for an answer of fewer than two chunks or tokens (no iteration to time).
    pub(crate) fn sample(
        &self,
        costs: &ModelCosts,
        prompt: u64,
        tokens: u64,
        gpus: u32,
    ) -> Option<ProfileSample> {
        let (first, last) = (self.first?, self.last?);
        if self.chunks < 2 || tokens < 2 {
            return None;
        }
        let seconds = last.duration_since(first).as_secs_f64() / (tokens - 1) as f64;
        if !(seconds.is_finite() && seconds > 0.0) {
            return None;
        }
        let batch = self.in_flight_sum as f64 / f64::from(self.chunks);
        let context = prompt as f64 + tokens as f64 / 2.0;
        Some(ProfileSample {
            kind: ProfileKind::Decode as i32,
            flops: batch * (costs.flops_per_token + costs.attention_flops_per_context * context),
            bytes: costs.weight_reads.bytes(batch) + costs.kv_bytes_per_token * batch * context,
            seconds,
            gpus: gpus.max(1),
            emulated: false,
        })
    }
}

/// Counts a request in flight for as long as it lives (an abort drops it too).
pub(crate) struct InFlight<'a>(&'a AtomicU32);

impl<'a> InFlight<'a> {
    pub(crate) fn enter(counter: &'a AtomicU32) -> InFlight<'a> {
        counter.fetch_add(1, Ordering::Relaxed);
        InFlight(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The node's GPU telemetry, read once: what the worker says at registration, and the reader its
/// heartbeats sample (`None` where there is no driver: a machine does not grow one while a worker
/// runs, so it is not asked again).
pub fn gpu_telemetry() -> (GpuTelemetryInfo, Option<rollfleet_gpu::Telemetry>) {
    let unavailable = |reason: String| GpuTelemetryInfo {
        available: false,
        unavailable_reason: reason,
        devices: Vec::new(),
    };
    let devices = match rollfleet_gpu::discover() {
        Ok(devices) => devices,
        Err(rollfleet_gpu::Unavailable(reason)) => return (unavailable(reason), None),
    };
    match rollfleet_gpu::Telemetry::open() {
        Ok(telemetry) => (
            GpuTelemetryInfo {
                available: true,
                unavailable_reason: String::new(),
                devices: devices
                    .into_iter()
                    .map(|d| GpuDevice {
                        index: d.index,
                        name: d.name,
                        uuid: d.uuid,
                        memory_bytes: d.memory_bytes,
                    })
                    .collect(),
            },
            Some(telemetry),
        ),
        Err(rollfleet_gpu::Unavailable(reason)) => (unavailable(reason), None),
    }
}

/// One reading of every GPU, into a heartbeat's load: per GPU, and the mean utilisation and
/// summed memory in use. A GPU whose reading failed is left out; with no reading at all, every
/// GPU field stays absent.
pub(crate) fn add_gpu_readings(load: &mut WorkerLoad, samples: &[rollfleet_gpu::GpuSample]) {
    load.gpus = samples
        .iter()
        .map(|s| GpuReading {
            index: s.index,
            utilization: s.utilization,
            memory_used_bytes: s.memory_used_bytes,
        })
        .collect();
    if !samples.is_empty() {
        let n = samples.len() as f64;
        load.gpu_utilization = Some(samples.iter().map(|s| s.utilization).sum::<f64>() / n);
        load.gpu_memory_used_bytes = Some(samples.iter().map(|s| s.memory_used_bytes as f64).sum());
    }
}

impl Node {
    /// What the node carries now: its emulated replicas' queues, batches and KV caches, and its
    /// environment slots in use. GPU telemetry is absent (no GPU runs anything here), not zero.
    pub(crate) async fn load(&self) -> WorkerLoad {
        let engines: Vec<(u64, Arc<EmulatedEngine>)> = self
            .engines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(&r, e)| (r, e.clone()))
            .collect();
        let kv_bytes = self.plan.costs.kv_bytes_per_token;
        let mut load = WorkerLoad::default();
        for (replica, engine) in engines {
            let gpus = self.replica_config(replica).map_or(1, |rc| rc.gpus);
            let (l, samples) = engine.report().await;
            load.samples
                .extend(samples.into_iter().map(|m| ProfileSample {
                    kind: match m.kind {
                        WorkKind::Prefill => ProfileKind::Prefill,
                        _ => ProfileKind::Decode,
                    } as i32,
                    flops: m.work.flops,
                    bytes: m.work.bytes,
                    seconds: m.seconds,
                    gpus,
                    emulated: true,
                }));
            load.queued_stages += l.queued;
            load.running_stages += l.running;
            load.batch_size += l.running;
            load.kv_cache_used_bytes += (l.kv_used_tokens as f64 * kv_bytes) as u64;
            load.kv_cache_capacity_bytes += (engine.kv_capacity() as f64 * kv_bytes) as u64;
        }
        load.running_stages += self.host.busy() as u32;
        if let Some(b) = &self.openai {
            // A real engine's queue and KV cache are its own; only the requests in flight are known.
            load.running_stages += b.in_flight.load(Ordering::Relaxed);
            load.samples
                .append(&mut b.samples.lock().unwrap_or_else(|p| p.into_inner()));
        }
        if let Some(t) = &self.tokens {
            load.running_stages += t.in_flight.load(Ordering::Relaxed);
        }
        // The latest samples, within what one report carries.
        if load.samples.len() > MAX_SAMPLES_PER_REPORT {
            load.samples
                .drain(..load.samples.len() - MAX_SAMPLES_PER_REPORT);
        }
        load
    }
}
