//! The router: where the next piece of generation work of a trajectory goes.
//!
//! Selection is a pure function of a read-only view of the replicas (the rule dynamo's KV router
//! follows: choosing has no side effects; booking happens in one admission path, in
//! `scheduler.rs`). It is:
//! - **session-sticky**: a later turn goes back to the replica that still holds the trajectory's
//!   KV cache, if that replica is healthy, serves an admissible version and has room; only the new
//!   tokens are then prefilled;
//! - **prefill/decode-aware**: otherwise the whole context must be recomputed, and when a prefill
//!   pool exists and the input is long enough to be worth a KV transfer, it goes to a prefill
//!   replica first and to a decode replica after, unless no prefill replica has room: then a
//!   decode replica prefills it itself;
//! - **load-aware**: among admissible replicas, the least loaded (batch slots and KV memory in
//!   use, see [`load_key`]) that has room wins, among the [`CANDIDATES`] least loaded; ties go
//!   to the lowest id, so the choice is deterministic; a turn without its KV cache skips a
//!   replica past the caller's slot limit ([`RouteRequest::cold_slot_limit`]) and waits if every
//!   admissible one is past it;
//! - **health-aware**: lost, draining or weight-less replicas are not candidates, and every
//!   stage that timed out on a replica adds a penalty to its load.

use crate::placement::ServeRole;
use crate::protocol::{ReplicaId, Version};

/// How many of the least-loaded replicas the router considers. Looking further rarely finds
/// room the least-loaded ones lack (the load order already counts KV use), and bounding it keeps
/// one routing decision O(1) in the size of the fleet.
pub const CANDIDATES: usize = 32;

/// A replica as the router sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaView {
    /// Its role.
    pub role: ServeRole,
    /// Usable right now (healthy, has weights, not draining for an update).
    pub available: bool,
    /// The version it serves.
    pub version: Option<Version>,
    /// Stages running on it.
    pub in_flight: u32,
    /// Batch slots.
    pub max_seqs: u32,
    /// KV tokens reserved.
    pub kv_reserved: u64,
    /// KV tokens it can hold.
    pub kv_capacity: u64,
    /// KV tokens held for idle trajectories that may be evicted to make room.
    pub kv_evictable: u64,
    /// Stages that timed out on it.
    pub failures: u32,
    /// Versions it is behind the latest published one.
    pub behind: u64,
}

impl ReplicaView {
    /// Whether it can take a stage needing `kv_tokens` more KV tokens at version `floor` or newer
    /// (`evict`: counting idle KV it could evict).
    pub fn fits(&self, kv_tokens: u64, floor: Version, evict: bool) -> bool {
        let free = self.kv_capacity.saturating_sub(self.kv_reserved)
            + if evict { self.kv_evictable } else { 0 };
        self.available
            && self.version.is_some_and(|v| v >= floor)
            && self.in_flight < self.max_seqs
            && kv_tokens <= free
    }
}

/// The load order key: batch-slot use and KV use, each in parts per million, plus a penalty per
/// timed-out stage and per version the replica is behind (new work prefers fresh weights, so its
/// turns stay inside the staleness bound longer). Lower is less loaded.
pub fn load_key(view: &ReplicaView) -> u64 {
    let slots = view.in_flight as u64 * 1_000_000 / view.max_seqs.max(1) as u64;
    let kv = view.kv_reserved.saturating_mul(1_000_000) / view.kv_capacity.max(1);
    slots + kv + view.failures as u64 * 250_000 + view.behind.min(16) * 300_000
}

/// Places a re-filed entry walks before [`LoadOrder`] searches for the rest of its way.
const WALK: usize = 8;

/// Replicas in load order: `(load_key, id)` entries, ascending and distinct, in a sorted vector.
/// A replica re-filed after a change of load usually moves a few places; moving the entries
/// between its old and new place costs less than a tree's removal and insertion, and walking the
/// least-loaded ones is a walk along a slice.
#[derive(Debug, Clone, Default)]
pub struct LoadOrder {
    entries: Vec<(u64, ReplicaId)>,
    /// Per replica id, where its entry was last put. Entries passed by a move shift by one
    /// place, so a hint is often off by a little, and is only ever a guess checked against the
    /// entry it points at: finding the entry to re-file is then a look or two instead of a
    /// binary search with a mispredicted branch per level, on every re-filing.
    hints: Vec<u32>,
}

/// Two orders are equal when they hold the same entries (the hints are only a cache).
impl PartialEq for LoadOrder {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries
    }
}

impl Eq for LoadOrder {}

