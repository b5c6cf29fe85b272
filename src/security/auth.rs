//! Tokens and what each may do: the pure permission model behind `[[auth.tokens]]`.
//!
//! A token is a secret the client presents in `Broker.hello`. The broker keeps only its SHA-256
//! (configured as hex), hashes what the client presents, and compares that hash with every
//! configured one in constant time ([`subtle`]), so neither the answer nor its timing says which
//! token, or which part of one, came close. What a token may do is a list of topic prefixes to
//! publish to, a list to consume from, and an `admin` flag (stats, forgetGroup, group policies).
//! A prefix is a plain string prefix: `"billing."` covers `billing.eu`, `"orders"` covers
//! `orders` and `orders-eu`, and `""` every topic.
//!
//! With no token configured every connection may do everything ([`Access::Open`]), as before
//! tokens existed. Nothing here does I/O; the connection (`server::connection`) asks
//! [`Tokens::authenticate`] once in `hello` and [`Access::check`] on every call after.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Length of a SHA-256 digest in bytes.
pub const SHA256_BYTES: usize = 32;

/// Tokens a broker accepts (at most this many: each `hello` compares against all of them).
pub const TOKENS_MAX: usize = 1024;

/// Bytes of a presented token the broker hashes; longer ones are refused unread.
pub const TOKEN_BYTES_MAX: usize = 4096;

/// One `[[auth.tokens]]` entry as configured.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSpec {
    /// Shown in logs, metrics and refusals; never the secret.
    pub name: String,
    /// SHA-256 of the secret.
    pub sha256: [u8; SHA256_BYTES],
    /// Topic prefixes this token may publish to.
    pub publish: Vec<String>,
    /// Topic prefixes this token may subscribe to.
    pub consume: Vec<String>,
    /// Stats, forgetGroup and group policies.
    pub admin: bool,
}

impl fmt::Debug for TokenSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenSpec")
            .field("name", &self.name)
            .field("publish", &self.publish)
            .field("consume", &self.consume)
            .field("admin", &self.admin)
            .finish_non_exhaustive()
    }
}

/// Reads a 64-digit hex SHA-256 (either case); `None` if it is not one.
pub fn parse_sha256_hex(text: &str) -> Option<[u8; SHA256_BYTES]> {
    let text = text.trim();
    if text.len() != SHA256_BYTES * 2 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; SHA256_BYTES];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// The SHA-256 of `secret`, as `sha256sum` prints it (lowercase hex).
pub fn sha256_hex(secret: &[u8]) -> String {
    Sha256::digest(secret)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a call needs a token to allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action<'a> {
    Publish {
        topic: &'a str,
    },
    Consume {
        topic: &'a str,
    },
    /// `what` names the call (`stats`, `forgetGroup`).
    Admin {
        what: &'static str,
    },
}

/// Why a connection or a call was refused, as counted in `pinq_auth_refusals_total{reason}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AuthReason {
    /// Tokens are configured and `hello` carried none.
    MissingToken,
    /// The token matches no configured one.
    UnknownToken,
    /// A call other than `hello` came before a successful `hello`.
    HelloRequired,
    PublishForbidden,
    ConsumeForbidden,
    AdminForbidden,
}

impl AuthReason {
    pub const ALL: [AuthReason; 6] = [
        AuthReason::MissingToken,
        AuthReason::UnknownToken,
        AuthReason::HelloRequired,
        AuthReason::PublishForbidden,
        AuthReason::ConsumeForbidden,
        AuthReason::AdminForbidden,
    ];

    /// The metric's label.
    pub fn name(self) -> &'static str {
        match self {
            AuthReason::MissingToken => "missingToken",
            AuthReason::UnknownToken => "unknownToken",
            AuthReason::HelloRequired => "helloRequired",
            AuthReason::PublishForbidden => "publishForbidden",
            AuthReason::ConsumeForbidden => "consumeForbidden",
            AuthReason::AdminForbidden => "adminForbidden",
        }
    }

    fn index(self) -> usize {
        AuthReason::ALL.iter().position(|&r| r == self).unwrap_or(0)
    }
}

/// A refusal of the permission model: the reason and a sentence naming what was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denied {
    pub reason: AuthReason,
    pub detail: String,
}

