//! The predictor's prefill queues: what a prefill costs on replicas that also decode, how long
//! prefills wait (M/G/1, the refills weighed by the square of their cost), the refills a weight
//! update causes and the burst they arrive in, and a step's prefills by where they run.

use crate::workload::{TaskLoad, normal_cdf};

use super::Problem;
use super::model::DECODE_COMPUTE_SHARE_MAX;

/// The FLOP/s a replica of `flops` has for prefill while its decoding sequences use
/// `decode_flops_per_s` of it: the engine runs both at once, decode first.
pub(super) fn compute_left_by_decoding(flops: f64, decode_flops_per_s: f64) -> f64 {
    let share = (decode_flops_per_s / flops.max(1e-30)).clamp(0.0, DECODE_COMPUTE_SHARE_MAX);
    flops * (1.0 - share)
}

/// FLOPs of prefilling a whole context of `c` tokens from nothing.
pub(super) fn context_prefill_flops(p: &Problem, c: f64) -> f64 {
    p.prefill_flops(c, 0.0)
}

/// What a set of replicas' prefill queues do to a prefill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PrefillQueue {
    /// Seconds of all their compute a step's prefill takes (the capacity term).
    pub(super) load_s: f64,
    /// Mean seconds per FLOP of prefill on the replica a prefill runs on.
    pub(super) s_per_flop: f64,
    /// Mean wait behind the prefills ahead, seconds.
    pub(super) wait_s: f64,
}

/// How long prefills wait on a set of replicas, given a step's prefills (`jobs`) and, per kind of
/// replica, `(replicas, FLOP/s each, share of the prefills it gets)`. Prefills are served one
/// batch at a time, so a kind's wait is M/G/1's: `rho / (1 - rho) x E[S^2] / (2 E[S])`, `S` the
/// time one prefill takes there; long prefills dominate it.
pub(super) fn prefill_queue(kinds: &[(f64, f64, f64)], jobs: &[Prefills], t: f64) -> PrefillQueue {
    // Folded from +0.0: an empty `sum` of floats is -0.0, which tables print as "-0.0".
    let flops = jobs.iter().fold(0.0, |acc, j| acc + j.count * j.flops);
    let flops_sq = jobs.iter().fold(0.0, |acc, j| acc + j.count * j.flops_sq);
    let capacity: f64 = kinds.iter().map(|&(r, f, _)| r * f).sum();
    let (mut s_per_flop, mut wait_s) = (0.0, 0.0);
    for &(replicas, replica_flops, share) in kinds.iter().filter(|k| k.0 > 0.0 && k.1 > 0.0) {
        if share <= 0.0 {
            continue;
        }
        let rho = (flops * share / (replicas * replica_flops) / t).clamp(0.0, 0.999);
        let residual = if flops > 0.0 {
            flops_sq / (2.0 * flops) / replica_flops
        } else {
            0.0
        };
        s_per_flop += share / replica_flops;
        wait_s += share * rho / (1.0 - rho) * residual;
    }
    PrefillQueue {
        load_s: flops / capacity.max(1e-30),
        s_per_flop,
        wait_s,
    }
}

/// A step's prefills of one kind: how many, their mean FLOPs and the mean of their squares (what
/// a queue's wait depends on).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Prefills {
    pub(super) count: f64,
    pub(super) flops: f64,
    pub(super) flops_sq: f64,
}

impl Prefills {
    /// `count` prefills of `flops` each.
    pub(super) fn alike(count: f64, flops: f64) -> Prefills {
        Prefills {
            count,
            flops,
            flops_sq: flops * flops,
        }
    }
}

/// Whether a prefill of `tokens` (context plus new) without a KV cache runs on a prefill
/// replica: when there are any and it is long enough to be worth a KV transfer.
pub(super) fn remote_prefill(p: &Problem, disaggregated: bool, tokens: f64) -> bool {
    disaggregated && tokens >= p.pd_min_prefill_tokens
}

