//! The workload model: what the agents and environments of a job produce, sampled.
//!
//! The simulator (and an emulated agent of the node worker), not the core, decides how long a prompt, an action or an observation is, how
//! many turns an episode lasts and how long an environment step or a reward takes; the core only
//! learns these as facts. Samples come from the distributions in the job spec, including the
//! Azure LLM inference trace 2023 (conversation service; Patel et al., "Splitwise", ISCA 2024;
//! CC BY 4.0; vendored in `data/`), drawn uniformly and multiplied by the spec's `scale`.
//!
//! Every sample is drawn from a stream keyed by what it describes (a group's prompt, a
//! trajectory's turn count, turn `k`'s action on attempt `a`, ...), so the same trajectory sees
//! the same workload under every policy and every interleaving of events.

use std::sync::OnceLock;

use rollfleet_core::WorkloadMeans;
use rollfleet_core::rng::SplitMix64;
use rollfleet_spec::{Distribution, JobSpec, TraceColumn, TraceName, lognormal_sigma};

/// The vendored trace.
const AZURE_CONV_2023: &str = include_str!("../data/azure_llm_conv_2023.csv");

/// Attribution that must accompany any figure derived from the trace.
pub const AZURE_ATTRIBUTION: &str = "Azure LLM inference trace 2023 (AzurePublicDataset, \
conversation service), CC BY 4.0; Patel et al., \"Splitwise: Efficient generative LLM inference \
using phase splitting\", ISCA 2024";

/// `(context tokens, generated tokens)` of every request in the trace.
pub fn azure_conv_2023() -> &'static [(f64, f64)] {
    static ROWS: OnceLock<Vec<(f64, f64)>> = OnceLock::new();
    ROWS.get_or_init(|| {
        AZURE_CONV_2023
            .lines()
            .skip(1)
            .filter_map(|line| {
                let mut fields = line.split(',').skip(1);
                let context = fields.next()?.trim().parse::<f64>().ok()?;
                let generated = fields.next()?.trim().parse::<f64>().ok()?;
                Some((context, generated))
            })
            .collect()
    })
}

fn trace_rows(trace: TraceName) -> &'static [(f64, f64)] {
    match trace {
        TraceName::AzureLlmConv2023 => azure_conv_2023(),
    }
}

/// One column of a trace as `f32`s, if every value of it converts exactly (token counts do).
/// Sampling reads one value at a random row: 4 bytes a row, instead of the rows' 16, keep the
/// column in cache. `None` when some value would not survive the conversion.
fn trace_column(trace: TraceName, column: TraceColumn) -> Option<&'static [f32]> {
    fn exact(rows: &[(f64, f64)], column: TraceColumn) -> Option<Vec<f32>> {
        rows.iter()
            .map(|r| {
                let v = match column {
                    TraceColumn::ContextTokens => r.0,
                    TraceColumn::GeneratedTokens => r.1,
                };
                let f = v as f32;
                (f64::from(f) == v).then_some(f)
            })
            .collect()
    }
    static CONTEXT: OnceLock<Option<Vec<f32>>> = OnceLock::new();
    static GENERATED: OnceLock<Option<Vec<f32>>> = OnceLock::new();
    let cell = match (trace, column) {
        (TraceName::AzureLlmConv2023, TraceColumn::ContextTokens) => &CONTEXT,
        (TraceName::AzureLlmConv2023, TraceColumn::GeneratedTokens) => &GENERATED,
    };
    cell.get_or_init(|| exact(trace_rows(trace), column))
        .as_deref()
}

/// The mean of a trace column.
pub fn trace_mean(trace: TraceName, column: TraceColumn) -> f64 {
    let rows = trace_rows(trace);
    if rows.is_empty() {
        return 0.0;
    }
    let sum: f64 = rows
        .iter()
        .map(|r| match column {
            TraceColumn::ContextTokens => r.0,
            TraceColumn::GeneratedTokens => r.1,
        })
        .sum();
    sum / rows.len() as f64
}

/// Draws one value.
pub fn sample(dist: &Distribution, rng: &mut SplitMix64) -> f64 {
    Sampler::new(dist).sample(rng)
}

