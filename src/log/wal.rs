//! The write-ahead log: record codec (pure) and the group-commit writer (glommio shell).
//!
//! The standalone [`super::Log`]: owns the segment files `wal-<first seq>.log` of one shard.
//! Every [`Command`] becomes one record whose sequence number is its log index, so a command is
//! recovered whole or not at all:
//!
//! ```text
//! record = len u32 LE | crc32c u32 LE | seq u64 LE | payload[len]
//! crc    = crc32c(len bytes ‖ seq bytes ‖ payload)
//! payload = the command's own encoding (see `super::command`, checksummed again)
//! ```
//!
//! Sequence numbers are consecutive across segments: recovery applies a record only if it is
//! exactly the next one, so nothing after a lost or torn record is ever applied. Each group-commit
//! write is zero-padded to [`WRITE_ALIGN`] and never rewritten, so a torn write can only damage
//! records that were never acknowledged; a zero header means "padding, skip to the next aligned
//! block".
//!
//! Segment layout: a header block ([`super::header`], [`SEGMENT_HEADER_BYTES`]) recording how
//! far the file was zero-filled, then the records. Segments of the older format (no header,
//! records from byte 0) are still read.
//!
//! Preallocation: the writer zero-fills a segment ahead of its write position in doubling steps
//! (256 KiB up to `wal_preallocate_bytes`, never past `segment_bytes_max`) and fdatasyncs that
//! (with the directory for a new file) before records land there, so a commit's fdatasync
//! overwrites blocks instead of growing the file through the filesystem journal (≈ 0.16 ms
//! against ≈ 4 ms here). Then it rewrites the header with the new zero-filled size, in the same
//! fdatasync as the records that follow. So the file on disk is never shorter than any write
//! made to it, and its header says how long it must be: recovery tells a file cut short from a
//! torn write by that (`super::recovery`). The zeros read as padding: a segment whose records
//! end in a zero-filled tail scans as [`ScanEnd::Clean`], so recovery neither warns nor cuts it.
//!
//! Disk use: a segment's records (padded writes) never take it past `segment_bytes_max` (the
//! record that would starts the next segment), and the zero-fill stops there too, so a segment
//! takes at most `segment_bytes_max` on disk (one record larger than that gets a segment of its
//! own). [`Wal::live_bytes`] counts the zero-filled size, which is what the WAL cap bounds.
//!
//! Group commit, pipelined: [`Wal::append`] encodes a record into the pending buffer at once
//! (no I/O) and wakes the writer task. The writer commits in rounds: a round writes every record
//! pending when it starts, then issues one fdatasync, after that write completed, in a task of
//! its own; the next round's write may start while that fdatasync is still in flight, up to
//! [`ROUNDS_IN_FLIGHT_MAX`] rounds at once, and records that arrive meanwhile pile up for the
//! next round. Without it a durable record that arrives just after a round started waits for
//! that round's fdatasync and then for its own write and fdatasync; with it, its write goes out
//! at once. A `Durable` write waits in [`Wal::wait_durable`] until its round's fdatasync *and*
//! those of every round before it have completed (`rounds`, a pure core): durability is reported
//! in sequence order, never for N before everything up to N, and nothing behind a failed
//! fdatasync is ever reported durable. The writer never reorders records and fsyncs a segment
//! before it writes the next one (after the rounds in flight on it have completed).
//!
//! Called by the engine (append, roll, release) and by recovery (decode, replay). The codec never
//! does I/O; the writer never decodes. After an I/O error the WAL is failed for good: every later
//! append and wait returns the error, because the memtable may already hold what the disk lost.
//!
//! The one exception, once [`Wal::retry_when_full`] is set (the standalone store): a write that
//! fails for lack of space (ENOSPC). The writer keeps the records it could not write, rewinds
//! to the write position it had (writes are aligned and padded, so the retry rewrites the same
//! offset and nothing after it was ever acknowledged), answers the durable waiters of those
//! records with `StoreError::DiskFull` (they may still be stored by the retry: at-least-once),
//! refuses new appends with the same error, and retries with backoff until a write succeeds:
//! then [`Wal::disk_full`] is `None` again and appends resume.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use glommio::io::DmaFile;

use self::rounds::{Covered, RoundId, Rounds};
use super::command::Command;
use super::header::{
    encode_segment_header, read_segment_header, SegmentHeader, SEGMENT_HEADER_BYTES,
};
use crate::ops::ratelimit::{monotonic_ms, LogLimit, LOG_INTERVAL_MS};
use crate::storage::io::{self as dio, WRITE_ALIGN};
use crate::storage::signal::Signal;
use crate::storage::StoreError;
use crate::storage::{io_error, Failure};

mod rounds;

/// Bytes of a record header: `len u32 | crc u32 | seq u64`.
pub const RECORD_HEADER_BYTES: usize = 16;
/// Largest record payload accepted (one command).
pub const RECORD_PAYLOAD_MAX: usize = 1 << 30;

/// Why bytes are not a valid record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("record truncated: needs {need} bytes, {have} present")]
    Truncated { need: usize, have: usize },
    #[error("record length {len} is out of range")]
    BadLength { len: u32 },
    #[error("record checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
    #[error("padding holds non-zero bytes at offset {offset}")]
    DirtyPadding { offset: usize },
}

/// Why a command cannot be framed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("command of {len} bytes exceeds the record limit of {RECORD_PAYLOAD_MAX}")]
    CommandTooLarge { len: usize },
}

/// What a record carries: anything with a self-contained encoding. The standalone log carries
/// [`Command`]s; the replicated log carries Raft records (`crate::cluster::record`) that wrap
/// them.
pub trait Payload {
    fn encoded_len(&self) -> usize;
    /// Appends the encoding (exactly `encoded_len` bytes) to `out`.
    fn encode_into(&self, out: &mut Vec<u8>);
}

impl Payload for Command {
    fn encoded_len(&self) -> usize {
        Command::encoded_len(self)
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        self.encode(out);
    }
}

/// Appends one framed record holding `command` (log index `seq`) to `out`. Returns the bytes
/// appended.
pub fn encode_record(
    seq: u64,
    command: &impl Payload,
    out: &mut Vec<u8>,
) -> Result<usize, EncodeError> {
    let len = command.encoded_len();
    if len > RECORD_PAYLOAD_MAX {
        return Err(EncodeError::CommandTooLarge { len });
    }
    let start = out.len();
    out.reserve(RECORD_HEADER_BYTES + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&seq.to_le_bytes());
    command.encode_into(out);
    debug_assert_eq!(out.len() - start, RECORD_HEADER_BYTES + len);
    let crc = record_crc(&out[start..start + 4], &out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(out.len() - start)
}

fn record_crc(len_bytes: &[u8], seq_and_payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(len_bytes), seq_and_payload)
}

