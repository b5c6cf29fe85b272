//! A consumer's subscription: the `Consumer` capability the broker delivers to, the bounded
//! local queue it fills, and the `Subscription` capability to ack, nack and touch with.

use std::cell::Cell;
use std::fmt;
use std::rc::Rc;

use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use uuid::Uuid;

use super::{
    AckGroup, AckLevel, Client, ClientError, Delivery, EventKey, Pending, TagResult, WireError,
};
use crate::rpc::pinq_capnp::{consumer, subscription};
use crate::rpc::{self, Field};

/// Local queue length used when the broker's default is asked for (`queue_size` 0); equal to
/// the broker's default `delivery.consumerQueueSize`.
const LOCAL_QUEUE_LEN_DEFAULT: usize = 1024;
/// Upper bound of the local queue, whatever the caller asks for.
const LOCAL_QUEUE_LEN_MAX: usize = 1 << 20;

/// How long [`Subscription::recv`] waits for the broker to tell why a subscription ended.
const WHY_ENDED_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The `Consumer` capability: receives delivery batches and queues them for the application.
pub(super) struct Inbox {
    pub(super) queue: LocalSender<Delivery>,
    /// For a consumer that takes at most N deliveries ([`Subscription::open`]'s `at_most`):
    /// deliveries whose `deliver` call may still return. Once it is spent, calls are held open,
    /// so the broker, at the `queueSize` bound, sends this consumer nothing more: not even a
    /// copy it NACKed, which would otherwise come back to it before it exits. None: unlimited.
    pub(super) returns_left: Rc<Cell<Option<u64>>>,
}

impl Inbox {
    /// Whether the call that carried `count` deliveries may return (spends the budget). A call
    /// that straddles the end of the budget returns too: holding it would leave the calls held
    /// short of the window, and the consumer waiting forever for its last deliveries (the
    /// broker may then send up to `count - 1` more than `n`, which the CLI does not show).
    fn may_return(&self, count: u64) -> bool {
        match self.returns_left.get() {
            None => true,
            Some(left) => {
                self.returns_left.set(Some(left.saturating_sub(count)));
                left > 0
            }
        }
    }
}

