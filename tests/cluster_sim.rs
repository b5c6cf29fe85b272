//! A deterministic, seeded simulation of one shard's Raft group on three nodes (issue 10, item 7),
//! in the style of raft-rs's harness and TigerBeetle's simulator: the real driver core
//! ([`Replica`] over tikv's `raft`) on every node, with a simulated clock, disk and network that
//! inject faults, and a model of the broker's clients and dispatcher on top. A failing seed
//! replays exactly: `PINQ_SIM_SEED=<n> cargo test --release --test cluster_sim <test>`;
//! `PINQ_SIM_SEEDS=<count>` runs more seeds; `PINQ_SIM_TRACE=1` prints every message sent and
//! `PINQ_SIM_RAFT_LOG=1` the raft core's log (its INFO lines: release builds drop DEBUG).
//!
//! What is modelled (time is in simulated milliseconds; one step is one millisecond):
//!
//! - **Clock**: each node ticks its replica every 8–12 ms (its own rate, so clocks drift) with
//!   ±1 ms of jitter; a paused node (SIGSTOP) neither ticks nor handles anything until resumed.
//! - **Disk**: records appended through the [`RecordSink`] are volatile until an fdatasync,
//!   started when the previous one completes, completes 1–8 ms later and covers every record
//!   appended before it started (group commit). Then [`Replica::durable`] releases the messages
//!   that waited for it. A crash loses every record not covered by a completed fdatasync.
//! - **State machine**: a set of stored keys, applying [`Command`]s in index order (`Store`
//!   inserts, `Delete` removes). It is durable the way the engine's tables are: now and then it
//!   *flushes* (a copy at its applied index survives a crash), and a restarted node starts from
//!   the flushed copy, `Replica::new(config, log, flushed_index)`, and re-applies the committed
//!   entries after it. So recovery exercises both the WAL's records and a lagging applied index.
//! - **Restart**: the `RaftLog` is rebuilt by [`RaftLog::apply_record`] over the synced records.
//! - **Network**: each message is delayed 1–15 ms (some 15–150 ms, so they reorder), dropped
//!   or duplicated. Partitions (one node isolated both ways, or one link cut one way) heal after
//!   0.1–1 s. A crashed node's incoming messages are lost.
//! - **Faults** are drawn per seed (swarm testing): up to 15% of messages dropped, 8%
//!   duplicated, 5% slow, and per millisecond up to 0.4% a crash (down 20–600 ms), 0.2% a
//!   pause (up to 400 ms), 0.4% a partition, 0.1% a full disk (100–800 ms). A full disk fails
//!   the node's next write; its driver stops, which the broker's one failure rule turns into
//!   a stopped node ([`Replica::fail`] first: from that instant it hands out nothing); it is
//!   started again once space is back.
//! - **Clients**: a publisher sends `Store` commands of new keys to a node that serves (a stale
//!   leader too, if it still believes it leads); a publish is *acknowledged durable* when the
//!   proposing node applies that entry (same index and term, so it is committed). Every node
//!   that believes it serves runs a model of the broker's pipeline for one consumer connected
//!   to it (so a node cut off with its consumer is the minority side of a partition): dispatch
//!   passes queue stored keys, the pump (credit returned) hands queued copies out, a copy not
//!   ACKed within the in-flight timeout is redelivered, and after `MAX_DELIVERIES` it is
//!   dead-lettered. The consumer ACKs some copies, which the leader proposes as `Delete`s. A
//!   node that starts serving (or restarts) starts with an empty in-flight table, as the broker
//!   does. **Every hand-out** (pump, redelivery, dead letter; and every dispatch pass) asks the
//!   leadership core at that moment (`Replica::may_hand_out(now)`), as the broker's paths do;
//!   heartbeats leave stamped with their send time (`Replica::stamp`).
//! - **Compaction** (one test): every node now and then compacts its log to the lowest follower
//!   match a leader saw, never past its own flushed state machine, and writes a `Checkpoint`
//!   record; so no node ever needs a snapshot, which `RaftLog` does not build yet.
//! - **Snapshots** (one test): compaction keeps only `SNAPSHOT_RETAIN_ENTRIES` past a node's
//!   flushed state, so a follower behind gets the leader's state machine as a snapshot, and
//!   installs it in the order `ReplicatedStore::install_snapshot` does: (1) the install marker
//!   (`snapshot-in/INSTALLING`, naming the staged file, both durable and kept across crashes);
//!   (2) the state machine forgets its state, takes the file's, flushes; (3) the checkpoint and
//!   the Ready's records are appended and made durable; (4) the marker goes. A crash may come at
//!   every [`CrashPoint`] between these, including in the middle of (2), where a memtable flush
//!   leaves a flushed state partly old and partly new, at the old index or the snapshot's. A
//!   restart with a marker does what `ReplicatedStore::open` and `finish_interrupted_install`
//!   do: the log is resumed at the snapshot by the driver's own pure `resume_log`, the file is
//!   loaded again, the checkpoint made durable and the marker removed, with crash points of its
//!   own; a node never runs with a marker, and without one its flushed state is never past
//!   its log.
//!
//! Invariants, checked as the run goes and once more after healing everything and letting the
//! cluster settle:
//!
//! 1. no durable-acknowledged publish is lost: when a node starts serving, and at the end on
//!    every node, each acknowledged key is in the state machine unless a committed `Delete`
//!    removed it (and the node applied through the acknowledged index);
//! 2. nothing is delivered after its delete committed: a leader never delivers a key whose
//!    `Delete` is at or below its applied index, and no `Store` of a key is applied after a
//!    `Delete` of it (a deleted key never comes back, on any node, across crashes);
//! 3. at most one leader, and at most one *serving* leader, per term;
//! 4. every node's applied state is the same at the same index: the entry (term, checksum) and a
//!    hash of the state machine after applying it are recorded by the first node to apply that
//!    index and compared on every other node and on every re-application after a restart.
//!
//! 5. the lease: no copy is handed out by a leader after any node knew an entry of a newer
//!    term committed, and no copy of a key is handed out once its `Delete` (its durable ACK)
//!    is committed — through pauses, partitions with the consumer on the minority side,
//!    crashes and full disks. With the lease check off (the control test) seeds do break it,
//!    so the assertion is not one that cannot fail.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use pinq::cluster::raft_log::RaftLog;
use pinq::cluster::record::RaftRecord;
use pinq::cluster::replica::{carries_command, quiet_logger, RecordSink, Replica, ReplicaConfig};
use pinq::cluster::snapshot::{resume_log, InstallPoint};
use pinq::key::{EventKey, TopicHash};
use pinq::log::command::Command;
use pinq::message::Value;
use raft::eraftpb::{Entry, Message, MessageType};

const NODE_COUNT: u64 = 3;
const ELECTION_TICKS: usize = 10;
const HEARTBEAT_TICKS: usize = 2;
/// Small, so a follower catching up gets several append messages.
const MESSAGE_BYTES_MAX: u64 = 2048;
const INFLIGHT_MESSAGES_MAX: usize = 16;

const TICK_MS_MIN: u64 = 8;
const TICK_MS_MAX: u64 = 12;
const FSYNC_MS_MAX: u64 = 8;
const NET_DELAY_MS_MAX: u64 = 15;
const NET_SLOW_DELAY_MS_MAX: u64 = 150;

/// Probabilities, in per mille (per message, or per node or per run per millisecond). Faults
/// are drawn per seed up to these maxima (swarm testing: some seeds lose many messages and
/// never crash, others crash often on a clean network).
const NET_SLOW_PERMILLE_MAX: u32 = 50;
const NET_DROP_PERMILLE_MAX: u32 = 150;
const NET_DUP_PERMILLE_MAX: u32 = 80;
const CRASH_PERMILLE_MAX: u32 = 4;
const PAUSE_PERMILLE_MAX: u32 = 2;
const PARTITION_PERMILLE_MAX: u32 = 4;
const PUBLISH_PERMILLE: u32 = 150;
const DISPATCH_PERMILLE: u32 = 100;
const FLUSH_PERMILLE: u32 = 10;
const COMPACT_PERMILLE: u32 = 20;
/// With snapshots: log entries kept past a node's flushed state.
const SNAPSHOT_RETAIN_ENTRIES: u64 = 20;
/// With snapshots: a crash at each step of a snapshot's install (each [`CrashPoint`]).
const SNAPSHOT_CRASH_PERMILLE: u32 = 150;

/// A node's disk fills up (per node per millisecond, at most), for a while.
const DISK_FULL_PERMILLE_MAX: u32 = 1;
const DISK_FULL_MS_MIN: u64 = 100;
const DISK_FULL_MS_MAX: u64 = 800;
/// A consumer returns credit (the pump hands out what is queued for it).
const PUMP_PERMILLE: u32 = 200;
/// The consumer's window (`queueSize`): copies out and not ACKed at most; the pump hands out
/// more only as ACKs free room, so hand-outs go on all the time there is a backlog.
const CONSUMER_WINDOW: usize = 6;
/// After a pause, the node's timers may run before it reads what waited in its sockets: held
/// messages arrive up to this long after it resumes.
const RESUME_SOCKET_LAG_MS_MAX: u64 = 30;
/// A consumer ACKs one handed-out copy (per millisecond: about 50 ms per copy, so some outlive
/// the in-flight timeout).
const ACK_PERMILLE: u32 = 20;
/// Every key divisible by this is a poison message its consumer never ACKs: redelivered, then
/// dead-lettered.
const POISON_EVERY: u64 = 8;
/// A copy handed out and not ACKed within this is redelivered (the in-flight timeout).
const REDELIVER_AFTER_MS: u64 = 120;
/// A copy whose next delivery would pass this is dead-lettered instead (`maxDeliveries`).
const MAX_DELIVERIES: u32 = 3;
/// The leader's lease: the broker's formula, half the election timeout at the nominal tick.
const LEASE_MS: u64 = (TICK_MS_MIN + TICK_MS_MAX) / 2 * ELECTION_TICKS as u64 / 2;

