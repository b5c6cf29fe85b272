//! Encodes the shards' snapshots in the OpenMetrics text format with `prometheus-client`.
//!
//! The figures already live in the shards' snapshots, so instead of mirroring them into
//! `prometheus-client` metric objects, one [`Collector`] walks the snapshots on each scrape and
//! emits const metrics: one family per metric name, one sample per shard (label `shard`) and per
//! extra label (`result`, `source`, `reason`). A shard that has not published a snapshot yet is
//! left out rather than shown as zeros. Storage families appear only when some shard's engine
//! keeps figures.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::{HistogramSnapshot, MetricsSlots, Problem, RaftFigures, ShardSnapshot, StorageFigures};
use crate::rpc::refusal::Code;

/// The collector over every shard's slot.
#[derive(Debug)]
pub struct ShardCollector {
    slots: MetricsSlots,
}

/// Encodes the current snapshots as an OpenMetrics text page (ends with `# EOF`).
pub fn render(slots: &MetricsSlots) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(ShardCollector {
        slots: slots.clone(),
    }));
    let mut page = String::new();
    prometheus_client::encoding::text::encode(&mut page, &registry)?;
    Ok(page)
}

/// A counter or gauge value of one shard, read from its snapshot.
type Read = fn(&ShardSnapshot) -> u64;

/// A storage figure of one shard.
type ReadStorage = fn(&StorageFigures) -> u64;

/// Counters with one extra label: (name, help, label, [(label value, read)]).
type Labelled = (
    &'static str,
    &'static str,
    &'static str,
    &'static [(&'static str, Read)],
);

const COUNTERS: &[(&str, &str, Read)] = &[
    (
        "pinq_messages_published",
        "Messages stored by publish batches on this shard (at their requested ack level).",
        |s| s.stats.counters.published_total,
    ),
    (
        "pinq_publish_duplicates",
        "Published messages not stored because their (producer id, sequence) was already stored within publish.dedupWindow (answered with the original tag).",
        |s| s.stats.counters.publish_duplicates_total,
    ),
    (
        "pinq_messages_dispatched",
        "Copies handed to a consumer's queue, first deliveries and redeliveries.",
        |s| s.stats.counters.dispatched_total,
    ),
    (
        "pinq_consumer_queue_full",
        "Times a consumer was skipped for a message because its window (queueSize: queued plus sent and not returned) or its unacknowledged bound was full.",
        |s| s.stats.counters.consumer_queue_full_total,
    ),
    (
        "pinq_delete_failures",
        "Delete batches the store refused (their keys are retried).",
        |s| s.stats.delete_failures_total,
    ),
    (
        "pinq_delete_batches",
        "Delete batches applied to the store.",
        |s| s.stats.delete_batches_total,
    ),
    (
        "pinq_deleted_keys",
        "Keys deleted by applied delete batches.",
        |s| s.stats.deleted_keys_total,
    ),
    (
        "pinq_dispatch_paused_delete_backlog",
        "Times dispatch paused because the keys waiting for deletion reached delivery.deleteBacklogMaxKeys (pause episodes; no scans or redeliveries until applied deletes bring the backlog under the bound).",
        |s| s.stats.counters.delete_backlog_pauses_total,
    ),
    (
        "pinq_unreadable_values",
        "Stored values that did not decode and were skipped.",
        |s| s.stats.counters.unreadable_values_total,
    ),
    (
        "pinq_groups_forgotten",
        "Consumer groups forgotten after groupRetention without consumers, or on request.",
        |s| s.stats.counters.groups_forgotten_total,
    ),
    (
        "pinq_copy_records_written",
        "Copy records written to the log (a group's deliveries so far before a redelivery, or its durable ACK while other groups hold the message).",
        |s| s.stats.copy_records_total,
    ),
    (
        "pinq_copy_record_failures",
        "Copy-record batches the store refused (retried; the copies they hold back wait).",
        |s| s.stats.copy_record_failures_total,
    ),
    (
        "pinq_dead_lettered",
        "Copies moved to a dead-letter topic after their group's delivery.maxDeliveries (stored there, then ACKed for the group).",
        |s| s.stats.counters.dead_lettered_total,
    ),
];

