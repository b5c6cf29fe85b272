//! A shard's storage: the [`Store`] seam the pipeline's shell uses ([`store`]), its two engines
//! (the in-memory [`MemStore`] and the io_uring LSM engine behind the command log, [`LsmStore`]),
//! and the closed choice between them that a shard runs ([`ShardStore`], from `storage.engine`).
//!
//! The LSM engine runs on glommio DMA files (O_DIRECT), one per shard.
//!
//! Owns what a shard keeps in tables: the in-memory write buffer ([`memtable`]), immutable
//! sorted tables ([`table`]), the list of live files ([`manifest`]), the compaction policy
//! ([`compaction`]), the engine's recovery ([`recovery`]) and the glommio shell that ties them
//! together ([`engine`]). The engine has no log of its own: [`LsmStore`] ([`lsm`]) puts the
//! shard's command log (`crate::log`, the WAL standalone) in front of it, and [`commit_path`] is the
//! one way a command reaches the engine, for it and for the replicated store
//! (`crate::cluster::driver`) alike. The shard's shell opens
//! one [`LsmStore`] on its own executor and uses it through [`crate::storage::Store`]; nothing else
//! in pinq touches these files.
//!
//! Shaped for a queue's workload (DESIGN-NOTES §4): keys are written once and mostly deleted
//! seconds later, so a delete that meets its put in the active memtable annihilates it and a
//! message published and ACKed within one memtable never reaches a table. A delete only
//! annihilates when no older source can hold the key. The shard's metadata (the event-id
//! high-water mark) lives in the manifest, outside the tables' key range.
//!
//! Layering: the codecs (blocks, table metadata, manifest) and the compaction policy
//! are pure and tested without I/O; [`io`] is the only place that talks to glommio files.
//! Nothing in this module may read the wall clock inside a pure part: time comes from a
//! [`engine::Clock`]. Nothing here may block the shard's thread on I/O after [`LsmStore::open`]
//! returns (recovery may, once, before the shard serves).

pub mod commit_path;
pub mod compaction;
pub mod engine;
pub mod io;
pub mod lsm;
pub mod manifest;
pub mod memory;
pub mod memtable;
pub mod merge;
pub mod options;
pub mod recovery;
pub mod shard;
pub(crate) mod signal;
pub mod store;
pub mod table;

pub use commit_path::{CommitPath, Logged};
pub use compaction::{Choice, CompactionConfig, TableSummary};
pub use engine::{Engine, LsmEnv, LsmStats};
pub use lsm::LsmStore;
pub use memory::MemStore;
pub use options::{Clock, LsmOptions, ManualClock, SystemClock};
pub use recovery::RecoveryReport;
pub use shard::{lsm_options, shard_dir, ShardStore};
pub use store::{Store, StoreError, StoreHealth, Sync, WriteBatch, WriteOp};

/// Name of the marker file every data directory keeps (see [`io::probe_disk`]).
pub const MARKER_FILE: &str = "PINQ_STORAGE";

/// Builds an I/O error naming the file it happened on.
pub(crate) fn io_error(path: &std::path::Path, source: std::io::Error) -> StoreError {
    StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A failure a log or an engine keeps, to answer every later call with (after an I/O error the
/// memory may hold what the disk lost, so nothing is retried). Plain data: `StoreError` holds an
/// `io::Error`, which cannot be cloned.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    path: String,
    kind: std::io::ErrorKind,
    message: String,
}

impl Failure {
    /// Keeps `error`; one that names no file is charged to `dir`.
    pub(crate) fn of(error: &StoreError, dir: &std::path::Path) -> Failure {
        match error {
            StoreError::Io { path, source } => Failure {
                path: path.clone(),
                kind: source.kind(),
                message: source.to_string(),
            },
            other => Failure {
                path: dir.display().to_string(),
                kind: std::io::ErrorKind::Other,
                message: other.to_string(),
            },
        }
    }

    /// The error to answer with.
    pub(crate) fn error(&self) -> StoreError {
        StoreError::Io {
            path: self.path.clone(),
            source: std::io::Error::new(self.kind, self.message.clone()),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Builds a corruption error naming the file it was found in.
pub(crate) fn corrupt(path: &std::path::Path, what: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        file: path.display().to_string(),
        what: what.into(),
    }
}