/// One decoded record, borrowing its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    pub seq: u64,
    pub payload: &'a [u8],
}

/// What sits at a position of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A valid record and the bytes it spans.
    Record(Record<'a>, usize),
    /// A zero header: the rest of this aligned block is padding.
    Padding,
}

/// Decodes the frame at the start of `buf`.
pub fn decode_frame(buf: &[u8]) -> Result<Frame<'_>, DecodeError> {
    if buf.len() < RECORD_HEADER_BYTES {
        return Err(DecodeError::Truncated {
            need: RECORD_HEADER_BYTES,
            have: buf.len(),
        });
    }
    let header = &buf[..RECORD_HEADER_BYTES];
    if header.iter().all(|&b| b == 0) {
        return Ok(Frame::Padding);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if len < 4 || len as usize > RECORD_PAYLOAD_MAX {
        return Err(DecodeError::BadLength { len });
    }
    let total = RECORD_HEADER_BYTES + len as usize;
    if buf.len() < total {
        return Err(DecodeError::Truncated {
            need: total,
            have: buf.len(),
        });
    }
    let stored = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    let computed = record_crc(&buf[0..4], &buf[8..total]);
    if stored != computed {
        return Err(DecodeError::Checksum { stored, computed });
    }
    let mut seq = [0u8; 8];
    seq.copy_from_slice(&buf[8..16]);
    Ok(Frame::Record(
        Record {
            seq: u64::from_le_bytes(seq),
            payload: &buf[RECORD_HEADER_BYTES..total],
        },
        total,
    ))
}

/// How a segment scan ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanEnd {
    /// The segment ends with padding or exactly after a record.
    Clean,
    /// Bytes at `offset` are not a valid record: a torn or corrupt tail starts there.
    Torn { offset: usize, reason: DecodeError },
}

/// Walks the records of one segment's bytes, skipping padding. Pure.
pub struct SegmentReader<'a> {
    bytes: &'a [u8],
    pos: usize,
    end: Option<ScanEnd>,
}

impl<'a> SegmentReader<'a> {
    /// A reader of a whole segment: starts after its header (see [`super::header`]), or at
    /// byte 0 for a segment without one.
    pub fn new(bytes: &'a [u8]) -> SegmentReader<'a> {
        SegmentReader::starting_at(bytes, read_segment_header(bytes).records_start())
    }

    /// A reader that starts at byte `pos` (a multiple of [`WRITE_ALIGN`]).
    pub fn starting_at(bytes: &'a [u8], pos: usize) -> SegmentReader<'a> {
        SegmentReader {
            bytes,
            pos: pos.min(bytes.len()),
            end: None,
        }
    }

    /// How the scan ended (after `next_record` returned `None`).
    pub fn end(&self) -> Option<&ScanEnd> {
        self.end.as_ref()
    }

    /// Offset just past the last valid record or padding.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The next record and its offset, or `None` at the end (see [`SegmentReader::end`]).
    pub fn next_record(&mut self) -> Option<(usize, Record<'a>)> {
        if self.end.is_some() {
            return None;
        }
        loop {
            let rest = &self.bytes[self.pos..];
            if rest.is_empty() {
                self.end = Some(ScanEnd::Clean);
                return None;
            }
            match decode_frame(rest) {
                Ok(Frame::Record(record, len)) => {
                    let at = self.pos;
                    self.pos += len;
                    return Some((at, record));
                }
                Ok(Frame::Padding) => {
                    let next = (self.pos / WRITE_ALIGN + 1) * WRITE_ALIGN;
                    let stop = next.min(self.bytes.len());
                    if let Some(dirty) = self.bytes[self.pos..stop].iter().position(|&b| b != 0) {
                        self.end = Some(ScanEnd::Torn {
                            offset: self.pos,
                            reason: DecodeError::DirtyPadding {
                                offset: self.pos + dirty,
                            },
                        });
                        return None;
                    }
                    self.pos = stop;
                }
                Err(DecodeError::Truncated { .. }) if rest.iter().all(|&b| b == 0) => {
                    self.pos = self.bytes.len();
                    self.end = Some(ScanEnd::Clean);
                    return None;
                }
                // A write that ended fewer than RECORD_HEADER_BYTES before a block boundary
                // leaves a padding too short to hold a zero header: the "header" read here runs
                // into the next write's first record. Zeros up to the boundary are that padding.
                // (A record is tried first: a valid one is never mistaken for padding.)
                Err(_)
                    if self.pos % WRITE_ALIGN != 0 && {
                        let next = (self.pos / WRITE_ALIGN + 1) * WRITE_ALIGN;
                        next < self.bytes.len()
                            && self.bytes[self.pos..next].iter().all(|&b| b == 0)
                    } =>
                {
                    self.pos = (self.pos / WRITE_ALIGN + 1) * WRITE_ALIGN;
                }
                Err(reason) => {
                    self.end = Some(ScanEnd::Torn {
                        offset: self.pos,
                        reason,
                    });
                    return None;
                }
            }
        }
    }
}

/// The first intact record that starts after byte `from` of a segment and whose sequence
/// number is above `after_seq`: evidence that damage at `from` is not a torn tail. Pure.
///
/// Tries every byte offset, because a flipped length field hides where the next record starts.
/// A candidate must frame a plausible length and a sequence number within 2^32 of `after_seq`
/// before its checksum is computed, so the search stays linear on real segments. Runs only
/// when recovery met damage.
pub fn find_intact_record(bytes: &[u8], from: usize, after_seq: u64) -> Option<(usize, u64)> {
    let end = bytes.len().checked_sub(RECORD_HEADER_BYTES)?;
    for at in from.saturating_add(1)..=end {
        let h = &bytes[at..at + RECORD_HEADER_BYTES];
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        if len < 4 || len > bytes.len() - at - RECORD_HEADER_BYTES {
            continue;
        }
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&h[8..16]);
        let seq = u64::from_le_bytes(raw);
        if seq <= after_seq || seq - after_seq > u32::MAX as u64 {
            continue;
        }
        if let Ok(Frame::Record(record, _)) = decode_frame(&bytes[at..]) {
            return Some((at, record.seq));
        }
    }
    None
}

/// Whether the next record goes into the pending chunk `last` (same segment, room left).
fn continues_chunk(last: Option<&Chunk>, segment_first_seq: u64) -> bool {
    last.is_some_and(|c| {
        c.segment_first_seq == segment_first_seq && c.bytes.len() < CHUNK_BYTES_MAX
    })
}

/// How much a record of `record_len` bytes adds to its segment's size on disk: every chunk is
/// written padded to [`WRITE_ALIGN`], so a segment's size is the sum of its chunks' padded
/// lengths. Pure.
fn growth_of(last: Option<&Chunk>, segment_first_seq: u64, record_len: usize) -> u64 {
    let align = |n: usize| dio::align_up(n) as u64;
    match last {
        Some(c) if continues_chunk(Some(c), segment_first_seq) => {
            align(c.bytes.len() + record_len) - align(c.bytes.len())
        }
        _ => align(record_len),
    }
}

/// File name of the segment whose first record has sequence number `first_seq`.
pub fn segment_name(first_seq: u64) -> String {
    format!("wal-{first_seq:020}.log")
}

/// Parses a segment file name back into its first sequence number.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("wal-")?.strip_suffix(".log")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

// ---------------------------------------------------------------------------------------------
// The writer (glommio shell).

/// Records appended but not yet handed to the writer, all for one segment.
struct Chunk {
    segment_first_seq: u64,
    bytes: Vec<u8>,
    last_seq: u64,
    /// Units of [`Wal::reserve`] its records hold: given back once it is written.
    reserved: u64,
}

/// Bytes appended and not yet written that [`Wal::reserve`] lets wait. Bounds the log's memory,
/// and the length of one group commit, when appends do not wait for their fdatasync (`leader`
/// publishes, buffered deletes): a commit of many megabytes makes every durable write behind it
/// wait as long, so deletes fall behind. A fixed bound: about 4 ms of writing at 1 GB/s.
pub const BUFFER_BYTES_MAX: u64 = 4 << 20;

/// A chunk is cut at this size so one DMA buffer stays small.
const CHUNK_BYTES_MAX: usize = 1 << 20;

/// Commit rounds in flight at once: a round's write may start while the previous round's
/// fdatasync is still in flight (see the module docs).
pub const ROUNDS_IN_FLIGHT_MAX: usize = 2;

/// The first zero-fill step of a new segment; later steps double up to `preallocate_bytes`.
const PREALLOCATE_FIRST_BYTES: u64 = 256 << 10;

/// The segment the writer is appending to.
struct OpenSegment {
    first_seq: u64,
    /// Shared with the fdatasyncs of the rounds in flight.
    file: Rc<DmaFile>,
    path: Rc<Path>,
    /// Next write offset (aligned).
    pos: u64,
    /// Bytes at the start of the file already written with zeros (or records): writes below
    /// this are overwrites, whose fdatasync needs no journal commit.
    zeroed_end: u64,
    /// The `written_bytes` the header on the file says (0: no header written yet).
    header_says: u64,
    /// The directory was synced since the file was created (its name survives a crash).
    named: bool,
}

/// A live segment (its records are not all in tables yet).
#[derive(Debug, Clone)]
pub struct SegmentMeta {
    pub first_seq: u64,
    pub path: PathBuf,
    /// Bytes its records take once written: the header block, records appended, and the
    /// padding of the writes that carry them (rollover counts these, not just record bytes).
    pub bytes: u64,
    /// Bytes the file takes on disk: its zero-filled (preallocated) size, which runs ahead of
    /// `bytes`. The WAL cap counts the larger of the two (see [`Wal::live_bytes`]).
    pub file_bytes: u64,
}

impl SegmentMeta {
    /// What the segment takes on disk now, or will once its pending records are written.
    pub fn disk_bytes(&self) -> u64 {
        self.bytes.max(self.file_bytes)
    }
}

/// Counters of the log, read by the engine's stats.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WalCounters {
    pub records: u64,
    pub record_bytes: u64,
    /// Record bytes written to the device, padding included.
    pub bytes_written: u64,
    /// Zeros written ahead of the records (segment preallocation).
    pub zero_fill_bytes: u64,
    pub writes: u64,
    pub fsyncs: u64,
}

