//! Flow control over the wire, against a real `pinq serve`, with consumers written against the
//! raw Cap'n Proto API: one whose `deliver` never returns, one that returns but never ACKs.
//! The broker must never have more than a consumer's `queueSize` deliveries in calls that have
//! not returned, nor more than `delivery.maxUnackedPerConsumer` unACKed; a full consumer is
//! skipped at once for a peer with room (counted in `pinq_consumer_queue_full_total`), and a
//! copy whose lease ran out goes to another member than the one that let it run out.

mod support;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, Client, PublishMessage, Subscription};
use pinq::rpc::pinq_capnp::{consumer, subscription};
use support::{http_get, on_executor, sample, Server};

/// Bound on waiting for what must happen.
const MUST_HAPPEN: Duration = Duration::from_secs(20);

/// What a raw consumer does with a `deliver` call once it has recorded it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Never returns: the client is hung inside its handler.
    Stuck,
    /// Returns at once, and never ACKs.
    Hoard,
    /// Returns this many milliseconds late (a network that holds the call, then heals).
    Late(u64),
}

/// A `Consumer` that records (payload, attempt) of every delivery it was sent.
struct Recorder {
    mode: Mode,
    seen: Rc<RefCell<Vec<(String, u32)>>>,
    tags: Rc<RefCell<Vec<Vec<u8>>>>,
}

impl consumer::Server for Recorder {
    async fn deliver(
        self: capnp::capability::Rc<Self>,
        params: consumer::DeliverParams,
        _: consumer::DeliverResults,
    ) -> Result<(), capnp::Error> {
        for d in params.get()?.get_deliveries()? {
            let payload = String::from_utf8_lossy(d.get_payload()?).into_owned();
            self.seen.borrow_mut().push((payload, d.get_attempt()));
            self.tags.borrow_mut().push(d.get_tag()?.to_vec());
        }
        match self.mode {
            Mode::Stuck => std::future::pending::<()>().await,
            Mode::Late(ms) => sleep(ms).await,
            Mode::Hoard => {}
        }
        Ok(())
    }
}

/// A raw subscription: the broker's answer and what it delivered so far.
struct Raw {
    queue_size: u32,
    max_unacked: u32,
    seen: Rc<RefCell<Vec<(String, u32)>>>,
    tags: Rc<RefCell<Vec<Vec<u8>>>>,
    subscription: subscription::Client,
}

async fn subscribe_raw(client: &Client, topic: &str, queue_size: u32, mode: Mode) -> Raw {
    let seen = Rc::new(RefCell::new(Vec::new()));
    let tags = Rc::new(RefCell::new(Vec::new()));
    let recorder = Recorder {
        mode,
        seen: seen.clone(),
        tags: tags.clone(),
    };
    let mut request = client.broker().subscribe_request();
    {
        let mut params = request.get();
        params.set_topic(topic);
        params.set_group("g");
        params.set_consumer(capnp_rpc::new_client(recorder));
        params.set_queue_size(queue_size);
    }
    let reply = request.send().promise.await.expect("subscribe");
    let reply = reply.get().expect("subscribe reply");
    Raw {
        queue_size: reply.get_queue_size(),
        max_unacked: reply.get_max_unacked(),
        seen,
        tags,
        subscription: reply.get_subscription().expect("subscription"),
    }
}

async fn publish(client: &Client, topic: &str, n: usize) {
    let messages: Vec<PublishMessage> = (0..n)
        .map(|i| PublishMessage::new(topic, format!("m{i}")))
        .collect();
    client
        .publish(messages, AckLevel::Leader)
        .await
        .expect("publish");
}

/// Receives and ACKs on `sub` until `want` distinct payloads came or [`MUST_HAPPEN`] passed;
/// returns how often each payload came.
async fn consume(sub: &Subscription, want: usize) -> BTreeMap<String, u32> {
    let deadline = Instant::now() + MUST_HAPPEN;
    let mut seen = BTreeMap::new();
    while seen.len() < want && Instant::now() < deadline {
        let next = futures_lite::future::or(async { sub.recv().await.ok() }, async {
            glommio::timer::sleep(Duration::from_millis(200)).await;
            None
        })
        .await;
        if let Some(d) = next {
            sub.ack(&[d.tag]).await.expect("ack");
            *seen
                .entry(String::from_utf8_lossy(&d.payload).into_owned())
                .or_insert(0) += 1;
        }
    }
    seen
}

