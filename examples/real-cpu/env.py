#!/usr/bin/env python3
"""The environment of the real-model job: one question, one answer, a verifiable reward.

The policy is asked for a single digit; the reward is 1 when its whole answer is one digit from
1 to 9 (a trailing full stop allowed), else ``1 / (1 + characters)``: shorter answers are closer.
A small instruct model at temperature 1 rarely answers with the digit alone, so the shaping
gives every GRPO group reward differences to learn from. Served to rollfleet over the
remote environment protocol with the Python SDK's ``rollfleet.env.serve``::

    python3 examples/real-cpu/env.py --port-file /tmp/env.port
    rollfleet worker --pool envs --remote-env digit=http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from typing import Any

from rollfleet.env import serve

QUESTIONS = [
    "Reply with a single digit from 1 to 9 and nothing else.",
    "Pick one digit between 1 and 9. Answer with the digit only.",
    "Say one number from 1 to 9, as a single digit, with no other words.",
]
ANSWER = re.compile(r"^\s*[1-9]\.?\s*$")


class Digit:
    """One episode: the question its seed picks, then one answer scored."""

    def __init__(self) -> None:
        self.question = ""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self.question = QUESTIONS[(seed or 0) % len(QUESTIONS)]
        return self.question, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if ANSWER.match(action):
            return "Correct.", 1.0, True, False, {}
        return "Not a single digit.", 1.0 / (1 + len(action.strip())), True, False, {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--port-file", help="write the bound port here once listening")
    args = parser.parse_args()
    server = serve(Digit, args.port, name="digit")
    if args.port_file:
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(server.port))
        os.replace(tmp, args.port_file)
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        server.wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