const LABELLED_COUNTERS: &[Labelled] = &[
    (
        "pinq_consumer_ack",
        "Tags settled by consumers: acked, nacked, or refused (the tag was not held by that consumer any more; counts ACK, NACK and touch).",
        "result",
        &[
            ("acked", |s| s.stats.counters.acked_total),
            ("nacked", |s| s.stats.counters.nacked_total),
            ("refused", |s| s.stats.counters.ack_refused_total),
        ],
    ),
    (
        "pinq_messages_expired",
        "Messages found past their TTL, by who found them.",
        "source",
        &[
            ("dispatcher", |s| s.stats.counters.expired_dispatcher_total),
            ("janitor", |s| s.stats.counters.expired_janitor_total),
        ],
    ),
    (
        "pinq_redeliveries",
        "Copies made deliverable again, by why.",
        "reason",
        &[
            ("timeout", |s| s.stats.counters.redeliveries_timeout_total),
            ("nack", |s| s.stats.counters.redeliveries_nack_total),
            ("disconnect", |s| {
                s.stats.counters.redeliveries_disconnect_total
            }),
        ],
    ),
];

const GAUGES: &[(&str, &str, Read)] = &[
    (
        "pinq_messages_in_flight",
        "Messages dispatched with at least one copy not yet settled (held by a consumer, waiting for redelivery, or NACK-delayed); messages whose copies are all ACKed or forgotten and only wait for their delete are in pinq_delete_backlog_keys.",
        |s| s.stats.in_flight as u64,
    ),
    (
        "pinq_copies_in_flight",
        "Copies held by consumers (queued for them or delivered) and not yet settled: one per message and recipient (the Broker.stats ShardStats.inFlight).",
        |s| s.stats.held_copies,
    ),
    (
        "pinq_delayed_copies",
        "Copies waiting out a NACK delay, a redelivery backoff or their move to a dead-letter topic.",
        |s| s.stats.delayed_copies,
    ),
    (
        "pinq_delete_backlog_max_keys",
        "The bound delivery.deleteBacklogMaxKeys: dispatch pauses while pinq_delete_backlog_keys is at it.",
        |s| s.stats.delete_backlog_max as u64,
    ),
    (
        "pinq_dedup_entries",
        "(producer id, sequence) pairs this shard remembers for idempotent publish (bounded by publish.dedupMaxEntries).",
        |s| s.stats.dedup_entries as u64,
    ),
    (
        "pinq_dedup_producers",
        "Producers this shard remembers sequences for (bounded by publish.dedupMaxProducers).",
        |s| s.stats.dedup_producers as u64,
    ),
    (
        "pinq_active_consumers",
        "Consumers subscribed to topics this shard owns.",
        |s| s.stats.active_consumers as u64,
    ),
    (
        "pinq_delete_queue_keys",
        "Keys waiting for the next delete batch.",
        |s| s.stats.delete_queued as u64,
    ),
    (
        "pinq_durable_settles_waiting",
        "Copies whose durable ACK or NACK waits for its commit (a delete or a copy record) before the call is answered.",
        |s| s.stats.durable_waiting as u64,
    ),
    (
        "pinq_copy_records_restored",
        "Copy records read back at start (or on a new leader) whose message was not dispatched or deleted since.",
        |s| s.stats.copy_records_restored as u64,
    ),
    (
        "pinq_delete_backlog_keys",
        "Keys waiting for deletion: queued, or in delete batches not yet applied. Dispatch pauses at delivery.deleteBacklogMaxKeys.",
        |s| s.stats.delete_backlog as u64,
    ),
    (
        "pinq_pending_copies",
        "Copies waiting for a consumer with room (retry lists).",
        |s| s.stats.pending_copies as u64,
    ),
    (
        "pinq_backlog_messages",
        "Stored messages that are due and not yet dispatched, plus copies waiting to be delivered again.",
        |s| s.stats.backlog,
    ),
    (
        "pinq_scheduled_messages",
        "Stored messages whose delay has not passed yet.",
        |s| s.stats.scheduled,
    ),
];

