//! [`Leadership`]: whether a replica may act as its shard's one leader (take proposals, hand
//! out copies), as a clock-free state machine beside the Raft core. The [`super::replica`]
//! feeds it the core's state after every step, tick and Ready, and the shell asks it with the
//! time of the question (`now_ms`, from a monotonic clock the shell reads; tests pass their
//! own). It does no I/O and reads no clock.
//!
//! The rules, in the order they are checked:
//!
//! 1. **Failure.** A replica whose driver stopped never serves again ([`Leadership::fail`]).
//! 2. **Step-down.** Any change of term or role clears everything below; a leader that starts
//!    handing its leadership over ([`Leadership::transfer_started`]) gives up serving for the
//!    rest of the term, because the transferee campaigns without waiting out anybody's lease.
//! 3. **First entry of the term.** A new leader serves only once it has applied the first
//!    entry of its own term: every command earlier terms committed (deletes, the event-id
//!    high-water mark) is then in its state.
//! 4. **Lease.** A serving leader hands out a copy only while a quorum (itself included) has
//!    answered, within `lease_ms`, a heartbeat of this term. The lease counts from when the
//!    heartbeat was *sent*, never from when its answer arrived: the shell stamps each outgoing
//!    heartbeat with (term, send time) ([`Leadership::stamp`]), the follower's raft core echoes
//!    the stamp in its answer, and [`Leadership::on_message`] takes the answer's stamp. Votes,
//!    append answers, a newer leader's appends and messages of other terms never refresh it.
//!    The quorum is of the voters in force ([`Leadership::set_voters`], fed at each applied
//!    membership change); in a joint membership, a quorum of each half, as an election needs.
//!
//! Why the lease holds: a follower that answered a heartbeat received it after it was sent,
//! and grants no vote (pre-vote or vote) for one election timeout after that (raft's
//! check-quorum lease; a restarted replica keeps the same quiet period, see
//! `Replica::new`), nor campaigns itself sooner. Every quorum that could elect a new leader
//! shares a member with the quorum that answered, so no newer leader exists, let alone commits
//! anything, before `sent + election timeout`. With `lease_ms` at half the election timeout the
//! margin covers clock rates that differ by up to 2× and a tick of granularity.
//!
//! What it does not cover: a copy handed out while the lease held reaches its client later if
//! the process stops between the hand-out and the socket write; that copy was handed out under
//! a valid lease (the at-least-once window the README names).

use std::collections::BTreeMap;

use raft::eraftpb::{Message, MessageType};

/// Marks a heartbeat context as a lease stamp (raft-rs puts read-index request ids there; pinq
/// makes no read-index requests, and stamps only heartbeats whose context is empty).
const STAMP_MAGIC: [u8; 2] = *b"pl";
const STAMP_BYTES: usize = 2 + 8 + 8;

/// What a replica's leadership is built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeadershipConfig {
    pub id: u64,
    /// The voters of the membership in force (the incoming half of a joint one).
    pub voters: Vec<u64>,
    /// How long a heartbeat answered by a quorum keeps the lease, from its send time. Must be
    /// below the election timeout; `cluster.tickInterval × electionTicks / 2` in the broker.
    pub lease_ms: u64,
}

/// The Raft core's state, as the leadership rules need it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RaftState {
    pub term: u64,
    pub leader: bool,
    /// Entries applied to the state machine here.
    pub applied: u64,
    /// The log's last index (a new leader's first entry is its last entry when it takes over).
    pub last_index: u64,
}

/// See the module docs.
#[derive(Clone, Debug)]
pub struct Leadership {
    config: LeadershipConfig,
    state: RaftState,
    /// While leader: the index of this term's first entry.
    term_start: Option<u64>,
    /// Follower → the latest send time of a heartbeat of this term it answered.
    answered: BTreeMap<u64, u64>,
    /// The latest send time stamped in this term (an answer cannot carry a later one).
    stamped_max: Option<u64>,
    /// [`Leadership::lease_until_ms`], recomputed when an answer or the role changes (every
    /// hand-out asks, so the question costs no sort and no allocation).
    lease_until: Option<u64>,
    transferring: bool,
    failed: bool,
    /// The outgoing voters of a joint membership (empty otherwise).
    voters_outgoing: Vec<u64>,
}

impl Leadership {
    pub fn new(config: LeadershipConfig) -> Leadership {
        Leadership {
            config,
            state: RaftState::default(),
            term_start: None,
            answered: BTreeMap::new(),
            stamped_max: None,
            lease_until: None,
            transferring: false,
            failed: false,
            voters_outgoing: Vec::new(),
        }
    }

