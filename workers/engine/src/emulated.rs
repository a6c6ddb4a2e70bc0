//! The emulated engine: an inference replica for machines without GPUs.
//!
//! It runs the simulator's roofline model ([`rollfleet_fleet::hardware::Engine`], the very same
//! code `rollfleet sim` uses, not a copy) against the real clock: continuous batching of decode,
//! prefill batches mixed in as chunked prefill does, a KV-cache capacity that limits admission,
//! aborts that free a sequence's KV at once, and weight updates that take the modelled transfer
//! time. Tokens are synthetic and every completion says `emulated: true`.
//!
//! Abort and resume: [`InFlight::abort`] stops a request and hands back a [`Partial`] (the
//! tokens it had generated), keeping its KV cache parked on the replica; [`EmulatedEngine::resume`]
//! continues it, decoding only what is left on top of the parked cache. A weight update drops
//! parked caches (they were computed by the old weights), so a request resumed after one is
//! prefilled again, prompt and partial output both, by the new weights: partial rollout in the
//! style of AReaL's interruptible generation.
//!
//! Time is scaled by [`EmulatedConfig::time_scale`]: one modelled second takes `time_scale` wall
//! seconds (2.0 runs the modelled hardware at half speed, so two loaded cores keep up). Whatever
//! figure comes out of this engine is modelled, not measured on a GPU.
//!
//! The engine is an actor: a tokio task owns the model and is the only one to touch it; callers
//! send it requests over a channel and await a oneshot reply. Dropping a pending request (the
//! future or the stream) sends an abort.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use rollfleet_core::{StageId, Time, TrajId};
use rollfleet_fleet::hardware::{
    Engine as Roofline, EngineDone, HardwareModel, Measured, ModelCosts, PrefillJob,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::{
    ChatMessage, Completion, Engine, EngineError, EngineFuture, EventStream, FinishReason,
    GenerateEvent, GenerateRequest, Prompt, WeightsRef,
};

/// The name every emulated output carries.
pub const BACKEND: &str = "emulated";

/// What the emulated replica models.
#[derive(Debug, Clone, PartialEq)]
pub struct EmulatedConfig {
    /// GPUs in the replica's tensor-parallel group.
    pub gpus: u32,
    /// Peak dense BF16 FLOP/s of one GPU (catalogue figure).
    pub peak_flops: f64,
    /// HBM bytes/s of one GPU (catalogue figure).
    pub bandwidth: f64,
    /// Achieved fractions of peak (the simulator's defaults unless told otherwise).
    pub hardware: HardwareModel,
    /// The policy model's per-token costs.
    pub costs: ModelCosts,
    /// KV-cache tokens the replica holds.
    pub kv_capacity_tokens: u64,
    /// Sequences batched at most.
    pub max_seqs: u32,
    /// Bytes/s a weight update achieves over the cross-pool link.
    pub link_bytes_per_s: f64,
    /// Bytes of one copy of the weights (for [`Engine::update_weights`]).
    pub weight_bytes: u64,
    /// Wall seconds per modelled second.
    pub time_scale: f64,
}

/// What an emulated request produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmulatedOutput {
    /// Tokens generated (0 for a prefill-only request).
    pub tokens: u64,
    /// Policy version that produced them.
    pub policy_version: u64,
    /// Always true: no GPU ran anything.
    pub emulated: bool,
}

/// A snapshot of the replica's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EmulatedLoad {
    /// Requests waiting for admission.
    pub queued: u32,
    /// Requests admitted (prefilling or decoding).
    pub running: u32,
    /// KV tokens reserved by admitted requests.
    pub kv_used_tokens: u64,
    /// Tokens generated so far.
    pub tokens_generated: u64,
    /// Tokens prefilled so far.
    pub tokens_prefilled: u64,
}

