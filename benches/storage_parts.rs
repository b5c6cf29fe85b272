//! Parts of the LSM engine alone, at pinq's sizes: 24-byte event keys of one topic in publish
//! order, values that are rkyv-archived messages with 100-byte payloads, the engine's default
//! options (`LsmOptions::default()`: 16 KiB blocks, 10 bloom bits a key, 64 MiB WAL segments).
//!
//! - `wal/encode_record`: frames a store command of 128 messages as one WAL record with its CRC32C, into a
//!   reused buffer; `wal/decode_frame`: checks such a record's length and CRC, as recovery does;
//!   both per put.
//! - `wal/append_durable`: `Wal::append` of one 128-put batch and `Wal::wait_durable` for it
//!   (the writer task's write and fdatasync, one record per commit), per batch. Real disk I/O.
//! - `memtable/insert/<n>`: `Memtable::apply` of n entries in batches of 128 into a new
//!   memtable, per entry; `memtable/scan/<n>`: an ordered walk of all n entries with
//!   `Memtable::range` over the topic's keys, per entry.
//! - `table/build/10000`: `TableBuilder` over 10,000 entries in memory (blocks, checksums, index,
//!   bloom, footer), per entry; `table/write/10000`: the same through `TableWriter` to a new DMA
//!   file, with its fdatasync, per entry; `table/scan_range/1000_of_100000`: a `TableCursor` over
//!   1,000 entries in the middle of a 100,000-entry table opened once (blocks are read from the
//!   file with direct I/O each time: the table keeps only its last block), per entry.
//!
//! DMA-file work runs in one glommio executor made once on this thread (after `probe_disk`, see
//! `storage::io`), measured with `iter_custom`. Files go to `$PINQ_BENCH_DIR` (default
//! `$TMPDIR`), which must be on a disk that supports O_DIRECT. Run with
//! `cargo bench --bench storage_parts`.

use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use glommio::{LocalExecutor, LocalExecutorBuilder, Placement};
use std::hint::black_box;

use pinq::key::{EventKey, TopicHash};
use pinq::log::wal::{self, Frame, Wal};
use pinq::log::Command;
use pinq::message::{Header, StoredMessage, Value};
use pinq::storage::io::probe_disk;
use pinq::storage::memtable::Memtable;
use pinq::storage::table::block::EntryRef;
use pinq::storage::table::{Table, TableBuilder, TableCursor, TableWriter};
use pinq::storage::LsmOptions;
use pinq::storage::WriteBatch;

const TOPIC: &str = "orders";
const PAYLOAD_BYTES: usize = 100;
const BATCH_LEN: usize = 128;
const BUILD_ENTRIES: u64 = 10_000;
const SCAN_TABLE_ENTRIES: u64 = 100_000;
const SCAN_RANGE_ENTRIES: u64 = 1_000;

fn value(i: u64) -> Value {
    Value::encode(&StoredMessage {
        topic: TOPIC.into(),
        payload: vec![(i % 251) as u8; PAYLOAD_BYTES],
        enqueued_at_ms: 1_700_000_000_000 + i,
        delay_ms: 0,
        ttl_ms: 0,
        headers: vec![Header {
            key: "trace".into(),
            value: b"0123456789abcdef".to_vec(),
        }],
    })
    .expect("a small message encodes")
}

/// The key of the `i`-th message of the topic: one due bucket a second, publish order.
fn key(i: u64) -> EventKey {
    EventKey::new(TopicHash::of(TOPIC), 1_700_000_000 + i / 1_000, i)
}

/// Batches of `BATCH_LEN` puts for entries `0..n`; every value shares one archive (an `Arc`).
fn batches(n: u64) -> Vec<WriteBatch> {
    let shared = value(0);
    let mut out = Vec::new();
    let mut batch = WriteBatch::new();
    for i in 0..n {
        batch.put(key(i).to_key(), shared.clone());
        if batch.len() == BATCH_LEN {
            out.push(std::mem::take(&mut batch));
        }
    }
    if !batch.is_empty() {
        out.push(batch);
    }
    out
}

