//! Tests of the node-to-node codec: every Raft message type round trips, the handshake checks
//! name what disagreed, and hostile bytes give typed errors.

// raft's protobuf structs have many fields; setting the few a test cares about one by one reads
// better than a struct literal with `..Default::default()`.
#![allow(clippy::field_reassign_with_default)]

use super::*;
use raft::eraftpb::{EntryType as RaftEntryType, MessageType as RaftMessageType};

const MAX: usize = 1 << 20;

const ALL_TYPES: [RaftMessageType; 19] = [
    RaftMessageType::MsgHup,
    RaftMessageType::MsgBeat,
    RaftMessageType::MsgPropose,
    RaftMessageType::MsgAppend,
    RaftMessageType::MsgAppendResponse,
    RaftMessageType::MsgRequestVote,
    RaftMessageType::MsgRequestVoteResponse,
    RaftMessageType::MsgSnapshot,
    RaftMessageType::MsgHeartbeat,
    RaftMessageType::MsgHeartbeatResponse,
    RaftMessageType::MsgUnreachable,
    RaftMessageType::MsgSnapStatus,
    RaftMessageType::MsgCheckQuorum,
    RaftMessageType::MsgTransferLeader,
    RaftMessageType::MsgTimeoutNow,
    RaftMessageType::MsgReadIndex,
    RaftMessageType::MsgReadIndexResp,
    RaftMessageType::MsgRequestPreVote,
    RaftMessageType::MsgRequestPreVoteResponse,
];

fn entry(index: u64, entry_type: RaftEntryType, data: &[u8]) -> Entry {
    let mut e = Entry::default();
    e.entry_type = entry_type;
    e.term = 7;
    e.index = index;
    e.data = data.to_vec().into();
    e.context = b"ctx".to_vec().into();
    e
}

fn snapshot() -> Snapshot {
    let mut s = Snapshot::default();
    s.data = vec![0xab; 1000].into();
    let metadata = s.mut_metadata();
    metadata.index = 500;
    metadata.term = 6;
    let conf = metadata.mut_conf_state();
    conf.voters = vec![1, 2, 3];
    conf.learners = vec![4];
    conf.voters_outgoing = vec![1, 2];
    conf.learners_next = vec![5];
    conf.auto_leave = true;
    s
}

/// A message with every field set to something distinct.
fn full_message(msg_type: RaftMessageType) -> Message {
    let mut m = Message::default();
    m.msg_type = msg_type;
    m.to = 2;
    m.from = 1;
    m.term = 9;
    m.log_term = 8;
    m.index = 100;
    m.mut_entries()
        .push(entry(101, RaftEntryType::EntryNormal, b"publish"));
    m.mut_entries()
        .push(entry(102, RaftEntryType::EntryConfChange, b""));
    m.mut_entries()
        .push(entry(103, RaftEntryType::EntryConfChangeV2, &[0; 70]));
    m.commit = 99;
    m.commit_term = 8;
    m.set_snapshot(snapshot());
    m.reject = true;
    m.reject_hint = 42;
    m.context = b"read-index-ctx".to_vec().into();
    m.request_snapshot = 77;
    m.priority = -3;
    m.deprecated_priority = 3;
    m
}

fn round_trip(messages: &[(u32, Message)]) -> Vec<(u32, Message)> {
    let mut bytes = Vec::new();
    encode_frame(messages, &mut bytes).unwrap();
    let mut out = Vec::new();
    let count = decode_frame(&bytes, MAX, |shard, m| out.push((shard, m))).unwrap();
    assert_eq!(count, messages.len());
    out
}

#[test]
fn every_message_type_round_trips_with_entries_and_a_snapshot() {
    let messages: Vec<(u32, Message)> = ALL_TYPES
        .iter()
        .enumerate()
        .map(|(i, t)| (i as u32, full_message(*t)))
        .collect();
    assert_eq!(round_trip(&messages), messages);
}

