//! Prometheus metrics: what a shard records, the snapshot it hands over, and the endpoint.
//!
//! The shards never take a lock on their hot path. Each shard counts in its [`ShardCore`]
//! (`Counters`, plain integers) and records latencies and sizes in its own [`ShardRecorder`]
//! (HdrHistograms behind the shard's `RefCell`). About once a second a low-priority task of the
//! shard turns both into a [`ShardSnapshot`] and stores it in the shard's [`MetricsSlots`] entry:
//! one short mutex hold per shard per second, never contended by another shard. The HTTP thread
//! (`http.rs`) reads the slots on each scrape and encodes them with `prometheus-client`
//! (`encode.rs`). A scrape therefore shows figures up to one snapshot interval old.
//!
//! Who calls it: `crate::server` (one slot per shard, the recorder inside each `Shard`, the
//! endpoint thread started by `run`). Nothing here does I/O except `http.rs`.
//!
//! [`ShardCore`]: crate::pipeline::ShardCore

pub mod encode;
pub mod groups;
pub mod http;
pub mod memory;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::pipeline::ShardStats;

/// How often a shard publishes its snapshot.
pub const SNAPSHOT_INTERVAL: Duration = Duration::from_secs(1);

/// Largest latency a histogram tells apart (60 s, in microseconds); larger ones count as this.
const LATENCY_US_MAX: u64 = 60_000_000;

/// Largest delete batch a histogram tells apart (`delivery.deleteBatchMaxKeys`' upper bound).
const BATCH_KEYS_MAX: u64 = 1_000_000;

/// Significant figures kept by the histograms: 1 % resolution keeps each one a few KiB.
const SIGNIFICANT_FIGURES: u8 = 2;
// HdrHistogram's bounds rules (high >= 2 * low with low = 1, at most 5 significant figures),
// checked when this file compiles.
const _: () = assert!(LATENCY_US_MAX >= 2 && BATCH_KEYS_MAX >= 2 && SIGNIFICANT_FIGURES <= 5);

/// Upper bounds (seconds) of the exported latency buckets.
pub const LATENCY_BUCKETS_S: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Upper bounds (keys) of the exported delete-batch-size buckets.
pub const BATCH_BUCKETS: &[f64] = &[
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0,
];

/// One histogram, accumulated in an HdrHistogram plus an exact sum.
pub struct Recorded {
    hist: Histogram<u64>,
    sum: u64,
    /// Recorded unit per exported unit (1e6 for microseconds exported as seconds).
    units_per_export: f64,
}

impl Recorded {
    fn new(high: u64, units_per_export: f64) -> Recorded {
        // Only the constants above reach here, and the assertions under them prove they are
        // bounds HdrHistogram accepts: this cannot fail on any input.
        let hist = Histogram::new_with_bounds(1, high, SIGNIFICANT_FIGURES)
            .expect("constant histogram bounds are valid");
        Recorded {
            hist,
            sum: 0,
            units_per_export,
        }
    }

    /// Records one value (values above the range count as the largest).
    pub fn record(&mut self, value: u64) {
        self.hist.saturating_record(value);
        self.sum = self.sum.saturating_add(value);
    }

    /// The exported form: per-bucket (not cumulative) counts for `bounds`, then the sum and the
    /// count. Bucket edges are exact to the histogram's resolution (1 %).
    pub fn snapshot(&self, bounds: &[f64]) -> HistogramSnapshot {
        let count = self.hist.len();
        let mut buckets = Vec::with_capacity(bounds.len() + 1);
        let mut below = 0u64;
        for &bound in bounds {
            let high = (bound * self.units_per_export) as u64;
            let cumulative = self.hist.count_between(0, high).min(count);
            buckets.push((bound, cumulative.saturating_sub(below)));
            below = below.max(cumulative);
        }
        buckets.push((f64::INFINITY, count.saturating_sub(below)));
        HistogramSnapshot {
            sum: self.sum as f64 / self.units_per_export,
            count,
            buckets,
        }
    }
}

