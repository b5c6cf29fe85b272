//! The flusher: writes the oldest frozen memtable through the compaction filter to a table,
//! commits the manifest with the highest log index the table now holds, and installs the table.
//!
//! Runs in the engine's background task queue; streams the memtable in chunks and yields between
//! them, so a flush of any size takes bounded memory (one block) and never starves dispatch.

use std::cell::RefCell;
use std::ops::Bound;
use std::path::Path;
use std::rc::Rc;

use super::{Inner, Version};
use crate::key::Key;
use crate::storage::compaction::{self, Verdict};
use crate::storage::corrupt;
use crate::storage::manifest::{self, TableEntry};
use crate::storage::memtable::{Entry, Memtable, MemtableCounters};
use crate::storage::table::block::EntryRef;
use crate::storage::table::{table_name, Table, TableWriter};
use crate::storage::StoreError;

impl Inner {
    pub(super) async fn run_flusher(self: Rc<Self>) {
        let mut attempt = 0u32;
        loop {
            let next = {
                let st = self.state.borrow();
                if st.shutdown || st.failed.is_some() {
                    break;
                }
                st.frozen.back().cloned()
            };
            match next {
                Some(mt) => match self.flush_memtable(mt).await {
                    Ok(()) => {
                        attempt = 0;
                        self.note_space_back();
                    }
                    Err(e) if e.is_no_space() => {
                        // The memtable stays frozen (its commands stay in the log) and is
                        // flushed again; writers stall once the frozen queue is full.
                        let delay = self.note_disk_full("a memtable flush", &e, attempt, true);
                        attempt = attempt.saturating_add(1);
                        self.flushed.notify();
                        self.sleep_unless_stopping(delay).await;
                    }
                    Err(e) => {
                        if !matches!(e, StoreError::Closed) {
                            self.fail(&e);
                        }
                        break;
                    }
                },
                None => {
                    let wait = self.flush_wanted.wait();
                    if self.state.borrow().frozen.is_empty() && !self.stopping() {
                        wait.await;
                    }
                }
            }
        }
        self.flushed.notify();
    }

    /// Adds one entry to the table being written, creating its file on the first entry (a
    /// flush or compaction whose every entry is dropped writes no table at all).
    pub(super) async fn add_to_table(
        &self,
        writer: &mut Option<TableWriter>,
        path: &Path,
        key: &[u8],
        stored: EntryRef<'_>,
        expiry: Option<u64>,
    ) -> Result<(), StoreError> {
        let w = match writer {
            Some(w) => w,
            None => writer.insert(
                TableWriter::create(
                    path,
                    self.options.block_bytes,
                    self.options.bloom_bits_per_key,
                )
                .await?,
            ),
        };
        w.add(key, stored, expiry).await
    }

    /// Writes the oldest frozen memtable to a table, commits the manifest (with the highest log
    /// index the table now holds) and installs the table.
    pub(super) async fn flush_memtable(&self, mt: Rc<RefCell<Memtable>>) -> Result<(), StoreError> {
        let now_ms = self.clock.now_ms();
        let id = self.alloc_table_id();
        let path = self.dir.join(table_name(id));
        let mut writer: Option<TableWriter> = None;
        let built = self.write_memtable(&mt, &path, now_ms, &mut writer).await;
        let (dropped_tombstones, dropped_expired) = match built {
            Ok(counts) => counts,
            Err(e) => {
                if let Some(w) = writer.take() {
                    w.abandon().await;
                }
                return Err(e);
            }
        };
        let table = match writer {
            Some(w) => {
                let (_, len) = w.finish().await?;
                Some((Rc::new(Table::open(&path, id).await?), len))
            }
            None => None,
        };
        let (last_seq, high_water, mt_counters) = {
            let m = mt.borrow();
            (m.last_seq(), m.event_id_high_water(), m.counters())
        };
        {
            let _permit = self
                .manifest_lock
                .acquire_permit(1)
                .await
                .map_err(|_| StoreError::Closed)?;
            let mut next = self.state.borrow().manifest.clone();
            next.next_table_id = self.state.borrow().next_table_id;
            next.applied_index = next.applied_index.max(last_seq);
            next.event_id_high_water = next.event_id_high_water.max(high_water);
            if let Some((_, len)) = &table {
                next.tables.insert(0, TableEntry { id, file_len: *len });
            }
            if let Err(e) = manifest::write(&self.dir, &next).await {
                if let Some((t, _)) = table {
                    discard_unlisted(t, &self.dir, &e).await;
                }
                return Err(e);
            }
            let mut st = self.state.borrow_mut();
            if let Some((t, _)) = &table {
                let mut tables = Vec::with_capacity(st.version.tables.len() + 1);
                tables.push(Rc::clone(t));
                tables.extend(st.version.tables.iter().cloned());
                st.version = Rc::new(Version { tables });
            }
            match st.frozen.back() {
                Some(back) if Rc::ptr_eq(back, &mt) => {
                    st.frozen.pop_back();
                }
                _ => {
                    return Err(corrupt(
                        &self.dir,
                        "flushed memtable is not the oldest frozen one (engine bug)",
                    ))
                }
            }
            st.manifest = next;
        }
        self.count_flush(&table, (dropped_tombstones, dropped_expired), &mt_counters);
        self.flushed.notify();
        self.compact_wanted.notify();
        Ok(())
    }

