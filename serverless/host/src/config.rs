//! Configuration of the local function host: which functions it serves and with what timeout,
//! memory size, reserved concurrency and cold start; payload, concurrency, event-queue and
//! connection limits; injected faults; and the `clap` arguments of `rollfleet serverless serve`,
//! which build a [`HostConfig`].

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rollfleet_rewards::{FunctionError, Handler, RewardFunction, Sandbox, SandboxLimits};

use crate::stats::HostStats;

/// AWS's documented limit for a synchronous (RequestResponse) request payload: 6 MB.
pub const MAX_SYNC_PAYLOAD: usize = 6 * 1024 * 1024;
/// AWS's documented limit for an asynchronous (Event) request payload: 1 MB (raised from
/// 256 KB; the Invoke API reference now gives 1 MB).
pub const MAX_EVENT_PAYLOAD: usize = 1024 * 1024;
/// A function's response is limited to 6 MB as well.
pub const MAX_RESPONSE_PAYLOAD: usize = 6 * 1024 * 1024;

/// Concurrency limit of a function without reserved concurrency. Lambda's unreserved functions
/// share the account's pool (1,000 by default); locally each function gets its own, small
/// enough that its synchronous request bodies stay within this many times 6 MB.
pub const DEFAULT_CONCURRENCY_PER_FUNCTION: u32 = 64;
/// How many Event invocations the host's asynchronous queue holds at once, all functions
/// together (received, or waiting for a concurrency slot).
pub const DEFAULT_EVENT_QUEUE_EVENTS: usize = 1_000;
/// How many payload bytes that queue holds at once.
pub const DEFAULT_EVENT_QUEUE_BYTES: usize = 64 * 1024 * 1024;
/// How long a queued event may wait for a concurrency slot before it is discarded: Lambda's
/// default `MaximumEventAgeInSeconds`, six hours.
pub const DEFAULT_EVENT_MAX_AGE: Duration = Duration::from_secs(6 * 60 * 60);
/// Time a client has to send a whole request head, counted from the connection's opening or
/// from the previous response (so it is also the idle keep-alive timeout).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a client has to send a whole request body once its head has arrived.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Open connections served at once; further ones wait in the listen backlog.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

/// A boxed future returned by a custom function.
pub type FunctionFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>, FunctionError>> + Send>>;
/// A function implemented in Rust by the embedder (tests, benchmarks, extensions).
pub type CustomFunction = Arc<dyn Fn(Bytes) -> FunctionFuture + Send + Sync>;

/// What runs when a function is invoked.
#[derive(Clone)]
pub enum FunctionCode {
    /// One of the built-in reward functions.
    Reward(RewardFunction),
    /// Anything else, as an async closure.
    Custom(CustomFunction),
}

impl std::fmt::Debug for FunctionCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FunctionCode::Reward(r) => write!(f, "Reward({})", r.name()),
            FunctionCode::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// One deployed function.
#[derive(Debug, Clone)]
pub struct FunctionConfig {
    pub code: FunctionCode,
    /// The function's own timeout, as Lambda's `Timeout` setting.
    pub timeout: Duration,
    /// As Lambda's `MemorySize`; used in the billing report (GB-seconds).
    pub memory_mb: u32,
    /// As Lambda's reserved concurrency: invocations beyond it are throttled (429).
    /// `None` means the host's [`HostConfig::concurrency_per_function`].
    pub reserved_concurrency: Option<u32>,
    /// Time to start a new execution environment when no warm one is free.
    pub cold_start: Duration,
    /// How long an idle environment stays warm.
    pub idle_ttl: Duration,
}

impl FunctionConfig {
    pub fn new(code: FunctionCode) -> Self {
        Self {
            code,
            timeout: Duration::from_secs(30),
            memory_mb: 512,
            reserved_concurrency: None,
            cold_start: Duration::ZERO,
            idle_ttl: Duration::from_secs(300),
        }
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn memory_mb(mut self, memory_mb: u32) -> Self {
        self.memory_mb = memory_mb;
        self
    }

    pub fn reserved_concurrency(mut self, limit: Option<u32>) -> Self {
        self.reserved_concurrency = limit;
        self
    }

    pub fn cold_start(mut self, cold_start: Duration) -> Self {
        self.cold_start = cold_start;
        self
    }

    pub fn idle_ttl(mut self, idle_ttl: Duration) -> Self {
        self.idle_ttl = idle_ttl;
        self
    }
}

/// Faults injected into RequestResponse invocations, for testing callers' retry logic.
/// Rates are probabilities in `[0, 1]`; their sum should not exceed 1.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FaultConfig {
    /// Answered with 500 `ServiceException` without running the function.
    pub service_error_rate: f64,
    /// Answered with 429 `TooManyRequestsException`.
    pub throttle_rate: f64,
    /// The function hangs until its timeout and is answered as a timed-out function.
    pub timeout_rate: f64,
    /// Seed of the fault draw, so a failing run can be replayed.
    pub seed: u64,
}

