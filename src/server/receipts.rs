//! Which `deliver` calls of one connection the client has not answered yet, and since when; and
//! the reset that ends a connection whose client stopped answering them.
//!
//! A copy's in-flight lease starts when its consumer answers the `deliver` call that carried it
//! (`crate::pipeline::inflight::CopyState::Held`). Until then the copy is not handed to anyone
//! else: it may still be on its way (in this process's buffers, the kernel's send queue, or a
//! network that is cut and will heal), and a copy that reached its first consumer after a
//! second consumer ACKed it would be delivered twice. A call unanswered for
//! `server.deliverTimeout` means the client or its network is stuck: the connection is then
//! reset with a TCP RST ([`reset`]), which discards every byte still queued for the client, so
//! the copies it held, released at once to other consumers as a disconnect, can never also
//! arrive here late.
//!
//! The same reset ends a connection whose unanswered calls were handed out by a shard that
//! stopped serving (it lost its leadership: [`Receipts::revoke`]). A new leader knows nothing of
//! them and hands their copies to other consumers; a call still in the old leader's send queue
//! behind a cut network would otherwise reach its client when the cut heals, after another
//! consumer's durable ACK of the same message was answered `ok`.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::rc::Rc;

/// The unanswered `deliver` calls of one connection: call number → when it was sent (ms).
/// Bounded by the connection's subscriptions × their windows (the owner never sends more).
#[derive(Default)]
pub struct Receipts {
    next: Cell<u64>,
    outstanding: RefCell<BTreeMap<u64, u64>>,
    /// A shard that handed out deliveries on this connection stopped serving them.
    revoked: Cell<bool>,
    /// Wakes the connection's watch when `revoked` is set.
    revoked_signal: crate::storage::signal::Signal,
}

/// One `deliver` call awaiting its answer; dropping it (answered, failed or abandoned) takes
/// it off the list.
pub struct Awaiting {
    receipts: Rc<Receipts>,
    call: u64,
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.receipts.outstanding.borrow_mut().remove(&self.call);
    }
}

impl Receipts {
    /// Notes a `deliver` call sent at `now_ms`.
    pub fn sent(self: &Rc<Self>, now_ms: u64) -> Awaiting {
        let call = self.next.get();
        self.next.set(call + 1);
        self.outstanding.borrow_mut().insert(call, now_ms);
        Awaiting {
            receipts: self.clone(),
            call,
        }
    }

    /// How long the oldest unanswered call has waited at `now_ms` (calls are numbered in the
    /// order they were sent, so the lowest number is the oldest).
    pub fn oldest_wait_ms(&self, now_ms: u64) -> Option<u64> {
        let outstanding = self.outstanding.borrow();
        let (_, sent_ms) = outstanding.first_key_value()?;
        Some(now_ms.saturating_sub(*sent_ms))
    }

    /// Whether a call has gone unanswered for `timeout_ms` or more at `now_ms`.
    pub fn overdue(&self, now_ms: u64, timeout_ms: u64) -> bool {
        self.oldest_wait_ms(now_ms)
            .is_some_and(|waited| waited >= timeout_ms)
    }

    /// A shard whose deliveries travel on this connection stopped serving them (it lost its
    /// leadership): if calls are unanswered, the connection's watch resets it at once.
    pub fn revoke(&self) {
        if !self.is_empty() {
            self.revoked.set(true);
            self.revoked_signal.notify();
        }
    }

    /// Whether calls are unanswered after a [`Receipts::revoke`] (the flag is cleared once every
    /// call was answered: nothing is then on its way).
    pub fn revoked_with_calls_out(&self) -> bool {
        if self.is_empty() {
            self.revoked.set(false);
        }
        self.revoked.get()
    }

    /// Resolves at the next [`Receipts::revoke`] that found calls unanswered.
    pub fn revoked(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.revoked_signal.wait()
    }

    /// Calls awaiting their answer.
    pub fn len(&self) -> usize {
        self.outstanding.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Makes the socket `fd` end with a TCP RST when it is closed (`SO_LINGER` on, 0 s): the
/// kernel discards what is still queued for the peer instead of sending it. The caller closes
/// the socket right after (drops the connection). A failure is returned, never fatal: the
/// connection still closes, only less abruptly.
pub fn reset(fd: RawFd) -> std::io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `fd` is the open socket of the connection being closed (the caller holds the
    // stream that owns it), and the option value is a `linger` of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::from_ref(&linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revoke_counts_only_while_calls_are_unanswered() {
        let receipts = Rc::new(Receipts::default());
        receipts.revoke();
        assert!(!receipts.revoked_with_calls_out(), "nothing was out");
        let call = receipts.sent(100);
        assert!(!receipts.revoked_with_calls_out());
        receipts.revoke();
        assert!(receipts.revoked_with_calls_out());
        drop(call);
        assert!(!receipts.revoked_with_calls_out(), "the call was answered");
        let _later = receipts.sent(200);
        assert!(
            !receipts.revoked_with_calls_out(),
            "a call sent after every earlier one was answered is not revoked"
        );
    }

    #[test]
    fn the_oldest_unanswered_call_decides_and_answered_calls_leave() {
        let receipts = Rc::new(Receipts::default());
        assert!(!receipts.overdue(1_000_000, 1));
        let first = receipts.sent(100);
        let second = receipts.sent(400);
        assert_eq!(receipts.oldest_wait_ms(500), Some(400));
        assert!(receipts.overdue(600, 500));
        assert!(!receipts.overdue(599, 500));
        drop(first);
        assert_eq!(receipts.oldest_wait_ms(500), Some(100));
        assert!(!receipts.overdue(600, 500));
        assert!(receipts.overdue(900, 500));
        drop(second);
        assert!(receipts.is_empty());
        assert!(!receipts.overdue(u64::MAX, 1));
    }

    #[test]
    fn reset_sets_a_zero_linger_on_a_socket() {
        use std::os::fd::AsRawFd as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let stream = std::net::TcpStream::connect(listener.local_addr().unwrap()).expect("conn");
        reset(stream.as_raw_fd()).expect("setsockopt");
        let mut linger = libc::linger {
            l_onoff: 0,
            l_linger: 7,
        };
        let mut len = std::mem::size_of::<libc::linger>() as libc::socklen_t;
        // SAFETY: reads the option into a `linger` of the size passed.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                std::ptr::from_mut(&mut linger).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        assert_eq!((linger.l_onoff, linger.l_linger), (1, 0));
        assert!(
            reset(-1).is_err(),
            "a bad descriptor is an error, not a panic"
        );
    }
}
