"""A client built from the protocol-1 schema (`pinq-protocol1.capnp`, as it was before protocol 2
and before the statistics' `backlog` changed meaning) against the current broker: `hello` with
version 1, refusals as exceptions whose text starts with their code, deliveries through the
old streaming `deliver`, ACKs, and `backlog` read with its protocol-1 meaning. Also: refusals
of `subscribe` and `setGroupPolicy` sent as exceptions start with their code (protocol 2)."""

import asyncio
import os

import capnp
import pytest

import pinq
from conftest import Broker

HERE = os.path.dirname(os.path.abspath(__file__))
WAIT_S = 15


def load_v1():
    # The old schema declares `deliver` as streaming, which needs /capnp/stream.capnp: pycapnp
    # ships it in its package directory. A parser of its own keeps it apart from the current
    # schema (both files have the same id).
    include = os.path.dirname(os.path.dirname(capnp.__file__))
    return capnp.SchemaParser().load(os.path.join(HERE, "pinq-protocol1.capnp"), imports=[include])


V1 = load_v1()


@pytest.fixture
def small_broker():
    b = Broker(
        ["--storage", "memory", "--cpus", "0"],
        env={"PINQ_DELIVERY_MAX_GROUPS_PER_SHARD": "2",
             "PINQ_DELIVERY_DELETE_BATCH_INTERVAL": "50ms"},
    ).start()
    yield b
    b.cleanup()


class Inbox(V1.Consumer.Server):
    def __init__(self, queue):
        self.queue = queue

    async def deliver(self, deliveries, **kwargs):
        for d in deliveries:
            await self.queue.put((bytes(d.payload), bytes(d.tag)))


def text_of(error) -> str:
    text = error.description
    return text[len("remote exception: "):] if text.startswith("remote exception: ") else text


async def v1_broker(addr: str):
    host, port = addr.rsplit(":", 1)
    stream = await capnp.AsyncIoStream.create_connection(host=host, port=int(port))
    rpc = capnp.TwoPartyClient(stream)
    broker = rpc.bootstrap().cast_as(V1.Broker)
    hello = await broker.hello(1)
    assert hello.serverVersion == 1, "the broker answers with the version the client speaks"
    return rpc, broker


def publish_request(broker, messages, ack="durable"):
    request = broker.publish_request()
    built = request.init("messages", len(messages))
    for b, (topic, payload, delay_ms) in zip(built, messages):
        b.topic = topic
        b.payload = payload
        b.delayMs = delay_ms
    request.ackLevel = ack
    return request


async def test_protocol_1_refusals_are_exceptions_that_start_with_their_code(small_broker):
    async with capnp.kj_loop():
        rpc, broker = await v1_broker(small_broker.addr)
        with pytest.raises(capnp.KjException) as raised:
            await publish_request(broker, [("v1", b"fine", 0), ("", b"no topic", 0)]).send()
        text = text_of(raised.value)
        assert text.startswith("invalidTopic: ") and "messages[1].topic" in text, text
        with pytest.raises(capnp.KjException) as raised:
            await publish_request(broker, [("v1", b"late", -5)]).send()
        assert text_of(raised.value).startswith("invalidDelay: "), text_of(raised.value)
        with pytest.raises(capnp.KjException) as raised:
            await broker.subscribe("", "g", Inbox(asyncio.Queue()), 0)
        assert text_of(raised.value).startswith("invalidTopic: subscribe: "), text_of(raised.value)
        rpc.close()


async def test_protocol_1_client_publishes_consumes_acks_and_reads_its_backlog(small_broker):
    topic = "v1-backlog"
    async with capnp.kj_loop():
        rpc, broker = await v1_broker(small_broker.addr)
        reply = await publish_request(
            broker, [(topic, b"a", 0), (topic, b"b", 0), (topic, b"later", 60_000)]
        ).send()
        assert len(reply.tags) == 3
        queue = asyncio.Queue()
        sub = (await broker.subscribe(topic, "g", Inbox(queue), 8)).subscription
        got = [await asyncio.wait_for(queue.get(), WAIT_S) for _ in range(2)]
        assert sorted(p for p, _ in got) == [b"a", b"b"]
        acked = await sub.ack([got[0][1]])
        assert [str(r) for r in acked.results] == ["ok"]

        # Protocol 1: a group's backlog is what it has not acknowledged, due or scheduled (one
        # in flight, one scheduled); the shard's is every message stored and not deleted.
        for _ in range(WAIT_S * 20):
            stats = (await broker.stats()).stats
            group = [g for g in stats.groups if g.topic == topic and g.group == "g"]
            if group and group[0].backlog == 2 and stats.shards[0].backlog == 2:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"protocol-1 backlog: {stats}")
        rpc.close()
        # The same moment through protocol 2: only what waits to be sent counts.
        async with await pinq.connect(small_broker.addr) as client:
            v2 = await client.stats()
            g2 = next(g for g in v2.groups if g.topic == topic and g.group == "g")
            assert (g2.backlog, g2.in_flight, g2.scheduled) == (0, 1, 1)
            assert v2.shards[0].backlog == 0 and v2.shards[0].scheduled == 1


async def test_subscribe_and_group_policy_refusals_start_with_their_code(small_broker):
    async with await pinq.connect(small_broker.addr) as client:
        with pytest.raises(pinq.Refused) as refused:
            await client.group_policy("p", "", max_deliveries=3)
        assert refused.value.code == "invalidRequest", refused.value
        with pytest.raises(pinq.Refused) as refused:
            await client.group_policy("p", "g", backoff=(10, 1))
        assert refused.value.code == "invalidRequest", refused.value
        with pytest.raises(pinq.Refused) as refused:
            await client.group_policy("", "g", max_deliveries=1)
        assert refused.value.code == "invalidTopic", refused.value
        # delivery.maxGroupsPerShard = 2: a third group is refused, by subscribe and by policy.
        subs = [await client.subscribe("p", group=g) for g in ("g1", "g2")]
        with pytest.raises(pinq.Refused) as refused:
            await client.subscribe("p", group="g3")
        assert refused.value.code == "tooManyGroups", refused.value
        assert refused.value.message.startswith("tooManyGroups: subscribe: ")
        # ... and past maxGroupsPerShard policies, a third policy.
        for g in ("g1", "g2"):
            await client.group_policy("p", g, max_deliveries=2)
        with pytest.raises(pinq.Refused) as refused:
            await client.group_policy("p", "g4", max_deliveries=2)
        assert refused.value.code == "tooManyGroups", refused.value
        assert refused.value.message.startswith("tooManyGroups: setGroupPolicy: ")
        for s in subs:
            await s.close()
