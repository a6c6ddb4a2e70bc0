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
//! # The file
//!
//! A [`JournalHeader`] (format [`FORMAT`]) then [`JournalRecord`]s, each in a frame of its own:
//!
//! ```text
//! length    u32, little-endian: the bytes of the message (at most 64 MiB)
//! check     u32, little-endian: CRC32C (Castagnoli) of the 4 bytes of `length`
//! message   `length` bytes, protobuf
//! checksum  u32, little-endian: CRC32C of the 4 bytes of `length`, then the message
//! ```
//!
//! The length has a check of its own so that a damaged length is never taken for a record cut
//! short: without it, a length that grew would send the reader past the end of the file, and
//! the rest of the journal would look like a torn record to cut off. A fixed-size length keeps
//! every bit of the frame at a place the checks cover, whatever a bit flip does to the value.
//! A frame costs 12 bytes beside its message.
//!
//! # Torn, or damaged
//!
//! The records of the events the actor takes together (those waiting in its inbox) are handed
//! to the operating system (buffered, so one `write` for a small batch) before it acts on any of
//! them, so a killed process loses nothing it acted on. A process killed in the middle of that
//! `write` leaves the file ending inside a frame: a *torn* record, which the scheduler never
//! acted on. That, and only that, is cut off when the journal is resumed
//! ([`JournalWriter::append`]): the file ends before a frame does, inside its first 8 bytes
//! (too few to check), or after a length whose check holds and before the message and its
//! checksum are all there.
//!
//! Anything else is damage, and the reader refuses the file ([`JournalError::Corrupt`], naming
//! the byte and the record) rather than resume from less than the journal held: a length whose
//! check fails, a length over the limit, a whole frame whose checksum fails, a message that does
//! not decode, zeros where a frame should start. A whole last frame with a bad checksum is
//! damage too, not a torn write: an append cut short leaves the file shorter than the frame, so
//! a frame of full length with wrong bytes comes from elsewhere (a machine that lost power
//! before the file reached the disk, the disk, a hand), and such a journal may have lost records
//! the actor acted on. Nothing is cut off or rewritten on damage: the file stays as it
//! is, to be looked into, and the scheduler is started on another journal file.
//!
//! A journal of an older format (`rollfleet-journal-v1`: each message prefixed by its length as
//! a varint, with no checksum) is refused, saying so ([`JournalError::OtherFormat`]).
//!
//! # Syncing
//!
//! Unless asked to ([`JournalWriter::syncing`], `--journal-sync`), the file is not `fsync`ed: a
//! killed process loses nothing, but a machine that loses power can lose records the actor had
//! acted on, and a journal that lost them is not one to resume from. Syncing, every batch is on
//! the disk (`fdatasync`) before any of its events is acted on: the events that arrive meanwhile
//! make the next batch bigger, so one sync covers more of them as the load grows.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use prost::Message;
use rollfleet_proto::v1::{JournalHeader, JournalRecord};

/// What the header's `format` says.
pub const FORMAT: &str = "rollfleet-journal-v2";

/// How every format of the journal starts, this one and the older.
const FORMAT_FAMILY: &str = "rollfleet-journal-";

/// The format before the frames had checksums.
const FORMAT_V1: &str = "rollfleet-journal-v1";

/// The largest record the reader takes (a worker's message is at most a few MB on the wire).
const MAX_RECORD_BYTES: u64 = 64 << 20;

/// A frame's length and the check of the length.
const HEAD_BYTES: usize = 8;

/// A frame's checksum, after the message.
const CHECKSUM_BYTES: usize = 4;

/// What a frame adds to its message.
const FRAME_OVERHEAD: u64 = (HEAD_BYTES + CHECKSUM_BYTES) as u64;

