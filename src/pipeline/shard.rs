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

use std::sync::Arc;

use ahash::{AHashMap, AHashSet};
use smallvec::SmallVec;

use super::deleter::{DeleteBatch, Deleter, DeleterLimits};
use super::dispatcher::{ScanRequest, TopicDispatch, Unapplied};
use super::hub::{ConsumerId, Hub, Queued, RecipientId, RecipientKind};
use super::inflight::{Copy, CopyState, Entry, InFlight, Timer};
use super::janitor::{Janitor, SweepPage};
use super::memory::give_back;
use crate::config::{AckLevel, DeliveryConfig, PublishConfig};
use crate::key::{
    self, due_bucket, due_bucket_bound, topic_end, EventKey, Key, KeyError, TopicHash,
};
use crate::log::Command;
use crate::message::{CodecError, Header, StoredMessage, Value};

/// One message of a publish request, as a client sent it (delay and TTL are checked here).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishMessage {
    pub topic: String,
    pub payload: Vec<u8>,
    pub delay_ms: i64,
    pub ttl_ms: i64,
    pub headers: Vec<Header>,
}

impl PublishMessage {
    pub fn new(topic: &str, payload: &[u8]) -> PublishMessage {
        PublishMessage {
            topic: topic.into(),
            payload: payload.to_vec(),
            delay_ms: 0,
            ttl_ms: 0,
            headers: Vec::new(),
        }
    }
}

/// Why a publish batch was refused. Nothing of a refused batch is written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    #[error("message {index}: {source}")]
    Topic { index: usize, source: KeyError },
    #[error("message {index}: delay_ms is {value}, it must be >= 0")]
    NegativeDelay { index: usize, value: i64 },
    #[error("message {index}: ttl_ms is {value}, it must be >= 0 (0 = never expires)")]
    NegativeTtl { index: usize, value: i64 },
    #[error("message {index}: payload is {len} bytes, publish.maxMessageBytes is {max}")]
    PayloadTooLarge {
        index: usize,
        len: usize,
        max: usize,
    },
    #[error("batch has {len} messages, publish.maxBatchMessages is {max}")]
    BatchTooLarge { len: usize, max: usize },
    #[error("ack level {requested:?} is weaker than publish.minAckLevel {min:?}")]
    AckLevelTooWeak { requested: AckLevel, min: AckLevel },
    #[error("message {index}: {source}")]
    Encode { index: usize, source: CodecError },
}

/// The replicable command of a publish: keys assigned, values encoded.
#[derive(Clone, Debug)]
pub struct StoreBatch {
    pub id: u64,
    pub messages: Vec<(EventKey, Value)>,
    /// The highest event id assigned so far, persisted with the batch so ids survive restarts.
    pub event_id_high_water: u64,
}

impl StoreBatch {
    /// The command that stores this batch (values are shared, not copied).
    pub fn command(&self) -> Command {
        Command::Store {
            messages: self.messages.clone(),
            event_id_high_water: self.event_id_high_water,
        }
    }

    pub fn tags(&self) -> Vec<EventKey> {
        self.messages.iter().map(|(key, _)| *key).collect()
    }
}

impl DeleteBatch {
    /// The command that deletes this batch's keys.
    pub fn command(&self) -> Command {
        Command::Delete {
            keys: self.keys.clone(),
        }
    }
}

/// The answer for one tag of an ACK, NACK or touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TagResult {
    Ok,
    /// No message with this tag is in flight on this shard.
    UnknownTag,
    /// The message is in flight, but this consumer does not hold its copy.
    NotHolder,
    /// This consumer's recipient has already acknowledged the message.
    AlreadyAcked,
    /// The tag is not a 24-byte event key.
    Malformed,
}

/// A copy handed to a consumer.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub key: EventKey,
    pub value: Value,
    pub attempt: u32,
}

/// Errors of consumer-facing calls.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConsumerError {
    #[error("{0}")]
    Topic(#[from] KeyError),
    #[error("unknown consumer")]
    UnknownConsumer,
    #[error("group {group:?} of topic {topic:?} does not exist")]
    UnknownGroup { topic: String, group: String },
    #[error("group {group:?} of topic {topic:?} still has consumers")]
    GroupHasConsumers { topic: String, group: String },
}

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
}

/// A snapshot of a shard's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardStats {
    pub counters: Counters,
    /// Messages dispatched with at least one copy not yet settled (Pending, Delayed or Held):
    /// entries whose copies are all done and only wait for their delete are not counted.
    pub in_flight: usize,
    pub active_consumers: usize,
    pub delete_batches_total: u64,
    pub deleted_keys_total: u64,
    pub delete_failures_total: u64,
    pub delete_queued: usize,
    /// Keys not yet deleted: queued, or in delete batches not yet applied.
    pub delete_backlog: usize,
    pub pending_copies: usize,
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
    publish: PublishConfig,
    now_ms: u64,
    next_event_id: u64,
    next_batch_id: u64,
    hub: Hub,
    inflight: InFlight,
    topics: AHashMap<Arc<str>, TopicDispatch>,
    unapplied: Unapplied,
    deleter: Deleter,
    janitor: Janitor,
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
}

