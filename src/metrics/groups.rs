//! Per-group metrics with bounded label cardinality: a shard exports at most
//! `delivery.maxGroupMetrics` groups with their own `topic` and `group` labels (the first in
//! (topic, group) order); the others are summed into one series with `topic=""` and
//! `group="_other"`, so a broker with many groups cannot blow up a Prometheus server.

use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::ShardSnapshot;
use crate::pipeline::GroupFigures;

/// The group label of the sum of groups past the bound.
pub const OTHER_GROUPS: &str = "_other";

/// The first `max` groups as they are, then one entry summing the rest (if any).
pub fn bounded(mut groups: Vec<GroupFigures>, max: usize) -> Vec<GroupFigures> {
    if groups.len() <= max {
        return groups;
    }
    let rest = groups.split_off(max);
    let mut other = GroupFigures {
        topic: Arc::from(""),
        group: Arc::from(OTHER_GROUPS),
        ..GroupFigures::default()
    };
    for g in &rest {
        other.absorb(g);
        other.backlog += g.backlog - g.pending;
        other.scheduled += g.scheduled;
    }
    groups.push(other);
    groups
}

type Read = fn(&GroupFigures) -> u64;

const GROUP_GAUGES: &[(&str, &str, Read)] = &[
    ("pinq_group_consumers", "Consumers of the group connected to this shard.", |g| {
        u64::from(g.consumers)
    }),
    (
        "pinq_group_backlog",
        "The topic's stored messages that are due and not yet dispatched, plus the group's copies waiting to be delivered again.",
        |g| g.backlog,
    ),
    (
        "pinq_group_scheduled",
        "The topic's stored messages whose delay has not passed yet.",
        |g| g.scheduled,
    ),
    (
        "pinq_group_delayed",
        "The group's copies waiting out a NACK delay, a redelivery backoff or their move to a dead-letter topic.",
        |g| g.delayed,
    ),
    (
        "pinq_group_in_flight",
        "Copies the group's consumers hold (queued for them or delivered, not settled).",
        |g| g.in_flight,
    ),
];

const GROUP_COUNTERS: &[(&str, &str, Read)] = &[
    (
        "pinq_group_dispatched",
        "Copies handed to the group's consumers, redeliveries included.",
        |g| g.counters.dispatched,
    ),
    ("pinq_group_acked", "Copies the group acknowledged.", |g| {
        g.counters.acked
    }),
    (
        "pinq_group_nacked",
        "Copies the group handed back by NACK.",
        |g| g.counters.nacked,
    ),
    (
        "pinq_group_redeliveries",
        "Deliveries after the first of a copy (timeout, NACK, or its holder leaving).",
        |g| g.counters.redeliveries,
    ),
    (
        "pinq_group_expired",
        "Copies dropped because their message's TTL passed.",
        |g| g.counters.expired,
    ),
    (
        "pinq_group_dead_lettered",
        "Copies moved to a dead-letter topic after too many delivery attempts.",
        |g| g.counters.dead_lettered,
    ),
];

/// The `pinq_group_*` families: one series per shard, topic and group (already bounded in each
/// snapshot by [`bounded`]).
pub fn encode(
    encoder: &mut DescriptorEncoder,
    shards: &[(String, ShardSnapshot)],
) -> Result<(), std::fmt::Error> {
    let families = GROUP_GAUGES
        .iter()
        .map(|f| (f, MetricType::Gauge))
        .chain(GROUP_COUNTERS.iter().map(|f| (f, MetricType::Counter)));
    for ((name, help, read), kind) in families {
        let mut family = encoder.encode_descriptor(name, help, None, kind)?;
        for (shard, snap) in shards {
            for g in &snap.stats.groups {
                let labels = [
                    ("shard", shard.as_str()),
                    ("topic", &*g.topic),
                    ("group", &*g.group),
                ];
                let mut sample = family.encode_family(&labels)?;
                match kind {
                    MetricType::Counter => {
                        sample.encode_counter::<NoLabelSet, _, u64>(&read(g), None)?
                    }
                    _ => sample.encode_gauge(&read(g))?,
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(i: u64) -> GroupFigures {
        let mut g = GroupFigures {
            topic: Arc::from(format!("t{i:03}").as_str()),
            group: Arc::from("g"),
            consumers: 1,
            backlog: 10 + i,
            pending: i,
            scheduled: 2,
            in_flight: 3,
            delayed: 1,
            ..GroupFigures::default()
        };
        g.counters.acked = i;
        g
    }

    #[test]
    fn groups_past_the_bound_are_summed_into_one_series() {
        let groups: Vec<GroupFigures> = (0..10).map(group).collect();
        let out = bounded(groups.clone(), 4);
        assert_eq!(out.len(), 5);
        assert_eq!(out[..4], groups[..4]);
        let other = &out[4];
        assert_eq!(&*other.group, OTHER_GROUPS);
        assert_eq!(other.consumers, 6);
        assert_eq!(other.backlog, (4..10).map(|i| 10 + i).sum::<u64>());
        assert_eq!(other.scheduled, 12);
        assert_eq!(other.in_flight, 18);
        assert_eq!(other.delayed, 6);
        assert_eq!(other.counters.acked, (4..10).sum::<u64>());
        assert_eq!(bounded(groups.clone(), 10), groups);
    }
}
