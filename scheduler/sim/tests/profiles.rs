//! Measured profiles from the simulator: every simulated prefill batch and decode iteration is
//! reported as a sample per (work kind, pool), every environment step and reward as a duration
//! per task and reward function, and a store measured on a run corrects the planner's
//! prediction where the planner's assumed efficiencies are wrong.
#![allow(clippy::unwrap_used)]

use rollfleet_planner::plan;
use rollfleet_planner::predict;
use rollfleet_planner::profile::Source;
use rollfleet_planner::roofline::{Efficiency, WorkKind};
use rollfleet_planner::search;
use rollfleet_sim::Baseline;
use rollfleet_sim::hardware::HardwareModel;
use rollfleet_sim::report::policy_report;
use rollfleet_sim::sim::{SimOptions, simulate, workload_means};
use rollfleet_sim::workload::mean;

/// One single-turn trajectory per step on a made-up GPU of 1 PFLOP/s and 1 TB/s: a 1,000-token
/// prompt (2e12 FLOP, 2 GB of weights read) and 100 decoded tokens, one at a time.
const HAND_JOB: &str = r#"
apiVersion: rollfleet.dev/v1alpha1
kind: RLJob
metadata: { name: hand }
spec:
  model: { name: toy, parameters: 1.0e9, layers: 1, hiddenSize: 8, kvHeads: 1, headDim: 8 }
  rl: { groupSize: 1, rolloutBatchSize: 1, trainBatchSize: 1, maxStaleness: 1, steps: 2, trainMfu: 0.5 }
  tasks:
    - { name: t, environment: sokoban, share: 1.0, maxTurns: 1, promptTokens: 1000, actionTokens: 100,
        observationTokens: 10, contextLimit: 4096, envStepMs: 1000, reward: r }
  rewards:
    - { name: r, runsOn: environment, latencyMs: 0 }
  network: { crossPoolGBps: 25 }
  catalog:
    gpus:
      - { name: T1, bf16DenseTflops: 1000, memoryGb: 100, memoryBandwidthGBps: 1000,
          interconnectGBps: 100, pricePerHourUsd: 1, source: test }
  pools:
    - { name: gen, gpu: T1, count: 1, roles: [generate] }
    - { name: train, gpu: T1, count: 1, roles: [train] }
    - { name: envs, cpu: c7i.8xlarge, count: 1 }
"#;

fn slow_hardware() -> HardwareModel {
    HardwareModel {
        compute_efficiency: 0.45,
        bandwidth_efficiency: 0.6,
        ..HardwareModel::default()
    }
}

#[test]
fn the_simulator_reports_prefill_and_decode_at_the_hardwares_share_of_peak_and_environment_steps_as_drawn()
 {
    let job = rollfleet_spec::parse_job(HAND_JOB.as_bytes(), "hand.yaml").unwrap();
    let spec = job.spec().clone();
    let (placement, policy) = Baseline::Rollfleet
        .setup(&spec, &job.catalog, &workload_means(&spec))
        .unwrap();
    let opts = SimOptions {
        hardware: slow_hardware(),
        ..SimOptions::default()
    };
    let run = simulate(
        &spec,
        &job.catalog,
        placement,
        policy,
        &opts,
        &mut |_, _| {},
    )
    .unwrap();
    // Prefill alone on the replica: 2e12 FLOP at 0.45 PFLOP/s = 4.44 ms against the 2 ms both
    // roofs give at peak (2e12 / 1e15 and 2e9 / 1e12): 45% of peak FLOP/s. (The 32-byte-per-token
    // KV cache and the attention FLOPs make the bytes roof, 2.000032 ms, the higher one at peak
    // by 8 parts in a million; the share is still of FLOP/s, which binds in the simulation.)
    let prefill = &run.profiles.measured[&WorkKind::Prefill]["gen"];
    assert_eq!(prefill.samples.len(), 2, "one prefill batch per step");
    for s in &prefill.samples {
        assert!((s - 0.45).abs() < 1e-9, "{s}");
    }
    // Decode of one sequence reads the 2 GB of weights per token: 2 GB at 0.6 TB/s against 2 ms
    // at peak: 60% of peak, one sample per stretch at a constant batch.
    let decode = &run.profiles.measured[&WorkKind::Decode]["gen"];
    assert!(!decode.samples.is_empty());
    for s in &decode.samples {
        assert!((s - 0.6).abs() < 1e-9, "{s}");
    }
    assert!(!run.profiles.measured[&WorkKind::Decode].contains_key("train"));
    // The one environment step of each step's trajectory (the reset is not one) takes the
    // spec's 1,000 ms, and says it was simulated.
    let env = &run.profiles.environment_steps["t"];
    assert_eq!((env.total, env.modelled), (2, 2));
    assert!(
        env.samples.iter().all(|&s| (s - 1.0).abs() < 1e-12),
        "{env:?}"
    );
}

