//! pinq's configuration: every key with its default, loaded from TOML, flags and `PINQ_` env vars.
//!
//! The structs here are what the rest of pinq reads; units are in the field names, and a value that
//! reaches them has been validated. Loading and validation (unknown keys, zero intervals,
//! out-of-range values, each error naming its key) live in `load.rs`; `pinq.example.toml` at the
//! repository root lists every key with its default, and a test keeps it equal to
//! [`Config::default`]. Nothing here is read on a hot path: shards copy what they need at start-up.

mod bytes;
mod cpus;
mod load;

pub use bytes::{format_byte_size, parse_byte_size, ByteSizeError};
pub use cpus::{allowed_cpus_from_status, format_cpu_list, online_cpus, CpuList, CpuListError};
pub use load::{env_from_process, env_var_name, ConfigError, ConfigLoader, Origin, ENV_PREFIX};

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// Everything `pinq serve` is configured with. Build it with [`ConfigLoader`]; `Default` is the
/// embedded defaults (standalone, `./data`, all CPUs, client port 7400, metrics on 9400).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    pub delivery: DeliveryConfig,
    pub publish: PublishConfig,
    pub server: ServerConfig,
    pub storage: StorageConfig,
    /// `[cluster]`: `None` (no `cluster.nodeId`) runs pinq standalone, exactly as without Raft.
    pub cluster: Option<ClusterConfig>,
    /// `[server.tls]` and `[[auth.tokens]]`.
    pub security: SecurityConfig,
}

/// TLS on the client ports and the tokens clients must present (`crate::security`). The
/// default is plain TCP and no token: anyone who reaches the port may do everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SecurityConfig {
    /// `[server.tls]`; `None` (no `certFile`) serves plain TCP.
    pub tls: Option<crate::security::tls::TlsFiles>,
    /// `[[auth.tokens]]`; empty: no token is asked for.
    pub tokens: Vec<crate::security::auth::TokenSpec>,
}

/// Delivery pipeline settings (`[delivery]` in TOML).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryConfig {
    /// `delivery.dispatchPollInterval`: the longest a dispatcher sleeps between passes.
    pub dispatch_poll_interval_ms: u64,
    /// `delivery.inFlightTimeout`: a copy not ACKed within this is redelivered.
    pub in_flight_timeout_ms: u64,
    /// `delivery.deleteBatchInterval`: how often the deleter flushes a partial batch.
    pub delete_batch_interval_ms: u64,
    /// `delivery.deleteBatchMaxKeys`: the most keys in one delete command.
    pub delete_batch_keys_max: usize,
    /// `delivery.deleteBatchesInFlight`: delete batches written at once (one group commit of the
    /// WAL can cover several).
    pub delete_batches_in_flight_max: usize,
    /// `delivery.deleteBacklogMaxKeys`: keys waiting for deletion (queued or in batches not yet
    /// applied) at which dispatch pauses on the shard until the deletes catch up.
    pub delete_backlog_keys_max: usize,
    /// `delivery.ttlSweepInterval`: how often the janitor sweeps the whole shard.
    pub ttl_sweep_interval_ms: u64,
    /// `delivery.consumerQueueSize`: bounded queue of each consumer.
    pub consumer_queue_len_max: usize,
    /// `delivery.timeBucket`: width of a due bucket in the event key.
    pub time_bucket_ms: u64,
    /// `delivery.groupRetention`: a group with no consumer this long is forgotten with its claims.
    pub group_retention_ms: u64,
    /// `delivery.maxUnackedPerConsumer`: copies a consumer may hold unacknowledged (prefetch).
    pub unacked_per_consumer_max: usize,
    /// `delivery.retryQueueSize`: copies waiting for redelivery per topic before scanning pauses.
    pub retry_len_max: usize,
    /// `delivery.scanBatchSize`: keys read per topic per scan request.
    pub scan_batch_len_max: usize,
    /// `delivery.maxGroupsPerTopic`: groups of one topic on a shard, with consumers or not.
    pub groups_per_topic_max: usize,
    /// `delivery.maxGroupsPerShard`: groups of all topics on a shard, with consumers or not.
    pub groups_per_shard_max: usize,
    /// `delivery.maxConsumersPerGroup`: consumers of one group (and universal consumers of one
    /// topic).
    pub consumers_per_group_max: usize,
    /// `delivery.maxCountedTopics`: topics whose stored, due and scheduled messages a shard
    /// counts one by one (figures); the messages of topics past it are summed as one.
    pub counted_topics_max: usize,
    /// `delivery.maxGroupMetrics`: groups of a shard exported with their own labels; the rest
    /// are summed under `group="_other"`.
    pub group_metrics_max: usize,
    /// `delivery.maxDeliveries`: deliveries of one copy before it is dead-lettered (0 =
    /// unlimited); a group's policy may override it.
    pub max_deliveries: u32,
    /// `delivery.deadLetterTopic`: where dead letters go; `{topic}` stands for the source topic.
    pub dead_letter_topic: String,
    /// `delivery.redeliveryBackoff`: wait before a redelivery after a plain NACK or a lease
    /// timeout, `INITIAL:MAX` (none: at once).
    pub redelivery_backoff: Option<crate::pipeline::policy::Backoff>,
}

