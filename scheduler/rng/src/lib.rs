//! rollfleet's one seeded random number generator (SplitMix64), shared by the scheduler core,
//! the simulator and the environments.
//!
//! Every random draw in rollfleet must be reproducible and independent of event order. The core
//! draws which task a new group samples from a generator seeded by `(job seed, group id)`, so the
//! same group gets the same task whatever policy or timing surrounds it; the simulator keys its
//! workload streams the same way; an environment's level is a pure function of its seed, so a lost
//! episode can be replayed. SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom
//! number generators", OOPSLA 2014) is small, fast and good enough for sampling (not for secrets);
//! it is written here so nothing depends on an RNG crate or OS entropy.

/// A SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator with the given seed.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// A generator for one keyed stream of a seeded run: the same `(seed, keys)` always give the
    /// same stream.
    pub fn keyed(seed: u64, keys: &[u64]) -> Self {
        let mut mix = SplitMix64::new(seed ^ 0x5851_f42d_4c95_7f2d);
        let mut state = mix.next_u64();
        for &key in keys {
            let mut m = SplitMix64::new(state ^ key.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            state = m.next_u64();
        }
        SplitMix64::new(state)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform float in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `[0, n)` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift; the tiny bias is irrelevant for simulation.
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// A uniform index in `[0, n)` (0 when `n` is 0).
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// A standard normal variate (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// An index drawn with probability proportional to `weights` (non-positive weights are never
    /// drawn; all non-positive gives index 0).
    pub fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().filter(|w| **w > 0.0).sum();
        if total.is_nan() || total <= 0.0 {
            return 0;
        }
        let mut x = self.next_f64() * total;
        let mut last = 0;
        for (i, &w) in weights.iter().enumerate() {
            if w > 0.0 {
                last = i;
                if x < w {
                    return i;
                }
                x -= w;
            }
        }
        last
    }
}

/// The seeds a seeded randomized test runs: the one `{prefix}_SEED` names in the environment (to
/// reproduce a failure), else `0..{prefix}_CASES` (`default_cases` when unset or not a number).
/// For tests only: it panics on a `{prefix}_SEED` that is not a number.
pub fn test_seeds(prefix: &str, default_cases: u64) -> Vec<u64> {
    let seed_var = format!("{prefix}_SEED");
    match std::env::var(&seed_var) {
        Ok(seed) => match seed.parse() {
            Ok(seed) => vec![seed],
            Err(_) => panic!("{seed_var} is a number, not {seed:?}"),
        },
        Err(_) => {
            let cases = std::env::var(format!("{prefix}_CASES"))
                .ok()
                .and_then(|c| c.parse().ok())
                .unwrap_or(default_cases);
            (0..cases).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_output_matches_the_reference_implementation() {
        // Reference value of splitmix64 seeded with 0 (Vigna's splitmix64.c).
        assert_eq!(SplitMix64::new(0).next_u64(), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn an_index_stays_below_its_bound_and_an_empty_range_gives_zero() {
        let mut rng = SplitMix64::new(3);
        assert!((0..1000).all(|_| rng.index(7) < 7));
        assert_eq!(rng.index(0), 0);
    }

    #[test]
    fn the_same_seed_gives_the_same_sequence() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        assert!((0..5).all(|_| a.next_u64() == b.next_u64()));
    }

    #[test]
    fn below_stays_in_range_and_hits_every_value() {
        let mut rng = SplitMix64::new(1);
        let mut seen = [false; 6];
        for _ in 0..1000 {
            seen[rng.below(6) as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn keyed_streams_are_reproducible_and_distinct() {
        let a = SplitMix64::keyed(7, &[1, 2]).next_u64();
        assert_eq!(a, SplitMix64::keyed(7, &[1, 2]).next_u64());
        assert_ne!(a, SplitMix64::keyed(7, &[2, 1]).next_u64());
        assert_ne!(a, SplitMix64::keyed(8, &[1, 2]).next_u64());
    }

    #[test]
    fn weighted_draws_follow_the_weights() {
        let mut rng = SplitMix64::new(1);
        let mut counts = [0u32; 3];
        for _ in 0..10_000 {
            counts[rng.weighted(&[0.5, 0.0, 0.5])] += 1;
        }
        assert_eq!(counts[1], 0);
        assert!((4_500..5_500).contains(&counts[0]), "{counts:?}");
    }
}
