"""The environment server: a gymnasium-style game served by ``rollfleet.env.serve``, checked
through the protocol exactly as rollfleet's client (``agents/remote``) calls it, and used by a
real job whose environment worker reaches it with ``--remote-env``."""

from __future__ import annotations

import http.client
import json
import math
import random
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from rollfleet import Trainer
from rollfleet.env import EnvServer, serve
from support import DEADLINE, EXTERNAL_JOB, EXTERNAL_JOB_NAME, Cluster

EPISODE_ID = re.compile(r"^[A-Za-z0-9_-]+$")


class GuessNumber:
    """Find a secret number from 1 to 100; a wrong guess is told to go higher or lower."""

    def __init__(self) -> None:
        self.secret = 0
        self.left = 0
        self.closed = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self.secret = random.Random(seed).randint(1, 100)
        self.left = int((options or {}).get("max_guesses", 7))
        return f"Guess a number from 1 to 100 in {self.left} tries.", {}

    def step(self, action: int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not 1 <= action <= 100:
            return f"{action} is not from 1 to 100.", 0.0, False, False, {"invalid_action": True}
        self.left -= 1
        if action == self.secret:
            return "Correct!", 1.0, True, False, {}
        hint = "higher" if action < self.secret else "lower"
        return f"{action} is wrong: go {hint}.", 0.0, False, self.left <= 0, {}

    def close(self) -> None:
        self.closed = True


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, 100)


class Remote:
    """A client of the protocol that calls it as ``agents/remote`` does: JSON bodies, one
    keep-alive connection, the statuses it expects."""

    def __init__(self, server: EnvServer) -> None:
        self.connection = http.client.HTTPConnection(server.host, server.port, timeout=10)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        self.connection.request(method, path, body=payload, headers=headers)
        response = self.connection.getresponse()
        data = response.read()
        return response.status, (json.loads(data) if data else None)

    def start(self, seed: int, environment: str = "guess") -> tuple[str, str]:
        status, body = self.call("POST", "/v1/episodes", {"environment": environment, "seed": seed})
        assert status == 201, body
        assert EPISODE_ID.match(body["episode"]), body
        return body["episode"], body["observation"]

    def step(self, episode: str, action: str) -> dict[str, Any]:
        status, body = self.call("POST", f"/v1/episodes/{episode}/step", {"action": action})
        assert status == 200, body
        assert isinstance(body["observation"], str)
        assert math.isfinite(body["reward"])
        assert isinstance(body["done"], bool) and isinstance(body["invalidAction"], bool)
        return dict(body)

    def error(self, method: str, path: str, body: Any, status: int, code: str) -> str:
        got, answer = self.call(method, path, body)
        assert got == status, answer
        assert answer["error"]["code"] == code, answer
        return str(answer["error"]["message"])


@pytest.fixture
def game() -> Iterator[EnvServer]:
    server = serve(
        GuessNumber,
        0,
        name="guess",
        slots=4,
        tasks=[{"max_guesses": 3}, {"max_guesses": 5}],
        parse_action=int,
    )
    yield server
    server.shutdown()


def test_health_lists_the_environments_served_and_the_slots_in_use(game: EnvServer) -> None:
    remote = Remote(game)
    assert remote.call("GET", "/v1/health") == (
        200,
        {"environments": ["guess"], "slots": 4, "busy": 0},
    )
    remote.start(1)
    assert remote.call("GET", "/v1/health")[1]["busy"] == 1
    assert game.url == f"http://127.0.0.1:{game.port}"


def test_an_episode_is_reset_with_the_seed_and_the_task_row_the_seed_picks(
    game: EnvServer,
) -> None:
    remote = Remote(game)
    _, first = remote.start(10)
    _, second = remote.start(11)
    assert first == "Guess a number from 1 to 100 in 3 tries."
    assert second == "Guess a number from 1 to 100 in 5 tries."


def test_the_same_seed_and_actions_replay_the_same_episode(game: EnvServer) -> None:
    remote = Remote(game)
    runs = []
    for _ in range(2):
        episode, _ = remote.start(7)
        runs.append([remote.step(episode, a) for a in ("50", "25", "75")])
    assert runs[0] == runs[1]


