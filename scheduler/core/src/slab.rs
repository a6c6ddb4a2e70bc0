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

    /// Removes and returns the value of `id`.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let index = id.checked_sub(self.base)? as usize;
        let value = self.items.get_mut(index)?.take()?;
        self.len -= 1;
        while let Some(None) = self.items.front() {
            self.items.pop_front();
            self.base += 1;
        }
        if self.items.is_empty() {
            self.base = 0;
        }
        Some(value)
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
}
