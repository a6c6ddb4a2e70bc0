//! Virtual time: the core's only notion of "when".
//!
//! The core never reads a clock. Every input carries a [`Time`] supplied by whoever drives the
//! core: the simulator's virtual clock, or the server's wall clock converted to nanoseconds since
//! the job started. Nanoseconds in a `u64` cover 584 years, and integer time keeps every decision
//! exactly reproducible.

use serde::{Deserialize, Serialize};

/// A point in time, in nanoseconds since the job started.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Time(pub u64);

impl Time {
    /// The start of the job.
    pub const ZERO: Time = Time(0);
    /// Never (used as "no deadline").
    pub const NEVER: Time = Time(u64::MAX);

    /// From seconds (non-finite or negative values saturate to zero / [`Time::NEVER`]).
    pub fn from_secs_f64(secs: f64) -> Time {
        Time(secs_to_nanos(secs))
    }

    /// As seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// This time plus a span, saturating.
    pub fn plus(self, span: Span) -> Time {
        Time(self.0.saturating_add(span.0))
    }

    /// The span from `earlier` to `self` (zero if `earlier` is later).
    pub fn since(self, earlier: Time) -> Span {
        Span(self.0.saturating_sub(earlier.0))
    }
}

/// A length of time, in nanoseconds.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Span(pub u64);

impl Span {
    /// No time at all.
    pub const ZERO: Span = Span(0);

    /// From seconds (non-finite or negative values saturate).
    pub fn from_secs_f64(secs: f64) -> Span {
        Span(secs_to_nanos(secs))
    }

    /// From milliseconds.
    pub fn from_millis(ms: u64) -> Span {
        Span(ms.saturating_mul(1_000_000))
    }

    /// As seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }
}

fn secs_to_nanos(secs: f64) -> u64 {
    if secs.is_nan() || secs <= 0.0 {
        0
    } else if secs >= u64::MAX as f64 / 1e9 {
        u64::MAX
    } else {
        round_positive(secs * 1e9)
    }
}

/// `x.round() as u64` for a positive finite `x`, without the libm call `f64::round` compiles to
/// on baseline x86-64 (it ran on every event). Below 2^52 the truncation and the fraction
/// `x - trunc(x)` are exact, so halves round away from zero as `round` does; from 2^52 on every
/// `f64` is already an integer.
fn round_positive(x: f64) -> u64 {
    const EXACT: f64 = (1u64 << 52) as f64;
    if x >= EXACT {
        return x as u64;
    }
    // Through `i64`: below 2^52 it holds the value, and its conversions are single
    // instructions where `u64`'s are not.
    let t = x as i64;
    let t = if x - t as f64 >= 0.5 { t + 1 } else { t };
    t as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_round_trip_through_nanoseconds() {
        assert_eq!(Time::from_secs_f64(1.5), Time(1_500_000_000));
        assert_eq!(Time(2_000_000_000).as_secs_f64(), 2.0);
    }

    #[test]
    fn rounding_to_nanoseconds_matches_f64_round() {
        let mut x = 1e-9_f64;
        while x < 1e10 {
            for v in [
                x,
                x * 1.5,
                x + 0.5e-9,
                x * 3.7,
                (x * 1e9).floor() / 1e9 + 0.5e-9,
            ] {
                assert_eq!(secs_to_nanos(v), (v * 1e9).round() as u64, "{v} s");
            }
            x *= 1.37;
        }
        for n in [
            0.5,
            1.5,
            2.5,
            4_503_599_627_370_495.5,
            4_503_599_627_370_496.0,
            1e19,
        ] {
            assert_eq!(round_positive(n), n.round() as u64, "{n}");
        }
    }

    #[test]
    fn nonsense_seconds_saturate_instead_of_panicking() {
        assert_eq!(Span::from_secs_f64(f64::NAN), Span::ZERO);
        assert_eq!(Span::from_secs_f64(-3.0), Span::ZERO);
        assert_eq!(Span::from_secs_f64(f64::INFINITY), Span(u64::MAX));
        assert_eq!(Time::NEVER.plus(Span(5)), Time::NEVER);
    }
}
