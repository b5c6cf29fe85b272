//! The stored form of a message: an rkyv archive of [`StoredMessage`], shared as a [`Value`].
//!
//! A `Value` is an immutable, 16-byte-aligned buffer behind a reference count, so the store, the
//! dispatcher and every consumer queue share one copy of each payload. [`Value::message`]
//! validates (bytecheck) on every call: a value read back from disk is untrusted until checked,
//! and the check costs tens of nanoseconds. rkyv's own error text is empty in release builds, so errors
//! here say what was being decoded.
//!
//! A publish builds its archives straight from the request's borrowed slices
//! ([`StoredMessageRef`], the one copy of a payload into the archive) at the edge, before the
//! enqueue time is known; the owning shard stamps that time into the archive in place
//! ([`UnstampedValue::stamp`]). A value that has passed its check, or that this process built,
//! is a [`CheckedValue`]: its accessor does not check again, so a value is checked once per hop
//! (where it enters the pipeline from the store), not on every access.

use std::sync::Arc;

use rkyv::munge::munge;
use rkyv::rancor::{self, Fallible, Source};
use rkyv::ser::{Allocator, Writer};
use rkyv::string::{ArchivedString, StringResolver};
use rkyv::util::AlignedVec;
use rkyv::vec::{ArchivedVec, VecResolver};
use rkyv::{Archive, Place, Serialize};

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

/// One header of a message being published, borrowed from the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderRef<'a> {
    pub key: &'a str,
    pub value: &'a [u8],
}

/// A message to archive whose fields borrow from the request that carried it. It archives to
/// exactly the bytes of the equivalent [`StoredMessage`] (its archived type *is*
/// [`ArchivedStoredMessage`]), without first copying the fields into owned ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredMessageRef<'a> {
    pub topic: &'a str,
    pub payload: &'a [u8],
    pub enqueued_at_ms: u64,
    pub delay_ms: u64,
    pub ttl_ms: u64,
    pub headers: &'a [HeaderRef<'a>],
}

impl Archive for HeaderRef<'_> {
    type Archived = ArchivedHeader;
    type Resolver = (StringResolver, VecResolver);

    fn resolve(&self, (key, value): Self::Resolver, out: Place<ArchivedHeader>) {
        munge!(let ArchivedHeader { key: out_key, value: out_value } = out);
        ArchivedString::resolve_from_str(self.key, key, out_key);
        ArchivedVec::resolve_from_slice(self.value, value, out_value);
    }
}

impl<S: Fallible + Allocator + Writer + ?Sized> Serialize<S> for HeaderRef<'_>
where
    S::Error: Source,
{
    fn serialize(&self, serializer: &mut S) -> Result<Self::Resolver, S::Error> {
        Ok((
            ArchivedString::serialize_from_str(self.key, serializer)?,
            ArchivedVec::<u8>::serialize_from_slice(self.value, serializer)?,
        ))
    }
}

impl Archive for StoredMessageRef<'_> {
    type Archived = ArchivedStoredMessage;
    type Resolver = (StringResolver, VecResolver, VecResolver);

    fn resolve(&self, (topic, payload, headers): Self::Resolver, out: Place<Self::Archived>) {
        munge!(let ArchivedStoredMessage {
            topic: out_topic,
            payload: out_payload,
            enqueued_at_ms,
            delay_ms,
            ttl_ms,
            headers: out_headers,
        } = out);
        ArchivedString::resolve_from_str(self.topic, topic, out_topic);
        ArchivedVec::resolve_from_slice(self.payload, payload, out_payload);
        self.enqueued_at_ms.resolve((), enqueued_at_ms);
        self.delay_ms.resolve((), delay_ms);
        self.ttl_ms.resolve((), ttl_ms);
        ArchivedVec::resolve_from_slice(self.headers, headers, out_headers);
    }
}

impl<S: Fallible + Allocator + Writer + ?Sized> Serialize<S> for StoredMessageRef<'_>
where
    S::Error: Source,
{
    fn serialize(&self, serializer: &mut S) -> Result<Self::Resolver, S::Error> {
        Ok((
            ArchivedString::serialize_from_str(self.topic, serializer)?,
            ArchivedVec::<u8>::serialize_from_slice(self.payload, serializer)?,
            ArchivedVec::<ArchivedHeader>::serialize_from_slice(self.headers, serializer)?,
        ))
    }
}

/// An archive built at the edge whose enqueue time the owning shard has not stamped yet. It is
/// owned by one task at a time (it crosses to the owning shard by move), so the stamp writes into
/// it in place; [`UnstampedValue::stamp`] then shares it as a [`CheckedValue`], same allocation.
pub struct UnstampedValue(AlignedVec<16>);

impl UnstampedValue {
    /// Archives `message` (its `enqueued_at_ms` is overwritten by the stamp). This is the one copy
    /// of the payload, from the request buffer into the archive.
    pub fn encode(message: &StoredMessageRef<'_>) -> Result<UnstampedValue, CodecError> {
        // Sized up front: growing the buffer while serializing copied the payload again
        // (`realloc` was 3 % of a shard's CPU at max rate). Fields, lengths and alignment fit in
        // 128 bytes plus 32 per header.
        let headers: usize = message
            .headers
            .iter()
            .map(|h| h.key.len() + h.value.len() + 32)
            .sum();
        let capacity = 128 + message.topic.len() + message.payload.len() + headers;
        rkyv::api::high::to_bytes_in::<_, rancor::Error>(
            message,
            AlignedVec::<16>::with_capacity(capacity),
        )
        .map(UnstampedValue)
        .map_err(|e| CodecError::Encode(e.to_string()))
    }

