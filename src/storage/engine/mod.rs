//! [`Engine`]: the state machine a shard's command log is applied to: memtables, tables,
//! flushes and compactions, as one glommio shell. It has no log of its own.
//!
//! Owns the engine's mutable state (active and frozen memtables, the current table version, the
//! manifest) and its two tasks, the flusher and the compactor (a background task queue with
//! fewer shares, so they cannot starve dispatch). Everything runs on the shard's one executor;
//! state lives in `RefCell`s that are never borrowed across an await.
//!
//! Write path (driven by the log's owner, `super::lsm::LsmStore` standalone): [`Engine::admit`]
//! waits while too many frozen memtables wait for their flush (memory stays bounded; stalled
//! writers go in arrival order, so commands reach the log in the order they came), the owner
//! appends the command to its log, and [`Engine::apply`] applies it to the active memtable under
//! the log index it got, in the same synchronous step. A full memtable is frozen, and the flusher
//! writes it to a table and commits the manifest with the highest index it holds
//! (`applied_index`): the log may then drop everything up to that index, and recovery replays the
//! log only past it. Nothing here fsyncs a log record: a command is made durable once, by the
//! log.
//!
//! Read path: a scan takes a snapshot (the active memtable's `Rc`, the frozen memtables, the
//! table version), merges the immutable sources with awaits allowed in between, and merges the
//! active memtable in one synchronous step at the end, so the result is one consistent state even
//! while writes continue.
//!
//! Full disk: a flush that fails for lack of space keeps its frozen memtable and is retried with
//! backoff (`LsmOptions::disk_full_retry_*`); meanwhile [`Engine::disk_full`] names the file,
//! the log's owner refuses new commands, stalled writers get `StoreError::DiskFull`, and a
//! close stops waiting for the flush (the log holds those commands). A compaction that fails for
//! lack of space removes its output and is retried later; it refuses nothing. A table written
//! for a manifest commit that failed is removed unless the manifest may already list it.
//!
//! Must never: read the wall clock outside [`SystemClock`]; hold a `RefCell` borrow across an
//! await; delete a file the committed manifest still needs; record an `applied_index` whose
//! commands are not all in the listed tables.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use glommio::sync::Semaphore;
use glommio::{Latency, Shares, TaskQueueHandle};

use super::manifest::Manifest;
use super::memtable::{Memtable, MemtableCounters};
use super::options::{Clock, LsmOptions, SystemClock};
use super::recovery::{self, RecoveryReport};
use super::signal::Signal;
use super::table::reader::Unreadable;
use super::table::Table;
use super::{io_error, Failure};
use crate::key::Key;
use crate::log::Command;
use crate::message::Value;
use crate::ops::ratelimit::{LogLimit, LOG_INTERVAL_MS};
use crate::storage::{StoreError, WriteBatch};

mod adopt;
mod compact;
mod flush;
mod read;

pub(crate) use read::live_below;

/// A snapshot of the engine's counters. Plain data, cheap to take.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LsmStats {
    pub wal_records: u64,
    pub wal_record_bytes: u64,
    /// Bytes written to WAL segments, padding included.
    pub wal_bytes_written: u64,
    /// Zeros written ahead of the records (segment preallocation).
    pub wal_zero_fill_bytes: u64,
    pub wal_writes: u64,
    pub wal_fsyncs: u64,
    /// Record bytes in segments not yet covered by tables.
    pub wal_live_bytes: u64,
    pub wal_segments: usize,
    pub memtable_bytes: usize,
    pub memtable_entries: usize,
    pub frozen_memtables: usize,
    pub frozen_bytes: usize,
    pub puts: u64,
    /// Deletes that met their put in memory: neither reached a table.
    pub annihilated: u64,
    pub tombstones: u64,
    pub deletes_dropped: u64,
    pub flushes: u64,
    pub flush_bytes_written: u64,
    pub flush_entries: u64,
    pub flush_tombstones_dropped: u64,
    pub flush_expired_dropped: u64,
    pub tables: usize,
    pub table_bytes: u64,
    pub table_entries: u64,
    pub table_tombstones: u64,
    pub compactions: u64,
    pub compaction_bytes_read: u64,
    pub compaction_bytes_written: u64,
    pub compaction_tombstones_dropped: u64,
    pub compaction_expired_dropped: u64,
    pub write_stalls: u64,
    pub recovery: RecoveryReport,
}

