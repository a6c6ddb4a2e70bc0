//! Compatibility with a Lambda Invoke API server this project did not write: serverless-offline
//! (serverless framework v3 plugin, runs Node handlers in worker threads, no Docker). The test
//! installs it itself (`serverless/compat/setup.sh`, `npm ci`) when it is missing, starts it on
//! free loopback ports, and drives it with the real aws-sdk-lambda client and the invoker.
//!
//! Where serverless-offline departs from AWS's documented behaviour the assertions pin down what
//! it does instead, so a change on either side shows up here; `docs/serverless.md` lists them.

// Test helpers outside #[test] functions panic on setup failures too; clippy.toml's
// allow-unwrap-in-tests does not reach them.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use aws_sdk_lambda::operation::invoke::InvokeError as Api;
use aws_sdk_lambda::primitives::Blob;
use aws_sdk_lambda::types::{InvocationType, LogType};
use common::*;
use rollfleet_lambda_invoker::{Delivery, FunctionSettings, InvokeError, RewardRequest};
use serde_json::{Value, json};

const PREFIX: &str = "rollfleet-compat-dev-";

fn compat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../compat")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

/// Installs serverless + serverless-offline if they are not there yet.
fn ensure_installed() {
    let dir = compat_dir();
    let status = std::process::Command::new("bash")
        .arg(dir.join("setup.sh"))
        .status()
        .expect("bash must be available to run serverless/compat/setup.sh");
    assert!(status.success(), "serverless/compat/setup.sh failed");
    assert!(
        dir.join("node_modules/serverless/bin/serverless.js")
            .exists()
    );
}

struct Offline {
    child: tokio::process::Child,
    url: String,
}

async fn start_offline() -> Offline {
    ensure_installed();
    let dir = compat_dir();
    let (http, lambda, ws) = (free_port(), free_port(), free_port());
    let child = tokio::process::Command::new("node")
        .arg(dir.join("node_modules/serverless/bin/serverless.js"))
        .args(["offline", "--host", "127.0.0.1"])
        .args(["--httpPort", &http.to_string()])
        .args(["--lambdaPort", &lambda.to_string()])
        .args(["--websocketPort", &ws.to_string()])
        .current_dir(&dir)
        // serverless v3 would otherwise try to reach its telemetry and notification services.
        .env("SLS_TELEMETRY_DISABLED", "1")
        .env("SLS_NOTIFICATIONS_MODE", "off")
        .env("SLS_DEPRECATION_DISABLE", "*")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("node must be installed to run serverless-offline");
    let deadline = Instant::now() + Duration::from_secs(90);
    while tokio::net::TcpStream::connect(("127.0.0.1", lambda))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "serverless-offline did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Offline {
        child,
        url: format!("http://127.0.0.1:{lambda}"),
    }
}

fn payload_of(out: &aws_sdk_lambda::operation::invoke::InvokeOutput) -> Value {
    serde_json::from_slice(out.payload().unwrap().as_ref()).unwrap()
}

