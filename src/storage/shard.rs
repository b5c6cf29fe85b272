//! `ShardStore`: the storage engine a shard runs, chosen by `storage.engine`, and how it is opened.
//!
//! A closed enum rather than a trait object: `Store` has async methods, and the set of engines is
//! pinq's own. Both logged engines commit through `crate::storage::CommitPath` and read from
//! their LSM engine, so a method has two cases: the engine or the memory store. [`ShardStore::open`] runs inside the shard's executor:
//! the LSM engine's DMA files belong to the executor that opens them, and its recovery makes
//! direct-I/O reads work on the disk first (the glommio polled-I/O probe trap, see
//! `storage::io::probe_disk`). It never panics: a bad data directory or a corrupt file is an
//! error that names the path, and start-up stops on it.
//!
//! Besides the [`Store`] methods: [`ShardStore::storage_figures`] (for `/metrics`; `None` for
//! engines without figures) and [`ShardStore::close`] (graceful shutdown, after the last write).

use std::path::{Path, PathBuf};

use crate::cluster::driver::{DriverConfig, ReplicatedStore};
use crate::config::{StorageConfig, StorageEngine};
use crate::key::Key;
use crate::log::Command;
use crate::message::Value;
use crate::metrics::StorageFigures;
use crate::storage::{Engine, Logged, LsmOptions, LsmStore};
use crate::storage::{MemStore, Store, StoreError, StoreHealth, Sync};

pub enum ShardStore {
    Memory(MemStore),
    Lsm(LsmStore),
    /// Clustered: the shard's Raft log in front of the LSM engine (`crate::cluster::driver`).
    Replicated(std::rc::Rc<ReplicatedStore>),
}

/// The directory of shard `shard_id` under `server.dataDir`.
pub fn shard_dir(data_dir: &Path, shard_id: usize) -> PathBuf {
    data_dir.join(format!("shard-{shard_id}"))
}

/// The engine options the config's `[storage]` keys set; the rest keep the engine's defaults.
pub fn lsm_options(storage: &StorageConfig) -> LsmOptions {
    let defaults = LsmOptions::default();
    LsmOptions {
        memtable_bytes_max: storage.memtable_bytes_max,
        wal_segment_bytes_max: storage.wal_segment_bytes_max,
        // A zero-fill step is counted against the WAL cap as soon as it is made: at most 1/32
        // of the cap, so the zeros ahead of the records never take the log past it by more
        // than about 3 %.
        wal_preallocate_bytes: defaults
            .wal_preallocate_bytes
            .min(storage.wal_segment_bytes_max)
            .min(storage.wal_bytes_max / 32),
        wal_bytes_max: storage.wal_bytes_max,
        recover_truncated_wal: storage.recover_truncated_wal,
        ..defaults
    }
}

impl ShardStore {
    /// Opens the engine `storage.engine` names for shard `shard_id`. Must run on the shard's
    /// executor.
    pub async fn open(
        storage: &StorageConfig,
        data_dir: &Path,
        shard_id: usize,
    ) -> Result<ShardStore, StoreError> {
        match storage.engine {
            StorageEngine::Memory => Ok(ShardStore::Memory(MemStore::new())),
            StorageEngine::Lsm => {
                let dir = shard_dir(data_dir, shard_id);
                let store = LsmStore::open(&dir, lsm_options(storage)).await?;
                let report = &store.stats().recovery;
                tracing::info!(
                    shard = shard_id,
                    dir = %dir.display(),
                    tables = report.tables,
                    table_bytes = report.table_bytes,
                    records_replayed = report.records_replayed,
                    wal_bytes_read = report.wal_bytes_read,
                    "storage opened"
                );
                Ok(ShardStore::Lsm(store))
            }
        }
    }

