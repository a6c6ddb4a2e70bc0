//! Math answer matching: pulls the final answer out of a model response (the last `\boxed{}`,
//! or failing that the last number) and compares it with a reference answer either exactly or
//! after normalisation (LaTeX clean-up, fractions, decimals, thousands separators, percent).
//!
//! Numbers are compared as exact rationals where they fit in `i128`, so `0.5`, `1/2`,
//! `\frac{1}{2}` and `\dfrac12` are all the same answer, while `0.333` is not `1/3`.

/// What the matcher extracted and decided, kept for the reward's `details`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MatchOutcome {
    pub matched: bool,
    /// The answer taken from the response, before normalisation.
    pub extracted: Option<String>,
    /// The normalised form that was compared.
    pub normalized: Option<String>,
}

/// Longest extracted answer kept in a [`MatchOutcome`]: details travel back in the function's
/// response, which must stay small however long the model's response was.
pub const MAX_REPORTED_ANSWER: usize = 256;

/// Exact match: the whole response, trimmed, equals the reference, trimmed.
pub fn exact_match(response: &str, reference: &str) -> MatchOutcome {
    let got = response.trim();
    MatchOutcome {
        matched: got == reference.trim(),
        extracted: Some(clip(got)),
        normalized: None,
    }
}

/// The first [`MAX_REPORTED_ANSWER`] bytes of `s`, cut at a character boundary.
fn clip(s: &str) -> String {
    if s.len() <= MAX_REPORTED_ANSWER {
        return s.to_owned();
    }
    let mut end = MAX_REPORTED_ANSWER;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Normalised math answer match between the final answer in `response` and `reference`.
///
/// The reference may itself be written with `\boxed{}` or LaTeX; it is normalised the same way.
pub fn math_answer_match(response: &str, reference: &str) -> MatchOutcome {
    let Some(extracted) = extract_final_answer(response) else {
        return MatchOutcome {
            matched: false,
            extracted: None,
            normalized: None,
        };
    };
    let reference = last_boxed(reference).unwrap_or_else(|| reference.to_owned());
    let got = normalize_answer(&extracted);
    let want = normalize_answer(&reference);
    let matched = match (parse_number(&got), parse_number(&want)) {
        (Some(a), Some(b)) => a.equals(&b),
        _ => !got.is_empty() && got == want,
    };
    MatchOutcome {
        matched,
        extracted: Some(clip(&extracted)),
        normalized: Some(clip(&got)),
    }
}

/// The content of the last `\boxed{...}` (or `\fbox{...}`), else the last number in the text.
pub fn extract_final_answer(text: &str) -> Option<String> {
    if let Some(boxed) = last_boxed(text) {
        return Some(boxed);
    }
    last_number(text)
}

/// Content of the last `\boxed{...}` or `\fbox{...}`, with nested braces balanced.
pub fn last_boxed(text: &str) -> Option<String> {
    let start = ["\\boxed", "\\fbox"]
        .iter()
        .filter_map(|m| text.rfind(m).map(|i| i + m.len()))
        .max()?;
    let rest = text[start..].trim_start();
    if let Some(body) = rest.strip_prefix('{') {
        let mut depth = 1usize;
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(body[..i].trim().to_owned());
                    }
                }
                _ => {}
            }
        }
        // Unbalanced braces: the answer is truncated, so there is no final answer to trust.
        None
    } else {
        // `\boxed 5` form: the answer runs to the next whitespace or `$`.
        let token: String = rest
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '$')
            .collect();
        (!token.is_empty()).then_some(token)
    }
}

fn last_number(text: &str) -> Option<String> {
    let mut best: Option<(usize, usize)> = None;
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let starts_number = bytes[i].is_ascii_digit()
            || (bytes[i] == b'-' && bytes.get(i + 1).is_some_and(u8::is_ascii_digit));
        if starts_number {
            let begin = i;
            i += 1;
            while i < bytes.len() {
                let b = bytes[i];
                let digit_after = bytes.get(i + 1).is_some_and(u8::is_ascii_digit);
                if b.is_ascii_digit() || ((b == b'.' || b == b',' || b == b'/') && digit_after) {
                    i += 1;
                } else {
                    break;
                }
            }
            best = Some((begin, i));
        } else {
            i += 1;
        }
    }
    best.map(|(a, b)| text[a..b].to_owned())
}

