//! Consumers: subscribe, unsubscribe, forget a group, drain a consumer's queue, and settle its
//! tags (ACK, NACK, touch) against the in-flight table.

use std::rc::Rc;
use std::sync::Arc;

use smallvec::SmallVec;

use super::transitions::ExpiredBy;
use super::{Release, ShardCore};
use crate::config::AckLevel;
use crate::key::{self, EventKey, KeyError, TopicHash};
use crate::message::CheckedValue;
use crate::pipeline::copies::Commit;
use crate::pipeline::dispatcher::TopicDispatch;
use crate::pipeline::hub::{ConsumerId, Limit, Queued, RecipientId};
use crate::pipeline::inflight::{CopyState, RECEIPT_PENDING};

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
    /// The tag is not a 24-byte event key (answered at the edge, which parses tags: the core
    /// only ever sees [`EventKey`]s).
    Malformed,
}

/// The answer of an ACK or NACK: a result per tag and, at `durable`, the commit to wait for
/// before answering (`None`, or already done, when nothing needs to reach the log).
pub struct Settled {
    pub results: Vec<TagResult>,
    pub commit: Option<Rc<Commit>>,
}

/// A copy handed to a consumer.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub key: EventKey,
    /// Checked once, when the dispatcher read it from the store.
    pub value: CheckedValue,
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
    /// The subscription would pass a bound of `[delivery]`; nothing was registered.
    #[error("{0}")]
    Limit(#[from] Limit),
}

impl ShardCore {
    /// Registers a consumer of `topic` in `group` (empty = universal) and wakes the dispatcher.
    /// Refused with [`ConsumerError::Limit`] past a bound on groups or consumers.
    pub fn subscribe(
        &mut self,
        now_ms: u64,
        topic: &str,
        group: &str,
        uuid: uuid::Uuid,
    ) -> Result<ConsumerId, ConsumerError> {
        self.subscribe_window(now_ms, topic, group, uuid, 0)
    }

    /// [`ShardCore::subscribe`] with the consumer's `queueSize` (0: the default): the bound of
    /// deliveries queued for it plus those sent and not yet returned ([`ShardCore::returned`]).
    pub fn subscribe_window(
        &mut self,
        now_ms: u64,
        topic: &str,
        group: &str,
        uuid: uuid::Uuid,
        queue_size: usize,
    ) -> Result<ConsumerId, ConsumerError> {
        key::validate_topic(topic)?;
        self.tick(now_ms);
        let registered = self.hub.register_window(topic, group, uuid, queue_size)?;
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
                self.release(key, recipient, Release::Disconnect, 0);
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

    pub(super) fn forget_group_id(&mut self, recipient: RecipientId) -> Option<()> {
        let removed = self.hub.remove_group(recipient)?;
        self.counters.groups_forgotten_total += 1;
        for key in removed.pending {
            self.forget_copy(key, recipient);
        }
        self.drop_topic_if_gone(&removed.topic);
        Some(())
    }

    pub(super) fn drop_topic_if_gone(&mut self, topic: &str) {
        if !self.hub.topics.contains_key(topic) {
            self.topics.remove(topic);
        }
    }

    /// Consumers with new deliveries queued since the last call.
    pub fn take_ready(&mut self) -> Vec<ConsumerId> {
        self.ready.drain().collect()
    }

    /// The `queueSize` in force for a consumer asking for `requested`, and the unacknowledged
    /// copies it may hold (the subscribe answer).
    pub fn consumer_bounds(&self, requested: usize) -> (usize, usize) {
        (self.hub.window_for(requested), self.hub.unacked_max())
    }

    /// The client returned the deliveries `keys` of `consumer` (its `deliver` call returned):
    /// their window goes back, and the lease of each copy it still holds starts now (a copy
    /// whose receipt is pending is never handed to anyone else: see [`CopyState::Held`]).
    /// Returns whether a dispatch pass should run: the consumer was full, so copies may wait
    /// for it.
    pub fn returned(&mut self, now_ms: u64, consumer: ConsumerId, keys: &[EventKey]) -> bool {
        let now_ms = self.tick(now_ms);
        let was_full = self.hub.note_returned(consumer, keys.len());
        if was_full {
            self.wake = true;
        }
        let Some(recipient) = self.hub.consumers.get(&consumer).map(|c| c.recipient) else {
            return was_full;
        };
        let leased = CopyState::Held {
            consumer,
            deadline_ms: now_ms.saturating_add(self.delivery.in_flight_timeout_ms),
        };
        for key in keys {
            let pending = CopyState::Held {
                consumer,
                deadline_ms: RECEIPT_PENDING,
            };
            if self.inflight.state(key, recipient) == Some(pending) {
                self.inflight.set_state(*key, recipient, leased, false);
            }
        }
        was_full
    }

    /// Takes up to `max` deliveries from a consumer's queue; they count against its window until
    /// [`ShardCore::returned`]. Copies that changed hands since they were queued are dropped;
    /// expired messages are never handed out.
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
            let current = matches!(copy.state(), CopyState::Held { consumer: h, .. } if h == consumer)
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
        self.hub.note_sent(consumer, out.len());
        for key in expired {
            self.expire(key, ExpiredBy::Dispatcher);
        }
        self.wake_if_blocked(&topic);
        out
    }

