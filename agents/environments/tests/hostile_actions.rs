//! Whatever a policy writes, an environment answers with an observation, never a panic, and an
//! episode always ends within its turn limit.

use proptest::prelude::*;
use rollfleet_environments::{BUILTIN_KINDS, builtin};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn arbitrary_actions_never_panic_and_episodes_end(
        seed in any::<u64>(),
        actions in proptest::collection::vec(".{0,80}", 1..120),
    ) {
        for kind in BUILTIN_KINDS {
            let mut env = builtin(kind).unwrap();
            let first = env.reset(seed).unwrap();
            prop_assert!(!first.is_empty());
            let mut ended = false;
            for action in &actions {
                match env.step(action) {
                    Ok(step) => {
                        prop_assert!(step.reward.is_finite());
                        if step.done {
                            ended = true;
                            break;
                        }
                    }
                    Err(error) => prop_assert!(false, "{kind}: {error}"),
                }
            }
            // Sokoban and FrozenLake cut off at 60 and 100 steps, the calculator at 4 turns.
            if actions.len() >= 100 {
                prop_assert!(ended, "{kind} did not end after {} actions", actions.len());
            }
        }
    }
}