/// Canonical text form of an answer: LaTeX wrappers and spacing removed.
pub fn normalize_answer(answer: &str) -> String {
    let mut s = answer.trim().to_owned();
    s = unwrap_command(&s, "\\text");
    s = unwrap_command(&s, "\\textbf");
    s = unwrap_command(&s, "\\mathrm");
    s = unwrap_command(&s, "\\mbox");
    for (from, to) in [
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\ ", ""),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\%", "%"),
        ("\\$", ""),
        ("$", ""),
        ("\\displaystyle", ""),
    ] {
        s = s.replace(from, to);
    }
    s.retain(|c| !c.is_whitespace());
    while s.ends_with('.') {
        s.pop();
    }
    // "x = 5" and "x=5" answer with the value; keep only the right-hand side of a single `=`.
    if s.matches('=').count() == 1
        && let Some((lhs, rhs)) = s.split_once('=')
        && lhs.len() <= 2
        && lhs.chars().all(|c| c.is_ascii_alphabetic())
    {
        s = rhs.to_owned();
    }
    s = expand_frac(&s);
    s
}

/// `\cmd{body}` becomes `body`, for every occurrence.
fn unwrap_command(s: &str, cmd: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find(cmd) {
        let after = &rest[pos + cmd.len()..];
        let Some(body) = after.strip_prefix('{') else {
            out.push_str(&rest[..pos + cmd.len()]);
            rest = after;
            continue;
        };
        let Some(close) = matching_brace(body) else {
            break;
        };
        out.push_str(&rest[..pos]);
        out.push_str(&body[..close]);
        rest = &body[close + 1..];
    }
    out.push_str(rest);
    out
}

/// Index of the `}` closing a body whose `{` was already consumed.
fn matching_brace(body: &str) -> Option<usize> {
    let mut depth = 1usize;
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// `\frac{a}{b}` and `\frac ab` become `(a)/(b)`-free `a/b` when both parts are plain.
fn expand_frac(s: &str) -> String {
    let Some(rest) = s.strip_prefix("\\frac") else {
        let neg = s.strip_prefix("-\\frac").map(|r| format!("\\frac{r}"));
        return match neg {
            Some(inner) => format!("-{}", expand_frac(&inner)),
            None => s.to_owned(),
        };
    };
    let (num, rest) = frac_arg(rest);
    let (den, rest) = frac_arg(rest);
    match (num, den) {
        (Some(n), Some(d)) if rest.is_empty() => format!("{n}/{d}"),
        _ => s.to_owned(),
    }
}

fn frac_arg(s: &str) -> (Option<&str>, &str) {
    if let Some(body) = s.strip_prefix('{') {
        match matching_brace(body) {
            Some(close) => (Some(&body[..close]), &body[close + 1..]),
            None => (None, s),
        }
    } else {
        match s.chars().next() {
            Some(c) if c.is_ascii_alphanumeric() => (Some(&s[..c.len_utf8()]), &s[c.len_utf8()..]),
            _ => (None, s),
        }
    }
}

/// A parsed numeric answer: exact when it fits, else floating point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    Rational { num: i128, den: i128 },
    Float(f64),
}

impl Number {
    fn equals(&self, other: &Number) -> bool {
        match (self, other) {
            (Number::Rational { num: a, den: b }, Number::Rational { num: c, den: d }) => a
                .checked_mul(*d)
                .zip(c.checked_mul(*b))
                .map(|(x, y)| x == y)
                .unwrap_or_else(|| self.as_f64() == other.as_f64()),
            _ => {
                let (x, y) = (self.as_f64(), other.as_f64());
                let scale = x.abs().max(y.abs()).max(1.0);
                (x - y).abs() <= 1e-9 * scale
            }
        }
    }

    fn as_f64(&self) -> f64 {
        match self {
            Number::Rational { num, den } => *num as f64 / *den as f64,
            Number::Float(f) => *f,
        }
    }
}

