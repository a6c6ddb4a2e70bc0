//! The vLLM backend: token-in/token-out generation over vLLM's OpenAI-compatible
//! `/v1/completions`, and per-replica weight updates over vLLM's RLHF serving API (dev mode,
//! `VLLM_SERVER_DEV_MODE=1`).
//!
//! Shapes follow vllm-project/vllm's `vllm/entrypoints/serve/dev/rlhf/api_router.py` (commit
//! `0100a2129224e729af1b3b8ed42a900cdfe9a452`), the shared-disk weight-transfer backend
//! `vllm/distributed/weight_transfer/disk_engine.py` (commit
//! `3b98defb1248fa873096121529d457c0f5124905`), and the `/reset_prefix_cache` and `/tokenize`
//! routers; see `docs/engines.md` for what was checked and the gaps.
//!
//! - Generation: `POST /v1/completions {"model", "prompt": [ids], "max_tokens", "temperature",
//!   "stop"?, "logprobs": 1, "return_token_ids": true, "stream": false}` with the request id in
//!   `X-Request-Id`. The sampled tokens are `choices[0].token_ids` and their logprobs
//!   `choices[0].logprobs.token_logprobs` (checked to be as many). vLLM reports no weight
//!   version per response, so, when [`VllmConfig::stamp_weight_version`] is set, the backend
//!   reads `GET /weight_info` just before sending and stamps the completion with it; rollfleet
//!   only updates drained replicas, so no update can fall between the two calls. Dropping the
//!   stream closes the connection, which vLLM treats as an abort.
//! - Weights (on a drained replica): `POST /pause?mode=wait`, `POST /start_weight_update`,
//!   `POST /update_weights {"update_info": {"path": dir}}` (the shared-disk backend: the engine
//!   must run with the `disk` weight-transfer backend), `POST /finish_weight_update
//!   {"weight_version": "<v>"}`, `POST /reset_prefix_cache`, `POST /resume`, then
//!   `GET /weight_info` must answer `{"weight_version": "<v>"}`. When a step after the pause
//!   fails, the backend resumes the engine (it keeps serving its old weights) and reports the
//!   failing step.
//! - Chat templates: `POST /tokenize {"model", "messages", "add_generation_prompt",
//!   "add_special_tokens": false}`, which applies the model's own chat template.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;

use crate::http::{Http, parse_version};
use crate::sglang::tokenize_chat_vllm_style;
use crate::{
    ChatMessage, Completion, Engine, EngineError, EngineFuture, EventStream, FinishReason,
    GenerateEvent, GenerateRequest, WeightsRef,
};

/// How the backend reaches its vLLM replica.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmConfig {
    /// Base URL, e.g. `http://10.0.0.7:8000`.
    pub base_url: String,
    /// Model name the engine serves (the `model` of every request).
    pub model: String,
    /// Bearer token (vLLM's `--api-key`), if set.
    pub api_key: Option<String>,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Timeout of one generation or control call.
    pub request_timeout: Duration,
    /// Timeout of the weight load (`/update_weights`).
    pub update_timeout: Duration,
    /// Read `GET /weight_info` before each generation to fill
    /// [`Completion::engine_weight_version`] (vLLM has no per-response version).
    pub stamp_weight_version: bool,
}

impl VllmConfig {
    /// A configuration for `model` at `base_url` with 5 s connect, 600 s request and 1800 s
    /// update timeouts, stamping generations with `/weight_info`.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> VllmConfig {
        VllmConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(600),
            update_timeout: Duration::from_secs(1800),
            stamp_weight_version: true,
        }
    }
}

/// A vLLM replica.
pub struct VllmEngine {
    config: VllmConfig,
    http: Http,
    version: AtomicU64,
}

