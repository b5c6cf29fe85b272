//! Rate-limited logging for error paths that can repeat: at most one line per interval per
//! site, and the line that does go out says how many were suppressed since the last one.
//!
//! Why: a store error a loop retries (a full disk, a deleter whose writes are refused) must not
//! write thousands of identical lines a second; the first line tells the operator, the next
//! ones only count. The decision ([`RateLimit::admit`]) is pure and takes the time as an
//! argument; [`LogLimit`] is the `Cell` form a single-threaded shard keeps beside the loop that
//! logs, and [`monotonic_ms`] the clock a shell without one may pass.
//!
//! Never used on a path that logs once by construction (a block logged once per table and
//! block keeps its own set instead).

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Instant;

/// One log site's limit: a line at most every `interval_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    interval_ms: u64,
    last_ms: Option<u64>,
    suppressed: u64,
}

impl RateLimit {
    pub const fn new(interval_ms: u64) -> RateLimit {
        RateLimit {
            interval_ms,
            last_ms: None,
            suppressed: 0,
        }
    }

    /// Whether a line may be written at `now_ms`: `Some(n)` with the lines suppressed since the
    /// last one written (then reset), `None` to stay silent (counted).
    pub fn admit(&mut self, now_ms: u64) -> Option<u64> {
        let due = self
            .last_ms
            .is_none_or(|last| now_ms.saturating_sub(last) >= self.interval_ms);
        if !due {
            self.suppressed += 1;
            return None;
        }
        self.last_ms = Some(now_ms);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// A [`RateLimit`] behind a `Cell`, for a log site inside `&self` code on one executor.
#[derive(Debug)]
pub struct LogLimit(Cell<RateLimit>);

impl LogLimit {
    pub const fn new(interval_ms: u64) -> LogLimit {
        LogLimit(Cell::new(RateLimit::new(interval_ms)))
    }

    /// See [`RateLimit::admit`].
    pub fn admit(&self, now_ms: u64) -> Option<u64> {
        let mut limit = self.0.get();
        let verdict = limit.admit(now_ms);
        self.0.set(limit);
        verdict
    }
}

/// The interval every repeated storage and loop error uses: one line per site per 10 s.
pub const LOG_INTERVAL_MS: u64 = 10_000;

/// Milliseconds since the first call in this process (monotonic): the clock for shells that
/// have none injected. Never used by pure code.
pub fn monotonic_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_line_goes_out_then_one_per_interval_with_the_suppressed_count() {
        let mut limit = RateLimit::new(1_000);
        assert_eq!(limit.admit(5), Some(0));
        assert_eq!(limit.admit(6), None);
        assert_eq!(limit.admit(999), None);
        assert_eq!(limit.admit(1_004), None);
        assert_eq!(limit.admit(1_005), Some(3));
        assert_eq!(limit.admit(2_004), None);
        assert_eq!(limit.admit(9_000), Some(1));
    }

    #[test]
    fn ten_thousand_errors_a_second_give_one_line_a_second() {
        let limit = LogLimit::new(1_000);
        let lines = (0..50_000u64)
            .filter(|i| limit.admit(i / 10).is_some())
            .count();
        assert_eq!(lines, 5);
    }

    #[test]
    fn a_clock_going_backwards_stays_silent_rather_than_panicking() {
        let mut limit = RateLimit::new(100);
        assert_eq!(limit.admit(1_000), Some(0));
        assert_eq!(limit.admit(10), None);
    }
}