/// Parses a normalised answer as a number: integers, decimals, `a/b`, percent, thousands
/// separators and scientific notation.
pub fn parse_number(s: &str) -> Option<Number> {
    let s = s.trim();
    if s.is_empty() || s.len() > 200 {
        return None;
    }
    if let Some(p) = s.strip_suffix('%') {
        return parse_number(p).map(|n| match n {
            Number::Rational { num, den } => den
                .checked_mul(100)
                .map(|den| reduce(num, den))
                .unwrap_or(Number::Float(num as f64 / den as f64 / 100.0)),
            Number::Float(f) => Number::Float(f / 100.0),
        });
    }
    if let Some((a, b)) = s.split_once('/') {
        let (a, b) = (
            parse_number(strip_parens(a))?,
            parse_number(strip_parens(b))?,
        );
        return match (a, b) {
            (Number::Rational { num: n1, den: d1 }, Number::Rational { num: n2, den: d2 }) => {
                if n2 == 0 {
                    return None;
                }
                match (n1.checked_mul(d2), d1.checked_mul(n2)) {
                    (Some(n), Some(d)) => Some(reduce(n, d)),
                    _ => Some(Number::Float(a.as_f64() / b.as_f64())),
                }
            }
            _ => {
                let d = b.as_f64();
                (d != 0.0).then(|| Number::Float(a.as_f64() / d))
            }
        };
    }
    let plain = strip_thousands(s)?;
    parse_decimal(&plain)
}

fn strip_parens(s: &str) -> &str {
    s.strip_prefix('(')
        .and_then(|x| x.strip_suffix(')'))
        .unwrap_or(s)
}

/// "1,234,567" becomes "1234567"; a comma in any other place means this is not one number.
fn strip_thousands(s: &str) -> Option<String> {
    if !s.contains(',') {
        return Some(s.to_owned());
    }
    let (int_part, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    let digits = int_part.strip_prefix('-').unwrap_or(int_part);
    let groups: Vec<&str> = digits.split(',').collect();
    let well_formed = groups.first().is_some_and(|g| (1..=3).contains(&g.len()))
        && groups[1..].iter().all(|g| g.len() == 3)
        && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_digit()));
    if !well_formed {
        return None;
    }
    let mut out = String::new();
    if int_part.starts_with('-') {
        out.push('-');
    }
    out.push_str(&groups.concat());
    if let Some(f) = frac {
        out.push('.');
        out.push_str(f);
    }
    Some(out)
}

fn parse_decimal(s: &str) -> Option<Number> {
    let (neg, body) = match s.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    if body.contains(['e', 'E']) {
        return body
            .parse::<f64>()
            .ok()
            .filter(|f| f.is_finite())
            .map(|f| Number::Float(if neg { -f } else { f }));
    }
    let (int_part, frac_part) = body.split_once('.').unwrap_or((body, ""));
    if int_part.is_empty() && frac_part.is_empty() {
        return None;
    }
    if !int_part.bytes().all(|b| b.is_ascii_digit())
        || !frac_part.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let digits = format!("{int_part}{frac_part}");
    let exact = digits.parse::<i128>().ok().and_then(|n| {
        let den = 10i128.checked_pow(u32::try_from(frac_part.len()).ok()?)?;
        Some(reduce(if neg { -n } else { n }, den))
    });
    exact.or_else(|| {
        body.parse::<f64>()
            .ok()
            .filter(|f| f.is_finite())
            .map(|f| Number::Float(if neg { -f } else { f }))
    })
}

