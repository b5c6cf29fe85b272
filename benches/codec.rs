//! Cap'n Proto codec of the client protocol: the cost of a batch on the wire, without sockets.
//!
//! - `deliver_encode`: the server fills a `Consumer.deliver` batch of 128 deliveries of 100-byte
//!   payloads from rkyv archives (as the dispatch path does) and serializes it to bytes;
//! - `deliver_decode`: the client reads such a batch from bytes into owned `Delivery` values;
//! - `publish_encode` / `publish_decode`: a 128-message publish batch written by the client and
//!   read and validated by the server (borrowing, without copies).
//!
//! Run with `cargo bench --bench codec`; throughput is reported per message.

use std::hint::black_box;

use capnp::message::{Builder, HeapAllocator, ReaderOptions};
use capnp::serialize;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

use pinq::config::{AckLevel, PublishConfig};
use pinq::key::{EventKey, TopicHash};
use pinq::message::{Header, StoredMessage, Value};
use pinq::rpc::pinq_capnp::{broker, consumer};
use pinq::rpc::{self, OutgoingDelivery, PublishLimits, PublishMessage};

const BATCH_LEN: usize = 128;
const PAYLOAD_BYTES: usize = 100;

fn stored(i: usize) -> StoredMessage {
    StoredMessage {
        topic: "orders".into(),
        payload: vec![(i % 251) as u8; PAYLOAD_BYTES],
        enqueued_at_ms: 1_700_000_000_000 + i as u64,
        delay_ms: 0,
        ttl_ms: 0,
        headers: vec![Header {
            key: "trace".into(),
            value: b"0123456789abcdef".to_vec(),
        }],
    }
}

/// Fills and serializes one deliver batch into `out` (cleared first).
fn encode_deliveries(values: &[(EventKey, Value)], out: &mut Vec<u8>) {
    let archived: Vec<OutgoingDelivery<'_, _>> = values
        .iter()
        .map(|(tag, value)| OutgoingDelivery {
            tag: *tag,
            message: value.message().expect("bench values are valid"),
            attempt: 1,
        })
        .collect();
    let mut message = Builder::new(HeapAllocator::new());
    let params = message.init_root::<consumer::deliver_params::Builder>();
    rpc::write_deliveries(params.init_deliveries(archived.len() as u32), &archived);
    out.clear();
    serialize::write_message(&mut *out, &message).expect("writing to a Vec cannot fail");
}

fn encode_publish(messages: &[PublishMessage], out: &mut Vec<u8>) {
    let mut message = Builder::new(HeapAllocator::new());
    let mut params = message.init_root::<broker::publish_params::Builder>();
    params.set_ack_level(AckLevel::Durable.into());
    rpc::write_publish_batch(params.init_messages(messages.len() as u32), messages)
        .expect("bench messages are valid");
    out.clear();
    serialize::write_message(&mut *out, &message).expect("writing to a Vec cannot fail");
}

fn deliveries(c: &mut Criterion) {
    let topic = TopicHash::of("orders");
    let values: Vec<(EventKey, Value)> = (0..BATCH_LEN)
        .map(|i| {
            let key = EventKey::new(topic, 1_000, i as u64);
            (key, Value::encode(&stored(i)).expect("encodable"))
        })
        .collect();
    let mut bytes = Vec::new();
    encode_deliveries(&values, &mut bytes);

    let mut group = c.benchmark_group("codec");
    group.throughput(Throughput::Elements(BATCH_LEN as u64));
    let mut out = Vec::with_capacity(bytes.len());
    group.bench_function("deliver_encode_128x100B", |b| {
        b.iter(|| {
            encode_deliveries(black_box(&values), &mut out);
            black_box(out.len())
        })
    });
    group.bench_function("deliver_decode_128x100B", |b| {
        b.iter(|| {
            let reader =
                serialize::read_message(&mut black_box(bytes.as_slice()), ReaderOptions::new())
                    .expect("valid message");
            let params = reader
                .get_root::<consumer::deliver_params::Reader>()
                .expect("valid root");
            let list = params.get_deliveries().expect("deliveries");
            black_box(rpc::read_deliveries(list).expect("valid deliveries"))
        })
    });
    group.finish();
}

fn publishes(c: &mut Criterion) {
    let messages: Vec<PublishMessage> = (0..BATCH_LEN)
        .map(|i| {
            let s = stored(i);
            PublishMessage {
                topic: s.topic,
                payload: s.payload,
                delay_ms: 0,
                ttl_ms: 0,
                headers: s.headers,
                ..PublishMessage::default()
            }
        })
        .collect();
    let mut bytes = Vec::new();
    encode_publish(&messages, &mut bytes);
    let limits = PublishLimits::from(&PublishConfig::default());

    let mut group = c.benchmark_group("codec");
    group.throughput(Throughput::Elements(BATCH_LEN as u64));
    let mut out = Vec::with_capacity(bytes.len());
    group.bench_function("publish_encode_128x100B", |b| {
        b.iter(|| {
            encode_publish(black_box(&messages), &mut out);
            black_box(out.len())
        })
    });
    group.bench_function("publish_decode_validate_128x100B", |b| {
        b.iter(|| {
            let reader =
                serialize::read_message(&mut black_box(bytes.as_slice()), ReaderOptions::new())
                    .expect("valid message");
            let params = reader
                .get_root::<broker::publish_params::Reader>()
                .expect("valid root");
            let list = params.get_messages().expect("messages");
            let batch = rpc::read_publish_batch(list, &limits).expect("valid batch");
            black_box(batch.len())
        })
    });
    group.finish();
}

criterion_group!(benches, deliveries, publishes);
criterion_main!(benches);