/// What to do about a journal the scheduler cannot resume from.
const START_AFRESH: &str = "the scheduler does not resume from it, and the file is kept as it \
                            is (nothing was cut off or overwritten): start the scheduler with \
                            another journal file to run the job afresh";

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
    /// The file is not a journal, or is damaged: anything but a record torn at its end.
    #[error("journal {path}, at byte {offset}: {reason}; {advice}", advice = START_AFRESH)]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Where the damaged frame (or region) starts.
        offset: u64,
        /// What is wrong: the record, what was expected and what was found.
        reason: String,
    },
    /// The journal was written in another format of it (by another version of rollfleet).
    #[error(
        "journal {path} is in format {format:?}, written by {written_by}; this scheduler reads \
         only {expected:?} and cannot resume from it. The file is kept as it is: start the \
         scheduler with another journal file to run the job afresh, or finish the job with the \
         rollfleet that wrote it",
        expected = FORMAT
    )]
    OtherFormat {
        /// The file.
        path: PathBuf,
        /// The format the file says it has.
        format: String,
        /// Which rollfleet wrote it, as far as the format tells.
        written_by: &'static str,
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

    /// Opens `path` to append after its first `valid_bytes` (what [`JournalReader`] read whole).
    /// What follows them is cut off only if it is a torn record: the start of a frame that the
    /// file ends inside. Anything else there (a whole frame, a damaged one) is refused with
    /// [`JournalError::Corrupt`] and the file is left as it is.
    pub fn append(path: &Path, valid_bytes: u64) -> Result<JournalWriter, JournalError> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| io(path, source))?;
        let len = file.metadata().map_err(|source| io(path, source))?.len();
        if len < valid_bytes {
            return Err(corrupt(
                path,
                len,
                format!(
                    "the file is {len} bytes long, shorter than the {valid_bytes} bytes of whole \
                     records read from it: it changed while it was read"
                ),
            ));
        }
        if len > valid_bytes {
            check_torn(&mut file, path, valid_bytes, len - valid_bytes)?;
            file.set_len(valid_bytes)
                .map_err(|source| io(path, source))?;
        }
        file.seek(SeekFrom::End(0))
            .map_err(|source| io(path, source))?;
        Ok(JournalWriter {
            path: path.to_owned(),
            out: BufWriter::new(file),
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

    /// Frames `message` (see the module's documentation) into the buffer.
    fn put(&mut self, message: &impl Message) -> Result<(), JournalError> {
        let len = message.encoded_len();
        // A record the reader would refuse must not be written: the journal would end there.
        let len32 = match u32::try_from(len) {
            Ok(n) if u64::from(n) <= MAX_RECORD_BYTES => n,
            _ => {
                return Err(io(
                    &self.path,
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!(
                            "a record of {len} bytes is over the journal's limit of \
                             {MAX_RECORD_BYTES} bytes"
                        ),
                    ),
                ));
            }
        };
        let len_bytes = len32.to_le_bytes();
        self.buf.clear();
        self.buf.extend_from_slice(&len_bytes);
        self.buf
            .extend_from_slice(&crc32c(&len_bytes).to_le_bytes());
        message
            .encode(&mut self.buf)
            .map_err(|e| io(&self.path, std::io::Error::other(e)))?;
        let checksum = crc32c_append(crc32c(&len_bytes), &self.buf[HEAD_BYTES..]);
        self.buf.extend_from_slice(&checksum.to_le_bytes());
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

/// What the reader found where the next frame should be.
enum Frame {
    /// A whole frame whose checks hold; its message is the first `len` bytes of the buffer.
    Whole {
        /// The message's bytes.
        len: usize,
    },
    /// The file ends here, between two frames.
    End,
    /// The file ends inside a frame, this many bytes into it.
    Torn(u64),
}

/// Reads a journal file's records in order.
pub struct JournalReader {
    path: PathBuf,
    input: BufReader<File>,
    /// Bytes of whole records (and the header) read so far.
    valid: u64,
    /// Bytes of a torn record at the end, once the end is reached.
    torn: u64,
    /// Whole frames read so far, the header included: the next record's number.
    frames: u64,
    /// The end was reached (a torn record there included).
    ended: bool,
    /// The damage found, given again to a caller that asks for more.
    failed: Option<(u64, String)>,
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
            frames: 0,
            ended: false,
            failed: None,
            buf: Vec::new(),
        };
        let header = match reader.next_frame() {
            Ok(Frame::Whole { len }) => match JournalHeader::decode(&reader.buf[..len]) {
                Ok(header) => {
                    reader.commit(len);
                    header
                }
                Err(e) => {
                    return Err(reader.fail(
                        0,
                        format!(
                            "not a rollfleet journal: its header's checksums hold but it does not \
                             decode ({e})"
                        ),
                    ));
                }
            },
            // The file is not empty, so this is the file shrinking under the reader.
            Ok(Frame::End) => return Ok(None),
            Ok(Frame::Torn(n)) => {
                return Err(older_format(path).unwrap_or_else(|| {
                    corrupt(
                        path,
                        0,
                        format!(
                            "the file ends {n} bytes into the header: not a rollfleet journal, or \
                             one whose scheduler was killed while writing its header, before \
                             serving anything (there is nothing to resume)"
                        ),
                    )
                }));
            }
            Err(JournalError::Corrupt { reason, .. }) => {
                return Err(older_format(path).unwrap_or_else(|| {
                    corrupt(
                        path,
                        0,
                        format!(
                            "not a rollfleet journal, or one whose header is damaged: {reason}"
                        ),
                    )
                }));
            }
            Err(e) => return Err(e),
        };
        if header.format != FORMAT {
            if header.format.starts_with(FORMAT_FAMILY) {
                return Err(JournalError::OtherFormat {
                    path: path.to_owned(),
                    written_by: written_by(&header.format),
                    format: header.format,
                });
            }
            return Err(reader.fail(
                0,
                format!(
                    "not a rollfleet journal: its header says format {:?}, expected {FORMAT:?}",
                    header.format
                ),
            ));
        }
        Ok(Some((header, reader)))
    }

    /// The next record; `None` at the end (a torn record there counts as the end: see
    /// [`JournalReader::torn_bytes`]). Damage anywhere before the end is
    /// [`JournalError::Corrupt`], and so is every call after it.
    pub fn next_record(&mut self) -> Result<Option<JournalRecord>, JournalError> {
        if let Some((offset, reason)) = &self.failed {
            return Err(corrupt(&self.path, *offset, reason.clone()));
        }
        if self.ended {
            return Ok(None);
        }
        match self.next_frame()? {
            Frame::Whole { len } => match JournalRecord::decode(&self.buf[..len]) {
                Ok(record) => {
                    self.commit(len);
                    Ok(Some(record))
                }
                Err(e) => {
                    let reason = format!(
                        "{}, of {len} bytes: its checksums hold but it does not decode as a \
                         journal record ({e}): it was not written by this version of rollfleet",
                        self.what()
                    );
                    Err(self.fail(self.valid, reason))
                }
            },
            Frame::End => {
                self.ended = true;
                Ok(None)
            }
            Frame::Torn(bytes) => {
                self.ended = true;
                self.torn = bytes;
                Ok(None)
            }
        }
    }

    /// Bytes of whole records read so far (where appending goes on).
    pub fn valid_bytes(&self) -> u64 {
        self.valid
    }

    /// Bytes of a torn record found at the end (0 when the file ended on a record).
    pub fn torn_bytes(&self) -> u64 {
        self.torn
    }

    /// Reads the frame at [`JournalReader::valid_bytes`] and checks it; nothing is counted as
    /// read until [`JournalReader::commit`].
    fn next_frame(&mut self) -> Result<Frame, JournalError> {
        let start = self.valid;
        let mut head = [0u8; HEAD_BYTES];
        let got = self.fill(&mut head)?;
        if got == 0 {
            return Ok(Frame::End);
        }
        if got < HEAD_BYTES {
            return Ok(Frame::Torn(got as u64));
        }
        let len = match parse_head(&head) {
            Ok(len) => len,
            Err(damage) => {
                let reason = format!("{}: {damage}", self.what());
                return Err(self.fail(start, reason));
            }
        };
        self.buf.clear();
        let want = len + CHECKSUM_BYTES as u64;
        let got = (&mut self.input)
            .take(want)
            .read_to_end(&mut self.buf)
            .map_err(|source| io(&self.path, source))? as u64;
        if got < want {
            return Ok(Frame::Torn(HEAD_BYTES as u64 + got));
        }
        // `len` is at most MAX_RECORD_BYTES, and the buffer holds it.
        let len = len as usize;
        let (message, stored) = self.buf.split_at(len);
        let mut stored_bytes = [0u8; CHECKSUM_BYTES];
        stored_bytes.copy_from_slice(stored);
        let stored = u32::from_le_bytes(stored_bytes);
        let computed = crc32c_append(crc32c(&head[..4]), message);
        if stored != computed {
            let end = start + FRAME_OVERHEAD + len as u64;
            let last = if self.input.fill_buf().is_ok_and(|rest| rest.is_empty()) {
                "; it is the last thing in the file, and whole: a write cut short leaves a \
                 frame shorter than its length, not one of full length with other bytes"
            } else {
                ""
            };
            let reason = format!(
                "{}, bytes {start} to {end}: its checksum does not match (expected \
                 {computed:#010x} from its length and its {len} bytes, found {stored:#010x}): \
                 its bytes were changed after they were written{last}",
                self.what()
            );
            return Err(self.fail(start, reason));
        }
        Ok(Frame::Whole { len })
    }

    /// Counts the frame just read, whose message had `len` bytes.
    fn commit(&mut self, len: usize) {
        self.valid += FRAME_OVERHEAD + len as u64;
        self.frames += 1;
    }

    /// The frame being read, as a person would name it.
    fn what(&self) -> String {
        match self.frames {
            0 => "the header".to_owned(),
            n => format!("record {n} (counting from 1 after the header)"),
        }
    }

    /// Reads until `buf` is full or the file ends; the bytes read.
    fn fill(&mut self, buf: &mut [u8]) -> Result<usize, JournalError> {
        let mut got = 0;
        while got < buf.len() {
            match self.input.read(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => return Err(io(&self.path, source)),
            }
        }
        Ok(got)
    }

    /// The damage found at `offset`: remembered, so that the reader never goes on past it.
    fn fail(&mut self, offset: u64, reason: String) -> JournalError {
        self.failed = Some((offset, reason.clone()));
        corrupt(&self.path, offset, reason)
    }
}

