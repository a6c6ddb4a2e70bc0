//! Hardware models: how long work takes on the simulated and emulated machines.
//!
//! The simulator runs these models, and so do emulated engines (`workers/engine`), so an emulated
//! run takes the time its simulation does. They are deliberately separate from the estimates the
//! core uses for its decisions, so that a wrong estimate shows up as a worse result rather than
//! being assumed away.
//!
//! - **Inference replica** ([`Engine`]): a roofline of the model's FLOPs and bytes against the
//!   replica's GPUs (peak BF16 FLOP/s and HBM bandwidth from the catalogue, times
//!   [`HardwareModel::compute_efficiency`] and [`HardwareModel::bandwidth_efficiency`]).
//!   Decode is continuously batched: one iteration advances every running sequence by a token and
//!   takes `max(FLOPs / compute, bytes / bandwidth)`, where FLOPs are `2 * N_active` per sequence
//!   plus attention over its context and bytes are the weights the batch reads (once per
//!   iteration: all of a dense model's; a mixture of experts' shared weights plus the expected
//!   union of the experts its tokens route to, [`rollfleet_spec::WeightReads`]) plus every
//!   sequence's KV cache. The iteration time is recomputed whenever the batch changes
//!   (a fluid model of the per-token loop, exact between batch changes up to context growth).
//!   Prefill runs in batches of up to [`PREFILL_BATCH_TOKENS`] tokens, mixed with decode as
//!   chunked prefill does: decode keeps its pace and prefill gets the compute decode leaves. A
//!   prefill of `t` tokens after `c` cached ones pays causal attention over every position
//!   (`t c + t (t + 1) / 2` tokens of context) and reads the weights its batch's tokens route to.
//! - **KV-cache transfer**: tokens x KV bytes per token over the cross-pool link.
//! - **Model costs** ([`model_costs`]): FLOPs, weight and KV-cache bytes per token of the job's
//!   model, which every replica model above is charged with.
//! - **Training** and **weight transfer**: in the simulator's `sim.rs` (`rollfleet-sim`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use rollfleet_core::slab::IdSlab;
use rollfleet_core::{StageId, Time, TrajId};
pub use rollfleet_planner::roofline::{Work as RooflineWork, WorkKind};
pub use rollfleet_spec::WeightReads;
use rollfleet_spec::{JobSpec, causal_attention_flops};

/// Hashes a trajectory id with one multiplication (Fibonacci hashing) for [`Engine::kv_held`],
/// which every stage start and end looks up: a tree walk there was a few percent of a run.
/// The map is never iterated, so its order cannot reach a result, and the hash has no random
/// seed: runs stay reproducible.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Tokens one prefill batch takes at most.
pub const PREFILL_BATCH_TOKENS: u64 = 16_384;

pub use rollfleet_planner::predict::DECODE_COMPUTE_SHARE_MAX;

/// Achieved fractions of peak, and other constants of the simulated hardware.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct HardwareModel {
    /// Share of peak FLOP/s that inference kernels achieve (prefill, compute-bound).
    pub compute_efficiency: f64,
    /// Share of peak HBM bandwidth that decode achieves (memory-bound).
    pub bandwidth_efficiency: f64,
    /// Share of the cross-pool link a bulk transfer achieves.
    pub link_efficiency: f64,
    /// How long an idle serverless instance stays warm, seconds.
    pub serverless_keepalive_s: f64,
}

impl Default for HardwareModel {
    fn default() -> Self {
        HardwareModel {
            compute_efficiency: 0.6,
            bandwidth_efficiency: 0.8,
            link_efficiency: 0.8,
            serverless_keepalive_s: 600.0,
        }
    }
}

/// Per-token costs of the policy model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelCosts {
    /// Dense forward FLOPs per token (2 x active parameters).
    pub flops_per_token: f64,
    /// Attention FLOPs per token per token of context (4 x layers x heads x head dim).
    pub attention_flops_per_context: f64,
    /// Bytes of active weights one token's forward pass reads.
    pub active_weight_bytes: f64,
    /// Bytes of weights a forward pass reads as a function of its tokens.
    pub weight_reads: WeightReads,
    /// KV-cache bytes per token.
    pub kv_bytes_per_token: f64,
}

