//! Behaviour tests of the pure pipeline, driven through a `MemStore` with hand-moved time.
//! No sleeps, no sockets: every test is deterministic.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use futures_lite::future::{block_on, poll_once};

use super::drive::{self, DeleteApplied};
use super::shard::{Delivery, ShardCore, TagResult};
use super::ConsumerId;
use crate::batch::{PublishError, ValidatedBatch};
use crate::config::{AckLevel, DeliveryConfig, PublishConfig};
use crate::key::{self, EventKey, Key, TopicHash};
use crate::log::Command;
use crate::message::{CheckedValue, StoredMessage, Value};
use crate::rpc::PublishMessage;
use crate::storage::{MemStore, Store, StoreError, Sync};

/// A store that records the rows it hands out and can be told to fail writes, or to hold them
/// (a held write stays pending, without a wake-up, until released and polled again).
#[derive(Default)]
pub(super) struct TestStore {
    pub inner: MemStore,
    pub read: RefCell<Vec<Key>>,
    pub fail_writes: RefCell<bool>,
    pub hold_writes: RefCell<bool>,
}

impl Store for TestStore {
    async fn commit(&self, command: &Command, sync: Sync) -> Result<u64, StoreError> {
        if *self.fail_writes.borrow() {
            return Err(StoreError::Closed);
        }
        futures_lite::future::poll_fn(|_| {
            if *self.hold_writes.borrow() {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await;
        self.inner.commit(command, sync).await
    }

    fn event_id_high_water(&self) -> u64 {
        self.inner.event_id_high_water()
    }

    async fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        let rows = self.inner.scan_now(start, end, limit);
        self.read
            .borrow_mut()
            .extend(rows.iter().map(|(k, _)| k.clone()));
        Ok(rows)
    }

    async fn first_key(&self, start: &[u8], end: Option<&[u8]>) -> Result<Option<Key>, StoreError> {
        Ok(self.inner.first_key_now(start, end))
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        Ok(self.inner.get_now(key))
    }
}

pub(super) struct Sim {
    pub core: RefCell<ShardCore>,
    pub store: TestStore,
    pub now_ms: u64,
}

pub(super) fn config() -> DeliveryConfig {
    DeliveryConfig {
        in_flight_timeout_ms: 1_000,
        delete_batch_interval_ms: 100,
        ttl_sweep_interval_ms: 10_000,
        consumer_queue_len_max: 4,
        ..DeliveryConfig::default()
    }
}

impl Sim {
    pub fn new(delivery: DeliveryConfig) -> Sim {
        let now_ms = 1_000_000;
        Sim {
            core: RefCell::new(ShardCore::new(delivery, now_ms)),
            store: TestStore::default(),
            now_ms,
        }
    }

    pub fn publish_with(
        &mut self,
        topic: &str,
        payload: &str,
        delay_ms: u64,
        ttl_ms: u64,
    ) -> EventKey {
        let message = PublishMessage {
            delay_ms,
            ttl_ms,
            ..PublishMessage::new(topic, payload.as_bytes())
        };
        let tags = block_on(drive::publish(
            &self.core,
            &self.store,
            self.now_ms,
            batch(&[message]),
        ))
        .unwrap();
        tags[0]
    }

    pub fn publish(&mut self, topic: &str, payload: &str) -> EventKey {
        self.publish_with(topic, payload, 0, 0)
    }

    pub fn subscribe(&mut self, topic: &str, group: &str) -> ConsumerId {
        let uuid = uuid::Uuid::from_u128(self.core.borrow().consumer_count() as u128 + 1);
        self.core
            .borrow_mut()
            .subscribe(self.now_ms, topic, group, uuid)
            .unwrap()
    }

    /// One dispatch pass.
    pub fn pass(&mut self) -> bool {
        block_on(drive::dispatch_pass(&self.core, &self.store, self.now_ms)).unwrap()
    }

    /// Passes until one is unproductive, as the shell drains without waiting.
    pub fn settle(&mut self) {
        for _ in 0..1000 {
            if !self.pass() {
                return;
            }
        }
        panic!("dispatcher never settled");
    }

    /// Drains a consumer whose client returns every `deliver` call at once.
    pub fn recv(&mut self, consumer: ConsumerId) -> Vec<Delivery> {
        let mut core = self.core.borrow_mut();
        let deliveries = core.drain(self.now_ms, consumer, usize::MAX);
        let keys: Vec<EventKey> = deliveries.iter().map(|d| d.key).collect();
        core.returned(self.now_ms, consumer, &keys);
        deliveries
    }

    pub fn payloads(&mut self, consumer: ConsumerId) -> Vec<String> {
        self.recv(consumer).iter().map(payload).collect()
    }

    pub fn ack(&mut self, consumer: ConsumerId, keys: &[EventKey]) -> Vec<TagResult> {
        self.core
            .borrow_mut()
            .ack(self.now_ms, consumer, keys)
            .unwrap()
    }

    pub fn nack(
        &mut self,
        consumer: ConsumerId,
        keys: &[EventKey],
        delay_ms: u64,
    ) -> Vec<TagResult> {
        self.core
            .borrow_mut()
            .nack(self.now_ms, consumer, keys, delay_ms)
            .unwrap()
    }

    pub fn advance(&mut self, ms: u64) {
        self.now_ms += ms;
    }

    /// Flushes every due delete batch.
    pub fn flush_deletes(&mut self) -> usize {
        let mut n = 0;
        while block_on(drive::flush_deletes(&self.core, &self.store, self.now_ms)).unwrap() {
            n += 1;
        }
        n
    }

    pub fn stored(&self, key: &EventKey) -> bool {
        self.store.inner.get_now(key.as_bytes()).is_some()
    }

    pub fn event_keys_stored(&self) -> usize {
        self.store
            .inner
            .scan_now(
                key::EVENT_RANGE_START,
                Some(key::EVENT_RANGE_END),
                usize::MAX,
            )
            .len()
    }
}

/// A batch validated as the edge does, for a core with the default `[publish]` config.
pub(super) fn batch(messages: &[PublishMessage]) -> ValidatedBatch {
    ValidatedBatch::from_messages(messages, AckLevel::Durable, &PublishConfig::default())
        .expect("test messages are valid")
}

pub(super) fn payload(delivery: &Delivery) -> String {
    String::from_utf8(delivery.value.message().payload.to_vec()).unwrap()
}

fn keys(deliveries: &[Delivery]) -> Vec<EventKey> {
    deliveries.iter().map(|d| d.key).collect()
}

#[test]
fn grouped_consumers_get_each_message_exactly_once() {
    let mut sim = Sim::new(config());
    let a = sim.subscribe("orders", "workers");
    let b = sim.subscribe("orders", "workers");
    for i in 0..6 {
        sim.publish("orders", &format!("m{i}"));
    }
    sim.settle();
    let mut got = sim.payloads(a);
    let from_b = sim.payloads(b);
    assert_eq!(got.len(), 3, "round-robin splits evenly");
    assert_eq!(from_b.len(), 3);
    got.extend(from_b);
    got.sort();
    assert_eq!(got, vec!["m0", "m1", "m2", "m3", "m4", "m5"]);
}

#[test]
fn universal_consumers_all_get_every_message() {
    let mut sim = Sim::new(config());
    let a = sim.subscribe("news", "");
    let b = sim.subscribe("news", "");
    sim.publish("news", "x");
    sim.publish("news", "y");
    sim.settle();
    assert_eq!(sim.payloads(a), vec!["x", "y"]);
    assert_eq!(sim.payloads(b), vec!["x", "y"]);
}

#[test]
fn several_groups_each_get_one_copy() {
    let mut sim = Sim::new(config());
    let billing = [
        sim.subscribe("orders", "billing"),
        sim.subscribe("orders", "billing"),
    ];
    let shipping = sim.subscribe("orders", "shipping");
    let listener = sim.subscribe("orders", "");
    sim.publish("orders", "o1");
    sim.settle();
    let billing_got: Vec<String> = billing.iter().flat_map(|c| sim.payloads(*c)).collect();
    assert_eq!(billing_got, vec!["o1"]);
    assert_eq!(sim.payloads(shipping), vec!["o1"]);
    assert_eq!(sim.payloads(listener), vec!["o1"]);
}

#[test]
fn full_consumer_queue_is_skipped_and_the_copy_retried_later() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 2,
        ..config()
    });
    let slow = sim.subscribe("jobs", "");
    for i in 0..5 {
        sim.publish("jobs", &format!("j{i}"));
    }
    sim.settle();
    assert_eq!(
        sim.core.borrow().consumer_info(slow).unwrap().2,
        2,
        "queue holds its bound, no more"
    );
    let first = sim.recv(slow);
    assert_eq!(
        first.iter().map(payload).collect::<Vec<_>>(),
        vec!["j0", "j1"]
    );
    sim.ack(slow, &keys(&first));
    sim.settle();
    let second = sim.recv(slow);
    assert_eq!(
        second.iter().map(payload).collect::<Vec<_>>(),
        vec!["j2", "j3"]
    );
    sim.ack(slow, &keys(&second));
    sim.settle();
    assert_eq!(sim.payloads(slow), vec!["j4"]);
}

