//! Crash recovery of the engine: rebuild a shard's tables from its directory.
//!
//! Order: make DMA reads work ([`io::probe_disk`]), load the manifest, find files it does not
//! list (tables from a flush or compaction that never committed, a leftover `MANIFEST.tmp`),
//! open every listed table (a missing, short or corrupt one is an error naming the file: pinq
//! refuses to serve from a damaged store). The manifest's `applied_index` tells the caller where
//! to replay the command log from (`crate::log::recovery`); the engine itself has no log.
//!
//! Nothing is removed here: the orphans found are returned as [`Recovered::orphans`], and the
//! caller removes them only once the log, too, was read without error, so a refused start leaves
//! every file as it was.
//!
//! Runs once, inside the store's open, before the shard serves; it may block on std I/O.
//! Called only by the engine.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::io as dio;
use super::manifest::{self, Manifest, MANIFEST_TMP_FILE};
use super::options::LsmOptions;
use super::table::{parse_table_name, table_name, Table};
use super::{corrupt, io_error};
use crate::storage::StoreError;

pub use crate::log::recovery::TornTail;

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
    /// Files to remove once the whole store was read without error.
    pub orphans: Vec<PathBuf>,
    pub report: RecoveryReport,
}

/// Removes the orphans recovery found, and syncs the directory if it removed any.
pub(crate) fn remove_orphans(dir: &Path, orphans: &[PathBuf]) -> Result<(), StoreError> {
    for path in orphans {
        tracing::info!(file = %path.display(), "removing orphan file");
        dio::remove_blocking(path)?;
    }
    if !orphans.is_empty() {
        dio::sync_dir_blocking(dir)?;
    }
    Ok(())
}

/// Rebuilds the engine's state from `dir` (created if missing). Changes no file but the
/// storage marker (see [`dio::probe_disk`]).
pub(crate) async fn recover(dir: &Path, options: &LsmOptions) -> Result<Recovered, StoreError> {
    std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    dio::probe_disk(dir).await?;
    let mut report = RecoveryReport::default();

    let manifest = manifest::read_blocking(dir)?.unwrap_or(Manifest {
        next_table_id: 1,
        ..Manifest::default()
    });
    let mut orphans = Vec::new();
    let tmp = dir.join(MANIFEST_TMP_FILE);
    if tmp.exists() {
        orphans.push(tmp);
    }
    let listed: std::collections::HashSet<u64> = manifest.tables.iter().map(|t| t.id).collect();
    for entry in std::fs::read_dir(dir).map_err(|e| io_error(dir, e))? {
        let entry = entry.map_err(|e| io_error(dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if parse_table_name(name).is_some_and(|id| !listed.contains(&id)) {
            orphans.push(entry.path());
        }
    }
    report.orphan_files_removed = orphans.len();

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
    Ok(Recovered {
        manifest,
        tables,
        orphans,
        report,
    })
}
