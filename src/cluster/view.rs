//! [`ClusterView`]: what every shard of a node knows about the cluster — each shard's leader and
//! term, and each node's client address — for `topology()`, notLeader hints, `/healthz` and
//! `pinq cluster status`.
//!
//! Shards write their own entry when their role changes (and their figures once a second), and
//! which peers their own transport is connected to; shard 0 writes the peers' addresses and
//! reachability (a peer is reachable when every shard's transport is connected to it). Readers take
//! a copy. The one lock is held for a copy or one small write, never across an await.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::replica::ReplicaStatus;

/// One peer node as the transport sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    pub id: u64,
    pub raft: String,
    /// Its client address, from its handshake (this node's own: `cluster.advertise`).
    pub client: Option<String>,
    pub reachable: bool,
}

/// One shard's replica on this node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardView {
    pub status: ReplicaStatus,
    /// The membership in force in this shard's group, as applied here.
    pub conf: raft::eraftpb::ConfState,
    /// The peer nodes this shard's own transport is connected to.
    pub connected: std::collections::BTreeSet<u64>,
}

#[derive(Debug, Default)]
struct Inner {
    nodes: BTreeMap<u64, NodeView>,
    shards: Vec<ShardView>,
}

/// Shared by every shard of a node. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct ClusterView {
    node_id: u64,
    inner: Arc<Mutex<Inner>>,
}

impl ClusterView {
    pub fn new(node_id: u64, nodes: Vec<NodeView>, shard_count: usize) -> ClusterView {
        let inner = Inner {
            nodes: nodes.into_iter().map(|n| (n.id, n)).collect(),
            shards: vec![ShardView::default(); shard_count],
        };
        ClusterView {
            node_id,
            inner: Arc::new(Mutex::new(inner)),
        }
    }

    pub fn node_id(&self) -> u64 {
        self.node_id
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> Option<T> {
        self.inner.lock().ok().map(|mut inner| f(&mut inner))
    }

    pub fn set_shard(&self, shard: usize, status: ReplicaStatus) {
        self.with(|inner| {
            if let Some(view) = inner.shards.get_mut(shard) {
                view.status = status;
            }
        });
    }

    /// Updates what the transport knows of a peer (its client address, reachability).
    pub fn set_node(&self, node: NodeView) {
        self.with(|inner| {
            inner.nodes.insert(node.id, node);
        });
    }

    pub fn client_address(&self, node: u64) -> Option<String> {
        self.with(|inner| inner.nodes.get(&node).and_then(|n| n.client.clone()))
            .flatten()
    }

    pub fn nodes(&self) -> Vec<NodeView> {
        self.with(|inner| inner.nodes.values().cloned().collect())
            .unwrap_or_default()
    }

    /// One shard's (serving, leader id, term), without copying the whole view (the publish
    /// path asks this per batch).
    pub fn shard_role(&self, shard: usize) -> Option<(bool, u64, u64)> {
        self.with(|inner| {
            inner
                .shards
                .get(shard)
                .map(|s| (s.status.serving, s.status.leader_id, s.status.term))
        })
        .flatten()
    }

    pub fn shards(&self) -> Vec<ShardView> {
        self.with(|inner| inner.shards.clone()).unwrap_or_default()
    }

    /// Whether this node serves as the leader of at least one shard (for `/healthz`).
    /// The membership of `shard`'s group changed (as applied here).
    pub fn set_conf(&self, shard: usize, conf: raft::eraftpb::ConfState) {
        self.with(|inner| {
            if let Some(view) = inner.shards.get_mut(shard) {
                view.conf = conf;
            }
        });
    }

    /// A member's Raft address (and client address, when known), from a change that adds it.
    pub fn learn_node(&self, id: u64, raft: String, client: Option<String>) {
        self.with(|inner| {
            let node = inner.nodes.entry(id).or_insert_with(|| NodeView {
                id,
                ..NodeView::default()
            });
            node.raft = raft;
            if client.is_some() {
                node.client = client;
            }
        });
    }

    /// A node no shard counts as a member any more.
    pub fn forget_node(&self, id: u64) {
        self.with(|inner| inner.nodes.remove(&id));
    }

    /// Every node some shard's group counts as a member (any role); `None` while no shard
    /// has a membership (a node started with `cluster.join`, before it is added).
    pub fn members_in_force(&self) -> Option<std::collections::BTreeSet<u64>> {
        self.with(|inner| {
            let members: std::collections::BTreeSet<u64> = inner
                .shards
                .iter()
                .flat_map(|s| super::membership::members_of(&s.conf).collect::<Vec<_>>())
                .collect();
            (!members.is_empty()).then_some(members)
        })
        .flatten()
    }

    /// `voter` when `node` votes in every shard, `learner` when it is a member of some shard
    /// without voting in all of them (being added, or removed), `None` otherwise.
    pub fn role_of(&self, node: u64) -> Option<&'static str> {
        self.with(|inner| {
            let roles: Vec<Option<&'static str>> = inner
                .shards
                .iter()
                .map(|s| super::membership::role_of(&s.conf, node))
                .collect();
            if roles.iter().all(|r| *r == Some("voter")) {
                Some("voter")
            } else if roles.iter().any(Option::is_some) {
                Some("learner")
            } else {
                None
            }
        })
        .flatten()
    }

    /// The peers shard `shard`'s transport is connected to now.
    pub fn set_connected(&self, shard: usize, connected: std::collections::BTreeSet<u64>) {
        self.with(|inner| {
            if let Some(view) = inner.shards.get_mut(shard) {
                view.connected = connected;
            }
        });
    }

    /// Whether the transport of every shard is connected to `node` (each shard carries its own
    /// group's traffic: one missing link leaves that group without the node).
    pub fn connected_on_every_shard(&self, node: u64) -> bool {
        self.with(|inner| {
            !inner.shards.is_empty() && inner.shards.iter().all(|s| s.connected.contains(&node))
        })
        .unwrap_or(false)
    }

    pub fn leads_any(&self) -> bool {
        self.with(|inner| inner.shards.iter().any(|s| s.status.serving))
            .unwrap_or(false)
    }
}
