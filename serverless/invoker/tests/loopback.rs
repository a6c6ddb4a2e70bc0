//! The real aws-sdk-lambda client against the local host over loopback TCP: every part of the
//! Invoke API the host implements (success, function error, unknown function, 413, 429 with
//! retry, timeouts, Event, DryRun, cold starts), and the invoker's behaviour on each.

// Test helpers outside #[test] functions panic on setup failures too; clippy.toml's
// allow-unwrap-in-tests does not reach them.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use aws_sdk_lambda::operation::invoke::InvokeError as Api;
use aws_sdk_lambda::primitives::Blob;
use aws_sdk_lambda::types::{InvocationType, LogType};
use base64::Engine;
use common::*;
use rollfleet_lambda_host::{FunctionConfig, HostConfig};
use rollfleet_lambda_invoker::{Delivery, InvokeError, RewardRequest};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn request(function: &str, trajectory: &str, payload: Value) -> RewardRequest {
    RewardRequest {
        function: function.to_owned(),
        trajectory_id: trajectory.to_owned(),
        attempt: 0,
        payload,
    }
}

fn json_payload(out: &aws_sdk_lambda::operation::invoke::InvokeOutput) -> Value {
    serde_json::from_slice(out.payload().unwrap().as_ref()).unwrap()
}

#[tokio::test]
async fn successful_reward_is_answered_200_with_the_result_and_executed_version() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let out = sdk(&host.url())
        .await
        .invoke()
        .function_name("math_answer")
        .payload(Blob::new(
            json!({"response": "so \\boxed{\\frac{6}{8}}", "reference": "0.75"}).to_string(),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 200);
    assert_eq!(out.function_error(), None);
    assert_eq!(out.executed_version(), Some("$LATEST"));
    assert_eq!(json_payload(&out)["reward"], 1.0);
}

#[tokio::test]
async fn function_arn_and_latest_qualifier_address_the_same_function() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let client = sdk(&host.url()).await;
    for name in [
        "arn:aws:lambda:us-east-1:000000000000:function:exact_match",
        "exact_match:$LATEST",
    ] {
        let out = client
            .invoke()
            .function_name(name)
            .payload(Blob::new(r#"{"response":"a","reference":"a"}"#))
            .send()
            .await
            .unwrap();
        assert_eq!(json_payload(&out)["reward"], 1.0, "{name}");
    }
}

#[tokio::test]
async fn function_error_is_200_with_x_amz_function_error_and_is_not_retried() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let out = sdk(&host.url())
        .await
        .invoke()
        .function_name("math_answer")
        .payload(Blob::new(r#"{"answer": 3}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 200);
    assert_eq!(out.function_error(), Some("Unhandled"));
    assert_eq!(json_payload(&out)["errorType"], "InvalidPayload");

    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    let err = invoker
        .invoke(request("math_answer", "t1", json!({"answer": 3})))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, InvokeError::Function { error_type, .. } if error_type == "InvalidPayload"),
        "{err:?}"
    );
    assert_eq!(invoker.summary().calls, 1);
    assert_eq!(invoker.summary().rewards_delivered, 0);
}

#[tokio::test]
async fn unknown_function_is_answered_with_resource_not_found_404() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let client = sdk(&host.url()).await;
    for name in ["no_such_reward", "math_answer:7"] {
        let err = client
            .invoke()
            .function_name(name)
            .payload(Blob::new("{}"))
            .send()
            .await
            .unwrap_err();
        let service = err.as_service_error().expect("a service error");
        assert!(
            matches!(service, Api::ResourceNotFoundException(_)),
            "{name}: {service:?}"
        );
        assert_eq!(err.raw_response().unwrap().status().as_u16(), 404);
    }
    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    let err = invoker
        .invoke(request("no_such_reward", "t1", json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, InvokeError::Rejected { code, .. } if code == "ResourceNotFoundException")
    );
    assert_eq!(
        invoker.summary().calls,
        1,
        "a permanent error must not be retried"
    );
}

