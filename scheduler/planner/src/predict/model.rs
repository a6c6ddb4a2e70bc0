//! The predictor's queueing model, piece by piece: the step's work, the routed decode replicas
//! and the per-token time they serve at, the spread of action lengths, the regeneration a
//! staleness bound causes, and the closed-loop step of a job's trajectories. The prefill queues
//! and the refills' bursts are in [`super::prefill`].

use std::cell::RefCell;

use crate::workload::{TaskLoad, Workload, normal_cdf, normal_pdf, normal_quantile};

use rollfleet_spec::WeightReads;

use super::Problem;

/// Per-step work of the job, independent of the placement.
#[derive(Debug, Clone, Copy)]
pub(super) struct StepWork {
    pub(super) first_prefill_flops: f64,
    pub(super) later_prefill_flops: f64,
    pub(super) decode_tokens: f64,
    pub(super) decode_context: f64,
    pub(super) train_flops: f64,
    pub(super) env_cpu_s: f64,
}

pub(super) fn step_work(p: &Problem) -> StepWork {
    let w = &p.workload;
    let model = |tokens: f64, cached: f64| p.prefill_flops(tokens, cached);
    let mut s = StepWork {
        first_prefill_flops: 0.0,
        later_prefill_flops: 0.0,
        decode_tokens: 0.0,
        decode_context: 0.0,
        train_flops: 0.0,
        env_cpu_s: 0.0,
    };
    let mut weighted_context = 0.0;
    for t in &w.tasks {
        let n = w.batch * t.share;
        s.first_prefill_flops += n * model(t.prompt, 0.0);
        s.later_prefill_flops += n * (t.turns - 1.0) * model(t.observation, t.decode_context);
        let tokens = n * t.turns * t.action;
        s.decode_tokens += tokens;
        weighted_context += tokens * t.decode_context;
        s.env_cpu_s += n * (t.turns + 1.0) * t.env_step_s * t.env_cpus;
        if t.local_reward {
            s.env_cpu_s += n * t.reward_s;
        }
    }
    s.decode_context = weighted_context / s.decode_tokens.max(1e-12);
    s.train_flops = w
        .tasks
        .iter()
        .map(|t| w.batch * t.share * trajectory_train_flops(p, t))
        .sum();
    s
}

/// The FLOPs of training on one trajectory of `task`: its tokens, and causal attention over its
/// whole length `L`, forward and backward: three times `L (L + 1) / 2` tokens of context, whose
/// mean needs `E[L^2] = mean^2 + variance` (actions vary per turn, and the turns in number).
pub(super) fn trajectory_train_flops(p: &Problem, task: &TaskLoad) -> f64 {
    let len =
        task.prompt + task.turns * task.action + (task.turns - 1.0).max(0.0) * task.observation;
    let var =
        task.turns * task.action_var + task.turns_var * (task.action + task.observation).powi(2);
    p.train_flops_per_token * len + 3.0 * p.attention_flops * (len * len + var + len) / 2.0
}

/// One kind of decode-capable replica, as the water-filling sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct DecodeKind {
    pub(super) replicas: f64,
    pub(super) bandwidth: f64,
    pub(super) flops: f64,
    pub(super) cap: f64,
    /// Trajectories the core's router puts on one replica of this kind per unit of load (see
    /// [`router_weight`]).
    pub(super) weight: f64,
}

/// How many trajectories the core's router puts on a replica, relative to the others. It
/// sends a trajectory that has no KV cache anywhere to the replica with the least load key,
/// `running / max_seqs + KV reserved / KV capacity` (`rollfleet_core::router::load_key`), and
/// later turns back to the same replica: so it fills replicas in proportion to their room, not
/// their speed, and `n` trajectories load a replica by `n (1 / max_seqs + reserved / kv)`.
/// A replica's share is the inverse of that (counting every held trajectory as running: the
/// batch-slot half weighs little beside the KV half on small replicas, where it matters).
pub(super) fn router_weight(max_seqs: f64, reserved_context: f64, kv_tokens: f64) -> f64 {
    if kv_tokens <= 0.0 || max_seqs <= 0.0 {
        return 0.0;
    }
    1.0 / (1.0 / max_seqs + reserved_context.max(1.0) / kv_tokens)
}

/// One iteration of a decode replica at a batch of `b`: `max((W(b) + b kv) / bandwidth, b flops /
/// FLOP/s)`, the simulator's roofline, where `W(b)` is what the batch's tokens route to (all
/// active weights of a dense model).
pub(super) fn iteration_time(
    k: &DecodeKind,
    b: f64,
    weights: &WeightReads,
    kv_per_seq: f64,
    flops_per_seq: f64,
) -> f64 {
    let by_bandwidth = (weights.bytes(b.max(1.0)) + b * kv_per_seq) / k.bandwidth.max(1e-30);
    let by_compute = b * flops_per_seq / k.flops.max(1e-30);
    by_bandwidth.max(by_compute)
}

/// [`iteration_time`] of one kind of replica, remembered batch by batch: the router's level
/// search evaluates every kind's occupancy many times over the same batches.
pub(super) struct IterationTimes<'a> {
    kind: &'a DecodeKind,
    weights: &'a WeightReads,
    kv_per_seq: f64,
    flops_per_seq: f64,
    known: RefCell<Vec<f64>>,
}

impl<'a> IterationTimes<'a> {
    pub(super) fn new(
        kind: &'a DecodeKind,
        weights: &'a WeightReads,
        kv_per_seq: f64,
        flops_per_seq: f64,
    ) -> Self {
        IterationTimes {
            kind,
            weights,
            kv_per_seq,
            flops_per_seq,
            known: RefCell::new(Vec::new()),
        }
    }