struct WalState {
    next_seq: u64,
    synced_seq: u64,
    pending: VecDeque<Chunk>,
    segments: VecDeque<SegmentMeta>,
    roll_requested: bool,
    failed: Option<Failure>,
    shutdown: bool,
    writer_running: bool,
    counters: WalCounters,
    /// The segment a write could not extend for lack of space, while that lasts.
    disk_full: Option<String>,
}

/// The log of one shard. Single-threaded: lives on the shard's executor behind an `Rc`.
pub struct Wal {
    dir: PathBuf,
    segment_bytes_max: u64,
    preallocate_bytes: u64,
    state: RefCell<WalState>,
    /// Wakes the writer: records were appended, or shutdown was requested.
    appended: Signal,
    /// Wakes durable waiters: `synced_seq` moved, or the log failed.
    synced: Signal,
    writer_idle: Cell<bool>,
    /// The commit rounds in flight (see the module docs).
    rounds: RefCell<Rounds<StoreError>>,
    /// Room for appended bytes not yet written (units: bytes, at most [`BUFFER_BYTES_MAX`]).
    buffer: glommio::sync::Semaphore,
    /// `Some((first_ms, max_ms))`: a write that fails for lack of space is retried with this
    /// backoff instead of failing the log (see the module docs).
    full_retry: Cell<Option<(u64, u64)>>,
    full_log: LogLimit,
}

impl Wal {
    /// A log whose next record is `next_seq`. `live` are recovered segments still needed (their
    /// files are never appended to again); the first append starts a new segment.
    ///
    /// `preallocate_bytes`: segments are zero-filled this far ahead of the write position.
    /// Appending past a file's end makes every fdatasync commit the new size through the
    /// filesystem journal (about 4 ms here, against 0.16 ms for an overwrite), so the writer
    /// extends the file in large zeroed steps and record writes are overwrites.
    pub fn new(
        dir: &Path,
        next_seq: u64,
        live: Vec<SegmentMeta>,
        segment_bytes_max: u64,
        preallocate_bytes: u64,
    ) -> Wal {
        let align = WRITE_ALIGN as u64;
        Wal {
            dir: dir.to_path_buf(),
            segment_bytes_max: (segment_bytes_max.div_ceil(align) * align)
                .max(SEGMENT_HEADER_BYTES as u64 + align),
            preallocate_bytes: preallocate_bytes.div_ceil(align) * align,
            state: RefCell::new(WalState {
                next_seq,
                synced_seq: next_seq.saturating_sub(1),
                pending: VecDeque::new(),
                segments: live.into(),
                roll_requested: true,
                failed: None,
                shutdown: false,
                writer_running: false,
                counters: WalCounters::default(),
                disk_full: None,
            }),
            appended: Signal::default(),
            synced: Signal::default(),
            writer_idle: Cell::new(true),
            rounds: RefCell::new(Rounds::new(ROUNDS_IN_FLIGHT_MAX)),
            buffer: glommio::sync::Semaphore::new(BUFFER_BYTES_MAX),
            full_retry: Cell::new(None),
            full_log: LogLimit::new(LOG_INTERVAL_MS),
        }
    }

