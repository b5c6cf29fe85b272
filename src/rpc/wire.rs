//! Conversions between the generated Cap'n Proto types and pinq's own.
//!
//! Writers fill a builder from pinq values; readers check every field of an untrusted message
//! (UTF-8, lengths, signs, enum values) and either return a value that is valid by construction
//! or a [`WireError`] that names the field and, in a batch, the index. Readers of the publish path
//! borrow from the message ([`PublishMessageRef`]) so the server can validate a whole batch before
//! it copies anything.

use capnp::{data_list, enum_list, struct_list};
use uuid::Uuid;

use super::pinq_capnp::{
    delivery, group_stats, header, publish_message, shard_info, shard_stats, stats, topic_stats,
    AckLevel as WireAckLevel, TagResult,
};
use crate::config::{AckLevel, PublishConfig};
use crate::key::{validate_topic, EventKey, KeyError};
pub use crate::log::sequences::PRODUCER_ID_LEN_MAX;
pub use crate::message::HeaderRef;
use crate::message::{
    ArchivedStoredMessage, CodecError, Header, StoredMessage, StoredMessageRef, UnstampedValue,
};

/// Errors reading or writing a protocol message.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("malformed Cap'n Proto message: {0}")]
    Capnp(#[from] capnp::Error),
    #[error("{field} is not valid UTF-8")]
    NotUtf8 { field: Field },
    #[error("{field}: {source}")]
    Topic { field: Field, source: KeyError },
    #[error("{field}: {source}")]
    Tag { field: Field, source: KeyError },
    #[error("{field} is {value}: negative values are refused")]
    Negative { field: Field, value: i64 },
    #[error("{field} is {value}, more than the protocol carries ({max})")]
    TooLarge { field: Field, value: u64, max: u64 },
    #[error("{field} is {len} bytes, the limit is {max}")]
    TooLong {
        field: Field,
        len: usize,
        max: usize,
    },
    #[error("{field} is {bytes} bytes (payload and headers), the limit is {max} (publish.maxMessageBytes)")]
    MessageTooLarge {
        field: Field,
        bytes: usize,
        max: usize,
    },
    #[error("batch of {len} messages, the limit is {max}")]
    BatchTooLarge { len: usize, max: usize },
    #[error("{field} has an unknown value {value} (newer peer?)")]
    UnknownEnumerant { field: Field, value: u16 },
    #[error("{field} is {len} bytes, expected {expected}")]
    WrongLength {
        field: Field,
        len: usize,
        expected: usize,
    },
}

impl WireError {
    /// The Cap'n Proto exception a server answers a bad request with: type `failed`, and this
    /// error's text as the description (the schema documents this convention).
    pub fn into_capnp(self) -> capnp::Error {
        match self {
            // Keep the original kind (a `disconnected` stays one), with our context added.
            WireError::Capnp(e) => e,
            other => capnp::Error::failed(other.to_string()),
        }
    }
}

impl WireError {
    /// The typed refusal of a request this error refuses, with the offending entry's index;
    /// `Err` with the exception for a malformed message (not a refusal: the bytes break Cap'n
    /// Proto itself). The refusal's message is this error's text, as protocol 1 sends it.
    pub fn refusal(self) -> Result<super::refusal::Refusal, capnp::Error> {
        let (code, index) = match &self {
            WireError::Capnp(_) => return Err(self.into_capnp()),
            other => (other.code(), other.field().and_then(|f| f.index)),
        };
        Ok(super::refusal::Refusal::new(code, self.to_string()).at(index))
    }

    /// The refusal code of a request with this error, from the variant and the field it names
    /// (the readers of this module name the fields).
    fn code(&self) -> super::refusal::Code {
        use super::refusal::Code;
        let name = self.field().map_or("", |f| f.name);
        match self {
            WireError::NotUtf8 { .. } => Code::NotUtf8,
            WireError::Topic { .. } => Code::InvalidTopic,
            WireError::Negative { .. } if name == "delayMs" => Code::InvalidDelay,
            WireError::Negative { .. } if name == "ttlMs" => Code::InvalidTtl,
            WireError::TooLarge { .. } if name.starts_with("headers") => Code::TooManyHeaders,
            WireError::TooLong { .. } if name == "producerId" => Code::InvalidProducerId,
            WireError::TooLong { .. } if name == "payload" => Code::MessageTooLarge,
            WireError::MessageTooLarge { .. } => Code::MessageTooLarge,
            WireError::BatchTooLarge { .. } => Code::BatchTooLarge,
            WireError::UnknownEnumerant { .. } if name == "ackLevel" => Code::InvalidAckLevel,
            _ => Code::InvalidRequest,
        }
    }

