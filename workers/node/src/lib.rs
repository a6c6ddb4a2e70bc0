//! The node worker: one daemon per node that registers with the scheduler, holds its lease with
//! heartbeats, and runs the assignments that arrive on its work stream.
//!
//! What it runs depends on its pool, as the job (sent back on registration) defines it:
//! - **GPU pools**, with the default [`EngineChoice::Emulated`]: each inference replica the
//!   scheduler places on this node is an [`EmulatedEngine`] (the simulator's roofline on the
//!   scaled real clock; no GPU is used and every output says `emulated`). Generated tokens are
//!   synthetic; how many is drawn from the task's `actionTokens` distribution, seeded per
//!   trajectory and turn, as the simulator draws it.
//! - **GPU pools**, with [`EngineChoice::OpenAi`]: every replica placed on this node is served by
//!   one real engine behind the OpenAI completions API (vLLM, SGLang), through
//!   [`OpenAiEngine`]. The scheduler sends the turn's whole context as text (rendered by the
//!   agent's prompt template); the engine's text goes back in the result, and the scheduler
//!   relays it to the environment step.
//! - In both cases the trainer is emulated: a batch takes the simulator's training time.
//! - **CPU pools**: real environments from `agents/` on the [`EnvHost`] (slots, deadlines, crash
//!   isolation). When the step carries the policy's text (`EnvStepWork.policy_output`, from a
//!   real engine), the action is extracted from it as the agent loop does; an action the
//!   environment cannot parse is an invalid action by its rules. When it does not (the emulated
//!   policy writes no meaningful text), the action applied is a random legal move of that
//!   environment, seeded per trajectory and turn. Either way the action applied is returned to
//!   the scheduler so that any worker can rebuild the episode by replay.
//! - **Serverless pools**: the reward functions of `serverless/rewards`, called in process (the
//!   code AWS Lambda would run through the custom runtime).
//!
//! An abort from the scheduler aborts the task running the assignment, which drops the engine
//! request (freeing its KV) or the environment call. An interrupt (its replica is due for new
//! weights) stops a generation where it is and reports the tokens it had, marked `interrupted`:
//! the emulated engine and SGLang can stop one request; other engines finish it.
//!
//! **Telemetry**: at start-up the worker reads the node's GPUs through NVML
//! ([`rollfleet_gpu`]). Where a driver exists, it says so at registration
//! (`HardwareInventory.gpu_telemetry`, with the devices) and sends a reading per GPU with every
//! heartbeat. Where none exists, it says why once (a log line, and the reason in the
//! registration), and its heartbeats carry no GPU figures: absent, never zero.

pub mod token_engine;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rollfleet_core::rng::SplitMix64;
use rollfleet_engine::emulated::{EmulatedConfig, EmulatedEngine};
use rollfleet_engine::openai::{OpenAiConfig, OpenAiEngine, WeightUpdate};
use rollfleet_engine::{Engine, EngineError, GenerateEvent, GenerateRequest, Prompt};
use rollfleet_envhost::{EnvHost, EpisodeId, Factory, HostConfig};
use rollfleet_fleet::hardware::{ModelCosts, WorkKind};
use rollfleet_fleet::plan::{JobPlan, PoolRole};
use rollfleet_proto::auth::{AuthChannel, ClientAuth, Token};
use rollfleet_proto::v1::{
    GenerationWork, GpuDevice, GpuInventory, GpuReading, GpuTelemetryInfo, HardwareInventory,
    HeartbeatRequest, ProfileKind, ProfileSample, RegisterRequest, SchedulerMessage, StageFailure,
    StageOutput, WorkAssignment, WorkResult, WorkerHello, WorkerLeaving, WorkerLoad, WorkerMessage,
    hardware_inventory, scheduler_message, stage_failure::Cause, work_assignment::Work,
    work_result, worker_message, worker_service_client::WorkerServiceClient,
};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// Why a worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The scheduler could not be reached.
    #[error("scheduler {url}: {reason}")]
    Connect {
        /// Its address.
        url: String,
        /// What happened.
        reason: String,
    },
    /// The scheduler refused or broke the conversation.
    #[error("scheduler refused: {0}")]
    Refused(String),
    /// The job the scheduler sent could not be planned.
    #[error("the scheduler's job: {0}")]
    Plan(#[from] rollfleet_fleet::PlanError),
    /// The LLM engine could not be set up.
    #[error("engine: {0}")]
    Engine(String),
}

/// Which LLM engine runs this node's generation stages (GPU pools only).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum EngineChoice {
    /// The emulated engine: the simulator's roofline on the scaled real clock, synthetic tokens.
    #[default]
    Emulated,
    /// A real engine behind the OpenAI completions API (vLLM, SGLang).
    OpenAi {
        /// Its base URL, e.g. `http://127.0.0.1:8000`.
        url: String,
        /// The model name to ask for; `None`: the first model the engine lists at `/v1/models`.
        model: Option<String>,
        /// Sampling temperature.
        temperature: f32,
    },
    /// SGLang replicas behind their native API, token-in, token-out, one per replica this node
    /// serves ([`token_engine`]).
    Sglang {
        /// Their base URLs, e.g. `http://127.0.0.1:30000`, one per replica.
        urls: Vec<String>,
        /// A vLLM-style chat-aware `/tokenize` for the model (SGLang's own takes text only);
        /// `None`: each engine's own URL.
        chat_tokenizer: Option<String>,
        /// Sampling temperature.
        temperature: f32,
        /// How long the engine's weight-loading call may take.
        update_timeout: Duration,
    },
    /// vLLM replicas, token-in, token-out, one per replica this node serves.
    Vllm {
        /// Their base URLs, one per replica.
        urls: Vec<String>,
        /// The model name to ask for; `None`: the first model the first engine lists.
        model: Option<String>,
        /// Sampling temperature.
        temperature: f32,
        /// How long the engine's weight-loading call may take.
        update_timeout: Duration,
    },
}

/// Settings of a worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// The scheduler's URL, e.g. `http://127.0.0.1:7070`.
    pub scheduler: String,
    /// The pool to join.
    pub pool: String,
    /// This node's name.
    pub hostname: String,
    /// Lease asked for.
    pub lease_ms: u64,
    /// Environment instances this node runs at once.
    pub env_slots: usize,
    /// How long to keep trying to reach the scheduler at start.
    pub connect_timeout: Duration,
    /// Model environment steps and rewards from the job spec (durations, token counts, episode
    /// lengths drawn from its distributions, as the simulator does) instead of running them.
    pub model_environments: bool,
    /// Environment kinds served by remote environment servers: `(kind, base URL)`.
    pub remote_envs: Vec<(String, String)>,
    /// The LLM engine of a GPU pool's generation stages.
    pub engine: EngineChoice,
    /// Share of the modelled rates the emulated GPUs achieve, in (0, 1] (1: as modelled).
    pub slowdown: f64,
    /// GPUs this node offers its pool, declared at registration (`GpuInventory.count`); `None`:
    /// not said, and the scheduler counts the node as an equal share of the pool.
    pub gpus: Option<u32>,
    /// The scheduler's bearer token, sent on every call (`None`: none is sent).
    pub token: Option<Token>,
    /// When the scheduler goes away mid-job (its stream breaks, or it no longer knows the
    /// lease: a scheduler restarted on its journal), how long to keep trying to register again
    /// with it; zero: end as before (a closed stream is [`WorkerExit::Closed`], a broken one an
    /// error).
    pub rejoin_for: Duration,
    /// Set to `true` when the node must go (the CLI does on SIGTERM or Ctrl-C): the worker says
    /// so to the scheduler ([`WorkerLeaving`]), keeps running what it has, and ends when the
    /// scheduler releases it ([`WorkerExit::Drained`]) or after `leave_timeout`.
    pub leave: Option<watch::Receiver<bool>>,
    /// How long a leaving worker waits for the scheduler to release it.
    pub leave_timeout: Duration,
    /// The CA certificate (PEM) to trust for an `https://` scheduler ([`rollfleet_proto::tls`]).
    pub tls_ca: Option<std::path::PathBuf>,
    /// This node's certificate and key (PEM files), for a scheduler that requires one.
    pub tls_identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

