"""`Client`: connects to a broker (or any node of a cluster), sends each topic's requests to the
leader of the topic's shard on that shard's own port, and follows leaders across failovers.

Routing. The owner of a topic is `xxh3_64(topic, seed "pinq_top") & 2^63-1` modulo the shard
count (the schema's header). Against a standalone broker the client sends a topic's requests to
the owner's own port (from `topology`), which saves the broker a hop between cores. In a cluster
it learns the members' client addresses (`clusterStatus`) and each shard's leader (`topology`);
a request answered with `notLeader` goes to the named leader, and one that meets a dead or
paused node (the connection drops, or no answer within `request_timeout`) is tried on the other
members until one answers as the leader, for at most `patience` seconds. Any port accepts any
request: routing only saves hops, and a shard port that fails falls back to the node's address.

Retrying a publish whose answer was lost may store it twice (at-least-once), unless it carries a
producer id: the broker then answers the retry with the first copy's tags. Refusals are never
retried: they mean nothing was done, and `Refused.retryable` tells the application whether to.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field, fields

import xxhash

from . import _loop
from ._conn import Connection, Security, join_address
from ._schema import ACK_LEVELS, TOPIC_HASH_MASK, TOPIC_HASH_SEED, schema
from .errors import (
    BadReply,
    ConnectionLost,
    NotLeader,
    PinqError,
    from_kj,
    is_transient,
    refusal_from_reply,
)
from .subscription import Subscription, _delay_ms


@dataclass
class Message:
    """One message of `Client.publish_messages` (per-message topic, headers, delay, TTL)."""

    topic: str
    payload: bytes
    headers: list = field(default_factory=list)  # [(key: str, value: bytes)]
    delay: float | None = None  # seconds
    ttl: float | None = None  # seconds
    producer_id: str | None = None
    sequence: int | None = None


def _camel_to_snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def _record(cls, reader):
    """A dataclass of `cls` from a capnp struct reader, camelCase fields in snake_case (fields
    this client does not know, from a newer broker, are left out)."""
    return _from_dict(cls, reader.to_dict())


def _from_dict(cls, values: dict):
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = _camel_to_snake(key)
        if name not in known:
            continue
        nested = _NESTED.get((cls, name))
        if nested is not None:
            value = [_from_dict(nested, v) for v in value]
        kwargs[name] = value
    return cls(**kwargs)


@dataclass
class ShardInfo:
    shard_id: int = 0
    host: str = ""
    port: int = 0
    cpu: int = 0
    leader_node_id: int = 0
    term: int = 0
    leader_address: str = ""

    @property
    def address(self) -> str:
        """The shard's own port, `host:port`."""
        return join_address(self.host, self.port)


@dataclass
class ShardStats:
    shard_id: int = 0
    published: int = 0
    dispatched: int = 0
    acked: int = 0
    nacked: int = 0
    in_flight: int = 0
    active_consumers: int = 0
    redeliveries: int = 0
    expired: int = 0
    delete_failures: int = 0
    backlog: int = 0
    scheduled: int = 0
    counted: bool = False
    # Copies waiting out a NACK delay, a backoff or their dead-letter publish (0 from brokers
    # older than the field). `in_flight` counts copies held by consumers.
    delayed: int = 0


@dataclass
class GroupStats:
    topic: str = ""
    group: str = ""
    shard_id: int = 0
    consumers: int = 0
    backlog: int = 0
    in_flight: int = 0
    dispatched: int = 0
    acked: int = 0
    nacked: int = 0
    redeliveries: int = 0
    expired: int = 0
    dead_lettered: int = 0
    scheduled: int = 0
    # Each copy not yet ACKed is in one of backlog, delayed, in_flight, scheduled.
    delayed: int = 0


@dataclass
class TopicStats:
    topic: str = ""
    shard_id: int = 0
    stored: int = 0
    due: int = 0
    scheduled: int = 0
    in_flight: int = 0
    groups: int = 0


@dataclass
class Stats:
    shards: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    topics: list = field(default_factory=list)


@dataclass
class GroupPolicy:
    max_deliveries: int = 0
    dead_letter_topic: str = ""
    backoff_initial_ms: int = 0
    backoff_max_ms: int = 0


