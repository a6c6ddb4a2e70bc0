//! The journal's integrity, through the crate's public API on real files: a journal damaged
//! anywhere is refused, naming the byte, and kept as it is; only a record torn at the very end
//! is taken for the end and cut off when appending.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::{Path, PathBuf};

use prost::Message;
use rollfleet_proto::v1::{JournalHeader, JournalRecord, journal_record};
use rollfleet_rng::SplitMix64;
use rollfleet_server::journal::{FORMAT, JournalError, JournalReader, JournalWriter};

/// A directory of its own for one test, removed when the test ends (passing or not).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "rollfleet-journal-integrity-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const JOB: &str = "name: integrity-job\n";

fn header() -> JournalHeader {
    JournalHeader {
        format: FORMAT.into(),
        job_yaml: JOB.into(),
        seed: 7,
        time_scale: 0.5,
        lease_ttl_ms: 3000,
        expect_workers: 5,
        replan_on_drift: None,
        stage_timeout_ms: 60_000,
    }
}

/// A record that differs from its neighbours in its time and its event.
fn record(i: u64) -> JournalRecord {
    let event = match i % 3 {
        0 => journal_record::Event::Tick(true),
        1 => journal_record::Event::Wake(true),
        _ => journal_record::Event::Detach(rollfleet_proto::v1::JournalDetach {
            worker: i,
            reason: format!("gone {i}"),
        }),
    };
    JournalRecord {
        at_ns: 1_000 * i,
        event: Some(event),
    }
}

/// Writes a journal of `n` records, flushing after each; the offsets where the header's frame
/// and every record's frame start, and the file's length last.
fn write_journal(path: &Path, n: u64) -> Vec<u64> {
    let mut bounds = vec![0];
    let mut w = JournalWriter::create(path, &header()).unwrap();
    bounds.push(std::fs::metadata(path).unwrap().len());
    for i in 1..=n {
        w.write(&record(i)).unwrap();
        w.flush().unwrap();
        bounds.push(std::fs::metadata(path).unwrap().len());
    }
    bounds
}

/// What a scheduler restarted on the file reads: the header, the records, the bytes of whole
/// records and those of a torn one at the end.
type Read = (JournalHeader, Vec<JournalRecord>, u64, u64);

fn read_all(path: &Path) -> Result<Read, JournalError> {
    let (h, mut r) = JournalReader::open(path)?.unwrap();
    let mut records = Vec::new();
    while let Some(rec) = r.next_record()? {
        records.push(rec);
    }
    Ok((h, records, r.valid_bytes(), r.torn_bytes()))
}

/// The offset a refusal names, failing the test on anything but [`JournalError::Corrupt`].
fn corrupt_offset(result: Result<Read, JournalError>, what: &str) -> (u64, String) {
    match result {
        Err(e @ JournalError::Corrupt { .. }) => {
            let message = e.to_string();
            let JournalError::Corrupt { offset, .. } = e else {
                unreachable!()
            };
            (offset, message)
        }
        Err(e) => panic!("{what}: refused, but not as damage: {e}"),
        Ok((_, records, valid, torn)) => panic!(
            "{what}: accepted ({} records, {valid} bytes whole, {torn} torn)",
            records.len()
        ),
    }
}

#[test]
fn records_written_are_read_back_all_and_in_order() {
    let dir = Scratch::new("roundtrip");
    let path = dir.file("j.journal");
    let bounds = write_journal(&path, 50);
    let (h, records, valid, torn) = read_all(&path).unwrap();
    assert_eq!(h, header());
    assert_eq!(records, (1..=50).map(record).collect::<Vec<_>>());
    assert_eq!(valid, *bounds.last().unwrap());
    assert_eq!(torn, 0);
}

