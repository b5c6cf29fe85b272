"""The client against a 3-node cluster with a failover: the leader the client was seeded with is
killed (SIGKILL, by process id); publishes and the subscription follow the new leader, every
copy not ACKed comes again, and no ACKed one does."""

import asyncio
import uuid

import pytest

import pinq
from conftest import Cluster

WAIT_S = 30


@pytest.fixture
def cluster():
    c = Cluster(3, env={"PINQ_DELIVERY_DELETE_BATCH_INTERVAL": "50ms"}).start()
    yield c
    c.cleanup()


async def leader_of_shard0(cluster, node: int) -> str:
    """The client address of shard 0's leader, as node `node` sees it (bounded wait)."""
    async with await pinq.connect(cluster.addr(node), request_timeout=3) as client:
        for _ in range(WAIT_S * 10):
            shards = await client.topology()
            if shards[0].leader_address:
                return shards[0].leader_address
            await asyncio.sleep(0.1)
    raise AssertionError("no leader elected")


async def wait_stored(addr: str, topic: str, stored: int) -> None:
    """Waits until the node at `addr` counts `stored` messages of `topic` (deletes applied)."""
    async with await pinq.connect(addr, request_timeout=3) as client:
        for _ in range(WAIT_S * 10):
            stats = await client.stats()
            now = [t.stored for t in stats.topics if t.topic == topic]
            if now == [stored]:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"{topic} never had {stored} stored: {now}")


async def test_publish_and_subscription_follow_the_leader_across_a_kill(cluster):
    leader = await leader_of_shard0(cluster, 1)
    t = f"failover-{uuid.uuid4().hex[:6]}"
    # Seeded with the leader itself: after the kill the client must find the others.
    client = await pinq.connect(leader, request_timeout=3, patience=WAIT_S)
    try:
        assert client.is_cluster
        status = await client.cluster_status()
        assert len(status.nodes) == 3 and status.node_id == cluster.node_of(leader)
        before = [f"before-{i:03}".encode() for i in range(40)]
        await client.publish(t, before, producer_id="py-failover")
        sub = await client.subscribe(t, group="g", queue_size=8)
        acked = set()
        async for d in sub:
            if d.payload in acked:
                continue
            assert await d.ack() == "ok"
            acked.add(d.payload)
            if len(acked) == 20:
                break
        await wait_stored(leader, t, 20)

        cluster.kill9(cluster.node_of(leader))
        after = [f"after-{i:03}".encode() for i in range(10)]
        await client.publish(t, after, producer_id="py-failover")
        new_leader = await leader_of_shard0(cluster, next(
            n for n in cluster.members if cluster.addr(n) != leader))
        assert new_leader != leader

        wanted = (set(before) - acked) | set(after)
        got = set()
        while not wanted <= got:
            d = await sub.recv(timeout=WAIT_S)
            assert d.payload not in acked, f"{d.payload!r} was ACKed before the kill"
            try:
                if await d.ack() == "ok":
                    got.add(d.payload)
            except (pinq.Refused, pinq.ConnectionLost):
                pass  # from the old leader's attachment: it comes again
        assert sub.consumer_id, "subscribed again on the new leader"
        await sub.close()
    finally:
        await client.close()
