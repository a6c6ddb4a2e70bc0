"""``Trainer``: an external trainer's client of the trainer feed (``TrainerFeed.Feed``).

A job with ``rl.trainer: external`` hands its batches to the feed instead of training them. A
trainer subscribes, consumes trajectories in batches, acknowledges what it has durably
consumed (``ack_through``), and publishes each new policy version on the same stream once its
weights are durable (``PublishWeights``); the scheduler answers every publication
(``PublicationAnswer``) and moves the job's policy version when it accepts one.

The protocol behaviour is that of the reference trainer (``rollfleet train``,
``scheduler/cli/src/commands/train.rs``):

- A background thread owns the bidirectional stream. It subscribes with a window (the items the
  scheduler may send ahead of acknowledgements; by default twice the batch size) and with
  ``resume_from``, the first sequence not acknowledged yet.
- When the stream breaks (a scheduler restarted on its journal, a network cut), it subscribes
  again from the first unacknowledged sequence. The scheduler then sends again what was not
  acknowledged; the thread drops every sequence already received, so the caller gets each
  trajectory exactly once, in feed order. A gap in the sequence is an error, never skipped.
- A publication sent and not answered when the stream breaks is sent again on the next stream;
  an answer that the version is "already published" then means the first one was taken.
- An acknowledgement never names a sequence the current stream has not carried yet (the
  scheduler would cut the stream for it); one made while disconnected travels as the next
  subscription's ``resume_from``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Iterator

import grpc

from rollfleet._connection import Connection, PathLike, TlsConfig, cancel, rpc_error
from rollfleet.batch import Batch, Trajectory
from rollfleet.errors import (
    AuthenticationError,
    ConfigError,
    FeedError,
    JobEnded,
    PublicationRefused,
    RollfleetError,
    SchedulerError,
    SchedulerUnavailable,
    SubscriptionRefused,
    TimedOut,
)
from rollfleet.jobs import JobPhase, JobStatus
from rollfleet.v1 import rollfleet_pb2 as pb

log = logging.getLogger("rollfleet.trainer")

#: The window the scheduler uses when a trainer asks for none.
DEFAULT_WINDOW = 256
_MAX_WINDOW = 2**32 - 1
# What the scheduler says when a trainer subscribes before any job was submitted to it: worth
# waiting for (a trainer may start before `rollfleet job submit`).
_NO_JOB_YET = "no job was submitted"
# The scheduler's reason when a version was published already.
_ALREADY_PUBLISHED = "already published"
# A full window with no batch in it is an error only once the stream has been quiet this long
# (a group's completion follows its last trajectory as a separate item).
_STALL_GRACE = 1.0
# How the scheduler ends the feed of a job that failed or was cancelled (ABORTED).
_JOB_ENDED = re.compile(r"job (\S+) ended (\w+)")
# gRPC codes after which subscribing again cannot help.
_FATAL_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED,
)


@dataclass(frozen=True)
class Publication:
    """A version the scheduler accepted."""

    version: int
    uri: str
    format: str
    #: The SHA-256 sent (hex; empty when none was, e.g. for a directory).
    sha256: str
    #: The size sent (0: left to the scheduler).
    bytes: int
    #: True when the publication was sent again after the stream broke and the scheduler said
    #: the version was already published: the first sending was taken.
    already_published: bool = False


@dataclass(frozen=True)
class FeedStats:
    """What the feed thread has seen so far."""

    #: Subscriptions after the first (the stream broke and was opened again).
    reconnects: int
    #: Trajectories received more than once (sent again after a reconnect) and dropped.
    duplicates_dropped: int
    #: Distinct trajectories received, and handed to the caller.
    received: int
    delivered: int
    #: Every sequence up to this one is acknowledged.
    acked_through: int


@dataclass
class _Pending:
    """A publication waiting for its answer."""

    request: pb.PublishWeights
    #: The stream it was last sent on (0: not sent yet).
    sent_on: int = 0
    resent: bool = False
    answer: pb.PublicationAnswer | None = None


class _Requests:
    """The messages of one feed stream, as the iterator grpc reads from; ``close`` ends it."""

    _END = object()

    def __init__(self) -> None:
        self._queue: collections.deque[object] = collections.deque()
        self._ready = threading.Condition()

    def put(self, message: pb.TrainerFeedRequest) -> None:
        with self._ready:
            self._queue.append(message)
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._queue.append(self._END)
            self._ready.notify()

    def __iter__(self) -> Iterator[pb.TrainerFeedRequest]:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                item = self._queue.popleft()
            if item is self._END:
                return
            assert isinstance(item, pb.TrainerFeedRequest)
            yield item


class _Stop(Exception):
    """The feed thread has nothing left to do (the job ended, or every version is published)."""


def _local_path(uri: str) -> str | None:
    """The local path a ``file://`` URI or an absolute path names (as the scheduler reads it)."""
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        return rest if scheme == "file" else None
    return uri if os.path.isabs(uri) else None