const DOWN_MS_MIN: u64 = 20;
const DOWN_MS_MAX: u64 = 600;
const PAUSE_MS_MAX: u64 = 400;
const PARTITION_MS_MIN: u64 = 100;
const PARTITION_MS_MAX: u64 = 1000;
const PUBLISH_KEYS_MAX: usize = 3;
const DELIVER_KEYS_MAX: usize = 4;

/// Milliseconds with faults per run, then healing.
const FAULT_MS: u64 = 3000;
/// How long a healed cluster may take to settle (a liveness bound: it must).
const SETTLE_MS_MAX: u64 = 10_000;

const TOPIC: TopicHash = TopicHash(0x5157);

fn config(id: u64) -> ReplicaConfig {
    ReplicaConfig {
        id,
        voters: (1..=NODE_COUNT).collect(),
        election_ticks: ELECTION_TICKS,
        heartbeat_ticks: HEARTBEAT_TICKS,
        max_message_bytes: MESSAGE_BYTES_MAX,
        max_inflight_messages: INFLIGHT_MESSAGES_MAX,
        lease_ms: LEASE_MS,
    }
}

fn key_of(id: u64) -> EventKey {
    EventKey::new(TOPIC, 0, id)
}

/// splitmix64's finaliser: the per-key term of the state machine's hash.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A node's disk: the WAL's records, of which a prefix is synced.
#[derive(Default)]
struct Disk {
    records: Vec<RaftRecord>,
    /// Records `[0, synced)` survive a crash.
    synced: usize,
    /// The fdatasync in flight: when it completes, and the records it covers.
    fsync: Option<(u64, usize)>,
    /// No space left: every write fails.
    full: bool,
}

/// A write failed for lack of space.
#[derive(Debug)]
struct DiskFull;

impl RecordSink for Disk {
    type Error = DiskFull;
    /// The sequence number is the record's position, 1-based.
    fn append(&mut self, record: &RaftRecord) -> Result<u64, Self::Error> {
        if self.full {
            return Err(DiskFull);
        }
        self.records.push(record.clone());
        Ok(self.records.len() as u64)
    }
}

/// The model state machine: the stored keys, and an order-independent hash of them.
#[derive(Clone, Default, PartialEq, Eq)]
struct StateMachine {
    keys: BTreeSet<u64>,
    applied: u64,
    hash: u64,
}

impl StateMachine {
    fn insert(&mut self, id: u64) {
        if self.keys.insert(id) {
            self.hash ^= mix(id);
        }
    }

    fn remove(&mut self, id: u64) {
        if self.keys.remove(&id) {
            self.hash ^= mix(id);
        }
    }
}

/// A proposal a node made and waits to see applied.
struct Proposal {
    term: u64,
    data: Vec<u8>,
    command: Command,
}

/// Where one copy of a message is, on the leader that dispatched it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CopyAt {
    /// Assigned to the consumer by a dispatch pass, waiting in its queue for the pump.
    Queued,
    /// Handed out at this time, not ACKed yet.
    Out { since_ms: u64 },
    /// Its ACK (a `Delete`) is proposed.
    Acking,
}

/// How a copy left the broker (the hand-out paths of `src/server/shard.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HandOut {
    /// The pump, on credit returned or after a dispatch pass: a first delivery.
    Pump,
    /// The pump, for a copy whose in-flight timeout ran out.
    Redelivery,
    /// To the dead-letter topic, after `MAX_DELIVERIES`.
    DeadLetter,
}

/// A serving leader's pipeline as far as hand-outs go: its in-flight table for the one
/// consumer it serves (a consumer connected to this node, on whichever side of a partition).
#[derive(Default)]
struct Dispatch {
    term: u64,
    copies: BTreeMap<u64, (u32, CopyAt)>,
}

struct Node {
    id: u64,
    /// `None` while crashed.
    replica: Option<Replica>,
    disk: Disk,
    sm: StateMachine,
    flushed: StateMachine,
    tick_ms: u64,
    next_tick_ms: u64,
    restart_at_ms: u64,
    paused_until_ms: u64,
    proposals: BTreeMap<u64, Proposal>,
    dispatch: Dispatch,
    was_serving: bool,
    /// While the disk is full: when space comes back.
    full_until_ms: u64,
    /// `snapshot-in/INSTALLING` and the staged file it names: durable, so a crash keeps it.
    marker: Option<Marker>,
}

/// An install marker and its staged file (the pulled file is durable before the marker is
/// written, so the sim keeps them together).
#[derive(Clone)]
struct Marker {
    point: InstallPoint,
    /// The staged file's state: the snapshot's keys, in key order.
    keys: Vec<u64>,
}

impl Marker {
    fn of(snapshot: &raft::eraftpb::Snapshot) -> Marker {
        let meta = snapshot.get_metadata();
        Marker {
            point: InstallPoint {
                index: meta.index,
                term: meta.term,
                conf: meta.get_conf_state().clone(),
            },
            keys: snapshot
                .data
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect(),
        }
    }

    /// The state machine the staged file makes.
    fn state(&self) -> StateMachine {
        let mut sm = StateMachine::default();
        for id in &self.keys {
            sm.insert(*id);
        }
        sm.applied = self.point.index;
        sm
    }
}

/// Where a crash may hit a snapshot's install (`ReplicatedStore::install_snapshot`), or the
/// redo of one at the next start (`finish_interrupted_install`). Each has its own function in
/// [`Sim`] and its own count in [`Stats::snapshot_crashes_at`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CrashPoint {
    /// The offer is taken, nothing is written: the old state.
    BeforeMarker,
    /// The marker is durable, the engine is untouched.
    MarkerWritten,
    /// The engine is forgetting its old state and loading the file, and a memtable flush
    /// made part of that durable: the flushed state is partly old, partly new.
    MidLoad,
    /// The file's state is flushed; the checkpoint and the Ready's records are not appended.
    Loaded,
    /// The records are appended and not all durable (a prefix may be).
    Appended,
    /// The records are durable, the marker is still there.
    RecordsDurable,
    /// The marker is removed, the raft core is not told yet.
    MarkerRemoved,
    /// At the next start, the redo's load, part-flushed as in `MidLoad`.
    RedoMidLoad,
    /// At the next start, the redo's state is flushed, its checkpoint is not durable.
    RedoLoaded,
    /// At the next start, the checkpoint is durable, the marker is still there.
    RedoDurable,
}

const CRASH_POINTS: [CrashPoint; 10] = [
    CrashPoint::BeforeMarker,
    CrashPoint::MarkerWritten,
    CrashPoint::MidLoad,
    CrashPoint::Loaded,
    CrashPoint::Appended,
    CrashPoint::RecordsDurable,
    CrashPoint::MarkerRemoved,
    CrashPoint::RedoMidLoad,
    CrashPoint::RedoLoaded,
    CrashPoint::RedoDurable,
];

impl Node {
    fn paused(&self, now: u64) -> bool {
        now < self.paused_until_ms
    }
}

#[derive(Default)]
struct Net {
    /// Messages in flight by (delivery time, send order): deterministic order.
    queue: BTreeMap<(u64, u64), Message>,
    sent: u64,
    /// Links cut, as (from, to).
    cut: BTreeSet<(u64, u64)>,
    heal_at_ms: u64,
}

/// What a run did, to show the simulation exercises what it claims to.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
struct Stats {
    seeds: u64,
    leader_terms: u64,
    crashes: u64,
    pauses: u64,
    partitions: u64,
    messages_sent: u64,
    messages_dropped: u64,
    acked_keys: u64,
    deleted_keys: u64,
    deliveries: u64,
    redeliveries: u64,
    dead_letters: u64,
    /// Hand-outs the leadership core refused (no lease, or no longer serving).
    hand_outs_refused: u64,
    /// Hand-outs that broke the lease rule (only counted with the lease check off, as a
    /// control: with it on, the first one fails the run).
    lease_violations: u64,
    disk_fulls: u64,
    snapshots_installed: u64,
    /// Crashes in the middle of a snapshot's install, at each [`CrashPoint`] (in the order of
    /// [`CRASH_POINTS`]).
    snapshot_crashes_at: [u64; CRASH_POINTS.len()],
    /// Restarts that found an install marker and finished its install.
    installs_resumed: u64,
    /// Of those, the ones whose flushed state named the snapshot's index but was not the
    /// snapshot's state (a flush in the middle of a load).
    installs_resumed_over_other_state: u64,
    compactions: u64,
    /// Entries a node's log held at most (bounded by compaction).
    log_entries_held_max: u64,
    last_index_max: u64,
    settle_ms_max: u64,
    /// A digest of every applied index's entry and state (a replay must match it).
    fingerprint: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.seeds += o.seeds;
        self.leader_terms += o.leader_terms;
        self.crashes += o.crashes;
        self.pauses += o.pauses;
        self.partitions += o.partitions;
        self.messages_sent += o.messages_sent;
        self.messages_dropped += o.messages_dropped;
        self.acked_keys += o.acked_keys;
        self.deleted_keys += o.deleted_keys;
        self.deliveries += o.deliveries;
        self.redeliveries += o.redeliveries;
        self.dead_letters += o.dead_letters;
        self.hand_outs_refused += o.hand_outs_refused;
        self.lease_violations += o.lease_violations;
        self.disk_fulls += o.disk_fulls;
        self.snapshots_installed += o.snapshots_installed;
        for (total, n) in self
            .snapshot_crashes_at
            .iter_mut()
            .zip(o.snapshot_crashes_at)
        {
            *total += n;
        }
        self.installs_resumed += o.installs_resumed;
        self.installs_resumed_over_other_state += o.installs_resumed_over_other_state;
        self.compactions += o.compactions;
        self.log_entries_held_max = self.log_entries_held_max.max(o.log_entries_held_max);
        self.last_index_max = self.last_index_max.max(o.last_index_max);
        self.settle_ms_max = self.settle_ms_max.max(o.settle_ms_max);
        self.fingerprint = self.fingerprint.rotate_left(5) ^ o.fingerprint;
    }
}

