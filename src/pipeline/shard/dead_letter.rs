//! Redelivery policy in the core: released copies wait their backoff, copies out of deliveries
//! go to the dead-letter outbox, and group policies are set and read.
//!
//! A copy a consumer lets go (NACK, lease timeout, disconnect) goes through [`ShardCore::release`].
//! If its recipient's policy allows no further delivery, the copy is not made pending: it is
//! parked (state `Delayed`, for `inFlightTimeout`, as a guard) and a [`DeadLetter`] is queued for
//! the shell, which publishes it durably to the dead-letter topic's shard and only then calls
//! [`ShardCore::on_dead_lettered`], which ACKs the copy for its group. If the publish fails or the
//! answer is lost, the guard runs out, the copy is released again, finds its policy still
//! exhausted and is queued again: a dead letter is never lost, at worst stored twice.
//!
//! Backoff: a plain NACK or a lease timeout waits the policy's backoff for the next attempt
//! (state `Delayed`); a NACK with an explicit delay keeps its delay; a disconnect redelivers at
//! once (the consumer did not judge the message). The jitter is derived from the copy, so runs
//! replay exactly.

use std::sync::Arc;

use ahash::AHashMap;

use super::ShardCore;
use crate::key::EventKey;
use crate::message::{CheckedValue, Header};
use crate::pipeline::hub::{Limit, RecipientId, RecipientKind};
use crate::pipeline::inflight::CopyState;
use crate::pipeline::policy::{Backoff, Policy, PolicyOverride};

/// Why a copy came back from its consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    Nack,
    Timeout,
    Disconnect,
}

impl Release {
    /// The reason named in a dead letter's headers.
    pub fn as_str(self) -> &'static str {
        match self {
            Release::Nack => "nack",
            Release::Timeout => "timeout",
            Release::Disconnect => "disconnect",
        }
    }
}

/// A copy out of deliveries, to be published to its dead-letter topic by the shell.
#[derive(Clone, Debug)]
pub struct DeadLetter {
    /// The source message, and the recipient whose copy this is: handed back to
    /// [`ShardCore::on_dead_lettered`] once the dead letter is stored.
    pub key: EventKey,
    pub recipient: RecipientId,
    pub value: CheckedValue,
    pub topic: Arc<str>,
    /// Empty for the universal consumers of the topic.
    pub group: Arc<str>,
    pub dead_letter_topic: String,
    pub attempts: u32,
    pub reason: Release,
}

/// Headers a dead letter carries besides the original ones.
pub const HEADER_TOPIC: &str = "pinq-dlq-topic";
pub const HEADER_GROUP: &str = "pinq-dlq-group";
pub const HEADER_ATTEMPTS: &str = "pinq-dlq-attempts";
pub const HEADER_REASON: &str = "pinq-dlq-reason";

impl DeadLetter {
    /// The message to publish: the original payload and headers, plus headers naming the source
    /// topic, group, attempts and last reason. It is due at once and never expires (whatever the
    /// original's TTL: a dead letter is kept until someone reads it).
    pub fn message(&self) -> crate::rpc::PublishMessage {
        let original = self.value.message();
        let mut headers: Vec<Header> = original
            .headers
            .iter()
            .map(|h| Header {
                key: h.key.as_str().to_owned(),
                value: h.value.as_slice().to_vec(),
            })
            .collect();
        for (key, value) in [
            (HEADER_TOPIC, self.topic.as_bytes().to_vec()),
            (HEADER_GROUP, self.group.as_bytes().to_vec()),
            (HEADER_ATTEMPTS, self.attempts.to_string().into_bytes()),
            (HEADER_REASON, self.reason.as_str().as_bytes().to_vec()),
        ] {
            headers.push(Header {
                key: key.to_owned(),
                value,
            });
        }
        crate::rpc::PublishMessage {
            topic: self.dead_letter_topic.clone(),
            payload: original.payload.as_slice().to_vec(),
            delay_ms: 0,
            ttl_ms: 0,
            headers,
            producer_id: self.producer_id(),
            sequence: self.key.event_id(),
        }
    }

    /// Dead letters are idempotent publishes: one producer per source topic and group, numbered
    /// by the source message's event id (unique on its shard, and a topic hash names one
    /// shard), so a dead letter sent again because its answer was lost is stored once within
    /// `publish.dedupWindow`.
    fn producer_id(&self) -> String {
        let group = xxhash_rust::xxh3::xxh3_64(self.group.as_bytes());
        format!("pinq-dlq/{:016x}/{group:016x}", self.key.topic_hash().0)
    }
}

