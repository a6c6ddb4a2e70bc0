//! The admission window rollfleet runs a job with: the core's rule (`Core::admission_window`),
//! or the rule widened by quarters of a rollout batch, whichever simulates fastest for the job on
//! its placement.
//!
//! The rule suits a job whose groups live close to the staleness bound: a wider window there
//! only shortens the steps the long groups must fit in, so more of them expire and generate
//! again. A job whose groups live well inside the bound is held back by it instead: the
//! trainer waits for a window too narrow to feed it. Which of the two a job is depends on the
//! spread of its lives against its step, which the rule does not see, and the planner's model
//! ranks the widths wrongly on some jobs (it does not describe the expiries a wider window
//! causes on a job bound by its longest chains), so neither decides.
//!
//! Each width is simulated for the job's first [`TUNING_STEPS`] steps (all of them in a shorter
//! job) on [`TUNING_SEEDS`] seeds of its own, drawn from the run's seed but not equal to it, so
//! the choice is not fitted to the trajectories the run then samples. Of the rule and the rule
//! widened by a quarter and by half a batch ([`WIDENINGS`]), the lowest mean step wins; on a tie,
//! the narrower window (it regenerates less). Where half a batch wins, the window widens a
//! quarter at a time while each quarter simulates [`WIDENING_GAIN`] faster than the last, up to
//! [`MAX_WIDENING_QUARTERS`]: a job whose trainer still waits at half a batch (the held-out web
//! agent at `maxStaleness: 3`) runs fastest around a whole batch over the rule. Where the rule
//! wins, the window narrows a quarter at a time while each quarter simulates [`NARROWING_GAIN`]
//! faster, down to one training batch (`Core::admission_window`'s floor): a job whose pools
//! cannot serve the rule's window (the RollArt-like workload on a third of its GPUs) gains
//! nothing from trajectories waiting in it but more refills after every weight update and more
//! expiries.

use rollfleet_catalog::Catalog;
use rollfleet_core::rng::SplitMix64;
use rollfleet_core::{Discipline, Placement, Policy};
use rollfleet_spec::JobSpec;
use serde::Serialize;

use crate::sim::{RunError, SimOptions, simulate};

/// The widenings always tried, in quarters of a rollout batch.
pub const WIDENINGS: [i32; 3] = [0, 1, 2];

/// The widest window tried, in quarters of a rollout batch: two batches over the rule.
pub const MAX_WIDENING_QUARTERS: i32 = 8;

/// How much faster than the width chosen so far (a quarter narrower) a width past [`WIDENINGS`]
/// must simulate to be chosen, and the next quarter tried: the trials run on few seeds, and
/// among widths that simulate alike the lowest mean is the seeds' noise, not the width's.
pub const WIDENING_GAIN: f64 = 0.01;

/// How much faster than the width chosen so far (a quarter wider) a window narrower than the
/// rule must simulate to be chosen, and the next quarter tried. Narrowing pays where the pools
/// cannot serve the rule's window, and there each quarter simulated 6-10% faster (the
/// RollArt-like workload on a third of its GPUs); on a job they can serve, a quarter less was
/// a few per cent faster on the trials' seeds and slower on the run's (the quick-start).
pub const NARROWING_GAIN: f64 = 0.05;

/// Seeds each width is simulated on.
pub const TUNING_SEEDS: u64 = 2;

/// Steps each tuning run simulates at most. Fewer misled: over its first 10 of 20 steps the
/// RollArt-like job looked faster with a wider window, and over all 20 it is slower.
pub const TUNING_STEPS: i64 = 20;

/// Keys the tuning seeds apart from every other draw made from the run's seed.
const TUNING_KEY: u64 = 0x7769_6e64_6f77;

/// One width's trial.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowProbe {
    /// The widening, in quarters of a rollout batch (negative: a narrowing).
    pub widening_quarters: i32,
    /// Simulated seconds per step, the mean over the tuning seeds; none when a run failed.
    pub step_s: Option<f64>,
    /// Why a run of this width failed (it is then not chosen).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// The width chosen, and every trial.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowChoice {
    /// The widening chosen, in quarters of a rollout batch (negative: a narrowing).
    pub widening_quarters: i32,
    /// Each width's trial (none where nothing was chosen: a batched policy has no window).
    pub probes: Vec<WindowProbe>,
}

