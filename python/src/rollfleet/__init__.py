"""rollfleet's Python SDK.

- ``Trainer``: an external trainer's client of the trainer feed: batches of trajectories (token
  ids, loss masks, behaviour log-probabilities, policy versions, rewards, groups),
  acknowledgements, and publication of new policy versions; reconnects on its own.
- ``rollfleet.env.serve``: a gymnasium-style environment served over rollfleet's remote
  environment protocol (standard library only).
- ``JobClient``: submit a job, read its status, follow it, cancel it.

Every expected failure is a ``RollfleetError`` (see ``rollfleet.errors``).
"""

from rollfleet import env
from rollfleet._connection import TOKEN_ENV, TlsConfig, read_token_file
from rollfleet.batch import (
    NO_VERSION,
    ArrayBatch,
    Batch,
    Segment,
    Trajectory,
    Turn,
    group_advantages,
)
from rollfleet.errors import (
    AuthenticationError,
    ConfigError,
    FeedError,
    InvalidJob,
    JobEnded,
    JobNotFound,
    PublicationRefused,
    RollfleetError,
    SchedulerError,
    SchedulerUnavailable,
    SubscriptionRefused,
    TimedOut,
)
from rollfleet.jobs import JobClient, JobPhase, JobStatus, PoolStatus
from rollfleet.trainer import FeedStats, Publication, Trainer, sha256_file

__version__ = "0.1.0"

__all__ = [
    "NO_VERSION",
    "TOKEN_ENV",
    "ArrayBatch",
    "AuthenticationError",
    "Batch",
    "ConfigError",
    "FeedError",
    "FeedStats",
    "InvalidJob",
    "JobClient",
    "JobEnded",
    "JobNotFound",
    "JobPhase",
    "JobStatus",
    "PoolStatus",
    "Publication",
    "PublicationRefused",
    "RollfleetError",
    "SchedulerError",
    "SchedulerUnavailable",
    "Segment",
    "SubscriptionRefused",
    "TimedOut",
    "TlsConfig",
    "Trainer",
    "Trajectory",
    "Turn",
    "env",
    "group_advantages",
    "read_token_file",
    "sha256_file",
]