#[test]
fn a_full_group_member_is_skipped_and_counted() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 1,
        ..config()
    });
    let a = sim.subscribe("jobs", "g");
    let b = sim.subscribe("jobs", "g");
    sim.publish("jobs", "j0");
    sim.settle();
    sim.publish("jobs", "j1");
    sim.settle();
    assert_eq!(sim.payloads(b), vec!["j1"]);
    // The pointer is back at a, whose queue is still full: a is skipped and b takes j2.
    sim.publish("jobs", "j2");
    sim.settle();
    assert_eq!(sim.payloads(b), vec!["j2"]);
    assert_eq!(sim.payloads(a), vec!["j0"]);
    assert_eq!(
        sim.core.borrow().stats().counters.consumer_queue_full_total,
        1
    );
}

/// Drains a consumer whose client does not return its `deliver` calls.
fn recv_stuck(sim: &mut Sim, consumer: ConsumerId) -> Vec<Delivery> {
    sim.core
        .borrow_mut()
        .drain(sim.now_ms, consumer, usize::MAX)
}

fn subscribe_window(sim: &mut Sim, topic: &str, group: &str, window: usize) -> ConsumerId {
    let uuid = uuid::Uuid::from_u128(sim.core.borrow().consumer_count() as u128 + 1);
    sim.core
        .borrow_mut()
        .subscribe_window(sim.now_ms, topic, group, uuid, window)
        .unwrap()
}

#[test]
fn deliveries_not_returned_count_against_the_window_and_peers_take_the_rest() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 100,
        ..config()
    });
    let stuck = subscribe_window(&mut sim, "jobs", "g", 4);
    let healthy = subscribe_window(&mut sim, "jobs", "g", 0);
    assert_eq!(sim.core.borrow().consumer_window(stuck), Some((4, 0)));
    assert_eq!(sim.core.borrow().consumer_window(healthy), Some((100, 0)));
    for i in 0..3 {
        sim.publish("jobs", &format!("a{i}"));
    }
    sim.settle();
    let mut sent = recv_stuck(&mut sim, stuck);
    assert_eq!(sent.len(), 2, "round-robin share of three");
    for i in 0..40 {
        sim.publish("jobs", &format!("b{i}"));
    }
    sim.settle();
    // Two out on the wire, two more queued: its window of 4 is full, however long it waits.
    sent.extend(recv_stuck(&mut sim, stuck));
    assert_eq!(sent.len(), 4);
    assert_eq!(sim.core.borrow().consumer_window(stuck), Some((4, 4)));
    sim.settle();
    assert!(recv_stuck(&mut sim, stuck).is_empty());
    assert_eq!(
        sim.recv(healthy).len(),
        43 - 4,
        "the healthy peer takes the rest"
    );
    let skipped = sim.core.borrow().stats().counters.consumer_queue_full_total;
    assert!(skipped > 0, "full consumer skipped and counted");
    // Its calls return: room again, the next copy may go to it.
    let keys: Vec<EventKey> = sent.iter().map(|d| d.key).collect();
    sim.core.borrow_mut().returned(sim.now_ms, stuck, &keys);
    assert_eq!(sim.core.borrow().consumer_window(stuck), Some((4, 0)));
    sim.publish("jobs", "c0");
    sim.publish("jobs", "c1");
    sim.settle();
    assert_eq!(recv_stuck(&mut sim, stuck).len(), 1);
}

#[test]
fn a_window_asked_above_the_server_bound_is_capped() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 8,
        ..config()
    });
    let c = subscribe_window(&mut sim, "jobs", "", 1000);
    assert_eq!(sim.core.borrow().consumer_window(c), Some((8, 0)));
    assert_eq!(sim.core.borrow().consumer_bounds(1000).0, 8);
    assert_eq!(sim.core.borrow().consumer_bounds(3).0, 3);
    assert_eq!(sim.core.borrow().consumer_bounds(0).0, 8);
}