#[test]
fn a_message_without_snapshot_or_entries_round_trips_without_them() {
    let mut heartbeat = Message::default();
    heartbeat.msg_type = RaftMessageType::MsgHeartbeat;
    heartbeat.to = 3;
    heartbeat.from = 1;
    heartbeat.term = 2;
    heartbeat.commit = 10;
    let back = round_trip(&[(5, heartbeat.clone())]);
    assert_eq!(back, [(5, heartbeat)]);
    assert!(!back[0].1.has_snapshot());
    assert!(back[0].1.get_entries().is_empty());

    // A snapshot without metadata stays without.
    let mut m = Message::default();
    m.msg_type = RaftMessageType::MsgSnapshot;
    let mut s = Snapshot::default();
    s.data = b"x".to_vec().into();
    m.set_snapshot(s);
    let back = round_trip(&[(0, m.clone())]);
    assert_eq!(back, [(0, m)]);
    assert!(!back[0].1.get_snapshot().has_metadata());
}

#[test]
fn an_empty_frame_is_a_keepalive() {
    assert!(round_trip(&[]).is_empty());
}

#[test]
fn the_schema_numbers_message_types_as_raft_does() {
    for t in ALL_TYPES {
        assert_eq!(message_type_to_wire(t) as u16, t as u16, "{t:?}");
        assert_eq!(message_type_from_wire(message_type_to_wire(t)), t);
    }
}

#[test]
fn the_size_estimate_bounds_the_encoded_size() {
    for messages in [
        vec![(0, full_message(RaftMessageType::MsgAppend))],
        ALL_TYPES
            .iter()
            .map(|t| (1, full_message(*t)))
            .collect::<Vec<_>>(),
        vec![(2, Message::default()); 100],
    ] {
        let estimate: usize = messages
            .iter()
            .map(|(_, m)| message_bytes_estimate(m))
            .sum::<usize>()
            + 64;
        let mut bytes = Vec::new();
        encode_frame(&messages, &mut bytes).unwrap();
        assert!(bytes.len() <= estimate, "{} > {estimate}", bytes.len());
    }
}

fn members(list: &[(u64, &str)]) -> BTreeMap<u64, SocketAddr> {
    list.iter()
        .map(|(id, addr)| (*id, addr.parse().unwrap()))
        .collect()
}

fn hello(node_id: u64, shard_count: u32) -> Hello {
    let members = members(&[
        (1, "127.0.0.1:7101"),
        (2, "127.0.0.1:7102"),
        (3, "127.0.0.1:7103"),
    ]);
    Hello {
        protocol_version: PROTOCOL_VERSION,
        node_id,
        client_addr: format!("127.0.0.1:740{node_id}"),
        raft_addr: members[&node_id],
        shard_count,
        members,
        shard: 0,
    }
}

#[test]
fn hello_and_replies_round_trip() {
    let mut ours = hello(2, 4);
    ours.shard = 3;
    let mut bytes = Vec::new();
    ours.encode(&mut bytes).unwrap();
    assert_eq!(Hello::decode(&bytes, MAX).unwrap(), ours);

    for reply in [
        HelloReply::Accepted,
        HelloReply::Refused(HandshakeRefusal {
            reason: RefusalReason::MembersMismatch,
            detail: "lists differ".to_owned(),
        }),
        HelloReply::Refused(HandshakeRefusal {
            reason: RefusalReason::SameNodeId,
            detail: String::new(),
        }),
        HelloReply::Refused(HandshakeRefusal {
            reason: RefusalReason::CertificateMismatch,
            detail: "names DNS:pinq-node-2".to_owned(),
        }),
        HelloReply::Refused(HandshakeRefusal {
            reason: RefusalReason::ShardMismatch,
            detail: "shard 1 on shard 0".to_owned(),
        }),
    ] {
        let mut bytes = Vec::new();
        reply.encode(&mut bytes).unwrap();
        assert_eq!(HelloReply::decode(&bytes, MAX).unwrap(), reply);
    }
}

