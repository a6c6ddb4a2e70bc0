//! Generation on an OpenAI-compatible engine across real processes, against a fake engine that
//! writes vLLM's wire format: the rendered turns sent, the text applied by the environment, and
//! an engine that refuses every request failing the job with its reason.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

// ---------------------------------------------------------------- a real (OpenAI-compatible) engine

/// What the fake engine answers at each turn (turn = assistant messages already in the prompt),
/// and the action the agent loop extracts from it. The last one repeats.
const ENGINE_ANSWERS: [(&str, &str); 5] = [
    ("I'll go down. <action>down</action>", "down"),
    ("<action>calc: 6 * 7</action>", "calc: 6 * 7"),
    ("I am not sure.", "I am not sure."),
    ("<action>answer: 42</action>", "answer: 42"),
    ("Right, then. <action>right</action>", "right"),
];

const CHATML_SYSTEM: &str = "<|im_start|>system\n";

/// Where the fake engine's answer pauses (never sent): after its first chunk.
const PAUSE: &str = "\u{0}pause\u{0}";

/// How long the fake engine takes from an answer's first chunk to the rest of it.
const DECODE_STRETCH: Duration = Duration::from_millis(20);
const CHATML_ASSISTANT: &str = "<|im_start|>assistant\n";

/// A deterministic engine speaking vLLM's OpenAI-compatible wire format, byte by byte, over plain
/// TCP: `GET /v1/models`, and `POST /v1/completions` streamed as server-sent events in chunked
/// transfer encoding (text chunks, a usage chunk, `[DONE]`). It records every completion request.
struct FakeEngine {
    url: String,
    requests: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
}

fn fake_engine() -> FakeEngine {
    fake_engine_answering(true)
}

/// vLLM's answer to a prompt longer than the model's context, which retrying cannot fix.
const VLLM_CONTEXT_ERROR: &str = r#"{"object":"error","message":"This model's maximum context length is 32768 tokens. However, you requested 40000 tokens. Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#;