/// The message length a frame's head gives, once its check holds; otherwise what is wrong.
fn parse_head(head: &[u8; HEAD_BYTES]) -> Result<u64, String> {
    let mut len_bytes = [0u8; 4];
    len_bytes.copy_from_slice(&head[..4]);
    let mut check_bytes = [0u8; 4];
    check_bytes.copy_from_slice(&head[4..]);
    let stored = u32::from_le_bytes(check_bytes);
    let computed = crc32c(&len_bytes);
    if stored != computed {
        if head.iter().all(|&b| b == 0) {
            return Err(format!(
                "{HEAD_BYTES} zero bytes where its length and the length's check should be: a \
                 zeroed region, such as a machine that lost power before the file reached the \
                 disk can leave (--journal-sync prevents that)"
            ));
        }
        return Err(format!(
            "the check of its length does not match (for the length {} expected \
             {computed:#010x}, found {stored:#010x}): the length, or its check, was changed \
             after it was written",
            u32::from_le_bytes(len_bytes)
        ));
    }
    let len = u64::from(u32::from_le_bytes(len_bytes));
    if len > MAX_RECORD_BYTES {
        return Err(format!(
            "its length says {len} bytes, over the limit of {MAX_RECORD_BYTES} (no rollfleet \
             writes such a record)"
        ));
    }
    Ok(len)
}

