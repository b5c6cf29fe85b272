# pinq client protocol (Cap'n Proto RPC).
#
# This file is the whole contract between pinq and its clients: a client in any language with a
# Cap'n Proto RPC implementation can use the broker from it alone.
#
# Loading
# -------
# The file imports nothing: it needs no import path and no other schema file.
#   pycapnp:   pinq = capnp.load("pinq.capnp")
#   C++:       capnp compile -oc++ pinq.capnp
#   Rust:      capnp compile -orust pinq.capnp, or capnpc::CompilerCommand::new().file("pinq.capnp")
#              .run() in build.rs (pinq's own build.rs, into src/rpc/pinq_capnp.rs)
#   Go:        capnpc-go wants `$Go.package` and `$Go.import` annotations: add them (and the
#              import of go.capnp they need) to a copy of this file, then
#              capnp compile -I<go-capnp>/std -ogo pinq.capnp
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
# a token without the permission, a bound such as `publish.maxBytesInFlight` or a full disk, ...)
# is answered with a `Refusal`: a `RefusalCode` to match on, the index of the offending entry of
# the batch, a sentence for people, and whether the same request may succeed later. A refused
# batch writes nothing: batches are atomic. How the refusal travels depends on the version the
# connection's `hello` negotiated:
#
# - protocol 2 (`clientVersion` >= 2): in the `refusal` field of the results of `publish`, `ack`,
#   `nack` and `touch`. The call returns normally, with `tags` (or `results`) empty; a client
#   must check `refusal.code != none` before it reads anything else.
# - protocol 1: as a Cap'n Proto exception whose description is the refusal's `message` (for a
#   code of `rpc::refusal` it starts with the code, a colon and a space; a batch's index appears
#   inside the sentence, `messages[3].topic`): type `overloaded` when `retryable`, else `failed`.
#   A v1 client would otherwise take a refused batch for a stored one with no tags.
#
# The other calls (`hello`, `subscribe`, the admin calls) refuse with exceptions in both versions,
# their text "code: sentence" where a code applies. Exceptions also stay for what is not a refusal
# of the request: `disconnected` means the connection or the shard behind it is gone, `failed`
# without a refusal a malformed message or an internal failure (the request may or may not have
# taken effect). Per-tag outcomes of ack/nack/touch are not refusals: they come back as a
# `TagResult` per tag.
#
# Delivery tags
# -------------
# A delivery tag is the message's 24-byte event key: big-endian
# `topicHash :UInt64 | dueBucket :UInt64 | eventId :UInt64`. Treat it as opaque bytes: keep it
# from the `publish` reply or the `Delivery`, and hand it back to `ack`, `nack` or `touch`.

@0x88d5e0f10fc40177;

const protocolVersion :UInt32 = 2;
# The protocol version this schema describes, sent in `Broker.hello`. It changes only when a
# change is not backward compatible; fields and methods added later keep the version.
# Version 2: refusals of `publish`, `ack`, `nack` and `touch` come in the results' `refusal`
# field instead of as exceptions (see "Errors" above), and the statistics' `backlog` counts only
# what waits to be sent. The broker still speaks version 1, with version 1's meanings.

const noIndex :UInt32 = 0xffffffff;
# `Refusal.index` when the refusal is about the call as a whole, not one entry of its batch.

const anyShard :UInt32 = 0xffffffff;
# The `shardId` that `Broker.hello` answers on the shared client port (any shard may serve it).

const tagBytes :UInt32 = 24;
# Length of every delivery tag, in bytes.

const consumerIdBytes :UInt32 = 16;
# Length of a consumer id (a UUID, RFC 4122 byte order), in bytes.

interface Broker {
  # The bootstrap capability of a pinq connection.

