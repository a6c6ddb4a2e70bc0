//! The policy model's shape, and the cost figures that follow from it.
//!
//! These are the numbers every cost model in rollfleet starts from: how many FLOPs one token
//! costs forward and in training, how many bytes of KV cache it leaves behind, and how many
//! bytes of weights a replica holds and a weight sync moves.
//!
//! Mixture-of-experts models split their parameters into a shared part (attention, embeddings,
//! dense and shared-expert layers), read for every token, and `experts` routed experts, of which
//! each token uses `expertsPerToken`. With `N` total and `N_a` active parameters, `E` experts
//! and top-`k` routing, one routed expert's parameters (summed over the MoE layers) are
//! `e = (N - N_a) / (E - k)` and the shared ones `N_a - k e` (so `N = shared + E e` and
//! `N_a = shared + k e`). A forward pass over `B` tokens reads the shared weights once and, per
//! MoE layer, the experts at least one of its tokens routes to: `E (1 - (1 - k/E)^B)` of them in
//! expectation when tokens route uniformly and independently (an assumption: trained routers
//! are load-balanced towards uniform by their auxiliary loss, e.g. Fedus et al., "Switch
//! Transformers", JMLR 2022, section 2.2). [`WeightReads`] is that formula, and both the
//! simulated replicas (`rollfleet-fleet`) and the planner's prediction call it.

use serde::{Deserialize, Serialize};

/// The policy model, as the job spec describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSpec {
    /// A label, e.g. `Qwen3-32B`.
    pub name: String,
    /// Total parameters (all experts of a mixture-of-experts model).
    pub parameters: f64,
    /// Parameters active per token; equal to `parameters` for a dense model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_parameters: Option<f64>,
    /// Transformer layers.
    pub layers: i64,
    /// Hidden (model) dimension.
    pub hidden_size: i64,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: i64,
    /// Dimension of one attention head.
    pub head_dim: i64,
    /// Bytes per weight and per KV-cache element (2 for BF16).
    #[serde(default = "two")]
    pub dtype_bytes: i64,
    /// Query attention heads. Attention FLOPs scale with `attentionHeads x headDim`; absent,
    /// `hiddenSize` is used (equal for most dense models, not for e.g. Qwen3-30B-A3B, whose 32
    /// heads of 128 are twice its hidden size of 2048).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_heads: Option<i64>,
    /// Routed experts per mixture-of-experts layer (e.g. 128 for Qwen3-30B-A3B, 256 for
    /// DeepSeek-V3); absent for a dense model. Shared experts count as shared parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<i64>,
    /// Routed experts each token uses (top-k; 8 for Qwen3-30B-A3B and DeepSeek-V3). Present
    /// exactly when `experts` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_per_token: Option<i64>,
}

/// The weight bytes a forward pass reads, as a function of the tokens it processes together:
/// the shared weights once, plus the expected union of the routed experts its tokens use (see
/// the module doc). A dense model reads all its (active) weights whatever the batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WeightReads {
    /// Bytes every forward pass reads (all the weights of a dense model).
    pub shared_bytes: f64,
    /// Bytes of one routed expert, summed over the MoE layers (0 for a dense model).
    pub expert_bytes: f64,
    /// Routed experts per MoE layer (0 for a dense model).
    pub experts: f64,
    /// Routed experts per token (0 for a dense model).
    pub experts_per_token: f64,
}

impl WeightReads {
    /// A dense model of `bytes` of weights: every pass reads them all.
    pub fn dense(bytes: f64) -> WeightReads {
        WeightReads {
            shared_bytes: bytes,
            expert_bytes: 0.0,
            experts: 0.0,
            experts_per_token: 0.0,
        }
    }

    /// Expected routed experts per MoE layer that a pass over `tokens` tokens touches:
    /// `E (1 - (1 - k/E)^B)` under uniform independent routing; a pass has at least one token.
    pub fn experts_touched(&self, tokens: f64) -> f64 {
        if self.experts <= 0.0 || self.experts_per_token <= 0.0 {
            return 0.0;
        }
        let b = tokens.max(1.0);
        let miss = (1.0 - self.experts_per_token / self.experts).clamp(0.0, 1.0);
        self.experts * (1.0 - miss.powf(b))
    }

    /// Expected weight bytes a pass over `tokens` tokens reads (decode: one token per running
    /// sequence; prefill: every token of the batch).
    pub fn bytes(&self, tokens: f64) -> f64 {
        self.shared_bytes + self.expert_bytes * self.experts_touched(tokens)
    }

    /// Bytes a single token's pass reads: the active weights.
    pub fn single_token_bytes(&self) -> f64 {
        self.bytes(1.0)
    }
}

/// Attention FLOPs of a causal pass over `tokens` new tokens after `cached` ones, given the
/// FLOPs per token of context (`ModelSpec::attention_flops_per_token(1.0)`): token `i` (from 1)
/// attends to `cached + i` positions, so the sum is `tokens x cached + tokens (tokens + 1) / 2`.
pub fn causal_attention_flops(per_context: f64, cached: f64, tokens: f64) -> f64 {
    per_context * (tokens * cached + tokens * (tokens + 1.0) / 2.0)
}

