//! `MemStore`: an in-memory [`Store`] over a `BTreeMap`, for tests, benchmarks and
//! `--storage memory`. Nothing survives the process. Its synchronous methods let pure-core tests
//! drive a store without an executor.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ops::Bound;

use super::store::{Store, StoreError, Sync};
use crate::key::Key;
use crate::log::Command;
use crate::message::Value;

#[derive(Default)]
pub struct MemStore {
    map: RefCell<BTreeMap<Key, Value>>,
    last_index: Cell<u64>,
    event_id_high_water: Cell<u64>,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// Applies a command at once (there is no log: the next index is the command's). Returns
    /// its index.
    pub fn apply(&self, command: &Command) -> u64 {
        let index = self.last_index.get() + 1;
        self.last_index.set(index);
        let mut map = self.map.borrow_mut();
        match command {
            Command::Store {
                messages,
                event_id_high_water,
            } => {
                for (key, value) in messages {
                    map.insert(key.to_key(), value.clone());
                }
                let high = self.event_id_high_water.get().max(*event_id_high_water);
                self.event_id_high_water.set(high);
            }
            Command::Delete { keys } => {
                for key in keys {
                    map.remove(key.as_bytes().as_slice());
                }
            }
            Command::GroupPolicy { topic, group, .. } => {
                map.insert(
                    Command::policy_key(topic, group),
                    Value::copy_from_slice(&command.to_bytes()),
                );
            }
        }
        index
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
    async fn commit(&self, command: &Command, _sync: Sync) -> Result<u64, StoreError> {
        Ok(self.apply(command))
    }

    fn event_id_high_water(&self) -> u64 {
        self.event_id_high_water.get()
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
