//! The scheduler's log: `tracing` events written to stderr for people (text, or JSON lines for a
//! cluster's log collector), filtered by `RUST_LOG`, and the newest of them kept in memory so
//! that `rollfleet job logs` reads them over the JobService without any collector.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::{Mutex, MutexGuard, OnceLock};

use rollfleet_proto::v1::LogLine;
use tokio::sync::broadcast;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Lines kept for `rollfleet job logs`: a job's start and its last minutes of events at the
/// rates a scheduler logs (a line per worker event, not per stage).
pub const KEPT_LINES: usize = 4096;
/// Longest message kept (a line is cut there, and says so), so that the buffer stays bounded
/// whatever a peer's text makes the scheduler log.
pub const MAX_LINE_BYTES: usize = 2048;
/// Lines a follower may fall behind before it is told it missed some.
const FOLLOW_BACKLOG: usize = 1024;

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One line per event for people: time, level, message.
    #[default]
    Text,
    /// One JSON object per line (time, level, target, message, fields), for log collectors.
    Json,
}

/// Why the log could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("RUST_LOG: {0}")]
    Filter(String),
    #[error("a logger is already installed in this process")]
    AlreadyInstalled,
}

/// The newest log lines, and a channel that tells followers of every new one.
pub struct RecentLogs {
    inner: Mutex<Kept>,
    followers: broadcast::Sender<LogLine>,
}

struct Kept {
    lines: VecDeque<LogLine>,
    next_seq: u64,
}

impl RecentLogs {
    fn new() -> RecentLogs {
        RecentLogs {
            inner: Mutex::new(Kept {
                lines: VecDeque::with_capacity(KEPT_LINES),
                next_seq: 1,
            }),
            followers: broadcast::channel(FOLLOW_BACKLOG).0,
        }
    }

    /// The process's log buffer (empty in a process that installed no logger).
    pub fn global() -> &'static RecentLogs {
        static LOGS: OnceLock<RecentLogs> = OnceLock::new();
        LOGS.get_or_init(RecentLogs::new)
    }

    fn lock(&self) -> MutexGuard<'_, Kept> {
        // A line is pushed whole or not at all: a panic elsewhere leaves the buffer consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `line` (numbering it) and hands it to every follower.
    pub fn push(&self, mut line: LogLine) {
        let mut kept = self.lock();
        line.seq = kept.next_seq;
        kept.next_seq += 1;
        if kept.lines.len() == KEPT_LINES {
            kept.lines.pop_front();
        }
        kept.lines.push_back(line.clone());
        // Sent under the lock, so that a follower's snapshot and its stream neither overlap nor
        // leave a gap. No follower is no error.
        let _ = self.followers.send(line);
    }

    /// The newest `tail` lines kept (all of them for 0), oldest first.
    pub fn tail(&self, tail: usize) -> Vec<LogLine> {
        let kept = self.lock();
        let skip = if tail == 0 {
            0
        } else {
            kept.lines.len().saturating_sub(tail)
        };
        kept.lines.iter().skip(skip).cloned().collect()
    }

    /// The newest `tail` lines and a receiver of every line after them.
    pub fn follow(&self, tail: usize) -> (Vec<LogLine>, broadcast::Receiver<LogLine>) {
        let kept = self.lock();
        let receiver = self.followers.subscribe();
        let skip = if tail == 0 {
            0
        } else {
            kept.lines.len().saturating_sub(tail)
        };
        (kept.lines.iter().skip(skip).cloned().collect(), receiver)
    }
}

/// The `tracing` layer that keeps events in [`RecentLogs::global`].
pub struct KeepRecent;

impl<S: Subscriber> Layer<S> for KeepRecent {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut text = Text::default();
        event.record(&mut text);
        let mut message = text.message;
        if !text.fields.is_empty() {
            if !message.is_empty() {
                message.push(' ');
            }
            message.push_str(&text.fields);
        }
        let metadata = event.metadata();
        RecentLogs::global().push(LogLine {
            seq: 0,
            unix_ms: unix_ms(),
            level: metadata.level().as_str().to_owned(),
            target: metadata.target().to_owned(),
            message: bounded(message),
        });
    }
}

/// An event's message and its other fields as `name=value`.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            self.field(field, format_args!("{value:?}"));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            self.field(field, format_args!("{value:?}"));
        }
    }
}

impl Text {
    fn field(&mut self, field: &Field, value: std::fmt::Arguments<'_>) {
        if !self.fields.is_empty() {
            self.fields.push(' ');
        }
        let _ = write!(self.fields, "{}={value}", field.name());
    }
}

fn bounded(mut message: String) -> String {
    if message.len() > MAX_LINE_BYTES {
        let mut cut = MAX_LINE_BYTES;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        let more = message.len() - cut;
        message.truncate(cut);
        let _ = write!(message, "... ({more} more bytes)");
    }
    message
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Installs the process's logger: events at the `RUST_LOG` levels (default `info`) to stderr in
/// `format`, and kept for `rollfleet job logs`.
pub fn init(format: LogFormat) -> Result<(), LogError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => {
            EnvFilter::try_new(&directives).map_err(|e| LogError::Filter(e.to_string()))?
        }
        _ => EnvFilter::new("info"),
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let text = (format == LogFormat::Text).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(ansi)
    });
    let json = (format == LogFormat::Json).then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_current_span(false)
    });
    tracing_subscriber::registry()
        .with(filter)
        .with(text)
        .with(json)
        .with(KeepRecent)
        .try_init()
        .map_err(|_| LogError::AlreadyInstalled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(message: &str) -> LogLine {
        LogLine {
            level: "INFO".into(),
            message: message.into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_buffer_keeps_the_newest_lines_numbered_in_order() {
        let logs = RecentLogs::new();
        for i in 0..KEPT_LINES + 10 {
            logs.push(line(&format!("line {i}")));
        }
        let all = logs.tail(0);
        assert_eq!(all.len(), KEPT_LINES);
        assert_eq!(all[0].message, "line 10");
        assert_eq!(all[0].seq, 11);
        assert!(all.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        let last = logs.tail(3);
        assert_eq!(
            last.iter().map(|l| l.message.as_str()).collect::<Vec<_>>(),
            [
                format!("line {}", KEPT_LINES + 7),
                format!("line {}", KEPT_LINES + 8),
                format!("line {}", KEPT_LINES + 9)
            ]
        );
    }

    #[test]
    fn a_follower_gets_the_tail_then_every_later_line_without_gap_or_repeat() {
        let logs = RecentLogs::new();
        logs.push(line("a"));
        logs.push(line("b"));
        let (tail, mut rx) = logs.follow(1);
        logs.push(line("c"));
        assert_eq!(tail.len(), 1);
        assert_eq!(tail[0].message, "b");
        let next = rx.try_recv().expect("the line after the tail");
        assert_eq!((next.message.as_str(), next.seq), ("c", 3));
    }

    #[test]
    fn a_huge_message_is_cut_and_says_how_much_was_left_out() {
        let message = bounded("é".repeat(MAX_LINE_BYTES));
        assert!(message.len() < MAX_LINE_BYTES + 40);
        assert!(message.ends_with(&format!("({} more bytes)", MAX_LINE_BYTES)));
    }
}
