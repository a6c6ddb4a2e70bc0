//! The HTTP side of the host: accepts connections, routes
//! `POST /2015-03-31/functions/{name}/invocations`, and answers exactly as the Lambda Invoke API
//! documents: status codes, `X-Amzn-ErrorType` error codes with a JSON body, function errors as
//! 200 with `X-Amz-Function-Error`, `X-Amz-Log-Result` with a `REPORT` line on `LogType: Tail`.
//!
//! Execution environments are modelled per function: an invocation reuses an idle warm one
//! (LIFO, like Lambda) or pays the configured cold start; a timed-out environment is discarded,
//! so the next invocation after a timeout starts cold, as on Lambda.
//!
//! Everything a client can make the host hold is bounded, so memory is too:
//! - request bodies, by the payload limit of their invocation type, enforced while reading
//!   (no more than the limit is ever buffered) and within the body-read timeout;
//! - synchronous invocations, by each function's concurrency (a slot is taken before the body
//!   is read, so at most that many bodies per function are in memory);
//! - Event invocations, by one queue for the whole host, counted in events and payload bytes
//!   (reserved before the body is read); each function's dispatcher runs queued events as its
//!   concurrency slots free up and discards those older than the maximum event age;
//! - connections, by a cap (beyond it the host stops accepting, and new connections wait in
//!   the listen backlog), a header-read timeout that is also the idle keep-alive timeout, and
//!   hyper's read buffer size.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rollfleet_rewards::{FunctionError, Handler, RewardFunction};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::config::{FunctionCode, FunctionConfig, HostConfig, MAX_RESPONSE_PAYLOAD};
use crate::stats::HostStats;

/// hyper's per-connection read buffer, and so the longest request head: small enough that the
/// connection cap bounds what idle or slow connections hold, large enough for any Invoke head.
const CONNECTION_BUFFER: usize = 64 * 1024;

/// Errors that stop the host.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("could not listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("could not read the listener's address: {0}")]
    LocalAddr(#[source] std::io::Error),
    #[error("could not install the Ctrl-C handler: {0}")]
    Signal(#[source] std::io::Error),
}

/// A deployed function and its execution environments.
struct Deployed {
    name: String,
    config: FunctionConfig,
    /// Concurrency slots, shared by synchronous invocations and queued events as Lambda shares
    /// a function's concurrency between them.
    slots: Arc<Semaphore>,
    /// The number of `slots`.
    concurrency: usize,
    /// When each idle warm environment was last used; the last entry is the most recent.
    warm: Mutex<Vec<Instant>>,
}

impl Deployed {
    /// Takes a warm environment if one is fresh; `false` means this invocation starts cold.
    fn take_warm(&self) -> bool {
        let Ok(mut warm) = self.warm.lock() else {
            return false;
        };
        match warm.pop() {
            Some(last) if last.elapsed() <= self.config.idle_ttl => true,
            Some(_) => {
                // The most recent one is stale, so all of them are.
                warm.clear();
                false
            }
            None => false,
        }
    }

    fn return_warm(&self) {
        if let Ok(mut warm) = self.warm.lock() {
            warm.push(Instant::now());
        }
    }

    /// The 429 for an invocation that found every concurrency slot taken.
    fn throttled(&self, request_id: &str) -> Reply {
        match self.config.reserved_concurrency {
            Some(_) => throttle(
                "ReservedFunctionConcurrentInvocationLimitExceeded",
                &format!(
                    "Rate Exceeded: function {} is at its reserved concurrency of {} concurrent invocations",
                    self.name, self.concurrency
                ),
                request_id,
            ),
            None => throttle(
                "ConcurrentInvocationLimitExceeded",
                &format!(
                    "Rate Exceeded: function {} is at the host's concurrency limit of {} concurrent invocations per function",
                    self.name, self.concurrency
                ),
                request_id,
            ),
        }
    }
}

/// A function as the router sees it: what runs, and where its events are queued.
struct Function {
    deployed: Arc<Deployed>,
    /// Unbounded as a channel; bounded by the [`EventBudget`] each event holds a share of.
    events: mpsc::UnboundedSender<QueuedEvent>,
}

/// An Event invocation waiting for its function's dispatcher.
struct QueuedEvent {
    payload: Bytes,
    received: Instant,
    /// Released when the event leaves the queue (starts running, or is discarded).
    _reservation: Reservation,
}

/// The asynchronous queue's capacity, shared by every function: at most `max_events` events
/// and `max_bytes` payload bytes at once, counting bodies still being received.
struct EventBudget {
    max_events: usize,
    max_bytes: usize,
    used: Mutex<(usize, usize)>,
    stats: Arc<HostStats>,
}

/// Why an Event invocation found no room in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum QueueFull {
    #[error(
        "Rate Exceeded: the asynchronous event queue is full ({max} events queued, the limit is {max} events)"
    )]
    Events { max: usize },
    #[error(
        "Rate Exceeded: the asynchronous event queue is full ({used} payload bytes queued, {wanted} more would pass the limit of {max} bytes)"
    )]
    Bytes {
        used: usize,
        wanted: usize,
        max: usize,
    },
}

