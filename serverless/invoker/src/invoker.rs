//! The reward invoker the scheduler calls: one `invoke` per (trajectory, attempt), turned into
//! Lambda Invoke calls through aws-sdk-lambda with a per-call timeout, bounded concurrency,
//! retries with jittered backoff on throttles and transient errors only, and an idempotency
//! ledger so each (trajectory, attempt) gets its reward delivered exactly once.
//!
//! Exactly once, precisely: the first `invoke` for a key that obtains a reward returns it with
//! [`Delivery::First`]; any other `invoke` for the same key, concurrent or later, returns the
//! same reward with [`Delivery::Duplicate`] and makes no call. A failed `invoke` leaves no
//! entry, so the scheduler may ask again. Infrastructure failures are returned as errors,
//! never as a zero reward.
//!
//! The SDK's own retries are switched off: its standard retry mode would retry throttles
//! without the invoker seeing them, which would hide them from the accounting.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_lambda::Client;
use aws_sdk_lambda::config::http::HttpResponse;
use aws_sdk_lambda::config::{BehaviorVersion, Region};
use aws_sdk_lambda::error::DisplayErrorContext;
use aws_sdk_lambda::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_lambda::primitives::Blob;
use aws_sdk_lambda::types::LogType;
use aws_smithy_types::retry::RetryConfig;
use aws_smithy_types::timeout::TimeoutConfig;
use serde_json::Value;
use tokio::sync::{OnceCell, Semaphore};

use crate::config::InvokerConfig;
use crate::metrics::{InvocationSummary, InvokerMetrics};
use crate::report::parse_log_result;

/// What the scheduler asks for: the reward of one attempt of one trajectory.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardRequest {
    /// The Lambda function name (or ARN) of the reward function.
    pub function: String,
    pub trajectory_id: String,
    /// The scheduler's attempt number for this trajectory's reward stage: a trajectory that is
    /// re-rolled gets a new attempt and so a new reward; a retried call does not.
    pub attempt: u32,
    /// The function's input; must be a JSON object. `idempotency_key` is added to it.
    pub payload: Value,
}

impl RewardRequest {
    pub fn idempotency_key(&self) -> String {
        format!("{}#{}", self.trajectory_id, self.attempt)
    }
}

/// Whether this call delivered the reward or repeated an already delivered one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    First,
    Duplicate,
}

/// A reward obtained from the function.
#[derive(Debug, Clone, PartialEq)]
pub struct Reward {
    pub idempotency_key: String,
    pub reward: f64,
    /// The function's whole JSON result (`reward`, `details`, ...).
    pub result: Value,
    /// Lambda Invoke calls it took, including retries.
    pub calls: u32,
    /// The call that produced the reward started a new execution environment.
    pub cold_start: bool,
}

/// A reward with its delivery status.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardOutcome {
    pub reward: Arc<Reward>,
    pub delivery: Delivery,
}

/// Why no reward could be obtained. None of these is a reward of zero.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvokeError {
    #[error("the payload must be a JSON object")]
    PayloadNotAnObject,
    /// Permanent: the request is wrong (unknown function, too large, bad input); no retry.
    #[error("{function}: {code}: {message}")]
    Rejected {
        function: String,
        code: String,
        message: String,
    },
    /// Permanent: the function failed on this input (e.g. `InvalidPayload`).
    #[error("{function}: function error {error_type}: {message}")]
    Function {
        function: String,
        error_type: String,
        message: String,
    },
    /// The function answered 200 with something that is not a reward.
    #[error("{function}: invalid reward result: {reason}")]
    InvalidResult { function: String, reason: String },
    /// Transient failures every time until the retry budget ran out.
    #[error("{function}: gave up after {calls} calls; last error: {last}")]
    Exhausted {
        function: String,
        calls: u32,
        last: String,
    },
}

/// How one call ended, for the retry decision and the accounting.
#[derive(Debug)]
enum CallOutcome {
    Success(Value, Option<crate::report::Report>),
    Throttled {
        retry_after: Option<Duration>,
        message: String,
    },
    Transient {
        outcome: &'static str,
        message: String,
    },
    Permanent(InvokeError),
}

type Ledger = HashMap<String, HashMap<u32, Arc<OnceCell<Arc<Reward>>>>>;

/// The reward invoker. Cheap to share behind an `Arc`; all methods take `&self`.
pub struct RewardInvoker {
    client: Client,
    config: InvokerConfig,
    slots: Semaphore,
    ledger: Mutex<Ledger>,
    metrics: InvokerMetrics,
    rng: Mutex<fastrand::Rng>,
}

