//! `pinq serve` on the LSM engine, as a real process: the default engine stores under
//! `<dataDir>/shard-<N>` and what was durably published survives a kill -9; a corrupt table or an
//! unusable data directory stops start-up with an error naming the file, never a panic.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use pinq::client::{AckLevel, Client, PublishMessage};
use support::{with_client, Server};

/// Publishes `batches` durable batches of `per_batch` messages to `topic`; returns the payloads.
async fn publish(
    client: &Client,
    topic: &str,
    batches: usize,
    per_batch: usize,
    size: usize,
) -> Vec<String> {
    let mut sent = Vec::new();
    for b in 0..batches {
        let messages: Vec<PublishMessage> = (0..per_batch)
            .map(|m| {
                let mut payload = format!("b{b}-m{m}-").into_bytes();
                payload.resize(size.max(payload.len()), b'.');
                PublishMessage::new(topic, payload)
            })
            .collect();
        client
            .publish(&messages, AckLevel::Durable)
            .await
            .expect("durable publish");
        sent.extend((0..per_batch).map(|m| format!("b{b}-m{m}-")));
    }
    sent
}

/// Receives from `topic` (group `g`) until every prefix in `want` was seen; returns them sorted.
async fn receive_all(client: &Client, topic: &str, want: usize) -> Vec<String> {
    let sub = client.subscribe(topic, "g", 4096).await.expect("subscribe");
    let mut got = Vec::new();
    let deadline = glommio::timer::sleep(Duration::from_secs(30));
    futures_lite::pin!(deadline);
    while got.len() < want {
        let batch = futures_lite::future::or(
            async { sub.recv_batch(1024).await.unwrap_or_default() },
            async {
                (&mut deadline).await;
                Vec::new()
            },
        )
        .await;
        if batch.is_empty() {
            break;
        }
        for d in batch {
            let text = String::from_utf8_lossy(&d.payload).into_owned();
            let prefix = text.split_inclusive('-').take(2).collect::<String>();
            got.push(prefix);
        }
    }
    got.sort();
    got
}

/// Starts `pinq serve` on `data_dir` and expects it to exit with an error; returns the exit code
/// and everything it printed to stderr.
fn start_expecting_failure(data_dir: &Path, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(support::pinq_bin());
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--cpus",
        "0",
    ])
    .arg("--data-dir")
    .arg(data_dir)
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn pinq serve");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            panic!(
                "pinq serve kept running on a bad data directory; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("wait");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn lsm_is_the_default_engine_and_durable_messages_survive_kill_9() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let mut server = Server::start_in(&data_dir, &["--cpus", "0"], &[]);
    assert!(
        data_dir.join("shard-0").join("PINQ_STORAGE").is_file(),
        "the default engine keeps its files under <dataDir>/shard-0"
    );
    let sent = with_client(server.server_arg(), |client| async move {
        publish(&client, "orders", 5, 20, 100).await
    });
    server.kill9();
    let server = Server::start_in(&data_dir, &["--cpus", "0"], &[]);
    let want = sent.len();
    let mut got = with_client(server.server_arg(), move |client| async move {
        receive_all(&client, "orders", want).await
    });
    got.dedup();
    let mut sent = sent;
    sent.sort();
    assert_eq!(
        got, sent,
        "every durably published message is delivered after kill -9"
    );
}

#[test]
fn a_corrupt_table_stops_start_up_with_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    // A small memtable, so that a few hundred KiB of messages reach a table.
    let env = [
        ("PINQ_STORAGE_MEMTABLE_BYTES", "64KiB"),
        ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "4KiB"),
    ];
    let mut server = Server::start_in(&data_dir, &["--cpus", "0", "--storage", "lsm"], &env);
    with_client(server.server_arg(), |client| async move {
        publish(&client, "orders", 40, 20, 1000).await;
    });
    let shard_dir = data_dir.join("shard-0");
    let tables = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&shard_dir)
            .expect("shard dir")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "sst"))
            .collect()
    };
    // The flush runs in the background: wait (bounded) for a table and a manifest.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while tables().is_empty() || !shard_dir.join("MANIFEST").is_file() {
        assert!(
            std::time::Instant::now() < deadline,
            "no table was written in {}",
            shard_dir.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    server.kill9();
    // Damage every table's tail (footer and index, which every open reads): whichever tables
    // the manifest lists, the first one opened is damaged.
    let tables = tables();
    for table in &tables {
        let mut bytes = std::fs::read(table).expect("read table");
        let len = bytes.len();
        for b in &mut bytes[len.saturating_sub(64)..] {
            *b ^= 0x5A;
        }
        std::fs::write(table, &bytes).expect("write table");
    }

    let (code, stderr) = start_expecting_failure(&data_dir, &env);
    assert_eq!(code, Some(1), "stderr:\n{stderr}");
    let named = tables.iter().any(|t| {
        t.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|name| stderr.contains(name))
    });
    assert!(
        named && stderr.contains("pinq: error:"),
        "the error names a damaged table; stderr:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic; stderr:\n{stderr}");
}

#[test]
fn a_shard_directory_that_is_a_file_stops_start_up_with_an_error_naming_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    std::fs::create_dir_all(&data_dir).expect("data dir");
    std::fs::write(data_dir.join("shard-0"), b"not a directory").expect("write");
    let (code, stderr) = start_expecting_failure(&data_dir, &[]);
    assert_eq!(code, Some(1), "stderr:\n{stderr}");
    assert!(
        stderr.contains("shard-0") && stderr.contains("pinq: error:"),
        "the error names the shard directory; stderr:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic; stderr:\n{stderr}");
}

/// `path` written relative to the working directory (`../..` up to `/`, then the rest).
fn relative_to_cwd(path: &Path) -> std::path::PathBuf {
    let cwd = std::env::current_dir().expect("cwd");
    let mut rel = std::path::PathBuf::new();
    for _ in cwd.components().skip(1) {
        rel.push("..");
    }
    rel.join(path.strip_prefix("/").expect("absolute temp path"))
}

#[test]
fn a_relative_data_dir_works_as_the_default_dot_slash_data_does() {
    // `pinq serve` defaults to `./data`; glommio cannot open a relative directory for its fsync,
    // which once made every durable publish fail with "Bad file descriptor".
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = relative_to_cwd(&tmp.path().join("data"));
    assert!(data_dir.is_relative());
    let server = Server::start_in(&data_dir, &["--cpus", "0"], &[]);
    let sent = with_client(server.server_arg(), |client| async move {
        publish(&client, "relative", 3, 10, 100).await
    });
    let want = sent.len();
    let mut got = with_client(server.server_arg(), move |client| async move {
        receive_all(&client, "relative", want).await
    });
    got.dedup();
    let mut sent = sent;
    sent.sort();
    assert_eq!(got, sent, "durable publishes on a relative data dir");
}
