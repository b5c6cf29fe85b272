//! Copy transitions: a copy back to its retry list, forgotten, expired, or offered to a consumer;
//! an entry whose copies are all done goes to the deleter. Every state change of a copy is here.

use smallvec::SmallVec;

use super::ShardCore;
use crate::key::EventKey;
use crate::pipeline::hub::{Queued, RecipientId};
use crate::pipeline::inflight::{CopyState, Entry, RECEIPT_PENDING};

/// Who found an expired message (`pinq_messages_expired_total{by}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpiredBy {
    Dispatcher,
    Janitor,
}

impl ShardCore {
    /// Puts a copy back in its recipient's retry list, or forgets it if the recipient is gone.
    pub(super) fn make_pending(&mut self, key: EventKey, recipient: RecipientId) {
        let Some(r) = self.hub.recipients.get_mut(&recipient) else {
            self.forget_copy(key, recipient);
            return;
        };
        match self.inflight.state(&key, recipient) {
            Some(CopyState::Held { .. } | CopyState::Delayed { .. }) => {}
            None | Some(CopyState::Pending | CopyState::Acked | CopyState::Forgotten) => return,
        }
        self.inflight
            .set_state(key, recipient, CopyState::Pending, false);
        r.pending.push_back(key);
        self.hub.note_pending(recipient);
        self.wake = true;
    }

    pub(super) fn forget_copy(&mut self, key: EventKey, recipient: RecipientId) {
        let done = self
            .inflight
            .entries
            .get(&key)
            .and_then(|e| e.copy(recipient))
            .is_none_or(|c| c.is_done());
        if !done {
            self.inflight
                .set_state(key, recipient, CopyState::Forgotten, false);
        }
        self.complete_if_done(key);
    }

    pub(super) fn complete_if_done(&mut self, key: EventKey) {
        if let Some(entry) = self.inflight.entries.get_mut(&key) {
            if !entry.deleting && entry.all_done() {
                Self::mark_deleting(entry, &mut self.deleting_entries);
                self.deleter.mark(key);
            }
        }
    }

    /// The entry only waits for its delete now: nothing hands its value out again, so it is
    /// dropped here rather than when the (possibly much later) delete is applied.
    pub(super) fn mark_deleting(entry: &mut Entry, deleting_entries: &mut usize) {
        if !entry.deleting {
            entry.deleting = true;
            *deleting_entries += 1;
        }
        entry.value = None;
    }

    /// An expired message: every copy is dropped and the key goes to the deleter. Counted once,
    /// by whoever meets it first (`by`): a key already with the deleter is on its way out.
    pub(super) fn expire(&mut self, key: EventKey, by: ExpiredBy) {
        if self.deleter.contains(&key) {
            return;
        }
        match by {
            ExpiredBy::Dispatcher => self.counters.expired_dispatcher_total += 1,
            ExpiredBy::Janitor => self.counters.expired_janitor_total += 1,
        }
        let open: SmallVec<[(RecipientId, CopyState); 4]> = self
            .inflight
            .entries
            .get(&key)
            .map(|e| {
                e.copies
                    .iter()
                    .filter(|c| !c.is_done())
                    .map(|c| (c.recipient, c.state()))
                    .collect()
            })
            .unwrap_or_default();
        for (recipient, state) in open {
            self.hub.count(recipient, |c| c.expired += 1);
            if let CopyState::Held { consumer, .. } = state {
                if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                    c.held.remove(&key);
                }
            }
            self.inflight
                .set_state(key, recipient, CopyState::Forgotten, false);
        }
        if let Some(entry) = self.inflight.entries.get_mut(&key) {
            Self::mark_deleting(entry, &mut self.deleting_entries);
        }
        self.deleter.mark(key);
    }

    /// Hands a copy to a consumer of its recipient, if one has room.
    pub(super) fn offer(&mut self, key: EventKey, recipient: RecipientId) -> bool {
        if !self.attempts_saved(key, recipient) {
            // Its record is queued; applying it wakes the next pass (`records` module docs).
            return false;
        }
        let avoid = self
            .inflight
            .entries
            .get(&key)
            .and_then(|e| e.copy(recipient))
            .and_then(|c| c.avoid);
        let (chosen, skipped) = self.hub.choose(recipient, avoid);
        self.counters.consumer_queue_full_total += skipped;
        let Some(consumer) = chosen else { return false };
        if avoid.is_some() {
            self.inflight.set_avoid(key, recipient, None);
        }
        // Its lease starts when the consumer confirms the receipt (`ShardCore::returned`).
        let held = CopyState::Held {
            consumer,
            deadline_ms: RECEIPT_PENDING,
        };
        let Some(attempt) = self.inflight.set_state(key, recipient, held, true) else {
            return false;
        };
        if let Some(c) = self.hub.consumers.get_mut(&consumer) {
            c.queue.push_back(Queued { key, attempt });
            c.held.insert(key);
        }
        self.ready.insert(consumer);
        self.counters.dispatched_total += 1;
        if attempt > 1 {
            self.counters.redelivered_total += 1;
        }
        self.hub.count(recipient, |c| {
            c.dispatched += 1;
            c.redeliveries += u64::from(attempt > 1);
        });
        self.productive = true;
        true
    }
}
