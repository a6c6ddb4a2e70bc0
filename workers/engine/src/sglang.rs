//! The SGLang backend: SGLang's native HTTP API (not its OpenAI layer), token-in/token-out with
//! per-token logprobs and per-replica weight updates from disk.
//!
//! Shapes follow `python/sglang/srt/entrypoints/http_server.py` (sgl-project/sglang at commit
//! `0025436eab0556737d615b36a4dd3e1e26e82f3d`) and `python/sglang/srt/managers/io_struct.py`;
//! see `docs/engines.md` for what was checked and what was not.
//!
//! - Generation: `POST /generate {"input_ids", "sampling_params": {"max_new_tokens",
//!   "temperature", "stop"?}, "return_logprob": true, "rid", "stream": false}`. The answer's
//!   `output_ids` are the sampled tokens and `meta_info.output_token_logprobs` holds one
//!   `[logprob, token_id, text-or-null]` per sampled token (checked to name the same ids);
//!   `meta_info.weight_version` is the engine's own version string, which rollfleet sets to the
//!   decimal policy version. The request is not streamed: the stream yields one
//!   [`GenerateEvent::Delta`] with every token, then [`GenerateEvent::Finished`]. Dropping the
//!   stream before the answer closes the connection and, best-effort, sends
//!   `POST /abort_request {"rid"}` on the current tokio runtime.
//! - Weights (on a drained replica): `POST /update_weights_from_disk {"model_path",
//!   "weight_version": "<v>", "flush_cache": true, "load_format"?}`; SGLang answers
//!   `{"success", "message", "num_paused_requests"}` with HTTP 200, or HTTP 400 when `success` is
//!   false. Then `GET /get_weight_version` must answer `{"weight_version": "<v>"}`: an engine
//!   that said yes but serves another version is a [`EngineError::Protocol`] error.
//! - Chat templates: SGLang's `/tokenize` (and `/v1/tokenize`) takes text only (`prompt`:
//!   a string or list of strings) and applies no chat template, and SGLang has no endpoint that
//!   renders messages to token ids without generating. So [`SglangEngine::tokenize_chat`] needs
//!   [`SglangConfig::chat_tokenizer_url`]: the base URL of a server with vLLM's chat-aware
//!   `POST /tokenize {"messages", "add_generation_prompt"}` for the same model (e.g. a vLLM
//!   server, or a tokenizer sidecar using the model's own template). Without it the call is
//!   [`EngineError::Unsupported`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;

use crate::http::{Http, parse_version};
use crate::{
    ChatMessage, Completion, Engine, EngineError, EngineFuture, EventStream, FinishReason,
    GenerateEvent, GenerateRequest, Prompt, WeightsRef,
};

/// How the backend reaches its SGLang replica.
#[derive(Debug, Clone, PartialEq)]
pub struct SglangConfig {
    /// Base URL, e.g. `http://10.0.0.7:30000`.
    pub base_url: String,
    /// Bearer token (SGLang's `--api-key`), if set.
    pub api_key: Option<String>,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Timeout of one generation or control call.
    pub request_timeout: Duration,
    /// Timeout of a weight load (`/update_weights_from_disk`).
    pub update_timeout: Duration,
    /// Base URL of a vLLM-style chat-aware `/tokenize` for the same model, used by
    /// [`Engine::tokenize_chat`] (SGLang's own `/tokenize` takes text only).
    pub chat_tokenizer_url: Option<String>,
}

impl SglangConfig {
    /// A configuration for `base_url` with 5 s connect, 600 s request and 1800 s update timeouts.
    pub fn new(base_url: impl Into<String>) -> SglangConfig {
        SglangConfig {
            base_url: base_url.into(),
            api_key: None,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(600),
            update_timeout: Duration::from_secs(1800),
            chat_tokenizer_url: None,
        }
    }
}

/// How `/pause_generation` treats requests in flight (SGLang's `PauseGenerationReqInput.mode`;
/// engines older than that field ignore the body and abort).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Abort and return every request in flight.
    Abort,
    /// Move running requests back to the waiting queue (their KV cache may be flushed).
    Retract,
    /// Freeze requests where they are, KV cache kept.
    InPlace,
}