/// What a scrape shows of one histogram.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// Sum of the observations, in the exported unit.
    pub sum: f64,
    pub count: u64,
    /// `(upper bound, observations in this bucket only)`, the last bound `+Inf`.
    pub buckets: Vec<(f64, u64)>,
}

/// A shard's histograms. Lives inside the shard (no lock); only the shard records.
pub struct ShardRecorder {
    /// Owning shard taking a publish batch → the batch stored at its ack level (µs).
    pub publish_latency: Recorded,
    /// A message's due time → its first delivery handed to the consumer's connection (µs;
    /// shard clock in milliseconds, so the resolution is 1 ms).
    pub delivery_latency: Recorded,
    /// One dispatch pass: planning, storage scans and routing of its deliveries (µs).
    pub dispatch_pass: Recorded,
    /// Keys per applied delete batch.
    pub delete_batch_size: Recorded,
    /// The steps of one message on the wire (issue 23), each on the shard serving the client's
    /// connection (µs): a `publish` call started → its answer ready to write (decode, admission,
    /// the owning shard's store and its cross-core hops).
    pub publish_call: Recorded,
    /// A `deliver` call handed to capnp-rpc → its answer received: the consumer's round trip,
    /// its client library and the network included.
    pub deliver_round_trip: Recorded,
    /// An `ack`, `nack` or `touch` call started → its answer ready to write.
    pub settle_call: Recorded,
}

impl Default for ShardRecorder {
    fn default() -> ShardRecorder {
        ShardRecorder {
            publish_latency: Recorded::new(LATENCY_US_MAX, 1e6),
            delivery_latency: Recorded::new(LATENCY_US_MAX, 1e6),
            dispatch_pass: Recorded::new(LATENCY_US_MAX, 1e6),
            delete_batch_size: Recorded::new(BATCH_KEYS_MAX, 1.0),
            publish_call: Recorded::new(LATENCY_US_MAX, 1e6),
            deliver_round_trip: Recorded::new(LATENCY_US_MAX, 1e6),
            settle_call: Recorded::new(LATENCY_US_MAX, 1e6),
        }
    }
}

impl ShardRecorder {
    pub fn snapshot(&self) -> RecorderSnapshot {
        RecorderSnapshot {
            publish_latency: self.publish_latency.snapshot(LATENCY_BUCKETS_S),
            delivery_latency: self.delivery_latency.snapshot(LATENCY_BUCKETS_S),
            dispatch_pass: self.dispatch_pass.snapshot(LATENCY_BUCKETS_S),
            delete_batch_size: self.delete_batch_size.snapshot(BATCH_BUCKETS),
            publish_call: self.publish_call.snapshot(LATENCY_BUCKETS_S),
            deliver_round_trip: self.deliver_round_trip.snapshot(LATENCY_BUCKETS_S),
            settle_call: self.settle_call.snapshot(LATENCY_BUCKETS_S),
        }
    }
}

/// The exported form of a [`ShardRecorder`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecorderSnapshot {
    pub publish_latency: HistogramSnapshot,
    pub delivery_latency: HistogramSnapshot,
    pub dispatch_pass: HistogramSnapshot,
    pub delete_batch_size: HistogramSnapshot,
    pub publish_call: HistogramSnapshot,
    pub deliver_round_trip: HistogramSnapshot,
    pub settle_call: HistogramSnapshot,
}

/// Storage-engine figures of one shard, for engines that keep them (the LSM log).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StorageFigures {
    pub wal_bytes_written: u64,
    pub wal_writes: u64,
    pub wal_fsyncs: u64,
    pub wal_live_bytes: u64,
    pub memtable_bytes: u64,
    pub frozen_memtable_bytes: u64,
    pub tables: u64,
    pub table_bytes: u64,
    pub flushes: u64,
    pub compactions: u64,
    pub compaction_bytes_read: u64,
    pub compaction_bytes_written: u64,
    /// Bytes memtable flushes wrote to tables (what survived annihilation).
    pub flush_bytes_written: u64,
    pub write_stalls: u64,
}

