//! The command log of a shard: [`Command`]s, the [`Log`] seam, and the standalone log (the WAL).
//!
//! ```text
//!  pipeline core ──Command──▶ Log::propose ──index──▶ apply(index, &Command) ──▶ engine memtable
//!  (leader side:               (standalone: WAL        (every replica runs the    + high-water mark
//!   stamps time, ids,           group commit)           same apply, in order)    + in-flight table
//!   cuts delete batches)             │
//!                                    └──▶ wait_durable(index) ──▶ reply / on_*_applied
//! ```
//!
//! Every durable change of a shard is a command; nothing else writes durable state. The
//! standalone log is the WAL ([`wal`]) with group commit, logging encoded commands; the storage
//! engine applies them without a log of its own, records the highest applied index in its
//! manifest when it flushes, and recovery ([`recovery`]) replays the log past that index. A
//! replicated log (Raft) takes the WAL's place behind the same seam: its entries carry the same
//! encoded commands, and committed entries go through the same apply.
//!
//! Who calls it: `crate::storage::LsmStore` owns a [`wal::Wal`] and an engine and runs
//! propose → apply → wait; the pipeline only produces commands.

pub mod command;
pub mod copies;
pub mod recovery;
pub mod sequences;
pub mod wal;

pub use command::{Command, CommandError};
pub use wal::Wal;

use std::future::Future;

use crate::storage::StoreError;

/// The seam between the side that produces commands and the log that orders and persists them.
pub trait Log {
    /// Appends `command` once the log has room for it (its buffer of unwritten bytes is
    /// bounded: a full one slows the proposer down) and returns its index. The append happens as
    /// the future completes: the caller applies the command under that index right after, with
    /// no await in between, so apply order is log order.
    fn propose(&self, command: &Command) -> impl Future<Output = Result<u64, StoreError>>;

    /// Resolves once the command at `index` is durable (standalone: covered by an fdatasync;
    /// replicated: committed by a quorum).
    fn wait_durable(&self, index: u64) -> impl Future<Output = Result<(), StoreError>>;

    /// The state machine holds every command through `index` on stable storage of its own: the
    /// log may drop them. Returns the files no longer needed, for the caller to remove.
    fn compact_through(&self, index: u64) -> Vec<std::path::PathBuf>;
}

impl Log for Wal {
    async fn propose(&self, command: &Command) -> Result<u64, StoreError> {
        let units = self.reserve(command).await?;
        self.append_reserved(command, units)
    }

    fn wait_durable(&self, index: u64) -> impl Future<Output = Result<(), StoreError>> {
        Wal::wait_durable(self, index)
    }

    fn compact_through(&self, index: u64) -> Vec<std::path::PathBuf> {
        self.release_through(index)
    }
}
