//! The multi-turn agent loop: how a trajectory's text is put together, turn by turn.
//!
//! A trajectory is a task prompt followed by turns; each turn is the policy's output (its
//! action, stamped with the policy version that produced it) and the environment's answer. This
//! crate owns the pieces every runtime needs, whichever process runs them:
//!
//! - [`PromptTemplate`] renders the context the policy sees (chat-style, with the transcript so
//!   far), so the text sent to an engine is the same in the simulator, on one machine and in a
//!   cluster;
//! - [`Transcript`] records turns with their policy versions (what the staleness bound checks);
//! - [`Limits`] ends an episode at its turn or context limit;
//! - [`run_episode`] drives a whole episode in one process, for tests, evaluation and the
//!   embedded run.
//!
//! Token counts come from a [`TokenCounter`]; the default estimates 4 bytes per token (OpenAI's
//! published rule of thumb for English text), which is what an emulated engine needs. A real
//! engine reports exact counts and the runtime records those instead.

use rollfleet_environments::{EnvError, Environment, extract_action};
use serde::Serialize;

/// Counts tokens in text.
pub trait TokenCounter {
    /// Tokens in `text`.
    fn count(&self, text: &str) -> u32;
}

/// Estimates one token per 4 bytes, rounded up.
#[derive(Debug, Clone, Copy, Default)]
pub struct BytesPerToken;

impl TokenCounter for BytesPerToken {
    fn count(&self, text: &str) -> u32 {
        u32::try_from(text.len().div_ceil(4)).unwrap_or(u32::MAX)
    }
}

/// One turn of a trajectory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Turn {
    /// Policy version that produced the action.
    pub policy_version: u64,
    /// The policy's whole output.
    pub output: String,
    /// Tokens of the output.
    pub output_tokens: u32,
    /// The environment's observation after the action.
    pub observation: String,
    /// Tokens of the observation.
    pub observation_tokens: u32,
    /// Reward of this step.
    pub reward: f64,
    /// The action could not be understood by the environment.
    pub invalid_action: bool,
}

/// The text of a trajectory so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Transcript {
    /// The task and first observation.
    pub task: String,
    /// Tokens of the task as rendered.
    pub task_tokens: u32,
    /// Turns taken.
    pub turns: Vec<Turn>,
}

impl Transcript {
    /// Tokens in the context so far: the task plus every output and observation.
    pub fn context_tokens(&self) -> u32 {
        self.turns.iter().fold(self.task_tokens, |sum, turn| {
            sum.saturating_add(turn.output_tokens)
                .saturating_add(turn.observation_tokens)
        })
    }

    /// Oldest policy version among the turns (what the staleness bound is checked against).
    pub fn oldest_policy_version(&self) -> Option<u64> {
        self.turns.iter().map(|t| t.policy_version).min()
    }

    /// Sum of step rewards.
    pub fn total_reward(&self) -> f64 {
        self.turns.iter().map(|t| t.reward).sum()
    }
}

/// How the context the policy sees is laid out.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptTemplate {
    /// Instructions placed before the task.
    pub system: String,
    /// Marks the start of a user (environment) message.
    pub user: String,
    /// Marks the start of an assistant (policy) message.
    pub assistant: String,
    /// Ends any message.
    pub end: String,
}

impl Default for PromptTemplate {
    /// The ChatML layout used by Qwen-family chat models.
    fn default() -> Self {
        PromptTemplate {
            system: "<|im_start|>system\nYou are an agent acting in an environment. Think \
                     briefly, then give your action inside <action></action>.<|im_end|>\n"
                .to_owned(),
            user: "<|im_start|>user\n".to_owned(),
            assistant: "<|im_start|>assistant\n".to_owned(),
            end: "<|im_end|>\n".to_owned(),
        }
    }
}

impl PromptTemplate {
    /// The whole context for the next turn, ending with the assistant marker.
    pub fn render(&self, transcript: &Transcript) -> String {
        let mut text = String::new();
        text.push_str(&self.system);
        self.push_message(&mut text, &self.user, &transcript.task);
        for turn in &transcript.turns {
            self.push_message(&mut text, &self.assistant, &turn.output);
            self.push_message(&mut text, &self.user, &turn.observation);
        }
        text.push_str(&self.assistant);
        text
    }

