//! A stable-toolchain fuzzer for every decoder of untrusted bytes (no nightly here, so no
//! libFuzzer): for each target it builds a corpus of valid encodings, mutates them with a seeded
//! generator (bit flips, byte sets, interesting values over length fields, truncations,
//! extensions, splices, range copies and deletions), feeds each mutant to the decoder, and
//! checks that the decoder returns (an error or a value whose accessors work) instead of
//! panicking, and that it allocates at most a bound proportional to its input.
//!
//! ```text
//! cargo run --release --example fuzz -- --target all --inputs 10000000
//! cargo run --release --example fuzz -- --target table --inputs 20000 --seed 7
//! ```
//!
//! Targets: `wal` (a WAL segment scan and the commands in it), `command`, `block`, `table`
//! (footer, index, bloom filter, props and blocks), `manifest`, `message` (the rkyv archive),
//! `publish` (a Cap'n Proto publish request through `rpc::read_publish_batch`) and `raft`
//! (`cluster::record::RaftRecord`). Inputs in `fuzz/regressions/<target>/` (one file each,
//! found earlier) are replayed first. A panicking input is written to
//! `fuzz/findings/<target>-<n>.bin` and printed in hex; the run exits non-zero if any was found.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use pinq::cluster::record::RaftRecord;
use pinq::key::{EventKey, TopicHash};
use pinq::log::header::{encode_segment_header, SegmentHeader};
use pinq::log::recovery::scan_segment;
use pinq::log::wal::{decode_frame, encode_record, Frame};
use pinq::log::Command;
use pinq::message::{Header, StoredMessage, Value};
use pinq::rpc::pinq_capnp::broker;
use pinq::rpc::{read_publish_batch, write_publish_batch, PublishLimits, PublishMessage};
use pinq::storage::manifest::{Manifest, TableEntry};
use pinq::storage::table::block::{Block, EntryRef};
use pinq::storage::table::reader::decode_table_bytes;
use pinq::storage::table::TableBuilder;

// ---------------------------------------------------------------------------------------------
// Allocation accounting: the bytes one decode allocates, against a bound.

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
/// A single allocation above this aborts the run (it would exhaust memory first).
const ALLOCATION_ABORT_BYTES: usize = 1 << 30;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size.saturating_sub(layout.size()));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[inline]
fn note(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCATED.fetch_add(bytes, Ordering::Relaxed);
        LARGEST.fetch_max(bytes, Ordering::Relaxed);
        if bytes > ALLOCATION_ABORT_BYTES {
            // Printing would allocate: a fixed message, then stop.
            let msg = b"fuzz: a decoder asked for more than 1 GiB in one allocation; aborting\n";
            unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
            std::process::abort();
        }
    }
}

