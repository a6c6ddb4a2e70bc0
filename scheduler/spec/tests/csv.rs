//! Distributions read from a column of a CSV file: where the file is found, what is kept of it,
//! and every way a file or a column can be refused, each named by its field and row.

#![allow(clippy::unwrap_used)] // tests may fail loudly

mod common;

use std::path::PathBuf;

use rollfleet_spec::{Distribution, MAX_CSV_BYTES, MAX_CSV_ROWS, load_job_file, parse_job};

use common::{edit, problems_of, quickstart, repo_root};

fn data() -> PathBuf {
    repo_root().join("scheduler/spec/tests/data")
}

/// A directory of its own for one test's files.
fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rollfleet-csv-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The quick-start with its first task's action tokens drawn from `path`'s `column`.
fn with_csv_actions(path: &str, column: &str) -> String {
    edit(
        &quickstart(),
        "actionTokens: { distribution: lognormal, median: 48, p99: 200, max: 256 }",
        &format!("actionTokens: {{ distribution: csv, path: '{path}', column: {column} }}"),
    )
}

/// The problems of a job whose actions come from a file holding `contents`.
fn problems_with_file(test: &str, contents: &str) -> Vec<String> {
    let path = scratch_dir(test).join("rows.csv");
    std::fs::write(&path, contents).unwrap();
    problems_of(&with_csv_actions(path.to_str().unwrap(), "tokens"))
}

fn assert_one_problem(problems: &[String], expected: &str) {
    assert!(
        problems.len() == 1 && problems[0].contains(expected),
        "{problems:#?} lacks {expected}"
    );
}

#[test]
fn a_job_file_reads_its_csv_beside_it_and_keeps_every_row_with_their_exact_mean() {
    let job = load_job_file(&data().join("csv-lengths.yaml")).unwrap();
    let actions = &job.spec().tasks[0].action_tokens;
    let Distribution::Csv { rows, scale, .. } = &**actions else {
        panic!("{actions:?}");
    };
    assert_eq!(*scale, 1.0);
    let values = rows.values().unwrap();
    assert_eq!(values.len(), 40);
    // Rows 1 and 4 sit after a quoted note holding a comma.
    assert_eq!((values[0], values[3]), (20.0, 131.0));
    assert_eq!(actions.mean(), Some(116.5));
    assert_eq!(actions.upper_bound(), Some(219.0));
    // The reward's latency: the other column of the same file, times 1.5.
    let latency = &job.spec().rewards[1].latency_ms;
    let Distribution::Csv { rows, .. } = &**latency else {
        panic!("{latency:?}");
    };
    let raw = rows.values().unwrap();
    let exact = 1.5 * raw.iter().sum::<f64>() / raw.len() as f64;
    assert!((latency.mean().unwrap() - exact).abs() < 1e-12);
}

#[test]
fn parse_job_resolves_a_relative_path_against_the_current_directory() {
    // `cargo test` runs in the crate's directory.
    let text = with_csv_actions("tests/data/action_tokens.csv", "output_tokens");
    let job = parse_job(text.as_bytes(), "job.yaml").unwrap();
    assert_eq!(job.spec().tasks[0].action_tokens.mean(), Some(116.5));
    // The same file named from elsewhere is not there.
    let text = with_csv_actions("data/action_tokens.csv", "output_tokens");
    assert_one_problem(
        &problems_of(&text),
        "spec.tasks[0].actionTokens.path: data/action_tokens.csv: no such file",
    );
}

#[test]
fn a_clipped_csv_mean_is_the_mean_of_the_clipped_scaled_rows() {
    let text = edit(
        &with_csv_actions("tests/data/action_tokens.csv", "output_tokens"),
        "column: output_tokens }",
        "column: output_tokens, scale: 2, max: 100 }",
    );
    let job = parse_job(text.as_bytes(), "job.yaml").unwrap();
    let actions = &job.spec().tasks[0].action_tokens;
    let Distribution::Csv { rows, .. } = &**actions else {
        panic!();
    };
    let values = rows.values().unwrap();
    let exact = values.iter().map(|v| (2.0 * v).min(100.0)).sum::<f64>() / values.len() as f64;
    assert_eq!(actions.mean(), Some(exact));
    assert!(exact < 100.0 && exact > 2.0 * 20.0, "{exact}");
    assert_eq!(actions.upper_bound(), Some(100.0));
}