    /// The iteration time at a whole batch of `b >= 1`.
    fn at(&self, b: usize) -> f64 {
        let mut known = self.known.borrow_mut();
        while known.len() < b {
            let next = known.len() as f64 + 1.0;
            known.push(self.between(next));
        }
        known[b - 1]
    }

    /// The iteration time at any batch, whole or not.
    fn between(&self, b: f64) -> f64 {
        iteration_time(
            self.kind,
            b,
            self.weights,
            self.kv_per_seq,
            self.flops_per_seq,
        )
    }
}

/// What one decode replica holding `alive` trajectories runs at, on average over its states.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Occupancy {
    /// Mean sequences decoding.
    pub(super) batch: f64,
    /// Tokens it makes a second.
    pub(super) tokens_per_s: f64,
    /// Mean seconds a token takes, over the tokens it makes (`batch / tokens_per_s`).
    pub(super) tau: f64,
}

impl Occupancy {
    /// A mean batch and the tokens a second it makes; a token's time is their ratio, or a lone
    /// sequence's when it makes none.
    fn of(batch: f64, tokens_per_s: f64, times: &IterationTimes) -> Occupancy {
        Occupancy {
            batch,
            tokens_per_s,
            tau: if tokens_per_s > 0.0 {
                batch / tokens_per_s
            } else {
                times.at(1)
            },
        }
    }
}

/// The decode batch of one replica as the random variable it is. Each of the `alive`
/// trajectories the router keeps on the replica alternates between decoding and everything
/// else (`other` seconds per token it decodes), and the replica shares its iterations among
/// the `b` decoding, `b / t(b)` tokens a second for the iteration time `t(b)` of
/// `times`. That is a closed network of an infinite server and a
/// processor-sharing station whose speed depends on its population, so its batch has the product
/// form `P(b) ~ C(alive, b) prod_{k <= b} t(k) / other` (BCMP; insensitive to the lengths'
/// distributions), and a token takes `E[b] / throughput` on average (Little's law at the
/// station; the arrival theorem makes the sequence's own KV read and routed experts part of
/// it). Where `t(b)` grows with the batch the batch spreads out: a mixture of experts reads
/// about `experts per token` more experts per sequence at small batches, so its busy states
/// are slow and last, and a token sees a larger batch than the mean-field fixed point `b =
/// alive tau / (tau + other)` gives (holdout-moe-agent at `maxStaleness` 2: 0.94 ms a token
/// against 0.77 ms at that fixed point). It holds `alive` fixed; how a replica's holding
/// sweeps over a step, which spreads the batch further, is [`held_occupancy`]'s. A fractional
/// `alive` takes `C(alive, b)` through its falling product.
pub(super) fn replica_occupancy(alive: f64, other: f64, times: &IterationTimes) -> Occupancy {
    if alive <= 0.0 {
        return Occupancy {
            batch: 0.0,
            tokens_per_s: 0.0,
            tau: times.at(1),
        };
    }
    if other <= 1e-50 * times.at(1) {
        // Always decoding (or as good as: other work a vanishing share of one iteration, whose
        // product-form terms would overflow): the whole of it is the batch.
        let tau = times.between(alive).max(1e-30);
        return Occupancy {
            batch: alive,
            tokens_per_s: alive / tau,
            tau,
        };
    }
    // P(b) up to a constant, term by term from P(0) = 1, rescaled before it overflows. The
    // ratio of successive terms falls with `b`, so past the mode the terms only fall; once they
    // are 1e-17 of the largest the rest cannot move a sum.
    const RESCALE: f64 = 1e-200;
    let (mut p, mut peak, mut total, mut batch, mut tokens) = (1.0, 1.0_f64, 1.0, 0.0, 0.0);
    for b in 1..=alive.ceil() as usize {
        let room = alive - b as f64 + 1.0;
        let t = times.at(b);
        let ratio = room / b as f64 * t / other;
        if room <= 0.0 || ratio <= 0.0 {
            break;
        }
        p *= ratio;
        if p > 1.0 / RESCALE {
            p *= RESCALE;
            peak *= RESCALE;
            total *= RESCALE;
            batch *= RESCALE;
            tokens *= RESCALE;
        }
        total += p;
        batch += p * b as f64;
        tokens += p * b as f64 / t;
        peak = peak.max(p);
        if ratio < 1.0 && p < 1e-17 * peak {
            break;
        }
    }
    Occupancy::of(batch / total, tokens / total, times)
}

/// Where the router puts the decoding sequences, and what each kind of replica then runs at.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Served {
    /// Per kind: trajectories alive on one replica, its decoding batch, its per-token time.
    pub(super) kinds: Vec<(f64, f64, f64)>,
    /// Per kind: its share of the tokens decoded (and so of the trajectories, which all decode
    /// alike wherever they are).
    pub(super) token_share: Vec<f64>,
    /// Token-weighted mean per-token time (`decoding sequences / tokens per second`).
    pub(super) tau: f64,
}

/// How the trajectories a replica holds vary over a step, around the mean the router's split
/// gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holding {
    /// Always the mean: a fleet whose replicas keep their sequences (no weight updates).
    Steady,
    /// From none to twice the mean, evenly over a step. The rolling update drops a replica's KV
    /// cache once a step, so the trajectories it held take their next turns elsewhere (the
    /// least loaded replicas, which are the ones just updated, emptied the same way) and it
    /// fills again from none until its own next update. Were a replica's per-token time flat in
    /// its batch, the sweep would change nothing; but a mixture of experts reads more experts
    /// for a larger batch, and every model more KV, so a token spends more of its time in the
    /// crowded part of the sweep, at a slower iteration than the mean batch's. The simulator's
    /// replicas hold trajectories with a spread of 0.4 to 0.9 times their mean over the
    /// example jobs (a uniform sweep: 0.58).
    RefilledEachUpdate,
}

