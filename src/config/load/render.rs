//! The configuration written back as TOML (`Config::to_toml`): what `pinq serve` logs as in
//! effect, and what the loader reads back to the same value.

#![allow(unused_imports)]
use super::*;

impl Config {
    /// The configuration as TOML that [`ConfigLoader`] reads back to the same value (for logs
    /// and for `pinq serve` operators who want to see what is in effect).
    pub fn to_toml(&self) -> String {
        let cluster = self
            .cluster
            .as_ref()
            .map_or_else(String::new, render_cluster);
        format!(
            "{}\n{}\n{}\n{}{cluster}{}",
            render_delivery(&self.delivery),
            render_publish(&self.publish),
            render_server(&self.server),
            render_storage(&self.storage),
            render_security(&self.security),
        )
    }
}

/// A TOML string.
fn text(value: &str) -> String {
    toml::Value::String(value.to_owned()).to_string()
}

/// A duration of `ms` as a TOML string (`"5s"`).
fn duration(ms: u64) -> String {
    text(&format_ms(ms))
}

/// A byte size as a TOML string (`"64MiB"`).
fn bytes(n: u64) -> String {
    text(&format_byte_size(n))
}

/// `[delivery]`.
fn render_delivery(d: &DeliveryConfig) -> String {
    format!(
        "[delivery]\n\
         dispatchPollInterval = {}\n\
         inFlightTimeout = {}\n\
         deleteBatchInterval = {}\n\
         deleteBatchMaxKeys = {}\n\
         deleteBatchesInFlight = {}\n\
         deleteBacklogMaxKeys = {}\n\
         ttlSweepInterval = {}\n\
         consumerQueueSize = {}\n\
         timeBucket = {}\n\
         groupRetention = {}\n\
         maxUnackedPerConsumer = {}\n\
         retryQueueSize = {}\n\
         scanBatchSize = {}\n\
         maxGroupsPerTopic = {}\n\
         maxGroupsPerShard = {}\n\
         maxConsumersPerGroup = {}\n\
         maxCountedTopics = {}\n\
         maxGroupMetrics = {}\n\
         maxDeliveries = {}\n\
         deadLetterTopic = {}\n\
         redeliveryBackoff = {}\n",
        duration(d.dispatch_poll_interval_ms),
        duration(d.in_flight_timeout_ms),
        duration(d.delete_batch_interval_ms),
        d.delete_batch_keys_max,
        d.delete_batches_in_flight_max,
        d.delete_backlog_keys_max,
        duration(d.ttl_sweep_interval_ms),
        d.consumer_queue_len_max,
        duration(d.time_bucket_ms),
        duration(d.group_retention_ms),
        d.unacked_per_consumer_max,
        d.retry_len_max,
        d.scan_batch_len_max,
        d.groups_per_topic_max,
        d.groups_per_shard_max,
        d.consumers_per_group_max,
        d.counted_topics_max,
        d.group_metrics_max,
        d.max_deliveries,
        text(&d.dead_letter_topic),
        text(
            &d.redelivery_backoff
                .map_or_else(|| "none".to_owned(), |b| b.text())
        ),
    )
}

/// `[publish]`.
fn render_publish(p: &PublishConfig) -> String {
    format!(
        "[publish]\n\
         maxMessageBytes = {}\n\
         maxBatchMessages = {}\n\
         minAckLevel = {}\n\
         maxBytesInFlight = {}\n\
         dedupWindow = {}\n\
         dedupMaxProducers = {}\n\
         dedupMaxEntries = {}\n",
        bytes(p.message_bytes_max as u64),
        p.batch_len_max,
        text(p.ack_level_min.as_str()),
        bytes(p.bytes_in_flight_max as u64),
        duration(p.dedup_window_ms),
        p.dedup_producers_max,
        p.dedup_entries_max,
    )
}

/// `[server]`.
fn render_server(s: &ServerConfig) -> String {
    let shard_port_base = match s.shard_port_base {
        Some(base) => format!("shardPortBase = {base}\n"),
        None => "# shardPortBase unset: client port + 1 + shard index\n".to_owned(),
    };
    format!(
        "[server]\n\
         dataDir = {}\n\
         cpus = {}\n\
         listen = {}\n\
         metricsListen = {}\n\
         {shard_port_base}\
         numa = {}\n\
         maxConnections = {}\n\
         idleTimeout = {}\n\
         frameTimeout = {}\n\
         deliverTimeout = {}\n\
         maxCallsInFlight = {}\n\
         maxSubscriptionsPerConnection = {}\n\
         maxSendBufferBytes = {}\n\
         maxNodeSendBufferBytes = {}\n\
         sendStallTimeout = {}\n\
         idlePoll = {}\n",
        text(&s.data_dir.to_string_lossy()),
        text(s.cpus.text()),
        text(&s.listen.to_string()),
        text(&s.metrics_listen.to_string()),
        text(s.numa.as_str()),
        s.client.connections_max,
        duration(s.client.idle_timeout_ms),
        duration(s.client.frame_timeout_ms),
        duration(s.client.deliver_timeout_ms),
        s.client.calls_in_flight_max,
        s.client.subscriptions_max,
        bytes(s.client.send_buffer_bytes_max as u64),
        bytes(s.client.node_send_buffer_bytes_max as u64),
        duration(s.client.send_stall_timeout_ms),
        text(&format_us(s.idle_poll_us)),
    )
}

