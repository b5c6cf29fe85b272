//! Typed refusals: the stable codes a client can match on when the broker refuses a request
//! (a configured bound is reached, the node cannot take it now, or the request breaks the
//! protocol or a `[publish]` limit), and the [`Refusal`] that carries one with the index of the
//! offending batch entry.
//!
//! On the wire a refusal travels as the connection's `hello` negotiated (`schema/pinq.capnp`,
//! "Errors"): on protocol 2 as the `Refusal` struct in the results of `publish`, `ack`, `nack`
//! and `touch` ([`Refusal::write`], [`Refusal::read`]); on protocol 1, and for every other call,
//! as a Cap'n Proto exception ([`Refusal::into_capnp`]) whose text is the refusal's message. For
//! a bound that message starts with the code, a colon and a space, then a sentence naming the
//! bound and its config key, for example
//! `tooManyConnections: this node serves 4096 connections, the limit server.maxConnections`.
//! Retryable refusals (the node is busy) travel as `overloaded` exceptions, the others as
//! `failed`. Clients of protocol 1 split the text at the first ": " to get the code (README,
//! "Limits and faults"); the Rust client does it in [`code_of`].
//!
//! The bounds ([`Code::ALL`]) are counted per shard in `pinq_refusals_total{code}`: the server
//! calls `Shard::refused(code)` where it refuses, and the metrics snapshot carries
//! [`RefusalCounts`]. Refusals of bad requests ([`Code::INVALID`]) are not counted there.
//! This module does no I/O and keeps no state.

use super::pinq_capnp::{refusal, RefusalCode, NO_INDEX};
use super::WireError;

/// A refusal's code. The names are part of the protocol: never rename one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    /// The node serves `server.maxConnections` connections already.
    TooManyConnections,
    /// The connection has `server.maxCallsInFlight` calls unanswered.
    TooManyCalls,
    /// The connection has `server.maxSubscriptionsPerConnection` subscriptions open.
    TooManySubscriptions,
    /// The shard holds `publish.maxBytesInFlight` bytes of publishes not yet stored, for longer
    /// than a publish may wait for room.
    PublishBytesInFlight,
    /// The topic has `delivery.maxGroupsPerTopic` groups, or the shard `maxGroupsPerShard`.
    TooManyGroups,
    /// The group has `delivery.maxConsumersPerGroup` consumers.
    TooManyConsumers,
    /// The shard's disk is full: writes are refused until space returns (reads go on).
    DiskFull,
    /// Tokens are configured (`auth.tokens`) and `hello` carried none, or one the broker does
    /// not accept. The text never says which part of a token was wrong.
    Unauthenticated,
    /// The connection's token does not allow the call; the text names the token, the action
    /// and the topic.
    Forbidden,
    /// A call came before a successful `Broker.hello`.
    HelloRequired,
    /// `hello` carried a `clientVersion` this broker does not speak.
    UnsupportedVersion,
    /// A message's topic is empty or longer than 255 bytes.
    InvalidTopic,
    /// A text field of a message (topic, header key, producer id) is not UTF-8.
    NotUtf8,
    /// A message's payload and headers exceed `publish.maxMessageBytes`.
    MessageTooLarge,
    /// A message has more headers than `rpc::HEADERS_PER_MESSAGE_MAX`.
    TooManyHeaders,
    /// A message's producer id is longer than `rpc::PRODUCER_ID_LEN_MAX`.
    InvalidProducerId,
    /// A message's delay is negative.
    InvalidDelay,
    /// A message's TTL is negative.
    InvalidTtl,
    /// The batch has more messages than `publish.maxBatchMessages`.
    BatchTooLarge,
    /// The ack level is a value this build does not know.
    InvalidAckLevel,
    /// The ack level is weaker than `publish.minAckLevel`.
    AckLevelTooLow,
    /// A settle call on a subscription that is closed, or that the broker ended.
    SubscriptionClosed,
    /// Another field of the request breaks the protocol; the message names it.
    InvalidRequest,
}

