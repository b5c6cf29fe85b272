//! Tests of the transport with real sockets on 127.0.0.1: several transports on one glommio
//! executor, talking to each other over loopback.

// raft's protobuf structs have many fields; setting the few a test cares about one by one reads
// better than a struct literal with `..Default::default()`.
#![allow(clippy::field_reassign_with_default)]

use super::*;
use raft::eraftpb::MessageType;
use std::future::Future;

type Received = Rc<RefCell<Vec<(u64, u32, Message)>>>;

/// Runs a test body on a fresh glommio executor.
fn run<F, Fut>(body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spawn(body)
        .unwrap()
        .join()
        .unwrap();
}

/// Polls `condition` every millisecond until it holds; fails the test after 10 s.
async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if condition() {
            return;
        }
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
    panic!("timed out waiting for {what}");
}

/// `n` free loopback ports (bound once, then released).
fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners.iter().map(|l| l.local_addr().unwrap()).collect()
}

/// Node `node_id` of a cluster whose members are at `addrs` (node i + 1 at addrs[i]), with fast
/// timing: 50 ms election timeout, so 500 ms before a silent connection is closed.
fn config(node_id: u64, addrs: &[SocketAddr]) -> ClusterConfig {
    ClusterConfig {
        node_id,
        join: None,
        raft_listen: addrs[node_id as usize - 1],
        peers: addrs
            .iter()
            .enumerate()
            .map(|(i, addr)| (i as u64 + 1, *addr))
            .collect(),
        advertise: SocketAddr::from(([127, 0, 0, 1], 7400 + node_id as u16)),
        tick_interval: Duration::from_millis(10),
        heartbeat_ticks: 1,
        election_ticks: 5,
        log_retain_entries: 1000,
        outbound_queue_messages: 1024,
        max_frame_bytes: 1 << 20,
        tls: None,
    }
}

fn start(config: &ClusterConfig, shard_count: u32) -> (Rc<Transport>, Received) {
    start_tls(config, shard_count, None)
}

/// Shard 0 of `shard_count`, listening on the node's port; connections for other shards are
/// closed (see [`start_node`] for a node running all of them).
fn start_tls(
    config: &ClusterConfig,
    shard_count: u32,
    tls: Option<Arc<NodeTls>>,
) -> (Rc<Transport>, Received) {
    let (transport, received) = start_shard(config, 0, shard_count, tls);
    transport
        .listen(config.raft_listen, Rc::new(|_, _| false))
        .unwrap();
    (transport, received)
}

/// Shard `index` of `count`'s transport, not listening.
fn start_shard(
    config: &ClusterConfig,
    index: u32,
    count: u32,
    tls: Option<Arc<NodeTls>>,
) -> (Rc<Transport>, Received) {
    let received: Received = Rc::default();
    let sink = received.clone();
    let transport = Transport::start(
        config,
        ShardPlace { index, count },
        tls,
        Rc::new(move |from, message| sink.borrow_mut().push((from, index, message))),
    )
    .unwrap();
    (transport, received)
}

/// Every shard of a node, each with its own transport, on this one executor: shard 0 listens
/// and hands each other shard its connections (as the server does across cores).
fn start_node(config: &ClusterConfig, shard_count: u32) -> Vec<(Rc<Transport>, Received)> {
    let shards: Vec<(Rc<Transport>, Received)> = (0..shard_count)
        .map(|index| start_shard(config, index, shard_count, None))
        .collect();
    let others: Vec<Rc<Transport>> = shards.iter().map(|(t, _)| t.clone()).collect();
    shards[0]
        .0
        .listen(
            config.raft_listen,
            Rc::new(move |to, accepted| match others.get(to as usize) {
                Some(transport) => {
                    transport.adopt(accepted);
                    true
                }
                None => false,
            }),
        )
        .unwrap();
    shards
}

fn heartbeat(from: u64, to: u64, term: u64) -> Message {
    let mut m = Message::default();
    m.msg_type = MessageType::MsgHeartbeat;
    m.from = from;
    m.to = to;
    m.term = term;
    m
}

fn all_reachable(transport: &Transport) -> bool {
    transport.peers().iter().all(|p| p.reachable)
}

