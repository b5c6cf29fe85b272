//! WAL recovery rules with a real `pinq serve` process (README "WAL recovery"): durable batches
//! are published, the server is killed with SIGKILL, the log is damaged on purpose, and the
//! restart must give the documented outcome:
//! - a flipped byte in the middle of the last segment, or anywhere in a segment that is not the
//!   last, stops start-up with an error naming the file and byte offset, and every file of the
//!   data directory is byte-for-byte what it was before the refused start;
//! - a flipped byte in the last record, or a last write torn (its later sectors never reached
//!   the disk), is a torn tail: it is cut off with a warning naming the byte offset and the
//!   records dropped, `/healthz` says `degraded` until the next restart, and every earlier batch
//!   is delivered;
//! - a segment shorter than it was written (cut inside its first record, inside its last, or at
//!   a record boundary in the middle of the log) stops start-up naming the file and what is
//!   missing, changing no file, until `--recover-truncated-wal` accepts the loss.
//!
//! Each publish is one durable batch awaited before the next, so each is one log record.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use pinq::client::{AckLevel, PublishMessage};
use pinq::log::wal::{parse_segment_name, SegmentReader, RECORD_HEADER_BYTES};
use support::{http_get, with_client, Server};

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

/// Every file of the data directory and its bytes, but the lock file (it holds the pid of the
/// last broker that opened the directory: process state, not data).
fn snapshot(data_dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![data_dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.file_name().is_some_and(|n| n == "pinq.lock") {
                continue;
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
fn start_expecting_failure_with(data_dir: &Path, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut child = Command::new(support::pinq_bin())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--metrics-listen", "127.0.0.1:0", "--cpus", "0"])
        .arg("--data-dir")
        .arg(data_dir)
        .envs(env.iter().copied())
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
    assert_refused_saying(data_dir, &ENV, file, &format!("at byte {offset}"));
}

/// Expects a refused start whose error names `file` and says `says`, and that no file changed.
/// Returns the error output.
fn assert_refused_saying(data_dir: &Path, env: &[(&str, &str)], file: &Path, says: &str) -> String {
    let before = snapshot(data_dir);
    let (code, stderr) = start_expecting_failure_with(data_dir, env);
    assert_eq!(code, Some(1), "stderr:\n{stderr}");
    let name = file.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(
        stderr.contains(name) && stderr.contains(says),
        "the error names {name} and says {says:?}; stderr:\n{stderr}"
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
    stderr
}

fn cut(path: &Path, len: usize) {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open segment");
    file.set_len(len as u64).expect("truncate");
}

/// `/healthz` once the shards have published their first snapshot (bounded wait).
fn healthz(server: &Server) -> (u16, String) {
    let addr = server.metrics_addr.expect("metrics endpoint");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = http_get(addr, "/healthz");
        if status == 200 || std::time::Instant::now() > deadline {
            return (status, body);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The server's output lines that contain every one of `words`.
/// The server's output lines holding all of `words`, waiting up to 10 s for one: stdout (where
/// the listening line that ends the start-up wait goes) and stderr (the warnings) are read by
/// two threads, so a warning logged before the listening line may still be on its way.
fn lines_with(server: &Server, words: &[&str]) -> Vec<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let found: Vec<String> = server
            .drain_output()
            .into_iter()
            .filter(|l| words.iter().all(|w| l.contains(w)))
            .collect();
        if !found.is_empty() || std::time::Instant::now() > deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Restarts on `data_dir` (after a kill) and expects `/healthz` to be a plain `ok` again: a
/// dropped tail is reported until the next restart only.
fn restart_is_healthy(data_dir: &Path, env: &[(&str, &str)]) {
    let server = Server::start_in(data_dir, &["--cpus", "0"], env);
    let (status, body) = healthz(&server);
    assert_eq!((status, body.as_str()), (200, "ok\n"));
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
fn a_last_segment_cut_inside_its_last_record_is_refused_until_the_loss_is_accepted() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    publish_then_kill(&data_dir);
    let segs = segments(&data_dir);
    let (last, offsets) = segs.last().expect("a segment with records");
    let at = *offsets.last().expect("records");
    cut(last, at + RECORD_HEADER_BYTES + 10);
    let stderr = assert_refused_saying(&data_dir, &ENV, last, "shorter than it was written");
    assert!(stderr.contains("--recover-truncated-wal"), "{stderr}");
    assert!(stderr.contains(&format!("from byte {at}")), "{stderr}");
    let mut server = Server::start_in(&data_dir, &["--cpus", "0", "--recover-truncated-wal"], &ENV);
    let got = receive_batches(server.server_arg());
    assert_eq!(got, (0..BATCHES - 1).collect::<Vec<_>>());
    let (status, body) = healthz(&server);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("degraded") && body.contains("truncated WAL accepted"),
        "{body}"
    );
    assert!(
        !lines_with(
            &server,
            &["WARN", &format!("at byte {at}"), "1 record(s) dropped"]
        )
        .is_empty(),
        "the loss is logged with its offset and count"
    );
    server.kill9();
    restart_is_healthy(&data_dir, &ENV);
}

/// The case: one durable batch of 5,000 messages is one record, and its segment is cut
/// to 44,867 bytes, inside that first record. It used to start with `records_replayed=0` and
/// `/healthz` 200, the 5,000 acknowledged messages gone.
#[test]
fn a_segment_cut_inside_its_first_record_is_refused_naming_the_file() {
    const MESSAGES: usize = 5_000;
    let env = [("PINQ_PUBLISH_MAX_BATCH_MESSAGES", "10000")];
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let mut server = Server::start_in(&data_dir, &["--cpus", "0"], &env);
    with_client(server.server_arg(), |client| async move {
        let messages: Vec<PublishMessage> = (0..MESSAGES)
            .map(|m| PublishMessage::new("wal", format!("m{m:05}-payload").into_bytes()))
            .collect();
        client
            .publish(&messages, AckLevel::Durable)
            .await
            .expect("durable publish");
    });
    server.kill9();
    let segs = segments(&data_dir);
    assert_eq!(segs.len(), 1, "one segment");
    let (segment, offsets) = &segs[0];
    assert_eq!(offsets.len(), 1, "the batch is one record");
    let len = std::fs::metadata(segment).expect("stat").len();
    assert!(len > 44_867, "the segment is {len} bytes");
    cut(segment, 44_867);
    let stderr =
        assert_refused_saying(&data_dir, &env, segment, "ends at byte 44867 inside record");
    assert!(
        stderr.contains("missing"),
        "the header's length is checked too: {stderr}"
    );

    // Accepting the loss starts the broker, says what was dropped, and reports it.
    let server = Server::start_in(&data_dir, &["--cpus", "0", "--recover-truncated-wal"], &env);
    let (status, body) = healthz(&server);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("degraded") && body.contains("1 record(s) dropped"),
        "{body}"
    );
    assert!(
        !lines_with(
            &server,
            &["WARN", "truncated WAL accepted", "1 record(s) dropped"]
        )
        .is_empty(),
        "the accepted loss is logged"
    );
}

/// A segment in the middle of the log cut at a record boundary: every record in it reads
/// cleanly, only its header tells that it was longer. Accepting the loss keeps the records
/// before the cut, sets the later segments aside and counts every record dropped.
#[test]
fn a_segment_cut_at_a_record_boundary_mid_log_is_refused_until_the_loss_is_accepted() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    publish_then_kill(&data_dir);
    let segs = segments(&data_dir);
    assert!(segs.len() >= 3, "{} segments with records", segs.len());
    let (victim, offsets) = &segs[1];
    let kept_here = offsets.len() / 2;
    let kept = segs[0].1.len() + kept_here;
    cut(victim, offsets[kept_here]);
    let stderr = assert_refused_saying(&data_dir, &ENV, victim, "shorter than it was written");
    assert!(stderr.contains("header records"), "{stderr}");

    let mut server = Server::start_in(&data_dir, &["--cpus", "0", "--recover-truncated-wal"], &ENV);
    let dropped = BATCHES - kept;
    assert!(
        !lines_with(
            &server,
            &[
                "WARN",
                &format!("at byte {}", offsets[kept_here]),
                &format!("{dropped} record(s) dropped")
            ]
        )
        .is_empty(),
        "the loss is logged with its offset and exact count"
    );
    let got = receive_batches(server.server_arg());
    assert_eq!(got, (0..kept).collect::<Vec<_>>());
    let set_aside = std::fs::read_dir(data_dir.join("shard-0"))
        .expect("shard dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".log.dropped"))
        .count();
    assert_eq!(
        set_aside,
        segs.len() - 2,
        "every later segment is set aside"
    );
    server.kill9();
    restart_is_healthy(&data_dir, &ENV);
}

/// A torn last write: the sectors after the start of the last record never reached the disk
/// (they still hold the preallocated zeros), the file keeps its length. Started without a
/// flag, with a warning naming the offset and count, `/healthz` degraded until a restart.
#[test]
fn a_torn_last_write_is_cut_with_a_warning_and_reported_degraded_until_restart() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    publish_then_kill(&data_dir);
    let segs = segments(&data_dir);
    let (last, offsets) = segs.last().expect("a segment with records");
    let at = *offsets.last().expect("records");
    let mut bytes = std::fs::read(last).expect("read");
    let from = at + RECORD_HEADER_BYTES + 8;
    let block_end = from.div_ceil(4096) * 4096;
    bytes[from..block_end].fill(0);
    std::fs::write(last, &bytes).expect("write");

    let mut server = Server::start_in(&data_dir, &["--cpus", "0"], &ENV);
    let got = receive_batches(server.server_arg());
    assert_eq!(got, (0..BATCHES - 1).collect::<Vec<_>>());
    assert!(
        !lines_with(
            &server,
            &[
                "WARN",
                "torn WAL tail cut",
                &format!("at byte {at}"),
                "1 record(s) dropped"
            ]
        )
        .is_empty(),
        "the torn tail is logged with its offset and count"
    );
    let (status, body) = healthz(&server);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("degraded") && body.contains(&format!("at byte {at}")),
        "{body}"
    );
    server.kill9();
    restart_is_healthy(&data_dir, &ENV);
}
