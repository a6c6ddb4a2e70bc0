//! The OpenAI-compatible backend against a local HTTP server that speaks the engines' wire
//! format: chunked transfer, server-sent events, vLLM's chunk, usage and error bodies, SGLang's
//! weight-update endpoint; plus aborts, cut connections and garbage.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use rollfleet_engine::openai::{OpenAiConfig, OpenAiEngine, WeightUpdate};
use rollfleet_engine::{Engine, EngineError, FinishReason, GenerateEvent, GenerateRequest, Prompt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// What the fake engine does with a request.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Streams "Hello world" in three chunks with token ids, usage and [DONE].
    Stream,
    /// Streams 200 chunks, 10 ms apart; reports how many it sent before the client left.
    Slow,
    /// Answers 400 with vLLM's error body.
    BadRequest,
    /// Streams a chunk that is not JSON.
    Garbage,
    /// Streams one chunk, then drops the connection without [DONE].
    Cut,
}

struct Seen {
    path: String,
    headers: String,
    body: serde_json::Value,
}

async fn read_request(stream: &mut TcpStream) -> Option<Seen> {
    let mut data = Vec::new();
    let mut buffer = [0u8; 4096];
    let head_end = loop {
        let n = stream.read(&mut buffer).await.ok()?;
        if n == 0 {
            return None;
        }
        data.extend_from_slice(&buffer[..n]);
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
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
        let n = stream.read(&mut buffer).await.ok()?;
        data.extend_from_slice(&buffer[..n]);
    }
    let path = head.split_whitespace().nth(1)?.to_owned();
    let body = serde_json::from_slice(&data[head_end..head_end + length]).unwrap_or_default();
    Some(Seen {
        path,
        headers: head,
        body,
    })
}

async fn chunk(stream: &mut TcpStream, data: &str) -> std::io::Result<()> {
    let event = format!("data: {data}\n\n");
    stream
        .write_all(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes())
        .await?;
    stream.flush().await
}

const SSE_HEAD: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

fn delta(text: &str, ids: &[u32], finish: Option<&str>) -> String {
    serde_json::json!({
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "policy",
        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "token_ids": ids}],
        "usage": null
    })
    .to_string()
}

async fn serve(
    mut stream: TcpStream,
    behaviour: Behaviour,
    seen: mpsc::UnboundedSender<Seen>,
    sent_before_abort: mpsc::UnboundedSender<usize>,
) -> std::io::Result<()> {
    let Some(request) = read_request(&mut stream).await else {
        return Ok(());
    };
    let path = request.path.clone();
    let _ = seen.send(request);
    if path == "/v1/models" {
        let body = r#"{"object":"list","data":[{"id":"Qwen/Qwen2.5-1.5B-Instruct","object":"model","created":1,"owned_by":"vllm","root":"Qwen/Qwen2.5-1.5B-Instruct","parent":null,"max_model_len":32768},{"id":"lora-a","object":"model","created":1,"owned_by":"vllm","root":"Qwen/Qwen2.5-1.5B-Instruct","parent":"Qwen/Qwen2.5-1.5B-Instruct"}]}"#;
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        return stream.write_all(answer.as_bytes()).await;
    }
    if path == "/update_weights_from_disk" {
        let body = r#"{"success":true,"message":"Succeeded to update model weights."}"#;
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        return stream.write_all(answer.as_bytes()).await;
    }
    match behaviour {
        Behaviour::Stream => {
            stream.write_all(SSE_HEAD.as_bytes()).await?;
            chunk(&mut stream, &delta("Hello", &[9707], None)).await?;
            chunk(&mut stream, &delta(" wor", &[1879], None)).await?;
            chunk(&mut stream, &delta("ld", &[67], Some("length"))).await?;
            let usage = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"policy","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":8}}}"#;
            chunk(&mut stream, usage).await?;
            chunk(&mut stream, "[DONE]").await?;
            stream.write_all(b"0\r\n\r\n").await
        }
        Behaviour::Slow => {
            stream.write_all(SSE_HEAD.as_bytes()).await?;
            for sent in 0..200 {
                if chunk(&mut stream, &delta("x", &[], None)).await.is_err() {
                    let _ = sent_before_abort.send(sent);
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let _ = sent_before_abort.send(200);
            Ok(())
        }
        Behaviour::BadRequest => {
            let body = r#"{"object":"error","message":"This model's maximum context length is 4096 tokens.","type":"BadRequestError","param":null,"code":400}"#;
            let answer = format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(answer.as_bytes()).await
        }
        Behaviour::Garbage => {
            stream.write_all(SSE_HEAD.as_bytes()).await?;
            chunk(&mut stream, "<html>not json</html>").await
        }
        Behaviour::Cut => {
            stream.write_all(SSE_HEAD.as_bytes()).await?;
            chunk(&mut stream, &delta("par", &[], None)).await
        }
    }
}

