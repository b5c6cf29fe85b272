//! Figures: a shard's statistics per topic and per group, computed from the stock and the hub
//! when asked (by the once-a-second metrics snapshot and by `stats` calls), never kept twice.
//!
//! - A topic's `stored` messages are `due` or `scheduled`; of the due ones, `in_flight` counts
//!   those dispatched whose delete is not applied yet, and `waiting` the others.
//! - A group's `backlog` is its topic's waiting messages plus the group's copies waiting for a
//!   consumer (redeliveries: NACKed, timed out, released by a leaving member); its `delayed`
//!   counts its copies waiting out a NACK delay, a backoff or their dead-letter publish; its
//!   `in_flight` counts the copies its consumers hold (queued for them or delivered, not
//!   settled). So each of a group's copies not yet ACKed is in exactly one of `backlog`,
//!   `delayed`, `in_flight` and `scheduled` (a message not yet dispatched counts as the
//!   group's copy of it).
//!
//! The untracked topics (past `delivery.maxCountedTopics`) appear as one topic named `""`; a
//! topic's universal consumers appear as one group named `""`.

use std::sync::Arc;

use ahash::{AHashMap, AHashSet};

use super::ShardCore;
use crate::key::{due_bucket_bound, TopicHash};
use crate::pipeline::hub::{Recipient, RecipientCounters, RecipientKind};

/// One topic of a shard.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicFigures {
    pub topic: Arc<str>,
    pub stored: u64,
    /// Stored and due, dispatched or not (`stored` = `due` + `scheduled`).
    pub due: u64,
    /// Due and not dispatched.
    pub waiting: u64,
    pub scheduled: u64,
    pub in_flight: u64,
    /// Groups of the topic on this shard (its universal consumers are not a group).
    pub groups: u32,
}

/// One group of a topic, or (`group` empty) the topic's universal consumers taken together.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupFigures {
    pub topic: Arc<str>,
    pub group: Arc<str>,
    pub consumers: u32,
    pub backlog: u64,
    /// The part of `backlog` that is this group's own copies waiting for a consumer.
    pub pending: u64,
    /// Copies waiting out a NACK delay, a backoff, or their dead-letter publish.
    pub delayed: u64,
    pub scheduled: u64,
    pub in_flight: u64,
    pub counters: RecipientCounters,
}

impl GroupFigures {
    /// Adds another recipient's figures of the same topic (its backlog of due messages is the
    /// topic's, already counted here: only its own waiting copies add).
    pub fn absorb(&mut self, other: &GroupFigures) {
        self.consumers += other.consumers;
        self.backlog += other.pending;
        self.pending += other.pending;
        self.delayed += other.delayed;
        self.in_flight += other.in_flight;
        let (c, o) = (&mut self.counters, &other.counters);
        c.dispatched += o.dispatched;
        c.acked += o.acked;
        c.nacked += o.nacked;
        c.redeliveries += o.redeliveries;
        c.expired += o.expired;
        c.dead_lettered += o.dead_lettered;
    }
}

impl ShardCore {
    /// Every topic with stored messages or consumers, and every group with members or claims.
    pub(super) fn figures(&self) -> (Vec<TopicFigures>, Vec<GroupFigures>) {
        let bound = due_bucket_bound(self.now_ms, self.delivery.time_bucket_ms);
        let mut topics: Vec<TopicFigures> = Vec::new();
        let mut seen: AHashSet<TopicHash> = AHashSet::new();
        for (hash, stock) in self.stock.figures() {
            let in_flight = self.stock.dispatched(hash);
            let name = stock.name.clone().unwrap_or_else(|| Arc::from(""));
            seen.insert(hash);
            topics.push(TopicFigures {
                groups: self.groups_of(&name),
                topic: name,
                stored: stock.stored,
                due: stock.due(bound),
                waiting: stock.due(bound).saturating_sub(in_flight),
                scheduled: stock.scheduled(bound),
                in_flight,
            });
        }
        for (name, members) in &self.hub.topics {
            if seen.insert(members.hash) {
                topics.push(TopicFigures {
                    topic: name.clone(),
                    in_flight: self.stock.dispatched(members.hash),
                    groups: self.groups_of(name),
                    ..TopicFigures::default()
                });
            }
        }
        topics.sort_by(|a, b| a.topic.cmp(&b.topic));
        let groups = self.group_figures(&topics);
        (topics, groups)
    }

    fn groups_of(&self, topic: &str) -> u32 {
        self.hub
            .topics
            .get(topic)
            .map_or(0, |m| m.groups.len() as u32)
    }

    /// Copies held by consumers (queued for them or delivered, not settled), summed over the
    /// shard: `ShardStats.inFlight`.
    pub(super) fn held_copies(&self) -> u64 {
        self.hub
            .consumers
            .values()
            .map(|c| c.held.len() as u64)
            .sum()
    }

    fn group_figures(&self, topics: &[TopicFigures]) -> Vec<GroupFigures> {
        let by_name: AHashMap<&str, (u64, u64)> = topics
            .iter()
            .map(|t| (t.topic.as_ref(), (t.waiting, t.scheduled)))
            .collect();
        let mut groups: Vec<GroupFigures> = self
            .hub
            .recipients
            .iter()
            .map(|(id, r)| {
                let (waiting, scheduled) =
                    by_name.get(r.topic.as_ref()).copied().unwrap_or_default();
                let (group, members) = self.members_of(r);
                let pending = r.pending.len() as u64;
                GroupFigures {
                    topic: r.topic.clone(),
                    group,
                    consumers: members.len() as u32,
                    backlog: waiting + pending,
                    pending,
                    delayed: self.inflight.delayed_of(*id),
                    scheduled,
                    in_flight: members
                        .iter()
                        .filter_map(|c| self.hub.consumers.get(c))
                        .map(|c| c.held.len() as u64)
                        .sum(),
                    counters: r.counters,
                }
            })
            .collect();
        groups.sort_by(|a, b| (&a.topic, &a.group).cmp(&(&b.topic, &b.group)));
        groups.dedup_by(|later, kept| {
            let universal = later.group.is_empty() && kept.group.is_empty();
            if universal && later.topic == kept.topic {
                kept.absorb(later);
            }
            universal && later.topic == kept.topic
        });
        groups
    }

    fn members_of<'a>(&self, r: &'a Recipient) -> (Arc<str>, &'a [super::ConsumerId]) {
        match &r.kind {
            RecipientKind::Group { name, members, .. } => (name.clone(), members.as_slice()),
            RecipientKind::Universal { consumer } => {
                (Arc::from(""), std::slice::from_ref(consumer))
            }
        }
    }
}
