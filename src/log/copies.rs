//! Copy records: the durable state of one group's copy of a message (pure codec).
//!
//! The in-flight table lives in memory, so without these a restart or a change of leader would
//! forget two things a consumer relies on: that a group ACKed a message other groups still hold
//! (the group would get it again), and how often a copy was delivered (`attempt` would start
//! again at 1 and `maxDeliveries` would count from zero). A [`CopyRecord`] keeps both, under a
//! metadata key of its own, written by [`crate::log::Command::Copies`] (kind 4):
//!
//! ```text
//! key   = 0x8000_0000_0000_0020 u64 BE | event key[24] | group u64 BE       (40 bytes)
//! value = version u8 (1) | attempts u32 LE | flags u8 (1 = the group ACKed the copy)
//! ```
//!
//! `group` is [`group_hash`] of the group's name; the event key names the topic. Records are
//! written only for groups: a universal consumer's copies end with its connection, so nothing
//! of them needs to outlive a restart. A record is written when a copy goes back for redelivery
//! (its attempts so far, before the redelivery is handed out) and when a `durable` ACK leaves
//! other copies of the message open; it is deleted in the same command that deletes its message.
//! The key's first u64 has its top bit set, so it never parses as an event key: the dispatcher,
//! the janitor and the table checks skip it. Bytes read back are untrusted: decoding checks
//! every length.

use crate::key::{EventKey, Key, EVENT_KEY_LEN};

/// First u64 of every copy record's key.
pub const COPY_KEY_PREFIX: u64 = 0x8000_0000_0000_0020;

/// Bytes of a copy record's key.
pub const COPY_KEY_LEN: usize = 8 + EVENT_KEY_LEN + 8;

/// Bytes of an encoded record in a command: key, group, attempts, flags.
pub const COPY_RECORD_BYTES: usize = EVENT_KEY_LEN + 8 + 4 + 1;

const VALUE_VERSION: u8 = 1;
const FLAG_ACKED: u8 = 1;

/// Which copy: a message and one group of its topic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CopyId {
    pub key: EventKey,
    pub group: u64,
}

/// The durable state of one group's copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRecord {
    pub id: CopyId,
    /// Deliveries of the copy so far (its next delivery is `attempts + 1`).
    pub attempts: u32,
    /// The group ACKed the copy: it is never delivered to the group again.
    pub acked: bool,
}

/// Why bytes are not a copy record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("copy record malformed: {what}")]
pub struct CopyRecordError {
    pub what: &'static str,
}

/// The persisted hash of a group name (`xxh3`, seed 0, as group policies use).
pub fn group_hash(group: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(group.as_bytes(), 0)
}

impl CopyId {
    /// The store key of this copy's record.
    pub fn store_key(&self) -> Key {
        let mut key = Key::new();
        key.extend_from_slice(&COPY_KEY_PREFIX.to_be_bytes());
        key.extend_from_slice(self.key.as_bytes());
        key.extend_from_slice(&self.group.to_be_bytes());
        key
    }

    /// The copy a store key names; `None` for a key that is not a copy record's.
    pub fn from_store_key(key: &[u8]) -> Option<CopyId> {
        if key.len() != COPY_KEY_LEN || key[0..8] != COPY_KEY_PREFIX.to_be_bytes() {
            return None;
        }
        let event = EventKey::parse(&key[8..8 + EVENT_KEY_LEN]).ok()?;
        let group = u64::from_be_bytes(key[8 + EVENT_KEY_LEN..].try_into().ok()?);
        Some(CopyId { key: event, group })
    }
}

/// The key range `[start, end)` that holds every copy record.
pub fn copy_key_range() -> (Key, Key) {
    let bound = |prefix: u64| Key::from_slice(&prefix.to_be_bytes());
    (bound(COPY_KEY_PREFIX), bound(COPY_KEY_PREFIX + 1))
}

impl CopyRecord {
    /// The record's store value.
    pub fn to_value(&self) -> [u8; 6] {
        let mut out = [0u8; 6];
        out[0] = VALUE_VERSION;
        out[1..5].copy_from_slice(&self.attempts.to_le_bytes());
        out[5] = if self.acked { FLAG_ACKED } else { 0 };
        out
    }

