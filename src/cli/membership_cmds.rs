//! `pinq cluster add-node` and `pinq cluster remove-node`: membership changes at run time,
//! driven shard by shard through the `changeMembership` admin call on each shard's leader.
//!
//! ```text
//! add-node:    the new node answers as node N ─▶ every shard: add N as a learner
//!              ─▶ every shard: wait until N's match index reaches the commit index it had
//!              ─▶ every shard: promote N to voter
//! remove-node: every shard N leads: hand its leadership over ─▶ every shard: remove N
//!              ─▶ tell N it was removed (it stops serving and says why)
//! ```
//!
//! Each step already done answers at once, so running a command again after an interruption
//! finishes it. A refusal (another change in progress, the last voter, an unreachable new node,
//! a node that does not catch up in time) ends the command with exit status 1 and the reason.
//! With `--json` one object is printed: `{"node":4,"action":"add","shards":[{"shard":0,
//! "voters":[1,2,3,4],"learners":[]}]}` (for `remove`, `"retired":true|false` too).

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use crate::client::{Client, ClientError, ClientOptions, ShardMembers, StepTarget};
use crate::rpc::cluster::ClusterStatus;
use crate::rpc::pinq_capnp::MembershipAction;

/// How long one step may look for its shard's leader (elections included).
const STEP_MAX: Duration = Duration::from_secs(30);
/// Pause between two looks at a shard (its leader, a learner's progress).
const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Args)]
pub struct AddNodeArgs {
    /// Any member of the cluster, e.g. 127.0.0.1:7400.
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    /// The new node's id (its --node-id).
    #[arg(long)]
    pub node_id: u64,
    /// The new node's Raft address, where its peers dial it (its --raft-listen).
    #[arg(long)]
    pub raft: String,
    /// The new node's client address (its --listen or --advertise).
    #[arg(long)]
    pub client: String,
    /// How long the new node may take to catch up in each shard before the command gives up
    /// (the node then stays a learner; run the command again).
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    #[command(flatten)]
    pub connect: super::connect_args::ConnectArgs,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RemoveNodeArgs {
    /// Any member of the cluster, e.g. 127.0.0.1:7400.
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    /// The id of the node to remove.
    #[arg(long)]
    pub node_id: u64,
    #[command(flatten)]
    pub connect: super::connect_args::ConnectArgs,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct ShardOutcome {
    shard: u32,
    voters: Vec<u64>,
    learners: Vec<u64>,
}

#[derive(Serialize)]
struct Outcome {
    node: u64,
    action: &'static str,
    shards: Vec<ShardOutcome>,
    /// remove-node: whether the removed node acknowledged it should stop.
    #[serde(skip_serializing_if = "Option::is_none")]
    retired: Option<bool>,
}

pub fn add_node(args: AddNodeArgs) -> anyhow::Result<()> {
    let json = args.json;
    let outcome = super::client_cmds::block_on("pinq-add-node", move || {
        Box::pin(async move { add(&args).await })
    })?;
    report(&outcome, json)
}

pub fn remove_node(args: RemoveNodeArgs) -> anyhow::Result<()> {
    let json = args.json;
    let outcome = super::client_cmds::block_on("pinq-remove-node", move || {
        Box::pin(async move { remove(&args).await })
    })?;
    report(&outcome, json)
}

fn report(outcome: &Outcome, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(outcome)?);
        return Ok(());
    }
    for s in &outcome.shards {
        println!(
            "shard {}: voters {:?} learners {:?}",
            s.shard, s.voters, s.learners
        );
    }
    match (outcome.action, outcome.retired) {
        ("add", _) => println!("node {} is a voter of every shard", outcome.node),
        (_, Some(true)) => println!(
            "node {} is removed from every shard and has stopped",
            outcome.node
        ),
        _ => println!(
            "node {} is removed from every shard; it could not be told to stop (stop it yourself)",
            outcome.node
        ),
    }
    Ok(())
}

/// The talking part of both commands: the options and the member first asked.
struct Session {
    options: ClientOptions,
    seed: String,
}

impl Session {
    fn new(seed: &str, connect: &super::connect_args::ConnectArgs) -> anyhow::Result<Session> {
        Ok(Session {
            options: ClientOptions {
                connect_timeout: Duration::from_secs(2),
                ..connect.client_options()?
            },
            seed: seed.to_string(),
        })
    }

