//! [`CommitPath`]: the one way a command reaches a shard's LSM engine, standalone and replicated
//! alike, and [`Logged`], which makes any log in front of the engine a [`Store`].
//!
//! ```text
//!  commit ─▶ admit ─▶ room in the log ─▶ Log::propose ─▶ apply (standalone) ─▶ Log::wait_durable
//!            (frozen     (walMaxBytes:        │                                  (fdatasync, or
//!             memtables)  wait for a flush)    └─ replicated: the Raft driver      quorum + apply)
//!                                                 applies committed entries
//!                                                 through CommitPath::apply
//! ```
//!
//! - **Admission**: the engine's bound on frozen memtables, in arrival order (`Engine::admit`).
//! - **Room in the log**: the log-size cap (`wal_bytes_max`, `storage.walMaxBytes`) is a bound on
//!   disk use, not a trigger that load can outrun: at the cap the memtable is frozen and the log
//!   rolled, and writers wait until the flush lets the log release what the tables now hold
//!   (`reclaimed`, notified by the store's reclaimer). With nothing to freeze there is nothing to
//!   release: the writer goes ahead. A follower's appends keep the same bound: the replicated
//!   store asks [`CommitPath::must_wait_for_room`] before it takes a leader's entries, and leaves
//!   them to be resent while the answer is yes.
//! - **Apply**: under the log index, with no await after the propose; a freeze (a full memtable,
//!   or the cap) starts a new log segment, so a segment's records belong to as few memtables as
//!   possible and are released together.
//! - **Wait**: `Sync::Durable` waits for the log's promise; a replicated log's commit always
//!   waits for its entry to be committed and applied, and `accepted` tells the caller earlier
//!   when `Sync::Buffered` is all it asked for.
//!
//! Full disk: a store whose log keeps records it could not write (the standalone WAL retries
//! them) refuses new commands with `StoreError::DiskFull` before they reach the log.

use std::rc::Rc;

use super::engine::Engine;
use super::signal::Signal;
use crate::key::Key;
use crate::log::{Command, Log, Wal};
use crate::message::Value;
use crate::storage::{Store, StoreError, Sync};

/// The engine, the WAL file writer under the log, and the cap rule between them. See the module
/// docs.
pub struct CommitPath {
    engine: Rc<Engine>,
    wal: Rc<Wal>,
    wal_bytes_max: u64,
    /// Notified each time the log released what a flush covers (or its reclaimer stopped).
    reclaimed: Rc<Signal>,
}

impl CommitPath {
    pub fn new(engine: Rc<Engine>, wal: Rc<Wal>, wal_bytes_max: u64) -> CommitPath {
        CommitPath {
            engine,
            wal,
            wal_bytes_max,
            reclaimed: Rc::new(Signal::default()),
        }
    }

    pub fn engine(&self) -> &Rc<Engine> {
        &self.engine
    }

    pub fn wal(&self) -> &Rc<Wal> {
        &self.wal
    }

    /// The log-size cap in bytes on disk.
    pub fn wal_bytes_max(&self) -> u64 {
        self.wal_bytes_max
    }

    /// What the reclaimer notifies once it released log segments (or stopped).
    pub(crate) fn reclaimed(&self) -> &Rc<Signal> {
        &self.reclaimed
    }

    /// Commits `command` through `log` (see the module docs); `accepted` runs once the command
    /// reached what `sync` promises to the caller (`Sync::Buffered` on a replicated log: the
    /// leader appended it). Returns its log index.
    pub async fn commit(
        &self,
        log: &impl Log,
        command: &Command,
        sync: Sync,
        accepted: impl FnOnce(),
    ) -> Result<u64, StoreError> {
        if let Some(path) = self.disk_full() {
            // Refused before the log: this command is not stored.
            return Err(StoreError::DiskFull { path });
        }
        let turn = self.engine.admit().await?;
        if command.is_empty() {
            drop(turn);
            let index = log.settle_empty(sync).await?;
            accepted();
            return Ok(index);
        }
        self.wait_for_log_room().await?;
        let index = log.propose(command).await?;
        let applies_here = log.applies_at_append();
        if applies_here {
            self.apply(index, command);
        }
        drop(turn);
        let mut accepted = Some(accepted);
        if sync == Sync::Buffered {
            if let Some(f) = accepted.take() {
                f();
            }
        }
        if sync == Sync::Durable || !applies_here {
            log.wait_durable(index).await?;
        }
        if let Some(f) = accepted {
            f();
        }
        Ok(index)
    }

    /// Applies command `index` to the engine (after its admission); a freeze, for a full
    /// memtable or for the log-size cap, starts a new log segment.
    pub fn apply(&self, index: u64, command: &Command) {
        let froze = self.engine.apply(index, command);
        let over_cap = self.engine.nothing_frozen() && self.wal.live_bytes() >= self.wal_bytes_max;
        if froze || (over_cap && self.engine.freeze()) {
            self.wal.roll();
        }
    }

    /// Whether the log is at its cap with a flush on its way that will release room, so a
    /// writer should wait for [`CommitPath::reclaimed`]. Freezes the memtable (and rolls the
    /// log) when nothing is frozen yet; with nothing to freeze, there is nothing to wait for.
    pub fn must_wait_for_room(&self) -> bool {
        if self.wal.live_bytes() < self.wal_bytes_max {
            return false;
        }
        if self.engine.nothing_frozen() {
            if !self.engine.freeze() {
                return false;
            }
            self.wal.roll();
        }
        true
    }

    /// Waits while [`CommitPath::must_wait_for_room`] says so.
    async fn wait_for_log_room(&self) -> Result<(), StoreError> {
        while self.must_wait_for_room() {
            let released = self.reclaimed.wait();
            self.engine.check_writable()?;
            self.wal.check()?;
            released.await;
        }
        Ok(())
    }

    /// The file a write could not extend for lack of space (log first, then tables), while
    /// writes are refused for it.
    pub fn disk_full(&self) -> Option<String> {
        self.wal.disk_full().or_else(|| self.engine.disk_full())
    }
}

/// A log in front of the LSM engine: the standalone store or the replicated one. Every such
/// store is a [`Store`] the same way: commits through its [`CommitPath`] and its log, reads
/// from the engine.
pub trait Logged {
    type Log: Log;

    fn path(&self) -> &CommitPath;

    fn log(&self) -> &Self::Log;
}

impl<T: Logged> Store for T {
    async fn commit(&self, command: &Command, sync: Sync) -> Result<u64, StoreError> {
        self.path().commit(self.log(), command, sync, || {}).await
    }

    async fn commit_accepting(
        &self,
        command: &Command,
        sync: Sync,
        accepted: impl FnOnce(),
    ) -> Result<u64, StoreError> {
        self.path()
            .commit(self.log(), command, sync, accepted)
            .await
    }

    fn event_id_high_water(&self) -> u64 {
        self.path().engine.event_id_high_water()
    }

    async fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        self.path().engine.scan(start, end, limit).await
    }

    async fn first_key(&self, start: &[u8], end: Option<&[u8]>) -> Result<Option<Key>, StoreError> {
        self.path().engine.first_key(start, end).await
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.path().engine.get(key).await
    }
}