#[tokio::test]
async fn serverless_offline_answers_the_invoke_api_for_the_sdk_and_the_invoker() {
    let mut offline = start_offline().await;
    let client = sdk(&offline.url).await;
    let exact = format!("{PREFIX}exact_match");

    // Success: 200 with the handler's result.
    let out = client
        .invoke()
        .function_name(&exact)
        .log_type(LogType::Tail)
        .payload(Blob::new(r#"{"response":" a ","reference":"a"}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 200);
    assert_eq!(out.function_error(), None);
    assert_eq!(payload_of(&out)["reward"], 1.0);
    // Difference: no X-Amz-Log-Result on LogType Tail, and no X-Amz-Executed-Version.
    assert_eq!(out.log_result(), None);
    assert_eq!(out.executed_version(), None);

    // Function error: 200 with X-Amz-Function-Error and the Lambda error shape.
    let out = client
        .invoke()
        .function_name(format!("{PREFIX}fail"))
        .payload(Blob::new("{}"))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 200);
    assert_eq!(out.function_error(), Some("Unhandled"));
    let body = payload_of(&out);
    assert_eq!(body["errorMessage"], "this reward always fails");
    // Difference: AWS's Node runtime reports the error's name ("InvalidPayload") here.
    assert_eq!(body["errorType"], "Error");

    // Unknown function: 404 ResourceNotFoundException, as on AWS.
    let err = client
        .invoke()
        .function_name("no_such_function")
        .payload(Blob::new("{}"))
        .send()
        .await
        .unwrap_err();
    assert!(matches!(
        err.as_service_error(),
        Some(Api::ResourceNotFoundException(_))
    ));
    assert_eq!(err.raw_response().unwrap().status().as_u16(), 404);

    // Over 6 MB: 413, but (difference) without the RequestTooLargeException error code.
    let over = format!(
        r#"{{"response":"{}","reference":"a"}}"#,
        "a".repeat(6 * 1024 * 1024)
    );
    let err = client
        .invoke()
        .function_name(&exact)
        .payload(Blob::new(over))
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.raw_response().unwrap().status().as_u16(), 413);
    assert!(!matches!(
        err.as_service_error(),
        Some(Api::RequestTooLargeException(_))
    ));

    // Timeout: 200 with a function error, message "[504] - Lambda timeout." (AWS: "Task timed
    // out after N seconds").
    let out = client
        .invoke()
        .function_name(format!("{PREFIX}slow"))
        .payload(Blob::new("{}"))
        .send()
        .await
        .unwrap();
    assert_eq!(out.function_error(), Some("Unhandled"));
    assert!(
        payload_of(&out)["errorMessage"]
            .as_str()
            .unwrap()
            .contains("Lambda timeout")
    );

    // Event: 202, as on AWS.
    let out = client
        .invoke()
        .function_name(&exact)
        .invocation_type(InvocationType::Event)
        .payload(Blob::new(r#"{"response":"a","reference":"a"}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status_code(), 202);

    // DryRun: difference: 400 InvalidParameterValueException instead of AWS's 204.
    let err = client
        .invoke()
        .function_name(&exact)
        .invocation_type(InvocationType::DryRun)
        .payload(Blob::new("{}"))
        .send()
        .await
        .unwrap_err();
    assert!(matches!(
        err.as_service_error(),
        Some(Api::InvalidParameterValueException(_))
    ));

    // The invoker: rewards delivered once, keys echoed, cost from observed duration (no REPORT
    // line), the function error not retried, the timeout retried as transient.
    let (invoker, _) = invoker(&offline.url, |c| {
        c.retry.max_attempts = 2;
        c.functions.insert(
            format!("{PREFIX}slow"),
            FunctionSettings {
                timeout: Duration::from_secs(1),
                memory_mb: 1024,
            },
        );
    })
    .await;
    let ask = |function: &str, trajectory: &str, payload: Value| RewardRequest {
        function: function.to_owned(),
        trajectory_id: trajectory.to_owned(),
        attempt: 0,
        payload,
    };
    let good = invoker
        .invoke(ask(
            &exact,
            "t1",
            json!({"response": "x", "reference": "x"}),
        ))
        .await
        .unwrap();
    assert_eq!(good.delivery, Delivery::First);
    assert_eq!(good.reward.reward, 1.0);
    assert_eq!(good.reward.result["idempotency_key"], "t1#0");
    let again = invoker
        .invoke(ask(
            &exact,
            "t1",
            json!({"response": "x", "reference": "x"}),
        ))
        .await
        .unwrap();
    assert_eq!(again.delivery, Delivery::Duplicate);
    let bad = invoker
        .invoke(ask(
            &exact,
            "t2",
            json!({"response": "x", "reference": "y"}),
        ))
        .await
        .unwrap();
    assert_eq!(bad.reward.reward, 0.0);
    let failed = invoker
        .invoke(ask(&format!("{PREFIX}fail"), "t3", json!({})))
        .await
        .unwrap_err();
    assert!(matches!(failed, InvokeError::Function { .. }), "{failed:?}");
    let timed_out = invoker
        .invoke(ask(&format!("{PREFIX}slow"), "t4", json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(timed_out, InvokeError::Exhausted { calls: 2, .. }),
        "{timed_out:?}"
    );

    let summary = invoker.summary();
    assert_eq!(summary.rewards_delivered, 2);
    assert_eq!(summary.duplicates_suppressed, 1);
    assert_eq!(
        summary.cold_starts, 0,
        "serverless-offline reports no Init Duration"
    );
    assert!(summary.gb_seconds > 0.0);

    let _ = offline.child.kill().await;
}
