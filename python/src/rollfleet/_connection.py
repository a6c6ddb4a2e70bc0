"""One gRPC connection to a scheduler: its URL, the bearer token on every call, TLS, and the
mapping of gRPC failures onto the SDK's exceptions.

The rules are the Rust clients' (``proto/src/auth.rs``, ``proto/src/tls.rs``): a token is 16 to
1,024 printable ASCII characters without spaces, sent as ``authorization: Bearer TOKEN``, and
read from ``ROLLFLEET_TOKEN`` when none is given; an ``https://`` scheduler needs the CA that
signed its certificate (there are no system roots), a plain ``http://`` one takes no TLS
settings, and a client certificate and key (mutual TLS) go together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Union
from urllib.parse import urlsplit

import grpc

from rollfleet.errors import (
    AuthenticationError,
    ConfigError,
    JobNotFound,
    RollfleetError,
    SchedulerError,
    SchedulerUnavailable,
)
from rollfleet.v1 import rollfleet_pb2 as pb

#: The environment variable every rollfleet process reads its token from when none is given.
TOKEN_ENV = "ROLLFLEET_TOKEN"
#: Shortest token accepted (as the scheduler's).
MIN_TOKEN_CHARS = 16
#: Longest token accepted (it travels in a header on every call).
MAX_TOKEN_CHARS = 1024

#: A path as the SDK takes it.
PathLike = Union[str, "os.PathLike[str]"]

# Trajectories are small next to this; the scheduler sends one per message.
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    # A scheduler restarted on its journal comes back within seconds: retry the TCP connection
    # at that pace rather than grpc's default of up to two minutes. Not
    # `grpc.min_reconnect_backoff_ms`: gRPC core takes it as the least time a connection
    # attempt is given (20 s by default), and at 200 ms a scheduler that answers the handshake
    # later (a loaded machine, a distant one, TLS) was never reached.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Notice a peer that vanished without closing (a lost machine) on the long-lived feed.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclass(frozen=True)
class TlsConfig:
    """TLS towards an ``https://`` scheduler.

    ``ca`` is the CA certificate (PEM) that signed the scheduler's certificate (the URL's host
    must be one of its names). ``cert`` and ``key`` are this client's certificate and private
    key (PEM), for a scheduler that requires client certificates (``--tls-client-ca``).
    """

    ca: PathLike
    cert: PathLike | None = None
    key: PathLike | None = None


def check_token(text: str, origin: str) -> str:
    """The token in ``text`` (surrounding whitespace dropped), or ``ConfigError`` naming
    ``origin`` when it is not one the scheduler could accept."""
    token = text.strip()
    for position, char in enumerate(token):
        if not 33 <= ord(char) <= 126:
            raise ConfigError(
                f"{origin}: the token has a space, a control or a non-ASCII character at "
                f"position {position} (a token is printable ASCII without spaces)"
            )
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{origin}: the token has {len(token)} characters; at least {MIN_TOKEN_CHARS} "
            "are needed"
        )
    if len(token) > MAX_TOKEN_CHARS:
        raise ConfigError(
            f"{origin}: the token has {len(token)} characters; at most {MAX_TOKEN_CHARS} "
            "are allowed"
        )
    return token


def read_token_file(path: PathLike) -> str:
    """The token on the first line of the file at ``path`` (as ``--token-file`` reads it)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024)
    except OSError as e:
        raise ConfigError(f"{os.fspath(path)}: {e.strerror or e}") from e
    lines = head.decode("utf-8", errors="replace").splitlines()
    return check_token(lines[0] if lines else "", os.fspath(path))


def resolve_token(token: str | None) -> str | None:
    """The token to send: ``token`` when given, else ``$ROLLFLEET_TOKEN`` when set and not
    empty, else none."""
    if token is not None:
        return check_token(token, "token")
    from_env = os.environ.get(TOKEN_ENV, "")
    if from_env.strip():
        return check_token(from_env, TOKEN_ENV)
    return None


@dataclass(frozen=True)
class Target:
    """A scheduler URL taken apart."""

    url: str
    #: ``host:port`` as grpc dials it.
    address: str
    secure: bool


def parse_url(url: str) -> Target:
    """``http://HOST:PORT`` or ``https://HOST:PORT`` (the port defaults to 80 or 443)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(
            f"scheduler URL {url!r}: expected http://HOST:PORT or https://HOST:PORT"
        )
    try:
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"scheduler URL {url!r}: {e}") from e
    host = parts.hostname
    if not host:
        raise ConfigError(f"scheduler URL {url!r}: no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"scheduler URL {url!r}: a scheduler URL has no path or query")
    secure = parts.scheme == "https"
    if port is None:
        port = 443 if secure else 80
    shown = f"[{host}]" if ":" in host else host
    return Target(url=url.rstrip("/"), address=f"{shown}:{port}", secure=secure)


def _read_pem(what: str, path: PathLike, block: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"tls.{what} {os.fspath(path)}: {e.strerror or e}") from e
    text = data.decode("utf-8", errors="replace")
    if block == "PRIVATE KEY":
        found = any(
            line.startswith("-----BEGIN ") and line.rstrip().endswith("PRIVATE KEY-----")
            for line in text.splitlines()
        )
    else:
        found = f"-----BEGIN {block}-----" in text
    if not found:
        raise ConfigError(
            f'tls.{what} {os.fspath(path)}: no PEM {block} in it (expected a "-----BEGIN '
            f'{block}" block)'
        )
    return data


def _credentials(target: Target, tls: TlsConfig | None) -> grpc.ChannelCredentials | None:
    if not target.secure:
        if tls is not None:
            raise ConfigError(
                f"scheduler URL {target.url}: TLS settings are for an https:// scheduler; this "
                "URL is plain http:// (the token and everything else would go in clear)"
            )
        return None
    if tls is None:
        raise ConfigError(
            f"scheduler URL {target.url}: an https:// scheduler needs tls=TlsConfig(ca=FILE), "
            "the CA certificate that signed its certificate"
        )
    if (tls.cert is None) != (tls.key is None):
        raise ConfigError("tls: a client certificate (cert) and its key (key) go together")
    ca = _read_pem("ca", tls.ca, "CERTIFICATE")
    cert = _read_pem("cert", tls.cert, "CERTIFICATE") if tls.cert is not None else None
    key = _read_pem("key", tls.key, "PRIVATE KEY") if tls.key is not None else None
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def _method(service: str, method: str) -> str:
    """The HTTP/2 path of ``service.method``, from the proto's descriptors."""
    descriptor = pb.DESCRIPTOR.services_by_name[service]
    return f"/{descriptor.full_name}/{descriptor.methods_by_name[method].name}"


