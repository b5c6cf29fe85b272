//! A fault campaign (Jepsen style) against three real `pinq serve` processes, each in a network
//! namespace of its own joined by veth pairs to a bridge in a fourth ("hub") namespace.
//!
//! Two clients publish durably (idempotent producers) and consume one group, ACKing `durable`:
//! side A from the hub namespace, side B from node 3's namespace, so when node 3 is cut off
//! B is on the minority side and A on the majority side. Every ~10 s one fault: kill -9 of the
//! leader or a follower (restarted 3 s later), SIGSTOP of the leader or a follower for 3-5 s, or
//! the leader or node 3 cut off for 4-6 s (its veth in the hub set down). Then everything is
//! healed and the group drained. The campaign checks, and prints:
//!
//! - acknowledged publishes lost = 0 (each one delivered at least once);
//! - copies delivered after a `durable` ACK of that message was answered `ok` = 0;
//! - the `attempt` of a message never goes down from one delivery to the next;
//! - exactly one leader of the shard at the end, which every node names;
//! - no panic in any node's log.
//!
//! It runs `PINQ_CAMPAIGN_SECS` seconds of faults (60 by default; `perf/campaign.sh` runs 300)
//! and needs root and `ip netns`: without them it prints why and passes without running.
//! Every address is inside the namespaces it makes; processes are stopped by their pid and the
//! namespaces deleted at the end, on failure too (`Drop`). No assertion is about speed: the
//! longest gap between acknowledged publishes is printed, not checked.

mod support;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, PublishMessage, Router, RouterOptions, TagResult};
use pinq::key::EventKey;

/// Seconds of faults when `PINQ_CAMPAIGN_SECS` is unset.
const DEFAULT_SECS: u64 = 60;
/// One fault starts every this often.
const FAULT_PERIOD: Duration = Duration::from_secs(10);
/// How long the drain after the faults may take before what is missing counts as lost.
const DRAIN_LIMIT: Duration = Duration::from_secs(90);
/// The drain ends this long after the last delivery once everything acknowledged arrived.
const DRAIN_QUIET: Duration = Duration::from_secs(3);
const TOPIC: &str = "campaign";
const GROUP: &str = "workers";
const NODES: u64 = 3;
/// Messages per publish batch, and the pause between a side's batches.
const BATCH: usize = 10;
const BATCH_PAUSE: Duration = Duration::from_millis(20);

/// The consumers' ACK level: `durable`, unless `PINQ_CAMPAIGN_ACK_LEVEL=leader` (which shows
/// that the check of copies delivered after an ACK answered ok catches what `leader` allows).
fn ack_level() -> AckLevel {
    match std::env::var("PINQ_CAMPAIGN_ACK_LEVEL").as_deref() {
        Ok("leader") => AckLevel::Leader,
        _ => AckLevel::Durable,
    }
}

fn campaign_secs() -> u64 {
    std::env::var("PINQ_CAMPAIGN_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SECS)
}

/// Why the campaign cannot run here, if it cannot.
fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root: network namespaces need CAP_SYS_ADMIN".into());
    }
    match Command::new("ip").args(["netns", "list"]).output() {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "`ip netns list` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!("`ip` is not available: {e}")),
    }
}

/// Runs `ip ARGS`; panics with its error output if it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// The namespaces and links of one campaign; deleted on drop.
struct Net {
    tag: String,
    made: Vec<String>,
}

impl Net {
    fn hub(&self) -> String {
        format!("{}hub", self.tag)
    }

    fn node_ns(&self, id: u64) -> String {
        format!("{}n{id}", self.tag)
    }

    fn create(tag: String) -> Net {
        let mut net = Net {
            tag,
            made: Vec::new(),
        };
        let hub = net.hub();
        ip(&["netns", "add", &hub]);
        net.made.push(hub.clone());
        ip(&["-n", &hub, "link", "set", "lo", "up"]);
        ip(&["-n", &hub, "link", "add", "pqbr", "type", "bridge"]);
        ip(&["-n", &hub, "addr", "add", "10.77.0.254/24", "dev", "pqbr"]);
        ip(&["-n", &hub, "link", "set", "pqbr", "up"]);
        for id in 1..=NODES {
            let ns = net.node_ns(id);
            ip(&["netns", "add", &ns]);
            net.made.push(ns.clone());
            let (h, v) = (format!("h{id}"), format!("v{id}"));
            ip(&[
                "-n", &hub, "link", "add", &h, "type", "veth", "peer", "name", &v,
            ]);
            ip(&["-n", &hub, "link", "set", &v, "netns", &ns]);
            ip(&["-n", &hub, "link", "set", &h, "master", "pqbr"]);
            ip(&["-n", &hub, "link", "set", &h, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("10.77.0.{id}/24"),
                "dev",
                &v,
            ]);
            ip(&["-n", &ns, "link", "set", &v, "up"]);
        }
        net
    }

