//! Remembered publish sequences: the durable half of idempotent publish (pure codec).
//!
//! A publish may carry a producer id and a sequence number per message. The shard leader
//! remembers each stored (producer, sequence) with the tag it was stored under
//! ([`crate::pipeline::dedup`]), and the same [`crate::log::Command`] that stores the message
//! writes a [`SequenceEntry`] through the engine, under a metadata key of its own, so the
//! memory survives restarts (WAL replay and tables alike) and replicates with the log:
//!
//! ```text
//! key   = 0x8000_0000_0000_0010 u64 BE | event_id u64 BE | 0 u64        (24 bytes)
//! value = version u8 (1) | producer_len u8 | producer | sequence u64 LE | tag[24] | stored_at_ms u64 LE
//! ```
//!
//! The key's first u64 has its top bit set, so it never parses as an event key: the dispatcher,
//! the janitor and the table checks skip it, and its value is never read as a message. The
//! event id is that of the original message's tag, unique on the shard, so every entry has its
//! own key and entries sort in publish order. Bytes read back are untrusted: decoding checks
//! every length.

use std::sync::Arc;

use crate::key::{EventKey, Key, EVENT_KEY_LEN};

/// First u64 of every sequence entry's key (the range `..10` and up belongs to idempotent
/// publish; `..01` and `..02` to dead letters).
pub const SEQUENCE_KEY_PREFIX: u64 = 0x8000_0000_0000_0010;

/// Longest producer id accepted, in bytes (its length is one byte in the encodings).
pub const PRODUCER_ID_LEN_MAX: usize = 255;

const ENTRY_VERSION: u8 = 1;

/// One remembered (producer, sequence): the message it stored and when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceEntry {
    pub producer: Arc<str>,
    pub sequence: u64,
    /// The tag of the message stored for it: the answer to a republish.
    pub tag: EventKey,
    /// Shard time of the store; the entry is forgotten `publish.dedupWindow` later.
    pub stored_at_ms: u64,
}

/// Why bytes are not a sequence entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sequence entry malformed: {what}")]
pub struct SequenceError {
    pub what: &'static str,
}

/// The store key of the entry whose original message has event id `event_id`.
pub fn sequence_key(event_id: u64) -> Key {
    let mut bytes = [0u8; EVENT_KEY_LEN];
    bytes[0..8].copy_from_slice(&SEQUENCE_KEY_PREFIX.to_be_bytes());
    bytes[8..16].copy_from_slice(&event_id.to_be_bytes());
    Key::from_buf(bytes)
}

/// The key range `[start, end)` that holds every sequence entry.
pub fn sequence_key_range() -> (Key, Key) {
    let mut end = [0u8; EVENT_KEY_LEN];
    end[0..8].copy_from_slice(&(SEQUENCE_KEY_PREFIX + 1).to_be_bytes());
    (sequence_key(0), Key::from_buf(end))
}

/// The event id a sequence entry's key names (the inverse of [`sequence_key`]); `None` for a
/// key that is not a sequence entry's.
pub fn sequence_key_event_id(key: &[u8]) -> Option<u64> {
    if !is_sequence_key(key) {
        return None;
    }
    key.get(8..16)?.try_into().ok().map(u64::from_be_bytes)
}

/// Whether a store key is a sequence entry's.
pub fn is_sequence_key(key: &[u8]) -> bool {
    key.len() == EVENT_KEY_LEN && key[0..8] == SEQUENCE_KEY_PREFIX.to_be_bytes()
}

impl SequenceEntry {
    /// Bytes [`SequenceEntry::encode_body`] appends.
    pub fn body_len(&self) -> usize {
        1 + self.producer.len() + 8 + EVENT_KEY_LEN + 8
    }

