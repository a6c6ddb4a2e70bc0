#!/usr/bin/env python3
"""A fake vLLM server for rollfleet's wire tests: vLLM's OpenAI-compatible completions with
token ids and logprobs, its chat-aware /tokenize, and its RLHF serving API (dev mode), with a
toy model.

Follows vllm-project/vllm: `vllm/entrypoints/serve/dev/rlhf/api_router.py` (commit
0100a2129224e729af1b3b8ed42a900cdfe9a452: /pause, /resume, /is_paused, /start_weight_update,
/update_weights, /finish_weight_update, /update_weight_version, /weight_info), the shared-disk
weight-transfer backend `vllm/distributed/weight_transfer/disk_engine.py` (commit
3b98defb1248fa873096121529d457c0f5124905: `update_info = {"path": <absolute directory with
*.safetensors>}`), `/reset_prefix_cache` from the dev cache router, and the `TokenizeChatRequest`
/ `TokenizeCompletionRequest` / `TokenizeResponse` shapes of the tokenize protocol. Error bodies
use vLLM's `ErrorResponse` (`{"error": {"message", "type", "param", "code"}}`). Python 3
standard library only.

The toy model (owned by the fakes, not by rollfleet) is `toy_model.py`'s, shared with the SGLang
fake (tokenizer, chat template, sampling). A checkpoint is a directory; its *.safetensors files (in name
order) hashed with sha256 are the weights' identity.

Flags: --fail-updates N (the first N /update_weights answer HTTP 500, the load raising),
--keep-old-weights (every step answers success but the engine keeps its old weights and old
version), --slow-update-ms N, --token-delay-ms N, --never-eos, --model NAME. /pause blocks new generations
until /resume. Every request is logged as one JSON line on stdout ({"path", "version", ...}).

Not modelled: streaming, stop strings, top-k logprob alternatives beyond the sampled token,
the NCCL/IPC weight-transfer backends, /init_weight_transfer_engine, sleep mode, LoRA.
"""

import hashlib
import json
import os
import threading
import time
from urllib.parse import parse_qs, urlsplit

from toy_model import (
    EOS,
    INITIAL_WEIGHTS,
    JsonHandler,
    arguments,
    chat_template,
    log,
    next_token,
    serve,
    token_str,
    tokenize,
)

MAX_MODEL_LEN = 32768


def error_body(status, message, err_type):
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.weights = INITIAL_WEIGHTS
        self.version = args.initial_version
        self.running = threading.Event()
        self.running.set()
        self.session = None  # None, or {"loaded": weights-or-None}
        self.updates = 0


