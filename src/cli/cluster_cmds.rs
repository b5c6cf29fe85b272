//! `pinq cluster status --server ADDR [--json]`: every node and every shard's Raft group; and
//! `pinq cluster convert --data-dir DIR`: a stopped standalone broker's data directory made the
//! first member's (`crate::cluster::convert`; README "Standalone to cluster").
//!
//! The node at ADDR names the members and the leader of each shard; each shard's figures
//! (term, commit and applied index, each follower's match index) are then read from that
//! shard's leader, which is the only node that knows its followers' progress. With `--json`
//! one object is printed (scripts depend on this form):
//! `{"nodes":[{"id":1,"raft":"…","client":"…","reachable":true,"role":"voter"}],"shards":[{"shard":0,"leader":1,"term":3,"commit":120,"applied":120,"followers":[{"id":2,"match":120,"lag":0}],"voters":[1,2,3],"learners":[],"voters_outgoing":[]}]}`.
//!
//! `pinq cluster add-node` and `remove-node` are in `super::membership_cmds`.

use anyhow::Context;
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::client::{Client, ClientOptions};
use crate::rpc::cluster::{ClusterStatus, ShardReplica};

/// How long the leader of a shard may take to answer before its figures are left out (the
/// answering node's own view is printed instead).
const LEADER_ANSWER_MAX: std::time::Duration = std::time::Duration::from_secs(2);

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Print every node (id, Raft and client address, reachable) and every shard (leader,
    /// term, commit and applied index, each follower's match index and lag).
    Status(StatusArgs),
    /// Add a node to every shard: as a learner, then, once it has caught up, as a voter. Start
    /// the node first with `pinq serve --node-id N --raft-listen ADDR --join ADDR`.
    AddNode(super::membership_cmds::AddNodeArgs),
    /// Remove a node from every shard (its leaderships handed over first); the node then stops.
    RemoveNode(super::membership_cmds::RemoveNodeArgs),
    /// Convert a stopped standalone broker's data directory into a cluster member's, in place
    /// (offline; re-run it after an interruption). Copy the result to every member's data
    /// directory before starting any of them (README "Standalone to cluster").
    Convert(ConvertArgs),
}

#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The standalone broker's data directory (server.dataDir); the broker must be stopped.
    #[arg(long)]
    pub data_dir: std::path::PathBuf,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Any node of the cluster, e.g. 127.0.0.1:7400.
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    #[command(flatten)]
    pub connect: super::connect_args::ConnectArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct NodeJson {
    id: u64,
    raft: String,
    client: String,
    reachable: bool,
    /// `voter`, `learner`, or empty (not a member as the answering node sees it).
    role: String,
}

#[derive(Serialize)]
struct FollowerJson {
    id: u64,
    #[serde(rename = "match")]
    matched: u64,
    lag: u64,
}

#[derive(Serialize)]
struct ShardJson {
    shard: u32,
    leader: u64,
    term: u64,
    commit: u64,
    applied: u64,
    followers: Vec<FollowerJson>,
    voters: Vec<u64>,
    learners: Vec<u64>,
    /// Not empty while a membership change is in progress (the voters before it).
    voters_outgoing: Vec<u64>,
}

#[derive(Serialize)]
struct StatusJson {
    nodes: Vec<NodeJson>,
    shards: Vec<ShardJson>,
}

pub fn run(command: ClusterCommand) -> anyhow::Result<()> {
    match command {
        ClusterCommand::Status(args) => status(args),
        ClusterCommand::Convert(args) => convert(args),
        ClusterCommand::AddNode(args) => super::membership_cmds::add_node(args),
        ClusterCommand::RemoveNode(args) => super::membership_cmds::remove_node(args),
    }
}

/// `pinq cluster convert`: one line per shard on stdout, then what to do next.
fn convert(args: ConvertArgs) -> anyhow::Result<()> {
    use crate::cluster::convert::{self, Outcome, Step, FAULT_STOP_AFTER_ENV};
    let stop_after = match std::env::var(FAULT_STOP_AFTER_ENV) {
        Ok(name) => Some(Step::parse(&name).ok_or_else(|| {
            crate::cli::UsageError(format!("{FAULT_STOP_AFTER_ENV}: no step named {name:?}"))
        })?),
        Err(_) => None,
    };
    let dir = args.data_dir.clone();
    let outcomes = super::client_cmds::block_on("pinq-convert", move || {
        Box::pin(async move {
            let options = crate::storage::lsm_options(&crate::config::StorageConfig::default());
            Ok(convert::convert_data_dir(&dir, &options, stop_after).await?)
        })
    })?;
    for (dir, outcome) in &outcomes {
        let what = match outcome {
            Outcome::Converted { index } => format!(
                "converted: its raft log starts after index {index} (term {})",
                convert::CHECKPOINT_TERM
            ),
            Outcome::AlreadyClustered => "already converted".to_string(),
            Outcome::Empty => "empty, nothing to convert".to_string(),
        };
        println!("{}: {what}", dir.display());
    }
    println!(
        "{} is now a cluster member's data directory ({} shard(s)): copy it whole to every \
         member's data directory, then start every member with --node-id, --raft-listen, \
         --peers and --cpus naming {} CPU(s)",
        args.data_dir.display(),
        outcomes.len(),
        outcomes.len()
    );
    Ok(())
}

