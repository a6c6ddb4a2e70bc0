//! An ordered list of keys with slot handles: a replica's idle KV caches, oldest use first.
//!
//! A replica keeps the KV cache of a trajectory between its turns, and evicts the least recently
//! used one first, ties broken by trajectory id: the order of `(time, trajectory)`. The core
//! writes these books on every generated turn (a cache is kept) and on every turn routed to the
//! replica that kept it (the cache is taken back), and reads the order only to evict. A
//! `BTreeMap` by trajectory beside a `BTreeSet` by `(time, trajectory)` cost two tree updates
//! each time. Here a cache is one node of a doubly linked list threaded through a slab, kept in
//! key order, and its owner holds the node's slot: taking it back unlinks one node, keeping one
//! appends it. The core's clock never goes back, so a new key is almost always the largest and
//! goes at the tail; one with a smaller key (a tie at the same time with a larger trajectory id
//! already there, or any key in another use) walks back from the tail to its place, so the order
//! is always the exact order of the keys.

/// A slot of [`LruList`]: stays valid until its entry is removed, then may be reused.
pub type Slot = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node<K, V> {
    key: K,
    value: V,
    prev: u32,
    next: u32,
    live: bool,
}

/// Entries ordered by their distinct keys, smallest first, each reachable by its slot.
#[derive(Debug, Clone)]
pub struct LruList<K, V> {
    nodes: Vec<Node<K, V>>,
    /// Slots of removed entries, reused last-freed first (its node is likely still in cache).
    free: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl<K, V> Default for LruList<K, V> {
    fn default() -> Self {
        LruList {
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl<K: Ord + Copy, V> LruList<K, V> {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries in the list.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Inserts an entry in key order and returns its slot. Keys must be distinct (as in a set);
    /// a key larger than every other is placed at once, another walks back from the tail.
    pub fn insert(&mut self, key: K, value: V) -> Slot {
        // The node to insert after: the last one whose key is smaller.
        let mut after = self.tail;
        while after != NIL && self.nodes[after as usize].key > key {
            after = self.nodes[after as usize].prev;
        }
        let before = match after {
            NIL => self.head,
            a => self.nodes[a as usize].next,
        };
        let node = Node {
            key,
            value,
            prev: after,
            next: before,
            live: true,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.nodes[s as usize] = node;
                s
            }
            None => {
                self.nodes.push(node);
                // A list of more than 4 billion idle caches on one replica is not a concern,
                // but a wrapped slot must never alias the end marker.
                assert!(self.nodes.len() <= NIL as usize, "LruList: too many slots");
                (self.nodes.len() - 1) as u32
            }
        };
        match after {
            NIL => self.head = slot,
            a => self.nodes[a as usize].next = slot,
        }
        match before {
            NIL => self.tail = slot,
            b => self.nodes[b as usize].prev = slot,
        }
        self.len += 1;
        slot
    }

    /// The key and value in `slot`, if it holds an entry.
    pub fn get(&self, slot: Slot) -> Option<(K, &V)> {
        self.nodes
            .get(slot as usize)
            .filter(|n| n.live)
            .map(|n| (n.key, &n.value))
    }

    /// Removes the entry in `slot` and returns its key and value (`None` if it holds none).
    pub fn remove(&mut self, slot: Slot) -> Option<(K, V)>
    where
        V: Copy,
    {
        let node = self.nodes.get_mut(slot as usize).filter(|n| n.live)?;
        node.live = false;
        let (prev, next, key, value) = (node.prev, node.next, node.key, node.value);
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
        self.free.push(slot);
        self.len -= 1;
        Some((key, value))
    }

    /// The entry with the smallest key, with its slot.
    pub fn first(&self) -> Option<(Slot, K, &V)> {
        let n = self.nodes.get(self.head as usize)?;
        Some((self.head, n.key, &n.value))
    }

    /// The entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (K, &V)> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            let n = self.nodes.get(at as usize)?;
            at = n.next;
            Some((n.key, &n.value))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use std::collections::BTreeMap;

    /// Runs random inserts and removals against a `BTreeMap`, with keys from `key`.
    fn against_a_tree(seed: u64, rounds: u64, mut key: impl FnMut(&mut SplitMix64, u64) -> u64) {
        let mut rng = SplitMix64::new(seed);
        let mut list: LruList<(u64, u64), u64> = LruList::new();
        let mut tree: BTreeMap<(u64, u64), u64> = BTreeMap::new();
        // The slots handed out, by key (what the core keeps in a trajectory's record).
        let mut slots: BTreeMap<(u64, u64), Slot> = BTreeMap::new();
        let mut next_id = 0u64;
        for round in 0..rounds {
            let action = rng.below(10);
            if action < 5 || tree.is_empty() {
                let time = key(&mut rng, round);
                // Mostly fresh ids, sometimes a small one (a tie can then go anywhere).
                let id = if rng.below(4) == 0 {
                    rng.below(64)
                } else {
                    next_id += 1;
                    1000 + next_id
                };
                if tree.contains_key(&(time, id)) {
                    continue;
                }
                let value = rng.next_u64();
                let slot = list.insert((time, id), value);
                tree.insert((time, id), value);
                slots.insert((time, id), slot);
            } else if action < 8 {
                // Take back a random entry by its slot (a sticky hit or a dropped cache).
                let k = rng.below(tree.len() as u64) as usize;
                let key = *tree.keys().nth(k).expect("k < len");
                let slot = slots.remove(&key).expect("slot kept");
                assert_eq!(list.remove(slot), tree.remove(&key).map(|v| (key, v)));
                assert_eq!(list.remove(slot), None, "a slot is removed once");
            } else {
                // Evict the first.
                let (slot, key, &value) = list.first().expect("not empty");
                assert_eq!(tree.pop_first(), Some((key, value)));
                assert_eq!(slots.remove(&key), Some(slot));
                assert_eq!(list.remove(slot), Some((key, value)));
            }
            assert_eq!(list.len(), tree.len());
            assert_eq!(
                list.first().map(|(_, k, &v)| (k, v)),
                tree.first_key_value().map(|(&k, &v)| (k, v))
            );
            for (&key, &slot) in &slots {
                assert_eq!(list.get(slot), Some((key, &tree[&key])));
            }
            if round % 97 == 0 {
                assert!(
                    list.iter()
                        .map(|(k, &v)| (k, v))
                        .eq(tree.iter().map(|(&k, &v)| (k, v)))
                );
            }
        }
        assert!(
            list.iter()
                .map(|(k, &v)| (k, v))
                .eq(tree.iter().map(|(&k, &v)| (k, v)))
        );
    }

    #[test]
    fn keeps_the_order_of_a_tree_when_time_only_grows_with_many_ties() {
        // The core's use: the clock never goes back and many caches are kept at the same time.
        let mut time = 0;
        against_a_tree(1, 20_000, |rng, _| {
            if rng.below(3) == 0 {
                time += rng.below(5);
            }
            time
        });
    }

    #[test]
    fn keeps_the_order_of_a_tree_for_keys_in_any_order() {
        against_a_tree(2, 20_000, |rng, _| rng.below(50));
    }

    #[test]
    fn keeps_the_order_of_a_tree_at_sizes_that_grow_and_shrink() {
        // Long runs of inserts, then of removals: slots are reused through every size.
        against_a_tree(3, 30_000, |rng, round| (round / 3000) * 10 + rng.below(3));
    }

    #[test]
    fn a_removed_slot_holds_nothing_until_it_is_reused() {
        let mut list: LruList<(u64, u64), u64> = LruList::new();
        let a = list.insert((5, 1), 10);
        let b = list.insert((5, 0), 20);
        assert_eq!(list.first(), Some((b, (5, 0), &20)));
        assert_eq!(list.remove(b), Some(((5, 0), 20)));
        assert_eq!(list.get(b), None);
        assert_eq!(list.remove(b), None);
        assert_eq!(list.first(), Some((a, (5, 1), &10)));
        let c = list.insert((7, 0), 30);
        assert_eq!(c, b, "the freed slot is reused");
        assert_eq!(list.get(c), Some(((7, 0), &30)));
        assert_eq!(list.get(99), None);
        assert!(list.iter().map(|(k, _)| k).eq([(5, 1), (7, 0)]));
    }
}
