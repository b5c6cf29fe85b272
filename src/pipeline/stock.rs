//! The stock: how many messages each topic holds in the store, how many of them are due and how
//! many scheduled (pure; no I/O, no clock).
//!
//! The core tells the stock of every store and delete it applies, so the figures stay exact
//! between restarts. After a restart (or on a new leader) the core starts empty, so the figures
//! come from a *census*: the janitor's sweep walks the whole key space anyway, and each page it
//! reads is counted into a census that replaces the running figures when the sweep ends. While a
//! census runs, stores and deletes of keys the sweep has already passed go into the census as
//! well, so the census is exact at its end except for keys changed inside the one page being
//! read at that moment (the next census corrects them). [`Stock::counted`] says whether a census
//! has completed since the core started.
//!
//! Due and scheduled: each topic keeps a small ordered map of its scheduled messages by due
//! bucket; buckets that have come due leave it at the topic's next store or delete. The map is
//! bounded (`SCHEDULE_BUCKETS_MAX`): past it, the latest two buckets merge, so a message of a
//! merged bucket may be counted due up to that bucket's width early, never late, and never lost.
//!
//! Memory follows configuration: at most `topics_max` topics are counted one by one; messages of
//! topics past it are summed in one `untracked` entry. A topic whose count falls to zero is
//! dropped.

use std::collections::BTreeMap;
use std::sync::Arc;

use ahash::AHashMap;

use crate::key::{EventKey, TopicHash};

/// Distinct due buckets kept per topic before the latest ones merge.
pub const SCHEDULE_BUCKETS_MAX: usize = 64;

/// A topic's (or the untracked topics') stored messages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicStock {
    /// `None` until a store or a census row names the topic (deletes carry only its hash).
    pub name: Option<Arc<str>>,
    pub stored: u64,
    scheduled: Schedule,
}

impl TopicStock {
    /// Stored messages due before `bound_bucket` (the first bucket not yet due).
    pub fn due(&self, bound_bucket: u64) -> u64 {
        self.stored.saturating_sub(self.scheduled(bound_bucket))
    }

    /// Stored messages due at `bound_bucket` or later.
    pub fn scheduled(&self, bound_bucket: u64) -> u64 {
        self.scheduled
            .buckets
            .range(bound_bucket..)
            .map(|(_, n)| n)
            .sum()
    }

    fn add(&mut self, key: &EventKey, bound_bucket: u64) {
        self.scheduled.settle(bound_bucket);
        self.stored += 1;
        if key.due_bucket() >= bound_bucket {
            self.scheduled.add(key.due_bucket());
        }
    }

    fn remove(&mut self, key: &EventKey, bound_bucket: u64) {
        self.scheduled.settle(bound_bucket);
        self.stored = self.stored.saturating_sub(1);
        self.scheduled.remove(key.due_bucket());
    }
}

/// Scheduled messages by due bucket; a bucket entry counts the messages due from its key up to
/// the next entry's key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Schedule {
    buckets: BTreeMap<u64, u64>,
    total: u64,
}

impl Schedule {
    fn add(&mut self, bucket: u64) {
        let start = match self.buckets.range(..=bucket).next_back() {
            // Join a merged bucket that already covers this one.
            Some((&start, _)) if self.buckets.len() >= SCHEDULE_BUCKETS_MAX => start,
            _ => bucket,
        };
        *self.buckets.entry(start).or_insert(0) += 1;
        self.total += 1;
        if self.buckets.len() > SCHEDULE_BUCKETS_MAX {
            self.merge_latest();
        }
    }

    /// Merges the latest bucket into the one before it (keeps that one's start).
    fn merge_latest(&mut self) {
        if let Some((_, last)) = self.buckets.pop_last() {
            if let Some(mut before) = self.buckets.last_entry() {
                *before.get_mut() += last;
            }
        }
    }

    /// Uncounts a message of `bucket`; one whose bucket came due (and was settled) is counted
    /// in `stored` only.
    fn remove(&mut self, bucket: u64) {
        let Some((&start, count)) = self.buckets.range_mut(..=bucket).next_back() else {
            return;
        };
        *count -= 1;
        self.total -= 1;
        if *count == 0 {
            self.buckets.remove(&start);
        }
    }

    /// Forgets buckets before `bound_bucket`: their messages are due now. Called on every store
    /// and delete of the topic, so it returns at once when nothing came due.
    fn settle(&mut self, bound_bucket: u64) {
        if self
            .buckets
            .first_key_value()
            .is_none_or(|(&first, _)| first >= bound_bucket)
        {
            return;
        }
        let later = self.buckets.split_off(&bound_bucket);
        let due: u64 = self.buckets.values().sum();
        self.total -= due;
        self.buckets = later;
    }
}

/// Stored, due and scheduled messages per topic of one shard.
#[derive(Debug)]
pub struct Stock {
    topics: AHashMap<TopicHash, TopicStock>,
    topics_max: usize,
    untracked: TopicStock,
    census: Option<Census>,
    counted: bool,
    /// In-flight entries per topic (dispatched, delete not yet applied): bounded by the
    /// in-flight table.
    dispatched: AHashMap<TopicHash, u64>,
}