    /// Cuts node `id` off from every other node and from side A (its link to the bridge down).
    fn cut(&self, id: u64) {
        ip(&["-n", &self.hub(), "link", "set", &format!("h{id}"), "down"]);
    }

    fn heal(&self, id: u64) {
        ip(&["-n", &self.hub(), "link", "set", &format!("h{id}"), "up"]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Runs `f` on a thread of its own inside network namespace `ns` (threads it starts, glommio
/// executors included, inherit the namespace).
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = PathBuf::from("/var/run/netns").join(ns);
    std::thread::spawn(move || {
        enter_ns(&path);
        f()
    })
    .join()
    .expect("namespace thread")
}

fn enter_ns(path: &Path) {
    let file = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    use std::os::fd::AsRawFd;
    // SAFETY: a valid namespace file descriptor; setns changes only this thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(
        rc,
        0,
        "setns {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

fn client_addr(id: u64) -> String {
    format!("10.77.0.{id}:7400")
}

fn seeds() -> String {
    (1..=NODES).map(client_addr).collect::<Vec<_>>().join(",")
}

/// One member: its process (run with `ip netns exec`, which execs pinq: the pid is pinq's).
struct Node {
    id: u64,
    ns: String,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    stopped: bool,
}

impl Node {
    fn start(&mut self) {
        let peers = (1..=NODES)
            .map(|i| format!("{i}=10.77.0.{i}:7500"))
            .collect::<Vec<_>>()
            .join(",");
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("node log");
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns, support::pinq_bin(), "serve"])
            .args(["--cpus", &((self.id - 1) % 2).to_string()])
            .args(["--node-id", &self.id.to_string()])
            .args(["--raft-listen", &format!("10.77.0.{}:7500", self.id)])
            .args(["--peers", &peers])
            .args(["--listen", &client_addr(self.id)])
            .args(["--metrics-listen", &format!("10.77.0.{}:9400", self.id)])
            .arg("--data-dir")
            .arg(&self.data_dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start pinq serve");
        self.child = Some(child);
        self.stopped = false;
    }

    fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .args([&format!("-{signal}"), &child.id().to_string()])
                .status();
        }
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.stopped = false;
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.stopped {
            self.signal("CONT");
        }
        self.kill9();
    }
}

/// What the clients saw, in the order they saw it.
#[derive(Default)]
struct Records {
    /// Payload of each acknowledged publish, and when its `ok` came.
    acked: HashMap<String, Instant>,
    events: Vec<Event>,
}

enum Event {
    Delivered {
        key: EventKey,
        payload: String,
        attempt: u32,
        side: Side,
        at: Instant,
    },
    /// A `durable` ACK of this message was answered `ok`.
    AckOk {
        key: EventKey,
        side: Side,
        at: Instant,
    },
}

/// Which client side saw an event ("A" or "B").
type Side = &'static str;

type Shared = Arc<Mutex<Records>>;

fn record(shared: &Shared, f: impl FnOnce(&mut Records)) {
    f(&mut shared.lock().unwrap_or_else(|e| e.into_inner()));
}

/// Flags the main thread gives the client sides.
#[derive(Default)]
struct Control {
    stop_publishing: AtomicBool,
    stop_consuming: AtomicBool,
}

fn router_options() -> RouterOptions {
    let mut options = RouterOptions {
        patience: Duration::from_secs(3),
        // A paused or cut-off leader answers nothing: the gap a client sees is at least this
        // (a try that times out is sent again elsewhere, deduplicated by its producer sequence).
        request_timeout: Duration::from_secs(1),
        ..RouterOptions::default()
    };
    options.client.connect_timeout = Duration::from_secs(1);
    options
}

/// One client side: a publisher and a consumer sharing a router, until told to stop.
async fn client_side(name: String, shared: Shared, control: Arc<Control>) {
    let router = loop {
        match Router::connect(&seeds(), router_options()).await {
            Ok(router) => break Rc::new(router),
            Err(_) if !control.stop_consuming.load(Ordering::Relaxed) => {
                glommio::timer::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => return,
        }
    };
    let side: Side = if name == "A" { "A" } else { "B" };
    let consumer = glommio::spawn_local(consume(
        router.clone(),
        side,
        shared.clone(),
        control.clone(),
    ));
    publish(&router, &name, &shared, &control).await;
    consumer.await;
}

async fn publish(router: &Router, name: &str, shared: &Shared, control: &Control) {
    let producer = format!("campaign-{name}");
    let mut sequence = 1u64;
    while !control.stop_publishing.load(Ordering::Relaxed) {
        let batch: Vec<PublishMessage> = (0..BATCH as u64)
            .map(|i| {
                PublishMessage::new(TOPIC, format!("{name}-{}", sequence + i))
                    .with_sequence(producer.clone(), sequence + i)
            })
            .collect();
        if router.publish(&batch, AckLevel::Durable).await.is_ok() {
            let now = Instant::now();
            record(shared, |r| {
                for m in &batch {
                    r.acked
                        .insert(String::from_utf8_lossy(&m.payload).into_owned(), now);
                }
            });
            sequence += BATCH as u64;
        }
        // A failed batch is sent again with the same sequences (deduplicated if it was stored).
        glommio::timer::sleep(BATCH_PAUSE).await;
    }
}

async fn consume(router: Rc<Router>, side: Side, shared: Shared, control: Arc<Control>) {
    while !control.stop_consuming.load(Ordering::Relaxed) {
        let Ok(subscription) = router.subscribe(TOPIC, GROUP, 64).await else {
            glommio::timer::sleep(Duration::from_millis(100)).await;
            continue;
        };
        subscription.set_ack_level(ack_level());
        let mut idle = Duration::ZERO;
        while !control.stop_consuming.load(Ordering::Relaxed) {
            let wait = Duration::from_millis(500);
            let batch = futures_lite::future::or(
                async { Some(subscription.recv_batch(64).await) },
                async {
                    glommio::timer::sleep(wait).await;
                    None
                },
            )
            .await;
            let batch = match batch {
                None => {
                    // Silent for long (its node may be cut off): subscribe again.
                    idle += wait;
                    if idle >= Duration::from_secs(5) {
                        break;
                    }
                    continue;
                }
                Some(Err(_)) => break,
                Some(Ok(batch)) => batch,
            };
            idle = Duration::ZERO;
            record(&shared, |r| {
                let at = Instant::now();
                for d in &batch {
                    r.events.push(Event::Delivered {
                        key: d.tag,
                        payload: String::from_utf8_lossy(&d.payload).into_owned(),
                        attempt: d.attempt,
                        side,
                        at,
                    });
                }
            });
            let tags: Vec<EventKey> = batch.iter().map(|d| d.tag).collect();
            if let Ok(results) = subscription.ack(&tags).await {
                record(&shared, |r| {
                    let at = Instant::now();
                    for (tag, result) in tags.iter().zip(results) {
                        if result == TagResult::Ok {
                            r.events.push(Event::AckOk {
                                key: *tag,
                                side,
                                at,
                            });
                        }
                    }
                });
            }
        }
    }
}

/// Starts a client side on its own thread inside `ns`.
fn start_side(
    ns: String,
    name: &str,
    shared: Shared,
    control: Arc<Control>,
) -> std::thread::JoinHandle<()> {
    let name = name.to_owned();
    let path = PathBuf::from("/var/run/netns").join(ns);
    std::thread::spawn(move || {
        enter_ns(&path);
        support::on_executor(move || client_side(name, shared, control));
    })
}

/// The cluster as seen from the hub: which nodes claim to lead the shard, and whom each
/// answering node names as leader.
fn leadership(net: &Net) -> (Vec<u64>, Vec<u64>) {
    let mut claimed = Vec::new();
    let mut named = Vec::new();
    for id in 1..=NODES {
        let status = in_ns(&net.hub(), move || {
            support::cluster::status_of(client_addr(id), Duration::from_secs(1))
        });
        if let Some(status) = status {
            if let Some(shard) = status.shards.iter().find(|s| s.shard_id == 0) {
                named.push(shard.leader_node_id);
                if shard.leader_node_id == id {
                    claimed.push(id);
                }
            }
        }
    }
    (claimed, named)
}

/// The current leader, if one node claims it within `limit`.
fn find_leader(net: &Net, limit: Duration) -> Option<u64> {
    let deadline = Instant::now() + limit;
    loop {
        if let [leader] = leadership(net).0[..] {
            return Some(leader);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    KillLeader,
    StopLeader,
    CutLeader,
    KillFollower,
    StopFollower,
    /// Node 3, whatever its role: side B is cut off with it.
    CutNode3,
}

const FAULTS: [Fault; 6] = [
    Fault::KillLeader,
    Fault::StopLeader,
    Fault::CutLeader,
    Fault::KillFollower,
    Fault::StopFollower,
    Fault::CutNode3,
];

/// Injects `fault` and heals it; returns what was done.
fn inject(fault: Fault, nodes: &mut [Node], net: &Net, rng: &mut fastrand::Rng) -> String {
    let leader = find_leader(net, Duration::from_secs(2));
    let followers: Vec<u64> = (1..=NODES).filter(|&id| Some(id) != leader).collect();
    let follower = followers[rng.usize(..followers.len())];
    let target = match fault {
        Fault::KillLeader | Fault::StopLeader | Fault::CutLeader => leader.unwrap_or(1),
        Fault::KillFollower | Fault::StopFollower => follower,
        Fault::CutNode3 => 3,
    };
    let node = &mut nodes[(target - 1) as usize];
    let held = match fault {
        Fault::KillLeader | Fault::KillFollower => {
            node.kill9();
            let down = Duration::from_secs(3);
            std::thread::sleep(down);
            node.start();
            down
        }
        Fault::StopLeader | Fault::StopFollower => {
            node.signal("STOP");
            node.stopped = true;
            let pause = Duration::from_millis(rng.u64(3000..=5000));
            std::thread::sleep(pause);
            node.signal("CONT");
            node.stopped = false;
            pause
        }
        Fault::CutLeader | Fault::CutNode3 => {
            net.cut(target);
            let cut = Duration::from_millis(rng.u64(4000..=6000));
            std::thread::sleep(cut);
            net.heal(target);
            cut
        }
    };
    format!("{fault:?} node {target} (leader was {leader:?}) for {held:?}")
}

/// What the campaign found.
#[derive(Debug, Default)]
struct Findings {
    acked: usize,
    deliveries: usize,
    lost: Vec<String>,
    delivered_after_durable_ack: usize,
    /// Each copy delivered after an ACK answered ok: payload, attempt, sides, time after.
    examples: Vec<String>,
    attempt_decreases: usize,
    longest_publish_gap: Duration,
    /// The five longest gaps between acknowledged publishes, and where they began.
    longest_gaps: Vec<String>,
}

/// The findings of a campaign whose faults began at `started`.
fn judge(records: &Records, started: Instant) -> Findings {
    let mut delivered = HashSet::new();
    let mut acked_ok: HashMap<EventKey, (Side, Instant)> = HashMap::new();
    let mut last_attempt: HashMap<EventKey, u32> = HashMap::new();
    let mut findings = Findings {
        acked: records.acked.len(),
        ..Findings::default()
    };
    for event in &records.events {
        match event {
            Event::Delivered {
                key,
                payload,
                attempt,
                side,
                at,
            } => {
                findings.deliveries += 1;
                delivered.insert(payload.as_str());
                if let Some((acked_by, acked_at)) = acked_ok.get(key) {
                    findings.delivered_after_durable_ack += 1;
                    findings.examples.push(format!(
                        "{payload} attempt {attempt} to side {side} at {:.1} s, {:?} after side \
                         {acked_by}'s ACK ok",
                        at.saturating_duration_since(started).as_secs_f64(),
                        at.saturating_duration_since(*acked_at)
                    ));
                }
                let last = last_attempt.entry(*key).or_insert(0);
                if *attempt < *last {
                    findings.attempt_decreases += 1;
                }
                *last = (*last).max(*attempt);
            }
            Event::AckOk { key, side, at } => {
                acked_ok.insert(*key, (*side, *at));
            }
        }
    }
    findings.lost = records
        .acked
        .keys()
        .filter(|p| !delivered.contains(p.as_str()))
        .cloned()
        .collect();
    findings.lost.sort();
    let mut times: Vec<Instant> = records.acked.values().copied().collect();
    times.sort();
    let mut gaps: Vec<(Duration, Instant)> =
        times.windows(2).map(|w| (w[1] - w[0], w[0])).collect();
    gaps.sort_by_key(|g| std::cmp::Reverse(g.0));
    findings.longest_publish_gap = gaps.first().map_or(Duration::ZERO, |g| g.0);
    findings.longest_gaps = gaps
        .iter()
        .take(5)
        .map(|(gap, from)| {
            format!(
                "{:.2} s from {:.1} s",
                gap.as_secs_f64(),
                from.saturating_duration_since(started).as_secs_f64()
            )
        })
        .collect();
    findings
}

/// The longest gap between acknowledged publishes that began within a fault's period, per kind
/// of fault (the first word of its description), e.g. `KillLeader 1.21 s`.
fn gaps_by_fault(records: &Records, started: Instant, done: &[(f64, String)]) -> Vec<String> {
    let mut times: Vec<f64> = records
        .acked
        .values()
        .map(|t| t.saturating_duration_since(started).as_secs_f64())
        .collect();
    times.sort_by(f64::total_cmp);
    let mut by_kind: Vec<(String, f64)> = Vec::new();
    for (at, what) in done {
        let kind = what.split_whitespace().next().unwrap_or("?").to_owned();
        let end = at + FAULT_PERIOD.as_secs_f64();
        let longest = times
            .windows(2)
            .filter(|w| w[0] >= *at && w[0] < end)
            .map(|w| w[1] - w[0])
            .fold(0.0, f64::max);
        match by_kind.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, gap)) => *gap = gap.max(longest),
            None => by_kind.push((kind, longest)),
        }
    }
    by_kind
        .iter()
        .map(|(kind, gap)| format!("{kind} {gap:.2} s"))
        .collect()
}

/// Whether every acknowledged publish has been delivered.
fn all_delivered(records: &Records) -> bool {
    let delivered: HashSet<&str> = records
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Delivered { payload, .. } => Some(payload.as_str()),
            Event::AckOk { .. } => None,
        })
        .collect();
    records.acked.keys().all(|p| delivered.contains(p.as_str()))
}