    /// The field an error names, if any.
    fn field(&self) -> Option<Field> {
        match self {
            WireError::Capnp(_) | WireError::BatchTooLarge { .. } => None,
            WireError::NotUtf8 { field }
            | WireError::Topic { field, .. }
            | WireError::Tag { field, .. }
            | WireError::Negative { field, .. }
            | WireError::TooLarge { field, .. }
            | WireError::TooLong { field, .. }
            | WireError::MessageTooLarge { field, .. }
            | WireError::UnknownEnumerant { field, .. }
            | WireError::WrongLength { field, .. } => Some(*field),
        }
    }
}

impl From<WireError> for capnp::Error {
    fn from(e: WireError) -> capnp::Error {
        e.into_capnp()
    }
}

/// Where in a message a problem is, for error texts: a field name and, inside a batch, the index
/// of the entry (`messages[3].topic`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub index: Option<u32>,
    pub list: &'static str,
}

impl Field {
    pub const fn top(name: &'static str) -> Field {
        Field {
            name,
            index: None,
            list: "",
        }
    }

    pub const fn at(list: &'static str, index: u32, name: &'static str) -> Field {
        Field {
            name,
            index: Some(index),
            list,
        }
    }
}

impl std::fmt::Display for Field {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            Some(i) if self.name.is_empty() => write!(f, "{}[{i}]", self.list),
            Some(i) => write!(f, "{}[{i}].{}", self.list, self.name),
            None => f.write_str(self.name),
        }
    }
}

/// A list length as the wire carries it (`u32`).
fn wire_len(len: usize, field: Field) -> Result<u32, WireError> {
    u32::try_from(len).map_err(|_| WireError::TooLarge {
        field,
        value: len as u64,
        max: u64::from(u32::MAX),
    })
}

fn text<'a>(reader: capnp::text::Reader<'a>, field: Field) -> Result<&'a str, WireError> {
    reader.to_str().map_err(|_| WireError::NotUtf8 { field })
}

// ---------------------------------------------------------------------------------------------
// Ack levels and tag results

impl From<AckLevel> for WireAckLevel {
    fn from(level: AckLevel) -> WireAckLevel {
        match level {
            AckLevel::Durable => WireAckLevel::Durable,
            AckLevel::Leader => WireAckLevel::Leader,
            AckLevel::None => WireAckLevel::None,
        }
    }
}

impl From<WireAckLevel> for AckLevel {
    fn from(level: WireAckLevel) -> AckLevel {
        match level {
            WireAckLevel::Durable => AckLevel::Durable,
            WireAckLevel::Leader => AckLevel::Leader,
            WireAckLevel::None => AckLevel::None,
        }
    }
}

/// Reads an ack level; an enumerant this build does not know is refused, never guessed.
pub fn read_ack_level(
    level: Result<WireAckLevel, capnp::NotInSchema>,
) -> Result<AckLevel, WireError> {
    level
        .map(AckLevel::from)
        .map_err(|e| WireError::UnknownEnumerant {
            field: Field::top("ackLevel"),
            value: e.0,
        })
}

/// Writes one result per tag, in order.
pub fn write_tag_results(mut list: enum_list::Builder<'_, TagResult>, results: &[TagResult]) {
    debug_assert_eq!(list.len() as usize, results.len());
    for (i, result) in (0u32..).zip(results) {
        list.set(i, *result);
    }
}

