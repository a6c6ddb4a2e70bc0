//! Planner benchmark (`cargo bench -p rollfleet-planner`): a `harness = false` bench that prints
//! medians. Plans the RollArt-like job (a 32B policy) on a 3,000-GPU, 10-pool inventory of eight
//! GPU products, and reports the wall time of the exact search. `ROLLFLEET_BENCH_RUNS` sets the
//! repetitions (default 5).

use std::path::PathBuf;
use std::time::Instant;

use rollfleet_planner::plan;
use rollfleet_spec::{Distribution, PoolSpec};

fn pool(name: &str, gpu: &str, count: i64) -> PoolSpec {
    PoolSpec {
        name: name.into(),
        gpu: Some(gpu.into()),
        cpu: None,
        serverless: None,
        count: Some(count),
        gpus_per_node: None,
        concurrency: None,
        roles: Vec::new(),
        kubernetes: None,
    }
}

fn main() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/jobs/rollart-agentic.yaml");
    let job = match rollfleet_spec::load_job_file(&path) {
        Ok(job) => job,
        Err(e) => {
            eprintln!("{e}");
            return;
        }
    };
    let mut spec = job.spec().clone();
    let others: Vec<PoolSpec> = spec
        .pools
        .iter()
        .filter(|p| p.gpu.is_none())
        .cloned()
        .collect();
    let mut pools = vec![
        pool("h800-a", "H800", 600),
        pool("h20-a", "H20", 800),
        pool("h100", "H100", 300),
        pool("h200", "H200", 200),
        pool("b200", "B200", 200),
        pool("a100", "A100-80G", 300),
        pool("l20", "L20", 200),
        pool("l40s", "L40S", 200),
        pool("h800-b", "H800", 100),
        pool("h20-b", "H20", 100),
    ];
    let gpus: i64 = pools.iter().filter_map(|p| p.count).sum();
    pools.extend(others);
    spec.pools = pools;
    // Trace columns have no closed-form mean here (the trace lives in the simulator); a fixed
    // stand-in of 500 tokens is enough to time the search.
    let mean = |d: &Distribution| d.mean().unwrap_or(500.0);
    let runs: usize = std::env::var("ROLLFLEET_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let mut walls = Vec::new();
    let mut last = None;
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        let result = plan::plan(&spec, &job.catalog, &mean);
        walls.push(start.elapsed().as_secs_f64());
        last = Some(result);
    }
    walls.sort_by(f64::total_cmp);
    let median = walls[walls.len() / 2];
    match last {
        Some(Ok(p)) => {
            println!(
                "plan: {gpus} GPUs in 10 pools: median {:.1} ms over {} runs (min {:.1}, max {:.1}); {} search nodes; predicted step {:.1} s",
                median * 1e3,
                walls.len(),
                walls[0] * 1e3,
                walls[walls.len() - 1] * 1e3,
                p.search_nodes,
                p.prediction.step_s
            );
            for r in &p.roles {
                println!("  {} on {}: {} x TP{}", r.role, r.pool, r.replicas, r.tp);
            }
        }
        Some(Err(e)) => eprintln!("plan failed: {e}"),
        None => {}
    }
}
