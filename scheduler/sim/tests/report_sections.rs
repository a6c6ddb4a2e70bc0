//! The simulator's report beyond the step times, as JSON and as the table prints it: the checks
//! line (finished groups that expired waiting for the trainer, KV caches evicted, how busy the
//! trainer was), the steps section and the decode section.
#![allow(clippy::unwrap_used)]

use rollfleet_sim::{Baseline, SimArgs};

mod common;
use common::{example, json_and_table, quickstart_args, table_section};

#[test]
fn the_checks_count_the_finished_groups_that_expired_waiting_for_the_trainer() {
    // The held-out math-and-code job at `maxStaleness: 1`: rollfleet's wide window leaves
    // finished groups waiting for the trainer past the bound; sync never has one waiting.
    let args = SimArgs {
        job: example("holdout-math-code.yaml"),
        baselines: vec![Baseline::Sync, Baseline::Rollfleet],
        ..quickstart_args()
    };
    let (report, table) = json_and_table(&args);
    let core = &report["policies"][1]["core"];
    let expired = core["groups_expired_waiting"].as_u64().unwrap();
    let trained: u64 = core["task_lives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["groups"].as_u64().unwrap())
        .sum();
    assert!(expired > 0 && trained > 0, "{core}");
    // Each of them generated again: every member with a turn of the expired weights, at least
    // one of its sixteen.
    let regenerated = core["regenerated_at_consumption"].as_u64().unwrap();
    assert!((expired..=expired * 16).contains(&regenerated), "{core}");
    assert_eq!(
        report["policies"][0]["core"]["groups_expired_waiting"].as_u64(),
        Some(0)
    );

    let checks = |policy: &str| {
        table
            .lines()
            .find(|l| l.starts_with(&format!("  {policy} ")) && l.contains("invariants"))
            .unwrap()
            .to_owned()
    };
    let share = 100.0 * expired as f64 / trained as f64;
    assert!(
        checks("rollfleet").contains(&format!(
            "{expired} finished groups ({share:.0}% of those trained) expired waiting for the \
             trainer"
        )),
        "{table}"
    );
    assert!(!checks("sync").contains("expired"), "{table}");
}

/// The report gives every step's time, first to last, adding up to the run; the table's steps
/// section gives each policy's first step, its steady steps' shortest, mean and longest, and
/// its last, as the JSON has them.
#[test]
fn the_steps_section_shows_the_first_the_steady_and_the_last_step_of_each_policy() {
    let args = SimArgs {
        steps: Some(6),
        baselines: vec![Baseline::Sync, Baseline::Rollfleet],
        ..quickstart_args()
    };
    let (report, table) = json_and_table(&args);
    let section = table_section(&table, "steps (seconds");
    assert_eq!(section.len(), 4, "{table}");
    for policy in report["policies"].as_array().unwrap() {
        let name = policy["policy"].as_str().unwrap();
        let steps: Vec<f64> = policy["step_times_s"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_f64().unwrap())
            .collect();
        assert_eq!(steps.len(), 6, "{name}");
        let total = policy["total_s"].as_f64().unwrap();
        assert!((steps.iter().sum::<f64>() - total).abs() < 1e-6, "{name}");
        // Six steps: the first and the last are warm-up and drain, the four between steady.
        let steady = &steps[1..5];
        let mean = steady.iter().sum::<f64>() / 4.0;
        let steady_mean = policy["steady_step_time_s"].as_f64().unwrap();
        assert!((mean - steady_mean).abs() < 1e-6, "{name}");
        let shortest = steady.iter().copied().fold(f64::INFINITY, f64::min);
        let longest = steady.iter().copied().fold(0.0, f64::max);
        let row = section
            .iter()
            .find(|l| l.starts_with(&format!("  {name} ")))
            .unwrap_or_else(|| panic!("no steps row for {name}: {table}"));
        let cells: Vec<&str> = row.split_whitespace().skip(1).collect();
        let expected: Vec<String> = [steps[0], shortest, mean, longest, steps[5]]
            .iter()
            .map(|s| format!("{s:.1}"))
            .collect();
        assert_eq!(cells, expected, "{row}");
    }
}

/// Each GPU pool that served reports how its replicas decoded: the pool's batch and time a
/// token took, its busiest and slowest replica's at least as large, the run's own time a token
/// took among the pools'; a pool that only trains, and a CPU pool, report none. The table has
/// a row per decoding pool and policy.
#[test]
fn each_serving_pool_reports_its_decode_beside_its_busiest_and_slowest_replica() {
    let args = SimArgs {
        baselines: vec![Baseline::Sync, Baseline::Rollfleet],
        ..quickstart_args()
    };
    let (report, table) = json_and_table(&args);
    let section = table_section(&table, "decode per GPU pool");
    let mut rows = 0;
    for policy in report["policies"].as_array().unwrap() {
        let name = policy["policy"].as_str().unwrap();
        let run_s_per_token = policy["decode_s_per_token"].as_f64().unwrap();
        let (mut fastest, mut slowest) = (f64::INFINITY, 0.0_f64);
        for pool in policy["pools"].as_array().unwrap() {
            let decode = &pool["decode"];
            if pool["kind"] != "gpu" || !pool["use_"].as_str().unwrap().contains("generate") {
                assert!(decode.is_null(), "{name}: {pool}");
                continue;
            }
            let field = |k: &str| decode[k].as_f64().unwrap();
            assert!(decode["replicas"].as_u64().unwrap() >= 1, "{pool}");
            assert!(field("batch") >= 1.0, "{pool}");
            assert!(
                field("busiest_replica_batch") >= field("batch") - 1e-9,
                "{pool}"
            );
            assert!(
                field("slowest_replica_s_per_token") >= field("s_per_token") - 1e-12,
                "{pool}"
            );
            fastest = fastest.min(field("s_per_token"));
            slowest = slowest.max(field("s_per_token"));
            let row = section
                .iter()
                .find(|l| {
                    l.split_whitespace().take(2).collect::<Vec<_>>()
                        == [name, pool["name"].as_str().unwrap()]
                })
                .unwrap_or_else(|| panic!("no decode row for {name}: {table}"));
            let cells: Vec<&str> = row.split_whitespace().skip(2).collect();
            assert_eq!(cells[0], decode["replicas"].to_string(), "{row}");
            assert_eq!(
                cells[3],
                format!("{:.2}", field("s_per_token") * 1000.0),
                "{row}"
            );
            rows += 1;
        }
        assert!(
            (fastest - 1e-12..=slowest + 1e-12).contains(&run_s_per_token),
            "{name}: {run_s_per_token} outside {fastest}..{slowest}"
        );
    }
    assert!(rows >= 2, "{table}");
    assert_eq!(section.len(), rows + 2, "{table}");
}

/// The trainer's load: a batch for every training command the core gave, its busy share of the
/// run, and the shortest, mean and longest batch, as the checks line prints them.
#[test]
fn the_checks_give_how_busy_the_trainer_was_and_how_long_its_batches_took() {
    let args = SimArgs {
        baselines: vec![Baseline::Sync, Baseline::Rollfleet],
        ..quickstart_args()
    };
    let (report, table) = json_and_table(&args);
    let checks = table_section(&table, "placement and checks");
    for policy in report["policies"].as_array().unwrap() {
        let name = policy["policy"].as_str().unwrap();
        let trainer = &policy["trainer"];
        let field = |k: &str| trainer[k].as_f64().unwrap();
        assert_eq!(
            trainer["batches"].as_u64(),
            policy["core"]["train_batches"].as_u64(),
            "{name}: {trainer}"
        );
        assert!(
            0.0 < field("busy_share") && field("busy_share") <= 1.0,
            "{trainer}"
        );
        assert!(
            field("batch_s_min") <= field("batch_s_mean")
                && field("batch_s_mean") <= field("batch_s_max"),
            "{trainer}"
        );
        // The mean batch times the batches is the trainer's busy time.
        let busy = field("batch_s_mean") * field("batches");
        let total = policy["total_s"].as_f64().unwrap();
        assert!(
            (busy / total - field("busy_share")).abs() < 1e-9,
            "{trainer}"
        );
        let line = checks
            .iter()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no checks line for {name}: {table}"));
        assert!(
            line.contains(&format!(
                "trainer busy {:.0}% of the run over {} batches, a batch {:.1} / {:.1} / {:.1} s",
                100.0 * field("busy_share"),
                trainer["batches"],
                field("batch_s_min"),
                field("batch_s_mean"),
                field("batch_s_max")
            )),
            "{line}"
        );
    }
}

/// A 32B policy on one H800 replica of eight GPUs, with a window of hundreds of long-context
/// trajectories: its KV cache holds a fraction of them, so they push one another's caches out.
const KV_BOUND_JOB: &str = r#"
apiVersion: rollfleet.dev/v1alpha1
kind: RLJob
metadata: { name: kv-bound }
spec:
  model: { name: Qwen3-32B, parameters: 32.8e9, layers: 64, hiddenSize: 5120, kvHeads: 8, headDim: 128 }
  rl: { groupSize: 8, rolloutBatchSize: 256, trainBatchSize: 128, maxStaleness: 2, overProvisioning: 0.25, steps: 2 }
  tasks:
    - name: swe
      environment: sokoban
      share: 1.0
      maxTurns: 30
      turns: { distribution: uniform, min: 8, max: 30 }
      promptTokens: { distribution: lognormal, median: 3000, p99: 9000, max: 12000 }
      actionTokens: { distribution: lognormal, median: 300, p99: 2000, max: 4096 }
      observationTokens: { distribution: lognormal, median: 600, p99: 4000, max: 8000 }
      contextLimit: 65536
      envStepMs: { distribution: lognormal, median: 2500, p99: 30000, max: 120000 }
      reward: env-score
  rewards:
    - { name: env-score, runsOn: environment, latencyMs: 0 }
  pools:
    - { name: h800, gpu: H800, count: 16 }
    - { name: cpu, cpu: c7i.16xlarge, count: 8 }
"#;

#[test]
fn the_checks_say_how_many_kv_caches_were_evicted_when_the_decode_replicas_cannot_hold_the_window()
{
    let job = std::env::temp_dir().join(format!("rollfleet-kv-bound-{}.yaml", std::process::id()));
    std::fs::write(&job, KV_BOUND_JOB).unwrap();
    let args = SimArgs {
        baselines: vec![Baseline::Rollfleet],
        ..SimArgs::new(job.clone())
    };
    let (report, table) = json_and_table(&args);
    std::fs::remove_file(&job).unwrap();
    let core = &report["policies"][0]["core"];
    let evicted = core["kv_evictions"].as_u64().unwrap();
    let finished = core["trajectories_completed"].as_u64().unwrap();
    assert!(evicted > finished, "{core}");
    let checks = table_section(&table, "placement and checks:");
    let line = checks.iter().find(|l| l.contains("rollfleet")).unwrap();
    assert!(
        line.contains(&format!(
            "; {evicted} KV caches evicted ({:.1} a finished trajectory",
            evicted as f64 / finished as f64
        )),
        "{line}"
    );
    // A fleet with room for its window evicts nothing and says nothing of it.
    let (quick, quick_table) = json_and_table(&quickstart_args());
    for policy in quick["policies"].as_array().unwrap() {
        assert_eq!(policy["core"]["kv_evictions"].as_u64(), Some(0), "{policy}");
    }
    assert!(!quick_table.contains("KV caches evicted"), "{quick_table}");
}
