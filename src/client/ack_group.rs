//! Acknowledgment grouping: ACKs given within a short window leave in one `ack` call. A
//! consumer that settles one message at a time otherwise pays the broker a call, a reply and a
//! wake-up per message; grouped, it pays one per window (or per `max_tags` tags, whichever comes
//! first; a group of `max_tags` callers leaves at once too). Each caller still gets its own
//! [`Pending`] with one result per tag it gave.
//!
//! The price is that an ACK reaches the broker up to one window later: a message whose ACK is
//! still waiting here when the connection drops is redelivered, exactly like one whose ACK was
//! lost on the way. Pulsar's client calls this acknowledgment grouping and does it by default;
//! pinq's client does it only when asked ([`Subscription::ack_group`](super::Subscription)).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use futures_channel::oneshot;

use super::{AckLevel, ClientError, EventKey, Pending, Refusal, TagResult, WireError};
use crate::rpc;
use crate::rpc::pinq_capnp::subscription;

/// Most tags one grouped call carries when the caller asks for more (or for 0).
pub const ACK_GROUP_TAGS_MAX: usize = 4096;

type Answer = Result<Vec<TagResult>, ClientError>;

/// One caller's tags inside the open group: where they start, how many, and who waits.
struct Waiter {
    start: usize,
    len: usize,
    answer: oneshot::Sender<Answer>,
}

/// The group being filled.
#[derive(Default)]
struct Open {
    tags: Vec<EventKey>,
    waiters: Vec<Waiter>,
    /// Bumped at every flush, so a timer armed for an earlier group does nothing.
    generation: u64,
    /// Whether a timer will flush the current group.
    armed: bool,
}

/// ACKs of one subscription, grouped for up to `window` or `max_tags` tags. Made by
/// [`Subscription::ack_group`](super::Subscription::ack_group); every handle must stay on the
/// executor that made it (it spawns its timers there). It holds the subscription's capability:
/// ACKs sent through it after the `Subscription` is dropped still reach the broker if the
/// connection is open.
#[derive(Clone)]
pub struct AckGroup {
    capability: subscription::Client,
    window: Duration,
    max_tags: usize,
    level: AckLevel,
    open: Rc<RefCell<Open>>,
}

impl AckGroup {
    pub(super) fn new(
        capability: subscription::Client,
        window: Duration,
        max_tags: usize,
        level: AckLevel,
    ) -> Self {
        let max_tags = match max_tags {
            0 => ACK_GROUP_TAGS_MAX,
            n => n.min(ACK_GROUP_TAGS_MAX),
        };
        AckGroup {
            capability,
            window,
            max_tags,
            level,
            open: Rc::default(),
        }
    }

    /// Acknowledges `tags` with the next grouped call: one result per tag, in order, once the
    /// broker has answered the group. A zero window sends at once, like `Subscription::ack`.
    pub fn ack(&self, tags: &[EventKey]) -> Pending<Vec<TagResult>> {
        let (answer, reply) = oneshot::channel();
        let full = {
            let mut open = self.open.borrow_mut();
            let start = open.tags.len();
            open.tags.extend_from_slice(tags);
            open.waiters.push(Waiter {
                start,
                len: tags.len(),
                answer,
            });
            // Callers count too: empty ACKs must not pile up waiters for a whole window.
            open.tags.len() >= self.max_tags
                || open.waiters.len() >= self.max_tags
                || self.window.is_zero()
        };
        if full {
            self.flush();
        } else {
            self.arm();
        }
        Pending::new(async move {
            reply.await.unwrap_or_else(|_| {
                Err(ClientError::Disconnected(
                    "the grouped ack was dropped before it was sent".into(),
                ))
            })
        })
    }

    /// Sends whatever the open group holds now.
    pub fn flush(&self) {
        let (tags, waiters) = {
            let mut open = self.open.borrow_mut();
            open.generation = open.generation.wrapping_add(1);
            open.armed = false;
            (
                std::mem::take(&mut open.tags),
                std::mem::take(&mut open.waiters),
            )
        };
        if waiters.is_empty() {
            return;
        }
        let reply = super::subscription::ack_call(&self.capability, &tags, self.level);
        super::runtime::spawn_local(async move { answer(waiters, reply.await) }).detach();
    }

