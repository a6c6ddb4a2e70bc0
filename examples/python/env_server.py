#!/usr/bin/env python3
"""A gymnasium-style environment served to rollfleet with ``rollfleet.env.serve``.

The game: find a secret number from 1 to 100; each wrong guess is told "higher" or "lower".
The number of tries comes from the task row the episode's seed picks (``tasks``). Point an
environment worker at it, declare the environment in the job and name it in a task::

    python3 examples/python/env_server.py --port 8765
    rollfleet worker --pool envs --remote-env guess=http://127.0.0.1:8765
    # in the job: tasks: [{ name: ..., environment: guess, ... }]
    #             environments: [{ name: guess, servedBy: remote }]

Any environment with gymnasium's ``reset(seed=, options=)`` and ``step(action)`` can take the
place of ``GuessNumber`` (a ``gymnasium.Env`` too, with text observations or a ``render``).
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
from typing import Any

from rollfleet.env import serve

TASKS = [{"max_guesses": 7}, {"max_guesses": 10}]


class GuessNumber:
    """One episode of the game; the same seed always hides the same number."""

    def __init__(self) -> None:
        self.secret = 0
        self.left = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self.secret = random.Random(seed).randint(1, 100)
        self.left = int((options or {}).get("max_guesses", 7))
        prompt = (
            f"I am thinking of a number from 1 to 100. Guess it in at most {self.left} tries: "
            "answer with <action>NUMBER</action>."
        )
        return prompt, {}

    def step(self, action: int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not 1 <= action <= 100:
            return f"{action} is not from 1 to 100.", 0.0, False, False, {"invalid_action": True}
        self.left -= 1
        if action == self.secret:
            return "Correct!", 1.0, True, False, {}
        hint = "higher" if action < self.secret else "lower"
        return f"{action} is wrong: go {hint}.", 0.0, False, self.left <= 0, {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0: any free port")
    parser.add_argument("--name", default="guess", help="the environment kind served")
    args = parser.parse_args()
    server = serve(GuessNumber, args.port, args.host, name=args.name, tasks=TASKS, parse_action=int)
    print(f"listening on {server.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        server.wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
