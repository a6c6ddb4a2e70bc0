//! Real engines driven token-in, token-out (SGLang's native API, vLLM's completions with token-id
//! prompts), one engine endpoint per inference replica.
//!
//! A node may front several engines (`--engine-url` given more than once): each replica the
//! scheduler places on the node takes the first endpoint no other replica holds, the first time
//! work for it arrives, and keeps it until the replica is stopped. A replica's weight sync
//! therefore loads weights into exactly one engine, so "replica by replica" holds on a real
//! fleet: while one engine loads, the others keep generating.
//!
//! A generation sends the trajectory's tokens so far (`GenerationWork.context_tokens`, exactly as
//! earlier turns produced them) followed by the tokens the model's chat template gives this
//! turn's new messages (tokenized by the engine, [`rollfleet_engine::chat_turn_tokens`]), and
//! returns the engine's sampled ids, their log-probabilities, the template tokens, and the weight
//! version the engine reported. The scheduler compares that version with the turn's stamp.
//!
//! Weight syncs of a published version load the trainer's checkpoint (`update_weights`, which
//! returns only once the engine itself reports the new version). These engines
//! serve real weights, so they need a job whose trainer publishes some (`rl.trainer: external`);
//! the node refuses the emulated trainer's jobs at registration.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};

use rollfleet_engine::{
    ChatMessage, Engine, EngineError, FinishReason, GenerateEvent, GenerateRequest, Prompt,
    WeightsRef,
};
use rollfleet_proto::v1::{
    GenerationWork, StageOutput, WeightSyncWork, WorkAssignment, stage_failure::Cause, work_result,
};
use tokio_stream::StreamExt;

use crate::{
    EngineChoice, InFlight, Interrupt, NodeError, WorkerOptions, engine_failure, failure,
    openai_backend,
};

/// Engines of one kind serving this node's replicas, one endpoint each.
pub struct TokenBackend {
    /// `"sglang"` or `"vllm"` (what the node registers as its backend).
    pub kind: &'static str,
    endpoints: Vec<Arc<dyn Engine>>,
    urls: Vec<String>,
    /// Which endpoint each replica holds.
    assigned: Mutex<BTreeMap<u64, usize>>,
    temperature: f32,
    /// Requests in flight (the node's load).
    pub in_flight: AtomicU32,
}

impl TokenBackend {
    /// A backend over `endpoints` (with their URLs, for messages).
    pub fn new(
        kind: &'static str,
        endpoints: Vec<(String, Arc<dyn Engine>)>,
        temperature: f32,
    ) -> TokenBackend {
        let (urls, endpoints) = endpoints.into_iter().unzip();
        TokenBackend {
            kind,
            endpoints,
            urls,
            assigned: Mutex::new(BTreeMap::new()),
            temperature,
            in_flight: AtomicU32::new(0),
        }
    }

    /// The engine URLs, in order.
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// The engine serving `replica`: the one it holds, or the first free one.
    pub fn endpoint(&self, replica: u64) -> Result<Arc<dyn Engine>, String> {
        let mut assigned = self.assigned.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&i) = assigned.get(&replica) {
            return Ok(self.endpoints[i].clone());
        }
        let taken: BTreeSet<usize> = assigned.values().copied().collect();
        let Some(free) = (0..self.endpoints.len()).find(|i| !taken.contains(i)) else {
            return Err(format!(
                "replica {replica}: this node fronts {} engine endpoint(s) ({}), each serving \
                 another replica ({}); give the worker one --engine-url per replica it serves",
                self.endpoints.len(),
                self.urls.join(", "),
                assigned
                    .iter()
                    .map(|(r, i)| format!("replica {r} on {}", self.urls[*i]))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        };
        tracing::info!(
            "worker: replica {replica} is served by the {} engine at {}",
            self.kind,
            self.urls[free]
        );
        assigned.insert(replica, free);
        Ok(self.endpoints[free].clone())
    }

    /// Frees the endpoint of a replica the scheduler stopped.
    pub fn release(&self, replica: u64) {
        self.assigned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&replica);
    }
}

