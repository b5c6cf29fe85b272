//! A shard's Raft snapshot as a stream (pure codecs and the receiver's bookkeeping).
//!
//! **What a snapshot holds.** The shard's state machine as commands: every live message as
//! `Store` commands (and the event-id high-water mark in them), its idempotent-publish entries
//! in `StoreSequenced` commands, each group policy as the `GroupPolicy` command the log applied,
//! and its copy records (deliveries so far, group ACKs: `crate::log::copies`) in `Copies`
//! commands. The leader writes them once into a file (the *snapshot file*: a sequence of
//! `len u32 LE | command[len]` records, each command checksummed itself), built by scanning its
//! engine page by page while it keeps applying, so the pages may show effects of entries after
//! the snapshot's index; that is sound because every command is idempotent per key (a key is
//! stored once, with one value, and a delete is final), and the follower replays the entries
//! after the index anyway. The file serves every follower that needs it, and every retry, as
//! long as the leader's log still holds the entries after its index.
//!
//! **How it travels.** Raft's own `MsgSnapshot` carries only an *offer* (a [`Descriptor`]: the
//! file's size, command count, chunk size and xxh3 hash). The follower does not step the offer
//! into its raft core; it pulls the file in fixed-size chunks ([`ChunkRequest`], at most
//! [`WINDOW_CHUNKS`] outstanding), each chunk checksummed (CRC32C), writes them in order into a
//! staging file, and steps the offer only when the whole file is on its disk and its hash
//! matches. Both directions of the pull ride in `MsgSnapshot` messages too (so they share the
//! node pair's connection and its batching), told apart by the first byte of the snapshot data:
//!
//! ```text
//! offer   = 2 | leader u64 | index u64 | term u64 | bytes u64 | commands u64 | chunk_bytes u32 | hash u64
//! chunk   = 3 | id | number u64 | crc32c u32 | bytes          (id = leader | index | term | hash)
//! request = 4 | id | first u64 | count u32
//! ```
//!
//! A lost chunk or request is noticed by the receiver ([`Fetch::due`]: no progress within
//! [`RESEND_AFTER_MS`]) and asked for again from the first chunk it lacks: the pull resumes, it
//! never starts over. Memory on either side is bounded by [`WINDOW_CHUNKS`] chunks per transfer.
//!
//! **An install a crash interrupted** ([`resume_log`]): what the raft log becomes at the next
//! start, as a pure function shared by the driver and the simulation (`tests/cluster_sim.rs`).

use raft::eraftpb::ConfState;

use crate::cluster::raft_log::RaftLog;
use crate::cluster::record::RaftRecord;
use crate::log::Command;

/// Chunks a receiver asks for before the first of them arrives.
pub const WINDOW_CHUNKS: u64 = 4;
/// A receiver that got no chunk for this long asks again from its first missing chunk.
pub const RESEND_AFTER_MS: u64 = 1_000;
/// A receiver that got no chunk for this long gives the transfer up (the leader offers again).
pub const GIVE_UP_AFTER_MS: u64 = 30_000;

const KIND_OFFER: u8 = 2;
const KIND_CHUNK: u8 = 3;
const KIND_REQUEST: u8 = 4;
const ID_BYTES: usize = 32;
const OFFER_BYTES: usize = 1 + 8 * 5 + 4 + 8;

/// Why snapshot bytes are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot message truncated ({len} bytes)")]
    Truncated { len: usize },
    #[error("snapshot message kind {0} is not known to this build")]
    UnknownKind(u8),
    #[error("snapshot chunk {number} fails its checksum")]
    Checksum { number: u64 },
    #[error("snapshot offer malformed: {0}")]
    Malformed(&'static str),
    #[error("snapshot file damaged: {0}")]
    Damaged(String),
}

/// Which snapshot: the leader that built it, the index and term it covers, and its hash (two
/// leaders' files of one index differ in bytes, so chunks of one are never mixed into another).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SnapshotId {
    pub leader: u64,
    pub index: u64,
    pub term: u64,
    pub hash: u64,
}

/// What the raft core's `MsgSnapshot` carries: enough to fetch and check the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub leader: u64,
    pub index: u64,
    pub term: u64,
    /// Length of the snapshot file.
    pub bytes: u64,
    /// Commands in it.
    pub commands: u64,
    /// Every chunk but the last is this long.
    pub chunk_bytes: u32,
    /// xxh3-64 of the whole file.
    pub hash: u64,
}

