//! Merging sorted sources (frozen memtables, tables) into one newest-wins stream.
//!
//! Sources are given newest first; for a key present in several, the newest entry wins and the
//! others are skipped. Tombstones are yielded (the caller decides: a scan hides them, compaction
//! keeps or drops them). The merge only reads immutable sources, so it may await block reads
//! between steps without losing consistency; the active memtable, which keeps changing, is merged
//! by the engine in one synchronous step at the end of a scan.
//!
//! Called by the engine's scans and by compaction. Never writes.

use std::cell::RefCell;
use std::ops::Bound;
use std::rc::Rc;

use super::memtable::{Entry, Memtable};
use super::table::TableCursor;
use crate::key::Key;
use crate::storage::StoreError;

/// Entries read from a memtable per borrow.
const MEM_BATCH: usize = 64;

/// One sorted input of a merge.
pub enum Source {
    /// An immutable (frozen) memtable.
    Mem {
        table: Rc<RefCell<Memtable>>,
        /// Next read starts after this key (or at `start` when `None`).
        after: Option<Key>,
        start: Key,
        end: Option<Key>,
        buffered: std::collections::VecDeque<(Key, Entry)>,
        done: bool,
    },
    Disk(TableCursor),
}

impl Source {
    pub fn memtable(table: Rc<RefCell<Memtable>>, start: &[u8], end: Option<&[u8]>) -> Source {
        Source::Mem {
            table,
            after: None,
            start: Key::from_slice(start),
            end: end.map(Key::from_slice),
            buffered: std::collections::VecDeque::new(),
            done: false,
        }
    }

    async fn next(&mut self) -> Result<Option<(Key, Entry)>, StoreError> {
        match self {
            Source::Mem {
                table,
                after,
                start,
                end,
                buffered,
                done,
            } => {
                if buffered.is_empty() && !*done {
                    let mt = table.borrow();
                    let lower = match after {
                        Some(k) => Bound::Excluded(k.as_slice()),
                        None => Bound::Included(start.as_slice()),
                    };
                    let upper = end
                        .as_ref()
                        .map_or(Bound::Unbounded, |e| Bound::Excluded(e.as_slice()));
                    buffered.extend(
                        mt.range(lower, upper)
                            .take(MEM_BATCH)
                            .map(|(k, e)| (k.clone(), e.clone())),
                    );
                    if buffered.len() < MEM_BATCH {
                        *done = true;
                    }
                    if let Some((k, _)) = buffered.back() {
                        *after = Some(k.clone());
                    }
                }
                Ok(buffered.pop_front())
            }
            Source::Disk(cursor) => cursor.next().await,
        }
    }
}

struct Slot {
    source: Source,
    head: Option<(Key, Entry)>,
    primed: bool,
}

/// Newest-wins merge of sources given newest first.
pub struct MergeIter {
    slots: Vec<Slot>,
}

impl MergeIter {
    pub fn new(sources: Vec<Source>) -> MergeIter {
        MergeIter {
            slots: sources
                .into_iter()
                .map(|source| Slot {
                    source,
                    head: None,
                    primed: false,
                })
                .collect(),
        }
    }

    /// The next key and its newest entry (tombstones included), or `None` when all are done.
    pub async fn next(&mut self) -> Result<Option<(Key, Entry)>, StoreError> {
        for slot in &mut self.slots {
            if !slot.primed {
                slot.head = slot.source.next().await?;
                slot.primed = true;
            }
        }
        let mut best: Option<usize> = None;
        for (i, slot) in self.slots.iter().enumerate() {
            if let Some((key, _)) = &slot.head {
                // Strictly smaller only: on a tie the newer (lower index) source keeps the win.
                if best.is_none_or(|b| self.slots[b].head.as_ref().is_some_and(|(bk, _)| key < bk))
                {
                    best = Some(i);
                }
            }
        }
        let Some(best) = best else {
            return Ok(None);
        };
        let winner = self.slots[best].head.take();
        self.slots[best].primed = false;
        if let Some((key, _)) = &winner {
            for slot in &mut self.slots {
                if slot.head.as_ref().is_some_and(|(k, _)| k == key) {
                    slot.head = None;
                    slot.primed = false;
                }
            }
        }
        Ok(winner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Value;
    use crate::storage::WriteBatch;

    fn mem(ops: &[(u8, Option<u8>)]) -> Rc<RefCell<Memtable>> {
        let mut mt = Memtable::new();
        let mut batch = WriteBatch::new();
        for &(k, v) in ops {
            match v {
                Some(v) => batch.put(Key::from_slice(&[k]), Value::copy_from_slice(&[v])),
                None => batch.delete(Key::from_slice(&[k])),
            }
        }
        mt.apply(1, batch, |_| true);
        Rc::new(RefCell::new(mt))
    }

    #[test]
    fn newest_source_wins_and_tombstones_are_yielded() {
        let newer = mem(&[(1, Some(10)), (3, None), (5, Some(50))]);
        let older = mem(&[(1, Some(1)), (2, Some(2)), (3, Some(3)), (6, Some(6))]);
        let mut merge = MergeIter::new(vec![
            Source::memtable(newer, &[], None),
            Source::memtable(older, &[], Some(&[6])),
        ]);
        let mut got = Vec::new();
        futures_lite::future::block_on(async {
            while let Some((k, e)) = merge.next().await.unwrap() {
                got.push((k[0], e.value().map(|v| v.as_bytes()[0])));
            }
        });
        assert_eq!(
            got,
            vec![(1, Some(10)), (2, Some(2)), (3, None), (5, Some(50))]
        );
    }

    #[test]
    fn memtable_source_pages_past_its_batch_size() {
        let ops: Vec<(u8, Option<u8>)> = (0..200u8).map(|k| (k, Some(k))).collect();
        let mut merge = MergeIter::new(vec![Source::memtable(mem(&ops), &[10], Some(&[150]))]);
        let mut n = 0;
        futures_lite::future::block_on(async {
            while let Some((k, _)) = merge.next().await.unwrap() {
                assert_eq!(k[0], 10 + n);
                n += 1;
            }
        });
        assert_eq!(n, 140);
    }
}
