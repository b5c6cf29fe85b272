//! The memtable: a shard's newest writes, in key order, bounded in bytes by the engine.
//!
//! Owns the in-memory map of puts and tombstones since the last freeze. Pure: no I/O, no clock.
//! The engine applies every batch here right after its command is appended to the log, freezes the table
//! when [`Memtable::bytes`] passes `memtable_bytes_max`, and a frozen memtable is only read
//! (scans, gets, and the flush that writes it to a sorted table).
//!
//! Annihilation (DESIGN-NOTES §4): pinq writes an event key once and deletes it once, usually
//! seconds later, so a delete that finds its put here removes it outright and the pair never
//! reaches a table. That is only correct when nothing older (a frozen memtable, a table) may
//! still hold a live value for the key — metadata keys are overwritten repeatedly — so the
//! caller answers that question with `live_below`, and the delete leaves a tombstone whenever the
//! answer is "maybe". A delete of a key that is nowhere below is dropped: it deletes nothing.

use std::collections::{btree_map, BTreeMap};
use std::ops::Bound;

use crate::key::Key;
use crate::message::Value;
use crate::storage::{WriteBatch, WriteOp};

/// Bytes charged per entry on top of key and value: tree node share, key inline buffer, the
/// value's reference count. An estimate; it keeps the bound honest for small messages.
pub const ENTRY_OVERHEAD_BYTES: usize = 64;

/// One version of a key.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    Put(Value),
    /// The key is deleted; older sources may still hold a value that this hides.
    Tombstone,
}

impl Entry {
    fn charge(key: &[u8], entry: &Entry) -> usize {
        key.len()
            + ENTRY_OVERHEAD_BYTES
            + match entry {
                Entry::Put(value) => value.len(),
                Entry::Tombstone => 0,
            }
    }

    /// The live value, if this entry is a put.
    pub fn value(&self) -> Option<&Value> {
        match self {
            Entry::Put(value) => Some(value),
            Entry::Tombstone => None,
        }
    }
}

/// What happened to the operations applied to one memtable.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MemtableCounters {
    pub puts: u64,
    /// Deletes that met their put here and removed it: neither reaches a table.
    pub annihilated: u64,
    /// Deletes kept as tombstones because an older source may hold the key.
    pub tombstones: u64,
    /// Deletes of keys that exist nowhere: nothing to do.
    pub deletes_dropped: u64,
}

/// The in-memory sorted write buffer.
#[derive(Debug, Default)]
pub struct Memtable {
    map: BTreeMap<Key, Entry>,
    bytes: usize,
    /// Highest log index applied (0 when none).
    last_seq: u64,
    /// The shard's event-id high-water mark as of `last_seq` (the flush records it in the
    /// manifest with `last_seq`).
    event_id_high_water: u64,
    counters: MemtableCounters,
}

impl Memtable {
    pub fn new() -> Memtable {
        Memtable::default()
    }

    /// Applies one batch (WAL record `seq`) in order. `live_below(key)` must return true when an
    /// older source may hold a live value for `key`; a false "true" only costs a tombstone.
    pub fn apply(&mut self, seq: u64, batch: WriteBatch, live_below: impl Fn(&[u8]) -> bool) {
        debug_assert!(
            seq > self.last_seq || seq == 0,
            "memtable batches must arrive in WAL order"
        );
        self.last_seq = self.last_seq.max(seq);
        for op in batch.ops {
            match op {
                WriteOp::Put(key, value) => {
                    self.counters.puts += 1;
                    self.insert(key, Entry::Put(value));
                }
                WriteOp::Delete(key) => self.delete(key, &live_below),
            }
        }
    }

    // One tree descent per operation (`entry`): key comparisons were the largest single cost
    // of a shard at max rate.
    fn insert(&mut self, key: Key, entry: Entry) {
        let charge = Entry::charge(&key, &entry);
        match self.map.entry(key) {
            btree_map::Entry::Occupied(mut slot) => {
                self.bytes -= Entry::charge(slot.key(), slot.get());
                self.bytes += charge;
                slot.insert(entry);
            }
            btree_map::Entry::Vacant(slot) => {
                self.bytes += charge;
                slot.insert(entry);
            }
        }
    }

    fn delete(&mut self, key: Key, live_below: &impl Fn(&[u8]) -> bool) {
        match self.map.entry(key) {
            btree_map::Entry::Occupied(slot) => {
                if matches!(slot.get(), Entry::Tombstone) {
                    return;
                }
                if live_below(slot.key()) {
                    self.counters.tombstones += 1;
                    let mut slot = slot;
                    self.bytes -= Entry::charge(slot.key(), slot.get());
                    self.bytes += Entry::charge(slot.key(), &Entry::Tombstone);
                    slot.insert(Entry::Tombstone);
                } else {
                    self.counters.annihilated += 1;
                    let (k, old) = slot.remove_entry();
                    self.bytes -= Entry::charge(&k, &old);
                }
            }
            btree_map::Entry::Vacant(slot) => {
                if live_below(slot.key()) {
                    self.counters.tombstones += 1;
                    self.bytes += Entry::charge(slot.key(), &Entry::Tombstone);
                    slot.insert(Entry::Tombstone);
                } else {
                    self.counters.deletes_dropped += 1;
                }
            }
        }
    }

