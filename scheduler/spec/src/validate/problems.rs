//! The problem list: each problem with its field path and reason, and the helpers that word
//! them (an unknown name with its nearest known one, a quantity with its unit).

use super::*;

/// One problem (or warning) in a job spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// Field path, e.g. `spec.pools[1].gpu`.
    pub path: String,
    /// What is wrong and, where it helps, what would be right.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// `unknown {what} "{name}" ({known})`, with a suggestion when a known name is close.
pub(super) fn unknown_name<'a>(
    what: &str,
    name: &str,
    known: impl IntoIterator<Item = &'a str>,
    listed: &str,
) -> String {
    let mut message = format!("unknown {what} \"{name}\" ({listed})");
    if let Some(close) = did_you_mean(name, known) {
        message.push_str(&format!("; did you mean `{close}`?"));
    }
    message
}

/// What a distribution measures: the most any of its parameters may be, the unit, and why.
pub(super) struct Quantity {
    pub(super) max: f64,
    pub(super) unit: &'static str,
    pub(super) reason: &'static str,
}

pub(super) const TOKENS: Quantity = Quantity {
    max: MAX_CONTEXT_LIMIT as f64,
    unit: "tokens",
    reason: "the longest context window accepted",
};

pub(super) const TURNS: Quantity = Quantity {
    max: MAX_TURNS as f64,
    unit: "turns",
    reason: "agentic episodes take tens to hundreds",
};

pub(super) const MILLISECONDS: Quantity = Quantity {
    max: MAX_LATENCY_MS,
    unit: "ms",
    reason: "a day",
};

/// A float as a person reads it: plain up to a quadrillion, in exponent form beyond
/// (`1e300` rather than three hundred digits).
pub(super) fn show(value: f64) -> String {
    if value.is_finite() && value.abs() >= 1e15 {
        format!("{value:e}")
    } else {
        value.to_string()
    }
}

#[derive(Default)]
pub(super) struct Problems {
    pub(super) errors: Vec<Problem>,
    pub(super) warnings: Vec<Problem>,
}

impl Problems {
    pub(super) fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    pub(super) fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    pub(super) fn at_least(&mut self, path: impl Into<String>, value: i64, min: i64) {
        if value < min {
            self.error(path, format!("must be at least {min}, got {value}"));
        }
    }

    /// At least `min` and at most `max` `what` (a unit, then the bound's reason).
    pub(super) fn within(
        &mut self,
        path: impl Into<String>,
        value: i64,
        min: i64,
        max: i64,
        what: &str,
    ) {
        if value < min {
            self.error(path, format!("must be at least {min}, got {value}"));
        } else if value > max {
            self.error(path, format!("must be at most {max} {what}, got {value}"));
        }
    }

    /// Finite and at most `max` `what`; the lower bound is checked by the caller.
    pub(super) fn finite_at_most(
        &mut self,
        path: impl Into<String>,
        value: f64,
        max: f64,
        what: &str,
    ) {
        if !value.is_finite() {
            self.error(path, format!("must be a finite number, got {value}"));
        } else if value > max {
            self.error(
                path,
                format!("must be at most {} {what}, got {}", show(max), show(value)),
            );
        }
    }

    /// At most `max` entries of a list.
    pub(super) fn at_most_entries(&mut self, path: &str, len: usize, max: usize, what: &str) {
        if len > max {
            self.error(path, format!("must list at most {max} {what}, got {len}"));
        }
    }

    pub(super) fn finite_in(&mut self, path: impl Into<String>, value: f64, min: f64, max: f64) {
        if !value.is_finite() || value < min || value > max {
            self.error(
                path,
                format!("must be between {min} and {max}, got {value}"),
            );
        }
    }

    pub(super) fn name(
        &mut self,
        path: String,
        name: &str,
        seen: &mut BTreeSet<String>,
        what: &str,
    ) {
        if name.trim().is_empty() {
            self.error(path, "must not be empty");
        } else if !seen.insert(name.to_owned()) {
            self.error(path, format!("duplicate {what} name \"{name}\""));
        }
    }
}
