//! A distribution read from one column of a CSV file (`{distribution: csv, path, column,
//! scale}`): the file is read once, when the job is loaded, into the values it holds, so that
//! sampling and means stay free of I/O.
//!
//! The reader is minimal on purpose: a header row names the columns, fields are separated by
//! commas, a field in double quotes may hold commas (and `""` for a quote), and a field may not
//! span lines. A value must be a finite number `>= 0`. The file is bounded ([`MAX_CSV_BYTES`],
//! [`MAX_CSV_ROWS`]) so that a wrong path (a dataset, a device) is refused rather than read.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::distribution::Distribution;
use crate::manifest::JobManifest;
use crate::validate::Problem;

/// Largest CSV file a distribution may name: 64 MiB, several times a million rows of a few
/// columns. The whole file is held in memory while its column is read.
pub const MAX_CSV_BYTES: u64 = 64 * 1024 * 1024;

/// Most data rows a CSV distribution may hold: a million, fifty times the Azure conversation
/// trace. Each row of the column is kept in memory (8 bytes) for the whole run.
pub const MAX_CSV_ROWS: usize = 1_000_000;

/// The values of a CSV column, read when the job was loaded; empty until then. Not part of the
/// YAML: a job written back out names its file again, and is read again when parsed.
#[derive(Clone, Default, PartialEq)]
pub struct CsvRows(Option<Arc<CsvValues>>);

/// The values of a column and their statistics, computed once.
#[derive(Debug, PartialEq)]
pub struct CsvValues {
    values: Vec<f64>,
    mean: f64,
    variance: f64,
    largest: f64,
    largest_row: usize,
}

impl CsvRows {
    /// Rows holding `values` (each finite and `>= 0`).
    pub fn new(values: Vec<f64>) -> Self {
        let n = values.len().max(1) as f64;
        let mean = values.iter().sum::<f64>() / n;
        let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let (largest_row, largest) =
            values
                .iter()
                .copied()
                .enumerate()
                .fold(
                    (0, 0.0_f64),
                    |(i, m), (j, v)| if v > m { (j, v) } else { (i, m) },
                );
        CsvRows(Some(Arc::new(CsvValues {
            values,
            mean,
            variance,
            largest,
            largest_row,
        })))
    }

    /// The values, in file order; `None` before the file was read.
    pub fn values(&self) -> Option<&[f64]> {
        self.0.as_ref().map(|v| v.values.as_slice())
    }

    /// Whether the file was read.
    pub fn is_loaded(&self) -> bool {
        self.0.is_some()
    }

    /// The mean of the values, unscaled (0 when empty or not read).
    pub fn mean(&self) -> Option<f64> {
        self.0.as_ref().map(|v| v.mean)
    }

    /// The population variance of the values, unscaled.
    pub fn variance(&self) -> Option<f64> {
        self.0.as_ref().map(|v| v.variance)
    }

    /// The largest value and its data row (from 1).
    pub fn largest(&self) -> Option<(f64, usize)> {
        self.0.as_ref().map(|v| (v.largest, v.largest_row + 1))
    }
}

impl fmt::Debug for CsvRows {
    // A million values would drown any message: the count says enough.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.values() {
            Some(values) => write!(f, "CsvRows({} rows)", values.len()),
            None => f.write_str("CsvRows(not read)"),
        }
    }
}

/// The validator's problem for a CSV distribution whose file was never read (a job built in
/// code rather than parsed).
pub(crate) const NOT_READ: &str = "the CSV file was not read: a job naming one is parsed with `parse_job` or `load_job_file`, \
     which read it";

