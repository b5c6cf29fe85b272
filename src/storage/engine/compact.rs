//! The compactor: asks the pure policy (`crate::storage::compaction::choose`) what to merge,
//! merges those tables through the compaction filter into one, swaps them in the manifest, and
//! removes replaced tables once no reader holds them.
//!
//! Runs in the engine's background task queue and yields every 256 entries.

use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use super::flush::stored_form;
use super::{Inner, Version};
use crate::storage::compaction::{self, Choice, Reason, TableSummary, Verdict};
use crate::storage::corrupt;
use crate::storage::io as dio;
use crate::storage::manifest::{self, TableEntry};
use crate::storage::merge::{MergeIter, Source};
use crate::storage::table::{table_name, Table, TableCursor, TableWriter};
use crate::storage::StoreError;

impl Inner {
    pub(super) async fn run_compactor(self: Rc<Self>) {
        let interval = Duration::from_millis(self.options.compaction_interval_ms.max(1));
        let mut attempt = 0u32;
        loop {
            if self.stopping() {
                break;
            }
            self.reap_obsolete().await;
            match self.compact_once(false).await {
                Ok(true) => {
                    attempt = 0;
                    continue;
                }
                Err(e) if e.is_no_space() => {
                    // Nothing changed: the inputs stay live and the output was removed.
                    let delay = self.note_disk_full("a compaction", &e, attempt, false);
                    attempt = attempt.saturating_add(1);
                    self.sleep_unless_stopping(delay).await;
                }
                Ok(false) => {
                    let wait = self.compact_wanted.wait();
                    if self.stopping() {
                        break;
                    }
                    futures_lite::future::or(wait, glommio::timer::sleep(interval)).await;
                }
                Err(StoreError::Closed) => break,
                Err(e) => {
                    self.fail(&e);
                    break;
                }
            }
        }
    }

    pub(super) fn summaries(tables: &[Rc<Table>]) -> Vec<TableSummary> {
        tables
            .iter()
            .map(|t| {
                let p = t.props();
                TableSummary {
                    id: t.id(),
                    file_bytes: t.file_len(),
                    puts: p.puts,
                    tombstones: p.tombstones,
                    key_bytes: p.key_bytes,
                    value_bytes: p.value_bytes,
                    ttl_value_bytes: p.ttl_value_bytes,
                    expires_min_ms: p.expires_min_ms,
                    expires_max_ms: p.expires_max_ms,
                }
            })
            .collect()
    }

    /// Runs one compaction if the policy (or `full`) asks for one. Returns whether it did.
    pub(super) async fn compact_once(&self, full: bool) -> Result<bool, StoreError> {
        let _permit = self
            .compaction_lock
            .acquire_permit(1)
            .await
            .map_err(|_| StoreError::Closed)?;
        let now_ms = self.clock.now_ms();
        let version = Rc::clone(&self.state.borrow().version);
        let summaries = Self::summaries(&version.tables);
        let choice = if full {
            compaction::choose_full(&summaries, now_ms)
        } else {
            compaction::choose(&summaries, &self.options.compaction, now_ms)
        };
        let Choice::Merge {
            first,
            count,
            reason,
        } = choice
        else {
            return Ok(false);
        };
        if count == 0 || first + count > version.tables.len() {
            return Ok(false);
        }
        let inputs: Vec<Rc<Table>> = version.tables[first..first + count].to_vec();
        let older: Vec<Rc<Table>> = version.tables[first + count..].to_vec();
        drop(version);
        self.compact(inputs, older, now_ms, reason).await?;
        Ok(true)
    }

