//! The in-flight table: per message, the state of each recipient's copy (pure).
//!
//! An entry exists from a message's first dispatch until its delete batch is applied. Recipients
//! are fixed when the entry is made. A copy is `Pending` (in its recipient's retry list),
//! `Delayed` (NACKed with a delay), `Held` by one consumer under a lease, `Acked`, or `Forgotten`
//! (its universal consumer left, or its group was forgotten). The message is deleted once every
//! copy is `Acked` or `Forgotten`.
//!
//! Leases and NACK delays are timers in one ordered set, so finding what to redeliver costs
//! O(timers due), never a walk of the table. The set is keyed by the copy: a copy has a timer
//! exactly while it is `Held` or `Delayed`, at the deadline its state names, and every state
//! change goes through [`InFlight::set_state`], which replaces or removes that timer. So a
//! client that touches or NACKs one copy in a loop moves one timer instead of adding one per
//! call, an ACK removes its lease timer at once, and the set never holds more timers than copies
//! are held or delayed (an earlier lazy-deletion heap kept stale timers until their deadline).
//!
//! Memory follows the live load, not its peak: an entry drops its value once every copy is done
//! (it only waits for its delete then), the table shrinks after a drain
//! ([`super::memory::give_back`]), and the timer set frees its nodes as timers go.

use std::collections::BTreeSet;

use ahash::AHashMap;
use smallvec::SmallVec;

use super::hub::{ConsumerId, RecipientId};
use super::memory::give_back;
use crate::key::EventKey;
use crate::message::CheckedValue;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyState {
    Pending,
    Delayed {
        until_ms: u64,
    },
    /// Handed to `consumer`. Its lease ends at `deadline_ms`, or, while that is
    /// [`RECEIPT_PENDING`], has not started: the consumer has not yet confirmed it received the
    /// copy (its `deliver` call has not returned), so the copy may still be on its way and is
    /// not handed to anyone else until the consumer confirms it or goes.
    Held {
        consumer: ConsumerId,
        deadline_ms: u64,
    },
    Acked,
    Forgotten,
}

/// The `deadline_ms` of a copy held by a consumer that has not yet confirmed receiving it: its
/// lease starts at the receipt ([`CopyState::Held`]).
pub const RECEIPT_PENDING: u64 = u64::MAX;

impl CopyState {
    /// When a copy in this state times out: the end of its lease or of its NACK delay. A copy
    /// whose receipt is pending has no timer.
    fn timer_at_ms(self) -> Option<u64> {
        match self {
            CopyState::Delayed { until_ms } => Some(until_ms),
            CopyState::Held { deadline_ms, .. } if deadline_ms == RECEIPT_PENDING => None,
            CopyState::Held { deadline_ms, .. } => Some(deadline_ms),
            CopyState::Pending | CopyState::Acked | CopyState::Forgotten => None,
        }
    }
}

/// One recipient's copy of a message. Its state is read with [`Copy::state`] and changed only
/// through [`InFlight::set_state`], which keeps the copy's timer in step with it.
#[derive(Clone, Debug)]
pub struct Copy {
    pub recipient: RecipientId,
    state: CopyState,
    /// Deliveries of this copy so far.
    pub attempt: u32,
    /// Deliveries of this copy the log has a record of (a group's copy is not handed out again
    /// before this reaches `attempt`: see [`crate::log::copies`]).
    pub saved: u32,
    /// The consumer that let this copy's last lease run out: its redelivery goes to another
    /// member of the group if one has room.
    pub avoid: Option<ConsumerId>,
}

impl Copy {
    /// A copy not yet offered to anyone.
    pub fn pending(recipient: RecipientId) -> Copy {
        Copy {
            recipient,
            state: CopyState::Pending,
            attempt: 0,
            saved: 0,
            avoid: None,
        }
    }

    /// A copy whose record was read back from the log: delivered `attempts` times, or ACKed.
    pub fn restored(recipient: RecipientId, attempts: u32, acked: bool) -> Copy {
        Copy {
            recipient,
            state: if acked {
                CopyState::Acked
            } else {
                CopyState::Pending
            },
            attempt: attempts,
            saved: attempts,
            avoid: None,
        }
    }

    pub fn state(&self) -> CopyState {
        self.state
    }

    pub fn is_done(&self) -> bool {
        matches!(self.state, CopyState::Acked | CopyState::Forgotten)
    }
}

pub struct Entry {
    /// The stored message; `None` once every copy is done (nothing will hand it out again).
    pub value: Option<CheckedValue>,
    pub expires_at_ms: Option<u64>,
    pub copies: SmallVec<[Copy; 2]>,
    /// Every copy is done (or the message expired): the key is with the deleter.
    pub deleting: bool,
    /// Groups (by [`crate::log::copies::group_hash`]) that may have a copy record in the log:
    /// the message's delete deletes them too.
    pub records: SmallVec<[u64; 1]>,
}

impl Entry {
    pub fn copy(&self, recipient: RecipientId) -> Option<&Copy> {
        self.copies.iter().find(|c| c.recipient == recipient)
    }

    pub fn all_done(&self) -> bool {
        self.copies.iter().all(Copy::is_done)
    }

    pub fn is_expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|at| now_ms >= at)
    }
}

/// A lease expiry or the end of a NACK delay. Ordered by time first, so the set's first timer
/// is the next one due.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timer {
    pub at_ms: u64,
    pub key: EventKey,
    pub recipient: RecipientId,
}

