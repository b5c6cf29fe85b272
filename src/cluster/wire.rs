//! The node-to-node codec: raft-rs's `eraftpb::Message` to and from `schema/replication.capnp`,
//! the handshake (`Hello`, `HelloReply`) as plain Rust values, the check of a peer's `Hello`
//! against ours, and the arithmetic of the stream framing.
//!
//! Pure: no I/O, no clock, no state. The transport (`super::transport`) calls it to fill its write
//! buffer and to read what a peer sent; tests call it directly. Raft's protobuf types stay off the
//! wire (the protobuf codec is only the in-memory representation raft-rs 0.7 gives us): every
//! field is copied into Cap'n Proto by name, so a change of raft's protobuf numbering could not
//! silently change the protocol.
//!
//! Every reader treats its bytes as hostile: a frame's size is checked from its segment table
//! before anything is allocated for it ([`frame_bytes`]), the Cap'n Proto reader's traversal limit
//! is the same `cluster.maxFrameBytes`, and every failure is a [`WireError`], never a panic.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;

use capnp::message::{Builder, HeapAllocator, ReaderOptions};
use capnp::serialize;
use raft::eraftpb::{
    ConfState, Entry, EntryType as RaftEntryType, Message, MessageType as RaftMessageType, Snapshot,
};

use crate::config::ClusterConfig;
use crate::rpc::replication_capnp::{
    conf_state, entry, frame, hello, hello_reply, raft_message, snapshot, EntryType, MessageType,
    RefusalReason as WireRefusalReason, REPLICATION_VERSION,
};

/// The replication protocol version this build speaks (`replicationVersion` in the schema).
pub const PROTOCOL_VERSION: u32 = REPLICATION_VERSION;

/// Bytes of the first word of a frame: the segment count and the first segment's size.
pub const FRAME_PREFIX_BYTES: usize = 8;

/// Most segments a frame may have. Our writer produces one or a few (the builder grows its first
/// segment); the Cap'n Proto library itself refuses 512 or more.
pub const FRAME_SEGMENTS_MAX: usize = 64;