/// What one token may do.
#[derive(Debug, PartialEq, Eq)]
pub struct Grant {
    pub name: String,
    publish: Vec<String>,
    consume: Vec<String>,
    admin: bool,
}

/// What a connection may do after its `hello`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// No token is configured: everything, as without authentication.
    Open,
    Token(Arc<Grant>),
}

impl Access {
    /// Whether the call may go ahead; the refusal names the token, the action and the topic.
    pub fn check(&self, action: Action<'_>) -> Result<(), Denied> {
        let Access::Token(grant) = self else {
            return Ok(());
        };
        let covered = |prefixes: &[String], topic: &str| {
            prefixes.iter().any(|p| topic.starts_with(p.as_str()))
        };
        let (allowed, reason, what) = match action {
            Action::Publish { topic } => (
                covered(&grant.publish, topic),
                AuthReason::PublishForbidden,
                format!("publish to topic {topic:?}"),
            ),
            Action::Consume { topic } => (
                covered(&grant.consume, topic),
                AuthReason::ConsumeForbidden,
                format!("subscribe to topic {topic:?}"),
            ),
            Action::Admin { what } => (
                grant.admin,
                AuthReason::AdminForbidden,
                format!("call {what} (needs admin = true)"),
            ),
        };
        if allowed {
            return Ok(());
        }
        Err(Denied {
            reason,
            detail: format!("token {:?} may not {what}", grant.name),
        })
    }

    /// The token's name, for logs (`None` when no token is configured).
    pub fn name(&self) -> Option<&str> {
        match self {
            Access::Open => None,
            Access::Token(grant) => Some(&grant.name),
        }
    }
}

/// The configured tokens, ready to check a `hello`.
#[derive(Debug, Default)]
pub struct Tokens {
    entries: Vec<([u8; SHA256_BYTES], Arc<Grant>)>,
}

impl Tokens {
    pub fn new(specs: &[TokenSpec]) -> Tokens {
        let entries = specs
            .iter()
            .map(|s| {
                let grant = Grant {
                    name: s.name.clone(),
                    publish: s.publish.clone(),
                    consume: s.consume.clone(),
                    admin: s.admin,
                };
                (s.sha256, Arc::new(grant))
            })
            .collect();
        Tokens { entries }
    }

    /// Whether every connection must present a token.
    pub fn required(&self) -> bool {
        !self.entries.is_empty()
    }

    /// The access a `hello` carrying `presented` (empty: none) gets. Every configured hash is
    /// compared, in constant time, whatever matched first.
    pub fn authenticate(&self, presented: &[u8]) -> Result<Access, Denied> {
        if !self.required() {
            return Ok(Access::Open);
        }
        if presented.is_empty() {
            return Err(Denied {
                reason: AuthReason::MissingToken,
                detail: "this broker requires a token in hello (auth.tokens is configured)".into(),
            });
        }
        let unknown = Denied {
            reason: AuthReason::UnknownToken,
            detail: "the token presented in hello is not one this broker accepts".into(),
        };
        if presented.len() > TOKEN_BYTES_MAX {
            return Err(unknown);
        }
        let digest: [u8; SHA256_BYTES] = Sha256::digest(presented).into();
        let mut found = None;
        for (hash, grant) in &self.entries {
            if bool::from(hash.ct_eq(&digest)) {
                found.get_or_insert_with(|| grant.clone());
            }
        }
        found.map(Access::Token).ok_or(unknown)
    }
}

/// Authentication refusals counted by one shard, one counter per [`AuthReason`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuthRefusalCounts {
    counts: [u64; AuthReason::ALL.len()],
}

impl AuthRefusalCounts {
    pub fn add(&mut self, reason: AuthReason) {
        let slot = &mut self.counts[reason.index()];
        *slot = slot.saturating_add(1);
    }

