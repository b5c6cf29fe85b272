//! The `Broker.stats` answer from the shards' own figures: one shard's [`ShardStats`] (pipeline
//! counters, topic and group figures) becomes its entries of the wire [`Stats`].

use super::{GroupStats, ShardStats as WireShard, Stats, TopicStats};
use crate::ids::ShardId;
use crate::pipeline::{GroupFigures, ShardStats};

/// Appends shard `shard`'s entries (the wire structs carry its id as the schema's `UInt32`).
pub fn add_shard(stats: &mut Stats, shard: ShardId, s: ShardStats) {
    let shard_id = shard.to_wire();
    let c = &s.counters;
    stats.shards.push(WireShard {
        shard_id,
        published: c.published_total,
        dispatched: c.dispatched_total,
        acked: c.acked_total,
        nacked: c.nacked_total,
        in_flight: s.held_copies,
        active_consumers: s.active_consumers as u64,
        redeliveries: c.redeliveries_timeout_total
            + c.redeliveries_nack_total
            + c.redeliveries_disconnect_total,
        expired: c.expired_dispatcher_total + c.expired_janitor_total,
        delete_failures: s.delete_failures_total,
        backlog: s.backlog,
        scheduled: s.scheduled,
        counted: s.counted,
        delayed: s.delayed_copies,
    });
    stats.topics.extend(s.topics.iter().map(|t| TopicStats {
        topic: t.topic.to_string(),
        shard_id,
        stored: t.stored,
        due: t.due,
        scheduled: t.scheduled,
        in_flight: t.in_flight,
        groups: t.groups,
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
        delayed: g.delayed,
    });
}

/// The figures with the meaning a protocol-1 client was built against: `ShardStats.backlog`
/// was the shard's messages stored and not yet deleted, due or scheduled (the sum of its
/// topics' `stored`), and `GroupStats.backlog` the messages due or scheduled that the recipient
/// has not acknowledged (waiting, in flight, delayed or not yet due). Protocol 2 split both
/// into `backlog` (waiting to be sent), `scheduled`, `delayed` and `inFlight`; a v1 client
/// reads none of the new fields, so it gets the old sum in the old one.
pub fn as_protocol_1(stats: &mut Stats) {
    for shard in &mut stats.shards {
        shard.backlog = stats
            .topics
            .iter()
            .filter(|t| t.shard_id == shard.shard_id)
            .map(|t| t.stored)
            .sum();
    }
    for group in &mut stats.groups {
        group.backlog = group.backlog + group.scheduled + group.in_flight + group.delayed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_1_backlog_is_everything_stored_or_unacknowledged() {
        let mut stats = Stats {
            shards: vec![
                WireShard {
                    shard_id: 0,
                    backlog: 1,
                    scheduled: 2,
                    in_flight: 3,
                    ..WireShard::default()
                },
                WireShard {
                    shard_id: 1,
                    ..WireShard::default()
                },
            ],
            topics: vec![
                TopicStats {
                    topic: "a".into(),
                    shard_id: 0,
                    stored: 6,
                    ..TopicStats::default()
                },
                TopicStats {
                    topic: String::new(),
                    shard_id: 0,
                    stored: 4,
                    ..TopicStats::default()
                },
            ],
            groups: vec![GroupStats {
                topic: "a".into(),
                group: "g".into(),
                backlog: 1,
                scheduled: 2,
                in_flight: 3,
                delayed: 4,
                ..GroupStats::default()
            }],
        };
        as_protocol_1(&mut stats);
        assert_eq!(stats.shards[0].backlog, 10, "both topic entries of shard 0");
        assert_eq!(stats.shards[1].backlog, 0);
        assert_eq!(stats.groups[0].backlog, 10);
        assert_eq!(
            stats.groups[0].scheduled, 2,
            "the new fields are left as they are"
        );
    }
}
