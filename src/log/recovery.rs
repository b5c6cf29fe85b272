//! Recovery of the standalone log: read the WAL segments, tell a torn tail from corruption, and
//! hand every command past the state machine's applied index to `apply`, in index order.
//!
//! The rules (README "WAL recovery"):
//! - Segments wholly below the applied index (the next segment starts at or below
//!   `applied + 1`) are not read: their commands are in the tables. They are removed.
//! - Records must carry consecutive indexes; a gap, or a first record that does not match the
//!   segment's name, is corruption.
//! - Damage is a **torn tail** only when it sits in the last segment and no intact record
//!   follows it there (the writer fsyncs a segment before it starts the next, so a torn write
//!   can only be the newest bytes). The tail is cut off at the damage.
//! - Damage anywhere else (a non-last segment, or with an intact record after it) is
//!   **corruption**: recovery returns [`StoreError::LogCorrupt`] naming the file and byte offset,
//!   and start-up stops.
//! - A segment **shorter than it was written** is a truncation, not a torn write: the writer
//!   zero-fills and syncs a segment ahead of its records, so a crash never leaves a file that
//!   ends inside a record or below the length its header records (see `super::header`).
//!   Recovery returns [`StoreError::LogTruncated`] naming the file and what is missing, in any
//!   segment, unless [`RecoveryPolicy::accept_truncation`] (`--recover-truncated-wal`) accepts
//!   the loss: the segment is cut there, later segments are set aside (`*.log.dropped`), and the
//!   records known lost are counted and logged.
//! - **No file is changed before that decision.** Recovery only reads; the truncation and removals
//!   it decided on are carried out by [`LogRecovery::finish`], which the caller runs once the
//!   whole store (tables and log) has been read without error.
//!
//! Runs once, before the shard serves; it may block on std I/O.

use std::path::{Path, PathBuf};

use super::command::Command;
use super::header::{read_segment_header, HeaderRead, SegmentHeader, SEGMENT_HEADER_BYTES};
use super::wal::{
    decode_frame, find_intact_record, parse_segment_name, DecodeError, Frame, ScanEnd, SegmentMeta,
    SegmentReader, RECORD_HEADER_BYTES, RECORD_PAYLOAD_MAX,
};
use crate::storage::StoreError;
use crate::storage::{corrupt, io as dio, io_error};

/// How recovery treats a segment shorter than it was written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryPolicy {
    /// Accept the loss (`pinq serve --recover-truncated-wal`): cut the log at the truncation
    /// and drop everything after it, instead of refusing to start.
    pub accept_truncation: bool,
}

/// Why records were dropped at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailLoss {
    /// A torn last write (never acknowledged, or indistinguishable from one).
    Torn,
    /// A segment shorter than it was written, accepted with `--recover-truncated-wal`.
    TruncationAccepted,
}

/// Log records dropped at start-up (and cut off by [`LogRecovery::finish`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub file: String,
    pub offset: u64,
    pub reason: String,
    /// Records known dropped: those whose headers are still legible past the cut (a torn tail
    /// counts at least the damaged one), plus, for an accepted truncation, the index gap to the
    /// next segment and every record of later segments. Records cut away with the end of the
    /// last segment cannot be counted.
    pub records_dropped: u64,
    pub loss: TailLoss,
}

impl std::fmt::Display for TornTail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.loss {
            TailLoss::Torn => "torn WAL tail cut",
            TailLoss::TruncationAccepted => "truncated WAL accepted (--recover-truncated-wal)",
        };
        write!(
            f,
            "{what} at byte {} of {}: {} record(s) dropped ({})",
            self.offset, self.file, self.records_dropped, self.reason
        )
    }
}

/// What log recovery found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogReport {
    pub segments_read: usize,
    pub segments_removed: usize,
    pub records_replayed: u64,
    pub wal_bytes_read: u64,
    pub torn_tail: Option<TornTail>,
}

/// A change to the log's files that recovery decided on but has not made yet.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cleanup {
    Remove(PathBuf),
    /// Cut the file to `len`; a segment with a header (`first_seq`) gets it rewritten to say
    /// `len` first, so the cut file never looks shorter than written.
    Truncate {
        path: PathBuf,
        len: u64,
        header_first_seq: Option<u64>,
    },
    /// Rename to `<name>.dropped`: recovery no longer reads it, an operator may.
    SetAside(PathBuf),
}

