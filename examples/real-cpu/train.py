#!/usr/bin/env python3
"""The trainer of the real-model job: GRPO on SmolLM2-135M-Instruct, on CPU, through rollfleet.

Written against the Python SDK only (``rollfleet.Trainer``): each RL step it takes a batch of
trajectories from the scheduler's feed (token ids, loss masks, the engines' behaviour
log-probabilities, rewards), recomputes the current policy's log-probabilities of the sampled
tokens with its own forward pass (``trainer/model.py``), takes one GRPO step on the last layers'
MLP and the final norm (``trainer/grpo.py``), writes the new weights as a GGUF file the engines
load (``trainer/write_gguf.py``), acknowledges the batch and publishes the version. A report
(JSON) says, per step: the mean reward, the trainer's and the engines' log-probabilities of the
sampled tokens (how far apart), a fixed probe's log-probability under the new weights, and the
time taken.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "trainer"))

import rollfleet  # noqa: E402
from grpo import Batch, GRPOConfig, GRPOTrainer  # noqa: E402
from model import load_gguf  # noqa: E402
from write_gguf import write_updated_gguf  # noqa: E402

# A fixed probe: its log-probability under each version shows the weights moving.
PROBE = [1, 4093, 198, 34, 2, 198, 1, 520, 9531, 198, 37]


def to_batch(batch: rollfleet.Batch) -> tuple[Batch, list[list[tuple[int, float]]]]:
    """The feed's trajectories as the trainer core's padded arrays, and per trajectory the
    (position, behaviour log-probability) of each sampled token."""
    rows: list[list[int]] = []
    masks: list[list[int]] = []
    behaviour: list[list[float]] = []
    sampled: list[list[tuple[int, float]]] = []
    for t in batch.trajectories:
        tokens: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        for turn in t.turns:
            tokens += list(turn.prompt_tokens)
            mask += [0] * len(turn.prompt_tokens)
            lps += [0.0] * len(turn.prompt_tokens)
            tokens += list(turn.action_tokens)
            mask += [1] * len(turn.action_tokens)
            lps += list(turn.action_logprobs)
        rows.append(tokens)
        masks.append(mask)
        behaviour.append(lps)
        sampled.append([(i, lp) for i, (m, lp) in enumerate(zip(mask, lps)) if m])
    width = max(len(r) for r in rows)

    def padded(rows: list[list[int]] | list[list[float]], value: float) -> list[list[float]]:
        return [[float(x) for x in row] + [value] * (width - len(row)) for row in rows]

    return (
        Batch(
            tokens=np.array(padded(rows, 0), dtype=np.int32),
            loss_mask=np.array(padded(masks, 0), dtype=np.float32),
            behaviour_lp=np.array(padded(behaviour, 0.0), dtype=np.float32),
            rewards=np.array([t.reward for t in batch.trajectories], dtype=np.float32),
            group_ids=np.array([t.group for t in batch.trajectories], dtype=np.int64),
        ),
        sampled,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scheduler", required=True)
    parser.add_argument("--job", default="real-cpu")
    parser.add_argument("--batch", type=int, default=8, help="the job's rolloutBatchSize")
    parser.add_argument("--steps", type=int, default=3, help="the job's steps")
    parser.add_argument("--checkpoints", required=True, type=Path)
    parser.add_argument("--report", required=True, type=Path)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    cfg, params, reader = load_gguf()
    trainer_core = GRPOTrainer(cfg, params, gc=GRPOConfig(lr=args.lr))
    probe = np.array([PROBE], dtype=np.int32)
    probe_initial = float(trainer_core.logprobs(probe).sum())
    steps: list[dict[str, Any]] = []
    with rollfleet.Trainer(args.scheduler, args.job) as feed:
        for step in range(args.steps):
            started = time.monotonic()
            batch = feed.next_batch(args.batch, timeout=1800)
            if batch is None:
                break
            arrays, sampled = to_batch(batch)
            result = trainer_core.step(arrays)
            # How far the trainer's log-probabilities of the sampled tokens are from the
            # engines' (computed before this step's update, so under the same weights).
            gaps = [
                abs(float(result.current_lp[b, i]) - lp)
                for b, tokens in enumerate(sampled)
                for i, lp in tokens
            ]
            path = args.checkpoints / f"policy-v{step + 1}.gguf"
            write_updated_gguf(reader, str(path), trainer_core.updated_tensors())
            feed.ack(batch)
            feed.publish(step + 1, path, "gguf")
            probe_lp = float(trainer_core.logprobs(probe).sum())
            steps.append(
                {
                    "version": step + 1,
                    "trajectories": [t.id for t in batch.trajectories],
                    # Every turn as the feed carried it: to check against the engines' logs.
                    "turns": [
                        {
                            "trajectory": t.id,
                            "versions": [s.policy_version for s in turn.segments],
                            "action_tokens": list(turn.action_tokens),
                            "logprobs": list(turn.action_logprobs),
                        }
                        for t in batch.trajectories
                        for turn in t.turns
                    ],
                    "rewards": [t.reward for t in batch.trajectories],
                    "mean_reward": float(arrays.rewards.mean()),
                    "loss": result.loss,
                    "logprob_gap_mean": float(np.mean(gaps)) if gaps else None,
                    "logprob_gap_max": float(np.max(gaps)) if gaps else None,
                    "probe_logprob": probe_lp,
                    "seconds": time.monotonic() - started,
                }
            )
            print(
                f"step {step + 1}/{args.steps}: mean reward {steps[-1]['mean_reward']:.2f}, "
                f"|trainer - engine| log-probability mean {steps[-1]['logprob_gap_mean']:.3f}, "
                f"probe {probe_lp:.3f}, {steps[-1]['seconds']:.1f} s",
                flush=True,
            )
    tmp = args.report.with_suffix(".tmp")
    tmp.write_text(json.dumps({"probe_initial": probe_initial, "steps": steps}, indent=1))
    os.replace(tmp, args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
