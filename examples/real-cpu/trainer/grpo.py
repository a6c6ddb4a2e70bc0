"""GRPO update for the JAX Llama model in ``model.py``.

Batch layout (all arrays aligned with ``tokens``; right padding only):

* ``tokens``        int   [B, T]  prompt/observation tokens followed by sampled action tokens
* ``loss_mask``     float [B, T]  1.0 where ``tokens[b, t]`` is a sampled action token
                                  (``loss_mask[:, 0]`` is ignored: nothing predicts token 0)
* ``behaviour_lp``  float [B, T]  log p_behaviour(tokens[b, t] | tokens[b, :t]) from the
                                  inference engine at action positions (anything elsewhere)
* ``rewards``       float [B]     one scalar reward per trajectory
* ``group_ids``     int   [B]     trajectories sharing a prompt share a group id

Objective (PPO-clip on group-normalised advantages, token-level mean as in DAPO):

    A_b   = (r_b - mean_{g(b)} r) / (std_{g(b)} r + 1e-6)      (population std; A=0 for
                                                                 singleton/constant groups)
    rho   = exp(logp_theta - behaviour_lp)
    L     = - sum_{b,t} mask * min(rho A_b, clip(rho, 1-eps, 1+eps) A_b) / sum mask

No KL-to-reference term (beta = 0), as in DAPO / Dr.GRPO.

Only a part of the weights is trained (see :class:`TrainSpec`): by default the SiLU MLP
(gate/up/down) of the last 2 transformer layers plus the final RMSNorm.  The first
``L - N`` layers run as a frozen prefix, so backprop only touches the last N layers and
the (tied, frozen) output head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp

from model import (KEY_TO_SUFFIX, ModelConfig, Params, final_logits, run_layers,
                   token_logprobs_from_logits)


@dataclass(frozen=True)
class TrainSpec:
    n_last_layers: int = 2
    layer_keys: tuple[str, ...] = ("w_gate", "w_up", "w_down")
    train_output_norm: bool = True


@dataclass(frozen=True)
class GRPOConfig:
    lr: float = 1e-4
    clip_eps: float = 0.2
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # global-norm clipping; <= 0 disables


@dataclass
class Batch:
    tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_lp: np.ndarray
    rewards: np.ndarray
    group_ids: np.ndarray


@dataclass
class StepResult:
    loss: float
    current_lp: np.ndarray      # [B, T] current-policy logprobs (before the update), 0 at t=0
    advantages: np.ndarray      # [B]
    metrics: dict[str, float] = field(default_factory=dict)


def group_advantages(rewards: np.ndarray, group_ids: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    adv = np.zeros_like(rewards)
    for g in np.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        if r.size < 2:
            continue
        adv[idx] = (r - r.mean()) / (r.std() + eps)
    return adv.astype(np.float32)


def clipped_pg_loss(cur_lp: jax.Array, behaviour_lp: jax.Array, mask: jax.Array,
                    adv: jax.Array, clip_eps: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """All of cur_lp/behaviour_lp/mask are [B, T-1] (targets tokens[:, 1:]); adv is [B]."""
    log_ratio = (cur_lp - behaviour_lp) * mask
    ratio = jnp.exp(log_ratio)
    a = adv[:, None]
    unclipped = ratio * a
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * a
    obj = jnp.minimum(unclipped, clipped)
    n = jnp.maximum(mask.sum(), 1.0)
    loss = -(obj * mask).sum() / n
    clip_frac = ((jnp.abs(ratio - 1.0) > clip_eps) * mask).sum() / n
    approx_kl = ((ratio - 1.0 - log_ratio) * mask).sum() / n  # k3 estimator of KL(behav||cur)
    return loss, {"clip_frac": clip_frac, "approx_kl": approx_kl,
                  "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0))}


def split_params(cfg: ModelConfig, params: Params, spec: TrainSpec) -> tuple[Params, Params]:
    """-> (trainable, frozen). Arrays are jnp."""
    k = cfg.n_layers - spec.n_last_layers
    if not 0 <= k < cfg.n_layers:
        raise ValueError("n_last_layers must be in [1, n_layers]")
    layers = params["layers"]
    trainable: Params = {"layers": {key: jnp.asarray(layers[key][k:]) for key in spec.layer_keys}}
    if spec.train_output_norm:
        trainable["output_norm"] = jnp.asarray(params["output_norm"])
    frozen: Params = {
        "tok_embd": jnp.asarray(params["tok_embd"]),
        "prefix_layers": {key: jnp.asarray(v[:k]) for key, v in layers.items()},
        "suffix_layers": {key: jnp.asarray(v[k:]) for key, v in layers.items()
                          if key not in spec.layer_keys},
    }
    if not spec.train_output_norm:
        frozen["output_norm"] = jnp.asarray(params["output_norm"])
    if "output" in params:
        frozen["output"] = jnp.asarray(params["output"])
    return trainable, frozen


def policy_logprobs(cfg: ModelConfig, trainable: Params, frozen: Params,
                    tokens: jax.Array) -> jax.Array:
    """[B, T-1] logprobs of tokens[:, 1:] under the split parameters."""
    x = frozen["tok_embd"][tokens]
    if frozen["prefix_layers"]["wq"].shape[0] > 0:
        x = run_layers(cfg, x, frozen["prefix_layers"])
    x = run_layers(cfg, x, {**frozen["suffix_layers"], **trainable["layers"]})
    head: Params = {"tok_embd": frozen["tok_embd"],
                    "output_norm": trainable.get("output_norm", frozen.get("output_norm"))}
    if "output" in frozen:
        head["output"] = frozen["output"]
    logits = final_logits(cfg, head, x)
    return token_logprobs_from_logits(logits, tokens)


def _adam_update(p: Params, g: Params, m: Params, v: Params, step: jax.Array,
                 gc: GRPOConfig) -> tuple[Params, Params, Params]:
    m = jax.tree_util.tree_map(lambda m_, g_: gc.beta1 * m_ + (1 - gc.beta1) * g_, m, g)
    v = jax.tree_util.tree_map(lambda v_, g_: gc.beta2 * v_ + (1 - gc.beta2) * g_ * g_, v, g)
    bc1 = 1 - gc.beta1 ** step
    bc2 = 1 - gc.beta2 ** step
    p = jax.tree_util.tree_map(
        lambda p_, m_, v_: p_ - gc.lr * (m_ / bc1) / (jnp.sqrt(v_ / bc2) + gc.adam_eps), p, m, v)
    return p, m, v


def make_step_fn(cfg: ModelConfig, gc: GRPOConfig) -> Callable[..., Any]:
    def loss_fn(trainable: Params, frozen: Params, tokens: jax.Array, mask: jax.Array,
                blp: jax.Array, adv: jax.Array) -> tuple[jax.Array, tuple[jax.Array, dict]]:
        cur = policy_logprobs(cfg, trainable, frozen, tokens)
        loss, metrics = clipped_pg_loss(cur, blp, mask, adv, gc.clip_eps)
        return loss, (cur, metrics)

    @jax.jit
    def step(trainable: Params, frozen: Params, m: Params, v: Params, t: jax.Array,
             tokens: jax.Array, mask: jax.Array, blp: jax.Array, adv: jax.Array):
        (loss, (cur, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, tokens, mask, blp, adv)
        gnorm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(grads)))
        if gc.max_grad_norm > 0:
            scale = jnp.minimum(1.0, gc.max_grad_norm / (gnorm + 1e-12))
            grads = jax.tree_util.tree_map(lambda x: x * scale, grads)
        new_p, m, v = _adam_update(trainable, grads, m, v, t, gc)
        metrics = {**metrics, "grad_norm": gnorm}
        return new_p, m, v, loss, cur, metrics

    return step


class GRPOTrainer:
    """Holds the split parameters and Adam state; one :meth:`step` = one optimizer step."""

    def __init__(self, cfg: ModelConfig, params: Params, spec: TrainSpec = TrainSpec(),
                 gc: GRPOConfig = GRPOConfig()) -> None:
        self.cfg, self.spec, self.gc = cfg, spec, gc
        self.trainable, self.frozen = split_params(cfg, params, spec)
        zeros = lambda p: jax.tree_util.tree_map(jnp.zeros_like, p)  # noqa: E731
        self.m, self.v = zeros(self.trainable), zeros(self.trainable)
        self.t = 0
        self._step = make_step_fn(cfg, gc)
        self._lp = jax.jit(lambda tr, fr, tok: policy_logprobs(cfg, tr, fr, tok))

    def logprobs(self, tokens: np.ndarray) -> np.ndarray:
        """Current-policy logprobs aligned with tokens: [B, T], column 0 = 0."""
        lp = np.asarray(self._lp(self.trainable, self.frozen, jnp.asarray(tokens, jnp.int32)))
        return np.concatenate([np.zeros((lp.shape[0], 1), np.float32), lp], axis=1)

    def step(self, batch: Batch) -> StepResult:
        adv = group_advantages(batch.rewards, batch.group_ids)
        tokens = jnp.asarray(batch.tokens, jnp.int32)
        mask = jnp.asarray(np.asarray(batch.loss_mask, np.float32)[:, 1:])
        blp = jnp.asarray(np.asarray(batch.behaviour_lp, np.float32)[:, 1:])
        self.t += 1
        self.trainable, self.m, self.v, loss, cur, metrics = self._step(
            self.trainable, self.frozen, self.m, self.v, jnp.float32(self.t),
            tokens, mask, blp, jnp.asarray(adv))
        cur_np = np.asarray(cur)
        cur_full = np.concatenate([np.zeros((cur_np.shape[0], 1), np.float32), cur_np], axis=1)
        return StepResult(loss=float(loss), current_lp=cur_full, advantages=adv,
                          metrics={k: float(v) for k, v in metrics.items()})

    def updated_tensors(self) -> dict[str, np.ndarray]:
        """GGUF tensor name -> float32 array (numpy (out, in) layout) for every trained tensor."""
        out: dict[str, np.ndarray] = {}
        k = self.cfg.n_layers - self.spec.n_last_layers
        for key, stacked in self.trainable["layers"].items():
            arr = np.asarray(stacked)
            for j in range(arr.shape[0]):
                out[f"blk.{k + j}.{KEY_TO_SUFFIX[key]}"] = arr[j]
        if "output_norm" in self.trainable:
            out["output_norm.weight"] = np.asarray(self.trainable["output_norm"])
        return out