/// A prefill waiting for (or in) a batch.
#[derive(Debug, Clone)]
pub struct PrefillJob {
    /// The stage.
    pub stage: StageId,
    /// The trajectory.
    pub traj: TrajId,
    /// Tokens already cached.
    pub cached: u64,
    /// Tokens to compute.
    pub tokens: u64,
    /// Tokens to decode after it (`None`: prefill only).
    pub decode: Option<u64>,
}

#[derive(Debug, Clone)]
struct Seq {
    stage: StageId,
    target: f64,
    tokens: u64,
    ctx_base: f64,
}

/// Something an engine finished.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineDone {
    /// A prefill-only job.
    Prefilled(StageId),
    /// A generation, with its tokens.
    Generated(StageId, u64),
}

/// A duration the engine measured: what a worker would report for a stage of work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// Prefill (one batch) or decode (one iteration of the running batch).
    pub kind: WorkKind,
    /// Its FLOPs and bytes.
    pub work: RooflineWork,
    /// How long it took on this replica, seconds.
    pub seconds: f64,
}

/// The prefill batch a replica is running.
#[derive(Debug, Clone)]
struct PrefillBatch {
    /// When it ends at the rate it runs at now.
    end: Time,
    jobs: Vec<PrefillJob>,
    work: RooflineWork,
    /// Share of its work left at the engine's `last`.
    left: f64,
    /// Seconds the whole batch takes at the rate it runs at now.
    secs: f64,
    /// Whether it has run alone at one rate so far (no sequence decoding beside it, no
    /// slowdown): its duration is then a sample of the replica's prefill rate.
    alone: bool,
}

/// One inference replica.
#[derive(Debug, Clone)]
pub struct Engine {
    /// GPUs.
    pub gpus: u32,
    flops: f64,
    bandwidth: f64,
    /// Peak FLOP/s of the replica (all its GPUs), for profile samples.
    pub peak_flops: f64,
    /// Peak memory bytes/s of the replica (all its GPUs), for profile samples.
    pub peak_bandwidth: f64,
    /// Durations measured since the owner last drained them (profile samples).
    pub measured: Vec<Measured>,
    iter_work: RooflineWork,
    costs: ModelCosts,
    /// KV tokens it can hold.
    pub kv_capacity: u64,
    /// KV tokens held, per trajectory (the sim's own books). Looked up, never iterated.
    pub kv_held: HashMap<TrajId, u64, BuildHasherDefault<IdHasher>>,
    /// Sum of `kv_held`.
    pub kv_used: u64,
    /// Version of the weights.
    pub version: Option<u64>,
    /// Incremented whenever scheduled wake-ups become void.
    pub epoch: u64,
    queue: VecDeque<PrefillJob>,
    batch: Option<PrefillBatch>,
    /// An empty batch vector kept for its allocation.
    spare_jobs: Vec<PrefillJob>,
    /// Running sequences by join order (keys only grow: a slab, not a tree).
    seqs: IdSlab<Seq>,
    /// Running sequences by `(target progress as bits, key)`, smallest on top: the next to
    /// finish. A heap, not a tree: a sequence is pushed once and popped once (a cancel, rare,
    /// filters the heap), and only the smallest is ever looked at. Targets are not negative, so
    /// their bits order as the numbers do; keys are distinct, so the order is total.
    finish: BinaryHeap<Reverse<(u64, u64)>>,
    next_seq: u64,
    progress: f64,
    last: Time,
    t_iter: f64,
    sum_ctx_base: f64,
    /// Generated tokens so far.
    pub tokens_generated: u64,
    /// Prefilled tokens so far.
    pub tokens_prefilled: u64,
    /// Seconds sequences spent in a decode batch, summed over the sequences (a batch of 4 for
    /// a second adds 4), and the tokens they decoded meanwhile: their ratio is the mean time a
    /// token took, over the tokens, as a sequence saw it.
    pub decode_sequence_s: f64,
    /// See [`Engine::decode_sequence_s`] (fractional: a stretch ends mid-iteration).
    pub decode_tokens_timed: f64,
    /// Seconds with at least one sequence decoding.
    pub decoding_s: f64,
}