/// What every node must agree on at an applied index (invariant 4).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct AppliedDigest {
    term: u64,
    data: u64,
    state: u64,
}

/// The invariants' memory of the whole run.
#[derive(Default)]
struct Checker {
    applied: BTreeMap<u64, AppliedDigest>,
    /// Key → index of the first committed `Delete` of it.
    deleted_at: BTreeMap<u64, u64>,
    /// Acknowledged key → (term, index) of its `Store`.
    acked: BTreeMap<u64, (u64, u64)>,
    leaders: BTreeMap<u64, u64>,
    serving: BTreeMap<u64, u64>,
    /// The newest term of which any node knew an entry committed, so far.
    newest_committed_term: u64,
}

/// One seed's fault rates, in per mille (see the maxima).
#[derive(Clone, Copy, Debug)]
struct Faults {
    slow: u32,
    drop: u32,
    dup: u32,
    crash: u32,
    pause: u32,
    partition: u32,
    disk_full: u32,
}

impl Faults {
    fn draw(rng: &mut fastrand::Rng) -> Faults {
        Faults {
            slow: rng.u32(0..=NET_SLOW_PERMILLE_MAX),
            drop: rng.u32(0..=NET_DROP_PERMILLE_MAX),
            dup: rng.u32(0..=NET_DUP_PERMILLE_MAX),
            crash: rng.u32(0..=CRASH_PERMILLE_MAX),
            pause: rng.u32(0..=PAUSE_PERMILLE_MAX),
            partition: rng.u32(0..=PARTITION_PERMILLE_MAX),
            disk_full: rng.u32(0..=DISK_FULL_PERMILLE_MAX),
        }
    }
}

#[derive(Clone, Copy)]
struct SimConfig {
    compaction: bool,
    /// Hand-outs ask the leadership core (`Replica::may_hand_out`), as the broker does. Off
    /// only for the control run that shows the lease assertion can fail.
    lease: bool,
    /// Compaction keeps only `SNAPSHOT_RETAIN_ENTRIES` past each node's flushed state, so
    /// followers behind get snapshots, whose installs crash at their every step now and then.
    snapshots: bool,
}

struct Sim {
    seed: u64,
    config: SimConfig,
    now: u64,
    rng: fastrand::Rng,
    nodes: Vec<Node>,
    net: Net,
    check: Checker,
    stats: Stats,
    next_key: u64,
    /// Faults are injected (until the cluster is healed), at these rates.
    faults: bool,
    rates: Faults,
    /// Every node has the log through here (see [`Sim::compact`]).
    compact_safe: u64,
    /// Every message sent, on stderr (`PINQ_SIM_TRACE=1`, for replaying one seed).
    trace: bool,
    /// `now`, for the raft core's log lines.
    clock: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// A directed test's crash: the next install (or redo) that reaches this point crashes.
    crash_next_at: Option<CrashPoint>,
}

/// Where a failure happened, for assertion messages.
struct At {
    seed: u64,
    now: u64,
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed {} at {} ms", self.seed, self.now)
    }
}

impl Sim {
    fn new(seed: u64, config: SimConfig) -> Sim {
        let mut rng = fastrand::Rng::with_seed(seed);
        let rates = Faults::draw(&mut rng);
        let clock = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let nodes = (1..=NODE_COUNT)
            .map(|id| {
                let mut replica = Replica::new(
                    &self::config(id),
                    RaftLog::new((1..=NODE_COUNT).collect()),
                    0,
                    &raft_logger(&clock),
                )
                .unwrap();
                replica.seed_election_timeouts(rng.u64(..));
                let tick_ms = rng.u64(TICK_MS_MIN..=TICK_MS_MAX);
                Node {
                    id,
                    replica: Some(replica),
                    disk: Disk::default(),
                    sm: StateMachine::default(),
                    flushed: StateMachine::default(),
                    tick_ms,
                    next_tick_ms: rng.u64(1..=tick_ms),
                    restart_at_ms: 0,
                    paused_until_ms: 0,
                    proposals: BTreeMap::new(),
                    dispatch: Dispatch::default(),
                    was_serving: false,
                    full_until_ms: 0,
                    marker: None,
                }
            })
            .collect();
        Sim {
            seed,
            config,
            now: 0,
            rng,
            nodes,
            net: Net::default(),
            check: Checker::default(),
            stats: Stats {
                seeds: 1,
                ..Stats::default()
            },
            next_key: 1,
            faults: true,
            rates,
            compact_safe: 0,
            trace: std::env::var_os("PINQ_SIM_TRACE").is_some(),
            clock,
            crash_next_at: None,
        }
    }

    fn at(&self) -> At {
        At {
            seed: self.seed,
            now: self.now,
        }
    }

    fn chance(&mut self, permille: u32) -> bool {
        self.rng.u32(0..1000) < permille
    }

    /// Runs the faulty phase, heals everything, and lets the cluster settle.
    fn run(mut self) -> Stats {
        for _ in 0..FAULT_MS {
            self.step();
        }
        self.heal();
        self.settle();
        self.check_end();
        self.stats
    }

    /// Steps until [`Sim::settled`]; a cluster that does not is a failure (liveness).
    fn settle(&mut self) {
        let start = self.now;
        while !self.settled() {
            assert!(
                self.now - start < SETTLE_MS_MAX,
                "{}: the healed cluster did not settle within {SETTLE_MS_MAX} ms:\n{}",
                self.at(),
                self.describe()
            );
            self.step();
        }
        self.stats.settle_ms_max = self.stats.settle_ms_max.max(self.now - start);
    }

    fn step(&mut self) {
        self.now += 1;
        self.clock
            .store(self.now, std::sync::atomic::Ordering::Relaxed);
        if self.faults {
            self.inject_faults();
        }
        self.restart_due();
        self.deliver_due();
        self.complete_fsyncs();
        self.tick_due();
        self.drain_all();
        if self.faults {
            self.publish();
            self.dispatch();
        }
        self.flush();
        if self.config.compaction {
            self.compact();
        }
        if self.config.snapshots {
            self.build_snapshots();
        }
        self.drain_all();
        self.start_fsyncs();
        self.check_step();
    }

    fn inject_faults(&mut self) {
        if self.net.heal_at_ms <= self.now {
            self.net.cut.clear();
        }
        for node in &mut self.nodes {
            if node.disk.full && node.full_until_ms <= self.now {
                node.disk.full = false;
            }
        }
        if self.chance(self.rates.disk_full) {
            let i = self.rng.usize(..self.nodes.len());
            let until = self.now + self.rng.u64(DISK_FULL_MS_MIN..=DISK_FULL_MS_MAX);
            let node = &mut self.nodes[i];
            if node.replica.is_some() && !node.disk.full {
                node.disk.full = true;
                node.full_until_ms = until;
            }
        }
        if self.chance(self.rates.crash) {
            let i = self.rng.usize(..self.nodes.len());
            if self.nodes[i].replica.is_some() {
                self.crash(i);
            }
        }
        if self.chance(self.rates.pause) {
            let i = self.rng.usize(..self.nodes.len());
            let until = self.now + self.rng.u64(1..=PAUSE_MS_MAX);
            let node = &mut self.nodes[i];
            if node.replica.is_some() && !node.paused(self.now) {
                node.paused_until_ms = until;
                self.stats.pauses += 1;
            }
        }
        if self.net.cut.is_empty() && self.chance(self.rates.partition) {
            let a = self.rng.u64(1..=NODE_COUNT);
            if self.rng.bool() {
                // One node isolated: the minority/majority split of three nodes.
                for b in (1..=NODE_COUNT).filter(|b| *b != a) {
                    self.net.cut.insert((a, b));
                    self.net.cut.insert((b, a));
                }
            } else {
                // One link cut one way (a node hears its peer but is not heard).
                let b = (a % NODE_COUNT) + 1;
                self.net.cut.insert((a, b));
            }
            self.net.heal_at_ms = self.now + self.rng.u64(PARTITION_MS_MIN..=PARTITION_MS_MAX);
            self.stats.partitions += 1;
        }
    }

    /// The driver of node `i` failed (its disk is full): the one failure rule. From that
    /// instant the replica serves and hands out nothing; then the node stops (a process exit),
    /// and is started again once space is back.
    fn driver_stops(&mut self, i: usize) {
        let at = self.at();
        let now = self.now;
        let node = &mut self.nodes[i];
        let Some(replica) = node.replica.as_mut() else {
            return;
        };
        replica.fail();
        assert!(
            !replica.serving() && !replica.may_hand_out(now),
            "{at}: node {} serves with a failed driver",
            node.id
        );
        let back_at = node.full_until_ms;
        self.crash(i);
        self.nodes[i].restart_at_ms = back_at.max(self.now + DOWN_MS_MIN);
        self.stats.crashes -= 1;
        self.stats.disk_fulls += 1;
    }