/// What an aborted request had done, to resume it with [`EmulatedEngine::resume`] or let it go
/// with [`EmulatedEngine::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partial {
    /// The aborted request (its parked KV cache is filed under it).
    pub id: u64,
    /// Tokens it had generated before the abort.
    pub generated: u64,
    /// Its context at the abort: cached, prefilled and generated tokens.
    pub context: u64,
    /// Tokens it may still generate (`None`: it was a prefill-only request).
    pub remaining: Option<u64>,
    /// Policy version the replica served at the abort.
    pub policy_version: u64,
}

/// A request submitted with [`EmulatedEngine::submit`]: wait for it, or abort it. Dropping it
/// aborts it and frees its KV.
pub struct InFlight {
    shared: Arc<Shared>,
    id: u64,
    rx: oneshot::Receiver<Result<EmulatedOutput, EngineError>>,
    guard: AbortOnDrop,
}

impl InFlight {
    /// The request's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Waits for the request to finish, keeping the handle (so that a `select!` may drop this
    /// wait and [`InFlight::interrupt`] the request instead).
    pub async fn finished(&mut self) -> Result<EmulatedOutput, EngineError> {
        let result = (&mut self.rx).await.map_err(|_| stopped())?;
        self.guard.armed = false;
        result
    }

    /// Waits for the request to finish.
    pub async fn wait(mut self) -> Result<EmulatedOutput, EngineError> {
        let result = (&mut self.rx).await.map_err(|_| stopped())?;
        self.guard.armed = false;
        result
    }

    /// Stops the request where it is and keeps what it did: its tokens so far and its KV cache,
    /// parked until [`EmulatedEngine::resume`] or [`EmulatedEngine::release`]. `None` when it
    /// had already finished (or was cut off by a weight update) before the abort arrived.
    pub async fn abort(mut self) -> Result<Option<Partial>, EngineError> {
        self.guard.armed = false;
        let (reply, rx) = oneshot::channel();
        self.shared
            .tx
            .send(Msg::Abort { id: self.id, reply })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }
}

/// What an interrupted request had done: [`InFlight::interrupt`].
#[derive(Debug, Clone, PartialEq)]
pub enum Interrupted {
    /// It stopped where it was (its parked cache is the caller's to resume or release).
    Partial(Partial),
    /// It had finished before the interrupt arrived.
    Finished(EmulatedOutput),
}

impl InFlight {
    /// Stops the request where it is, as [`InFlight::abort`] does, or, if it had already
    /// finished, hands back its output.
    pub async fn interrupt(mut self) -> Result<Interrupted, EngineError> {
        self.guard.armed = false;
        let (reply, rx) = oneshot::channel();
        self.shared
            .tx
            .send(Msg::Abort { id: self.id, reply })
            .map_err(|_| stopped())?;
        match rx.await.map_err(|_| stopped())? {
            Some(partial) => Ok(Interrupted::Partial(partial)),
            // The engine answers in order: a request it found finished had its output sent
            // before this reply.
            None => (&mut self.rx)
                .await
                .map_err(|_| stopped())?
                .map(Interrupted::Finished),
        }
    }
}

struct Request {
    id: u64,
    cached: u64,
    prefill: u64,
    decode: Option<u64>,
    /// KV tokens already reserved for it (a resumed request's parked cache).
    parked: u64,
    reply: oneshot::Sender<Result<EmulatedOutput, EngineError>>,
}

impl Request {
    /// A new request (nothing parked for it yet).
    fn new(
        id: u64,
        cached: u64,
        prefill: u64,
        decode: Option<u64>,
        reply: oneshot::Sender<Result<EmulatedOutput, EngineError>>,
    ) -> Request {
        Request {
            id,
            cached,
            prefill,
            decode,
            parked: 0,
            reply,
        }
    }

    fn kv_needed(&self) -> u64 {
        self.cached + self.prefill + self.decode.unwrap_or(0)
    }
}

