//! The OpenAI-compatible backend: a real engine (vLLM, SGLang) behind `POST /v1/completions`,
//! streamed as server-sent events.
//!
//! Requests ask for `stream: true` with `stream_options.include_usage`, so the last chunk
//! carries the engine's own token counts (and, on vLLM and SGLang, the prefix-cache hits in
//! `usage.prompt_tokens_details.cached_tokens`). With `return_token_ids` the backend also asks
//! for token ids (vLLM's `return_token_ids` extension) and passes them on when present.
//! Dropping the event stream closes the connection, which both engines treat as an abort.
//!
//! Weight updates are not part of the OpenAI API. The backend implements SGLang's
//! `POST /update_weights_from_disk` when configured to; for other engines the runtime must load
//! weights through the engine's own mechanism, and `update_weights` says so.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde::{Deserialize, Serialize};

use crate::sse::SseDecoder;
use crate::{
    ChatMessage, Completion, Engine, EngineError, EngineFuture, EventStream, FinishReason,
    GenerateEvent, GenerateRequest, Prompt, WeightsRef,
};

/// How the backend reaches its engine.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiConfig {
    /// Base URL, e.g. `http://10.0.0.7:8000` (plain HTTP; engines run inside the cluster).
    pub base_url: String,
    /// Model name the engine serves.
    pub model: String,
    /// Bearer token, if the engine wants one.
    pub api_key: Option<String>,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Ask for token ids in stream chunks (vLLM's `return_token_ids`).
    pub return_token_ids: bool,
    /// How weights are loaded.
    pub weight_update: WeightUpdate,
}

/// How an engine loads new weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightUpdate {
    /// The engine has no HTTP endpoint for it.
    Unsupported,
    /// SGLang's `POST /update_weights_from_disk {"model_path": ...}`.
    SglangFromDisk,
}

#[derive(Serialize)]
struct CompletionBody<'a> {
    model: &'a str,
    prompt: &'a Prompt,
    max_tokens: u32,
    temperature: f32,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    stop: &'a [String],
    stream: bool,
    stream_options: StreamOptions,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    return_token_ids: bool,
    user: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: String,
    #[serde(default)]
    finish_reason: Option<String>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
}

#[derive(Deserialize)]
struct Usage {
    prompt_tokens: u32,
    completion_tokens: u32,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// An engine behind the OpenAI completions API.
pub struct OpenAiEngine {
    config: OpenAiConfig,
    client: reqwest::Client,
    version: AtomicU64,
}

impl OpenAiEngine {
    /// A backend for the engine at `config.base_url`, serving policy version `version`.
    pub fn new(config: OpenAiConfig, version: u64) -> Result<OpenAiEngine, EngineError> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .build()
            .map_err(|e| EngineError::Unavailable {
                endpoint: config.base_url.clone(),
                reason: format!("cannot build an HTTP client: {e}"),
            })?;
        Ok(OpenAiEngine {
            config: OpenAiConfig {
                base_url: config.base_url.trim_end_matches('/').to_owned(),
                ..config
            },
            client,
            version: AtomicU64::new(version),
        })
    }

    /// The engine's address.
    pub fn base_url(&self) -> &str {
        &self.config.base_url
    }

    /// The model name sent with every request.
    pub fn model(&self) -> &str {
        &self.config.model
    }

    /// Records that the weights the engine serves now are policy version `version`, loading
    /// nothing. For runs whose trainer publishes no real weights (the emulated trainer): the
    /// engine keeps its weights, and the version is a label the scheduler's staleness books need.
    pub fn relabel_version(&self, version: u64) {
        self.version.store(version, Ordering::SeqCst);
    }

    /// The models the engine serves (`GET {base}/v1/models`, answered by vLLM and SGLang), in
    /// the order it lists them.
    pub async fn served_models(&self) -> Result<Vec<String>, EngineError> {
        #[derive(Deserialize)]
        struct Models {
            data: Vec<Model>,
        }
        #[derive(Deserialize)]
        struct Model {
            id: String,
        }
        let mut builder = self
            .client
            .get(format!("{}/v1/models", self.config.base_url));
        if let Some(key) = &self.config.api_key {
            builder = builder.bearer_auth(key);
        }
        let response = builder.send().await.map_err(|e| self.unavailable(e))?;
        let response = self.check_status(response).await?;
        let models: Models = response
            .json()
            .await
            .map_err(|e| self.protocol(format_args!("/v1/models answer: {e}")))?;
        Ok(models.data.into_iter().map(|m| m.id).collect())
    }

