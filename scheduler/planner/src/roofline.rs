//! Model-based profiles: the roofline of every kind of work on every GPU product.
//!
//! A piece of work is a number of FLOPs and a number of bytes moved through device memory. Its
//! arithmetic intensity (FLOP per byte) against a GPU's ridge point (peak FLOP/s over memory
//! bytes/s) says which of the two limits it: above the ridge, compute; below it, bandwidth. This
//! is the whole reason prefill belongs on an H800 (ridge 295 FLOP/byte; prefill runs at
//! thousands) and decode on an H20 (decode runs at tens, below even the H20's ridge of 37, so only
//! bandwidth matters and the H20 has more of it for less money).
//!
//! The formulas are the ones every cost model in rollfleet starts from ([`ModelSpec`]'s per-token
//! figures): `2 N` FLOPs per token forward plus `4 L H c` for attention over `c` earlier tokens,
//! `6 N` per token in training, the active weights read once per forward pass, the KV cache read
//! once per decoded token. Achieved rates are peak times the [`Efficiency`] the planner assumes;
//! measured profiles ([`crate::profile`]) replace these once a cluster has reported enough
//! samples.

use rollfleet_catalog::GpuProduct;
use rollfleet_spec::ModelSpec;
use serde::{Deserialize, Serialize};

/// The kinds of work a profile covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkKind {
    /// Prefill of a prompt or an observation.
    Prefill,
    /// One decode iteration of a batch of sequences.
    Decode,
    /// A training pass (forward and backward).
    Train,
    /// Moving one copy of the weights from the trainer to a replica.
    WeightTransfer,
}

impl WorkKind {
    /// Every kind, in a fixed order.
    pub const ALL: [WorkKind; 4] = [
        WorkKind::Prefill,
        WorkKind::Decode,
        WorkKind::Train,
        WorkKind::WeightTransfer,
    ];

    /// Its name in tables and files.
    pub fn name(self) -> &'static str {
        match self {
            WorkKind::Prefill => "prefill",
            WorkKind::Decode => "decode",
            WorkKind::Train => "train",
            WorkKind::WeightTransfer => "weight-transfer",
        }
    }
}

/// Shares of peak a GPU achieves: the planner's own assumptions, replaced by measured profiles.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Efficiency {
    /// Share of peak dense FLOP/s inference kernels achieve.
    pub compute: f64,
    /// Share of peak HBM bandwidth memory-bound kernels achieve.
    pub bandwidth: f64,
    /// Share of the cross-pool network a bulk transfer achieves.
    pub link: f64,
}

impl Default for Efficiency {
    /// The fractions commonly reported for well-tuned serving stacks (about 60% of peak FLOP/s
    /// for large GEMMs, 80% of HBM bandwidth for decode). They are the planner's estimates; the
    /// simulator keeps its own hardware model on purpose, so that a wrong estimate shows.
    fn default() -> Self {
        Efficiency {
            compute: 0.6,
            bandwidth: 0.8,
            link: 0.8,
        }
    }
}

/// FLOPs and bytes of one piece of work.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Work {
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes moved through device memory (or over the network, for a transfer).
    pub bytes: f64,
}

/// Which roof limits a piece of work on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bound {
    /// FLOP/s.
    Compute,
    /// Memory bandwidth.
    Bandwidth,
}

impl Bound {
    /// Its name in explanations.
    pub fn name(self) -> &'static str {
        match self {
            Bound::Compute => "compute-bound",
            Bound::Bandwidth => "bandwidth-bound",
        }
    }
}

impl Work {
    /// FLOP per byte.
    pub fn intensity(&self) -> f64 {
        if self.bytes > 0.0 {
            self.flops / self.bytes
        } else {
            f64::INFINITY
        }
    }

    /// Which roof limits it on a GPU of the given ridge point.
    pub fn bound_on(&self, ridge: f64) -> Bound {
        if self.intensity() >= ridge {
            Bound::Compute
        } else {
            Bound::Bandwidth
        }
    }

    /// Seconds on a device with these achieved rates (the roofline: the slower of the two).
    pub fn seconds(&self, flops_per_s: f64, bytes_per_s: f64) -> f64 {
        let c = if self.flops > 0.0 {
            self.flops / flops_per_s.max(1e-30)
        } else {
            0.0
        };
        let b = if self.bytes > 0.0 {
            self.bytes / bytes_per_s.max(1e-30)
        } else {
            0.0
        };
        c.max(b)
    }
}