impl Descriptor {
    pub fn id(&self) -> SnapshotId {
        SnapshotId {
            leader: self.leader,
            index: self.index,
            term: self.term,
            hash: self.hash,
        }
    }

    pub fn chunks(&self) -> u64 {
        self.bytes.div_ceil(u64::from(self.chunk_bytes.max(1)))
    }

    /// The byte range of chunk `number` in the file.
    pub fn chunk_range(&self, number: u64) -> (u64, usize) {
        let at = number * u64::from(self.chunk_bytes);
        let len = self
            .bytes
            .saturating_sub(at)
            .min(u64::from(self.chunk_bytes));
        (at, len as usize)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(OFFER_BYTES);
        out.push(KIND_OFFER);
        for v in [
            self.leader,
            self.index,
            self.term,
            self.bytes,
            self.commands,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.chunk_bytes.to_le_bytes());
        out.extend_from_slice(&self.hash.to_le_bytes());
        out
    }
}

/// The point an install marker names: the snapshot's index, term and membership.
#[derive(Debug, Clone, PartialEq)]
pub struct InstallPoint {
    pub index: u64,
    pub term: u64,
    pub conf: ConfState,
}

/// At open, with an unfinished install: the raft log starts at the snapshot, as the install's
/// checkpoint would have made it (the engine's state is the snapshot's once it has adopted the
/// staged tables, if the stop came before that switch). Returns the checkpoint record to write,
/// if the log did not reach it before the stop; the caller makes it durable before it removes
/// the marker.
pub fn resume_log(log: &mut RaftLog, point: &InstallPoint) -> Result<Option<RaftRecord>, String> {
    if log.base().0 >= point.index {
        return Ok(None);
    }
    let mut hard_state = log.hard_state().clone();
    if hard_state.term < point.term {
        hard_state.term = point.term;
        hard_state.vote = 0;
    }
    hard_state.commit = hard_state.commit.max(point.index);
    let record = RaftRecord::Checkpoint {
        index: point.index,
        term: point.term,
        hard_state,
        conf: Some(point.conf.clone()),
    };
    log.apply_record(&record)?;
    Ok(Some(record))
}

/// A receiver's ask for chunks `first .. first + count` of a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRequest {
    pub id: SnapshotId,
    pub first: u64,
    pub count: u32,
}

impl ChunkRequest {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + ID_BYTES + 12);
        out.push(KIND_REQUEST);
        put_id(&mut out, &self.id);
        out.extend_from_slice(&self.first.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out
    }
}

/// One chunk of a snapshot file, as received (its checksum already verified).
#[derive(Debug, PartialEq, Eq)]
pub struct Chunk<'a> {
    pub id: SnapshotId,
    pub number: u64,
    pub bytes: &'a [u8],
}

/// Encodes chunk `number` of snapshot `id`.
pub fn encode_chunk(id: &SnapshotId, number: u64, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + ID_BYTES + 12 + bytes.len());
    out.push(KIND_CHUNK);
    put_id(&mut out, id);
    out.extend_from_slice(&number.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(bytes).to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// The three kinds of snapshot traffic.
#[derive(Debug, PartialEq, Eq)]
pub enum Traffic<'a> {
    Offer(Descriptor),
    Chunk(Chunk<'a>),
    Request(ChunkRequest),
}

/// Reads a `MsgSnapshot`'s data.
pub fn classify(data: &[u8]) -> Result<Traffic<'_>, SnapshotError> {
    let truncated = || SnapshotError::Truncated { len: data.len() };
    let (&kind, rest) = data.split_first().ok_or_else(truncated)?;
    let mut r = Reader { rest };
    match kind {
        KIND_OFFER => {
            if data.len() != OFFER_BYTES {
                return Err(truncated());
            }
            let d = Descriptor {
                leader: r.u64().ok_or_else(truncated)?,
                index: r.u64().ok_or_else(truncated)?,
                term: r.u64().ok_or_else(truncated)?,
                bytes: r.u64().ok_or_else(truncated)?,
                commands: r.u64().ok_or_else(truncated)?,
                chunk_bytes: r.u32().ok_or_else(truncated)?,
                hash: r.u64().ok_or_else(truncated)?,
            };
            if d.chunk_bytes == 0 {
                return Err(SnapshotError::Malformed("chunk size 0"));
            }
            Ok(Traffic::Offer(d))
        }
        KIND_CHUNK => {
            let id = r.id().ok_or_else(truncated)?;
            let number = r.u64().ok_or_else(truncated)?;
            let crc = r.u32().ok_or_else(truncated)?;
            if crc32c::crc32c(r.rest) != crc {
                return Err(SnapshotError::Checksum { number });
            }
            Ok(Traffic::Chunk(Chunk {
                id,
                number,
                bytes: r.rest,
            }))
        }
        KIND_REQUEST => {
            let request = ChunkRequest {
                id: r.id().ok_or_else(truncated)?,
                first: r.u64().ok_or_else(truncated)?,
                count: r.u32().ok_or_else(truncated)?,
            };
            if !r.rest.is_empty() {
                return Err(truncated());
            }
            Ok(Traffic::Request(request))
        }
        other => Err(SnapshotError::UnknownKind(other)),
    }
}