/// The log as recovery left it: where appends continue, which segments are still needed, and
/// the file changes still to make.
#[derive(Debug)]
pub struct LogRecovery {
    /// Index the next appended command gets.
    pub next_index: u64,
    pub live_segments: Vec<SegmentMeta>,
    pub report: LogReport,
    cleanup: Vec<Cleanup>,
}

impl LogRecovery {
    /// Makes the file changes recovery decided on (cut a torn tail, remove segments the tables
    /// cover, set aside what an accepted truncation dropped), then syncs the directory. Call
    /// only once every part of the store was read.
    pub fn finish(&mut self, dir: &Path) -> Result<(), StoreError> {
        let mut removed = false;
        for step in std::mem::take(&mut self.cleanup) {
            match step {
                Cleanup::Remove(path) => {
                    dio::remove_blocking(&path)?;
                    removed = true;
                }
                Cleanup::Truncate {
                    path,
                    len,
                    header_first_seq,
                } => {
                    if let Some(first_seq) = header_first_seq {
                        let header = super::header::encode_segment_header(&SegmentHeader {
                            first_seq,
                            written_bytes: len,
                        });
                        dio::write_at_blocking(&path, 0, &header)?;
                    }
                    dio::truncate_blocking(&path, len)?;
                }
                Cleanup::SetAside(path) => {
                    let mut to = path.clone().into_os_string();
                    to.push(".dropped");
                    tracing::warn!(file = %path.display(), "setting aside a WAL segment after an accepted truncation");
                    dio::rename_blocking(&path, Path::new(&to))?;
                    // Durable before the segment before it is cut (the step after these): a
                    // crash in between must not leave a cut segment followed by a gap, which
                    // the next start would call corruption.
                    dio::sync_dir_blocking(dir)?;
                }
            }
        }
        if removed {
            dio::sync_dir_blocking(dir)?;
        }
        if let Some(tail) = &self.report.torn_tail {
            tracing::warn!(
                file = %tail.file,
                offset = tail.offset,
                records_dropped = tail.records_dropped,
                "{tail}"
            );
        }
        Ok(())
    }
}

/// The WAL segments in `dir`, oldest first.
fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>, StoreError> {
    let mut segments = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_error(dir, e))? {
        let entry = entry.map_err(|e| io_error(dir, e))?;
        let name = entry.file_name();
        if let Some(first_seq) = name.to_str().and_then(parse_segment_name) {
            segments.push((first_seq, entry.path()));
        }
    }
    segments.sort();
    Ok(segments)
}

/// A segment that ends before it was written to (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncation {
    /// Where the intact records end.
    pub offset: usize,
    /// What is missing, for the error and the log.
    pub what: String,
}

/// The records of one segment and how it ends, checked against the rules above. Pure.
#[derive(Debug, PartialEq, Eq)]
pub struct SegmentScan {
    /// `(offset, index)` of each intact record, in order.
    pub records: Vec<(usize, u64)>,
    /// Where a torn tail starts, if the segment has one.
    pub torn: Option<(usize, String)>,
    /// Set when the segment is shorter than it was written; `torn` is `None` then.
    pub truncated: Option<Truncation>,
    /// Offset just past the last intact record (or the header).
    pub records_end: usize,
    /// The segment's header (`None`: a segment of the older format).
    pub header: Option<SegmentHeader>,
}

/// Why a segment cannot be recovered, with where.
#[derive(Debug, PartialEq, Eq)]
pub struct Damage {
    pub offset: u64,
    pub reason: String,
    pub evidence: String,
}

/// The header of a segment, checked against its name.
fn checked_header(bytes: &[u8], first_seq: u64) -> Result<Option<SegmentHeader>, Damage> {
    match read_segment_header(bytes) {
        HeaderRead::Absent => Ok(None),
        HeaderRead::Damaged { reason } => Err(Damage {
            offset: 0,
            reason,
            evidence: "the header records how much of the segment was written".into(),
        }),
        HeaderRead::Present(h) if h.first_seq != first_seq => Err(Damage {
            offset: 0,
            reason: format!(
                "its header names first record {} but its file name {first_seq}",
                h.first_seq
            ),
            evidence: "a segment's name and header are written together".into(),
        }),
        HeaderRead::Present(h) => Ok(Some(h)),
    }
}