/// The live tables, newest first. Immutable: a change installs a new version.
#[derive(Default)]
pub(crate) struct Version {
    pub tables: Vec<Rc<Table>>,
}

#[derive(Debug, Default)]
struct Counters {
    flushed_memtables: MemtableCounters,
    flushes: u64,
    flush_bytes_written: u64,
    flush_entries: u64,
    flush_tombstones_dropped: u64,
    flush_expired_dropped: u64,
    compactions: u64,
    compaction_bytes_read: u64,
    compaction_bytes_written: u64,
    compaction_tombstones_dropped: u64,
    compaction_expired_dropped: u64,
    write_stalls: u64,
    /// Unreadable blocks of tables compaction has since replaced (they count since start-up).
    retired_unreadable: Unreadable,
}

struct State {
    active: Rc<RefCell<Memtable>>,
    /// Newest first; the flusher takes from the back.
    frozen: VecDeque<Rc<RefCell<Memtable>>>,
    version: Rc<Version>,
    manifest: Manifest,
    next_table_id: u64,
    /// Tables replaced by compaction, removed once no reader holds them.
    obsolete: Vec<Rc<Table>>,
    /// The highest event id any applied command assigned.
    event_id_high_water: u64,
    closing: bool,
    shutdown: bool,
    failed: Option<Failure>,
    /// A flush or compaction failed for lack of space (the file it was writing): retried with
    /// backoff, cleared by the next one that succeeds.
    disk_full: Option<String>,
}

struct Inner {
    dir: PathBuf,
    options: LsmOptions,
    clock: Rc<dyn Clock>,
    state: RefCell<State>,
    counters: RefCell<Counters>,
    /// Serialises manifest commits (flush and compaction both commit).
    manifest_lock: Semaphore,
    /// Serialises compactions (background worker and `compact_all`).
    compaction_lock: Semaphore,
    flush_wanted: Signal,
    compact_wanted: Signal,
    /// A flush committed, or the engine failed.
    flushed: Signal,
    /// Tickets of the writers stalled on a full frozen queue, in arrival order. A writer that
    /// finds the queue non-empty waits its turn even if there is room: commands reach the log in
    /// the order they arrived, which the shard relies on (each store command carries the
    /// event-id high-water mark; a later batch overtaking an earlier one while it waits would
    /// leave the lower mark last, and ids would be reused after a restart).
    stalled: RefCell<VecDeque<u64>>,
    next_stall_ticket: Cell<u64>,
    recovery: RefCell<RecoveryReport>,
    /// The flusher's and the compactor's no-space warnings (one line per interval).
    disk_full_log: LogLimit,
}

/// A writer's turn to append to the log and apply, from [`Engine::admit`]. Drop it right after
/// the apply: the next stalled writer goes then. Removes a stalled writer's ticket however its
/// wait ends (its turn came, an error, or the write future was dropped), and wakes the others to
/// re-check whose turn it is.
pub struct Admission<'a> {
    ticket: Option<(&'a Inner, u64)>,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if let Some((inner, ticket)) = self.ticket.take() {
            inner.stalled.borrow_mut().retain(|&t| t != ticket);
            inner.flushed.notify();
        }
    }
}

/// The LSM engine of one shard. Create it on the shard's executor with [`Engine::open_with`],
/// replay the log into it with [`Engine::apply`], then [`Engine::start`] its tasks.
pub struct Engine {
    inner: Rc<Inner>,
    queue: TaskQueueHandle,
    tasks: RefCell<Vec<glommio::task::JoinHandle<()>>>,
}

/// What [`Engine::open_with`] found besides the engine itself.
pub struct Opened {
    pub engine: Engine,
    /// Every command at or below this log index is in the tables: replay the log after it.
    pub applied_index: u64,
    /// Files the manifest does not list; remove them with [`Engine::remove_orphans`] once the
    /// log was read too (a refused start changes no file).
    pub orphans: Vec<PathBuf>,
}

/// Extra wiring for [`Engine::open_with`] (and `LsmStore::open_with`).
#[derive(Default)]
pub struct LsmEnv {
    /// Time source for TTL filtering; the system clock when `None`.
    pub clock: Option<Rc<dyn Clock>>,
    /// Task queue for flush and compaction; a new low-share queue when `None`.
    pub background_queue: Option<TaskQueueHandle>,
}

