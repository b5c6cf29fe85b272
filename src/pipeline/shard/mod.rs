//! `ShardCore`: one shard's whole delivery pipeline as a pure state machine.
//!
//! It owns the hub, the in-flight table, the per-topic dispatch state, the deleter and the
//! janitor, and ties them together. It performs no I/O and reads no clock: every call takes
//! `now_ms` (clamped so shard time never goes back), store reads come in as data
//! ([`ShardCore::on_scan`]), and changes to durable state go out as commands
//! ([`StoreBatch`], [`DeleteBatch`]) that the shell applies, so a replicated log can later sit in
//! front of the store without changing anything here.
//!
//! The shell (`super::drive` helpers, driven by a glommio task per shard) calls, in a loop:
//! `plan_pass` → scans → `on_scan`, `take_delete_batch` → write → `on_delete_applied`, the janitor
//! pages, `drain` for consumers in `take_ready`, and sleeps until `next_wake_ms`.
//!
//! Backpressure: while the deleter's backlog (keys queued or in delete batches not yet applied)
//! is at or over `deleteBacklogMaxKeys`, `plan_pass` does nothing: no scans, no retry lists, no
//! timers. Consumers drain what is already queued for them and then get nothing new, so their
//! ACKs, and with them the backlog, stop growing; producers slow down as the store fills. The
//! backlog can pass the bound only by copies already handed out when the pause began and by
//! expired keys the janitor finds. The applied delete that brings the backlog under the bound
//! wakes the dispatcher (`on_delete_applied` returns `true`, and sets `wake`).
//!
//! The core is split by responsibility: [`publish`] assigns keys to validated batches,
//! [`consumers`] registers consumers and settles their tags, [`transitions`] moves copies between
//! states and offers them, [`passes`] plans dispatch passes and takes scan results in, and
//! [`deletes`] feeds the deleter and the janitor. This file holds the state they share.

mod consumers;
mod dead_letter;
mod deletes;
mod figures;
mod passes;
mod publish;
mod records;
mod transitions;

pub use consumers::{ConsumerError, Delivery, Settled, TagResult};
pub use dead_letter::{DeadLetter, Release};
pub use publish::StoreBatch;

use std::rc::Rc;
use std::sync::Arc;

use ahash::{AHashMap, AHashSet};

use super::copies::{CopyWrites, Waiters};
use super::dedup::{DedupLimits, DedupTable};
use super::deleter::{Deleter, DeleterLimits};
use super::dispatcher::{TopicDispatch, Unapplied};
use super::hub::{ConsumerId, Hub, HubLimits};
use super::inflight::InFlight;
use super::janitor::Janitor;
use super::policy::Policy;
use super::stock::Stock;
use crate::config::DeliveryConfig;
use crate::storage::signal::Signal;

pub use figures::{GroupFigures, TopicFigures};

/// Counters of one shard (the metrics layer reads these).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub published_total: u64,
    pub dispatched_total: u64,
    pub redelivered_total: u64,
    pub acked_total: u64,
    pub ack_refused_total: u64,
    pub nacked_total: u64,
    pub redeliveries_timeout_total: u64,
    pub redeliveries_nack_total: u64,
    pub redeliveries_disconnect_total: u64,
    pub expired_dispatcher_total: u64,
    pub expired_janitor_total: u64,
    pub consumer_queue_full_total: u64,
    pub unreadable_values_total: u64,
    pub groups_forgotten_total: u64,
    /// Times dispatch paused because the delete backlog reached `deleteBacklogMaxKeys` (pause
    /// episodes, not passes skipped).
    pub delete_backlog_pauses_total: u64,
    /// Published messages not stored because their (producer id, sequence) was already stored
    /// inside `publish.dedupWindow` (answered with the original tag).
    pub publish_duplicates_total: u64,
    /// Copies moved to a dead-letter topic (stored there, then ACKed for their group).
    pub dead_lettered_total: u64,
}

