//! The environment host: runs the environments of a CPU node, a bounded number at once, and
//! keeps a misbehaving environment from taking anything else down with it.
//!
//! - **Slots**: at most `slots` episodes run at once; a start beyond that is refused with
//!   [`HostError::NoFreeSlot`] (the scheduler never sends more than a node's capacity; this is
//!   the backstop).
//! - **Timeouts**: every reset and step runs on the blocking thread pool under a deadline. An
//!   environment that hangs is abandoned (its thread cannot be killed; it is left to finish and
//!   its result dropped), its slot is freed, and the caller gets
//!   [`HostError::Infrastructure`].
//! - **Crash isolation**: a panic inside an environment is caught and becomes
//!   [`HostError::Infrastructure`] for that episode only.
//! - **Replay**: environments are pure functions of their seed and actions, so an episode lost to
//!   an infrastructure failure can be rebuilt on any host with [`EnvHost::restore`], which replays
//!   the recorded actions. A failure is therefore retried, never scored as a zero reward.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rollfleet_environments::{EnvError, Environment, Step};

/// Makes a fresh environment of one kind.
pub type Factory = Arc<dyn Fn() -> Box<dyn Environment + Send> + Send + Sync>;

/// Identifies an episode on this host.
pub type EpisodeId = u64;

/// Why the host could not do what was asked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HostError {
    /// No factory for this environment kind.
    #[error("unknown environment \"{kind}\" (this host runs: {})", known.join(", "))]
    UnknownEnvironment {
        /// The kind asked for.
        kind: String,
        /// The kinds this host runs.
        known: Vec<String>,
    },
    /// Every slot is busy.
    #[error("all {0} environment slots are busy")]
    NoFreeSlot(usize),
    /// No such episode (never started, already ended, or lost to a failure).
    #[error("no episode {0} on this host")]
    UnknownEpisode(EpisodeId),
    /// The environment panicked, hung past its deadline, or could not be reached: the episode is
    /// gone from this host; retry it (see [`EnvHost::restore`]), never score it.
    #[error("episode {episode}: infrastructure failure: {reason}")]
    Infrastructure {
        /// The episode.
        episode: EpisodeId,
        /// What happened.
        reason: String,
    },
    /// The environment refused the call (e.g. an impossible configuration).
    #[error("episode {episode}: {error}")]
    Environment {
        /// The episode.
        episode: EpisodeId,
        /// The environment's error.
        error: EnvError,
    },
}

/// Settings of a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostConfig {
    /// Episodes that may run at once.
    pub slots: usize,
    /// Deadline of one reset or step.
    pub step_timeout: Duration,
}

enum Slot {
    /// Idle between calls, holding its environment.
    Ready(Box<dyn Environment + Send>),
    /// A call is running on a blocking thread, which holds the environment.
    Busy,
}

struct State {
    episodes: BTreeMap<EpisodeId, Slot>,
    next_id: EpisodeId,
}

/// The environment host of one node.
pub struct EnvHost {
    config: HostConfig,
    factories: BTreeMap<String, Factory>,
    state: Mutex<State>,
}

impl EnvHost {
    /// A host running these environment kinds.
    pub fn new(config: HostConfig, factories: BTreeMap<String, Factory>) -> Self {
        EnvHost {
            config,
            factories,
            state: Mutex::new(State {
                episodes: BTreeMap::new(),
                next_id: 1,
            }),
        }
    }