async fn sleep(ms: u64) {
    glommio::timer::sleep(Duration::from_millis(ms)).await;
}

fn server(env: &[(&str, &str)]) -> Server {
    Server::start_with_env(&["--cpus", "0", "--storage", "memory"], env)
}

/// `pinq_consumer_queue_full_total` of shard 0, polled until it is positive (metrics are
/// published once a second) or 5 s passed.
fn queue_full_total(server: &Server) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, page) = http_get(server.metrics_addr.expect("metrics"), "/metrics");
        let value = sample(&page, "pinq_consumer_queue_full_total", "shard=\"0\"");
        match value {
            Some(v) if v > 0.0 => return v,
            _ if Instant::now() >= deadline => return value.unwrap_or(0.0),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

#[test]
fn a_consumer_stuck_in_deliver_holds_no_more_than_its_queue_size() {
    let server = server(&[
        ("PINQ_DELIVERY_CONSUMER_QUEUE_SIZE", "64"),
        ("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "1s"),
        ("PINQ_SERVER_DELIVER_TIMEOUT", "1s"),
    ]);
    let addr = server.addr.to_string();
    let (stuck_seen, capped, healthy_got) = on_executor(move || async move {
        // The stuck consumers on a connection of their own: it is reset once a deliver call
        // has gone unanswered for server.deliverTimeout.
        let stuck_client = Client::connect(addr.as_str()).await.expect("connect");
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let stuck = subscribe_raw(&stuck_client, "jobs", 4, Mode::Stuck).await;
        assert_eq!(
            stuck.queue_size, 4,
            "the answer names the queueSize in force"
        );
        let greedy = subscribe_raw(&stuck_client, "other", 100_000, Mode::Stuck).await;
        let capped = greedy.queue_size;
        let healthy = client.subscribe("jobs", "g", 0).await.expect("subscribe");
        publish(&client, "jobs", 200).await;
        // Every message reaches the healthy member: the stuck one's share first (it is skipped
        // once full), then its four copies once its connection was reset (their leases never
        // started: the stuck consumer never confirmed it received them).
        let got = consume(&healthy, 200).await;
        sleep(1_500).await;
        let stuck_seen = stuck.seen.borrow().clone();
        (stuck_seen, capped, got)
    });
    assert_eq!(
        capped, 64,
        "a queueSize above delivery.consumerQueueSize is capped"
    );
    assert_eq!(
        stuck_seen.len(),
        4,
        "a consumer whose deliver never returns got only its queueSize: {stuck_seen:?}"
    );
    assert_eq!(
        healthy_got.len(),
        200,
        "the healthy member got every message"
    );
    assert!(
        queue_full_total(&server) >= 1.0,
        "skipping the full consumer is counted"
    );
}

#[test]
fn a_consumer_that_never_acks_holds_no_more_than_max_unacked() {
    let server = server(&[
        ("PINQ_DELIVERY_MAX_UNACKED_PER_CONSUMER", "5"),
        ("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "30s"),
    ]);
    let addr = server.addr.to_string();
    let (hoard, max_unacked, healthy_got) = on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let hoarder = subscribe_raw(&client, "jobs", 0, Mode::Hoard).await;
        let healthy = client.subscribe("jobs", "g", 0).await.expect("subscribe");
        publish(&client, "jobs", 50).await;
        let got = consume(&healthy, 45).await;
        sleep(500).await;
        let hoard = hoarder.seen.borrow().clone();
        (hoard, hoarder.max_unacked, got)
    });
    assert_eq!(
        max_unacked, 5,
        "the answer names delivery.maxUnackedPerConsumer"
    );
    assert_eq!(hoard.len(), 5, "five unACKed copies and no more: {hoard:?}");
    assert_eq!(healthy_got.len(), 45, "its peer took every other message");
}

#[test]
fn a_lease_that_ran_out_is_redelivered_to_another_member() {
    let server = server(&[("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "1s")]);
    let addr = server.addr.to_string();
    let (hoard, healthy_got) = on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let hoarder = subscribe_raw(&client, "jobs", 0, Mode::Hoard).await;
        let healthy = client.subscribe("jobs", "g", 0).await.expect("subscribe");
        publish(&client, "jobs", 40).await;
        let got = consume(&healthy, 40).await;
        // Past another lease: a copy that went back to the hoarder would have come by now.
        sleep(1_500).await;
        let hoard = hoarder.seen.borrow().clone();
        (hoard, got)
    });
    let first: Vec<_> = hoard.iter().filter(|(_, attempt)| *attempt == 1).collect();
    let again: Vec<_> = hoard.iter().filter(|(_, attempt)| *attempt > 1).collect();
    assert!(!first.is_empty(), "the hoarder got its round-robin share");
    assert!(
        again.is_empty(),
        "no copy went back to the member that let its lease run out: {again:?}"
    );
    assert_eq!(
        healthy_got.len(),
        40,
        "the healthy member got every message, the hoarder's after their leases"
    );
}

/// Regression (issue 21): a copy's lease ran from the moment it was sent, so a copy still on
/// its way (a cut network, a stalled socket) timed out, went to another member, was ACKed there
/// (answered ok), and then reached its first consumer: a copy delivered again after a durable
/// ACK. The lease now starts when the consumer answers the `deliver` call: a copy whose answer
/// is late waits for it, and is never in two consumers' hands.
#[test]
fn a_copy_whose_deliver_call_is_answered_late_is_never_handed_to_another_member() {
    let server = server(&[
        ("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "300ms"),
        ("PINQ_SERVER_DELIVER_TIMEOUT", "30s"),
    ]);
    let addr = server.addr.to_string();
    let (late_seen, late_acked, healthy_got) = on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        // Its calls are answered 1.5 s late: five leases, had they started at the send.
        let late = subscribe_raw(&client, "jobs", 0, Mode::Late(1_500)).await;
        let healthy = client.subscribe("jobs", "g", 0).await.expect("subscribe");
        let published = Instant::now();
        publish(&client, "jobs", 40).await;
        // The healthy member takes (and ACKs) its share at once.
        sleep(200).await;
        let late_share = late.tags.borrow().len();
        let got = consume(&healthy, 40 - late_share).await;
        // The late member ACKs what it got once its calls were answered, within its lease.
        let answered = published + Duration::from_millis(1_650);
        sleep(
            answered
                .saturating_duration_since(Instant::now())
                .as_millis() as u64,
        )
        .await;
        let tags = late.tags.borrow().clone();
        let mut request = late.subscription.ack_request();
        {
            let mut list = request.get().init_tags(tags.len() as u32);
            for (i, tag) in tags.iter().enumerate() {
                list.set(i as u32, tag);
            }
        }
        let reply = request.send().promise.await.expect("ack");
        let results = reply
            .get()
            .expect("ack reply")
            .get_results()
            .expect("results");
        let acked = results
            .iter()
            .filter(|r| matches!(r, Ok(pinq::rpc::pinq_capnp::TagResult::Ok)))
            .count();
        // Nothing of the late member's comes to the healthy one after.
        sleep(1_000).await;
        let mut got_later = Vec::new();
        while let Some(Some(d)) =
            futures_lite::future::poll_once(async { healthy.recv().await.ok() }).await
        {
            got_later.push(String::from_utf8_lossy(&d.payload).into_owned());
        }
        assert!(
            got_later.is_empty(),
            "redelivered to the healthy member: {got_later:?}"
        );
        let late_seen = late.seen.borrow().clone();
        (late_seen, acked, got)
    });
    assert!(!late_seen.is_empty(), "the late member got its share");
    assert_eq!(
        late_acked,
        late_seen.len(),
        "every copy the late member got was still its own to ACK: {late_seen:?}"
    );
    for (payload, _) in &late_seen {
        assert!(
            !healthy_got.contains_key(payload),
            "{payload} went to both members"
        );
    }
    assert_eq!(
        healthy_got.len() + late_seen.len(),
        40,
        "each message went to exactly one member"
    );
}