#[tokio::test]
async fn payload_over_6_mb_is_refused_with_request_too_large_413_and_6_mb_is_accepted() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let client = sdk(&host.url()).await;
    let envelope = r#"{"response":"","reference":"x"}"#.len();
    let at_limit = format!(
        r#"{{"response":"{}","reference":"x"}}"#,
        "a".repeat(6 * 1024 * 1024 - envelope)
    );
    assert_eq!(at_limit.len(), 6 * 1024 * 1024);
    let out = client
        .invoke()
        .function_name("exact_match")
        .payload(Blob::new(at_limit))
        .send()
        .await
        .unwrap();
    assert_eq!(json_payload(&out)["reward"], 0.0);

    let over = format!(
        r#"{{"response":"{}","reference":"x"}}"#,
        "a".repeat(6 * 1024 * 1024)
    );
    let err = client
        .invoke()
        .function_name("exact_match")
        .payload(Blob::new(over))
        .send()
        .await
        .unwrap_err();
    assert!(matches!(
        err.as_service_error(),
        Some(Api::RequestTooLargeException(_))
    ));
    assert_eq!(err.raw_response().unwrap().status().as_u16(), 413);
}

#[tokio::test]
async fn body_that_is_not_json_is_invalid_request_content_400() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let err = sdk(&host.url())
        .await
        .invoke()
        .function_name("exact_match")
        .payload(Blob::new("{not json"))
        .send()
        .await
        .unwrap_err();
    assert!(matches!(
        err.as_service_error(),
        Some(Api::InvalidRequestContentException(_))
    ));
    assert_eq!(err.raw_response().unwrap().status().as_u16(), 400);
}

#[tokio::test]
async fn reserved_concurrency_throttles_with_429_and_retry_after_and_the_invoker_retries() {
    let slow =
        FunctionConfig::new(sleeper(Duration::from_millis(300))).reserved_concurrency(Some(1));
    let host = start_host(host_with(&[("slow", slow)])).await;
    let client = sdk(&host.url()).await;
    let first = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .invoke()
                .function_name("slow")
                .payload(Blob::new("{}"))
                .send()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let err = client
        .invoke()
        .function_name("slow")
        .payload(Blob::new("{}"))
        .send()
        .await
        .unwrap_err();
    match err.as_service_error() {
        Some(Api::TooManyRequestsException(t)) => {
            assert_eq!(t.retry_after_seconds(), Some("1"));
        }
        other => panic!("expected TooManyRequestsException, got {other:?}"),
    }
    assert_eq!(err.raw_response().unwrap().status().as_u16(), 429);
    assert_eq!(first.await.unwrap().unwrap().status_code(), 200);

    // Through the invoker, both rewards arrive: the throttled one is retried.
    let (invoker, _) = invoker(&host.url(), |c| {
        c.retry.max_attempts = 20;
        c.retry.cap = Duration::from_millis(150);
    })
    .await;
    let (a, b) = tokio::join!(
        invoker.invoke(request("slow", "a", json!({}))),
        invoker.invoke(request("slow", "b", json!({}))),
    );
    assert_eq!(a.unwrap().reward.reward, 1.0);
    assert_eq!(b.unwrap().reward.reward, 1.0);
    let summary = invoker.summary();
    assert!(summary.throttles >= 1, "{summary:?}");
    assert!(summary.retries >= 1, "{summary:?}");
    assert_eq!(summary.rewards_delivered, 2);
}