/// Where a CSV distribution's rows went wrong, as `(parameter, reason)`.
type Failure = (&'static str, String);

/// Reads every CSV distribution of `manifest` into it, resolving relative paths against
/// `base` (the job file's directory; the current directory when `None`). Returns a problem per
/// distribution whose file or column cannot be used. Each file is read once however many
/// distributions name it.
pub(crate) fn load_csv_distributions(
    manifest: &mut JobManifest,
    base: Option<&Path>,
) -> Vec<Problem> {
    let mut files: BTreeMap<PathBuf, Result<Arc<String>, String>> = BTreeMap::new();
    let mut problems = Vec::new();
    for (field, dist) in distributions(manifest) {
        let Distribution::Csv {
            path, column, rows, ..
        } = dist
        else {
            continue;
        };
        let resolved = match base {
            Some(dir) => dir.join(path.as_str()),
            None => PathBuf::from(path.as_str()),
        };
        let text = files
            .entry(resolved.clone())
            .or_insert_with(|| read_csv_file(&resolved, base.is_some()).map(Arc::new));
        let outcome = match text {
            Ok(text) => read_column(text, column).map_err(|(parameter, reason)| {
                let reason = if parameter == "path" {
                    format!("{path}: {reason}")
                } else {
                    reason
                };
                (parameter, reason)
            }),
            Err(reason) => Err(("path", reason.clone())),
        };
        match outcome {
            Ok(values) => *rows = CsvRows::new(values),
            Err((parameter, message)) => problems.push(Problem {
                path: format!("{field}.{parameter}"),
                message,
            }),
        }
    }
    problems
}

/// Rewrites the relative path of every CSV distribution of `manifest` as an absolute one,
/// resolved against `dir` (the job file's directory), so that the job reads the same files
/// wherever it is parsed again: a scheduler it is submitted to resolves a relative path against
/// its own working directory. Whether any path changed.
pub fn absolute_csv_paths(manifest: &mut JobManifest, dir: &Path) -> std::io::Result<bool> {
    let mut changed = false;
    for (_, dist) in distributions(manifest) {
        if let Distribution::Csv { path, .. } = dist
            && Path::new(path.as_str()).is_relative()
        {
            *path = std::path::absolute(dir.join(path.as_str()))?
                .to_string_lossy()
                .into_owned();
            changed = true;
        }
    }
    Ok(changed)
}

/// Every distribution of `manifest`, with the path of its field.
fn distributions(manifest: &mut JobManifest) -> Vec<(String, &mut Distribution)> {
    let spec = &mut manifest.spec;
    let mut fields: Vec<(String, &mut Distribution)> = Vec::new();
    for (i, task) in spec.tasks.iter_mut().enumerate() {
        let path = format!("spec.tasks[{i}]");
        if let Some(turns) = task.turns.as_mut() {
            fields.push((format!("{path}.turns"), &mut turns.0));
        }
        fields.push((format!("{path}.promptTokens"), &mut task.prompt_tokens.0));
        fields.push((format!("{path}.actionTokens"), &mut task.action_tokens.0));
        fields.push((
            format!("{path}.observationTokens"),
            &mut task.observation_tokens.0,
        ));
        fields.push((format!("{path}.envStepMs"), &mut task.env_step_ms.0));
    }
    for (i, reward) in spec.rewards.iter_mut().enumerate() {
        fields.push((
            format!("spec.rewards[{i}].latencyMs"),
            &mut reward.latency_ms.0,
        ));
    }
    fields
}

/// The text of a CSV file, bounded by [`MAX_CSV_BYTES`]; only a regular file is opened (not a
/// device or a pipe, which might never end). `beside_job`: whether a relative path was resolved
/// against the job file's directory (else against the current one), for the error.
fn read_csv_file(path: &Path, beside_job: bool) -> Result<String, String> {
    use std::io::Read;
    let shown = path.display();
    let base = if beside_job {
        "the job file's directory"
    } else {
        "the working directory of the process that reads the job"
    };
    let cannot = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => {
            format!("{shown}: no such file (a relative path is resolved against {base})")
        }
        _ => format!("{shown}: cannot read: {e}"),
    };
    if path.extension().and_then(|e| e.to_str()) != Some("csv") {
        return Err(format!(
            "{shown}: must name a `.csv` file (a wrong path must not be read as data)"
        ));
    }
    let metadata = std::fs::metadata(path).map_err(cannot)?;
    if !metadata.is_file() {
        return Err(format!("{shown}: not a regular file"));
    }
    let too_large = |size: u64| {
        format!(
            "{shown}: {size} bytes is too large for a CSV distribution (the limit is \
             {MAX_CSV_BYTES} bytes, 64 MiB: the file is held in memory while it is read)"
        )
    };
    if metadata.len() > MAX_CSV_BYTES {
        return Err(too_large(metadata.len()));
    }
    let file = std::fs::File::open(path).map_err(cannot)?;
    let mut bytes = Vec::new();
    file.take(MAX_CSV_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() as u64 > MAX_CSV_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "{shown}: not UTF-8 text: invalid byte at offset {}",
            e.utf8_error().valid_up_to()
        )
    })
}