#[derive(Debug, thiserror::Error)]
pub enum InvokerError {
    #[error("could not register metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

impl std::fmt::Debug for RewardInvoker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardInvoker")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Builds an aws-sdk-lambda client for `config`: with an endpoint URL, static placeholder
/// credentials (a local host ignores signatures, and the default chain would otherwise probe
/// the instance metadata service); without one, the normal AWS credential chain.
pub async fn lambda_client(config: &InvokerConfig) -> Client {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let timeouts = TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(5))
        .build();
    match &config.endpoint_url {
        Some(url) => {
            let conf = aws_sdk_lambda::Config::builder()
                .behavior_version(BehaviorVersion::latest())
                .region(Region::new(config.region.clone()))
                .endpoint_url(url)
                .credentials_provider(aws_credential_types::Credentials::new(
                    "rollfleet-local",
                    "rollfleet-local",
                    None,
                    None,
                    "rollfleet-local",
                ))
                .http_client(http)
                .retry_config(RetryConfig::disabled())
                .timeout_config(timeouts)
                .build();
            Client::from_conf(conf)
        }
        None => {
            let shared = aws_config::defaults(BehaviorVersion::latest())
                .region(Region::new(config.region.clone()))
                .http_client(http)
                .retry_config(RetryConfig::disabled())
                .timeout_config(timeouts)
                .load()
                .await;
            Client::new(&shared)
        }
    }
}

impl RewardInvoker {
    /// An invoker with its own SDK client, metrics registered into `registry`.
    pub async fn connect(
        config: InvokerConfig,
        registry: &prometheus::Registry,
    ) -> Result<Self, InvokerError> {
        let client = lambda_client(&config).await;
        Self::with_client(client, config, registry)
    }

