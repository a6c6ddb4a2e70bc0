//! Format and regex rewards: does a response follow the output format the task asked for
//! (`<think>…</think><answer>…</answer>`, a JSON object, a pattern given by the task author)?
//!
//! Patterns come from task specs, which are input: they are compiled with a bounded program size
//! so a pathological pattern is rejected instead of exhausting memory. The `regex` crate matches
//! in linear time, so no pattern can cause catastrophic backtracking.

use regex::RegexBuilder;

/// Upper bound on a compiled pattern's size; generous for real formats, small enough to keep a
/// hostile `(a{1000}){1000}` from allocating gigabytes.
const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Longest pattern text accepted.
const MAX_PATTERN_LEN: usize = 4096;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FormatError {
    #[error("pattern is {0} bytes, more than the {MAX_PATTERN_LEN} allowed")]
    PatternTooLong(usize),
    #[error("invalid pattern: {0}")]
    InvalidPattern(String),
}

/// Whether `response` matches `pattern`: anywhere in it, or as a whole when `full_match`.
pub fn regex_match(response: &str, pattern: &str, full_match: bool) -> Result<bool, FormatError> {
    if pattern.len() > MAX_PATTERN_LEN {
        return Err(FormatError::PatternTooLong(pattern.len()));
    }
    let anchored;
    let pattern = if full_match {
        anchored = format!("^(?:{pattern})$");
        anchored.as_str()
    } else {
        pattern
    };
    let re = RegexBuilder::new(pattern)
        .size_limit(REGEX_SIZE_LIMIT)
        .dfa_size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map_err(|e| FormatError::InvalidPattern(e.to_string()))?;
    Ok(re.is_match(response))
}

/// Result of the reasoning-format check, with the pieces found.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ThinkAnswer {
    pub well_formed: bool,
    pub answer: Option<String>,
}

/// The R1-style format: exactly one `<think>…</think>` followed by exactly one
/// `<answer>…</answer>`, nothing but whitespace around them, both non-empty.
pub fn think_answer_format(response: &str) -> ThinkAnswer {
    let bad = ThinkAnswer {
        well_formed: false,
        answer: None,
    };
    let s = response.trim();
    for tag in ["<think>", "</think>", "<answer>", "</answer>"] {
        if s.matches(tag).count() != 1 {
            return bad;
        }
    }
    let Some(rest) = s.strip_prefix("<think>") else {
        return bad;
    };
    let Some((thought, rest)) = rest.split_once("</think>") else {
        return bad;
    };
    let Some(rest) = rest.trim_start().strip_prefix("<answer>") else {
        return bad;
    };
    let Some(answer) = rest.strip_suffix("</answer>") else {
        return bad;
    };
    if thought.trim().is_empty() || answer.trim().is_empty() {
        return bad;
    }
    ThinkAnswer {
        well_formed: true,
        answer: Some(answer.trim().to_owned()),
    }
}

/// Whether the response, trimmed and with an optional ```json fence removed, is one JSON object.
pub fn is_json_object(response: &str) -> bool {
    let s = response.trim();
    let s = s
        .strip_prefix("```json")
        .or_else(|| s.strip_prefix("```"))
        .and_then(|x| x.trim_end().strip_suffix("```"))
        .unwrap_or(s);
    matches!(
        serde_json::from_str::<serde_json::Value>(s.trim()),
        Ok(serde_json::Value::Object(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_formed_think_answer_response_is_accepted_and_answer_extracted() {
        let r = "<think>2+2 is 4</think>\n<answer> 4 </answer>";
        let got = think_answer_format(r);
        assert!(got.well_formed);
        assert_eq!(got.answer.as_deref(), Some("4"));
    }

    #[test]
    fn missing_duplicated_or_reordered_tags_are_rejected() {
        for r in [
            "<answer>4</answer>",
            "<think>a</think><answer>4</answer><answer>5</answer>",
            "<answer>4</answer><think>a</think>",
            "<think>a</think>text<answer>4</answer>",
            "<think></think><answer>4</answer>",
            "<think>a</think><answer>4</answer> trailing",
            "<think>a<answer>4</answer></think>",
        ] {
            assert!(!think_answer_format(r).well_formed, "{r}");
        }
    }

    #[test]
    fn regex_full_match_anchors_the_whole_response() {
        assert!(regex_match("Answer: 42", r"Answer: \d+", true).unwrap());
        assert!(!regex_match("Answer: 42 because", r"Answer: \d+", true).unwrap());
        assert!(regex_match("so, Answer: 42 because", r"Answer: \d+", false).unwrap());
    }

    #[test]
    fn alternation_inside_a_full_match_pattern_stays_anchored() {
        assert!(!regex_match("xa", "a|b", true).unwrap());
    }

    #[test]
    fn invalid_and_oversized_patterns_are_errors_not_panics() {
        assert!(matches!(
            regex_match("x", "(unclosed", false),
            Err(FormatError::InvalidPattern(_))
        ));
        assert!(matches!(
            regex_match("x", &"a".repeat(5000), false),
            Err(FormatError::PatternTooLong(5000))
        ));
        assert!(matches!(
            regex_match("x", "((a{100}){100}){100}", false),
            Err(FormatError::InvalidPattern(_))
        ));
    }

    #[test]
    fn backtracking_bomb_pattern_runs_in_linear_time() {
        let text = format!("{}!", "a".repeat(50_000));
        let start = std::time::Instant::now();
        assert!(!regex_match(&text, "(a+)+$b", false).unwrap());
        // A backtracking engine would take longer than the age of the universe here.
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn json_object_check_accepts_fenced_objects_only() {
        assert!(is_json_object("```json\n{\"a\": 1}\n```"));
        assert!(is_json_object(" {\"a\": [1,2]} "));
        assert!(!is_json_object("[1,2]"));
        assert!(!is_json_object("{\"a\": "));
    }
}
