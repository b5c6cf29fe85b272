//! Statistics of a real `pinq serve` process: `Broker.stats` per shard, topic and group, the
//! backlog of stored messages (also after a restart), each expired message counted once, the
//! per-group metrics, and the `pinq stats`, `pinq topics` and `pinq groups` commands. Waits are
//! bounded only to fail a hung test; shard figures are read until they hold.

mod support;

use std::time::{Duration, Instant};

use pinq::client::Client;
use pinq::rpc::{GroupStats, Stats, TopicStats};
use support::{cli, http_get, sample, with_client, Server};

const WAIT: Duration = Duration::from_secs(60);

fn stats_of(server: &Server) -> Stats {
    with_client(server.server_arg(), |client: Client| async move {
        client.stats().await.expect("stats")
    })
}

/// Reads stats until `done` holds (or the wait runs out: the caller's asserts then fail).
fn stats_until(server: &Server, done: impl Fn(&Stats) -> bool) -> Stats {
    let deadline = Instant::now() + WAIT;
    loop {
        let stats = stats_of(server);
        if done(&stats) || Instant::now() > deadline {
            return stats;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn topic<'a>(stats: &'a Stats, name: &str) -> Option<&'a TopicStats> {
    stats.topics.iter().find(|t| t.topic == name)
}

fn group<'a>(stats: &'a Stats, topic: &str, group: &str) -> Option<&'a GroupStats> {
    stats
        .groups
        .iter()
        .find(|g| g.topic == topic && g.group == group)
}

fn publish(server: &Server, topic: &str, delay: Option<&str>, count: usize) {
    let target = server.server_arg();
    let payloads: Vec<String> = (0..count).map(|i| format!("m{i}")).collect();
    let mut args = vec!["publish", "--server", &target, "--topic", topic];
    if let Some(delay) = delay {
        args.extend(["--delay", delay]);
    }
    args.extend(payloads.iter().map(String::as_str));
    let (code, out, err) = cli(&args, None);
    assert_eq!(code, 0, "publish failed: {out}{err}");
}

fn consume(server: &Server, topic: &str, group: &str, count: u64) {
    let target = server.server_arg();
    let count = count.to_string();
    let (code, out, err) = cli(
        &[
            "consume",
            "--server",
            &target,
            "--topic",
            topic,
            "--group",
            group,
            "--count",
            &count,
            "--timeout",
            "60s",
        ],
        None,
    );
    assert_eq!(code, 0, "consume failed: {out}{err}");
}

#[test]
fn stored_messages_show_as_backlog_and_groups_are_listed_also_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = ["--cpus", "0"];
    let mut server = Server::start_in(dir.path(), &args, &[]);
    publish(&server, "orders", None, 100);
    publish(&server, "orders", Some("1h"), 20);

    let stats = stats_until(&server, |s| {
        topic(s, "orders").is_some_and(|t| t.stored == 120 && t.due == 100)
    });
    let t = topic(&stats, "orders").expect("the topic is listed");
    assert_eq!(
        (t.stored, t.due, t.scheduled, t.in_flight),
        (120, 100, 20, 0)
    );
    assert_eq!(stats.shards[0].backlog, 100, "{stats:?}");
    assert_eq!(stats.shards[0].scheduled, 20);

    // A group consumes 30: it is listed with its counters, and the backlog shrinks.
    consume(&server, "orders", "billing", 30);
    let stats = stats_until(&server, |s| {
        group(s, "orders", "billing").is_some_and(|g| g.acked == 30)
            && topic(s, "orders").is_some_and(|t| t.stored == 90)
    });
    let g = group(&stats, "orders", "billing").expect("the group is listed");
    assert_eq!(g.acked, 30, "{g:?}");
    assert!(g.dispatched >= 30, "{g:?}");
    assert_eq!(g.shard_id, 0);
    let t = topic(&stats, "orders").expect("topic");
    assert_eq!((t.stored, t.scheduled), (90, 20), "{t:?}");
    // The 70 due messages the group has not settled are its backlog (whether the dispatcher
    // has claimed them for it yet or not).
    assert_eq!(g.backlog, 70, "{g:?}");

    // After a restart the shard counts its store again.
    assert_eq!(server.signal_and_wait("TERM", WAIT), Some(0));
    let server = Server::start_in(dir.path(), &args, &[]);
    let stats = stats_until(&server, |s| {
        s.shards[0].counted && topic(s, "orders").is_some_and(|t| t.stored == 90)
    });
    assert!(stats.shards[0].counted);
    let t = topic(&stats, "orders").expect("topic after the restart");
    assert_eq!((t.stored, t.due, t.scheduled), (90, 70, 20), "{t:?}");
    assert_eq!(stats.shards[0].backlog, 70);

    // The commands print the same figures.
    let target = server.server_arg();
    let (code, out, err) = cli(&["topics", "--server", &target], None);
    assert_eq!(code, 0, "{err}");
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("orders "))
        .unwrap_or_else(|| panic!("no orders row in:\n{out}"))
        .split_whitespace()
        .collect();
    assert_eq!(row[..6], ["orders", "0", "90", "70", "20", "0"], "{out}");
    println!("$ pinq topics --server {target}\n{out}");

    consume(&server, "orders", "billing", 5);
    let (code, out, err) = cli(&["groups", "--server", &target, "--topic", "orders"], None);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("orders ") && l.contains("billing")),
        "{out}"
    );
    println!("$ pinq groups --server {target} --topic orders\n{out}");

    let (code, out, err) = cli(&["stats", "--server", &target, "--json"], None);
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("stats --json is JSON");
    assert_eq!(json["shards"][0]["scheduled"], 20, "{out}");
    assert!(
        json["groups"].as_array().is_some_and(|g| !g.is_empty()),
        "{out}"
    );
    let (code, out, err) = cli(&["stats", "--server", &target], None);
    assert_eq!(code, 0, "{err}");
    println!("$ pinq stats --server {target}\n{out}");
}

