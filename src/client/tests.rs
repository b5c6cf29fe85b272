//! The client against a small fake broker that implements `schema/pinq.capnp` over real TCP on
//! 127.0.0.1, on one glommio executor. The fake keeps the protocol's contracts (atomic validated
//! batches, one tag per message, per-tag results, streaming deliveries, disconnect on drop) with
//! none of the real broker's storage or dispatch.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use capnp::capability::Rc as CapRc;
use capnp_rpc::rpc_twoparty_capnp::Side;
use capnp_rpc::{twoparty, RpcSystem};
use futures_lite::io::{BufReader, BufWriter};
use glommio::channels::local_channel::{self, LocalSender};
use glommio::net::TcpListener;

use super::subscription::Inbox;
use super::*;
use crate::config::PublishConfig;
use crate::key::TopicHash;
use crate::message::StoredMessage;
use crate::rpc::pinq_capnp::{broker, consumer, subscription};
use crate::rpc::{OutgoingDelivery, PublishLimits};

// ---------------------------------------------------------------------------------------------
// The fake broker

#[derive(Default)]
struct BrokerState {
    next_event_id: u64,
    next_consumer_id: u128,
    subscribers: Vec<Rc<FakeSubscription>>,
    /// Tags acked by anyone (one recipient only in this fake).
    acked: HashSet<EventKey>,
    /// Subscriptions whose capability was released by the client.
    disconnects: usize,
    publish_batches: usize,
    ack_calls: usize,
}

struct FakeBroker {
    state: Rc<RefCell<BrokerState>>,
    port: u16,
    server_version: u32,
}

/// One subscription: messages waiting to go out, and those in flight.
struct FakeSubscription {
    topic: String,
    pending: RefCell<VecDeque<(EventKey, Rc<StoredMessage>, u32)>>,
    in_flight: RefCell<HashMap<EventKey, (Rc<StoredMessage>, u32)>>,
    wake: LocalSender<()>,
    closed: RefCell<bool>,
    state: Rc<RefCell<BrokerState>>,
}

impl FakeSubscription {
    fn push(&self, key: EventKey, message: Rc<StoredMessage>, attempt: u32) {
        self.pending.borrow_mut().push_back((key, message, attempt));
        let _ = self.wake.try_send(());
    }

    fn close(&self) {
        *self.closed.borrow_mut() = true;
        let _ = self.wake.try_send(());
    }
}

/// Sends a subscription's pending messages to its consumer in streaming batches.
async fn pump(
    sub: Rc<FakeSubscription>,
    consumer: consumer::Client,
    wake: local_channel::LocalReceiver<()>,
) {
    loop {
        if *sub.closed.borrow() {
            return;
        }
        let batch: Vec<(EventKey, Rc<StoredMessage>, u32)> = {
            let mut pending = sub.pending.borrow_mut();
            let n = pending.len().min(16);
            pending.drain(..n).collect()
        };
        if batch.is_empty() {
            if wake.recv().await.is_none() {
                return;
            }
            continue;
        }
        let mut request = consumer.deliver_request();
        {
            let outgoing: Vec<OutgoingDelivery<'_, StoredMessage>> = batch
                .iter()
                .map(|(tag, message, attempt)| OutgoingDelivery {
                    tag: *tag,
                    message: message.as_ref(),
                    attempt: *attempt,
                })
                .collect();
            let list = request.get().init_deliveries(outgoing.len() as u32);
            rpc::write_deliveries(list, &outgoing);
        }
        {
            let mut in_flight = sub.in_flight.borrow_mut();
            for (tag, message, attempt) in &batch {
                in_flight.insert(*tag, (message.clone(), *attempt));
            }
        }
        if request.send().promise.await.is_err() {
            sub.close();
            return;
        }
    }
}

impl broker::Server for FakeBroker {
    async fn hello(
        self: CapRc<Self>,
        params: broker::HelloParams,
        mut results: broker::HelloResults,
    ) -> Result<(), capnp::Error> {
        let client_version = params.get()?.get_client_version();
        if client_version == 0 {
            return Err(capnp::Error::failed(
                "clientVersion 0 is not a version".into(),
            ));
        }
        // A fake of protocol 1 only refuses newer clients, as such a broker does.
        if self.server_version == 1 && client_version > 1 {
            return Err(crate::rpc::refusal::Code::UnsupportedVersion.error(format!(
                "this broker speaks 1, not clientVersion {client_version}"
            )));
        }
        let mut reply = results.get();
        reply.set_server_version(self.server_version);
        reply.set_shard_count(1);
        reply.set_shard_id(crate::rpc::ANY_SHARD);
        Ok(())
    }

