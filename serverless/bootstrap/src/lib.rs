//! The AWS Lambda custom-runtime loop for rollfleet's reward functions, over plain HTTP against
//! the Runtime API at `AWS_LAMBDA_RUNTIME_API` (the `provided.al2023` runtime's contract):
//! `GET /2018-06-01/runtime/invocation/next`, then `POST .../invocation/{id}/response` or
//! `.../invocation/{id}/error`; `POST /2018-06-01/runtime/init/error` if the handler is unknown.
//!
//! The function's `Handler` setting (`_HANDLER`) names the reward function (`math_answer`,
//! `code_tests`, ...), so one `bootstrap.zip` serves them all.

use std::time::Duration;

use rollfleet_rewards::{FunctionError, Handler, RewardFunction};

const API: &str = "2018-06-01/runtime";
/// Lambda's own request limit; a larger event cannot come from the Runtime API.
const MAX_EVENT_BYTES: u64 = 7 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("AWS_LAMBDA_RUNTIME_API is not set")]
    NoRuntimeApi,
    #[error("unknown handler {0:?}; expected one of the reward function names")]
    UnknownHandler(String),
    #[error("Runtime API request {what} failed: {message}")]
    Api { what: &'static str, message: String },
}

/// A client of one Runtime API endpoint (`host:port`).
pub struct RuntimeClient {
    base: String,
    agent: ureq::Agent,
}

/// One event to handle.
pub struct Invocation {
    pub request_id: String,
    pub payload: Vec<u8>,
}

impl RuntimeClient {
    pub fn new(runtime_api: &str) -> Self {
        let agent = ureq::Agent::config_builder()
            // `next` is a long poll: it blocks until an event arrives.
            .timeout_global(None)
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            base: format!("http://{runtime_api}/{API}"),
            agent,
        }
    }

    /// Waits for the next event.
    pub fn next(&self) -> Result<Invocation, RuntimeError> {
        let err = |message: String| RuntimeError::Api {
            what: "next",
            message,
        };
        let mut resp = self
            .agent
            .get(format!("{}/invocation/next", self.base))
            .call()
            .map_err(|e| err(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(err(format!("status {}", resp.status())));
        }
        let request_id = resp
            .headers()
            .get("lambda-runtime-aws-request-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
            .ok_or_else(|| err("missing or malformed Lambda-Runtime-Aws-Request-Id".to_owned()))?
            .to_owned();
        let payload = resp
            .body_mut()
            .with_config()
            .limit(MAX_EVENT_BYTES)
            .read_to_vec()
            .map_err(|e| err(e.to_string()))?;
        Ok(Invocation {
            request_id,
            payload,
        })
    }

    pub fn respond(&self, request_id: &str, body: &[u8]) -> Result<(), RuntimeError> {
        self.post(
            "response",
            &format!("{}/invocation/{request_id}/response", self.base),
            body,
            None,
        )
    }

    pub fn fail(&self, request_id: &str, error: &FunctionError) -> Result<(), RuntimeError> {
        self.post(
            "error",
            &format!("{}/invocation/{request_id}/error", self.base),
            &error.to_json(),
            Some(&error.error_type),
        )
    }

    pub fn init_error(&self, error: &FunctionError) -> Result<(), RuntimeError> {
        self.post(
            "init/error",
            &format!("{}/init/error", self.base),
            &error.to_json(),
            Some(&error.error_type),
        )
    }

    fn post(
        &self,
        what: &'static str,
        url: &str,
        body: &[u8],
        error_type: Option<&str>,
    ) -> Result<(), RuntimeError> {
        let mut req = self
            .agent
            .post(url)
            .header("content-type", "application/json");
        if let Some(t) = error_type {
            req = req.header("lambda-runtime-function-error-type", t);
        }
        let resp = req.send(body).map_err(|e| RuntimeError::Api {
            what,
            message: e.to_string(),
        })?;
        if resp.status().is_success() {
            Ok(())
        } else {
            Err(RuntimeError::Api {
                what,
                message: format!("status {}", resp.status()),
            })
        }
    }
}

/// Resolves the handler, then serves events until the Runtime API fails three times in a row
/// (Lambda then restarts the environment).
pub fn run(runtime_api: &str, handler_name: &str, handler: &Handler) -> Result<(), RuntimeError> {
    let client = RuntimeClient::new(runtime_api);
    let Some(function) = RewardFunction::from_name(handler_name) else {
        let error = FunctionError::new(
            "Runtime.InvalidEntrypoint",
            format!("unknown handler {handler_name:?}"),
        );
        client.init_error(&error)?;
        return Err(RuntimeError::UnknownHandler(handler_name.to_owned()));
    };
    let mut failures = 0u32;
    loop {
        let invocation = match client.next() {
            Ok(inv) => {
                failures = 0;
                inv
            }
            Err(e) => {
                failures += 1;
                if failures >= 3 {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let sent = match handler.invoke(function, &invocation.payload) {
            Ok(body) => client.respond(&invocation.request_id, &body),
            Err(error) => client.fail(&invocation.request_id, &error),
        };
        // A failed post loses only this answer (Lambda times the invocation out); keep serving.
        if let Err(e) = sent {
            tracing::warn!("bootstrap: {e}");
        }
    }
}
