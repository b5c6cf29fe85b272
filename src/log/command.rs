//! Commands: every durable change of a shard as plain data, and their checksummed codec (pure).
//!
//! The leader side of a shard (the pipeline core: stamping time, due buckets and event ids,
//! cutting delete batches) *produces* commands; one `apply` consumes them on every replica. The
//! encoded form is self-contained and self-checking, so the standalone WAL stores it as a
//! record's payload and a Raft entry can carry it unchanged:
//!
//! ```text
//! command = crc32c u32 LE | version u8 | kind u8 | body          crc = crc32c(version ‖ kind ‖ body)
//! store   (kind 1) = event_id_high_water u64 LE | count u32 LE | (key[24] | len u32 LE | value[len])*
//! delete  (kind 2) = count u32 LE | key[24]*
//! policy  (kind 3) = topic str16 | group str16 | flags u8 | max_deliveries u32 LE
//!                    | dead_letter_topic str16 | backoff_initial_ms u64 LE | backoff_max_ms u64 LE
//!                    str16 = len u16 LE | UTF-8[len]; flags: 1 max set, 2 topic set,
//!                    4 backoff set, 8 backoff on (unset fields are written as zero / empty)
//! store with sequences (kind 5) = store body (as kind 1)
//!           | remember u32 LE | (producer_len u8 | producer | sequence u64 LE | tag[24] | stored_at_ms u64 LE)*
//!           | forget u32 LE | event_id u64 LE*
//! copies (kind 4) = count u32 LE | (key[24] | group u64 LE | attempts u32 LE | flags u8)*
//!                   | deleted u32 LE | key[24]* | dropped u32 LE | (key[24] | group u64 LE)*
//! ```
//!
//! Kind 4 writes [`super::copies`] records (a group's copy: deliveries so far, ACKed or not) and,
//! when it deletes messages whose copies have records, deletes both in one atomic change (a
//! delete without records stays kind 2).
//!
//! Kinds 1 and 2 are the message log. Kind 3 (a group's redelivery policy, written by the
//! `setGroupPolicy` admin call) is shard metadata: the store keeps it under a key whose first
//! u64 is [`POLICY_KEY_PREFIX`] (top bit set, so never an event key), and the shard reads it back
//! at start. Kind 5 is a store that also writes the (producer, sequence) entries of idempotent
//! publish and deletes expired ones (see [`super::sequences`]); a publish without producer ids
//! and with nothing to forget is still written as kind 1. Adding a kind changes nothing in how
//! the others are written: old logs decode.
//!
//! Decoding checks the checksum first, then every length against the bytes present before
//! allocating, and refuses trailing bytes: bytes from a disk or a peer are untrusted.

use super::copies::{CopyId, CopyRecord, COPY_RECORD_BYTES};
use super::sequences::{sequence_key, SequenceEntry};
use crate::key::{EventKey, Key, TopicHash, EVENT_KEY_LEN};
use crate::message::Value;
use crate::pipeline::policy::{Backoff, PolicyOverride};

/// Version of the encoding written today. A decoder refuses versions it does not know.
pub const COMMAND_VERSION: u8 = 1;

const KIND_STORE: u8 = 1;
const KIND_DELETE: u8 = 2;
const KIND_COPIES: u8 = 4;
const KIND_STORE_SEQUENCED: u8 = 5;
/// Smallest encoded sequence entry: an empty producer, sequence, tag and time.
const SEQUENCE_ENTRY_BYTES_MIN: usize = 1 + 8 + EVENT_KEY_LEN + 8;

// ---- dead letters and redelivery policy (kinds 3 and 4) ------------------------------------
const KIND_GROUP_POLICY: u8 = 3;
/// First u64 of the store key of a group's policy: `prefix | topic hash | group hash`.
pub const POLICY_KEY_PREFIX: u64 = 0x8000_0000_0000_0001;
const POLICY_MAX_SET: u8 = 1;
const POLICY_TOPIC_SET: u8 = 2;
const POLICY_BACKOFF_SET: u8 = 4;
const POLICY_BACKOFF_ON: u8 = 8;
/// `crc u32 | version u8 | kind u8`.
const HEADER_BYTES: usize = 6;

