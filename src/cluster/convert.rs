//! `pinq cluster convert`: turns a standalone broker's data directory into the data directory
//! of a cluster's first member, offline (the broker stopped), shard by shard.
//!
//! A standalone shard directory holds tables whose manifest reaches a standalone log index and
//! a WAL of encoded [`Command`]s; a clustered one holds tables whose manifest reaches a Raft
//! index and a WAL of [`RaftRecord`]s. Conversion makes the standalone index a Raft index: the
//! shard's whole log goes into its tables (open, flush, close: the one recovery and flush
//! there are), and the WAL is replaced by a Raft log that starts with a checkpoint at that
//! index (term [`CHECKPOINT_TERM`], committed), so Raft starts after it and every member that
//! starts from a copy of the directory holds the same state at the same point.
//!
//! Crash safety: each step leaves a directory one of the two modes opens, and a second run
//! finishes the job ([`Step`] names them):
//!
//! ```text
//!  standalone ─flush─▶ standalone, log covered ─stage─▶ + convert-staging/ (ignored by both)
//!    ─remove old log, fsync dir─▶ standalone, no log ─rename staged segment, fsync dir─▶ clustered
//! ```
//!
//! The rename is the switch. Before it, a standalone start opens the directory as it was (the
//! tables hold everything; an empty log continues after their index) and a clustered start
//! refuses it ([`StoreError::NotClustered`]); after it, the directory is a cluster member's.
//!
//! [`classify`] and [`checkpoint_at`] are pure; the rest is the glommio shell, run by the CLI
//! on a one-off executor. It never runs inside a broker: it takes the data directory's lock.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use raft::eraftpb::HardState;

use super::record::RaftRecord;
use crate::log::wal::{segment_name, RECORD_HEADER_BYTES};
use crate::log::{recovery, Command, Wal};
use crate::storage::io as dio;
use crate::storage::{manifest, LsmOptions, LsmStore, StoreError};

/// The term of the checkpoint a converted log starts with (the first election makes term 2).
pub const CHECKPOINT_TERM: u64 = 1;
/// Where the new Raft log is written before the switch; neither mode reads it.
pub const STAGING_DIR: &str = "convert-staging";
/// Environment variable of the fault hook: stop after this step (tests; never in production).
pub const FAULT_STOP_AFTER_ENV: &str = "PINQ_FAULT_CONVERT_STOP_AFTER";

/// What a shard directory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardKind {
    /// Nothing written yet: it opens in either mode as it is.
    Empty,
    Standalone,
    Clustered,
}

/// What the records of a shard's WAL decode as.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RecordKinds {
    pub commands: u64,
    pub raft_records: u64,
}

impl RecordKinds {
    /// Counts one record. A command carries its own checksum, so it is tried first: a Raft
    /// record is never taken for one.
    pub fn count(&mut self, payload: &[u8]) -> Result<(), String> {
        if Command::decode(payload).is_ok() {
            self.commands += 1;
            return Ok(());
        }
        match RaftRecord::decode(payload) {
            Ok(_) => {
                self.raft_records += 1;
                Ok(())
            }
            Err(e) => Err(format!(
                "neither a standalone command nor a raft record: {e}"
            )),
        }
    }
}

/// What a shard directory is, from what its log holds and how far its tables reach. Tables
/// without any record are standalone: a replica always keeps its last record. Pure.
pub fn classify(kinds: RecordKinds, applied_index: u64) -> Result<ShardKind, &'static str> {
    match (kinds.commands > 0, kinds.raft_records > 0) {
        (true, true) => Err("its log holds both standalone commands and raft records"),
        (false, true) => Ok(ShardKind::Clustered),
        (true, false) => Ok(ShardKind::Standalone),
        (false, false) if applied_index > 0 => Ok(ShardKind::Standalone),
        (false, false) => Ok(ShardKind::Empty),
    }
}

/// The one record of a converted log: the log starts after `index`, committed through it.
/// Pure.
pub fn checkpoint_at(index: u64) -> RaftRecord {
    RaftRecord::Checkpoint {
        index,
        term: CHECKPOINT_TERM,
        hard_state: HardState {
            term: CHECKPOINT_TERM,
            vote: 0,
            commit: index,
            ..HardState::default()
        },
        // The members are those the first start is given (`cluster.peers`).
        conf: None,
    }
}

/// The steps of one shard's conversion, in order (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The standalone log is in the tables.
    Flushed,
    /// The new Raft log is written and synced in the staging directory.
    Staged,
    /// The standalone log's segments are gone (and the directory synced).
    OldLogRemoved,
    /// The staged segment is in place (and the directory synced): the shard is clustered.
    Switched,
}

