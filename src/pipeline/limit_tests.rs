//! Tests of what clients can make the pipeline hold: timers per copy (touch, NACK), groups per
//! topic and per shard, consumers per group, and the cost of retiring groups. Pure and
//! deterministic, through the `Sim` harness of [`super::tests`].

use super::hub::Limit;
use super::shard::{ConsumerError, TagResult};
use super::tests::{config, Sim};
use super::ConsumerId;
use crate::config::DeliveryConfig;
use crate::key::EventKey;

fn subscribe(sim: &Sim, topic: &str, group: &str) -> Result<ConsumerId, ConsumerError> {
    let n = sim.core.borrow().consumer_count() as u128 + 1_000;
    sim.core
        .borrow_mut()
        .subscribe(sim.now_ms, topic, group, uuid::Uuid::from_u128(n))
}

fn touch(sim: &Sim, consumer: ConsumerId, tag: EventKey) -> Vec<TagResult> {
    sim.core
        .borrow_mut()
        .touch(sim.now_ms, consumer, &[tag])
        .unwrap()
}

fn timers(sim: &Sim) -> usize {
    let core = sim.core.borrow();
    core.assert_consistent();
    core.timers_len()
}

/// One message published and delivered to a fresh consumer of `t`/`g`.
fn one_held_copy() -> (Sim, ConsumerId, EventKey) {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("t", "g");
    let tag = sim.publish("t", "m");
    sim.settle();
    assert_eq!(sim.recv(c).len(), 1);
    (sim, c, tag)
}

// ---- timers ------------------------------------------------------------------------------

#[test]
fn touching_one_copy_100k_times_keeps_one_timer() {
    let (mut sim, c, tag) = one_held_copy();
    assert_eq!(timers(&sim), 1);
    for i in 0..100_000u64 {
        if i % 1000 == 0 {
            sim.advance(1);
        }
        assert_eq!(touch(&sim, c, tag), vec![TagResult::Ok]);
        assert_eq!(sim.core.borrow().timers_len(), 1, "after touch {i}");
    }
    assert_eq!(timers(&sim), 1);
    // The lease runs from the last touch: not redelivered before, redelivered at its end.
    sim.advance(999);
    sim.settle();
    assert!(
        sim.recv(c).is_empty(),
        "redelivered before the last lease ended"
    );
    sim.advance(1);
    sim.settle();
    let again = sim.recv(c);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].attempt, 2);
    assert_eq!(timers(&sim), 1, "one lease for the redelivered copy");
}

#[test]
fn nacking_with_a_delay_replaces_the_lease_timer_and_repeats_add_none() {
    let (mut sim, c, tag) = one_held_copy();
    assert_eq!(sim.nack(c, &[tag], 500), vec![TagResult::Ok]);
    assert_eq!(timers(&sim), 1, "the delay replaced the lease");
    for _ in 0..100_000 {
        assert_eq!(sim.nack(c, &[tag], 500), vec![TagResult::NotHolder]);
        assert_eq!(touch(&sim, c, tag), vec![TagResult::NotHolder]);
    }
    assert_eq!(timers(&sim), 1);
    // Deliver, NACK with a delay, wait it out: each round trip leaves one timer, never more.
    for round in 0..1_000 {
        sim.advance(500);
        sim.settle();
        let got = sim.recv(c);
        assert_eq!(got.len(), 1, "round {round}");
        assert_eq!(timers(&sim), 1, "lease of round {round}");
        assert_eq!(sim.nack(c, &[tag], 500), vec![TagResult::Ok]);
        assert_eq!(timers(&sim), 1, "delay of round {round}");
    }
}

#[test]
fn an_ack_removes_its_lease_timer_at_once() {
    let (mut sim, c, tag) = one_held_copy();
    assert_eq!(timers(&sim), 1);
    assert_eq!(sim.ack(c, &[tag]), vec![TagResult::Ok]);
    assert_eq!(timers(&sim), 0);
}