/// Whether the scan stopped at a record that runs past the end of the file: its header names
/// the next index (a torn header would not), or the file ends inside the header itself.
fn ends_inside_record(bytes: &[u8], end: Option<&ScanEnd>, next_seq: u64) -> Option<String> {
    let Some(ScanEnd::Torn {
        offset,
        reason: DecodeError::Truncated { need, have },
    }) = end
    else {
        return None;
    };
    if *need == RECORD_HEADER_BYTES {
        return Some(format!(
            "it ends at byte {}, {have} byte(s) into a record header",
            bytes.len()
        ));
    }
    let seq = u64::from_le_bytes(bytes[offset + 8..offset + 16].try_into().ok()?);
    (seq == next_seq).then(|| {
        format!(
            "it ends at byte {} inside record {seq}, which needs {} more byte(s)",
            bytes.len(),
            need - have
        )
    })
}

/// Scans one segment's bytes (the whole file): intact records, then either a clean end, a torn
/// tail (allowed only when `is_last` and no intact record follows the damage), a truncation,
/// or [`Damage`]. Pure.
pub fn scan_segment(bytes: &[u8], first_seq: u64, is_last: bool) -> Result<SegmentScan, Damage> {
    let header = checked_header(bytes, first_seq)?;
    let start = if header.is_some() {
        SEGMENT_HEADER_BYTES
    } else {
        0
    };
    let mut reader = SegmentReader::starting_at(bytes, start);
    let mut records = Vec::new();
    let mut records_end = start.min(bytes.len());
    let mut last_seq = first_seq.saturating_sub(1);
    while let Some((offset, record)) = reader.next_record() {
        let expected = last_seq + 1;
        if record.seq != expected {
            return Err(Damage {
                offset: offset as u64,
                reason: format!("record {} found where {expected} was expected", record.seq),
                evidence: "log indexes must be consecutive".into(),
            });
        }
        records.push((offset, record.seq));
        records_end = offset + RECORD_HEADER_BYTES + record.payload.len();
        last_seq = record.seq;
    }
    let torn = match reader.end() {
        Some(ScanEnd::Torn { offset, reason }) => Some((*offset, reason.to_string())),
        _ => None,
    };
    if let Some((offset, reason)) = &torn {
        if let Some((at, seq)) = find_intact_record(bytes, *offset, last_seq) {
            return Err(Damage {
                offset: *offset as u64,
                reason: reason.clone(),
                evidence: format!("intact record {seq} follows at byte {at}"),
            });
        }
    }
    let cut_at = torn.as_ref().map_or(bytes.len(), |(o, _)| *o);
    let short = header.and_then(|h| {
        let have = bytes.len() as u64;
        (have < h.written_bytes).then(|| {
            format!(
                "its header records {} bytes written, the file has {have} ({} missing)",
                h.written_bytes,
                h.written_bytes - have
            )
        })
    });
    let inside = ends_inside_record(bytes, reader.end(), last_seq + 1);
    if let Some(what) = inside
        .into_iter()
        .chain(short)
        .reduce(|a, b| format!("{a}; {b}"))
    {
        return Ok(SegmentScan {
            records,
            torn: None,
            truncated: Some(Truncation {
                offset: cut_at,
                what,
            }),
            records_end,
            header,
        });
    }
    if let Some((offset, reason)) = &torn {
        if !is_last {
            return Err(Damage {
                offset: *offset as u64,
                reason: reason.clone(),
                evidence: "a later segment exists (a segment is synced before the next one starts)"
                    .into(),
            });
        }
    }
    Ok(SegmentScan {
        records,
        torn,
        truncated: None,
        records_end,
        header,
    })
}

