//! The emulated engine's cost behaviour, on tokio's paused clock (time advances only when every
//! task waits, so the measured durations are the model's, not the machine's load).

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::time::Duration;

use futures_util::StreamExt;
use rollfleet_engine::emulated::{EmulatedConfig, EmulatedEngine};
use rollfleet_engine::{Engine, EngineError, GenerateEvent, GenerateRequest, Prompt};
use rollfleet_fleet::hardware::{HardwareModel, ModelCosts};
use tokio::time::Instant;

/// 2 GB of weights at 1 TB/s: a lone decode takes 2 ms a token; 1 PFLOP/s of compute.
fn config(kv_capacity_tokens: u64, time_scale: f64) -> EmulatedConfig {
    EmulatedConfig {
        gpus: 1,
        peak_flops: 1e15,
        bandwidth: 1e12,
        hardware: HardwareModel {
            compute_efficiency: 1.0,
            bandwidth_efficiency: 1.0,
            ..HardwareModel::default()
        },
        costs: ModelCosts {
            flops_per_token: 2e9,
            attention_flops_per_context: 0.0,
            active_weight_bytes: 2e9,
            weight_reads: rollfleet_fleet::hardware::WeightReads::dense(2e9),
            kv_bytes_per_token: 0.0,
        },
        kv_capacity_tokens,
        max_seqs: 64,
        link_bytes_per_s: 1e9,
        weight_bytes: 4_000_000_000,
        time_scale,
    }
}

fn close(actual: Duration, expected_s: f64) -> bool {
    (actual.as_secs_f64() - expected_s).abs() < expected_s * 0.02 + 0.002
}

#[tokio::test(start_paused = true)]
async fn a_lone_decode_takes_the_weight_read_time_per_token() {
    let engine = EmulatedEngine::start(config(100_000, 1.0));
    let start = Instant::now();
    let out = engine.run(10, 0, Some(100)).await.unwrap();
    assert_eq!(out.tokens, 100);
    assert!(out.emulated);
    assert!(close(start.elapsed(), 0.2), "{:?}", start.elapsed());
}

#[tokio::test(start_paused = true)]
async fn a_bigger_batch_generates_more_tokens_per_second() {
    let engine = EmulatedEngine::start(config(100_000, 1.0));
    let start = Instant::now();
    engine.run(10, 0, Some(100)).await.unwrap();
    let alone = 100.0 / start.elapsed().as_secs_f64();

    let start = Instant::now();
    let runs: Vec<_> = (0..16).map(|_| engine.run(10, 0, Some(100))).collect();
    let outs = futures_util::future::join_all(runs).await;
    assert!(
        outs.iter()
            .all(|o| o.as_ref().is_ok_and(|o| o.tokens == 100))
    );
    let batched = 1600.0 / start.elapsed().as_secs_f64();
    // Sixteen sequences share each weight read: sixteen times the tokens per second.
    assert!(
        batched > 12.0 * alone,
        "alone {alone:.0} tok/s, batched {batched:.0} tok/s"
    );
}

