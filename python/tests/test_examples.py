"""The examples in examples/python/ run as documented, against a real scheduler."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from support import DEADLINE, EXTERNAL_JOB_NAME, ROOT, Cluster, read_line

EXAMPLES = ROOT / "examples" / "python"


def test_the_example_trainer_drives_the_external_quickstart_to_success(
    clusters: Callable[..., Cluster], weights: Path
) -> None:
    cluster = clusters(weights_dir=weights)
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "trainer.py"),
            "--scheduler",
            cluster.url,
            "--job",
            EXTERNAL_JOB_NAME,
            "--checkpoints",
            str(weights),
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 0, done.stderr
    assert "done: version 5 published, 160 trajectories consumed" in done.stdout
    assert json.loads((weights / "state.json").read_text()) == {
        "acked_through": 160,
        "version": 5,
    }
    assert sorted(p.name for p in weights.glob("policy-v*.ckpt")) == [
        f"policy-v{v}.ckpt" for v in range(1, 6)
    ]
    assert cluster.stop_scheduler() == 0


def test_the_example_trainer_reports_a_refused_subscription_in_one_line_without_a_traceback(
    clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = clusters(pools=())
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "trainer.py"),
            "--scheduler",
            cluster.url,
            "--job",
            "another-job",
            "--checkpoints",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: the scheduler at ") and EXTERNAL_JOB_NAME in line


def test_the_example_environment_server_serves_its_game_until_stopped() -> None:
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "env_server.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = read_line(server.stdout, time.monotonic() + 30, "the example server")
        assert line.startswith("listening on "), line
        port = int(line.split()[-1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=10) as r:
            assert json.loads(r.read()) == {"environments": ["guess"], "slots": 64, "busy": 0}
        server.send_signal(signal.SIGTERM)
        assert server.wait(DEADLINE) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
