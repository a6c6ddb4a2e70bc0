//! Re-planning: when to plan again, and how to move from one placement to the next without
//! stopping rollout.
//!
//! - [`drift`]: the pools whose measured (or probed) share of peak has moved from the one the plan
//!   was made with by more than a relative margin;
//! - [`Settling`]: when a drift is acted on: after forgetting the drifted pool's estimates that
//!   may predate the change, and once they are measured again;
//! - [`after_loss`]: the placement that remains when a pool loses GPUs (replicas on lost GPUs are
//!   gone, the trainer shrinks to whole surviving nodes), which is what runs until the new plan
//!   is in place, and the new plan for the smaller inventory;
//! - [`migration`]: the waves that turn one placement into another, each changing at most a given
//!   number of serving replicas, adding before removing, so that serving capacity never drops by
//!   more than one wave's worth and rollout never stops as a whole.
//!
//! Pure functions and plain state. The simulator applies the waves through the core's
//! `ReplicaAdded` and `RetireReplica` inputs (`rollfleet sim --lose`, `--grow` and
//! `--replan-on-drift`), and so does the scheduler server while a job runs.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::predict::{Candidate, Group, Problem, Role};
use crate::profile::ProfileStore;
use crate::roofline::{Efficiency, WorkKind};
use crate::search;

/// A share of peak that moved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Drift {
    /// The pool.
    pub pool: String,
    /// The work.
    pub kind: WorkKind,
    /// Share of peak the plan assumed.
    pub planned: f64,
    /// Share of peak in effect now.
    pub now: f64,
}

/// Pools whose share of peak (prefill: FLOP/s, decode: bandwidth) in `profiles` differs from the
/// one `planned` was built with by more than `margin` (relative).
pub fn drift(planned: &Problem, profiles: &ProfileStore, margin: f64) -> Vec<Drift> {
    let mut out = Vec::new();
    let model = Efficiency::default();
    for pool in &planned.gpu_pools {
        for kind in [WorkKind::Prefill, WorkKind::Decode] {
            let (was, peak_flops, peak_bw) = match kind {
                WorkKind::Prefill => (
                    pool.rates.flops / pool.peak_flops.max(1e-30),
                    pool.peak_flops,
                    pool.peak_bandwidth,
                ),
                _ => (
                    pool.rates.bandwidth / pool.peak_bandwidth.max(1e-30),
                    pool.peak_flops,
                    pool.peak_bandwidth,
                ),
            };
            let now = profiles
                .effective(
                    kind,
                    &pool.name,
                    &pool.rates.gpu,
                    peak_flops,
                    peak_bw,
                    &model,
                )
                .share;
            if (now - was).abs() > margin * was.abs() {
                out.push(Drift {
                    pool: pool.name.clone(),
                    kind,
                    planned: was,
                    now,
                });
            }
        }
    }
    out
}

/// Policy versions a drifted pool waits for fresh samples of every kind it had measured before
/// the planner is asked anyway (a kind it no longer runs may never send one).
pub const SETTLE_VERSIONS: u64 = 4;

/// What a drift check says to do ([`Settling::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// Nothing drifted, and no pool is waiting.
    Quiet,
    /// Pools drifted for the first time. The estimates of their kinds of work that did not
    /// drift may still describe the hardware as it was: the caller forgets them
    /// ([`ProfileStore::restart`]), and then plans again at once when `wait` is false, or waits
    /// for fresh samples of those it trusted.
    Restart {
        /// Per pool, the kinds of work whose samples to forget.
        forget: Vec<(String, Vec<WorkKind>)>,
        /// Whether to wait for fresh samples before planning.
        wait: bool,
    },
    /// Drifted pools are still waiting for fresh samples.
    Waiting,
    /// Plan again if the profiles still drift: the drifted pools have fresh samples (or waited
    /// [`SETTLE_VERSIONS`]), or a pool that drifted before drifted again.
    Ready,
}

/// Makes a re-plan on drift wait for samples taken after the change it shows. A pool's kinds of
/// work are measured at different rates: when its decode share drifts, the estimate of its
/// prefill share (the median of a window of samples that can span many steps) can still read
/// the hardware as it was, and a plan made with half of the change moves replicas for the wrong
/// reason (measured: `docs/planner.md`, re-planning on drift). So at a pool's first drift the
/// estimates of its other kinds are forgotten, and the re-plan waits until those it had trusted
/// are measured again. A pool that drifts again later re-plans at once: its estimates were
/// measured afresh since.
#[derive(Debug, Clone, Default)]
pub struct Settling {
    /// Per pool waiting: the version it drifted at, and the kinds of work to measure again.
    pending: BTreeMap<String, (u64, Vec<WorkKind>)>,
    /// Pools that drifted before.
    drifted: std::collections::BTreeSet<String>,
    /// The version at which the drift being settled was seen ([`Settling::take_seen`]).
    seen: Option<u64>,
}