    fn unavailable(&self, reason: impl std::fmt::Display) -> EngineError {
        EngineError::Unavailable {
            endpoint: self.config.base_url.clone(),
            reason: reason.to_string(),
        }
    }

    fn protocol(&self, reason: impl std::fmt::Display) -> EngineError {
        EngineError::Protocol {
            endpoint: self.config.base_url.clone(),
            reason: reason.to_string(),
        }
    }

    async fn send(&self, request: &GenerateRequest) -> Result<reqwest::Response, EngineError> {
        let body = CompletionBody {
            model: &self.config.model,
            prompt: &request.prompt,
            max_tokens: request.max_tokens,
            temperature: request.temperature,
            stop: &request.stop,
            stream: true,
            stream_options: StreamOptions {
                include_usage: true,
            },
            return_token_ids: self.config.return_token_ids,
            user: &request.session,
        };
        let mut builder = self
            .client
            .post(format!("{}/v1/completions", self.config.base_url))
            .header("X-Request-Id", &request.request_id)
            .json(&body);
        if let Some(key) = &self.config.api_key {
            builder = builder.bearer_auth(key);
        }
        let response = builder.send().await.map_err(|e| self.unavailable(e))?;
        self.check_status(response).await
    }

    async fn check_status(
        &self,
        response: reqwest::Response,
    ) -> Result<reqwest::Response, EngineError> {
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        // OpenAI-style errors are {"error": {"message": ...}}; vLLM also sends {"message": ...}.
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| {
                v.pointer("/error/message")
                    .or_else(|| v.get("message"))
                    .and_then(|m| m.as_str().map(str::to_owned))
            })
            .unwrap_or_else(|| text.chars().take(300).collect());
        if status.is_client_error() && status.as_u16() != 429 {
            Err(EngineError::Rejected {
                endpoint: self.config.base_url.clone(),
                status: status.as_u16(),
                message,
            })
        } else {
            Err(self.unavailable(format_args!("HTTP {}: {message}", status.as_u16())))
        }
    }
}

/// Decodes a completion stream into events.
struct Decoder {
    sse: SseDecoder,
    pending: VecDeque<GenerateEvent>,
    finish_reason: Option<FinishReason>,
    usage: Option<Usage>,
    policy_version: u64,
    done: bool,
}

impl Decoder {
    fn feed(&mut self, engine: &OpenAiEngine, bytes: &[u8]) -> Result<(), EngineError> {
        for data in self.sse.feed(bytes).map_err(|e| engine.protocol(e))? {
            if data == "[DONE]" {
                self.done = true;
                let usage = self.usage.take();
                self.pending.push_back(GenerateEvent::Finished(Completion {
                    finish_reason: self.finish_reason.unwrap_or(FinishReason::Other),
                    prompt_tokens: usage.as_ref().map(|u| u.prompt_tokens),
                    completion_tokens: usage.as_ref().map(|u| u.completion_tokens),
                    cached_prompt_tokens: usage
                        .as_ref()
                        .and_then(|u| u.prompt_tokens_details.as_ref())
                        .and_then(|d| d.cached_tokens),
                    policy_version: self.policy_version,
                    emulated: false,
                    engine_weight_version: None,
                }));
                return Ok(());
            }
            let chunk: Chunk = serde_json::from_str(&data)
                .map_err(|e| engine.protocol(format_args!("chunk is not a completion: {e}")))?;
            if chunk.usage.is_some() {
                self.usage = chunk.usage;
            }
            for choice in chunk.choices {
                if let Some(reason) = choice.finish_reason {
                    self.finish_reason = Some(match reason.as_str() {
                        "stop" => FinishReason::Stop,
                        "length" => FinishReason::Length,
                        _ => FinishReason::Other,
                    });
                }
                let token_ids = choice.token_ids.unwrap_or_default();
                if !choice.text.is_empty() || !token_ids.is_empty() {
                    self.pending.push_back(GenerateEvent::Delta {
                        text: choice.text,
                        token_ids,
                        logprobs: Vec::new(),
                    });
                }
            }
        }
        Ok(())
    }
}

enum State {
    Start(GenerateRequest),
    Streaming(
        std::pin::Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
        Box<Decoder>,
    ),
    Over,
}