/// Inputs a decoder accepted (how far past the checks mutants get).
static ACCEPTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn accepted() {
    ACCEPTED.fetch_add(1, Ordering::Relaxed);
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// What one decode may allocate: a small multiple of its input, plus fixed slack.
fn allocation_bound(input_len: usize) -> usize {
    64 * input_len + (256 << 10)
}

// ---------------------------------------------------------------------------------------------
// Targets

struct Target {
    name: &'static str,
    corpus: fn(&mut fastrand::Rng) -> Vec<Vec<u8>>,
    decode: fn(&[u8]),
    /// Recomputes the checksums a mutant broke, so half the mutants reach the checks behind
    /// the checksum instead of all dying at it.
    reseal: fn(&mut [u8]),
}

const TARGETS: &[Target] = &[
    Target {
        name: "wal",
        corpus: corpus_wal,
        decode: decode_wal,
        reseal: reseal_wal,
    },
    Target {
        name: "command",
        corpus: corpus_command,
        decode: decode_command,
        reseal: reseal_command,
    },
    Target {
        name: "block",
        corpus: corpus_block,
        decode: decode_block,
        reseal: reseal_trailing,
    },
    Target {
        name: "table",
        corpus: corpus_table,
        decode: decode_table,
        reseal: reseal_footer,
    },
    Target {
        name: "manifest",
        corpus: corpus_manifest,
        decode: decode_manifest,
        reseal: reseal_trailing,
    },
    Target {
        name: "message",
        corpus: corpus_message,
        decode: decode_message,
        reseal: reseal_none,
    },
    Target {
        name: "publish",
        corpus: corpus_publish,
        decode: decode_publish,
        reseal: reseal_none,
    },
    Target {
        name: "raft",
        corpus: corpus_raft,
        decode: decode_raft,
        reseal: reseal_none,
    },
];

fn reseal_none(_: &mut [u8]) {}

/// `body | crc32c(body)`: blocks and the manifest.
fn reseal_trailing(bytes: &mut [u8]) {
    if let Some(split) = bytes.len().checked_sub(4) {
        let crc = crc32c::crc32c(&bytes[..split]);
        bytes[split..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// A table's footer: its last 52 bytes end with the crc32c of the 48 before.
fn reseal_footer(bytes: &mut [u8]) {
    if let Some(start) = bytes.len().checked_sub(52) {
        reseal_trailing(&mut bytes[start..]);
    }
}

/// `crc32c(rest) | rest`: a command.
fn reseal_command(bytes: &mut [u8]) {
    if bytes.len() >= 4 {
        let crc = crc32c::crc32c(&bytes[4..]);
        bytes[..4].copy_from_slice(&crc.to_le_bytes());
    }
}

/// The first WAL record (`len u32 | crc u32 | seq u64 | command`) and the command in it.
fn reseal_wal(bytes: &mut [u8]) {
    let Some(len) = bytes.get(..4) else { return };
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let Some(end) = len.checked_add(16).filter(|&end| end <= bytes.len()) else {
        return;
    };
    reseal_command(&mut bytes[16..end]);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes[..4]), &bytes[8..end]);
    bytes[4..8].copy_from_slice(&crc.to_le_bytes());
}

fn stored(rng: &mut fastrand::Rng) -> StoredMessage {
    StoredMessage {
        topic: ["orders", "t", "payments/eu"][rng.usize(0..3)].into(),
        payload: (0..rng.usize(0..64)).map(|_| rng.u8(..)).collect(),
        enqueued_at_ms: rng.u64(..1 << 42),
        delay_ms: rng.u64(0..100_000),
        ttl_ms: [0, 60_000][rng.usize(0..2)],
        headers: (0..rng.usize(0..3))
            .map(|i| Header {
                key: format!("h{i}"),
                value: (0..rng.usize(0..8)).map(|_| rng.u8(..)).collect(),
            })
            .collect(),
    }
}

fn event_key(rng: &mut fastrand::Rng) -> EventKey {
    EventKey::new(
        TopicHash(rng.u64(..1 << 63)),
        rng.u64(..1 << 40),
        rng.u64(..),
    )
}

fn command(rng: &mut fastrand::Rng) -> Command {
    if rng.u8(..) < 40 {
        return Command::GroupPolicy {
            topic: "t".repeat(rng.usize(1..20)),
            group: "g".repeat(rng.usize(0..20)),
            policy: pinq::pipeline::policy::PolicyOverride {
                max_deliveries: rng.bool().then(|| rng.u32(..)),
                dead_letter_topic: rng.bool().then(|| "d".repeat(rng.usize(0..20))),
                backoff: rng.bool().then(|| {
                    let initial = rng.u64(1..1000);
                    pinq::pipeline::policy::Backoff::new(initial, initial + rng.u64(..1000)).ok()
                }),
            },
        };
    }
    let messages = |rng: &mut fastrand::Rng| {
        (0..rng.usize(0..5))
            .map(|_| {
                let value = Value::encode(&stored(rng)).expect("encode");
                (event_key(rng), value)
            })
            .collect()
    };
    match rng.u8(0..4) {
        3 => {
            let id = |rng: &mut fastrand::Rng| pinq::log::copies::CopyId {
                key: event_key(rng),
                group: rng.u64(..),
            };
            Command::Copies {
                records: (0..rng.usize(0..4))
                    .map(|_| pinq::log::copies::CopyRecord {
                        id: id(rng),
                        attempts: rng.u32(..),
                        acked: rng.bool(),
                    })
                    .collect(),
                deleted: (0..rng.usize(0..4)).map(|_| event_key(rng)).collect(),
                dropped: (0..rng.usize(0..4)).map(|_| id(rng)).collect(),
            }
        }
        0 => Command::Store {
            messages: messages(rng),
            event_id_high_water: rng.u64(..),
        },
        1 => Command::StoreSequenced {
            messages: messages(rng),
            event_id_high_water: rng.u64(..),
            remember: (0..rng.usize(0..4))
                .map(|_| pinq::log::sequences::SequenceEntry {
                    producer: std::sync::Arc::from("p".repeat(rng.usize(1..40)).as_str()),
                    sequence: rng.u64(..),
                    tag: event_key(rng),
                    stored_at_ms: rng.u64(..),
                })
                .collect(),
            forget: (0..rng.usize(0..4)).map(|_| rng.u64(..)).collect(),
        },
        _ => Command::Delete {
            keys: (0..rng.usize(0..8)).map(|_| event_key(rng)).collect(),
        },
    }
}

fn corpus_command(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    (0..32)
        .map(|_| {
            let mut out = Vec::new();
            command(rng).encode(&mut out);
            out
        })
        .collect()
}

fn decode_command(bytes: &[u8]) {
    // A decoded command's values are untrusted too: checking them must not panic.
    if let Ok(command) = Command::decode(bytes) {
        accepted();
        walk_command(&command);
    }
}

fn walk_command(command: &Command) {
    match command {
        Command::Store { messages, .. } | Command::StoreSequenced { messages, .. } => {
            for (key, value) in messages {
                let _ = key.to_key();
                let _ = value.message();
            }
        }
        Command::GroupPolicy { topic, group, .. } => {
            // A decoded policy must round-trip: the store keeps its encoding as the value.
            let _ = Command::policy_key(topic, group);
            assert_eq!(Command::decode(&command.to_bytes()).as_ref(), Ok(command));
        }
        Command::Delete { .. } => {}
        Command::Copies { .. } => {
            // Records round-trip through the store's rows as through the command.
            command.for_each_op(|key, value| {
                if let (Some(id), Some(value)) =
                    (pinq::log::copies::CopyId::from_store_key(&key), value)
                {
                    let record = pinq::log::copies::CopyRecord::from_row(&key, value.as_bytes());
                    assert_eq!(record.map(|r| r.id), Ok(id));
                }
            });
        }
    }
    command.for_each_op(|key, value| {
        let _ = (key.len(), value.map(|v| v.len()));
    });
}

fn corpus_wal(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    (0..16)
        .map(|_| {
            let first = rng.u64(1..1000);
            // Half with a segment header (records from its end), half of the older format.
            let mut out = if rng.bool() {
                encode_segment_header(&SegmentHeader {
                    first_seq: first,
                    written_bytes: rng.u64(0..64 << 10),
                })
            } else {
                Vec::new()
            };
            for seq in first..first + rng.u64(1..5) {
                encode_record(seq, &command(rng), &mut out).expect("record");
                if rng.bool() {
                    // Padding to the next 4 KiB boundary, as a group commit leaves it.
                    out.resize(out.len().div_ceil(4096) * 4096, 0);
                }
            }
            out
        })
        .collect()
}

fn decode_wal(bytes: &[u8]) {
    let first_seq = bytes
        .get(8..16)
        .map_or(1, |s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])));
    if scan_segment(bytes, first_seq, true).is_ok_and(|scan| !scan.records.is_empty()) {
        accepted();
    }
    let _ = scan_segment(bytes, first_seq, false);
    let mut at = 0;
    while at < bytes.len() {
        match decode_frame(&bytes[at..]) {
            Ok(Frame::Record(record, len)) => {
                if let Ok(command) = Command::decode(record.payload) {
                    walk_command(&command);
                }
                at += len;
            }
            Ok(Frame::Padding) => at = (at / 4096 + 1) * 4096,
            Err(_) => break,
        }
    }
}