/// One durable change of a shard.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Stores published messages under keys the leader assigned, and raises the event-id
    /// high-water mark so ids are never reused after a restart or a change of leader.
    Store {
        messages: Vec<(EventKey, Value)>,
        event_id_high_water: u64,
    },
    /// Deletes messages every recipient has ACKed (or that expired).
    Delete { keys: Vec<EventKey> },
    /// A [`Command::Store`] that also remembers the (producer, sequence) of its messages and
    /// forgets entries whose window ended (by their original event id), in one atomic change.
    StoreSequenced {
        messages: Vec<(EventKey, Value)>,
        event_id_high_water: u64,
        remember: Vec<SequenceEntry>,
        forget: Vec<u64>,
    },
    /// Sets a group's overrides of the `[delivery]` redelivery defaults (replacing earlier ones).
    GroupPolicy {
        topic: String,
        group: String,
        policy: PolicyOverride,
    },
    /// Writes copy records (replacing earlier ones of the same copies) and deletes messages
    /// together with the records of their copies, in one atomic change.
    Copies {
        records: Vec<CopyRecord>,
        deleted: Vec<EventKey>,
        dropped: Vec<CopyId>,
    },
}

/// Why bytes are not a valid command.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    #[error("command truncated: needs {need} bytes, {have} present")]
    Truncated { need: usize, have: usize },
    #[error("command checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
    #[error("command version {found} is not supported (this build writes {COMMAND_VERSION})")]
    UnknownVersion { found: u8 },
    #[error("unknown command kind {found}")]
    UnknownKind { found: u8 },
    #[error("command malformed: {what}")]
    Malformed { what: &'static str },
}

impl Command {
    /// Number of messages or keys the command carries.
    pub fn len(&self) -> usize {
        match self {
            Command::Store { messages, .. } => messages.len(),
            Command::Delete { keys } => keys.len(),
            Command::StoreSequenced {
                messages,
                remember,
                forget,
                ..
            } => messages.len() + remember.len() + forget.len(),
            Command::GroupPolicy { .. } => 1,
            Command::Copies {
                records,
                deleted,
                dropped,
            } => records.len() + deleted.len() + dropped.len(),
        }
    }

    /// The event-id high-water mark a store command raises, if it is one.
    pub fn event_id_high_water(&self) -> Option<u64> {
        match self {
            Command::Store {
                event_id_high_water,
                ..
            }
            | Command::StoreSequenced {
                event_id_high_water,
                ..
            } => Some(*event_id_high_water),
            Command::Delete { .. } | Command::GroupPolicy { .. } | Command::Copies { .. } => None,
        }
    }

    /// The store puts (`Some` value) and deletes (`None`) this command stands for, in order:
    /// messages, remembered sequence entries (as metadata keys), then deletes; a group policy
    /// is one put under its metadata key. The one mapping every store uses.
    pub fn for_each_op(&self, mut op: impl FnMut(Key, Option<Value>)) {
        match self {
            Command::Store { messages, .. } => {
                for (key, value) in messages {
                    op(key.to_key(), Some(value.clone()));
                }
            }
            Command::Delete { keys } => {
                for key in keys {
                    op(key.to_key(), None);
                }
            }
            Command::StoreSequenced {
                messages,
                remember,
                forget,
                ..
            } => {
                for (key, value) in messages {
                    op(key.to_key(), Some(value.clone()));
                }
                for entry in remember {
                    op(
                        sequence_key(entry.tag.event_id()),
                        Some(Value::copy_from_slice(&entry.to_value())),
                    );
                }
                for event_id in forget {
                    op(sequence_key(*event_id), None);
                }
            }
            // The value is the whole checksummed command: the shard decodes it back at start.
            Command::GroupPolicy { topic, group, .. } => op(
                Command::policy_key(topic, group),
                Some(Value::copy_from_slice(&self.to_bytes())),
            ),
            Command::Copies {
                records,
                deleted,
                dropped,
            } => {
                for record in records {
                    op(
                        record.id.store_key(),
                        Some(Value::copy_from_slice(&record.to_value())),
                    );
                }
                for key in deleted {
                    op(key.to_key(), None);
                }
                for id in dropped {
                    op(id.store_key(), None);
                }
            }
        }
    }

    /// The store key a [`Command::GroupPolicy`] of `topic` and `group` is kept under.
    pub fn policy_key(topic: &str, group: &str) -> Key {
        let group_hash = xxhash_rust::xxh3::xxh3_64_with_seed(group.as_bytes(), 0);
        let mut key = Key::new();
        key.extend_from_slice(&POLICY_KEY_PREFIX.to_be_bytes());
        key.extend_from_slice(&TopicHash::of(topic).0.to_be_bytes());
        key.extend_from_slice(&group_hash.to_be_bytes());
        key
    }

