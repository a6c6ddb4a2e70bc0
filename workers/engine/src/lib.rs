//! LLM engine backends: the interface a node worker drives, and its implementations.
//!
//! An [`Engine`] generates a continuation of a prompt as a stream of [`GenerateEvent`]s and can
//! load new policy weights. Dropping the stream aborts the request (for the OpenAI-compatible
//! backend that closes the HTTP connection, which vLLM and SGLang both treat as an abort), so a
//! scheduler that preempts a stage only has to drop what it holds.
//!
//! Backends:
//! - [`openai::OpenAiEngine`]: a real engine behind the OpenAI completions API (vLLM, SGLang),
//!   streamed over HTTP;
//! - [`emulated::EmulatedEngine`]: for machines without GPUs, the simulator's roofline run
//!   against the (scaled) real clock; every output is marked `emulated`.

pub mod emulated;
pub mod openai;
mod sse;

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

    /// Loads policy weights `version` from `source` (a path or URL the engine understands).
    fn update_weights(&self, version: u64, source: &str) -> EngineFuture<'_, ()>;

    /// The policy version the engine serves now.
    fn policy_version(&self) -> u64;

    /// `"openai"`, `"emulated"`, ...
    fn backend(&self) -> &'static str;
}