/// A distribution ready to draw from, with what each draw would otherwise recompute (a
/// log-normal's sigma, a logarithm) computed once: the draws are [`sample`]'s, bit for bit.
#[derive(Debug, Clone, Copy)]
pub struct Sampler<'a> {
    dist: &'a Distribution,
    sigma: f64,
}

impl<'a> Sampler<'a> {
    /// A sampler of `dist`.
    pub fn new(dist: &'a Distribution) -> Self {
        let sigma = match *dist {
            Distribution::LogNormal { median, p99, .. } => lognormal_sigma(median, p99),
            _ => 0.0,
        };
        Sampler { dist, sigma }
    }

    /// Draws one value.
    pub fn sample(&self, rng: &mut SplitMix64) -> f64 {
        let value = match *self.dist {
            Distribution::Fixed { value } => value,
            Distribution::Uniform { min, max } => min + rng.next_f64() * (max - min),
            Distribution::LogNormal { median, max, .. } => {
                let v = median * (self.sigma * rng.normal()).exp();
                max.map_or(v, |m| v.min(m))
            }
            Distribution::Trace {
                trace,
                column,
                scale,
                max,
            } => {
                let v = match trace_column(trace, column) {
                    // The same row and the same value as below, from the compact column.
                    Some(values) => {
                        let value = values
                            .get(rng.below(values.len() as u64) as usize)
                            .map_or(0.0, |&x| f64::from(x));
                        scale * value
                    }
                    None => {
                        let rows = trace_rows(trace);
                        let row = rows
                            .get(rng.below(rows.len() as u64) as usize)
                            .copied()
                            .unwrap_or((0.0, 0.0));
                        scale
                            * match column {
                                TraceColumn::ContextTokens => row.0,
                                TraceColumn::GeneratedTokens => row.1,
                            }
                    }
                };
                max.map_or(v, |m| v.min(m))
            }
            // Uniformly among the rows read when the job was loaded (none: 0).
            Distribution::Csv {
                ref rows,
                scale,
                max,
                ..
            } => {
                let values = rows.values().unwrap_or(&[]);
                let v = if values.is_empty() {
                    0.0
                } else {
                    values
                        .get(rng.below(values.len() as u64) as usize)
                        .map_or(0.0, |&x| scale * x)
                };
                max.map_or(v, |m| v.min(m))
            }
        };
        if value.is_finite() {
            value.max(0.0)
        } else {
            0.0
        }
    }
}

/// The mean of a distribution: closed form where there is one, the trace's own mean scaled and
/// clipped (estimated from the rows) otherwise; a CSV column's is exact, from its rows.
pub fn mean(dist: &Distribution) -> f64 {
    match *dist {
        Distribution::Trace {
            trace,
            column,
            scale,
            max,
        } => {
            let rows = trace_rows(trace);
            if rows.is_empty() {
                return 0.0;
            }
            let sum: f64 = rows
                .iter()
                .map(|r| {
                    let v = scale
                        * match column {
                            TraceColumn::ContextTokens => r.0,
                            TraceColumn::GeneratedTokens => r.1,
                        };
                    max.map_or(v, |m| v.min(m))
                })
                .sum();
            sum / rows.len() as f64
        }
        ref other => other.mean().unwrap_or(0.0),
    }
}

/// Stream tags, so that different quantities never share a stream.
pub mod stream {
    /// A group's prompt length.
    pub const PROMPT: u64 = 11;
    /// A trajectory's number of turns.
    pub const TURNS: u64 = 12;
    /// An action's length.
    pub const ACTION: u64 = 13;
    /// An observation's length.
    pub const OBSERVATION: u64 = 14;
    /// An environment step's latency.
    pub const ENV_LATENCY: u64 = 15;
    /// Whether an environment step fails.
    pub const ENV_FAILURE: u64 = 16;
    /// A reward's latency.
    pub const REWARD: u64 = 17;
    /// Replica failures.
    pub const FAILURES: u64 = 18;
}