enum Msg {
    Submit(Request),
    Cancel(u64),
    Abort {
        id: u64,
        reply: oneshot::Sender<Option<Partial>>,
    },
    Resume {
        partial: Partial,
        id: u64,
        reply: oneshot::Sender<Result<EmulatedOutput, EngineError>>,
    },
    Release(u64),
    Update {
        version: u64,
        bytes: u64,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    Load(oneshot::Sender<EmulatedLoad>),
    /// The load and the samples measured since the last report, in one round trip.
    Report(oneshot::Sender<(EmulatedLoad, Vec<Measured>)>),
}

/// Samples the replica keeps at most between two [`EmulatedEngine::report`]s (the oldest
/// go first), so that a replica nobody asks keeps bounded memory.
pub const MAX_SAMPLES: usize = 4096;

struct Shared {
    tx: mpsc::UnboundedSender<Msg>,
    version: Arc<AtomicU64>,
    next_id: AtomicU64,
    sessions: Mutex<BTreeMap<String, u64>>,
}

/// An emulated inference replica. Needs a tokio runtime; the actor stops when this is dropped
/// and no request is pending.
pub struct EmulatedEngine {
    shared: Arc<Shared>,
    weight_bytes: u64,
    kv_capacity: u64,
}

impl EmulatedEngine {
    /// Starts the replica's actor on the current tokio runtime, serving version 0.
    pub fn start(config: EmulatedConfig) -> EmulatedEngine {
        let (tx, rx) = mpsc::unbounded_channel();
        let version = Arc::new(AtomicU64::new(0));
        let roofline = Roofline::new(
            config.gpus.max(1),
            config.peak_flops,
            config.bandwidth,
            &config.hardware,
            config.costs,
            config.kv_capacity_tokens,
        );
        let actor = Actor {
            roofline,
            start: Instant::now(),
            scale: if config.time_scale.is_finite() && config.time_scale > 0.0 {
                config.time_scale
            } else {
                1.0
            },
            kv_capacity: config.kv_capacity_tokens,
            kv_used: 0,
            max_seqs: config.max_seqs.max(1),
            link: config.link_bytes_per_s.max(1.0),
            waiting: VecDeque::new(),
            running: BTreeMap::new(),
            parked: BTreeMap::new(),
            updating: None,
            version: version.clone(),
        };
        tokio::spawn(actor.run(rx));
        EmulatedEngine {
            shared: Arc::new(Shared {
                tx,
                version,
                next_id: AtomicU64::new(1),
                sessions: Mutex::new(BTreeMap::new()),
            }),
            weight_bytes: config.weight_bytes,
            kv_capacity: config.kv_capacity_tokens,
        }
    }

    /// KV-cache tokens the replica holds.
    pub fn kv_capacity(&self) -> u64 {
        self.kv_capacity
    }

    /// Runs one request: prefill `prefill` tokens on top of `cached` ones already held, then
    /// decode `decode` tokens (`None`: prefill only). Waits for admission while the batch or the
    /// KV cache is full. Dropping the future aborts the request and frees its KV.
    pub async fn run(
        &self,
        cached: u64,
        prefill: u64,
        decode: Option<u64>,
    ) -> Result<EmulatedOutput, EngineError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        submit(&self.shared, id, cached, prefill, decode).await
    }

    /// Submits a request as [`EmulatedEngine::run`] does, returning a handle that can also
    /// abort it and keep its progress ([`InFlight::abort`]).
    pub fn submit(&self, cached: u64, prefill: u64, decode: Option<u64>) -> InFlight {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        let _ = self.shared.tx.send(Msg::Submit(Request::new(
            id, cached, prefill, decode, reply,
        )));
        self.in_flight(id, rx)
    }

    /// Continues an aborted request: decodes what it had left on top of its parked KV cache,
    /// or, if a weight update dropped that cache, prefills its whole context again first (with
    /// the new weights). The output counts the tokens generated after the resume.
    pub fn resume(&self, partial: Partial) -> InFlight {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        let _ = self.shared.tx.send(Msg::Resume { partial, id, reply });
        self.in_flight(id, rx)
    }

    /// Frees an aborted request's parked KV cache without resuming it.
    pub fn release(&self, partial: Partial) {
        let _ = self.shared.tx.send(Msg::Release(partial.id));
    }

