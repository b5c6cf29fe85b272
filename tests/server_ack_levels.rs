//! What an ACK's and a NACK's `ok` promise, proved by killing a real `pinq serve --storage lsm`
//! with SIGKILL right after the answers and restarting it on the same data directory:
//!
//! - a `durable` ACK answered `ok` is never delivered again, also when another group still
//!   holds the message (the copy record path), and `delivery.deleteBatchInterval` (10 s here)
//!   does not delay the answer;
//! - a `leader` ACK promises no such thing: with the long interval its copies come back;
//! - a copy's `attempt` never goes down across a kill, and `maxDeliveries` counts across it.

mod support;

use std::time::{Duration, Instant};

use pinq::client::{AckLevel, Client, PublishMessage, Subscription, TagResult};
use support::Server;

const SERVER_ARGS: &[&str] = &["--cpus", "0", "--storage", "lsm"];
const SERVER_ENV: &[(&str, &str)] = &[
    ("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "10s"),
    ("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "60s"),
    ("PINQ_DELIVERY_MAX_DELIVERIES", "3"),
];
/// How long a consumer listens for copies that must not come (or waits for ones that must).
const LISTEN: Duration = Duration::from_millis(1500);
const WAIT_MAX: Duration = Duration::from_secs(20);

async fn publish(client: &Client, topic: &str, n: usize) {
    let messages: Vec<PublishMessage> = (0..n)
        .map(|i| PublishMessage::new(topic, format!("m{i}").into_bytes()))
        .collect();
    for chunk in messages.chunks(50) {
        client
            .publish(chunk, AckLevel::Durable)
            .await
            .expect("publish");
    }
}

/// Receives until `want` deliveries came, or `LISTEN` passed without one after `want` was
/// reached (with `want` 0: listens for `LISTEN`). Bounded by `WAIT_MAX`.
async fn receive(sub: &Subscription, want: usize) -> Vec<pinq::client::Delivery> {
    let mut got = Vec::new();
    let started = Instant::now();
    let mut last = Instant::now();
    while started.elapsed() < WAIT_MAX {
        if got.len() >= want && last.elapsed() >= LISTEN {
            break;
        }
        let batch = futures_lite::future::or(
            async { Some(sub.recv_batch(256).await.expect("subscription open")) },
            async {
                glommio::timer::sleep(Duration::from_millis(50)).await;
                None
            },
        )
        .await;
        if let Some(batch) = batch {
            last = Instant::now();
            got.extend(batch);
        }
    }
    got
}

/// A server on a data directory of its own, which outlives each process.
fn start() -> (tempfile::TempDir, Server) {
    let tmp = tempfile::tempdir().expect("temp dir");
    let server = Server::start_in(&tmp.path().join("data"), SERVER_ARGS, SERVER_ENV);
    (tmp, server)
}

fn restart(server: &mut Server) -> Server {
    server.kill9();
    Server::start_in(&server.data_dir.clone(), SERVER_ARGS, SERVER_ENV)
}

#[test]
fn durable_acks_hold_across_kill_9_and_leader_acks_do_not_promise_it() {
    let (_tmp, mut server) = start();
    let answered = support::with_client(server.server_arg(), |client| async move {
        publish(&client, "durable", 100).await;
        publish(&client, "leader", 100).await;
        let durable = client.subscribe("durable", "g", 0).await.unwrap();
        let leader = client.subscribe("leader", "g", 0).await.unwrap();
        leader.set_ack_level(AckLevel::Leader);
        assert_eq!(durable.ack_level(), AckLevel::Durable, "the default");
        let mut answered = 0;
        for (sub, _) in [(&durable, "durable"), (&leader, "leader")] {
            let got = receive(sub, 100).await;
            assert_eq!(got.len(), 100);
            for chunk in got.chunks(10) {
                let tags: Vec<_> = chunk.iter().map(|d| d.tag).collect();
                let results = sub.ack(&tags).await.expect("ack");
                assert!(results.iter().all(|r| *r == TagResult::Ok), "{results:?}");
                answered += tags.len();
            }
        }
        answered
    });
    assert_eq!(answered, 200);
    // The last `ok` was just answered; the interval (10 s) has not passed.
    let server = restart(&mut server);
    let (durable_again, leader_again) =
        support::with_client(server.server_arg(), |client| async move {
            let durable = client.subscribe("durable", "g", 0).await.unwrap();
            let leader = client.subscribe("leader", "g", 0).await.unwrap();
            let leader_again = receive(&leader, 100).await.len();
            let durable_again = receive(&durable, 0).await.len();
            (durable_again, leader_again)
        });
    assert_eq!(
        durable_again, 0,
        "durable ACKs answered ok came back after kill -9"
    );
    assert_eq!(
        leader_again, 100,
        "leader ACKs within the delete interval are not durable (the control of this test)"
    );
}

#[test]
fn a_durable_ack_of_one_group_holds_while_another_group_holds_the_message() {
    let (_tmp, mut server) = start();
    support::with_client(server.server_arg(), |client| async move {
        let billing = client.subscribe("orders", "billing", 0).await.unwrap();
        let shipping = client.subscribe("orders", "shipping", 0).await.unwrap();
        publish(&client, "orders", 50).await;
        let for_billing = receive(&billing, 50).await;
        assert_eq!(receive(&shipping, 50).await.len(), 50);
        let tags: Vec<_> = for_billing.iter().map(|d| d.tag).collect();
        let results = billing.ack(&tags).await.expect("ack");
        assert!(results.iter().all(|r| *r == TagResult::Ok));
        // Shipping never ACKs: the messages stay, billing's ACKs live in copy records.
    });
    let server = restart(&mut server);
    let (billing_again, shipping_again) =
        support::with_client(server.server_arg(), |client| async move {
            // Both at once, shipping's call first: a message's recipients are fixed at its first
            // dispatch after the start, and shipping must be one of them (billing usually is too,
            // and then only its copy record keeps its copies from coming back).
            let (shipping, billing) = futures_lite::future::zip(
                client.subscribe("orders", "shipping", 0),
                client.subscribe("orders", "billing", 0),
            )
            .await;
            let (shipping, billing) = (shipping.unwrap(), billing.unwrap());
            let shipping_again = receive(&shipping, 50).await;
            let billing_again = receive(&billing, 0).await.len();
            // Shipping's ACKs now complete the messages; their deletes take billing's records.
            let tags: Vec<_> = shipping_again.iter().map(|d| d.tag).collect();
            shipping.ack(&tags).await.expect("ack");
            (billing_again, shipping_again.len())
        });
    assert_eq!(
        billing_again, 0,
        "billing's durable ACKs came back after kill -9"
    );
    assert_eq!(
        shipping_again, 50,
        "shipping's unACKed copies must come back"
    );
}

#[test]
fn attempts_never_go_down_and_max_deliveries_counts_across_kill_9() {
    let (_tmp, mut server) = start();
    let mut seen = Vec::new();
    for life in 0..3 {
        let attempt = support::with_client(server.server_arg(), move |client| async move {
            if life == 0 {
                publish(&client, "jobs", 1).await;
            }
            let sub = client.subscribe("jobs", "workers", 0).await.unwrap();
            let got = receive(&sub, 1).await;
            assert_eq!(got.len(), 1, "life {life}: the message must be delivered");
            // A long delay: the copy is not redelivered (and counted) before the kill.
            let results = sub.nack(&[got[0].tag], 60_000).await.expect("nack");
            assert_eq!(results, vec![TagResult::Ok]);
            got[0].attempt
        });
        seen.push(attempt);
        server = restart(&mut server);
    }
    assert_eq!(seen, vec![1, 2, 3], "each kill -9 continues the count");
    // The third NACK exhausted maxDeliveries = 3: the copy goes to the dead-letter topic. The
    // kill may have come before its dead letter was stored, or before the source's delete: then
    // the copy comes once more, numbered 3 (never 1, never 4), and its NACK dead-letters it (a
    // dead letter is never lost, at worst stored twice).
    let dead = support::with_client(server.server_arg(), |client| async move {
        let sub = client.subscribe("jobs", "workers", 0).await.unwrap();
        let dlq = client.subscribe("jobs.dlq", "ops", 0).await.unwrap();
        for again in receive(&sub, 0).await {
            assert_eq!(
                again.attempt, 3,
                "a fourth delivery, or a count that went down"
            );
            sub.nack(&[again.tag], 0).await.expect("nack");
        }
        receive(&dlq, 1).await.len()
    });
    assert!(
        (1..=2).contains(&dead),
        "the exhausted copy is dead-lettered (at most twice), got {dead}"
    );
}
