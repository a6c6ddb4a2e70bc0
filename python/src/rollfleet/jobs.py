"""``JobClient``: submit a job to a scheduler, read its status, follow it, cancel it.

It mirrors ``rollfleet job submit|status|watch|cancel`` (``scheduler/cli/src/commands/job.rs``):
a scheduler runs one job, the one it was started with or the first valid one submitted to it;
submitting that job again answers with its name and changes nothing, another job is refused.
Unlike the CLI, the SDK does not validate a job before sending it: the scheduler does, and an
invalid job is refused with its problems (``InvalidJob``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Iterator, TypeGuard

import grpc

from rollfleet._connection import Connection, PathLike, TlsConfig, cancel, rpc_error
from rollfleet.errors import (
    ConfigError,
    InvalidJob,
    RollfleetError,
    SchedulerError,
    SchedulerUnavailable,
    TimedOut,
)
from rollfleet.v1 import rollfleet_pb2 as pb

# Job files are a few kilobytes; the scheduler's own reader stops well before this.
_MAX_JOB_BYTES = 4 * 1024 * 1024


class JobPhase(str, Enum):
    """A job's phase, named as the scheduler and the CLI name it."""

    UNSPECIFIED = "Unspecified"
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def ended(self) -> bool:
        """Whether a job in this phase is over: succeeded, failed or cancelled."""
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED)

    @classmethod
    def from_proto(cls, phase: int) -> JobPhase:
        """The phase of a ``JobStatus.phase`` value (an unknown number is ``UNSPECIFIED``)."""
        return _PHASES.get(phase, JobPhase.UNSPECIFIED)


_PHASES: dict[int, JobPhase] = {
    int(pb.JOB_PHASE_UNSPECIFIED): JobPhase.UNSPECIFIED,
    int(pb.JOB_PHASE_PENDING): JobPhase.PENDING,
    int(pb.JOB_PHASE_RUNNING): JobPhase.RUNNING,
    int(pb.JOB_PHASE_SUCCEEDED): JobPhase.SUCCEEDED,
    int(pb.JOB_PHASE_FAILED): JobPhase.FAILED,
    int(pb.JOB_PHASE_CANCELLED): JobPhase.CANCELLED,
}