impl From<&crate::storage::engine::LsmStats> for StorageFigures {
    fn from(s: &crate::storage::engine::LsmStats) -> StorageFigures {
        StorageFigures {
            wal_bytes_written: s.wal_bytes_written,
            wal_writes: s.wal_writes,
            wal_fsyncs: s.wal_fsyncs,
            wal_live_bytes: s.wal_live_bytes,
            memtable_bytes: s.memtable_bytes as u64,
            frozen_memtable_bytes: s.frozen_bytes as u64,
            tables: s.tables as u64,
            table_bytes: s.table_bytes,
            flushes: s.flushes,
            compactions: s.compactions,
            compaction_bytes_read: s.compaction_bytes_read,
            compaction_bytes_written: s.compaction_bytes_written,
            flush_bytes_written: s.flush_bytes_written,
            write_stalls: s.write_stalls,
        }
    }
}

/// Raft figures of one shard's replica, in a cluster.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RaftFigures {
    pub term: u64,
    /// This replica leads and serves the shard.
    pub serving: bool,
    pub commit: u64,
    pub applied: u64,
    /// Times this replica saw the shard's leader change.
    pub leader_changes: u64,
    /// Raft messages dropped between the replica and the transport, by where.
    pub drops: RaftDrops,
    /// Peer nodes the shard's own transport is connected to now.
    pub peers_connected: u64,
    /// Connections the shard's own transport established (both handshakes accepted).
    pub connections_established: u64,
    /// Handshakes of the shard's transport refused, either side.
    pub handshake_refusals: u64,
    /// Accepted peer connections the shard closed unserved: too many handshakes in progress,
    /// or (the listening shard) the connection's shard could not take it.
    pub connections_shed: u64,
    /// Subscription closes another shard could not take (it had stopped).
    pub closes_lost: u64,
    /// A proposal → its entry committed and applied here (leader only).
    pub commit_latency: HistogramSnapshot,
    /// Entries per log record written (one record per Ready).
    pub append_batch_entries: HistogramSnapshot,
    /// Leader only: entries each follower lacks of the commit index, by peer node id.
    pub follower_lag: Vec<(u64, u64)>,
}

/// Raft messages a shard dropped on their way between its replica and the peers, by where
/// (Raft retransmits what is lost; none vanishes uncounted), its own transport's included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RaftDrops {
    /// The driver's outbox to the shard's sender loop was full.
    pub outbox_full: u64,
    /// Always 0 since every shard runs its own transport (its messages no longer cross to shard
    /// 0); kept so that the `reason` label's series stay.
    pub to_transport_full: u64,
    /// Always 0 since every shard runs its own transport (a peer's messages no longer cross
    /// from shard 0); kept so that the `reason` label's series stay.
    pub to_replica_full: u64,
    /// The transport's queue to a peer was full.
    pub transport_queue_full: u64,
    /// The peer was not connected.
    pub peer_not_connected: u64,
    /// A message larger than `cluster.maxFrameBytes`.
    pub oversize: u64,
    /// An inbound message of another shard, or not from the connected peer.
    pub inbound: u64,
    /// A leader's entries left unanswered while this replica's log was at its byte cap with a
    /// flush on its way (`storage.walMaxBytes`); the leader sends them again.
    pub log_full: u64,
    /// A snapshot chunk or chunk request left for later: the leader's chunk senders or the
    /// follower's chunk queue were busy (the follower asks again).
    pub snapshot_busy: u64,
    /// A snapshot message that could not be read (damaged, or a kind this build does not know).
    pub snapshot_malformed: u64,
}

