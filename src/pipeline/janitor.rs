//! The TTL janitor: plans sweeps of the whole shard for expired messages (pure).
//!
//! The dispatcher's inline TTL check only sees topics with consumers; the janitor covers the rest.
//! Every `ttlSweepInterval` it walks the whole key space in pages (the shell scans; the janitor
//! reads the pages), skips metadata keys and values that do not parse, and returns the expired
//! event keys for the deleter. One sweep at a time; a page is bounded so the shell can yield
//! between pages.

use crate::key::{EventKey, Key};
use crate::message::Value;

/// The next page the shell should read for the sweep in progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SweepPage {
    pub start: Key,
    pub limit: usize,
}

/// The first sweep starts this long after the core (or sooner, with a shorter interval).
pub const FIRST_SWEEP_AFTER_MS: u64 = 1_000;

pub struct Janitor {
    interval_ms: u64,
    page_len_max: usize,
    next_sweep_ms: u64,
    in_progress: bool,
    pub sweeps_total: u64,
    pub skipped_non_event_total: u64,
    pub skipped_unreadable_total: u64,
}

impl Janitor {
    pub fn new(interval_ms: u64, page_len_max: usize, now_ms: u64) -> Janitor {
        Janitor {
            interval_ms: interval_ms.max(1),
            page_len_max: page_len_max.max(1),
            // The first sweep is also the census of what the store holds (`super::stock`): it
            // runs soon after the start, so figures are right soon after a restart.
            next_sweep_ms: now_ms.saturating_add(interval_ms.min(FIRST_SWEEP_AFTER_MS)),
            in_progress: false,
            sweeps_total: 0,
            skipped_non_event_total: 0,
            skipped_unreadable_total: 0,
        }
    }

    pub fn next_sweep_ms(&self) -> Option<u64> {
        (!self.in_progress).then_some(self.next_sweep_ms)
    }

    /// Starts a sweep if one is due: returns the first page to read.
    pub fn begin(&mut self, now_ms: u64) -> Option<SweepPage> {
        if self.in_progress || now_ms < self.next_sweep_ms {
            return None;
        }
        self.in_progress = true;
        Some(SweepPage {
            start: Key::new(),
            limit: self.page_len_max,
        })
    }

    /// Gives up the sweep in progress (the store could not be read); the next starts a full
    /// interval from now.
    pub fn abort(&mut self, now_ms: u64) {
        self.in_progress = false;
        self.next_sweep_ms = now_ms.saturating_add(self.interval_ms);
    }

    /// Reads one page; returns the expired event keys in it and the next page, or `None` when the
    /// sweep is over (the page was short).
    pub fn on_page(
        &mut self,
        rows: &[(Key, Value)],
        now_ms: u64,
    ) -> (Vec<EventKey>, Option<SweepPage>) {
        let mut expired = Vec::new();
        for (key, value) in rows {
            let Ok(event) = EventKey::parse(key) else {
                self.skipped_non_event_total += 1;
                continue;
            };
            match value.message() {
                Ok(message) if message.is_expired(now_ms) => expired.push(event),
                Ok(_) => {}
                Err(_) => self.skipped_unreadable_total += 1,
            }
        }
        let next = match rows.last() {
            Some((last, _)) if rows.len() >= self.page_len_max => {
                let mut start = last.clone();
                start.push(0);
                Some(SweepPage {
                    start,
                    limit: self.page_len_max,
                })
            }
            _ => {
                self.in_progress = false;
                self.sweeps_total += 1;
                self.next_sweep_ms = now_ms.saturating_add(self.interval_ms);
                None
            }
        };
        (expired, next)
    }
}
