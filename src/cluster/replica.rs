//! [`Replica`]: one shard's Raft group member as a pure state machine (the driver's core).
//!
//! It wraps the `raft` crate's `RawNode` over a [`RaftLog`] and turns each `Ready` into
//! [`Work`] the shell carries out: messages to send now, a [`RaftRecord`] to append to the log,
//! committed entries to apply, and a change of role. It performs no I/O and reads no clock: the
//! shell calls [`Replica::tick`] on its timer, [`Replica::step`] with messages from peers,
//! [`Replica::durable`] when the log's fdatasync moved, and [`Replica::applied_to`] after it
//! applied committed entries. The same core runs in the deterministic simulation
//! (`tests/cluster_sim.rs`) with a simulated disk and network.
//!
//! Persistence is asynchronous and grouped: a Ready's record goes into the log's group commit
//! without waiting (`advance_append_async`); messages that must follow it (votes, append
//! responses) are held until the fdatasync covering it, and only then is the Ready reported
//! persisted, so one fdatasync covers every Ready appended while the previous one was in flight.
//!
//! Leadership: whether this replica serves (takes proposals) and may hand out copies is
//! [`Leadership`]'s to say (the first-entry-of-term rule, the lease, step-down); the replica
//! feeds it the core's state after every step, tick and Ready, and the peers' heartbeat answers.
//! A restarted replica ignores vote requests for one election timeout (its quiet period): it
//! may have answered a leader's heartbeat just before it went down, and that leader's lease
//! counts on it not voting for another so soon.

use std::collections::VecDeque;

use raft::eraftpb::{ConfChangeV2, ConfState, Entry, EntryType, Message, MessageType, Snapshot};
use raft::{RawNode, StateRole};

use super::leadership::{Leadership, LeadershipConfig, RaftState};
use super::raft_log::RaftLog;
use super::record::RaftRecord;

/// Timing and limits of one replica (from `[cluster]`).
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    pub id: u64,
    pub voters: Vec<u64>,
    pub election_ticks: usize,
    pub heartbeat_ticks: usize,
    /// Largest append message, in bytes of entries.
    pub max_message_bytes: u64,
    /// Append messages in flight per follower.
    pub max_inflight_messages: usize,
    /// How long a heartbeat answered by a quorum keeps the leader's lease (see
    /// [`LeadershipConfig::lease_ms`]); below the election timeout.
    pub lease_ms: u64,
}

/// Where the shell appends a [`Work`]'s record; returns its log sequence number (the WAL's).
pub trait RecordSink {
    type Error;
    fn append(&mut self, record: &RaftRecord) -> Result<u64, Self::Error>;
}

/// A replica's role as the shell needs it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Role {
    pub term: u64,
    /// This replica is the leader.
    pub leader: bool,
    /// The leader this replica knows of (0: none).
    pub leader_id: u64,
}

/// What one Ready asks of the shell, in this order: send `messages`, apply `committed` (then
/// [`Replica::applied_to`]); the record was already appended through the [`RecordSink`].
#[derive(Debug, Default)]
pub struct Work {
    pub messages: Vec<Message>,
    pub committed: Vec<Entry>,
    pub role: Option<Role>,
    /// A snapshot from the leader to install before anything else. Its records are not in
    /// the log yet: the shell installs it, makes the state machine durable, appends `deferred`
    /// in order and then calls [`Replica::snapshot_written`] (so a crash in between leaves the
    /// old state, never a log that starts past the state machine).
    pub snapshot: Option<Snapshot>,
    pub deferred: Vec<RaftRecord>,
}

/// A Ready appended to the log and not yet durable.
struct Pending {
    number: u64,
    /// The record's sequence number; `None` when the Ready had nothing to persist.
    seq: Option<u64>,
    /// A snapshot's Ready, waiting for [`Replica::snapshot_written`].
    blocked: bool,
    /// A snapshot's Ready (until it is persisted; see [`Replica::installing_snapshot`]).
    snapshot: bool,
    messages: Vec<Message>,
}