impl ShardCore {
    pub fn new(delivery: DeliveryConfig, publish: PublishConfig, now_ms: u64) -> ShardCore {
        ShardCore {
            hub: Hub::new(
                delivery.consumer_queue_len_max,
                delivery.unacked_per_consumer_max,
            ),
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
            delivery,
            publish,
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
        }
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

    // ---- publish -------------------------------------------------------------------------

    /// Validates a batch and assigns its keys. The whole batch is refused if any message is bad.
    pub fn prepare_publish(
        &mut self,
        now_ms: u64,
        messages: &[PublishMessage],
        ack: AckLevel,
    ) -> Result<StoreBatch, PublishError> {
        if ack < self.publish.ack_level_min {
            return Err(PublishError::AckLevelTooWeak {
                requested: ack,
                min: self.publish.ack_level_min,
            });
        }
        if messages.len() > self.publish.batch_len_max {
            return Err(PublishError::BatchTooLarge {
                len: messages.len(),
                max: self.publish.batch_len_max,
            });
        }
        for (index, m) in messages.iter().enumerate() {
            key::validate_topic(&m.topic)
                .map_err(|source| PublishError::Topic { index, source })?;
            if m.delay_ms < 0 {
                return Err(PublishError::NegativeDelay {
                    index,
                    value: m.delay_ms,
                });
            }
            if m.ttl_ms < 0 {
                return Err(PublishError::NegativeTtl {
                    index,
                    value: m.ttl_ms,
                });
            }
            if m.payload.len() > self.publish.message_bytes_max {
                return Err(PublishError::PayloadTooLarge {
                    index,
                    len: m.payload.len(),
                    max: self.publish.message_bytes_max,
                });
            }
        }
        let now_ms = self.tick(now_ms);
        let mut out = Vec::with_capacity(messages.len());
        let mut lowest_due: Vec<(TopicHash, u64)> = Vec::new();
        for (index, m) in messages.iter().enumerate() {
            let stored = StoredMessage {
                topic: m.topic.clone(),
                payload: m.payload.clone(),
                enqueued_at_ms: now_ms,
                delay_ms: m.delay_ms as u64,
                ttl_ms: m.ttl_ms as u64,
                headers: m.headers.clone(),
            };
            let value =
                Value::encode(&stored).map_err(|source| PublishError::Encode { index, source })?;
            let hash = TopicHash::of(&m.topic);
            let due = due_bucket(now_ms, m.delay_ms as u64, self.delivery.time_bucket_ms);
            match lowest_due.iter_mut().find(|(t, _)| *t == hash) {
                Some((_, low)) => *low = (*low).min(due),
                None => lowest_due.push((hash, due)),
            }
            out.push((
                EventKey::new(hash, due, self.next_event_id + index as u64),
                value,
            ));
        }
        self.next_event_id += messages.len() as u64;
        let id = self.next_batch_id;
        self.next_batch_id += 1;
        self.unapplied.insert(id, lowest_due);
        Ok(StoreBatch {
            id,
            messages: out,
            event_id_high_water: self.next_event_id - 1,
        })
    }

    /// The batch is in the store: wake the dispatcher for served topics it touched.
    pub fn on_publish_applied(&mut self, batch: &StoreBatch) {
        self.unapplied.remove(batch.id);
        self.counters.published_total += batch.messages.len() as u64;
        let bound = due_bucket_bound(self.now_ms, self.delivery.time_bucket_ms);
        for (key, value) in &batch.messages {
            let Ok(message) = value.message() else {
                continue;
            };
            if let Some(topic) = self.topics.get_mut(message.topic.as_str()) {
                topic.note_published(key.due_bucket());
                if key.due_bucket() < bound {
                    self.wake = true;
                }
            }
        }
    }

    /// The batch was not stored; its keys are abandoned.
    pub fn on_publish_failed(&mut self, batch_id: u64) {
        self.unapplied.remove(batch_id);
    }

    // ---- consumers -----------------------------------------------------------------------

    /// Registers a consumer of `topic` in `group` (empty = universal) and wakes the dispatcher.
    pub fn subscribe(
        &mut self,
        now_ms: u64,
        topic: &str,
        group: &str,
        uuid: uuid::Uuid,
    ) -> Result<ConsumerId, ConsumerError> {
        key::validate_topic(topic)?;
        self.tick(now_ms);
        let registered = self.hub.register(topic, group, uuid);
        if !self.topics.contains_key(topic) {
            self.topics
                .insert(Arc::from(topic), TopicDispatch::new(TopicHash::of(topic)));
        }
        // A returning group member picks up its group's parked copies on the next pass.
        self.wake = true;
        Ok(registered.consumer)
    }

    /// Removes a consumer: its group copies become redeliverable at once; a universal consumer's
    /// copies are forgotten (fan-out listeners do not hold messages back).
    pub fn unsubscribe(&mut self, now_ms: u64, consumer: ConsumerId) -> Result<(), ConsumerError> {
        let now_ms = self.tick(now_ms);
        let gone = self
            .hub
            .unregister(consumer, now_ms)
            .ok_or(ConsumerError::UnknownConsumer)?;
        self.ready.remove(&consumer);
        let recipient = gone.consumer.recipient;
        let universal = gone.recipient_removed.is_some();
        for key in gone.consumer.held {
            if universal {
                self.forget_copy(key, recipient);
            } else {
                self.counters.redeliveries_disconnect_total += 1;
                self.make_pending(key, recipient);
            }
        }
        if let Some(removed) = gone.recipient_removed {
            for key in removed.pending {
                self.forget_copy(key, recipient);
            }
        }
        self.drop_topic_if_gone(&gone.consumer.topic);
        Ok(())
    }

    /// Forgets a group with no consumers at once, with its claims (an admin call).
    pub fn forget_group(
        &mut self,
        now_ms: u64,
        topic: &str,
        group: &str,
    ) -> Result<(), ConsumerError> {
        self.tick(now_ms);
        let recipient = self
            .hub
            .topics
            .get(topic)
            .and_then(|t| t.groups.get(group))
            .copied()
            .ok_or_else(|| ConsumerError::UnknownGroup {
                topic: topic.into(),
                group: group.into(),
            })?;
        self.forget_group_id(recipient)
            .ok_or_else(|| ConsumerError::GroupHasConsumers {
                topic: topic.into(),
                group: group.into(),
            })
    }

    fn forget_group_id(&mut self, recipient: RecipientId) -> Option<()> {
        let removed = self.hub.remove_group(recipient)?;
        self.counters.groups_forgotten_total += 1;
        for key in removed.pending {
            self.forget_copy(key, recipient);
        }
        self.drop_topic_if_gone(&removed.topic);
        Some(())
    }

    fn drop_topic_if_gone(&mut self, topic: &str) {
        if !self.hub.topics.contains_key(topic) {
            self.topics.remove(topic);
        }
    }

    /// Consumers with new deliveries queued since the last call.
    pub fn take_ready(&mut self) -> Vec<ConsumerId> {
        self.ready.drain().collect()
    }

    /// Takes up to `max` deliveries from a consumer's queue. Copies that changed hands since they
    /// were queued are dropped; expired messages are never handed out.
    pub fn drain(&mut self, now_ms: u64, consumer: ConsumerId, max: usize) -> Vec<Delivery> {
        let now_ms = self.tick(now_ms);
        let mut out = Vec::new();
        let mut expired: SmallVec<[EventKey; 4]> = SmallVec::new();
        let Some(c) = self.hub.consumers.get_mut(&consumer) else {
            return out;
        };
        let recipient = c.recipient;
        while out.len() < max {
            let Some(Queued { key, attempt }) = c.queue.pop_front() else {
                break;
            };
            let Some(entry) = self.inflight.entries.get(&key) else {
                continue;
            };
            let Some(copy) = entry.copies.iter().find(|cp| cp.recipient == recipient) else {
                continue;
            };
            let current = matches!(copy.state, CopyState::Held { consumer: h, .. } if h == consumer)
                && copy.attempt == attempt
                && !entry.deleting;
            if !current {
                continue;
            }
            if entry.is_expired(now_ms) {
                expired.push(key);
                continue;
            }
            // A held copy is not done, so its entry is not deleting and still has its value.
            let Some(value) = entry.value.clone() else {
                continue;
            };
            out.push(Delivery {
                key,
                value,
                attempt,
            });
        }
        let topic = c.topic.clone();
        for key in expired {
            self.counters.expired_dispatcher_total += 1;
            self.expire(key);
        }
        self.wake_if_blocked(&topic);
        out
    }

    fn wake_if_blocked(&mut self, topic: &str) {
        if self.topics.get(topic).is_some_and(|t| t.blocked) {
            self.wake = true;
        }
    }

    /// Acknowledges copies held by `consumer`. A message is deleted once all its recipients ACKed.
    pub fn ack(
        &mut self,
        now_ms: u64,
        consumer: ConsumerId,
        tags: &[&[u8]],
    ) -> Result<Vec<TagResult>, ConsumerError> {
        self.tick(now_ms);
        self.settle(consumer, tags, |core, key, recipient| {
            core.counters.acked_total += 1;
            if let Some(entry) = core.inflight.entries.get_mut(&key) {
                if let Some(copy) = entry.copy_mut(recipient) {
                    copy.state = CopyState::Acked;
                }
            }
            core.complete_if_done(key);
        })
    }

    /// Releases copies held by `consumer` for redelivery, at once or after `delay_ms`.
    pub fn nack(
        &mut self,
        now_ms: u64,
        consumer: ConsumerId,
        tags: &[&[u8]],
        delay_ms: u64,
    ) -> Result<Vec<TagResult>, ConsumerError> {
        let now_ms = self.tick(now_ms);
        self.settle(consumer, tags, |core, key, recipient| {
            core.counters.nacked_total += 1;
            core.counters.redeliveries_nack_total += 1;
            if delay_ms == 0 {
                core.make_pending(key, recipient);
            } else {
                let generation = core.inflight.next_generation();
                let until_ms = now_ms.saturating_add(delay_ms);
                if let Some(copy) = core
                    .inflight
                    .entries
                    .get_mut(&key)
                    .and_then(|e| e.copy_mut(recipient))
                {
                    copy.state = CopyState::Delayed { until_ms };
                    copy.generation = generation;
                }
                core.inflight.schedule(Timer {
                    at_ms: until_ms,
                    key,
                    recipient,
                    generation,
                });
            }
        })
    }

    /// Extends the lease of copies held by `consumer` by a full `inFlightTimeout` from now.
    pub fn touch(
        &mut self,
        now_ms: u64,
        consumer: ConsumerId,
        tags: &[&[u8]],
    ) -> Result<Vec<TagResult>, ConsumerError> {
        let now_ms = self.tick(now_ms);
        let deadline_ms = now_ms.saturating_add(self.delivery.in_flight_timeout_ms);
        let mut results = Vec::with_capacity(tags.len());
        for tag in tags {
            let result = match self.holder_check(consumer, tag)? {
                Ok((key, recipient)) => {
                    let generation = self.inflight.next_generation();
                    if let Some(copy) = self
                        .inflight
                        .entries
                        .get_mut(&key)
                        .and_then(|e| e.copy_mut(recipient))
                    {
                        copy.state = CopyState::Held {
                            consumer,
                            deadline_ms,
                        };
                        copy.generation = generation;
                    }
                    self.inflight.schedule(Timer {
                        at_ms: deadline_ms,
                        key,
                        recipient,
                        generation,
                    });
                    TagResult::Ok
                }
                Err(refused) => refused,
            };
            results.push(result);
        }
        Ok(results)
    }

    /// Shared path of ACK and NACK: checks each tag is held by `consumer`, releases it from the
    /// consumer, then applies `settled` to it.
    fn settle(
        &mut self,
        consumer: ConsumerId,
        tags: &[&[u8]],
        mut settled: impl FnMut(&mut ShardCore, EventKey, RecipientId),
    ) -> Result<Vec<TagResult>, ConsumerError> {
        let mut results = Vec::with_capacity(tags.len());
        for tag in tags {
            let result = match self.holder_check(consumer, tag)? {
                Ok((key, recipient)) => {
                    if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                        c.held.remove(&key);
                    }
                    if let Some(copy) = self
                        .inflight
                        .entries
                        .get_mut(&key)
                        .and_then(|e| e.copy_mut(recipient))
                    {
                        copy.generation = 0;
                    }
                    settled(self, key, recipient);
                    TagResult::Ok
                }
                Err(refused) => {
                    self.counters.ack_refused_total += 1;
                    refused
                }
            };
            results.push(result);
        }
        if let Some(topic) = self.hub.consumers.get(&consumer).map(|c| c.topic.clone()) {
            self.wake_if_blocked(&topic);
        }
        Ok(results)
    }