    async fn publish(
        self: CapRc<Self>,
        params: broker::PublishParams,
        mut results: broker::PublishResults,
    ) -> Result<(), capnp::Error> {
        let params = params.get()?;
        let _ack = rpc::read_ack_level(params.get_ack_level())?;
        let limits = PublishLimits::from(&PublishConfig::default());
        // Validate the whole batch before writing anything: batches are atomic. A refusal goes
        // in the results, as protocol 2 has it.
        let batch = match rpc::read_publish_batch(params.get_messages()?, &limits) {
            Ok(batch) => batch,
            Err(e) => {
                e.refusal()?.write(results.get().init_refusal());
                return Ok(());
            }
        };
        let mut state = self.state.borrow_mut();
        state.publish_batches += 1;
        let mut tags = Vec::with_capacity(batch.len());
        for message in &batch {
            state.next_event_id += 1;
            let key = EventKey::new(TopicHash::of(message.topic), 0, state.next_event_id);
            let stored = Rc::new(message.to_stored(1_000));
            for sub in &state.subscribers {
                if sub.topic == message.topic && !*sub.closed.borrow() {
                    sub.push(key, stored.clone(), 1);
                }
            }
            tags.push(key);
        }
        rpc::write_tags(results.get().init_tags(tags.len() as u32), &tags);
        Ok(())
    }

    async fn subscribe(
        self: CapRc<Self>,
        params: broker::SubscribeParams,
        mut results: broker::SubscribeResults,
    ) -> Result<(), capnp::Error> {
        let params = params.get()?;
        let topic = params.get_topic()?.to_str()?.to_owned();
        crate::key::validate_topic(&topic)
            .map_err(|e| capnp::Error::failed(format!("topic: {e}")))?;
        let consumer = params.get_consumer()?;
        let (wake, wake_rx) = local_channel::new_bounded(1);
        let sub = Rc::new(FakeSubscription {
            topic,
            pending: RefCell::default(),
            in_flight: RefCell::default(),
            wake,
            closed: RefCell::new(false),
            state: self.state.clone(),
        });
        let id = {
            let mut state = self.state.borrow_mut();
            state.next_consumer_id += 1;
            state.subscribers.push(sub.clone());
            state.next_consumer_id
        };
        glommio::spawn_local(pump(sub.clone(), consumer, wake_rx)).detach();
        let mut reply = results.get();
        reply.set_subscription(capnp_rpc::new_client(SubscriptionHandle { sub }));
        reply.set_consumer_id(uuid::Uuid::from_u128(id).as_bytes());
        Ok(())
    }

    fn topology(
        self: CapRc<Self>,
        _: broker::TopologyParams,
        mut results: broker::TopologyResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        let shards = [ShardInfo {
            shard_id: 0,
            host: "127.0.0.1".into(),
            port: self.port,
            cpu: 0,
            ..ShardInfo::default()
        }];
        rpc::write_topology(results.get().init_shards(1), &shards);
        std::future::ready(Ok(()))
    }

    fn stats(
        self: CapRc<Self>,
        _: broker::StatsParams,
        mut results: broker::StatsResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        let state = self.state.borrow();
        let stats = Stats {
            shards: vec![ShardStats {
                shard_id: 0,
                published: state.next_event_id,
                acked: state.acked.len() as u64,
                active_consumers: state.subscribers.len() as u64,
                ..ShardStats::default()
            }],
            groups: Vec::new(),
            topics: Vec::new(),
        };
        std::future::ready(rpc::write_stats(results.get().init_stats(), &stats).map_err(Into::into))
    }

    async fn forget_group(
        self: CapRc<Self>,
        params: broker::ForgetGroupParams,
        _: broker::ForgetGroupResults,
    ) -> Result<(), capnp::Error> {
        if params.get()?.get_group()?.as_bytes().is_empty() {
            return Err(capnp::Error::failed("forgetGroup: group is empty".into()));
        }
        Ok(())
    }
}

