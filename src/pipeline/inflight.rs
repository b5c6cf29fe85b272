//! The in-flight table: per message, the state of each recipient's copy (pure).
//!
//! An entry exists from a message's first dispatch until its delete batch is applied. Recipients
//! are fixed when the entry is made. A copy is `Pending` (in its recipient's retry list),
//! `Delayed` (NACKed with a delay), `Held` by one consumer under a lease, `Acked`, or `Forgotten`
//! (its universal consumer left, or its group was forgotten). The message is deleted once every
//! copy is `Acked` or `Forgotten`.
//!
//! Leases and NACK delays are kept in a min-heap of timers, so finding what to redeliver costs
//! O(timers due), never a walk of the table. Timers are never removed in place: each copy carries a
//! `generation` bumped on every change, and a popped timer whose generation is stale is dropped.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use ahash::AHashMap;
use smallvec::SmallVec;

use super::hub::{ConsumerId, RecipientId};
use crate::key::EventKey;
use crate::message::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyState {
    Pending,
    Delayed {
        until_ms: u64,
    },
    Held {
        consumer: ConsumerId,
        deadline_ms: u64,
    },
    Acked,
    Forgotten,
}

#[derive(Clone, Debug)]
pub struct Copy {
    pub recipient: RecipientId,
    pub state: CopyState,
    /// Deliveries of this copy so far.
    pub attempt: u32,
    /// Bumped on every state change; timers and queued deliveries carry the value they saw.
    pub generation: u64,
}

impl Copy {
    pub fn is_done(&self) -> bool {
        matches!(self.state, CopyState::Acked | CopyState::Forgotten)
    }
}

pub struct Entry {
    pub value: Value,
    pub expires_at_ms: Option<u64>,
    pub copies: SmallVec<[Copy; 2]>,
    /// Every copy is done (or the message expired): the key is with the deleter.
    pub deleting: bool,
}

impl Entry {
    pub fn copy_mut(&mut self, recipient: RecipientId) -> Option<&mut Copy> {
        self.copies.iter_mut().find(|c| c.recipient == recipient)
    }

    pub fn all_done(&self) -> bool {
        self.copies.iter().all(Copy::is_done)
    }

    pub fn is_expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|at| now_ms >= at)
    }
}

/// A lease expiry or the end of a NACK delay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timer {
    pub at_ms: u64,
    pub key: EventKey,
    pub recipient: RecipientId,
    pub generation: u64,
}

#[derive(Default)]
pub struct InFlight {
    pub entries: AHashMap<EventKey, Entry>,
    timers: BinaryHeap<Reverse<Timer>>,
    next_generation: u64,
}

impl InFlight {
    pub fn new() -> InFlight {
        InFlight::default()
    }

    pub fn next_generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    pub fn schedule(&mut self, timer: Timer) {
        self.timers.push(Reverse(timer));
    }

    /// The earliest timer, stale or not (a stale one only causes an early, empty wake-up).
    pub fn next_timer_ms(&self) -> Option<u64> {
        self.timers.peek().map(|Reverse(t)| t.at_ms)
    }

    /// Pops the next timer due at `now_ms` whose copy has not changed since it was set.
    pub fn pop_due_timer(&mut self, now_ms: u64) -> Option<Timer> {
        while let Some(Reverse(timer)) = self.timers.peek().copied() {
            if timer.at_ms > now_ms {
                return None;
            }
            self.timers.pop();
            let live = self
                .entries
                .get(&timer.key)
                .and_then(|e| e.copies.iter().find(|c| c.recipient == timer.recipient))
                .is_some_and(|c| c.generation == timer.generation);
            if live {
                return Some(timer);
            }
        }
        None
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
}
