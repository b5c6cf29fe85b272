//! Membership changes on the server side: the members a node starts with (its address book, or
//! for a node started with `cluster.join`, those a running member names), the tasks that keep
//! the node's view, its shards' transports and its address book in step with the membership
//! each shard applies, and the `changeMembership` admin call (each step runs on the shard it changes).
//!
//! The Raft side (proposing and applying changes, the membership in the log) is
//! `crate::cluster::driver`'s; the rules of each step are `crate::cluster::membership`'s.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use super::mesh::{Refused, Reply, Request};
use super::shard::Shard;
use crate::cluster::address_book::{self, Address, AddressBook};
use crate::cluster::driver::ReplicatedStore;
use crate::cluster::membership::{Action, MemberAddr, MembershipError};
use crate::cluster::transport::Transport;
use crate::cluster::view::{ClusterView, NodeView};
use crate::config::ClusterConfig;
use crate::rpc::cluster::write_ids;
use crate::rpc::pinq_capnp::{broker, MembershipAction};

/// How long a joining node tries to reach the member `cluster.join` names at start-up.
const JOIN_QUERY_MAX: Duration = Duration::from_secs(10);
/// How often each shard brings its transport, and shard 0 the view and the address book, in
/// line with the view.
const SYNC_EVERY: Duration = Duration::from_millis(200);
/// The file a node removed from its cluster leaves in its data directory.
pub const REMOVED_FILE: &str = "removed-from-cluster";

/// A step of `changeMembership` as the owning shard runs it.
#[derive(Clone, Debug)]
pub enum Step {
    Change(Action, MemberAddr),
    TransferLeadership,
}

/// The shard's membership after a step: (voters, learners).
pub type Members = (Vec<u64>, Vec<u64>);

/// The members this node starts with, by id: its address book when it has one (a restart),
/// else the members the node at `cluster.join` names (a first start of a joining node), else
/// `cluster.peers`. Refuses a node that was removed from its cluster. Blocking: start-up only.
pub fn initial_members(cluster: &ClusterConfig, data_dir: &Path) -> anyhow::Result<Vec<NodeView>> {
    let removed = data_dir.join(REMOVED_FILE);
    if let Ok(why) = std::fs::read_to_string(&removed) {
        anyhow::bail!(
            "this node was removed from its cluster ({}): {}. To add it again, start it with an empty data directory and --join, then run `pinq cluster add-node`",
            removed.display(),
            why.trim()
        );
    }
    let mut book = match address_book::load(data_dir).map_err(anyhow::Error::msg)? {
        Some(book) => book,
        None => match &cluster.join {
            Some(join) => ask_members(cluster, join)?,
            None => AddressBook::new(),
        },
    };
    for (id, raft) in &cluster.peers {
        book.entry(*id).or_insert(Address {
            raft: *raft,
            client: None,
        });
    }
    let own = book.entry(cluster.node_id).or_insert(Address {
        raft: cluster.raft_listen,
        client: None,
    });
    own.client = Some(cluster.advertise.to_string());
    Ok(book
        .into_iter()
        .map(|(id, a)| NodeView {
            id,
            raft: a.raft.to_string(),
            client: a.client,
            reachable: id == cluster.node_id,
        })
        .collect())
}

/// A standalone start on a cluster member's data directory (one that holds the member's
/// address book) is refused: its shards' logs are Raft logs, not command logs.
pub fn refuse_standalone_on_member_dir(config: &crate::config::Config) -> anyhow::Result<()> {
    if config.cluster.is_some() || config.storage.engine == crate::config::StorageEngine::Memory {
        return Ok(());
    }
    let book = address_book::path_in(&config.server.data_dir);
    anyhow::ensure!(
        !book.exists(),
        "{} holds a cluster member's data ({} exists): start it as that member (--node-id with --peers or --join), not standalone",
        config.server.data_dir.display(),
        book.display()
    );
    Ok(())
}

