//! The vLLM backend against `tests/fakes/vllm_server.py`, a fake vLLM speaking
//! `/v1/completions` with token ids and logprobs, the chat-aware `/tokenize` and the RLHF
//! (dev-mode) weight-update API over a toy model, run as a real process.

mod fake;

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use fake::{Fake, generated, request, run, scratch_dir};
use futures_util::StreamExt;
use rollfleet_engine::vllm::{VllmConfig, VllmEngine};
use rollfleet_engine::{ChatMessage, Engine, EngineError, WeightsRef, chat_turn_tokens};

fn engine(fake: &Fake) -> anyhow::Result<VllmEngine> {
    let config = VllmConfig {
        request_timeout: Duration::from_secs(20),
        update_timeout: Duration::from_secs(20),
        ..VllmConfig::new(fake.url.clone(), "toy-model")
    };
    Ok(VllmEngine::new(config, 0)?)
}

/// A checkpoint directory with one safetensors file, as vLLM's shared-disk backend wants.
fn checkpoint(version: u64, content: &str) -> anyhow::Result<WeightsRef> {
    let dir = scratch_dir("vllm-ckpt")?;
    std::fs::write(dir.join("model.safetensors"), content)?;
    Ok(WeightsRef {
        version,
        uri: format!("file://{}", dir.display()),
        format: "safetensors".into(),
        sha256: String::new(),
    })
}

#[tokio::test]
async fn generation_returns_the_engines_exact_tokens_logprobs_and_weight_version()
-> anyhow::Result<()> {
    let fake = Fake::start("vllm_server.py", &[])?;
    let engine = engine(&fake)?;
    let (ids, logprobs, done) = run(&engine, request("r1", vec![5, 6, 7], 12, 0)).await?;
    let record = fake
        .wait_for("/v1/completions", Duration::from_secs(5))
        .await?;
    let (want_ids, want_logprobs) = generated(&record)?;
    ensure!(!ids.is_empty() && ids.len() <= 12);
    assert_eq!(ids, want_ids);
    assert_eq!(logprobs, want_logprobs);
    assert_eq!(record["request_id"], "r1");
    assert_eq!(
        done.engine_weight_version,
        Some(0),
        "read from /weight_info"
    );
    assert_eq!(done.prompt_tokens, Some(3));
    assert_eq!(done.completion_tokens, Some(ids.len() as u32));
    let paths = fake.paths();
    assert_eq!(paths, ["/weight_info", "/v1/completions"]);
    Ok(())
}

#[tokio::test]
async fn a_weight_update_pauses_loads_resets_resumes_and_reads_the_version_back()
-> anyhow::Result<()> {
    let fake = Fake::start("vllm_server.py", &[])?;
    let engine = engine(&fake)?;
    let (before, _, _) = run(&engine, request("a", vec![9, 9, 9], 16, 0)).await?;
    let weights = checkpoint(1, "weights of step 1")?;
    engine.update_weights(&weights).await?;
    assert_eq!(engine.policy_version(), 1);
    assert_eq!(engine.served_weight_version().await?, Some(1));
    let paths = fake.paths();
    let at = paths
        .iter()
        .position(|p| p == "/pause")
        .context("no pause")?;
    assert_eq!(
        paths[at..at + 7],
        [
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
            "/weight_info"
        ]
    );
    assert_eq!(fake.records("/pause")[0]["mode"], "wait");
    assert_eq!(
        fake.records("/update_weights")[0]["checkpoint"],
        weights.local_path()
    );
    let (after, _, done) = run(&engine, request("b", vec![9, 9, 9], 16, 1)).await?;
    assert_eq!(done.engine_weight_version, Some(1));
    assert_ne!(before, after, "new weights, same context: other tokens");
    Ok(())
}

