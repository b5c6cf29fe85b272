//! The hub alone (`pinq::pipeline::hub::Hub`, pure, no store, no executor): choosing the
//! consumer that takes the next copy, and offering a message to every recipient of its topic.
//!
//! - `choose_group/<n>`: `Hub::choose` on a group of `n` consumers that all have room (the
//!   round-robin pointer moves every call), per call;
//! - `choose_group_full/<n>`: the same group with every consumer but one at its queue bound, so a
//!   call skips `n - 1` full consumers before it finds room, per call;
//! - `offer_fanout`: what the shard core's offer does with the hub for one message of a topic
//!   with one group of 4 consumers and 3 universal consumers (4 copies): `recipients_of`, then per
//!   recipient `choose` and a push onto the chosen consumer's queue and held set. 1,024 messages
//!   an iteration, then the queues are cleared (timed too), reported per message.
//!
//! Run with `cargo bench --bench hub`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use pinq::key::{EventKey, TopicHash};
use pinq::pipeline::hub::{Hub, Queued};
use pinq::pipeline::RecipientId;

const TOPIC: &str = "orders";
const QUEUE_LEN_MAX: usize = 1 << 16;
const UNACKED_MAX: usize = 1 << 16;
const OFFER_MESSAGES: u64 = 1_024;

fn group_of(n: u64) -> (Hub, RecipientId) {
    let mut hub = Hub::new(QUEUE_LEN_MAX, UNACKED_MAX);
    let mut recipient = None;
    for i in 0..n {
        let registered = hub
            .register(TOPIC, "workers", uuid::Uuid::from_u128(i as u128 + 1))
            .expect("an unbounded hub");
        recipient = Some(registered.recipient);
    }
    (hub, recipient.expect("at least one consumer"))
}

fn choose(c: &mut Criterion) {
    let mut group = c.benchmark_group("choose_group");
    group.throughput(Throughput::Elements(1));
    for n in [1u64, 4, 16] {
        let (mut hub, recipient) = group_of(n);
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| black_box(hub.choose(black_box(recipient), None)))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("choose_group_full");
    group.throughput(Throughput::Elements(1));
    for n in [4u64, 16] {
        // A small queue bound so that filling a consumer is cheap.
        let mut hub = Hub::new(4, UNACKED_MAX);
        let mut recipient = None;
        for i in 0..n {
            let registered = hub
                .register(TOPIC, "workers", uuid::Uuid::from_u128(i as u128 + 1))
                .expect("an unbounded hub");
            recipient = Some(registered.recipient);
            if i + 1 < n {
                let consumer = hub
                    .consumers
                    .get_mut(&registered.consumer)
                    .expect("just registered");
                for j in 0..4 {
                    consumer.queue.push_back(Queued {
                        key: EventKey::new(TopicHash::of(TOPIC), 0, i * 4 + j),
                        attempt: 1,
                    });
                }
            }
        }
        let recipient = recipient.expect("at least one consumer");
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                let (chosen, skipped) = hub.choose(black_box(recipient), None);
                debug_assert!(chosen.is_some());
                black_box((chosen, skipped))
            })
        });
    }
    group.finish();
}

fn offer_fanout(c: &mut Criterion) {
    let mut hub = Hub::new(QUEUE_LEN_MAX, UNACKED_MAX);
    for i in 0..4u128 {
        hub.register(TOPIC, "workers", uuid::Uuid::from_u128(i + 1))
            .expect("an unbounded hub");
    }
    for i in 0..3u128 {
        hub.register(TOPIC, "", uuid::Uuid::from_u128(100 + i))
            .expect("an unbounded hub");
    }
    assert_eq!(
        hub.recipients_of(TOPIC).len(),
        4,
        "one group and three universals"
    );
    let topic = TopicHash::of(TOPIC);
    let mut next_id = 0u64;

    let mut group = c.benchmark_group("offer_fanout");
    group.throughput(Throughput::Elements(OFFER_MESSAGES));
    group.bench_function("group_of_4_and_3_universals", |b| {
        b.iter(|| {
            for _ in 0..OFFER_MESSAGES {
                next_id += 1;
                let key = EventKey::new(topic, 0, next_id);
                for recipient in hub.recipients_of(TOPIC) {
                    let (chosen, _skipped) = hub.choose(recipient, None);
                    let consumer = chosen.expect("queues are cleared every iteration");
                    if let Some(c) = hub.consumers.get_mut(&consumer) {
                        c.queue.push_back(Queued { key, attempt: 1 });
                        c.held.insert(key);
                    }
                }
            }
            for consumer in hub.consumers.values_mut() {
                consumer.queue.clear();
                consumer.held.clear();
            }
        })
    });
    group.finish();
}

criterion_group!(benches, choose, offer_fanout);
criterion_main!(benches);