fn put_id(out: &mut Vec<u8>, id: &SnapshotId) {
    for v in [id.leader, id.index, id.term, id.hash] {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.rest.split_first_chunk::<N>()?;
        self.rest = rest;
        Some(*head)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn id(&mut self) -> Option<SnapshotId> {
        Some(SnapshotId {
            leader: self.u64()?,
            index: self.u64()?,
            term: self.u64()?,
            hash: self.u64()?,
        })
    }
}

/// Appends one command to a snapshot file's bytes.
pub fn push_command(out: &mut Vec<u8>, command: &Command) {
    out.extend_from_slice(&(command.encoded_len() as u32).to_le_bytes());
    command.encode(out);
}

/// Parses a snapshot file fed to it in pieces of any size, holding at most one command (and
/// refusing one longer than `max_command_bytes` before buffering it).
pub struct CommandReader {
    pending: Vec<u8>,
    max_command_bytes: usize,
    commands: u64,
}

impl CommandReader {
    pub fn new(max_command_bytes: usize) -> CommandReader {
        CommandReader {
            pending: Vec::new(),
            max_command_bytes,
            commands: 0,
        }
    }

    /// Feeds the next bytes of the file; returns the commands they complete.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<Vec<Command>, SnapshotError> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let want = match self.pending.len() {
                n if n < 4 => 4 - n,
                _ => 4 + self.command_len()? - self.pending.len(),
            };
            let take = want.min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() > 4 && self.pending.len() == 4 + self.command_len()? {
                let command = Command::decode(&self.pending[4..])
                    .map_err(|e| SnapshotError::Damaged(format!("command: {e}")))?;
                out.push(command);
                self.commands += 1;
                self.pending.clear();
            }
        }
        Ok(out)
    }

    fn command_len(&self) -> Result<usize, SnapshotError> {
        let len = u32::from_le_bytes([
            self.pending[0],
            self.pending[1],
            self.pending[2],
            self.pending[3],
        ]) as usize;
        if len == 0 || len > self.max_command_bytes {
            return Err(SnapshotError::Damaged(format!(
                "a command of {len} bytes (at most {} expected)",
                self.max_command_bytes
            )));
        }
        Ok(len)
    }

    /// The file ended: it must end between commands and hold as many as announced.
    pub fn finish(&self, announced: u64) -> Result<(), SnapshotError> {
        if !self.pending.is_empty() {
            return Err(SnapshotError::Damaged("truncated in a command".into()));
        }
        if self.commands != announced {
            return Err(SnapshotError::Damaged(format!(
                "{} commands where the offer announces {announced}",
                self.commands
            )));
        }
        Ok(())
    }
}

/// A receiver's pull of one snapshot: which chunks it asked for and has, when to ask again.
/// Chunks are taken in order only (one connection keeps them in order; a gap means a loss, and
/// the chunks after it are asked for again), so what it has is always a prefix of the file.
#[derive(Debug, Clone)]
pub struct Fetch {
    pub descriptor: Descriptor,
    /// Chunks `0 .. next` are written.
    next: u64,
    /// Chunks `next .. asked` were asked for.
    asked: u64,
    /// When the last chunk (or the start) came.
    progress_ms: u64,
}

/// A pull that made no progress for [`GIVE_UP_AFTER_MS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no snapshot chunk came for {quiet_ms} ms")]
pub struct GivenUp {
    pub quiet_ms: u64,
}

/// What a receiver does with an arriving chunk.
#[derive(Debug, PartialEq, Eq)]
pub enum Taken {
    /// Write it: it is the next one.
    Write,
    /// Not the one awaited (another snapshot, a duplicate, or after a gap): drop it.
    Drop,
}

impl Fetch {
    pub fn new(descriptor: Descriptor, now_ms: u64) -> Fetch {
        Fetch {
            descriptor,
            next: 0,
            asked: 0,
            progress_ms: now_ms,
        }
    }