#[test]
fn a_local_only_refusal_reason_is_never_encoded() {
    let reply = HelloReply::Refused(HandshakeRefusal {
        reason: RefusalReason::Tls,
        detail: "no TLS".to_owned(),
    });
    let err = reply.encode(&mut Vec::new()).unwrap_err();
    assert!(
        matches!(
            err,
            WireError::LocalReason {
                reason: RefusalReason::Tls
            }
        ),
        "{err}"
    );
}

#[test]
fn hello_from_config_uses_the_configured_address_not_a_wildcard() {
    let config = ClusterConfig {
        node_id: 2,
        join: None,
        raft_listen: "0.0.0.0:7102".parse().unwrap(),
        peers: members(&[(1, "10.0.0.1:7101"), (2, "10.0.0.2:7102")]),
        advertise: "10.0.0.2:7400".parse().unwrap(),
        tick_interval: std::time::Duration::from_millis(50),
        heartbeat_ticks: 2,
        election_ticks: 10,
        log_retain_entries: 100,
        outbound_queue_messages: 16,
        max_frame_bytes: MAX,
        tls: None,
    };
    let h = Hello::new(&config, 3, 2);
    assert_eq!(h.shard, 2);
    assert_eq!(h.raft_addr.to_string(), "10.0.0.2:7102");
    assert_eq!(h.client_addr, "10.0.0.2:7400");
    assert_eq!(h.shard_count, 3);
    assert_eq!(h.members, config.peers);
}

#[test]
fn matching_hellos_are_accepted_both_ways() {
    assert_eq!(check_hello(&hello(1, 2), &hello(2, 2)), Ok(()));
    assert_eq!(check_hello(&hello(2, 2), &hello(1, 2)), Ok(()));
}

#[test]
fn a_shard_count_mismatch_is_refused_saying_both_counts() {
    let refusal = check_hello(&hello(1, 2), &hello(2, 4)).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::ShardCountMismatch);
    assert!(
        refusal
            .detail
            .starts_with("node 2 runs 4 shards, node 1 runs 2"),
        "{refusal}"
    );
    let other_way = check_hello(&hello(2, 4), &hello(1, 2)).unwrap_err();
    assert_eq!(other_way.reason, RefusalReason::ShardCountMismatch);
    assert!(other_way
        .detail
        .starts_with("node 1 runs 2 shards, node 2 runs 4"));
}

#[test]
fn a_hello_of_another_shard_is_refused_naming_both() {
    let mut theirs = hello(2, 2);
    theirs.shard = 1;
    let refusal = check_hello(&hello(1, 2), &theirs).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::ShardMismatch);
    assert_eq!(
        refusal.detail,
        "node 2 sent the Hello of shard 1 on a connection of shard 0 of node 1"
    );
}

#[test]
fn a_preamble_round_trips_and_another_magic_is_refused() {
    assert_eq!(decode_preamble(encode_preamble(7)).unwrap(), 7);
    assert_eq!(&encode_preamble(1), b"PQR2\x01\x00\x00\x00");
    // A version-1 node starts with a Hello frame's segment table; a TLS client with its record.
    for bytes in [[0, 0, 0, 0, 9, 0, 0, 0], [22, 3, 1, 0, 200, 1, 0, 0]] {
        assert!(
            matches!(decode_preamble(bytes), Err(WireError::BadPreamble { .. })),
            "{bytes:?}"
        );
    }
}