impl PauseMode {
    fn as_str(self) -> &'static str {
        match self {
            PauseMode::Abort => "abort",
            PauseMode::Retract => "retract",
            PauseMode::InPlace => "in_place",
        }
    }
}

/// An SGLang replica behind its native HTTP API.
pub struct SglangEngine {
    config: SglangConfig,
    http: Http,
    chat_tokenizer: Option<Http>,
    version: AtomicU64,
}

#[derive(Deserialize)]
struct GenerateAnswer {
    #[serde(default)]
    text: Option<String>,
    output_ids: Vec<u32>,
    meta_info: MetaInfo,
}

/// One entry of `meta_info.output_token_logprobs`: `[logprob, token_id, text-or-null]`.
type TokenLogprob = (Option<f64>, u32, Option<String>);

#[derive(Deserialize)]
struct MetaInfo {
    #[serde(default)]
    output_token_logprobs: Option<Vec<TokenLogprob>>,
    #[serde(default)]
    weight_version: Option<serde_json::Value>,
    #[serde(default)]
    finish_reason: Option<serde_json::Value>,
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct UpdateAnswer {
    success: bool,
    #[serde(default)]
    message: String,
}

#[derive(Deserialize)]
struct WeightVersion {
    weight_version: Option<serde_json::Value>,
}

/// Sends `POST /abort_request {"rid"}` when dropped armed (a generation dropped mid-way).
struct AbortOnDrop {
    http: Http,
    rid: String,
    armed: Arc<AtomicBool>,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.armed.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let http = self.http.clone();
            let rid = std::mem::take(&mut self.rid);
            handle.spawn(async move {
                let builder = http
                    .request(
                        reqwest::Method::POST,
                        "/abort_request",
                        Duration::from_secs(5),
                    )
                    .json(&json!({ "rid": rid }));
                // Best-effort: the connection is closed anyway, which SGLang also notices.
                let _ = http.send_text("/abort_request", builder).await;
            });
        }
    }
}

impl SglangEngine {
    /// A backend for the replica at `config.base_url`, labelled as serving policy `version`.
    pub fn new(config: SglangConfig, version: u64) -> Result<SglangEngine, EngineError> {
        let http = Http::new(
            &config.base_url,
            config.api_key.clone(),
            config.connect_timeout,
        )?;
        let chat_tokenizer = match &config.chat_tokenizer_url {
            Some(url) => Some(Http::new(
                url,
                config.api_key.clone(),
                config.connect_timeout,
            )?),
            None => None,
        };
        Ok(SglangEngine {
            config,
            http,
            chat_tokenizer,
            version: AtomicU64::new(version),
        })
    }

    /// The replica's address.
    pub fn base_url(&self) -> &str {
        &self.http.base_url
    }

    /// `POST /pause_generation {"mode"}`: stops scheduling generations.
    pub async fn pause_generation(&self, mode: PauseMode) -> Result<(), EngineError> {
        self.http
            .post_json::<serde_json::Value>(
                "/pause_generation",
                &json!({ "mode": mode.as_str() }),
                self.config.request_timeout,
            )
            .await
            .map(drop)
    }

    /// `POST /continue_generation`: resumes after [`SglangEngine::pause_generation`].
    pub async fn continue_generation(&self) -> Result<(), EngineError> {
        self.http
            .post_json::<serde_json::Value>(
                "/continue_generation",
                &json!({}),
                self.config.request_timeout,
            )
            .await
            .map(drop)
    }

    /// `POST /flush_cache`: empties the radix (prefix) cache. SGLang answers 400 when requests
    /// are running or waiting, which is a [`EngineError::Rejected`] error.
    pub async fn flush_cache(&self) -> Result<(), EngineError> {
        let builder = self.http.request(
            reqwest::Method::POST,
            "/flush_cache",
            self.config.request_timeout,
        );
        self.http.send_text("/flush_cache", builder).await.map(drop)
    }