    /// The next request to send, if the window has room.
    pub fn request(&mut self) -> Option<ChunkRequest> {
        let end = (self.next + WINDOW_CHUNKS).min(self.descriptor.chunks());
        if self.asked >= end {
            return None;
        }
        let request = ChunkRequest {
            id: self.descriptor.id(),
            first: self.asked,
            count: (end - self.asked) as u32,
        };
        self.asked = end;
        Some(request)
    }

    /// Decides about an arriving chunk.
    pub fn take(&mut self, chunk: &Chunk<'_>, now_ms: u64) -> Taken {
        let (_, len) = self.descriptor.chunk_range(chunk.number);
        if chunk.id != self.descriptor.id() || chunk.number != self.next || chunk.bytes.len() != len
        {
            return Taken::Drop;
        }
        self.next += 1;
        self.asked = self.asked.max(self.next);
        self.progress_ms = now_ms;
        Taken::Write
    }

    /// No chunk came for a while: ask again from the first missing one. `Err` when the
    /// transfer is given up.
    pub fn due(&mut self, now_ms: u64) -> Result<(), GivenUp> {
        let quiet = now_ms.saturating_sub(self.progress_ms);
        if quiet >= GIVE_UP_AFTER_MS {
            return Err(GivenUp { quiet_ms: quiet });
        }
        if quiet >= RESEND_AFTER_MS && self.asked > self.next {
            self.asked = self.next;
            self.progress_ms = now_ms;
        }
        Ok(())
    }

    pub fn complete(&self) -> bool {
        self.next == self.descriptor.chunks()
    }