#[test]
fn a_flipped_bit_anywhere_in_the_file_is_refused_with_its_frame_offset_and_the_file_is_kept() {
    let dir = Scratch::new("flips");
    let path = dir.file("j.journal");
    let bounds = write_journal(&path, 4);
    let clean = std::fs::read(&path).unwrap();
    let mut accepted = Vec::new();
    for byte in 0..clean.len() {
        // The frame the byte belongs to: its start is what a refusal must name.
        let frame_start = *bounds.iter().rev().find(|&&b| b <= byte as u64).unwrap();
        for bit in 0..8 {
            let mut flipped = clean.clone();
            flipped[byte] ^= 1 << bit;
            std::fs::write(&path, &flipped).unwrap();
            match read_all(&path) {
                Err(JournalError::Corrupt { offset, .. }) => assert_eq!(
                    offset, frame_start,
                    "bit {bit} of byte {byte} is refused at another frame"
                ),
                Err(e) => panic!("bit {bit} of byte {byte}: refused, but not as damage: {e}"),
                Ok(_) => accepted.push((byte, bit)),
            }
            assert_eq!(
                std::fs::read(&path).unwrap(),
                flipped,
                "reading changed the file"
            );
        }
    }
    assert!(
        accepted.is_empty(),
        "{} of {} single-bit flips accepted (byte, bit): {accepted:?}",
        accepted.len(),
        clean.len() * 8
    );
}

#[test]
fn a_damaged_length_mid_file_is_refused_not_taken_for_a_torn_tail_and_nothing_is_cut_off() {
    let dir = Scratch::new("length");
    let path = dir.file("j.journal");
    let bounds = write_journal(&path, 5);
    // Record 2's length made to run far past the end of the file, as one that is only torn
    // would: the three records after it must not be lost to it.
    let at = bounds[2] as usize;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at + 2] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();

    let (found, mut reader) = JournalReader::open(&path).unwrap().unwrap();
    assert_eq!(found, header());
    assert_eq!(reader.next_record().unwrap(), Some(record(1)));
    let err = reader.next_record().unwrap_err();
    let message = err.to_string();
    let JournalError::Corrupt { offset, .. } = err else {
        panic!("not refused as damage: {message}")
    };
    assert_eq!(offset, bounds[2]);
    for said in [
        "j.journal",
        &format!("at byte {}", bounds[2]),
        "record 2",
        "check of its length does not match",
        "kept as it is",
        "another journal file",
    ] {
        assert!(message.contains(said), "{said:?} missing from: {message}");
    }
    // A reader asked again does not go on past the damage.
    assert!(matches!(
        reader.next_record(),
        Err(JournalError::Corrupt { .. })
    ));
    // Even asked to append after the last whole record, the writer does not cut the rest off.
    let refused = JournalWriter::append(&path, reader.valid_bytes());
    assert!(
        matches!(refused, Err(JournalError::Corrupt { offset, .. }) if offset == bounds[2]),
        "append was not refused"
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "the file changed");
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        *bounds.last().unwrap()
    );
}