    /// Only what the next turn adds to the previous context (the last output and observation,
    /// and the assistant marker): what a prefill on a replica that holds the session's KV cache
    /// has to process.
    pub fn render_increment(&self, transcript: &Transcript) -> String {
        match transcript.turns.last() {
            None => self.render(transcript),
            Some(turn) => {
                let mut text = String::new();
                text.push_str(&self.end);
                self.push_message(&mut text, &self.user, &turn.observation);
                text.push_str(&self.assistant);
                text
            }
        }
    }

    fn push_message(&self, text: &mut String, role: &str, body: &str) {
        text.push_str(role);
        text.push_str(body);
        text.push('\n');
        text.push_str(&self.end);
    }
}

/// When an episode is cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most turns.
    pub max_turns: u32,
    /// Most context tokens (task plus every turn).
    pub context_limit: u32,
}

/// Why an episode ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum EndReason {
    /// The environment said the episode is over.
    Done,
    /// `max_turns` reached.
    TurnLimit,
    /// The context would exceed `context_limit`.
    ContextLimit,
}

impl Limits {
    /// Whether the transcript has hit a limit.
    pub fn reached(&self, transcript: &Transcript) -> Option<EndReason> {
        if transcript.turns.len() >= self.max_turns as usize {
            Some(EndReason::TurnLimit)
        } else if transcript.context_tokens() >= self.context_limit {
            Some(EndReason::ContextLimit)
        } else {
            None
        }
    }
}

/// A policy: context in, output text out.
pub trait Policy {
    /// The output for this context, and the policy version that produced it.
    fn act(&mut self, context: &str, max_tokens: u32) -> Result<(String, u64), PolicyError>;
}

/// A policy call that failed (an infrastructure failure: the engine, not the model).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy failed: {0}")]
pub struct PolicyError(pub String);

/// Why an episode could not be run to its end.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EpisodeError {
    /// The policy failed; the episode is an infrastructure failure, not a zero reward.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The environment refused a call.
    #[error("environment: {0}")]
    Environment(#[from] EnvError),
}

/// A finished episode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Episode {
    /// Everything that was said.
    pub transcript: Transcript,
    /// Why it ended.
    pub end: EndReason,
}