    /// An invoker over an existing SDK client (its retry config should be disabled).
    pub fn with_client(
        client: Client,
        config: InvokerConfig,
        registry: &prometheus::Registry,
    ) -> Result<Self, InvokerError> {
        let metrics = InvokerMetrics::register(registry)?;
        let rng = match config.jitter_seed {
            Some(seed) => fastrand::Rng::with_seed(seed),
            None => fastrand::Rng::new(),
        };
        Ok(Self {
            client,
            slots: Semaphore::new(config.max_concurrency.max(1)),
            config,
            ledger: Mutex::new(HashMap::new()),
            metrics,
            rng: Mutex::new(rng),
        })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn metrics(&self) -> &InvokerMetrics {
        &self.metrics
    }

    /// Totals for the run summary.
    pub fn summary(&self) -> InvocationSummary {
        self.metrics.summary()
    }

    /// Drops the ledger entries of a trajectory once the trainer has consumed it, so the
    /// ledger does not grow without bound.
    pub fn forget_trajectory(&self, trajectory_id: &str) {
        if let Ok(mut ledger) = self.ledger.lock() {
            ledger.remove(trajectory_id);
        }
    }

    /// Obtains the reward for `request`, exactly once per (trajectory, attempt).
    pub async fn invoke(&self, request: RewardRequest) -> Result<RewardOutcome, InvokeError> {
        let key = request.idempotency_key();
        let Value::Object(mut payload) = request.payload else {
            return Err(InvokeError::PayloadNotAnObject);
        };
        let cell = {
            let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
            ledger
                .entry(request.trajectory_id.clone())
                .or_default()
                .entry(request.attempt)
                .or_default()
                .clone()
        };
        if let Some(done) = cell.get() {
            self.metrics
                .duplicates
                .with_label_values(&[request.function.as_str()])
                .inc();
            return Ok(RewardOutcome {
                reward: done.clone(),
                delivery: Delivery::Duplicate,
            });
        }
        payload.insert("idempotency_key".to_owned(), Value::String(key.clone()));
        let body = serde_json::to_vec(&Value::Object(payload)).unwrap_or_default();
        let mut ran = false;
        let result = cell
            .get_or_try_init(|| {
                ran = true;
                self.call_with_retries(&request.function, &key, body)
            })
            .await
            .cloned();
        match result {
            Ok(reward) => {
                let delivery = if ran {
                    Delivery::First
                } else {
                    Delivery::Duplicate
                };
                let counter = if ran {
                    &self.metrics.rewards
                } else {
                    &self.metrics.duplicates
                };
                counter
                    .with_label_values(&[request.function.as_str()])
                    .inc();
                Ok(RewardOutcome { reward, delivery })
            }
            Err(e) => Err(e),
        }
    }

    async fn call_with_retries(
        &self,
        function: &str,
        key: &str,
        body: Vec<u8>,
    ) -> Result<Arc<Reward>, InvokeError> {
        let policy = self.config.retry;
        let settings = self.config.function(function);
        let call_timeout = self.config.call_timeout(function);
        let labels = [function];
        let mut calls = 0u32;
        loop {
            calls += 1;
            let outcome = {
                let _permit = self.slots.acquire().await;
                self.call_once(function, &body, call_timeout).await
            };
            let (outcome_label, retry_after, last) = match outcome {
                CallOutcome::Success(result, report) => {
                    self.record_call(function, "success");
                    self.account(function, settings.memory_mb, report.as_ref());
                    let cold_start = report.is_some_and(|r| r.init_ms.is_some());
                    return self.reward_from(function, key, result, calls, cold_start);
                }
                CallOutcome::Permanent(e) => {
                    let label = match e {
                        InvokeError::Function { .. } => "function_error",
                        _ => "permanent_error",
                    };
                    self.record_call(function, label);
                    self.metrics.errors.with_label_values(&labels).inc();
                    return Err(e);
                }
                CallOutcome::Throttled {
                    retry_after,
                    message,
                } => {
                    self.metrics.throttles.with_label_values(&labels).inc();
                    ("throttled", retry_after, message)
                }
                CallOutcome::Transient { outcome, message } => {
                    self.metrics.errors.with_label_values(&labels).inc();
                    (outcome, None, message)
                }
            };
            self.record_call(function, outcome_label);
            if calls >= policy.max_attempts {
                return Err(InvokeError::Exhausted {
                    function: function.to_owned(),
                    calls,
                    last,
                });
            }
            self.metrics.retries.with_label_values(&labels).inc();
            tokio::time::sleep(self.backoff(calls, retry_after)).await;
        }
    }

    fn record_call(&self, function: &str, outcome: &str) {
        self.metrics
            .calls
            .with_label_values(&[function, outcome])
            .inc();
    }

    /// Full jitter: uniform in `[0, min(cap, base * 2^(n-1))]`; a `Retry-After` raises the
    /// floor to that many seconds (capped), so a throttled caller does not come back early.
    fn backoff(&self, calls: u32, retry_after: Option<Duration>) -> Duration {
        let policy = self.config.retry;
        let exp = policy
            .base
            .saturating_mul(1u32 << calls.saturating_sub(1).min(20))
            .min(policy.cap);
        let x = self.rng.lock().map(|mut r| r.f64()).unwrap_or(0.5);
        let jitter = exp.mul_f64(x);
        match retry_after {
            Some(after) => after.min(policy.cap) + policy.base.mul_f64(x),
            None => jitter,
        }
    }

    fn account(&self, function: &str, memory_mb: u32, report: Option<&crate::report::Report>) {
        let Some(report) = report else {
            return;
        };
        if report.init_ms.is_some() {
            self.metrics
                .cold_starts
                .with_label_values(&[function])
                .inc();
        }
        let memory = report.memory_mb.unwrap_or(memory_mb);
        self.metrics
            .billed_ms
            .with_label_values(&[function])
            .inc_by(report.billed_ms);
        // ms * MB / 1024 = MB-ms/1024 = GB-ms; * 1000 = micro-GB-s.
        let micro = report.billed_ms.saturating_mul(u64::from(memory)) * 1000 / 1024;
        self.metrics
            .micro_gb_seconds
            .with_label_values(&[function])
            .inc_by(micro);
    }

    async fn call_once(&self, function: &str, body: &[u8], call_timeout: Duration) -> CallOutcome {
        let mut call = self
            .client
            .invoke()
            .function_name(function)
            .payload(Blob::new(body));
        if self.config.request_log_tail {
            call = call.log_type(LogType::Tail);
        }
        let started = Instant::now();
        let sent = tokio::time::timeout(call_timeout, call.send()).await;
        let elapsed = started.elapsed();
        self.metrics.call_seconds.observe(elapsed.as_secs_f64());
        let output = match sent {
            Err(_) => {
                return CallOutcome::Transient {
                    outcome: "timeout",
                    message: format!("no answer within the call timeout of {call_timeout:?}"),
                };
            }
            Ok(Err(e)) => return classify_sdk_error(function, e),
            Ok(Ok(output)) => output,
        };
        let report = match output.log_result() {
            Some(encoded) => parse_log_result(encoded),
            // No log tail (e.g. a server that ignores LogType): bill what we observed.
            None => Some(crate::report::Report {
                billed_ms: u64::try_from(elapsed.as_micros().div_ceil(1000))
                    .unwrap_or(u64::MAX)
                    .max(1),
                memory_mb: None,
                init_ms: None,
            }),
        };
        let payload = output.payload().map(|b| b.as_ref()).unwrap_or_default();
        if output.function_error().is_some() {
            self.account(
                function,
                self.config.function(function).memory_mb,
                report.as_ref(),
            );
            return classify_function_error(function, payload);
        }
        match serde_json::from_slice::<Value>(payload) {
            Ok(v) => CallOutcome::Success(v, report),
            Err(e) => CallOutcome::Permanent(InvokeError::InvalidResult {
                function: function.to_owned(),
                reason: format!("not JSON: {e}"),
            }),
        }
    }

    fn reward_from(
        &self,
        function: &str,
        key: &str,
        result: Value,
        calls: u32,
        cold_start: bool,
    ) -> Result<Arc<Reward>, InvokeError> {
        let invalid = |reason: String| InvokeError::InvalidResult {
            function: function.to_owned(),
            reason,
        };
        if let Some(echoed) = result.get("idempotency_key").and_then(Value::as_str)
            && echoed != key
        {
            return Err(invalid(format!(
                "answer is for idempotency key {echoed}, not {key}"
            )));
        }
        let reward = result
            .get("reward")
            .and_then(Value::as_f64)
            .filter(|r| r.is_finite())
            .ok_or_else(|| invalid("no finite numeric `reward` field".to_owned()))?;
        Ok(Arc::new(Reward {
            idempotency_key: key.to_owned(),
            reward,
            result,
            calls,
            cold_start,
        }))
    }
}

/// Function errors that say the environment failed, not the reward's input.
const TRANSIENT_FUNCTION_ERRORS: &[&str] = &[
    "Sandbox.Timedout",
    "Sandbox.Unavailable",
    "Runtime.ExitError",
    "Runtime.Unknown",
    "Runtime.ExitError.OutOfMemory",
];

fn classify_function_error(function: &str, payload: &[u8]) -> CallOutcome {
    let parsed: Value = serde_json::from_slice(payload).unwrap_or(Value::Null);
    let error_type = parsed
        .get("errorType")
        .and_then(Value::as_str)
        .unwrap_or("Unhandled")
        .to_owned();
    let message = parsed
        .get("errorMessage")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(payload).into_owned());
    // AWS says "Task timed out after N seconds"; serverless-offline says "[504] - Lambda timeout.".
    let timed_out = message.contains("Task timed out") || message.contains("Lambda timeout");
    if timed_out || TRANSIENT_FUNCTION_ERRORS.contains(&error_type.as_str()) {
        CallOutcome::Transient {
            outcome: if timed_out {
                "timeout"
            } else {
                "transient_error"
            },
            message: format!("{error_type}: {message}"),
        }
    } else {
        CallOutcome::Permanent(InvokeError::Function {
            function: function.to_owned(),
            error_type,
            message,
        })
    }
}