fn table_bytes(rng: &mut fastrand::Rng) -> Vec<u8> {
    let mut builder = TableBuilder::new(256, 10);
    let mut keys: Vec<Vec<u8>> = (0..rng.usize(1..40))
        .map(|_| event_key(rng).to_key().to_vec())
        .collect();
    keys.sort();
    keys.dedup();
    let value = Value::encode(&stored(rng)).expect("encode");
    let mut out = Vec::new();
    for key in &keys {
        let entry = if rng.u8(0..4) == 0 {
            EntryRef::Tombstone
        } else {
            EntryRef::Put(value.as_bytes())
        };
        builder.add(key, entry, None).expect("add");
        out.extend(builder.take_output());
    }
    out.extend(builder.finish().0);
    out
}

fn corpus_table(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    (0..16).map(|_| table_bytes(rng)).collect()
}

fn decode_table(bytes: &[u8]) {
    if let Ok((meta, blocks)) = decode_table_bytes(bytes) {
        accepted();
        let _ = meta.bloom.may_contain(b"key");
        for block in &blocks {
            walk_block(block);
        }
    }
}

fn walk_block(block: &Block) {
    for i in 0..block.len() {
        let key = block.key(i);
        let _ = block.entry(i);
        let _ = block.find(key);
    }
    let _ = block.seek(b"\x01");
}