    pub fn get(&self, reason: AuthReason) -> u64 {
        self.counts[reason.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(
        name: &str,
        secret: &str,
        publish: &[&str],
        consume: &[&str],
        admin: bool,
    ) -> TokenSpec {
        TokenSpec {
            name: name.into(),
            sha256: parse_sha256_hex(&sha256_hex(secret.as_bytes())).unwrap(),
            publish: publish.iter().map(|s| s.to_string()).collect(),
            consume: consume.iter().map(|s| s.to_string()).collect(),
            admin,
        }
    }

    fn tokens() -> Tokens {
        Tokens::new(&[
            spec(
                "billing",
                "s3cret",
                &["orders", "billing."],
                &["orders"],
                false,
            ),
            spec("ops", "root-token", &[], &[], true),
        ])
    }

    #[test]
    fn sha256_hex_matches_sha256sum() {
        // printf 'abc' | sha256sum
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let upper = sha256_hex(b"abc").to_ascii_uppercase();
        assert_eq!(
            parse_sha256_hex(&upper),
            parse_sha256_hex(&sha256_hex(b"abc"))
        );
        assert_eq!(parse_sha256_hex("abc"), None);
        assert_eq!(parse_sha256_hex(&"zz".repeat(32)), None);
    }

    #[test]
    fn no_tokens_configured_opens_everything() {
        let open = Tokens::default().authenticate(b"").unwrap();
        assert_eq!(open, Access::Open);
        assert!(open.check(Action::Admin { what: "stats" }).is_ok());
        assert!(open.check(Action::Publish { topic: "x" }).is_ok());
    }

    #[test]
    fn a_missing_or_unknown_token_is_refused_by_reason() {
        let t = tokens();
        assert_eq!(
            t.authenticate(b"").unwrap_err().reason,
            AuthReason::MissingToken
        );
        let wrong = t.authenticate(b"s3cret!").unwrap_err();
        assert_eq!(wrong.reason, AuthReason::UnknownToken);
        assert!(!wrong.detail.contains("s3cret"));
        let long = vec![b'a'; TOKEN_BYTES_MAX + 1];
        assert_eq!(
            t.authenticate(&long).unwrap_err().reason,
            AuthReason::UnknownToken
        );
    }

    #[test]
    fn a_token_may_only_what_its_prefixes_allow() {
        let access = tokens().authenticate(b"s3cret").unwrap();
        assert_eq!(access.name(), Some("billing"));
        assert!(access.check(Action::Publish { topic: "orders" }).is_ok());
        assert!(access.check(Action::Publish { topic: "orders-eu" }).is_ok());
        assert!(access
            .check(Action::Publish {
                topic: "billing.eu"
            })
            .is_ok());
        let denied = access
            .check(Action::Publish { topic: "billing" })
            .unwrap_err();
        assert_eq!(denied.reason, AuthReason::PublishForbidden);
        assert!(denied.detail.contains("\"billing\""), "{}", denied.detail);
        assert!(access.check(Action::Consume { topic: "orders" }).is_ok());
        let denied = access
            .check(Action::Consume {
                topic: "billing.eu",
            })
            .unwrap_err();
        assert_eq!(denied.reason, AuthReason::ConsumeForbidden);
        let denied = access.check(Action::Admin { what: "stats" }).unwrap_err();
        assert_eq!(denied.reason, AuthReason::AdminForbidden);
        assert!(denied.detail.contains("stats"));
    }

    #[test]
    fn an_admin_token_with_no_prefixes_may_neither_publish_nor_consume() {
        let access = tokens().authenticate(b"root-token").unwrap();
        assert!(access.check(Action::Admin { what: "stats" }).is_ok());
        assert!(access.check(Action::Publish { topic: "orders" }).is_err());
        assert!(access.check(Action::Consume { topic: "orders" }).is_err());
    }

    #[test]
    fn an_empty_prefix_covers_every_topic() {
        let t = Tokens::new(&[spec("all", "x", &[""], &[""], false)]);
        let access = t.authenticate(b"x").unwrap();
        assert!(access.check(Action::Publish { topic: "anything" }).is_ok());
        assert!(access.check(Action::Consume { topic: "anything" }).is_ok());
    }

    #[test]
    fn refusals_are_counted_per_reason() {
        let mut c = AuthRefusalCounts::default();
        c.add(AuthReason::UnknownToken);
        c.add(AuthReason::UnknownToken);
        c.add(AuthReason::AdminForbidden);
        assert_eq!(c.get(AuthReason::UnknownToken), 2);
        assert_eq!(c.get(AuthReason::AdminForbidden), 1);
        assert_eq!(c.get(AuthReason::MissingToken), 0);
    }
}
