//! Sorted tables on real DMA files: written by `TableWriter`, read back by `Table` and
//! `TableCursor`, and refused with an error naming the file when a byte is damaged.

mod support;

use support::on_executor as run;

use std::rc::Rc;

use pinq::key::{EventKey, TopicHash};
use pinq::message::{StoredMessage, Value};
use pinq::storage::io as dio;
use pinq::storage::memtable::Entry;
use pinq::storage::table::block::EntryRef;
use pinq::storage::table::{table_name, Table, TableCursor, TableWriter};
use pinq::storage::StoreError;

fn event_key(i: u64) -> [u8; 24] {
    *EventKey::new(TopicHash(7), i / 10, i).as_bytes()
}

fn message(i: u64) -> Value {
    Value::encode(&StoredMessage {
        topic: "t".into(),
        payload: vec![i as u8; 100],
        enqueued_at_ms: 1_000,
        delay_ms: 0,
        ttl_ms: if i % 3 == 0 { 500 } else { 0 },
        headers: Vec::new(),
    })
    .expect("encode")
}

async fn write_table(path: &std::path::Path, n: u64) -> u64 {
    let mut w = TableWriter::create(path, 4096, 10).await.expect("create");
    for i in 0..n {
        let key = event_key(i);
        if i % 7 == 0 {
            w.add(&key, EntryRef::Tombstone, None).await.expect("add");
        } else {
            let value = message(i);
            let expires = value.message().expect("valid").expires_at_ms();
            w.add(&key, EntryRef::Put(value.as_bytes()), expires)
                .await
                .expect("add");
        }
    }
    let (props, len) = w.finish().await.expect("finish");
    assert_eq!(props.entries(), n);
    len
}

#[test]
fn table_written_with_dma_reads_back_by_get_and_cursor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().to_path_buf();
    run(move || async move {
        dio::probe_disk(&root).await.expect("probe");
        let path = root.join(table_name(1));
        let len = write_table(&path, 3000).await;
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), len);
        let table = Rc::new(Table::open(&path, 1).await.expect("open"));
        assert!(table.blocks() > 50);
        assert_eq!(table.props().tombstones, 3000u64.div_ceil(7));
        assert_eq!(table.props().expires_min_ms, 1_500);

        for i in [0u64, 1, 2, 7, 1234, 2999] {
            let got = table.get(&event_key(i)).await.expect("get");
            if i % 7 == 0 {
                assert_eq!(got, Some(Entry::Tombstone));
            } else {
                assert_eq!(got, Some(Entry::Put(message(i))));
            }
        }
        assert_eq!(table.get(&event_key(5000)).await.expect("get"), None);

        let start = event_key(100);
        let end = event_key(250);
        let mut cursor = TableCursor::new(Rc::clone(&table), &start, Some(&end));
        let mut seen = Vec::new();
        while let Some((key, _)) = cursor.next().await.expect("next") {
            seen.push(EventKey::parse(&key).expect("event key").event_id());
        }
        assert_eq!(seen, (100..250).collect::<Vec<_>>());
        table.verify().await.expect("verify");
    });
}

#[test]
fn damaged_tables_are_refused_with_an_error_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().to_path_buf();
    run(move || async move {
        dio::probe_disk(&root).await.expect("probe");
        let path = root.join(table_name(2));
        write_table(&path, 500).await;
        let pristine = std::fs::read(&path).expect("read");

        // A flipped byte in a data block: open succeeds (metadata is fine), the block is
        // skipped by gets and cursors (never served), counted once, and verify names it.
        let mut bad = pristine.clone();
        bad[100] ^= 0x01;
        std::fs::write(&path, &bad).expect("write");
        let table = Rc::new(Table::open(&path, 2).await.expect("metadata intact"));
        assert_eq!(table.get(&event_key(3)).await.expect("get"), None);
        assert_eq!(table.get(&event_key(3)).await.expect("get again"), None);
        let damage = table.unreadable();
        assert_eq!(damage.blocks, 1);
        assert!(damage.values >= 1, "{damage:?}");
        let mut cursor = TableCursor::new(Rc::clone(&table), &[], None);
        let mut seen = Vec::new();
        while let Some((key, _)) = cursor.next().await.expect("next") {
            seen.push(EventKey::parse(&key).expect("event key").event_id());
        }
        assert!(!seen.contains(&3), "no key of the damaged block is served");
        assert_eq!(seen.last(), Some(&499), "the keys after it are");
        assert_eq!(
            seen.len() as u64 + damage.values,
            500,
            "every key is either served or counted as unreadable"
        );
        assert_eq!(
            table.unreadable(),
            damage,
            "counted once however often it is read"
        );
        match table.verify().await {
            Err(StoreError::Corrupt { file, .. }) => assert!(file.ends_with(&table_name(2))),
            other => panic!("expected corruption, got {other:?}"),
        }
        drop(cursor);
        let table = Rc::try_unwrap(table).expect("last reference");
        table.close().await.expect("close");

        // A flipped byte in the footer: open refuses.
        let mut bad = pristine.clone();
        let at = bad.len() - 10;
        bad[at] ^= 0x01;
        std::fs::write(&path, &bad).expect("write");
        match Table::open(&path, 2).await {
            Err(StoreError::Corrupt { file, what }) => {
                assert!(file.ends_with(&table_name(2)), "{file}: {what}")
            }
            other => panic!("expected corruption, got {other:?}"),
        }

        // A truncated table: open refuses.
        std::fs::write(&path, &pristine[..pristine.len() - 1]).expect("write");
        assert!(matches!(
            Table::open(&path, 2).await,
            Err(StoreError::Corrupt { .. })
        ));
    });
}
