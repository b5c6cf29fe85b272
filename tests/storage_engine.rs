//! `LsmStore` behaviours on real DMA files: annihilation, tombstones over tables, the event-id
//! high-water mark, flush, compaction, TTL, recovery from the command log, torn tails and stats.

mod support;

use support::on_executor as run;

use std::rc::Rc;

use pinq::key::{EventKey, TopicHash};
use pinq::log::Command;
use pinq::message::{StoredMessage, Value};
use pinq::storage::{LsmEnv, LsmOptions, LsmStore, ManualClock};
use pinq::storage::{Store, StoreError, Sync};

fn small_options() -> LsmOptions {
    LsmOptions {
        memtable_bytes_max: 64 << 10,
        block_bytes: 4096,
        wal_preallocate_bytes: 256 << 10,
        compaction_interval_ms: 3_600_000,
        ..LsmOptions::default()
    }
}

fn key(id: u64) -> EventKey {
    EventKey::new(TopicHash(42), id / 100, id)
}

fn message(id: u64, ttl_ms: u64) -> Value {
    Value::encode(&StoredMessage {
        topic: "orders".into(),
        payload: vec![(id % 251) as u8; 100],
        enqueued_at_ms: 1_000,
        delay_ms: 0,
        ttl_ms,
        headers: Vec::new(),
    })
    .expect("encode")
}

fn puts(ids: std::ops::Range<u64>, ttl_ms: u64) -> Command {
    Command::Store {
        event_id_high_water: ids.end.saturating_sub(1),
        messages: ids.map(|id| (key(id), message(id, ttl_ms))).collect(),
    }
}

fn deletes(ids: std::ops::Range<u64>) -> Command {
    Command::Delete {
        keys: ids.map(key).collect(),
    }
}

async fn all_ids(store: &LsmStore) -> Vec<u64> {
    ids_of(
        &store
            .scan(&[], Some(&[0x80]), usize::MAX)
            .await
            .expect("scan"),
    )
}

fn ids_of(rows: &[(pinq::key::Key, Value)]) -> Vec<u64> {
    rows.iter()
        .map(|(k, _)| EventKey::parse(k).expect("event key").event_id())
        .collect()
}

#[test]
fn publish_and_ack_within_one_memtable_write_no_table_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let store = LsmStore::open(&path, small_options()).await.expect("open");
        for round in 0..20u64 {
            let ids = round * 10..round * 10 + 10;
            store
                .commit(&puts(ids.clone(), 0), Sync::Durable)
                .await
                .expect("publish");
            store
                .commit(&deletes(ids), Sync::Durable)
                .await
                .expect("ack");
        }
        store.flush().await.expect("flush");
        let stats = store.stats();
        assert_eq!(stats.annihilated, 200);
        assert_eq!(stats.tombstones, 0);
        assert_eq!(stats.flush_bytes_written, 0, "{stats:#?}");
        assert_eq!(stats.tables, 0);
        assert!(all_ids(&store).await.is_empty());
        store.close().await.expect("close");
    });
}

#[test]
fn delete_of_a_flushed_key_leaves_a_tombstone_that_hides_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let store = LsmStore::open(&path, small_options()).await.expect("open");
        store
            .commit(&puts(0..50, 0), Sync::Durable)
            .await
            .expect("put");
        store.flush().await.expect("flush");
        assert_eq!(store.stats().tables, 1);
        store
            .commit(&deletes(10..20), Sync::Durable)
            .await
            .expect("delete");
        assert_eq!(store.stats().tombstones, 10);
        let expected: Vec<u64> = (0..10).chain(20..50).collect();
        assert_eq!(all_ids(&store).await, expected);
        assert_eq!(store.get(key(15).as_bytes()).await.expect("get"), None);
        assert_eq!(
            store.get(key(25).as_bytes()).await.expect("get"),
            Some(message(25, 0))
        );
        store.flush().await.expect("flush");
        assert_eq!(all_ids(&store).await, expected);
        store.compact_all().await.expect("compact");
        let stats = store.stats();
        assert_eq!(stats.tables, 1);
        assert_eq!(stats.table_tombstones, 0, "{stats:#?}");
        assert_eq!(all_ids(&store).await, expected);
        store.close().await.expect("close");
    });
}