/// Points of the midpoint rule over [`Holding::RefilledEachUpdate`]'s sweep.
const SWEEP_POINTS: usize = 16;

/// [`replica_occupancy`] over the holdings a replica passes through ([`Holding`]) around a mean
/// of `alive` (at most `cap`, the most it can hold: a replica near full sweeps less, as it
/// cannot hold more than `cap`): its mean batch and tokens a second, and a token's mean time
/// (their ratio).
pub(super) fn held_occupancy(
    alive: f64,
    cap: f64,
    other: f64,
    times: &IterationTimes,
    holding: Holding,
) -> Occupancy {
    let alive = alive.min(cap);
    match holding {
        Holding::Steady => replica_occupancy(alive, other, times),
        Holding::RefilledEachUpdate => {
            let reach = alive.min(cap - alive).max(0.0);
            let (mut batch, mut tokens) = (0.0, 0.0);
            for i in 0..SWEEP_POINTS {
                let x = (2.0 * (i as f64 + 0.5) / SWEEP_POINTS as f64) - 1.0;
                let o = replica_occupancy(alive + reach * x, other, times);
                batch += o.batch;
                tokens += o.tokens_per_s;
            }
            let points = SWEEP_POINTS as f64;
            Occupancy::of(batch / points, tokens / points, times)
        }
    }
}

/// The router's split of a decode load over the replicas (in proportion to [`router_weight`],
/// every kind capped by its batch), at the load level that decodes `rate` tokens a second;
/// `None` if even full replicas cannot. `other` is the seconds a trajectory is alive without
/// decoding, per token it decodes; each kind makes the tokens of its [`held_occupancy`], which
/// grow with the trajectories it holds: a root search on the level.
pub(super) fn routed(
    kinds: &[DecodeKind],
    rate: f64,
    other: f64,
    holding: Holding,
    weights: &WeightReads,
    kv_per_seq: f64,
    flops_per_seq: f64,
) -> Option<Served> {
    let other = other.max(0.0);
    let tables: Vec<IterationTimes> = kinds
        .iter()
        .map(|k| IterationTimes::new(k, weights, kv_per_seq, flops_per_seq))
        .collect();
    let at = |level: f64| -> (Vec<(f64, f64, f64)>, f64) {
        let mut made = 0.0;
        let per: Vec<(f64, f64, f64)> = kinds
            .iter()
            .zip(&tables)
            .map(|(k, table)| {
                if k.replicas <= 0.0 || k.weight <= 0.0 || k.bandwidth <= 0.0 {
                    return (0.0, 0.0, 0.0);
                }
                let cap = k.cap.max(0.0);
                let alive = (level * k.weight).min(cap);
                let o = held_occupancy(alive, cap, other, table, holding);
                made += k.replicas * o.tokens_per_s;
                (alive, o.batch, o.tau)
            })
            .collect();
        (per, made)
    };
    // The level at which every kind is full: no higher level adds a sequence.
    let full = kinds
        .iter()
        .filter(|k| k.weight > 0.0 && k.replicas > 0.0)
        .map(|k| k.cap / k.weight)
        .fold(0.0_f64, f64::max);
    if full <= 0.0 {
        return None;
    }
    let (mut lo, mut hi) = (0.0, full);
    if rate > 0.0 {
        let at_full = at(hi).1;
        if at_full < rate * (1.0 - 1e-9) {
            return None;
        }
        // Regula falsi with the Illinois rule: the tokens made grow smoothly with the level
        // between the kinds' caps, so it takes a fraction of bisection's evaluations, each of
        // which sums every kind's occupancy.
        let (mut f_lo, mut f_hi) = (-rate, at_full - rate);
        let mut kept = 0_i8;
        for _ in 0..200 {
            if hi - lo <= 1e-12 * hi {
                break;
            }
            let mut x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo);
            if !(x > lo && x < hi) {
                x = 0.5 * (lo + hi);
            }
            let fx = at(x).1 - rate;
            if fx >= 0.0 {
                (hi, f_hi) = (x, fx);
                if kept > 0 {
                    f_lo *= 0.5;
                }
                kept = 1;
            } else {
                (lo, f_lo) = (x, fx);
                if kept < 0 {
                    f_hi *= 0.5;
                }
                kept = -1;
            }
            if fx.abs() <= 1e-12 * rate {
                hi = x;
                break;
            }
        }
    } else {
        // Nothing to decode: one lone sequence, wherever the router would put it.
        hi = 1e-9 * full;
    }
    let (per, made) = at(hi);
    let token_share: Vec<f64> = kinds
        .iter()
        .zip(&per)
        .map(|(k, &(_, batch, tau))| {
            if made > 0.0 && tau > 0.0 {
                k.replicas * batch / tau / made
            } else {
                0.0
            }
        })
        .collect();
    let tau = per
        .iter()
        .zip(&token_share)
        .map(|(&(_, _, t), q)| q * t)
        .sum();
    Some(Served {
        kinds: per,
        token_share,
        tau,
    })
}

impl Served {
    /// The token-weighted mean and variance of the per-token time a sequence sees, over the
    /// kinds of replica it may land on ([`replica_occupancy`] already counts its own KV read and
    /// experts).
    pub(super) fn seen(&self) -> (f64, f64) {
        let (mut mean, mut second) = (0.0, 0.0);
        for (&(_, _, tau), q) in self.kinds.iter().zip(&self.token_share) {
            mean += q * tau;
            second += q * tau * tau;
        }
        (mean, (second - mean * mean).max(0.0))
    }

