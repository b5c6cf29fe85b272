//! Dead letters, redelivery backoff and group policies against a real `pinq serve` on
//! 127.0.0.1: a poison message NACKed until it lands in the dead-letter topic with its headers
//! (on the same shard and across shards), backoff intervals measured against the policy, a
//! policy set with `pinq group policy` surviving a kill -9, and the bound on policies.
//!
//! No assertion is about speed: the backoff's lower bounds are exact (a redelivery never comes
//! early) and its upper bounds carry a tolerance a loaded machine allows.

mod support;

use std::time::{Duration, Instant};

use pinq::client::{AckLevel, Client, Delivery, Header, PublishMessage};
use pinq::key::TopicHash;
use support::{cli, http_get, on_executor, sample, Server};

const MUST_HAPPEN: Duration = Duration::from_secs(15);

async fn recv_within(sub: &pinq::client::Subscription, wait: Duration) -> Option<Delivery> {
    futures_lite::future::or(async { sub.recv().await.ok() }, async {
        glommio::timer::sleep(wait).await;
        None
    })
    .await
}

fn header<'a>(d: &'a Delivery, key: &str) -> Option<&'a str> {
    d.headers
        .iter()
        .find(|h| h.key == key)
        .and_then(|h| std::str::from_utf8(&h.value).ok())
}

/// Publishes one poison message on `topic`, NACKs every delivery of it for `group`, and returns
/// the attempts seen and the dead letter read from `dlq`.
async fn nack_until_dead(
    client: &Client,
    topic: &str,
    group: &str,
    dlq: &str,
) -> (Vec<u32>, Delivery) {
    let dead = client
        .subscribe(dlq, "inspect", 0)
        .await
        .expect("subscribe dlq");
    let sub = client.subscribe(topic, group, 0).await.expect("subscribe");
    let mut message = PublishMessage::new(topic, "poison");
    message.headers.push(Header {
        key: "trace".into(),
        value: b"abc".to_vec(),
    });
    client
        .publish([message], AckLevel::Durable)
        .await
        .expect("publish");
    let mut attempts = Vec::new();
    while let Some(d) = recv_within(&sub, Duration::from_secs(2)).await {
        attempts.push(d.attempt);
        sub.nack(&[d.tag], 0).await.expect("nack");
    }
    let letter = recv_within(&dead, MUST_HAPPEN).await.expect("dead letter");
    dead.ack(&[letter.tag]).await.expect("ack dead letter");
    (attempts, letter)
}

fn assert_dead_letter(letter: &Delivery, topic: &str, group: &str, attempts: &str) {
    assert_eq!(letter.payload, b"poison");
    assert_eq!(header(letter, "trace"), Some("abc"), "original header kept");
    assert_eq!(header(letter, "pinq-dlq-topic"), Some(topic));
    assert_eq!(header(letter, "pinq-dlq-group"), Some(group));
    assert_eq!(header(letter, "pinq-dlq-attempts"), Some(attempts));
    assert_eq!(header(letter, "pinq-dlq-reason"), Some("nack"));
}

