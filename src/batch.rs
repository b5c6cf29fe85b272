//! The validated publish batch: what the edge (the connection that read the request) hands to
//! the shard that owns a message's topic, checked once and already in its stored form.
//!
//! The edge reads a batch from the wire with [`rpc::read_publish_batch`], which checks every
//! message against the protocol and `[publish]` limits and borrows from the request; here the
//! batch's ack level is checked against `publish.minAckLevel` (the config is the same on every
//! shard), each message is archived straight from the request's slices, and the batch is split
//! by owning shard. The owning shard's core does not validate again: it assigns keys (due
//! bucket, event id) and stamps the enqueue time into each archive in place
//! ([`crate::pipeline::ShardCore::prepare_publish`]). A refused batch is refused whole, before
//! anything is sent to a shard, so nothing of it is stored.
//!
//! Payload copies between the socket and the WAL's DMA buffer:
//!
//! ```text
//!  socket ─▶ capnp segments          (the RPC transport's read; the request buffer)
//!   1. capnp segments ─▶ rkyv archive   PublishMessageRef::archive, here at the edge
//!      (crosses to the owning shard by move; stamped in place; shared, not copied, by the
//!       StoreBatch, the Command, the memtable and the in-flight table)
//!   2. rkyv archive ─▶ WAL chunk        Command::encode into the pending chunk
//!   3. WAL chunk ─▶ DMA buffer          storage::io::write_padded
//!  (then, out of this stretch: archive ─▶ capnp deliver, when a consumer gets the message)
//! ```
//!
//! Before this type there were five in that stretch: capnp → `PublishMessage` (edge) →
//! `StoredMessage` (clone in `prepare_publish`) → rkyv → WAL chunk → DMA buffer.

use std::sync::Arc;

use crate::config::{AckLevel, PublishConfig};
use crate::key::TopicHash;
use crate::message::{CodecError, UnstampedValue};
use crate::rpc::{self, PublishLimits, PublishMessageRef, WireError};

/// Why a publish batch was refused. Nothing of a refused batch is written.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A message or the batch breaks the protocol or a `[publish]` limit (the error names the
    /// field and the message's index, `messages[3].topic`).
    #[error(transparent)]
    Invalid(#[from] WireError),
    #[error("ack level {requested:?} is weaker than publish.minAckLevel {min:?}")]
    AckLevelTooWeak { requested: AckLevel, min: AckLevel },
    #[error("message {index}: {source}")]
    Encode { index: usize, source: CodecError },
}

/// One message of a validated batch: what the owning shard needs to key it, and its archive.
#[derive(Debug)]
pub struct ValidatedMessage {
    pub topic_hash: TopicHash,
    /// Milliseconds from enqueue until due (also inside the archive; here so the key's due
    /// bucket needs no archive access).
    pub delay_ms: u64,
    pub value: UnstampedValue,
    /// Idempotent publish: the message's producer id and sequence (`None`: not idempotent).
    /// Messages of one producer in a row share one allocation.
    pub producer: Option<(Arc<str>, u64)>,
}

/// Messages of one publish request bound for one shard, validated and archived at the edge.
/// Only this module makes one, from messages that passed the wire's checks.
#[derive(Debug)]
pub struct ValidatedBatch {
    ack: AckLevel,
    messages: Vec<ValidatedMessage>,
}

/// The part of a request bound for one shard, and where each of its messages sits in the
/// request (for the reply's tags).
#[derive(Debug)]
pub struct ShardPart {
    pub shard: usize,
    pub places: Vec<u32>,
    pub batch: ValidatedBatch,
}