    /// Whether a store key is a group policy's.
    pub fn is_policy_key(key: &[u8]) -> bool {
        key.len() == 24 && key[0..8] == POLICY_KEY_PREFIX.to_be_bytes()
    }

    /// The key range holding every group policy: `[start, end)`.
    pub fn policy_key_range() -> (Key, Key) {
        let bound = |prefix: u64| Key::from_slice(&prefix.to_be_bytes());
        (bound(POLICY_KEY_PREFIX), bound(POLICY_KEY_PREFIX + 1))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes [`Command::encode`] appends.
    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES
            + match self {
                Command::Store { messages, .. } => {
                    12 + messages
                        .iter()
                        .map(|(_, v)| EVENT_KEY_LEN + 4 + v.len())
                        .sum::<usize>()
                }
                Command::Delete { keys } => 4 + keys.len() * EVENT_KEY_LEN,
                Command::StoreSequenced {
                    messages,
                    remember,
                    forget,
                    ..
                } => {
                    12 + messages
                        .iter()
                        .map(|(_, v)| EVENT_KEY_LEN + 4 + v.len())
                        .sum::<usize>()
                        + 4
                        + remember.iter().map(SequenceEntry::body_len).sum::<usize>()
                        + 4
                        + forget.len() * 8
                }
                Command::GroupPolicy {
                    topic,
                    group,
                    policy,
                } => {
                    2 + topic.len()
                        + 2
                        + group.len()
                        + 1
                        + 4
                        + 2
                        + policy.dead_letter_topic.as_ref().map_or(0, String::len)
                        + 16
                }
                Command::Copies {
                    records,
                    deleted,
                    dropped,
                } => {
                    12 + records.len() * COPY_RECORD_BYTES
                        + deleted.len() * EVENT_KEY_LEN
                        + dropped.len() * (EVENT_KEY_LEN + 8)
                }
            }
    }

    /// Appends the encoded command to `out`; returns the bytes appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> usize {
        let start = out.len();
        out.reserve(self.encoded_len());
        out.extend_from_slice(&[0u8; 4]);
        out.push(COMMAND_VERSION);
        match self {
            Command::Store {
                messages,
                event_id_high_water,
            } => {
                out.push(KIND_STORE);
                encode_store_body(out, messages, *event_id_high_water);
            }
            Command::Delete { keys } => {
                out.push(KIND_DELETE);
                out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
                for key in keys {
                    out.extend_from_slice(key.as_bytes());
                }
            }
            Command::StoreSequenced {
                messages,
                event_id_high_water,
                remember,
                forget,
            } => {
                out.push(KIND_STORE_SEQUENCED);
                encode_store_body(out, messages, *event_id_high_water);
                out.extend_from_slice(&(remember.len() as u32).to_le_bytes());
                for entry in remember {
                    entry.encode_body(out);
                }
                out.extend_from_slice(&(forget.len() as u32).to_le_bytes());
                for event_id in forget {
                    out.extend_from_slice(&event_id.to_le_bytes());
                }
            }
            Command::GroupPolicy {
                topic,
                group,
                policy,
            } => {
                out.push(KIND_GROUP_POLICY);
                encode_policy(topic, group, policy, out);
            }
            Command::Copies {
                records,
                deleted,
                dropped,
            } => {
                out.push(KIND_COPIES);
                encode_copies(records, deleted, dropped, out);
            }
        }
        let crc = crc32c::crc32c(&out[start + 4..]);
        out[start..start + 4].copy_from_slice(&crc.to_le_bytes());
        debug_assert_eq!(out.len() - start, self.encoded_len());
        out.len() - start
    }

    /// The encoded command as a new buffer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes one command that spans all of `bytes` (values are copied into aligned buffers).
    pub fn decode(bytes: &[u8]) -> Result<Command, CommandError> {
        if bytes.len() < HEADER_BYTES {
            return Err(CommandError::Truncated {
                need: HEADER_BYTES,
                have: bytes.len(),
            });
        }
        let stored = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let computed = crc32c::crc32c(&bytes[4..]);
        if stored != computed {
            return Err(CommandError::Checksum { stored, computed });
        }
        if bytes[4] != COMMAND_VERSION {
            return Err(CommandError::UnknownVersion { found: bytes[4] });
        }
        let mut r = Reader {
            buf: &bytes[HEADER_BYTES..],
        };
        let command = match bytes[5] {
            KIND_STORE => decode_store(&mut r)?,
            KIND_DELETE => decode_delete(&mut r)?,
            KIND_STORE_SEQUENCED => decode_store_sequenced(&mut r)?,
            KIND_GROUP_POLICY => decode_policy(&mut r)?,
            KIND_COPIES => decode_copies(&mut r)?,
            found => return Err(CommandError::UnknownKind { found }),
        };
        if !r.buf.is_empty() {
            return Err(CommandError::Malformed {
                what: "trailing bytes after the command",
            });
        }
        Ok(command)
    }
}

