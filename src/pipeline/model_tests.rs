//! Model test of the delivery core: seeded random sequences of publish, subscribe, unsubscribe,
//! drain, ACK, NACK, touch, time, dispatch passes, delete flushes and janitor sweeps, run through
//! the `Sim` harness and checked after every step against a small reference model.
//!
//! The model does not re-implement dispatch. It records what it has seen (publishes, deliveries,
//! settlement results, passes, deletes) and derives what the core may and may not do next:
//!
//! - a delivery is of the consumer's topic, not before its due time, not at or after its expiry,
//!   not after its key's delete was applied, not to a recipient that has ACKed it, and not to a
//!   second consumer of a recipient while the copy is known to be held by another (or is waiting
//!   out a NACK delay);
//! - only the holder's ACK/NACK/touch is accepted; a known holder's is never refused;
//! - a key is deleted only once it expired or every sticky recipient ACKed it;
//! - queues and unacknowledged copies stay within their bounds;
//! - a subscription is refused only past a bound on groups or consumers (groups per topic, per
//!   shard, consumers per group, all small and random here), never one an existing group has room
//!   for; timers stay one per held or delayed copy;
//! - idempotent publish: a message whose (producer, sequence) was stored less than the window ago
//!   (and not by a batch that failed) is answered with the original tag and not stored again;
//!   a new tag for such a pair only once the table's bounds forgot pairs (its eviction counters
//!   say so); a republish while the original's batch is not applied waits on it, and learns
//!   whether it was stored; stored sequence entries stay within the table and its delete queue;
//! - dead letters (each topic's sticky group has a random `maxDeliveries` policy, the defaults a
//!   random backoff): no copy is delivered more often than its group's maximum; a dead letter
//!   names a copy delivered exactly that often, of its topic, bound for `{topic}.dlq`; a
//!   confirmed one ACKs the copy for its group; an unconfirmed one (a lost publish) comes back
//!   after its guard;
//! - at the end, with every consumer ACKing and time run past every delay, lease, TTL and
//!   retention, every message without a TTL reached every sticky recipient and the store is empty.
//!
//! "Known to be held" is a [`Lock`]: the copy cannot change hands until a dispatch pass runs at or
//! after `until_ms` (leases and NACK delays are released only by passes). A lease's deadline is at
//! least `inFlightTimeout` after the consumer's queue was last seen empty, since the copy was
//! queued after that.
//!
//! A failing seed is printed with its last steps (all of them with `PINQ_MODEL_TRACE=1`);
//! `PINQ_MODEL_SEED=N` replays one seed and `PINQ_MODEL_SEEDS=N` runs more seeds than the default.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};

use futures_lite::future::block_on;

use super::dedup::{DedupLimits, Originals};
use super::drive;
use super::hub::Limit;
use super::shard::{Delivery, StoreBatch, TagResult};
use super::tests::batch;
use super::tests::Sim;
use super::ConsumerId;
use crate::config::DeliveryConfig;
use crate::key::{due_bucket, EventKey, TopicHash};
use crate::log::sequences::sequence_key_range;
use crate::rpc::PublishMessage;

const SEEDS: u64 = 200;
const STEPS: usize = 300;
const CONSUMERS_MAX: usize = 12;
const SLOW_PUBLISHES_MAX: usize = 2;
const DELAY_MAX_MS: u64 = 2_000;
const TTL_MAX_MS: u64 = 3_000;
const NACK_DELAY_MAX_MS: u64 = 1_500;
const ADVANCE_MAX_MS: u64 = 1_500;
const FINAL_ROUNDS_MAX: usize = 50;
const TRACE_SHOWN: usize = 80;
/// Wake-ups in a row at one instant before the shell is declared to busy-loop.
const SHELL_SPINS_MAX: usize = 1_000;

const TOPICS: [&str; 3] = ["t0", "t1", "t2"];
const PRODUCERS: [&str; 3] = ["p0", "p1", "p2"];
/// Sticky group: one member per topic from before the first publish to the end.
const STICKY_GROUP: &str = "g1";
const GROUPS: [&str; 3] = [STICKY_GROUP, "g2", ""];

/// A recipient as the model names it: a group of a topic, or one universal consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Rcpt {
    Group { topic: usize, group: &'static str },
    Universal(ConsumerId),
}

struct Message {
    topic: usize,
    enqueued_at_ms: u64,
    delay_ms: u64,
    ttl_ms: u64,
    /// In the store (a slow publish is not until it completes; a failed one never is).
    stored: bool,
    abandoned: bool,
    deleted: bool,
    delivered_to: BTreeSet<Rcpt>,
    acked_by: BTreeSet<Rcpt>,
}

impl Message {
    fn expired_at(&self, now_ms: u64) -> bool {
        self.ttl_ms > 0 && now_ms >= self.enqueued_at_ms + self.ttl_ms
    }
}

struct Consumer {
    topic: usize,
    group: &'static str,
    sticky: bool,
    uuid: uuid::Uuid,
    /// When its queue was last seen empty: everything queued later was queued at or after this.
    emptied_at_ms: u64,
    /// Tags drained and not yet settled by this consumer (candidates for ACK, NACK, touch).
    holding: Vec<EventKey>,
    /// Its `queueSize` in force, and the deliveries drained but not yet returned (a client
    /// whose `deliver` call is still running).
    window: usize,
    out: Vec<EventKey>,
}

/// The copy cannot change hands (or, with `holder: None`, cannot be handed out at all) until a
/// dispatch pass numbered above `after_pass` runs at or after `until_ms`.
#[derive(Clone, Copy, Debug)]
struct Lock {
    holder: Option<ConsumerId>,
    until_ms: u64,
    after_pass: u64,
}

#[derive(Clone, Copy, Debug)]
enum CopyState {
    Locked(Lock),
    Acked,
}

#[derive(Clone, Copy, Debug)]
struct CopyRecord {
    state: CopyState,
    last_attempt: u32,
}

/// What the model knows of a (producer, sequence) pair's last store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PairState {
    Pending,
    Stored,
    Abandoned,
}

