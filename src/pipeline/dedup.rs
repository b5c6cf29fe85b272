//! `DedupTable`: the (producer id, sequence) pairs a shard leader remembers for idempotent
//! publish, bounded in time, producers and entries (pure: no I/O, no clock).
//!
//! The core asks it, in log order (while preparing a batch), whether a message's (producer,
//! sequence) was already stored inside `publish.dedupWindow`; if so the message is not stored
//! again and its answer is the original tag. New pairs are remembered at once, still *pending*
//! until their batch is applied, so two concurrent publishes of one pair store it once; a
//! batch that fails takes its pending pairs back out. What it forgets (window over, a bound
//! reached) it queues for deletion from the store; the core puts those deletions into its next
//! store command ([`crate::log::Command::StoreSequenced`]), so stored entries do not outgrow the
//! bounds either.
//!
//! Bounds, and what happens at them:
//! - `publish.dedupMaxProducers`: remembering a pair of a new producer when the table is full
//!   forgets the least recently used producer (every pair of it);
//! - `publish.dedupMaxEntries`: remembering a pair when the table holds that many forgets the
//!   oldest pair first (its window is cut short).
//!
//! A republish of a forgotten pair is stored again: the guarantee holds inside the window and
//! the bounds, as documented in the README ("Idempotent publish").

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use ahash::AHashMap;

use crate::key::EventKey;
use crate::log::sequences::SequenceEntry;

/// The table's bounds (from `[publish]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DedupLimits {
    pub window_ms: u64,
    pub producers_max: usize,
    pub entries_max: usize,
}

impl Default for DedupLimits {
    fn default() -> DedupLimits {
        let d = crate::config::PublishConfig::default();
        DedupLimits::from(&d)
    }
}

impl From<&crate::config::PublishConfig> for DedupLimits {
    fn from(c: &crate::config::PublishConfig) -> DedupLimits {
        DedupLimits {
            window_ms: c.dedup_window_ms,
            producers_max: c.dedup_producers_max.max(1),
            entries_max: c.dedup_entries_max.max(1),
        }
    }
}

/// What a republished pair's original is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Original {
    pub tag: EventKey,
    /// The batch that stores it, while that batch is not yet applied.
    pub pending_batch: Option<u64>,
}

/// Where the originals a batch answered with stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Originals {
    /// Every one is stored.
    Stored,
    /// Some batch is not yet applied.
    Waiting,
    /// Some original's batch failed (or its pair was forgotten before it was stored).
    Lost,
}

/// Counters of the table (the metrics layer reads these).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DedupCounters {
    pub expired_total: u64,
    pub evicted_producers_total: u64,
    pub evicted_entries_total: u64,
}

#[derive(Debug)]
struct Remembered {
    original: Original,
}

#[derive(Debug)]
struct Producer {
    sequences: AHashMap<u64, Remembered>,
    last_use: u64,
}

/// One remembered pair in store-time order.
#[derive(Debug)]
struct Aged {
    stored_at_ms: u64,
    producer: Arc<str>,
    sequence: u64,
    event_id: u64,
}

#[derive(Debug)]
pub struct DedupTable {
    limits: DedupLimits,
    producers: AHashMap<Arc<str>, Producer>,
    /// Producers by last use (a use counter, not time: unique and monotonic).
    by_use: BTreeMap<u64, Arc<str>>,
    uses: u64,
    /// Every remembered pair, oldest first; pairs forgotten another way (their producer evicted,
    /// their batch failed) stay until they reach the front, and count toward `entries_max`.
    aged: VecDeque<Aged>,
    /// Event ids of stored entries to delete from the store, oldest first.
    forget: VecDeque<u64>,
    live: usize,
    pub counters: DedupCounters,
}

impl DedupTable {
    pub fn new(limits: DedupLimits) -> DedupTable {
        DedupTable {
            limits,
            producers: AHashMap::new(),
            by_use: BTreeMap::new(),
            uses: 0,
            aged: VecDeque::new(),
            forget: VecDeque::new(),
            live: 0,
            counters: DedupCounters::default(),
        }
    }