struct FakeEngine {
    url: String,
    seen: mpsc::UnboundedReceiver<Seen>,
    sent_before_abort: mpsc::UnboundedReceiver<usize>,
}

async fn fake_engine(behaviour: Behaviour) -> FakeEngine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (seen_tx, seen) = mpsc::unbounded_channel();
    let (abort_tx, sent_before_abort) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve(stream, behaviour, seen_tx.clone(), abort_tx.clone()));
        }
    });
    FakeEngine {
        url,
        seen,
        sent_before_abort,
    }
}

fn engine(url: &str, weight_update: WeightUpdate) -> Arc<OpenAiEngine> {
    Arc::new(
        OpenAiEngine::new(
            OpenAiConfig {
                base_url: url.to_owned(),
                model: "policy".to_owned(),
                api_key: Some("secret".to_owned()),
                connect_timeout: Duration::from_secs(2),
                return_token_ids: true,
                weight_update,
            },
            3,
        )
        .unwrap(),
    )
}

fn request() -> GenerateRequest {
    GenerateRequest {
        request_id: "req-1".to_owned(),
        session: "quickstart/7/2".to_owned(),
        prompt: Prompt::Tokens(vec![1, 2, 3]),
        max_tokens: 3,
        temperature: 1.0,
        stop: vec!["</action>".to_owned()],
        policy_version: 3,
    }
}

#[tokio::test]
async fn a_streamed_completion_yields_text_token_ids_and_the_engines_usage() {
    let mut fake = fake_engine(Behaviour::Stream).await;
    let events: Vec<_> = engine(&fake.url, WeightUpdate::Unsupported)
        .generate(request())
        .collect()
        .await;
    let events: Vec<GenerateEvent> = events.into_iter().map(Result::unwrap).collect();
    let text: String = events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Delta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, "Hello world");
    let ids: Vec<u32> = events
        .iter()
        .flat_map(|e| match e {
            GenerateEvent::Delta { token_ids, .. } => token_ids.clone(),
            _ => vec![],
        })
        .collect();
    assert_eq!(ids, [9707, 1879, 67]);
    let GenerateEvent::Finished(done) = events.last().unwrap() else {
        panic!("the last event must be Finished");
    };
    assert_eq!(done.finish_reason, FinishReason::Length);
    assert_eq!(
        (
            done.prompt_tokens,
            done.completion_tokens,
            done.cached_prompt_tokens
        ),
        (Some(12), Some(3), Some(8))
    );
    assert!(!done.emulated);

    let seen = fake.seen.recv().await.unwrap();
    assert_eq!(seen.path, "/v1/completions");
    assert!(
        seen.headers
            .to_ascii_lowercase()
            .contains("authorization: bearer secret")
    );
    assert!(
        seen.headers
            .to_ascii_lowercase()
            .contains("x-request-id: req-1")
    );
    assert_eq!(seen.body["prompt"], serde_json::json!([1, 2, 3]));
    assert_eq!(seen.body["stream"], true);
    assert_eq!(seen.body["stream_options"]["include_usage"], true);
    assert_eq!(seen.body["return_token_ids"], true);
    assert_eq!(seen.body["stop"], serde_json::json!(["</action>"]));
    assert_eq!(seen.body["user"], "quickstart/7/2");
}

#[tokio::test]
async fn dropping_the_stream_aborts_the_request_at_the_engine() {
    let mut fake = fake_engine(Behaviour::Slow).await;
    let mut stream = engine(&fake.url, WeightUpdate::Unsupported).generate(request());
    for _ in 0..3 {
        assert!(matches!(
            stream.next().await,
            Some(Ok(GenerateEvent::Delta { .. }))
        ));
    }
    drop(stream);
    let sent = tokio::time::timeout(Duration::from_secs(5), fake.sent_before_abort.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        sent < 50,
        "the engine kept streaming {sent} chunks after the abort"
    );
}