    fn in_flight(
        &self,
        id: u64,
        rx: oneshot::Receiver<Result<EmulatedOutput, EngineError>>,
    ) -> InFlight {
        InFlight {
            shared: self.shared.clone(),
            id,
            rx,
            guard: AbortOnDrop {
                tx: self.shared.tx.clone(),
                id,
                armed: true,
            },
        }
    }

    /// Loads `version`, moving `bytes` over the link: takes the modelled transfer time, drops
    /// every KV cache, and holds new admissions until done.
    pub async fn load_weights(&self, version: u64, bytes: u64) -> Result<(), EngineError> {
        let (reply, rx) = oneshot::channel();
        self.shared
            .tx
            .send(Msg::Update {
                version,
                bytes,
                reply,
            })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Its load now, and what it measured since the last report: one sample per prefill batch
    /// and per stretch of decode at a constant batch (modelled seconds: this replica is
    /// emulated). One round trip, for a worker's heartbeat.
    pub async fn report(&self) -> (EmulatedLoad, Vec<Measured>) {
        let (reply, rx) = oneshot::channel();
        if self.shared.tx.send(Msg::Report(reply)).is_err() {
            return Default::default();
        }
        rx.await.unwrap_or_default()
    }

    /// The replica's load now.
    pub async fn load(&self) -> EmulatedLoad {
        let (reply, rx) = oneshot::channel();
        if self.shared.tx.send(Msg::Load(reply)).is_err() {
            return EmulatedLoad::default();
        }
        rx.await.unwrap_or_default()
    }
}

fn stopped() -> EngineError {
    EngineError::Unavailable {
        endpoint: BACKEND.into(),
        reason: "the emulated engine stopped".into(),
    }
}

async fn submit(
    shared: &Shared,
    id: u64,
    cached: u64,
    prefill: u64,
    decode: Option<u64>,
) -> Result<EmulatedOutput, EngineError> {
    let (reply, rx) = oneshot::channel();
    shared
        .tx
        .send(Msg::Submit(Request::new(
            id, cached, prefill, decode, reply,
        )))
        .map_err(|_| stopped())?;
    let mut guard = AbortOnDrop {
        tx: shared.tx.clone(),
        id,
        armed: true,
    };
    let result = rx.await.map_err(|_| stopped())?;
    guard.armed = false;
    result
}

struct AbortOnDrop {
    tx: mpsc::UnboundedSender<Msg>,
    id: u64,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Msg::Cancel(self.id));
        }
    }
}

struct Running {
    kv: u64,
    /// Context in place before its decode: cached plus prefilled tokens.
    context: u64,
    /// Of which cached (in place before its prefill).
    cached: u64,
    decode: Option<u64>,
    reply: oneshot::Sender<Result<EmulatedOutput, EngineError>>,
}

type UpdateReply = oneshot::Sender<Result<(), EngineError>>;

struct Actor {
    roofline: Roofline,
    start: Instant,
    scale: f64,
    kv_capacity: u64,
    kv_used: u64,
    max_seqs: u32,
    link: f64,
    waiting: VecDeque<Request>,
    running: BTreeMap<u64, Running>,
    /// KV tokens of aborted requests kept for a resume, by request id.
    parked: BTreeMap<u64, u64>,
    updating: Option<(Time, u64, UpdateReply)>,
    version: Arc<AtomicU64>,
}

impl Actor {
    /// Modelled time now: wall time since start divided by the scale.
    fn now(&self) -> Time {
        Time::from_secs_f64(self.start.elapsed().as_secs_f64() / self.scale)
    }

    fn wall(&self, t: Time) -> Instant {
        self.start + std::time::Duration::from_secs_f64(t.as_secs_f64() * self.scale)
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        loop {
            let wake = [
                self.roofline.next_wake(),
                self.updating.as_ref().map(|(t, _, _)| *t),
            ]
            .into_iter()
            .flatten()
            .min();
            let msg = match wake {
                Some(t) => {
                    let at = self.wall(t);
                    tokio::select! {
                        msg = rx.recv() => msg,
                        _ = tokio::time::sleep_until(at) => {
                            self.tick();
                            continue;
                        }
                    }
                }
                None => rx.recv().await,
            };
            let Some(msg) = msg else { return };
            self.handle(msg);
        }
    }