/// Prefill of `tokens` new tokens after `cached` tokens already in the KV cache: every new
/// token's dense FLOPs, causal attention over everything before it, one read of the weights its
/// tokens route to (all of them for a dense model), and the KV cache read and written once.
pub fn prefill(model: &ModelSpec, tokens: f64, cached: f64) -> Work {
    Work {
        flops: tokens * model.forward_flops_per_token()
            + rollfleet_spec::causal_attention_flops(
                model.attention_flops_per_token(1.0),
                cached,
                tokens,
            ),
        bytes: model.weight_reads().bytes(tokens) + model.kv_bytes_per_token() * (cached + tokens),
    }
}

/// One decode iteration of `batch` sequences at `context` tokens each: one token per sequence,
/// one read of the weights the batch's tokens route to (all active weights of a dense model),
/// and every sequence's KV cache read.
pub fn decode_step(model: &ModelSpec, batch: f64, context: f64) -> Work {
    Work {
        flops: batch * (model.forward_flops_per_token() + model.attention_flops_per_token(context)),
        bytes: model.weight_reads().bytes(batch) + batch * model.kv_bytes_per_token() * context,
    }
}

/// Training on `tokens` tokens: `6 x active parameters` FLOPs per token; the weights are read
/// forward and backward and the gradients written once per pass.
pub fn train(model: &ModelSpec, tokens: f64) -> Work {
    Work {
        flops: model.train_flops_per_token() * tokens,
        bytes: 3.0 * model.weight_bytes(),
    }
}

/// One copy of the weights over the network.
pub fn weight_transfer(model: &ModelSpec) -> Work {
    Work {
        flops: 0.0,
        bytes: model.weight_bytes(),
    }
}

/// Achieved rates of one GPU product under an [`Efficiency`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuRates {
    /// Product name.
    pub gpu: String,
    /// Achieved FLOP/s per GPU.
    pub flops: f64,
    /// Achieved memory bytes/s per GPU.
    pub bandwidth: f64,
    /// Ridge point of the peaks, FLOP per byte.
    pub ridge: f64,
    /// Memory per GPU, bytes.
    pub memory: f64,
    /// USD per GPU-hour.
    pub price_per_hour: f64,
}

impl GpuRates {
    /// The rates of a catalogue product.
    pub fn of(gpu: &GpuProduct, eff: &Efficiency) -> GpuRates {
        GpuRates {
            gpu: gpu.name.clone(),
            flops: gpu.peak_flops() * eff.compute,
            bandwidth: gpu.memory_bandwidth_bytes_per_s() * eff.bandwidth,
            ridge: gpu.ridge_point_flop_per_byte(),
            memory: gpu.memory_bytes(),
            price_per_hour: gpu.price_per_hour_usd,
        }
    }
}

/// One row of a profile table: a kind of work on a GPU product.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProfileRow {
    /// The work.
    pub kind: WorkKind,
    /// The GPU product.
    pub gpu: String,
    /// What the row is for, e.g. `4096 tokens` or `batch 64 at 4096 context`.
    pub shape: String,
    /// FLOP per byte of the work.
    pub intensity: f64,
    /// The GPU's ridge point.
    pub ridge: f64,
    /// Which roof limits it.
    pub bound: Bound,
    /// Seconds on one GPU at the assumed efficiency.
    pub seconds: f64,
    /// USD of GPU time for it.
    pub cost_usd: f64,
}