    /// `POST /abort_request {"rid"}`: aborts one request (SGLang answers 200 whether or not the
    /// request still existed).
    pub async fn abort_request(&self, rid: &str) -> Result<(), EngineError> {
        let builder = self
            .http
            .request(
                reqwest::Method::POST,
                "/abort_request",
                self.config.request_timeout,
            )
            .json(&json!({ "rid": rid }));
        self.http
            .send_text("/abort_request", builder)
            .await
            .map(drop)
    }

    async fn read_version(&self) -> Result<Option<u64>, EngineError> {
        const PATH: &str = "/get_weight_version";
        let answer: WeightVersion = self
            .http
            .get_json(PATH, self.config.request_timeout)
            .await?;
        match answer.weight_version {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(raw) => parse_version(&raw).map(Some).ok_or_else(|| {
                self.http.protocol(
                    PATH,
                    format_args!("weight_version {raw} is not a decimal policy version"),
                )
            }),
        }
    }

    async fn run(
        http: Http,
        request: GenerateRequest,
        timeout: Duration,
    ) -> Result<Vec<GenerateEvent>, EngineError> {
        const PATH: &str = "/generate";
        let mut sampling = json!({
            "max_new_tokens": request.max_tokens,
            "temperature": request.temperature,
        });
        if !request.stop.is_empty() {
            sampling["stop"] = json!(request.stop);
        }
        let mut body = json!({
            "sampling_params": sampling,
            "return_logprob": true,
            "rid": request.request_id,
            "stream": false,
        });
        match &request.prompt {
            Prompt::Tokens(ids) => body["input_ids"] = json!(ids),
            Prompt::Text(text) => body["text"] = json!(text),
        }
        let armed = Arc::new(AtomicBool::new(true));
        let _guard = AbortOnDrop {
            http: http.clone(),
            rid: request.request_id.clone(),
            armed: armed.clone(),
        };
        let result = http.post_json::<GenerateAnswer>(PATH, &body, timeout).await;
        armed.store(false, Ordering::Relaxed);
        let answer = result?;
        let meta = answer.meta_info;
        let logprobs = match meta.output_token_logprobs {
            None => Vec::new(),
            Some(entries) => {
                if entries.len() != answer.output_ids.len() {
                    return Err(http.protocol(
                        PATH,
                        format_args!(
                            "{} output_token_logprobs for {} output_ids",
                            entries.len(),
                            answer.output_ids.len()
                        ),
                    ));
                }
                let mut logprobs = Vec::with_capacity(entries.len());
                for (i, ((logprob, id, _), want)) in
                    entries.iter().zip(&answer.output_ids).enumerate()
                {
                    if id != want {
                        return Err(http.protocol(
                            PATH,
                            format_args!(
                                "output_token_logprobs[{i}] is for token {id}, output_ids[{i}] is {want}"
                            ),
                        ));
                    }
                    let Some(logprob) = logprob else {
                        return Err(http.protocol(
                            PATH,
                            format_args!("output_token_logprobs[{i}] has no logprob"),
                        ));
                    };
                    logprobs.push(*logprob as f32);
                }
                logprobs
            }
        };
        let engine_weight_version = match meta.weight_version {
            None | Some(serde_json::Value::Null) => None,
            Some(raw) => Some(parse_version(&raw).ok_or_else(|| {
                http.protocol(
                    PATH,
                    format_args!("meta_info.weight_version {raw} is not a decimal policy version"),
                )
            })?),
        };
        let finish_reason = match meta
            .finish_reason
            .as_ref()
            .and_then(|f| f.get("type").or(Some(f)))
            .and_then(|t| t.as_str())
        {
            Some("stop") => FinishReason::Stop,
            Some("length") => FinishReason::Length,
            Some("abort") => FinishReason::Aborted,
            _ => FinishReason::Other,
        };
        let completion_tokens = meta
            .completion_tokens
            .or_else(|| u32::try_from(answer.output_ids.len()).ok());
        Ok(vec![
            GenerateEvent::Delta {
                text: answer.text.unwrap_or_default(),
                token_ids: answer.output_ids,
                logprobs,
            },
            GenerateEvent::Finished(Completion {
                finish_reason,
                prompt_tokens: meta.prompt_tokens,
                completion_tokens,
                cached_prompt_tokens: meta.cached_tokens,
                policy_version: request.policy_version,
                emulated: false,
                engine_weight_version,
            }),
        ])
    }
}