/// A snapshot of a shard's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardStats {
    pub counters: Counters,
    /// Messages dispatched with at least one copy not yet settled (Pending, Delayed or Held):
    /// entries whose copies are all done and only wait for their delete are not counted.
    pub in_flight: usize,
    /// Copies held by consumers (queued for them or delivered, not settled): `ShardStats.inFlight`.
    pub held_copies: u64,
    /// Copies waiting out a NACK delay, a backoff or their dead-letter publish.
    pub delayed_copies: u64,
    pub active_consumers: usize,
    pub delete_batches_total: u64,
    pub deleted_keys_total: u64,
    pub delete_failures_total: u64,
    pub delete_queued: usize,
    /// Keys not yet deleted: queued, or in delete batches not yet applied.
    pub delete_backlog: usize,
    /// `delivery.deleteBacklogMaxKeys`: dispatch pauses while `delete_backlog` is at it.
    pub delete_backlog_max: usize,
    pub pending_copies: usize,
    /// Stored messages that are due and not dispatched, plus copies waiting for redelivery.
    pub backlog: u64,
    /// Stored messages not yet due.
    pub scheduled: u64,
    /// Whether a census of the store has completed since the shard started (before that,
    /// messages stored before the start are missing from `backlog`, `scheduled` and topics).
    pub counted: bool,
    pub topics: Vec<TopicFigures>,
    pub groups: Vec<GroupFigures>,
    /// (producer, sequence) pairs remembered for idempotent publish, and their producers.
    pub dedup_entries: usize,
    pub dedup_producers: usize,
    /// Copy records written, and batches of them refused by the store.
    pub copy_records_total: u64,
    pub copy_record_failures_total: u64,
    /// Copies whose durable ACK or NACK waits for its commit.
    pub durable_waiting: usize,
    /// Copy records read back and not yet taken by a dispatched or deleted message.
    pub copy_records_restored: usize,
}

/// Capacities of the tables that grow with load (memory accounting, tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capacities {
    pub in_flight_entries: usize,
    pub timers: usize,
    pub delete_queue: usize,
    pub delete_known: usize,
}

pub struct ShardCore {
    delivery: DeliveryConfig,
    now_ms: u64,
    next_event_id: u64,
    next_batch_id: u64,
    hub: Hub,
    inflight: InFlight,
    topics: AHashMap<Arc<str>, TopicDispatch>,
    unapplied: Unapplied,
    deleter: Deleter,
    janitor: Janitor,
    /// Stored, due and scheduled messages per topic (figures only).
    stock: Stock,
    /// In-flight entries marked `deleting` (all copies done, or expired), kept so `stats` need
    /// not walk the table.
    deleting_entries: usize,
    /// The last pass found the delete backlog at its bound and did nothing.
    paused: bool,
    ready: AHashSet<ConsumerId>,
    /// Something happened that the next pass should act on at once.
    wake: bool,
    productive: bool,
    counters: Counters,
    /// Idempotent publish: the (producer, sequence) pairs stored inside the window.
    dedup: DedupTable,
    /// Notified whenever a publish batch settles (applied or failed), and when the core is
    /// dropped: a batch that answered with a pending original waits on it.
    settled: Rc<Signal>,
    policies: dead_letter::Policies,
    /// Copy records queued, being written, and read back at start (`records`).
    copies: CopyWrites,
    /// `durable` ACKs and NACKs waiting for their commit; dropping the core loses them.
    waiters: Waiters,
}

impl Drop for ShardCore {
    fn drop(&mut self) {
        // A replaced core's waiters wake, see they are no longer current, and give up.
        self.settled.notify();
    }
}

impl ShardCore {
    pub fn new(delivery: DeliveryConfig, now_ms: u64) -> ShardCore {
        ShardCore {
            hub: Hub::with_limits(HubLimits {
                queue_len_max: delivery.consumer_queue_len_max,
                unacked_max: delivery.unacked_per_consumer_max,
                groups_per_topic_max: delivery.groups_per_topic_max,
                groups_per_shard_max: delivery.groups_per_shard_max,
                consumers_per_group_max: delivery.consumers_per_group_max,
            }),
            deleter: Deleter::new(
                DeleterLimits {
                    interval_ms: delivery.delete_batch_interval_ms,
                    batch_keys_max: delivery.delete_batch_keys_max,
                    batches_in_flight_max: delivery.delete_batches_in_flight_max,
                    backlog_keys_max: delivery.delete_backlog_keys_max,
                },
                now_ms,
            ),
            janitor: Janitor::new(
                delivery.ttl_sweep_interval_ms,
                delivery.scan_batch_len_max.max(1024),
                now_ms,
            ),
            stock: Stock::new(delivery.counted_topics_max),
            policies: dead_letter::Policies::new(Policy {
                max_deliveries: delivery.max_deliveries,
                dead_letter_topic: delivery.dead_letter_topic.clone(),
                backoff: delivery.redelivery_backoff,
            }),
            delivery,
            now_ms,
            next_event_id: 1,
            next_batch_id: 1,
            inflight: InFlight::new(),
            topics: AHashMap::new(),
            unapplied: Unapplied::default(),
            deleting_entries: 0,
            paused: false,
            ready: AHashSet::new(),
            wake: false,
            productive: false,
            counters: Counters::default(),
            dedup: DedupTable::new(DedupLimits::default()),
            settled: Rc::new(Signal::default()),
            copies: CopyWrites::default(),
            waiters: Waiters::default(),
        }
    }

