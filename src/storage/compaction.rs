//! Compaction policy (pure) and the per-entry filter compaction applies.
//!
//! [`choose`] looks at the live tables (newest first) and the time, and returns what to merge:
//! a contiguous run of tables, because entries only shadow older ones and a run keeps that order
//! intact. It never does I/O and never reads a clock; the engine's compaction worker, in the
//! background task queue, carries a [`Choice`] out and installs the result.
//!
//! Rules, in order:
//! 1. **Space amplification.** Tombstones shadow puts in older tables, and expired messages are
//!    dead weight. When the estimated dead bytes pass `space_amp_max_percent` of the live bytes
//!    (and `dead_bytes_min`), merge from the newest table holding dead bytes down to the oldest:
//!    with nothing older left, every tombstone and every expired message can go.
//! 2. **Size tiers.** Walking from the newest table, a table joins the run while it is at most
//!    `size_ratio_percent` of the run so far; a run of `merge_width_min` tables is merged. Each
//!    byte is rewritten about log(total/flush size) times: bounded write amplification.
//! 3. **Table count.** More than `tables_max` tables: merge the newest ones (reads stay cheap).
//!
//! [`filter`] decides, per merged entry, what survives: tombstones are dropped when no older
//! table can hold their key, expired messages are dropped (or become tombstones when an older
//! table may still hold an older value under the same key).

use crate::key::EventKey;
use crate::message::Value;
use crate::storage::memtable::Entry;

/// Tuning of the policy. Units are in the names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompactionConfig {
    /// More tables than this triggers a merge of the newest ones.
    pub tables_max: usize,
    /// Fewest tables a size-tier merge takes.
    pub merge_width_min: usize,
    /// A table joins the newer run while its size is at most this percentage of the run's.
    pub size_ratio_percent: u64,
    /// Total bytes may be at most this percentage of live bytes (150 = 1.5×).
    pub space_amp_max_percent: u64,
    /// Dead bytes below this never trigger a rewrite on their own.
    pub dead_bytes_min: u64,
}

impl Default for CompactionConfig {
    fn default() -> CompactionConfig {
        CompactionConfig {
            tables_max: 12,
            merge_width_min: 4,
            size_ratio_percent: 200,
            space_amp_max_percent: 150,
            dead_bytes_min: 1 << 20,
        }
    }
}

/// What the policy knows about one table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableSummary {
    pub id: u64,
    pub file_bytes: u64,
    pub puts: u64,
    pub tombstones: u64,
    pub key_bytes: u64,
    pub value_bytes: u64,
    pub ttl_value_bytes: u64,
    pub expires_min_ms: u64,
    pub expires_max_ms: u64,
}

impl TableSummary {
    fn entries(&self) -> u64 {
        self.puts + self.tombstones
    }

    /// Estimated bytes of puts that expired by `now_ms` (linear between first and last expiry).
    fn expired_bytes(&self, now_ms: u64) -> u64 {
        if self.ttl_value_bytes == 0 || now_ms < self.expires_min_ms {
            return 0;
        }
        if now_ms >= self.expires_max_ms {
            return self.ttl_value_bytes;
        }
        let span = (self.expires_max_ms - self.expires_min_ms).max(1) as u128;
        let passed = (now_ms - self.expires_min_ms) as u128;
        (self.ttl_value_bytes as u128 * passed / span) as u64
    }

    fn bytes_per_entry(&self) -> u64 {
        self.file_bytes / self.entries().max(1)
    }
}

/// Why a merge was chosen (for logs and stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    SpaceAmplification,
    SizeTier,
    TableCount,
    Manual,
}

/// The policy's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Idle,
    /// Merge tables `first..first + count` of the newest-first list into one.
    Merge {
        first: usize,
        count: usize,
        reason: Reason,
    },
}