    pub(super) async fn compact(
        &self,
        inputs: Vec<Rc<Table>>,
        older: Vec<Rc<Table>>,
        now_ms: u64,
        reason: Reason,
    ) -> Result<(), StoreError> {
        let id = self.alloc_table_id();
        let path = self.dir.join(table_name(id));
        let mut writer: Option<TableWriter> = None;
        let damaged_before: u64 = inputs.iter().map(|t| t.unreadable().blocks).sum();
        let merged = self
            .merge_tables(&inputs, &older, &path, now_ms, &mut writer)
            .await;
        let damaged: u64 = inputs.iter().map(|t| t.unreadable().blocks).sum();
        if damaged > 0 && merged.is_ok() {
            // The merge walked past them: the new table leaves their keys out for good.
            tracing::warn!(
                dir = %self.dir.display(),
                blocks = damaged,
                new_this_merge = damaged - damaged_before.min(damaged),
                "compaction drops the key ranges of unreadable blocks (their messages were already lost)"
            );
        }
        let (dropped_tombstones, dropped_expired) = match merged {
            Ok(counts) => counts,
            Err(e) => {
                if let Some(w) = writer.take() {
                    w.abandon().await;
                }
                return Err(e);
            }
        };
        let output = match writer {
            Some(w) => {
                let (_, len) = w.finish().await?;
                Some((Rc::new(Table::open(&path, id).await?), len))
            }
            None => None,
        };
        let bytes_read: u64 = inputs.iter().map(|t| t.file_len()).sum();
        {
            let _permit = self
                .manifest_lock
                .acquire_permit(1)
                .await
                .map_err(|_| StoreError::Closed)?;
            let current = Rc::clone(&self.state.borrow().version);
            let Some(pos) = current
                .tables
                .iter()
                .position(|t| Rc::ptr_eq(t, &inputs[0]))
            else {
                return Err(corrupt(
                    &self.dir,
                    "compaction inputs vanished (engine bug)",
                ));
            };
            let contiguous = inputs.iter().enumerate().all(|(i, t)| {
                current
                    .tables
                    .get(pos + i)
                    .is_some_and(|c| Rc::ptr_eq(c, t))
            });
            if !contiguous {
                return Err(corrupt(
                    &self.dir,
                    "compaction inputs are no longer contiguous (engine bug)",
                ));
            }
            let mut tables: Vec<Rc<Table>> = current.tables[..pos].to_vec();
            if let Some((t, _)) = &output {
                tables.push(Rc::clone(t));
            }
            tables.extend(current.tables[pos + inputs.len()..].iter().cloned());
            let mut next = self.state.borrow().manifest.clone();
            next.next_table_id = self.state.borrow().next_table_id;
            next.tables = tables
                .iter()
                .map(|t| TableEntry {
                    id: t.id(),
                    file_len: t.file_len(),
                })
                .collect();
            if let Err(e) = manifest::write(&self.dir, &next).await {
                drop(tables);
                drop(current);
                if let Some((t, _)) = output {
                    super::flush::discard_unlisted(t, &self.dir, &e).await;
                }
                return Err(e);
            }
            let mut st = self.state.borrow_mut();
            st.version = Rc::new(Version { tables });
            st.manifest = next;
            st.obsolete.extend(inputs.iter().cloned());
        }
        let written = output.as_ref().map_or(0, |(_, len)| *len);
        {
            let mut c = self.counters.borrow_mut();
            c.compactions += 1;
            c.compaction_bytes_read += bytes_read;
            c.compaction_bytes_written += written;
            c.compaction_tombstones_dropped += dropped_tombstones;
            c.compaction_expired_dropped += dropped_expired;
        }
        tracing::debug!(
            ?reason,
            inputs = inputs.len(),
            bytes_read,
            written,
            "compaction done"
        );
        drop(inputs);
        self.reap_obsolete().await;
        Ok(())
    }

    pub(super) async fn merge_tables(
        &self,
        inputs: &[Rc<Table>],
        older: &[Rc<Table>],
        path: &Path,
        now_ms: u64,
        writer: &mut Option<TableWriter>,
    ) -> Result<(u64, u64), StoreError> {
        let sources = inputs
            .iter()
            .map(|t| Source::Disk(TableCursor::new(Rc::clone(t), &[], None)))
            .collect();
        let mut merge = MergeIter::new(sources);
        let (mut dropped_tombstones, mut dropped_expired) = (0u64, 0u64);
        let mut n = 0u64;
        while let Some((key, entry)) = merge.next().await? {
            let verdict = compaction::filter(&key, &entry, now_ms, |k| {
                older.iter().any(|t| t.may_contain(k))
            });
            let Some((stored, expiry)) = stored_form(&key, &entry, &verdict) else {
                match verdict {
                    Verdict::DropTombstone => dropped_tombstones += 1,
                    _ => dropped_expired += 1,
                }
                continue;
            };
            self.add_to_table(writer, path, &key, stored, expiry)
                .await?;
            n += 1;
            if n % 256 == 0 {
                if self.state.borrow().shutdown {
                    return Err(StoreError::Closed);
                }
                glommio::yield_if_needed().await;
            }
        }
        Ok((dropped_tombstones, dropped_expired))
    }

    /// Removes the files of replaced tables that no reader holds any more.
    pub(super) async fn reap_obsolete(&self) {
        let candidates = std::mem::take(&mut self.state.borrow_mut().obsolete);
        let mut keep = Vec::new();
        for table in candidates {
            match Rc::try_unwrap(table) {
                Ok(table) => {
                    self.counters.borrow_mut().retired_unreadable += table.unreadable();
                    let path = table.path().to_path_buf();
                    let _ = table.close().await;
                    if let Err(e) = dio::remove(&path).await {
                        tracing::warn!(file = %path.display(), error = %e, "could not remove a compacted table; recovery will");
                    }
                }
                Err(table) => keep.push(table),
            }
        }
        self.state.borrow_mut().obsolete.extend(keep);
    }
}
