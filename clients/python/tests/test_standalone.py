"""The client against a standalone broker (two shards, memory storage): the contract of the
README, refusals, flow control, ack/nack/touch, ACK grouping, idempotent publish, group policies,
statistics and routing to a shard's own port."""

import asyncio
import uuid

import pytest

import pinq

# Every wait for the broker is bounded; none asserts on how long it took.
WAIT_S = 15


def topic(name: str) -> str:
    """A topic of its own per test, so tests sharing the broker do not see each other's."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def take(sub, count: int) -> list:
    deliveries = []
    while len(deliveries) < count:
        deliveries.append(await sub.recv(timeout=WAIT_S))
    return deliveries


async def wait_stats(client, check, what: str):
    """Polls `stats` until `check(stats)` holds (bounded)."""
    for _ in range(WAIT_S * 20):
        stats = await client.stats()
        if check(stats):
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: last stats {stats}")


async def test_publish_subscribe_ack_round_trip(broker):
    t = topic("round-trip")
    async with await pinq.connect(broker.addr) as client:
        sub = await client.subscribe(t, group="workers")
        tags = await client.publish(t, [b"one", b"two", b"three"])
        assert len(tags) == 3 and all(len(tag) == pinq.TAG_BYTES for tag in tags)
        got = {}
        async for d in sub:
            assert d.topic == t and d.attempt == 1 and d.headers == []
            assert type(d.payload) is bytes and type(d.tag) is bytes
            assert await d.ack() == "ok"
            got[d.payload] = d.tag
            if len(got) == 3:
                break
        assert got == {b"one": tags[0], b"two": tags[1], b"three": tags[2]}
        # A second ACK of the same tag is not "ok": the copy is gone.
        assert await sub.ack([tags[0]]) != ["ok"]
        await sub.close()


async def test_refusals_are_typed_with_code_index_and_retryable(broker):
    t = topic("refused")
    async with await pinq.connect(broker.addr) as client:
        with pytest.raises(pinq.Refused) as refused:
            await client.publish(t, [b"small", b"x" * (17 * 1024)])
        assert refused.value.code == "messageTooLarge"
        assert refused.value.index == 1
        assert refused.value.retryable is False
        assert "16384" in refused.value.message or "maxMessageBytes" in refused.value.message
        with pytest.raises(pinq.Refused) as refused:
            await client.publish("", [b"no topic"])
        assert (refused.value.code, refused.value.index) == ("invalidTopic", 0)
        with pytest.raises(pinq.Refused) as refused:
            await client.publish_messages(
                [pinq.Message(t, b"ok"), pinq.Message(t, b"bad", headers=[("k", b"v")] * 300)]
            )
        assert (refused.value.code, refused.value.index) == ("tooManyHeaders", 1)
        # A refused batch stored nothing.
        stats = await client.stats()
        assert not [s for s in stats.topics if s.topic == t and s.stored]
        with pytest.raises(ValueError):
            await client.publish(t, [b"x"], ack_level="fsync")


async def test_group_members_share_and_universal_consumers_each_get_every_message(broker):
    t = topic("fanout")
    async with await pinq.connect(broker.addr) as client:
        members = [await client.subscribe(t, group="g", queue_size=8) for _ in range(2)]
        universal = [await client.subscribe(t) for _ in range(2)]
        assert members[0].queue_size == 8
        payloads = {f"m{i}".encode() for i in range(40)}
        await client.publish(t, sorted(payloads))
        for u in universal:
            got = await take(u, 40)
            assert {d.payload for d in got} == payloads
            await u.ack([d.tag for d in got])
        seen = []
        while len(seen) < 40:
            for m in members:
                try:
                    d = await m.recv(timeout=0.2)
                except asyncio.TimeoutError:
                    continue
                seen.append((members.index(m), d.payload))
                await d.ack()
        assert sorted(p for _, p in seen) == sorted(payloads), "each message once to the group"
        for s in members + universal:
            await s.close()


async def test_nack_with_delay_touch_and_headers(broker):
    t = topic("nack")
    async with await pinq.connect(broker.addr) as client:
        sub = await client.subscribe(t, group="g")
        await client.publish(t, [b"job"], headers=[("trace", b"abc"), ("trace", b"def")])
        first = await sub.recv(timeout=WAIT_S)
        assert first.headers == [("trace", b"abc"), ("trace", b"def")]
        assert await first.touch() == "ok"
        assert await first.nack(delay=0.3) == "ok"
        again = await sub.recv(timeout=WAIT_S)
        assert (again.payload, again.attempt, again.tag) == (b"job", 2, first.tag)
        with pytest.raises(ValueError):
            await again.nack(level="fsync")
        assert await again.nack(level="leader") == "ok"
        third = await sub.recv(timeout=WAIT_S)
        assert third.attempt == 3
        assert await third.ack() == "ok"
        # Settling a copy this consumer no longer holds is a per-tag result, not an error.
        assert await first.ack() in ("unknownTag", "alreadyAcked")


async def test_a_nacked_copy_waiting_out_its_delay_is_counted_as_delayed(broker):
    t = topic("delayed")
    async with await pinq.connect(broker.addr) as client:
        sub = await client.subscribe(t, group="g")
        await client.publish(t, [b"a", b"b", b"c"])
        got = await take(sub, 3)
        assert await got[0].nack(delay=3600) == "ok"
        assert await got[1].ack() == "ok"

        def gauges(s):
            g = next((g for g in s.groups if g.topic == t and g.group == "g"), None)
            return g and (g.backlog, g.delayed, g.in_flight, g.scheduled)

        # Each copy not yet ACKed is in one gauge: one delayed, one held.
        stats = await wait_stats(client, lambda s: gauges(s) == (0, 1, 1, 0), "one delayed")
        shard = next(sh for sh in stats.shards if any(
            g.shard_id == sh.shard_id and g.topic == t for g in stats.groups))
        assert shard.delayed >= 1 and shard.in_flight >= 1


async def test_delay_ttl_and_ack_levels(broker):
    t = topic("delay")
    async with await pinq.connect(broker.addr) as client:
        sub = await client.subscribe(t, group="g")
        await client.publish(t, [b"later"], ack_level="leader", delay=0.5)
        # A TTL not longer than its delay: never delivered, counted as expired.
        await client.publish(t, [b"never"], ack_level="none", delay=0.4, ttl=0.2)
        d = await sub.recv(timeout=WAIT_S)
        assert (d.payload, d.delay_ms) == (b"later", 500)
        assert await d.ack(level="leader") == "ok"
        await wait_stats(
            client,
            lambda s: any(g.topic == t and g.expired >= 1 for g in s.groups)
            or sum(sh.expired for sh in s.shards) >= 1,
            "the message whose TTL passed is counted as expired",
        )


async def test_an_ack_after_the_ttl_answers_unknown_tag(broker):
    t = topic("ttl-ack")
    async with await pinq.connect(broker.addr) as client:
        sub = await client.subscribe(t, group="g")
        await client.publish(t, [b"short-lived"], ttl=0.3)
        d = await sub.recv(timeout=WAIT_S)
        await wait_stats(
            client,
            lambda s: any(g.topic == t and g.expired == 1 for g in s.groups),
            "the delivered copy expired (janitor sweep every 200 ms)",
        )
        # As the schema and the README say: the copy is gone, not held by another consumer.
        assert await d.ack() == "unknownTag"


async def test_producer_id_makes_a_retried_batch_idempotent(broker):
    t = topic("dedup")
    async with await pinq.connect(broker.addr) as client:
        first = await client.publish(t, [b"a", b"b"], producer_id="py-producer", sequence=10)
        again = await client.publish(t, [b"a", b"b"], producer_id="py-producer", sequence=10)
        assert again == first, "the broker answers a retry with the first copy's tags"
        auto = await client.publish(t, [b"c"], producer_id="py-producer")
        assert auto[0] not in first
        sub = await client.subscribe(t, group="g")
        got = await take(sub, 3)
        assert sorted(d.payload for d in got) == [b"a", b"b", b"c"]
        await sub.ack([d.tag for d in got])
        with pytest.raises(asyncio.TimeoutError):
            await sub.recv(timeout=0.5)


async def test_ack_grouping_sends_one_call_for_many_acks(broker):
    t = topic("ack-group")
    async with await pinq.connect(broker.addr) as client:
        sub = await client.subscribe(t, group="g", ack_window=0.05)
        await client.publish(t, [b"%d" % i for i in range(50)])
        got = await take(sub, 50)
        attachment = sub._current
        calls = []
        settle = attachment.settle

        async def counted(method, tags, delay_ms, level):
            calls.append((method, len(tags), level))
            return await settle(method, tags, delay_ms, level)

        attachment.settle = counted
        # Two ACK levels in one window: one grouped call per level (all 50 ACKs are given in
        # one turn of the event loop, well inside the window).
        results = await asyncio.gather(
            *(d.ack(level="leader" if i % 2 else "durable") for i, d in enumerate(got))
        )
        assert results == ["ok"] * 50
        assert sorted(calls) == [("ack", 25, "durable"), ("ack", 25, "leader")]
        stats = await wait_stats(
            client,
            lambda s: any(g.topic == t and g.group == "g" and g.acked == 50 for g in s.groups),
            "50 grouped ACKs counted",
        )
        group = next(g for g in stats.groups if g.topic == t and g.group == "g")
        assert group.in_flight == 0


async def test_closing_a_subscription_redelivers_what_it_held(broker):
    t = topic("close")
    async with await pinq.connect(broker.addr) as client:
        first = await client.subscribe(t, group="g")
        await client.publish(t, [b"held"])
        held = await first.recv(timeout=WAIT_S)
        await first.close()
        with pytest.raises(pinq.Refused) as refused:
            await held.ack()
        assert refused.value.code == "subscriptionClosed" and refused.value.index is None
        second = await client.subscribe(t, group="g")
        d = await second.recv(timeout=WAIT_S)
        assert (d.payload, d.attempt) == (b"held", 2)
        await d.ack()


async def test_group_policy_dead_letters_after_max_deliveries(broker):
    t = topic("policy")
    async with await pinq.connect(broker.addr) as client:
        policy = await client.group_policy(t, "g", max_deliveries=2, backoff=(0, 0))
        assert policy.max_deliveries == 2 and policy.dead_letter_topic == f"{t}.dlq"
        assert (await client.group_policy(t, "g")).max_deliveries == 2
        dlq = await client.subscribe(f"{t}.dlq", group="inspect")
        sub = await client.subscribe(t, group="g")
        await client.publish(t, [b"poison"])
        for attempt in (1, 2):
            d = await sub.recv(timeout=WAIT_S)
            assert d.attempt == attempt
            await d.nack()
        dead = await dlq.recv(timeout=WAIT_S)
        headers = dict(dead.headers)
        assert dead.payload == b"poison"
        assert headers["pinq-dlq-group"] == b"g" and headers["pinq-dlq-reason"] == b"nack"
        await dead.ack()


async def test_topology_stats_and_routing_to_the_shards_own_port(broker):
    async with await pinq.connect(broker.addr) as client:
        shards = await client.topology()
        assert [s.shard_id for s in shards] == [0, 1]
        assert sorted(s.port for s in shards) == sorted(broker.shard_ports)
        assert client.shard_count == 2 and not client.is_cluster
        topics = {}
        for i in range(16):
            name = topic(f"route{i}")
            topics.setdefault(client.shard_of(name), name)
        assert set(topics) == {0, 1}, "16 topics land on both shards"
        for shard, name in topics.items():
            await client.publish(name, [b"x"])
            conn = await client._conn_for(shard, broker.addr)
            assert conn.shard_id == shard, "requests go to the owner's own port"
            sub = await client.subscribe(name, group="g")
            d = await sub.recv(timeout=WAIT_S)
            await d.ack()
            await sub.close()
        stats = await client.stats()
        assert [s.shard_id for s in stats.shards] == [0, 1]
        assert sum(s.published for s in stats.shards) >= 2


async def test_a_broker_that_is_not_there_is_connection_lost(broker):
    with pytest.raises(pinq.ConnectionLost):
        await pinq.connect("127.0.0.1:1", timeout=2)
    with pytest.raises(ValueError):
        await pinq.connect("no-port")


def test_the_readme_example_runs(broker):
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(here)
    env = dict(os.environ, PYTHONPATH=package + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, os.path.join(package, "examples", "quickstart.py"), broker.addr],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused: messageTooLarge at message 1 (retryable: False)" in out.stdout
    assert "job 3 (attempt 2)" in out.stdout and "later (attempt 1)" in out.stdout


async def test_a_dead_letter_stays_within_the_header_and_size_limits(broker):
    t = topic("dlq-limits")
    async with await pinq.connect(broker.addr) as client:
        await client.group_policy(t, "g", max_deliveries=1, backoff=(0, 0))
        dlq = await client.subscribe(f"{t}.dlq", group="inspect")
        sub = await client.subscribe(t, group="g")
        full = [(f"h{i}", b"v") for i in range(256)]
        await client.publish(t, [b"many headers"], headers=full)
        # 16 KiB is the fixture's publish.maxMessageBytes: a payload that leaves 10 bytes.
        await client.publish(t, [b"x" * (16 * 1024 - 10)])
        for _ in range(2):
            d = await sub.recv(timeout=WAIT_S)
            assert await d.nack() == "ok"
        letters = {}
        for _ in range(2):
            letter = await dlq.recv(timeout=WAIT_S)
            letters[len(letter.payload)] = letter
            await letter.ack()
        many = letters[len(b"many headers")]
        keys = [k for k, _ in many.headers]
        assert len(keys) == 256, "no more headers than a publish may carry"
        assert keys[:252] == [f"h{i}" for i in range(252)], "the last application ones left out"
        assert keys[252:] == ["pinq-dlq-topic", "pinq-dlq-group", "pinq-dlq-attempts",
                              "pinq-dlq-reason"]
        big = letters[16 * 1024 - 10]
        size = len(big.payload) + sum(len(k) + len(v) for k, v in big.headers)
        assert size <= 16 * 1024, "the dead letter is within publish.maxMessageBytes"
        assert big.payload == b"x" * (16 * 1024 - 10), "the payload is never cut"
