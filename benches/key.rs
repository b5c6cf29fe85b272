//! The 24-byte event key codec and the persisted topic hash, alone (no store, no executor).
//!
//! - `event_key/new`: encodes `topic_hash | due_bucket | event_id` big-endian into 24 bytes;
//! - `event_key/parse`: checks and copies 24 bytes back into a key (as a client's delivery tag
//!   is read on ACK); `event_key/fields` reads the three fields out of a key;
//! - `topic_hash/of/<len>`: XXH3-64 with the fixed seed over topic names of 8, 32 and 255 bytes.
//!
//! Times are per key (or per hash); run with `cargo bench --bench key`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use pinq::key::{EventKey, TopicHash, EVENT_KEY_LEN, TOPIC_LEN_MAX};

fn event_key(c: &mut Criterion) {
    let mut group = c.benchmark_group("event_key");
    group.throughput(Throughput::Elements(1));
    let topic = TopicHash::of("orders");
    let mut id = 0u64;
    group.bench_function("new", |b| {
        b.iter(|| {
            id = id.wrapping_add(1);
            black_box(EventKey::new(
                black_box(topic),
                black_box(1_700_000_000),
                id,
            ))
        })
    });

    let bytes: [u8; EVENT_KEY_LEN] = *EventKey::new(topic, 1_700_000_000, 42).as_bytes();
    group.bench_function("parse", |b| {
        b.iter(|| black_box(EventKey::parse(black_box(&bytes[..])).expect("a valid key")))
    });

    let key = EventKey::new(topic, 1_700_000_000, 42);
    group.bench_function("fields", |b| {
        b.iter(|| {
            let key = black_box(&key);
            black_box((key.topic_hash(), key.due_bucket(), key.event_id()))
        })
    });
    group.finish();
}

fn topic_hash(c: &mut Criterion) {
    let mut group = c.benchmark_group("topic_hash/of");
    group.throughput(Throughput::Elements(1));
    for len in [8usize, 32, TOPIC_LEN_MAX] {
        let name: String = "orders.eu-west.".chars().cycle().take(len).collect();
        group.bench_with_input(BenchmarkId::from_parameter(len), &name, |b, name| {
            b.iter(|| black_box(TopicHash::of(black_box(name))))
        });
    }
    group.finish();
}

criterion_group!(benches, event_key, topic_hash);
criterion_main!(benches);