#[test]
fn unacked_copies_bound_a_consumer_whose_calls_return() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 100,
        unacked_per_consumer_max: 3,
        ..config()
    });
    let a = sim.subscribe("jobs", "g");
    for i in 0..10 {
        sim.publish("jobs", &format!("j{i}"));
    }
    sim.settle();
    let got = sim.recv(a);
    assert_eq!(got.len(), 3, "maxUnackedPerConsumer");
    sim.settle();
    assert!(sim.recv(a).is_empty());
    sim.ack(a, &keys(&got[..1]));
    sim.settle();
    assert_eq!(sim.recv(a).len(), 1);
}

#[test]
fn a_lease_that_ran_out_is_redelivered_to_another_member() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 100,
        ..config()
    });
    let a = sim.subscribe("jobs", "g");
    let b = sim.subscribe("jobs", "g");
    sim.publish("jobs", "j0");
    sim.settle();
    // Round-robin gave j0 to a; the pointer now names b, so give b one more to bring it back to a.
    let first = sim.recv(a);
    assert_eq!(first.iter().map(payload).collect::<Vec<_>>(), vec!["j0"]);
    sim.publish("jobs", "j1");
    sim.settle();
    let other = sim.recv(b);
    assert_eq!(other.iter().map(payload).collect::<Vec<_>>(), vec!["j1"]);
    sim.ack(b, &keys(&other));
    sim.now_ms += 1_001;
    sim.settle();
    // The pointer names a, but a let j0's lease run out: b gets it.
    assert!(
        sim.recv(a).is_empty(),
        "not back to the consumer that timed out"
    );
    let again = sim.recv(b);
    assert_eq!(again.iter().map(payload).collect::<Vec<_>>(), vec!["j0"]);
    assert_eq!(again[0].attempt, 2);
    // With no other member having room, the same consumer is still served.
    let mut solo = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 100,
        ..config()
    });
    let only = solo.subscribe("jobs", "g");
    solo.publish("jobs", "k0");
    solo.settle();
    assert_eq!(solo.recv(only).len(), 1);
    solo.now_ms += 1_001;
    solo.settle();
    assert_eq!(solo.recv(only)[0].attempt, 2);
}

#[test]
fn round_robin_rotates_per_group_independently() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 100,
        ..config()
    });
    let g1 = [
        sim.subscribe("t", "g1"),
        sim.subscribe("t", "g1"),
        sim.subscribe("t", "g1"),
    ];
    let g2 = [sim.subscribe("t", "g2"), sim.subscribe("t", "g2")];
    for i in 0..6 {
        sim.publish("t", &format!("{i}"));
    }
    sim.settle();
    let g1_got: Vec<Vec<String>> = g1.iter().map(|c| sim.payloads(*c)).collect();
    let g2_got: Vec<Vec<String>> = g2.iter().map(|c| sim.payloads(*c)).collect();
    assert_eq!(g1_got, vec![vec!["0", "3"], vec!["1", "4"], vec!["2", "5"]]);
    assert_eq!(g2_got, vec![vec!["0", "2", "4"], vec!["1", "3", "5"]]);
}

#[test]
fn registering_a_consumer_wakes_the_dispatcher() {
    let mut sim = Sim::new(config());
    sim.publish("t", "waiting");
    sim.settle();
    assert!(
        sim.core.borrow().next_wake_ms() > sim.now_ms,
        "idle with no consumers"
    );
    let c = sim.subscribe("t", "g");
    assert_eq!(
        sim.core.borrow().next_wake_ms(),
        sim.now_ms,
        "a new consumer wakes it at once"
    );
    sim.settle();
    assert_eq!(sim.payloads(c), vec!["waiting"]);
}

#[test]
fn a_publish_to_a_served_topic_wakes_the_dispatcher() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    sim.settle();
    assert!(sim.core.borrow().next_wake_ms() > sim.now_ms);
    sim.publish("t", "now");
    assert_eq!(sim.core.borrow().next_wake_ms(), sim.now_ms);
    sim.settle();
    assert_eq!(sim.payloads(c), vec!["now"]);
}

#[test]
fn unregistering_the_last_consumer_stops_scanning_the_topic() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    sim.settle();
    sim.core.borrow_mut().unsubscribe(sim.now_ms, c).unwrap();
    sim.publish("t", "later");
    sim.store.read.borrow_mut().clear();
    sim.advance(1_000);
    sim.settle();
    assert!(
        sim.store.read.borrow().is_empty(),
        "a topic without consumers is never scanned"
    );
}

/// A copy's lease starts when its consumer confirms the receipt (its `deliver` call returned):
/// until then the copy may still be on its way, and goes to no one else however long it waits.
#[test]
fn a_lease_starts_at_the_receipt_and_an_unconfirmed_copy_never_changes_hands() {
    let mut sim = Sim::new(config());
    let a = sim.subscribe("t", "g");
    let b = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    let sent = recv_stuck(&mut sim, a);
    assert_eq!(keys(&sent), vec![tag]);
    sim.advance(60_000);
    sim.settle();
    assert!(sim.recv(b).is_empty(), "unconfirmed: no lease runs out");
    sim.core.borrow().assert_consistent();
    sim.core.borrow_mut().returned(sim.now_ms, a, &[tag]);
    sim.advance(999);
    sim.settle();
    assert!(sim.recv(b).is_empty(), "the lease runs from the receipt");
    sim.advance(1);
    sim.settle();
    assert_eq!(keys(&sim.recv(b)), vec![tag]);
    sim.core.borrow().assert_consistent();
}

#[test]
fn in_flight_timeout_redelivers_to_another_consumer_of_the_group() {
    let mut sim = Sim::new(config());
    let a = sim.subscribe("t", "g");
    let b = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    let to_a = sim.recv(a);
    assert_eq!(keys(&to_a), vec![tag]);
    sim.advance(999);
    sim.settle();
    assert!(sim.recv(b).is_empty(), "not before the timeout");
    assert_eq!(
        sim.core.borrow().next_wake_ms(),
        sim.now_ms + 1,
        "the lease expiry is a wake-up"
    );
    sim.advance(1);
    sim.settle();
    let to_b = sim.recv(b);
    assert_eq!(keys(&to_b), vec![tag]);
    assert_eq!(to_b[0].attempt, 2);
    assert_eq!(
        sim.ack(a, &[tag]),
        vec![TagResult::NotHolder],
        "the expired lease's holder may not ACK"
    );
    assert_eq!(sim.ack(b, &[tag]), vec![TagResult::Ok]);
    assert_eq!(
        sim.core
            .borrow()
            .stats()
            .counters
            .redeliveries_timeout_total,
        1
    );
}

