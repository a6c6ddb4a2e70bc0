//! Validation of every example job and of a table of bad specs: each bad spec must give its own
//! clear error naming the field, and no input of any kind may panic.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

mod common;

use std::path::PathBuf;

use proptest::prelude::*;
use rollfleet_spec::{MAX_SPEC_BYTES, SpecError, load_job_file, parse_job};

use common::{edit, problems_of, quickstart, repo_root};

fn examples_dir() -> PathBuf {
    repo_root().join("examples/jobs")
}

#[test]
fn every_example_job_is_valid() {
    let mut seen = 0;
    for entry in std::fs::read_dir(examples_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let job = load_job_file(&path).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                job.warnings.is_empty(),
                "{}: {:?}",
                path.display(),
                job.warnings
            );
            seen += 1;
        }
    }
    assert!(
        seen >= 2,
        "expected the quick-start and the RollArt-like examples"
    );
}

#[test]
fn the_rollart_example_is_disaggregated_over_h800_h20_cpu_and_serverless() {
    let job = load_job_file(&examples_dir().join("rollart-agentic.yaml")).unwrap();
    let kinds: Vec<String> = job
        .spec()
        .pools
        .iter()
        .map(|p| {
            p.gpu
                .clone()
                .or(p.cpu.clone())
                .or(p.serverless.clone())
                .unwrap()
        })
        .collect();
    assert_eq!(kinds, ["H800", "H20", "c7i.16xlarge", "aws-lambda"]);
    assert!(job.spec().tasks.len() >= 3);
}

