//! The `[cluster]` section: converting and validating the Raft settings into
//! [`ClusterConfig`](super::super::ClusterConfig).
//!
//! A node is clustered exactly when `cluster.nodeId` is set; then `raftListen` and `peers` are
//! required, and any other `cluster.*` key without `nodeId` is refused (a half-configured node must
//! not start standalone and quietly diverge from its peers). The membership rules here are the
//! static ones a node can check alone: this node is a member at `raftListen`, ids and addresses are
//! unique, and every address is one a peer can dial. Agreement *between* nodes (same members, same
//! shard count) is checked at the transport's handshake (`crate::cluster::wire::check_hello`).

#![allow(unused_imports)]
use super::*;

use super::super::{ClusterConfig, FRAME_OVERHEAD_BYTES};
use crate::security::node::NodeTlsFiles;

/// Default `cluster.tickInterval`: with 2 heartbeat and 10 election ticks, a follower campaigns
/// 500 ms to 1 s after its leader went silent.
const TICK_INTERVAL_DEFAULT: Duration = Duration::from_millis(50);
const TICK_INTERVAL_MAX: Duration = Duration::from_secs(10);
const HEARTBEAT_TICKS_DEFAULT: usize = 2;
const HEARTBEAT_TICKS_LIMIT: usize = 1_000;
const ELECTION_TICKS_DEFAULT: usize = 10;
const ELECTION_TICKS_LIMIT: usize = 10_000;
const LOG_RETAIN_ENTRIES_DEFAULT: usize = 100_000;
const LOG_RETAIN_ENTRIES_LIMIT: usize = 100_000_000;
const OUTBOUND_QUEUE_MESSAGES_DEFAULT: usize = 4096;
const OUTBOUND_QUEUE_MESSAGES_LIMIT: usize = 1 << 20;
const MAX_FRAME_BYTES_DEFAULT: u64 = 64 << 20;
const MAX_FRAME_BYTES_MIN: u64 = 1 << 20;
const MAX_FRAME_BYTES_LIMIT: u64 = 1 << 30;
/// More members than this is a typo, not a cluster: every shard's leader replicates to all.
const MEMBERS_LIMIT: usize = 64;

/// The keys of `[cluster]` besides `nodeId`, in the order a missing one is reported.
const DEPENDENT_KEYS: [&str; 13] = [
    "raftListen",
    "peers",
    "join",
    "advertise",
    "tickInterval",
    "heartbeatTicks",
    "electionTicks",
    "logRetainEntries",
    "outboundQueueMessages",
    "maxFrameBytes",
    "tlsCertFile",
    "tlsKeyFile",
    "tlsCaFile",
];

/// The `[cluster.tls]` keys as flattened, with their names inside the table.
const TLS_KEYS: [(&str, &str); 3] = [
    ("cluster.tlsCertFile", "certFile"),
    ("cluster.tlsKeyFile", "keyFile"),
    ("cluster.tlsCaFile", "caFile"),
];