    /// Mean sequences decoding on a replica that holds any.
    pub(super) fn batch_per_replica(&self, kinds: &[DecodeKind]) -> f64 {
        let (mut held, mut replicas) = (0.0, 0.0);
        for (k, &(_, b, _)) in kinds.iter().zip(&self.kinds) {
            if b > 0.0 {
                held += k.replicas * b;
                replicas += k.replicas;
            }
        }
        held / replicas.max(1e-12)
    }
}

/// Sequences one replica batches at per-token time `tau`.
pub(super) fn batch_at(
    k: &DecodeKind,
    tau: f64,
    weights: f64,
    kv_per_seq: f64,
    flops_per_seq: f64,
) -> f64 {
    let by_bandwidth = (k.bandwidth * tau - weights) / kv_per_seq.max(1e-30);
    let by_compute = tau * k.flops / flops_per_seq.max(1e-30);
    by_bandwidth.min(by_compute).clamp(0.0, k.cap)
}

/// The smallest per-token time at which the replicas decode `rate` tokens a second, if any. A
/// mixture of experts reads the weights of the batch it runs ([`WeightReads::bytes`] at the
/// replicas' mean batch): a fixed point, reached from one token's read upwards.
pub(super) fn token_time(
    kinds: &[DecodeKind],
    rate: f64,
    weights: &WeightReads,
    kv_per_seq: f64,
    flops_per_seq: f64,
) -> Option<f64> {
    let mut w = weights.single_token_bytes();
    let mut tau = fixed_weights_token_time_all(kinds, rate, w, kv_per_seq, flops_per_seq)?;
    for _ in 0..50 {
        let (mut held, mut replicas) = (0.0, 0.0);
        for k in kinds.iter().filter(|k| k.replicas > 0.0) {
            let b = batch_at(k, tau, w, kv_per_seq, flops_per_seq);
            if b > 0.0 {
                held += k.replicas * b;
                replicas += k.replicas;
            }
        }
        let next = weights.bytes(held / replicas.max(1e-12));
        if (next - w).abs() <= 1e-12 * w.max(1.0) {
            break;
        }
        w = next;
        tau = fixed_weights_token_time_all(kinds, rate, w, kv_per_seq, flops_per_seq)?;
    }
    Some(tau)
}

/// [`token_time`] for passes that read `weights` bytes whatever their batch.
fn fixed_weights_token_time_all(
    kinds: &[DecodeKind],
    rate: f64,
    weights: f64,
    kv_per_seq: f64,
    flops_per_seq: f64,
) -> Option<f64> {
    let g = |tau: f64| {
        kinds
            .iter()
            .map(|k| k.replicas * batch_at(k, tau, weights, kv_per_seq, flops_per_seq))
            .sum::<f64>()
            - rate * tau
    };
    // The batch of each kind is piecewise linear in tau; its corners are where it starts, where
    // compute takes over from bandwidth, and where it hits its cap. Between corners g is linear.
    let mut corners = Vec::with_capacity(kinds.len() * 4);
    for k in kinds
        .iter()
        .filter(|k| k.replicas > 0.0 && k.bandwidth > 0.0)
    {
        let start = weights / k.bandwidth;
        corners.push(start);
        let slope_b = k.bandwidth / kv_per_seq.max(1e-30);
        let slope_c = k.flops / flops_per_seq.max(1e-30);
        if slope_b > slope_c {
            corners.push(weights / kv_per_seq.max(1e-30) / (slope_b - slope_c));
        }
        corners.push((k.cap * kv_per_seq + weights) / k.bandwidth);
        corners.push(k.cap / slope_c.max(1e-30));
    }
    corners.retain(|c| c.is_finite() && *c > 0.0);
    corners.sort_by(f64::total_cmp);
    corners.dedup();
    let mut prev = (0.0, 0.0);
    for &c in &corners {
        let v = g(c);
        if v >= 0.0 && c > prev.0 {
            if rate <= 0.0 {
                // Nothing to decode: a lone sequence's time on the fastest replica.
                return Some(corners.first().copied().unwrap_or(c));
            }
            // g is linear on [prev, c], negative at prev: interpolate the root.
            let (x0, y0) = prev;
            return Some(if v > y0 {
                x0 + (c - x0) * (-y0) / (v - y0)
            } else {
                c
            });
        }
        prev = (c, v);
    }
    None
}

/// The token-weighted mean and standard deviation of one turn's action, over the tasks.
pub(super) fn action_spread(w: &Workload) -> (f64, f64) {
    let weight: f64 = w.tasks.iter().map(|k| k.share * k.turns).sum();
    if weight <= 0.0 {
        return (0.0, 0.0);
    }
    let mean = w
        .tasks
        .iter()
        .map(|k| k.share * k.turns * k.action)
        .sum::<f64>()
        / weight;
    let second = w
        .tasks
        .iter()
        .map(|k| k.share * k.turns * (k.action_var + k.action * k.action))
        .sum::<f64>()
        / weight;
    (mean, (second - mean * mean).max(0.0).sqrt())
}

/// How many standard deviations the largest of `n` normal draws lies above their mean (Blom's
/// plotting position; 0 for one draw or fewer).
pub(super) fn expected_max_z(n: f64) -> f64 {
    if n <= 1.0 {
        0.0
    } else {
        normal_quantile((n - 0.375) / (n + 0.25))
    }
}