#[test]
fn the_event_id_high_water_mark_survives_from_the_manifest_and_from_the_log() {
    // Flushed: the manifest carries the mark (it is no key in the tables). Unflushed: the log
    // replay raises it again. Every key stays an event key.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let store = LsmStore::open(&path, small_options()).await.expect("open");
        assert_eq!(store.event_id_high_water(), 0);
        store
            .commit(&puts(0..10, 0), Sync::Durable)
            .await
            .expect("put");
        store.flush().await.expect("flush");
        store
            .commit(&deletes(0..10), Sync::Durable)
            .await
            .expect("ack");
        store.close().await.expect("close");
        let store = LsmStore::open(&path, small_options())
            .await
            .expect("reopen");
        assert_eq!(store.event_id_high_water(), 9, "from the manifest");
        assert!(all_ids(&store).await.is_empty());
        let everything = store.scan(&[], None, usize::MAX).await.expect("scan");
        assert!(everything.is_empty(), "no metadata key in the tables");
        store
            .commit(&puts(10..20, 0), Sync::Durable)
            .await
            .expect("put");
        store.close_unflushed().await.expect("close");
        let store = LsmStore::open(&path, small_options())
            .await
            .expect("reopen");
        assert_eq!(store.event_id_high_water(), 19, "from the log replay");
        store.close().await.expect("close");
    });
}

#[test]
fn unflushed_writes_are_recovered_from_the_wal_after_a_drop_without_close() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        {
            let store = LsmStore::open(&path, small_options()).await.expect("open");
            store
                .commit(&puts(0..30, 0), Sync::Durable)
                .await
                .expect("put");
            store.flush().await.expect("flush");
            store
                .commit(&puts(30..60, 0), Sync::Durable)
                .await
                .expect("put");
            store
                .commit(&deletes(0..5), Sync::Durable)
                .await
                .expect("delete");
            store
                .commit(&deletes(40..45), Sync::Durable)
                .await
                .expect("delete");
            // Dropped without close: the memtable is only in the WAL.
        }
        let store = LsmStore::open(&path, small_options())
            .await
            .expect("reopen");
        let report = store.stats().recovery;
        assert_eq!(report.records_replayed, 3, "{report:#?}");
        // The segment is zero-filled past its last record (preallocation): that reads as a
        // clean end, not as a torn tail.
        assert_eq!(report.torn_tail, None, "{report:#?}");
        assert_eq!(report.tables, 1);
        let expected: Vec<u64> = (5..40).chain(45..60).collect();
        assert_eq!(all_ids(&store).await, expected);
        store.close().await.expect("close");
        let store = LsmStore::open(&path, small_options())
            .await
            .expect("reopen");
        assert_eq!(store.stats().recovery.records_replayed, 0, "close flushed");
        assert_eq!(all_ids(&store).await, expected);
        store.close().await.expect("close");
    });
}

#[test]
fn a_torn_wal_tail_is_truncated_and_earlier_batches_survive() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        {
            let store = LsmStore::open(&path, small_options()).await.expect("open");
            for i in 0..10 {
                store
                    .commit(&puts(i * 10..i * 10 + 10, 0), Sync::Durable)
                    .await
                    .expect("put");
            }
        }
        let segment = std::fs::read_dir(&path)
            .expect("list")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "log"))
            .expect("a WAL segment");
        let mut bytes = std::fs::read(&segment).expect("read");
        // Damage the last record itself (the segment is zero-filled past it).
        let last = {
            let mut reader = pinq::log::wal::SegmentReader::new(&bytes);
            std::iter::from_fn(|| reader.next_record().map(|(at, _)| at))
                .last()
                .expect("records")
        };
        let at = last + 100;
        bytes[at] ^= 0xFF;
        std::fs::write(&segment, &bytes).expect("write");
        let store = LsmStore::open(&path, small_options())
            .await
            .expect("reopen");
        let report = store.stats().recovery;
        let torn = report.torn_tail.clone().expect("torn tail reported");
        assert!(torn.file.ends_with(".log"));
        let ids = all_ids(&store).await;
        assert!(!ids.is_empty() && ids.len() < 100, "{} ids", ids.len());
        assert_eq!(ids.len() % 10, 0, "batches are recovered whole");
        assert_eq!(ids, (0..ids.len() as u64).collect::<Vec<_>>());
        // The store keeps working after the truncation, and a second reopen agrees.
        store
            .commit(&puts(500..510, 0), Sync::Durable)
            .await
            .expect("put");
        drop(store);
        let store = LsmStore::open(&path, small_options())
            .await
            .expect("reopen");
        assert!(store.stats().recovery.torn_tail.is_none());
        let again = all_ids(&store).await;
        assert_eq!(again.len(), ids.len() + 10);
        store.close().await.expect("close");
    });
}

