//! Delivery accounting of a bench run: which message reached which receiver how often, so the
//! report can say `received`, `duplicates` and `missing` exactly, not estimate them.
//!
//! A receiver is a consumer group (its members share one account: each message must reach the
//! group once) or a universal consumer. Counts are one byte per message per receiver, indexed
//! by the producer's sequence number, which producers assign densely from 0. Pure: the driver
//! locks it and feeds it what consumers saw.

/// Deliveries of one receiver, per producer: `counts[producer][seq]` deliveries seen.
#[derive(Clone, Debug, Default)]
struct Receiver {
    counts: Vec<Vec<u8>>,
    deliveries: u64,
    /// Redeliveries the bench asked for (nacks): they are not duplicates.
    nacks: u64,
}

/// Counts per receiver.
#[derive(Clone, Debug)]
pub struct Tracker {
    receivers: Vec<Receiver>,
    producers: usize,
    /// Sequence numbers above this are refused as corrupt (a bound on memory).
    seq_max: u64,
    /// Distinct (message, receiver) pairs seen, kept as deliveries arrive.
    distinct: u64,
}

/// What the tracker concluded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Tally {
    /// Messages sent.
    pub sent: u64,
    /// Distinct (message, receiver) pairs delivered.
    pub received: u64,
    /// Deliveries beyond the first of a (message, receiver) pair, less those a nack asked for.
    pub duplicates: u64,
    /// (message, receiver) pairs never delivered.
    pub missing: u64,
    /// Deliveries that were not bench messages of this run.
    pub foreign: u64,
}

impl Tracker {
    /// A tracker for `receivers` receivers and `producers` producers, each sending at most
    /// `seq_max + 1` messages.
    pub fn new(receivers: usize, producers: usize, seq_max: u64) -> Tracker {
        Tracker {
            receivers: vec![
                Receiver {
                    counts: vec![Vec::new(); producers],
                    ..Receiver::default()
                };
                receivers
            ],
            producers,
            seq_max,
            distinct: 0,
        }
    }

    /// Records one delivery; returns `false` (and records nothing) when the identity is out of
    /// range, which only a corrupt or foreign payload produces.
    pub fn record(&mut self, receiver: usize, producer: u32, seq: u64) -> bool {
        let producer = producer as usize;
        if receiver >= self.receivers.len() || producer >= self.producers || seq > self.seq_max {
            return false;
        }
        let r = &mut self.receivers[receiver];
        let counts = &mut r.counts[producer];
        let seq = seq as usize;
        if counts.len() <= seq {
            counts.resize((seq + 1).next_power_of_two(), 0);
        }
        if counts[seq] == 0 {
            self.distinct += 1;
        }
        counts[seq] = counts[seq].saturating_add(1);
        r.deliveries += 1;
        true
    }

    /// Notes that `receiver` nacked a delivery, so one more delivery of it is expected.
    pub fn note_nack(&mut self, receiver: usize) {
        if let Some(r) = self.receivers.get_mut(receiver) {
            r.nacks += 1;
        }
    }

    /// Distinct (message, receiver) pairs delivered so far.
    pub fn distinct(&self) -> u64 {
        self.distinct
    }

    /// The verdict, given how many messages each producer sent (`sent[p]`: seq 0..sent[p]).
    pub fn tally(&self, sent: &[u64], foreign: u64) -> Tally {
        let mut tally = Tally {
            sent: sent.iter().sum(),
            foreign,
            ..Tally::default()
        };
        for r in &self.receivers {
            let mut distinct = 0u64;
            for (producer, counts) in r.counts.iter().enumerate() {
                let sent_by = sent.get(producer).copied().unwrap_or(0);
                for seq in 0..sent_by {
                    match counts.get(seq as usize).copied().unwrap_or(0) {
                        0 => tally.missing += 1,
                        _ => distinct += 1,
                    }
                }
            }
            tally.received += distinct;
            tally.duplicates += r
                .deliveries
                .saturating_sub(distinct)
                .saturating_sub(r.nacks);
        }
        tally
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_once_per_receiver_is_complete() {
        let mut t = Tracker::new(2, 2, 1000);
        for receiver in 0..2 {
            for producer in 0..2 {
                for seq in 0..10 {
                    assert!(t.record(receiver, producer, seq));
                }
            }
        }
        let tally = t.tally(&[10, 10], 0);
        assert_eq!(
            tally,
            Tally {
                sent: 20,
                received: 40,
                duplicates: 0,
                missing: 0,
                foreign: 0
            }
        );
        assert_eq!(t.distinct(), 40);
    }

    #[test]
    fn a_gap_is_missing_and_a_repeat_is_a_duplicate() {
        let mut t = Tracker::new(1, 1, 1000);
        for seq in [0, 1, 1, 3] {
            t.record(0, 0, seq);
        }
        let tally = t.tally(&[4], 0);
        assert_eq!(tally.received, 3);
        assert_eq!(tally.missing, 1);
        assert_eq!(tally.duplicates, 1);
    }

    #[test]
    fn redelivery_after_a_nack_is_not_a_duplicate() {
        let mut t = Tracker::new(1, 1, 1000);
        t.record(0, 0, 0);
        t.note_nack(0);
        t.record(0, 0, 0);
        let tally = t.tally(&[1], 0);
        assert_eq!((tally.received, tally.duplicates, tally.missing), (1, 0, 0));
    }

    #[test]
    fn out_of_range_identity_is_refused() {
        let mut t = Tracker::new(1, 1, 10);
        assert!(!t.record(0, 1, 0));
        assert!(!t.record(1, 0, 0));
        assert!(!t.record(0, 0, 11));
        assert_eq!(t.distinct(), 0);
    }
}
