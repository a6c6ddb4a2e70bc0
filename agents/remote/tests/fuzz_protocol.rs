//! Seeded fuzzing of the remote environment protocol from the client's side: a fake environment
//! server answers every request with a mutated answer from the seed corpus
//! (`tests/fuzz-corpus/protocol/`: starts, steps, errors, a chunked answer) — flipped, inserted
//! and deleted bytes, truncation, hostile status lines and lengths, JSON values of the wrong type,
//! non-finite rewards, bad episode ids, bodies past the size limit. Each case starts an episode
//! and steps it. Every call must come back within its deadline as a step or as an error that
//! names the server (an infrastructure failure, retried elsewhere, or a refused request), and
//! never panic.
//!
//! `ROLLFLEET_FUZZ_CASES` (default 200) sets the number of seeds, `ROLLFLEET_FUZZ_SEED` runs one
//! seed alone: a failing case prints the command that reproduces it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may fail loudly

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rollfleet_environments::{EnvError, Environment};
use rollfleet_remote_env::{MAX_RESPONSE_BYTES, RemoteEnvironment};
use rollfleet_rng::SplitMix64;

/// The client's own deadline per call; a call that outlives it by far is a hang.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

fn corpus() -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus/protocol");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("the seed corpus exists")
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(p).unwrap())
        })
        .collect()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Replaces the body after the head, fixing `content-length` half of the time.
fn with_body(answer: &[u8], body: &[u8], rng: &mut SplitMix64) -> Vec<u8> {
    let end = find(answer, b"\r\n\r\n").map_or(answer.len(), |i| i + 4);
    let head = String::from_utf8_lossy(&answer[..end]).into_owned();
    let head = if rng.index(2) == 0 {
        head.lines()
            .map(|l| {
                if l.to_ascii_lowercase().starts_with("content-length:") {
                    format!("content-length: {}", body.len())
                } else {
                    l.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("\r\n")
    } else {
        head
    };
    let mut out = head.into_bytes();
    if !out.ends_with(b"\r\n\r\n") {
        out.extend_from_slice(b"\r\n\r\n");
    }
    out.extend_from_slice(body);
    out
}

/// One answer: a corpus entry, `preferred` three times in four, left honest two times in five
/// (so that many cases get past the start) and otherwise given 1 to 3 mutations.
fn mutate(rng: &mut SplitMix64, corpus: &[(String, Vec<u8>)], preferred: &str) -> Vec<u8> {
    let mut bytes = match corpus.iter().find(|(n, _)| n == preferred) {
        Some((_, b)) if rng.index(4) != 0 => b.clone(),
        _ => corpus[rng.index(corpus.len())].1.clone(),
    };
    if rng.index(5) < 2 {
        return bytes; // an honest answer now and then keeps episodes going
    }
    for _ in 0..1 + rng.index(3) {
        let len = bytes.len().max(1);
        match rng.index(9) {
            0 => {
                let i = rng.index(len).min(bytes.len().saturating_sub(1));
                if let Some(b) = bytes.get_mut(i) {
                    *b ^= 1 << rng.index(8);
                }
            }
            1 => {
                let i = rng.index(len + 1).min(bytes.len());
                let b = [b'"', b'{', b'}', b'\\', b',', 0, 0xff, b'\n'][rng.index(8)];
                bytes.insert(i, b);
            }
            2 => {
                let i = rng.index(len).min(bytes.len());
                let n = rng.index(16).min(bytes.len() - i);
                bytes.drain(i..i + n);
            }
            3 => bytes.truncate(rng.index(len)),
            4 => {
                let status = [
                    "HTTP/1.1 200 OK",
                    "HTTP/1.1 201 Created",
                    "HTTP/1.1 999 Odd",
                    "HTTP/1.1 429 Too Many Requests",
                    "HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:1/",
                    "HTTP/9.9 200 OK",
                    "garbage",
                    "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK",
                ][rng.index(8)];
                let end = find(&bytes, b"\r\n").unwrap_or(bytes.len());
                bytes.splice(..end, status.bytes());
            }
            5 => {
                let value = ["0", "-1", "99999999999999999999", "5, 6", "abc"][rng.index(5)];
                let header = format!("content-length: {value}\r\n");
                let at = find(&bytes, b"\r\n").map_or(0, |i| i + 2);
                bytes.splice(at..at, header.into_bytes());
            }
            6 => {
                let body: Vec<u8> = match rng.index(10) {
                    0 => br#"{"observation": "x", "reward": NaN, "done": false}"#.to_vec(),
                    1 => br#"{"observation": "x", "reward": 1e999, "done": false}"#.to_vec(),
                    2 => br#"{"observation": 7, "reward": "1", "done": "yes"}"#.to_vec(),
                    3 => br#"{"episode": "../../etc/passwd", "observation": ""}"#.to_vec(),
                    4 => br#"{"episode": "", "observation": "x"}"#.to_vec(),
                    5 => format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000)).into_bytes(),
                    6 => format!(
                        r#"{{"observation": "{}", "reward": 0, "done": false}}"#,
                        "a".repeat(MAX_RESPONSE_BYTES as usize + 10)
                    )
                    .into_bytes(),
                    7 => br#"{"error": {"code": 5}}"#.to_vec(),
                    8 => b"\xff\xfe\x00not json".to_vec(),
                    _ => br#"{"observation": "\ud800", "reward": -0.0, "done": true}"#.to_vec(),
                };
                bytes = with_body(&bytes, &body, rng);
            }
            7 => {
                let other = &corpus[rng.index(corpus.len())].1;
                let cut = rng.index(other.len().max(1)).min(other.len());
                bytes.extend_from_slice(&other[cut..]);
            }
            _ => {
                let i = rng.index(len).min(bytes.len());
                let n = rng.index(8).min(bytes.len() - i);
                for b in &mut bytes[i..i + n] {
                    *b = rng.next_u64() as u8;
                }
            }
        }
    }
    bytes
}

/// Reads one request (head and `content-length` body) from `stream`, or gives up.
fn read_request(stream: &mut TcpStream) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while let Ok(n) = stream.read(&mut chunk) {
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = find(&buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return;
            }
        }
    }
}

