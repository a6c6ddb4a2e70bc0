//! Distributions of token counts and latencies, as a job spec writes them.
//!
//! A user writes either a plain number (`actionTokens: 256`) or a map tagged by `distribution`
//! (`{distribution: lognormal, median: 256, p99: 2048}`). The spec only describes and validates
//! them; sampling belongs to the simulator, which owns its seeded random number generator.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::csv_column::CsvRows;

/// A real trace a distribution can sample from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TraceName {
    /// The Azure LLM inference trace 2023, conversation service (Patel et al., Splitwise,
    /// ISCA 2024; CC BY 4.0): 19,365 requests with their context and generated token counts.
    #[serde(rename = "azure-llm-conv-2023")]
    AzureLlmConv2023,
}

/// Which column of a trace to sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum TraceColumn {
    /// Prompt (context) token counts.
    ContextTokens,
    /// Generated (response) token counts.
    GeneratedTokens,
}

/// A distribution of a non-negative quantity (tokens, or milliseconds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "distribution", rename_all = "camelCase", deny_unknown_fields)]
pub enum Distribution {
    /// Always the same value.
    Fixed {
        /// The value.
        value: f64,
    },
    /// Uniform between `min` and `max`, inclusive.
    Uniform {
        /// Lower end.
        min: f64,
        /// Upper end.
        max: f64,
    },
    /// Log-normal, given by its median and 99th percentile (the two figures people know).
    #[serde(rename = "lognormal")]
    LogNormal {
        /// Median (50th percentile).
        median: f64,
        /// 99th percentile; at least the median.
        p99: f64,
        /// Values above this are clipped to it (a context limit, or a timeout).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max: Option<f64>,
    },
    /// Samples from a real trace, multiplied by `scale`.
    Trace {
        /// Which trace.
        trace: TraceName,
        /// Which column of it.
        column: TraceColumn,
        /// Multiplier applied to every sample (RL rollouts have longer tails than serving).
        #[serde(default = "one")]
        scale: f64,
        /// Values above this are clipped to it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max: Option<f64>,
    },
    /// Samples uniformly among the rows of one column of a CSV file, multiplied by `scale`.
    Csv {
        /// The file. [`crate::load_job_file`] resolves a relative path against the job file's
        /// directory; [`crate::parse_job`] against the current directory.
        path: String,
        /// The column, as the header row names it.
        column: String,
        /// Multiplier applied to every sample.
        #[serde(default = "one")]
        scale: f64,
        /// Values above this are clipped to it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max: Option<f64>,
        /// The column's values, read when the job is loaded (not written in the YAML).
        #[serde(skip)]
        rows: CsvRows,
    },
}

fn one() -> f64 {
    1.0
}

impl Distribution {
    /// The mean, where it has a closed form (trace means come from the trace itself); a CSV
    /// column's is the exact mean of its rows (scaled and clipped), once the file was read.
    pub fn mean(&self) -> Option<f64> {
        match *self {
            Distribution::Csv {
                ref rows,
                scale,
                max,
                ..
            } => csv_moment(rows, scale, max, 1),
            Distribution::Fixed { value } => Some(value),
            Distribution::Uniform { min, max } => Some((min + max) / 2.0),
            Distribution::LogNormal { median, p99, max } => Some(lognormal_moment(
                median,
                lognormal_sigma(median, p99),
                max,
                1,
            )),
            Distribution::Trace { .. } => None,
        }
    }

    /// The variance, where it has a closed form (a log-normal's of the values actually drawn,
    /// `min(X, max)`), or of a CSV column's rows; `None` for a trace.
    pub fn variance(&self) -> Option<f64> {
        match *self {
            Distribution::Csv {
                ref rows,
                scale,
                max,
                ..
            } => match max {
                None => rows.variance().map(|v| v * scale * scale),
                Some(_) => {
                    let m1 = csv_moment(rows, scale, max, 1)?;
                    let m2 = csv_moment(rows, scale, max, 2)?;
                    Some((m2 - m1 * m1).max(0.0))
                }
            },
            Distribution::Fixed { .. } => Some(0.0),
            Distribution::Uniform { min, max } => Some((max - min).powi(2) / 12.0),
            Distribution::LogNormal { median, p99, max } => {
                let sigma = lognormal_sigma(median, p99);
                let m1 = lognormal_moment(median, sigma, max, 1);
                let m2 = lognormal_moment(median, sigma, max, 2);
                Some((m2 - m1 * m1).max(0.0))
            }
            Distribution::Trace { .. } => None,
        }
    }

    /// The third cumulant (third central moment), where it has a closed form (a log-normal's
    /// of the values actually drawn, `min(X, max)`), or of a CSV column's rows; `None` for a
    /// trace. How far the right tail reaches: the largest of many draws lies where it puts it.
    pub fn third_cumulant(&self) -> Option<f64> {
        let central = |m1: f64, m2: f64, m3: f64| m3 - 3.0 * m1 * m2 + 2.0 * m1.powi(3);
        match *self {
            Distribution::Csv {
                ref rows,
                scale,
                max,
                ..
            } => {
                let m1 = csv_moment(rows, scale, max, 1)?;
                let m2 = csv_moment(rows, scale, max, 2)?;
                let m3 = csv_moment(rows, scale, max, 3)?;
                Some(central(m1, m2, m3))
            }
            Distribution::Fixed { .. } | Distribution::Uniform { .. } => Some(0.0),
            Distribution::LogNormal { median, p99, max } => {
                let sigma = lognormal_sigma(median, p99);
                let m = |n| lognormal_moment(median, sigma, max, n);
                Some(central(m(1), m(2), m(3)))
            }
            Distribution::Trace { .. } => None,
        }
    }