def test_a_game_won_by_bisection_ends_terminated_and_its_episode_is_forgotten(
    game: EnvServer,
) -> None:
    remote = Remote(game)
    episode, _ = remote.start(4)  # 3 tries is too few for bisection: seed 4 has 5
    low, high = 1, 100
    for _ in range(7):
        guess = (low + high) // 2
        answer = remote.step(episode, str(guess))
        if answer["done"]:
            break
        if "go higher" in answer["observation"]:
            low = guess + 1
        else:
            high = guess - 1
    if guess == secret(4):
        assert answer == {
            "observation": "Correct!",
            "reward": 1.0,
            "done": True,
            "invalidAction": False,
            "terminated": True,
            "truncated": False,
        }
    else:
        assert answer["done"] and answer["truncated"] and not answer["terminated"]
    remote.error("POST", f"/v1/episodes/{episode}/step", {"action": "1"}, 404, "unknown_episode")
    assert game.stats().episodes_finished == 1


def test_running_out_of_tries_is_truncated_and_ends_the_episode(game: EnvServer) -> None:
    remote = Remote(game)
    episode, _ = remote.start(0)  # 3 tries
    wrong = str(secret(0) % 100 + 1)
    answers = [remote.step(episode, wrong) for _ in range(3)]
    assert [a["done"] for a in answers] == [False, False, True]
    assert answers[-1]["truncated"] and not answers[-1]["terminated"]
    assert answers[-1]["reward"] == 0.0


def test_an_action_the_environment_cannot_take_is_an_invalid_action_not_an_error(
    game: EnvServer,
) -> None:
    remote = Remote(game)
    episode, _ = remote.start(0)
    unparsed = remote.step(episode, "fifty")
    assert unparsed["invalidAction"] and not unparsed["done"]
    assert "fifty" in unparsed["observation"]
    out_of_range = remote.step(episode, "0")
    assert out_of_range["invalidAction"] and not out_of_range["done"]
    # Neither used a try: three wrong guesses still end it.
    wrong = str(secret(0) % 100 + 1)
    assert [remote.step(episode, wrong)["done"] for _ in range(3)] == [False, False, True]
    assert game.stats().invalid_actions == 2


def test_malformed_and_unknown_requests_get_the_protocols_error_codes(game: EnvServer) -> None:
    remote = Remote(game)
    message = remote.error(
        "POST", "/v1/episodes", {"environment": "chess", "seed": 1}, 404, "unknown_environment"
    )
    assert "chess" in message and "guess" in message
    for body in (
        {"environment": "guess"},
        {"environment": "guess", "seed": -1},
        {"environment": "guess", "seed": True},
        {"environment": "guess", "seed": "7"},
        {"seed": 1},
        [1, 2],
    ):
        remote.error("POST", "/v1/episodes", body, 400, "bad_request")
    episode, _ = remote.start(1)
    remote.error("POST", f"/v1/episodes/{episode}/step", {"act": "1"}, 400, "bad_request")
    remote.error("POST", "/v1/episodes/nope/step", {"action": "1"}, 404, "unknown_episode")
    remote.error("GET", "/v1/nothing", None, 404, "not_found")
    assert remote.call("DELETE", f"/v1/episodes/{episode}") == (204, None)
    remote.error("POST", f"/v1/episodes/{episode}/step", {"action": "1"}, 404, "unknown_episode")
    # A body that is not JSON at all, on a fresh connection.
    raw = http.client.HTTPConnection(game.host, game.port, timeout=10)
    raw.request("POST", "/v1/episodes", body=b"{not json", headers={"Content-Type": "application/json"})
    response = raw.getresponse()
    assert response.status == 400
    assert json.loads(response.read())["error"]["code"] == "bad_request"


def test_a_full_server_refuses_new_episodes_with_429_until_one_is_deleted(
    game: EnvServer,
) -> None:
    remote = Remote(game)
    episodes = [remote.start(seed)[0] for seed in range(4)]
    message = remote.error(
        "POST", "/v1/episodes", {"environment": "guess", "seed": 9}, 429, "no_free_slot"
    )
    assert "4 slots" in message
    assert remote.call("DELETE", f"/v1/episodes/{episodes[0]}") == (204, None)
    remote.start(9)


