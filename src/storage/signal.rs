//! A single-threaded "something changed" broadcast for the engine's tasks: the WAL writer waits
//! for new records, durable writers wait for an fdatasync, stalled writers wait for a flush.
//!
//! Waiters re-check their condition after every wake-up, so a notify never carries data and a
//! spurious wake-up is harmless. Lives on one glommio executor; never crosses threads.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::task::{Poll, Waker};

#[derive(Default)]
pub(crate) struct Signal {
    epoch: Cell<u64>,
    wakers: RefCell<Vec<Waker>>,
}

impl Signal {
    /// Wakes every current waiter.
    pub fn notify(&self) {
        self.epoch.set(self.epoch.get().wrapping_add(1));
        let wakers = std::mem::take(&mut *self.wakers.borrow_mut());
        for waker in wakers {
            waker.wake();
        }
    }

    /// Resolves at the next [`Signal::notify`] after this call.
    pub fn wait(&self) -> impl Future<Output = ()> + '_ {
        let start = self.epoch.get();
        futures_lite::future::poll_fn(move |cx| {
            if self.epoch.get() != start {
                return Poll::Ready(());
            }
            let mut wakers = self.wakers.borrow_mut();
            if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
                wakers.push(cx.waker().clone());
            }
            Poll::Pending
        })
    }
}
