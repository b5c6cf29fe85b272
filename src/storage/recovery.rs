//! Crash recovery: rebuild a shard's store from its directory.
//!
//! Order: make DMA reads work ([`io::probe_disk`]), load the manifest, remove files it does not
//! list (tables from a flush or compaction that never committed, a leftover `MANIFEST.tmp`),
//! open every listed table (a missing, short or corrupt one is an error naming the file: pinq
//! refuses to serve from a damaged store), then replay the WAL records after
//! `wal_flushed_seq` into memtables, in sequence order.
//!
//! The WAL's invariant makes the torn-tail rule simple: records are applied only if each is
//! exactly the next sequence number, so nothing after a lost or damaged record is applied. A
//! damaged record at the end of the log is a torn write that was never acknowledged: it is
//! truncated away (the file is shortened and synced before the shard writes anything new). A
//! damaged record followed by later valid records that the tables do not already hold is
//! corruption, and an error.
//!
//! Runs once, inside `LsmStore::open`, before the shard serves; it may block on std I/O.
//! Called only by the engine.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::engine::{live_below, LsmOptions};
use super::io as dio;
use super::manifest::{self, Manifest, MANIFEST_TMP_FILE};
use super::memtable::Memtable;
use super::table::{parse_table_name, table_name, Table};
use super::wal::{decode_batch, parse_segment_name, ScanEnd, SegmentMeta, SegmentReader};
use super::{corrupt, io_error};
use crate::store::StoreError;

/// A torn WAL tail found and truncated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub file: String,
    pub offset: u64,
    pub reason: String,
}

/// What recovery found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub tables: usize,
    pub table_bytes: u64,
    pub orphan_files_removed: usize,
    pub segments_read: usize,
    pub segments_removed: usize,
    pub records_replayed: u64,
    pub wal_bytes_read: u64,
    pub torn_tail: Option<TornTail>,
}

/// The state recovery hands to the engine.
pub(crate) struct Recovered {
    pub manifest: Manifest,
    /// Newest first.
    pub tables: Vec<Rc<Table>>,
    pub active: Memtable,
    /// Newest first.
    pub frozen: VecDeque<Rc<RefCell<Memtable>>>,
    pub next_seq: u64,
    pub live_segments: Vec<SegmentMeta>,
    pub report: RecoveryReport,
}

fn remove_blocking(path: &Path) -> Result<(), StoreError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error(path, e)),
    }
}