class Connection:
    """A channel to one scheduler, with the token every call carries.

    Everything that can be checked locally (the URL, the token, the TLS files) is checked when
    it is made, so a mistake is a ``ConfigError`` before anything is sent.
    """

    def __init__(self, scheduler_url: str, token: str | None, tls: TlsConfig | None) -> None:
        self.target = parse_url(scheduler_url)
        self.url = self.target.url
        secret = resolve_token(token)
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {secret}"),) if secret is not None else ()
        )
        self._credentials = _credentials(self.target, tls)
        self.channel = self._open()

    def _open(self) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(self.target.address, options=_CHANNEL_OPTIONS)
        return grpc.secure_channel(
            self.target.address, self._credentials, options=_CHANNEL_OPTIONS
        )

    def close(self) -> None:
        """Closes the channel; calls in flight end with ``CANCELLED``."""
        self.channel.close()

    # The calls, typed: each is looked up by the method name the proto gives.

    def submit(
        self, request: pb.SubmitJobRequest, timeout: float
    ) -> pb.SubmitJobResponse:
        """``JobService.Submit``."""
        call: grpc.UnaryUnaryMultiCallable[pb.SubmitJobRequest, pb.SubmitJobResponse] = (
            self.channel.unary_unary(
                _method("JobService", "Submit"),
                request_serializer=pb.SubmitJobRequest.SerializeToString,
                response_deserializer=pb.SubmitJobResponse.FromString,
            )
        )
        return call(request, timeout=timeout, metadata=self.metadata)

    def status(self, job: str, timeout: float) -> pb.JobStatus:
        """``JobService.Status``."""
        call: grpc.UnaryUnaryMultiCallable[pb.JobRef, pb.JobStatus] = self.channel.unary_unary(
            _method("JobService", "Status"),
            request_serializer=pb.JobRef.SerializeToString,
            response_deserializer=pb.JobStatus.FromString,
        )
        return call(pb.JobRef(job=job), timeout=timeout, metadata=self.metadata)

    def cancel(self, job: str, timeout: float) -> pb.CancelJobResponse:
        """``JobService.Cancel``."""
        call: grpc.UnaryUnaryMultiCallable[pb.JobRef, pb.CancelJobResponse] = (
            self.channel.unary_unary(
                _method("JobService", "Cancel"),
                request_serializer=pb.JobRef.SerializeToString,
                response_deserializer=pb.CancelJobResponse.FromString,
            )
        )
        return call(pb.JobRef(job=job), timeout=timeout, metadata=self.metadata)

    def watch(self, job: str, timeout: float | None) -> grpc.CallIterator[pb.JobStatus]:
        """``JobService.Watch``: a status on every change, starting with the current one."""
        call: grpc.UnaryStreamMultiCallable[pb.JobRef, pb.JobStatus] = (
            self.channel.unary_stream(
                _method("JobService", "Watch"),
                request_serializer=pb.JobRef.SerializeToString,
                response_deserializer=pb.JobStatus.FromString,
            )
        )
        return call(pb.JobRef(job=job), timeout=timeout, metadata=self.metadata)

    def feed(
        self, requests: Iterator[pb.TrainerFeedRequest]
    ) -> grpc.CallIterator[pb.TrainerFeedItem]:
        """``TrainerFeed.Feed``: the bidirectional trainer feed."""
        call: grpc.StreamStreamMultiCallable[pb.TrainerFeedRequest, pb.TrainerFeedItem] = (
            self.channel.stream_stream(
                _method("TrainerFeed", "Feed"),
                request_serializer=pb.TrainerFeedRequest.SerializeToString,
                response_deserializer=pb.TrainerFeedItem.FromString,
            )
        )
        return call(requests, metadata=self.metadata)



def cancel(call: grpc.Call) -> None:
    """Cancels a call in flight (grpc-stubs leaves ``cancel`` unannotated)."""
    call.cancel()  # type: ignore[no-untyped-call]


def rpc_error(url: str, what: str, error: grpc.RpcError) -> RollfleetError:
    """The SDK's exception for a failed call ``what`` to the scheduler at ``url``."""
    code = error.code()
    details = error.details() or ""
    name = code.name if code is not None else "UNKNOWN"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return SchedulerUnavailable(
            f"{what}: cannot reach the scheduler at {url}: {details or name}"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(
            f"{what}: the scheduler at {url} refused the call: {details}",
            code=name,
            reason=details,
        )
    if code == grpc.StatusCode.NOT_FOUND:
        return JobNotFound(
            f"{what}: the scheduler at {url} says: {details}", code=name, reason=details
        )
    return SchedulerError(
        f"{what}: the scheduler at {url} says: {details or name}", code=name, reason=details
    )
