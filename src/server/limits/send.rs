//! Bytes a connection may have sent in `Consumer.deliver` calls that its client has not
//! answered: per connection (`server.maxSendBufferBytes`) and per shard (its share of
//! `server.maxNodeSendBufferBytes`).
//!
//! Why here and not on the socket: capnp-rpc's twoparty writer queues every outgoing message
//! without bound, so a client that stops reading its socket made the broker serialise its whole
//! window (`queueSize` copies per subscription, 48 subscriptions of 64 KiB messages: 3.4 GiB)
//! into that queue. A `deliver` call's bytes are taken here before it is built and given back
//! when it returns, so what the writer queue can hold is bounded by these budgets. A delivery
//! stream that finds no room leaves its copies in its sink (they are shared with the owner's
//! in-flight table, so they cost nothing more): its window stays full and the owner's
//! dispatcher gives the group's next copies to its other consumers.
//!
//! A connection that waits for room while none of its calls returns is stalled: the watchdog
//! closes it after `server.sendStallTimeout`, which drops its subscriptions and so releases its
//! copies. Pure accounting with wakers; it reads no clock (`now_ms` is passed in).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// What one delivery costs beyond its stored value: the `Delivery` struct, its tag and the list
/// pointer of the `deliver` call it travels in.
pub const DELIVERY_OVERHEAD_BYTES: usize = 64;

/// One budget of bytes sent and not answered, with the streams waiting for room in it.
#[derive(Debug)]
pub struct SendBudget {
    max: usize,
    in_use: Cell<usize>,
    waiters: RefCell<Vec<Waker>>,
}

impl SendBudget {
    pub fn new(max: usize) -> Rc<SendBudget> {
        Rc::new(SendBudget {
            max,
            in_use: Cell::new(0),
            waiters: RefCell::new(Vec::new()),
        })
    }

    pub fn in_use(&self) -> usize {
        self.in_use.get()
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Whether `bytes` more fit; with `alone` (one delivery) anything fits an empty budget, so a
    /// delivery larger than the whole budget goes by itself.
    fn fits(&self, bytes: usize, alone: bool) -> bool {
        let in_use = self.in_use.get();
        (alone && in_use == 0) || in_use.saturating_add(bytes) <= self.max
    }

    fn take(&self, bytes: usize) {
        self.in_use.set(self.in_use.get().saturating_add(bytes));
    }

    fn give(&self, bytes: usize) {
        self.in_use.set(self.in_use.get().saturating_sub(bytes));
        for waker in self.waiters.borrow_mut().drain(..) {
            waker.wake();
        }
    }

    fn wait(&self, waker: &Waker) {
        let mut waiters = self.waiters.borrow_mut();
        if !waiters.iter().any(|w| w.will_wake(waker)) {
            waiters.push(waker.clone());
        }
    }
}

/// What one connection may send: its own budget and its shard's, and since when it has waited
/// for room without any of its calls returning.
#[derive(Debug)]
pub struct SendGate {
    conn: Rc<SendBudget>,
    shard: Rc<SendBudget>,
    /// Set when a stream of this connection, with bytes of its own unanswered, finds no room;
    /// cleared whenever one of its calls returns.
    blocked_since_ms: Cell<Option<u64>>,
    /// Most bytes this connection has had unanswered at once (to decide on a trim at close).
    high_water: Cell<usize>,
    /// The connection is closed: its calls will never be answered.
    closed: Cell<bool>,
}

/// Bytes of one `deliver` call, taken from both budgets; dropping it (the call returned or
/// failed) gives them back and wakes the streams waiting for room.
#[derive(Debug)]
pub struct SendPermit {
    gate: Rc<SendGate>,
    bytes: usize,
}

impl SendGate {
    pub fn new(conn_max: usize, shard: Rc<SendBudget>) -> Rc<SendGate> {
        Rc::new(SendGate {
            conn: SendBudget::new(conn_max),
            shard,
            blocked_since_ms: Cell::new(None),
            high_water: Cell::new(0),
            closed: Cell::new(false),
        })
    }

    /// Whether `bytes` more fit in both budgets (`alone`: they are one delivery).
    pub fn fits(&self, bytes: usize, alone: bool) -> bool {
        self.conn.fits(bytes, alone) && self.shard.fits(bytes, alone)
    }

    /// Takes `bytes` (the caller checked [`SendGate::fits`] for at least its first delivery).
    pub fn take(self: &Rc<Self>, bytes: usize) -> SendPermit {
        self.conn.take(bytes);
        self.shard.take(bytes);
        self.high_water
            .set(self.high_water.get().max(self.conn.in_use()));
        SendPermit {
            gate: self.clone(),
            bytes,
        }
    }