  hello @0 (clientVersion :UInt32, token :Data)
      -> (serverVersion :UInt32, shardCount :UInt32, shardId :UInt32, members :List(Text));
  # Version handshake: call once, first. Every other call before a successful `hello` fails
  # (type `failed`, text `helloRequired: ...`). `clientVersion` is the `protocolVersion` the
  # client was built against; a version the broker does not speak fails the call
  # (`unsupportedVersion: ...`; this broker speaks 1 and 2). Otherwise it answers with the
  # version the connection speaks from then on, which is `clientVersion` (a client must stop if
  # it does not support the answer), its number of shards, and the shard whose port this
  # connection reached (`anyShard` on the shared client port). A client of version 2 talking to
  # a broker that refuses it may call `hello` again with 1 and read refusals as exceptions.
  #
  # `token` (added after protocol version 1; old clients leave it empty): the secret bytes of
  # an access token. When the broker is configured with tokens (`[[auth.tokens]]`), `hello`
  # without one, or with one it does not accept, fails with `unauthenticated: ...`, and the
  # connection can do nothing but call `hello` again. With a token, each later call is checked
  # against its permissions (topic prefixes to publish to and to consume from, admin calls);
  # a call outside them fails with `forbidden: ...` naming the token, the action and the topic.
  # A broker without tokens ignores the field. Send tokens only over TLS.
  #
  # `members` (added after protocol version 2; empty from older brokers and from a standalone
  # one): the client address of every member of the cluster, this node included, as this node
  # knows them. A client learns the whole cluster in the handshake, so a seed that dies right
  # after answering it still leaves the client the other members to try.

  publish @1 (messages :List(PublishMessage), ackLevel :AckLevel)
      -> (tags :List(Data), notLeader :NotLeader, refusal :Refusal);
  # Publishes a batch of messages, possibly to several topics. The batch is atomic: if any
  # message is refused (see "Errors" above), nothing is written and, on protocol 2, `refusal`
  # says why and which message (`index`); `tags` is then empty. The reply
  # comes once the batch has reached `ackLevel`; `tags` holds each message's 24-byte delivery tag,
  # in the order of `messages`. An empty batch is allowed and returns no tags.
  #
  # In a cluster, only the leader of a shard stores its topics' messages. If `notLeader` is set
  # in the reply, this node does not lead a shard the batch needs: `tags` is empty and nothing
  # was stored; send the batch to `notLeader.leaderAddress` (or, while it is empty, retry after
  # a short wait). A batch whose topics belong to shards led by different nodes must be split by
  # shard (the owner of a topic is given at the top of this file). If the call fails instead
  # (an exception) while a leader changes, the batch may or may not be stored: publishing it
  # again is at-least-once. A refusal, unlike an exception, always means nothing was stored.

  subscribe @2 (topic :Text, group :Text, consumer :Consumer, queueSize :UInt32)
      -> (subscription :Subscription, consumerId :Data, notLeader :NotLeader, queueSize :UInt32,
          maxUnacked :UInt32);
  # Registers `consumer` for `topic`. A non-empty `group` makes it a competing consumer: each
  # message goes to exactly one consumer of the group (round-robin). An empty `group` makes it a
  # universal consumer: it gets every message (fan-out). Each group and each universal consumer
  # is a separate recipient with its own copy of every message, acknowledged on its own.
  #
  # `queueSize` bounds the deliveries the broker has sent to this consumer in `deliver` calls
  # that have not returned, plus those it has queued for it; 0 means the broker's
  # `delivery.consumerQueueSize`, and larger values are capped by it. The reply's `queueSize` is
  # the bound in force. Apart from that, the consumer never holds more than the reply's
  # `maxUnacked` copies unacknowledged (`delivery.maxUnackedPerConsumer`). A consumer at either
  # bound is skipped: the copy goes to another consumer of the group with room, at once, or
  # waits. A copy whose lease ran out goes preferably to another consumer than the one that let
  # it run out. Deliveries arrive as `Consumer.deliver` calls (see below).
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