    pub fn limits(&self) -> DedupLimits {
        self.limits
    }

    /// Pairs remembered now.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Producers remembered now.
    pub fn producers(&self) -> usize {
        self.producers.len()
    }

    /// Stored entries waiting to be deleted.
    pub fn forget_queued(&self) -> usize {
        self.forget.len()
    }

    /// Items of the age queue (live and stale): never more than `entries_max`.
    pub fn aged_len(&self) -> usize {
        self.aged.len()
    }

    /// The original of a pair, if it is remembered (and marks its producer used).
    pub fn lookup(&mut self, producer: &str, sequence: u64) -> Option<Original> {
        let found = self
            .producers
            .get(producer)?
            .sequences
            .get(&sequence)
            .map(|r| r.original)?;
        self.touch(producer);
        Some(found)
    }

    /// Remembers a pair that batch `batch` stores under `tag`, pending until the batch applies.
    pub fn remember(
        &mut self,
        producer: &Arc<str>,
        sequence: u64,
        tag: EventKey,
        now_ms: u64,
        batch: Option<u64>,
    ) {
        // First the entry bound (it may forget this producer's last pair), then the producer
        // bound, so the pair always finds its producer.
        while self.aged.len() >= self.limits.entries_max {
            if self.drop_oldest() {
                self.counters.evicted_entries_total += 1;
            }
        }
        if !self.producers.contains_key(producer.as_ref()) {
            if self.producers.len() >= self.limits.producers_max {
                self.evict_least_recent_producer();
            }
            self.producers.insert(
                producer.clone(),
                Producer {
                    sequences: AHashMap::new(),
                    last_use: 0,
                },
            );
        }
        self.touch(producer);
        let Some(p) = self.producers.get_mut(producer.as_ref()) else {
            return;
        };
        let old = p.sequences.insert(
            sequence,
            Remembered {
                original: Original {
                    tag,
                    pending_batch: batch,
                },
            },
        );
        match old {
            // A pair is remembered again only when loading a store that held it twice: the
            // older entry goes.
            Some(old) => self.forget.push_back(old.original.tag.event_id()),
            None => self.live += 1,
        }
        self.aged.push_back(Aged {
            stored_at_ms: now_ms,
            producer: producer.clone(),
            sequence,
            event_id: tag.event_id(),
        });
    }

    /// Batch `batch` was applied: its pairs are stored. A pair forgotten while its batch was
    /// pending is deleted again now: its first deletion may have been applied before the batch
    /// stored it.
    pub fn settle(&mut self, remembered: &[SequenceEntry], batch: u64) {
        for entry in remembered {
            match self.entry_mut(&entry.producer, entry.sequence) {
                Some(r) if r.original.tag == entry.tag => {
                    if r.original.pending_batch == Some(batch) {
                        r.original.pending_batch = None;
                    }
                }
                _ => self.forget.push_back(entry.tag.event_id()),
            }
        }
    }

    /// Batch `batch` failed: its pairs were not stored (a republish stores them), and what it
    /// was to delete is queued again.
    pub fn abandon(&mut self, remembered: &[SequenceEntry], batch: u64, forgotten: &[u64]) {
        for entry in remembered {
            let mine = self
                .entry_mut(&entry.producer, entry.sequence)
                .is_some_and(|r| r.original.pending_batch == Some(batch));
            if mine {
                self.remove(&entry.producer, entry.sequence);
            }
        }
        for event_id in forgotten.iter().rev() {
            self.forget.push_front(*event_id);
        }
    }