impl Code {
    /// Every bound's code (counted in `pinq_refusals_total`), in the order [`RefusalCounts`]
    /// keeps them.
    pub const ALL: [Code; 11] = [
        Code::TooManyConnections,
        Code::TooManyCalls,
        Code::TooManySubscriptions,
        Code::PublishBytesInFlight,
        Code::TooManyGroups,
        Code::TooManyConsumers,
        Code::DiskFull,
        Code::Unauthenticated,
        Code::Forbidden,
        Code::HelloRequired,
        Code::UnsupportedVersion,
    ];

    /// The codes of requests that break the protocol or a `[publish]` limit (not counted).
    pub const INVALID: [Code; 12] = [
        Code::InvalidTopic,
        Code::NotUtf8,
        Code::MessageTooLarge,
        Code::TooManyHeaders,
        Code::InvalidProducerId,
        Code::InvalidDelay,
        Code::InvalidTtl,
        Code::BatchTooLarge,
        Code::InvalidAckLevel,
        Code::AckLevelTooLow,
        Code::SubscriptionClosed,
        Code::InvalidRequest,
    ];

    /// Every code: the bounds, then the invalid requests.
    pub fn every() -> impl Iterator<Item = Code> {
        Code::ALL.into_iter().chain(Code::INVALID)
    }

    /// The code as it appears on the wire and in the metric's label.
    pub fn name(self) -> &'static str {
        match self {
            Code::TooManyConnections => "tooManyConnections",
            Code::TooManyCalls => "tooManyCalls",
            Code::TooManySubscriptions => "tooManySubscriptions",
            Code::PublishBytesInFlight => "publishBytesInFlight",
            Code::TooManyGroups => "tooManyGroups",
            Code::TooManyConsumers => "tooManyConsumers",
            Code::DiskFull => "diskFull",
            Code::Unauthenticated => "unauthenticated",
            Code::Forbidden => "forbidden",
            Code::HelloRequired => "helloRequired",
            Code::UnsupportedVersion => "unsupportedVersion",
            Code::InvalidTopic => "invalidTopic",
            Code::NotUtf8 => "notUtf8",
            Code::MessageTooLarge => "messageTooLarge",
            Code::TooManyHeaders => "tooManyHeaders",
            Code::InvalidProducerId => "invalidProducerId",
            Code::InvalidDelay => "invalidDelay",
            Code::InvalidTtl => "invalidTtl",
            Code::BatchTooLarge => "batchTooLarge",
            Code::InvalidAckLevel => "invalidAckLevel",
            Code::AckLevelTooLow => "ackLevelTooLow",
            Code::SubscriptionClosed => "subscriptionClosed",
            Code::InvalidRequest => "invalidRequest",
        }
    }

    /// Whether the client may retry the same request later (sent as `overloaded`).
    pub fn retry_later(self) -> bool {
        matches!(
            self,
            Code::TooManyConnections
                | Code::TooManyCalls
                | Code::PublishBytesInFlight
                | Code::DiskFull
        )
    }

    /// Its counter in [`RefusalCounts`]; `None` for the codes not counted.
    fn counter(self) -> Option<usize> {
        Code::ALL.iter().position(|&c| c == self)
    }

    /// The refusal of a bound: its message is the code, ": " and `detail`, which names the
    /// bound and its config key.
    pub fn refusal(self, detail: impl std::fmt::Display) -> Refusal {
        Refusal::new(self, format!("{}: {detail}", self.name()))
    }

    /// The Cap'n Proto exception carrying this refusal (how it travels outside the calls that
    /// have a `refusal` field, and on protocol 1).
    pub fn error(self, detail: impl std::fmt::Display) -> capnp::Error {
        self.refusal(detail).into_capnp()
    }

    /// The schema's enumerant.
    pub fn to_wire(self) -> RefusalCode {
        match self {
            Code::TooManyConnections => RefusalCode::TooManyConnections,
            Code::TooManyCalls => RefusalCode::TooManyCalls,
            Code::TooManySubscriptions => RefusalCode::TooManySubscriptions,
            Code::PublishBytesInFlight => RefusalCode::PublishBytesInFlight,
            Code::TooManyGroups => RefusalCode::TooManyGroups,
            Code::TooManyConsumers => RefusalCode::TooManyConsumers,
            Code::DiskFull => RefusalCode::DiskFull,
            Code::Unauthenticated => RefusalCode::Unauthenticated,
            Code::Forbidden => RefusalCode::Forbidden,
            Code::HelloRequired => RefusalCode::HelloRequired,
            Code::UnsupportedVersion => RefusalCode::UnsupportedVersion,
            Code::InvalidTopic => RefusalCode::InvalidTopic,
            Code::NotUtf8 => RefusalCode::NotUtf8,
            Code::MessageTooLarge => RefusalCode::MessageTooLarge,
            Code::TooManyHeaders => RefusalCode::TooManyHeaders,
            Code::InvalidProducerId => RefusalCode::InvalidProducerId,
            Code::InvalidDelay => RefusalCode::InvalidDelay,
            Code::InvalidTtl => RefusalCode::InvalidTtl,
            Code::BatchTooLarge => RefusalCode::BatchTooLarge,
            Code::InvalidAckLevel => RefusalCode::InvalidAckLevel,
            Code::AckLevelTooLow => RefusalCode::AckLevelTooLow,
            Code::SubscriptionClosed => RefusalCode::SubscriptionClosed,
            Code::InvalidRequest => RefusalCode::InvalidRequest,
        }
    }

    /// The code of the schema's enumerant; `None` for `none` (no refusal).
    pub fn from_wire(code: RefusalCode) -> Option<Code> {
        Code::every().find(|c| c.to_wire() == code)
    }
}

