//! The scheduler's journal across real processes: a scheduler killed mid-run resumes from it
//! and trains and feeds every trajectory once; a journal that cannot be written is emptied and
//! the job goes on without it.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

/// A trainer that reads the feed through scheduler restarts: it acknowledges every 8th item
/// and, when the feed breaks, subscribes again from its first unacknowledged item, as a trainer
/// that checkpoints what it consumed does. Checks that items come gap-free and that an item
/// sent again is the item sent before; returns every item consumed, in order (sequence,
/// trajectory), and how many were sent again.
async fn train_through_restarts(url: String, total: usize) -> (Vec<(u64, u64)>, usize) {
    use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
    use rollfleet_proto::v1::trainer_feed_item::Item;
    let start = Instant::now();
    let mut consumed: Vec<(u64, u64)> = Vec::new();
    let mut sent_before = std::collections::BTreeMap::new();
    let mut resent = 0;
    loop {
        assert!(
            start.elapsed() < DEADLINE,
            "the trainer consumed {} of {total} within {DEADLINE:?}",
            consumed.len()
        );
        let Ok(mut client) = TrainerFeedClient::connect(url.clone()).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(consumed.len() as u64 + 1, 16)).unwrap();
        let Ok(feed) = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let mut feed = feed.into_inner();
        let mut unacked = Vec::new();
        while let Ok(Some(item)) = feed.message().await {
            let Some(Item::Trajectory(t)) = item.item else {
                continue;
            };
            let id = t.trajectory.unwrap().id;
            assert_eq!(
                t.sequence,
                (consumed.len() + unacked.len() + 1) as u64,
                "gap-free, from the resume point"
            );
            if let Some(before) = sent_before.insert(t.sequence, id) {
                assert_eq!(before, id, "item {} sent again is another", t.sequence);
                resent += 1;
            }
            unacked.push((t.sequence, id));
            if unacked.len() == 8 || consumed.len() + unacked.len() == total {
                // The call may have ended (the scheduler was killed) while items it received
                // before are still read: then the acknowledgement is not sent, and what it
                // covered comes again after the next subscription.
                if tx.send(ack(t.sequence)).is_err() {
                    break;
                }
                consumed.append(&mut unacked);
            }
            if consumed.len() == total {
                // Everything is acknowledged: the scheduler ends the feed when it leaves.
                while let Ok(Some(_)) = feed.message().await {}
                return (consumed, resent);
            }
        }
    }
}

