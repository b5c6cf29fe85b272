//! `MemStore`: an in-memory [`Store`] over a `BTreeMap`, for tests, benchmarks and
//! `--storage memory`. Nothing survives the process. Its synchronous methods let pure-core tests
//! drive a store without an executor.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Bound;

use super::{Store, StoreError, Sync, WriteBatch, WriteOp};
use crate::key::Key;
use crate::message::Value;

#[derive(Default)]
pub struct MemStore {
    map: RefCell<BTreeMap<Key, Value>>,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    pub fn apply(&self, batch: WriteBatch) {
        let mut map = self.map.borrow_mut();
        for op in batch.ops {
            match op {
                WriteOp::Put(key, value) => {
                    map.insert(key, value);
                }
                WriteOp::Delete(key) => {
                    map.remove(&key);
                }
            }
        }
    }

    pub fn scan_now(&self, start: &[u8], end: Option<&[u8]>, limit: usize) -> Vec<(Key, Value)> {
        let map = self.map.borrow();
        map.range::<[u8], _>((
            Bound::Included(start),
            end.map_or(Bound::Unbounded, Bound::Excluded),
        ))
        .take(limit)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
    }

    pub fn first_key_now(&self, start: &[u8], end: Option<&[u8]>) -> Option<Key> {
        let map = self.map.borrow();
        map.range::<[u8], _>((
            Bound::Included(start),
            end.map_or(Bound::Unbounded, Bound::Excluded),
        ))
        .next()
        .map(|(k, _)| k.clone())
    }

    pub fn get_now(&self, key: &[u8]) -> Option<Value> {
        self.map.borrow().get(key).cloned()
    }

    pub fn len(&self) -> usize {
        self.map.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.borrow().is_empty()
    }
}

impl Store for MemStore {
    async fn write(&self, batch: WriteBatch, _sync: Sync) -> Result<(), StoreError> {
        self.apply(batch);
        Ok(())
    }

    async fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        Ok(self.scan_now(start, end, limit))
    }

    async fn first_key(&self, start: &[u8], end: Option<&[u8]>) -> Result<Option<Key>, StoreError> {
        Ok(self.first_key_now(start, end))
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        Ok(self.get_now(key))
    }
}