/// A refused request: what a client matches on (`code`), which entry of the batch it was
/// (`index`, `None` for the call as a whole) and a sentence for people. Nothing of the request
/// was done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: Code,
    pub index: Option<u32>,
    pub message: String,
    /// The same request may succeed later; from the code, or as the broker said for a code
    /// this build reads but does not know.
    pub retryable: bool,
}

/// The message, then the code and the index from the fields: `messages[2].topic: topic name
/// is empty (invalidTopic, message 2)`.
impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}", self.message, self.code.name())?;
        if let Some(index) = self.index {
            write!(f, ", message {index}")?;
        }
        f.write_str(")")
    }
}

impl Refusal {
    /// A refusal of the call as a whole; `message` is the whole text.
    pub fn new(code: Code, message: impl Into<String>) -> Refusal {
        Refusal {
            code,
            index: None,
            message: message.into(),
            retryable: code.retry_later(),
        }
    }

    /// This refusal about entry `index` of the batch.
    pub fn at(mut self, index: Option<u32>) -> Refusal {
        self.index = index;
        self
    }

    /// The refusal as a protocol 1 client gets it: an exception whose description is the
    /// message, `overloaded` when retryable, else `failed`.
    pub fn into_capnp(self) -> capnp::Error {
        // Every refusal sent as an exception starts with its code (schema, "Errors"); a wire
        // error's message names the field ("messages[1].topic: ...") and gets the code before it.
        let name = self.code.name();
        let message = match self.message.strip_prefix(name) {
            Some(rest) if rest.starts_with(": ") => self.message,
            _ => format!("{name}: {}", self.message),
        };
        if self.retryable {
            capnp::Error::overloaded(message)
        } else {
            capnp::Error::failed(message)
        }
    }

    /// Fills a results' `refusal` field (protocol 2).
    pub fn write(&self, mut builder: refusal::Builder<'_>) {
        builder.set_code(self.code.to_wire());
        builder.set_index(self.index.unwrap_or(NO_INDEX));
        builder.set_message(self.message.as_str());
        builder.set_retryable(self.retryable);
    }

