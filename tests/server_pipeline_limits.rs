//! A real `pinq serve` with small delivery bounds set by environment variables: a subscription
//! past `delivery.maxGroupsPerTopic`, `delivery.maxGroupsPerShard` or
//! `delivery.maxConsumersPerGroup` is refused with its typed code (`tooManyGroups`,
//! `tooManyConsumers`) and counted in `pinq_refusals_total`, while the groups and consumers
//! already there keep getting every message.
//!
//! One shard (`--cpus 0`), so the per-shard bounds are the node's. No assertion is about speed:
//! waits are upper bounds for something that must happen.

mod support;

use std::time::{Duration, Instant};

use pinq::client::{AckLevel, Client, ClientError, PublishMessage, Subscription, TagResult};
use pinq::rpc::refusal::Code;
use support::{http_get, on_executor, sample, Server};

/// Longest wait for something that must happen.
const MUST_HAPPEN: Duration = Duration::from_secs(15);

fn server(env: &[(&str, &str)]) -> Server {
    Server::start_with_env(&["--storage", "memory", "--cpus", "0"], env)
}

/// The refusal of a subscription that must be refused.
async fn refused(client: &Client, topic: &str, group: &str) -> ClientError {
    match client.subscribe(topic, group, 0).await {
        Ok(_) => panic!("subscribing {topic:?} in {group:?} was accepted past its bound"),
        Err(e) => e,
    }
}

/// Receives and ACKs until `sub` got `n` messages or `within` passed; returns their payloads.
async fn receive(sub: &Subscription, n: usize, within: Duration) -> Vec<String> {
    let mut got = Vec::new();
    let deadline = Instant::now() + within;
    while got.len() < n && Instant::now() < deadline {
        let next = futures_lite::future::or(sub.recv(), async {
            glommio::timer::sleep(Duration::from_millis(20)).await;
            None
        })
        .await;
        if let Some(d) = next {
            assert_eq!(sub.ack(&[d.tag]).await.expect("ack"), vec![TagResult::Ok]);
            got.push(String::from_utf8_lossy(&d.payload).into_owned());
        }
    }
    got
}

async fn publish(client: &Client, topic: &str, n: usize) {
    let batch: Vec<PublishMessage> = (0..n)
        .map(|i| PublishMessage::new(topic, format!("m{i}")))
        .collect();
    let tags = client
        .publish(batch, AckLevel::Durable)
        .await
        .expect("publish");
    assert_eq!(tags.len(), n);
}

