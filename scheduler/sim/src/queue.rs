//! The simulator's future events: a calendar queue keyed on virtual time, earliest first, ties
//! in the order they were pushed.
//!
//! A discrete-event simulation pops its earliest event and pushes events at or after the
//! current time, most of them within seconds of it. A binary heap sifts every push and pop
//! through a dozen levels, each one a mispredicted comparison; that was a large share of the
//! simulator's cycles. A calendar queue files an event by its time into a ring of buckets of
//! [`BUCKET_NS`] each (an append), finds the next busy bucket from a bitmap, and sorts only the
//! few events of the bucket being served. Events beyond the ring's horizon wait in a binary
//! heap until the ring reaches them.
//!
//! Keys are unique, the time in the high 64 bits over a sequence number (the push order) and
//! the event's slot, and every bucket is sorted by the whole key: the order is exactly the one
//! the binary heap had, by time, then by push order. The events themselves wait in a slot list;
//! the buckets move 16-byte keys only.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rollfleet_core::Time;

/// A key: time in the high half, then the order it was pushed in (a sequence number, unique,
/// in the high bits of the low half) over its slot in [`EventQueue::slots`] (the low
/// `slot_bits` bits, so the slot never decides). Comparing keys compares `(time, push order)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key(u128);

impl Key {
    fn new(at: Time, order: u64) -> Key {
        Key(((at.0 as u128) << 64) | order as u128)
    }

    fn at(self) -> Time {
        Time((self.0 >> 64) as u64)
    }

    fn order(self) -> u64 {
        self.0 as u64
    }

    /// The calendar bucket of its time.
    fn bucket(self) -> u64 {
        self.at().0 / BUCKET_NS
    }
}

/// Nanoseconds a bucket spans: 2^23 (8.4 ms), a few events each in the simulator's runs,
/// which average about 2 to 4 virtual ms between events. A power of two, so filing divides
/// by a shift.
const BUCKET_NS: u64 = 1 << 23;
/// Buckets in the ring: a horizon of 17 virtual seconds, past most environment steps.
const RING: usize = 2048;

/// Future events, earliest first (ties in the order they were pushed).
///
/// Where a key is: `front` holds from `head` on, sorted, the keys of bucket `cur` and any pushed
/// into an earlier bucket since; `ring[b % RING]` the keys of bucket `b` for `cur < b < cur +
/// RING`; `far` the others, all in buckets after `cur`. So every key of `front` comes before
/// every other, and a bucket of the ring before every later one.
pub(crate) struct EventQueue<E> {
    front: Vec<Key>,
    /// The keys of `front` before this one were popped. Popping moves it on rather than
    /// removing the first key, and keeping `front` in ascending order puts a key pushed into the
    /// bucket being served (usually one of the latest) near its end: inserting it moves few keys.
    head: usize,
    ring: Vec<Vec<Key>>,
    /// Bit `i % 64` of word `i / 64` is set when `ring[i]` is not empty.
    occupied: Vec<u64>,
    far: BinaryHeap<Reverse<Key>>,
    /// The bucket `front` serves.
    cur: u64,
    len: usize,
    slots: Vec<Option<E>>,
    free: Vec<usize>,
    seq: u64,
    /// Low bits of [`Key::order`] holding the slot: widened when the slots outgrow them.
    slot_bits: u32,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue::with_slot_bits(24)
    }
}

impl<E> EventQueue<E> {
    pub(crate) fn with_slot_bits(slot_bits: u32) -> Self {
        EventQueue {
            front: Vec::new(),
            head: 0,
            ring: (0..RING).map(|_| Vec::new()).collect(),
            occupied: vec![0; RING / 64],
            far: BinaryHeap::new(),
            cur: 0,
            len: 0,
            slots: Vec::new(),
            free: Vec::new(),
            seq: 0,
            slot_bits,
        }
    }