    /// The largest value it can take, if bounded.
    pub fn upper_bound(&self) -> Option<f64> {
        match *self {
            Distribution::Fixed { value } => Some(value),
            Distribution::Uniform { max, .. } => Some(max),
            Distribution::LogNormal { max, .. } | Distribution::Trace { max, .. } => max,
            Distribution::Csv {
                ref rows,
                scale,
                max,
                ..
            } => match rows.largest() {
                Some((largest, _)) => Some(max.map_or(largest * scale, |m| m.min(largest * scale))),
                None => max,
            },
        }
    }

    /// Every problem with the parameters, as `(field, reason)`; empty when valid.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        let mut non_negative = |field: &'static str, value: f64| {
            if !value.is_finite() || value < 0.0 {
                problems.push((field, format!("must be a finite number >= 0, got {value}")));
            }
        };
        match *self {
            Distribution::Fixed { value } => non_negative("value", value),
            Distribution::Uniform { min, max } => {
                non_negative("min", min);
                non_negative("max", max);
                if min > max {
                    problems.push(("max", format!("must be >= min ({min}), got {max}")));
                }
            }
            Distribution::LogNormal { median, p99, max } => {
                if !median.is_finite() || median <= 0.0 {
                    problems.push(("median", format!("must be > 0, got {median}")));
                }
                if !p99.is_finite() || p99 < median {
                    problems.push(("p99", format!("must be >= median ({median}), got {p99}")));
                }
                if let Some(max) = max
                    && (!max.is_finite() || max < median)
                {
                    problems.push(("max", format!("must be >= median ({median}), got {max}")));
                }
            }
            Distribution::Trace { scale, max, .. } | Distribution::Csv { scale, max, .. } => {
                if !scale.is_finite() || scale <= 0.0 {
                    problems.push(("scale", format!("must be > 0, got {scale}")));
                }
                if let Some(max) = max
                    && (!max.is_finite() || max <= 0.0)
                {
                    problems.push(("max", format!("must be > 0, got {max}")));
                }
            }
        }
        problems
    }
}

/// `E[min(scale X, max)^n]` over a CSV column's rows `X`: exact, from the rows themselves.
fn csv_moment(rows: &CsvRows, scale: f64, max: Option<f64>, n: i32) -> Option<f64> {
    if n == 1
        && max.is_none()
        && let Some(mean) = rows.mean()
    {
        return Some(mean * scale);
    }
    let values = rows.values()?;
    if values.is_empty() {
        return Some(0.0);
    }
    let sum: f64 = values
        .iter()
        .map(|&v| {
            let v = scale * v;
            max.map_or(v, |m| v.min(m)).powi(n)
        })
        .sum();
    Some(sum / values.len() as f64)
}

/// The sigma of a log-normal with the given median and 99th percentile.
pub fn lognormal_sigma(median: f64, p99: f64) -> f64 {
    /// The 99th percentile of the standard normal distribution.
    const Z99: f64 = 2.326_347_874_040_841;
    if median <= 0.0 || p99 <= median {
        return 0.0;
    }
    (p99 / median).ln() / Z99
}

/// `E[min(X, max)^n]` for a log-normal `X` of median `e^mu` and log-sd `sigma`, in closed form:
/// `e^(n mu + n^2 sigma^2 / 2) Phi((ln max - mu - n sigma^2) / sigma) + max^n (1 - Phi((ln max -
/// mu) / sigma))` (the partial moments of the log-normal; e.g. Johnson, Kotz and Balakrishnan,
/// "Continuous Univariate Distributions", vol. 1, 2nd ed., ch. 14). This is the moment of what
/// the sampler draws, which clips at `max`, not the unclipped moment clipped afterwards.
pub fn lognormal_moment(median: f64, sigma: f64, max: Option<f64>, n: i32) -> f64 {
    let nf = f64::from(n);
    let raw = median.powi(n) * (nf * nf * sigma * sigma / 2.0).exp();
    let Some(m) = max else {
        return raw;
    };
    if median <= 0.0 || m <= 0.0 {
        return 0.0;
    }
    if sigma <= 0.0 {
        return median.min(m).powi(n);
    }
    let z = (m / median).ln() / sigma;
    raw * normal_cdf(z - nf * sigma) + m.powi(n) * normal_cdf(-z)
}

/// The standard normal distribution function, from the complementary error function `erfcc` of
/// Numerical Recipes in C (Press et al., 2nd ed., section 6.2: fractional error below 1.2e-7
/// everywhere).
pub fn normal_cdf(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 {
        1.0 - erfc / 2.0
    } else {
        erfc / 2.0
    }
}

