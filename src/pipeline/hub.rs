//! The hub: consumers, groups and their bounded queues (pure; no I/O, no clock).
//!
//! Each consumer registers with `(topic, group)`. A non-empty group is one *recipient* whose
//! members compete round-robin (the pointer rotates on every dispatch); an empty group makes the
//! consumer a universal recipient of its own (fan-out). Every consumer has a bounded queue that
//! the shard's shell drains toward the connection; [`Hub::choose`] never blocks and never picks a
//! consumer without room. Room is the consumer's *window* (its `queueSize`, capped by
//! `delivery.consumerQueueSize`) less what is queued here and what was sent in `deliver` calls
//! that have not returned ([`Hub::note_sent`], [`Hub::note_returned`]), and at most
//! `delivery.maxUnackedPerConsumer` copies held unacknowledged.
//!
//! The hub does not know message states; the shard core ([`super::shard`]) owns the in-flight
//! table and calls the hub to pick holders. Recipients keep their own retry list (`pending`) of
//! copies waiting for a consumer, so a group without members parks its claims at no cost.
//!
//! What clients can make the hub hold is bounded ([`HubLimits`]): groups per topic and per shard,
//! and consumers per group (universal consumers of a topic count as one group). A subscription
//! past a bound is refused with a [`Limit`] naming it and its config key; members of existing
//! groups keep coming and going. A group without members counts until it is forgotten, so the
//! hub keeps those groups in a queue ordered by the time they emptied ([`Hub::take_retired`]):
//! retiring them costs O(groups due), never a walk of every group. Likewise the recipients
//! whose retry list a pass serves are kept in a set ([`Hub::servable`]: members and copies
//! waiting), so parked claims of groups without members cost a pass nothing.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

use ahash::{AHashMap, AHashSet};
use smallvec::SmallVec;

use crate::key::{EventKey, TopicHash};

/// A consumer's handle inside one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerId(pub u64);

/// A group or a universal consumer: something that gets its own copy of each message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecipientId(pub u64);

/// A delivery waiting in a consumer's queue. `attempt` ties it to one delivery of the copy: if
/// the copy changed hands since (timeout, NACK), the drain drops this stale entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued {
    pub key: EventKey,
    pub attempt: u32,
}

pub struct Consumer {
    pub uuid: uuid::Uuid,
    pub topic: Arc<str>,
    pub recipient: RecipientId,
    pub queue: VecDeque<Queued>,
    /// The consumer's `queueSize` in force: `queue` plus `out` never pass it.
    pub window: usize,
    /// Deliveries drained toward the client whose `deliver` call has not returned yet.
    pub out: usize,
    /// Keys whose copy this consumer holds (queued or delivered, not yet ACKed).
    pub held: AHashSet<EventKey>,
}

#[derive(Debug)]
pub enum RecipientKind {
    Group {
        name: Arc<str>,
        members: Vec<ConsumerId>,
        next: usize,
        empty_since_ms: Option<u64>,
    },
    Universal {
        consumer: ConsumerId,
    },
}

pub struct Recipient {
    pub topic: Arc<str>,
    pub kind: RecipientKind,
    /// Copies waiting for a consumer of this recipient, oldest first. Each key appears once:
    /// a copy is in this list exactly while its state is `Pending`.
    pub pending: VecDeque<EventKey>,
    pub counters: RecipientCounters,
}

/// What happened to one recipient's copies since it was created (`GroupStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecipientCounters {
    pub dispatched: u64,
    pub acked: u64,
    pub nacked: u64,
    /// Deliveries after the first of a copy (timeout, NACK, or its holder leaving).
    pub redeliveries: u64,
    pub expired: u64,
    pub dead_lettered: u64,
}

impl Recipient {
    pub fn has_members(&self) -> bool {
        match &self.kind {
            RecipientKind::Group { members, .. } => !members.is_empty(),
            RecipientKind::Universal { .. } => true,
        }
    }
}

/// Consumers of one topic.
pub struct TopicMembers {
    pub hash: TopicHash,
    pub groups: AHashMap<Arc<str>, RecipientId>,
    pub universals: Vec<RecipientId>,
    pub live_consumers: usize,
}

/// The bounds of what consumers can make one shard's hub hold (`[delivery]` keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HubLimits {
    /// `delivery.consumerQueueSize`.
    pub queue_len_max: usize,
    /// `delivery.maxUnackedPerConsumer`.
    pub unacked_max: usize,
    /// `delivery.maxGroupsPerTopic`.
    pub groups_per_topic_max: usize,
    /// `delivery.maxGroupsPerShard`.
    pub groups_per_shard_max: usize,
    /// `delivery.maxConsumersPerGroup`; also bounds the universal consumers of one topic.
    pub consumers_per_group_max: usize,
}

