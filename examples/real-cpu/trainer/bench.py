"""Timings on this machine: load, forward (logprobs) over B x T, one GRPO step, GGUF write.

    .venv/bin/python bench.py [--batch 8] [--seq 256] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax.numpy as jnp  # noqa: E402

from grpo import Batch, GRPOConfig, GRPOTrainer, TrainSpec  # noqa: E402
from model import encode, load_gguf, load_tokenizer, make_logprobs_fn, to_jax  # noqa: E402
from write_gguf import write_updated_gguf  # noqa: E402

TEXT = ("Reinforcement learning from verifiable rewards trains a language model by sampling "
        "several answers per prompt, scoring each one, and pushing up the probability of the "
        "answers that scored above their group's average while pushing down the others. ")


def timed(f, *a):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    r = f(*a)
    return r, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()
    B, T = args.batch, args.seq

    (cfg, params, reader), t_load = timed(load_gguf)
    print(f"load+dequantize: {t_load:.2f}s")
    tok = load_tokenizer(reader)
    jp = to_jax(params)
    ids = encode(tok, TEXT * 20)
    rng = np.random.default_rng(0)
    tokens = np.stack([np.roll(np.asarray(ids[: T + B * 7]), -7 * b)[:T] for b in range(B)])
    tokens = tokens.astype(np.int32)

    lp_fn = make_logprobs_fn(cfg)
    _, t_c = timed(lambda: lp_fn(jp, jnp.asarray(tokens)).block_until_ready())
    _, t_f = timed(lambda: lp_fn(jp, jnp.asarray(tokens)).block_until_ready())
    print(f"forward logprobs {B}x{T}: first (compile+run) {t_c:.2f}s, steady {t_f:.2f}s")

    tr = GRPOTrainer(cfg, params, TrainSpec(n_last_layers=args.layers), GRPOConfig(lr=1e-5))
    mask = np.zeros((B, T), np.float32)
    mask[:, args.prompt:] = 1.0
    behaviour = tr.logprobs(tokens) + rng.normal(0, 0.05, (B, T)).astype(np.float32)
    batch = Batch(tokens, mask, behaviour, rng.random(B), np.arange(B) // 2)
    r1, t_s1 = timed(tr.step, batch)
    r2, t_s2 = timed(tr.step, batch)
    print(f"GRPO step {B}x{T} (last {args.layers} layers' MLP + output_norm): "
          f"first (compile+run) {t_s1:.2f}s, steady {t_s2:.2f}s; loss {r2.loss:.4f} {r2.metrics}")

    with tempfile.TemporaryDirectory() as d:
        _, t_w = timed(write_updated_gguf, reader, os.path.join(d, "u.gguf"), tr.updated_tensors())
        size = os.path.getsize(os.path.join(d, "u.gguf"))
    print(f"GGUF write: {t_w:.2f}s ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