/// Why a proposal was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    #[error("not the leader (leader: {leader:?})")]
    NotLeader { leader: Option<u64> },
    #[error("the proposal was dropped by the raft core")]
    Dropped,
    #[error("another membership change is in progress in this shard")]
    ChangeInProgress,
}

/// One follower's progress, as the leader sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FollowerStatus {
    pub id: u64,
    pub matched: u64,
}

/// A replica's figures for `pinq cluster status` and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplicaStatus {
    pub id: u64,
    pub term: u64,
    pub leader_id: u64,
    pub is_leader: bool,
    pub serving: bool,
    pub commit: u64,
    pub applied: u64,
    pub first_index: u64,
    pub last_index: u64,
    pub followers: Vec<FollowerStatus>,
}

pub struct Replica {
    node: RawNode<RaftLog>,
    unpersisted: VecDeque<Pending>,
    leadership: Leadership,
    /// Ticks left of the quiet period after a (re)start, during which vote requests are
    /// ignored (see the module docs).
    quiet_ticks: usize,
    applied: u64,
    last_role: Role,
    /// State of the seeded generator of election timeouts, once
    /// [`Replica::seed_election_timeouts`] was called (else the raft core draws them itself).
    election_seed: Option<u64>,
    /// A member added at run time that holds nothing yet (no membership at all): it takes its
    /// first state from a snapshot, never from entries (see [`Replica::step`]).
    awaiting_snapshot: bool,
}

impl Replica {
    /// A replica over a recovered `log`, whose state machine holds everything through `applied`.
    pub fn new(
        config: &ReplicaConfig,
        mut log: RaftLog,
        applied: u64,
        logger: &slog::Logger,
    ) -> Result<Replica, raft::Error> {
        log.note_applied(applied);
        let applied = applied.min(log.hard_state().commit);
        log.start_at(applied);
        let raft_config = raft::Config {
            id: config.id,
            election_tick: config.election_ticks,
            heartbeat_tick: config.heartbeat_ticks,
            applied,
            max_size_per_msg: config.max_message_bytes,
            max_inflight_msgs: config.max_inflight_messages,
            check_quorum: true,
            pre_vote: true,
            ..raft::Config::default()
        };
        raft_config.validate()?;
        let node = RawNode::new(&raft_config, log, logger)?;
        let last_role = Role {
            term: node.raft.term,
            leader: false,
            leader_id: 0,
        };
        let leadership = Leadership::new(LeadershipConfig {
            id: config.id,
            voters: config.voters.clone(),
            lease_ms: config.lease_ms,
        });
        let awaiting_snapshot = is_empty_conf(node.store().conf_state());
        let mut replica = Replica {
            node,
            unpersisted: VecDeque::new(),
            leadership,
            quiet_ticks: config.election_ticks,
            applied,
            last_role,
            election_seed: None,
            awaiting_snapshot,
        };
        if awaiting_snapshot {
            // Any index past 0: the first leader that reaches it is asked for a snapshot.
            replica.node.raft.pending_request_snapshot = 1;
        }
        replica.sync_leadership_voters();
        replica.observe();
        Ok(replica)
    }

    /// The leadership core counts the lease among the voters of the membership in force (both
    /// halves of a joint one).
    fn sync_leadership_voters(&mut self) {
        let cs = self.node.store().conf_state();
        self.leadership
            .set_voters(cs.voters.clone(), cs.voters_outgoing.clone());
    }

    /// The membership in force (as applied here).
    pub fn conf_state(&self) -> &ConfState {
        self.node.store().conf_state()
    }

    /// Whether this replica is still waiting for its first state (a member added at run
    /// time before its first snapshot).
    pub fn awaiting_snapshot(&self) -> bool {
        self.awaiting_snapshot
    }