    /// Appends `producer_len u8 | producer | sequence | tag | stored_at_ms` (the command's form).
    pub fn encode_body(&self, out: &mut Vec<u8>) {
        debug_assert!(self.producer.len() <= PRODUCER_ID_LEN_MAX);
        out.push(self.producer.len() as u8);
        out.extend_from_slice(self.producer.as_bytes());
        out.extend_from_slice(&self.sequence.to_le_bytes());
        out.extend_from_slice(self.tag.as_bytes());
        out.extend_from_slice(&self.stored_at_ms.to_le_bytes());
    }

    /// Decodes one body from the front of `buf`; returns it and the bytes it took.
    pub fn decode_body(buf: &[u8]) -> Result<(SequenceEntry, usize), SequenceError> {
        let err = |what| SequenceError { what };
        let len = *buf.first().ok_or(err("producer length"))? as usize;
        let need = 1 + len + 8 + EVENT_KEY_LEN + 8;
        if buf.len() < need {
            return Err(err("entry truncated"));
        }
        let producer =
            std::str::from_utf8(&buf[1..1 + len]).map_err(|_| err("producer id is not UTF-8"))?;
        if producer.is_empty() {
            return Err(err("empty producer id"));
        }
        let at = 1 + len;
        let sequence = u64_le(&buf[at..at + 8]);
        let tag = EventKey::parse(&buf[at + 8..at + 8 + EVENT_KEY_LEN])
            .map_err(|_| err("tag is not an event key"))?;
        let stored_at_ms = u64_le(&buf[at + 8 + EVENT_KEY_LEN..need]);
        Ok((
            SequenceEntry {
                producer: Arc::from(producer),
                sequence,
                tag,
                stored_at_ms,
            },
            need,
        ))
    }

    /// The stored value: a version byte, then the body.
    pub fn to_value(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.body_len());
        out.push(ENTRY_VERSION);
        self.encode_body(&mut out);
        out
    }

    /// Reads a stored value back.
    pub fn from_value(bytes: &[u8]) -> Result<SequenceEntry, SequenceError> {
        match bytes.split_first() {
            Some((&ENTRY_VERSION, body)) => {
                let (entry, used) = SequenceEntry::decode_body(body)?;
                if used != body.len() {
                    return Err(SequenceError {
                        what: "trailing bytes after the entry",
                    });
                }
                Ok(entry)
            }
            Some(_) => Err(SequenceError {
                what: "unknown entry version",
            }),
            None => Err(SequenceError {
                what: "empty value",
            }),
        }
    }
}

fn u64_le(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TopicHash;

    fn entry() -> SequenceEntry {
        SequenceEntry {
            producer: Arc::from("orders-7"),
            sequence: 42,
            tag: EventKey::new(TopicHash(5), 9, 1234),
            stored_at_ms: 777,
        }
    }

    #[test]
    fn an_entry_round_trips_and_every_truncation_is_refused() {
        let value = entry().to_value();
        assert_eq!(SequenceEntry::from_value(&value).unwrap(), entry());
        for cut in 0..value.len() {
            assert!(
                SequenceEntry::from_value(&value[..cut]).is_err(),
                "cut {cut}"
            );
        }
        let mut long = value.clone();
        long.push(0);
        assert!(SequenceEntry::from_value(&long).is_err());
    }

    #[test]
    fn sequence_keys_are_never_event_keys_and_sort_in_publish_order() {
        let (start, end) = sequence_key_range();
        for id in [0, 1, 99, u64::MAX] {
            let key = sequence_key(id);
            assert!(EventKey::parse(&key).is_err());
            assert!(is_sequence_key(&key));
            assert_eq!(sequence_key_event_id(&key), Some(id));
            assert!(start <= key && key < end);
        }
        assert!(sequence_key(1) < sequence_key(2));
        assert!(!is_sequence_key(
            EventKey::new(TopicHash(1), 2, 3).as_bytes()
        ));
        assert!(!is_sequence_key(&end));
        assert_eq!(sequence_key_event_id(&end), None);
    }
}