@dataclass(frozen=True)
class PoolStatus:
    """One pool of the job: its workers and load."""

    pool: str
    workers: int
    #: Share of the last interval the pool was busy, 0..1.
    busy: float
    queued_stages: int


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands, as ``rollfleet job status`` shows it."""

    job: str
    phase: JobPhase
    policy_version: int
    rl_step: int
    rl_steps_total: int
    trajectories_in_flight: int
    trajectories_completed: int
    trajectories_trained: int
    pools: tuple[PoolStatus, ...]
    #: The scheduler's message (why a job failed, for instance).
    message: str

    @property
    def ended(self) -> bool:
        """Whether the job is over."""
        return self.phase.ended

    @classmethod
    def from_proto(cls, status: pb.JobStatus) -> JobStatus:
        """The status as the scheduler sent it."""
        return cls(
            job=status.job,
            phase=JobPhase.from_proto(status.phase),
            policy_version=status.policy_version,
            rl_step=status.rl_step,
            rl_steps_total=status.rl_steps_total,
            trajectories_in_flight=status.trajectories_in_flight,
            trajectories_completed=status.trajectories_completed,
            trajectories_trained=status.trajectories_trained,
            pools=tuple(
                PoolStatus(p.pool, p.workers, p.busy, p.queued_stages) for p in status.pools
            ),
            message=status.message,
        )


def _is_yaml(job: str | os.PathLike[str]) -> TypeGuard[str]:
    """Whether ``job`` is the YAML itself (a ``str`` of several lines, or an empty one) rather
    than the path of its file."""
    return isinstance(job, str) and ("\n" in job or not job.strip())


def job_dir(job: str | os.PathLike[str]) -> str:
    """The absolute directory of ``job``'s file, against which the scheduler resolves the
    relative CSV paths it names; empty for a job given as its YAML (they are then resolved
    against the scheduler's working directory)."""
    if _is_yaml(job):
        return ""
    return os.path.dirname(os.path.abspath(os.fspath(job)))


def read_job(job: str | os.PathLike[str]) -> str:
    """The YAML of ``job``: a path (``os.PathLike``, or a ``str`` of one line) is read; a
    ``str`` of several lines is taken as the YAML itself."""
    if _is_yaml(job):
        if not job.strip():
            raise ConfigError("job: empty (pass the job's YAML or the path of its file)")
        return job
    path = os.fspath(job)
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_JOB_BYTES + 1)
    except FileNotFoundError as e:
        raise ConfigError(
            f"job file {path}: does not exist (pass the job's YAML itself, or the path of "
            "its file)"
        ) from e
    except OSError as e:
        raise ConfigError(f"job file {path}: {e.strerror or e}") from e
    if len(data) > _MAX_JOB_BYTES:
        raise ConfigError(f"job file {path}: over {_MAX_JOB_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"job file {path}: not UTF-8") from e


class JobClient:
    """A client of a scheduler's ``JobService``.

    ``scheduler_url`` is ``http://HOST:PORT`` (or ``https://`` with ``tls``); ``token`` is the
    scheduler's bearer token (default: ``$ROLLFLEET_TOKEN`` when set). Every call but ``watch``
    gives up after ``timeout`` seconds. Errors are ``RollfleetError`` subclasses:
    ``SchedulerUnavailable``, ``AuthenticationError``, ``JobNotFound``, ``InvalidJob``.
    """

    def __init__(
        self,
        scheduler_url: str,
        token: str | None = None,
        tls: TlsConfig | None = None,
        *,
        timeout: float = 10.0,
    ) -> None:
        if not timeout > 0:
            raise ConfigError(f"timeout {timeout}: must be a positive number of seconds")
        self._conn = Connection(scheduler_url, token, tls)
        self._timeout = timeout

    @property
    def scheduler_url(self) -> str:
        """The scheduler's URL."""
        return self._conn.url

    def __enter__(self) -> JobClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Closes the connection."""
        self._conn.close()

    def submit(self, job: str | PathLike) -> str:
        """Submits a job (its YAML, or the path of its file); returns the job's name.

        A job given by the path of its file has the relative CSV paths it names resolved against
        that file's directory, which the scheduler must see at the same path (a shared file
        system); a job given as its YAML, against the scheduler's working directory.

        Submitting the job the scheduler already runs answers with its name and changes nothing.
        ``InvalidJob`` when the scheduler refuses it (an invalid spec, with its problems; or
        another job already running there).
        """
        yaml = read_job(job)
        try:
            answer = self._conn.submit(
                pb.SubmitJobRequest(job_yaml=yaml, request_id="", job_dir=job_dir(job)),
                timeout=self._timeout,
            )
        except grpc.RpcError as e:
            error = rpc_error(self._conn.url, "submit", e)
            if isinstance(error, SchedulerError) and e.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            ):
                raise InvalidJob(str(error), code=error.code, reason=error.reason) from None
            raise error from None
        return answer.job

    def status(self, job: str) -> JobStatus:
        """The job's status now. ``JobNotFound`` when the scheduler runs another job (or none
        yet): the message names the one it runs."""
        try:
            return JobStatus.from_proto(self._conn.status(job, timeout=self._timeout))
        except grpc.RpcError as e:
            raise rpc_error(self._conn.url, "status", e) from None

    def cancel(self, job: str) -> JobStatus:
        """Cancels the job (its workers are drained; nothing trained is lost); returns its
        status after the cancel."""
        try:
            answer = self._conn.cancel(job, timeout=self._timeout)
        except grpc.RpcError as e:
            raise rpc_error(self._conn.url, "cancel", e) from None
        return JobStatus.from_proto(answer.status)

    def watch(self, job: str, *, timeout: float | None = None) -> Iterator[JobStatus]:
        """The job's status on every change, starting with the current one, until it ends.

        ``timeout`` bounds the whole watch (``TimedOut`` past it). The scheduler going away
        before the job ends is ``SchedulerUnavailable``.
        """
        call = self._conn.watch(job, timeout=timeout)
        ended = False
        try:
            for message in call:
                status = JobStatus.from_proto(message)
                yield status
                if status.ended:
                    ended = True
                    return
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
                raise TimedOut(
                    f"watch: job {job} did not end within {timeout} s"
                ) from None
            raise rpc_error(self._conn.url, "watch", e) from None
        finally:
            if not ended:
                cancel(call)
        raise SchedulerUnavailable(
            f"watch: the scheduler at {self._conn.url} ended the watch of job {job} before "
            "the job ended"
        )

    def wait(self, job: str, *, timeout: float) -> JobStatus:
        """Follows the job until it ends and returns its last status (whatever the phase)."""
        last: JobStatus | None = None
        for status in self.watch(job, timeout=timeout):
            last = status
        if last is None:  # pragma: no cover - watch returns only after an ended status
            raise RollfleetError(f"watch: no status of job {job}")
        return last