    /// The archive's bytes (tests and benches check where they end up).
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// Writes the enqueue time into the archive and shares it, without copying or checking: this
    /// process built the archive, so it is valid by construction.
    pub fn stamp(mut self, enqueued_at_ms: u64) -> CheckedValue {
        debug_assert!(
            rkyv::access::<ArchivedStoredMessage, rancor::Failure>(self.0.as_slice()).is_ok(),
            "an archive built by UnstampedValue::encode failed its check"
        );
        // SAFETY: the bytes are an archive `encode` wrote of a `StoredMessageRef`, whose archived
        // type is `ArchivedStoredMessage`, and nothing else can reach them while `self` is owned.
        let sealed =
            unsafe { rkyv::api::access_unchecked_mut::<ArchivedStoredMessage>(&mut self.0) };
        munge!(let ArchivedStoredMessage { enqueued_at_ms: at, .. } = sealed);
        *at.unseal() = enqueued_at_ms.into();
        CheckedValue(Value(Arc::new(self.0)))
    }
}

impl std::fmt::Debug for UnstampedValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UnstampedValue({} bytes)", self.0.len())
    }
}

/// A [`Value`] known to hold a valid archive: checked once where it entered this hop
/// ([`CheckedValue::check`]), or built by this process ([`UnstampedValue::stamp`],
/// [`CheckedValue::encode`]). Its accessor does not check again.
#[derive(Clone, PartialEq)]
pub struct CheckedValue(Value);

impl CheckedValue {
    /// Checks a value of unknown origin (read from a store) once.
    pub fn check(value: Value) -> Result<CheckedValue, CodecError> {
        value.message()?;
        Ok(CheckedValue(value))
    }

    /// Encodes an owned message (tests and tools).
    pub fn encode(message: &StoredMessage) -> Result<CheckedValue, CodecError> {
        Value::encode(message).map(CheckedValue)
    }

    /// The archived message, without a check (the type says it was checked).
    pub fn message(&self) -> &ArchivedStoredMessage {
        debug_assert!(self.0.message().is_ok(), "a checked value fails its check");
        // SAFETY: a `CheckedValue` is only made from bytes that passed `Value::message` or that
        // `rkyv` serialized as an `ArchivedStoredMessage`, and a `Value` is immutable.
        unsafe { rkyv::access_unchecked::<ArchivedStoredMessage>(self.0.as_bytes()) }
    }

    pub fn value(&self) -> &Value {
        &self.0
    }

    pub fn into_value(self) -> Value {
        self.0
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// Decodes into an owned message (tests and tools).
    pub fn decode(&self) -> Result<StoredMessage, CodecError> {
        self.0.decode()
    }
}

impl std::fmt::Debug for CheckedValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CheckedValue({} bytes)", self.0.len())
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
    fn an_archive_built_from_borrowed_fields_and_stamped_equals_the_owned_encoding() {
        let owned = sample();
        let headers: Vec<HeaderRef<'_>> = owned
            .headers
            .iter()
            .map(|h| HeaderRef {
                key: &h.key,
                value: &h.value,
            })
            .collect();
        let borrowed = StoredMessageRef {
            topic: &owned.topic,
            payload: &owned.payload,
            enqueued_at_ms: 0,
            delay_ms: owned.delay_ms,
            ttl_ms: owned.ttl_ms,
            headers: &headers,
        };
        let unstamped = UnstampedValue::encode(&borrowed).unwrap();
        let at = unstamped.as_bytes().as_ptr();
        let stamped = unstamped.stamp(owned.enqueued_at_ms);
        assert_eq!(stamped.as_bytes().as_ptr(), at, "stamped in place");
        assert_eq!(
            stamped.as_bytes(),
            Value::encode(&owned).unwrap().as_bytes()
        );
        assert_eq!(stamped.decode().unwrap(), owned);
        assert_eq!(stamped.message().enqueued_at_ms(), 1_000);
        // Many headers and a payload past the inline string size take the same layout.
        let big = vec![
            HeaderRef {
                key: "a-long-header-key-name",
                value: &[7; 300]
            };
            9
        ];
        let payload = vec![1u8; 5_000];
        let borrowed = StoredMessageRef {
            headers: &big,
            payload: &payload,
            topic: "a-topic-name-longer-than-eight-bytes",
            ..borrowed
        };
        let owned = StoredMessage {
            topic: borrowed.topic.into(),
            payload: payload.clone(),
            enqueued_at_ms: 77,
            delay_ms: borrowed.delay_ms,
            ttl_ms: borrowed.ttl_ms,
            headers: big
                .iter()
                .map(|h| Header {
                    key: h.key.into(),
                    value: h.value.to_vec(),
                })
                .collect(),
        };
        let stamped = UnstampedValue::encode(&borrowed).unwrap().stamp(77);
        assert_eq!(
            stamped.as_bytes(),
            Value::encode(&owned).unwrap().as_bytes()
        );
    }

    #[test]
    fn a_checked_value_refuses_corrupt_bytes_once_and_then_reads_without_a_check() {
        assert!(CheckedValue::check(Value::copy_from_slice(&[0xFF; 7])).is_err());
        let value = Value::encode(&sample()).unwrap();
        let checked = CheckedValue::check(value.clone()).unwrap();
        assert_eq!(checked.message().payload.as_slice(), b"hello");
        assert_eq!(checked.value(), &value);
    }

    #[test]
    fn zero_ttl_never_expires() {
        let mut message = sample();
        message.ttl_ms = 0;
        let value = Value::encode(&message).unwrap();
        assert!(!value.message().unwrap().is_expired(u64::MAX));
    }
}