#[test]
fn nack_makes_the_copy_redeliverable_at_once() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "");
    let tag = sim.publish("t", "m");
    sim.settle();
    assert_eq!(keys(&sim.recv(c)), vec![tag]);
    assert_eq!(sim.nack(c, &[tag], 0), vec![TagResult::Ok]);
    assert_eq!(sim.core.borrow().next_wake_ms(), sim.now_ms);
    sim.settle();
    let again = sim.recv(c);
    assert_eq!(keys(&again), vec![tag]);
    assert_eq!(again[0].attempt, 2);
}

#[test]
fn nack_with_delay_redelivers_after_the_delay() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(c);
    sim.nack(c, &[tag], 300);
    sim.advance(299);
    sim.settle();
    assert!(sim.recv(c).is_empty());
    sim.advance(1);
    sim.settle();
    assert_eq!(keys(&sim.recv(c)), vec![tag]);
}

#[test]
fn a_disconnect_releases_that_consumers_copies_at_once() {
    let mut sim = Sim::new(config());
    let a = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    assert_eq!(keys(&sim.recv(a)), vec![tag]);
    let b = sim.subscribe("t", "g");
    sim.core.borrow_mut().unsubscribe(sim.now_ms, a).unwrap();
    sim.settle();
    assert_eq!(keys(&sim.recv(b)), vec![tag], "no timeout wait");
}

#[test]
fn a_group_whose_only_worker_left_keeps_its_claim_until_a_new_worker_comes() {
    let mut sim = Sim::new(config());
    let first = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(first);
    sim.core
        .borrow_mut()
        .unsubscribe(sim.now_ms, first)
        .unwrap();
    sim.advance(60_000);
    sim.settle();
    sim.flush_deletes();
    assert!(sim.stored(&tag));
    let second = sim.subscribe("t", "g");
    sim.settle();
    assert_eq!(keys(&sim.recv(second)), vec![tag]);
}

#[test]
fn a_universal_consumer_that_leaves_is_forgotten_and_holds_nothing_back() {
    let mut sim = Sim::new(config());
    let worker = sim.subscribe("t", "g");
    let listener = sim.subscribe("t", "");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(listener);
    let got = sim.recv(worker);
    sim.ack(worker, &keys(&got));
    sim.core
        .borrow_mut()
        .unsubscribe(sim.now_ms, listener)
        .unwrap();
    sim.advance(100);
    sim.flush_deletes();
    assert!(
        !sim.stored(&tag),
        "deleted once the only remaining recipient ACKed"
    );
}

#[test]
fn group_retention_forgets_an_abandoned_group_with_its_claims() {
    let retention_ms = 5_000;
    let mut sim = Sim::new(DeliveryConfig {
        group_retention_ms: retention_ms,
        ..config()
    });
    let worker = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(worker);
    sim.core
        .borrow_mut()
        .unsubscribe(sim.now_ms, worker)
        .unwrap();
    sim.advance(retention_ms);
    sim.settle();
    sim.advance(100);
    sim.flush_deletes();
    assert!(!sim.stored(&tag));
    assert_eq!(sim.core.borrow().stats().counters.groups_forgotten_total, 1);
}

#[test]
fn forgetting_a_group_by_admin_call_releases_its_claims_at_once() {
    let mut sim = Sim::new(config());
    let worker = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(worker);
    assert!(
        sim.core
            .borrow_mut()
            .forget_group(sim.now_ms, "t", "g")
            .is_err(),
        "not while it has consumers"
    );
    sim.core
        .borrow_mut()
        .unsubscribe(sim.now_ms, worker)
        .unwrap();
    sim.core
        .borrow_mut()
        .forget_group(sim.now_ms, "t", "g")
        .unwrap();
    sim.advance(100);
    sim.flush_deletes();
    assert!(!sim.stored(&tag));
}

#[test]
fn an_ack_from_a_consumer_that_does_not_hold_the_copy_is_refused_and_deletes_nothing() {
    let mut sim = Sim::new(config());
    let a = sim.subscribe("t", "g");
    let b = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    let holder = if sim.recv(a).is_empty() { b } else { a };
    let other = if holder == a { b } else { a };
    assert_eq!(sim.ack(other, &[tag]), vec![TagResult::NotHolder]);
    let unknown = EventKey::new(TopicHash::of("t"), 1, 999_999);
    assert_eq!(sim.ack(holder, &[unknown]), vec![TagResult::UnknownTag]);
    sim.advance(1_000);
    sim.flush_deletes();
    assert!(sim.stored(&tag));
    assert_eq!(sim.core.borrow().stats().counters.acked_total, 0);
}

#[test]
fn a_repeated_ack_deletes_nothing_twice() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(c);
    assert_eq!(sim.ack(c, &[tag]), vec![TagResult::Ok]);
    assert_eq!(sim.ack(c, &[tag]), vec![TagResult::AlreadyAcked]);
    sim.advance(100);
    assert_eq!(sim.flush_deletes(), 1);
    assert_eq!(sim.core.borrow().stats().deleted_keys_total, 1);
    assert_eq!(
        sim.ack(c, &[tag]),
        vec![TagResult::UnknownTag],
        "gone after the delete is applied"
    );
}

#[test]
fn one_groups_ack_does_not_delete_another_groups_copy() {
    let mut sim = Sim::new(config());
    let billing = sim.subscribe("t", "billing");
    let shipping = sim.subscribe("t", "shipping");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(billing);
    sim.recv(shipping);
    sim.ack(billing, &[tag]);
    sim.advance(1_000);
    sim.flush_deletes();
    assert!(sim.stored(&tag), "shipping has not ACKed yet");
    sim.ack(shipping, &[tag]);
    sim.advance(100);
    sim.flush_deletes();
    assert!(!sim.stored(&tag));
}

#[test]
fn a_ttl_expired_message_is_never_delivered_and_is_deleted() {
    let mut sim = Sim::new(config());
    let tag = sim.publish_with("t", "short", 0, 50);
    sim.advance(50);
    let c = sim.subscribe("t", "g");
    sim.settle();
    assert!(sim.recv(c).is_empty());
    sim.advance(100);
    sim.flush_deletes();
    assert!(!sim.stored(&tag));
    assert_eq!(
        sim.core.borrow().stats().counters.expired_dispatcher_total,
        1
    );
}

