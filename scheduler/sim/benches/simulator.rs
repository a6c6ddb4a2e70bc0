//! Simulator benchmarks (`cargo bench -p rollfleet-sim`): a `harness = false` bench that prints
//! medians, so it needs no benchmarking framework.
//!
//! - scheduler events per second of wall time, on the RollArt-like example (every policy, on the
//!   core's default placement, and rollfleet on the planner's, which `rollfleet sim` runs);
//! - the time to simulate one RL step of a 3,000-GPU job with 100,000 trajectories in flight
//!   (`benches/scale-3000.yaml`).
//!
//! `ROLLFLEET_BENCH_RUNS` sets the repetitions (default 3). A plain argument
//! (`cargo bench -p rollfleet-sim -- rollfleet`) keeps only the benches whose name contains it, so a
//! profiler can look at one policy alone.

use std::path::PathBuf;
use std::time::Instant;

use rollfleet_sim::placement::choose;
use rollfleet_sim::sim::{SimOptions, simulate, workload_means};
use rollfleet_sim::{Baseline, PlacementChoice};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench(name: &str, path: PathBuf, baseline: Baseline, on_plan: bool, runs: usize) {
    // Cargo passes `--bench` to a harness-less bench; only a plain word selects.
    let selected = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with('-'))
        .all(|filter| name.contains(&filter));
    if !selected {
        return;
    }
    let job = match rollfleet_spec::load_job_file(&path) {
        Ok(job) => job,
        Err(e) => {
            eprintln!("{name}: {e}");
            return;
        }
    };
    let spec = job.spec();
    let mut walls = Vec::new();
    let mut rates = Vec::new();
    let mut last = None;
    for _ in 0..runs {
        // Planning happens before the clock starts: only the simulated run is timed.
        let setup = if on_plan {
            choose(PlacementChoice::Plan, spec, &job.catalog)
                .ok()
                .and_then(|(placement, _)| baseline.setup_with(spec, &job.catalog, placement).ok())
        } else {
            baseline
                .setup(spec, &job.catalog, &workload_means(spec))
                .ok()
        };
        let Some((placement, policy)) = setup else {
            eprintln!("{name}: no placement");
            return;
        };
        let start = Instant::now();
        let run = simulate(
            spec,
            &job.catalog,
            placement,
            policy,
            &SimOptions::default(),
            &mut |_, _| {},
        );
        let wall = start.elapsed().as_secs_f64();
        match run {
            Ok(run) => {
                walls.push(wall);
                rates.push(run.scheduler_events as f64 / wall);
                last = Some(run);
            }
            Err(e) => {
                eprintln!("{name}: {e}");
                return;
            }
        }
    }
    if let Some(run) = last {
        println!(
            "{name:<44} median {:>7.3} s wall | {:>9} scheduler events, {:>9} sim events | {:>5.2} M scheduler events/s | {} trajectories started, {:.0} virtual s",
            median(walls),
            run.scheduler_events,
            run.sim_events,
            median(rates) / 1e6,
            run.lifecycle.0,
            run.makespan_s,
        );
    }
}

fn main() {
    let runs = std::env::var("ROLLFLEET_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3usize)
        .max(1);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let rollart = root.join("../../examples/jobs/rollart-agentic.yaml");
    for baseline in Baseline::ALL {
        bench(
            &format!("rollart-agentic, 20 steps, {}", baseline.name()),
            rollart.clone(),
            baseline,
            false,
            runs,
        );
    }
    bench(
        "rollart-agentic, 20 steps, rollfleet, on the plan",
        rollart.clone(),
        Baseline::Rollfleet,
        true,
        runs,
    );
    bench(
        "scale-3000 (3,000 GPUs, 100k in flight), 1 step",
        root.join("benches/scale-3000.yaml"),
        Baseline::Rollfleet,
        false,
        runs,
    );
}