/// Why bytes from a peer could not be read, or a value could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("malformed Cap'n Proto message: {0}")]
    Capnp(#[from] capnp::Error),
    #[error("{field} has an unknown value {value} (a newer peer?)")]
    UnknownEnumerant { field: &'static str, value: u16 },
    #[error("{field} is not valid UTF-8")]
    NotUtf8 { field: &'static str },
    #[error("{field} is \"{text}\", not an IP:port address")]
    BadAddress { field: &'static str, text: String },
    #[error("frame announces {count} segments, at most {FRAME_SEGMENTS_MAX} are accepted")]
    SegmentCount { count: u64 },
    #[error("frame of {bytes} bytes is larger than cluster.maxFrameBytes ({max} bytes)")]
    FrameTooLarge { bytes: u64, max: usize },
    #[error("frame is {got} bytes, its segment table announces {needed}")]
    Truncated { needed: usize, got: usize },
    #[error("{field} holds {len} items, more than a Cap'n Proto list can")]
    ListTooLong { field: &'static str, len: usize },
    #[error("{field}: node id 0 is not a node")]
    ZeroNodeId { field: &'static str },
    #[error("the peer speaks TLS (a TLS record where a frame was expected): it has [cluster.tls], this node does not")]
    TlsRecord,
    #[error("refusal reason {reason} is local to a node and never sent")]
    LocalReason { reason: RefusalReason },
    #[error("the connection does not start with a pinq preamble (bytes {bytes:02x?}; a peer of another replication protocol version?)")]
    BadPreamble { bytes: [u8; PREAMBLE_BYTES] },
}

// ---------------------------------------------------------------------------------------------
// Framing

/// Reader options for frames of at most `max_frame_bytes`: the traversal limit is the frame's
/// size in words, so no frame can make the reader walk more than it holds (never capnp's 64 MiB
/// default, which is not ours to pick).
pub fn reader_options(max_frame_bytes: usize) -> ReaderOptions {
    let mut options = ReaderOptions::new();
    options.traversal_limit_in_words(Some(max_frame_bytes.div_ceil(8)));
    options
}

/// From a frame's first word, the length of its whole segment table in bytes (the first word
/// included; always a multiple of 8). The transport reads that many bytes before
/// [`frame_bytes`].
pub fn segment_table_bytes(prefix: [u8; FRAME_PREFIX_BYTES]) -> Result<usize, WireError> {
    let count = u64::from(u32::from_le_bytes([
        prefix[0], prefix[1], prefix[2], prefix[3],
    ])) + 1;
    if count > FRAME_SEGMENTS_MAX as u64 {
        // Either way the frame is refused; a TLS record's header (content type 20..=23, major
        // version 3) says why, for a node without [cluster.tls] talking to one with it.
        if (20..=23).contains(&prefix[0]) && prefix[1] == 3 {
            return Err(WireError::TlsRecord);
        }
        return Err(WireError::SegmentCount { count });
    }
    // 4 bytes of count, 4 per segment, padded to a word.
    let count = count as usize;
    Ok((4 + 4 * count).div_ceil(8) * 8)
}

/// The length in bytes of the whole frame (segment table and segments) whose segment table is
/// `table` (as long as [`segment_table_bytes`] said); refused when over `max_frame_bytes`, before
/// the transport reserves anything for the body.
pub fn frame_bytes(table: &[u8], max_frame_bytes: usize) -> Result<usize, WireError> {
    if table.len() < FRAME_PREFIX_BYTES {
        return Err(WireError::Truncated {
            needed: FRAME_PREFIX_BYTES,
            got: table.len(),
        });
    }
    let mut prefix = [0u8; FRAME_PREFIX_BYTES];
    prefix.copy_from_slice(&table[..FRAME_PREFIX_BYTES]);
    let table_len = segment_table_bytes(prefix)?;
    if table.len() < table_len {
        return Err(WireError::Truncated {
            needed: table_len,
            got: table.len(),
        });
    }
    let count = (u32::from_le_bytes([table[0], table[1], table[2], table[3]]) as usize) + 1;
    let words: u64 = (0..count)
        .map(|i| {
            let at = 4 + 4 * i;
            u64::from(u32::from_le_bytes([
                table[at],
                table[at + 1],
                table[at + 2],
                table[at + 3],
            ]))
        })
        .sum();
    let total = table_len as u64 + words * 8;
    if total > max_frame_bytes as u64 {
        return Err(WireError::FrameTooLarge {
            bytes: total,
            max: max_frame_bytes,
        });
    }
    // Below max_frame_bytes, which is a usize.
    Ok(total as usize)
}

/// Runs `read` on `bytes` aligned to a word, as the Cap'n Proto reader requires: in place when
/// they are (the transport reads into a buffer of `capnp::Word`s), else on an aligned copy.
fn with_aligned<T>(
    bytes: &[u8],
    read: impl FnOnce(&[u8]) -> Result<T, WireError>,
) -> Result<T, WireError> {
    if (bytes.as_ptr() as usize) % 8 == 0 {
        return read(bytes);
    }
    let mut words = capnp::Word::allocate_zeroed_vec(bytes.len().div_ceil(8));
    let aligned = capnp::Word::words_to_bytes_mut(&mut words);
    aligned[..bytes.len()].copy_from_slice(bytes);
    read(&aligned[..bytes.len()])
}

/// Reads one framed message from the start of `bytes` (aligned to a word), which must hold the
/// whole frame as [`frame_bytes`] measures it.
fn read_frame(
    bytes: &[u8],
    max_frame_bytes: usize,
) -> Result<capnp::message::Reader<serialize::NoAllocSliceSegments<'_>>, WireError> {
    let total = frame_bytes(bytes, max_frame_bytes)?;
    if bytes.len() < total {
        return Err(WireError::Truncated {
            needed: total,
            got: bytes.len(),
        });
    }
    let mut slice = &bytes[..total];
    Ok(serialize::read_message_from_flat_slice_no_alloc(
        &mut slice,
        reader_options(max_frame_bytes),
    )?)
}

/// Appends `builder` to `out` in the stream framing.
fn write_frame(builder: &Builder<HeapAllocator>, out: &mut Vec<u8>) -> Result<(), WireError> {
    serialize::write_message(out, builder)?;
    Ok(())
}

fn list_len(field: &'static str, len: usize) -> Result<u32, WireError> {
    u32::try_from(len).map_err(|_| WireError::ListTooLong { field, len })
}

fn text<'a>(reader: capnp::text::Reader<'a>, field: &'static str) -> Result<&'a str, WireError> {
    reader.to_str().map_err(|_| WireError::NotUtf8 { field })
}

fn address(text: &str, field: &'static str) -> Result<SocketAddr, WireError> {
    text.parse().map_err(|_| WireError::BadAddress {
        field,
        text: text.chars().take(64).collect(),
    })
}

// ---------------------------------------------------------------------------------------------
// Preamble

/// Bytes of the preamble a dialer writes before anything else (before TLS).
pub const PREAMBLE_BYTES: usize = 8;
/// The preamble's first four bytes (the 2 is [`PROTOCOL_VERSION`]: a version-1 node sends a
/// frame's segment table there instead).
pub const PREAMBLE_MAGIC: [u8; 4] = *b"PQR2";

/// The preamble of a connection carrying shard `shard`'s traffic: the magic, then the shard index
/// in little-endian. Plaintext, so that the listening core can hand the socket to the shard's
/// core before any TLS state exists; the `Hello` repeats the shard under TLS ([`check_hello`]).
pub fn encode_preamble(shard: u32) -> [u8; PREAMBLE_BYTES] {
    let mut bytes = [0u8; PREAMBLE_BYTES];
    bytes[..4].copy_from_slice(&PREAMBLE_MAGIC);
    bytes[4..].copy_from_slice(&shard.to_le_bytes());
    bytes
}

/// The shard index a preamble names (not checked against the shards this node runs: the
/// caller knows how many it runs).
pub fn decode_preamble(bytes: [u8; PREAMBLE_BYTES]) -> Result<u32, WireError> {
    if bytes[..4] != PREAMBLE_MAGIC {
        return Err(WireError::BadPreamble { bytes });
    }
    Ok(u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]))
}

// ---------------------------------------------------------------------------------------------
// Handshake

/// A node's introduction, the first message each way on a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The sender's [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The sender's `cluster.nodeId`.
    pub node_id: u64,
    /// The sender's `cluster.advertise`, where clients reach it.
    pub client_addr: String,
    /// The sender's own entry in `members`.
    pub raft_addr: SocketAddr,
    /// Shards the sender runs.
    pub shard_count: u32,
    /// The sender's `cluster.peers`.
    pub members: BTreeMap<u64, SocketAddr>,
    /// The shard whose traffic the connection carries (the sender's).
    pub shard: u32,
}

impl Hello {
    /// This node's `Hello` on the connections of shard `shard` of `shard_count`.
    pub fn new(config: &ClusterConfig, shard_count: u32, shard: u32) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: config.node_id,
            client_addr: config.advertise.to_string(),
            // The configured address (raftListen may be a wildcard); validated to be present.
            raft_addr: config
                .peers
                .get(&config.node_id)
                .copied()
                .unwrap_or(config.raft_listen),
            shard_count,
            members: config.peers.clone(),
            shard,
        }
    }

    /// Appends this `Hello` as one frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
        let mut builder = Builder::new_default();
        let mut root = builder.init_root::<hello::Builder>();
        root.set_protocol_version(self.protocol_version);
        root.set_node_id(self.node_id);
        root.set_client_address(self.client_addr.as_str());
        root.set_raft_address(self.raft_addr.to_string().as_str());
        root.set_shard_count(self.shard_count);
        root.set_shard(self.shard);
        let mut members = root.init_members(list_len("members", self.members.len())?);
        for (i, (id, addr)) in self.members.iter().enumerate() {
            let mut member = members.reborrow().get(i as u32);
            member.set_node_id(*id);
            member.set_raft_address(addr.to_string().as_str());
        }
        write_frame(&builder, out)
    }

    /// Reads a `Hello` frame.
    pub fn decode(bytes: &[u8], max_frame_bytes: usize) -> Result<Hello, WireError> {
        with_aligned(bytes, |bytes| Hello::decode_aligned(bytes, max_frame_bytes))
    }

    fn decode_aligned(bytes: &[u8], max_frame_bytes: usize) -> Result<Hello, WireError> {
        let message = read_frame(bytes, max_frame_bytes)?;
        let root = message.get_root::<hello::Reader>()?;
        let node_id = root.get_node_id();
        if node_id == 0 {
            return Err(WireError::ZeroNodeId {
                field: "hello.nodeId",
            });
        }
        let mut members = BTreeMap::new();
        for member in root.get_members()? {
            let id = member.get_node_id();
            if id == 0 {
                return Err(WireError::ZeroNodeId {
                    field: "hello.members.nodeId",
                });
            }
            let addr = address(
                text(member.get_raft_address()?, "hello.members.raftAddress")?,
                "hello.members.raftAddress",
            )?;
            // A repeated id is kept as the last one; check_hello compares whole lists anyway.
            members.insert(id, addr);
        }
        Ok(Hello {
            protocol_version: root.get_protocol_version(),
            node_id,
            client_addr: text(root.get_client_address()?, "hello.clientAddress")?.to_owned(),
            raft_addr: address(
                text(root.get_raft_address()?, "hello.raftAddress")?,
                "hello.raftAddress",
            )?,
            shard_count: root.get_shard_count(),
            members,
            shard: root.get_shard(),
        })
    }
}