/// Waits until the metrics page counts at least `count` refusals with `code` on shard 0;
/// returns the count seen.
fn refusals_counted(server: &Server, code: Code, count: f64) -> f64 {
    let metrics = server.metrics_addr.expect("metrics endpoint");
    let labels = format!("shard=\"0\",code=\"{}\"", code.name());
    let deadline = Instant::now() + MUST_HAPPEN;
    let mut seen = None;
    while Instant::now() < deadline {
        let (status, page) = http_get(metrics, "/metrics");
        assert_eq!(status, 200);
        seen = sample(&page, "pinq_refusals_total", &labels);
        if let Some(seen) = seen.filter(|n| *n >= count) {
            return seen;
        }
        // Figures are published once a second.
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("pinq_refusals_total{{{labels}}} is {seen:?}, expected at least {count}");
}

#[test]
fn a_fourth_group_of_a_topic_is_refused_with_its_code_and_the_first_three_still_deliver() {
    let server = server(&[("PINQ_DELIVERY_MAX_GROUPS_PER_TOPIC", "3")]);
    let addr = server.addr;
    on_executor(move || async move {
        let client = Client::connect(addr).await.expect("connect");
        let mut subs = Vec::new();
        for group in ["g1", "g2", "g3"] {
            subs.push(client.subscribe("orders", group, 0).await.expect(group));
        }
        let e = refused(&client, "orders", "g4").await;
        assert_eq!(e.refusal(), Some(Code::TooManyGroups), "{e}");
        assert!(e.to_string().contains("delivery.maxGroupsPerTopic"), "{e}");
        // The bound is per topic, and a member of an existing group is no new group.
        let _other = client
            .subscribe("other", "g4", 0)
            .await
            .expect("another topic");
        let second = client.subscribe("orders", "g1", 0).await.expect("g1 again");
        drop(second);

        publish(&client, "orders", 5).await;
        for (sub, group) in subs.iter().zip(["g1", "g2", "g3"]) {
            let got = receive(sub, 5, MUST_HAPPEN).await;
            assert_eq!(got.len(), 5, "group {group} got {got:?}");
        }
        // Still refused: nothing was registered by the refusal.
        let e = refused(&client, "orders", "g5").await;
        assert_eq!(e.refusal(), Some(Code::TooManyGroups), "{e}");
    });
    assert_eq!(refusals_counted(&server, Code::TooManyGroups, 2.0), 2.0);
}

#[test]
fn a_new_group_past_the_shards_bound_is_refused_whatever_its_topic() {
    let server = server(&[("PINQ_DELIVERY_MAX_GROUPS_PER_SHARD", "2")]);
    let addr = server.addr;
    on_executor(move || async move {
        let client = Client::connect(addr).await.expect("connect");
        let a = client.subscribe("a", "g", 0).await.expect("a");
        let _b = client.subscribe("b", "g", 0).await.expect("b");
        let e = refused(&client, "c", "g").await;
        assert_eq!(e.refusal(), Some(Code::TooManyGroups), "{e}");
        assert!(e.to_string().contains("delivery.maxGroupsPerShard"), "{e}");
        publish(&client, "a", 3).await;
        assert_eq!(receive(&a, 3, MUST_HAPPEN).await.len(), 3);
    });
    assert_eq!(refusals_counted(&server, Code::TooManyGroups, 1.0), 1.0);
}

#[test]
fn a_consumer_past_max_consumers_per_group_is_refused_and_the_group_keeps_delivering() {
    let server = server(&[("PINQ_DELIVERY_MAX_CONSUMERS_PER_GROUP", "3")]);
    let addr = server.addr;
    on_executor(move || async move {
        let client = Client::connect(addr).await.expect("connect");
        let mut subs = Vec::new();
        for i in 0..3 {
            let sub = client.subscribe("jobs", "crew", 0).await;
            subs.push(sub.unwrap_or_else(|e| panic!("member {i}: {e}")));
        }
        let e = refused(&client, "jobs", "crew").await;
        assert_eq!(e.refusal(), Some(Code::TooManyConsumers), "{e}");
        assert!(
            e.to_string().contains("delivery.maxConsumersPerGroup"),
            "{e}"
        );
        // Another group of the topic has its own room.
        let other = client.subscribe("jobs", "audit", 0).await.expect("audit");

        let total = 30;
        publish(&client, "jobs", total).await;
        assert_eq!(receive(&other, total, MUST_HAPPEN).await.len(), total);
        let mut crew = 0;
        let deadline = Instant::now() + MUST_HAPPEN;
        while crew < total && Instant::now() < deadline {
            for sub in &subs {
                crew += receive(sub, total, Duration::from_millis(100)).await.len();
            }
        }
        assert_eq!(crew, total, "the group shared every message");

        // A member that leaves makes room for a new one.
        let leaving = subs.pop().expect("a member");
        leaving.close().await.expect("close");
        let deadline = Instant::now() + MUST_HAPPEN;
        loop {
            match client.subscribe("jobs", "crew", 0).await {
                Ok(_) => break,
                Err(e) if e.refusal() == Some(Code::TooManyConsumers) => {
                    assert!(
                        Instant::now() < deadline,
                        "no room after a member left: {e}"
                    );
                    glommio::timer::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("subscribe after a member left: {e}"),
            }
        }
    });
    // At least the one refusal above (the retries after `close` may add some).
    refusals_counted(&server, Code::TooManyConsumers, 1.0);
}