/// Reads the per-tag results of an ack, nack or touch reply.
pub fn read_tag_results(
    list: enum_list::Reader<'_, TagResult>,
) -> Result<Vec<TagResult>, WireError> {
    (0..list.len())
        .map(|i| {
            list.get(i).map_err(|e| WireError::UnknownEnumerant {
                field: Field::at("results", i, ""),
                value: e.0,
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Tags and ids

/// Writes delivery tags into a `List(Data)` initialised with `tags.len()` entries.
pub fn write_tags(mut list: data_list::Builder<'_>, tags: &[EventKey]) {
    debug_assert_eq!(list.len() as usize, tags.len());
    for (i, tag) in (0u32..).zip(tags) {
        list.set(i, tag.as_bytes());
    }
}

/// Parses one tag of a client's ack, nack or touch: the server answers a bad tag with
/// [`TagResult::Malformed`] for that entry rather than failing the whole call.
pub fn parse_tag(list: data_list::Reader<'_>, index: u32) -> Result<EventKey, WireError> {
    let bytes = list.get(index)?;
    EventKey::parse(bytes).map_err(|source| WireError::Tag {
        field: Field::at("tags", index, ""),
        source,
    })
}

/// The tags of an ACK, NACK or touch, parsed once at the edge: the well-formed ones as
/// [`EventKey`]s in request order, which is all the owning shard sees, and where each sits in the
/// request. A tag that is not an event key is answered "malformed" for its entry by
/// [`SettleTags::answers`] rather than failing the whole call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SettleTags {
    pub keys: Vec<EventKey>,
    /// `places[i]` is the index in the request of `keys[i]`.
    places: Vec<u32>,
    len: u32,
}

impl SettleTags {
    /// Parses every tag of `list`; only a broken Cap'n Proto list is an error.
    pub fn read(list: data_list::Reader<'_>) -> Result<SettleTags, WireError> {
        let len = list.len();
        let mut tags = SettleTags {
            keys: Vec::with_capacity(len as usize),
            places: Vec::with_capacity(len as usize),
            len,
        };
        for i in 0..len {
            match parse_tag(list, i) {
                Ok(key) => {
                    tags.keys.push(key);
                    tags.places.push(i);
                }
                Err(WireError::Capnp(e)) => return Err(WireError::Capnp(e)),
                Err(_) => {}
            }
        }
        Ok(tags)
    }

    /// Number of tags in the request, well formed or not.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One answer per tag of the request, in its order: `settled[i]` for the `i`-th well-formed
    /// tag (`keys[i]`, which the caller may have taken to send on), `malformed` for every tag that
    /// was not an event key.
    pub fn answers<T: Copy>(&self, settled: &[T], malformed: T) -> Vec<T> {
        assert_eq!(
            settled.len(),
            self.places.len(),
            "one settle result per well-formed tag"
        );
        let mut out = vec![malformed; self.len as usize];
        for (place, result) in self.places.iter().zip(settled) {
            out[*place as usize] = *result;
        }
        out
    }
}

/// Reads a list of tags a peer must have sent well formed (the tags of a publish reply): any bad
/// tag fails the whole list.
pub fn read_tags(list: data_list::Reader<'_>) -> Result<Vec<EventKey>, WireError> {
    (0..list.len()).map(|i| parse_tag(list, i)).collect()
}

/// Reads a consumer id (a 16-byte UUID).
pub fn read_consumer_id(bytes: &[u8]) -> Result<Uuid, WireError> {
    Uuid::from_slice(bytes).map_err(|_| WireError::WrongLength {
        field: Field::top("consumerId"),
        len: bytes.len(),
        expected: super::CONSUMER_ID_BYTES as usize,
    })
}

// ---------------------------------------------------------------------------------------------
// Publish

/// A message to publish, as a client builds it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PublishMessage {
    pub topic: String,
    pub payload: Vec<u8>,
    /// Milliseconds from enqueue until the message is due; 0 = at once.
    pub delay_ms: u64,
    /// Milliseconds from enqueue until the message expires; 0 = never.
    pub ttl_ms: u64,
    pub headers: Vec<Header>,
    /// Idempotent publish: who numbers this message; empty = not idempotent.
    pub producer_id: String,
    /// Idempotent publish: the message's number in `producer_id`'s sequence.
    pub sequence: u64,
}

impl PublishMessage {
    /// A message due at once that never expires.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> PublishMessage {
        PublishMessage {
            topic: topic.into(),
            payload: payload.into(),
            ..PublishMessage::default()
        }
    }
}

impl PublishMessage {
    /// This message as the server's reader would have produced it from the wire (in-process
    /// publishers, tests and benches); not yet checked against any limit.
    pub fn borrow(&self) -> PublishMessageRef<'_> {
        PublishMessageRef {
            topic: &self.topic,
            payload: &self.payload,
            delay_ms: self.delay_ms,
            ttl_ms: self.ttl_ms,
            headers: self
                .headers
                .iter()
                .map(|h| HeaderRef {
                    key: &h.key,
                    value: &h.value,
                })
                .collect(),
            producer_id: &self.producer_id,
            sequence: self.sequence,
        }
    }

    /// This message numbered `sequence` by `producer_id` (idempotent publish).
    pub fn with_sequence(mut self, producer_id: impl Into<String>, sequence: u64) -> Self {
        self.producer_id = producer_id.into();
        self.sequence = sequence;
        self
    }
}

/// The wire carries delays as `Int64` so that a server can refuse negatives from clients in
/// languages without unsigned integers; a Rust `u64` past `i64::MAX` cannot be sent.
fn signed_ms(value: u64, field: Field) -> Result<i64, WireError> {
    i64::try_from(value).map_err(|_| WireError::TooLarge {
        field,
        value,
        max: i64::MAX as u64,
    })
}

/// Fills one `PublishMessage` of a batch (`index` is for error texts).
pub fn write_publish_message(
    mut builder: publish_message::Builder<'_>,
    message: &PublishMessage,
    index: u32,
) -> Result<(), WireError> {
    builder.set_topic(message.topic.as_str());
    builder.set_payload(&message.payload);
    builder.set_delay_ms(signed_ms(
        message.delay_ms,
        Field::at("messages", index, "delayMs"),
    )?);
    builder.set_ttl_ms(signed_ms(
        message.ttl_ms,
        Field::at("messages", index, "ttlMs"),
    )?);
    if !message.headers.is_empty() {
        let count = wire_len(
            message.headers.len(),
            Field::at("messages", index, "headers"),
        )?;
        let mut list = builder.reborrow().init_headers(count);
        for (i, h) in (0u32..).zip(&message.headers) {
            let mut entry = list.reborrow().get(i);
            entry.set_key(h.key.as_str());
            entry.set_value(&h.value);
        }
    }
    if !message.producer_id.is_empty() {
        builder.set_producer_id(message.producer_id.as_str());
        builder.set_sequence(message.sequence);
    }
    Ok(())
}

/// Fills a `List(PublishMessage)` with a whole batch.
pub fn write_publish_batch(
    mut list: struct_list::Builder<'_, publish_message::Owned>,
    messages: &[PublishMessage],
) -> Result<(), WireError> {
    debug_assert_eq!(list.len() as usize, messages.len());
    for (i, message) in (0u32..).zip(messages) {
        write_publish_message(list.reborrow().get(i), message, i)?;
    }
    Ok(())
}

/// The broker's limits on a publish batch (`[publish]` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishLimits {
    pub message_bytes_max: usize,
    pub batch_len_max: usize,
}

