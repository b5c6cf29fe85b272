//! The storage engine's figures (issue 4), measured on `LsmStore` alone on real DMA files: no
//! sockets, no shards. Prints one line per figure; it is a measuring program, not a criterion
//! bench, because each figure is one long run (fdatasyncs, a 1 GiB WAL), not a micro-timing.
//!
//! ```text
//! cargo bench --bench storage                 # everything, 1 GiB recovery
//! PINQ_BENCH_WAL_MIB=256 cargo bench --bench storage
//! PINQ_BENCH_DIR=/mnt/nvme cargo bench --bench storage   # where the files go (default: $TMPDIR)
//! ```
//!
//! Figures: durable appends of 128 × 100-byte messages per batch (msgs/s, fdatasyncs per batch,
//! batch latency p50/p99/max) at 1, 4 and 16 concurrent writers; table bytes written by a
//! publish/ACK cycle inside one memtable; recovery time of a large WAL; disk use after a
//! publish/ACK cycle and a full compaction against the live data; write amplification.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use pinq::key::{EventKey, TopicHash};
use pinq::log::Command;
use pinq::message::{StoredMessage, Value};
use pinq::storage::{LsmOptions, LsmStats, LsmStore};
use pinq::storage::{Store, Sync};

const MESSAGES_PER_BATCH: u64 = 128;
const PAYLOAD_BYTES: usize = 100;

fn key(id: u64) -> EventKey {
    EventKey::new(TopicHash(7), id / 1000, id)
}

fn message() -> Value {
    Value::encode(&StoredMessage {
        topic: "bench".into(),
        payload: vec![0xAB; PAYLOAD_BYTES],
        enqueued_at_ms: 1_000,
        delay_ms: 0,
        ttl_ms: 0,
        headers: Vec::new(),
    })
    .expect("encode")
}

fn puts(first: u64, n: u64, value: &Value) -> Command {
    Command::Store {
        messages: (first..first + n)
            .map(|id| (key(id), value.clone()))
            .collect(),
        event_id_high_water: first + n - 1,
    }
}

