"""The job client, the token and TLS against a real scheduler: submit, status, watch, cancel,
as ``rollfleet job`` does; calls refused for want of the token; a TLS scheduler."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import pytest

import rollfleet
from rollfleet import JobClient, JobPhase, TlsConfig, Trainer
from support import (
    DEADLINE,
    EMULATED_JOB,
    EXTERNAL_JOB,
    EXTERNAL_JOB_NAME,
    POOLS,
    Cluster,
    Proxy,
    make_certificates,
    openssl,
)

TOKEN = "0123456789abcdef0123456789abcdef"


def test_a_job_submitted_to_an_idle_scheduler_runs_to_success_and_its_watch_ends_there(
    clusters: Callable[..., Cluster],
) -> None:
    cluster = clusters(job=None)
    with JobClient(cluster.url) as jobs:
        assert jobs.submit(EMULATED_JOB) == "quickstart"
        # The same job again (as its YAML this time) changes nothing; another one is refused.
        assert jobs.submit(EMULATED_JOB.read_text()) == "quickstart"
        with pytest.raises(rollfleet.InvalidJob, match='runs job "quickstart"'):
            jobs.submit(str(EXTERNAL_JOB))
        statuses = list(jobs.watch("quickstart", timeout=DEADLINE))
        phases = [s.phase for s in statuses]
        assert phases[-1] == JobPhase.SUCCEEDED
        order = [JobPhase.PENDING, JobPhase.RUNNING, JobPhase.SUCCEEDED]
        assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases)
        final = jobs.status("quickstart")
        assert final.ended and final.phase == JobPhase.SUCCEEDED
        assert final.rl_step == final.rl_steps_total == 5
        assert final.trajectories_trained == 5 * 32
        # (Its workers drain and leave once it ends: their count is not checked here.)
        assert [p.pool for p in final.pools] == list(POOLS)
        # A finished job's watch is its last status.
        (again,) = list(jobs.watch("quickstart", timeout=DEADLINE))
        assert again.phase == JobPhase.SUCCEEDED
    assert cluster.stop_scheduler() == 0


def test_a_scheduler_slow_to_answer_a_new_connection_is_still_reached(
    clusters: Callable[..., Cluster],
) -> None:
    # Its half of the HTTP/2 handshake comes a second late, as from a loaded machine or a
    # scheduler far away: the client waits for it within the call's timeout.
    cluster = clusters(job=None, pools=())
    proxy = Proxy(cluster.address)
    try:
        proxy.stall(to_client_only=True)
        late = threading.Timer(1.0, proxy.resume)
        late.start()
        with JobClient(f"http://{proxy.address}") as jobs:
            with pytest.raises(rollfleet.JobNotFound, match="no job was submitted"):
                jobs.status("quickstart")
        late.join()
    finally:
        proxy.close()


def test_an_invalid_job_is_refused_with_its_problems_and_a_valid_one_is_taken_after(
    clusters: Callable[..., Cluster],
) -> None:
    cluster = clusters(job=None, pools=())
    with JobClient(cluster.url) as jobs:
        with pytest.raises(rollfleet.JobNotFound, match="no job was submitted"):
            jobs.status("quickstart")
        broken = EMULATED_JOB.read_text().replace("groupSize: 4", "groupSize: 0")
        with pytest.raises(rollfleet.InvalidJob) as refused:
            jobs.submit(broken)
        assert "spec.rl.groupSize" in refused.value.reason
        assert refused.value.code == "INVALID_ARGUMENT"
        assert jobs.submit(EMULATED_JOB) == "quickstart"
        with pytest.raises(rollfleet.JobNotFound, match='runs "quickstart"'):
            jobs.status("another-job")


def test_a_job_file_naming_a_csv_beside_it_is_taken_from_another_directory_and_its_yaml_alone_is_not(
    clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    # The scheduler runs in its own working directory; the job and its CSV are elsewhere.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "lengths.csv").write_text("output_tokens\n40\n48\n56\n")
    action = "actionTokens: { distribution: lognormal, median: 48, p99: 200, max: 256 }"
    text = EMULATED_JOB.read_text()
    assert action in text
    job = elsewhere / "job.yaml"
    job.write_text(
        text.replace(
            action, "actionTokens: { distribution: csv, path: lengths.csv, column: output_tokens }"
        )
    )
    cluster = clusters(job=None, pools=())
    with JobClient(cluster.url) as jobs:
        # As YAML, the relative path is the scheduler's own, where no such file is.
        with pytest.raises(rollfleet.InvalidJob) as refused:
            jobs.submit(job.read_text())
        assert "spec.tasks[0].actionTokens.path" in refused.value.reason
        assert jobs.submit(job) == "quickstart"
        # The scheduler keeps the job with the file's absolute path: the same file resubmitted
        # is the same job.
        assert jobs.submit(str(job)) == "quickstart"


def test_a_cancelled_job_ends_cancelled_and_its_watch_ends_with_it(
    clusters: Callable[..., Cluster],
) -> None:
    # No workers: the job waits for them until it is cancelled.
    cluster = clusters(job=EMULATED_JOB, pools=(), expect_workers=5)
    with JobClient(cluster.url) as jobs:
        assert jobs.status("quickstart").phase == JobPhase.PENDING
        seen: list[rollfleet.JobStatus] = []
        watcher = threading.Thread(
            target=lambda: seen.extend(jobs.watch("quickstart", timeout=DEADLINE)), daemon=True
        )
        watcher.start()
        jobs.cancel("quickstart")
        watcher.join(DEADLINE)
        assert seen and seen[-1].phase == JobPhase.CANCELLED
        assert seen[-1].ended
    assert cluster.scheduler is not None
    assert cluster.scheduler.wait(DEADLINE) == 1, "a cancelled job is not a success"


def test_settings_are_checked_before_anything_is_sent(tmp_path: Path) -> None:
    for url in ("localhost:7070", "ftp://localhost:7070", "http://localhost:7070/api", "http://"):
        with pytest.raises(rollfleet.ConfigError, match="scheduler URL"):
            JobClient(url)
    with pytest.raises(rollfleet.ConfigError, match="needs tls=TlsConfig"):
        JobClient("https://localhost:7070")
    with pytest.raises(rollfleet.ConfigError, match="plain http://"):
        JobClient("http://localhost:7070", tls=TlsConfig(ca=tmp_path / "ca.pem"))
    with pytest.raises(rollfleet.ConfigError, match="ca.pem"):
        JobClient("https://localhost:7070", tls=TlsConfig(ca=tmp_path / "ca.pem"))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(rollfleet.ConfigError, match="no PEM CERTIFICATE"):
        JobClient("https://localhost:7070", tls=TlsConfig(ca=not_pem))
    with pytest.raises(rollfleet.ConfigError, match="at least 16"):
        JobClient("http://localhost:7070", token="short")
    with pytest.raises(rollfleet.ConfigError, match="position 4"):
        JobClient("http://localhost:7070", token="abcd efgh ijkl mnop")
    with pytest.raises(rollfleet.ConfigError, match="does not exist"):
        JobClient("http://localhost:7070").submit(str(tmp_path / "missing.yaml"))
    with pytest.raises(rollfleet.ConfigError, match="window"):
        Trainer("http://localhost:7070", EXTERNAL_JOB_NAME, window=0)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert rollfleet.read_token_file(token_file) == TOKEN


def test_an_unreachable_scheduler_is_an_error_naming_its_url() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with JobClient(url, timeout=5) as jobs:
        with pytest.raises(rollfleet.SchedulerUnavailable, match=url):
            jobs.status("quickstart")
        with pytest.raises(rollfleet.SchedulerUnavailable, match=url):
            jobs.submit(EMULATED_JOB)


def test_a_scheduler_with_a_token_refuses_calls_without_it_and_serves_those_with_it(
    clusters: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cluster = clusters(
        scheduler_args=["--token-file", str(token_file)], env={"ROLLFLEET_TOKEN": TOKEN}
    )
    monkeypatch.delenv("ROLLFLEET_TOKEN", raising=False)
    with pytest.raises(rollfleet.AuthenticationError, match="none was sent"):
        JobClient(cluster.url).status(EXTERNAL_JOB_NAME)
    with pytest.raises(rollfleet.AuthenticationError, match="not this scheduler's"):
        JobClient(cluster.url, token="f" * 32).status(EXTERNAL_JOB_NAME)
    with Trainer(cluster.url, EXTERNAL_JOB_NAME) as refused:
        with pytest.raises(rollfleet.AuthenticationError, match=cluster.url):
            refused.next_batch(32, timeout=DEADLINE)
    assert JobClient(cluster.url, token=TOKEN).status(EXTERNAL_JOB_NAME).job == EXTERNAL_JOB_NAME
    # As every rollfleet process, the SDK reads the token from ROLLFLEET_TOKEN when given none.
    monkeypatch.setenv("ROLLFLEET_TOKEN", TOKEN)
    assert JobClient(cluster.url).status(EXTERNAL_JOB_NAME).job == EXTERNAL_JOB_NAME
    with Trainer(cluster.url, EXTERNAL_JOB_NAME) as trainer:
        batch = trainer.next_batch(32, timeout=DEADLINE)
        assert batch is not None and batch.first_sequence == 1


@pytest.mark.skipif(openssl() is None, reason="openssl is needed to make the certificates")
def test_a_tls_scheduler_serves_clients_that_trust_its_ca_and_refuses_the_others(
    clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    command = openssl()
    assert command is not None
    certs = make_certificates(tmp_path / "certs", command)
    cluster = clusters(
        scheduler_args=["--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])],
        worker_args={pool: ["--tls-ca", str(certs["ca"])] for pool in POOLS},
    )
    assert cluster.url.startswith("https://")
    trusted = TlsConfig(ca=certs["ca"])
    assert JobClient(cluster.url, tls=trusted).status(EXTERNAL_JOB_NAME).job == EXTERNAL_JOB_NAME
    with pytest.raises(rollfleet.SchedulerUnavailable, match=cluster.url):
        JobClient(cluster.url, tls=TlsConfig(ca=certs["other_ca"]), timeout=5).status(
            EXTERNAL_JOB_NAME
        )
    plain = cluster.url.replace("https://", "http://")
    with pytest.raises(rollfleet.SchedulerUnavailable):
        JobClient(plain, timeout=5).status(EXTERNAL_JOB_NAME)
    with Trainer(cluster.url, EXTERNAL_JOB_NAME, tls=trusted) as trainer:
        batch = trainer.next_batch(32, timeout=DEADLINE)
        assert batch is not None and batch.problems() == []


@pytest.mark.skipif(openssl() is None, reason="openssl is needed to make the certificates")
def test_a_scheduler_requiring_client_certificates_serves_only_clients_presenting_one(
    clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    command = openssl()
    assert command is not None
    certs = make_certificates(tmp_path / "certs", command)
    cluster = clusters(
        pools=(),
        scheduler_args=[
            "--tls-cert", str(certs["cert"]),
            "--tls-key", str(certs["key"]),
            "--tls-client-ca", str(certs["ca"]),
        ],
    )
    mutual = TlsConfig(ca=certs["ca"], cert=certs["client_cert"], key=certs["client_key"])
    assert JobClient(cluster.url, tls=mutual).status(EXTERNAL_JOB_NAME).job == EXTERNAL_JOB_NAME
    with pytest.raises(rollfleet.SchedulerUnavailable, match=cluster.url):
        JobClient(cluster.url, tls=TlsConfig(ca=certs["ca"]), timeout=5).status(EXTERNAL_JOB_NAME)
    with pytest.raises(rollfleet.ConfigError, match="go together"):
        JobClient(cluster.url, tls=TlsConfig(ca=certs["ca"], cert=certs["client_cert"]))
