#!/usr/bin/env python3
"""The pinq Python client in one page: publish, consume as a group, ack, nack, read a refusal.

    pip install ./clients/python
    pinq serve --storage memory &                      # a broker on 127.0.0.1:7400
    python3 clients/python/examples/quickstart.py 127.0.0.1:7400

With TLS and a token: quickstart.py broker.example:7400 --tls-ca ca.pem --token "$PINQ_TOKEN"
Exit status 0 when every message was delivered and acknowledged.
"""

import argparse
import asyncio

import pinq


async def main(args) -> None:
    async with await pinq.connect(args.addr, tls=args.tls_ca, token=args.token) as client:
        topic = "quickstart"
        # A refused batch stores nothing and says why: a code to match on, the offending
        # message, a sentence for people, and whether retrying unchanged may succeed.
        try:
            await client.publish(topic, [b"fine", b"x" * (2 << 20)])
        except pinq.Refused as e:
            print(f"refused: {e.code} at message {e.index} (retryable: {e.retryable})")

        sub = await client.subscribe(topic, group="workers", queue_size=64)
        tags = await client.publish(topic, [b"job %d" % i for i in range(5)])
        await client.publish(topic, [b"later"], delay=0.5, ttl=60, ack_level="leader")
        print(f"published {len(tags) + 1} messages")

        done = 0
        async for d in sub:
            if d.payload == b"job 3" and d.attempt == 1:
                await d.nack()  # handed back: it comes again with attempt 2
                continue
            print(f"{d.payload.decode()} (attempt {d.attempt})")
            assert await d.ack() == "ok"
            done += 1
            if done == 6:
                break
        await sub.close()
        stats = await client.stats()
        for g in stats.groups:
            if (g.topic, g.group) == (topic, "workers"):
                print(f"group workers: {g.acked} acked, {g.nacked} nacked, {g.backlog} waiting")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("addr", nargs="?", default="127.0.0.1:7400")
    parser.add_argument("--tls-ca", help="speak TLS, trusting this CA (PEM)")
    parser.add_argument("--token", help="the access token, when the broker has tokens")
    asyncio.run(main(parser.parse_args()))