    /// Starts the window's timer unless one already runs for the open group.
    fn arm(&self) {
        let generation = {
            let mut open = self.open.borrow_mut();
            if open.armed {
                return;
            }
            open.armed = true;
            open.generation
        };
        let group = self.clone();
        super::runtime::spawn_local(async move {
            super::runtime::sleep(group.window).await;
            if group.open.borrow().generation == generation {
                group.flush();
            }
        })
        .detach();
    }
}

/// Hands each waiter its slice of the group's answer (or its share of the group's failure).
fn answer(waiters: Vec<Waiter>, result: Answer) {
    for waiter in waiters {
        let share = match &result {
            Ok(results) => results
                .get(waiter.start..waiter.start + waiter.len)
                .map(<[TagResult]>::to_vec)
                .ok_or_else(|| short_reply(results.len(), waiter.start + waiter.len)),
            Err(e) => Err(share_error(e, &waiter)),
        };
        let _ = waiter.answer.send(share);
    }
}

fn short_reply(len: usize, expected: usize) -> ClientError {
    ClientError::BadReply(WireError::WrongLength {
        field: rpc::Field::top("results (count)"),
        len,
        expected,
    })
}

/// The group's failure as one waiter sees it: a typed refusal keeps its code, with the index
/// moved into the waiter's own tags (or dropped when it named another caller's tag); every
/// other error keeps its kind and text.
fn share_error(e: &ClientError, waiter: &Waiter) -> ClientError {
    match e {
        ClientError::Rejected(refusal) => {
            let index = refusal.index.and_then(|i| {
                let i = usize::try_from(i).ok()?;
                let own = i.checked_sub(waiter.start).filter(|&o| o < waiter.len)?;
                u32::try_from(own).ok()
            });
            ClientError::Rejected(Refusal {
                index,
                ..refusal.clone()
            })
        }
        ClientError::Refused(text) => ClientError::Refused(text.clone()),
        ClientError::Overloaded(text) => ClientError::Overloaded(text.clone()),
        ClientError::Disconnected(text) => ClientError::Disconnected(text.clone()),
        ClientError::Unimplemented(text) => ClientError::Unimplemented(text.clone()),
        other => ClientError::BadReply(WireError::Capnp(capnp::Error::failed(other.to_string()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::refusal::Code;

    fn waiter(start: usize, len: usize) -> Waiter {
        Waiter {
            start,
            len,
            answer: oneshot::channel().0,
        }
    }

    fn refused_at(index: Option<u32>) -> ClientError {
        ClientError::Rejected(Refusal {
            code: Code::SubscriptionClosed,
            index,
            message: "closed".into(),
            retryable: false,
        })
    }

    #[test]
    fn a_refusal_names_the_index_inside_the_callers_own_tags_or_none() {
        let e = refused_at(Some(5));
        assert_eq!(share_error(&e, &waiter(4, 3)).refused_index(), Some(1));
        assert_eq!(share_error(&e, &waiter(0, 5)).refused_index(), None);
        assert_eq!(share_error(&e, &waiter(6, 2)).refused_index(), None);
        assert_eq!(
            share_error(&e, &waiter(6, 2)).refusal(),
            Some(Code::SubscriptionClosed)
        );
        assert_eq!(
            share_error(&refused_at(None), &waiter(0, 9)).refused_index(),
            None
        );
    }

    #[test]
    fn other_failures_keep_their_kind_and_text() {
        let shared = share_error(&ClientError::Disconnected("gone".into()), &waiter(0, 1));
        assert!(matches!(shared, ClientError::Disconnected(t) if t == "gone"));
        let shared = share_error(&ClientError::Overloaded("busy".into()), &waiter(0, 1));
        assert!(matches!(shared, ClientError::Overloaded(t) if t == "busy"));
    }
}