/// The values of `column` in CSV `text`, or the parameter at fault and why.
pub(crate) fn read_column(text: &str, column: &str) -> Result<Vec<f64>, Failure> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty());
    let Some((_, header)) = lines.next() else {
        return Err((
            "path",
            "the file is empty; a CSV distribution needs a header row naming its columns and \
             at least one data row"
                .to_owned(),
        ));
    };
    let names = split_fields(header.trim_start_matches('\u{feff}'));
    let Some(index) = names.iter().position(|name| name.trim() == column) else {
        return Err((
            "column",
            format!(
                "no column \"{column}\" in the header row (columns found: {})",
                names
                    .iter()
                    .map(|n| format!("\"{}\"", n.trim()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    };
    let mut values = Vec::new();
    for (row, (line_index, line)) in lines.enumerate() {
        let row = row + 1;
        let line_number = line_index + 1;
        if row > MAX_CSV_ROWS {
            return Err((
                "path",
                format!(
                    "more than {MAX_CSV_ROWS} data rows (each row's value is kept in memory for \
                     the whole run)"
                ),
            ));
        }
        let fields = split_fields(line);
        let Some(field) = fields.get(index) else {
            return Err((
                "path",
                format!(
                    "row {row} (line {line_number}) has {} fields, so no \"{column}\" (field {})",
                    fields.len(),
                    index + 1
                ),
            ));
        };
        let field = field.trim();
        let value = field.parse::<f64>().map_err(|_| {
            (
                "path",
                format!(
                    "row {row} (line {line_number}): \"{column}\" is not a number: \"{field}\""
                ),
            )
        })?;
        if !value.is_finite() || value < 0.0 {
            return Err((
                "path",
                format!(
                    "row {row} (line {line_number}): \"{column}\" must be a finite number >= 0, \
                     got {field}"
                ),
            ));
        }
        values.push(value);
    }
    if values.is_empty() {
        return Err((
            "path",
            "the file has a header row but no data rows".to_owned(),
        ));
    }
    Ok(values)
}

/// The fields of one CSV line: split at commas outside double quotes; a quoted field loses its
/// quotes, and `""` inside it stands for one quote.
fn split_fields(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut field)),
            c => field.push(c),
        }
    }
    fields.push(field);
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quoted_field_keeps_its_commas_and_its_doubled_quotes() {
        assert_eq!(
            split_fields(r#"1,"a, ""b"", c",2"#),
            vec!["1", r#"a, "b", c"#, "2"]
        );
    }

    #[test]
    fn a_column_is_found_by_its_header_after_a_quoted_field() {
        let text = "id,\"note, free\",tokens\r\n1,\"x, y\",10\n2,z,30\n\n";
        assert_eq!(read_column(text, "tokens").unwrap(), vec![10.0, 30.0]);
    }

    #[test]
    fn a_missing_column_lists_the_columns_found() {
        let (parameter, reason) = read_column("a,b\n1,2\n", "c").unwrap_err();
        assert_eq!(parameter, "column");
        assert!(reason.contains("\"a\", \"b\""), "{reason}");
    }

    #[test]
    fn a_bad_value_names_its_row_and_line() {
        for (text, said) in [
            ("t\n1\nabc\n", "row 2 (line 3): \"t\" is not a number"),
            (
                "t\n1\n\n-4\n",
                "row 2 (line 4): \"t\" must be a finite number >= 0",
            ),
            (
                "t\nNaN\n",
                "row 1 (line 2): \"t\" must be a finite number >= 0",
            ),
            ("t\ninf\n", "row 1 (line 2)"),
            ("x,t\n1\n", "row 1 (line 2) has 1 fields"),
        ] {
            let (parameter, reason) = read_column(text, "t").unwrap_err();
            assert_eq!(parameter, "path");
            assert!(reason.contains(said), "{reason} lacks {said}");
        }
    }

    #[test]
    fn an_empty_file_or_one_without_data_rows_is_refused() {
        assert!(read_column("", "t").unwrap_err().1.contains("empty"));
        assert!(
            read_column("t\n", "t")
                .unwrap_err()
                .1
                .contains("no data rows")
        );
    }

    #[test]
    fn more_rows_than_the_bound_are_refused_with_the_reason() {
        let text = format!("t\n{}", "1\n".repeat(MAX_CSV_ROWS + 1));
        let (_, reason) = read_column(&text, "t").unwrap_err();
        assert!(reason.contains("more than 1000000 data rows"), "{reason}");
        assert!(reason.contains("memory"), "{reason}");
        let text = format!("t\n{}", "1\n".repeat(MAX_CSV_ROWS));
        assert_eq!(read_column(&text, "t").unwrap().len(), MAX_CSV_ROWS);
    }

    #[test]
    fn the_statistics_are_those_of_the_values() {
        let rows = CsvRows::new(vec![1.0, 5.0, 3.0]);
        assert_eq!(rows.mean(), Some(3.0));
        assert_eq!(rows.variance(), Some(8.0 / 3.0));
        assert_eq!(rows.largest(), Some((5.0, 2)));
        assert_eq!(format!("{rows:?}"), "CsvRows(3 rows)");
    }
}
