# pinq replication protocol: Raft messages between the nodes of a cluster.
#
# This file is the contract between pinq nodes (not clients: clients use pinq.capnp). Every shard
# of a cluster is one Raft group across the nodes, with shard k of every node a member of group k;
# the node ids are the Raft ids (`cluster.nodeId`). Each group has its own TCP connection per pair
# of nodes, run by the core of its shard on both sides (a core runs one shard), so the Raft
# traffic of a shard never crosses to another core; everything a shard queued for a peer in one
# tick (its heartbeats, its appends) travels together in one frame.
#
# Framing
# -------
# Plain Cap'n Proto messages, not RPC, in the standard stream framing (capnp::serialize: a
# segment table, then the segments). A receiver reads at most `cluster.maxFrameBytes` per message
# (segment table included) and closes the connection on a larger one: that bound is also the
# reader's traversal limit, so a peer cannot make a node reserve more than it per connection.
# Entry payloads are pinq commands, which carry their own CRC32C; TCP checksums the rest.
#
# Connecting
# ----------
# Of each pair of nodes, shard k of the one with the lower node id dials the other's
# `cluster.raftListen` (one port per node, whatever its shard count); the connection then carries
# both directions of group k. The dialer first writes an 8-byte plaintext preamble, before TLS:
# the ASCII magic "PQR2" and the shard index k as a little-endian UInt32. The accepting node
# reads it (within the handshake timeout) on the core that listens and hands the socket to shard
# k's core, which runs TLS and the handshake; a preamble with another magic or a shard index the
# node does not run closes the connection (logged, counted as a refusal on the accepting side).
# Then each side starts by sending a `Hello`, reads the
# peer's `Hello`, and sends a `HelloReply` with its verdict on it; only when both replies say
# `accepted` do `Frame`s follow, in both directions. A refused side closes the connection; the
# dialer retries with backoff, so a node whose configuration is fixed and restarted joins without
# its peers restarting. Either side may close an idle connection, so a side with nothing to send
# sends an empty `Frame` now and then as a keepalive.
#
# Compatibility
# -------------
# `replicationVersion` changes only when a change is not backward compatible; fields added later
# (at the end, with new ordinals) keep it. A node refuses a peer whose version it cannot speak.

@0xc672c91ebc1f75f5;

const replicationVersion :UInt32 = 2;
# 2: the preamble and one connection per shard (`Hello.shard`); 1 had one connection per node
# pair for every shard.
# The protocol version this schema describes, sent in `Hello.protocolVersion`.

# ---------------------------------------------------------------------------------------------
# Handshake

struct Hello {
  # The first message on a connection, in each direction: who this node is and what it believes
  # the cluster is. Two nodes work together only if they agree on the shard count and the members.

  protocolVersion @0 :UInt32;
  # `replicationVersion` of the sender.

  nodeId @1 :UInt64;
  # The sender's `cluster.nodeId` (positive).

  clientAddress @2 :Text;
  # The sender's `cluster.advertise`: where clients reach it ("IP:port"), so a follower can send a
  # client to its shard's leader.

  raftAddress @3 :Text;
  # The sender's own entry in `members` ("IP:port").

  shardCount @4 :UInt32;
  # Shards the sender runs; every node of a cluster must run the same number (shard k of each
  # node is a member of Raft group k).

  members @5 :List(Member);
  # The sender's `cluster.peers`, sorted by node id, itself included.

  shard @6 :UInt32;
  # The shard (Raft group) whose traffic this connection carries: the sender's shard, which must
  # be the receiver's too (and the one the dialer's preamble named).
}

struct Member {
  # One entry of `cluster.peers`.

  nodeId @0 :UInt64;
  raftAddress @1 :Text;
  # "IP:port", as configured.
}

struct HelloReply {
  # A node's verdict on the peer's `Hello`, sent right after reading it.

  union {
    accepted @0 :Void;
    # Frames may follow.

    refused @1 :Refusal;
    # The sender closes the connection after this.
  }
}

struct Refusal {
  reason @0 :RefusalReason;

  detail @1 :Text;
  # For people: which values disagreed, e.g. "node 2 runs 4 shards, node 1 runs 2".
}

enum RefusalReason {
  shardCountMismatch @0;
  # The two nodes run different numbers of shards.

  membersMismatch @1;
  # The two nodes list different members (ids or Raft addresses).

  unknownNode @2;
  # The peer's node id is not among the refusing node's members, or it connected with an address
  # other than the one the members list gives it.

  versionUnsupported @3;
  # The refusing node cannot speak the peer's `protocolVersion`.

  sameNodeId @4;
  # The peer claims the refusing node's own id: two nodes configured with one id, or a node that
  # dialed itself.

  certificateMismatch @5;
  # With `[cluster.tls]`: the peer's TLS client certificate does not name the node its `Hello`
  # claims (neither an IP subjectAltName equal to that member's IP nor the DNS name
  # `pinq-node-<id>`). Only a node that completed a TLS handshake can receive it, so only a
  # build that knows it. (A failed TLS handshake itself is never sent here: it leaves no channel
  # to send on; each side logs its own reason.)

