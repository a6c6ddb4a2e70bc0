"""The exceptions the SDK raises: every expected failure is one of these, with a message that
names what went wrong (the scheduler's URL, the field, the scheduler's own reason).

``RollfleetError`` is the base of all of them, so ``except rollfleet.RollfleetError`` catches
every condition a trainer or a tool should report rather than crash on.
"""

from __future__ import annotations


class RollfleetError(Exception):
    """Base class of every error the SDK raises on purpose."""


class ConfigError(RollfleetError, ValueError):
    """A setting is wrong before anything is sent: a URL, a token, a TLS file, a job file."""


class SchedulerUnavailable(RollfleetError):
    """The scheduler cannot be reached (not listening, gone, TLS handshake refused) or did not
    come back in time after the connection broke."""


class SchedulerError(RollfleetError):
    """The scheduler answered a call with an error.

    ``code`` is the gRPC status code's name (``"NOT_FOUND"``, ``"INVALID_ARGUMENT"``, ...) and
    ``reason`` the scheduler's own message.
    """

    def __init__(self, message: str, *, code: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


class AuthenticationError(SchedulerError):
    """The scheduler refused the call for want of its token (``Unauthenticated``)."""


class JobNotFound(SchedulerError):
    """The scheduler does not run the job named (it runs another one, or none yet)."""


class InvalidJob(SchedulerError):
    """The scheduler refused a submitted job: its spec is invalid (the reason lists the
    problems), or the scheduler already runs another job."""


class SubscriptionRefused(SchedulerError):
    """The scheduler refused the trainer feed subscription: an unknown job, another trainer
    already reading the job's feed (one trainer reads a job's feed), a ``resume_from`` past
    what was ever sent, or before what was acknowledged (those items are gone)."""


class FeedError(RollfleetError):
    """The trainer feed broke its contract or was used against it: a gap in the sequence
    numbers, an acknowledgement the scheduler refused, a window too small for the batch asked."""


class PublicationRefused(RollfleetError):
    """The scheduler refused a published version; nothing changed on its side.

    ``version`` is the version refused and ``reason`` the scheduler's reason, which names the
    field (``publish.uri``, ``publish.sha256``, ...) or the rule (a skipped version, a step not
    handed out yet).
    """

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"the scheduler refused version {version}: {reason}")
        self.version = version
        self.reason = reason


class JobEnded(RollfleetError):
    """The job ended without succeeding (failed or cancelled) while the trainer waited on it.

    ``phase`` is the job's phase name (``"Failed"``, ``"Cancelled"``) and ``reason`` the
    scheduler's status message.
    """

    def __init__(self, job: str, phase: str, reason: str) -> None:
        said = f": {reason}" if reason else ""
        super().__init__(f"job {job} ended {phase}{said}")
        self.job = job
        self.phase = phase
        self.reason = reason


class TimedOut(RollfleetError, TimeoutError):
    """A bounded wait ran out (a batch, a publication's answer, a job status)."""