impl Engine for OpenAiEngine {
    fn generate(&self, request: GenerateRequest) -> EventStream {
        let serving = self.policy_version();
        if request.policy_version != serving {
            let error = EngineError::Rejected {
                endpoint: self.config.base_url.clone(),
                status: 409,
                message: format!(
                    "request wants policy version {} but the engine serves {serving}",
                    request.policy_version
                ),
            };
            return Box::pin(futures_util::stream::once(async move { Err(error) }));
        }
        let engine = OpenAiEngine {
            config: self.config.clone(),
            client: self.client.clone(),
            version: AtomicU64::new(serving),
        };
        let stream = futures_util::stream::unfold(
            (engine, State::Start(request)),
            |(engine, mut state)| async move {
                loop {
                    state = match state {
                        State::Over => return None,
                        State::Start(request) => match engine.send(&request).await {
                            Ok(response) => State::Streaming(
                                Box::pin(response.bytes_stream()),
                                Box::new(Decoder {
                                    sse: SseDecoder::default(),
                                    pending: VecDeque::new(),
                                    finish_reason: None,
                                    usage: None,
                                    policy_version: request.policy_version,
                                    done: false,
                                }),
                            ),
                            Err(error) => return Some((Err(error), (engine, State::Over))),
                        },
                        State::Streaming(mut bytes, mut decoder) => {
                            if let Some(event) = decoder.pending.pop_front() {
                                let next = if decoder.done && decoder.pending.is_empty() {
                                    State::Over
                                } else {
                                    State::Streaming(bytes, decoder)
                                };
                                return Some((Ok(event), (engine, next)));
                            }
                            match bytes.next().await {
                                Some(Ok(chunk)) => match decoder.feed(&engine, &chunk) {
                                    Ok(()) => State::Streaming(bytes, decoder),
                                    Err(error) => {
                                        return Some((Err(error), (engine, State::Over)));
                                    }
                                },
                                Some(Err(error)) => {
                                    let error = engine.unavailable(error);
                                    return Some((Err(error), (engine, State::Over)));
                                }
                                None => {
                                    let error = engine.unavailable(
                                        "the stream ended before [DONE] (connection lost)",
                                    );
                                    return Some((Err(error), (engine, State::Over)));
                                }
                            }
                        }
                    }
                }
            },
        );
        Box::pin(stream)
    }

    fn update_weights(&self, weights: &WeightsRef) -> EngineFuture<'_, ()> {
        let version = weights.version;
        let source = weights.local_path().to_owned();
        Box::pin(async move {
            match self.config.weight_update {
                WeightUpdate::Unsupported => Err(EngineError::Unsupported(format!(
                    "{}: the OpenAI API has no weight update; configure the engine's own \
                     mechanism (e.g. SGLang's update_weights_from_disk)",
                    self.config.base_url
                ))),
                WeightUpdate::SglangFromDisk => {
                    let response = self
                        .client
                        .post(format!("{}/update_weights_from_disk", self.config.base_url))
                        .json(&serde_json::json!({
                            "model_path": source,
                            "weight_version": version.to_string(),
                        }))
                        .send()
                        .await
                        .map_err(|e| self.unavailable(e))?;
                    let response = self.check_status(response).await?;
                    let answer: serde_json::Value = response
                        .json()
                        .await
                        .map_err(|e| self.protocol(format_args!("update answer: {e}")))?;
                    if answer.get("success").and_then(|s| s.as_bool()) != Some(true) {
                        return Err(self.unavailable(format_args!(
                            "weight update to version {version} failed: {answer}"
                        )));
                    }
                    self.version.store(version, Ordering::SeqCst);
                    Ok(())
                }
            }
        })
    }

    /// The OpenAI API has no weight version: `None`.
    fn served_weight_version(&self) -> EngineFuture<'_, Option<u64>> {
        Box::pin(async { Ok(None) })
    }

    /// vLLM's chat-aware `POST /tokenize {"model", "messages", "add_generation_prompt"}`.
    fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> EngineFuture<'_, Vec<u32>> {
        #[derive(Deserialize)]
        struct Tokens {
            tokens: Vec<u32>,
        }
        let body = serde_json::json!({
            "model": self.config.model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "add_special_tokens": false,
        });
        Box::pin(async move {
            let mut builder = self
                .client
                .post(format!("{}/tokenize", self.config.base_url))
                .json(&body);
            if let Some(key) = &self.config.api_key {
                builder = builder.bearer_auth(key);
            }
            let response = builder.send().await.map_err(|e| self.unavailable(e))?;
            let response = self.check_status(response).await?;
            let tokens: Tokens = response
                .json()
                .await
                .map_err(|e| self.protocol(format_args!("/tokenize answer: {e}")))?;
            Ok(tokens.tokens)
        })
    }

    fn policy_version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }

    fn backend(&self) -> &'static str {
        "openai"
    }
}
