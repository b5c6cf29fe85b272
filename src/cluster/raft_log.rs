//! [`RaftLog`]: the Raft core's view of a shard's replicated log (pure, in memory).
//!
//! It holds what the WAL holds, as the `raft` crate's [`Storage`] reads it: the hard state, the
//! membership, the point the log was compacted to, and every entry after it. The shell
//! keeps the two in step: each [`RaftRecord`] it writes to the WAL it also applies here
//! ([`RaftLog::apply_record`]), and recovery rebuilds this state by applying the WAL's records in
//! order, so after a restart it is exactly what was written.
//!
//! Membership: the log keeps the membership in force at each index where it changed
//! ([`RaftRecord::Conf`], written when a configuration change is applied, and the membership a
//! checkpoint carries), from the compaction point on. The raft core starts from the membership
//! in force at the state machine's applied index ([`RaftLog::start_at`]): the configuration
//! changes committed after it are applied again, like every other entry. A log without any
//! membership record (written before membership changes existed) starts from the configured
//! `cluster.peers`.
//!
//! Memory: the entries kept are those not yet compacted, which the shell bounds by
//! `cluster.logRetainEntries` past the slowest follower and by the engine's flushed index.

use std::collections::VecDeque;

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use super::record::RaftRecord;

/// A shard's Raft log in memory. See the module docs.
#[derive(Debug, Default)]
pub struct RaftLog {
    hard_state: HardState,
    /// The membership the raft core starts from (see [`RaftLog::start_at`]).
    conf_state: ConfState,
    /// The membership in force from each index on, ascending; the first one is in force at
    /// the compaction point. Empty: no membership record was ever written (`conf_state` is
    /// the configured one).
    confs: Vec<(u64, ConfState)>,
    /// Index and term of the entry just before `entries` (the compaction point).
    base_index: u64,
    base_term: u64,
    entries: VecDeque<Entry>,
    entry_bytes: usize,
    /// A snapshot of the state machine the shell built for a follower that fell behind the
    /// compaction point (the raft core asks through `Storage::snapshot`, which cannot wait).
    prepared: Option<Snapshot>,
    /// The core asked for a snapshot and none was ready: the shell should build one.
    wanted: std::cell::Cell<bool>,
}

impl RaftLog {
    /// An empty log of a group with these voters.
    pub fn new(voters: Vec<u64>) -> RaftLog {
        let conf_state = ConfState {
            voters,
            ..ConfState::default()
        };
        RaftLog {
            conf_state,
            ..RaftLog::default()
        }
    }

    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    pub fn first_index(&self) -> u64 {
        self.base_index + 1
    }

    pub fn last_index(&self) -> u64 {
        self.base_index + self.entries.len() as u64
    }

    /// The compaction point: every entry at or below it is gone.
    pub fn base(&self) -> (u64, u64) {
        (self.base_index, self.base_term)
    }

    /// Entries held and their payload bytes (for metrics and bounds).
    pub fn held(&self) -> (usize, usize) {
        (self.entries.len(), self.entry_bytes)
    }

    /// The lowest index the log may be compacted to so that the entries after it hold at most
    /// `max_bytes` of payload (the bound on what a lagging follower can keep in memory).
    pub fn compact_point_for_bytes(&self, max_bytes: usize) -> u64 {
        let mut kept = 0usize;
        for e in self.entries.iter().rev() {
            kept += e.data.len();
            if kept > max_bytes {
                return e.index;
            }
        }
        self.base_index
    }

    pub fn entry_term(&self, index: u64) -> Option<u64> {
        if index == self.base_index {
            return Some(self.base_term);
        }
        self.entry(index).map(|e| e.term)
    }

    fn entry(&self, index: u64) -> Option<&Entry> {
        if index <= self.base_index {
            return None;
        }
        self.entries.get((index - self.base_index - 1) as usize)
    }

