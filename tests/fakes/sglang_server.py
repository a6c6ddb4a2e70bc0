#!/usr/bin/env python3
"""A fake SGLang server for rollfleet's wire tests: SGLang's native HTTP API with a toy model.

Follows the native endpoints of SGLang's `python/sglang/srt/entrypoints/http_server.py`
(sgl-project/sglang commit 0025436eab0556737d615b36a4dd3e1e26e82f3d) and the request structs
of `python/sglang/srt/managers/io_struct.py` (`GenerateReqInput`, `UpdateWeightFromDiskReqInput`,
`AbortReq`, `PauseGenerationReqInput`): same paths, field names, status codes and error bodies as
read there. Python 3 standard library only.

Endpoints: POST /generate (non-streaming only), POST /update_weights_from_disk,
GET /get_weight_version, GET /get_model_info, POST /pause_generation, POST /continue_generation,
GET|POST /flush_cache, POST /abort_request, POST /tokenize and /v1/tokenize (text only, as in
SGLang), GET /health.

The toy model (owned by the fakes, not by rollfleet) is `toy_model.py`'s, shared with the vLLM
fake (tokenizer, chat template, sampling). Weights: a checkpoint is any file (or directory: its files in name order); its sha256 is the
  weights' identity. The version is the string sent as `weight_version`.

Flags: --fail-updates N (the first N updates answer HTTP 400 with success false, as SGLang does
when a load raises), --keep-old-weights (updates answer success but the engine keeps serving
the old weights and the old version), --slow-update-ms N, --token-delay-ms N (per generated
token, to test aborts), --never-eos. Pause blocks new generations until continue. Every request is logged as
one JSON line on stdout ({"path", "version", ...}).

Not modelled: streaming, batching, stop strings, sampling parameters other than max_new_tokens
and sampling_seed, the OpenAI-compatible endpoints, LoRA, distributed and tensor weight updates.
"""

import hashlib
import json
import os
import threading
import time

from toy_model import (
    EOS,
    INITIAL_WEIGHTS,
    JsonHandler,
    arguments,
    log,
    next_token,
    serve,
    token_str,
    tokenize,
)


def detokenize(ids):
    return " ".join(token_str(i) for i in ids)


def checkpoint_hash(path):
    h = hashlib.sha256()
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            with open(os.path.join(path, name), "rb") as f:
                h.update(f.read())
    else:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.weights = INITIAL_WEIGHTS
        self.version = args.initial_version
        self.model_path = "toy/initial"
        self.running = threading.Event()
        self.running.set()
        self.updates = 0
        self.aborted = set()