/// Why a node refused a peer at the handshake (`RefusalReason` in the schema).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RefusalReason {
    ShardCountMismatch,
    MembersMismatch,
    UnknownNode,
    VersionUnsupported,
    SameNodeId,
    /// The peer's TLS certificate names another node than its `Hello` claims.
    CertificateMismatch,
    /// The TLS handshake failed (wrong CA, no client certificate, another member's certificate
    /// on the dialing side, a peer without TLS). Local only: never in a `HelloReply`, there is
    /// no channel to send it on.
    Tls,
    /// The peer's `Hello` names another shard than the connection's, or its preamble a shard
    /// this node does not run.
    ShardMismatch,
}

impl RefusalReason {
    /// The schema's spelling, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::ShardCountMismatch => "shardCountMismatch",
            RefusalReason::MembersMismatch => "membersMismatch",
            RefusalReason::UnknownNode => "unknownNode",
            RefusalReason::VersionUnsupported => "versionUnsupported",
            RefusalReason::SameNodeId => "sameNodeId",
            RefusalReason::CertificateMismatch => "certificateMismatch",
            RefusalReason::Tls => "tls",
            RefusalReason::ShardMismatch => "shardMismatch",
        }
    }

    /// The schema's enumerant; `None` for a local-only reason.
    fn to_wire(self) -> Option<WireRefusalReason> {
        Some(match self {
            RefusalReason::ShardCountMismatch => WireRefusalReason::ShardCountMismatch,
            RefusalReason::MembersMismatch => WireRefusalReason::MembersMismatch,
            RefusalReason::UnknownNode => WireRefusalReason::UnknownNode,
            RefusalReason::VersionUnsupported => WireRefusalReason::VersionUnsupported,
            RefusalReason::SameNodeId => WireRefusalReason::SameNodeId,
            RefusalReason::CertificateMismatch => WireRefusalReason::CertificateMismatch,
            RefusalReason::ShardMismatch => WireRefusalReason::ShardMismatch,
            RefusalReason::Tls => return None,
        })
    }

    fn from_wire(reason: WireRefusalReason) -> RefusalReason {
        match reason {
            WireRefusalReason::ShardCountMismatch => RefusalReason::ShardCountMismatch,
            WireRefusalReason::MembersMismatch => RefusalReason::MembersMismatch,
            WireRefusalReason::UnknownNode => RefusalReason::UnknownNode,
            WireRefusalReason::VersionUnsupported => RefusalReason::VersionUnsupported,
            WireRefusalReason::SameNodeId => RefusalReason::SameNodeId,
            WireRefusalReason::CertificateMismatch => RefusalReason::CertificateMismatch,
            WireRefusalReason::ShardMismatch => RefusalReason::ShardMismatch,
        }
    }
}