    /// Proposes a membership change (joint consensus when it changes more than one voter;
    /// raft leaves the joint configuration by itself). `context` travels with the entry.
    /// Refused while another change is in progress, the group is in a joint configuration, or
    /// this replica does not serve.
    pub fn propose_conf_change(
        &mut self,
        change: ConfChangeV2,
        context: Vec<u8>,
    ) -> Result<(u64, u64), ProposeError> {
        if !self.serving() {
            let leader = self.node.raft.leader_id;
            return Err(ProposeError::NotLeader {
                leader: (leader != 0 && leader != self.node.raft.id).then_some(leader),
            });
        }
        if self.node.raft.has_pending_conf() || !self.conf_state().voters_outgoing.is_empty() {
            return Err(ProposeError::ChangeInProgress);
        }
        self.node
            .propose_conf_change(context, change)
            .map_err(|_| ProposeError::Dropped)?;
        Ok((self.node.raft.term, self.node.raft.raft_log.last_index()))
    }

    /// Applies a committed configuration change (every replica, in log order): the raft core
    /// takes it, and the membership in force from `entry.index` on is returned for the shell to
    /// make durable ([`RaftRecord::Conf`]).
    pub fn apply_conf_change(&mut self, entry: &Entry) -> Result<ConfState, raft::Error> {
        let change = decode_conf_change(entry)?;
        let cs = self.node.apply_conf_change(&change)?;
        self.node.mut_store().note_conf(entry.index, cs.clone());
        self.sync_leadership_voters();
        self.observe();
        Ok(cs)
    }

    /// Feeds the leadership core the raft core's state (after anything that may change it).
    fn observe(&mut self) {
        let raft = &self.node.raft;
        self.leadership.observe(RaftState {
            term: raft.term,
            leader: raft.state == StateRole::Leader,
            applied: self.applied,
            last_index: raft.raft_log.last_index(),
        });
    }

    /// Draws every later election timeout from a generator seeded with `seed` instead of the
    /// raft core's `thread_rng`, so a simulation replays a seed exactly (randomness is
    /// injected). The range is the core's own, `[election_ticks, 2 × election_ticks)`.
    pub fn seed_election_timeouts(&mut self, seed: u64) {
        self.election_seed = Some(seed);
        self.draw_election_timeout();
    }

    /// The core redraws its election timeout in `reset`, which runs only when the term or the
    /// role changes (`become_follower`/`candidate`/`leader`). So a change of either across a
    /// call is when to draw ours over it: never less often than the core (entering
    /// pre-candidacy also redraws, which is harmless), so none of its draws survives.
    fn redraw_if_reset(&mut self, before: (u64, StateRole)) {
        if self.election_seed.is_some() && before != self.term_and_state() {
            self.draw_election_timeout();
        }
    }

    fn draw_election_timeout(&mut self) {
        let Some(state) = self.election_seed.as_mut() else {
            return;
        };
        // splitmix64: small, and good enough to spread timeouts.
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let min = self.node.raft.election_timeout();
        let ticks = min + (z % min as u64) as usize;
        self.node.raft.set_randomized_election_timeout(ticks);
    }

    fn term_and_state(&self) -> (u64, StateRole) {
        (self.node.raft.term, self.node.raft.state)
    }

    pub fn tick(&mut self) {
        if self.installing_snapshot() {
            return;
        }
        let before = self.term_and_state();
        self.quiet_ticks = self.quiet_ticks.saturating_sub(1);
        self.node.tick();
        self.redraw_if_reset(before);
        self.observe();
    }

    /// Takes a message from a peer. Messages for another group member, or stale ones, are
    /// dropped by the core (Raft tolerates loss); so are vote requests during the quiet
    /// period after a (re)start.
    pub fn step(&mut self, message: Message) -> Result<(), raft::Error> {
        if self.quiet_ticks > 0 && asks_for_vote(&message, self.node.raft.term) {
            return Ok(());
        }
        if self.installing_snapshot() && message.get_msg_type() == MessageType::MsgTimeoutNow {
            return Ok(());
        }
        let before = self.term_and_state();
        let rejected_by = (message.get_msg_type() == MessageType::MsgAppendResponse
            && message.reject)
            .then_some(message.from);
        self.leadership.on_message(&message);
        let result = self.node.step(message);
        if let Some(follower) = rejected_by {
            self.keep_next_past_match(follower);
        }
        self.redraw_if_reset(before);
        self.observe();
        result
    }

