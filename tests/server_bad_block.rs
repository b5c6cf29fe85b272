//! A flipped byte in a data block of a table, with a real `pinq serve`: the block is skipped,
//! never served, and the topic keeps flowing.
//!
//! Durable batches are published with a small memtable (so several tables are flushed), then a
//! few more that stay in the WAL, and the server is killed. A byte inside the first data block
//! of the oldest table is flipped. After the restart: every message of the other blocks and of
//! the WAL is delivered, none of the damaged block's is (and no payload differs from one that
//! was published), `pinq_unreadable_values_total` counts the lost keys, `/healthz` answers 503
//! naming unreadable blocks, `pinq doctor --data-dir` names the table, and the ERROR lines are
//! a handful, not a flood.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, PublishMessage};
use pinq::storage::table::parse_table_name;
use support::{cli, http_get, with_client, Server};

const TABLE_BATCHES: usize = 60;
const WAL_BATCHES: usize = 3;
const PER_BATCH: usize = 10;
const ENV: [(&str, &str); 2] = [
    ("PINQ_STORAGE_MEMTABLE_BYTES", "64KiB"),
    ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "4KiB"),
];

/// The payload of message `m` of batch `b`: names both, padded to 1 KiB so blocks fill.
fn payload(b: usize, m: usize) -> Vec<u8> {
    let mut p = format!("b{b:03}-m{m:02}-").into_bytes();
    p.resize(1024, b'.');
    p
}

fn publish(addr: String, batches: std::ops::Range<usize>) {
    with_client(addr, move |client| async move {
        for b in batches {
            let messages: Vec<PublishMessage> = (0..PER_BATCH)
                .map(|m| PublishMessage::new("rot", payload(b, m)))
                .collect();
            client
                .publish(&messages, AckLevel::Durable)
                .await
                .expect("durable publish");
        }
    });
}

/// The table files of shard 0, oldest first.
fn tables(data_dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(data_dir.join("shard-0"))
        .expect("shard dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| Some((parse_table_name(p.file_name()?.to_str()?)?, p)))
        .collect();
    found.sort();
    found.into_iter().map(|(_, p)| p).collect()
}

/// Every (batch, message) delivered to a new group until nothing more comes for 3 s; panics on
/// a payload that was never published (corrupt bytes served).
fn receive_all(addr: String) -> BTreeSet<(usize, usize)> {
    with_client(addr, |client| async move {
        let sub = client.subscribe("rot", "g", 4096).await.expect("subscribe");
        let mut got = BTreeSet::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let batch = futures_lite::future::or(
                async { sub.recv_batch(1024).await.expect("stream open") },
                async {
                    glommio::timer::sleep(Duration::from_secs(3)).await;
                    Vec::new()
                },
            )
            .await;
            if batch.is_empty() {
                break;
            }
            for d in batch {
                let text = String::from_utf8_lossy(&d.payload).into_owned();
                let b: usize = text[1..4].parse().expect("payload names its batch");
                let m: usize = text[6..8].parse().expect("payload names its message");
                assert_eq!(d.payload, payload(b, m), "a delivered payload was altered");
                got.insert((b, m));
            }
        }
        got
    })
}

fn metric_sum(page: &str, name: &str) -> f64 {
    let prefix = format!("{name}{{");
    page.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

#[test]
fn a_flipped_byte_in_a_data_block_skips_that_block_and_later_messages_flow() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let mut server = Server::start_in(&data_dir, &["--cpus", "0", "--storage", "lsm"], &ENV);
    publish(server.server_arg(), 0..TABLE_BATCHES);
    // The flushes run in the background: wait (bounded) until some tables are on disk.
    let deadline = Instant::now() + Duration::from_secs(30);
    while tables(&data_dir).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    publish(
        server.server_arg(),
        TABLE_BATCHES..TABLE_BATCHES + WAL_BATCHES,
    );
    server.kill9();

    let all = tables(&data_dir);
    assert!(
        all.len() >= 2,
        "600 KiB through a 64 KiB memtable flushed tables: {all:?}"
    );
    let victim = all[0].clone();
    let mut bytes = std::fs::read(&victim).expect("read table");
    // The first data block starts at offset 0 and is about 16 KiB: byte 100 is inside it.
    bytes[100] ^= 0x20;
    std::fs::write(&victim, &bytes).expect("write table");

    let server = Server::start_in(&data_dir, &["--cpus", "0", "--storage", "lsm"], &ENV);
    let got = receive_all(server.server_arg());
    let published = (TABLE_BATCHES + WAL_BATCHES) * PER_BATCH;
    let lost = published - got.len();
    for b in TABLE_BATCHES..TABLE_BATCHES + WAL_BATCHES {
        for m in 0..PER_BATCH {
            assert!(
                got.contains(&(b, m)),
                "message {b}/{m} from the WAL delivered"
            );
        }
    }
    eprintln!(
        "figures: {} of {published} delivered, {lost} lost with the block",
        got.len()
    );
    assert!(lost > 0, "the damaged block's messages are not delivered");
    assert!(
        lost < published / 4,
        "only one block's messages are lost ({lost} of {published})"
    );
    assert!(
        got.contains(&(TABLE_BATCHES - 1, PER_BATCH - 1)),
        "messages after the block flow"
    );

    // The metrics loop publishes once a second: poll (bounded) for the figures.
    let metrics = server.metrics_addr.expect("metrics endpoint");
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut counted, mut health) = (0.0, (0, String::new()));
    while Instant::now() < deadline {
        counted = metric_sum(
            &http_get(metrics, "/metrics").1,
            "pinq_unreadable_values_total",
        );
        health = http_get(metrics, "/healthz");
        if counted > 0.0 && health.0 == 503 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        counted > 0.0,
        "pinq_unreadable_values_total counts the lost keys"
    );
    assert!(
        counted as usize <= lost,
        "counted {counted} unreadable values, {lost} messages lost"
    );
    assert_eq!(health.0, 503, "/healthz: {}", health.1);
    assert!(
        health.1.contains("unreadable"),
        "/healthz names it: {}",
        health.1
    );

    let dir = data_dir.to_str().expect("utf-8 path");
    let (_, out, err) = cli(&["doctor", "--data-dir", dir, "--cpus", "0"], None);
    let name = victim.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(
        out.lines()
            .any(|l| l.contains("table blocks") && l.contains(name) && l.contains("unreadable")),
        "doctor names the table {name}:\n{out}{err}"
    );

    let output = server.drain_output();
    let errors = output.iter().filter(|l| l.contains("ERROR")).count();
    assert!(
        errors <= 5,
        "one ERROR line per block, not a flood: {errors}"
    );
    assert!(!output.iter().any(|l| l.contains("panicked")), "no panic");
}