#[test]
fn a_corrupt_table_is_refused_at_open_with_its_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let store = LsmStore::open(&path, small_options()).await.expect("open");
        store
            .commit(&puts(0..100, 0), Sync::Durable)
            .await
            .expect("put");
        store.close().await.expect("close");
        let table = std::fs::read_dir(&path)
            .expect("list")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "sst"))
            .expect("a table");
        let mut bytes = std::fs::read(&table).expect("read");
        let at = bytes.len() - 60;
        bytes[at] ^= 0x01;
        std::fs::write(&table, &bytes).expect("write");
        match LsmStore::open(&path, small_options()).await {
            Err(StoreError::Corrupt { file, .. }) => {
                assert_eq!(file, table.display().to_string())
            }
            Err(other) => panic!("expected corruption, got {other}"),
            Ok(_) => panic!("a corrupt table was accepted"),
        }
    });
}

#[test]
fn expired_messages_are_dropped_by_compaction_and_space_is_reclaimed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let clock = Rc::new(ManualClock::new(1_000));
        let env = LsmEnv {
            clock: Some(clock.clone()),
            background_queue: None,
        };
        let store = LsmStore::open_with(&path, small_options(), env)
            .await
            .expect("open");
        store
            .commit(&puts(0..200, 500), Sync::Durable)
            .await
            .expect("put");
        store
            .commit(&puts(200..300, 0), Sync::Durable)
            .await
            .expect("put");
        store.flush().await.expect("flush");
        assert_eq!(store.stats().table_entries, 300);
        clock.set(1_500);
        store.compact_all().await.expect("compact");
        let stats = store.stats();
        assert_eq!(stats.compaction_expired_dropped, 200, "{stats:#?}");
        assert_eq!(stats.table_entries, 100);
        assert_eq!(all_ids(&store).await, (200..300).collect::<Vec<_>>());
        store.close().await.expect("close");
    });
}

#[test]
fn full_publish_ack_cycle_then_compaction_leaves_little_on_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let store = LsmStore::open(&path, small_options()).await.expect("open");
        // Messages that wait long enough to reach tables, then are ACKed.
        for chunk in 0..20u64 {
            store
                .commit(&puts(chunk * 100..chunk * 100 + 100, 0), Sync::Buffered)
                .await
                .expect("put");
        }
        store.flush().await.expect("flush");
        let live_ids: Vec<u64> = (1900..2000).collect();
        for chunk in 0..19u64 {
            store
                .commit(&deletes(chunk * 100..chunk * 100 + 100), Sync::Buffered)
                .await
                .expect("ack");
        }
        store.flush().await.expect("flush");
        store.compact_all().await.expect("compact");
        let stats = store.stats();
        assert_eq!(all_ids(&store).await, live_ids);
        let live_bytes: u64 = 100 * (24 + message(0, 0).len() as u64);
        assert!(
            stats.table_bytes * 2 <= live_bytes * 3,
            "disk {} vs live {live_bytes}: {stats:#?}",
            stats.table_bytes
        );
        store.close().await.expect("close");
    });
}

