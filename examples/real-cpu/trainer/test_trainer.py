"""pytest for the CPU GRPO trainer core on the real SmolLM2-135M-Instruct GGUF.

Run:  cd examples/real-cpu/trainer && .venv/bin/python -m pytest -q -s test_trainer.py
(-s shows the per-step timings).  The llama.cpp agreement test runs only when an
interpreter with llama_cpp is found ($LLAMA_PYTHON, ../.venv, or .venv-llama).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gguf  # noqa: E402

from grpo import (Batch, GRPOConfig, GRPOTrainer, TrainSpec, clipped_pg_loss,  # noqa: E402
                  group_advantages)
from model import (decode, encode, find_smollm2_gguf, greedy_generate, load_gguf,  # noqa: E402
                   load_tokenizer, make_logprobs_fn, to_jax)
from write_gguf import write_updated_gguf  # noqa: E402

SENTENCE = ("The quick brown fox jumps over the lazy dog. It was a sunny day in the park, "
            "and the children were playing football on the grass.")


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    cfg, params, reader = load_gguf()
    print(f"\n[timing] load+dequantize GGUF: {time.perf_counter() - t0:.2f}s")
    return cfg, params, to_jax(params), reader, load_tokenizer(reader)


def _llama_python() -> str | None:
    cands = [os.environ.get("LLAMA_PYTHON"), os.path.join(HERE, "..", ".venv", "bin", "python"),
             os.path.join(HERE, "..", "engine", ".venv", "bin", "python"),
             os.path.join(HERE, ".venv-llama", "bin", "python")]
    for c in cands:
        if c and os.path.exists(c):
            ok = subprocess.run([c, "-c", "import llama_cpp"], capture_output=True).returncode == 0
            if ok:
                return c
    return None


def _toy_batch(cfg, tok):  # type: ignore[no-untyped-def]
    prompt = encode(tok, "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
    good = encode(tok, "Blue is a lovely colour.")
    bad = encode(tok, "I refuse to answer that.")
    T = len(prompt) + max(len(good), len(bad))
    tokens = np.full((2, T), cfg.eos_id, np.int32)
    mask = np.zeros((2, T), np.float32)
    for i, a in enumerate((good, bad)):
        s = prompt + a
        tokens[i, : len(s)] = s
        mask[i, len(prompt): len(s)] = 1.0
    return tokens, mask


# ----------------------------------------------------------------------------- model


def test_model_facts(loaded) -> None:  # type: ignore[no-untyped-def]
    cfg, params, _, reader, _ = loaded
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
    assert (cfg.ffn, cfg.vocab, cfg.rope_theta) == (1536, 49152, 100000.0)
    assert cfg.tied_embeddings and "output" not in params
    types = {t.tensor_type.name for t in reader.tensors}
    assert types <= {"Q4_1", "Q8_0", "F32"}
    for leaf in jax.tree_util.tree_leaves(params):
        assert leaf.dtype == np.float32 and np.isfinite(leaf).all()


def test_greedy_text_is_sensible(loaded) -> None:  # type: ignore[no-untyped-def]
    cfg, _, jp, _, tok = loaded
    t0 = time.perf_counter()
    out = decode(tok, greedy_generate(cfg, jp, encode(tok, "The capital of France is"), 8))
    print(f"[timing] greedy 8 tokens (incl. compile): {time.perf_counter() - t0:.2f}s -> {out!r}")
    assert "Paris" in out


def test_logprobs_finite_perplexity_and_padding(loaded) -> None:  # type: ignore[no-untyped-def]
    cfg, _, jp, _, tok = loaded
    lp_fn = make_logprobs_fn(cfg)
    ids = encode(tok, SENTENCE)
    short = encode(tok, "Hello world, how are you?")
    batch = np.full((2, len(ids)), cfg.eos_id, np.int32)
    batch[0] = ids
    batch[1, : len(short)] = short
    t0 = time.perf_counter()
    lp = np.asarray(lp_fn(jp, jnp.asarray(batch)))
    print(f"[timing] logprobs 2x{len(ids)} (incl. compile): {time.perf_counter() - t0:.2f}s")
    assert lp.shape == (2, len(ids) - 1) and np.isfinite(lp).all() and (lp <= 0).all()
    ppl = float(np.exp(-lp[0].mean()))
    print(f"perplexity of plain sentence: {ppl:.2f}")
    assert 2.0 < ppl < 60.0
    # right padding must not change the real tokens' logprobs (causal attention)
    alone = np.asarray(make_logprobs_fn(cfg)(jp, jnp.asarray([short], jnp.int32)))[0]
    np.testing.assert_allclose(lp[1, : len(short) - 1], alone, atol=2e-4)


# ----------------------------------------------------------------------------- GRPO


def test_group_advantages() -> None:
    adv = group_advantages(np.array([1.0, 0.0, 3.0, 3.0, 5.0]), np.array([0, 0, 1, 1, 2]))
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0, 0.0], atol=1e-5)


def test_clip_blocks_gradient_outside_trust_region() -> None:
    blp = jnp.zeros((1, 3))
    mask = jnp.ones((1, 3))

    def f(cur: jax.Array, a: float) -> jax.Array:
        return clipped_pg_loss(cur, blp, mask, jnp.array([a]), 0.2)[0]

    cur = jnp.log(jnp.array([[1.5, 1.1, 0.5]]))  # ratios 1.5 (clipped), 1.1, 0.5
    g_pos = np.asarray(jax.grad(f)(cur, 1.0))[0]
    assert g_pos[0] == 0.0 and g_pos[1] < 0 and g_pos[2] < 0  # A>0: ratio>1.2 gets no push
    g_neg = np.asarray(jax.grad(f)(cur, -1.0))[0]
    assert g_neg[0] > 0 and g_neg[1] > 0 and g_neg[2] == 0.0  # A<0: ratio<0.8 gets no push


def test_grpo_step_moves_logprobs_the_right_way(loaded) -> None:  # type: ignore[no-untyped-def]
    cfg, params, _, _, tok = loaded
    tokens, mask = _toy_batch(cfg, tok)
    tr = GRPOTrainer(cfg, params, TrainSpec(n_last_layers=2), GRPOConfig(lr=1e-4))
    behaviour = tr.logprobs(tokens)  # on-policy: behaviour == current policy
    batch = Batch(tokens, mask, behaviour, np.array([1.0, 0.0]), np.array([7, 7]))
    t0 = time.perf_counter()
    res = tr.step(batch)
    print(f"[timing] GRPO step 2x{tokens.shape[1]} (incl. compile): {time.perf_counter() - t0:.2f}s "
          f"metrics={res.metrics}")
    # recomputed current-policy logprobs equal the behaviour ones (same weights)
    assert np.abs((res.current_lp - behaviour) * mask).max() < 1e-4
    np.testing.assert_allclose(res.advantages, [1.0, -1.0], atol=1e-5)
    after = tr.logprobs(tokens)
    mean = lambda lp, i: float((lp[i] * mask[i]).sum() / mask[i].sum())  # noqa: E731
    d_good = mean(after, 0) - mean(behaviour, 0)
    d_bad = mean(after, 1) - mean(behaviour, 1)
    print(f"mean action logprob change: high-reward {d_good:+.4f}, low-reward {d_bad:+.4f}")
    assert d_good > 1e-3 and d_bad < -1e-3
    # untouched tensors really are untouched; trained ones moved
    upd = tr.updated_tensors()
    assert set(upd) == {f"blk.{i}.ffn_{n}.weight" for i in (28, 29) for n in ("gate", "up", "down")} | {"output_norm.weight"}
    assert not np.array_equal(upd["blk.29.ffn_down.weight"], params["layers"]["w_down"][29])
    # second step (compiled) timing, now off-policy w.r.t. the stale behaviour logprobs
    t0 = time.perf_counter()
    res2 = tr.step(batch)
    print(f"[timing] GRPO step 2x{tokens.shape[1]} (compiled): {time.perf_counter() - t0:.2f}s "
          f"clip_frac={res2.metrics['clip_frac']:.2f}")
    assert np.isfinite(res2.loss)


# ----------------------------------------------------------------------------- GGUF write


@pytest.fixture(scope="module")
def trained(loaded, tmp_path_factory):  # type: ignore[no-untyped-def]
    cfg, params, _, reader, tok = loaded
    tokens, mask = _toy_batch(cfg, tok)
    tr = GRPOTrainer(cfg, params, TrainSpec(n_last_layers=2), GRPOConfig(lr=1e-4))
    tr.step(Batch(tokens, mask, tr.logprobs(tokens), np.array([1.0, 0.0]), np.array([0, 0])))
    out = str(tmp_path_factory.mktemp("gguf") / "updated.gguf")
    t0 = time.perf_counter()
    write_updated_gguf(reader, out, tr.updated_tensors())
    print(f"\n[timing] GGUF write: {time.perf_counter() - t0:.2f}s")
    return tr, out, tokens, mask


def test_written_gguf_roundtrip(loaded, trained) -> None:  # type: ignore[no-untyped-def]
    cfg, _, _, src, _ = loaded
    tr, out, tokens, mask = trained
    assert not any(n.startswith(".updated.gguf.tmp") for n in os.listdir(os.path.dirname(out)))
    upd = tr.updated_tensors()
    new = gguf.GGUFReader(out)
    # metadata identical
    for name, f in src.fields.items():
        if name.startswith("GGUF."):
            continue
        assert new.fields[name].contents() == f.contents(), name
    assert set(new.fields) == set(src.fields)
    by_name = {t.name: t for t in new.tensors}
    assert [t.name for t in new.tensors] == [t.name for t in src.tensors]
    n_same = 0
    for t in src.tensors:
        nt = by_name[t.name]
        if t.name in upd:
            assert nt.tensor_type == gguf.GGMLQuantizationType.F32
            got = np.asarray(nt.data).reshape(upd[t.name].shape)
            np.testing.assert_array_equal(got, upd[t.name])
            old = gguf.quants.dequantize(t.data, t.tensor_type).reshape(got.shape)
            assert not np.array_equal(got, old), t.name
        else:
            assert nt.tensor_type == t.tensor_type and list(nt.shape) == list(t.shape)
            assert np.asarray(nt.data).tobytes() == np.asarray(t.data).tobytes(), t.name
            n_same += 1
    assert n_same == len(src.tensors) - len(upd)
    # our forward on the re-read file reproduces the trainer's current policy
    cfg2, p2, _ = load_gguf(out)
    lp = np.asarray(make_logprobs_fn(cfg2)(to_jax(p2), jnp.asarray(tokens)))
    np.testing.assert_allclose(lp * mask[:, 1:], tr.logprobs(tokens)[:, 1:] * mask[:, 1:],
                               atol=1e-4)


# ----------------------------------------------------------------------------- llama.cpp


def _ref(py: str, *args: str) -> dict:
    r = subprocess.run([py, os.path.join(HERE, "llamacpp_ref.py"), *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_agreement_with_llama_cpp(loaded, trained) -> None:  # type: ignore[no-untyped-def]
    py = _llama_python()
    if py is None:
        pytest.skip("no interpreter with llama_cpp found")
    cfg, _, jp, _, tok = loaded
    tr, out, _, _ = trained
    seqs = [encode(tok, SENTENCE),
            encode(tok, "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n12 + 30 = 42."),
            encode(tok, "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")]
    print(f"llama.cpp reference interpreter: {py}")
    ref = _ref(py, "logprobs", find_smollm2_gguf(), json.dumps(seqs))["logprobs"]
    lp_fn = make_logprobs_fn(cfg)
    diffs = []
    for s, r in zip(seqs, ref):
        ours = np.asarray(lp_fn(jp, jnp.asarray([s], jnp.int32)))[0]
        diffs.append(np.abs(ours - np.asarray(r)))
    d = np.concatenate(diffs)
    print(f"|logprob(ours) - logprob(llama.cpp)| over {d.size} tokens: "
          f"max {d.max():.4f}, mean {d.mean():.4f}")
    # llama.cpp quantizes activations to Q8 inside its Q4_1/Q8_0 matmuls; we use exact
    # f32 activations, so per-token noise of ~0.07 nats (max ~0.6) is expected.  A real
    # bug is far larger: HF rotate_half on GGUF weights gives mean ~1.0, max 2.5-8.
    assert d.mean() < 0.15 and d.max() < 1.0
    # the updated GGUF loads in llama.cpp, generates, and matches our updated policy
    gen = _ref(py, "generate", out, "The capital of France is", "8")
    print(f"llama.cpp on updated GGUF: {gen['text']!r}")
    assert gen["text"].strip()
    ref2 = _ref(py, "logprobs", out, json.dumps(seqs[:1]))["logprobs"][0]
    ours2 = tr.logprobs(np.asarray([seqs[0]], np.int32))[0, 1:]
    d2 = float(np.abs(ours2 - np.asarray(ref2)).max())
    print(f"updated model: max |Δlogprob| vs llama.cpp: {d2:.4f}")
    assert d2 < 1.0
