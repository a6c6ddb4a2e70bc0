//! rollfleet's admission window, chosen per job by simulating it (`rollfleet_sim::window`): the
//! choice, the seeds it is made on, and what `rollfleet sim` reports of it.
#![allow(clippy::unwrap_used)]

use rollfleet_sim::sim::RunError;
use rollfleet_sim::window::{
    MAX_WIDENING_QUARTERS, WIDENINGS, choose_among, choose_window, narrowest_quarters, tuning_seeds,
};
use rollfleet_sim::{Baseline, OutputFormat, PlacementChoice, SimArgs, SimOptions, simulate};

fn example(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/jobs")
        .join(name)
}

/// The job, the planner's placement of it and rollfleet's policy on it.
fn planned(
    name: &str,
) -> (
    rollfleet_spec::ValidatedJob,
    rollfleet_core::Placement,
    rollfleet_core::Policy,
) {
    let job = rollfleet_spec::load_job_file(&example(name)).unwrap();
    let (placement, _) =
        rollfleet_sim::placement::choose(PlacementChoice::Plan, job.spec(), &job.catalog).unwrap();
    let (placement, policy) = Baseline::Rollfleet
        .setup_with(job.spec(), &job.catalog, placement)
        .unwrap();
    (job, placement, policy)
}

#[test]
fn the_window_chosen_is_the_width_that_simulated_fastest_on_seeds_other_than_the_runs() {
    let (job, placement, policy) = planned("quickstart.yaml");
    let opts = SimOptions {
        seed: 3,
        ..SimOptions::default()
    };
    let choice = choose_window(job.spec(), &job.catalog, &placement, &policy, &opts).unwrap();
    let widths: Vec<i32> = choice.probes.iter().map(|p| p.widening_quarters).collect();
    // The widths always tried, and a quarter narrower where the rule was the fastest of them.
    assert_eq!(widths[..WIDENINGS.len()], WIDENINGS);
    assert!(
        widths[WIDENINGS.len()..].iter().all(|&q| q == -1),
        "{widths:?}"
    );
    let steps: Vec<f64> = choice.probes.iter().map(|p| p.step_s.unwrap()).collect();
    let fastest = steps.iter().copied().fold(f64::INFINITY, f64::min);
    let chosen = choice
        .probes
        .iter()
        .find(|p| p.widening_quarters == choice.widening_quarters)
        .unwrap();
    assert_eq!(chosen.step_s, Some(fastest), "{choice:?}");
    // The narrowest of equally fast widths.
    assert!(
        choice
            .probes
            .iter()
            .zip(&steps)
            .all(|(p, &s)| s > fastest || p.widening_quarters >= choice.widening_quarters),
        "{choice:?}"
    );
    let seeds = tuning_seeds(3);
    assert_eq!(seeds.len(), 2);
    assert!(!seeds.contains(&3) && seeds[0] != seeds[1], "{seeds:?}");
    assert_ne!(seeds, tuning_seeds(4));
    // A pure function of the job and the seed.
    assert_eq!(
        choice,
        choose_window(job.spec(), &job.catalog, &placement, &policy, &opts).unwrap()
    );
}

#[test]
fn a_job_whose_groups_live_well_inside_the_bound_runs_faster_on_the_wider_window_it_chooses() {
    // The held-out math-and-code job: at `maxStaleness: 1` its trainer waits for the rule's
    // window of three quarters of a batch.
    let (job, placement, policy) = planned("holdout-math-code.yaml");
    let opts = SimOptions::default();
    let choice = choose_window(job.spec(), &job.catalog, &placement, &policy, &opts).unwrap();
    assert!(choice.widening_quarters > 0, "{choice:?}");
    let step = |quarters| mean_step(&job, &placement, &policy, &opts, quarters);
    // On the run's own seed, which the choice never saw.
    let (rule, chosen) = (step(0), step(choice.widening_quarters));
    assert!(chosen < 0.95 * rule, "{chosen} s against {rule} s");
}

#[test]
fn a_job_whose_trainer_still_waits_at_half_a_batch_widens_further_and_runs_faster() {
    // The held-out web agent, at `maxStaleness: 3`.
    let (job, placement, policy) = planned("holdout-web-agent.yaml");
    let opts = SimOptions::default();
    let choice = choose_window(job.spec(), &job.catalog, &placement, &policy, &opts).unwrap();
    assert!(choice.widening_quarters > 2, "{choice:?}");
    assert_eq!(
        tried(&choice),
        (0..=choice.widening_quarters + 1).collect::<Vec<_>>(),
        "one width past the chosen one is tried"
    );
    let step = |quarters| mean_step(&job, &placement, &policy, &opts, quarters);
    let (half, chosen) = (step(2), step(choice.widening_quarters));
    assert!(chosen < half, "{chosen} s against {half} s");
}