#[test]
fn three_nodes_exchange_messages_on_every_shard_each_over_its_own_connections() {
    run(|| async {
        let addrs = free_addrs(3);
        let nodes: Vec<Vec<(Rc<Transport>, Received)>> = (1..=3)
            .map(|id| start_node(&config(id, &addrs), 4))
            .collect();
        until("every pair connected on every shard", || {
            nodes.iter().flatten().all(|(t, _)| all_reachable(t))
        })
        .await;
        for (i, shards) in nodes.iter().enumerate() {
            let from = i as u64 + 1;
            for to in (1..=3).filter(|to| *to != from) {
                for (shard, (transport, _)) in shards.iter().enumerate() {
                    transport.send(to, heartbeat(from, to, shard as u64 + 10));
                }
            }
        }
        until("2 messages at each shard of each node", || {
            nodes.iter().flatten().all(|(_, r)| r.borrow().len() == 2)
        })
        .await;
        for (i, shards) in nodes.iter().enumerate() {
            let me = i as u64 + 1;
            for (shard, (transport, received)) in shards.iter().enumerate() {
                let mut got: Vec<(u64, u32, u64)> = received
                    .borrow()
                    .iter()
                    .map(|(from, shard, m)| {
                        assert_eq!(m.to, me);
                        assert_eq!(m.from, *from);
                        (*from, *shard, m.term)
                    })
                    .collect();
                got.sort();
                let expected: Vec<(u64, u32, u64)> = (1..=3)
                    .filter(|from| *from != me)
                    .map(|from| (from, shard as u32, shard as u64 + 10))
                    .collect();
                assert_eq!(got, expected, "node {me} shard {shard}");
                // Each shard sent and received its own, over its own two connections.
                let counters = transport.counters();
                assert_eq!(counters.messages_sent, 2);
                assert_eq!(counters.messages_received, 2);
                assert_eq!(counters.dropped(), 0);
                assert_eq!(
                    counters.connections_established, 2,
                    "node {me} shard {shard}"
                );
                let peers = transport.peers();
                assert_eq!(peers.len(), 2);
                for peer in peers {
                    assert_eq!(
                        peer.client_addr,
                        Some(format!("127.0.0.1:{}", 7400 + peer.id))
                    );
                    assert_eq!(peer.raft_addr, addrs[peer.id as usize - 1]);
                }
            }
            // Shard 0 listens for all: it handed the other shards' accepted connections over
            // (node 1 accepts none, node 2 one per other shard from node 1, node 3 two).
            assert_eq!(shards[0].0.counters().handoffs, 3 * (me - 1));
        }
        for (transport, _) in nodes.iter().flatten() {
            transport.stop();
        }
    });
}

#[test]
fn messages_queued_in_one_turn_travel_in_one_frame() {
    run(|| async {
        let addrs = free_addrs(2);
        let (one, _) = start(&config(1, &addrs), 1);
        let (two, received) = start(&config(2, &addrs), 1);
        until("connected", || all_reachable(&one) && all_reachable(&two)).await;
        let frames_before = one.counters().frames_sent;
        // 64 messages of one tick: queued without yielding in between.
        for term in 0..64 {
            one.send(2, heartbeat(1, 2, term));
        }
        until("64 heartbeats", || received.borrow().len() == 64).await;
        let counters = one.counters();
        assert_eq!(counters.messages_sent, 64);
        // One data frame (a keepalive may have gone out meanwhile as well).
        let frames = counters.frames_sent - frames_before;
        assert!((1..=2).contains(&frames), "{frames} frames");
        assert_eq!(two.counters().messages_received, 64);
        one.stop();
        two.stop();
    });
}

