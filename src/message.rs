//! The stored form of a message: an rkyv archive of [`StoredMessage`], shared as a [`Value`].
//!
//! A `Value` is an immutable, 16-byte-aligned buffer behind a reference count, so the store, the
//! dispatcher and every consumer queue share one copy of each payload. Archives are validated
//! (bytecheck) on every access: a value read back from disk is untrusted until checked, and the
//! check costs tens of nanoseconds. rkyv's own error text is empty in release builds, so errors
//! here say what was being decoded.

use std::sync::Arc;

use rkyv::rancor;
use rkyv::util::AlignedVec;

/// One header of a message.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub key: String,
    pub value: Vec<u8>,
}

/// A message as the store keeps it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub topic: String,
    pub payload: Vec<u8>,
    pub enqueued_at_ms: u64,
    pub delay_ms: u64,
    /// 0 means the message never expires.
    pub ttl_ms: u64,
    pub headers: Vec<Header>,
}

impl StoredMessage {
    /// When this message expires, if it does: expired once `now_ms >= expires_at_ms`.
    pub fn expires_at_ms(&self) -> Option<u64> {
        expiry(self.enqueued_at_ms, self.ttl_ms)
    }
}

impl ArchivedStoredMessage {
    pub fn enqueued_at_ms(&self) -> u64 {
        self.enqueued_at_ms.to_native()
    }

    pub fn delay_ms(&self) -> u64 {
        self.delay_ms.to_native()
    }

    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms.to_native()
    }

    pub fn expires_at_ms(&self) -> Option<u64> {
        expiry(self.enqueued_at_ms(), self.ttl_ms())
    }

    pub fn is_expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms().is_some_and(|at| now_ms >= at)
    }
}

fn expiry(enqueued_at_ms: u64, ttl_ms: u64) -> Option<u64> {
    (ttl_ms > 0).then(|| enqueued_at_ms.saturating_add(ttl_ms))
}

/// Errors decoding a stored value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("stored message of {len} bytes failed validation (corrupt or not a pinq message)")]
    InvalidMessage { len: usize },
    #[error("could not encode a message: {0}")]
    Encode(String),
}

/// An immutable, shared, aligned stored value.
#[derive(Clone)]
pub struct Value(Arc<AlignedVec<16>>);

impl Value {
    /// Encodes a message into a new value.
    pub fn encode(message: &StoredMessage) -> Result<Value, CodecError> {
        rkyv::to_bytes::<rancor::Error>(message)
            .map(|bytes| Value(Arc::new(bytes)))
            .map_err(|e| CodecError::Encode(e.to_string()))
    }

    /// Copies raw bytes (for example from a disk block) into an aligned value. No validation.
    pub fn copy_from_slice(bytes: &[u8]) -> Value {
        let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        Value(Arc::new(aligned))
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_slice()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Validates and views the archived message, without copying.
    pub fn message(&self) -> Result<&ArchivedStoredMessage, CodecError> {
        rkyv::access::<ArchivedStoredMessage, rancor::Failure>(self.0.as_slice())
            .map_err(|_| CodecError::InvalidMessage { len: self.0.len() })
    }

    /// Decodes into an owned message (tests and tools; the hot path uses [`Value::message`]).
    pub fn decode(&self) -> Result<StoredMessage, CodecError> {
        let archived = self.message()?;
        rkyv::deserialize::<StoredMessage, rancor::Error>(archived)
            .map_err(|_| CodecError::InvalidMessage { len: self.0.len() })
    }
}

impl std::fmt::Debug for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Value({} bytes)", self.0.len())
    }
}

impl PartialEq for Value {
    fn eq(&self, other: &Value) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredMessage {
        StoredMessage {
            topic: "orders".into(),
            payload: b"hello".to_vec(),
            enqueued_at_ms: 1_000,
            delay_ms: 50,
            ttl_ms: 200,
            headers: vec![Header {
                key: "k".into(),
                value: b"v".to_vec(),
            }],
        }
    }

    #[test]
    fn value_round_trips_and_reads_without_copy() {
        let value = Value::encode(&sample()).unwrap();
        let archived = value.message().unwrap();
        assert_eq!(archived.topic.as_str(), "orders");
        assert_eq!(archived.payload.as_slice(), b"hello");
        assert_eq!(archived.expires_at_ms(), Some(1_200));
        assert!(!archived.is_expired(1_199));
        assert!(archived.is_expired(1_200));
        assert_eq!(value.decode().unwrap(), sample());
        let copied = Value::copy_from_slice(value.as_bytes());
        assert_eq!(copied.decode().unwrap(), sample());
    }

    #[test]
    fn corrupt_values_are_refused_not_trusted() {
        let value = Value::encode(&sample()).unwrap();
        let bytes = value.as_bytes().to_vec();
        assert!(Value::copy_from_slice(&bytes[..bytes.len() / 2])
            .message()
            .is_err());
        assert!(Value::copy_from_slice(&[0xFF; 7]).message().is_err());
        // Flip every byte in turn: validation either refuses it or yields a well-formed message.
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0xFF;
            if let Ok(m) = Value::copy_from_slice(&bad).message() {
                let _ = m.topic.as_str().len() + m.payload.len();
            }
        }
    }

    #[test]
    fn zero_ttl_never_expires() {
        let mut message = sample();
        message.ttl_ms = 0;
        let value = Value::encode(&message).unwrap();
        assert!(!value.message().unwrap().is_expired(u64::MAX));
    }
}