#[tokio::test]
async fn a_rejected_request_carries_the_engines_message() {
    let fake = fake_engine(Behaviour::BadRequest).await;
    let first = engine(&fake.url, WeightUpdate::Unsupported)
        .generate(request())
        .next()
        .await
        .unwrap();
    assert_eq!(
        first.unwrap_err(),
        EngineError::Rejected {
            endpoint: fake.url.clone(),
            status: 400,
            message: "This model's maximum context length is 4096 tokens.".to_owned(),
        }
    );
}

#[tokio::test]
async fn garbage_is_a_protocol_violation_and_a_cut_stream_is_an_infrastructure_failure() {
    let fake = fake_engine(Behaviour::Garbage).await;
    let events: Vec<_> = engine(&fake.url, WeightUpdate::Unsupported)
        .generate(request())
        .collect()
        .await;
    assert!(
        matches!(events.last().unwrap(), Err(EngineError::Protocol { .. })),
        "{events:?}"
    );

    let fake = fake_engine(Behaviour::Cut).await;
    let events: Vec<_> = engine(&fake.url, WeightUpdate::Unsupported)
        .generate(request())
        .collect()
        .await;
    assert!(matches!(events[0], Ok(GenerateEvent::Delta { .. })));
    assert!(
        matches!(events.last().unwrap(), Err(EngineError::Unavailable { .. })),
        "{events:?}"
    );
}

#[tokio::test]
async fn an_unreachable_engine_is_unavailable_and_named() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let first = engine(&url, WeightUpdate::Unsupported)
        .generate(request())
        .next()
        .await
        .unwrap();
    match first {
        Err(EngineError::Unavailable { endpoint, .. }) => assert_eq!(endpoint, url),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_request_for_another_policy_version_is_refused_before_it_is_sent() {
    let mut fake = fake_engine(Behaviour::Stream).await;
    let stale = GenerateRequest {
        policy_version: 2,
        ..request()
    };
    let first = engine(&fake.url, WeightUpdate::Unsupported)
        .generate(stale)
        .next()
        .await
        .unwrap();
    assert!(matches!(
        first,
        Err(EngineError::Rejected { status: 409, .. })
    ));
    assert!(
        fake.seen.try_recv().is_err(),
        "nothing may reach the engine"
    );
}

#[tokio::test]
async fn weights_update_through_sglangs_endpoint_and_move_the_served_version() {
    let mut fake = fake_engine(Behaviour::Stream).await;
    let engine = engine(&fake.url, WeightUpdate::SglangFromDisk);
    engine.update_weights(&weights_v4()).await.unwrap();
    assert_eq!(engine.policy_version(), 4);
    let seen = fake.seen.recv().await.unwrap();
    assert_eq!(seen.path, "/update_weights_from_disk");
    assert_eq!(seen.body["model_path"], "/ckpt/step-4");

    let plain = self::engine(&fake.url, WeightUpdate::Unsupported);
    assert!(matches!(
        plain.update_weights(&weights_v4()).await,
        Err(EngineError::Unsupported(_))
    ));
    assert_eq!(plain.policy_version(), 3);
}

#[tokio::test]
async fn the_served_models_are_listed_and_a_relabelled_version_is_served() {
    let mut fake = fake_engine(Behaviour::Stream).await;
    let engine = engine(&fake.url, WeightUpdate::Unsupported);
    assert_eq!(
        engine.served_models().await.unwrap(),
        ["Qwen/Qwen2.5-1.5B-Instruct", "lora-a"]
    );
    let seen = fake.seen.recv().await.unwrap();
    assert_eq!(seen.path, "/v1/models");
    assert!(seen.headers.starts_with("GET "));

    // Weights the emulated trainer "published" are only a label: nothing is sent to the engine,
    // and requests for the new version go through.
    engine.relabel_version(5);
    assert_eq!(engine.policy_version(), 5);
    let events: Vec<_> = engine
        .generate(GenerateRequest {
            policy_version: 5,
            ..request()
        })
        .collect()
        .await;
    let Some(Ok(GenerateEvent::Finished(done))) = events.last() else {
        panic!("{events:?}");
    };
    assert_eq!(done.policy_version, 5);
    assert_eq!(fake.seen.recv().await.unwrap().path, "/v1/completions");
}

fn weights_v4() -> rollfleet_engine::WeightsRef {
    rollfleet_engine::WeightsRef {
        version: 4,
        uri: "/ckpt/step-4".into(),
        format: "safetensors".into(),
        sha256: String::new(),
    }
}
