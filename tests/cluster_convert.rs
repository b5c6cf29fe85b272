//! `pinq cluster convert` with real processes: a standalone `pinq serve` holds durable
//! publishes (immediate, delayed, one idempotent) and a group that ACKed some of them durably
//! while the rest were in flight; it is stopped (SIGTERM, or kill -9), its data directory is
//! converted and copied to three members (the documented procedure, README "Standalone to
//! cluster"), and the cluster delivers exactly the messages not ACKed, the idempotent one once,
//! and takes new publishes. The command's refusals exit non-zero with a clear reason; a
//! conversion stopped after any of its steps (the fault hook `PINQ_FAULT_CONVERT_STOP_AFTER`)
//! leaves a directory that opens standalone with everything in it, or clustered, and running
//! the command again finishes the job.
//!
//! Every server binds 127.0.0.1 and is stopped by its pid; the tests run one at a time (each
//! starts up to three brokers on a 2-core machine).

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, PublishMessage, TagResult};
use support::cluster::{free_port, Cluster};
use support::{cli_within, pinq_bin, Server};

const TOPIC: &str = "jobs";
const GROUP: &str = "g";
const IMMEDIATE: usize = 30;
/// Of the immediate messages, the first this many are ACKed `durable` before the stop.
const ACKED: usize = 10;
const DELAYED: usize = 8;
/// Due a few seconds after their publish: still scheduled when the broker stops, due by the
/// time the cluster serves.
const DELAY_MS: u64 = 3_000;
/// A message delayed far past the test: stored, never delivered here.
const FAR_DELAY_MS: u64 = 3_600_000;
const STANDALONE_ARGS: &[&str] = &["--cpus", "0"];
const STANDALONE_ENV: &[(&str, &str)] = &[("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "60s")];
const CLUSTER_ENV: &[(&str, &str)] = &[("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "50ms")];
const CLI_LIMIT: Duration = Duration::from_secs(30);
const FIRST_ELECTION_TIMEOUT: Duration = Duration::from_secs(15);

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A standalone broker on `data_dir` with the state the module docs describe; returns the
/// payloads a consumer of the group must still get.
fn standalone_with_state(data_dir: &Path) -> (Server, BTreeSet<String>) {
    let server = Server::start_in(data_dir, STANDALONE_ARGS, STANDALONE_ENV);
    support::with_client(server.server_arg(), |client| async move {
        let sub = client.subscribe(TOPIC, GROUP, 0).await.expect("subscribe");
        let immediate: Vec<PublishMessage> = (0..IMMEDIATE)
            .map(|i| PublishMessage::new(TOPIC, format!("now-{i:02}")))
            .collect();
        let mut later: Vec<PublishMessage> = (0..DELAYED)
            .map(|i| PublishMessage {
                delay_ms: DELAY_MS,
                ..PublishMessage::new(TOPIC, format!("later-{i:02}"))
            })
            .collect();
        later.push(PublishMessage {
            delay_ms: FAR_DELAY_MS,
            ..PublishMessage::new(TOPIC, "far")
        });
        later.push(idempotent());
        for batch in [immediate, later] {
            client
                .publish(&batch, AckLevel::Durable)
                .await
                .expect("publish");
        }
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.len() < IMMEDIATE + 1 && Instant::now() < deadline {
            let batch = futures_lite::future::or(async { sub.recv_batch(64).await.ok() }, async {
                glommio::timer::sleep(Duration::from_millis(100)).await;
                None
            })
            .await;
            got.extend(batch.unwrap_or_default());
        }
        let mut acked: Vec<_> = got
            .iter()
            .filter(|d| d.payload.starts_with(b"now-"))
            .collect();
        acked.sort_by(|a, b| a.payload.cmp(&b.payload));
        let tags: Vec<_> = acked.iter().take(ACKED).map(|d| d.tag).collect();
        assert_eq!(
            tags.len(),
            ACKED,
            "the standalone broker delivered too little"
        );
        let results = sub.ack(&tags).await.expect("ack");
        assert!(results.iter().all(|r| *r == TagResult::Ok), "{results:?}");
    });
    let mut expected: BTreeSet<String> =
        (ACKED..IMMEDIATE).map(|i| format!("now-{i:02}")).collect();
    expected.extend((0..DELAYED).map(|i| format!("later-{i:02}")));
    expected.insert("once".to_string());
    (server, expected)
}

/// The one idempotent message: published before the conversion and again after it.
fn idempotent() -> PublishMessage {
    PublishMessage {
        producer_id: "producer-1".into(),
        sequence: 1,
        ..PublishMessage::new(TOPIC, "once")
    }
}

fn convert(data_dir: &Path) -> (i32, String, String) {
    let dir = data_dir.display().to_string();
    cli_within(&["cluster", "convert", "--data-dir", &dir], None, CLI_LIMIT)
}

/// Copies a directory tree (the documented "copy it to every member" step).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the copy");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("dir entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy a file");
        }
    }
}

/// `pinq consume` of the group through every member, ACKing (durable) what it prints.
fn consume(cluster: &Cluster, count: usize, timeout: &str) -> Vec<String> {
    let servers = cluster
        .ids()
        .iter()
        .map(|&id| cluster.addr(id))
        .collect::<Vec<_>>()
        .join(",");
    let count = count.to_string();
    let (code, out, err) = cli_within(
        &[
            "consume",
            "--server",
            &servers,
            "--topic",
            TOPIC,
            "--group",
            GROUP,
            "--count",
            &count,
            "--timeout",
            timeout,
        ],
        None,
        CLI_LIMIT,
    );
    assert_eq!(code, 0, "consume failed: {err}");
    out.lines().map(str::to_string).collect()
}

/// Converts `data_dir`, starts three members on copies of it and checks what they deliver.
fn convert_and_serve_as_cluster(data_dir: &Path, expected: &BTreeSet<String>) {
    let (code, out, err) = convert(data_dir);
    assert_eq!(code, 0, "convert failed: {out}{err}");
    assert!(
        out.contains("converted: its raft log starts after index"),
        "{out}"
    );
    let mut cluster = Cluster::new(3, CLUSTER_ENV);
    for id in cluster.ids() {
        copy_tree(data_dir, &cluster.member(id).data_dir);
    }
    let ids = cluster.ids();
    let args = ids.iter().map(|&id| cluster.args(id, &[])).collect();
    cluster.start_nodes(&ids, args);
    let leader = cluster.wait_for_leader(0, &ids, FIRST_ELECTION_TIMEOUT);
    // The idempotent message again: the dedup state came along, so it is not stored twice.
    let addr = cluster.addr(leader);
    support::with_client(addr, |client| async move {
        client
            .publish(&[idempotent()], AckLevel::Durable)
            .await
            .expect("republish");
    });
    let delivered = consume(&cluster, expected.len(), "20s");
    let got: BTreeSet<String> = delivered.iter().cloned().collect();
    assert_eq!(
        got.len(),
        delivered.len(),
        "a copy came twice: {delivered:?}"
    );
    assert_eq!(
        &got, expected,
        "the cluster must deliver exactly the un-ACKed messages"
    );
    let again = consume(&cluster, 100, "2s");
    assert!(
        again.is_empty(),
        "delivered again or not expected: {again:?}"
    );
    let (code, _, err) = cli_within(
        &[
            "publish",
            "--server",
            &cluster.addr(leader),
            "--topic",
            TOPIC,
            "--ack",
            "durable",
        ],
        Some("after\n"),
        CLI_LIMIT,
    );
    assert_eq!(code, 0, "a new publish failed: {err}");
    assert_eq!(consume(&cluster, 1, "10s"), vec!["after".to_string()]);
    assert_far_message_still_scheduled(&cluster.addr(leader));
    for id in cluster.ids() {
        cluster.kill9(id);
    }
}

/// The message delayed past the test is stored and scheduled on the leader (it came along
/// with its due time). Polls: a new leader counts its store in the background.
fn assert_far_message_still_scheduled(leader: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = String::new();
    while Instant::now() < deadline {
        let (code, out, _) = cli_within(&["topics", "--server", leader, "--json"], None, CLI_LIMIT);
        let topics: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let jobs = topics
            .as_array()
            .and_then(|all| all.iter().find(|t| t["topic"] == TOPIC));
        if code == 0 && jobs.is_some_and(|t| t["stored"] == 1 && t["scheduled"] == 1) {
            return;
        }
        last = out;
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("the far-delayed message is not stored and scheduled on the leader: {last}");
}

#[test]
fn a_standalone_directory_stopped_by_sigterm_becomes_a_three_node_cluster() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("temp dir");
    let data_dir = tmp.path().join("data");
    let (mut server, expected) = standalone_with_state(&data_dir);
    assert_eq!(
        server.signal_and_wait("TERM", Duration::from_secs(30)),
        Some(0)
    );
    convert_and_serve_as_cluster(&data_dir, &expected);
}

#[test]
fn a_standalone_directory_killed_with_sigkill_becomes_a_three_node_cluster() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("temp dir");
    let data_dir = tmp.path().join("data");
    let (mut server, expected) = standalone_with_state(&data_dir);
    server.kill9();
    convert_and_serve_as_cluster(&data_dir, &expected);
}

