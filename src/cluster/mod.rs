//! Clustered mode: every shard a Raft group across the nodes of `cluster.peers` (shard k of
//! node A ↔ shard k of node B; PRODUCT.md §6), with tikv's `raft` crate as the consensus core.
//!
//! - [`record`]: what a shard's WAL holds in a cluster (entries, hard state, checkpoints); pure.
//! - [`raft_log`]: the raft core's `Storage`, the in-memory mirror of that WAL; pure.
//! - [`membership`]: membership changes at run time (add a learner, promote, remove) as a pure
//!   core: the change each step needs, its refusals, the addresses it carries.
//! - [`leadership`]: whether a replica may act as the one leader — take proposals, hand out
//!   copies (first entry of the term, the lease, step-down); pure, fed by the replica.
//! - [`replica`]: the driver's pure core (Ready → work for the shell), shared with the
//!   deterministic simulation (`tests/cluster_sim.rs`).
//! - [`address_book`]: where each member is (Raft and client address), kept in the data
//!   directory so a restart knows the members added at run time.
//! - [`convert`]: `pinq cluster convert`, the offline step that makes a standalone data
//!   directory a cluster's first member (a checkpoint at the tables' index as the Raft log).
//! - [`driver`]: `ReplicatedStore`, the glommio shell that drives a replica on its shard's core
//!   (the WAL, the engine's apply, proposals resolved at apply, log compaction).
//! - [`view`]: what every shard of a node knows of the cluster (leaders, terms, addresses).
//! - [`wire`]: the node-to-node codec (`schema/replication.capnp` ↔ raft-rs's messages), the
//!   handshake and its checks; pure.
//! - [`transport`]: one per shard, on the shard's own executor: its TCP connections to each
//!   peer, carrying that shard's Raft messages; the only part that does network I/O. Shard 0's
//!   also accepts the node's one Raft port and hands each connection to its shard's core
//!   (over the mesh, `crate::server::shard`).

pub mod address_book;
pub mod convert;
pub mod driver;
pub mod leadership;
pub mod membership;
pub mod raft_log;
pub mod record;
pub mod replica;
pub mod snapshot;
pub mod transport;
pub mod view;
pub mod wire;