impl RaftDrops {
    /// Each count with its `reason` label.
    pub fn by_reason(&self) -> [(&'static str, u64); 10] {
        [
            ("outbox_full", self.outbox_full),
            ("to_transport_full", self.to_transport_full),
            ("to_replica_full", self.to_replica_full),
            ("transport_queue_full", self.transport_queue_full),
            ("peer_not_connected", self.peer_not_connected),
            ("oversize", self.oversize),
            ("inbound", self.inbound),
            ("log_full", self.log_full),
            ("snapshot_busy", self.snapshot_busy),
            ("snapshot_malformed", self.snapshot_malformed),
        ]
    }
}

/// A replica's histograms (see [`RaftFigures`]); lives in the replicated store.
pub struct RaftRecorder {
    pub commit_latency: Recorded,
    pub append_batch_entries: Recorded,
}

impl Default for RaftRecorder {
    fn default() -> RaftRecorder {
        RaftRecorder {
            commit_latency: Recorded::new(LATENCY_US_MAX, 1e6),
            append_batch_entries: Recorded::new(BATCH_KEYS_MAX, 1.0),
        }
    }
}

/// Why a shard is not healthy, as `/healthz` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// Writes are refused until space returns; the text names what failed.
    DiskFull(String),
    /// Unreadable table blocks were skipped (their messages are lost to corruption).
    UnreadableBlocks(u64),
    /// The shard does not accept work (the text says why).
    Fenced(String),
    /// Start-up dropped WAL records (a torn last write, or a truncation the operator accepted):
    /// the text names the file, byte offset and count. The shard serves: degraded, not
    /// unhealthy, until the next restart.
    WalTailDropped(String),
}

impl Problem {
    /// The problem's name as the `problem` label of `pinq_shard_problem` carries it.
    pub fn label(&self) -> &'static str {
        match self {
            Problem::DiskFull(_) => "disk_full",
            Problem::UnreadableBlocks(_) => "unreadable_blocks",
            Problem::Fenced(_) => "fenced",
            Problem::WalTailDropped(_) => "wal_tail_dropped",
        }
    }

    /// Whether the shard still serves everything with this problem: `/healthz` then answers
    /// 200 `degraded` instead of 503.
    pub fn is_degraded_only(&self) -> bool {
        matches!(self, Problem::WalTailDropped(_))
    }

    /// Every label, in the order the metric lists them.
    pub const LABELS: [&'static str; 4] = [
        "disk_full",
        "unreadable_blocks",
        "fenced",
        "wal_tail_dropped",
    ];
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::DiskFull(what) => {
                write!(f, "disk full, writes refused until space returns ({what})")
            }
            Problem::UnreadableBlocks(n) => write!(
                f,
                "{n} unreadable table block(s) skipped (see pinq doctor --data-dir)"
            ),
            Problem::Fenced(why) => write!(f, "fenced: {why}"),
            Problem::WalTailDropped(what) => {
                write!(f, "degraded: {what} (reported until the next restart)")
            }
        }
    }
}

/// Everything a scrape shows of one shard.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardSnapshot {
    pub stats: ShardStats,
    /// Empty while the shard is healthy.
    pub problems: Vec<Problem>,
    /// Refusals of client requests by code (`pinq_refusals_total`).
    pub refusals: crate::rpc::refusal::RefusalCounts,
    /// Refusals of the permission model by reason (`pinq_auth_refusals_total`).
    pub auth_refusals: crate::security::auth::AuthRefusalCounts,
    pub histograms: RecorderSnapshot,
    /// `None` for engines without figures (the in-memory store): nothing is exported then.
    pub storage: Option<StorageFigures>,
    /// `None` for a standalone broker.
    pub raft: Option<RaftFigures>,
    /// The shard's byte bounds on client connections (`pinq_client_*`).
    pub client_memory: memory::ClientMemoryFigures,
}

/// A shard whose last snapshot is older than this is reported stalled by `/healthz`: its
/// background task has not run for ten snapshot intervals.
pub const STALLED_AFTER: Duration = Duration::from_secs(10);