/// The `Subscription` capability of one fake subscription.
struct SubscriptionHandle {
    sub: Rc<FakeSubscription>,
}

impl SubscriptionHandle {
    fn settle(
        &self,
        tags: capnp::data_list::Reader<'_>,
        mut on_held: impl FnMut(EventKey, Rc<StoredMessage>, u32) -> bool,
    ) -> Vec<TagResult> {
        (0..tags.len())
            .map(|i| {
                let Ok(tag) = rpc::parse_tag(tags, i) else {
                    return TagResult::Malformed;
                };
                let held = self.sub.in_flight.borrow().get(&tag).cloned();
                match held {
                    Some((message, attempt)) => {
                        if on_held(tag, message, attempt) {
                            self.sub.in_flight.borrow_mut().remove(&tag);
                        }
                        TagResult::Ok
                    }
                    None if self.sub.state.borrow().acked.contains(&tag) => TagResult::AlreadyAcked,
                    None => TagResult::UnknownTag,
                }
            })
            .collect()
    }
}

impl Drop for SubscriptionHandle {
    fn drop(&mut self) {
        // Releasing the capability is a disconnect.
        self.sub.close();
        self.sub.state.borrow_mut().disconnects += 1;
    }
}

impl subscription::Server for SubscriptionHandle {
    async fn ack(
        self: CapRc<Self>,
        params: subscription::AckParams,
        mut results: subscription::AckResults,
    ) -> Result<(), capnp::Error> {
        let tags = params.get()?.get_tags()?;
        let state = self.sub.state.clone();
        state.borrow_mut().ack_calls += 1;
        let outcome = self.settle(tags, |tag, _, _| {
            state.borrow_mut().acked.insert(tag);
            true
        });
        rpc::write_tag_results(results.get().init_results(outcome.len() as u32), &outcome);
        Ok(())
    }

    async fn nack(
        self: CapRc<Self>,
        params: subscription::NackParams,
        mut results: subscription::NackResults,
    ) -> Result<(), capnp::Error> {
        let tags = params.get()?.get_tags()?;
        let sub = self.sub.clone();
        let outcome = self.settle(tags, |tag, message, attempt| {
            sub.push(tag, message, attempt + 1);
            true
        });
        rpc::write_tag_results(results.get().init_results(outcome.len() as u32), &outcome);
        Ok(())
    }

    async fn touch(
        self: CapRc<Self>,
        params: subscription::TouchParams,
        mut results: subscription::TouchResults,
    ) -> Result<(), capnp::Error> {
        let tags = params.get()?.get_tags()?;
        let outcome = self.settle(tags, |_, _, _| false);
        rpc::write_tag_results(results.get().init_results(outcome.len() as u32), &outcome);
        Ok(())
    }

    fn close(
        self: CapRc<Self>,
        _: subscription::CloseParams,
        _: subscription::CloseResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.sub.close();
        std::future::ready(Ok(()))
    }
}

/// Starts the fake broker on an ephemeral port of 127.0.0.1; returns its address and state.
fn start_fake_broker(server_version: u32) -> (String, Rc<RefCell<BrokerState>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let local = listener.local_addr().unwrap();
    let addr = local.to_string();
    let state = Rc::new(RefCell::new(BrokerState::default()));
    let broker: broker::Client = capnp_rpc::new_client(FakeBroker {
        state: state.clone(),
        port: local.port(),
        server_version,
    });
    glommio::spawn_local(async move {
        while let Ok(stream) = listener.accept().await {
            let (reader, writer) = futures_lite::io::split(stream);
            let network = twoparty::VatNetwork::new(
                BufReader::new(reader),
                BufWriter::new(writer),
                Side::Server,
                capnp::message::ReaderOptions::new(),
            );
            let rpc_system = RpcSystem::new(Box::new(network), Some(broker.clone().client));
            glommio::spawn_local(rpc_system).detach();
        }
    })
    .detach();
    (addr, state)
}

/// Runs a test body on a fresh glommio executor.
fn run<F, Fut>(body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    glommio::LocalExecutorBuilder::default()
        .spawn(body)
        .unwrap()
        .join()
        .unwrap();
}