/// Estimated dead bytes of each table: its own tombstones, the older puts they shadow, and its
/// expired messages.
pub fn dead_bytes(tables: &[TableSummary], now_ms: u64) -> Vec<u64> {
    tables
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let older = &tables[i + 1..];
            let older_entries: u64 = older.iter().map(TableSummary::entries).sum();
            let older_bytes: u64 = older.iter().map(|o| o.file_bytes).sum();
            let shadowed_per_tombstone = older_bytes.checked_div(older_entries).unwrap_or(0);
            let tombstone_bytes =
                t.tombstones * (t.bytes_per_entry().min(64) + shadowed_per_tombstone);
            tombstone_bytes + t.expired_bytes(now_ms)
        })
        .collect()
}

/// Decides what to compact. `tables` are newest first.
pub fn choose(tables: &[TableSummary], config: &CompactionConfig, now_ms: u64) -> Choice {
    let n = tables.len();
    if n == 0 {
        return Choice::Idle;
    }
    // 1. Space amplification.
    let dead = dead_bytes(tables, now_ms);
    let dead_total: u64 = dead.iter().sum();
    let total: u64 = tables.iter().map(|t| t.file_bytes).sum();
    let live = total.saturating_sub(dead_total);
    if dead_total >= config.dead_bytes_min.max(1)
        && dead_total.saturating_mul(100)
            > config
                .space_amp_max_percent
                .saturating_sub(100)
                .saturating_mul(live)
    {
        if let Some(first) = dead.iter().position(|&d| d > 0) {
            return Choice::Merge {
                first,
                count: n - first,
                reason: Reason::SpaceAmplification,
            };
        }
    }
    // 2. Size tiers from the newest table.
    let mut run = 1;
    let mut run_bytes = tables[0].file_bytes;
    while run < n
        && tables[run].file_bytes.saturating_mul(100)
            <= run_bytes.saturating_mul(config.size_ratio_percent)
    {
        run_bytes += tables[run].file_bytes;
        run += 1;
    }
    if run >= config.merge_width_min.max(2) {
        return Choice::Merge {
            first: 0,
            count: run,
            reason: Reason::SizeTier,
        };
    }
    // 3. Too many tables.
    if n > config.tables_max.max(1) {
        let count = (n - config.tables_max.max(1) + 1)
            .max(config.merge_width_min.max(2))
            .min(n);
        return Choice::Merge {
            first: 0,
            count,
            reason: Reason::TableCount,
        };
    }
    Choice::Idle
}

/// A full merge of every table, if there is anything to gain (admin and tests).
pub fn choose_full(tables: &[TableSummary], now_ms: u64) -> Choice {
    let worth = tables.len() > 1
        || tables
            .iter()
            .any(|t| t.tombstones > 0 || t.expired_bytes(now_ms) > 0);
    if worth {
        Choice::Merge {
            first: 0,
            count: tables.len(),
            reason: Reason::Manual,
        }
    } else {
        Choice::Idle
    }
}

/// The expiry of a stored value, if its key is an event key and its message has a TTL.
pub fn expiry_of(key: &[u8], value: &Value) -> Option<u64> {
    if EventKey::parse(key).is_err() {
        return None;
    }
    value.message().ok()?.expires_at_ms()
}

/// What compaction (or a flush) writes for one merged entry.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Keep,
    /// Write a tombstone instead (an expired put over an older value).
    Tombstone,
    DropTombstone,
    DropExpired,
}

