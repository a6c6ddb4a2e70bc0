//! LLM engine backends: the interface a node worker drives, and its implementations.
//!
//! An [`Engine`] generates a continuation of a prompt as a stream of [`GenerateEvent`]s and can
//! load new policy weights. Dropping the stream aborts the request (for the OpenAI-compatible
//! backend that closes the HTTP connection, which vLLM and SGLang both treat as an abort), so a
//! scheduler that preempts a stage only has to drop what it holds.
//!
//! Backends:
//! - [`sglang::SglangEngine`]: SGLang's native HTTP API, token-in/token-out with per-token
//!   logprobs and per-replica weight updates from disk checked against the engine's own version;
//! - [`vllm::VllmEngine`]: vLLM's `/v1/completions` with token-id prompts and its RLHF
//!   (dev-mode) weight-update API;
//! - [`openai::OpenAiEngine`]: a real engine behind the OpenAI completions API (vLLM, SGLang),
//!   streamed over HTTP;
//! - [`emulated::EmulatedEngine`]: for machines without GPUs, the simulator's roofline run
//!   against the (scaled) real clock; every output is marked `emulated`.
//!
//! # Token-in/token-out and chat templates
//!
//! For RL the trainer must see exactly the tokens the policy sampled, with the logprobs the
//! engine computed for them. Re-tokenising decoded text does not give them back (BPE merges
//! across turn boundaries, special tokens, whitespace normalisation). So a multi-turn
//! trajectory is kept as token ids: the sampled tokens are appended as they came, and only the
//! tokens the chat template adds around a new message (the end of the assistant turn, the role
//! header, the environment's text, the generation prompt) are produced by tokenising, with the
//! engine's own template ([`Engine::tokenize_chat`], [`chat_turn_tokens`]).

pub mod emulated;
mod http;
pub mod openai;
pub mod sglang;
mod sse;
pub mod vllm;

use std::future::Future;
use std::pin::Pin;

use futures_util::Stream;
use serde::Serialize;

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Unique id, for logs and engine-side bookkeeping.
    pub request_id: String,
    /// The trajectory this belongs to; engines and routers use it for prefix-cache affinity.
    pub session: String,
    /// The whole context (the engine's prefix cache makes the repeated part cheap).
    pub prompt: Prompt,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Sampling temperature.
    pub temperature: f32,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Policy version the output must be produced with (checked against the engine's).
    pub policy_version: u64,
}

/// A prompt as text or as token ids.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text, tokenised by the engine.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// One event of a generation stream.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerateEvent {
    /// New output.
    Delta {
        /// New text.
        text: String,
        /// New token ids, when the engine returns them.
        token_ids: Vec<u32>,
        /// The engine's log-probability of each token of `token_ids`, in order; empty when the
        /// engine gave none.
        logprobs: Vec<f32>,
    },
    /// The generation is over; always the last event of a successful stream.
    Finished(Completion),
}

/// Why a generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum FinishReason {
    /// A stop string or the end-of-sequence token.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The request was aborted ([`Engine::interrupt`]): the output is what it had generated.
    Aborted,
    /// Anything else the engine reported.
    Other,
}

/// Summary of a finished generation.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Completion {
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// Prompt tokens, as the engine counted them.
    pub prompt_tokens: Option<u32>,
    /// Generated tokens, as the engine counted them.
    pub completion_tokens: Option<u32>,
    /// Prompt tokens served from the prefix cache, when the engine reports it.
    pub cached_prompt_tokens: Option<u32>,
    /// Policy version that produced the output.
    pub policy_version: u64,
    /// True when no real GPU ran the model (the emulated engine).
    pub emulated: bool,
    /// The weight version the engine itself reported for this generation (SGLang's
    /// `meta_info.weight_version`; for vLLM the version `/weight_info` reported when the
    /// generation was sent). `None` when the engine did not say.
    pub engine_weight_version: Option<u64>,
}

/// Published policy weights, as the trainer announced them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WeightsRef {
    /// Policy version of these weights.
    pub version: u64,
    /// Where they are: `file:///abs/path` or a plain absolute path.
    pub uri: String,
    /// `"safetensors"`, `"gguf"`, `"hf-dir"`, ...
    pub format: String,
    /// Hex SHA-256 of the checkpoint, as the trainer published it.
    pub sha256: String,
}

impl WeightsRef {
    /// The checkpoint's local path: `uri` without a `file://` scheme.
    pub fn local_path(&self) -> &str {
        self.uri.strip_prefix("file://").unwrap_or(&self.uri)
    }
}

/// One chat message, rendered by the engine's own chat template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`, `"tool"`, ...
    pub role: String,
    /// The message's text.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Why a generation or weight update failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The engine could not be reached, broke the connection, or answered 5xx: an
    /// infrastructure failure, to be retried elsewhere, never scored.
    #[error("{endpoint}: engine unavailable: {reason}")]
    Unavailable {
        /// The engine's address.
        endpoint: String,
        /// What happened.
        reason: String,
    },
    /// The engine refused the request (4xx): retrying the same request will not help.
    #[error("{endpoint}: request rejected with HTTP {status}: {message}")]
    Rejected {
        /// The engine's address.
        endpoint: String,
        /// HTTP status.
        status: u16,
        /// The engine's message.
        message: String,
    },
    /// The engine answered something that is not the protocol.
    #[error("{endpoint}: protocol violation: {reason}")]
    Protocol {
        /// The engine's address.
        endpoint: String,
        /// What was wrong.
        reason: String,
    },
    /// The backend cannot do this (e.g. a weight update on an engine with no such endpoint).
    #[error("{0}")]
    Unsupported(String),
}

