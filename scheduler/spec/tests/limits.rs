//! The limits that keep a job spec cheap to handle: how large and how deeply nested a document
//! may be before the YAML parser sees it, and how large every figure of a job may be before the
//! planner and the simulator do. Each bound is named with its field and its reason, and every
//! real job in the repository stays within all of them.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

mod common;

use std::path::{Path, PathBuf};

use rollfleet_spec::{
    MAX_NESTING, MAX_SPEC_BYTES, SpecError, load_job_file, parse_job, parse_yaml,
};

use common::{edit, problems_of, quickstart, repo_root};

fn assert_problem(text: &str, expected: &str) {
    let problems = problems_of(text);
    assert!(
        problems.iter().any(|p| p == expected),
        "expected `{expected}`, got {problems:#?}"
    );
}

/// `a: [[[...]]]`, `bytes` long.
fn nested_flow(bytes: usize) -> String {
    let depth = (bytes - 4) / 2;
    format!("a: {}{}\n", "[".repeat(depth), "]".repeat(depth))
}

#[test]
fn a_deeply_nested_document_is_refused_before_parsing_with_the_limit_named() {
    // 200 KB of nested brackets: the YAML parser alone would take about a minute.
    let text = nested_flow(200 * 1024);
    let error = parse_job(text.as_bytes(), "nested.yaml").unwrap_err();
    assert!(
        matches!(
            error,
            SpecError::TooDeep {
                line: 1,
                limit: 64,
                ..
            }
        ),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .starts_with("nested.yaml: line 1: nested deeper than 64 levels;"),
        "{error}"
    );
    assert_eq!(MAX_NESTING, 64);
}