/// Filters one entry. `older_may_hold` answers whether any table older than the output may hold
/// the key; it is only asked when the answer matters.
pub fn filter(
    key: &[u8],
    entry: &Entry,
    now_ms: u64,
    older_may_hold: impl Fn(&[u8]) -> bool,
) -> Verdict {
    match entry {
        Entry::Tombstone => {
            if older_may_hold(key) {
                Verdict::Keep
            } else {
                Verdict::DropTombstone
            }
        }
        Entry::Put(value) => match expiry_of(key, value) {
            Some(at) if now_ms >= at => {
                if older_may_hold(key) {
                    Verdict::Tombstone
                } else {
                    Verdict::DropExpired
                }
            }
            _ => Verdict::Keep,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TopicHash;
    use crate::message::StoredMessage;

    fn table(id: u64, file_bytes: u64, puts: u64, tombstones: u64) -> TableSummary {
        TableSummary {
            id,
            file_bytes,
            puts,
            tombstones,
            expires_min_ms: u64::MAX,
            ..TableSummary::default()
        }
    }

    fn config() -> CompactionConfig {
        CompactionConfig {
            dead_bytes_min: 1,
            ..CompactionConfig::default()
        }
    }

    #[test]
    fn nothing_to_do_for_few_healthy_tables() {
        assert_eq!(choose(&[], &config(), 0), Choice::Idle);
        let tables = vec![table(3, 1_000, 10, 0), table(2, 100_000, 1000, 0)];
        assert_eq!(choose(&tables, &config(), 0), Choice::Idle);
    }

    #[test]
    fn tombstones_shadowing_most_of_the_data_force_a_merge_to_the_bottom() {
        // Newest table: 900 tombstones over an older table of 1000 puts.
        let tables = vec![
            table(5, 20_000, 0, 900),
            table(4, 5_000, 50, 0),
            table(1, 100_000, 1000, 0),
        ];
        assert_eq!(
            choose(&tables, &config(), 0),
            Choice::Merge {
                first: 0,
                count: 3,
                reason: Reason::SpaceAmplification
            }
        );
    }

    #[test]
    fn expired_bytes_count_as_dead_once_their_time_has_come() {
        let mut t = table(1, 100_000, 1000, 0);
        t.ttl_value_bytes = 90_000;
        t.expires_min_ms = 1_000;
        t.expires_max_ms = 2_000;
        let tables = vec![t];
        assert_eq!(choose(&tables, &config(), 999), Choice::Idle);
        assert_eq!(
            choose(&tables, &config(), 2_000),
            Choice::Merge {
                first: 0,
                count: 1,
                reason: Reason::SpaceAmplification
            }
        );
    }

    #[test]
    fn similar_sized_new_tables_merge_as_a_tier() {
        let tables = vec![
            table(9, 1_000, 10, 0),
            table(8, 1_100, 10, 0),
            table(7, 900, 10, 0),
            table(6, 1_200, 10, 0),
            table(1, 1_000_000, 10_000, 0),
        ];
        assert_eq!(
            choose(&tables, &config(), 0),
            Choice::Merge {
                first: 0,
                count: 4,
                reason: Reason::SizeTier
            }
        );
    }

    #[test]
    fn too_many_tables_merge_the_newest() {
        // Sizes grow fast so no tier forms; 14 tables > tables_max 12.
        let tables: Vec<TableSummary> = (0..14)
            .map(|i| table(100 - i, 10u64.pow((i / 2) as u32 + 1) * 3, 10, 0))
            .collect();
        match choose(&tables, &config(), 0) {
            Choice::Merge {
                first: 0, count, ..
            } => assert!(count >= 4),
            other => panic!("expected a merge, got {other:?}"),
        }
    }

    #[test]
    fn filter_drops_what_nothing_needs() {
        let key = EventKey::new(TopicHash(1), 1, 1).to_key();
        let msg = Value::encode(&StoredMessage {
            topic: "t".into(),
            payload: vec![1],
            enqueued_at_ms: 100,
            delay_ms: 0,
            ttl_ms: 50,
            headers: vec![],
        })
        .unwrap();
        let put = Entry::Put(msg);
        assert_eq!(filter(&key, &put, 149, |_| false), Verdict::Keep);
        assert_eq!(filter(&key, &put, 150, |_| false), Verdict::DropExpired);
        assert_eq!(filter(&key, &put, 150, |_| true), Verdict::Tombstone);
        assert_eq!(
            filter(&key, &Entry::Tombstone, 0, |_| false),
            Verdict::DropTombstone
        );
        assert_eq!(filter(&key, &Entry::Tombstone, 0, |_| true), Verdict::Keep);
        // Metadata values are never treated as messages.
        let meta = Entry::Put(Value::copy_from_slice(&[1, 2, 3]));
        assert_eq!(
            filter(&[0xFF, 1], &meta, u64::MAX, |_| false),
            Verdict::Keep
        );
    }
}