@dataclass
class NodeStatus:
    id: int = 0
    raft_address: str = ""
    client_address: str = ""
    reachable: bool = False


@dataclass
class FollowerProgress:
    node_id: int = 0
    match_index: int = 0


@dataclass
class ShardReplica:
    shard_id: int = 0
    leader_node_id: int = 0
    term: int = 0
    commit_index: int = 0
    applied_index: int = 0
    followers: list = field(default_factory=list)


@dataclass
class ClusterStatus:
    node_id: int = 0
    nodes: list = field(default_factory=list)
    shards: list = field(default_factory=list)


_NESTED = {
    (Stats, "shards"): ShardStats,
    (Stats, "groups"): GroupStats,
    (Stats, "topics"): TopicStats,
    (ClusterStatus, "nodes"): NodeStatus,
    (ClusterStatus, "shards"): ShardReplica,
    (ShardReplica, "followers"): FollowerProgress,
}


class _NotLeaderHint(PinqError):
    """Internal: a node answered `notLeader`; the router follows it."""

    def __init__(self, hint):
        super().__init__(f"not the leader of shard {hint.shardId}")
        self.shard_id = int(hint.shardId)
        self.leader_address = str(hint.leaderAddress)
        self.term = int(hint.term)


def topic_shard(topic: str, shard_count: int) -> int:
    """The shard that owns `topic` among `shard_count` (the schema's header)."""
    digest = xxhash.xxh3_64_intdigest(topic.encode(), seed=TOPIC_HASH_SEED)
    return (digest & TOPIC_HASH_MASK) % max(1, shard_count)