impl FaultConfig {
    pub fn is_active(&self) -> bool {
        self.service_error_rate > 0.0 || self.throttle_rate > 0.0 || self.timeout_rate > 0.0
    }
}

/// Everything the host needs to serve.
#[derive(Debug, Clone)]
pub struct HostConfig {
    pub functions: BTreeMap<String, FunctionConfig>,
    pub region: String,
    pub account_id: String,
    /// Largest RequestResponse (and DryRun) request body, in bytes.
    pub max_sync_payload: usize,
    /// Largest Event request body, in bytes.
    pub max_event_payload: usize,
    /// Concurrency limit of each function that has no reserved concurrency.
    pub concurrency_per_function: u32,
    /// Event invocations the asynchronous queue holds at once, all functions together; beyond
    /// it an Event invocation is answered 429.
    pub event_queue_events: usize,
    /// Payload bytes the asynchronous queue holds at once; beyond it, 429 as well.
    pub event_queue_bytes: usize,
    /// A queued event still waiting for a concurrency slot after this long is discarded.
    pub event_max_age: Duration,
    /// See [`DEFAULT_HEADER_READ_TIMEOUT`].
    pub header_read_timeout: Duration,
    /// See [`DEFAULT_BODY_READ_TIMEOUT`].
    pub body_read_timeout: Duration,
    /// See [`DEFAULT_MAX_CONNECTIONS`].
    pub max_connections: usize,
    pub faults: FaultConfig,
    /// Runs the built-in reward functions (holds the sandbox limits).
    pub handler: Arc<Handler>,
    /// Counters the embedder can read while the host runs.
    pub stats: Arc<HostStats>,
}

impl HostConfig {
    /// A host with no functions.
    pub fn empty() -> Self {
        Self {
            functions: BTreeMap::new(),
            region: "us-east-1".to_owned(),
            account_id: "000000000000".to_owned(),
            max_sync_payload: MAX_SYNC_PAYLOAD,
            max_event_payload: MAX_EVENT_PAYLOAD,
            concurrency_per_function: DEFAULT_CONCURRENCY_PER_FUNCTION,
            event_queue_events: DEFAULT_EVENT_QUEUE_EVENTS,
            event_queue_bytes: DEFAULT_EVENT_QUEUE_BYTES,
            event_max_age: DEFAULT_EVENT_MAX_AGE,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            faults: FaultConfig::default(),
            handler: Arc::new(Handler::default()),
            stats: Arc::new(HostStats::default()),
        }
    }

    /// A host serving every built-in reward function under its own name, with defaults.
    pub fn with_reward_functions() -> Self {
        let mut config = Self::empty();
        for f in RewardFunction::ALL {
            config.add(f.name(), FunctionConfig::new(FunctionCode::Reward(f)));
        }
        config
    }

    pub fn add(&mut self, name: &str, function: FunctionConfig) -> &mut Self {
        self.functions.insert(name.to_owned(), function);
        self
    }

    /// The ARN AWS would give a function of this name.
    pub fn function_arn(&self, name: &str) -> String {
        format!(
            "arn:aws:lambda:{}:{}:function:{name}",
            self.region, self.account_id
        )
    }
}