impl EventBudget {
    fn try_reserve(self: &Arc<Self>, bytes: usize) -> Result<Reservation, QueueFull> {
        let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
        let (events, queued) = *used;
        if events >= self.max_events {
            return Err(QueueFull::Events {
                max: self.max_events,
            });
        }
        if queued.saturating_add(bytes) > self.max_bytes {
            return Err(QueueFull::Bytes {
                used: queued,
                wanted: bytes,
                max: self.max_bytes,
            });
        }
        *used = (events + 1, queued + bytes);
        self.stats.event_queue_size(used.0, used.1);
        Ok(Reservation {
            budget: self.clone(),
            bytes,
        })
    }

    fn release(&self, events: usize, bytes: usize) {
        let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
        *used = (used.0.saturating_sub(events), used.1.saturating_sub(bytes));
        self.stats.event_queue_size(used.0, used.1);
    }
}

/// One event's share of the [`EventBudget`]; given back on drop.
struct Reservation {
    budget: Arc<EventBudget>,
    bytes: usize,
}

impl Reservation {
    /// Gives back what a body turned out not to need (a reservation is made for the declared
    /// or the largest allowed size, before the body is read).
    fn shrink_to(&mut self, bytes: usize) {
        if bytes < self.bytes {
            self.budget.release(0, self.bytes - bytes);
            self.bytes = bytes;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.release(1, self.bytes);
    }
}

struct State {
    functions: HashMap<String, Function>,
    region: String,
    account_id: String,
    max_sync_payload: usize,
    max_event_payload: usize,
    body_read_timeout: Duration,
    header_read_timeout: Duration,
    max_connections: usize,
    event_budget: Arc<EventBudget>,
    faults: crate::config::FaultConfig,
    fault_rng: Mutex<fastrand::Rng>,
    handler: Arc<Handler>,
    stats: Arc<HostStats>,
}

impl State {
    /// Also starts each function's event dispatcher, so it must run inside a tokio runtime.
    fn new(config: HostConfig) -> Self {
        let event_max_age = config.event_max_age;
        let functions = config
            .functions
            .into_iter()
            .map(|(name, function)| {
                let concurrency = function
                    .reserved_concurrency
                    .unwrap_or(config.concurrency_per_function)
                    as usize;
                let concurrency = concurrency.min(Semaphore::MAX_PERMITS);
                let deployed = Arc::new(Deployed {
                    name: name.clone(),
                    config: function,
                    slots: Arc::new(Semaphore::new(concurrency)),
                    concurrency,
                    warm: Mutex::new(Vec::new()),
                });
                let (events, queue) = mpsc::unbounded_channel();
                tokio::spawn(dispatch_events(
                    deployed.clone(),
                    queue,
                    event_max_age,
                    config.handler.clone(),
                    config.stats.clone(),
                ));
                (name, Function { deployed, events })
            })
            .collect();
        Self {
            functions,
            region: config.region,
            account_id: config.account_id,
            max_sync_payload: config.max_sync_payload,
            max_event_payload: config.max_event_payload,
            body_read_timeout: config.body_read_timeout,
            // hyper disconnects at once on a zero timeout.
            header_read_timeout: config.header_read_timeout.max(Duration::from_millis(1)),
            max_connections: config.max_connections.clamp(1, Semaphore::MAX_PERMITS),
            event_budget: Arc::new(EventBudget {
                max_events: config.event_queue_events,
                max_bytes: config.event_queue_bytes,
                used: Mutex::new((0, 0)),
                stats: config.stats.clone(),
            }),
            faults: config.faults,
            fault_rng: Mutex::new(fastrand::Rng::with_seed(config.faults.seed)),
            handler: config.handler,
            stats: config.stats,
        }
    }