/// The whole-context prefills a weight update causes a trajectory of `task`: per trajectory
/// that lives through an update, how many (the share of its updates that fall before its last
/// turn: the one after it needs none) and their FLOPs' mean and mean square, `prefill_flops`
/// giving the FLOPs of prefilling a whole context of so many tokens.
///
/// The update falls in a uniformly random turn of its life; if the trajectory goes on, its next
/// turn prefills the whole context so far, `prompt + j (action + observation)` after `j` turns,
/// which costs a causal attention quadratic in it: the long contexts late in a long trajectory
/// dominate the square, so the mean context alone says little about how long others wait
/// behind them. The turns are taken as uniform over their mean plus or minus `sqrt(3)` standard
/// deviations, rounded (exact for the uniform turns jobs give in practice).
pub(super) fn refill_moments(task: &TaskLoad, prefill_flops: impl Fn(f64) -> f64) -> Prefills {
    let spread = (3.0 * task.turns_var).sqrt();
    let (lo, hi) = (
        (task.turns - spread).max(1.0),
        (task.turns + spread).min(task.max_turns.max(1.0)),
    );
    // P(turns > j) for turns drawn uniform on [lo, hi] and rounded, as the simulator draws them
    // (a point mass when they are fixed).
    let goes_on = |j: f64| {
        if hi - lo < 1e-9 {
            if j + 0.5 < lo { 1.0 } else { 0.0 }
        } else {
            ((hi - j - 0.5) / (hi - lo)).clamp(0.0, 1.0)
        }
    };
    let per_turn = task.action + task.observation;
    let (mut weight, mut flops, mut flops_sq) = (0.0, 0.0, 0.0);
    let last = task.max_turns.max(1.0) as u32;
    for j in 1..last {
        let w = goes_on(f64::from(j));
        if w <= 0.0 {
            break;
        }
        let context = (task.prompt + f64::from(j) * per_turn).min(task.context_limit);
        let f = prefill_flops(context);
        weight += w;
        flops += w * f;
        flops_sq += w * f * f;
    }
    if weight <= 0.0 {
        return Prefills::alike(0.0, 0.0);
    }
    Prefills {
        count: (weight / task.turns.max(1.0)).min(1.0),
        flops: flops / weight,
        flops_sq: flops_sq / weight,
    }
}

/// What a burst of refills costs the prefills meeting it, seconds of wait ([`refill_backlog`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(super) struct Backlog {
    /// A refill's: it arrives within the burst.
    pub(super) refill_s: f64,
    /// Any other prefill's, arriving at any moment of the step.
    pub(super) other_s: f64,
    /// How long the replicas serve the burst once a step (none without a backlog).
    pub(super) busy_s: f64,
}

impl Backlog {
    /// A later turn's wait for the burst, on average over a step of `t`, of a sequence that
    /// comes back every `turn_s` seconds and lives `life_s`, when the update it lives through
    /// refills it. The burst's refills are served one after another over `busy_s`; a sequence
    /// refilled at a moment `x` of it comes back for its later turns, on top of its cache and
    /// on the same replica, while the rest of the burst still waits there, each meeting about
    /// what a refill meets, for as long as it lives: over `e = min(busy_s, life_s)`, with `x`
    /// uniform, `(e - turn_s)^2 / (2 e turn_s)` turns. A sequence that lives through the step
    /// takes `t / turn_s` turns in it, and one that lives less is refilled in that share of the
    /// steps, so either way `refill_s (e - turn_s)+^2 / (2 e t)` a turn. Inside the emulated
    /// engine, 7-10% of the cached prefills of the example jobs meet a refill ahead of them and
    /// wait about what a refill does; the others hardly wait at all.
    pub(super) fn cached_s(&self, turn_s: f64, life_s: f64, t: f64) -> f64 {
        let within = self.busy_s.min(life_s);
        if within <= turn_s || t <= 0.0 {
            return 0.0;
        }
        self.refill_s * (within - turn_s).powi(2) / (2.0 * within * t)
    }
}

/// The refills' bursts on each kind of replica ([`refill_backlogs`]), with the share of the
/// refills each kind takes.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct Backlogs(Vec<(f64, Backlog)>);

