//! The ids of shards and of cluster nodes as their own types, so that a shard id and a node id
//! (or a shard id and a count, an index, a term) cannot be passed for one another where they
//! sit side by side in a signature (STYLE.md habit 4).
//!
//! [`ShardId`] is the index of a shard on its node (0 .. shard count), as the server's mesh,
//! sinks and leader hints carry it; [`NodeId`] is a cluster member's `cluster.nodeId` (never 0:
//! 0 means "none known" on the wire and in Raft). Both are plain `Copy` values with no
//! behaviour beyond conversion and display. The server (`crate::server`) and the RPC glue
//! (`crate::rpc`) use them; the wire structs shared with the client library, and the cluster,
//! config and storage layers, keep raw integers, and convert at their boundary with
//! [`ShardId::new`] / [`ShardId::get`] (and [`NodeId::new`] / [`NodeId::get`]).

use std::fmt;

/// A shard of this node: the index of its core's executor, 0 .. the shard count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardId(usize);

impl ShardId {
    /// Shard 0, the one that listens on a node's Raft port (each shard runs its own transport).
    pub const FIRST: ShardId = ShardId(0);

    pub const fn new(index: usize) -> ShardId {
        ShardId(index)
    }

    /// The index, for a `Vec` of per-shard entries.
    pub const fn get(self) -> usize {
        self.0
    }

    /// The form of the schema's `shardId` fields (`UInt32`). Shard counts are CPU counts
    /// (`config::CpuList`), far below `u32::MAX`; a larger index saturates rather than wraps.
    pub fn to_wire(self) -> u32 {
        u32::try_from(self.0).unwrap_or(u32::MAX)
    }

    /// A `shardId` of the schema or of the cluster transport.
    pub fn from_wire(id: u32) -> ShardId {
        ShardId(usize::try_from(id).unwrap_or(usize::MAX))
    }

    /// The shards of a node with `count` shards, in order.
    pub fn all(count: usize) -> impl Iterator<Item = ShardId> {
        (0..count).map(ShardId)
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A cluster member's `cluster.nodeId` (Raft's peer id). Never 0: where a node may be unknown
/// the type is `Option<NodeId>`, and [`NodeId::from_wire`] turns the wire's 0 into `None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u64);

impl NodeId {
    /// `None` for 0, which names no node.
    pub const fn new(id: u64) -> Option<NodeId> {
        if id == 0 {
            None
        } else {
            Some(NodeId(id))
        }
    }

    pub const fn get(self) -> u64 {
        self.0
    }

    /// A node id field of the wire or of Raft, where 0 means "none known".
    pub const fn from_wire(id: u64) -> Option<NodeId> {
        NodeId::new(id)
    }

    /// The wire's form of a node that may be unknown: 0 for `None`.
    pub fn to_wire(id: Option<NodeId>) -> u64 {
        id.map_or(0, NodeId::get)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_zero_is_no_node_and_round_trips_through_the_wire_as_zero() {
        assert_eq!(NodeId::new(0), None);
        assert_eq!(NodeId::from_wire(3).map(NodeId::get), Some(3));
        assert_eq!(NodeId::to_wire(None), 0);
        assert_eq!(NodeId::to_wire(NodeId::new(7)), 7);
    }

    #[test]
    fn shard_ids_display_as_their_index_and_order_by_it() {
        let ids: Vec<ShardId> = ShardId::all(3).collect();
        assert_eq!(ids, vec![ShardId::new(0), ShardId::new(1), ShardId::new(2)]);
        assert_eq!(ids[2].to_string(), "2");
        assert!(ids[0] < ids[1]);
        assert_eq!(ShardId::new(5).to_wire(), 5);
        assert_eq!(ShardId::from_wire(5), ShardId::new(5));
        assert_eq!(ShardId::FIRST.get(), 0);
    }
}