    /// The newest version of `key` held here.
    pub fn get(&self, key: &[u8]) -> Option<&Entry> {
        self.map.get(key)
    }

    /// Entries between two bounds, in key order.
    pub fn range<'a>(
        &'a self,
        start: Bound<&'a [u8]>,
        end: Bound<&'a [u8]>,
    ) -> impl Iterator<Item = (&'a Key, &'a Entry)> + 'a {
        let empty = match (start, end) {
            (Bound::Included(s), Bound::Excluded(e))
            | (Bound::Excluded(s), Bound::Included(e))
            | (Bound::Excluded(s), Bound::Excluded(e)) => s >= e,
            (Bound::Included(s), Bound::Included(e)) => s > e,
            _ => false,
        };
        // BTreeMap::range panics on inverted bounds; an empty range is the honest answer.
        let bounds = if empty {
            (Bound::Included(&[][..]), Bound::Excluded(&[][..]))
        } else {
            (start, end)
        };
        self.map.range::<[u8], _>(bounds)
    }

    /// Every entry in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&Key, &Entry)> {
        self.map.iter()
    }

    /// Charged bytes (keys, values, per-entry overhead).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Raises the event-id high-water mark this memtable carries to the manifest.
    pub fn note_event_id_high_water(&mut self, high_water: u64) {
        self.event_id_high_water = self.event_id_high_water.max(high_water);
    }

    pub fn event_id_high_water(&self) -> u64 {
        self.event_id_high_water
    }

    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    pub fn counters(&self) -> MemtableCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> Key {
        Key::from_slice(&[b; 24])
    }

    fn put(batch: &mut WriteBatch, b: u8, len: usize) {
        batch.put(key(b), Value::copy_from_slice(&vec![b; len]));
    }

    #[test]
    fn delete_meeting_its_put_annihilates_when_nothing_is_below() {
        let mut mt = Memtable::new();
        let mut batch = WriteBatch::new();
        put(&mut batch, 1, 100);
        put(&mut batch, 2, 100);
        mt.apply(1, batch, |_| false);
        let mut batch = WriteBatch::new();
        batch.delete(key(1));
        mt.apply(2, batch, |_| false);
        assert_eq!(mt.len(), 1);
        assert!(mt.get(&key(1)).is_none());
        assert_eq!(mt.counters().annihilated, 1);
        assert_eq!(mt.bytes(), 24 + 100 + ENTRY_OVERHEAD_BYTES);
        assert_eq!(mt.last_seq(), 2);
    }

    #[test]
    fn delete_leaves_a_tombstone_when_an_older_source_may_hold_the_key() {
        let mut mt = Memtable::new();
        let mut batch = WriteBatch::new();
        put(&mut batch, 1, 10);
        batch.delete(key(1));
        batch.delete(key(3));
        mt.apply(1, batch, |_| true);
        assert_eq!(mt.get(&key(1)), Some(&Entry::Tombstone));
        assert_eq!(mt.get(&key(3)), Some(&Entry::Tombstone));
        assert_eq!(mt.counters().tombstones, 2);
        assert_eq!(mt.bytes(), 2 * (24 + ENTRY_OVERHEAD_BYTES));
    }

    #[test]
    fn delete_of_a_key_that_exists_nowhere_is_dropped() {
        let mut mt = Memtable::new();
        let mut batch = WriteBatch::new();
        batch.delete(key(9));
        mt.apply(1, batch, |_| false);
        assert!(mt.is_empty());
        assert_eq!(mt.bytes(), 0);
        assert_eq!(mt.counters().deletes_dropped, 1);
    }

    #[test]
    fn overwrites_keep_the_byte_count_exact() {
        let mut mt = Memtable::new();
        for (seq, len) in [(1u64, 10usize), (2, 300), (3, 5)] {
            let mut batch = WriteBatch::new();
            put(&mut batch, 7, len);
            mt.apply(seq, batch, |_| false);
        }
        assert_eq!(mt.len(), 1);
        assert_eq!(mt.bytes(), 24 + 5 + ENTRY_OVERHEAD_BYTES);
        assert_eq!(
            mt.get(&key(7)).and_then(|e| e.value()).map(Value::len),
            Some(5)
        );
    }

    #[test]
    fn range_is_half_open_and_ordered() {
        let mut mt = Memtable::new();
        let mut batch = WriteBatch::new();
        for b in [5u8, 1, 3, 4, 2] {
            put(&mut batch, b, 1);
        }
        mt.apply(1, batch, |_| false);
        let k2 = key(2);
        let k4 = key(4);
        let got: Vec<u8> = mt
            .range(
                Bound::Included(k2.as_slice()),
                Bound::Excluded(k4.as_slice()),
            )
            .map(|(k, _)| k[0])
            .collect();
        assert_eq!(got, vec![2, 3]);
        let all: Vec<u8> = mt
            .range(Bound::Unbounded, Bound::Unbounded)
            .map(|(k, _)| k[0])
            .collect();
        assert_eq!(all, vec![1, 2, 3, 4, 5]);
        let inverted = mt.range(
            Bound::Included(k4.as_slice()),
            Bound::Excluded(k2.as_slice()),
        );
        assert_eq!(inverted.count(), 0);
    }
}