impl Engine {
    /// Opens (or creates) the engine in `dir` from its manifest and tables. Must run on a
    /// glommio executor. Changes no file (see [`Opened::orphans`]); starts no task.
    pub async fn open_with(
        dir: impl AsRef<Path>,
        options: LsmOptions,
        env: LsmEnv,
    ) -> Result<Opened, StoreError> {
        // glommio opens directories (for their fsync) with a path it cannot resolve relative to
        // the working directory ("Bad file descriptor"), so the engine keeps an absolute one.
        let dir = std::path::absolute(dir.as_ref()).map_err(|e| io_error(dir.as_ref(), e))?;
        options.validate().map_err(|what| {
            io_error(
                &dir,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, what),
            )
        })?;
        let recovered = recovery::recover(&dir, &options).await?;
        let applied_index = recovered.manifest.applied_index;
        let high_water = recovered.manifest.event_id_high_water;
        let next_table_id = recovered.manifest.next_table_id.max(1);
        let queue = env.background_queue.unwrap_or_else(|| {
            glommio::executor().create_task_queue(
                Shares::Static(options.background_shares),
                Latency::NotImportant,
                "pinq-storage-bg",
            )
        });
        let inner = Rc::new(Inner {
            dir,
            clock: env.clock.unwrap_or_else(|| Rc::new(SystemClock::default())),
            state: RefCell::new(State {
                active: Rc::new(RefCell::new(Memtable::new())),
                frozen: VecDeque::new(),
                version: Rc::new(Version {
                    tables: recovered.tables,
                }),
                manifest: recovered.manifest,
                next_table_id,
                obsolete: Vec::new(),
                event_id_high_water: high_water,
                closing: false,
                shutdown: false,
                failed: None,
                disk_full: None,
            }),
            counters: RefCell::new(Counters::default()),
            manifest_lock: Semaphore::new(1),
            compaction_lock: Semaphore::new(1),
            flush_wanted: Signal::default(),
            compact_wanted: Signal::default(),
            flushed: Signal::default(),
            stalled: RefCell::new(VecDeque::new()),
            next_stall_ticket: Cell::new(0),
            recovery: RefCell::new(recovered.report),
            disk_full_log: LogLimit::new(LOG_INTERVAL_MS),
            options,
        });
        Ok(Opened {
            engine: Engine {
                inner,
                queue,
                tasks: RefCell::new(Vec::new()),
            },
            applied_index,
            orphans: recovered.orphans,
        })
    }

    /// Removes the files recovery found unlisted (call once the log was read without error).
    pub fn remove_orphans(&self, orphans: &[PathBuf]) -> Result<(), StoreError> {
        recovery::remove_orphans(&self.inner.dir, orphans)
    }

    /// Adds the log's part to the recovery report (the figures `/metrics` shows).
    pub fn note_log_recovery(&self, log: &crate::log::recovery::LogReport) {
        let mut r = self.inner.recovery.borrow_mut();
        r.segments_read = log.segments_read;
        r.segments_removed = log.segments_removed;
        r.records_replayed = log.records_replayed;
        r.wal_bytes_read = log.wal_bytes_read;
        r.torn_tail = log.torn_tail.clone();
    }

    /// Starts the flusher and the compactor (after the log was replayed).
    pub fn start(&self) -> Result<(), StoreError> {
        let inner = &self.inner;
        let spawn_error = |e: glommio::GlommioError<()>| {
            io_error(
                &inner.dir,
                std::io::Error::other(format!("spawning a storage task: {e}")),
            )
        };
        let flusher = glommio::spawn_local_into(Rc::clone(inner).run_flusher(), self.queue)
            .map_err(spawn_error)?
            .detach();
        let compactor = glommio::spawn_local_into(Rc::clone(inner).run_compactor(), self.queue)
            .map_err(spawn_error)?
            .detach();
        self.tasks.borrow_mut().extend([flusher, compactor]);
        if !inner.state.borrow().frozen.is_empty() {
            inner.flush_wanted.notify();
        }
        Ok(())
    }

    /// Waits for this writer's turn (see [`Admission`]); fails once the engine is closing or
    /// failed.
    pub async fn admit(&self) -> Result<Admission<'_>, StoreError> {
        self.inner.admit().await
    }

    /// Applies command `index` of the log to the active memtable. Returns whether a full
    /// memtable was frozen (the log's owner starts a new log segment then).
    pub fn apply(&self, index: u64, command: &Command) -> bool {
        self.inner.apply(index, command)
    }

    /// Freezes the active memtable if it holds anything; returns whether it did.
    pub fn freeze(&self) -> bool {
        self.inner.freeze()
    }

    /// Whether no memtable waits for its flush (the log-size cap only freezes then).
    pub fn nothing_frozen(&self) -> bool {
        self.inner.state.borrow().frozen.is_empty()
    }

    /// Every command at or below this index is in the tables.
    pub fn flushed_index(&self) -> u64 {
        self.inner.state.borrow().manifest.applied_index
    }

    /// Resolves after the next flush commits (or the engine fails or stops).
    pub fn flushed(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.inner.flushed.wait()
    }

    /// The highest event id any applied command assigned.
    pub fn event_id_high_water(&self) -> u64 {
        self.inner.state.borrow().event_id_high_water
    }

    /// Whether writes are refused (closing, closed or failed).
    pub fn check_writable(&self) -> Result<(), StoreError> {
        self.inner.check_writable()
    }

    /// Freezes the active memtable (if it holds anything) and waits until every frozen memtable
    /// is in a table.
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.inner.check_readable()?;
        self.inner.freeze();
        self.inner.wait_frozen_drained().await
    }

    /// Merges every table into one now (drops all droppable tombstones and expired messages).
    pub async fn compact_all(&self) -> Result<(), StoreError> {
        self.inner.check_readable()?;
        self.inner.compact_once(true).await.map(|_| ())
    }

    /// First step of a graceful close: refuses new writes; with `flush`, writes every memtable
    /// to a table. Fails with `StoreError::Closed` when a close already began.
    pub async fn begin_close(&self, flush: bool) -> Result<(), StoreError> {
        if self.inner.state.borrow().closing {
            return Err(StoreError::Closed);
        }
        self.inner.state.borrow_mut().closing = true;
        if flush && self.inner.failure().is_none() {
            self.inner.freeze();
            return self.inner.wait_frozen_drained().await;
        }
        Ok(())
    }

    /// Last step of a graceful close: stops the background tasks and removes replaced tables.
    pub async fn finish_close(&self) {
        self.inner.state.borrow_mut().shutdown = true;
        self.inner.flush_wanted.notify();
        self.inner.compact_wanted.notify();
        let tasks = std::mem::take(&mut *self.tasks.borrow_mut());
        for task in tasks {
            task.await;
        }
        self.inner.reap_obsolete().await;
    }

    /// The file a flush or compaction could not write for lack of space, while that lasts.
    pub fn disk_full(&self) -> Option<String> {
        self.inner.state.borrow().disk_full.clone()
    }

    /// The engine's health: the file a flush or compaction could not write, and the unreadable
    /// table blocks skipped since start-up (for a store whose log has no disk-full state of its
    /// own to add).
    pub fn health(&self) -> crate::storage::StoreHealth {
        let unreadable = self.unreadable();
        crate::storage::StoreHealth {
            disk_full: self.disk_full(),
            unreadable_blocks: unreadable.blocks,
            unreadable_values: unreadable.values,
            wal_tail_dropped: self
                .inner
                .recovery
                .borrow()
                .torn_tail
                .as_ref()
                .map(|t| t.to_string()),
        }
    }

    /// Unreadable table blocks skipped since start-up, and the keys in them.
    pub fn unreadable(&self) -> Unreadable {
        let st = self.inner.state.borrow();
        let mut total = self.inner.counters.borrow().retired_unreadable;
        for table in st.version.tables.iter().chain(st.obsolete.iter()) {
            total += table.unreadable();
        }
        total
    }

    /// Counters and sizes, for metrics and benches (the log's figures are filled in by its
    /// owner).
    pub fn stats(&self) -> LsmStats {
        self.inner.stats()
    }

    /// Whether a graceful close flushes the memtable (`LsmOptions::flush_on_close`).
    pub fn flush_on_close(&self) -> bool {
        self.inner.options.flush_on_close
    }

    /// The settings this engine was opened with.
    pub fn options(&self) -> &LsmOptions {
        &self.inner.options
    }

    /// The task queue of its flusher and compactor (another engine on this shard may share it).
    pub fn background_queue(&self) -> TaskQueueHandle {
        self.queue
    }

    /// The directory this engine lives in.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// True when no flush is pending (tests and benches).
    pub fn is_quiet(&self) -> bool {
        self.inner.state.borrow().frozen.is_empty()
    }

    /// Scans `[start, end)` (`end == None`: unbounded), at most `limit` keys, from one
    /// consistent snapshot.
    pub async fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        self.inner.scan(start, end, limit).await
    }

    /// The first key in `[start, end)`.
    pub async fn first_key(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> Result<Option<Key>, StoreError> {
        Ok(self
            .inner
            .scan(start, end, 1)
            .await?
            .into_iter()
            .next()
            .map(|(k, _)| k))
    }

    /// Reads one key.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.inner.get(key).await
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Without a close: stop the tasks.
        let mut st = self.inner.state.borrow_mut();
        st.closing = true;
        st.shutdown = true;
        drop(st);
        self.inner.flush_wanted.notify();
        self.inner.compact_wanted.notify();
        self.inner.flushed.notify();
    }
}