    /// Retries writes that fail for lack of space, waiting `first_ms` doubling to `max_ms`
    /// between tries, instead of failing the log (see the module docs).
    pub fn retry_when_full(&self, first_ms: u64, max_ms: u64) {
        self.full_retry.set(Some((first_ms, max_ms)));
    }

    /// The segment a write could not extend for lack of space, while appends are refused.
    pub fn disk_full(&self) -> Option<String> {
        self.state.borrow().disk_full.clone()
    }

    /// Starts the writer task on the current task queue (the foreground: commits are latency).
    pub fn start(self: &Rc<Self>) {
        let mut st = self.state.borrow_mut();
        if st.writer_running {
            return;
        }
        st.writer_running = true;
        drop(st);
        let wal = Rc::clone(self);
        glommio::spawn_local(async move { wal.run_writer().await }).detach();
    }

    fn failure(&self) -> Option<StoreError> {
        self.state.borrow().failed.as_ref().map(Failure::error)
    }

    /// Fails if the log has failed or is shut down, or while the disk is full.
    pub fn check(&self) -> Result<(), StoreError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let st = self.state.borrow();
        if st.shutdown {
            return Err(StoreError::Closed);
        }
        if let Some(path) = &st.disk_full {
            return Err(StoreError::DiskFull { path: path.clone() });
        }
        Ok(())
    }

    /// Encodes `command` as the next record and queues it for the writer, without waiting for
    /// room in the buffer (tests, benches and tools; the broker appends through `Log::propose`,
    /// which does wait). No I/O, no await. Returns its log index.
    pub fn append(&self, command: &impl Payload) -> Result<u64, StoreError> {
        self.append_reserved(command, 0)
    }

    /// Waits until the log's buffer has room for `command` (see [`BUFFER_BYTES_MAX`]); returns
    /// the units to hand to [`Wal::append_reserved`]. Waiters are served in arrival order, so
    /// commands reach the log in the order their writers reserved.
    pub async fn reserve(&self, command: &impl Payload) -> Result<u64, StoreError> {
        self.check()?;
        let units = ((RECORD_HEADER_BYTES + command.encoded_len()) as u64).min(BUFFER_BYTES_MAX);
        if self.buffer.acquire(units).await.is_err() {
            return Err(self.failure().unwrap_or(StoreError::Closed));
        }
        Ok(units)
    }

    /// [`Wal::append`] of a command whose room was reserved; the units are given back once its
    /// record is written (or at once, if the append fails).
    pub fn append_reserved(&self, command: &impl Payload, units: u64) -> Result<u64, StoreError> {
        let appended = self.append_with(command, units);
        if appended.is_err() && units > 0 {
            self.buffer.signal(units);
        }
        appended
    }

    fn append_with(&self, command: &impl Payload, units: u64) -> Result<u64, StoreError> {
        self.check()?;
        let record_len = RECORD_HEADER_BYTES + command.encoded_len();
        if command.encoded_len() > RECORD_PAYLOAD_MAX {
            return Err(io_error(
                &self.dir,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    EncodeError::CommandTooLarge {
                        len: command.encoded_len(),
                    }
                    .to_string(),
                ),
            ));
        }
        let mut st = self.state.borrow_mut();
        let seq = st.next_seq;
        let need_roll = st.roll_requested
            || st.segments.back().is_none_or(|s| {
                // A segment holding a record never grows past its bound: the record that would
                // take it there starts the next one (a record larger than a whole segment gets
                // one to itself).
                s.bytes > SEGMENT_HEADER_BYTES as u64
                    && s.bytes + growth_of(st.pending.back(), s.first_seq, record_len)
                        > self.segment_bytes_max
            });
        if need_roll {
            st.roll_requested = false;
            st.segments.push_back(SegmentMeta {
                first_seq: seq,
                path: self.dir.join(segment_name(seq)),
                bytes: SEGMENT_HEADER_BYTES as u64,
                file_bytes: 0,
            });
        }
        let segment_first_seq = st.segments.back().map_or(seq, |s| s.first_seq);
        let growth = growth_of(st.pending.back(), segment_first_seq, record_len);
        if !continues_chunk(st.pending.back(), segment_first_seq) {
            st.pending.push_back(Chunk {
                segment_first_seq,
                bytes: Vec::with_capacity(64 * 1024),
                last_seq: seq,
                reserved: 0,
            });
        }
        let chunk = st
            .pending
            .back_mut()
            .ok_or_else(|| io_error(&self.dir, std::io::Error::other("no pending chunk")))?;
        let len = encode_record(seq, command, &mut chunk.bytes).map_err(|e| {
            io_error(
                &self.dir,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
            )
        })?;
        chunk.last_seq = seq;
        chunk.reserved += units;
        st.next_seq = seq + 1;
        st.counters.records += 1;
        st.counters.record_bytes += len as u64;
        if let Some(seg) = st.segments.back_mut() {
            seg.bytes += growth;
        }
        drop(st);
        self.appended.notify();
        Ok(seq)
    }

    /// The next record starts a new segment (called when a memtable is frozen, so a segment's
    /// records belong to as few memtables as possible and can be released together).
    pub fn roll(&self) {
        self.state.borrow_mut().roll_requested = true;
    }

    /// Sequence number the next record will get.
    pub fn next_seq(&self) -> u64 {
        self.state.borrow().next_seq
    }

    /// Highest sequence number on stable storage.
    pub fn synced_seq(&self) -> u64 {
        self.state.borrow().synced_seq
    }

    /// Resolves once record `seq` is covered by an fdatasync.
    pub async fn wait_durable(&self, seq: u64) -> Result<(), StoreError> {
        loop {
            if let Some(e) = self.failure() {
                return Err(e);
            }
            let wait = {
                let st = self.state.borrow();
                if st.synced_seq >= seq {
                    return Ok(());
                }
                if let Some(path) = &st.disk_full {
                    return Err(StoreError::DiskFull { path: path.clone() });
                }
                if !st.writer_running {
                    return Err(StoreError::Closed);
                }
                self.synced.wait()
            };
            wait.await;
        }
    }

    /// Everything appended so far is durable.
    pub async fn sync_all(&self) -> Result<(), StoreError> {
        let last = self.next_seq().saturating_sub(1);
        self.wait_durable(last).await
    }

    /// Bytes the live segments take on disk: headers, records, padding, and the zeros
    /// preallocated ahead of the records. The WAL cap (`storage.walMaxBytes`) counts these.
    pub fn live_bytes(&self) -> u64 {
        self.state
            .borrow()
            .segments
            .iter()
            .map(SegmentMeta::disk_bytes)
            .sum()
    }

    pub fn live_segments(&self) -> usize {
        self.state.borrow().segments.len()
    }

    pub fn counters(&self) -> WalCounters {
        self.state.borrow().counters
    }

    /// Forgets the segments whose records are all at or below `flushed_seq` (now in tables) and
    /// returns their paths for the caller to remove. The newest segment is always kept.
    pub fn release_through(&self, flushed_seq: u64) -> Vec<PathBuf> {
        let mut st = self.state.borrow_mut();
        let mut released = Vec::new();
        while st.segments.len() >= 2 {
            let next_first = st.segments[1].first_seq;
            if next_first > flushed_seq.saturating_add(1) {
                break;
            }
            if let Some(seg) = st.segments.pop_front() {
                released.push(seg.path);
            }
        }
        released
    }

    /// Stops the writer after it has written and synced everything pending.
    pub async fn shutdown(&self) -> Result<(), StoreError> {
        let result = self.sync_all().await;
        self.state.borrow_mut().shutdown = true;
        self.appended.notify();
        // Wait for the writer to leave its loop so no write is in flight when the caller returns.
        while self.state.borrow().writer_running {
            let wait = self.synced.wait();
            if !self.state.borrow().writer_running {
                break;
            }
            wait.await;
        }
        match result {
            Err(StoreError::Closed) => Ok(()),
            other => other,
        }
    }

    /// Asks the writer to stop once everything pending is written (for `Drop`, which cannot
    /// wait).
    pub fn request_shutdown(&self) {
        self.state.borrow_mut().shutdown = true;
        self.appended.notify();
    }

    /// True while no write or fdatasync is in flight and nothing is pending.
    pub fn is_idle(&self) -> bool {
        self.writer_idle.get()
            && self.rounds.borrow().is_empty()
            && self.state.borrow().pending.is_empty()
    }

    /// How many commit rounds may be in flight at once (see the module docs; default
    /// [`ROUNDS_IN_FLIGHT_MAX`]). 1 is the classic group commit: a round's write waits for the
    /// previous round's fdatasync. For benches comparing the two (`benches/wal_pipeline.rs`).
    pub fn set_rounds_in_flight_max(&self, rounds: usize) {
        self.rounds.borrow_mut().set_in_flight_max(rounds);
    }

    async fn run_writer(self: Rc<Self>) {
        let mut current: Option<OpenSegment> = None;
        // Chunks taken for writing, in order: a write that fails for lack of space leaves the
        // unwritten ones here for the retry.
        let mut batch: VecDeque<Chunk> = VecDeque::new();
        // The records taken and not yet in a round (and the buffer room their chunks hold),
        // with those of failed rounds, until a round's fdatasync covers them.
        let mut unsynced: Option<Covered> = None;
        let mut attempt = 0u32;
        loop {
            let stop = self.take_pending(&mut batch, &mut unsynced);
            let failed = self.rounds.borrow_mut().take_failed();
            let step = match failed {
                Some((lost, error)) => {
                    unsynced = Some(unsynced.map_or(lost, |u| lost.merge(u)));
                    Err(error)
                }
                None => {
                    let room = self.rounds.borrow().has_room();
                    if unsynced.is_none() && stop {
                        break;
                    }
                    if unsynced.is_none() || !room {
                        self.wait_for_work(unsynced.is_none()).await;
                        continue;
                    }
                    self.writer_idle.set(false);
                    self.write_round(&mut batch, &mut current).await
                }
            };
            match step {
                Ok(synced_file) => {
                    attempt = 0;
                    if let Some(covered) = unsynced.take() {
                        self.begin_round(covered, synced_file);
                    }
                }
                Err(e) if e.is_no_space() && !stop && self.full_retry.get().is_some() => {
                    // Rounds still in flight hold earlier records: let them finish first, so
                    // only the records the retry may lose are answered with `DiskFull`.
                    self.drain_rounds().await;
                    if self.rounds.borrow().has_failure() {
                        continue;
                    }
                    let delay = self.note_disk_full(&e, attempt);
                    attempt = attempt.saturating_add(1);
                    self.synced.notify();
                    self.sleep_unless_shutdown(delay).await;
                }
                Err(e) => {
                    let failure = Failure::of(&e, &self.dir);
                    tracing::error!(error = %failure, "WAL write failed; the shard's log is failed");
                    self.state.borrow_mut().failed = Some(failure);
                    self.synced.notify();
                    break;
                }
            }
        }
        self.drain_rounds().await;
        if let Some(seg) = current.take() {
            if let Ok(file) = Rc::try_unwrap(seg.file) {
                let _ = dio::close(file, &seg.path).await;
            }
        }
        self.writer_idle.set(true);
        self.state.borrow_mut().writer_running = false;
        // Writers waiting for room would wait forever: they get the failure (or `Closed`).
        self.buffer.close();
        self.synced.notify();
    }

    /// Moves the appended chunks into `batch` and what they cover into `unsynced`. Returns
    /// whether the writer should stop once nothing is left to write (shutdown, or failed).
    fn take_pending(&self, batch: &mut VecDeque<Chunk>, unsynced: &mut Option<Covered>) -> bool {
        let mut st = self.state.borrow_mut();
        for chunk in st.pending.drain(..) {
            let covered = Covered {
                last_seq: chunk.last_seq,
                reserved: chunk.reserved,
            };
            *unsynced = Some(unsynced.map_or(covered, |u| u.merge(covered)));
            batch.push_back(chunk);
        }
        st.shutdown || st.failed.is_some()
    }

    /// Waits for records to write (`idle`: nothing is waiting to be written) or, with records
    /// waiting, for a round in flight to complete and make room. A failed round wakes both.
    async fn wait_for_work(&self, idle: bool) {
        if idle {
            let wait = self.appended.wait();
            self.writer_idle.set(true);
            wait.await;
        } else {
            self.synced.wait().await;
        }
    }

    /// Waits until every round in flight has completed (successfully or not).
    async fn drain_rounds(&self) {
        while !self.rounds.borrow().is_settled() {
            self.synced.wait().await;
        }
    }

    /// Starts a round: issues the fdatasync of `file` (the segment the round's last write went
    /// to, written completely by now) in a task of its own, so the writer can start the next
    /// round's write meanwhile. `None`: nothing was written since the last sync, the records
    /// are covered already.
    fn begin_round(self: &Rc<Self>, covered: Covered, file: Option<(Rc<DmaFile>, Rc<Path>)>) {
        let id = self.rounds.borrow_mut().begin(covered);
        let Some((file, path)) = file else {
            self.round_done(id, Ok(()));
            return;
        };
        let wal = Rc::clone(self);
        glommio::spawn_local(async move {
            let result = dio::fdatasync(&file, &path).await;
            drop(file);
            wal.round_done(id, result);
        })
        .detach();
    }

    /// A round's fdatasync completed: reports durable what the rounds make durable (in
    /// sequence order: see `rounds`), gives their buffer room back, and wakes the waiters (and
    /// the writer, after a failure).
    fn round_done(&self, id: RoundId, result: Result<(), StoreError>) {
        let (advance, failure) = {
            let mut rounds = self.rounds.borrow_mut();
            let advance = rounds.complete(id, result);
            (advance, rounds.has_failure())
        };
        if let Some(covered) = advance.covered {
            let mut st = self.state.borrow_mut();
            st.synced_seq = st.synced_seq.max(covered.last_seq);
            st.counters.fsyncs += advance.rounds;
            let healed = st.disk_full.take();
            drop(st);
            if let Some(path) = healed {
                tracing::info!(file = %path, "space is back: WAL writes resumed");
            }
            self.buffer.signal(covered.reserved);
        }
        if failure {
            self.appended.notify();
        }
        self.synced.notify();
    }

    /// A write failed for lack of space: appends are refused from now on (health names the
    /// file), a warning goes out at most once per interval, and the retry waits the backoff.
    fn note_disk_full(&self, error: &StoreError, attempt: u32) -> std::time::Duration {
        let path = match error {
            StoreError::Io { path, .. } | StoreError::DiskFull { path } => path.clone(),
            _ => self.dir.display().to_string(),
        };
        self.state.borrow_mut().disk_full = Some(path);
        let (first_ms, max_ms) = self.full_retry.get().unwrap_or((100, 5_000));
        let delay_ms = crate::storage::options::retry_delay_ms(first_ms, max_ms, attempt);
        if let Some(suppressed) = self.full_log.admit(monotonic_ms()) {
            tracing::warn!(
                dir = %self.dir.display(),
                suppressed,
                "WAL write failed for lack of space, retrying in {delay_ms} ms; publishes and deletes are refused meanwhile: {error}"
            );
        }
        std::time::Duration::from_millis(delay_ms)
    }

    /// Sleeps `delay`, or less if a shutdown is requested meanwhile.
    async fn sleep_unless_shutdown(&self, delay: std::time::Duration) {
        let stop = async {
            while !self.state.borrow().shutdown {
                self.appended.wait().await;
            }
        };
        futures_lite::future::or(glommio::timer::sleep(delay), stop).await;
    }

    /// Counts `zeroed` bytes of zero-fill and records that segment `first_seq` now takes
    /// `file_bytes` on disk (the WAL cap counts it from now on).
    fn note_zero_fill(&self, first_seq: u64, zeroed: u64, file_bytes: u64) {
        let mut st = self.state.borrow_mut();
        st.counters.zero_fill_bytes += zeroed;
        if let Some(meta) = st.segments.iter_mut().find(|m| m.first_seq == first_seq) {
            meta.file_bytes = file_bytes;
        }
    }

    /// Makes the segment ready for a write ending at `end`: zero-fills ahead and syncs that (so
    /// the write is an overwrite and the file's size on disk covers it), syncs the directory
    /// once for a new file, and rewrites the header with the new zero-filled size. The header
    /// write reaches the disk with the write that follows it, in the same fdatasync; it is
    /// issued only after the zeros it describes are synced, so the header never claims more
    /// than the file holds (see [`super::header`]).
    async fn prepare_room(&self, seg: &mut OpenSegment, end: u64) -> Result<(), StoreError> {
        if end > seg.zeroed_end {
            // Each step doubles the zeroed size, up to `preallocate_bytes`: a segment that a
            // flush rolls early wastes at most as many zeros as it holds records (plus one
            // first step), instead of a whole step per segment. Never past the segment's bound
            // (rollover keeps records within it), so a segment takes at most
            // `segment_bytes_max` on disk. All are multiples of WRITE_ALIGN; a
            // `preallocate_bytes` of 0 zero-fills exactly what the write needs.
            let step = seg
                .zeroed_end
                .max(PREALLOCATE_FIRST_BYTES)
                .min(self.preallocate_bytes);
            let target = (seg.zeroed_end + step).min(self.segment_bytes_max).max(end);
            dio::write_zeros(
                &seg.file,
                &seg.path,
                seg.zeroed_end,
                target - seg.zeroed_end,
            )
            .await?;
            self.note_zero_fill(seg.first_seq, target - seg.zeroed_end, target);
            seg.zeroed_end = target;
            dio::fdatasync(&seg.file, &seg.path).await?;
            self.state.borrow_mut().counters.fsyncs += 1;
        }
        if !seg.named {
            // The new name must survive a crash before any record in it is acknowledged (a
            // retry after a failure above syncs it then).
            dio::sync_dir(&self.dir).await?;
            seg.named = true;
        }
        if seg.header_says != seg.zeroed_end {
            let header = encode_segment_header(&SegmentHeader {
                first_seq: seg.first_seq,
                written_bytes: seg.zeroed_end,
            });
            dio::write_padded(&seg.file, &seg.path, 0, &header).await?;
            seg.header_says = seg.zeroed_end;
        }
        Ok(())
    }

    /// The write half of a round: writes chunks in order, fsyncing a segment before moving to
    /// the next (after the rounds in flight on it have completed), and returns the segment the
    /// last write went to, for the round's fdatasync (`None` if no segment is open).
    ///
    /// Takes each chunk off the front of `chunks` once it is written: after an error, what is
    /// left is exactly what must be written again, and every segment position and size was
    /// advanced only past writes that succeeded.
    async fn write_round(
        &self,
        chunks: &mut VecDeque<Chunk>,
        current: &mut Option<OpenSegment>,
    ) -> Result<Option<(Rc<DmaFile>, Rc<Path>)>, StoreError> {
        while let Some(chunk) = chunks.front() {
            let switch = current
                .as_ref()
                .is_none_or(|seg| seg.first_seq != chunk.segment_first_seq);
            if switch {
                let first_seq = chunk.segment_first_seq;
                self.switch_segment(current, first_seq).await?;
            }
            if let Some(seg) = current.as_mut() {
                let padded = dio::align_up(chunk.bytes.len().max(1)) as u64;
                self.prepare_room(seg, seg.pos + padded).await?;
                let written =
                    dio::write_padded(&seg.file, &seg.path, seg.pos, &chunk.bytes).await?;
                seg.pos += written as u64;
                let mut st = self.state.borrow_mut();
                st.counters.bytes_written += written as u64;
                st.counters.writes += 1;
            }
            chunks.pop_front();
        }
        Ok(current
            .as_ref()
            .map(|seg| (Rc::clone(&seg.file), Rc::clone(&seg.path))))
    }

    /// Lets the open segment go, synced, and opens segment `first_seq`. The rounds in flight
    /// complete first: their fdatasyncs hold the file.
    async fn switch_segment(
        &self,
        current: &mut Option<OpenSegment>,
        first_seq: u64,
    ) -> Result<(), StoreError> {
        self.drain_rounds().await;
        if let Some(seg) = current.as_ref() {
            // Synced before it is let go: a retry after a failure here syncs it again.
            dio::fdatasync(&seg.file, &seg.path).await?;
            self.state.borrow_mut().counters.fsyncs += 1;
        }
        if let Some(seg) = current.take() {
            if let Ok(file) = Rc::try_unwrap(seg.file) {
                dio::close(file, &seg.path).await?;
            }
        }
        let path: Rc<Path> = self.dir.join(segment_name(first_seq)).into();
        let file = dio::open_rw(&path, true).await?;
        *current = Some(OpenSegment {
            first_seq,
            file: Rc::new(file),
            path,
            pos: SEGMENT_HEADER_BYTES as u64,
            zeroed_end: 0,
            header_says: 0,
            named: false,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::key::{EventKey, TopicHash};
    use crate::message::Value;

    fn key(id: u64) -> EventKey {
        EventKey::new(TopicHash(3), 1, id)
    }

    fn sample_batch() -> Command {
        Command::Store {
            messages: vec![
                (key(1), Value::copy_from_slice(b"hello world")),
                (key(2), Value::copy_from_slice(b"")),
            ],
            event_id_high_water: 2,
        }
    }

    #[test]
    fn record_round_trips() {
        let batch = sample_batch();
        let mut out = Vec::new();
        let len = encode_record(42, &batch, &mut out).unwrap();
        assert_eq!(len, out.len());
        assert_eq!(len, RECORD_HEADER_BYTES + batch.encoded_len());
        match decode_frame(&out).unwrap() {
            Frame::Record(record, used) => {
                assert_eq!(used, len);
                assert_eq!(record.seq, 42);
                assert_eq!(Command::decode(record.payload).unwrap(), batch);
            }
            Frame::Padding => panic!("record decoded as padding"),
        }
    }

    #[test]
    fn empty_batch_is_a_valid_record() {
        let mut out = Vec::new();
        encode_record(1, &Command::Delete { keys: vec![] }, &mut out).unwrap();
        let Frame::Record(record, _) = decode_frame(&out).unwrap() else {
            panic!("expected a record")
        };
        assert!(Command::decode(record.payload).unwrap().is_empty());
    }

    #[test]
    fn every_flipped_bit_is_detected() {
        let mut out = Vec::new();
        encode_record(7, &sample_batch(), &mut out).unwrap();
        for byte in 0..out.len() {
            for bit in 0..8 {
                let mut bad = out.clone();
                bad[byte] ^= 1 << bit;
                match decode_frame(&bad) {
                    Ok(Frame::Record(record, _)) => {
                        panic!(
                            "flip at byte {byte} bit {bit} accepted as seq {}",
                            record.seq
                        )
                    }
                    Ok(Frame::Padding) => panic!("flip at byte {byte} read as padding"),
                    Err(_) => {}
                }
            }
        }
    }

    #[test]
    fn truncated_records_are_refused() {
        let mut out = Vec::new();
        encode_record(7, &sample_batch(), &mut out).unwrap();
        for cut in 0..out.len() {
            assert!(decode_frame(&out[..cut]).is_err(), "cut at {cut} accepted");
        }
    }

    #[test]
    fn segment_reader_skips_padding_and_stops_at_a_torn_tail() {
        let mut seg = Vec::new();
        encode_record(1, &sample_batch(), &mut seg).unwrap();
        encode_record(2, &sample_batch(), &mut seg).unwrap();
        seg.resize(WRITE_ALIGN, 0);
        let second_block = seg.len();
        encode_record(3, &sample_batch(), &mut seg).unwrap();
        let torn_at = seg.len();
        let mut tail = Vec::new();
        encode_record(4, &sample_batch(), &mut tail).unwrap();
        seg.extend_from_slice(&tail[..tail.len() / 2]);

        let mut reader = SegmentReader::new(&seg);
        let seqs: Vec<(usize, u64)> =
            std::iter::from_fn(|| reader.next_record().map(|(at, r)| (at, r.seq))).collect();
        assert_eq!(seqs.len(), 3);
        assert_eq!(seqs[2], (second_block, 3));
        match reader.end() {
            Some(ScanEnd::Torn { offset, .. }) => assert_eq!(*offset, torn_at),
            other => panic!("expected a torn tail, got {other:?}"),
        }
    }

    #[test]
    fn segment_reader_ends_clean_on_zero_tail_and_flags_dirty_padding() {
        let mut seg = Vec::new();
        encode_record(1, &sample_batch(), &mut seg).unwrap();
        seg.resize(2 * WRITE_ALIGN + 5, 0);
        let mut reader = SegmentReader::new(&seg);
        assert!(reader.next_record().is_some());
        assert!(reader.next_record().is_none());
        assert_eq!(reader.end(), Some(&ScanEnd::Clean));

        let mut dirty = seg.clone();
        dirty[WRITE_ALIGN - 3] = 9;
        let mut reader = SegmentReader::new(&dirty);
        assert!(reader.next_record().is_some());
        assert!(reader.next_record().is_none());
        assert!(matches!(reader.end(), Some(ScanEnd::Torn { .. })));
    }

    /// Regression (found by the server crash test and the model test): a group-commit write
    /// ending 1 to 15 bytes before a block boundary left padding shorter than a header, which
    /// the reader took for a torn record, dropping every later (acknowledged) record.
    #[test]
    fn segment_reader_skips_padding_shorter_than_a_header() {
        for short in 1..=RECORD_HEADER_BYTES {
            // One message: record = 16 header + 6 command header + 12 + 24 key + 4 len + value.
            let value_len = WRITE_ALIGN - short - RECORD_HEADER_BYTES - 46;
            let batch = Command::Store {
                messages: vec![(key(1), Value::copy_from_slice(&vec![7u8; value_len]))],
                event_id_high_water: 1,
            };
            let mut seg = Vec::new();
            encode_record(1, &batch, &mut seg).unwrap();
            assert_eq!(seg.len(), WRITE_ALIGN - short);
            seg.resize(WRITE_ALIGN, 0);
            encode_record(2, &sample_batch(), &mut seg).unwrap();
            seg.resize(2 * WRITE_ALIGN, 0);

            let mut reader = SegmentReader::new(&seg);
            let seqs: Vec<u64> =
                std::iter::from_fn(|| reader.next_record().map(|(_, r)| r.seq)).collect();
            assert_eq!(seqs, vec![1, 2], "padding of {short} bytes");
            assert_eq!(
                reader.end(),
                Some(&ScanEnd::Clean),
                "padding of {short} bytes"
            );
        }
    }

    /// A simulated disk that lets every operation through to the real files, but (1) fails
    /// fdatasync number `fail_sync` (counting from 1) with EIO, and (2) during each record
    /// write (after the first zero fill's fdatasync), while `more` is above zero, appends the
    /// next record to `wal`: so that record goes to the next round, deterministically, and
    /// notes how many rounds were in flight when the write was issued.
    struct ScriptedDisk {
        fail_sync: u64,
        syncs: Cell<u64>,
        wal: RefCell<Option<Rc<Wal>>>,
        more: Cell<u32>,
        last_appended: Cell<u64>,
        rounds_in_flight_at_writes: RefCell<Vec<usize>>,
    }

    impl ScriptedDisk {
        fn new(fail_sync: u64, more: u32) -> Rc<ScriptedDisk> {
            Rc::new(ScriptedDisk {
                fail_sync,
                syncs: Cell::new(0),
                wal: RefCell::new(None),
                more: Cell::new(more),
                last_appended: Cell::new(0),
                rounds_in_flight_at_writes: RefCell::new(Vec::new()),
            })
        }
    }

    impl crate::storage::io::seam::Disk for ScriptedDisk {
        fn decide(
            &self,
            op: crate::storage::io::seam::Op<'_>,
        ) -> crate::storage::io::seam::Outcome {
            use crate::storage::io::seam::{Op, Outcome};
            match op {
                Op::Sync { .. } => {
                    self.syncs.set(self.syncs.get() + 1);
                    if self.syncs.get() == self.fail_sync {
                        return Outcome::Fail(std::io::Error::from_raw_os_error(libc::EIO));
                    }
                }
                Op::Write { pos, .. } if pos >= 2 * WRITE_ALIGN as u64 => {
                    let wal = self.wal.borrow().clone();
                    if let Some(wal) = wal {
                        let in_flight = wal.rounds.borrow().in_flight();
                        self.rounds_in_flight_at_writes.borrow_mut().push(in_flight);
                        if self.more.get() > 0 {
                            self.more.set(self.more.get() - 1);
                            if let Ok(seq) = wal.append(&sample_batch()) {
                                self.last_appended.set(seq);
                            }
                        }
                    }
                }
                _ => {}
            }
            Outcome::Proceed
        }
    }

    fn on_executor<F, Fut>(body: F)
    where
        F: FnOnce(PathBuf) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().to_path_buf();
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .spawn(move || async move {
                dio::probe_disk(&path).await.expect("probe");
                body(path).await;
                crate::storage::io::seam::uninstall();
            })
            .expect("executor")
            .join()
            .expect("test");
    }

    /// Each record is appended while the previous one's write is in flight, so each goes to a
    /// round of its own: the write of every round after the first starts while the previous
    /// round's fdatasync is still in flight (two rounds at once), and still every record is
    /// reported durable, in order, and reads back whole. With one round at a time (the bound
    /// at 1) no write starts while a round is in flight, which shows the test sees the
    /// difference.
    #[test]
    fn a_round_is_written_while_the_previous_rounds_fdatasync_is_in_flight() {
        for bound in [2usize, 1] {
            on_executor(move |path| async move {
                let disk = ScriptedDisk::new(0, 20);
                crate::storage::io::seam::install(disk.clone());
                let wal = Rc::new(Wal::new(&path, 1, Vec::new(), 64 << 20, 1 << 20));
                wal.set_rounds_in_flight_max(bound);
                wal.start();
                let first = wal.append(&sample_batch()).expect("append");
                wal.wait_durable(first).await.expect("durable");
                *disk.wal.borrow_mut() = Some(Rc::clone(&wal));
                let second = wal.append(&sample_batch()).expect("append");
                // Each record's write appends the next: wait until the chain has ended.
                let mut last = second;
                loop {
                    wal.wait_durable(last).await.expect("durable");
                    if disk.more.get() == 0 && disk.last_appended.get() == last {
                        break;
                    }
                    last = disk.last_appended.get().max(last);
                }
                assert_eq!(last, second + 20);
                *disk.wal.borrow_mut() = None;
                let at_writes = disk.rounds_in_flight_at_writes.borrow().clone();
                let overlapped = at_writes.iter().filter(|&&n| n >= 1).count();
                // Not every one: the executor may run the fdatasync's completion before the
                // writer issues the next write (glommio's preemption), which is fine.
                if bound == 2 {
                    assert!(
                        overlapped >= 10,
                        "writes with a round in flight: {at_writes:?}"
                    );
                } else {
                    assert_eq!(overlapped, 0, "bound 1: {at_writes:?}");
                }
                assert!(at_writes.iter().all(|&n| n <= bound), "{at_writes:?}");
                wal.shutdown().await.expect("shutdown");
                let bytes = std::fs::read(path.join(segment_name(1))).expect("segment");
                let mut reader = SegmentReader::new(&bytes);
                let seqs: Vec<u64> =
                    std::iter::from_fn(|| reader.next_record().map(|(_, r)| r.seq)).collect();
                assert_eq!(seqs, (1..=last).collect::<Vec<u64>>());
            });
        }
    }

    /// A round whose fdatasync fails fails the log: its waiters and those of the record behind
    /// it (appended while its write was in flight) get the error, no round starts behind the
    /// failure, and `synced_seq` stays where the last good round left it.
    #[test]
    fn a_failed_fdatasync_fails_its_round_and_every_record_behind_it() {
        on_executor(|path| async move {
            // Syncs: 1 the first zero fill, 2 and 3 the rounds of seq 1 and 2, 4 seq 3's.
            let disk = ScriptedDisk::new(4, 1);
            crate::storage::io::seam::install(disk.clone());
            let wal = Rc::new(Wal::new(&path, 1, Vec::new(), 64 << 20, 1 << 20));
            wal.start();
            for _ in 0..2 {
                let seq = wal.append(&sample_batch()).expect("append");
                wal.wait_durable(seq).await.expect("durable");
            }
            *disk.wal.borrow_mut() = Some(Rc::clone(&wal));
            let third = wal.append(&sample_batch()).expect("append");
            let failed = wal.wait_durable(third).await;
            *disk.wal.borrow_mut() = None;
            let fourth = disk.last_appended.get();
            assert_eq!(fourth, 4, "seq 4 appended during seq 3's write");
            assert!(failed.is_err(), "seq 3's fdatasync failed: {failed:?}");
            let behind = wal.wait_durable(fourth).await;
            assert!(
                behind.is_err(),
                "seq 4 reported durable behind a failed round"
            );
            assert_eq!(wal.synced_seq(), 2);
            assert_eq!(disk.syncs.get(), 4, "no round after the failed one");
            assert!(
                wal.append(&sample_batch()).is_err(),
                "the log is failed for good"
            );
            let _ = wal.shutdown().await;
        });
    }

    #[test]
    fn segment_names_round_trip() {
        assert_eq!(parse_segment_name(&segment_name(0)), Some(0));
        assert_eq!(parse_segment_name(&segment_name(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_segment_name("wal-12.log"), None);
        assert_eq!(parse_segment_name("tbl-00000000000000000001.sst"), None);
    }
}
