//! Copy records on their way to the log, the records read back at start, and the `durable`
//! ACKs and NACKs waiting for their commit (pure).
//!
//! What must outlive a restart or a change of leader about a group's copy (see
//! [`crate::log::copies`]): how often it was delivered, and whether the group ACKed it while
//! other groups still hold the message. The shard core queues a [`CopyRecord`] here when a copy
//! goes back for redelivery, and when a `durable` ACK leaves other copies open; the shell takes
//! them as [`CopyBatch`]es (one [`crate::log::Command::Copies`] each) and reports them applied
//! or failed. A later record of the same copy replaces a queued one. Up to
//! [`BATCHES_IN_FLIGHT_MAX`] batches are out at once; a failed batch goes back to the front.
//!
//! Records read back at start wait in [`CopyWrites::restored`] until their message is
//! dispatched again (the core applies them to the new in-flight entry) or deleted.
//!
//! Bounds: every queued record names a copy in the in-flight table, which is bounded, and a copy
//! has at most one record queued; waiters are one per tag of a pending `durable` call, and calls
//! in flight are bounded per connection (`server.maxCallsInFlight`).

use std::cell::Cell;
use std::collections::VecDeque;
use std::rc::Rc;

use ahash::AHashMap;
use smallvec::SmallVec;

use super::memory::give_back;
use crate::key::EventKey;
use crate::log::copies::{CopyId, CopyRecord};
use crate::storage::signal::Signal;

/// Copy batches written at once (each one log command; several share a group commit).
pub const BATCHES_IN_FLIGHT_MAX: usize = 2;
/// Records in one batch.
pub const BATCH_RECORDS_MAX: usize = 1024;
/// After a batch failed, the next one waits this long (a full or failed disk is not retried in
/// a loop).
pub const RETRY_AFTER_MS: u64 = 100;

/// Copy records to write together, in one command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyBatch {
    pub records: Vec<CopyRecord>,
}

/// A `durable` ACK or NACK call waiting for what it changed to commit. The core counts down
/// one per commit it waits for; the shell awaits [`Commit::wait`].
#[derive(Default)]
pub struct Commit {
    remaining: Cell<usize>,
    lost: Cell<bool>,
    signal: Signal,
}

/// How a [`Commit`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Committed {
    /// Everything the call changed is committed.
    Yes,
    /// The core that accepted the call was replaced (its shard stopped leading or restarted
    /// its pipeline) before the commit: the change may be lost.
    Lost,
}

impl Commit {
    pub(crate) fn add(&self) {
        self.remaining.set(self.remaining.get() + 1);
    }

    pub(crate) fn done_one(&self) {
        let left = self.remaining.get().saturating_sub(1);
        self.remaining.set(left);
        if left == 0 {
            self.signal.notify();
        }
    }

    pub(crate) fn lose(&self) {
        self.lost.set(true);
        self.signal.notify();
    }

    pub fn is_pending(&self) -> bool {
        self.remaining.get() > 0 && !self.lost.get()
    }

    /// Resolves once every commit the call waits for is applied, or the core is gone.
    pub async fn wait(&self) -> Committed {
        while self.is_pending() {
            self.signal.wait().await;
        }
        if self.lost.get() {
            Committed::Lost
        } else {
            Committed::Yes
        }
    }
}

/// Who waits for which commit: a message's delete, or one copy's record.
#[derive(Default)]
pub struct Waiters {
    deletes: AHashMap<EventKey, SmallVec<[Rc<Commit>; 1]>>,
    records: AHashMap<CopyId, SmallVec<[Rc<Commit>; 1]>>,
}

impl Waiters {
    pub fn on_delete(&mut self, key: EventKey, commit: &Rc<Commit>) {
        commit.add();
        self.deletes.entry(key).or_default().push(commit.clone());
    }

    pub fn on_record(&mut self, id: CopyId, commit: &Rc<Commit>) {
        commit.add();
        self.records.entry(id).or_default().push(commit.clone());
    }

    pub fn deleted(&mut self, key: &EventKey) {
        if let Some(commits) = self.deletes.remove(key) {
            commits.iter().for_each(|c| c.done_one());
        }
    }

    pub fn recorded(&mut self, id: &CopyId) {
        if let Some(commits) = self.records.remove(id) {
            commits.iter().for_each(|c| c.done_one());
        }
    }

    /// Whether any call waits for the delete of `key`.
    pub fn waits_for_delete(&self, key: &EventKey) -> bool {
        self.deletes.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.deletes.len() + self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn shrink(&mut self) {
        give_back(&mut self.deletes);
        give_back(&mut self.records);
    }
}

impl Drop for Waiters {
    fn drop(&mut self) {
        let all = self.deletes.values().chain(self.records.values());
        all.flatten().for_each(|c| c.lose());
    }
}

/// Queued records, batches out, and records restored at start.
#[derive(Default)]
pub struct CopyWrites {
    queue: VecDeque<CopyId>,
    queued: AHashMap<CopyId, CopyRecord>,
    batches_out: usize,
    /// A batch failed: no batch is cut before this time.
    retry_at_ms: u64,
    /// Records read back at start, by message, until the message is dispatched or deleted.
    restored: AHashMap<EventKey, SmallVec<[CopyRecord; 1]>>,
    pub batches_total: u64,
    pub records_total: u64,
    pub failures_total: u64,
}

impl CopyWrites {
    /// Queues a record; one already queued for the same copy is replaced (keeping its place).
    pub fn queue(&mut self, record: CopyRecord) {
        if self.queued.insert(record.id, record).is_none() {
            self.queue.push_back(record.id);
        }
    }