impl Inner {
    fn failure(&self) -> Option<StoreError> {
        self.state.borrow().failed.as_ref().map(Failure::error)
    }

    fn check_readable(&self) -> Result<(), StoreError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        if self.state.borrow().shutdown {
            return Err(StoreError::Closed);
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<(), StoreError> {
        self.check_readable()?;
        if self.state.borrow().closing {
            return Err(StoreError::Closed);
        }
        Ok(())
    }

    /// A background write failed for lack of space: with `refuse` (a flush: memory cannot
    /// drain) remember the file, which refuses writes and shows in the health check; warn at
    /// most once per interval; return how long to wait before retry `attempt`. A compaction
    /// does not refuse writes: it only reclaims space, and on a disk full of tables it may need
    /// more than ever returns.
    fn note_disk_full(
        &self,
        what: &str,
        error: &StoreError,
        attempt: u32,
        refuse: bool,
    ) -> std::time::Duration {
        if refuse {
            let path = match error {
                StoreError::Io { path, .. } | StoreError::DiskFull { path } => path.clone(),
                _ => self.dir.display().to_string(),
            };
            self.state.borrow_mut().disk_full = Some(path);
        }
        let delay_ms = super::options::retry_delay_ms(
            self.options.disk_full_retry_first_ms,
            self.options.disk_full_retry_max_ms,
            attempt,
        );
        if let Some(suppressed) = self.disk_full_log.admit(self.clock.now_ms()) {
            tracing::warn!(
                dir = %self.dir.display(),
                suppressed,
                "{what} failed for lack of space, retrying in {delay_ms} ms (reads go on; writes wait): {error}"
            );
        }
        std::time::Duration::from_millis(delay_ms)
    }

    /// A background write succeeded: the disk has room again.
    fn note_space_back(&self) {
        if self.state.borrow_mut().disk_full.take().is_some() {
            tracing::info!(dir = %self.dir.display(), "space is back: table writes resumed");
        }
    }

    fn fail(&self, error: &StoreError) {
        let failure = Failure::of(error, &self.dir);
        tracing::error!(error = %failure, "storage background work failed; the store refuses further writes");
        self.state.borrow_mut().failed = Some(failure);
        self.flushed.notify();
    }

    async fn admit(&self) -> Result<Admission<'_>, StoreError> {
        self.check_writable()?;
        let room =
            |inner: &Inner| inner.state.borrow().frozen.len() < inner.options.frozen_memtables_max;
        if room(self) && self.stalled.borrow().is_empty() {
            return Ok(Admission { ticket: None });
        }
        let ticket = self.next_stall_ticket.get();
        self.next_stall_ticket.set(ticket + 1);
        self.stalled.borrow_mut().push_back(ticket);
        // The admission drops right after the append (not after the fdatasync): the next writer
        // in line goes once this one's record is queued, and they still share commits.
        let admission = Admission {
            ticket: Some((self, ticket)),
        };
        self.counters.borrow_mut().write_stalls += 1;
        loop {
            let wait = self.flushed.wait();
            let first = self.stalled.borrow().front() == Some(&ticket);
            if first && room(self) {
                return Ok(admission);
            }
            wait.await;
            self.check_writable()?;
            if let Some(path) = self.state.borrow().disk_full.clone() {
                // The flush this writer waits for cannot happen until space returns.
                return Err(StoreError::DiskFull { path });
            }
        }
    }

