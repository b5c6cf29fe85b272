//! The engine's settings ([`LsmOptions`], checked by [`LsmOptions::validate`]) and where it gets
//! the time ([`Clock`]: the system clock, or a [`ManualClock`] tests move by hand).
//!
//! Plain data, no I/O: the server fills the options from `config.storage`; the recovery and the
//! engine read them.

use std::cell::Cell;

use super::compaction::CompactionConfig;

/// Where the engine gets the time (TTL filtering in flush and compaction). Injected so tests
/// drive expiry by hand.
pub trait Clock {
    fn now_ms(&self) -> u64;
}

/// Wall-clock milliseconds since the Unix epoch, never going backwards.
#[derive(Debug, Default)]
pub struct SystemClock {
    last_ms: Cell<u64>,
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let now = now.max(self.last_ms.get());
        self.last_ms.set(now);
        now
    }
}

/// A clock tests set by hand.
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ms: Cell<u64>,
}

impl ManualClock {
    pub fn new(now_ms: u64) -> ManualClock {
        ManualClock {
            now_ms: Cell::new(now_ms),
        }
    }

    pub fn set(&self, now_ms: u64) {
        self.now_ms.set(now_ms);
    }

    pub fn advance(&self, ms: u64) {
        self.now_ms.set(self.now_ms.get().saturating_add(ms));
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.get()
    }
}

/// Engine settings. Units are in the names; the server fills this from `config.storage`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LsmOptions {
    /// A memtable is frozen and flushed once it holds this many bytes (`storage.memtableBytes`).
    pub memtable_bytes_max: usize,
    /// Frozen memtables waiting for their flush before writers stall.
    pub frozen_memtables_max: usize,
    /// Log bytes not yet covered by tables before the memtable is frozen anyway (padding
    /// included). Bounds recovery time and disk use when publish/ACK pairs annihilate and the
    /// memtable never fills. Checked by the log's owner, which knows the log's size.
    pub wal_bytes_max: u64,
    /// A WAL segment is closed and a new one started past this size.
    pub wal_segment_bytes_max: u64,
    /// WAL segments are zero-filled this far ahead of the write position, so that a commit's
    /// fdatasync is an overwrite and not a file-size change through the filesystem journal.
    pub wal_preallocate_bytes: u64,
    /// Target size of a table's data block.
    pub block_bytes: usize,
    /// Bloom filter bits per key.
    pub bloom_bits_per_key: usize,
    pub compaction: CompactionConfig,
    /// How often the compactor re-checks the policy without being woken (TTL expiry).
    pub compaction_interval_ms: u64,
    /// Shares of the background task queue (glommio's default queue has 1000).
    pub background_shares: usize,
    /// Read every block of every table at open (slow; for tools and paranoid restarts).
    pub verify_tables_on_open: bool,
    /// `close` flushes the memtable so the next open replays nothing.
    pub flush_on_close: bool,
    /// A write that failed for lack of space is retried after this long, doubling each time
    /// up to [`LsmOptions::disk_full_retry_max_ms`] (see [`retry_delay_ms`]).
    pub disk_full_retry_first_ms: u64,
    pub disk_full_retry_max_ms: u64,
    /// Open a log with a segment shorter than it was written by cutting it there and dropping
    /// what follows, instead of refusing (`pinq serve --recover-truncated-wal`; one start only).
    pub recover_truncated_wal: bool,
}

/// The wait before retry `attempt` (0 for the first) of a write that failed for lack of space:
/// `first_ms` doubling up to `max_ms`. Pure.
pub fn retry_delay_ms(first_ms: u64, max_ms: u64, attempt: u32) -> u64 {
    first_ms
        .saturating_mul(1u64 << attempt.min(32))
        .min(max_ms)
        .max(1)
}

impl Default for LsmOptions {
    fn default() -> LsmOptions {
        LsmOptions {
            memtable_bytes_max: 64 << 20,
            frozen_memtables_max: 2,
            wal_bytes_max: 256 << 20,
            wal_segment_bytes_max: 64 << 20,
            wal_preallocate_bytes: 8 << 20,
            block_bytes: 16 << 10,
            bloom_bits_per_key: 10,
            compaction: CompactionConfig::default(),
            compaction_interval_ms: 10_000,
            background_shares: 100,
            verify_tables_on_open: false,
            flush_on_close: true,
            disk_full_retry_first_ms: 100,
            disk_full_retry_max_ms: 5_000,
            recover_truncated_wal: false,
        }
    }
}

impl LsmOptions {
    /// Checks the settings; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let checks: [(&str, bool); 8] = [
            ("memtable_bytes_max", self.memtable_bytes_max >= 4096),
            ("frozen_memtables_max", self.frozen_memtables_max >= 1),
            ("wal_bytes_max", self.wal_bytes_max >= 4096),
            ("wal_segment_bytes_max", self.wal_segment_bytes_max >= 4096),
            (
                "block_bytes",
                (256..=(64 << 20)).contains(&self.block_bytes),
            ),
            (
                "bloom_bits_per_key",
                (1..=64).contains(&self.bloom_bits_per_key),
            ),
            (
                "background_shares",
                (1..=1000).contains(&self.background_shares),
            ),
            (
                "disk_full_retry_max_ms",
                (1..=600_000).contains(&self.disk_full_retry_first_ms)
                    && self.disk_full_retry_first_ms <= self.disk_full_retry_max_ms
                    && self.disk_full_retry_max_ms <= 600_000,
            ),
        ];
        match checks.iter().find(|(_, ok)| !ok) {
            Some((name, _)) => Err(format!("storage option {name} is out of range")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_full_retries_double_from_100_ms_to_5_s() {
        let delays: Vec<u64> = (0..9).map(|a| retry_delay_ms(100, 5_000, a)).collect();
        assert_eq!(
            delays,
            [100, 200, 400, 800, 1_600, 3_200, 5_000, 5_000, 5_000]
        );
        assert_eq!(retry_delay_ms(100, 5_000, u32::MAX), 5_000);
    }
}