  setGroupPolicy @7 (topic :Text, group :Text,
                     setMaxDeliveries :Bool, maxDeliveries :UInt32,
                     setDeadLetterTopic :Bool, deadLetterTopic :Text,
                     setBackoff :Bool, backoffInitialMs :UInt64, backoffMaxMs :UInt64)
      -> (policy :GroupPolicy, notLeader :NotLeader);
  # Admin: overrides the `[delivery]` redelivery defaults for one consumer group of a topic,
  # durably (a command in the shard's log; it survives restarts and replicates). Only the fields
  # whose `set...` flag is true change; with no flag set the call only reads the policy. The
  # group need not exist yet. Answers the policy now in force (defaults with overrides). In a
  # cluster only the leader of the topic's shard writes or reads it: if `notLeader` is set,
  # nothing was done and `policy` is null; call `notLeader.leaderAddress` instead.
  # `maxDeliveries`: deliveries of one copy before it goes to the dead-letter topic; 0 =
  # unlimited. `deadLetterTopic`: where its dead letters go, `{topic}` standing for `topic`;
  # empty with `setDeadLetterTopic` = back to the default. Backoff: `backoffInitialMs` 0 =
  # no backoff for this group (a plain NACK redelivers at once), else
  # 1 <= backoffInitialMs <= backoffMaxMs <= 86400000. In a cluster the call goes to the
  # topic's shard leader (like `subscribe`). Fails (`failed`, text "code: sentence") on an empty
  # group, a bad topic or bounds, or past `delivery.maxGroupsPerShard` policies
  # (`tooManyGroups`).

  changeMembership @8 (shardId :UInt32, action :MembershipAction, nodeId :UInt64,
                       raftAddress :Text, clientAddress :Text)
      -> (voters :List(UInt64), learners :List(UInt64), notLeader :NotLeader);
  # Admin, cluster only: one step of a membership change (`pinq cluster add-node` and
  # `remove-node` drive these steps; see the README's "Adding, removing and replacing a node").
  # `addLearner`, `promote` and `remove` go to the leader of `shardId` (else `notLeader` is set
  # and nothing was done) and answer once the change is committed and applied there, with the
  # shard's voters and learners then; a step already done answers at once. `addLearner` needs
  # the new node's `raftAddress` (IP:PORT, where its peers dial it) and `clientAddress`; the
  # other actions ignore them. `transferLeadership`: if this node leads `shardId`, it hands the
  # leadership to another voter (answers at once; `notLeader` names the leader otherwise).
  # `retire` goes to the node being removed itself (`nodeId` must be its id), once no shard
  # counts it a member any more: it stops serving and exits, saying why.
  # Fails (`failed`, text "code: sentence") with `membershipInProgress` (another change of the
  # shard is not finished), `lastVoter`, `notALearner`, `leadershipLost` (run the step again),
  # `notClustered` (a standalone broker) or `invalidRequest`.
}

enum MembershipAction {
  addLearner @0;
  promote @1;
  remove @2;
  transferLeadership @3;
  retire @4;
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
  role @4 :Text;
  # "voter" (it votes in every shard), "learner" (a member of some shard that does not vote in
  # every one: being added or removed), or empty (not a member as this node sees it).
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
  voters @6 :List(UInt64);
  learners @7 :List(UInt64);
  votersOutgoing @8 :List(UInt64);
  # The shard's membership as the answering node applied it; `votersOutgoing` is not empty while
  # a change is in progress (raft's joint consensus: the voters before the change).
}

struct FollowerProgress {
  nodeId @0 :UInt64;
  matchIndex @1 :UInt64;
  # The highest log index known to be on that follower.
}

interface Consumer {
  # Implemented by the client and passed to `Broker.subscribe`; the broker calls it.

