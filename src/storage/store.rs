//! The storage seam the shard uses: the [`Store`] trait, its sync levels, errors and the
//! memtable's form of a command ([`WriteBatch`]).
//!
//! The delivery pipeline never calls a store: it is a pure core that asks for scans and returns
//! write batches as data. The shard's shell carries those requests to a [`Store`]. Two engines sit
//! behind this trait: `MemStore` (`super::memory`: tests, benchmarks, `--storage memory`) and
//! `LsmStore` (`super::lsm`: the command log in front of the io_uring LSM engine). Methods are `async` because the LSM engine waits on io_uring; the memory
//! store answers at once.
//!
//! Contract every engine keeps:
//! - `commit` applies a [`Command`] atomically, in commit order: after a crash either all of it or
//!   none of it is visible; with [`Sync::Durable`] it resolves only once the command is on stable
//!   storage. It is the only way to change a store.
//! - `scan` returns keys in byte order within `[start, end)`, at most `limit` of them, from one
//!   consistent snapshot; callers page by resuming after the last key returned.
//! - `first_key` is a cheap seek: the first key in `[start, end)` without reading its value.

use std::future::Future;

use crate::key::Key;
use crate::log::Command;
use crate::message::Value;

/// How far a write must get before it resolves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    /// Resolves once the batch is on stable storage (fdatasync).
    Durable,
    /// Resolves once the batch is applied in memory and queued for the log.
    Buffered,
}

/// One change in a write batch: what the engine's memtable applies for a [`Command`].
#[derive(Clone, Debug, PartialEq)]
pub enum WriteOp {
    Put(Key, Value),
    Delete(Key),
}

impl WriteOp {
    pub fn key(&self) -> &Key {
        match self {
            WriteOp::Put(key, _) | WriteOp::Delete(key) => key,
        }
    }
}

/// An atomic group of puts and deletes (the memtable's form of one command).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WriteBatch {
    pub ops: Vec<WriteOp>,
}

impl WriteBatch {
    pub fn new() -> WriteBatch {
        WriteBatch::default()
    }

    pub fn put(&mut self, key: Key, value: Value) {
        self.ops.push(WriteOp::Put(key, value));
    }

    pub fn delete(&mut self, key: Key) {
        self.ops.push(WriteOp::Delete(key));
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// Errors from a storage engine.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("corrupt data in {file}: {what}")]
    Corrupt { file: String, what: String },
    /// Damage in the command log that cannot be a torn write: start-up stops, nothing on disk
    /// was changed.
    #[error("corrupt WAL record in {file} at byte {offset}: {reason}; {evidence}, so this is not a torn tail: refusing to start (no file was changed)")]
    LogCorrupt {
        file: String,
        offset: u64,
        reason: String,
        evidence: String,
    },
    /// A command-log segment shorter than it was written (cut after the fact, not torn by a
    /// crash): acknowledged records may be lost. Start-up stops, nothing on disk was changed;
    /// `pinq serve --recover-truncated-wal` accepts the loss.
    #[error("WAL segment {file} is shorter than it was written: {what}; acknowledged records from byte {offset} on may be lost: refusing to start (no file was changed). To accept the loss, start once with `pinq serve --recover-truncated-wal`")]
    LogTruncated {
        file: String,
        offset: u64,
        what: String,
    },
    #[error("store is closed")]
    Closed,
    /// A write failed for lack of space on the disk holding `path` (ENOSPC). Not fatal: writes
    /// are refused (nothing new is appended) and the failed write is retried with backoff until
    /// space returns; reads go on. A command whose write was in flight when the disk filled may
    /// still be stored by that retry (at-least-once), one refused before its append is not.
    #[error("disk full: a write to {path} failed for lack of space; writes are refused and retried until space returns")]
    DiskFull { path: String },
    /// Clustered: this replica does not lead the shard's Raft group (`leader`: the node that
    /// does, when known). Nothing was written.
    #[error("not the leader of this shard (leader: {})", leader.map_or("none yet".to_string(), |l| format!("node {l}")))]
    NotLeader { leader: Option<u64> },
    /// Clustered: leadership changed while the command waited for its commit. It may or may
    /// not be stored: retry on the new leader (at-least-once).
    #[error("leadership changed before the command committed: it may or may not be stored")]
    LeadershipLost,
    /// Clustered: a command larger than one Raft entry may carry. Nothing was written.
    #[error("a command of {bytes} bytes exceeds what one raft entry may carry ({max} bytes, from cluster.maxFrameBytes): publish smaller batches")]
    TooLarge { bytes: usize, max: usize },
    /// Clustered start-up found a shard directory a standalone broker wrote: its tables reach
    /// log index `applied_index` and it has no Raft log. Nothing was changed.
    #[error("{dir} was written by a standalone broker (its tables hold the log through index {applied_index}, and it has no raft log): stop that broker and run `pinq cluster convert --data-dir <dataDir>` first (README \"Standalone to cluster\")")]
    NotClustered { dir: String, applied_index: u64 },
}

impl StoreError {
    /// Whether the store refuses every later write after this error: an I/O error fails the log
    /// or the engine for good (memory may hold what the disk lost), and damage is not repaired
    /// by retrying. `Closed` only means a shutdown is under way.
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            StoreError::Closed
                | StoreError::DiskFull { .. }
                | StoreError::NotLeader { .. }
                | StoreError::LeadershipLost
                | StoreError::TooLarge { .. }
        )
    }

    /// Whether this is [`StoreError::DiskFull`] (the server refuses with `Code::DiskFull`).
    pub fn is_disk_full(&self) -> bool {
        matches!(self, StoreError::DiskFull { .. })
    }

    /// Whether this I/O error means "no space left on the device" (ENOSPC, or EDQUOT: a quota
    /// heals the same way): the one I/O failure the store retries instead of failing for good.
    pub fn is_no_space(&self) -> bool {
        const ENOSPC: i32 = 28;
        const EDQUOT: i32 = 122;
        match self {
            StoreError::Io { source, .. } => {
                matches!(source.raw_os_error(), Some(ENOSPC | EDQUOT))
                    || matches!(
                        source.kind(),
                        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
                    )
            }
            StoreError::DiskFull { .. } => true,
            _ => false,
        }
    }

    /// The [`StoreError::DiskFull`] form of a no-space I/O error (naming its file).
    pub fn to_disk_full(&self) -> StoreError {
        match self {
            StoreError::Io { path, .. } | StoreError::DiskFull { path } => {
                StoreError::DiskFull { path: path.clone() }
            }
            other => other.clone_kind(),
        }
    }

    /// A copy to hand to several waiters (an I/O error keeps its kind and text).
    pub fn clone_kind(&self) -> StoreError {
        match self {
            StoreError::Io { path, source } => StoreError::Io {
                path: path.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            StoreError::Corrupt { file, what } => StoreError::Corrupt {
                file: file.clone(),
                what: what.clone(),
            },
            StoreError::LogCorrupt {
                file,
                offset,
                reason,
                evidence,
            } => StoreError::LogCorrupt {
                file: file.clone(),
                offset: *offset,
                reason: reason.clone(),
                evidence: evidence.clone(),
            },
            StoreError::LogTruncated { file, offset, what } => StoreError::LogTruncated {
                file: file.clone(),
                offset: *offset,
                what: what.clone(),
            },
            StoreError::Closed => StoreError::Closed,
            StoreError::DiskFull { path } => StoreError::DiskFull { path: path.clone() },
            StoreError::NotLeader { leader } => StoreError::NotLeader { leader: *leader },
            StoreError::LeadershipLost => StoreError::LeadershipLost,
            StoreError::TooLarge { bytes, max } => StoreError::TooLarge {
                bytes: *bytes,
                max: *max,
            },
            StoreError::NotClustered { dir, applied_index } => StoreError::NotClustered {
                dir: dir.clone(),
                applied_index: *applied_index,
            },
        }
    }
}