#[test]
fn a_job_written_back_names_its_file_not_its_rows() {
    let job = load_job_file(&data().join("csv-lengths.yaml")).unwrap();
    let yaml = serde_yaml_ng::to_string(&job.manifest).unwrap();
    assert!(
        yaml.contains("distribution: csv") && yaml.contains("path: action_tokens.csv"),
        "{yaml}"
    );
    assert!(!yaml.contains("rows"), "{yaml}");
}

#[test]
fn a_missing_file_is_named_with_its_field_and_where_it_was_looked_for() {
    assert_one_problem(
        &problems_of(&with_csv_actions("no/such/lengths.csv", "tokens")),
        "spec.tasks[0].actionTokens.path: no/such/lengths.csv: no such file (a relative path \
         is resolved against the working directory of the process that reads the job)",
    );
    // Read from a job file, it was looked for beside it.
    let dir = scratch_dir("missing");
    let job = dir.join("job.yaml");
    std::fs::write(&job, with_csv_actions("no/such/lengths.csv", "tokens")).unwrap();
    let error = load_job_file(&job).unwrap_err().to_string();
    assert!(
        error.contains(&format!(
            "{}: no such file (a relative path is resolved against the job file's directory)",
            dir.join("no/such/lengths.csv").display()
        )),
        "{error}"
    );
}

#[test]
fn a_path_that_is_not_a_csv_file_is_not_read() {
    let dir = scratch_dir("not-csv");
    std::fs::create_dir_all(dir.join("folder.csv")).unwrap();
    let problems = problems_of(&with_csv_actions("/etc/passwd", "tokens"));
    assert_one_problem(
        &problems,
        "spec.tasks[0].actionTokens.path: /etc/passwd: must name a `.csv` file",
    );
    let folder = dir.join("folder.csv");
    assert_one_problem(
        &problems_of(&with_csv_actions(folder.to_str().unwrap(), "tokens")),
        "not a regular file",
    );
}

#[test]
fn a_missing_column_lists_the_columns_found() {
    assert_one_problem(
        &problems_of(&with_csv_actions(
            "tests/data/action_tokens.csv",
            "outputTokens",
        )),
        "spec.tasks[0].actionTokens.column: no column \"outputTokens\" in the header row \
         (columns found: \"episode\", \"note\", \"output_tokens\", \"reward_ms\")",
    );
}

#[test]
fn every_bad_value_is_named_by_its_field_and_row() {
    let cases = [
        (
            "tokens\n10\nmany\n",
            "row 2 (line 3): \"tokens\" is not a number: \"many\"",
        ),
        (
            "tokens\n10\n-3\n",
            "row 2 (line 3): \"tokens\" must be a finite number >= 0, got -3",
        ),
        (
            "tokens\n10\n20\nNaN\n",
            "row 3 (line 4): \"tokens\" must be a finite number >= 0, got NaN",
        ),
        (
            "tokens\ninf\n",
            "row 1 (line 2): \"tokens\" must be a finite number >= 0, got inf",
        ),
        ("id,tokens\n1,5\n2\n", "row 2 (line 3) has 1 fields"),
        ("", "the file is empty"),
        ("tokens\n", "the file has a header row but no data rows"),
    ];
    for (i, (contents, expected)) in cases.into_iter().enumerate() {
        let problems = problems_with_file(&format!("bad-{i}"), contents);
        assert_one_problem(&problems, "spec.tasks[0].actionTokens.path: ");
        assert_one_problem(&problems, expected);
    }
}

#[test]
fn a_file_over_its_row_or_byte_bound_is_refused_saying_why() {
    let rows = format!("tokens\n{}", "1\n".repeat(MAX_CSV_ROWS + 1));
    let problems = problems_with_file("rows", &rows);
    assert_one_problem(
        &problems,
        "more than 1000000 data rows (each row's value is kept in memory for the whole run)",
    );
    // A sparse file just over the byte bound: refused from its size, before it is read.
    let path = scratch_dir("bytes").join("huge.csv");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(MAX_CSV_BYTES + 1).unwrap();
    assert_one_problem(
        &problems_of(&with_csv_actions(path.to_str().unwrap(), "tokens")),
        "67108865 bytes is too large for a CSV distribution (the limit is 67108864 bytes, 64 \
         MiB: the file is held in memory while it is read)",
    );
}

