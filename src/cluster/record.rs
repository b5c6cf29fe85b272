//! Records of the replicated log: what a shard's WAL holds in a cluster (pure codec).
//!
//! In a cluster the shard's WAL *is* its Raft log: every record is a [`RaftRecord`], framed and
//! checksummed by the WAL like a standalone command (`crate::log::wal`). The WAL's own sequence
//! numbers only order records; Raft indexes live inside them, so a conflicting tail is
//! truncated by appending, never by rewriting a file:
//!
//! ```text
//! record     = version u8 | kind u8 | body
//! entries    (kind 1) = hard_state | count u32 | entry*        a first index at or below the last
//! hard state (kind 2) = hard_state                              one replaces the log from there
//! checkpoint (kind 3) = index u64 | term u64 | hard_state       the log starts after `index`
//! conf       (kind 4) = index u64 | conf_state                  the membership from `index` on
//! checkpoint (kind 5) = index u64 | term u64 | hard_state | conf_state   kind 3 with the
//!                                                               membership in force at `index`
//! hard_state = term u64 | vote u64 | commit u64
//! conf_state = (count u32 | id u64*) × 4 (voters, learners, voters outgoing, learners next)
//!              | auto_leave u8
//! entry      = index u64 | term u64 | type u8 | data_len u32 | data | context_len u32 | context
//! ```
//!
//! All integers are little-endian. Decoding checks every length against the bytes present before
//! allocating and refuses trailing bytes: a record that decodes is whole.

use raft::eraftpb::{ConfState, Entry, EntryType, HardState};

use crate::log::wal::Payload;

/// Version of the encoding written today.
pub const RECORD_VERSION: u8 = 1;

const KIND_ENTRIES: u8 = 1;
const KIND_HARD_STATE: u8 = 2;
const KIND_CHECKPOINT: u8 = 3;
const KIND_CONF: u8 = 4;
const KIND_CHECKPOINT_CONF: u8 = 5;
const HARD_STATE_BYTES: usize = 24;
const ENTRY_FIXED_BYTES: usize = 8 + 8 + 1 + 4 + 4;

/// One record of a shard's replicated log.
#[derive(Clone, Debug, PartialEq)]
pub enum RaftRecord {
    /// Entries appended after the log's last one, or replacing its tail from their first index
    /// on (a conflicting tail from an old term), with the hard state at that time.
    Entries {
        hard_state: HardState,
        entries: Vec<Entry>,
    },
    /// The term or the vote changed (and must be on disk before the messages that follow it).
    HardState(HardState),
    /// The log starts after `index` (of term `term`): written before older segments are
    /// dropped, so the point the log was compacted to and the hard state survive them.
    ///
    /// `conf` is the membership in force at `index` (the group's `ConfState`); `None` in a
    /// checkpoint written before membership changes existed, or by `pinq cluster convert`,
    /// where the configured `cluster.peers` are the membership.
    Checkpoint {
        index: u64,
        term: u64,
        hard_state: HardState,
        conf: Option<ConfState>,
    },
    /// The membership in force from `index` on: written when a configuration change committed
    /// at `index` is applied (and at a log's creation, index 0, for the initial members), made
    /// durable before anything after it is applied.
    Conf { index: u64, conf_state: ConfState },
}

/// Why bytes are not a valid record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("raft record truncated at byte {at}")]
    Truncated { at: usize },
    #[error("raft record version {found} is not supported (this build writes {RECORD_VERSION})")]
    UnknownVersion { found: u8 },
    #[error("unknown raft record kind {found}")]
    UnknownKind { found: u8 },
    #[error("raft record malformed: {what}")]
    Malformed { what: &'static str },
}

