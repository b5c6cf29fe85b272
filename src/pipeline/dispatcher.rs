//! Per-topic dispatch state: the scan cursor and when the topic next has something due (pure).
//!
//! A pass scans `(cursor, dueUpperBound(now))` of each served topic and moves the cursor forward,
//! so a pass costs O(keys newly due), not O(keys in flight) and not O(keys waiting for later).
//! New keys always sort after the cursor: the shard stamps due buckets from a clock that never
//! goes back, and event ids grow. Keys of a publish that is not yet applied to the store can still
//! land behind the cursor, so the scan also stops before the lowest due bucket of any such
//! publish ([`Unapplied`]).
//!
//! `next_due_bucket` is learned from a seek past the scan bound (the shell's `first_key`) and
//! from publishes, so the shard wakes when the next delayed message falls due, not a poll later.

use ahash::AHashMap;

use crate::key::{EventKey, Key, TopicHash};

/// What a pass asks the shell to read for one topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScanRequest {
    pub topic: std::sync::Arc<str>,
    /// First key to read (inclusive).
    pub start: Key,
    /// Scan bound (exclusive): nothing due later is read.
    pub end: Key,
    pub limit: usize,
    /// If fewer than `limit` rows come back, seek the first key in `[end, seek_end)`: it tells when
    /// the topic next has something due.
    pub seek_end: Key,
}

pub struct TopicDispatch {
    pub hash: TopicHash,
    /// The last key read by a scan.
    pub cursor: Option<EventKey>,
    /// The due bucket of the first key known past the cursor; `None` if nothing is known waiting.
    pub next_due_bucket: Option<u64>,
    /// The last scan was cut by its limit: scan again at once.
    pub more: bool,
    /// The last pass skipped this topic because no recipient had room.
    pub blocked: bool,
    /// When the topic was last scanned: a topic is scanned at least every poll interval.
    pub last_scan_ms: u64,
    /// Lowest due bucket published while a scan was out, merged with that scan's seek.
    pub noted_during_scan: Option<u64>,
}

impl TopicDispatch {
    pub fn new(hash: TopicHash) -> TopicDispatch {
        // Nothing is known about the store yet: scan from the topic's first key.
        TopicDispatch {
            hash,
            cursor: None,
            next_due_bucket: Some(0),
            more: true,
            blocked: false,
            last_scan_ms: 0,
            noted_during_scan: None,
        }
    }

    pub fn scan_start(&self) -> Key {
        match &self.cursor {
            Some(cursor) => cursor.successor(),
            None => EventKey::topic_start(self.hash).to_key(),
        }
    }

    /// Whether something may be due below `bound_bucket`.
    pub fn wants_scan(&self, bound_bucket: u64) -> bool {
        self.more || self.next_due_bucket.is_some_and(|due| due < bound_bucket)
    }

    /// A message was stored with this due bucket.
    pub fn note_published(&mut self, due_bucket: u64) {
        self.next_due_bucket = Some(
            self.next_due_bucket
                .map_or(due_bucket, |d| d.min(due_bucket)),
        );
        self.noted_during_scan = Some(
            self.noted_during_scan
                .map_or(due_bucket, |d| d.min(due_bucket)),
        );
    }
}

/// Publishes whose keys are assigned but not yet in the store, by batch.
#[derive(Default)]
pub struct Unapplied {
    batches: AHashMap<u64, Vec<(TopicHash, u64)>>,
}

impl Unapplied {
    pub fn insert(&mut self, batch_id: u64, lowest_due: Vec<(TopicHash, u64)>) {
        self.batches.insert(batch_id, lowest_due);
    }

    pub fn remove(&mut self, batch_id: u64) -> Option<Vec<(TopicHash, u64)>> {
        self.batches.remove(&batch_id)
    }

    /// The lowest due bucket of an unapplied key of `topic`, if any.
    pub fn lowest_due(&self, topic: TopicHash) -> Option<u64> {
        self.batches
            .values()
            .flatten()
            .filter(|(t, _)| *t == topic)
            .map(|(_, due)| *due)
            .min()
    }

    pub fn len(&self) -> usize {
        self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }
}