/// The fake engine; when `completes` is false it refuses every completion with HTTP 400.
fn fake_engine_answering(completes: bool) -> FakeEngine {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let seen = seen.clone();
            std::thread::spawn(move || {
                // Keep-alive: answer requests on this connection until the client closes it.
                let mut data = Vec::new();
                let mut buf = [0u8; 8192];
                loop {
                    let head_end = loop {
                        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => data.extend_from_slice(&buf[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&data[..head_end]).to_string();
                    let length: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    while data.len() < head_end + length {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => data.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body: Value = serde_json::from_slice(&data[head_end..head_end + length])
                        .unwrap_or_default();
                    data.drain(..head_end + length);
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                    let answer = if path == "/v1/models" {
                        let body = r#"{"object":"list","data":[{"id":"fake-policy","object":"model","created":1,"owned_by":"vllm","root":"fake-policy","parent":null,"max_model_len":32768}]}"#;
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                    } else if path == "/v1/completions" && !completes {
                        seen.lock().unwrap().push(body);
                        format!(
                            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{VLLM_CONTEXT_ERROR}",
                            VLLM_CONTEXT_ERROR.len()
                        )
                    } else if path == "/v1/completions" {
                        let prompt = body["prompt"].as_str().unwrap_or("").to_owned();
                        seen.lock().unwrap().push(body);
                        let turn = prompt.matches(CHATML_ASSISTANT).count().saturating_sub(1);
                        let text = ENGINE_ANSWERS[turn.min(ENGINE_ANSWERS.len() - 1)].0;
                        let (a, b) = text.split_at(text.len() / 2);
                        let chunk = |text: &str, finish: Option<&str>| {
                            serde_json::json!({
                                "id": "cmpl-fake", "object": "text_completion", "created": 1,
                                "model": "fake-policy",
                                "choices": [{"index": 0, "text": text, "logprobs": null,
                                             "finish_reason": finish, "stop_reason": null}],
                                "usage": null
                            })
                            .to_string()
                        };
                        let usage = serde_json::json!({
                            "id": "cmpl-fake", "object": "text_completion", "created": 1,
                            "model": "fake-policy", "choices": [],
                            "usage": {"prompt_tokens": prompt.len().div_ceil(4),
                                      "completion_tokens": text.split_whitespace().count(),
                                      "total_tokens": 0}
                        })
                        .to_string();
                        let mut out = String::from(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n",
                        );
                        for data in [
                            chunk(a, None),
                            chunk(b, Some("stop")),
                            usage,
                            "[DONE]".into(),
                        ] {
                            let event = format!("data: {data}\n\n");
                            out.push_str(&format!("{:x}\r\n{event}\r\n", event.len()));
                            if out.matches(PAUSE).count() == 0 {
                                // The rest of the answer comes one decode stretch later.
                                out.push_str(PAUSE);
                            }
                        }
                        out.push_str("0\r\n\r\n");
                        out
                    } else {
                        let body = r#"{"object":"error","message":"Not Found","type":"NotFoundError","code":404}"#;
                        format!(
                            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                    };
                    for (i, part) in answer.split(PAUSE).enumerate() {
                        if i > 0 {
                            std::thread::sleep(DECODE_STRETCH);
                        }
                        if stream
                            .write_all(part.as_bytes())
                            .and_then(|()| stream.flush())
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            });
        }
    });
    FakeEngine { url, requests }
}

/// The environment kind whose task opens a prompt (its first user message).
fn task_kind(task: &str) -> &'static str {
    if task.starts_with("Convert ") {
        "calculator"
    } else if task.starts_with("Reach the goal") {
        "frozenlake"
    } else if task.starts_with("Push every box") {
        "sokoban"
    } else {
        panic!("not a task of the job's environments: {task:?}")
    }
}

#[test]
fn workers_with_an_openai_engine_send_the_rendered_turns_and_the_environment_applies_its_text() {
    let engine = fake_engine();
    let dir = temp_dir("openai");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    // Both generation pools drive the fake engine: one names the model, one asks /v1/models.
    for (pool, model) in [("prefill", Some("fake-policy")), ("decode", None)] {
        let mut cmd = Command::new(BIN);
        cmd.args(["worker", "--scheduler", &url, "--pool", pool])
            .args(["--name", &format!("{pool}-0")])
            .args(["--engine", "openai", "--engine-url", &engine.url]);
        if let Some(model) = model {
            cmd.args(["--model", model]);
        }
        procs.0.push(
            cmd.stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
    }
    for pool in ["train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    let report = check_report(&report, 2, 0);
    let generations = report["engine_generations"].as_u64().unwrap();
    assert!(generations >= 64, "{report:#}");
    assert_eq!(report["emulated_gpus"], false);
    // The engine's timings came back as decode samples, marked as measured on an engine (not
    // modelled), each under the hardware's peak.
    let decode = report["profiles"]["measured"]["decode"]
        .as_object()
        .unwrap();
    assert!(!decode.is_empty(), "no decode samples: {report:#}");
    for (pool, estimate) in decode {
        let samples = estimate["samples"].as_array().unwrap();
        assert!(!samples.is_empty(), "{pool}: {estimate}");
        assert_eq!(estimate["modelled"], 0, "{pool}: {estimate}");
        for share in samples {
            let share = share.as_f64().unwrap();
            assert!(share > 0.0 && share <= 1.0, "{pool}: {share}");
        }
    }
    for pool in report["pools"].as_array().unwrap() {
        if pool["pool"] == "prefill" || pool["pool"] == "decode" {
            assert!(pool["kind"].as_str().unwrap().contains("openai"), "{pool}");
        }
    }

    let requests = engine.requests.lock().unwrap().clone();
    assert!(requests.len() as u64 >= generations, "{}", requests.len());
    let (mut invalid_seen, mut applied_seen, mut deepest) = (0, 0, 0);
    for request in &requests {
        assert_eq!(request["model"], "fake-policy", "{request}");
        assert_eq!(request["stream"], true);
        assert!(request["max_tokens"].as_u64().unwrap() > 0);
        let prompt = request["prompt"].as_str().unwrap();
        // The agent's ChatML template: system, the task, then each turn's output and
        // observation, ending with the assistant marker.
        assert!(prompt.starts_with(CHATML_SYSTEM), "{prompt}");
        assert!(prompt.ends_with(CHATML_ASSISTANT), "{prompt}");
        let messages: Vec<(&str, &str)> = prompt
            .split("<|im_start|>")
            .skip(1)
            .map(|m| {
                let (role, body) = m.split_once('\n').unwrap();
                (
                    role,
                    body.trim_end_matches("<|im_end|>\n").trim_end_matches('\n'),
                )
            })
            .collect();
        assert_eq!(messages[0].0, "system");
        assert_eq!(messages[1].0, "user");
        let kind = task_kind(messages[1].1);
        assert_eq!(messages.last().unwrap(), &("assistant", ""));
        let turns = &messages[2..messages.len() - 1];
        assert_eq!(turns.len() % 2, 0, "{prompt}");
        deepest = deepest.max(turns.len() / 2);
        for (t, pair) in turns.chunks(2).enumerate() {
            let ((r1, output), (r2, observation)) = (pair[0], pair[1]);
            assert_eq!((r1, r2), ("assistant", "user"), "{prompt}");
            // The text the engine generated came back as the turn's output...
            let (answer, action) = ENGINE_ANSWERS[t.min(ENGINE_ANSWERS.len() - 1)];
            assert_eq!(output, answer, "turn {t} of {prompt}");
            // ...and the environment applied the action in it: a move it understands, or an
            // invalid action by its own rules (an observation, not a failure).
            let valid = match kind {
                "calculator" => action.starts_with("calc:") || action.starts_with("answer:"),
                _ => ["up", "down", "left", "right"].contains(&action),
            };
            let invalid = format!("Invalid action {action:?}");
            if valid {
                assert!(!observation.contains("Invalid action"), "{observation}");
                applied_seen += 1;
                if action == "calc: 6 * 7" {
                    assert!(observation.contains("calc: 6 * 7 = 42"), "{observation}");
                }
            } else {
                assert!(observation.contains(&invalid), "{kind}: {observation}");
                invalid_seen += 1;
            }
        }
    }
    eprintln!(
        "fake engine: {} completion requests, {generations} generations used; turns applied: \
         {applied_seen} understood, {invalid_seen} invalid; deepest prompt: {deepest} turns",
        requests.len()
    );
    assert!(deepest >= 3, "no episode went past its third turn");
    assert!(
        invalid_seen > 0 && applied_seen > 0,
        "{invalid_seen} {applied_seen}"
    );
}

#[test]
fn rollfleet_run_drives_an_openai_engine_when_told_to() {
    let engine = fake_engine();
    let dir = temp_dir("run-openai");
    let job = job_file(&dir, 1);
    let out = Command::new(BIN)
        .arg("run")
        .arg(&job)
        .args([
            "--time-scale",
            "1",
            "--engine",
            "openai",
            "--engine-url",
            &engine.url,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("Succeeded - 1 of 1 RL steps"), "{stdout}");
    assert!(
        stdout.contains("generations by a real OpenAI-compatible engine"),
        "{stdout}"
    );
    assert!(!stdout.contains("GPU figures are EMULATED"), "{stdout}");
    assert!(stderr.contains(&engine.url), "{stderr}");
    let requests = engine.requests.lock().unwrap().len();
    assert!(
        requests >= 32,
        "{requests} completion requests for 32 trajectories"
    );
}

#[test]
fn an_engine_that_refuses_every_request_fails_the_job_with_its_reason_instead_of_retrying_forever()
{
    let engine = fake_engine_answering(false);
    let dir = temp_dir("refusing-engine");
    let job = job_file(&dir, 2);
    let report_path = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report_path, 5, &[]);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode"] {
        procs.0.push(
            Command::new(BIN)
                .args(["worker", "--scheduler", &url, "--pool", pool])
                .args(["--name", &format!("{pool}-0")])
                .args(["--engine", "openai", "--engine-url", &engine.url])
                .args(["--model", "fake-policy"])
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
    }
    for pool in ["train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(!status.success(), "a job that trained nothing succeeded");
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["phase"], "Failed", "{report:#}");
    let failure = report["failure"].as_str().unwrap();
    // The reason names the refusal as the engine put it.
    assert!(failure.contains("HTTP 400"), "{failure}");
    assert!(failure.contains("maximum context length"), "{failure}");
    let abandoned = report["groups_abandoned"].as_array().unwrap();
    assert!(!abandoned.is_empty(), "{report:#}");
    assert_eq!(report["trained"].as_array().unwrap().len(), 0, "{report:#}");
    // Each trajectory given up was tried as often as the limit says, not once and not forever.
    let requests = engine.requests.lock().unwrap().len() as u64;
    let limit = u64::from(rollfleet_core::config::DEFAULT_STAGE_FAILURE_LIMIT);
    assert!(
        requests >= limit * abandoned.len() as u64,
        "{requests} requests for {} groups",
        abandoned.len()
    );
}