class Client:
    """A pinq client. Make one with `await pinq.connect(...)`; close it with `await
    client.close()` or use it as `async with`. Every method is a coroutine of the asyncio loop
    it was made on."""

    def __init__(self, seed: str, security: Security, timeout, request_timeout, patience):
        self._seed = seed
        self._security = security
        self._connect_timeout = timeout
        self._request_timeout = request_timeout
        self._patience = patience
        self._members = [seed]
        self._conns: dict[str, Connection] = {}
        self._leaders: dict[int, str] = {}
        # node address -> {shard id -> that node's own port of the shard}
        self._shard_ports: dict[str, dict[int, str]] = {}
        self._subscriptions: set = set()
        self._sequences: dict[str, itertools.count] = {}
        self.shard_count = 1
        self._closed = False

    # --- Connections ---------------------------------------------------------------------

    async def _open(self) -> None:
        seed = await self._conn_at(self._seed)
        self.shard_count = seed.shard_count
        await self._learn(seed)

    async def _conn_at(self, addr: str, server_name=None) -> Connection:
        conn = self._conns.get(addr)
        if conn is not None and not conn.lost.is_set():
            return conn
        if self._closed:
            raise ConnectionLost("the client is closed")
        conn = await Connection.open(addr, self._security, self._connect_timeout, server_name)
        self._conns[addr] = conn
        return conn

    def _forget(self, addr: str) -> None:
        conn = self._conns.pop(addr, None)
        if conn is not None:
            conn.close()

    async def _learn(self, conn: Connection) -> None:
        """Learns the members' addresses, the shards' leaders and `conn`'s node's shard ports."""
        try:
            status = await conn.call(conn.broker.clusterStatus(), self._request_timeout)
            for node in status.status.nodes:
                addr = str(node.clientAddress)
                if addr and addr not in self._members:
                    self._members.append(addr)
            topology = await conn.call(conn.broker.topology(), self._request_timeout)
        except PinqError:
            return  # another node (or a later try) will tell
        ports = {}
        for shard in topology.shards:
            ports[int(shard.shardId)] = join_address(str(shard.host), int(shard.port))
            if shard.leaderAddress:
                self._leaders[int(shard.shardId)] = str(shard.leaderAddress)
        self._shard_ports[conn.addr] = ports

    @property
    def is_cluster(self) -> bool:
        """Whether the broker is a cluster with other members to fail over to."""
        return len(self._members) > 1

    def shard_of(self, topic: str) -> int:
        """The shard that owns `topic`."""
        return topic_shard(topic, self.shard_count)

    def _node_for(self, shard: int, attempt: int) -> str:
        """The node to try for `shard`: its leader when known, otherwise members in turn."""
        leader = self._leaders.get(shard)
        if leader:
            return leader
        if len(self._members) == 1:
            return self._members[0]
        return self._members[attempt % len(self._members)]

    async def _conn_for(self, shard: int, node: str) -> Connection:
        """A connection to `shard`'s own port on `node` when known and reachable, else to
        `node`'s client port."""
        node_conn = await self._conn_at(node)
        if node not in self._shard_ports:
            await self._learn(node_conn)
        port = self._shard_ports.get(node, {}).get(shard)
        if port is None or port == node:
            return node_conn
        try:
            return await self._conn_at(port, node_conn.server_name)
        except PinqError:
            # A shard port behind a firewall or on another interface: the node's port works.
            self._shard_ports[node].pop(shard, None)
            return node_conn

    async def _routed(self, shard: int, call):
        """Runs `call(conn)` against `shard`'s leader, following `notLeader` hints and
        skipping dead or paused nodes, for at most `patience` seconds."""
        deadline = time.monotonic() + self._patience
        for attempt in itertools.count():
            node = self._node_for(shard, attempt)
            try:
                conn = await self._conn_for(shard, node)
                return await call(conn)
            except _NotLeaderHint as hint:
                if hint.leader_address and hint.leader_address != node:
                    self._leaders[shard] = hint.leader_address
                else:
                    self._leaders.pop(shard, None)
                error: PinqError = NotLeader(shard, hint.leader_address, hint.term)
            except PinqError as e:
                if not is_transient(e):
                    raise
                self._forget_node(node)
                self._leaders.pop(shard, None)
                error = e
            if time.monotonic() >= deadline or self._closed:
                raise error
            if shard not in self._leaders:
                # No leader named: give the election a moment.
                await asyncio.sleep(min(0.3, 0.02 * 2 ** min(attempt, 4)))
        raise AssertionError("unreachable")

    def _forget_node(self, node: str) -> None:
        """Drops the connections to `node` and to its shard ports (it died or paused)."""
        for addr in [node, *self._shard_ports.get(node, {}).values()]:
            self._forget(addr)
        self._shard_ports.pop(node, None)

    async def _any(self, call):
        """Runs `call(conn)` on the seed, or on any member that answers."""
        last = None
        for node in list(self._members):
            try:
                return await call(await self._conn_at(node))
            except PinqError as e:
                if not is_transient(e):
                    raise
                self._forget_node(node)
                last = e
        raise last

    # --- Publishing ------------------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        payloads,
        ack_level: str = "durable",
        delay=None,
        ttl=None,
        producer_id: str | None = None,
        *,
        sequence=None,
        headers=None,
    ) -> list:
        """Publishes `payloads` (a list of bytes) to `topic` as one atomic batch; returns each
        message's 24-byte delivery tag, in order.

        `ack_level`: "durable" (fsynced, and in a cluster committed by a quorum), "leader"
        (accepted in memory) or "none". `delay`/`ttl`: seconds (float or timedelta) applied to
        every message. `producer_id` makes the publish idempotent: each message is numbered
        (`sequence`: the first number, or one number per message; default the client's own
        counter), and a batch retried after a lost answer is stored once. `headers`: a list of
        (key, value bytes) given to every message. Raises `Refused` when the broker refuses the
        batch (nothing stored)."""
        payloads = list(payloads)
        numbers = self._sequence_numbers(producer_id, sequence, len(payloads))
        messages = [
            Message(topic, p, list(headers or []), delay, ttl, producer_id, n)
            for p, n in zip(payloads, numbers)
        ]
        return await self._publish_shard(self.shard_of(topic), messages, ack_level)

    async def publish_messages(self, messages, ack_level: str = "durable") -> list:
        """Publishes `Message`s, possibly to several topics; returns their tags in order. The
        messages of each shard go in one atomic batch, the shards' batches concurrently: a
        refusal of one shard's batch (raised) does not undo another's."""
        messages = list(messages)
        by_shard: dict[int, list[int]] = {}
        for i, m in enumerate(messages):
            by_shard.setdefault(self.shard_of(m.topic), []).append(i)
        replies = await asyncio.gather(
            *(
                self._publish_shard(shard, [messages[i] for i in idx], ack_level)
                for shard, idx in by_shard.items()
            )
        )
        tags = [b""] * len(messages)
        for idx, shard_tags in zip(by_shard.values(), replies):
            for i, tag in zip(idx, shard_tags):
                tags[i] = tag
        return tags

    def _sequence_numbers(self, producer_id, sequence, count) -> list:
        if not producer_id:
            return [None] * count
        if sequence is None:
            # Microseconds since the epoch at the first publish: a restarted producer starts
            # above every number it used before unless it published over a million a second.
            counter = self._sequences.setdefault(
                producer_id, itertools.count(time.time_ns() // 1000)
            )
            return [next(counter) for _ in range(count)]
        if isinstance(sequence, int):
            return list(range(sequence, sequence + count))
        numbers = list(sequence)
        if len(numbers) != count:
            raise ValueError(f"{len(numbers)} sequence numbers for {count} messages")
        return numbers

    async def _publish_shard(self, shard: int, messages: list, ack_level: str) -> list:
        if ack_level not in ACK_LEVELS:
            raise ValueError(f"ack_level {ack_level!r} is not one of {', '.join(ACK_LEVELS)}")
        if not messages:
            return []

        async def send(conn: Connection):
            request = conn.broker.publish_request()
            _write_messages(request.init("messages", len(messages)), messages)
            request.ackLevel = ack_level
            reply = await conn.call(request.send(), self._request_timeout)
            refused = refusal_from_reply(reply.refusal)
            if refused is not None:
                raise refused
            if reply._has("notLeader"):
                raise _NotLeaderHint(reply.notLeader)
            tags = [bytes(t) for t in reply.tags]
            if len(tags) != len(messages):
                raise BadReply(f"publish answered {len(tags)} tags for {len(messages)} messages")
            return tags

        return await self._routed(shard, send)

    # --- Consuming -------------------------------------------------------------------------

    async def subscribe(
        self,
        topic: str,
        group: str = "",
        queue_size: int = 0,
        *,
        ack_window: float = 0.0,
        ack_max_tags: int = 0,
        follow: bool = True,
    ) -> Subscription:
        """Subscribes to `topic` on the leader of its shard: as a member of `group` (each
        message to one member), or with `group=""` as a universal consumer (every message).

        `queue_size` bounds the deliveries the broker sends ahead (0: the broker's
        `delivery.consumerQueueSize`). `ack_window` > 0 groups the ACKs given within that many
        seconds into one call (at most `ack_max_tags` tags, 0 = 4096). `follow` (default) makes
        the subscription subscribe again on the new leader when its shard's leader changes;
        with `follow=False` iteration raises `SubscriptionEnded` or `ConnectionLost` instead."""
        if not 0 <= queue_size < 2**32:
            raise ValueError(f"queue_size {queue_size} is not a UInt32")
        sub = Subscription(self, topic, group, queue_size, ack_window, ack_max_tags, follow)
        await sub._attach()
        self._subscriptions.add(sub)
        return sub

    async def _subscribe_once(self, sub: Subscription):
        """Subscribes `sub` on its shard's leader; returns the new attachment."""

        async def send(conn: Connection):
            attachment = sub._attachment_for(conn, sub.topic)
            request = conn.broker.subscribe_request()
            request.topic = sub.topic
            request.group = sub.group
            request.consumer = attachment.consumer()
            request.queueSize = sub._queue_size_asked
            reply = await conn.call(request.send(), self._request_timeout)
            if reply._has("notLeader"):
                raise _NotLeaderHint(reply.notLeader)
            attachment.capability = reply.subscription
            attachment.consumer_id = bytes(reply.consumerId)
            attachment.queue_size = int(reply.queueSize)
            attachment.max_unacked = int(reply.maxUnacked)
            return attachment

        return await self._routed(self.shard_of(sub.topic), send)

    # --- Administration and figures --------------------------------------------------------

    async def topology(self) -> list:
        """The broker's shards (`ShardInfo`), with each shard's own port and, in a cluster,
        its leader as the answering node knows it."""
        reply = await self._any(lambda c: c.call(c.broker.topology(), self._request_timeout))
        return [_record(ShardInfo, s) for s in reply.shards]

    async def stats(self) -> Stats:
        """Counters of every shard, topic and group of the answering node (`Stats`)."""
        reply = await self._any(lambda c: c.call(c.broker.stats(), self._request_timeout))
        return _record(Stats, reply.stats)

    async def cluster_status(self) -> ClusterStatus:
        """The answering node's view of the cluster (node id 0 and no nodes standalone)."""
        reply = await self._any(
            lambda c: c.call(c.broker.clusterStatus(), self._request_timeout)
        )
        return _record(ClusterStatus, reply.status)

    async def group_policy(
        self,
        topic: str,
        group: str,
        *,
        max_deliveries: int | None = None,
        dead_letter_topic: str | None = None,
        backoff: tuple | None = None,
    ) -> GroupPolicy:
        """Reads, or with any keyword set changes, the redelivery policy of one group (on the
        leader of the topic's shard); returns the policy in force. `backoff` is (initial, max)
        in seconds, or (0, 0) for none; `dead_letter_topic=""` restores the default."""

        async def send(conn: Connection):
            request = conn.broker.setGroupPolicy_request()
            request.topic = topic
            request.group = group
            if max_deliveries is not None:
                request.setMaxDeliveries = True
                request.maxDeliveries = max_deliveries
            if dead_letter_topic is not None:
                request.setDeadLetterTopic = True
                request.deadLetterTopic = dead_letter_topic
            if backoff is not None:
                request.setBackoff = True
                request.backoffInitialMs = _delay_ms(backoff[0])
                request.backoffMaxMs = _delay_ms(backoff[1])
            reply = await conn.call(request.send(), self._request_timeout)
            if reply._has("notLeader"):
                raise _NotLeaderHint(reply.notLeader)
            return _record(GroupPolicy, reply.policy)

        return await self._routed(self.shard_of(topic), send)

    async def forget_group(self, topic: str, group: str) -> None:
        """Admin: forgets a consumer group of a topic at once (on its shard's leader)."""

        async def send(conn: Connection):
            await conn.call(conn.broker.forgetGroup(topic, group), self._request_timeout)

        await self._routed(self.shard_of(topic), send)

    # --- Lifetime --------------------------------------------------------------------------

    async def close(self) -> None:
        """Closes the subscriptions (the broker redelivers what they held) and connections."""
        if self._closed:
            return
        for sub in list(self._subscriptions):
            try:
                await sub.close()
            except PinqError:
                pass
        self._closed = True
        for addr in list(self._conns):
            self._forget(addr)
        await asyncio.sleep(0)
        await _loop.release()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


def _write_messages(builder, messages) -> None:
    for b, m in zip(builder, messages):
        b.topic = m.topic
        b.payload = bytes(m.payload)
        if m.delay is not None:
            b.delayMs = _delay_ms(m.delay)
        if m.ttl is not None:
            b.ttlMs = _delay_ms(m.ttl)
        if m.headers:
            hs = b.init("headers", len(m.headers))
            for h, (key, value) in zip(hs, m.headers):
                h.key = key
                h.value = value.encode() if isinstance(value, str) else bytes(value)
        if m.producer_id:
            b.producerId = m.producer_id
            b.sequence = m.sequence


async def connect(
    addr: str,
    tls=None,
    token=None,
    *,
    tls_server_name: str | None = None,
    timeout: float = 10.0,
    request_timeout: float = 10.0,
    patience: float = 30.0,
) -> Client:
    """Connects to a pinq broker, or to any node of a cluster, at `addr` ("HOST:PORT").

    `tls`: None (plain TCP), True (trust the system's CAs), the path of a CA file (PEM), or an
    `ssl.SSLContext` (client certificates). `token`: the access token (str or bytes) the broker
    checks in `hello`. `tls_server_name`: the name on the broker's certificate when it is not
    the host of `addr`. `timeout`: to connect; `request_timeout`: for one answer; `patience`:
    how long a request keeps following leaders across nodes before its error is raised."""
    security = Security.of(tls, token, tls_server_name)
    await _loop.acquire()
    client = Client(addr, security, timeout, request_timeout, patience)
    try:
        await client._open()
    except BaseException:
        await client.close()
        raise
    return client
