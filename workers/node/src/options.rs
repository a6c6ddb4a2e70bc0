//! The worker's options: which engine serves its replicas, where the scheduler is, how it
//! authenticates, and the environment host they configure.

use super::*;

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

/// The environment host: the built-in environments plus every remote kind asked for (a remote
/// environment is used exactly like a built-in one, see `agents/remote`).
pub(crate) fn env_host(opts: &WorkerOptions) -> EnvHost {
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
