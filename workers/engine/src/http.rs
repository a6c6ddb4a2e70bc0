//! Plain JSON-over-HTTP calls shared by the native engine backends (SGLang, vLLM), with the
//! crate's error mapping: no connection, a timeout or a 5xx answer is [`EngineError::Unavailable`];
//! a 4xx answer is [`EngineError::Rejected`] carrying the engine's own message; an answer that is
//! not the expected JSON is [`EngineError::Protocol`]. Every error names the engine's URL and the
//! path called.

use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::EngineError;

/// An HTTP client bound to one engine replica.
#[derive(Clone)]
pub(crate) struct Http {
    pub(crate) base_url: String,
    pub(crate) client: reqwest::Client,
    pub(crate) api_key: Option<String>,
}

impl Http {
    pub(crate) fn new(
        base_url: &str,
        api_key: Option<String>,
        connect_timeout: Duration,
    ) -> Result<Http, EngineError> {
        let base_url = base_url.trim_end_matches('/').to_owned();
        let client = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .build()
            .map_err(|e| EngineError::Unavailable {
                endpoint: base_url.clone(),
                reason: format!("cannot build an HTTP client: {e}"),
            })?;
        Ok(Http {
            base_url,
            client,
            api_key,
        })
    }

    /// `{base}{path}`, for error messages.
    pub(crate) fn endpoint(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }

    pub(crate) fn unavailable(&self, path: &str, reason: impl std::fmt::Display) -> EngineError {
        EngineError::Unavailable {
            endpoint: self.endpoint(path),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn protocol(&self, path: &str, reason: impl std::fmt::Display) -> EngineError {
        EngineError::Protocol {
            endpoint: self.endpoint(path),
            reason: reason.to_string(),
        }
    }

    /// Checks the version an engine reported at `path` after loading `loaded`: an engine that
    /// answered success and still serves other weights is caught here.
    pub(crate) fn expect_loaded(
        &self,
        path: &str,
        reported: Option<u64>,
        loaded: u64,
    ) -> Result<(), EngineError> {
        if reported == Some(loaded) {
            return Ok(());
        }
        let reported = reported.map_or_else(|| "none".to_owned(), |v| v.to_string());
        Err(self.protocol(
            path,
            format_args!("engine reports version {reported} after loading {loaded}"),
        ))
    }

    /// A request builder for `path` (may carry a query string), with the API key.
    pub(crate) fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        timeout: Duration,
    ) -> reqwest::RequestBuilder {
        let mut builder = self
            .client
            .request(method, self.endpoint(path))
            .timeout(timeout);
        if let Some(key) = &self.api_key {
            builder = builder.bearer_auth(key);
        }
        builder
    }

    /// Sends `builder` and returns the answer's body text, mapping transport errors and non-2xx
    /// statuses.
    pub(crate) async fn send_text(
        &self,
        path: &str,
        builder: reqwest::RequestBuilder,
    ) -> Result<String, EngineError> {
        let response = builder.send().await.map_err(|e| {
            let what = if e.is_timeout() {
                "timed out"
            } else if e.is_connect() {
                "cannot connect"
            } else {
                "request failed"
            };
            self.unavailable(path, format_args!("{what}: {e}"))
        })?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|e| self.unavailable(path, format_args!("answer cut short: {e}")))?;
        if status.is_success() {
            return Ok(text);
        }
        let message = error_message(&text);
        if status.is_client_error() && status.as_u16() != 429 && status.as_u16() != 408 {
            Err(EngineError::Rejected {
                endpoint: self.endpoint(path),
                status: status.as_u16(),
                message,
            })
        } else {
            Err(self.unavailable(path, format_args!("HTTP {}: {message}", status.as_u16())))
        }
    }

    /// Sends `builder` and parses the JSON answer as `T`.
    pub(crate) async fn send_json<T: DeserializeOwned>(
        &self,
        path: &str,
        builder: reqwest::RequestBuilder,
    ) -> Result<T, EngineError> {
        let text = self.send_text(path, builder).await?;
        serde_json::from_str(&text).map_err(|e| {
            let head: String = text.chars().take(200).collect();
            self.protocol(path, format_args!("unexpected answer ({e}): {head}"))
        })
    }

    /// `POST path` with a JSON body, answer parsed as `T`.
    pub(crate) async fn post_json<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &serde_json::Value,
        timeout: Duration,
    ) -> Result<T, EngineError> {
        let builder = self
            .request(reqwest::Method::POST, path, timeout)
            .json(body);
        self.send_json(path, builder).await
    }

    /// `GET path`, answer parsed as `T`.
    pub(crate) async fn get_json<T: DeserializeOwned>(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Result<T, EngineError> {
        let builder = self.request(reqwest::Method::GET, path, timeout);
        self.send_json(path, builder).await
    }
}

/// The engine's message out of an error body: OpenAI/vLLM `{"error": {"message"}}`, vLLM's
/// `{"error": "..."}`, FastAPI's `{"detail"}`, SGLang's `{"message"}`; else the text's start.
pub(crate) fn error_message(text: &str) -> String {
    let value = serde_json::from_str::<serde_json::Value>(text).ok();
    value
        .as_ref()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("error").filter(|e| e.is_string()))
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(|m| m.as_str().map(str::to_owned))
        })
        .unwrap_or_else(|| text.chars().take(300).collect())
}

/// A weight version string as rollfleet writes it (the decimal policy version).
pub(crate) fn parse_version(raw: &serde_json::Value) -> Option<u64> {
    match raw {
        serde_json::Value::String(s) => s.trim().parse().ok(),
        serde_json::Value::Number(n) => n.as_u64(),
        _ => None,
    }
}