impl LoadOrder {
    /// An empty order.
    pub fn new() -> Self {
        Self::default()
    }

    /// The entries, least loaded first.
    pub fn iter(&self) -> std::slice::Iter<'_, (u64, ReplicaId)> {
        self.entries.iter()
    }

    /// Files an entry; `false` if it was already there.
    pub fn insert(&mut self, entry: (u64, ReplicaId)) -> bool {
        match self.entries.binary_search(&entry) {
            Ok(_) => false,
            Err(i) => {
                self.entries.insert(i, entry);
                self.hint(entry.1, i);
                true
            }
        }
    }

    /// Notes that replica `id`'s entry was put at `place`.
    #[inline]
    fn hint(&mut self, id: ReplicaId, place: usize) {
        let index = id.0 as usize;
        if index >= self.hints.len() {
            // Ids are dense (replica indices), so the table stays the size of the fleet.
            self.hints.resize(index + 1, 0);
        }
        self.hints[index] = place as u32;
    }

    /// Where `entry` is: at its replica's hint or a place or two away from it, or else found
    /// by a binary search.
    #[inline]
    fn find(&self, entry: &(u64, ReplicaId)) -> Option<usize> {
        if let Some(&hint) = self.hints.get(entry.1.0 as usize) {
            let hint = hint as usize;
            for place in [
                hint,
                hint.wrapping_sub(1),
                hint + 1,
                hint.wrapping_sub(2),
                hint + 2,
            ] {
                if self.entries.get(place) == Some(entry) {
                    return Some(place);
                }
            }
        }
        self.entries.binary_search(entry).ok()
    }

    /// Replaces `old` (when filed) by `new` (when given): the same set as removing one and
    /// inserting the other, by moving only the entries between their two places.
    pub fn refile(&mut self, old: Option<(u64, ReplicaId)>, new: Option<(u64, ReplicaId)>) {
        let from = old.and_then(|o| self.find(&o));
        match (from, new) {
            (Some(i), Some(new)) => self.shift(i, new),
            (Some(i), None) => {
                self.entries.remove(i);
            }
            (None, Some(new)) => {
                self.insert(new);
            }
            (None, None) => {}
        }
    }

    /// Puts `new` in place of the entry at `i`, walking it to its sorted place one neighbour at
    /// a time: a re-filed replica usually moves a few places, and moving the entries it passes
    /// as it goes costs less than searching for its new place. In a large fleet of evenly
    /// loaded replicas a move can pass hundreds, so past [`WALK`] places the rest of the way
    /// is found by a search and the stretch passed moved in one copy.
    fn shift(&mut self, i: usize, new: (u64, ReplicaId)) {
        let mut j = i;
        let len = self.entries.len();
        if new > self.entries[i] {
            while j + 1 < len && j - i < WALK && self.entries[j + 1] < new {
                self.entries[j] = self.entries[j + 1];
                j += 1;
            }
            if j + 1 < len && self.entries[j + 1] < new {
                // First place at or past `new`: the entries before it move down one.
                let end = j + 1 + self.entries[j + 1..].partition_point(|e| *e < new);
                self.entries.copy_within(j + 1..end, j);
                j = end - 1;
            }
            if j + 1 < len && self.entries[j + 1] == new {
                // Already filed: only the old one goes (its slot is now `j`).
                self.entries.remove(j);
                return;
            }
        } else {
            while j > 0 && i - j < WALK && self.entries[j - 1] > new {
                self.entries[j] = self.entries[j - 1];
                j -= 1;
            }
            if j > 0 && self.entries[j - 1] > new {
                // First place past `new`: from there the entries move up one.
                let start = self.entries[..j].partition_point(|e| *e <= new);
                self.entries.copy_within(start..j, start + 1);
                j = start;
            }
            if j > 0 && self.entries[j - 1] == new {
                self.entries.remove(j);
                return;
            }
        }
        self.entries[j] = new;
        self.hint(new.1, j);
    }
}

impl FromIterator<(u64, ReplicaId)> for LoadOrder {
    fn from_iter<I: IntoIterator<Item = (u64, ReplicaId)>>(iter: I) -> Self {
        let mut entries: Vec<(u64, ReplicaId)> = iter.into_iter().collect();
        entries.sort_unstable();
        entries.dedup();
        let mut order = LoadOrder {
            entries,
            hints: Vec::new(),
        };
        for place in 0..order.entries.len() {
            order.hint(order.entries[place].1, place);
        }
        order
    }
}