#[test]
fn a_message_that_expires_in_a_consumer_queue_is_not_handed_out() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    let tag = sim.publish_with("t", "short", 0, 10);
    sim.settle();
    sim.advance(10);
    assert!(sim.recv(c).is_empty());
    sim.advance(100);
    sim.flush_deletes();
    assert!(!sim.stored(&tag));
}

#[test]
fn a_ttl_shorter_than_the_delay_is_never_delivered() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    let tag = sim.publish_with("t", "never", 500, 100);
    for _ in 0..10 {
        sim.advance(100);
        sim.settle();
        assert!(sim.recv(c).is_empty());
    }
    sim.flush_deletes();
    assert!(!sim.stored(&tag));
}

#[test]
fn a_delayed_message_is_delivered_at_its_due_time_not_before() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    // Due before the janitor's first sweep (a second after the start), which would wake the
    // core first.
    let tag = sim.publish_with("t", "later", 734, 0);
    sim.settle();
    assert_eq!(
        sim.core.borrow().next_wake_ms(),
        sim.now_ms + 50,
        "capped by the poll interval"
    );
    sim.advance(733);
    sim.settle();
    assert!(sim.recv(c).is_empty());
    assert_eq!(
        sim.core.borrow().next_wake_ms(),
        sim.now_ms + 1,
        "wakes exactly when it falls due"
    );
    sim.advance(1);
    sim.settle();
    assert_eq!(keys(&sim.recv(c)), vec![tag]);
}

#[test]
fn future_buckets_are_never_read() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    for i in 0..50 {
        sim.publish_with("t", &format!("{i}"), 10 + i * 100, 0);
    }
    for _ in 0..60 {
        sim.advance(97);
        sim.settle();
        let now_bucket = sim.now_ms;
        for raw in sim.store.read.borrow().iter() {
            let key = EventKey::parse(raw).unwrap();
            assert!(
                key.due_bucket() <= now_bucket,
                "read a key due later: {key:?}"
            );
        }
        let got = sim.recv(c);
        sim.ack(c, &keys(&got));
    }
    assert_eq!(
        sim.store.read.borrow().len(),
        50,
        "each key read exactly once"
    );
}

#[test]
fn the_janitor_deletes_expired_messages_of_topics_without_consumers_and_skips_other_keys() {
    let mut sim = Sim::new(config());
    let expired = sim.publish_with("nobody", "old", 0, 10);
    let alive = sim.publish_with("nobody", "young", 0, 0);
    let not_a_message = EventKey::new(TopicHash(5), 0, 0).to_key();
    sim.store.inner.apply(&Command::Store {
        messages: vec![(
            EventKey::new(TopicHash(5), 0, 0),
            Value::copy_from_slice(b"garbage bytes"),
        )],
        event_id_high_water: 0,
    });
    sim.advance(10_000);
    let swept = block_on(drive::sweep(&sim.core, &sim.store, sim.now_ms, || async {})).unwrap();
    assert!(swept);
    sim.advance(100);
    sim.flush_deletes();
    assert!(!sim.stored(&expired));
    assert!(sim.stored(&alive));
    assert!(
        sim.store.inner.get_now(&not_a_message).is_some(),
        "unreadable values are left alone"
    );
    assert!(sim.store.inner.event_id_high_water() >= 2);
    assert_eq!(sim.core.borrow().stats().counters.expired_janitor_total, 1);
}

#[test]
fn the_janitor_pages_through_a_large_store() {
    let mut sim = Sim::new(config());
    let mut expired = Vec::new();
    for i in 0..3_000 {
        expired.push(sim.publish_with(&format!("topic-{}", i % 7), "x", 0, 5));
    }
    sim.advance(10_000);
    let mut pages = 0;
    block_on(drive::sweep(&sim.core, &sim.store, sim.now_ms, || {
        pages += 1;
        async {}
    }))
    .unwrap();
    assert!(pages >= 2, "swept in bounded pages");
    for _ in 0..10 {
        sim.advance(100);
        sim.flush_deletes();
    }
    assert_eq!(sim.event_keys_stored(), 0);
}

#[test]
fn failed_delete_flushes_are_retried_and_counted() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(c);
    sim.ack(c, &[tag]);
    sim.advance(100);
    *sim.store.fail_writes.borrow_mut() = true;
    assert!(block_on(drive::flush_deletes(&sim.core, &sim.store, sim.now_ms)).is_err());
    assert_eq!(sim.core.borrow().stats().delete_failures_total, 1);
    *sim.store.fail_writes.borrow_mut() = false;
    sim.advance(100);
    sim.flush_deletes();
    assert!(!sim.stored(&tag));
    assert_eq!(
        sim.core.borrow().stats().in_flight,
        0,
        "in-flight entry removed after the flush"
    );
}

#[test]
fn a_bad_message_refuses_the_whole_batch_once_at_the_edge_with_its_index() {
    let good = PublishMessage::new("t", b"ok");
    let cases = [
        (
            PublishMessage::new("", b"x"),
            "messages[1].topic: topic name is empty",
        ),
        (
            PublishMessage::new("t", vec![0; (1 << 20) + 1]),
            "messages[1].payload is 1048577 bytes, the limit is 1048576",
        ),
        (
            PublishMessage::new("x".repeat(256), b"x"),
            "messages[1].topic: topic name is 256 bytes, the limit is 255",
        ),
    ];
    for (bad, expected) in cases {
        let e = ValidatedBatch::from_messages(
            &[good.clone(), bad],
            AckLevel::Durable,
            &PublishConfig::default(),
        )
        .unwrap_err();
        assert!(matches!(e, PublishError::Invalid(_)), "{e:?}");
        assert_eq!(e.to_string(), expected);
    }
    // Nothing of a refused batch reaches a core, so nothing can be stored.
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    sim.settle();
    assert!(sim.store.inner.is_empty());
    assert!(sim.recv(c).is_empty());
}

#[test]
fn a_weaker_ack_level_than_the_floor_is_refused_at_the_edge() {
    let strict = PublishConfig {
        ack_level_min: AckLevel::Durable,
        ..PublishConfig::default()
    };
    let result =
        ValidatedBatch::from_messages(&[PublishMessage::new("t", b"x")], AckLevel::Leader, &strict);
    assert!(matches!(result, Err(PublishError::AckLevelTooWeak { .. })));
}

