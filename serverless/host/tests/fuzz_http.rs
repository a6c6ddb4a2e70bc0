//! Seeded fuzzing of the local Lambda host's HTTP request handling: every case takes a request
//! from the seed corpus (`tests/fuzz-corpus/http/`), mutates it (flipped, inserted, deleted and
//! duplicated bytes, truncation, an oversized header, a hostile `Content-Length`, chunked
//! garbage, two requests spliced) and sends it over real TCP to a running host. The host must
//! answer with an HTTP response or close the connection within a deadline; it must never panic
//! (a panic hook counts panics on any thread) and must still serve an honest request afterwards.
//!
//! `ROLLFLEET_FUZZ_CASES` (default 300) sets the number of seeds, `ROLLFLEET_FUZZ_SEED` runs one
//! seed alone: a failing case prints the command that reproduces it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may fail loudly

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rollfleet_lambda_host::{FunctionCode, FunctionConfig, HostConfig, LocalHost};
use rollfleet_rng::SplitMix64;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Long enough for anything the host is expected to do; reaching it means a hang.
const DEADLINE: Duration = Duration::from_secs(5);

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn corpus() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus/http");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("the seed corpus exists")
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// One mutated request: 1 to 4 mutations of one corpus entry.
fn mutate(rng: &mut SplitMix64, corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = corpus[rng.index(corpus.len())].clone();
    for _ in 0..1 + rng.index(4) {
        let len = bytes.len().max(1);
        match rng.index(10) {
            0 => {
                let i = rng.index(len);
                if let Some(b) = bytes.get_mut(i) {
                    *b ^= 1 << rng.index(8);
                }
            }
            1 => {
                let i = rng.index(len + 1).min(bytes.len());
                let b = *[b'\r', b'\n', b':', b' ', 0, 0xff, b'0', b'9']
                    .get(rng.index(8))
                    .unwrap();
                bytes.insert(i, b);
            }
            2 => {
                let i = rng.index(len).min(bytes.len());
                let n = rng.index(16).min(bytes.len() - i);
                bytes.drain(i..i + n);
            }
            3 => {
                let i = rng.index(len).min(bytes.len());
                let n = rng.index(64).min(bytes.len() - i);
                let copy = bytes[i..i + n].to_vec();
                let at = rng.index(bytes.len() + 1);
                bytes.splice(at..at, copy);
            }
            4 => bytes.truncate(rng.index(len)),
            5 => {
                // An oversized header, past the host's connection buffer.
                let n = [100, 8_000, 70_000, 500_000][rng.index(4)];
                let header = format!("x-big: {}\r\n", "a".repeat(n));
                let at = find(&bytes, b"\r\n").map_or(0, |i| i + 2);
                bytes.splice(at..at, header.into_bytes());
            }
            6 => {
                let value = [
                    "-1",
                    "0",
                    "99999999999999999999999",
                    "4294967296",
                    "1, 2",
                    " 7 ",
                    "0x10",
                    "",
                ][rng.index(8)];
                let header = format!("content-length: {value}\r\n");
                let at = find(&bytes, b"\r\n").map_or(0, |i| i + 2);
                bytes.splice(at..at, header.into_bytes());
            }
            7 => {
                let garbage = [
                    "transfer-encoding: chunked\r\n\r\nfffffffffffffffffffff\r\n",
                    "transfer-encoding: chunked\r\n\r\n3;ext=\"\r\nab\r\n0\r\n",
                    "transfer-encoding: gzip, chunked\r\n\r\n-1\r\n\r\n",
                    "transfer-encoding: chunked\r\n\r\n10000000\r\nabc",
                ][rng.index(4)];
                let at = find(&bytes, b"\r\n\r\n").unwrap_or(bytes.len());
                bytes.truncate(at + 2.min(bytes.len() - at));
                bytes.extend_from_slice(garbage.as_bytes());
            }
            8 => {
                let other = &corpus[rng.index(corpus.len())];
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

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Sends `request`, half-closes (as a client that has nothing more to say), and reads until
/// the host closes. `None` is a hang.
async fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> Option<Vec<u8>> {
    let mut stream = TcpStream::connect(addr).await.expect("the host accepts");
    tokio::time::timeout(DEADLINE, async {
        // The host may close before reading everything (an oversized head): not our concern.
        let _ = stream.write_all(request).await;
        let _ = stream.shutdown().await;
        let mut reply = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return reply,
                Ok(n) => reply.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .ok()
}

async fn start() -> LocalHost {
    let mut config = HostConfig::empty();
    let echo = FunctionCode::Custom(Arc::new(|payload: bytes::Bytes| {
        Box::pin(async move { Ok(payload.to_vec()) })
    }));
    config.add("echo", FunctionConfig::new(echo));
    config.header_read_timeout = Duration::from_millis(500);
    config.body_read_timeout = Duration::from_millis(500);
    LocalHost::start(([127, 0, 0, 1], 0).into(), config)
        .await
        .expect("the host starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_and_truncated_http_requests_get_an_answer_or_a_close_and_never_a_panic() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let seeds = rollfleet_rng::test_seeds("ROLLFLEET_FUZZ", 300);
    let corpus = corpus();
    assert!(
        corpus.len() >= 5,
        "the seed corpus has {} entries",
        corpus.len()
    );
    let host = start().await;
    let started = Instant::now();
    let (mut answered, mut closed) = (0, 0);
    for &seed in &seeds {
        let reproduce = format!(
            "reproduce with: ROLLFLEET_FUZZ_SEED={seed} cargo test -p rollfleet-lambda-host \
             --test fuzz_http"
        );
        let request = mutate(&mut SplitMix64::new(seed), &corpus);
        let Some(reply) = exchange(host.addr(), &request).await else {
            panic!(
                "case {seed}: the host neither answered nor closed within {DEADLINE:?}; {reproduce}"
            );
        };
        if reply.is_empty() {
            closed += 1;
        } else {
            assert!(
                reply.starts_with(b"HTTP/1."),
                "case {seed}: the host answered something that is not HTTP: {:?}; {reproduce}",
                String::from_utf8_lossy(&reply[..reply.len().min(200)])
            );
            answered += 1;
        }
        assert_eq!(
            PANICS.load(Ordering::SeqCst),
            0,
            "case {seed}: the host panicked; {reproduce}"
        );
    }
    // An honest request still works after all that.
    let honest = corpus
        .iter()
        .find(|r| r.starts_with(b"POST") && find(r, b"RequestResponse").is_some())
        .expect("the corpus has a synchronous invocation");
    // Sent without the half-close: hyper drops a connection whose client half-closed before
    // the answer is written, which a function slower than the EOF would lose.
    let mut honest = honest.clone();
    let at = find(&honest, b"\r\n").unwrap() + 2;
    honest.splice(at..at, b"connection: close\r\n".iter().copied());
    let mut stream = TcpStream::connect(host.addr()).await.unwrap();
    stream.write_all(&honest).await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut reply))
        .await
        .expect("an answer in time")
        .unwrap();
    assert!(
        reply.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&reply)
    );
    eprintln!(
        "{} cases in {:?}: {answered} answered, {closed} closed without an answer",
        seeds.len(),
        started.elapsed()
    );
    if seeds.len() >= 50 {
        // A mutator whose every request is refused before routing tests only hyper.
        assert!(
            answered * 2 >= seeds.len(),
            "only {answered} of {} answered",
            seeds.len()
        );
    }
    host.shutdown().await.expect("the host stops");
}
