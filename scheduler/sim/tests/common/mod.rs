//! Fixtures the simulator's integration tests share: an example job's path, the quick-start's
//! arguments, and a report of one run as JSON and as the table.
#![allow(dead_code)] // each test file includes this module and uses part of it
#![allow(clippy::unwrap_used)]

use rollfleet_sim::{OutputFormat, SimArgs};

/// The path of `examples/jobs/NAME`.
pub fn example(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/jobs")
        .join(name)
}

/// The quick-start job, cut to three steps.
pub fn quickstart_args() -> SimArgs {
    SimArgs {
        steps: Some(3),
        ..SimArgs::new(example("quickstart.yaml"))
    }
}

/// The JSON report and the table of one run of `args`.
pub fn json_and_table(args: &SimArgs) -> (serde_json::Value, String) {
    let mut out = Vec::new();
    rollfleet_sim::run(args, OutputFormat::Json, &mut out, &mut std::io::sink()).unwrap();
    let report = serde_json::from_slice(&out).unwrap();
    let mut out = Vec::new();
    rollfleet_sim::run(args, OutputFormat::Table, &mut out, &mut std::io::sink()).unwrap();
    (report, String::from_utf8(out).unwrap())
}

/// The lines of the table's section whose title starts with `title`, up to the blank line after.
pub fn table_section<'a>(table: &'a str, title: &str) -> Vec<&'a str> {
    table
        .lines()
        .skip_while(|l| !l.starts_with(title))
        .take_while(|l| !l.is_empty())
        .collect()
}
