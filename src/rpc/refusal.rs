//! Typed refusals: the stable codes a client can match on when the broker refuses a request
//! because a configured bound is reached or the node cannot take it now.
//!
//! On the wire a refusal is a Cap'n Proto exception whose text starts with the code, a colon
//! and a space, then a sentence naming the bound and its config key, for example
//! `tooManyConnections: this node serves 4096 connections, the limit server.maxConnections`.
//! Bounds a client may retry after (the node is busy) travel as `overloaded` exceptions; bounds
//! that only a change of the client's behaviour lifts (too many subscriptions on a connection)
//! as `failed`. Clients in other languages split the text at the first ": " to get the code
//! (README, "Limits and faults"); the Rust client does it in [`code_of`].
//!
//! Every refusal is counted per shard in `pinq_refusals_total{code}`: the server calls
//! `Shard::refused(code)` where it refuses, and the metrics snapshot carries [`RefusalCounts`].

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
}

impl Code {
    /// Every code, in the order [`RefusalCounts`] keeps them.
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

    fn index(self) -> usize {
        Code::ALL.iter().position(|&c| c == self).unwrap_or(0)
    }

    /// The Cap'n Proto exception carrying this refusal; `detail` names the bound and its key.
    pub fn error(self, detail: impl std::fmt::Display) -> capnp::Error {
        let text = format!("{}: {detail}", self.name());
        if self.retry_later() {
            capnp::Error::overloaded(text)
        } else {
            capnp::Error::failed(text)
        }
    }
}

/// The refusal code at the start of an exception's text, if it carries one.
pub fn code_of(text: &str) -> Option<Code> {
    // capnp-rpc may prefix remote exceptions ("remote exception: "): look for a known code
    // followed by ": " anywhere at a word start.
    Code::ALL.into_iter().find(|code| {
        let tag = format!("{}: ", code.name());
        text.starts_with(&tag) || text.contains(&format!(" {tag}"))
    })
}

/// Refusals counted by one shard, one counter per [`Code`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefusalCounts {
    counts: [u64; Code::ALL.len()],
}

impl RefusalCounts {
    pub fn add(&mut self, code: Code) {
        let slot = &mut self.counts[code.index()];
        *slot = slot.saturating_add(1);
    }

    pub fn get(&self, code: Code) -> u64 {
        self.counts[code.index()]
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