    fn current_load(&self) -> EmulatedLoad {
        EmulatedLoad {
            queued: self.waiting.len() as u32,
            running: self.running.len() as u32,
            kv_used_tokens: self.kv_used,
            tokens_generated: self.roofline.tokens_generated,
            tokens_prefilled: self.roofline.tokens_prefilled,
        }
    }

    fn handle(&mut self, msg: Msg) {
        let now = self.now();
        match msg {
            Msg::Submit(req) => {
                let need = req.kv_needed();
                if need > self.kv_capacity {
                    let _ = req.reply.send(Err(EngineError::Rejected {
                        endpoint: BACKEND.into(),
                        status: 413,
                        message: format!(
                            "request needs {need} KV tokens; the replica holds {}",
                            self.kv_capacity
                        ),
                    }));
                    return;
                }
                self.waiting.push_back(req);
                self.admit(now);
            }
            Msg::Cancel(id) => {
                self.forget(id);
                if let Some(run) = self.running.remove(&id) {
                    self.roofline.cancel(now, StageId(id));
                    self.kv_used -= run.kv;
                }
                self.admit(now);
            }
            Msg::Abort { id, reply } => {
                let version = self.version.load(Ordering::Acquire);
                let partial = if let Some(pos) = self.waiting.iter().position(|r| r.id == id) {
                    // Not admitted yet: nothing done, and only a resumed request's parked
                    // cache to keep.
                    self.waiting.remove(pos).map(|req| {
                        if req.parked > 0 {
                            self.parked.insert(id, req.parked);
                        }
                        Partial {
                            id,
                            generated: 0,
                            context: req.cached + req.prefill,
                            remaining: req.decode,
                            policy_version: version,
                        }
                    })
                } else if let Some(run) = self.running.remove(&id) {
                    // The context and what was generated stay (only what was cached if its
                    // prefill had not finished); the room reserved for the rest is freed.
                    let (generated, keep) = match self.roofline.cancel(now, StageId(id)) {
                        Some(generated) => (generated, run.context + generated),
                        None => (0, run.cached),
                    };
                    self.kv_used -= run.kv - keep.min(run.kv);
                    self.parked.insert(id, keep.min(run.kv));
                    Some(Partial {
                        id,
                        generated,
                        context: run.context + generated,
                        remaining: run.decode.map(|n| n.saturating_sub(generated)),
                        policy_version: version,
                    })
                } else {
                    None
                };
                let _ = reply.send(partial);
                self.admit(now);
            }
            Msg::Resume { partial, id, reply } => {
                // What the parked cache holds is not computed again; the rest of the context
                // is prefilled (all of it when a weight update dropped the cache).
                let parked = self.parked.remove(&partial.id).unwrap_or(0);
                let cached = parked.min(partial.context);
                let prefill = partial.context - cached;
                let req = Request {
                    id,
                    cached,
                    prefill,
                    decode: partial.remaining.map(|n| n.max(1)),
                    parked,
                    reply,
                };
                self.handle(Msg::Submit(req));
            }
            Msg::Release(id) => {
                if let Some(kv) = self.parked.remove(&id) {
                    self.kv_used -= kv;
                }
                self.admit(now);
            }
            Msg::Update {
                version,
                bytes,
                reply,
            } => {
                // Loading weights keeps no KV cache; whatever still runs is cut off (the
                // scheduler drains a replica before updating it, so normally nothing is).
                self.roofline.wipe(now);
                self.parked.clear();
                for req in &mut self.waiting {
                    // Its parked cache is gone with the old weights: prefill it all again.
                    if req.parked > 0 {
                        req.prefill += req.cached;
                        req.cached = 0;
                        req.parked = 0;
                    }
                }
                for (_, run) in std::mem::take(&mut self.running) {
                    let _ = run.reply.send(Err(EngineError::Unavailable {
                        endpoint: BACKEND.into(),
                        reason: "aborted by a weight update".into(),
                    }));
                }
                self.kv_used = 0;
                let done = now.plus(rollfleet_core::Span::from_secs_f64(
                    bytes as f64 / self.link,
                ));
                if let Some((_, _, old)) = self.updating.replace((done, version, reply)) {
                    let _ = old.send(Err(EngineError::Unavailable {
                        endpoint: BACKEND.into(),
                        reason: "superseded by a newer weight update".into(),
                    }));
                }
            }
            Msg::Report(reply) => {
                let samples = std::mem::take(&mut self.roofline.measured);
                let _ = reply.send((self.current_load(), samples));
            }
            Msg::Load(reply) => {
                let _ = reply.send(self.current_load());
            }
        }
    }