/// Completes once `leave` says the node must go (never without a `leave`, or once its sender
/// is gone without saying so).
async fn leave_asked(leave: &mut Option<watch::Receiver<bool>>) {
    if let Some(rx) = leave
        && rx.wait_for(|go| *go).await.is_ok()
    {
        return;
    }
    std::future::pending::<()>().await
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending::<()>().await,
    }
}

/// Whether `leave` says the node must go.
fn leaving(leave: &Option<watch::Receiver<bool>>) -> bool {
    leave.as_ref().is_some_and(|rx| *rx.borrow())
}

/// How a worker ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// The scheduler said the job is over (drain).
    Drained,
    /// The scheduler closed the stream.
    Closed,
}

/// A real engine serving every replica placed on this node.
struct OpenAiBackend {
    engine: OpenAiEngine,
    temperature: f32,
    /// Requests in flight (the node's load).
    in_flight: AtomicU32,
    /// Decode timings measured since the last load report (see [`DecodeTiming`]).
    samples: Mutex<Vec<ProfileSample>>,
}

/// Profile samples one load report carries at most (the scheduler refuses more).
const MAX_SAMPLES_PER_REPORT: usize = rollfleet_server::MAX_PROFILE_SAMPLES_PER_REPORT;

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
struct DecodeTiming {
    first: Option<tokio::time::Instant>,
    last: Option<tokio::time::Instant>,
    chunks: u32,
    in_flight_sum: u64,
}

impl DecodeTiming {
    fn chunk(&mut self, at: tokio::time::Instant, in_flight: u32) {
        self.first.get_or_insert(at);
        self.last = Some(at);
        self.chunks += 1;
        self.in_flight_sum += u64::from(in_flight.max(1));
    }

    /// The decode sample of a generation of `tokens` tokens after a `prompt`-token context, on a
    /// replica of `gpus` GPUs: one iteration's work at the mean batch and mean context, by the
    /// model's own accounting (as the emulated engine's), and its measured duration. `None`
    /// for an answer of fewer than two chunks or tokens (no iteration to time).
    fn sample(
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
            bytes: costs.active_weight_bytes + costs.kv_bytes_per_token * batch * context,
            seconds,
            gpus: gpus.max(1),
            emulated: false,
        })
    }
}

/// Counts a request in flight for as long as it lives (an abort drops it too).
struct InFlight<'a>(&'a AtomicU32);

