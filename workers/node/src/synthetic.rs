//! The emulated policy's outputs: synthetic tokens and log-probabilities, and random legal
//! actions, each seeded per trajectory and turn.

use super::*;

/// Vocabulary the emulated engine draws its synthetic token ids from (Qwen2.5's size).
const SYNTHETIC_VOCAB: u64 = 151_936;

/// The emulated engine's `n` synthetic token ids and their log-probabilities, seeded by `seed`
/// and `key` (trajectory, attempt, turn): the shape of a real engine's output, for the token-level
/// feed, with no model behind it (every such turn is marked emulated).
pub(crate) fn synthetic_tokens(seed: u64, key: &[u64], n: u64) -> (Vec<u32>, Vec<f32>) {
    let mut rng = synthetic_rng(seed, key);
    let n = n.min(MAX_SYNTHETIC_TOKENS) as usize;
    let mut ids = Vec::with_capacity(n);
    let mut logprobs = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(rng.below(SYNTHETIC_VOCAB) as u32);
        // A sampled token's log-probability: at most 0, mostly near it.
        logprobs.push(-(rng.next_f64() * rng.next_f64() * 4.0) as f32);
    }
    (ids, logprobs)
}

/// The emulated engine's `n` synthetic ids of a prompt (no log-probabilities: nothing sampled
/// them).
pub(crate) fn synthetic_ids(seed: u64, key: &[u64], n: u64) -> Vec<u32> {
    let mut rng = synthetic_rng(seed, key);
    (0..n.min(MAX_SYNTHETIC_TOKENS))
        .map(|_| rng.below(SYNTHETIC_VOCAB) as u32)
        .collect()
}

/// Most synthetic tokens one turn gets (a bound on what a malformed count can cost).
const MAX_SYNTHETIC_TOKENS: u64 = 1 << 20;

fn synthetic_rng(seed: u64, key: &[u64]) -> SplitMix64 {
    let mut keyed = vec![0x746f_6b65_6e73];
    keyed.extend_from_slice(key);
    SplitMix64::keyed(seed, &keyed)
}

/// The emulated policy's action: a random legal move of the environment, seeded per episode and
/// turn (the synthetic tokens of the emulated engine carry no text to parse). Grid games get a
/// direction, the calculator task a `calc:` call or an `answer:`; any other (remote) kind gets a
/// number from 1 to 100, the action format of the reference remote server's game.
pub fn emulated_action(environment: &str, seed: u64, turn: u32) -> String {
    let mut rng = SplitMix64::keyed(seed, &[0x6163_7469_6f6e, turn as u64]);
    match environment {
        "calculator" => {
            if rng.below(3) == 0 {
                format!("answer: {:.3}", rng.next_f64() * 100.0)
            } else {
                format!("calc: {} * {}", rng.below(100), rng.below(100))
            }
        }
        "sokoban" | "frozenlake" => {
            ["up", "down", "left", "right"][rng.below(4) as usize].to_owned()
        }
        _ => (1 + rng.below(100)).to_string(),
    }
}