impl Step {
    pub const ALL: [Step; 4] = [
        Step::Flushed,
        Step::Staged,
        Step::OldLogRemoved,
        Step::Switched,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Step::Flushed => "flushed",
            Step::Staged => "staged",
            Step::OldLogRemoved => "old-log-removed",
            Step::Switched => "switched",
        }
    }

    pub fn parse(name: &str) -> Option<Step> {
        Step::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// What became of one shard directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Its Raft log now starts after `index`.
    Converted { index: u64 },
    /// It already held a Raft log (an earlier run converted it).
    AlreadyClustered,
    /// Nothing was ever written to it.
    Empty,
}

/// Why a conversion was refused or stopped. Nothing past the last finished step was changed.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{dir}: no such data directory")]
    NoDataDir { dir: String },
    #[error("{dir} holds no shard directory (shard-0, shard-1, …): not a pinq data directory")]
    NoShards { dir: String },
    #[error("cannot convert {dir} while it is in use (stop the broker first): {detail}")]
    InUse { dir: String, detail: String },
    #[error("{dir} is already a cluster member's data directory (every shard holds a raft log): nothing to convert")]
    AlreadyClustered { dir: String },
    #[error("{dir} is neither a standalone nor a clustered shard directory: {reason}")]
    Unrecognised { dir: String, reason: String },
    #[error("{dir}: after the flush, {records} log record(s) past index {applied_index} are still outside the tables; nothing was switched")]
    NotCovered {
        dir: String,
        applied_index: u64,
        records: u64,
    },
    #[error("converting {dir}: {source}")]
    Store {
        dir: String,
        #[source]
        source: StoreError,
    },
    #[error("{dir}: stopped after step {step} ({FAULT_STOP_AFTER_ENV})")]
    StoppedByFault { dir: String, step: &'static str },
}

fn store_error(dir: &Path) -> impl Fn(StoreError) -> ConvertError + '_ {
    move |source| ConvertError::Store {
        dir: dir.display().to_string(),
        source,
    }
}

/// The shard directories of `data_dir` (`shard-<i>`), by shard number.
pub fn shard_dirs(data_dir: &Path) -> Result<Vec<PathBuf>, ConvertError> {
    let listing =
        std::fs::read_dir(data_dir).map_err(|e| store_error(data_dir)(dio_error(data_dir, e)))?;
    let mut shards = Vec::new();
    for entry in listing {
        let entry = entry.map_err(|e| store_error(data_dir)(dio_error(data_dir, e)))?;
        let name = entry.file_name();
        let number = name
            .to_str()
            .and_then(|n| n.strip_prefix("shard-"))
            .and_then(|n| n.parse::<usize>().ok());
        if let (Some(number), true) = (number, entry.path().is_dir()) {
            shards.push((number, entry.path()));
        }
    }
    shards.sort();
    Ok(shards.into_iter().map(|(_, path)| path).collect())
}

fn dio_error(path: &Path, e: std::io::Error) -> StoreError {
    crate::storage::io_error(path, e)
}

/// Converts every shard of `data_dir` (see the module docs); `stop_after` is the fault hook.
/// Holds the data directory's lock throughout, so no broker starts on it meanwhile.
pub async fn convert_data_dir(
    data_dir: &Path,
    options: &LsmOptions,
    stop_after: Option<Step>,
) -> Result<Vec<(PathBuf, Outcome)>, ConvertError> {
    let name = data_dir.display().to_string();
    if !data_dir.is_dir() {
        return Err(ConvertError::NoDataDir { dir: name });
    }
    let _lock =
        crate::server::exclusive::lock_data_dir(data_dir).map_err(|e| ConvertError::InUse {
            dir: name.clone(),
            detail: e.to_string(),
        })?;
    let shards = shard_dirs(data_dir)?;
    if shards.is_empty() {
        return Err(ConvertError::NoShards { dir: name });
    }
    let mut outcomes = Vec::with_capacity(shards.len());
    for dir in shards {
        let outcome = convert_shard(&dir, options, stop_after).await?;
        outcomes.push((dir, outcome));
    }
    // Nothing converted and a shard already clustered (the others empty): an earlier run did
    // the job.
    let converted = outcomes
        .iter()
        .any(|(_, o)| matches!(o, Outcome::Converted { .. }));
    let clustered = outcomes
        .iter()
        .any(|(_, o)| *o == Outcome::AlreadyClustered);
    if clustered && !converted {
        return Err(ConvertError::AlreadyClustered { dir: name });
    }
    Ok(outcomes)
}

/// What the shard directory `dir` is. Reads; changes no file. Each segment is checked on
/// its own (`recovery::scan_segment`): where the log starts depends on what it is (a
/// standalone log continues the tables' index, a Raft log numbers its records from 1), and
/// the open that follows checks the whole.
pub async fn inspect(dir: &Path) -> Result<ShardKind, ConvertError> {
    let applied_index = manifest::read_blocking(dir)
        .map_err(store_error(dir))?
        .map_or(0, |m| m.applied_index);
    let segments = log_segments(dir)?;
    let mut kinds = RecordKinds::default();
    for (i, (first_seq, path)) in segments.iter().enumerate() {
        count_segment(&mut kinds, path, *first_seq, i + 1 == segments.len())?;
        glommio::yield_if_needed().await;
    }
    classify(kinds, applied_index).map_err(|reason| unrecognised(dir, reason.to_string()))
}