/// A census in progress: what the sweep has counted so far, through `through` (inclusive).
#[derive(Debug, Default)]
struct Census {
    topics: AHashMap<TopicHash, TopicStock>,
    untracked: TopicStock,
    through: Option<EventKey>,
}

impl Census {
    fn covers(&self, key: &EventKey) -> bool {
        self.through.is_some_and(|t| *key <= t)
    }
}

impl Stock {
    pub fn new(topics_max: usize) -> Stock {
        Stock {
            topics: AHashMap::new(),
            topics_max,
            untracked: TopicStock::default(),
            census: None,
            counted: false,
            dispatched: AHashMap::new(),
        }
    }

    /// A message got its in-flight entry.
    pub fn on_dispatched(&mut self, key: &EventKey) {
        *self.dispatched.entry(key.topic_hash()).or_insert(0) += 1;
    }

    /// A message's in-flight entry is gone (its delete was applied).
    pub fn on_retired(&mut self, key: &EventKey) {
        let hash = key.topic_hash();
        if let Some(n) = self.dispatched.get_mut(&hash) {
            *n -= 1;
            if *n == 0 {
                self.dispatched.remove(&hash);
            }
        }
    }

    /// In-flight entries of a topic.
    pub fn dispatched(&self, topic: TopicHash) -> u64 {
        self.dispatched.get(&topic).copied().unwrap_or(0)
    }

    /// Whether a census has completed since this stock was made: before that, messages stored
    /// before the start are missing from the figures.
    pub fn counted(&self) -> bool {
        self.counted
    }

    /// A message is in the store.
    pub fn on_stored(&mut self, key: &EventKey, topic: &str, bound_bucket: u64) {
        let max = self.topics_max;
        Self::entry(&mut self.topics, &mut self.untracked, max, key, topic).add(key, bound_bucket);
        if let Some(census) = self.census.as_mut().filter(|c| c.covers(key)) {
            Self::entry(&mut census.topics, &mut census.untracked, max, key, topic)
                .add(key, bound_bucket);
        }
    }

    /// A message's delete is applied.
    pub fn on_deleted(&mut self, key: &EventKey, bound_bucket: u64) {
        Self::remove_from(&mut self.topics, &mut self.untracked, key, bound_bucket);
        if let Some(census) = self.census.as_mut().filter(|c| c.covers(key)) {
            Self::remove_from(&mut census.topics, &mut census.untracked, key, bound_bucket);
        }
    }

    /// A sweep starts: a new census begins (replacing one that did not finish).
    pub fn begin_census(&mut self) {
        self.census = Some(Census::default());
    }

    /// Counts one sweep row: an event key with its topic's name.
    pub fn census_row(&mut self, key: &EventKey, topic: &str, bound_bucket: u64) {
        let max = self.topics_max;
        if let Some(census) = self.census.as_mut() {
            Self::entry(&mut census.topics, &mut census.untracked, max, key, topic)
                .add(key, bound_bucket);
        }
    }

    /// The sweep has read every key through `key`.
    pub fn census_through(&mut self, key: EventKey) {
        if let Some(census) = self.census.as_mut() {
            census.through = Some(census.through.map_or(key, |t| t.max(key)));
        }
    }

    /// The sweep is over: its census becomes the figures.
    pub fn end_census(&mut self) {
        if let Some(census) = self.census.take() {
            self.topics = census.topics;
            self.untracked = census.untracked;
            self.counted = true;
        }
    }

    /// The sweep gave up: the running figures stay.
    pub fn abort_census(&mut self) {
        self.census = None;
    }

    /// Every counted topic, and the untracked sum (hash `u64::MAX`, no name) when it holds
    /// anything.
    pub fn figures(&self) -> impl Iterator<Item = (TopicHash, &TopicStock)> {
        let untracked =
            (self.untracked.stored > 0).then_some((TopicHash(u64::MAX), &self.untracked));
        self.topics.iter().map(|(h, t)| (*h, t)).chain(untracked)
    }

    /// Topics counted one by one (tests).
    pub fn topics_len(&self) -> usize {
        self.topics.len()
    }

