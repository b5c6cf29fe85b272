//! Cluster messages of the client protocol: `NotLeader` (which node leads a shard) and
//! `ClusterStatus` (every node, every shard's Raft group), between the schema's builders and
//! readers and plain structs the server and the client library share.

use capnp::struct_list;

use super::pinq_capnp::{cluster_status, not_leader};
use super::{Field, WireError};

/// A shard this node does not lead, and who does (see `NotLeader` in the schema).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotLeader {
    pub shard_id: u32,
    pub term: u64,
    /// 0: no leader known yet.
    pub leader_node_id: u64,
    /// Empty when not known.
    pub leader_address: String,
}

pub fn write_not_leader(mut b: not_leader::Builder<'_>, n: &NotLeader) {
    b.set_shard_id(n.shard_id);
    b.set_term(n.term);
    b.set_leader_node_id(n.leader_node_id);
    b.set_leader_address(n.leader_address.as_str());
}

fn text(reader: capnp::Result<capnp::text::Reader<'_>>, field: Field) -> Result<String, WireError> {
    reader?
        .to_str()
        .map(str::to_owned)
        .map_err(|_| WireError::NotUtf8 { field })
}

/// Reads a reply's `notLeader` field: `None` when it is not set.
pub fn read_not_leader(
    has: bool,
    reader: capnp::Result<not_leader::Reader<'_>>,
) -> Result<Option<NotLeader>, WireError> {
    if !has {
        return Ok(None);
    }
    let r = reader?;
    Ok(Some(NotLeader {
        shard_id: r.get_shard_id(),
        term: r.get_term(),
        leader_node_id: r.get_leader_node_id(),
        leader_address: text(
            r.get_leader_address(),
            Field::top("notLeader.leaderAddress"),
        )?,
    }))
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStatus {
    pub id: u64,
    pub raft_address: String,
    pub client_address: String,
    pub reachable: bool,
    /// `voter`, `learner`, or empty (see the schema's `NodeStatus.role`).
    pub role: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FollowerProgress {
    pub node_id: u64,
    pub match_index: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardReplica {
    pub shard_id: u32,
    pub leader_node_id: u64,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub followers: Vec<FollowerProgress>,
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
    /// Not empty while a membership change is in progress (the voters before it).
    pub voters_outgoing: Vec<u64>,
}

/// `Broker.clusterStatus`'s answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterStatus {
    pub node_id: u64,
    pub nodes: Vec<NodeStatus>,
    pub shards: Vec<ShardReplica>,
}

pub fn write_cluster_status(mut b: cluster_status::Builder<'_>, s: &ClusterStatus) {
    b.set_node_id(s.node_id);
    let mut nodes = b.reborrow().init_nodes(s.nodes.len() as u32);
    for (i, n) in (0u32..).zip(&s.nodes) {
        let mut nb = nodes.reborrow().get(i);
        nb.set_id(n.id);
        nb.set_raft_address(n.raft_address.as_str());
        nb.set_client_address(n.client_address.as_str());
        nb.set_reachable(n.reachable);
        nb.set_role(n.role.as_str());
    }
    let mut shards = b.init_shards(s.shards.len() as u32);
    for (i, sh) in (0u32..).zip(&s.shards) {
        let mut sb = shards.reborrow().get(i);
        sb.set_shard_id(sh.shard_id);
        sb.set_leader_node_id(sh.leader_node_id);
        sb.set_term(sh.term);
        sb.set_commit_index(sh.commit_index);
        sb.set_applied_index(sh.applied_index);
        let mut fl = sb.reborrow().init_followers(sh.followers.len() as u32);
        for (j, f) in (0u32..).zip(&sh.followers) {
            let mut fb = fl.reborrow().get(j);
            fb.set_node_id(f.node_id);
            fb.set_match_index(f.match_index);
        }
        write_ids(
            sb.reborrow().init_voters(sh.voters.len() as u32),
            &sh.voters,
        );
        write_ids(
            sb.reborrow().init_learners(sh.learners.len() as u32),
            &sh.learners,
        );
        let outgoing = &sh.voters_outgoing;
        write_ids(sb.init_voters_outgoing(outgoing.len() as u32), outgoing);
    }
}

/// Fills a list of node ids.
pub fn write_ids(mut list: capnp::primitive_list::Builder<'_, u64>, ids: &[u64]) {
    for (i, id) in (0u32..).zip(ids) {
        list.set(i, *id);
    }
}

/// Reads a list of node ids.
pub fn read_ids(
    list: capnp::Result<capnp::primitive_list::Reader<'_, u64>>,
) -> capnp::Result<Vec<u64>> {
    Ok(list?.iter().collect())
}

pub fn read_cluster_status(r: cluster_status::Reader<'_>) -> Result<ClusterStatus, WireError> {
    let nodes: struct_list::Reader<'_, _> = r.get_nodes()?;
    let nodes = nodes
        .iter()
        .map(|n| {
            Ok(NodeStatus {
                id: n.get_id(),
                raft_address: text(n.get_raft_address(), Field::top("nodes.raftAddress"))?,
                client_address: text(n.get_client_address(), Field::top("nodes.clientAddress"))?,
                reachable: n.get_reachable(),
                role: text(n.get_role(), Field::top("nodes.role"))?,
            })
        })
        .collect::<Result<Vec<_>, WireError>>()?;
    let shards = r.get_shards()?;
    let shards = shards
        .iter()
        .map(|s| {
            let followers = s
                .get_followers()?
                .iter()
                .map(|f| FollowerProgress {
                    node_id: f.get_node_id(),
                    match_index: f.get_match_index(),
                })
                .collect();
            Ok(ShardReplica {
                shard_id: s.get_shard_id(),
                leader_node_id: s.get_leader_node_id(),
                term: s.get_term(),
                commit_index: s.get_commit_index(),
                applied_index: s.get_applied_index(),
                followers,
                voters: read_ids(s.get_voters())?,
                learners: read_ids(s.get_learners())?,
                voters_outgoing: read_ids(s.get_voters_outgoing())?,
            })
        })
        .collect::<Result<Vec<_>, WireError>>()?;
    Ok(ClusterStatus {
        node_id: r.get_node_id(),
        nodes,
        shards,
    })
}