    /// Adds one committed flush to the counters: (tombstones, expired) it dropped, the table it
    /// wrote, the memtable's own counts.
    fn count_flush(
        &self,
        table: &Option<(Rc<Table>, u64)>,
        (dropped_tombstones, dropped_expired): (u64, u64),
        mt_counters: &MemtableCounters,
    ) {
        let mut c = self.counters.borrow_mut();
        c.flushes += 1;
        c.flush_tombstones_dropped += dropped_tombstones;
        c.flush_expired_dropped += dropped_expired;
        if let Some((t, len)) = table {
            c.flush_bytes_written += len;
            c.flush_entries += t.props().entries();
        }
        let f = &mut c.flushed_memtables;
        f.puts += mt_counters.puts;
        f.annihilated += mt_counters.annihilated;
        f.tombstones += mt_counters.tombstones;
        f.deletes_dropped += mt_counters.deletes_dropped;
    }

    /// Sleeps `delay`, or less if the engine shuts down meanwhile.
    pub(super) async fn sleep_unless_stopping(&self, delay: std::time::Duration) {
        let stop = async {
            while !self.stopping() {
                self.flush_wanted.wait().await;
            }
        };
        futures_lite::future::or(glommio::timer::sleep(delay), stop).await;
    }

    /// Streams a frozen memtable through the compaction filter into `writer` (created on the
    /// first surviving entry). Returns (tombstones dropped, expired dropped).
    pub(super) async fn write_memtable(
        &self,
        mt: &Rc<RefCell<Memtable>>,
        path: &Path,
        now_ms: u64,
        writer: &mut Option<TableWriter>,
    ) -> Result<(u64, u64), StoreError> {
        const CHUNK: usize = 256;
        let mut after: Option<Key> = None;
        let (mut dropped_tombstones, mut dropped_expired) = (0u64, 0u64);
        loop {
            let chunk: Vec<(Key, Entry)> = {
                let m = mt.borrow();
                let lower = after
                    .as_ref()
                    .map_or(Bound::Unbounded, |k| Bound::Excluded(k.as_slice()));
                m.range(lower, Bound::Unbounded)
                    .take(CHUNK)
                    .map(|(k, e)| (k.clone(), e.clone()))
                    .collect()
            };
            let Some((last, _)) = chunk.last() else { break };
            after = Some(last.clone());
            for (key, entry) in &chunk {
                let verdict = {
                    let st = self.state.borrow();
                    let tables = &st.version.tables;
                    compaction::filter(key, entry, now_ms, |k| {
                        tables.iter().any(|t| t.may_contain(k))
                    })
                };
                let Some((stored, expiry)) = stored_form(key, entry, &verdict) else {
                    match verdict {
                        Verdict::DropTombstone => dropped_tombstones += 1,
                        _ => dropped_expired += 1,
                    }
                    continue;
                };
                self.add_to_table(writer, path, key, stored, expiry).await?;
            }
            if self.state.borrow().shutdown {
                return Err(StoreError::Closed);
            }
            glommio::yield_if_needed().await;
        }
        Ok((dropped_tombstones, dropped_expired))
    }
}

/// Removes a table written for a manifest commit that failed, unless the failure came after
/// the new manifest was renamed into place (then the table may be listed: recovery removes it
/// if it is not). Best effort: a leftover is an orphan the next start removes.
pub(super) async fn discard_unlisted(table: Rc<Table>, dir: &Path, error: &StoreError) {
    let tmp = dir.join(manifest::MANIFEST_TMP_FILE).display().to_string();
    let before_rename = matches!(error, StoreError::Io { path, .. } if *path == tmp);
    let Ok(table) = Rc::try_unwrap(table) else {
        return;
    };
    let path = table.path().to_path_buf();
    let _ = table.close().await;
    if before_rename {
        let _ = crate::storage::io::remove(&path).await;
    }
}

/// The stored form of a surviving entry, or `None` when the verdict drops it.
pub(super) fn stored_form<'a>(
    key: &[u8],
    entry: &'a Entry,
    verdict: &Verdict,
) -> Option<(EntryRef<'a>, Option<u64>)> {
    match (verdict, entry) {
        (Verdict::Keep, Entry::Put(value)) => Some((
            EntryRef::Put(value.as_bytes()),
            compaction::expiry_of(key, value),
        )),
        (Verdict::Keep, Entry::Tombstone) | (Verdict::Tombstone, _) => {
            Some((EntryRef::Tombstone, None))
        }
        (Verdict::DropTombstone, _) | (Verdict::DropExpired, _) => None,
    }
}