fn unrecognised(path: &Path, reason: String) -> ConvertError {
    ConvertError::Unrecognised {
        dir: path.display().to_string(),
        reason,
    }
}

/// The WAL segments of `dir` (`wal-<first seq>.log`), oldest first.
fn log_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>, ConvertError> {
    let listing = std::fs::read_dir(dir).map_err(|e| store_error(dir)(dio_error(dir, e)))?;
    let mut segments = Vec::new();
    for entry in listing {
        let entry = entry.map_err(|e| store_error(dir)(dio_error(dir, e)))?;
        let name = entry.file_name();
        if let Some(first_seq) = name.to_str().and_then(crate::log::wal::parse_segment_name) {
            segments.push((first_seq, entry.path()));
        }
    }
    segments.sort();
    Ok(segments)
}

/// Counts what the intact records of one segment are.
fn count_segment(
    kinds: &mut RecordKinds,
    path: &Path,
    first_seq: u64,
    is_last: bool,
) -> Result<(), ConvertError> {
    let bytes = dio::read_blocking(path).map_err(|e| store_error(path)(dio_error(path, e)))?;
    let scan = recovery::scan_segment(&bytes, first_seq, is_last).map_err(|d| {
        unrecognised(
            path,
            format!("byte {}: {}; {}", d.offset, d.reason, d.evidence),
        )
    })?;
    for &(offset, seq) in &scan.records {
        let payload = bytes
            .get(offset..offset + RECORD_HEADER_BYTES)
            .and_then(|h| h.get(..4))
            .and_then(|len| len.try_into().ok())
            .map(|len: [u8; 4]| u32::from_le_bytes(len) as usize)
            .and_then(|len| {
                let start = offset + RECORD_HEADER_BYTES;
                bytes.get(start..start + len)
            })
            .ok_or_else(|| unrecognised(path, format!("record {seq} at byte {offset} is cut")))?;
        kinds
            .count(payload)
            .map_err(|e| unrecognised(path, format!("record {seq} at byte {offset}: {e}")))?;
    }
    Ok(())
}

/// Converts one shard directory, or says why it needs nothing.
async fn convert_shard(
    dir: &Path,
    options: &LsmOptions,
    stop_after: Option<Step>,
) -> Result<Outcome, ConvertError> {
    // A leftover of an interrupted run: neither mode reads it, and it is rebuilt below.
    remove_staging(dir)?;
    match inspect(dir).await? {
        ShardKind::Clustered => return Ok(Outcome::AlreadyClustered),
        ShardKind::Empty => return Ok(Outcome::Empty),
        ShardKind::Standalone => {}
    }
    let stop = |step: Step| match stop_after {
        Some(s) if s == step => Err(ConvertError::StoppedByFault {
            dir: dir.display().to_string(),
            step: step.name(),
        }),
        _ => Ok(()),
    };
    let index = flush_standalone(dir, options).await?;
    stop(Step::Flushed)?;
    let staged = stage_raft_log(dir, index, options).await?;
    stop(Step::Staged)?;
    remove_log_segments(dir)?;
    stop(Step::OldLogRemoved)?;
    dio::rename_blocking(&staged, &dir.join(segment_name(1))).map_err(store_error(dir))?;
    dio::sync_dir_blocking(dir).map_err(store_error(dir))?;
    stop(Step::Switched)?;
    remove_staging(dir)?;
    Ok(Outcome::Converted { index })
}

/// Opens the standalone store (its log replays into the engine), flushes everything into
/// tables and closes it; checks that the tables cover the whole log and returns their index.
async fn flush_standalone(dir: &Path, options: &LsmOptions) -> Result<u64, ConvertError> {
    let store = LsmStore::open(dir, options.clone())
        .await
        .map_err(store_error(dir))?;
    let flushed = store.flush().await;
    let closed = store.close().await;
    flushed.and(closed).map_err(store_error(dir))?;
    let applied_index = manifest::read_blocking(dir)
        .map_err(store_error(dir))?
        .map_or(0, |m| m.applied_index);
    let mut records = 0u64;
    recovery::recover(dir, applied_index, |_, _| records += 1)
        .await
        .map_err(store_error(dir))?;
    if records > 0 {
        return Err(ConvertError::NotCovered {
            dir: dir.display().to_string(),
            applied_index,
            records,
        });
    }
    Ok(applied_index)
}