/// The SGLang or vLLM engines of `--engine sglang|vllm`, one per URL; `None` for other engines.
pub(crate) async fn backend(opts: &WorkerOptions) -> Result<Option<TokenBackend>, NodeError> {
    use rollfleet_engine::sglang::{SglangConfig, SglangEngine};
    use rollfleet_engine::vllm::{VllmConfig, VllmEngine};
    let api_key = std::env::var("ROLLFLEET_ENGINE_API_KEY")
        .ok()
        .filter(|k| !k.is_empty());
    let engine_error = |e: EngineError| NodeError::Engine(e.to_string());
    match &opts.engine {
        EngineChoice::Sglang {
            urls,
            chat_tokenizer,
            temperature,
            update_timeout,
        } => {
            let mut endpoints: Vec<(String, Arc<dyn Engine>)> = Vec::new();
            for url in urls {
                let config = SglangConfig {
                    api_key: api_key.clone(),
                    chat_tokenizer_url: Some(chat_tokenizer.clone().unwrap_or_else(|| url.clone())),
                    update_timeout: *update_timeout,
                    ..SglangConfig::new(url.clone())
                };
                let engine = SglangEngine::new(config, 0).map_err(engine_error)?;
                endpoints.push((url.clone(), Arc::new(engine)));
            }
            Ok(Some(TokenBackend::new("sglang", endpoints, *temperature)))
        }
        EngineChoice::Vllm {
            urls,
            model,
            temperature,
            update_timeout,
        } => {
            let model = match (model, urls.first()) {
                (Some(m), _) => m.clone(),
                (None, Some(url)) => openai_backend(url, None, *temperature, opts.connect_timeout)
                    .await?
                    .engine
                    .model()
                    .to_owned(),
                (None, None) => {
                    return Err(NodeError::Engine("--engine vllm needs --engine-url".into()));
                }
            };
            let mut endpoints: Vec<(String, Arc<dyn Engine>)> = Vec::new();
            for url in urls {
                let config = VllmConfig {
                    api_key: api_key.clone(),
                    update_timeout: *update_timeout,
                    ..VllmConfig::new(url.clone(), model.clone())
                };
                let engine = VllmEngine::new(config, 0).map_err(engine_error)?;
                endpoints.push((url.clone(), Arc::new(engine)));
            }
            Ok(Some(TokenBackend::new("vllm", endpoints, *temperature)))
        }
        _ => Ok(None),
    }
}

