//! Publish: a batch the edge validated and archived ([`ValidatedBatch`]) gets its keys (due
//! bucket, event id) and its enqueue time, and becomes a [`StoreBatch`] command; once applied,
//! the dispatcher of each served topic is told. Nothing here validates a message again or
//! copies a payload: the archives are stamped in place and shared.
//!
//! Idempotent publish is decided here, in log order: a message whose (producer id, sequence)
//! the [`DedupTable`](crate::pipeline::dedup::DedupTable) remembers is not stored again and is
//! answered with the original tag; a new pair is remembered at once (pending until applied), so
//! a concurrent publish of the same pair finds it. The decision travels in the command (the
//! duplicates are simply not in it, the new pairs are), so every replica applies the same state.

use std::sync::Arc;

use super::ShardCore;
use crate::batch::ValidatedBatch;
use crate::key::{due_bucket, due_bucket_bound, EventKey, TopicHash};
use crate::log::sequences::SequenceEntry;
use crate::log::Command;
use crate::message::CheckedValue;
use crate::pipeline::dedup::Originals;

/// Forgotten sequence entries one store command deletes at least (plus one per pair it
/// remembers, so deletions always outpace what the bounds can forget).
const FORGET_PER_COMMAND_MIN: usize = 1024;

/// The replicable command of a publish: keys assigned, values stamped.
#[derive(Clone, Debug)]
pub struct StoreBatch {
    pub id: u64,
    /// The archives built at the edge, stamped on this shard (same allocations). Duplicates
    /// are not here.
    pub messages: Vec<(EventKey, CheckedValue)>,
    /// The highest event id assigned so far, persisted with the batch so ids survive restarts.
    pub event_id_high_water: u64,
    /// The tag answered for each message of the request part, in order: its own key, or for a
    /// duplicate the original's.
    pub answers: Vec<EventKey>,
    /// (producer, sequence) pairs this batch stores.
    pub remember: Vec<SequenceEntry>,
    /// Event ids of sequence entries whose window ended, deleted by the same command.
    pub forget: Vec<u64>,
    /// Duplicates whose original's batch was not yet applied when this one was prepared:
    /// (producer, sequence, original tag). The answer waits for them.
    pub waits: Vec<(Arc<str>, u64, EventKey)>,
    /// Messages answered with an original tag.
    pub duplicates: usize,
}

impl StoreBatch {
    /// The command that stores this batch (values are shared, not copied).
    pub fn command(&self) -> Command {
        let messages = self
            .messages
            .iter()
            .map(|(key, value)| (*key, value.value().clone()))
            .collect();
        if self.remember.is_empty() && self.forget.is_empty() {
            return Command::Store {
                messages,
                event_id_high_water: self.event_id_high_water,
            };
        }
        Command::StoreSequenced {
            messages,
            event_id_high_water: self.event_id_high_water,
            remember: self.remember.clone(),
            forget: self.forget.clone(),
        }
    }

    /// Every message was a duplicate and nothing is to be forgotten: there is nothing to write.
    pub fn writes_nothing(&self) -> bool {
        self.duplicates > 0
            && self.messages.is_empty()
            && self.remember.is_empty()
            && self.forget.is_empty()
    }

    pub fn tags(&self) -> Vec<EventKey> {
        self.answers.clone()
    }
}

impl ShardCore {
    /// Assigns a validated batch its keys and enqueue time, and answers duplicates. The batch
    /// was checked whole at the edge, against the same `[publish]` config this core has, so
    /// nothing here can refuse it.
    pub fn prepare_publish(&mut self, now_ms: u64, batch: ValidatedBatch) -> StoreBatch {
        let now_ms = self.tick(now_ms);
        self.dedup.expire(now_ms);
        let id = self.next_batch_id;
        self.next_batch_id += 1;
        let mut out = Vec::with_capacity(batch.len());
        let mut answers = Vec::with_capacity(batch.len());
        let mut remember = Vec::new();
        let mut waits = Vec::new();
        let mut duplicates = 0;
        let mut lowest_due: Vec<(TopicHash, u64)> = Vec::new();
        for m in batch.into_messages() {
            if let Some((producer, sequence)) = &m.producer {
                if let Some(original) = self.dedup.lookup(producer, *sequence) {
                    duplicates += 1;
                    answers.push(original.tag);
                    if original.pending_batch.is_some_and(|b| b != id) {
                        waits.push((producer.clone(), *sequence, original.tag));
                    }
                    continue;
                }
            }
            let hash = m.topic_hash;
            let due = due_bucket(now_ms, m.delay_ms, self.delivery.time_bucket_ms);
            match lowest_due.iter_mut().find(|(t, _)| *t == hash) {
                Some((_, low)) => *low = (*low).min(due),
                None => lowest_due.push((hash, due)),
            }
            let key = EventKey::new(hash, due, self.next_event_id);
            self.next_event_id += 1;
            if let Some((producer, sequence)) = m.producer {
                self.dedup
                    .remember(&producer, sequence, key, now_ms, Some(id));
                remember.push(SequenceEntry {
                    producer,
                    sequence,
                    tag: key,
                    stored_at_ms: now_ms,
                });
            }
            answers.push(key);
            out.push((key, m.value.stamp(now_ms)));
        }
        let forget = self
            .dedup
            .take_forgotten(FORGET_PER_COMMAND_MIN + remember.len());
        self.unapplied.insert(id, lowest_due);
        StoreBatch {
            id,
            messages: out,
            event_id_high_water: self.next_event_id - 1,
            answers,
            remember,
            forget,
            waits,
            duplicates,
        }
    }

    /// The batch is in the store: wake the dispatcher for served topics it touched.
    pub fn on_publish_applied(&mut self, batch: &StoreBatch) {
        self.unapplied.remove(batch.id);
        self.dedup.settle(&batch.remember, batch.id);
        self.settled.notify();
        self.counters.published_total += batch.messages.len() as u64;
        self.counters.publish_duplicates_total += batch.duplicates as u64;
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

    /// The batch was not stored; its keys are abandoned, its pairs forgotten (a republish
    /// stores them) and its deletions queued again.
    pub fn on_publish_failed(&mut self, batch: &StoreBatch) {
        self.unapplied.remove(batch.id);
        self.dedup.abandon(&batch.remember, batch.id, &batch.forget);
        self.settled.notify();
    }

    /// Where the originals a batch answered with stand (see [`StoreBatch::waits`]).
    pub fn originals(&self, batch: &StoreBatch) -> Originals {
        self.dedup.originals(&batch.waits)
    }

    /// The signal [`ShardCore::on_publish_applied`] and [`ShardCore::on_publish_failed`]
    /// notify.
    pub(crate) fn settled_signal(&self) -> std::rc::Rc<crate::storage::signal::Signal> {
        self.settled.clone()
    }

    /// The idempotent-publish table (figures and tests).
    pub fn dedup_table(&self) -> &crate::pipeline::dedup::DedupTable {
        &self.dedup
    }

    /// Loads the sequence entries read back from the store (at start, or when a replica starts
    /// to lead); ones whose window ended are deleted with the next store command.
    pub fn recover_sequences(&mut self, now_ms: u64, entries: &[SequenceEntry]) {
        let now_ms = self.tick(now_ms);
        for entry in entries {
            self.dedup.load(entry, now_ms);
        }
    }
}
