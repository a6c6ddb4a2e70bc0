//! A map from increasing ids to values, stored densely.
//!
//! Stage ids are handed out in increasing order and most stages finish soon after they start, so
//! a ring buffer indexed by `id - oldest live id` gives O(1) insert, lookup and removal, and
//! iterates in id order (deterministically), where a `BTreeMap` would shuffle large nodes on
//! every removal.

use std::collections::VecDeque;

/// Values keyed by ids that are inserted in (mostly) increasing order.
#[derive(Debug, Clone)]
pub struct IdSlab<T> {
    base: u64,
    items: VecDeque<Option<T>>,
    len: usize,
}

impl<T> Default for IdSlab<T> {
    fn default() -> Self {
        IdSlab {
            base: 0,
            items: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> IdSlab<T> {
    /// An empty slab.
    pub fn new() -> Self {
        Self::default()
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Inserts or replaces; returns `false` (and drops the value) for an id older than every
    /// live one that is not itself live.
    pub fn insert(&mut self, id: u64, value: T) -> bool {
        if self.items.is_empty() {
            self.base = id;
        }
        if id < self.base {
            let gap = (self.base - id) as usize;
            if gap > 1 << 24 {
                return false;
            }
            for _ in 0..gap {
                self.items.push_front(None);
            }
            self.base = id;
        }
        let index = (id - self.base) as usize;
        // The usual case, the next id: append, instead of filling a `None` and replacing it.
        if index == self.items.len() {
            self.items.push_back(Some(value));
            self.len += 1;
            return true;
        }
        if index > self.items.len() {
            self.items.resize_with(index + 1, || None);
        }
        if self.items[index].replace(value).is_none() {
            self.len += 1;
        }
        true
    }

    /// The value of `id`.
    pub fn get(&self, id: u64) -> Option<&T> {
        let index = id.checked_sub(self.base)? as usize;
        self.items.get(index)?.as_ref()
    }

    /// The value of `id`, mutably.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let index = id.checked_sub(self.base)? as usize;
        self.items.get_mut(index)?.as_mut()
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: u64) -> bool {
        self.get(id).is_some()
    }

    /// Removes and returns the value of `id`. Inlined: most removals are of a stage that is not
    /// the oldest, and cost a look and a `take`.
    #[inline]
    pub fn remove(&mut self, id: u64) -> Option<T> {
        self.remove_if(id, |_| true)
    }

    /// Removes and returns the value of `id` if `pred` holds for it (one lookup where a `get`
    /// and a `remove` would make two).
    #[inline]
    pub fn remove_if(&mut self, id: u64, pred: impl FnOnce(&T) -> bool) -> Option<T> {
        let index = id.checked_sub(self.base)? as usize;
        let entry = self.items.get_mut(index)?;
        if !entry.as_ref().is_some_and(pred) {
            return None;
        }
        let value = entry.take()?;
        self.len -= 1;
        // The front is always live (every removal there trims it), so only removing the oldest
        // can leave empty ids to drop.
        if index == 0 {
            self.trim_front();
        }
        Some(value)
    }

    /// Drops the empty ids at the front.
    #[inline(never)]
    fn trim_front(&mut self) {
        while let Some(None) = self.items.front() {
            self.items.pop_front();
            self.base += 1;
        }
        if self.items.is_empty() {
            self.base = 0;
        }
    }

    /// Live entries in id order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &T)> {
        let base = self.base;
        self.items
            .iter()
            .enumerate()
            .filter_map(move |(i, v)| v.as_ref().map(|v| (base + i as u64, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_come_back_in_id_order_after_any_removals() {
        let mut slab = IdSlab::new();
        for id in 10..20 {
            assert!(slab.insert(id, id * 2));
        }
        assert_eq!(slab.remove(10), Some(20));
        assert_eq!(slab.remove(15), Some(30));
        assert_eq!(slab.remove(15), None);
        assert_eq!(slab.get(12), Some(&24));
        let ids: Vec<u64> = slab.iter().map(|(id, _)| id).collect();
        assert_eq!(ids, vec![11, 12, 13, 14, 16, 17, 18, 19]);
        assert_eq!(slab.len(), 8);
        assert!(slab.insert(5, 0));
        assert_eq!(slab.iter().next(), Some((5, &0)));
    }

    #[test]
    fn random_inserts_and_removals_match_a_btreemap() {
        use crate::rng::SplitMix64;
        use std::collections::BTreeMap;
        for seed in 0..20 {
            let mut rng = SplitMix64::new(seed);
            let mut slab: IdSlab<u64> = IdSlab::new();
            let mut tree: BTreeMap<u64, u64> = BTreeMap::new();
            // Ids mostly increase (as stage ids do), with a long-lived entry now and then, a few
            // replacements and inserts before the oldest live id.
            let mut next = 1_000u64;
            for _ in 0..5_000 {
                match rng.below(20) {
                    0..=9 => {
                        next += 1 + rng.below(3);
                        let v = rng.next_u64();
                        assert!(slab.insert(next, v));
                        tree.insert(next, v);
                    }
                    10 => {
                        // Replace a live one, or insert below the oldest live one.
                        let id = match tree.keys().next() {
                            Some(&first) if rng.below(2) == 0 => first.saturating_sub(rng.below(5)),
                            _ => next.saturating_sub(rng.below(50)),
                        };
                        let v = rng.next_u64();
                        assert!(slab.insert(id, v));
                        tree.insert(id, v);
                    }
                    _ => {
                        // Remove mostly recent ids (short-lived), sometimes the oldest; every
                        // other removal only of an even value.
                        let id = if rng.below(8) == 0 {
                            tree.keys().next().copied().unwrap_or(0)
                        } else {
                            next.saturating_sub(rng.below(40))
                        };
                        if rng.below(2) == 0 {
                            assert_eq!(slab.remove(id), tree.remove(&id));
                        } else {
                            let even = tree.get(&id).is_some_and(|v| v % 2 == 0);
                            let expected = if even { tree.remove(&id) } else { None };
                            assert_eq!(slab.remove_if(id, |v| v % 2 == 0), expected);
                        }
                    }
                }
                let probe = next.saturating_sub(rng.below(100));
                assert_eq!(slab.get(probe), tree.get(&probe));
                assert_eq!(slab.contains(probe), tree.contains_key(&probe));
                assert_eq!(slab.len(), tree.len());
                assert_eq!(slab.is_empty(), tree.is_empty());
            }
            let a: Vec<(u64, u64)> = slab.iter().map(|(id, &v)| (id, v)).collect();
            let b: Vec<(u64, u64)> = tree.iter().map(|(&id, &v)| (id, v)).collect();
            assert_eq!(a, b);
        }
    }
}