impl ValidatedBatch {
    /// Splits a batch [`rpc::read_publish_batch`] has read and validated by owning shard,
    /// archiving each message (its one payload copy). Parts come in shard order; shards without
    /// a message get none.
    pub fn split(
        messages: &[PublishMessageRef<'_>],
        ack: AckLevel,
        config: &PublishConfig,
        shard_count: usize,
    ) -> Result<Vec<ShardPart>, PublishError> {
        check_ack_level(ack, config)?;
        let mut parts: Vec<ShardPart> = Vec::new();
        let mut last_producer: Option<Arc<str>> = None;
        for (index, m) in (0u32..).zip(messages) {
            let topic_hash = TopicHash::of(m.topic);
            let shard = topic_hash.shard(shard_count);
            let value = m.archive().map_err(|source| PublishError::Encode {
                index: index as usize,
                source,
            })?;
            let at = match parts.iter().position(|p| p.shard == shard) {
                Some(at) => at,
                None => {
                    parts.push(ShardPart {
                        shard,
                        places: Vec::new(),
                        batch: ValidatedBatch {
                            ack,
                            messages: Vec::new(),
                        },
                    });
                    parts.len() - 1
                }
            };
            let producer = (!m.producer_id.is_empty()).then(|| {
                let name = match &last_producer {
                    Some(name) if name.as_ref() == m.producer_id => name.clone(),
                    _ => Arc::from(m.producer_id),
                };
                last_producer = Some(name.clone());
                (name, m.sequence)
            });
            let part = &mut parts[at];
            part.places.push(index);
            part.batch.messages.push(ValidatedMessage {
                topic_hash,
                delay_ms: m.delay_ms,
                value,
                producer,
            });
        }
        parts.sort_unstable_by_key(|p| p.shard);
        Ok(parts)
    }

    /// A batch for one shard from owned messages (in-process publishers: tests, benches), checked
    /// by the same functions the wire reader uses.
    pub fn from_messages(
        messages: &[rpc::PublishMessage],
        ack: AckLevel,
        config: &PublishConfig,
    ) -> Result<ValidatedBatch, PublishError> {
        let limits = PublishLimits::from(config);
        rpc::check_publish_batch_len(messages.len(), &limits)?;
        let borrowed: Vec<PublishMessageRef<'_>> = messages.iter().map(|m| m.borrow()).collect();
        for (index, m) in (0u32..).zip(&borrowed) {
            rpc::check_publish_message(m, index, &limits)?;
        }
        let mut parts = ValidatedBatch::split(&borrowed, ack, config, 1)?;
        Ok(parts.pop().map_or(
            ValidatedBatch {
                ack,
                messages: Vec::new(),
            },
            |part| part.batch,
        ))
    }

    pub fn ack(&self) -> AckLevel {
        self.ack
    }

    pub fn len(&self) -> usize {
        self.messages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    pub fn messages(&self) -> &[ValidatedMessage] {
        &self.messages
    }

    pub fn into_messages(self) -> Vec<ValidatedMessage> {
        self.messages
    }
}

fn check_ack_level(ack: AckLevel, config: &PublishConfig) -> Result<(), PublishError> {
    if ack < config.ack_level_min {
        return Err(PublishError::AckLevelTooWeak {
            requested: ack,
            min: config.ack_level_min,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_split_by_owning_shard_keeping_each_message_place() {
        let messages: Vec<rpc::PublishMessage> = (0..32)
            .map(|i| rpc::PublishMessage::new(format!("topic-{i}"), vec![i as u8; 10]))
            .collect();
        let borrowed: Vec<PublishMessageRef<'_>> = messages.iter().map(|m| m.borrow()).collect();
        let parts =
            ValidatedBatch::split(&borrowed, AckLevel::Durable, &PublishConfig::default(), 4)
                .unwrap();
        assert!(parts.windows(2).all(|w| w[0].shard < w[1].shard));
        let mut seen = 0;
        for part in &parts {
            assert_eq!(part.places.len(), part.batch.len());
            for (place, m) in part.places.iter().zip(part.batch.messages()) {
                let original = &messages[*place as usize];
                let hash = TopicHash::of(&original.topic);
                assert_eq!(hash.shard(4), part.shard);
                assert_eq!(m.topic_hash, hash);
                seen += 1;
            }
        }
        assert_eq!(seen, messages.len());
    }

    #[test]
    fn a_bad_message_refuses_the_batch_with_its_index() {
        let mut messages = vec![
            rpc::PublishMessage::new("fine", "a"),
            rpc::PublishMessage::new("fine", "b"),
            rpc::PublishMessage::new("", "c"),
        ];
        let config = PublishConfig::default();
        let e = ValidatedBatch::from_messages(&messages, AckLevel::Durable, &config).unwrap_err();
        assert_eq!(e.to_string(), "messages[2].topic: topic name is empty");
        messages[2] = rpc::PublishMessage::new("t", vec![0; config.message_bytes_max + 1]);
        let e = ValidatedBatch::from_messages(&messages, AckLevel::Durable, &config).unwrap_err();
        assert!(e.to_string().starts_with("messages[2].payload is "), "{e}");
        let strict = PublishConfig {
            ack_level_min: AckLevel::Durable,
            ..PublishConfig::default()
        };
        let e =
            ValidatedBatch::from_messages(&messages[..1], AckLevel::Leader, &strict).unwrap_err();
        assert!(matches!(e, PublishError::AckLevelTooWeak { .. }));
    }

    #[test]
    fn headers_count_toward_max_message_bytes() {
        let config = PublishConfig {
            message_bytes_max: 64,
            ..PublishConfig::default()
        };
        let mut message = rpc::PublishMessage::new("t", vec![0; 40]);
        // The payload alone fits.
        ValidatedBatch::from_messages(&[message.clone()], AckLevel::Durable, &config).unwrap();
        message.headers.push(crate::message::Header {
            key: "trace-id".into(),
            value: vec![b'x'; 16],
        });
        // 40 + 8 + 16 = 64: exactly the limit.
        ValidatedBatch::from_messages(&[message.clone()], AckLevel::Durable, &config).unwrap();
        message.headers[0].value.push(b'x');
        let e = ValidatedBatch::from_messages(&[message], AckLevel::Durable, &config).unwrap_err();
        assert_eq!(
            e.to_string(),
            "messages[0] is 65 bytes (payload and headers), the limit is 64 (publish.maxMessageBytes)"
        );
    }
}