/// The mean of the largest of `n` draws of a distribution with this `mean`, standard deviation
/// `sd` and skewness `skew`: a shifted log-normal matched on the three (its skewness `(w + 2)
/// sqrt(w - 1)` for `w = e^(sigma^2)`), whose largest draw is found by quadrature of `E[e^(mu +
/// sigma Z_(n))]` over the density `n Phi(z)^(n-1) phi(z)` of the largest of `n` standard
/// normals; a normal's, `mean + z_n sd`, when it has no skew. A lifetime is a sum of positive,
/// right-skewed parts: one long-tailed action (median 2,500 and p99 12,000 tokens, skewness
/// 2.7) puts the largest of 16 at 8,830 tokens on average, where the normal says 7,350; the sum
/// of many turns has little skew left (a sum of `k` like parts has `1 / sqrt(k)` of theirs), and
/// its largest draw stays near the normal's.
pub(super) fn skewed_expected_max(mean: f64, sd: f64, skew: f64, n: f64) -> f64 {
    if n <= 1.0 || sd <= 0.0 {
        return mean;
    }
    if skew <= 1e-6 {
        return mean + expected_max_z(n) * sd;
    }
    let skew_of = |w: f64| (w + 2.0) * (w - 1.0).max(0.0).sqrt();
    let (mut lo, mut hi) = (1.0_f64, 2.0_f64);
    while skew_of(hi) < skew && hi < 1e12 {
        hi *= 2.0;
    }
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if skew_of(mid) < skew {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let w = 0.5 * (lo + hi);
    let sigma = w.ln().sqrt();
    // The log-normal part: its variance is `m^2 (w - 1)`, the whole spread; the shift carries
    // the rest of the mean.
    let part_mean = sd / (w - 1.0).sqrt();
    let mu = part_mean.ln() - sigma * sigma / 2.0;
    let (weight, total) = MAX_OF_NORMALS.with(|grids| {
        let mut grids = grids.borrow_mut();
        let grid = max_of_normals_grid(&mut grids, n);
        grid.iter().fold((0.0, 0.0), |(w, t), &(z, density)| {
            (w + density, t + density * (mu + sigma * z).exp())
        })
    });
    let largest_part = if weight > 0.0 {
        total / weight
    } else {
        part_mean
    };
    mean - part_mean + largest_part
}

/// Points `z` and weights of a quadrature, by the bits of the `n` they are for.
type Grids = Vec<(u64, Vec<(f64, f64)>)>;

thread_local! {
    /// [`max_of_normals_grid`]'s grids by `n`: the planner asks for a few sizes (a group, a
    /// step's share of each task) thousands of times a plan.
    static MAX_OF_NORMALS: RefCell<Grids> = const { RefCell::new(Vec::new()) };
}

/// Points `z` and weights of the density `n Phi(z)^(n-1) phi(z)` of the largest of `n` standard
/// normals, for a midpoint rule: it lies within a few units of its Blom point (its spread is at
/// most one), and a tenth of a unit is exact to a few parts in 10^5 on the smooth integrands it
/// weighs.
fn max_of_normals_grid(grids: &mut Grids, n: f64) -> &[(f64, f64)] {
    let key = n.to_bits();
    let at = match grids.iter().position(|(k, _)| *k == key) {
        Some(i) => i,
        None => {
            const POINTS: usize = 120;
            let centre = expected_max_z(n);
            let (from, to) = (centre - 6.0, centre + 6.0);
            let dz = (to - from) / POINTS as f64;
            let grid = (0..POINTS)
                .map(|i| {
                    let z = from + (i as f64 + 0.5) * dz;
                    (z, n * normal_cdf(z).powf(n - 1.0) * normal_pdf(z))
                })
                .collect();
            // A plan asks for a handful of sizes; a long-lived scheduler re-plans with the same.
            if grids.len() >= 64 {
                grids.remove(0);
            }
            grids.push((key, grid));
            grids.len() - 1
        }
    };
    &grids[at].1
}

/// The most of a replica's compute its decoding sequences take from a prefill running beside
/// them: a prefill always progresses. The emulated engine (`rollfleet_fleet::hardware`) runs
/// with this cap, and the model prices its prefills by it.
pub const DECODE_COMPUTE_SHARE_MAX: f64 = 0.9;

/// What the staleness bound costs a group of a task, averaged over its groups.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Regeneration {
    /// Mean seconds a group holds its slot, over all its attempts.
    pub(super) slot_s: f64,
    /// Mean attempts a group makes (1 if none is ever thrown away).
    pub(super) attempts: f64,
}

/// How the core restarts a task's late groups early ([`regeneration`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct EarlyRestart {
    /// The task's long chain, seconds: a group whose deadline is shorter is restarted.
    pub(super) chain: f64,
    /// Seconds from the publication to the restarted attempt's start.
    pub(super) delay: f64,
}

/// Equal-probability points of a group's lasting lag (its members' turn counts, which a
/// regeneration does not redraw), for averaging over groups.
pub(super) const LAG_POINTS: usize = 16;

/// `x Q(x) - phi(x)`, an antiderivative of the standard normal survival function `Q(x) = 1 -
/// Phi(x)`.
fn survival_antiderivative(x: f64) -> f64 {
    x * (1.0 - normal_cdf(x)) - normal_pdf(x)
}

/// The mean of the standard normal survival function `Q(x) = 1 - Phi(x)` over `[a, b]`:
/// `x Q(x) - phi(x)` is its antiderivative ([`survival_antiderivative`]).
pub(super) fn mean_survival(a: f64, b: f64) -> f64 {
    if b - a < 1e-12 {
        return 1.0 - normal_cdf(a);
    }
    ((survival_antiderivative(b) - survival_antiderivative(a)) / (b - a)).clamp(0.0, 1.0)
}

