"""Reference logprobs / generation from llama.cpp (llama-cpp-python).

Run with an interpreter that has ``llama_cpp`` installed (NOT the JAX venv), e.g.::

    .venv-llama/bin/python llamacpp_ref.py logprobs MODEL.gguf '[[1,2,3],[4,5]]'
    .venv-llama/bin/python llamacpp_ref.py generate MODEL.gguf 'The capital of France is' 12

Prints one JSON object on stdout.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def _load(path: str):  # type: ignore[no-untyped-def]
    import llama_cpp.llama_cpp as llama_cpp_c
    from llama_cpp import Llama

    # PITFALL: a GGML_NATIVE build on this Xeon compiles ggml's AMX kernels (the CPU
    # advertises amx_tile/amx_int8), but the sandbox does not grant AMX tile state, so
    # the first quantized matmul dies with SIGILL (`tilezero`).  The AMX path is an
    # "extra buffer type"; turning extra buffer types off avoids it at run time.
    _orig = llama_cpp_c.llama_model_default_params

    def _params():  # type: ignore[no-untyped-def]
        p = _orig()
        p.use_extra_bufts = False
        return p

    llama_cpp_c.llama_model_default_params = _params  # Llama.__init__ looks it up here

    return Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=2, logits_all=True,
                 verbose=False, seed=0)


def logprobs(path: str, seqs: list[list[int]]) -> dict:
    llm = _load(path)
    out = []
    for seq in seqs:
        llm.reset()
        llm.eval(seq)
        logits = np.asarray(llm.scores[: len(seq)], dtype=np.float64)  # [T, V]
        m = logits.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        lp = [float(logits[t - 1, seq[t]] - lse[t - 1]) for t in range(1, len(seq))]
        out.append(lp)
    return {"logprobs": out}


def generate(path: str, prompt: str, n: int) -> dict:
    llm = _load(path)
    toks = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    res = llm.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1)
    return {"prompt_tokens": toks, "text": res["choices"][0]["text"]}


def main() -> None:
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "logprobs":
        print(json.dumps(logprobs(path, json.loads(sys.argv[3]))))
    elif cmd == "generate":
        print(json.dumps(generate(path, sys.argv[3], int(sys.argv[4]))))
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