fn encode_store_body(out: &mut Vec<u8>, messages: &[(EventKey, Value)], event_id_high_water: u64) {
    out.extend_from_slice(&event_id_high_water.to_le_bytes());
    out.extend_from_slice(&(messages.len() as u32).to_le_bytes());
    for (key, value) in messages {
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(value.as_bytes());
    }
}

fn decode_store_sequenced(r: &mut Reader<'_>) -> Result<Command, CommandError> {
    let (messages, event_id_high_water) = decode_store_body(r)?;
    let count = r.u32("remembered count")? as usize;
    if count > r.buf.len() / SEQUENCE_ENTRY_BYTES_MIN {
        return Err(CommandError::Malformed {
            what: "remembered count exceeds the command",
        });
    }
    let mut remember = Vec::with_capacity(count);
    for _ in 0..count {
        let (entry, used) = SequenceEntry::decode_body(r.buf)
            .map_err(|e| CommandError::Malformed { what: e.what })?;
        r.take(used, "sequence entry")?;
        remember.push(entry);
    }
    let count = r.u32("forgotten count")? as usize;
    if count > r.buf.len() / 8 {
        return Err(CommandError::Malformed {
            what: "forgotten count exceeds the command",
        });
    }
    let forget = (0..count)
        .map(|_| r.u64("forgotten event id"))
        .collect::<Result<_, _>>()?;
    Ok(Command::StoreSequenced {
        messages,
        event_id_high_water,
        remember,
        forget,
    })
}

fn decode_store(r: &mut Reader<'_>) -> Result<Command, CommandError> {
    let (messages, event_id_high_water) = decode_store_body(r)?;
    Ok(Command::Store {
        messages,
        event_id_high_water,
    })
}

type StoreBody = (Vec<(EventKey, Value)>, u64);

fn decode_store_body(r: &mut Reader<'_>) -> Result<StoreBody, CommandError> {
    let event_id_high_water = r.u64("high-water mark")?;
    let count = r.u32("message count")? as usize;
    // Each message takes at least a key and a length: refuse counts the bytes cannot hold.
    if count > r.buf.len() / (EVENT_KEY_LEN + 4) {
        return Err(CommandError::Malformed {
            what: "message count exceeds the command",
        });
    }
    let mut messages = Vec::with_capacity(count);
    for _ in 0..count {
        let key = r.key()?;
        let len = r.u32("value length")? as usize;
        let value = Value::copy_from_slice(r.take(len, "value bytes")?);
        messages.push((key, value));
    }
    Ok((messages, event_id_high_water))
}

fn encode_copies(
    records: &[CopyRecord],
    deleted: &[EventKey],
    dropped: &[CopyId],
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(&(records.len() as u32).to_le_bytes());
    for record in records {
        record.encode(out);
    }
    out.extend_from_slice(&(deleted.len() as u32).to_le_bytes());
    for key in deleted {
        out.extend_from_slice(key.as_bytes());
    }
    out.extend_from_slice(&(dropped.len() as u32).to_le_bytes());
    for id in dropped {
        out.extend_from_slice(id.key.as_bytes());
        out.extend_from_slice(&id.group.to_le_bytes());
    }
}