/// `(Phi(z) - z^2 Q(z) + z phi(z)) / 2`, an antiderivative of `phi(z) - z Q(z)`, the standard
/// normal's mean excess over `z` ([`mean_excess`]).
fn excess_antiderivative(z: f64) -> f64 {
    (normal_cdf(z) - z * z * (1.0 - normal_cdf(z)) + z * normal_pdf(z)) / 2.0
}

/// The mean of `E[(X - d)+]` for `X ~ Normal(mean, sd)` over `d` uniform on `[low, high]`: how
/// far past a deadline drawn there an attempt runs, on average (nothing where it makes it).
pub(super) fn mean_excess(mean: f64, sd: f64, low: f64, high: f64) -> f64 {
    if sd <= 0.0 {
        if high - low < 1e-12 {
            return (mean - low).max(0.0);
        }
        let past = |d: f64| (mean - d).max(0.0);
        // The integral of a ramp: a triangle, or a trapezoid when the mean is past both ends.
        let over = if mean <= low {
            0.0
        } else if mean >= high {
            (past(low) + past(high)) / 2.0 * (high - low)
        } else {
            past(low) * past(low) / 2.0
        };
        return over / (high - low);
    }
    let (za, zb) = ((low - mean) / sd, (high - mean) / sd);
    if zb - za < 1e-9 {
        return sd * normal_pdf(za) - (low - mean) * (1.0 - normal_cdf(za));
    }
    (sd * sd * (excess_antiderivative(zb) - excess_antiderivative(za)) / (high - low)).max(0.0)
}

/// The cost of the staleness bound to a task's groups. An attempt (first turn to being taken by
/// the trainer) lasts `mean + lasting x Zg + fresh x Za`: `Zg` is the group's own lag (the turn
/// counts of its members, the same on every attempt), `Za` is drawn afresh on each attempt
/// (environment steps, actions), both standard normal. A group started a share `phi` into a
/// version's step (uniform) must be taken by the trainer before `maxStaleness + 1` more versions
/// are published, `(S + 1 - phi) T` after it started; an attempt that misses is thrown away
/// whole (every member's first turn is then too old) at the publication that expires it
/// (`Core::restart_expired_open_groups`), having held its slot until that deadline, not for its
/// whole length, and the group starts again, at a share of a step as random as the first.
///
/// `restart`, the long chain of the task by which the core restarts a group early
/// (`Core::restart_late_groups`), when it has one: a group whose deadline is shorter than it,
/// but not a whole bound `(S + 1) T` shorter, is restarted at the first publication after its
/// start, having held its slot `(1 - phi) T`. Those are the groups started in the last share `p =
/// (chain - S T) / T` of a step (clamped to [0, 1]). It starts again on the weights just
/// published once its running members reach their next generation, the restart's delay later (the
/// slot held meanwhile), with the whole bound less that delay ahead. With `q1` the mean miss of
/// an attempt over the deadlines of the groups left running and `q0` its miss with the whole
/// bound, and `o1`, `o0` how far past those deadlines an attempt runs on average
/// ([`mean_excess`]), a group holds its slot, by renewal over its attempts, `E = (mean - (1 - p)
/// o1 - p o0 + p (p T / 2 + delay)) / (1 - (1 - p) q1 - p q0)`; without the rule (`p = 0`) that
/// is the renewal reward of attempts cut at their deadlines. A group that almost never makes it
/// holds its slot until the job ends, on average half of the job (`hold_limit_s`). The attempts
/// a group makes are its slot over its mean attempt: a restarted one generated as much as the
/// time it held. The core's regeneration of a lone expired finished member at a publication is
/// left out on purpose (the module doc says why).
pub(super) fn regeneration(
    mean: f64,
    lasting: f64,
    fresh: f64,
    max_staleness: f64,
    t: f64,
    hold_limit_s: f64,
    restart: Option<EarlyRestart>,
) -> Regeneration {
    let (earliest, latest) = (max_staleness * t, (max_staleness + 1.0) * t);
    let (restarted, restart_delay) = match restart {
        Some(EarlyRestart { chain, delay }) if max_staleness > 0.0 && chain <= latest => {
            (((chain - earliest) / t.max(1e-12)).clamp(0.0, 1.0), delay)
        }
        _ => (0.0, 0.0),
    };
    // The deadlines of the groups the rule lets run, and of a restarted attempt.
    let lowest = earliest + restarted * t;
    let whole = latest - restart_delay;
    let (mut slot_s, mut attempts) = (0.0, 0.0);
    for j in 0..LAG_POINTS {
        let lag = if lasting > 0.0 {
            lasting * normal_quantile((j as f64 + 0.5) / LAG_POINTS as f64)
        } else {
            0.0
        };
        let attempt = (mean + lag).max(0.0);
        let (miss_running, miss_whole) = if fresh > 0.0 {
            (
                mean_survival((lowest - attempt) / fresh, (latest - attempt) / fresh),
                1.0 - normal_cdf((whole - attempt) / fresh),
            )
        } else {
            (
                ((attempt - lowest) / (latest - lowest).max(1e-12)).clamp(0.0, 1.0),
                if attempt > whole { 1.0 } else { 0.0 },
            )
        };
        let made = 1.0 - (1.0 - restarted) * miss_running - restarted * miss_whole;
        // An attempt that misses is restarted at the publication that expires it
        // (`Core::restart_expired_open_groups`), not when its slowest member is done: it holds
        // its slot until its deadline, not for its whole length.
        let overrun = (1.0 - restarted) * mean_excess(attempt, fresh, lowest, latest)
            + restarted * mean_excess(attempt, fresh, whole, whole);
        let expected = attempt - overrun + restarted * (restarted * t / 2.0 + restart_delay);
        let held = if made > 0.0 {
            expected / made
        } else {
            f64::INFINITY
        };
        let held = held.min(hold_limit_s.max(attempt));
        slot_s += held;
        attempts += held / attempt.max(1e-12);
    }
    Regeneration {
        slot_s: slot_s / LAG_POINTS as f64,
        attempts: attempts / LAG_POINTS as f64,
    }
}

