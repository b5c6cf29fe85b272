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
//! Who calls it: `crate::storage::CommitPath`, the one commit path of both stores (the standalone
//! `LsmStore` with a [`wal::Wal`], the replicated store with its Raft log), runs propose →
//! apply → wait; the pipeline only produces commands.

pub mod command;
pub mod copies;
pub mod header;
pub mod recovery;
pub mod sequences;
pub mod wal;

pub use command::{Command, CommandError};
pub use wal::Wal;

use std::future::Future;

use crate::storage::{StoreError, Sync};

/// The seam between the side that produces commands and the log that orders and persists them.
/// `crate::storage::CommitPath` is the one commit path in front of it, for the standalone log
/// (the [`Wal`]) and the replicated one (the shard's Raft log, `crate::cluster::driver`).
pub trait Log {
    /// Whether the proposer applies what it proposed, right after [`Log::propose`] returns (the
    /// order of appends is final: the standalone log). A replicated log applies committed entries
    /// itself, in order, on every replica; its [`Log::wait_durable`] resolves once the command
    /// is applied here.
    fn applies_at_append(&self) -> bool;

    /// Appends `command` once the log has room for it (its buffer of unwritten bytes is
    /// bounded: a full one slows the proposer down) and returns its index. The append happens as
    /// the future completes: a proposer that applies ([`Log::applies_at_append`]) does so under
    /// that index right after, with no await in between, so apply order is log order.
    fn propose(&self, command: &Command) -> impl Future<Output = Result<u64, StoreError>>;

    /// Resolves once the command at `index` is durable (standalone: covered by an fdatasync;
    /// replicated: committed by a quorum and applied here). Call it right after `propose`.
    fn wait_durable(&self, index: u64) -> impl Future<Output = Result<(), StoreError>>;

    /// The index a commit without a change answers with, once what it promises holds for
    /// everything before it (standalone: the last record, synced for [`Sync::Durable`];
    /// replicated: the last applied entry).
    fn settle_empty(&self, sync: Sync) -> impl Future<Output = Result<u64, StoreError>>;
}

impl Log for Wal {
    fn applies_at_append(&self) -> bool {
        true
    }

    async fn propose(&self, command: &Command) -> Result<u64, StoreError> {
        let units = self.reserve(command).await?;
        self.append_reserved(command, units)
    }

    fn wait_durable(&self, index: u64) -> impl Future<Output = Result<(), StoreError>> {
        Wal::wait_durable(self, index)
    }

    async fn settle_empty(&self, sync: Sync) -> Result<u64, StoreError> {
        let last = self.next_seq().saturating_sub(1);
        if sync == Sync::Durable {
            self.sync_all().await?;
        }
        Ok(last)
    }
}
