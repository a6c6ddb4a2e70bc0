//! The SGLang backend against `tests/fakes/sglang_server.py`, a fake SGLang speaking the native
//! HTTP API over a toy model, run as a real process: token-in/token-out generation with logprobs
//! and the engine's weight version, weight updates checked by reading the version back, the
//! engine's failures, chat-template deltas and aborts.

mod fake;

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use fake::{Fake, generated, request, run, scratch_dir};
use futures_util::StreamExt;
use rollfleet_engine::sglang::{PauseMode, SglangConfig, SglangEngine};
use rollfleet_engine::{ChatMessage, Engine, EngineError, WeightsRef, chat_turn_tokens};

fn engine(fake: &Fake, chat_tokenizer_url: Option<String>) -> anyhow::Result<SglangEngine> {
    let config = SglangConfig {
        request_timeout: Duration::from_secs(20),
        update_timeout: Duration::from_secs(20),
        chat_tokenizer_url,
        ..SglangConfig::new(fake.url.clone())
    };
    Ok(SglangEngine::new(config, 0)?)
}

fn checkpoint(name: &str, content: &str) -> anyhow::Result<WeightsRef> {
    let dir = scratch_dir("ckpt")?;
    let path = dir.join(name);
    std::fs::write(&path, content)?;
    Ok(WeightsRef {
        version: 0,
        uri: format!("file://{}", path.display()),
        format: "safetensors".into(),
        sha256: String::new(),
    })
}

#[tokio::test]
async fn generation_returns_the_engines_exact_tokens_logprobs_and_weight_version()
-> anyhow::Result<()> {
    let fake = Fake::start("sglang_server.py", &[])?;
    let engine = engine(&fake, None)?;
    let (ids, logprobs, done) = run(&engine, request("r1", vec![5, 6, 7], 12, 0)).await?;
    let record = fake.wait_for("/generate", Duration::from_secs(5)).await?;
    let (want_ids, want_logprobs) = generated(&record)?;
    ensure!(!ids.is_empty() && ids.len() <= 12);
    assert_eq!(ids, want_ids);
    assert_eq!(logprobs, want_logprobs);
    assert!(logprobs.iter().all(|l| *l < 0.0));
    assert_eq!(record["rid"], "r1");
    assert_eq!(done.engine_weight_version, Some(0));
    assert_eq!(done.prompt_tokens, Some(3));
    assert_eq!(done.completion_tokens, Some(ids.len() as u32));
    assert!(!done.emulated);
    Ok(())
}

#[tokio::test]
async fn a_weight_update_is_read_back_from_the_engine_and_changes_what_it_generates()
-> anyhow::Result<()> {
    let fake = Fake::start("sglang_server.py", &[])?;
    let engine = engine(&fake, None)?;
    let (before, _, _) = run(&engine, request("a", vec![9, 9, 9], 16, 0)).await?;
    let weights = WeightsRef {
        version: 1,
        ..checkpoint("step-1.safetensors", "weights of step 1")?
    };
    engine.update_weights(&weights).await?;
    assert_eq!(engine.policy_version(), 1);
    assert_eq!(engine.served_weight_version().await?, Some(1));
    let update = fake.records("/update_weights_from_disk");
    assert_eq!(update.len(), 1);
    assert_eq!(update[0]["requested_version"], "1");
    assert_eq!(update[0]["model_path"], weights.local_path());
    let paths = fake.paths();
    let at = paths
        .iter()
        .position(|p| p == "/update_weights_from_disk")
        .context("no update")?;
    assert_eq!(paths[at + 1], "/get_weight_version");

    let (after, _, done) = run(&engine, request("b", vec![9, 9, 9], 16, 1)).await?;
    assert_eq!(done.engine_weight_version, Some(1));
    assert_ne!(before, after, "new weights, same context: other tokens");
    Ok(())
}

#[tokio::test]
async fn a_failing_update_is_an_error_naming_the_endpoint_and_the_next_one_succeeds()
-> anyhow::Result<()> {
    let fake = Fake::start("sglang_server.py", &["--fail-updates", "1"])?;
    let engine = engine(&fake, None)?;
    let weights = WeightsRef {
        version: 1,
        ..checkpoint("w", "step 1")?
    };
    match engine.update_weights(&weights).await {
        Err(EngineError::Rejected {
            endpoint,
            status,
            message,
        }) => {
            assert!(
                endpoint.ends_with("/update_weights_from_disk"),
                "{endpoint}"
            );
            assert_eq!(status, 400);
            assert!(message.contains("simulated failure"), "{message}");
        }
        other => bail!("expected a rejection, got {other:?}"),
    }
    assert_eq!(engine.policy_version(), 0);
    assert_eq!(engine.served_weight_version().await?, Some(0));
    engine.update_weights(&weights).await?;
    assert_eq!(engine.policy_version(), 1);
    Ok(())
}