#[test]
fn an_unclosed_nest_spread_over_lines_is_refused_at_the_line_where_it_gets_too_deep() {
    // Inside `spec.model` (two block levels), one bracket per line: the 63rd bracket, on line
    // 66, is the 65th level.
    let text = quickstart().replace(
        "  model:\n",
        &format!("  model:\n    extra:\n{}", "      [\n".repeat(100)),
    );
    let error = parse_job(text.as_bytes(), "job.yaml").unwrap_err();
    let expected_line = text
        .lines()
        .position(|l| l == "  model:")
        .map(|model| model + 1 + 1 + 62)
        .unwrap();
    match error {
        SpecError::TooDeep { line, limit, .. } => {
            assert_eq!((line, limit), (expected_line, 64));
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_deep_block_indentation_is_refused_like_a_deep_flow_nest() {
    let mut text = String::new();
    for level in 0..100 {
        text.push_str(&" ".repeat(level));
        text.push_str("k:\n");
    }
    let error = parse_job(text.as_bytes(), "indented.yaml").unwrap_err();
    assert!(
        matches!(error, SpecError::TooDeep { line: 65, .. }),
        "{error}"
    );
}

#[test]
fn brackets_in_strings_comments_and_block_scalars_do_not_count_but_real_nesting_does() {
    let brackets = "[".repeat(200);
    let text = edit(
        &quickstart(),
        "  name: quickstart\n",
        &format!(
            "  name: quickstart # {brackets}\n  labels:\n    single: '{brackets}'\n    \
             double: \"{brackets}\"\n    plain: x {brackets}\n    block: |\n      {brackets}\n      \
             it's\n"
        ),
    );
    let job = parse_job(text.as_bytes(), "job.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(job.manifest.metadata.labels["single"], brackets);
    // The same document with a real nest after the strings is refused, at the nest's line.
    let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
    let text = edit(
        &text,
        "    name: Qwen2.5-1.5B-Instruct",
        &format!("    name: Qwen2.5-1.5B-Instruct\n    extra: {deep}"),
    );
    let line = text
        .lines()
        .position(|l| l.starts_with("    extra:"))
        .unwrap()
        + 1;
    let error = parse_job(text.as_bytes(), "job.yaml").unwrap_err();
    assert!(
        matches!(error, SpecError::TooDeep { line: l, .. } if l == line),
        "{error}"
    );
}

#[test]
fn any_file_parsed_as_yaml_is_refused_when_too_large_or_too_deep() {
    // `parse_yaml` reads other formats than a job (a cluster inventory): the same limits hold.
    let huge = "#".repeat(MAX_SPEC_BYTES + 1);
    let error = parse_yaml::<serde_json::Value>(&huge, "inventory.yaml").unwrap_err();
    assert!(
        matches!(error, SpecError::TooLarge { size, .. } if size == MAX_SPEC_BYTES as u64 + 1),
        "{error}"
    );
    let error =
        parse_yaml::<serde_json::Value>(&nested_flow(20 * 1024), "inventory.yaml").unwrap_err();
    assert!(matches!(error, SpecError::TooDeep { .. }), "{error}");
}

#[test]
fn a_rollout_batch_of_four_trillion_is_refused_with_the_field_and_the_bound() {
    let text = edit(
        &quickstart(),
        "rolloutBatchSize: 32 ",
        "rolloutBatchSize: 4000000000000 ",
    );
    assert_problem(
        &text,
        "spec.rl.rolloutBatchSize: must be at most 1048576 trajectories (far past published RL \
         batches; the simulator and the planner work through every trajectory of a step), got \
         4000000000000",
    );
}

#[test]
fn three_thousand_pools_are_refused_with_the_bound() {
    let extra: String = (0..3000)
        .map(|i| format!("    - {{ name: extra-{i}, gpu: H20, count: 1 }}\n"))
        .collect();
    let text = edit(&quickstart(), "  pools:\n", &format!("  pools:\n{extra}"));
    assert_problem(
        &text,
        "spec.pools: must list at most 256 pools (real inventories have a few dozen at most; the \
         planner's search grows with each one), got 3005",
    );
}

#[test]
fn steps_staleness_and_hidden_size_near_two_to_the_63_are_refused_with_their_bounds() {
    let near = "9223372036854775807";
    let text = edit(&quickstart(), "steps: 5\n", &format!("steps: {near}\n"));
    let text = edit(&text, "maxStaleness: 1 ", &format!("maxStaleness: {near} "));
    let text = edit(&text, "hiddenSize: 1536", &format!("hiddenSize: {near}"));
    let problems = problems_of(&text);
    for expected in [
        format!(
            "spec.model.hiddenSize: must be at most 1048576 (published models have up to about \
             20,000), got {near}"
        ),
        format!(
            "spec.rl.maxStaleness: must be at most 1000 policy versions (asynchronous RL stays \
             within a handful), got {near}"
        ),
        format!(
            "spec.rl.steps: must be at most 10000000 steps (published RL runs take hundreds \
             to thousands), got {near}"
        ),
    ] {
        assert!(problems.contains(&expected), "{expected}\n{problems:#?}");
    }
}

#[test]
fn an_action_token_p99_of_1e300_is_refused_with_the_field_and_the_bound() {
    let text = edit(
        &quickstart(),
        "median: 48, p99: 200,",
        "median: 48, p99: 1e300,",
    );
    assert_problem(
        &text,
        "spec.tasks[0].actionTokens.p99: must be at most 10485760 tokens (the longest context \
         window accepted), got 1e300",
    );
}

#[test]
fn a_lognormal_so_wide_its_mean_runs_away_is_refused() {
    // Median 0.001 ms and p99 1,000 ms: sigma 8.9, a mean of 10^14 ms.
    let text = edit(
        &quickstart(),
        "{ distribution: lognormal, median: 3, p99: 20 }",
        "{ distribution: lognormal, median: 0.001, p99: 1000 }",
    );
    assert_problem(
        &text,
        "spec.rewards[1].latencyMs.p99: must be at most 10000 times the median (0.001): a wider \
         spread puts the mean above the 99th percentile, got 1000",
    );
}

/// (edit applied to the quick-start, the exact problem expected).
const TOO_LARGE: &[(&str, &str, &str)] = &[
    (
        "groupSize: 4 ",
        "groupSize: 8192 ",
        "spec.rl.groupSize: must be at most 4096 trajectories (GRPO groups hold 4 to 64), got 8192",
    ),
    (
        "trainBatchSize: 16 ",
        "trainBatchSize: 2097152 ",
        "spec.rl.trainBatchSize: must be at most 1048576 trajectories (far past published RL \
         batches; the simulator and the planner work through every trajectory of a step), got \
         2097152",
    ),
    (
        "maxTurns: 8\n",
        "maxTurns: 20000\n",
        "spec.tasks[0].maxTurns: must be at most 10000 turns (agentic episodes take tens to \
         hundreds), got 20000",
    ),
    (
        "maxTurns: 8\n",
        "maxTurns: 8\n      turns: { distribution: uniform, min: 1, max: 1e6 }\n",
        "spec.tasks[0].turns.max: must be at most 10000 turns (agentic episodes take tens to \
         hundreds), got 1000000",
    ),
    (
        "promptTokens: 220",
        "promptTokens: 2e7",
        "spec.tasks[0].promptTokens.value: must be at most 10485760 tokens (the longest context \
         window accepted), got 20000000",
    ),
    (
        "observationTokens: 90",
        "observationTokens: { distribution: trace, trace: azure-llm-conv-2023, column: \
         contextTokens, scale: 1000 }",
        "spec.tasks[0].observationTokens.scale: must be at most 100 (1 to 10 stretches serving \
         traffic to RL lengths), got 1000",
    ),
    (
        "observationTokens: 90",
        "observationTokens: { distribution: csv, path: tests/data/too_long_actions.csv, column: \
         output_tokens }",
        "spec.tasks[0].observationTokens.path: tests/data/too_long_actions.csv: row 2 of \
         \"output_tokens\" is 20000000 (times scale 1: 20000000), above the largest allowed, \
         10485760 tokens (the longest context window accepted)",
    ),
    (
        "{ distribution: uniform, min: 1, max: 5 }",
        "{ distribution: uniform, min: 1, max: 1e12 }",
        "spec.tasks[0].envStepMs.max: must be at most 86400000 ms (a day), got 1000000000000",
    ),
    (
        "{ distribution: lognormal, median: 3, p99: 20 }",
        "{ distribution: lognormal, median: 3, p99: 20, max: 1e20 }",
        "spec.rewards[1].latencyMs.max: must be at most 86400000 ms (a day), got 1e20",
    ),
    (
        "memoryMb: 256",
        "memoryMb: 1099511627776",
        "spec.rewards[1].memoryMb: must be at most 1048576 MB (a hundred times AWS Lambda's \
         largest function), got 1099511627776",
    ),
    (
        "concurrency: 16",
        "concurrency: 1099511627776",
        "spec.pools[4].concurrency: must be at most 1000000 executions (account quotas reach tens \
         of thousands), got 1099511627776",
    ),
    (
        "gpu: H20\n      count: 2",
        "gpu: H20\n      count: 2\n      gpusPerNode: 1099511627776",
        "spec.pools[1].gpusPerNode: must be at most 1024 GPUs (NVLink domains hold 8 to 72), got \
         1099511627776",
    ),
    (
        "gpu: H20\n      count: 2",
        "gpu: H20\n      count: 999999",
        "spec.pools: the gpu pools must count at most 1000000 GPUs together (several times the \
         largest cluster built), got 1000001",
    ),
    (
        "parameters: 1.54e9",
        "parameters: 1e20",
        "spec.model.parameters: must be at most 10000000000000 (five times the largest models \
         announced), got 1e20",
    ),
    (
        "layers: 28",
        "layers: 1099511627776",
        "spec.model.layers: must be at most 10000 (published models have up to about 130), got \
         1099511627776",
    ),
    (
        "kvHeads: 2",
        "kvHeads: 1099511627776",
        "spec.model.kvHeads: must be at most 8192 (published models have up to 128), got \
         1099511627776",
    ),
    (
        "headDim: 128",
        "headDim: 1099511627776",
        "spec.model.headDim: must be at most 8192 (published models have up to 512), got \
         1099511627776",
    ),
    (
        "  pools:\n",
        "  network: { crossPoolGBps: 1e30 }\n  pools:\n",
        "spec.network.crossPoolGBps: must be at most 1000000 GB/s (a thousand times eight 800 \
         Gb/s NICs), got 1e30",
    ),
    (
        "  pools:\n",
        "  catalog:\n    gpus:\n      - { name: X1, bf16DenseTflops: 1e9, memoryGb: 80, \
         memoryBandwidthGBps: 3000, interconnectGBps: 900, pricePerHourUsd: 2 }\n  pools:\n",
        "spec.catalog.gpus[0].bf16DenseTflops: must be at most 1000000 TFLOP/s (a few hundred \
         times the fastest GPU's), got 1000000000",
    ),
    (
        "  pools:\n",
        "  catalog:\n    cpuShapes:\n      - { name: big, vcpus: 4000000000, memoryGib: 1e12, \
         pricePerHourUsd: 1 }\n  pools:\n",
        "spec.catalog.cpuShapes[0].vcpus: must be at most 100000 vCPUs (fifty times the \
         largest instances'), got 4000000000",
    ),
];

#[test]
fn every_figure_of_a_job_has_an_upper_bound_named_with_its_reason() {
    let good = quickstart();
    for (from, to, expected) in TOO_LARGE {
        assert_problem(&edit(&good, from, to), expected);
    }
}

#[test]
fn non_finite_numbers_are_refused_with_the_field_named() {
    let cases = [
        (
            "parameters: 1.54e9",
            "parameters: .inf",
            "spec.model.parameters",
        ),
        (
            "overProvisioning: 0.25",
            "overProvisioning: .nan",
            "spec.rl.overProvisioning",
        ),
        ("share: 0.3", "share: .nan", "spec.tasks[1].share"),
        (
            "median: 48, p99: 200,",
            "median: 48, p99: .inf,",
            "spec.tasks[0].actionTokens.p99",
        ),
        (
            "  pools:\n",
            "  network: { crossPoolGBps: .inf }\n  pools:\n",
            "spec.network.crossPoolGBps",
        ),
        (
            "  pools:\n",
            "  catalog:\n    cpuShapes:\n      - { name: c9, vcpus: 8, memoryGib: 16, \
             pricePerHourUsd: .nan }\n  pools:\n",
            "spec.catalog.cpuShapes[0].pricePerHourUsd",
        ),
    ];
    for (from, to, path) in cases {
        let problems = problems_of(&edit(&quickstart(), from, to));
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with(&format!("{path}: "))
                    && (p.contains("NaN") || p.contains("inf"))),
            "{to}: expected a problem at {path}, got {problems:#?}"
        );
    }
}

/// Whether a YAML file is an RL job: a top-level `kind: RLJob` line (a CRD or a Prometheus rule
/// file mentions the kind only indented, if at all).
fn is_rl_job(text: &str) -> bool {
    text.lines().any(|line| line.trim_end() == "kind: RLJob")
}

fn yaml_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        // Virtual environments and installed packages hold other projects' YAML.
        if name.starts_with('.') || name == "node_modules" || name == "target" {
            continue;
        }
        if path.is_dir() {
            yaml_files(&path, found);
        } else if name.ends_with(".yaml") || name.ends_with(".yml") {
            found.push(path);
        }
    }
}

#[test]
fn every_rl_job_in_the_examples_and_the_benchmarks_stays_within_every_limit() {
    let root = repo_root();
    let mut files = Vec::new();
    yaml_files(&root.join("examples"), &mut files);
    yaml_files(&root.join("scheduler"), &mut files);
    files.sort();
    let mut jobs = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        if is_rl_job(&text) {
            if let Err(error) = load_job_file(&path) {
                panic!("{error}");
            }
            jobs.push(path);
        }
    }
    // The four example jobs and the 3,000-GPU benchmark at least.
    assert!(jobs.len() >= 5, "{jobs:?}");
    assert!(
        jobs.iter()
            .any(|p| p.ends_with("examples/real-cpu/job.yaml")),
        "{jobs:?}"
    );
}