/// Attention FLOPs of training on a sequence of `tokens` (forward and backward): three times the
/// forward pass's causal attention (the backward pass computes two products for each forward
/// one, as for the dense layers' `6 N = 3 x 2 N`; Korthikanti et al., "Reducing Activation
/// Recomputation in Large Transformer Models", MLSys 2023, model FLOPs `72 B s l h^2 (1 + s / 6h)`,
/// i.e. the same factor of three on the `s^2` attention term).
pub fn train_attention_flops(per_context: f64, tokens: f64) -> f64 {
    3.0 * causal_attention_flops(per_context, 0.0, tokens)
}

fn two() -> i64 {
    2
}

impl ModelSpec {
    /// Parameters used per token.
    pub fn active(&self) -> f64 {
        self.active_parameters.unwrap_or(self.parameters)
    }

    /// Bytes of weights in one full copy of the model.
    pub fn weight_bytes(&self) -> f64 {
        self.parameters * self.dtype_bytes as f64
    }

    /// Bytes of weights read to produce one token (active parameters only).
    pub fn active_weight_bytes(&self) -> f64 {
        self.active() * self.dtype_bytes as f64
    }

    /// `(experts, experts per token)` of a mixture-of-experts model whose fields make sense
    /// (both present, `experts > expertsPerToken >= 1`, active below total); `None` otherwise,
    /// which costs it as a dense model of its active parameters.
    pub fn routing(&self) -> Option<(f64, f64)> {
        let (e, k) = (self.experts?, self.experts_per_token?);
        (k >= 1 && e > k && self.active() < self.parameters).then_some((e as f64, k as f64))
    }

    /// Parameters of one routed expert summed over the MoE layers: `(N - N_a) / (E - k)`
    /// (0 for a dense model).
    pub fn expert_parameters(&self) -> f64 {
        self.routing()
            .map_or(0.0, |(e, k)| (self.parameters - self.active()) / (e - k))
    }

    /// Parameters every token uses: attention, embeddings, dense and shared-expert layers
    /// (`N_a - k e`; all active parameters of a dense model).
    pub fn shared_parameters(&self) -> f64 {
        let k = self.routing().map_or(0.0, |(_, k)| k);
        self.active() - k * self.expert_parameters()
    }

    /// The weight bytes a forward pass reads as a function of its tokens ([`WeightReads`]).
    pub fn weight_reads(&self) -> WeightReads {
        let dtype = self.dtype_bytes as f64;
        match self.routing() {
            Some((e, k)) => WeightReads {
                shared_bytes: self.shared_parameters() * dtype,
                expert_bytes: self.expert_parameters() * dtype,
                experts: e,
                experts_per_token: k,
            },
            None => WeightReads::dense(self.active_weight_bytes()),
        }
    }

    /// Width of the attention products: query heads x head dimension, or the hidden size when
    /// the heads are not given.
    pub fn attention_width(&self) -> f64 {
        match self.attention_heads {
            Some(h) if h > 0 => h as f64 * self.head_dim as f64,
            _ => self.hidden_size as f64,
        }
    }

    /// Forward FLOPs per token for the dense (matrix-multiply) part: 2 per active parameter.
    pub fn forward_flops_per_token(&self) -> f64 {
        2.0 * self.active()
    }

    /// Forward FLOPs per token for attention over `context` earlier tokens: QK^T and AV, each
    /// `2 x heads x headDim x context` per layer (Kaplan et al., "Scaling Laws for Neural
    /// Language Models", 2020, table 1: `2 n_layer n_ctx d_attn` per product), with
    /// [`ModelSpec::attention_width`] as `heads x headDim`.
    pub fn attention_flops_per_token(&self, context: f64) -> f64 {
        4.0 * self.layers as f64 * self.attention_width() * context
    }

    /// Training FLOPs per token (forward and backward): 6 per active parameter.
    pub fn train_flops_per_token(&self) -> f64 {
        6.0 * self.active()
    }

    /// KV-cache bytes one token leaves behind: K and V, per layer, per KV head.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * self.layers as f64
            * self.kv_heads as f64
            * self.head_dim as f64
            * self.dtype_bytes as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-7B-Instruct's published config: 28 layers, hidden 3584, 4 KV heads of 128.
    fn qwen_7b() -> ModelSpec {
        ModelSpec {
            name: "Qwen2.5-7B".into(),
            parameters: 7.61e9,
            active_parameters: None,
            layers: 28,
            hidden_size: 3584,
            kv_heads: 4,
            head_dim: 128,
            dtype_bytes: 2,
            attention_heads: None,
            experts: None,
            experts_per_token: None,
        }
    }

