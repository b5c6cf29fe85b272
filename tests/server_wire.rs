//! A real `pinq serve` process on 127.0.0.1, driven over the wire by the client library and the
//! CLI: publish → consume → ack, grouped vs universal consumers, NACK, in-flight timeout and
//! disconnect redelivery, delayed delivery, TTL expiry, topics on two shards reached through
//! the other shard's port, and bad input from clients.
//!
//! No assertion here is about speed: waits are generous upper bounds for something that must
//! happen, and "nothing arrives" checks wait a fixed while and then look.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pinq::client::{AckLevel, Client, ClientError, Delivery, PublishMessage, TagResult};
use pinq::key::TopicHash;
use support::{cli, on_executor, Server};

/// Longest wait for something that must happen.
const MUST_HAPPEN: Duration = Duration::from_secs(15);

/// The next delivery of `sub`, or `None` after `wait`.
async fn recv_within(sub: &pinq::client::Subscription, wait: Duration) -> Option<Delivery> {
    futures_lite::future::or(async { sub.recv().await.ok() }, async {
        glommio::timer::sleep(wait).await;
        None
    })
    .await
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

fn text(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.payload).into_owned()
}

fn memory_server(extra: &[&str]) -> Server {
    let mut args = vec!["--storage", "memory", "--cpus", "0"];
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// `pinq publish --server ADDR --topic TOPIC ARGS..` with `stdin`; asserts exit 0.
fn publish(addr: &str, topic: &str, args: &[&str], stdin: Option<&str>) {
    let mut all = vec!["publish", "--server", addr, "--topic", topic];
    all.extend_from_slice(args);
    let (code, out, err) = cli(&all, stdin);
    assert_eq!(code, 0, "pinq {all:?} failed:\n{out}{err}");
}

/// `pinq consume --server ADDR --topic TOPIC ARGS..`; asserts exit 0 and returns what it printed.
fn consume(addr: &str, topic: &str, args: &[&str]) -> String {
    let mut all = vec!["consume", "--server", addr, "--topic", topic];
    all.extend_from_slice(args);
    let (code, out, err) = cli(&all, None);
    assert_eq!(code, 0, "pinq {all:?} failed:\n{out}{err}");
    out
}

#[test]
fn cli_publish_then_consume_prints_and_acks_each_message_once() {
    let server = memory_server(&[]);
    let addr = server.server_arg();
    publish(&addr, "orders", &["one", "two", "three"], None);
    publish(&addr, "orders", &["--ack", "leader"], Some("four\nfive\n"));

    let out = consume(&addr, "orders", &["--count", "5", "--timeout", "15s"]);
    let got: BTreeSet<&str> = out.lines().collect();
    let want: BTreeSet<&str> = ["one", "two", "three", "four", "five"].into();
    assert_eq!(got, want, "printed: {out:?}");
    assert_eq!(out.lines().count(), 5, "each message printed once: {out:?}");

    // Everything was ACKed: a second consumer gets nothing.
    let out = consume(&addr, "orders", &["--timeout", "700ms"]);
    assert_eq!(out, "", "acked messages came back");
}

#[test]
fn cli_consume_never_handles_more_than_count() {
    let server = memory_server(&[]);
    let addr = server.server_arg();
    publish(&addr, "t", &["a", "b", "c", "d"], None);
    let first = consume(
        &addr,
        "t",
        &["--group", "g", "--count", "3", "--timeout", "15s"],
    );
    assert_eq!(first.lines().count(), 3, "printed {first:?}");
    // The fourth was not handled by the first member of the group (it may have been delivered
    // to it; closing the subscription handed it back), so the next member gets exactly it.
    let rest = consume(
        &addr,
        "t",
        &["--group", "g", "--count", "5", "--timeout", "8s"],
    );
    let mut all: Vec<&str> = first.lines().chain(rest.lines()).collect();
    all.sort_unstable();
    assert_eq!(all, ["a", "b", "c", "d"], "first {first:?} then {rest:?}");
}

#[test]
fn cli_nack_hands_the_message_back_for_redelivery() {
    let server = memory_server(&[]);
    let addr = server.server_arg();
    publish(&addr, "jobs", &["retry-me"], None);
    let once = ["--group", "g", "--count", "1", "--timeout", "15s"];
    let nack: Vec<&str> = once.iter().copied().chain(["--nack"]).collect();
    assert_eq!(consume(&addr, "jobs", &nack), "retry-me\n");
    assert_eq!(
        consume(&addr, "jobs", &once),
        "retry-me\n",
        "a NACKed message is delivered again"
    );
}

#[test]
fn a_universal_consumer_that_leaves_drops_its_copies() {
    // PRODUCT.md §1: fan-out listeners do not hold messages back; a universal consumer that
    // disconnects is forgotten with its copies, NACKed or not.
    let server = memory_server(&[]);
    let addr = server.server_arg();
    publish(&addr, "news", &["once"], None);
    let got = consume(
        &addr,
        "news",
        &["--count", "1", "--nack", "--timeout", "15s"],
    );
    assert_eq!(got, "once\n");
    assert_eq!(
        consume(&addr, "news", &["--count", "1", "--timeout", "1s"]),
        ""
    );
}

#[test]
fn groups_compete_and_universal_consumers_get_everything() {
    let server = memory_server(&[]);
    let addr = server.addr;
    on_executor(move || async move {
        let client = Client::connect(addr).await.expect("connect");
        let g1 = client.subscribe("fan", "workers", 0).await.expect("g1");
        let g2 = client.subscribe("fan", "workers", 0).await.expect("g2");
        let other = Client::connect(addr).await.expect("connect 2");
        let all = other.subscribe("fan", "", 0).await.expect("universal");
        let total = 40usize;
        let batch: Vec<PublishMessage> = (0..total)
            .map(|i| PublishMessage::new("fan", format!("m{i}")))
            .collect();
        let tags = client
            .publish(batch, AckLevel::Durable)
            .await
            .expect("publish");
        assert_eq!(tags.len(), total);

        let mut by_member: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let mut universal = Vec::new();
        let deadline = Instant::now() + MUST_HAPPEN;
        while (by_member.values().map(Vec::len).sum::<usize>() < total || universal.len() < total)
            && Instant::now() < deadline
        {
            for (name, sub) in [("g1", &g1), ("g2", &g2), ("all", &all)] {
                while let Some(d) = recv_within(sub, Duration::from_millis(20)).await {
                    let results = sub.ack(&[d.tag]).await.expect("ack");
                    assert_eq!(results, vec![TagResult::Ok], "ack by {name}");
                    if name == "all" {
                        universal.push(text(&d));
                    } else {
                        by_member.entry(name).or_default().push(text(&d));
                    }
                }
            }
        }
        let grouped: Vec<String> = by_member.values().flatten().cloned().collect();
        let grouped_set: BTreeSet<&String> = grouped.iter().collect();
        assert_eq!(
            grouped.len(),
            total,
            "the group got each message once: {by_member:?}"
        );
        assert_eq!(grouped_set.len(), total, "no duplicates inside the group");
        assert!(
            by_member.get("g1").is_some_and(|v| !v.is_empty())
                && by_member.get("g2").is_some_and(|v| !v.is_empty()),
            "both group members got a share: {by_member:?}"
        );
        let universal_set: BTreeSet<&String> = universal.iter().collect();
        assert_eq!(
            universal.len(),
            total,
            "the universal consumer got every message"
        );
        assert_eq!(universal_set, grouped_set);
    });
}

#[test]
fn in_flight_timeout_redelivers_an_unacked_message() {
    let server = Server::start_with_env(
        &["--storage", "memory", "--cpus", "0"],
        &[("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "300ms")],
    );
    let addr = server.addr;
    on_executor(move || async move {
        let client = Client::connect(addr).await.expect("connect");
        let sub = client.subscribe("slow", "g", 0).await.expect("subscribe");
        client
            .publish([PublishMessage::new("slow", "late")], AckLevel::Durable)
            .await
            .expect("publish");
        let first = recv_within(&sub, MUST_HAPPEN)
            .await
            .expect("first delivery");
        assert_eq!(first.attempt, 1);
        // Not ACKed: the lease runs out and the same consumer gets it again.
        let again = recv_within(&sub, MUST_HAPPEN).await.expect("redelivery");
        assert_eq!(again.tag, first.tag);
        assert_eq!(again.attempt, 2);
        // The first copy's lease is gone; the current one can be ACKed.
        assert_eq!(
            sub.ack(&[again.tag]).await.expect("ack"),
            vec![TagResult::Ok]
        );
        assert!(
            recv_within(&sub, Duration::from_millis(900))
                .await
                .is_none(),
            "an ACKed message came back"
        );
    });
}

#[test]
fn a_consumer_that_vanishes_has_its_messages_redelivered() {
    let server = memory_server(&[]);
    let addr = server.addr;
    on_executor(move || async move {
        let survivor_client = Client::connect(addr).await.expect("connect");
        let publisher = Client::connect(addr).await.expect("connect publisher");
        {
            let doomed_client = Client::connect(addr).await.expect("connect doomed");
            let doomed = doomed_client
                .subscribe("work", "crew", 0)
                .await
                .expect("subscribe doomed");
            publisher
                .publish([PublishMessage::new("work", "unit")], AckLevel::Durable)
                .await
                .expect("publish");
            let d = recv_within(&doomed, MUST_HAPPEN).await.expect("delivery");
            assert_eq!(text(&d), "unit");
            // The connection goes away without ACK, close or unsubscribe.
            drop(doomed);
            drop(doomed_client);
        }
        let survivor = survivor_client
            .subscribe("work", "crew", 0)
            .await
            .expect("subscribe survivor");
        let d = recv_within(&survivor, MUST_HAPPEN)
            .await
            .expect("redelivered to the surviving member");
        assert_eq!(text(&d), "unit");
        assert_eq!(d.attempt, 2);
    });
}

#[test]
fn a_killed_consumer_process_has_its_messages_redelivered() {
    let server = memory_server(&[]);
    let addr = server.server_arg();
    // A `pinq consume` process that subscribes, is frozen (SIGSTOP) so it cannot ACK what it is
    // given, and is then killed with SIGKILL while it holds the message.
    let mut frozen = std::process::Command::new(support::pinq_bin())
        .args(["consume", "--server", &addr, "--topic", "k", "--group", "g"])
        .args(["--timeout", "60s"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn consumer");
    wait_for_consumers(&addr, 1);
    let pid = frozen.id().to_string();
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .expect("kill -STOP");
    assert!(stopped.success());
    publish(&addr, "k", &["held"], None);
    // The frozen consumer is the only one: the broker hands it the message.
    wait_for_in_flight(&addr, 1);
    frozen.kill().expect("kill -9 the frozen consumer");
    frozen.wait().expect("reap");
    let out = consume(
        &addr,
        "k",
        &["--group", "g", "--count", "1", "--timeout", "15s"],
    );
    assert_eq!(
        out, "held\n",
        "the killed consumer's message is redelivered"
    );
}

/// Waits until the broker's stats report at least `n` messages in flight.
fn wait_for_in_flight(addr: &str, n: usize) {
    wait_for_stat(addr, "in_flight", n);
}

/// Waits until the broker's stats report at least `n` consumers in all.
fn wait_for_consumers(addr: &str, n: usize) {
    wait_for_stat(addr, "consumers", n);
}

/// Polls `pinq stats` until the sum of `column` over the shards reaches `n`.
fn wait_for_stat(addr: &str, column: &str, n: usize) {
    let deadline = Instant::now() + MUST_HAPPEN;
    loop {
        let (code, out, _) = cli(&["stats", "--server", addr], None);
        if code == 0 && stat_total(&out, column) >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{column} never reached {n}: {out}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The total of one column of `pinq stats` output.
fn stat_total(out: &str, column: &str) -> usize {
    let mut lines = out.lines();
    let Some(header) = lines.next() else { return 0 };
    let Some(col) = header.split_whitespace().position(|h| h == column) else {
        return 0;
    };
    lines
        .filter_map(|l| l.split_whitespace().nth(col)?.parse::<usize>().ok())
        .sum()
}

#[test]
fn a_delayed_message_is_not_delivered_before_its_time() {
    let server = memory_server(&[]);
    let addr = server.addr;
    on_executor(move || async move {
        let client = Client::connect(addr).await.expect("connect");
        let sub = client.subscribe("later", "g", 0).await.expect("subscribe");
        let sent_at = now_ms();
        let mut message = PublishMessage::new("later", "wait for it");
        message.delay_ms = 800;
        client
            .publish([message], AckLevel::Durable)
            .await
            .expect("publish");
        let d = recv_within(&sub, MUST_HAPPEN).await.expect("delivery");
        let got_at = now_ms();
        assert_eq!(d.delay_ms, 800);
        assert!(
            got_at >= sent_at + 800,
            "delivered {} ms after publishing, before its 800 ms delay",
            got_at - sent_at
        );
        assert!(d.enqueued_at_ms + d.delay_ms <= got_at);
    });
}

#[test]
fn an_expired_message_is_never_delivered() {
    let server = memory_server(&[]);
    let addr = server.server_arg();
    publish(&addr, "fresh", &["--ttl", "200ms", "stale"], None);
    publish(&addr, "fresh", &["--ttl", "1h", "good"], None);
    std::thread::sleep(Duration::from_millis(600));
    let out = consume(&addr, "fresh", &["--timeout", "1500ms"]);
    assert_eq!(out, "good\n", "only the unexpired message is delivered");
}

/// Two topics, one owned by each of two shards.
fn topics_on_two_shards() -> (String, String) {
    let mut on = [None, None];
    for i in 0.. {
        let topic = format!("topic-{i}");
        let shard = TopicHash::of(&topic).shard(2);
        if on[shard].is_none() {
            on[shard] = Some(topic);
        }
        if let [Some(a), Some(b)] = &on {
            return (a.clone(), b.clone());
        }
    }
    unreachable!()
}

#[test]
fn topics_of_both_shards_work_through_either_shards_port() {
    let server = Server::start(&["--storage", "memory", "--cpus", "0,1"]);
    assert_eq!(server.shard_ports.len(), 2, "two shards");
    let (t0, t1) = topics_on_two_shards();
    let shard_addrs = [server.shard_addr(0), server.shard_addr(1)];
    on_executor(move || async move {
        for (via, addr) in shard_addrs.iter().enumerate() {
            let client = Client::connect(*addr)
                .await
                .expect("connect to a shard port");
            assert_eq!(client.server().shard_id, Some(via as u32));
            assert_eq!(client.server().shard_count, 2);
            for topic in [&t0, &t1] {
                let sub = client.subscribe(topic, "g", 0).await.expect("subscribe");
                let payload = format!("via-{via}-{topic}");
                client
                    .publish(
                        [PublishMessage::new(topic.as_str(), payload.as_str())],
                        AckLevel::Durable,
                    )
                    .await
                    .expect("publish");
                let d = recv_within(&sub, MUST_HAPPEN).await.expect("delivery");
                assert_eq!(text(&d), payload);
                assert_eq!(sub.ack(&[d.tag]).await.expect("ack"), vec![TagResult::Ok]);
                sub.close().await.expect("close");
            }
        }
    });
}

#[test]
fn bad_requests_get_errors_and_the_broker_keeps_serving() {
    let server = memory_server(&[]);
    let addr = server.addr;
    // Garbage instead of Cap'n Proto: the broker closes that connection.
    let mut garbage = std::net::TcpStream::connect(addr).expect("connect");
    garbage
        .set_read_timeout(Some(MUST_HAPPEN))
        .expect("timeout");
    garbage.write_all(&[0xFFu8; 4096]).expect("write garbage");
    let mut buf = [0u8; 1024];
    loop {
        match garbage.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the broker neither answered nor closed a garbage connection: {e}"),
        }
    }
    // A client that connects and vanishes at once.
    drop(std::net::TcpStream::connect(addr).expect("connect"));

    on_executor(move || async move {
        // A client that vanishes in the middle of a publish call.
        {
            let quitter = Client::connect(addr).await.expect("connect");
            let batch: Vec<PublishMessage> = (0..2000)
                .map(|i| PublishMessage::new("abandoned", format!("m{i}")))
                .collect();
            let reply = quitter.publish(batch, AckLevel::Durable);
            glommio::timer::sleep(Duration::from_millis(2)).await;
            drop(reply);
            drop(quitter);
        }
        let client = Client::connect(addr).await.expect("connect");
        let refused = |r: Result<Vec<pinq::client::EventKey>, ClientError>, what: &str| match r {
            Err(ClientError::Rejected(_)) | Err(ClientError::InvalidRequest(_)) => {}
            other => panic!("{what}: expected an error, got {other:?}"),
        };
        refused(
            client
                .publish([PublishMessage::new("", "x")], AckLevel::Durable)
                .await,
            "empty topic",
        );
        refused(
            client
                .publish(
                    [PublishMessage::new("t".repeat(300), "x")],
                    AckLevel::Durable,
                )
                .await,
            "oversized topic",
        );
        refused(
            client
                .publish(
                    [PublishMessage::new("t", vec![0u8; 2 << 20])],
                    AckLevel::Durable,
                )
                .await,
            "oversized payload",
        );
        // A batch with one bad message is refused whole.
        refused(
            client
                .publish(
                    [
                        PublishMessage::new("whole", "ok"),
                        PublishMessage::new("", "bad"),
                    ],
                    AckLevel::Durable,
                )
                .await,
            "mixed batch",
        );
        let sub = client.subscribe("whole", "g", 0).await.expect("subscribe");
        assert!(
            recv_within(&sub, Duration::from_millis(500))
                .await
                .is_none(),
            "part of a refused batch was stored"
        );
        // A tag this consumer does not hold.
        let tags = client
            .publish([PublishMessage::new("other", "x")], AckLevel::Durable)
            .await
            .expect("publish");
        let results = sub.ack(&tags).await.expect("ack reply");
        assert_ne!(
            results,
            vec![TagResult::Ok],
            "acked a tag it was never given"
        );
        // The connection still works after all of that.
        client
            .publish([PublishMessage::new("whole", "fine")], AckLevel::Durable)
            .await
            .expect("publish after errors");
        let d = recv_within(&sub, MUST_HAPPEN).await.expect("delivery");
        assert_eq!(text(&d), "fine");
    });
}