    /// Appends `entries` (consecutive), first cutting the log from their first index on if they
    /// overlap it (a conflicting tail). Entries that would leave a gap are refused.
    pub fn append(&mut self, entries: &[Entry]) -> Result<(), String> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        if first.index <= self.base_index {
            return Err(format!(
                "entries from {} overlap the compacted log (through {})",
                first.index, self.base_index
            ));
        }
        if first.index > self.last_index() + 1 {
            return Err(format!(
                "entries from {} leave a gap after the last entry {}",
                first.index,
                self.last_index()
            ));
        }
        self.truncate_from(first.index);
        for e in entries {
            self.entry_bytes += e.data.len();
            self.entries.push_back(e.clone());
        }
        Ok(())
    }

    fn truncate_from(&mut self, index: u64) {
        let keep = (index - self.base_index - 1) as usize;
        while self.entries.len() > keep {
            if let Some(e) = self.entries.pop_back() {
                self.entry_bytes -= e.data.len();
            }
        }
    }

    pub fn set_hard_state(&mut self, hard_state: HardState) {
        self.hard_state = hard_state;
    }

    /// Drops every entry at or below `index` (which must be held, or be the base already).
    pub fn compact_to(&mut self, index: u64) -> Result<(), String> {
        if index <= self.base_index {
            return Ok(());
        }
        let term = self
            .entry_term(index)
            .ok_or_else(|| format!("cannot compact to {index}: not in the log"))?;
        while self.entries.front().is_some_and(|e| e.index <= index) {
            if let Some(e) = self.entries.pop_front() {
                self.entry_bytes -= e.data.len();
            }
        }
        self.base_index = index;
        self.base_term = term;
        self.prune_confs(index);
        Ok(())
    }

    /// Whether the raft core asked for a snapshot none was ready for (and forgets the ask).
    pub fn take_snapshot_wanted(&self) -> bool {
        self.wanted.replace(false)
    }

    /// The snapshot the next `Storage::snapshot` call hands out.
    pub fn set_prepared(&mut self, snapshot: Option<Snapshot>) {
        self.prepared = snapshot;
    }

    pub fn prepared_index(&self) -> Option<u64> {
        self.prepared.as_ref().map(|s| s.get_metadata().index)
    }

    pub fn conf_state(&self) -> &ConfState {
        &self.conf_state
    }

    /// Whether any membership record was read or written.
    pub fn has_conf_record(&self) -> bool {
        !self.confs.is_empty()
    }

    /// Notes the membership in force from `index` on (a configuration change applied, a
    /// snapshot's or a checkpoint's membership); it replaces any noted at or after `index`
    /// (those were applied before a restart and are being applied again).
    pub fn note_conf(&mut self, index: u64, conf_state: ConfState) {
        self.confs.retain(|(at, _)| *at < index);
        self.confs.push((index, conf_state.clone()));
        self.conf_state = conf_state;
    }

    /// Notes the membership in force at `index` without forgetting later changes.
    fn insert_conf(&mut self, index: u64, conf_state: ConfState) {
        let at = self.confs.partition_point(|(i, _)| *i < index);
        if self.confs.get(at).is_some_and(|(i, _)| *i == index) {
            self.confs[at].1 = conf_state;
        } else {
            self.confs.insert(at, (index, conf_state));
        }
        if let Some((_, last)) = self.confs.last() {
            self.conf_state = last.clone();
        }
    }

    /// The membership in force at `index`: the last one noted at or below it (the configured
    /// one when none is).
    pub fn conf_at(&self, index: u64) -> ConfState {
        self.confs
            .iter()
            .rev()
            .find(|(at, _)| *at <= index)
            .or(self.confs.first())
            .map_or_else(|| self.conf_state.clone(), |(_, cs)| cs.clone())
    }

    /// After recovery: the raft core starts from the membership in force at `applied` (the
    /// state machine's index); the changes after it are applied again.
    pub fn start_at(&mut self, applied: u64) {
        if !self.confs.is_empty() {
            self.conf_state = self.conf_at(applied);
        }
    }

    /// Forgets the memberships superseded at or before `index` (the one in force there stays).
    fn prune_confs(&mut self, index: u64) {
        let in_force = self.confs.iter().rposition(|(at, _)| *at <= index);
        if let Some(keep_from) = in_force {
            self.confs.drain(..keep_from);
        }
    }

    /// Replaces the whole log with a snapshot's point: nothing at or below it is held, and the
    /// next entry is `index + 1`.
    pub fn reset_to(&mut self, index: u64, term: u64) {
        self.entries.clear();
        self.entry_bytes = 0;
        self.base_index = index;
        self.base_term = term;
    }

    /// Applies one record as read back from the WAL (recovery) or just written (the shell).
    pub fn apply_record(&mut self, record: &RaftRecord) -> Result<(), String> {
        match record {
            RaftRecord::Entries {
                hard_state,
                entries,
            } => {
                self.replay_entries(entries)?;
                self.merge_hard_state(hard_state);
            }
            RaftRecord::HardState(hard_state) => self.merge_hard_state(hard_state),
            RaftRecord::Checkpoint {
                index,
                term,
                hard_state,
                conf,
            } => {
                if *index > self.last_index() || *index < self.base_index {
                    // A snapshot's point past everything held (or a stale one): start there.
                    self.reset_to(*index, *term);
                } else if *index == self.base_index {
                    // Confirms a provisional base (see `replay_entries`).
                    self.base_term = *term;
                } else if self.entry_term(*index) == Some(*term) {
                    self.compact_to(*index)?;
                } else {
                    self.reset_to(*index, *term);
                }
                self.merge_hard_state(hard_state);
                if let Some(conf) = conf {
                    // In force at its index; changes after it (written before this checkpoint
                    // while the log was being compacted) stay.
                    self.insert_conf(*index, conf.clone());
                    self.prune_confs(self.base_index);
                }
            }
            RaftRecord::Conf { index, conf_state } => {
                self.note_conf(*index, conf_state.clone());
                // Written once the change was committed and applied: the log is committed at
                // least that far (hard states carry the commit index lazily, and a member
                // whose last change removed the others could not commit it again).
                let commit = self.hard_state.commit.max(*index).min(self.last_index());
                self.hard_state.commit = commit.max(self.hard_state.commit);
            }
        }
        Ok(())
    }

    /// Recovery's append: the WAL's oldest segments may have been dropped after a checkpoint
    /// (which comes later in the log), so the first entries read may start past the empty
    /// log's base — they set a provisional base the checkpoint then confirms — and entries at
    /// or below the base are already covered.
    fn replay_entries(&mut self, entries: &[Entry]) -> Result<(), String> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        if self.entries.is_empty() && first.index > self.base_index + 1 {
            self.reset_to(first.index - 1, 0);
        }
        let skip = entries
            .iter()
            .take_while(|e| e.index <= self.base_index)
            .count();
        self.append(&entries[skip..])
    }

    /// A later record's hard state wins; the commit index only moves forward (entries records
    /// carry it lazily), and never past the last entry.
    fn merge_hard_state(&mut self, hs: &HardState) {
        let commit = self.hard_state.commit.max(hs.commit).min(self.last_index());
        self.hard_state = hs.clone();
        self.hard_state.commit = commit.max(self.base_index);
    }

    /// After recovery: the engine holds everything through `applied`, so the log is committed at
    /// least that far.
    pub fn note_applied(&mut self, applied: u64) {
        let commit = self
            .hard_state
            .commit
            .max(applied)
            .min(self.last_index().max(self.base_index));
        self.hard_state.commit = commit;
    }
}

