//! Helpers the spec's integration tests share: the quick-start job and exact edits of it.

#![allow(dead_code)] // each test file uses its own subset

use std::path::PathBuf;

use rollfleet_spec::parse_job;

/// The repository's root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The quick-start job's YAML.
pub fn quickstart() -> String {
    std::fs::read_to_string(repo_root().join("examples/jobs/quickstart.yaml")).unwrap()
}

/// Replaces exactly one occurrence, so a case cannot silently stop mutating anything.
pub fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "`{from}` must occur exactly once"
    );
    text.replacen(from, to, 1)
}

/// What validation says of `text` (nothing when it is a valid job).
pub fn problems_of(text: &str) -> Vec<String> {
    match parse_job(text.as_bytes(), "job.yaml") {
        Ok(_) => vec![],
        Err(error) => error.problems().iter().map(|p| p.to_string()).collect(),
    }
}