    async fn status_of(&self, addr: &str) -> anyhow::Result<ClusterStatus> {
        let client = Client::connect_with(addr, &self.options)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        let status = client.cluster_status().await.context("clusterStatus")?;
        anyhow::ensure!(
            status.node_id != 0,
            "{addr} is a standalone broker (no [cluster] configured)"
        );
        Ok(status)
    }

    async fn status(&self) -> anyhow::Result<ClusterStatus> {
        self.status_of(&self.seed).await
    }

    /// The client address of the node that leads `shard`, as the seed knows it.
    async fn leader_of(&self, shard: u32) -> anyhow::Result<Option<(u64, String)>> {
        let status = self.status().await?;
        let Some(leader) = status
            .shards
            .iter()
            .find(|s| s.shard_id == shard)
            .map(|s| s.leader_node_id)
            .filter(|id| *id != 0)
        else {
            return Ok(None);
        };
        let addr = status
            .nodes
            .iter()
            .find(|n| n.id == leader)
            .map(|n| n.client_address.clone())
            .filter(|a| !a.is_empty());
        Ok(addr.map(|a| (leader, a)))
    }

    /// Whether `node` is the only voter of `shard`, as the seed knows it.
    async fn only_voter(&self, shard: u32, node: u64) -> anyhow::Result<bool> {
        let status = self.status().await?;
        Ok(status
            .shards
            .iter()
            .find(|s| s.shard_id == shard)
            .is_some_and(|s| s.voters == [node]))
    }

    /// Runs `action` on `shard`'s leader, following leadership changes for [`STEP_MAX`].
    async fn step(
        &self,
        shard: u32,
        action: MembershipAction,
        target: &StepTarget,
    ) -> anyhow::Result<ShardMembers> {
        let deadline = Instant::now() + STEP_MAX;
        loop {
            let answer = match self.leader_of(shard).await? {
                Some((_, addr)) => self.step_at(&addr, shard, action, target).await,
                None => Err(Retry::Again("no leader yet".into())),
            };
            match answer {
                Ok(members) => return Ok(members),
                Err(Retry::Refused(e)) => return Err(e),
                Err(Retry::Again(why)) if Instant::now() >= deadline => {
                    anyhow::bail!("shard {shard}: gave up after {STEP_MAX:?}: {why}")
                }
                Err(Retry::Again(_)) => glommio::timer::sleep(POLL).await,
            }
        }
    }

    async fn step_at(
        &self,
        addr: &str,
        shard: u32,
        action: MembershipAction,
        target: &StepTarget,
    ) -> Result<ShardMembers, Retry> {
        let client = Client::connect_with(addr, &self.options)
            .await
            .map_err(|e| Retry::Again(format!("{addr}: {e}")))?;
        match client.change_membership(shard, action, target).await {
            Ok(members) => Ok(members),
            Err(ClientError::NotLeader(n)) => Err(Retry::Again(format!(
                "{addr} does not lead shard {shard} (leader: node {})",
                n.leader_node_id
            ))),
            Err(e) if e.to_string().contains("leadershipLost") => Err(Retry::Again(e.to_string())),
            Err(e) => Err(Retry::Refused(anyhow::anyhow!("shard {shard}: {e}"))),
        }
    }
}

/// Whether a step may be tried again.
enum Retry {
    Again(String),
    Refused(anyhow::Error),
}

async fn add(args: &AddNodeArgs) -> anyhow::Result<Outcome> {
    let session = Session::new(&args.server, &args.connect)?;
    check_new_node(&session, args).await?;
    let target = StepTarget {
        node_id: args.node_id,
        raft_address: args.raft.clone(),
        client_address: args.client.clone(),
    };
    let shards = session.status().await?.shards.len() as u32;
    for shard in 0..shards {
        session
            .step(shard, MembershipAction::AddLearner, &target)
            .await?;
    }
    for shard in 0..shards {
        wait_caught_up(&session, shard, args.node_id, args.timeout).await?;
    }
    let mut outcome = Outcome {
        node: args.node_id,
        action: "add",
        shards: Vec::new(),
        retired: None,
    };
    for shard in 0..shards {
        let members = session
            .step(shard, MembershipAction::Promote, &target)
            .await?;
        outcome.shards.push(shard_outcome(shard, members));
    }
    Ok(outcome)
}

