//! The pipelined group commit's bookkeeping (pure): which commit rounds of the WAL writer are in
//! flight, and how far their fdatasyncs, completed in any order, make the log durable.
//!
//! A round is the write of the records pending when it started, then one fdatasync issued after
//! that write completed. The writer (`super::wal`) may start the next round's write while
//! earlier rounds' fdatasyncs are still in flight, up to [`Rounds::new`]'s bound. Their
//! fdatasyncs may complete in any order; this core reports a round durable only once it and
//! every round before it completed without error, so the log's durable sequence number only
//! ever moves forward over records that are all on stable storage, in sequence order.
//!
//! After a round fails, nothing after it is reported durable: once every round in flight has
//! completed, [`Rounds::take_failed`] hands the writer the failed round and all the rounds
//! behind it, merged, with the first error (the writer then fails the log, or retries them for
//! lack of space). No I/O, no clock; the writer's glommio shell drives it.

use std::collections::VecDeque;

/// Names one round from [`Rounds::begin`] to [`Rounds::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundId(u64);

/// Records a round (or a merge of rounds) covers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Covered {
    /// Highest sequence number written in it.
    pub last_seq: u64,
    /// Units of the log's buffer its records hold (given back once durable).
    pub reserved: u64,
}

impl Covered {
    /// This and `later` together.
    pub fn merge(self, later: Covered) -> Covered {
        Covered {
            last_seq: self.last_seq.max(later.last_seq),
            reserved: self.reserved + later.reserved,
        }
    }
}

/// What a completion made durable: every record through `last_seq`, `rounds` fdatasyncs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Advance {
    pub covered: Option<Covered>,
    pub rounds: u64,
}

struct Round<E> {
    id: u64,
    covered: Covered,
    outcome: Option<Result<(), E>>,
}

/// The rounds in flight, oldest first.
pub struct Rounds<E> {
    in_flight: VecDeque<Round<E>>,
    in_flight_max: usize,
    next_id: u64,
}

impl<E> Rounds<E> {
    /// At most `in_flight_max` rounds (at least 1: 1 is the classic group commit, where a
    /// round's write waits for the previous round's fdatasync).
    pub fn new(in_flight_max: usize) -> Rounds<E> {
        Rounds {
            in_flight: VecDeque::new(),
            in_flight_max: in_flight_max.max(1),
            next_id: 0,
        }
    }

    /// Changes the bound (rounds already in flight stay).
    pub fn set_in_flight_max(&mut self, in_flight_max: usize) {
        self.in_flight_max = in_flight_max.max(1);
    }

    /// A new round may start: below the bound, and no round failed (a failure stops the
    /// pipeline until [`Rounds::take_failed`] hands it over).
    pub fn has_room(&self) -> bool {
        self.in_flight.len() < self.in_flight_max && !self.has_failure()
    }

    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// How many rounds are in flight (tests look; the writer asks [`Rounds::has_room`]).
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Every round in flight has completed, successfully or not (true when none is).
    pub fn is_settled(&self) -> bool {
        self.in_flight.iter().all(|r| r.outcome.is_some())
    }

    /// A round in flight failed (it and the rounds behind it wait for [`Rounds::take_failed`]).
    pub fn has_failure(&self) -> bool {
        self.in_flight
            .iter()
            .any(|r| matches!(r.outcome, Some(Err(_))))
    }

    /// A round whose write completed and whose fdatasync is about to be issued. Its records
    /// come after every earlier round's (the writer never reorders records).
    pub fn begin(&mut self, covered: Covered) -> RoundId {
        debug_assert!(
            self.in_flight
                .back()
                .is_none_or(|r| r.covered.last_seq <= covered.last_seq),
            "rounds out of sequence order"
        );
        let id = self.next_id;
        self.next_id += 1;
        self.in_flight.push_back(Round {
            id,
            covered,
            outcome: None,
        });
        RoundId(id)
    }

    /// Round `id`'s fdatasync completed with `result`. Returns what is durable now: the rounds
    /// at the front that all completed without error (nothing if an earlier round is still in
    /// flight or failed).
    pub fn complete(&mut self, id: RoundId, result: Result<(), E>) -> Advance {
        if let Some(round) = self.in_flight.iter_mut().find(|r| r.id == id.0) {
            debug_assert!(round.outcome.is_none(), "round completed twice");
            round.outcome = Some(result);
        }
        let mut advance = Advance::default();
        while self
            .in_flight
            .front()
            .is_some_and(|r| matches!(r.outcome, Some(Ok(()))))
        {
            if let Some(round) = self.in_flight.pop_front() {
                advance.covered = Some(match advance.covered {
                    Some(c) => c.merge(round.covered),
                    None => round.covered,
                });
                advance.rounds += 1;
            }
        }
        advance
    }