impl ConfigLoader {
    /// `[cluster]` as a [`ClusterConfig`], or `None` when no cluster key is set. Needs the
    /// converted `[server]` and `[publish]` for the checks that involve them.
    pub(super) fn cluster(
        &self,
        raw: RawCluster,
        server: &ServerConfig,
        publish: &PublishConfig,
    ) -> Result<Option<ClusterConfig>, ConfigError> {
        let Some(node_id) = raw.node_id else {
            let set = DEPENDENT_KEYS
                .iter()
                .find(|key| self.origin(&format!("cluster.{key}")) != Origin::Default);
            return match set {
                None => Ok(None),
                Some(key) => Err(self.invalid(
                    "cluster.nodeId",
                    format!(
                        "must be set when cluster.{key} is ({}): a node without an id would run standalone",
                        self.origin(&format!("cluster.{key}"))
                    ),
                )),
            };
        };
        if node_id == 0 {
            return Err(self.invalid(
                "cluster.nodeId",
                "must be greater than zero (Raft reserves 0 for \"no node\")",
            ));
        }
        let Some(raft_listen_text) = raw.raft_listen.as_deref() else {
            return Err(self.invalid(
                "cluster.raftListen",
                format!(
                    "must be set when cluster.nodeId is ({}): the address this node accepts its peers on",
                    self.origin("cluster.nodeId")
                ),
            ));
        };
        let raft_listen = self.address("cluster.raftListen", raft_listen_text)?;
        let (peers, join) = self.members_or_join(&raw, node_id, raft_listen)?;

        let advertise = self.advertise(raw.advertise.as_deref(), server)?;

        let (tick_interval_ms, heartbeat_ticks, election_ticks) = self.raft_timing(&raw)?;
        let log_retain_entries = self.count(
            "cluster.logRetainEntries",
            raw.log_retain_entries,
            LOG_RETAIN_ENTRIES_DEFAULT,
            LOG_RETAIN_ENTRIES_LIMIT,
        )? as u64;
        let outbound_queue_messages = self.count(
            "cluster.outboundQueueMessages",
            raw.outbound_queue_messages,
            OUTBOUND_QUEUE_MESSAGES_DEFAULT,
            OUTBOUND_QUEUE_MESSAGES_LIMIT,
        )?;
        let max_frame_bytes = self.max_frame_bytes(&raw, publish)?;

        let cluster = ClusterConfig {
            node_id,
            raft_listen,
            peers,
            join,
            advertise,
            tick_interval: Duration::from_millis(tick_interval_ms),
            heartbeat_ticks,
            election_ticks,
            log_retain_entries,
            outbound_queue_messages,
            max_frame_bytes,
            tls: self.cluster_tls(&raw.tls_cert_file, &raw.tls_key_file, &raw.tls_ca_file)?,
        };
        self.check_cluster_ports(&cluster, server)?;
        Ok(Some(cluster))
    }

    /// `cluster.advertise`, or `server.listen` when that is an address a client can connect to.
    fn advertise(
        &self,
        advertise: Option<&str>,
        server: &ServerConfig,
    ) -> Result<SocketAddr, ConfigError> {
        Ok(match advertise {
            Some(text) => {
                let advertise = self.address("cluster.advertise", text)?;
                if advertise.ip().is_unspecified() || advertise.port() == 0 {
                    return Err(self.invalid(
                        "cluster.advertise",
                        format!(
                            "{advertise} is not an address a client can connect to: give this node's own IP and client port"
                        ),
                    ));
                }
                advertise
            }
            None if server.listen.ip().is_unspecified() || server.listen.port() == 0 => {
                return Err(self.invalid(
                    "cluster.advertise",
                    format!(
                        "must be set because server.listen ({}) is not an address a client can connect to: give this node's own IP and client port",
                        server.listen
                    ),
                ))
            }
            None => server.listen,
        })
    }

    /// `cluster.tickInterval` (ms), `heartbeatTicks` and `electionTicks`, the election longer
    /// than the heartbeat.
    fn raft_timing(&self, raw: &RawCluster) -> Result<(u64, usize, usize), ConfigError> {
        let tick_interval_ms = self.millis(
            "cluster.tickInterval",
            raw.tick_interval,
            u64::try_from(TICK_INTERVAL_DEFAULT.as_millis()).unwrap_or(u64::MAX),
            TICK_INTERVAL_MAX,
        )?;
        let heartbeat_ticks = self.count(
            "cluster.heartbeatTicks",
            raw.heartbeat_ticks,
            HEARTBEAT_TICKS_DEFAULT,
            HEARTBEAT_TICKS_LIMIT,
        )?;
        let election_ticks = self.count(
            "cluster.electionTicks",
            raw.election_ticks,
            ELECTION_TICKS_DEFAULT,
            ELECTION_TICKS_LIMIT,
        )?;
        if election_ticks <= heartbeat_ticks {
            let blamed = if raw.election_ticks.is_some() {
                "cluster.electionTicks"
            } else {
                "cluster.heartbeatTicks"
            };
            return Err(self.invalid(
                blamed,
                format!(
                    "cluster.electionTicks ({election_ticks}) must be greater than cluster.heartbeatTicks ({heartbeat_ticks}): followers would campaign between two heartbeats of a healthy leader"
                ),
            ));
        }
        Ok((tick_interval_ms, heartbeat_ticks, election_ticks))
    }