    /// The Raft core's state now. A change of term or role clears the lease and the serving
    /// state (rule 2); a leader of a new term notes its first entry (rule 3).
    pub fn observe(&mut self, state: RaftState) {
        if state.term != self.state.term || state.leader != self.state.leader {
            self.answered.clear();
            self.stamped_max = None;
            self.transferring = false;
            self.term_start = state.leader.then_some(state.last_index);
            self.state = state;
            self.lease_until = self.compute_lease_until();
        }
        self.state = state;
    }

    /// Stamps this term's outgoing heartbeats with `now_ms` (their send time). Call with the
    /// messages as they leave, just before the transport takes them.
    pub fn stamp(&mut self, now_ms: u64, messages: &mut [Message]) {
        if !self.state.leader || self.failed {
            return;
        }
        let term = self.state.term;
        let mut stamped = false;
        for m in messages.iter_mut().filter(|m| {
            m.get_msg_type() == MessageType::MsgHeartbeat && m.term == term && m.context.is_empty()
        }) {
            let mut context = Vec::with_capacity(STAMP_BYTES);
            context.extend_from_slice(&STAMP_MAGIC);
            context.extend_from_slice(&term.to_le_bytes());
            context.extend_from_slice(&now_ms.to_le_bytes());
            m.context = context.into();
            stamped = true;
        }
        if stamped {
            self.stamped_max = Some(self.stamped_max.map_or(now_ms, |t| t.max(now_ms)));
        }
    }

    /// A message from a peer, before the raft core steps it: an answer to one of this term's
    /// stamped heartbeats refreshes that follower's part of the lease; nothing else does.
    pub fn on_message(&mut self, message: &Message) {
        if !self.state.leader || message.get_msg_type() != MessageType::MsgHeartbeatResponse {
            return;
        }
        if message.term != self.state.term
            || message.from == self.config.id
            || !(self.config.voters.contains(&message.from)
                || self.voters_outgoing.contains(&message.from))
        {
            return;
        }
        let Some((term, sent_ms)) = parse_stamp(&message.context) else {
            return;
        };
        // A stamp of another term, or from the future, is not one of ours.
        if term != self.state.term || self.stamped_max.is_none_or(|max| sent_ms > max) {
            return;
        }
        let entry = self.answered.entry(message.from).or_insert(sent_ms);
        *entry = (*entry).max(sent_ms);
        self.lease_until = self.compute_lease_until();
    }

    /// This leader asked a follower to take over: it serves no more in this term.
    pub fn transfer_started(&mut self) {
        if self.state.leader {
            self.transferring = true;
        }
    }

    /// The replica's driver stopped: it never serves again (the node stops).
    pub fn fail(&mut self) {
        self.failed = true;
    }

    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Leader of its term, caught up with every earlier term, not handing over, not failed:
    /// it takes proposals.
    pub fn serving(&self) -> bool {
        self.state.leader
            && !self.failed
            && !self.transferring
            && self
                .term_start
                .is_some_and(|start| self.state.applied >= start)
    }

    /// The index of this term's first entry, while leader.
    pub fn term_start(&self) -> Option<u64> {
        self.term_start
    }

    /// Until when the lease holds (exclusive): the send time of the latest heartbeat a quorum
    /// answered, plus `lease_ms`. `None` without a lease; `u64::MAX` for a group of one.
    pub fn lease_until_ms(&self) -> Option<u64> {
        self.lease_until
    }

    fn compute_lease_until(&self) -> Option<u64> {
        if !self.state.leader {
            return None;
        }
        let incoming = self.lease_among(&self.config.voters)?;
        if self.voters_outgoing.is_empty() {
            return Some(incoming);
        }
        // A joint membership: a new leader needs a quorum of both halves, so the lease holds
        // while each half's quorum answered.
        Some(incoming.min(self.lease_among(&self.voters_outgoing)?))
    }

    /// The lease a quorum of `voters` gives (this leader counts itself when it is one of them).
    fn lease_among(&self, voters: &[u64]) -> Option<u64> {
        let quorum = voters.len() / 2 + 1;
        let me = usize::from(voters.contains(&self.config.id));
        let needed = quorum.saturating_sub(me);
        if needed == 0 {
            return Some(u64::MAX);
        }
        let mut times: Vec<u64> = voters
            .iter()
            .filter(|id| **id != self.config.id)
            .filter_map(|id| self.answered.get(id).copied())
            .collect();
        if times.len() < needed {
            return None;
        }
        times.sort_unstable_by(|a, b| b.cmp(a));
        Some(times[needed - 1].saturating_add(self.config.lease_ms))
    }

