//! The `Broker.stats` answer from the shards' own figures: one shard's [`ShardStats`] (pipeline
//! counters, topic and group figures) becomes its entries of the wire [`Stats`].

use super::{GroupStats, ShardStats as WireShard, Stats, TopicStats};
use crate::pipeline::{GroupFigures, ShardStats};

/// Appends shard `shard_id`'s entries.
pub fn add_shard(stats: &mut Stats, shard_id: u32, s: ShardStats) {
    let c = &s.counters;
    stats.shards.push(WireShard {
        shard_id,
        published: c.published_total,
        dispatched: c.dispatched_total,
        acked: c.acked_total,
        nacked: c.nacked_total,
        in_flight: s.in_flight as u64,
        active_consumers: s.active_consumers as u64,
        redeliveries: c.redeliveries_timeout_total
            + c.redeliveries_nack_total
            + c.redeliveries_disconnect_total,
        expired: c.expired_dispatcher_total + c.expired_janitor_total,
        delete_failures: s.delete_failures_total,
        backlog: s.backlog,
        scheduled: s.scheduled,
        counted: s.counted,
    });
    stats.topics.extend(s.topics.iter().map(|t| TopicStats {
        topic: t.topic.to_string(),
        shard_id,
        stored: t.stored,
        due: t.due,
        scheduled: t.scheduled,
        in_flight: t.in_flight,
        groups: t.recipients,
    }));
    for g in &s.groups {
        add_group(&mut stats.groups, shard_id, g);
    }
}

fn add_group(groups: &mut Vec<GroupStats>, shard_id: u32, g: &GroupFigures) {
    let c = &g.counters;
    groups.push(GroupStats {
        topic: g.topic.to_string(),
        group: g.group.to_string(),
        shard_id,
        consumers: g.consumers,
        backlog: g.backlog,
        in_flight: g.in_flight,
        dispatched: c.dispatched,
        acked: c.acked,
        nacked: c.nacked,
        redeliveries: c.redeliveries,
        expired: c.expired,
        dead_lettered: c.dead_lettered,
        scheduled: g.scheduled,
    });
}