    /// Chunks written so far.
    pub fn written(&self) -> u64 {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{EventKey, TopicHash};
    use crate::message::Value;

    fn store(i: u64) -> Command {
        Command::Store {
            messages: vec![(
                EventKey::new(TopicHash(3), i, i),
                Value::copy_from_slice(&[i as u8; 30]),
            )],
            event_id_high_water: i,
        }
    }

    fn descriptor(bytes: u64) -> Descriptor {
        Descriptor {
            leader: 1,
            index: 40,
            term: 3,
            bytes,
            commands: 9,
            chunk_bytes: 100,
            hash: 0xfeed,
        }
    }

    fn point(index: u64, term: u64) -> InstallPoint {
        InstallPoint {
            index,
            term,
            conf: ConfState {
                voters: vec![1, 2, 3],
                ..ConfState::default()
            },
        }
    }

    fn hard_state(term: u64, vote: u64, commit: u64) -> raft::eraftpb::HardState {
        raft::eraftpb::HardState {
            term,
            vote,
            commit,
            ..Default::default()
        }
    }

    #[test]
    fn an_interrupted_install_resumes_a_log_behind_at_the_snapshot() {
        let mut log = RaftLog::new(vec![1, 2, 3]);
        log.apply_record(&RaftRecord::HardState(hard_state(2, 1, 0)))
            .unwrap();
        let record = resume_log(&mut log, &point(40, 3)).unwrap();
        let Some(RaftRecord::Checkpoint {
            index,
            term,
            hard_state: hs,
            conf,
        }) = record
        else {
            panic!("no checkpoint: {record:?}");
        };
        assert_eq!((index, term), (40, 3));
        // A newer term than the log knew: no vote cast in it.
        assert_eq!((hs.term, hs.vote, hs.commit), (3, 0, 40));
        assert_eq!(conf, Some(point(40, 3).conf));
        assert_eq!(log.base(), (40, 3));
        assert_eq!(log.hard_state().commit, 40);
        assert_eq!(log.conf_state(), &point(40, 3).conf);
    }

    #[test]
    fn an_interrupted_install_keeps_a_newer_term_and_its_vote() {
        let mut log = RaftLog::new(vec![1, 2, 3]);
        log.apply_record(&RaftRecord::HardState(hard_state(5, 2, 0)))
            .unwrap();
        let Some(RaftRecord::Checkpoint { hard_state: hs, .. }) =
            resume_log(&mut log, &point(40, 3)).unwrap()
        else {
            panic!("no checkpoint");
        };
        assert_eq!((hs.term, hs.vote, hs.commit), (5, 2, 40));
    }

    #[test]
    fn an_interrupted_install_whose_checkpoint_is_durable_writes_nothing() {
        let mut log = RaftLog::new(vec![1, 2, 3]);
        let first = resume_log(&mut log, &point(40, 3)).unwrap();
        assert!(first.is_some());
        let before = (log.base(), log.hard_state().clone());
        assert_eq!(resume_log(&mut log, &point(40, 3)), Ok(None));
        assert_eq!((log.base(), log.hard_state().clone()), before);
    }

    #[test]
    fn offers_requests_and_chunks_round_trip() {
        let d = descriptor(1234);
        assert_eq!(classify(&d.encode()), Ok(Traffic::Offer(d)));
        let r = ChunkRequest {
            id: d.id(),
            first: 7,
            count: 4,
        };
        assert_eq!(classify(&r.encode()), Ok(Traffic::Request(r)));
        let bytes = [5u8; 77];
        let c = encode_chunk(&d.id(), 12, &bytes);
        assert_eq!(
            classify(&c),
            Ok(Traffic::Chunk(Chunk {
                id: d.id(),
                number: 12,
                bytes: &bytes
            }))
        );
        let mut bad = c.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(classify(&bad), Err(SnapshotError::Checksum { number: 12 }));
        for cut in 0..d.encode().len() {
            assert!(classify(&d.encode()[..cut]).is_err());
        }
        assert_eq!(classify(&[1, 0, 0]), Err(SnapshotError::UnknownKind(1)));
    }

    #[test]
    fn the_command_reader_takes_any_split_and_refuses_damage() {
        let mut file = Vec::new();
        for i in 0..5 {
            push_command(&mut file, &store(i));
        }
        for piece in [1, 3, 7, 64, file.len()] {
            let mut reader = CommandReader::new(1 << 20);
            let mut got = Vec::new();
            for part in file.chunks(piece) {
                got.extend(reader.feed(part).unwrap());
            }
            reader.finish(5).unwrap();
            assert_eq!(got, (0..5).map(store).collect::<Vec<_>>());
        }
        let mut reader = CommandReader::new(1 << 20);
        reader.feed(&file[..file.len() - 2]).unwrap();
        assert!(reader.finish(5).is_err(), "a truncated file is refused");
        let mut reader = CommandReader::new(1 << 20);
        reader.feed(&file).unwrap();
        assert!(
            reader.finish(6).is_err(),
            "a count that disagrees is refused"
        );
        let mut bad = file.clone();
        bad[10] ^= 1;
        assert!(CommandReader::new(1 << 20).feed(&bad).is_err());
        assert!(
            CommandReader::new(8).feed(&file).is_err(),
            "the length bound holds"
        );
    }

    #[test]
    fn a_fetch_keeps_its_window_takes_chunks_in_order_and_resumes_after_a_loss() {
        let d = descriptor(950); // 10 chunks, the last one 50 bytes
        let mut f = Fetch::new(d, 0);
        let r = f.request().unwrap();
        assert_eq!((r.first, r.count), (0, WINDOW_CHUNKS as u32));
        assert_eq!(f.request(), None, "the window is full");
        let body = [0u8; 100];
        let chunk = |number| Chunk {
            id: d.id(),
            number,
            bytes: &body,
        };
        assert_eq!(f.take(&chunk(0), 10), Taken::Write);
        assert_eq!(f.request().map(|r| (r.first, r.count)), Some((4, 1)));
        // Chunk 1 is lost: 2 arrives and is dropped; after a quiet second 1 is asked again.
        assert_eq!(f.take(&chunk(2), 20), Taken::Drop);
        assert_eq!(f.take(&chunk(0), 20), Taken::Drop, "a duplicate");
        f.due(500).unwrap();
        assert_eq!(f.request(), None);
        f.due(10 + RESEND_AFTER_MS).unwrap();
        assert_eq!(f.request().map(|r| (r.first, r.count)), Some((1, 4)));
        let other = Chunk {
            id: SnapshotId { hash: 1, ..d.id() },
            number: 1,
            bytes: &body,
        };
        assert_eq!(
            f.take(&other, 1100),
            Taken::Drop,
            "another snapshot's chunk"
        );
        for n in 1..9 {
            assert_eq!(f.take(&chunk(n), 1100), Taken::Write);
            f.request();
        }
        assert_eq!(
            f.take(&chunk(9), 1100),
            Taken::Drop,
            "the last chunk is short"
        );
        let last = [0u8; 50];
        let tail = Chunk {
            id: d.id(),
            number: 9,
            bytes: &last,
        };
        assert_eq!(f.take(&tail, 1100), Taken::Write);
        assert!(f.complete());
        assert_eq!(f.request(), None);
        assert!(Fetch::new(d, 0).due(GIVE_UP_AFTER_MS).is_err());
    }
}