impl RaftRecord {
    /// The highest Raft index this record holds (0 for one without entries).
    pub fn last_index(&self) -> u64 {
        match self {
            RaftRecord::Entries { entries, .. } => entries.last().map_or(0, Entry::get_index),
            RaftRecord::HardState(_) => 0,
            RaftRecord::Checkpoint { index, .. } => *index,
            RaftRecord::Conf { index, .. } => *index,
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<RaftRecord, RecordError> {
        let mut r = Reader { bytes, at: 0 };
        let version = r.u8()?;
        if version != RECORD_VERSION {
            return Err(RecordError::UnknownVersion { found: version });
        }
        let record = match r.u8()? {
            KIND_ENTRIES => {
                let hard_state = r.hard_state()?;
                let count = r.u32()? as usize;
                if count > r.remaining() / ENTRY_FIXED_BYTES {
                    return Err(RecordError::Malformed {
                        what: "entry count exceeds the record",
                    });
                }
                let mut entries = Vec::with_capacity(count);
                for _ in 0..count {
                    entries.push(r.entry()?);
                }
                if entries.windows(2).any(|w| w[1].index != w[0].index + 1) {
                    return Err(RecordError::Malformed {
                        what: "entry indexes are not consecutive",
                    });
                }
                RaftRecord::Entries {
                    hard_state,
                    entries,
                }
            }
            KIND_HARD_STATE => RaftRecord::HardState(r.hard_state()?),
            KIND_CHECKPOINT => RaftRecord::Checkpoint {
                index: r.u64()?,
                term: r.u64()?,
                hard_state: r.hard_state()?,
                conf: None,
            },
            KIND_CHECKPOINT_CONF => RaftRecord::Checkpoint {
                index: r.u64()?,
                term: r.u64()?,
                hard_state: r.hard_state()?,
                conf: Some(r.conf_state()?),
            },
            KIND_CONF => RaftRecord::Conf {
                index: r.u64()?,
                conf_state: r.conf_state()?,
            },
            found => return Err(RecordError::UnknownKind { found }),
        };
        if r.remaining() != 0 {
            return Err(RecordError::Malformed {
                what: "trailing bytes after the record",
            });
        }
        Ok(record)
    }
}

impl Payload for RaftRecord {
    fn encoded_len(&self) -> usize {
        2 + match self {
            RaftRecord::Entries { entries, .. } => {
                HARD_STATE_BYTES
                    + 4
                    + entries
                        .iter()
                        .map(|e| ENTRY_FIXED_BYTES + e.data.len() + e.context.len())
                        .sum::<usize>()
            }
            RaftRecord::HardState(_) => HARD_STATE_BYTES,
            RaftRecord::Checkpoint { conf, .. } => {
                16 + HARD_STATE_BYTES + conf.as_ref().map_or(0, conf_state_len)
            }
            RaftRecord::Conf { conf_state, .. } => 8 + conf_state_len(conf_state),
        }
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(RECORD_VERSION);
        match self {
            RaftRecord::Entries {
                hard_state,
                entries,
            } => {
                out.push(KIND_ENTRIES);
                put_hard_state(out, hard_state);
                out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
                for e in entries {
                    out.extend_from_slice(&e.index.to_le_bytes());
                    out.extend_from_slice(&e.term.to_le_bytes());
                    out.push(e.get_entry_type() as u8);
                    out.extend_from_slice(&(e.data.len() as u32).to_le_bytes());
                    out.extend_from_slice(&e.data);
                    out.extend_from_slice(&(e.context.len() as u32).to_le_bytes());
                    out.extend_from_slice(&e.context);
                }
            }
            RaftRecord::HardState(hard_state) => {
                out.push(KIND_HARD_STATE);
                put_hard_state(out, hard_state);
            }
            RaftRecord::Checkpoint {
                index,
                term,
                hard_state,
                conf,
            } => {
                out.push(if conf.is_some() {
                    KIND_CHECKPOINT_CONF
                } else {
                    KIND_CHECKPOINT
                });
                out.extend_from_slice(&index.to_le_bytes());
                out.extend_from_slice(&term.to_le_bytes());
                put_hard_state(out, hard_state);
                if let Some(conf) = conf {
                    put_conf_state(out, conf);
                }
            }
            RaftRecord::Conf { index, conf_state } => {
                out.push(KIND_CONF);
                out.extend_from_slice(&index.to_le_bytes());
                put_conf_state(out, conf_state);
            }
        }
    }
}

fn put_hard_state(out: &mut Vec<u8>, hs: &HardState) {
    out.extend_from_slice(&hs.term.to_le_bytes());
    out.extend_from_slice(&hs.vote.to_le_bytes());
    out.extend_from_slice(&hs.commit.to_le_bytes());
}

/// A membership's id lists in the order [`put_conf_state`] writes them.
fn conf_lists(cs: &ConfState) -> [&[u64]; 4] {
    [
        &cs.voters,
        &cs.learners,
        &cs.voters_outgoing,
        &cs.learners_next,
    ]
}

fn conf_state_len(cs: &ConfState) -> usize {
    conf_lists(cs)
        .iter()
        .map(|l| 4 + 8 * l.len())
        .sum::<usize>()
        + 1
}

/// `conf_state = (count u32 | id u64*){voters, learners, voters_outgoing, learners_next} |
/// auto_leave u8`.
fn put_conf_state(out: &mut Vec<u8>, cs: &ConfState) {
    for list in conf_lists(cs) {
        out.extend_from_slice(&(list.len() as u32).to_le_bytes());
        for id in list {
            out.extend_from_slice(&id.to_le_bytes());
        }
    }
    out.push(u8::from(cs.auto_leave));
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], RecordError> {
        if self.remaining() < n {
            return Err(RecordError::Truncated { at: self.at });
        }
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, RecordError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, RecordError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    fn hard_state(&mut self) -> Result<HardState, RecordError> {
        Ok(HardState {
            term: self.u64()?,
            vote: self.u64()?,
            commit: self.u64()?,
            ..HardState::default()
        })
    }

    fn ids(&mut self) -> Result<Vec<u64>, RecordError> {
        let count = self.u32()? as usize;
        if count > self.remaining() / 8 {
            return Err(RecordError::Malformed {
                what: "id count exceeds the record",
            });
        }
        (0..count).map(|_| self.u64()).collect()
    }

    fn conf_state(&mut self) -> Result<ConfState, RecordError> {
        let voters = self.ids()?;
        let learners = self.ids()?;
        let voters_outgoing = self.ids()?;
        let learners_next = self.ids()?;
        let auto_leave = match self.u8()? {
            0 => false,
            1 => true,
            _ => {
                return Err(RecordError::Malformed {
                    what: "auto_leave is neither 0 nor 1",
                })
            }
        };
        Ok(ConfState {
            voters,
            learners,
            voters_outgoing,
            learners_next,
            auto_leave,
            ..ConfState::default()
        })
    }

    fn entry(&mut self) -> Result<Entry, RecordError> {
        let mut e = Entry {
            index: self.u64()?,
            term: self.u64()?,
            ..Entry::default()
        };
        let kind = match self.u8()? {
            0 => EntryType::EntryNormal,
            1 => EntryType::EntryConfChange,
            2 => EntryType::EntryConfChangeV2,
            _ => {
                return Err(RecordError::Malformed {
                    what: "unknown entry type",
                })
            }
        };
        e.set_entry_type(kind);
        let len = self.u32()? as usize;
        e.data = self.take(len)?.to_vec().into();
        let len = self.u32()? as usize;
        e.context = self.take(len)?.to_vec().into();
        Ok(e)
    }
}

#[cfg(test)]
#[allow(clippy::field_reassign_with_default)]
mod tests {
    use super::*;

    fn hs(term: u64, vote: u64, commit: u64) -> HardState {
        let mut h = HardState::default();
        h.term = term;
        h.vote = vote;
        h.commit = commit;
        h
    }

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        let mut e = Entry::default();
        e.index = index;
        e.term = term;
        e.data = data.to_vec().into();
        e
    }

    fn bytes(record: &RaftRecord) -> Vec<u8> {
        let mut out = Vec::new();
        record.encode_into(&mut out);
        assert_eq!(out.len(), record.encoded_len());
        out
    }

    fn samples() -> Vec<RaftRecord> {
        vec![
            RaftRecord::Entries {
                hard_state: hs(3, 1, 7),
                entries: vec![
                    entry(8, 3, b"abc"),
                    entry(9, 3, b""),
                    entry(10, 3, &[7; 300]),
                ],
            },
            RaftRecord::HardState(hs(4, 2, 9)),
            RaftRecord::Checkpoint {
                index: 120,
                term: 4,
                hard_state: hs(5, 0, 130),
                conf: None,
            },
            RaftRecord::Checkpoint {
                index: 121,
                term: 4,
                hard_state: hs(5, 0, 130),
                conf: Some(ConfState {
                    voters: vec![1, 2, 4],
                    learners: vec![5],
                    voters_outgoing: vec![1, 2, 3],
                    learners_next: vec![3],
                    auto_leave: true,
                    ..ConfState::default()
                }),
            },
            RaftRecord::Conf {
                index: 122,
                conf_state: ConfState {
                    voters: vec![1, 2, 4],
                    ..ConfState::default()
                },
            },
        ]
    }

    #[test]
    fn every_kind_round_trips() {
        for record in samples() {
            assert_eq!(RaftRecord::decode(&bytes(&record)).unwrap(), record);
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        for record in samples() {
            let b = bytes(&record);
            for cut in 0..b.len() {
                assert!(RaftRecord::decode(&b[..cut]).is_err(), "cut at {cut}");
            }
        }
    }

    #[test]
    fn trailing_bytes_and_unknown_kinds_are_refused() {
        let mut b = bytes(&samples()[1]);
        b.push(0);
        assert!(matches!(
            RaftRecord::decode(&b),
            Err(RecordError::Malformed { .. })
        ));
        let mut b = bytes(&samples()[1]);
        b[1] = 9;
        assert_eq!(
            RaftRecord::decode(&b),
            Err(RecordError::UnknownKind { found: 9 })
        );
        b[0] = 2;
        assert_eq!(
            RaftRecord::decode(&b),
            Err(RecordError::UnknownVersion { found: 2 })
        );
    }

    #[test]
    fn a_lying_entry_count_is_refused_before_allocating() {
        let mut b = bytes(&samples()[0]);
        let at = 2 + HARD_STATE_BYTES;
        b[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(RaftRecord::decode(&b).is_err());
    }
}