/// What a store knows of its own health, for `/healthz` and `pinq_shard_healthy`.
///
/// Healthy is the default; an engine sets what applies. A store that failed for good does not
/// report here: it stops the node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreHealth {
    /// Writes are refused because the disk is full (what failed, naming the file); they are
    /// retried with backoff and resume once space returns. Reads go on meanwhile.
    pub disk_full: Option<String>,
    /// Blocks of the sorted tables found unreadable (checksum or decode failure) and skipped
    /// since start-up; their keys are counted in `pinq_unreadable_values_total`.
    pub unreadable_blocks: u64,
    /// Keys in those blocks (from each block's entry count when it is still legible, else 1 a
    /// block): the store's part of `pinq_unreadable_values_total`.
    pub unreadable_values: u64,
    /// Log records this start dropped (a torn last write cut off, or a truncation accepted
    /// with `--recover-truncated-wal`): file, byte offset and count. Serving goes on; health
    /// reports it as degraded until the next restart.
    pub wal_tail_dropped: Option<String>,
}

/// A shard's key-value storage engine. See the module docs for the contract.
pub trait Store {
    /// Commits one command (see the module docs); returns its log index.
    fn commit(
        &self,
        command: &Command,
        sync: Sync,
    ) -> impl Future<Output = Result<u64, StoreError>>;

    /// [`Store::commit`], calling `accepted` once the command has reached what `Sync::Buffered`
    /// promises, which may be before it is applied: a replicated store accepts a command when
    /// its leader has appended it, and applies it once a quorum has. Standalone stores accept
    /// and apply at once, so by default `accepted` runs when `commit` resolves successfully.
    fn commit_accepting(
        &self,
        command: &Command,
        sync: Sync,
        accepted: impl FnOnce(),
    ) -> impl Future<Output = Result<u64, StoreError>> {
        async move {
            let index = self.commit(command, sync).await?;
            accepted();
            Ok(index)
        }
    }

    /// The highest event id any committed command assigned (0 for a new store).
    fn event_id_high_water(&self) -> u64;

    /// `end == None` means unbounded.
    fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<(Key, Value)>, StoreError>>;

    fn first_key(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> impl Future<Output = Result<Option<Key>, StoreError>>;

    /// Reads one key.
    fn get(&self, key: &[u8]) -> impl Future<Output = Result<Option<Value>, StoreError>>;
}