impl From<&PublishConfig> for PublishLimits {
    fn from(config: &PublishConfig) -> PublishLimits {
        PublishLimits {
            message_bytes_max: config.message_bytes_max,
            batch_len_max: config.batch_len_max,
        }
    }
}

/// A validated message of a publish request, borrowing from the request: topic 1..=255 bytes of
/// UTF-8, payload within the limit, non-negative delay and TTL, UTF-8 header keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishMessageRef<'a> {
    pub topic: &'a str,
    pub payload: &'a [u8],
    pub delay_ms: u64,
    pub ttl_ms: u64,
    pub headers: Vec<HeaderRef<'a>>,
    /// Idempotent publish: empty = not idempotent (`sequence` is then ignored).
    pub producer_id: &'a str,
    pub sequence: u64,
}

impl PublishMessageRef<'_> {
    /// The bytes `publish.maxMessageBytes` and `publish.maxBytesInFlight` count: the payload and
    /// every header's name and value (the topic has its own bound).
    pub fn counted_bytes(&self) -> usize {
        self.headers.iter().fold(self.payload.len(), |sum, h| {
            sum.saturating_add(h.key.len())
                .saturating_add(h.value.len())
        })
    }

    /// The stored form of this message, enqueued at `enqueued_at_ms` (the broker's clock).
    pub fn to_stored(&self, enqueued_at_ms: u64) -> StoredMessage {
        StoredMessage {
            topic: self.topic.to_owned(),
            payload: self.payload.to_vec(),
            enqueued_at_ms,
            delay_ms: self.delay_ms,
            ttl_ms: self.ttl_ms,
            headers: self
                .headers
                .iter()
                .map(|h| Header {
                    key: h.key.to_owned(),
                    value: h.value.to_vec(),
                })
                .collect(),
        }
    }

    /// Archives this message straight from the borrowed fields (the one copy of its payload on
    /// the publish path); the owning shard stamps the enqueue time in later.
    pub fn archive(&self) -> Result<UnstampedValue, CodecError> {
        UnstampedValue::encode(&StoredMessageRef {
            topic: self.topic,
            payload: self.payload,
            enqueued_at_ms: 0,
            delay_ms: self.delay_ms,
            ttl_ms: self.ttl_ms,
            headers: &self.headers,
        })
    }

    /// The message as a client would have built it (tests and tools).
    pub fn to_owned_message(&self) -> PublishMessage {
        let stored = self.to_stored(0);
        PublishMessage {
            topic: stored.topic,
            payload: stored.payload,
            delay_ms: stored.delay_ms,
            ttl_ms: stored.ttl_ms,
            headers: stored.headers,
            producer_id: self.producer_id.to_owned(),
            sequence: self.sequence,
        }
    }
}

fn unsigned_ms(value: i64, field: Field) -> Result<u64, WireError> {
    u64::try_from(value).map_err(|_| WireError::Negative { field, value })
}