#[test]
fn a_shard_count_mismatch_is_refused_with_the_typed_reason_on_both_sides() {
    run(|| async {
        let addrs = free_addrs(2);
        let (one, _) = start(&config(1, &addrs), 2);
        let (two, _) = start(&config(2, &addrs), 4);
        until("a refusal on both sides", || {
            !one.recent_refusals().is_empty() && !two.recent_refusals().is_empty()
        })
        .await;
        for (transport, us, them, ours, theirs) in [(&one, 1, 2, 2, 4), (&two, 2, 1, 4, 2)] {
            let event = &transport.recent_refusals()[0];
            assert_eq!(event.peer, Some(them));
            assert!(event.by_us, "each side refuses the other");
            assert_eq!(event.refusal.reason, RefusalReason::ShardCountMismatch);
            assert!(
                event.refusal.detail.starts_with(&format!(
                    "node {them} runs {theirs} shards, node {us} runs {ours}"
                )),
                "{}",
                event.refusal
            );
            assert!(!all_reachable(transport));
        }
        // The dialer keeps retrying (with backoff), and each retry is refused again.
        let before = one.counters().handshake_refusals;
        until("a retry", || one.counters().handshake_refusals > before).await;
        assert_eq!(one.counters().connections_established, 0);
        one.send(2, heartbeat(1, 2, 1));
        assert_eq!(one.counters().dropped_not_connected, 1);
        one.stop();
        two.stop();
    });
}

#[test]
fn a_member_listed_at_another_address_is_refused_naming_it() {
    run(|| async {
        let addrs = free_addrs(4);
        let (one, _) = start(&config(1, &addrs[..3]), 2);
        // Node 2 believes node 3 listens elsewhere.
        let moved = [addrs[0], addrs[1], addrs[3]];
        let (two, _) = start(&config(2, &moved), 2);
        until("a refusal", || !two.recent_refusals().is_empty()).await;
        let event = &two.recent_refusals()[0];
        assert_eq!(event.refusal.reason, RefusalReason::MembersMismatch);
        assert!(
            event.refusal.detail.contains(&format!("3={}", addrs[3])),
            "{}",
            event.refusal
        );
        one.stop();
        two.stop();
    });
}

#[test]
fn peers_set_at_run_time_are_dialed_and_dropped() {
    run(|| async {
        let addrs = free_addrs(3);
        let (one, _) = start(&config(1, &addrs[..2]), 2);
        let (two, _) = start(&config(2, &addrs[..2]), 2);
        until("1 and 2 connected", || {
            one.peers().iter().all(|p| p.reachable)
        })
        .await;
        // Node 3 starts knowing all three; node 1 learns of it at run time and dials it.
        let (three, _) = start(&config(3, &addrs), 2);
        let all: BTreeMap<u64, SocketAddr> = [(1, addrs[0]), (2, addrs[1]), (3, addrs[2])].into();
        one.set_peers(&all);
        until("1 reaches 3", || {
            one.peers().iter().any(|p| p.id == 3 && p.reachable)
        })
        .await;
        // Node 3 leaves node 1's members: the connection closes and is not dialed again.
        let without_three: BTreeMap<u64, SocketAddr> = [(1, addrs[0]), (2, addrs[1])].into();
        one.set_peers(&without_three);
        assert!(one.peers().iter().all(|p| p.id != 3));
        until("3 sees 1 gone", || {
            three.peers().iter().all(|p| p.id != 1 || !p.reachable)
        })
        .await;
        one.stop();
        two.stop();
        three.stop();
    });
}

#[test]
fn a_restarted_peer_is_reconnected_and_messages_flow_again() {
    run(|| async {
        let addrs = free_addrs(2);
        let (one, received_one) = start(&config(1, &addrs), 2);
        let (two, received_two) = start(&config(2, &addrs), 2);
        until("connected", || all_reachable(&one) && all_reachable(&two)).await;
        one.send(2, heartbeat(1, 2, 1));
        until("first message", || received_two.borrow().len() == 1).await;

        // Node 2 (the accepting side) restarts: node 1 redials it.
        two.stop();
        until("node 1 sees node 2 gone", || !all_reachable(&one)).await;
        glommio::timer::sleep(Duration::from_millis(20)).await;
        let (two, received_two) = start(&config(2, &addrs), 2);
        until("reconnected to node 2", || {
            all_reachable(&one) && all_reachable(&two)
        })
        .await;
        assert_eq!(one.counters().reconnects, 1);
        one.send(2, heartbeat(1, 2, 2));
        two.send(1, heartbeat(2, 1, 2));
        until("messages after node 2's restart", || {
            received_two.borrow().len() == 1 && received_one.borrow().len() == 1
        })
        .await;

        // Node 1 (the dialing side) restarts: node 2 takes its new connection.
        one.stop();
        until("node 2 sees node 1 gone", || !all_reachable(&two)).await;
        glommio::timer::sleep(Duration::from_millis(20)).await;
        let (one, received_one) = start(&config(1, &addrs), 2);
        until("reconnected to node 1", || {
            all_reachable(&one) && all_reachable(&two)
        })
        .await;
        two.send(1, heartbeat(2, 1, 3));
        until("message after node 1's restart", || {
            received_one.borrow().len() == 1
        })
        .await;
        assert_eq!(received_one.borrow()[0].2.term, 3);
        one.stop();
        two.stop();
    });
}

