//! Operations of a real `pinq serve` process: the metrics endpoint, `/healthz`, and graceful
//! shutdown on SIGTERM/SIGINT. No assertion here depends on timing: waits are bounded only to
//! fail a hung test instead of hanging CI.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pinq::client::{AckLevel, Client, PublishMessage};
use support::{cli, http_get, sample, Server};

/// Upper bound on how long a graceful shutdown may take before the test calls it hung.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(60);

/// Upper bound on waiting for a metrics snapshot to show a figure.
const SCRAPE_WAIT: Duration = Duration::from_secs(60);

fn start() -> Server {
    Server::start(&["--cpus", "0", "--storage", "memory"])
}

/// Scrapes until `done(page)` holds (shards publish a snapshot about once a second).
fn scrape_until(server: &Server, done: impl Fn(&str) -> bool) -> String {
    let addr = server
        .metrics_addr
        .expect("the server printed its metrics address");
    let deadline = std::time::Instant::now() + SCRAPE_WAIT;
    loop {
        let (status, page) = http_get(addr, "/metrics");
        assert_eq!(status, 200, "{page}");
        if done(&page) || std::time::Instant::now() > deadline {
            return page;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn healthz_answers_200_while_serving_and_unknown_paths_404() {
    let server = start();
    let addr = server.metrics_addr.expect("metrics address");
    let (status, body) = http_get(addr, "/healthz");
    assert_eq!(status, 200);
    assert_eq!(body, "ok\n");
    assert_eq!(http_get(addr, "/nope").0, 404);
}

#[test]
fn scrape_after_publishing_and_consuming_shows_the_counters_moving() {
    let server = start();
    let target = server.server_arg();
    let messages = ["a", "b", "c", "d", "e"];
    let mut args = vec!["publish", "--server", &target, "--topic", "metrics-t"];
    args.extend(messages);
    let (code, out, err) = cli(&args, None);
    assert_eq!(code, 0, "publish failed: {out}{err}");
    let (code, out, err) = cli(
        &[
            "consume",
            "--server",
            &target,
            "--topic",
            "metrics-t",
            "--group",
            "g",
            "--count",
            "5",
            "--timeout",
            "60s",
        ],
        None,
    );
    assert_eq!(code, 0, "consume failed: {out}{err}");
    assert_eq!(out.lines().count(), 5, "{out}");

    let value = |page: &str, name: &str, labels: &str| sample(page, name, labels).unwrap_or(-1.0);
    let page = scrape_until(&server, |page| {
        value(
            page,
            "pinq_consumer_ack_total",
            r#"shard="0",result="acked""#,
        ) >= 5.0
    });
    assert!(
        value(&page, "pinq_messages_published_total", r#"shard="0""#) >= 5.0,
        "{page}"
    );
    assert!(value(&page, "pinq_messages_dispatched_total", r#"shard="0""#) >= 5.0);
    assert!(
        value(
            &page,
            "pinq_consumer_ack_total",
            r#"shard="0",result="acked""#
        ) >= 5.0
    );
    assert!(value(&page, "pinq_publish_latency_seconds_count", r#"shard="0""#) >= 1.0);
    assert!(value(&page, "pinq_delivery_latency_seconds_count", r#"shard="0""#) >= 5.0);
    assert!(
        value(
            &page,
            "pinq_dispatch_pass_duration_seconds_count",
            r#"shard="0""#
        ) >= 1.0
    );
    // Every family is there, with the names operators query.
    for family in [
        "pinq_messages_in_flight",
        "pinq_active_consumers",
        "pinq_messages_expired",
        "pinq_delete_batch_size",
        "pinq_delete_failures",
        "pinq_redeliveries",
        "pinq_consumer_queue_full",
    ] {
        assert!(
            page.contains(&format!("# TYPE {family} ")),
            "{family} missing:\n{page}"
        );
    }
    // The in-memory store keeps no storage figures, so none are shown.
    assert!(!page.contains("pinq_storage_"));
}

/// Messages per publish batch of the background publisher.
const PUBLISH_BATCH_LEN: usize = 10;

/// Batches the publisher must have had acknowledged before the signal is sent, so the signal
/// lands while it is publishing.
const BATCHES_BEFORE_SIGNAL: usize = 20;

/// Publishes batches with `durable` acks through the client library, one after the other, until
/// a publish fails (the broker stopped taking them) or `stop` is set; returns the payloads the
/// broker acknowledged. `progress` counts acknowledged batches.
fn publish_until_refused(
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    progress: Arc<AtomicUsize>,
) -> Vec<String> {
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spawn(move || async move {
            let mut acked = Vec::new();
            let Ok(client) = Client::connect(addr).await else {
                return acked;
            };
            let mut next = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let payloads: Vec<String> = (next..next + PUBLISH_BATCH_LEN)
                    .map(|i| format!("m{i}"))
                    .collect();
                next += PUBLISH_BATCH_LEN;
                let batch: Vec<PublishMessage> = payloads
                    .iter()
                    .map(|p| PublishMessage::new("drain", p.clone()))
                    .collect();
                match client.publish(batch, AckLevel::Durable).await {
                    Ok(_) => acked.extend(payloads),
                    Err(_) => break,
                }
                progress.fetch_add(1, Ordering::Relaxed);
            }
            acked
        })
        .expect("publisher executor")
        .join()
        .expect("publisher thread")
}

/// Sends `signal` while a publisher is publishing; returns (exit code, acknowledged payloads).
fn signal_while_publishing(server: &mut Server, signal: &str) -> (Option<i32>, Vec<String>) {
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicUsize::new(0));
    let publisher = {
        let (addr, stop, progress) = (server.addr, stop.clone(), progress.clone());
        std::thread::spawn(move || publish_until_refused(addr, stop, progress))
    };
    let deadline = std::time::Instant::now() + SHUTDOWN_WAIT;
    while progress.load(Ordering::Relaxed) < BATCHES_BEFORE_SIGNAL
        && !publisher.is_finished()
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        progress.load(Ordering::Relaxed) >= BATCHES_BEFORE_SIGNAL,
        "the publisher did not get going"
    );
    let code = server.signal_and_wait(signal, SHUTDOWN_WAIT);
    stop.store(true, Ordering::Relaxed);
    let acked = publisher.join().expect("publisher");
    (code, acked)
}

#[test]
fn sigterm_while_publishing_durable_drains_and_exits_0() {
    let mut server = start();
    let (code, acked) = signal_while_publishing(&mut server, "TERM");
    eprintln!(
        "{} messages acknowledged before the broker stopped",
        acked.len()
    );
    assert_eq!(code, Some(0), "graceful shutdown must exit 0");
    assert!(!acked.is_empty());
    let output = server.drain_output().join("\n");
    assert!(!output.contains("ERROR"), "{output}");
    // The memory store keeps nothing across a restart, so check what the shards counted as
    // stored when they stopped: every publish acknowledged before the signal is among them.
    let published: usize = output
        .lines()
        .find_map(|l| l.strip_prefix("pinq stopped: "))
        .and_then(|rest| {
            rest.split_once("; ")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no 'pinq stopped' line:\n{output}"));
    assert!(
        published >= acked.len(),
        "{} publishes acknowledged, {published} stored",
        acked.len()
    );
}

#[test]
fn sigint_shuts_down_gracefully_too() {
    let mut server = start();
    assert_eq!(server.signal_and_wait("INT", SHUTDOWN_WAIT), Some(0));
}

#[test]
#[ignore = "needs the LSM store: in this branch storage.engine = \"lsm\" still falls back to memory, so nothing survives a restart"]
fn sigterm_while_publishing_loses_no_durable_acknowledged_message() {
    let mut server = Server::start(&["--cpus", "0", "--storage", "lsm"]);
    let data_dir = server.data_dir.clone();
    let (code, acked) = signal_while_publishing(&mut server, "TERM");
    eprintln!(
        "{} messages acknowledged before the broker stopped",
        acked.len()
    );
    assert_eq!(code, Some(0));
    let restarted = Server::start_in(&data_dir, &["--cpus", "0", "--storage", "lsm"], &[]);
    let target = restarted.server_arg();
    let count = acked.len().to_string();
    let (code, out, err) = cli(
        &[
            "consume",
            "--server",
            &target,
            "--topic",
            "drain",
            "--group",
            "check",
            "--count",
            &count,
            "--timeout",
            "60s",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let got: std::collections::HashSet<&str> = out.lines().collect();
    for payload in &acked {
        assert!(
            got.contains(payload.as_str()),
            "{payload} was acknowledged and then lost"
        );
    }
}

#[test]
fn serve_refuses_a_bad_config_naming_the_key_and_exits_2() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("pinq.toml");
    std::fs::write(&path, "[server]\nnuma = \"auto\"\nmetricsPort = 9400\n").unwrap();
    let (code, _, err) = cli(&["serve", "--config", path.to_str().unwrap()], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("server.metricsPort"), "{err}");
    std::fs::write(&path, "[server]\nnuma = \"node1\"\n").unwrap();
    let (code, _, err) = cli(&["serve", "--config", path.to_str().unwrap()], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("server.numa"), "{err}");
}