/// Runs one episode of `environment` from `seed` with `policy`, in this process.
pub fn run_episode(
    environment: &mut dyn Environment,
    policy: &mut dyn Policy,
    seed: u64,
    template: &PromptTemplate,
    limits: Limits,
    tokens: &dyn TokenCounter,
) -> Result<Episode, EpisodeError> {
    let task = environment.reset(seed)?;
    let mut transcript = Transcript {
        task_tokens: tokens.count(&template.render(&Transcript {
            task: task.clone(),
            ..Transcript::default()
        })),
        task,
        turns: Vec::new(),
    };
    loop {
        if let Some(end) = limits.reached(&transcript) {
            return Ok(Episode { transcript, end });
        }
        let context = template.render(&transcript);
        let budget = limits
            .context_limit
            .saturating_sub(transcript.context_tokens());
        let (output, policy_version) = policy.act(&context, budget)?;
        let step = environment.step(extract_action(&output))?;
        transcript.turns.push(Turn {
            policy_version,
            output_tokens: tokens.count(&output),
            output,
            observation_tokens: tokens.count(&step.observation),
            observation: step.observation,
            reward: step.reward,
            invalid_action: step.invalid_action,
        });
        if step.done {
            return Ok(Episode {
                transcript,
                end: EndReason::Done,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use rollfleet_environments::frozenlake::{Config, FrozenLake, Map};
    use rollfleet_environments::{builtin, conversion};

    use super::*;

    /// Replays a fixed list of outputs, stamping each with an increasing policy version.
    struct Scripted {
        outputs: Vec<String>,
        version: u64,
    }

    impl Policy for Scripted {
        fn act(&mut self, _: &str, _: u32) -> Result<(String, u64), PolicyError> {
            if self.outputs.is_empty() {
                return Err(PolicyError("engine unreachable".into()));
            }
            self.version += 1;
            Ok((self.outputs.remove(0), self.version))
        }
    }

    fn scripted(outputs: &[&str]) -> Scripted {
        Scripted {
            outputs: outputs.iter().map(|s| s.to_string()).collect(),
            version: 0,
        }
    }

    const WIDE: Limits = Limits {
        max_turns: 50,
        context_limit: 100_000,
    };

    /// Environment that starts every episode on Gymnasium's 4x4 map.
    struct Gym4x4(FrozenLake);

    impl Environment for Gym4x4 {
        fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
            Ok(self
                .0
                .reset_to(Map::parse("SFFF\nFHFH\nFFFH\nHFFG").unwrap(), seed))
        }
        fn step(&mut self, action: &str) -> Result<rollfleet_environments::Step, EnvError> {
            self.0.step(action)
        }
        fn kind(&self) -> &'static str {
            "frozenlake"
        }
    }

    #[test]
    fn a_solved_episode_ends_done_with_its_reward_and_versions() {
        let mut env = Gym4x4(FrozenLake::new(Config::default()));
        let mut policy = scripted(&[
            "<action>down</action>",
            "<action>down</action>",
            "right!<action>right</action>",
            "<action>down</action>",
            "<action>right</action>",
            "<action>right</action>",
        ]);
        let episode = run_episode(
            &mut env,
            &mut policy,
            0,
            &PromptTemplate::default(),
            WIDE,
            &BytesPerToken,
        )
        .unwrap();
        assert_eq!(episode.end, EndReason::Done);
        assert_eq!(episode.transcript.turns.len(), 6);
        assert_eq!(episode.transcript.total_reward(), 1.0);
        assert_eq!(episode.transcript.oldest_policy_version(), Some(1));
    }

    #[test]
    fn the_turn_limit_cuts_an_episode_off() {
        let mut env = builtin("sokoban").unwrap();
        let mut policy = scripted(&["wait"; 4]);
        let limits = Limits {
            max_turns: 3,
            ..WIDE
        };
        let episode = run_episode(
            env.as_mut(),
            &mut policy,
            1,
            &PromptTemplate::default(),
            limits,
            &BytesPerToken,
        )
        .unwrap();
        assert_eq!(episode.end, EndReason::TurnLimit);
        assert_eq!(episode.transcript.turns.len(), 3);
    }

    #[test]
    fn the_context_limit_cuts_an_episode_off_before_the_policy_is_asked() {
        let mut env = builtin("sokoban").unwrap();
        let mut policy = scripted(&["up"; 40]);
        let limits = Limits {
            max_turns: 40,
            context_limit: 400,
        };
        let episode = run_episode(
            env.as_mut(),
            &mut policy,
            1,
            &PromptTemplate::default(),
            limits,
            &BytesPerToken,
        )
        .unwrap();
        assert_eq!(episode.end, EndReason::ContextLimit);
        let before_last = Transcript {
            turns: episode.transcript.turns[..episode.transcript.turns.len() - 1].to_vec(),
            ..episode.transcript.clone()
        };
        assert!(episode.transcript.context_tokens() >= 400);
        assert!(before_last.context_tokens() < 400);
    }

    #[test]
    fn a_policy_failure_is_an_infrastructure_error_not_a_zero_reward() {
        let mut env = conversion::UnitConversion::new(conversion::Config::default());
        let mut policy = scripted(&["calc: 1+1"]);
        let error = run_episode(
            &mut env,
            &mut policy,
            1,
            &PromptTemplate::default(),
            WIDE,
            &BytesPerToken,
        )
        .unwrap_err();
        assert_eq!(
            error,
            EpisodeError::Policy(PolicyError("engine unreachable".into()))
        );
    }

    #[test]
    fn the_increment_is_exactly_what_the_full_context_adds() {
        let template = PromptTemplate::default();
        let mut transcript = Transcript {
            task: "Convert 1 mile to kilometres.".into(),
            ..Transcript::default()
        };
        transcript.turns.push(Turn {
            policy_version: 3,
            output: "<action>calc: 1*1.609344</action>".into(),
            output_tokens: 9,
            observation: "calc: 1*1.609344 = 1.609344".into(),
            observation_tokens: 7,
            reward: 0.0,
            invalid_action: false,
        });
        let full = template.render(&transcript);
        let previous = Transcript {
            turns: vec![],
            ..transcript.clone()
        };
        let prefix = format!(
            "{}{}\n",
            template.render(&previous),
            transcript.turns[0].output
        );
        assert_eq!(
            full,
            format!("{prefix}{}", template.render_increment(&transcript))
        );
    }

    #[test]
    fn the_byte_estimate_rounds_up() {
        assert_eq!(BytesPerToken.count(""), 0);
        assert_eq!(BytesPerToken.count("abcde"), 2);
    }
}