/// The new node must answer at its client address as node N, at the Raft address given.
async fn check_new_node(session: &Session, args: &AddNodeArgs) -> anyhow::Result<()> {
    let theirs = session.status_of(&args.client).await.with_context(|| {
        format!(
            "node {} is unreachable at {} (start it first: pinq serve --node-id {} --raft-listen {} --join {})",
            args.node_id, args.client, args.node_id, args.raft, args.server
        )
    })?;
    anyhow::ensure!(
        theirs.node_id == args.node_id,
        "the node at {} is node {}, not node {}",
        args.client,
        theirs.node_id,
        args.node_id
    );
    let own = theirs.nodes.iter().find(|n| n.id == args.node_id);
    if let Some(own) = own {
        anyhow::ensure!(
            own.raft_address == args.raft,
            "node {} listens for its peers at {}, not at {} (--raft)",
            args.node_id,
            own.raft_address,
            args.raft
        );
    }
    Ok(())
}

/// Waits until `node`'s match index in `shard` reaches the commit index the leader had when
/// the wait began.
async fn wait_caught_up(
    session: &Session,
    shard: u32,
    node: u64,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut target = None;
    let mut last = (0, 0);
    while Instant::now() < deadline {
        if let Some((_, addr)) = session.leader_of(shard).await? {
            if let Ok(status) = session.status_of(&addr).await {
                if let Some(s) = status.shards.iter().find(|s| s.shard_id == shard) {
                    let goal = *target.get_or_insert(s.commit_index);
                    let matched = s
                        .followers
                        .iter()
                        .find(|f| f.node_id == node)
                        .map_or(0, |f| f.match_index);
                    last = (matched, goal);
                    if matched >= goal && goal > 0 {
                        return Ok(());
                    }
                }
            }
        }
        glommio::timer::sleep(POLL).await;
    }
    anyhow::bail!(
        "node {node} has not caught up in shard {shard} within {timeout:?} (match index {} of {}): it stays a learner; run the command again",
        last.0,
        last.1
    )
}

async fn remove(args: &RemoveNodeArgs) -> anyhow::Result<Outcome> {
    let session = Session::new(&args.server, &args.connect)?;
    let status = session.status().await?;
    let node = args.node_id;
    let node_addr = status
        .nodes
        .iter()
        .find(|n| n.id == node)
        .map(|n| n.client_address.clone());
    let target = StepTarget {
        node_id: node,
        ..StepTarget::default()
    };
    let mut outcome = Outcome {
        node,
        action: "remove",
        shards: Vec::new(),
        retired: None,
    };
    for shard in 0..status.shards.len() as u32 {
        hand_over_if_leader(&session, shard, node, &target).await?;
        let members = session
            .step(shard, MembershipAction::Remove, &target)
            .await?;
        outcome.shards.push(shard_outcome(shard, members));
    }
    outcome.retired = Some(match node_addr.filter(|a| !a.is_empty()) {
        Some(addr) => retire(&session, &addr, &target).await,
        None => false,
    });
    Ok(outcome)
}

/// While `node` leads `shard`, asks it to hand the leadership over, and waits for another.
async fn hand_over_if_leader(
    session: &Session,
    shard: u32,
    node: u64,
    target: &StepTarget,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + STEP_MAX;
    while let Some((leader, addr)) = session.leader_of(shard).await? {
        if leader != node || session.only_voter(shard, node).await? {
            // Nobody to hand over to: the removal itself refuses the last voter.
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "shard {shard}: node {node} still leads it after {STEP_MAX:?} of asking it to hand over"
        );
        let _ = session
            .step_at(&addr, shard, MembershipAction::TransferLeadership, target)
            .await;
        glommio::timer::sleep(POLL).await;
    }
    Ok(())
}

/// Tells the removed node to stop; whether it answered.
async fn retire(session: &Session, addr: &str, target: &StepTarget) -> bool {
    let Ok(client) = Client::connect_with(addr, &session.options).await else {
        return false;
    };
    client
        .change_membership(0, MembershipAction::Retire, target)
        .await
        .is_ok()
}

fn shard_outcome(shard: u32, members: ShardMembers) -> ShardOutcome {
    ShardOutcome {
        shard,
        voters: members.voters,
        learners: members.learners,
    }
}