    /// Stamps this leader's outgoing heartbeats with their send time, `now_ms` (the shell calls
    /// it on every batch of messages just before the transport takes them; see
    /// [`Leadership::stamp`]).
    pub fn stamp(&mut self, now_ms: u64, messages: &mut [Message]) {
        self.leadership.stamp(now_ms, messages);
    }

    /// Whether this replica may hand out a copy at `now_ms`: it serves and holds its lease.
    pub fn may_hand_out(&self, now_ms: u64) -> bool {
        self.leadership.may_hand_out(now_ms)
    }

    /// Until when this leader's lease holds (see [`Leadership::lease_until_ms`]).
    pub fn lease_until_ms(&self) -> Option<u64> {
        self.leadership.lease_until_ms()
    }

    /// The shell's driver stopped: this replica never serves again.
    pub fn fail(&mut self) {
        self.leadership.fail();
    }

    /// The highest index known committed, and its term (`None` if compacted away).
    pub fn committed(&self) -> (u64, Option<u64>) {
        let commit = self.node.raft.raft_log.committed;
        (commit, self.log().entry_term(commit))
    }

    /// After a rejected append: raft-rs 0.7 lowers a probed follower's next index to
    /// `min(rejected, hint + 1)` without the floor etcd's raft has (`max(…, match + 1)`,
    /// `tracker/progress.go`), so a late or duplicated rejection can put it at or below what the
    /// follower is known to hold. With the whole log that only resends entries; once the log is
    /// compacted through the follower's match, the leader wants a snapshot (which `RaftLog`
    /// cannot build), sends nothing more, and the follower never catches up. Found by
    /// `tests/cluster_sim.rs` (compaction, seed 34).
    fn keep_next_past_match(&mut self, follower: u64) {
        if self.node.raft.state != StateRole::Leader {
            return;
        }
        let Some(progress) = self.node.raft.mut_prs().get_mut(follower) else {
            return;
        };
        if progress.next_idx <= progress.matched {
            progress.next_idx = progress.matched + 1;
            self.node.raft.send_append(follower);
        }
    }

    /// Starts an election now (tests, and a leader transfer later).
    pub fn campaign(&mut self) -> Result<(), raft::Error> {
        let before = self.term_and_state();
        let result = self.node.campaign();
        self.redraw_if_reset(before);
        self.observe();
        result
    }

    /// Appends `data` (an encoded command) as a new entry; returns its term and index. Only a
    /// serving leader takes proposals.
    pub fn propose(&mut self, data: Vec<u8>) -> Result<(u64, u64), ProposeError> {
        if !self.serving() {
            let leader = self.node.raft.leader_id;
            return Err(ProposeError::NotLeader {
                leader: (leader != 0 && leader != self.node.raft.id).then_some(leader),
            });
        }
        self.node
            .propose(Vec::new(), data)
            .map_err(|_| ProposeError::Dropped)?;
        Ok((self.node.raft.term, self.node.raft.raft_log.last_index()))
    }

    /// Leader of its term, caught up with every earlier term, neither handing over nor failed
    /// (see [`Leadership::serving`]).
    pub fn serving(&self) -> bool {
        self.leadership.serving()
    }

    pub fn role(&self) -> Role {
        Role {
            term: self.node.raft.term,
            leader: self.node.raft.state == StateRole::Leader,
            leader_id: self.node.raft.leader_id,
        }
    }

    pub fn has_work(&self) -> bool {
        self.node.has_ready()
    }