/// A stream of generation events.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<GenerateEvent, EngineError>> + Send>>;

/// A future returned by an engine.
pub type EngineFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, EngineError>> + Send + 'a>>;

/// An LLM engine a node worker drives.
pub trait Engine: Send + Sync {
    /// Starts generating; drop the stream to abort.
    fn generate(&self, request: GenerateRequest) -> EventStream;

    /// Loads `weights` and returns once the engine serves them (checked against the version the
    /// engine reports, where it reports one). Call it on a drained replica.
    fn update_weights(&self, weights: &WeightsRef) -> EngineFuture<'_, ()>;

    /// The weight version the engine itself reports serving, read back from the engine; `None`
    /// when it cannot say.
    fn served_weight_version(&self) -> EngineFuture<'_, Option<u64>>;

    /// Asks the engine to stop the generation `request_id` where it is: its stream then ends
    /// with what it had generated and [`FinishReason::Aborted`] (or as usual, if it finished
    /// first). [`EngineError::Unsupported`] when the engine cannot stop one request.
    fn interrupt(&self, request_id: &str) -> EngineFuture<'_, ()> {
        let message = format!(
            "the {} backend cannot stop one generation ({request_id}) and keep its output",
            self.backend()
        );
        Box::pin(async move { Err(EngineError::Unsupported(message)) })
    }

    /// The token ids of `messages` rendered with the model's own chat template (the engine's),
    /// with the generation prompt when `add_generation_prompt`.
    fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> EngineFuture<'_, Vec<u32>>;

    /// The policy version the engine serves now.
    fn policy_version(&self) -> u64;

    /// `"openai"`, `"emulated"`, ...
    fn backend(&self) -> &'static str;
}

/// The tokens to append to a token-in/token-out context for a new chat turn.
///
/// For the first turn (`first`), the token ids of `messages` with the generation prompt. For a
/// later turn, the context already ends with the tokens the policy sampled for the previous
/// assistant turn (`context_end` is the last of them), so only what the template adds after
/// them is wanted:
/// - the end of the assistant turn: what the template renders after an assistant message's
///   content (found by rendering one with empty content), minus its first token when the
///   answer ended with it (the end-of-turn token the model stopped on, e.g. ChatML's
///   `<|im_end|>`; the newline after it was never sampled), or all of it when the answer was
///   cut by the length limit;
/// - then the new message(s) and the generation prompt: the template is rendered for a fixed
///   dummy prefix `[user "x", assistant "y"]`, once alone and once followed by `messages` and
///   the generation prompt, and the suffix of the longer rendering is taken. The shorter
///   rendering must be a prefix of the longer, or the template is not incremental (it rewrites
///   earlier turns, e.g. strips past reasoning) and this fails with [`EngineError::Protocol`].
///
/// Why: re-tokenising the whole conversation each turn would replace the sampled tokens with a
/// re-tokenisation of their text, which can differ, and the trainer's logprobs would then belong
/// to tokens the policy never produced. Only the template's own tokens are tokenised.
pub async fn chat_turn_tokens(
    engine: &dyn Engine,
    first: bool,
    messages: &[ChatMessage],
    context_end: Option<u32>,
) -> Result<Vec<u32>, EngineError> {
    if first {
        return engine.tokenize_chat(messages, true).await;
    }
    let prefix = [
        ChatMessage::new("user", "x"),
        ChatMessage::new("assistant", "y"),
    ];
    let short = engine.tokenize_chat(&prefix, false).await?;
    let mut all = prefix.to_vec();
    all.extend_from_slice(messages);
    let long = engine.tokenize_chat(&all, true).await?;
    if !long.starts_with(&short) {
        let at = short
            .iter()
            .zip(&long)
            .position(|(a, b)| a != b)
            .unwrap_or(short.len().min(long.len()));
        return Err(EngineError::Protocol {
            endpoint: engine.backend().to_owned(),
            reason: format!(
                "the chat template is not incremental: rendering [user, assistant] gives {} \
                 tokens, which are not a prefix of the {} tokens of [user, assistant, new \
                 messages] (first difference at token {at}); the turn's tokens cannot be \
                 appended to the sampled ones",
                short.len(),
                long.len()
            ),
        });
    }
    let mut tokens = turn_closing(engine, context_end).await?;
    tokens.extend_from_slice(&long[short.len()..]);
    Ok(tokens)
}

/// What the template renders after an assistant message's content that the policy did not
/// sample (see [`chat_turn_tokens`]); empty when the template does not render an assistant
/// turn as the generation prompt followed by its content.
async fn turn_closing(
    engine: &dyn Engine,
    context_end: Option<u32>,
) -> Result<Vec<u32>, EngineError> {
    let user = [ChatMessage::new("user", "x")];
    let opened = engine.tokenize_chat(&user, true).await?;
    let answered = [
        ChatMessage::new("user", "x"),
        ChatMessage::new("assistant", ""),
    ];
    let closed = engine.tokenize_chat(&answered, false).await?;
    let Some(closing) = closed.strip_prefix(opened.as_slice()) else {
        return Ok(Vec::new());
    };
    Ok(match closing.split_first() {
        Some((end, rest)) if context_end == Some(*end) => rest.to_vec(),
        _ => closing.to_vec(),
    })
}