/// Average tokens per trajectory of a job, for the placement.
pub fn workload_means(spec: &JobSpec) -> WorkloadMeans {
    let mut prefill = 0.0;
    let mut train = 0.0;
    let total_share: f64 = spec
        .tasks
        .iter()
        .map(|t| t.share.max(0.0))
        .sum::<f64>()
        .max(1e-9);
    for task in &spec.tasks {
        let turns = task
            .turns
            .as_ref()
            .map_or(task.max_turns as f64, |d| mean(d))
            .clamp(1.0, task.max_turns.max(1) as f64);
        let p = mean(&task.prompt_tokens);
        let a = mean(&task.action_tokens);
        let o = mean(&task.observation_tokens);
        let w = task.share.max(0.0) / total_share;
        prefill += w * (p + (turns - 1.0) * o);
        train += w * (p + turns * a + (turns - 1.0) * o);
    }
    WorkloadMeans {
        prefill_tokens: prefill,
        train_tokens: train,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vendored_trace_has_every_row_and_its_published_medians() {
        let rows = azure_conv_2023();
        // The upstream README says 19,365 requests; the file holds 19,366 data rows.
        assert_eq!(rows.len(), 19_366);
        let mut generated: Vec<f64> = rows.iter().map(|r| r.1).collect();
        generated.sort_by(f64::total_cmp);
        assert_eq!(generated[generated.len() / 2], 129.0);
    }

    #[test]
    fn both_trace_columns_are_kept_exactly_as_f32() {
        let rows = azure_conv_2023();
        for column in [TraceColumn::ContextTokens, TraceColumn::GeneratedTokens] {
            let values = trace_column(TraceName::AzureLlmConv2023, column)
                .expect("token counts convert exactly");
            assert_eq!(values.len(), rows.len());
            for (v, r) in values.iter().zip(rows) {
                let want = match column {
                    TraceColumn::ContextTokens => r.0,
                    TraceColumn::GeneratedTokens => r.1,
                };
                assert_eq!(f64::from(*v).to_bits(), want.to_bits());
            }
        }
    }

    #[test]
    fn trace_samples_are_scaled_and_clipped() {
        let dist = Distribution::Trace {
            trace: TraceName::AzureLlmConv2023,
            column: TraceColumn::GeneratedTokens,
            scale: 3.0,
            max: Some(500.0),
        };
        let mut rng = SplitMix64::new(3);
        for _ in 0..1000 {
            let v = sample(&dist, &mut rng);
            assert!(
                (0.0..=500.0).contains(&v) && (v == 500.0 || v % 3.0 == 0.0),
                "{v}"
            );
        }
    }

    #[test]
    fn lognormal_samples_have_the_stated_median() {
        let dist = Distribution::LogNormal {
            median: 100.0,
            p99: 1000.0,
            max: None,
        };
        let mut rng = SplitMix64::new(9);
        let mut v: Vec<f64> = (0..20_001).map(|_| sample(&dist, &mut rng)).collect();
        v.sort_by(f64::total_cmp);
        assert!((90.0..110.0).contains(&v[10_000]), "{}", v[10_000]);
    }

    #[test]
    fn a_clipped_lognormal_mean_is_what_a_large_sample_of_its_draws_averages() {
        // Clipped at its 90th percentile, a heavy tail (p99 ten times the median) loses a
        // fifth of its mean: `min(unclipped mean, max)` kept the clip instead.
        let dist = Distribution::LogNormal {
            median: 1000.0,
            p99: 10_000.0,
            max: Some(2_700.0),
        };
        let sampler = Sampler::new(&dist);
        let mut rng = SplitMix64::new(20_240_601);
        let n = 2_000_000;
        let total: f64 = (0..n).map(|_| sampler.sample(&mut rng)).sum();
        let sampled = total / n as f64;
        let exact = mean(&dist);
        assert!(
            (exact - sampled).abs() < 0.002 * sampled,
            "{exact} vs {sampled}"
        );
        assert!(exact < 2_700.0 - 100.0, "{exact}");
    }

    fn csv(values: Vec<f64>, scale: f64, max: Option<f64>) -> Distribution {
        Distribution::Csv {
            path: "rows.csv".into(),
            column: "tokens".into(),
            scale,
            max,
            rows: rollfleet_spec::CsvRows::new(values),
        }
    }

    #[test]
    fn csv_samples_are_scaled_rows_the_same_for_the_same_seed() {
        let values: Vec<f64> = (0..50).map(|i| f64::from(i * i % 97)).collect();
        let dist = csv(values.clone(), 2.5, None);
        let draw = |seed| {
            let mut rng = SplitMix64::new(seed);
            (0..200)
                .map(|_| sample(&dist, &mut rng))
                .collect::<Vec<_>>()
        };
        let first = draw(7);
        assert_eq!(first, draw(7));
        assert_ne!(first, draw(8));
        for v in &first {
            assert!(values.iter().any(|r| 2.5 * r == *v), "{v}");
        }
    }

    #[test]
    fn csv_sample_means_converge_to_the_exact_mean_of_the_rows() {
        let values: Vec<f64> = (0..1000).map(|i| f64::from((i * 7919) % 1009)).collect();
        let exact_rows = values.iter().sum::<f64>() / values.len() as f64;
        for (scale, max) in [(1.0, None), (3.0, None), (2.0, Some(1500.0))] {
            let dist = csv(values.clone(), scale, max);
            let exact = mean(&dist);
            if max.is_none() {
                assert!((exact - scale * exact_rows).abs() < 1e-9, "{exact}");
            } else {
                assert!(exact < scale * exact_rows, "{exact}");
            }
            let sampler = Sampler::new(&dist);
            let mut rng = SplitMix64::new(41);
            let n = 400_000;
            let sampled = (0..n).map(|_| sampler.sample(&mut rng)).sum::<f64>() / n as f64;
            assert!(
                (sampled - exact).abs() < 0.01 * exact,
                "{sampled} vs {exact}"
            );
        }
    }

    #[test]
    fn a_csv_distribution_whose_file_was_not_read_draws_zero() {
        let dist = Distribution::Csv {
            path: "rows.csv".into(),
            column: "tokens".into(),
            scale: 1.0,
            max: None,
            rows: rollfleet_spec::CsvRows::default(),
        };
        assert_eq!(sample(&dist, &mut SplitMix64::new(1)), 0.0);
        assert_eq!(mean(&dist), 0.0);
    }

    fn quickstart() -> JobSpec {
        let text = include_str!("../../../examples/jobs/quickstart.yaml");
        rollfleet_spec::parse_job(text.as_bytes(), "quickstart.yaml")
            .unwrap()
            .spec()
            .clone()
    }

    fn fixed(value: f64) -> rollfleet_spec::Dist {
        rollfleet_spec::Dist(Distribution::Fixed { value })
    }

    #[test]
    fn workload_means_count_the_first_prompt_once_and_every_later_observation_in_prefill() {
        let mut spec = quickstart();
        spec.tasks.truncate(1);
        let task = &mut spec.tasks[0];
        task.share = 1.0;
        task.max_turns = 8;
        task.turns = Some(fixed(3.0));
        task.prompt_tokens = fixed(100.0);
        task.action_tokens = fixed(10.0);
        task.observation_tokens = fixed(20.0);
        let means = workload_means(&spec);
        // 100 prompt tokens, then 2 observations of 20 prefilled; training sees all 3 actions.
        assert_eq!(means.prefill_tokens, 100.0 + 2.0 * 20.0);
        assert_eq!(means.train_tokens, 100.0 + 3.0 * 10.0 + 2.0 * 20.0);
    }

    #[test]
    fn workload_means_weigh_tasks_by_share_and_cap_turns_at_the_tasks_maximum() {
        let mut spec = quickstart();
        spec.tasks.truncate(1);
        let mut task = spec.tasks[0].clone();
        task.max_turns = 2;
        task.turns = Some(fixed(5.0));
        task.prompt_tokens = fixed(100.0);
        task.action_tokens = fixed(10.0);
        task.observation_tokens = fixed(0.0);
        task.share = 3.0;
        let mut single_turn = task.clone();
        single_turn.turns = None;
        single_turn.max_turns = 1;
        single_turn.share = 1.0;
        spec.tasks = vec![task, single_turn];
        let means = workload_means(&spec);
        // Five turns asked, two allowed: 100 + 2 x 10 trained, weighted 3:1 against 100 + 10.
        assert_eq!(means.train_tokens, 0.75 * 120.0 + 0.25 * 110.0);
        assert_eq!(means.prefill_tokens, 100.0);
    }
}