def sha256_file(path: PathLike) -> str:
    """The SHA-256 of a file's contents, lower-case hex (what ``PublishWeights.sha256`` holds)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class Trainer:
    """An external trainer's connection to the trainer feed of ``job``.

    ``scheduler_url`` is ``http://HOST:PORT`` (``https://`` with ``tls``); ``token`` the
    scheduler's bearer token (default: ``$ROLLFLEET_TOKEN`` when set). ``window`` is the items
    the scheduler may send ahead of acknowledgements (default: twice the first batch size
    asked for). ``resume_from`` is the first sequence not durably consumed, for a trainer
    restarted with its own record of what it acknowledged (``acked_through + 1``); a fresh
    trainer leaves it at 1. ``connect_timeout`` bounds the wait for the first subscription,
    ``reconnect_for`` the wait for the scheduler to come back after the stream broke;
    ``poll_interval`` is how often, while waiting for trajectories, the job's status is read
    (to notice that it ended).

    Typical use::

        with Trainer("http://127.0.0.1:7070", "quickstart-external") as trainer:
            for batch in trainer.batches(32):
                ...                                   # an optimizer step on the batch
                path = save_checkpoint(...)           # durably
                trainer.ack(batch)
                trainer.publish(trainer.version + 1, path, "safetensors")

    One thread consumes (``batches``, ``next_batch``, ``ack``, ``publish``); the stream is the
    background thread's. Every expected failure is a ``RollfleetError``.
    """

    def __init__(
        self,
        scheduler_url: str,
        job: str,
        token: str | None = None,
        tls: TlsConfig | None = None,
        *,
        window: int | None = None,
        resume_from: int = 1,
        connect_timeout: float = 30.0,
        reconnect_for: float = 60.0,
        poll_interval: float = 2.0,
    ) -> None:
        if not job:
            raise ConfigError("job: empty (the job's metadata.name)")
        if window is not None and not 1 <= window <= _MAX_WINDOW:
            raise ConfigError(f"window {window}: must be between 1 and {_MAX_WINDOW}")
        if resume_from < 0:
            raise ConfigError(f"resume_from {resume_from}: must be 0 or more")
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("reconnect_for", reconnect_for),
            ("poll_interval", poll_interval),
        ):
            if not value > 0:
                raise ConfigError(f"{name} {value}: must be a positive number of seconds")
        self.job = job
        self._conn = Connection(scheduler_url, token, tls)
        self._window = window
        self._connect_timeout = connect_timeout
        self._reconnect_for = reconnect_for
        self._poll_interval = poll_interval

        self._lock = threading.Condition()
        # Everything below is guarded by _lock.
        self._buffer: collections.deque[Trajectory] = collections.deque()
        # Sequences after which a group is complete.
        self._boundaries: set[int] = set()
        self._resume_from = max(resume_from, 1)
        # The next sequence expected (None until the first one arrives).
        self._next: int | None = None
        self._delivered_through = self._resume_from - 1
        self._acked = self._resume_from - 1
        # The stream in use: its number, its outgoing messages, the ack sent on it, the highest
        # sequence it carried, whether it carried anything.
        self._stream = 0
        self._requests: _Requests | None = None
        self._call: grpc.CallIterator[pb.TrainerFeedItem] | None = None
        self._ack_sent = self._acked
        self._stream_seen = 0
        self._stream_items = 0
        self._last_on_stream = 0
        self._last_item_at = time.monotonic()
        self._pending: _Pending | None = None
        self._failure: RollfleetError | None = None
        self._ended: JobStatus | None = None
        self._version: int | None = None
        self._steps_total: int | None = None
        self._reconnects = 0
        self._duplicates = 0
        self._received = 0
        self._delivered = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._publish_lock = threading.Lock()

    # ------------------------------------------------------------------ public API

    def __enter__(self) -> Trainer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def scheduler_url(self) -> str:
        """The scheduler's URL."""
        return self._conn.url

    @property
    def version(self) -> int:
        """The job's policy version as this trainer knows it: the last version accepted, or
        the job's version when the feed was first opened (0 before anything is known)."""
        with self._lock:
            return self._version or 0

    @property
    def acked_through(self) -> int:
        """Every sequence up to this one is acknowledged (keep it to resume a restarted
        trainer with ``resume_from=acked_through + 1``)."""
        with self._lock:
            return self._acked

    @property
    def stats(self) -> FeedStats:
        """Counts of what the feed thread has seen."""
        with self._lock:
            return FeedStats(
                reconnects=self._reconnects,
                duplicates_dropped=self._duplicates,
                received=self._received,
                delivered=self._delivered,
                acked_through=self._acked,
            )

    def batches(
        self, size: int, whole_groups: bool = True, *, timeout: float | None = None
    ) -> Iterator[Batch]:
        """Batches of ``size`` trajectories, in feed order, until the job is over.

        With ``whole_groups`` a batch ends only where a group (task instance) is complete: it
        holds ``size`` trajectories when ``size`` is a multiple of the job's group size (the
        usual case, e.g. ``rolloutBatchSize``), else the first group boundary after ``size``.
        The iteration ends when every version of the job is published, or the job succeeded
        (a last batch may then be smaller); ``JobEnded`` when it failed or was cancelled.
        ``timeout`` bounds the wait for each batch (``TimedOut``).
        """
        while True:
            batch = self.next_batch(size, whole_groups, timeout=timeout)
            if batch is None:
                return
            yield batch

    def next_batch(
        self, size: int, whole_groups: bool = True, *, timeout: float | None = None
    ) -> Batch | None:
        """The next batch (see ``batches``), or ``None`` when the job is over."""
        if size < 1:
            raise ValueError(f"size {size}: a batch holds at least one trajectory")
        window = self._start(self._window or min(2 * size, _MAX_WINDOW))
        if size > window:
            raise ConfigError(
                f"size {size}: larger than the feed's window of {window} (the scheduler sends "
                "at most that many trajectories ahead of acknowledgements)"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        next_poll = time.monotonic() + self._poll_interval
        with self._lock:
            while True:
                # The job's end says more than the scheduler going away with it.
                if self._ended is not None and self._ended.phase != JobPhase.SUCCEEDED:
                    raise JobEnded(self.job, self._ended.phase.value, self._ended.message)
                if self._failure is not None:
                    raise self._failure
                count = self._cut(size, whole_groups)
                if count:
                    return self._take(count)
                if self._over():
                    return self._take(len(self._buffer)) if self._buffer else None
                outstanding = (self._next - 1 if self._next is not None else 0) - self._acked
                idle = time.monotonic() - self._last_item_at
                if outstanding >= window and idle > _STALL_GRACE:
                    held = self._delivered_through - self._acked
                    raise FeedError(
                        f"the feed's window of {window} is full ({held} trajectories handed out "
                        f"and not acknowledged, {len(self._buffer)} waiting) and holds no "
                        + ("batch of whole groups" if whole_groups else f"batch of {size}")
                        + ": acknowledge consumed batches (Trainer.ack), or use a larger window"
                    )
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimedOut(
                        f"no batch of {size} trajectories of job {self.job} within {timeout} s "
                        f"({len(self._buffer)} waiting)"
                    )
                if now >= next_poll:
                    self._lock.release()
                    try:
                        self._poll_status()
                    finally:
                        self._lock.acquire()
                    next_poll = time.monotonic() + self._poll_interval
                    continue
                wait = next_poll - now
                if outstanding >= window:
                    wait = min(wait, _STALL_GRACE)
                if deadline is not None:
                    wait = min(wait, deadline - now)
                self._lock.wait(max(wait, 0.0))

    def ack(self, batch: Batch | int) -> None:
        """Acknowledges every trajectory through ``batch`` (or through a sequence number):
        they are consumed and will not be sent again. Call it once the batch is durably
        consumed (after the optimizer step, with its checkpoint written)."""
        through = batch.last_sequence if isinstance(batch, Batch) else int(batch)
        with self._lock:
            if through > self._delivered_through:
                raise FeedError(
                    f"ack through {through}: only sequences through {self._delivered_through} "
                    "were handed out"
                )
            if through <= self._acked:
                return
            self._acked = through
            self._send_ack()

    def publish(
        self,
        version: int,
        uri: PathLike,
        format: str,
        sha256: str | None = None,
        *,
        size: int | None = None,
        timeout: float = 120.0,
    ) -> Publication:
        """Publishes ``version`` (exactly one more than the last) once its weights are durable
        at ``uri`` (``file:///ABS/PATH`` or an absolute path, a file or a directory every engine
        can read), and waits for the scheduler's answer.

        ``format`` is passed to the engines as is ("safetensors", "hf-dir", ...). For a file
        readable here, ``sha256`` and ``size`` are computed when not given; the scheduler checks
        them against the file. Returns the ``Publication`` accepted; ``PublicationRefused``
        carries the scheduler's reason otherwise (nothing changed; the stream goes on).
        """
        if version < 1:
            raise ValueError(f"version {version}: published versions start at 1")
        if not format:
            raise ValueError("format: empty (say what the weights are, e.g. 'safetensors')")
        text = os.fspath(uri)
        path = _local_path(text)
        if path is not None and os.path.isfile(path):
            try:
                if sha256 is None:
                    sha256 = sha256_file(path)
                if size is None:
                    size = os.path.getsize(path)
            except OSError as e:
                log.info("cannot read %s to hash it (the scheduler will): %s", path, e)
        request = pb.PublishWeights(
            version=version,
            uri=text,
            format=format,
            sha256=sha256 or "",
            bytes=size or 0,
        )
        self._start(self._window or DEFAULT_WINDOW)
        deadline = time.monotonic() + timeout
        with self._publish_lock, self._lock:
            if self._failure is not None:
                raise self._failure
            pending = _Pending(request)
            self._pending = pending
            if self._requests is not None:
                self._requests.put(pb.TrainerFeedRequest(publish=request))
                pending.sent_on = self._stream
            try:
                while pending.answer is None:
                    if self._failure is not None:
                        raise self._failure
                    if self._thread is None or not self._thread.is_alive():
                        raise FeedError(
                            f"version {version}: the trainer feed is closed "
                            + (f"(job {self.job} ended {self._ended.phase.value})"
                               if self._ended is not None else "")
                        )
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimedOut(
                            f"version {version}: no answer from the scheduler at "
                            f"{self._conn.url} within {timeout} s"
                        )
                    self._lock.wait(min(left, 1.0))
            finally:
                self._pending = None
            answer = pending.answer
            resent_taken = pending.resent and _ALREADY_PUBLISHED in answer.reason
            if not answer.accepted and not resent_taken:
                raise PublicationRefused(version, answer.reason)
            self._version = max(self._version or 0, version)
            self._lock.notify_all()
            return Publication(
                version=version,
                uri=text,
                format=format,
                sha256=request.sha256,
                bytes=request.bytes,
                already_published=not answer.accepted,
            )

    def close(self, timeout: float = 10.0) -> None:
        """Ends the stream: the acknowledgements made are sent first (the scheduler reads them
        before it sees the end), then the connection is closed."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            requests = self._requests
            self._lock.notify_all()
        self._wake.set()
        if requests is not None:
            requests.close()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                with self._lock:
                    call = self._call
                if call is not None:
                    cancel(call)
                thread.join(timeout)
        self._conn.close()

    # ------------------------------------------------------------------ consumer side

    def _start(self, window: int) -> int:
        """Starts the feed thread (once) with ``window``; returns the window in use."""
        with self._lock:
            if self._closing:
                raise FeedError("the trainer is closed")
            if self._thread is None:
                self._window = window
                self._thread = threading.Thread(
                    target=self._run, name=f"rollfleet-feed-{self.job}", daemon=True
                )
                self._thread.start()
            assert self._window is not None
            return self._window

    def _cut(self, size: int, whole_groups: bool) -> int:
        """How many buffered trajectories make the next batch (0: not enough yet)."""
        if len(self._buffer) < size:
            return 0
        if not whole_groups:
            return size
        for i in range(size - 1, len(self._buffer)):
            if self._buffer[i].sequence in self._boundaries:
                return i + 1
        return 0

    def _take(self, count: int) -> Batch:
        taken = [self._buffer.popleft() for _ in range(count)]
        self._delivered_through = taken[-1].sequence
        self._delivered += count
        self._boundaries = {s for s in self._boundaries if s > self._delivered_through}
        return Batch(taken)

    def _over_for_consumer(self) -> bool:
        """Whether no more trajectories will be handed out (under the lock): the job ended, or
        every version of it is published."""
        if self._ended is not None:
            return True
        return self._steps_total is not None and (self._version or 0) >= self._steps_total

    def _over(self) -> bool:
        """``_over_for_consumer``, or the feed thread stopped."""
        if self._over_for_consumer():
            return True
        return self._thread is not None and not self._thread.is_alive()

    def _poll_status(self) -> None:
        """Reads the job's status (off the lock) to notice that it ended; failures to read it
        are left to the feed thread, which owns reconnecting."""
        try:
            status = JobStatus.from_proto(self._conn.status(self.job, timeout=5.0))
        except grpc.RpcError:
            return
        with self._lock:
            self._note_status(status)

    def _note_status(self, status: JobStatus) -> None:
        """Takes what a status says (under the lock)."""
        log.debug("job status: %s", status)
        # A scheduler that has just started can answer a blank status (no steps, no pools)
        # before its first real one: that says nothing about the job.
        if status.rl_steps_total > 0:
            self._steps_total = status.rl_steps_total
        # The status is refreshed on the scheduler's tick: it may lag a publication just
        # accepted, never lead it.
        self._version = max(self._version or 0, status.policy_version)
        if status.ended:
            self._ended = status
        self._lock.notify_all()

    # ------------------------------------------------------------------ feed thread

    def _send_ack(self) -> None:
        """Sends the acknowledgement due on the current stream (under the lock), never beyond
        what the stream carried."""
        if self._requests is None:
            return
        through = min(self._acked, self._stream_seen)
        if through > self._ack_sent:
            self._requests.put(pb.TrainerFeedRequest(ack_through=through))
            self._ack_sent = through

    def _run(self) -> None:
        deadline = time.monotonic() + self._connect_timeout
        waiting_for = f"the first subscription within {self._connect_timeout} s"
        delay = 0.2
        try:
            while True:
                reason, carried = self._stream_once()
                with self._lock:
                    if self._closing or self._nothing_to_send():
                        return
                if carried:
                    # A stream that worked broke: the scheduler gets reconnect_for to return.
                    deadline = time.monotonic() + self._reconnect_for
                    waiting_for = f"{self._reconnect_for} s after the feed broke"
                    delay = 0.2
                    log.warning(
                        "trainer feed of job %s broke (%s); subscribing again from sequence %d",
                        self.job,
                        reason,
                        self.acked_through + 1,
                    )
                if time.monotonic() >= deadline:
                    if _NO_JOB_YET in reason:
                        raise SubscriptionRefused(
                            f"the scheduler at {self._conn.url} has no job {self.job} "
                            f"({waiting_for}): {reason}",
                            code="NOT_FOUND",
                            reason=reason,
                        )
                    raise SchedulerUnavailable(
                        f"cannot reach the trainer feed of job {self.job} at {self._conn.url} "
                        f"({waiting_for}): {reason}"
                    )
                if self._wake.wait(delay):
                    return
                delay = min(delay * 2, 2.0)
        except _Stop:
            return
        except RollfleetError as e:
            with self._lock:
                if not self._closing:
                    self._failure = e
        except Exception as e:  # a bug here must not leave the consumer waiting forever
            log.exception("the trainer feed thread failed")
            with self._lock:
                self._failure = RollfleetError(f"the trainer feed thread failed: {e!r}")
        finally:
            with self._lock:
                self._lock.notify_all()

    def _nothing_to_send(self) -> bool:
        """Whether the feed can be left (under the lock): nothing more will be handed out, and
        nothing handed out waits for an acknowledgement, nor a publication for its answer."""
        return (
            self._over_for_consumer()
            and self._delivered_through <= self._acked
            and self._pending is None
        )

    def _stream_once(self) -> tuple[str, bool]:
        """Reads the job's status, then one feed stream until it ends; returns why it ended
        (for a retry) and whether it carried anything, raises ``_Stop`` when there is nothing
        left to do, or a ``RollfleetError`` when retrying cannot help."""
        started = time.monotonic()
        try:
            status = JobStatus.from_proto(self._conn.status(self.job, timeout=5.0))
        except grpc.RpcError as e:
            return self._status_failure(e), False
        with self._lock:
            self._note_status(status)
            if self._closing or self._nothing_to_send():
                raise _Stop()
            requests = _Requests()
            self._stream += 1
            if self._stream > 1:
                self._reconnects += 1
            self._stream_seen = 0
            self._stream_items = 0
            self._last_on_stream = 0
            assert self._window is not None
            requests.put(
                pb.TrainerFeedRequest(
                    subscribe=pb.FeedSubscribe(
                        job=self.job, resume_from=self._acked + 1, window=self._window
                    )
                )
            )
            self._ack_sent = self._acked
            pending = self._pending
            if pending is not None and pending.answer is None:
                pending.resent = pending.sent_on != 0
                pending.sent_on = self._stream
                requests.put(pb.TrainerFeedRequest(publish=pending.request))
            self._requests = requests
            call = self._conn.feed(iter(requests))
            self._call = call
        try:
            for item in call:
                with self._lock:
                    self._on_item(item)
            return "the scheduler ended the stream", self._carried(started)
        except RollfleetError:
            cancel(call)
            raise
        except grpc.RpcError as e:
            with self._lock:
                # Read through a call: mypy keeps the narrowing of the check above.
                if self._is_closing():
                    return "closed", False
                carried = self._stream_items > 0
            code = e.code()
            details = e.details() or ""
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise AuthenticationError(
                    f"the scheduler at {self._conn.url} refused the trainer feed: {details}",
                    code=code.name,
                    reason=details,
                ) from None
            ended = _JOB_ENDED.match(details)
            if code == grpc.StatusCode.ABORTED and ended and ended.group(1) == self.job:
                # The job failed or was cancelled: the scheduler says so as it ends the feed.
                raise JobEnded(self.job, ended.group(2), details) from None
            if code in _FATAL_CODES:
                if not carried and code in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.NOT_FOUND,
                    # Another trainer reads the job's feed.
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.OUT_OF_RANGE,
                ):
                    raise SubscriptionRefused(
                        f"the scheduler at {self._conn.url} refused the feed subscription of "
                        f"job {self.job}: {details}",
                        code=code.name,
                        reason=details,
                    ) from None
                raise FeedError(
                    f"the scheduler at {self._conn.url} ended the trainer feed of job "
                    f"{self.job}: {details or code.name}"
                ) from None
            return (
                f"{code.name if code is not None else 'UNKNOWN'}: {details}",
                self._carried(started),
            )
        finally:
            requests.close()
            with self._lock:
                self._requests = None
                self._call = None

    def _is_closing(self) -> bool:
        return self._closing

    def _carried(self, started: float) -> bool:
        """Whether the stream that started at ``started`` worked: it carried items, or stayed
        open a while."""
        with self._lock:
            return self._stream_items > 0 or time.monotonic() - started > 2.0

    def _status_failure(self, error: grpc.RpcError) -> str:
        """What a failed status read before subscribing means: a reason to retry, or the error
        to raise."""
        code = error.code()
        details = error.details() or ""
        if code == grpc.StatusCode.NOT_FOUND and _NO_JOB_YET in details:
            return details
        if code == grpc.StatusCode.NOT_FOUND:
            raise SubscriptionRefused(
                f"the scheduler at {self._conn.url} has no job {self.job}: {details}",
                code=code.name,
                reason=details,
            )
        if code in _FATAL_CODES:
            raise rpc_error(self._conn.url, "status", error)
        return f"{code.name if code is not None else 'UNKNOWN'}: {details}"

    def _on_item(self, item: pb.TrainerFeedItem) -> None:
        """Takes one feed item (under the lock)."""
        kind = item.WhichOneof("item")
        self._last_item_at = time.monotonic()
        if kind == "trajectory":
            self._on_trajectory(item.trajectory)
        elif kind == "group_complete":
            if self._last_on_stream:
                self._boundaries.add(self._last_on_stream)
        elif kind == "publication":
            answer = item.publication
            pending = self._pending
            if pending is not None and pending.answer is None and (
                answer.version == pending.request.version
            ):
                pending.answer = answer
            else:
                log.info(
                    "an answer for version %d that no publication waits for: %s",
                    answer.version,
                    answer.reason or "accepted",
                )
        self._lock.notify_all()

    def _on_trajectory(self, t: pb.CompletedTrajectory) -> None:
        sequence = t.sequence
        self._stream_items += 1
        self._stream_seen = max(self._stream_seen, sequence)
        self._last_on_stream = sequence
        if self._next is None:
            # The first item ever: the scheduler starts at resume_from, or after what it had
            # acknowledged already (a restarted trainer whose own record lagged).
            if sequence < self._resume_from:
                raise FeedError(
                    f"the feed sent sequence {sequence} to a subscription from "
                    f"{self._resume_from}"
                )
            self._next = sequence
            self._acked = max(self._acked, sequence - 1)
            self._ack_sent = max(self._ack_sent, sequence - 1)
            self._delivered_through = max(self._delivered_through, sequence - 1)
        if sequence < self._next:
            self._duplicates += 1
        elif sequence > self._next:
            raise FeedError(
                f"the feed skipped sequences {self._next} to {sequence - 1} of job {self.job} "
                "(acknowledged by another subscriber?): they were never handed to this trainer"
            )
        else:
            self._buffer.append(Trajectory.from_proto(t))
            self._next = sequence + 1
            self._received += 1
        self._send_ack()


__all__ = [
    "DEFAULT_WINDOW",
    "FeedStats",
    "Publication",
    "SchedulerError",
    "Trainer",
    "sha256_file",
]