    /// The node loses its process: volatile records, its memory, its in-flight fdatasync.
    fn crash(&mut self, i: usize) {
        let down_ms = self.rng.u64(DOWN_MS_MIN..=DOWN_MS_MAX);
        let node = &mut self.nodes[i];
        node.replica = None;
        let synced = node.disk.synced;
        node.disk.records.truncate(synced);
        node.disk.fsync = None;
        node.sm = node.flushed.clone();
        node.proposals.clear();
        node.dispatch = Dispatch::default();
        node.was_serving = false;
        node.paused_until_ms = 0;
        node.restart_at_ms = self.now + down_ms;
        self.stats.crashes += 1;
    }

    /// Recovery as `ReplicatedStore::open` does it: the log from the synced records, the state
    /// machine from its flushed copy; with an install marker, the log resumed at the snapshot
    /// (by the driver's own `resume_log`) and the install finished before anything else.
    fn restart(&mut self, i: usize) {
        let seed = self.rng.u64(..);
        let jitter = self.rng.u64(1..=TICK_MS_MAX);
        let at = self.at();
        let logger = raft_logger(&self.clock);
        let node = &mut self.nodes[i];
        let mut log = RaftLog::new((1..=NODE_COUNT).collect());
        for record in &node.disk.records {
            log.apply_record(record)
                .unwrap_or_else(|e| panic!("{at}: node {} recovery: {e}", node.id));
        }
        let marker = node.marker.clone();
        let resumed = marker.as_ref().and_then(|m| {
            resume_log(&mut log, &m.point)
                .unwrap_or_else(|e| panic!("{at}: node {} resuming an install: {e}", node.id))
        });
        let applied = marker
            .as_ref()
            .map_or(node.flushed.applied, |m| m.point.index);
        // The state machine only ever applied entries that were durable here; a snapshot's
        // state is flushed before its checkpoint is durable only under a marker, which resumed
        // the log at the snapshot.
        assert!(
            node.flushed.applied <= log.last_index(),
            "{at}: node {} flushed state at {} is past its recovered log (last {})",
            node.id,
            node.flushed.applied,
            log.last_index()
        );
        assert!(
            log.first_index() <= applied + 1,
            "{at}: node {} log compacted to {} past its applied state {applied}",
            node.id,
            log.first_index() - 1,
        );
        let mut replica = Replica::new(&config(node.id), log, applied, &logger)
            .unwrap_or_else(|e| panic!("{at}: node {} restart: {e}", node.id));
        replica.seed_election_timeouts(seed);
        if let Some(record) = &resumed {
            if node.disk.append(record).is_err() {
                // The open fails: the node stays down until space is back.
                node.restart_at_ms = node.full_until_ms.max(self.now + DOWN_MS_MIN);
                self.stats.disk_fulls += 1;
                return;
            }
        }
        node.sm = node.flushed.clone();
        node.replica = Some(replica);
        node.next_tick_ms = self.now + jitter;
        if let Some(marker) = marker {
            self.finish_interrupted_install(i, &marker);
        }
    }

    /// `finish_interrupted_install`: the staged file is loaded again over whatever the
    /// interrupted load left flushed (idempotent: everything is forgotten first), the resumed
    /// checkpoint is made durable, and only then does the marker go.
    fn finish_interrupted_install(&mut self, i: usize, marker: &Marker) {
        let flushed = &self.nodes[i].flushed;
        if flushed.applied == marker.point.index && flushed.keys != marker.state().keys {
            // The manifest names the snapshot's index over a state that is not the snapshot's:
            // only the marker tells it apart.
            self.stats.installs_resumed_over_other_state += 1;
        }
        self.check_snapshot_state(i, marker);
        if !self.load_staged(i, marker, CrashPoint::RedoMidLoad, CrashPoint::RedoLoaded) {
            return;
        }
        if !self.make_durable(i, CrashPoint::RedoDurable) {
            return;
        }
        self.nodes[i].marker = None;
        self.stats.installs_resumed += 1;
    }

    fn restart_due(&mut self) {
        for i in 0..self.nodes.len() {
            if self.nodes[i].replica.is_none() && self.nodes[i].restart_at_ms <= self.now {
                self.restart(i);
            }
        }
    }

    fn send(&mut self, messages: Vec<Message>) {
        for m in messages {
            assert_ne!(m.from, m.to, "{}: a message to itself", self.at());
            if self.trace {
                eprintln!(
                    "{:>6} ms {}->{} {:?} term {} index {} log_term {} commit {} entries {:?} \
                     reject {} hint {}",
                    self.now,
                    m.from,
                    m.to,
                    m.get_msg_type(),
                    m.term,
                    m.index,
                    m.log_term,
                    m.commit,
                    m.entries.first().map(|e| (e.index, m.entries.len())),
                    m.reject,
                    m.reject_hint
                );
            }
            self.stats.messages_sent += 1;
            if self.net.cut.contains(&(m.from, m.to))
                || (self.faults && self.chance(self.rates.drop))
            {
                self.stats.messages_dropped += 1;
                continue;
            }
            let copies = if self.faults && self.chance(self.rates.dup) {
                2
            } else {
                1
            };
            for _ in 0..copies {
                let delay = if self.chance(self.rates.slow) {
                    self.rng.u64(NET_DELAY_MS_MAX..=NET_SLOW_DELAY_MS_MAX)
                } else {
                    self.rng.u64(1..=NET_DELAY_MS_MAX)
                };
                self.net.sent += 1;
                self.net
                    .queue
                    .insert((self.now + delay, self.net.sent), m.clone());
            }
        }
    }

    fn deliver_due(&mut self) {
        while let Some(entry) = self.net.queue.first_entry() {
            if entry.key().0 > self.now {
                break;
            }
            let m = entry.remove();
            if self.net.cut.contains(&(m.from, m.to)) {
                self.stats.messages_dropped += 1;
                continue;
            }
            let node = &mut self.nodes[(m.to - 1) as usize];
            if node.paused(self.now) {
                // Held in the socket until the process runs again, and read a little later
                // than its timers run (see `RESUME_SOCKET_LAG_MS_MAX`).
                let at = node.paused_until_ms + self.rng.u64(0..=RESUME_SOCKET_LAG_MS_MAX);
                self.net.sent += 1;
                self.net.queue.insert((at, self.net.sent), m);
                continue;
            }
            match node.replica.as_mut() {
                // A stale or duplicated message is the core's to ignore; an error here is one
                // of those (the core says so rather than panicking).
                Some(replica) => {
                    let _ = replica.step(m);
                }
                None => self.stats.messages_dropped += 1,
            }
        }
    }

    fn complete_fsyncs(&mut self) {
        for i in 0..self.nodes.len() {
            let node = &mut self.nodes[i];
            let Some((done_ms, covers)) = node.disk.fsync else {
                continue;
            };
            // A paused process learns of its fdatasync when it runs again.
            if done_ms > self.now || node.paused(self.now) {
                continue;
            }
            node.disk.fsync = None;
            if node.disk.full {
                // The write behind this fdatasync found no space.
                self.driver_stops(i);
                continue;
            }
            // An install's own wait for durability may have synced past it already.
            node.disk.synced = node.disk.synced.max(covers);
            let messages = match node.replica.as_mut() {
                Some(replica) => {
                    let mut messages = replica.durable(covers as u64);
                    replica.stamp(self.now, &mut messages);
                    messages
                }
                None => Vec::new(),
            };
            self.send(messages);
        }
    }

    fn start_fsyncs(&mut self) {
        for i in 0..self.nodes.len() {
            let ms = self.rng.u64(1..=FSYNC_MS_MAX);
            let node = &mut self.nodes[i];
            if node.replica.is_some()
                && node.disk.fsync.is_none()
                && node.disk.records.len() > node.disk.synced
            {
                node.disk.fsync = Some((self.now + ms, node.disk.records.len()));
            }
        }
    }

    fn tick_due(&mut self) {
        for i in 0..self.nodes.len() {
            let jitter = self.rng.u64(0..=2);
            let node = &mut self.nodes[i];
            if node.paused(self.now) || node.next_tick_ms > self.now {
                continue;
            }
            let Some(replica) = node.replica.as_mut() else {
                continue;
            };
            replica.tick();
            node.next_tick_ms = self.now + node.tick_ms + jitter - 1;
        }
    }

    fn drain_all(&mut self) {
        for i in 0..self.nodes.len() {
            if !self.nodes[i].paused(self.now) {
                self.drain(i);
            }
        }
    }

    /// Carries out every Ready of node `i`: send, apply, note the role.
    fn drain(&mut self, i: usize) {
        loop {
            let at = self.at();
            let node = &mut self.nodes[i];
            let Some(replica) = node.replica.as_mut() else {
                return;
            };
            let work = match replica.next_work(&mut node.disk) {
                Ok(Some(work)) => work,
                Ok(None) => return,
                Err(DiskFull) => return self.driver_stops(i),
            };
            assert!(
                work.snapshot.is_none() || self.config.snapshots,
                "{at}: node {} got a snapshot, but none is ever built",
                node.id
            );
            let mut messages = work.messages;
            replica.stamp(self.now, &mut messages);
            for m in &messages {
                if m.get_msg_type() == MessageType::MsgSnapshot {
                    replica.snapshot_sent(m.to);
                }
            }
            self.send(messages);
            if let Some(snapshot) = work.snapshot {
                if !self.install_snapshot(i, snapshot, work.deferred) {
                    return;
                }
            }
            if let Some(last) = work.committed.last().map(Entry::get_index) {
                for entry in &work.committed {
                    self.apply(i, entry);
                }
                if let Some(replica) = self.nodes[i].replica.as_mut() {
                    replica.applied_to(last);
                }
            }
        }
    }