    /// Turns the next Ready into work; its record (if any) is appended through `sink` first.
    pub fn next_work<S: RecordSink>(&mut self, sink: &mut S) -> Result<Option<Work>, S::Error> {
        if !self.node.has_ready() {
            return Ok(None);
        }
        let mut rd = self.node.ready();
        let mut work = Work {
            messages: rd.take_messages(),
            ..Work::default()
        };
        if !rd.snapshot().is_empty() {
            let snapshot = rd.snapshot().clone();
            let meta = snapshot.get_metadata();
            self.node.mut_store().reset_to(meta.index, meta.term);
            let conf = meta.get_conf_state().clone();
            self.node.mut_store().note_conf(meta.index, conf);
            self.sync_leadership_voters();
            self.awaiting_snapshot = false;
            work.snapshot = Some(snapshot);
        }
        let entries = rd.take_entries();
        let hard_state = rd.hs().cloned();
        let vote_changed = hard_state.as_ref().is_some_and(|hs| {
            let old = self.node.store().hard_state();
            hs.term != old.term || hs.vote != old.vote
        });
        let current_hs = || {
            hard_state
                .clone()
                .unwrap_or_else(|| self.node.store().hard_state().clone())
        };
        if let Some(s) = &work.snapshot {
            // Written by the shell once the snapshot is installed (see `Work::snapshot`).
            work.deferred.push(RaftRecord::Checkpoint {
                index: s.get_metadata().index,
                term: s.get_metadata().term,
                hard_state: current_hs(),
                conf: Some(s.get_metadata().get_conf_state().clone()),
            });
        }
        let record = if !entries.is_empty() {
            Some(RaftRecord::Entries {
                hard_state: current_hs(),
                entries,
            })
        } else if vote_changed && work.snapshot.is_none() {
            Some(RaftRecord::HardState(current_hs()))
        } else {
            None
        };
        if let Some(RaftRecord::Entries { entries, .. }) = &record {
            // Appended to the raft core's storage before `advance_append_async`, as the core
            // reads entries back from there.
            let _ = self.node.mut_store().append(entries);
        }
        let blocked = work.snapshot.is_some();
        let seq = match record {
            Some(record) if blocked => {
                work.deferred.push(record);
                None
            }
            Some(record) => Some(sink.append(&record)?),
            None => None,
        };
        if let Some(hs) = hard_state {
            self.node.mut_store().set_hard_state(hs);
        }
        work.committed = rd.take_committed_entries();
        let persisted_messages = rd.take_persisted_messages();
        let number = rd.number();
        self.node.advance_append_async(rd);
        self.unpersisted.push_back(Pending {
            number,
            seq,
            blocked,
            snapshot: blocked,
            messages: persisted_messages,
        });
        // A Ready with nothing to write is persisted as soon as those before it are.
        work.messages.extend(self.release_persisted(None));
        work.role = self.note_role();
        Ok(Some(work))
    }

    /// The log is durable through `synced_seq`: reports the Readies it covers persisted and
    /// returns the messages that waited for them.
    pub fn durable(&mut self, synced_seq: u64) -> Vec<Message> {
        self.release_persisted(Some(synced_seq))
    }

    fn release_persisted(&mut self, synced_seq: Option<u64>) -> Vec<Message> {
        let mut messages = Vec::new();
        let mut last = None;
        while let Some(front) = self.unpersisted.front() {
            if front.blocked {
                break;
            }
            let done = match front.seq {
                None => true,
                Some(seq) => synced_seq.is_some_and(|synced| seq <= synced),
            };
            if !done {
                break;
            }
            if let Some(p) = self.unpersisted.pop_front() {
                last = Some(p.number);
                messages.extend(p.messages);
            }
        }
        if let Some(number) = last {
            self.node.on_persist_ready(number);
            // A persisted snapshot is applied: the core's applied index follows (it may only
            // once the snapshot is persisted), or it would look for entries the snapshot
            // replaced.
            let log = &self.node.raft.raft_log;
            let to = self.applied.min(log.persisted).min(log.committed);
            if to > log.applied {
                self.node.advance_apply_to(to);
            }
        }
        messages
    }

