//! `chat_turn_tokens`: the first turn is the whole rendering, a later turn only the template's
//! delta after an assistant turn, and a template that rewrites earlier turns is refused.

use rollfleet_engine::{
    ChatMessage, Engine, EngineError, EngineFuture, EventStream, GenerateRequest, WeightsRef,
    chat_turn_tokens,
};

/// An engine whose template numbers each message by its position from the end (as a template
/// that marks the last turn differently would): not incremental.
struct Rewriting;

impl Engine for Rewriting {
    fn generate(&self, _request: GenerateRequest) -> EventStream {
        Box::pin(futures_util::stream::empty())
    }
    fn update_weights(&self, _weights: &WeightsRef) -> EngineFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    fn served_weight_version(&self) -> EngineFuture<'_, Option<u64>> {
        Box::pin(async { Ok(None) })
    }
    fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> EngineFuture<'_, Vec<u32>> {
        let n = messages.len() as u32;
        let mut tokens: Vec<u32> = (0..n).map(|i| n - i).collect();
        if add_generation_prompt {
            tokens.push(99);
        }
        Box::pin(async move { Ok(tokens) })
    }
    fn policy_version(&self) -> u64 {
        0
    }
    fn backend(&self) -> &'static str {
        "rewriting"
    }
}

#[tokio::test]
async fn a_template_that_rewrites_earlier_turns_is_refused_with_the_reason() {
    let turn = [ChatMessage::new("user", "next")];
    match chat_turn_tokens(&Rewriting, false, &turn, None).await {
        Err(EngineError::Protocol { reason, .. }) => {
            assert!(reason.contains("not incremental"), "{reason}");
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
    // The first turn needs no prefix check.
    assert_eq!(
        chat_turn_tokens(&Rewriting, true, &turn, None).await.ok(),
        Some(vec![1, 99])
    );
}
