# The protocol-1 client schema as it was at commit 0570533^ (before ShardStats.backlog and
# GroupStats.backlog changed meaning, and before protocol 2): tests/test_protocol1.py builds a
# client from it to check the current broker still speaks protocol 1 as this file promised.
# Kept byte for byte below this header; do not edit.

# pinq client protocol (Cap'n Proto RPC).
#
# This file is the whole contract between pinq and its clients: a client in any language with a
# Cap'n Proto RPC implementation can use the broker from it alone.
#
# Connecting
# ----------
# Open a TCP connection to the broker's client port (default 127.0.0.1:7400) and start a
# two-party RPC session (rpc-twoparty.capnp, the client is side "client"). The bootstrap
# capability is a `Broker`. Call `Broker.hello` first.
#
# Every shard of a broker also listens on a port of its own (see `Broker.topology`): a client that
# sends a topic's requests to the port of the shard that owns it saves one hop between CPU cores.
# The owner of a topic is `xxh3_64(topic bytes, seed 0x70696e715f746f70) & 0x7fffffffffffffff`
# modulo the shard count. Any port accepts any request; routing is only an optimisation.
#
# Batches
# -------
# Every call carries a batch (of messages, deliveries or tags). One message per call is far too
# slow for a broker: send as many as you have, and keep several calls in flight.
#
# Errors
# ------
# A request the broker refuses (an empty or overlong topic, a payload over `publish.maxMessageBytes`,
# a negative delay or TTL, an ack level below `publish.minAckLevel`, too many messages in one batch,
# an unsupported protocol version, ...) fails with a Cap'n Proto exception of type `failed` whose
# description names the problem (and, for a batch, the index of the offending entry). A refused
# batch writes nothing: batches are atomic. An exception of type `overloaded` means "try again
# later"; `disconnected` means the connection or the shard behind it is gone. Per-tag outcomes of
# ack/nack/touch are not exceptions: they come back as a `TagResult` per tag.
#
# Delivery tags
# -------------
# A delivery tag is the message's 24-byte event key: big-endian
# `topicHash :UInt64 | dueBucket :UInt64 | eventId :UInt64`. Treat it as opaque bytes: keep it
# from the `publish` reply or the `Delivery`, and hand it back to `ack`, `nack` or `touch`.

@0x88d5e0f10fc40177;

const protocolVersion :UInt32 = 1;
# The protocol version this schema describes, sent in `Broker.hello`. It changes only when a
# change is not backward compatible; fields and methods added later keep the version.

const anyShard :UInt32 = 0xffffffff;
# The `shardId` that `Broker.hello` answers on the shared client port (any shard may serve it).

const tagBytes :UInt32 = 24;
# Length of every delivery tag, in bytes.

const consumerIdBytes :UInt32 = 16;
# Length of a consumer id (a UUID, RFC 4122 byte order), in bytes.

interface Broker {
  # The bootstrap capability of a pinq connection.

  hello @0 (clientVersion :UInt32) -> (serverVersion :UInt32, shardCount :UInt32, shardId :UInt32);
  # Version handshake: call once, first. `clientVersion` is the `protocolVersion` the client was
  # built against. The broker fails the call (type `failed`) if it cannot serve that version;
  # otherwise it answers with its own `protocolVersion` (a client must stop if it does not support
  # that one), its number of shards, and the shard whose port this connection reached
  # (`anyShard` on the shared client port).

  publish @1 (messages :List(PublishMessage), ackLevel :AckLevel)
      -> (tags :List(Data), notLeader :NotLeader);
  # Publishes a batch of messages, possibly to several topics. The batch is atomic: if any
  # message is refused (see "Errors" above), the call fails and nothing is written. The reply
  # comes once the batch has reached `ackLevel`; `tags` holds each message's 24-byte delivery tag,
  # in the order of `messages`. An empty batch is allowed and returns no tags.
  #
  # In a cluster, only the leader of a shard stores its topics' messages. If `notLeader` is set
  # in the reply, this node does not lead a shard the batch needs: `tags` is empty and nothing
  # was stored; send the batch to `notLeader.leaderAddress` (or, while it is empty, retry after
  # a short wait). A batch whose topics belong to shards led by different nodes must be split by
  # shard (the owner of a topic is given at the top of this file). If the call fails instead
  # (an exception) while a leader changes, the batch may or may not be stored: publishing it
  # again is at-least-once.