impl Engine {
    /// A replica of `gpus` GPUs with the given per-GPU peak FLOP/s and bytes/s.
    pub fn new(
        gpus: u32,
        peak_flops: f64,
        bandwidth: f64,
        hw: &HardwareModel,
        costs: ModelCosts,
        kv_capacity: u64,
    ) -> Engine {
        Engine {
            gpus,
            flops: gpus as f64 * peak_flops * hw.compute_efficiency,
            bandwidth: gpus as f64 * bandwidth * hw.bandwidth_efficiency,
            peak_flops: gpus as f64 * peak_flops,
            peak_bandwidth: gpus as f64 * bandwidth,
            measured: Vec::new(),
            iter_work: RooflineWork {
                flops: 0.0,
                bytes: 0.0,
            },
            costs,
            kv_capacity,
            kv_held: HashMap::default(),
            kv_used: 0,
            version: Some(0),
            epoch: 0,
            queue: VecDeque::new(),
            batch: None,
            spare_jobs: Vec::new(),
            seqs: IdSlab::new(),
            finish: BinaryHeap::new(),
            next_seq: 0,
            progress: 0.0,
            last: Time::ZERO,
            t_iter: 0.0,
            sum_ctx_base: 0.0,
            tokens_generated: 0,
            tokens_prefilled: 0,
            decode_sequence_s: 0.0,
            decode_tokens_timed: 0.0,
            decoding_s: 0.0,
        }
    }

    /// Whether it is doing anything.
    pub fn busy(&self) -> bool {
        self.batch.is_some() || !self.seqs.is_empty()
    }

    /// Sets the KV held for a trajectory; returns whether capacity still holds.
    pub fn hold_kv(&mut self, traj: TrajId, tokens: u64) -> bool {
        let old = self.kv_held.insert(traj, tokens).unwrap_or(0);
        self.kv_used = self.kv_used - old + tokens;
        self.kv_used <= self.kv_capacity
    }

    /// Frees the KV held for a trajectory.
    pub fn release_kv(&mut self, traj: TrajId) {
        if let Some(old) = self.kv_held.remove(&traj) {
            self.kv_used -= old;
        }
    }

    /// Forgets everything (lost, or loading new weights keeps nothing).
    pub fn wipe(&mut self, now: Time) {
        self.kv_held.clear();
        self.kv_used = 0;
        self.queue.clear();
        self.batch = None;
        self.seqs = IdSlab::new();
        self.finish.clear();
        self.progress = 0.0;
        self.sum_ctx_base = 0.0;
        self.last = now;
        self.t_iter = 0.0;
        self.epoch += 1;
    }

    fn advance(&mut self, now: Time) {
        if let Some(b) = &mut self.batch
            && b.secs > 0.0
        {
            let dt = now.since(self.last).as_secs_f64();
            b.left = (b.left - dt / b.secs).max(0.0);
        }
        if !self.seqs.is_empty() && self.t_iter > 0.0 {
            let dt = now.since(self.last).as_secs_f64();
            self.progress += dt / self.t_iter;
            let batch = self.seqs.len() as f64;
            self.decode_sequence_s += batch * dt;
            self.decoding_s += dt;
            self.decode_tokens_timed += batch * dt / self.t_iter;
            // One sample per stretch at a constant batch: the iteration time the batch ran at.
            if dt > 0.0 {
                self.measured.push(Measured {
                    kind: WorkKind::Decode,
                    work: self.iter_work,
                    seconds: self.t_iter,
                });
            }
        }
        self.last = now;
    }