impl Storage for RaftLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(
            self.hard_state.clone(),
            self.conf_state.clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.base_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last_index() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let max = max_size.into().unwrap_or(u64::MAX);
        let mut out = Vec::new();
        let mut size = 0u64;
        for index in low..high {
            let Some(e) = self.entry(index) else { break };
            size += (e.data.len() + e.context.len() + 24) as u64;
            if !out.is_empty() && size > max {
                break;
            }
            out.push(e.clone());
        }
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx < self.base_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.entry_term(idx)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(RaftLog::first_index(self))
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(RaftLog::last_index(self))
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        // Snapshots are built by the shell (they read the engine, which takes awaits): until
        // one covering the request is ready, the core retries and the shell is asked to build.
        if let Some(snapshot) = &self.prepared {
            let index = snapshot.get_metadata().index;
            if index >= request_index && index >= self.base_index {
                return Ok(snapshot.clone());
            }
        }
        self.wanted.set(true);
        Err(raft::Error::Store(
            StorageError::SnapshotTemporarilyUnavailable,
        ))
    }
}

#[cfg(test)]
#[allow(clippy::field_reassign_with_default)]
mod tests {
    use super::*;

    fn conf(voters: &[u64]) -> ConfState {
        ConfState {
            voters: voters.to_vec(),
            ..ConfState::default()
        }
    }

