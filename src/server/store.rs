//! `ShardStore`: the storage engine a shard runs, chosen by `storage.engine`.
//!
//! A closed enum rather than a trait object: `Store` has async methods, and the set of engines is
//! pinq's own. Every method delegates.
//!
//! Besides the [`Store`] methods: [`ShardStore::storage_figures`] (for `/metrics`; `None` for
//! engines without figures) and [`ShardStore::close`] (graceful shutdown, after the last write).

use crate::key::Key;
use crate::message::Value;
use crate::metrics::StorageFigures;
use crate::store::{MemStore, Store, StoreError, Sync, WriteBatch};

pub enum ShardStore {
    Memory(MemStore),
}

impl ShardStore {
    /// The engine's figures for the metrics endpoint; `None` when it keeps none (memory).
    pub fn storage_figures(&self) -> Option<StorageFigures> {
        match self {
            ShardStore::Memory(_) => None,
        }
    }

    /// Makes everything written so far durable and releases the engine (graceful shutdown).
    pub async fn close(&self) -> Result<(), StoreError> {
        match self {
            ShardStore::Memory(_) => Ok(()),
        }
    }
}

impl Store for ShardStore {
    async fn write(&self, batch: WriteBatch, sync: Sync) -> Result<(), StoreError> {
        match self {
            ShardStore::Memory(s) => s.write(batch, sync).await,
        }
    }

    async fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        match self {
            ShardStore::Memory(s) => s.scan(start, end, limit).await,
        }
    }

    async fn first_key(&self, start: &[u8], end: Option<&[u8]>) -> Result<Option<Key>, StoreError> {
        match self {
            ShardStore::Memory(s) => s.first_key(start, end).await,
        }
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        match self {
            ShardStore::Memory(s) => s.get(key).await,
        }
    }
}