    pub(crate) fn push(&mut self, at: Time, event: E) {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some(event);
                slot
            }
            None => {
                self.slots.push(Some(event));
                self.slots.len() - 1
            }
        };
        if (slot as u64) >> self.slot_bits != 0 {
            self.repack(self.slot_bits + 8);
        }
        if self.seq + 1 >= 1 << (64 - self.slot_bits) {
            self.repack(self.slot_bits);
        }
        self.seq += 1;
        self.file(Key::new(at, (self.seq << self.slot_bits) | slot as u64));
        self.len += 1;
    }

    fn file(&mut self, key: Key) {
        let b = key.bucket();
        if b <= self.cur {
            // The bucket being served (or, after the clock stopped short of it, an earlier
            // one): in order among the keys of `front` not yet popped.
            let at = self.head + self.front[self.head..].partition_point(|k| *k < key);
            self.front.insert(at, key);
        } else if b - self.cur < RING as u64 {
            let i = (b % RING as u64) as usize;
            self.ring[i].push(key);
            self.occupied[i / 64] |= 1 << (i % 64);
        } else {
            self.far.push(Reverse(key));
        }
    }

    /// Re-encodes the queued keys with `slot_bits` bits of slot, their sequence numbers
    /// renumbered from 1 in the same order: neither the slots nor the sequence numbers overflow
    /// their bits (as long as fewer than 2^(64 - `slot_bits`) events are pending), and the order
    /// of events does not change. Never needed in practice: 2^24 events pending at once, or
    /// 2^40 pushed. Every key ends up in `front`, which is sorted, so the invariant holds.
    fn repack(&mut self, slot_bits: u32) {
        let mask = (1u64 << self.slot_bits) - 1;
        let mut keys: Vec<Key> = self.front.drain(self.head..).collect();
        self.front.clear();
        self.head = 0;
        for bucket in &mut self.ring {
            keys.append(bucket);
        }
        self.occupied.fill(0);
        keys.extend(self.far.drain().map(|Reverse(k)| k));
        keys.sort_unstable();
        self.slot_bits = slot_bits;
        self.seq = 0;
        for key in &mut keys {
            self.seq += 1;
            *key = Key::new(key.at(), (self.seq << slot_bits) | (key.order() & mask));
        }
        // `front` serves up to its latest key's bucket, so that a later push into an earlier
        // one is sorted in among them.
        if let Some(latest) = keys.last() {
            self.cur = self.cur.max(latest.bucket());
        }
        self.front = keys;
    }

    /// The first busy bucket of the ring after `cur`, if any.
    fn next_in_ring(&self) -> Option<u64> {
        let start = ((self.cur + 1) % RING as u64) as usize;
        let words = self.occupied.len();
        // The word holding `start`, its bits from `start` on; then the next words, around the
        // ring; then that first word's bits before `start`.
        let first = self.occupied[start / 64] & (u64::MAX << (start % 64));
        let found = if first != 0 {
            Some((start / 64) * 64 + first.trailing_zeros() as usize)
        } else {
            (1..=words).find_map(|step| {
                let w = (start / 64 + step) % words;
                let bits = self.occupied[w];
                (bits != 0).then(|| w * 64 + bits.trailing_zeros() as usize)
            })
        }?;
        // Buckets `cur + 1 ..= cur + RING - 1` map to distinct slots.
        let offset = (found + RING - start) % RING;
        Some(self.cur + 1 + offset as u64)
    }

    /// Moves on to the next busy bucket once `front` is empty: its keys, from the ring and
    /// from `far`, become `front`.
    fn advance(&mut self) {
        if self.head < self.front.len() {
            return;
        }
        self.front.clear();
        self.head = 0;
        let ring = self.next_in_ring();
        let far = self.far.peek().map(|Reverse(k)| k.bucket());
        let next = match (ring, far) {
            (Some(r), Some(f)) => r.min(f),
            (Some(r), None) => r,
            (None, Some(f)) => f,
            (None, None) => return,
        };
        if ring == Some(next) {
            let i = (next % RING as u64) as usize;
            std::mem::swap(&mut self.front, &mut self.ring[i]);
            self.occupied[i / 64] &= !(1 << (i % 64));
        }
        while let Some(Reverse(k)) = self.far.peek()
            && k.bucket() == next
        {
            self.front.push(*k);
            self.far.pop();
        }
        self.cur = next;
        if self.front.len() > 1 {
            self.front.sort_unstable();
        }
    }

    /// When the earliest event happens (without reading the event itself).
    pub(crate) fn next_time(&mut self) -> Option<Time> {
        self.advance();
        self.front.get(self.head).map(|k| k.at())
    }

    fn slot(&self, key: Key) -> usize {
        (key.order() & ((1u64 << self.slot_bits) - 1)) as usize
    }

    pub(crate) fn peek(&mut self) -> Option<(Time, &E)> {
        self.advance();
        let key = *self.front.get(self.head)?;
        let slot = self.slot(key);
        Some((key.at(), self.slots[slot].as_ref()?))
    }

    pub(crate) fn pop(&mut self) -> Option<(Time, E)> {
        self.advance();
        let key = *self.front.get(self.head)?;
        self.head += 1;
        self.len -= 1;
        let slot = self.slot(key);
        let event = self.slots[slot].take()?;
        self.free.push(slot);
        Some((key.at(), event))
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use rollfleet_core::rng::SplitMix64;

    use super::*;

    /// Pushes and pops a random mix on a queue and on a `BTreeSet` of `(time, push number)`,
    /// checking every pop and every peek against the set's first entry. `time` draws the time
    /// of a push from the random source and the time of the last pop.
    fn check(mut q: EventQueue<u64>, rounds: u64, time: impl Fn(&mut SplitMix64, u64) -> u64) {
        let mut reference: BTreeSet<(u64, u64)> = BTreeSet::new();
        let mut pushed = 0u64;
        let mut now = 0u64;
        let mut rng = SplitMix64::new(5);
        for _ in 0..rounds {
            for _ in 0..rng.below(5) {
                let at = time(&mut rng, now);
                q.push(Time(at), pushed);
                reference.insert((at, pushed));
                pushed += 1;
            }
            assert_eq!(q.len(), reference.len());
            assert_eq!(q.next_time(), reference.first().map(|&(at, _)| Time(at)));
            assert_eq!(
                q.peek().map(|(at, &n)| (at.0, n)),
                reference.first().copied()
            );
            for _ in 0..rng.below(5) {
                let popped = q.pop().map(|(at, n)| (at.0, n));
                assert_eq!(popped, reference.pop_first());
                if let Some((at, _)) = popped {
                    now = at;
                }
            }
        }
        while let Some((at, n)) = q.pop() {
            assert_eq!(Some((at.0, n)), reference.pop_first());
        }
        assert!(reference.is_empty());
        assert_eq!(q.len(), 0);
    }

    /// Times at or after the last pop, often equal to it or to each other.
    fn near(rng: &mut SplitMix64, now: u64) -> u64 {
        now + rng.below(20)
    }

    #[test]
    fn events_come_out_by_time_then_push_order() {
        check(EventQueue::default(), 6_000, near);
    }

    #[test]
    fn events_at_the_same_time_come_out_in_push_order() {
        check(EventQueue::default(), 3_000, |rng, now| now + rng.below(2));
    }

    #[test]
    fn nanosecond_times_spread_over_hours_come_out_in_order() {
        check(EventQueue::default(), 20_000, |rng, now| {
            now + match rng.below(4) {
                0 => 0,
                1 => rng.below(1_000_000),
                2 => rng.below(10_000_000_000),
                _ => rng.below(10_000_000_000_000),
            }
        });
    }

    #[test]
    fn events_on_either_side_of_bucket_and_ring_edges_come_out_in_order() {
        let horizon = BUCKET_NS * RING as u64;
        check(EventQueue::default(), 6_000, |rng, now| {
            let edge = match rng.below(3) {
                0 => (now / BUCKET_NS + 1) * BUCKET_NS,
                1 => (now / BUCKET_NS + RING as u64) * BUCKET_NS,
                _ => now + horizon,
            };
            (edge + rng.below(3)).saturating_sub(rng.below(3)).max(now)
        });
    }

    #[test]
    fn far_future_times_wait_behind_near_ones() {
        check(EventQueue::default(), 6_000, |rng, now| {
            match rng.below(8) {
                0 => u64::MAX - rng.below(3),
                1 => now.saturating_add(1 << 62),
                _ => now.saturating_add(rng.below(1_000)),
            }
        });
    }

    #[test]
    fn events_pushed_before_the_last_one_popped_still_come_out_in_order() {
        // Not something the simulator does, but the queue stays correct.
        check(EventQueue::default(), 6_000, |rng, now| {
            (now + rng.below(100)).saturating_sub(rng.below(200))
        });
    }

    #[test]
    fn the_order_survives_a_queue_growing_to_many_pending_events() {
        // Pushes outnumber pops: tens of thousands pending at the end.
        let mut q = EventQueue::default();
        let mut reference = BTreeSet::new();
        let mut rng = SplitMix64::new(9);
        for n in 0..40_000u64 {
            let at = rng.below(1 << 40);
            q.push(Time(at), n);
            reference.insert((at, n));
            if n % 7 == 0 {
                assert_eq!(q.pop().map(|(at, n)| (at.0, n)), reference.pop_first());
            }
        }
        while let Some((at, n)) = q.pop() {
            assert_eq!(Some((at.0, n)), reference.pop_first());
        }
        assert!(reference.is_empty());
    }

    #[test]
    fn the_order_survives_slots_outgrowing_their_bits() {
        check(EventQueue::with_slot_bits(2), 6_000, near);
    }

    #[test]
    fn the_order_survives_sequence_numbers_running_out() {
        // 2^12 sequence numbers: renumbered about twice in 9,000 pushes.
        check(EventQueue::with_slot_bits(52), 6_000, near);
    }
}
