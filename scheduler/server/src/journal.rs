//! The scheduler's journal (`rollfleet scheduler --journal FILE`): what lets a scheduler that
//! was killed come back with its job.
//!
//! The actor decides from the events it takes (a registration, a worker's message, the core's
//! timer, its own tick) and from their times, and from nothing else: no clock read in the middle
//! of a decision, no answer from the outside world. So a record of every event with its time,
//! written before the actor acts on it, is the job's whole state: a scheduler started on the
//! file replays the records through a fresh actor and stands where the killed one stood, bit for
//! bit (the core is deterministic, and so is everything the actor keeps beside it). Then it
//! writes a `recovered` record and handles it like any other: every worker of the killed
//! scheduler is gone with its streams, so their stages go back to the queues and their replicas
//! to the workers that register again.
//!
//! The file is a [`JournalHeader`] then [`JournalRecord`]s, each prefixed by its length as a
//! varint. The records of the events the actor takes together (those waiting in its inbox) are
//! handed to the operating system (buffered, so one `write` for a small batch) before it acts on
//! any of them, so a killed process loses nothing it acted on; a torn record at the end (the
//! process died in the middle of writing it, before acting on it) is cut off when the file is
//! opened again.
//! Unless asked to ([`JournalWriter::syncing`], `--journal-sync`), the file is not `fsync`ed: a
//! killed process loses nothing, but a machine that loses power can lose records the actor had
//! acted on, and a journal that lost them is not one to resume from. Syncing, every batch is on
//! the disk (`fdatasync`) before any of its events is acted on: the events that arrive meanwhile
//! make the next batch bigger, so one sync covers more of them as the load grows.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use prost::Message;
use rollfleet_proto::v1::{JournalHeader, JournalRecord};

/// What the header's `format` says.
pub const FORMAT: &str = "rollfleet-journal-v1";

/// The largest record the reader takes (a worker's message is at most a few MB on the wire).
const MAX_RECORD_BYTES: u64 = 64 << 20;

/// What went wrong with a journal.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The file could not be read or written.
    #[error("journal {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not a journal, or is damaged before its end.
    #[error("journal {path}: {reason} (at byte {offset})")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Where.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// There is nothing to replay: no such file, or an empty one.
    #[error("journal {path}: no such file, or an empty one: nothing to replay")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The journal was written by a scheduler with other settings: replaying it would not give
    /// its state back.
    #[error(
        "journal {path} was written with {field} {journal}; this scheduler has {given} (start it \
         with the journal's settings, or with another journal file to run the job afresh)"
    )]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// The setting (a flag or the job file).
        field: &'static str,
        /// Its value in the journal.
        journal: String,
        /// Its value now.
        given: String,
    },
}

/// Appends records to a journal file.
pub struct JournalWriter {
    path: PathBuf,
    out: BufWriter<File>,
    buf: Vec<u8>,
    /// Whether [`JournalWriter::flush`] waits for the records to reach the disk.
    sync: bool,
}

impl JournalWriter {
    /// Creates (or empties) `path` and writes `header`.
    pub fn create(path: &Path, header: &JournalHeader) -> Result<JournalWriter, JournalError> {
        let file = File::create(path).map_err(|source| io(path, source))?;
        let mut writer = JournalWriter {
            path: path.to_owned(),
            out: BufWriter::new(file),
            buf: Vec::with_capacity(1024),
            sync: false,
        };
        writer.put(header)?;
        writer.flush()?;
        Ok(writer)
    }

