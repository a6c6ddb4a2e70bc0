#!/usr/bin/env python3
"""A minimal external trainer written with rollfleet's Python SDK.

It trains no model: each RL step it takes a batch of whole groups from the trainer feed,
computes GRPO's group advantages and a stand-in "loss" over the batch's tokens, writes a dummy
checkpoint file durably, acknowledges the batch and publishes the file as the next policy
version. Its progress (what it acknowledged, the version it published) is kept in
``CHECKPOINTS/state.json``, so a trainer started again carries on where it stopped.

    rollfleet scheduler examples/jobs/quickstart-external.yaml --expect-workers 5 \\
        --weights-dir /tmp/ckpt &
    for pool in prefill decode train envs rewards; do rollfleet worker --pool $pool & done
    python3 examples/python/trainer.py --job quickstart-external --checkpoints /tmp/ckpt

Replace ``optimizer_step`` and ``save_checkpoint`` with a real model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import rollfleet


def optimizer_step(batch: rollfleet.Batch) -> float:
    """Stands in for a policy-gradient step: the advantage-weighted mean of the behaviour
    log-probabilities over the tokens the loss applies to."""
    advantages = batch.advantages()
    total, tokens = 0.0, 0
    for trajectory, advantage in zip(batch, advantages):
        for logprob, mask in zip(trajectory.logprobs(), trajectory.loss_mask()):
            if mask:
                total += -advantage * logprob
                tokens += 1
    return total / max(tokens, 1)


def write_durably(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file, fsync and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(directory: Path, version: int, batch: rollfleet.Batch, loss: float) -> Path:
    """Stands in for saving the model: a small file naming what the step trained on."""
    path = directory / f"policy-v{version}.ckpt"
    body = {
        "version": version,
        "loss": loss,
        "trajectories": [t.id for t in batch],
        "sequences": [batch.first_sequence, batch.last_sequence],
    }
    write_durably(path, json.dumps(body).encode())
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scheduler", default="http://127.0.0.1:7070", help="the scheduler's URL")
    parser.add_argument("--job", required=True, help="the job's name (metadata.name)")
    parser.add_argument("--checkpoints", type=Path, required=True, help="where checkpoints go")
    parser.add_argument("--batch-size", type=int, default=32, help="the job's rolloutBatchSize")
    parser.add_argument("--token-file", type=Path, help="the scheduler's token (first line)")
    parser.add_argument("--tls-ca", type=Path, help="the CA of an https:// scheduler")
    args = parser.parse_args()

    args.checkpoints.mkdir(parents=True, exist_ok=True)
    checkpoints = args.checkpoints.resolve()
    state_path = checkpoints / "state.json"
    state = {"acked_through": 0, "version": 0}
    if state_path.exists():
        state.update(json.loads(state_path.read_text()))
    try:
        token = rollfleet.read_token_file(args.token_file) if args.token_file else None
        tls = rollfleet.TlsConfig(ca=args.tls_ca) if args.tls_ca else None
        with rollfleet.Trainer(
            args.scheduler,
            args.job,
            token=token,
            tls=tls,
            resume_from=state["acked_through"] + 1,
        ) as trainer:
            for batch in trainer.batches(args.batch_size):
                version = max(trainer.version, state["version"]) + 1
                loss = optimizer_step(batch)
                path = save_checkpoint(checkpoints, version, batch, loss)
                trainer.ack(batch)
                trainer.publish(version, path, "rollfleet-example")
                state = {"acked_through": batch.last_sequence, "version": version}
                write_durably(state_path, json.dumps(state).encode())
                print(
                    f"version {version}: {len(batch)} trajectories "
                    f"(sequences {batch.first_sequence}..{batch.last_sequence}), "
                    f"mean reward {sum(batch.rewards) / len(batch):.3f}, loss {loss:.4f}",
                    flush=True,
                )
            stats = trainer.stats
    except rollfleet.RollfleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"done: version {state['version']} published, {stats.delivered} trajectories "
        f"consumed, {stats.reconnects} reconnects",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