#[test]
fn convert_refuses_a_directory_in_use_a_converted_one_and_one_that_is_not_pinqs() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("temp dir");
    let missing = tmp.path().join("missing");
    let (code, _, err) = convert(&missing);
    assert_eq!(code, 1);
    assert!(err.contains("no such data directory"), "{err}");
    let bare = tmp.path().join("bare");
    std::fs::create_dir_all(&bare).expect("mkdir");
    let (code, _, err) = convert(&bare);
    assert_eq!(code, 1);
    assert!(err.contains("holds no shard directory"), "{err}");

    let data_dir = tmp.path().join("data");
    // Two shards: the topic's holds a message, the other stays empty.
    let mut server = Server::start_in(&data_dir, &["--cpus", "0,1"], &[]);
    let (code, _, err) = cli_within(
        &[
            "publish",
            "--server",
            &server.server_arg(),
            "--topic",
            TOPIC,
            "--ack",
            "durable",
        ],
        Some("one\n"),
        CLI_LIMIT,
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = convert(&data_dir);
    assert_eq!(code, 1, "converting a running broker's directory: {err}");
    assert!(
        err.contains("while it is in use") && err.contains("pid"),
        "{err}"
    );
    assert_eq!(
        server.signal_and_wait("TERM", Duration::from_secs(30)),
        Some(0)
    );
    let (code, out, err) = convert(&data_dir);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out.matches("converted: its raft log").count(), 1, "{out}");
    assert_eq!(out.matches("empty, nothing to convert").count(), 1, "{out}");
    assert!(out.contains("(2 shard(s))"), "{out}");
    let (code, _, err) = convert(&data_dir);
    assert_eq!(code, 1);
    assert!(
        err.contains("already a cluster member's data directory"),
        "{err}"
    );
}

