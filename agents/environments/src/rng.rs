//! A small seeded random number generator, so that an environment's levels depend only on its
//! seed: the same seed gives the same level on every machine and in every run, which lets the
//! scheduler retry a failed environment from scratch and get the very same episode back.

/// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
/// OOPSLA 2014): one 64-bit state word, good statistical quality for simulation, not for secrets.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..n` (`n > 0`), without modulo bias worth noticing for small `n`.
    pub fn below(&mut self, n: usize) -> usize {
        debug_assert!(n > 0);
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// A uniform float in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_sequence() {
        let a: Vec<u64> = std::iter::repeat_with({
            let mut r = SplitMix64::new(7);
            move || r.next_u64()
        })
        .take(5)
        .collect();
        let mut r = SplitMix64::new(7);
        assert!(a.iter().all(|x| *x == r.next_u64()));
    }

    #[test]
    fn below_stays_in_range_and_hits_every_value() {
        let mut r = SplitMix64::new(1);
        let mut seen = [false; 6];
        for _ in 0..1000 {
            let v = r.below(6);
            seen[v] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}