    fn recompute(&mut self) {
        let n = self.seqs.len() as f64;
        if n == 0.0 {
            self.t_iter = 0.0;
        } else {
            let ctx = self.sum_ctx_base + n * self.progress;
            let flops =
                n * self.costs.flops_per_token + self.costs.attention_flops_per_context * ctx;
            let bytes = self.costs.weight_reads.bytes(n) + self.costs.kv_bytes_per_token * ctx;
            self.t_iter = (flops / self.flops).max(bytes / self.bandwidth).max(1e-9);
            self.iter_work = RooflineWork { flops, bytes };
        }
        self.retime_prefill();
    }

    /// Seconds a prefill of `work` takes with the compute the decoding sequences leave now.
    fn prefill_secs(&self, work: RooflineWork) -> f64 {
        let compute = self.flops * (1.0 - self.decode_compute_share());
        (work.flops / compute).max(work.bytes / self.bandwidth)
    }

    /// The prefill batch under way goes on at the compute the decode batch leaves it from now
    /// on: its end moves whenever a sequence joins or leaves (the caller advanced it first).
    fn retime_prefill(&mut self) {
        let Some(work) = self.batch.as_ref().map(|b| b.work) else {
            return;
        };
        let secs = self.prefill_secs(work);
        let alone = self.seqs.is_empty();
        let last = self.last;
        if let Some(b) = &mut self.batch {
            b.secs = secs;
            b.alone &= alone;
            b.end = last.plus(rollfleet_core::Span::from_secs_f64(b.left * secs));
        }
    }

    /// Share of compute decode uses right now.
    fn decode_compute_share(&self) -> f64 {
        if self.seqs.is_empty() || self.t_iter <= 0.0 {
            return 0.0;
        }
        let n = self.seqs.len() as f64;
        let ctx = self.sum_ctx_base + n * self.progress;
        let flops = n * self.costs.flops_per_token + self.costs.attention_flops_per_context * ctx;
        (flops / self.flops / self.t_iter).min(DECODE_COMPUTE_SHARE_MAX)
    }

    /// Queues a prefill (then, for a generation, its decode).
    pub fn add_prefill(&mut self, now: Time, job: PrefillJob) {
        self.advance(now);
        self.queue.push_back(job);
        self.start_batch(now);
    }

    /// Starts decoding a sequence whose KV cache of `context` tokens is in place.
    pub fn add_decode(&mut self, now: Time, stage: StageId, context: u64, tokens: u64) {
        self.advance(now);
        self.join(stage, context, tokens);
        self.recompute();
    }

    fn join(&mut self, stage: StageId, context: u64, tokens: u64) {
        let key = self.next_seq;
        self.next_seq += 1;
        let tokens = tokens.max(1);
        let target = self.progress + tokens as f64;
        let ctx_base = context as f64 - self.progress;
        self.sum_ctx_base += ctx_base;
        self.seqs.insert(
            key,
            Seq {
                stage,
                target,
                tokens,
                ctx_base,
            },
        );
        self.finish.push(Reverse((target.to_bits(), key)));
    }

    fn start_batch(&mut self, now: Time) {
        if self.batch.is_some() || self.queue.is_empty() {
            return;
        }
        let mut jobs = std::mem::take(&mut self.spare_jobs);
        let mut tokens = 0;
        while let Some(job) = self.queue.front() {
            if !jobs.is_empty() && tokens + job.tokens > PREFILL_BATCH_TOKENS {
                break;
            }
            tokens += job.tokens;
            if let Some(job) = self.queue.pop_front() {
                jobs.push(job);
            }
        }
        let mut flops = 0.0;
        let mut bytes = self.costs.weight_reads.bytes(tokens as f64);
        for job in &jobs {
            let t = job.tokens as f64;
            flops += t * self.costs.flops_per_token
                + causal_attention_flops(
                    self.costs.attention_flops_per_context,
                    job.cached as f64,
                    t,
                );
            bytes += self.costs.kv_bytes_per_token * (job.cached as f64 + t);
        }
        let work = RooflineWork { flops, bytes };
        let secs = self.prefill_secs(work);
        self.batch = Some(PrefillBatch {
            end: now.plus(rollfleet_core::Span::from_secs_f64(secs)),
            jobs,
            work,
            left: 1.0,
            secs,
            alone: self.seqs.is_empty(),
        });
    }