/// `pinq cluster convert` with the fault hook: stops (exit 1) after `step`.
fn convert_stopping_after(data_dir: &Path, step: &str) -> (i32, String) {
    let mut child = std::process::Command::new(pinq_bin())
        .args(["cluster", "convert", "--data-dir"])
        .arg(data_dir)
        .env("PINQ_FAULT_CONVERT_STOP_AFTER", step)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn pinq");
    let deadline = Instant::now() + CLI_LIMIT;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("convert stopping after {step} did not exit within {CLI_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().expect("output");
    let code = output.status.code().unwrap_or(-1);
    (code, String::from_utf8_lossy(&output.stderr).into_owned())
}

/// A standalone broker on `data_dir` delivers exactly `expected` (and is stopped).
fn opens_standalone_with(data_dir: &Path, expected: &BTreeSet<String>) {
    let mut server = Server::start_in(data_dir, STANDALONE_ARGS, STANDALONE_ENV);
    let count = expected.len().to_string();
    let (code, out, err) = cli_within(
        &[
            "consume",
            "--server",
            &server.server_arg(),
            "--topic",
            TOPIC,
            "--count",
            &count,
            "--timeout",
            "10s",
        ],
        None,
        CLI_LIMIT,
    );
    assert_eq!(code, 0, "{err}");
    let got: BTreeSet<String> = out.lines().map(str::to_string).collect();
    assert_eq!(&got, expected);
    server.kill9();
}

#[test]
fn a_conversion_stopped_after_any_step_leaves_a_directory_that_opens_and_a_rerun_finishes() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("temp dir");
    let original = tmp.path().join("original");
    let server = Server::start_in(&original, STANDALONE_ARGS, &[]);
    let payloads: Vec<String> = (0..20).map(|i| format!("kept-{i:02}")).collect();
    let (code, _, err) = cli_within(
        &[
            "publish",
            "--server",
            &server.server_arg(),
            "--topic",
            TOPIC,
            "--ack",
            "durable",
        ],
        Some(&(payloads.join("\n") + "\n")),
        CLI_LIMIT,
    );
    assert_eq!(code, 0, "{err}");
    let mut server = server;
    server.kill9();
    let expected: BTreeSet<String> = payloads.into_iter().collect();
    for step in ["flushed", "staged", "old-log-removed", "switched"] {
        let dir = tmp.path().join(step);
        copy_tree(&original, &dir);
        let (code, err) = convert_stopping_after(&dir, step);
        assert_eq!(code, 1, "{step}: {err}");
        assert!(err.contains(&format!("stopped after step {step}")), "{err}");
        if step == "old-log-removed" {
            // Between the removal and the switch a clustered start is refused, naming why.
            let dir_arg = dir.display().to_string();
            let raft = format!("127.0.0.1:{}", free_port(0));
            let peers = format!("1={raft}");
            let listen = format!("127.0.0.1:{}", free_port(1));
            let (code, _, err) = cli_within(
                &[
                    "serve",
                    "--cpus",
                    "0",
                    "--node-id",
                    "1",
                    "--raft-listen",
                    &raft,
                    "--peers",
                    &peers,
                    "--listen",
                    &listen,
                    "--metrics-listen",
                    "127.0.0.1:0",
                    "--data-dir",
                    &dir_arg,
                ],
                None,
                CLI_LIMIT,
            );
            assert_ne!(code, 0);
            assert!(err.contains("pinq cluster convert"), "{err}");
        }
        if step != "switched" {
            // Still a standalone directory, with every message.
            opens_standalone_with(&dir, &expected);
        }
        let (code, out, err) = convert(&dir);
        if step == "switched" {
            assert_eq!(code, 1, "{out}{err}");
            assert!(err.contains("already a cluster member's"), "{err}");
            assert!(!dir.join("shard-0").join("convert-staging").exists());
        } else {
            assert_eq!(code, 0, "{step}: {out}{err}");
            assert!(out.contains("converted"), "{out}");
        }
    }
}