#[test]
fn member_lists_may_differ_but_not_on_an_address() {
    // A membership change spreads node by node, and a joining node knows only the members it
    // was told: lists that differ in who they name are accepted.
    let mut theirs = hello(2, 2);
    theirs.members.remove(&3);
    assert_eq!(check_hello(&hello(1, 2), &theirs), Ok(()));
    let mut more = hello(2, 2);
    more.members.insert(4, "127.0.0.1:7104".parse().unwrap());
    assert_eq!(check_hello(&hello(1, 2), &more), Ok(()));
    // Two addresses for one member are refused, naming it.
    let mut moved = hello(2, 2);
    moved.members.insert(3, "127.0.0.1:7999".parse().unwrap());
    let refusal = check_hello(&hello(1, 2), &moved).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::MembersMismatch);
    assert_eq!(
        refusal.detail,
        "node 2 lists members [1=127.0.0.1:7101, 2=127.0.0.1:7102, 3=127.0.0.1:7999], node 1 lists \
         [1=127.0.0.1:7101, 2=127.0.0.1:7102, 3=127.0.0.1:7103]: they disagree on the address of \
         [3=127.0.0.1:7999]"
    );
}

#[test]
fn an_unknown_or_misplaced_node_is_refused() {
    let mut stranger = hello(2, 2);
    stranger.node_id = 9;
    let refusal = check_hello(&hello(1, 2), &stranger).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::UnknownNode);
    assert!(refusal.detail.contains("node 9"), "{refusal}");
    assert!(refusal.detail.contains("[1=127.0.0.1:7101"), "{refusal}");

    let mut elsewhere = hello(2, 2);
    elsewhere.raft_addr = "127.0.0.1:7103".parse().unwrap();
    let refusal = check_hello(&hello(1, 2), &elsewhere).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::UnknownNode);
    assert!(refusal
        .detail
        .contains("the members list gives 127.0.0.1:7102"));
}

#[test]
fn the_same_node_id_and_another_version_are_refused() {
    let refusal = check_hello(&hello(1, 2), &hello(1, 2)).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::SameNodeId);
    let mut future = hello(2, 2);
    future.protocol_version = PROTOCOL_VERSION + 1;
    let refusal = check_hello(&hello(1, 2), &future).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::VersionUnsupported);
    let theirs = format!("version {}", PROTOCOL_VERSION + 1);
    assert!(refusal.detail.contains(&theirs), "{refusal}");
    assert_eq!(
        refusal.to_string(),
        format!("versionUnsupported: {}", refusal.detail)
    );
}

#[test]
fn truncated_frames_give_typed_errors() {
    let mut bytes = Vec::new();
    encode_frame(&[(0, full_message(RaftMessageType::MsgAppend))], &mut bytes).unwrap();
    for len in 0..bytes.len() {
        let err = decode_frame(&bytes[..len], MAX, |_, _| {
            panic!("decoded from {len} bytes")
        })
        .unwrap_err();
        assert!(
            matches!(err, WireError::Truncated { .. } | WireError::Capnp(_)),
            "{len}: {err:?}"
        );
    }
    let mut hello_bytes = Vec::new();
    hello(1, 2).encode(&mut hello_bytes).unwrap();
    for len in 0..hello_bytes.len() {
        assert!(Hello::decode(&hello_bytes[..len], MAX).is_err());
        assert!(HelloReply::decode(&hello_bytes[..len], MAX).is_err() || len >= 8);
    }
}

#[test]
fn garbage_never_panics() {
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        // xorshift64*: deterministic, so a failure replays.
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        seed.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut valid = Vec::new();
    encode_frame(
        &ALL_TYPES
            .iter()
            .map(|t| (3, full_message(*t)))
            .collect::<Vec<_>>(),
        &mut valid,
    )
    .unwrap();
    let mut hello_bytes = Vec::new();
    hello(1, 2).encode(&mut hello_bytes).unwrap();
    for round in 0..3000 {
        let base = if round % 2 == 0 { &valid } else { &hello_bytes };
        let mut bytes = base.clone();
        // Flip a few bytes of a valid frame, or replace it with noise.
        if round % 7 == 0 {
            let len = (next() % 512) as usize;
            bytes = (0..len).map(|_| next() as u8).collect();
        } else {
            for _ in 0..1 + next() % 8 {
                let at = (next() as usize) % bytes.len();
                bytes[at] = next() as u8;
            }
        }
        let _ = decode_frame(&bytes, MAX, |_, _| {});
        let _ = Hello::decode(&bytes, MAX);
        let _ = HelloReply::decode(&bytes, MAX);
    }
}

