//! How every `rollfleet` subcommand prints: one `-o table|json|yaml` flag, results on stdout,
//! errors and progress on stderr, and a fixed set of exit codes.
//!
//! Tables are for people (aligned columns, units in the cells); JSON and YAML are for programs
//! and carry the same facts with numbers unformatted.
//!
//! A reader that goes away (`rollfleet catalog -o json | head -1`) ends the command cleanly:
//! every result is written through [`Stdout`], which notes a closed pipe, and `main` then exits
//! 0 without a word, however the write error travelled back up.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::Serialize;

/// `-o` / `--output`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Aligned columns for reading.
    Table,
    /// One JSON document.
    Json,
    /// One YAML document.
    Yaml,
}

/// Exit codes shared by every subcommand (documented in `docs/cli.md`).
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// The command failed while running (I/O, a peer, an internal error).
    pub const FAILED: u8 = 1;
    /// A wrong command line (clap exits with it before a command runs) or environment
    /// (`RUST_LOG` that does not parse).
    pub const USAGE: u8 = 2;
    /// The input (a job spec, an inventory) is invalid; nothing was done.
    pub const INVALID_INPUT: u8 = 3;
}

/// Set by the first write to stdout that finds the pipe's reader gone. Global because a write
/// error reaches `main` in many shapes (wrapped by serde_json, turned into a message by a
/// command's own error type), and only the fact that the reader left decides the exit code.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Whether a write to [`Stdout`] found the reader of the pipe gone.
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

/// The process's stdout, noting a closed pipe (EPIPE) as it passes the error on, so that the
/// command stops producing and `main` can tell a reader that left from a failure.
pub struct Stdout(io::Stdout);

impl Stdout {
    /// The process's stdout (unlocked: the runtime commands also log from worker threads).
    pub fn new() -> Stdout {
        Stdout(io::stdout())
    }
}

impl Default for Stdout {
    fn default() -> Stdout {
        Stdout::new()
    }
}

/// Passes `result` on, noting a closed pipe.
fn noting_closed<T>(result: io::Result<T>) -> io::Result<T> {
    if let Err(e) = &result
        && e.kind() == io::ErrorKind::BrokenPipe
    {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
    }
    result
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        noting_closed(self.0.write(buf))
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        noting_closed(self.0.write_all(buf))
    }

    fn flush(&mut self) -> io::Result<()> {
        noting_closed(self.0.flush())
    }
}

/// Writes `value` as JSON or YAML.
pub fn write_structured<T: Serialize>(
    format: OutputFormat,
    value: &T,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    match format {
        OutputFormat::Json => {
            serde_json::to_writer_pretty(&mut *out, value)?;
            writeln!(out)?;
        }
        OutputFormat::Yaml | OutputFormat::Table => {
            out.write_all(serde_yaml_ng::to_string(value)?.as_bytes())?;
        }
    }
    Ok(())
}

/// A table with a header row; columns are as wide as their widest cell.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    right_aligned: Vec<bool>,
}

impl Table {
    /// A table with these column names; a name ending in `>` is right-aligned (numbers).
    pub fn new(columns: &[&str]) -> Self {
        Table {
            header: columns
                .iter()
                .map(|c| c.trim_end_matches('>').to_owned())
                .collect(),
            right_aligned: columns.iter().map(|c| c.ends_with('>')).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells are left blank.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Writes the table.
    pub fn write(&self, out: &mut dyn Write) -> io::Result<()> {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(widths.len()) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let empty = String::new();
        let mut line = |cells: &[String]| -> io::Result<()> {
            let mut text = String::new();
            for (i, width) in widths.iter().enumerate() {
                let cell = cells.get(i).unwrap_or(&empty);
                let pad = width - cell.chars().count();
                if i > 0 {
                    text.push_str("  ");
                }
                if self.right_aligned[i] {
                    text.push_str(&" ".repeat(pad));
                    text.push_str(cell);
                } else {
                    text.push_str(cell);
                    text.push_str(&" ".repeat(pad));
                }
            }
            writeln!(out, "{}", text.trim_end())
        };
        line(&self.header)?;
        for row in &self.rows {
            line(row)?;
        }
        Ok(())
    }
}

/// A quantity with an SI prefix: `si(3.08e9, "B") == "3.08 GB"`.
pub fn si(value: f64, unit: &str) -> String {
    let prefixes = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    for (scale, prefix) in prefixes {
        if value.abs() >= scale {
            return format!("{} {prefix}{unit}", three_digits(value / scale));
        }
    }
    format!("{} {unit}", three_digits(value))
}

/// A parameter count as people write it: `32.8B`, `1.54B`, `350M`.
pub fn count(value: f64) -> String {
    let prefixes = [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")];
    for (scale, suffix) in prefixes {
        if value.abs() >= scale {
            return format!("{}{suffix}", three_digits(value / scale));
        }
    }
    three_digits(value)
}

pub use rollfleet_server::counted;

/// Three significant digits, without trailing zeros beyond them.
fn three_digits(value: f64) -> String {
    if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn si_prefixes_keep_three_significant_digits() {
        assert_eq!(si(3.08e9, "B"), "3.08 GB");
        assert_eq!(si(989e12, "FLOP/s"), "989 TFLOP/s");
        assert_eq!(si(57_344.0, "B"), "57.3 kB");
        assert_eq!(si(12.0, "ms"), "12.0 ms");
        assert_eq!(count(32.8e9), "32.8B");
        assert_eq!(count(1.54e9), "1.54B");
    }

    #[test]
    fn a_count_of_one_takes_the_singular_and_any_other_the_plural() {
        assert_eq!(counted(1_usize, "worker", "workers"), "1 worker");
        assert_eq!(counted(0_u64, "worker", "workers"), "0 workers");
        assert_eq!(counted(2_u32, "entry", "entries"), "2 entries");
        assert_eq!(
            counted(1.0_f64, "wall second", "wall seconds"),
            "1 wall second"
        );
        assert_eq!(
            counted(4.0_f64, "wall second", "wall seconds"),
            "4 wall seconds"
        );
    }

    #[test]
    fn table_columns_align_and_numbers_align_right() {
        let mut table = Table::new(&["NAME", "COUNT>"]);
        table.row(vec!["decode".into(), "320".into()]);
        table.row(vec!["h800".into(), "8".into()]);
        let mut out = Vec::new();
        table.write(&mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "NAME    COUNT\ndecode    320\nh800        8\n"
        );
    }
}
