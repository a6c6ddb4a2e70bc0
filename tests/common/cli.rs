//! The harness the CLI tests (`tests/cli*.rs`) share: the `rollfleet` binary run from the
//! repository as a separate process, its output as text, and a scratch folder per test.

#![allow(dead_code)] // each test file includes this module and uses part of it

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The binary, run from the repository, with no `ROLLFLEET_SCHEDULER` of the caller's shell.
pub fn command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rollfleet"));
    command
        .args(args)
        .current_dir(repo())
        .env_remove("ROLLFLEET_SCHEDULER");
    command
}

pub fn rollfleet(args: &[&str]) -> Output {
    command(args).output().unwrap()
}

pub fn rollfleet_with_env(args: &[&str], name: &str, value: &str) -> Output {
    command(args).env(name, value).output().unwrap()
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

pub fn scratch(name: &str, contents: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rollfleet-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}
