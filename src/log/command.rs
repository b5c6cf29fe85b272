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
//! ```
//!
//! Decoding checks the checksum first, then every length against the bytes present before
//! allocating, and refuses trailing bytes: bytes from a disk or a peer are untrusted.

use crate::key::{EventKey, EVENT_KEY_LEN};
use crate::message::Value;

/// Version of the encoding written today. A decoder refuses versions it does not know.
pub const COMMAND_VERSION: u8 = 1;

const KIND_STORE: u8 = 1;
const KIND_DELETE: u8 = 2;
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
        }
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
                out.extend_from_slice(&event_id_high_water.to_le_bytes());
                out.extend_from_slice(&(messages.len() as u32).to_le_bytes());
                for (key, value) in messages {
                    out.extend_from_slice(key.as_bytes());
                    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
                    out.extend_from_slice(value.as_bytes());
                }
            }
            Command::Delete { keys } => {
                out.push(KIND_DELETE);
                out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
                for key in keys {
                    out.extend_from_slice(key.as_bytes());
                }
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

fn decode_store(r: &mut Reader<'_>) -> Result<Command, CommandError> {
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
    Ok(Command::Store {
        messages,
        event_id_high_water,
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

    #[test]
    fn commands_round_trip() {
        for command in [store(), delete(), Command::Delete { keys: vec![] }] {
            let bytes = command.to_bytes();
            assert_eq!(bytes.len(), command.encoded_len());
            assert_eq!(Command::decode(&bytes).unwrap(), command);
        }
    }

    #[test]
    fn every_flipped_bit_is_refused() {
        for command in [store(), delete()] {
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
        let bytes = store().to_bytes();
        for cut in 0..bytes.len() {
            assert!(Command::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
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
