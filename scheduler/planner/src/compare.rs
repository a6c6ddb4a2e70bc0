//! Fixed placements to compare the plan with: `uniform` and `best-gpu`.
//!
//! - **uniform**: every role spread evenly over all GPUs, blind to what suits which hardware:
//!   every pool gives the same share of its serving GPUs to prefill and the rest to decode (or
//!   every pool generates, prefill and decode colocated). The core trains on one pool, so the
//!   trainer is one pool's whole nodes. Among this family, the best by the predictor (trainer
//!   pool and size, prefill share in tenths or colocated generation, one tensor-parallel degree
//!   for every pool) is taken, so the comparison is with the best uniform placement, not a
//!   strawman.
//! - **best-gpu**: everything on the most powerful GPU product (highest peak FLOP/s per GPU; the
//!   larger pool on a tie), the other GPU pools idle, planned exactly on that pool alone.

use crate::predict::{self, Candidate, Group, Problem, Role};
use crate::search::{self, Found, trainer_sizes};

/// The best uniform placement by the predictor.
pub fn uniform(p: &Problem) -> Option<Found> {
    let mut best: Option<(f64, Candidate)> = None;
    let mut nodes = 0;
    for trainer_pool in 0..p.gpu_pools.len() {
        for g in trainer_sizes(p, trainer_pool) {
            if crate::cancel::requested() {
                return None;
            }
            // Prefill share in tenths, or 10 = colocated generation everywhere; one
            // tensor-parallel degree for every pool (the smallest each pool allows at or above
            // it), so the uniform placement has the same lever the plan has.
            for (tenth, wanted) in (1..=10u32).flat_map(|t| [1u32, 2, 4, 8].map(|w| (t, w))) {
                let mut groups = Vec::new();
                for (i, pool) in p.gpu_pools.iter().enumerate() {
                    let Some(tp) = pool
                        .tps
                        .iter()
                        .copied()
                        .find(|&t| t >= wanted)
                        .or_else(|| pool.tps.last().copied())
                    else {
                        continue;
                    };
                    let avail = if i == trainer_pool {
                        pool.count - g
                    } else {
                        pool.count
                    };
                    let replicas = avail / tp;
                    if tenth == 10 {
                        groups.push(Group {
                            pool: i,
                            role: Role::Generate,
                            tp,
                            replicas,
                        });
                    } else {
                        let prefill = (replicas * tenth + 5) / 10;
                        groups.push(Group {
                            pool: i,
                            role: Role::Prefill,
                            tp,
                            replicas: prefill,
                        });
                        groups.push(Group {
                            pool: i,
                            role: Role::Decode,
                            tp,
                            replicas: replicas - prefill,
                        });
                    }
                }
                let c = Candidate {
                    groups,
                    trainer_pool,
                    trainer_gpus: g,
                };
                nodes += 1;
                if let Some(t) = predict::step_time(p, &c)
                    && best.as_ref().is_none_or(|(b, _)| t < *b)
                {
                    best = Some((t, c));
                }
            }
        }
    }
    best.map(|(step_s, candidate)| Found {
        candidate,
        step_s,
        nodes,
    })
}

/// Everything on the most powerful GPU pool.
pub fn best_gpu(p: &Problem) -> Option<Found> {
    let keep = (0..p.gpu_pools.len()).max_by(|&a, &b| {
        let (x, y) = (&p.gpu_pools[a], &p.gpu_pools[b]);
        x.peak_flops
            .total_cmp(&y.peak_flops)
            .then(x.count.cmp(&y.count))
            .then(b.cmp(&a))
    })?;
    let mut only = p.clone();
    only.gpu_pools = vec![p.gpu_pools[keep].clone()];
    let found = search::solve(&only)?;
    let remap = |c: Candidate| Candidate {
        groups: c
            .groups
            .into_iter()
            .map(|g| Group { pool: keep, ..g })
            .collect(),
        trainer_pool: keep,
        trainer_gpus: c.trainer_gpus,
    };
    Some(Found {
        candidate: remap(found.candidate),
        step_s: found.step_s,
        nodes: found.nodes,
    })
}