/// Rebuilds the store's state from `dir` (created if missing).
pub(crate) async fn recover(dir: &Path, options: &LsmOptions) -> Result<Recovered, StoreError> {
    std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    dio::probe_disk(dir).await?;
    let mut report = RecoveryReport::default();

    let manifest = manifest::read_blocking(dir)?.unwrap_or(Manifest {
        next_table_id: 1,
        wal_flushed_seq: 0,
        tables: Vec::new(),
    });
    remove_blocking(&dir.join(MANIFEST_TMP_FILE))?;

    let mut segments: Vec<(u64, PathBuf)> = Vec::new();
    let listed: std::collections::HashSet<u64> = manifest.tables.iter().map(|t| t.id).collect();
    let entries = std::fs::read_dir(dir).map_err(|e| io_error(dir, e))?;
    let mut removed_any = false;
    for entry in entries {
        let entry = entry.map_err(|e| io_error(dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(id) = parse_table_name(name) {
            if !listed.contains(&id) {
                tracing::info!(file = %entry.path().display(), "removing orphan table");
                remove_blocking(&entry.path())?;
                report.orphan_files_removed += 1;
                removed_any = true;
            }
        } else if let Some(first_seq) = parse_segment_name(name) {
            segments.push((first_seq, entry.path()));
        }
    }
    segments.sort();

    let mut tables = Vec::with_capacity(manifest.tables.len());
    for t in &manifest.tables {
        let path = dir.join(table_name(t.id));
        if !path.exists() {
            return Err(corrupt(&path, "table listed in the manifest is missing"));
        }
        let table = Table::open(&path, t.id).await?;
        if table.file_len() != t.file_len {
            return Err(corrupt(
                &path,
                format!(
                    "table is {} bytes, the manifest says {}",
                    table.file_len(),
                    t.file_len
                ),
            ));
        }
        if options.verify_tables_on_open {
            table.verify().await?;
        }
        report.table_bytes += t.file_len;
        tables.push(Rc::new(table));
    }
    report.tables = tables.len();

    // Replay the WAL past the manifest.
    let flushed = manifest.wal_flushed_seq;
    let mut expected = flushed + 1;
    let mut active = Memtable::new();
    let mut frozen: VecDeque<Rc<RefCell<Memtable>>> = VecDeque::new();
    let mut live_segments = Vec::new();
    let mut torn_at: Option<PathBuf> = None;
    for (first_seq, path) in segments {
        let bytes = std::fs::read(&path).map_err(|e| io_error(&path, e))?;
        report.segments_read += 1;
        report.wal_bytes_read += bytes.len() as u64;
        let mut reader = SegmentReader::new(&bytes);
        let mut applied_here = 0u64;
        let mut first_record = true;
        let mut records_end = 0usize;
        while let Some((offset, record)) = reader.next_record() {
            records_end = offset + super::wal::RECORD_HEADER_BYTES + record.payload.len();
            if first_record && record.seq != first_seq {
                return Err(corrupt(
                    &path,
                    format!("first record is {}, the name says {first_seq}", record.seq),
                ));
            }
            first_record = false;
            if record.seq <= flushed {
                continue;
            }
            if let Some(torn) = &torn_at {
                return Err(corrupt(
                    torn,
                    format!(
                        "damaged record followed by record {} in {}",
                        record.seq,
                        path.display()
                    ),
                ));
            }
            if record.seq != expected {
                return Err(corrupt(
                    &path,
                    format!("record {} found where {expected} was expected", record.seq),
                ));
            }
            let batch = decode_batch(record.payload)
                .map_err(|e| corrupt(&path, format!("record {}: {e}", record.seq)))?;
            active.apply(record.seq, batch, |key| live_below(&frozen, &tables, key));
            if active.bytes() >= options.memtable_bytes_max {
                frozen.push_front(Rc::new(RefCell::new(std::mem::take(&mut active))));
            }
            expected += 1;
            applied_here += 1;
            report.records_replayed += 1;
            if report.records_replayed % 1024 == 0 {
                glommio::yield_if_needed().await;
            }
        }
        let end = reader.end().cloned();
        if let Some(ScanEnd::Torn { offset, reason }) = end {
            if torn_at.is_none() {
                tracing::warn!(file = %path.display(), offset, %reason, "truncating torn WAL tail");
                report.torn_tail = Some(TornTail {
                    file: path.display().to_string(),
                    offset: offset as u64,
                    reason: reason.to_string(),
                });
            }
            torn_at = Some(path.clone());
            if applied_here > 0 {
                truncate_blocking(&path, offset as u64)?;
            }
        }
        if applied_here > 0 {
            live_segments.push(SegmentMeta {
                first_seq,
                path,
                bytes: records_end as u64,
            });
        } else {
            // Nothing here that the tables lack: the segment is not needed.
            remove_blocking(&path)?;
            report.segments_removed += 1;
            removed_any = true;
        }
    }
    if removed_any {
        dio::sync_dir_blocking(dir)?;
    }
    Ok(Recovered {
        next_seq: expected,
        manifest,
        tables,
        active,
        frozen,
        live_segments,
        report,
    })
}

fn truncate_blocking(path: &Path, len: u64) -> Result<(), StoreError> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| io_error(path, e))?;
    file.set_len(len).map_err(|e| io_error(path, e))?;
    file.sync_all().map_err(|e| io_error(path, e))
}
