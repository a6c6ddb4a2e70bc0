"""Fixtures: real rollfleet clusters (scheduler and workers as processes), stopped after each
test whatever its outcome."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from support import Cluster, start_cluster


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Starts clusters (``start_cluster``'s arguments, under the test's directory) and stops
    every one of them at the end of the test."""
    started: list[Cluster] = []

    def start(name: str = "cluster", **kwargs: Any) -> Cluster:
        cluster = start_cluster(tmp_path / name, **kwargs)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """The directory checkpoints are written to (the scheduler's --weights-dir)."""
    path = tmp_path / "weights"
    path.mkdir()
    return path.resolve()
