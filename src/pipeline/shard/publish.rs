//! Publish: a batch the edge validated and archived ([`ValidatedBatch`]) gets its keys (due
//! bucket, event id) and its enqueue time, and becomes a [`StoreBatch`] command; once applied,
//! the dispatcher of each served topic is told. Nothing here validates a message again or
//! copies a payload: the archives are stamped in place and shared.

use super::ShardCore;
use crate::batch::ValidatedBatch;
use crate::key::{due_bucket, due_bucket_bound, EventKey, TopicHash};
use crate::log::Command;
use crate::message::CheckedValue;

/// The replicable command of a publish: keys assigned, values stamped.
#[derive(Clone, Debug)]
pub struct StoreBatch {
    pub id: u64,
    /// The archives built at the edge, stamped on this shard (same allocations).
    pub messages: Vec<(EventKey, CheckedValue)>,
    /// The highest event id assigned so far, persisted with the batch so ids survive restarts.
    pub event_id_high_water: u64,
}

impl StoreBatch {
    /// The command that stores this batch (values are shared, not copied).
    pub fn command(&self) -> Command {
        Command::Store {
            messages: self
                .messages
                .iter()
                .map(|(key, value)| (*key, value.value().clone()))
                .collect(),
            event_id_high_water: self.event_id_high_water,
        }
    }

    pub fn tags(&self) -> Vec<EventKey> {
        self.messages.iter().map(|(key, _)| *key).collect()
    }
}

impl ShardCore {
    /// Assigns a validated batch its keys and enqueue time. The batch was checked whole at the
    /// edge, against the same `[publish]` config this core has, so nothing here can refuse it.
    pub fn prepare_publish(&mut self, now_ms: u64, batch: ValidatedBatch) -> StoreBatch {
        let now_ms = self.tick(now_ms);
        let first_id = self.next_event_id;
        let count = batch.len() as u64;
        let mut out = Vec::with_capacity(batch.len());
        let mut lowest_due: Vec<(TopicHash, u64)> = Vec::new();
        for (id, m) in (first_id..).zip(batch.into_messages()) {
            let hash = m.topic_hash;
            let due = due_bucket(now_ms, m.delay_ms, self.delivery.time_bucket_ms);
            match lowest_due.iter_mut().find(|(t, _)| *t == hash) {
                Some((_, low)) => *low = (*low).min(due),
                None => lowest_due.push((hash, due)),
            }
            out.push((EventKey::new(hash, due, id), m.value.stamp(now_ms)));
        }
        self.next_event_id += count;
        let id = self.next_batch_id;
        self.next_batch_id += 1;
        self.unapplied.insert(id, lowest_due);
        StoreBatch {
            id,
            messages: out,
            event_id_high_water: self.next_event_id - 1,
        }
    }

    /// The batch is in the store: wake the dispatcher for served topics it touched.
    pub fn on_publish_applied(&mut self, batch: &StoreBatch) {
        self.unapplied.remove(batch.id);
        self.counters.published_total += batch.messages.len() as u64;
        let bound = due_bucket_bound(self.now_ms, self.delivery.time_bucket_ms);
        for (key, value) in &batch.messages {
            self.stock
                .on_stored(key, value.message().topic.as_str(), bound);
            if let Some(topic) = self.topics.get_mut(value.message().topic.as_str()) {
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