    /// Whether `consumer` holds the copy named by `tag`: `Ok((key, recipient))`, or the refusal.
    fn holder_check(
        &self,
        consumer: ConsumerId,
        tag: &[u8],
    ) -> Result<Result<(EventKey, RecipientId), TagResult>, ConsumerError> {
        let recipient = self
            .hub
            .consumers
            .get(&consumer)
            .ok_or(ConsumerError::UnknownConsumer)?
            .recipient;
        let Ok(key) = EventKey::parse(tag) else {
            return Ok(Err(TagResult::Malformed));
        };
        let Some(entry) = self.inflight.entries.get(&key) else {
            return Ok(Err(TagResult::UnknownTag));
        };
        let Some(copy) = entry.copies.iter().find(|c| c.recipient == recipient) else {
            return Ok(Err(TagResult::NotHolder));
        };
        Ok(match copy.state {
            CopyState::Held {
                consumer: holder, ..
            } if holder == consumer => Ok((key, recipient)),
            CopyState::Acked => Err(TagResult::AlreadyAcked),
            _ => Err(TagResult::NotHolder),
        })
    }

    // ---- copy transitions ----------------------------------------------------------------

    /// Puts a copy back in its recipient's retry list, or forgets it if the recipient is gone.
    fn make_pending(&mut self, key: EventKey, recipient: RecipientId) {
        let Some(r) = self.hub.recipients.get_mut(&recipient) else {
            self.forget_copy(key, recipient);
            return;
        };
        let generation = self.inflight.next_generation();
        let Some(copy) = self
            .inflight
            .entries
            .get_mut(&key)
            .and_then(|e| e.copy_mut(recipient))
        else {
            return;
        };
        if copy.is_done() || copy.state == CopyState::Pending {
            return;
        }
        copy.state = CopyState::Pending;
        copy.generation = generation;
        r.pending.push_back(key);
        self.wake = true;
    }

