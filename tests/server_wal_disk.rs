//! The WAL's disk use stays within `storage.walMaxBytes` (+10 %) under kill -9 churn, for
//! segment sizes across the range the configuration allows, measured as the blocks the segment
//! files take (st_blocks: preallocated and zero-filled space included, not file lengths).
//!
//! Each round starts `pinq serve` on the same data directory, runs durable publishers and a
//! consumer that ACKs everything (publish/ACK pairs annihilate in the memtable, so only the WAL
//! cap makes the log release segments), and kills the broker with SIGKILL in the middle of it.
//! A sampler thread measures the WAL's blocks every few milliseconds throughout, restarts
//! included (recovery replays the log and keeps its segments).
//!
//! Regression (issue 25): the WAL took 1.47x the cap under this churn; a closed 64 MiB segment
//! took 72 MiB and segments of 8 MiB or less took twice their size.
//!
//! Clustered, the same bound holds for the Raft log of the leader and of each follower (issue
//! 21 part 7: a follower used to append whatever its leader sent, the cap only compacting).

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, PublishMessage};
use support::cluster::Cluster;
use support::{with_client, Server};

const WAL_MAX_BYTES: u64 = 8 << 20;
const ROUNDS: usize = 5;
/// Load before each kill.
const ROUND: Duration = Duration::from_millis(2_500);
/// Bound on one round's load loop, should the kill not end it.
const LOAD_MAX: Duration = Duration::from_secs(20);
const PUBLISHERS: usize = 4;
const MESSAGES_PER_BATCH: usize = 32;
const PAYLOAD_BYTES: usize = 1_000;

/// Blocks (in bytes) the WAL segments of every shard under `data_dir` take now.
fn wal_disk_bytes(data_dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(shards) = std::fs::read_dir(data_dir) else {
        return 0;
    };
    let mut total = 0;
    for shard in shards.flatten() {
        let Ok(files) = std::fs::read_dir(shard.path()) else {
            continue;
        };
        for file in files.flatten() {
            let name = file.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("wal-") && name.ends_with(".log") {
                // A segment removed between the listing and the stat takes nothing.
                if let Ok(meta) = std::fs::metadata(file.path()) {
                    total += meta.blocks() * 512;
                }
            }
        }
    }
    total
}

