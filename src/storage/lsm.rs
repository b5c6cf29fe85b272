//! [`LsmStore`]: a shard's standalone durable state, the command log (the WAL) in front of the
//! LSM [`Engine`], behind [`crate::storage::Store`].
//!
//! A commit is `admit` (the engine's bound on frozen memtables) → `Log::propose` (waits for room
//! in the log's bounded buffer of unwritten bytes, then queues the record for the next group
//! commit) → `Engine::apply` under the index it got (no await in between, so apply order is log
//! order) → for `Sync::Durable`, `Log::wait_durable`. One fdatasync
//! per group commit covers every command in it; nothing is synced twice.
//!
//! Open: the engine loads its manifest and tables, the log is replayed past the manifest's
//! `applied_index` into the engine, and only once both were read without error are orphan files
//! removed and a torn tail cut (see `crate::log::recovery`): a refused start changes no file.
//!
//! Full disk: a write that fails for lack of space is not fatal here. The log keeps the records
//! it could not write and retries them (`Wal::retry_when_full`), the engine keeps a memtable it
//! could not flush and retries it; meanwhile [`LsmStore::commit`] refuses every new command with
//! `StoreError::DiskFull` before it is appended (nothing grows: memory, log and tables stay
//! as they are), reads go on, and [`LsmStore::disk_full`] names the file for the health check.
//! The first write that succeeds clears it. Any other I/O error still fails the store for good.
//!
//! Reclaim: when a flush commits, the log drops the segments the tables now cover (a small task
//! waits on the engine's flush signal). The log-size cap (`wal_bytes_max`, `storage.walMaxBytes`:
//! what the segments take on disk, headers, padding and preallocated zeros included) freezes
//! the memtable even when it is not full, so publish/ACK pairs that annihilate cannot grow the
//! log without bound; and while the log is at the cap with a flush pending, commits wait for
//! that flush to release segments before they append, so the cap is a bound on disk use, not a
//! trigger that load can outrun.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;

use super::engine::{Engine, LsmEnv, LsmStats, Opened};
use super::io as dio;
use super::options::LsmOptions;
use super::signal::Signal;
use crate::key::Key;
use crate::log::{recovery, Command, Log, Wal};
use crate::message::Value;
use crate::storage::{Store, StoreError, Sync};

/// The io_uring LSM store of one shard with its standalone command log. Create it on the
/// shard's executor with [`LsmStore::open`]; use it through [`Store`]; end with
/// [`LsmStore::close`].
pub struct LsmStore {
    engine: Rc<Engine>,
    wal: Rc<Wal>,
    wal_bytes_max: u64,
    /// Notified each time the reclaimer has released what a flush covers (or stopped).
    reclaimed: Rc<Signal>,
    reclaimer: RefCell<Option<glommio::task::JoinHandle<()>>>,
}

impl LsmStore {
    /// Opens (or creates) the store in `dir`, recovering what a previous run left. Must run on a
    /// glommio executor.
    pub async fn open(dir: impl AsRef<Path>, options: LsmOptions) -> Result<LsmStore, StoreError> {
        LsmStore::open_with(dir, options, LsmEnv::default()).await
    }