    fn forget_copy(&mut self, key: EventKey, recipient: RecipientId) {
        if let Some(copy) = self
            .inflight
            .entries
            .get_mut(&key)
            .and_then(|e| e.copy_mut(recipient))
        {
            if !copy.is_done() {
                copy.state = CopyState::Forgotten;
                copy.generation = 0;
            }
        }
        self.complete_if_done(key);
    }

    fn complete_if_done(&mut self, key: EventKey) {
        if let Some(entry) = self.inflight.entries.get_mut(&key) {
            if !entry.deleting && entry.all_done() {
                Self::mark_deleting(entry, &mut self.deleting_entries);
                self.deleter.mark(key);
            }
        }
    }

    /// The entry only waits for its delete now: nothing hands its value out again, so it is
    /// dropped here rather than when the (possibly much later) delete is applied.
    fn mark_deleting(entry: &mut Entry, deleting_entries: &mut usize) {
        if !entry.deleting {
            entry.deleting = true;
            *deleting_entries += 1;
        }
        entry.value = None;
    }

    /// An expired message: every copy is dropped and the key goes to the deleter.
    fn expire(&mut self, key: EventKey) {
        if let Some(entry) = self.inflight.entries.get_mut(&key) {
            for copy in entry.copies.iter_mut() {
                if let CopyState::Held { consumer, .. } = copy.state {
                    if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                        c.held.remove(&key);
                    }
                }
                if !copy.is_done() {
                    copy.state = CopyState::Forgotten;
                }
            }
            Self::mark_deleting(entry, &mut self.deleting_entries);
        }
        self.deleter.mark(key);
    }

    /// Hands a copy to a consumer of its recipient, if one has room.
    fn offer(&mut self, key: EventKey, recipient: RecipientId, now_ms: u64) -> bool {
        let (chosen, skipped) = self.hub.choose(recipient);
        self.counters.consumer_queue_full_total += skipped;
        let Some(consumer) = chosen else { return false };
        let generation = self.inflight.next_generation();
        let deadline_ms = now_ms.saturating_add(self.delivery.in_flight_timeout_ms);
        let Some(copy) = self
            .inflight
            .entries
            .get_mut(&key)
            .and_then(|e| e.copy_mut(recipient))
        else {
            return false;
        };
        copy.state = CopyState::Held {
            consumer,
            deadline_ms,
        };
        copy.attempt += 1;
        copy.generation = generation;
        let attempt = copy.attempt;
        self.inflight.schedule(Timer {
            at_ms: deadline_ms,
            key,
            recipient,
            generation,
        });
        if let Some(c) = self.hub.consumers.get_mut(&consumer) {
            c.queue.push_back(Queued { key, attempt });
            c.held.insert(key);
        }
        self.ready.insert(consumer);
        self.counters.dispatched_total += 1;
        if attempt > 1 {
            self.counters.redelivered_total += 1;
        }
        self.productive = true;
        true
    }

    // ---- dispatch passes -----------------------------------------------------------------

    /// Starts a dispatch pass: releases timed-out leases and ended NACK delays, serves retry
    /// lists, forgets groups past their retention, and returns the scans to run. While the delete
    /// backlog is at its bound the pass does none of that and returns no scans (module docs).
    pub fn plan_pass(&mut self, now_ms: u64) -> Vec<ScanRequest> {
        let now_ms = self.tick(now_ms);
        self.wake = false;
        self.productive = false;

        if self.deleter.is_over_backlog() {
            if !self.paused {
                self.paused = true;
                self.counters.delete_backlog_pauses_total += 1;
            }
            return Vec::new();
        }
        self.paused = false;

        while let Some(timer) = self.inflight.pop_due_timer(now_ms) {
            let state = self
                .inflight
                .entries
                .get(&timer.key)
                .and_then(|e| e.copies.iter().find(|c| c.recipient == timer.recipient))
                .map(|c| c.state);
            match state {
                Some(CopyState::Held { consumer, .. }) => {
                    if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                        c.held.remove(&timer.key);
                    }
                    self.counters.redeliveries_timeout_total += 1;
                    self.make_pending(timer.key, timer.recipient);
                }
                Some(CopyState::Delayed { .. }) => self.make_pending(timer.key, timer.recipient),
                _ => {}
            }
        }

        self.forget_retired_groups(now_ms);

        let recipients: Vec<RecipientId> = self
            .hub
            .recipients
            .iter()
            .filter(|(_, r)| !r.pending.is_empty() && r.has_members())
            .map(|(id, _)| *id)
            .collect();
        for recipient in recipients {
            self.serve_pending(recipient, now_ms);
        }

        let bound_bucket = due_bucket_bound(now_ms, self.delivery.time_bucket_ms);
        let poll_ms = self.delivery.dispatch_poll_interval_ms;
        let mut requests = Vec::new();
        for (name, topic) in self.topics.iter_mut() {
            let Some(members) = self.hub.topics.get(name) else {
                continue;
            };
            if members.live_consumers == 0 {
                continue;
            }
            let bound = self
                .unapplied
                .lowest_due(topic.hash)
                .map_or(bound_bucket, |low| low.min(bound_bucket));
            let polled = now_ms >= topic.last_scan_ms.saturating_add(poll_ms);
            if !topic.wants_scan(bound) && !polled {
                continue;
            }
            let recipients = self.hub.recipients_of(name);
            let room = recipients
                .iter()
                .map(|r| self.hub.room(*r))
                .max()
                .unwrap_or(0);
            let pending: usize = recipients
                .iter()
                .filter_map(|r| self.hub.recipients.get(r))
                .map(|r| r.pending.len())
                .sum();
            // Each message read may park one copy per recipient in the retry lists, so a scan
            // reads at most (free room / recipients) messages, but at least one while there is any
            // room: with more recipients than the bound the quotient is 0, and the topic would
            // never be read again. The lists may so overshoot the bound by `recipients - 1`.
            let budget = match self.delivery.retry_len_max.saturating_sub(pending) {
                0 => 0,
                free => (free / recipients.len().max(1)).max(1),
            };
            let limit = self.delivery.scan_batch_len_max.min(room).min(budget);
            topic.blocked = limit == 0;
            if topic.blocked {
                continue;
            }
            let start = topic.scan_start();
            let end = EventKey::new(topic.hash, bound, 0).to_key();
            topic.last_scan_ms = now_ms;
            topic.noted_during_scan = None;
            if start >= end {
                // Only a publish still being written holds the bound this low. Nothing past the
                // cursor is due before the bound, so a next due bucket below it is stale.
                topic.more = false;
                topic.next_due_bucket = topic.next_due_bucket.map(|due| due.max(bound));
                continue;
            }
            requests.push(ScanRequest {
                topic: name.clone(),
                start,
                end,
                limit,
                seek_end: topic_end(topic.hash),
            });
        }
        requests
    }

    fn forget_retired_groups(&mut self, now_ms: u64) {
        let retention_ms = self.delivery.group_retention_ms;
        let retired: SmallVec<[RecipientId; 4]> = self
            .hub
            .recipients
            .iter()
            .filter(|(_, r)| {
                matches!(r.kind, RecipientKind::Group { empty_since_ms: Some(since), .. }
                    if now_ms >= since.saturating_add(retention_ms))
            })
            .map(|(id, _)| *id)
            .collect();
        for recipient in retired {
            self.forget_group_id(recipient);
        }
    }

    fn serve_pending(&mut self, recipient: RecipientId, now_ms: u64) {
        loop {
            let Some(key) = self
                .hub
                .recipients
                .get(&recipient)
                .and_then(|r| r.pending.front().copied())
            else {
                return;
            };
            let status = match self.inflight.entries.get(&key) {
                Some(entry) if !entry.deleting => {
                    match entry
                        .copies
                        .iter()
                        .find(|c| c.recipient == recipient)
                        .map(|c| c.state)
                    {
                        Some(CopyState::Pending) if entry.is_expired(now_ms) => {
                            PendingStatus::Expired
                        }
                        Some(CopyState::Pending) => PendingStatus::Ready,
                        _ => PendingStatus::Stale,
                    }
                }
                _ => PendingStatus::Stale,
            };
            match status {
                PendingStatus::Stale => {}
                PendingStatus::Expired => {
                    self.counters.expired_dispatcher_total += 1;
                    self.expire(key);
                }
                PendingStatus::Ready => {
                    if !self.offer(key, recipient, now_ms) {
                        return;
                    }
                }
            }
            if let Some(r) = self.hub.recipients.get_mut(&recipient) {
                r.pending.pop_front();
                give_back(&mut r.pending);
            }
        }
    }

    /// Feeds the rows a [`ScanRequest`] returned, and the first key at or past its bound (the
    /// seek) when the scan came back short.
    pub fn on_scan(
        &mut self,
        now_ms: u64,
        request: &ScanRequest,
        rows: &[(Key, Value)],
        next_key: Option<&[u8]>,
    ) {
        let now_ms = self.tick(now_ms);
        let topic_name = request.topic.as_ref();
        let recipients = self.hub.recipients_of(topic_name);
        if recipients.is_empty() || !self.topics.contains_key(topic_name) {
            return;
        }
        for (raw, value) in rows {
            let Ok(key) = EventKey::parse(raw) else {
                continue;
            };
            if let Some(topic) = self.topics.get_mut(topic_name) {
                topic.cursor = Some(key);
            }
            if self.inflight.entries.contains_key(&key) {
                continue;
            }
            let message = match value.message() {
                Ok(message) => message,
                Err(_) => {
                    self.counters.unreadable_values_total += 1;
                    continue;
                }
            };
            if message.topic.as_str() != topic_name {
                continue; // another topic with the same hash
            }
            if message.is_expired(now_ms) {
                self.counters.expired_dispatcher_total += 1;
                self.deleter.mark(key);
                continue;
            }
            let copies = recipients
                .iter()
                .map(|r| Copy {
                    recipient: *r,
                    state: CopyState::Pending,
                    attempt: 0,
                    generation: 0,
                })
                .collect();
            self.inflight.entries.insert(
                key,
                Entry {
                    value: Some(value.clone()),
                    expires_at_ms: message.expires_at_ms(),
                    copies,
                    deleting: false,
                },
            );
            for recipient in &recipients {
                if !self.offer(key, *recipient, now_ms) {
                    if let Some(r) = self.hub.recipients.get_mut(recipient) {
                        r.pending.push_back(key);
                    }
                }
            }
        }
        let Some(topic) = self.topics.get_mut(topic_name) else {
            return;
        };
        if rows.len() >= request.limit {
            topic.more = true;
            self.productive = true;
        } else {
            topic.more = false;
            let seen = next_key
                .and_then(|k| EventKey::parse(k).ok())
                .filter(|k| k.topic_hash() == topic.hash)
                .map(|k| k.due_bucket());
            topic.next_due_bucket = match (seen, topic.noted_during_scan) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
    }

    /// Whether the last pass did something, so the next one should run at once.
    pub fn productive(&self) -> bool {
        self.productive
    }

    /// When the shell should run the next pass (or flush, or sweep): at most a poll interval away.
    pub fn next_wake_ms(&self) -> u64 {
        let mut at = self.next_pass_ms();
        for candidate in [self.deleter.next_flush_ms(), self.janitor.next_sweep_ms()]
            .into_iter()
            .flatten()
        {
            at = at.min(candidate);
        }
        at.max(self.now_ms)
    }

    /// When the next dispatch pass is due, ignoring the deleter and the janitor (a shell that
    /// runs those in their own tasks sleeps its dispatch loop until this).
    pub fn next_pass_ms(&self) -> u64 {
        let now_ms = self.now_ms;
        if self.wake || self.productive {
            return now_ms;
        }
        let bucket_ms = self.delivery.time_bucket_ms.max(1);
        let mut at = now_ms.saturating_add(self.delivery.dispatch_poll_interval_ms);
        if self.paused {
            // Nothing is due until deletes catch up, and the delete that brings the backlog under
            // its bound sets `wake`: waking for due timers or buckets now would only spin.
            return at;
        }
        for (name, topic) in &self.topics {
            let served = self
                .hub
                .topics
                .get(name)
                .is_some_and(|m| m.live_consumers > 0);
            if let (true, false, Some(due)) = (served, topic.blocked, topic.next_due_bucket) {
                // A pass cannot read at or past a publish still being written, and that write
                // wakes the dispatcher when it lands (`on_publish_applied`): waking for it now
                // would only spin on empty passes.
                if self
                    .unapplied
                    .lowest_due(topic.hash)
                    .is_some_and(|low| due >= low)
                {
                    continue;
                }
                // Bucket `due` is scanned once (now + 1) / bucket_ms > due.
                at = at.min(
                    due.saturating_add(1)
                        .saturating_mul(bucket_ms)
                        .saturating_sub(1),
                );
            }
        }
        if let Some(candidate) = self.inflight.next_timer_ms() {
            at = at.min(candidate);
        }
        at.max(now_ms)
    }

    // ---- deleter -------------------------------------------------------------------------

    /// Takes a due delete batch if fewer than `deleteBatchesInFlight` are out; call again until
    /// `None` to fill every slot.
    pub fn take_delete_batch(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        let now_ms = self.tick(now_ms);
        self.deleter.take_batch(now_ms)
    }

    /// When the next delete batch is due, if keys wait and a batch slot is free.
    pub fn next_delete_ms(&self) -> Option<u64> {
        self.deleter.next_flush_ms()
    }

    /// Whether the last pass found the delete backlog at its bound (dispatch is paused).
    pub fn dispatch_paused(&self) -> bool {
        self.paused
    }

    /// Takes a delete batch at once, due or not (shutdown).
    pub fn take_delete_batch_now(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        let now_ms = self.tick(now_ms);
        self.deleter.take_batch_now(now_ms)
    }

    /// Whether deletes wait or one is being written.
    pub fn deletes_busy(&self) -> bool {
        self.deleter.is_busy()
    }

    /// The batch is applied: in-flight entries of its keys are removed. Returns `true` when
    /// dispatch was paused on the delete backlog and may resume now (the shell kicks its
    /// dispatcher; `wake` is set for a shell that polls `next_pass_ms`).
    pub fn on_delete_applied(&mut self, batch: &DeleteBatch) -> bool {
        self.deleter.on_applied(batch);
        for key in &batch.keys {
            if let Some(entry) = self.inflight.remove(key) {
                if entry.deleting {
                    self.deleting_entries -= 1;
                }
                for copy in &entry.copies {
                    if let CopyState::Held { consumer, .. } = copy.state {
                        if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                            c.held.remove(key);
                        }
                    }
                }
            }
        }
        let resumed = self.paused && !self.deleter.is_over_backlog();
        if resumed {
            self.wake = true;
        }
        resumed
    }

    pub fn on_delete_failed(&mut self, batch: DeleteBatch) {
        self.deleter.on_failed(batch);
    }

    // ---- janitor -------------------------------------------------------------------------

    pub fn begin_sweep(&mut self, now_ms: u64) -> Option<SweepPage> {
        let now_ms = self.tick(now_ms);
        self.janitor.begin(now_ms)
    }

    /// Reads one sweep page, routes expired messages to the deleter, returns the next page.
    pub fn on_sweep_page(&mut self, now_ms: u64, rows: &[(Key, Value)]) -> Option<SweepPage> {
        let now_ms = self.tick(now_ms);
        let (expired, next) = self.janitor.on_page(rows, now_ms);
        for key in expired {
            if self.deleter.contains(&key) {
                continue;
            }
            self.counters.expired_janitor_total += 1;
            self.expire(key);
        }
        next
    }

    /// A sweep could not read the store; the next one starts after a full interval.
    pub fn abort_sweep(&mut self, now_ms: u64) {
        let now_ms = self.tick(now_ms);
        self.janitor.abort(now_ms);
    }

    // ---- figures -------------------------------------------------------------------------

    pub fn stats(&self) -> ShardStats {
        assert!(
            self.deleting_entries <= self.inflight.len(),
            "{} entries counted as deleting, {} in the table",
            self.deleting_entries,
            self.inflight.len()
        );
        ShardStats {
            counters: self.counters.clone(),
            in_flight: self.inflight.len() - self.deleting_entries,
            active_consumers: self.hub.consumers.len(),
            delete_batches_total: self.deleter.batches_total,
            deleted_keys_total: self.deleter.keys_total,
            delete_failures_total: self.deleter.failures_total,
            delete_queued: self.deleter.queued(),
            delete_backlog: self.deleter.backlog(),
            pending_copies: self.hub.recipients.values().map(|r| r.pending.len()).sum(),
        }
    }

    /// A consumer's UUID, topic and current queue length (for the shell and for tests).
    pub fn consumer_info(&self, consumer: ConsumerId) -> Option<(uuid::Uuid, &str, usize, usize)> {
        self.hub
            .consumers
            .get(&consumer)
            .map(|c| (c.uuid, c.topic.as_ref(), c.queue.len(), c.held.len()))
    }

    pub fn consumer_count(&self) -> usize {
        self.hub.consumers.len()
    }

    /// Number of timers in the heap, live or stale (for benchmarks and memory accounting).
    pub fn timers_len(&self) -> usize {
        self.inflight.timers_len()
    }

    /// Whether an in-flight entry for `key` still holds its value (`None`: no entry).
    #[cfg(test)]
    pub(crate) fn value_held(&self, key: &EventKey) -> Option<bool> {
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

enum PendingStatus {
    Ready,
    Expired,
    Stale,
}