    /// When it next finishes something.
    pub fn next_wake(&self) -> Option<Time> {
        let batch = self.batch.as_ref().map(|b| b.end);
        let decode = self.finish.peek().map(|&Reverse((bits, _))| {
            let remaining = (f64::from_bits(bits) - self.progress).max(0.0);
            self.last
                .plus(rollfleet_core::Span::from_secs_f64(remaining * self.t_iter))
        });
        match (batch, decode) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Advances to `now` and returns what finished.
    pub fn wake(&mut self, now: Time) -> Vec<EngineDone> {
        let mut done = Vec::new();
        self.wake_into(now, &mut done);
        done
    }

    /// Advances to `now` and appends what finished to `done` (the simulator keeps one buffer).
    pub fn wake_into(&mut self, now: Time, done: &mut Vec<EngineDone>) {
        self.advance(now);
        if let Some(b) = &self.batch
            && b.end <= now
            && let Some(PrefillBatch {
                mut jobs,
                work,
                secs,
                alone,
                ..
            }) = self.batch.take()
        {
            // A prefill that shared the GPU with running decodes also paid for them: its
            // duration is not a sample of the prefill rate (it would read as a slower GPU), so
            // only one that ran alone throughout (at one rate, exactly `secs`) is reported.
            if alone {
                self.measured.push(Measured {
                    kind: WorkKind::Prefill,
                    work,
                    seconds: secs,
                });
            }
            for job in jobs.drain(..) {
                self.tokens_prefilled += job.tokens;
                match job.decode {
                    None => done.push(EngineDone::Prefilled(job.stage)),
                    Some(tokens) => self.join(job.stage, job.cached + job.tokens, tokens),
                }
            }
            // The next batch reuses its allocation.
            self.spare_jobs = jobs;
            self.start_batch(now);
        }
        // Sequences within a nanosecond's worth of progress of their target are done.
        let slack = if self.t_iter > 0.0 {
            1e-9 / self.t_iter
        } else {
            0.0
        };
        while let Some(&Reverse((bits, key))) = self.finish.peek() {
            if f64::from_bits(bits) > self.progress + slack + 1e-9 {
                break;
            }
            self.finish.pop();
            if let Some(seq) = self.seqs.remove(key) {
                self.sum_ctx_base -= seq.ctx_base;
                self.tokens_generated += seq.tokens;
                done.push(EngineDone::Generated(seq.stage, seq.tokens));
            }
        }
        if self.seqs.is_empty() {
            self.progress = 0.0;
            self.sum_ctx_base = 0.0;
        }
        self.recompute();
    }

    /// From `now` on, achieves only `share` of the rates it had (a throttled or badly-driven
    /// GPU); its peaks stay, so what it measures shows the drop. A prefill batch already under
    /// way goes on at the new rate (and, having run at two, is no sample of either).
    pub fn slow_down(&mut self, now: Time, share: f64) {
        self.advance(now);
        if let Some(b) = &mut self.batch {
            b.alone = false;
        }
        self.flops *= share;
        self.bandwidth *= share;
        self.recompute();
    }

    /// Drops a stage wherever it is (a cancel); returns the tokens it had generated by then if
    /// it was decoding (`None` if it was still waiting for or in its prefill), which an
    /// abort-and-resume keeps.
    pub fn cancel(&mut self, now: Time, stage: StageId) -> Option<u64> {
        self.advance(now);
        let generated = self
            .seqs
            .iter()
            .find(|(_, s)| s.stage == stage)
            .map(|(_, s)| {
                let left = (s.target - self.progress).max(0.0);
                (s.tokens as f64 - left).floor().clamp(0.0, s.tokens as f64) as u64
            });
        self.queue.retain(|j| j.stage != stage);
        if let Some(b) = &mut self.batch {
            b.jobs.retain(|j| j.stage != stage);
        }
        let keys: Vec<u64> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.stage == stage)
            .map(|(k, _)| k)
            .collect();
        for &key in &keys {
            if let Some(seq) = self.seqs.remove(key) {
                self.sum_ctx_base -= seq.ctx_base;
            }
        }
        if !keys.is_empty() {
            self.finish.retain(|Reverse((_, key))| !keys.contains(key));
        }
        self.recompute();
        generated
    }
}