fn status(args: StatusArgs) -> anyhow::Result<()> {
    let report = super::client_cmds::block_on("pinq-cluster", move || {
        Box::pin(async move {
            gather(&args.server, &args.connect)
                .await
                .map(|r| (r, args.json))
        })
    })?;
    let (report, json) = report;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Asks `server`, then each shard's leader, as the module docs say.
async fn gather(
    server: &str,
    connect: &super::connect_args::ConnectArgs,
) -> anyhow::Result<StatusJson> {
    let options = ClientOptions {
        connect_timeout: std::time::Duration::from_secs(2),
        ..connect.client_options()?
    };
    let client = Client::connect_with(server, &options)
        .await
        .with_context(|| format!("connecting to {server}"))?;
    let status = client.cluster_status().await.context("clusterStatus")?;
    anyhow::ensure!(
        status.node_id != 0,
        "{server} is a standalone broker (no [cluster] configured)"
    );
    let mut shards = Vec::with_capacity(status.shards.len());
    for shard in &status.shards {
        let from_leader = leader_view(&status, shard, &options).await;
        shards.push(shard_json(from_leader.as_ref().unwrap_or(shard)));
    }
    let nodes = status
        .nodes
        .iter()
        .map(|n| NodeJson {
            id: n.id,
            raft: n.raft_address.clone(),
            client: n.client_address.clone(),
            reachable: n.reachable,
            role: n.role.clone(),
        })
        .collect();
    Ok(StatusJson { nodes, shards })
}

/// The shard as its leader sees it (with the followers' progress), if the leader answers.
async fn leader_view(
    status: &ClusterStatus,
    shard: &ShardReplica,
    options: &ClientOptions,
) -> Option<ShardReplica> {
    if shard.leader_node_id == 0 || shard.leader_node_id == status.node_id {
        return None;
    }
    let node = status.nodes.iter().find(|n| n.id == shard.leader_node_id)?;
    // A paused leader's kernel still accepts the connection: bound the whole exchange.
    let ask = async {
        let client = Client::connect_with(node.client_address.as_str(), options)
            .await
            .ok()?;
        client.cluster_status().await.ok()
    };
    let theirs = futures_lite::future::or(ask, async {
        glommio::timer::sleep(LEADER_ANSWER_MAX).await;
        None
    })
    .await?;
    theirs
        .shards
        .into_iter()
        .find(|s| s.shard_id == shard.shard_id)
}

fn shard_json(s: &ShardReplica) -> ShardJson {
    ShardJson {
        shard: s.shard_id,
        leader: s.leader_node_id,
        term: s.term,
        commit: s.commit_index,
        applied: s.applied_index,
        followers: s
            .followers
            .iter()
            .map(|f| FollowerJson {
                id: f.node_id,
                matched: f.match_index,
                lag: s.commit_index.saturating_sub(f.match_index),
            })
            .collect(),
        voters: s.voters.clone(),
        learners: s.learners.clone(),
        voters_outgoing: s.voters_outgoing.clone(),
    }
}

fn print_table(report: &StatusJson) {
    println!(
        "{:>4}  {:<22} {:<22} {:<9} {:<7}",
        "node", "raft", "client", "reachable", "role"
    );
    for n in &report.nodes {
        println!(
            "{:>4}  {:<22} {:<22} {:<9} {:<7}",
            n.id, n.raft, n.client, n.reachable, n.role
        );
    }
    println!();
    println!(
        "{:>5} {:>6} {:>6} {:>10} {:>10}  followers (id:match/lag)",
        "shard", "leader", "term", "commit", "applied"
    );
    for s in &report.shards {
        let followers: Vec<String> = s
            .followers
            .iter()
            .map(|f| format!("{}:{}/{}", f.id, f.matched, f.lag))
            .collect();
        println!(
            "{:>5} {:>6} {:>6} {:>10} {:>10}  {}",
            s.shard,
            s.leader,
            s.term,
            s.commit,
            s.applied,
            followers.join(" ")
        );
    }
    println!();
    println!("shard  membership");
    for s in &report.shards {
        let change = if s.voters_outgoing.is_empty() {
            String::new()
        } else {
            format!(
                "  (change in progress: voters before {:?})",
                s.voters_outgoing
            )
        };
        println!(
            "{:>5}  voters {:?} learners {:?}{change}",
            s.shard, s.voters, s.learners
        );
    }
}
