//! Copy records and durable settles: what the core asks the log to remember of a group's copy
//! (its deliveries so far; its ACK while other groups hold the message), the records read back
//! at start, and the `durable` ACKs and NACKs that wait for their commit.
//!
//! Rules (see [`crate::log::copies`] and [`crate::pipeline::copies`]):
//! - a group's copy is not handed out again before the log holds a record of its deliveries so
//!   far (`Copy::saved >= Copy::attempt`): after a restart the next delivery is never numbered
//!   lower than one a consumer already saw. The first delivery needs no record, so it costs
//!   nothing; the record is queued as the copy comes back (NACK, timeout, disconnect);
//! - a `durable` ACK waits for the message's delete when it completed the message, else for a
//!   record saying the group ACKed the copy; the deleter cuts such a delete at once;
//! - a `durable` NACK waits for the record of the copy's deliveries;
//! - a message's delete deletes every record of its copies in the same command.

use std::rc::Rc;

use super::ShardCore;
use crate::config::AckLevel;
use crate::key::EventKey;
use crate::log::copies::{group_hash, CopyId, CopyRecord};
use crate::pipeline::copies::{Commit, CopyBatch};
use crate::pipeline::hub::{RecipientId, RecipientKind};
use crate::pipeline::inflight::{Copy, Entry};

impl ShardCore {
    /// The persisted hash of a group recipient's name; `None` for a universal consumer.
    pub(super) fn group_of(&self, recipient: RecipientId) -> Option<u64> {
        match &self.hub.recipients.get(&recipient)?.kind {
            RecipientKind::Group { name, .. } => Some(group_hash(name)),
            RecipientKind::Universal { .. } => None,
        }
    }

    /// Whether the copy may be handed out: its deliveries so far are on record, or it needs no
    /// record (a universal consumer's). If not, its record is queued.
    pub(super) fn attempts_saved(&mut self, key: EventKey, recipient: RecipientId) -> bool {
        let saved = self
            .inflight
            .entries
            .get(&key)
            .and_then(|e| e.copy(recipient))
            .is_none_or(|c| c.saved >= c.attempt);
        if saved || self.group_of(recipient).is_none() {
            return true;
        }
        self.save_attempts(key, recipient);
        false
    }

    /// Queues a record of the copy's deliveries so far, if a group's copy has more than the
    /// log holds. Returns the copy's id when a record is (now) queued.
    pub(super) fn save_attempts(
        &mut self,
        key: EventKey,
        recipient: RecipientId,
    ) -> Option<CopyId> {
        let group = self.group_of(recipient)?;
        let entry = self.inflight.entries.get_mut(&key)?;
        let copy = entry.copy(recipient)?;
        let id = CopyId { key, group };
        if copy.saved >= copy.attempt {
            return self.copies.is_queued(&id).then_some(id);
        }
        let record = CopyRecord {
            id,
            attempts: copy.attempt,
            acked: false,
        };
        Self::note_record(entry, group);
        self.copies.queue(record);
        Some(id)
    }

    fn note_record(entry: &mut Entry, group: u64) {
        if !entry.records.contains(&group) {
            entry.records.push(group);
        }
    }

    /// What a `durable` ACK of `key` by `recipient` waits for (called right after the ACK
    /// was applied): the message's delete, or the record of the group's ACK.
    pub(super) fn ack_commit(
        &mut self,
        key: EventKey,
        recipient: RecipientId,
        commit: &Rc<Commit>,
    ) {
        let Some(entry) = self.inflight.entries.get(&key) else {
            return;
        };
        if entry.deleting {
            self.waiters.on_delete(key, commit);
            self.deleter.hurry();
            return;
        }
        let Some(group) = self.group_of(recipient) else {
            // A universal consumer's copy ends with its subscription: nothing to record.
            return;
        };
        let attempts = entry.copy(recipient).map_or(0, |c| c.attempt);
        let id = CopyId { key, group };
        if let Some(entry) = self.inflight.entries.get_mut(&key) {
            Self::note_record(entry, group);
        }
        self.copies.queue(CopyRecord {
            id,
            attempts,
            acked: true,
        });
        self.waiters.on_record(id, commit);
    }

