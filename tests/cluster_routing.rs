//! A client finds the cluster, and dead letters find their topic's leader, with three real
//! `pinq serve` processes on 127.0.0.1.
//!
//! - `pinq publish` through a seed that is killed (SIGKILL) right after it answered `hello`
//!   still succeeds, on another member learned from that handshake.
//! - With two shards led by different nodes, a message NACKed until it is out of deliveries
//!   lands in its dead-letter topic although that topic's leader is another node.
//! - With two shards per node, each shard's transport has its own connection to every peer and
//!   both groups replicate; a connection whose preamble names a shard the node does not run is
//!   refused, and the node says why.
//!
//! No assertion is about speed; the time the publish took is printed. Every member is stopped
//! by its pid (the `Cluster` helper); the tests run one at a time (three brokers on 2 cores).

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use support::cluster::{free_port, Cluster};
use support::{cli_within, on_executor};

/// ACK deletes batched quickly, so a consumer's ACK commits soon.
const ENV: &[(&str, &str)] = &[("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "50ms")];

/// How long a fresh cluster may take to elect its first leaders on a loaded machine.
const FIRST_ELECTION_TIMEOUT: Duration = Duration::from_secs(15);

/// Upper bound for any one CLI command of these tests (a functional bound: the router's own
/// patience is 20 s, so a client that found no other member would fail, not hang).
const CLI_LIMIT: Duration = Duration::from_secs(60);

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A one-connection TCP relay in front of `target` that SIGKILLs `pid` once it has passed on
/// the broker's second message to the client: the first answers the bootstrap, the second
/// `hello` (the client pipelines both, and the broker answers them in order). The client then
/// holds a completed handshake with a node that is gone; the relay closes both sides and stops
/// listening, so the seed address refuses further connections as a dead node's would.
struct KillAfterHello {
    addr: SocketAddr,
    done: std::thread::JoinHandle<bool>,
}

impl KillAfterHello {
    fn start(target: SocketAddr, pid: u32) -> KillAfterHello {
        let listener = TcpListener::bind(("127.0.0.1", free_port(0))).expect("bind the relay");
        let addr = listener.local_addr().expect("relay address");
        let done = std::thread::spawn(move || {
            let (client, _) = listener.accept().expect("the client connects to the relay");
            drop(listener);
            let server = TcpStream::connect(target).expect("the relay reaches the seed");
            let (mut from_client, mut to_server) = (
                client.try_clone().expect("clone"),
                server.try_clone().expect("clone"),
            );
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                while let Ok(n) = from_client.read(&mut buf) {
                    if n == 0 || to_server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
            let killed = relay_two_messages_then_kill(&server, &client, pid);
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
            killed
        });
        KillAfterHello { addr, done }
    }

    /// Whether the seed was killed after the handshake's answer went through.
    fn killed(self) -> bool {
        self.done.join().expect("relay thread")
    }
}

fn relay_two_messages_then_kill(server: &TcpStream, client: &TcpStream, pid: u32) -> bool {
    let (mut from_server, mut to_client) = (server, client);
    for _ in 0..2 {
        let message = match capnp::serialize::read_message(&mut from_server, Default::default()) {
            Ok(message) => message,
            Err(_) => return false,
        };
        let segments = message.into_segments();
        if capnp::serialize::write_message_segments(&mut to_client, &segments).is_err() {
            return false;
        }
    }
    to_client.flush().expect("flush to the client");
    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

fn publish_cli(server: &str, topic: &str, payload: &str) -> (i32, String, String) {
    cli_within(
        &[
            "publish", "--server", server, "--topic", topic, "--ack", "durable", payload,
        ],
        None,
        CLI_LIMIT,
    )
}

/// The payloads `count` consumes of `topic` for `group` through `addr` (each ACKed).
fn consume_cli(addr: &str, topic: &str, group: &str, count: usize) -> Vec<String> {
    let count = count.to_string();
    let (code, out, err) = cli_within(
        &[
            "consume",
            "--server",
            addr,
            "--topic",
            topic,
            "--group",
            group,
            "--count",
            &count,
            "--timeout",
            "20s",
        ],
        None,
        CLI_LIMIT,
    );
    assert_eq!(code, 0, "consume through {addr} failed:\n{out}\n{err}");
    out.lines().map(str::to_owned).collect()
}

#[test]
fn publish_through_a_seed_killed_right_after_hello_succeeds_on_another_member() {
    let _serial = serial();
    let mut cluster = Cluster::start(3, ENV);
    let ids = cluster.ids();
    // The seed is the shard's leader: the publish must also wait out an election.
    let seed = cluster.wait_for_leader(0, &ids, FIRST_ELECTION_TIMEOUT);
    // The handshake names every member once the nodes have met (each learns a peer's client
    // address from the peer's own handshake).
    let seed_addr = cluster.addr(seed);
    let deadline = Instant::now() + FIRST_ELECTION_TIMEOUT;
    loop {
        let addr = seed_addr.clone();
        let members = on_executor(move || async move {
            match pinq::client::Client::connect(addr.as_str()).await {
                Ok(client) => client.members().to_vec(),
                Err(_) => Vec::new(),
            }
        });
        let mut want: Vec<String> = ids.iter().map(|&id| cluster.addr(id)).collect();
        let mut got = members.clone();
        want.sort();
        got.sort();
        if got == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "hello of node {seed} names members {members:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let relay = KillAfterHello::start(cluster.member(seed).client, cluster.server(seed).pid());
    let started = Instant::now();
    let (code, out, err) = publish_cli(&relay.addr.to_string(), "routed", "after-the-seed-died");
    let took = started.elapsed();
    assert!(
        relay.killed(),
        "the seed was not killed after its hello answer"
    );
    cluster.kill9(seed);
    assert_eq!(
        code, 0,
        "publish through a seed killed after hello failed:\n{out}\n{err}"
    );
    println!("publish through a seed killed right after hello: ok in {took:?}");

    let survivor = ids
        .iter()
        .copied()
        .find(|&id| id != seed)
        .expect("a survivor");
    let got = consume_cli(&cluster.addr(survivor), "routed", "readers", 1);
    assert_eq!(got, ["after-the-seed-died"], "the publish was stored once");
}

/// `--cpus` of every member of the dead-letter test: two shards per node.
const TWO_SHARDS: &str = "0,1";

/// Starts three members with two shards each (shard ports chosen by the kernel).
fn two_shard_cluster() -> Cluster {
    let env = [
        ("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "50ms"),
        ("PINQ_DELIVERY_MAX_DELIVERIES", "2"),
        ("PINQ_SERVER_SHARD_PORT_BASE", "0"),
    ];
    let mut cluster = Cluster::new(3, &env);
    let ids = cluster.ids();
    let args = ids
        .iter()
        .map(|&id| cluster.args(id, &[("--cpus", TWO_SHARDS)]))
        .collect();
    cluster.start_nodes(&ids, args);
    cluster
}

/// Makes shards 0 and 1 be led by different nodes and returns their leaders: while one node
/// leads both, it is killed (its shards elect among the others, each at random) and, if the
/// new leaders coincide again, started again before the next round.
fn leaders_on_different_nodes(cluster: &mut Cluster) -> (u64, u64) {
    const ROUNDS_MAX: usize = 12;
    for _ in 0..ROUNDS_MAX {
        let running = cluster.running();
        let l0 = cluster.wait_for_leader(0, &running, FIRST_ELECTION_TIMEOUT);
        let l1 = cluster.wait_for_leader(1, &running, FIRST_ELECTION_TIMEOUT);
        if l0 != l1 {
            return (l0, l1);
        }
        for id in cluster.ids() {
            if !running.contains(&id) {
                let args = cluster.args(id, &[("--cpus", TWO_SHARDS)]);
                cluster.start_nodes(&[id], vec![args]);
                // A node behind the others cannot win an election (Raft's up-to-date rule):
                // the next round would always pick the same survivor.
                wait_caught_up(cluster, id, l0);
            }
        }
        cluster.kill9(l0);
    }
    panic!("shards 0 and 1 were led by one node after {ROUNDS_MAX} elections");
}

/// Waits (at most 15 s) until node `id` has applied, on both shards, what `leader` had
/// committed when the wait began.
fn wait_caught_up(cluster: &Cluster, id: u64, leader: u64) {
    let limit = Duration::from_secs(1);
    let Some(target) = cluster.status(leader, limit) else {
        return;
    };
    let deadline = Instant::now() + FIRST_ELECTION_TIMEOUT;
    while Instant::now() < deadline {
        let caught_up = cluster.status(id, limit).is_some_and(|s| {
            target.shards.iter().all(|t| {
                s.shards
                    .iter()
                    .any(|r| r.shard_id == t.shard_id && r.applied_index >= t.commit_index)
            })
        });
        if caught_up {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn recv_within(
    sub: &pinq::client::Subscription,
    wait: Duration,
) -> Option<pinq::client::Delivery> {
    futures_lite::future::or(async { sub.recv().await.ok() }, async {
        glommio::timer::sleep(wait).await;
        None
    })
    .await
}

fn header<'a>(d: &'a pinq::client::Delivery, key: &str) -> Option<&'a str> {
    d.headers
        .iter()
        .find(|h| h.key == key)
        .and_then(|h| std::str::from_utf8(&h.value).ok())
}

#[test]
fn dead_letter_reaches_its_topics_leader_on_another_node() {
    use pinq::client::{AckLevel, Client, PublishMessage};
    use pinq::key::TopicHash;

    let _serial = serial();
    let mut cluster = two_shard_cluster();
    let (l0, l1) = leaders_on_different_nodes(&mut cluster);
    // A topic on one shard whose dead-letter topic (`<topic>.dlq`) is on the other.
    let topic = (0..1000)
        .map(|i| format!("orders{i}"))
        .find(|t| TopicHash::of(t).shard(2) != TopicHash::of(&format!("{t}.dlq")).shard(2))
        .expect("a topic whose dead-letter topic is on the other shard");
    let dlq = format!("{topic}.dlq");
    let (source_leader, dlq_leader) = match TopicHash::of(&topic).shard(2) {
        0 => (l0, l1),
        _ => (l1, l0),
    };
    assert_ne!(source_leader, dlq_leader);
    println!("{topic} led by node {source_leader}, {dlq} by node {dlq_leader}");
    let source_addr = cluster.addr(source_leader);
    let dlq_addr = cluster.addr(dlq_leader);
    let (t, d) = (topic.clone(), dlq.clone());
    let (attempts, letter) = on_executor(move || async move {
        let source = Client::connect(source_addr.as_str())
            .await
            .expect("connect");
        let inspector = Client::connect(dlq_addr.as_str()).await.expect("connect");
        let dead = inspector
            .subscribe(&d, "inspect", 0)
            .await
            .expect("subscribe to the dead-letter topic on its leader");
        let sub = source.subscribe(&t, "workers", 0).await.expect("subscribe");
        source
            .publish(
                [PublishMessage::new(t.as_str(), "poison")],
                AckLevel::Durable,
            )
            .await
            .expect("publish");
        let mut attempts = Vec::new();
        while let Some(delivery) = recv_within(&sub, Duration::from_secs(2)).await {
            attempts.push(delivery.attempt);
            sub.nack(&[delivery.tag], 0).await.expect("nack");
        }
        let letter = recv_within(&dead, Duration::from_secs(15)).await;
        if let Some(letter) = &letter {
            dead.ack(&[letter.tag]).await.expect("ack the dead letter");
        }
        (attempts, letter)
    });
    assert_eq!(attempts, vec![1, 2], "two deliveries, then none");
    let letter = letter.expect("the dead letter reached the dead-letter topic's leader");
    assert_eq!(letter.payload, b"poison");
    assert_eq!(header(&letter, "pinq-dlq-topic"), Some(topic.as_str()));
    assert_eq!(header(&letter, "pinq-dlq-group"), Some("workers"));
    assert_eq!(header(&letter, "pinq-dlq-attempts"), Some("2"));
    assert_eq!(header(&letter, "pinq-dlq-reason"), Some("nack"));
}

/// The metrics page of member `id`.
fn metrics_of(cluster: &Cluster, id: u64) -> String {
    support::http_get(cluster.member(id).metrics, "/metrics").1
}

/// Whether every shard of member `id` has its own connection to each of the two other members.
fn every_shard_connected(cluster: &Cluster, id: u64) -> bool {
    let page = metrics_of(cluster, id);
    ["shard=\"0\"", "shard=\"1\""]
        .iter()
        .all(|shard| support::sample(&page, "pinq_raft_peers_connected", shard) == Some(2.0))
}

#[test]
fn two_shards_per_node_each_carry_their_raft_traffic_over_their_own_connections() {
    let _serial = serial();
    let started = Instant::now();
    let cluster = two_shard_cluster();
    let running = cluster.running();
    let l0 = cluster.wait_for_leader(0, &running, FIRST_ELECTION_TIMEOUT);
    let l1 = cluster.wait_for_leader(1, &running, FIRST_ELECTION_TIMEOUT);
    // Both groups replicate: every follower applies what each shard's leader committed.
    for id in cluster.ids() {
        wait_caught_up(&cluster, id, l0);
        wait_caught_up(&cluster, id, l1);
    }
    let status = cluster
        .status(1, Duration::from_secs(5))
        .expect("node 1 answers status");
    assert_eq!(status.shards.len(), 2, "{status:?}");
    assert!(status.nodes.iter().all(|n| n.reachable), "{status:?}");

    // Each shard's transport has its own connection to each peer (one Raft port per node).
    let deadline = Instant::now() + FIRST_ELECTION_TIMEOUT;
    while !cluster
        .ids()
        .iter()
        .all(|&id| every_shard_connected(&cluster, id))
    {
        assert!(
            Instant::now() < deadline,
            "not every shard connected to both peers: {}",
            metrics_of(&cluster, 1)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for id in cluster.ids() {
        let page = metrics_of(&cluster, id);
        for shard in ["shard=\"0\"", "shard=\"1\""] {
            let established =
                support::sample(&page, "pinq_raft_connections_established_total", shard);
            assert!(
                established >= Some(2.0),
                "node {id} {shard}: {established:?}"
            );
        }
    }

    // A connection whose preamble names a shard the node does not run is closed before TLS
    // and the Hello, and the node says why.
    let raft = cluster.member(1).raft;
    let mut stream = TcpStream::connect(raft).expect("connect to node 1's Raft port");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    stream
        .write_all(b"PQR2\x07\x00\x00\x00")
        .expect("send a preamble");
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(
        rest.is_empty(),
        "node 1 answered a refused connection: {rest:?}"
    );
    let words = [
        "refused a peer at the handshake",
        "shardMismatch",
        "names shard 7",
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    loop {
        seen.extend(cluster.server(1).drain_output());
        if seen.iter().any(|l| words.iter().all(|w| l.contains(w))) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node 1 logged no line with {words:?}:\n{}",
            seen.join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The cluster keeps working on both shards.
    assert!(cluster
        .ids()
        .iter()
        .all(|&id| every_shard_connected(&cluster, id)));
    eprintln!("two-shard transport test took {:?}", started.elapsed());
}
