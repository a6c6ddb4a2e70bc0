//! What a client without the scheduler's token meets: `rollfleet job status` refused, exit 1.

use std::process::Command;

/// Runs `rollfleet job status` against `url` with no token in its environment and checks that
/// the scheduler refused it.
pub fn assert_job_status_refused_without_token(bin: &str, url: &str) {
    let out = Command::new(bin)
        .args(["job", "status", "quickstart", "--scheduler", url])
        .env_remove("ROLLFLEET_TOKEN")
        .output()
        .expect("rollfleet job status runs");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refused the call"),
        "{out:?}"
    );
}