/// Integrates a level (busy GPUs, busy vCPUs, ...) over time, with a coarse timeline.
#[derive(Debug, Clone)]
pub struct Meter {
    level: f64,
    last: Time,
    /// Integral of the level, level-seconds.
    pub total: f64,
    /// Level-seconds per bucket.
    pub buckets: Vec<f64>,
    /// Bucket width, ns.
    pub width: u64,
}

/// Buckets a meter keeps at most before halving its resolution.
const MAX_BUCKETS: usize = 512;

impl Default for Meter {
    fn default() -> Self {
        Meter {
            level: 0.0,
            last: Time::ZERO,
            total: 0.0,
            buckets: Vec::new(),
            width: 1_000_000_000,
        }
    }
}

impl Meter {
    /// The current level.
    pub fn level(&self) -> f64 {
        self.level
    }

    /// Changes the level at `now`.
    pub fn set(&mut self, now: Time, level: f64) {
        self.flush(now);
        self.level = level;
    }

    /// Adds to the level at `now`.
    pub fn add(&mut self, now: Time, delta: f64) {
        let level = self.level + delta;
        self.set(now, level.max(0.0));
    }

    /// Accounts time up to `now` at the current level.
    pub fn flush(&mut self, now: Time) {
        if now <= self.last {
            return;
        }
        while now.0 / self.width >= MAX_BUCKETS as u64 {
            self.width *= 2;
            let merged: Vec<f64> = self.buckets.chunks(2).map(|c| c.iter().sum()).collect();
            self.buckets = merged;
        }
        let mut t = self.last.0;
        while t < now.0 {
            let bucket = (t / self.width) as usize;
            let end = ((bucket as u64 + 1) * self.width).min(now.0);
            if self.buckets.len() <= bucket {
                self.buckets.resize(bucket + 1, 0.0);
            }
            let secs = (end - t) as f64 / 1e9;
            self.buckets[bucket] += self.level * secs;
            self.total += self.level * secs;
            t = end;
        }
        self.last = now;
    }
}