#[test]
fn the_wal_is_handed_the_archives_built_at_the_edge_not_copies() {
    let mut sim = Sim::new(config());
    let messages: Vec<PublishMessage> = (0..4)
        .map(|i| PublishMessage::new(format!("t{i}"), vec![i as u8; 300]))
        .collect();
    let validated = batch(&messages);
    let built_at: Vec<(*const u8, Vec<u8>)> = validated
        .messages()
        .iter()
        .map(|m| (m.value.as_bytes().as_ptr(), m.value.as_bytes().to_vec()))
        .collect();
    sim.advance(5);
    let store_batch = sim.core.borrow_mut().prepare_publish(sim.now_ms, validated);
    let Command::Store {
        messages: stored, ..
    } = store_batch.command()
    else {
        panic!("a publish is a store command");
    };
    assert_eq!(stored.len(), messages.len());
    for ((_, value), (at, unstamped)) in stored.iter().zip(&built_at) {
        assert_eq!(
            value.as_bytes().as_ptr(),
            *at,
            "same allocation as at the edge"
        );
        let archived = CheckedValue::check(value.clone()).unwrap();
        assert_eq!(
            archived.message().enqueued_at_ms(),
            sim.now_ms,
            "stamped in place"
        );
        // Only the 8 bytes of the stamp differ from what the edge built.
        let differing = value
            .as_bytes()
            .iter()
            .zip(unstamped)
            .filter(|(a, b)| a != b)
            .count();
        assert!(differing <= 8, "{differing} bytes changed");
    }
    for (m, (_, value)) in messages.iter().zip(&stored) {
        let decoded = value.decode().unwrap();
        assert_eq!(
            (decoded.topic.as_str(), &decoded.payload),
            (m.topic.as_str(), &m.payload)
        );
    }
}

#[test]
fn event_ids_continue_after_a_restart() {
    let mut sim = Sim::new(config());
    let before = sim.publish("t", "a");
    let store = std::mem::take(&mut sim.store);
    let mut restarted = Sim::new(config());
    restarted.store = store;
    drive::recover(&restarted.core, &restarted.store);
    let after = restarted.publish("t", "b");
    assert!(after.event_id() > before.event_id());
}

#[test]
fn two_topics_with_the_same_hash_never_see_each_others_messages() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("mine", "g");
    // Forge a message of another topic under this topic's hash, as a collision would store it.
    let stored = StoredMessage {
        topic: "theirs".into(),
        payload: b"not for you".to_vec(),
        enqueued_at_ms: sim.now_ms,
        delay_ms: 0,
        ttl_ms: 0,
        headers: vec![],
    };
    sim.store.inner.apply(&Command::Store {
        messages: vec![(
            EventKey::new(TopicHash::of("mine"), 0, 1),
            Value::encode(&stored).unwrap(),
        )],
        event_id_high_water: 0,
    });
    sim.publish("mine", "yours");
    sim.settle();
    assert_eq!(sim.payloads(c), vec!["yours"]);
}

#[test]
fn a_publish_not_yet_stored_is_not_skipped_by_a_pass() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    // A durable batch gets its keys, then a faster batch is stored and scanned before it lands.
    let slow = sim
        .core
        .borrow_mut()
        .prepare_publish(sim.now_ms, batch(&[PublishMessage::new("t", b"slow")]));
    sim.publish("t", "fast");
    sim.settle();
    sim.store.inner.apply(&slow.command());
    sim.core.borrow_mut().on_publish_applied(&slow);
    sim.settle();
    let mut got = sim.payloads(c);
    got.sort();
    assert_eq!(got, vec!["fast", "slow"]);
}

#[test]
fn in_flight_entries_are_bounded_by_consumer_capacity() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 8,
        unacked_per_consumer_max: 16,
        ..config()
    });
    let c = sim.subscribe("t", "g");
    for i in 0..100 {
        sim.publish("t", &format!("{i}"));
    }
    sim.settle();
    sim.recv(c);
    sim.settle();
    sim.recv(c);
    sim.settle();
    assert_eq!(
        sim.core.borrow().stats().in_flight,
        16,
        "prefetch limit holds"
    );
}

/// Found by model test, seed 1: the scan budget was `retryQueueSize / recipients`, which is 0 as
/// soon as a topic has more recipients than the retry bound, so the topic was never scanned again.
#[test]
fn a_topic_with_more_recipients_than_the_retry_bound_is_still_scanned() {
    let mut sim = Sim::new(DeliveryConfig {
        retry_len_max: 2,
        ..config()
    });
    let listeners = [
        sim.subscribe("t", ""),
        sim.subscribe("t", ""),
        sim.subscribe("t", ""),
    ];
    let tag = sim.publish("t", "m");
    sim.settle();
    for listener in listeners {
        assert_eq!(keys(&sim.recv(listener)), vec![tag]);
    }
}

/// Found by model test, seed 0: while a publish was being written, the scan stopped short of its
/// due bucket, but the seek past that bound found a due key, so `next_wake_ms` kept answering
/// "now" and the shell spun on empty passes until the write landed.
#[test]
fn a_publish_being_written_does_not_make_the_dispatcher_spin() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    sim.settle();
    let slow = sim
        .core
        .borrow_mut()
        .prepare_publish(sim.now_ms, batch(&[PublishMessage::new("t", b"slow")]));
    sim.publish("t", "fast");
    sim.settle();
    assert!(
        sim.core.borrow().next_wake_ms() > sim.now_ms,
        "nothing can be read until the slow write lands: no wake-up now"
    );
    sim.store.inner.apply(&slow.command());
    sim.core.borrow_mut().on_publish_applied(&slow);
    assert_eq!(
        sim.core.borrow().next_wake_ms(),
        sim.now_ms,
        "the landing write wakes the dispatcher"
    );
    sim.settle();
    let mut got = sim.payloads(c);
    got.sort();
    assert_eq!(got, vec!["fast", "slow"]);
}

