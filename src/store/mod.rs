//! The storage interface the shard uses, and its in-memory implementation.
//!
//! The delivery pipeline never calls a store: it is a pure core that asks for scans and returns
//! write batches as data. The shard's shell carries those requests to a [`Store`]. Two engines sit
//! behind this trait: [`MemStore`] (tests, benchmarks, `--storage memory`) and the io_uring LSM log
//! in `crate::storage`. Methods are `async` because the LSM engine waits on io_uring; the memory
//! store answers at once.
//!
//! Contract every engine keeps:
//! - `write` applies a batch atomically: after a crash either all of it or none of it is visible;
//!   with [`Sync::Durable`] it resolves only once the batch is on stable storage.
//! - `scan` returns keys in byte order within `[start, end)`, at most `limit` of them, from one
//!   consistent snapshot; callers page by resuming after the last key returned.
//! - `first_key` is a cheap seek: the first key in `[start, end)` without reading its value.

pub mod memory;

pub use memory::MemStore;

use std::future::Future;

use crate::key::Key;
use crate::message::Value;

/// How far a write must get before it resolves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    /// Resolves once the batch is on stable storage (fdatasync).
    Durable,
    /// Resolves once the batch is applied in memory and queued for the log.
    Buffered,
}

/// One change in a write batch.
#[derive(Clone, Debug, PartialEq)]
pub enum WriteOp {
    Put(Key, Value),
    Delete(Key),
}

impl WriteOp {
    pub fn key(&self) -> &Key {
        match self {
            WriteOp::Put(key, _) | WriteOp::Delete(key) => key,
        }
    }
}

/// An atomic group of puts and deletes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WriteBatch {
    pub ops: Vec<WriteOp>,
}

impl WriteBatch {
    pub fn new() -> WriteBatch {
        WriteBatch::default()
    }

    pub fn put(&mut self, key: Key, value: Value) {
        self.ops.push(WriteOp::Put(key, value));
    }

    pub fn delete(&mut self, key: Key) {
        self.ops.push(WriteOp::Delete(key));
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// Errors from a storage engine.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("corrupt data in {file}: {what}")]
    Corrupt { file: String, what: String },
    #[error("store is closed")]
    Closed,
}

/// A shard's key-value storage engine. See the module docs for the contract.
pub trait Store {
    fn write(&self, batch: WriteBatch, sync: Sync) -> impl Future<Output = Result<(), StoreError>>;

    /// `end == None` means unbounded.
    fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<(Key, Value)>, StoreError>>;

    fn first_key(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> impl Future<Output = Result<Option<Key>, StoreError>>;

    /// Reads one key.
    fn get(&self, key: &[u8]) -> impl Future<Output = Result<Option<Value>, StoreError>>;
}
