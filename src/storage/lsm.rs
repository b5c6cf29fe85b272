//! [`LsmStore`]: a shard's standalone durable state, the command log (the WAL) in front of the
//! LSM [`Engine`], behind [`crate::storage::Store`].
//!
//! A commit takes the one commit path (`super::commit_path`, shared with the replicated store):
//! `admit` (the engine's bound on frozen memtables) → room under the log-size cap →
//! `Log::propose` (waits for room in the log's bounded buffer of unwritten bytes, then queues
//! the record for the next group commit) → `Engine::apply` under the index it got (no await in
//! between, so apply order is log order) → for `Sync::Durable`, `Log::wait_durable`. One
//! fdatasync per group commit covers every command in it; nothing is synced twice.
//!
//! Open: the engine loads its manifest and tables, the log is replayed past the manifest's
//! `applied_index` into the engine, and only once both were read without error are orphan files
//! removed and a torn tail cut (see `crate::log::recovery`): a refused start changes no file.
//!
//! Full disk: a write that fails for lack of space is not fatal here. The log keeps the records
//! it could not write and retries them (`Wal::retry_when_full`), the engine keeps a memtable it
//! could not flush and retries it; meanwhile a commit refuses every new command with
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

use super::commit_path::{CommitPath, Logged};
use super::engine::{Engine, LsmEnv, LsmStats, Opened};
use super::io as dio;
use super::options::LsmOptions;
use super::signal::Signal;
use crate::log::{recovery, Wal};
use crate::storage::StoreError;

/// The io_uring LSM store of one shard with its standalone command log. Create it on the
/// shard's executor with [`LsmStore::open`]; use it through [`Store`]; end with
/// [`LsmStore::close`].
pub struct LsmStore {
    path: CommitPath,
    engine: Rc<Engine>,
    wal: Rc<Wal>,
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
        let path = CommitPath::new(Rc::clone(&engine), Rc::clone(&wal), wal_bytes_max);
        let reclaimer = glommio::spawn_local(reclaim(
            Rc::clone(&engine),
            Rc::clone(&wal),
            Rc::clone(path.reclaimed()),
        ))
        .detach();
        Ok(LsmStore {
            path,
            engine,
            wal,
            reclaimer: RefCell::new(Some(reclaimer)),
        })
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
        let covered = self.wal.release_through(self.engine.flushed_index());
        self.engine.finish_close().await;
        if let Some(task) = self.reclaimer.borrow_mut().take() {
            task.cancel();
        }
        // Writers waiting for room in the log find the store closed.
        self.path.reclaimed().notify();
        for path in covered {
            dio::remove(&path).await?;
        }
        result.and(wal_result)
    }

    /// The file a write could not extend for lack of space (log first, then tables), while
    /// writes are refused for it.
    pub fn disk_full(&self) -> Option<String> {
        self.path.disk_full()
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
        for path in wal.release_through(engine.flushed_index()) {
            if let Err(e) = dio::remove(&path).await {
                tracing::warn!(file = %path.display(), error = %e, "could not remove a WAL segment the tables cover; the next start will");
            }
        }
        reclaimed.notify();
    }
}

impl Logged for LsmStore {
    type Log = Wal;

    fn path(&self) -> &CommitPath {
        &self.path
    }

    fn log(&self) -> &Wal {
        &self.wal
    }
}