/// A shard's latest snapshot and when it was taken; `None` until its first.
type Slot = Mutex<Option<(Instant, ShardSnapshot)>>;

/// One slot per shard, and what the node knows of itself at start-up.
#[derive(Clone, Debug, Default)]
pub struct MetricsSlots {
    slots: Arc<Vec<Slot>>,
    /// The server certificate's file and its end of validity (Unix seconds), with TLS on.
    certificate: Option<Arc<(String, i64)>>,
}

impl MetricsSlots {
    pub fn new(shards: usize) -> MetricsSlots {
        MetricsSlots {
            slots: Arc::new((0..shards).map(|_| Mutex::new(None)).collect()),
            certificate: None,
        }
    }

    /// Exports the end of validity of the server certificate read from `file`
    /// (`pinq_tls_certificate_expiry_timestamp_seconds`).
    pub fn with_certificate(mut self, file: String, not_after_s: i64) -> MetricsSlots {
        self.certificate = Some(Arc::new((file, not_after_s)));
        self
    }

    /// The server certificate's file and end of validity, with TLS on.
    pub fn certificate(&self) -> Option<(&str, i64)> {
        self.certificate.as_deref().map(|(f, t)| (f.as_str(), *t))
    }

    /// Stores shard `shard`'s latest snapshot (called by that shard only).
    pub fn publish(&self, shard: usize, snapshot: ShardSnapshot) {
        if let Some(slot) = self.slots.get(shard) {
            // A poisoned slot only means a scrape panicked while reading it: the data is whole.
            let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
            *guard = Some((Instant::now(), snapshot));
        }
    }

    /// Copies of every shard's latest snapshot, in shard order (`None` before the first one).
    pub fn read(&self) -> Vec<Option<ShardSnapshot>> {
        self.read_aged()
            .into_iter()
            .map(|s| s.map(|(_, s)| s))
            .collect()
    }

    /// Like [`MetricsSlots::read`], with how long ago each snapshot was taken.
    pub fn read_aged(&self) -> Vec<Option<(Duration, ShardSnapshot)>> {
        self.slots
            .iter()
            .map(|slot| {
                let guard = slot.lock().unwrap_or_else(|p| p.into_inner());
                guard.as_ref().map(|(at, s)| (at.elapsed(), s.clone()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_snapshot_puts_each_value_in_its_bucket_once() {
        let mut r = Recorded::new(LATENCY_US_MAX, 1e6);
        r.record(40); // 40 µs → first bucket (≤ 50 µs)
        r.record(900); // 0.9 ms → ≤ 1 ms
        r.record(120_000_000); // above range → saturates at 60 s → +Inf
        let s = r.snapshot(LATENCY_BUCKETS_S);
        assert_eq!(s.count, 3);
        assert_eq!(s.buckets.len(), LATENCY_BUCKETS_S.len() + 1);
        assert_eq!(s.buckets[0], (0.000_05, 1));
        let ms = s.buckets.iter().find(|(b, _)| *b == 0.001).unwrap();
        assert_eq!(ms.1, 1);
        assert_eq!(s.buckets.last().unwrap().1, 1);
        assert_eq!(s.buckets.iter().map(|(_, n)| n).sum::<u64>(), 3);
        assert!((s.sum - (40.0 + 900.0 + 120_000_000.0) / 1e6).abs() < 1e-9);
    }

    #[test]
    fn slots_hold_the_latest_snapshot_per_shard() {
        let slots = MetricsSlots::new(2);
        assert_eq!(slots.read(), vec![None, None]);
        let mut snap = ShardSnapshot::default();
        snap.stats.in_flight = 7;
        slots.publish(1, snap.clone());
        let read = slots.read();
        assert!(read[0].is_none());
        assert_eq!(read[1].as_ref().map(|s| s.stats.in_flight), Some(7));
    }
}
