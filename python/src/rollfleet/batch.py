"""What the trainer feed hands a trainer: trajectories with their token ids, behaviour
log-probabilities, loss masks and policy versions, gathered in batches; and GRPO's group
advantages.

A trajectory's token sequence is its turns one after another, each turn's prompt tokens (the
task on turn 0, the environment's observation after that, with the chat template's tokens)
then its action tokens (what the policy sampled). The loss mask is 1 on action tokens only;
the log-probabilities and policy versions are the behaviour policy's, for action tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence, overload

from rollfleet.v1 import rollfleet_pb2 as pb

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

#: The version given to tokens no policy generated (prompts, observations) in per-token
#: version arrays.
NO_VERSION = -1


@dataclass(frozen=True)
class Segment:
    """A run of a turn's action tokens generated under one policy version."""

    policy_version: int
    tokens: int


@dataclass(frozen=True)
class Turn:
    """One turn of a trajectory: what the policy was shown, and what it answered."""

    index: int
    #: The policy version that generated this turn's action; for a turn resumed after an
    #: interrupt, its oldest segment's (what the staleness bound counts).
    policy_version: int
    prompt_tokens: tuple[int, ...]
    action_tokens: tuple[int, ...]
    #: One behaviour log-probability per action token.
    action_logprobs: tuple[float, ...]
    #: One value per token of ``prompt_tokens`` then ``action_tokens``: 1 where the loss
    #: applies (sampled tokens), 0 elsewhere.
    loss_mask: tuple[int, ...]
    #: The versions that generated ``action_tokens``, in order (more than one when a weight
    #: update interrupted the turn and it resumed).
    segments: tuple[Segment, ...]
    #: What the environment answered to this turn's action.
    observation: str
    #: The action the environment applied.
    action: str
    #: The policy's text (empty for an emulated engine, which produces token counts only).
    output: str
    #: True when the tokens and log-probabilities are an emulated engine's synthetic ones.
    emulated: bool

    @property
    def tokens(self) -> tuple[int, ...]:
        """The turn's tokens: prompt then action."""
        return self.prompt_tokens + self.action_tokens

    def action_versions(self) -> list[int]:
        """The policy version of each action token, from the segments."""
        versions: list[int] = []
        for segment in self.segments:
            versions.extend([segment.policy_version] * segment.tokens)
        return versions

    def problems(self) -> list[str]:
        """What is inconsistent in the turn (empty when nothing is): the checks of rollfleet's
        reference trainer."""
        actions = len(self.action_tokens)
        found: list[str] = []
        if len(self.action_logprobs) != actions:
            found.append(f"{len(self.action_logprobs)} log-probabilities for {actions} action tokens")
        if len(self.loss_mask) != len(self.prompt_tokens) + actions:
            found.append(
                f"a loss mask of {len(self.loss_mask)} for "
                f"{len(self.prompt_tokens) + actions} tokens"
            )
        covered = sum(s.tokens for s in self.segments)
        if covered != actions:
            found.append(f"segments cover {covered} of {actions} action tokens")
        if self.segments and min(s.policy_version for s in self.segments) != self.policy_version:
            found.append(
                f"the turn is stamped with version {self.policy_version}, not its oldest "
                "segment's"
            )
        if any(not math.isfinite(lp) or lp > 0.0 for lp in self.action_logprobs):
            found.append("a log-probability above 0 or not a number")
        return found

    @classmethod
    def from_proto(cls, turn: pb.Turn) -> Turn:
        """The turn as the feed carried it."""
        return cls(
            index=turn.index,
            policy_version=turn.policy_version,
            prompt_tokens=tuple(turn.prompt_tokens),
            action_tokens=tuple(turn.action_tokens),
            action_logprobs=tuple(turn.action_logprobs),
            loss_mask=tuple(turn.loss_mask),
            segments=tuple(Segment(s.policy_version, s.tokens) for s in turn.segments),
            observation=turn.observation,
            action=turn.action,
            output=turn.output,
            emulated=turn.emulated,
        )


