//! The host's limits, checked against the real host on loopback over real TCP with hand-written
//! HTTP/1.1, so that each request is exactly what a misbehaving client would send: payload
//! limits per invocation type, the bounded event queue (size, bytes, maximum age), synchronous
//! concurrency, and connection hygiene (header, body and idle timeouts, the connection cap).
//!
//! Timeouts are configured short and asserted against generous deadlines: these check that the
//! host lets go of a client, not how fast.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rollfleet_lambda_host::{
    FunctionCode, FunctionConfig, HostConfig, HostStatsSnapshot, LocalHost, MAX_EVENT_PAYLOAD,
    MAX_SYNC_PAYLOAD,
};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Long enough for anything the host is expected to do; reaching it means a client was left
/// hanging.
const DEADLINE: Duration = Duration::from_secs(5);

/// A custom function that sleeps, then answers a reward of 1.
fn sleeper(delay: Duration) -> FunctionCode {
    FunctionCode::Custom(Arc::new(move |_payload| {
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            Ok(br#"{"reward": 1.0}"#.to_vec())
        })
    }))
}

/// A host serving `fast` (answers at once) and `slow` (sleeps `delay`, with `slow_slots`
/// reserved concurrency), after `tweak` has set its limits.
async fn start(
    delay: Duration,
    slow_slots: Option<u32>,
    tweak: impl FnOnce(&mut HostConfig),
) -> LocalHost {
    let mut config = HostConfig::empty();
    config.add("fast", FunctionConfig::new(sleeper(Duration::ZERO)));
    config.add(
        "slow",
        FunctionConfig::new(sleeper(delay)).reserved_concurrency(slow_slots),
    );
    tweak(&mut config);
    LocalHost::start(([127, 0, 0, 1], 0).into(), config)
        .await
        .expect("the host starts")
}

fn stats(host: &LocalHost) -> HostStatsSnapshot {
    host.stats().snapshot()
}

