"""Batches without a scheduler: trajectories built from the feed's messages, their token
layout, numpy arrays, consistency checks and GRPO's group advantages."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollfleet import NO_VERSION, Batch, Trajectory, group_advantages
from rollfleet.v1 import rollfleet_pb2 as pb


def turn(
    index: int,
    prompt: list[int],
    action: list[int],
    segments: list[tuple[int, int]],
    *,
    mask: bytes | None = None,
    logprobs: list[float] | None = None,
    stamp: int | None = None,
) -> pb.Turn:
    # The scheduler stamps a turn with its oldest segment's version.
    oldest = min(v for v, _ in segments) if segments else 0
    return pb.Turn(
        index=index,
        policy_version=oldest if stamp is None else stamp,
        prompt_tokens=prompt,
        action_tokens=action,
        action_logprobs=logprobs if logprobs is not None else [-0.5] * len(action),
        loss_mask=mask if mask is not None else bytes([0] * len(prompt) + [1] * len(action)),
        segments=[pb.Segment(policy_version=v, tokens=n) for v, n in segments],
        observation=f"observation {index}",
        action=f"action {index}",
    )


def trajectory(sequence: int, group: int, reward: float, turns: list[pb.Turn]) -> Trajectory:
    return Trajectory.from_proto(
        pb.CompletedTrajectory(
            sequence=sequence,
            trajectory=pb.TrajectoryId(job="j", group=group, index=sequence % 2, id=100 + sequence),
            turns=turns,
            reward=reward,
            oldest_policy_version=1,
            task="t",
            prompt="p",
        )
    )


def two_trajectories() -> Batch:
    # The first: two turns, the second interrupted by a weight update (versions 1 then 2).
    first = trajectory(
        5,
        7,
        1.0,
        [turn(0, [1, 2], [3], [(1, 1)]), turn(1, [4], [5, 6, 7], [(1, 2), (2, 1)])],
    )
    second = trajectory(6, 7, 0.0, [turn(0, [8], [9, 10], [(2, 2)])])
    return Batch([first, second])


def test_a_trajectory_lays_out_its_turns_prompt_then_action_with_masks_logprobs_and_versions() -> None:
    t = two_trajectories()[0]
    assert t.tokens() == [1, 2, 3, 4, 5, 6, 7]
    assert t.loss_mask() == [0, 0, 1, 0, 1, 1, 1]
    assert t.logprobs() == [0.0, 0.0, -0.5, 0.0, -0.5, -0.5, -0.5]
    assert t.versions() == [NO_VERSION, NO_VERSION, 1, NO_VERSION, 1, 1, 2]
    assert t.turns[1].action_versions() == [1, 1, 2]
    assert t.action_token_count == 4
    assert (t.id, t.group, t.sequence, t.job) == (105, 7, 5, "j")
    assert t.problems() == []


def test_a_batch_spans_its_feed_positions_and_acts_as_a_sequence() -> None:
    batch = two_trajectories()
    assert (batch.first_sequence, batch.last_sequence) == (5, 6)
    assert len(batch) == 2 and batch[1].sequence == 6 and len(batch[0:1]) == 1
    assert batch.rewards == [1.0, 0.0] and batch.groups == [7, 7]
    assert "sequences 5..6" in repr(batch)
    with pytest.raises(ValueError):
        Batch([])


def test_to_numpy_pads_to_the_longest_trajectory_and_keeps_every_token_aligned() -> None:
    arrays = two_trajectories().to_numpy(pad_id=-9)
    assert arrays.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, -9, -9, -9, -9]]
    assert arrays.loss_mask.tolist() == [[0, 0, 1, 0, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0]]
    assert arrays.attention_mask.tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    assert arrays.versions.tolist() == [
        [NO_VERSION, NO_VERSION, 1, NO_VERSION, 1, 1, 2],
        [NO_VERSION, 2, 2] + [NO_VERSION] * 4,
    ]
    assert arrays.logprobs.dtype == np.float32
    assert np.allclose(arrays.logprobs[arrays.loss_mask == 1], -0.5)
    assert (arrays.logprobs[arrays.loss_mask == 0] == 0).all()
    assert arrays.lengths.tolist() == [7, 3]
    assert arrays.sequences.tolist() == [5, 6]
    assert arrays.groups.tolist() == [7, 7]
    # One group of two, rewards 1 and 0: mean 0.5, sample std sqrt(0.5).
    assert np.allclose(arrays.advantages, [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)])


def test_inconsistent_tokens_are_reported_per_turn_and_refused_as_arrays() -> None:
    bad = trajectory(
        1,
        1,
        0.0,
        [
            turn(0, [1], [2, 3], [(1, 2)], logprobs=[-0.1]),
            turn(1, [4], [5], [(1, 1)], mask=bytes([0])),
            turn(2, [6], [7, 8], [(1, 1)]),
            turn(3, [9], [10], [(1, 1)], logprobs=[0.5]),
            turn(4, [11], [12, 13], [(1, 1), (2, 1)], stamp=2),
        ],
    )
    problems = bad.problems()
    assert problems == [
        "trajectory 101 turn 0: 1 log-probabilities for 2 action tokens",
        "trajectory 101 turn 1: a loss mask of 1 for 2 tokens",
        "trajectory 101 turn 2: segments cover 1 of 2 action tokens",
        "trajectory 101 turn 3: a log-probability above 0 or not a number",
        "trajectory 101 turn 4: the turn is stamped with version 2, not its oldest segment's",
    ]
    with pytest.raises(ValueError, match="turn 0: 1 log-probabilities"):
        Batch([bad]).to_numpy()


def test_group_advantages_center_each_group_and_scale_by_its_sample_std() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 3.0]
    groups = [7, 7, 7, 7, 9, 9, 4]
    std7 = math.sqrt(4 * 0.25 / 3)
    scaled = group_advantages(rewards, groups, epsilon=0.0)
    assert scaled[:4] == pytest.approx([0.5 / std7, -0.5 / std7, -0.5 / std7, 0.5 / std7])
    # Equal rewards and a lone trajectory carry no signal.
    assert scaled[4:] == [0.0, 0.0, 0.0]
    centered = group_advantages(rewards, groups, scale_by_std=False)
    assert centered == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]
    # Members of a group need not be adjacent.
    assert group_advantages([1.0, 5.0, 3.0], [1, 2, 1], scale_by_std=False) == [-1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="3 rewards for 2 group ids"):
        group_advantages([1.0, 2.0, 3.0], [1, 2])
