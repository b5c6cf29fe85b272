//! Tests of `durable` ACKs and NACKs and of copy records (`shard::records`): what waits for which
//! commit, and what a core that starts over the same store (a restart, a new leader) does with
//! the records.

use futures_lite::future::block_on;

use super::copies::Committed;
use super::drive;
use super::tests::{config, payload, Sim};
use crate::config::{AckLevel, DeliveryConfig};
use crate::key::{self, EventKey};
use crate::log::copies::copy_key_range;
use crate::pipeline::shard::ShardCore;
use crate::pipeline::TagResult;

fn ack(
    sim: &mut Sim,
    consumer: crate::pipeline::ConsumerId,
    keys: &[EventKey],
    level: AckLevel,
) -> super::shard::Settled {
    sim.core
        .borrow_mut()
        .ack_at(sim.now_ms, consumer, keys, level)
        .unwrap()
}

fn records_stored(sim: &Sim) -> usize {
    let (start, end) = copy_key_range();
    sim.store
        .inner
        .scan_now(&start, Some(&end), usize::MAX)
        .len()
}

/// A fresh core over the same store, as after a restart or a change of leader, with the
/// records read back.
fn restart(sim: &mut Sim, delivery: DeliveryConfig) {
    *sim.core.borrow_mut() = ShardCore::new(delivery, sim.now_ms);
    let found = block_on(drive::read_copy_records(&sim.store)).unwrap();
    assert!(found.orphans.is_empty() && found.unreadable == 0);
    sim.core.borrow_mut().restore_copies(found.live);
}

#[test]
fn a_durable_ack_waits_for_its_delete_which_is_cut_at_once() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("jobs", "g");
    let key = sim.publish("jobs", "j");
    sim.settle();
    assert_eq!(sim.recv(c).len(), 1);
    let settled = ack(&mut sim, c, &[key], AckLevel::Durable);
    assert_eq!(settled.results, vec![TagResult::Ok]);
    let commit = settled.commit.expect("a durable ACK has a commit");
    assert!(commit.is_pending(), "nothing is written yet");
    // No time passes: the delete does not wait for `deleteBatchInterval`.
    assert_eq!(sim.flush_deletes(), 1);
    assert!(!sim.stored(&key));
    assert_eq!(block_on(commit.wait()), Committed::Yes);
}

#[test]
fn a_leader_ack_waits_for_nothing_and_its_delete_waits_for_the_interval() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("jobs", "g");
    let key = sim.publish("jobs", "j");
    sim.settle();
    sim.recv(c);
    let settled = ack(&mut sim, c, &[key], AckLevel::Leader);
    assert!(settled.commit.is_none());
    assert_eq!(
        sim.flush_deletes(),
        0,
        "a partial batch waits for the interval"
    );
    sim.advance(100);
    assert_eq!(sim.flush_deletes(), 1);
}

#[test]
fn a_durable_ack_of_one_group_is_recorded_and_survives_a_restart() {
    let mut sim = Sim::new(config());
    let billing = sim.subscribe("orders", "billing");
    let shipping = sim.subscribe("orders", "shipping");
    let key = sim.publish("orders", "o1");
    sim.settle();
    sim.recv(billing);
    sim.recv(shipping);
    let commit = ack(&mut sim, billing, &[key], AckLevel::Durable)
        .commit
        .unwrap();
    assert!(
        commit.is_pending(),
        "the group's ACK must reach the log first"
    );
    block_on(drive::write_copy_records(&sim.core, &sim.store)).unwrap();
    assert_eq!(block_on(commit.wait()), Committed::Yes);
    assert_eq!(records_stored(&sim), 1);

    // A crash now: billing ACKed durably, shipping did not.
    restart(&mut sim, config());
    let billing = sim.subscribe("orders", "billing");
    let shipping = sim.subscribe("orders", "shipping");
    sim.settle();
    assert!(sim.recv(billing).is_empty(), "billing's ACK held");
    let again = sim.recv(shipping);
    assert_eq!(again.iter().map(payload).collect::<Vec<_>>(), vec!["o1"]);
    // Shipping's ACK completes the message: its delete takes billing's record with it.
    ack(&mut sim, shipping, &[key], AckLevel::Leader);
    sim.advance(100);
    sim.flush_deletes();
    assert!(!sim.stored(&key));
    assert_eq!(records_stored(&sim), 0, "no record outlives its message");
}