/// Asks the member at `join` for the cluster's members (retrying for [`JOIN_QUERY_MAX`]), and
/// checks this node's id is not another member's.
fn ask_members(cluster: &ClusterConfig, join: &str) -> anyhow::Result<AddressBook> {
    let target = join.to_string();
    let status = crate::cli::client_cmds::block_on("pinq-join", move || {
        Box::pin(async move {
            let deadline = std::time::Instant::now() + JOIN_QUERY_MAX;
            loop {
                let tried = async {
                    let client = crate::client::Client::connect(&target).await?;
                    client.cluster_status().await
                };
                match tried.await {
                    Ok(status) => return Ok(status),
                    Err(e) if std::time::Instant::now() >= deadline => {
                        anyhow::bail!(
                            "cannot ask {target} (cluster.join) for the cluster's members: {e}"
                        )
                    }
                    Err(_) => glommio::timer::sleep(Duration::from_millis(250)).await,
                }
            }
        })
    })?;
    anyhow::ensure!(
        status.node_id != 0,
        "{join} (cluster.join) is a standalone broker, not a cluster member"
    );
    let mut book = AddressBook::new();
    for node in &status.nodes {
        let Ok(raft) = node.raft_address.parse::<SocketAddr>() else {
            continue;
        };
        if node.id == cluster.node_id && raft != cluster.raft_listen {
            anyhow::bail!(
                "node id {} is already a member of the cluster at {join}, with Raft address {raft}: give this node another --node-id",
                node.id
            );
        }
        let client = (!node.client_address.is_empty()).then(|| node.client_address.clone());
        book.insert(node.id, Address { raft, client });
    }
    tracing::info!(join, members = ?book.keys().collect::<Vec<_>>(), "joining a running cluster: serving nothing until `pinq cluster add-node` adds this node");
    Ok(book)
}

/// Keeps the view in step with the membership `store` applies (every shard of a cluster).
pub async fn watch_shard(
    shard: crate::ids::ShardId,
    store: Rc<ReplicatedStore>,
    view: ClusterView,
) {
    loop {
        let news = store.membership();
        view.set_conf(shard.get(), news.conf);
        for m in news.learned {
            view.learn_node(m.id, m.raft.to_string(), Some(m.client));
        }
        store.membership_changed().await;
    }
}

/// Every shard: its transport's peers after the view (so a member added or removed is dialed or
/// dropped by every shard's transport), and which of them it is connected to into the view.
pub async fn sync_transport(
    shard: crate::ids::ShardId,
    view: ClusterView,
    transport: Rc<Transport>,
) {
    let mut peers_set: Option<BTreeMap<u64, SocketAddr>> = None;
    loop {
        let connected = transport
            .peers()
            .iter()
            .filter(|p| p.reachable)
            .map(|p| p.id)
            .collect();
        view.set_connected(shard.get(), connected);
        let peers: BTreeMap<u64, SocketAddr> = book_of(&view.nodes())
            .iter()
            .map(|(id, a)| (*id, a.raft))
            .collect();
        // Only when they changed: the transport's peers and its `Hello` are rebuilt then.
        if peers_set.as_ref() != Some(&peers) {
            transport.set_peers(&peers);
            peers_set = Some(peers);
        }
        glommio::timer::sleep(SYNC_EVERY).await;
    }
}

