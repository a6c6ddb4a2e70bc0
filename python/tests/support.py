"""Test helpers: a real rollfleet scheduler with one emulated worker per pool, and a TCP proxy
that can cut or stall the connections through it.

Every process is started here and stopped by its own handle; every wait is bounded.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

#: The repository's root (python/tests/ is two levels down).
ROOT = Path(__file__).resolve().parents[2]
#: The external-trainer quick-start: 5 steps of 32 trajectories in groups of 4.
EXTERNAL_JOB = ROOT / "examples" / "jobs" / "quickstart-external.yaml"
EXTERNAL_JOB_NAME = "quickstart-external"
#: The quick-start with rollfleet's own (emulated) trainer.
EMULATED_JOB = ROOT / "examples" / "jobs" / "quickstart.yaml"
POOLS = ("prefill", "decode", "train", "envs", "rewards")
#: Wall seconds per modelled second: the quick-start runs in about a second.
TIME_SCALE = "0.1"
#: How long any one thing is waited for.
DEADLINE = 90.0


def rollfleet_bin() -> Path:
    """The rollfleet binary: ``$ROLLFLEET_BIN``, else the repository's debug build (waited for
    a while: it may be being rebuilt)."""
    path = Path(os.environ.get("ROLLFLEET_BIN", ROOT / "target" / "debug" / "rollfleet"))
    start = time.monotonic()
    while not (path.is_file() and os.access(path, os.X_OK)):
        if time.monotonic() - start > 120:
            raise RuntimeError(
                f"no rollfleet binary at {path}: build it (cargo build -p rollfleet-cli) or set "
                "ROLLFLEET_BIN"
            )
        time.sleep(1)
    return path


def read_line(stream: IO[str], deadline: float, what: str) -> str:
    """One line of a child's stdout, waiting at most until ``deadline``."""
    buffer = ""
    fd = stream.fileno()
    while "\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{what} printed no line in time (so far: {buffer!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096).decode()
        if not chunk:
            raise RuntimeError(f"{what} exited before printing its address ({buffer!r})")
        buffer += chunk
    return buffer.split("\n", 1)[0]


def _drain(stream: IO[str], sink: Path) -> None:
    with open(sink, "a") as out:
        for line in stream:
            out.write(line)


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log, for an assertion's message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"


@dataclass
class Cluster:
    """A scheduler and its workers, all real processes, logging under ``dir``."""

    binary: Path
    dir: Path
    job: Path | None
    scheduler_args: list[str]
    env: dict[str, str]
    url: str = ""
    address: str = ""
    scheduler: subprocess.Popen[str] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    schedulers_started: int = 0

    def start_scheduler(self, listen: str = "127.0.0.1:0") -> None:
        """Starts the scheduler and reads the address it listens on."""
        self.schedulers_started += 1
        log = self.dir / f"scheduler-{self.schedulers_started}.log"
        command = [str(self.binary), "scheduler"]
        if self.job is not None:
            command.append(str(self.job))
        command += ["--listen", listen, *self.scheduler_args]
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
            env=self.env,
        )
        self.scheduler = process
        assert process.stdout is not None
        line = read_line(process.stdout, time.monotonic() + 30, f"the scheduler ({log})")
        if not line.startswith("listening on "):
            raise RuntimeError(f"the scheduler said {line!r}, not its address")
        self.address = line.removeprefix("listening on ").strip()
        scheme = "https" if "--tls-cert" in self.scheduler_args else "http"
        self.url = f"{scheme}://{self.address}"
        threading.Thread(
            target=_drain, args=(process.stdout, self.dir / "scheduler.out"), daemon=True
        ).start()

    def start_worker(self, pool: str, extra: Sequence[str] = ()) -> None:
        """One emulated worker for ``pool``."""
        log = self.dir / f"worker-{pool}-{len(self.workers)}.log"
        self.workers.append(
            subprocess.Popen(
                [str(self.binary), "worker", "--scheduler", self.url, "--pool", pool, *extra],
                stdout=subprocess.DEVNULL,
                stderr=open(log, "w"),
                env=self.env,
            )
        )

    def kill_scheduler(self) -> None:
        """SIGKILL: the scheduler goes away without a word."""
        assert self.scheduler is not None
        self.scheduler.kill()
        self.scheduler.wait(DEADLINE)

    def stop_scheduler(self) -> int:
        """SIGTERM, as an operator stops a scheduler; its exit status (the job's)."""
        assert self.scheduler is not None
        self.scheduler.send_signal(signal.SIGTERM)
        return self.scheduler.wait(DEADLINE)

    def scheduler_log(self) -> str:
        return tail(self.dir / f"scheduler-{self.schedulers_started}.log")

    def stop(self) -> None:
        """Stops every process this cluster started."""
        for process in [*self.workers, *([self.scheduler] if self.scheduler else [])]:
            if process.poll() is None:
                process.kill()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass


def start_cluster(
    directory: Path,
    job: Path | None = EXTERNAL_JOB,
    *,
    scheduler_args: Sequence[str] = (),
    worker_args: dict[str, list[str]] | None = None,
    pools: Sequence[str] = POOLS,
    env: dict[str, str] | None = None,
    weights_dir: Path | None = None,
    expect_workers: int | None = None,
) -> Cluster:
    """A scheduler of ``job`` (``None``: waiting for a submission) kept serving after the job
    ends, and one emulated worker per pool (which it waits for, unless told how many)."""
    directory.mkdir(parents=True, exist_ok=True)
    args = [
        "--expect-workers",
        str(len(pools) if expect_workers is None else expect_workers),
        "--time-scale",
        TIME_SCALE,
        "--until-stopped",
        "--report",
        str(directory / "report.json"),
        *scheduler_args,
    ]
    if weights_dir is not None:
        args += ["--weights-dir", str(weights_dir)]
    process_env = dict(os.environ)
    process_env.pop("ROLLFLEET_TOKEN", None)
    process_env.update(env or {})
    cluster = Cluster(rollfleet_bin(), directory, job, args, process_env)
    try:
        cluster.start_scheduler()
        for pool in pools:
            cluster.start_worker(pool, (worker_args or {}).get(pool, []))
    except BaseException:
        cluster.stop()
        raise
    return cluster


class Proxy:
    """A TCP proxy to ``upstream`` on a free loopback port. ``cut`` closes every connection
    through it (new ones are taken as before); ``stall`` holds bytes until ``cut``."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._stalled = threading.Event()
        self._stalled_to_client = threading.Event()
        self._closed = False
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
                self.connections += 1
            threading.Thread(
                target=self._pump, args=(client, server, self._stalled), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(server, client, self._stalled_to_client), daemon=True
            ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, stalled: threading.Event) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                while stalled.is_set():
                    if source.fileno() < 0:
                        return
                    time.sleep(0.01)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stall(self, to_client_only: bool = False) -> None:
        """Holds every byte in both directions, or only those the server sends (the
        connections stay open)."""
        self._stalled_to_client.set()
        if not to_client_only:
            self._stalled.set()

    def resume(self) -> None:
        """Lets the bytes held by ``stall`` through, and every later one."""
        self._stalled.clear()
        self._stalled_to_client.clear()

    def cut(self) -> None:
        """Closes every connection through the proxy, dropping what it held."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self._stalled.clear()
        self._stalled_to_client.clear()

    def close(self) -> None:
        self.cut()
        self._listener.close()


def openssl() -> str | None:
    """The openssl command, if there is one."""
    return shutil.which("openssl")


def make_certificates(directory: Path, openssl_cmd: str) -> dict[str, Path]:
    """A CA, a server certificate it signs for 127.0.0.1 (an IP SAN) and a client certificate
    it signs; and another CA."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(
            [openssl_cmd, *args], cwd=directory, check=True, capture_output=True, timeout=60
        )

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        run("req", "-x509", *ec, "-days", "2", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
            "-subj", f"/CN=rollfleet test {ca}")
    run("req", *ec, "-keyout", "scheduler.key", "-out", "scheduler.csr", "-subj", "/CN=scheduler")
    (directory / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    run("x509", "-req", "-in", "scheduler.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "scheduler.pem")
    run("req", *ec, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=trainer")
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "client.ext", "-out", "client.pem")
    return {
        "client_cert": directory / "client.pem",
        "client_key": directory / "client.key",
        "ca": directory / "ca.pem",
        "other_ca": directory / "other-ca.pem",
        "cert": directory / "scheduler.pem",
        "key": directory / "scheduler.key",
    }
