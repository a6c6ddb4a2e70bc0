//! The real engine behind the OpenAI completions API: the backend every replica of the node
//! shares, a turn's generation streamed from it, and its weight updates.

use super::*;

/// A real engine serving every replica placed on this node.
pub(crate) struct OpenAiBackend {
    pub(crate) engine: OpenAiEngine,
    pub(crate) temperature: f32,
    /// Requests in flight (the node's load).
    pub(crate) in_flight: AtomicU32,
    /// Decode timings measured since the last load report (see [`DecodeTiming`]).
    pub(crate) samples: Mutex<Vec<ProfileSample>>,
}

/// Connects to the OpenAI-compatible engine; without a model name, takes the first model the
/// engine lists (retrying until `connect_timeout`: an engine may still be loading its weights).
pub(crate) async fn openai_backend(
    url: &str,
    model: Option<&str>,
    temperature: f32,
    connect_timeout: Duration,
) -> Result<OpenAiBackend, NodeError> {
    let config = |model: String| OpenAiConfig {
        base_url: url.to_owned(),
        model,
        api_key: std::env::var("ROLLFLEET_ENGINE_API_KEY")
            .ok()
            .filter(|k| !k.is_empty()),
        connect_timeout: Duration::from_secs(5),
        return_token_ids: false,
        // Weights come from the scheduler's weight-sync assignments; see `weight_sync`.
        weight_update: WeightUpdate::Unsupported,
    };
    let engine = |model: String| {
        OpenAiEngine::new(config(model), 0).map_err(|e| NodeError::Engine(e.to_string()))
    };
    let model = match model {
        Some(m) => m.to_owned(),
        None => {
            let probe = engine(String::new())?;
            let deadline = tokio::time::Instant::now() + connect_timeout;
            loop {
                match probe.served_models().await {
                    Ok(models) => match models.into_iter().next() {
                        Some(m) => break m,
                        None => {
                            return Err(NodeError::Engine(format!(
                                "{url}/v1/models lists no model; pass --model"
                            )));
                        }
                    },
                    Err(e @ EngineError::Unavailable { .. })
                        if tokio::time::Instant::now() < deadline =>
                    {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(NodeError::Engine(e.to_string())),
                }
            }
        }
    };
    Ok(OpenAiBackend {
        engine: engine(model)?,
        temperature,
        in_flight: AtomicU32::new(0),
        samples: Mutex::new(Vec::new()),
    })
}

/// One generation stage on the OpenAI-compatible engine: the scheduler's rendered context in,
/// the engine's text out (with its own token count).
pub(crate) async fn generate_openai(
    backend: &OpenAiBackend,
    a: &WorkAssignment,
    g: &GenerationWork,
    costs: &ModelCosts,
    gpus: u32,
) -> Result<StageOutput, work_result::Outcome> {
    let engine = &backend.engine;
    if g.prefill_only {
        // Over the OpenAI API an engine prefills as part of the generation, and no KV cache moves
        // between engines: the generation stage that follows sends the whole context.
        return Ok(StageOutput {
            policy_version: engine.policy_version(),
            text: "[prefill: done by the OpenAI-compatible engine with the generation]".into(),
            ..Default::default()
        });
    }
    if g.prompt_text.is_empty() {
        return Err(failure(
            Cause::Invalid,
            "generation.prompt_text: empty; an OpenAI-compatible engine needs the turn's text (the \
             scheduler sends it to workers registered with backend \"openai\")",
        ));
    }
    let traj = a.trajectory.clone().unwrap_or_default();
    let request = GenerateRequest {
        request_id: format!(
            "{}-{}.{}-turn{}-a{}",
            traj.job, traj.id, traj.attempt, a.turn, a.assignment_id
        ),
        session: g.session.clone(),
        prompt: Prompt::Text(g.prompt_text.clone()),
        max_tokens: g.max_new_tokens.max(1),
        temperature: backend.temperature,
        stop: Vec::new(),
        // The version the engine serves now: the result says which one produced the text.
        policy_version: engine.policy_version(),
    };
    let _in_flight = InFlight::enter(&backend.in_flight);
    // Dropping the stream (an abort drops this whole task) closes the connection: an abort.
    let mut stream = engine.generate(request);
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let mut timing = DecodeTiming::default();
    while let Some(event) = stream.next().await {
        match event.map_err(engine_failure)? {
            GenerateEvent::Delta {
                text: delta,
                token_ids: ids,
                ..
            } => {
                if !delta.is_empty() || !ids.is_empty() {
                    timing.chunk(
                        tokio::time::Instant::now(),
                        backend.in_flight.load(Ordering::Relaxed),
                    );
                }
                text.push_str(&delta);
                token_ids.extend(ids);
            }
            GenerateEvent::Finished(done) => {
                let token_count = done
                    .completion_tokens
                    .map(u64::from)
                    .or_else(|| (!token_ids.is_empty()).then_some(token_ids.len() as u64))
                    .unwrap_or_else(|| tokens_of(&text));
                let prompt = done.prompt_tokens.map_or(g.prefill_token_count, u64::from);
                if let Some(sample) = timing.sample(costs, prompt, token_count, gpus) {
                    let mut samples = backend.samples.lock().unwrap_or_else(|p| p.into_inner());
                    if samples.len() >= MAX_SAMPLES_PER_REPORT {
                        samples.remove(0);
                    }
                    samples.push(sample);
                }
                return Ok(StageOutput {
                    tokens: token_ids,
                    text,
                    policy_version: done.policy_version,
                    emulated: done.emulated,
                    token_count,
                    ..Default::default()
                });
            }
        }
    }
    Err(failure(
        Cause::Infrastructure,
        format!(
            "{}: the generation stream ended without a finish",
            engine.base_url()
        ),
    ))
}

/// A weight sync on the OpenAI-compatible engine. Weights published by the emulated trainer
/// (`emulated://` sources) do not exist: the engine keeps its weights and the version is only
/// relabelled. Any other source is handed to the engine's update mechanism (which the OpenAI API
/// does not have: it fails, saying so).
pub(crate) async fn weight_sync_openai(
    backend: &OpenAiBackend,
    w: &rollfleet_proto::v1::WeightSyncWork,
) -> Result<StageOutput, work_result::Outcome> {
    if w.source.starts_with("emulated://") {
        backend.engine.relabel_version(w.to_version);
        return Ok(StageOutput {
            policy_version: w.to_version,
            text: format!(
                "[weights of version {} come from the emulated trainer: none loaded; the engine \
                 keeps its weights]",
                w.to_version
            ),
            ..Default::default()
        });
    }
    backend
        .engine
        .update_weights(&rollfleet_engine::WeightsRef {
            version: w.to_version,
            uri: w.source.clone(),
            format: w.format.clone(),
            sha256: w.sha256.clone(),
        })
        .await
        .map_err(engine_failure)?;
    Ok(StageOutput {
        policy_version: w.to_version,
        ..Default::default()
    })
}

pub(crate) fn tokens_of(text: &str) -> u64 {
    // About four bytes a token, as `agents`' default counter assumes.
    (text.len() as u64).div_ceil(4).max(1)
}