fn reduce(num: i128, den: i128) -> Number {
    let g = gcd(num.unsigned_abs(), den.unsigned_abs()).max(1);
    let (mut n, mut d) = (num / g as i128, den / g as i128);
    if d < 0 {
        n = -n;
        d = -d;
    }
    Number::Rational { num: n, den: d }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_answer_is_extracted_with_nested_braces() {
        let r = "so the result is $\\boxed{\\frac{1}{2}}$ as claimed";
        assert_eq!(last_boxed(r).as_deref(), Some("\\frac{1}{2}"));
    }

    #[test]
    fn the_last_boxed_answer_wins_over_earlier_ones() {
        assert_eq!(
            extract_final_answer("try \\boxed{3}, no wait, \\boxed{4}").as_deref(),
            Some("4")
        );
    }

    #[test]
    fn unbalanced_boxed_yields_no_answer_from_the_box() {
        assert_eq!(last_boxed("\\boxed{\\frac{1}{2}"), None);
    }

    #[test]
    fn without_a_box_the_last_number_is_the_answer() {
        assert_eq!(
            extract_final_answer("3 apples and 4 pears make 7.").as_deref(),
            Some("7")
        );
        assert_eq!(
            extract_final_answer("The total is -1,250.50 dollars").as_deref(),
            Some("-1,250.50")
        );
    }

    #[test]
    fn fractions_decimals_and_latex_fractions_are_equivalent() {
        for resp in [
            "\\boxed{0.5}",
            "\\boxed{1/2}",
            "\\boxed{\\frac{1}{2}}",
            "\\boxed{\\dfrac12}",
            "\\boxed{50\\%}",
        ] {
            assert!(math_answer_match(resp, "\\frac{1}{2}").matched, "{resp}");
        }
    }

    #[test]
    fn close_but_different_numbers_do_not_match() {
        assert!(!math_answer_match("\\boxed{0.333}", "1/3").matched);
        assert!(!math_answer_match("\\boxed{7}", "8").matched);
        assert!(!math_answer_match("the answer is 12", "120").matched);
    }

    #[test]
    fn thousands_separators_units_and_text_wrappers_are_normalised() {
        assert!(math_answer_match("\\boxed{1,000,000}", "1000000").matched);
        assert!(math_answer_match("\\boxed{\\text{5}}", "5").matched);
        assert!(math_answer_match("\\boxed{x = 3}", "3").matched);
        assert!(math_answer_match("\\boxed{90^\\circ}", "90").matched);
        assert!(math_answer_match("\\boxed{ -4 .}", "-4").matched);
    }

    #[test]
    fn symbolic_answers_match_after_whitespace_normalisation() {
        assert!(math_answer_match("\\boxed{2\\sqrt{3}}", "2 \\sqrt{3}").matched);
        assert!(!math_answer_match("\\boxed{2\\sqrt{3}}", "3\\sqrt{2}").matched);
    }

    #[test]
    fn malformed_numbers_are_not_treated_as_numbers() {
        assert_eq!(parse_number("1,00"), None);
        assert_eq!(parse_number("1/0"), None);
        assert_eq!(parse_number("--3"), None);
        assert_eq!(parse_number(""), None);
        assert_eq!(parse_number("1e999"), None);
    }

    #[test]
    fn huge_integers_fall_back_to_floating_comparison_without_overflow() {
        let big = "123456789012345678901234567890123456789012345678901234567890";
        assert!(math_answer_match(&format!("\\boxed{{{big}}}"), big).matched);
        let n = parse_number(&format!("{big}/{big}"));
        assert!(n.is_some());
    }

    #[test]
    fn response_without_any_answer_scores_no_match() {
        let o = math_answer_match("I do not know.", "5");
        assert!(!o.matched);
        assert_eq!(o.extracted, None);
    }

    #[test]
    fn reported_answers_are_clipped_so_results_stay_small() {
        let long = "é".repeat(10_000);
        let o = exact_match(&long, "x");
        assert!(o.extracted.unwrap().len() <= MAX_REPORTED_ANSWER);
        let o = math_answer_match(&format!("\\boxed{{{long}}}"), "x");
        assert!(o.normalized.unwrap().len() <= MAX_REPORTED_ANSWER);
    }

    #[test]
    fn exact_match_ignores_only_surrounding_whitespace() {
        assert!(exact_match("  Paris\n", "Paris").matched);
        assert!(!exact_match("paris", "Paris").matched);
    }

    #[test]
    fn hostile_unicode_and_brace_soup_does_not_panic() {
        for s in [
            "\\boxed{{{{{{",
            "\\boxed}}}}",
            "\\boxed",
            "\\frac{",
            "é\\boxed{é/ü}",
            "\\text{",
            "-",
            "1/-",
            "%%%",
        ] {
            let _ = math_answer_match(s, s);
            let _ = normalize_answer(s);
        }
        assert!(!math_answer_match("\\boxed", "5").matched);
    }
}