/// Model costs from the spec.
pub fn model_costs(spec: &JobSpec) -> ModelCosts {
    ModelCosts {
        flops_per_token: spec.model.forward_flops_per_token(),
        attention_flops_per_context: spec.model.attention_flops_per_token(1.0),
        active_weight_bytes: spec.model.active_weight_bytes(),
        weight_reads: spec.model.weight_reads(),
        kv_bytes_per_token: spec.model.kv_bytes_per_token(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> ModelCosts {
        ModelCosts {
            flops_per_token: 2e9,
            attention_flops_per_context: 0.0,
            active_weight_bytes: 2e9,
            weight_reads: WeightReads::dense(2e9),
            kv_bytes_per_token: 0.0,
        }
    }

    #[test]
    fn a_moe_decode_batch_reads_more_expert_weights_than_one_token_but_fewer_than_all() {
        // 1 GB shared, 64 experts of 0.1 GB, 4 per token: 1.4 GB for one token, 7.4 GB for all.
        let reads = WeightReads {
            shared_bytes: 1e9,
            expert_bytes: 1e8,
            experts: 64.0,
            experts_per_token: 4.0,
        };
        let moe = ModelCosts {
            active_weight_bytes: reads.bytes(1.0),
            weight_reads: reads,
            ..costs()
        };
        let iteration = |n: u64| {
            let mut e = Engine::new(1, 1e18, 1e12, &hw(), moe, 1_000_000);
            for s in 0..n {
                e.add_decode(Time::ZERO, StageId(s), 10, 100);
            }
            e.next_wake().unwrap().as_secs_f64() / 100.0
        };
        // At 1 TB/s: one sequence 1.4 ms a token; eight read 64 (1 - (15/16)^8) = 25.4 experts.
        assert!((iteration(1) - 1.4e-3).abs() < 1e-9, "{}", iteration(1));
        let eight = (1e9 + 1e8 * 64.0 * (1.0 - (15.0_f64 / 16.0).powi(8))) / 1e12;
        assert!(
            (iteration(8) - eight).abs() < 1e-9,
            "{} vs {eight}",
            iteration(8)
        );
        assert!(iteration(8) > 1.4e-3 && iteration(8) < 7.4e-3);
    }

    fn hw() -> HardwareModel {
        HardwareModel {
            compute_efficiency: 1.0,
            bandwidth_efficiency: 1.0,
            ..HardwareModel::default()
        }
    }

    #[test]
    fn a_lone_decode_is_bound_by_reading_the_weights_once_per_token() {
        // 2 GB of weights at 1 TB/s: 2 ms per token; 100 tokens take 0.2 s.
        let mut e = Engine::new(1, 1e15, 1e12, &hw(), costs(), 1000);
        e.add_decode(Time::ZERO, StageId(1), 10, 100);
        let wake = e.next_wake().unwrap();
        assert!((wake.as_secs_f64() - 0.2).abs() < 1e-6, "{wake:?}");
        assert_eq!(e.wake(wake), vec![EngineDone::Generated(StageId(1), 100)]);
    }

    #[test]
    fn batching_shares_the_weight_reads() {
        // Two sequences in one batch still take 2 ms per iteration.
        let mut e = Engine::new(1, 1e15, 1e12, &hw(), costs(), 1000);
        e.add_decode(Time::ZERO, StageId(1), 10, 100);
        e.add_decode(Time::ZERO, StageId(2), 10, 50);
        let first = e.next_wake().unwrap();
        assert!((first.as_secs_f64() - 0.1).abs() < 1e-6);
        assert_eq!(e.wake(first), vec![EngineDone::Generated(StageId(2), 50)]);
        let second = e.next_wake().unwrap();
        assert!((second.as_secs_f64() - 0.2).abs() < 1e-6);
    }

    #[test]
    fn a_decoded_token_is_timed_at_its_batchs_iteration_time_over_the_tokens() {
        // Two sequences share 2 ms iterations for 0.1 s (50 tokens each), then one runs alone
        // for 0.1 s more (50 tokens): 0.3 sequence-seconds over 150 tokens, 2 ms a token.
        let mut e = Engine::new(1, 1e15, 1e12, &hw(), costs(), 1000);
        e.add_decode(Time::ZERO, StageId(1), 10, 100);
        e.add_decode(Time::ZERO, StageId(2), 10, 50);
        let first = e.next_wake().unwrap();
        e.wake(first);
        let second = e.next_wake().unwrap();
        e.wake(second);
        assert!(
            (e.decode_sequence_s - 0.3).abs() < 1e-9,
            "{}",
            e.decode_sequence_s
        );
        assert!(
            (e.decode_tokens_timed - 150.0).abs() < 1e-6,
            "{}",
            e.decode_tokens_timed
        );
    }

    #[test]
    fn prefill_is_compute_bound_for_long_inputs() {
        // 10,000 tokens x 2 GFLOP at 1 PFLOP/s = 20 ms (the weight read takes 2 ms; no attention
        // FLOPs in this model).
        let mut e = Engine::new(1, 1e15, 1e12, &hw(), costs(), 100_000);
        e.add_prefill(
            Time::ZERO,
            PrefillJob {
                stage: StageId(1),
                traj: TrajId(1),
                cached: 0,
                tokens: 10_000,
                decode: None,
            },
        );
        let wake = e.next_wake().unwrap();
        assert!((wake.as_secs_f64() - 0.02).abs() < 1e-6, "{wake:?}");
        assert_eq!(e.wake(wake), vec![EngineDone::Prefilled(StageId(1))]);
    }

    fn prefill_of(tokens: u64) -> PrefillJob {
        PrefillJob {
            stage: StageId(10_000),
            traj: TrajId(1),
            cached: 0,
            tokens,
            decode: None,
        }
    }

    /// 500 sequences decoding for 5 tokens: 2 ms iterations (the weight read), of which their
    /// 500 x 2 GFLOP take 1 ms of a 1 PFLOP/s GPU, half its compute, for 10 ms.
    fn half_busy_decoding(e: &mut Engine, at: Time) {
        for s in 0..500 {
            e.add_decode(at, StageId(s), 10, 5);
        }
    }

    #[test]
    fn a_prefill_speeds_up_as_soon_as_the_decoding_beside_it_ends() {
        // 10,000 tokens: 20 ms alone. Half speed for the 10 ms of decoding does a quarter of
        // it; the other three quarters take 15 ms alone: done at 25 ms, not at 40.
        let mut e = Engine::new(1, 1e15, 1e12, &hw(), costs(), 1_000_000);
        half_busy_decoding(&mut e, Time::ZERO);
        e.add_prefill(Time::ZERO, prefill_of(10_000));
        let decoded = e.next_wake().unwrap();
        assert!((decoded.as_secs_f64() - 0.010).abs() < 1e-6, "{decoded:?}");
        assert_eq!(e.wake(decoded).len(), 500);
        let prefilled = e.next_wake().unwrap();
        assert!(
            (prefilled.as_secs_f64() - 0.025).abs() < 1e-6,
            "{prefilled:?}"
        );
        assert_eq!(
            e.wake(prefilled),
            vec![EngineDone::Prefilled(StageId(10_000))]
        );
        // It shared the GPU for a while, so its duration is no sample of the prefill rate.
        assert!(e.measured.iter().all(|m| m.kind == WorkKind::Decode));
    }

    #[test]
    fn a_prefill_slows_down_when_decoding_sequences_join_it() {
        // A quarter of it alone in 5 ms, a quarter at half speed while 500 sequences decode
        // from 5 ms to 15 ms, the last half alone again in 10 ms: done at 25 ms, not at 20.
        let mut e = Engine::new(1, 1e15, 1e12, &hw(), costs(), 1_000_000);
        e.add_prefill(Time::ZERO, prefill_of(10_000));
        half_busy_decoding(&mut e, Time::from_secs_f64(0.005));
        let decoded = e.next_wake().unwrap();
        assert!((decoded.as_secs_f64() - 0.015).abs() < 1e-6, "{decoded:?}");
        e.wake(decoded);
        let prefilled = e.next_wake().unwrap();
        assert!(
            (prefilled.as_secs_f64() - 0.025).abs() < 1e-6,
            "{prefilled:?}"
        );
    }

    #[test]
    fn a_meter_integrates_its_level_over_time() {
        let mut m = Meter::default();
        m.set(Time::from_secs_f64(1.0), 4.0);
        m.set(Time::from_secs_f64(3.0), 0.0);
        assert!((m.total - 8.0).abs() < 1e-9);
        m.flush(Time::from_secs_f64(2000.0));
        assert!((m.buckets.iter().sum::<f64>() - 8.0).abs() < 1e-9);
        assert!(m.buckets.len() <= MAX_BUCKETS);
    }

    #[test]
    fn model_costs_charge_two_flops_per_active_parameter_and_every_active_weight_byte() {
        let text = include_str!("../../../examples/jobs/rollart-agentic.yaml");
        let job = rollfleet_spec::parse_job(text.as_bytes(), "rollart-agentic.yaml").unwrap();
        let model = &job.spec().model;
        let costs = model_costs(job.spec());
        assert_eq!(costs.flops_per_token, 2.0 * model.active());
        assert_eq!(costs.active_weight_bytes, model.active_weight_bytes());
        assert_eq!(costs.kv_bytes_per_token, model.kv_bytes_per_token());
        // Attention is charged per token of context: twice the context, twice the FLOPs.
        assert_eq!(
            costs.attention_flops_per_context * 2.0,
            model.attention_flops_per_token(2.0)
        );
        assert!(costs.kv_bytes_per_token > 0.0 && costs.attention_flops_per_context > 0.0);
    }
}
