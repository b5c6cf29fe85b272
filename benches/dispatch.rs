//! Cost of a dispatch pass of the pure core (`ShardCore` over a `MemStore`, driven with
//! `block_on`, no executor, no I/O).
//!
//! - `dispatch_per_message`: 1,024 due messages, one group consumer with room for all of them;
//!   the passes that read and hand them out, the drain and the ACK, reported per message.
//! - `pass_nothing_due`: one pass with nothing to deliver, time moved by a poll interval each
//!   time so the topic is really scanned, over four shards: nothing stored (`empty`); 100,000
//!   messages of a topic nobody consumes, nothing in flight (`stored_100k_unserved`, the same
//!   store depth as the next two); 100,000 copies delivered and held unacknowledged
//!   (`in_flight_100k`); and 100,000 messages delayed far into the future (`delayed_100k`).
//!   PRODUCT.md §2 asks that a pass cost O(newly due + redeliveries due): the last two should stay
//!   within 2× of a pass with nothing in flight.

use std::cell::RefCell;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use futures_lite::future::block_on;

use pinq::config::{AckLevel, DeliveryConfig, PublishConfig};
use pinq::key::EventKey;
use pinq::pipeline::{drive, ConsumerId, ShardCore, ValidatedBatch};
use pinq::rpc::PublishMessage;
use pinq::storage::MemStore;

const TOPIC: &str = "bench";
const START_MS: u64 = 1_000_000;
const PUBLISH_BATCH_LEN: usize = 1_000;
const DISPATCH_MESSAGES: usize = 1_024;
const WAITING_MESSAGES: usize = 100_000;
/// Far beyond any bench run: no lease expires and no delayed message falls due while measuring.
const FAR_MS: u64 = 1_000_000_000_000;

struct Shard {
    core: RefCell<ShardCore>,
    store: MemStore,
    consumer: ConsumerId,
    now_ms: u64,
}

fn delivery_config() -> DeliveryConfig {
    DeliveryConfig {
        consumer_queue_len_max: 1 << 20,
        unacked_per_consumer_max: 1 << 20,
        in_flight_timeout_ms: FAR_MS,
        ..DeliveryConfig::default()
    }
}

impl Shard {
    fn new() -> Shard {
        let mut core = ShardCore::new(delivery_config(), START_MS);
        let consumer = core
            .subscribe(START_MS, TOPIC, "workers", uuid::Uuid::from_u128(1))
            .expect("a valid topic");
        Shard {
            core: RefCell::new(core),
            store: MemStore::new(),
            consumer,
            now_ms: START_MS,
        }
    }

    fn publish(&self, topic: &str, n: usize, delay_ms: u64) {
        let message = PublishMessage {
            delay_ms,
            ..PublishMessage::new(topic, [0u8; 64])
        };
        let mut left = n;
        while left > 0 {
            let messages = vec![message.clone(); left.min(PUBLISH_BATCH_LEN)];
            let batch = ValidatedBatch::from_messages(
                &messages,
                AckLevel::Durable,
                &PublishConfig::default(),
            )
            .expect("valid messages");
            block_on(drive::publish(&self.core, &self.store, self.now_ms, batch))
                .expect("publish to a memory store");
            left -= messages.len();
        }
    }

    /// Passes until one is unproductive, as the shell drains without waiting.
    fn settle(&self) {
        while block_on(drive::dispatch_pass(&self.core, &self.store, self.now_ms))
            .expect("scan a memory store")
        {}
    }

    fn drain(&self) -> Vec<EventKey> {
        let mut core = self.core.borrow_mut();
        let deliveries = core.drain(self.now_ms, self.consumer, usize::MAX);
        let keys: Vec<EventKey> = deliveries.iter().map(|d| d.key).collect();
        core.returned(self.now_ms, self.consumer, &keys);
        keys
    }

    /// One pass a poll interval after the last: the topic is scanned, nothing is due.
    fn idle_pass(&mut self) -> bool {
        self.now_ms += delivery_config().dispatch_poll_interval_ms;
        block_on(drive::dispatch_pass(&self.core, &self.store, self.now_ms))
            .expect("scan a memory store")
    }
}

fn dispatch_per_message(c: &mut Criterion) {
    let mut group = c.benchmark_group("dispatch_per_message");
    group.throughput(Throughput::Elements(DISPATCH_MESSAGES as u64));
    group.bench_function("pass_scan_offer_drain_ack", |b| {
        b.iter_batched(
            || {
                let shard = Shard::new();
                shard.publish(TOPIC, DISPATCH_MESSAGES, 0);
                shard
            },
            |shard| {
                shard.settle();
                let keys = shard.drain();
                assert_eq!(keys.len(), DISPATCH_MESSAGES);
                let results = shard
                    .core
                    .borrow_mut()
                    .ack(shard.now_ms, shard.consumer, &keys)
                    .expect("a registered consumer");
                black_box(results);
                shard
            },
            BatchSize::PerIteration,
        );
    });
    group.finish();
}

fn pass_nothing_due(c: &mut Criterion) {
    let mut group = c.benchmark_group("pass_nothing_due");

    let mut empty = Shard::new();
    empty.settle();
    group.bench_function("empty", |b| b.iter(|| black_box(empty.idle_pass())));

    // Control: the same store depth with nothing in flight (100,000 messages of a topic nobody
    // consumes, so never scanned). A pass seeks the store twice, and a seek costs O(log keys) in
    // any ordered store; this separates that from anything that grows with the in-flight table.
    let mut stored = Shard::new();
    stored.publish("unserved", WAITING_MESSAGES, 0);
    stored.settle();
    assert_eq!(stored.core.borrow().stats().in_flight, 0);
    group.bench_function("stored_100k_unserved", |b| {
        b.iter(|| black_box(stored.idle_pass()))
    });

    let mut in_flight = Shard::new();
    in_flight.publish(TOPIC, WAITING_MESSAGES, 0);
    in_flight.settle();
    assert_eq!(in_flight.drain().len(), WAITING_MESSAGES);
    assert_eq!(
        in_flight.core.borrow().stats().in_flight,
        WAITING_MESSAGES,
        "every copy delivered and held unacknowledged"
    );
    group.bench_function("in_flight_100k", |b| {
        b.iter(|| black_box(in_flight.idle_pass()))
    });
    assert!(
        in_flight.drain().is_empty(),
        "nothing was redelivered while measuring"
    );

    let mut delayed = Shard::new();
    delayed.publish(TOPIC, WAITING_MESSAGES, FAR_MS);
    delayed.settle();
    group.bench_function("delayed_100k", |b| {
        b.iter(|| black_box(delayed.idle_pass()))
    });
    assert!(
        delayed.drain().is_empty(),
        "nothing fell due while measuring"
    );

    group.finish();
}

criterion_group!(benches, dispatch_per_message, pass_nothing_due);
criterion_main!(benches);
