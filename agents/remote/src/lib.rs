//! The remote environment protocol: environments that live in another process, another
//! language or a sandbox, reached over HTTP with JSON bodies.
//!
//! The protocol is small on purpose, so that a Python environment needs only the standard
//! library (see `examples/remote-env/server.py` and `docs/remote-environments.md`):
//!
//! | request | body | answer |
//! |---|---|---|
//! | `POST /v1/episodes` | `{"environment": "guess", "seed": 7}` | `201 {"episode": "e1", "observation": "..."}` |
//! | `POST /v1/episodes/{episode}/step` | `{"action": "50"}` | `200 {"observation": "...", "reward": 0.0, "done": false, "invalidAction": false}` |
//! | `DELETE /v1/episodes/{episode}` | | `204` |
//! | `GET /v1/health` | | `200 {"environments": ["guess"], "slots": 64, "busy": 3}` |
//!
//! Errors are JSON `{"error": {"code": "...", "message": "..."}}` with a 4xx or 5xx status.
//! [`RemoteEnvironment`] is the client: it implements [`Environment`], so a remote environment
//! is used exactly like a built-in one. Any transport failure, timeout, 5xx or malformed answer
//! is [`EnvError::Unavailable`] naming the server: an infrastructure failure, to be retried on
//! another host, never scored as a zero reward.

use std::time::Duration;

use rollfleet_environments::{EnvError, Environment, Step};
use serde::{Deserialize, Serialize};

/// Largest answer body accepted from a server (observations are text, not datasets).
pub const MAX_RESPONSE_BYTES: u64 = 4 * 1024 * 1024;

/// `POST /v1/episodes` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartRequest {
    /// Environment name, as the server lists it in `/v1/health`.
    pub environment: String,
    /// Seed of the episode: the same seed must give the same episode.
    pub seed: u64,
}

/// `POST /v1/episodes` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartResponse {
    /// Opaque episode id, used in later paths.
    pub episode: String,
    /// The task and first observation.
    pub observation: String,
}

/// `POST /v1/episodes/{episode}/step` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRequest {
    /// The policy's action text.
    pub action: String,
}

/// `POST /v1/episodes/{episode}/step` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepResponse {
    /// What the policy sees next.
    pub observation: String,
    /// Reward of this step.
    pub reward: f64,
    /// The episode is over.
    pub done: bool,
    /// The action was not understood.
    #[serde(default)]
    pub invalid_action: bool,
}

/// `GET /v1/health` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Health {
    /// Environments the server runs.
    pub environments: Vec<String>,
    /// Episodes it can run at once.
    pub slots: u32,
    /// Episodes running now.
    pub busy: u32,
}

/// An error answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong, as the server says it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Machine-readable code: `unknown_environment`, `unknown_episode`, `bad_request`,
    /// `no_free_slot`, `internal`.
    pub code: String,
    /// For people.
    pub message: String,
}

/// A client of one remote environment server, for one environment kind.
pub struct RemoteEnvironment {
    base_url: String,
    environment: String,
    agent: ureq::Agent,
    episode: Option<String>,
}

impl RemoteEnvironment {
    /// A client for `environment` on the server at `base_url` (`http://host:port`); every call
    /// gives up after `timeout`.
    pub fn new(base_url: &str, environment: &str, timeout: Duration) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        RemoteEnvironment {
            base_url: base_url.trim_end_matches('/').to_owned(),
            environment: environment.to_owned(),
            agent,
            episode: None,
        }
    }

    /// Asks the server what it runs.
    pub fn health(&self) -> Result<Health, EnvError> {
        let url = format!("{}/v1/health", self.base_url);
        let response = self
            .agent
            .get(&url)
            .call()
            .map_err(|e| self.unavailable(&e))?;
        self.read(response, 200)
    }

    fn unavailable(&self, error: &dyn std::fmt::Display) -> EnvError {
        EnvError::Unavailable(format!("{}: {error}", self.base_url))
    }

    fn read<T: for<'de> Deserialize<'de>>(
        &self,
        mut response: ureq::http::Response<ureq::Body>,
        expected: u16,
    ) -> Result<T, EnvError> {
        let status = response.status().as_u16();
        let body = response
            .body_mut()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_string()
            .map_err(|e| self.unavailable(&e))?;
        if status == expected {
            return serde_json::from_str(&body)
                .map_err(|e| self.unavailable(&format_args!("malformed answer ({e})")));
        }
        let detail = serde_json::from_str::<ErrorBody>(&body)
            .map(|b| format!("{}: {}", b.error.code, b.error.message))
            .unwrap_or_else(|_| body.chars().take(200).collect());
        let message = format!("{}: HTTP {status}: {detail}", self.base_url);
        // A 4xx means this request was wrong (a bug on our side or a misconfiguration); a 5xx
        // or anything unexpected means the server is in trouble.
        if (400..500).contains(&status) && status != 429 {
            Err(EnvError::InvalidConfig(message))
        } else {
            Err(EnvError::Unavailable(message))
        }
    }
}

impl Environment for RemoteEnvironment {
    fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        if let Some(previous) = self.episode.take() {
            // Free the server's slot; if this fails the server reclaims it on its own timeout.
            let url = format!("{}/v1/episodes/{previous}", self.base_url);
            let _ = self.agent.delete(&url).call();
        }
        let url = format!("{}/v1/episodes", self.base_url);
        let request = StartRequest {
            environment: self.environment.clone(),
            seed,
        };
        let response = self
            .agent
            .post(&url)
            .send_json(&request)
            .map_err(|e| self.unavailable(&e))?;
        let started: StartResponse = self.read(response, 201)?;
        if started.episode.is_empty()
            || !started
                .episode
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(self.unavailable(&format_args!(
                "episode id {:?} is not [A-Za-z0-9_-]+",
                started.episode
            )));
        }
        self.episode = Some(started.episode);
        Ok(started.observation)
    }

    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        let Some(episode) = self.episode.clone() else {
            return Err(EnvError::NotRunning);
        };
        let url = format!("{}/v1/episodes/{episode}/step", self.base_url);
        let response = self
            .agent
            .post(&url)
            .send_json(&StepRequest {
                action: action.to_owned(),
            })
            .map_err(|e| self.unavailable(&e))?;
        let answer: StepResponse = self.read(response, 200)?;
        if !answer.reward.is_finite() {
            return Err(self.unavailable(&format_args!("reward {} is not finite", answer.reward)));
        }
        if answer.done {
            self.episode = None;
        }
        Ok(Step {
            observation: answer.observation,
            reward: answer.reward,
            done: answer.done,
            invalid_action: answer.invalid_action,
        })
    }

    fn kind(&self) -> &'static str {
        "remote"
    }
}
