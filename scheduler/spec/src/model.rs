//! The policy model's shape, and the cost figures that follow from it.
//!
//! These are the numbers every cost model in rollfleet starts from: how many FLOPs one token
//! costs forward and in training, how many bytes of KV cache it leaves behind, and how many
//! bytes of weights a replica holds and a weight sync moves.

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

    /// Forward FLOPs per token for the dense (matrix-multiply) part: 2 per active parameter.
    pub fn forward_flops_per_token(&self) -> f64 {
        2.0 * self.active()
    }

    /// Forward FLOPs per token for attention over `context` earlier tokens:
    /// QK^T and AV, each 2 x hidden x context per layer.
    pub fn attention_flops_per_token(&self, context: f64) -> f64 {
        4.0 * self.layers as f64 * self.hidden_size as f64 * context
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
        }
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
