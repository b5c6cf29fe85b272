//! Three replicas of one shard over a perfect in-memory network and disk: an election, commits
//! on every replica, and a failover. (The seeded simulation with faults is `cluster_sim.rs`.)

use std::collections::BTreeMap;

use pinq::cluster::raft_log::RaftLog;
use pinq::cluster::record::RaftRecord;
use pinq::cluster::replica::{carries_command, quiet_logger, RecordSink, Replica, ReplicaConfig};
use raft::eraftpb::Message;

#[derive(Default)]
struct Disk {
    records: Vec<RaftRecord>,
}

impl RecordSink for Disk {
    type Error = ();
    fn append(&mut self, record: &RaftRecord) -> Result<u64, ()> {
        self.records.push(record.clone());
        Ok(self.records.len() as u64)
    }
}

struct Node {
    replica: Replica,
    disk: Disk,
    applied: Vec<(u64, Vec<u8>)>,
}

fn config(id: u64) -> ReplicaConfig {
    ReplicaConfig {
        id,
        voters: vec![1, 2, 3],
        election_ticks: 10,
        heartbeat_ticks: 2,
        max_message_bytes: 1 << 20,
        max_inflight_messages: 64,
        lease_ms: 50,
    }
}

fn node(id: u64) -> Node {
    let replica =
        Replica::new(&config(id), RaftLog::new(vec![1, 2, 3]), 0, &quiet_logger()).unwrap();
    Node {
        replica,
        disk: Disk::default(),
        applied: Vec::new(),
    }
}

/// Runs every replica's work until nothing is left; messages are delivered at once, disks
/// are durable at once. `down` nodes neither send nor receive.
fn settle(nodes: &mut BTreeMap<u64, Node>, down: &[u64]) {
    for _ in 0..1000 {
        let mut outbox: Vec<Message> = Vec::new();
        let mut busy = false;
        for (id, n) in nodes.iter_mut() {
            if down.contains(id) {
                continue;
            }
            while let Some(work) = n.replica.next_work(&mut n.disk).unwrap() {
                busy = true;
                outbox.extend(work.messages);
                let mut last = None;
                for e in work.committed {
                    if carries_command(&e) {
                        n.applied.push((e.index, e.data.to_vec()));
                    }
                    last = Some(e.index);
                }
                if let Some(last) = last {
                    n.replica.applied_to(last);
                }
                outbox.extend(n.replica.durable(n.disk.records.len() as u64));
            }
        }
        for m in outbox {
            if down.contains(&m.to) || down.contains(&m.from) {
                continue;
            }
            if let Some(n) = nodes.get_mut(&m.to) {
                let _ = n.replica.step(m);
            }
        }
        if !busy {
            return;
        }
    }
    panic!("did not settle");
}

fn tick_until_leader(nodes: &mut BTreeMap<u64, Node>, down: &[u64]) -> u64 {
    for _ in 0..500 {
        for (id, n) in nodes.iter_mut() {
            if !down.contains(id) {
                n.replica.tick();
            }
        }
        settle(nodes, down);
        if let Some((id, _)) = nodes
            .iter()
            .find(|(id, n)| !down.contains(id) && n.replica.serving())
        {
            return *id;
        }
    }
    panic!("no leader");
}

#[test]
fn a_leader_is_elected_commits_everywhere_and_fails_over() {
    let mut nodes: BTreeMap<u64, Node> = (1..=3).map(|id| (id, node(id))).collect();
    let leader = tick_until_leader(&mut nodes, &[]);
    for i in 0..10u8 {
        let leader_node = nodes.get_mut(&leader).unwrap();
        leader_node.replica.propose(vec![i; 8]).unwrap();
        settle(&mut nodes, &[]);
    }
    for n in nodes.values() {
        assert_eq!(n.applied.len(), 10, "every replica applied every command");
    }
    let follower = nodes.keys().copied().find(|id| *id != leader).unwrap();
    assert!(nodes
        .get_mut(&follower)
        .unwrap()
        .replica
        .propose(vec![1])
        .is_err());

    let new_leader = tick_until_leader(&mut nodes, &[leader]);
    assert_ne!(new_leader, leader);
    nodes
        .get_mut(&new_leader)
        .unwrap()
        .replica
        .propose(vec![42])
        .unwrap();
    settle(&mut nodes, &[leader]);
    for (id, n) in &nodes {
        if *id != leader {
            assert_eq!(n.applied.last().unwrap().1, vec![42]);
        }
    }
    // The old leader comes back and catches up from the log.
    for _ in 0..50 {
        for n in nodes.values_mut() {
            n.replica.tick();
        }
        settle(&mut nodes, &[]);
    }
    assert_eq!(nodes[&leader].applied, nodes[&new_leader].applied);
}

/// Everything node `n` sends once its pending work is done and durable.
fn outgoing(n: &mut Node) -> Vec<Message> {
    let mut out = Vec::new();
    while let Some(work) = n.replica.next_work(&mut n.disk).unwrap() {
        out.extend(work.messages);
    }
    out.extend(n.replica.durable(n.disk.records.len() as u64));
    out
}

/// A (re)started replica ignores vote requests for one election timeout: it may have answered
/// a leader's heartbeat just before it went down, and that leader's lease counts on it not
/// voting for another so soon. After that it votes as usual.
#[test]
fn a_restarted_replica_grants_no_vote_for_an_election_timeout() {
    use raft::eraftpb::MessageType;
    let mut n = node(3);
    let vote = Message {
        msg_type: MessageType::MsgRequestVote,
        from: 2,
        to: 3,
        term: 5,
        ..Message::default()
    };
    let answers = |messages: &[Message]| {
        messages
            .iter()
            .filter(|m| m.get_msg_type() == MessageType::MsgRequestVoteResponse)
            .map(|m| (m.to, m.reject))
            .collect::<Vec<_>>()
    };
    n.replica.step(vote.clone()).unwrap();
    assert_eq!(
        answers(&outgoing(&mut n)),
        vec![],
        "no vote in the quiet period"
    );
    assert_eq!(n.replica.role().term, 0, "nor a change of term");
    for _ in 0..config(3).election_ticks {
        n.replica.tick();
    }
    n.replica.step(vote).unwrap();
    assert_eq!(
        answers(&outgoing(&mut n)),
        vec![(2, false)],
        "a vote after it"
    );
}