  deliver @0 (deliveries :List(Delivery)) -> ();
  # A batch of deliveries, oldest first. Returning from the call is the consumer's flow control:
  # the broker never has more than the subscription's `queueSize` deliveries sent to this
  # consumer in calls that have not returned, so a client applies back-pressure simply by not
  # returning until it has room for the batch (a consumer at its bound is skipped, and the copy
  # goes to another consumer of the group). Several calls may be in flight at once; they arrive
  # in order. A copy is in flight from the moment it is sent; its lease (`inFlightTimeout`)
  # starts when this call returns (the consumer has it): acknowledge it with `Subscription.ack`,
  # hand it back with `nack`, or extend its lease with `touch`. Until the call returns the copy
  # goes to no one else; a call unanswered for the server's `deliverTimeout` resets the
  # connection. If the call throws, the broker treats it as a disconnect of this consumer.
}

interface Subscription {
  # One consumer's handle, returned by `Broker.subscribe`. Only the consumer that received a copy
  # may ack, nack or touch it. Each call returns one `TagResult` per tag, in the order given;
  # a refused tag changes nothing. A call refused as a whole (the subscription is closed or was
  # ended by the broker, too many calls in flight) changes nothing either: on protocol 2 its
  # `refusal` is set (`index` = `noIndex`) and `results` is empty (see "Errors" above).

  ack @0 (tags :List(Data), level :AckLevel) -> (results :List(TagResult), refusal :Refusal);
  # Acknowledges delivered copies. A message is deleted once every recipient it was dispatched to
  # has acknowledged it. `level` says when the reply comes (unset = `durable`):
  # - `durable`: once what the ACK changed is committed: the message's delete (or, while other
  #   groups still hold copies, the record that this group is done) is fsynced on the owning
  #   shard, and in a cluster committed by a quorum. After an `ok` at this level the copy is never
  #   delivered again: not after a crash, a failover, a pause or a healed partition. The commit
  #   starts at once (it does not wait for `delivery.deleteBatchInterval`).
  # - `leader` (and `none`, which means the same here): once the owning shard accepted the ACK in
  #   memory. A crash or failover before the delete commits may deliver the copy again.

  nack @1 (tags :List(Data), delayMs :UInt64, level :AckLevel)
      -> (results :List(TagResult), refusal :Refusal);
  # Hands delivered copies back for redelivery (to the next consumer of the group, or to this
  # universal consumer) after `delayMs` milliseconds, 0 meaning at once. `level` as for `ack`:
  # at `durable` (unset) the reply comes once the copy's delivery count is committed, so the
  # `attempt` of its redelivery, and `maxDeliveries`, hold across a crash or failover.

  touch @2 (tags :List(Data)) -> (results :List(TagResult), refusal :Refusal);
  # Extends the lease of delivered copies: their in-flight timeout starts again from now.

  close @3 () -> ();
  # Ends the subscription, exactly like dropping it: unacknowledged copies are redelivered.
  # The broker stops calling `Consumer.deliver`; later calls on this capability fail.
}

enum AckLevel {
  # How far a publish (or an `ack`/`nack` of a `Subscription`) must have got before the broker
  # replies.

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
  producerId @5 :Text;
  # Optional, for idempotent publish: who numbers this message (UTF-8, at most 255 bytes; empty
  # or unset = not idempotent, `sequence` is then ignored). Pick one id per logical producer
  # that survives its restarts (a host and process name, a job id), not one per connection.
  sequence @6 :UInt64;
  # With `producerId`: this message's number in the producer's sequence. Within
  # `publish.dedupWindow` (default 2 min) of storing a (producerId, sequence), the shard does not
  # store a message with the same pair again: the publish answers with the tag of the message
  # first stored, so a batch retried after a failure or a timeout is consumed once. Numbers need
  # not be consecutive nor increasing; the pair is kept per shard (per topic owner), so reuse a
  # number only for the same message. Bounds (`publish.dedupMaxProducers`, least recently used
  # producer forgotten first; `publish.dedupMaxEntries`, oldest pair first) may end a pair's
  # window early: see the README, "Idempotent publish".
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
  # One entry per recipient with members or claims: each (topic, group) pair, and per topic one
  # entry with an empty `group` summing its universal consumers. Ordered by shard, topic, group.
  topics @2 :List(TopicStats);
  # One entry per topic with stored messages or consumers, ordered by shard and topic. A shard
  # counts at most `delivery.maxCountedTopics` topics one by one; the messages of the others are
  # summed in one entry with an empty `topic`.
}

