//! Clustered mode: every shard a Raft group across the nodes (shard k of node A ↔ shard k of
//! node B), with tikv's `raft` crate as the consensus core.
//!
//! - [`record`]: what a shard's WAL holds in a cluster (entries, hard state, checkpoints);
//! - [`raft_log`]: the raft core's `Storage`, the in-memory mirror of that WAL;
//! - [`replica`]: the pure driver core (Ready → work for the shell), shared with the simulation;
//! - `crate::storage::replicated`: the glommio shell that drives a replica on its shard's core.

pub mod driver;
pub mod raft_log;
pub mod record;
pub mod replica;
pub mod transport;
pub mod view;
