//! Giving memory back after a drain: the one rule the pipeline's tables shrink by.
//!
//! Hash maps, sets, deques and heaps keep their peak capacity after they empty, so a burst of
//! 1M in-flight entries would pin that memory for the life of the shard. Each table that can grow
//! with load calls [`give_back`] after it removes elements. It shrinks a table only when it is
//! under a quarter full and its capacity is past [`SHRINK_FLOOR_LEN`], and then to twice its
//! length: the next shrink needs the length to halve again, and a regrowth needs it to double, so
//! the cost stays amortised O(1) per removal. Pure: no I/O, no clock.

use std::collections::{BinaryHeap, VecDeque};
use std::hash::Hash;

use ahash::{AHashMap, AHashSet};

/// Tables at or under this capacity are never shrunk (reallocating a small table saves nothing).
pub const SHRINK_FLOOR_LEN: usize = 1024;

/// A table that can report and release its spare capacity.
pub trait Shrink {
    fn len_and_capacity(&self) -> (usize, usize);
    fn shrink_to_len(&mut self, len_min: usize);
}

/// Shrinks `table` to twice its length if it is large and under a quarter full. Returns whether
/// it shrank.
pub fn give_back(table: &mut impl Shrink) -> bool {
    let (len, capacity) = table.len_and_capacity();
    if capacity <= SHRINK_FLOOR_LEN || len >= capacity / 4 {
        return false;
    }
    table.shrink_to_len(len.saturating_mul(2).max(SHRINK_FLOOR_LEN / 2));
    true
}

impl<T> Shrink for VecDeque<T> {
    fn len_and_capacity(&self) -> (usize, usize) {
        (self.len(), self.capacity())
    }
    fn shrink_to_len(&mut self, len_min: usize) {
        self.shrink_to(len_min);
    }
}

impl<T: Ord> Shrink for BinaryHeap<T> {
    fn len_and_capacity(&self) -> (usize, usize) {
        (self.len(), self.capacity())
    }
    fn shrink_to_len(&mut self, len_min: usize) {
        self.shrink_to(len_min);
    }
}

impl<K: Eq + Hash, V> Shrink for AHashMap<K, V> {
    fn len_and_capacity(&self) -> (usize, usize) {
        (self.len(), self.capacity())
    }
    fn shrink_to_len(&mut self, len_min: usize) {
        self.shrink_to(len_min);
    }
}

impl<K: Eq + Hash> Shrink for AHashSet<K> {
    fn len_and_capacity(&self) -> (usize, usize) {
        (self.len(), self.capacity())
    }
    fn shrink_to_len(&mut self, len_min: usize) {
        self.shrink_to(len_min);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drained_large_table_shrinks_and_a_small_or_busy_one_does_not() {
        let mut deque: VecDeque<u64> = (0..100_000).collect();
        deque.drain(..99_000);
        assert!(give_back(&mut deque));
        assert!(deque.capacity() < 10_000, "{}", deque.capacity());
        assert_eq!(deque.len(), 1_000);

        let mut small: VecDeque<u64> = (0..1000).collect();
        small.clear();
        assert!(!give_back(&mut small), "at or under the floor: kept");

        let mut busy: AHashMap<u64, u64> = (0..100_000).map(|i| (i, i)).collect();
        busy.retain(|k, _| *k < 60_000);
        assert!(!give_back(&mut busy), "more than a quarter full: kept");
        busy.retain(|k, _| *k < 1_000);
        assert!(give_back(&mut busy));
        assert!(busy.capacity() < 10_000, "{}", busy.capacity());
    }
}