class Handler(JsonHandler):
    def send_text(self, status, text):
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def validation_error(self, message):
        # SGLang's RequestValidationError handler: 400 with an ErrorResponse body.
        self.send_json(
            400,
            {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
        )

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

    def do_PUT(self):
        self.route("PUT")

    def route(self, method):
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
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif path == "/get_weight_version" and method == "GET":
                log({"path": path, "version": s.version})
                self.send_json(200, {"weight_version": s.version})
            elif path == "/get_model_info" and method == "GET":
                log({"path": path, "version": s.version})
                self.send_json(
                    200,
                    {
                        "model_path": s.model_path,
                        "tokenizer_path": s.model_path,
                        "is_generation": True,
                        "preferred_sampling_params": None,
                        "weight_version": s.version,
                    },
                )
            elif path == "/generate" and method in ("POST", "PUT"):
                self.generate(body)
            elif path == "/update_weights_from_disk" and method == "POST":
                self.update_weights(body)
            elif path == "/pause_generation" and method == "POST":
                s.running.clear()
                log({"path": path, "version": s.version, "mode": body.get("mode", "abort")})
                self.send_json(200, {"message": "Generation paused successfully.", "status": "ok"})
            elif path == "/continue_generation" and method == "POST":
                s.running.set()
                log({"path": path, "version": s.version})
                self.send_json(200, {"message": "Generation continued successfully.", "status": "ok"})
            elif path == "/flush_cache" and method in ("GET", "POST"):
                log({"path": path, "version": s.version})
                self.send_text(
                    200,
                    "Cache flushed.\nPlease check backend logs for more details. (When there are "
                    "running or waiting requests, the operation will not be performed.)\n",
                )
            elif path == "/abort_request" and method == "POST":
                rid = body.get("rid") or ""
                with s.lock:
                    s.aborted.add(rid)
                log({"path": path, "version": s.version, "rid": rid, "abort_all": bool(body.get("abort_all"))})
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif path in ("/tokenize", "/v1/tokenize") and method == "POST":
                self.tokenize(path, body)
            else:
                self.send_json(404, {"detail": "Not Found"})
        except (BrokenPipeError, ConnectionResetError):
            log({"path": path, "version": s.version, "client_gone": True})

    def tokenize(self, path, body):
        s = self.state
        prompt = body.get("prompt")
        log({"path": path, "version": s.version})
        if prompt is None:
            # SGLang's TokenizeRequest requires `prompt` (a string or a list of strings) and
            # knows no `messages`: pydantic rejects the body, answered as 400.
            self.validation_error("1 validation error for TokenizeRequest\nprompt\n  Field required")
            return
        if isinstance(prompt, str):
            tokens = tokenize(prompt)
            count = len(tokens)
        elif isinstance(prompt, list):
            tokens = [tokenize(p) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            self.validation_error(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
            return
        self.send_json(200, {"tokens": tokens, "count": count, "max_model_len": 32768, "object": "tokenize"})

    def generate(self, body):
        s = self.state
        if body.get("stream"):
            self.send_json(400, {"error": {"message": "this fake does not stream /generate"}})
            return
        input_ids = body.get("input_ids")
        text = body.get("text")
        if input_ids is None and text is None:
            # GenerateReqInput.normalize raises ValueError; answered by _create_error_response.
            self.send_json(400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})
            return
        if input_ids is None:
            input_ids = tokenize(text)
        if not isinstance(input_ids, list) or not all(isinstance(i, int) for i in input_ids):
            self.validation_error("input_ids must be a list of integers")
            return
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        seed = params.get("sampling_seed", 0)
        rid = body.get("rid") or f"rid-{time.time_ns()}"
        s.running.wait()
        with s.lock:
            weights, version = s.weights, s.version
        output, logprobs = [], []
        context = list(input_ids)
        finish = {"type": "length", "length": max_new}
        for i in range(max_new):
            if s.args.token_delay_ms:
                time.sleep(s.args.token_delay_ms / 1000.0)
                with s.lock:
                    if rid in s.aborted:
                        finish = {"type": "abort", "message": "Abort before prefill", "status_code": 200}
                        break
            token, token_logprob = next_token(weights, context, seed, i, s.args.never_eos)
            logprobs.append(token_logprob)
            output.append(token)
            context.append(token)
            if token == EOS:
                finish = {"type": "stop", "matched": EOS}
                break
        log(
            {
                "path": "/generate",
                "version": version,
                "rid": rid,
                "input_ids": input_ids,
                "output_ids": output,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        )
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "weight_version": version,
            "completion_tokens": len(output),
            "cached_tokens": 0,
            "e2e_latency": 0.001,
        }
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, output)]
        self.send_json(200, {"text": detokenize(output), "output_ids": output, "meta_info": meta})

    def update_weights(self, body):
        s = self.state
        model_path = body.get("model_path")
        new_version = body.get("weight_version")
        if not isinstance(model_path, str):
            self.validation_error("model_path: Input should be a valid string")
            return
        started = time.time()
        if s.args.slow_update_ms:
            time.sleep(s.args.slow_update_ms / 1000.0)
        with s.lock:
            s.updates += 1
            attempt = s.updates
            if attempt <= s.args.fail_updates:
                success = False
                message = (
                    "Failed to update weights: simulated failure (--fail-updates).\n"
                    "Rolling back to original weights."
                )
            else:
                try:
                    weights = checkpoint_hash(model_path)
                except OSError as e:
                    success = False
                    message = f"Failed to get weights iterator: {e}."
                else:
                    success = True
                    message = "Succeeded to update model weights."
                    if not s.args.keep_old_weights:
                        s.weights = weights
                        s.model_path = model_path
                        if new_version is not None:
                            s.version = new_version
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
                "started": started,
                "finished": time.time(),
            }
        )
        self.send_json(
            200 if success else 400,
            {"success": success, "message": message, "num_paused_requests": 0},
        )


def main():
    parser = arguments(__doc__.split("\n")[0])
    args = parser.parse_args()
    Handler.state = State(args)
    serve(Handler, args)


if __name__ == "__main__":
    main()