#[test]
fn a_row_above_the_fields_bound_is_refused_naming_the_row_and_the_bound() {
    let text = with_csv_actions("tests/data/too_long_actions.csv", "output_tokens");
    assert_one_problem(
        &problems_of(&text),
        "spec.tasks[0].actionTokens.path: tests/data/too_long_actions.csv: row 2 of \
         \"output_tokens\" is 20000000 (times scale 1: 20000000), above the largest allowed, \
         10485760 tokens (the longest context window accepted)",
    );
    // A scale can carry the rows past the bound too, and a `max` can hold them below it.
    let scaled = edit(
        &with_csv_actions("tests/data/action_tokens.csv", "output_tokens"),
        "column: output_tokens }",
        "column: output_tokens, scale: 1e6 }",
    );
    assert_one_problem(
        &problems_of(&scaled),
        "row 28 of \"output_tokens\" is 219 (times scale 1000000: 219000000), above the largest \
         allowed",
    );
    let clipped = edit(&scaled, "scale: 1e6 }", "scale: 1e6, max: 4000 }");
    assert_eq!(problems_of(&clipped), Vec::<String>::new());
}

#[test]
fn a_serverless_reward_whose_csv_latencies_outlast_the_platform_is_refused() {
    let dir = scratch_dir("lambda");
    std::fs::write(dir.join("ms.csv"), "ms\n5\n1000000\n").unwrap();
    let text = edit(
        &quickstart(),
        "latencyMs: { distribution: lognormal, median: 3, p99: 20 }",
        &format!(
            "latencyMs: {{ distribution: csv, path: '{}', column: ms }}",
            dir.join("ms.csv").display()
        ),
    );
    assert_one_problem(
        &problems_of(&text),
        "spec.rewards[1].latencyMs.path: 1000000 ms is longer than aws-lambda lets one \
         invocation run (900 s)",
    );
}

#[test]
fn a_distribution_of_a_job_built_in_code_without_reading_its_file_is_refused() {
    let job = load_job_file(&data().join("csv-lengths.yaml")).unwrap();
    let mut spec = job.spec().clone();
    spec.tasks[0].action_tokens = rollfleet_spec::Dist(Distribution::Csv {
        path: "action_tokens.csv".into(),
        column: "output_tokens".into(),
        scale: 1.0,
        max: None,
        rows: Default::default(),
    });
    let error = job
        .with_pools(spec.pools.clone(), "inventory.yaml")
        .map(|_| ())
        .and_then(|()| {
            let mut unread = job.clone();
            unread.manifest.spec = spec;
            unread.with_pools(job.spec().pools.clone(), "inventory.yaml")
        })
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("the job's spec.tasks[0].actionTokens.path: the CSV file was not read"),
        "{error}"
    );
}

#[test]
fn a_job_sent_elsewhere_names_its_csv_files_by_their_absolute_paths_beside_the_job_file() {
    let mut job = load_job_file(&data().join("csv-lengths.yaml")).unwrap();
    assert!(rollfleet_spec::absolute_csv_paths(&mut job.manifest, &data()).unwrap());
    let yaml = serde_yaml_ng::to_string(&job.manifest).unwrap();
    let beside = data().join("action_tokens.csv");
    assert!(
        yaml.contains(&format!("path: {}", beside.display())),
        "{yaml}"
    );
    // Parsed as text anywhere, it reads the same rows.
    let again = parse_job(yaml.as_bytes(), "sent").unwrap();
    assert_eq!(
        again.spec().tasks[0].action_tokens.mean(),
        job.spec().tasks[0].action_tokens.mean()
    );
    // Paths already absolute are left as they are.
    assert!(!rollfleet_spec::absolute_csv_paths(&mut job.manifest, &data()).unwrap());
}

#[test]
fn a_job_sent_with_its_directory_is_rewritten_with_absolute_csv_paths_and_any_other_is_kept_as_written()
 {
    let file = data().join("csv-lengths.yaml");
    let text = std::fs::read(&file).unwrap();
    let sent = rollfleet_spec::job_yaml_for_dir(&text, "job_yaml", &data()).unwrap();
    let beside = data().join("action_tokens.csv");
    assert!(
        sent.contains(&format!("path: {}", beside.display())),
        "{sent}"
    );
    // Resolved against another directory, the file is not there: the field says so.
    let elsewhere = data().join("no-such-directory");
    let error = rollfleet_spec::job_yaml_for_dir(&text, "job_yaml", &elsewhere).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("spec.tasks[0].actionTokens.path"),
        "{error}"
    );
    // A job naming no CSV file is sent byte for byte.
    let plain = std::fs::read(repo_root().join("examples/jobs/quickstart.yaml")).unwrap();
    let kept = rollfleet_spec::job_yaml_for_dir(&plain, "job_yaml", &data()).unwrap();
    assert_eq!(kept.as_bytes(), &plain[..]);
}