fn decode_copies(r: &mut Reader<'_>) -> Result<Command, CommandError> {
    let count = r.count("copy record count", COPY_RECORD_BYTES)?;
    let records = (0..count)
        .map(|_| {
            CopyRecord::decode(r.take(COPY_RECORD_BYTES, "copy record")?)
                .map_err(|e| CommandError::Malformed { what: e.what })
        })
        .collect::<Result<_, _>>()?;
    let count = r.count("deleted key count", EVENT_KEY_LEN)?;
    let deleted = (0..count).map(|_| r.key()).collect::<Result<_, _>>()?;
    let count = r.count("dropped copy count", EVENT_KEY_LEN + 8)?;
    let dropped = (0..count)
        .map(|_| {
            let key = r.key()?;
            let group = r.u64("dropped copy group")?;
            Ok(CopyId { key, group })
        })
        .collect::<Result<_, _>>()?;
    Ok(Command::Copies {
        records,
        deleted,
        dropped,
    })
}

fn decode_delete(r: &mut Reader<'_>) -> Result<Command, CommandError> {
    let count = r.u32("key count")? as usize;
    if count > r.buf.len() / EVENT_KEY_LEN {
        return Err(CommandError::Malformed {
            what: "key count exceeds the command",
        });
    }
    let keys = (0..count).map(|_| r.key()).collect::<Result<_, _>>()?;
    Ok(Command::Delete { keys })
}

/// Writes a str16: callers pass names already checked to fit (topics and groups are at most
/// 255 bytes); a longer one is cut at a char boundary rather than written with a lying length.
fn put_str16(text: &str, out: &mut Vec<u8>) {
    let mut len = text.len().min(u16::MAX as usize);
    while !text.is_char_boundary(len) {
        len -= 1;
    }
    out.extend_from_slice(&(len as u16).to_le_bytes());
    out.extend_from_slice(&text.as_bytes()[..len]);
}

fn encode_policy(topic: &str, group: &str, policy: &PolicyOverride, out: &mut Vec<u8>) {
    put_str16(topic, out);
    put_str16(group, out);
    let mut flags = 0;
    if policy.max_deliveries.is_some() {
        flags |= POLICY_MAX_SET;
    }
    if policy.dead_letter_topic.is_some() {
        flags |= POLICY_TOPIC_SET;
    }
    if let Some(backoff) = policy.backoff {
        flags |= POLICY_BACKOFF_SET;
        if backoff.is_some() {
            flags |= POLICY_BACKOFF_ON;
        }
    }
    out.push(flags);
    out.extend_from_slice(&policy.max_deliveries.unwrap_or(0).to_le_bytes());
    put_str16(policy.dead_letter_topic.as_deref().unwrap_or(""), out);
    let (initial, max) = policy
        .backoff
        .flatten()
        .map_or((0, 0), |b| (b.initial_ms, b.max_ms));
    out.extend_from_slice(&initial.to_le_bytes());
    out.extend_from_slice(&max.to_le_bytes());
}

fn decode_policy(r: &mut Reader<'_>) -> Result<Command, CommandError> {
    let topic = r.str16("policy topic")?;
    let group = r.str16("policy group")?;
    let flags = r.take(1, "policy flags")?[0];
    if flags & !(POLICY_MAX_SET | POLICY_TOPIC_SET | POLICY_BACKOFF_SET | POLICY_BACKOFF_ON) != 0
        || (flags & POLICY_BACKOFF_ON != 0 && flags & POLICY_BACKOFF_SET == 0)
    {
        return Err(CommandError::Malformed {
            what: "policy flags",
        });
    }
    let max = r.u32("policy max deliveries")?;
    let dead_letter_topic = r.str16("policy dead-letter topic")?;
    let initial_ms = r.u64("policy backoff initial")?;
    let max_ms = r.u64("policy backoff max")?;
    let backoff = if flags & POLICY_BACKOFF_ON != 0 {
        Some(
            Backoff::new(initial_ms, max_ms).map_err(|_| CommandError::Malformed {
                what: "policy backoff bounds",
            })?,
        )
    } else {
        None
    };
    Ok(Command::GroupPolicy {
        topic,
        group,
        policy: PolicyOverride {
            max_deliveries: (flags & POLICY_MAX_SET != 0).then_some(max),
            dead_letter_topic: (flags & POLICY_TOPIC_SET != 0).then_some(dead_letter_topic),
            backoff: (flags & POLICY_BACKOFF_SET != 0).then_some(backoff),
        },
    })
}