type ReadHistogram = fn(&ShardSnapshot) -> &HistogramSnapshot;

const HISTOGRAMS: &[(&str, &str, ReadHistogram)] = &[
    (
        "pinq_publish_latency_seconds",
        "Owning shard taking a publish batch to the batch stored at its requested ack level.",
        |s| &s.histograms.publish_latency,
    ),
    (
        "pinq_delivery_latency_seconds",
        "A message's due time to its first delivery handed to the consumer's connection (1 ms resolution).",
        |s| &s.histograms.delivery_latency,
    ),
    (
        "pinq_dispatch_pass_duration_seconds",
        "One dispatch pass: planning, storage scans and routing of its deliveries.",
        |s| &s.histograms.dispatch_pass,
    ),
    (
        "pinq_delete_batch_size",
        "Keys per applied delete batch.",
        |s| &s.histograms.delete_batch_size,
    ),
    (
        "pinq_publish_call_seconds",
        "A publish call started to its answer ready to write, on the connection's shard (decode, admission, store).",
        |s| &s.histograms.publish_call,
    ),
    (
        "pinq_deliver_round_trip_seconds",
        "A deliver call sent to its answer received: the consumer's round trip.",
        |s| &s.histograms.deliver_round_trip,
    ),
    (
        "pinq_settle_call_seconds",
        "An ack, nack or touch call started to its answer ready to write, on the connection's shard.",
        |s| &s.histograms.settle_call,
    ),
];

const STORAGE_COUNTERS: &[(&str, &str, ReadStorage)] = &[
    (
        "pinq_storage_wal_bytes_written",
        "Bytes written to WAL segments, padding included.",
        |f| f.wal_bytes_written,
    ),
    ("pinq_storage_wal_writes", "WAL writes.", |f| f.wal_writes),
    ("pinq_storage_wal_fsyncs", "WAL fdatasyncs.", |f| {
        f.wal_fsyncs
    }),
    (
        "pinq_storage_flushes",
        "Memtables flushed to tables.",
        |f| f.flushes,
    ),
    ("pinq_storage_compactions", "Compactions run.", |f| {
        f.compactions
    }),
    (
        "pinq_storage_compaction_bytes_read",
        "Bytes read by compactions.",
        |f| f.compaction_bytes_read,
    ),
    (
        "pinq_storage_compaction_bytes_written",
        "Bytes written by compactions.",
        |f| f.compaction_bytes_written,
    ),
    (
        "pinq_storage_flush_bytes_written",
        "Bytes memtable flushes wrote to tables: what was not deleted (annihilated) in memory first.",
        |f| f.flush_bytes_written,
    ),
    (
        "pinq_storage_write_stalls",
        "Writes that waited for a flush because the memtables were full.",
        |f| f.write_stalls,
    ),
];

const STORAGE_GAUGES: &[(&str, &str, ReadStorage)] = &[
    (
        "pinq_storage_wal_live_bytes",
        "WAL record bytes not yet covered by tables.",
        |f| f.wal_live_bytes,
    ),
    (
        "pinq_storage_memtable_bytes",
        "Bytes in the active memtable.",
        |f| f.memtable_bytes,
    ),
    (
        "pinq_storage_frozen_memtable_bytes",
        "Bytes in memtables waiting to be flushed.",
        |f| f.frozen_memtable_bytes,
    ),
    ("pinq_storage_tables", "Live sorted tables.", |f| f.tables),
    (
        "pinq_storage_table_bytes",
        "Bytes in live sorted tables.",
        |f| f.table_bytes,
    ),
];

