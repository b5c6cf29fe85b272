#!/usr/bin/env python3
"""A pinq client in Python, written from schema/pinq.capnp alone (pycapnp 2.x).

Speaks protocol 2: publishes a batch the broker refuses (its second message has an empty topic)
and prints the typed refusal read from the results (code and index of the offending message);
then publishes a few messages, subscribes as a member of a group, receives them through
`Consumer.deliver`, ACKs each, and checks the broker answered `ok` for every tag.

    pip install pycapnp
    cargo run --release -- serve --storage memory &        # a broker on 127.0.0.1:7400
    python3 schema/examples/python_client.py 127.0.0.1:7400

A broker with TLS and tokens (README, "Security"): give the CA that signed its certificate and
the token, as options or in the environment (PINQ_TLS_CA, PINQ_TLS_SERVER_NAME, PINQ_TOKEN):

    python3 schema/examples/python_client.py broker.example:7400 \
        --tls-ca ca.pem --token-file billing.token

Exit status 0 when every published message was delivered and ACKed.
"""

import argparse
import asyncio
import os
import ssl

import capnp

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = os.path.join(HERE, "..", "pinq.capnp")
# The schema imports nothing: no import path is needed.
pinq = capnp.load(SCHEMA)


class Consumer(pinq.Consumer.Server):
    """Receives delivery batches; the broker sends the next batch when this call returns."""

    def __init__(self, inbox):
        self.inbox = inbox

    async def deliver(self, deliveries, **kwargs):
        for d in deliveries:
            await self.inbox.put((d.topic, bytes(d.payload), bytes(d.tag), d.attempt))


async def show_refusal(broker, topic):
    """Publishes a batch whose second message has an empty topic and prints the refusal.

    A refused call returns normally: test `refusal.code` (it reads "none" when the field is
    unset) before anything else. `index` is the offending message, `noIndex` the whole call.
    """
    request = broker.publish_request()
    messages = request.init("messages", 2)
    messages[0].topic = topic
    messages[0].payload = b"never stored"
    messages[1].topic = ""
    request.ackLevel = "durable"
    reply = await request.send()
    refusal = reply.refusal
    assert refusal.code == "invalidTopic" and refusal.index == 1, refusal
    assert len(reply.tags) == 0, "a refused batch stores nothing"
    where = "the whole call" if refusal.index == pinq.noIndex else f"message {refusal.index}"
    print(f"refused: {refusal.code} at {where} (retryable: {refusal.retryable}): {refusal.message}")


def tls_context(args):
    """An SSL context trusting --tls-ca, or None for plain TCP."""
    if not args.tls_ca:
        return None
    context = ssl.create_default_context(cafile=args.tls_ca)
    if args.tls_cert:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    return context


def token_of(args):
    """The token's bytes (first line of --token-file, else PINQ_TOKEN), or empty for none."""
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            return f.readline().strip().encode()
    return os.environ.get("PINQ_TOKEN", "").strip().encode()


async def main(args):
    host, port = args.addr.rsplit(":", 1)
    context = tls_context(args)
    tls = {}
    if context is not None:
        tls = {"ssl": context, "server_hostname": args.tls_server_name or host}
    stream = await capnp.AsyncIoStream.create_connection(host=host, port=int(port), **tls)
    client = capnp.TwoPartyClient(stream)
    broker = client.bootstrap().cast_as(pinq.Broker)

    # hello comes first: the broker refuses every other call before it (helloRequired), and
    # with tokens configured it checks the token here (unauthenticated when missing or unknown).
    # With protocolVersion 2 the broker answers refusals of publish/ack/nack/touch in the results'
    # `refusal` field; it answers with the version the connection speaks.
    hello = await broker.hello(pinq.protocolVersion, token_of(args))
    print(f"server protocol {hello.serverVersion}, {hello.shardCount} shard(s)")
    assert hello.serverVersion == pinq.protocolVersion, "the broker speaks another version"

    topic = "python-example"
    await show_refusal(broker, topic)
    inbox = asyncio.Queue()
    sub = (await broker.subscribe(topic, "py-workers", Consumer(inbox), 64)).subscription

    count = 5
    request = broker.publish_request()
    messages = request.init("messages", count)
    for i, m in enumerate(messages):
        m.topic = topic
        m.payload = f"hello {i} from python".encode()
    request.ackLevel = "durable"
    reply = await request.send()
    assert reply.refusal.code == "none", f"publish refused: {reply.refusal.message}"
    tags = reply.tags
    assert len(tags) == count, f"{len(tags)} tags for {count} messages"
    for t in tags:
        assert len(t) == pinq.tagBytes

    seen = set()
    while len(seen) < count:
        topic_got, payload, tag, attempt = await asyncio.wait_for(inbox.get(), timeout=15)
        print(f"{topic_got}: {payload.decode()} (attempt {attempt})")
        reply = await sub.ack([tag])
        assert reply.refusal.code == "none", f"ack refused: {reply.refusal.message}"
        assert list(reply.results) == ["ok"], f"ack answered {list(reply.results)}"
        seen.add(payload)
    await sub.close()
    print(f"delivered and acked {len(seen)} message(s)")


def parse_args():
    parser = argparse.ArgumentParser(description="A pinq client from the schema alone.")
    parser.add_argument("addr", nargs="?", default="127.0.0.1:7400")
    parser.add_argument("--tls-ca", default=os.environ.get("PINQ_TLS_CA"),
                        help="speak TLS, trusting this CA (PEM)")
    parser.add_argument("--tls-server-name", default=os.environ.get("PINQ_TLS_SERVER_NAME"),
                        help="name on the broker's certificate (default: the host of ADDR)")
    parser.add_argument("--tls-cert", help="client certificate (PEM), with --tls-key")
    parser.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    parser.add_argument("--token-file", help="file whose first line is the token (else PINQ_TOKEN)")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(capnp.run(main(parse_args())))