    /// Reads a results' `refusal` field: `None` when it is unset or its code is `none`. A code
    /// this build does not know reads as [`Code::InvalidRequest`], keeping the broker's
    /// `retryable` and a message that names the unknown value.
    pub fn read(present: bool, reader: refusal::Reader<'_>) -> Result<Option<Refusal>, WireError> {
        if !present {
            return Ok(None);
        }
        let message = reader
            .get_message()?
            .to_str()
            .map_err(|_| WireError::NotUtf8 {
                field: super::Field::top("refusal.message"),
            })?;
        let (code, message) = match reader.get_code() {
            Ok(code) => match Code::from_wire(code) {
                Some(code) => (code, message.to_owned()),
                None => return Ok(None),
            },
            Err(capnp::NotInSchema(value)) => (
                Code::InvalidRequest,
                format!("refusal code {value} (newer broker?): {message}"),
            ),
        };
        let index = Some(reader.get_index()).filter(|&i| i != NO_INDEX);
        Ok(Some(Refusal {
            code,
            index,
            message,
            retryable: reader.get_retryable(),
        }))
    }
}

/// The refusal code at the start of an exception's text, if it carries one.
pub fn code_of(text: &str) -> Option<Code> {
    // capnp-rpc may prefix remote exceptions ("remote exception: "): look for a known code
    // followed by ": " anywhere at a word start.
    Code::every().find(|code| {
        let tag = format!("{}: ", code.name());
        text.starts_with(&tag) || text.contains(&format!(" {tag}"))
    })
}

/// The text of a failure `method` sends as an exception: when `text` starts with a refusal's
/// code, the code comes first, as the schema promises ("tooManyGroups: subscribe: ..."), so a
/// client matching the start of the text finds it; otherwise "method: text".
pub fn code_first(method: &str, text: &str) -> String {
    Code::every()
        .find_map(|code| {
            let rest = text.strip_prefix(code.name())?.strip_prefix(": ")?;
            Some(format!("{}: {method}: {rest}", code.name()))
        })
        .unwrap_or_else(|| format!("{method}: {text}"))
}

/// Refusals counted by one shard, one counter per [`Code`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefusalCounts {
    counts: [u64; Code::ALL.len()],
}

impl RefusalCounts {
    /// Counts a refusal of a bound; the codes of invalid requests are not counted.
    pub fn add(&mut self, code: Code) {
        if let Some(slot) = code.counter().map(|i| &mut self.counts[i]) {
            *slot = slot.saturating_add(1);
        }
    }