fn corpus_block(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    let mut blocks = Vec::new();
    for table in corpus_table(rng) {
        if let Ok((meta, _)) = decode_table_bytes(&table) {
            for entry in meta.index.iter().take(3) {
                let start = entry.handle.offset as usize;
                blocks.push(table[start..start + entry.handle.len as usize].to_vec());
            }
        }
    }
    blocks
}

fn decode_block(bytes: &[u8]) {
    if let Ok(block) = Block::decode(bytes.to_vec()) {
        accepted();
        walk_block(&block);
    }
}

fn corpus_manifest(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    (0..16)
        .map(|_| {
            let next_table_id = rng.u64(10..1000);
            let mut ids: Vec<u64> = (0..rng.u64(0..8))
                .map(|_| rng.u64(..next_table_id))
                .collect();
            ids.sort_unstable();
            ids.dedup();
            Manifest {
                next_table_id,
                applied_index: rng.u64(..),
                event_id_high_water: rng.u64(..),
                tables: ids
                    .into_iter()
                    .map(|id| TableEntry {
                        id,
                        file_len: rng.u64(..1 << 30),
                    })
                    .collect(),
            }
            .encode()
        })
        .collect()
}

fn decode_manifest(bytes: &[u8]) {
    if Manifest::decode(bytes).is_ok() {
        accepted();
    }
}

fn corpus_message(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    (0..32)
        .map(|_| {
            Value::encode(&stored(rng))
                .expect("encode")
                .as_bytes()
                .to_vec()
        })
        .collect()
}

fn decode_message(bytes: &[u8]) {
    let value = Value::copy_from_slice(bytes);
    if let Ok(m) = value.message() {
        accepted();
        let _ = m.topic.as_str().len() + m.payload.len() + m.headers.len();
        for h in m.headers.iter() {
            let _ = h.key.as_str().len() + h.value.len();
        }
        let _ = m.expires_at_ms();
        let _ = value.decode();
    }
}

fn limits() -> PublishLimits {
    PublishLimits {
        message_bytes_max: 1 << 20,
        batch_len_max: 1000,
    }
}

fn corpus_publish(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    (0..16)
        .map(|_| {
            let messages: Vec<PublishMessage> = (0..rng.usize(0..5))
                .map(|_| {
                    let s = stored(rng);
                    PublishMessage {
                        topic: s.topic,
                        payload: s.payload,
                        delay_ms: s.delay_ms,
                        ttl_ms: s.ttl_ms,
                        headers: s.headers,
                        producer_id: if rng.bool() {
                            String::new()
                        } else {
                            "p".repeat(rng.usize(1..=255))
                        },
                        sequence: rng.u64(..),
                    }
                })
                .collect();
            let mut message = capnp::message::Builder::new_default();
            let params = message.init_root::<broker::publish_params::Builder>();
            let list = params.init_messages(messages.len() as u32);
            write_publish_batch(list, &messages).expect("write batch");
            let mut out = Vec::new();
            capnp::serialize::write_message(&mut out, &message).expect("serialize");
            out
        })
        .collect()
}