    /// Leaders build the snapshots their raft cores ask for: the state machine's keys at its
    /// applied index (as `ReplicatedStore::build_snapshot` scans its engine).
    fn build_snapshots(&mut self) {
        for node in &mut self.nodes {
            if node.paused(self.now) {
                continue;
            }
            let Some(replica) = node.replica.as_mut() else {
                continue;
            };
            if !replica.snapshot_wanted() {
                continue;
            }
            let Some((index, term, conf_state)) = replica.snapshot_point() else {
                continue;
            };
            assert_eq!(
                index, node.sm.applied,
                "the snapshot is taken at the applied state"
            );
            let mut snapshot = raft::eraftpb::Snapshot {
                data: node
                    .sm
                    .keys
                    .iter()
                    .flat_map(|id| id.to_le_bytes())
                    .collect::<Vec<u8>>()
                    .into(),
                ..Default::default()
            };
            let meta = snapshot.mut_metadata();
            meta.index = index;
            meta.term = term;
            meta.set_conf_state(conf_state);
            replica.offer_snapshot(snapshot);
        }
    }

    /// Node `i` installs a snapshot as `ReplicatedStore::install_snapshot` does, one function
    /// per step: the marker ([`Sim::write_marker`]), the engine's load of the staged file
    /// ([`Sim::load_staged`]), the checkpoint and the Ready's records made durable
    /// ([`Sim::write_records`]), the marker removed ([`Sim::remove_marker`]); a crash may come
    /// at every [`CrashPoint`] between them. Returns whether the node still runs.
    fn install_snapshot(
        &mut self,
        i: usize,
        snapshot: raft::eraftpb::Snapshot,
        deferred: Vec<RaftRecord>,
    ) -> bool {
        let marker = Marker::of(&snapshot);
        self.check_snapshot_state(i, &marker);
        if !self.write_marker(i, &marker)
            || !self.load_staged(i, &marker, CrashPoint::MidLoad, CrashPoint::Loaded)
        {
            return false;
        }
        let Some(last) = self.write_records(i, &deferred) else {
            return false;
        };
        if !self.remove_marker(i) {
            return false;
        }
        let now = self.now;
        let node = &mut self.nodes[i];
        let mut messages = Vec::new();
        if let Some(replica) = node.replica.as_mut() {
            replica.snapshot_written(marker.point.index, last);
            // The driver's loop asks for what the records' durability released.
            messages = replica.durable(node.disk.synced as u64);
            replica.stamp(now, &mut messages);
        }
        self.send(messages);
        self.stats.snapshots_installed += 1;
        true
    }

    /// The snapshot carries the state every node had at its index (invariant 4): checked when
    /// it is taken and again when a restart loads it.
    fn check_snapshot_state(&self, i: usize, marker: &Marker) {
        let index = marker.point.index;
        if let Some(digest) = self.check.applied.get(&index) {
            assert_eq!(
                digest.state,
                marker.state().hash,
                "{}: node {} installs a snapshot at {index} whose state differs",
                self.at(),
                self.nodes[i].id
            );
        }
    }

    /// Step 1: the marker (naming the staged file, durable before it) is written atomically
    /// and durably; a full disk fails the write, and the driver stops.
    fn write_marker(&mut self, i: usize, marker: &Marker) -> bool {
        if self.crash_installing(i, CrashPoint::BeforeMarker) {
            return false;
        }
        if self.nodes[i].disk.full {
            self.driver_stops(i);
            return false;
        }
        self.nodes[i].marker = Some(marker.clone());
        !self.crash_installing(i, CrashPoint::MarkerWritten)
    }

    /// Step 2: the engine forgets its old state and takes the staged file's commands, then
    /// flushes. A memtable flush in the middle can make part of that durable: a crash at `mid`
    /// leaves [`Sim::part_loaded`]'s mix as the flushed state.
    fn load_staged(
        &mut self,
        i: usize,
        marker: &Marker,
        mid: CrashPoint,
        after: CrashPoint,
    ) -> bool {
        if self.crash_due(mid) {
            self.nodes[i].flushed = self.part_loaded(i, marker);
            self.crash_at(i, mid);
            return false;
        }
        self.nodes[i].sm = marker.state();
        if self.nodes[i].disk.full {
            // The flush fails: the driver stops, the marker stays.
            self.driver_stops(i);
            return false;
        }
        self.nodes[i].flushed = self.nodes[i].sm.clone();
        !self.crash_installing(i, after)
    }

    /// What a flush in the middle of a load leaves: the old in-memory state with its keys
    /// forgotten (in key order, as `forget_messages` scans) up to some point, then, once all
    /// are gone, the file's keys loaded up to some point; its index is the old one or the
    /// snapshot's (the load's commands are applied at the snapshot's index).
    fn part_loaded(&mut self, i: usize, marker: &Marker) -> StateMachine {
        let mut sm = self.nodes[i].sm.clone();
        let old: Vec<u64> = sm.keys.iter().copied().collect();
        let forgotten = self.rng.usize(0..=old.len());
        let loaded = if forgotten == old.len() {
            self.rng.usize(0..=marker.keys.len())
        } else {
            0
        };
        for id in &old[..forgotten] {
            sm.remove(*id);
        }
        for id in &marker.keys[..loaded] {
            sm.insert(*id);
        }
        if self.rng.bool() {
            sm.applied = marker.point.index;
        }
        sm
    }

    /// Step 3: the checkpoint and the Ready's records are appended and made durable. A crash
    /// before their fdatasync completes may find a prefix of them durable (a group commit in
    /// flight). Returns the last record's sequence number, `None` if the node went down.
    fn write_records(&mut self, i: usize, deferred: &[RaftRecord]) -> Option<u64> {
        let mut last = 0;
        for record in deferred {
            match self.nodes[i].disk.append(record) {
                Ok(seq) => last = seq,
                Err(DiskFull) => {
                    self.driver_stops(i);
                    return None;
                }
            }
        }
        if self.crash_due(CrashPoint::Appended) {
            let disk = &self.nodes[i].disk;
            let synced = self.rng.usize(disk.synced..=disk.records.len());
            self.nodes[i].disk.synced = synced;
            self.crash_at(i, CrashPoint::Appended);
            return None;
        }
        self.make_durable(i, CrashPoint::RecordsDurable)
            .then_some(last)
    }

    /// The WAL's `wait_durable`: one fdatasync covers every record appended so far (on a full
    /// disk it fails and the driver stops); then a crash may come at `after`.
    fn make_durable(&mut self, i: usize, after: CrashPoint) -> bool {
        if self.nodes[i].disk.full {
            self.driver_stops(i);
            return false;
        }
        let disk = &mut self.nodes[i].disk;
        disk.synced = disk.records.len();
        !self.crash_installing(i, after)
    }

    /// Step 4: the install is durable, the marker goes.
    fn remove_marker(&mut self, i: usize) -> bool {
        self.nodes[i].marker = None;
        !self.crash_installing(i, CrashPoint::MarkerRemoved)
    }

    /// Whether a crash comes at `point` of an install: while faults are injected now and then,
    /// and where a directed test asks for one.
    fn crash_due(&mut self, point: CrashPoint) -> bool {
        if self.crash_next_at == Some(point) {
            self.crash_next_at = None;
            return true;
        }
        self.faults && self.chance(SNAPSHOT_CRASH_PERMILLE)
    }

    /// A crash at `point` of a snapshot's install, now and then.
    fn crash_installing(&mut self, i: usize, point: CrashPoint) -> bool {
        if !self.crash_due(point) {
            return false;
        }
        self.crash_at(i, point);
        true
    }

    fn crash_at(&mut self, i: usize, point: CrashPoint) {
        self.crash(i);
        let at = CRASH_POINTS.iter().position(|p| *p == point).unwrap_or(0);
        self.stats.snapshot_crashes_at[at] += 1;
    }

    /// Applies one committed entry on node `i`, checking invariants 2 and 4.
    fn apply(&mut self, i: usize, entry: &Entry) {
        let at = self.at();
        let node = &mut self.nodes[i];
        assert_eq!(
            entry.index,
            node.sm.applied + 1,
            "{at}: node {} applies out of order",
            node.id
        );
        if carries_command(entry) {
            let command = Command::decode(&entry.data)
                .unwrap_or_else(|e| panic!("{at}: entry {} is no command: {e}", entry.index));
            match &command {
                Command::Store { messages, .. } | Command::StoreSequenced { messages, .. } => {
                    for (key, _) in messages {
                        let id = key.event_id();
                        if let Some(deleted) = self.check.deleted_at.get(&id) {
                            assert!(
                                *deleted > entry.index,
                                "{at}: node {} stores key {id} at {} after its delete at {deleted}",
                                node.id,
                                entry.index
                            );
                        }
                        node.sm.insert(id);
                    }
                }
                Command::Delete { keys } => {
                    for key in keys {
                        let id = key.event_id();
                        node.sm.remove(id);
                        self.check.deleted_at.entry(id).or_insert(entry.index);
                    }
                }
                // The simulation proposes no group policies or copy records (shard metadata,
                // not messages).
                Command::GroupPolicy { .. } | Command::Copies { .. } => {}
            }
        }
        node.sm.applied = entry.index;
        let digest = AppliedDigest {
            term: entry.term,
            data: xxhash_rust::xxh3::xxh3_64(&entry.data),
            state: node.sm.hash,
        };
        let first = *self.check.applied.entry(entry.index).or_insert(digest);
        assert_eq!(
            first, digest,
            "{at}: node {} applied state at index {} differs from another node's",
            node.id, entry.index
        );
        if let Some(proposal) = node.proposals.remove(&entry.index) {
            if proposal.term == entry.term && proposal.data[..] == entry.data[..] {
                match proposal.command {
                    Command::Store { messages, .. } | Command::StoreSequenced { messages, .. } => {
                        for (key, _) in messages {
                            self.check
                                .acked
                                .insert(key.event_id(), (entry.term, entry.index));
                            self.stats.acked_keys += 1;
                        }
                    }
                    Command::Delete { keys } => {
                        for key in keys {
                            node.dispatch.copies.remove(&key.event_id());
                            self.stats.deleted_keys += 1;
                        }
                    }
                    Command::GroupPolicy { .. } | Command::Copies { .. } => {}
                }
            }
        }
    }