#[test]
fn a_full_queue_drops_and_counts() {
    run(|| async {
        let addrs = free_addrs(2);
        let mut small = config(1, &addrs);
        small.outbound_queue_messages = 4;
        let (one, _) = start(&small, 1);
        let (two, received) = start(&config(2, &addrs), 1);
        until("connected", || all_reachable(&one) && all_reachable(&two)).await;
        // Ten sends before the writer runs: four fit the queue.
        for term in 0..10 {
            one.send(2, heartbeat(1, 2, term));
        }
        assert_eq!(one.counters().dropped_queue_full, 6);
        until("the queued four", || received.borrow().len() == 4).await;
        let terms: Vec<u64> = received.borrow().iter().map(|(_, _, m)| m.term).collect();
        assert_eq!(terms, [0, 1, 2, 3]);
        // The queue has room again once drained.
        one.send(2, heartbeat(1, 2, 99));
        until("one more", || received.borrow().len() == 5).await;
        // Unknown and unconnected peers drop too.
        one.send(7, heartbeat(1, 7, 1));
        assert_eq!(one.counters().dropped_not_connected, 1);
        assert_eq!(one.counters().dropped(), 7);
        one.stop();
        two.stop();
    });
}

#[test]
fn a_message_larger_than_a_frame_is_dropped_and_the_rest_go() {
    run(|| async {
        let addrs = free_addrs(2);
        let (one, _) = start(&config(1, &addrs), 1);
        let (two, received) = start(&config(2, &addrs), 1);
        until("connected", || all_reachable(&one) && all_reachable(&two)).await;
        let mut huge = heartbeat(1, 2, 5);
        huge.msg_type = MessageType::MsgAppend;
        let mut entry = raft::eraftpb::Entry::default();
        entry.data = vec![0u8; 2 << 20].into();
        huge.mut_entries().push(entry);
        one.send(2, heartbeat(1, 2, 4));
        one.send(2, huge);
        one.send(2, heartbeat(1, 2, 6));
        until("the two small ones", || received.borrow().len() == 2).await;
        assert_eq!(one.counters().dropped_oversize, 1);
        let terms: Vec<u64> = received.borrow().iter().map(|(_, _, m)| m.term).collect();
        assert_eq!(terms, [4, 6]);
        one.stop();
        two.stop();
    });
}

#[test]
fn messages_from_another_node_are_dropped_on_arrival() {
    run(|| async {
        let addrs = free_addrs(2);
        let (one, _) = start(&config(1, &addrs), 2);
        let (two, received) = start(&config(2, &addrs), 2);
        until("connected", || all_reachable(&one) && all_reachable(&two)).await;
        one.send(2, heartbeat(3, 2, 1)); // claims to be from node 3
        one.send(2, heartbeat(1, 2, 2));
        until("the valid one", || received.borrow().len() == 1).await;
        until("the other counted", || two.counters().dropped_inbound == 1).await;
        one.stop();
        two.stop();
    });
}

/// Connects to `addr` as a raw client of shard 0 (the preamble sent).
async fn raw_connect(addr: SocketAddr) -> TcpStream {
    raw_connect_to_shard(addr, 0).await
}

async fn raw_connect_to_shard(addr: SocketAddr, shard: u32) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(&encode_preamble(shard)).await.unwrap();
    stream
}