/// `rollfleet serverless serve`: run the local Lambda-compatible host for the reward functions.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (loopback by default: the host does not check SigV4 signatures).
    #[arg(long, default_value = "127.0.0.1:9001")]
    pub listen: std::net::SocketAddr,
    /// Timeout of each function, in seconds (Lambda's `Timeout`).
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
    /// Memory size of each function in MB (Lambda's `MemorySize`; used for GB-seconds).
    #[arg(long, default_value_t = 512)]
    pub memory_mb: u32,
    /// Reserved concurrency of each cheap function; `--concurrency-per-function` when absent.
    #[arg(long)]
    pub reserved_concurrency: Option<u32>,
    /// Concurrency limit of each function without reserved concurrency (429 beyond it).
    #[arg(long, default_value_t = DEFAULT_CONCURRENCY_PER_FUNCTION)]
    pub concurrency_per_function: u32,
    /// Reserved concurrency of `code_tests` (each invocation runs Python subprocesses);
    /// defaults to the number of CPUs.
    #[arg(long)]
    pub code_tests_concurrency: Option<u32>,
    /// Simulated cold start of a new execution environment, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub cold_start_ms: u64,
    /// How long an idle execution environment stays warm, in seconds.
    #[arg(long, default_value_t = 300)]
    pub idle_ttl_secs: u64,
    /// CPU seconds allowed to one sandboxed code run.
    #[arg(long, default_value_t = 5)]
    pub sandbox_cpu_secs: u64,
    /// Wall-clock milliseconds allowed to one sandboxed code run.
    #[arg(long, default_value_t = 10_000)]
    pub sandbox_wall_ms: u64,
    /// Address-space limit of one sandboxed code run, in MiB.
    #[arg(long, default_value_t = 512)]
    pub sandbox_memory_mib: u64,
    /// Output limit of one sandboxed code run (each of stdout, stderr), in KiB.
    #[arg(long, default_value_t = 1024)]
    pub sandbox_output_kib: usize,
    /// Event invocations the asynchronous queue holds at once (429 beyond it).
    #[arg(long, default_value_t = DEFAULT_EVENT_QUEUE_EVENTS)]
    pub event_queue_events: usize,
    /// Payload MiB the asynchronous queue holds at once (429 beyond it).
    #[arg(long, default_value_t = DEFAULT_EVENT_QUEUE_BYTES >> 20)]
    pub event_queue_mib: usize,
    /// Seconds a queued event may wait for a concurrency slot before it is discarded.
    #[arg(long, default_value_t = DEFAULT_EVENT_MAX_AGE.as_secs())]
    pub event_max_age_secs: u64,
    /// Milliseconds a client has to send a whole request head (also the idle keep-alive
    /// timeout).
    #[arg(long, default_value_t = DEFAULT_HEADER_READ_TIMEOUT.as_millis() as u64)]
    pub header_read_timeout_ms: u64,
    /// Milliseconds a client has to send a whole request body.
    #[arg(long, default_value_t = DEFAULT_BODY_READ_TIMEOUT.as_millis() as u64)]
    pub body_read_timeout_ms: u64,
    /// Open connections served at once; further ones wait to be accepted.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Region used in ARNs and error messages.
    #[arg(long, default_value = "us-east-1")]
    pub region: String,
}

impl Default for ServeArgs {
    fn default() -> Self {
        Self {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 9001)),
            timeout_secs: 30,
            memory_mb: 512,
            reserved_concurrency: None,
            concurrency_per_function: DEFAULT_CONCURRENCY_PER_FUNCTION,
            code_tests_concurrency: None,
            cold_start_ms: 0,
            idle_ttl_secs: 300,
            sandbox_cpu_secs: 5,
            sandbox_wall_ms: 10_000,
            sandbox_memory_mib: 512,
            sandbox_output_kib: 1024,
            event_queue_events: DEFAULT_EVENT_QUEUE_EVENTS,
            event_queue_mib: DEFAULT_EVENT_QUEUE_BYTES >> 20,
            event_max_age_secs: DEFAULT_EVENT_MAX_AGE.as_secs(),
            header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT.as_millis() as u64,
            body_read_timeout_ms: DEFAULT_BODY_READ_TIMEOUT.as_millis() as u64,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            region: "us-east-1".to_owned(),
        }
    }
}

impl ServeArgs {
    /// The host configuration these arguments describe.
    pub fn host_config(&self) -> HostConfig {
        let limits = SandboxLimits {
            cpu_seconds: self.sandbox_cpu_secs.max(1),
            wall_time_ms: self.sandbox_wall_ms.max(1),
            memory_bytes: self.sandbox_memory_mib.saturating_mul(1 << 20),
            max_file_bytes: 16 << 20,
            max_processes: 32,
            max_output_bytes: self.sandbox_output_kib.saturating_mul(1024).max(1),
        };
        let timeout = Duration::from_secs(self.timeout_secs.max(1));
        let mut config = HostConfig::empty();
        config.region = self.region.clone();
        config.concurrency_per_function = self.concurrency_per_function;
        config.event_queue_events = self.event_queue_events;
        config.event_queue_bytes = self.event_queue_mib.saturating_mul(1 << 20);
        config.event_max_age = Duration::from_secs(self.event_max_age_secs);
        // A zero timeout would disconnect every client before its first byte.
        config.header_read_timeout = Duration::from_millis(self.header_read_timeout_ms.max(1));
        config.body_read_timeout = Duration::from_millis(self.body_read_timeout_ms.max(1));
        config.max_connections = self.max_connections.max(1);
        // A code_tests call stops starting new cases a little before the function times out.
        config.handler = Arc::new(Handler::new(
            Sandbox::new(limits),
            timeout.saturating_sub(Duration::from_millis(
                self.sandbox_wall_ms.min(timeout.as_millis() as u64 / 2),
            )),
        ));
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        for f in RewardFunction::ALL {
            let concurrency = if f == RewardFunction::CodeTests {
                Some(self.code_tests_concurrency.unwrap_or(cpus))
            } else {
                self.reserved_concurrency
            };
            config.add(
                f.name(),
                FunctionConfig::new(FunctionCode::Reward(f))
                    .timeout(timeout)
                    .memory_mb(self.memory_mb)
                    .reserved_concurrency(concurrency)
                    .cold_start(Duration::from_millis(self.cold_start_ms))
                    .idle_ttl(Duration::from_secs(self.idle_ttl_secs)),
            );
        }
        config
    }
}