/// The mean step of the job run on `opts`'s seed at a window widened by `quarters`.
fn mean_step(
    job: &rollfleet_spec::ValidatedJob,
    placement: &rollfleet_core::Placement,
    policy: &rollfleet_core::Policy,
    opts: &SimOptions,
    quarters: i32,
) -> f64 {
    let policy = rollfleet_core::Policy {
        window_widening_quarters: quarters,
        ..policy.clone()
    };
    let run = simulate(
        job.spec(),
        &job.catalog,
        placement.clone(),
        policy,
        opts,
        &mut |_, _| {},
    )
    .unwrap();
    assert!(run.violations.is_empty(), "{:?}", run.violations);
    run.makespan_s / run.publish_times_s.len() as f64
}

#[test]
fn a_batched_policy_has_no_window_to_choose() {
    let job = rollfleet_spec::load_job_file(&example("quickstart.yaml")).unwrap();
    let (placement, policy) = Baseline::OneStepOff
        .setup(
            job.spec(),
            &job.catalog,
            &rollfleet_sim::sim::workload_means(job.spec()),
        )
        .unwrap();
    let choice = choose_window(
        job.spec(),
        &job.catalog,
        &placement,
        &policy,
        &SimOptions::default(),
    )
    .unwrap();
    assert_eq!(choice.widening_quarters, 0);
    assert!(choice.probes.is_empty());
}