/// Records dropped past byte `from` of a segment: each frame there whose header names the next
/// index and a possible length (its payload may be damaged), skipping zero padding to the next
/// block; at least one when non-zero bytes follow `from` (the damaged record). Pure.
pub fn count_records_past(bytes: &[u8], from: usize, next_seq: u64) -> u64 {
    let align = crate::storage::io::WRITE_ALIGN;
    let mut count = 0u64;
    let mut at = from;
    while at + RECORD_HEADER_BYTES <= bytes.len() {
        if let Ok(Frame::Padding) = decode_frame(&bytes[at..]) {
            at = (at / align + 1) * align;
            continue;
        }
        let h = &bytes[at..at + RECORD_HEADER_BYTES];
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let seq = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
        if !(4..=RECORD_PAYLOAD_MAX).contains(&len) || seq != next_seq + count {
            break;
        }
        count += 1;
        at += RECORD_HEADER_BYTES + len;
    }
    let damaged = bytes
        .get(from..)
        .is_some_and(|rest| rest.iter().any(|&b| b != 0));
    count.max(u64::from(damaged))
}

/// Reads the log in `dir` and calls `apply(index, command)` for every command past
/// `applied_index`, in order. Changes no file (see [`LogRecovery::finish`]). Refuses a
/// truncated segment (see [`recover_with`]).
pub async fn recover(
    dir: &Path,
    applied_index: u64,
    apply: impl FnMut(u64, Command),
) -> Result<LogRecovery, StoreError> {
    recover_with(dir, applied_index, RecoveryPolicy::default(), apply).await
}

/// [`recover`] with a choice of what to do with a truncated segment.
pub async fn recover_with(
    dir: &Path,
    applied_index: u64,
    policy: RecoveryPolicy,
    mut apply: impl FnMut(u64, Command),
) -> Result<LogRecovery, StoreError> {
    recover_records(dir, applied_index, policy, |seq, payload| {
        apply(seq, Command::decode(payload).map_err(|e| e.to_string())?);
        Ok(())
    })
    .await
}

/// Where replay stands while the segments are read.
struct Replay {
    applied_index: u64,
    expected: u64,
    report: LogReport,
    cleanup: Vec<Cleanup>,
    live_segments: Vec<SegmentMeta>,
}

/// [`recover`] for any payload: calls `replay(seq, payload)` for every record past
/// `applied_index`, in order; an error from `replay` is corruption of that record. The
/// replicated log uses it with `applied_index = 0` (its record numbers are not Raft indexes).
pub async fn recover_records(
    dir: &Path,
    applied_index: u64,
    policy: RecoveryPolicy,
    mut replay: impl FnMut(u64, &[u8]) -> Result<(), String>,
) -> Result<LogRecovery, StoreError> {
    let segments = list_segments(dir)?;
    let mut state = Replay {
        applied_index,
        expected: applied_index + 1,
        report: LogReport::default(),
        cleanup: Vec::new(),
        live_segments: Vec::new(),
    };
    for (i, (first_seq, path)) in segments.iter().enumerate() {
        let next_first = segments.get(i + 1).map(|(s, _)| *s);
        if next_first.is_some_and(|next| next <= applied_index + 1) {
            state.cleanup.push(Cleanup::Remove(path.clone()));
            state.report.segments_removed += 1;
            continue;
        }
        let bytes = dio::read_blocking(path).map_err(|e| io_error(path, e))?;
        state.report.segments_read += 1;
        state.report.wal_bytes_read += bytes.len() as u64;
        let scan = scan_segment(&bytes, *first_seq, next_first.is_none()).map_err(|d| {
            StoreError::LogCorrupt {
                file: path.display().to_string(),
                offset: d.offset,
                reason: d.reason,
                evidence: d.evidence,
            }
        })?;
        if let Some(cut) = &scan.truncated {
            // Later segments are set aside before this one is cut ([`LogRecovery::finish`] runs
            // the steps in order).
            if !policy.accept_truncation {
                return Err(StoreError::LogTruncated {
                    file: path.display().to_string(),
                    offset: cut.offset as u64,
                    what: cut.what.clone(),
                });
            }
        }
        let applied_here = replay_segment(&mut state, path, &bytes, &scan, &mut replay).await?;
        let cut = scan
            .truncated
            .as_ref()
            .map(|t| (t.offset, t.what.clone(), TailLoss::TruncationAccepted));
        let cut = cut.or_else(|| scan.torn.clone().map(|(o, r)| (o, r, TailLoss::Torn)));
        if let Some((offset, reason, loss)) = cut {
            let last_seq = scan
                .records
                .last()
                .map_or(first_seq.saturating_sub(1), |r| r.1);
            let mut records_dropped = count_records_past(&bytes, offset, last_seq + 1);
            if loss == TailLoss::TruncationAccepted {
                records_dropped += set_aside_later(&mut state, &segments[i + 1..], last_seq);
            }
            state.report.torn_tail = Some(TornTail {
                file: path.display().to_string(),
                offset: offset as u64,
                reason,
                records_dropped,
                loss,
            });
        }
        keep_or_remove(&mut state, *first_seq, path, &bytes, &scan, applied_here);
        if scan.truncated.is_some() {
            break;
        }
    }
    Ok(LogRecovery {
        next_index: state.expected,
        live_segments: state.live_segments,
        report: state.report,
        cleanup: state.cleanup,
    })
}