impl Settling {
    /// The version at which the drift now planned for was first seen (`None` when it was not
    /// settled: a pool that drifted before drifted again), and forgets it.
    pub fn take_seen(&mut self) -> Option<u64> {
        self.seen.take()
    }

    /// At version `version`, with the `drifts` the current `profiles` show: what to do.
    pub fn check(&mut self, drifts: &[Drift], profiles: &ProfileStore, version: u64) -> Settle {
        // While pools wait, a drift of another pool waits with them, and is planned for (on the
        // samples it has) together with theirs.
        if !self.pending.is_empty() {
            self.pending.retain(|pool, (since, kinds)| {
                let fresh = kinds.iter().all(|&k| profiles.measured_ready(k, pool));
                !fresh && version < since.saturating_add(SETTLE_VERSIONS)
            });
            return if self.pending.is_empty() {
                Settle::Ready
            } else {
                Settle::Waiting
            };
        }
        if drifts.is_empty() {
            return Settle::Quiet;
        }
        let mut forget = Vec::new();
        for d in drifts {
            if self.drifted.contains(&d.pool) || forget.iter().any(|(p, _)| p == &d.pool) {
                continue;
            }
            let others: Vec<WorkKind> = [WorkKind::Prefill, WorkKind::Decode]
                .into_iter()
                .filter(|&k| !drifts.iter().any(|o| o.pool == d.pool && o.kind == k))
                .collect();
            let trusted: Vec<WorkKind> = others
                .iter()
                .copied()
                .filter(|&k| profiles.measured_ready(k, &d.pool))
                .collect();
            if !trusted.is_empty() {
                self.pending.insert(d.pool.clone(), (version, trusted));
            }
            forget.push((d.pool.clone(), others));
        }
        if forget.is_empty() {
            return Settle::Ready;
        }
        for (pool, _) in &forget {
            self.drifted.insert(pool.clone());
        }
        self.seen.get_or_insert(version);
        Settle::Restart {
            forget,
            wait: !self.pending.is_empty(),
        }
    }
}

/// What remains of `c` when pool `pool` of `p` loses `lost` GPUs: the problem with the smaller
/// pool, and the placement that survives (replicas dropped from the end of the pool's groups,
/// the trainer cut to whole surviving nodes, or moved off if none survive; `None` if nothing can
/// train).
pub fn after_loss(
    p: &Problem,
    c: &Candidate,
    pool: usize,
    lost: u32,
) -> (Problem, Option<Candidate>) {
    let mut smaller = p.clone();
    let Some(gp) = smaller.gpu_pools.get_mut(pool) else {
        return (smaller, Some(c.clone()));
    };
    gp.count = gp.count.saturating_sub(lost);
    let left = gp.count;
    let per_node = gp.per_node.max(1);
    let mut survivor = c.clone();
    // GPUs in use on that pool: the trainer's, then each group's.
    let mut budget = left;
    if survivor.trainer_pool == pool {
        let keep = survivor.trainer_gpus.min(budget);
        let keep = if keep >= per_node {
            keep / per_node * per_node
        } else {
            keep
        };
        if keep < crate::predict::min_train_gpus(&smaller, &smaller.gpu_pools[pool]) {
            return (smaller, None);
        }
        survivor.trainer_gpus = keep;
        budget -= keep;
    }
    for g in survivor.groups.iter_mut().filter(|g| g.pool == pool) {
        let fit = budget / g.tp.max(1);
        g.replicas = g.replicas.min(fit);
        budget -= g.replicas * g.tp;
    }
    survivor.groups.retain(|g| g.replicas > 0);
    (smaller, Some(survivor))
}

/// One wave of a migration: replicas to start and to stop, per (pool, role, degree).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Wave {
    /// Replicas started.
    pub start: Vec<Group>,
    /// Replicas stopped (drained first by the core: no new work, finish what runs).
    pub stop: Vec<Group>,
    /// The trainer's GPUs after the wave.
    pub trainer_gpus: u32,
}

fn counts(c: &Candidate) -> BTreeMap<(usize, Role, u32), u32> {
    let mut m = BTreeMap::new();
    for g in &c.groups {
        *m.entry((g.pool, g.role, g.tp)).or_insert(0) += g.replicas;
    }
    m
}

fn gpus_in_use(
    p: &Problem,
    c: &BTreeMap<(usize, Role, u32), u32>,
    trainer: (usize, u32),
) -> Vec<u32> {
    let mut used = vec![0u32; p.gpu_pools.len()];
    for (&(pool, _, tp), &n) in c {
        if let Some(u) = used.get_mut(pool) {
            *u += n * tp;
        }
    }
    if let Some(u) = used.get_mut(trainer.0) {
        *u += trainer.1;
    }
    used
}