#[test]
fn the_report_gives_rollfleets_window_and_its_trials_and_no_window_to_the_baselines() {
    let args = SimArgs {
        baselines: vec![Baseline::OneStepOff, Baseline::Rollfleet],
        ..SimArgs::new(example("quickstart.yaml"))
    };
    let mut out = Vec::new();
    let mut err = Vec::new();
    rollfleet_sim::run(&args, OutputFormat::Json, &mut out, &mut err).unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let policies = report["policies"].as_array().unwrap();
    let by_name = |name: &str| {
        policies
            .iter()
            .find(|p| p["policy"] == name)
            .unwrap()
            .clone()
    };
    let window = &by_name("rollfleet")["admission_window"];
    // The widths always tried come first; a narrower or a wider one may follow.
    let widths: Vec<i64> = window["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["widening_quarters"].as_i64().unwrap())
        .collect();
    assert_eq!(
        widths[..WIDENINGS.len()],
        WIDENINGS.map(i64::from),
        "{window}"
    );
    assert!(window["widening_quarters"].as_i64().is_some(), "{window}");
    assert!(by_name("one-step-off")["admission_window"].is_null());
    let progress = String::from_utf8(err).unwrap();
    assert!(
        progress.contains("rollfleet: admission window "),
        "{progress}"
    );
}

/// Trials that run `steps[q]` seconds a step for widening `q` on every seed, or fail where it
/// is `None`; a width past the list runs a second slower than the widest listed.
fn trials(steps: &[Option<f64>]) -> impl FnMut(i32, u64) -> Result<f64, RunError> {
    move |quarters, _seed| {
        let step = match steps.get(quarters as usize) {
            Some(&step) => step,
            None => steps.last().copied().flatten().map(|s| s + 1.0),
        };
        step.ok_or(RunError::TooLong(1.0))
    }
}

fn tried(choice: &rollfleet_sim::window::WindowChoice) -> Vec<i32> {
    choice.probes.iter().map(|p| p.widening_quarters).collect()
}

#[test]
fn a_widened_width_whose_trial_fails_is_passed_over_and_its_probe_says_why() {
    let choice = choose_among(trials(&[Some(10.0), None, Some(12.0)]), &[1, 2], 0).unwrap();
    assert_eq!(choice.widening_quarters, 0, "{choice:?}");
    let failed = &choice.probes[1];
    assert_eq!(failed.step_s, None);
    assert!(
        failed.failed.as_deref().is_some_and(|why| !why.is_empty()),
        "{failed:?}"
    );
    assert!(
        choice.describe().contains("rule + 1/4 batch failed ("),
        "{}",
        choice.describe()
    );

    // Past the failed width, a faster one is still chosen.
    let choice = choose_among(trials(&[Some(10.0), None, Some(9.0)]), &[1, 2], 0).unwrap();
    assert_eq!(choice.widening_quarters, 2, "{choice:?}");
}

#[test]
fn a_failed_trial_of_the_rule_is_the_error_and_a_tie_goes_to_the_narrower_window() {
    assert!(choose_among(trials(&[None, Some(9.0), Some(9.0)]), &[1], 0).is_err());
    let choice = choose_among(trials(&[Some(11.0), Some(9.0), Some(9.0)]), &[1], 0).unwrap();
    assert_eq!(choice.widening_quarters, 1, "{choice:?}");
}

#[test]
fn each_width_is_tried_on_every_seed_and_scored_by_its_mean() {
    let mut tried = Vec::new();
    let choice = choose_among(
        |quarters, seed| {
            tried.push((quarters, seed));
            // The rule: 10 and 14 (mean 12); a quarter: 8 and 17 (mean 12.5); a half: 13.
            Ok(match (quarters, seed) {
                (0, 1) => 10.0,
                (0, _) => 14.0,
                (1, 1) => 8.0,
                (1, _) => 17.0,
                _ => 13.0,
            })
        },
        &[1, 2],
        0,
    )
    .unwrap();
    assert_eq!(tried.len(), WIDENINGS.len() * 2);
    assert_eq!(choice.widening_quarters, 0, "{choice:?}");
    assert_eq!(choice.probes[1].step_s, Some(12.5));
}

#[test]
fn a_wider_window_is_tried_while_each_quarter_more_is_faster_by_the_gain() {
    // Half a batch is the fastest of the widths always tried, three quarters is 10% faster
    // still, and a whole batch only 0.5% faster than that: three quarters is chosen, and
    // nothing past a whole batch is tried, however fast it would be.
    let steps = [12.0, 11.0, 10.0, 9.0, 8.955, 5.0].map(Some);
    let choice = choose_among(trials(&steps), &[1, 2], 0).unwrap();
    assert_eq!(choice.widening_quarters, 3, "{choice:?}");
    assert_eq!(tried(&choice), [0, 1, 2, 3, 4]);
    assert!(
        choice
            .describe()
            .contains("rule + 3/4 batch 9.0 s (chosen)")
            && choice.describe().contains("rule + 1 batch 9.0 s"),
        "{}",
        choice.describe()
    );
}

#[test]
fn no_width_past_half_a_batch_is_tried_unless_half_a_batch_is_the_fastest() {
    let choice = choose_among(trials(&[10.0, 9.0, 9.5, 1.0].map(Some)), &[1, 2], 0).unwrap();
    assert_eq!(choice.widening_quarters, 1, "{choice:?}");
    assert_eq!(tried(&choice), WIDENINGS);
    // A failed half batch is not the fastest either.
    let choice = choose_among(trials(&[Some(10.0), Some(9.0), None, Some(1.0)]), &[1], 0).unwrap();
    assert_eq!(tried(&choice), WIDENINGS);
}

#[test]
fn the_widening_stops_at_two_batches_over_the_rule() {
    let steps: Vec<Option<f64>> = (0..20).map(|q| Some(100.0 - 5.0 * f64::from(q))).collect();
    let choice = choose_among(trials(&steps), &[1], 0).unwrap();
    assert_eq!(MAX_WIDENING_QUARTERS, 8);
    assert_eq!(
        choice.widening_quarters, MAX_WIDENING_QUARTERS,
        "{choice:?}"
    );
    assert_eq!(
        tried(&choice),
        (0..=MAX_WIDENING_QUARTERS).collect::<Vec<_>>()
    );
    assert!(
        choice
            .describe()
            .contains("rule + 2 batches 60.0 s (chosen)"),
        "{}",
        choice.describe()
    );
}

#[test]
fn where_the_rule_wins_a_narrower_window_is_tried_while_each_quarter_less_is_faster_by_the_gain() {
    // Wider windows are slower; a quarter narrower is 10% faster, half a batch 11% faster
    // still, three quarters only 1.25% faster than that (less than the narrowing's gain): half a
    // batch narrower is chosen.
    let step = |quarters: i32| match quarters {
        0 => 10.0,
        1 => 11.0,
        2 => 12.0,
        -1 => 9.0,
        -2 => 8.0,
        -3 => 7.9,
        _ => 1.0,
    };
    let choice = choose_among(|q, _| Ok(step(q)), &[1, 2], -4).unwrap();
    assert_eq!(choice.widening_quarters, -2, "{choice:?}");
    assert_eq!(tried(&choice), [0, 1, 2, -1, -2, -3]);
    assert!(
        choice
            .describe()
            .contains("rule - 1/2 batch 8.0 s (chosen)"),
        "{}",
        choice.describe()
    );
    // Never past the narrowest window the job allows, however fast it would be.
    let choice = choose_among(|q, _| Ok(10.0 + f64::from(q)), &[1], -2).unwrap();
    assert_eq!(choice.widening_quarters, -2, "{choice:?}");
    assert_eq!(tried(&choice), [0, 1, 2, -1, -2]);
    // Where the rule's window is already one training batch, nothing narrower is tried.
    let choice = choose_among(|q, _| Ok(10.0 + f64::from(q)), &[1], 0).unwrap();
    assert_eq!(tried(&choice), WIDENINGS);
}

#[test]
fn a_window_narrows_no_further_than_one_training_batch() {
    // The RollArt-like job: batches of 1024 at `maxStaleness: 2`, a rule of one batch and
    // training batches of 256, so three quarters narrower is one training batch.
    let (job, _, policy) = planned("rollart-agentic.yaml");
    assert_eq!(narrowest_quarters(job.spec(), &policy), -3);
    // The quick-start's rule is one training batch already.
    let (quick, _, quick_policy) = planned("quickstart.yaml");
    let terms = |q| {
        rollfleet_core::Core::admission_window(
            quick.spec().rl.rollout_batch_size as u64,
            quick.spec().rl.train_batch_size as u64,
            quick.spec().rl.group_size as u64,
            quick_policy.max_staleness,
            quick_policy.over_provisioning,
            quick_policy.cap_over_provisioning,
            q,
        )
    };
    let narrowest = narrowest_quarters(quick.spec(), &quick_policy);
    assert_eq!(terms(narrowest - 1).window, terms(narrowest).window);
    assert!(narrowest == 0 || terms(narrowest).window < terms(0).window);
}