    fn apply(&self, index: u64, command: &Command) -> bool {
        let batch = write_batch(command);
        {
            let mut st = self.state.borrow_mut();
            if let Some(event_id_high_water) = command.event_id_high_water() {
                st.event_id_high_water = st.event_id_high_water.max(event_id_high_water);
            }
            let high_water = st.event_id_high_water;
            let mut active = st.active.borrow_mut();
            active.note_event_id_high_water(high_water);
            active.apply(index, batch, |key| {
                live_below(&st.frozen, &st.version.tables, key)
            });
        }
        let full = self.state.borrow().active.borrow().bytes() >= self.options.memtable_bytes_max;
        full && self.freeze()
    }

    /// Moves the active memtable to the frozen list, if any command has been applied to it (a
    /// new memtable has `last_seq` 0). Returns whether it did.
    fn freeze(&self) -> bool {
        let mut st = self.state.borrow_mut();
        if st.active.borrow().last_seq() == 0 {
            return false;
        }
        let old = std::mem::replace(&mut st.active, Rc::new(RefCell::new(Memtable::new())));
        st.frozen.push_front(old);
        drop(st);
        self.flush_wanted.notify();
        true
    }

    async fn wait_frozen_drained(&self) -> Result<(), StoreError> {
        loop {
            if let Some(e) = self.failure() {
                return Err(e);
            }
            let wait = {
                let st = self.state.borrow();
                if st.frozen.is_empty() {
                    return Ok(());
                }
                if let Some(path) = &st.disk_full {
                    // A close must not wait for space: the log still holds these commands.
                    return Err(StoreError::DiskFull { path: path.clone() });
                }
                if st.shutdown {
                    return Err(StoreError::Closed);
                }
                self.flushed.wait()
            };
            wait.await;
        }
    }