#[test]
fn timers_stay_one_per_held_copy_under_many_copies_and_touches() {
    let mut sim = Sim::new(DeliveryConfig {
        consumer_queue_len_max: 1 << 12,
        unacked_per_consumer_max: 1 << 12,
        scan_batch_len_max: 1 << 12,
        ..config()
    });
    let c = sim.subscribe("t", "g");
    let tags: Vec<EventKey> = (0..2_000)
        .map(|i| sim.publish("t", &format!("m{i}")))
        .collect();
    sim.settle();
    assert_eq!(sim.recv(c).len(), tags.len());
    for _ in 0..20 {
        sim.advance(10);
        let results = sim.core.borrow_mut().touch(sim.now_ms, c, &tags).unwrap();
        assert!(results.iter().all(|r| *r == TagResult::Ok));
        assert_eq!(timers(&sim), tags.len());
    }
    sim.nack(c, &tags[..1000], 100);
    assert_eq!(
        timers(&sim),
        tags.len(),
        "a delay replaced each NACKed lease"
    );
    sim.ack(c, &tags[1000..]);
    assert_eq!(timers(&sim), 1000, "only the delayed copies keep a timer");
}

// ---- groups and consumers ---------------------------------------------------------------

fn limited(groups_per_topic: usize, groups_per_shard: usize, consumers: usize) -> Sim {
    Sim::new(DeliveryConfig {
        groups_per_topic_max: groups_per_topic,
        groups_per_shard_max: groups_per_shard,
        consumers_per_group_max: consumers,
        ..config()
    })
}

#[test]
fn a_new_group_past_max_groups_per_topic_is_refused_and_the_others_still_deliver() {
    let mut sim = limited(3, 100, 10);
    let members: Vec<ConsumerId> = ["g1", "g2", "g3"]
        .iter()
        .map(|g| sim.subscribe("t", g))
        .collect();
    let refused = subscribe(&sim, "t", "g4").unwrap_err();
    assert_eq!(
        refused,
        ConsumerError::Limit(Limit::GroupsPerTopic {
            topic: "t".into(),
            limit: 3
        })
    );
    assert!(
        refused.to_string().contains("delivery.maxGroupsPerTopic"),
        "{refused}"
    );
    // Other topics have their own bound; members of existing groups still join.
    subscribe(&sim, "u", "g4").unwrap();
    let second = subscribe(&sim, "t", "g1").unwrap();
    assert_eq!(sim.core.borrow().groups_len(), 4);
    sim.publish("t", "m");
    sim.settle();
    let got: usize =
        members.iter().map(|c| sim.recv(*c).len()).sum::<usize>() + sim.recv(second).len();
    assert_eq!(got, 3, "each of the three groups got its copy");
}

#[test]
fn a_new_group_past_max_groups_per_shard_is_refused_whatever_its_topic() {
    let sim = limited(10, 2, 10);
    subscribe(&sim, "a", "g").unwrap();
    subscribe(&sim, "b", "g").unwrap();
    let refused = subscribe(&sim, "c", "g").unwrap_err();
    assert_eq!(
        refused,
        ConsumerError::Limit(Limit::GroupsPerShard { limit: 2 })
    );
    assert!(refused.to_string().contains("delivery.maxGroupsPerShard"));
    // Universal consumers are not groups.
    subscribe(&sim, "c", "").unwrap();
    subscribe(&sim, "a", "g").unwrap();
}

#[test]
fn consumers_past_max_consumers_per_group_are_refused_and_the_group_keeps_working() {
    let mut sim = limited(10, 10, 2);
    let a = sim.subscribe("t", "g");
    let b = sim.subscribe("t", "g");
    let refused = subscribe(&sim, "t", "g").unwrap_err();
    assert_eq!(
        refused,
        ConsumerError::Limit(Limit::ConsumersPerGroup {
            topic: "t".into(),
            group: "g".into(),
            limit: 2
        })
    );
    assert!(refused
        .to_string()
        .contains("delivery.maxConsumersPerGroup"));
    // Universal consumers of a topic are bounded the same way.
    sim.subscribe("t", "");
    sim.subscribe("t", "");
    let refused = subscribe(&sim, "t", "").unwrap_err();
    assert!(matches!(
        refused,
        ConsumerError::Limit(Limit::UniversalsPerTopic { limit: 2, .. })
    ));
    for i in 0..4 {
        sim.publish("t", &format!("m{i}"));
    }
    sim.settle();
    assert_eq!(sim.recv(a).len() + sim.recv(b).len(), 4);
    // A member that leaves makes room for another.
    sim.core.borrow_mut().unsubscribe(sim.now_ms, a).unwrap();
    subscribe(&sim, "t", "g").unwrap();
    assert_eq!(sim.core.borrow().consumer_count(), 4);
}