    /// Whether a record of this copy waits to be cut.
    pub fn is_queued(&self, id: &CopyId) -> bool {
        self.queued.contains_key(id)
    }

    /// Takes the next batch if records wait, a batch slot is free and no failure is being
    /// waited out.
    pub fn take_batch(&mut self, now_ms: u64) -> Option<CopyBatch> {
        if self.queue.is_empty()
            || self.batches_out >= BATCHES_IN_FLIGHT_MAX
            || now_ms < self.retry_at_ms
        {
            return None;
        }
        let n = self.queue.len().min(BATCH_RECORDS_MAX);
        let records: Vec<CopyRecord> = self
            .queue
            .drain(..n)
            .filter_map(|id| self.queued.remove(&id))
            .collect();
        give_back(&mut self.queue);
        give_back(&mut self.queued);
        self.batches_out += 1;
        Some(CopyBatch { records })
    }

    pub fn on_applied(&mut self, batch: &CopyBatch) {
        self.batches_out = self.batches_out.saturating_sub(1);
        self.batches_total += 1;
        self.records_total += batch.records.len() as u64;
    }

    /// A failed batch: its records go back to the front, unless a newer record of the same copy
    /// was queued meanwhile (that one is written instead); the next batch waits
    /// [`RETRY_AFTER_MS`].
    pub fn on_failed(&mut self, batch: CopyBatch, now_ms: u64) {
        self.batches_out = self.batches_out.saturating_sub(1);
        self.failures_total += 1;
        self.retry_at_ms = now_ms.saturating_add(RETRY_AFTER_MS);
        for record in batch.records.into_iter().rev() {
            if let std::collections::hash_map::Entry::Vacant(slot) = self.queued.entry(record.id) {
                slot.insert(record);
                self.queue.push_front(record.id);
            }
        }
    }

    /// Records queued or being written.
    pub fn is_busy(&self) -> bool {
        !self.queue.is_empty() || self.batches_out > 0
    }

    pub fn queued_len(&self) -> usize {
        self.queue.len()
    }

    /// Keeps a record read back at start until its message is dispatched or deleted.
    pub fn restore(&mut self, record: CopyRecord) {
        self.restored.entry(record.id.key).or_default().push(record);
    }

    /// The restored records of a message, taken (its in-flight entry takes them over).
    pub fn take_restored(&mut self, key: &EventKey) -> SmallVec<[CopyRecord; 1]> {
        if self.restored.is_empty() {
            return SmallVec::new();
        }
        let taken = self.restored.remove(key).unwrap_or_default();
        if !taken.is_empty() {
            give_back(&mut self.restored);
        }
        taken
    }

    /// The restored records of a message, left in place.
    pub fn restored_of(&self, key: &EventKey) -> impl Iterator<Item = &CopyRecord> {
        self.restored.get(key).into_iter().flatten()
    }

    pub fn restored_len(&self) -> usize {
        self.restored.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TopicHash;

    fn record(i: u64, attempts: u32) -> CopyRecord {
        CopyRecord {
            id: CopyId {
                key: EventKey::new(TopicHash(3), 1, i),
                group: 9,
            },
            attempts,
            acked: false,
        }
    }

    #[test]
    fn a_later_record_of_a_copy_replaces_the_queued_one_in_place() {
        let mut w = CopyWrites::default();
        w.queue(record(1, 1));
        w.queue(record(2, 1));
        w.queue(record(1, 2));
        let batch = w.take_batch(0).unwrap();
        assert_eq!(batch.records, vec![record(1, 2), record(2, 1)]);
    }

    #[test]
    fn batches_out_are_bounded_and_a_failed_one_yields_to_newer_records() {
        let mut w = CopyWrites::default();
        for i in 0..3 {
            w.queue(record(i, 1));
            if i < 2 {
                assert!(w.take_batch(0).is_some());
            }
        }
        assert!(w.take_batch(0).is_none(), "two batches out at most");
        let failed = CopyBatch {
            records: vec![record(0, 1), record(2, 1)],
        };
        w.queue(record(0, 5));
        w.on_failed(failed, 1_000);
        assert!(w.take_batch(1_050).is_none(), "a failure is waited out");
        let batch = w.take_batch(1_000 + RETRY_AFTER_MS).unwrap();
        assert_eq!(batch.records, vec![record(2, 1), record(0, 5)]);
        assert!(w.is_busy());
    }

    #[test]
    fn commits_resolve_once_every_wait_is_done_and_are_lost_with_their_waiters() {
        let commit = Rc::new(Commit::default());
        let mut waiters = Waiters::default();
        let r = record(1, 1);
        waiters.on_delete(r.id.key, &commit);
        waiters.on_record(r.id, &commit);
        waiters.deleted(&r.id.key);
        assert!(commit.is_pending());
        waiters.recorded(&r.id);
        assert!(!commit.is_pending() && !commit.lost.get());

        let lost = Rc::new(Commit::default());
        waiters.on_delete(r.id.key, &lost);
        drop(waiters);
        assert!(lost.lost.get());
    }
}