    /// Drops a request still waiting for admission, with the parked cache it was to resume on.
    fn forget(&mut self, id: u64) {
        if let Some(pos) = self.waiting.iter().position(|r| r.id == id)
            && let Some(req) = self.waiting.remove(pos)
        {
            self.kv_used -= req.parked.min(self.kv_used);
        }
    }

    fn tick(&mut self) {
        let now = self.now();
        let measured = &mut self.roofline.measured;
        if measured.len() > MAX_SAMPLES {
            measured.drain(..measured.len() - MAX_SAMPLES);
        }
        if let Some((t, _, _)) = &self.updating
            && *t <= now
            && let Some((_, version, reply)) = self.updating.take()
        {
            self.version.store(version, Ordering::Release);
            let _ = reply.send(Ok(()));
        }
        for done in self.roofline.wake(now) {
            let (id, tokens) = match done {
                EngineDone::Prefilled(s) => (s.0, 0),
                EngineDone::Generated(s, n) => (s.0, n),
            };
            if let Some(run) = self.running.remove(&id) {
                self.kv_used -= run.kv;
                let _ = run.reply.send(Ok(EmulatedOutput {
                    tokens,
                    policy_version: self.version.load(Ordering::Acquire),
                    emulated: true,
                }));
            }
        }
        self.admit(now);
    }

    /// Continuous batching: admits waiting requests in order while a sequence slot and their
    /// whole KV footprint (context plus every token they may generate) are free.
    fn admit(&mut self, now: Time) {
        if self.updating.is_some() {
            return;
        }
        while let Some(req) = self.waiting.front() {
            let need = req.kv_needed();
            // A resumed request's parked cache is already counted in `kv_used`.
            let more = need - req.parked.min(need);
            if self.running.len() as u32 >= self.max_seqs || self.kv_used + more > self.kv_capacity
            {
                break;
            }
            let Some(req) = self.waiting.pop_front() else {
                break;
            };
            if req.prefill == 0 && req.decode.is_none() {
                self.kv_used -= req.parked.min(self.kv_used);
                let _ = req.reply.send(Ok(EmulatedOutput {
                    tokens: 0,
                    policy_version: self.version.load(Ordering::Acquire),
                    emulated: true,
                }));
                continue;
            }
            self.kv_used += more;
            if req.prefill > 0 {
                self.roofline.add_prefill(
                    now,
                    PrefillJob {
                        stage: StageId(req.id),
                        traj: TrajId(req.id),
                        cached: req.cached,
                        tokens: req.prefill,
                        decode: req.decode,
                    },
                );
            } else {
                self.roofline
                    .add_decode(now, StageId(req.id), req.cached, req.decode.unwrap_or(1));
            }
            self.running.insert(
                req.id,
                Running {
                    kv: need,
                    context: req.cached + req.prefill,
                    cached: req.cached,
                    decode: req.decode,
                    reply: req.reply,
                },
            );
        }
    }
}

/// One synthetic token id for up to 4 bytes of text: FNV-1a into a 32k vocabulary.
fn synthetic_token(chunk: &[u8]) -> u32 {
    let hash = chunk.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    (hash % 32_000) as u32
}