impl Collector for ShardCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let shards: Vec<(String, ShardSnapshot)> = self
            .slots
            .read()
            .into_iter()
            .enumerate()
            .filter_map(|(i, s)| s.map(|s| (i.to_string(), s)))
            .collect();
        for (name, help, read) in COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (shard, snap) in &shards {
                family
                    .encode_family(&[("shard", shard.as_str())])?
                    .encode_counter::<NoLabelSet, _, u64>(&read(snap), None)?;
            }
        }
        for (name, help, label, values) in LABELLED_COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (shard, snap) in &shards {
                for (value, read) in values.iter() {
                    family
                        .encode_family(&[("shard", shard.as_str()), (label, value)])?
                        .encode_counter::<NoLabelSet, _, u64>(&read(snap), None)?;
                }
            }
        }
        encode_health(&mut encoder, &shards)?;
        super::memory::encode(&mut encoder, &shards)?;
        for (name, help, read) in GAUGES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (shard, snap) in &shards {
                family
                    .encode_family(&[("shard", shard.as_str())])?
                    .encode_gauge(&read(snap))?;
            }
        }
        for (name, help, read) in HISTOGRAMS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for (shard, snap) in &shards {
                let h = read(snap);
                family
                    .encode_family(&[("shard", shard.as_str())])?
                    .encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)?;
            }
        }
        encode_raft(&mut encoder, &shards)?;
        encode_certificate(&mut encoder, &self.slots)?;
        super::groups::encode(&mut encoder, &shards)?;
        let storage: Vec<(&str, &StorageFigures)> = shards
            .iter()
            .filter_map(|(shard, snap)| snap.storage.as_ref().map(|f| (shard.as_str(), f)))
            .collect();
        if storage.is_empty() {
            return Ok(());
        }
        for (name, help, read) in STORAGE_COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (shard, figures) in &storage {
                family
                    .encode_family(&[("shard", *shard)])?
                    .encode_counter::<NoLabelSet, _, u64>(&read(figures), None)?;
            }
        }
        for (name, help, read) in STORAGE_GAUGES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (shard, figures) in &storage {
                family
                    .encode_family(&[("shard", *shard)])?
                    .encode_gauge(&read(figures))?;
            }
        }
        Ok(())
    }
}

type RaftRead = fn(&RaftFigures) -> u64;

const RAFT_GAUGES: &[(&str, &str, RaftRead)] = &[
    (
        "pinq_raft_term",
        "The shard's Raft term on this node.",
        |f| f.term,
    ),
    (
        "pinq_raft_leader",
        "1 while this node leads and serves the shard.",
        |f| u64::from(f.serving),
    ),
    (
        "pinq_raft_commit_index",
        "Highest log index known committed.",
        |f| f.commit,
    ),
    (
        "pinq_raft_applied_index",
        "Highest log index applied here.",
        |f| f.applied,
    ),
    (
        "pinq_raft_peers_connected",
        "Peer nodes this shard's own transport has a connection to (handshake accepted).",
        |f| f.peers_connected,
    ),
];

const RAFT_COUNTERS: &[(&str, &str, RaftRead)] = &[
    (
        "pinq_raft_leader_changes",
        "Changes of the shard's leader seen by this node.",
        |f| f.leader_changes,
    ),
    (
        "pinq_raft_connections_established",
        "Connections this shard's own transport established with peer nodes.",
        |f| f.connections_established,
    ),
    (
        "pinq_raft_handshake_refusals",
        "Handshakes of this shard's transport refused, by this node or by the peer.",
        |f| f.handshake_refusals,
    ),
    (
        "pinq_raft_connections_shed",
        "Accepted peer connections closed unserved: too many handshakes in progress, or (shard 0) their shard could not take them.",
        |f| f.connections_shed,
    ),
    (
        "pinq_subscription_closes_lost",
        "Ends of subscription streams (on a change of leader) another shard could no longer take.",
        |f| f.closes_lost,
    ),
];

type RaftHistogram = fn(&RaftFigures) -> &crate::metrics::HistogramSnapshot;