    #[test]
    fn the_membership_in_force_follows_its_records_and_survives_compaction() {
        let mut log = RaftLog::new(vec![1, 2, 3]);
        assert!(!log.has_conf_record());
        let entries: Vec<Entry> = (1..=10).map(|i| entry(i, 1)).collect();
        log.apply_record(&RaftRecord::Conf {
            index: 0,
            conf_state: conf(&[1, 2, 3]),
        })
        .unwrap();
        log.apply_record(&RaftRecord::Entries {
            hard_state: HardState::default(),
            entries,
        })
        .unwrap();
        log.apply_record(&RaftRecord::Conf {
            index: 4,
            conf_state: conf(&[1, 2, 3, 4]),
        })
        .unwrap();
        log.apply_record(&RaftRecord::Conf {
            index: 8,
            conf_state: conf(&[1, 2, 4]),
        })
        .unwrap();
        assert_eq!(log.conf_at(3), conf(&[1, 2, 3]));
        assert_eq!(log.conf_at(4), conf(&[1, 2, 3, 4]));
        assert_eq!(log.conf_at(9), conf(&[1, 2, 4]));
        // The raft core starts from the membership at the state machine's index: the change
        // at 8 is applied again after a restart whose tables hold index 6.
        log.start_at(6);
        assert_eq!(log.conf_state(), &conf(&[1, 2, 3, 4]));
        // Applied again at 8 (a record with the same index replaces the older one).
        log.note_conf(8, conf(&[1, 2, 4]));
        assert_eq!(log.conf_state(), &conf(&[1, 2, 4]));
        // Compaction keeps the one in force at the new base, and what follows.
        log.compact_to(6).unwrap();
        assert_eq!(log.conf_at(6), conf(&[1, 2, 3, 4]));
        assert_eq!(log.conf_at(10), conf(&[1, 2, 4]));
        // A checkpoint carries the one in force at its index; a later change read before it
        // (written while the log was being compacted) stays.
        let mut replayed = RaftLog::new(vec![9]);
        replayed
            .apply_record(&RaftRecord::Conf {
                index: 8,
                conf_state: conf(&[1, 2, 4]),
            })
            .unwrap();
        replayed
            .apply_record(&RaftRecord::Checkpoint {
                index: 6,
                term: 1,
                hard_state: HardState::default(),
                conf: Some(conf(&[1, 2, 3, 4])),
            })
            .unwrap();
        assert_eq!(replayed.conf_at(7), conf(&[1, 2, 3, 4]));
        assert_eq!(replayed.conf_at(8), conf(&[1, 2, 4]));
        replayed.start_at(7);
        assert_eq!(replayed.conf_state(), &conf(&[1, 2, 3, 4]));
    }

    fn entry(index: u64, term: u64) -> Entry {
        let mut e = Entry::default();
        e.index = index;
        e.term = term;
        e.data = vec![index as u8; 10].into();
        e
    }

    fn hs(term: u64, commit: u64) -> HardState {
        let mut h = HardState::default();
        h.term = term;
        h.commit = commit;
        h
    }

    #[test]
    fn an_overlapping_append_replaces_the_conflicting_tail() {
        let mut log = RaftLog::new(vec![1, 2, 3]);
        log.append(&(1..=5).map(|i| entry(i, 1)).collect::<Vec<_>>())
            .unwrap();
        log.append(&[entry(4, 2), entry(5, 2), entry(6, 2)])
            .unwrap();
        assert_eq!(log.last_index(), 6);
        assert_eq!(log.entry_term(3), Some(1));
        assert_eq!(log.entry_term(4), Some(2));
        assert_eq!(log.held(), (6, 60));
        assert!(log.append(&[entry(9, 2)]).is_err(), "a gap is refused");
    }