    /// What a `durable` NACK of `key` by `recipient` waits for: the record of its deliveries.
    pub(super) fn nack_commit(
        &mut self,
        key: EventKey,
        recipient: RecipientId,
        commit: &Rc<Commit>,
    ) {
        if let Some(id) = self.save_attempts(key, recipient) {
            self.waiters.on_record(id, commit);
        }
    }

    /// A new settle's commit, when `level` waits for one.
    pub(super) fn commit_for(level: AckLevel) -> Option<Rc<Commit>> {
        (level == AckLevel::Durable).then(|| Rc::new(Commit::default()))
    }

    // ---- batches -------------------------------------------------------------------------

    /// Takes a batch of copy records to write, if any wait and a slot is free.
    pub fn take_copy_batch(&mut self, now_ms: u64) -> Option<CopyBatch> {
        let now_ms = self.tick(now_ms);
        self.copies.take_batch(now_ms)
    }

    /// The batch is in the log: its copies may be handed out again, and calls waiting for it
    /// are answered. Wakes the dispatcher (a copy held back for its record is now servable).
    pub fn on_copies_applied(&mut self, batch: &CopyBatch) {
        self.copies.on_applied(batch);
        for record in &batch.records {
            self.waiters.recorded(&record.id);
            let Some(entry) = self.inflight.entries.get_mut(&record.id.key) else {
                continue;
            };
            let group = record.id.group;
            for copy in entry.copies.iter_mut() {
                if self.hub.recipients.get(&copy.recipient).is_some_and(
                    |r| matches!(&r.kind, RecipientKind::Group { name, .. } if group_hash(name) == group),
                ) {
                    copy.saved = copy.saved.max(record.attempts);
                }
            }
        }
        self.waiters.shrink();
        self.wake = true;
    }

    pub fn on_copies_failed(&mut self, batch: CopyBatch) {
        let now_ms = self.now_ms;
        self.copies.on_failed(batch, now_ms);
    }

    /// Whether copy records wait to be cut into a batch.
    pub fn copies_waiting(&self) -> bool {
        self.copies.queued_len() > 0
    }

    /// Whether copy records wait or are being written (shutdown waits for them).
    pub fn copies_busy(&self) -> bool {
        self.copies.is_busy()
    }

    // ---- records read back at start --------------------------------------------------------

    /// Takes the copy records read back from the log (at start, or when this replica starts to
    /// lead): each waits until its message is dispatched again or deleted.
    pub fn restore_copies(&mut self, records: impl IntoIterator<Item = CopyRecord>) {
        for record in records {
            self.copies.restore(record);
        }
    }

    /// Records read back and not yet taken by a dispatched or deleted message (tests, figures).
    pub fn restored_copies(&self) -> usize {
        self.copies.restored_len()
    }

    /// The copies of a message about to get its in-flight entry, with what the log says of
    /// them; returns the copies and the groups that have records.
    pub(super) fn restored_copies_of(
        &mut self,
        key: EventKey,
        recipients: &[RecipientId],
    ) -> (smallvec::SmallVec<[Copy; 2]>, smallvec::SmallVec<[u64; 1]>) {
        let records = self.copies.take_restored(&key);
        if records.is_empty() {
            // The common case costs no hashing: nothing was recorded of this message.
            let copies = recipients.iter().map(|r| Copy::pending(*r)).collect();
            return (copies, smallvec::SmallVec::new());
        }
        let copies = recipients
            .iter()
            .map(|r| {
                let group = self.group_of(*r);
                match records.iter().find(|rec| Some(rec.id.group) == group) {
                    Some(rec) => Copy::restored(*r, rec.attempts, rec.acked),
                    None => Copy::pending(*r),
                }
            })
            .collect();
        (copies, records.iter().map(|r| r.id.group).collect())
    }

    /// The records a delete of `keys` must delete too: those of their entries, and restored
    /// ones of messages never dispatched since the start.
    pub(super) fn records_of(&self, keys: &[EventKey]) -> Vec<CopyId> {
        let mut ids = Vec::new();
        for key in keys {
            if let Some(entry) = self.inflight.entries.get(key) {
                ids.extend(
                    entry
                        .records
                        .iter()
                        .map(|&group| CopyId { key: *key, group }),
                );
            }
            ids.extend(self.copies.restored_of(key).map(|r| r.id));
        }
        ids
    }
}