/// A server that answers each connection with the next queued answer (a `204` when none is
/// queued) and closes it.
fn fake_server(answers: Arc<Mutex<VecDeque<Vec<u8>>>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            read_request(&mut stream);
            let answer = answers.lock().unwrap().pop_front().unwrap_or_else(|| {
                b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n".to_vec()
            });
            let _ = stream.write_all(&answer);
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    });
    url
}

/// Checks one call's outcome: in time, and an error (if any) that names the server.
fn check<T>(
    what: &str,
    outcome: std::thread::Result<Result<T, EnvError>>,
    took: Duration,
    url: &str,
    case: &str,
) -> Option<T> {
    let Ok(result) = outcome else {
        panic!("{case}: {what} panicked");
    };
    assert!(
        took < CALL_TIMEOUT * 3,
        "{case}: {what} took {took:?} (the client's deadline is {CALL_TIMEOUT:?})"
    );
    match result {
        Ok(value) => Some(value),
        Err(EnvError::Unavailable(message) | EnvError::InvalidConfig(message)) => {
            assert!(
                message.contains(url),
                "{case}: {what} failed without naming the server: {message}"
            );
            None
        }
        Err(EnvError::NotRunning) => None,
    }
}

#[test]
fn mutated_environment_server_answers_give_an_error_naming_the_server_and_never_a_panic() {
    let seeds = rollfleet_rng::test_seeds("ROLLFLEET_FUZZ", 200);
    let corpus = corpus();
    assert!(
        corpus.len() >= 5,
        "the seed corpus has {} entries",
        corpus.len()
    );
    let answers = Arc::new(Mutex::new(VecDeque::new()));
    let url = fake_server(answers.clone());
    let started = Instant::now();
    let (mut started_ok, mut steps_ok, mut refused) = (0, 0, 0);
    for &seed in &seeds {
        let case = format!(
            "case {seed} (reproduce with: ROLLFLEET_FUZZ_SEED={seed} cargo test -p \
             rollfleet-remote-env --test fuzz_protocol)"
        );
        let mut rng = SplitMix64::new(seed);
        {
            let mut queue = answers.lock().unwrap();
            queue.clear();
            queue.push_back(mutate(&mut rng, &corpus, "start"));
            for _ in 0..3 {
                queue.push_back(mutate(&mut rng, &corpus, "step"));
            }
        }
        let mut env = RemoteEnvironment::new(&url, "guess", CALL_TIMEOUT);
        let t = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| env.reset(seed)));
        let Some(_) = check("start", outcome, t.elapsed(), &url, &case) else {
            refused += 1;
            continue;
        };
        started_ok += 1;
        for _ in 0..3 {
            let t = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| env.step("50")));
            match check("step", outcome, t.elapsed(), &url, &case) {
                Some(step) => {
                    assert!(step.reward.is_finite(), "{case}: reward {}", step.reward);
                    steps_ok += 1;
                    if step.done {
                        break;
                    }
                }
                None => {
                    refused += 1;
                    break;
                }
            }
        }
    }
    eprintln!(
        "{} cases in {:?}: {started_ok} episodes started, {steps_ok} steps taken, {refused} \
         answers refused",
        seeds.len(),
        started.elapsed()
    );
    if seeds.len() >= 50 {
        // A mutator that breaks every start reaches none of the step handling.
        assert!(
            started_ok * 5 >= seeds.len() && steps_ok > 0,
            "only {started_ok} of {} episodes started, {steps_ok} steps",
            seeds.len()
        );
    }
}