#[test]
fn a_preamble_naming_a_shard_the_node_does_not_run_is_refused_saying_why() {
    run(|| async {
        let addrs = free_addrs(2);
        let (two, _) = start(&config(2, &addrs), 2);
        let mut stream = raw_connect_to_shard(addrs[1], 5).await;
        // Closed before TLS or a Hello: nothing comes back.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "{rest:?}");
        until("refused", || !two.recent_refusals().is_empty()).await;
        let event = &two.recent_refusals()[0];
        assert_eq!(event.peer, None);
        assert!(event.by_us);
        assert_eq!(event.refusal.reason, RefusalReason::ShardMismatch);
        assert_eq!(
            event.refusal.detail,
            "the connection's preamble names shard 5, node 2 runs 2 shards"
        );
        assert_eq!(two.counters().handoffs, 0);
        two.stop();
    });
}

#[test]
fn a_connection_its_shard_cannot_take_is_closed_and_counted_and_dialed_again() {
    run(|| async {
        let addrs = free_addrs(2);
        // Node 2's listening shard hands nothing over (as with its channel to shard 1 full).
        let (two, _) = start(&config(2, &addrs), 2);
        let (one, _) = start_shard(&config(1, &addrs), 1, 2, None);
        until("two hand-offs refused", || {
            two.counters().handoffs_shed >= 2
        })
        .await;
        assert_eq!(two.counters().handoffs, 0);
        assert!(!all_reachable(&one));
        one.stop();
        two.stop();
    });
}

#[test]
fn a_connection_without_a_preamble_is_closed_as_undecodable() {
    run(|| async {
        let addrs = free_addrs(2);
        let (two, _) = start(&config(2, &addrs), 1);
        let mut stream = TcpStream::connect(addrs[1]).await.unwrap();
        // What a version-1 node sends first: a Hello frame's segment table.
        stream.write_all(&[0, 0, 0, 0, 9, 0, 0, 0]).await.unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        until("counted", || two.counters().decode_errors == 1).await;
        two.stop();
    });
}

#[test]
fn a_hello_of_another_shard_is_refused_by_the_shard_it_was_handed_to() {
    run(|| async {
        let addrs = free_addrs(2);
        let shards = start_node(&config(2, &addrs), 2);
        // The preamble names shard 1, the Hello says shard 0.
        let mut stream = raw_connect_to_shard(addrs[1], 1).await;
        let mut out = Vec::new();
        Hello::new(&config(1, &addrs), 2, 0)
            .encode(&mut out)
            .unwrap();
        stream.write_all(&out).await.unwrap();
        let mut buffer = FrameBuffer::default();
        let len = read_frame(&mut stream, &mut buffer, 1 << 20).await.unwrap();
        let theirs = Hello::decode(buffer.bytes(len), 1 << 20).unwrap();
        assert_eq!((theirs.node_id, theirs.shard), (2, 1));
        let len = read_frame(&mut stream, &mut buffer, 1 << 20).await.unwrap();
        let HelloReply::Refused(refusal) = HelloReply::decode(buffer.bytes(len), 1 << 20).unwrap()
        else {
            panic!("accepted a Hello of shard 0 on shard 1");
        };
        assert_eq!(refusal.reason, RefusalReason::ShardMismatch);
        let (one, _) = &shards[1];
        until("recorded", || !one.recent_refusals().is_empty()).await;
        assert_eq!(one.recent_refusals()[0].refusal, refusal);
        assert_eq!(shards[0].0.counters().handoffs, 1);
        for (transport, _) in &shards {
            transport.stop();
        }
    });
}

#[test]
fn an_oversized_incoming_frame_closes_the_connection_before_its_body_is_read() {
    run(|| async {
        let addrs = free_addrs(2);
        let (two, _) = start(&config(2, &addrs), 1);
        let mut stream = raw_connect(addrs[1]).await;
        // One segment announcing 16 Mi words (128 MiB), then nothing.
        let mut table = [0u8; 8];
        table[4..8].copy_from_slice(&(16u32 << 20).to_le_bytes());
        stream.write_all(&table).await.unwrap();
        stream.flush().await.unwrap();
        // Node 2 sent its Hello, then closes on our frame (a reset or an orderly close).
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        until("counted", || two.counters().frames_too_large == 1).await;
        assert_eq!(two.counters().connections_established, 0);
        two.stop();
    });
}