  subscribe @2 (topic :Text, group :Text, consumer :Consumer, queueSize :UInt32)
      -> (subscription :Subscription, consumerId :Data, notLeader :NotLeader);
  # Registers `consumer` for `topic`. A non-empty `group` makes it a competing consumer: each
  # message goes to exactly one consumer of the group (round-robin). An empty `group` makes it a
  # universal consumer: it gets every message (fan-out). Each group and each universal consumer
  # is a separate recipient with its own copy of every message, acknowledged on its own.
  #
  # `queueSize` bounds the deliveries the broker queues for this consumer before it skips it for
  # others; 0 means the broker's `delivery.consumerQueueSize`, and larger values are capped by the
  # broker. Deliveries then arrive as `Consumer.deliver` calls (see below).
  #
  # The reply carries the `Subscription` to acknowledge with and the consumer's 16-byte UUID.
  # Dropping the `Subscription` capability (or the connection) is a disconnect: copies the consumer
  # holds unacknowledged are redelivered at once, and a universal consumer is forgotten.
  #
  # In a cluster, only the leader of the topic's shard serves consumers: if `notLeader` is set,
  # `subscription` is null; subscribe at `notLeader.leaderAddress` instead. When the shard's
  # leader changes, the broker releases the `Consumer` capability (no more `deliver` calls) and
  # `ack`/`nack`/`touch` fail: subscribe again, on the new leader. Copies not acknowledged by
  # then are delivered again there (at-least-once); a message whose delete was committed is not.

  topology @3 () -> (shards :List(ShardInfo));
  # The broker's shards and the port each listens on, ordered by `shardId`.

  stats @4 () -> (stats :Stats);
  # Counters of every shard, topic and group, read at the time of the call.

  forgetGroup @5 (topic :Text, group :Text) -> ();
  # Admin: forgets a consumer group of a topic at once, with its claims on messages, as
  # `delivery.groupRetention` does after that long without consumers: copies waiting only for
  # this group are deleted. Meant for a group whose consumers are gone for good. Fails (`failed`)
  # if `group` is empty.

  clusterStatus @6 () -> (status :ClusterStatus);
  # In a cluster: every member node and this node's view of every shard's Raft group (on the
  # shard's leader, with each follower's progress). Standalone: `nodeId` 0 and no nodes.
}

struct NotLeader {
  # In a cluster: this node does not lead the shard a request needs. Nothing was done.

  shardId @0 :UInt32;
  term @1 :UInt64;
  # The Raft term this node knows for the shard.
  leaderNodeId @2 :UInt64;
  # The leader's node id; 0 when no leader is known yet (an election is under way: retry soon).
  leaderAddress @3 :Text;
  # The leader's client address, `host:port`; empty when not known.
}

struct ClusterStatus {
  nodeId @0 :UInt64;
  # The node that answered; 0 for a standalone broker.
  nodes @1 :List(NodeStatus);
  shards @2 :List(ShardReplica);
}

struct NodeStatus {
  id @0 :UInt64;
  raftAddress @1 :Text;
  clientAddress @2 :Text;
  # Empty when the answering node has not heard it from that node yet.
  reachable @3 :Bool;
  # The answering node has a working connection to it (always true for itself).
}

struct ShardReplica {
  # One shard's Raft group as the answering node sees it.
  shardId @0 :UInt32;
  leaderNodeId @1 :UInt64;
  # 0: no leader known.
  term @2 :UInt64;
  commitIndex @3 :UInt64;
  appliedIndex @4 :UInt64;
  followers @5 :List(FollowerProgress);
  # Filled only when the answering node is the leader.
}

struct FollowerProgress {
  nodeId @0 :UInt64;
  matchIndex @1 :UInt64;
  # The highest log index known to be on that follower.
}

interface Consumer {
  # Implemented by the client and passed to `Broker.subscribe`; the broker calls it.

  deliver @0 (deliveries :List(Delivery)) -> stream;
  # A batch of deliveries, oldest first. This is a streaming call: the broker keeps a bounded
  # number of batches in flight and sends more only as earlier calls return, so a client applies
  # back-pressure simply by not returning until it has room for the batch. A copy is in flight
  # (its timeout running) from the moment it is sent: acknowledge it with `Subscription.ack`, hand
  # it back with `nack`, or extend its lease with `touch`. If the call throws, the broker treats it
  # as a disconnect of this consumer.
}

interface Subscription {
  # One consumer's handle, returned by `Broker.subscribe`. Only the consumer that received a copy
  # may ack, nack or touch it. Each call returns one `TagResult` per tag, in the order given;
  # a refused tag changes nothing.

  ack @0 (tags :List(Data)) -> (results :List(TagResult));
  # Acknowledges delivered copies. A message is deleted once every recipient it was dispatched to
  # has acknowledged it.

  nack @1 (tags :List(Data), delayMs :UInt64) -> (results :List(TagResult));
  # Hands delivered copies back for redelivery (to the next consumer of the group, or to this
  # universal consumer) after `delayMs` milliseconds, 0 meaning at once.

  touch @2 (tags :List(Data)) -> (results :List(TagResult));
  # Extends the lease of delivered copies: their in-flight timeout starts again from now.

  close @3 () -> ();
  # Ends the subscription, exactly like dropping it: unacknowledged copies are redelivered.
  # The broker stops calling `Consumer.deliver`; later calls on this capability fail.
}

enum AckLevel {
  # How far a publish must have got before the broker replies.

  durable @0;
  # Default: written and fsynced on the owning shard (and, in a cluster, committed by a quorum).
  leader @1;
  # Accepted in memory by the owning shard (the leader, in a cluster), not yet fsynced.
  none @2;
  # Accepted for processing; nothing waited on. A crash may lose the batch.
}

struct PublishMessage {
  # One message of a `Broker.publish` batch.

