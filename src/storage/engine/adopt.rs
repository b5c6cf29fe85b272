//! Adopting another engine's tables: the switch of a Raft snapshot's install. A follower builds
//! the leader's state in a staging engine of its own (in another directory, closed and flushed
//! before this runs); [`Engine::adopt`] then makes those tables this engine's whole state with
//! one manifest commit.
//!
//! The staged tables are hard-linked into this engine's directory under new ids (the staging
//! directory stays whole, so an adopt interrupted by a crash can run again from it), the
//! manifest that lists only them (and the snapshot's index) replaces the old one atomically, and
//! the old tables are removed once no reader holds them. A crash before the manifest's rename
//! leaves the old state (the links are orphans recovery removes); after it, the new one.

use std::path::Path;
use std::rc::Rc;

use super::{Engine, Version};
use crate::storage::io as dio;
use crate::storage::manifest::{self, Manifest, TableEntry};
use crate::storage::memtable::Memtable;
use crate::storage::table::{table_name, Table};
use crate::storage::{corrupt, io_error, StoreError};

impl Engine {
    /// Replaces everything this engine holds with the tables of the closed engine in `staged`,
    /// as of log index `applied_index` (see the module docs). The caller applies nothing
    /// meanwhile (the Raft driver runs the install in its loop).
    pub async fn adopt(&self, staged: &Path, applied_index: u64) -> Result<(), StoreError> {
        let inner = &self.inner;
        // No flush may commit after the switch: drain them all first.
        self.flush().await?;
        let _compacting = inner
            .compaction_lock
            .acquire_permit(1)
            .await
            .map_err(|_| StoreError::Closed)?;
        let _committing = inner
            .manifest_lock
            .acquire_permit(1)
            .await
            .map_err(|_| StoreError::Closed)?;
        let untouched = {
            let st = inner.state.borrow();
            st.frozen.is_empty() && st.active.borrow().last_seq() == 0
        };
        if !untouched {
            return Err(corrupt(
                &inner.dir,
                "written to while adopting a snapshot's tables (driver bug)",
            ));
        }
        let theirs = manifest::read_blocking(staged)?
            .ok_or_else(|| corrupt(staged, "the staged engine has no manifest"))?;
        let (entries, tables) = self.link_tables(staged, &theirs).await?;
        let mut next = inner.state.borrow().manifest.clone();
        next.next_table_id = inner.state.borrow().next_table_id;
        next.applied_index = applied_index;
        next.event_id_high_water = next.event_id_high_water.max(theirs.event_id_high_water);
        next.tables = entries;
        if let Err(e) = manifest::write(&inner.dir, &next).await {
            for table in tables {
                super::flush::discard_unlisted(table, &inner.dir, &e).await;
            }
            return Err(e);
        }
        {
            let mut st = inner.state.borrow_mut();
            let old = std::mem::replace(&mut st.version, Rc::new(Version { tables }));
            st.obsolete.extend(old.tables.iter().cloned());
            st.active = Rc::new(std::cell::RefCell::new(Memtable::new()));
            st.event_id_high_water = next.event_id_high_water;
            st.manifest = next;
        }
        inner.reap_obsolete().await;
        inner.compact_wanted.notify();
        Ok(())
    }

    /// Links the staged manifest's tables here under new ids, newest first, and opens them.
    async fn link_tables(
        &self,
        staged: &Path,
        theirs: &Manifest,
    ) -> Result<(Vec<TableEntry>, Vec<Rc<Table>>), StoreError> {
        let inner = &self.inner;
        let mut entries = Vec::with_capacity(theirs.tables.len());
        let mut tables = Vec::with_capacity(theirs.tables.len());
        for entry in &theirs.tables {
            let id = inner.alloc_table_id();
            let from = staged.join(table_name(entry.id));
            let to = inner.dir.join(table_name(id));
            std::fs::hard_link(&from, &to).map_err(|e| io_error(&to, e))?;
            entries.push(TableEntry {
                id,
                file_len: entry.file_len,
            });
            tables.push(Rc::new(Table::open(&to, id).await?));
        }
        dio::sync_dir(&inner.dir).await?;
        Ok((entries, tables))
    }
}