/// Fails the test instead of hanging when an awaited event never comes.
async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    match glommio::timer::timeout(Duration::from_secs(10), async { Ok(future.await) }).await {
        Ok(value) => value,
        Err(_) => panic!("timed out waiting for {what}"),
    }
}

fn message(topic: &str, payload: &str) -> PublishMessage {
    PublishMessage::new(topic, payload.as_bytes().to_vec())
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn connect_does_the_handshake_and_reports_the_server() {
    run(|| async {
        let (addr, _) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = within("connect", Client::connect(addr.as_str()))
            .await
            .unwrap();
        assert_eq!(
            client.server(),
            ServerInfo {
                protocol_version: crate::rpc::PROTOCOL_VERSION,
                shard_count: 1,
                shard_id: None,
            }
        );
        let shards = within("topology", client.topology()).await.unwrap();
        assert_eq!(shards.len(), 1);
        assert_eq!(format!("{}:{}", shards[0].host, shards[0].port), addr);
        // One shard owns every topic: the owner's port is the one listed.
        let direct = within("owner", client.connect_to_owner("orders"))
            .await
            .unwrap();
        assert_eq!(direct.server().shard_count, 1);
        direct.close().await.unwrap();
        client.close().await.unwrap();
    });
}

#[test]
fn a_broker_of_another_protocol_version_is_refused() {
    run(|| async {
        let (addr, _) = start_fake_broker(crate::rpc::PROTOCOL_VERSION + 1);
        match within("connect", Client::connect(addr.as_str())).await {
            Err(ClientError::VersionMismatch { server, client }) => {
                assert_eq!(server, crate::rpc::PROTOCOL_VERSION + 1);
                assert_eq!(client, crate::rpc::PROTOCOL_VERSION);
            }
            other => panic!("expected a version mismatch, got {other:?}"),
        }
    });
}

#[test]
fn a_broker_of_protocol_1_only_is_spoken_to_in_version_1() {
    run(|| async {
        let (addr, _) = start_fake_broker(1);
        let client = within("connect", Client::connect(addr.as_str()))
            .await
            .unwrap();
        assert_eq!(client.server().protocol_version, 1);
        let tags = client
            .publish(vec![message("orders", "ok")], AckLevel::Durable)
            .await
            .unwrap();
        assert_eq!(tags.len(), 1);
    });
}

#[test]
fn connecting_to_a_closed_port_fails_with_the_address() {
    run(|| async {
        // Bind and drop a listener to find a port nobody listens on.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        match within("connect", Client::connect(addr.as_str())).await {
            Err(ClientError::Connect { addr: named, .. }) => assert_eq!(named, addr),
            other => panic!("expected a connect error, got {other:?}"),
        }
    });
}