/// Writes the converted Raft log (one checkpoint at `index`) into the staging directory and
/// syncs it; returns the segment's path there.
async fn stage_raft_log(
    dir: &Path,
    index: u64,
    options: &LsmOptions,
) -> Result<PathBuf, ConvertError> {
    let staging = dir.join(STAGING_DIR);
    std::fs::create_dir_all(&staging).map_err(|e| store_error(dir)(dio_error(&staging, e)))?;
    let wal = Rc::new(Wal::new(
        &staging,
        1,
        Vec::new(),
        options.wal_segment_bytes_max,
        options.wal_preallocate_bytes,
    ));
    wal.start();
    let written = match wal.append(&checkpoint_at(index)) {
        Ok(seq) => wal.wait_durable(seq).await,
        Err(e) => Err(e),
    };
    let stopped = wal.shutdown().await;
    written.and(stopped).map_err(store_error(dir))?;
    dio::sync_dir_blocking(&staging).map_err(store_error(dir))?;
    let segment = staging.join(segment_name(1));
    if !segment.is_file() {
        let missing = std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the staged raft log segment was not written",
        );
        return Err(store_error(dir)(dio_error(&segment, missing)));
    }
    Ok(segment)
}

/// Removes every WAL segment of `dir` (the tables hold what they held), then syncs it.
fn remove_log_segments(dir: &Path) -> Result<(), ConvertError> {
    for (_, path) in log_segments(dir)? {
        dio::remove_blocking(&path).map_err(store_error(dir))?;
    }
    dio::sync_dir_blocking(dir).map_err(store_error(dir))
}

fn remove_staging(dir: &Path) -> Result<(), ConvertError> {
    let staging = dir.join(STAGING_DIR);
    if !staging.exists() {
        return Ok(());
    }
    std::fs::remove_dir_all(&staging).map_err(|e| store_error(dir)(dio_error(&staging, e)))?;
    dio::sync_dir_blocking(dir).map_err(store_error(dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::wal::Payload;

    fn kinds(commands: u64, raft_records: u64) -> RecordKinds {
        RecordKinds {
            commands,
            raft_records,
        }
    }

    #[test]
    fn a_directory_is_classified_by_its_records_then_by_its_tables() {
        assert_eq!(classify(kinds(3, 0), 0), Ok(ShardKind::Standalone));
        assert_eq!(classify(kinds(0, 2), 900), Ok(ShardKind::Clustered));
        // A standalone log the tables cover whole was removed by its last close.
        assert_eq!(classify(kinds(0, 0), 900), Ok(ShardKind::Standalone));
        assert_eq!(classify(kinds(0, 0), 0), Ok(ShardKind::Empty));
        assert!(classify(kinds(1, 1), 5).is_err());
    }

    #[test]
    fn records_are_told_apart_and_garbage_is_refused() {
        let mut k = RecordKinds::default();
        let command = Command::Store {
            messages: Vec::new(),
            event_id_high_water: 7,
        };
        k.count(&command.to_bytes()).unwrap();
        let mut raft = Vec::new();
        checkpoint_at(42).encode_into(&mut raft);
        k.count(&raft).unwrap();
        assert_eq!(k, kinds(1, 1));
        assert!(k.count(b"\x09\x09garbage").is_err());
    }

    #[test]
    fn the_converted_log_starts_committed_after_the_tables_index() {
        let mut log = super::super::raft_log::RaftLog::new(vec![1, 2, 3]);
        log.apply_record(&checkpoint_at(5000)).unwrap();
        assert_eq!(log.base(), (5000, CHECKPOINT_TERM));
        assert_eq!(log.first_index(), 5001);
        assert_eq!(log.hard_state().commit, 5000);
        assert_eq!(log.hard_state().term, CHECKPOINT_TERM);
    }

    #[test]
    fn a_replica_over_a_converted_log_starts_at_its_checkpoint() {
        use super::super::replica::{quiet_logger, Replica, ReplicaConfig};
        let mut log = super::super::raft_log::RaftLog::new(vec![1, 2, 3]);
        log.apply_record(&checkpoint_at(5000)).unwrap();
        let config = ReplicaConfig {
            id: 2,
            voters: vec![1, 2, 3],
            election_ticks: 10,
            heartbeat_ticks: 1,
            max_message_bytes: 1 << 20,
            max_inflight_messages: 16,
            lease_ms: 250,
        };
        let replica = Replica::new(&config, log, 5000, &quiet_logger()).unwrap();
        let status = replica.status();
        assert_eq!((status.commit, status.applied), (5000, 5000));
        assert_eq!((status.first_index, status.last_index), (5001, 5000));
    }

    #[test]
    fn every_step_name_parses_back() {
        for step in Step::ALL {
            assert_eq!(Step::parse(step.name()), Some(step));
        }
        assert_eq!(Step::parse("nope"), None);
    }
}