/// The waves from `from` to `to` (both placements on `p`, the same trainer pool), changing at
/// most `per_wave` serving replicas each: every wave first starts what fits on free GPUs, then
/// stops replicas that are not wanted, at most `per_wave` of them, so the serving replicas
/// running never fall more than `per_wave` below the smaller of the two placements.
pub fn migration(p: &Problem, from: &Candidate, to: &Candidate, per_wave: u32) -> Vec<Wave> {
    let per_wave = per_wave.max(1);
    let mut now = counts(from);
    let want = counts(to);
    let mut trainer = (from.trainer_pool, from.trainer_gpus);
    let mut waves = Vec::new();
    for _ in 0..100_000 {
        if now == want && trainer == (to.trainer_pool, to.trainer_gpus) {
            break;
        }
        let mut wave = Wave {
            start: Vec::new(),
            stop: Vec::new(),
            trainer_gpus: trainer.1,
        };
        let mut changed = 0;
        // Start what is missing, where GPUs are free.
        let mut used = gpus_in_use(p, &now, trainer);
        for (&(pool, role, tp), &n) in &want {
            let have = now.get(&(pool, role, tp)).copied().unwrap_or(0);
            let free = p.gpu_pools.get(pool).map_or(0, |g| g.count)
                - used[pool].min(p.gpu_pools.get(pool).map_or(0, |g| g.count));
            let add = n
                .saturating_sub(have)
                .min(free / tp.max(1))
                .min(per_wave - changed);
            if add > 0 {
                *now.entry((pool, role, tp)).or_insert(0) += add;
                used[pool] += add * tp;
                wave.start.push(Group {
                    pool,
                    role,
                    tp,
                    replicas: add,
                });
                changed += add;
            }
        }
        // Stop what is not wanted.
        let mut stop_budget = per_wave;
        let keys: Vec<(usize, Role, u32)> = now.keys().copied().collect();
        for key in keys {
            let have = now.get(&key).copied().unwrap_or(0);
            let n = want.get(&key).copied().unwrap_or(0);
            let cut = have.saturating_sub(n).min(stop_budget);
            if cut > 0 {
                if let Some(h) = now.get_mut(&key) {
                    *h -= cut;
                }
                stop_budget -= cut;
                wave.stop.push(Group {
                    pool: key.0,
                    role: key.1,
                    tp: key.2,
                    replicas: cut,
                });
            }
        }
        now.retain(|_, n| *n > 0);
        // The trainer moves to its new size once its GPUs are free.
        let target = (to.trainer_pool, to.trainer_gpus);
        if trainer != target {
            let used = gpus_in_use(p, &now, (target.0, 0));
            let count = p.gpu_pools.get(target.0).map_or(0, |g| g.count);
            let free = count.saturating_sub(used.get(target.0).copied().unwrap_or(0));
            if target.1 <= free || target.1 < trainer.1 {
                trainer = target;
            }
        }
        wave.trainer_gpus = trainer.1;
        if wave.start.is_empty()
            && wave.stop.is_empty()
            && wave.trainer_gpus
                == waves
                    .last()
                    .map_or(from.trainer_gpus, |w: &Wave| w.trainer_gpus)
        {
            break;
        }
        waves.push(wave);
    }
    waves
}

/// The new plan `found` for a running job on `p`, if it trains on the pool the running placement
/// trains on (a resize is carried out by [`migration`]'s waves); otherwise the best plan that
/// keeps the running trainer as it is. A trainer does not move between pools mid-run: its
/// weights and optimizer state would have to move with it.
pub fn on_trainer_pool(
    p: &Problem,
    running: &Candidate,
    found: search::Found,
) -> Option<search::Found> {
    if found.candidate.trainer_pool == running.trainer_pool {
        return Some(found);
    }
    search::choose(
        &p.clone()
            .with_trainer(running.trainer_pool, running.trainer_gpus),
    )
}

/// Plans again after pool `pool` loses `lost` GPUs: the surviving placement, the new plan on the
/// smaller inventory, and the waves between them. When the full prediction gives the new plan
/// no gain over running on the survivors, the survivors are the plan and nothing moves.
pub fn replan_after_loss(
    p: &Problem,
    c: &Candidate,
    pool: usize,
    lost: u32,
    per_wave: u32,
) -> Option<(Problem, Candidate, search::Found, Vec<Wave>)> {
    let (smaller, survivor) = after_loss(p, c, pool, lost);
    let survivor = survivor?;
    let found = on_trainer_pool(&smaller, &survivor, search::choose(&smaller)?)?;
    let full = |c: &Candidate| crate::predict::predict(&smaller, c).map(|pr| pr.step_s);
    if let (Some(new), Some(old)) = (full(&found.candidate), full(&survivor))
        && old <= new
    {
        let stay = search::Found {
            step_s: crate::predict::step_time(&smaller, &survivor)?,
            candidate: survivor.clone(),
            nodes: found.nodes,
        };
        return Some((smaller, survivor, stay, Vec::new()));
    }
    let waves = migration(&smaller, &survivor, &found.candidate, per_wave);
    Some((smaller, survivor, found, waves))
}