/// Headers one published message may carry (PRODUCT.md §5; README, "Client limits").
pub const HEADERS_PER_MESSAGE_MAX: u32 = 256;

/// Reads and validates one message of a publish batch (`index` is for error texts). What only
/// the wire can get wrong (UTF-8, signs) is checked while reading; the limits are checked by
/// [`check_publish_message`], the one check in-process publishers go through too.
pub fn read_publish_message<'a>(
    reader: publish_message::Reader<'a>,
    index: u32,
    limits: &PublishLimits,
) -> Result<PublishMessageRef<'a>, WireError> {
    let topic = text(reader.get_topic()?, Field::at("messages", index, "topic"))?;
    let payload = reader.get_payload()?;
    let delay_ms = unsigned_ms(
        reader.get_delay_ms(),
        Field::at("messages", index, "delayMs"),
    )?;
    let ttl_ms = unsigned_ms(reader.get_ttl_ms(), Field::at("messages", index, "ttlMs"))?;
    let headers = if reader.has_headers() {
        let list = reader.get_headers()?;
        // Checked before anything is allocated: a list of zero-sized structs costs no bytes on
        // the wire, so its length alone could ask for gigabytes.
        if list.len() > HEADERS_PER_MESSAGE_MAX {
            return Err(WireError::TooLarge {
                field: Field::at("messages", index, "headers (count)"),
                value: u64::from(list.len()),
                max: u64::from(HEADERS_PER_MESSAGE_MAX),
            });
        }
        let mut headers = Vec::with_capacity(list.len() as usize);
        for h in list.iter() {
            headers.push(HeaderRef {
                key: text(h.get_key()?, Field::at("messages", index, "headers.key"))?,
                value: h.get_value()?,
            });
        }
        headers
    } else {
        Vec::new()
    };
    let producer_id = if reader.has_producer_id() {
        text(
            reader.get_producer_id()?,
            Field::at("messages", index, "producerId"),
        )?
    } else {
        ""
    };
    let message = PublishMessageRef {
        topic,
        payload,
        delay_ms,
        ttl_ms,
        headers,
        producer_id,
        sequence: reader.get_sequence(),
    };
    check_publish_message(&message, index, limits)?;
    Ok(message)
}

/// Checks one message against the protocol and the broker's limits: topic 1..=255 bytes, payload
/// and headers together within `publish.maxMessageBytes`.
#[inline]
pub fn check_publish_message(
    message: &PublishMessageRef<'_>,
    index: u32,
    limits: &PublishLimits,
) -> Result<(), WireError> {
    validate_topic(message.topic).map_err(|source| WireError::Topic {
        field: Field::at("messages", index, "topic"),
        source,
    })?;
    if message.producer_id.len() > PRODUCER_ID_LEN_MAX {
        return Err(WireError::TooLong {
            field: Field::at("messages", index, "producerId"),
            len: message.producer_id.len(),
            max: PRODUCER_ID_LEN_MAX,
        });
    }
    let bytes = message.counted_bytes();
    if bytes > limits.message_bytes_max && message.headers.is_empty() {
        return Err(WireError::TooLong {
            field: Field::at("messages", index, "payload"),
            len: bytes,
            max: limits.message_bytes_max,
        });
    }
    if bytes > limits.message_bytes_max {
        return Err(WireError::MessageTooLarge {
            field: Field::at("messages", index, ""),
            bytes,
            max: limits.message_bytes_max,
        });
    }
    Ok(())
}

/// Checks a batch's length against `publish.maxBatchMessages`.
pub fn check_publish_batch_len(len: usize, limits: &PublishLimits) -> Result<(), WireError> {
    if len > limits.batch_len_max {
        return Err(WireError::BatchTooLarge {
            len,
            max: limits.batch_len_max,
        });
    }
    Ok(())
}

/// Reads and validates a whole publish batch: the first bad message fails it all, as the
/// protocol requires (a refused batch writes nothing).
pub fn read_publish_batch<'a>(
    list: struct_list::Reader<'a, publish_message::Owned>,
    limits: &PublishLimits,
) -> Result<Vec<PublishMessageRef<'a>>, WireError> {
    check_publish_batch_len(list.len() as usize, limits)?;
    (0..list.len())
        .map(|i| read_publish_message(list.get(i), i, limits))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Deliveries

/// What a delivery needs from a stored message, so the server can send straight from an rkyv
/// archive (no copy on the dispatch path) and tests can send from an owned message.
pub trait DeliveryContent {
    fn topic(&self) -> &str;
    fn payload(&self) -> &[u8];
    fn enqueued_at_ms(&self) -> u64;
    fn delay_ms(&self) -> u64;
    fn header_count(&self) -> usize;
    /// Header `i` as (key, value); `i < header_count()`.
    fn header(&self, i: usize) -> (&str, &[u8]);
}