#[tokio::test]
async fn a_function_running_past_its_timeout_is_a_timed_out_function_error_and_retried() {
    let hang =
        FunctionConfig::new(sleeper(Duration::from_secs(30))).timeout(Duration::from_millis(200));
    let host = start_host(host_with(&[("hang", hang)])).await;
    let out = sdk(&host.url())
        .await
        .invoke()
        .function_name("hang")
        .payload(Blob::new("{}"))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 200);
    assert_eq!(out.function_error(), Some("Unhandled"));
    let body = json_payload(&out);
    assert_eq!(body["errorType"], "Sandbox.Timedout");
    assert!(
        body["errorMessage"]
            .as_str()
            .unwrap()
            .contains("Task timed out after 0.20 seconds")
    );

    let (invoker, registry) = invoker(&host.url(), |c| {
        c.retry.max_attempts = 3;
        c.call_timeout_margin = Duration::from_secs(2);
    })
    .await;
    let err = invoker
        .invoke(request("hang", "t", json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(err, InvokeError::Exhausted { calls: 3, .. }),
        "{err:?}"
    );
    let timeouts = invoker
        .metrics()
        .calls
        .with_label_values(&["hang", "timeout"])
        .get();
    assert_eq!(timeouts, 3);
    let exported = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap();
    assert!(
        exported.contains("rollfleet_reward_calls_total{function=\"hang\",outcome=\"timeout\"} 3")
    );
}

#[tokio::test]
async fn the_client_side_call_timeout_fires_when_the_server_never_answers() {
    // Accepts connections and reads requests, but never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = silent.accept().await {
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await;
            held.push(s);
        }
    });
    let (invoker, _) = invoker(&format!("http://{addr}"), |c| {
        c.default_function.timeout = Duration::from_millis(100);
        c.call_timeout_margin = Duration::from_millis(100);
        c.retry.max_attempts = 2;
    })
    .await;
    let started = std::time::Instant::now();
    let err = invoker
        .invoke(request("exact_match", "t", json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(err, InvokeError::Exhausted { calls: 2, .. }),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        invoker
            .metrics()
            .calls
            .with_label_values(&["exact_match", "timeout"])
            .get(),
        2
    );
}

#[tokio::test]
async fn event_invocation_is_accepted_with_202_and_runs_in_the_background() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let out = sdk(&host.url())
        .await
        .invoke()
        .function_name("exact_match")
        .invocation_type(InvocationType::Event)
        .payload(Blob::new(r#"{"response":"a","reference":"a"}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 202);
    assert!(out.payload().is_none_or(|p| p.as_ref().is_empty()));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while host.stats.snapshot().events_completed == 0 {
        assert!(std::time::Instant::now() < deadline, "the event never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(host.stats.snapshot().invocations, 1);
}

#[tokio::test]
async fn event_payload_over_1_mb_is_refused_with_413() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let err = sdk(&host.url())
        .await
        .invoke()
        .function_name("exact_match")
        .invocation_type(InvocationType::Event)
        .payload(Blob::new(format!(
            r#"{{"response":"{}"}}"#,
            "a".repeat(1 << 20)
        )))
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.raw_response().unwrap().status().as_u16(), 413);
}

#[tokio::test]
async fn dry_run_is_answered_with_204_and_runs_nothing() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let client = sdk(&host.url()).await;
    let out = client
        .invoke()
        .function_name("exact_match")
        .invocation_type(InvocationType::DryRun)
        .payload(Blob::new("{}"))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 204);
    assert_eq!(host.stats.snapshot().invocations, 0);
    // DryRun still checks that the function exists.
    let err = client
        .invoke()
        .function_name("nope")
        .invocation_type(InvocationType::DryRun)
        .send()
        .await
        .unwrap_err();
    assert!(matches!(
        err.as_service_error(),
        Some(Api::ResourceNotFoundException(_))
    ));
}

