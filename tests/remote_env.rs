//! The remote environment protocol against a real server in another process and language: the
//! Python reference server in `examples/remote-env/server.py`, killed with SIGKILL mid-episode,
//! and a hostile server that answers garbage.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rollfleet_agent::{BytesPerToken, Limits, Policy, PolicyError, PromptTemplate, run_episode};
use rollfleet_environments::{EnvError, Environment};
use rollfleet_remote_env::RemoteEnvironment;

struct PythonServer {
    child: Child,
    url: String,
}

impl PythonServer {
    fn start() -> PythonServer {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/remote-env/server.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args(["--port", "0", "--slots", "4"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 must be installed");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap()
            .to_owned();
        PythonServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for PythonServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Guesses by bisection, reading "go higher" / "go lower" from the last observation.
struct Bisect {
    low: u32,
    high: u32,
    last: Option<u32>,
}

impl Policy for Bisect {
    fn act(&mut self, context: &str, _: u32) -> Result<(String, u64), PolicyError> {
        if let Some(last) = self.last {
            let tail = &context[context.rfind("is wrong").unwrap_or(0)..];
            if tail.contains("go higher") {
                self.low = last + 1;
            } else if tail.contains("go lower") {
                self.high = last - 1;
            }
        }
        let guess = (self.low + self.high) / 2;
        self.last = Some(guess);
        Ok((format!("<action>{guess}</action>"), 1))
    }
}

fn bisect() -> Bisect {
    Bisect {
        low: 1,
        high: 100,
        last: None,
    }
}

const LIMITS: Limits = Limits {
    max_turns: 7,
    context_limit: 8192,
};

#[test]
fn an_agent_solves_a_python_environment_through_the_protocol() {
    let server = PythonServer::start();
    let mut env = RemoteEnvironment::new(&server.url, "guess", Duration::from_secs(5));
    let health = env.health().unwrap();
    assert_eq!(health.environments, ["guess"]);
    let template = PromptTemplate::default();
    let mut turns = Vec::new();
    for seed in [1, 2, 3, 1] {
        let episode = run_episode(
            &mut env,
            &mut bisect(),
            seed,
            &template,
            LIMITS,
            &BytesPerToken,
        )
        .unwrap();
        assert_eq!(episode.transcript.total_reward(), 1.0, "seed {seed}");
        turns.push(episode.transcript.turns.len());
    }
    // Bisection finds any number in 1..=100 within 7 guesses, and the same seed hides the same
    // number, so it takes the same path.
    assert!(turns.iter().all(|t| *t <= 7));
    assert_eq!(turns[0], turns[3]);
}

#[test]
fn a_server_killed_mid_episode_is_an_infrastructure_failure_naming_it() {
    let mut server = PythonServer::start();
    let mut env = RemoteEnvironment::new(&server.url, "guess", Duration::from_secs(5));
    env.reset(9).unwrap();
    env.step("50").unwrap();
    server.child.kill().unwrap(); // SIGKILL
    server.child.wait().unwrap();
    match env.step("25") {
        Err(EnvError::Unavailable(message)) => {
            assert!(message.starts_with(&server.url), "{message}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn a_wrong_request_is_a_configuration_error_with_the_servers_reason() {
    let server = PythonServer::start();
    let mut env = RemoteEnvironment::new(&server.url, "chess", Duration::from_secs(5));
    match env.reset(1) {
        Err(EnvError::InvalidConfig(message)) => {
            assert!(
                message.contains("HTTP 404: unknown_environment: 'chess'"),
                "{message}"
            )
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn a_full_server_answers_429_which_is_retryable() {
    let server = PythonServer::start();
    let mut held = Vec::new();
    for seed in 0..4 {
        let mut env = RemoteEnvironment::new(&server.url, "guess", Duration::from_secs(5));
        env.reset(seed).unwrap();
        held.push(env);
    }
    let mut extra = RemoteEnvironment::new(&server.url, "guess", Duration::from_secs(5));
    match extra.reset(99) {
        Err(EnvError::Unavailable(message)) => assert!(message.contains("HTTP 429"), "{message}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// Serves `answers` (raw HTTP responses) one per connection, on a free loopback port.
fn hostile_server(answers: Vec<Vec<u8>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for answer in answers {
            let Ok((mut stream, _)) = listener.accept() else {
                return;
            };
            let mut buffer = [0u8; 4096];
            let _ = stream.read(&mut buffer);
            let _ = stream.write_all(&answer);
        }
    });
    url
}

#[test]
fn garbage_oversized_and_silent_answers_are_refused_without_a_panic() {
    let http = |status: &str, body: &[u8]| {
        let mut answer = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        answer.extend_from_slice(body);
        answer
    };
    let huge = vec![b'x'; 5 * 1024 * 1024];
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("not json", http("201 Created", b"<html>hello</html>")),
        (
            "bad episode id",
            http(
                "201 Created",
                br#"{"episode":"../../etc","observation":""}"#,
            ),
        ),
        ("oversized", http("201 Created", &huge)),
        ("not http", b"\x00\x01\x02garbage\r\n\r\n".to_vec()),
        ("server error", http("500 Internal Server Error", b"boom")),
    ];
    for (what, answer) in cases {
        let url = hostile_server(vec![answer]);
        let mut env = RemoteEnvironment::new(&url, "guess", Duration::from_secs(2));
        match env.reset(1) {
            Err(EnvError::Unavailable(message)) => {
                assert!(message.starts_with(&url), "{what}: {message}")
            }
            other => panic!("{what}: expected Unavailable, got {other:?}"),
        }
    }
    // A server that accepts the connection and never answers: the timeout ends the call.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut env = RemoteEnvironment::new(&url, "guess", Duration::from_millis(300));
    assert!(matches!(env.reset(1), Err(EnvError::Unavailable(_))));
    drop(listener);
}