/// API error codes worth retrying: the service or its dependencies are briefly unavailable.
const TRANSIENT_CODES: &[&str] = &[
    "ServiceException",
    "ResourceNotReadyException",
    "EC2ThrottledException",
    "EC2UnexpectedException",
    "ENILimitReachedException",
    "SubnetIPAddressLimitReachedException",
    "EFSMountConnectivityException",
    "EFSMountTimeoutException",
    "EFSIOException",
    "SnapStartNotReadyException",
    "SnapStartTimeoutException",
];

fn classify_sdk_error(
    function: &str,
    error: SdkError<aws_sdk_lambda::operation::invoke::InvokeError, HttpResponse>,
) -> CallOutcome {
    use aws_sdk_lambda::operation::invoke::InvokeError as Api;
    match &error {
        SdkError::ServiceError(service) => {
            let e = service.err();
            let code = e.code().unwrap_or("Unknown").to_owned();
            let message = e.message().unwrap_or("").to_owned();
            let status = service.raw().status().as_u16();
            if matches!(e, Api::TooManyRequestsException(_)) || status == 429 {
                let header = service.raw().headers().get("retry-after");
                let modelled = match e {
                    Api::TooManyRequestsException(t) => t.retry_after_seconds(),
                    _ => None,
                };
                let retry_after = modelled
                    .or(header)
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map(|s| Duration::from_secs_f64(s.min(3600.0)));
                return CallOutcome::Throttled {
                    retry_after,
                    message: format!("{code}: {message}"),
                };
            }
            if TRANSIENT_CODES.contains(&code.as_str()) || status >= 500 {
                return CallOutcome::Transient {
                    outcome: "transient_error",
                    message: format!("{code}: {message}"),
                };
            }
            CallOutcome::Permanent(InvokeError::Rejected {
                function: function.to_owned(),
                code,
                message,
            })
        }
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            CallOutcome::Transient {
                outcome: "transient_error",
                message: DisplayErrorContext(&error).to_string(),
            }
        }
        _ => CallOutcome::Permanent(InvokeError::Rejected {
            function: function.to_owned(),
            code: "ClientError".to_owned(),
            message: DisplayErrorContext(&error).to_string(),
        }),
    }
}