    fn serving_nodes(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|i| {
                let node = &self.nodes[*i];
                !node.paused(self.now) && node.replica.as_ref().is_some_and(Replica::serving)
            })
            .collect()
    }

    fn propose(&mut self, i: usize, command: Command) -> bool {
        let data = command.to_bytes();
        let node = &mut self.nodes[i];
        let Some(replica) = node.replica.as_mut() else {
            return false;
        };
        match replica.propose(data.clone()) {
            Ok((term, index)) => {
                node.proposals.insert(
                    index,
                    Proposal {
                        term,
                        data,
                        command,
                    },
                );
                true
            }
            Err(_) => false,
        }
    }

    /// A client publishes new keys to some serving node.
    fn publish(&mut self) {
        if !self.chance(PUBLISH_PERMILLE) {
            return;
        }
        let serving = self.serving_nodes();
        if serving.is_empty() {
            return;
        }
        let i = serving[self.rng.usize(..serving.len())];
        let count = self.rng.usize(1..=PUBLISH_KEYS_MAX) as u64;
        self.publish_to(i, count);
    }

    fn publish_to(&mut self, i: usize, count: u64) -> bool {
        let ids = self.next_key..self.next_key + count;
        self.next_key += count;
        let command = Command::Store {
            messages: ids
                .clone()
                .map(|id| (key_of(id), Value::copy_from_slice(&id.to_le_bytes())))
                .collect(),
            event_id_high_water: ids.end - 1,
        };
        self.propose(i, command)
    }

    /// Every node that believes it serves runs its pipeline: dispatch passes assign stored keys
    /// to its consumer, the pump hands queued copies out, copies not ACKed in time are
    /// redelivered or dead-lettered, and the consumer ACKs some of what it holds (the leader
    /// proposes those as `Delete` commands). Each hand-out asks the leadership core at that
    /// moment, as the broker's paths do ([`Sim::hand_out`]).
    fn dispatch(&mut self) {
        for i in 0..self.nodes.len() {
            let serving = !self.nodes[i].paused(self.now)
                && self.nodes[i].replica.as_ref().is_some_and(Replica::serving);
            if !serving {
                self.nodes[i].dispatch = Dispatch::default();
                continue;
            }
            let term = self.nodes[i].replica.as_ref().map_or(0, |r| r.role().term);
            if self.nodes[i].dispatch.term != term {
                // A new leadership starts with an empty in-flight table.
                self.nodes[i].dispatch = Dispatch {
                    term,
                    ..Dispatch::default()
                };
            }
            if self.chance(DISPATCH_PERMILLE) && self.may_hand_out(i) {
                self.dispatch_pass(i);
            }
            self.time_out_copies(i);
            if self.chance(PUMP_PERMILLE) {
                self.pump(i);
            }
            self.consumer_acks(i);
        }
    }

    /// A dispatch pass: stored keys not in flight are queued for the consumer.
    fn dispatch_pass(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let fresh: Vec<u64> = node
            .sm
            .keys
            .iter()
            .filter(|id| !node.dispatch.copies.contains_key(id))
            .take(DELIVER_KEYS_MAX)
            .copied()
            .collect();
        for id in fresh {
            node.dispatch.copies.insert(id, (1, CopyAt::Queued));
        }
    }

    /// Copies out past the in-flight timeout are queued again, or dead-lettered once they had
    /// their `MAX_DELIVERIES`.
    fn time_out_copies(&mut self, i: usize) {
        let now = self.now;
        let due: Vec<(u64, u32)> = self.nodes[i]
            .dispatch
            .copies
            .iter()
            .filter_map(|(id, (attempt, at))| match at {
                CopyAt::Out { since_ms } if now - since_ms >= REDELIVER_AFTER_MS => {
                    Some((*id, *attempt))
                }
                _ => None,
            })
            .collect();
        for (id, attempt) in due {
            if attempt < MAX_DELIVERIES {
                self.nodes[i]
                    .dispatch
                    .copies
                    .insert(id, (attempt + 1, CopyAt::Queued));
            } else if self.hand_out(i, id, HandOut::DeadLetter) {
                // Stored in the dead-letter topic, then ACKed for its group.
                self.stats.dead_letters += 1;
                self.ack(i, vec![id]);
            }
        }
    }

    /// The pump: hands out queued copies whose keys are still stored, as far as the
    /// consumer's window has room.
    fn pump(&mut self, i: usize) {
        let copies = &self.nodes[i].dispatch.copies;
        let out = copies
            .values()
            .filter(|(_, at)| matches!(at, CopyAt::Out { .. }))
            .count();
        let queued: Vec<(u64, u32)> = copies
            .iter()
            .filter(|(_, (_, at))| *at == CopyAt::Queued)
            .map(|(id, (attempt, _))| (*id, *attempt))
            .take(CONSUMER_WINDOW.saturating_sub(out))
            .collect();
        for (id, attempt) in queued {
            if !self.nodes[i].sm.keys.contains(&id) {
                // Deleted since it was queued (the broker's drain drops such copies).
                self.nodes[i].dispatch.copies.remove(&id);
                continue;
            }
            let how = if attempt == 1 {
                HandOut::Pump
            } else {
                HandOut::Redelivery
            };
            if !self.hand_out(i, id, how) {
                // Held back: it waits in the queue for the lease.
                continue;
            }
            match how {
                HandOut::Redelivery => self.stats.redeliveries += 1,
                _ => self.stats.deliveries += 1,
            }
            let since_ms = self.now;
            self.nodes[i]
                .dispatch
                .copies
                .insert(id, (attempt, CopyAt::Out { since_ms }));
        }
    }

    /// The consumer ACKs some of the copies it holds.
    fn consumer_acks(&mut self, i: usize) {
        let out: Vec<u64> = self.nodes[i]
            .dispatch
            .copies
            .iter()
            .filter(|(id, (_, at))| matches!(at, CopyAt::Out { .. }) && *id % POISON_EVERY != 0)
            .map(|(id, _)| *id)
            .collect();
        let acks: Vec<u64> = out
            .into_iter()
            .filter(|_| self.chance(ACK_PERMILLE))
            .collect();
        if !acks.is_empty() {
            self.ack(i, acks);
        }
    }

    /// Proposes the `Delete` of ACKed keys on node `i`.
    fn ack(&mut self, i: usize, ids: Vec<u64>) {
        let command = Command::Delete {
            keys: ids.iter().map(|id| key_of(*id)).collect(),
        };
        if self.propose(i, command) {
            for id in ids {
                if let Some((_, at)) = self.nodes[i].dispatch.copies.get_mut(&id) {
                    *at = CopyAt::Acking;
                }
            }
        }
    }

    /// Whether node `i` may hand out a copy now: what every hand-out path of the broker asks
    /// (`ReplicatedStore::may_hand_out`), or, in the control run, only whether it serves.
    fn may_hand_out(&self, i: usize) -> bool {
        let Some(replica) = self.nodes[i].replica.as_ref() else {
            return false;
        };
        if self.config.lease {
            replica.may_hand_out(self.now)
        } else {
            replica.serving()
        }
    }

    /// The newest term any node knows an entry of committed (see [`Checker`]).
    fn newest_committed_term(&mut self) -> u64 {
        for node in &self.nodes {
            if let Some(term) = node.replica.as_ref().and_then(|r| r.committed().1) {
                self.check.newest_committed_term = self.check.newest_committed_term.max(term);
            }
        }
        self.check.newest_committed_term
    }

    /// Node `i` hands out a copy of `id` if the leadership core allows it now, and checks the
    /// lease rule (invariant 5) when it does: no newer term has committed anything, and the
    /// key's `Delete` is not committed (a copy is never handed out after its durable ACK).
    fn hand_out(&mut self, i: usize, id: u64, how: HandOut) -> bool {
        if !self.may_hand_out(i) {
            self.stats.hand_outs_refused += 1;
            return false;
        }
        let at = self.at();
        let newest = self.newest_committed_term();
        let node = &self.nodes[i];
        let term = node.replica.as_ref().map_or(0, |r| r.role().term);
        let deleted = self.check.deleted_at.get(&id).copied();
        let broken = newest > term || deleted.is_some();
        if broken && !self.config.lease {
            self.stats.lease_violations += 1;
            return true;
        }
        assert!(
            newest <= term,
            "{at}: node {} hands out key {id} ({how:?}) as leader of term {term} after term \
             {newest} committed an entry",
            node.id
        );
        assert!(
            deleted.is_none(),
            "{at}: node {} hands out key {id} ({how:?}) in term {term}, whose delete committed \
             at index {deleted:?}",
            node.id
        );
        true
    }

    /// Now and then a node's state machine reaches its disk.
    fn flush(&mut self) {
        for i in 0..self.nodes.len() {
            if self.chance(FLUSH_PERMILLE) && self.nodes[i].replica.is_some() {
                self.nodes[i].flushed = self.nodes[i].sm.clone();
            }
        }
    }

    /// A node drops the log every node has and its own flushed state machine covers. The
    /// point every node has is the lowest follower match a leader saw (a committed entry a
    /// follower persisted is never lost nor cut, so the point stays safe once seen); the broker
    /// would carry it in the leader's messages, here it is handed over directly.
    fn compact(&mut self) {
        for i in 0..self.nodes.len() {
            let safe = self.nodes[i]
                .replica
                .as_ref()
                .and_then(Replica::min_follower_match)
                .map(|matched| matched.min(self.nodes[i].sm.applied));
            if let Some(safe) = safe {
                self.compact_safe = self.compact_safe.max(safe);
            }
        }
        for i in 0..self.nodes.len() {
            if !self.chance(COMPACT_PERMILLE) {
                continue;
            }
            let at = self.at();
            let node = &mut self.nodes[i];
            let Some(replica) = node.replica.as_mut() else {
                continue;
            };
            let to = if self.config.snapshots {
                // As `logRetainEntries` does: a follower further behind gets a snapshot.
                node.flushed
                    .applied
                    .saturating_sub(SNAPSHOT_RETAIN_ENTRIES)
                    .min(replica.applied())
            } else {
                self.compact_safe.min(node.flushed.applied)
            };
            if to <= replica.log().base().0 {
                continue;
            }
            let (index, term) = replica
                .compact_to(to)
                .unwrap_or_else(|e| panic!("{at}: node {} compaction: {e}", node.id));
            assert_eq!(index, to, "{at}: node {} compacted elsewhere", node.id);
            let hard_state = replica.log().hard_state().clone();
            let checkpoint = RaftRecord::Checkpoint {
                index,
                term,
                hard_state,
                conf: Some(replica.log().conf_at(index)),
            };
            if node.disk.append(&checkpoint).is_err() {
                // The log could not take it: the driver stops, as on any failed write.
                self.driver_stops(i);
                continue;
            }
            self.stats.compactions += 1;
        }
    }

    fn check_step(&mut self) {
        let at = self.at();
        for node in &mut self.nodes {
            let Some(replica) = node.replica.as_ref() else {
                continue;
            };
            assert_eq!(
                replica.applied(),
                node.sm.applied,
                "{at}: node {} replica and state machine disagree on applied",
                node.id
            );
            // An install finishes (or the node goes down) before the node runs on.
            assert!(
                node.marker.is_none(),
                "{at}: node {} runs with an install marker",
                node.id
            );
            let role = replica.role();
            if role.leader {
                let first = *self.check.leaders.entry(role.term).or_insert(node.id);
                assert_eq!(first, node.id, "{at}: two leaders in term {}", role.term);
            }
            let serving = replica.serving();
            if serving {
                let first = *self.check.serving.entry(role.term).or_insert(node.id);
                assert_eq!(
                    first, node.id,
                    "{at}: two serving leaders in term {}",
                    role.term
                );
            }
            if serving && !node.was_serving {
                // Invariant 1 at every change of leadership: a leader starts with every
                // acknowledged publish that was not deleted.
                for (id, (term, index)) in &self.check.acked {
                    assert!(
                        node.sm.applied >= *index,
                        "{at}: node {} serves term {} at applied {} without acked key {id} \
                         (term {term}, index {index})",
                        node.id,
                        role.term,
                        node.sm.applied
                    );
                    let deleted = self
                        .check
                        .deleted_at
                        .get(id)
                        .is_some_and(|d| *d <= node.sm.applied);
                    assert!(
                        deleted || node.sm.keys.contains(id),
                        "{at}: node {} serves term {} without acked key {id} (term {term}, \
                         index {index})",
                        node.id,
                        role.term
                    );
                }
            }
            node.was_serving = serving;
            let (held, _) = replica.log().held();
            self.stats.log_entries_held_max = self.stats.log_entries_held_max.max(held as u64);
        }
    }

    /// Ends every fault: the network is whole and loses nothing, every node runs.
    fn heal(&mut self) {
        self.faults = false;
        self.net.cut.clear();
        for node in &mut self.nodes {
            node.disk.full = false;
            node.paused_until_ms = 0;
            node.restart_at_ms = self.now;
        }
    }

    /// Each node's figures, for a failure message.
    fn describe(&self) -> String {
        let mut out = format!(
            "faults {:?}; compaction safe through {}\n",
            self.rates, self.compact_safe
        );
        for node in &self.nodes {
            let replica = node.replica.as_ref().map(Replica::status);
            out += &format!(
                "node {}: sm applied {} flushed {} disk {}/{} synced; marker {:?}; {replica:?}\n",
                node.id,
                node.sm.applied,
                node.flushed.applied,
                node.disk.synced,
                node.disk.records.len(),
                node.marker.as_ref().map(|m| m.point.index)
            );
        }
        out
    }

    /// Every node runs, has applied everything the leader has, with nothing left to persist.
    fn settled(&self) -> bool {
        let Some(leader) = self.serving_nodes().first().copied() else {
            return false;
        };
        let Some(last) = self.nodes[leader]
            .replica
            .as_ref()
            .map(|r| r.log().last_index())
        else {
            return false;
        };
        self.nodes.iter().all(|n| {
            n.replica.as_ref().is_some_and(|r| {
                // A proposal or a message not yet turned into work is not in the log yet.
                !r.has_work()
                    && r.log().last_index() == last
                    && r.status().commit == last
                    && r.oldest_unpersisted_seq().is_none()
            }) && n.sm.applied == last
                && n.disk.synced == n.disk.records.len()
        })
    }

    /// Invariants 1 and 2 on the settled cluster.
    fn check_end(&mut self) {
        let at = self.at();
        let first = &self.nodes[0].sm;
        for node in &self.nodes[1..] {
            assert!(
                node.sm == *first,
                "{at}: node {} and node 1 settled with different state",
                node.id
            );
        }
        for (id, (term, index)) in &self.check.acked {
            let deleted = self.check.deleted_at.contains_key(id);
            for node in &self.nodes {
                assert!(
                    deleted || node.sm.keys.contains(id),
                    "{at}: acked key {id} (term {term}, index {index}) lost on node {}",
                    node.id
                );
            }
        }
        for id in self.check.deleted_at.keys() {
            for node in &self.nodes {
                assert!(
                    !node.sm.keys.contains(id),
                    "{at}: deleted key {id} is back on node {}",
                    node.id
                );
            }
        }
        self.stats.leader_terms = self.check.leaders.len() as u64;
        self.stats.fingerprint = self.check.applied.iter().fold(0, |f, (index, d)| {
            mix(f ^ index ^ d.term.rotate_left(16) ^ d.data ^ d.state.rotate_left(32))
        });
        self.stats.last_index_max = first.applied;
    }
}