#[test]
fn an_empty_group_counts_until_it_is_forgotten_then_frees_its_slot() {
    let retention_ms = 60_000;
    let mut sim = Sim::new(DeliveryConfig {
        groups_per_topic_max: 1,
        group_retention_ms: retention_ms,
        ..config()
    });
    let c = sim.subscribe("t", "old");
    sim.core.borrow_mut().unsubscribe(sim.now_ms, c).unwrap();
    assert!(
        subscribe(&sim, "t", "new").is_err(),
        "the empty group still counts"
    );
    sim.advance(retention_ms - 1);
    sim.pass();
    assert!(subscribe(&sim, "t", "new").is_err());
    sim.advance(1);
    sim.pass();
    assert_eq!(sim.core.borrow().groups_len(), 0, "retired");
    subscribe(&sim, "t", "new").unwrap();
}

#[test]
fn retiring_groups_looks_only_at_the_groups_due() {
    let groups = 10_000u64;
    let retention_ms = 1_000_000;
    let mut sim = Sim::new(DeliveryConfig {
        groups_per_shard_max: 1 << 20,
        group_retention_ms: retention_ms,
        ..config()
    });
    // Groups empty one millisecond apart: group i is due at retention + i.
    for i in 0..groups {
        let c = sim.subscribe(&format!("t{}", i % 97), &format!("g{i}"));
        sim.core.borrow_mut().unsubscribe(sim.now_ms, c).unwrap();
        sim.advance(1);
    }
    let start = sim.now_ms - groups;
    // 1,000 passes with nothing due: each looks at one group (the oldest), not 10,000.
    let before = checks(&sim);
    for _ in 0..1_000 {
        sim.pass();
    }
    assert_eq!(checks(&sim) - before, 1_000);
    assert_eq!(sim.core.borrow().groups_len(), groups as usize);
    // 100 groups fall due: one pass retires them and looks at one more.
    sim.now_ms = start + retention_ms + 99;
    let before = checks(&sim);
    sim.pass();
    assert_eq!(checks(&sim) - before, 101);
    assert_eq!(sim.core.borrow().groups_len(), groups as usize - 100);
    // A group that gets a member back leaves the queue; when it empties again it is due later.
    let back = sim.subscribe("t3", "g100");
    sim.core.borrow_mut().unsubscribe(sim.now_ms, back).unwrap();
    sim.now_ms = start + retention_ms + 100;
    sim.pass();
    assert_eq!(
        sim.core.borrow().groups_len(),
        groups as usize - 100,
        "g100 emptied again"
    );
    sim.now_ms = start + retention_ms + groups;
    sim.pass();
    assert_eq!(
        sim.core.borrow().groups_len(),
        1,
        "only g100 waits for its new retention"
    );
}

#[test]
fn parked_claims_of_groups_without_members_cost_a_pass_nothing() {
    let mut sim = Sim::new(config());
    let groups = 1_000;
    let members: Vec<ConsumerId> = (0..groups)
        .map(|i| sim.subscribe("t", &format!("g{i}")))
        .collect();
    sim.publish("t", "m");
    sim.settle();
    for c in &members {
        assert_eq!(sim.recv(*c).len(), 1);
        sim.core.borrow_mut().unsubscribe(sim.now_ms, *c).unwrap();
    }
    // Each group parked its copy in its retry list; none has a member to serve it.
    assert_eq!(sim.core.borrow().stats().pending_copies, groups);
    assert_eq!(sim.core.borrow().servable_len(), 0);
    sim.pass();
    sim.core.borrow().assert_consistent();
    // A returning member makes its group servable, and gets the copy.
    let back = sim.subscribe("t", "g7");
    assert_eq!(sim.core.borrow().servable_len(), 1);
    sim.settle();
    assert_eq!(sim.recv(back).len(), 1);
    assert_eq!(sim.core.borrow().servable_len(), 0);
}

fn checks(sim: &Sim) -> u64 {
    sim.core.borrow().retire_checks_total()
}