#[derive(Default)]
pub struct InFlight {
    pub entries: AHashMap<EventKey, Entry>,
    /// One timer per `Held` or `Delayed` copy, at the deadline its state names.
    timers: BTreeSet<Timer>,
    /// `Delayed` copies per recipient (`GroupStats.delayed`), kept in step by
    /// [`InFlight::set_state`] and [`InFlight::remove`] so figures need not walk the table; a
    /// recipient without delayed copies has no entry.
    delayed: AHashMap<RecipientId, u64>,
}

impl InFlight {
    pub fn new() -> InFlight {
        InFlight::default()
    }

    /// The state of one copy, if the message and the copy exist.
    pub fn state(&self, key: &EventKey, recipient: RecipientId) -> Option<CopyState> {
        self.entries.get(key)?.copy(recipient).map(Copy::state)
    }

    /// Moves a copy to `state`, replacing its timer by the one `state` names (a lease deadline,
    /// the end of a NACK delay) or removing it; with `delivered`, counts one more delivery
    /// attempt. Returns the copy's attempts so far, or `None` (and no change) when the message or
    /// the copy is gone.
    pub fn set_state(
        &mut self,
        key: EventKey,
        recipient: RecipientId,
        state: CopyState,
        delivered: bool,
    ) -> Option<u32> {
        let copy = self
            .entries
            .get_mut(&key)?
            .copies
            .iter_mut()
            .find(|c| c.recipient == recipient)?;
        let before = copy.state.timer_at_ms();
        let was_delayed = matches!(copy.state, CopyState::Delayed { .. });
        copy.state = state;
        copy.attempt += u32::from(delivered);
        let attempt = copy.attempt;
        match (was_delayed, matches!(state, CopyState::Delayed { .. })) {
            (false, true) => *self.delayed.entry(recipient).or_default() += 1,
            (true, false) => self.uncount_delayed(recipient),
            _ => {}
        }
        if let Some(at_ms) = before {
            self.timers.remove(&Timer {
                at_ms,
                key,
                recipient,
            });
        }
        if let Some(at_ms) = state.timer_at_ms() {
            self.timers.insert(Timer {
                at_ms,
                key,
                recipient,
            });
        }
        Some(attempt)
    }

    /// Records the consumer a copy's next delivery should avoid ([`Copy::avoid`]).
    pub fn set_avoid(&mut self, key: EventKey, recipient: RecipientId, avoid: Option<ConsumerId>) {
        let copy = self
            .entries
            .get_mut(&key)
            .and_then(|e| e.copies.iter_mut().find(|c| c.recipient == recipient));
        if let Some(copy) = copy {
            copy.avoid = avoid;
        }
    }

    /// When the next timer is due.
    pub fn next_timer_ms(&self) -> Option<u64> {
        self.timers.first().map(|t| t.at_ms)
    }

    /// Takes the next timer due at `now_ms`. Its copy is still in the state that set it: the
    /// caller moves the copy on (to its retry list), which finds no timer left to remove.
    pub fn pop_due_timer(&mut self, now_ms: u64) -> Option<Timer> {
        if self.timers.first()?.at_ms > now_ms {
            return None;
        }
        self.timers.pop_first()
    }

    /// Removes an entry (its delete was applied) with its copies' timers; the table shrinks
    /// after a drain.
    pub fn remove(&mut self, key: &EventKey) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        for copy in &entry.copies {
            if matches!(copy.state, CopyState::Delayed { .. }) {
                self.uncount_delayed(copy.recipient);
            }
            if let Some(at_ms) = copy.state.timer_at_ms() {
                self.timers.remove(&Timer {
                    at_ms,
                    key: *key,
                    recipient: copy.recipient,
                });
            }
        }
        give_back(&mut self.entries);
        Some(entry)
    }

    fn uncount_delayed(&mut self, recipient: RecipientId) {
        if let Some(n) = self.delayed.get_mut(&recipient) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.delayed.remove(&recipient);
            }
        }
    }

    /// Copies of `recipient` waiting out a NACK delay, a backoff or their dead-letter publish.
    pub fn delayed_of(&self, recipient: RecipientId) -> u64 {
        self.delayed.get(&recipient).copied().unwrap_or(0)
    }

    /// Capacity of the table, and the timers held (a tree has no spare capacity).
    pub fn capacities(&self) -> (usize, usize) {
        (self.entries.capacity(), self.timers.len())
    }

    pub fn timers_len(&self) -> usize {
        self.timers.len()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Checks that timers and copies agree: one timer per held or delayed copy, at its deadline,
    /// and no other (tests; a walk of the whole table).
    #[cfg(test)]
    pub fn assert_timers_match_copies(&self) {
        let mut expected = 0;
        for (key, entry) in &self.entries {
            for copy in &entry.copies {
                if let Some(at_ms) = copy.state.timer_at_ms() {
                    expected += 1;
                    let timer = Timer {
                        at_ms,
                        key: *key,
                        recipient: copy.recipient,
                    };
                    assert!(self.timers.contains(&timer), "no timer for {timer:?}");
                }
            }
        }
        assert_eq!(self.timers.len(), expected, "timers without a copy");
        let mut delayed: AHashMap<RecipientId, u64> = AHashMap::new();
        for copy in self.entries.values().flat_map(|e| e.copies.iter()) {
            if matches!(copy.state, CopyState::Delayed { .. }) {
                *delayed.entry(copy.recipient).or_default() += 1;
            }
        }
        assert_eq!(self.delayed, delayed, "delayed copies per recipient");
    }
}