#[test]
fn garbage_in_a_handshake_closes_the_connection() {
    run(|| async {
        let addrs = free_addrs(2);
        let (two, _) = start(&config(2, &addrs), 1);
        let mut stream = raw_connect(addrs[1]).await;
        // A valid segment table of 2 words whose body is noise.
        let mut frame = vec![0u8; 8];
        frame[4..8].copy_from_slice(&2u32.to_le_bytes());
        frame.extend_from_slice(&[0xff; 16]);
        stream.write_all(&frame).await.unwrap();
        stream.flush().await.unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        until("counted", || two.counters().decode_errors == 1).await;
        two.stop();
    });
}

#[test]
fn a_silent_connection_is_closed_as_stalled() {
    run(|| async {
        let addrs = free_addrs(2);
        let (two, _) = start(&config(2, &addrs), 1);
        let mut stream = raw_connect(addrs[1]).await;
        // Send nothing: node 2 waits for our Hello for 10 election timeouts (500 ms), then closes.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        until("counted", || two.counters().stalled_connections == 1).await;
        two.stop();
    });
}

#[test]
fn an_idle_pair_stays_connected_through_keepalives() {
    run(|| async {
        let addrs = free_addrs(2);
        let (one, _) = start(&config(1, &addrs), 1);
        let (two, _) = start(&config(2, &addrs), 1);
        until("connected", || all_reachable(&one) && all_reachable(&two)).await;
        // Twice the idle timeout with nothing to send.
        glommio::timer::sleep(Duration::from_millis(1000)).await;
        assert!(all_reachable(&one) && all_reachable(&two));
        assert_eq!(one.counters().connections_established, 1);
        assert_eq!(one.counters().stalled_connections, 0);
        assert!(one.counters().frames_sent >= 5, "{:?}", one.counters());
        one.stop();
        two.stop();
    });
}

#[test]
fn a_second_transport_on_the_same_port_fails_to_start() {
    run(|| async {
        let addrs = free_addrs(1);
        let (one, _) = start(&config(1, &addrs), 1);
        let err = start_shard(&config(1, &addrs), 0, 1, None)
            .0
            .listen(addrs[0], Rc::new(|_, _| false))
            .err()
            .unwrap();
        assert!(matches!(err, TransportError::Bind { .. }), "{err}");
        one.stop();
    });
}

#[test]
fn backoff_jitter_stays_within_half_and_whole() {
    let mut jitter = Jitter::new(1, 2);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..100 {
        let d = jitter.spread(Duration::from_millis(200));
        assert!(
            d >= Duration::from_millis(100) && d <= Duration::from_millis(200),
            "{d:?}"
        );
        seen.insert(d);
    }
    assert!(seen.len() > 10);
    // Seeded: the same pair gives the same delays.
    let a: Vec<Duration> = (0..5)
        .map(|_| Jitter::new(3, 4).spread(BACKOFF_MAX))
        .collect();
    let b: Vec<Duration> = (0..5)
        .map(|_| Jitter::new(3, 4).spread(BACKOFF_MAX))
        .collect();
    assert_eq!(a, b);
}

// ---------------------------------------------------------------------------------------------
// With `[cluster.tls]`: certificates made by the `openssl` program.

fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`ca.pem`) and `node1`, `node2` certificates signed by it, naming `pinq-node-<id>`.
fn make_pki() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca",
    ]);
    openssl(d, &ca);
    for id in 1..=2 {
        let (key, csr, pem, ext) = (
            format!("node{id}.key"),
            format!("node{id}.csr"),
            format!("node{id}.pem"),
            format!("node{id}.ext"),
        );
        std::fs::write(
            d.join(&ext),
            format!("subjectAltName=DNS:pinq-node-{id}\nextendedKeyUsage=serverAuth,clientAuth\n"),
        )
        .unwrap();
        let subj = format!("/CN=pinq-node-{id}");
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
        openssl(d, &req);
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ],
        );
    }
    dir
}

