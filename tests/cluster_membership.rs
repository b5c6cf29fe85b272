//! Membership changes at run time with real processes under load (issue 22 part 1): a member is
//! replaced (3 → 4 → 3 nodes: node 4 joins with `--join` and `pinq cluster add-node`, node 3
//! goes with `pinq cluster remove-node`), then the current leader is removed, while a producer
//! publishes `durable` batches and a consumer ACKs them `durable` the whole time. Checked:
//! every acknowledged publish is delivered, no copy arrives after a durable ACK of it was
//! answered ok, each removed node stops by itself and refuses a restart, the roles in
//! `cluster status --json`, and the refusals (an unreachable new node, the last voter).
//!
//! Every server binds to 127.0.0.1 and is stopped by the test (by its pid, through
//! `support::Server`); every loop is bounded in time.

mod support;

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, PublishMessage, Router, RouterOptions, TagResult};
use support::cluster::Cluster;

const ENV: &[(&str, &str)] = &[("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "50ms")];
const SHARD: u32 = 0;
const TOPIC: &str = "members";
const GROUP: &str = "workers";
const FIRST_ELECTION_TIMEOUT: Duration = Duration::from_secs(15);
/// How long the drain after the changes may take before what is missing counts as lost.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);
/// A removed node must stop within this after `remove-node` answered.
const STOP_WITHIN: Duration = Duration::from_secs(15);

/// What the client saw.
#[derive(Default)]
struct Records {
    /// Payloads whose durable publish was answered ok.
    acked: HashSet<String>,
    /// Payloads delivered, with how often.
    delivered: HashMap<String, u32>,
    /// Payloads whose durable ACK was answered ok.
    ack_ok: HashSet<String>,
    /// Copies delivered after a durable ACK of the same message was answered ok.
    after_ack_ok: Vec<String>,
}

type Shared = Arc<Mutex<Records>>;

fn with<T>(shared: &Shared, f: impl FnOnce(&mut Records) -> T) -> T {
    f(&mut shared.lock().unwrap_or_else(|e| e.into_inner()))
}

#[derive(Default)]
struct Control {
    stop_publishing: AtomicBool,
    stop_consuming: AtomicBool,
}

fn router_options() -> RouterOptions {
    let mut options = RouterOptions {
        patience: Duration::from_secs(3),
        request_timeout: Duration::from_secs(1),
        ..RouterOptions::default()
    };
    options.client.connect_timeout = Duration::from_secs(1);
    options
}

/// A producer and a consumer on one router, until told to stop.
async fn client_side(seeds: String, shared: Shared, control: Arc<Control>) {
    let router = loop {
        match Router::connect(&seeds, router_options()).await {
            Ok(router) => break Rc::new(router),
            Err(_) => glommio::timer::sleep(Duration::from_millis(200)).await,
        }
    };
    let consumer = glommio::spawn_local(consume(router.clone(), shared.clone(), control.clone()));
    publish(&router, &shared, &control).await;
    consumer.await;
}

async fn publish(router: &Router, shared: &Shared, control: &Control) {
    let mut sequence = 1u64;
    while !control.stop_publishing.load(Ordering::Relaxed) {
        let batch: Vec<PublishMessage> = (0..10u64)
            .map(|i| {
                PublishMessage::new(TOPIC, format!("m-{}", sequence + i))
                    .with_sequence("membership-test", sequence + i)
            })
            .collect();
        if router.publish(&batch, AckLevel::Durable).await.is_ok() {
            with(shared, |r| {
                for m in &batch {
                    r.acked
                        .insert(String::from_utf8_lossy(&m.payload).into_owned());
                }
            });
            sequence += batch.len() as u64;
        }
        glommio::timer::sleep(Duration::from_millis(20)).await;
    }
}

async fn consume(router: Rc<Router>, shared: Shared, control: Arc<Control>) {
    while !control.stop_consuming.load(Ordering::Relaxed) {
        let Ok(subscription) = router.subscribe(TOPIC, GROUP, 64).await else {
            glommio::timer::sleep(Duration::from_millis(100)).await;
            continue;
        };
        subscription.set_ack_level(AckLevel::Durable);
        while !control.stop_consuming.load(Ordering::Relaxed) {
            let batch = futures_lite::future::or(
                async { Some(subscription.recv_batch(64).await) },
                async {
                    glommio::timer::sleep(Duration::from_millis(500)).await;
                    None
                },
            )
            .await;
            let batch = match batch {
                None => continue,
                Some(Err(_)) => break,
                Some(Ok(batch)) => batch,
            };
            let payloads: Vec<String> = batch
                .iter()
                .map(|d| String::from_utf8_lossy(&d.payload).into_owned())
                .collect();
            with(&shared, |r| {
                for p in &payloads {
                    *r.delivered.entry(p.clone()).or_default() += 1;
                    if r.ack_ok.contains(p) {
                        r.after_ack_ok.push(p.clone());
                    }
                }
            });
            let tags: Vec<_> = batch.iter().map(|d| d.tag).collect();
            if let Ok(results) = subscription.ack(&tags).await {
                with(&shared, |r| {
                    for (p, result) in payloads.iter().zip(results) {
                        if result == TagResult::Ok {
                            r.ack_ok.insert(p.clone());
                        }
                    }
                });
            }
        }
    }
}

/// `pinq cluster ...` with `args`; (exit code, stdout, stderr).
fn cluster_cli(args: &[&str]) -> (i32, String, String) {
    let mut full = vec!["cluster"];
    full.extend_from_slice(args);
    support::cli(&full, None)
}

fn status_json(addr: &str) -> serde_json::Value {
    let (code, out, err) = cluster_cli(&["status", "--server", addr, "--json"]);
    assert_eq!(code, 0, "cluster status failed: {err}");
    serde_json::from_str(&out).expect("status --json is JSON")
}

/// The role `status --json` at `addr` gives node `id` ("" when not listed).
fn role_of(addr: &str, id: u64) -> String {
    let status = status_json(addr);
    status["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["id"] == id)
        .and_then(|n| n["role"].as_str())
        .unwrap_or("")
        .to_string()
}

fn voters_in(outcome: &serde_json::Value) -> Vec<Vec<u64>> {
    outcome["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|s| {
            s["voters"]
                .as_array()
                .expect("voters")
                .iter()
                .filter_map(serde_json::Value::as_u64)
                .collect()
        })
        .collect()
}

fn remove(cluster: &mut Cluster, via: u64, node: u64) {
    let started = Instant::now();
    let (code, out, err) = cluster_cli(&[
        "remove-node",
        "--server",
        &cluster.addr(via),
        "--node-id",
        &node.to_string(),
        "--json",
    ]);
    assert_eq!(code, 0, "remove-node {node}: {err}");
    let outcome: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    for voters in voters_in(&outcome) {
        assert!(!voters.contains(&node), "{node} still votes: {out}");
    }
    assert_eq!(
        outcome["retired"], true,
        "node {node} was told to stop: {out}"
    );
    eprintln!("remove-node {node} took {:?}: {out}", started.elapsed());
    let exit = cluster.server_mut(node).wait_exit(STOP_WITHIN);
    assert_eq!(
        exit,
        Some(0),
        "the removed node {node} stops by itself, cleanly"
    );
}

#[test]
fn a_member_is_replaced_and_the_leader_removed_under_load_losing_nothing() {
    let mut cluster = Cluster::new(4, ENV);
    let first = [1, 2, 3];
    let peers = cluster.peers_of(&first);
    let args = first
        .iter()
        .map(|&id| cluster.args(id, &[("--peers", &peers)]))
        .collect();
    cluster.start_nodes(&first, args);
    cluster.wait_for_leader(SHARD, &first, FIRST_ELECTION_TIMEOUT);

    let shared = Shared::default();
    let control = Arc::new(Control::default());
    let seeds = (1..=4)
        .map(|id| cluster.addr(id))
        .collect::<Vec<_>>()
        .join(",");
    let client = {
        let (shared, control) = (shared.clone(), control.clone());
        std::thread::spawn(move || {
            support::on_executor(move || client_side(seeds, shared, control));
        })
    };
    std::thread::sleep(Duration::from_secs(2));

    // An unreachable new node is refused, naming it; nothing changes.
    let (code, _, err) = cluster_cli(&[
        "add-node",
        "--server",
        &cluster.addr(1),
        "--node-id",
        "4",
        "--raft",
        &cluster.member(4).raft.to_string(),
        "--client",
        &cluster.addr(4),
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("node 4 is unreachable"), "{err}");

    // Node 4 joins: a learner, then a voter of every shard.
    let join = cluster.join_args(4, &cluster.addr(2));
    cluster.start_nodes(&[4], vec![join]);
    assert_eq!(
        role_of(&cluster.addr(4), 4),
        "",
        "a joining node is nobody's member yet"
    );
    let started = Instant::now();
    let (code, out, err) = cluster_cli(&[
        "add-node",
        "--server",
        &cluster.addr(1),
        "--node-id",
        "4",
        "--raft",
        &cluster.member(4).raft.to_string(),
        "--client",
        &cluster.addr(4),
        "--json",
    ]);
    assert_eq!(code, 0, "add-node: {err}");
    eprintln!("add-node 4 took {:?}: {out}", started.elapsed());
    let outcome: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    for voters in voters_in(&outcome) {
        assert_eq!(voters, [1, 2, 3, 4], "{out}");
    }
    assert_eq!(role_of(&cluster.addr(1), 4), "voter");
    std::thread::sleep(Duration::from_secs(1));

    // Node 3 goes (3 → 4 → 3 nodes), then whichever node leads now.
    remove(&mut cluster, 1, 3);
    std::thread::sleep(Duration::from_secs(1));
    let leader = cluster.wait_for_leader(SHARD, &[1, 2, 4], FIRST_ELECTION_TIMEOUT);
    let via = [1, 2, 4].into_iter().find(|&id| id != leader).unwrap_or(1);
    remove(&mut cluster, via, leader);
    let rest: Vec<u64> = [1, 2, 4].into_iter().filter(|&id| id != leader).collect();
    cluster.wait_for_leader(SHARD, &rest, FIRST_ELECTION_TIMEOUT);
    std::thread::sleep(Duration::from_secs(1));

    // A removed node refuses to start again, saying why.
    let again = cluster.args(3, &[]);
    let output = std::process::Command::new(support::pinq_bin())
        .arg("serve")
        .args(&again)
        .output()
        .expect("run pinq serve");
    assert!(!output.status.success());
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(said.contains("removed from its cluster"), "{said}");

    // Drain: everything acknowledged arrives; nothing after a durable ACK ok.
    control.stop_publishing.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + DRAIN_LIMIT;
    loop {
        let missing = with(&shared, |r| {
            r.acked
                .iter()
                .filter(|p| !r.delivered.contains_key(*p))
                .count()
        });
        if missing == 0 || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    control.stop_consuming.store(true, Ordering::Relaxed);
    client.join().expect("client side");
    with(&shared, |r| {
        let lost: Vec<&String> = r
            .acked
            .iter()
            .filter(|p| !r.delivered.contains_key(*p))
            .collect();
        let redelivered = r.delivered.values().filter(|n| **n > 1).count();
        eprintln!(
            "{} publishes acknowledged, {} delivered ({} more than once), {} ACKs ok, {} lost, {} after an ACK ok",
            r.acked.len(),
            r.delivered.len(),
            redelivered,
            r.ack_ok.len(),
            lost.len(),
            r.after_ack_ok.len()
        );
        assert!(
            r.acked.len() > 200,
            "the load ran ({} acknowledged)",
            r.acked.len()
        );
        assert!(
            lost.is_empty(),
            "acknowledged publishes lost: {:?}",
            &lost[..lost.len().min(10)]
        );
        assert!(
            r.after_ack_ok.is_empty(),
            "copies delivered after a durable ACK ok: {:?}",
            r.after_ack_ok
        );
    });

    // Two voters left: one may go, the last may not.
    let (last, other) = (rest[0], rest[1]);
    remove(&mut cluster, last, other);
    let (code, _, err) = cluster_cli(&[
        "remove-node",
        "--server",
        &cluster.addr(last),
        "--node-id",
        &last.to_string(),
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("last voter"), "{err}");

    // The membership is stored: restarted with its first, outdated --peers (three voters, two
    // of them gone), the last member follows the stored one (itself alone), leads and serves.
    cluster.kill9(last);
    let outdated = cluster.args(last, &[("--peers", &peers)]);
    cluster.start_nodes(&[last], vec![outdated]);
    cluster.wait_for_leader(SHARD, &[last], FIRST_ELECTION_TIMEOUT);
    let (code, _, err) = support::cli(
        &[
            "publish",
            "--server",
            &cluster.addr(last),
            "--topic",
            TOPIC,
            "--ack",
            "durable",
        ],
        Some("after restart\n"),
    );
    assert_eq!(code, 0, "a publish after the restart: {err}");

    // A member's data directory does not start standalone.
    cluster.kill9(last);
    let dir = cluster.member(last).data_dir.display().to_string();
    let output = std::process::Command::new(support::pinq_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(["--cpus", "0", "--data-dir", &dir])
        .output()
        .expect("run pinq serve");
    assert!(!output.status.success());
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(said.contains("holds a cluster member's data"), "{said}");
}
