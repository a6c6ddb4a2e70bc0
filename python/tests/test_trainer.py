"""The trainer client against a real scheduler: the external-trainer quick-start (5 RL steps of
32 trajectories in groups of 4, staleness bound 1) driven entirely from Python, with emulated
workers; the stream broken by a proxy, a scheduler killed and restarted on its journal."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import rollfleet
from rollfleet import Batch, JobClient, JobPhase, Publication, Trainer
from support import (
    DEADLINE,
    EXTERNAL_JOB_NAME,
    Cluster,
    Proxy,
)

STEPS = 5
BATCH = 32
GROUP = 4
MAX_STALENESS = 1


@dataclass
class Run:
    """What a Python trainer consumed and published."""

    #: (version the batch was trained from, the batch)
    batches: list[tuple[int, Batch]] = field(default_factory=list)
    publications: list[Publication] = field(default_factory=list)

    @property
    def trajectories(self) -> list[rollfleet.Trajectory]:
        return [t for _, batch in self.batches for t in batch]


def checkpoint(weights: Path, version: int, batch: Batch) -> Path:
    """A stand-in for a model checkpoint: the batch's token ids, written durably."""
    path = weights / f"policy-v{version}.ckpt"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(f"version {version}\n")
        for t in batch:
            f.write(" ".join(map(str, t.tokens())) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def train(
    trainer: Trainer,
    weights: Path,
    run: Run | None = None,
    *,
    after_batch: Callable[[Run, Batch], None] | None = None,
) -> Run:
    """The trainer loop: a batch, a checkpoint, an ack, a publication; until the job is over."""
    run = run or Run()
    for batch in trainer.batches(BATCH, timeout=DEADLINE):
        if after_batch is not None:
            after_batch(run, batch)
        version = trainer.version
        path = checkpoint(weights, version + 1, batch)
        trainer.ack(batch)
        run.publications.append(
            trainer.publish(version + 1, path, "rollfleet-test", timeout=DEADLINE)
        )
        run.batches.append((version, batch))
    return run


def check_run(run: Run, cluster: Cluster) -> None:
    """Every trajectory exactly once, in feed order, in whole groups, consistent tokens, within
    the staleness bound; every version published in order; the job succeeded and the scheduler
    handed over exactly what the trainer consumed."""
    sequences = [t.sequence for t in run.trajectories]
    assert sequences == list(range(1, STEPS * BATCH + 1)), "a trajectory lost or repeated"
    ids = [t.id for t in run.trajectories]
    assert len(set(ids)) == len(ids) == STEPS * BATCH
    assert [p.version for p in run.publications] == list(range(1, STEPS + 1))
    assert [v for v, _ in run.batches] == list(range(STEPS))
    for version, batch in run.batches:
        assert len(batch) == BATCH
        assert set(Counter(batch.groups).values()) == {GROUP}, "a group split across batches"
        assert batch.problems() == []
        for t in batch:
            assert version - t.oldest_policy_version <= MAX_STALENESS
            assert t.job == EXTERNAL_JOB_NAME
            assert t.turns, "a trajectory without turns"
            for turn in t.turns:
                assert len(turn.action_logprobs) == len(turn.action_tokens)
                assert len(turn.loss_mask) == len(turn.prompt_tokens) + len(turn.action_tokens)
                assert sum(s.tokens for s in turn.segments) == len(turn.action_tokens)
                assert max(turn.action_versions(), default=0) <= version
        arrays = batch.to_numpy()
        assert arrays.tokens.shape == (BATCH, int(arrays.lengths.max()))
        assert list(arrays.lengths) == [len(t.tokens()) for t in batch]
        assert int(arrays.loss_mask.sum()) == sum(t.action_token_count for t in batch)
        on_policy = arrays.loss_mask == 1
        assert (arrays.logprobs[on_policy] <= 0).all()
        assert (arrays.versions[on_policy] >= 0).all()
        assert (arrays.versions[~on_policy] == rollfleet.NO_VERSION).all()
        assert np.isfinite(arrays.rewards).all()
        for group in set(batch.groups):
            members = arrays.groups == group
            assert abs(float(arrays.advantages[members].sum())) < 1e-6
    status = JobClient(cluster.url).status(EXTERNAL_JOB_NAME)
    assert status.phase == JobPhase.SUCCEEDED, status
    assert status.policy_version == STEPS
    assert status.trajectories_trained == STEPS * BATCH
    assert cluster.stop_scheduler() == 0, cluster.scheduler_log()
    report = json.loads((cluster.dir / "report.json").read_text())
    assert report["phase"] == "Succeeded"
    assert report["trained_twice"] == []
    assert report["trained"] == ids, "the trainer consumed other trajectories than were fed"


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_python_trainer_drives_the_external_job_to_success_receiving_every_trajectory_once(
    clusters: Callable[..., Cluster], weights: Path
) -> None:
    cluster = clusters(weights_dir=weights)
    statuses: list[rollfleet.JobStatus] = []
    watcher = threading.Thread(
        target=lambda: statuses.extend(
            JobClient(cluster.url).watch(EXTERNAL_JOB_NAME, timeout=DEADLINE)
        ),
        daemon=True,
    )
    watcher.start()
    with Trainer(cluster.url, EXTERNAL_JOB_NAME) as trainer:
        run = train(trainer, weights)
        assert trainer.version == STEPS
        assert trainer.acked_through == STEPS * BATCH
        assert trainer.stats.reconnects == 0
    watcher.join(DEADLINE)
    assert statuses and statuses[-1].phase == JobPhase.SUCCEEDED
    versions = [s.policy_version for s in statuses]
    assert versions == sorted(versions), "the policy version went back"
    for p in run.publications:
        assert p.sha256 and p.bytes == (weights / f"policy-v{p.version}.ckpt").stat().st_size
        assert not p.already_published
    check_run(run, cluster)


def test_refused_publications_raise_with_the_schedulers_reason_and_change_nothing(
    clusters: Callable[..., Cluster], weights: Path, tmp_path: Path
) -> None:
    cluster = clusters(weights_dir=weights)
    jobs = JobClient(cluster.url)
    with Trainer(cluster.url, EXTERNAL_JOB_NAME) as trainer:
        batch = trainer.next_batch(BATCH, timeout=DEADLINE)
        assert batch is not None
        good = checkpoint(weights, 1, batch)
        outside = tmp_path / "elsewhere.ckpt"
        outside.write_text("not in the weights directory")

        def refused(version: int, uri: str | Path, **kwargs: str) -> str:
            with pytest.raises(rollfleet.PublicationRefused) as caught:
                trainer.publish(version, uri, "rollfleet-test", timeout=DEADLINE, **kwargs)
            assert caught.value.version == version
            assert caught.value.reason in str(caught.value)
            return caught.value.reason

        assert "skips a version" in refused(2, good)
        assert "outside the scheduler's weights directory" in refused(1, outside)
        assert "publish.sha256" in refused(1, good, sha256="0" * 64)
        assert "not an absolute path" in refused(1, "relative/policy.ckpt")
        assert "cannot be read" in refused(1, weights / "missing.ckpt")
        assert "scheme" in refused(1, "s3://bucket/policy.ckpt")
        assert jobs.status(EXTERNAL_JOB_NAME).policy_version == 0, "a refusal changed the job"
        trainer.ack(batch)
        accepted = trainer.publish(1, f"file://{good}", "rollfleet-test", timeout=DEADLINE)
        assert accepted.version == 1 and not accepted.already_published
        assert "already published" in refused(1, good)
        # The status shows the version once the scheduler took the publication.
        wait_for(lambda: jobs.status(EXTERNAL_JOB_NAME).policy_version == 1, "version 1")
        # The stream went on through the refusals: the job trains to its end.
        run = train(trainer, weights, Run(batches=[(0, batch)], publications=[accepted]))
    check_run(run, cluster)


def test_a_job_cancelled_under_the_trainer_ends_its_batches_with_an_error_not_a_hang(
    clusters: Callable[..., Cluster], weights: Path
) -> None:
    cluster = clusters(weights_dir=weights)
    start = time.monotonic()
    with Trainer(cluster.url, EXTERNAL_JOB_NAME, reconnect_for=3.0, poll_interval=0.5) as trainer:
        batch = trainer.next_batch(BATCH, timeout=DEADLINE)
        assert batch is not None
        trainer.ack(batch)
        JobClient(cluster.url).cancel(EXTERNAL_JOB_NAME)
        # The scheduler ends the feed saying the job was cancelled (not as a restart would).
        with pytest.raises(rollfleet.JobEnded) as ended:
            for _ in range(STEPS + 1):
                batch = trainer.next_batch(BATCH, timeout=DEADLINE)
                assert batch is not None
                trainer.ack(batch)
        assert ended.value.phase == "Cancelled"
        assert EXTERNAL_JOB_NAME in str(ended.value)
    assert time.monotonic() - start < 30


def test_a_full_window_is_an_error_naming_the_fix_and_acknowledging_frees_it(
    clusters: Callable[..., Cluster], weights: Path
) -> None:
    cluster = clusters(weights_dir=weights)
    with Trainer(cluster.url, EXTERNAL_JOB_NAME, window=BATCH) as trainer:
        first = trainer.next_batch(BATCH, timeout=DEADLINE)
        assert first is not None
        with pytest.raises(rollfleet.FeedError, match="window of 32 is full.*Trainer.ack"):
            trainer.next_batch(BATCH, timeout=DEADLINE)
        with pytest.raises(rollfleet.ConfigError, match="larger than the feed's window"):
            trainer.next_batch(BATCH + 1)
        trainer.ack(first)
        trainer.publish(1, checkpoint(weights, 1, first), "rollfleet-test", timeout=DEADLINE)
        second = trainer.next_batch(BATCH, timeout=DEADLINE)
        assert second is not None and second.first_sequence == BATCH + 1
        with pytest.raises(rollfleet.FeedError, match="only sequences through"):
            trainer.ack(second.last_sequence + 1)


def test_a_stream_cut_mid_run_resumes_from_the_first_unacknowledged_trajectory_without_loss_or_duplicates(
    clusters: Callable[..., Cluster], weights: Path
) -> None:
    cluster = clusters(weights_dir=weights)
    proxy = Proxy(cluster.address)
    try:
        with Trainer(f"http://{proxy.address}", EXTERNAL_JOB_NAME) as trainer:
            cuts: list[int] = []

            def cut_the_stream(run: Run, batch: Batch) -> None:
                # Before the first and third acknowledgements: the scheduler sends again all it
                # sent since the last one, which the trainer must not hand out twice.
                if len(run.batches) in (0, 2):
                    dropped = trainer.stats.duplicates_dropped
                    proxy.cut()
                    cuts.append(batch.last_sequence)
                    wait_for(
                        lambda: trainer.stats.duplicates_dropped >= dropped + BATCH,
                        "the unacknowledged trajectories sent again",
                    )

            run = train(trainer, weights, after_batch=cut_the_stream)
            stats = trainer.stats
        assert len(cuts) == 2
        assert stats.reconnects >= 2
        assert stats.duplicates_dropped >= 2 * BATCH
        assert stats.received == stats.delivered == STEPS * BATCH
        assert proxy.connections >= 3
        check_run(run, cluster)
    finally:
        proxy.close()


def test_a_publication_whose_answer_is_lost_with_the_stream_is_sent_again_and_taken_once(
    clusters: Callable[..., Cluster], weights: Path
) -> None:
    cluster = clusters(weights_dir=weights)
    jobs = JobClient(cluster.url)
    proxy = Proxy(cluster.address)
    try:
        with Trainer(f"http://{proxy.address}", EXTERNAL_JOB_NAME) as trainer:
            run = Run()
            for version in (1, 2):
                batch = trainer.next_batch(BATCH, timeout=DEADLINE)
                assert batch is not None
                path = checkpoint(weights, version, batch)
                trainer.ack(batch)
                answers: list[Publication] = []
                errors: list[BaseException] = []

                def publish() -> None:
                    try:
                        answers.append(
                            trainer.publish(version, path, "rollfleet-test", timeout=DEADLINE)
                        )
                    except BaseException as e:  # handed to the test's thread
                        errors.append(e)

                if version == 1:
                    # The publication reaches the scheduler, its answer does not.
                    proxy.stall(to_client_only=True)
                else:
                    # Neither the publication nor its answer gets through.
                    proxy.stall()
                publisher = threading.Thread(target=publish, daemon=True)
                publisher.start()
                if version == 1:
                    wait_for(
                        lambda: jobs.status(EXTERNAL_JOB_NAME).policy_version == 1,
                        "the scheduler taking version 1",
                    )
                else:
                    time.sleep(0.5)
                    assert jobs.status(EXTERNAL_JOB_NAME).policy_version == 1
                assert publisher.is_alive(), "answered through a stalled stream"
                proxy.cut()
                publisher.join(DEADLINE)
                assert not errors, errors
                (answer,) = answers
                assert answer.version == version
                # Sent again: version 1 was taken the first time, version 2 only now.
                assert answer.already_published == (version == 1)
                run.publications.append(answer)
                run.batches.append((version - 1, batch))
            assert trainer.stats.reconnects >= 2
            train(trainer, weights, run)
        check_run(run, cluster)
    finally:
        proxy.close()


def test_a_scheduler_killed_and_restarted_on_its_journal_loses_and_repeats_no_trajectory(
    clusters: Callable[..., Cluster], weights: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.bin"
    cluster = clusters(weights_dir=weights, scheduler_args=["--journal", str(journal)])

    def kill_after_version_2(run: Run, batch: Batch) -> None:
        if len(run.batches) == 2:
            cluster.kill_scheduler()
            cluster.start_scheduler(listen=cluster.address)

    with Trainer(cluster.url, EXTERNAL_JOB_NAME) as trainer:
        run = train(trainer, weights, after_batch=kill_after_version_2)
        assert trainer.stats.reconnects >= 1
    assert cluster.schedulers_started == 2
    check_run(run, cluster)


def test_an_unreachable_scheduler_is_an_error_naming_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with Trainer(url, EXTERNAL_JOB_NAME, connect_timeout=1.0) as trainer:
        with pytest.raises(rollfleet.SchedulerUnavailable, match=url):
            trainer.next_batch(BATCH, timeout=DEADLINE)
        with pytest.raises(rollfleet.SchedulerUnavailable, match=url):
            trainer.publish(1, "/nonexistent/policy.ckpt", "rollfleet-test")
    assert time.monotonic() - start < 30


def test_a_subscription_to_a_job_the_scheduler_does_not_run_is_refused_with_its_reason(
    clusters: Callable[..., Cluster],
) -> None:
    cluster = clusters(pools=())
    with Trainer(cluster.url, "another-job") as trainer:
        with pytest.raises(rollfleet.SubscriptionRefused) as refused:
            trainer.next_batch(BATCH, timeout=DEADLINE)
    assert EXTERNAL_JOB_NAME in str(refused.value)
    assert cluster.url in str(refused.value)


def test_a_restarted_trainer_resumes_from_its_own_record_of_what_it_acknowledged(
    clusters: Callable[..., Cluster], weights: Path
) -> None:
    cluster = clusters(weights_dir=weights)
    run = Run()
    with Trainer(cluster.url, EXTERNAL_JOB_NAME) as first:
        batch = first.next_batch(BATCH, timeout=DEADLINE)
        assert batch is not None
        first.ack(batch)
        run.publications.append(
            first.publish(1, checkpoint(weights, 1, batch), "rollfleet-test", timeout=DEADLINE)
        )
        run.batches.append((0, batch))
        # Handed out but never acknowledged: the next trainer gets it again.
        unacked = first.next_batch(BATCH, timeout=DEADLINE)
        assert unacked is not None
        record = first.acked_through
    assert record == BATCH
    # A trainer restarted at once reads the job's version from a status refreshed on the
    # scheduler's tick; one restarted later (as here) finds the version it published.
    wait_for(lambda: JobClient(cluster.url).status(EXTERNAL_JOB_NAME).policy_version == 1, "v1")
    with Trainer(cluster.url, EXTERNAL_JOB_NAME, resume_from=record + 1) as second:
        assert second.acked_through == BATCH
        run = train(second, weights, run)
        assert run.batches[1][1].first_sequence == unacked.first_sequence
    check_run(run, cluster)