impl Backlogs {
    /// A refill's wait ([`Backlog::refill_s`]), over where refills land.
    pub(super) fn refill_s(&self) -> f64 {
        self.0.iter().map(|(share, b)| share * b.refill_s).sum()
    }

    /// Any other prefill's ([`Backlog::other_s`]).
    pub(super) fn other_s(&self) -> f64 {
        self.0.iter().map(|(share, b)| share * b.other_s).sum()
    }

    /// A later turn's after its refill ([`Backlog::cached_s`]), on the kind it was refilled on.
    pub(super) fn cached_s(&self, turn_s: f64, life_s: f64, t: f64) -> f64 {
        self.0
            .iter()
            .map(|(share, b)| share * b.cached_s(turn_s, life_s, t))
            .sum()
    }
}

/// The bursts a step's refills (`refill_flops` of them, caught in `turns`) make on each kind of
/// replica, `(replicas, FLOP/s each, share of the prefills it gets)` as for [`prefill_queue`]:
/// a replica of a kind takes its share of them over its replicas, at its own speed. The router
/// spreads turns without a cache by room, not speed, so a slow kind's replicas take about as many
/// refills as a fast kind's and serve each for longer: on the RollArt-like job's uniform
/// placement (5 H800 and 40 H20 replicas, generation on both) the model, pooling the two kinds'
/// compute, had a replica's refills take 19.5 s a step where each H20 replica's take 34 s in the
/// simulator, and their refills wait 5.3 s against 11.7 s simulated (seed 0).
pub(super) fn refill_backlogs(
    refill_flops: f64,
    kinds: &[(f64, f64, f64)],
    turns: &[CaughtTurn],
    t: f64,
) -> Backlogs {
    Backlogs(
        kinds
            .iter()
            .filter(|&&(replicas, flops, share)| replicas > 0.0 && flops > 0.0 && share > 0.0)
            .map(|&(replicas, flops, share)| {
                let work_s = refill_flops * share / (replicas * flops);
                (share, refill_backlog(work_s, turns, t))
            })
            .collect(),
    )
}

/// The turn that the sequences of one task were caught in when their replica took new weights:
/// its share of the burst's refill work, and the turn's mean and variance, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct CaughtTurn {
    pub(super) share: f64,
    pub(super) mean_s: f64,
    pub(super) var_s: f64,
}

impl CaughtTurn {
    /// The share of the sequences caught in this turn that are back by `s` seconds after the
    /// update, and how many a second come back then (per sequence). A sequence caught at a
    /// uniform moment of a renewal process of turns `X` comes back after the rest of its turn,
    /// whose law is the equilibrium one, `P(R <= s) = E[min(X, s)] / E[X]` with density
    /// `P(X > s) / E[X]` (a turn caught is length-biased, and the rest of one is uniform on
    /// it). Turns are taken as log-normal with the turn's mean and variance (fixed when it
    /// has none).
    fn back_by(&self, s: f64) -> (f64, f64) {
        let m = self.mean_s.max(1e-12);
        if s <= 0.0 {
            return (0.0, 1.0 / m);
        }
        if self.var_s <= 1e-12 * m * m {
            return if s < m { (s / m, 1.0 / m) } else { (1.0, 0.0) };
        }
        let sigma_sq = (1.0 + self.var_s / (m * m)).ln();
        let sigma = sigma_sq.sqrt();
        let mu = m.ln() - sigma_sq / 2.0;
        let z = (s.ln() - mu) / sigma;
        let longer = 1.0 - normal_cdf(z);
        let up_to_s = s * longer + m * normal_cdf(z - sigma);
        ((up_to_s / m).min(1.0), longer / m)
    }
}