/// Found by model test, seed 40: a publish being written in the cursor's own bucket held the scan
/// bound at or behind the cursor; the pass skipped the topic without learning anything, kept the
/// stale next due bucket left by a scan cut at its limit, and `next_wake_ms` answered "now" forever.
#[test]
fn a_publish_being_written_behind_the_cursor_does_not_make_the_dispatcher_spin() {
    let mut sim = Sim::new(DeliveryConfig {
        scan_batch_len_max: 1,
        ..config()
    });
    let c = sim.subscribe("t", "g");
    sim.publish("t", "fast");
    assert!(sim.pass(), "the scan is cut at its limit of one row");
    let slow = sim
        .core
        .borrow_mut()
        .prepare_publish(sim.now_ms, batch(&[PublishMessage::new("t", b"slow")]));
    sim.settle();
    assert!(
        sim.core.borrow().next_wake_ms() > sim.now_ms,
        "nothing can be read until the slow write lands: no wake-up now"
    );
    sim.store.inner.apply(&slow.command());
    sim.core.borrow_mut().on_publish_applied(&slow);
    sim.settle();
    assert_eq!(sim.payloads(c), vec!["fast", "slow"]);
}

/// A delete write started and not yet finished.
type Write<'a> = Pin<Box<dyn Future<Output = Result<DeleteApplied, StoreError>> + 'a>>;

/// Starts writing every delete batch the core lets out now; each write is polled once (so a
/// held store leaves it pending) and returned.
fn start_delete_writes(sim: &Sim) -> Vec<Write<'_>> {
    drive::take_delete_batches(&sim.core, sim.now_ms, false, usize::MAX)
        .into_iter()
        .map(|batch| {
            let mut write: Write<'_> =
                Box::pin(drive::write_delete_batch(&sim.core, &sim.store, batch));
            assert!(
                block_on(poll_once(&mut write)).is_none(),
                "a held write does not finish"
            );
            write
        })
        .collect()
}

fn publish_many(sim: &Sim, topic: &str, n: usize) {
    let messages: Vec<PublishMessage> = (0..n)
        .map(|i| PublishMessage::new(topic, format!("{i}").as_bytes()))
        .collect();
    for chunk in messages.chunks(1000) {
        block_on(drive::publish(
            &sim.core,
            &sim.store,
            sim.now_ms,
            batch(chunk),
        ))
        .unwrap();
    }
}

#[test]
fn several_delete_batches_are_out_at_once_and_each_settles_on_its_own() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 16,
        delete_batch_keys_max: 2,
        delete_batches_in_flight_max: 3,
        ..config()
    });
    let c = sim.subscribe("t", "g");
    let tags: Vec<EventKey> = (0..8).map(|i| sim.publish("t", &format!("{i}"))).collect();
    sim.settle();
    assert_eq!(keys(&sim.recv(c)), tags);
    sim.ack(c, &tags);
    *sim.store.hold_writes.borrow_mut() = true;
    let mut writes = start_delete_writes(&sim);
    assert_eq!(writes.len(), 3, "one write per slot, all out together");
    let stats = sim.core.borrow().stats();
    assert_eq!(stats.delete_queued, 2, "a full batch waits for a free slot");
    assert_eq!(stats.delete_backlog, 8);
    assert_eq!(
        sim.core.borrow().next_delete_ms(),
        None,
        "no slot: no wake-up"
    );
    assert_eq!(sim.event_keys_stored(), 8, "nothing deleted while held");

    *sim.store.hold_writes.borrow_mut() = false;
    let last = writes.pop().unwrap();
    assert_eq!(
        block_on(last).unwrap().keys,
        2,
        "writes finish in any order"
    );
    assert_eq!(sim.event_keys_stored(), 6);
    assert_eq!(
        sim.core.borrow().next_delete_ms(),
        Some(sim.now_ms),
        "the freed slot takes the waiting full batch at once"
    );
    for write in writes {
        block_on(write).unwrap();
    }
    assert_eq!(sim.flush_deletes(), 1);
    assert_eq!(sim.event_keys_stored(), 0);
    let stats = sim.core.borrow().stats();
    assert_eq!(stats.delete_batches_total, 4);
    assert_eq!(stats.delete_backlog, 0);
    assert_eq!(stats.in_flight, 0);
}

#[test]
fn the_delete_backlog_bound_pauses_dispatch_until_held_deletes_complete_and_nothing_is_lost() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 4,
        delete_batch_keys_max: 4,
        delete_batches_in_flight_max: 2,
        delete_backlog_keys_max: 8,
        ..config()
    });
    let c = sim.subscribe("t", "g");
    publish_many(&sim, "t", 40);
    let mut got: Vec<String> = Vec::new();
    *sim.store.hold_writes.borrow_mut() = true;
    let mut held: Vec<EventKey> = Vec::new();
    // Two rounds of four: each ACKed round is a full batch, written (and held) at once.
    for _ in 0..2 {
        sim.settle();
        let deliveries = sim.recv(c);
        assert_eq!(deliveries.len(), 4);
        got.extend(deliveries.iter().map(payload));
        held.extend(keys(&deliveries));
        sim.ack(c, &keys(&deliveries));
    }
    // The writes borrow the sim: they live in this scope, with the sim's clock standing still.
    {
        let writes = start_delete_writes(&sim);
        assert_eq!(writes.len(), 2);
        assert_eq!(sim.core.borrow().stats().delete_backlog, 8, "at the bound");

        let dispatched = sim.core.borrow().stats().counters.dispatched_total;
        for _ in 0..5 {
            let productive =
                block_on(drive::dispatch_pass(&sim.core, &sim.store, sim.now_ms)).unwrap();
            assert!(!productive);
        }
        let stats = sim.core.borrow().stats();
        assert_eq!(
            stats.counters.dispatched_total, dispatched,
            "nothing new handed out"
        );
        assert_eq!(
            stats.counters.delete_backlog_pauses_total, 1,
            "one pause episode"
        );
        assert_eq!(stats.delete_backlog, 8, "the backlog stays at its bound");
        assert!(sim.core.borrow().dispatch_paused());
        assert!(
            sim.core.borrow().next_pass_ms() > sim.now_ms,
            "a paused dispatcher does not spin"
        );
        assert!(sim
            .core
            .borrow_mut()
            .drain(sim.now_ms, c, usize::MAX)
            .is_empty());
        assert!(
            held.iter().all(|k| sim.stored(k)),
            "held deletes not applied"
        );

        *sim.store.hold_writes.borrow_mut() = false;
        let resumed: Vec<bool> = writes
            .into_iter()
            .map(|write| block_on(write).unwrap().dispatch_resumed)
            .collect();
        assert_eq!(
            resumed,
            vec![true, true],
            "the first applied batch brings the backlog under the bound; so does the second"
        );
    }
    assert!(held.iter().all(|k| !sim.stored(k)));
    assert_eq!(
        sim.core.borrow().next_pass_ms(),
        sim.now_ms,
        "the delete that lifted the pause wakes the dispatcher"
    );
    // Throughput recovers: everything else is delivered, ACKed and deleted.
    for _ in 0..100 {
        sim.settle();
        let deliveries = sim.recv(c);
        if deliveries.is_empty() {
            break;
        }
        got.extend(deliveries.iter().map(payload));
        sim.ack(c, &keys(&deliveries));
        sim.advance(100);
        sim.flush_deletes();
    }
    sim.advance(100);
    sim.flush_deletes();
    let mut expected: Vec<String> = (0..40).map(|i| format!("{i}")).collect();
    expected.sort();
    got.sort();
    assert_eq!(got, expected, "every message delivered exactly once");
    assert_eq!(sim.event_keys_stored(), 0);
    assert!(!sim.core.borrow().dispatch_paused());
}