struct TopicStats {
  # Messages of one topic on its shard, read at the time of the call.

  topic @0 :Text;
  shardId @1 :UInt32;
  stored @2 :UInt64;
  # Gauge: messages in the store (not yet deleted).
  due @3 :UInt64;
  # Gauge: stored messages that are due (`stored` = `due` + `scheduled`).
  scheduled @4 :UInt64;
  # Gauge: stored messages whose delay has not passed yet.
  inFlight @5 :UInt64;
  # Gauge: of the due messages, those dispatched and not yet deleted (some recipient has not
  # settled its copy, or the delete is being written).
  groups @6 :UInt32;
  # Gauge: consumer groups of the topic (its universal consumers, which belong to no group, are
  # not counted; earlier brokers counted them as one more group).
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
  # Gauge: copies held by consumers (queued for them or sent) and not yet acknowledged, nacked or
  # timed out: one per (message, recipient). Earlier brokers counted messages.
  activeConsumers @6 :UInt64;
  # Gauge: consumers connected to this shard's topics.
  redeliveries @7 :UInt64;
  # Total copies sent again after a timeout, nack or disconnect.
  expired @8 :UInt64;
  # Total messages dropped because their TTL passed.
  deleteFailures @9 :UInt64;
  # Total delete batches that failed and were queued again.
  backlog @10 :UInt64;
  # Gauge: stored messages that are due and not yet dispatched, plus copies waiting to be
  # delivered again (NACKed, timed out, or released by a consumer that left). On a protocol-1
  # connection, its protocol-1 meaning: messages stored and not yet deleted, due or scheduled.
  scheduled @11 :UInt64;
  # Gauge: stored messages whose delay has not passed yet.
  counted @12 :Bool;
  # False until the shard has counted its store once since it started (within about a second,
  # plus the time to read the store): until then `backlog`, `scheduled` and the topics' figures
  # miss messages stored before the start.
  delayed @13 :UInt64;
  # Gauge: copies waiting out a NACK delay, a redelivery backoff or their move to a dead-letter
  # topic; they go back to `backlog` (or are dead-lettered) when the wait ends. Added to
  # protocol 2 later: earlier brokers leave it 0 and count these copies nowhere.
}

struct GroupPolicy {
  # The redelivery policy in force for one group: the `[delivery]` defaults with the group's
  # overrides (see `Broker.setGroupPolicy`).

  maxDeliveries @0 :UInt32;
  # Deliveries of one copy before it is dead-lettered; 0 = unlimited.
  deadLetterTopic @1 :Text;
  # The dead-letter topic of this group's topic (`{topic}` already replaced).
  backoffInitialMs @2 :UInt64;
  # Wait before the first redelivery (attempt 2) after a plain NACK or a lease timeout, doubling
  # per attempt (jitter takes up to a quarter off, never below this) up to `backoffMaxMs`;
  # 0 = no backoff (redelivered at once).
  backoffMaxMs @3 :UInt64;
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
  # Gauge: the topic's stored messages that are due and not yet dispatched, plus this
  # recipient's copies waiting to be delivered again. On a protocol-1 connection, its protocol-1
  # meaning: messages due or scheduled that this recipient has not acknowledged (this backlog
  # plus `inFlight` plus `scheduled`).
  inFlight @5 :UInt64;
  # Gauge: copies sent to this recipient and not yet settled.
  dispatched @6 :UInt64;
  acked @7 :UInt64;
  nacked @8 :UInt64;
  redeliveries @9 :UInt64;
  expired @10 :UInt64;
  deadLettered @11 :UInt64;
  # Total copies moved to a dead-letter topic after too many delivery attempts.
  scheduled @12 :UInt64;
  # Gauge: the topic's stored messages whose delay has not passed yet (they will reach this
  # recipient when due).
  delayed @13 :UInt64;
  # Gauge: this recipient's copies waiting out a NACK delay, a redelivery backoff or their move
  # to a dead-letter topic. Each copy not yet acknowledged is in exactly one of `backlog`,
  # `delayed`, `inFlight` and `scheduled` (a message not yet dispatched counts as the
  # recipient's copy of it). Added to protocol 2 later: earlier brokers leave it 0.
}