@dataclass(frozen=True)
class Trajectory:
    """One completed trajectory, as the feed delivered it."""

    #: Its position on the feed: 1, 2, 3, ... with no gaps, per job.
    sequence: int
    #: The scheduler's trajectory number (unique per job).
    id: int
    #: The task instance it belongs to (GRPO's group) and its index in the group.
    group: int
    index: int
    #: How many times the scheduler regenerated it.
    attempt: int
    job: str
    turns: tuple[Turn, ...]
    reward: float
    #: The oldest policy version among its turns.
    oldest_policy_version: int
    #: The task's name in the job spec, and its first user message.
    task: str
    prompt: str

    @classmethod
    def from_proto(cls, t: pb.CompletedTrajectory) -> Trajectory:
        """The trajectory as the feed carried it."""
        ident = t.trajectory
        return cls(
            sequence=t.sequence,
            id=ident.id,
            group=ident.group,
            index=ident.index,
            attempt=ident.attempt,
            job=ident.job,
            turns=tuple(Turn.from_proto(turn) for turn in t.turns),
            reward=t.reward,
            oldest_policy_version=t.oldest_policy_version,
            task=t.task,
            prompt=t.prompt,
        )

    def tokens(self) -> list[int]:
        """Every token, turn after turn (prompt then action of each)."""
        out: list[int] = []
        for turn in self.turns:
            out.extend(turn.prompt_tokens)
            out.extend(turn.action_tokens)
        return out

    def loss_mask(self) -> list[int]:
        """1 on the tokens the loss applies to (the policy's), 0 elsewhere; one per token."""
        out: list[int] = []
        for turn in self.turns:
            out.extend(turn.loss_mask)
        return out

    def logprobs(self) -> list[float]:
        """The behaviour log-probability of each token: the engine's for action tokens, 0.0 for
        prompt and observation tokens."""
        out: list[float] = []
        for turn in self.turns:
            out.extend([0.0] * len(turn.prompt_tokens))
            out.extend(turn.action_logprobs)
        return out

    def versions(self) -> list[int]:
        """The policy version that generated each token (``NO_VERSION`` for prompt tokens)."""
        out: list[int] = []
        for turn in self.turns:
            out.extend([NO_VERSION] * len(turn.prompt_tokens))
            out.extend(turn.action_versions())
        return out

    @property
    def action_token_count(self) -> int:
        """Tokens the policy generated over every turn."""
        return sum(len(turn.action_tokens) for turn in self.turns)

    def problems(self) -> list[str]:
        """What is inconsistent in its turns, each naming the turn (empty when nothing is)."""
        return [
            f"trajectory {self.id} turn {turn.index}: {problem}"
            for turn in self.turns
            for problem in turn.problems()
        ]


def group_advantages(
    rewards: Sequence[float],
    groups: Sequence[int],
    *,
    scale_by_std: bool = True,
    epsilon: float = 1e-6,
) -> list[float]:
    """GRPO's advantages: each reward minus the mean reward of its group, divided by the
    group's standard deviation (plus ``epsilon``) when ``scale_by_std``.

    The standard deviation is the sample one (``n - 1``), as TRL and verl compute it; a group of
    one trajectory has advantage 0. Groups are taken as they appear in ``groups`` (the
    trajectories of a group need not be adjacent).
    """
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} group ids")
    members: dict[int, list[float]] = {}
    for reward, group in zip(rewards, groups):
        members.setdefault(group, []).append(float(reward))
    stats: dict[int, tuple[float, float]] = {}
    for group, values in members.items():
        mean = sum(values) / len(values)
        if len(values) > 1:
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        else:
            std = 0.0
        stats[group] = (mean, std)
    out: list[float] = []
    for reward, group in zip(rewards, groups):
        mean, std = stats[group]
        advantage = float(reward) - mean
        # A group whose rewards are all equal has nothing to scale (every advantage is 0).
        if scale_by_std and std > 0:
            advantage /= std + epsilon
        out.append(advantage)
    return out


@dataclass(frozen=True)
class ArrayBatch:
    """A batch as numpy arrays, right-padded to its longest trajectory (``Batch.to_numpy``).

    Per token, shape ``[batch, max_len]``: ``tokens`` (int64, ``pad_id`` past the end),
    ``loss_mask`` (int8, 0 past the end), ``attention_mask`` (int8, 1 on real tokens),
    ``logprobs`` (float32, behaviour log-probabilities, 0 where the mask is 0) and ``versions``
    (int64, the policy version of each action token, ``NO_VERSION`` elsewhere). Per trajectory,
    shape ``[batch]``: ``lengths``, ``rewards`` (float64), ``groups``, ``sequences`` and
    ``advantages`` (float64, ``group_advantages`` with the batch's defaults).
    """

    tokens: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.int8]
    attention_mask: npt.NDArray[np.int8]
    logprobs: npt.NDArray[np.float32]
    versions: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    rewards: npt.NDArray[np.float64]
    groups: npt.NDArray[np.int64]
    sequences: npt.NDArray[np.int64]
    advantages: npt.NDArray[np.float64]