/// `POST {tokenizer}/tokenize {"messages", "add_generation_prompt", "add_special_tokens": false}`
/// (vLLM's `TokenizeChatRequest`), answer `{"tokens": [...]}`.
pub(crate) async fn tokenize_chat_vllm_style(
    http: &Http,
    model: Option<&str>,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    timeout: Duration,
) -> Result<Vec<u32>, EngineError> {
    #[derive(Deserialize)]
    struct Tokens {
        tokens: Vec<u32>,
    }
    let mut body = json!({
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "add_special_tokens": false,
    });
    if let Some(model) = model {
        body["model"] = json!(model);
    }
    let answer: Tokens = http.post_json("/tokenize", &body, timeout).await?;
    Ok(answer.tokens)
}

impl Engine for SglangEngine {
    fn generate(&self, request: GenerateRequest) -> EventStream {
        let serving = self.policy_version();
        if request.policy_version != serving {
            let error = EngineError::Rejected {
                endpoint: self.http.endpoint("/generate"),
                status: 409,
                message: format!(
                    "request wants policy version {} but the replica serves {serving}",
                    request.policy_version
                ),
            };
            return Box::pin(futures_util::stream::once(async move { Err(error) }));
        }
        let run = SglangEngine::run(self.http.clone(), request, self.config.request_timeout);
        let events = async move {
            match run.await {
                Ok(events) => events.into_iter().map(Ok).collect(),
                Err(error) => vec![Err(error)],
            }
        };
        Box::pin(futures_util::stream::once(events).flat_map(futures_util::stream::iter))
    }

    /// `POST /abort_request {"rid"}`: the pending `/generate` answers with the ids generated so
    /// far and `finish_reason.type` `"abort"`.
    fn interrupt(&self, request_id: &str) -> EngineFuture<'_, ()> {
        let rid = request_id.to_owned();
        Box::pin(async move { self.abort_request(&rid).await })
    }

    fn update_weights(&self, weights: &WeightsRef) -> EngineFuture<'_, ()> {
        let weights = weights.clone();
        Box::pin(async move {
            const PATH: &str = "/update_weights_from_disk";
            let mut body = json!({
                "model_path": weights.local_path(),
                "weight_version": weights.version.to_string(),
                "flush_cache": true,
            });
            // SGLang's load formats; anything else (e.g. "hf-dir") leaves SGLang's "auto".
            if matches!(
                weights.format.as_str(),
                "safetensors" | "gguf" | "pt" | "npcache"
            ) {
                body["load_format"] = json!(weights.format);
            }
            let answer: UpdateAnswer = self
                .http
                .post_json(PATH, &body, self.config.update_timeout)
                .await?;
            if !answer.success {
                return Err(self.http.unavailable(
                    PATH,
                    format_args!(
                        "loading version {} from {} failed: {}",
                        weights.version,
                        weights.local_path(),
                        answer.message
                    ),
                ));
            }
            let reported = self.read_version().await?;
            self.http
                .expect_loaded("/get_weight_version", reported, weights.version)?;
            self.version.store(weights.version, Ordering::SeqCst);
            Ok(())
        })
    }

    fn served_weight_version(&self) -> EngineFuture<'_, Option<u64>> {
        Box::pin(self.read_version())
    }

    fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> EngineFuture<'_, Vec<u32>> {
        let messages = messages.to_vec();
        Box::pin(async move {
            let Some(tokenizer) = &self.chat_tokenizer else {
                return Err(EngineError::Unsupported(format!(
                    "{}: SGLang's /tokenize takes text only and applies no chat template; set \
                     chat_tokenizer_url to a vLLM-style chat /tokenize for the same model",
                    self.http.base_url
                )));
            };
            tokenize_chat_vllm_style(
                tokenizer,
                None,
                &messages,
                add_generation_prompt,
                self.config.request_timeout,
            )
            .await
        })
    }

    fn policy_version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }

    fn backend(&self) -> &'static str {
        "sglang"
    }
}