#[tokio::test]
async fn cold_start_is_reported_in_the_log_tail_and_counted_with_its_cost() {
    let mut config = HostConfig::with_reward_functions();
    let exact = FunctionConfig::new(rollfleet_lambda_host::FunctionCode::Reward(
        rollfleet_rewards::RewardFunction::ExactMatch,
    ))
    .cold_start(Duration::from_millis(80))
    .memory_mb(1024);
    config.add("exact_match", exact);
    let host = start_host(config).await;

    let out = sdk(&host.url())
        .await
        .invoke()
        .function_name("exact_match")
        .log_type(LogType::Tail)
        .payload(Blob::new(r#"{"response":"a","reference":"a"}"#))
        .send()
        .await
        .unwrap();
    let log = base64::engine::general_purpose::STANDARD
        .decode(out.log_result().unwrap())
        .unwrap();
    let log = String::from_utf8(log).unwrap();
    assert!(log.contains("Init Duration: "), "{log}");
    assert!(log.contains("Memory Size: 1024 MB"), "{log}");

    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    for t in ["a", "b", "c"] {
        let r = invoker
            .invoke(request(
                "exact_match",
                t,
                json!({"response": "a", "reference": "a"}),
            ))
            .await
            .unwrap();
        assert!(!r.reward.cold_start, "the environment was warm already");
    }
    let summary = invoker.summary();
    assert_eq!(summary.cold_starts, 0);
    assert_eq!(summary.calls, 3);
    // At least 1 ms billed per call at 1 GB: 3 calls >= 0.003 GB-s.
    assert!(summary.gb_seconds >= 0.003 - 1e-9, "{summary:?}");
    assert!(summary.billed_seconds >= 0.003 - 1e-9, "{summary:?}");
}

#[tokio::test]
async fn a_second_environment_starts_cold_under_concurrency_and_the_invoker_counts_it() {
    let slow = FunctionConfig::new(sleeper(Duration::from_millis(100)))
        .cold_start(Duration::from_millis(20));
    let host = start_host(host_with(&[("slow", slow)])).await;
    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    let (a, b) = tokio::join!(
        invoker.invoke(request("slow", "a", json!({}))),
        invoker.invoke(request("slow", "b", json!({}))),
    );
    assert!(a.unwrap().reward.cold_start && b.unwrap().reward.cold_start);
    let c = invoker
        .invoke(request("slow", "c", json!({})))
        .await
        .unwrap();
    assert!(!c.reward.cold_start);
    assert_eq!(invoker.summary().cold_starts, 2);
    assert_eq!(host.stats.snapshot().cold_starts, 2);
}

#[tokio::test]
async fn the_same_trajectory_attempt_is_invoked_once_even_when_asked_twice_concurrently() {
    let slow = FunctionConfig::new(sleeper(Duration::from_millis(100)));
    let host = start_host(host_with(&[("slow", slow)])).await;
    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    let (a, b) = tokio::join!(
        invoker.invoke(request("slow", "t", json!({}))),
        invoker.invoke(request("slow", "t", json!({}))),
    );
    let mut deliveries = [a.unwrap().delivery, b.unwrap().delivery];
    deliveries.sort_by_key(|d| *d == Delivery::Duplicate);
    assert_eq!(deliveries, [Delivery::First, Delivery::Duplicate]);
    let later = invoker
        .invoke(request("slow", "t", json!({})))
        .await
        .unwrap();
    assert_eq!(later.delivery, Delivery::Duplicate);
    assert_eq!(host.stats.snapshot().invocations, 1);
    assert_eq!(invoker.summary().duplicates_suppressed, 2);

    // A new attempt of the same trajectory is a new reward.
    let mut next = request("slow", "t", json!({}));
    next.attempt = 1;
    assert_eq!(
        invoker.invoke(next).await.unwrap().delivery,
        Delivery::First
    );
    assert_eq!(host.stats.snapshot().invocations, 2);
}

#[tokio::test]
async fn the_idempotency_key_reaches_the_function_and_comes_back() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    let mut r = request(
        "think_answer_format",
        "traj-9",
        json!({"response": "<think>x</think><answer>1</answer>"}),
    );
    r.attempt = 4;
    let got = invoker.invoke(r).await.unwrap();
    assert_eq!(got.reward.reward, 1.0);
    assert_eq!(got.reward.result["idempotency_key"], "traj-9#4");
}

#[tokio::test]
async fn code_tests_reward_runs_real_python_through_the_host() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    let payload = json!({
        "code": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
        "tests": {"unit": ["assert fib(10) == 55", "assert fib(1) == 1", "assert fib(5) == 6"]},
    });
    let got = invoker
        .invoke(request("code_tests", "t", payload))
        .await
        .unwrap();
    assert!(
        (got.reward.reward - 2.0 / 3.0).abs() < 1e-9,
        "{:?}",
        got.reward.result
    );
}

