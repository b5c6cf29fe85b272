//! Idempotent publish against real `pinq serve` processes: a republished (producer id,
//! sequence) is answered with its original tag and consumed once — in one run, after a kill -9
//! between the two publishes, after a graceful restart (the pairs then come back from tables,
//! not the WAL), and through `pinq publish --producer-id`. Past `publish.dedupWindow` a pair is
//! stored again.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, Client, PublishMessage, Subscription};
use pinq::key::EventKey;
use support::{cli, http_get, on_executor, sample, Server};

const LSM: &[&str] = &["--cpus", "0", "--storage", "lsm"];
/// Bound on waiting for a delivery that must come.
const MUST_HAPPEN: Duration = Duration::from_secs(20);
/// After the expected deliveries, listen this long for copies that must not come.
const QUIET: Duration = Duration::from_millis(700);

fn numbered(topic: &str, producer: &str, sequences: std::ops::Range<u64>) -> Vec<PublishMessage> {
    sequences
        .map(|s| PublishMessage::new(topic, format!("m{s}")).with_sequence(producer, s))
        .collect()
}

fn publish(addr: String, messages: Vec<PublishMessage>) -> Vec<EventKey> {
    on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        client
            .publish(messages, AckLevel::Durable)
            .await
            .expect("publish")
    })
}

async fn recv_within(sub: &Subscription, wait: Duration) -> Option<pinq::client::Delivery> {
    futures_lite::future::or(async { sub.recv().await.ok() }, async {
        glommio::timer::sleep(wait).await;
        None
    })
    .await
}

/// Consumes `topic` as group `g` until `expected` deliveries came and then nothing more for
/// [`QUIET`]; returns how often each payload was delivered.
fn consume(addr: String, topic: &'static str, expected: usize) -> BTreeMap<String, usize> {
    on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let sub = client.subscribe(topic, "g", 0).await.expect("subscribe");
        let mut seen = BTreeMap::new();
        let mut got = 0;
        loop {
            let wait = if got < expected { MUST_HAPPEN } else { QUIET };
            let Some(d) = recv_within(&sub, wait).await else {
                break;
            };
            got += 1;
            sub.ack(&[d.tag]).await.expect("ack");
            *seen
                .entry(String::from_utf8(d.payload).expect("utf-8"))
                .or_insert(0) += 1;
        }
        seen
    })
}

fn once_each(seen: &BTreeMap<String, usize>, sequences: std::ops::Range<u64>) {
    let want: BTreeMap<String, usize> = sequences.map(|s| (format!("m{s}"), 1)).collect();
    assert_eq!(*seen, want, "every message once, none twice");
}

/// Polls `/metrics` (figures are published once a second) until the shard-summed counter
/// reaches `want`; returns the last value seen.
fn wait_for_metric(server: &Server, name: &str, want: f64) -> f64 {
    let metrics = server.metrics_addr.expect("metrics address");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, page) = http_get(metrics, "/metrics");
        let value = sample(&page, name, "shard=\"0\"").unwrap_or(0.0);
        if value >= want || Instant::now() > deadline {
            return value;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_republished_producer_sequence_is_answered_with_its_original_tag_and_consumed_once() {
    let server = Server::start(LSM);
    let first = publish(server.server_arg(), numbered("orders", "shop-1", 1..4));
    // The retry overlaps: 1..3 again, plus a new 4; and the same pair twice in one batch.
    let mut retry = numbered("orders", "shop-1", 1..5);
    retry.push(PublishMessage::new("orders", "m4-again").with_sequence("shop-1", 4));
    let second = publish(server.server_arg(), retry);
    assert_eq!(second[..3], first[..], "duplicates carry the original tags");
    assert!(!first.contains(&second[3]), "sequence 4 is new");
    assert_eq!(
        second[4], second[3],
        "one pair twice in a batch is stored once"
    );
    // Another producer's sequence 1 is its own.
    let other = publish(server.server_arg(), numbered("orders", "shop-2", 1..2));
    assert!(!first.contains(&other[0]));
    // Without a producer id nothing is deduplicated.
    let plain = vec![PublishMessage::new("orders", "plain"); 2];
    let plain_tags = publish(server.server_arg(), plain);
    assert_ne!(plain_tags[0], plain_tags[1]);

    let seen = consume(server.server_arg(), "orders", 7);
    let mut want: BTreeMap<String, usize> = (1..5).map(|s| (format!("m{s}"), 1)).collect();
    // shop-2's m1 and the plain pair.
    *want.get_mut("m1").expect("m1") += 1;
    want.insert("plain".into(), 2);
    assert_eq!(seen, want);
    assert_eq!(
        wait_for_metric(&server, "pinq_publish_duplicates_total", 4.0),
        4.0,
        "3 republished + 1 repeated in a batch"
    );
}

#[test]
fn concurrent_publishes_of_one_pair_store_it_once() {
    let server = Server::start(LSM);
    let addr = server.server_arg();
    let (a, b) = on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let batch = numbered("race", "p", 1..51);
        // Both requests are sent before either reply is awaited.
        let one = client.publish(batch.clone(), AckLevel::Durable);
        let two = client.publish(batch, AckLevel::Durable);
        (one.await.expect("first"), two.await.expect("second"))
    });
    assert_eq!(a, b, "the second answers with the first's tags");
    once_each(&consume(server.server_arg(), "race", 50), 1..51);
}