/// Shard 0: the peers' reachability (every shard's transport connected to it) and client
/// addresses into the view, nodes no shard counts any more out of it, and the address book
/// file after the view.
pub async fn sync_members(
    view: ClusterView,
    transport: Rc<Transport>,
    data_dir: PathBuf,
    node_id: u64,
) {
    let mut saved: Option<AddressBook> = None;
    let mut failing: Option<String> = None;
    loop {
        for peer in transport.peers() {
            let client = peer.client_addr.or_else(|| view.client_address(peer.id));
            view.set_node(NodeView {
                id: peer.id,
                raft: peer.raft_addr.to_string(),
                client,
                reachable: view.connected_on_every_shard(peer.id),
            });
        }
        if let Some(members) = view.members_in_force() {
            for node in view.nodes() {
                if node.id != node_id && !members.contains(&node.id) {
                    tracing::info!(
                        node = node_id,
                        peer = node.id,
                        "no shard counts node {} as a member any more: forgetting it",
                        node.id
                    );
                    view.forget_node(node.id);
                }
            }
        }
        let book = book_of(&view.nodes());
        if saved.as_ref() != Some(&book) {
            match address_book::save(&data_dir, &book).await {
                Ok(()) => {
                    saved = Some(book);
                    failing = None;
                }
                Err(e) => {
                    // Said once per different failure; tried again at every turn.
                    let text = e.to_string();
                    if failing.as_ref() != Some(&text) {
                        tracing::warn!(
                            node = node_id,
                            "cannot save the cluster's address book (retrying): {text}"
                        );
                        failing = Some(text);
                    }
                }
            }
        }
        glommio::timer::sleep(SYNC_EVERY).await;
    }
}

/// The view's nodes as an address book (nodes whose Raft address does not parse are left out).
fn book_of(nodes: &[NodeView]) -> AddressBook {
    nodes
        .iter()
        .filter_map(|n| {
            let raft = n.raft.parse().ok()?;
            Some((
                n.id,
                Address {
                    raft,
                    client: n.client.clone(),
                },
            ))
        })
        .collect()
}

/// `Broker.changeMembership`: reads the step, runs it on the shard it names (or, for `retire`,
/// on this node), writes the shard's members or where its leader is.
pub async fn change_membership(
    shard: &Rc<Shard>,
    params: broker::ChangeMembershipParams,
    mut results: broker::ChangeMembershipResults,
    failed: fn(String) -> capnp::Error,
) -> Result<(), capnp::Error> {
    let invalid = |e: String| failed(format!("invalidRequest: changeMembership: {e}"));
    let Some(view) = &shard.cluster else {
        return Err(failed(
            "notClustered: changeMembership: this broker is standalone".to_string(),
        ));
    };
    let p = params.get()?;
    let target = crate::ids::ShardId::from_wire(p.get_shard_id());
    let node = p.get_node_id();
    let action = p.get_action().map_err(|e| invalid(e.to_string()))?;
    let step = match action {
        MembershipAction::Retire => return retire(shard, view, node),
        MembershipAction::TransferLeadership => Step::TransferLeadership,
        MembershipAction::AddLearner | MembershipAction::Promote | MembershipAction::Remove => {
            let member = member_of(node, p.get_raft_address()?, p.get_client_address()?, action)
                .map_err(invalid)?;
            Step::Change(action_of(action), member)
        }
    };
    if target.get() >= shard.count {
        return Err(invalid(format!(
            "shard {target} does not exist ({} shards)",
            shard.count
        )));
    }
    let answer = shard
        .call(target, |reply| Request::ChangeMembership { step, reply })
        .await;
    match answer {
        Ok((voters, learners)) => {
            let mut r = results.get();
            write_ids(r.reborrow().init_voters(voters.len() as u32), &voters);
            write_ids(r.init_learners(learners.len() as u32), &learners);
            Ok(())
        }
        Err(Refused::NotLeader(hint)) => {
            super::connection::write_not_leader(results.get().init_not_leader(), &hint);
            Ok(())
        }
        Err(e) => Err(failed(e.to_string())),
    }
}

fn action_of(action: MembershipAction) -> Action {
    match action {
        MembershipAction::AddLearner => Action::AddLearner,
        MembershipAction::Promote => Action::Promote,
        _ => Action::Remove,
    }
}