def test_one_keep_alive_connection_serves_every_request(game: EnvServer) -> None:
    remote = Remote(game)
    remote.call("GET", "/v1/health")
    sock = remote.connection.sock
    episode, _ = remote.start(3)
    remote.step(episode, "50")
    remote.call("DELETE", f"/v1/episodes/{episode}")
    assert remote.connection.sock is sock, "the server closed a keep-alive connection"


class Broken:
    """Fails the way an environment can: in reset, in step, or with a reward that is no
    number."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        if seed == 666:
            raise RuntimeError("the sandbox did not start")
        return "ready", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "crash":
            raise RuntimeError("the sandbox died")
        return "ok", float("nan") if action == "nan" else 0.5, False, False, {}


def test_an_environment_that_fails_answers_500_internal_and_its_episode_is_dropped() -> None:
    with serve(Broken, 0, name="broken") as server:
        remote = Remote(server)
        message = remote.error(
            "POST", "/v1/episodes", {"environment": "broken", "seed": 666}, 500, "internal"
        )
        assert "the sandbox did not start" in message
        for action in ("crash", "nan"):
            episode, _ = remote.start(1, "broken")
            assert remote.step(episode, "fine")["reward"] == 0.5
            remote.error("POST", f"/v1/episodes/{episode}/step", {"action": action}, 500, "internal")
            remote.error("POST", f"/v1/episodes/{episode}/step", {"action": "fine"}, 404, "unknown_episode")
        assert remote.call("GET", "/v1/health")[1]["busy"] == 0


def test_idle_episodes_are_reclaimed_and_shutdown_closes_the_rest() -> None:
    made: list[GuessNumber] = []

    def factory() -> GuessNumber:
        made.append(GuessNumber())
        return made[-1]

    server = serve(factory, 0, name="guess", idle_timeout=0.3, parse_action=int)
    remote = Remote(server)
    idle, _ = remote.start(1)
    time.sleep(0.6)
    assert remote.call("GET", "/v1/health")[1]["busy"] == 0
    assert made[0].closed
    remote.error("POST", f"/v1/episodes/{idle}/step", {"action": "1"}, 404, "unknown_episode")
    remote.start(2)
    server.shutdown()
    assert made[1].closed


def test_a_job_plays_a_python_environment_through_a_rollfleet_worker(
    clusters: Callable[..., Cluster], weights: Path, tmp_path: Path
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        EXTERNAL_JOB.read_text()
        .replace("environment: frozenlake", "environment: pyguess")
        .replace(
            "  rewards:\n",
            "  environments:\n    - { name: pyguess, servedBy: remote }\n  rewards:\n",
            1,
        )
    )
    with serve(
        GuessNumber,
        0,
        name="pyguess",
        tasks=[{"max_guesses": 3}, {"max_guesses": 5}],
        parse_action=int,
        slots=1024,
    ) as game:
        cluster = clusters(
            job=job,
            weights_dir=weights,
            worker_args={"envs": ["--remote-env", f"pyguess={game.url}"]},
        )
        played = []
        with Trainer(cluster.url, EXTERNAL_JOB_NAME) as trainer:
            for batch in trainer.batches(32, timeout=DEADLINE):
                played += [t for t in batch if t.task == "frozenlake"]
                path = weights / f"v{trainer.version + 1}.ckpt"
                path.write_text(str([t.id for t in batch]))
                trainer.ack(batch)
                trainer.publish(trainer.version + 1, path, "rollfleet-test", timeout=DEADLINE)
            assert trainer.version == 5
        stats = game.stats()
    assert played, "no trajectory of the task served from Python"
    assert stats.by_environment == {"pyguess": stats.episodes_started}
    assert stats.episodes_started >= len(played)
    assert stats.steps >= sum(len(t.turns) for t in played)
    step = re.compile(r"^(\d+ is wrong: go (higher|lower)\.|Correct!)$")
    for t in played:
        assert re.match(r"^Guess a number from 1 to 100 in [35] tries\.$", t.prompt), t.prompt
        for turn in t.turns:
            assert step.match(turn.observation), turn.observation
            assert turn.action.isdigit()
        won = t.turns[-1].observation == "Correct!"
        # The environment's reward (its last step's) is the trajectory's reward.
        assert t.reward == (1.0 if won else 0.0)
        assert len(t.turns) <= 5
    assert cluster.stop_scheduler() == 0