    /// [`LsmStore::open`] with an injected clock and/or background task queue.
    pub async fn open_with(
        dir: impl AsRef<Path>,
        options: LsmOptions,
        env: LsmEnv,
    ) -> Result<LsmStore, StoreError> {
        let segment_bytes_max = options.wal_segment_bytes_max;
        let preallocate_bytes = options.wal_preallocate_bytes;
        let wal_bytes_max = options.wal_bytes_max;
        let policy = recovery::RecoveryPolicy {
            accept_truncation: options.recover_truncated_wal,
        };
        let retry = (
            options.disk_full_retry_first_ms,
            options.disk_full_retry_max_ms,
        );
        let Opened {
            engine,
            applied_index,
            orphans,
        } = Engine::open_with(dir, options, env).await?;
        let mut log =
            recovery::recover_with(engine.dir(), applied_index, policy, |index, command| {
                engine.apply(index, &command);
            })
            .await?;
        // Everything was read without error: only now may files change.
        engine.remove_orphans(&orphans)?;
        log.finish(engine.dir())?;
        engine.note_log_recovery(&log.report);
        let wal = Rc::new(Wal::new(
            engine.dir(),
            log.next_index,
            log.live_segments,
            segment_bytes_max,
            preallocate_bytes,
        ));
        wal.retry_when_full(retry.0, retry.1);
        wal.start();
        engine.start()?;
        let engine = Rc::new(engine);
        let reclaimed = Rc::new(Signal::default());
        let reclaimer = glommio::spawn_local(reclaim(
            Rc::clone(&engine),
            Rc::clone(&wal),
            Rc::clone(&reclaimed),
        ))
        .detach();
        Ok(LsmStore {
            engine,
            wal,
            wal_bytes_max,
            reclaimed,
            reclaimer: RefCell::new(Some(reclaimer)),
        })
    }

    /// Appends `command` to the log and applies it; with `Sync::Durable`, resolves after the
    /// fdatasync that covers it. Returns the command's log index.
    pub async fn commit(&self, command: &Command, sync: Sync) -> Result<u64, StoreError> {
        if let Some(path) = self.disk_full() {
            // Refused before the log: this command is not stored (see the module docs).
            return Err(StoreError::DiskFull { path });
        }
        let turn = self.engine.admit().await?;
        if command.is_empty() {
            drop(turn);
            let last = self.wal.next_seq().saturating_sub(1);
            if sync == Sync::Durable {
                self.wal.sync_all().await?;
            }
            return Ok(last);
        }
        self.wait_for_log_room().await?;
        let index = self.wal.propose(command).await?;
        let froze = self.engine.apply(index, command);
        let over_cap = self.engine.nothing_frozen() && self.wal.live_bytes() >= self.wal_bytes_max;
        if froze || (over_cap && self.engine.freeze()) {
            // A segment's records then belong to as few memtables as possible and can be
            // released together.
            self.wal.roll();
        }
        drop(turn);
        if sync == Sync::Durable {
            Log::wait_durable(&*self.wal, index).await?;
        }
        Ok(index)
    }

    /// Makes the WAL cap a bound (see the module docs): while the log takes `wal_bytes_max` on
    /// disk, freezes the memtable (and rolls the log) so a flush will release segments, and
    /// waits for that release. With nothing to freeze (an empty memtable) there is nothing to
    /// release either: the append goes ahead rather than wait forever.
    async fn wait_for_log_room(&self) -> Result<(), StoreError> {
        loop {
            if self.wal.live_bytes() < self.wal_bytes_max {
                return Ok(());
            }
            if self.engine.nothing_frozen() {
                if !self.engine.freeze() {
                    return Ok(());
                }
                self.wal.roll();
            }
            let released = self.reclaimed.wait();
            self.engine.check_writable()?;
            self.wal.check()?;
            released.await;
        }
    }