/// Seconds per step averaged over a job of `steps` steps, what a finite run measures, from the
/// steady step `t`. Every step but the last is a steady one; the last also pays `drain_s`, the
/// wait for the groups the job started last ([`drain_wait`]). The first step is taken as a
/// steady one, which it is not: the whole window starts at once, so the first step ends with
/// the first groups to finish of a fresh window. Near one batch of window it simulates shorter
/// than a steady step (RollArt-like job: 72-79 s against 106-111 s), at two batches or more
/// (`maxStaleness` 4 and 8) about twice as long; not modelled. Nor can the job end before its
/// trainer has trained every step, which it cannot start on groups not yet done
/// (`trainer_done_s`, [`trainer_done`]). A job of one step is all start: its batch is started at
/// once, so it waits for `one_batch`, the slowest groups of the batch.
pub(super) fn job_average(
    t: f64,
    steps: f64,
    one_batch: f64,
    trainer_done_s: f64,
    drain_s: f64,
) -> f64 {
    let steps = steps.max(1.0);
    let last = if steps > 1.0 {
        t + drain_s
    } else {
        one_batch.max(t)
    };
    ((steps - 1.0) * t + last).max(trainer_done_s) / steps
}

/// The groups of one entry of [`SlotLife`]s and what training one of them takes, for
/// [`trainer_done`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Release {
    pub(super) life: SlotLife,
    /// Seconds the trainer takes over one of these groups.
    pub(super) group_train_s: f64,
}

/// Cells of [`trainer_done`]'s grid.
const RELEASE_CELLS: usize = 512;

/// The earliest the trainer can have trained `total_train_s` when it can take a group only once
/// the group is done. The window's `groups` start at once, and each slot, as its group is taken,
/// starts another, of a task drawn by share: the groups done by `x` are the renewal function of
/// the slot lives (their mixture) on a grid over `horizon_s`, and the training they bring by `x`
/// is `W(x)`. Whatever is done after `x` is trained after it, so the trainer is done no sooner
/// than `x + total - W(x)` for every `x`. Slot lives are taken free of any queue at the trainer,
/// which only holds groups back. It binds where the trainer is busy nearly all of a steady step
/// and the long groups of a fresh window are done long after the short ones, which bring too
/// little training to keep it busy meanwhile (the held-out MoE job on sixteen H800s and 128
/// H20s, simulated at seed 0: its trainer idled 82 s of the first 105). The slots renew without
/// end here: the job's last starts, and the trainer's wait for the last groups they leave, are
/// the drain's ([`drain_wait`]), as they are on the latency side.
pub(super) fn trainer_done(
    releases: &[Release],
    groups: f64,
    total_train_s: f64,
    horizon_s: f64,
) -> f64 {
    if releases.is_empty() || groups <= 0.0 || total_train_s <= 0.0 || horizon_s <= 0.0 {
        return total_train_s.max(0.0);
    }
    let h = horizon_s / RELEASE_CELLS as f64;
    let below = |l: &SlotLife, x: f64| -> f64 {
        if l.sd_s > 1e-12 {
            normal_cdf((x - l.mean_s) / l.sd_s)
        } else if x >= l.mean_s {
            1.0
        } else {
            0.0
        }
    };
    // A slot's cycle lands in cell `j` (centred on `j h`) with probability `cycle[j]`, and
    // brings `work[j]` of training there; what would end in no time is put in the first cell.
    let mut cycle = vec![0.0; RELEASE_CELLS + 1];
    let mut work = vec![0.0; RELEASE_CELLS + 1];
    for r in releases {
        let mut previous = 0.0;
        for j in 1..=RELEASE_CELLS {
            let upto = below(&r.life, (j as f64 + 0.5) * h);
            let mass = r.life.share * (upto - previous);
            previous = upto;
            cycle[j] += mass;
            work[j] += mass * r.group_train_s;
        }
    }
    // `starts[i]`: a slot's groups started in cell `i`, its first at 0.
    let mut starts = vec![0.0; RELEASE_CELLS + 1];
    starts[0] = 1.0;
    for i in 1..=RELEASE_CELLS {
        starts[i] = (1..=i).map(|j| cycle[j] * starts[i - j]).sum();
    }
    let mut released = 0.0;
    let mut done = total_train_s;
    for i in 1..=RELEASE_CELLS {
        released += groups * (1..=i).map(|j| work[j] * starts[i - j]).sum::<f64>();
        let x = i as f64 * h;
        done = done.max(x + (total_train_s - released).max(0.0));
        if released >= total_train_s {
            break;
        }
    }
    done
}

/// How long the groups of one task hold an admission slot (start to being taken by the
/// trainer, every attempt included): a normal of this mean and spread, for this share of the
/// groups.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct SlotLife {
    pub(super) share: f64,
    pub(super) mean_s: f64,
    pub(super) sd_s: f64,
}

