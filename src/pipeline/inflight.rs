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
//! An ACK leaves its lease timer behind until the deadline, so under load most of the heap is
//! stale; [`InFlight::schedule`] rebuilds it with only live timers once it is more than twice the
//! live count found by the last rebuild plus [`TIMERS_REBUILD_FLOOR_LEN`], which keeps pushes
//! amortised O(1) and the heap within a constant of the live timers.
//!
//! Memory follows the live load, not its peak: an entry drops its value once every copy is done
//! (it only waits for its delete then), and the table and heap shrink after a drain
//! ([`super::memory::give_back`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

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
    /// The stored message; `None` once every copy is done (nothing will hand it out again).
    pub value: Option<CheckedValue>,
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

/// The heap is not rebuilt below this many timers (a rebuild would free almost nothing).
pub const TIMERS_REBUILD_FLOOR_LEN: usize = 1024;

#[derive(Default)]
pub struct InFlight {
    pub entries: AHashMap<EventKey, Entry>,
    timers: BinaryHeap<Reverse<Timer>>,
    /// Live timers found by the last rebuild: the heap is rebuilt past twice this plus the floor.
    timers_live_at_rebuild: usize,
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

    /// Moves a copy to `state` under a new generation and sets a timer for `at_ms` (the end of a
    /// lease or of a NACK delay); with `delivered`, counts one more delivery attempt. Returns the
    /// copy's attempts so far, or `None` (and no timer) when the message or the copy is gone.
    pub fn arm(
        &mut self,
        key: EventKey,
        recipient: RecipientId,
        state: CopyState,
        at_ms: u64,
        delivered: bool,
    ) -> Option<u32> {
        let generation = self.next_generation();
        let copy = self.entries.get_mut(&key)?.copy_mut(recipient)?;
        copy.state = state;
        copy.generation = generation;
        copy.attempt += u32::from(delivered);
        let attempt = copy.attempt;
        self.schedule(Timer {
            at_ms,
            key,
            recipient,
            generation,
        });
        Some(attempt)
    }

    pub fn schedule(&mut self, timer: Timer) {
        if self.timers.len()
            >= self
                .timers_live_at_rebuild
                .saturating_mul(2)
                .saturating_add(TIMERS_REBUILD_FLOOR_LEN)
        {
            self.drop_stale_timers();
        }
        self.timers.push(Reverse(timer));
    }

    /// Rebuilds the heap with only the timers whose copy has not changed since they were set.
    fn drop_stale_timers(&mut self) {
        let entries = &self.entries;
        self.timers.retain(|Reverse(timer)| is_live(entries, timer));
        self.timers_live_at_rebuild = self.timers.len();
        give_back(&mut self.timers);
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
            if is_live(&self.entries, &timer) {
                return Some(timer);
            }
            give_back(&mut self.timers);
        }
        None
    }

    /// Removes an entry (its delete was applied); the table shrinks after a drain.
    pub fn remove(&mut self, key: &EventKey) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        give_back(&mut self.entries);
        Some(entry)
    }

    /// Capacity of the table and of the timer heap (memory accounting, tests).
    pub fn capacities(&self) -> (usize, usize) {
        (self.entries.capacity(), self.timers.capacity())
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

/// Whether `timer`'s copy still exists with the generation the timer was set for.
fn is_live(entries: &AHashMap<EventKey, Entry>, timer: &Timer) -> bool {
    entries
        .get(&timer.key)
        .and_then(|e| e.copies.iter().find(|c| c.recipient == timer.recipient))
        .is_some_and(|c| c.generation == timer.generation)
}
