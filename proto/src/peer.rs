//! What one side of the contract may send the other, and how a string a peer sent is shown.
//!
//! The scheduler, its workers and the operator all print what peers said (a pool name, an
//! environment kind, an error text), and all of them check the same per-message limits; both
//! live here, beside the messages, so that no process needs the scheduler server to speak the
//! contract.

/// Profile samples a worker's load report may carry; more is a protocol violation.
pub const MAX_PROFILE_SAMPLES_PER_REPORT: usize = 512;

/// How much of a peer's string an error message quotes.
pub const QUOTED_CHARS: usize = 64;

/// A string a peer sent, quoted for an error message: at most [`QUOTED_CHARS`] characters of
/// it, escaped, so that a newline cannot forge a log line. An error travels in the
/// `grpc-message` header, and one echoing a hostile 100 KB name whole broke the client's HTTP/2
/// header limit instead of reaching it (found by fuzzing).
pub fn quoted(s: &str) -> String {
    let head = first_chars(s, QUOTED_CHARS);
    if head.len() == s.len() {
        format!("{head:?}")
    } else {
        format!("{head:?}... ({} bytes)", s.len())
    }
}

/// The first `n` characters of `s` (all of it when shorter).
pub fn first_chars(s: &str, n: usize) -> &str {
    s.char_indices().nth(n).map_or(s, |(end, _)| &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_string_is_quoted_whole_when_short_and_cut_with_its_length_when_long() {
        assert_eq!(quoted("h20"), "\"h20\"");
        assert_eq!(quoted("a\u{0}b"), "\"a\\0b\"");
        assert_eq!(quoted("a\nforged"), "\"a\\nforged\"");
        let long = "ü".repeat(100);
        assert_eq!(
            quoted(&long),
            format!("{:?}... (200 bytes)", "ü".repeat(64))
        );
    }

    #[test]
    fn first_chars_cuts_on_a_character_boundary() {
        assert_eq!(first_chars("üüü", 2), "üü");
        assert_eq!(first_chars("ab", 5), "ab");
    }
}
