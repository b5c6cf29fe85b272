//! Redelivery policy of a recipient (pure): how many deliveries a copy gets before it is
//! dead-lettered, where dead letters go, and how long a released copy waits before its next
//! delivery (exponential backoff with jitter).
//!
//! The `[delivery]` keys give every group its defaults; an admin call (`setGroupPolicy`) may
//! override them per group, durably (a [`crate::log::Command::GroupPolicy`] in the shard's
//! log). Nothing here reads a clock or a random source: jitter is derived from the copy (its
//! event id, recipient and attempt), so the same copy waits the same time in every run and tests
//! can compute the expected delay.

/// Exponential backoff between `initial_ms` and `max_ms` (`delivery.redeliveryBackoff`,
/// written `INITIAL:MAX`, e.g. `100ms:10s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub initial_ms: u64,
    pub max_ms: u64,
}

/// Why a [`Backoff`] text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackoffError {
    #[error("must be INITIAL:MAX, e.g. \"100ms:10s\", found {0:?}")]
    Form(String),
    #[error("{which} {text:?} is not a duration (e.g. 250ms, 2s, 1m)")]
    Duration { which: &'static str, text: String },
    #[error("INITIAL ({initial_ms} ms) must be at least 1 ms and at most MAX ({max_ms} ms)")]
    Order { initial_ms: u64, max_ms: u64 },
}

/// The longest backoff accepted (a day): a longer wait is a delayed message, not a retry.
pub const BACKOFF_MAX_MS: u64 = 24 * 3600 * 1000;

impl Backoff {
    /// Parses `INITIAL:MAX` with durations like `100ms`, `2s`, `1m`, `1h`.
    pub fn parse(text: &str) -> Result<Backoff, BackoffError> {
        let (initial, max) = text
            .split_once(':')
            .ok_or_else(|| BackoffError::Form(text.into()))?;
        let initial_ms =
            parse_duration_ms(initial.trim()).ok_or_else(|| BackoffError::Duration {
                which: "INITIAL",
                text: initial.into(),
            })?;
        let max_ms = parse_duration_ms(max.trim()).ok_or_else(|| BackoffError::Duration {
            which: "MAX",
            text: max.into(),
        })?;
        Backoff::new(initial_ms, max_ms)
    }

    /// A backoff from its two bounds, checked: `1 <= initial <= max <= BACKOFF_MAX_MS`.
    pub fn new(initial_ms: u64, max_ms: u64) -> Result<Backoff, BackoffError> {
        if initial_ms == 0 || initial_ms > max_ms || max_ms > BACKOFF_MAX_MS {
            return Err(BackoffError::Order { initial_ms, max_ms });
        }
        Ok(Backoff { initial_ms, max_ms })
    }

    /// The wait before delivery `next_attempt` (2 = the first redelivery): the base doubles from
    /// `initial_ms` per attempt up to `max_ms`, and jitter takes up to a quarter off it, never
    /// below `initial_ms`. So attempt 2 waits exactly `initial_ms`, and every wait lies in
    /// `[initial_ms, max_ms]`. `seed` picks the jitter (the caller derives it from the copy).
    pub fn delay_ms(&self, next_attempt: u32, seed: u64) -> u64 {
        let doublings = next_attempt.saturating_sub(2).min(63);
        let base = self
            .initial_ms
            .checked_shl(doublings)
            .filter(|b| b >> doublings == self.initial_ms)
            .unwrap_or(u64::MAX)
            .min(self.max_ms);
        let spread = base / 4;
        let off = if spread == 0 {
            0
        } else {
            mix(seed) % (spread + 1)
        };
        base.saturating_sub(off).max(self.initial_ms)
    }

    /// The `INITIAL:MAX` text of this backoff (for `pinq group policy` and config rendering).
    pub fn text(&self) -> String {
        format!("{}ms:{}ms", self.initial_ms, self.max_ms)
    }
}

