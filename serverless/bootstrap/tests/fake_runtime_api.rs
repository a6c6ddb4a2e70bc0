//! The real `bootstrap` binary against a small fake of the Lambda Runtime API on loopback: it
//! must fetch events, post results to `/response`, function errors to `/error` with the error
//! type header, and report an unknown handler to `/init/error` before exiting.

// Test helpers outside #[test] functions panic on setup failures too; clippy.toml's
// allow-unwrap-in-tests does not reach them.
#![allow(clippy::unwrap_used)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A request the fake received.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

#[derive(Default)]
struct Fake {
    events: Mutex<VecDeque<(String, String)>>,
    seen: Mutex<Vec<Seen>>,
}

fn start_fake(events: &[(&str, &str)]) -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    fake.events
        .lock()
        .unwrap()
        .extend(events.iter().map(|(id, e)| (id.to_string(), e.to_string())));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let shared = fake.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let fake = shared.clone();
            std::thread::spawn(move || serve_connection(stream, &fake));
        }
    });
    (addr, fake)
}

fn serve_connection(stream: TcpStream, fake: &Fake) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or("").to_owned();
        let path = parts.next().unwrap_or("").to_owned();
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_lowercase(), v.trim().to_owned()));
            }
        }
        let len = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok())
            .unwrap_or(0);
        let mut body = vec![0; len];
        reader.read_exact(&mut body).unwrap();
        fake.seen.lock().unwrap().push(Seen {
            method: method.clone(),
            path: path.clone(),
            headers,
            body,
        });
        let reply = if path.ends_with("/invocation/next") {
            match fake.events.lock().unwrap().pop_front() {
                Some((id, event)) => format!(
                    "HTTP/1.1 200 OK\r\nlambda-runtime-aws-request-id: {id}\r\nlambda-runtime-deadline-ms: 0\r\ncontent-length: {}\r\n\r\n{event}",
                    event.len()
                ),
                // No more events: fail `next`, so the runtime gives up and exits.
                None => {
                    "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n".to_owned()
                }
            }
        } else {
            "HTTP/1.1 202 Accepted\r\ncontent-length: 16\r\n\r\n{\"status\":\"OK\"}\n".to_owned()
        };
        if out.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

fn run_bootstrap(api: &str, handler: &str) -> std::process::ExitStatus {
    let mut child = Command::new(env!("CARGO_BIN_EXE_bootstrap"))
        .env("AWS_LAMBDA_RUNTIME_API", api)
        .env("_HANDLER", handler)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("bootstrap did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bootstrap_answers_each_event_on_the_runtime_api_and_reports_function_errors() {
    let (api, fake) = start_fake(&[
        (
            "req-1",
            r#"{"response":"\\boxed{1/2}","reference":"0.5","idempotency_key":"t#0"}"#,
        ),
        ("req-2", r#"{"nonsense":true}"#),
        ("req-3", r#"{"response":"7","reference":"8"}"#),
    ]);
    let status = run_bootstrap(&api, "math_answer");
    assert!(
        !status.success(),
        "exits once the Runtime API keeps failing"
    );

    let seen = fake.seen.lock().unwrap().clone();
    let posts: Vec<&Seen> = seen.iter().filter(|s| s.method == "POST").collect();
    assert_eq!(posts.len(), 3, "{seen:?}");

    assert_eq!(
        posts[0].path,
        "/2018-06-01/runtime/invocation/req-1/response"
    );
    let ok: Value = serde_json::from_slice(&posts[0].body).unwrap();
    assert_eq!(ok["reward"], 1.0);
    assert_eq!(ok["idempotency_key"], "t#0");

    assert_eq!(posts[1].path, "/2018-06-01/runtime/invocation/req-2/error");
    let err: Value = serde_json::from_slice(&posts[1].body).unwrap();
    assert_eq!(err["errorType"], "InvalidPayload");
    assert!(
        posts[1]
            .headers
            .iter()
            .any(|(k, v)| k == "lambda-runtime-function-error-type" && v == "InvalidPayload")
    );

    assert_eq!(
        posts[2].path,
        "/2018-06-01/runtime/invocation/req-3/response"
    );
    let zero: Value = serde_json::from_slice(&posts[2].body).unwrap();
    assert_eq!(zero["reward"], 0.0);
}

#[test]
fn an_unknown_handler_is_reported_as_an_init_error() {
    let (api, fake) = start_fake(&[]);
    let status = run_bootstrap(&api, "no_such_reward");
    assert!(!status.success());
    let seen = fake.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].path, "/2018-06-01/runtime/init/error");
    let err: Value = serde_json::from_slice(&seen[0].body).unwrap();
    assert_eq!(err["errorType"], "Runtime.InvalidEntrypoint");
}

#[test]
fn a_malformed_request_id_from_the_runtime_api_is_not_used_in_a_url() {
    let (api, fake) = start_fake(&[("../../evil", r#"{"response":"a","reference":"a"}"#)]);
    let status = run_bootstrap(&api, "exact_match");
    assert!(!status.success());
    let seen = fake.seen.lock().unwrap().clone();
    assert!(seen.iter().all(|s| s.method == "GET"), "{seen:?}");
}