impl consumer::Server for Inbox {
    async fn deliver(
        self: capnp::capability::Rc<Self>,
        params: consumer::DeliverParams,
        _: consumer::DeliverResults,
    ) -> Result<(), capnp::Error> {
        let deliveries = rpc::read_deliveries(params.get()?.get_deliveries()?)?;
        drop(params);
        let count = deliveries.len() as u64;
        // Not returning until every delivery is queued is the back-pressure: the broker never
        // has more than the subscription's `queueSize` deliveries in calls not yet returned.
        for delivery in deliveries {
            if self.queue.send(delivery).await.is_err() {
                // The application dropped its `Subscription`; the broker redelivers.
                return Err(capnp::Error::disconnected(
                    "the subscription was dropped by the consumer".into(),
                ));
            }
        }
        if !self.may_return(count) {
            // Held until the subscription or the connection ends (see `returns_left`).
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// A subscription of one consumer. Deliveries are read with [`Subscription::recv`] or
/// [`Subscription::recv_batch`]; each must then be acked, nacked, or left to time out.
/// Dropping it is a disconnect: the broker redelivers what it held.
pub struct Subscription {
    client: Client,
    capability: subscription::Client,
    queue: LocalReceiver<Delivery>,
    consumer_id: Uuid,
    queue_size: u32,
    max_unacked: u32,
    topic: String,
    group: String,
    /// The level of [`Subscription::ack`], [`Subscription::nack`] and ACK groups.
    ack_level: std::cell::Cell<AckLevel>,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("consumer_id", &self.consumer_id)
            .finish_non_exhaustive()
    }
}

/// The reply of `ack`, `nack` or `touch` (each its own capnp results type, all with a
/// `results :List(TagResult)` and a `refusal` field) as a [`Pending`] of one result per tag,
/// checked for count, or the refusal.
macro_rules! tag_results {
    ($promise:expr, $count:expr) => {{
        let promise = $promise;
        Pending::new(async move {
            let reply = promise.await.map_err(ClientError::from_rpc)?;
            let reply = reply.get().map_err(ClientError::bad_reply)?;
            let refusal = reply.get_refusal().map_err(ClientError::bad_reply)?;
            ClientError::rejected(reply.has_refusal(), refusal)?;
            let results = reply.get_results().map_err(ClientError::bad_reply)?;
            checked_results(results, $count)
        })
    }};
}

impl Subscription {
    /// Subscribes. With `at_most = Some(n)` the consumer takes at most `n` deliveries in all
    /// (`queue_size` is then `n` capped at the default): after `n - queueSize` of them its
    /// `deliver` calls no longer return, so the broker never sends it an `n + 1`th copy.
    pub(super) async fn open(
        client: Client,
        topic: &str,
        group: &str,
        queue_size: u32,
        at_most: Option<u64>,
    ) -> Result<Subscription, ClientError> {
        let queue_size = match at_most {
            Some(n) => n.clamp(1, LOCAL_QUEUE_LEN_DEFAULT as u64) as u32,
            None => queue_size,
        };
        let local_len = match queue_size {
            0 => LOCAL_QUEUE_LEN_DEFAULT,
            n => (n as usize).min(LOCAL_QUEUE_LEN_MAX),
        };
        let (sender, queue) = local_channel::new_bounded(local_len);
        // Until the broker says which bound is in force, count with the one asked for.
        let returns_left = Rc::new(Cell::new(
            at_most.map(|n| n.saturating_sub(u64::from(queue_size))),
        ));
        let consumer: consumer::Client = capnp_rpc::new_client(Inbox {
            queue: sender,
            returns_left: Rc::clone(&returns_left),
        });
        let mut request = client.broker().subscribe_request();
        {
            let mut params = request.get();
            params.set_topic(topic);
            params.set_group(group);
            params.set_consumer(consumer);
            params.set_queue_size(queue_size);
        }
        let reply = request
            .send()
            .promise
            .await
            .map_err(ClientError::from_rpc)?;
        let reply = reply.get().map_err(ClientError::bad_reply)?;
        if let Some(not_leader) =
            rpc::cluster::read_not_leader(reply.has_not_leader(), reply.get_not_leader())
                .map_err(ClientError::BadReply)?
        {
            return Err(ClientError::NotLeader(not_leader));
        }
        // A broker that capped the queue below the ask sends less ahead: more calls may return.
        let granted = match reply.get_queue_size() {
            0 => queue_size,
            n => n.min(queue_size),
        };
        if let Some(left) = returns_left.get() {
            returns_left.set(Some(left + u64::from(queue_size - granted)));
        }
        let capability = reply.get_subscription().map_err(ClientError::bad_reply)?;
        let id_bytes = reply.get_consumer_id().map_err(ClientError::bad_reply)?;
        let consumer_id = rpc::read_consumer_id(id_bytes).map_err(ClientError::BadReply)?;
        Ok(Subscription {
            client,
            capability,
            queue,
            consumer_id,
            queue_size: reply.get_queue_size(),
            max_unacked: reply.get_max_unacked(),
            topic: topic.to_owned(),
            group: group.to_owned(),
            ack_level: std::cell::Cell::new(AckLevel::Durable),
        })
    }

    /// Sets the level of later [`Self::ack`] and [`Self::nack`] calls and of ACK groups made
    /// after it (default `durable`: answered once the ACK is committed, so the copy is never
    /// delivered again; `leader`: once the broker accepted it in memory).
    pub fn set_ack_level(&self, level: AckLevel) {
        self.ack_level.set(level);
    }

    pub fn ack_level(&self) -> AckLevel {
        self.ack_level.get()
    }

    /// The `queueSize` in force, as the broker answered: it never has more deliveries than this
    /// queued for this consumer or in `deliver` calls not yet returned (0 from an older broker).
    pub fn queue_size(&self) -> u32 {
        self.queue_size
    }

    /// The unacknowledged copies the broker lets this consumer hold (0 from an older broker).
    pub fn max_unacked(&self) -> u32 {
        self.max_unacked
    }

    /// The consumer's id, as the broker assigned it.
    pub fn consumer_id(&self) -> Uuid {
        self.consumer_id
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The group; empty for a universal consumer.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The connection this subscription lives on.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The next delivery, waiting for one. Once the subscription is over the error says how:
    /// [`ClientError::Disconnected`] when the connection to the broker is gone (the broker
    /// stopped or the network failed), [`ClientError::SubscriptionEnded`] when the broker ended
    /// the subscription on a live connection (its shard changed leader, or it is shutting down).
    pub async fn recv(&self) -> Result<Delivery, ClientError> {
        match self.queue.recv().await {
            Some(delivery) => Ok(delivery),
            None => Err(self.why_ended().await),
        }
    }

    /// The deliveries as a stream, for `StreamExt` combinators; it ends with the subscription
    /// (use [`Subscription::recv`] to learn why). Only one stream may be read at a time.
    pub fn stream(&self) -> impl futures_lite::Stream<Item = Delivery> + '_ {
        self.queue.stream()
    }

    /// Waits for at least one delivery, then takes whatever else is already queued, up to `max`
    /// in all (never empty unless `max` is 0). Errors as [`Subscription::recv`] once the
    /// subscription is over.
    pub async fn recv_batch(&self, max: usize) -> Result<Vec<Delivery>, ClientError> {
        let mut batch = Vec::new();
        if max == 0 {
            return Ok(batch);
        }
        batch.push(self.recv().await?);
        while batch.len() < max {
            match futures_lite::future::poll_once(self.queue.recv()).await {
                Some(Some(delivery)) => batch.push(delivery),
                // Nothing queued right now, or the subscription ended (the next call says so).
                _ => break,
            }
        }
        Ok(batch)
    }

    /// The local queue closed: ask the broker a trivial question to tell a dead connection
    /// from a subscription the broker ended. Bounded by [`WHY_ENDED_TIMEOUT`].
    async fn why_ended(&self) -> ClientError {
        let probe = futures_lite::future::or(async { Some(self.client.topology().await) }, async {
            super::runtime::sleep(WHY_ENDED_TIMEOUT).await;
            None
        })
        .await;
        match probe {
            Some(Ok(_)) => ClientError::SubscriptionEnded {
                topic: self.topic.clone(),
            },
            Some(Err(ClientError::Disconnected(why))) => ClientError::Disconnected(why),
            Some(Err(e)) => ClientError::Disconnected(format!(
                "the subscription to {} ended and the broker does not answer: {e}",
                self.topic
            )),
            None => ClientError::Disconnected(format!(
                "the subscription to {} ended and the broker did not answer within {:?}",
                self.topic, WHY_ENDED_TIMEOUT
            )),
        }
    }

    /// Acknowledges delivered messages; one result per tag, in order.
    pub fn ack(&self, tags: &[EventKey]) -> Pending<Vec<TagResult>> {
        ack_call(&self.capability, tags, self.ack_level.get())
    }

    /// ACKs of this subscription grouped into one call per `window` (or per `max_tags` tags,
    /// 0 meaning [`ACK_GROUP_TAGS_MAX`](super::ACK_GROUP_TAGS_MAX)): fewer round trips for a
    /// consumer that settles messages one by one, at the price of ACKs reaching the broker up
    /// to `window` later. See [`AckGroup`].
    pub fn ack_group(&self, window: std::time::Duration, max_tags: usize) -> AckGroup {
        AckGroup::new(
            self.capability.clone(),
            window,
            max_tags,
            self.ack_level.get(),
        )
    }

    /// Hands delivered messages back for redelivery after `delay_ms` (0: at once).
    pub fn nack(&self, tags: &[EventKey], delay_ms: u64) -> Pending<Vec<TagResult>> {
        let mut request = self.capability.nack_request();
        let Some(count) = tag_count(tags) else {
            return too_many_tags(tags);
        };
        request.get().set_delay_ms(delay_ms);
        request.get().set_level(self.ack_level.get().into());
        rpc::write_tags(request.get().init_tags(count), tags);
        tag_results!(request.send().promise, count)
    }

    /// Extends the lease of delivered messages: their in-flight timeout starts again.
    pub fn touch(&self, tags: &[EventKey]) -> Pending<Vec<TagResult>> {
        let mut request = self.capability.touch_request();
        let Some(count) = tag_count(tags) else {
            return too_many_tags(tags);
        };
        rpc::write_tags(request.get().init_tags(count), tags);
        tag_results!(request.send().promise, count)
    }

    /// Ends the subscription and waits for the broker to confirm. Deliveries still queued
    /// locally are dropped; the broker redelivers everything not acked.
    pub async fn close(self) -> Result<(), ClientError> {
        self.capability
            .close_request()
            .send()
            .promise
            .await
            .map_err(ClientError::from_rpc)?;
        Ok(())
    }
}

/// One `ack` call for `tags` on `capability`.
pub(super) fn ack_call(
    capability: &subscription::Client,
    tags: &[EventKey],
    level: AckLevel,
) -> Pending<Vec<TagResult>> {
    let mut request = capability.ack_request();
    request.get().set_level(level.into());
    let Some(count) = tag_count(tags) else {
        return too_many_tags(tags);
    };
    rpc::write_tags(request.get().init_tags(count), tags);
    tag_results!(request.send().promise, count)
}

fn tag_count(tags: &[EventKey]) -> Option<u32> {
    u32::try_from(tags.len()).ok()
}

fn too_many_tags<T: 'static>(tags: &[EventKey]) -> Pending<T> {
    Pending::failed(ClientError::InvalidRequest(WireError::TooLarge {
        field: Field::top("tags (count)"),
        value: tags.len() as u64,
        max: u64::from(u32::MAX),
    }))
}

fn checked_results(
    results: capnp::enum_list::Reader<'_, TagResult>,
    count: u32,
) -> Result<Vec<TagResult>, ClientError> {
    let results = rpc::read_tag_results(results).map_err(ClientError::BadReply)?;
    if results.len() != count as usize {
        return Err(ClientError::BadReply(WireError::WrongLength {
            field: Field::top("results (count)"),
            len: results.len(),
            expected: count as usize,
        }));
    }
    Ok(results)
}