    /// A host running every built-in environment.
    pub fn with_builtins(config: HostConfig) -> Self {
        let mut factories: BTreeMap<String, Factory> = BTreeMap::new();
        for kind in rollfleet_environments::BUILTIN_KINDS {
            let factory: Factory = Arc::new(move || {
                rollfleet_environments::builtin(kind)
                    .unwrap_or_else(|| unreachable!("{kind} is listed as built in"))
            });
            factories.insert((*kind).to_owned(), factory);
        }
        EnvHost::new(config, factories)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while the lock is held cannot leave the map inconsistent (every update is a
        // single insert or remove), so a poisoned lock is still safe to use.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Episodes running now.
    pub fn busy(&self) -> usize {
        self.state().episodes.len()
    }

    /// Slots in all.
    pub fn slots(&self) -> usize {
        self.config.slots
    }

    /// Starts an episode of `kind` from `seed`; returns its id and first observation.
    pub async fn start(&self, kind: &str, seed: u64) -> Result<(EpisodeId, String), HostError> {
        self.restore(kind, seed, &[]).await
    }

    /// Starts an episode of `kind` from `seed` and replays `actions` on it, rebuilding the state
    /// an episode lost elsewhere had reached; returns its id and the last observation.
    pub async fn restore(
        &self,
        kind: &str,
        seed: u64,
        actions: &[String],
    ) -> Result<(EpisodeId, String), HostError> {
        let factory = self
            .factories
            .get(kind)
            .ok_or_else(|| HostError::UnknownEnvironment {
                kind: kind.to_owned(),
                known: self.factories.keys().cloned().collect(),
            })?
            .clone();
        let id = {
            let mut state = self.state();
            if state.episodes.len() >= self.config.slots {
                return Err(HostError::NoFreeSlot(self.config.slots));
            }
            let id = state.next_id;
            state.next_id += 1;
            state.episodes.insert(id, Slot::Busy);
            id
        };
        let actions = actions.to_vec();
        let outcome = self
            .run_isolated(id, move || {
                let mut environment = factory();
                let mut observation = environment.reset(seed)?;
                for action in &actions {
                    observation = environment.step(action)?.observation;
                }
                Ok((environment, observation))
            })
            .await;
        match outcome {
            Ok((environment, observation)) => {
                self.state().episodes.insert(id, Slot::Ready(environment));
                Ok((id, observation))
            }
            Err(error) => {
                self.state().episodes.remove(&id);
                Err(error)
            }
        }
    }

    /// Applies the policy's action to an episode.
    pub async fn step(&self, id: EpisodeId, action: &str) -> Result<Step, HostError> {
        let mut environment = {
            let mut state = self.state();
            match state.episodes.get_mut(&id) {
                None => return Err(HostError::UnknownEpisode(id)),
                Some(slot) => match std::mem::replace(slot, Slot::Busy) {
                    Slot::Ready(environment) => environment,
                    Slot::Busy => {
                        return Err(HostError::Infrastructure {
                            episode: id,
                            reason: "a step was sent while the previous one still runs".into(),
                        });
                    }
                },
            }
        };
        let action = action.to_owned();
        let outcome = self
            .run_isolated(id, move || {
                let step = environment.step(&action)?;
                Ok((environment, step))
            })
            .await;
        match outcome {
            Ok((environment, step)) => {
                let mut state = self.state();
                if step.done {
                    state.episodes.remove(&id);
                } else {
                    state.episodes.insert(id, Slot::Ready(environment));
                }
                Ok(step)
            }
            Err(error) => {
                self.state().episodes.remove(&id);
                Err(error)
            }
        }
    }

    /// Ends an episode early and frees its slot (e.g. the trajectory was cancelled).
    pub fn end(&self, id: EpisodeId) -> bool {
        self.state().episodes.remove(&id).is_some()
    }

    /// Runs `work` on the blocking pool with the step deadline, turning panics, timeouts and
    /// unreachable environments into infrastructure failures of this episode.
    async fn run_isolated<T: Send + 'static>(
        &self,
        episode: EpisodeId,
        work: impl FnOnce() -> Result<T, EnvError> + Send + 'static,
    ) -> Result<T, HostError> {
        let task = tokio::task::spawn_blocking(move || catch_unwind(AssertUnwindSafe(work)));
        let infrastructure = |reason: String| HostError::Infrastructure { episode, reason };
        match tokio::time::timeout(self.config.step_timeout, task).await {
            Err(_) => Err(infrastructure(format!(
                "no answer within {:?}; the environment was abandoned",
                self.config.step_timeout
            ))),
            Ok(Err(join_error)) => Err(infrastructure(format!("task failed: {join_error}"))),
            Ok(Ok(Err(panic))) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_owned());
                Err(infrastructure(format!(
                    "the environment panicked: {message}"
                )))
            }
            Ok(Ok(Ok(Err(EnvError::Unavailable(reason))))) => Err(infrastructure(reason)),
            Ok(Ok(Ok(Err(error)))) => Err(HostError::Environment { episode, error }),
            Ok(Ok(Ok(Ok(value)))) => Ok(value),
        }
    }
}