#[test]
fn a_scheduler_killed_mid_run_resumes_from_its_journal_and_trains_and_feeds_every_trajectory_once()
{
    let dir = temp_dir("journal");
    let steps = 10;
    let job = job_file(&dir, steps);
    let report = dir.join("report.json");
    let journal = dir.join("scheduler.journal");
    let journal = journal.to_str().unwrap();
    let (sched, url) = scheduler(&job, &report, 5, &["--journal", journal]);
    let addr = url.strip_prefix("http://").unwrap().to_owned();
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let trainer = {
        let url = url.clone();
        std::thread::spawn(move || rt().block_on(train_through_restarts(url, 32 * steps as usize)))
    };
    wait_status(&url, "two steps trained", |s| s.policy_version >= 2);
    // SIGKILL: no goodbye, no flush; what the journal holds is what the kernel was handed.
    procs.0[0].kill().unwrap();
    procs.0[0].wait().unwrap();
    // Replayed offline, the journal says where the job stood and how to resume it.
    let out = Command::new(BIN)
        .args(["journal", "show", journal, "-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["phase"], "Running", "{shown:#}");
    let stood_at = shown["policy_version"].as_u64().unwrap();
    let resume = shown["resume"].as_str().unwrap();
    assert!(
        resume.contains("--expect-workers 5") && resume.contains("--lease-ms 2000"),
        "{resume}"
    );

    // The same command on the same address: it replays the journal, and the workers, whose
    // streams broke, register again.
    let mut command = Command::new(BIN);
    command.arg("scheduler").arg(&job);
    let (mut sched, _) = spawn_scheduler(
        &mut command,
        &report,
        5,
        &["--journal", journal, "--listen", &addr],
        Stdio::piped(),
    );
    let log = tee_log(&mut sched);
    procs.0[0] = sched;
    let resumed_at = {
        let start = Instant::now();
        loop {
            let line = log
                .recv_timeout(DEADLINE.saturating_sub(start.elapsed()))
                .expect("the restarted scheduler says where it resumed");
            if let Some(rest) = line.split("resumed job quickstart at version ").nth(1) {
                break rest.split(' ').next().unwrap().parse::<u64>().unwrap();
            }
        }
    };
    assert!(
        (2..u64::from(steps)).contains(&resumed_at),
        "killed mid-run, not at version {resumed_at}"
    );
    assert_eq!(
        resumed_at, stood_at,
        "the offline replay is the scheduler's"
    );
    let (consumed, resent) = trainer.join().unwrap();
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the resumed scheduler failed: {status:?}");
    // Every step trained, every trajectory once, though the five workers of the scheduler
    // before were lost with it.
    let report_value = check_report(&report, u64::from(steps), 5);
    let trained = trained(&report_value);
    let fed: Vec<u64> = consumed.iter().map(|x| x.1).collect();
    assert_eq!(
        fed, trained,
        "the trainer consumed every trained trajectory once, in order, across the restart"
    );
    eprintln!("items sent again after the restart: {resent}");

    // The journal is the job: a scheduler started on it alone (no job file) replays it to the
    // very report the resumed one wrote, bit for bit, but for the dispatch latencies, which
    // are measured live. The journal says a trainer was subscribed, so the scheduler waits for
    // it to say it consumed everything before it leaves.
    let replayed = dir.join("replayed.json");
    let (sched, url) = spawn_scheduler(
        Command::new(BIN).arg("scheduler"),
        &replayed,
        5,
        &["--journal", journal],
        Stdio::inherit(),
    );
    procs.0.push(sched);
    std::thread::sleep(Duration::from_secs(2));
    let sched = procs.0.last_mut().unwrap();
    assert!(
        sched.try_wait().unwrap().is_none(),
        "the scheduler of an ended job left without its trainer's word"
    );
    rt().block_on(async {
        use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
        let mut client = TrainerFeedClient::connect(url).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(u64::from(32 * steps) + 1, 16)).unwrap();
        let mut feed = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        // Nothing is left to send; the feed ends when the scheduler leaves.
        let rest = tokio::time::timeout(DEADLINE, feed.message()).await;
        assert!(matches!(rest, Ok(Ok(None)) | Ok(Err(_))), "{rest:?}");
    });
    let status = wait_exit(procs.0.last_mut().unwrap(), DEADLINE);
    assert!(status.success(), "{status:?}");
    let again: Value = serde_json::from_slice(&std::fs::read(&replayed).unwrap()).unwrap();
    assert_eq!(decisions(&again), decisions(&report_value));
    assert_journal_replays_to(Path::new(journal), &report_value);

    // A scheduler with other settings is refused, naming the setting, and the journal is left
    // as it was.
    let size = std::fs::metadata(journal).unwrap().len();
    let out = Command::new(BIN)
        .args(["scheduler", "--listen", "127.0.0.1:0", "--seed", "1"])
        .args([
            "--time-scale",
            "1",
            "--lease-ms",
            "2000",
            "--expect-workers",
            "5",
        ])
        .args(["--journal", journal])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--seed 0") && stderr.contains("has 1"),
        "{stderr}"
    );
    assert_eq!(std::fs::metadata(journal).unwrap().len(), size);
}

#[test]
fn a_journal_that_cannot_be_written_is_emptied_and_the_job_goes_on_without_it() {
    let dir = temp_dir("journal-full");
    let steps = 6;
    let job = job_file(&dir, steps);
    let report = dir.join("report.json");
    let journal = dir.join("scheduler.journal");
    // A real failed write: the scheduler may grow no file past 128 KiB (RLIMIT_FSIZE, inherited
    // across exec), with SIGXFSZ ignored, so a write past it fails with EFBIG as one to a full
    // disk fails with ENOSPC. The report (about 50 KB) fits; the journal (about 70 KB a step)
    // does not.
    let mut command = Command::new("bash");
    command
        .arg("-c")
        .arg(r#"trap '' XFSZ; ulimit -f 128; exec "$0" "$@""#)
        .arg(BIN)
        .arg("scheduler")
        .arg(&job)
        .arg("--journal")
        .arg(&journal);
    let (mut sched, url) = spawn_scheduler(
        &mut command,
        &report,
        5,
        &["--metrics-addr", "127.0.0.1:0"],
        Stdio::piped(),
    );
    let log = stderr_lines(&mut sched);
    let metrics = metrics_address(&log);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let failed = wait_line(&log, "the job goes on without a journal");
    assert!(
        failed.contains("scheduler.journal")
            && failed.contains("File too large")
            && failed.contains("the file is emptied"),
        "{failed}"
    );
    // Counted once, while the job still runs.
    let start = Instant::now();
    loop {
        let exposition = scrape(&metrics);
        if sample(&exposition, "rollfleet_journal_failures_total") == Some(1.0) {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE && procs.0[0].try_wait().unwrap().is_none(),
            "the failed journal write was not counted while the job ran:\n{exposition}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    // Nothing accepted was lost to the failure: every step trained, every trajectory once.
    check_report(&report, steps.into(), 0);
    // The journal has no gap to resume from: it is empty, and says there is nothing to replay.
    assert_eq!(std::fs::metadata(&journal).unwrap().len(), 0);
    let out = Command::new(BIN)
        .arg("journal")
        .arg("show")
        .arg(&journal)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("nothing to replay"),
        "{out:?}"
    );
}
