//! Parsing of the `REPORT` line Lambda appends to a function's log, which the Invoke API returns
//! base64-encoded in `X-Amz-Log-Result` when asked with `LogType: Tail`. It is the only place
//! the Invoke API says whether an invocation was a cold start (`Init Duration`) and how long it
//! was billed for.

use base64::Engine;

/// What a `REPORT` line says about one invocation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    pub billed_ms: u64,
    pub memory_mb: Option<u32>,
    /// Present only when the invocation started a new execution environment.
    pub init_ms: Option<f64>,
}

/// Decodes an `X-Amz-Log-Result` value and parses its last `REPORT` line.
pub fn parse_log_result(encoded: &str) -> Option<Report> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8_lossy(&bytes);
    parse_report(&text)
}

/// Parses the last `REPORT RequestId: ...` line of a log.
pub fn parse_report(log: &str) -> Option<Report> {
    let line = log.lines().rev().find(|l| l.starts_with("REPORT "))?;
    let mut billed_ms = None;
    let mut memory_mb = None;
    let mut init_ms = None;
    for field in line.split('\t') {
        let Some((key, value)) = field.split_once(':') else {
            continue;
        };
        let number = value.split_whitespace().next();
        match key.trim() {
            "Billed Duration" => billed_ms = number.and_then(|v| v.parse::<u64>().ok()),
            "Memory Size" => memory_mb = number.and_then(|v| v.parse::<u32>().ok()),
            "Init Duration" => init_ms = number.and_then(|v| v.parse::<f64>().ok()),
            _ => {}
        }
    }
    Some(Report {
        billed_ms: billed_ms?,
        memory_mb,
        init_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_report_line_with_init_duration_is_a_cold_start() {
        let log = "START RequestId: 6f6c Version: $LATEST\nEND RequestId: 6f6c\nREPORT RequestId: 6f6c\tDuration: 12.34 ms\tBilled Duration: 13 ms\tMemory Size: 128 MB\tMax Memory Used: 38 MB\tInit Duration: 150.02 ms\t\n";
        let r = parse_report(log).unwrap();
        assert_eq!(r.billed_ms, 13);
        assert_eq!(r.memory_mb, Some(128));
        assert_eq!(r.init_ms, Some(150.02));
    }

    #[test]
    fn report_without_init_duration_is_a_warm_start() {
        let log = "REPORT RequestId: x\tDuration: 1.00 ms\tBilled Duration: 1 ms\tMemory Size: 512 MB\tMax Memory Used: 20 MB\t";
        assert_eq!(parse_report(log).unwrap().init_ms, None);
    }

    #[test]
    fn garbage_log_results_parse_to_nothing() {
        assert_eq!(parse_log_result("!!!not base64"), None);
        assert_eq!(parse_log_result(""), None);
        assert_eq!(
            parse_report("REPORT RequestId: x\tBilled Duration: lots"),
            None
        );
    }
}