    pub fn get(&self, code: Code) -> u64 {
        code.counter().map_or(0, |i| self.counts[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_round_trips_through_its_text() {
        for code in Code::ALL {
            let e = code.error("the limit x.y is 3");
            assert_eq!(code_of(&e.extra), Some(code), "{}", e.extra);
            let remote = format!("remote exception: {}", e.extra);
            assert_eq!(code_of(&remote), Some(code));
        }
        assert_eq!(code_of("tooManyCallsX: no"), None);
        assert_eq!(code_of("nothing here"), None);
    }

    #[test]
    fn refusals_sent_as_exceptions_start_with_their_code() {
        assert_eq!(
            code_first(
                "subscribe",
                "tooManyGroups: delivery.maxGroupsPerTopic is 2"
            ),
            "tooManyGroups: subscribe: delivery.maxGroupsPerTopic is 2"
        );
        assert_eq!(
            code_first("setGroupPolicy", "storage failed: gone"),
            "setGroupPolicy: storage failed: gone"
        );
        let wire = Refusal::new(Code::InvalidTopic, "messages[1].topic: topic name is empty");
        assert_eq!(
            wire.into_capnp().extra,
            "invalidTopic: messages[1].topic: topic name is empty"
        );
        let coded = Code::DiskFull.refusal("the disk is full");
        let e = coded.into_capnp();
        assert_eq!(e.extra, "diskFull: the disk is full", "no second prefix");
        assert_eq!(e.kind, capnp::ErrorKind::Overloaded);
    }

    #[test]
    fn every_code_has_its_name_and_ordinal_in_the_schema() {
        let schema = include_str!("../../schema/pinq.capnp");
        let mut names = std::collections::HashSet::new();
        for code in Code::every() {
            let line = format!("  {} @{};", code.name(), code.to_wire() as u16);
            assert!(schema.contains(&line), "schema lacks {line:?}");
            assert!(names.insert(code.name()), "{} twice", code.name());
            assert_eq!(Code::from_wire(code.to_wire()), Some(code));
        }
        assert_eq!(Code::from_wire(RefusalCode::None), None);
    }

    fn written(
        refusal: Option<&Refusal>,
    ) -> capnp::message::Builder<capnp::message::HeapAllocator> {
        let mut message = capnp::message::Builder::new_default();
        let mut results =
            message.init_root::<crate::rpc::pinq_capnp::broker::publish_results::Builder<'_>>();
        if let Some(refusal) = refusal {
            refusal.write(results.reborrow().init_refusal());
        }
        message
    }

    fn read_back(
        message: &capnp::message::Builder<capnp::message::HeapAllocator>,
    ) -> Option<Refusal> {
        let results = message
            .get_root_as_reader::<crate::rpc::pinq_capnp::broker::publish_results::Reader<'_>>()
            .unwrap();
        Refusal::read(results.has_refusal(), results.get_refusal().unwrap()).unwrap()
    }

    #[test]
    fn a_refusal_round_trips_through_the_results_field_with_its_index() {
        let at_two = Code::InvalidTopic
            .refusal("messages[2].topic: topic name is empty")
            .at(Some(2));
        assert_eq!(read_back(&written(Some(&at_two))), Some(at_two));
        let whole = Code::DiskFull.refusal("the disk is full");
        assert!(whole.retryable);
        let back = read_back(&written(Some(&whole))).unwrap();
        assert_eq!(back.index, None, "noIndex reads as the whole call");
        assert_eq!(back, whole);
        assert_eq!(read_back(&written(None)), None, "no field, no refusal");
    }

    #[test]
    fn an_unset_refusal_reads_as_code_none_and_the_whole_call() {
        let message = written(None);
        let results = message
            .get_root_as_reader::<crate::rpc::pinq_capnp::broker::publish_results::Reader<'_>>()
            .unwrap();
        let unset = results.get_refusal().unwrap();
        assert_eq!(unset.get_code().unwrap(), RefusalCode::None);
        assert_eq!(unset.get_index(), NO_INDEX);
        assert_eq!(Refusal::read(true, unset).unwrap(), None);
    }

    #[test]
    fn a_refusal_sent_as_an_exception_keeps_its_text_and_kind() {
        let e = Code::PublishBytesInFlight.refusal("full").into_capnp();
        assert_eq!(e.kind, capnp::ErrorKind::Overloaded);
        assert_eq!(e.extra, "publishBytesInFlight: full");
        let e = Refusal::new(Code::InvalidTopic, "messages[0].topic: x")
            .at(Some(0))
            .into_capnp();
        assert_eq!(e.kind, capnp::ErrorKind::Failed);
        // The code first, as every refusal sent as an exception (schema, "Errors").
        assert_eq!(e.extra, "invalidTopic: messages[0].topic: x");
    }

    #[test]
    fn invalid_request_codes_are_not_counted() {
        let mut c = RefusalCounts::default();
        c.add(Code::InvalidTopic);
        assert_eq!(c.get(Code::InvalidTopic), 0);
        assert!(Code::ALL.iter().all(|&code| c.get(code) == 0));
    }

    #[test]
    fn retryable_codes_travel_as_overloaded() {
        let e = Code::TooManyCalls.error("x");
        assert_eq!(e.kind, capnp::ErrorKind::Overloaded);
        let e = Code::TooManySubscriptions.error("x");
        assert_eq!(e.kind, capnp::ErrorKind::Failed);
    }

    #[test]
    fn counts_are_kept_per_code() {
        let mut c = RefusalCounts::default();
        c.add(Code::DiskFull);
        c.add(Code::DiskFull);
        c.add(Code::TooManyGroups);
        assert_eq!(c.get(Code::DiskFull), 2);
        assert_eq!(c.get(Code::TooManyGroups), 1);
        assert_eq!(c.get(Code::TooManyCalls), 0);
    }
}