/// The model-based profile of the standard shapes on one GPU: prefill of `prefill_tokens`, a
/// decode iteration of `batch` at `context`, training on `train_tokens`, one weight transfer at
/// `link_bytes_per_s`.
pub fn profile_rows(
    model: &ModelSpec,
    rates: &GpuRates,
    shape: &Shapes,
    link_bytes_per_s: f64,
) -> Vec<ProfileRow> {
    let row = |kind: WorkKind, label: String, work: Work, seconds: f64| ProfileRow {
        kind,
        gpu: rates.gpu.clone(),
        shape: label,
        intensity: work.intensity(),
        ridge: rates.ridge,
        bound: if kind == WorkKind::WeightTransfer {
            Bound::Bandwidth
        } else {
            work.bound_on(rates.ridge)
        },
        seconds,
        cost_usd: seconds * rates.price_per_hour / 3600.0,
    };
    let p = prefill(model, shape.prefill_tokens, 0.0);
    let d = decode_step(model, shape.batch, shape.context);
    let t = train(model, shape.train_tokens);
    let w = weight_transfer(model);
    vec![
        row(
            WorkKind::Prefill,
            format!("{:.0} tokens", shape.prefill_tokens),
            p,
            p.seconds(rates.flops, rates.bandwidth),
        ),
        row(
            WorkKind::Decode,
            format!(
                "batch {:.0} at {:.0} context (one token each)",
                shape.batch, shape.context
            ),
            d,
            d.seconds(rates.flops, rates.bandwidth),
        ),
        row(
            WorkKind::Train,
            format!("{:.0} tokens", shape.train_tokens),
            t,
            t.seconds(rates.flops, rates.bandwidth),
        ),
        row(
            WorkKind::WeightTransfer,
            format!("{:.1} GB over the network", w.bytes / 1e9),
            w,
            w.bytes / link_bytes_per_s.max(1.0),
        ),
    ]
}