/// Polls the host's counters until `done` holds, failing the test after [`DEADLINE`].
async fn wait_for(host: &LocalHost, what: &str, done: impl Fn(&HostStatsSnapshot) -> bool) {
    let started = Instant::now();
    loop {
        let now = stats(host);
        if done(&now) {
            return;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{what} never happened: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The head of an Invoke request with a `Content-Length`.
fn head(function: &str, invocation_type: &str, length: usize, close: bool) -> String {
    format!(
        "POST /2015-03-31/functions/{function}/invocations HTTP/1.1\r\nhost: localhost\r\nx-amz-invocation-type: {invocation_type}\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n{}\r\n",
        if close { "connection: close\r\n" } else { "" }
    )
}

/// A JSON object of exactly `len` bytes (at least 8).
fn json_of_len(len: usize) -> Vec<u8> {
    format!(r#"{{"p":"{}"}}"#, "a".repeat(len - 8)).into_bytes()
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// Asserts a Lambda API error: status, `X-Amzn-ErrorType`, and `Type: User`.
    fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.header("x-amzn-errortype"), Some(code), "{self:?}");
        assert_eq!(self.json()["Type"], "User", "{self:?}");
    }

    fn message(&self) -> String {
        self.json()["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

fn parse(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete response: {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// Reads until the host closes the connection, within [`DEADLINE`].
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut raw = Vec::new();
    match tokio::time::timeout(DEADLINE, stream.read_to_end(&mut raw)).await {
        Ok(Ok(_)) => raw,
        // A reset also means the host let go of the connection.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => raw,
        Ok(Err(e)) => panic!("reading the reply failed: {e}"),
        Err(_) => panic!("the host kept the connection open past {DEADLINE:?}"),
    }
}

/// Reads one response (with a `Content-Length`, as the host sends them) and leaves the
/// connection open, within [`DEADLINE`].
async fn read_response(stream: &mut TcpStream) -> Reply {
    let mut raw = Vec::new();
    let read = async {
        loop {
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                let reply = parse(&raw[..end + 4]);
                let length: usize = reply
                    .header("content-length")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                if raw.len() >= end + 4 + length {
                    return parse(&raw[..end + 4 + length]);
                }
            }
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await.expect("read the reply");
            assert!(n > 0, "the host closed the connection mid-reply");
            raw.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(DEADLINE, read)
        .await
        .expect("the host answered in time")
}

/// Sends `request` on a new connection and reads the reply (the request should ask the host
/// to close the connection after it).
async fn exchange(addr: SocketAddr, request: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("send");
    parse(&read_until_closed(&mut stream).await)
}

async fn invoke(addr: SocketAddr, function: &str, invocation_type: &str, body: &[u8]) -> Reply {
    let mut request = head(function, invocation_type, body.len(), true).into_bytes();
    request.extend_from_slice(body);
    exchange(addr, &request).await
}

/// Streams `total` bytes as a chunked body (no `Content-Length` to refuse early) and stops
/// right after the last byte, so that every byte sent has been read when the host answers.
async fn invoke_chunked(addr: SocketAddr, invocation_type: &str, total: usize) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /2015-03-31/functions/fast/invocations HTTP/1.1\r\nhost: localhost\r\nx-amz-invocation-type: {invocation_type}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("send head");
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0;
    while sent < total {
        let n = chunk.len().min(total - sent);
        let mut frame = format!("{n:x}\r\n").into_bytes();
        frame.extend_from_slice(&chunk[..n]);
        sent += n;
        if sent < total {
            frame.extend_from_slice(b"\r\n");
        }
        if stream.write_all(&frame).await.is_err() {
            break;
        }
    }
    parse(&read_until_closed(&mut stream).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_invocation_over_the_async_payload_limit_is_refused_413_naming_the_limit() {
    let host = start(Duration::ZERO, None, |_| {}).await;
    // Declared too large: refused from the head alone.
    let declared = exchange(
        host.addr(),
        head("fast", "Event", MAX_EVENT_PAYLOAD + 1, true).as_bytes(),
    )
    .await;
    declared.assert_error(413, "RequestTooLargeException");
    // Not declared: refused while reading, once the body passes the limit.
    let streamed = invoke_chunked(host.addr(), "Event", MAX_EVENT_PAYLOAD + 1).await;
    streamed.assert_error(413, "RequestTooLargeException");
    for reply in [&declared, &streamed] {
        assert!(
            reply
                .message()
                .contains("Event (asynchronous) payload limit is 1048576 bytes"),
            "{reply:?}"
        );
    }
    let now = stats(&host);
    assert_eq!(now.payloads_too_large, 2, "{now:?}");
    assert_eq!(now.events_queued, 0, "{now:?}");
    assert_eq!(
        now.event_queue_bytes, 0,
        "a refused body still holds queue room: {now:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_response_invocation_over_the_sync_payload_limit_is_refused_413_naming_the_limit()
{
    let host = start(Duration::ZERO, None, |_| {}).await;
    let declared = exchange(
        host.addr(),
        head("fast", "RequestResponse", MAX_SYNC_PAYLOAD + 1, true).as_bytes(),
    )
    .await;
    declared.assert_error(413, "RequestTooLargeException");
    let streamed = invoke_chunked(host.addr(), "RequestResponse", MAX_SYNC_PAYLOAD + 1).await;
    streamed.assert_error(413, "RequestTooLargeException");
    for reply in [&declared, &streamed] {
        assert!(
            reply
                .message()
                .contains("RequestResponse (synchronous) payload limit is 6291456 bytes"),
            "{reply:?}"
        );
    }
    assert_eq!(stats(&host).payloads_too_large, 2);
    assert_eq!(stats(&host).invocations, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_just_under_and_exactly_at_each_payload_limit_are_accepted() {
    let host = start(Duration::ZERO, None, |_| {}).await;
    for len in [MAX_EVENT_PAYLOAD - 1, MAX_EVENT_PAYLOAD] {
        let reply = invoke(host.addr(), "fast", "Event", &json_of_len(len)).await;
        assert_eq!(reply.status, 202, "{len}: {reply:?}");
    }
    for len in [MAX_SYNC_PAYLOAD - 1, MAX_SYNC_PAYLOAD] {
        let reply = invoke(host.addr(), "fast", "RequestResponse", &json_of_len(len)).await;
        assert_eq!(reply.status, 200, "{len}: {reply:?}");
        assert_eq!(reply.json()["reward"], 1.0);
    }
    wait_for(&host, "both events running", |s| s.events_completed == 2).await;
    assert_eq!(stats(&host).payloads_too_large, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_event_queue_is_full_further_events_are_refused_429_and_the_queue_does_not_grow() {
    let host = start(Duration::from_secs(1), Some(1), |c| {
        c.event_queue_events = 2
    })
    .await;
    let payload = json_of_len(10_000);
    // The first event takes the only slot and leaves the queue...
    assert_eq!(
        invoke(host.addr(), "slow", "Event", &payload).await.status,
        202
    );
    wait_for(&host, "the first event running", |s| s.invocations == 1).await;
    // ...two more fill it...
    for _ in 0..2 {
        assert_eq!(
            invoke(host.addr(), "slow", "Event", &payload).await.status,
            202
        );
    }
    // ...and every further one is refused, not queued, the largest allowed included.
    for i in 0..20 {
        let body = if i == 0 {
            json_of_len(MAX_EVENT_PAYLOAD)
        } else {
            payload.clone()
        };
        let reply = invoke(host.addr(), "slow", "Event", &body).await;
        reply.assert_error(429, "TooManyRequestsException");
        assert_eq!(reply.header("retry-after"), Some("1"));
        assert!(
            reply.message().contains("the limit is 2 events"),
            "{reply:?}"
        );
    }
    let now = stats(&host);
    assert_eq!(now.events_queued, 3, "{now:?}");
    assert_eq!(now.events_refused, 20, "{now:?}");
    assert_eq!(now.throttles, 20, "{now:?}");
    assert!(now.event_queue_peak_events <= 2, "{now:?}");
    assert!(now.event_queue_peak_bytes <= 2 * 10_000, "{now:?}");

    // The queued events run, one at a time; the refused ones never do.
    wait_for(&host, "the queued events running", |s| {
        s.events_completed == 3
    })
    .await;
    let now = stats(&host);
    assert_eq!(now.invocations, 3, "{now:?}");
    assert_eq!(
        (now.event_queue_events, now.event_queue_bytes),
        (0, 0),
        "{now:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_queue_out_of_payload_bytes_refuses_the_next_event_with_429() {
    let host = start(Duration::from_secs(1), Some(1), |c| {
        c.event_queue_bytes = 100_000
    })
    .await;
    let payload = json_of_len(40_000);
    assert_eq!(
        invoke(host.addr(), "slow", "Event", &payload).await.status,
        202
    );
    wait_for(&host, "the first event running", |s| s.invocations == 1).await;
    for _ in 0..2 {
        assert_eq!(
            invoke(host.addr(), "slow", "Event", &payload).await.status,
            202
        );
    }
    let reply = invoke(host.addr(), "slow", "Event", &payload).await;
    reply.assert_error(429, "TooManyRequestsException");
    assert!(
        reply.message().contains("the limit of 100000 bytes"),
        "{reply:?}"
    );
    let now = stats(&host);
    assert_eq!((now.events_queued, now.events_refused), (3, 1), "{now:?}");
    assert!(now.event_queue_peak_bytes <= 100_000, "{now:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_events_older_than_the_maximum_age_are_discarded_without_running() {
    let host = start(Duration::from_secs(1), Some(1), |c| {
        c.event_max_age = Duration::from_millis(200);
    })
    .await;
    assert_eq!(
        invoke(host.addr(), "slow", "Event", b"{}").await.status,
        202
    );
    wait_for(&host, "the first event running", |s| s.invocations == 1).await;
    // Waits behind the first, which runs for longer than the maximum age.
    assert_eq!(
        invoke(host.addr(), "slow", "Event", b"{}").await.status,
        202
    );
    wait_for(&host, "the second event expiring", |s| {
        s.events_expired == 1
    })
    .await;
    wait_for(&host, "the first event finishing", |s| {
        s.events_completed == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let now = stats(&host);
    assert_eq!(now.invocations, 1, "an expired event ran: {now:?}");
    assert_eq!(now.event_queue_events, 0, "{now:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_invocations_beyond_the_concurrency_limit_are_refused_429() {
    // `slow` has no reserved concurrency: the host's per-function limit applies.
    let host = start(Duration::from_secs(1), None, |c| {
        c.concurrency_per_function = 2
    })
    .await;
    let addr = host.addr();
    let running: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { invoke(addr, "slow", "RequestResponse", b"{}").await }))
        .collect();
    wait_for(&host, "two invocations running", |s| s.invocations == 2).await;
    // On a kept-alive connection and with a large body, as a retrying client would send it.
    let mut client = TcpStream::connect(addr).await.expect("connect");
    let body = json_of_len(1 << 20);
    let mut request = head("slow", "RequestResponse", body.len(), false).into_bytes();
    request.extend_from_slice(&body);
    client.write_all(&request).await.expect("send");
    let reply = read_response(&mut client).await;
    reply.assert_error(429, "TooManyRequestsException");
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(reply.json()["Reason"], "ConcurrentInvocationLimitExceeded");
    assert!(
        reply
            .message()
            .contains("concurrency limit of 2 concurrent invocations"),
        "{reply:?}"
    );
    for task in running {
        assert_eq!(task.await.expect("task").status, 200);
    }
    // The slots are free again, and the refused body was read and dropped, so the retry can
    // use the same connection.
    let mut retry = head("slow", "RequestResponse", 2, true).into_bytes();
    retry.extend_from_slice(b"{}");
    client.write_all(&retry).await.expect("send the retry");
    let reply = parse(&read_until_closed(&mut client).await);
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(stats(&host).throttles, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_halfway_through_a_request_head_is_disconnected_within_the_header_timeout()
 {
    let host = start(Duration::ZERO, None, |c| {
        c.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    let mut stream = TcpStream::connect(host.addr()).await.expect("connect");
    stream
        .write_all(b"POST /2015-03-31/functions/fast/invocations HTTP/1.1\r\nhost: loc")
        .await
        .expect("send");
    let raw = read_until_closed(&mut stream).await;
    assert!(
        !String::from_utf8_lossy(&raw).starts_with("HTTP/1.1 200"),
        "a half request was served"
    );
    wait_for(&host, "the timeout counted", |s| {
        s.header_read_timeouts == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_the_header_timeout() {
    let host = start(Duration::ZERO, None, |c| {
        c.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    let mut stream = TcpStream::connect(host.addr()).await.expect("connect");
    let mut request = head("fast", "RequestResponse", 2, false).into_bytes();
    request.extend_from_slice(b"{}");
    stream.write_all(&request).await.expect("send");
    // The host answers, then closes the connection once it has been idle for the timeout.
    let reply = parse(&read_until_closed(&mut stream).await);
    assert_eq!(reply.status, 200, "{reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_running_longer_than_the_header_timeout_still_answers() {
    let host = start(Duration::from_millis(900), None, |c| {
        c.header_read_timeout = Duration::from_millis(200);
    })
    .await;
    let reply = invoke(host.addr(), "slow", "RequestResponse", b"{}").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["reward"], 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_is_answered_408_within_the_body_timeout() {
    let host = start(Duration::ZERO, None, |c| {
        c.body_read_timeout = Duration::from_millis(300);
    })
    .await;
    let mut stream = TcpStream::connect(host.addr()).await.expect("connect");
    let mut request = head("fast", "RequestResponse", 100, true).into_bytes();
    request.extend_from_slice(br#"{"p":"#);
    stream.write_all(&request).await.expect("send");
    let reply = parse(&read_until_closed(&mut stream).await);
    reply.assert_error(408, "RequestTimeoutException");
    assert!(reply.message().contains("300 ms"), "{reply:?}");
    let now = stats(&host);
    assert_eq!((now.body_read_timeouts, now.invocations), (1, 0), "{now:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_unserved_until_a_slot_frees() {
    let host = start(Duration::ZERO, None, |c| {
        c.max_connections = 2;
        c.header_read_timeout = Duration::from_secs(30);
    })
    .await;
    // Two silent clients take both connection slots (connections are accepted in order).
    let first = TcpStream::connect(host.addr()).await.expect("connect");
    let _second = TcpStream::connect(host.addr()).await.expect("connect");

    // A third client's connection completes in the backlog, but nothing serves its request.
    let mut third = TcpStream::connect(host.addr()).await.expect("connect");
    let mut request = head("fast", "RequestResponse", 2, true).into_bytes();
    request.extend_from_slice(b"{}");
    third.write_all(&request).await.expect("send");
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(700), third.read(&mut byte)).await;
    assert!(
        early.is_err(),
        "a connection beyond the cap was served: {early:?}"
    );

    // Once a slot frees, it is served.
    drop(first);
    let reply = parse(&read_until_closed(&mut third).await);
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(stats(&host).connection_cap_waits >= 1);
}