#[derive(Deserialize)]
struct CompletionAnswer {
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: String,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    logprobs: Option<Logprobs>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Logprobs {
    #[serde(default)]
    token_logprobs: Vec<Option<f64>>,
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

#[derive(Deserialize)]
struct WeightInfo {
    weight_version: Option<serde_json::Value>,
}

async fn weight_info(http: &Http, timeout: Duration) -> Result<Option<u64>, EngineError> {
    const PATH: &str = "/weight_info";
    let answer: WeightInfo = http.get_json(PATH, timeout).await?;
    match answer.weight_version {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(raw) => parse_version(&raw).map(Some).ok_or_else(|| {
            http.protocol(
                PATH,
                format_args!("weight_version {raw} is not a decimal policy version"),
            )
        }),
    }
}

impl VllmEngine {
    /// A backend for the replica at `config.base_url`, labelled as serving policy `version`.
    pub fn new(config: VllmConfig, version: u64) -> Result<VllmEngine, EngineError> {
        let http = Http::new(
            &config.base_url,
            config.api_key.clone(),
            config.connect_timeout,
        )?;
        Ok(VllmEngine {
            config,
            http,
            version: AtomicU64::new(version),
        })
    }

    /// The replica's address.
    pub fn base_url(&self) -> &str {
        &self.http.base_url
    }

    async fn post_control(
        &self,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let mut builder = self.http.request(reqwest::Method::POST, path, timeout);
        if let Some(body) = body {
            builder = builder.json(&body);
        }
        self.http.send_text(path, builder).await.map(drop)
    }

    /// `POST /pause?mode=wait`: lets requests in flight finish, then stops scheduling.
    pub async fn pause(&self) -> Result<(), EngineError> {
        self.post_control("/pause?mode=wait", None, self.config.request_timeout)
            .await
    }

    /// `POST /resume`.
    pub async fn resume(&self) -> Result<(), EngineError> {
        self.post_control("/resume", None, self.config.request_timeout)
            .await
    }

    /// `POST /reset_prefix_cache`.
    pub async fn reset_prefix_cache(&self) -> Result<(), EngineError> {
        self.post_control("/reset_prefix_cache", None, self.config.request_timeout)
            .await
    }

    async fn load(&self, weights: &WeightsRef) -> Result<(), EngineError> {
        let timeout = self.config.request_timeout;
        self.post_control("/start_weight_update", Some(json!({})), timeout)
            .await?;
        self.post_control(
            "/update_weights",
            Some(json!({ "update_info": { "path": weights.local_path() } })),
            self.config.update_timeout,
        )
        .await?;
        self.post_control(
            "/finish_weight_update",
            Some(json!({ "weight_version": weights.version.to_string() })),
            timeout,
        )
        .await?;
        self.reset_prefix_cache().await
    }

    async fn run(
        http: Http,
        config: VllmConfig,
        request: GenerateRequest,
    ) -> Result<Vec<GenerateEvent>, EngineError> {
        const PATH: &str = "/v1/completions";
        let engine_weight_version = if config.stamp_weight_version {
            weight_info(&http, config.request_timeout).await?
        } else {
            None
        };
        let mut body = json!({
            "model": config.model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "logprobs": 1,
            "return_token_ids": true,
            "stream": false,
        });
        if !request.stop.is_empty() {
            body["stop"] = json!(request.stop);
        }
        let builder = http
            .request(reqwest::Method::POST, PATH, config.request_timeout)
            .header("X-Request-Id", &request.request_id)
            .json(&body);
        let answer: CompletionAnswer = http.send_json(PATH, builder).await?;
        let Some(choice) = answer.choices.into_iter().next() else {
            return Err(http.protocol(PATH, "the answer has no choices"));
        };
        let Some(token_ids) = choice.token_ids else {
            return Err(http.protocol(
                PATH,
                "choices[0].token_ids is missing (does this vLLM support return_token_ids?)",
            ));
        };
        let logprobs = match choice.logprobs {
            None => Vec::new(),
            Some(l) => {
                if l.token_logprobs.len() != token_ids.len() {
                    return Err(http.protocol(
                        PATH,
                        format_args!(
                            "{} token_logprobs for {} token_ids",
                            l.token_logprobs.len(),
                            token_ids.len()
                        ),
                    ));
                }
                let mut out = Vec::with_capacity(token_ids.len());
                for (i, logprob) in l.token_logprobs.iter().enumerate() {
                    let Some(logprob) = logprob else {
                        return Err(
                            http.protocol(PATH, format_args!("token_logprobs[{i}] is null"))
                        );
                    };
                    out.push(*logprob as f32);
                }
                out
            }
        };
        let finish_reason = match choice.finish_reason.as_deref() {
            Some("stop") => FinishReason::Stop,
            Some("length") => FinishReason::Length,
            Some("abort") => FinishReason::Aborted,
            _ => FinishReason::Other,
        };
        let usage = answer.usage;
        Ok(vec![
            GenerateEvent::Delta {
                text: choice.text,
                token_ids,
                logprobs,
            },
            GenerateEvent::Finished(Completion {
                finish_reason,
                prompt_tokens: usage.as_ref().map(|u| u.prompt_tokens),
                completion_tokens: usage.as_ref().map(|u| u.completion_tokens),
                cached_prompt_tokens: usage
                    .as_ref()
                    .and_then(|u| u.prompt_tokens_details.as_ref())
                    .and_then(|d| d.cached_tokens),
                policy_version: request.policy_version,
                emulated: false,
                engine_weight_version,
            }),
        ])
    }
}

impl Engine for VllmEngine {
    fn generate(&self, request: GenerateRequest) -> EventStream {
        let serving = self.policy_version();
        if request.policy_version != serving {
            let error = EngineError::Rejected {
                endpoint: self.http.endpoint("/v1/completions"),
                status: 409,
                message: format!(
                    "request wants policy version {} but the replica serves {serving}",
                    request.policy_version
                ),
            };
            return Box::pin(futures_util::stream::once(async move { Err(error) }));
        }
        let run = VllmEngine::run(self.http.clone(), self.config.clone(), request);
        let events = async move {
            match run.await {
                Ok(events) => events.into_iter().map(Ok).collect(),
                Err(error) => vec![Err(error)],
            }
        };
        Box::pin(futures_util::stream::once(events).flat_map(futures_util::stream::iter))
    }

    fn update_weights(&self, weights: &WeightsRef) -> EngineFuture<'_, ()> {
        let weights = weights.clone();
        Box::pin(async move {
            self.pause().await?;
            let loaded = self.load(&weights).await;
            // Resume either way: after a failed load the engine still serves its old weights.
            let resumed = self.resume().await;
            loaded?;
            resumed?;
            let reported = weight_info(&self.http, self.config.request_timeout).await?;
            self.http
                .expect_loaded("/weight_info", reported, weights.version)?;
            self.version.store(weights.version, Ordering::SeqCst);
            Ok(())
        })
    }

    fn served_weight_version(&self) -> EngineFuture<'_, Option<u64>> {
        Box::pin(weight_info(&self.http, self.config.request_timeout))
    }

    fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> EngineFuture<'_, Vec<u32>> {
        let messages = messages.to_vec();
        Box::pin(async move {
            tokenize_chat_vllm_style(
                &self.http,
                Some(&self.config.model),
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
        "vllm"
    }
}