/// Adds a task's slot lives for the end of the job ([`drain_wait`]) to `lives`: its groups hold
/// their slots `slot_s` on average, an attempt lasting `attempt_s` (spread `sd_s`). The groups
/// that keep their first attempt and those that start again are apart: the longest remaining
/// lives at the end are the restarted groups', which a normal around the mean over both puts far
/// too early (without over-provisioning the job's last step waits for them; simulated, that
/// mean made the held-out jobs' job average 5-26% low at `overProvisioning: 0`). A share
/// `p = slot / attempt - 1` of them restarts, up to one restart in all on average, and holds its
/// slot `(slot - attempt) / p` more, with the spread of two attempts; past one restart on
/// average, or with none, one life of the mean.
pub(super) fn push_slot_lives(
    lives: &mut Vec<SlotLife>,
    share: f64,
    attempt_s: f64,
    slot_s: f64,
    sd_s: f64,
) {
    let restarted = (slot_s / attempt_s.max(1e-9) - 1.0).clamp(0.0, 1.0);
    if restarted > 1e-3 && restarted < 1.0 {
        lives.push(SlotLife {
            share: share * (1.0 - restarted),
            mean_s: attempt_s,
            sd_s,
        });
        lives.push(SlotLife {
            share: share * restarted,
            mean_s: attempt_s + (slot_s - attempt_s) / restarted,
            sd_s: sd_s * std::f64::consts::SQRT_2,
        });
    } else {
        lives.push(SlotLife {
            share,
            mean_s: slot_s,
            sd_s,
        });
    }
}

/// What the end of a job adds to its last step. The core starts the job's batches and one
/// over-provisioning margin `E` and no more (`Core::admit_groups`), and once what is left to
/// start fits within `F` more than the window and its margin (`Core::last_starts`: one batch,
/// within the cap of `maxStaleness` batches) it starts all of it: `W + F` are then left to train,
/// of the `W + E` running and the `F` just started, and the job ends when those are done. The
/// running ones are a steady window's groups caught at a random moment, so what each has left to
/// live follows the equilibrium law of slot lives (a group holds its slot in proportion to its
/// life, and is caught uniformly within it): `P(R <= r) = int_0^r S(x) dx / E[L]`, `S` the
/// survival of a life; the fresh ones have whole lives ahead. The end comes when the `(W + F) /
/// n`-th of the `(W + E + F) / n` groups' remaining lives is over, near the mixture's `(W + F) /
/// (W + E + F)` quantile (without a margin or fresh starts, the longest of them), where a window
/// kept full would have taken `(W + F) / B` steady steps; the excess is the drain. Equal lives
/// make the two about the same; spread lives make the drain wait for the long ones, which a full
/// window would have dropped. A job of no more than one window (`steps x B <= W`) is left to
/// `one_batch`. A job a little longer, which the core starts whole at once because its budget
/// fits within `W + E + F`, is still taken as a running window here: such jobs of two or three
/// steps have no steady state for the model to describe.
pub(super) fn drain_wait(lives: &[SlotLife], w: &Workload, t: f64) -> f64 {
    let (window, margin) = w.admission_terms();
    let fresh = (w.last_starts() - window - margin).max(0.0);
    let n = w.group_size.max(1.0);
    let (running, started) = ((window + margin) / n, fresh / n);
    let needed = ((window + fresh) / n).floor();
    if w.steps * w.batch <= window || needed < 1.0 {
        return 0.0;
    }
    // The survival of a life integrated from 0 to `r`.
    let lived = |r: f64| -> f64 {
        lives
            .iter()
            .map(|l| {
                let integral = if l.sd_s > 1e-12 {
                    l.sd_s
                        * (survival_antiderivative((r - l.mean_s) / l.sd_s)
                            - survival_antiderivative(-l.mean_s / l.sd_s))
                } else {
                    r.min(l.mean_s).max(0.0)
                };
                l.share * integral
            })
            .sum()
    };
    // The share of whole lives over by `r`.
    let over = |r: f64| -> f64 {
        lives
            .iter()
            .map(|l| {
                let done = if l.sd_s > 1e-12 {
                    normal_cdf((r - l.mean_s) / l.sd_s)
                } else if r >= l.mean_s {
                    1.0
                } else {
                    0.0
                };
                l.share * done
            })
            .sum()
    };
    let longest = lives
        .iter()
        .map(|l| l.mean_s + 10.0 * l.sd_s)
        .fold(0.0_f64, f64::max);
    let mean_life = lived(longest);
    if mean_life <= 0.0 {
        return 0.0;
    }
    let done = |r: f64| (running * lived(r) / mean_life + started * over(r)) / (running + started);
    // The `needed`-th shortest of the remaining lives lies near this quantile (Blom's
    // approximation of an order statistic): without a margin, the longest of them.
    let wanted = (needed - 0.375) / ((running + started).floor() + 0.25);
    let (mut lo, mut hi) = (0.0, longest);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if done(mid) < wanted {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (0.5 * (lo + hi) - (window + fresh) / w.batch * t).max(0.0)
}

/// Seconds per step of a closed network of `customers` groups, each spending `think_s` in
/// generation (an infinite server: every group generates at once) and `service_s` at a single
/// FIFO server, by exact mean value analysis (Reiser and Lavenberg): the response time at the
/// server with `k` customers is `service x (1 + queue with k - 1)`, the throughput `k / (think +
/// response)`, the queue `throughput x response`.
pub(super) fn closed_loop_step(customers: f64, think_s: f64, service_s: f64, per_step: f64) -> f64 {
    let n = customers.floor().max(1.0) as usize;
    let (mut queued, mut throughput) = (0.0, 0.0);
    for k in 1..=n {
        let response = service_s * (1.0 + queued);
        throughput = k as f64 / (think_s + response).max(1e-12);
        queued = throughput * response;
    }
    per_step / throughput.max(1e-12)
}

/// M/D/1 sojourn factor: service time times `1 + rho / (2 (1 - rho))`.
pub(super) fn queue(rho: f64) -> f64 {
    let rho = rho.clamp(0.0, 0.999);
    1.0 + rho / (2.0 * (1.0 - rho))
}