/// The raft core's log on stderr, prefixed by the simulated time (`PINQ_SIM_RAFT_LOG=1`, for
/// replaying one seed); else nothing.
fn raft_logger(now: &std::sync::Arc<std::sync::atomic::AtomicU64>) -> slog::Logger {
    if std::env::var_os("PINQ_SIM_RAFT_LOG").is_none() {
        return quiet_logger();
    }
    slog::Logger::root(
        StderrDrain {
            now: std::sync::Arc::clone(now),
        },
        slog::o!(),
    )
}

struct StderrDrain {
    now: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl slog::Drain for StderrDrain {
    type Ok = ();
    type Err = slog::Never;
    fn log(
        &self,
        record: &slog::Record<'_>,
        values: &slog::OwnedKVList,
    ) -> Result<(), slog::Never> {
        struct Line(String);
        impl slog::Serializer for Line {
            fn emit_arguments(&mut self, key: slog::Key, val: &fmt::Arguments<'_>) -> slog::Result {
                self.0 += &format!(" {key}={val}");
                Ok(())
            }
        }
        let mut line = Line(String::new());
        let _ = slog::KV::serialize(&record.kv(), record, &mut line);
        let _ = slog::KV::serialize(values, record, &mut line);
        eprintln!(
            "{:>6} ms {} {}{}",
            self.now.load(std::sync::atomic::Ordering::Relaxed),
            record.level().as_short_str(),
            record.msg(),
            line.0
        );
        Ok(())
    }
}

/// Prints how to replay a seed when the run panics.
struct ReplayHint {
    test: &'static str,
    seed: u64,
}

impl Drop for ReplayHint {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "cluster_sim: {} failed with seed {}; replay it with \
                 PINQ_SIM_SEED={} cargo test --release --test cluster_sim {}",
                self.test, self.seed, self.seed, self.test
            );
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} is not a number")),
    )
}

/// The seeds to run: `PINQ_SIM_SEED` alone, or `PINQ_SIM_SEEDS` (else `default`) from 0.
fn seeds(default: u64) -> Vec<u64> {
    match env_u64("PINQ_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (0..env_u64("PINQ_SIM_SEEDS").unwrap_or(default)).collect(),
    }
}

fn run_seeds(test: &'static str, default_seeds: u64, config: SimConfig) -> Stats {
    let started = std::time::Instant::now();
    let mut total = Stats::default();
    for seed in seeds(default_seeds) {
        let hint = ReplayHint { test, seed };
        total.add(&Sim::new(seed, config).run());
        drop(hint);
    }
    eprintln!("{test}: {total:?} in {:?}", started.elapsed());
    total
}