fn bench_root() -> PathBuf {
    std::env::var_os("PINQ_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// One executor on this thread for every DMA-file bench, probed for the bench directory.
struct Io {
    executor: LocalExecutor,
    dir: tempfile::TempDir,
}

impl Io {
    fn new() -> Io {
        let executor = LocalExecutorBuilder::new(Placement::Unbound)
            .name("bench-storage-parts")
            .make()
            .expect("a glommio executor");
        let dir = tempfile::tempdir_in(bench_root()).expect("a bench directory");
        executor
            .run(probe_disk(dir.path()))
            .expect("probe the bench disk");
        Io { executor, dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

fn wal_benches(c: &mut Criterion, io: &Io) {
    let options = LsmOptions::default();
    let mut group = c.benchmark_group("wal");
    let shared = value(0);
    let batch = Command::Store {
        messages: (0..BATCH_LEN as u64)
            .map(|i| (key(i), shared.clone()))
            .collect(),
        event_id_high_water: BATCH_LEN as u64,
    };
    assert_eq!(batch.len(), BATCH_LEN);

    group.throughput(Throughput::Elements(BATCH_LEN as u64));
    let mut out = Vec::with_capacity(64 << 10);
    let mut seq = 0u64;
    group.bench_function("encode_record", |b| {
        b.iter(|| {
            out.clear();
            seq += 1;
            black_box(wal::encode_record(seq, black_box(&batch), &mut out).expect("a small batch"))
        })
    });

    let mut record = Vec::new();
    wal::encode_record(7, &batch, &mut record).expect("a small batch");
    group.bench_function("decode_frame", |b| {
        b.iter(|| match wal::decode_frame(black_box(&record)) {
            Ok(Frame::Record(r, len)) => black_box((r.seq, len)),
            other => panic!("the record decodes: {other:?}"),
        })
    });

    let wal_dir = io.path().join("wal");
    std::fs::create_dir_all(&wal_dir).expect("the WAL directory");
    let log = Rc::new(Wal::new(
        &wal_dir,
        1,
        Vec::new(),
        options.wal_segment_bytes_max,
        options.wal_preallocate_bytes,
    ));
    io.executor.run(async { log.start() });
    group.throughput(Throughput::Elements(1));
    group.bench_function("append_durable", |b| {
        b.iter_custom(|iters| {
            io.executor.run(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let seq = log.append(&batch).expect("append to a healthy log");
                    log.wait_durable(seq).await.expect("the record is synced");
                }
                start.elapsed()
            })
        })
    });
    log.request_shutdown();
    group.finish();
}

fn memtable_benches(c: &mut Criterion) {
    let mut group = c.benchmark_group("memtable");
    for n in [10_000u64, 100_000] {
        group.throughput(Throughput::Elements(n));
        let input = batches(n);
        group.bench_with_input(BenchmarkId::new("insert", n), &input, |b, input| {
            b.iter_batched(
                || input.clone(),
                |batches| {
                    let mut memtable = Memtable::new();
                    for (seq, batch) in batches.into_iter().enumerate() {
                        memtable.apply(seq as u64 + 1, batch, |_| false);
                    }
                    memtable
                },
                BatchSize::PerIteration,
            )
        });

        let mut memtable = Memtable::new();
        for (seq, batch) in input.into_iter().enumerate() {
            memtable.apply(seq as u64 + 1, batch, |_| false);
        }
        assert_eq!(memtable.len() as u64, n);
        let start = EventKey::topic_start(TopicHash::of(TOPIC));
        let end = EventKey::topic_start(TopicHash(TopicHash::of(TOPIC).0 + 1));
        group.bench_function(BenchmarkId::new("scan", n), |b| {
            b.iter(|| {
                let mut bytes = 0usize;
                for (key, entry) in memtable.range(
                    Bound::Included(start.as_bytes().as_slice()),
                    Bound::Excluded(end.as_bytes().as_slice()),
                ) {
                    bytes += key.len() + entry.value().map_or(0, Value::len);
                }
                black_box(bytes)
            })
        });
    }
    group.finish();
}

/// Entries `0..n` (key bytes, value) in key order.
fn table_entries(n: u64) -> (Vec<EventKey>, Value) {
    ((0..n).map(key).collect(), value(0))
}

async fn write_table(path: &Path, keys: &[EventKey], value: &Value) -> u64 {
    let options = LsmOptions::default();
    let mut writer = TableWriter::create(path, options.block_bytes, options.bloom_bits_per_key)
        .await
        .expect("create a table file");
    for key in keys {
        writer
            .add(key.as_bytes(), EntryRef::Put(value.as_bytes()), None)
            .await
            .expect("add in key order");
    }
    let (_props, len) = writer.finish().await.expect("finish the table");
    len
}

fn table_benches(c: &mut Criterion, io: &Io) {
    let options = LsmOptions::default();
    let mut group = c.benchmark_group("table");

    let (keys, shared) = table_entries(BUILD_ENTRIES);
    group.throughput(Throughput::Elements(BUILD_ENTRIES));
    group.bench_function(BenchmarkId::new("build", BUILD_ENTRIES), |b| {
        b.iter(|| {
            let mut builder = TableBuilder::new(options.block_bytes, options.bloom_bits_per_key);
            let mut bytes = 0usize;
            for key in &keys {
                builder
                    .add(key.as_bytes(), EntryRef::Put(shared.as_bytes()), None)
                    .expect("add in key order");
                bytes += builder.take_output().len();
            }
            let (tail, props, total) = builder.finish();
            black_box((bytes + tail.len(), props, total))
        })
    });

    let mut file_no = 0u64;
    group.bench_function(BenchmarkId::new("write", BUILD_ENTRIES), |b| {
        b.iter_custom(|iters| {
            io.executor.run(async {
                let mut elapsed = Duration::ZERO;
                for _ in 0..iters {
                    file_no += 1;
                    let path = io.path().join(format!("write-{file_no}.sst"));
                    let start = Instant::now();
                    black_box(write_table(&path, &keys, &shared).await);
                    elapsed += start.elapsed();
                    std::fs::remove_file(&path).expect("remove the bench table");
                }
                elapsed
            })
        })
    });

    let (keys, shared) = table_entries(SCAN_TABLE_ENTRIES);
    let path = io.path().join("scan.sst");
    let table = io.executor.run(async {
        write_table(&path, &keys, &shared).await;
        Rc::new(Table::open(&path, 1).await.expect("open the bench table"))
    });
    let first = (SCAN_TABLE_ENTRIES - SCAN_RANGE_ENTRIES) / 2;
    let start = keys[first as usize];
    let end = keys[(first + SCAN_RANGE_ENTRIES) as usize];
    group.throughput(Throughput::Elements(SCAN_RANGE_ENTRIES));
    group.bench_function(
        BenchmarkId::new(
            "scan_range",
            format!("{SCAN_RANGE_ENTRIES}_of_{SCAN_TABLE_ENTRIES}"),
        ),
        |b| {
            b.iter_custom(|iters| {
                io.executor.run(async {
                    let begin = Instant::now();
                    for _ in 0..iters {
                        let mut cursor = TableCursor::new(
                            Rc::clone(&table),
                            start.as_bytes(),
                            Some(end.as_bytes()),
                        );
                        let mut seen = 0u64;
                        while let Some((key, entry)) =
                            cursor.next().await.expect("read the bench table")
                        {
                            black_box((key, entry));
                            seen += 1;
                        }
                        assert_eq!(seen, SCAN_RANGE_ENTRIES);
                    }
                    begin.elapsed()
                })
            })
        },
    );
    group.finish();
}

fn storage_parts(c: &mut Criterion) {
    memtable_benches(c);
    let io = Io::new();
    wal_benches(c, &io);
    table_benches(c, &io);
}

criterion_group!(benches, storage_parts);
criterion_main!(benches);