    /// A snapshot was taken from the raft core and is not persisted yet. Meanwhile the core's
    /// log starts past its applied index, and a campaign would look for the entries between
    /// (raft-rs panics: "unexpected error getting unapplied entries ... Compacted"), so this
    /// replica neither ticks nor takes a leader's transfer until then. Found by
    /// `tests/cluster_sim.rs` (snapshots, seed 34).
    fn installing_snapshot(&self) -> bool {
        self.unpersisted.iter().any(|p| p.snapshot)
    }

    /// The shell installed the snapshot of the oldest blocked Ready and wrote its records up
    /// to `seq`: it is persisted once `seq` is durable.
    pub fn snapshot_written(&mut self, index: u64, seq: u64) {
        if let Some(p) = self.unpersisted.iter_mut().find(|p| p.blocked) {
            p.blocked = false;
            p.seq = Some(seq);
        }
        if index > self.applied {
            self.applied = index;
        }
        self.observe();
    }

    /// Whether the raft core asked for a snapshot to send a follower (and forgets the ask).
    pub fn snapshot_wanted(&self) -> bool {
        self.log().take_snapshot_wanted()
    }

    /// Where a snapshot built now stands: the applied index, its term and the membership.
    pub fn snapshot_point(&self) -> Option<(u64, u64, raft::eraftpb::ConfState)> {
        let index = self.applied;
        let term = self.log().entry_term(index)?;
        Some((index, term, self.log().conf_state().clone()))
    }

    /// Offers a built snapshot to the raft core (taken at its next ask).
    pub fn offer_snapshot(&mut self, snapshot: Snapshot) {
        self.node.mut_store().set_prepared(Some(snapshot));
    }

    /// The snapshot sent to `follower` was handed to the transport: the leader probes it from
    /// the snapshot's index on (if it was lost, the follower rejects and asks again).
    pub fn snapshot_sent(&mut self, follower: u64) {
        self.node
            .report_snapshot(follower, raft::SnapshotStatus::Finish);
    }

    /// The sequence number of the oldest record not yet reported durable.
    pub fn oldest_unpersisted_seq(&self) -> Option<u64> {
        self.unpersisted.iter().find_map(|p| p.seq)
    }

    /// The shell applied every committed entry through `index`.
    pub fn applied_to(&mut self, index: u64) {
        if index > self.applied {
            self.applied = index;
            self.node.advance_apply_to(index);
        }
        self.observe();
    }

    pub fn applied(&self) -> u64 {
        self.applied
    }

    fn note_role(&mut self) -> Option<Role> {
        self.observe();
        let role = self.role();
        if role == self.last_role {
            return None;
        }
        self.last_role = role;
        Some(role)
    }

    /// While leader: the index of this term's first entry (it serves once that is applied).
    pub fn leader_start(&self) -> Option<u64> {
        self.leadership.term_start()
    }

    /// Drops log entries through `index` (the state machine has them on disk and every follower
    /// has them, or is beyond the retention bound). Returns the new compaction point.
    pub fn compact_to(&mut self, index: u64) -> Result<(u64, u64), String> {
        let index = index.min(self.applied);
        self.node.mut_store().compact_to(index)?;
        Ok(self.node.store().base())
    }

    pub fn log(&self) -> &RaftLog {
        self.node.store()
    }

    /// Leader only: asks the most up-to-date follower to take over at once (a graceful
    /// shutdown hands leadership over instead of leaving the group to an election timeout).
    /// Returns the follower asked, if any.
    pub fn transfer_leadership(&mut self) -> Option<u64> {
        if self.node.raft.state != StateRole::Leader {
            return None;
        }
        // Among voters only: raft ignores a transfer to a learner.
        let voters = self.conf_state().voters.clone();
        let to = self
            .status()
            .followers
            .iter()
            .filter(|f| voters.contains(&f.id))
            .max_by_key(|f| f.matched)?
            .id;
        // The transferee campaigns without waiting out this leader's lease.
        self.leadership.transfer_started();
        self.node.transfer_leader(to);
        self.observe();
        Some(to)
    }

