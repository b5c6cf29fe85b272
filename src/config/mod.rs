//! pinq's configuration: every key with its default, loaded from TOML, flags and `PINQ_` env vars.
//!
//! The structs here are what the rest of pinq reads; units are in the field names. Loading and
//! validation (unknown keys, zero intervals, out-of-range values, each error naming its key) live
//! in `load.rs`.

/// Delivery pipeline settings (`[delivery]` in TOML).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryConfig {
    /// `delivery.dispatchPollInterval`: the longest a dispatcher sleeps between passes.
    pub dispatch_poll_interval_ms: u64,
    /// `delivery.inFlightTimeout`: a copy not ACKed within this is redelivered.
    pub in_flight_timeout_ms: u64,
    /// `delivery.deleteBatchInterval`: how often the deleter flushes a partial batch.
    pub delete_batch_interval_ms: u64,
    /// `delivery.deleteBatchMaxKeys`: keys per delete flush; a full batch flushes at once.
    pub delete_batch_keys_max: usize,
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
}

impl Default for DeliveryConfig {
    fn default() -> DeliveryConfig {
        DeliveryConfig {
            dispatch_poll_interval_ms: 50,
            in_flight_timeout_ms: 5_000,
            delete_batch_interval_ms: 500,
            delete_batch_keys_max: 1024,
            ttl_sweep_interval_ms: 60_000,
            consumer_queue_len_max: 1024,
            time_bucket_ms: 1,
            group_retention_ms: 24 * 3600 * 1000,
            unacked_per_consumer_max: 16_384,
            retry_len_max: 65_536,
            scan_batch_len_max: 256,
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
}

impl Default for PublishConfig {
    fn default() -> PublishConfig {
        PublishConfig {
            message_bytes_max: 1 << 20,
            batch_len_max: 10_000,
            ack_level_min: AckLevel::None,
        }
    }
}