/// A subscription refused because it would pass a bound; the text names the bound's key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Limit {
    #[error(
        "topic {topic:?} has {limit} groups on this shard, the limit delivery.maxGroupsPerTopic \
         (a group without consumers counts until delivery.groupRetention or forgetGroup removes it)"
    )]
    GroupsPerTopic { topic: String, limit: usize },
    #[error(
        "this shard holds {limit} groups, the limit delivery.maxGroupsPerShard (a group without \
         consumers counts until delivery.groupRetention or forgetGroup removes it)"
    )]
    GroupsPerShard { limit: usize },
    #[error(
        "group {group:?} of topic {topic:?} has {limit} consumers, the limit \
         delivery.maxConsumersPerGroup"
    )]
    ConsumersPerGroup {
        topic: String,
        group: String,
        limit: usize,
    },
    #[error(
        "topic {topic:?} has {limit} consumers without a group, the limit \
         delivery.maxConsumersPerGroup"
    )]
    UniversalsPerTopic { topic: String, limit: usize },
}

impl Limit {
    /// Whether the refusal is about groups (rather than consumers of one group).
    pub fn is_groups(&self) -> bool {
        matches!(
            self,
            Limit::GroupsPerTopic { .. } | Limit::GroupsPerShard { .. }
        )
    }
}

pub struct Hub {
    limits: HubLimits,
    next_id: u64,
    pub consumers: AHashMap<ConsumerId, Consumer>,
    pub recipients: AHashMap<RecipientId, Recipient>,
    pub topics: AHashMap<Arc<str>, TopicMembers>,
    /// Groups in the hub (with members or not), counted against `groups_per_shard_max`.
    groups_len: usize,
    /// Groups without members, by the time they emptied (oldest first): one entry per such group,
    /// removed when a member comes back or the group goes.
    emptied: BTreeSet<(u64, RecipientId)>,
    /// Entries of `emptied` looked at by [`Hub::take_retired`] (tests count the work with it).
    pub retire_checks_total: u64,
    /// Recipients with members and a non-empty retry list: what a pass serves.
    servable: BTreeSet<RecipientId>,
}

/// What [`Hub::register`] created.
pub struct Registered {
    pub consumer: ConsumerId,
    pub recipient: RecipientId,
    /// True when this consumer is the topic's first live consumer.
    pub topic_became_served: bool,
}

/// What [`Hub::unregister`] removed.
pub struct Unregistered {
    pub consumer: Consumer,
    /// True for a universal consumer: its recipient is gone and its copies are to be forgotten.
    pub recipient_removed: Option<Recipient>,
    /// True when the topic has no live consumer left.
    pub topic_unserved: bool,
}

impl Hub {
    /// A hub with bounded consumer queues and no bound on groups or consumers (benches).
    pub fn new(queue_len_max: usize, unacked_max: usize) -> Hub {
        Hub::with_limits(HubLimits {
            queue_len_max,
            unacked_max,
            groups_per_topic_max: usize::MAX,
            groups_per_shard_max: usize::MAX,
            consumers_per_group_max: usize::MAX,
        })
    }

    pub fn with_limits(limits: HubLimits) -> Hub {
        Hub {
            limits: HubLimits {
                queue_len_max: limits.queue_len_max.max(1),
                unacked_max: limits.unacked_max.max(1),
                ..limits
            },
            next_id: 1,
            consumers: AHashMap::new(),
            recipients: AHashMap::new(),
            topics: AHashMap::new(),
            groups_len: 0,
            emptied: BTreeSet::new(),
            retire_checks_total: 0,
            servable: BTreeSet::new(),
        }
    }