#[derive(Clone, Copy, Debug)]
struct Pair {
    tag: EventKey,
    stored_at_ms: u64,
    state: PairState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settle {
    Ack,
    Nack(u64),
    Touch,
}

struct Model {
    seed: u64,
    rng: fastrand::Rng,
    cfg: DeliveryConfig,
    sim: Sim,
    topics: usize,
    consumers: BTreeMap<ConsumerId, Consumer>,
    sticky_universal: Vec<ConsumerId>,
    messages: BTreeMap<EventKey, Message>,
    copies: BTreeMap<(EventKey, Rcpt), CopyRecord>,
    slow: Vec<StoreBatch>,
    passes: u64,
    last_pass_ms: u64,
    next_uuid: u128,
    next_payload: u64,
    trace: Vec<String>,
    /// Groups subscribed to and not forgotten by an admin call: a superset of the core's groups
    /// (retention may have forgotten some).
    groups_seen: BTreeSet<(usize, &'static str)>,
    /// Subscriptions refused so far: past a bound on groups, past a bound on consumers.
    refused: (u64, u64),
    /// Groups whose last member left, and when (retention may forget them).
    groups_emptied: BTreeMap<(usize, &'static str), u64>,
    dedup: DedupLimits,
    pairs: BTreeMap<(String, u64), Pair>,
    /// The highest sequence each producer used.
    sequences: [u64; 3],
    /// Republishes answered with a pending original, waiting for it.
    waiting: Vec<StoreBatch>,
    /// `maxDeliveries` of each topic's sticky group (0 = unlimited).
    max_deliveries: Vec<u32>,
    /// Dead letters confirmed, and those dropped as if their publish had failed.
    dead_letters: (u64, u64),
    /// In the final phase every dead letter is confirmed.
    confirm_all: bool,
}

impl Model {
    fn new(seed: u64) -> Model {
        let mut rng = fastrand::Rng::with_seed(seed);
        let cfg = DeliveryConfig {
            dispatch_poll_interval_ms: 50,
            in_flight_timeout_ms: 1_000,
            delete_batch_interval_ms: 100,
            delete_batch_keys_max: rng.usize(1..=8),
            ttl_sweep_interval_ms: 3_000,
            consumer_queue_len_max: rng.usize(1..=4),
            time_bucket_ms: [1, 1, 1, 7, 10][rng.usize(0..5)],
            group_retention_ms: 5_000,
            unacked_per_consumer_max: rng.usize(1..=6),
            retry_len_max: rng.usize(2..=32),
            scan_batch_len_max: rng.usize(1..=8),
            delete_batches_in_flight_max: rng.usize(1..=3),
            // Small enough that the delete-backlog pause happens in most runs.
            delete_backlog_keys_max: rng.usize(8..=32),
            groups_per_topic_max: rng.usize(1..=2),
            groups_per_shard_max: 0,
            consumers_per_group_max: rng.usize(2..=6),
            counted_topics_max: rng.usize(1..=3),
            group_metrics_max: 4,
            max_deliveries: 0,
            dead_letter_topic: crate::pipeline::policy::DEAD_LETTER_TOPIC_DEFAULT.into(),
            redelivery_backoff: rng
                .bool()
                .then(|| crate::pipeline::policy::Backoff::new(rng.u64(1..=20), 400).ok())
                .flatten(),
        };
        let topics = rng.usize(2..=3);
        let max_deliveries: Vec<u32> = (0..topics).map(|_| [0, 1, 2, 3][rng.usize(0..4)]).collect();
        // Every topic's sticky group must fit.
        let cfg = DeliveryConfig {
            groups_per_shard_max: rng.usize(topics..=2 * topics),
            ..cfg
        };
        let sim = Sim::new(cfg.clone());
        let dedup = DedupLimits {
            window_ms: rng.u64(300..=6_000),
            producers_max: rng.usize(1..=3),
            entries_max: rng.usize(2..=24),
        };
        let core = super::ShardCore::new(cfg.clone(), sim.now_ms).with_dedup_limits(dedup);
        *sim.core.borrow_mut() = core;
        let mut model = Model {
            seed,
            rng,
            cfg,
            sim,
            topics,
            consumers: BTreeMap::new(),
            sticky_universal: Vec::new(),
            messages: BTreeMap::new(),
            copies: BTreeMap::new(),
            slow: Vec::new(),
            passes: 0,
            last_pass_ms: 0,
            next_uuid: 1,
            next_payload: 0,
            trace: Vec::new(),
            groups_seen: BTreeSet::new(),
            refused: (0, 0),
            groups_emptied: BTreeMap::new(),
            dedup,
            pairs: BTreeMap::new(),
            sequences: [0; 3],
            waiting: Vec::new(),
            max_deliveries,
            dead_letters: (0, 0),
            confirm_all: false,
        };
        for (name, max) in TOPICS.iter().zip(model.max_deliveries.clone()) {
            let policy = crate::pipeline::policy::PolicyOverride {
                max_deliveries: Some(max),
                ..Default::default()
            };
            model
                .sim
                .core
                .borrow_mut()
                .set_policy(name, STICKY_GROUP, policy)
                .expect("a policy per sticky group fits maxGroupsPerShard");
        }
        model.note(format!("seed {seed}: {} topics, {:?}", topics, model.cfg));
        for topic in 0..topics {
            model.subscribe(topic, STICKY_GROUP, true);
            let universal = model.subscribe(topic, "", true);
            model
                .sticky_universal
                .push(universal.expect("the first universal consumer fits"));
        }
        model
    }

    fn note(&mut self, line: String) {
        self.trace.push(line);
    }

    fn now(&self) -> u64 {
        self.sim.now_ms
    }

    fn rcpt_of(&self, consumer: ConsumerId) -> Rcpt {
        let c = &self.consumers[&consumer];
        if c.group.is_empty() {
            Rcpt::Universal(consumer)
        } else {
            Rcpt::Group {
                topic: c.topic,
                group: c.group,
            }
        }
    }

    /// Whether `lock` still holds: no pass after it was taken has run at or after `until_ms`.
    fn locked(&self, lock: &Lock) -> bool {
        !(self.passes > lock.after_pass && self.last_pass_ms >= lock.until_ms)
    }

    // ---- the random phase ----------------------------------------------------------------

    fn run(&mut self) {
        for _ in 0..STEPS {
            self.random_step();
            self.check_bounds();
        }
        self.final_phase();
    }

    fn random_step(&mut self) {
        let roll = self.rng.u32(0..100);
        match roll {
            0..=19 => self.publish(),
            20..=22 => self.begin_slow_publish(),
            23..=24 => self.complete_slow_publish(),
            25 => self.republish_pending(),
            26 => self.fail_slow_publish(),
            27..=31 => {
                if self.consumers.len() < CONSUMERS_MAX {
                    let topic = self.rng.usize(0..self.topics);
                    let group = GROUPS[self.rng.usize(0..GROUPS.len())];
                    self.subscribe(topic, group, false);
                }
            }
            32..=35 => self.unsubscribe_random(),
            36..=49 => {
                if let Some(c) = self.random_consumer() {
                    let max = if self.rng.bool() {
                        usize::MAX
                    } else {
                        self.rng.usize(1..=3)
                    };
                    self.drain(c, max);
                }
            }
            50..=61 => self.settle_random(Settle::Ack),
            62..=66 => {
                let delay = if self.rng.bool() {
                    0
                } else {
                    self.rng.u64(1..=NACK_DELAY_MAX_MS)
                };
                self.settle_random(Settle::Nack(delay));
            }
            67..=70 => self.settle_random(Settle::Touch),
            71..=80 => {
                let ms = self.rng.u64(0..=ADVANCE_MAX_MS);
                self.advance(ms);
            }
            81..=84 => {
                let ms = self.rng.u64(0..=ADVANCE_MAX_MS);
                self.run_like_the_shell(ms);
            }
            85..=88 => {
                self.pass();
            }
            89..=94 => self.settle(),
            95..=96 => self.flush_deletes(),
            97 => self.failed_flush(),
            98 => self.sweep(),
            _ => self.forget_group(),
        }
    }

    fn random_consumer(&mut self) -> Option<ConsumerId> {
        let ids: Vec<ConsumerId> = self.consumers.keys().copied().collect();
        (!ids.is_empty()).then(|| ids[self.rng.usize(0..ids.len())])
    }

    fn new_message(&mut self) -> PublishMessage {
        self.new_message_numbered(false)
    }

    /// A message, some of them numbered by a producer: a fresh sequence, or (unless
    /// `fresh_only`) one used before whose original is not pending.
    fn new_message_numbered(&mut self, fresh_only: bool) -> PublishMessage {
        let message = self.new_plain_message();
        if self.rng.u8(0..10) < 6 {
            return message;
        }
        let p = self.rng.usize(0..PRODUCERS.len());
        let used = self.sequences[p];
        let again = (!fresh_only && used > 0 && self.rng.bool())
            .then(|| self.rng.u64(1..=used))
            .filter(|s| {
                self.pairs
                    .get(&(PRODUCERS[p].to_owned(), *s))
                    .is_none_or(|pair| pair.state != PairState::Pending)
            });
        let sequence = again.unwrap_or_else(|| {
            self.sequences[p] += 1;
            self.sequences[p]
        });
        message.with_sequence(PRODUCERS[p], sequence)
    }

    fn new_plain_message(&mut self) -> PublishMessage {
        let topic = self.rng.usize(0..self.topics);
        let delay_ms = if self.rng.u8(0..10) < 3 {
            self.rng.u64(0..=DELAY_MAX_MS)
        } else {
            0
        };
        let ttl_ms = if self.rng.u8(0..10) < 3 {
            self.rng.u64(1..=TTL_MAX_MS)
        } else {
            0
        };
        self.next_payload += 1;
        PublishMessage {
            delay_ms,
            ttl_ms,
            ..PublishMessage::new(TOPICS[topic], format!("m{}", self.next_payload).as_bytes())
        }
    }

    fn record_published(&mut self, key: EventKey, message: &PublishMessage, stored: bool) {
        let topic = TOPICS.iter().position(|t| *t == message.topic).unwrap();
        let now = self.now();
        assert_eq!(key.topic_hash(), TopicHash::of(&message.topic));
        assert_eq!(
            key.due_bucket(),
            due_bucket(now, message.delay_ms, self.cfg.time_bucket_ms),
            "a key's due bucket is its due time's bucket"
        );
        let fresh = self.messages.insert(
            key,
            Message {
                topic,
                enqueued_at_ms: now,
                delay_ms: message.delay_ms,
                ttl_ms: message.ttl_ms,
                stored,
                abandoned: false,
                deleted: false,
                delivered_to: BTreeSet::new(),
                acked_by: BTreeSet::new(),
            },
        );
        assert!(
            fresh.is_none(),
            "a delivery tag was handed out twice: {key:?}"
        );
    }

    fn publish(&mut self) {
        let n = self.rng.usize(1..=3);
        let messages: Vec<PublishMessage> = (0..n).map(|_| self.new_message()).collect();
        let tags = block_on(drive::publish(
            &self.sim.core,
            &self.sim.store,
            self.now(),
            batch(&messages),
        ))
        .unwrap();
        assert_eq!(tags.len(), messages.len());
        for (key, message) in tags.iter().zip(&messages) {
            self.note(format!(
                "@{} publish {} {:?} delay {} ttl {} pair {:?} -> {key:?}",
                self.now(),
                message.topic,
                String::from_utf8_lossy(&message.payload),
                message.delay_ms,
                message.ttl_ms,
                (&message.producer_id, message.sequence)
            ));
            if self.check_pair(*key, message, PairState::Stored) {
                self.record_published(*key, message, true);
            }
        }
    }

    /// Checks the answer to a numbered message against what the model knows of its pair and
    /// records a new store of it. Returns whether the message was stored (not a duplicate).
    fn check_pair(&mut self, tag: EventKey, message: &PublishMessage, state: PairState) -> bool {
        let duplicate = self.messages.contains_key(&tag);
        if message.producer_id.is_empty() {
            assert!(
                !duplicate,
                "a message without a producer id was answered with an old tag"
            );
            return true;
        }
        let id = (message.producer_id.clone(), message.sequence);
        let now = self.now();
        let known = self.pairs.get(&id).copied().filter(|p| {
            p.state != PairState::Abandoned && now < p.stored_at_ms + self.dedup.window_ms
        });
        if duplicate {
            let pair = known.unwrap_or_else(|| {
                panic!("{id:?} answered with {tag:?}, but no store of it is remembered")
            });
            assert_eq!(pair.tag, tag, "{id:?} answered with another pair's tag");
            return false;
        }
        if let Some(pair) = known {
            let c = self.sim.core.borrow().dedup_table().counters;
            assert!(
                c.evicted_entries_total + c.evicted_producers_total > 0,
                "{id:?} stored again inside its window ({pair:?}) though no bound forgot a pair"
            );
        }
        self.pairs.insert(
            id,
            Pair {
                tag,
                stored_at_ms: now,
                state,
            },
        );
        true
    }

    /// Republishes a pair whose original's batch is still being stored: the answer names the
    /// original and waits for it.
    fn republish_pending(&mut self) {
        let c = self.sim.core.borrow().dedup_table().counters;
        if c.evicted_entries_total + c.evicted_producers_total > 0 {
            return;
        }
        let now = self.now();
        let window_ms = self.dedup.window_ms;
        let Some(entry) = self
            .slow
            .iter()
            .find_map(|b| b.remember.first().cloned())
            .filter(|e| now < e.stored_at_ms + window_ms)
        else {
            return;
        };
        let message = self
            .new_plain_message()
            .with_sequence(entry.producer.as_ref(), entry.sequence);
        let dup = self
            .sim
            .core
            .borrow_mut()
            .prepare_publish(self.now(), batch(std::slice::from_ref(&message)));
        self.note(format!(
            "@{} republish of pending {:?} -> {:?}",
            self.now(),
            (&entry.producer, entry.sequence),
            dup.tags()
        ));
        assert_eq!(dup.tags(), vec![entry.tag]);
        assert!(dup.messages.is_empty() && dup.waits.len() == 1);
        assert_eq!(self.sim.core.borrow().originals(&dup), Originals::Waiting);
        self.sim.store.inner.apply(&dup.command());
        self.sim.core.borrow_mut().on_publish_applied(&dup);
        self.waiting.push(dup);
    }

    /// A slow batch settled: the republishes waiting on it learn whether it was stored.
    fn settle_waiting(&mut self, settled: &StoreBatch, stored: bool) {
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|w| {
                w.waits
                    .iter()
                    .all(|(_, _, tag)| settled.answers.contains(tag))
            });
        self.waiting = rest;
        let want = if stored {
            Originals::Stored
        } else {
            Originals::Lost
        };
        for w in mine {
            let state = self.sim.core.borrow().originals(&w);
            // A bound may have forgotten the pair meanwhile: then it reads as lost.
            let c = self.sim.core.borrow().dedup_table().counters;
            let evicted = c.evicted_entries_total + c.evicted_producers_total > 0;
            // So may its window's end: the answer is then "not stored", and a retry stores it.
            let now = self.now();
            let expired = w.waits.iter().any(|(p, seq, _)| {
                self.pairs
                    .get(&(p.to_string(), *seq))
                    .is_some_and(|pair| now >= pair.stored_at_ms + self.dedup.window_ms)
            });
            assert!(
                state == want || ((evicted || expired) && state == Originals::Lost),
                "a republish waiting on {:?} sees {state:?}, the batch was {}",
                w.waits,
                if stored { "stored" } else { "not stored" }
            );
        }
    }

    /// A publish whose keys are assigned but whose store write has not landed yet.
    fn begin_slow_publish(&mut self) {
        if self.slow.len() >= SLOW_PUBLISHES_MAX {
            return;
        }
        let message = self.new_message_numbered(true);
        let batch = self
            .sim
            .core
            .borrow_mut()
            .prepare_publish(self.now(), batch(std::slice::from_ref(&message)));
        let key = batch.messages[0].0;
        assert!(self.check_pair(key, &message, PairState::Pending));
        self.note(format!(
            "@{} slow publish begins {} delay {} ttl {} -> {key:?}",
            self.now(),
            message.topic,
            message.delay_ms,
            message.ttl_ms
        ));
        self.record_published(key, &message, false);
        self.slow.push(batch);
    }

    fn complete_slow_publish(&mut self) {
        if self.slow.is_empty() {
            return;
        }
        let batch = self.slow.remove(self.rng.usize(0..self.slow.len()));
        self.note(format!(
            "@{} slow publish lands {:?}",
            self.now(),
            batch.tags()
        ));
        self.sim.store.inner.apply(&batch.command());
        self.sim.core.borrow_mut().on_publish_applied(&batch);
        for key in batch.tags() {
            self.messages.get_mut(&key).unwrap().stored = true;
        }
        self.set_pair_states(&batch, PairState::Stored);
        self.settle_waiting(&batch, true);
    }

    fn set_pair_states(&mut self, batch: &StoreBatch, state: PairState) {
        for entry in &batch.remember {
            let id = (entry.producer.to_string(), entry.sequence);
            if let Some(pair) = self.pairs.get_mut(&id) {
                if pair.tag == entry.tag {
                    pair.state = state;
                }
            }
        }
    }

    fn fail_slow_publish(&mut self) {
        if self.slow.is_empty() {
            return;
        }
        let batch = self.slow.remove(self.rng.usize(0..self.slow.len()));
        self.note(format!(
            "@{} slow publish fails {:?}",
            self.now(),
            batch.tags()
        ));
        self.sim.core.borrow_mut().on_publish_failed(&batch);
        for key in batch.tags() {
            self.messages.get_mut(&key).unwrap().abandoned = true;
        }
        self.set_pair_states(&batch, PairState::Abandoned);
        self.settle_waiting(&batch, false);
    }

    /// Subscribes, or checks that the refusal was owed to a bound.
    fn subscribe(&mut self, topic: usize, group: &'static str, sticky: bool) -> Option<ConsumerId> {
        let uuid = uuid::Uuid::from_u128(self.next_uuid);
        self.next_uuid += 1;
        let now = self.now();
        let asked = self.rng.usize(0..=6);
        let window = match asked {
            0 => self.cfg.consumer_queue_len_max,
            n => n.min(self.cfg.consumer_queue_len_max),
        };
        let result =
            self.sim
                .core
                .borrow_mut()
                .subscribe_window(now, TOPICS[topic], group, uuid, asked);
        let members = self
            .consumers
            .values()
            .filter(|c| c.topic == topic && c.group == group)
            .count();
        let id = match result {
            Ok(id) => id,
            Err(e) => {
                self.note(format!(
                    "@{now} subscribe {} {group:?} -> {e}",
                    TOPICS[topic]
                ));
                assert!(!sticky, "a sticky consumer was refused: {e}");
                self.check_refusal(topic, members, e);
                return None;
            }
        };
        assert!(
            members < self.cfg.consumers_per_group_max,
            "{members} consumers of {} {group:?} already, yet one more was accepted",
            TOPICS[topic]
        );
        if !group.is_empty() {
            self.groups_seen.insert((topic, group));
            // A group retention may have forgotten is a new recipient of the same name: what the
            // old one did (ACKs, locks) says nothing about it.
            let emptied = self.groups_emptied.remove(&(topic, group));
            if emptied.is_some_and(|at| now >= at + self.cfg.group_retention_ms) {
                self.forget_records(topic, group);
            }
        }
        self.note(format!(
            "@{now} subscribe {} {group:?}{} -> {id:?}",
            TOPICS[topic],
            if sticky { " (sticky)" } else { "" }
        ));
        let fresh = self.consumers.insert(
            id,
            Consumer {
                topic,
                group,
                sticky,
                uuid,
                emptied_at_ms: now,
                holding: Vec::new(),
                window,
                out: Vec::new(),
            },
        );
        assert!(fresh.is_none(), "consumer id reused: {id:?}");
        Some(id)
    }

    /// Drops what the model knows of a group's copies: the group was (or may have been)
    /// forgotten, and a group of that name is a new recipient.
    fn forget_records(&mut self, topic: usize, group: &'static str) {
        let rcpt = Rcpt::Group { topic, group };
        self.copies.retain(|(_, r), _| *r != rcpt);
    }

    /// A subscription was refused: the bound it names must really be reached.
    fn check_refusal(&mut self, topic: usize, members: usize, e: super::ConsumerError) {
        let super::ConsumerError::Limit(limit) = e else {
            panic!("subscribe refused for another reason: {e}");
        };
        if limit.is_groups() {
            self.refused.0 += 1;
        } else {
            self.refused.1 += 1;
        }
        let seen_in_topic = self.groups_seen.iter().filter(|(t, _)| *t == topic).count();
        match limit {
            Limit::ConsumersPerGroup { limit, .. } | Limit::UniversalsPerTopic { limit, .. } => {
                assert_eq!(members, limit, "refused below the consumer bound");
            }
            Limit::GroupsPerTopic { limit, .. } => {
                assert_eq!(members, 0, "an existing group was refused as a new one");
                assert!(
                    seen_in_topic >= limit,
                    "refused below the topic's group bound"
                );
            }
            Limit::GroupsPerShard { limit } => {
                assert_eq!(members, 0, "an existing group was refused as a new one");
                assert!(
                    self.groups_seen.len() >= limit,
                    "refused below the shard's group bound"
                );
            }
        }
    }

    fn unsubscribe_random(&mut self) {
        let leaving: Vec<ConsumerId> = self
            .consumers
            .iter()
            .filter(|(_, c)| !c.sticky)
            .map(|(id, _)| *id)
            .collect();
        if leaving.is_empty() {
            return;
        }
        let id = leaving[self.rng.usize(0..leaving.len())];
        let now = self.now();
        self.note(format!("@{now} unsubscribe {id:?}"));
        self.sim.core.borrow_mut().unsubscribe(now, id).unwrap();
        self.collect_dead_letters();
        if let Some(gone) = self.consumers.remove(&id) {
            let left = self
                .consumers
                .values()
                .any(|c| c.topic == gone.topic && c.group == gone.group);
            if !gone.group.is_empty() && !left {
                self.groups_emptied.insert((gone.topic, gone.group), now);
            }
        }
        // Copies it was known to hold are released at once: the next pass may hand them to
        // anyone. (A copy whose lock has lapsed may already have moved on: nothing is known.)
        let passes = self.passes;
        let last_pass_ms = self.last_pass_ms;
        for record in self.copies.values_mut() {
            if let CopyState::Locked(lock) = &mut record.state {
                let held = !(passes > lock.after_pass && last_pass_ms >= lock.until_ms);
                if held && lock.holder == Some(id) {
                    *lock = Lock {
                        holder: None,
                        until_ms: now,
                        after_pass: passes,
                    };
                }
            }
        }
    }

    fn forget_group(&mut self) {
        let topic = self.rng.usize(0..self.topics);
        let now = self.now();
        let result = self
            .sim
            .core
            .borrow_mut()
            .forget_group(now, TOPICS[topic], "g2");
        let members = self
            .consumers
            .values()
            .filter(|c| c.topic == topic && c.group == "g2")
            .count();
        self.note(format!(
            "@{now} forget group {} g2 ({members} members) -> {result:?}",
            TOPICS[topic]
        ));
        if members > 0 {
            assert!(
                result.is_err(),
                "a group with consumers cannot be forgotten"
            );
        } else {
            self.groups_seen.remove(&(topic, "g2"));
        }
        if result.is_ok() {
            self.groups_emptied.remove(&(topic, "g2"));
            self.forget_records(topic, "g2");
        }
    }

    // ---- deliveries ----------------------------------------------------------------------

    fn drain(&mut self, consumer: ConsumerId, max: usize) -> usize {
        let now = self.now();
        let deliveries = self.sim.core.borrow_mut().drain(now, consumer, max);
        assert!(deliveries.len() <= max);
        self.note(format!(
            "@{now} drain {consumer:?} max {max} -> {:?}",
            deliveries
                .iter()
                .map(|d| (d.key, d.attempt))
                .collect::<Vec<_>>()
        ));
        for delivery in &deliveries {
            self.check_delivery(consumer, delivery);
        }
        // Most clients return at once; some keep their `deliver` calls running a while.
        let c = self.consumers.get_mut(&consumer).unwrap();
        c.out.extend(deliveries.iter().map(|d| d.key));
        if self.rng.usize(0..3) > 0 {
            self.return_deliveries(consumer);
        }
        let queue_len = self.sim.core.borrow().consumer_info(consumer).unwrap().2;
        if queue_len == 0 {
            self.consumers.get_mut(&consumer).unwrap().emptied_at_ms = now;
        }
        deliveries.len()
    }

    /// The consumer's running `deliver` calls return.
    fn return_deliveries(&mut self, consumer: ConsumerId) {
        let c = self.consumers.get_mut(&consumer).unwrap();
        let keys = std::mem::take(&mut c.out);
        if !keys.is_empty() {
            self.note(format!("return {consumer:?} {}", keys.len()));
            let now = self.now();
            self.sim.core.borrow_mut().returned(now, consumer, &keys);
        }
    }

    fn check_delivery(&mut self, consumer: ConsumerId, delivery: &Delivery) {
        let now = self.now();
        let key = delivery.key;
        let rcpt = self.rcpt_of(consumer);
        let c = &self.consumers[&consumer];
        let Some(m) = self.messages.get(&key) else {
            panic!("{consumer:?} got a message nobody published: {key:?}");
        };
        let stored = delivery.value.message();
        assert_eq!(
            stored.topic.as_str(),
            TOPICS[c.topic],
            "{consumer:?} got a message of another topic: {key:?}"
        );
        assert_eq!(m.topic, c.topic);
        assert!(m.stored && !m.abandoned, "delivered before it was stored");
        assert!(
            now >= m.enqueued_at_ms + m.delay_ms,
            "{key:?} delivered at {now}, before its due time {}",
            m.enqueued_at_ms + m.delay_ms
        );
        assert!(
            !m.expired_at(now),
            "{key:?} delivered at {now}, at or after its expiry {}",
            m.enqueued_at_ms + m.ttl_ms
        );
        assert!(!m.deleted, "{key:?} delivered after its delete was applied");
        if c.group == STICKY_GROUP {
            let max = self.max_deliveries[c.topic];
            assert!(
                max == 0 || delivery.attempt <= max,
                "{key:?} delivered to {rcpt:?} for attempt {}, past maxDeliveries {max}",
                delivery.attempt
            );
        }
        let emptied_at_ms = c.emptied_at_ms;
        let previous = self.copies.get(&(key, rcpt)).copied();
        if let Some(record) = previous {
            match record.state {
                CopyState::Acked => panic!("{key:?} delivered to {rcpt:?}, which has ACKed it"),
                CopyState::Locked(lock) => {
                    assert!(
                        !self.locked(&lock) || lock.holder == Some(consumer),
                        "{key:?} delivered to {consumer:?} of {rcpt:?} while {lock:?} holds \
                         (passes {}, last pass at {})",
                        self.passes,
                        self.last_pass_ms
                    );
                }
            }
            assert!(
                delivery.attempt > record.last_attempt,
                "attempt {} of {key:?} for {rcpt:?} after attempt {}",
                delivery.attempt,
                record.last_attempt
            );
        }
        self.copies.insert(
            (key, rcpt),
            CopyRecord {
                state: CopyState::Locked(Lock {
                    holder: Some(consumer),
                    until_ms: emptied_at_ms + self.cfg.in_flight_timeout_ms,
                    after_pass: self.passes,
                }),
                last_attempt: delivery.attempt,
            },
        );
        self.messages
            .get_mut(&key)
            .unwrap()
            .delivered_to
            .insert(rcpt);
        let holding = &mut self.consumers.get_mut(&consumer).unwrap().holding;
        if !holding.contains(&key) {
            holding.push(key);
        }
    }

    // ---- ACK, NACK, touch ----------------------------------------------------------------

    fn settle_random(&mut self, how: Settle) {
        let Some(consumer) = self.random_consumer() else {
            return;
        };
        let mut tags: Vec<EventKey> = self.consumers[&consumer]
            .holding
            .iter()
            .copied()
            .filter(|_| self.rng.u8(0..10) < 6)
            .collect();
        // Now and then a tag this consumer may well not hold: another's, or one never published.
        if self.rng.u8(0..10) < 3 && !self.messages.is_empty() {
            let keys: Vec<EventKey> = self.messages.keys().copied().collect();
            tags.push(keys[self.rng.usize(0..keys.len())]);
        }
        if self.rng.u8(0..20) == 0 {
            tags.push(EventKey::new(TopicHash::of(TOPICS[0]), 0, u64::MAX / 2));
        }
        if tags.is_empty() {
            return;
        }
        self.settle_tags(consumer, &tags, how);
    }

    fn settle_tags(&mut self, consumer: ConsumerId, tags: &[EventKey], how: Settle) {
        let now = self.now();
        let results = {
            let mut core = self.sim.core.borrow_mut();
            match how {
                Settle::Ack => core.ack(now, consumer, tags),
                Settle::Nack(delay) => core.nack(now, consumer, tags, delay),
                Settle::Touch => core.touch(now, consumer, tags),
            }
        }
        .unwrap();
        self.note(format!(
            "@{now} {how:?} {consumer:?} {:?}",
            tags.iter().zip(&results).collect::<Vec<_>>()
        ));
        assert_eq!(results.len(), tags.len());
        for (key, result) in tags.iter().zip(results) {
            self.check_settled(consumer, *key, result, how);
        }
        self.collect_dead_letters();
    }

    /// Takes the core's dead letters, checks each, and confirms it (its publish succeeded) or,
    /// now and then in the random phase, drops it (its publish failed: the guard brings it back).
    fn collect_dead_letters(&mut self) {
        let letters = self.sim.core.borrow_mut().take_dead_letters();
        for letter in letters {
            let topic = TOPICS
                .iter()
                .position(|t| *t == letter.topic.as_ref())
                .expect("a dead letter of a known topic");
            assert_eq!(
                letter.group.as_ref(),
                STICKY_GROUP,
                "only sticky groups have a maximum"
            );
            let max = self.max_deliveries[topic];
            let rcpt = Rcpt::Group {
                topic,
                group: STICKY_GROUP,
            };
            let record = self.copies.get(&(letter.key, rcpt)).copied();
            assert!(max > 0, "dead letter {letter:?} of an unlimited group");
            // A copy may be queued, time out and be dead-lettered before it was ever drained:
            // the model saw at most as many attempts as the core counted.
            assert!(
                record.map_or(0, |r| r.last_attempt) <= letter.attempts,
                "dead letter {letter:?}: the model saw more attempts ({record:?})"
            );
            assert!(
                letter.attempts >= max,
                "dead letter after {} < {max}",
                letter.attempts
            );
            assert_eq!(letter.dead_letter_topic, format!("{}.dlq", TOPICS[topic]));
            assert_eq!(letter.value.message().topic.as_str(), TOPICS[topic]);
            let m = &self.messages[&letter.key];
            assert!(!m.acked_by.contains(&rcpt), "dead letter of an ACKed copy");
            let confirm = self.confirm_all || self.rng.u8(0..10) < 8;
            let now = self.now();
            self.note(format!(
                "@{now} dead letter {:?} attempts {} {}",
                letter.key,
                letter.attempts,
                if confirm { "stored" } else { "lost" }
            ));
            if !confirm {
                self.dead_letters.1 += 1;
                continue;
            }
            self.dead_letters.0 += 1;
            self.sim
                .core
                .borrow_mut()
                .on_dead_lettered(now, letter.key, letter.recipient);
            self.messages
                .get_mut(&letter.key)
                .unwrap()
                .acked_by
                .insert(rcpt);
            if let Some(record) = self.copies.get_mut(&(letter.key, rcpt)) {
                record.state = CopyState::Acked;
            }
        }
    }

    fn check_settled(
        &mut self,
        consumer: ConsumerId,
        key: EventKey,
        result: TagResult,
        how: Settle,
    ) {
        let now = self.now();
        let rcpt = self.rcpt_of(consumer);
        let topic = self.consumers[&consumer].topic;
        let Some(m) = self.messages.get(&key) else {
            assert_eq!(result, TagResult::UnknownTag, "{key:?} was never published");
            return;
        };
        if m.deleted {
            assert_eq!(
                result,
                TagResult::UnknownTag,
                "{how:?} of {key:?}, whose delete was applied"
            );
        }
        if m.topic != topic {
            assert_ne!(
                result,
                TagResult::Ok,
                "{consumer:?} settled a message of another topic"
            );
        }
        let expired = m.expired_at(now);
        let record = self.copies.get(&(key, rcpt)).copied();
        match record.map(|r| r.state) {
            Some(CopyState::Acked) if !m.deleted => assert_eq!(
                result,
                TagResult::AlreadyAcked,
                "{how:?} by {consumer:?} of {key:?}, which {rcpt:?} ACKed"
            ),
            Some(CopyState::Locked(lock)) if self.locked(&lock) => {
                if lock.holder == Some(consumer) {
                    if !expired {
                        assert_eq!(
                            result,
                            TagResult::Ok,
                            "{how:?} of {key:?} by its holder {consumer:?} was refused"
                        );
                    }
                } else {
                    assert_ne!(
                        result,
                        TagResult::Ok,
                        "{how:?} of {key:?} by {consumer:?} accepted while {lock:?} holds"
                    );
                }
            }
            _ => {}
        }
        let passes = self.passes;
        let last_attempt = record.map_or(0, |r| r.last_attempt);
        let holding = &mut self.consumers.get_mut(&consumer).unwrap().holding;
        if result != TagResult::Ok {
            holding.retain(|k| *k != key);
            return;
        }
        let state = match how {
            Settle::Ack => {
                holding.retain(|k| *k != key);
                self.messages.get_mut(&key).unwrap().acked_by.insert(rcpt);
                CopyState::Acked
            }
            Settle::Nack(delay_ms) => {
                holding.retain(|k| *k != key);
                CopyState::Locked(Lock {
                    holder: None,
                    until_ms: now + delay_ms,
                    after_pass: passes,
                })
            }
            Settle::Touch => {
                if !holding.contains(&key) {
                    holding.push(key);
                }
                CopyState::Locked(Lock {
                    holder: Some(consumer),
                    until_ms: now + self.cfg.in_flight_timeout_ms,
                    after_pass: passes,
                })
            }
        };
        self.copies.insert(
            (key, rcpt),
            CopyRecord {
                state,
                last_attempt,
            },
        );
    }

    // ---- time, passes, deletes, sweeps ---------------------------------------------------

    fn advance(&mut self, ms: u64) {
        self.sim.advance(ms);
        self.note(format!("@{} advanced {ms}", self.now()));
    }

    fn pass(&mut self) -> bool {
        self.passes += 1;
        self.last_pass_ms = self.now();
        let productive = self.sim.pass();
        self.collect_dead_letters();
        self.note(format!(
            "@{} pass {} -> productive {productive}",
            self.now(),
            self.passes
        ));
        productive
    }

    fn settle(&mut self) {
        for _ in 0..1_000 {
            if !self.pass() {
                return;
            }
        }
        panic!("the dispatcher never settled");
    }

    /// Moves time forward as the shell would: to each `next_wake_ms` in turn, running a pass, a
    /// delete flush and a sweep there.
    fn run_like_the_shell(&mut self, ms: u64) {
        let target = self.now() + ms;
        let mut spins = 0;
        loop {
            // The core's clock moves only when it is called, so a wake-up it asks for may already
            // lie behind the model's clock: that means "at once".
            let wake = self.sim.core.borrow().next_wake_ms().max(self.now());
            if wake > target {
                break;
            }
            spins = if wake == self.now() { spins + 1 } else { 0 };
            assert!(
                spins <= SHELL_SPINS_MAX,
                "the shell busy-loops at {wake}: next_wake_ms keeps answering now, stats {:?}",
                self.sim.core.borrow().stats()
            );
            self.sim.now_ms = wake;
            self.pass();
            self.flush_deletes();
            self.sweep();
        }
        self.sim.now_ms = target;
        self.note(format!("@{} shell ran to here", self.now()));
    }

    fn flush_deletes(&mut self) {
        let batches = self.sim.flush_deletes();
        self.note(format!("@{} flushed {batches} delete batches", self.now()));
        if batches > 0 {
            self.note_deletes();
        }
    }

    /// A delete flush whose store write fails: nothing is deleted, the batch is retried later.
    fn failed_flush(&mut self) {
        *self.sim.store.fail_writes.borrow_mut() = true;
        let result = block_on(drive::flush_deletes(
            &self.sim.core,
            &self.sim.store,
            self.now(),
        ));
        *self.sim.store.fail_writes.borrow_mut() = false;
        self.note(format!("@{} failed flush -> {result:?}", self.now()));
        self.note_deletes();
    }

    fn sweep(&mut self) {
        let swept = block_on(drive::sweep(
            &self.sim.core,
            &self.sim.store,
            self.now(),
            || async {},
        ))
        .unwrap();
        if swept {
            self.note(format!("@{} janitor swept", self.now()));
        }
    }

    /// Finds keys whose delete was applied and checks each was allowed to go.
    fn note_deletes(&mut self) {
        let now = self.now();
        let gone: Vec<EventKey> = self
            .messages
            .iter()
            .filter(|(key, m)| m.stored && !m.deleted && !self.sim.stored(key))
            .map(|(key, _)| *key)
            .collect();
        for key in gone {
            let m = &self.messages[&key];
            let sticky = [
                Rcpt::Group {
                    topic: m.topic,
                    group: STICKY_GROUP,
                },
                Rcpt::Universal(self.sticky_universal[m.topic]),
            ];
            assert!(
                m.expired_at(now) || sticky.iter().all(|r| m.acked_by.contains(r)),
                "{key:?} deleted at {now} before it expired and before {:?} ACKed it (ACKed by {:?})",
                sticky,
                m.acked_by
            );
            self.note(format!("@{now} deleted {key:?}"));
            self.messages.get_mut(&key).unwrap().deleted = true;
        }
    }

    fn check_bounds(&self) {
        let core = self.sim.core.borrow();
        core.assert_consistent();
        self.check_figures(&core.stats());
        let table = core.dedup_table();
        assert!(
            table.len() <= self.dedup.entries_max && table.aged_len() <= self.dedup.entries_max
        );
        assert!(table.producers() <= self.dedup.producers_max);
        let (start, end) = sequence_key_range();
        let stored = self
            .sim
            .store
            .inner
            .scan_now(&start, Some(&end), usize::MAX)
            .len();
        // Pending pairs are in the table but not yet stored; forgotten ones are stored until
        // a store command deletes them (queued, or in a batch not yet landed).
        let deleting =
            table.forget_queued() + self.slow.iter().map(|b| b.forget.len()).sum::<usize>();
        assert!(
            stored <= table.len() + deleting,
            "{stored} sequence entries stored, the table remembers {} and will delete {deleting}",
            table.len(),
        );
        assert!(core.groups_len() <= self.cfg.groups_per_shard_max);
        assert_eq!(core.consumer_count(), self.consumers.len());
        for (id, c) in &self.consumers {
            let (uuid, topic, queue_len, held_len) = core.consumer_info(*id).unwrap();
            assert_eq!(uuid, c.uuid);
            assert_eq!(topic, TOPICS[c.topic]);
            assert!(
                queue_len <= self.cfg.consumer_queue_len_max,
                "{id:?} queues {queue_len}, consumerQueueSize is {}",
                self.cfg.consumer_queue_len_max
            );
            assert!(
                held_len <= self.cfg.unacked_per_consumer_max,
                "{id:?} holds {held_len}, maxUnackedPerConsumer is {}",
                self.cfg.unacked_per_consumer_max
            );
            let (window, out) = core.consumer_window(*id).unwrap();
            assert_eq!(
                (window, out),
                (c.window, c.out.len()),
                "{id:?} window and out"
            );
            assert!(
                queue_len + out <= window,
                "{id:?} queues {queue_len} and has {out} out, its queueSize is {window}"
            );
        }
    }

    /// The stock counts exactly the messages in the store, and an expired message is counted
    /// once, whoever meets it first.
    fn check_figures(&self, stats: &super::ShardStats) {
        let live = |m: &&Message| m.stored && !m.deleted;
        let stored = self.messages.values().filter(live).count() as u64;
        assert_eq!(stats.topics.iter().map(|t| t.stored).sum::<u64>(), stored);
        for t in &stats.topics {
            assert!(t.waiting + t.scheduled <= t.stored, "{t:?}");
        }
        let with_ttl = self
            .messages
            .values()
            .filter(|m| m.stored && m.ttl_ms > 0)
            .count();
        let c = &stats.counters;
        assert!(
            c.expired_dispatcher_total + c.expired_janitor_total <= with_ttl as u64,
            "{} + {} expired, only {with_ttl} messages have a TTL",
            c.expired_dispatcher_total,
            c.expired_janitor_total
        );
        let acked: u64 = stats.groups.iter().map(|g| g.counters.acked).sum();
        assert!(acked <= c.acked_total);
    }

    // ---- the final phase -----------------------------------------------------------------

    /// Every consumer ACKs everything it gets; time runs past every delay, lease, NACK delay,
    /// TTL, group retention, delete interval and sweep interval; repeated until nothing is left.
    fn final_phase(&mut self) {
        self.note("final phase".into());
        self.confirm_all = true;
        while !self.slow.is_empty() {
            self.complete_slow_publish();
        }
        let step_ms = [
            DELAY_MAX_MS,
            TTL_MAX_MS,
            NACK_DELAY_MAX_MS,
            self.cfg.in_flight_timeout_ms,
            self.cfg.group_retention_ms,
            self.cfg.ttl_sweep_interval_ms,
            self.cfg.delete_batch_interval_ms,
        ]
        .into_iter()
        .max()
        .unwrap()
            + 1;
        let mut quiet = false;
        for _ in 0..FINAL_ROUNDS_MAX {
            self.advance(step_ms);
            let mut delivered = 0;
            for _ in 0..100 {
                self.settle();
                let ids: Vec<ConsumerId> = self.consumers.keys().copied().collect();
                let mut round = 0;
                for id in ids {
                    self.return_deliveries(id);
                    round += self.drain(id, usize::MAX);
                    let tags = self.consumers[&id].holding.clone();
                    if !tags.is_empty() {
                        self.settle_tags(id, &tags, Settle::Ack);
                    }
                    self.check_bounds();
                }
                delivered += round;
                if round == 0 {
                    break;
                }
            }
            self.flush_deletes();
            self.sweep();
            self.flush_deletes();
            if delivered == 0 && self.sim.event_keys_stored() == 0 {
                quiet = true;
                break;
            }
        }
        if !quiet {
            let left: Vec<String> = self
                .messages
                .iter()
                .filter(|(_, m)| m.stored && !m.deleted)
                .map(|(key, m)| {
                    format!(
                        "{key:?} enqueued {} delay {} ttl {} delivered to {:?} acked by {:?}",
                        m.enqueued_at_ms, m.delay_ms, m.ttl_ms, m.delivered_to, m.acked_by
                    )
                })
                .collect();
            panic!(
                "never quiet at {}: {} event keys stored, stats {:?}, left:\n  {}",
                self.now(),
                self.sim.event_keys_stored(),
                self.sim.core.borrow().stats(),
                left.join("\n  ")
            );
        }
        for (key, m) in &self.messages {
            if m.ttl_ms > 0 || m.abandoned {
                continue;
            }
            let sticky = [
                Rcpt::Group {
                    topic: m.topic,
                    group: STICKY_GROUP,
                },
                Rcpt::Universal(self.sticky_universal[m.topic]),
            ];
            for rcpt in sticky {
                // A consumer may ACK a copy queued for it before draining it (the random phase
                // ACKs tags it did not receive): that settles the recipient's claim as well.
                assert!(
                    m.delivered_to.contains(&rcpt) || m.acked_by.contains(&rcpt),
                    "{key:?} (no TTL) was never delivered to {rcpt:?}"
                );
            }
            assert!(m.deleted, "{key:?} still stored");
        }
        let stats = self.sim.core.borrow().stats();
        assert_eq!(stats.in_flight, 0, "in-flight entries left: {stats:?}");
        assert_eq!(stats.delete_queued, 0, "deletes left: {stats:?}");
    }
}

/// Runs one seed; returns the subscriptions refused for groups and for consumers, and the dead
/// letters confirmed and lost.
fn run_seed(seed: u64) -> (u64, u64, u64, u64) {
    let mut model = Model::new(seed);
    let outcome = catch_unwind(AssertUnwindSafe(|| model.run()));
    if let Err(panic) = outcome {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let shown = if std::env::var_os("PINQ_MODEL_TRACE").is_some() {
            usize::MAX
        } else {
            TRACE_SHOWN
        };
        let skip = model.trace.len().saturating_sub(shown);
        let trace = model.trace[skip..].join("\n  ");
        panic!(
            "model test failed at seed {} (replay: PINQ_MODEL_SEED={} cargo test --lib \
             model_test): {message}\nlast steps:\n  {trace}",
            model.seed, model.seed
        );
    }
    (
        model.refused.0,
        model.refused.1,
        model.dead_letters.0,
        model.dead_letters.1,
    )
}

#[test]
fn model_test_random_operations_keep_the_delivery_invariants() {
    if let Ok(seed) = std::env::var("PINQ_MODEL_SEED") {
        let refused = run_seed(seed.parse().expect("PINQ_MODEL_SEED is a number"));
        eprintln!("refusals (groups, consumers), dead letters (stored, lost): {refused:?}");
        return;
    }
    let seeds = std::env::var("PINQ_MODEL_SEEDS")
        .ok()
        .map_or(SEEDS, |n| n.parse().expect("PINQ_MODEL_SEEDS is a number"));
    let mut refused = (0, 0);
    let mut dead = (0, 0);
    for seed in 0..seeds {
        let (groups, consumers, stored, lost) = run_seed(seed);
        refused = (refused.0 + groups, refused.1 + consumers);
        dead = (dead.0 + stored, dead.1 + lost);
    }
    // The seeds dead-letter copies, and lose some dead letters that their guard brings back.
    assert!(
        dead.0 > 0 && dead.1 > 0,
        "dead letters (stored, lost): {dead:?}"
    );
    // The bounds are small enough that the seeds meet both kinds of refusal.
    assert!(
        refused.0 > 0 && refused.1 > 0,
        "refusals (groups, consumers): {refused:?}"
    );
}