#[test]
fn poison_message_nacked_until_it_lands_in_the_dead_letter_topic_with_its_headers() {
    let server = Server::start_with_env(
        &["--storage", "memory", "--cpus", "0-1"],
        &[("PINQ_DELIVERY_MAX_DELIVERIES", "3")],
    );
    // One topic whose dead-letter topic lives on the same shard, one where it lives on the other.
    let same = (0..1000)
        .map(|i| format!("same{i}"))
        .find(|t| TopicHash::of(t).shard(2) == TopicHash::of(&format!("{t}.dlq")).shard(2))
        .expect("same-shard topic");
    let cross = (0..1000)
        .map(|i| format!("cross{i}"))
        .find(|t| TopicHash::of(t).shard(2) != TopicHash::of(&format!("{t}.dlq")).shard(2))
        .expect("cross-shard topic");
    let addr = server.addr;
    for topic in [same, cross] {
        let t = topic.clone();
        let (attempts, letter) = on_executor(move || async move {
            let client = Client::connect(addr).await.expect("connect");
            nack_until_dead(&client, &t, "workers", &format!("{t}.dlq")).await
        });
        assert_eq!(
            attempts,
            vec![1, 2, 3],
            "{topic}: three deliveries, then none"
        );
        assert_dead_letter(&letter, &topic, "workers", "3");
    }
    // Counted once per dead letter, on the source topic's shards.
    let metrics = server.metrics_addr.expect("metrics address");
    let deadline = Instant::now() + MUST_HAPPEN;
    loop {
        let (_, page) = http_get(metrics, "/metrics");
        let total: f64 = (0..2)
            .filter_map(|s| sample(&page, "pinq_dead_lettered_total", &format!("shard=\"{s}\"")))
            .sum();
        if total == 2.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pinq_dead_lettered_total {total}, want 2"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn backoff_spaces_redeliveries_as_the_policy_says_and_an_explicit_delay_keeps_its_delay() {
    let server = Server::start(&["--storage", "memory", "--cpus", "0"]);
    let addr = server.server_arg();
    let (code, out, err) = cli(
        &[
            "group",
            "policy",
            "--server",
            &addr,
            "--topic",
            "slow",
            "--group",
            "g",
            "--backoff",
            "300ms:1200ms",
            "--max-deliveries",
            "6",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("backoff: 300ms:1200ms"), "{out}");
    let addr = server.addr;
    let (gaps, explicit) = on_executor(move || async move {
        let client = Client::connect(addr).await.expect("connect");
        let sub = client.subscribe("slow", "g", 0).await.expect("subscribe");
        client
            .publish([PublishMessage::new("slow", "x")], AckLevel::Durable)
            .await
            .expect("publish");
        let mut last = None;
        let mut gaps = Vec::new();
        for attempt in 1..=5u32 {
            let d = recv_within(&sub, MUST_HAPPEN).await.expect("delivery");
            assert_eq!(d.attempt, attempt);
            let now = Instant::now();
            if let Some(at) = last {
                gaps.push((attempt, now.duration_since(at)));
            }
            last = Some(now);
            if attempt < 5 {
                sub.nack(&[d.tag], 0).await.expect("nack");
            } else {
                // An explicit delay keeps its delay (100 ms, below the backoff's 1200 ms).
                sub.nack(&[d.tag], 100).await.expect("nack with delay");
            }
        }
        let d = recv_within(&sub, MUST_HAPPEN).await.expect("delivery 6");
        let explicit = last.map(|at| at.elapsed()).unwrap_or_default();
        assert_eq!(d.attempt, 6);
        sub.ack(&[d.tag]).await.expect("ack");
        (gaps, explicit)
    });
    // Attempt 2 waits INITIAL, then the base doubles (jitter takes up to a quarter off, never
    // below INITIAL), capped at MAX.
    let bounds = [(2, 300, 300), (3, 450, 600), (4, 900, 1200), (5, 900, 1200)];
    let slack = Duration::from_millis(800);
    eprintln!("backoff 300ms:1200ms, measured gaps {gaps:?}, explicit 100 ms NACK {explicit:?}");
    for ((attempt, gap), (want, low, high)) in gaps.iter().zip(bounds) {
        assert_eq!(*attempt, want);
        let (low, high) = (Duration::from_millis(low), Duration::from_millis(high));
        assert!(
            *gap >= low - Duration::from_millis(5) && *gap <= high + slack,
            "attempt {attempt} after {gap:?}, policy says {low:?}..={high:?}"
        );
    }
    assert!(
        explicit >= Duration::from_millis(95) && explicit < Duration::from_millis(1100),
        "explicit 100 ms delay took {explicit:?}"
    );
}

#[test]
fn a_group_policy_survives_kill_9_and_still_dead_letters() {
    let mut server = Server::start(&["--cpus", "0"]);
    let addr = server.server_arg();
    let (code, out, err) = cli(
        &[
            "group",
            "policy",
            "--server",
            &addr,
            "--topic",
            "jobs",
            "--group",
            "w",
            "--max-deliveries",
            "2",
            "--dead-letter-topic",
            "dead.{topic}",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("maxDeliveries: 2"), "{out}");
    assert!(out.contains("deadLetterTopic: dead.jobs"), "{out}");
    server.kill9();
    let data_dir = server.data_dir.clone();
    let server = Server::start_in(&data_dir, &["--cpus", "0"], &[]);
    let addr = server.server_arg();
    // No flags: the call only reads the policy, which came back from the log.
    let (code, out, err) = cli(
        &[
            "group", "policy", "--server", &addr, "--topic", "jobs", "--group", "w",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("maxDeliveries: 2"), "{out}");
    assert!(out.contains("deadLetterTopic: dead.jobs"), "{out}");
    assert!(out.contains("backoff: none"), "{out}");
    let addr = server.addr;
    let (attempts, letter) = on_executor(move || async move {
        let client = Client::connect(addr).await.expect("connect");
        nack_until_dead(&client, "jobs", "w", "dead.jobs").await
    });
    assert_eq!(attempts, vec![1, 2]);
    assert_dead_letter(&letter, "jobs", "w", "2");
    drop(server);
}

#[test]
fn policies_past_max_groups_per_shard_are_refused_by_code_and_bad_input_is_typed() {
    let server = Server::start_with_env(
        &["--storage", "memory", "--cpus", "0"],
        &[("PINQ_DELIVERY_MAX_GROUPS_PER_SHARD", "2")],
    );
    let addr = server.server_arg();
    let policy = |group: &str, extra: &[&str]| {
        let mut args = vec![
            "group", "policy", "--server", &addr, "--topic", "t", "--group", group,
        ];
        args.extend_from_slice(extra);
        cli(&args, None)
    };
    assert_eq!(policy("a", &["--max-deliveries", "1"]).0, 0);
    assert_eq!(policy("b", &["--max-deliveries", "1"]).0, 0);
    let (code, _, err) = policy("c", &["--max-deliveries", "1"]);
    assert_ne!(code, 0);
    assert!(err.contains("tooManyGroups"), "{err}");
    // Changing a known group's policy is not a new one.
    assert_eq!(policy("a", &["--max-deliveries", "4"]).0, 0);
    let (code, _, err) = policy("a", &["--backoff", "5s:1s"]);
    assert_eq!(code, 2, "a bad backoff is a usage error: {err}");
    let (code, _, err) = policy("", &[]);
    assert_eq!(code, 2, "an empty group is a usage error: {err}");
}

#[test]
fn consume_count_1_nack_three_times_shows_the_message_three_times_then_it_is_dead_lettered() {
    let server = Server::start_with_env(
        &["--storage", "memory", "--cpus", "0"],
        &[("PINQ_DELIVERY_MAX_DELIVERIES", "3")],
    );
    let addr = server.server_arg();
    let (code, _, err) = cli(
        &[
            "publish",
            "--server",
            &addr,
            "--topic",
            "cli-poison",
            "poison",
        ],
        None,
    );
    assert_eq!(code, 0, "publish: {err}");
    let consume = |topic: &str, extra: &[&str]| {
        let mut args = vec![
            "consume",
            "--server",
            &addr,
            "--topic",
            topic,
            "--group",
            "workers",
            "--timeout",
            "5s",
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = cli(&args, None);
        assert_eq!(code, 0, "consume {extra:?}: {err}");
        out
    };
    // Each run receives at most one delivery: the copy it NACKs is not sent back to it before
    // it exits, so each run costs the message exactly one delivery attempt.
    for run in 1..=3 {
        let out = consume("cli-poison", &["--count", "1", "--nack"]);
        assert_eq!(out, "poison\n", "run {run} shows the message once");
    }
    let dead = consume("cli-poison.dlq", &["--count", "1"]);
    assert_eq!(
        dead, "poison\n",
        "after three deliveries it is a dead letter"
    );
    let (code, out, err) = cli(
        &[
            "consume",
            "--server",
            &addr,
            "--topic",
            "cli-poison",
            "--group",
            "workers",
            "--count",
            "1",
            "--timeout",
            "1s",
        ],
        None,
    );
    assert_eq!(
        (code, out.as_str()),
        (0, ""),
        "nothing left on the topic: {err}"
    );
    // The same bound with a larger count: two runs of --count 2 over two messages, each
    // NACKing both, leave every message with two deliveries (maxDeliveries 3: none dead yet).
    let (code, _, err) = cli(
        &["publish", "--server", &addr, "--topic", "cli-two", "a", "b"],
        None,
    );
    assert_eq!(code, 0, "publish: {err}");
    for run in 1..=2 {
        let out = consume("cli-two", &["--count", "2", "--nack"]);
        let mut lines: Vec<&str> = out.lines().collect();
        lines.sort_unstable();
        assert_eq!(lines, ["a", "b"], "run {run}");
    }
    let out = consume("cli-two", &["--count", "2"]);
    assert_eq!(
        out.lines().count(),
        2,
        "the third delivery of each is still on the topic"
    );
    let dead = consume("cli-two.dlq", &["--count", "1"]);
    assert_eq!(dead, "", "nothing of cli-two was dead-lettered");
}