#[test]
fn faulty_cluster_never_loses_acked_publishes_or_resurrects_deletes() {
    let stats = run_seeds(
        "faulty_cluster_never_loses_acked_publishes_or_resurrects_deletes",
        500,
        SimConfig {
            compaction: false,
            lease: true,
            snapshots: false,
        },
    );
    // The faults happened and the clients got work done through them, on every hand-out path.
    assert!(stats.crashes >= stats.seeds, "{stats:?}");
    assert!(stats.pauses >= stats.seeds / 4, "{stats:?}");
    assert!(stats.disk_fulls >= stats.seeds / 10, "{stats:?}");
    assert!(stats.deliveries >= 20 * stats.seeds, "{stats:?}");
    assert!(stats.redeliveries >= stats.seeds, "{stats:?}");
    assert!(stats.dead_letters >= stats.seeds / 4, "{stats:?}");
    // The lease did refuse hand-outs (a leader cut off, paused or newly elected).
    assert!(stats.hand_outs_refused >= stats.seeds, "{stats:?}");
    assert!(stats.partitions >= stats.seeds, "{stats:?}");
    assert!(stats.leader_terms >= 2 * stats.seeds, "{stats:?}");
    assert!(stats.acked_keys >= 50 * stats.seeds, "{stats:?}");
    assert!(stats.deleted_keys >= 20 * stats.seeds, "{stats:?}");
}

#[test]
fn log_compaction_to_the_slowest_follower_keeps_every_invariant() {
    let stats = run_seeds(
        "log_compaction_to_the_slowest_follower_keeps_every_invariant",
        300,
        SimConfig {
            compaction: true,
            lease: true,
            snapshots: false,
        },
    );
    assert!(stats.compactions >= stats.seeds, "{stats:?}");
    assert!(stats.acked_keys >= 50 * stats.seeds, "{stats:?}");
    assert!(
        stats.log_entries_held_max < stats.last_index_max,
        "compaction bounded no log: {stats:?}"
    );
}

/// Seeds enough for every [`CrashPoint`] to be hit (a run of one seed hits a few).
const SEEDS_FOR_EVERY_CRASH_POINT: u64 = 50;

#[test]
fn snapshot_installs_crashed_at_every_step_keep_every_invariant() {
    let stats = run_seeds(
        "snapshot_installs_crashed_at_every_step_keep_every_invariant",
        200,
        SimConfig {
            compaction: true,
            lease: true,
            snapshots: true,
        },
    );
    // Installs finished, at once or by a restart's redo.
    assert!(
        stats.snapshots_installed + stats.installs_resumed >= stats.seeds,
        "{stats:?}"
    );
    let crashes: u64 = stats.snapshot_crashes_at.iter().sum();
    assert!(crashes >= stats.seeds / 4, "{stats:?}");
    if stats.seeds >= SEEDS_FOR_EVERY_CRASH_POINT {
        // Every step of the install, and of its redo at a restart, had crashes.
        for (point, n) in CRASH_POINTS.iter().zip(stats.snapshot_crashes_at) {
            assert!(n > 0, "no crash at {point:?}: {stats:?}");
        }
        assert!(stats.installs_resumed > 0, "{stats:?}");
        assert!(stats.installs_resumed_over_other_state > 0, "{stats:?}");
    }
    assert!(stats.acked_keys >= 50 * stats.seeds, "{stats:?}");
    assert!(stats.deliveries >= 20 * stats.seeds, "{stats:?}");
}

/// The control: with hand-outs asking only whether the node believes it serves (no lease), a
/// deposed leader on the minority side, or one paused past an election, hands out copies after
/// a newer term committed. So invariant 5 is a check that can fail.
#[test]
fn without_the_lease_a_deposed_leader_hands_out_after_a_newer_term_committed() {
    let stats = run_seeds(
        "without_the_lease_a_deposed_leader_hands_out_after_a_newer_term_committed",
        100,
        SimConfig {
            compaction: false,
            lease: false,
            snapshots: false,
        },
    );
    assert!(stats.lease_violations > 0, "{stats:?}");
}

#[test]
fn a_seed_replays_exactly() {
    let seed = env_u64("PINQ_SIM_SEED").unwrap_or(7);
    let run = || {
        Sim::new(
            seed,
            SimConfig {
                compaction: true,
                lease: true,
                snapshots: true,
            },
        )
        .run()
    };
    let (first, second) = (run(), run());
    assert_ne!(first.fingerprint, 0);
    assert_eq!(first, second, "seed {seed} ran differently twice");
}

/// Regression, found by the compaction simulation (seed 34 before the fix in `Replica::step`):
/// a stale (late or duplicated) rejection that reached the leader while it probed a follower
/// lowered the follower's next index below its match; with the log compacted through that
/// match, the leader wanted a snapshot it cannot build, and the follower never caught up.
#[test]
fn a_stale_rejection_after_compaction_does_not_strand_a_follower() {
    let mut sim = Sim::new(
        1,
        SimConfig {
            compaction: false,
            lease: true,
            snapshots: false,
        },
    );
    sim.heal();
    sim.settle();
    let leader = sim.serving_nodes()[0];
    for _ in 0..5 {
        assert!(sim.publish_to(leader, 2));
        sim.settle();
    }
    // Equal logs are not enough: the leader must know every follower holds all of it (their
    // answers may still be in flight).
    let last = sim.nodes[leader]
        .replica
        .as_ref()
        .unwrap()
        .log()
        .last_index();
    let start = sim.now;
    while sim.nodes[leader]
        .replica
        .as_ref()
        .and_then(Replica::min_follower_match)
        != Some(last)
    {
        assert!(
            sim.now - start < SETTLE_MS_MAX,
            "the leader never saw every match"
        );
        sim.step();
    }
    let follower = (leader + 1) % sim.nodes.len();
    let (leader_id, follower_id) = (sim.nodes[leader].id, sim.nodes[follower].id);
    let replica = sim.nodes[leader].replica.as_mut().unwrap();
    let (term, last) = (replica.role().term, replica.log().last_index());
    assert!(last > 5, "the publishes are in the log (last {last})");
    // Every follower holds the whole log, so the leader may drop all of it.
    assert_eq!(replica.compact_to(last).unwrap().0, last);
    let rejection = |index: u64, hint: u64| Message {
        msg_type: MessageType::MsgAppendResponse,
        from: follower_id,
        to: leader_id,
        term,
        index,
        reject: true,
        reject_hint: hint,
        commit: last,
        ..Message::default()
    };
    // Everything in flight is lost (an answer of the follower would repair its progress).
    sim.net.queue.clear();
    // A rejection past the match moves the follower to probing from match + 1 ...
    let _ = replica.step(rejection(last + 1, last));
    sim.drain(leader);
    // ... whose probe is lost ...
    sim.net.queue.clear();
    // ... and a stale rejection of that same index, hinting far below the match, arrives.
    let replica = sim.nodes[leader].replica.as_mut().unwrap();
    let _ = replica.step(rejection(last, last - 3));
    sim.drain(leader);
    // New entries must still reach the follower (with only the compacted log behind them).
    assert!(sim.publish_to(leader, 2));
    sim.settle();
}

/// Regression, found by the snapshot simulation (seed 152 with raft's `skip_bcast_commit`, and
/// seed 908 without it, before the install marker was modelled): a follower crashed after its
/// install flushed the snapshot's state and before the checkpoint was durable; the restart left
/// its state machine at the snapshot's state labelled with the log's lower index, a flush made
/// that pair durable, and after a second crash the node applied the entries after that index
/// over the snapshot's state. With the marker, the restart loads the snapshot again at its own
/// index (over a whole or a part-flushed load), so a flush and a crash right after it leave a
/// node that converges.
#[test]
fn a_crash_after_an_install_flushed_then_a_flush_and_a_crash_after_the_restart_converge() {
    for point in [CrashPoint::Loaded, CrashPoint::MidLoad] {
        for seed in 150..155 {
            crash_an_install_then_flush_and_crash_after_the_redo(seed, point);
        }
    }
}

fn crash_an_install_then_flush_and_crash_after_the_redo(seed: u64, point: CrashPoint) {
    let mut sim = Sim::new(
        seed,
        SimConfig {
            compaction: true,
            lease: true,
            snapshots: true,
        },
    );
    sim.heal();
    sim.settle();
    let leader = sim.serving_nodes()[0];
    let follower = (leader + 1) % sim.nodes.len();
    sim.crash(follower);
    sim.nodes[follower].restart_at_ms = u64::MAX;
    // The leader's log moves past everything the follower's log has: it needs a snapshot.
    let mut log = RaftLog::new((1..=NODE_COUNT).collect());
    for record in &sim.nodes[follower].disk.records {
        log.apply_record(record).unwrap();
    }
    let start = sim.now;
    while sim.nodes[leader]
        .replica
        .as_ref()
        .map_or(0, |r| r.log().first_index())
        <= log.last_index() + 1
    {
        assert!(
            sim.now - start < SETTLE_MS_MAX,
            "the leader never compacted"
        );
        assert!(sim.publish_to(leader, 2));
        for _ in 0..20 {
            sim.step();
        }
    }
    sim.crash_next_at = Some(point);
    sim.nodes[follower].restart_at_ms = sim.now;
    while sim.crash_next_at.is_some() {
        assert!(sim.now - start < 2 * SETTLE_MS_MAX, "no install crashed");
        sim.step();
    }
    let node = &sim.nodes[follower];
    let marker = node.marker.clone();
    assert!(node.replica.is_none(), "{}", sim.describe());
    let Some(marker) = marker else {
        panic!("seed {seed}: no marker after a crash at {point:?}");
    };
    // The restart finishes the install; a flush and a crash come before anything else.
    sim.restart(follower);
    let node = &mut sim.nodes[follower];
    assert!(node.marker.is_none());
    assert!(
        node.sm == marker.state(),
        "seed {seed}: the redo left another state"
    );
    assert_eq!(
        node.replica.as_ref().map(Replica::applied),
        Some(marker.point.index)
    );
    node.flushed = node.sm.clone();
    sim.crash(follower);
    sim.nodes[follower].restart_at_ms = sim.now;
    sim.settle();
    sim.check_end();
    assert_eq!(sim.stats.installs_resumed, 1, "{:?}", sim.stats);
}