/// Checks that the `tail` bytes of `file` from `at` on are a torn frame (one that the file ends
/// inside), the only thing [`JournalWriter::append`] may cut off.
fn check_torn(file: &mut File, path: &Path, at: u64, tail: u64) -> Result<(), JournalError> {
    if tail < HEAD_BYTES as u64 {
        return Ok(());
    }
    let mut head = [0u8; HEAD_BYTES];
    file.seek(SeekFrom::Start(at))
        .and_then(|_| file.read_exact(&mut head))
        .map_err(|source| io(path, source))?;
    let len = parse_head(&head).map_err(|damage| {
        corrupt(
            path,
            at,
            format!("the bytes after the last whole record are not a torn one: {damage}"),
        )
    })?;
    if tail >= FRAME_OVERHEAD + len {
        return Err(corrupt(
            path,
            at,
            format!(
                "the {tail} bytes after the last whole record hold a whole frame of a {len}-byte \
                 record, not a torn one, so they are not cut off"
            ),
        ));
    }
    Ok(())
}

/// The error for a journal of an older format at `path`, if it is one: a v1 file is a header
/// prefixed by its length as a varint, with no checksum.
fn older_format(path: &Path) -> Option<JournalError> {
    let mut file = File::open(path).ok()?;
    let mut len = 0u64;
    for i in 0..10 {
        let mut byte = [0u8; 1];
        file.read_exact(&mut byte).ok()?;
        len |= u64::from(byte[0] & 0x7f) << (7 * i);
        if byte[0] & 0x80 == 0 {
            break;
        }
        if i == 9 {
            return None;
        }
    }
    if len > MAX_RECORD_BYTES {
        return None;
    }
    let mut header = Vec::new();
    file.take(len).read_to_end(&mut header).ok()?;
    if header.len() as u64 != len {
        return None;
    }
    let format = JournalHeader::decode(header.as_slice()).ok()?.format;
    (format.starts_with(FORMAT_FAMILY) && format != FORMAT).then(|| JournalError::OtherFormat {
        path: path.to_owned(),
        written_by: written_by(&format),
        format,
    })
}

/// Which rollfleet wrote a journal of `format`.
fn written_by(format: &str) -> &'static str {
    if format == FORMAT_V1 {
        "an older rollfleet (its records have no checksums)"
    } else {
        "another version of rollfleet"
    }
}

fn corrupt(path: &Path, offset: u64, reason: String) -> JournalError {
    JournalError::Corrupt {
        path: path.to_owned(),
        offset,
        reason,
    }
}

fn io(path: &Path, source: std::io::Error) -> JournalError {
    JournalError::Io {
        path: path.to_owned(),
        source,
    }
}

/// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), one byte at a time: fast enough for a
/// journal, which is written and replayed at tens of MB/s at most.
const CRC32C_TABLE: [u32; 256] = crc32c_table();

const fn crc32c_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            bit += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

/// The CRC32C of `bytes`.
fn crc32c(bytes: &[u8]) -> u32 {
    crc32c_append(0, bytes)
}

/// The CRC32C of the bytes whose CRC32C is `crc` followed by `bytes`.
fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    let mut c = !crc;
    for &b in bytes {
        c = CRC32C_TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
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
    fn crc32c_gives_the_standard_check_value_and_chains() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c_append(crc32c(b"1234"), b"56789"), 0xE306_9283);
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
