//! What the actor keeps of a trajectory's tokens, and how they travel: the kind of prompt a
//! worker's engine takes ([`PolicyInput`]), each turn's tokens as the engine produced them
//! ([`TurnTokens`]), the context a token-in engine is sent for a turn ([`token_context`]) and the
//! turn as the trainer feed carries it ([`feed_turn`]).

use std::collections::BTreeMap;

use rollfleet_proto::v1::{ChatMessage, Segment, Turn};

/// What a worker's engine takes as a generation's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PolicyInput {
    /// Token counts only (the emulated engine).
    Counts,
    /// The turn's whole context as text (an OpenAI-compatible engine): its output text goes to
    /// the environment step.
    Text,
    /// Token ids in, token ids and log-probabilities out (SGLang's and vLLM's native APIs): the
    /// context goes as the tokens earlier turns produced, with only the new messages as text.
    Tokens,
}

impl PolicyInput {
    pub(crate) fn of_backend(backend: &str) -> PolicyInput {
        match backend {
            "openai" => PolicyInput::Text,
            "sglang" | "vllm" => PolicyInput::Tokens,
            _ => PolicyInput::Counts,
        }
    }
}

/// The tokens of one turn's generation, as the engine produced them.
#[derive(Default)]
pub(crate) struct TurnTokens {
    /// The ids the chat template gave the messages before the action (the task, or the last
    /// observation).
    pub(crate) prompt: Vec<u32>,
    /// The sampled action ids and their behaviour log-probabilities.
    pub(crate) action: Vec<u32>,
    pub(crate) logprobs: Vec<f32>,
    pub(crate) emulated: bool,
    /// The runs of `action` each version generated, in order: one, or more for a turn whose
    /// generation was interrupted by a weight update and resumed. Empty: one run, under the
    /// turn's version.
    pub(crate) segments: Vec<Segment>,
}

/// A feed turn with its tokens: prompt then action ids, the action's log-probabilities, a loss
/// mask over both (1 on the sampled action tokens only), and the versions that generated them.
pub(crate) fn feed_turn(mut turn: Turn, tokens: Option<TurnTokens>) -> Turn {
    let Some(t) = tokens else {
        return turn;
    };
    let mut mask = Vec::with_capacity(t.prompt.len() + t.action.len());
    mask.resize(t.prompt.len(), 0u8);
    mask.resize(t.prompt.len() + t.action.len(), 1);
    turn.loss_mask = mask;
    turn.segments = if t.segments.is_empty() {
        vec![Segment {
            policy_version: turn.policy_version,
            tokens: t.action.len() as u32,
        }]
    } else {
        t.segments
    };
    turn.prompt_tokens = t.prompt;
    turn.action_tokens = t.action;
    turn.action_logprobs = t.logprobs;
    turn.emulated = t.emulated;
    turn
}

/// What a token-in engine needs for turn `turn`: every token of the turns before it (`tokens`,
/// by turn), as they were produced, and the chat message this turn adds (`content`: the task on
/// turn 0, then the observation the last action got).
pub(crate) fn token_context(
    tokens: &BTreeMap<u32, TurnTokens>,
    turn: u32,
    content: String,
) -> (Vec<u32>, Vec<ChatMessage>) {
    let mut context = Vec::new();
    for t in tokens.range(..turn).map(|(_, t)| t) {
        context.extend_from_slice(&t.prompt);
        context.extend_from_slice(&t.action);
    }
    let message = ChatMessage {
        role: "user".into(),
        content,
    };
    (context, vec![message])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fed_turn_masks_its_prompt_and_trains_its_action_under_one_segment() {
        let turn = feed_turn(
            Turn {
                policy_version: 3,
                ..Default::default()
            },
            Some(TurnTokens {
                prompt: vec![1, 2, 3],
                action: vec![7, 8],
                logprobs: vec![-0.5, -0.25],
                emulated: false,
                segments: Vec::new(),
            }),
        );
        assert_eq!(turn.loss_mask, vec![0, 0, 0, 1, 1]);
        assert_eq!(turn.segments.len(), 1);
        assert_eq!(
            (turn.segments[0].policy_version, turn.segments[0].tokens),
            (3, 2)
        );
        assert_eq!(turn.action_logprobs, vec![-0.5, -0.25]);
    }

    #[test]
    fn a_resumed_turn_keeps_one_segment_per_version_that_generated_it() {
        let turn = feed_turn(
            Turn {
                policy_version: 2,
                ..Default::default()
            },
            Some(TurnTokens {
                prompt: vec![1],
                action: vec![7, 8, 9],
                logprobs: vec![-0.5, -0.25, -1.0],
                emulated: false,
                segments: vec![
                    Segment {
                        policy_version: 2,
                        tokens: 2,
                    },
                    Segment {
                        policy_version: 3,
                        tokens: 1,
                    },
                ],
            }),
        );
        assert_eq!(turn.loss_mask, vec![0, 1, 1, 1]);
        let runs: Vec<(u64, u32)> = turn
            .segments
            .iter()
            .map(|s| (s.policy_version, s.tokens))
            .collect();
        assert_eq!(runs, vec![(2, 2), (3, 1)]);
    }

    #[test]
    fn a_turns_context_is_every_earlier_turns_prompt_and_action_in_order() {
        let mut tokens = BTreeMap::new();
        for (turn, (p, a)) in [(vec![1], vec![2, 3]), (vec![4], vec![5])]
            .into_iter()
            .enumerate()
        {
            tokens.insert(
                turn as u32,
                TurnTokens {
                    prompt: p,
                    action: a,
                    ..Default::default()
                },
            );
        }
        let (context, messages) = token_context(&tokens, 1, "obs".into());
        assert_eq!(context, vec![1, 2, 3]);
        assert_eq!(messages[0].content, "obs");
        assert_eq!(
            token_context(&tokens, 2, String::new()).0,
            vec![1, 2, 3, 4, 5]
        );
    }
}