    /// Opens `path` to append after its first `valid_bytes` (what [`JournalReader`] read whole;
    /// a torn record after them is cut off).
    pub fn append(path: &Path, valid_bytes: u64) -> Result<JournalWriter, JournalError> {
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|source| io(path, source))?;
        file.set_len(valid_bytes)
            .map_err(|source| io(path, source))?;
        let mut out = BufWriter::new(file);
        std::io::Seek::seek(&mut out, std::io::SeekFrom::End(0))
            .map_err(|source| io(path, source))?;
        Ok(JournalWriter {
            path: path.to_owned(),
            out,
            buf: Vec::with_capacity(1024),
            sync: false,
        })
    }

    /// From now on, every [`JournalWriter::flush`] also waits until the records are on the disk
    /// (`fdatasync`), so that a machine losing power loses none the scheduler acted on. Turning
    /// it on syncs what is written so far, and the directory that holds the file (a new file's
    /// name is an entry of its directory, which must reach the disk too).
    pub fn syncing(mut self, sync: bool) -> Result<JournalWriter, JournalError> {
        self.sync = sync;
        if sync {
            self.flush()?;
            self.out
                .get_ref()
                .sync_all()
                .map_err(|source| io(&self.path, source))?;
            let dir = match self.path.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir,
                _ => Path::new("."),
            };
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|source| io(dir, source))?;
        }
        Ok(self)
    }

    /// Writes `record` into the buffer; it reaches the file at the next [`JournalWriter::flush`].
    pub fn write(&mut self, record: &JournalRecord) -> Result<(), JournalError> {
        self.put(record)
    }

    /// Hands every record written so far to the operating system (one `write`), and when
    /// [syncing](JournalWriter::syncing), waits until they are on the disk.
    pub fn flush(&mut self) -> Result<(), JournalError> {
        self.out.flush().map_err(|source| io(&self.path, source))?;
        if self.sync {
            self.out
                .get_ref()
                .sync_data()
                .map_err(|source| io(&self.path, source))?;
        }
        Ok(())
    }

    fn put(&mut self, message: &impl Message) -> Result<(), JournalError> {
        self.buf.clear();
        message
            .encode_length_delimited(&mut self.buf)
            .map_err(|e| io(&self.path, std::io::Error::other(e)))?;
        self.out
            .write_all(&self.buf)
            .map_err(|source| io(&self.path, source))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Gives the journal up after a failed write: drops what is still buffered, unwritten (a
    /// `BufWriter` dropped whole would try to write it once more, and on a disk the emptying
    /// just freed it could land past the new end, leaving zeros where the header was), and
    /// empties the file, so that a restart on it starts the job afresh instead of resuming from
    /// a journal with a gap in it.
    pub fn abandon(self) -> Result<(), JournalError> {
        let (file, _unwritten) = self.out.into_parts();
        file.set_len(0).map_err(|source| io(&self.path, source))
    }
}

/// Reads a journal file's records in order.
pub struct JournalReader {
    path: PathBuf,
    input: BufReader<File>,
    /// Bytes of whole records (and the header) read so far.
    valid: u64,
    /// Bytes of a torn record at the end, once the end is reached.
    torn: u64,
    buf: Vec<u8>,
}

impl JournalReader {
    /// Opens `path` and reads its header; `None` when the file does not exist or is empty (a
    /// new journal).
    pub fn open(path: &Path) -> Result<Option<(JournalHeader, JournalReader)>, JournalError> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(io(path, source)),
        };
        let len = file.metadata().map_err(|source| io(path, source))?.len();
        if len == 0 {
            return Ok(None);
        }
        let mut reader = JournalReader {
            path: path.to_owned(),
            input: BufReader::with_capacity(1 << 16, file),
            valid: 0,
            torn: 0,
            buf: Vec::new(),
        };
        let header: JournalHeader = match reader.next_message()? {
            Some(h) => h,
            None => {
                return Err(reader.corrupt(
                    0,
                    "not a rollfleet journal, or one whose scheduler was killed while writing its \
                     header (before serving anything: delete it to start the job afresh)"
                        .into(),
                ));
            }
        };
        if header.format != FORMAT {
            return Err(reader.corrupt(
                0,
                format!(
                    "not a rollfleet journal (format {:?}, expected {FORMAT:?})",
                    header.format
                ),
            ));
        }
        Ok(Some((header, reader)))
    }

    /// The next record; `None` at the end (a torn record there counts as the end: see
    /// [`JournalReader::torn_bytes`]).
    pub fn next_record(&mut self) -> Result<Option<JournalRecord>, JournalError> {
        self.next_message()
    }

    /// Bytes of whole records read so far (where appending goes on).
    pub fn valid_bytes(&self) -> u64 {
        self.valid
    }

    /// Bytes of a torn record found at the end (0 when the file ended on a record).
    pub fn torn_bytes(&self) -> u64 {
        self.torn
    }

    fn next_message<M: Message + Default>(&mut self) -> Result<Option<M>, JournalError> {
        let start = self.valid;
        let mut len: u64 = 0;
        let mut read = 0u64;
        loop {
            let mut byte = [0u8; 1];
            match self.input.read(&mut byte) {
                Ok(0) => {
                    self.torn = read;
                    return Ok(None);
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => return Err(io(&self.path, source)),
            }
            if read >= 10 {
                return Err(self.corrupt(start, "a record's length is not a varint".into()));
            }
            len |= u64::from(byte[0] & 0x7f) << (7 * read);
            read += 1;
            if byte[0] & 0x80 == 0 {
                break;
            }
        }
        if len > MAX_RECORD_BYTES {
            return Err(self.corrupt(
                start,
                format!("a record says it is {len} bytes long (at most {MAX_RECORD_BYTES})"),
            ));
        }
        self.buf.clear();
        let got = (&mut self.input)
            .take(len)
            .read_to_end(&mut self.buf)
            .map_err(|source| io(&self.path, source))? as u64;
        if got < len {
            self.torn = read + got;
            return Ok(None);
        }
        let message = M::decode(self.buf.as_slice())
            .map_err(|e| self.corrupt(start, format!("a record does not decode: {e}")))?;
        self.valid = start + read + len;
        Ok(Some(message))
    }

    fn corrupt(&self, offset: u64, reason: String) -> JournalError {
        JournalError::Corrupt {
            path: self.path.clone(),
            offset,
            reason,
        }
    }
}