#[test]
fn a_republish_after_kill_9_between_the_two_publishes_is_not_stored_again() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let mut server = Server::start_in(&data_dir, LSM, &[]);
    let first = publish(server.server_arg(), numbered("crash", "job-9", 1..21));
    server.kill9();

    let server = Server::start_in(&data_dir, LSM, &[]);
    let again = publish(server.server_arg(), numbered("crash", "job-9", 1..26));
    assert_eq!(
        again[..20],
        first[..],
        "the WAL replay remembered every pair"
    );
    once_each(&consume(server.server_arg(), "crash", 25), 1..26);
}

#[test]
fn pairs_come_back_from_tables_after_a_graceful_restart() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let mut server = Server::start_in(&data_dir, LSM, &[]);
    let first = publish(server.server_arg(), numbered("flushed", "job-3", 1..11));
    // A graceful stop flushes the memtable into a table, and the WAL no longer holds the batch.
    assert_eq!(
        server.signal_and_wait("TERM", Duration::from_secs(30)),
        Some(0)
    );
    let server = Server::start_in(&data_dir, LSM, &[]);
    let again = publish(server.server_arg(), numbered("flushed", "job-3", 1..11));
    assert_eq!(again, first);
    once_each(&consume(server.server_arg(), "flushed", 10), 1..11);
}

#[test]
fn past_the_window_a_pair_is_stored_again() {
    let server = Server::start_with_env(LSM, &[("PINQ_PUBLISH_DEDUP_WINDOW", "500ms")]);
    let first = publish(server.server_arg(), numbered("late", "p", 1..2));
    let inside = publish(server.server_arg(), numbered("late", "p", 1..2));
    assert_eq!(inside, first);
    std::thread::sleep(Duration::from_millis(800));
    let after = publish(server.server_arg(), numbered("late", "p", 1..2));
    assert_ne!(after, first, "the window ended: stored again");
    let seen = consume(server.server_arg(), "late", 2);
    assert_eq!(seen.get("m1"), Some(&2));
}

#[test]
fn rerunning_pinq_publish_with_a_producer_id_publishes_nothing_twice() {
    let server = Server::start(LSM);
    let addr = server.server_arg();
    let run = |first: &str, messages: &[&str]| {
        let mut args = vec![
            "publish",
            "--server",
            addr.as_str(),
            "--topic",
            "cli",
            "--producer-id",
            "nightly-import",
            "--first-sequence",
            first,
        ];
        args.extend_from_slice(messages);
        let (code, _, stderr) = cli(&args, None);
        assert_eq!(code, 0, "{stderr}");
    };
    run("1", &["m1", "m2", "m3"]);
    // The same command again (a rerun after a failure), then one that continues at 4.
    run("1", &["m1", "m2", "m3"]);
    run("4", &["m4"]);
    once_each(&consume(addr.clone(), "cli", 4), 1..5);
    // Through stdin the numbering is the same: lines 1..=3 are known, 5 is new.
    let (code, _, stderr) = cli(
        &[
            "publish",
            "--server",
            addr.as_str(),
            "--topic",
            "cli",
            "--producer-id",
            "nightly-import",
        ],
        Some("m1\nm2\nm3\nm4\nm5\n"),
    );
    assert_eq!(code, 0, "{stderr}");
    once_each(&consume(addr.clone(), "cli", 1), 5..6);
    let (code, _, stderr) = cli(
        &[
            "publish",
            "--server",
            addr.as_str(),
            "--topic",
            "cli",
            "--first-sequence",
            "3",
            "x",
        ],
        None,
    );
    assert_ne!(code, 0, "--first-sequence needs --producer-id");
    assert!(stderr.contains("--producer-id"), "{stderr}");
}