/// The node a change is about; `addLearner` needs its addresses, the others only its id.
fn member_of(
    node: u64,
    raft: capnp::text::Reader<'_>,
    client: capnp::text::Reader<'_>,
    action: MembershipAction,
) -> Result<MemberAddr, String> {
    if node == 0 {
        return Err("nodeId 0 is not a node (Raft reserves it)".into());
    }
    let raft = raft.to_str().map_err(|_| "raftAddress is not UTF-8")?;
    let client = client.to_str().map_err(|_| "clientAddress is not UTF-8")?;
    let adding = action == MembershipAction::AddLearner;
    let raft: SocketAddr = match raft.parse() {
        Ok(addr) => addr,
        Err(_) if !adding => SocketAddr::from(([0, 0, 0, 0], 0)),
        Err(_) => return Err(format!("raftAddress {raft:?} is not IP:PORT")),
    };
    if adding && (raft.ip().is_unspecified() || raft.port() == 0) {
        return Err(format!(
            "raftAddress {raft} is not an address peers can dial"
        ));
    }
    if adding && (client.is_empty() || client.contains(' ') || !client.contains(':')) {
        return Err(format!("clientAddress {client:?} is not HOST:PORT"));
    }
    Ok(MemberAddr {
        id: node,
        raft,
        client: client.to_string(),
    })
}

/// `retire`: this node was removed from every shard (as their leaders said); it says so, leaves a mark in its data
/// directory (a restart refuses to start) and stops serving.
fn retire(shard: &Rc<Shard>, view: &ClusterView, node: u64) -> Result<(), capnp::Error> {
    if node != view.node_id() {
        return Err(capnp::Error::failed(format!(
            "invalidRequest: changeMembership: retire names node {node}, this is node {}",
            view.node_id()
        )));
    }
    // Not checked against this node's own view: a removed node may never learn that its
    // removal committed (the leader stops talking to it). `pinq cluster remove-node` sends
    // this only once the leaders of every shard have applied the removal.
    shard.retire(format!(
        "node {node} was removed from the cluster by `pinq cluster remove-node`"
    ));
    Ok(())
}

/// Runs a step on the shard it changes (called by the shard's request handler).
pub async fn run_step(shard: &Rc<Shard>, step: Step, reply: Reply<Members>) {
    let Some(store) = shard.replicated().cloned() else {
        let _ = reply.send(Err(Refused::Failed(
            "notClustered: this shard is not replicated".into(),
        )));
        return;
    };
    let result = match step {
        Step::TransferLeadership => transfer(shard, &store),
        Step::Change(action, member) => store
            .change_membership(action, &member, shard.id.get())
            .await
            .map_err(|e| refusal(shard, e)),
    };
    let sorted = |mut ids: Vec<u64>| {
        ids.sort_unstable();
        ids
    };
    let answer = result.map(|conf| (sorted(conf.voters), sorted(conf.learners)));
    let _ = reply.send(answer);
}

fn transfer(
    shard: &Rc<Shard>,
    store: &ReplicatedStore,
) -> Result<raft::eraftpb::ConfState, Refused> {
    if !store.role().0.leader {
        return Err(Refused::NotLeader(shard.leader_hint()));
    }
    store.transfer_leadership();
    Ok(store.membership().conf)
}

/// The refusal of a step, its text starting with the code the schema names.
fn refusal(shard: &Shard, e: MembershipError) -> Refused {
    match e {
        MembershipError::NotLeader { .. } => Refused::NotLeader(shard.leader_hint()),
        MembershipError::InProgress { .. } => Refused::Failed(format!("membershipInProgress: {e}")),
        MembershipError::LastVoter { .. } => Refused::Failed(format!("lastVoter: {e}")),
        MembershipError::NotALearner { .. } => Refused::Failed(format!("notALearner: {e}")),
        MembershipError::Lost { .. } => Refused::Failed(format!("leadershipLost: {e}")),
        MembershipError::Failed(text) => Refused::Failed(format!("failed: {text}")),
    }
}