#[test]
fn a_zeroed_record_in_the_middle_is_refused_not_skipped() {
    let dir = Scratch::new("zeroed");
    let path = dir.file("j.journal");
    let bounds = write_journal(&path, 4);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[bounds[2] as usize..bounds[3] as usize].fill(0);
    std::fs::write(&path, &bytes).unwrap();
    let (offset, message) = corrupt_offset(read_all(&path), "a zeroed record 2");
    assert_eq!(offset, bounds[2]);
    assert!(message.contains("zero"), "{message}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[test]
fn zeros_after_the_last_record_are_refused_not_taken_for_a_torn_one() {
    let dir = Scratch::new("zero-tail");
    let path = dir.file("j.journal");
    let bounds = write_journal(&path, 3);
    let mut bytes = std::fs::read(&path).unwrap();
    // What a file whose length reached the disk and its last bytes did not can look like.
    bytes.extend_from_slice(&[0; 40]);
    std::fs::write(&path, &bytes).unwrap();
    let (offset, _) = corrupt_offset(read_all(&path), "zeros after the last record");
    assert_eq!(offset, *bounds.last().unwrap());
    assert!(JournalWriter::append(&path, offset).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[test]
fn a_whole_last_record_with_a_bad_checksum_is_refused_not_taken_for_a_torn_one() {
    let dir = Scratch::new("last");
    let path = dir.file("j.journal");
    let bounds = write_journal(&path, 3);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bounds[bounds.len() - 2];
    // A byte of the message, past the frame's 8-byte head.
    bytes[last as usize + 9] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let (offset, message) = corrupt_offset(read_all(&path), "a damaged last record");
    assert_eq!(offset, last);
    assert!(
        message.contains("record 3") && message.contains("checksum does not match"),
        "{message}"
    );
    assert!(
        message.contains("last thing in the file, and whole"),
        "{message}"
    );
    assert!(matches!(
        JournalWriter::append(&path, last),
        Err(JournalError::Corrupt { .. })
    ));
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[test]
fn an_edited_header_is_refused() {
    let dir = Scratch::new("header");
    let path = dir.file("j.journal");
    write_journal(&path, 2);
    let mut bytes = std::fs::read(&path).unwrap();
    let job_at = bytes
        .windows(JOB.len())
        .position(|w| w == JOB.as_bytes())
        .unwrap();
    // "integrity-job" becomes "integrity-jov": a job file that still parses.
    bytes[job_at + JOB.len() - 2] = b'v';
    std::fs::write(&path, &bytes).unwrap();
    let err = JournalReader::open(&path).err().unwrap();
    let message = err.to_string();
    assert!(
        matches!(err, JournalError::Corrupt { offset: 0, .. }),
        "{message}"
    );
    assert!(message.contains("header"), "{message}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[test]
fn a_record_torn_anywhere_at_the_end_is_the_end_and_only_it_is_cut_off_when_appending() {
    let dir = Scratch::new("torn");
    let path = dir.file("j.journal");
    let bounds = write_journal(&path, 3);
    let whole = std::fs::read(&path).unwrap();
    let last = bounds[bounds.len() - 2];
    let end = *bounds.last().unwrap();
    for cut in last + 1..end {
        std::fs::write(&path, &whole[..cut as usize]).unwrap();
        let (_, records, valid, torn) =
            read_all(&path).unwrap_or_else(|e| panic!("cut at byte {cut} of {end}: refused: {e}"));
        assert_eq!(records, vec![record(1), record(2)], "cut at byte {cut}");
        assert_eq!(valid, last);
        assert_eq!(torn, cut - last);
        let mut w = JournalWriter::append(&path, valid).unwrap();
        w.write(&record(9)).unwrap();
        w.write(&record(10)).unwrap();
        w.flush().unwrap();
        drop(w);
        let (_, records, _, torn) = read_all(&path).unwrap();
        assert_eq!(
            records,
            vec![record(1), record(2), record(9), record(10)],
            "cut at byte {cut}"
        );
        assert_eq!(torn, 0);
        assert_eq!(
            &std::fs::read(&path).unwrap()[..last as usize],
            &whole[..last as usize],
            "appending changed what came before the torn record"
        );
    }
}

#[test]
fn a_journal_of_the_older_unchecked_format_is_refused_naming_its_format() {
    let dir = Scratch::new("v1");
    let path = dir.file("old.journal");
    // What rollfleet wrote before the checksums: each message prefixed by its varint length.
    let mut bytes = Vec::new();
    JournalHeader {
        format: "rollfleet-journal-v1".into(),
        ..header()
    }
    .encode_length_delimited(&mut bytes)
    .unwrap();
    for i in 1..=3 {
        record(i).encode_length_delimited(&mut bytes).unwrap();
    }
    std::fs::write(&path, &bytes).unwrap();
    let err = JournalReader::open(&path).err().unwrap();
    let message = err.to_string();
    assert!(
        matches!(err, JournalError::OtherFormat { .. }),
        "not refused for its format: {message}"
    );
    for said in [
        "old.journal",
        "\"rollfleet-journal-v1\"",
        "older rollfleet",
        FORMAT,
        "another journal file",
    ] {
        assert!(message.contains(said), "{said:?} missing from: {message}");
    }
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[test]
fn a_damaged_journal_of_a_real_job_is_refused_by_the_replay_a_restart_runs_and_is_kept() {
    let dir = Scratch::new("replay");
    let path = dir.file("j.journal");
    let job = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/jobs/quickstart.yaml"),
    )
    .unwrap();
    let mut w = JournalWriter::create(
        &path,
        &JournalHeader {
            job_yaml: job,
            ..header()
        },
    )
    .unwrap();
    let mut bounds = vec![std::fs::metadata(&path).unwrap().len()];
    for i in 1..=6 {
        w.write(&JournalRecord {
            at_ns: 200_000_000 * i,
            event: Some(journal_record::Event::Tick(true)),
        })
        .unwrap();
        w.flush().unwrap();
        bounds.push(std::fs::metadata(&path).unwrap().len());
    }
    drop(w);
    let replayed = rollfleet_server::replay_journal(&path, None).unwrap();
    assert_eq!(replayed.records, 6);
    assert_eq!(replayed.torn_bytes, 0);

    let mut bytes = std::fs::read(&path).unwrap();
    bytes[bounds[2] as usize + 9] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let err = rollfleet_server::replay_journal(&path, None).err().unwrap();
    assert!(
        matches!(
            &err,
            rollfleet_server::ServerError::Journal(JournalError::Corrupt { offset, .. })
                if *offset == bounds[2]
        ),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

/// Seeded corruptions of more than one bit (runs of random bytes, inserted and deleted bytes,
/// a huge length written anywhere, zeroed spans), 1 to 3 at once: each is refused as damage or
/// read as the header and some first records exactly as written, never a panic and never a
/// record that was not written. `ROLLFLEET_FUZZ_CASES` (default 400) sets the number of seeds,
/// `ROLLFLEET_FUZZ_SEED` runs one.
#[test]
fn random_corruptions_of_a_journal_are_refused_or_read_as_a_prefix_of_what_was_written() {
    let dir = Scratch::new("fuzz");
    let path = dir.file("j.journal");
    write_journal(&path, 12);
    let clean = std::fs::read(&path).unwrap();
    let written: Vec<JournalRecord> = (1..=12).map(record).collect();
    let seeds = rollfleet_rng::test_seeds("ROLLFLEET_FUZZ", 400);
    let (mut refused, mut prefixes) = (0, 0);
    for &seed in &seeds {
        let reproduce = format!(
            "reproduce with: ROLLFLEET_FUZZ_SEED={seed} cargo test -p rollfleet-server --test \
             journal_integrity random_corruptions"
        );
        let mut rng = SplitMix64::new(seed);
        let mut bytes = clean.clone();
        for _ in 0..1 + rng.index(3) {
            let len = bytes.len().max(1);
            let at = rng.index(len).min(bytes.len());
            match rng.index(5) {
                0 => {
                    let n = (1 + rng.index(16)).min(bytes.len() - at);
                    for b in &mut bytes[at..at + n] {
                        *b = rng.next_u64() as u8;
                    }
                }
                1 => {
                    let n = 1 + rng.index(8);
                    let junk: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                    bytes.splice(at..at, junk);
                }
                2 => {
                    let n = (1 + rng.index(8)).min(bytes.len() - at);
                    bytes.drain(at..at + n);
                }
                3 => {
                    let n = 4.min(bytes.len() - at);
                    bytes[at..at + n].copy_from_slice(&[0xff; 4][..n]);
                }
                _ => {
                    let n = (1 + rng.index(64)).min(bytes.len() - at);
                    bytes[at..at + n].fill(0);
                }
            }
        }
        if bytes == clean {
            continue;
        }
        std::fs::write(&path, &bytes).unwrap();
        let outcome = std::panic::catch_unwind(|| read_all(&path));
        match outcome {
            Err(_) => panic!("case {seed} panicked; {reproduce}"),
            Ok(Err(_)) => refused += 1,
            Ok(Ok((h, records, _, _))) => {
                assert_eq!(
                    h,
                    header(),
                    "case {seed}: a damaged header read; {reproduce}"
                );
                assert!(
                    written.starts_with(&records),
                    "case {seed}: read {} records that are not the first ones written; \
                     {reproduce}",
                    records.len()
                );
                prefixes += 1;
            }
        }
        assert_eq!(
            std::fs::read(&path).unwrap(),
            bytes,
            "case {seed}: reading changed the file; {reproduce}"
        );
    }
    eprintln!("{refused} refused, {prefixes} read as a prefix (damage at the very end)");
    if seeds.len() >= 100 {
        assert!(refused > prefixes, "{refused} refused, {prefixes} read");
    }
}