    /// The lowest index every follower has (the leader's view), or `None` when not leader.
    pub fn min_follower_match(&self) -> Option<u64> {
        let progress = self.node.status().progress?;
        progress
            .iter()
            .filter(|(id, _)| **id != self.node.raft.id)
            .map(|(_, p)| p.matched)
            .min()
    }

    pub fn status(&self) -> ReplicaStatus {
        let status = self.node.status();
        let followers = status
            .progress
            .map(|p| {
                let mut f: Vec<FollowerStatus> = p
                    .iter()
                    .filter(|(id, _)| **id != status.id)
                    .map(|(id, p)| FollowerStatus {
                        id: *id,
                        matched: p.matched,
                    })
                    .collect();
                f.sort_by_key(|f| f.id);
                f
            })
            .unwrap_or_default();
        ReplicaStatus {
            id: status.id,
            term: status.hs.term,
            leader_id: status.ss.leader_id,
            is_leader: status.ss.raft_state == StateRole::Leader,
            serving: self.serving(),
            commit: status.hs.commit,
            applied: self.applied,
            first_index: self.log().first_index(),
            last_index: self.log().last_index(),
            followers,
        }
    }
}

/// No voter and no learner: a member added at run time that has not received its first
/// snapshot (see [`Replica::awaiting_snapshot`]).
pub fn is_empty_conf(cs: &ConfState) -> bool {
    cs.voters.is_empty()
        && cs.learners.is_empty()
        && cs.voters_outgoing.is_empty()
        && cs.learners_next.is_empty()
}

/// A committed configuration change entry as the `ConfChangeV2` raft applies.
pub fn decode_conf_change(entry: &Entry) -> Result<ConfChangeV2, raft::Error> {
    use protobuf::Message as _;
    match entry.get_entry_type() {
        EntryType::EntryConfChangeV2 => Ok(ConfChangeV2::parse_from_bytes(&entry.data)?),
        EntryType::EntryConfChange => {
            // pinq proposes only V2 changes; a V1 one reads as the one change it makes.
            let v1 = raft::eraftpb::ConfChange::parse_from_bytes(&entry.data)?;
            let mut single = raft::eraftpb::ConfChangeSingle {
                node_id: v1.node_id,
                ..Default::default()
            };
            single.set_change_type(v1.get_change_type());
            let mut v2 = ConfChangeV2::default();
            v2.mut_changes().push(single);
            v2.context = v1.context;
            Ok(v2)
        }
        EntryType::EntryNormal => Err(raft::Error::ConfChangeError(format!(
            "entry {} is not a configuration change",
            entry.index
        ))),
    }
}

/// Whether a committed entry changes the membership.
pub fn is_conf_change(entry: &Entry) -> bool {
    entry.get_entry_type() != EntryType::EntryNormal
}

/// A request for a vote (or pre-vote) in a term past `term`: what the quiet period ignores.
fn asks_for_vote(message: &Message, term: u64) -> bool {
    matches!(
        message.get_msg_type(),
        MessageType::MsgRequestVote | MessageType::MsgRequestPreVote
    ) && message.term > term
}

/// Whether a committed entry carries a command (the leader's empty entry of a new term and
/// configuration changes do not).
pub fn carries_command(entry: &Entry) -> bool {
    entry.get_entry_type() == EntryType::EntryNormal && !entry.data.is_empty()
}

/// A logger for the raft core that drops everything (pinq logs through `tracing`).
pub fn quiet_logger() -> slog::Logger {
    slog::Logger::root(slog::Discard, slog::o!())
}