/// A distribution that may be written as a bare number.
///
/// Hand-written so that a plain number becomes `Fixed` while a map keeps serde's own precise
/// error messages (an untagged enum would reduce every mistake to "did not match any variant").
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Dist(pub Distribution);

impl std::ops::Deref for Dist {
    type Target = Distribution;
    fn deref(&self) -> &Distribution {
        &self.0
    }
}

#[cfg(feature = "schema")]
impl schemars::JsonSchema for Dist {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Dist".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        crate::schema::distribution()
    }
}

impl<'de> Deserialize<'de> for Dist {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DistVisitor;
        impl<'de> Visitor<'de> for DistVisitor {
            type Value = Dist;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number or a map with a `distribution` key")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dist, E> {
                Ok(Dist(Distribution::Fixed { value: v as f64 }))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dist, E> {
                Ok(Dist(Distribution::Fixed { value: v as f64 }))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Dist, E> {
                Ok(Dist(Distribution::Fixed { value: v }))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Dist, A::Error> {
                Distribution::deserialize(de::value::MapAccessDeserializer::new(map)).map(Dist)
            }
        }
        deserializer.deserialize_any(DistVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_number_is_a_fixed_distribution() {
        let dist: Dist = serde_json::from_str("256").unwrap();
        assert_eq!(dist.0, Distribution::Fixed { value: 256.0 });
    }

    #[test]
    fn a_tagged_map_keeps_its_parameters() {
        let dist: Dist =
            serde_json::from_str(r#"{"distribution":"lognormal","median":100,"p99":900}"#).unwrap();
        assert_eq!(
            dist.0,
            Distribution::LogNormal {
                median: 100.0,
                p99: 900.0,
                max: None
            }
        );
    }

    #[test]
    fn an_unknown_parameter_is_named_in_the_error() {
        let error = serde_json::from_str::<Dist>(r#"{"distribution":"fixed","valu":1}"#)
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown field `valu`"), "{error}");
    }

    #[test]
    fn lognormal_mean_matches_the_closed_form() {
        // median 100, p99 = 100 * e^(2.326 * 1) so sigma = 1 and mean = 100 * e^0.5.
        let p99 = 100.0 * 2.326_347_874_040_841_f64.exp();
        let mean = Distribution::LogNormal {
            median: 100.0,
            p99,
            max: None,
        }
        .mean()
        .unwrap();
        assert!((mean - 100.0 * 0.5_f64.exp()).abs() < 1e-9, "{mean}");
    }

    #[test]
    fn a_lognormals_third_cumulant_matches_the_closed_form_and_a_clip_cuts_it() {
        // sigma = 1: w = e, variance (w - 1) w e^0 x 100^2, third cumulant v^1.5 (w + 2) sqrt(w - 1).
        let p99 = 100.0 * 2.326_347_874_040_841_f64.exp();
        let open = Distribution::LogNormal {
            median: 100.0,
            p99,
            max: None,
        };
        let w = std::f64::consts::E;
        let v = 100.0_f64.powi(2) * w * (w - 1.0);
        let hand = v.powf(1.5) * (w + 2.0) * (w - 1.0).sqrt();
        let k3 = open.third_cumulant().unwrap();
        assert!((k3 - hand).abs() < 1e-9 * hand, "{k3} vs {hand}");
        // Clipped at its p99, the tail it keeps is far shorter.
        let clipped = Distribution::LogNormal {
            median: 100.0,
            p99,
            max: Some(p99),
        };
        assert!(clipped.third_cumulant().unwrap() < 0.5 * hand);
        // Symmetric ones have none; a trace's is not known here.
        assert_eq!(
            Distribution::Uniform { min: 1.0, max: 9.0 }.third_cumulant(),
            Some(0.0)
        );
        assert_eq!(
            Distribution::Fixed { value: 3.0 }.third_cumulant(),
            Some(0.0)
        );
    }

    #[test]
    fn a_clipped_lognormal_mean_is_the_mean_of_the_clipped_values() {
        // sigma = 1, clipped at the median: half the mass sits at the median, the other half
        // averages 100 e^0.5 Phi(-1) / 0.5 below it; the old `min(mean, max)` gave 100.
        let p99 = 100.0 * 2.326_347_874_040_841_f64.exp();
        let clipped = Distribution::LogNormal {
            median: 100.0,
            p99,
            max: Some(100.0),
        };
        let expected = 100.0 * 0.5_f64.exp() * normal_cdf(-1.0) + 100.0 * 0.5;
        let mean = clipped.mean().unwrap();
        assert!((mean - expected).abs() < 1e-4, "{mean} vs {expected}");
        assert!(mean < 100.0);
        // A clip far above everything changes nothing.
        let far = Distribution::LogNormal {
            median: 100.0,
            p99,
            max: Some(1e12),
        };
        assert!((far.mean().unwrap() - 100.0 * 0.5_f64.exp()).abs() < 1e-6);
    }

    #[test]
    fn inverted_uniform_bounds_are_a_problem() {
        let problems = Distribution::Uniform { min: 5.0, max: 1.0 }.problems();
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].0, "max");
    }
}
