//! The server's publish path without sockets or disks, per message: a 128 × 100-byte publish
//! batch (one 16-byte header each) read from Cap'n Proto bytes and validated at the edge, turned
//! into a store batch by a shard core (keys, enqueue time, rkyv archives), its command encoded
//! into a WAL chunk (a reused buffer, as `Wal` does) and announced applied to the core.
//!
//! This is the stretch "parse once at the edge" shortens: every payload copy and bytecheck
//! between the socket and the WAL buffer is inside it (the DMA copy of `write_padded` is not).
//!
//! Run with `cargo bench --bench publish_path -- --warm-up-time 1 --measurement-time 2`.

use std::hint::black_box;

use capnp::message::{Builder, HeapAllocator, ReaderOptions};
use capnp::serialize;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

use pinq::batch::ValidatedBatch;
use pinq::config::{AckLevel, DeliveryConfig, PublishConfig};
use pinq::message::Header;
use pinq::pipeline::ShardCore;
use pinq::rpc::pinq_capnp::broker;
use pinq::rpc::{self, PublishLimits, PublishMessage};

const BATCH_LEN: usize = 128;
const PAYLOAD_BYTES: usize = 100;
const START_MS: u64 = 1_700_000_000_000;

fn request_bytes() -> Vec<u8> {
    let messages: Vec<PublishMessage> = (0..BATCH_LEN)
        .map(|i| PublishMessage {
            headers: vec![Header {
                key: "trace".into(),
                value: b"0123456789abcdef".to_vec(),
            }],
            ..PublishMessage::new("orders", vec![(i % 251) as u8; PAYLOAD_BYTES])
        })
        .collect();
    let mut message = Builder::new(HeapAllocator::new());
    let mut params = message.init_root::<broker::publish_params::Builder>();
    params.set_ack_level(AckLevel::Durable.into());
    rpc::write_publish_batch(params.init_messages(BATCH_LEN as u32), &messages)
        .expect("bench messages are valid");
    let mut out = Vec::new();
    serialize::write_message(&mut out, &message).expect("writing to a Vec cannot fail");
    out
}

/// What `Broker.publish` and `drive::publish` do with one batch for one shard, minus the I/O
/// (the split by shard included, with one shard).
fn publish_once(core: &mut ShardCore, bytes: &[u8], limits: &PublishLimits, chunk: &mut Vec<u8>) {
    let reader = serialize::read_message(&mut &bytes[..], ReaderOptions::new()).expect("valid");
    let params = reader
        .get_root::<broker::publish_params::Reader>()
        .expect("valid root");
    let ack = rpc::read_ack_level(params.get_ack_level()).expect("known level");
    let list = params.get_messages().expect("messages");
    let messages = rpc::read_publish_batch(list, limits).expect("valid batch");
    let mut parts =
        ValidatedBatch::split(&messages, ack, &PublishConfig::default(), 1).expect("valid batch");
    let part = parts.pop().expect("one shard");
    let store_batch = core.prepare_publish(START_MS, part.batch);
    chunk.clear();
    store_batch.command().encode(chunk);
    core.on_publish_applied(&store_batch);
}

fn publish_path(c: &mut Criterion) {
    let bytes = request_bytes();
    let limits = PublishLimits::from(&PublishConfig::default());
    let mut core = ShardCore::new(DeliveryConfig::default(), START_MS);
    let mut chunk = Vec::with_capacity(64 << 10);
    let mut group = c.benchmark_group("publish_path");
    group.throughput(Throughput::Elements(BATCH_LEN as u64));
    group.bench_function("edge_to_wal_chunk_128x100B", |b| {
        b.iter(|| {
            publish_once(&mut core, black_box(&bytes), &limits, &mut chunk);
            black_box(chunk.len())
        })
    });
    group.finish();
}

criterion_group!(benches, publish_path);
criterion_main!(benches);