/// Durable publishers and an ACKing consumer until the broker goes away (or `for_at_most`).
fn load(addr: String, for_at_most: Duration) {
    with_client(addr, move |client| async move {
        let deadline = Instant::now() + for_at_most;
        let client = std::rc::Rc::new(client);
        let mut tasks = Vec::new();
        for p in 0..PUBLISHERS {
            let client = std::rc::Rc::clone(&client);
            tasks.push(glommio::spawn_local(async move {
                let payload = vec![b'x'; PAYLOAD_BYTES];
                let mut batch = 0u64;
                while Instant::now() < deadline {
                    let messages: Vec<PublishMessage> = (0..MESSAGES_PER_BATCH)
                        .map(|_| PublishMessage::new("disk", payload.clone()))
                        .collect();
                    if client.publish(&messages, AckLevel::Durable).await.is_err() {
                        return;
                    }
                    batch += 1;
                }
                let _ = (p, batch);
            }));
        }
        let consumer = {
            let client = std::rc::Rc::clone(&client);
            glommio::spawn_local(async move {
                let Ok(sub) = client.subscribe("disk", "g", 1024).await else {
                    return;
                };
                while Instant::now() < deadline {
                    let batch = futures_lite::future::or(
                        async { Some(sub.recv_batch(512).await.unwrap_or_default()) },
                        async {
                            glommio::timer::sleep(Duration::from_millis(50)).await;
                            None
                        },
                    )
                    .await;
                    match batch {
                        None => continue,
                        Some(batch) if batch.is_empty() => return,
                        Some(batch) => {
                            let tags: Vec<_> = batch.iter().map(|d| d.tag).collect();
                            if sub.ack(&tags).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            })
        };
        for task in tasks {
            task.await;
        }
        consumer.await;
    });
}

/// Samples `wal_disk_bytes(dir)` every 5 ms until `stop`; returns the largest figure.
fn sample_peak(dir: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut peak = 0;
        while !stop.load(Ordering::Relaxed) {
            peak = peak.max(wal_disk_bytes(&dir));
            std::thread::sleep(Duration::from_millis(5));
        }
        peak.max(wal_disk_bytes(&dir))
    })
}

/// Runs the churn with `segment_bytes`; returns the most the WAL took on disk at any sample.
fn churn(segment_bytes: &str) -> u64 {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir: PathBuf = tmp.path().join("data");
    let env = [
        ("PINQ_STORAGE_WAL_SEGMENT_BYTES", segment_bytes),
        ("PINQ_STORAGE_WAL_MAX_BYTES", "8MiB"),
        ("PINQ_STORAGE_MEMTABLE_BYTES", "8MiB"),
        ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "16KiB"),
        ("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "10ms"),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_peak(data_dir.clone(), Arc::clone(&stop));
    for _ in 0..ROUNDS {
        let mut server = Server::start_in(&data_dir, &["--cpus", "0"], &env);
        let addr = server.server_arg();
        let loader = std::thread::spawn(move || load(addr, LOAD_MAX));
        std::thread::sleep(ROUND);
        server.kill9();
        loader.join().expect("load thread");
    }
    stop.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler")
}

#[test]
fn wal_disk_use_stays_within_wal_max_bytes_under_kill9_churn_for_every_segment_size() {
    let bound = WAL_MAX_BYTES + WAL_MAX_BYTES / 10;
    let mut peaks = Vec::new();
    for segment_bytes in ["64KiB", "1MiB", "8MiB", "64MiB", "16GiB"] {
        let peak = churn(segment_bytes);
        eprintln!(
            "walSegmentBytes {segment_bytes}: WAL peak {peak} bytes on disk ({:.2} of walMaxBytes {WAL_MAX_BYTES})",
            peak as f64 / WAL_MAX_BYTES as f64
        );
        peaks.push((segment_bytes, peak));
    }
    for (segment_bytes, peak) in &peaks {
        assert!(
            *peak <= bound,
            "walSegmentBytes {segment_bytes}: the WAL took {peak} bytes on disk, above {bound} (walMaxBytes {WAL_MAX_BYTES} + 10 %); all: {peaks:?}"
        );
    }
    // The load reached the cap (else the bound was never tested).
    assert!(
        peaks.iter().all(|(_, peak)| *peak >= WAL_MAX_BYTES / 2),
        "the load must take the WAL near its cap: {peaks:?}"
    );
}

#[test]
fn every_member_of_a_cluster_keeps_its_raft_log_within_wal_max_bytes() {
    let env = [
        ("PINQ_STORAGE_WAL_SEGMENT_BYTES", "1MiB"),
        ("PINQ_STORAGE_WAL_MAX_BYTES", "8MiB"),
        ("PINQ_STORAGE_MEMTABLE_BYTES", "8MiB"),
        ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "16KiB"),
        ("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "10ms"),
    ];
    let cluster = Cluster::start(3, &env);
    let ids = cluster.ids();
    let leader = cluster.wait_for_leader(0, &ids, Duration::from_secs(30));
    let stop = Arc::new(AtomicBool::new(false));
    let samplers: Vec<_> = ids
        .iter()
        .map(|&id| sample_peak(cluster.member(id).data_dir.clone(), Arc::clone(&stop)))
        .collect();
    load(cluster.addr(leader), Duration::from_secs(8));
    stop.store(true, Ordering::Relaxed);
    let peaks: Vec<(u64, u64)> = ids
        .iter()
        .zip(samplers)
        .map(|(&id, sampler)| (id, sampler.join().expect("sampler")))
        .collect();
    eprintln!(
        "leader {leader}; WAL peaks on disk by node: {peaks:?} (walMaxBytes {WAL_MAX_BYTES})"
    );
    // Measured (9 runs): at most 1.06x with the bound kept; without it (a follower appending
    // whatever its leader sent, a leader's commits never waiting) 1.09-1.23x in every run.
    let bound = WAL_MAX_BYTES + WAL_MAX_BYTES * 8 / 100;
    for (id, peak) in &peaks {
        assert!(
            *peak <= bound,
            "node {id} (leader {leader}): its Raft log took {peak} bytes on disk, above {bound} (walMaxBytes + 8 %); all: {peaks:?}"
        );
        assert!(
            *peak >= WAL_MAX_BYTES / 2,
            "node {id}: the load must take every log near its cap: {peaks:?}"
        );
    }
}