    fn arn(&self, name: &str) -> String {
        format!(
            "arn:aws:lambda:{}:{}:function:{name}",
            self.region, self.account_id
        )
    }

    fn draw_fault(&self) -> Option<Fault> {
        if !self.faults.is_active() {
            return None;
        }
        let x = self.fault_rng.lock().map(|mut r| r.f64()).unwrap_or(1.0);
        let f = &self.faults;
        if x < f.service_error_rate {
            Some(Fault::ServiceError)
        } else if x < f.service_error_rate + f.throttle_rate {
            Some(Fault::Throttle)
        } else if x < f.service_error_rate + f.throttle_rate + f.timeout_rate {
            Some(Fault::Timeout)
        } else {
            None
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    ServiceError,
    Throttle,
    Timeout,
}

/// Runs one function's queued events, each in one of the function's concurrency slots, oldest
/// first, and discards those that waited longer than `max_age`. Returns once the host has
/// stopped (the sender is gone) and every event still queued has run or expired.
async fn dispatch_events(
    deployed: Arc<Deployed>,
    mut queue: mpsc::UnboundedReceiver<QueuedEvent>,
    max_age: Duration,
    handler: Arc<Handler>,
    stats: Arc<HostStats>,
) {
    // Events taken off the channel, so that the oldest one's age can be watched while every
    // slot is busy.
    let mut waiting: VecDeque<QueuedEvent> = VecDeque::new();
    let mut open = true;
    loop {
        let Some(oldest) = waiting.front().map(|e| e.received) else {
            if !open {
                return;
            }
            match queue.recv().await {
                Some(event) => waiting.push_back(event),
                None => open = false,
            }
            continue;
        };
        let expires = tokio::time::Instant::from_std(oldest)
            .checked_add(max_age)
            .unwrap_or_else(far_future);
        tokio::select! {
            received = queue.recv(), if open => match received {
                Some(event) => waiting.push_back(event),
                None => open = false,
            },
            () = tokio::time::sleep_until(expires) => {
                while waiting.front().is_some_and(|e| e.received.elapsed() >= max_age) {
                    waiting.pop_front();
                    stats.event_expired();
                }
            }
            slot = deployed.slots.clone().acquire_owned() => {
                let Ok(slot) = slot else {
                    // The semaphore is never closed; nothing could run these events.
                    return;
                };
                let Some(event) = waiting.pop_front() else {
                    continue;
                };
                if event.received.elapsed() >= max_age {
                    stats.event_expired();
                    continue;
                }
                let QueuedEvent { payload, _reservation: reservation, .. } = event;
                // Leaving the queue for a slot: its room is free for the next event.
                drop(reservation);
                tokio::spawn(run_event(
                    deployed.clone(),
                    payload,
                    slot,
                    handler.clone(),
                    stats.clone(),
                ));
            }
        }
    }
}

/// An instant no timer reaches, for a maximum age too large to add to the clock.
fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 24 * 60 * 60)
}

async fn run_event(
    deployed: Arc<Deployed>,
    payload: Bytes,
    _slot: OwnedSemaphorePermit,
    handler: Arc<Handler>,
    stats: Arc<HostStats>,
) {
    let _ = execute(&handler, &stats, &deployed, payload, None).await;
    stats.event_completed();
}

/// Serves the Lambda Invoke API on `listener` until `shutdown` completes, then stops accepting,
/// lets in-flight requests finish (for up to 10 seconds) and returns. Events still queued then
/// run in the background as their function's concurrency allows.
pub async fn serve(
    listener: TcpListener,
    config: HostConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), HostError> {
    let state = Arc::new(State::new(config));
    let connections = Arc::new(Semaphore::new(state.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(state.header_read_timeout)
        .max_buf_size(CONNECTION_BUFFER);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        // At the cap, stop accepting: new connections wait in the kernel's listen backlog,
        // costing the host nothing, and are served in order as slots free up (the header-read
        // timeout frees the slots of clients that stall).
        let slot = match connections.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                state.stats.connection_cap_wait();
                tokio::select! {
                    () = &mut shutdown => break,
                    slot = connections.clone().acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_) => break,
                    },
                }
            }
        };
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        // Usually EMFILE or a connection reset before accept: transient, so
                        // back off briefly instead of stopping the host.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                // Small request/response pairs: Nagle would add tens of milliseconds.
                let _ = stream.set_nodelay(true);
                let service_state = state.clone();
                let service =
                    hyper::service::service_fn(move |req| handle(service_state.clone(), req));
                let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
                let stats = state.stats.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    // A client hanging up mid-request is its own business; one that was too
                    // slow to send a request head is counted.
                    if let Err(e) = conn.await
                        && e.is_timeout()
                    {
                        stats.header_read_timeout();
                    }
                });
            }
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(Duration::from_secs(10), graceful.shutdown()).await;
    Ok(())
}

