#!/usr/bin/env python3
"""A remote rollfleet environment in plain Python (standard library only).

It serves the remote environment protocol (docs/remote-environments.md) for one game,
"guess": find a secret number between 1 and 100 in at most 7 guesses; each wrong guess is
answered with "higher" or "lower". Copy it and replace `GuessEpisode` with your environment.

    python3 examples/remote-env/server.py --port 8099
    python3 examples/remote-env/server.py --port 0   # any free port; prints "listening on PORT"
"""

import argparse
import json
import random
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 1 << 20


class GuessEpisode:
    """One episode; the same seed always hides the same number."""

    max_guesses = 7

    def __init__(self, seed):
        self.secret = random.Random(seed).randint(1, 100)
        self.guesses = 0

    def reset(self):
        return ("I am thinking of a number between 1 and 100. Guess it in at most "
                f"{self.max_guesses} tries: answer with <action>NUMBER</action>.")

    def step(self, action):
        text = action.strip()
        if text.startswith("<action>") and text.endswith("</action>"):
            text = text[len("<action>"):-len("</action>")].strip()
        self.guesses += 1
        out_of_guesses = self.guesses >= self.max_guesses
        try:
            guess = int(text)
        except ValueError:
            return {"observation": f"{text!r} is not a number.", "reward": 0.0,
                    "done": out_of_guesses, "invalidAction": True}
        if guess == self.secret:
            return {"observation": "Correct!", "reward": 1.0, "done": True}
        hint = "higher" if guess < self.secret else "lower"
        return {"observation": f"{guess} is wrong: go {hint}.", "reward": 0.0,
                "done": out_of_guesses}


ENVIRONMENTS = {"guess": GuessEpisode}


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, slots):
        super().__init__(address, Handler)
        self.slots = slots
        self.episodes = {}
        self.next_id = 0
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, *args):
        pass

    def reply(self, status, body=None):
        payload = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def error(self, status, code, message):
        self.reply(status, {"error": {"code": code, "message": message}})

    def body(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ValueError(f"body of {length} bytes is over the {MAX_BODY}-byte limit")
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self):
        if self.path != "/v1/health":
            return self.error(HTTPStatus.NOT_FOUND, "not_found", self.path)
        with self.server.lock:
            busy = len(self.server.episodes)
        self.reply(HTTPStatus.OK, {"environments": sorted(ENVIRONMENTS),
                                   "slots": self.server.slots, "busy": busy})

    def do_POST(self):
        try:
            request = self.body()
        except (ValueError, json.JSONDecodeError) as e:
            return self.error(HTTPStatus.BAD_REQUEST, "bad_request", str(e))
        parts = self.path.strip("/").split("/")
        if parts == ["v1", "episodes"]:
            kind = ENVIRONMENTS.get(request.get("environment"))
            if kind is None:
                return self.error(HTTPStatus.NOT_FOUND, "unknown_environment",
                                  f"{request.get('environment')!r}; known: {sorted(ENVIRONMENTS)}")
            seed = request.get("seed")
            if not isinstance(seed, int):
                return self.error(HTTPStatus.BAD_REQUEST, "bad_request", "seed: integer required")
            with self.server.lock:
                if len(self.server.episodes) >= self.server.slots:
                    return self.error(HTTPStatus.TOO_MANY_REQUESTS, "no_free_slot",
                                      f"all {self.server.slots} slots busy")
                self.server.next_id += 1
                episode_id = f"e{self.server.next_id}"
                episode = kind(seed)
                self.server.episodes[episode_id] = episode
            return self.reply(HTTPStatus.CREATED,
                              {"episode": episode_id, "observation": episode.reset()})
        if len(parts) == 4 and parts[:2] == ["v1", "episodes"] and parts[3] == "step":
            with self.server.lock:
                episode = self.server.episodes.get(parts[2])
            if episode is None:
                return self.error(HTTPStatus.NOT_FOUND, "unknown_episode", parts[2])
            action = request.get("action")
            if not isinstance(action, str):
                return self.error(HTTPStatus.BAD_REQUEST, "bad_request", "action: string required")
            result = episode.step(action)
            if result["done"]:
                with self.server.lock:
                    self.server.episodes.pop(parts[2], None)
            return self.reply(HTTPStatus.OK, result)
        return self.error(HTTPStatus.NOT_FOUND, "not_found", self.path)

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 3 and parts[:2] == ["v1", "episodes"]:
            with self.server.lock:
                self.server.episodes.pop(parts[2], None)
            return self.reply(HTTPStatus.NO_CONTENT)
        return self.error(HTTPStatus.NOT_FOUND, "not_found", self.path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--slots", type=int, default=64)
    args = parser.parse_args()
    server = Server((args.host, args.port), args.slots)
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