  topic @0 :Text;
  # Topic name: UTF-8, 1 to 255 bytes.
  payload @1 :Data;
  # The message body, opaque to the broker; at most `publish.maxMessageBytes` bytes (default 1 MiB).
  delayMs @2 :Int64;
  # Milliseconds from enqueue until the message may be delivered; 0 = at once. Negative: refused.
  ttlMs @3 :Int64;
  # Milliseconds from enqueue after which the message expires undelivered; 0 = never. A message
  # whose TTL is not longer than its delay is never delivered. Negative: refused.
  headers @4 :List(Header);
  # Optional application headers, delivered with the message unchanged and in order.
}

struct Header {
  # An application header: a key and an opaque value. Keys need not be unique.

  key @0 :Text;
  value @1 :Data;
}

struct Delivery {
  # One message delivered to a consumer.

  topic @0 :Text;
  # The topic it was published to.
  payload @1 :Data;
  # The message body as published.
  tag @2 :Data;
  # The 24-byte delivery tag to pass to `Subscription.ack`, `nack` or `touch`.
  enqueuedAtMs @3 :UInt64;
  # When the broker accepted the message, in milliseconds since the Unix epoch (broker clock).
  delayMs @4 :UInt64;
  # The delay it was published with: it became due at `enqueuedAtMs + delayMs`.
  attempt @5 :UInt32;
  # 1 on the first delivery to this recipient, then 2, 3, ... on each redelivery (after a timeout,
  # a NACK or a disconnect). Redeliveries may go to another consumer of the group.
  headers @6 :List(Header);
  # The headers it was published with.
}

enum TagResult {
  # The outcome of one tag of `Subscription.ack`, `nack` or `touch`.

  ok @0;
  # Done.
  unknownTag @1;
  # No copy with this tag is in flight for this consumer's recipient (never delivered, already
  # deleted, expired, or its lease ran out and it went back for redelivery).
  notHolder @2;
  # The copy is in flight, but held by another consumer of the group.
  alreadyAcked @3;
  # This recipient has already acknowledged this tag.
  malformed @4;
  # The tag is not 24 bytes or is not an event key.
}

struct ShardInfo {
  # One shard of the broker, from `Broker.topology`.

  shardId @0 :UInt32;
  # 0-based; the owner of a topic is its hash modulo the shard count (see the top of this file).
  host @1 :Text;
  # Host (name or IP address) of the shard's own port.
  port @2 :UInt16;
  # The shard's own port: connections to it are served on the shard's core.
  cpu @3 :UInt32;
  # The CPU the shard is pinned to.
  leaderNodeId @4 :UInt64;
  # In a cluster: the node leading this shard (0: none known yet). 0 for a standalone broker.
  term @5 :UInt64;
  # In a cluster: the shard's Raft term as this node knows it.
  leaderAddress @6 :Text;
  # In a cluster: the leader's client address, `host:port` (empty when not known). Publishes
  # and subscriptions for this shard's topics go there.
}

struct Stats {
  # Counters from `Broker.stats`. Totals count since the broker started; gauges are current.

  shards @0 :List(ShardStats);
  # One entry per shard, ordered by `shardId`.
  groups @1 :List(GroupStats);
  # One entry per recipient with state: each (topic, group) pair, and per topic one entry with
  # an empty `group` summing its universal consumers.
}

struct ShardStats {
  # Counters of one shard.

  shardId @0 :UInt32;
  published @1 :UInt64;
  # Total messages accepted by publish.
  dispatched @2 :UInt64;
  # Total copies sent to consumers, redeliveries included.
  acked @3 :UInt64;
  # Total copies acknowledged.
  nacked @4 :UInt64;
  # Total copies handed back by nack.
  inFlight @5 :UInt64;
  # Gauge: copies sent and not yet acknowledged, nacked or timed out.
  activeConsumers @6 :UInt64;
  # Gauge: consumers connected to this shard's topics.
  redeliveries @7 :UInt64;
  # Total copies sent again after a timeout, nack or disconnect.
  expired @8 :UInt64;
  # Total messages dropped because their TTL passed.
  deleteFailures @9 :UInt64;
  # Total delete batches that failed and were queued again.
  backlog @10 :UInt64;
  # Gauge: messages stored and not yet deleted, due or scheduled.
}

struct GroupStats {
  # Counters of one recipient of a topic: a consumer group, or (empty `group`) the universal
  # consumers of the topic together.

  topic @0 :Text;
  group @1 :Text;
  shardId @2 :UInt32;
  # The shard owning the topic.
  consumers @3 :UInt32;
  # Gauge: connected consumers.
  backlog @4 :UInt64;
  # Gauge: messages due or scheduled that this recipient has not acknowledged.
  inFlight @5 :UInt64;
  # Gauge: copies sent to this recipient and not yet settled.
  dispatched @6 :UInt64;
  acked @7 :UInt64;
  nacked @8 :UInt64;
  redeliveries @9 :UInt64;
  expired @10 :UInt64;
  deadLettered @11 :UInt64;
  # Total copies moved to a dead-letter topic after too many delivery attempts.
}