    /// The membership changed: the lease is counted among these voters from now on (a
    /// follower's part of the lease stays if it is still a voter).
    pub fn set_voters(&mut self, voters: Vec<u64>, outgoing: Vec<u64>) {
        self.config.voters = voters;
        self.voters_outgoing = outgoing;
        self.lease_until = self.compute_lease_until();
    }

    /// Whether a copy may be handed out at `now_ms`: serving, and within the lease.
    pub fn may_hand_out(&self, now_ms: u64) -> bool {
        self.serving() && self.lease_until_ms().is_some_and(|until| now_ms < until)
    }
}

fn parse_stamp(context: &[u8]) -> Option<(u64, u64)> {
    if context.len() != STAMP_BYTES || context[..2] != STAMP_MAGIC {
        return None;
    }
    let term = u64::from_le_bytes(context[2..10].try_into().ok()?);
    let sent_ms = u64::from_le_bytes(context[10..18].try_into().ok()?);
    Some((term, sent_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE_MS: u64 = 100;

    fn leadership(voters: &[u64]) -> Leadership {
        Leadership::new(LeadershipConfig {
            id: 1,
            voters: voters.to_vec(),
            lease_ms: LEASE_MS,
        })
    }

    fn leader(term: u64, applied: u64, last_index: u64) -> RaftState {
        RaftState {
            term,
            leader: true,
            applied,
            last_index,
        }
    }

    fn heartbeat(term: u64, to: u64) -> Message {
        Message {
            msg_type: MessageType::MsgHeartbeat,
            from: 1,
            to,
            term,
            ..Message::default()
        }
    }

    /// What a follower's raft core answers: the heartbeat's context, echoed.
    fn answer(heartbeat: &Message, term: u64) -> Message {
        Message {
            msg_type: MessageType::MsgHeartbeatResponse,
            from: heartbeat.to,
            to: 1,
            term,
            context: heartbeat.context.clone(),
            ..Message::default()
        }
    }

    /// A leader of `term` that applied its first entry, with heartbeats to 2 and 3 stamped at
    /// `sent_ms`.
    fn serving_leader(term: u64, sent_ms: u64) -> (Leadership, Vec<Message>) {
        let mut l = leadership(&[1, 2, 3]);
        l.observe(leader(term, 4, 5));
        l.observe(leader(term, 5, 5));
        let mut beats = vec![heartbeat(term, 2), heartbeat(term, 3)];
        l.stamp(sent_ms, &mut beats);
        (l, beats)
    }

    #[test]
    fn a_new_leader_serves_only_once_its_first_entry_is_applied() {
        let mut l = leadership(&[1]);
        l.observe(leader(3, 4, 5));
        assert!(!l.serving());
        assert!(!l.may_hand_out(0));
        assert_eq!(l.term_start(), Some(5));
        l.observe(leader(3, 5, 6));
        assert!(l.serving());
        // A group of one needs nobody's answer.
        assert!(l.may_hand_out(u64::MAX - 1));
    }

    #[test]
    fn a_quorum_of_answers_grants_the_lease_from_the_send_time() {
        let (mut l, beats) = serving_leader(2, 1_000);
        assert!(l.serving());
        assert!(!l.may_hand_out(1_000), "no answer yet: no lease");
        // One follower and the leader are a quorum of three.
        l.on_message(&answer(&beats[0], 2));
        assert_eq!(l.lease_until_ms(), Some(1_000 + LEASE_MS));
        assert!(l.may_hand_out(1_099));
        // It counts from the send time, however late the answer came.
        assert!(!l.may_hand_out(1_100));
    }

    #[test]
    fn only_heartbeat_answers_of_the_current_term_refresh_the_lease() {
        let (mut l, beats) = serving_leader(2, 1_000);
        let mut vote = answer(&beats[0], 2);
        vote.msg_type = MessageType::MsgRequestVoteResponse;
        l.on_message(&vote);
        let mut append = answer(&beats[0], 2);
        append.msg_type = MessageType::MsgAppendResponse;
        l.on_message(&append);
        // An answer of another term, and an unstamped one.
        l.on_message(&answer(&beats[0], 3));
        l.on_message(&answer(&heartbeat(2, 2), 2));
        assert_eq!(l.lease_until_ms(), None);
        l.on_message(&answer(&beats[1], 2));
        assert!(l.may_hand_out(1_050));
    }

    #[test]
    fn a_stamp_of_an_earlier_term_or_from_the_future_is_ignored() {
        let (mut l, old) = serving_leader(2, 1_000);
        l.observe(RaftState {
            term: 3,
            leader: false,
            applied: 6,
            last_index: 6,
        });
        l.observe(leader(4, 7, 7));
        // Term 2's heartbeat, answered by a follower now in term 4.
        l.on_message(&answer(&old[0], 4));
        assert_eq!(l.lease_until_ms(), None);
        // A stamp later than anything this leader sent.
        let mut beats = vec![heartbeat(4, 2)];
        l.stamp(2_000, &mut beats);
        let mut forged = beats[0].clone();
        forged.context = {
            let mut c = STAMP_MAGIC.to_vec();
            c.extend_from_slice(&4u64.to_le_bytes());
            c.extend_from_slice(&9_000u64.to_le_bytes());
            c.into()
        };
        l.on_message(&answer(&forged, 4));
        assert_eq!(l.lease_until_ms(), None);
        l.on_message(&answer(&beats[0], 4));
        assert_eq!(l.lease_until_ms(), Some(2_000 + LEASE_MS));
    }

    #[test]
    fn every_change_of_role_or_term_clears_the_lease() {
        let (mut l, beats) = serving_leader(2, 1_000);
        l.on_message(&answer(&beats[0], 2));
        assert!(l.may_hand_out(1_010));
        l.observe(RaftState {
            term: 3,
            leader: false,
            applied: 5,
            last_index: 5,
        });
        assert!(!l.serving());
        assert!(!l.may_hand_out(1_010));
        assert_eq!(l.lease_until_ms(), None);
        // Leading again: a new first entry, a new lease.
        l.observe(leader(4, 5, 6));
        assert!(!l.may_hand_out(1_010));
        l.observe(leader(4, 6, 6));
        assert!(l.serving());
        assert!(
            !l.may_hand_out(1_010),
            "the old term's answers do not count"
        );
    }

    #[test]
    fn a_quorum_needs_enough_followers_and_takes_the_older_of_the_needed_answers() {
        let mut l = leadership(&[1, 2, 3, 4, 5]);
        l.observe(leader(2, 9, 9));
        let mut first = vec![heartbeat(2, 2), heartbeat(2, 3), heartbeat(2, 4)];
        l.stamp(1_000, &mut first);
        let mut second = vec![heartbeat(2, 2)];
        l.stamp(1_040, &mut second);
        l.on_message(&answer(&second[0], 2));
        assert_eq!(
            l.lease_until_ms(),
            None,
            "one follower of five is no quorum"
        );
        l.on_message(&answer(&first[1], 2));
        // Followers 2 (1 040) and 3 (1 000) with the leader: the quorum's oldest answer counts.
        assert_eq!(l.lease_until_ms(), Some(1_000 + LEASE_MS));
        l.on_message(&answer(&first[0], 2));
        assert_eq!(
            l.lease_until_ms(),
            Some(1_000 + LEASE_MS),
            "an older answer never shortens a follower's part"
        );
    }

    #[test]
    fn a_transfer_of_leadership_ends_serving_for_the_term() {
        let (mut l, beats) = serving_leader(2, 1_000);
        l.on_message(&answer(&beats[0], 2));
        l.transfer_started();
        assert!(!l.serving());
        assert!(!l.may_hand_out(1_010));
        let mut later = vec![heartbeat(2, 2)];
        l.stamp(1_020, &mut later);
        l.on_message(&answer(&later[0], 2));
        assert!(!l.may_hand_out(1_030));
    }

    #[test]
    fn a_failed_driver_never_serves_again() {
        let (mut l, beats) = serving_leader(2, 1_000);
        l.on_message(&answer(&beats[0], 2));
        l.fail();
        assert!(l.failed());
        assert!(!l.serving());
        assert!(!l.may_hand_out(1_010));
        l.observe(leader(3, 7, 7));
        assert!(!l.serving());
    }

    #[test]
    fn only_empty_heartbeats_of_the_current_term_are_stamped() {
        let mut l = leadership(&[1, 2, 3]);
        l.observe(leader(2, 5, 5));
        let mut read_index = heartbeat(2, 2);
        read_index.context = b"read".to_vec().into();
        let mut append = heartbeat(2, 3);
        append.msg_type = MessageType::MsgAppend;
        let mut messages = vec![read_index, append, heartbeat(1, 2)];
        l.stamp(1_000, &mut messages);
        assert_eq!(&messages[0].context[..], b"read");
        assert!(messages[1].context.is_empty());
        assert!(messages[2].context.is_empty());
        // A follower stamps nothing.
        let mut f = leadership(&[1, 2, 3]);
        let mut beats = vec![heartbeat(0, 2)];
        f.stamp(1_000, &mut beats);
        assert!(beats[0].context.is_empty());
    }
}