/// `work_s` seconds of prefill (the refills of a step's weight updates, in seconds of the
/// replicas' compute) come back as the sequences' turns end ([`CaughtTurn::back_by`]), over
/// the turns they were caught in, and are served first come first served. A fluid queue: the
/// work back by `s`, `A(s)`, is concave (fewer are back each second), so a backlog `A(s) - s`
/// builds while more than a second of work arrives a second and lasts until it is served, at
/// `busy_s`. A refill meets the backlog of its moment, `int (A - s) dA / work_s`; any other
/// prefill, arriving at any moment of the step `t`, `int (A - s) ds / t`. Turns of one fixed
/// length `D` give `(work_s - D) / 2` and `(work_s - D) work_s / (2 t)`; turns that vary bring
/// most sequences back early, and a burst that the mean rest of a turn would have spread
/// without a backlog can still leave one.
pub(super) fn refill_backlog(work_s: f64, turns: &[CaughtTurn], t: f64) -> Backlog {
    const POINTS: usize = 64;
    let total: f64 = turns.iter().map(|c| c.share).sum();
    if work_s <= 0.0 || total <= 0.0 {
        return Backlog::default();
    }
    let arrived = |s: f64| -> (f64, f64) {
        turns.iter().fold((0.0, 0.0), |(a, rate), c| {
            let (back, per_s) = c.back_by(s);
            let weight = work_s * c.share / total;
            (a + weight * back, rate + weight * per_s)
        })
    };
    if arrived(0.0).1 <= 1.0 {
        return Backlog::default();
    }
    // `A(s) - s` is concave and positive just after 0: its end is the one root past 0, within
    // `work_s` (no more than all of it ever arrives).
    let (mut lo, mut hi) = (0.0, work_s);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if arrived(mid).0 > mid {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let busy_s = 0.5 * (lo + hi);
    if busy_s <= 0.0 {
        return Backlog::default();
    }
    // Midpoint sums, the refills' against the work arrived within each interval (its rate
    // jumps where a fixed turn ends).
    let h = busy_s / POINTS as f64;
    let (mut met_by_refills, mut backlog_s, mut before) = (0.0, 0.0, 0.0);
    for i in 0..POINTS {
        let s = (i as f64 + 0.5) * h;
        let backlog = (arrived(s).0 - s).max(0.0);
        let by_end = arrived((i + 1) as f64 * h).0;
        met_by_refills += backlog * (by_end - before);
        backlog_s += backlog * h;
        before = by_end;
    }
    Backlog {
        refill_s: met_by_refills / work_s,
        other_s: backlog_s / t.max(1e-12),
        busy_s,
    }
}

/// The prefills of a step, by where they run: `(local, remote)`.
///
/// Each later turn's observation is prefilled where its KV cache is (locally, on top of the
/// cached context). Each first turn's prompt is prefilled on the prefill replicas when there are
/// any, locally otherwise. And every trajectory alive when its replica takes new weights (once
/// a step) loses its KV cache, so its next turn prefills its whole context again
/// (`refills[k]`, task `k`'s [`refill_moments`]), routed as a turn without a cache is: to the
/// prefill replicas when there are any. `alive_s[k]` is how long a trajectory of task `k` is
/// alive, so by Little's law `B / T x share x alive` are.
pub(super) fn step_prefills(
    p: &Problem,
    disaggregated: bool,
    refills: &[Prefills],
    alive_s: &[f64],
    t: f64,
) -> (Vec<Prefills>, Vec<Prefills>) {
    let w = &p.workload;
    let (mut local, mut remote) = (Vec::new(), Vec::new());
    for ((task, alive), moments) in w.tasks.iter().zip(alive_s).zip(refills) {
        let n = w.batch * task.share;
        let obs = task.observation;
        local.push(Prefills::alike(
            n * (task.turns - 1.0).max(0.0),
            p.flops_per_token * obs + p.attention_flops * obs * task.decode_context,
        ));
        let first = Prefills::alike(n, context_prefill_flops(p, task.prompt));
        if remote_prefill(p, disaggregated, task.prompt) {
            remote.push(first);
        } else {
            local.push(first);
        }
        let refill = Prefills {
            count: n / t * alive * moments.count,
            ..*moments
        };
        if remote_prefill(p, disaggregated, task.decode_context) {
            remote.push(refill);
        } else {
            local.push(refill);
        }
    }
    (local, remote)
}