/// Lines that report a panic, in every node's log.
fn panics(nodes: &[Node]) -> Vec<String> {
    nodes
        .iter()
        .flat_map(|n| {
            std::fs::read_to_string(&n.log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("panicked"))
                .map(|l| format!("node {}: {l}", n.id))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Waits until exactly one node claims the shard and every node names it.
fn settled_leader(net: &Net, limit: Duration) -> Result<u64, String> {
    let deadline = Instant::now() + limit;
    loop {
        let (claimed, named) = leadership(net);
        if let [leader] = claimed[..] {
            if named.len() == NODES as usize && named.iter().all(|&n| n == leader) {
                return Ok(leader);
            }
        }
        if Instant::now() >= deadline {
            return Err(format!("claimed by {claimed:?}, named {named:?}"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

// The short version (60 s) runs in the default suite; `perf/campaign.sh SECS` runs it longer.
// A 240 s run on 95261e3 delivered 64 copies again after their durable ACK was answered ok:
// copies whose lease ran out while they were still on their way through a cut network (leases
// now start at the receipt; see README, Decisions → Delivery).
#[test]
fn fault_campaign_loses_no_acknowledged_publish_and_redelivers_no_durably_acked_copy() {
    if let Some(reason) = skip_reason() {
        println!("fault campaign skipped: {reason}");
        return;
    }
    let secs = campaign_secs();
    let seed = std::env::var("PINQ_CAMPAIGN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!(
        "fault campaign: {secs} s of faults, consumers ACK {:?}, seed {seed} \
         (PINQ_CAMPAIGN_SEED replays the choices)",
        ack_level()
    );
    let mut rng = fastrand::Rng::with_seed(seed);
    let tmp = tempfile::tempdir().expect("temp dir");
    let net = Net::create(format!("pq{}", std::process::id()));
    let mut nodes: Vec<Node> = (1..=NODES)
        .map(|id| Node {
            id,
            ns: net.node_ns(id),
            data_dir: tmp.path().join(format!("node{id}")),
            log: tmp.path().join(format!("node{id}.log")),
            child: None,
            stopped: false,
        })
        .collect();
    for node in &mut nodes {
        node.start();
    }
    let first = find_leader(&net, Duration::from_secs(30));
    assert!(
        first.is_some(),
        "no first leader within 30 s: {:?}",
        panics(&nodes)
    );

    let shared: Shared = Arc::default();
    let control = Arc::new(Control::default());
    let sides = vec![
        start_side(net.hub(), "A", shared.clone(), control.clone()),
        start_side(net.node_ns(3), "B", shared.clone(), control.clone()),
    ];
    let started = Instant::now();
    let mut done = Vec::new();
    let mut round = 0usize;
    while started.elapsed() < Duration::from_secs(secs) {
        let round_start = Instant::now();
        let fault = FAULTS[round % FAULTS.len()];
        let at = started.elapsed().as_secs_f64();
        let what = inject(fault, &mut nodes, &net, &mut rng);
        println!("  {at:>5.1} s  {what}");
        done.push((at, what));
        round += 1;
        if let Some(rest) = FAULT_PERIOD.checked_sub(round_start.elapsed()) {
            std::thread::sleep(rest);
        }
    }

    let faulted = started.elapsed();
    control.stop_publishing.store(true, Ordering::Relaxed);
    let drain_start = Instant::now();
    let mut seen = (0, Instant::now());
    while drain_start.elapsed() < DRAIN_LIMIT {
        let (all_delivered, events) = {
            let records = shared.lock().unwrap_or_else(|e| e.into_inner());
            (all_delivered(&records), records.events.len())
        };
        if events != seen.0 {
            seen = (events, Instant::now());
        }
        // Everything acknowledged arrived, and nothing more (a redelivery) for a while.
        if all_delivered && seen.1.elapsed() >= DRAIN_QUIET {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let drain = drain_start.elapsed();
    control.stop_consuming.store(true, Ordering::Relaxed);
    for side in sides {
        side.join().expect("client side");
    }
    let leader = settled_leader(&net, Duration::from_secs(20));
    let panics = panics(&nodes);
    if let Ok(dir) = std::env::var("PINQ_CAMPAIGN_LOG_DIR") {
        // The nodes' logs outlive the temporary directory, for a failed run's post-mortem.
        let _ = std::fs::create_dir_all(&dir);
        for node in &nodes {
            let _ = std::fs::copy(
                &node.log,
                Path::new(&dir).join(format!("node{}.log", node.id)),
            );
        }
    }
    let records = shared.lock().unwrap_or_else(|e| e.into_inner());
    let findings = judge(&records, started);
    println!(
        "fault campaign: {} faults in {:.0} s; acknowledged publishes {}, deliveries {}, lost {}, \
         delivered after a durable ACK ok {}, attempt decreases {}, leader at the end {leader:?}, \
         panics {}, drain {drain:.1?}, longest gap between acknowledged publishes {:.2?}",
        done.len(),
        faulted.as_secs_f64(),
        findings.acked,
        findings.deliveries,
        findings.lost.len(),
        findings.delivered_after_durable_ack,
        findings.attempt_decreases,
        panics.len(),
        findings.longest_publish_gap,
    );
    println!("longest gaps: {}", findings.longest_gaps.join(", "));
    println!(
        "longest gap after each kind of fault: {}",
        gaps_by_fault(&records, started, &done).join(", ")
    );
    assert!(findings.acked > 0, "no publish was acknowledged at all");
    assert!(
        findings.lost.is_empty(),
        "{} acknowledged publishes never delivered, e.g. {:?}",
        findings.lost.len(),
        &findings.lost[..findings.lost.len().min(10)]
    );
    assert_eq!(
        findings.delivered_after_durable_ack,
        0,
        "copies delivered after their durable ACK was answered ok: {:?}",
        &findings.examples[..findings.examples.len().min(20)]
    );
    assert_eq!(
        findings.attempt_decreases, 0,
        "a message's attempt went down"
    );
    assert!(leader.is_ok(), "no single leader at the end: {leader:?}");
    assert!(panics.is_empty(), "panics in the logs: {panics:?}");
}