    /// Once every round in flight has completed and one failed: the failed round and every
    /// round after it, merged (none of them is durable), with the first failure's error. The
    /// rounds are forgotten.
    pub fn take_failed(&mut self) -> Option<(Covered, E)> {
        if !self.has_failure() || self.in_flight.iter().any(|r| r.outcome.is_none()) {
            return None;
        }
        let mut covered: Option<Covered> = None;
        let mut error = None;
        for round in self.in_flight.drain(..) {
            covered = Some(match covered {
                Some(c) => c.merge(round.covered),
                None => round.covered,
            });
            if let (None, Some(Err(e))) = (&error, round.outcome) {
                error = Some(e);
            }
        }
        Some((covered?, error?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covered(last_seq: u64, reserved: u64) -> Covered {
        Covered { last_seq, reserved }
    }

    #[test]
    fn one_round_is_durable_when_its_fdatasync_completes() {
        let mut rounds: Rounds<&str> = Rounds::new(2);
        let a = rounds.begin(covered(3, 30));
        assert_eq!(rounds.in_flight(), 1);
        let advance = rounds.complete(a, Ok(()));
        assert_eq!(advance.covered, Some(covered(3, 30)));
        assert_eq!(advance.rounds, 1);
        assert!(rounds.is_empty());
    }

    #[test]
    fn a_later_round_completing_first_reports_nothing_until_the_earlier_one_does() {
        let mut rounds: Rounds<&str> = Rounds::new(2);
        let a = rounds.begin(covered(3, 30));
        let b = rounds.begin(covered(5, 20));
        assert!(!rounds.has_room(), "two in flight at a bound of two");
        let early = rounds.complete(b, Ok(()));
        assert_eq!(early, Advance::default(), "seq 5 reported before seq 3");
        let both = rounds.complete(a, Ok(()));
        assert_eq!(both.covered, Some(covered(5, 50)));
        assert_eq!(both.rounds, 2);
        assert!(rounds.has_room());
    }

    #[test]
    fn in_order_completions_advance_one_round_at_a_time() {
        let mut rounds: Rounds<&str> = Rounds::new(2);
        let a = rounds.begin(covered(3, 1));
        let b = rounds.begin(covered(5, 1));
        assert_eq!(rounds.complete(a, Ok(())).covered, Some(covered(3, 1)));
        assert!(rounds.has_room());
        let c = rounds.begin(covered(9, 1));
        assert_eq!(rounds.complete(b, Ok(())).covered, Some(covered(5, 1)));
        assert_eq!(rounds.complete(c, Ok(())).covered, Some(covered(9, 1)));
    }

    #[test]
    fn nothing_after_a_failed_round_is_durable_even_if_its_own_sync_succeeded() {
        let mut rounds: Rounds<&str> = Rounds::new(3);
        let a = rounds.begin(covered(2, 1));
        let b = rounds.begin(covered(4, 2));
        let c = rounds.begin(covered(6, 4));
        assert_eq!(rounds.complete(a, Ok(())).covered, Some(covered(2, 1)));
        assert_eq!(rounds.complete(b, Err("eio")), Advance::default());
        assert!(!rounds.has_room(), "no new round behind a failure");
        assert!(rounds.take_failed().is_none(), "round c still in flight");
        assert_eq!(rounds.complete(c, Ok(())), Advance::default());
        let (lost, error) = rounds.take_failed().expect("a failed round");
        assert_eq!(lost, covered(6, 6));
        assert_eq!(error, "eio");
        assert!(rounds.is_empty());
        assert!(rounds.has_room());
    }

    #[test]
    fn the_first_failure_is_the_one_reported() {
        let mut rounds: Rounds<&str> = Rounds::new(2);
        let a = rounds.begin(covered(2, 0));
        let b = rounds.begin(covered(4, 0));
        rounds.complete(b, Err("second"));
        rounds.complete(a, Err("first"));
        let (lost, error) = rounds.take_failed().expect("failed rounds");
        assert_eq!((lost.last_seq, error), (4, "first"));
    }

    #[test]
    fn a_bound_of_one_is_the_classic_group_commit() {
        let mut rounds: Rounds<&str> = Rounds::new(0);
        let a = rounds.begin(covered(1, 0));
        assert!(!rounds.has_room());
        rounds.complete(a, Ok(()));
        assert!(rounds.has_room());
    }
}