    fn alloc_table_id(&self) -> u64 {
        let mut st = self.state.borrow_mut();
        let id = st.next_table_id;
        st.next_table_id += 1;
        id
    }

    fn stopping(&self) -> bool {
        let st = self.state.borrow();
        st.shutdown || st.failed.is_some()
    }

    fn stats(&self) -> LsmStats {
        let st = self.state.borrow();
        let c = self.counters.borrow();
        let active = st.active.borrow();
        let mut mem = c.flushed_memtables;
        for mt in std::iter::once(&st.active).chain(st.frozen.iter()) {
            let m = mt.borrow().counters();
            mem.puts += m.puts;
            mem.annihilated += m.annihilated;
            mem.tombstones += m.tombstones;
            mem.deletes_dropped += m.deletes_dropped;
        }
        LsmStats {
            memtable_bytes: active.bytes(),
            memtable_entries: active.len(),
            frozen_memtables: st.frozen.len(),
            frozen_bytes: st.frozen.iter().map(|m| m.borrow().bytes()).sum(),
            puts: mem.puts,
            annihilated: mem.annihilated,
            tombstones: mem.tombstones,
            deletes_dropped: mem.deletes_dropped,
            flushes: c.flushes,
            flush_bytes_written: c.flush_bytes_written,
            flush_entries: c.flush_entries,
            flush_tombstones_dropped: c.flush_tombstones_dropped,
            flush_expired_dropped: c.flush_expired_dropped,
            tables: st.version.tables.len(),
            table_bytes: st.version.tables.iter().map(|t| t.file_len()).sum(),
            table_entries: st.version.tables.iter().map(|t| t.props().entries()).sum(),
            table_tombstones: st.version.tables.iter().map(|t| t.props().tombstones).sum(),
            compactions: c.compactions,
            compaction_bytes_read: c.compaction_bytes_read,
            compaction_bytes_written: c.compaction_bytes_written,
            compaction_tombstones_dropped: c.compaction_tombstones_dropped,
            compaction_expired_dropped: c.compaction_expired_dropped,
            write_stalls: c.write_stalls,
            recovery: self.recovery.borrow().clone(),
            ..LsmStats::default()
        }
    }
}

/// The memtable operations a command stands for.
fn write_batch(command: &Command) -> WriteBatch {
    let mut batch = WriteBatch::new();
    batch.ops.reserve(command.len());
    command.for_each_op(|key, value| match value {
        Some(value) => batch.put(key, value),
        None => batch.delete(key),
    });
    batch
}