    /// `cluster.maxFrameBytes`, large enough for a Raft entry holding the largest message.
    fn max_frame_bytes(
        &self,
        raw: &RawCluster,
        publish: &PublishConfig,
    ) -> Result<usize, ConfigError> {
        let max_frame_bytes = self.bytes(
            "cluster.maxFrameBytes",
            raw.max_frame_bytes,
            MAX_FRAME_BYTES_DEFAULT,
            (MAX_FRAME_BYTES_MIN, MAX_FRAME_BYTES_LIMIT),
        )?;
        // Bounded by MAX_FRAME_BYTES_LIMIT above.
        let max_frame_bytes = usize::try_from(max_frame_bytes).unwrap_or(usize::MAX);
        let message_bytes_max = publish.message_bytes_max;
        if max_frame_bytes.saturating_sub(FRAME_OVERHEAD_BYTES) < message_bytes_max {
            let blamed = if raw.max_frame_bytes.is_some() {
                "cluster.maxFrameBytes"
            } else {
                "publish.maxMessageBytes"
            };
            return Err(self.invalid(
                blamed,
                format!(
                    "cluster.maxFrameBytes ({max_frame_bytes} bytes) must be at least publish.maxMessageBytes ({message_bytes_max} bytes) + {FRAME_OVERHEAD_BYTES} bytes: a Raft entry holding one largest message must fit in one frame to a peer"
                ),
            ));
        }
        Ok(max_frame_bytes)
    }

    /// `[cluster.tls]`: all three files or none; the first one missing is named. The files are
    /// read and checked when the server starts (`crate::security::node`), not here.
    fn cluster_tls(
        &self,
        cert_file: &Option<String>,
        key_file: &Option<String>,
        ca_file: &Option<String>,
    ) -> Result<Option<NodeTlsFiles>, ConfigError> {
        let path = |value: &Option<String>| {
            value
                .as_deref()
                .map(str::trim)
                .filter(|text| !text.is_empty())
                .map(PathBuf::from)
        };
        let files = [path(cert_file), path(key_file), path(ca_file)];
        let Some(set) = files.iter().position(Option::is_some) else {
            return Ok(None);
        };
        let missing: Vec<String> = files
            .iter()
            .zip(TLS_KEYS)
            .filter(|(file, _)| file.is_none())
            .map(|(_, (_, name))| format!("cluster.tls.{name}"))
            .collect();
        if !missing.is_empty() {
            return Err(self.invalid(
                TLS_KEYS[set].0,
                format!(
                    "needs {} too: node TLS takes certFile, keyFile and caFile, or none of them",
                    missing.join(" and ")
                ),
            ));
        }
        let [Some(cert_file), Some(key_file), Some(ca_file)] = files else {
            return Ok(None);
        };
        Ok(Some(NodeTlsFiles {
            cert_file,
            key_file,
            ca_file,
        }))
    }

    /// Parses `ID=IP:PORT` members; ids and addresses unique, at least one member.
    fn peers(&self, members: &[String]) -> Result<BTreeMap<u64, SocketAddr>, ConfigError> {
        const KEY: &str = "cluster.peers";
        if members.is_empty() {
            return Err(self.invalid(
                KEY,
                "must list at least one member (this node) as ID=IP:PORT",
            ));
        }
        if members.len() > MEMBERS_LIMIT {
            return Err(self.invalid(
                KEY,
                format!(
                    "must list at most {MEMBERS_LIMIT} members, found {}",
                    members.len()
                ),
            ));
        }
        let mut peers = BTreeMap::new();
        for member in members {
            let malformed = || {
                self.invalid(
                    KEY,
                    format!(
                        "\"{member}\" is not ID=IP:PORT: write e.g. \"1=127.0.0.1:7101\" (hostnames are not resolved)"
                    ),
                )
            };
            let (id_text, addr_text) = member.split_once('=').ok_or_else(malformed)?;
            let id: u64 = id_text.trim().parse().map_err(|_| malformed())?;
            let addr: SocketAddr = addr_text.trim().parse().map_err(|_| malformed())?;
            if id == 0 {
                return Err(self.invalid(
                    KEY,
                    format!("\"{member}\": node ids must be greater than zero"),
                ));
            }
            if addr.ip().is_unspecified() || addr.port() == 0 {
                return Err(self.invalid(
                    KEY,
                    format!(
                        "\"{member}\": {addr} is not an address a peer can connect to: give the member's own IP and a fixed port"
                    ),
                ));
            }
            if peers.contains_key(&id) {
                return Err(self.invalid(KEY, format!("node id {id} is listed twice")));
            }
            if let Some((other, _)) = peers.iter().find(|(_, known)| **known == addr) {
                return Err(self.invalid(
                    KEY,
                    format!("nodes {other} and {id} have the same address {addr}"),
                ));
            }
            peers.insert(id, addr);
        }
        Ok(peers)
    }