/// Plans `job` with the model, simulates the plan on `hardware`, and predicts the same placement
/// again with the profile that run measured: (simulated, model prediction, measured prediction)
/// seconds per step, averaged over the job's steps.
fn before_and_after(job: &str, hardware: HardwareModel) -> (f64, f64, f64) {
    let path = format!(
        "{}/../../examples/jobs/{job}.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let name = job;
    let job = rollfleet_spec::load_job_file(std::path::Path::new(&path)).unwrap();
    let spec = job.spec().clone();
    let model = plan::problem(&spec, &job.catalog, &mean, &Efficiency::default()).unwrap();
    let found = search::choose(&model).unwrap();
    let planned = plan::describe(&spec, &model, &found.candidate, found.nodes).unwrap();
    let (placement, policy) = Baseline::Rollfleet
        .setup_with(&spec, &job.catalog, planned.placement.clone())
        .unwrap();
    let opts = SimOptions {
        hardware,
        ..SimOptions::default()
    };
    let run = simulate(
        &spec,
        &job.catalog,
        placement,
        policy,
        &opts,
        &mut |_, _| {},
    )
    .unwrap();
    assert!(run.violations.is_empty(), "{:?}", run.violations);
    let reference = rollfleet_sim::reference::reference(&spec, &job.catalog, &hardware, 0);
    let simulated = policy_report(
        "rollfleet",
        &spec,
        &job.catalog,
        &hardware,
        &run,
        &reference,
    )
    .step_time_s;
    let measured = plan::problem_profiled(
        &spec,
        &job.catalog,
        &mean,
        &Efficiency::default(),
        &run.profiles,
    )
    .unwrap();
    // Every GPU pool that decoded now predicts with its measured share, not the model's.
    for g in &measured.gpu_pools {
        if run.profiles.measured[&WorkKind::Decode].contains_key(&g.name) {
            assert_eq!(g.profile[1].source, Source::Measured, "{}", g.name);
            assert!(
                (g.profile[1].share - hardware.bandwidth_efficiency).abs() < 0.01,
                "{}",
                g.name
            );
        }
    }
    let after = predict::predict(&measured, &found.candidate)
        .unwrap()
        .job_step_s;
    let before = planned.prediction.job_step_s;
    eprintln!(
        "{}: simulated (compute {:.0}%, bandwidth {:.0}% of peak) {simulated:.3} s/step; \
         predicted {before:.3} s with the model ({:+.1}%), {after:.3} s with the measured \
         profile ({:+.1}%)",
        name,
        hardware.compute_efficiency * 100.0,
        hardware.bandwidth_efficiency * 100.0,
        (before / simulated - 1.0) * 100.0,
        (after / simulated - 1.0) * 100.0
    );
    (simulated, before, after)
}

#[test]
fn a_profile_measured_on_slower_simulated_hardware_moves_the_prediction_toward_the_simulated_step()
{
    let (simulated, before, after) = before_and_after("quickstart", slow_hardware());
    assert!(after > before, "slower hardware predicts a slower step");
    assert!(
        (after - simulated).abs() < (before - simulated).abs(),
        "before {before}, after {after}, simulated {simulated}"
    );
}

#[test]
#[ignore = "two runs of the RollArt-like job: about 25 s in a debug build"]
fn on_the_rollart_like_job_a_measured_profile_moves_the_prediction_toward_the_simulated_step() {
    // With the simulator's default hardware the measured decode shares equal the planner's
    // assumption (80%, checked in `before_and_after`); a prefill that runs beside decode on the
    // same replica gets the compute decode leaves (52% of peak on the H20s, not 60%), so the
    // prediction may move, and only toward the simulated step.
    let (simulated, before, after) = before_and_after("rollart-agentic", HardwareModel::default());
    // Issue #4's target: the plan's predicted step within 10% of the simulated one. (Until the
    // full prediction counted the burst of refills after every weight update, 2026-11-23, it was
    // 3% below; now it is 4% above.)
    assert!(
        (before / simulated - 1.0).abs() < 0.10,
        "predicted {before}, simulated {simulated}"
    );
    assert!(
        (after - simulated).abs() <= (before - simulated).abs(),
        "before {before}, after {after}, simulated {simulated}"
    );
    let (simulated, before, after) = before_and_after("rollart-agentic", slow_hardware());
    assert!(
        (after - simulated).abs() < (before - simulated).abs(),
        "before {before}, after {after}, simulated {simulated}"
    );
}