fn io(path: &Path, source: std::io::Error) -> JournalError {
    JournalError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Checks that `header` was written with the settings of `now`; the first that differs is the
/// error.
pub fn check_header(
    path: &Path,
    journal: &JournalHeader,
    now: &JournalHeader,
) -> Result<(), JournalError> {
    let mismatch = |field: &'static str, journal: String, given: String| JournalError::Mismatch {
        path: path.to_owned(),
        field,
        journal,
        given,
    };
    if journal.job_yaml != now.job_yaml {
        return Err(mismatch(
            "the job file",
            format!("of {} bytes", journal.job_yaml.len()),
            format!("another, of {} bytes", now.job_yaml.len()),
        ));
    }
    // Each as the flag takes it; a float's shortest text is exact, so equal texts are equal
    // values.
    let drift = |d: Option<f64>| d.map_or_else(|| "none".to_owned(), |d| d.to_string());
    let settings = [
        ("--seed", journal.seed.to_string(), now.seed.to_string()),
        (
            "--time-scale",
            journal.time_scale.to_string(),
            now.time_scale.to_string(),
        ),
        (
            "--lease-ms",
            journal.lease_ttl_ms.to_string(),
            now.lease_ttl_ms.to_string(),
        ),
        (
            "--expect-workers",
            journal.expect_workers.to_string(),
            now.expect_workers.to_string(),
        ),
        (
            "a stage timeout (ms) of",
            journal.stage_timeout_ms.to_string(),
            now.stage_timeout_ms.to_string(),
        ),
        (
            "--replan-on-drift",
            drift(journal.replan_on_drift),
            drift(now.replan_on_drift),
        ),
    ];
    match settings.into_iter().find(|(_, j, n)| j != n) {
        Some((field, journal, given)) => Err(mismatch(field, journal, given)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> JournalHeader {
        JournalHeader {
            format: FORMAT.into(),
            job_yaml: "name: j\n".into(),
            seed: 7,
            time_scale: 0.5,
            lease_ttl_ms: 3000,
            expect_workers: 5,
            replan_on_drift: None,
            stage_timeout_ms: 60_000,
        }
    }

    fn tick(at_ns: u64) -> JournalRecord {
        JournalRecord {
            at_ns,
            event: Some(rollfleet_proto::v1::journal_record::Event::Tick(true)),
        }
    }

    fn read_all(path: &Path) -> (JournalHeader, Vec<JournalRecord>, u64, u64) {
        let (h, mut r) = JournalReader::open(path).unwrap().unwrap();
        let mut records = Vec::new();
        while let Some(rec) = r.next_record().unwrap() {
            records.push(rec);
        }
        (h, records, r.valid_bytes(), r.torn_bytes())
    }

    #[test]
    fn records_written_are_read_back_in_order_and_appending_goes_on_after_them() {
        let dir = std::env::temp_dir().join(format!("rollfleet-journal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.journal");
        let mut w = JournalWriter::create(&path, &header()).unwrap();
        for t in 1..=3 {
            w.write(&tick(t)).unwrap();
        }
        w.flush().unwrap();
        drop(w);
        let (h, records, valid, torn) = read_all(&path);
        assert_eq!(h, header());
        assert_eq!(records, vec![tick(1), tick(2), tick(3)]);
        assert_eq!(torn, 0);
        let mut w = JournalWriter::append(&path, valid).unwrap();
        w.write(&tick(4)).unwrap();
        drop(w);
        assert_eq!(read_all(&path).1.len(), 4);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_record_torn_at_the_end_is_the_end_and_is_cut_off_when_appending() {
        let dir = std::env::temp_dir().join(format!("rollfleet-journal-t-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.journal");
        let mut w = JournalWriter::create(&path, &header()).unwrap();
        w.write(&tick(1)).unwrap();
        w.write(&tick(1_000_000)).unwrap();
        drop(w);
        let full = std::fs::metadata(&path).unwrap().len();
        // The process died two bytes into its last record.
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(full - 3).unwrap();
        drop(file);
        let (_, records, valid, torn) = read_all(&path);
        assert_eq!(records, vec![tick(1)]);
        assert!(torn > 0, "the torn record is reported");
        let mut w = JournalWriter::append(&path, valid).unwrap();
        w.write(&tick(2)).unwrap();
        drop(w);
        let (_, records, _, torn) = read_all(&path);
        assert_eq!(records, vec![tick(1), tick(2)]);
        assert_eq!(torn, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_abandoned_journal_is_left_empty_and_what_it_still_buffered_is_never_written() {
        let dir = std::env::temp_dir().join(format!("rollfleet-journal-a-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.journal");
        let mut w = JournalWriter::create(&path, &header()).unwrap();
        w.write(&tick(1)).unwrap();
        w.flush().unwrap();
        // Buffered, not yet handed over: a writer dropped whole would write it on its way out,
        // at the offset it had reached, past the end of the emptied file.
        w.write(&tick(2)).unwrap();
        w.abandon().unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        assert!(
            JournalReader::open(&path).unwrap().is_none(),
            "nothing to replay"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_syncing_journal_reads_back_whole_after_every_flush_and_after_appending() {
        let dir = std::env::temp_dir().join(format!("rollfleet-journal-s-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.journal");
        let mut w = JournalWriter::create(&path, &header())
            .unwrap()
            .syncing(true)
            .unwrap();
        w.write(&tick(1)).unwrap();
        w.flush().unwrap();
        // Flushed means handed over (and synced): readable before the writer is gone.
        assert_eq!(read_all(&path).1, vec![tick(1)]);
        drop(w);
        let valid = read_all(&path).2;
        let mut w = JournalWriter::append(&path, valid)
            .unwrap()
            .syncing(true)
            .unwrap();
        w.write(&tick(2)).unwrap();
        w.flush().unwrap();
        assert_eq!(read_all(&path).1, vec![tick(1), tick(2)]);
        drop(w);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_journal_or_is_missing_or_empty_is_said_so() {
        let dir = std::env::temp_dir().join(format!("rollfleet-journal-n-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("n.journal");
        assert!(JournalReader::open(&path).unwrap().is_none());
        std::fs::write(&path, b"").unwrap();
        assert!(JournalReader::open(&path).unwrap().is_none());
        std::fs::write(&path, b"name: a job file, not a journal\n").unwrap();
        let err = JournalReader::open(&path).err().unwrap().to_string();
        assert!(err.contains("n.journal"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_journal_of_other_settings_is_refused_naming_the_setting() {
        let path = Path::new("j.journal");
        assert!(check_header(path, &header(), &header()).is_ok());
        let mut other = header();
        other.expect_workers = 6;
        let err = check_header(path, &header(), &other)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--expect-workers 5") && err.contains("has 6"),
            "{err}"
        );
        let mut other = header();
        other.job_yaml = "name: k\n".into();
        let err = check_header(path, &header(), &other)
            .unwrap_err()
            .to_string();
        assert!(err.contains("the job file"), "{err}");
    }
}