#[test]
fn a_redelivery_waits_for_the_record_of_earlier_deliveries_and_attempts_survive_restarts() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("jobs", "g");
    let key = sim.publish("jobs", "j");
    sim.settle();
    assert_eq!(sim.recv(c)[0].attempt, 1);
    let nack = sim
        .core
        .borrow_mut()
        .nack_at(sim.now_ms, c, &[key], 0, AckLevel::Durable)
        .unwrap();
    let commit = nack.commit.expect("a durable NACK has a commit");
    // The pass below writes the record first (the sequential driver), then redelivers.
    assert!(commit.is_pending());
    {
        let mut core = sim.core.borrow_mut();
        core.plan_pass(sim.now_ms);
        assert!(
            core.drain(sim.now_ms, c, usize::MAX).is_empty(),
            "not handed out before its record is in the log"
        );
    }
    sim.settle();
    assert_eq!(block_on(commit.wait()), Committed::Yes);
    assert_eq!(sim.recv(c)[0].attempt, 2);

    // Crash while attempt 2 is held: the next delivery is not numbered lower than 2.
    restart(&mut sim, config());
    let c = sim.subscribe("jobs", "g");
    sim.settle();
    let after = sim.recv(c);
    assert_eq!(after.len(), 1);
    assert!(
        after[0].attempt >= 2,
        "attempt went down to {}",
        after[0].attempt
    );
}

#[test]
fn max_deliveries_counts_across_restarts() {
    let delivery = DeliveryConfig {
        max_deliveries: 3,
        ..config()
    };
    let mut sim = Sim::new(delivery.clone());
    let mut seen = Vec::new();
    for _ in 0..3 {
        let c = sim.subscribe("jobs", "g");
        if seen.is_empty() {
            sim.publish("jobs", "j");
        }
        sim.settle();
        let got = sim.recv(c);
        assert_eq!(got.len(), 1);
        seen.push(got[0].attempt);
        sim.nack(c, &[got[0].key], 0);
        block_on(drive::write_copy_records(&sim.core, &sim.store)).unwrap();
        restart(&mut sim, delivery.clone());
    }
    assert_eq!(seen, vec![1, 2, 3], "each restart continues the count");
    // The third NACK exhausted the policy; its dead letter was not stored before the crash, so
    // the copy comes once more, numbered 3 (never 1), and its NACK dead-letters it.
    let c = sim.subscribe("jobs", "g");
    sim.settle();
    let again = sim.recv(c);
    assert_eq!(again.iter().map(|d| d.attempt).collect::<Vec<_>>(), vec![3]);
    sim.nack(c, &[again[0].key], 0);
    assert_eq!(sim.core.borrow_mut().take_dead_letters().len(), 1);
}

#[test]
fn a_replaced_core_loses_its_waiting_commits() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("jobs", "g");
    let key = sim.publish("jobs", "j");
    sim.settle();
    sim.recv(c);
    let commit = ack(&mut sim, c, &[key], AckLevel::Durable).commit.unwrap();
    *sim.core.borrow_mut() = ShardCore::new(config(), sim.now_ms);
    assert_eq!(block_on(commit.wait()), Committed::Lost);
}

#[test]
fn a_universal_consumers_copies_need_no_record() {
    let mut sim = Sim::new(config());
    let c = sim.subscribe("news", "");
    let key = sim.publish("news", "x");
    sim.settle();
    sim.recv(c);
    sim.nack(c, &[key], 0);
    sim.settle();
    assert_eq!(sim.recv(c)[0].attempt, 2);
    assert_eq!(records_stored(&sim), 0);
    assert!(
        sim.store
            .inner
            .scan_now(key::EVENT_RANGE_START, Some(key::EVENT_RANGE_END), 9)
            .len()
            == 1
    );
}