    /// Freezes the active memtable (if it holds anything) and waits until every frozen memtable
    /// is in a table.
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.wal.roll();
        self.engine.flush().await
    }

    /// Merges every table into one now (drops all droppable tombstones and expired messages).
    pub async fn compact_all(&self) -> Result<(), StoreError> {
        self.engine.compact_all().await
    }

    /// Resolves once everything committed so far is on stable storage.
    pub async fn sync(&self) -> Result<(), StoreError> {
        self.engine.check_writable()?;
        self.wal.sync_all().await
    }

    /// Graceful shutdown: refuses new writes, flushes the memtable (if `flush_on_close`), syncs
    /// the log and stops the background tasks. Later calls return `StoreError::Closed`.
    pub async fn close(&self) -> Result<(), StoreError> {
        let flush = self.engine.flush_on_close();
        self.shutdown(flush).await
    }

    /// Shutdown that leaves the memtable in the log, as a crash would (minus a torn tail): the
    /// next open replays it. For recovery tests and tools.
    pub async fn close_unflushed(&self) -> Result<(), StoreError> {
        self.shutdown(false).await
    }

    async fn shutdown(&self, flush: bool) -> Result<(), StoreError> {
        let result = self.engine.begin_close(flush).await;
        if matches!(result, Err(StoreError::Closed)) {
            return result;
        }
        let wal_result = self.wal.shutdown().await;
        let covered = self.wal.compact_through(self.engine.flushed_index());
        self.engine.finish_close().await;
        if let Some(task) = self.reclaimer.borrow_mut().take() {
            task.cancel();
        }
        // Writers waiting for room in the log find the store closed.
        self.reclaimed.notify();
        for path in covered {
            dio::remove(&path).await?;
        }
        result.and(wal_result)
    }

    /// The file a write could not extend for lack of space (log first, then tables), while
    /// writes are refused for it.
    pub fn disk_full(&self) -> Option<String> {
        self.wal.disk_full().or_else(|| self.engine.disk_full())
    }

    /// What the store knows of its health (disk full, unreadable blocks).
    pub fn health(&self) -> crate::storage::StoreHealth {
        crate::storage::StoreHealth {
            disk_full: self.disk_full(),
            ..self.engine.health()
        }
    }

    /// Counters and sizes of the engine and the log, for metrics and benches.
    pub fn stats(&self) -> LsmStats {
        stats_of(&self.engine, &self.wal)
    }

    /// The directory this store lives in.
    pub fn dir(&self) -> &Path {
        self.engine.dir()
    }

    /// True when no flush is pending and the log writer is idle (tests and benches).
    pub fn is_quiet(&self) -> bool {
        self.engine.is_quiet() && self.wal.is_idle()
    }
}

impl Drop for LsmStore {
    fn drop(&mut self) {
        // Without close(): the log writer still writes what is pending, then stops.
        self.wal.request_shutdown();
    }
}

/// The engine's figures with its log's (standalone or replicated, the log is a [`Wal`]).
pub(crate) fn stats_of(engine: &Engine, wal: &Wal) -> LsmStats {
    let counters = wal.counters();
    LsmStats {
        wal_records: counters.records,
        wal_record_bytes: counters.record_bytes,
        wal_bytes_written: counters.bytes_written,
        wal_zero_fill_bytes: counters.zero_fill_bytes,
        wal_writes: counters.writes,
        wal_fsyncs: counters.fsyncs,
        wal_live_bytes: wal.live_bytes(),
        wal_segments: wal.live_segments(),
        ..engine.stats()
    }
}

/// Drops the log segments the tables cover, after every flush, and tells writers waiting for
/// room in the log (also when it stops: they then find the engine closed or failed).
async fn reclaim(engine: Rc<Engine>, wal: Rc<Wal>, reclaimed: Rc<Signal>) {
    loop {
        engine.flushed().await;
        if engine.check_writable().is_err() {
            reclaimed.notify();
            return;
        }
        for path in wal.compact_through(engine.flushed_index()) {
            if let Err(e) = dio::remove(&path).await {
                tracing::warn!(file = %path.display(), error = %e, "could not remove a WAL segment the tables cover; the next start will");
            }
        }
        reclaimed.notify();
    }
}

impl Store for LsmStore {
    async fn commit(&self, command: &Command, sync: Sync) -> Result<u64, StoreError> {
        LsmStore::commit(self, command, sync).await
    }

    async fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        self.engine.scan(start, end, limit).await
    }

    async fn first_key(&self, start: &[u8], end: Option<&[u8]>) -> Result<Option<Key>, StoreError> {
        self.engine.first_key(start, end).await
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.engine.get(key).await
    }

    fn event_id_high_water(&self) -> u64 {
        self.engine.event_id_high_water()
    }
}