impl<'a> InFlight<'a> {
    fn enter(counter: &'a AtomicU32) -> InFlight<'a> {
        counter.fetch_add(1, Ordering::Relaxed);
        InFlight(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

struct Node {
    plan: JobPlan,
    pool: u32,
    time_scale: f64,
    engines: Mutex<BTreeMap<u64, Arc<EmulatedEngine>>>,
    /// Replicas a re-plan started on this node mid-run (the job's own placement has the rest).
    started_replicas: Mutex<BTreeMap<u64, rollfleet_core::ReplicaConfig>>,
    /// Share of the modelled rates its emulated GPUs achieve.
    slowdown: f64,
    openai: Option<Arc<OpenAiBackend>>,
    tokens: Option<Arc<token_engine::TokenBackend>>,
    host: EnvHost,
    episodes: Mutex<BTreeMap<(u64, u32), (EpisodeId, usize)>>,
    slots: usize,
    rewards: rollfleet_rewards::Handler,
    model_environments: bool,
}

/// How a refusal from the scheduler ends the session (`prefix` says which call it answered).
fn gone_or_refused(status: &tonic::Status, prefix: &str) -> Ended {
    let reason = format!("{prefix}{}", status.message());
    if scheduler_gone(status) {
        Ended::SchedulerGone {
            reason,
            closed: false,
        }
    } else {
        Ended::Error(NodeError::Refused(reason))
    }
}

async fn connect(
    opts: &WorkerOptions,
    connect_for: Duration,
) -> Result<WorkerServiceClient<AuthChannel>, NodeError> {
    let refused = |reason: String| NodeError::Connect {
        url: opts.scheduler.clone(),
        reason,
    };
    let identity = opts
        .tls_identity
        .as_ref()
        .map(|(cert, key)| (cert.as_path(), key.as_path()));
    let endpoint =
        rollfleet_proto::tls::endpoint(&opts.scheduler, opts.tls_ca.as_deref(), identity)
            .map_err(|e| refused(e.to_string()))?;
    let deadline = tokio::time::Instant::now() + connect_for;
    loop {
        match endpoint.connect().await {
            Ok(channel) => {
                return Ok(WorkerServiceClient::with_interceptor(
                    channel,
                    ClientAuth::new(opts.token.as_ref()),
                )
                .max_decoding_message_size(rollfleet_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(rollfleet_proto::MAX_MESSAGE_BYTES));
            }
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(refused(e.to_string()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Connects to the OpenAI-compatible engine; without a model name, takes the first model the
/// engine lists (retrying until `connect_timeout`: an engine may still be loading its weights).
async fn openai_backend(
    url: &str,
    model: Option<&str>,
    temperature: f32,
    connect_timeout: Duration,
) -> Result<OpenAiBackend, NodeError> {
    let config = |model: String| OpenAiConfig {
        base_url: url.to_owned(),
        model,
        api_key: std::env::var("ROLLFLEET_ENGINE_API_KEY")
            .ok()
            .filter(|k| !k.is_empty()),
        connect_timeout: Duration::from_secs(5),
        return_token_ids: false,
        // Weights come from the scheduler's weight-sync assignments; see `weight_sync`.
        weight_update: WeightUpdate::Unsupported,
    };
    let engine = |model: String| {
        OpenAiEngine::new(config(model), 0).map_err(|e| NodeError::Engine(e.to_string()))
    };
    let model = match model {
        Some(m) => m.to_owned(),
        None => {
            let probe = engine(String::new())?;
            let deadline = tokio::time::Instant::now() + connect_timeout;
            loop {
                match probe.served_models().await {
                    Ok(models) => match models.into_iter().next() {
                        Some(m) => break m,
                        None => {
                            return Err(NodeError::Engine(format!(
                                "{url}/v1/models lists no model; pass --model"
                            )));
                        }
                    },
                    Err(e @ EngineError::Unavailable { .. })
                        if tokio::time::Instant::now() < deadline =>
                    {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(NodeError::Engine(e.to_string())),
                }
            }
        }
    };
    Ok(OpenAiBackend {
        engine: engine(model)?,
        temperature,
        in_flight: AtomicU32::new(0),
        samples: Mutex::new(Vec::new()),
    })
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
fn add_gpu_readings(load: &mut WorkerLoad, samples: &[rollfleet_gpu::GpuSample]) {
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

/// Registers, then serves assignments until the job ends or the scheduler cuts the worker off.
pub async fn run(opts: WorkerOptions) -> Result<WorkerExit, NodeError> {
    let (telemetry_info, telemetry) = gpu_telemetry();
    let telemetry = telemetry.map(Arc::new);
    let openai = match &opts.engine {
        EngineChoice::OpenAi {
            url,
            model,
            temperature,
        } => Some(Arc::new(
            openai_backend(url, model.as_deref(), *temperature, opts.connect_timeout).await?,
        )),
        _ => None,
    };
    let tokens = token_engine::backend(&opts).await?.map(Arc::new);
    let software = Software {
        backend: match (&openai, &tokens) {
            (Some(_), _) => "openai",
            (None, Some(t)) => t.kind,
            (None, None) => "emulated",
        },
        version: match (&openai, &tokens) {
            (Some(b), _) => format!(
                "rollfleet-node {}; model {:?} at {}",
                env!("CARGO_PKG_VERSION"),
                b.engine.model(),
                b.engine.base_url()
            ),
            (None, Some(t)) => format!(
                "rollfleet-node {}; {} at {}",
                env!("CARGO_PKG_VERSION"),
                t.kind,
                t.urls().join(", ")
            ),
            (None, None) => env!("CARGO_PKG_VERSION").to_owned(),
        },
        telemetry_info,
        telemetry,
        openai,
        tokens,
    };
    let mut connect_for = opts.connect_timeout;
    loop {
        match session(&opts, &software, connect_for).await {
            Ok(exit) => return Ok(exit),
            Err(Ended::Error(e)) => return Err(e),
            // A node that is going does not come back.
            Err(Ended::SchedulerGone { .. }) if leaving(&opts.leave) => {
                return Ok(WorkerExit::Closed);
            }
            Err(Ended::SchedulerGone { reason, .. }) if !opts.rejoin_for.is_zero() => {
                tracing::warn!(
                    "worker ({}): the scheduler went away ({reason}); registering again for up \
                     to {} s",
                    opts.hostname,
                    opts.rejoin_for.as_secs_f64()
                );
                connect_for = opts.rejoin_for;
                // A scheduler that takes the registration and loses the worker again at once
                // is not hammered.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(Ended::SchedulerGone { closed: true, .. }) => return Ok(WorkerExit::Closed),
            Err(Ended::SchedulerGone { reason, .. }) => return Err(NodeError::Refused(reason)),
        }
    }
}

/// What a node runs its work with, the same in every session.
struct Software {
    backend: &'static str,
    version: String,
    telemetry_info: GpuTelemetryInfo,
    telemetry: Option<Arc<rollfleet_gpu::Telemetry>>,
    openai: Option<Arc<OpenAiBackend>>,
    tokens: Option<Arc<token_engine::TokenBackend>>,
}

/// How a session with the scheduler ended, short of the job's drain.
enum Ended {
    /// The scheduler went away or forgot the lease: a worker may register again.
    SchedulerGone {
        /// What the worker saw.
        reason: String,
        /// The scheduler closed the stream (rather than the stream breaking).
        closed: bool,
    },
    /// Anything else ends the worker.
    Error(NodeError),
}

impl From<NodeError> for Ended {
    fn from(e: NodeError) -> Ended {
        Ended::Error(e)
    }
}

/// Whether a refusal means the scheduler is gone or no longer knows this worker (so registering
/// again may work), rather than that it refuses this worker.
fn scheduler_gone(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::Internal
            | tonic::Code::NotFound
    )
}

/// One registration with the scheduler and the work it gives until the job drains it or the
/// scheduler goes away.
async fn session(
    opts: &WorkerOptions,
    software: &Software,
    connect_for: Duration,
) -> Result<WorkerExit, Ended> {
    let Software {
        backend,
        version: backend_version,
        telemetry_info,
        telemetry,
        openai,
        tokens,
    } = software;
    let (backend, backend_version) = (*backend, backend_version.clone());
    let telemetry = telemetry.clone();
    let openai = openai.clone();
    let tokens = tokens.clone();
    if leaving(&opts.leave) {
        return Ok(WorkerExit::Closed);
    }
    let mut client = connect(opts, connect_for).await?;
    let response = client
        .register(RegisterRequest {
            inventory: Some(HardwareInventory {
                hostname: opts.hostname.clone(),
                pool: opts.pool.clone(),
                device: opts.gpus.map(|count| {
                    hardware_inventory::Device::Gpu(GpuInventory {
                        count,
                        emulated: openai.is_none() && tokens.is_none(),
                        ..Default::default()
                    })
                }),
                backend: backend.into(),
                backend_version,
                gpu_telemetry: Some(telemetry_info.clone()),
            }),
            requested_lease_ms: opts.lease_ms,
            previous_worker_id: String::new(),
        })
        .await;
    let response = match response {
        Ok(response) => response.into_inner(),
        // A scheduler that comes back to find its job over (it was resumed from its journal
        // after the end) has nothing for the worker: the job is drained.
        Err(status) if status.code() == tonic::Code::FailedPrecondition => {
            tracing::info!(
                "worker ({}): the scheduler says {}; nothing left to do",
                opts.hostname,
                status.message()
            );
            return Ok(WorkerExit::Drained);
        }
        Err(status) => return Err(gone_or_refused(&status, "")),
    };
    let lease = response
        .lease
        .ok_or_else(|| NodeError::Refused("the registration answer has no lease".into()))?;
    let plan = JobPlan::from_yaml(&response.job_yaml, "the scheduler's job", 0)
        .map_err(NodeError::from)?;
    let pool = plan
        .pool_index(&opts.pool)
        .ok_or_else(|| NodeError::Refused(format!("the job has no pool {:?}", opts.pool)))?;
    let time_scale = if response.time_scale > 0.0 {
        response.time_scale
    } else {
        1.0
    };
    if openai.is_some() && plan.pool_role(pool) != Some(PoolRole::Gpu) {
        return Err(Ended::Error(NodeError::Engine(format!(
            "--engine openai serves generation, which runs on GPU pools; pool {:?} is a {:?} pool",
            opts.pool,
            plan.pool_role(pool)
        ))));
    }
    if let Some(t) = &tokens {
        if plan.pool_role(pool) != Some(PoolRole::Gpu) {
            return Err(Ended::Error(NodeError::Engine(format!(
                "--engine {} serves generation, which runs on GPU pools; pool {:?} is a {:?} pool",
                t.kind,
                opts.pool,
                plan.pool_role(pool)
            ))));
        }
        if plan.spec().rl.trainer != rollfleet_spec::TrainerMode::External {
            return Err(Ended::Error(NodeError::Engine(format!(
                "--engine {} loads every policy version's real weights, and the job's trainer is \
                 emulated (it publishes none): run the job with rl.trainer: external, or use \
                 --engine openai, whose engine keeps its weights under the emulated trainer",
                t.kind
            ))));
        }
        tracing::info!(
            "worker {} ({}): registered for pool {}; generation token-in, token-out on {} {} \
             engine(s): {}",
            shown_lease(&lease.worker_id),
            opts.hostname,
            opts.pool,
            t.urls().len(),
            t.kind,
            t.urls().join(", ")
        );
    }
    match &openai {
        None if tokens.is_some() => {}
        None => tracing::info!(
            "worker {} ({}): registered for pool {} ({}); emulated hardware at time scale \
             {time_scale}",
            shown_lease(&lease.worker_id),
            opts.hostname,
            opts.pool,
            match plan.pool_role(pool) {
                Some(PoolRole::Gpu) => "GPUs",
                Some(PoolRole::Cpu) => "CPU nodes",
                Some(PoolRole::Serverless) => "serverless functions",
                None => "not in the job",
            }
        ),
        Some(b) => tracing::info!(
            "worker {} ({}): registered for pool {}; generation on the OpenAI-compatible engine \
             at {} (model \"{}\"); training emulated at time scale {time_scale}",
            shown_lease(&lease.worker_id),
            opts.hostname,
            opts.pool,
            b.engine.base_url(),
            b.engine.model()
        ),
    }
    // Said once: the scheduler has it in the registration too.
    if telemetry_info.available {
        let names: Vec<&str> = telemetry_info
            .devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        tracing::info!(
            "worker {} ({}): GPU telemetry (NVML) from {} GPUs ({}) with every heartbeat",
            shown_lease(&lease.worker_id),
            opts.hostname,
            names.len(),
            names.join(", ")
        );
    } else {
        tracing::warn!(
            "worker {} ({}): no GPU telemetry on this node, reported once and never as zeros: {}",
            shown_lease(&lease.worker_id),
            opts.hostname,
            telemetry_info.unavailable_reason
        );
    }
    let node = Arc::new(Node {
        plan,
        pool,
        time_scale,
        engines: Mutex::new(BTreeMap::new()),
        started_replicas: Mutex::new(BTreeMap::new()),
        slowdown: opts.slowdown,
        openai,
        tokens,
        host: env_host(opts),
        episodes: Mutex::new(BTreeMap::new()),
        slots: opts.env_slots.max(1),
        rewards: rollfleet_rewards::Handler::default(),
        model_environments: opts.model_environments,
    });

    // Heartbeats on their own task; losing the lease ends the worker.
    let (lost_tx, mut lost_rx) = mpsc::unbounded_channel::<tonic::Status>();
    let mut hb_client = client.clone();
    let hb_id = lease.worker_id.clone();
    let epoch = lease.epoch;
    let interval = Duration::from_millis(lease.heartbeat_interval_ms.max(50));
    let hb_node = node.clone();
    let heartbeat = tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            let mut load = hb_node.load().await;
            if let Some(t) = &telemetry {
                let t = t.clone();
                // NVML calls block (briefly): off the async threads.
                if let Ok(samples) = tokio::task::spawn_blocking(move || t.sample()).await {
                    add_gpu_readings(&mut load, &samples);
                }
            }
            let r = hb_client
                .heartbeat(HeartbeatRequest {
                    worker_id: hb_id.clone(),
                    epoch,
                    load: Some(load),
                })
                .await;
            if let Err(status) = r {
                let _ = lost_tx.send(status);
                return;
            }
        }
    });

    let (out, out_rx) = mpsc::unbounded_channel();
    let _ = out.send(WorkerMessage {
        message: Some(worker_message::Message::Hello(WorkerHello {
            worker_id: lease.worker_id.clone(),
            epoch,
        })),
    });
    let mut inbound = client
        .work(UnboundedReceiverStream::new(out_rx))
        .await
        .map_err(|s| gone_or_refused(&s, ""))?
        .into_inner();
    let running: Arc<Mutex<BTreeMap<u64, Running>>> = Arc::new(Mutex::new(BTreeMap::new()));
    let mut leave = opts.leave.clone();
    let mut release_by: Option<tokio::time::Instant> = None;
    let result = loop {
        let message = tokio::select! {
            m = inbound.next() => m,
            status = lost_rx.recv() => {
                let status = status.unwrap_or_else(|| tonic::Status::unknown("the heartbeat task ended"));
                break Err(gone_or_refused(&status, "heartbeat refused: "));
            }
            () = leave_asked(&mut leave), if release_by.is_none() => {
                tracing::info!(
                    "worker {} ({}): leaving: the scheduler gives this node nothing new and \
                     releases it once what it runs is done (at most {} s)",
                    shown_lease(&lease.worker_id),
                    opts.hostname,
                    opts.leave_timeout.as_secs_f64()
                );
                let _ = out.send(WorkerMessage {
                    message: Some(worker_message::Message::Leaving(WorkerLeaving {
                        reason: format!("node {} is going away", opts.hostname),
                    })),
                });
                release_by = Some(tokio::time::Instant::now() + opts.leave_timeout);
                continue;
            }
            () = sleep_until_opt(release_by) => {
                break Err(Ended::Error(NodeError::Refused(format!(
                    "leaving: the scheduler did not release this node within {:?}",
                    opts.leave_timeout
                ))));
            }
        };
        match message {
            None => {
                break Err(Ended::SchedulerGone {
                    reason: "the scheduler closed the work stream".into(),
                    closed: true,
                });
            }
            Some(Err(status)) => break Err(gone_or_refused(&status, "")),
            Some(Ok(SchedulerMessage { message: None })) => {}
            Some(Ok(SchedulerMessage {
                message: Some(m), ..
            })) => match m {
                scheduler_message::Message::Assign(a) => {
                    let id = a.assignment_id;
                    let node = node.clone();
                    let out = out.clone();
                    let running2 = running.clone();
                    let (interrupt, interrupted) = watch::channel(false);
                    let task = tokio::spawn(async move {
                        let started = tokio::time::Instant::now();
                        let outcome = node.execute(&a, Interrupt(interrupted)).await;
                        running2
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&id);
                        let _ = out.send(WorkerMessage {
                            message: Some(worker_message::Message::Result(WorkResult {
                                assignment_id: id,
                                outcome: Some(outcome),
                                duration_us: started.elapsed().as_micros() as u64,
                            })),
                        });
                    });
                    running
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id, (task.abort_handle(), interrupt));
                }
                scheduler_message::Message::AbortAssignmentId(id) => {
                    if let Some((h, _)) = running
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id)
                    {
                        h.abort();
                    }
                }
                scheduler_message::Message::InterruptAssignmentId(id) => {
                    if let Some((_, interrupt)) =
                        running.lock().unwrap_or_else(|p| p.into_inner()).get(&id)
                    {
                        interrupt.send_replace(true);
                    }
                }
                scheduler_message::Message::Drain(_) => break Ok(WorkerExit::Drained),
                scheduler_message::Message::StartReplica(start) => {
                    if let Err(reason) = node.start_replica(&start) {
                        tracing::warn!("worker: {reason}");
                    } else {
                        tracing::info!(
                            "worker: serves replica {} from now on ({} x {} GPUs)",
                            start.replica,
                            start.role,
                            start.gpus
                        );
                    }
                }
                scheduler_message::Message::StopReplica(replica) => {
                    node.stop_replica(replica);
                    tracing::info!("worker: replica {replica} retired");
                }
            },
        }
    };
    heartbeat.abort();
    for (_, (h, _)) in std::mem::take(&mut *running.lock().unwrap_or_else(|p| p.into_inner())) {
        h.abort();
    }
    result
}

/// The environment host: the built-in environments plus every remote kind asked for (a remote
/// environment is used exactly like a built-in one, see `agents/remote`).
fn env_host(opts: &WorkerOptions) -> EnvHost {
    let mut factories: BTreeMap<String, Factory> = BTreeMap::new();
    for kind in rollfleet_environments::BUILTIN_KINDS {
        let factory: Factory = Arc::new(move || {
            rollfleet_environments::builtin(kind)
                .unwrap_or_else(|| unreachable!("{kind} is listed as built in"))
        });
        factories.insert((*kind).to_owned(), factory);
    }
    for (kind, url) in &opts.remote_envs {
        let (kind2, url) = (kind.clone(), url.clone());
        let factory: Factory = Arc::new(move || {
            Box::new(rollfleet_remote_env::RemoteEnvironment::new(
                &url,
                &kind2,
                Duration::from_secs(30),
            ))
        });
        factories.insert(kind.clone(), factory);
    }
    EnvHost::new(
        HostConfig {
            slots: opts.env_slots.max(1),
            step_timeout: Duration::from_secs(30),
        },
        factories,
    )
}

fn failure(cause: Cause, message: impl Into<String>) -> work_result::Outcome {
    work_result::Outcome::Failure(StageFailure {
        cause: cause as i32,
        message: message.into(),
    })
}

/// An environment host's refusal as a stage failure. An environment this node does not know,
/// or one that calls its configuration impossible (a remote server's `unknown_environment` and
/// other 4xx answers), is a configuration error: retrying on another node cannot fix it, so it
/// is reported as invalid, naming the environment, for the scheduler to fail the job with.
/// Everything else (a crash, a timeout, an unreachable server) is an infrastructure fault.
fn env_failure(kind: &str, error: rollfleet_envhost::HostError) -> work_result::Outcome {
    use rollfleet_envhost::HostError;
    match error {
        HostError::UnknownEnvironment { .. } => failure(
            Cause::Invalid,
            format!(
                "{error}; a remote environment is served by workers started with --remote-env \
                 {kind}=URL"
            ),
        ),
        HostError::Environment {
            error: rollfleet_environments::EnvError::InvalidConfig(_),
            ..
        } => failure(
            Cause::Invalid,
            format!("environment {}: {error}", rollfleet_server::quoted(kind)),
        ),
        _ => failure(Cause::Infrastructure, error.to_string()),
    }
}

/// A failed engine call as a stage failure: an engine that is unreachable, answers 5xx or breaks
/// the protocol is an infrastructure fault (retried, never scored); a refused request is invalid.
fn engine_failure(error: EngineError) -> work_result::Outcome {
    let cause = match error {
        EngineError::Unavailable { .. } | EngineError::Protocol { .. } => Cause::Infrastructure,
        EngineError::Rejected { .. } | EngineError::Unsupported(_) => Cause::Invalid,
    };
    failure(cause, error.to_string())
}

/// One generation stage on the OpenAI-compatible engine: the scheduler's rendered context in,
/// the engine's text out (with its own token count).
async fn generate_openai(
    backend: &OpenAiBackend,
    a: &WorkAssignment,
    g: &GenerationWork,
    costs: &ModelCosts,
    gpus: u32,
) -> Result<StageOutput, work_result::Outcome> {
    let engine = &backend.engine;
    if g.prefill_only {
        // Over the OpenAI API an engine prefills as part of the generation, and no KV cache moves
        // between engines: the generation stage that follows sends the whole context.
        return Ok(StageOutput {
            policy_version: engine.policy_version(),
            text: "[prefill: done by the OpenAI-compatible engine with the generation]".into(),
            ..Default::default()
        });
    }
    if g.prompt_text.is_empty() {
        return Err(failure(
            Cause::Invalid,
            "generation.prompt_text: empty; an OpenAI-compatible engine needs the turn's text (the \
             scheduler sends it to workers registered with backend \"openai\")",
        ));
    }
    let traj = a.trajectory.clone().unwrap_or_default();
    let request = GenerateRequest {
        request_id: format!(
            "{}-{}.{}-turn{}-a{}",
            traj.job, traj.id, traj.attempt, a.turn, a.assignment_id
        ),
        session: g.session.clone(),
        prompt: Prompt::Text(g.prompt_text.clone()),
        max_tokens: g.max_new_tokens.max(1),
        temperature: backend.temperature,
        stop: Vec::new(),
        // The version the engine serves now: the result says which one produced the text.
        policy_version: engine.policy_version(),
    };
    let _in_flight = InFlight::enter(&backend.in_flight);
    // Dropping the stream (an abort drops this whole task) closes the connection: an abort.
    let mut stream = engine.generate(request);
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let mut timing = DecodeTiming::default();
    while let Some(event) = stream.next().await {
        match event.map_err(engine_failure)? {
            GenerateEvent::Delta {
                text: delta,
                token_ids: ids,
                ..
            } => {
                if !delta.is_empty() || !ids.is_empty() {
                    timing.chunk(
                        tokio::time::Instant::now(),
                        backend.in_flight.load(Ordering::Relaxed),
                    );
                }
                text.push_str(&delta);
                token_ids.extend(ids);
            }
            GenerateEvent::Finished(done) => {
                let token_count = done
                    .completion_tokens
                    .map(u64::from)
                    .or_else(|| (!token_ids.is_empty()).then_some(token_ids.len() as u64))
                    .unwrap_or_else(|| tokens_of(&text));
                let prompt = done.prompt_tokens.map_or(g.prefill_token_count, u64::from);
                if let Some(sample) = timing.sample(costs, prompt, token_count, gpus) {
                    let mut samples = backend.samples.lock().unwrap_or_else(|p| p.into_inner());
                    if samples.len() >= MAX_SAMPLES_PER_REPORT {
                        samples.remove(0);
                    }
                    samples.push(sample);
                }
                return Ok(StageOutput {
                    tokens: token_ids,
                    text,
                    policy_version: done.policy_version,
                    emulated: done.emulated,
                    token_count,
                    ..Default::default()
                });
            }
        }
    }
    Err(failure(
        Cause::Infrastructure,
        format!(
            "{}: the generation stream ended without a finish",
            engine.base_url()
        ),
    ))
}

/// A weight sync on the OpenAI-compatible engine. Weights published by the emulated trainer
/// (`emulated://` sources) do not exist: the engine keeps its weights and the version is only
/// relabelled. Any other source is handed to the engine's update mechanism (which the OpenAI API
/// does not have: it fails, saying so).
async fn weight_sync_openai(
    backend: &OpenAiBackend,
    w: &rollfleet_proto::v1::WeightSyncWork,
) -> Result<StageOutput, work_result::Outcome> {
    if w.source.starts_with("emulated://") {
        backend.engine.relabel_version(w.to_version);
        return Ok(StageOutput {
            policy_version: w.to_version,
            text: format!(
                "[weights of version {} come from the emulated trainer: none loaded; the engine \
                 keeps its weights]",
                w.to_version
            ),
            ..Default::default()
        });
    }
    backend
        .engine
        .update_weights(&rollfleet_engine::WeightsRef {
            version: w.to_version,
            uri: w.source.clone(),
            format: w.format.clone(),
            sha256: w.sha256.clone(),
        })
        .await
        .map_err(engine_failure)?;
    Ok(StageOutput {
        policy_version: w.to_version,
        ..Default::default()
    })
}

fn tokens_of(text: &str) -> u64 {
    // About four bytes a token, as `agents`' default counter assumes.
    (text.len() as u64).div_ceil(4).max(1)
}

/// Vocabulary the emulated engine draws its synthetic token ids from (Qwen2.5's size).
const SYNTHETIC_VOCAB: u64 = 151_936;

/// The emulated engine's `n` synthetic token ids and their log-probabilities, seeded by `seed`
/// and `key` (trajectory, attempt, turn): the shape of a real engine's output, for the token-level
/// feed, with no model behind it (every such turn is marked emulated).
fn synthetic_tokens(seed: u64, key: &[u64], n: u64) -> (Vec<u32>, Vec<f32>) {
    let mut rng = synthetic_rng(seed, key);
    let n = n.min(MAX_SYNTHETIC_TOKENS) as usize;
    let mut ids = Vec::with_capacity(n);
    let mut logprobs = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(rng.below(SYNTHETIC_VOCAB) as u32);
        // A sampled token's log-probability: at most 0, mostly near it.
        logprobs.push(-(rng.next_f64() * rng.next_f64() * 4.0) as f32);
    }
    (ids, logprobs)
}

/// The emulated engine's `n` synthetic ids of a prompt (no log-probabilities: nothing sampled
/// them).
fn synthetic_ids(seed: u64, key: &[u64], n: u64) -> Vec<u32> {
    let mut rng = synthetic_rng(seed, key);
    (0..n.min(MAX_SYNTHETIC_TOKENS))
        .map(|_| rng.below(SYNTHETIC_VOCAB) as u32)
        .collect()
}

/// Most synthetic tokens one turn gets (a bound on what a malformed count can cost).
const MAX_SYNTHETIC_TOKENS: u64 = 1 << 20;

fn synthetic_rng(seed: u64, key: &[u64]) -> SplitMix64 {
    let mut keyed = vec![0x746f_6b65_6e73];
    keyed.extend_from_slice(key);
    SplitMix64::keyed(seed, &keyed)
}

/// An assignment being run: its task, to abort, and its interrupt, to set.
type Running = (AbortHandle, watch::Sender<bool>);

/// A generation's interrupt: set when the scheduler asks the generation to stop where it is.
pub(crate) struct Interrupt(pub(crate) watch::Receiver<bool>);

impl Interrupt {
    /// Resolves once the interrupt is asked for (never, if it cannot be any more).
    pub(crate) async fn asked(&mut self) {
        if self.0.wait_for(|asked| *asked).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Runs an emulated request that an interrupt may stop where it is: its output (the tokens
/// generated until then, when interrupted) and whether it was interrupted. An interrupted
/// request's cache is let go: the turn resumes after a weight update, which drops it anyway.
async fn run_interruptible(
    engine: &EmulatedEngine,
    cached: u64,
    prefill: u64,
    decode: u64,
    mut interrupt: Interrupt,
) -> Result<(rollfleet_engine::emulated::EmulatedOutput, bool), EngineError> {
    use rollfleet_engine::emulated::Interrupted;
    let mut flight = engine.submit(cached, prefill, Some(decode));
    tokio::select! {
        out = flight.finished() => return Ok((out?, false)),
        () = interrupt.asked() => {}
    }
    match flight.interrupt().await? {
        Interrupted::Finished(out) => Ok((out, false)),
        Interrupted::Partial(partial) => {
            engine.release(partial);
            Ok((
                rollfleet_engine::emulated::EmulatedOutput {
                    tokens: partial.generated,
                    policy_version: partial.policy_version,
                    emulated: true,
                },
                true,
            ))
        }
    }
}

/// The emulated policy's action: a random legal move of the environment, seeded per episode and
/// turn (the synthetic tokens of the emulated engine carry no text to parse). Grid games get a
/// direction, the calculator task a `calc:` call or an `answer:`; any other (remote) kind gets a
/// number from 1 to 100, the action format of the reference remote server's game.
pub fn emulated_action(environment: &str, seed: u64, turn: u32) -> String {
    let mut rng = SplitMix64::keyed(seed, &[0x6163_7469_6f6e, turn as u64]);
    match environment {
        "calculator" => {
            if rng.below(3) == 0 {
                format!("answer: {:.3}", rng.next_f64() * 100.0)
            } else {
                format!("calc: {} * {}", rng.below(100), rng.below(100))
            }
        }
        "sokoban" | "frozenlake" => {
            ["up", "down", "left", "right"][rng.below(4) as usize].to_owned()
        }
        _ => (1 + rng.below(100)).to_string(),
    }
}

impl Node {
    /// What the node carries now: its emulated replicas' queues, batches and KV caches, and its
    /// environment slots in use. GPU telemetry is absent (no GPU runs anything here), not zero.
    async fn load(&self) -> WorkerLoad {
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

    /// Replica `replica` as the job's placement has it, or as a re-plan started it here.
    fn replica_config(&self, replica: u64) -> Option<rollfleet_core::ReplicaConfig> {
        self.plan.replica(replica).cloned().or_else(|| {
            self.started_replicas
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&replica)
                .cloned()
        })
    }

    /// Takes on a replica a re-plan started on this node. A shape that cannot be served (no
    /// GPUs, no KV cache, an unknown role, an id the placement already has) is refused, naming
    /// the field.
    fn start_replica(&self, start: &rollfleet_proto::v1::ReplicaStart) -> Result<(), String> {
        use rollfleet_core::ServeRole;
        let role = match start.role.as_str() {
            "prefill" => ServeRole::Prefill,
            "decode" => ServeRole::Decode,
            "generate" => ServeRole::Generate,
            other => {
                return Err(format!(
                    "start_replica.role: {other:?} is not prefill, decode or generate"
                ));
            }
        };
        if start.gpus == 0 || start.kv_capacity_tokens == 0 || start.max_seqs == 0 {
            return Err(format!(
                "start_replica: replica {} has {} GPUs, {} KV tokens and {} sequences; each must \
                 be positive",
                start.replica, start.gpus, start.kv_capacity_tokens, start.max_seqs
            ));
        }
        if self.plan.replica(start.replica).is_some() {
            return Err(format!(
                "start_replica.replica: {} is a replica of the job's own placement",
                start.replica
            ));
        }
        self.started_replicas
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                start.replica,
                rollfleet_core::ReplicaConfig {
                    pool: self.pool,
                    role,
                    gpus: start.gpus,
                    kv_capacity_tokens: start.kv_capacity_tokens,
                    max_seqs: start.max_seqs,
                },
            );
        Ok(())
    }

    /// Drops a replica a re-plan retired: its engine (and the memory it models) goes.
    fn stop_replica(&self, replica: u64) {
        if let Some(t) = &self.tokens {
            t.release(replica);
        }
        self.engines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&replica);
        self.started_replicas
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&replica);
    }

    /// Replica `replica` (named by the work's field `field`, such as `generation.replica`), if
    /// it belongs to this worker's pool.
    fn own_replica(
        &self,
        field: &str,
        replica: u64,
    ) -> Result<rollfleet_core::ReplicaConfig, String> {
        let rc = self.replica_config(replica).ok_or_else(|| {
            format!(
                "{field}: no replica {replica} in the placement (neither the job's plan nor a \
                 re-plan's replica started on this worker)"
            )
        })?;
        if rc.pool != self.pool {
            return Err(format!(
                "{field}: replica {replica} belongs to pool {}, not this worker's {}",
                self.plan.pool_name(rc.pool),
                self.plan.pool_name(self.pool)
            ));
        }
        Ok(rc)
    }

    fn engine(&self, field: &str, replica: u64) -> Result<Arc<EmulatedEngine>, String> {
        let mut engines = self.engines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = engines.get(&replica) {
            return Ok(e.clone());
        }
        let rc = self.own_replica(field, replica)?;
        let (peak, bw) = self.plan.gpu_peaks(rc.pool);
        let engine = Arc::new(EmulatedEngine::start(EmulatedConfig {
            gpus: rc.gpus,
            peak_flops: peak * self.slowdown,
            bandwidth: bw * self.slowdown,
            hardware: self.plan.hardware,
            costs: self.plan.costs,
            kv_capacity_tokens: rc.kv_capacity_tokens,
            max_seqs: rc.max_seqs,
            link_bytes_per_s: self.plan.link_bytes_per_s(),
            weight_bytes: self.plan.config.weight_bytes,
            time_scale: self.time_scale,
        }));
        engines.insert(replica, engine.clone());
        Ok(engine)
    }

    async fn execute(&self, a: &WorkAssignment, interrupt: Interrupt) -> work_result::Outcome {
        if self.model_environments
            && let Some(output) = self.modelled(a).await
        {
            return work_result::Outcome::Output(output);
        }
        match self.try_execute(a, interrupt).await {
            Ok(mut output) => {
                // Token ids and log-probabilities travel packed (cheap for the scheduler).
                rollfleet_proto::packed::pack(&mut output);
                work_result::Outcome::Output(output)
            }
            Err(outcome) => outcome,
        }
    }

    async fn try_execute(
        &self,
        a: &WorkAssignment,
        interrupt: Interrupt,
    ) -> Result<StageOutput, work_result::Outcome> {
        let invalid = |m: String| failure(Cause::Invalid, m);
        let infra = |m: String| failure(Cause::Infrastructure, m);
        let role = self.plan.pool_role(self.pool);
        let work = a
            .work
            .as_ref()
            .ok_or_else(|| invalid("work: not set".into()))?;
        let traj = a.trajectory.clone().unwrap_or_default();
        match work {
            Work::Generation(g) => {
                if role != Some(PoolRole::Gpu) {
                    return Err(invalid("generation work sent to a non-GPU pool".into()));
                }
                if let Some(backend) = &self.openai {
                    let gpus = self
                        .own_replica("generation.replica", g.replica)
                        .map_err(invalid)?
                        .gpus;
                    return generate_openai(backend, a, g, &self.plan.costs, gpus).await;
                }
                if let Some(backend) = &self.tokens {
                    self.own_replica("generation.replica", g.replica)
                        .map_err(invalid)?;
                    return token_engine::generate(backend, a, g, interrupt).await;
                }
                let engine = self
                    .engine("generation.replica", g.replica)
                    .map_err(invalid)?;
                if g.prefill_only {
                    let out = engine
                        .run(0, g.prefill_token_count, None)
                        .await
                        .map_err(|e| infra(e.to_string()))?;
                    return Ok(StageOutput {
                        policy_version: out.policy_version,
                        emulated: true,
                        text: "[emulated prefill]".into(),
                        ..Default::default()
                    });
                }
                if g.kv_pull_tokens > 0 {
                    let secs = g.kv_pull_tokens as f64 * self.plan.costs.kv_bytes_per_token
                        / self.plan.link_bytes_per_s();
                    tokio::time::sleep(Duration::from_secs_f64(secs * self.time_scale)).await;
                }
                let task = self.plan.spec().tasks.get(a.task as usize);
                let mut rng = SplitMix64::keyed(
                    self.plan.config.seed,
                    &[
                        0x6465_636f_6465,
                        traj.id,
                        traj.attempt as u64,
                        a.turn as u64,
                    ],
                );
                let drawn = task.map_or(64.0, |t| {
                    rollfleet_fleet::workload::sample(&t.action_tokens, &mut rng)
                });
                // The turn's length is drawn whole; a resumed turn generates what is left of it.
                let n = (drawn.round().max(1.0) as u64)
                    .saturating_sub(g.resumed_tokens)
                    .clamp(1, u64::from(g.max_new_tokens.max(1)));
                let cached = u64::from(g.cached_prefix_tokens) + g.kv_pull_tokens;
                let (out, interrupted) =
                    run_interruptible(&engine, cached, g.prefill_token_count, n, interrupt)
                        .await
                        .map_err(|e| infra(e.to_string()))?;
                let mut key = vec![traj.id, u64::from(traj.attempt), u64::from(a.turn)];
                if g.resumed_tokens > 0 {
                    key.push(g.resumed_tokens);
                }
                let (tokens, logprobs) = synthetic_tokens(self.plan.config.seed, &key, out.tokens);
                let prompt_tokens =
                    synthetic_ids(!self.plan.config.seed, &key, g.new_message_tokens);
                Ok(StageOutput {
                    policy_version: out.policy_version,
                    emulated: true,
                    token_count: out.tokens,
                    text: format!("[emulated: {} synthetic tokens]", out.tokens),
                    tokens,
                    logprobs,
                    prompt_tokens,
                    interrupted,
                    ..Default::default()
                })
            }
            Work::WeightSync(w) => {
                if let Some(backend) = &self.openai {
                    self.own_replica("weight_sync.replica", w.replica)
                        .map_err(invalid)?;
                    return weight_sync_openai(backend, w).await;
                }
                if let Some(backend) = &self.tokens {
                    self.own_replica("weight_sync.replica", w.replica)
                        .map_err(invalid)?;
                    return token_engine::weight_sync(backend, w).await;
                }
                let engine = self
                    .engine("weight_sync.replica", w.replica)
                    .map_err(invalid)?;
                engine
                    .load_weights(w.to_version, w.weight_bytes)
                    .await
                    .map_err(|e| infra(e.to_string()))?;
                Ok(StageOutput {
                    policy_version: w.to_version,
                    emulated: true,
                    ..Default::default()
                })
            }
            Work::Train(t) => {
                if role != Some(PoolRole::Gpu) {
                    return Err(invalid("training sent to a non-GPU pool".into()));
                }
                let secs = self.plan.train_seconds(t.tokens, t.trainer_gpus) * self.time_scale;
                tokio::time::sleep(Duration::from_secs_f64(secs.min(3600.0))).await;
                Ok(StageOutput {
                    policy_version: t.from_version + u64::from(t.publishes),
                    emulated: true,
                    text: format!(
                        "[emulated training: {} trajectories, {} tokens]",
                        t.batch.len(),
                        t.tokens
                    ),
                    ..Default::default()
                })
            }
            Work::EnvStep(e) => {
                if role != Some(PoolRole::Cpu) {
                    return Err(invalid("an environment step sent to a non-CPU pool".into()));
                }
                let key = (traj.id, traj.attempt);
                if e.reset {
                    self.forget(key);
                    self.make_room();
                    let (episode, observation) = self
                        .host
                        .start(&e.environment, e.seed)
                        .await
                        .map_err(|err| env_failure(&e.environment, err))?;
                    self.remember(key, episode, 0);
                    return Ok(StageOutput {
                        token_count: tokens_of(&observation),
                        observation,
                        ..Default::default()
                    });
                }
                let held = self
                    .episodes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&key)
                    .copied();
                let episode = match held {
                    Some((episode, applied)) if applied == e.history.len() => episode,
                    _ => {
                        // Not here (it ran elsewhere, or was lost): rebuild it by replay.
                        self.forget(key);
                        self.make_room();
                        let (episode, _) = self
                            .host
                            .restore(&e.environment, e.seed, &e.history)
                            .await
                            .map_err(|err| env_failure(&e.environment, err))?;
                        episode
                    }
                };
                // The policy's text when a real engine wrote it (the action extracted as the
                // agent loop does); a random legal move when the policy is emulated.
                let action = match &e.policy_output {
                    Some(text) => rollfleet_environments::extract_action(text).to_owned(),
                    None => emulated_action(&e.environment, e.seed, a.turn),
                };
                let step = self.host.step(episode, &action).await.map_err(|err| {
                    self.episodes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&key);
                    env_failure(&e.environment, err)
                })?;
                if step.done {
                    self.episodes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&key);
                } else {
                    self.remember(key, episode, e.history.len() + 1);
                }
                Ok(StageOutput {
                    token_count: tokens_of(&step.observation),
                    observation: step.observation,
                    done: step.done,
                    reward: step.reward,
                    text: action,
                    ..Default::default()
                })
            }
            Work::Reward(r) => {
                let function = rollfleet_rewards::RewardFunction::from_name(&r.function)
                    .ok_or_else(|| invalid(format!("reward.function: unknown {:?}", r.function)))?;
                let handler = self.rewards.clone();
                let payload = r.payload.clone();
                let result =
                    tokio::task::spawn_blocking(move || handler.invoke(function, &payload))
                        .await
                        .map_err(|e| infra(format!("reward task: {e}")))?;
                let bytes = result.map_err(|e| {
                    if e.error_type == rollfleet_rewards::FunctionError::INVALID_PAYLOAD {
                        invalid(e.to_string())
                    } else {
                        infra(e.to_string())
                    }
                })?;
                let value: serde_json::Value = serde_json::from_slice(&bytes)
                    .map_err(|e| infra(format!("reward result is not JSON: {e}")))?;
                let reward = value
                    .get("reward")
                    .and_then(serde_json::Value::as_f64)
                    .ok_or_else(|| infra("reward result has no number \"reward\"".into()))?;
                Ok(StageOutput {
                    reward,
                    ..Default::default()
                })
            }
        }
    }

    /// An environment step or reward drawn from the job spec's distributions (what the
    /// simulator does), taking the drawn time on the scaled clock; `None` for other work.
    async fn modelled(&self, a: &WorkAssignment) -> Option<StageOutput> {
        use rollfleet_fleet::workload::sample;
        let traj = a.trajectory.clone().unwrap_or_default();
        let task = self.plan.spec().tasks.get(a.task as usize)?;
        let seed = self.plan.config.seed;
        let keyed =
            |k: u64| SplitMix64::keyed(seed, &[k, traj.id, traj.attempt as u64, a.turn as u64]);
        let output = match a.work.as_ref()? {
            Work::EnvStep(e) => {
                let ms = sample(&task.env_step_ms, &mut keyed(1));
                tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0 * self.time_scale)).await;
                if e.reset {
                    let tokens = sample(&task.prompt_tokens, &mut keyed(2)).round().max(1.0);
                    StageOutput {
                        token_count: tokens as u64,
                        observation: "[modelled environment]".into(),
                        emulated: true,
                        ..Default::default()
                    }
                } else {
                    let max = task.max_turns.max(1) as f64;
                    let mut turns_rng = SplitMix64::keyed(seed, &[3, traj.id, traj.attempt as u64]);
                    let wanted = task
                        .turns
                        .as_ref()
                        .map_or(max, |d| sample(d, &mut turns_rng).round())
                        .clamp(1.0, max) as u32;
                    let tokens = sample(&task.observation_tokens, &mut keyed(4))
                        .round()
                        .max(0.0);
                    StageOutput {
                        token_count: tokens as u64,
                        done: a.turn >= wanted,
                        observation: "[modelled environment]".into(),
                        text: "[modelled action]".into(),
                        emulated: true,
                        ..Default::default()
                    }
                }
            }
            Work::Reward(_) => {
                let reward = self
                    .plan
                    .spec()
                    .rewards
                    .iter()
                    .find(|r| r.name == task.reward)?;
                let ms = sample(&reward.latency_ms, &mut keyed(5));
                tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0 * self.time_scale)).await;
                StageOutput {
                    emulated: true,
                    ..Default::default()
                }
            }
            _ => return None,
        };
        Some(output)
    }

    fn remember(&self, key: (u64, u32), episode: EpisodeId, applied: usize) {
        self.episodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, (episode, applied));
    }

    fn forget(&self, key: (u64, u32)) {
        if let Some((episode, _)) = self
            .episodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key)
        {
            self.host.end(episode);
        }
    }

    /// Episodes abandoned by the scheduler (regenerated trajectories) would fill the slots:
    /// end the oldest ones when the host is nearly full.
    fn make_room(&self) {
        let mut episodes = self.episodes.lock().unwrap_or_else(|p| p.into_inner());
        while episodes.len() + 1 >= self.slots {
            let Some((_, (episode, _))) = episodes.pop_first() else {
                break;
            };
            self.host.end(episode);
        }
    }
}

