//! Figures: a shard's statistics per topic and per group, computed from the stock and the hub
//! when asked (by the once-a-second metrics snapshot and by `stats` calls), never kept twice.
//!
//! - A topic's `waiting` messages are stored, due and not dispatched; `in_flight` counts its
//!   in-flight entries (dispatched, delete not yet applied); `scheduled` are not due yet.
//! - A group's `backlog` is its topic's waiting messages plus the group's copies waiting for a
//!   consumer (redeliveries: NACKed, timed out, released by a leaving member); its `in_flight`
//!   counts the copies its consumers hold (queued for them or delivered, not settled).
//!
//! The untracked topics (past `delivery.maxCountedTopics`) appear as one topic named `""`.

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
    pub waiting: u64,
    pub scheduled: u64,
    pub in_flight: u64,
    /// Groups and universal consumers of the topic on this shard.
    pub recipients: u32,
}

/// One group (or universal consumer, `group` empty) of a topic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupFigures {
    pub topic: Arc<str>,
    pub group: Arc<str>,
    pub consumers: u32,
    pub backlog: u64,
    /// The part of `backlog` that is this group's own copies waiting for a consumer.
    pub pending: u64,
    pub scheduled: u64,
    pub in_flight: u64,
    pub counters: RecipientCounters,
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
                recipients: self.recipients_of(&name),
                topic: name,
                stored: stock.stored,
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
                    recipients: self.recipients_of(name),
                    ..TopicFigures::default()
                });
            }
        }
        topics.sort_by(|a, b| a.topic.cmp(&b.topic));
        let groups = self.group_figures(&topics);
        (topics, groups)
    }

    fn recipients_of(&self, topic: &str) -> u32 {
        self.hub
            .topics
            .get(topic)
            .map_or(0, |m| (m.groups.len() + m.universals.len()) as u32)
    }

    fn group_figures(&self, topics: &[TopicFigures]) -> Vec<GroupFigures> {
        let by_name: AHashMap<&str, (u64, u64)> = topics
            .iter()
            .map(|t| (t.topic.as_ref(), (t.waiting, t.scheduled)))
            .collect();
        let mut groups: Vec<GroupFigures> = self
            .hub
            .recipients
            .values()
            .map(|r| {
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