/// Per-shard state of the policies: the defaults, the per-group overrides (bounded by
/// `maxGroupsPerShard`), the dead-letter outbox and per-recipient dead-letter counts.
pub struct Policies {
    defaults: Policy,
    overrides: AHashMap<Arc<str>, AHashMap<Arc<str>, PolicyOverride>>,
    overrides_len: usize,
    /// Bounded by the copies parked for dead-lettering (each is queued once per release).
    outbox: Vec<DeadLetter>,
}

impl Policies {
    pub fn new(defaults: Policy) -> Policies {
        Policies {
            defaults,
            overrides: AHashMap::new(),
            overrides_len: 0,
            outbox: Vec::new(),
        }
    }

    fn defaults(&self) -> &Policy {
        &self.defaults
    }

    fn override_of(&self, topic: &str, group: &str) -> Option<&PolicyOverride> {
        self.overrides.get(topic)?.get(group)
    }

    /// Max deliveries and backoff of a recipient, without building its whole policy (the NACK
    /// path).
    fn limits(&self, topic: &str, group: &str) -> (u32, Option<Backoff>) {
        let d = self.defaults();
        match self.override_of(topic, group) {
            None => (d.max_deliveries, d.backoff),
            Some(o) => (
                o.max_deliveries.unwrap_or(d.max_deliveries),
                o.backoff.unwrap_or(d.backoff),
            ),
        }
    }
}

impl ShardCore {
    /// The topic and group name of a recipient (empty group: universal consumers).
    fn recipient_names(&self, recipient: RecipientId) -> Option<(Arc<str>, Arc<str>)> {
        let r = self.hub.recipients.get(&recipient)?;
        let group = match &r.kind {
            RecipientKind::Group { name, .. } => name.clone(),
            RecipientKind::Universal { .. } => Arc::from(""),
        };
        Some((r.topic.clone(), group))
    }

    /// A copy came back from its consumer (module docs): dead-lettered if its policy allows no
    /// more deliveries, else delayed by `delay_ms`, by the backoff, or made pending at once.
    /// Returns whether the copy will be delivered again (not dead-lettered, not gone).
    pub(super) fn release(
        &mut self,
        key: EventKey,
        recipient: RecipientId,
        why: Release,
        delay_ms: u64,
    ) -> bool {
        let now_ms = self.now_ms;
        let Some(attempts) = self
            .inflight
            .entries
            .get(&key)
            .and_then(|e| e.copy(recipient))
            .map(|c| c.attempt)
        else {
            return false;
        };
        let (max, backoff) = match self.hub.recipients.get(&recipient) {
            Some(r) => match &r.kind {
                RecipientKind::Group { name, .. } => self.policies.limits(&r.topic, name),
                RecipientKind::Universal { .. } => self.policies.limits(&r.topic, ""),
            },
            None => (0, None),
        };
        if max > 0 && attempts >= max {
            self.dead_letter(key, recipient, attempts, why);
            return false;
        }
        // Written while the copy waits (its delay, or the next pass): see `records`.
        self.save_attempts(key, recipient);
        let wait_ms = match (why, delay_ms) {
            (_, d) if d > 0 => d,
            (Release::Disconnect, _) => 0,
            (Release::Nack | Release::Timeout, _) => backoff.map_or(0, |b| {
                let seed = key.event_id() ^ (recipient.0 << 24) ^ (u64::from(attempts) << 48);
                b.delay_ms(attempts.saturating_add(1), seed)
            }),
        };
        if wait_ms == 0 {
            self.make_pending(key, recipient);
        } else {
            let until_ms = now_ms.saturating_add(wait_ms);
            self.inflight
                .set_state(key, recipient, CopyState::Delayed { until_ms }, false);
        }
        true
    }

