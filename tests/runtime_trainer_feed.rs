//! The trainer feed across real processes: what was not acknowledged is sent again after a
//! reconnect, one trainer reads a job's feed, and a resume that would skip or acknowledge
//! unsent items is refused.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

/// Reads the feed until `count` trajectories came; returns their (sequence, trajectory id).
async fn read_feed(
    feed: &mut tonic::Streaming<rollfleet_proto::v1::TrainerFeedItem>,
    count: usize,
) -> Vec<(u64, u64)> {
    let mut got = Vec::new();
    while got.len() < count {
        let item = tokio::time::timeout(DEADLINE, feed.message())
            .await
            .expect("the feed went quiet")
            .unwrap()
            .expect("the feed ended early");
        if let Some(rollfleet_proto::v1::trainer_feed_item::Item::Trajectory(t)) = item.item {
            // What a trainer needs of it: the task's prompt, and every turn's action and the
            // environment's answer to it, each with the version that generated it.
            assert!(!t.prompt.is_empty(), "{t:?}");
            assert!(!t.turns.is_empty(), "{t:?}");
            for turn in &t.turns {
                assert!(
                    !turn.action.is_empty() && !turn.observation.is_empty(),
                    "{t:?}"
                );
                assert!(turn.policy_version >= t.oldest_policy_version, "{t:?}");
            }
            got.push((t.sequence, t.trajectory.unwrap().id));
        }
    }
    got
}

#[test]
fn the_trainer_feed_resends_what_was_not_acknowledged_after_a_reconnect() {
    use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
    let dir = temp_dir("feed");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let (first, second) = rt().block_on(async {
        let mut client = TrainerFeedClient::connect(url.clone()).await.unwrap();
        // A trainer cannot resume past what was ever sent (found by fuzzing: it overflowed the
        // window's arithmetic, and would have dropped every trajectory appended since).
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(u64::MAX, u32::MAX)).unwrap();
        let refused = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("subscribe.resume_from"),
            "{refused:?}"
        );
        // First connection: a window of 8, read 10 (acking 5 opens the window), then leave.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(1, 8)).unwrap();
        let mut feed = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut first = read_feed(&mut feed, 8).await;
        tx.send(ack(5)).unwrap();
        first.extend(read_feed(&mut feed, 2).await);
        drop(tx);
        drop(feed);

        // Reconnect: everything from 6 comes again, then the rest, acknowledged as it comes.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(subscribe(6, 8)).unwrap();
        let mut feed = client
            .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut second = Vec::new();
        while second.len() < 64 - 5 {
            let got = read_feed(&mut feed, 1).await;
            tx.send(ack(got[0].0)).unwrap();
            second.extend(got);
        }
        // Everything is acknowledged: the scheduler ends the feed when it leaves.
        let rest = tokio::time::timeout(DEADLINE, async {
            let mut extra = 0;
            while let Ok(Some(item)) = feed.message().await {
                if let Some(rollfleet_proto::v1::trainer_feed_item::Item::Trajectory(_)) = item.item
                {
                    extra += 1;
                }
            }
            extra
        })
        .await
        .expect("the feed did not end after the job");
        assert_eq!(rest, 0, "nothing beyond the job's trajectories");
        (first, second)
    });
    let seqs: Vec<u64> = first.iter().map(|x| x.0).collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    let seqs: Vec<u64> = second.iter().map(|x| x.0).collect();
    assert_eq!(
        seqs,
        (6..=64).collect::<Vec<_>>(),
        "gap-free from the resume point"
    );
    // What was resent is what was sent before.
    assert_eq!(&first[5..10], &second[..5]);
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success());
    let report = check_report(&report, 2, 0);
    let trained = trained(&report);
    let fed: Vec<u64> = first[..5].iter().chain(&second).map(|x| x.1).collect();
    assert_eq!(
        fed, trained,
        "the feed carries every trained trajectory once, in order"
    );
}

#[test]
fn one_trainer_reads_a_jobs_feed_and_a_resume_that_would_skip_or_acknowledge_unsent_items_is_refused()
 {
    use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
    let dir = temp_dir("feed-readers");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 5, &[]);
    let mut procs = Procs(vec![sched]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let (first, last) = rt().block_on(async {
        let mut client = TrainerFeedClient::connect(url.clone()).await.unwrap();
        let open = |resume_from: u64| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tx.send(subscribe(resume_from, 8)).unwrap();
            (tx, tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        };
        // Trainer A reads 1-10 and acknowledges 5.
        let (a_tx, a_rx) = open(1);
        let mut a = client.feed(a_rx).await.unwrap().into_inner();
        let mut first = read_feed(&mut a, 8).await;
        a_tx.send(ack(5)).unwrap();
        first.extend(read_feed(&mut a, 2).await);

        // A second trainer while A's stream is open is refused, naming why.
        let (_b_tx, b_rx) = open(1);
        let refused = client.feed(b_rx).await.unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert!(refused.message().contains("another trainer"), "{refused:?}");

        // A leaves. B cannot claim to have consumed items no stream ever sent (A's window had
        // 13 sent: 5 acknowledged and 8 ahead).
        drop(a_tx);
        drop(a);
        let (_b_tx, b_rx) = open(65);
        let refused = client.feed(b_rx).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("subscribe.resume_from")
                && refused.message().contains("sent through 13 only"),
            "{refused:?}"
        );
        // B takes over after 10 (its own account: it consumed 1-10), reads 11 and acknowledges it.
        let (b_tx, b_rx) = open(11);
        let mut b = client.feed(b_rx).await.unwrap().into_inner();
        let eleventh = read_feed(&mut b, 1).await;
        assert_eq!(eleventh[0].0, 11);
        b_tx.send(ack(11)).unwrap();
        // Closing its side ends B's stream once the scheduler has read the acknowledgement.
        drop(b_tx);
        while let Ok(Some(_)) = b.message().await {}

        // A comes back from 6: items 6-11 are acknowledged and gone, and the feed says so
        // instead of carrying on at 12 with a gap.
        let (_a_tx, a_rx) = open(6);
        let refused = client.feed(a_rx).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("resume from 12"), "{refused:?}");

        // From 12, the rest comes gap-free.
        let (tx, rx) = open(12);
        let mut feed = client.feed(rx).await.unwrap().into_inner();
        let mut last = Vec::new();
        while last.len() < 64 - 11 {
            let got = read_feed(&mut feed, 1).await;
            tx.send(ack(got[0].0)).unwrap();
            last.extend(got);
        }
        // Everything is acknowledged: the scheduler ends the feed when it leaves.
        while let Ok(Some(_)) = feed.message().await {}
        drop(tx);
        (first, last)
    });
    let seqs: Vec<u64> = first.iter().map(|x| x.0).collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    let seqs: Vec<u64> = last.iter().map(|x| x.0).collect();
    assert_eq!(seqs, (12..=64).collect::<Vec<_>>());
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success());
    let _ = std::fs::remove_dir_all(&dir);
}