#[tokio::test(start_paused = true)]
async fn kv_capacity_holds_back_admission_until_a_sequence_finishes() {
    // Each request needs 600 KV tokens (100 of context + 500 to generate): two cannot fit in 1000.
    let engine = EmulatedEngine::start(config(1000, 1.0));
    let start = Instant::now();
    let (a, b) = tokio::join!(engine.run(100, 0, Some(500)), engine.run(100, 0, Some(500)));
    assert_eq!(a.unwrap().tokens, 500);
    assert_eq!(b.unwrap().tokens, 500);
    // One after the other: 2 x 500 tokens x 2 ms, not 1 s as a shared batch would take.
    assert!(close(start.elapsed(), 2.0), "{:?}", start.elapsed());

    let big = engine.run(600, 0, Some(500)).await;
    assert!(
        matches!(big, Err(EngineError::Rejected { status: 413, .. })),
        "{big:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_aborted_request_frees_its_kv_for_the_next_one_at_once() {
    let engine = EmulatedEngine::start(config(1000, 1.0));
    let first = engine.run(100, 0, Some(500));
    let second = engine.run(100, 0, Some(500));
    tokio::pin!(second);
    let start = Instant::now();
    // Abort the first after 0.1 s by dropping it; the second is then admitted and takes 1 s.
    // Biased: the first request is submitted (on its first poll) before the second.
    tokio::select! {
        biased;
        _ = first => panic!("the first request cannot finish in 0.1 s"),
        _ = &mut second => panic!("the second request cannot run while the first holds the KV"),
        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
    }
    let load = engine.load().await;
    assert_eq!(
        (load.queued, load.running),
        (0, 1),
        "the second took the freed KV at once"
    );
    assert_eq!(second.await.unwrap().tokens, 500);
    assert!(close(start.elapsed(), 1.1), "{:?}", start.elapsed());
}

#[tokio::test(start_paused = true)]
async fn prefill_is_compute_bound_and_scaled_time_runs_slower() {
    // 10,000 tokens x 2 GFLOP at 1 PFLOP/s = 20 ms modelled; at time scale 3, 60 ms of wall time.
    let engine = EmulatedEngine::start(config(100_000, 3.0));
    let start = Instant::now();
    let out = engine.run(0, 10_000, None).await.unwrap();
    assert_eq!(out.tokens, 0);
    assert!(close(start.elapsed(), 0.06), "{:?}", start.elapsed());
}

#[tokio::test(start_paused = true)]
async fn a_weight_update_takes_the_transfer_time_and_changes_the_version() {
    let engine = EmulatedEngine::start(config(100_000, 1.0));
    assert_eq!(engine.policy_version(), 0);
    let start = Instant::now();
    // 4 GB over 1 GB/s.
    engine.update_weights(&weights(1)).await.unwrap();
    assert!(close(start.elapsed(), 4.0), "{:?}", start.elapsed());
    assert_eq!(engine.policy_version(), 1);
    assert_eq!(engine.run(0, 0, Some(5)).await.unwrap().policy_version, 1);
}

#[tokio::test(start_paused = true)]
async fn the_engine_trait_says_every_output_is_emulated_and_reuses_the_session_prefix() {
    let engine = EmulatedEngine::start(config(100_000, 1.0));
    assert_eq!(engine.backend(), "emulated");
    let request = |prompt: Vec<u32>| GenerateRequest {
        request_id: "r".into(),
        session: "traj-7".into(),
        prompt: Prompt::Tokens(prompt),
        max_tokens: 20,
        temperature: 1.0,
        stop: vec![],
        policy_version: 0,
    };
    let events: Vec<_> = engine.generate(request(vec![1; 300])).collect().await;
    let Some(Ok(GenerateEvent::Finished(done))) = events.last() else {
        panic!("{events:?}")
    };
    assert!(done.emulated);
    assert_eq!(done.completion_tokens, Some(20));
    assert_eq!(done.cached_prompt_tokens, Some(0));
    let Some(Ok(GenerateEvent::Delta {
        text, token_ids, ..
    })) = events.first()
    else {
        panic!("{events:?}")
    };
    assert!(text.contains("emulated"));
    assert_eq!(token_ids.len(), 20);

    // The next turn's prompt extends the first: the 320 tokens already held are not prefilled.
    let events: Vec<_> = engine.generate(request(vec![1; 400])).collect().await;
    let Some(Ok(GenerateEvent::Finished(done))) = events.last() else {
        panic!("{events:?}")
    };
    assert_eq!(done.cached_prompt_tokens, Some(320));

    let mut stale = request(vec![1; 10]);
    stale.policy_version = 3;
    let events: Vec<_> = engine.generate(stale).collect().await;
    assert!(matches!(
        events[0],
        Err(EngineError::Rejected { status: 409, .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn an_aborted_request_keeps_its_tokens_and_a_resume_decodes_only_the_rest() {
    let engine = EmulatedEngine::start(config(100_000, 1.0));
    let start = Instant::now();
    let request = engine.submit(10, 0, Some(500));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let partial = request.abort().await.unwrap().unwrap();
    // 2 ms a token alone: about 150 tokens in 0.3 s, all kept.
    assert!((148..=151).contains(&partial.generated), "{partial:?}");
    assert_eq!(partial.context, 10 + partial.generated);
    assert_eq!(partial.remaining, Some(500 - partial.generated));
    let load = engine.load().await;
    assert_eq!((load.queued, load.running), (0, 0));
    // Parked: the context and the tokens so far, not the room for the rest of the answer.
    assert_eq!(load.kv_used_tokens, partial.context);

    let resumed = engine.resume(partial).wait().await.unwrap();
    assert_eq!(partial.generated + resumed.tokens, 500);
    // The whole answer took what it would have without the abort: nothing was computed twice.
    assert!(close(start.elapsed(), 1.0), "{:?}", start.elapsed());
    assert_eq!(engine.load().await.kv_used_tokens, 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_resumed_after_a_weight_update_prefills_its_context_again_with_the_new_weights() {
    let engine = EmulatedEngine::start(config(1_000_000, 1.0));
    // 50,000 tokens x 2 GFLOP at 1 PFLOP/s: a 0.1 s prefill, then 2 ms a token.
    let request = engine.submit(0, 50_000, Some(500));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let partial = request.abort().await.unwrap().unwrap();
    assert!((148..=151).contains(&partial.generated), "{partial:?}");
    assert_eq!(partial.policy_version, 0);
    engine.update_weights(&weights(1)).await.unwrap();
    // The parked cache was computed by version 0: the update dropped it.
    assert_eq!(engine.load().await.kv_used_tokens, 0);

    let start = Instant::now();
    let resumed = engine.resume(partial).wait().await.unwrap();
    assert_eq!(resumed.policy_version, 1);
    assert_eq!(partial.generated + resumed.tokens, 500);
    // Prefill of the 50,000-token prompt plus the partial answer again, then the rest.
    let expected = (50_000 + partial.generated) as f64 * 2e-6 + resumed.tokens as f64 * 0.002;
    assert!(close(start.elapsed(), expected), "{:?}", start.elapsed());
}

#[tokio::test(start_paused = true)]
async fn a_request_aborted_during_its_prefill_keeps_only_what_was_cached() {
    let engine = EmulatedEngine::start(config(1_000_000, 1.0));
    let request = engine.submit(1_000, 50_000, Some(100));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let partial = request.abort().await.unwrap().unwrap();
    assert_eq!(partial.generated, 0);
    assert_eq!(partial.context, 51_000);
    assert_eq!(engine.load().await.kv_used_tokens, 1_000);
    // Released instead of resumed: the parked cache is freed.
    engine.release(partial);
    assert_eq!(engine.load().await.kv_used_tokens, 0);
}

#[tokio::test(start_paused = true)]
async fn a_report_hands_over_the_load_and_each_sample_once() {
    let engine = EmulatedEngine::start(config(100_000, 1.0));
    let out = engine.run(10, 0, Some(100)).await.unwrap();
    assert_eq!(out.tokens, 100);
    let (load, samples) = engine.report().await;
    assert_eq!(
        (load.queued, load.running, load.tokens_generated),
        (0, 0, 100)
    );
    // A lone decode at 2 ms a token: every decode sample is that iteration, timed by the model.
    let decode: Vec<_> = samples
        .iter()
        .filter(|m| m.kind == rollfleet_fleet::hardware::WorkKind::Decode)
        .collect();
    assert!(!decode.is_empty(), "{samples:?}");
    assert!(
        decode.iter().all(|m| (m.seconds - 2e-3).abs() < 1e-9),
        "{decode:?}"
    );
    // Taken: the next report has none, and the load is the same.
    let (again, none) = engine.report().await;
    assert!(none.is_empty(), "{none:?}");
    assert_eq!(again, load);
}

fn weights(version: u64) -> rollfleet_engine::WeightsRef {
    rollfleet_engine::WeightsRef {
        version,
        uri: "emulated".into(),
        format: String::new(),
        sha256: String::new(),
    }
}

#[tokio::test]
async fn the_emulated_engines_synthetic_template_gives_a_delta_after_an_assistant_turn() {
    let engine = EmulatedEngine::start(config(100_000, 0.001));
    let turn = [rollfleet_engine::ChatMessage::new("user", "the door opens")];
    let delta = rollfleet_engine::chat_turn_tokens(&engine, false, &turn, None)
        .await
        .unwrap();
    assert!(!delta.is_empty());
    assert_eq!(delta, engine.tokenize_chat(&turn, true).await.unwrap());
    assert!(delta.iter().all(|t| *t < 32_000));
    assert_eq!(
        engine.served_weight_version().await.unwrap(),
        Some(engine.policy_version())
    );
}