/// A host running in the background of the current tokio runtime: the embedded default for
/// rewards in a local run. Dropping it (or calling [`LocalHost::shutdown`]) stops it.
#[derive(Debug)]
pub struct LocalHost {
    addr: std::net::SocketAddr,
    stats: Arc<HostStats>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), HostError>>>,
}

impl LocalHost {
    /// Binds `addr` (use port 0 for a free port) and starts serving `config` in a task.
    pub async fn start(addr: std::net::SocketAddr, config: HostConfig) -> Result<Self, HostError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| HostError::Bind { addr, source })?;
        let addr = listener.local_addr().map_err(HostError::LocalAddr)?;
        let stats = config.stats.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, config, async {
            let _ = stopped.await;
        }));
        Ok(Self {
            addr,
            stats,
            stop: Some(stop),
            task: Some(task),
        })
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The endpoint URL to give the invoker (`InvokerConfig::local`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn stats(&self) -> &Arc<HostStats> {
        &self.stats
    }

    /// Stops accepting, waits for in-flight requests (up to 10 s), and returns.
    pub async fn shutdown(mut self) -> Result<(), HostError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await.unwrap_or(Ok(())),
            None => Ok(()),
        }
    }
}

impl Drop for LocalHost {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Binds `args.listen` and serves the reward functions until Ctrl-C.
pub async fn run(args: crate::config::ServeArgs) -> Result<(), HostError> {
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|source| HostError::Bind {
            addr: args.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(HostError::LocalAddr)?;
    let config = args.host_config();
    // Installed before the banner: a caller that reads it and sends SIGINT at once must find
    // the handler there, not the default action (a spawned task's `ctrl_c()` registers only
    // when that task first runs, which a loaded machine delays).
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(HostError::Signal)?;
    tracing::info!(
        "serverless host: Lambda Invoke API on http://{addr} serving {}",
        config
            .functions
            .keys()
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    );
    serve(listener, config, async move {
        interrupt.recv().await;
    })
    .await
}

type Reply = Response<Full<Bytes>>;

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Reply, Infallible> {
    let request_id = request_id();
    Ok(route(&state, req, &request_id)
        .await
        .unwrap_or_else(|reply| reply))
}

/// `Err` carries an error reply, so `?` can be used for every rejection.
async fn route(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Result<Reply, Reply> {
    let path = req.uri().path();
    let Some(raw_name) = path
        .strip_prefix("/2015-03-31/functions/")
        .and_then(|rest| rest.strip_suffix("/invocations"))
        .filter(|name| !name.is_empty() && !name.contains('/'))
    else {
        return Err(aws_error(
            StatusCode::NOT_FOUND,
            "UnknownOperationException",
            "User",
            &format!("Unknown operation {} {path}", req.method()),
            request_id,
        ));
    };
    if req.method() != Method::POST {
        return Err(aws_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "UnknownOperationException",
            "User",
            &format!("Unknown operation {} {path}", req.method()),
            request_id,
        ));
    }
    let name = percent_decode(raw_name).ok_or_else(|| {
        invalid_parameter(
            "Function name is not valid percent-encoded UTF-8",
            request_id,
        )
    })?;
    let query_qualifier = req.uri().query().and_then(|q| {
        q.split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "Qualifier")
            .and_then(|(_, v)| percent_decode(v))
    });
    let (function_name, qualifier) = split_function_name(&name);
    let qualifier = qualifier.map(str::to_owned).or(query_qualifier);
    let function = state
        .functions
        .get(function_name)
        .filter(|_| qualifier.as_deref().is_none_or(|q| q == "$LATEST"))
        .ok_or_else(|| {
            let mut arn = state.arn(function_name);
            if let Some(q) = &qualifier {
                arn.push(':');
                arn.push_str(q);
            }
            aws_error(
                StatusCode::NOT_FOUND,
                "ResourceNotFoundException",
                "User",
                &format!("Function not found: {arn}"),
                request_id,
            )
        })?;
    let deployed = function.deployed.clone();

    let headers = req.headers();
    let invocation_type = match headers
        .get("x-amz-invocation-type")
        .map(|v| v.to_str().unwrap_or("<invalid>"))
    {
        None | Some("RequestResponse") => InvocationType::RequestResponse,
        Some("Event") => InvocationType::Event,
        Some("DryRun") => InvocationType::DryRun,
        Some(other) => {
            return Err(invalid_parameter(
                &format!(
                    "1 validation error detected: Value '{other}' at 'invocationType' failed to satisfy constraint: Member must satisfy enum value set: [Event, RequestResponse, DryRun]"
                ),
                request_id,
            ));
        }
    };
    let tail = headers
        .get("x-amz-log-type")
        .is_some_and(|v| v.as_bytes() == b"Tail");

    let (limit, limit_name) = match invocation_type {
        InvocationType::Event => (state.max_event_payload, "Event (asynchronous)"),
        InvocationType::RequestResponse => {
            (state.max_sync_payload, "RequestResponse (synchronous)")
        }
        InvocationType::DryRun => (state.max_sync_payload, "DryRun (synchronous)"),
    };
    let too_large = || {
        state.stats.payload_too_large();
        aws_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestTooLargeException",
            "User",
            &format!(
                "Request must be smaller than {limit} bytes for the InvokeFunction operation: the {limit_name} payload limit is {limit} bytes"
            ),
            request_id,
        )
    };
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        // Answer before reading: a client streaming gigabytes gets its 413 at once.
        return Err(too_large());
    }
    // A declared length is at most `limit` here.
    let expected = declared.map_or(limit, |n| usize::try_from(n).unwrap_or(limit));

    // Room for the request is taken before its body is read, so that only admitted bodies are
    // ever in memory: a queue reservation for an event, a concurrency slot otherwise (DryRun
    // included: it runs nothing, but its body is up to 6 MB too).
    let admission = match invocation_type {
        InvocationType::Event => match state.event_budget.try_reserve(expected) {
            Ok(reservation) => Admission::Queued(reservation),
            Err(full) => {
                state.stats.throttle();
                state.stats.event_refused();
                let refusal = throttle(
                    "FunctionInvocationRateLimitExceeded",
                    &full.to_string(),
                    request_id,
                );
                discard_body(req.into_body(), limit, state.body_read_timeout).await;
                return Err(refusal);
            }
        },
        _ => match deployed.slots.clone().try_acquire_owned() {
            Ok(slot) => Admission::Slot(slot),
            Err(_) => {
                state.stats.throttle();
                let refusal = deployed.throttled(request_id);
                discard_body(req.into_body(), limit, state.body_read_timeout).await;
                return Err(refusal);
            }
        },
    };

    let payload = match read_body(req.into_body(), limit, expected, state.body_read_timeout).await {
        Ok(payload) => payload,
        Err(BodyError::TooLarge) => return Err(too_large()),
        Err(BodyError::TimedOut) => {
            state.stats.body_read_timeout();
            return Err(aws_error(
                StatusCode::REQUEST_TIMEOUT,
                "RequestTimeoutException",
                "User",
                &format!(
                    "The request body was not received within the body-read timeout of {} ms",
                    state.body_read_timeout.as_millis()
                ),
                request_id,
            ));
        }
        Err(BodyError::Read(e)) => {
            return Err(aws_error(
                StatusCode::BAD_REQUEST,
                "InvalidRequestContentException",
                "User",
                &format!("Could not read request body: {e}"),
                request_id,
            ));
        }
    };
    if !payload.is_empty() && serde_json::from_slice::<serde::de::IgnoredAny>(&payload).is_err() {
        return Err(aws_error(
            StatusCode::BAD_REQUEST,
            "InvalidRequestContentException",
            "User",
            "Could not parse request body into json: the payload is not valid JSON",
            request_id,
        ));
    }

    match admission {
        Admission::Queued(mut reservation) => {
            reservation.shrink_to(payload.len());
            let event = QueuedEvent {
                payload,
                received: Instant::now(),
                _reservation: reservation,
            };
            if function.events.send(event).is_err() {
                return Err(service_error(
                    "the function's event dispatcher has stopped",
                    request_id,
                ));
            }
            state.stats.event_queued();
            Ok(empty(StatusCode::ACCEPTED, request_id))
        }
        Admission::Slot(_) if invocation_type == InvocationType::DryRun => {
            Ok(empty(StatusCode::NO_CONTENT, request_id))
        }
        Admission::Slot(slot) => {
            let fault = state.draw_fault();
            if fault == Some(Fault::ServiceError) {
                state.stats.service_error();
                return Err(aws_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "ServiceException",
                    "Service",
                    "The AWS Lambda service encountered an internal error (injected fault).",
                    request_id,
                ));
            }
            if fault == Some(Fault::Throttle) {
                state.stats.throttle();
                return Err(throttle(
                    "ReservedFunctionConcurrentInvocationLimitExceeded",
                    "Rate Exceeded. (injected fault)",
                    request_id,
                ));
            }
            let outcome = execute(&state.handler, &state.stats, &deployed, payload, fault).await;
            drop(slot);
            Ok(sync_reply(&deployed, outcome, tail, request_id))
        }
    }
}

