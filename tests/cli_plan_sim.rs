//! The `rollfleet` binary's planning and simulation commands as a user meets them (`plan`,
//! `profiles`, `sim`, `catalog`, `gpus`): run as a separate process, judged by its exit code,
//! its stdout and its stderr.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::Path;
use std::process::Output;

#[path = "common/cli.rs"]
mod harness;
use harness::*;

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
    // The window the scheduler would run it with, and the trials that chose it.
    let window = stdout
        .lines()
        .find(|l| l.starts_with("admission window: "))
        .unwrap_or_default();
    assert!(window.contains("(chosen)"), "{stdout}");
    // How the model has each task's groups live: a member, the slowest one, to done, and the
    // wait for the trainer.
    let lives = stdout
        .lines()
        .find(|l| l.starts_with("group lives "))
        .unwrap_or_default();
    for task in ["swe-bench-style", "webshop", "sokoban", "math-with-tools"] {
        assert!(lives.contains(&format!("{task} ")), "{stdout}");
    }
    assert_eq!(lives.matches(" / ").count(), 12, "{lives}");
    let json = rollfleet(&["plan", "examples/jobs/rollart-agentic.yaml", "-o", "json"]);
    let value: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let probes = value["admission_window"]["probes"].as_array().unwrap();
    // The three widths always tried and, as the rule wins on this job, a quarter narrower.
    let widths: Vec<i64> = probes
        .iter()
        .map(|p| p["widening_quarters"].as_i64().unwrap())
        .collect();
    assert_eq!(widths, [0, 1, 2, -1], "{}", value["admission_window"]);
    assert_eq!(
        value["admission_window"]["widening_quarters"].as_i64(),
        Some(0)
    );
    let task_lives = value["plan"]["prediction"]["task_lives"]
        .as_array()
        .unwrap();
    assert_eq!(task_lives.len(), 4);
    for life in task_lives {
        let (member, group) = (
            life["member_s"].as_f64().unwrap(),
            life["group_s"].as_f64().unwrap(),
        );
        assert!(0.0 < member && member < group, "{life}");
        assert!(life["trainer_wait_s"].as_f64().unwrap() > 0.0, "{life}");
    }
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

#[test]
fn plan_never_predicts_a_step_below_the_fixed_yardstick_and_keeps_the_models_own_figure() {
    for job in [
        "rollart-agentic",
        "holdout-math-code",
        "holdout-web-agent",
        "holdout-moe-agent",
        "holdout-mixtral-search",
    ] {
        let path = format!("examples/jobs/{job}.yaml");
        let out = rollfleet(&["plan", &path, "--compare", "-o", "json"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let predicted = value["predicted_step_s"].as_f64().unwrap();
        let yardstick = value["yardstick"]["step_s"].as_f64().unwrap();
        let model = value["plan"]["prediction"]["step_s"].as_f64().unwrap();
        assert!(predicted >= yardstick, "{job}: {predicted} < {yardstick}");
        assert_eq!(predicted, model.max(yardstick), "{job}");
        // The job's average adds its start and its end to the steady step, held at the
        // yardstick as well.
        let job_average = value["predicted_job_step_s"].as_f64().unwrap();
        let model_average = value["plan"]["prediction"]["job_step_s"].as_f64().unwrap();
        assert_eq!(job_average, model_average.max(yardstick), "{job}");
        assert!(
            job_average >= predicted,
            "{job}: {job_average} < {predicted}"
        );
        match value["predicted_below_yardstick"].as_f64() {
            Some(below) => assert!(below == model && below < yardstick, "{job}: {value}"),
            None => assert!(model >= yardstick, "{job}: {value}"),
        }
        for compared in value["compared"].as_array().unwrap() {
            let step = compared["step_s"].as_f64().unwrap();
            assert!(step >= yardstick, "{job}: {compared}");
        }
    }
    // The web agent's model sits a few percent under its yardstick: the table says it was raised,
    // and by how much.
    let out = rollfleet(&["plan", "examples/jobs/holdout-web-agent.yaml"]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("raised to the fixed yardstick") && stdout.contains("the model said"),
        "{stdout}"
    );
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
    // The yardstick assumes the model's shares of peak, so it does not judge measured ones.
    assert!(stdout.contains("no fixed yardstick"), "{stdout}");

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

#[test]
fn sim_runs_a_job_on_an_inventory_and_checks_it_as_plan_does() {
    // The quick-start's pools with four H20s instead of two: the decode pool the run reports
    // is the inventory's.
    let inventory = scratch(
        "quickstart-inventory.yaml",
        "pools:\n  - { name: prefill, gpu: H800, count: 1 }\n  \
         - { name: decode, gpu: H20, count: 4 }\n  \
         - { name: train, gpu: H800, count: 1, roles: [train] }\n  \
         - { name: envs, cpu: c7i.8xlarge, count: 1 }\n  \
         - { name: rewards, serverless: aws-lambda, concurrency: 16 }\n",
    );
    let run = |inventory: &Path| {
        rollfleet(&[
            "sim",
            "examples/jobs/quickstart.yaml",
            "--inventory",
            inventory.to_str().unwrap(),
            "--baseline",
            "rollfleet",
            "--steps",
            "2",
            "-o",
            "json",
        ])
    };
    let out = run(&inventory);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pools = &report["policies"][0]["pools"];
    let decode = pools
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "decode")
        .unwrap();
    assert_eq!(decode["use_"], "generate 1x4", "{pools}");

    // Its problems are named by their path in the inventory, the job's with it in the job.
    let broken = scratch(
        "broken-inventory.yaml",
        "pools:\n  - { name: decode, gpu: H20, count: 4 }\n  \
         - { name: decode, gpu: H800, count: 1 }\n",
    );
    let out = run(&broken);
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("pools[1].name: duplicate pool name \"decode\"")
            && stderr.contains("broken-inventory.yaml"),
        "{stderr}"
    );
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
    for policy in [
        "sync ",
        "sync-disaggregated",
        "one-step-off",
        "areal-like",
        "rollfleet",
    ] {
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
    let names: Vec<&str> = json["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "sync",
            "sync-disaggregated",
            "one-step-off",
            "areal-like",
            "rollfleet"
        ]
    );
    assert_eq!(json["policies"], from_yaml["policies"]);
}
