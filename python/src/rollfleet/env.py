"""Serve gymnasium-style environments to rollfleet over its remote environment protocol.

``serve(factory, port)`` runs an HTTP server (standard library only) that rollfleet's workers
reach with ``rollfleet worker --remote-env KIND=http://HOST:PORT``; a job's task then names
``environment: KIND``. The protocol is ``agents/remote`` (``docs/remote-environments.md``):

========================================  =================================  ===================
request                                   body                               success
========================================  =================================  ===================
``POST /v1/episodes``                     ``{"environment": K, "seed": N}``  ``201 {"episode", "observation"}``
``POST /v1/episodes/{episode}/step``      ``{"action": TEXT}``               ``200 {"observation", "reward", "done", "invalidAction"}``
``DELETE /v1/episodes/{episode}``                                            ``204``
``GET /v1/health``                                                           ``200 {"environments", "slots", "busy"}``
========================================  =================================  ===================

Errors are ``{"error": {"code", "message"}}``: ``unknown_environment`` and ``unknown_episode``
(404), ``bad_request`` (400), ``no_free_slot`` (429), ``internal`` (500). rollfleet treats a 4xx
other than 429 as a configuration error, and 429, 5xx or a malformed answer as an
infrastructure failure: the episode is replayed elsewhere from its seed, never scored.

How a gymnasium environment maps onto it:

- Each episode gets a fresh environment from the factory, and ``reset(seed=SEED,
  options=OPTIONS)``: the seed is rollfleet's (the same seed and actions must give the same
  episode: rollfleet replays episodes after failures). The protocol carries no task: OPTIONS
  come from ``tasks``, a list of rows (dataset items) picked by ``seed % len(tasks)``, or a
  function of the seed.
- The action is the policy's text (rollfleet has already extracted ``<action>...</action>``);
  ``parse_action`` turns it into the environment's action, and a ``ValueError`` from it is an
  invalid action: answered as a step with ``invalidAction: true``, the environment not stepped.
  The environment can also say so itself with ``info["invalid_action"] = True``.
- Observations are text: ``render`` turns one into the text the policy sees (default: a
  ``str`` as is, anything else as JSON).
- ``done`` is ``terminated or truncated``. The answer also carries ``terminated`` and
  ``truncated`` separately, but rollfleet reads only ``done``: it cannot tell a time limit from
  a terminal state. ``info`` is not sent at all (only its ``invalid_action``), and a reward must
  be a finite number.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Callable, Mapping, Protocol, Sequence, SupportsFloat, Union

log = logging.getLogger("rollfleet.env")

#: Largest request body read (actions are text).
MAX_BODY_BYTES = 1 << 20


class Env(Protocol):
    """What ``serve`` needs of an environment: gymnasium's ``reset`` and ``step``
    (``close``, when it has one, is called when the episode ends)."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Starts an episode: its first observation and an info dict."""
        ...

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Applies ``action``: observation, reward, terminated, truncated, info."""
        ...


#: Makes a fresh environment for one episode.
EnvFactory = Callable[[], Env]
#: The options of an episode's ``reset``: dataset rows picked by seed, or a function of it.
Tasks = Union[Sequence[Mapping[str, Any]], Callable[[int], Union[Mapping[str, Any], None]]]


def default_render(observation: Any) -> str:
    """An observation as text: a ``str`` as is, ``bytes`` decoded, anything else as JSON
    (arrays through their ``tolist``)."""
    if isinstance(observation, str):
        return observation
    if isinstance(observation, bytes):
        return observation.decode("utf-8", errors="replace")

    def plain(value: Any) -> Any:
        to_list = getattr(value, "tolist", None)
        if callable(to_list):
            return to_list()
        return str(value)

    return json.dumps(observation, default=plain)


@dataclass
class EnvStats:
    """What a server has done so far."""

    episodes_started: int = 0
    episodes_finished: int = 0
    steps: int = 0
    invalid_actions: int = 0
    #: Episodes started per environment name.
    by_environment: dict[str, int] = field(default_factory=dict)


@dataclass
class _Episode:
    environment: str
    env: Env
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)


class _Refusal(Exception):
    """An error answer: HTTP status, protocol code, message."""

    def __init__(self, status: HTTPStatus, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        factories: Mapping[str, EnvFactory],
        slots: int,
        tasks: Tasks | None,
        render: Callable[[Any], str],
        parse_action: Callable[[str], Any],
        idle_timeout: float,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.factories = dict(factories)
        self.slots = slots
        self.tasks = tasks
        self.render = render
        self.parse_action = parse_action
        self.idle_timeout = idle_timeout
        self.episodes: dict[str, _Episode] = {}
        self.lock = threading.Lock()
        self.stats = EnvStats()

    # Everything below is what the handler calls; each returns (status, body) or raises
    # _Refusal.

    def options(self, seed: int) -> dict[str, Any] | None:
        if self.tasks is None:
            return None
        if callable(self.tasks):
            row = self.tasks(seed)
        else:
            if not self.tasks:
                return None
            row = self.tasks[seed % len(self.tasks)]
        return None if row is None else dict(row)

    def reclaim_idle(self) -> None:
        """Ends episodes nobody used for ``idle_timeout`` (a client that vanished)."""
        now = time.monotonic()
        gone: list[_Episode] = []
        with self.lock:
            for key, e in list(self.episodes.items()):
                # Claimed first: an episode stepping right now is not idle.
                if now - e.last_used > self.idle_timeout and e.lock.acquire(blocking=False):
                    gone.append(self.episodes.pop(key))
                    e.lock.release()
        for episode in gone:
            log.info("episode of %s idle for %.0f s: reclaimed", episode.environment, now - episode.last_used)
            _close(episode.env)

    def start(self, request: Mapping[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        environment = request.get("environment")
        if not isinstance(environment, str):
            raise _Refusal(HTTPStatus.BAD_REQUEST, "bad_request", "environment: string required")
        factory = self.factories.get(environment)
        if factory is None:
            raise _Refusal(
                HTTPStatus.NOT_FOUND,
                "unknown_environment",
                f"{environment!r}; this server runs {sorted(self.factories)}",
            )
        seed = request.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise _Refusal(
                HTTPStatus.BAD_REQUEST, "bad_request", "seed: a non-negative integer required"
            )
        self.reclaim_idle()
        episode_id = secrets.token_urlsafe(12)
        with self.lock:
            if len(self.episodes) >= self.slots:
                raise _Refusal(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    "no_free_slot",
                    f"all {self.slots} slots busy",
                )
            # Hold the slot while the environment is made and reset.
            placeholder = _Episode(environment, _Placeholder())
            placeholder.lock.acquire()
            self.episodes[episode_id] = placeholder
        try:
            env = factory()
            observation, _info = env.reset(seed=seed, options=self.options(seed))
            text = self.render(observation)
        except Exception as e:
            with self.lock:
                self.episodes.pop(episode_id, None)
            log.exception("%s: reset(seed=%d) failed", environment, seed)
            raise _Refusal(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                "internal",
                f"{environment}: reset(seed={seed}) failed: {e!r}",
            ) from e
        with self.lock:
            self.episodes[episode_id] = _Episode(environment, env)
            self.stats.episodes_started += 1
            self.stats.by_environment[environment] = (
                self.stats.by_environment.get(environment, 0) + 1
            )
        return HTTPStatus.CREATED, {"episode": episode_id, "observation": text}

    def step(self, episode_id: str, request: Mapping[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        action_text = request.get("action")
        if not isinstance(action_text, str):
            raise _Refusal(HTTPStatus.BAD_REQUEST, "bad_request", "action: string required")
        with self.lock:
            episode = self.episodes.get(episode_id)
        if episode is None or isinstance(episode.env, _Placeholder):
            raise _Refusal(HTTPStatus.NOT_FOUND, "unknown_episode", episode_id)
        with episode.lock:
            with self.lock:
                if self.episodes.get(episode_id) is not episode:
                    # Reclaimed or deleted while this request waited for it.
                    raise _Refusal(HTTPStatus.NOT_FOUND, "unknown_episode", episode_id)
            episode.last_used = time.monotonic()
            try:
                action = self.parse_action(action_text)
            except ValueError as e:
                with self.lock:
                    self.stats.invalid_actions += 1
                return HTTPStatus.OK, {
                    "observation": f"Invalid action {action_text!r}: {e}",
                    "reward": 0.0,
                    "done": False,
                    "invalidAction": True,
                    "terminated": False,
                    "truncated": False,
                }
            try:
                observation, reward, terminated, truncated, info = episode.env.step(action)
                text = self.render(observation)
                value = float(reward)
            except Exception as e:
                self.forget(episode_id)
                log.exception("%s: step(%r) failed", episode.environment, action_text)
                raise _Refusal(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    "internal",
                    f"{episode.environment}: step failed: {e!r}",
                ) from e
            if not math.isfinite(value):
                self.forget(episode_id)
                raise _Refusal(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    "internal",
                    f"{episode.environment}: reward {value} is not a finite number",
                )
            done = bool(terminated) or bool(truncated)
            invalid = bool(info.get("invalid_action", False)) if isinstance(info, Mapping) else False
            with self.lock:
                self.stats.steps += 1
                if invalid:
                    self.stats.invalid_actions += 1
            if done:
                self.forget(episode_id)
                with self.lock:
                    self.stats.episodes_finished += 1
            return HTTPStatus.OK, {
                "observation": text,
                "reward": value,
                "done": done,
                "invalidAction": invalid,
                "terminated": bool(terminated),
                "truncated": bool(truncated),
            }

    def forget(self, episode_id: str) -> None:
        with self.lock:
            episode = self.episodes.pop(episode_id, None)
        if episode is not None and not isinstance(episode.env, _Placeholder):
            _close(episode.env)

    def health(self) -> dict[str, Any]:
        self.reclaim_idle()
        with self.lock:
            busy = len(self.episodes)
        return {"environments": sorted(self.factories), "slots": self.slots, "busy": busy}


class _Placeholder:
    """Stands in an episode's slot while its environment is made."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        raise RuntimeError("not an environment")

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        raise RuntimeError("not an environment")


