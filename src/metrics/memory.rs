//! The `pinq_client_memory_*` families: what each shard's byte bounds on client connections
//! hold now and how often they held a client back (`crate::server::limits`). Written by the
//! shard into its snapshot; encoded here on each scrape, one sample per shard.

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::ShardSnapshot;

/// One shard's figures of its client memory bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientMemoryFigures {
    /// Bytes of `deliver` calls sent and not answered, all connections of the shard.
    pub send_buffer_bytes: u64,
    /// The shard's share of `server.maxNodeSendBufferBytes`.
    pub send_buffer_bytes_max: u64,
    /// Times a delivery stream waited for room in its connection's or shard's send budget.
    pub sends_waited_total: u64,
    /// Connections closed because they stayed blocked past `server.sendStallTimeout`.
    pub send_stall_closes_total: u64,
    /// Bytes of `publish.maxBytesInFlight` taken (publishes and large frames being read).
    pub publish_bytes_in_flight: u64,
    /// Large request frames whose body waited for room before it was read off the socket.
    pub frames_waited_total: u64,
    /// `malloc_trim` calls after a connection that held much memory closed.
    pub heap_trims_total: u64,
}

type Read = fn(&ClientMemoryFigures) -> u64;

const GAUGES: [(&str, &str, Read); 3] = [
    (
        "pinq_client_send_buffer_bytes",
        "Bytes of Consumer.deliver calls sent and not yet answered, all connections of the shard (bounded by server.maxSendBufferBytes per connection and the shard's share of server.maxNodeSendBufferBytes).",
        |f| f.send_buffer_bytes,
    ),
    (
        "pinq_client_send_buffer_max_bytes",
        "The shard's share of server.maxNodeSendBufferBytes.",
        |f| f.send_buffer_bytes_max,
    ),
    (
        "pinq_publish_bytes_in_flight",
        "Bytes taken from the shard's publish.maxBytesInFlight: publishes being stored and large request frames being read.",
        |f| f.publish_bytes_in_flight,
    ),
];

const COUNTERS: [(&str, &str, Read); 4] = [
    (
        "pinq_client_send_waits",
        "Times a subscription's deliveries waited for room in their connection's or shard's send budget (their copies stay in the sink; the group's other consumers get the next ones).",
        |f| f.sends_waited_total,
    ),
    (
        "pinq_client_send_stall_closes",
        "Connections closed because deliveries waited for room and none of their deliver calls returned within server.sendStallTimeout.",
        |f| f.send_stall_closes_total,
    ),
    (
        "pinq_client_frame_waits",
        "Large request frames whose body waited for room in publish.maxBytesInFlight before it was read off the socket.",
        |f| f.frames_waited_total,
    ),
    (
        "pinq_heap_trims",
        "malloc_trim calls after a connection that held many bytes closed.",
        |f| f.heap_trims_total,
    ),
];

/// Encodes the families for every shard that has published a snapshot.
pub fn encode(
    encoder: &mut DescriptorEncoder,
    shards: &[(String, ShardSnapshot)],
) -> Result<(), std::fmt::Error> {
    for (name, help, read) in GAUGES {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (shard, snap) in shards {
            family
                .encode_family(&[("shard", shard.as_str())])?
                .encode_gauge(&read(&snap.client_memory))?;
        }
    }
    for (name, help, read) in COUNTERS {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (shard, snap) in shards {
            family
                .encode_family(&[("shard", shard.as_str())])?
                .encode_counter::<NoLabelSet, _, u64>(&read(&snap.client_memory), None)?;
        }
    }
    Ok(())
}
