#!/usr/bin/env python3
"""A pinq client in Python, written from schema/pinq.capnp alone (pycapnp 2.x).

Publishes a few messages, subscribes as a member of a group, receives them through the
`Consumer.deliver` stream, ACKs each, and checks the broker answered `ok` for every tag.

    pip install pycapnp
    cargo run --release -- serve --storage memory &        # a broker on 127.0.0.1:7400
    python3 schema/examples/python_client.py 127.0.0.1:7400

Exit status 0 when every published message was delivered and ACKed.
"""

import asyncio
import os
import sys

import capnp

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = os.path.join(HERE, "..", "pinq.capnp")
pinq = capnp.load(SCHEMA, imports=[os.path.join(HERE, "..", "include")])


class Consumer(pinq.Consumer.Server):
    """Receives delivery batches; the broker sends the next batch when this call returns."""

    def __init__(self, inbox):
        self.inbox = inbox

    async def deliver(self, deliveries, **kwargs):
        for d in deliveries:
            await self.inbox.put((d.topic, bytes(d.payload), bytes(d.tag), d.attempt))


async def main(addr):
    host, port = addr.rsplit(":", 1)
    stream = await capnp.AsyncIoStream.create_connection(host=host, port=int(port))
    client = capnp.TwoPartyClient(stream)
    broker = client.bootstrap().cast_as(pinq.Broker)

    hello = await broker.hello(pinq.protocolVersion)
    print(f"server protocol {hello.serverVersion}, {hello.shardCount} shard(s)")

    topic = "python-example"
    inbox = asyncio.Queue()
    sub = (await broker.subscribe(topic, "py-workers", Consumer(inbox), 64)).subscription

    count = 5
    request = broker.publish_request()
    messages = request.init("messages", count)
    for i, m in enumerate(messages):
        m.topic = topic
        m.payload = f"hello {i} from python".encode()
    request.ackLevel = "durable"
    tags = (await request.send()).tags
    assert len(tags) == count, f"{len(tags)} tags for {count} messages"
    for t in tags:
        assert len(t) == pinq.tagBytes

    seen = set()
    while len(seen) < count:
        topic_got, payload, tag, attempt = await asyncio.wait_for(inbox.get(), timeout=15)
        print(f"{topic_got}: {payload.decode()} (attempt {attempt})")
        results = (await sub.ack([tag])).results
        assert list(results) == ["ok"], f"ack answered {list(results)}"
        seen.add(payload)
    await sub.close()
    print(f"delivered and acked {len(seen)} message(s)")


if __name__ == "__main__":
    asyncio.run(capnp.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7400")))
