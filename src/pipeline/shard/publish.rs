//! Publish: a validated batch gets its keys (due bucket, event id) and its enqueue time, and
//! becomes a [`StoreBatch`] command; once applied, the dispatcher of each served topic is told.

use super::ShardCore;
use crate::config::AckLevel;
use crate::key::{self, due_bucket, due_bucket_bound, EventKey, KeyError, TopicHash};
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

impl ShardCore {
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
}
