//! The deleter: collects keys to delete (ACK completions, expirations) and cuts them into
//! bounded delete batches (pure).
//!
//! A batch is due when `deleteBatchInterval` has passed since the last flush, or at once when a
//! full batch (`deleteBatchMaxKeys`) is waiting. At most one batch is out at a time; a failed batch
//! goes back to the front of the queue and is counted. Keys are deduplicated: the dispatcher and
//! the janitor may both find the same expired key, and it is deleted once. In clustered mode a
//! batch is a Raft `DeleteBatch` command; standalone it is one store write.

use std::collections::VecDeque;

use ahash::AHashSet;

use crate::key::EventKey;

/// Keys to delete together, in one atomic store write (or one replicated command).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeleteBatch {
    pub keys: Vec<EventKey>,
}

pub struct Deleter {
    interval_ms: u64,
    batch_keys_max: usize,
    queue: VecDeque<EventKey>,
    known: AHashSet<EventKey>,
    in_progress: bool,
    last_flush_ms: u64,
    pub failures_total: u64,
    pub batches_total: u64,
    pub keys_total: u64,
}

impl Deleter {
    pub fn new(interval_ms: u64, batch_keys_max: usize, now_ms: u64) -> Deleter {
        Deleter {
            interval_ms: interval_ms.max(1),
            batch_keys_max: batch_keys_max.max(1),
            queue: VecDeque::new(),
            known: AHashSet::new(),
            in_progress: false,
            last_flush_ms: now_ms,
            failures_total: 0,
            batches_total: 0,
            keys_total: 0,
        }
    }

    /// Queues a key for deletion; a key already queued or being flushed is not queued twice.
    pub fn mark(&mut self, key: EventKey) -> bool {
        if self.known.insert(key) {
            self.queue.push_back(key);
            true
        } else {
            false
        }
    }

    pub fn contains(&self, key: &EventKey) -> bool {
        self.known.contains(key)
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// When the next batch is due, if any key waits and no batch is out.
    pub fn next_flush_ms(&self) -> Option<u64> {
        if self.in_progress || self.queue.is_empty() {
            return None;
        }
        if self.queue.len() >= self.batch_keys_max {
            return Some(self.last_flush_ms);
        }
        Some(self.last_flush_ms.saturating_add(self.interval_ms))
    }

    /// Takes the next batch (at most `deleteBatchMaxKeys` keys) if one is due at `now_ms`.
    pub fn take_batch(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        if self.next_flush_ms()? > now_ms {
            return None;
        }
        Some(self.cut(now_ms))
    }

    fn cut(&mut self, now_ms: u64) -> DeleteBatch {
        let n = self.queue.len().min(self.batch_keys_max);
        let keys: Vec<EventKey> = self.queue.drain(..n).collect();
        self.in_progress = true;
        self.last_flush_ms = now_ms;
        DeleteBatch { keys }
    }

    /// Takes the next batch whatever the interval (shutdown drains the queue this way), if any
    /// key waits and no batch is out.
    pub fn take_batch_now(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        self.next_flush_ms()?;
        Some(self.cut(now_ms))
    }

    /// Whether keys wait or a batch is out: a shutdown must not close the store before this is
    /// false.
    pub fn is_busy(&self) -> bool {
        self.in_progress || !self.queue.is_empty()
    }

    /// The batch is applied: its keys are forgotten here. The caller clears in-flight entries.
    pub fn on_applied(&mut self, batch: &DeleteBatch) {
        for key in &batch.keys {
            self.known.remove(key);
        }
        self.in_progress = false;
        self.batches_total += 1;
        self.keys_total += batch.keys.len() as u64;
    }

    /// The batch failed: its keys go back to the front, to be retried on the next flush.
    pub fn on_failed(&mut self, batch: DeleteBatch) {
        for key in batch.keys.into_iter().rev() {
            self.queue.push_front(key);
        }
        self.in_progress = false;
        self.failures_total += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TopicHash;

    fn key(i: u64) -> EventKey {
        EventKey::new(TopicHash(1), 0, i)
    }

    #[test]
    fn shutdown_takes_waiting_keys_before_the_interval_one_batch_at_a_time() {
        let mut deleter = Deleter::new(500, 2, 0);
        for i in 0..3 {
            deleter.mark(key(i));
        }
        let first = deleter.take_batch_now(1).unwrap();
        assert_eq!(first.keys.len(), 2);
        assert!(deleter.is_busy());
        assert_eq!(deleter.take_batch_now(1), None, "one batch out at a time");
        deleter.on_applied(&first);
        assert_eq!(deleter.take_batch_now(2).unwrap().keys, vec![key(2)]);
        assert_eq!(deleter.take_batch_now(2), None);
    }

    #[test]
    fn deleter_flushes_on_the_interval() {
        let mut deleter = Deleter::new(500, 1024, 0);
        deleter.mark(key(1));
        assert_eq!(deleter.take_batch(499), None);
        assert_eq!(deleter.next_flush_ms(), Some(500));
        let batch = deleter.take_batch(500).unwrap();
        assert_eq!(batch.keys, vec![key(1)]);
        deleter.on_applied(&batch);
        assert_eq!(deleter.next_flush_ms(), None);
    }

    #[test]
    fn full_batch_flushes_at_once_and_at_most_the_cap() {
        let mut deleter = Deleter::new(500, 4, 0);
        for i in 0..10 {
            deleter.mark(key(i));
        }
        let first = deleter.take_batch(1).unwrap();
        assert_eq!(first.keys.len(), 4);
        assert_eq!(deleter.take_batch(1), None, "one batch out at a time");
        deleter.on_applied(&first);
        let second = deleter.take_batch(1).unwrap();
        assert_eq!(second.keys, (4..8).map(key).collect::<Vec<_>>());
        deleter.on_applied(&second);
        // Two left: below the cap, so they wait for the interval from the last flush.
        assert_eq!(deleter.take_batch(2), None);
        assert_eq!(deleter.take_batch(501).unwrap().keys.len(), 2);
    }

    #[test]
    fn failed_flush_is_requeued_first_and_counted() {
        let mut deleter = Deleter::new(10, 2, 0);
        for i in 0..3 {
            deleter.mark(key(i));
        }
        let batch = deleter.take_batch(0).unwrap();
        deleter.on_failed(batch.clone());
        assert_eq!(deleter.failures_total, 1);
        assert_eq!(deleter.take_batch(0).unwrap(), batch);
    }

    #[test]
    fn a_key_is_deleted_once_however_often_it_is_marked() {
        let mut deleter = Deleter::new(10, 8, 0);
        assert!(deleter.mark(key(1)));
        assert!(!deleter.mark(key(1)));
        let batch = deleter.take_batch(10).unwrap();
        assert!(
            !deleter.mark(key(1)),
            "a key being flushed is not queued again"
        );
        deleter.on_applied(&batch);
        assert_eq!(batch.keys, vec![key(1)]);
        assert_eq!(deleter.queued(), 0);
    }
}