/// One generation stage, token-in, token-out.
pub(crate) async fn generate(
    backend: &TokenBackend,
    a: &WorkAssignment,
    g: &GenerationWork,
    mut interrupt: Interrupt,
) -> Result<StageOutput, work_result::Outcome> {
    let engine = backend
        .endpoint(g.replica)
        .map_err(|m| failure(Cause::Invalid, m))?;
    if g.prefill_only {
        // The engine prefills as part of the generation, and no KV cache moves between
        // engines: the generation stage that follows sends the whole context.
        return Ok(StageOutput {
            policy_version: engine.policy_version(),
            text: format!(
                "[prefill: done by the {} engine with the generation]",
                backend.kind
            ),
            ..Default::default()
        });
    }
    let resumed = g.resumed_tokens > 0;
    if g.new_messages.is_empty() && !resumed {
        return Err(failure(
            Cause::Invalid,
            "generation.new_messages: empty; a token-in engine needs the turn's new messages (the \
             scheduler sends them to workers registered with backend \"sglang\" or \"vllm\")",
        ));
    }
    if resumed && g.resumed_tokens > g.context_tokens.len() as u64 {
        return Err(failure(
            Cause::Invalid,
            format!(
                "generation.resumed_tokens: {} resumed tokens but only {} context tokens",
                g.resumed_tokens,
                g.context_tokens.len()
            ),
        ));
    }
    // A resumed turn's context already ends with its template and the answer so far: the
    // engine goes on from there.
    let prompt_tokens = if resumed {
        Vec::new()
    } else {
        let messages: Vec<ChatMessage> = g
            .new_messages
            .iter()
            .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
            .collect();
        let first = g.context_tokens.is_empty();
        let context_end = g.context_tokens.last().copied();
        rollfleet_engine::chat_turn_tokens(engine.as_ref(), first, &messages, context_end)
            .await
            .map_err(engine_failure)?
    };
    let mut prompt = g.context_tokens.clone();
    prompt.extend_from_slice(&prompt_tokens);
    let traj = a.trajectory.clone().unwrap_or_default();
    let request_id = format!(
        "{}-{}.{}-turn{}-a{}",
        traj.job, traj.id, traj.attempt, a.turn, a.assignment_id
    );
    let request = GenerateRequest {
        request_id: request_id.clone(),
        session: g.session.clone(),
        prompt: Prompt::Tokens(prompt),
        max_tokens: g.max_new_tokens.max(1),
        temperature: backend.temperature,
        stop: Vec::new(),
        policy_version: a.policy_version,
    };
    let _in_flight = InFlight::enter(&backend.in_flight);
    // Dropping the stream (an abort drops this whole task) aborts the request.
    let mut stream = engine.generate(request);
    let (mut text, mut tokens, mut logprobs) = (String::new(), Vec::new(), Vec::new());
    let mut asked = false;
    loop {
        let event = tokio::select! {
            event = stream.next() => event,
            () = interrupt.asked(), if !asked => {
                asked = true;
                // The engine answers the pending request with what it had; one that cannot
                // stop a single request finishes it.
                if let Err(e) = engine.interrupt(&request_id).await {
                    tracing::warn!("worker: {request_id} runs to its end: {e}");
                }
                continue;
            }
        };
        let Some(event) = event else { break };
        match event.map_err(engine_failure)? {
            GenerateEvent::Delta {
                text: delta,
                token_ids,
                logprobs: l,
            } => {
                text.push_str(&delta);
                tokens.extend(token_ids);
                logprobs.extend(l);
            }
            GenerateEvent::Finished(done) => {
                if logprobs.len() != tokens.len() {
                    return Err(failure(
                        Cause::Infrastructure,
                        format!(
                            "{} engine: {} log-probabilities for {} generated tokens",
                            backend.kind,
                            logprobs.len(),
                            tokens.len()
                        ),
                    ));
                }
                return Ok(StageOutput {
                    token_count: tokens.len() as u64,
                    tokens,
                    logprobs,
                    prompt_tokens,
                    text,
                    policy_version: done.policy_version,
                    emulated: done.emulated,
                    engine_weight_version: done.engine_weight_version,
                    interrupted: done.finish_reason == FinishReason::Aborted,
                    ..Default::default()
                });
            }
        }
    }
    Err(failure(
        Cause::Infrastructure,
        format!(
            "{} engine: the generation ended without a finish",
            backend.kind
        ),
    ))
}

/// One weight sync of one replica's engine.
pub async fn weight_sync(
    backend: &TokenBackend,
    w: &WeightSyncWork,
) -> Result<StageOutput, work_result::Outcome> {
    let engine = backend
        .endpoint(w.replica)
        .map_err(|m| failure(Cause::Invalid, m))?;
    if w.source.starts_with("emulated://") && w.to_version == 0 {
        // The initial weights are those the engine was started with: a replica placed anew
        // before the first publication (a re-plan, a moved replica) keeps them, if that is what
        // its engine still serves.
        let served = engine
            .served_weight_version()
            .await
            .map_err(engine_failure)?;
        return match served {
            Some(0) => Ok(StageOutput {
                policy_version: 0,
                ..Default::default()
            }),
            other => Err(failure(
                Cause::Infrastructure,
                format!(
                    "weight sync of replica {} to version 0: its {} engine serves version {}, \
                     not the initial weights; restart it on the base model",
                    w.replica,
                    backend.kind,
                    other.map_or_else(|| "unknown".to_owned(), |v| v.to_string())
                ),
            )),
        };
    }
    if w.source.starts_with("emulated://") {
        return Err(failure(
            Cause::Invalid,
            format!(
                "weight sync of replica {} to version {}: the emulated trainer publishes no \
                 weights for a {} engine to load (run the job with rl.trainer: external)",
                w.replica, w.to_version, backend.kind
            ),
        ));
    }
    let weights = WeightsRef {
        version: w.to_version,
        uri: w.source.clone(),
        format: w.format.clone(),
        sha256: w.sha256.clone(),
    };
    // Returns once the engine itself reports the new version: an engine that said it loaded and
    // did not fails here, before any turn is stamped with the new version.
    engine
        .update_weights(&weights)
        .await
        .map_err(engine_failure)?;
    Ok(StageOutput {
        policy_version: w.to_version,
        ..Default::default()
    })
}