impl WindowChoice {
    /// How reports say it: the trials, the chosen one marked.
    pub fn describe(&self) -> String {
        self.probes
            .iter()
            .map(|p| {
                let mark = if p.widening_quarters == self.widening_quarters {
                    " (chosen)"
                } else {
                    ""
                };
                let result = match (p.step_s, &p.failed) {
                    (Some(step_s), _) => format!("{step_s:.1} s"),
                    (None, Some(why)) => format!("failed ({why})"),
                    (None, None) => "not run".to_owned(),
                };
                format!("{} {result}{mark}", widening_label(p.widening_quarters))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `rule`, `rule + 1/4 batch`, `rule + 1/2 batch`, `rule + 3/4 batch`, `rule + 1 batch`, `rule +
/// 5/4 batches`, ..., and `rule - 1/4 batch`, ... for a narrowing.
pub fn widening_label(quarters: i32) -> String {
    let size = quarters.unsigned_abs();
    let fraction = match size % 4 {
        0 => format!("{}", size / 4),
        2 => format!("{}/2", size / 2),
        _ => format!("{size}/4"),
    };
    let sign = if quarters < 0 { '-' } else { '+' };
    match size {
        0 => "rule".to_owned(),
        1..=4 => format!("rule {sign} {fraction} batch"),
        _ => format!("rule {sign} {fraction} batches"),
    }
}

/// The narrowing (negative quarters) at which the job's admission window reaches its floor:
/// one training batch (or group), below which `Core::admission_window` narrows no further. 0
/// where the rule's window is already there.
pub fn narrowest_quarters(spec: &JobSpec, policy: &Policy) -> i32 {
    let window = |quarters: i32| {
        rollfleet_core::Core::admission_window(
            spec.rl.rollout_batch_size.max(1) as u64,
            spec.rl.train_batch_size.max(1) as u64,
            spec.rl.group_size.max(1) as u64,
            policy.max_staleness,
            policy.over_provisioning,
            policy.cap_over_provisioning,
            quarters,
        )
        .window
    };
    let mut quarters = 0;
    // A rule of at most two batches narrows in at most eight quarters.
    while quarters > -MAX_WIDENING_QUARTERS && window(quarters - 1) < window(quarters) {
        quarters -= 1;
    }
    quarters
}

/// The run seeds the widths are tried on, for a run seeded `seed`.
pub fn tuning_seeds(seed: u64) -> Vec<u64> {
    (0..TUNING_SEEDS)
        .map(|i| SplitMix64::keyed(seed, &[TUNING_KEY, i]).next_u64())
        .collect()
}

/// [`choose_window`] for rollfleet's own policy with the job's RL settings.
pub fn choose_rollfleet_window(
    spec: &JobSpec,
    catalog: &Catalog,
    placement: &Placement,
    opts: &SimOptions,
) -> Result<WindowChoice, RunError> {
    choose_window(spec, catalog, placement, &Policy::rollfleet(spec), opts)
}

/// The widening of the admission window `policy` should run the job with on `placement` (see
/// the module docs); `opts` gives the run's seed and hardware model (its failures, losses,
/// migrations and slowdowns are left out of the trials). A width whose run fails is not chosen
/// (its trial says why); a failed run of the rule itself is the error.
pub fn choose_window(
    spec: &JobSpec,
    catalog: &Catalog,
    placement: &Placement,
    policy: &Policy,
    opts: &SimOptions,
) -> Result<WindowChoice, RunError> {
    if policy.discipline != Discipline::Continuous {
        return Ok(WindowChoice {
            widening_quarters: policy.window_widening_quarters,
            probes: Vec::new(),
        });
    }
    let mut trial_spec = spec.clone();
    trial_spec.rl.steps = spec.rl.steps.clamp(1, TUNING_STEPS);
    let trial = |quarters: i32, seed: u64| {
        let trial_opts = SimOptions {
            seed,
            hardware: opts.hardware,
            max_virtual_s: opts.max_virtual_s,
            ..SimOptions::default()
        };
        let trial_policy = Policy {
            window_widening_quarters: quarters,
            ..policy.clone()
        };
        simulate(
            &trial_spec,
            catalog,
            placement.clone(),
            trial_policy,
            &trial_opts,
            &mut |_, _| {},
        )
        .map(|run| run.makespan_s / run.publish_times_s.len().max(1) as f64)
    };
    choose_among(
        trial,
        &tuning_seeds(opts.seed),
        narrowest_quarters(spec, policy),
    )
}

/// The width the trials so far choose: the lowest mean step among [`WIDENINGS`], the narrower
/// on a tie; then each width a quarter further from the rule in turn (wider past the widest,
/// narrower below the rule) while it is faster than the chosen one by [`WIDENING_GAIN`] (wider)
/// or [`NARROWING_GAIN`] (narrower). `None` while no trial succeeded.
fn chosen(probes: &[WindowProbe]) -> Option<(i32, f64)> {
    let fixed = WIDENINGS.len().min(probes.len());
    let steps = |probes: &[WindowProbe]| {
        probes
            .iter()
            .filter_map(|p| p.step_s.map(|s| (p.widening_quarters, s)))
            .collect::<Vec<_>>()
    };
    let mut best = steps(&probes[..fixed]).into_iter().fold(
        None::<(i32, f64)>,
        |best, (q, s)| match best {
            Some((_, b)) if b <= s => best,
            _ => Some((q, s)),
        },
    )?;
    for (q, s) in steps(&probes[fixed..]) {
        let (next, gain) = if q > 0 {
            (best.0 + 1, WIDENING_GAIN)
        } else {
            (best.0 - 1, NARROWING_GAIN)
        };
        if q != next || s > best.1 * (1.0 - gain) {
            break;
        }
        best = (q, s);
    }
    Some(best)
}

/// The choice among [`WIDENINGS`] and, while each quarter further is faster by
/// [`WIDENING_GAIN`] ([`NARROWING_GAIN`] narrower), wider windows up to
/// [`MAX_WIDENING_QUARTERS`] or narrower ones down to `narrowest` (`chosen`), given
/// `trial(quarters, seed)`, the simulated seconds per step of a width on a seed, scored by its
/// mean over `seeds`. A width whose trial fails on any seed is not chosen (its probe says why); a
/// failed trial of the rule is the error, as the rule is what the job runs with when nothing else
/// is.
pub fn choose_among(
    mut trial: impl FnMut(i32, u64) -> Result<f64, RunError>,
    seeds: &[u64],
    narrowest: i32,
) -> Result<WindowChoice, RunError> {
    let mut probes: Vec<WindowProbe> = Vec::with_capacity(WIDENINGS.len());
    let widest_always = WIDENINGS[WIDENINGS.len() - 1];
    // After the widths always tried, the next is a quarter past the chosen one when the chosen
    // one is the widest or narrowest tried: wider past half a batch, narrower below the rule.
    let next = |probes: &[WindowProbe]| -> Option<i32> {
        if probes.len() < WIDENINGS.len() {
            return Some(WIDENINGS[probes.len()]);
        }
        let (best, _) = chosen(probes)?;
        let edge = |q: i32| probes.iter().all(|p| p.widening_quarters != q);
        if best >= widest_always && best < MAX_WIDENING_QUARTERS && edge(best + 1) {
            Some(best + 1)
        } else if best <= 0 && best > narrowest && edge(best - 1) {
            Some(best - 1)
        } else {
            None
        }
    };
    while let Some(quarters) = next(&probes) {
        // A scheduler told to stop while it plans the job stops choosing too (the planner's
        // flag, [`rollfleet_planner::cancel`]): what it chose is then thrown away.
        if rollfleet_planner::cancel::requested() {
            break;
        }
        let mut total = 0.0;
        let mut failed = None;
        for &seed in seeds {
            match trial(quarters, seed) {
                Ok(step_s) => total += step_s,
                Err(e) if quarters == 0 => return Err(e),
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        probes.push(WindowProbe {
            widening_quarters: quarters,
            step_s: failed.is_none().then(|| total / seeds.len().max(1) as f64),
            failed,
        });
    }
    let best = chosen(&probes).map_or(0, |(q, _)| q);
    Ok(WindowChoice {
        widening_quarters: best,
        probes,
    })
}
