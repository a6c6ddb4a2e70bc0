//! The trainer feed (`TrainerFeed.Feed`): trajectories handed to training, in order, each with a
//! gap-free sequence number, kept until the trainer acknowledges them and sent again to a trainer
//! that reconnects.
//!
//! The actor appends to the [`FeedLog`] when the core hands a batch to the trainer; feed streams
//! read from it on their own tasks (the log is behind a mutex, and a `watch` channel says how far
//! it goes), so a slow trainer never holds up scheduling. A trainer subscribes with the first
//! sequence it has not durably consumed; everything from there is (re)sent, at most `window`
//! items ahead of its acknowledgements. Acknowledging a sequence that was never sent is a
//! protocol violation and ends the stream with the reason.
//!
//! One trainer reads a job's feed: a second subscription while a stream is open is refused
//! (after a short wait, so that a trainer reconnecting finds its old stream gone). A
//! subscription's `resume_from` is the trainer's own account of what it consumed, taken as an
//! acknowledgement, but only of items some stream sent; one from before what was acknowledged
//! (those items are gone) is refused rather than resumed past: a gap is never skipped. With the
//! emulated trainer nothing has to read the feed, so it keeps only the newest
//! [`UNREAD_KEPT_WITHOUT_TRAINER`] items nobody acknowledged; a reader that falls further behind
//! is told which items it missed.
//!
//! An external trainer (`rl.trainer: external`) publishes each new version on the same stream
//! (`PublishWeights`). Its `uri` is checked here, before the actor hears of it, because whether a
//! file can be read is not something a journal replay could decide again: a `file://` URI or an
//! absolute path, with no `.` or `..` component, inside the scheduler's weights directory when
//! one is set, naming a file or directory that exists (and, for a file with a `sha256`, whose
//! contents hash to it). The actor then takes it or refuses it by the version ([`crate::actor`]);
//! either way the answer comes back on the stream as a `PublicationAnswer`.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::Stream;
use rollfleet_proto::v1::{
    CompletedTrajectory, PublicationAnswer, PublishWeights, TrainerFeedItem, TrainerFeedRequest,
    trainer_feed_item, trainer_feed_request, trainer_feed_server::TrainerFeed,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Items sent ahead of acknowledgements when the trainer asks for no window.
pub const DEFAULT_WINDOW: u32 = 256;

/// Items an emulated-trainer job's feed keeps for a reader (the emulated trainer trained them;
/// a reader there only watches): enough for one that keeps up with a full window.
pub const UNREAD_KEPT_WITHOUT_TRAINER: usize = 4 * DEFAULT_WINDOW as usize;

/// How long a subscription waits for another trainer's open stream to end before it is refused:
/// a trainer reconnecting after its stream broke may get there before the scheduler saw it break.
const SECOND_READER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

struct Entry {
    sequence: u64,
    trajectory: CompletedTrajectory,
    /// The group this trajectory completes, if it is the group's last.
    completes_group: Option<u64>,
}

struct Log {
    entries: VecDeque<Entry>,
    next_sequence: u64,
    acked: u64,
    subscribed: bool,
    closed: bool,
    /// Why the job ended, when it did not succeed: the streams end with it as an error, so that
    /// a trainer tells a cancelled or failed job from a scheduler going away to restart.
    ended_without_success: Option<String>,
    /// The last sequence some stream sent. After a replay of the journal, everything appended
    /// (the killed scheduler may have sent it all): a trainer may resume after any of it.
    sent_through: u64,
    /// The subscription whose stream is open (one trainer reads a job's feed).
    reader: Option<u64>,
    subscriptions: u64,
    /// Items nobody has to acknowledge are kept up to this many (the oldest go first); `None`:
    /// every item is kept until a trainer acknowledges it.
    unread_cap: Option<usize>,
    /// Items through this sequence were dropped unread (see `unread_cap`).
    dropped_through: u64,
}

/// The feed's items, shared by the actor (which appends) and the feed streams (which read).
pub struct FeedLog {
    log: Mutex<Log>,
    last: watch::Sender<u64>,
}

impl Default for FeedLog {
    fn default() -> Self {
        FeedLog {
            log: Mutex::new(Log {
                entries: VecDeque::new(),
                next_sequence: 1,
                acked: 0,
                subscribed: false,
                closed: false,
                ended_without_success: None,
                sent_through: 0,
                reader: None,
                subscriptions: 0,
                unread_cap: None,
                dropped_through: 0,
            }),
            last: watch::Sender::new(0),
        }
    }
}

impl FeedLog {
    fn lock(&self) -> MutexGuard<'_, Log> {
        // Every update is a push, a pop or a counter: a poisoned lock is still consistent.
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends a trajectory (with its sequence filled in); `completes_group` when it is the last
    /// of its group in this batch.
    pub fn append(&self, mut trajectory: CompletedTrajectory, completes_group: Option<u64>) {
        let sequence = {
            let mut log = self.lock();
            let sequence = log.next_sequence;
            log.next_sequence += 1;
            trajectory.sequence = sequence;
            log.entries.push_back(Entry {
                sequence,
                trajectory,
                completes_group,
            });
            if let Some(cap) = log.unread_cap {
                while log.entries.len() > cap {
                    if let Some(dropped) = log.entries.pop_front() {
                        log.dropped_through = dropped.sequence;
                    }
                }
            }
            sequence
        };
        self.last.send_replace(sequence);
    }

    /// Keeps only the newest [`UNREAD_KEPT_WITHOUT_TRAINER`] items nobody acknowledged: the job's
    /// trainer is emulated, so nothing has to read them.
    pub fn without_trainer(&self) {
        self.lock().unread_cap = Some(UNREAD_KEPT_WITHOUT_TRAINER);
    }

    /// After a replay of the journal: a killed scheduler may have sent every item appended, so
    /// a trainer may resume after any of them.
    pub fn replayed(&self) {
        let mut log = self.lock();
        log.sent_through = log.next_sequence - 1;
    }

    /// Whether a trainer ever subscribed and has acknowledged everything appended.
    pub fn drained(&self) -> bool {
        let log = self.lock();
        !log.subscribed || log.acked + 1 >= log.next_sequence
    }

    /// Ends every feed stream: the scheduler is going away. `unsuccessful`: the job did not
    /// succeed, and this is why; the streams end with it (`ABORTED`) instead of a plain end.
    pub fn close(&self, unsuccessful: Option<String>) {
        {
            let mut log = self.lock();
            log.closed = true;
            log.ended_without_success = unsuccessful;
        }
        self.last.send_modify(|_| {});
    }

    /// Marks that a trainer subscribed: after the job, the scheduler waits for it to
    /// acknowledge everything (a scheduler resumed from a journal learns it from there).
    pub fn mark_subscribed(&self) {
        self.lock().subscribed = true;
    }

    /// Whether a trainer ever subscribed.
    pub fn subscribed(&self) -> bool {
        self.lock().subscribed
    }

    /// Sequences acknowledged so far.
    pub fn acked(&self) -> u64 {
        self.lock().acked
    }

    fn ack(&self, through: u64) {
        let mut log = self.lock();
        if through > log.acked {
            log.acked = through;
        }
        while log.entries.front().is_some_and(|e| e.sequence <= through) {
            log.entries.pop_front();
        }
    }

    /// Items from `from` up to `until` (inclusive), as they go on the wire; an error when some
    /// of them were dropped unread (an emulated-trainer job's reader fell too far behind).
    fn items(&self, from: u64, until: u64) -> Result<Vec<TrainerFeedItem>, Status> {
        let log = self.lock();
        if from <= log.dropped_through {
            return Err(dropped_unread(from, log.dropped_through));
        }
        let mut items = Vec::new();
        for e in log
            .entries
            .iter()
            .filter(|e| e.sequence >= from && e.sequence <= until)
        {
            items.push(TrainerFeedItem {
                item: Some(trainer_feed_item::Item::Trajectory(e.trajectory.clone())),
            });
            if let Some(group) = e.completes_group {
                items.push(TrainerFeedItem {
                    item: Some(trainer_feed_item::Item::GroupComplete(group)),
                });
            }
        }
        Ok(items)
    }

    /// Notes that a stream sent every item through `until`.
    fn sent(&self, until: u64) {
        let mut log = self.lock();
        log.sent_through = log.sent_through.max(until);
    }

    /// Makes the caller the feed's one reader, once another's open stream (if any) has ended,
    /// waiting [`SECOND_READER_WAIT`] at most; the reader stops being one when the returned
    /// guard drops.
    async fn become_reader(self: &Arc<Self>, job: &str) -> Result<Reader, Status> {
        let waited = std::time::Instant::now();
        loop {
            {
                let mut log = self.lock();
                if log.reader.is_none() {
                    log.subscriptions += 1;
                    let id = log.subscriptions;
                    log.reader = Some(id);
                    return Ok(Reader {
                        log: self.clone(),
                        id,
                    });
                }
            }
            if waited.elapsed() >= SECOND_READER_WAIT {
                return Err(Status::failed_precondition(format!(
                    "another trainer is reading the feed of job {}: one trainer reads a job's \
                     feed (end the other's stream first)",
                    crate::quoted(job)
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Where a subscription with `resume_from` starts: everything before it is consumed by the
    /// trainer's own account, which is taken as an acknowledgement of items that were sent, and
    /// never of items that were not (taking its word for those would drop them, untrained).
    /// `0`: from the first item not acknowledged.
    fn resume_point(&self, resume_from: u64) -> Result<u64, Status> {
        let log = self.lock();
        let gone = log.acked.max(log.dropped_through);
        if resume_from == 0 {
            return Ok(gone + 1);
        }
        if resume_from > log.sent_through.saturating_add(1) {
            return Err(Status::invalid_argument(format!(
                "subscribe.resume_from: {resume_from}, but items were sent through {} only: a \
                 trainer cannot have consumed what was never sent (a trainer new to this feed \
                 starts from 1, or 0 for the first item not acknowledged)",
                log.sent_through
            )));
        }
        if resume_from <= log.dropped_through {
            return Err(dropped_unread(resume_from, log.dropped_through));
        }
        if resume_from <= log.acked {
            return Err(Status::invalid_argument(format!(
                "subscribe.resume_from: {resume_from}, but items through {} were acknowledged \
                 and are no longer held: resume from {} (the feed never skips a gap)",
                log.acked,
                log.acked + 1
            )));
        }
        drop(log);
        self.ack(resume_from - 1);
        Ok(resume_from)
    }
}

/// The error for a reader asking for items dropped unread.
fn dropped_unread(from: u64, dropped_through: u64) -> Status {
    Status::out_of_range(format!(
        "items {from} to {dropped_through} of the feed were dropped unread: the job's trainer is \
         emulated, so the feed keeps only its newest {UNREAD_KEPT_WITHOUT_TRAINER} items for a \
         reader; resume from {} or later",
        dropped_through + 1
    ))
}

/// The feed's one reader, for as long as this lives.
struct Reader {
    log: Arc<FeedLog>,
    id: u64,
}

impl Drop for Reader {
    fn drop(&mut self) {
        let mut log = self.log.lock();
        if log.reader == Some(self.id) {
            log.reader = None;
        }
    }
}

/// The TrainerFeed service.
pub struct Feed {
    /// The log.
    pub log: Arc<FeedLog>,
    /// The job.
    pub slot: Arc<crate::job::JobSlot>,
    /// The actor, told of a trainer's first subscription (for its journal) and of publications.
    pub actor: mpsc::Sender<crate::actor::Event>,
    /// Where published weights must be (`None`: any absolute path the scheduler can read).
    pub weights_root: Option<std::path::PathBuf>,
}

/// Checks a publication's `uri` (and `sha256`, for a file): the reason it is refused, naming the
/// field, or the publication with its `bytes` filled in from the file when it gave none.
pub fn check_publication(
    mut publish: PublishWeights,
    weights_root: Option<&std::path::Path>,
) -> Result<PublishWeights, String> {
    use std::path::{Component, Path};
    let uri = publish.uri.as_str();
    // The peer's string, cut to a length fit for a message.
    let quoted = crate::quoted(uri);
    let path = match uri.split_once("://") {
        Some(("file", rest)) => rest,
        Some((scheme, _)) => {
            return Err(format!(
                "publish.uri: scheme {} is not allowed: weights are published as \
                 file:///ABSOLUTE/PATH or an absolute path on storage every engine can read",
                crate::quoted(scheme)
            ));
        }
        None => uri,
    };
    let path = Path::new(path);
    if path.as_os_str().is_empty() {
        return Err("publish.uri: empty".into());
    }
    if !path.is_absolute() {
        return Err(format!("publish.uri: {quoted} is not an absolute path"));
    }
    if path
        .components()
        .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return Err(format!(
            "publish.uri: {quoted} has a '.' or '..' component (path traversal is refused)"
        ));
    }
    let real = std::fs::canonicalize(path)
        .map_err(|e| format!("publish.uri: the weights at {quoted} cannot be read: {e}"))?;
    if let Some(root) = weights_root {
        let root = std::fs::canonicalize(root).map_err(|e| {
            format!(
                "the scheduler's weights directory {} cannot be read: {e}",
                root.display()
            )
        })?;
        if !real.starts_with(&root) {
            return Err(format!(
                "publish.uri: {quoted} is outside the scheduler's weights directory {}",
                root.display()
            ));
        }
    }
    let meta = std::fs::metadata(&real)
        .map_err(|e| format!("publish.uri: the weights at {quoted} cannot be read: {e}"))?;
    if meta.is_dir() {
        if !publish.sha256.is_empty() {
            return Err(format!(
                "publish.sha256: {quoted} is a directory; a checksum is checked for a file only"
            ));
        }
        std::fs::read_dir(&real)
            .map_err(|e| format!("publish.uri: the weights at {quoted} cannot be read: {e}"))?;
        return Ok(publish);
    }
    if publish.bytes == 0 {
        publish.bytes = meta.len();
    } else if publish.bytes != meta.len() {
        return Err(format!(
            "publish.bytes: {} but {quoted} holds {} bytes",
            publish.bytes,
            meta.len()
        ));
    }
    if !publish.sha256.is_empty() {
        let want = publish.sha256.to_ascii_lowercase();
        if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "publish.sha256: {} is not a SHA-256 in hex (64 hex digits)",
                crate::quoted(&publish.sha256)
            ));
        }
        let got = sha256_file(&real)
            .map_err(|e| format!("publish.uri: the weights at {quoted} cannot be read: {e}"))?;
        if got != want {
            return Err(format!(
                "publish.sha256: {quoted} hashes to {got}, not {want} (a partial or other file)"
            ));
        }
        publish.sha256 = want;
    }
    Ok(publish)
}

/// The SHA-256 of a file's contents, in lower-case hex (what `PublishWeights.sha256` holds).
pub fn sha256_file(path: &std::path::Path) -> std::io::Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

type FeedStream = Pin<Box<dyn Stream<Item = Result<TrainerFeedItem, Status>> + Send>>;

#[tonic::async_trait]
impl TrainerFeed for Feed {
    type FeedStream = FeedStream;

    async fn feed(
        &self,
        request: Request<Streaming<TrainerFeedRequest>>,
    ) -> Result<Response<Self::FeedStream>, Status> {
        let mut incoming = request.into_inner();
        let first = tokio::time::timeout(std::time::Duration::from_secs(10), incoming.next())
            .await
            .map_err(|_| Status::deadline_exceeded("no subscribe within 10 s"))?;
        let subscribe = match first {
            Some(Ok(TrainerFeedRequest {
                message: Some(trainer_feed_request::Message::Subscribe(s)),
            })) => s,
            Some(Ok(_)) => {
                return Err(Status::invalid_argument(
                    "the first message on the feed must be a FeedSubscribe",
                ));
            }
            Some(Err(status)) => return Err(status),
            None => return Err(Status::cancelled("the feed ended before its subscribe")),
        };
        if let Some(message) = self.slot.unknown(&subscribe.job, "subscribe.job") {
            return Err(Status::not_found(message));
        }
        let log = self.log.clone();
        let reader = log.become_reader(&subscribe.job).await?;
        let resume = log.resume_point(subscribe.resume_from)?;
        let first = !std::mem::replace(&mut log.lock().subscribed, true);
        if first {
            let _ = self.actor.send(crate::actor::Event::FeedSubscribed).await;
        }
        let window = u64::from(if subscribe.window == 0 {
            DEFAULT_WINDOW
        } else {
            subscribe.window
        });
        let (tx, rx) = mpsc::channel(64);
        let actor = self.actor.clone();
        let weights_root = self.weights_root.clone();
        tokio::spawn(async move {
            // Held for the life of the stream: another trainer may subscribe once it is gone.
            let _reader = reader;
            let mut last = log.last.subscribe();
            let mut next = resume;
            loop {
                let ended = {
                    let log = log.lock();
                    log.closed.then(|| log.ended_without_success.clone())
                };
                if let Some(unsuccessful) = ended {
                    if let Some(why) = unsuccessful {
                        let _ = tx.send(Err(Status::aborted(why))).await;
                    }
                    return;
                }
                let appended = *last.borrow_and_update();
                let until = appended.min(log.acked().saturating_add(window));
                if next <= until {
                    let items = match log.items(next, until) {
                        Ok(items) => items,
                        Err(missed) => {
                            let _ = tx.send(Err(missed)).await;
                            return;
                        }
                    };
                    for item in items {
                        if tx.send(Ok(item)).await.is_err() {
                            return;
                        }
                    }
                    log.sent(until);
                    next = until + 1;
                }
                tokio::select! {
                    changed = last.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                    message = incoming.next() => match message {
                        Some(Ok(TrainerFeedRequest { message: Some(m) })) => match m {
                            trainer_feed_request::Message::AckThrough(n) => {
                                if n >= next {
                                    let _ = tx
                                        .send(Err(Status::invalid_argument(format!(
                                            "ack_through: {n} was never sent (sent through {})",
                                            next - 1
                                        ))))
                                        .await;
                                    return;
                                }
                                log.ack(n);
                            }
                            trainer_feed_request::Message::Publish(publish) => {
                                let answer =
                                    publication_answer(publish, weights_root.clone(), &actor)
                                        .await;
                                let item = TrainerFeedItem {
                                    item: Some(trainer_feed_item::Item::Publication(answer)),
                                };
                                if tx.send(Ok(item)).await.is_err() {
                                    return;
                                }
                            }
                            trainer_feed_request::Message::Subscribe(_) => {
                                let _ = tx
                                    .send(Err(Status::invalid_argument(
                                        "a second FeedSubscribe on the same feed",
                                    )))
                                    .await;
                                return;
                            }
                        },
                        Some(Ok(_)) => {
                            let _ = tx
                                .send(Err(Status::invalid_argument("an empty feed message")))
                                .await;
                            return;
                        }
                        // The trainer left; unacknowledged items wait for its return.
                        Some(Err(_)) | None => return,
                    },
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Checks a publication (off the async threads: a checksum reads the whole file) and, when it
/// passes, has the actor take or refuse it.
async fn publication_answer(
    publish: PublishWeights,
    weights_root: Option<std::path::PathBuf>,
    actor: &mpsc::Sender<crate::actor::Event>,
) -> PublicationAnswer {
    let version = publish.version;
    let refused = |reason: String| PublicationAnswer {
        version,
        accepted: false,
        reason,
    };
    let checked =
        tokio::task::spawn_blocking(move || check_publication(publish, weights_root.as_deref()))
            .await;
    let publish = match checked {
        Ok(Ok(publish)) => publish,
        Ok(Err(reason)) => return refused(reason),
        Err(e) => return refused(format!("the publication could not be checked: {e}")),
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    if actor
        .send(crate::actor::Event::Publish { publish, reply })
        .await
        .is_err()
    {
        return refused("the scheduler is shutting down".into());
    }
    answer
        .await
        .unwrap_or_else(|_| refused("the scheduler is shutting down".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(count: u64, without_trainer: bool) -> FeedLog {
        let log = FeedLog::default();
        if without_trainer {
            log.without_trainer();
        }
        for _ in 0..count {
            log.append(CompletedTrajectory::default(), None);
        }
        log
    }

    #[test]
    fn an_emulated_trainer_jobs_feed_keeps_only_its_newest_items_and_says_which_a_reader_missed() {
        let log = filled(1100, true);
        let kept = UNREAD_KEPT_WITHOUT_TRAINER as u64;
        assert_eq!(log.lock().entries.len() as u64, kept);
        let first_kept = 1100 - kept + 1;
        assert_eq!(log.resume_point(0).unwrap(), first_kept);
        log.sent(1100);
        let missed = log.resume_point(5).unwrap_err();
        assert_eq!(missed.code(), tonic::Code::OutOfRange);
        assert!(
            missed
                .message()
                .contains(&format!("resume from {first_kept} or later")),
            "{missed:?}"
        );
        assert!(log.items(first_kept - 1, first_kept + 3).is_err());
        assert_eq!(log.items(first_kept, first_kept + 3).unwrap().len(), 4);
    }

    #[test]
    fn an_external_trainers_feed_keeps_every_item_until_it_is_acknowledged() {
        let log = filled(1100, false);
        assert_eq!(log.lock().entries.len(), 1100);
        assert_eq!(log.resume_point(0).unwrap(), 1);
    }

    #[test]
    fn after_a_replay_a_trainer_may_resume_after_any_item_the_killed_scheduler_appended() {
        let log = filled(40, false);
        assert!(log.resume_point(41).is_err(), "nothing was sent yet");
        log.replayed();
        assert_eq!(log.resume_point(41).unwrap(), 41);
        assert_eq!(log.acked(), 40);
    }
}
