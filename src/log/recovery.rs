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
//! - **No file is changed before that decision.** Recovery only reads; the truncation and removals
//!   it decided on are carried out by [`LogRecovery::finish`], which the caller runs once the
//!   whole store (tables and log) has been read without error.
//!
//! Runs once, before the shard serves; it may block on std I/O.

use std::path::{Path, PathBuf};

use super::command::Command;
use super::wal::{
    find_intact_record, parse_segment_name, ScanEnd, SegmentMeta, SegmentReader,
    RECORD_HEADER_BYTES,
};
use crate::storage::StoreError;
use crate::storage::{corrupt, io as dio, io_error};

/// A torn WAL tail found (and cut off by [`LogRecovery::finish`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub file: String,
    pub offset: u64,
    pub reason: String,
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
    Truncate { path: PathBuf, len: u64 },
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
    /// cover), then syncs the directory. Call only once every part of the store was read.
    pub fn finish(&mut self, dir: &Path) -> Result<(), StoreError> {
        let mut removed = false;
        for step in std::mem::take(&mut self.cleanup) {
            match step {
                Cleanup::Remove(path) => {
                    remove_blocking(&path)?;
                    removed = true;
                }
                Cleanup::Truncate { path, len } => {
                    tracing::warn!(file = %path.display(), offset = len, "cutting torn WAL tail");
                    truncate_blocking(&path, len)?;
                }
            }
        }
        if removed {
            dio::sync_dir_blocking(dir)?;
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

/// The records of one segment and how it ends, checked against the rules above. Pure.
#[derive(Debug, PartialEq, Eq)]
pub struct SegmentScan {
    /// `(offset, index)` of each intact record, in order.
    pub records: Vec<(usize, u64)>,
    /// Where a torn tail starts, if the segment has one.
    pub torn: Option<(usize, String)>,
    /// Offset just past the last intact record.
    pub records_end: usize,
}

/// Why a segment cannot be recovered, with where.
#[derive(Debug, PartialEq, Eq)]
pub struct Damage {
    pub offset: u64,
    pub reason: String,
    pub evidence: String,
}

/// Scans one segment's bytes: intact records, then either a clean end, a torn tail (allowed only
/// when `is_last` and no intact record follows the damage), or [`Damage`]. Pure.
pub fn scan_segment(bytes: &[u8], first_seq: u64, is_last: bool) -> Result<SegmentScan, Damage> {
    let mut reader = SegmentReader::new(bytes);
    let mut records = Vec::new();
    let mut records_end = 0;
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
    let Some((offset, reason)) = torn else {
        return Ok(SegmentScan {
            records,
            torn: None,
            records_end,
        });
    };
    if !is_last {
        return Err(Damage {
            offset: offset as u64,
            reason,
            evidence: "a later segment exists (a segment is synced before the next one starts)"
                .into(),
        });
    }
    if let Some((at, seq)) = find_intact_record(bytes, offset, last_seq) {
        return Err(Damage {
            offset: offset as u64,
            reason,
            evidence: format!("intact record {seq} follows at byte {at}"),
        });
    }
    Ok(SegmentScan {
        records,
        torn: Some((offset, reason)),
        records_end,
    })
}

/// Reads the log in `dir` and calls `apply(index, command)` for every command past
/// `applied_index`, in order. Changes no file (see [`LogRecovery::finish`]).
pub async fn recover(
    dir: &Path,
    applied_index: u64,
    mut apply: impl FnMut(u64, Command),
) -> Result<LogRecovery, StoreError> {
    recover_records(dir, applied_index, |seq, payload| {
        apply(seq, Command::decode(payload).map_err(|e| e.to_string())?);
        Ok(())
    })
    .await
}

/// [`recover`] for any payload: calls `replay(seq, payload)` for every record past
/// `applied_index`, in order; an error from `replay` is corruption of that record. The
/// replicated log uses it with `applied_index = 0` (its record numbers are not Raft indexes).
pub async fn recover_records(
    dir: &Path,
    applied_index: u64,
    mut replay: impl FnMut(u64, &[u8]) -> Result<(), String>,
) -> Result<LogRecovery, StoreError> {
    let segments = list_segments(dir)?;
    let mut report = LogReport::default();
    let mut cleanup = Vec::new();
    let mut live_segments = Vec::new();
    let mut expected = applied_index + 1;
    for (i, (first_seq, path)) in segments.iter().enumerate() {
        let next_first = segments.get(i + 1).map(|(s, _)| *s);
        if next_first.is_some_and(|next| next <= applied_index + 1) {
            cleanup.push(Cleanup::Remove(path.clone()));
            report.segments_removed += 1;
            continue;
        }
        let bytes = dio::read_blocking(path).map_err(|e| io_error(path, e))?;
        report.segments_read += 1;
        report.wal_bytes_read += bytes.len() as u64;
        let scan = scan_segment(&bytes, *first_seq, next_first.is_none()).map_err(|d| {
            StoreError::LogCorrupt {
                file: path.display().to_string(),
                offset: d.offset,
                reason: d.reason,
                evidence: d.evidence,
            }
        })?;
        let mut applied_here = 0u64;
        for &(offset, seq) in &scan.records {
            if seq <= applied_index {
                continue;
            }
            if seq != expected {
                return Err(StoreError::LogCorrupt {
                    file: path.display().to_string(),
                    offset: offset as u64,
                    reason: format!("record {seq} found where {expected} was expected"),
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
            expected += 1;
            applied_here += 1;
            report.records_replayed += 1;
            if report.records_replayed % 1024 == 0 {
                glommio::yield_if_needed().await;
            }
        }
        if let Some((offset, reason)) = &scan.torn {
            report.torn_tail = Some(TornTail {
                file: path.display().to_string(),
                offset: *offset as u64,
                reason: reason.clone(),
            });
        }
        if applied_here == 0 {
            // Nothing here that the tables lack: the segment is not needed.
            cleanup.push(Cleanup::Remove(path.clone()));
            report.segments_removed += 1;
            continue;
        }
        if let Some((offset, _)) = &scan.torn {
            cleanup.push(Cleanup::Truncate {
                path: path.clone(),
                len: *offset as u64,
            });
        }
        live_segments.push(SegmentMeta {
            first_seq: *first_seq,
            path: path.clone(),
            bytes: crate::storage::io::align_up(scan.records_end) as u64,
        });
    }
    Ok(LogRecovery {
        next_index: expected,
        live_segments,
        report,
        cleanup,
    })
}

fn remove_blocking(path: &Path) -> Result<(), StoreError> {
    dio::remove_blocking(path)
}

fn truncate_blocking(path: &Path, len: u64) -> Result<(), StoreError> {
    dio::truncate_blocking(path, len)
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

    #[test]
    fn a_truncated_last_segment_is_a_torn_tail() {
        let bytes = segment(1, 10);
        let last = *offsets(&bytes, 1).last().unwrap();
        let cut = &bytes[..last + 20];
        let scan = scan_segment(cut, 1, true).unwrap();
        assert_eq!(scan.records.len(), 9);
        assert_eq!(scan.torn.as_ref().map(|(o, _)| *o), Some(last));
    }

    #[test]
    fn a_gap_in_the_indexes_is_corruption() {
        let mut bytes = Vec::new();
        encode_record(1, &command(1), &mut bytes).unwrap();
        encode_record(3, &command(3), &mut bytes).unwrap();
        assert!(scan_segment(&bytes, 1, true).is_err());
    }
}