/// The reader options the server itself reads client requests with (`server::limits`), for the
/// default `[publish]` limits: the target sees exactly what a client's bytes meet. A list of
/// zero-sized header structs costs no bytes but one word of traversal each; with these options
/// alone a 600-byte request once made `read_publish_batch` allocate 150 MB, until the reader
/// bounded the header count (`fuzz/regressions/publish/`).
fn publish_reader_options() -> capnp::message::ReaderOptions {
    pinq::server::limits::reader_options(&pinq::config::PublishConfig::default())
}

fn decode_publish(bytes: &[u8]) {
    let mut slice = bytes;
    let Ok(reader) =
        capnp::serialize::read_message_from_flat_slice(&mut slice, publish_reader_options())
    else {
        return;
    };
    let Ok(params) = reader.get_root::<broker::publish_params::Reader>() else {
        return;
    };
    let _ = params.get_ack_level();
    if let Ok(list) = params.get_messages() {
        if let Ok(batch) = read_publish_batch(list, &limits()) {
            accepted();
            for m in &batch {
                let _ = m.to_owned_message();
            }
        }
    }
}

/// A membership with a few random ids in each list.
fn random_conf(rng: &mut fastrand::Rng) -> raft::eraftpb::ConfState {
    let mut ids = |n: usize| -> Vec<u64> { (0..rng.usize(0..n)).map(|_| rng.u64(1..9)).collect() };
    raft::eraftpb::ConfState {
        voters: ids(5),
        learners: ids(3),
        voters_outgoing: ids(4),
        learners_next: ids(2),
        auto_leave: false,
        ..raft::eraftpb::ConfState::default()
    }
}

fn corpus_raft(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    use pinq::log::wal::Payload;
    use raft::eraftpb::{Entry, HardState};
    (0..24)
        .map(|_| {
            let hard_state = HardState {
                term: rng.u64(..100),
                vote: rng.u64(..5),
                commit: rng.u64(..1000),
                ..HardState::default()
            };
            let record = match rng.u8(0..5) {
                0 => {
                    let first = rng.u64(1..1000);
                    RaftRecord::Entries {
                        hard_state,
                        entries: (first..first + rng.u64(0..4))
                            .map(|index| {
                                let data: Vec<u8> =
                                    (0..rng.usize(0..40)).map(|_| rng.u8(..)).collect();
                                Entry {
                                    index,
                                    term: rng.u64(..100),
                                    data: data.into(),
                                    ..Entry::default()
                                }
                            })
                            .collect(),
                    }
                }
                1 => RaftRecord::HardState(hard_state),
                2 => RaftRecord::Conf {
                    index: rng.u64(..1000),
                    conf_state: random_conf(rng),
                },
                3 => RaftRecord::Checkpoint {
                    index: rng.u64(..1000),
                    term: rng.u64(..100),
                    hard_state,
                    conf: Some(random_conf(rng)),
                },
                _ => RaftRecord::Checkpoint {
                    index: rng.u64(..1000),
                    term: rng.u64(..100),
                    hard_state,
                    conf: None,
                },
            };
            let mut out = Vec::new();
            record.encode_into(&mut out);
            out
        })
        .collect()
}

fn decode_raft(bytes: &[u8]) {
    if let Ok(record) = RaftRecord::decode(bytes) {
        accepted();
        let _ = record.last_index();
    }
}

// ---------------------------------------------------------------------------------------------
// Mutation

const INTERESTING_U32: &[u32] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    255,
    256,
    4095,
    4096,
    0x7FFF,
    0xFFFF,
    0x1_0000,
    0x7FFF_FFFF,
    0x8000_0000,
    0xFFFF_FFFE,
    0xFFFF_FFFF,
];

