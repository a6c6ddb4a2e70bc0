//! An ordered set of small integer ids, as a two-level bitset.
//!
//! The core's queues hold trajectory ids, ordered oldest group first. Trajectories are numbered
//! group by group as groups start, so that order is the order of the ids, and a queue is a set
//! of ids walked upwards. A bitset makes insertion and removal one bit each (a tree allocates
//! and rebalances nodes), and a summary bit per word of ids lets the walk skip a long run of
//! ids that are not queued (finished trajectories, or ones in another phase) 4,096 at a time.

/// Ids (below 2^64) in increasing order; memory grows with the largest id inserted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdSet {
    /// Bit `i % 64` of word `i / 64` is set when `i` is in the set.
    words: Vec<u64>,
    /// Bit `w % 64` of summary word `w / 64` is set when word `w` is not zero.
    summary: Vec<u64>,
    len: usize,
}

impl IdSet {
    /// An empty set.
    #[cfg(test)]
    pub fn new() -> Self {
        Self::default()
    }

    /// Ids in the set.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `id` is in the set.
    #[cfg(test)]
    pub fn contains(&self, id: u64) -> bool {
        self.words
            .get((id / 64) as usize)
            .is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    /// Adds `id`; `false` if it was already there.
    pub fn insert(&mut self, id: u64) -> bool {
        let word = (id / 64) as usize;
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
            self.summary.resize(self.words.len().div_ceil(64), 0);
        }
        let bit = 1 << (id % 64);
        if self.words[word] & bit != 0 {
            return false;
        }
        self.words[word] |= bit;
        self.summary[word / 64] |= 1 << (word % 64);
        self.len += 1;
        true
    }

    /// Removes `id`; `false` if it was not there.
    pub fn remove(&mut self, id: u64) -> bool {
        let word = (id / 64) as usize;
        let bit = 1 << (id % 64);
        match self.words.get_mut(word) {
            Some(w) if *w & bit != 0 => {
                *w &= !bit;
                if *w == 0 {
                    self.summary[word / 64] &= !(1 << (word % 64));
                }
                self.len -= 1;
                true
            }
            _ => false,
        }
    }

    /// The smallest id in the set.
    pub fn first(&self) -> Option<u64> {
        self.at_or_after(0)
    }

    /// The smallest id in the set greater than `id`.
    pub fn after(&self, id: u64) -> Option<u64> {
        self.at_or_after(id.checked_add(1)?)
    }

    /// The smallest id in the set at or above `id`.
    fn at_or_after(&self, id: u64) -> Option<u64> {
        let word = (id / 64) as usize;
        let rest = self.words.get(word)? & (u64::MAX << (id % 64));
        if rest != 0 {
            return Some(word as u64 * 64 + rest.trailing_zeros() as u64);
        }
        // The next word that is not zero, from the summary.
        let next = word + 1;
        let mut index = next / 64;
        let mut bits = self.summary.get(index)? & u64::MAX.checked_shl((next % 64) as u32)?;
        while bits == 0 {
            index += 1;
            bits = *self.summary.get(index)?;
        }
        let word = index * 64 + bits.trailing_zeros() as usize;
        let w = self.words.get(word)?;
        Some(word as u64 * 64 + w.trailing_zeros() as u64)
    }

    /// The ids, smallest first.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        std::iter::successors(self.first(), |&id| self.after(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use std::collections::BTreeSet;

    #[test]
    fn walks_the_same_ids_as_a_tree() {
        let mut rng = SplitMix64::new(3);
        let mut set = IdSet::new();
        let mut tree = BTreeSet::new();
        for round in 0..40_000u64 {
            // Clustered ids, with long gaps now and then, as a queue of trajectories sees.
            let id = match rng.below(10) {
                0 => rng.below(300_000),
                _ => round / 4 + rng.below(200),
            };
            if rng.below(3) == 0 {
                assert_eq!(set.remove(id), tree.remove(&id));
            } else {
                assert_eq!(set.insert(id), tree.insert(id));
            }
            assert_eq!(set.len(), tree.len());
            let probe = rng.below(310_000);
            assert_eq!(set.contains(probe), tree.contains(&probe));
            assert_eq!(
                set.after(probe),
                tree.range(probe + 1..).next().copied(),
                "after {probe}"
            );
            assert_eq!(set.first(), tree.first().copied());
        }
        assert!(set.iter().eq(tree.iter().copied()));
        assert_eq!(set.after(u64::MAX), None);
    }

    #[test]
    fn ids_on_word_and_summary_boundaries() {
        let mut set = IdSet::new();
        for id in [0, 63, 64, 4095, 4096, 4097, 262_143, 262_144] {
            assert!(set.insert(id));
        }
        let ids: Vec<u64> = set.iter().collect();
        assert_eq!(ids, vec![0, 63, 64, 4095, 4096, 4097, 262_143, 262_144]);
        assert!(set.remove(4096));
        assert_eq!(set.after(4095), Some(4097));
        assert!(set.remove(4097));
        assert_eq!(set.after(4095), Some(262_143));
        assert_eq!(set.after(262_144), None);
    }
}