/// A lease id as logs show it: its number (`w<N>`), without the secret that makes it a
/// capability.
fn shown_lease(worker_id: &str) -> &str {
    worker_id.split('-').next().unwrap_or(worker_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_environment_refused_for_its_configuration_is_invalid_and_a_crash_is_infrastructure() {
        use rollfleet_envhost::HostError;
        use rollfleet_environments::EnvError;
        let cause = |outcome: work_result::Outcome| match outcome {
            work_result::Outcome::Failure(f) => (f.cause(), f.message),
            other => panic!("not a failure: {other:?}"),
        };
        let unknown = HostError::UnknownEnvironment {
            kind: "webshop".into(),
            known: vec!["sokoban".into()],
        };
        let (c, message) = cause(env_failure("webshop", unknown));
        assert_eq!(c, Cause::Invalid);
        assert!(
            message.contains("unknown environment \"webshop\""),
            "{message}"
        );
        assert!(message.contains("--remote-env webshop=URL"), "{message}");
        let refused = HostError::Environment {
            episode: 3,
            error: EnvError::InvalidConfig(
                "http://127.0.0.1:9: HTTP 404: unknown_environment: 'wordle'".into(),
            ),
        };
        let (c, message) = cause(env_failure("wordle", refused));
        assert_eq!(c, Cause::Invalid);
        assert!(message.starts_with("environment \"wordle\": "), "{message}");
        assert!(message.contains("unknown_environment"), "{message}");
        for infrastructure in [
            HostError::Infrastructure {
                episode: 4,
                reason: "the environment panicked".into(),
            },
            HostError::NoFreeSlot(8),
            HostError::UnknownEpisode(5),
            HostError::Environment {
                episode: 6,
                error: EnvError::NotRunning,
            },
        ] {
            let (c, _) = cause(env_failure("sokoban", infrastructure));
            assert_eq!(c, Cause::Infrastructure);
        }
    }

    #[test]
    fn readings_fill_the_load_and_no_reading_leaves_every_gpu_field_absent() {
        let mut load = WorkerLoad::default();
        add_gpu_readings(&mut load, &[]);
        assert_eq!(load, WorkerLoad::default(), "no reading: absent, not zero");

        let sample = |index, utilization, memory_used_bytes| rollfleet_gpu::GpuSample {
            index,
            utilization,
            memory_used_bytes,
        };
        add_gpu_readings(&mut load, &[sample(0, 0.5, 100), sample(3, 1.0, 300)]);
        assert_eq!(load.gpus.len(), 2);
        assert_eq!(
            (load.gpus[1].index, load.gpus[1].utilization),
            (3, 1.0),
            "indices are the driver's"
        );
        assert_eq!(load.gpu_utilization, Some(0.75));
        assert_eq!(load.gpu_memory_used_bytes, Some(400.0));
    }

    /// This project's machines have no NVIDIA driver; on one that has, the devices are listed.
    #[test]
    fn the_node_says_whether_it_has_gpu_telemetry_and_why_not() {
        let (info, reader) = gpu_telemetry();
        if info.available {
            assert!(reader.is_some() && !info.devices.is_empty());
            assert!(info.unavailable_reason.is_empty());
        } else {
            assert!(reader.is_none() && info.devices.is_empty());
            assert!(
                info.unavailable_reason.contains("NVML")
                    || info.unavailable_reason.contains("no GPU"),
                "{}",
                info.unavailable_reason
            );
        }
    }

    #[test]
    fn a_streamed_answer_gives_one_decode_sample_at_the_batch_in_flight() {
        let costs = ModelCosts {
            flops_per_token: 3e9,
            attention_flops_per_context: 1e5,
            active_weight_bytes: 3e9,
            kv_bytes_per_token: 3e4,
        };
        let start = tokio::time::Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut timing = DecodeTiming::default();
        timing.chunk(at(0), 1);
        assert!(
            timing.sample(&costs, 100, 5, 2).is_none(),
            "one chunk times no iteration"
        );
        timing.chunk(at(20), 3);
        timing.chunk(at(40), 2);
        // 5 tokens: the 4 after the first came over 40 ms, 10 ms an iteration; the batch is the
        // mean of 1, 3 and 2 requests in flight; the context the prompt plus half the answer.
        let s = timing.sample(&costs, 100, 5, 2).unwrap();
        assert!((s.seconds - 0.010).abs() < 1e-12, "{}", s.seconds);
        let (batch, context) = (2.0, 102.5);
        assert!((s.flops - batch * (3e9 + 1e5 * context)).abs() < 1.0);
        assert!((s.bytes - (3e9 + 3e4 * batch * context)).abs() < 1.0);
        assert_eq!((s.gpus, s.emulated), (2, false));
        assert_eq!(s.kind, ProfileKind::Decode as i32);
        assert!(
            timing.sample(&costs, 100, 1, 2).is_none(),
            "one token, no iteration"
        );
    }
}