#[tokio::test]
async fn a_failing_update_is_an_error_naming_the_endpoint_and_the_engine_resumes()
-> anyhow::Result<()> {
    let fake = Fake::start("vllm_server.py", &["--fail-updates", "1"])?;
    let engine = engine(&fake)?;
    let weights = checkpoint(1, "step 1")?;
    match engine.update_weights(&weights).await {
        Err(EngineError::Unavailable { endpoint, reason }) => {
            assert!(endpoint.ends_with("/update_weights"), "{endpoint}");
            assert!(reason.contains("simulated failure"), "{reason}");
        }
        other => bail!("expected the engine's failure, got {other:?}"),
    }
    assert_eq!(engine.policy_version(), 0);
    assert!(fake.paths().ends_with(&["/resume".to_owned()]));
    assert_eq!(engine.served_weight_version().await?, Some(0));
    // Still serving, and the next update goes through.
    run(&engine, request("c", vec![3], 4, 0)).await?;
    engine.update_weights(&weights).await?;
    assert_eq!(engine.policy_version(), 1);
    Ok(())
}

#[tokio::test]
async fn an_engine_that_keeps_its_old_weights_is_caught_by_the_version_read_back()
-> anyhow::Result<()> {
    let fake = Fake::start("vllm_server.py", &["--keep-old-weights"])?;
    let engine = engine(&fake)?;
    match engine.update_weights(&checkpoint(1, "step 1")?).await {
        Err(EngineError::Protocol { endpoint, reason }) => {
            assert!(endpoint.ends_with("/weight_info"), "{endpoint}");
            assert!(
                reason.contains("engine reports version 0 after loading 1"),
                "{reason}"
            );
        }
        other => bail!("expected a protocol error, got {other:?}"),
    }
    assert_eq!(engine.policy_version(), 0);
    Ok(())
}

#[tokio::test]
async fn a_missing_checkpoint_is_rejected_with_the_engines_message() -> anyhow::Result<()> {
    let fake = Fake::start("vllm_server.py", &[])?;
    let engine = engine(&fake)?;
    let weights = WeightsRef {
        version: 1,
        uri: "/nonexistent/rollfleet/step-1".into(),
        format: "safetensors".into(),
        sha256: String::new(),
    };
    match engine.update_weights(&weights).await {
        Err(EngineError::Rejected {
            endpoint,
            status,
            message,
        }) => {
            assert!(endpoint.ends_with("/update_weights"), "{endpoint}");
            assert_eq!(status, 400);
            assert!(
                message.contains("must be a local directory: /nonexistent/rollfleet/step-1"),
                "{message}"
            );
        }
        other => bail!("expected a rejection, got {other:?}"),
    }
    assert!(fake.paths().ends_with(&["/resume".to_owned()]));
    Ok(())
}

#[tokio::test]
async fn chat_turn_tokens_are_the_engines_template_delta_after_an_assistant_turn()
-> anyhow::Result<()> {
    let fake = Fake::start("vllm_server.py", &[])?;
    let engine = engine(&fake)?;
    let first = [
        ChatMessage::new("system", "you play a game"),
        ChatMessage::new("user", "hello there"),
    ];
    let tokens = chat_turn_tokens(&engine, true, &first, None).await?;
    assert_eq!(tokens, engine.tokenize_chat(&first, true).await?);
    let without_prompt = engine.tokenize_chat(&first, false).await?;
    assert!(tokens.starts_with(&without_prompt) && tokens.len() > without_prompt.len());
    fake::assert_turns_render_the_whole_conversation(&engine).await?;
    Ok(())
}

#[tokio::test]
async fn dropping_a_generation_mid_way_returns_at_once_and_the_engine_keeps_serving()
-> anyhow::Result<()> {
    let fake = Fake::start("vllm_server.py", &["--token-delay-ms", "50", "--never-eos"])?;
    let engine = engine(&fake)?;
    let mut stream = engine.generate(request("long-one", vec![1, 2, 3], 400, 0));
    let early = tokio::time::timeout(Duration::from_millis(300), stream.next()).await;
    assert!(
        early.is_err(),
        "a 20 s generation cannot be over after 300 ms"
    );
    drop(stream);
    let served = tokio::time::timeout(Duration::from_secs(5), engine.served_weight_version())
        .await
        .context("the engine hangs after an abort")??;
    assert_eq!(served, Some(0));
    Ok(())
}