struct Refusal {
  # Why the broker refused a request (protocol 2; see "Errors" at the top of this file). Nothing
  # of the request was done. An unset `refusal` field reads as `code` = `none`: test the code,
  # not the field's presence, in any language.

  code @0 :RefusalCode;
  index @1 :UInt32 = 0xffffffff;
  # The offending entry of the request's batch (`messages[index]` of `publish`), or `noIndex`
  # when the call as a whole is refused.
  message @2 :Text;
  # For people and logs: what was refused and the bound or config key behind it. The same text
  # a protocol 1 client gets as the exception's description. Do not parse it; match on `code`.
  retryable @3 :Bool;
  # The same request may succeed later unchanged (the node is busy, its disk full): retry with a
  # backoff. False: only a change of the request or of the broker's configuration helps. A client
  # that does not know a (newer) `code` goes by this.
}

enum RefusalCode {
  # The code of a `Refusal`. Codes are protocol: new ones are added at the end, none is ever
  # renumbered or renamed. The name is also the "code: " prefix of refusals sent as exceptions.

  none @0;
  # No refusal: the request was done (what an unset `refusal` field reads as).

  tooManyConnections @1;
  # The node serves `server.maxConnections` connections already. Retryable.
  tooManyCalls @2;
  # The connection has `server.maxCallsInFlight` calls unanswered. Retryable.
  tooManySubscriptions @3;
  # The connection has `server.maxSubscriptionsPerConnection` subscriptions open.
  publishBytesInFlight @4;
  # The shard holds `publish.maxBytesInFlight` bytes of publishes not yet stored. Retryable.
  tooManyGroups @5;
  # `delivery.maxGroupsPerTopic` or `maxGroupsPerShard` reached.
  tooManyConsumers @6;
  # `delivery.maxConsumersPerGroup` reached.
  diskFull @7;
  # The shard's disk is full; writes are refused until space returns. Retryable.
  unauthenticated @8;
  # `hello` carried no token, or one the broker does not accept.
  forbidden @9;
  # The connection's token does not allow this (`index`: the message whose topic it may not
  # publish to).
  helloRequired @10;
  # A call came before a successful `hello`.
  unsupportedVersion @11;
  # `hello` carried a `clientVersion` this broker does not speak.

  invalidTopic @12;
  # `messages[index].topic` is empty or longer than 255 bytes.
  notUtf8 @13;
  # A text field of `messages[index]` (topic, header key, producer id) is not UTF-8.
  messageTooLarge @14;
  # `messages[index]`: payload and headers together exceed `publish.maxMessageBytes`.
  tooManyHeaders @15;
  # `messages[index]` has more headers than the broker takes (256).
  invalidProducerId @16;
  # `messages[index].producerId` is longer than 255 bytes.
  invalidDelay @17;
  # `messages[index].delayMs` is negative.
  invalidTtl @18;
  # `messages[index].ttlMs` is negative.
  batchTooLarge @19;
  # The batch has more messages than `publish.maxBatchMessages`.
  invalidAckLevel @20;
  # `ackLevel` is a value this broker does not know (a newer client?).
  ackLevelTooLow @21;
  # `ackLevel` is weaker than `publish.minAckLevel`.
  subscriptionClosed @22;
  # `ack`/`nack`/`touch` on a subscription that was closed, or that the broker ended (its shard
  # changed leader, or its consumer is gone): subscribe again. The copies it held are redelivered.
  invalidRequest @23;
  # Another field of the request breaks the protocol; `message` names it.
}