/// What lets a request in: a share of the event queue for an Event invocation, a concurrency
/// slot for the others.
enum Admission {
    Queued(Reservation),
    Slot(OwnedSemaphorePermit),
}

/// Why a request body was not read whole.
#[derive(Debug)]
enum BodyError {
    /// Longer than the payload limit.
    TooLarge,
    /// Not received within the body-read timeout.
    TimedOut,
    Read(hyper::Error),
}

/// Reads a body of at most `limit` bytes within `timeout`. The buffer never holds more than
/// `limit` bytes: a frame that would take it past the limit ends the read instead.
async fn read_body(
    mut body: Incoming,
    limit: usize,
    expected: usize,
    timeout: Duration,
) -> Result<Bytes, BodyError> {
    let read = async {
        let mut buffer = BytesMut::with_capacity(expected.min(limit));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(BodyError::Read)?;
            if let Ok(data) = frame.into_data() {
                if data.len() > limit.saturating_sub(buffer.len()) {
                    return Err(BodyError::TooLarge);
                }
                buffer.extend_from_slice(&data);
            }
        }
        Ok(buffer.freeze())
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or(Err(BodyError::TimedOut))
}

/// Reads and drops a refused request's body, up to the payload limit and within the body-read
/// timeout, holding no more than one frame at a time. Without it the host would close the
/// connection with the body unread, the kernel would answer the client's data with a reset,
/// and the client could lose the refusal (and its `Retry-After`) before reading it.
async fn discard_body(mut body: Incoming, limit: usize, timeout: Duration) {
    let drain = async {
        let mut seen = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                seen = seen.saturating_add(data.len());
                if seen > limit {
                    return;
                }
            }
        }
    };
    let _ = tokio::time::timeout(timeout, drain).await;
}