impl DeliveryContent for StoredMessage {
    fn topic(&self) -> &str {
        &self.topic
    }
    fn payload(&self) -> &[u8] {
        &self.payload
    }
    fn enqueued_at_ms(&self) -> u64 {
        self.enqueued_at_ms
    }
    fn delay_ms(&self) -> u64 {
        self.delay_ms
    }
    fn header_count(&self) -> usize {
        self.headers.len()
    }
    fn header(&self, i: usize) -> (&str, &[u8]) {
        let h = &self.headers[i];
        (&h.key, &h.value)
    }
}

impl DeliveryContent for ArchivedStoredMessage {
    fn topic(&self) -> &str {
        self.topic.as_str()
    }
    fn payload(&self) -> &[u8] {
        self.payload.as_slice()
    }
    fn enqueued_at_ms(&self) -> u64 {
        ArchivedStoredMessage::enqueued_at_ms(self)
    }
    fn delay_ms(&self) -> u64 {
        ArchivedStoredMessage::delay_ms(self)
    }
    fn header_count(&self) -> usize {
        self.headers.len()
    }
    fn header(&self, i: usize) -> (&str, &[u8]) {
        let h = &self.headers[i];
        (h.key.as_str(), h.value.as_slice())
    }
}

/// One delivery the server is about to send.
#[derive(Debug, Clone, Copy)]
pub struct OutgoingDelivery<'a, M: ?Sized> {
    pub tag: EventKey,
    pub message: &'a M,
    /// 1 on the first delivery to a recipient.
    pub attempt: u32,
}

/// Fills one `Delivery`.
pub fn write_delivery<M: DeliveryContent + ?Sized>(
    mut builder: delivery::Builder<'_>,
    delivery: &OutgoingDelivery<'_, M>,
) {
    let message = delivery.message;
    builder.set_topic(message.topic());
    builder.set_payload(message.payload());
    builder.set_tag(delivery.tag.as_bytes());
    builder.set_enqueued_at_ms(message.enqueued_at_ms());
    builder.set_delay_ms(message.delay_ms());
    builder.set_attempt(delivery.attempt);
    let count = message.header_count();
    if count > 0 {
        // A stored message's headers came through a `List(Header)`, so they fit in one.
        let mut list = builder.init_headers(count.min(u32::MAX as usize) as u32);
        for i in 0..list.len() {
            let (key, value) = message.header(i as usize);
            let mut entry = list.reborrow().get(i);
            entry.set_key(key);
            entry.set_value(value);
        }
    }
}

/// Fills a `List(Delivery)` initialised with `deliveries.len()` entries.
pub fn write_deliveries<M: DeliveryContent + ?Sized>(
    mut list: struct_list::Builder<'_, delivery::Owned>,
    deliveries: &[OutgoingDelivery<'_, M>],
) {
    debug_assert_eq!(list.len() as usize, deliveries.len());
    for (i, d) in (0u32..).zip(deliveries) {
        write_delivery(list.reborrow().get(i), d);
    }
}

/// A message as a consumer receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub topic: String,
    pub payload: Vec<u8>,
    /// The delivery tag to ack, nack or touch.
    pub tag: EventKey,
    /// When the broker accepted the message (ms since the Unix epoch, broker clock).
    pub enqueued_at_ms: u64,
    pub delay_ms: u64,
    /// 1 on the first delivery to this recipient.
    pub attempt: u32,
    pub headers: Vec<Header>,
}

/// Reads one `Delivery` into an owned value (the request's buffer is released when the
/// `deliver` call returns, so a consumer must copy what it keeps).
pub fn read_delivery(reader: delivery::Reader<'_>, index: u32) -> Result<Delivery, WireError> {
    let topic = text(reader.get_topic()?, Field::at("deliveries", index, "topic"))?;
    let tag_bytes = reader.get_tag()?;
    let tag = EventKey::parse(tag_bytes).map_err(|source| WireError::Tag {
        field: Field::at("deliveries", index, "tag"),
        source,
    })?;
    let headers = if reader.has_headers() {
        read_headers(
            reader.get_headers()?,
            Field::at("deliveries", index, "headers.key"),
        )?
    } else {
        Vec::new()
    };
    Ok(Delivery {
        topic: topic.to_owned(),
        payload: reader.get_payload()?.to_vec(),
        tag,
        enqueued_at_ms: reader.get_enqueued_at_ms(),
        delay_ms: reader.get_delay_ms(),
        attempt: reader.get_attempt(),
        headers,
    })
}