/// Synthetic token ids: deterministic per request, never meant to be read.
fn synthetic_tokens(seed: u64, n: u64) -> Vec<u32> {
    let mut rng = rollfleet_core::rng::SplitMix64::new(seed);
    (0..n).map(|_| (rng.next_u64() % 32_000) as u32).collect()
}

impl Engine for EmulatedEngine {
    fn generate(&self, request: GenerateRequest) -> EventStream {
        let prompt_tokens = match &request.prompt {
            Prompt::Tokens(t) => t.len() as u64,
            // About four bytes a token, as `agents`' default counter assumes.
            Prompt::Text(s) => (s.len() as u64).div_ceil(4),
        };
        let served = self.policy_version();
        if request.policy_version != served {
            let error = EngineError::Rejected {
                endpoint: BACKEND.into(),
                status: 409,
                message: format!(
                    "request wants policy version {}, the engine serves {served}",
                    request.policy_version
                ),
            };
            return Box::pin(futures_util::stream::once(async move { Err(error) }));
        }
        let cached = {
            let sessions = self
                .shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            sessions
                .get(&request.session)
                .copied()
                .unwrap_or(0)
                .min(prompt_tokens)
        };
        let max_tokens = u64::from(request.max_tokens.max(1));
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let shared = self.shared.clone();
        let session = request.session;
        let events = async move {
            match submit(
                &shared,
                id,
                cached,
                prompt_tokens - cached,
                Some(max_tokens),
            )
            .await
            {
                Err(e) => vec![Err(e)],
                Ok(out) => {
                    shared
                        .sessions
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(session, prompt_tokens + out.tokens);
                    vec![
                        Ok(GenerateEvent::Delta {
                            text: format!("[emulated: {} synthetic tokens]", out.tokens),
                            token_ids: synthetic_tokens(id, out.tokens),
                            logprobs: Vec::new(),
                        }),
                        Ok(GenerateEvent::Finished(Completion {
                            finish_reason: FinishReason::Length,
                            prompt_tokens: u32::try_from(prompt_tokens).ok(),
                            completion_tokens: u32::try_from(out.tokens).ok(),
                            cached_prompt_tokens: u32::try_from(cached).ok(),
                            policy_version: out.policy_version,
                            emulated: true,
                            engine_weight_version: Some(out.policy_version),
                        })),
                    ]
                }
            }
        };
        Box::pin(futures_util::stream::once(events).flat_map(futures_util::stream::iter))
    }

    fn update_weights(&self, weights: &WeightsRef) -> EngineFuture<'_, ()> {
        let bytes = self.weight_bytes;
        let version = weights.version;
        Box::pin(async move {
            self.shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
            self.load_weights(version, bytes).await
        })
    }

    fn served_weight_version(&self) -> EngineFuture<'_, Option<u64>> {
        let version = self.policy_version();
        Box::pin(async move { Ok(Some(version)) })
    }

    /// Emulated: a deterministic synthetic tokenisation, not a model's. Each message is rendered
    /// ChatML-style (`<|im_start|>{role}\n{content}<|im_end|>\n`, then `<|im_start|>assistant\n`
    /// as the generation prompt) and each rendered piece is cut into 4-byte chunks hashed into a
    /// 32k vocabulary, so a rendering is a prefix of the rendering of a longer conversation.
    fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> EngineFuture<'_, Vec<u32>> {
        let mut pieces: Vec<String> = messages
            .iter()
            .map(|m| format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content))
            .collect();
        if add_generation_prompt {
            pieces.push("<|im_start|>assistant\n".to_owned());
        }
        let tokens = pieces
            .iter()
            .flat_map(|piece| piece.as_bytes().chunks(4).map(synthetic_token))
            .collect();
        Box::pin(async move { Ok(tokens) })
    }

    fn policy_version(&self) -> u64 {
        self.shared.version.load(Ordering::Acquire)
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }
}