/// The shapes a profile table is computed at.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Shapes {
    /// Tokens of one prefill.
    pub prefill_tokens: f64,
    /// Sequences in one decode iteration.
    pub batch: f64,
    /// Context of each of them.
    pub context: f64,
    /// Tokens of one training pass.
    pub train_tokens: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollfleet_catalog::Catalog;

    /// Qwen3-32B's published config (the RollArt-like example's policy).
    fn qwen_32b() -> ModelSpec {
        ModelSpec {
            name: "Qwen3-32B".into(),
            parameters: 32.8e9,
            active_parameters: None,
            layers: 64,
            hidden_size: 5120,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            attention_heads: None,
            experts: None,
            experts_per_token: None,
        }
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-300)
    }

    #[test]
    fn ridge_points_of_h800_and_h20_match_their_datasheets() {
        let catalog = Catalog::builtin();
        let eff = Efficiency::default();
        let h800 = GpuRates::of(catalog.gpu("H800").unwrap(), &eff);
        let h20 = GpuRates::of(catalog.gpu("H20").unwrap(), &eff);
        // 989 TFLOP/s / 3,350 GB/s and 148 TFLOP/s / 4,000 GB/s.
        assert!(close(h800.ridge, 989e12 / 3350e9, 1e-12), "{}", h800.ridge);
        assert!(close(h20.ridge, 37.0, 1e-12), "{}", h20.ridge);
        assert!(close(h20.bandwidth, 4000e9 * 0.8, 1e-12));
    }

    #[test]
    fn a_lone_decode_token_does_one_flop_per_byte_of_weights() {
        // Batch 1 at zero context: 2 x 32.8e9 FLOPs against 2 x 32.8e9 bytes.
        let w = decode_step(&qwen_32b(), 1.0, 0.0);
        assert_eq!(w.flops, 65.6e9);
        assert_eq!(w.bytes, 65.6e9);
        assert_eq!(w.intensity(), 1.0);
    }

    #[test]
    fn decode_at_batch_64_and_4k_context_is_below_both_peak_ridges_but_costs_less_on_an_h20() {
        // KV per token: 2 x 64 layers x 8 heads x 128 x 2 bytes = 262,144 bytes.
        // FLOPs: 64 x (65.6e9 + 4 x 64 x 5120 x 4096) = 64 x 70.9687e9 = 4.541997e12.
        // Bytes: 65.6e9 + 64 x 262,144 x 4096 = 65.6e9 + 68.719e9 = 134.319e9.
        // Intensity 33.8 < 37 (H20) < 295 (H800).
        let w = decode_step(&qwen_32b(), 64.0, 4096.0);
        assert!(close(
            w.flops,
            64.0 * (65.6e9 + 4.0 * 64.0 * 5120.0 * 4096.0),
            1e-12
        ));
        assert!(close(w.bytes, 65.6e9 + 64.0 * 262_144.0 * 4096.0, 1e-12));
        assert!(close(w.intensity(), 33.815, 1e-3), "{}", w.intensity());
        assert_eq!(w.bound_on(37.0), Bound::Bandwidth);
        assert_eq!(w.bound_on(295.2), Bound::Bandwidth);
        // At achieved rates the ridges move: the H20's becomes 88.8 / 3.2 = 27.75 FLOP/byte,
        // below 33.8, so compute limits it after all: 4.541997e12 / 88.8e12 = 51.15 ms, while
        // the H800 (ridge 593.4 / 2.68 = 221) reads bytes: 134.319e9 / 2.68e12 = 50.12 ms.
        // Per dollar the H20 still wins: 51.15 ms x $1.10/h against 50.12 ms x $2.60/h.
        let catalog = Catalog::builtin();
        let eff = Efficiency::default();
        let h20 = GpuRates::of(catalog.gpu("H20").unwrap(), &eff);
        let h800 = GpuRates::of(catalog.gpu("H800").unwrap(), &eff);
        assert!(close(w.seconds(h20.flops, h20.bandwidth), 0.051_149, 1e-4));
        assert!(close(
            w.seconds(h800.flops, h800.bandwidth),
            0.050_119,
            1e-4
        ));
    }

    #[test]
    fn prefill_of_4k_tokens_is_compute_bound_and_6_7x_faster_on_an_h800() {
        // FLOPs: 4096 x 65.6e9 + 4 x 64 x 5120 x (4096 x 4097 / 2) = 268.6976e12 + 10.9978e12
        // (causal: token i attends to i positions).
        let w = prefill(&qwen_32b(), 4096.0, 0.0);
        let flops = 4096.0 * 65.6e9 + 4.0 * 64.0 * 5120.0 * (4096.0 * 4097.0 / 2.0);
        assert!(close(w.flops, flops, 1e-12));
        assert!(w.intensity() > 4000.0, "{}", w.intensity());
        assert_eq!(w.bound_on(295.2), Bound::Compute);
        // At 60% of peak: 279.69e12 / 593.4e12 = 0.4713 s on an H800, / 88.8e12 = 3.150 s on an H20.
        let catalog = Catalog::builtin();
        let eff = Efficiency::default();
        let h800 = GpuRates::of(catalog.gpu("H800").unwrap(), &eff);
        let h20 = GpuRates::of(catalog.gpu("H20").unwrap(), &eff);
        assert!(close(
            w.seconds(h800.flops, h800.bandwidth),
            flops / 593.4e12,
            1e-9
        ));
        assert!(close(
            w.seconds(h20.flops, h20.bandwidth),
            flops / 88.8e12,
            1e-9
        ));
    }

    #[test]
    fn training_costs_six_flops_per_active_parameter_per_token() {
        let moe = ModelSpec {
            active_parameters: Some(3.3e9),
            ..qwen_32b()
        };
        assert_eq!(train(&moe, 1000.0).flops, 6.0 * 3.3e9 * 1000.0);
        assert_eq!(train(&qwen_32b(), 1.0).flops, 6.0 * 32.8e9);
    }

    #[test]
    fn a_weight_transfer_moves_every_parameter_once() {
        let w = weight_transfer(&qwen_32b());
        assert_eq!(w.bytes, 65.6e9);
        // 65.6 GB over 50 GB/s at 80%: 1.64 s.
        let rates = GpuRates::of(
            Catalog::builtin().gpu("H20").unwrap(),
            &Efficiency::default(),
        );
        let shapes = Shapes {
            prefill_tokens: 4096.0,
            batch: 64.0,
            context: 4096.0,
            train_tokens: 1e6,
        };
        let rows = profile_rows(&qwen_32b(), &rates, &shapes, 50e9 * 0.8);
        let transfer = rows
            .iter()
            .find(|r| r.kind == WorkKind::WeightTransfer)
            .unwrap();
        assert!(close(transfer.seconds, 1.64, 1e-12));
        let decode = rows.iter().find(|r| r.kind == WorkKind::Decode).unwrap();
        assert_eq!(decode.bound, Bound::Bandwidth);
        let prefill = rows.iter().find(|r| r.kind == WorkKind::Prefill).unwrap();
        assert_eq!(prefill.bound, Bound::Compute);
    }
}