/// Reads a whole `List(Delivery)`.
pub fn read_deliveries(
    list: struct_list::Reader<'_, delivery::Owned>,
) -> Result<Vec<Delivery>, WireError> {
    (0..list.len())
        .map(|i| read_delivery(list.get(i), i))
        .collect()
}

fn read_headers(
    list: struct_list::Reader<'_, header::Owned>,
    key_field: Field,
) -> Result<Vec<Header>, WireError> {
    list.iter()
        .map(|h| {
            Ok(Header {
                key: text(h.get_key()?, key_field)?.to_owned(),
                value: h.get_value()?.to_vec(),
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Topology and stats

/// One shard of the broker and its own port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardInfo {
    pub shard_id: u32,
    pub host: String,
    pub port: u16,
    pub cpu: u32,
    /// In a cluster: the node leading the shard (0: none known, or standalone).
    pub leader_node_id: u64,
    pub term: u64,
    /// In a cluster: the leader's client address (empty when unknown).
    pub leader_address: String,
}

/// Fills one `ShardInfo`.
pub fn write_shard_info(mut builder: shard_info::Builder<'_>, shard: &ShardInfo) {
    builder.set_shard_id(shard.shard_id);
    builder.set_host(shard.host.as_str());
    builder.set_port(shard.port);
    builder.set_cpu(shard.cpu);
    builder.set_leader_node_id(shard.leader_node_id);
    builder.set_term(shard.term);
    builder.set_leader_address(shard.leader_address.as_str());
}

/// Fills a `List(ShardInfo)` initialised with `shards.len()` entries.
pub fn write_topology(mut list: struct_list::Builder<'_, shard_info::Owned>, shards: &[ShardInfo]) {
    debug_assert_eq!(list.len() as usize, shards.len());
    for (i, shard) in (0u32..).zip(shards) {
        write_shard_info(list.reborrow().get(i), shard);
    }
}

/// Reads a topology reply.
pub fn read_topology(
    list: struct_list::Reader<'_, shard_info::Owned>,
) -> Result<Vec<ShardInfo>, WireError> {
    (0..list.len())
        .map(|i| {
            let s = list.get(i);
            Ok(ShardInfo {
                shard_id: s.get_shard_id(),
                host: text(s.get_host()?, Field::at("shards", i, "host"))?.to_owned(),
                port: s.get_port(),
                cpu: s.get_cpu(),
                leader_node_id: s.get_leader_node_id(),
                term: s.get_term(),
                leader_address: text(
                    s.get_leader_address()?,
                    Field::at("shards", i, "leaderAddress"),
                )?
                .to_owned(),
            })
        })
        .collect()
}

/// Counters of one shard (see `ShardStats` in the schema for each one's meaning).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ShardStats {
    pub shard_id: u32,
    pub published: u64,
    pub dispatched: u64,
    pub acked: u64,
    pub nacked: u64,
    pub in_flight: u64,
    pub active_consumers: u64,
    pub redeliveries: u64,
    pub expired: u64,
    pub delete_failures: u64,
    pub backlog: u64,
    pub scheduled: u64,
    pub counted: bool,
    pub delayed: u64,
}

/// Counters of one recipient of a topic (see `GroupStats` in the schema).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GroupStats {
    pub topic: String,
    /// Empty for the universal consumers of the topic taken together.
    pub group: String,
    pub shard_id: u32,
    pub consumers: u32,
    pub backlog: u64,
    pub in_flight: u64,
    pub dispatched: u64,
    pub acked: u64,
    pub nacked: u64,
    pub redeliveries: u64,
    pub expired: u64,
    pub dead_lettered: u64,
    pub scheduled: u64,
    pub delayed: u64,
}

/// Messages of one topic on its shard (see `TopicStats` in the schema).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TopicStats {
    /// Empty for the sum of the topics a shard does not count one by one.
    pub topic: String,
    pub shard_id: u32,
    pub stored: u64,
    pub due: u64,
    pub scheduled: u64,
    pub in_flight: u64,
    pub groups: u32,
}

/// The broker's counters, as `Broker.stats` returns them.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub shards: Vec<ShardStats>,
    pub groups: Vec<GroupStats>,
    pub topics: Vec<TopicStats>,
}

fn write_shard_stats(mut b: shard_stats::Builder<'_>, s: &ShardStats) {
    b.set_shard_id(s.shard_id);
    b.set_published(s.published);
    b.set_dispatched(s.dispatched);
    b.set_acked(s.acked);
    b.set_nacked(s.nacked);
    b.set_in_flight(s.in_flight);
    b.set_active_consumers(s.active_consumers);
    b.set_redeliveries(s.redeliveries);
    b.set_expired(s.expired);
    b.set_delete_failures(s.delete_failures);
    b.set_backlog(s.backlog);
    b.set_scheduled(s.scheduled);
    b.set_counted(s.counted);
    b.set_delayed(s.delayed);
}