#[tokio::test]
async fn hostile_http_requests_get_error_answers_and_the_host_keeps_serving() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let raw = |req: &'static [u8]| {
        let addr = host.addr;
        async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(req).await.unwrap();
            let mut buf = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut buf)).await;
            String::from_utf8_lossy(&buf).into_owned()
        }
    };
    let bad_type = raw(b"POST /2015-03-31/functions/exact_match/invocations HTTP/1.1\r\nhost: x\r\nx-amz-invocation-type: Sometimes\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}").await;
    assert!(bad_type.starts_with("HTTP/1.1 400"), "{bad_type}");
    assert!(
        bad_type
            .to_lowercase()
            .contains("invalidparametervalueexception")
    );
    let wrong_path = raw(b"GET /etc/passwd HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
    assert!(wrong_path.starts_with("HTTP/1.1 404"), "{wrong_path}");
    let huge = raw(b"POST /2015-03-31/functions/exact_match/invocations HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999\r\nconnection: close\r\n\r\n").await;
    assert!(huge.starts_with("HTTP/1.1 413"), "{huge}");
    let bad_escape = raw(b"POST /2015-03-31/functions/%ff%fe/invocations HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
    assert!(bad_escape.starts_with("HTTP/1.1 400"), "{bad_escape}");
    let _garbage = raw(b"\x00\x01\x02 not http at all\r\n\r\n").await;

    let out = sdk(&host.url())
        .await
        .invoke()
        .function_name("exact_match")
        .payload(Blob::new(r#"{"response":"a","reference":"a"}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 200);
}

#[tokio::test]
async fn the_invoker_never_has_more_calls_in_flight_than_its_concurrency_limit() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let now = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (n, p) = (now.clone(), peak.clone());
    let counting = rollfleet_lambda_host::FunctionCode::Custom(Arc::new(move |_payload| {
        let (now, peak) = (n.clone(), p.clone());
        Box::pin(async move {
            let current = now.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(current, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            now.fetch_sub(1, Ordering::SeqCst);
            Ok(br#"{"reward": 0.5}"#.to_vec())
        })
    }));
    let host = start_host(host_with(&[("counting", FunctionConfig::new(counting))])).await;
    let (invoker, _) = invoker(&host.url(), |c| c.max_concurrency = 2).await;
    let invoker = Arc::new(invoker);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let invoker = invoker.clone();
            tokio::spawn(async move {
                invoker
                    .invoke(request("counting", &format!("t{i}"), json!({})))
                    .await
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().reward.reward, 0.5);
    }
    assert_eq!(peak.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_payload_that_is_not_a_json_object_is_refused_before_any_call() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    let err = invoker
        .invoke(request("exact_match", "t", json!(["not", "an", "object"])))
        .await
        .unwrap_err();
    assert_eq!(err, InvokeError::PayloadNotAnObject);
    assert_eq!(host.stats.snapshot().invocations, 0);
    assert_eq!(invoker.summary().calls, 0);
}

#[tokio::test]
async fn a_forgotten_trajectory_is_invoked_again_if_asked_again() {
    let host = start_host(HostConfig::with_reward_functions()).await;
    let (invoker, _) = invoker(&host.url(), |_| {}).await;
    let ask = || {
        request(
            "exact_match",
            "t",
            json!({"response": "a", "reference": "a"}),
        )
    };
    assert_eq!(
        invoker.invoke(ask()).await.unwrap().delivery,
        Delivery::First
    );
    invoker.forget_trajectory("t");
    assert_eq!(
        invoker.invoke(ask()).await.unwrap().delivery,
        Delivery::First
    );
    assert_eq!(host.stats.snapshot().invocations, 2);
}

#[tokio::test]
async fn an_embedded_host_stops_serving_after_shutdown() {
    let host = rollfleet_lambda_host::LocalHost::start(
        ([127, 0, 0, 1], 0).into(),
        HostConfig::with_reward_functions(),
    )
    .await
    .unwrap();
    let addr = host.addr();
    host.shutdown().await.unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