    fn entry<'a>(
        topics: &'a mut AHashMap<TopicHash, TopicStock>,
        untracked: &'a mut TopicStock,
        topics_max: usize,
        key: &EventKey,
        topic: &str,
    ) -> &'a mut TopicStock {
        let hash = key.topic_hash();
        if !topics.contains_key(&hash) && topics.len() >= topics_max {
            return untracked;
        }
        let entry = topics.entry(hash).or_default();
        if entry.name.is_none() {
            entry.name = Some(Arc::from(topic));
        }
        entry
    }

    fn remove_from(
        topics: &mut AHashMap<TopicHash, TopicStock>,
        untracked: &mut TopicStock,
        key: &EventKey,
        bound_bucket: u64,
    ) {
        let hash = key.topic_hash();
        match topics.get_mut(&hash) {
            Some(t) => {
                t.remove(key, bound_bucket);
                if t.stored == 0 {
                    topics.remove(&hash);
                }
            }
            None => untracked.remove(key, bound_bucket),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(topic: u64, bucket: u64, id: u64) -> EventKey {
        EventKey::new(TopicHash(topic), bucket, id)
    }

    fn name(s: &str) -> String {
        s.to_owned()
    }

    fn figures_of(stock: &mut Stock, bound: u64, topic: u64) -> (u64, u64, u64) {
        stock
            .figures()
            .find(|(h, _)| h.0 == topic)
            .map(|(_, t)| (t.stored, t.due(bound), t.scheduled(bound)))
            .unwrap_or_default()
    }

    #[test]
    fn stores_and_deletes_keep_due_and_scheduled_exact() {
        let mut s = Stock::new(16);
        let t = name("orders");
        for id in 0..10 {
            s.on_stored(&key(1, 5, id), &t, 10); // due
        }
        for id in 10..15 {
            s.on_stored(&key(1, 20 + id, id), &t, 10); // scheduled, buckets 30..35
        }
        assert_eq!(figures_of(&mut s, 10, 1), (15, 10, 5));
        s.on_deleted(&key(1, 5, 0), 10);
        s.on_deleted(&key(1, 30, 10), 10);
        assert_eq!(figures_of(&mut s, 10, 1), (13, 9, 4));
        // Time passes: buckets 31 and 32 come due.
        assert_eq!(figures_of(&mut s, 33, 1), (13, 11, 2));
        // Deleting a key whose bucket came due touches `stored` only.
        s.on_deleted(&key(1, 31, 11), 33);
        assert_eq!(figures_of(&mut s, 33, 1), (12, 10, 2));
        for id in 1..10 {
            s.on_deleted(&key(1, 5, id), 33);
        }
        for id in 12..15 {
            s.on_deleted(&key(1, 20 + id, id), 33);
        }
        assert_eq!(s.topics_len(), 0, "an empty topic is dropped");
    }

    #[test]
    fn schedule_buckets_are_bounded_and_merge_early_never_late() {
        let mut s = Stock::new(4);
        let t = name("later");
        let n = 10 * SCHEDULE_BUCKETS_MAX as u64;
        for i in 0..n {
            s.on_stored(&key(7, 1000 + i, i), &t, 10);
        }
        let stock = s.topics.get(&TopicHash(7)).expect("topic counted");
        assert!(stock.scheduled.buckets.len() <= SCHEDULE_BUCKETS_MAX);
        assert_eq!(stock.scheduled(0), n);
        // Every message due by the end is counted due; none is lost on the way.
        let mut last_due = 0;
        for bound in (1000..=1000 + n).step_by(37) {
            let (stored, due, scheduled) = figures_of(&mut s, bound, 7);
            assert_eq!(stored, n);
            assert_eq!(due + scheduled, n);
            assert!(
                due >= bound - 1000,
                "due {due} counted late at bound {bound}"
            );
            assert!(due >= last_due);
            last_due = due;
        }
        assert_eq!(figures_of(&mut s, 1000 + n, 7), (n, n, 0));
        for i in 0..n {
            s.on_deleted(&key(7, 1000 + i, i), 1000 + n);
        }
        assert_eq!(s.topics_len(), 0);
    }

    #[test]
    fn topics_past_the_bound_are_summed_untracked() {
        let mut s = Stock::new(2);
        for topic in 1..=5u64 {
            s.on_stored(&key(topic, 1, topic), &name(&format!("t{topic}")), 10);
        }
        assert_eq!(s.topics_len(), 2);
        let figures: Vec<_> = s.figures().collect();
        let untracked = figures.iter().find(|(h, _)| h.0 == u64::MAX).expect("sum");
        assert_eq!(untracked.1.stored, 3);
        assert_eq!(untracked.1.name, None);
        assert_eq!(figures.iter().map(|(_, t)| t.stored).sum::<u64>(), 5);
    }

    #[test]
    fn a_census_replaces_the_figures_and_sees_changes_behind_it() {
        let mut s = Stock::new(16);
        let t = name("orders");
        // Messages stored before a restart: the new stock does not know them.
        assert!(!s.counted());
        s.begin_census();
        for id in 0..4 {
            s.census_row(&key(1, 5, id), &t, 10);
        }
        s.census_through(key(1, 5, 3));
        // While the sweep runs: a store behind it, a store ahead of it (the sweep will read it),
        // a delete behind it.
        s.on_stored(&key(1, 4, 100), &t, 10);
        s.on_stored(&key(1, 50, 101), &t, 10);
        s.on_deleted(&key(1, 5, 0), 10);
        s.census_row(&key(1, 50, 101), &t, 10);
        s.census_through(key(1, 50, 101));
        s.end_census();
        assert!(s.counted());
        // 4 found - 1 deleted + 1 stored behind + 1 read ahead = 5; one scheduled.
        assert_eq!(figures_of(&mut s, 10, 1), (5, 4, 1));
    }
}