def _close(env: Env) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # a failing close must not take the server down
            log.exception("closing an environment failed")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # Keep-alive, as rollfleet's client (ureq) pools its connections. It drops one idle for 15 s
    # and probes a pooled one before reusing it; a connection idle this long (another client's)
    # is closed here, so that its thread ends.
    protocol_version = "HTTP/1.1"
    timeout = 120

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _reply(self, status: HTTPStatus, body: Mapping[str, Any] | None) -> None:
        payload = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if payload:
            self.wfile.write(payload)

    def _error(self, refusal: _Refusal) -> None:
        self._reply(refusal.status, {"error": {"code": refusal.code, "message": refusal.message}})

    def _body(self) -> dict[str, Any]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = self._chunked()
        else:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                self.close_connection = True
                raise _Refusal(HTTPStatus.BAD_REQUEST, "bad_request", "Content-Length: not a number")
            if length < 0 or length > MAX_BODY_BYTES:
                self.close_connection = True
                raise _Refusal(
                    HTTPStatus.BAD_REQUEST,
                    "bad_request",
                    f"a body of {length} bytes (at most {MAX_BODY_BYTES})",
                )
            data = self.rfile.read(length)
        if not data.strip():
            return {}
        try:
            value = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise _Refusal(HTTPStatus.BAD_REQUEST, "bad_request", f"body is not JSON: {e}") from e
        if not isinstance(value, dict):
            raise _Refusal(HTTPStatus.BAD_REQUEST, "bad_request", "body: a JSON object required")
        return value

    def _chunked(self) -> bytes:
        data = b""
        while True:
            line = self.rfile.readline(64)
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                self.close_connection = True
                raise _Refusal(HTTPStatus.BAD_REQUEST, "bad_request", "malformed chunked body")
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass
                return data
            if len(data) + size > MAX_BODY_BYTES:
                self.close_connection = True
                raise _Refusal(
                    HTTPStatus.BAD_REQUEST, "bad_request", f"a body over {MAX_BODY_BYTES} bytes"
                )
            data += self.rfile.read(size)
            self.rfile.readline(8)

    def _path(self) -> list[str]:
        return [p for p in self.path.split("?", 1)[0].split("/") if p]

    def _not_found(self) -> _Refusal:
        return _Refusal(HTTPStatus.NOT_FOUND, "not_found", f"{self.command} {self.path}")

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        try:
            if self._path() != ["v1", "health"]:
                raise self._not_found()
            self._reply(HTTPStatus.OK, self.server.health())
        except _Refusal as r:
            self._error(r)

    def do_POST(self) -> None:  # noqa: N802
        try:
            request = self._body()
            parts = self._path()
            if parts == ["v1", "episodes"]:
                status, body = self.server.start(request)
            elif len(parts) == 4 and parts[:2] == ["v1", "episodes"] and parts[3] == "step":
                status, body = self.server.step(parts[2], request)
            else:
                raise self._not_found()
            self._reply(status, body)
        except _Refusal as r:
            self._error(r)

    def do_DELETE(self) -> None:  # noqa: N802
        try:
            self._body()
            parts = self._path()
            if len(parts) != 3 or parts[:2] != ["v1", "episodes"]:
                raise self._not_found()
            self.server.forget(parts[2])
            self._reply(HTTPStatus.NO_CONTENT, None)
        except _Refusal as r:
            self._error(r)