#[test]
fn scans_page_consistently_across_memtables_and_tables() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let store = LsmStore::open(&path, small_options()).await.expect("open");
        store
            .commit(&puts(0..300, 0), Sync::Buffered)
            .await
            .expect("put");
        store.flush().await.expect("flush");
        store
            .commit(&puts(300..600, 0), Sync::Buffered)
            .await
            .expect("put");
        store.flush().await.expect("flush");
        store
            .commit(&deletes(100..400), Sync::Buffered)
            .await
            .expect("del");
        store
            .commit(&puts(600..700, 0), Sync::Buffered)
            .await
            .expect("put");
        let mut seen = Vec::new();
        let mut start = pinq::key::Key::new();
        loop {
            let page = store.scan(&start, Some(&[0x80]), 37).await.expect("scan");
            let Some((last, _)) = page.last() else { break };
            start = last.clone();
            start.push(0);
            seen.extend(
                page.iter()
                    .map(|(k, _)| EventKey::parse(k).expect("key").event_id()),
            );
        }
        let expected: Vec<u64> = (0..100).chain(400..700).collect();
        assert_eq!(seen, expected);
        let first = store
            .first_key(key(100).as_bytes(), None)
            .await
            .expect("first");
        assert_eq!(first, Some(key(400).to_key()));
        store.close().await.expect("close");
        assert!(matches!(
            store.commit(&puts(0..1, 0), Sync::Durable).await,
            Err(StoreError::Closed)
        ));
    });
}

#[test]
fn memtable_bound_freezes_and_flushes_in_the_background() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let store = LsmStore::open(&path, small_options()).await.expect("open");
        for chunk in 0..50u64 {
            store
                .commit(&puts(chunk * 20..chunk * 20 + 20, 0), Sync::Buffered)
                .await
                .expect("put");
        }
        store.sync().await.expect("sync");
        let stats = store.stats();
        assert!(stats.memtable_bytes <= 64 << 10, "{stats:#?}");
        store.flush().await.expect("flush");
        let stats = store.stats();
        assert!(stats.flushes >= 3, "{stats:#?}");
        assert_eq!(
            stats.wal_segments, 1,
            "covered segments are deleted: {stats:#?}"
        );
        assert_eq!(all_ids(&store).await.len(), 1000);
        store.close().await.expect("close");
    });
}

#[test]
fn writers_stalled_on_a_full_frozen_queue_reach_the_log_in_arrival_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let options = LsmOptions {
            memtable_bytes_max: 16 << 10,
            frozen_memtables_max: 1,
            ..small_options()
        };
        let store = Rc::new(LsmStore::open(&path, options).await.expect("open"));
        let arrivals = Rc::new(std::cell::RefCell::new(Vec::new()));
        let applied = Rc::new(std::cell::RefCell::new(Vec::new()));
        let tasks: Vec<_> = (0..16u64)
            .map(|t| {
                let (store, arrivals, applied) =
                    (Rc::clone(&store), Rc::clone(&arrivals), Rc::clone(&applied));
                glommio::spawn_local(async move {
                    for round in 0..8u64 {
                        for _ in 0..(t * 7 + round * 3) % 5 {
                            futures_lite::future::yield_now().await;
                        }
                        let first = (t * 8 + round) * 50;
                        let n = {
                            let mut a = arrivals.borrow_mut();
                            let n = a.len();
                            a.push(n);
                            n
                        };
                        // A buffered write returns in the same step as its append: the order
                        // of the returns is the order of the log.
                        store
                            .commit(&puts(first..first + 50, 0), Sync::Buffered)
                            .await
                            .expect("write");
                        applied.borrow_mut().push(n);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await;
        }
        let stats = store.stats();
        assert!(
            stats.write_stalls > 0,
            "the test must stall writers: {stats:#?}"
        );
        let applied = applied.borrow().clone();
        let in_order: Vec<usize> = (0..applied.len()).collect();
        assert_eq!(
            applied, in_order,
            "writes reached the log out of arrival order"
        );
        store.close().await.expect("close");
    });
}

#[test]
fn replaying_the_log_onto_a_fresh_state_machine_reproduces_the_state_exactly() {
    // The same commands applied live to a model, replayed from the log into a fresh in-memory
    // state machine, and recovered by the LSM store: three identical states.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    run(move || async move {
        let mut rng = fastrand::Rng::with_seed(7);
        let live = pinq::storage::MemStore::new();
        let mut last_index = 0;
        {
            let store = LsmStore::open(&path, LsmOptions::default())
                .await
                .expect("open");
            let mut next = 0u64;
            for _ in 0..300 {
                let command = if rng.u8(0..3) > 0 || next == 0 {
                    let n = rng.u64(1..20);
                    next += n;
                    puts(next - n..next, 0)
                } else {
                    let keys = (0..rng.u64(1..10)).map(|_| key(rng.u64(0..next))).collect();
                    Command::Delete { keys }
                };
                last_index = store
                    .commit(&command, Sync::Buffered)
                    .await
                    .expect("commit");
                live.apply(&command);
            }
            store.sync().await.expect("sync");
            // Dropped without close: everything is only in the log.
        }
        let replayed = pinq::storage::MemStore::new();
        let mut indexes = Vec::new();
        let recovery = pinq::log::recovery::recover(&path, 0, |index, command| {
            indexes.push(index);
            replayed.apply(&command);
        })
        .await
        .expect("replay");
        assert_eq!(indexes, (1..=last_index).collect::<Vec<_>>());
        assert_eq!(recovery.next_index, last_index + 1);
        let everything = |m: &pinq::storage::MemStore| m.scan_now(&[], None, usize::MAX);
        assert_eq!(everything(&replayed), everything(&live));
        assert_eq!(replayed.event_id_high_water(), live.event_id_high_water());

        let store = LsmStore::open(&path, LsmOptions::default())
            .await
            .expect("reopen");
        let recovered = store.scan(&[], None, usize::MAX).await.expect("scan");
        assert_eq!(recovered, everything(&live));
        assert_eq!(store.event_id_high_water(), live.event_id_high_water());
        store.close().await.expect("close");
    });
}