/// Replays the records of one scanned segment past the applied index; returns how many.
async fn replay_segment(
    state: &mut Replay,
    path: &Path,
    bytes: &[u8],
    scan: &SegmentScan,
    replay: &mut impl FnMut(u64, &[u8]) -> Result<(), String>,
) -> Result<u64, StoreError> {
    let mut applied_here = 0u64;
    for &(offset, seq) in &scan.records {
        if seq <= state.applied_index {
            continue;
        }
        if seq != state.expected {
            return Err(StoreError::LogCorrupt {
                file: path.display().to_string(),
                offset: offset as u64,
                reason: format!("record {seq} found where {} was expected", state.expected),
                evidence: "a record is missing between segments".into(),
            });
        }
        let start = offset + RECORD_HEADER_BYTES;
        let len = u32::from_le_bytes([
            bytes[offset],
            bytes[offset + 1],
            bytes[offset + 2],
            bytes[offset + 3],
        ]) as usize;
        replay(seq, &bytes[start..start + len])
            .map_err(|e| corrupt(path, format!("record {seq} at byte {offset}: {e}")))?;
        state.expected += 1;
        applied_here += 1;
        state.report.records_replayed += 1;
        if state.report.records_replayed % 1024 == 0 {
            glommio::yield_if_needed().await;
        }
    }
    Ok(applied_here)
}

/// An accepted truncation drops every later segment: they are set aside, and the records
/// they hold (and the index gap before the first of them) are counted.
fn set_aside_later(state: &mut Replay, later: &[(u64, PathBuf)], last_seq: u64) -> u64 {
    let mut dropped = later
        .first()
        .map_or(0, |(first, _)| first.saturating_sub(last_seq + 1));
    for (first_seq, path) in later {
        if let Ok(bytes) = dio::read_blocking(path) {
            let mut reader = SegmentReader::new(&bytes);
            let mut next = *first_seq;
            while let Some((_, record)) = reader.next_record() {
                if record.seq != next {
                    break;
                }
                next += 1;
            }
            dropped += next - first_seq;
        }
        state.cleanup.push(Cleanup::SetAside(path.clone()));
    }
    dropped
}

