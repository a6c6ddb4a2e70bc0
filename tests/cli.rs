//! The `rollfleet` binary as a user meets it: run as a separate process, judged by its exit
//! code, its stdout and its stderr.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The binary, run from the repository, with no `ROLLFLEET_SCHEDULER` of the caller's shell.
fn command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rollfleet"));
    command
        .args(args)
        .current_dir(repo())
        .env_remove("ROLLFLEET_SCHEDULER");
    command
}

fn rollfleet(args: &[&str]) -> Output {
    command(args).output().unwrap()
}

fn rollfleet_with_env(args: &[&str], name: &str, value: &str) -> Output {
    command(args).env(name, value).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn scratch(name: &str, contents: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rollfleet-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn validate_accepts_the_quickstart_and_prints_its_figures() {
    let out = rollfleet(&["validate", "examples/jobs/quickstart.yaml"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("valid job \"quickstart\""), "{stdout}");
    assert!(stdout.contains("KV cache 28.7 kB/token"), "{stdout}");
    assert!(text(&out.stderr).is_empty());
}

#[test]
fn validate_json_carries_the_job_and_derived_figures() {
    let out = rollfleet(&[
        "validate",
        "-o",
        "json",
        "examples/jobs/rollart-agentic.yaml",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["valid"], true);
    assert_eq!(report["job"]["metadata"]["name"], "rollart-agentic");
    // Qwen3-32B: 2 x 64 layers x 8 KV heads x 128 x 2 bytes = 262,144 bytes per token.
    assert_eq!(report["derived"]["kvBytesPerToken"], 262_144.0);
    let h800 = &report["derived"]["pools"][0];
    assert_eq!(h800["device"], "H800");
    assert_eq!(h800["minTensorParallel"], 2);
}

#[test]
fn an_invalid_job_exits_3_with_every_problem_on_stderr() {
    let good = std::fs::read_to_string(repo().join("examples/jobs/quickstart.yaml")).unwrap();
    let bad = good
        .replace("gpu: H20", "gpu: H900")
        .replace("maxStaleness: 1", "maxStaleness: -2");
    let path = scratch("bad.yaml", &bad);
    let out = rollfleet(&["validate", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("2 problems"), "{stderr}");
    assert!(
        stderr.contains("spec.pools[1].gpu: unknown GPU \"H900\""),
        "{stderr}"
    );
    assert!(
        stderr.contains("spec.rl.maxStaleness: must be at least 0, got -2"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());

    let out = rollfleet(&["validate", "-o", "json", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["valid"], false);
    assert_eq!(report["errors"].as_array().unwrap().len(), 2);
    assert_eq!(report["errors"][1]["path"], "spec.pools[1].gpu");
}

#[test]
fn validate_refuses_a_job_naming_an_environment_and_a_reward_function_that_exist_nowhere() {
    let good = std::fs::read_to_string(repo().join("examples/jobs/quickstart.yaml")).unwrap();
    let bad = good
        .replace("environment: frozenlake", "environment: my-webshop")
        .replace("function: math_answer", "function: my_python_reward");
    let path = scratch("unknown-names.yaml", &bad);
    let out = rollfleet(&["validate", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stdout));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("2 problems"), "{stderr}");
    assert!(
        stderr.contains("spec.tasks[1].environment: unknown environment \"my-webshop\""),
        "{stderr}"
    );
    assert!(
        stderr.contains("spec.rewards[1].function: unknown reward function \"my_python_reward\""),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    // A slip of one letter is answered with the name meant.
    let misspelt = good.replace("environment: sokoban", "environment: sokobam");
    let path = scratch("misspelt-environment.yaml", &misspelt);
    let out = rollfleet(&["validate", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("spec.tasks[0].environment: unknown environment \"sokobam\"")
            && stderr.contains("did you mean `sokoban`?"),
        "{stderr}"
    );
}

#[test]
fn every_command_exits_0_for_its_help_and_2_for_a_wrong_command_line() {
    let commands: [&[&str]; 16] = [
        &["validate"],
        &["catalog"],
        &["gpus"],
        &["sim"],
        &["plan"],
        &["profile", "show"],
        &["serverless", "serve"],
        &["run"],
        &["scheduler"],
        &["job", "status"],
        &["job", "list"],
        &["job", "logs"],
        &["journal", "show"],
        &["worker"],
        &["train"],
        &["completion"],
    ];
    for command in commands {
        let help = rollfleet(&[command, &["--help"]].concat());
        assert_eq!(help.status.code(), Some(0), "{command:?} --help");
        let wrong = rollfleet(&[command, &["--no-such-flag"]].concat());
        assert_eq!(wrong.status.code(), Some(2), "{command:?} --no-such-flag");
        assert!(
            text(&wrong.stderr).contains("--no-such-flag"),
            "{command:?}"
        );
    }
    // The environment is part of the command line: log levels that do not parse.
    let out = rollfleet_with_env(&["catalog"], "RUST_LOG", "[[[");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("RUST_LOG"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_missing_file_exits_3_naming_the_file() {
    let out = rollfleet(&["validate", "no/such/job.yaml"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out.stderr).starts_with("error: no/such/job.yaml: cannot read"));
}

#[test]
fn every_command_that_reads_a_file_exits_3_naming_a_missing_one() {
    let missing = "no/such/dir/input.yaml";
    let checkpoints = std::env::temp_dir().join(format!(
        "rollfleet-cli-{}-checkpoints-never-made",
        std::process::id()
    ));
    let checkpoints = checkpoints.to_str().unwrap();
    let quickstart = "examples/jobs/quickstart.yaml";
    let external = "examples/jobs/quickstart-external.yaml";
    let cases: Vec<Vec<&str>> = vec![
        vec!["validate", missing],
        vec!["validate", "-o", "json", missing],
        vec!["sim", missing],
        vec!["plan", missing],
        vec!["plan", quickstart, "--inventory", missing],
        vec!["plan", quickstart, "--profiles", missing],
        vec!["catalog", "--job", missing],
        vec!["profile", "show", missing],
        vec!["profile", "import", missing],
        vec![
            "profile",
            "export",
            "--to",
            "/dev/null",
            "--profiles",
            missing,
        ],
        vec!["journal", "show", missing],
        vec![
            "job",
            "submit",
            missing,
            "--scheduler",
            "http://127.0.0.1:1",
        ],
        vec!["job", "status", "quickstart", "--token-file", missing],
        vec![
            "job",
            "cancel",
            "quickstart",
            "--scheduler",
            "https://127.0.0.1:1",
            "--tls-ca",
            missing,
        ],
        vec!["run", missing],
        vec!["train", missing, "--checkpoints", checkpoints],
        vec![
            "train",
            external,
            "--checkpoints",
            checkpoints,
            "--token-file",
            missing,
        ],
        vec![
            "train",
            external,
            "--checkpoints",
            checkpoints,
            "--scheduler",
            "https://127.0.0.1:1",
            "--tls-ca",
            missing,
        ],
        vec!["scheduler", missing, "--listen", "127.0.0.1:0"],
        vec![
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            missing,
        ],
        vec!["worker", "--pool", "decode", "--token-file", missing],
        vec![
            "worker",
            "--pool",
            "decode",
            "--scheduler",
            "https://127.0.0.1:1",
            "--tls-ca",
            missing,
        ],
    ];
    for args in &cases {
        let out = rollfleet(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {stderr}");
        assert!(stderr.contains(missing), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // Refused before anything was done.
    assert!(!Path::new(checkpoints).exists());
}

#[test]
fn binary_garbage_is_refused_without_a_crash() {
    let dir = std::env::temp_dir().join(format!("rollfleet-cli-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("garbage.yaml");
    std::fs::write(&path, [0x7f, b'E', b'L', b'F', 0xff, 0xfe, 0x00, 0x01]).unwrap();
    let out = rollfleet(&["validate", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out.stderr).contains("not UTF-8 text: invalid byte at offset 4"));
}

#[test]
fn a_wrong_command_line_exits_2() {
    let out = rollfleet(&["validate", "--no-such-flag", "x.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    let out = rollfleet(&["-o", "xml", "catalog"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn help_shows_an_example_for_every_subcommand() {
    for args in [
        &["--help"][..],
        &["validate", "--help"],
        &["catalog", "--help"],
        &["plan", "--help"],
        &["profile", "show", "--help"],
    ] {
        let out = rollfleet(args);
        assert_eq!(out.status.code(), Some(0));
        let stdout = text(&out.stdout);
        assert!(
            stdout.contains("Examples:\n  rollfleet "),
            "{args:?}: {stdout}"
        );
    }
}

#[test]
fn plan_puts_training_on_the_compute_rich_pool_and_says_why_each_role_goes_where() {
    let out = rollfleet(&["plan", "examples/jobs/rollart-agentic.yaml", "--compare"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("not measured"), "{stdout}");
    assert!(stdout.contains("predicted step:"), "{stdout}");
    let train = stdout
        .lines()
        .find(|l| l.starts_with("train "))
        .unwrap_or_default();
    assert!(train.contains("h800"), "{stdout}");
    assert!(stdout.contains("bandwidth-bound") && stdout.contains("compute-bound"));
    assert!(stdout.contains("best-gpu"), "{stdout}");
    // RollArt's mapping: prefill on the H800s, decode on the H20s, and the plan says why it is
    // not the search's own optimum.
    let role_on = |role: &str, pool: &str| {
        stdout
            .lines()
            .any(|l| l.starts_with(role) && l.split_whitespace().nth(1) == Some(pool))
    };
    assert!(
        role_on("prefill", "h800") && role_on("decode", "h20"),
        "{stdout}"
    );
    assert!(stdout.contains("RollArt's affinity mapping"), "{stdout}");
    let json = rollfleet(&["plan", "examples/jobs/rollart-agentic.yaml", "-o", "json"]);
    let value: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    // Every GPU is used at most once: serving replicas plus the trainer fit in 192 + 320 GPUs.
    let replicas = value["plan"]["placement"]["replicas"].as_array().unwrap();
    assert!(!replicas.is_empty());
    let serving: u64 = replicas.iter().map(|r| r["gpus"].as_u64().unwrap()).sum();
    let training = value["plan"]["placement"]["trainer"]["gpus"]
        .as_u64()
        .unwrap();
    assert!(serving + training <= 512, "{serving} + {training}");
    // The choice's own figures: both full predictions without the refills' burst.
    let search_s = value["affinity_over_search_s"].as_f64().unwrap();
    let plan_s = value["affinity_plan_s"].as_f64().unwrap();
    assert!(plan_s < search_s, "{plan_s} against {search_s}");
}

/// `rollfleet plan` of the RollArt-like job on the inventory file `inventory`.
fn plan_rollart_on(inventory: &Path) -> Output {
    rollfleet(&[
        "plan",
        "examples/jobs/rollart-agentic.yaml",
        "--inventory",
        inventory.to_str().unwrap(),
    ])
}

#[test]
fn plan_on_an_inventory_too_small_for_the_model_exits_3_naming_the_pool_and_the_bytes_short() {
    let inventory = scratch(
        "small-inventory.yaml",
        "pools:\n  - { name: l20s, gpu: L20, count: 16, gpusPerNode: 1 }\n  \
         - { name: env-nodes, cpu: c7i.16xlarge, count: 4 }\n  \
         - { name: lambda, serverless: aws-lambda, concurrency: 100 }\n",
    );
    let out = plan_rollart_on(&inventory);
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    // Checked as the job's own pools are: the same words as `rollfleet validate`'s.
    assert!(
        stderr.contains("no GPU pool can hold it")
            && stderr.contains("\"l20s\" (1 x L20 = 43.2 GB usable) is 39.6 GB short"),
        "{stderr}"
    );
}

#[test]
fn plan_checks_an_inventory_as_a_jobs_pools_and_refuses_a_huge_one_unread() {
    // Found by fuzzing: a count of 2^63 - 1 made the search run for minutes, and a duplicate
    // name went unnoticed.
    let inventory = scratch(
        "fuzzed-inventory.yaml",
        "pools:\n  - { name: h800, gpu: H800, count: 9223372036854775807 }\n  \
         - { name: h20, gpu: H20, count: 320 }\n  \
         - { name: env-nodes, cpu: c7i.16xlarge, count: 48 }\n  \
         - { name: lambda, serverless: aws-lambda, concurrency: 800 }\n  \
         - { name: h800, gpu: H800, count: 192 }\n",
    );
    let out = plan_rollart_on(&inventory);
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("pools[0].count: must be at most 1000000 GPUs")
            && stderr.contains("pools[4].name: duplicate pool name \"h800\""),
        "{stderr}"
    );
    let huge = scratch("huge-inventory.yaml", &"#".repeat(2 << 20));
    let out = plan_rollart_on(&huge);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("too large"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn profiles_show_the_roofline_export_without_fake_probes_and_import_measured_samples() {
    let out = rollfleet(&["profile", "show", "examples/jobs/rollart-agentic.yaml"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("not measured") && stdout.contains("model"),
        "{stdout}"
    );
    let decode_h20 = stdout
        .lines()
        .find(|l| l.starts_with("h20") && l.contains("decode"))
        .unwrap();
    assert!(decode_h20.contains("bandwidth-bound"), "{decode_h20}");

    // Export with a probe: on a machine without a GPU it says so and writes no numbers.
    let exported = scratch("exported.json", "");
    let out = rollfleet(&[
        "profile",
        "export",
        "--probe",
        "--to",
        exported.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let store: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&exported).unwrap()).unwrap();
    let gpus = rollfleet_gpus_present();
    if !gpus {
        assert!(
            text(&out.stderr).contains("no probe"),
            "{}",
            text(&out.stderr)
        );
        assert_eq!(store["probed"], serde_json::json!({}));
    }

    // Import 20 measured samples of H20 decode at 40% of peak bandwidth and plan with them.
    let samples = vec!["0.4"; 20].join(", ");
    let measured = scratch(
        "measured.json",
        &format!(
            r#"{{"measured": {{"decode": {{"h20": {{"samples": [{samples}], "total": 20}}}}}}}}"#
        ),
    );
    let merged = scratch("merged.json", "");
    std::fs::remove_file(&merged).unwrap();
    let out = rollfleet(&[
        "profile",
        "import",
        measured.to_str().unwrap(),
        "--into",
        merged.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("0.400"), "{}", text(&out.stdout));
    let shown = rollfleet(&[
        "profile",
        "show",
        "examples/jobs/rollart-agentic.yaml",
        "--profiles",
        merged.to_str().unwrap(),
    ]);
    let shown = text(&shown.stdout);
    let line = shown
        .lines()
        .find(|l| l.starts_with("h20") && l.contains("decode"))
        .unwrap();
    assert!(line.contains("0.40") && line.contains("measured"), "{line}");
    // Samples that do not say they were modelled are a real GPU's.
    assert!(!line.contains("emulated"), "{line}");
    let base = rollfleet(&["plan", "examples/jobs/rollart-agentic.yaml", "-o", "json"]);
    let slower = rollfleet(&[
        "plan",
        "examples/jobs/rollart-agentic.yaml",
        "-o",
        "json",
        "--profiles",
        merged.to_str().unwrap(),
    ]);
    let step = |o: &Output| -> f64 {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["plan"]["prediction"]["step_s"].as_f64().unwrap()
    };
    assert!(
        step(&slower) > step(&base),
        "{} vs {}",
        step(&slower),
        step(&base)
    );

    // A sample that is not a share of peak is refused, naming where it is.
    let bad = scratch(
        "bad.json",
        r#"{"measured": {"prefill": {"h800": {"samples": [0.5, -3], "total": 2}}}}"#,
    );
    let out = rollfleet(&["profile", "import", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("measured.prefill.h800"),
        "{}",
        text(&out.stderr)
    );

    // Measured environment steps: 20 of a task at 9 s replace the job spec's mean in the plan
    // and are shown as in effect; a negative duration, or a sum that makes no mean duration, is
    // refused naming the entry.
    let samples = vec!["9.0"; 20].join(", ");
    let timed = scratch(
        "timed.json",
        &format!(
            r#"{{"environmentSteps": {{"swe-bench-style": {{"samples": [{samples}], "total": 20, "sum": 180.0}}}}}}"#
        ),
    );
    let shown = rollfleet(&[
        "profile",
        "show",
        "examples/jobs/rollart-agentic.yaml",
        "--profiles",
        timed.to_str().unwrap(),
    ]);
    assert_eq!(shown.status.code(), Some(0), "{}", text(&shown.stderr));
    let shown = text(&shown.stdout);
    let line = shown
        .lines()
        .find(|l| l.starts_with("environment-step") && l.contains("swe-bench-style"))
        .unwrap_or_else(|| panic!("{shown}"));
    assert!(
        line.contains("9.0000") && line.contains("measured"),
        "{line}"
    );
    let longer = rollfleet(&[
        "plan",
        "examples/jobs/rollart-agentic.yaml",
        "-o",
        "json",
        "--profiles",
        timed.to_str().unwrap(),
    ]);
    assert!(
        step(&longer) > step(&base),
        "{} vs {}",
        step(&longer),
        step(&base)
    );
    for (body, entry) in [
        (
            r#"{"environmentSteps": {"webshop": {"samples": [0.5, -1.0], "total": 2, "sum": 1.0}}}"#,
            "environmentSteps.webshop",
        ),
        (
            r#"{"rewards": {"unit-tests": {"samples": [4.0], "total": 1, "sum": 1e300}}}"#,
            "rewards.unit-tests",
        ),
    ] {
        let bad = scratch("bad-timed.json", body);
        let out = rollfleet(&["profile", "import", bad.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(3), "{body}");
        assert!(text(&out.stderr).contains(entry), "{}", text(&out.stderr));
    }
}

#[test]
fn sim_writes_measured_profiles_that_plan_uses_and_names_as_measured() {
    let profiles = scratch("sim-profiles.json", "");
    let out = rollfleet(&[
        "sim",
        "examples/jobs/quickstart.yaml",
        "--baseline",
        "rollfleet",
        "--sim-bandwidth-efficiency",
        "0.6",
        "--profiles-out",
        profiles.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let store: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&profiles).unwrap()).unwrap();
    assert!(
        store["measured"]["decode"]["decode"]["samples"]
            .as_array()
            .is_some_and(|s| s.len() >= 20),
        "{store}"
    );
    // Every one of them is the simulator's own roofline, and the store says so.
    let decode = &store["measured"]["decode"]["decode"];
    assert_eq!(decode["modelled"], decode["total"], "{store}");
    let out = rollfleet(&[
        "plan",
        "examples/jobs/quickstart.yaml",
        "--profiles",
        profiles.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("decode") && l.contains("of peak bandwidth"))
        .unwrap();
    assert!(
        line.contains("60.0%") && line.contains("measured on emulated or simulated hardware"),
        "{line}"
    );
    // A pool the run never served on keeps the model's figure, and says so.
    assert!(stdout.contains("model assumption"), "{stdout}");

    // Without the rollfleet policy there is nothing to write: a clear error, not an empty file.
    let out = rollfleet(&[
        "sim",
        "examples/jobs/quickstart.yaml",
        "--baseline",
        "sync",
        "--profiles-out",
        profiles.to_str().unwrap(),
    ]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains("--profiles-out"),
        "{}",
        text(&out.stderr)
    );
    let out = rollfleet(&[
        "sim",
        "examples/jobs/quickstart.yaml",
        "--sim-compute-efficiency",
        "1.5",
    ]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains("--sim-compute-efficiency"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn sim_refuses_a_malformed_pool_loss_naming_the_flag_and_the_problem() {
    for (arg, why) in [
        ("decode", "no ':'"),
        ("nowhere:0.3@2", "no pool \"nowhere\""),
        ("envs:0.3@2", "not a GPU pool"),
        ("decode:0.3@5", "step 5 is not in 1..5"),
    ] {
        let out = rollfleet(&["sim", "examples/jobs/quickstart.yaml", "--lose", arg]);
        assert_ne!(out.status.code(), Some(0), "{arg}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(&format!("--lose {arg}")) && stderr.contains(why),
            "{arg}: {stderr}"
        );
    }
}

/// Whether this machine has an NVIDIA driver (then a probe may add real figures).
fn rollfleet_gpus_present() -> bool {
    Path::new("/proc/driver/nvidia").exists()
}

#[test]
fn catalog_lists_every_builtin_gpu_as_json_and_yaml() {
    let out = rollfleet(&["catalog", "-o", "json"]);
    assert_eq!(out.status.code(), Some(0));
    let listing: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = listing["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "A100-80G", "B200", "H100", "H20", "H200", "H800", "L20", "L40S"
        ]
    );

    let out = rollfleet(&["catalog", "-o", "yaml"]);
    assert!(text(&out.stdout).contains("- name: H800\n  bf16DenseTflops: 989.0\n"));
}

#[test]
fn catalog_with_a_job_shows_its_overrides() {
    let good = std::fs::read_to_string(repo().join("examples/jobs/quickstart.yaml")).unwrap();
    let custom = good.replace(
        "  pools:\n",
        "  catalog:\n    gpus:\n      - {name: H20, bf16DenseTflops: 148, memoryGb: 96, memoryBandwidthGBps: 4000, interconnectGBps: 900, pricePerHourUsd: 0.85}\n  pools:\n",
    );
    let path = scratch("custom.yaml", &custom);
    let out = rollfleet(&["catalog", "--job", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let h20 = text(&out.stdout)
        .lines()
        .find(|l| l.starts_with("H20 "))
        .unwrap()
        .to_owned();
    assert!(h20.contains("0.85") && h20.ends_with("user"), "{h20}");
}

#[test]
fn gpus_either_lists_real_gpus_or_says_plainly_there_are_none() {
    let out = rollfleet(&["gpus", "-o", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    if report["available"] == false {
        // No driver: a reason, and no figures at all (not zeros).
        assert!(report["reason"].as_str().unwrap().contains("NVML"));
        assert_eq!(report["gpus"].as_array().unwrap().len(), 0);
        let table = rollfleet(&["gpus"]);
        assert!(text(&table.stdout).starts_with("no GPU on this node: "));
    } else {
        assert!(!report["gpus"].as_array().unwrap().is_empty());
    }
}

#[test]
fn sim_compares_rollfleet_with_every_baseline_and_labels_the_figures_as_modelled() {
    let out = rollfleet(&["sim", "examples/jobs/quickstart.yaml"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("simulated on a virtual clock"), "{stdout}");
    assert!(stdout.contains("not measured"), "{stdout}");
    for policy in ["sync ", "sync-disaggregated", "one-step-off", "rollfleet"] {
        assert!(stdout.contains(policy), "{policy} missing: {stdout}");
    }
    assert!(
        text(&out.stderr).contains("scheduler events"),
        "progress goes to stderr"
    );
}

#[test]
fn sim_json_is_byte_identical_across_processes_and_yaml_carries_the_same_report() {
    let args = [
        "sim",
        "-o",
        "json",
        "--seed",
        "3",
        "examples/jobs/quickstart.yaml",
    ];
    let first = rollfleet(&args);
    let second = rollfleet(&args);
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    assert_eq!(first.stdout, second.stdout);
    let json: serde_json::Value = serde_json::from_slice(&first.stdout).unwrap();

    let yaml = rollfleet(&[
        "sim",
        "-o",
        "yaml",
        "--seed",
        "3",
        "examples/jobs/quickstart.yaml",
    ]);
    assert_eq!(yaml.status.code(), Some(0));
    let from_yaml: serde_json::Value = serde_yaml_ng::from_slice(&yaml.stdout).unwrap();
    assert_eq!(json["policies"].as_array().unwrap().len(), 4);
    assert_eq!(json["policies"], from_yaml["policies"]);
}

#[test]
fn sim_of_an_invalid_job_exits_3_naming_the_field() {
    let good = std::fs::read_to_string(repo().join("examples/jobs/quickstart.yaml")).unwrap();
    let path = scratch("bad-sim.yaml", &good.replace("gpu: H20", "gpu: H900"));
    let out = rollfleet(&["sim", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out.stderr).contains("spec.pools[1].gpu: unknown GPU \"H900\""));
}

#[test]
fn run_refuses_a_slowdown_of_a_pool_the_job_has_no_gpus_in_or_a_share_past_one() {
    let out = rollfleet(&[
        "run",
        "examples/jobs/quickstart.yaml",
        "--emulate-slowdown",
        "envs=0.5",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("job quickstart has no GPU pool \"envs\""),
        "{}",
        text(&out.stderr)
    );
    let out = rollfleet(&[
        "run",
        "examples/jobs/quickstart.yaml",
        "--emulate-slowdown",
        "decode=1.5",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a malformed flag is a usage error"
    );
    assert!(
        text(&out.stderr).contains("SHARE in (0, 1]"),
        "{}",
        text(&out.stderr)
    );
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--replan-on-drift",
        "0",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out.stderr).contains("--replan-on-drift 0: the margin must be a positive share"));
}

#[test]
fn a_journal_that_cannot_be_written_or_is_not_a_journal_is_refused_naming_the_file() {
    // A full disk: the scheduler does not start a job it could not resume.
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--journal",
        "/dev/full",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("journal /dev/full:"),
        "{}",
        text(&out.stderr)
    );
    // A job file given as the journal is not replayed, and not overwritten.
    let job = scratch("journal-is-a-job.yaml", "name: not a journal\n");
    let out = rollfleet(&[
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--journal",
        job.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("journal-is-a-job.yaml"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&job).unwrap(),
        "name: not a journal\n"
    );
}

#[test]
fn a_scheduler_given_half_a_tls_identity_or_a_key_file_without_a_key_serves_nothing_and_says_why() {
    let cert = scratch(
        "tls-cert.pem",
        "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
    );
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        cert.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--tls-key"),
        "{}",
        text(&out.stderr)
    );
    let key = scratch("tls-key.pem", "not a key\n");
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(
        said.contains("--tls-key") && said.contains("tls-key.pem") && said.contains("PRIVATE KEY"),
        "{said}"
    );
    assert!(
        text(&out.stdout).is_empty(),
        "it listened: {}",
        text(&out.stdout)
    );
}

#[test]
fn client_certificate_flags_come_with_what_they_need() {
    // A client certificate needs its key and the CA that signed the scheduler's.
    let out = rollfleet(&["job", "status", "quickstart", "--tls-cert", "client.pem"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(
        said.contains("--tls-key") && said.contains("--tls-ca"),
        "{said}"
    );
    // A scheduler asks for client certificates only when it serves TLS itself.
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--tls-client-ca",
        "ca.pem",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--tls-cert"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn journal_sync_without_a_journal_is_refused_naming_the_flag_it_needs() {
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--journal-sync",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--journal <FILE>"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn serverless_serve_answers_the_lambda_invoke_api_and_stops_on_ctrl_c() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::Stdio;

    let mut child = Command::new(env!("CARGO_BIN_EXE_rollfleet"))
        .args(["serverless", "serve", "--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    let address = banner
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {banner:?}"))
        .to_owned();
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    let body = r#"{"response":"the answer is \\boxed{42}","reference":"42"}"#;
    write!(
        stream,
        "POST /2015-03-31/functions/math_answer/invocations HTTP/1.1\r\nhost: localhost\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("\"reward\":1.0"), "{reply}");

    let interrupted = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

#[test]
fn rollfleet_job_says_when_the_address_answers_but_is_no_scheduler() {
    // A plain HTTP/1.1 server on the port (a web server, a proxy): it answers every request
    // with the same page and closes.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            use std::io::{Read, Write};
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
            );
        }
    });
    let out = rollfleet(&["job", "status", "quickstart", "--scheduler", &url]);
    assert_eq!(out.status.code(), Some(1));
    let said = text(&out.stderr);
    assert!(
        said.contains(&format!("{url} did not answer as a rollfleet scheduler")),
        "{said}"
    );
}

#[test]
fn rollfleet_job_names_the_scheduler_it_cannot_reach_and_refuses_a_url_that_is_not_one() {
    // Port 1 on loopback: nothing listens there.
    let out = rollfleet(&[
        "job",
        "status",
        "quickstart",
        "--scheduler",
        "http://127.0.0.1:1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let said = text(&out.stderr);
    assert!(
        said.contains("cannot reach the scheduler at http://127.0.0.1:1"),
        "{said}"
    );
    // A value that is no URL is a bad command line, refused by the argument parser.
    let out = rollfleet(&["job", "cancel", "quickstart", "--scheduler", "not a url"]);
    assert_eq!(out.status.code(), Some(2));
    let said = text(&out.stderr);
    assert!(
        said.contains("--scheduler") && said.contains("\"not a url\" is not a URL"),
        "{said}"
    );
}

#[test]
fn a_scheduler_url_without_a_scheme_is_a_usage_error_saying_what_to_write() {
    let checkpoints = std::env::temp_dir().join(format!(
        "rollfleet-cli-{}-no-scheme-checkpoints",
        std::process::id()
    ));
    for args in [
        &["job", "status", "quickstart", "--scheduler", "127.0.0.1:1"][..],
        &["job", "watch", "quickstart", "--scheduler", "127.0.0.1:1"],
        &["job", "cancel", "quickstart", "--scheduler", "127.0.0.1:1"],
        &[
            "job",
            "submit",
            "examples/jobs/quickstart.yaml",
            "--scheduler",
            "127.0.0.1:1",
        ],
        &["worker", "--pool", "decode", "--scheduler", "127.0.0.1:1"],
        &[
            "train",
            "examples/jobs/quickstart-external.yaml",
            "--checkpoints",
            checkpoints.to_str().unwrap(),
            "--scheduler",
            "127.0.0.1:1",
        ],
    ] {
        let out = rollfleet(args);
        let said = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(said.contains("--scheduler"), "{args:?}: {said}");
        assert!(
            said.contains(
                "127.0.0.1:1 has no scheme; use http://127.0.0.1:1 or https://127.0.0.1:1"
            ),
            "{args:?}: {said}"
        );
        assert!(
            !said.contains("unreachable") && !said.contains("cannot reach"),
            "{said}"
        );
    }
    assert!(!checkpoints.exists());
}

#[test]
fn rollfleet_scheduler_in_the_environment_is_the_default_of_every_scheduler_flag() {
    const VAR: &str = "ROLLFLEET_SCHEDULER";
    // Read: a value with no scheme is refused as the flag's would be, naming the variable.
    for args in [
        &["job", "status", "quickstart"][..],
        &["worker", "--pool", "decode"],
    ] {
        let out = rollfleet_with_env(args, VAR, "127.0.0.1:9");
        let said = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(
            said.contains("127.0.0.1:9 has no scheme") && said.contains(VAR),
            "{args:?}: {said}"
        );
    }
    // A good one is used.
    let out = rollfleet_with_env(&["job", "status", "quickstart"], VAR, "http://127.0.0.1:1");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot reach the scheduler at http://127.0.0.1:1"),
        "{}",
        text(&out.stderr)
    );
    // The flag wins over the variable.
    let out = rollfleet_with_env(
        &[
            "job",
            "status",
            "quickstart",
            "--scheduler",
            "http://127.0.0.1:1",
        ],
        VAR,
        "127.0.0.1:9",
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("http://127.0.0.1:1"));
    // Unset, the scheduler's own default address, as before.
    let out = rollfleet(&["job", "status", "quickstart"]);
    let said = text(&out.stderr);
    assert_ne!(out.status.code(), Some(2), "{said}");
    assert!(said.contains("http://127.0.0.1:7070"), "{said}");
    // Every command with the flag says so in its help.
    for args in [
        &["job", "submit", "--help"][..],
        &["job", "status", "--help"],
        &["job", "watch", "--help"],
        &["job", "cancel", "--help"],
        &["worker", "--help"],
        &["train", "--help"],
    ] {
        let out = rollfleet(args);
        assert_eq!(out.status.code(), Some(0));
        assert!(
            text(&out.stdout).contains("[env: ROLLFLEET_SCHEDULER="),
            "{args:?}: {}",
            text(&out.stdout)
        );
    }
}

#[test]
fn rollfleet_job_submit_checks_the_job_before_contacting_any_scheduler() {
    let job = scratch(
        "bad-submit.yaml",
        &std::fs::read_to_string(repo().join("examples/jobs/quickstart.yaml"))
            .unwrap()
            .replace("gpu: ", "gpu: NoSuchGpu-"),
    );
    // The scheduler URL is unreachable: an invalid job must be refused before that matters.
    let out = rollfleet(&[
        "job",
        "submit",
        job.to_str().unwrap(),
        "--scheduler",
        "http://127.0.0.1:1",
    ]);
    assert_eq!(out.status.code(), Some(3));
    let said = text(&out.stderr);
    assert!(
        said.contains("gpu") && !said.contains("cannot reach"),
        "{said}"
    );
}

/// Runs `args` with stdout a pipe whose reader leaves early: at once, or after one line.
fn with_a_reader_that_leaves(args: &[&str], read_a_line_first: bool) -> Output {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let mut child = command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    if read_a_line_first {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
    } else {
        drop(stdout);
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_reader_that_closes_the_pipe_early_is_no_error() {
    // Each command prints more than one line; whether the reader has gone before the writes
    // is a race, hence the rounds.
    let commands: [(&[&str], bool); 4] = [
        (&["catalog", "-o", "json"], false),
        (&["catalog"], false),
        (&["completion", "bash"], false),
        (
            &[
                "sim",
                "examples/jobs/quickstart.yaml",
                "--baseline",
                "rollfleet",
                "-o",
                "json",
            ],
            true,
        ),
    ];
    for round in 0..20 {
        for (args, progress_on_stderr) in commands {
            let out = with_a_reader_that_leaves(args, round % 2 == 1);
            let stderr = text(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{args:?}, round {round}: {stderr}"
            );
            assert!(
                !stderr.contains("Broken pipe")
                    && !stderr.contains("error")
                    && !stderr.contains("panicked"),
                "{args:?}, round {round}: {stderr}"
            );
            if !progress_on_stderr {
                assert!(stderr.is_empty(), "{args:?}, round {round}: {stderr}");
            }
        }
    }
}

#[test]
fn counts_of_one_are_printed_in_the_singular() {
    let job = std::fs::read_to_string(repo().join("examples/jobs/quickstart.yaml"))
        .unwrap()
        .replace("rolloutBatchSize: 32", "rolloutBatchSize: 4")
        .replace("trainBatchSize: 16", "trainBatchSize: 4")
        .replace("steps: 5", "steps: 1");
    let path = scratch("one-of-everything.yaml", &job);
    let out = rollfleet(&["validate", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("1 group of 4 = 4 trajectories per step")
            && stdout.contains("1 optimizer update per step")
            && stdout.contains("max staleness 1, 1 step\n"),
        "{stdout}"
    );
    // And the plural stays for other counts.
    let out = rollfleet(&["validate", "examples/jobs/quickstart.yaml"]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("8 groups of 4 = 32 trajectories per step")
            && stdout.contains("2 optimizer updates per step")
            && stdout.contains("5 steps"),
        "{stdout}"
    );
}

#[test]
fn the_top_level_help_shows_rollfleet_run_on_the_quickstart_among_its_examples() {
    let out = rollfleet(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = text(&out.stdout);
    let examples = stdout.split("Examples:").nth(1).unwrap_or_default();
    assert!(
        examples.contains("\n  rollfleet run examples/jobs/quickstart.yaml"),
        "{stdout}"
    );
    assert!(stdout.contains("ROLLFLEET_SCHEDULER"), "{stdout}");
}

#[test]
fn completion_prints_a_script_for_bash_zsh_and_fish() {
    for shell in ["bash", "zsh", "fish"] {
        let out = rollfleet(&["completion", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}: {}", text(&out.stderr));
        assert!(out.stderr.is_empty(), "{shell}: {}", text(&out.stderr));
        let script = text(&out.stdout);
        assert!(
            script.contains("rollfleet")
                && script.contains("validate")
                && script.contains("journal"),
            "{shell}: {script}"
        );
    }
    let out = rollfleet(&["completion", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
}
