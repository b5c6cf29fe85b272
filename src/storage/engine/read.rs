//! The engine's read path: snapshots, merged scans and point reads, and the annihilation
//! question "may an older source hold this key?" ([`live_below`]).
//!
//! A scan takes a snapshot (the active memtable's `Rc`, the frozen memtables, the table version),
//! merges the immutable sources with awaits allowed in between, and merges the active memtable
//! in one synchronous step at the end, so the result is one consistent state even while writes
//! continue. Never holds a `RefCell` borrow across an await.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ops::Bound;
use std::rc::Rc;

use super::{Inner, Version};
use crate::key::Key;
use crate::message::Value;
use crate::storage::memtable::{Entry, Memtable};
use crate::storage::merge::{MergeIter, Source};
use crate::storage::table::{Table, TableCursor};
use crate::storage::StoreError;

/// True when a source older than the active memtable may hold a live value for `key`: the
/// newest frozen memtable that has the key decides; otherwise any table whose range and bloom
/// filter admit it. Used by annihilation (memtable) during writes and recovery.
pub(crate) fn live_below(
    frozen: &VecDeque<Rc<RefCell<Memtable>>>,
    tables: &[Rc<Table>],
    key: &[u8],
) -> bool {
    for mt in frozen {
        match mt.borrow().get(key) {
            Some(Entry::Put(_)) => return true,
            Some(Entry::Tombstone) => return false,
            None => {}
        }
    }
    tables.iter().any(|t| t.may_contain(key))
}

/// What a read sees: the active memtable (still changing), the frozen ones and the tables.
struct Snapshot {
    active: Rc<RefCell<Memtable>>,
    frozen: Vec<Rc<RefCell<Memtable>>>,
    version: Rc<Version>,
}

/// Upper bound of the part of a scan whose older entries are all known.
enum Upper<'a> {
    /// The scan's own end (`None` = unbounded): older sources are exhausted.
    End(Option<&'a [u8]>),
    /// Through this key, inclusive.
    Through(Key),
}

/// Merges the active memtable (newest) with the older entries already read, hiding tombstones.
fn merge_active(
    active: &Memtable,
    older: &[(Key, Entry)],
    start: &[u8],
    upper: &Upper<'_>,
    limit: usize,
) -> Vec<(Key, Value)> {
    let end = match upper {
        Upper::End(Some(e)) => Bound::Excluded(*e),
        Upper::End(None) => Bound::Unbounded,
        Upper::Through(k) => Bound::Included(k.as_slice()),
    };
    let mut a = active.range(Bound::Included(start), end).peekable();
    let mut o = older.iter().map(|(k, e)| (k, e)).peekable();
    let mut out = Vec::with_capacity(limit.min(1024));
    while out.len() < limit {
        let next = match (a.peek(), o.peek()) {
            (None, None) => None,
            (Some(_), None) => a.next(),
            (None, Some(_)) => o.next(),
            (Some((ak, _)), Some((ok, _))) => match ak.as_slice().cmp(ok.as_slice()) {
                std::cmp::Ordering::Less => a.next(),
                std::cmp::Ordering::Greater => o.next(),
                std::cmp::Ordering::Equal => {
                    // The active memtable is newer: its entry shadows the older one.
                    o.next();
                    a.next()
                }
            },
        };
        let Some((key, entry)) = next else { break };
        if let Entry::Put(value) = entry {
            out.push((key.clone(), value.clone()));
        }
    }
    out
}

impl Inner {
    fn snapshot(&self) -> Snapshot {
        let st = self.state.borrow();
        Snapshot {
            active: Rc::clone(&st.active),
            frozen: st.frozen.iter().cloned().collect(),
            version: Rc::clone(&st.version),
        }
    }

    pub(super) async fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        self.check_readable()?;
        if limit == 0 || end.is_some_and(|e| e <= start) {
            return Ok(Vec::new());
        }
        let Snapshot {
            active,
            frozen,
            version,
        } = self.snapshot();
        let mut sources: Vec<Source> = frozen
            .into_iter()
            .map(|mt| Source::memtable(mt, start, end))
            .collect();
        for table in &version.tables {
            let props = table.props();
            let overlaps = props.entries() > 0
                && props.max_key.as_slice() >= start
                && end.is_none_or(|e| props.min_key.as_slice() < e);
            if overlaps {
                sources.push(Source::Disk(TableCursor::new(Rc::clone(table), start, end)));
            }
        }
        if sources.is_empty() {
            return Ok(merge_active(
                &active.borrow(),
                &[],
                start,
                &Upper::End(end),
                limit,
            ));
        }
        let mut merge = MergeIter::new(sources);
        let mut older: Vec<(Key, Entry)> = Vec::new();
        let mut want = limit.saturating_add(16);
        loop {
            let mut exhausted = false;
            while older.len() < want {
                match merge.next().await? {
                    Some(item) => older.push(item),
                    None => {
                        exhausted = true;
                        break;
                    }
                }
            }
            let upper = match (exhausted, older.last()) {
                (false, Some((k, _))) => Upper::Through(k.clone()),
                _ => Upper::End(end),
            };
            let out = merge_active(&active.borrow(), &older, start, &upper, limit);
            if out.len() >= limit || exhausted {
                return Ok(out);
            }
            want = want.saturating_mul(2);
        }
    }

    pub(super) async fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.check_readable()?;
        let Snapshot {
            active,
            frozen,
            version,
        } = self.snapshot();
        if let Some(entry) = active.borrow().get(key) {
            return Ok(entry.value().cloned());
        }
        for mt in &frozen {
            if let Some(entry) = mt.borrow().get(key) {
                return Ok(entry.value().cloned());
            }
        }
        for table in &version.tables {
            if let Some(entry) = table.get(key).await? {
                return Ok(entry.value().cloned());
            }
        }
        Ok(None)
    }
}