class Handler(JsonHandler):
    def send_empty(self, status=200):
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def fail(self, status, message):
        err_type = {400: "BadRequestError", 404: "NotFoundError", 409: "Conflict"}.get(
            status, "InternalServerError"
        )
        self.send_json(status, error_body(status, message, err_type))

    def body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return {}
        return json.loads(raw)

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def route(self, method):
        url = urlsplit(self.path)
        path, query = url.path, parse_qs(url.query)
        s = self.state
        try:
            body = self.body() if method == "POST" else {}
        except (ValueError, UnicodeDecodeError):
            self.fail(400, "Invalid JSON format")
            return
        try:
            if path == "/health" and method == "GET":
                log({"path": path, "version": s.version})
                self.send_empty()
            elif path == "/v1/models" and method == "GET":
                log({"path": path, "version": s.version})
                self.send_json(200, {"object": "list", "data": [{"id": s.args.model, "object": "model"}]})
            elif path == "/v1/completions" and method == "POST":
                self.completions(body)
            elif path == "/tokenize" and method == "POST":
                self.tokenize(body)
            elif path == "/pause" and method == "POST":
                mode = (query.get("mode") or ["abort"])[0]
                if mode not in ("abort", "wait", "keep"):
                    self.fail(400, f"Input should be 'abort', 'wait' or 'keep': {mode}")
                    return
                s.running.clear()
                log({"path": path, "version": s.version, "mode": mode})
                self.send_json(200, {"status": "paused"})
            elif path == "/resume" and method == "POST":
                s.running.set()
                log({"path": path, "version": s.version})
                self.send_json(200, {"status": "resumed"})
            elif path == "/is_paused" and method == "GET":
                log({"path": path, "version": s.version})
                self.send_json(200, {"is_paused": not s.running.is_set()})
            elif path == "/start_weight_update" and method == "POST":
                with s.lock:
                    if s.session is not None:
                        log({"path": path, "version": s.version, "ok": False})
                        self.fail(500, "A shared-disk weight update is already active")
                        return
                    s.session = {"loaded": None}
                log({"path": path, "version": s.version})
                self.send_json(200, {"message": "Weight update started"})
            elif path == "/update_weights" and method == "POST":
                self.update_weights(body)
            elif path == "/finish_weight_update" and method == "POST":
                self.finish_weight_update(body)
            elif path == "/update_weight_version" and method == "POST":
                new_version = body.get("new_version")
                if not isinstance(new_version, str):
                    self.fail(400, "new_version: Field required")
                    return
                with s.lock:
                    if not s.args.keep_old_weights:
                        s.version = new_version
                log({"path": path, "version": s.version})
                self.send_json(200, {"success": True, "new_version": new_version})
            elif path == "/weight_info" and method == "GET":
                log({"path": path, "version": s.version})
                self.send_json(200, {"weight_version": s.version})
            elif path == "/reset_prefix_cache" and method == "POST":
                log({"path": path, "version": s.version})
                self.send_empty()
            else:
                self.send_json(404, {"detail": "Not Found"})
        except (BrokenPipeError, ConnectionResetError):
            log({"path": path, "version": s.version, "client_gone": True})

    def tokenize(self, body):
        s = self.state
        log({"path": "/tokenize", "version": s.version})
        model = body.get("model")
        if model is not None and model != s.args.model:
            self.fail(404, f"The model `{model}` does not exist.")
            return
        if "messages" in body:
            if body.get("continue_final_message") and body.get("add_generation_prompt", True):
                self.fail(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
                return
            tokens = chat_template(body["messages"], body.get("add_generation_prompt", True))
        elif isinstance(body.get("prompt"), str):
            tokens = tokenize(body["prompt"])
        else:
            self.fail(400, "prompt: Field required")
            return
        strs = [token_str(t) for t in tokens] if body.get("return_token_strs") else None
        self.send_json(
            200, {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens, "token_strs": strs}
        )

    def completions(self, body):
        s = self.state
        model = body.get("model")
        if model != s.args.model:
            self.fail(404, f"The model `{model}` does not exist.")
            return
        if body.get("stream"):
            self.fail(400, "this fake does not stream /v1/completions")
            return
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            input_ids = tokenize(prompt)
        elif isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
            input_ids = prompt
        else:
            self.fail(400, "prompt must be a string or a list of token ids")
            return
        max_tokens = int(body.get("max_tokens") or 16)
        if len(input_ids) + max_tokens > MAX_MODEL_LEN:
            self.fail(400, f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")
            return
        seed = body.get("seed") or 0
        want_logprobs = body.get("logprobs")
        request_id = self.headers.get("X-Request-Id") or f"cmpl-{time.time_ns()}"
        s.running.wait()
        with s.lock:
            weights, version = s.weights, s.version
        output, logprobs = [], []
        context = list(input_ids)
        finish = "length"
        for i in range(max_tokens):
            if s.args.token_delay_ms:
                time.sleep(s.args.token_delay_ms / 1000.0)
            token, token_logprob = next_token(weights, context, seed, i, s.args.never_eos)
            logprobs.append(token_logprob)
            output.append(token)
            context.append(token)
            if token == EOS:
                finish = "stop"
                break
        log(
            {
                "path": "/v1/completions",
                "version": version,
                "request_id": request_id,
                "output_ids": output,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        )
        text = " ".join(token_str(t) for t in output)
        lp = None
        if want_logprobs is not None:
            offsets, at = [], 0
            for t in output:
                offsets.append(at)
                at += len(token_str(t)) + 1
            lp = {
                "text_offset": offsets,
                "token_logprobs": logprobs,
                "tokens": [token_str(t) for t in output],
                "top_logprobs": [{token_str(t): l} for t, l in zip(output, logprobs)],
            }
        choice = {
            "index": 0,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = output
            choice["prompt_token_ids"] = input_ids
        self.send_json(
            200,
            {
                "id": f"cmpl-{request_id}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": s.args.model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(input_ids),
                    "total_tokens": len(input_ids) + len(output),
                    "completion_tokens": len(output),
                    "prompt_tokens_details": None,
                },
            },
        )

    def update_weights(self, body):
        s = self.state
        update_info = body.get("update_info")
        if update_info is None:
            self.fail(400, "Missing 'update_info' in request body")
            return
        if s.args.slow_update_ms:
            time.sleep(s.args.slow_update_ms / 1000.0)
        with s.lock:
            s.updates += 1
            path = update_info.get("path") if isinstance(update_info, dict) else None
            record = {"path": "/update_weights", "version": s.version, "checkpoint": path}
            if s.session is None:
                log({**record, "ok": False})
                self.fail(500, "start_weight_update must be called before loading a checkpoint")
                return
            if s.updates <= s.args.fail_updates:
                s.session = None
                log({**record, "ok": False})
                self.fail(500, "simulated failure (--fail-updates) while loading the checkpoint")
                return
            # DiskWeightTransferUpdateInfo.__post_init__ raises ValueError for a bad path.
            problem = None
            if not isinstance(path, str) or not path:
                problem = "`path` must be a non-empty absolute local directory"
            elif not os.path.isabs(path):
                problem = "`path` must be an absolute local directory"
            elif not os.path.isdir(path):
                problem = f"Shared-disk checkpoint path must be a local directory: {path}"
            else:
                files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
                if not files:
                    problem = f"Shared-disk checkpoint directory contains no safetensors files: {path}"
            if problem is not None:
                s.session = None
                log({**record, "ok": False})
                self.fail(400, problem)
                return
            h = hashlib.sha256()
            for name in files:
                with open(os.path.join(path, name), "rb") as f:
                    h.update(f.read())
            s.session["loaded"] = h.hexdigest()
            log({**record, "ok": True})
        self.send_json(200, {"message": "Weights updated"})

    def finish_weight_update(self, body):
        s = self.state
        new_version = body.get("weight_version")
        with s.lock:
            session, s.session = s.session, None
            if session is None:
                log({"path": "/finish_weight_update", "version": s.version, "ok": False})
                self.fail(500, "No shared-disk weight update is active")
                return
            if session["loaded"] is None:
                log({"path": "/finish_weight_update", "version": s.version, "ok": False})
                self.fail(500, "No checkpoint was loaded during the shared-disk update session")
                return
            if not s.args.keep_old_weights:
                s.weights = session["loaded"]
                if new_version is not None:
                    s.version = str(new_version)
            log({"path": "/finish_weight_update", "version": s.version, "requested_version": new_version})
        self.send_json(200, {"message": "Weight update finished"})


def main():
    parser = arguments(__doc__.split("\n")[0])
    parser.add_argument("--model", default="toy-model")
    args = parser.parse_args()
    Handler.state = State(args)
    serve(Handler, args)


if __name__ == "__main__":
    main()
