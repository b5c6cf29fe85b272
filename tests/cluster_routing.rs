//! A client finds the cluster, and dead letters find their topic's leader, with three real
//! `pinq serve` processes on 127.0.0.1.
//!
//! - `pinq publish` through a seed that is killed (SIGKILL) right after it answered `hello`
//!   still succeeds, on another member learned from that handshake.
//! - With two shards led by different nodes, a message NACKed until it is out of deliveries
//!   lands in its dead-letter topic although that topic's leader is another node.
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