/// A refusal: the typed reason and, for people, which values disagreed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", reason.as_str())]
pub struct HandshakeRefusal {
    pub reason: RefusalReason,
    pub detail: String,
}

/// A node's verdict on its peer's `Hello`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HelloReply {
    Accepted,
    Refused(HandshakeRefusal),
}

impl HelloReply {
    /// Appends this reply as one frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
        let mut builder = Builder::new_default();
        let mut root = builder.init_root::<hello_reply::Builder>();
        match self {
            HelloReply::Accepted => root.set_accepted(()),
            HelloReply::Refused(refusal) => {
                let reason = refusal.reason.to_wire().ok_or(WireError::LocalReason {
                    reason: refusal.reason,
                })?;
                let mut refused = root.init_refused();
                refused.set_reason(reason);
                refused.set_detail(refusal.detail.as_str());
            }
        }
        write_frame(&builder, out)
    }

    /// Reads a `HelloReply` frame.
    pub fn decode(bytes: &[u8], max_frame_bytes: usize) -> Result<HelloReply, WireError> {
        with_aligned(bytes, |bytes| {
            HelloReply::decode_aligned(bytes, max_frame_bytes)
        })
    }

    fn decode_aligned(bytes: &[u8], max_frame_bytes: usize) -> Result<HelloReply, WireError> {
        let message = read_frame(bytes, max_frame_bytes)?;
        let root = message.get_root::<hello_reply::Reader>()?;
        match root.which() {
            Ok(hello_reply::Accepted(())) => Ok(HelloReply::Accepted),
            Ok(hello_reply::Refused(refused)) => {
                let refused = refused?;
                let reason = refused.get_reason().map_err(|capnp::NotInSchema(value)| {
                    WireError::UnknownEnumerant {
                        field: "helloReply.refused.reason",
                        value,
                    }
                })?;
                Ok(HelloReply::Refused(HandshakeRefusal {
                    reason: RefusalReason::from_wire(reason),
                    detail: text(refused.get_detail()?, "helloReply.refused.detail")?.to_owned(),
                }))
            }
            Err(capnp::NotInSchema(value)) => Err(WireError::UnknownEnumerant {
                field: "helloReply",
                value,
            }),
        }
    }
}