    pub(super) fn wake_if_blocked(&mut self, topic: &str) {
        if self.topics.get(topic).is_some_and(|t| t.blocked) {
            self.wake = true;
        }
    }

    /// Acknowledges copies held by `consumer`, answered at once (`leader`). A message is
    /// deleted once all its recipients ACKed.
    pub fn ack(
        &mut self,
        now_ms: u64,
        consumer: ConsumerId,
        tags: &[EventKey],
    ) -> Result<Vec<TagResult>, ConsumerError> {
        Ok(self
            .ack_at(now_ms, consumer, tags, AckLevel::Leader)?
            .results)
    }

    /// [`Self::ack`] at `level`: at `durable` the answer carries the [`Commit`] to wait for
    /// (the deletes, or the records of the group's ACK: `records` module docs).
    pub fn ack_at(
        &mut self,
        now_ms: u64,
        consumer: ConsumerId,
        tags: &[EventKey],
        level: AckLevel,
    ) -> Result<Settled, ConsumerError> {
        self.tick(now_ms);
        let commit = Self::commit_for(level);
        let results = self.settle(consumer, tags, |core, key, recipient| {
            core.counters.acked_total += 1;
            core.hub.count(recipient, |c| c.acked += 1);
            core.inflight
                .set_state(key, recipient, CopyState::Acked, false);
            core.complete_if_done(key);
            if let Some(commit) = &commit {
                core.ack_commit(key, recipient, commit);
            }
        })?;
        Ok(Settled { results, commit })
    }

    /// Releases copies held by `consumer` for redelivery (answered at once, `leader`).
    pub fn nack(
        &mut self,
        now_ms: u64,
        consumer: ConsumerId,
        tags: &[EventKey],
        delay_ms: u64,
    ) -> Result<Vec<TagResult>, ConsumerError> {
        Ok(self
            .nack_at(now_ms, consumer, tags, delay_ms, AckLevel::Leader)?
            .results)
    }

    /// Releases copies held by `consumer` for redelivery: after `delay_ms` if not 0, else after
    /// the group's backoff (at once without one); a copy out of deliveries is dead-lettered. At
    /// `durable` the answer carries the [`Commit`] of the copies' delivery records.
    pub fn nack_at(
        &mut self,
        now_ms: u64,
        consumer: ConsumerId,
        tags: &[EventKey],
        delay_ms: u64,
        level: AckLevel,
    ) -> Result<Settled, ConsumerError> {
        self.tick(now_ms);
        let commit = Self::commit_for(level);
        let results = self.settle(consumer, tags, |core, key, recipient| {
            core.counters.nacked_total += 1;
            core.hub.count(recipient, |c| c.nacked += 1);
            core.counters.redeliveries_nack_total += 1;
            let again = core.release(key, recipient, Release::Nack, delay_ms);
            if let (true, Some(commit)) = (again, &commit) {
                // A dead-lettered copy needs no record: the shell stores its dead letter.
                core.nack_commit(key, recipient, commit);
            }
        })?;
        Ok(Settled { results, commit })
    }

    /// Extends the lease of copies held by `consumer` by a full `inFlightTimeout` from now.
    pub fn touch(
        &mut self,
        now_ms: u64,
        consumer: ConsumerId,
        tags: &[EventKey],
    ) -> Result<Vec<TagResult>, ConsumerError> {
        let now_ms = self.tick(now_ms);
        let deadline_ms = now_ms.saturating_add(self.delivery.in_flight_timeout_ms);
        let mut results = Vec::with_capacity(tags.len());
        for tag in tags {
            let result = match self.holder_check(consumer, *tag)? {
                Ok((key, recipient)) => {
                    let held = CopyState::Held {
                        consumer,
                        deadline_ms,
                    };
                    self.inflight.set_state(key, recipient, held, false);
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
    pub(super) fn settle(
        &mut self,
        consumer: ConsumerId,
        tags: &[EventKey],
        mut settled: impl FnMut(&mut ShardCore, EventKey, RecipientId),
    ) -> Result<Vec<TagResult>, ConsumerError> {
        let mut results = Vec::with_capacity(tags.len());
        for tag in tags {
            let result = match self.holder_check(consumer, *tag)? {
                Ok((key, recipient)) => {
                    if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                        c.held.remove(&key);
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

    /// Whether `consumer` holds the copy named by `key`: `Ok((key, recipient))`, or the refusal.
    /// Tags are parsed once, at the edge: one that is not an event key never gets here, and the
    /// edge answers it [`TagResult::Malformed`] itself.
    pub(super) fn holder_check(
        &self,
        consumer: ConsumerId,
        key: EventKey,
    ) -> Result<Result<(EventKey, RecipientId), TagResult>, ConsumerError> {
        let recipient = self
            .hub
            .consumers
            .get(&consumer)
            .ok_or(ConsumerError::UnknownConsumer)?
            .recipient;
        let Some(entry) = self.inflight.entries.get(&key) else {
            return Ok(Err(TagResult::UnknownTag));
        };
        let Some(copy) = entry.copies.iter().find(|c| c.recipient == recipient) else {
            return Ok(Err(TagResult::NotHolder));
        };
        Ok(match copy.state() {
            CopyState::Held {
                consumer: holder, ..
            } if holder == consumer => Ok((key, recipient)),
            CopyState::Acked => Err(TagResult::AlreadyAcked),
            _ => Err(TagResult::NotHolder),
        })
    }
}
