//! The model's section and the one global constraint that most often goes wrong: that a
//! replica of the model fits in some GPU pool at all.

use super::*;
use crate::model::ModelSpec;

pub(super) fn check_model(spec: &JobSpec, problems: &mut Problems) {
    let model = &spec.model;
    if model.name.trim().is_empty() {
        problems.error("spec.model.name", "must not be empty");
    }
    if !model.parameters.is_finite() || model.parameters < 1.0 {
        problems.error(
            "spec.model.parameters",
            format!(
                "must be a positive parameter count, got {}",
                model.parameters
            ),
        );
    } else {
        problems.finite_at_most(
            "spec.model.parameters",
            model.parameters,
            MAX_PARAMETERS,
            "(five times the largest models announced)",
        );
    }
    if let Some(active) = model.active_parameters
        && (!active.is_finite() || active < 1.0 || active > model.parameters)
    {
        problems.error(
            "spec.model.activeParameters",
            format!(
                "must be between 1 and parameters ({}), got {active}",
                model.parameters
            ),
        );
    }
    problems.within(
        "spec.model.layers",
        model.layers,
        1,
        MAX_LAYERS,
        "(published models have up to about 130)",
    );
    problems.within(
        "spec.model.hiddenSize",
        model.hidden_size,
        1,
        MAX_HIDDEN_SIZE,
        "(published models have up to about 20,000)",
    );
    problems.within(
        "spec.model.kvHeads",
        model.kv_heads,
        1,
        MAX_ATTENTION_SIZE,
        "(published models have up to 128)",
    );
    problems.within(
        "spec.model.headDim",
        model.head_dim,
        1,
        MAX_ATTENTION_SIZE,
        "(published models have up to 512)",
    );
    if let Some(heads) = model.attention_heads {
        problems.within(
            "spec.model.attentionHeads",
            heads,
            1,
            MAX_ATTENTION_SIZE,
            "(published models have up to 128)",
        );
    }
    check_experts(model, problems);
    if ![1, 2, 4].contains(&model.dtype_bytes) {
        problems.error(
            "spec.model.dtypeBytes",
            format!("must be 1, 2 or 4, got {}", model.dtype_bytes),
        );
    }
}

/// A mixture of experts: `experts` and `expertsPerToken` together, `experts >= expertsPerToken
/// >= 1`, and fewer active parameters than total when some experts go unused per token.
fn check_experts(model: &ModelSpec, problems: &mut Problems) {
    match (model.experts, model.experts_per_token) {
        (None, None) => {}
        (Some(_), None) => problems.error(
            "spec.model.expertsPerToken",
            "must be given with experts (the routed experts each token uses)",
        ),
        (None, Some(_)) => problems.error(
            "spec.model.experts",
            "must be given with expertsPerToken (the routed experts per MoE layer)",
        ),
        (Some(experts), Some(k)) => {
            problems.within(
                "spec.model.experts",
                experts,
                1,
                MAX_EXPERTS,
                "(published models have up to 384)",
            );
            if k < 1 || k > experts {
                problems.error(
                    "spec.model.expertsPerToken",
                    format!("must be between 1 and experts ({experts}), got {k}"),
                );
            } else if k < experts && model.active() >= model.parameters {
                problems.error(
                    "spec.model.activeParameters",
                    format!(
                        "must be below parameters ({}) for a mixture of experts using {k} of \
                         {experts} experts per token",
                        model.parameters
                    ),
                );
            }
        }
    }
}

/// Bytes one serving replica needs: the weights plus the KV cache of one full context, the least
/// that lets it make progress on the longest trajectory.
pub fn replica_bytes(spec: &JobSpec) -> (f64, f64) {
    let longest_context = spec
        .tasks
        .iter()
        .map(|t| t.context_limit)
        .max()
        .unwrap_or(0);
    let kv = spec.model.kv_bytes_per_token() * longest_context as f64;
    (spec.model.weight_bytes(), kv)
}

pub(super) fn check_model_fits(spec: &JobSpec, catalog: &Catalog, problems: &mut Problems) {
    let (weights, kv) = replica_bytes(spec);
    let needed = weights + kv;
    let mut shortfalls = Vec::new();
    let mut any_fits = false;
    for (i, pool) in spec.pools.iter().enumerate() {
        let (Some(gpu_name), Some(count)) = (&pool.gpu, pool.count) else {
            continue;
        };
        let Ok(gpu) = catalog.gpu(gpu_name) else {
            continue;
        };
        // A replica may span at most one node (tensor parallelism across nodes is too slow
        // for decode), and at most the pool.
        let gpus = count.min(pool.gpus_per_node());
        let usable = gpus as f64 * gpu.memory_bytes() * USABLE_MEMORY_FRACTION;
        if usable >= needed {
            any_fits = true;
        } else {
            shortfalls.push(format!(
                "\"{}\" ({gpus} x {} = {:.1} GB usable) is {:.1} GB short",
                pool.name,
                gpu.name,
                usable / 1e9,
                (needed - usable) / 1e9
            ));
            let pinned_to_model_work = pool.roles.iter().any(|r| r.is_gpu_role());
            let message = format!(
                "one replica needs {:.1} GB, but {gpus} x {} hold {:.1} GB usable",
                needed / 1e9,
                gpu.name,
                usable / 1e9
            );
            if pinned_to_model_work {
                problems.error(format!("spec.pools[{i}].roles"), message);
            } else {
                problems.warn(format!("spec.pools[{i}]"), message);
            }
        }
    }
    if !any_fits {
        problems.error(
            "spec.model",
            format!(
                "one replica needs {:.1} GB (weights {:.1} GB + KV cache of one {}-token context \
                 {:.1} GB), and no GPU pool can hold it within one node: {}",
                needed / 1e9,
                weights / 1e9,
                spec.tasks
                    .iter()
                    .map(|t| t.context_limit)
                    .max()
                    .unwrap_or(0),
                kv / 1e9,
                shortfalls.join("; ")
            ),
        );
    }
}