  shardMismatch @6;
  # The peer's `Hello.shard` is not the shard of the connection it arrived on (the preamble named
  # another one), or the preamble named a shard the refusing node does not run (then logged only:
  # the connection is closed before TLS and the `Hello`s).
}

# ---------------------------------------------------------------------------------------------
# Raft traffic

struct Frame {
  # What one write carries after the handshake: every Raft message the connection's shard queued
  # for this peer since the last write. An empty frame is a keepalive.

  messages @0 :List(ShardMessage);
}

struct ShardMessage {
  shard @0 :UInt32;
  # The Raft group: the index of the shard on both nodes; always the connection's `Hello.shard`
  # (a receiver drops, and counts, any other).

  message @1 :RaftMessage;
}

struct RaftMessage {
  # raft-rs's `eraftpb::Message` (tikv `raft` crate 0.7), field by field and with its meaning; the
  # comments give the protobuf field names. `to` and `from` are node ids.

  msgType @0 :MessageType;
  to @1 :UInt64;
  from @2 :UInt64;
  term @3 :UInt64;
  logTerm @4 :UInt64;
  # log_term: the term of the entry at `index` (for MsgAppend, the entry before `entries`).
  index @5 :UInt64;
  entries @6 :List(Entry);
  commit @7 :UInt64;
  commitTerm @8 :UInt64;
  snapshot @9 :Snapshot;
  # Absent unless the message carries one (MsgSnapshot).
  reject @10 :Bool;
  rejectHint @11 :UInt64;
  context @12 :Data;
  requestSnapshot @13 :UInt64;
  priority @14 :Int64;
  deprecatedPriority @15 :UInt64;
  # deprecated_priority: still sent by raft-rs 0.7 beside `priority` (see eraftpb.proto).
}

enum MessageType {
  # eraftpb::MessageType; the ordinals are raft-rs's numbers.
  msgHup @0;
  msgBeat @1;
  msgPropose @2;
  msgAppend @3;
  msgAppendResponse @4;
  msgRequestVote @5;
  msgRequestVoteResponse @6;
  msgSnapshot @7;
  msgHeartbeat @8;
  msgHeartbeatResponse @9;
  msgUnreachable @10;
  msgSnapStatus @11;
  msgCheckQuorum @12;
  msgTransferLeader @13;
  msgTimeoutNow @14;
  msgReadIndex @15;
  msgReadIndexResp @16;
  msgRequestPreVote @17;
  msgRequestPreVoteResponse @18;
}

struct Entry {
  # eraftpb::Entry. Its deprecated `sync_log` flag is not carried (raft-rs 0.7 never reads it).
  entryType @0 :EntryType;
  term @1 :UInt64;
  index @2 :UInt64;
  data @3 :Data;
  # For a normal entry, a pinq command (its own encoding, with its CRC32C).
  context @4 :Data;
}

enum EntryType {
  # eraftpb::EntryType; the ordinals are raft-rs's numbers.
  entryNormal @0;
  entryConfChange @1;
  entryConfChangeV2 @2;
}

struct Snapshot {
  # eraftpb::Snapshot. pinq never sends a shard's state in one message: `data` is one of three
  # kinds of snapshot traffic, told apart by its first byte (integers little-endian; `id` is
  # leader u64 | index u64 | term u64 | hash u64):
  #
  #   2 offer   | leader u64 | index u64 | term u64 | bytes u64 | commands u64 |
  #               chunkBytes u32 | hash u64          (leader -> follower; `metadata` is set)
  #   3 chunk   | id | number u64 | crc32c u32 | bytes   (leader -> follower, one chunk of the
  #               snapshot file: bytes [number * chunkBytes, ...) of it)
  #   4 request | id | first u64 | count u32            (follower -> leader: send chunks
  #               first .. first + count; at most 4 are outstanding)
  #
  # The file is a sequence of `len u32 | command[len]` (pinq commands, each with its own
  # CRC32C); `hash` is its xxh3-64, `bytes` its length. A follower applies the commands to a
  # staging engine as the chunks arrive and steps the offer into its raft core only once the
  # whole stream is staged and matches the offer's size, command count and hash. A message of another
  # first byte is dropped and counted (`snapshot_malformed`).
  data @0 :Data;
  metadata @1 :SnapshotMetadata;
}

struct SnapshotMetadata {
  confState @0 :ConfState;
  index @1 :UInt64;
  # The applied index the snapshot covers.
  term @2 :UInt64;
  # The term of the entry at `index`.
}

struct ConfState {
  # eraftpb::ConfState: the group's membership at the snapshot.
  voters @0 :List(UInt64);
  learners @1 :List(UInt64);
  votersOutgoing @2 :List(UInt64);
  learnersNext @3 :List(UInt64);
  autoLeave @4 :Bool;
}