fn mutate(rng: &mut fastrand::Rng, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    for _ in 0..rng.usize(1..5) {
        let len = input.len();
        match rng.u8(0..10) {
            0 | 1 if len > 0 => {
                let i = rng.usize(0..len);
                input[i] ^= 1 << rng.u8(0..8);
            }
            2 if len > 0 => {
                let i = rng.usize(0..len);
                input[i] = [0, 0xFF, 0x7F, 0x80, 1, rng.u8(..)][rng.usize(0..6)];
            }
            // An interesting value over what may be a length or count field.
            3 | 4 if len >= 4 => {
                let v = INTERESTING_U32[rng.usize(0..INTERESTING_U32.len())];
                let v = if rng.bool() {
                    v
                } else {
                    v.wrapping_add(len as u32)
                };
                let width = [1usize, 2, 4, 8][rng.usize(0..4)].min(len);
                let i = rng.usize(0..=len - width);
                let bytes = u64::from(v).to_le_bytes();
                input[i..i + width].copy_from_slice(&bytes[..width]);
            }
            5 if len > 0 => input.truncate(rng.usize(0..len)),
            6 => {
                let extra = rng.usize(1..64);
                input.extend((0..extra).map(|_| if rng.bool() { 0 } else { rng.u8(..) }));
            }
            // Splice: a prefix of this one and a suffix of another.
            7 if !corpus.is_empty() => {
                let other = &corpus[rng.usize(0..corpus.len())];
                let cut = rng.usize(0..=len);
                let from = rng.usize(0..=other.len());
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            // Copy a range over another place.
            8 if len > 1 => {
                let a = rng.usize(0..len);
                let n = rng.usize(1..=(len - a).min(64));
                let b = rng.usize(0..len);
                let chunk: Vec<u8> = input[a..a + n].to_vec();
                for (k, byte) in chunk.into_iter().enumerate() {
                    if let Some(slot) = input.get_mut(b + k) {
                        *slot = byte;
                    }
                }
            }
            9 if len > 1 => {
                let a = rng.usize(0..len);
                let n = rng.usize(1..=(len - a).min(64));
                input.drain(a..a + n);
            }
            _ => {}
        }
    }
    // Keep inputs small: decoders are checked for bounds, not throughput.
    input.truncate(64 << 10);
}

// ---------------------------------------------------------------------------------------------
// Runner

thread_local! {
    static LAST_PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

#[derive(Default)]
struct Findings {
    panics: u64,
    over_allocations: u64,
    largest_allocation: usize,
}

/// Runs one input; returns the panic message, if it panicked, and the bytes it allocated.
fn run_one(decode: fn(&[u8]), input: &[u8]) -> (Option<String>, usize) {
    ALLOCATED.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let result = std::panic::catch_unwind(|| decode(input));
    COUNTING.store(false, Ordering::Relaxed);
    let allocated = ALLOCATED.load(Ordering::Relaxed);
    let panic = result
        .err()
        .map(|_| LAST_PANIC.with(|p| std::mem::take(&mut *p.borrow_mut())));
    (panic, allocated)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn record_finding(target: &str, what: &str, input: &[u8], n: u64) {
    let dir = Path::new("fuzz/findings");
    let _ = std::fs::create_dir_all(dir);
    let path = dir.join(format!("{target}-{n}.bin"));
    let _ = std::fs::write(&path, input);
    eprintln!(
        "fuzz {target}: {what}; input ({} bytes) saved to {}: {}",
        input.len(),
        path.display(),
        hex(&input[..input.len().min(256)])
    );
}

fn regressions(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, Vec<u8>)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read(e.path()).ok().map(|b| (e.path(), b)))
        .collect();
    out.sort();
    out
}

fn fuzz(target: &Target, inputs: u64, seed: u64) -> Findings {
    let mut rng = fastrand::Rng::with_seed(seed);
    let corpus = (target.corpus)(&mut rng);
    let mut findings = Findings::default();
    let check = |input: &[u8], findings: &mut Findings| {
        let (panic, allocated) = run_one(target.decode, input);
        findings.largest_allocation = findings.largest_allocation.max(allocated);
        if let Some(message) = panic {
            findings.panics += 1;
            if findings.panics <= 5 {
                record_finding(
                    target.name,
                    &format!("panic: {message}"),
                    input,
                    findings.panics,
                );
            }
        } else if allocated > allocation_bound(input.len()) {
            findings.over_allocations += 1;
            if findings.over_allocations <= 5 {
                let what = format!(
                    "allocated {allocated} bytes for {} input bytes (bound {})",
                    input.len(),
                    allocation_bound(input.len())
                );
                record_finding(target.name, &what, input, 100 + findings.over_allocations);
            }
        }
    };
    for (path, input) in regressions(target.name) {
        let before = findings.panics + findings.over_allocations;
        check(&input, &mut findings);
        if findings.panics + findings.over_allocations > before {
            eprintln!(
                "fuzz {}: regression {} fails again",
                target.name,
                path.display()
            );
        }
    }
    for input in &corpus {
        check(input, &mut findings);
    }
    let mut current = Vec::new();
    for i in 0..inputs {
        // Mostly fresh mutants of the corpus; sometimes keep mutating the last one, to wander
        // further from valid encodings.
        if i % 8 != 0 || current.is_empty() {
            current.clear();
            current.extend_from_slice(&corpus[rng.usize(0..corpus.len())]);
        }
        mutate(&mut rng, &mut current, &corpus);
        if rng.bool() {
            (target.reseal)(&mut current);
        }
        check(&current, &mut findings);
    }
    findings
}

struct Args {
    targets: Vec<&'static Target>,
    inputs: u64,
    seed: u64,
}

fn args() -> Result<Args, String> {
    let mut target = "all".to_string();
    let mut inputs = 100_000u64;
    let mut seed = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--target" => target = value()?,
            "--inputs" => inputs = value()?.parse().map_err(|e| format!("--inputs: {e}"))?,
            "--seed" => seed = Some(value()?.parse().map_err(|e| format!("--seed: {e}"))?),
            other => {
                return Err(format!(
                    "unknown argument {other} (use --target, --inputs, --seed)"
                ))
            }
        }
    }
    let targets: Vec<&'static Target> = if target == "all" {
        TARGETS.iter().collect()
    } else {
        target
            .split(',')
            .map(|name| {
                TARGETS.iter().find(|t| t.name == name).ok_or_else(|| {
                    let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
                    format!("unknown target {name}; targets: all, {}", names.join(", "))
                })
            })
            .collect::<Result<_, _>>()?
    };
    Ok(Args {
        targets,
        inputs,
        seed: seed.unwrap_or_else(|| fastrand::u64(..)),
    })
}