    /// Forgets every pair whose window ended at `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some(front) = self.aged.front() {
            if front.stored_at_ms.saturating_add(self.limits.window_ms) > now_ms {
                break;
            }
            if self.drop_oldest() {
                self.counters.expired_total += 1;
            }
        }
    }

    /// Up to `max` stored entries to delete now, oldest first.
    pub fn take_forgotten(&mut self, max: usize) -> Vec<u64> {
        let n = max.min(self.forget.len());
        self.forget.drain(..n).collect()
    }

    /// Loads an entry read back from the store (at start, or when a replica starts to lead):
    /// one whose window ended is queued for deletion instead.
    pub fn load(&mut self, entry: &SequenceEntry, now_ms: u64) {
        if entry.stored_at_ms.saturating_add(self.limits.window_ms) <= now_ms {
            self.forget.push_back(entry.tag.event_id());
            self.counters.expired_total += 1;
            return;
        }
        self.remember(
            &entry.producer,
            entry.sequence,
            entry.tag,
            entry.stored_at_ms,
            None,
        );
    }

    /// Where the originals `waits` (pairs and the tags a batch answered with) stand.
    pub fn originals(&self, waits: &[(Arc<str>, u64, EventKey)]) -> Originals {
        let mut state = Originals::Stored;
        for (producer, sequence, tag) in waits {
            let original = self
                .producers
                .get(producer.as_ref())
                .and_then(|p| p.sequences.get(sequence))
                .map(|r| r.original);
            match original {
                Some(o) if o.tag == *tag && o.pending_batch.is_none() => {}
                Some(o) if o.tag == *tag => state = Originals::Waiting,
                _ => return Originals::Lost,
            }
        }
        state
    }

    fn entry_mut(&mut self, producer: &str, sequence: u64) -> Option<&mut Remembered> {
        self.producers
            .get_mut(producer)?
            .sequences
            .get_mut(&sequence)
    }

    fn touch(&mut self, producer: &str) {
        self.uses += 1;
        let uses = self.uses;
        if let Some((name, p)) = self.producers.get_key_value(producer) {
            let name = name.clone();
            let old = p.last_use;
            self.by_use.remove(&old);
            self.by_use.insert(uses, name);
        }
        if let Some(p) = self.producers.get_mut(producer) {
            p.last_use = uses;
        }
    }

    fn evict_least_recent_producer(&mut self) {
        let Some((_, name)) = self.by_use.pop_first() else {
            return;
        };
        if let Some(p) = self.producers.remove(name.as_ref()) {
            self.live -= p.sequences.len();
            self.forget
                .extend(p.sequences.values().map(|r| r.original.tag.event_id()));
            self.counters.evicted_producers_total += 1;
        }
    }

    /// Drops the oldest item of the age queue; returns whether it was a live pair (now
    /// forgotten and queued for deletion).
    fn drop_oldest(&mut self) -> bool {
        let Some(aged) = self.aged.pop_front() else {
            return false;
        };
        let live = self
            .producers
            .get(aged.producer.as_ref())
            .and_then(|p| p.sequences.get(&aged.sequence))
            .is_some_and(|r| r.original.tag.event_id() == aged.event_id);
        if live {
            self.remove(&aged.producer, aged.sequence);
            self.forget.push_back(aged.event_id);
        }
        live
    }

    fn remove(&mut self, producer: &str, sequence: u64) {
        let Some(p) = self.producers.get_mut(producer) else {
            return;
        };
        if p.sequences.remove(&sequence).is_some() {
            self.live -= 1;
        }
        if p.sequences.is_empty() {
            let last_use = p.last_use;
            self.producers.remove(producer);
            self.by_use.remove(&last_use);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TopicHash;

    fn limits(window_ms: u64, producers_max: usize, entries_max: usize) -> DedupLimits {
        DedupLimits {
            window_ms,
            producers_max,
            entries_max,
        }
    }

    fn tag(id: u64) -> EventKey {
        EventKey::new(TopicHash(1), 0, id)
    }

    fn name(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn a_remembered_pair_answers_its_original_tag_until_its_window_ends() {
        let mut t = DedupTable::new(limits(1000, 8, 100));
        t.remember(&name("p"), 1, tag(10), 0, Some(1));
        assert_eq!(
            t.lookup("p", 1),
            Some(Original {
                tag: tag(10),
                pending_batch: Some(1)
            })
        );
        assert_eq!(t.lookup("p", 2), None);
        assert_eq!(t.lookup("q", 1), None);
        t.expire(999);
        assert!(t.lookup("p", 1).is_some());
        t.expire(1000);
        assert_eq!(t.lookup("p", 1), None);
        assert_eq!(t.take_forgotten(10), vec![10]);
        assert_eq!(t.counters.expired_total, 1);
        assert!(t.is_empty());
        assert_eq!(t.producers(), 0);
    }

    #[test]
    fn at_the_producer_bound_the_least_recently_used_producer_is_forgotten() {
        let mut t = DedupTable::new(limits(u64::MAX / 2, 3, 1000));
        for (i, p) in ["a", "b", "c"].iter().enumerate() {
            t.remember(&name(p), 1, tag(i as u64), 0, None);
        }
        // "a" is used again, so "b" is now the least recently used.
        assert!(t.lookup("a", 1).is_some());
        t.remember(&name("d"), 1, tag(3), 0, None);
        assert_eq!(t.producers(), 3);
        assert!(t.lookup("b", 1).is_none());
        assert!(t.lookup("a", 1).is_some() && t.lookup("c", 1).is_some());
        assert_eq!(t.take_forgotten(10), vec![1]);
        assert_eq!(t.counters.evicted_producers_total, 1);
        for i in 0..1000u64 {
            t.remember(&name(&format!("p{i}")), 1, tag(100 + i), 0, None);
            assert!(t.producers() <= 3);
        }
    }

    #[test]
    fn at_the_entry_bound_the_oldest_pair_is_forgotten_and_memory_stays_bounded() {
        let mut t = DedupTable::new(limits(u64::MAX / 2, 4, 50));
        for i in 0..10_000u64 {
            t.remember(&name(&format!("p{}", i % 7)), i, tag(i), i, None);
            assert!(t.len() <= 50 && t.aged_len() <= 50, "at {i}");
            assert!(t.producers() <= 4);
            // As the core does with every store command: drain at least what came in.
            t.take_forgotten(1 + 1024);
            assert_eq!(t.forget_queued(), 0);
        }
        assert!(
            t.len() <= t.aged_len(),
            "every live pair is in the age queue"
        );
        assert!(t.lookup("p3", 9_999).is_some(), "the newest pair stays");
        assert!(t.counters.evicted_entries_total + t.counters.evicted_producers_total > 0);
    }

    #[test]
    fn a_settled_pair_is_stored_and_an_abandoned_one_is_lost_and_forgets_come_back() {
        let mut t = DedupTable::new(limits(1000, 8, 100));
        let entry = |seq, id| SequenceEntry {
            producer: name("p"),
            sequence: seq,
            tag: tag(id),
            stored_at_ms: 0,
        };
        t.remember(&name("p"), 1, tag(10), 0, Some(7));
        t.remember(&name("p"), 2, tag(11), 0, Some(8));
        let waits = vec![(name("p"), 1, tag(10))];
        assert_eq!(t.originals(&waits), Originals::Waiting);
        t.settle(&[entry(1, 10)], 7);
        assert_eq!(t.originals(&waits), Originals::Stored);
        t.abandon(&[entry(2, 11)], 8, &[99, 100]);
        assert_eq!(t.originals(&[(name("p"), 2, tag(11))]), Originals::Lost);
        assert_eq!(t.lookup("p", 2), None);
        assert_eq!(t.take_forgotten(1), vec![99]);
        assert_eq!(t.take_forgotten(5), vec![100]);
        // A settle or abandon for another batch leaves a pair alone.
        t.abandon(&[entry(1, 10)], 8, &[]);
        assert!(t.lookup("p", 1).is_some());
    }

    #[test]
    fn loading_keeps_pairs_inside_the_window_and_queues_expired_ones_for_deletion() {
        let mut t = DedupTable::new(limits(1000, 8, 100));
        let entry = |seq, id, at| SequenceEntry {
            producer: name("p"),
            sequence: seq,
            tag: tag(id),
            stored_at_ms: at,
        };
        t.load(&entry(1, 10, 100), 1500);
        t.load(&entry(2, 11, 600), 1500);
        assert_eq!(t.lookup("p", 1), None);
        assert_eq!(t.lookup("p", 2).map(|o| o.tag), Some(tag(11)));
        assert_eq!(t.take_forgotten(10), vec![10]);
        t.expire(1600);
        assert_eq!(t.lookup("p", 2), None);
    }
}