#[tokio::test]
async fn an_engine_that_keeps_its_old_weights_is_caught_by_the_version_read_back()
-> anyhow::Result<()> {
    let fake = Fake::start("sglang_server.py", &["--keep-old-weights"])?;
    let engine = engine(&fake, None)?;
    let weights = WeightsRef {
        version: 1,
        ..checkpoint("w", "step 1")?
    };
    match engine.update_weights(&weights).await {
        Err(EngineError::Protocol { endpoint, reason }) => {
            assert!(endpoint.ends_with("/get_weight_version"), "{endpoint}");
            assert!(
                reason.contains("engine reports version 0 after loading 1"),
                "{reason}"
            );
        }
        other => bail!("expected a protocol error, got {other:?}"),
    }
    assert_eq!(engine.policy_version(), 0, "the label does not move");
    Ok(())
}

#[tokio::test]
async fn a_missing_checkpoint_is_rejected_with_the_engines_message() -> anyhow::Result<()> {
    let fake = Fake::start("sglang_server.py", &[])?;
    let engine = engine(&fake, None)?;
    let weights = WeightsRef {
        version: 1,
        uri: "/nonexistent/rollfleet/step-1".into(),
        format: "hf-dir".into(),
        sha256: String::new(),
    };
    match engine.update_weights(&weights).await {
        Err(EngineError::Rejected { message, .. }) => {
            assert!(
                message.contains("Failed to get weights iterator"),
                "{message}"
            );
            assert!(
                message.contains("/nonexistent/rollfleet/step-1"),
                "{message}"
            );
        }
        other => bail!("expected a rejection, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn chat_turns_use_a_chat_tokenizer_because_sglangs_tokenize_takes_text_only()
-> anyhow::Result<()> {
    let sglang = Fake::start("sglang_server.py", &[])?;
    let messages = [ChatMessage::new("user", "hello there")];
    let plain = engine(&sglang, None)?;
    assert!(matches!(
        plain.tokenize_chat(&messages, true).await,
        Err(EngineError::Unsupported(_))
    ));

    // The same model's template, served by a vLLM-style chat /tokenize.
    let tokenizer = Fake::start("vllm_server.py", &[])?;
    let engine = engine(&sglang, Some(tokenizer.url.clone()))?;
    let first = chat_turn_tokens(&engine, true, &messages, None).await?;
    assert_eq!(first, engine.tokenize_chat(&messages, true).await?);
    fake::assert_turns_render_the_whole_conversation(&engine).await?;
    Ok(())
}

#[tokio::test]
async fn dropping_a_generation_mid_way_returns_at_once_and_aborts_it_on_the_engine()
-> anyhow::Result<()> {
    let fake = Fake::start(
        "sglang_server.py",
        &["--token-delay-ms", "50", "--never-eos"],
    )?;
    let engine = engine(&fake, None)?;
    let mut stream = engine.generate(request("long-one", vec![1, 2, 3], 400, 0));
    let early = tokio::time::timeout(Duration::from_millis(300), stream.next()).await;
    assert!(
        early.is_err(),
        "a 20 s generation cannot be over after 300 ms"
    );
    drop(stream);
    let abort = fake
        .wait_for("/abort_request", Duration::from_secs(5))
        .await?;
    assert_eq!(abort["rid"], "long-one");
    fake.wait_for("/generate", Duration::from_secs(5)).await?;
    let finished = fake
        .records("/generate")
        .into_iter()
        .find(|r| r.get("finish_reason").is_some())
        .context("the generation was not logged")?;
    assert_eq!(finished["finish_reason"]["type"], "abort");
    Ok(())
}

#[tokio::test]
async fn a_paused_engine_holds_generations_until_it_continues() -> anyhow::Result<()> {
    let fake = Fake::start("sglang_server.py", &[])?;
    let engine = std::sync::Arc::new(engine(&fake, None)?);
    engine.pause_generation(PauseMode::Abort).await?;
    let held = {
        let engine = engine.clone();
        tokio::spawn(async move { run(engine.as_ref(), request("p", vec![4], 4, 0)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!held.is_finished());
    engine.continue_generation().await?;
    let (ids, _, _) = tokio::time::timeout(Duration::from_secs(5), held).await???;
    assert!(!ids.is_empty());
    engine.flush_cache().await?;
    engine.abort_request("nothing").await?;
    Ok(())
}