/// (what is wrong, edit applied to the quick-start, the exact problem expected).
const BAD_SPECS: &[(&str, &str, &str, &str)] = &[
    (
        "experts without experts per token",
        "headDim: 128\n",
        "headDim: 128\n    experts: 64\n",
        "spec.model.expertsPerToken: must be given with experts (the routed experts each token uses)",
    ),
    (
        "more experts per token than experts",
        "headDim: 128\n",
        "headDim: 128\n    experts: 4\n    expertsPerToken: 8\n    activeParameters: 1e9\n",
        "spec.model.expertsPerToken: must be between 1 and experts (4), got 8",
    ),
    (
        "a mixture of experts with every parameter active",
        "headDim: 128\n",
        "headDim: 128\n    experts: 64\n    expertsPerToken: 8\n",
        "spec.model.activeParameters: must be below parameters (1540000000) for a mixture of experts using 8 of 64 experts per token",
    ),
    (
        "unknown GPU",
        "gpu: H20",
        "gpu: H900",
        "spec.pools[1].gpu: unknown GPU \"H900\" (known: A100-80G, B200, H100, H20, H200, H800, L20, L40S)",
    ),
    (
        "negative count",
        "cpu: c7i.8xlarge\n      count: 1",
        "cpu: c7i.8xlarge\n      count: -4",
        "spec.pools[3].count: must be at least 1, got -4",
    ),
    (
        "shares that do not sum to 1",
        "share: 0.3",
        "share: 0.4",
        "spec.tasks: shares must sum to 1, they sum to 1.1",
    ),
    (
        "unknown CPU shape",
        "cpu: c7i.8xlarge",
        "cpu: c9.huge",
        "spec.pools[3].cpu: unknown CPU shape \"c9.huge\" (known: c7i.16xlarge, c7i.48xlarge, c7i.8xlarge, m7i.8xlarge)",
    ),
    (
        "missing field",
        "    layers: 28\n",
        "",
        "spec.model: missing field `layers` at line 12 column 5",
    ),
    (
        "wrong type",
        "groupSize: 4 ",
        "groupSize: four ",
        "spec.rl.groupSize: invalid type: string \"four\", expected i64 at line 19 column 16",
    ),
    (
        "misspelled field",
        "maxStaleness: 1",
        "maxStalenes: 1",
        "spec.rl.maxStalenes: unknown field `maxStalenes`, expected one of `groupSize`, `rolloutBatchSize`, `trainBatchSize`, `maxStaleness`, `overProvisioning`, `steps`, `trainMfu`, `trainer`, `interruptGeneration` at line 22 column 5; did you mean `maxStaleness`?",
    ),
    (
        "group size that does not divide the batch",
        "groupSize: 4 ",
        "groupSize: 3 ",
        "spec.rl.rolloutBatchSize: must be a multiple of groupSize (3) so that every group is complete, got 32",
    ),
    (
        "negative staleness",
        "maxStaleness: 1",
        "maxStaleness: -1",
        "spec.rl.maxStaleness: must be at least 0, got -1",
    ),
    (
        "serverless reward longer than the platform lets a call run",
        "latencyMs: { distribution: lognormal, median: 3, p99: 20 }",
        "latencyMs: { distribution: lognormal, median: 3000, p99: 20000, max: 1200000 }",
        "spec.rewards[1].latencyMs.max: 1200000 ms is longer than aws-lambda lets one invocation run (900 s): such calls would time out on every attempt",
    ),
    (
        "serverless reward whose p99 is past the platform's limit",
        "latencyMs: { distribution: lognormal, median: 3, p99: 20 }",
        "latencyMs: { distribution: lognormal, median: 3000, p99: 950000 }",
        "spec.rewards[1].latencyMs.p99: 950000 ms is longer than aws-lambda lets one invocation run (900 s): such calls would time out on every attempt",
    ),
    (
        "reward that does not exist",
        "reward: exact-answer",
        "reward: exact-anser",
        "spec.tasks[2].reward: unknown reward \"exact-anser\" (known: env-score, exact-answer); did you mean `exact-answer`?",
    ),
    (
        "serverless reward on a CPU pool",
        "pool: rewards",
        "pool: envs",
        "spec.rewards[1].pool: pool \"envs\" is not a serverless pool, which runsOn: serverless needs",
    ),
    (
        "pool with two kinds",
        "serverless: aws-lambda",
        "serverless: aws-lambda\n      cpu: c7i.8xlarge",
        "spec.pools[4]: must set exactly one of `gpu`, `cpu` and `serverless`",
    ),
    (
        "inverted distribution",
        "{ distribution: uniform, min: 1, max: 5 }",
        "{ distribution: uniform, min: 9, max: 5 }",
        "spec.tasks[0].envStepMs.max: must be >= min (9), got 5",
    ),
    (
        "bad job name",
        "name: quickstart",
        "name: Quick_Start",
        "metadata.name: \"Quick_Start\" is not a DNS-1123 label (lower-case letters, digits and '-', starting and ending with a letter or digit, at most 63 characters)",
    ),
    (
        "GPU role on a CPU pool",
        "count: 1\n      roles: [train]",
        "count: 1\n      roles: [train]\n    - name: cpu2\n      cpu: c7i.8xlarge\n      count: 2\n      roles: [decode]",
        "spec.pools[3].roles[0]: a cpu pool cannot take role Decode",
    ),
    (
        "more turns than the context can hold",
        "maxTurns: 8",
        "maxTurns: 1099511627776",
        "spec.tasks[0].maxTurns: must be at most contextLimit (4096): every turn adds at least one token, got 1099511627776",
    ),
    (
        "a context limit beyond any model's",
        "observationTokens: 90\n      contextLimit: 4096",
        "observationTokens: 90\n      contextLimit: 1099511627776",
        "spec.tasks[0].contextLimit: must be at most 10485760 tokens (the longest published context window), got 1099511627776",
    ),
    (
        "a pool larger than any cluster",
        "gpu: H20\n      count: 2",
        "gpu: H20\n      count: 1099511627776",
        "spec.pools[1].count: must be at most 1000000 GPUs (several times the largest cluster built), got 1099511627776",
    ),
    (
        "an environment that exists nowhere",
        "environment: frozenlake",
        "environment: my-webshop",
        "spec.tasks[1].environment: unknown environment \"my-webshop\" (built in: calculator, frozenlake, sokoban; declared in spec.environments: none); an environment served by a remote environment server is declared in spec.environments with `servedBy: remote`",
    ),
    (
        "a misspelt built-in environment",
        "environment: sokoban",
        "environment: sokobn",
        "spec.tasks[0].environment: unknown environment \"sokobn\" (built in: calculator, frozenlake, sokoban; declared in spec.environments: none); did you mean `sokoban`?",
    ),
    (
        "a reward function no worker implements",
        "function: math_answer",
        "function: my_python_reward",
        "spec.rewards[1].function: unknown reward function \"my_python_reward\" (the reward workers implement: code_tests, exact_match, json_format, math_answer, regex_match, think_answer_format)",
    ),
    (
        "a misspelt reward function",
        "function: math_answer",
        "function: math-answer",
        "spec.rewards[1].function: unknown reward function \"math-answer\" (the reward workers implement: code_tests, exact_match, json_format, math_answer, regex_match, think_answer_format); did you mean `math_answer`?",
    ),
    (
        "a misspelt task field",
        "      reward: exact-answer",
        "      rewrd: exact-answer",
        "spec.tasks[2].rewrd: unknown field `rewrd`, expected one of `name`, `environment`, `share`, `maxTurns`, `turns`, `promptTokens`, `actionTokens`, `observationTokens`, `contextLimit`, `envStepMs`, `envCpus`, `envFailureRate`, `reward` at line 55 column 7; did you mean `reward`?",
    ),
    (
        "a misspelt reward placement",
        "runsOn: serverless",
        "runsOn: serverles",
        "spec.rewards[1].runsOn: unknown variant `serverles`, expected one of `serverless`, `local`, `environment` at line 61 column 15; did you mean `serverless`?",
    ),
    (
        "a declared environment without a server",
        "  rewards:\n",
        "  environments:\n    - name: guess\n      servedBy: somewhere\n  rewards:\n",
        "spec.environments[0].servedBy: unknown variant `somewhere`, expected `remote` at line 58 column 17",
    ),
    (
        "an environment declared twice",
        "  rewards:\n",
        "  environments:\n    - { name: guess, servedBy: remote }\n    - { name: guess, servedBy: remote }\n  rewards:\n",
        "spec.environments[1].name: duplicate environment name \"guess\"",
    ),
];