    /// Parks a copy out of deliveries and queues its dead letter (module docs).
    fn dead_letter(&mut self, key: EventKey, recipient: RecipientId, attempts: u32, why: Release) {
        let value = self
            .inflight
            .entries
            .get(&key)
            .and_then(|e| e.value.clone());
        let (Some(value), Some((topic, group))) = (value, self.recipient_names(recipient)) else {
            // No value (the message expired meanwhile) or no recipient: nothing to keep.
            self.forget_copy(key, recipient);
            return;
        };
        let guard_ms = self
            .now_ms
            .saturating_add(self.delivery.in_flight_timeout_ms);
        self.inflight.set_state(
            key,
            recipient,
            CopyState::Delayed { until_ms: guard_ms },
            false,
        );
        let policy = Policy::with(
            self.policies.defaults(),
            self.policies.override_of(&topic, &group),
        );
        self.policies.outbox.push(DeadLetter {
            key,
            recipient,
            value,
            dead_letter_topic: policy.dead_letter_topic_of(&topic),
            topic,
            group,
            attempts,
            reason: why,
        });
    }

    /// Dead letters queued since the last call (the shell publishes them).
    pub fn take_dead_letters(&mut self) -> Vec<DeadLetter> {
        std::mem::take(&mut self.policies.outbox)
    }

    /// The dead letter of this copy is stored: the copy is ACKed for its recipient.
    pub fn on_dead_lettered(&mut self, now_ms: u64, key: EventKey, recipient: RecipientId) {
        self.tick(now_ms);
        let open = self
            .inflight
            .entries
            .get(&key)
            .and_then(|e| e.copy(recipient))
            .is_some_and(|c| !c.is_done());
        if !open {
            return;
        }
        if let Some(CopyState::Held { consumer, .. }) = self.inflight.state(&key, recipient) {
            if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                c.held.remove(&key);
            }
        }
        self.inflight
            .set_state(key, recipient, CopyState::Acked, false);
        self.counters.dead_lettered_total += 1;
        self.hub.count(recipient, |c| c.dead_lettered += 1);
        self.complete_if_done(key);
    }

    /// Checks that a policy for `topic`/`group` may be set: refused past `maxGroupsPerShard`
    /// policies on this shard. Call before the command is written.
    pub fn check_policy(&self, topic: &str, group: &str) -> Result<(), Limit> {
        let known = self.policies.override_of(topic, group).is_some();
        if !known && self.policies.overrides_len >= self.delivery.groups_per_shard_max {
            return Err(Limit::GroupsPerShard {
                limit: self.delivery.groups_per_shard_max,
            });
        }
        Ok(())
    }

    /// Applies a change of a group's policy (the command was written, or is being replayed at
    /// start): each field the change names replaces the group's override, the others stay; a
    /// dead-letter topic of `""` goes back to the default. Past the bound it is refused (a log
    /// written under a larger bound).
    pub fn set_policy(
        &mut self,
        topic: &str,
        group: &str,
        change: PolicyOverride,
    ) -> Result<(), Limit> {
        self.check_policy(topic, group)?;
        let groups = self.policies.overrides.entry(Arc::from(topic)).or_default();
        let slot = match groups.get_mut(group) {
            Some(slot) => slot,
            None => {
                self.policies.overrides_len += 1;
                groups.entry(Arc::from(group)).or_default()
            }
        };
        if let Some(n) = change.max_deliveries {
            slot.max_deliveries = Some(n);
        }
        if let Some(name) = change.dead_letter_topic {
            slot.dead_letter_topic = (!name.is_empty()).then_some(name);
        }
        if let Some(backoff) = change.backoff {
            slot.backoff = Some(backoff);
        }
        self.wake = true;
        Ok(())
    }

    /// The policy in force for `topic`'s `group`: defaults with its overrides.
    pub fn policy(&self, topic: &str, group: &str) -> Policy {
        Policy::with(
            self.policies.defaults(),
            self.policies.override_of(topic, group),
        )
    }

    /// Groups with policy overrides on this shard (tests: the bound).
    pub fn policies_len(&self) -> usize {
        self.policies.overrides_len
    }

    /// A released copy's NACK-delay or guard ended: whether it is out of deliveries (released
    /// again, so it is dead-lettered), else it is made pending.
    pub(super) fn on_delay_ended(&mut self, key: EventKey, recipient: RecipientId) {
        let attempts = self
            .inflight
            .entries
            .get(&key)
            .and_then(|e| e.copy(recipient))
            .map_or(0, |c| c.attempt);
        let (max, _) = match self.recipient_names(recipient) {
            Some((topic, group)) => self.policies.limits(&topic, &group),
            None => (0, None),
        };
        if max > 0 && attempts >= max {
            self.dead_letter(key, recipient, attempts, Release::Nack);
        } else {
            self.make_pending(key, recipient);
        }
    }
}
