//! The `rollfleet` binary as a user meets it: run as a separate process, judged by its exit
//! code, its stdout and its stderr. This file: validating jobs, bad input and files, help,
//! usage errors and completions; `cli_plan_sim.rs` and `cli_runtime.rs` hold the rest.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::Path;
use std::process::Output;

#[path = "common/cli.rs"]
mod harness;
use harness::*;

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
fn sim_of_an_invalid_job_exits_3_naming_the_field() {
    let good = std::fs::read_to_string(repo().join("examples/jobs/quickstart.yaml")).unwrap();
    let path = scratch("bad-sim.yaml", &good.replace("gpu: H20", "gpu: H900"));
    let out = rollfleet(&["sim", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out.stderr).contains("spec.pools[1].gpu: unknown GPU \"H900\""));
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

#[test]
fn validate_and_sim_read_a_csv_distribution_beside_the_job_from_any_directory() {
    let job = repo().join("scheduler/spec/tests/data/csv-lengths.yaml");
    let job = job.to_str().unwrap();
    // Run from elsewhere: the CSV is found beside the job file, not in the current directory.
    let elsewhere = std::env::temp_dir();
    let out = command(&["validate", job])
        .current_dir(&elsewhere)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    // The sokoban actions: the exact mean of the file's 40 rows, 116.5 tokens.
    assert!(
        stdout.contains("valid job \"csv-lengths\"") && stdout.contains("~116 tok"),
        "{stdout}"
    );
    let out = command(&["sim", job])
        .current_dir(&elsewhere)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("invariants held"));
    // Moved away from its file, the job is invalid, naming the field and the file.
    let moved = scratch("csv-moved.yaml", &std::fs::read_to_string(job).unwrap());
    let out = rollfleet(&["sim", moved.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("spec.tasks[0].actionTokens.path: ")
            && stderr.contains("action_tokens.csv: no such file"),
        "{stderr}"
    );
}