    /// Qwen3-30B-A3B's published config (huggingface.co/Qwen/Qwen3-30B-A3B, config.json): 48
    /// layers, hidden 2048, 32 query heads and 4 KV heads of 128, 128 experts, 8 per token;
    /// 30.5B parameters, 3.3B active (its model card).
    fn qwen3_30b_a3b() -> ModelSpec {
        ModelSpec {
            name: "Qwen3-30B-A3B".into(),
            parameters: 30.5e9,
            active_parameters: Some(3.3e9),
            layers: 48,
            hidden_size: 2048,
            kv_heads: 4,
            head_dim: 128,
            dtype_bytes: 2,
            attention_heads: Some(32),
            experts: Some(128),
            experts_per_token: Some(8),
        }
    }

    #[test]
    fn moe_parameters_split_into_shared_and_experts_that_add_up_to_total_and_active() {
        let m = qwen3_30b_a3b();
        let e = m.expert_parameters();
        let shared = m.shared_parameters();
        assert!((shared + 128.0 * e - 30.5e9).abs() < 1.0, "{shared} {e}");
        assert!((shared + 8.0 * e - 3.3e9).abs() < 1.0, "{shared} {e}");
        assert!(shared > 0.0 && e > 0.0);
    }

    #[test]
    fn a_decode_batch_of_moe_tokens_reads_the_union_of_their_experts() {
        let m = qwen3_30b_a3b();
        let reads = m.weight_reads();
        // One token reads exactly the active weights.
        assert!((reads.bytes(1.0) - m.active_weight_bytes()).abs() < 1.0);
        // Two tokens: 128 (1 - (120/128)^2) = 15.5 experts, not 16 (they overlap).
        let two = 128.0 * (1.0 - (120.0_f64 / 128.0).powi(2));
        assert!((reads.experts_touched(2.0) - two).abs() < 1e-9);
        assert!((two - 15.5).abs() < 1e-9);
        // Growing batches read more, never more than every weight.
        let mut last = 0.0;
        for b in [1.0, 4.0, 16.0, 64.0, 256.0] {
            let bytes = reads.bytes(b);
            assert!(bytes > last && bytes <= m.weight_bytes() + 1.0);
            last = bytes;
        }
        // A prefill batch of thousands of tokens reads all of them.
        assert!((reads.bytes(16_384.0) - m.weight_bytes()).abs() < 1e3);
    }

    #[test]
    fn a_dense_model_reads_its_weights_whatever_the_batch() {
        let reads = qwen_7b().weight_reads();
        assert_eq!(reads.bytes(1.0), reads.bytes(512.0));
        assert_eq!(reads.bytes(1.0), qwen_7b().active_weight_bytes());
    }

    #[test]
    fn attention_flops_follow_query_heads_when_given_and_the_hidden_size_otherwise() {
        // Qwen2.5-7B: 28 heads x 128 = 3584 = hidden: the same either way.
        let dense = qwen_7b();
        let with_heads = ModelSpec {
            attention_heads: Some(28),
            ..qwen_7b()
        };
        assert_eq!(
            dense.attention_flops_per_token(100.0),
            with_heads.attention_flops_per_token(100.0)
        );
        // Qwen3-30B-A3B: 32 x 128 = 4096, twice its hidden size of 2048.
        let moe = qwen3_30b_a3b();
        assert_eq!(moe.attention_flops_per_token(1.0), 4.0 * 48.0 * 4096.0);
    }

    #[test]
    fn causal_attention_sums_every_position_of_a_prefill() {
        // Three new tokens after two cached ones attend to 3, 4 and 5 positions.
        assert_eq!(causal_attention_flops(10.0, 2.0, 3.0), 10.0 * 12.0);
        // Training triples the forward sum over the whole sequence: 1 + 2 + 3 + 4 = 10.
        assert_eq!(train_attention_flops(10.0, 4.0), 300.0);
    }

    #[test]
    fn kv_bytes_per_token_match_a_hand_computation() {
        // 2 (K,V) x 28 layers x 4 heads x 128 dims x 2 bytes = 57,344 bytes = 56 KiB.
        assert_eq!(qwen_7b().kv_bytes_per_token(), 57_344.0);
    }

    #[test]
    fn dense_model_uses_all_parameters_per_token() {
        let model = qwen_7b();
        assert_eq!(model.forward_flops_per_token(), 2.0 * 7.61e9);
        assert_eq!(model.train_flops_per_token(), 6.0 * 7.61e9);
        assert_eq!(model.weight_bytes(), 15.22e9);
    }

    #[test]
    fn mixture_of_experts_costs_active_parameters_but_stores_all() {
        let moe = ModelSpec {
            parameters: 30.5e9,
            active_parameters: Some(3.3e9),
            ..qwen_7b()
        };
        assert_eq!(moe.forward_flops_per_token(), 6.6e9);
        assert_eq!(moe.weight_bytes(), 61.0e9);
        assert_eq!(moe.active_weight_bytes(), 6.6e9);
    }
}