    /// A record read back from the store (`key`, `value`).
    pub fn from_row(key: &[u8], value: &[u8]) -> Result<CopyRecord, CopyRecordError> {
        let id = CopyId::from_store_key(key).ok_or(CopyRecordError { what: "key" })?;
        let [version, a0, a1, a2, a3, flags] = value else {
            return Err(CopyRecordError {
                what: "value length",
            });
        };
        if *version != VALUE_VERSION {
            return Err(CopyRecordError { what: "version" });
        }
        if flags & !FLAG_ACKED != 0 {
            return Err(CopyRecordError { what: "flags" });
        }
        Ok(CopyRecord {
            id,
            attempts: u32::from_le_bytes([*a0, *a1, *a2, *a3]),
            acked: flags & FLAG_ACKED != 0,
        })
    }

    /// Appends the record's command encoding: key, group, attempts, flags.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.id.key.as_bytes());
        out.extend_from_slice(&self.id.group.to_le_bytes());
        out.extend_from_slice(&self.attempts.to_le_bytes());
        out.push(if self.acked { FLAG_ACKED } else { 0 });
    }

    /// Decodes one record of [`COPY_RECORD_BYTES`] bytes.
    pub fn decode(bytes: &[u8]) -> Result<CopyRecord, CopyRecordError> {
        if bytes.len() != COPY_RECORD_BYTES {
            return Err(CopyRecordError {
                what: "record length",
            });
        }
        let key = EventKey::parse(&bytes[..EVENT_KEY_LEN])
            .map_err(|_| CopyRecordError { what: "event key" })?;
        let &[g0, g1, g2, g3, g4, g5, g6, g7, a0, a1, a2, a3, flags] = &bytes[EVENT_KEY_LEN..]
        else {
            return Err(CopyRecordError {
                what: "record length",
            });
        };
        let group = u64::from_le_bytes([g0, g1, g2, g3, g4, g5, g6, g7]);
        let attempts = u32::from_le_bytes([a0, a1, a2, a3]);
        if flags & !FLAG_ACKED != 0 {
            return Err(CopyRecordError { what: "flags" });
        }
        Ok(CopyRecord {
            id: CopyId { key, group },
            attempts,
            acked: flags & FLAG_ACKED != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TopicHash;

    fn record(acked: bool) -> CopyRecord {
        CopyRecord {
            id: CopyId {
                key: EventKey::new(TopicHash::of("orders"), 7, 42),
                group: group_hash("billing"),
            },
            attempts: 3,
            acked,
        }
    }

    #[test]
    fn a_record_round_trips_through_its_row_and_its_command_encoding() {
        for acked in [false, true] {
            let r = record(acked);
            let key = r.id.store_key();
            assert_eq!(key.len(), COPY_KEY_LEN);
            assert_eq!(CopyRecord::from_row(&key, &r.to_value()), Ok(r));
            let mut out = Vec::new();
            r.encode(&mut out);
            assert_eq!(out.len(), COPY_RECORD_BYTES);
            assert_eq!(CopyRecord::decode(&out), Ok(r));
        }
    }

    #[test]
    fn record_keys_sort_inside_their_range_and_never_parse_as_event_keys() {
        let (start, end) = copy_key_range();
        let key = record(false).id.store_key();
        assert!(start.as_slice() <= key.as_slice() && key.as_slice() < end.as_slice());
        assert!(EventKey::parse(&key).is_err());
        assert_eq!(CopyId::from_store_key(&key[..COPY_KEY_LEN - 1]), None);
    }

    #[test]
    fn damaged_values_are_refused() {
        let r = record(true);
        let key = r.id.store_key();
        let mut value = r.to_value();
        value[5] = 0x80;
        assert!(CopyRecord::from_row(&key, &value).is_err());
        let mut value = r.to_value();
        value[0] = 9;
        assert!(CopyRecord::from_row(&key, &value).is_err());
        assert!(CopyRecord::from_row(&key, &r.to_value()[..5]).is_err());
    }
}
