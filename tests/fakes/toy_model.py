"""The toy model both fake engines serve (`sglang_server.py`, `vllm_server.py`), and the
scaffolding they share: one tokenizer and chat template, so that either fake can tokenize for
the other (a fake vLLM is the SGLang fake's chat tokenizer in rollfleet's tests), one way of
sampling, and one way of starting, logging and announcing the port.

- tokenizer: whitespace-separated words, each to 10 + fnv1a(word) % 990; the specials
  <|im_start|> = 1, <|im_end|> = 2 (also EOS), newline = 3;
- chat template (ChatML-like): per message [1] + tok(role) + [3] + tok(content) + [2, 3]; the
  generation prompt is [1] + tok("assistant") + [3];
- sampling: token i is a function of sha256(weights, context, seed); it is EOS with probability
  about 1/8 after the first token; its logprob is a negative float that is a function of
  sha256(weights, context, token) only.

Python 3 standard library only.
"""

import argparse
import hashlib
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

IM_START, IM_END, NEWLINE = 1, 2, 3
EOS = IM_END
VOCAB = 1000


def fnv1a(text):
    h = 0xCBF29CE484222325
    for b in text.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def tokenize(text):
    return [10 + fnv1a(w) % (VOCAB - 10) for w in text.split()]


def token_str(i):
    return "<|im_end|>" if i == EOS else f"t{i}"


def chat_template(messages, add_generation_prompt):
    ids = []
    for m in messages:
        ids += [IM_START] + tokenize(str(m.get("role", ""))) + [NEWLINE]
        ids += tokenize(str(m.get("content", ""))) + [IM_END, NEWLINE]
    if add_generation_prompt:
        ids += [IM_START] + tokenize("assistant") + [NEWLINE]
    return ids


def digest(*parts):
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "big")


def next_token(weights, context, seed, index, never_eos):
    """The token sampled at position `index` of an answer after `context`, and its logprob."""
    h = digest(weights, context, seed)
    token = EOS if index > 0 and h % 8 == 0 and not never_eos else 10 + h % (VOCAB - 10)
    return token, -((digest(weights, context, token) % 4000) + 1) / 1000.0


INITIAL_WEIGHTS = hashlib.sha256(b"initial weights").hexdigest()


def log(record):
    """One request, as one JSON line on stdout ({"path", "version", ...})."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def arguments(description):
    """The flags both fakes take; a fake adds its own before parsing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file")
    parser.add_argument("--fail-updates", type=int, default=0)
    parser.add_argument("--keep-old-weights", action="store_true")
    parser.add_argument("--slow-update-ms", type=int, default=0)
    parser.add_argument("--token-delay-ms", type=int, default=0)
    parser.add_argument("--never-eos", action="store_true")
    parser.add_argument("--initial-version", default="0")
    return parser


def serve(handler, args):
    """Serves `handler` until interrupted, writing the bound port to `--port-file` first."""
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    port = server.server_address[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    log({"path": "<listening>", "version": args.initial_version, "port": port})
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


class JsonHandler(BaseHTTPRequestHandler):
    """What both fakes' request handlers share: HTTP/1.1 keep-alive, no access log (each
    request is logged as JSON instead), JSON answers."""

    protocol_version = "HTTP/1.1"
    state = None

    def log_message(self, *args):
        pass

    def send_json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
