//! Clustered mode: every shard a Raft group across the nodes of `cluster.peers` (PRODUCT.md §6).
//!
//! - [`wire`]: the node-to-node codec (`schema/replication.capnp` ↔ raft-rs's messages), the
//!   handshake and its checks; pure.
//! - [`transport`]: one TCP connection per node pair carrying every shard's Raft messages, on one
//!   glommio executor; the only part that does network I/O.
//!
//! The Raft driver, its storage and the shard integration sit beside these and talk to the
//! transport through `Transport::send` and the inbound callback only.

pub mod transport;
pub mod wire;