#[test]
fn an_entry_drops_its_value_once_every_recipient_acked() {
    let mut sim = Sim::new(config());
    let a = sim.subscribe("t", "a");
    let b = sim.subscribe("t", "b");
    let tag = sim.publish("t", "m");
    sim.settle();
    sim.recv(a);
    sim.recv(b);
    sim.ack(a, &[tag]);
    assert_eq!(
        sim.core.borrow().value_held(&tag),
        Some(true),
        "b still holds it"
    );
    sim.ack(b, &[tag]);
    assert_eq!(
        sim.core.borrow().value_held(&tag),
        Some(false),
        "the entry waits for its delete without its value"
    );
    sim.advance(100);
    sim.flush_deletes();
    assert_eq!(sim.core.borrow().value_held(&tag), None);
}

#[test]
fn an_expired_entry_drops_its_value_at_once() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    let tag = sim.publish_with("t", "m", 0, 50);
    sim.settle();
    sim.advance(60);
    assert!(sim.recv(c).is_empty(), "expired in the queue");
    assert_eq!(sim.core.borrow().value_held(&tag), Some(false));
    assert_eq!(sim.core.borrow().stats().in_flight, 0);
}

#[test]
fn in_flight_counts_messages_with_copies_not_yet_settled_not_those_waiting_for_their_delete() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 16,
        ..config()
    });
    let c = sim.subscribe("t", "g");
    let tags: Vec<EventKey> = (0..3).map(|i| sim.publish("t", &format!("{i}"))).collect();
    sim.settle();
    sim.recv(c);
    assert_eq!(sim.core.borrow().stats().in_flight, 3);
    sim.ack(c, &tags[..2]);
    let stats = sim.core.borrow().stats();
    assert_eq!(stats.in_flight, 1);
    assert_eq!(stats.delete_backlog, 2);
    sim.advance(100);
    sim.flush_deletes();
    let stats = sim.core.borrow().stats();
    assert_eq!(stats.in_flight, 1);
    assert_eq!(stats.delete_backlog, 0);
}

#[test]
fn a_drained_in_flight_table_and_timer_heap_give_their_memory_back() {
    let n = 20_000;
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 1 << 16,
        unacked_per_consumer_max: 1 << 16,
        scan_batch_len_max: 4096,
        ..config()
    });
    let c = sim.subscribe("t", "g");
    publish_many(&sim, "t", n);
    sim.settle();
    let deliveries = sim.recv(c);
    assert_eq!(deliveries.len(), n);
    let peak = sim.core.borrow().capacities();
    assert!(peak.in_flight_entries >= n && peak.timers >= n, "{peak:?}");
    for chunk in keys(&deliveries).chunks(1000) {
        sim.ack(c, chunk);
    }
    // A full batch goes at once; the partial rest waits an interval after that cut.
    sim.flush_deletes();
    sim.advance(100);
    sim.flush_deletes();
    assert_eq!(sim.core.borrow().stats().delete_backlog, 0);
    // The lease timers of the ACKed copies are stale; they go when their deadline is popped.
    sim.advance(1_000);
    sim.pass();
    assert_eq!(sim.core.borrow().timers_len(), 0);
    let after = sim.core.borrow().capacities();
    assert!(
        after.in_flight_entries < peak.in_flight_entries / 4,
        "{peak:?} -> {after:?}"
    );
    assert!(after.timers < peak.timers / 4, "{peak:?} -> {after:?}");
    assert!(
        after.delete_queue < n / 4 && after.delete_known < n / 4,
        "{after:?}"
    );
}

/// A group's (backlog, delayed, in flight, scheduled), and the shard's copies in flight and
/// delayed.
fn gauges(sim: &Sim) -> ((u64, u64, u64, u64), (u64, u64)) {
    let stats = sim.core.borrow().stats();
    let g = &stats.groups[0];
    (
        (g.backlog, g.delayed, g.in_flight, g.scheduled),
        (stats.held_copies, stats.delayed_copies),
    )
}

#[test]
fn every_unacked_copy_is_in_one_gauge_while_nack_delays_and_backoffs_run_out() {
    let backoff = super::policy::Backoff::new(400, 400).ok();
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 16,
        redelivery_backoff: backoff,
        ..config()
    });
    let c = sim.subscribe("t", "g");
    let tags: Vec<EventKey> = (0..4).map(|i| sim.publish("t", &format!("m{i}"))).collect();
    sim.publish_with("t", "later", 60_000, 0);
    assert_eq!(
        gauges(&sim),
        ((4, 0, 0, 1), (0, 0)),
        "due, not yet dispatched"
    );
    sim.settle();
    assert_eq!(keys(&sim.recv(c)), tags);
    assert_eq!(gauges(&sim), ((0, 0, 4, 1), (4, 0)));
    // A NACK with a delay, a NACK under the backoff (400 ms less up to a quarter), an ACK.
    sim.nack(c, &tags[..1], 200);
    sim.nack(c, &tags[1..2], 0);
    sim.ack(c, &tags[2..3]);
    assert_eq!(gauges(&sim), ((0, 2, 1, 1), (1, 2)), "5 published, 1 ACKed");
    sim.advance(200);
    sim.settle();
    assert_eq!(
        gauges(&sim),
        ((0, 1, 2, 1), (2, 1)),
        "the delay ran out: held again"
    );
    sim.advance(400);
    sim.settle();
    assert_eq!(
        gauges(&sim),
        ((0, 0, 3, 1), (3, 0)),
        "the backoff ran out too"
    );
    sim.core.borrow().assert_consistent();
}
