//! The deleter: collects keys to delete (ACK completions, expirations), cuts them into bounded
//! delete batches, and reports the backlog that dispatch pauses on (pure).
//!
//! A batch takes everything waiting, up to `deleteBatchMaxKeys`. It is due at once when a batch
//! slot is free and at least [`EAGER_KEYS`] keys wait (under load deletes go out as fast as the
//! log commits them, each carrying what piled up during the previous commit: group commit for
//! deletes), else once `deleteBatchInterval` has passed since the last cut (at low rates a few
//! ACKs share one write instead of paying an fdatasync each). Up to `deleteBatchesInFlight`
//! batches may be out at once: durable deletes are fdatasync-bound, and several writes out
//! together share one group commit of the WAL. With one 1,024-key batch out, deletes fell behind
//! 4,096 publishes per fsync cycle without bound; with a fixed trigger at the cap, a slow commit
//! (`leader` publishes filling the log) capped deletes at slots × cap per commit.
//!
//! The *backlog* is every key not yet deleted: queued, or in a batch not yet applied. At
//! `deleteBacklogMaxKeys` the shard stops dispatching (`ShardCore::plan_pass`), so ACKed
//! messages cannot pile up in memory faster than they are deleted; the deleter itself never
//! refuses a key (an ACK must not fail because deletes are slow).
//!
//! A failed batch goes back to the front of the queue and is counted; the next cut then waits for
//! the interval even if a full batch is waiting, so a failing store is retried once an interval,
//! not in a loop. Keys are deduplicated: the
//! dispatcher and the janitor may both find the same expired key, and it is deleted once. In
//! clustered mode a batch is a Raft `DeleteBatch` command; standalone it is one store write.

use std::collections::VecDeque;

use ahash::AHashSet;

use super::memory::give_back;
use crate::key::EventKey;

/// Keys waiting at which a batch is cut at once when a slot is free (rather than on the
/// interval). Small enough that the backlog under load stays a few thousand keys, large enough
/// that a trickle of ACKs is still batched by the interval.
pub const EAGER_KEYS: usize = 1024;

/// Keys to delete together, in one atomic store write (or one replicated command).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeleteBatch {
    pub keys: Vec<EventKey>,
    /// Copy records of these messages, deleted with them (filled in by the shard core).
    pub dropped: Vec<crate::log::copies::CopyId>,
}

/// The deleter's bounds (from `DeliveryConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeleterLimits {
    /// `deleteBatchInterval`: the longest a partial batch waits after the last cut.
    pub interval_ms: u64,
    /// `deleteBatchMaxKeys`.
    pub batch_keys_max: usize,
    /// `deleteBatchesInFlight`: batches cut and not yet applied or failed.
    pub batches_in_flight_max: usize,
    /// `deleteBacklogMaxKeys`: at or over this many keys waiting, dispatch pauses.
    pub backlog_keys_max: usize,
}

pub struct Deleter {
    limits: DeleterLimits,
    queue: VecDeque<EventKey>,
    /// Every key queued or in a batch out: the deduplication set.
    known: AHashSet<EventKey>,
    batches_out: usize,
    keys_out: usize,
    last_cut_ms: u64,
    /// A batch failed since the last cut: the next one waits for the interval.
    backing_off: bool,
    /// A call waits for a queued key's delete (a `durable` ACK): the next batch is due at once.
    hurried: bool,
    pub failures_total: u64,
    pub batches_total: u64,
    pub keys_total: u64,
}