fn main() {
    let args = match args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("fuzz: {e}");
            std::process::exit(2);
        }
    };
    std::panic::set_hook(Box::new(|info| {
        let message = info.to_string();
        LAST_PANIC.with(|p| *p.borrow_mut() = message);
    }));
    println!(
        "fuzz seed {} ({} inputs per target); replay with --seed {}",
        args.seed, args.inputs, args.seed
    );
    let mut failed = false;
    for target in &args.targets {
        ACCEPTED.store(0, Ordering::Relaxed);
        let started = Instant::now();
        let findings = fuzz(target, args.inputs, args.seed);
        let secs = started.elapsed().as_secs_f64();
        println!(
            "{:<9} {:>11} inputs in {:>7.1} s ({:>9.0}/s), {:>5.1}% accepted: {} panics, {} over the allocation bound, largest decode allocated {} bytes",
            target.name,
            args.inputs,
            secs,
            args.inputs as f64 / secs.max(1e-9),
            100.0 * ACCEPTED.load(Ordering::Relaxed) as f64 / args.inputs.max(1) as f64,
            findings.panics,
            findings.over_allocations,
            findings.largest_allocation
        );
        failed |= findings.panics > 0 || findings.over_allocations > 0;
    }
    if failed {
        std::process::exit(1);
    }
}
