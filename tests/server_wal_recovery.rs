//! WAL recovery rules with a real `pinq serve` process (README "WAL recovery"): durable batches
//! are published, the server is killed with SIGKILL, the log is damaged on purpose, and the
//! restart must give the documented outcome:
//! - a flipped byte in the middle of the last segment, or anywhere in a segment that is not the
//!   last, stops start-up with an error naming the file and byte offset, and every file of the
//!   data directory is byte-for-byte what it was before the refused start;
//! - a flipped byte in the last record, or a last segment cut short inside its last record, is
//!   a torn tail: it is cut off and every earlier batch is delivered.
//!
//! Each publish is one durable batch awaited before the next, so each is one log record.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use pinq::client::{AckLevel, PublishMessage};
use pinq::log::wal::{parse_segment_name, SegmentReader, RECORD_HEADER_BYTES};
use support::{with_client, Server};

const BATCHES: usize = 40;
const PER_BATCH: usize = 5;
/// Small segments (each commit takes a 4 KiB block): the batches span several segments.
const ENV: [(&str, &str); 2] = [
    ("PINQ_STORAGE_WAL_SEGMENT_BYTES", "64KiB"),
    ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "4KiB"),
];

/// Starts a server, publishes `BATCHES` durable batches one at a time, kills it with SIGKILL.
fn publish_then_kill(data_dir: &Path) {
    let mut server = Server::start_in(data_dir, &["--cpus", "0"], &ENV);
    with_client(server.server_arg(), |client| async move {
        for b in 0..BATCHES {
            let messages: Vec<PublishMessage> = (0..PER_BATCH)
                .map(|m| PublishMessage::new("wal", format!("b{b:03}-m{m}").into_bytes()))
                .collect();
            client
                .publish(&messages, AckLevel::Durable)
                .await
                .expect("durable publish");
        }
    });
    server.kill9();
}

/// Receives what `topic` holds (group `g`) until nothing more comes for a while.
fn receive_batches(addr: String) -> Vec<usize> {
    with_client(addr, |client| async move {
        let sub = client.subscribe("wal", "g", 4096).await.expect("subscribe");
        let mut got: BTreeMap<usize, usize> = BTreeMap::new();
        loop {
            let batch = futures_lite::future::or(
                async { sub.recv_batch(1024).await.unwrap_or_default() },
                async {
                    glommio::timer::sleep(Duration::from_secs(2)).await;
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
                *got.entry(b).or_default() += 1;
            }
        }
        assert!(
            got.values().all(|&n| n == PER_BATCH),
            "batches whole: {got:?}"
        );
        got.into_keys().collect()
    })
}

/// The WAL segments of shard 0 that hold records, oldest first, with their record offsets.
fn segments(data_dir: &Path) -> Vec<(PathBuf, Vec<usize>)> {
    let shard = data_dir.join("shard-0");
    let mut out: Vec<(u64, PathBuf, Vec<usize>)> = std::fs::read_dir(&shard)
        .expect("shard dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let first = parse_segment_name(p.file_name()?.to_str()?)?;
            let bytes = std::fs::read(&p).ok()?;
            let mut reader = SegmentReader::new(&bytes);
            let offsets: Vec<usize> =
                std::iter::from_fn(|| reader.next_record().map(|(at, _)| at)).collect();
            Some((first, p, offsets))
        })
        .filter(|(_, _, offsets)| !offsets.is_empty())
        .collect();
    out.sort();
    out.into_iter().map(|(_, p, o)| (p, o)).collect()
}

/// Every file of the data directory and its bytes.
fn snapshot(data_dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![data_dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                out.insert(path.clone(), std::fs::read(&path).expect("read file"));
            }
        }
    }
    out
}

fn flip(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).expect("read segment");
    bytes[at] ^= 0x20;
    std::fs::write(path, &bytes).expect("write segment");
}

/// Starts `pinq serve` on `data_dir` expecting it to refuse; returns its exit code and stderr.
fn start_expecting_failure(data_dir: &Path) -> (Option<i32>, String) {
    let mut child = Command::new(support::pinq_bin())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--metrics-listen", "127.0.0.1:0", "--cpus", "0"])
        .arg("--data-dir")
        .arg(data_dir)
        .envs(ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pinq serve");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().ok().flatten().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("pinq serve kept running on a corrupt WAL");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("wait");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Damages the log with `damage`, expects a refused start that names `file` and the offset, and
/// checks that no file changed.
fn assert_refused_unchanged(data_dir: &Path, file: &Path, offset: usize) {
    let before = snapshot(data_dir);
    let (code, stderr) = start_expecting_failure(data_dir);
    assert_eq!(code, Some(1), "stderr:\n{stderr}");
    let name = file.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(
        stderr.contains(name) && stderr.contains(&format!("at byte {offset}")),
        "the error names {name} and byte {offset}; stderr:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic; stderr:\n{stderr}");
    let after = snapshot(data_dir);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>(),
        "a refused start adds or removes no file"
    );
    for (path, bytes) in &before {
        assert!(
            after.get(path) == Some(bytes),
            "a refused start changed {}",
            path.display()
        );
    }
}

#[test]
fn a_flip_in_the_middle_of_the_last_segment_refuses_start_and_changes_no_file() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    publish_then_kill(&data_dir);
    let segs = segments(&data_dir);
    let (last, offsets) = segs.last().expect("a segment with records");
    assert!(
        offsets.len() >= 3,
        "{} records in the last segment",
        offsets.len()
    );
    let victim = offsets[offsets.len() / 2];
    flip(last, victim + RECORD_HEADER_BYTES + 20);
    assert_refused_unchanged(&data_dir, last, victim);
}

#[test]
fn a_flip_in_a_segment_that_is_not_the_last_refuses_start_and_changes_no_file() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    publish_then_kill(&data_dir);
    let segs = segments(&data_dir);
    assert!(segs.len() >= 2, "{} segments with records", segs.len());
    // The last record of a segment that is not the last: a torn tail it cannot be.
    let (first, offsets) = &segs[0];
    let victim = *offsets.last().expect("records");
    flip(first, victim + RECORD_HEADER_BYTES + 20);
    assert_refused_unchanged(&data_dir, first, victim);
}

#[test]
fn a_flip_in_the_last_record_is_a_torn_tail_and_every_earlier_batch_is_delivered() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    publish_then_kill(&data_dir);
    let segs = segments(&data_dir);
    let (last, offsets) = segs.last().expect("a segment with records");
    flip(
        last,
        offsets.last().expect("records") + RECORD_HEADER_BYTES + 20,
    );
    let server = Server::start_in(&data_dir, &["--cpus", "0"], &ENV);
    let got = receive_batches(server.server_arg());
    assert_eq!(got, (0..BATCHES - 1).collect::<Vec<_>>());
}

#[test]
fn a_last_segment_cut_inside_its_last_record_is_a_torn_tail() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    publish_then_kill(&data_dir);
    let segs = segments(&data_dir);
    let (last, offsets) = segs.last().expect("a segment with records");
    let cut = offsets.last().expect("records") + RECORD_HEADER_BYTES + 10;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(last)
        .expect("open segment");
    file.set_len(cut as u64).expect("truncate");
    drop(file);
    let server = Server::start_in(&data_dir, &["--cpus", "0"], &ENV);
    let got = receive_batches(server.server_arg());
    assert_eq!(got, (0..BATCHES - 1).collect::<Vec<_>>());
}