    /// Sets the bounds of idempotent publish (`[publish]`); call before the first publish.
    pub fn with_dedup_limits(mut self, limits: DedupLimits) -> ShardCore {
        self.dedup = DedupTable::new(limits);
        self
    }

    pub fn dedup_limits(&self) -> DedupLimits {
        self.dedup.limits()
    }

    /// Advances shard time; the wall clock may step back, shard time never does.
    fn tick(&mut self, now_ms: u64) -> u64 {
        self.now_ms = self.now_ms.max(now_ms);
        self.now_ms
    }

    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Continues event ids after a restart from the persisted high-water mark.
    pub fn recover_event_ids(&mut self, high_water: u64) {
        self.next_event_id = self.next_event_id.max(high_water.saturating_add(1));
    }

    // ---- figures -------------------------------------------------------------------------

    pub fn stats(&self) -> ShardStats {
        assert!(
            self.deleting_entries <= self.inflight.len(),
            "{} entries counted as deleting, {} in the table",
            self.deleting_entries,
            self.inflight.len()
        );
        let (topics, groups) = self.figures();
        ShardStats {
            backlog: topics.iter().map(|t| t.waiting).sum::<u64>()
                + groups.iter().map(|g| g.pending).sum::<u64>(),
            scheduled: topics.iter().map(|t| t.scheduled).sum(),
            held_copies: self.held_copies(),
            delayed_copies: groups.iter().map(|g| g.delayed).sum(),
            counted: self.stock.counted(),
            topics,
            groups,
            counters: self.counters.clone(),
            in_flight: self.inflight.len() - self.deleting_entries,
            active_consumers: self.hub.consumers.len(),
            delete_batches_total: self.deleter.batches_total,
            deleted_keys_total: self.deleter.keys_total,
            delete_failures_total: self.deleter.failures_total,
            delete_queued: self.deleter.queued(),
            delete_backlog: self.deleter.backlog(),
            delete_backlog_max: self.delivery.delete_backlog_keys_max,
            pending_copies: self.hub.recipients.values().map(|r| r.pending.len()).sum(),
            dedup_entries: self.dedup.len(),
            dedup_producers: self.dedup.producers(),
            copy_records_total: self.copies.records_total,
            copy_record_failures_total: self.copies.failures_total,
            durable_waiting: self.waiters.len(),
            copy_records_restored: self.copies.restored_len(),
        }
    }

    /// A consumer's UUID, topic and current queue length (for the shell and for tests).
    pub fn consumer_info(&self, consumer: ConsumerId) -> Option<(uuid::Uuid, &str, usize, usize)> {
        self.hub
            .consumers
            .get(&consumer)
            .map(|c| (c.uuid, c.topic.as_ref(), c.queue.len(), c.held.len()))
    }

    /// A consumer's window (`queueSize` in force) and its deliveries not yet returned (tests).
    pub fn consumer_window(&self, consumer: ConsumerId) -> Option<(usize, usize)> {
        self.hub.consumers.get(&consumer).map(|c| (c.window, c.out))
    }

    pub fn consumer_count(&self) -> usize {
        self.hub.consumers.len()
    }

    /// Number of lease and NACK-delay timers: one per held or delayed copy (benchmarks, memory
    /// accounting, tests).
    pub fn timers_len(&self) -> usize {
        self.inflight.timers_len()
    }

    /// Groups on this shard, with consumers or not (tests, figures).
    pub fn groups_len(&self) -> usize {
        self.hub.groups_len()
    }

    /// Groups looked at by retirement so far: the work [`Self::plan_pass`] spends on retiring
    /// groups (tests).
    pub fn retire_checks_total(&self) -> u64 {
        self.hub.retire_checks_total
    }

    /// Recipients the next pass serves the retry list of (tests).
    #[cfg(test)]
    pub(crate) fn servable_len(&self) -> usize {
        self.hub.servable().count()
    }

    /// Checks the core's internal bookkeeping against a walk of its tables (tests).
    #[cfg(test)]
    pub(crate) fn assert_consistent(&self) {
        self.inflight.assert_timers_match_copies();
        self.hub.assert_servable_exact();
    }

    /// Whether an in-flight entry for `key` still holds its value (`None`: no entry).
    #[cfg(test)]
    pub(crate) fn value_held(&self, key: &crate::key::EventKey) -> Option<bool> {
        self.inflight.entries.get(key).map(|e| e.value.is_some())
    }

    /// Capacities of the tables that grow with load (memory accounting, tests).
    pub fn capacities(&self) -> Capacities {
        let (in_flight_entries, timers) = self.inflight.capacities();
        let (delete_queue, delete_known) = self.deleter.capacities();
        Capacities {
            in_flight_entries,
            timers,
            delete_queue,
            delete_known,
        }
    }
}