/// splitmix64: spreads a seed made of small numbers over all 64 bits.
fn mix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A duration as the config files write one (`250ms`, `2s`, `1m`), in whole milliseconds.
fn parse_duration_ms(text: &str) -> Option<u64> {
    let d = humantime::parse_duration(text).ok()?;
    (d.subsec_nanos() % 1_000_000 == 0).then(|| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A group's overrides of the `[delivery]` defaults, as the admin call set them. `None` keeps the
/// default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyOverride {
    /// 0 = unlimited.
    pub max_deliveries: Option<u32>,
    pub dead_letter_topic: Option<String>,
    /// `Some(None)`: backoff switched off for this group although the default has one.
    pub backoff: Option<Option<Backoff>>,
}

/// The policy in force for one recipient: defaults with its overrides applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// 0 = unlimited.
    pub max_deliveries: u32,
    /// The dead-letter topic's template; `{topic}` stands for the source topic.
    pub dead_letter_topic: String,
    pub backoff: Option<Backoff>,
}

/// The default dead-letter topic (`delivery.deadLetterTopic`).
pub const DEAD_LETTER_TOPIC_DEFAULT: &str = "{topic}.dlq";

impl Policy {
    /// `defaults` with `over` applied.
    pub fn with(defaults: &Policy, over: Option<&PolicyOverride>) -> Policy {
        let Some(over) = over else {
            return defaults.clone();
        };
        Policy {
            max_deliveries: over.max_deliveries.unwrap_or(defaults.max_deliveries),
            dead_letter_topic: over
                .dead_letter_topic
                .clone()
                .unwrap_or_else(|| defaults.dead_letter_topic.clone()),
            backoff: over.backoff.unwrap_or(defaults.backoff),
        }
    }

    /// Whether a copy delivered `attempts` times may not be delivered again.
    pub fn exhausted(&self, attempts: u32) -> bool {
        self.max_deliveries > 0 && attempts >= self.max_deliveries
    }

    /// The dead-letter topic of `topic` under this policy.
    pub fn dead_letter_topic_of(&self, topic: &str) -> String {
        self.dead_letter_topic.replace("{topic}", topic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_parses_and_refuses_by_name() {
        assert_eq!(
            Backoff::parse("100ms:10s"),
            Ok(Backoff {
                initial_ms: 100,
                max_ms: 10_000
            })
        );
        assert_eq!(Backoff::parse("2s:1m").map(|b| b.max_ms), Ok(60_000));
        assert!(matches!(
            Backoff::parse("100ms"),
            Err(BackoffError::Form(_))
        ));
        assert!(matches!(
            Backoff::parse("abc:1s"),
            Err(BackoffError::Duration {
                which: "INITIAL",
                ..
            })
        ));
        assert!(matches!(
            Backoff::parse("10s:1s"),
            Err(BackoffError::Order { .. })
        ));
        assert!(matches!(
            Backoff::parse("0ms:1s"),
            Err(BackoffError::Order { .. })
        ));
    }

    #[test]
    fn backoff_starts_at_initial_doubles_and_stays_within_bounds() {
        let b = Backoff::new(100, 1000).unwrap();
        for seed in 0..200u64 {
            assert_eq!(b.delay_ms(2, seed), 100, "attempt 2 waits INITIAL");
            let third = b.delay_ms(3, seed);
            assert!((150..=200).contains(&third), "attempt 3: {third}");
            let fourth = b.delay_ms(4, seed);
            assert!((300..=400).contains(&fourth), "attempt 4: {fourth}");
            let fifth = b.delay_ms(5, seed);
            assert!((600..=800).contains(&fifth), "attempt 5: {fifth}");
            for attempt in 6..80 {
                let d = b.delay_ms(attempt, seed);
                assert!((750..=1000).contains(&d), "attempt {attempt}: {d}");
            }
        }
        // The jitter really varies with the seed.
        let waits: std::collections::BTreeSet<u64> = (0..50).map(|s| b.delay_ms(6, s)).collect();
        assert!(waits.len() > 10, "{waits:?}");
    }

    #[test]
    fn overrides_replace_only_what_they_name() {
        let defaults = Policy {
            max_deliveries: 0,
            dead_letter_topic: DEAD_LETTER_TOPIC_DEFAULT.into(),
            backoff: Backoff::new(10, 20).ok(),
        };
        let over = PolicyOverride {
            max_deliveries: Some(3),
            dead_letter_topic: None,
            backoff: Some(None),
        };
        let p = Policy::with(&defaults, Some(&over));
        assert_eq!(p.max_deliveries, 3);
        assert_eq!(p.dead_letter_topic_of("jobs"), "jobs.dlq");
        assert_eq!(p.backoff, None);
        assert!(!p.exhausted(2) && p.exhausted(3));
        assert!(!defaults.exhausted(u32::MAX), "0 is unlimited");
    }
}