impl Deleter {
    pub fn new(limits: DeleterLimits, now_ms: u64) -> Deleter {
        Deleter {
            limits: DeleterLimits {
                interval_ms: limits.interval_ms.max(1),
                batch_keys_max: limits.batch_keys_max.max(1),
                batches_in_flight_max: limits.batches_in_flight_max.max(1),
                backlog_keys_max: limits.backlog_keys_max.max(1),
            },
            queue: VecDeque::new(),
            known: AHashSet::new(),
            batches_out: 0,
            keys_out: 0,
            last_cut_ms: now_ms,
            backing_off: false,
            hurried: false,
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

    /// A call waits for a queued delete: cut the next batch as soon as a slot is free, without
    /// waiting for the interval (a failing store still backs off).
    pub fn hurry(&mut self) {
        self.hurried = true;
    }

    pub fn contains(&self, key: &EventKey) -> bool {
        self.known.contains(key)
    }

    /// Keys waiting for the next batch.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Batches cut and not yet applied or failed.
    pub fn batches_out(&self) -> usize {
        self.batches_out
    }

    /// Keys not yet deleted: queued, or in a batch not yet applied.
    pub fn backlog(&self) -> usize {
        debug_assert_eq!(self.known.len(), self.queue.len() + self.keys_out);
        self.queue.len() + self.keys_out
    }

    /// Whether the backlog is at or over `deleteBacklogMaxKeys`: dispatch must pause.
    pub fn is_over_backlog(&self) -> bool {
        self.backlog() >= self.limits.backlog_keys_max
    }

    /// When the next batch is due, if any key waits and a batch slot is free.
    pub fn next_flush_ms(&self) -> Option<u64> {
        if self.batches_out >= self.limits.batches_in_flight_max || self.queue.is_empty() {
            return None;
        }
        let eager = EAGER_KEYS.min(self.limits.batch_keys_max);
        if (self.queue.len() >= eager || self.hurried) && !self.backing_off {
            return Some(self.last_cut_ms);
        }
        Some(self.last_cut_ms.saturating_add(self.limits.interval_ms))
    }

    /// Takes the next batch (at most `deleteBatchMaxKeys` keys) if one is due at `now_ms` and
    /// fewer than `deleteBatchesInFlight` are out. Call again until `None` to fill every slot.
    pub fn take_batch(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        if self.next_flush_ms()? > now_ms {
            return None;
        }
        Some(self.cut(now_ms))
    }

    /// Takes the next batch whatever the interval (shutdown drains the queue this way), if any
    /// key waits and a batch slot is free.
    pub fn take_batch_now(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        self.next_flush_ms()?;
        Some(self.cut(now_ms))
    }

    fn cut(&mut self, now_ms: u64) -> DeleteBatch {
        let n = self.queue.len().min(self.limits.batch_keys_max);
        let keys: Vec<EventKey> = self.queue.drain(..n).collect();
        give_back(&mut self.queue);
        self.batches_out += 1;
        self.keys_out += keys.len();
        self.last_cut_ms = now_ms;
        self.backing_off = false;
        // Keys still queued may include hurried ones: the next cut stays due at once.
        self.hurried = self.hurried && !self.queue.is_empty();
        DeleteBatch {
            keys,
            dropped: Vec::new(),
        }
    }

    /// Whether keys wait or a batch is out: a shutdown must not close the store before this is
    /// false.
    pub fn is_busy(&self) -> bool {
        self.batches_out > 0 || !self.queue.is_empty()
    }

    /// The batch is applied: its keys are forgotten here. The caller clears in-flight entries.
    pub fn on_applied(&mut self, batch: &DeleteBatch) {
        self.release(batch);
        for key in &batch.keys {
            self.known.remove(key);
        }
        give_back(&mut self.known);
        self.batches_total += 1;
        self.keys_total += batch.keys.len() as u64;
    }

    /// The batch failed: its keys go back to the front, to be retried on the next flush.
    pub fn on_failed(&mut self, batch: DeleteBatch) {
        self.release(&batch);
        for key in batch.keys.into_iter().rev() {
            self.queue.push_front(key);
        }
        self.backing_off = true;
        self.failures_total += 1;
    }

    fn release(&mut self, batch: &DeleteBatch) {
        assert!(
            self.batches_out > 0 && self.keys_out >= batch.keys.len(),
            "a delete batch settled that was never cut ({} out, {} keys out, {} settled)",
            self.batches_out,
            self.keys_out,
            batch.keys.len()
        );
        self.batches_out -= 1;
        self.keys_out -= batch.keys.len();
    }

    /// Capacity of the queue and of the deduplication set (memory accounting, tests).
    pub fn capacities(&self) -> (usize, usize) {
        (self.queue.capacity(), self.known.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TopicHash;

    fn key(i: u64) -> EventKey {
        EventKey::new(TopicHash(1), 0, i)
    }

    fn deleter(interval_ms: u64, batch_keys_max: usize, batches_in_flight_max: usize) -> Deleter {
        Deleter::new(
            DeleterLimits {
                interval_ms,
                batch_keys_max,
                batches_in_flight_max,
                backlog_keys_max: 1 << 20,
            },
            0,
        )
    }

    #[test]
    fn shutdown_takes_waiting_keys_before_the_interval_up_to_the_batches_in_flight() {
        let mut deleter = deleter(500, 2, 1);
        for i in 0..3 {
            deleter.mark(key(i));
        }
        let first = deleter.take_batch_now(1).unwrap();
        assert_eq!(first.keys.len(), 2);
        assert!(deleter.is_busy());
        assert_eq!(deleter.take_batch_now(1), None, "the one slot is taken");
        deleter.on_applied(&first);
        assert_eq!(deleter.take_batch_now(2).unwrap().keys, vec![key(2)]);
        assert_eq!(deleter.take_batch_now(2), None);
    }

    #[test]
    fn deleter_flushes_on_the_interval() {
        let mut deleter = deleter(500, 1024, 4);
        deleter.mark(key(1));
        assert_eq!(deleter.take_batch(499), None);
        assert_eq!(deleter.next_flush_ms(), Some(500));
        let batch = deleter.take_batch(500).unwrap();
        assert_eq!(batch.keys, vec![key(1)]);
        deleter.on_applied(&batch);
        assert_eq!(deleter.next_flush_ms(), None);
    }

    #[test]
    fn full_batches_flush_at_once_at_most_the_cap_each_while_slots_are_free() {
        let mut deleter = deleter(500, 4, 2);
        for i in 0..10 {
            deleter.mark(key(i));
        }
        let first = deleter.take_batch(1).unwrap();
        assert_eq!(first.keys.len(), 4);
        let second = deleter.take_batch(1).unwrap();
        assert_eq!(second.keys, (4..8).map(key).collect::<Vec<_>>());
        assert_eq!(deleter.batches_out(), 2);
        assert_eq!(deleter.take_batch(1), None, "both slots taken");
        assert_eq!(deleter.next_flush_ms(), None, "nothing to wake for");
        deleter.on_applied(&second);
        // Two left: below the cap, so they wait for the interval from the last cut.
        assert_eq!(deleter.take_batch(2), None);
        assert_eq!(deleter.take_batch(501).unwrap().keys.len(), 2);
        deleter.on_applied(&first);
        assert_eq!(deleter.batches_total, 2);
    }

    #[test]
    fn under_load_a_batch_goes_at_once_past_the_eager_count_and_takes_everything_waiting() {
        let mut deleter = Deleter::new(
            DeleterLimits {
                interval_ms: 500,
                batch_keys_max: 65_536,
                batches_in_flight_max: 1,
                backlog_keys_max: 1 << 20,
            },
            0,
        );
        for i in 0..EAGER_KEYS as u64 - 1 {
            deleter.mark(key(i));
        }
        assert_eq!(
            deleter.take_batch(1),
            None,
            "a trickle waits for the interval"
        );
        for i in EAGER_KEYS as u64 - 1..3 * EAGER_KEYS as u64 {
            deleter.mark(key(i));
        }
        let batch = deleter.take_batch(1).expect("due at once");
        assert_eq!(
            batch.keys.len(),
            3 * EAGER_KEYS,
            "everything waiting, up to the cap"
        );
        assert_eq!(deleter.take_batch(1), None, "the one slot is taken");
    }

    #[test]
    fn several_batches_are_out_at_once_and_settle_in_any_order() {
        let mut deleter = deleter(100, 3, 4);
        for i in 0..12 {
            deleter.mark(key(i));
        }
        let batches: Vec<DeleteBatch> = std::iter::from_fn(|| deleter.take_batch(0)).collect();
        assert_eq!(batches.len(), 4, "one per slot");
        assert_eq!(deleter.queued(), 0);
        assert_eq!(deleter.backlog(), 12, "keys out still count until applied");
        deleter.on_applied(&batches[2]);
        deleter.on_failed(batches[0].clone());
        assert_eq!(deleter.backlog(), 9);
        assert_eq!(deleter.batches_out(), 2);
        assert_eq!(
            deleter.take_batch(100).unwrap(),
            batches[0],
            "the failed batch goes first, an interval later"
        );
        deleter.on_applied(&batches[1]);
        deleter.on_applied(&batches[3]);
        deleter.on_applied(&batches[0]);
        assert_eq!(deleter.backlog(), 0);
        assert!(!deleter.is_busy());
        assert_eq!(deleter.keys_total, 12);
    }

    #[test]
    fn the_backlog_counts_queued_and_unapplied_keys_against_its_bound() {
        let mut deleter = Deleter::new(
            DeleterLimits {
                interval_ms: 100,
                batch_keys_max: 2,
                batches_in_flight_max: 4,
                backlog_keys_max: 4,
            },
            0,
        );
        for i in 0..3 {
            deleter.mark(key(i));
        }
        assert!(!deleter.is_over_backlog());
        let batch = deleter.take_batch(0).unwrap();
        deleter.mark(key(3));
        assert!(deleter.is_over_backlog(), "2 out + 2 queued = the bound");
        assert!(deleter.mark(key(4)), "a key is never refused");
        assert_eq!(deleter.backlog(), 5);
        deleter.on_applied(&batch);
        assert!(!deleter.is_over_backlog());
    }

    #[test]
    fn failed_flush_is_requeued_first_counted_and_retried_after_the_interval() {
        let mut deleter = deleter(10, 2, 1);
        for i in 0..3 {
            deleter.mark(key(i));
        }
        let batch = deleter.take_batch(0).unwrap();
        deleter.on_failed(batch.clone());
        assert_eq!(deleter.failures_total, 1);
        assert_eq!(
            deleter.take_batch(9),
            None,
            "a full batch waits for the interval after a failure"
        );
        assert_eq!(deleter.take_batch(10).unwrap(), batch);
        deleter.on_applied(&batch);
        assert_eq!(
            deleter.next_flush_ms(),
            Some(20),
            "a success ends the back-off"
        );
        deleter.mark(key(3));
        assert_eq!(
            deleter.take_batch(10).unwrap().keys.len(),
            2,
            "full: at once"
        );
    }

    #[test]
    fn a_key_is_deleted_once_however_often_it_is_marked() {
        let mut deleter = deleter(10, 8, 4);
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

    #[test]
    fn a_drained_deleter_gives_its_memory_back() {
        let mut deleter = deleter(10, 1 << 20, 1);
        for i in 0..100_000 {
            deleter.mark(key(i));
        }
        let (queue_peak, known_peak) = deleter.capacities();
        let batch = deleter.take_batch(10).unwrap();
        deleter.on_applied(&batch);
        let (queue, known) = deleter.capacities();
        assert!(queue < queue_peak / 4, "queue {queue_peak} -> {queue}");
        assert!(known < known_peak / 4, "set {known_peak} -> {known}");
    }
}