/// A segment with records past the applied index stays live (cut at a torn tail or accepted
/// truncation); one without is removed.
fn keep_or_remove(
    state: &mut Replay,
    first_seq: u64,
    path: &Path,
    bytes: &[u8],
    scan: &SegmentScan,
    applied_here: u64,
) {
    if applied_here == 0 {
        // Nothing here that the tables lack: the segment is not needed.
        state.cleanup.push(Cleanup::Remove(path.to_path_buf()));
        state.report.segments_removed += 1;
        return;
    }
    let cut = scan
        .truncated
        .as_ref()
        .map(|t| t.offset)
        .or(scan.torn.as_ref().map(|(o, _)| *o));
    if let Some(offset) = cut {
        state.cleanup.push(Cleanup::Truncate {
            path: path.to_path_buf(),
            len: offset as u64,
            header_first_seq: scan.header.map(|h| h.first_seq),
        });
    }
    state.live_segments.push(SegmentMeta {
        first_seq,
        path: path.to_path_buf(),
        bytes: crate::storage::io::align_up(scan.records_end) as u64,
        file_bytes: cut.unwrap_or(bytes.len()) as u64,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{EventKey, TopicHash};
    use crate::log::wal::encode_record;
    use crate::message::Value;
    use crate::storage::io::WRITE_ALIGN;

    fn command(i: u64) -> Command {
        Command::Store {
            messages: vec![(
                EventKey::new(TopicHash(1), 0, i),
                Value::copy_from_slice(&[i as u8; 40]),
            )],
            event_id_high_water: i,
        }
    }

    /// A segment of `n` records from `first`, in two aligned writes, zero-filled after.
    fn segment(first: u64, n: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for seq in first..first + n / 2 {
            encode_record(seq, &command(seq), &mut out).unwrap();
        }
        out.resize(out.len().div_ceil(WRITE_ALIGN) * WRITE_ALIGN, 0);
        for seq in first + n / 2..first + n {
            encode_record(seq, &command(seq), &mut out).unwrap();
        }
        out.resize(
            out.len().div_ceil(WRITE_ALIGN) * WRITE_ALIGN + WRITE_ALIGN,
            0,
        );
        out
    }

    fn offsets(bytes: &[u8], first: u64) -> Vec<usize> {
        scan_segment(bytes, first, true)
            .unwrap()
            .records
            .iter()
            .map(|(o, _)| *o)
            .collect()
    }

    #[test]
    fn a_clean_segment_yields_every_record_in_order() {
        let bytes = segment(5, 10);
        let scan = scan_segment(&bytes, 5, false).unwrap();
        let seqs: Vec<u64> = scan.records.iter().map(|(_, s)| *s).collect();
        assert_eq!(seqs, (5..15).collect::<Vec<_>>());
        assert_eq!(scan.torn, None);
    }

    #[test]
    fn a_flip_in_the_middle_of_the_last_segment_is_corruption() {
        let bytes = segment(1, 10);
        let third = offsets(&bytes, 1)[2];
        let mut bad = bytes.clone();
        bad[third + RECORD_HEADER_BYTES + 10] ^= 0x40;
        let damage = scan_segment(&bad, 1, true).unwrap_err();
        assert_eq!(damage.offset, third as u64);
        assert!(damage.evidence.contains("intact record 4"), "{damage:?}");
    }

    #[test]
    fn a_flipped_length_field_still_finds_the_intact_records_after_it() {
        let bytes = segment(1, 10);
        let second = offsets(&bytes, 1)[1];
        let mut bad = bytes.clone();
        bad[second] ^= 0x01;
        let damage = scan_segment(&bad, 1, true).unwrap_err();
        assert_eq!(damage.offset, second as u64);
    }

    #[test]
    fn a_flip_in_the_last_record_of_the_last_segment_is_a_torn_tail() {
        let bytes = segment(1, 10);
        let last = *offsets(&bytes, 1).last().unwrap();
        let mut bad = bytes.clone();
        bad[last + RECORD_HEADER_BYTES + 3] ^= 0x01;
        let scan = scan_segment(&bad, 1, true).unwrap();
        assert_eq!(scan.records.len(), 9);
        assert_eq!(scan.torn.as_ref().map(|(o, _)| *o), Some(last));
    }

    #[test]
    fn damage_in_a_segment_that_is_not_the_last_is_corruption_even_at_its_end() {
        let bytes = segment(1, 10);
        let last = *offsets(&bytes, 1).last().unwrap();
        let mut bad = bytes.clone();
        bad[last + RECORD_HEADER_BYTES + 3] ^= 0x01;
        let damage = scan_segment(&bad, 1, false).unwrap_err();
        assert_eq!(damage.offset, last as u64);
        assert!(damage.evidence.contains("later segment"));
    }

    /// Regression (issue 25): a segment cut inside its first record lost every acknowledged
    /// record in it with `records_replayed=0` at INFO. The writer zero-fills ahead of its
    /// records, so a crash never leaves a file ending inside one: this is a truncation.
    #[test]
    fn a_segment_of_the_older_format_cut_inside_a_record_is_a_truncation() {
        let bytes = segment(1, 10);
        let offs = offsets(&bytes, 1);
        for (cut, intact) in [(offs[0] + 20, 0), (offs[4] + 30, 4), (offs[9] + 20, 9)] {
            let scan = scan_segment(&bytes[..cut], 1, true).unwrap();
            assert_eq!(scan.records.len(), intact, "cut at {cut}");
            assert_eq!(scan.torn, None);
            let t = scan.truncated.expect("a truncation");
            assert_eq!(t.offset, offs[intact]);
            assert!(
                t.what.contains(&format!("inside record {}", intact + 1)),
                "{t:?}"
            );
        }
        // Cut inside a record header (fewer than 16 bytes of it left).
        let scan = scan_segment(&bytes[..offs[3] + 7], 1, false).unwrap();
        assert!(scan
            .truncated
            .is_some_and(|t| t.what.contains("record header")));
    }

    /// `segment(first, n)` with a header saying `written` bytes, records moved after it.
    fn with_header(first: u64, n: u64, written: Option<u64>) -> Vec<u8> {
        let body = segment(first, n);
        let mut out = crate::log::header::encode_segment_header(&SegmentHeader {
            first_seq: first,
            written_bytes: written.unwrap_or((SEGMENT_HEADER_BYTES + body.len()) as u64),
        });
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn a_segment_shorter_than_its_header_says_is_a_truncation_wherever_it_is_cut() {
        let bytes = with_header(1, 10, None);
        let offs = offsets(&bytes, 1);
        assert_eq!(offs[0], SEGMENT_HEADER_BYTES);
        let whole = scan_segment(&bytes, 1, true).unwrap();
        assert_eq!(
            (whole.records.len(), whole.truncated, whole.torn),
            (10, None, None)
        );
        // At a record boundary, in the padding after a write, inside the zeros at the end,
        // inside the header: each leaves records that read cleanly, but the file is short.
        let ends: Vec<usize> = scan_segment(&bytes, 1, true)
            .unwrap()
            .records
            .iter()
            .map(|(o, _)| *o)
            .collect();
        for cut in [ends[5], offs[4] + 1000, bytes.len() - 100, 30, 4096] {
            let scan = scan_segment(&bytes[..cut], 1, true).unwrap();
            let t = scan
                .truncated
                .unwrap_or_else(|| panic!("cut at {cut} must be refused"));
            assert!(t.what.contains("header records"), "{t:?}");
        }
    }

    #[test]
    fn a_torn_last_write_in_a_segment_with_a_header_is_a_torn_tail() {
        let bytes = with_header(1, 10, None);
        let offs = offsets(&bytes, 1);
        // The last write reached the disk only in part: its later sectors still hold zeros.
        let mut torn = bytes.clone();
        let from = offs[7] + 40;
        let end = from.div_ceil(WRITE_ALIGN) * WRITE_ALIGN;
        torn[from..end].fill(0);
        let scan = scan_segment(&torn, 1, true).unwrap();
        assert_eq!(scan.truncated, None);
        assert_eq!(scan.records.len(), 7);
        assert_eq!(scan.torn.as_ref().map(|(o, _)| *o), Some(offs[7]));
        // The damaged record still names itself; the records after it are zeros.
        assert_eq!(count_records_past(&torn, offs[7], 8), 1);
    }

    #[test]
    fn a_damaged_or_misnamed_header_is_corruption() {
        let mut bytes = with_header(1, 10, None);
        bytes[10] ^= 1;
        bytes[512 + 10] ^= 1;
        assert_eq!(scan_segment(&bytes, 1, true).unwrap_err().offset, 0);
        let bytes = with_header(1, 10, None);
        assert!(scan_segment(&bytes, 2, true)
            .unwrap_err()
            .reason
            .contains("file name"));
    }

    #[test]
    fn count_records_past_counts_legible_headers_and_at_least_the_damaged_one() {
        let bytes = segment(1, 10);
        let offs = offsets(&bytes, 1);
        assert_eq!(count_records_past(&bytes, offs[6], 7), 4);
        assert_eq!(count_records_past(&bytes, bytes.len(), 11), 0);
        let mut garbled = bytes.clone();
        garbled[offs[9]] ^= 0xff;
        garbled[offs[9] + 1] ^= 0xff;
        garbled[offs[9] + 3] ^= 0x7f;
        assert_eq!(count_records_past(&garbled, offs[9], 10), 1);
    }

    #[test]
    fn a_gap_in_the_indexes_is_corruption() {
        let mut bytes = Vec::new();
        encode_record(1, &command(1), &mut bytes).unwrap();
        encode_record(3, &command(3), &mut bytes).unwrap();
        assert!(scan_segment(&bytes, 1, true).is_err());
    }
}