#[test]
fn publish_returns_one_tag_per_message_in_order() {
    run(|| async {
        let (addr, state) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        let batch = vec![
            message("orders", "a"),
            message("orders", "b"),
            message("other", "c"),
        ];
        let tags = within("publish", client.publish(&batch, AckLevel::Durable))
            .await
            .unwrap();
        assert_eq!(tags.len(), 3);
        assert_eq!(
            tags.iter().map(|t| t.event_id()).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(tags[0].topic_hash(), TopicHash::of("orders"));
        assert_eq!(tags[2].topic_hash(), TopicHash::of("other"));
        let empty = client.publish(Vec::new(), AckLevel::None).await.unwrap();
        assert!(empty.is_empty());
        let stats = within("stats", client.stats()).await.unwrap();
        assert_eq!(stats.shards[0].published, 3);
        assert_eq!(state.borrow().publish_batches, 2);
    });
}

#[test]
fn a_refused_batch_reports_the_brokers_reason_and_writes_nothing() {
    run(|| async {
        let (addr, state) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        let batch = vec![message("orders", "fine"), message("", "no topic")];
        match within("publish", client.publish(batch, AckLevel::Durable)).await {
            Err(ClientError::Rejected(refusal)) => {
                assert_eq!(refusal.code, RefusalCode::InvalidTopic);
                assert_eq!(refusal.index, Some(1));
                assert_eq!(refusal.message, "messages[1].topic: topic name is empty");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(state.borrow().next_event_id, 0);
        // The connection is still usable after a refused call.
        let tags = client
            .publish(vec![message("orders", "ok")], AckLevel::Durable)
            .await
            .unwrap();
        assert_eq!(tags.len(), 1);
        // A delay the protocol cannot carry is refused before anything is sent.
        let mut too_late = message("orders", "x");
        too_late.delay_ms = u64::MAX;
        assert!(matches!(
            client.publish(vec![too_late], AckLevel::Durable).await,
            Err(ClientError::InvalidRequest(_))
        ));
        assert!(matches!(
            client.forget_group("orders", "").await,
            Err(ClientError::Refused(_))
        ));
        client.forget_group("orders", "billing").await.unwrap();
    });
}

#[test]
fn subscribe_receives_published_messages_and_acks_each_once() {
    run(|| async {
        let (addr, _) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        let sub = within("subscribe", client.subscribe("orders", "billing", 16))
            .await
            .unwrap();
        assert_eq!(sub.consumer_id(), uuid::Uuid::from_u128(1));
        assert_eq!((sub.topic(), sub.group()), ("orders", "billing"));
        let mut with_header = message("orders", "c");
        with_header.headers.push(Header {
            key: "trace".into(),
            value: b"42".to_vec(),
        });
        let tags = client
            .publish(
                vec![
                    message("orders", "a"),
                    message("other", "skip"),
                    message("orders", "b"),
                    with_header,
                ],
                AckLevel::Leader,
            )
            .await
            .unwrap();
        let mut got = Vec::new();
        while got.len() < 3 {
            got.extend(within("deliveries", sub.recv_batch(8)).await.unwrap());
        }
        assert_eq!(
            got.iter().map(|d| d.payload.as_slice()).collect::<Vec<_>>(),
            vec![b"a".as_slice(), b"b", b"c"]
        );
        assert_eq!(got[0].tag, tags[0]);
        assert_eq!(got[2].tag, tags[3]);
        assert_eq!(got[2].headers.len(), 1);
        assert!(got.iter().all(|d| d.attempt == 1 && d.topic == "orders"));
        let delivered: Vec<EventKey> = got.iter().map(|d| d.tag).collect();
        assert_eq!(
            within("touch", sub.touch(&delivered[..1])).await.unwrap(),
            vec![TagResult::Ok]
        );
        assert_eq!(
            within("ack", sub.ack(&delivered)).await.unwrap(),
            vec![TagResult::Ok; 3]
        );
        // Acked once: a second ack is refused per tag, as is a tag never delivered.
        let results = sub.ack(&[delivered[0], tags[1]]).await.unwrap();
        assert_eq!(
            results,
            vec![TagResult::AlreadyAcked, TagResult::UnknownTag]
        );
        let stats = client.stats().await.unwrap();
        assert_eq!(stats.shards[0].acked, 3);
        within("close", sub.close()).await.unwrap();
    });
}

#[test]
fn grouped_acks_leave_in_one_call_and_each_caller_gets_its_own_results() {
    run(|| async {
        let (addr, state) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        let sub = within("subscribe", client.subscribe("orders", "g", 16))
            .await
            .unwrap();
        let batch: Vec<_> = ["a", "b", "c", "d", "e", "f"]
            .iter()
            .map(|p| message("orders", p))
            .collect();
        let published = client.publish(batch, AckLevel::Leader).await.unwrap();
        let mut got = Vec::new();
        while got.len() < 6 {
            got.extend(within("deliveries", sub.recv_batch(8)).await.unwrap());
        }
        let t: Vec<EventKey> = got.iter().map(|d| d.tag).collect();

        // Three callers inside one window: one call, each answered with its own slice.
        let group = sub.ack_group(Duration::from_millis(50), 0);
        let first = group.ack(&t[..1]);
        let second = group.ack(&t[1..3]);
        let third = group.ack(&[t[3], published[0]]);
        assert_eq!(within("first", first).await.unwrap(), vec![TagResult::Ok]);
        assert_eq!(
            within("second", second).await.unwrap(),
            vec![TagResult::Ok; 2]
        );
        assert_eq!(
            within("third", third).await.unwrap(),
            vec![TagResult::Ok, TagResult::AlreadyAcked]
        );
        assert_eq!(state.borrow().ack_calls, 1);

        // Reaching max_tags sends at once: an hour's window is never waited for.
        let group = sub.ack_group(Duration::from_secs(3600), 2);
        let fourth = group.ack(&t[4..5]);
        let fifth = group.ack(&t[5..6]);
        assert_eq!(within("fourth", fourth).await.unwrap(), vec![TagResult::Ok]);
        assert_eq!(within("fifth", fifth).await.unwrap(), vec![TagResult::Ok]);
        assert_eq!(state.borrow().ack_calls, 2);
        assert_eq!(client.stats().await.unwrap().shards[0].acked, 6);

        // Callers count against max_tags too: empty ACKs do not wait out the window.
        let group = sub.ack_group(Duration::from_secs(3600), 2);
        let (empty, again) = (group.ack(&[]), group.ack(&[]));
        assert_eq!(within("empty", empty).await.unwrap(), Vec::new());
        assert_eq!(within("again", again).await.unwrap(), Vec::new());
        assert_eq!(state.borrow().ack_calls, 3);
    });
}

#[test]
fn nack_brings_the_message_back_with_the_next_attempt() {
    run(|| async {
        let (addr, _) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        let sub = client.subscribe("jobs", "", 0).await.unwrap();
        client
            .publish(vec![message("jobs", "work")], AckLevel::Durable)
            .await
            .unwrap();
        let first = within("first delivery", sub.recv()).await.unwrap();
        assert_eq!(first.attempt, 1);
        assert_eq!(
            sub.nack(&[first.tag], 0).await.unwrap(),
            vec![TagResult::Ok]
        );
        use futures_lite::StreamExt;
        let again = within("redelivery", sub.stream().next()).await.unwrap();
        assert_eq!((again.tag, again.attempt), (first.tag, 2));
        assert_eq!(sub.ack(&[again.tag]).await.unwrap(), vec![TagResult::Ok]);
    });
}

#[test]
fn a_consumer_that_stops_reading_loses_nothing_and_keeps_order() {
    run(|| async {
        let (addr, _) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        // A local queue of 4 against 300 messages: the broker's deliver calls wait for room.
        let sub = client.subscribe("orders", "g", 4).await.unwrap();
        let batch: Vec<PublishMessage> = (0..300)
            .map(|i| message("orders", &i.to_string()))
            .collect();
        client.publish(batch, AckLevel::None).await.unwrap();
        glommio::timer::sleep(Duration::from_millis(50)).await;
        let mut got = Vec::new();
        while got.len() < 300 {
            let batch = within("deliveries", sub.recv_batch(64)).await.unwrap();
            assert!(batch.len() <= 64);
            got.extend(batch);
        }
        let expected: Vec<Vec<u8>> = (0..300).map(|i: i32| i.to_string().into_bytes()).collect();
        assert_eq!(
            got.into_iter().map(|d| d.payload).collect::<Vec<_>>(),
            expected
        );
    });
}

#[test]
fn publisher_keeps_at_most_window_batches_in_flight_and_answers_in_order() {
    run(|| async {
        let (addr, state) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        let mut publisher = Publisher::new(&client, AckLevel::Durable, 4);
        let mut answered = Vec::new();
        for b in 0..20 {
            let batch: Vec<PublishMessage> = (0..10)
                .map(|i| message("orders", &format!("{b}/{i}")))
                .collect();
            if let Some(tags) = within("send", publisher.send(batch)).await.unwrap() {
                answered.push(tags);
            }
            assert!(publisher.in_flight() <= 4);
        }
        assert_eq!(answered.len(), 16);
        answered.extend(within("flush", publisher.flush()).await.unwrap());
        assert_eq!(publisher.in_flight(), 0);
        let ids: Vec<u64> = answered.iter().flatten().map(|t| t.event_id()).collect();
        assert_eq!(ids, (1..=200).collect::<Vec<u64>>());
        assert_eq!(state.borrow().publish_batches, 20);
    });
}

#[test]
fn dropping_a_subscription_disconnects_the_consumer() {
    run(|| async {
        let (addr, state) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        let sub = client.subscribe("orders", "g", 0).await.unwrap();
        assert_eq!(state.borrow().disconnects, 0);
        drop(sub);
        // The release travels with the next message on the connection.
        client.topology().await.unwrap();
        within("the release", async {
            while state.borrow().disconnects == 0 {
                glommio::timer::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
    });
}

#[test]
fn calls_after_close_fail_as_disconnected() {
    run(|| async {
        let (addr, _) = start_fake_broker(crate::rpc::PROTOCOL_VERSION);
        let client = Client::connect(addr.as_str()).await.unwrap();
        let other_handle = client.clone();
        within("close", client.close()).await.unwrap();
        match within(
            "publish",
            other_handle.publish(vec![message("t", "x")], AckLevel::Durable),
        )
        .await
        {
            Err(ClientError::Disconnected(_)) => {}
            other => panic!("expected a disconnect, got {other:?}"),
        }
    });
}

#[test]
fn deliver_waits_for_room_in_the_local_queue() {
    run(|| async {
        let (sender, queue) = local_channel::new_bounded(2);
        let inbox: consumer::Client = capnp_rpc::new_client(Inbox {
            queue: sender,
            returns_left: Default::default(),
        });
        let stored = StoredMessage {
            topic: "orders".into(),
            payload: b"p".to_vec(),
            enqueued_at_ms: 1,
            delay_ms: 0,
            ttl_ms: 0,
            headers: Vec::new(),
        };
        let deliveries: Vec<OutgoingDelivery<'_, StoredMessage>> = (1..=3)
            .map(|id| OutgoingDelivery {
                tag: EventKey::new(TopicHash::of("orders"), 0, id),
                message: &stored,
                attempt: 1,
            })
            .collect();
        let mut request = inbox.deliver_request();
        rpc::write_deliveries(request.get().init_deliveries(3), &deliveries);
        let mut call = request.send().promise;
        // Three deliveries, room for two: the call must not return yet.
        for _ in 0..10 {
            assert!(futures_lite::future::poll_once(&mut call).await.is_none());
            glommio::yield_if_needed().await;
        }
        assert_eq!(queue.recv().await.map(|d| d.tag.event_id()), Some(1));
        within("the call to return", &mut call).await.unwrap();
        assert_eq!(queue.recv().await.map(|d| d.tag.event_id()), Some(2));
        assert_eq!(queue.recv().await.map(|d| d.tag.event_id()), Some(3));
        // With the application's end gone, the call fails: the broker sees a disconnect.
        drop(queue);
        let mut request = inbox.deliver_request();
        rpc::write_deliveries(request.get().init_deliveries(1), &deliveries[..1]);
        assert!(within("the failing call", request.send().promise)
            .await
            .is_err());
    });
}

#[test]
fn a_consumer_of_at_most_n_holds_the_calls_past_its_budget() {
    run(|| async {
        let (sender, queue) = local_channel::new_bounded(8);
        // Two deliveries may return; the broker's queue bound covers the rest.
        let inbox: consumer::Client = capnp_rpc::new_client(Inbox {
            queue: sender,
            returns_left: std::rc::Rc::new(std::cell::Cell::new(Some(2))),
        });
        let stored = StoredMessage {
            topic: "orders".into(),
            payload: b"p".to_vec(),
            enqueued_at_ms: 1,
            delay_ms: 0,
            ttl_ms: 0,
            headers: Vec::new(),
        };
        let deliveries: Vec<OutgoingDelivery<'_, StoredMessage>> = (1..=3)
            .map(|id| OutgoingDelivery {
                tag: EventKey::new(TopicHash::of("orders"), 0, id),
                message: &stored,
                attempt: 1,
            })
            .collect();
        let call = |range: std::ops::Range<usize>| {
            let mut request = inbox.deliver_request();
            let part = &deliveries[range];
            rpc::write_deliveries(request.get().init_deliveries(part.len() as u32), part);
            request.send().promise
        };
        within("a call within the budget", call(0..2))
            .await
            .unwrap();
        let mut held = call(2..3);
        // Past the budget the call does not return, though its delivery is queued at once.
        for _ in 0..10 {
            assert!(futures_lite::future::poll_once(&mut held).await.is_none());
            glommio::yield_if_needed().await;
        }
        for id in 1..=3 {
            let got = within("a queued delivery", queue.recv()).await;
            assert_eq!(got.map(|d| d.tag.event_id()), Some(id));
        }
        assert!(futures_lite::future::poll_once(&mut held).await.is_none());
    });
}