    #[test]
    fn compaction_keeps_the_term_of_the_base() {
        let mut log = RaftLog::new(vec![1]);
        log.append(&(1..=5).map(|i| entry(i, i)).collect::<Vec<_>>())
            .unwrap();
        log.compact_to(3).unwrap();
        assert_eq!(log.first_index(), 4);
        assert_eq!(Storage::term(&log, 3).unwrap(), 3);
        assert!(Storage::term(&log, 2).is_err());
        assert!(log
            .entries(3, 5, None, GetEntriesContext::empty(false))
            .is_err());
        let got = log
            .entries(4, 6, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(got.iter().map(|e| e.index).collect::<Vec<_>>(), vec![4, 5]);
    }

    #[test]
    fn replaying_records_rebuilds_the_same_log() {
        let records = vec![
            RaftRecord::HardState(hs(1, 0)),
            RaftRecord::Entries {
                hard_state: hs(1, 2),
                entries: (1..=4).map(|i| entry(i, 1)).collect(),
            },
            RaftRecord::Entries {
                hard_state: hs(2, 3),
                entries: vec![entry(4, 2), entry(5, 2)],
            },
            RaftRecord::Checkpoint {
                index: 2,
                term: 1,
                hard_state: hs(2, 4),
                conf: None,
            },
        ];
        let mut log = RaftLog::new(vec![1, 2, 3]);
        for r in &records {
            log.apply_record(r).unwrap();
        }
        assert_eq!(log.base(), (2, 1));
        assert_eq!(log.last_index(), 5);
        assert_eq!(log.entry_term(4), Some(2));
        assert_eq!(log.hard_state().commit, 4);
        assert_eq!(log.hard_state().term, 2);
    }

    #[test]
    fn the_byte_bound_picks_the_point_that_keeps_at_most_that_much() {
        let mut log = RaftLog::new(vec![1]);
        log.append(&(1..=10).map(|i| entry(i, 1)).collect::<Vec<_>>())
            .unwrap();
        // Ten entries of 10 bytes: keeping at most 35 bytes keeps 8, 9 and 10.
        assert_eq!(log.compact_point_for_bytes(35), 7);
        assert_eq!(log.compact_point_for_bytes(1_000), 0);
        log.compact_to(log.compact_point_for_bytes(35)).unwrap();
        assert!(log.held().1 <= 35);
        assert_eq!(log.held(), (3, 30));
    }

    #[test]
    fn a_log_whose_first_segments_were_dropped_replays_from_its_checkpoint() {
        // Segments holding 1..=10 were removed after a checkpoint at 12 was written; what is
        // left starts with entries 11..=14, then the checkpoint, then more entries.
        let records = vec![
            RaftRecord::Entries {
                hard_state: hs(2, 10),
                entries: (11..=14).map(|i| entry(i, 2)).collect(),
            },
            RaftRecord::Checkpoint {
                index: 12,
                term: 2,
                hard_state: hs(2, 13),
                conf: None,
            },
            RaftRecord::Entries {
                hard_state: hs(2, 14),
                entries: vec![entry(15, 2)],
            },
        ];
        let mut log = RaftLog::new(vec![1, 2, 3]);
        for r in &records {
            log.apply_record(r).unwrap();
        }
        assert_eq!(log.base(), (12, 2));
        assert_eq!(log.last_index(), 15);
        assert_eq!(log.entry_term(13), Some(2));
    }

    #[test]
    fn a_checkpoint_at_the_provisional_base_confirms_its_term() {
        let mut log = RaftLog::new(vec![1]);
        log.apply_record(&RaftRecord::Entries {
            hard_state: hs(3, 0),
            entries: (21..=23).map(|i| entry(i, 3)).collect(),
        })
        .unwrap();
        log.apply_record(&RaftRecord::Checkpoint {
            index: 20,
            term: 3,
            hard_state: hs(3, 22),
            conf: None,
        })
        .unwrap();
        assert_eq!(log.base(), (20, 3));
        assert_eq!(log.last_index(), 23);
    }

    #[test]
    fn the_commit_index_never_goes_back_or_past_the_log() {
        let mut log = RaftLog::new(vec![1]);
        log.apply_record(&RaftRecord::Entries {
            hard_state: hs(1, 3),
            entries: (1..=3).map(|i| entry(i, 1)).collect(),
        })
        .unwrap();
        log.apply_record(&RaftRecord::HardState(hs(1, 1))).unwrap();
        assert_eq!(log.hard_state().commit, 3);
        log.apply_record(&RaftRecord::HardState(hs(1, 9))).unwrap();
        assert_eq!(log.hard_state().commit, 3);
    }
}
