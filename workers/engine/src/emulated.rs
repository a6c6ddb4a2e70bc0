//! The emulated engine: an inference replica for machines without GPUs.
//!
//! It runs the simulator's roofline model ([`rollfleet_sim::hardware::Engine`], the very same
//! code `rollfleet sim` uses, not a copy) against the real clock: continuous batching of decode,
//! prefill batches mixed in as chunked prefill does, a KV-cache capacity that limits admission,
//! aborts that free a sequence's KV at once, and weight updates that take the modelled transfer
//! time. Tokens are synthetic and every completion says `emulated: true`.
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
use rollfleet_sim::hardware::{
    Engine as Roofline, EngineDone, HardwareModel, ModelCosts, PrefillJob,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::{
    Completion, Engine, EngineError, EngineFuture, EventStream, FinishReason, GenerateEvent,
    GenerateRequest, Prompt,
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

struct Request {
    id: u64,
    cached: u64,
    prefill: u64,
    decode: Option<u64>,
    reply: oneshot::Sender<Result<EmulatedOutput, EngineError>>,
}

enum Msg {
    Submit(Request),
    Cancel(u64),
    Update {
        version: u64,
        bytes: u64,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    Load(oneshot::Sender<EmulatedLoad>),
}

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
    {
        let (reply, rx) = oneshot::channel();
        shared
            .tx
            .send(Msg::Submit(Request {
                id,
                cached,
                prefill,
                decode,
                reply,
            }))
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

    fn handle(&mut self, msg: Msg) {
        let now = self.now();
        match msg {
            Msg::Submit(req) => {
                let need = req.cached + req.prefill + req.decode.unwrap_or(0);
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
                self.waiting.retain(|r| r.id != id);
                if let Some(run) = self.running.remove(&id) {
                    self.roofline.cancel(now, StageId(id));
                    self.kv_used -= run.kv;
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
            Msg::Load(reply) => {
                let _ = reply.send(EmulatedLoad {
                    queued: self.waiting.len() as u32,
                    running: self.running.len() as u32,
                    kv_used_tokens: self.kv_used,
                    tokens_generated: self.roofline.tokens_generated,
                    tokens_prefilled: self.roofline.tokens_prefilled,
                });
            }
        }
    }

    fn tick(&mut self) {
        let now = self.now();
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
            let need = req.cached + req.prefill + req.decode.unwrap_or(0);
            if self.running.len() as u32 >= self.max_seqs || self.kv_used + need > self.kv_capacity
            {
                break;
            }
            let Some(req) = self.waiting.pop_front() else {
                break;
            };
            if req.prefill == 0 && req.decode.is_none() {
                let _ = req.reply.send(Ok(EmulatedOutput {
                    tokens: 0,
                    policy_version: self.version.load(Ordering::Acquire),
                    emulated: true,
                }));
                continue;
            }
            self.kv_used += need;
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
                    reply: req.reply,
                },
            );
        }
    }
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
                        }),
                        Ok(GenerateEvent::Finished(Completion {
                            finish_reason: FinishReason::Length,
                            prompt_tokens: u32::try_from(prompt_tokens).ok(),
                            completion_tokens: u32::try_from(out.tokens).ok(),
                            cached_prompt_tokens: u32::try_from(cached).ok(),
                            policy_version: out.policy_version,
                            emulated: true,
                        })),
                    ]
                }
            }
        };
        Box::pin(futures_util::stream::once(events).flat_map(futures_util::stream::iter))
    }

    fn update_weights(&self, version: u64, _source: &str) -> EngineFuture<'_, ()> {
        let bytes = self.weight_bytes;
        Box::pin(async move {
            self.shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
            self.load_weights(version, bytes).await
        })
    }

    fn policy_version(&self) -> u64 {
        self.shared.version.load(Ordering::Acquire)
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }
}
