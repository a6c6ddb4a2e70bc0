"""The Python trainer with engines that load what it publishes: the external-trainer
quick-start with its prefill and decode replicas on fake SGLang servers (``tests/fakes``: SGLang's
native API over a toy model, no GPU), driven token-in, token-out by rollfleet's workers, as
``examples/external-trainer/run.sh`` does with the Rust reference trainer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from rollfleet import Trainer
from support import DEADLINE, EXTERNAL_JOB_NAME, ROOT, Cluster
from test_trainer import check_run, train

FAKES = ROOT / "tests" / "fakes"


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[Callable[[str, str], str]]:
    """Starts a fake engine (script, name) logging to ``tmp_path/NAME.log``; its URL."""
    started: list[subprocess.Popen[bytes]] = []

    def start(script: str, name: str) -> str:
        port_file = tmp_path / f"{name}.port"
        started.append(
            subprocess.Popen(
                [sys.executable, str(FAKES / script), "--port-file", str(port_file)],
                stdout=open(tmp_path / f"{name}.log", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert time.monotonic() < deadline, f"the fake {name} never started"
            assert started[-1].poll() is None, f"the fake {name} exited"
            time.sleep(0.05)
        return f"http://127.0.0.1:{port_file.read_text().strip()}"

    yield start
    for process in started:
        process.kill()
        process.wait(10)


def engine_log(directory: Path, name: str) -> list[dict[str, Any]]:
    lines = (directory / f"{name}.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_weights_published_from_python_are_loaded_by_sglang_engines_that_generate_the_turns(
    clusters: Callable[..., Cluster],
    fakes: Callable[[str, str], str],
    weights: Path,
    tmp_path: Path,
) -> None:
    prefill = fakes("sglang_server.py", "prefill-0")
    decode = [fakes("sglang_server.py", f"decode-{i}") for i in range(2)]
    tokenizer = fakes("vllm_server.py", "tokenizer")
    sglang = ["--engine", "sglang", "--chat-tokenizer-url", tokenizer]
    cluster = clusters(
        weights_dir=weights,
        worker_args={
            "prefill": [*sglang, "--engine-url", prefill],
            "decode": [*sglang, "--engine-url", decode[0], "--engine-url", decode[1]],
        },
    )
    with Trainer(cluster.url, EXTERNAL_JOB_NAME) as trainer:
        run = train(trainer, weights)
    turns = [turn for t in run.trajectories for turn in t.turns if turn.action_tokens]
    assert turns and not any(turn.emulated for turn in turns), "a turn the engines did not make"
    assert all(turn.output for turn in turns), "an engine's turn without its text"
    # Every engine loaded the files the trainer published, in version order, and generated
    # only under versions it had loaded; the decode engines took the versions as they came
    # (the job may end before the last one reaches every replica).
    published = {str(weights / f"policy-v{v}.ckpt"): v for v in range(1, 6)}
    for name in ("prefill-0", "decode-0", "decode-1"):
        log = engine_log(tmp_path, name)
        loaded = [
            (e["model_path"], int(e["requested_version"]))
            for e in log
            if e["path"] == "/update_weights_from_disk" and e["success"]
        ]
        assert all(published.get(path) == version for path, version in loaded), loaded
        versions = [version for _, version in loaded]
        assert versions == sorted(set(versions)), f"{name} loaded {versions}"
        served = {int(e["version"]) for e in log if e["path"] == "/generate"}
        assert served <= {0, *versions}, f"{name} served {served}, loaded {versions}"
        if name.startswith("decode"):
            assert len(versions) >= 2 and versions[-1] >= 4, f"{name} loaded {versions}"
    check_run(run, cluster)