    /// Ready once one delivery of `bytes` fits; until then the stream is counted as waiting, and as blocked
    /// (for the stall timeout) when bytes of its own connection are unanswered.
    pub fn poll_room(&self, cx: &mut Context<'_>, bytes: usize, now_ms: u64) -> Poll<()> {
        if self.closed.get() || self.fits(bytes, true) {
            return Poll::Ready(());
        }
        if self.conn.in_use() > 0 && self.blocked_since_ms.get().is_none() {
            self.blocked_since_ms.set(Some(now_ms));
        }
        self.conn.wait(cx.waker());
        self.shard.wait(cx.waker());
        Poll::Pending
    }

    /// Marks the connection closed (its RPC system is gone) and wakes every task waiting on it.
    pub fn close(&self) {
        self.closed.set(true);
        for waker in self.conn.waiters.borrow_mut().drain(..) {
            waker.wake();
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.get()
    }

    /// Ready once the connection is closed.
    pub fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.closed.get() {
            return Poll::Ready(());
        }
        self.conn.wait(cx.waker());
        Poll::Pending
    }

    /// Since when the connection has waited for room with none of its calls returning.
    pub fn blocked_since_ms(&self) -> Option<u64> {
        self.blocked_since_ms.get()
    }

    pub fn in_use(&self) -> usize {
        self.conn.in_use()
    }

    pub fn high_water(&self) -> usize {
        self.high_water.get()
    }
}

impl Drop for SendPermit {
    fn drop(&mut self) {
        self.gate.blocked_since_ms.set(None);
        self.gate.conn.give(self.bytes);
        self.gate.shard.give(self.bytes);
    }
}

/// The bytes a delivery of a stored value of `value_bytes` takes from the budgets.
pub fn delivery_charge_bytes(value_bytes: usize) -> usize {
    value_bytes.saturating_add(DELIVERY_OVERHEAD_BYTES)
}

/// How many of the deliveries (their charges, oldest first) go in the next call: as many as
/// fit, at most `len_max`; the first always when the gate has room for it. Pure.
pub fn batch_len(gate: &SendGate, charges: impl Iterator<Item = usize>, len_max: usize) -> usize {
    let mut total = 0usize;
    let mut n = 0usize;
    for charge in charges.take(len_max) {
        let next = total.saturating_add(charge);
        if !gate.fits(next, n == 0) {
            break;
        }
        total = next;
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop_cx() -> Context<'static> {
        Context::from_waker(Waker::noop())
    }

    #[test]
    fn a_connection_gets_no_more_than_its_own_budget() {
        let shard = SendBudget::new(1 << 20);
        let gate = SendGate::new(100, shard);
        assert_eq!(batch_len(&gate, [40, 40, 40].into_iter(), 256), 2);
        let permit = gate.take(80);
        assert_eq!(batch_len(&gate, [40].into_iter(), 256), 0);
        assert!(gate.poll_room(&mut noop_cx(), 40, 7).is_pending());
        assert_eq!(gate.blocked_since_ms(), Some(7));
        drop(permit);
        assert_eq!(gate.blocked_since_ms(), None);
        assert!(gate.poll_room(&mut noop_cx(), 40, 8).is_ready());
        assert!(gate.poll_closed(&mut noop_cx()).is_pending());
        gate.close();
        assert!(gate.poll_closed(&mut noop_cx()).is_ready());
    }

    #[test]
    fn connections_share_the_shard_budget_and_one_waiting_on_others_is_not_blocked() {
        let shard = SendBudget::new(100);
        let a = SendGate::new(1000, shard.clone());
        let b = SendGate::new(1000, shard.clone());
        let held = a.take(90);
        assert!(b.poll_room(&mut noop_cx(), 20, 5).is_pending());
        // b has nothing of its own unanswered: waiting on a is not a stall of b.
        assert_eq!(b.blocked_since_ms(), None);
        assert_eq!(shard.in_use(), 90);
        drop(held);
        assert_eq!(shard.in_use(), 0);
        assert!(b.poll_room(&mut noop_cx(), 20, 6).is_ready());
    }

    #[test]
    fn a_delivery_larger_than_the_budget_goes_alone() {
        let gate = SendGate::new(100, SendBudget::new(100));
        assert_eq!(batch_len(&gate, [500, 10].into_iter(), 256), 1);
        let _alone = gate.take(500);
        assert_eq!(batch_len(&gate, [10].into_iter(), 256), 0);
        assert_eq!(gate.high_water(), 500);
    }
}