#[test]
fn each_bad_spec_gives_its_own_clear_error() {
    let good = quickstart();
    for (what, from, to, expected) in BAD_SPECS {
        let problems = problems_of(&edit(&good, from, to));
        assert!(
            problems.iter().any(|p| p == expected),
            "{what}: expected `{expected}`, got {problems:#?}"
        );
    }
}

#[test]
fn an_environment_declared_as_served_remotely_may_be_named_by_a_task() {
    let text = edit(
        &quickstart(),
        "environment: frozenlake",
        "environment: guess",
    );
    let text = edit(
        &text,
        "  rewards:\n",
        "  environments:\n    - name: guess\n      servedBy: remote\n  rewards:\n",
    );
    let job = parse_job(text.as_bytes(), "job.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(job.spec().environments[0].name, "guess");
    assert_eq!(
        job.spec().environments[0].served_by,
        rollfleet_spec::EnvironmentServer::Remote
    );
    // Declared, it is written back out (the job `validate --json` and the journal carry).
    let yaml = serde_yaml_ng::to_string(&job.manifest).unwrap();
    assert!(yaml.contains("servedBy: remote"), "{yaml}");
}

#[test]
fn a_job_without_declared_environments_writes_none_back_out() {
    let job = parse_job(quickstart().as_bytes(), "job.yaml").unwrap();
    assert!(job.spec().environments.is_empty());
    let json = serde_json::to_value(&job.manifest).unwrap();
    assert!(json["spec"].get("environments").is_none(), "{json:#}");
}

#[test]
fn every_semantic_problem_is_reported_at_once() {
    let text = edit(&quickstart(), "gpu: H20", "gpu: H900");
    let text = edit(&text, "share: 0.3", "share: 0.4");
    let text = edit(&text, "maxStaleness: 1", "maxStaleness: -1");
    let Err(SpecError::Invalid { problems, .. }) = parse_job(text.as_bytes(), "job.yaml") else {
        panic!("expected an invalid spec");
    };
    let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(
        paths,
        ["spec.rl.maxStaleness", "spec.tasks", "spec.pools[1].gpu"]
    );
}

#[test]
fn a_model_that_fits_in_no_pool_names_each_pool_and_the_bytes_short() {
    // 405B parameters in BF16 are 810 GB; an 8-GPU H800 node holds 576 GB usable.
    let text = edit(&quickstart(), "parameters: 1.54e9", "parameters: 405e9");
    let text = edit(&text, "count: 2", "count: 16");
    let problems = problems_of(&text);
    let fit = problems
        .iter()
        .find(|p| p.starts_with("spec.model: one replica needs"))
        .unwrap_or_else(|| panic!("{problems:#?}"));
    assert!(fit.contains("weights 810.0 GB"), "{fit}");
    assert!(
        fit.contains("\"decode\" (8 x H20 = 691.2 GB usable) is"),
        "{fit}"
    );
    assert!(
        fit.contains("\"prefill\" (1 x H800 = 72.0 GB usable) is"),
        "{fit}"
    );
}

#[test]
fn a_pool_too_small_for_the_model_is_a_warning_unless_pinned_to_model_work() {
    // 8B in BF16 is 16 GB of weights, plus 28 layers x 2 KV heads x 128 x 2 (K,V) x 2 bytes
    // x 4,096 tokens = 0.12 GB of KV cache: it fits an H20 pool but not one 12 GB card.
    let text = edit(&quickstart(), "parameters: 1.54e9", "parameters: 8e9");
    let text = text.replace(
        "  pools:\n",
        "  catalog:\n    gpus:\n      - {name: T4-12G, bf16DenseTflops: 65, memoryGb: 12, memoryBandwidthGBps: 320, interconnectGBps: 32, pricePerHourUsd: 0.35}\n  pools:\n    - name: tiny\n      gpu: T4-12G\n      count: 1\n",
    );
    let job = parse_job(text.as_bytes(), "job.yaml").unwrap();
    assert_eq!(job.warnings.len(), 1, "{:?}", job.warnings);
    assert_eq!(job.warnings[0].path, "spec.pools[0]");

    let pinned = text.replace(
        "      gpu: T4-12G\n      count: 1\n",
        "      gpu: T4-12G\n      count: 1\n      roles: [decode]\n",
    );
    let problems = problems_of(&pinned);
    assert_eq!(
        problems,
        ["spec.pools[0].roles: one replica needs 16.1 GB, but 1 x T4-12G hold 10.8 GB usable"]
    );
}

#[test]
fn a_ten_megabyte_file_is_refused_before_it_is_parsed() {
    let dir = std::env::temp_dir().join(format!("rollfleet-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("huge.yaml");
    std::fs::write(&path, vec![b'#'; 10 * 1024 * 1024]).unwrap();
    let error = load_job_file(&path).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        matches!(
            error,
            SpecError::TooLarge {
                size: 10_485_760,
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().ends_with(&format!(
        "10485760 bytes is too large for a job spec (the limit is {MAX_SPEC_BYTES} bytes)"
    )));
}

#[test]
fn non_utf8_bytes_are_refused_with_their_offset() {
    let mut bytes = quickstart().into_bytes();
    bytes[40] = 0xff;
    let error = parse_job(&bytes, "job.yaml").unwrap_err();
    assert_eq!(
        error.to_string(),
        "job.yaml: not UTF-8 text: invalid byte at offset 40"
    );
}

#[test]
fn an_empty_file_says_what_a_spec_starts_with() {
    let error = parse_job(b"  \n", "job.yaml").unwrap_err();
    assert!(error.to_string().contains("the file is empty"), "{error}");
}

#[test]
fn a_yaml_alias_bomb_is_refused_without_exhausting_memory() {
    let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..30 {
        let prev = i - 1;
        text.push_str(&format!(
            "a{i}: &a{i} [*a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}]\n"
        ));
    }
    assert!(parse_job(text.as_bytes(), "bomb.yaml").is_err());
}

#[test]
fn a_missing_file_names_the_file() {
    let error = load_job_file(std::path::Path::new("/nonexistent/job.yaml")).unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("/nonexistent/job.yaml: cannot read"),
        "{error}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = parse_job(&bytes, "fuzz.yaml");
    }

    #[test]
    fn arbitrary_edits_of_a_valid_spec_never_panic(
        position in 0usize..4000,
        length in 0usize..40,
        replacement in "[-a-z0-9:{}\\[\\] ,.\n]{0,24}",
    ) {
        let text = quickstart();
        let start = position.min(text.len());
        let end = (start + length).min(text.len());
        if text.is_char_boundary(start) && text.is_char_boundary(end) {
            let mutated = format!("{}{}{}", &text[..start], replacement, &text[end..]);
            let _ = parse_job(mutated.as_bytes(), "fuzz.yaml");
        }
    }
}

#[test]
fn other_pools_are_validated_as_the_jobs_own_with_their_paths_in_the_inventory() {
    let job = parse_job(quickstart().as_bytes(), "job.yaml").unwrap();
    let mut pools = job.spec().pools.clone();
    // A count past the limit, and a second pool of the same name.
    pools[0].count = Some(1 << 40);
    pools.push(pools[1].clone());
    let error = job.with_pools(pools, "cluster.yaml").unwrap_err();
    let problems: Vec<String> = error.problems().iter().map(|p| p.to_string()).collect();
    assert_eq!(
        problems,
        [
            "pools[0].count: must be at most 1000000 GPUs (several times the largest cluster built), got 1099511627776",
            "pools[5].name: duplicate pool name \"decode\"",
        ]
    );
    assert!(
        error.to_string().starts_with("cluster.yaml: 2 problems"),
        "{error}"
    );
    // Pools the job's rewards need are missing: the job's field is named.
    let without_rewards: Vec<_> = job
        .spec()
        .pools
        .iter()
        .filter(|p| p.name != "rewards")
        .cloned()
        .collect();
    let error = job.with_pools(without_rewards, "cluster.yaml").unwrap_err();
    let problems: Vec<String> = error.problems().iter().map(|p| p.to_string()).collect();
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("the job's spec.rewards[1].pool: unknown pool \"rewards\"")),
        "{problems:?}"
    );
    // Valid pools give the job on them, checked.
    let mut bigger = job.spec().pools.clone();
    bigger[1].count = Some(8);
    let moved = job.with_pools(bigger, "cluster.yaml").unwrap();
    assert_eq!(moved.spec().pools[1].count, Some(8));
}