    /// Recipients a pass should serve: with members, and copies in their retry list.
    pub fn servable(&self) -> impl Iterator<Item = RecipientId> + '_ {
        self.servable.iter().copied()
    }

    /// Call after a recipient's members or retry list changed: keeps [`Hub::servable`] exact.
    pub fn note_pending(&mut self, recipient: RecipientId) {
        match self.recipients.get(&recipient) {
            Some(r) if r.has_members() && !r.pending.is_empty() => {
                self.servable.insert(recipient);
            }
            _ => {
                self.servable.remove(&recipient);
            }
        }
    }

    /// Checks [`Hub::servable`] against a walk of every recipient (tests).
    #[cfg(test)]
    pub fn assert_servable_exact(&self) {
        let walked: BTreeSet<RecipientId> = self
            .recipients
            .iter()
            .filter(|(_, r)| r.has_members() && !r.pending.is_empty())
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(walked, self.servable, "servable recipients");
    }

    /// Groups in the hub, with members or not.
    pub fn groups_len(&self) -> usize {
        self.groups_len
    }

    /// Refuses a subscription of `topic` in `group` (empty = universal) that would pass a bound.
    fn check_limits(&self, topic: &str, group: &str) -> Result<(), Limit> {
        let limits = &self.limits;
        let members = self.topics.get(topic);
        if group.is_empty() {
            let universals = members.map_or(0, |m| m.universals.len());
            if universals >= limits.consumers_per_group_max {
                return Err(Limit::UniversalsPerTopic {
                    topic: topic.into(),
                    limit: limits.consumers_per_group_max,
                });
            }
            return Ok(());
        }
        match members.and_then(|m| m.groups.get(group)) {
            Some(recipient) => {
                let consumers = match self.recipients.get(recipient).map(|r| &r.kind) {
                    Some(RecipientKind::Group { members, .. }) => members.len(),
                    _ => 0,
                };
                if consumers >= limits.consumers_per_group_max {
                    return Err(Limit::ConsumersPerGroup {
                        topic: topic.into(),
                        group: group.into(),
                        limit: limits.consumers_per_group_max,
                    });
                }
            }
            None => {
                if members.map_or(0, |m| m.groups.len()) >= limits.groups_per_topic_max {
                    return Err(Limit::GroupsPerTopic {
                        topic: topic.into(),
                        limit: limits.groups_per_topic_max,
                    });
                }
                if self.groups_len >= limits.groups_per_shard_max {
                    return Err(Limit::GroupsPerShard {
                        limit: limits.groups_per_shard_max,
                    });
                }
            }
        }
        Ok(())
    }

    fn allocate(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// The `queueSize` in force for a consumer that asked for `requested` (0: the default,
    /// `delivery.consumerQueueSize`, which also caps it).
    pub fn window_for(&self, requested: usize) -> usize {
        match requested {
            0 => self.limits.queue_len_max,
            n => n.min(self.limits.queue_len_max),
        }
    }

    /// The unacknowledged copies one consumer may hold (`delivery.maxUnackedPerConsumer`).
    pub fn unacked_max(&self) -> usize {
        self.limits.unacked_max
    }

    /// Registers a consumer with the default window. An empty `group` makes it universal.
    /// Refused, with nothing changed, when it would pass one of the [`HubLimits`].
    pub fn register(
        &mut self,
        topic: &str,
        group: &str,
        uuid: uuid::Uuid,
    ) -> Result<Registered, Limit> {
        self.register_window(topic, group, uuid, 0)
    }

    /// Registers a consumer whose window is [`Hub::window_for`] `requested`.
    pub fn register_window(
        &mut self,
        topic: &str,
        group: &str,
        uuid: uuid::Uuid,
        requested: usize,
    ) -> Result<Registered, Limit> {
        self.check_limits(topic, group)?;
        let consumer = ConsumerId(self.allocate());
        let topic_name: Arc<str> = match self.topics.get_key_value(topic) {
            Some((name, _)) => name.clone(),
            None => Arc::from(topic),
        };
        let recipient = if group.is_empty() {
            let recipient = RecipientId(self.allocate());
            self.recipients.insert(
                recipient,
                Recipient {
                    topic: topic_name.clone(),
                    kind: RecipientKind::Universal { consumer },
                    pending: VecDeque::new(),
                    counters: RecipientCounters::default(),
                },
            );
            self.topics_entry(&topic_name).universals.push(recipient);
            recipient
        } else {
            let existing = self
                .topics
                .get(topic)
                .and_then(|t| t.groups.get(group))
                .copied();
            let recipient = match existing {
                Some(r) => r,
                None => {
                    let recipient = RecipientId(self.allocate());
                    let name: Arc<str> = Arc::from(group);
                    self.recipients.insert(
                        recipient,
                        Recipient {
                            topic: topic_name.clone(),
                            kind: RecipientKind::Group {
                                name: name.clone(),
                                members: Vec::new(),
                                next: 0,
                                empty_since_ms: None,
                            },
                            pending: VecDeque::new(),
                            counters: RecipientCounters::default(),
                        },
                    );
                    self.topics_entry(&topic_name)
                        .groups
                        .insert(name, recipient);
                    self.groups_len += 1;
                    recipient
                }
            };
            if let Some(Recipient {
                kind:
                    RecipientKind::Group {
                        members,
                        empty_since_ms,
                        ..
                    },
                ..
            }) = self.recipients.get_mut(&recipient)
            {
                members.push(consumer);
                if let Some(since) = empty_since_ms.take() {
                    self.emptied.remove(&(since, recipient));
                }
            }
            recipient
        };
        let members = self.topics_entry(&topic_name);
        members.live_consumers += 1;
        let topic_became_served = members.live_consumers == 1;
        self.consumers.insert(
            consumer,
            Consumer {
                uuid,
                topic: topic_name,
                recipient,
                queue: VecDeque::new(),
                window: self.window_for(requested),
                out: 0,
                held: AHashSet::default(),
            },
        );
        self.note_pending(recipient);
        Ok(Registered {
            consumer,
            recipient,
            topic_became_served,
        })
    }

    fn topics_entry(&mut self, topic: &Arc<str>) -> &mut TopicMembers {
        self.topics
            .entry(topic.clone())
            .or_insert_with(|| TopicMembers {
                hash: TopicHash::of(topic),
                groups: AHashMap::new(),
                universals: Vec::new(),
                live_consumers: 0,
            })
    }

    /// Removes a consumer. A group keeps its claims (and its pending list) when its last member
    /// leaves; a universal consumer's recipient is removed and returned.
    pub fn unregister(&mut self, consumer: ConsumerId, now_ms: u64) -> Option<Unregistered> {
        let removed = self.consumers.remove(&consumer)?;
        let mut recipient_removed = None;
        match self
            .recipients
            .get_mut(&removed.recipient)
            .map(|r| &mut r.kind)
        {
            Some(RecipientKind::Group {
                members,
                next,
                empty_since_ms,
                ..
            }) => {
                if let Some(at) = members.iter().position(|m| *m == consumer) {
                    members.remove(at);
                    if *next > at {
                        *next -= 1;
                    }
                }
                if members.is_empty() {
                    *empty_since_ms = Some(now_ms);
                    *next = 0;
                    self.emptied.insert((now_ms, removed.recipient));
                }
            }
            Some(RecipientKind::Universal { .. }) => {
                recipient_removed = self.recipients.remove(&removed.recipient);
                if let Some(members) = self.topics.get_mut(&removed.topic) {
                    members.universals.retain(|r| *r != removed.recipient);
                }
            }
            None => {}
        }
        self.note_pending(removed.recipient);
        let mut topic_unserved = false;
        if let Some(members) = self.topics.get_mut(&removed.topic) {
            members.live_consumers -= 1;
            topic_unserved = members.live_consumers == 0;
            if topic_unserved && members.groups.is_empty() && members.universals.is_empty() {
                self.topics.remove(&removed.topic);
            }
        }
        Some(Unregistered {
            consumer: removed,
            recipient_removed,
            topic_unserved,
        })
    }

    /// Removes a group and returns it (with its pending list), if it has no members.
    /// Counts something that happened to a copy of `recipient`.
    pub fn count(&mut self, recipient: RecipientId, what: impl FnOnce(&mut RecipientCounters)) {
        if let Some(r) = self.recipients.get_mut(&recipient) {
            what(&mut r.counters);
        }
    }

    pub fn remove_group(&mut self, recipient: RecipientId) -> Option<Recipient> {
        let has_members = self.recipients.get(&recipient)?.has_members();
        if has_members {
            return None;
        }
        let removed = self.recipients.remove(&recipient)?;
        self.servable.remove(&recipient);
        if let RecipientKind::Group {
            name,
            empty_since_ms,
            ..
        } = &removed.kind
        {
            self.groups_len -= 1;
            if let Some(since) = empty_since_ms {
                self.emptied.remove(&(*since, recipient));
            }
            if let Some(members) = self.topics.get_mut(&removed.topic) {
                members.groups.remove(name);
                if members.live_consumers == 0
                    && members.groups.is_empty()
                    && members.universals.is_empty()
                {
                    self.topics.remove(&removed.topic);
                }
            }
        }
        Some(removed)
    }

    /// Takes the groups that have had no member for `retention_ms` at `now_ms`, oldest first
    /// (they are still in the hub: the caller forgets them). Looks at the groups due and one more.
    pub fn take_retired(&mut self, now_ms: u64, retention_ms: u64) -> SmallVec<[RecipientId; 4]> {
        let mut due = SmallVec::new();
        while let Some(&(since, recipient)) = self.emptied.first() {
            self.retire_checks_total += 1;
            if now_ms < since.saturating_add(retention_ms) {
                break;
            }
            self.emptied.pop_first();
            due.push(recipient);
        }
        due
    }

    /// The recipients a message of `topic` gets right now: groups with members, and universal
    /// consumers. Fixed at a message's first dispatch.
    pub fn recipients_of(&self, topic: &str) -> SmallVec<[RecipientId; 4]> {
        let mut out = SmallVec::new();
        if let Some(members) = self.topics.get(topic) {
            for recipient in members.groups.values() {
                if self
                    .recipients
                    .get(recipient)
                    .is_some_and(Recipient::has_members)
                {
                    out.push(*recipient);
                }
            }
            out.extend(members.universals.iter().copied());
        }
        out
    }

    /// Copies `consumer` can take now: its window less what is queued and out on the wire, and
    /// its unacknowledged bound less what it holds.
    fn room_of(&self, consumer: ConsumerId) -> usize {
        self.consumers.get(&consumer).map_or(0, |c| {
            let queued = c.queue.len().saturating_add(c.out);
            (c.window.saturating_sub(queued))
                .min(self.limits.unacked_max.saturating_sub(c.held.len()))
        })
    }

    fn has_room(&self, consumer: ConsumerId) -> bool {
        self.room_of(consumer) > 0
    }

    /// `n` deliveries left toward the client: they count against its window until returned.
    pub fn note_sent(&mut self, consumer: ConsumerId, n: usize) {
        if let Some(c) = self.consumers.get_mut(&consumer) {
            c.out = c.out.saturating_add(n);
        }
    }

    /// The client returned `n` deliveries (its `deliver` call returned): room again. Returns
    /// whether the consumer's window was full before, so copies may be waiting for it.
    pub fn note_returned(&mut self, consumer: ConsumerId, n: usize) -> bool {
        let Some(c) = self.consumers.get_mut(&consumer) else {
            return false;
        };
        let was_full = c.queue.len().saturating_add(c.out) >= c.window;
        c.out = c.out.saturating_sub(n);
        was_full
    }

    /// How many more copies a recipient's consumers can take now.
    pub fn room(&self, recipient: RecipientId) -> usize {
        match self.recipients.get(&recipient).map(|r| &r.kind) {
            Some(RecipientKind::Group { members, .. }) => {
                members.iter().map(|c| self.room_of(*c)).sum()
            }
            Some(RecipientKind::Universal { consumer }) => self.room_of(*consumer),
            None => 0,
        }
    }

    /// Picks the consumer of `recipient` that takes the next copy, or `None` if every consumer is
    /// full (or the group has no members). Groups rotate their pointer on every dispatch.
    /// `avoid` (the consumer that let the copy's lease run out) is taken only when no other
    /// member has room. Returns the number of full consumers skipped as well.
    pub fn choose(
        &mut self,
        recipient: RecipientId,
        avoid: Option<ConsumerId>,
    ) -> (Option<ConsumerId>, u64) {
        let mut skipped = 0;
        let candidates: SmallVec<[ConsumerId; 8]> =
            match self.recipients.get(&recipient).map(|r| &r.kind) {
                Some(RecipientKind::Universal { consumer }) => smallvec::smallvec![*consumer],
                Some(RecipientKind::Group { members, next, .. }) => {
                    let n = members.len();
                    (0..n).map(|i| members[(next + i) % n]).collect()
                }
                None => SmallVec::new(),
            };
        let mut fallback = None;
        for (offset, candidate) in candidates.iter().enumerate() {
            if !self.has_room(*candidate) {
                skipped += 1;
            } else if Some(*candidate) == avoid && candidates.len() > 1 {
                fallback = Some(offset);
            } else {
                self.rotate_past(recipient, offset);
                return (Some(*candidate), skipped);
            }
        }
        let chosen = fallback.map(|offset| {
            self.rotate_past(recipient, offset);
            candidates[offset]
        });
        (chosen, skipped)
    }

    /// Moves a group's round-robin pointer past the member `offset` places after it.
    fn rotate_past(&mut self, recipient: RecipientId, offset: usize) {
        if let Some(Recipient {
            kind: RecipientKind::Group { members, next, .. },
            ..
        }) = self.recipients.get_mut(&recipient)
        {
            *next = (*next + offset + 1) % members.len().max(1);
        }
    }

    pub fn queue_len_max(&self) -> usize {
        self.limits.queue_len_max
    }
}