impl Default for DeliveryConfig {
    fn default() -> DeliveryConfig {
        DeliveryConfig {
            dispatch_poll_interval_ms: 50,
            in_flight_timeout_ms: 5_000,
            delete_batch_interval_ms: 500,
            delete_batch_keys_max: 65_536,
            delete_batches_in_flight_max: 4,
            delete_backlog_keys_max: 262_144,
            ttl_sweep_interval_ms: 60_000,
            consumer_queue_len_max: 1024,
            time_bucket_ms: 1,
            group_retention_ms: 24 * 3600 * 1000,
            unacked_per_consumer_max: 16_384,
            retry_len_max: 65_536,
            scan_batch_len_max: 256,
            groups_per_topic_max: 1024,
            groups_per_shard_max: 16_384,
            consumers_per_group_max: 1024,
            counted_topics_max: 4096,
            group_metrics_max: 256,
            max_deliveries: 0,
            dead_letter_topic: crate::pipeline::policy::DEAD_LETTER_TOPIC_DEFAULT.to_owned(),
            redelivery_backoff: None,
        }
    }
}

/// Acknowledgement level of a publish, weakest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AckLevel {
    /// Replied to once the batch is accepted; nothing waited on.
    None,
    /// Replied to once appended in memory (and, in a cluster, by the leader), not yet fsynced.
    Leader,
    /// Replied to once fsynced (and, in a cluster, committed by a quorum).
    Durable,
}

/// Publish settings (`[publish]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishConfig {
    /// `publish.maxMessageBytes`: largest payload accepted.
    pub message_bytes_max: usize,
    /// `publish.maxBatchMessages`: most messages in one publish batch.
    pub batch_len_max: usize,
    /// `publish.minAckLevel`: requests weaker than this are rejected.
    pub ack_level_min: AckLevel,
    /// `publish.maxBytesInFlight`: bytes of publishes (payload and headers) a shard holds for
    /// its connections before later publishes wait for room (`crate::server::limits`).
    pub bytes_in_flight_max: usize,
    /// `publish.dedupWindow`: how long a shard remembers a stored (producer id, sequence), so a
    /// republished one is answered with its original tag instead of being stored again.
    pub dedup_window_ms: u64,
    /// `publish.dedupMaxProducers`: producers a shard remembers sequences for; past it the least
    /// recently used producer is forgotten.
    pub dedup_producers_max: usize,
    /// `publish.dedupMaxEntries`: (producer, sequence) entries a shard remembers; past it the
    /// oldest entry is forgotten before its window ends.
    pub dedup_entries_max: usize,
}