#[test]
fn an_oversized_frame_is_refused_from_its_segment_table() {
    // One segment announcing 16 Mi words (128 MiB): refused before any body is read.
    let mut table = vec![0u8; 8];
    table[4..8].copy_from_slice(&(16u32 << 20).to_le_bytes());
    let err = frame_bytes(&table, 64 << 20).unwrap_err();
    assert!(
        matches!(err, WireError::FrameTooLarge { bytes, max } if bytes == (128 << 20) + 8 && max == 64 << 20),
        "{err:?}"
    );
    // Too many segments.
    let mut prefix = [0u8; 8];
    prefix[0..4].copy_from_slice(&1000u32.to_le_bytes());
    assert!(matches!(
        segment_table_bytes(prefix),
        Err(WireError::SegmentCount { count: 1001 })
    ));
    // u32::MAX segments must not overflow.
    prefix[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(segment_table_bytes(prefix).is_err());

    // A real frame larger than the limit is refused by decode too.
    let mut m = Message::default();
    m.mut_entries()
        .push(entry(1, RaftEntryType::EntryNormal, &vec![1u8; 4096]));
    let mut bytes = Vec::new();
    encode_frame(&[(0, m)], &mut bytes).unwrap();
    assert!(matches!(
        decode_frame(&bytes, 1024, |_, _| {}),
        Err(WireError::FrameTooLarge { .. })
    ));
    assert_eq!(frame_bytes(&bytes, MAX).unwrap(), bytes.len());
}

#[test]
fn segment_tables_are_word_padded() {
    let table = |count: u32| {
        let mut prefix = [0u8; 8];
        prefix[0..4].copy_from_slice(&(count - 1).to_le_bytes());
        segment_table_bytes(prefix).unwrap()
    };
    assert_eq!(table(1), 8);
    assert_eq!(table(2), 16);
    assert_eq!(table(3), 16);
    assert_eq!(table(4), 24);
}

#[test]
fn an_unknown_message_type_is_a_typed_error() {
    // `to` is the data section's second word and msgType the first 16 bits of its first word
    // (Cap'n Proto lays fields out by ordinal): find `to` by a marker and patch msgType.
    let marker = 0xa1a2_a3a4_a5a6_a7a8_u64;
    let mut m = Message::default();
    m.to = marker;
    let mut bytes = Vec::new();
    encode_frame(&[(0, m)], &mut bytes).unwrap();
    let at = bytes
        .windows(8)
        .position(|w| w == marker.to_le_bytes())
        .unwrap();
    bytes[at - 8..at - 6].copy_from_slice(&999u16.to_le_bytes());
    let err = decode_frame(&bytes, MAX, |_, _| panic!("decoded")).unwrap_err();
    assert!(
        matches!(
            err,
            WireError::UnknownEnumerant {
                field: "raftMessage.msgType",
                value: 999
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_tls_record_where_a_frame_was_expected_is_named() {
    // A TLS handshake record (ClientHello) and an alert record.
    for prefix in [
        [0x16, 0x03, 0x01, 0x00, 0xf8, 0x01, 0x00, 0x00],
        [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32, 0x00],
    ] {
        let err = segment_table_bytes(prefix).unwrap_err();
        assert!(matches!(err, WireError::TlsRecord), "{err}");
        assert!(err.to_string().contains("[cluster.tls]"), "{err}");
    }
    // Any other oversized segment count is reported as such.
    let err = segment_table_bytes([0xff, 0xff, 0, 0, 0, 0, 0, 0]).unwrap_err();
    assert!(matches!(err, WireError::SegmentCount { .. }), "{err}");
}
