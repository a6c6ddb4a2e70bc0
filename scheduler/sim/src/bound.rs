//! The lower bound on the time of one RL step, and the tiny LP solver it needs.
//!
//! For every resource, the useful work of a step (of the trajectories actually trained on: their
//! prompt and observation prefill, their decode, their training, their environment steps and
//! rewards) divided by the resource's capacity is a time the step cannot beat. GPU work may go to
//! any GPU pool, so for GPUs the bound is the best fractional placement: the linear program
//!
//! ```text
//! minimise T  subject to  sum_w x[w][p] * cost[w][p] <= T   for every GPU pool p
//!                         sum_p x[w][p] = 1                 for every kind of work w
//!                         x >= 0
//! ```
//!
//! where `cost[w][p]` is the time pool `p` would take to do all of work `w` alone at the
//! simulator's own achievable rates (the same rates the simulated runs get; anything faster is
//! impossible in the simulated world). Splitting work fractionally, ignoring memory limits, KV
//! transfers, weight syncs, queueing and dependencies only makes the bound lower, so it is a true
//! lower bound of the simulated system. CPU pools are interchangeable for environments (their
//! vCPUs add up); each serverless pool is bounded by its concurrency.

/// Solves `min T` for the GPU placement LP above. `cost[w][p]` must be finite and positive
/// (use `f64::INFINITY` for "cannot"); returns `(T, x)`.
pub fn min_makespan(cost: &[Vec<f64>]) -> Option<(f64, Vec<Vec<f64>>)> {
    let works = cost.len();
    let pools = cost.first().map_or(0, |c| c.len());
    if works == 0 || pools == 0 {
        return Some((0.0, vec![vec![0.0; pools]; works]));
    }
    // Scale costs to about 1 for numerical comfort.
    let scale = cost
        .iter()
        .flatten()
        .copied()
        .filter(|c| c.is_finite() && *c > 0.0)
        .fold(0.0_f64, f64::max);
    if scale <= 0.0 {
        return Some((0.0, vec![vec![0.0; pools]; works]));
    }
    // Variables: x[w][p] (works*pools), T, slack s[p], artificial a[w].
    let nx = works * pools;
    let t_col = nx;
    let s0 = nx + 1;
    let a0 = s0 + pools;
    let cols = a0 + works;
    let rows = pools + works;
    let mut tab = vec![vec![0.0; cols + 1]; rows];
    for p in 0..pools {
        for w in 0..works {
            let c = cost[w][p] / scale;
            // An impossible placement gets a prohibitive cost.
            tab[p][w * pools + p] = if c.is_finite() { c } else { 1e12 };
        }
        tab[p][t_col] = -1.0;
        tab[p][s0 + p] = 1.0;
    }
    for w in 0..works {
        let r = pools + w;
        for p in 0..pools {
            tab[r][w * pools + p] = 1.0;
        }
        tab[r][a0 + w] = 1.0;
        tab[r][cols] = 1.0;
    }
    let mut basis: Vec<usize> = (0..pools)
        .map(|p| s0 + p)
        .chain((0..works).map(|w| a0 + w))
        .collect();
    // Phase 1: minimise the artificials.
    let mut phase1 = vec![0.0; cols];
    for w in 0..works {
        phase1[a0 + w] = 1.0;
    }
    simplex(&mut tab, &mut basis, &phase1, cols)?;
    // Phase 2: minimise T, artificials barred.
    for row in tab.iter_mut() {
        for v in &mut row[a0..cols] {
            *v = 0.0;
        }
    }
    let mut phase2 = vec![0.0; cols];
    phase2[t_col] = 1.0;
    simplex(&mut tab, &mut basis, &phase2, a0)?;
    let mut x = vec![vec![0.0; pools]; works];
    let mut t = 0.0;
    for (r, &b) in basis.iter().enumerate() {
        if b < nx {
            x[b / pools][b % pools] = tab[r][cols];
        } else if b == t_col {
            t = tab[r][cols];
        }
    }
    Some((t * scale, x))
}

/// Tableau simplex with Bland's rule over columns `< allowed`; returns `None` if unbounded.
fn simplex(tab: &mut [Vec<f64>], basis: &mut [usize], cost: &[f64], allowed: usize) -> Option<()> {
    let rows = tab.len();
    let rhs = tab.first().map_or(0, |r| r.len() - 1);
    for _ in 0..10_000 {
        // Reduced costs.
        let mut entering = None;
        for j in 0..allowed {
            if basis.contains(&j) {
                continue;
            }
            let mut reduced = cost[j];
            for r in 0..rows {
                reduced -= cost[basis[r]] * tab[r][j];
            }
            if reduced < -1e-12 {
                entering = Some(j);
                break;
            }
        }
        let Some(j) = entering else { return Some(()) };
        let mut leaving: Option<(usize, f64)> = None;
        for r in 0..rows {
            if tab[r][j] > 1e-12 {
                let ratio = tab[r][rhs] / tab[r][j];
                if leaving.is_none_or(|(lr, best)| {
                    ratio < best - 1e-15 || (ratio <= best + 1e-15 && basis[r] < basis[lr])
                }) {
                    leaving = Some((r, ratio));
                }
            }
        }
        let (r, _) = leaving?;
        let pivot = tab[r][j];
        for v in tab[r].iter_mut() {
            *v /= pivot;
        }
        let pivot_row = tab[r].clone();
        for (i, row) in tab.iter_mut().enumerate() {
            if i != r && row[j].abs() > 0.0 {
                let f = row[j];
                for (v, p) in row.iter_mut().zip(&pivot_row) {
                    *v -= f * p;
                }
            }
        }
        basis[r] = j;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_pool_does_everything_in_the_sum_of_the_times() {
        let (t, _) = min_makespan(&[vec![2.0], vec![3.0]]).unwrap();
        assert!((t - 5.0).abs() < 1e-9, "{t}");
    }

    #[test]
    fn two_identical_pools_halve_the_time() {
        let (t, _) = min_makespan(&[vec![2.0, 2.0], vec![4.0, 4.0]]).unwrap();
        assert!((t - 3.0).abs() < 1e-9, "{t}");
    }

    #[test]
    fn each_kind_of_work_goes_where_it_is_cheap() {
        // Pool 0 is fast at work 0, pool 1 at work 1: T = 1 with no splitting.
        let (t, x) = min_makespan(&[vec![1.0, 10.0], vec![10.0, 1.0]]).unwrap();
        assert!((t - 1.0).abs() < 1e-9, "{t}");
        assert!((x[0][0] - 1.0).abs() < 1e-9 && (x[1][1] - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_hand_computed_split_is_found() {
        // Work 0 costs 6 on pool 0 and 3 on pool 1; work 1 only fits pool 1 (cost 1).
        // Put f of work 0 on pool 0: 6f = 3(1-f) + 1  =>  f = 4/9, T = 8/3.
        let (t, _) = min_makespan(&[vec![6.0, 3.0], vec![f64::INFINITY, 1.0]]).unwrap();
        assert!((t - 8.0 / 3.0).abs() < 1e-9, "{t}");
    }
}