impl Default for PublishConfig {
    fn default() -> PublishConfig {
        PublishConfig {
            message_bytes_max: 1 << 20,
            batch_len_max: 10_000,
            ack_level_min: AckLevel::None,
            bytes_in_flight_max: 64 << 20,
            dedup_window_ms: 120_000,
            dedup_producers_max: 1024,
            dedup_entries_max: 262_144,
        }
    }
}

impl AckLevel {
    /// The spelling used in the config, on the command line and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            AckLevel::None => "none",
            AckLevel::Leader => "leader",
            AckLevel::Durable => "durable",
        }
    }

    /// Reads `"none"`, `"leader"` or `"durable"`.
    pub fn parse(text: &str) -> Option<AckLevel> {
        match text {
            "none" => Some(AckLevel::None),
            "leader" => Some(AckLevel::Leader),
            "durable" => Some(AckLevel::Durable),
            _ => None,
        }
    }
}

/// Client port of a standalone broker.
pub const LISTEN_PORT_DEFAULT: u16 = 7400;

/// Port of the Prometheus endpoint.
pub const METRICS_PORT_DEFAULT: u16 = 9400;

/// Process-level settings (`[server]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// `server.dataDir`: where each shard keeps its WAL and tables.
    pub data_dir: PathBuf,
    /// `server.cpus`: one shard per CPU, pinned; shard `i` runs on `cpus.cpus()[i]`.
    pub cpus: CpuList,
    /// `server.listen`: the client port every shard accepts on (SO_REUSEPORT).
    pub listen: SocketAddr,
    /// `server.metricsListen`: the Prometheus `/metrics` and `/healthz` endpoint.
    pub metrics_listen: SocketAddr,
    /// `server.shardPortBase`: first per-shard port (shard `i` on base + `i`); `None` means the
    /// client port + 1. See [`ServerConfig::shard_listen`].
    pub shard_port_base: Option<u16>,
    /// `server.numa`: `auto` narrows `cpus` to the CPUs of one NUMA node at start-up
    /// (`crate::ops::numa`); `off` uses `cpus` as given.
    pub numa: NumaMode,
    /// What one client may make the server hold (`crate::server::limits`).
    pub client: ClientLimits,
    /// `server.idlePoll`: how long a shard's executor keeps polling for work (spinning on its
    /// CPU) before it sleeps in the kernel; 0 sleeps at once. Spinning spares a sleep and a
    /// wake (and glommio's `membarrier` before each sleep) when the next request comes soon,
    /// at the price of that much CPU burnt after each burst of work (`tuning.md`).
    pub idle_poll_us: u64,
}

/// Bounds on what one client connection may make the server hold (`[server]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientLimits {
    /// `server.maxConnections`: client connections of the whole node (every shard and port).
    pub connections_max: usize,
    /// `server.idleTimeout`: a connection with no call in flight, no subscription and no byte
    /// received for this long is closed.
    pub idle_timeout_ms: u64,
    /// `server.frameTimeout`: a request frame begun but not complete for this long closes its
    /// connection.
    pub frame_timeout_ms: u64,
    /// `server.deliverTimeout`: a `deliver` call the client has not answered for this long
    /// resets its connection (`crate::server::receipts`).
    pub deliver_timeout_ms: u64,
    /// `server.maxCallsInFlight`: calls of one connection being served at once.
    pub calls_in_flight_max: usize,
    /// `server.maxSubscriptionsPerConnection`: subscriptions open on one connection.
    pub subscriptions_max: usize,
    /// `server.maxSendBufferBytes`: bytes of `Consumer.deliver` calls one connection may have
    /// sent and not had answered (across all its subscriptions); past it its deliveries wait.
    pub send_buffer_bytes_max: usize,
    /// `server.maxNodeSendBufferBytes`: the same bound for every connection of the node
    /// together, split evenly between the shards.
    pub node_send_buffer_bytes_max: usize,
    /// `server.sendStallTimeout`: a connection whose deliveries wait for room and none of whose
    /// `deliver` calls returned for this long is closed, and its copies released.
    pub send_stall_timeout_ms: u64,
}