fn write_group_stats(mut b: group_stats::Builder<'_>, g: &GroupStats) {
    b.set_topic(g.topic.as_str());
    b.set_group(g.group.as_str());
    b.set_shard_id(g.shard_id);
    b.set_consumers(g.consumers);
    b.set_backlog(g.backlog);
    b.set_in_flight(g.in_flight);
    b.set_dispatched(g.dispatched);
    b.set_acked(g.acked);
    b.set_nacked(g.nacked);
    b.set_redeliveries(g.redeliveries);
    b.set_expired(g.expired);
    b.set_dead_lettered(g.dead_lettered);
    b.set_scheduled(g.scheduled);
    b.set_delayed(g.delayed);
}

fn write_topic_stats(mut b: topic_stats::Builder<'_>, t: &TopicStats) {
    b.set_topic(t.topic.as_str());
    b.set_shard_id(t.shard_id);
    b.set_stored(t.stored);
    b.set_due(t.due);
    b.set_scheduled(t.scheduled);
    b.set_in_flight(t.in_flight);
    b.set_groups(t.groups);
}

/// Fills a `Stats`.
pub fn write_stats(mut builder: stats::Builder<'_>, s: &Stats) -> Result<(), WireError> {
    let mut shards = builder
        .reborrow()
        .init_shards(wire_len(s.shards.len(), Field::top("shards"))?);
    for (i, shard) in (0u32..).zip(&s.shards) {
        write_shard_stats(shards.reborrow().get(i), shard);
    }
    let mut groups = builder
        .reborrow()
        .init_groups(wire_len(s.groups.len(), Field::top("groups"))?);
    for (i, group) in (0u32..).zip(&s.groups) {
        write_group_stats(groups.reborrow().get(i), group);
    }
    let mut topics = builder.init_topics(wire_len(s.topics.len(), Field::top("topics"))?);
    for (i, topic) in (0u32..).zip(&s.topics) {
        write_topic_stats(topics.reborrow().get(i), topic);
    }
    Ok(())
}

/// Reads a `Stats`.
pub fn read_stats(reader: stats::Reader<'_>) -> Result<Stats, WireError> {
    let shards = reader
        .get_shards()?
        .iter()
        .map(|s| ShardStats {
            shard_id: s.get_shard_id(),
            published: s.get_published(),
            dispatched: s.get_dispatched(),
            acked: s.get_acked(),
            nacked: s.get_nacked(),
            in_flight: s.get_in_flight(),
            active_consumers: s.get_active_consumers(),
            redeliveries: s.get_redeliveries(),
            expired: s.get_expired(),
            delete_failures: s.get_delete_failures(),
            backlog: s.get_backlog(),
            scheduled: s.get_scheduled(),
            counted: s.get_counted(),
            delayed: s.get_delayed(),
        })
        .collect();
    let list = reader.get_groups()?;
    let mut groups = Vec::with_capacity(list.len() as usize);
    for (i, g) in (0u32..).zip(list.iter()) {
        groups.push(GroupStats {
            topic: text(g.get_topic()?, Field::at("groups", i, "topic"))?.to_owned(),
            group: text(g.get_group()?, Field::at("groups", i, "group"))?.to_owned(),
            shard_id: g.get_shard_id(),
            consumers: g.get_consumers(),
            backlog: g.get_backlog(),
            in_flight: g.get_in_flight(),
            dispatched: g.get_dispatched(),
            acked: g.get_acked(),
            nacked: g.get_nacked(),
            redeliveries: g.get_redeliveries(),
            expired: g.get_expired(),
            dead_lettered: g.get_dead_lettered(),
            scheduled: g.get_scheduled(),
            delayed: g.get_delayed(),
        });
    }
    let list = reader.get_topics()?;
    let mut topics = Vec::with_capacity(list.len() as usize);
    for (i, t) in (0u32..).zip(list.iter()) {
        topics.push(TopicStats {
            topic: text(t.get_topic()?, Field::at("topics", i, "topic"))?.to_owned(),
            shard_id: t.get_shard_id(),
            stored: t.get_stored(),
            due: t.get_due(),
            scheduled: t.get_scheduled(),
            in_flight: t.get_in_flight(),
            groups: t.get_groups(),
        });
    }
    Ok(Stats {
        shards,
        groups,
        topics,
    })
}

#[cfg(test)]
mod tests;