/// `[storage]`.
fn render_storage(st: &StorageConfig) -> String {
    format!(
        "[storage]\n\
         engine = {}\n\
         memtableBytes = {}\n\
         walSegmentBytes = {}\n\
         walMaxBytes = {}\n",
        text(st.engine.as_str()),
        bytes(st.memtable_bytes_max as u64),
        bytes(st.wal_segment_bytes_max),
        bytes(st.wal_bytes_max),
    )
}

/// `[cluster]` (with its `[cluster.tls]`), preceded by an empty line.
fn render_cluster(c: &crate::config::ClusterConfig) -> String {
    let peers: Vec<String> = c
        .peers
        .iter()
        .map(|(id, addr)| text(&format!("{id}={addr}")))
        .collect();
    // A joining node's peers are itself only, which is what `join` implies.
    let members = match &c.join {
        Some(join) => format!("join = {}", text(join)),
        None => format!("peers = [{}]", peers.join(", ")),
    };
    format!(
        "\n[cluster]\n\
         nodeId = {}\n\
         raftListen = {}\n\
         {}\n\
         advertise = {}\n\
         tickInterval = {}\n\
         heartbeatTicks = {}\n\
         electionTicks = {}\n\
         logRetainEntries = {}\n\
         outboundQueueMessages = {}\n\
         maxFrameBytes = {}\n{}",
        c.node_id,
        text(&c.raft_listen.to_string()),
        members,
        text(&c.advertise.to_string()),
        duration(u64::try_from(c.tick_interval.as_millis()).unwrap_or(u64::MAX)),
        c.heartbeat_ticks,
        c.election_ticks,
        c.log_retain_entries,
        c.outbound_queue_messages,
        bytes(c.max_frame_bytes as u64),
        render_cluster_tls(c.tls.as_ref()),
    )
}

/// `[cluster.tls]`, when set (right after `[cluster]`'s keys, as a sub-table of it).
fn render_cluster_tls(tls: Option<&crate::security::node::NodeTlsFiles>) -> String {
    let Some(tls) = tls else {
        return String::new();
    };
    let path = |p: &std::path::Path| toml::Value::String(p.to_string_lossy().into()).to_string();
    format!(
        "\n[cluster.tls]\ncertFile = {}\nkeyFile = {}\ncaFile = {}\n",
        path(&tls.cert_file),
        path(&tls.key_file),
        path(&tls.ca_file)
    )
}

/// `[server.tls]` and `[[auth.tokens]]`, when set (the token hashes, never a secret).
fn render_security(security: &SecurityConfig) -> String {
    let path = |p: &std::path::Path| text(&p.to_string_lossy());
    let list = |items: &[String]| {
        let items: Vec<String> = items.iter().map(|i| text(i)).collect();
        format!("[{}]", items.join(", "))
    };
    let mut out = String::new();
    if let Some(tls) = &security.tls {
        out.push_str(&format!(
            "\n[server.tls]\ncertFile = {}\nkeyFile = {}\n",
            path(&tls.cert_file),
            path(&tls.key_file)
        ));
        if let Some(ca) = &tls.client_ca_file {
            out.push_str(&format!("clientCaFile = {}\n", path(ca)));
        }
    }
    for token in &security.tokens {
        let hex: String = token.sha256.iter().map(|b| format!("{b:02x}")).collect();
        out.push_str(&format!(
            "\n[[auth.tokens]]\nname = {}\nsha256 = {}\npublish = {}\nconsume = {}\nadmin = {}\n",
            text(&token.name),
            text(&hex),
            list(&token.publish),
            list(&token.consume),
            token.admin
        ));
    }
    out
}

/// Microseconds in the largest unit that divides them: `"0"`, `"2ms"`, `"200us"`.
pub(super) fn format_us(us: u64) -> String {
    if us == 0 {
        "0us".to_owned()
    } else if us % 1000 == 0 {
        format_ms(us / 1000)
    } else {
        format!("{us}us")
    }
}

/// Milliseconds in the largest unit that divides them: `"24h"`, `"5s"`, `"50ms"`.
pub(super) fn format_ms(ms: u64) -> String {
    if ms != 0 && ms % 3_600_000 == 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms != 0 && ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}
