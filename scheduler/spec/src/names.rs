//! The names a job may use for what its workers run: environments and reward functions, and
//! the "did you mean" suggestion for a name that is close to a known one.
//!
//! The lists live here, in the pure spec crate, so that validation needs no dependency on the
//! crates that implement them; each of those crates has a test that its own list agrees with the
//! one here (`rollfleet-environments`, `rollfleet-rewards`).

/// Environment kinds every CPU worker runs without being told anything (the built-in
/// environments of `rollfleet-environments`), sorted.
pub const BUILTIN_ENVIRONMENTS: &[&str] = &["calculator", "frozenlake", "sokoban"];

/// Reward functions the reward workers (and the Lambda bootstrap) implement, by the name a
/// reward's `function` gives (the functions of `rollfleet-rewards`), sorted.
pub const BUILTIN_REWARD_FUNCTIONS: &[&str] = &[
    "code_tests",
    "exact_match",
    "json_format",
    "math_answer",
    "regex_match",
    "think_answer_format",
];

/// The candidate closest to `name`, if one is close enough to be a likely slip: at most one
/// edit for names up to four characters, two up to nine, and a third of the length beyond, and
/// never the name itself. Case is ignored when measuring (`Sokoban` suggests `sokoban`).
pub fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let wanted: Vec<char> = name.to_lowercase().chars().collect();
    let limit = match wanted.len() {
        0 => return None,
        1..=4 => 1,
        5..=9 => 2,
        n => n / 3,
    };
    candidates
        .into_iter()
        .filter(|c| *c != name)
        .filter_map(|c| {
            let other: Vec<char> = c.to_lowercase().chars().collect();
            // A length difference alone past the limit rules the candidate out, and keeps a
            // megabyte-long name from costing a quadratic comparison.
            if wanted.len().abs_diff(other.len()) > limit {
                return None;
            }
            let distance = edit_distance(&wanted, &other);
            (distance <= limit).then_some((distance, c))
        })
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, c)| c)
}

/// Levenshtein distance (insertions, deletions and substitutions of one character).
fn edit_distance(a: &[char], b: &[char]) -> usize {
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    let mut current = vec![0; b.len() + 1];
    for (i, ca) in a.iter().enumerate() {
        current[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
}

/// A serde "unknown field" or "unknown variant" message with a suggestion added when one of the
/// names it expects is close: ``unknown field `enviroment`, expected one of `name`,
/// `environment`, ...`` gains ``; did you mean `environment`?``. Other messages are returned
/// as they are.
pub(crate) fn with_field_suggestion(message: String) -> String {
    let Some(start) = ["unknown field `", "unknown variant `"]
        .iter()
        .find_map(|prefix| message.find(prefix).map(|at| at + prefix.len()))
    else {
        return message;
    };
    let Some(unknown) = message[start..].split('`').next() else {
        return message;
    };
    let Some(expected) = message[start..].find("expected") else {
        return message;
    };
    // The expected names are the backquoted words after "expected" (odd pieces between quotes).
    let names: Vec<&str> = message[start + expected..]
        .split('`')
        .skip(1)
        .step_by(2)
        .collect();
    match did_you_mean(unknown, names) {
        Some(close) => format!("{message}; did you mean `{close}`?"),
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_one_letter_slip_suggests_the_known_name() {
        assert_eq!(
            did_you_mean("sokobn", BUILTIN_ENVIRONMENTS.iter().copied()),
            Some("sokoban")
        );
        assert_eq!(
            did_you_mean("frozen-lake", BUILTIN_ENVIRONMENTS.iter().copied()),
            Some("frozenlake")
        );
        assert_eq!(
            did_you_mean("Sokoban", BUILTIN_ENVIRONMENTS.iter().copied()),
            Some("sokoban")
        );
        assert_eq!(
            did_you_mean("math-answer", BUILTIN_REWARD_FUNCTIONS.iter().copied()),
            Some("math_answer")
        );
    }

    #[test]
    fn a_name_far_from_every_known_one_suggests_nothing() {
        for name in ["my-webshop", "", "x", "chess", &"a".repeat(1 << 20)] {
            assert_eq!(
                did_you_mean(name, BUILTIN_ENVIRONMENTS.iter().copied()),
                None,
                "{name:.20}"
            );
        }
    }

    #[test]
    fn the_lists_are_sorted_and_without_duplicates() {
        for list in [BUILTIN_ENVIRONMENTS, BUILTIN_REWARD_FUNCTIONS] {
            assert!(list.windows(2).all(|w| w[0] < w[1]), "{list:?}");
        }
    }

    #[test]
    fn an_unknown_field_message_gains_the_closest_expected_field() {
        let message = "unknown field `enviroment`, expected one of `name`, `environment`, \
                       `share` at line 3 column 7"
            .to_owned();
        assert_eq!(
            with_field_suggestion(message.clone()),
            format!("{message}; did you mean `environment`?")
        );
        let far = "unknown field `colour`, expected `name` or `share`".to_owned();
        assert_eq!(with_field_suggestion(far.clone()), far);
        let other = "invalid type: string \"four\", expected i64".to_owned();
        assert_eq!(with_field_suggestion(other.clone()), other);
    }
}