class EnvServer:
    """A running environment server (``serve``'s handle)."""

    def __init__(self, server: _Server, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        address = server.server_address
        self.host: str = str(address[0])
        self.port: int = int(address[1])

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, as ``rollfleet worker --remote-env KIND=URL`` takes it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def environments(self) -> list[str]:
        """The environment names served."""
        return sorted(self._server.factories)

    def stats(self) -> EnvStats:
        """A copy of the counts so far."""
        with self._server.lock:
            s = self._server.stats
            return EnvStats(
                s.episodes_started,
                s.episodes_finished,
                s.steps,
                s.invalid_actions,
                dict(s.by_environment),
            )

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the server is shut down (or ``timeout`` passes)."""
        self._thread.join(timeout)

    def shutdown(self) -> None:
        """Stops serving, closes the socket and every environment still open."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        with self._server.lock:
            episodes = list(self._server.episodes.values())
            self._server.episodes.clear()
        for episode in episodes:
            if not isinstance(episode.env, _Placeholder):
                _close(episode.env)

    def __enter__(self) -> EnvServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.shutdown()


def serve(
    factory: EnvFactory | Mapping[str, EnvFactory],
    port: int,
    host: str = "127.0.0.1",
    *,
    name: str = "env",
    slots: int = 64,
    tasks: Tasks | None = None,
    render: Callable[[Any], str] = default_render,
    parse_action: Callable[[str], Any] = str,
    idle_timeout: float = 600.0,
) -> EnvServer:
    """Serves environments over rollfleet's remote environment protocol, in a background
    thread; returns the running server (``port`` 0 picks a free one: see ``.port``).

    ``factory`` makes a fresh environment per episode, served under ``name``; or a mapping of
    names to factories, to serve several. ``slots`` is the episodes held at once (more are
    refused with 429). ``tasks`` gives each episode's ``reset`` options (see the module's
    documentation), ``render`` turns an observation into text, ``parse_action`` the policy's
    text into an action (``ValueError``: an invalid action). Episodes idle for
    ``idle_timeout`` seconds are reclaimed.
    """
    factories: Mapping[str, EnvFactory] = (
        dict(factory) if isinstance(factory, Mapping) else {name: factory}
    )
    if not factories:
        raise ValueError("serve: no environment to serve")
    for kind in factories:
        if not kind or "=" in kind:
            raise ValueError(f"environment name {kind!r}: empty or holds '='")
    if slots < 1:
        raise ValueError(f"slots {slots}: at least 1")
    if not idle_timeout > 0:
        raise ValueError(f"idle_timeout {idle_timeout}: a positive number of seconds")
    server = _Server(
        (host, port), factories, slots, tasks, render, parse_action, idle_timeout
    )
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.2},
        name=f"rollfleet-env-{server.server_address[1]}",
        daemon=True,
    )
    thread.start()
    return EnvServer(server, thread)