    /// Opens shard `shard_id`'s replicated store (clustered mode: always the LSM engine) and
    /// starts its Raft driver; its messages for peers go to `outbox`. Must run on the shard's
    /// executor.
    pub async fn open_replicated(
        storage: &StorageConfig,
        data_dir: &Path,
        shard_id: usize,
        config: DriverConfig,
        outbox: glommio::channels::local_channel::LocalSender<Vec<raft::eraftpb::Message>>,
    ) -> Result<ShardStore, StoreError> {
        let dir = shard_dir(data_dir, shard_id);
        let store = std::rc::Rc::new(
            ReplicatedStore::open(&dir, lsm_options(storage), config, outbox).await?,
        );
        store.start()?;
        let status = store.status();
        tracing::info!(
            shard = shard_id,
            dir = %dir.display(),
            first_index = status.first_index,
            last_index = status.last_index,
            commit = status.commit,
            applied = status.applied,
            "replicated storage opened"
        );
        Ok(ShardStore::Replicated(store))
    }

    /// The engine's figures for the metrics endpoint; `None` when it keeps none (memory).
    pub fn storage_figures(&self) -> Option<StorageFigures> {
        match self {
            ShardStore::Memory(_) => None,
            ShardStore::Lsm(s) => Some(StorageFigures::from(&s.stats())),
            ShardStore::Replicated(s) => Some(StorageFigures::from(&s.stats())),
        }
    }

    /// The engine's own view of its health (disk full, unreadable blocks); healthy for engines
    /// that cannot tell.
    pub fn health(&self) -> StoreHealth {
        match self {
            ShardStore::Memory(_) => StoreHealth::default(),
            ShardStore::Lsm(s) => s.health(),
            ShardStore::Replicated(s) => s.health(),
        }
    }

    /// Graceful close: the LSM engine flushes its memtable and syncs its WAL.
    pub async fn close(&self) -> Result<(), StoreError> {
        match self {
            ShardStore::Memory(_) => Ok(()),
            ShardStore::Lsm(s) => s.close().await,
            ShardStore::Replicated(s) => s.close().await,
        }
    }
}

impl ShardStore {
    /// Where reads go: the LSM engine behind either log, or the memory store.
    fn engine(&self) -> Result<&Engine, &MemStore> {
        match self {
            ShardStore::Memory(s) => Err(s),
            ShardStore::Lsm(s) => Ok(s.path().engine()),
            ShardStore::Replicated(s) => Ok(s.path().engine()),
        }
    }
}

/// Commits go to the engine's own path (both logged engines take `CommitPath`); reads to
/// the engine or the memory store.
impl Store for ShardStore {
    async fn commit(&self, command: &Command, sync: Sync) -> Result<u64, StoreError> {
        self.commit_accepting(command, sync, || {}).await
    }

    async fn commit_accepting(
        &self,
        command: &Command,
        sync: Sync,
        accepted: impl FnOnce(),
    ) -> Result<u64, StoreError> {
        match self {
            ShardStore::Memory(s) => s.commit_accepting(command, sync, accepted).await,
            ShardStore::Lsm(s) => s.commit_accepting(command, sync, accepted).await,
            ShardStore::Replicated(s) => s.commit_accepting(command, sync, accepted).await,
        }
    }

    fn event_id_high_water(&self) -> u64 {
        match self.engine() {
            Ok(engine) => engine.event_id_high_water(),
            Err(memory) => memory.event_id_high_water(),
        }
    }

    async fn scan(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        match self.engine() {
            Ok(engine) => engine.scan(start, end, limit).await,
            Err(memory) => memory.scan(start, end, limit).await,
        }
    }

    async fn first_key(&self, start: &[u8], end: Option<&[u8]>) -> Result<Option<Key>, StoreError> {
        match self.engine() {
            Ok(engine) => engine.first_key(start, end).await,
            Err(memory) => memory.first_key(start, end).await,
        }
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        match self.engine() {
            Ok(engine) => engine.get(key).await,
            Err(memory) => memory.get(key).await,
        }
    }
}