async fn engine_ids(engine: &pinq::storage::Engine) -> Vec<u64> {
    ids_of(
        &engine
            .scan(&[], Some(&[0x80]), usize::MAX)
            .await
            .expect("scan"),
    )
}

/// A Raft snapshot's switch: the shard's engine takes a staged engine's tables as its whole
/// state in one manifest commit; what it held before (tables and memtable) is gone, the
/// snapshot's index is its applied index, and a reopen finds the same. The staged directory
/// stays whole (an interrupted install adopts it again).
#[test]
fn adopting_a_staged_engine_replaces_the_whole_state_with_one_manifest_commit() {
    use pinq::storage::Engine;
    let dir = tempfile::tempdir().expect("tmp");
    let (live_dir, staged_dir) = (dir.path().join("live"), dir.path().join("staged"));
    run(move || async move {
        let staged = Engine::open_with(&staged_dir, small_options(), LsmEnv::default())
            .await
            .expect("open staged")
            .engine;
        staged.start().expect("start");
        for (seq, chunk) in (1000..1400u64).step_by(100).enumerate() {
            staged.apply(seq as u64 + 1, &puts(chunk..chunk + 100, 0));
        }
        staged.begin_close(true).await.expect("flush staged");
        staged.finish_close().await;

        let live = Engine::open_with(&live_dir, small_options(), LsmEnv::default())
            .await
            .expect("open live")
            .engine;
        live.start().expect("start");
        live.apply(1, &puts(0..100, 0));
        live.flush().await.expect("flush");
        live.apply(2, &puts(5000..5010, 0));
        live.apply(3, &deletes(1000..1010));
        assert_eq!(live.flushed_index(), 1);

        live.adopt(&staged_dir, 70).await.expect("adopt");
        let want: Vec<u64> = (1000..1400).collect();
        assert_eq!(
            engine_ids(&live).await,
            want,
            "only the staged state is left"
        );
        assert_eq!(live.flushed_index(), 70, "the snapshot's index is applied");
        assert_eq!(
            live.event_id_high_water(),
            5009,
            "the higher mark of the two"
        );
        live.apply(71, &puts(7000..7001, 0));
        live.begin_close(true).await.expect("close");
        live.finish_close().await;
        drop(live);

        let opened = Engine::open_with(&live_dir, small_options(), LsmEnv::default())
            .await
            .expect("reopen");
        assert_eq!(opened.applied_index, 71);
        let mut want = want;
        want.push(7000);
        assert_eq!(
            engine_ids(&opened.engine).await,
            want,
            "the reopen finds the same"
        );
        let staged = Engine::open_with(&staged_dir, small_options(), LsmEnv::default())
            .await
            .expect("staged intact");
        assert_eq!(engine_ids(&staged.engine).await.len(), 400);
    });
}