fn service_error(message: &str, request_id: &str) -> Reply {
    aws_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "ServiceException",
        "Service",
        &format!("The local host could not take the invocation: {message}"),
        request_id,
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InvocationType {
    RequestResponse,
    Event,
    DryRun,
}

struct Outcome {
    result: Result<Vec<u8>, FunctionError>,
    duration: Duration,
    init: Option<Duration>,
}

async fn execute(
    handler: &Arc<Handler>,
    stats: &HostStats,
    f: &Deployed,
    payload: Bytes,
    fault: Option<Fault>,
) -> Outcome {
    stats.invocation();
    let init = if f.take_warm() {
        None
    } else {
        stats.cold_start();
        let started = Instant::now();
        if !f.config.cold_start.is_zero() {
            tokio::time::sleep(f.config.cold_start).await;
        }
        Some(started.elapsed())
    };
    let started = Instant::now();
    let run = async {
        if fault == Some(Fault::Timeout) {
            // Hang past the timeout, as a function stuck on a dead dependency would.
            tokio::time::sleep(f.config.timeout + Duration::from_secs(1)).await;
        }
        run_code(handler, &f.config.code, payload).await
    };
    let result = match tokio::time::timeout(f.config.timeout, run).await {
        Ok(result) => {
            f.return_warm();
            result
        }
        Err(_) => {
            // Lambda resets the environment after a timeout; it is not returned to the pool.
            stats.timeout();
            Err(FunctionError::new(
                "Sandbox.Timedout",
                format!(
                    "Task timed out after {:.2} seconds",
                    f.config.timeout.as_secs_f64()
                ),
            ))
        }
    };
    let result = match result {
        Ok(body) if body.len() > MAX_RESPONSE_PAYLOAD => Err(FunctionError::new(
            "Function.ResponseSizeTooLarge",
            format!(
                "Response payload size ({} bytes) exceeded maximum allowed payload size ({MAX_RESPONSE_PAYLOAD} bytes).",
                body.len()
            ),
        )),
        other => other,
    };
    if result.is_err() {
        stats.function_error();
    }
    Outcome {
        result,
        duration: started.elapsed(),
        init,
    }
}

async fn run_code(
    handler: &Arc<Handler>,
    code: &FunctionCode,
    payload: Bytes,
) -> Result<Vec<u8>, FunctionError> {
    match code {
        FunctionCode::Reward(RewardFunction::CodeTests) => {
            // Subprocesses and blocking waits: keep them off the async workers.
            let handler = handler.clone();
            tokio::task::spawn_blocking(move || handler.invoke(RewardFunction::CodeTests, &payload))
                .await
                .unwrap_or_else(|e| {
                    Err(FunctionError::new(
                        "Runtime.ExitError",
                        format!("function crashed: {e}"),
                    ))
                })
        }
        FunctionCode::Reward(f) => handler.invoke(*f, &payload),
        FunctionCode::Custom(f) => f(payload).await,
    }
}

fn sync_reply(f: &Deployed, outcome: Outcome, tail: bool, request_id: &str) -> Reply {
    let (status_header, body) = match outcome.result {
        Ok(body) => (None, body),
        Err(e) => (Some("Unhandled"), e.to_json()),
    };
    let mut reply = Response::new(Full::new(Bytes::from(body)));
    let h = reply.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(
        "x-amz-executed-version",
        HeaderValue::from_static("$LATEST"),
    );
    insert_request_id(h, request_id);
    if let Some(kind) = status_header {
        h.insert("x-amz-function-error", HeaderValue::from_static(kind));
    }
    if tail {
        let log = report_log(f, &outcome.duration, outcome.init, request_id);
        let encoded = base64::engine::general_purpose::STANDARD.encode(log);
        if let Ok(v) = HeaderValue::from_str(&encoded) {
            h.insert("x-amz-log-result", v);
        }
    }
    reply
}

/// The last lines of the function's log as Lambda writes them, `REPORT` line included.
/// Billed duration is rounded up to the millisecond, as Lambda bills since December 2020.
fn report_log(
    f: &Deployed,
    duration: &Duration,
    init: Option<Duration>,
    request_id: &str,
) -> String {
    let ms = duration.as_secs_f64() * 1000.0;
    let billed = ms.ceil().max(1.0) as u64;
    let mut report = format!(
        "START RequestId: {request_id} Version: $LATEST\nEND RequestId: {request_id}\nREPORT RequestId: {request_id}\tDuration: {ms:.2} ms\tBilled Duration: {billed} ms\tMemory Size: {} MB\tMax Memory Used: {} MB\t",
        f.config.memory_mb,
        f.config.memory_mb.min(64),
    );
    if let Some(init) = init {
        report.push_str(&format!(
            "Init Duration: {:.2} ms\t",
            init.as_secs_f64() * 1000.0
        ));
    }
    report.push('\n');
    report
}

/// A 429 `TooManyRequestsException`; `reason` is one of Lambda's `ThrottleReason` values.
fn throttle(reason: &str, message: &str, request_id: &str) -> Reply {
    let body = json!({
        "Reason": reason,
        "Type": "User",
        "message": message,
    });
    let mut reply = json_reply(StatusCode::TOO_MANY_REQUESTS, body, request_id);
    let h = reply.headers_mut();
    h.insert(
        "x-amzn-errortype",
        HeaderValue::from_static("TooManyRequestsException"),
    );
    h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
    reply
}

fn invalid_parameter(message: &str, request_id: &str) -> Reply {
    aws_error(
        StatusCode::BAD_REQUEST,
        "InvalidParameterValueException",
        "User",
        message,
        request_id,
    )
}

/// An API error as Lambda's REST-JSON protocol sends it: code in `X-Amzn-ErrorType`,
/// `{"Type", "message"}` in the body.
fn aws_error(
    status: StatusCode,
    code: &'static str,
    kind: &str,
    message: &str,
    request_id: &str,
) -> Reply {
    let mut reply = json_reply(
        status,
        json!({"Type": kind, "message": message}),
        request_id,
    );
    reply
        .headers_mut()
        .insert("x-amzn-errortype", HeaderValue::from_static(code));
    reply
}

fn json_reply(status: StatusCode, body: serde_json::Value, request_id: &str) -> Reply {
    let mut reply = Response::new(Full::new(Bytes::from(body.to_string())));
    *reply.status_mut() = status;
    let h = reply.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    insert_request_id(h, request_id);
    reply
}

fn empty(status: StatusCode, request_id: &str) -> Reply {
    let mut reply = Response::new(Full::new(Bytes::new()));
    *reply.status_mut() = status;
    insert_request_id(reply.headers_mut(), request_id);
    reply
}

fn insert_request_id(h: &mut hyper::HeaderMap, request_id: &str) {
    if let Ok(v) = HeaderValue::from_str(request_id) {
        h.insert("x-amzn-requestid", v);
    }
}

/// A random request id in UUID form, as Lambda's.
fn request_id() -> String {
    let a = fastrand::u128(..);
    let hex = format!("{a:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The function name and qualifier in any of the forms Lambda accepts: `name`, `name:qualifier`,
/// `account:function:name[:qualifier]`, `arn:aws:lambda:region:account:function:name[:qualifier]`.
fn split_function_name(name: &str) -> (&str, Option<&str>) {
    let rest = if let Some(arn) = name.strip_prefix("arn:") {
        // partition:lambda:region:account:function:name[:qualifier]
        arn.splitn(6, ':').nth(5).unwrap_or("")
    } else if let Some((_, after)) = name.split_once(":function:") {
        after
    } else {
        name
    };
    match rest.split_once(':') {
        Some((n, q)) => (n, Some(q)),
        None => (rest, None),
    }
}

/// Decodes `%XX` escapes; `None` for malformed escapes or non-UTF-8 results.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_documented_function_name_form_resolves_to_name_and_qualifier() {
        assert_eq!(split_function_name("math_answer"), ("math_answer", None));
        assert_eq!(
            split_function_name("math_answer:$LATEST"),
            ("math_answer", Some("$LATEST"))
        );
        assert_eq!(
            split_function_name("123456789012:function:math_answer"),
            ("math_answer", None)
        );
        assert_eq!(
            split_function_name("arn:aws:lambda:us-west-2:123456789012:function:math_answer:7"),
            ("math_answer", Some("7"))
        );
        assert_eq!(split_function_name("arn:broken"), ("", None));
    }

    #[test]
    fn percent_decoding_rejects_truncated_and_non_utf8_escapes() {
        assert_eq!(percent_decode("a%3Ab").as_deref(), Some("a:b"));
        assert_eq!(percent_decode("%24LATEST").as_deref(), Some("$LATEST"));
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("bad%zz"), None);
        assert_eq!(percent_decode("%ff"), None);
    }

    #[test]
    fn request_ids_have_the_uuid_shape() {
        let id = request_id();
        let lens: Vec<usize> = id.split('-').map(str::len).collect();
        assert_eq!(lens, vec![8, 4, 4, 4, 12]);
    }
}