/// A request for generation work.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRequest {
    /// Tokens already in the trajectory's context.
    pub context: u64,
    /// New tokens to add this turn (prompt or observation).
    pub input: u64,
    /// Most tokens the action may take.
    pub max_new: u64,
    /// The replica holding the trajectory's KV cache of `context` tokens, if any.
    pub sticky: Option<ReplicaId>,
    /// Oldest admissible version.
    pub floor: Version,
    /// Inputs at least this long go to a prefill replica when one exists.
    pub pd_min_prefill_tokens: u64,
    /// Whether sticky sessions are enabled.
    pub sticky_sessions: bool,
    /// Whether prefill replicas exist.
    pub disaggregated: bool,
    /// Most batch slots in use, in parts per million of its own, a replica may have to take
    /// this turn when it goes there without its KV cache ([`u64::MAX`]: no limit).
    pub cold_slot_limit: u64,
}

/// Where the work goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Generate on the replica that holds the KV cache; prefill only the new tokens.
    Sticky(ReplicaId),
    /// Prefill the whole context on this prefill replica (decode is routed when it is done).
    Prefill(ReplicaId),
    /// Prefill the whole context locally and generate on this replica (`evict`: make room by
    /// evicting idle KV caches first).
    Generate(ReplicaId, bool),
}

/// Where the router looks replicas up: any `Fn(ReplicaId) -> Option<ReplicaView>`, or a type
/// of the caller's over its own replica table.
pub trait ReplicaLookup {
    /// The replica `id` as the router sees it.
    fn view(&self, id: ReplicaId) -> Option<ReplicaView>;
}

impl<F: Fn(ReplicaId) -> Option<ReplicaView>> ReplicaLookup for F {
    #[inline]
    fn view(&self, id: ReplicaId) -> Option<ReplicaView> {
        self(id)
    }
}

/// The replica sets, in load order, that the router walks.
///
/// Generic over the lookup (not a `&dyn Fn`): a routing decision looks up to [`CANDIDATES`]
/// replicas up, and a lookup the compiler can inline builds only the parts of a
/// [`ReplicaView`] that [`ReplicaView::fits`] reads, instead of a whole view through an
/// indirect call per candidate.
pub struct RouterView<'a, L: ReplicaLookup + ?Sized> {
    /// Looks a replica up by id.
    pub lookup: &'a L,
    /// Available prefill replicas by `(load_key, id)`.
    pub prefill: &'a LoadOrder,
    /// Available decode/generate replicas by `(load_key, id)`.
    pub decode: &'a LoadOrder,
}