/// Node TLS for `config`'s node, presenting certificate `cert` (`node1` or `node2`).
fn node_tls(pki: &std::path::Path, config: &ClusterConfig, cert: &str) -> Option<Arc<NodeTls>> {
    let files = crate::security::node::NodeTlsFiles {
        cert_file: pki.join(format!("{cert}.pem")),
        key_file: pki.join(format!("{cert}.key")),
        ca_file: pki.join("ca.pem"),
    };
    let now = crate::security::tls::unix_now_s();
    let (tls, _) = NodeTls::from_files(&files, config.node_id, &config.peers, now).unwrap();
    Some(Arc::new(tls))
}

#[test]
fn nodes_with_tls_connect_and_exchange_messages() {
    let pki = make_pki();
    let dir = pki.path().to_owned();
    run(move || async move {
        let addrs = free_addrs(2);
        let (c1, c2) = (config(1, &addrs), config(2, &addrs));
        let (one, _) = start_tls(&c1, 1, node_tls(&dir, &c1, "node1"));
        let (two, received) = start_tls(&c2, 1, node_tls(&dir, &c2, "node2"));
        until("connected", || all_reachable(&one) && all_reachable(&two)).await;
        one.send(2, heartbeat(1, 2, 7));
        until("a heartbeat", || received.borrow().len() == 1).await;
        assert_eq!(received.borrow()[0].2.term, 7);
        assert!(one.recent_refusals().is_empty() && two.recent_refusals().is_empty());
        one.stop();
        two.stop();
    });
}

#[test]
fn a_plain_node_and_a_tls_node_refuse_each_other_saying_why() {
    let pki = make_pki();
    let dir = pki.path().to_owned();
    run(move || async move {
        let addrs = free_addrs(2);
        let c1 = config(1, &addrs);
        // Node 1 (TLS) dials node 2 (plain).
        let (one, _) = start_tls(&c1, 1, node_tls(&dir, &c1, "node1"));
        let (two, _) = start(&config(2, &addrs), 1);
        until("a refusal on both sides", || {
            !one.recent_refusals().is_empty() && !two.recent_refusals().is_empty()
        })
        .await;
        for (transport, expected) in [(&one, "does not speak TLS"), (&two, "speaks TLS")] {
            let event = &transport.recent_refusals()[0];
            assert_eq!(event.refusal.reason, RefusalReason::Tls);
            assert!(event.by_us);
            assert!(event.refusal.detail.contains(expected), "{}", event.refusal);
        }
        assert!(!all_reachable(&one) && !all_reachable(&two));
        one.stop();
        two.stop();
    });
}

#[test]
fn a_node_presenting_another_members_certificate_is_refused_on_both_sides() {
    let pki = make_pki();
    let dir = pki.path().to_owned();
    run(move || async move {
        let addrs = free_addrs(2);
        let (c1, c2) = (config(1, &addrs), config(2, &addrs));
        // Node 1 dials node 2 presenting node 2's own certificate.
        let (one, _) = start_tls(&c1, 1, node_tls(&dir, &c1, "node2"));
        let (two, _) = start_tls(&c2, 1, node_tls(&dir, &c2, "node2"));
        until("refusals", || {
            !one.recent_refusals().is_empty() && !two.recent_refusals().is_empty()
        })
        .await;
        let refused = &two.recent_refusals()[0];
        assert_eq!(refused.peer, Some(1));
        assert!(refused.by_us);
        assert_eq!(refused.refusal.reason, RefusalReason::CertificateMismatch);
        assert!(
            refused.refusal.detail.contains("names DNS:pinq-node-2"),
            "{}",
            refused.refusal
        );
        let told = &one.recent_refusals()[0];
        assert!(!told.by_us);
        assert_eq!(told.refusal.reason, RefusalReason::CertificateMismatch);
        one.stop();
        two.stop();
    });
}

#[test]
fn a_silent_connection_to_a_tls_node_is_closed() {
    let pki = make_pki();
    let dir = pki.path().to_owned();
    run(move || async move {
        let addrs = free_addrs(2);
        let c2 = config(2, &addrs);
        let (two, _) = start_tls(&c2, 1, node_tls(&dir, &c2, "node2"));
        let mut stream = raw_connect(addrs[1]).await;
        // No ClientHello: the read timeout (500 ms here) or HANDSHAKE_TIMEOUT ends it.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        until("counted", || two.counters().stalled_connections == 1).await;
        assert_eq!(two.counters().connections_established, 0);
        two.stop();
    });
}
