//! Distributions of token counts and latencies, as a job spec writes them.
//!
//! A user writes either a plain number (`actionTokens: 256`) or a map tagged by `distribution`
//! (`{distribution: lognormal, median: 256, p99: 2048}`). The spec only describes and validates
//! them; sampling belongs to the simulator, which owns its seeded random number generator.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

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
}

fn one() -> f64 {
    1.0
}

impl Distribution {
    /// The mean, where it has a closed form (trace means come from the trace itself).
    pub fn mean(&self) -> Option<f64> {
        match *self {
            Distribution::Fixed { value } => Some(value),
            Distribution::Uniform { min, max } => Some((min + max) / 2.0),
            Distribution::LogNormal { median, p99, max } => {
                let sigma = lognormal_sigma(median, p99);
                let mean = median * (sigma * sigma / 2.0).exp();
                Some(max.map_or(mean, |m| mean.min(m)))
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
            Distribution::Trace { scale, max, .. } => {
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

/// The sigma of a log-normal with the given median and 99th percentile.
pub fn lognormal_sigma(median: f64, p99: f64) -> f64 {
    /// The 99th percentile of the standard normal distribution.
    const Z99: f64 = 2.326_347_874_040_841;
    if median <= 0.0 || p99 <= median {
        return 0.0;
    }
    (p99 / median).ln() / Z99
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
    fn inverted_uniform_bounds_are_a_problem() {
        let problems = Distribution::Uniform { min: 5.0, max: 1.0 }.problems();
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].0, "max");
    }
}