fn deletes(first: u64, n: u64) -> Command {
    Command::Delete {
        keys: (first..first + n).map(key).collect(),
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn bench_root() -> PathBuf {
    std::env::var_os("PINQ_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// Durable appends from `writers` concurrent tasks, `batches` batches in all.
async fn durable_appends(root: &Path, writers: u64, batches: u64) {
    let dir = tempfile::tempdir_in(root).expect("tempdir");
    let store = Rc::new(
        LsmStore::open(dir.path(), LsmOptions::default())
            .await
            .expect("open"),
    );
    let value = message();
    let per_writer = batches / writers;
    let before = store.stats();
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let store = Rc::clone(&store);
            let value = value.clone();
            glommio::spawn_local(async move {
                let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
                for b in 0..per_writer {
                    let first = (w * per_writer + b) * MESSAGES_PER_BATCH;
                    let batch = puts(first, MESSAGES_PER_BATCH, &value);
                    let t = Instant::now();
                    store.commit(&batch, Sync::Durable).await.expect("write");
                    let _ = hist.record(t.elapsed().as_micros() as u64);
                }
                hist
            })
        })
        .collect();
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
    for task in tasks {
        hist.add(task.await).expect("merge histograms");
    }
    let elapsed = started.elapsed();
    let after = store.stats();
    let done = per_writer * writers;
    let msgs = done * MESSAGES_PER_BATCH;
    println!(
        "durable append, {writers:>2} writers: {done} batches of {MESSAGES_PER_BATCH} x {PAYLOAD_BYTES} B in {:.2} s = {:.0} msgs/s; \
         fdatasyncs {} ({:.3} per batch), writes {}; batch latency p50 {} us, p99 {} us, max {} us; flushes during the run {}",
        elapsed.as_secs_f64(),
        msgs as f64 / elapsed.as_secs_f64(),
        after.wal_fsyncs - before.wal_fsyncs,
        (after.wal_fsyncs - before.wal_fsyncs) as f64 / done as f64,
        after.wal_writes - before.wal_writes,
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.99),
        hist.max(),
        after.flushes - before.flushes,
    );
    store.close().await.expect("close");
}

/// Publish and ACK inside one memtable, then a flush: no table bytes.
async fn publish_ack_in_memtable(root: &Path) {
    let dir = tempfile::tempdir_in(root).expect("tempdir");
    let store = LsmStore::open(dir.path(), LsmOptions::default())
        .await
        .expect("open");
    let value = message();
    let batches = 200u64;
    for b in 0..batches {
        store
            .commit(
                &puts(b * MESSAGES_PER_BATCH, MESSAGES_PER_BATCH, &value),
                Sync::Durable,
            )
            .await
            .expect("publish");
    }
    for b in 0..batches {
        store
            .commit(
                &deletes(b * MESSAGES_PER_BATCH, MESSAGES_PER_BATCH),
                Sync::Buffered,
            )
            .await
            .expect("ack");
    }
    store.flush().await.expect("flush");
    let s = store.stats();
    println!(
        "publish+ACK in one memtable: {} messages, annihilated {}, flushes {}, table bytes written {}, tables {}, WAL record bytes {}",
        batches * MESSAGES_PER_BATCH,
        s.annihilated,
        s.flushes,
        s.flush_bytes_written,
        s.tables,
        s.wal_record_bytes
    );
    store.close().await.expect("close");
}

/// Fills a WAL of about `wal_bytes` with publish/ACK pairs (so the memtable stays small and
/// nothing is flushed), stops without flushing, and times the reopen.
async fn recovery(root: &Path, wal_bytes: u64) {
    let dir = tempfile::tempdir_in(root).expect("tempdir");
    let options = LsmOptions {
        wal_bytes_max: wal_bytes * 2,
        ..LsmOptions::default()
    };
    let value = message();
    let fill_started = Instant::now();
    {
        let store = LsmStore::open(dir.path(), options.clone())
            .await
            .expect("open");
        let mut b = 0u64;
        while store.stats().wal_record_bytes < wal_bytes {
            let first = b * MESSAGES_PER_BATCH;
            store
                .commit(&puts(first, MESSAGES_PER_BATCH, &value), Sync::Buffered)
                .await
                .expect("publish");
            store
                .commit(&deletes(first, MESSAGES_PER_BATCH), Sync::Buffered)
                .await
                .expect("ack");
            b += 1;
            if b % 64 == 0 {
                glommio::yield_if_needed().await;
            }
        }
        store.sync().await.expect("sync");
        let s = store.stats();
        assert_eq!(s.flushes, 0, "the WAL must not be released by a flush");
        store.close_unflushed().await.expect("close");
    }
    let fill = fill_started.elapsed();
    let on_disk = dir_bytes(dir.path());
    let started = Instant::now();
    let store = LsmStore::open(dir.path(), options).await.expect("reopen");
    let elapsed = started.elapsed();
    let r = store.stats().recovery;
    println!(
        "recovery: WAL of {:.0} MiB ({} segments read, {:.0} MiB files incl. preallocation, {} records) replayed in {:.2} s ({:.0} MiB/s); writing it took {:.1} s",
        r.wal_bytes_read as f64 / f64::from(1 << 20),
        r.segments_read,
        on_disk as f64 / f64::from(1 << 20),
        r.records_replayed,
        elapsed.as_secs_f64(),
        r.wal_bytes_read as f64 / f64::from(1 << 20) / elapsed.as_secs_f64(),
        fill.as_secs_f64(),
    );
    store.close().await.expect("close");
}

/// Publishes `messages` (memtable small enough that tables form), ACKs all but one in ten a
/// while later (so most deletes meet flushed puts: tombstones), then flushes and compacts.
/// Reports disk use against the live data and the write amplification.
async fn publish_ack_cycle_space(root: &Path, messages: u64) {
    let dir = tempfile::tempdir_in(root).expect("tempdir");
    let options = LsmOptions {
        memtable_bytes_max: 4 << 20,
        ..LsmOptions::default()
    };
    let store = LsmStore::open(dir.path(), options).await.expect("open");
    let value = message();
    let batches = messages / MESSAGES_PER_BATCH;
    // ACKs trail publishes by this many batches (about 2 memtables), as a consumer backlog.
    let lag = 2 * (4 << 20) / (MESSAGES_PER_BATCH * (value.len() as u64 + 24 + 64));
    let mut user_bytes = 0u64;
    let ack = |b: u64| Command::Delete {
        keys: (b * MESSAGES_PER_BATCH..(b + 1) * MESSAGES_PER_BATCH)
            .filter(|id| id % 10 != 0)
            .map(key)
            .collect(),
    };
    for b in 0..batches + lag {
        if b < batches {
            store
                .commit(
                    &puts(b * MESSAGES_PER_BATCH, MESSAGES_PER_BATCH, &value),
                    Sync::Durable,
                )
                .await
                .expect("publish");
            user_bytes += MESSAGES_PER_BATCH * (24 + value.len() as u64);
        }
        if b >= lag {
            let batch = ack(b - lag);
            user_bytes += batch.len() as u64 * 24;
            store.commit(&batch, Sync::Buffered).await.expect("ack");
        }
    }
    store.flush().await.expect("flush");
    let before_compaction = dir_bytes(dir.path());
    let s1 = store.stats();
    store.compact_all().await.expect("compact");
    // Files of replaced tables are removed once no reader holds them.
    glommio::timer::sleep(Duration::from_millis(50)).await;
    let after_compaction = dir_bytes(dir.path());
    let s = store.stats();
    let live = store.scan(&[], None, usize::MAX).await.expect("scan");
    let live_bytes: u64 = live.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum();
    let written = s.wal_bytes_written + s.flush_bytes_written + s.compaction_bytes_written;
    println!(
        "publish/ACK cycle: {} published, {} live ({} B of keys+values); tables before compaction {} ({} B, {} tombstones), \
         directory {} B; after compaction: tables {} ({} B), directory {} B = {:.2}x live data (tables alone {:.2}x)",
        batches * MESSAGES_PER_BATCH,
        live.len(),
        live_bytes,
        s1.tables,
        s1.table_bytes,
        s1.table_tombstones,
        before_compaction,
        s.tables,
        s.table_bytes,
        after_compaction,
        after_compaction as f64 / live_bytes as f64,
        s.table_bytes as f64 / live_bytes as f64,
    );
    println!(
        "write amplification: user bytes {user_bytes} (keys+values of puts, keys of deletes); written: WAL {} (+ {} zero-fill), \
         tables by flush {}, by compaction {}; total/user = {:.2} (with zero-fill {:.2}); annihilated {}, tombstones {}",
        s.wal_bytes_written,
        s.wal_zero_fill_bytes,
        s.flush_bytes_written,
        s.compaction_bytes_written,
        written as f64 / user_bytes as f64,
        (written + s.wal_zero_fill_bytes) as f64 / user_bytes as f64,
        s.annihilated,
        s.tombstones,
    );
    print_stats_line(&s);
    store.close().await.expect("close");
}

fn print_stats_line(s: &LsmStats) {
    println!(
        "  (flushes {}, compactions {}, compaction read {} B, tombstones dropped {}, write stalls {})",
        s.flushes,
        s.compactions,
        s.compaction_bytes_read,
        s.compaction_tombstones_dropped,
        s.write_stalls
    );
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken from the command line.
    let wal_mib: u64 = std::env::var("PINQ_BENCH_WAL_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let only = std::env::var("PINQ_BENCH_ONLY").unwrap_or_default();
    let root = bench_root();
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spawn(move || async move {
            if only.is_empty() || only == "append" {
                for writers in [1, 4, 16] {
                    durable_appends(&root, writers, 2048).await;
                }
            }
            if only.is_empty() || only == "memtable" {
                publish_ack_in_memtable(&root).await;
            }
            if only.is_empty() || only == "space" {
                publish_ack_cycle_space(&root, 256 * 1024).await;
            }
            if only.is_empty() || only == "recovery" {
                recovery(&root, wal_mib << 20).await;
            }
        })
        .expect("executor starts")
        .join()
        .expect("bench runs");
}