fn members_text(members: &BTreeMap<u64, SocketAddr>) -> String {
    let listed: Vec<String> = members
        .iter()
        .map(|(id, addr)| format!("{id}={addr}"))
        .collect();
    format!("[{}]", listed.join(", "))
}

/// Whether this node (`ours`) works with the peer that sent `theirs`. Both nodes run it on each
/// other's `Hello`, so each side of a mismatch knows why; the first rule broken is reported:
/// protocol version, same id, unknown node, shard count, shard, members.
pub fn check_hello(ours: &Hello, theirs: &Hello) -> Result<(), HandshakeRefusal> {
    let refuse = |reason, detail: String| Err(HandshakeRefusal { reason, detail });
    let (us, them) = (ours.node_id, theirs.node_id);
    if theirs.protocol_version != ours.protocol_version {
        return refuse(
            RefusalReason::VersionUnsupported,
            format!(
                "node {them} speaks replication protocol version {}, node {us} speaks {}",
                theirs.protocol_version, ours.protocol_version
            ),
        );
    }
    if them == us {
        return refuse(
            RefusalReason::SameNodeId,
            format!(
                "the peer at {} says it is node {them}, which is this node's own id (two nodes configured with one cluster.nodeId?)",
                theirs.raft_addr
            ),
        );
    }
    let Some(&listed) = ours.members.get(&them) else {
        return refuse(
            RefusalReason::UnknownNode,
            format!(
                "node {them} ({}) is not a member of node {us}'s cluster, whose members are {}",
                theirs.raft_addr,
                members_text(&ours.members)
            ),
        );
    };
    if theirs.shard_count != ours.shard_count {
        return refuse(
            RefusalReason::ShardCountMismatch,
            format!(
                "node {them} runs {} shards, node {us} runs {}: every node of a cluster must run the same number (server.cpus)",
                theirs.shard_count, ours.shard_count
            ),
        );
    }
    if theirs.shard != ours.shard {
        return refuse(
            RefusalReason::ShardMismatch,
            format!(
                "node {them} sent the Hello of shard {} on a connection of shard {} of node {us}",
                theirs.shard, ours.shard
            ),
        );
    }
    // Member lists differ while a membership change spreads (and a joining node knows the
    // members it was told); what two nodes must agree on is the address of every node both
    // list.
    let conflicts: BTreeMap<u64, SocketAddr> = theirs
        .members
        .iter()
        .filter(|(id, addr)| ours.members.get(id).is_some_and(|mine| mine != *addr))
        .map(|(id, addr)| (*id, *addr))
        .collect();
    if !conflicts.is_empty() {
        return refuse(
            RefusalReason::MembersMismatch,
            format!(
                "node {them} lists members {}, node {us} lists {}: they disagree on the address of {}",
                members_text(&theirs.members),
                members_text(&ours.members),
                members_text(&conflicts)
            ),
        );
    }
    if theirs.raft_addr != listed {
        return refuse(
            RefusalReason::UnknownNode,
            format!(
                "node {them} says its Raft address is {}, the members list gives {listed}",
                theirs.raft_addr
            ),
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Raft messages

/// An upper bound of the bytes `message` takes in a frame, so the transport can cut frames below
/// `cluster.maxFrameBytes` before encoding. Conservative: every struct and pointer is counted at
/// its largest, every blob rounded up to a word.
pub fn message_bytes_estimate(message: &Message) -> usize {
    const MESSAGE_FIXED: usize = 256; // ShardMessage + RaftMessage: data words and pointers
    const ENTRY_FIXED: usize = 64;
    const SNAPSHOT_FIXED: usize = 128;
    let blob = |len: usize| len.div_ceil(8) * 8 + 8;
    let entries: usize = message
        .get_entries()
        .iter()
        .map(|e| ENTRY_FIXED + blob(e.data.len()) + blob(e.context.len()))
        .sum();
    let snapshot = if message.has_snapshot() {
        let snapshot = message.get_snapshot();
        let conf = snapshot.get_metadata().get_conf_state();
        let ids = conf.voters.len()
            + conf.learners.len()
            + conf.voters_outgoing.len()
            + conf.learners_next.len();
        SNAPSHOT_FIXED + blob(snapshot.data.len()) + 8 * ids + 32
    } else {
        0
    };
    MESSAGE_FIXED + blob(message.context.len()) + entries + snapshot
}

/// Appends one `Frame` holding `messages` (shard, message) to `out`. An empty slice makes a
/// keepalive.
pub fn encode_frame(messages: &[(u32, Message)], out: &mut Vec<u8>) -> Result<(), WireError> {
    let mut builder = Builder::new_default();
    let root = builder.init_root::<frame::Builder>();
    let mut list = root.init_messages(list_len("frame.messages", messages.len())?);
    for (i, (shard, message)) in messages.iter().enumerate() {
        let mut item = list.reborrow().get(i as u32);
        item.set_shard(*shard);
        write_message(message, item.init_message())?;
    }
    write_frame(&builder, out)
}

/// Reads a `Frame`, handing each (shard, message) to `each` in order. Nothing is handed over
/// unless the whole frame reads: a frame is refused whole.
pub fn decode_frame(
    bytes: &[u8],
    max_frame_bytes: usize,
    mut each: impl FnMut(u32, Message),
) -> Result<usize, WireError> {
    let decoded = with_aligned(bytes, |bytes| {
        let message = read_frame(bytes, max_frame_bytes)?;
        let root = message.get_root::<frame::Reader>()?;
        let list = root.get_messages()?;
        let mut decoded = Vec::with_capacity(list.len() as usize);
        for item in list {
            decoded.push((item.get_shard(), read_message(item.get_message()?)?));
        }
        Ok(decoded)
    })?;
    let count = decoded.len();
    for (shard, message) in decoded {
        each(shard, message);
    }
    Ok(count)
}

fn write_message(message: &Message, mut out: raft_message::Builder) -> Result<(), WireError> {
    out.set_msg_type(message_type_to_wire(message.msg_type));
    out.set_to(message.to);
    out.set_from(message.from);
    out.set_term(message.term);
    out.set_log_term(message.log_term);
    out.set_index(message.index);
    let entries = message.get_entries();
    let mut list = out
        .reborrow()
        .init_entries(list_len("raftMessage.entries", entries.len())?);
    for (i, e) in entries.iter().enumerate() {
        write_entry(e, list.reborrow().get(i as u32));
    }
    out.set_commit(message.commit);
    out.set_commit_term(message.commit_term);
    if message.has_snapshot() {
        write_snapshot(message.get_snapshot(), out.reborrow().init_snapshot())?;
    }
    out.set_reject(message.reject);
    out.set_reject_hint(message.reject_hint);
    out.set_context(&message.context);
    out.set_request_snapshot(message.request_snapshot);
    out.set_priority(message.priority);
    out.set_deprecated_priority(message.deprecated_priority);
    Ok(())
}

fn read_message(reader: raft_message::Reader) -> Result<Message, WireError> {
    let msg_type =
        reader
            .get_msg_type()
            .map_err(|capnp::NotInSchema(value)| WireError::UnknownEnumerant {
                field: "raftMessage.msgType",
                value,
            })?;
    let mut message = Message {
        msg_type: message_type_from_wire(msg_type),
        to: reader.get_to(),
        from: reader.get_from(),
        term: reader.get_term(),
        log_term: reader.get_log_term(),
        index: reader.get_index(),
        commit: reader.get_commit(),
        commit_term: reader.get_commit_term(),
        reject: reader.get_reject(),
        reject_hint: reader.get_reject_hint(),
        context: reader.get_context()?.to_vec().into(),
        request_snapshot: reader.get_request_snapshot(),
        priority: reader.get_priority(),
        deprecated_priority: reader.get_deprecated_priority(),
        ..Message::default()
    };
    let list = message.mut_entries();
    for e in reader.get_entries()? {
        list.push(read_entry(e)?);
    }
    if reader.has_snapshot() {
        message.set_snapshot(read_snapshot(reader.get_snapshot()?)?);
    }
    Ok(message)
}

fn write_entry(e: &Entry, mut out: entry::Builder) {
    out.set_entry_type(match e.entry_type {
        RaftEntryType::EntryNormal => EntryType::EntryNormal,
        RaftEntryType::EntryConfChange => EntryType::EntryConfChange,
        RaftEntryType::EntryConfChangeV2 => EntryType::EntryConfChangeV2,
    });
    out.set_term(e.term);
    out.set_index(e.index);
    out.set_data(&e.data);
    out.set_context(&e.context);
}

fn read_entry(reader: entry::Reader) -> Result<Entry, WireError> {
    let entry_type = match reader
        .get_entry_type()
        .map_err(|capnp::NotInSchema(value)| WireError::UnknownEnumerant {
            field: "entry.entryType",
            value,
        })? {
        EntryType::EntryNormal => RaftEntryType::EntryNormal,
        EntryType::EntryConfChange => RaftEntryType::EntryConfChange,
        EntryType::EntryConfChangeV2 => RaftEntryType::EntryConfChangeV2,
    };
    Ok(Entry {
        entry_type,
        term: reader.get_term(),
        index: reader.get_index(),
        data: reader.get_data()?.to_vec().into(),
        context: reader.get_context()?.to_vec().into(),
        ..Entry::default()
    })
}

fn write_snapshot(s: &Snapshot, mut out: snapshot::Builder) -> Result<(), WireError> {
    out.set_data(&s.data);
    if s.has_metadata() {
        let metadata = s.get_metadata();
        let mut m = out.init_metadata();
        m.set_index(metadata.index);
        m.set_term(metadata.term);
        if metadata.has_conf_state() {
            write_conf_state(metadata.get_conf_state(), m.init_conf_state())?;
        }
    }
    Ok(())
}

fn read_snapshot(reader: snapshot::Reader) -> Result<Snapshot, WireError> {
    let mut s = Snapshot {
        data: reader.get_data()?.to_vec().into(),
        ..Snapshot::default()
    };
    if reader.has_metadata() {
        let m = reader.get_metadata()?;
        let metadata = s.mut_metadata();
        metadata.index = m.get_index();
        metadata.term = m.get_term();
        if m.has_conf_state() {
            *metadata.mut_conf_state() = read_conf_state(m.get_conf_state()?)?;
        }
    }
    Ok(s)
}

fn write_conf_state(c: &ConfState, mut out: conf_state::Builder) -> Result<(), WireError> {
    fn ids<'a>(
        field: &'static str,
        from: &[u64],
        init: impl FnOnce(u32) -> capnp::primitive_list::Builder<'a, u64>,
    ) -> Result<(), WireError> {
        let mut list = init(list_len(field, from.len())?);
        for (i, id) in from.iter().enumerate() {
            list.set(i as u32, *id);
        }
        Ok(())
    }
    ids("confState.voters", &c.voters, |n| {
        out.reborrow().init_voters(n)
    })?;
    ids("confState.learners", &c.learners, |n| {
        out.reborrow().init_learners(n)
    })?;
    ids("confState.votersOutgoing", &c.voters_outgoing, |n| {
        out.reborrow().init_voters_outgoing(n)
    })?;
    ids("confState.learnersNext", &c.learners_next, |n| {
        out.reborrow().init_learners_next(n)
    })?;
    out.set_auto_leave(c.auto_leave);
    Ok(())
}

fn read_conf_state(reader: conf_state::Reader) -> Result<ConfState, WireError> {
    let ids = |list: capnp::primitive_list::Reader<u64>| list.iter().collect::<Vec<u64>>();
    Ok(ConfState {
        voters: ids(reader.get_voters()?),
        learners: ids(reader.get_learners()?),
        voters_outgoing: ids(reader.get_voters_outgoing()?),
        learners_next: ids(reader.get_learners_next()?),
        auto_leave: reader.get_auto_leave(),
        ..ConfState::default()
    })
}

/// raft-rs's message type as the schema's; the ordinals match (see the schema), but each is
/// named so a renumbering on either side fails to compile instead of changing meaning.
fn message_type_to_wire(t: RaftMessageType) -> MessageType {
    match t {
        RaftMessageType::MsgHup => MessageType::MsgHup,
        RaftMessageType::MsgBeat => MessageType::MsgBeat,
        RaftMessageType::MsgPropose => MessageType::MsgPropose,
        RaftMessageType::MsgAppend => MessageType::MsgAppend,
        RaftMessageType::MsgAppendResponse => MessageType::MsgAppendResponse,
        RaftMessageType::MsgRequestVote => MessageType::MsgRequestVote,
        RaftMessageType::MsgRequestVoteResponse => MessageType::MsgRequestVoteResponse,
        RaftMessageType::MsgSnapshot => MessageType::MsgSnapshot,
        RaftMessageType::MsgHeartbeat => MessageType::MsgHeartbeat,
        RaftMessageType::MsgHeartbeatResponse => MessageType::MsgHeartbeatResponse,
        RaftMessageType::MsgUnreachable => MessageType::MsgUnreachable,
        RaftMessageType::MsgSnapStatus => MessageType::MsgSnapStatus,
        RaftMessageType::MsgCheckQuorum => MessageType::MsgCheckQuorum,
        RaftMessageType::MsgTransferLeader => MessageType::MsgTransferLeader,
        RaftMessageType::MsgTimeoutNow => MessageType::MsgTimeoutNow,
        RaftMessageType::MsgReadIndex => MessageType::MsgReadIndex,
        RaftMessageType::MsgReadIndexResp => MessageType::MsgReadIndexResp,
        RaftMessageType::MsgRequestPreVote => MessageType::MsgRequestPreVote,
        RaftMessageType::MsgRequestPreVoteResponse => MessageType::MsgRequestPreVoteResponse,
    }
}

fn message_type_from_wire(t: MessageType) -> RaftMessageType {
    match t {
        MessageType::MsgHup => RaftMessageType::MsgHup,
        MessageType::MsgBeat => RaftMessageType::MsgBeat,
        MessageType::MsgPropose => RaftMessageType::MsgPropose,
        MessageType::MsgAppend => RaftMessageType::MsgAppend,
        MessageType::MsgAppendResponse => RaftMessageType::MsgAppendResponse,
        MessageType::MsgRequestVote => RaftMessageType::MsgRequestVote,
        MessageType::MsgRequestVoteResponse => RaftMessageType::MsgRequestVoteResponse,
        MessageType::MsgSnapshot => RaftMessageType::MsgSnapshot,
        MessageType::MsgHeartbeat => RaftMessageType::MsgHeartbeat,
        MessageType::MsgHeartbeatResponse => RaftMessageType::MsgHeartbeatResponse,
        MessageType::MsgUnreachable => RaftMessageType::MsgUnreachable,
        MessageType::MsgSnapStatus => RaftMessageType::MsgSnapStatus,
        MessageType::MsgCheckQuorum => RaftMessageType::MsgCheckQuorum,
        MessageType::MsgTransferLeader => RaftMessageType::MsgTransferLeader,
        MessageType::MsgTimeoutNow => RaftMessageType::MsgTimeoutNow,
        MessageType::MsgReadIndex => RaftMessageType::MsgReadIndex,
        MessageType::MsgReadIndexResp => RaftMessageType::MsgReadIndexResp,
        MessageType::MsgRequestPreVote => RaftMessageType::MsgRequestPreVote,
        MessageType::MsgRequestPreVoteResponse => RaftMessageType::MsgRequestPreVoteResponse,
    }
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests;