/// A cursor that refuses to read past its end.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], CommandError> {
        if self.buf.len() < n {
            return Err(CommandError::Malformed { what });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, CommandError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, CommandError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }

    fn str16(&mut self, what: &'static str) -> Result<String, CommandError> {
        let b = self.take(2, what)?;
        let len = u16::from_le_bytes([b[0], b[1]]) as usize;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| CommandError::Malformed { what })
    }

    /// A u32 count of items of `item_bytes` each, refused when the bytes left cannot hold it.
    fn count(&mut self, what: &'static str, item_bytes: usize) -> Result<usize, CommandError> {
        let count = self.u32(what)? as usize;
        if count > self.buf.len() / item_bytes {
            return Err(CommandError::Malformed { what });
        }
        Ok(count)
    }

    fn key(&mut self) -> Result<EventKey, CommandError> {
        EventKey::parse(self.take(EVENT_KEY_LEN, "event key")?)
            .map_err(|_| CommandError::Malformed { what: "event key" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TopicHash;

    fn store() -> Command {
        Command::Store {
            messages: (0..3)
                .map(|i| {
                    (
                        EventKey::new(TopicHash(7), 10 + i, 100 + i),
                        Value::copy_from_slice(&vec![i as u8; i as usize * 5]),
                    )
                })
                .collect(),
            event_id_high_water: 102,
        }
    }

    fn delete() -> Command {
        Command::Delete {
            keys: (0..4).map(|i| EventKey::new(TopicHash(9), 1, i)).collect(),
        }
    }

    fn store_sequenced() -> Command {
        let Command::Store {
            messages,
            event_id_high_water,
        } = store()
        else {
            unreachable!()
        };
        Command::StoreSequenced {
            remember: messages
                .iter()
                .enumerate()
                .map(|(i, (key, _))| SequenceEntry {
                    producer: std::sync::Arc::from(format!("producer-{i}").as_str()),
                    sequence: i as u64 + 1,
                    tag: *key,
                    stored_at_ms: 1000 + i as u64,
                })
                .collect(),
            messages,
            event_id_high_water,
            forget: vec![3, 4],
        }
    }

    fn copies() -> Command {
        let id = |i: u64| CopyId {
            key: EventKey::new(TopicHash(5), 2, i),
            group: 0xfeed_0000 + i,
        };
        Command::Copies {
            records: vec![
                CopyRecord {
                    id: id(1),
                    attempts: 2,
                    acked: false,
                },
                CopyRecord {
                    id: id(2),
                    attempts: 1,
                    acked: true,
                },
            ],
            deleted: vec![id(3).key],
            dropped: vec![id(3), id(4)],
        }
    }

    #[test]
    fn copies_put_records_and_delete_messages_with_their_records() {
        let mut puts = Vec::new();
        let mut deletes = Vec::new();
        copies().for_each_op(|k, v| match v {
            Some(v) => puts.push((k, v)),
            None => deletes.push(k),
        });
        assert_eq!(puts.len(), 2);
        let record = CopyRecord::from_row(&puts[1].0, puts[1].1.as_bytes()).unwrap();
        assert!(record.acked && record.attempts == 1);
        assert_eq!(deletes.len(), 3);
        assert!(EventKey::parse(&deletes[0]).is_ok());
        assert!(CopyId::from_store_key(&deletes[2]).is_some());
    }

    fn policy() -> Command {
        Command::GroupPolicy {
            topic: "jobs".into(),
            group: "workers".into(),
            policy: PolicyOverride {
                max_deliveries: Some(5),
                dead_letter_topic: Some("jobs.dead".into()),
                backoff: Some(Backoff::new(100, 10_000).ok()),
            },
        }
    }

    #[test]
    fn commands_round_trip() {
        let unset = Command::GroupPolicy {
            topic: "t".into(),
            group: "g".into(),
            policy: PolicyOverride {
                backoff: Some(None),
                ..PolicyOverride::default()
            },
        };
        for command in [
            store(),
            delete(),
            Command::Delete { keys: vec![] },
            store_sequenced(),
            policy(),
            unset,
            copies(),
        ] {
            let bytes = command.to_bytes();
            assert_eq!(bytes.len(), command.encoded_len());
            assert_eq!(Command::decode(&bytes).unwrap(), command);
        }
    }

    #[test]
    fn every_flipped_bit_is_refused() {
        for command in [store(), delete(), store_sequenced(), policy(), copies()] {
            let bytes = command.to_bytes();
            for byte in 0..bytes.len() {
                for bit in 0..8 {
                    let mut bad = bytes.clone();
                    bad[byte] ^= 1 << bit;
                    assert!(
                        Command::decode(&bad).is_err(),
                        "flip at byte {byte} bit {bit} accepted"
                    );
                }
            }
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        for command in [store(), store_sequenced(), policy(), copies()] {
            let bytes = command.to_bytes();
            for cut in 0..bytes.len() {
                assert!(Command::decode(&bytes[..cut]).is_err(), "cut at {cut}");
            }
        }
    }

    #[test]
    fn a_sequenced_store_puts_its_entries_under_metadata_keys_and_deletes_forgotten_ones() {
        let mut puts = Vec::new();
        let mut deletes = Vec::new();
        store_sequenced().for_each_op(|k, v| match v {
            Some(v) => puts.push((k, v)),
            None => deletes.push(k),
        });
        assert_eq!(puts.len(), 6);
        for (key, value) in &puts[3..] {
            assert!(crate::log::sequences::is_sequence_key(key));
            let entry = SequenceEntry::from_value(value.as_bytes()).unwrap();
            assert_eq!(sequence_key(entry.tag.event_id()), *key);
        }
        assert_eq!(deletes, vec![sequence_key(3), sequence_key(4)]);
        assert_eq!(store_sequenced().event_id_high_water(), Some(102));
        assert_eq!(delete().event_id_high_water(), None);
    }

    #[test]
    fn a_lying_remembered_count_is_refused_before_allocating() {
        let mut bytes = vec![0, 0, 0, 0, COMMAND_VERSION, KIND_STORE_SEQUENCED];
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Command::decode(&sealed(bytes)),
            Err(CommandError::Malformed { .. })
        ));
    }

    #[test]
    fn policy_keys_are_never_event_keys_and_sit_in_their_range() {
        let key = Command::policy_key("jobs", "workers");
        assert!(Command::is_policy_key(&key));
        assert!(!Command::is_policy_key(
            &crate::log::sequences::sequence_key(7)
        ));
        assert!(EventKey::parse(&key).is_err());
        let (start, end) = Command::policy_key_range();
        assert!(key >= start && key < end);
        assert_ne!(key, Command::policy_key("jobs", "others"));
        assert_ne!(key, Command::policy_key("other", "workers"));
    }

    #[test]
    fn policy_with_bad_flags_or_backoff_is_refused() {
        let mut bytes = policy().to_bytes();
        // flags sit after the two names: 6 + (2 + 4) + (2 + 7)
        let at = HEADER_BYTES + 6 + 9;
        bytes[at] = 0x40;
        assert!(matches!(
            Command::decode(&sealed(bytes.clone())),
            Err(CommandError::Malformed {
                what: "policy flags"
            })
        ));
        bytes[at] = POLICY_BACKOFF_SET | POLICY_BACKOFF_ON;
        let len = bytes.len();
        bytes[len - 16..].copy_from_slice(&[0u8; 16]);
        assert!(matches!(
            Command::decode(&sealed(bytes)),
            Err(CommandError::Malformed {
                what: "policy backoff bounds"
            })
        ));
    }

    /// Re-checksums hand-made bytes, so the test reaches the checks behind the checksum.
    fn sealed(mut bytes: Vec<u8>) -> Vec<u8> {
        let crc = crc32c::crc32c(&bytes[4..]);
        bytes[..4].copy_from_slice(&crc.to_le_bytes());
        bytes
    }

    #[test]
    fn unknown_versions_kinds_and_lying_counts_are_refused_by_name() {
        let mut bytes = delete().to_bytes();
        bytes[4] = 9;
        assert_eq!(
            Command::decode(&sealed(bytes.clone())),
            Err(CommandError::UnknownVersion { found: 9 })
        );
        bytes[4] = COMMAND_VERSION;
        bytes[5] = 77;
        assert_eq!(
            Command::decode(&sealed(bytes)),
            Err(CommandError::UnknownKind { found: 77 })
        );
        let mut lying = vec![0, 0, 0, 0, COMMAND_VERSION, KIND_DELETE];
        lying.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Command::decode(&sealed(lying)),
            Err(CommandError::Malformed { .. })
        ));
        let mut trailing = delete().to_bytes();
        trailing.push(0);
        assert!(matches!(
            Command::decode(&sealed(trailing)),
            Err(CommandError::Malformed { .. })
        ));
    }
}