class Batch(Sequence[Trajectory]):
    """Trajectories consecutive on the feed, handed to the trainer together.

    It is a sequence of ``Trajectory``; ``first_sequence`` and ``last_sequence`` are the feed
    positions it spans (``Trainer.ack(batch)`` acknowledges through ``last_sequence``).
    """

    def __init__(self, trajectories: Sequence[Trajectory]) -> None:
        if not trajectories:
            raise ValueError("a batch holds at least one trajectory")
        self.trajectories: tuple[Trajectory, ...] = tuple(trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    @overload
    def __getitem__(self, index: int) -> Trajectory: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Trajectory, ...]: ...

    def __getitem__(self, index: int | slice) -> Trajectory | tuple[Trajectory, ...]:
        return self.trajectories[index]

    def __repr__(self) -> str:
        return (
            f"Batch({len(self)} trajectories, sequences {self.first_sequence}.."
            f"{self.last_sequence}, {len(set(self.groups))} groups)"
        )

    @property
    def first_sequence(self) -> int:
        """The feed position of its first trajectory."""
        return self.trajectories[0].sequence

    @property
    def last_sequence(self) -> int:
        """The feed position of its last trajectory."""
        return self.trajectories[-1].sequence

    @property
    def rewards(self) -> list[float]:
        """Each trajectory's reward."""
        return [t.reward for t in self.trajectories]

    @property
    def groups(self) -> list[int]:
        """Each trajectory's group (task instance)."""
        return [t.group for t in self.trajectories]

    def advantages(self, *, scale_by_std: bool = True, epsilon: float = 1e-6) -> list[float]:
        """GRPO's group advantages of the batch's trajectories (see ``group_advantages``)."""
        return group_advantages(
            self.rewards, self.groups, scale_by_std=scale_by_std, epsilon=epsilon
        )

    def problems(self) -> list[str]:
        """Every inconsistency in its trajectories' tokens (empty when there is none)."""
        return [p for t in self.trajectories for p in t.problems()]

    def to_numpy(self, *, pad_id: int = 0) -> ArrayBatch:
        """The batch as padded numpy arrays (needs numpy: ``pip install 'rollfleet[numpy]'``)."""
        try:
            import numpy as np
        except ImportError as e:
            raise ImportError(
                "Batch.to_numpy needs numpy: pip install 'rollfleet[numpy]'"
            ) from e
        problems = self.problems()
        if problems:
            raise ValueError(
                "the batch's tokens are inconsistent, they cannot be laid out as arrays: "
                + "; ".join(problems)
            )
        rows = len(self.trajectories)
        lengths = [len(t.tokens()) for t in self.trajectories]
        width = max(lengths) if lengths else 0
        tokens = np.full((rows, width), pad_id, dtype=np.int64)
        loss_mask = np.zeros((rows, width), dtype=np.int8)
        attention = np.zeros((rows, width), dtype=np.int8)
        logprobs = np.zeros((rows, width), dtype=np.float32)
        versions = np.full((rows, width), NO_VERSION, dtype=np.int64)
        for row, t in enumerate(self.trajectories):
            n = lengths[row]
            tokens[row, :n] = t.tokens()
            loss_mask[row, :n] = t.loss_mask()
            attention[row, :n] = 1
            logprobs[row, :n] = t.logprobs()
            versions[row, :n] = t.versions()
        return ArrayBatch(
            tokens=tokens,
            loss_mask=loss_mask,
            attention_mask=attention,
            logprobs=logprobs,
            versions=versions,
            lengths=np.asarray(lengths, dtype=np.int64),
            rewards=np.asarray(self.rewards, dtype=np.float64),
            groups=np.asarray(self.groups, dtype=np.int64),
            sequences=np.asarray([t.sequence for t in self.trajectories], dtype=np.int64),
            advantages=np.asarray(self.advantages(), dtype=np.float64),
        )