    /// This node is a member, at `raftListen` (or on its port when `raftListen` is a wildcard
    /// such as `0.0.0.0:7101`).
    /// `cluster.peers` (a new cluster's first members) or `cluster.join` (a member's client
    /// address: this node joins a running cluster, and the peers are then only itself).
    fn members_or_join(
        &self,
        raw: &RawCluster,
        node_id: u64,
        raft_listen: SocketAddr,
    ) -> Result<(BTreeMap<u64, SocketAddr>, Option<String>), ConfigError> {
        match (&raw.peers, &raw.join) {
            (Some(_), Some(_)) => Err(self.invalid(
                "cluster.join",
                format!(
                    "cannot be set with cluster.peers ({}): peers names a new cluster's first members, join adds this node to a running cluster",
                    self.origin("cluster.peers")
                ),
            )),
            (None, Some(join)) => {
                if join.trim().is_empty() || !join.contains(':') {
                    return Err(self.invalid(
                        "cluster.join",
                        format!("{join:?} is not HOST:PORT: give any member's client address"),
                    ));
                }
                if raft_listen.ip().is_unspecified() {
                    return Err(self.invalid(
                        "cluster.raftListen",
                        format!(
                            "{raft_listen} is a wildcard: a joining node needs the concrete address its peers will dial (the one given to `pinq cluster add-node --raft`)"
                        ),
                    ));
                }
                Ok((BTreeMap::from([(node_id, raft_listen)]), Some(join.clone())))
            }
            (Some(PeersValue(members)), None) => {
                let peers = self.peers(members)?;
                self.check_membership(node_id, raft_listen, &peers)?;
                Ok((peers, None))
            }
            (None, None) => Err(self.invalid(
                "cluster.peers",
                format!(
                    "must be set when cluster.nodeId is ({}): every member as ID=IP:PORT, this node included (or cluster.join, to join a running cluster)",
                    self.origin("cluster.nodeId")
                ),
            )),
        }
    }

    fn check_membership(
        &self,
        node_id: u64,
        raft_listen: SocketAddr,
        peers: &BTreeMap<u64, SocketAddr>,
    ) -> Result<(), ConfigError> {
        let listed: Vec<String> = peers.keys().map(u64::to_string).collect();
        let Some(&own) = peers.get(&node_id) else {
            return Err(self.invalid(
                "cluster.peers",
                format!(
                    "does not list this node (cluster.nodeId = {node_id}), only {}: list every member, this node included",
                    listed.join(", ")
                ),
            ));
        };
        let matches = own == raft_listen
            || (raft_listen.ip().is_unspecified() && raft_listen.port() == own.port());
        if !matches {
            return Err(self.invalid(
                "cluster.raftListen",
                format!(
                    "{raft_listen} is not this node's address in cluster.peers ({node_id}={own}): peers would dial an address nobody listens on"
                ),
            ));
        }
        Ok(())
    }

    /// `raftListen` must not share a port with the client, metrics or per-shard listeners.
    fn check_cluster_ports(
        &self,
        cluster: &ClusterConfig,
        server: &ServerConfig,
    ) -> Result<(), ConfigError> {
        let raft = cluster.raft_listen;
        let same_host = |other: SocketAddr| {
            raft.ip() == other.ip() || raft.ip().is_unspecified() || other.ip().is_unspecified()
        };
        for (key, other) in [
            ("server.listen", server.listen),
            ("server.metricsListen", server.metrics_listen),
        ] {
            if other.port() == raft.port() && same_host(other) {
                return Err(self.invalid(
                    "cluster.raftListen",
                    format!("{raft} uses the same port as {key} ({other})"),
                ));
            }
        }
        for shard in 0..server.cpus.len() {
            let other = server.shard_listen(shard);
            if other.port() != 0 && other.port() == raft.port() && same_host(other) {
                return Err(self.invalid(
                    "cluster.raftListen",
                    format!(
                        "{raft} uses the port of shard {shard} ({other}, see server.shardPortBase)"
                    ),
                ));
            }
        }
        Ok(())
    }
}