impl<L: ReplicaLookup + ?Sized> RouterView<'_, L> {
    #[inline]
    fn view(&self, id: ReplicaId) -> Option<ReplicaView> {
        self.lookup.view(id)
    }

    /// The least-loaded replica of `set` that fits (no eviction), then, failing that, the
    /// least-loaded one that fits after evicting idle KV caches.
    pub fn least_loaded(
        &self,
        set: &LoadOrder,
        kv_tokens: u64,
        floor: Version,
        allow_evict: bool,
    ) -> Option<(ReplicaId, bool)> {
        self.least_loaded_within(set, kv_tokens, floor, allow_evict, u64::MAX)
    }

    /// [`RouterView::least_loaded`] among the replicas holding fewer than `slot_limit` parts
    /// per million of their batch slots ([`u64::MAX`]: no limit).
    pub fn least_loaded_within(
        &self,
        set: &LoadOrder,
        kv_tokens: u64,
        floor: Version,
        allow_evict: bool,
        slot_limit: u64,
    ) -> Option<(ReplicaId, bool)> {
        // One walk answers both questions: the first fit without eviction wins outright, and
        // the first fit with eviction seen on the way is the answer when there is none. (When
        // the fleet is full every routing attempt fails the first question, and looking every
        // candidate up a second time doubled the cost of the commonest outcome.)
        let mut evict_fit = None;
        for &(_, id) in set.iter().take(CANDIDATES) {
            let Some(view) = self.view(id) else {
                continue;
            };
            if slot_limit != u64::MAX
                && view.in_flight as u64 * 1_000_000 >= slot_limit * view.max_seqs.max(1) as u64
            {
                continue;
            }
            if view.fits(kv_tokens, floor, false) {
                return Some((id, false));
            }
            if allow_evict && evict_fit.is_none() && view.fits(kv_tokens, floor, true) {
                evict_fit = Some(id);
            }
        }
        evict_fit.map(|id| (id, true))
    }

    /// Routes one turn's generation (pure; see the module docs).
    pub fn route(&self, req: &RouteRequest, allow_evict: bool) -> Option<Route> {
        let full = req.context + req.input + req.max_new;
        if req.sticky_sessions
            && let Some(id) = req.sticky
            && let Some(view) = self.view(id).as_ref()
            && matches!(view.role, ServeRole::Decode | ServeRole::Generate)
            && view.fits(req.input + req.max_new, req.floor, false)
        {
            return Some(Route::Sticky(id));
        }
        if req.disaggregated
            && req.context + req.input >= req.pd_min_prefill_tokens
            && let Some((id, _)) =
                self.least_loaded(self.prefill, req.context + req.input, req.floor, false)
        {
            return Some(Route::Prefill(id));
        }
        // A decode replica prefills the rest itself: short inputs, and long ones when no
        // prefill replica has room (its batch slots or KV memory taken, by a burst of
        // whole-context prefills after a weight update or by too few prefill replicas for the
        // job) rather than the turn waiting for one. The RollArt-like workload on a third of its
        // GPUs (one prefill replica) waited 40-60 s a turn at the core that way, and ran 18%
        // slower per step.
        self.least_loaded_within(
            self.decode,
            full,
            req.floor,
            allow_evict,
            req.cold_slot_limit,
        )
        .map(|(id, evict)| Route::Generate(id, evict))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(role: ServeRole, in_flight: u32, kv_reserved: u64) -> ReplicaView {
        ReplicaView {
            role,
            available: true,
            version: Some(3),
            in_flight,
            max_seqs: 8,
            kv_reserved,
            kv_capacity: 1000,
            kv_evictable: 0,
            failures: 0,
            behind: 0,
        }
    }

    type LoadSet = LoadOrder;

    fn sets(replicas: &[ReplicaView]) -> (LoadSet, LoadSet) {
        let mut prefill = LoadOrder::new();
        let mut decode = LoadOrder::new();
        for (i, r) in replicas.iter().enumerate() {
            let entry = (load_key(r), ReplicaId(i as u64));
            match r.role {
                ServeRole::Prefill => prefill.insert(entry),
                _ => decode.insert(entry),
            };
        }
        (prefill, decode)
    }

    fn request(sticky: Option<ReplicaId>) -> RouteRequest {
        RouteRequest {
            context: 100,
            input: 50,
            max_new: 100,
            sticky,
            floor: 2,
            pd_min_prefill_tokens: 1_000_000,
            sticky_sessions: true,
            cold_slot_limit: u64::MAX,
            disaggregated: false,
        }
    }

    /// Re-files random replicas to random keys, checking the order against a tree.
    fn check_refiling(replicas: usize, distinct_keys: u64, rounds: usize) {
        use std::collections::BTreeSet;
        let mut rng = crate::rng::SplitMix64::new(11);
        let mut order = LoadOrder::new();
        let mut tree = BTreeSet::new();
        let mut keys: Vec<Option<u64>> = vec![None; replicas];
        for _ in 0..rounds {
            let id = rng.below(replicas as u64) as usize;
            let new = match rng.below(8) {
                0 => None,
                // Few distinct keys, so that ties broken by id are common.
                _ => Some(rng.below(distinct_keys) * 1000),
            };
            let old = keys[id];
            let entry = |k: Option<u64>| k.map(|k| (k, ReplicaId(id as u64)));
            order.refile(entry(old), entry(new));
            if let Some(o) = entry(old) {
                tree.remove(&o);
            }
            if let Some(n) = entry(new) {
                tree.insert(n);
            }
            keys[id] = new;
            assert!(order.iter().eq(tree.iter()));
        }
        let collected: LoadOrder = tree.iter().rev().copied().collect();
        assert_eq!(collected, order);
    }

    #[test]
    fn refiling_keeps_the_same_entries_as_a_tree_would() {
        check_refiling(40, 12, 20_000);
    }

    #[test]
    fn long_moves_in_a_large_fleet_keep_the_same_entries_as_a_tree_would() {
        // Hundreds of replicas and many keys: most moves pass more than `WALK` entries.
        check_refiling(400, 200, 5_000);
    }

    #[test]
    fn a_later_turn_goes_back_to_the_replica_holding_its_kv_cache() {
        let replicas = vec![
            replica(ServeRole::Decode, 0, 0),
            replica(ServeRole::Decode, 5, 500),
        ];
        let (prefill, decode) = sets(&replicas);
        let view = RouterView {
            lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
            prefill: &prefill,
            decode: &decode,
        };
        assert_eq!(
            view.route(&request(Some(ReplicaId(1))), false),
            Some(Route::Sticky(ReplicaId(1)))
        );
    }

    #[test]
    fn a_new_trajectory_goes_to_the_least_loaded_replica() {
        let replicas = vec![
            replica(ServeRole::Decode, 4, 100),
            replica(ServeRole::Decode, 1, 100),
        ];
        let (prefill, decode) = sets(&replicas);
        let view = RouterView {
            lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
            prefill: &prefill,
            decode: &decode,
        };
        assert_eq!(
            view.route(&request(None), false),
            Some(Route::Generate(ReplicaId(1), false))
        );
    }

    #[test]
    fn a_turn_without_its_cache_waits_rather_than_go_past_the_slot_limit_but_a_sticky_one_goes() {
        // Only replica 1 serves the admissible version, and it holds 4 of its 8 slots.
        let mut replicas = vec![
            replica(ServeRole::Decode, 0, 0),
            replica(ServeRole::Decode, 4, 100),
        ];
        replicas[0].version = Some(1);
        let (prefill, decode) = sets(&replicas);
        let view = RouterView {
            lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
            prefill: &prefill,
            decode: &decode,
        };
        let within = |limit: u64, sticky: Option<ReplicaId>| RouteRequest {
            cold_slot_limit: limit,
            ..request(sticky)
        };
        // Half its slots is the limit: a cold turn finds no replica under it.
        assert_eq!(view.route(&within(500_000, None), false), None);
        assert_eq!(
            view.route(&within(500_001, None), false),
            Some(Route::Generate(ReplicaId(1), false))
        );
        assert_eq!(
            view.route(&within(500_000, Some(ReplicaId(1))), false),
            Some(Route::Sticky(ReplicaId(1)))
        );
    }

    #[test]
    fn an_unhealthy_or_too_old_replica_is_never_chosen() {
        let mut replicas = vec![
            replica(ServeRole::Decode, 0, 0),
            replica(ServeRole::Decode, 7, 0),
        ];
        replicas[0].available = false;
        let (prefill, decode) = sets(&replicas);
        let view = RouterView {
            lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
            prefill: &prefill,
            decode: &decode,
        };
        assert_eq!(
            view.route(&request(Some(ReplicaId(0))), false),
            Some(Route::Generate(ReplicaId(1), false))
        );
        replicas[1].version = Some(1);
        let view = RouterView {
            lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
            prefill: &prefill,
            decode: &decode,
        };
        assert_eq!(view.route(&request(None), false), None);
    }

    #[test]
    fn a_long_input_is_prefilled_on_the_prefill_pool_when_disaggregated() {
        let replicas = vec![
            replica(ServeRole::Decode, 0, 0),
            replica(ServeRole::Prefill, 0, 0),
        ];
        let (prefill, decode) = sets(&replicas);
        let view = RouterView {
            lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
            prefill: &prefill,
            decode: &decode,
        };
        let req = RouteRequest {
            disaggregated: true,
            pd_min_prefill_tokens: 100,
            ..request(None)
        };
        assert_eq!(view.route(&req, false), Some(Route::Prefill(ReplicaId(1))));
    }

    #[test]
    fn a_long_input_is_prefilled_by_a_decode_replica_when_no_prefill_replica_has_room() {
        let disaggregated = RouteRequest {
            disaggregated: true,
            pd_min_prefill_tokens: 100,
            ..request(None)
        };
        // Every batch slot of the prefill replica taken, then its KV memory.
        for (in_flight, kv_reserved) in [(8, 0), (0, 1000)] {
            let replicas = vec![
                replica(ServeRole::Decode, 0, 0),
                replica(ServeRole::Prefill, in_flight, kv_reserved),
            ];
            let (prefill, decode) = sets(&replicas);
            let view = RouterView {
                lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
                prefill: &prefill,
                decode: &decode,
            };
            assert_eq!(
                view.route(&disaggregated, false),
                Some(Route::Generate(ReplicaId(0), false))
            );
        }
    }

    #[test]
    fn a_full_replica_is_chosen_only_if_evicting_idle_caches_makes_room() {
        let mut replicas = vec![replica(ServeRole::Decode, 0, 900)];
        let (prefill, decode) = sets(&replicas);
        let view = RouterView {
            lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
            prefill: &prefill,
            decode: &decode,
        };
        assert_eq!(view.route(&request(None), true), None);
        replicas[0].kv_evictable = 500;
        let view = RouterView {
            lookup: &|id: ReplicaId| replicas.get(id.0 as usize).cloned(),
            prefill: &prefill,
            decode: &decode,
        };
        assert_eq!(
            view.route(&request(None), true),
            Some(Route::Generate(ReplicaId(0), true))
        );
    }
}
