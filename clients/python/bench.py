#!/usr/bin/env python3
"""Throughput of the Python client: one producer and one group consumer in one process (one
core: run it under `taskset -c 1`), like `pinq bench --producers 1 --consumers 1`.

The producer keeps `--window` batches of `--batch` messages in flight for `--duration` seconds;
the consumer ACKs what it received with one `ack` call per `recv_batch` (up to `--batch`). Prints the rates measured over the duration, then drains and checks every message
published was delivered.

    taskset -c 1 python3 clients/python/bench.py --server 127.0.0.1:7400 --duration 10
"""

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pinq  # noqa: E402  (the package beside this script, installed or not)


async def produce(client, topic, args, stop_at, counts):
    payload = b"x" * args.size
    batch = [payload] * args.batch
    in_flight = set()
    while time.monotonic() < stop_at:
        while len(in_flight) < args.window:
            in_flight.add(asyncio.ensure_future(
                client.publish(topic, batch, ack_level=args.ack_level)))
        done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        for d in done:
            counts["published"] += len(d.result())
    for d in await asyncio.gather(*in_flight):
        counts["published"] += len(d)


async def consume(sub, args, counts, stop):
    while not (stop.is_set() and counts["consumed"] >= counts["published"]):
        try:
            batch = await sub.recv_batch(args.batch, timeout=0.2)
        except asyncio.TimeoutError:
            if stop.is_set() and counts["drain_deadline"] < time.monotonic():
                break
            continue
        counts["consumed"] += len(batch)
        await sub.ack([d.tag for d in batch])


async def concurrent(client, topic, args, counts):
    """Producer and consumer at once; rates over the measured window."""
    sub = await client.subscribe(topic, group="bench", queue_size=args.queue)
    stop = asyncio.Event()
    consumer = asyncio.ensure_future(consume(sub, args, counts, stop))
    await produce(client, topic, args, time.monotonic() + args.warmup, counts)
    start, cpu0 = time.monotonic(), time.process_time()
    p0, c0 = counts["published"], counts["consumed"]
    await produce(client, topic, args, start + args.duration, counts)
    elapsed, cpu = time.monotonic() - start, time.process_time() - cpu0
    published, consumed = counts["published"] - p0, counts["consumed"] - c0
    counts["drain_deadline"] = time.monotonic() + 60
    stop.set()
    await consumer
    await sub.close()
    return {
        "published_per_s": round(published / elapsed),
        "consumed_per_s": round(consumed / elapsed),
        "client_cpu_us_per_msg": round(cpu * 1e6 / max(1, published + consumed), 1),
    }


async def phases(client, topic, args, counts):
    """First only publishing for the duration, then only consuming what was published."""
    start, cpu0 = time.monotonic(), time.process_time()
    await produce(client, topic, args, start + args.duration, counts)
    pub_s, pub_cpu = time.monotonic() - start, time.process_time() - cpu0
    sub = await client.subscribe(topic, group="bench", queue_size=args.queue)
    stop = asyncio.Event()
    stop.set()
    counts["drain_deadline"] = time.monotonic() + 120
    start, cpu0 = time.monotonic(), time.process_time()
    await consume(sub, args, counts, stop)
    con_s, con_cpu = time.monotonic() - start, time.process_time() - cpu0
    await sub.close()
    return {
        "published_per_s": round(counts["published"] / pub_s),
        "publish_cpu_us_per_msg": round(pub_cpu * 1e6 / max(1, counts["published"]), 2),
        "consumed_per_s": round(counts["consumed"] / con_s),
        "consume_cpu_us_per_msg": round(con_cpu * 1e6 / max(1, counts["consumed"]), 2),
    }


async def main(args):
    topic = f"pybench-{uuid.uuid4().hex[:8]}"
    counts = {"published": 0, "consumed": 0, "drain_deadline": float("inf")}
    async with await pinq.connect(args.server) as client:
        run = phases if args.mode == "phases" else concurrent
        figures = await run(client, topic, args, counts)
    result = {
        "mode": args.mode,
        "size": args.size,
        "batch": args.batch,
        "window": args.window,
        "ack_level": args.ack_level,
        **figures,
        "published": counts["published"],
        "consumed": counts["consumed"],
    }
    print(json.dumps(result))
    return 0 if counts["consumed"] >= counts["published"] else 1


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", default="127.0.0.1:7400")
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--queue", type=int, default=0, help="subscribe queue_size (0: broker's)")
    p.add_argument("--ack-level", default="durable")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--mode", choices=["concurrent", "phases"], default="concurrent",
                   help="producer and consumer at once, or publish first then consume")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
