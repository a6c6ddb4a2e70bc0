//! Property tests: the pure rewards take arbitrary model output (any Unicode, unbalanced
//! LaTeX, huge numbers) without panicking, and keep their reported answers small.

use proptest::prelude::*;
use rollfleet_rewards::format::{is_json_object, regex_match, think_answer_format};
use rollfleet_rewards::math::{
    MAX_REPORTED_ANSWER, exact_match, math_answer_match, normalize_answer, parse_number,
};

/// Text biased towards the characters the parsers treat specially.
fn latexish() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            Just("\\boxed{".to_owned()),
            Just("\\frac".to_owned()),
            Just("\\text{".to_owned()),
            Just("{".to_owned()),
            Just("}".to_owned()),
            Just("/".to_owned()),
            Just(",".to_owned()),
            Just(".".to_owned()),
            Just("-".to_owned()),
            Just("%".to_owned()),
            Just("=".to_owned()),
            Just("<think>".to_owned()),
            Just("</answer>".to_owned()),
            "[0-9]{1,40}",
            any::<String>(),
        ],
        0..40,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn math_matching_never_panics_and_reports_bounded_answers(a in latexish(), b in latexish()) {
        let o = math_answer_match(&a, &b);
        prop_assert!(o.extracted.as_ref().is_none_or(|s| s.len() <= MAX_REPORTED_ANSWER));
        prop_assert!(o.normalized.as_ref().is_none_or(|s| s.len() <= MAX_REPORTED_ANSWER));
        let _ = normalize_answer(&a);
        let _ = parse_number(&a);
    }

    #[test]
    fn any_text_exactly_matches_itself(a in any::<String>()) {
        prop_assert!(exact_match(&a, &a).matched);
    }

    #[test]
    fn an_integer_answer_in_a_box_matches_itself_with_thousands_separators(n in any::<i64>()) {
        let plain = n.to_string();
        let boxed = format!("so \\boxed{{{}}}", with_separators(n));
        let same = math_answer_match(&boxed, &plain).matched;
        prop_assert!(same, "{} vs {}", boxed, plain);
        let next = (i128::from(n) + 1).to_string();
        let other = math_answer_match(&boxed, &next).matched;
        prop_assert!(!other, "{} vs {}", boxed, next);
    }

    #[test]
    fn format_checks_never_panic(a in latexish(), p in any::<String>()) {
        let t = think_answer_format(&a);
        prop_assert!(!t.well_formed || t.answer.is_some());
        let _ = is_json_object(&a);
        let _ = regex_match(&a, &p, true);
    }
}

/// `-1234567` as `-1,234,567`.
fn with_separators(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}