#[test]
fn an_expired_message_is_counted_once_whoever_meets_it_first() {
    // The janitor sweeps every 200 ms and the dispatcher meets the messages when they fall due;
    // deletes wait 5 s, so both find the same expired keys before their delete is applied.
    let env = [
        ("PINQ_DELIVERY_TTL_SWEEP_INTERVAL", "200ms"),
        ("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "5s"),
    ];
    let server = Server::start_with_env(&["--cpus", "0", "--storage", "memory"], &env);
    let target = server.server_arg();
    // A consumer of the topic, so the dispatcher scans it.
    let mut consumer = std::process::Command::new(support::pinq_bin())
        .args([
            "consume",
            "--server",
            &target,
            "--topic",
            "short",
            "--group",
            "g",
            "--timeout",
            "20s",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("consume");
    stats_until(&server, |s| {
        group(s, "short", "g").is_some_and(|g| g.consumers == 1)
    });
    let payloads: Vec<String> = (0..5).map(|i| format!("x{i}")).collect();
    let mut args = vec![
        "publish", "--server", &target, "--topic", "short", "--delay", "1s", "--ttl", "300ms",
    ];
    args.extend(payloads.iter().map(String::as_str));
    let (code, out, err) = cli(&args, None);
    assert_eq!(code, 0, "{out}{err}");

    let stats = stats_until(&server, |s| s.shards[0].expired >= 5);
    assert_eq!(stats.shards[0].expired, 5, "{stats:?}");
    // Both have had time to meet every key again: still 5, and the stats call agrees with
    // the metrics.
    std::thread::sleep(Duration::from_secs(2));
    let stats = stats_of(&server);
    assert_eq!(stats.shards[0].expired, 5, "{stats:?}");
    let addr = server.metrics_addr.expect("metrics address");
    let (_, page) = http_get(addr, "/metrics");
    let by = |source: &str| {
        sample(
            &page,
            "pinq_messages_expired_total",
            &format!("shard=\"0\",source=\"{source}\""),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(by("dispatcher") + by("janitor"), 5.0, "{page}");
    consumer.kill().ok();
    consumer.wait().ok();
}

#[test]
fn per_group_metrics_are_labelled_up_to_the_bound_and_the_rest_summed() {
    let env = [("PINQ_DELIVERY_MAX_GROUP_METRICS", "2")];
    let server = Server::start_with_env(&["--cpus", "0", "--storage", "memory"], &env);
    // Four groups with a member each when the messages come (a message's recipients are the
    // groups with members at its first dispatch).
    let target = server.server_arg();
    let mut consumers: Vec<std::process::Child> = ["a", "b", "c", "d"]
        .iter()
        .map(|g| {
            std::process::Command::new(support::pinq_bin())
                .args([
                    "consume", "--server", &target, "--topic", "fan", "--group", g,
                ])
                .args(["--count", "4", "--timeout", "60s"])
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("consume")
        })
        .collect();
    stats_until(&server, |s| {
        s.groups
            .iter()
            .filter(|g| g.topic == "fan" && g.consumers == 1)
            .count()
            == 4
    });
    publish(&server, "fan", None, 4);
    for c in &mut consumers {
        assert!(c.wait().expect("consume exits").success());
    }
    let addr = server.metrics_addr.expect("metrics address");
    let deadline = Instant::now() + WAIT;
    let acked = |page: &str, topic: &str, group: &str| {
        sample(
            page,
            "pinq_group_acked_total",
            &format!("shard=\"0\",topic=\"{topic}\",group=\"{group}\""),
        )
    };
    let page = loop {
        let (_, page) = http_get(addr, "/metrics");
        if acked(&page, "", "_other") == Some(8.0) || Instant::now() > deadline {
            break page;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(acked(&page, "fan", "a"), Some(4.0), "{page}");
    assert_eq!(acked(&page, "fan", "b"), Some(4.0), "{page}");
    assert_eq!(
        acked(&page, "fan", "c"),
        None,
        "c is past the bound: {page}"
    );
    assert_eq!(acked(&page, "", "_other"), Some(8.0), "{page}");
    let series = page
        .lines()
        .filter(|l| l.starts_with("pinq_group_acked_total{"))
        .count();
    assert_eq!(series, 3, "{page}");
    // The stats call still lists every group.
    let stats = stats_of(&server);
    assert_eq!(stats.groups.iter().filter(|g| g.topic == "fan").count(), 4);
}