const RAFT_HISTOGRAMS: &[(&str, &str, RaftHistogram)] = &[
    (
        "pinq_raft_commit_latency_seconds",
        "A proposal on the leader → committed by a quorum and applied.",
        |f| &f.commit_latency,
    ),
    (
        "pinq_raft_append_batch_entries",
        "Entries per record appended to the Raft log (one per Ready).",
        |f| &f.append_batch_entries,
    ),
];

/// The `pinq_raft_*` families, for shards that have a replica (none standalone).
/// Refusals by code, and each shard's health (`/healthz` gives the same with reasons).
fn encode_health(
    encoder: &mut DescriptorEncoder,
    shards: &[(String, ShardSnapshot)],
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(
        "pinq_refusals",
        "Client requests refused by a configured bound or a full disk, by refusal code (the code starts the error text the client gets).",
        None,
        MetricType::Counter,
    )?;
    for (shard, snap) in shards {
        for code in Code::ALL {
            family
                .encode_family(&[("shard", shard.as_str()), ("code", code.name())])?
                .encode_counter::<NoLabelSet, _, u64>(&snap.refusals.get(code), None)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "pinq_auth_refusals",
        "Connections and calls refused by authentication (missing or unknown token, no hello) or by a token's permissions, by reason.",
        None,
        MetricType::Counter,
    )?;
    for (shard, snap) in shards {
        for reason in crate::security::auth::AuthReason::ALL {
            family
                .encode_family(&[("shard", shard.as_str()), ("reason", reason.name())])?
                .encode_counter::<NoLabelSet, _, u64>(&snap.auth_refusals.get(reason), None)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "pinq_shard_healthy",
        "1 while the shard serves (/healthz 200, perhaps degraded), 0 otherwise (see pinq_shard_problem and /healthz).",
        None,
        MetricType::Gauge,
    )?;
    for (shard, snap) in shards {
        let healthy = u64::from(snap.problems.iter().all(Problem::is_degraded_only));
        family
            .encode_family(&[("shard", shard.as_str())])?
            .encode_gauge(&healthy)?;
    }
    let mut family = encoder.encode_descriptor(
        "pinq_shard_problem",
        "1 for each problem a shard has now: disk_full (writes refused until space returns), unreadable_blocks (corrupt table blocks skipped), fenced, wal_tail_dropped (start-up dropped WAL records; serving, degraded until restart).",
        None,
        MetricType::Gauge,
    )?;
    for (shard, snap) in shards {
        for label in Problem::LABELS {
            let on = u64::from(snap.problems.iter().any(|p| p.label() == label));
            family
                .encode_family(&[("shard", shard.as_str()), ("problem", label)])?
                .encode_gauge(&on)?;
        }
    }
    Ok(())
}

/// The server certificate's end of validity, with TLS on (nothing without TLS).
fn encode_certificate(
    encoder: &mut DescriptorEncoder,
    slots: &MetricsSlots,
) -> Result<(), std::fmt::Error> {
    let Some((file, not_after_s)) = slots.certificate() else {
        return Ok(());
    };
    let mut family = encoder.encode_descriptor(
        "pinq_tls_certificate_expiry_timestamp_seconds",
        "When the server certificate (server.tls.certFile, read at start-up) stops being valid, in Unix seconds; a renewed file is read at the next restart.",
        None,
        MetricType::Gauge,
    )?;
    family
        .encode_family(&[("file", file)])?
        .encode_gauge(&not_after_s)?;
    Ok(())
}

fn encode_raft(
    encoder: &mut DescriptorEncoder,
    shards: &[(String, ShardSnapshot)],
) -> Result<(), std::fmt::Error> {
    let raft: Vec<(&str, &RaftFigures)> = shards
        .iter()
        .filter_map(|(shard, snap)| snap.raft.as_ref().map(|f| (shard.as_str(), f)))
        .collect();
    if raft.is_empty() {
        return Ok(());
    }
    for (name, help, read) in RAFT_GAUGES {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (shard, f) in &raft {
            family
                .encode_family(&[("shard", *shard)])?
                .encode_gauge(&read(f))?;
        }
    }
    for (name, help, read) in RAFT_COUNTERS {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (shard, f) in &raft {
            family
                .encode_family(&[("shard", *shard)])?
                .encode_counter::<NoLabelSet, _, u64>(&read(f), None)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "pinq_raft_messages_dropped",
        "Raft messages dropped between a replica and its peers, by reason (Raft retransmits).",
        None,
        MetricType::Counter,
    )?;
    for (shard, f) in &raft {
        for (reason, n) in f.drops.by_reason() {
            family
                .encode_family(&[("shard", *shard), ("reason", reason)])?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
    }
    for (name, help, read) in RAFT_HISTOGRAMS {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
        for (shard, f) in &raft {
            let h = read(f);
            family
                .encode_family(&[("shard", *shard)])?
                .encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "pinq_raft_follower_lag_entries",
        "Leader only: committed entries a follower does not have yet.",
        None,
        MetricType::Gauge,
    )?;
    for (shard, f) in &raft {
        for (peer, lag) in &f.follower_lag {
            let peer = peer.to_string();
            family
                .encode_family(&[("shard", *shard), ("peer", peer.as_str())])?
                .encode_gauge(lag)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ShardRecorder;

    fn snapshot(published: u64) -> ShardSnapshot {
        let mut snap = ShardSnapshot::default();
        snap.stats.counters.published_total = published;
        snap.stats.counters.acked_total = 3;
        snap.stats.counters.redeliveries_nack_total = 2;
        snap.stats.in_flight = 5;
        snap.stats.delete_backlog = 9;
        snap.stats.counters.delete_backlog_pauses_total = 4;
        let mut recorder = ShardRecorder::default();
        recorder.publish_latency.record(300);
        snap.histograms = recorder.snapshot();
        snap
    }

    #[test]
    fn wire_step_histograms_are_exported_in_seconds() {
        let mut snap = ShardSnapshot::default();
        let mut recorder = ShardRecorder::default();
        recorder.publish_call.record(80);
        recorder.deliver_round_trip.record(900);
        recorder.deliver_round_trip.record(1_100);
        recorder.settle_call.record(60);
        snap.histograms = recorder.snapshot();
        let slots = MetricsSlots::new(1);
        slots.publish(0, snap);
        let page = render(&slots).unwrap();
        for (name, count) in [
            ("pinq_publish_call_seconds", 1),
            ("pinq_deliver_round_trip_seconds", 2),
            ("pinq_settle_call_seconds", 1),
        ] {
            assert!(page.contains(&format!("# TYPE {name} histogram")), "{page}");
            assert!(
                page.contains(&format!("{name}_count{{shard=\"0\"}} {count}\n")),
                "{name}: {page}"
            );
        }
        assert!(
            page.contains("pinq_deliver_round_trip_seconds_sum{shard=\"0\"} 0.002\n"),
            "{page}"
        );
    }

    #[test]
    fn page_has_per_shard_samples_with_their_labels() {
        let slots = MetricsSlots::new(2);
        slots.publish(0, snapshot(10));
        slots.publish(1, snapshot(20));
        let page = render(&slots).unwrap();
        assert!(
            page.contains("pinq_messages_published_total{shard=\"0\"} 10\n"),
            "{page}"
        );
        assert!(
            page.contains("pinq_messages_published_total{shard=\"1\"} 20\n"),
            "{page}"
        );
        assert!(page.contains("pinq_consumer_ack_total{shard=\"0\",result=\"acked\"} 3\n"));
        assert!(page.contains("pinq_redeliveries_total{shard=\"1\",reason=\"nack\"} 2\n"));
        assert!(page.contains("pinq_messages_in_flight{shard=\"0\"} 5\n"));
        assert!(page.contains("pinq_delete_backlog_keys{shard=\"0\"} 9\n"));
        assert!(page.contains("pinq_dispatch_paused_delete_backlog_total{shard=\"1\"} 4\n"));
        assert!(page.contains("# TYPE pinq_publish_latency_seconds histogram"));
        assert!(page.contains("pinq_publish_latency_seconds_count{shard=\"1\"} 1\n"));
        assert!(
            page.contains("pinq_publish_latency_seconds_bucket{le=\"0.0005\",shard=\"0\"} 1\n")
                || page
                    .contains("pinq_publish_latency_seconds_bucket{shard=\"0\",le=\"0.0005\"} 1\n"),
            "{page}"
        );
        assert!(page.ends_with("# EOF\n"));
    }

    #[test]
    fn every_raft_drop_is_exported_with_its_reason() {
        let slots = MetricsSlots::new(2);
        let mut zero = snapshot(1);
        zero.raft = Some(RaftFigures {
            drops: crate::metrics::RaftDrops {
                to_replica_full: 4,
                transport_queue_full: 2,
                ..Default::default()
            },
            closes_lost: 1,
            ..RaftFigures::default()
        });
        let mut one = snapshot(1);
        one.raft = Some(RaftFigures {
            drops: crate::metrics::RaftDrops {
                outbox_full: 3,
                to_transport_full: 5,
                ..Default::default()
            },
            ..RaftFigures::default()
        });
        slots.publish(0, zero);
        slots.publish(1, one);
        let page = render(&slots).unwrap();
        for (shard, reason, n) in [
            (0, "to_replica_full", 4),
            (0, "transport_queue_full", 2),
            (0, "outbox_full", 0),
            (1, "outbox_full", 3),
            (1, "to_transport_full", 5),
            (1, "peer_not_connected", 0),
        ] {
            let line = format!(
                "pinq_raft_messages_dropped_total{{shard=\"{shard}\",reason=\"{reason}\"}} {n}\n"
            );
            assert!(page.contains(&line), "{line} not in {page}");
        }
        assert!(page.contains("pinq_subscription_closes_lost_total{shard=\"0\"} 1\n"));
    }

    #[test]
    fn refusals_and_health_are_exported_per_shard() {
        let slots = MetricsSlots::new(2);
        let mut sick = snapshot(1);
        sick.refusals.add(Code::TooManyCalls);
        sick.auth_refusals
            .add(crate::security::auth::AuthReason::UnknownToken);
        sick.problems
            .push(Problem::DiskFull("wal-1: No space left".into()));
        slots.publish(0, snapshot(1));
        slots.publish(1, sick);
        let page = render(&slots).unwrap();
        assert!(
            page.contains("pinq_refusals_total{shard=\"1\",code=\"tooManyCalls\"} 1\n"),
            "{page}"
        );
        assert!(page.contains("pinq_refusals_total{shard=\"0\",code=\"tooManyCalls\"} 0\n"));
        assert!(page.contains("pinq_auth_refusals_total{shard=\"1\",reason=\"unknownToken\"} 1\n"));
        assert!(page.contains("pinq_shard_healthy{shard=\"0\"} 1\n"));
        assert!(page.contains("pinq_shard_healthy{shard=\"1\"} 0\n"));
        assert!(page.contains("pinq_shard_problem{shard=\"1\",problem=\"disk_full\"} 1\n"));
        assert!(page.contains("pinq_shard_problem{shard=\"1\",problem=\"fenced\"} 0\n"));
    }

    #[test]
    fn storage_families_appear_only_with_an_engine_that_has_figures() {
        let slots = MetricsSlots::new(1);
        slots.publish(0, snapshot(1));
        assert!(!render(&slots).unwrap().contains("pinq_storage_"));
        let mut snap = snapshot(1);
        snap.storage = Some(StorageFigures {
            wal_fsyncs: 4,
            ..StorageFigures::default()
        });
        slots.publish(0, snap);
        assert!(render(&slots)
            .unwrap()
            .contains("pinq_storage_wal_fsyncs_total{shard=\"0\"} 4\n"));
    }

    #[test]
    fn a_shard_without_a_snapshot_is_left_out() {
        let slots = MetricsSlots::new(2);
        slots.publish(1, snapshot(1));
        let page = render(&slots).unwrap();
        assert!(!page.contains("shard=\"0\""));
        assert!(page.contains("shard=\"1\""));
    }
}