impl Default for ClientLimits {
    fn default() -> ClientLimits {
        ClientLimits {
            connections_max: 4096,
            idle_timeout_ms: 300_000,
            frame_timeout_ms: 10_000,
            deliver_timeout_ms: 15_000,
            calls_in_flight_max: 1024,
            subscriptions_max: 256,
            send_buffer_bytes_max: 16 << 20,
            node_send_buffer_bytes_max: 256 << 20,
            send_stall_timeout_ms: 30_000,
        }
    }
}

/// How `pinq serve` places shards across NUMA nodes (`server.numa`, `--numa`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NumaMode {
    /// Use `server.cpus` as given.
    Off,
    /// Keep only the CPUs of one node: the NIC's node, else the node with most of `server.cpus`.
    Auto,
}

impl NumaMode {
    /// The spelling used in the config and by `--numa`.
    pub fn as_str(self) -> &'static str {
        match self {
            NumaMode::Off => "off",
            NumaMode::Auto => "auto",
        }
    }
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            data_dir: PathBuf::from("./data"),
            cpus: CpuList::all_online(),
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), LISTEN_PORT_DEFAULT),
            metrics_listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), METRICS_PORT_DEFAULT),
            shard_port_base: None,
            numa: NumaMode::Off,
            client: ClientLimits::default(),
            idle_poll_us: 0,
        }
    }
}

impl ServerConfig {
    /// The address shard `shard_index` listens on besides the shared client port, for shard-aware
    /// clients: the IP of `listen`, port `shardPortBase + shard_index`, by default one above
    /// `listen`'s port plus `shard_index`. Port 0 asks the OS for an ephemeral port: every shard
    /// gets one when `shardPortBase` is 0, or when it is unset and `listen` itself uses port 0
    /// (tests); `topology()` must then report the ports actually bound. Validation guarantees the
    /// ports of all shards fit below 65536.
    pub fn shard_listen(&self, shard_index: usize) -> SocketAddr {
        assert!(
            shard_index < self.cpus.len(),
            "shard {shard_index} of {}",
            self.cpus.len()
        );
        let base = match self.shard_port_base {
            Some(base) => base,
            None if self.listen.port() == 0 => 0,
            None => self.listen.port().saturating_add(1),
        };
        let port = if base == 0 {
            0
        } else {
            u16::try_from(shard_index)
                .ok()
                .and_then(|index| base.checked_add(index))
                .unwrap_or(0)
        };
        SocketAddr::new(self.listen.ip(), port)
    }
}

/// Which storage engine the shards run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageEngine {
    /// The io_uring LSM log: WAL, memtable, sorted tables, compaction. Durable.
    Lsm,
    /// Everything in memory: nothing survives a restart. For tests and benchmarks.
    Memory,
}

impl StorageEngine {
    /// The spelling used in the config and by `--storage`.
    pub fn as_str(self) -> &'static str {
        match self {
            StorageEngine::Lsm => "lsm",
            StorageEngine::Memory => "memory",
        }
    }
}

/// Storage settings (`[storage]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageConfig {
    /// `storage.engine`.
    pub engine: StorageEngine,
    /// `storage.memtableBytes`: a shard's memtable is frozen and flushed to a table at this size.
    pub memtable_bytes_max: usize,
    /// `storage.walSegmentBytes`: a WAL segment file is closed and a new one started at this size.
    pub wal_segment_bytes_max: u64,
    /// `storage.walMaxBytes`: disk a shard's WAL may take (headers, padding and preallocated
    /// zeros included). At this size the memtable is frozen so its segments can be released,
    /// and appends wait while a flush that will release them runs. Default: 256 MiB or four
    /// memtables, whichever is larger.
    pub wal_bytes_max: u64,
    /// `pinq serve --recover-truncated-wal` (a flag only, never a config key: it accepts a loss
    /// once): a WAL segment shorter than it was written is cut there instead of refused.
    pub recover_truncated_wal: bool,
}

impl Default for StorageConfig {
    fn default() -> StorageConfig {
        StorageConfig {
            engine: StorageEngine::Lsm,
            memtable_bytes_max: 64 << 20,
            wal_segment_bytes_max: 64 << 20,
            wal_bytes_max: 256 << 20,
            recover_truncated_wal: false,
        }
    }
}

/// Raft replication settings (`[cluster]`). Present only when `cluster.nodeId` is set; the loader
/// then requires `raftListen` and `peers` too, and has checked that this node is one of the peers,
/// at `raftListen`, and that ids and addresses are unique.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// `cluster.nodeId`: this node's Raft id, positive (raft-rs reserves 0 for "none").
    pub node_id: u64,
    /// `cluster.raftListen`: where this node accepts connections from its peers.
    pub raft_listen: SocketAddr,
    /// `cluster.peers`: every member's Raft address by node id, this node included: a new
    /// cluster's first membership (the membership stored in the log wins later). With
    /// `cluster.join`, only this node.
    pub peers: BTreeMap<u64, SocketAddr>,
    /// `cluster.join`: a running member's client address; this node starts as nobody's member
    /// and serves nothing until `pinq cluster add-node` adds it.
    pub join: Option<String>,
    /// `cluster.advertise`: the client address this node gives peers and clients (by default
    /// `server.listen`, which must then be a concrete IP and port).
    pub advertise: SocketAddr,
    /// `cluster.tickInterval`: one Raft tick.
    pub tick_interval: Duration,
    /// `cluster.heartbeatTicks`: ticks between a leader's heartbeats.
    pub heartbeat_ticks: usize,
    /// `cluster.electionTicks`: ticks without a leader before a follower campaigns (raft-rs
    /// randomises it within `[electionTicks, 2 × electionTicks)`); greater than `heartbeatTicks`.
    pub election_ticks: usize,
    /// `cluster.logRetainEntries`: entries a leader keeps past what every follower has; a follower
    /// further behind gets a snapshot.
    pub log_retain_entries: u64,
    /// `cluster.outboundQueueMessages`: Raft messages queued per peer for sending; more are
    /// dropped and counted (Raft retransmits).
    pub outbound_queue_messages: usize,
    /// `cluster.maxFrameBytes`: largest frame sent to or accepted from a peer, and the Cap'n Proto
    /// traversal limit of the reader; see [`ClusterConfig::entry_bytes_max`].
    pub max_frame_bytes: usize,
    /// `[cluster.tls]`: mutual TLS on the Raft port; `None` (no file set) is plain TCP.
    pub tls: Option<crate::security::node::NodeTlsFiles>,
}

/// Bytes of a frame that are not entry payload, reserved by [`ClusterConfig::entry_bytes_max`]:
/// the Cap'n Proto segment table and pointers, the `Frame`, `ShardMessage` and `RaftMessage`
/// structs and each entry's own header (a few hundred bytes for a message carrying one entry).
pub const FRAME_OVERHEAD_BYTES: usize = 64 << 10;

impl ClusterConfig {
    /// The largest `data` + `context` of one Raft entry (or a snapshot's data) that still fits in
    /// one frame. A Raft message always carries at least one entry, however large, so a proposal
    /// above this could never reach a follower: the shard must refuse it (raft's
    /// `max_size_per_msg` should not exceed it either).
    pub fn entry_bytes_max(&self) -> usize {
        self.max_frame_bytes.saturating_sub(FRAME_OVERHEAD_BYTES)
    }

    /// The election timeout: `electionTicks × tickInterval`.
    pub fn election_timeout(&self) -> Duration {
        self.tick_interval
            .saturating_mul(u32::try_from(self.election_ticks).unwrap_or(u32::MAX))
    }
}
