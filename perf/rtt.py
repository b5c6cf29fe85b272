#!/usr/bin/env python3
"""Loopback TCP round trip, the floor under a publish-ack: a ping-pong of SIZE-byte messages
between two processes over 127.0.0.1 with TCP_NODELAY, the echo side pinned to SERVER_CPU and
the pinging side to CLIENT_CPU (like the broker and the load generator in perf/low-rate.sh).

Two ways, both reported:
  back-to-back  the next ping leaves as soon as the pong is in (both sides stay hot)
  paced         one ping every 1/RATE s (both sides sleep between pings, as at 200 msgs/s: each
                round trip then pays the wake-up of two sleeping threads)

  perf/rtt.py [--rate 200] [--count 2000] [--size 100] [--server-cpu 0] [--client-cpu 1] [--json F]

Prints one line per way, "rtt <way>: p50 X p99 Y µs (n N)", and writes both to --json.
"""
import argparse
import json
import os
import socket
import sys
import time


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return buf


def echo(listener, size, cpu):
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            conn.sendall(recv_exact(conn, size))
    except ConnectionError:
        pass
    os._exit(0)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ping(s, size, count, interval_s):
    msg = b"x" * size
    out = []
    next_at = time.perf_counter()
    for _ in range(count):
        if interval_s:
            next_at += interval_s
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        t0 = time.perf_counter_ns()
        s.sendall(msg)
        recv_exact(s, size)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--server-cpu", type=int, default=0)
    ap.add_argument("--client-cpu", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    pid = os.fork()
    if pid == 0:
        echo(listener, a.size, a.server_cpu)
    os.sched_setaffinity(0, {a.client_cpu})
    s = socket.create_connection(listener.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ping(s, a.size, 200, 0)  # warm-up
    result = {}
    for way, interval in (("back-to-back", 0), ("paced", 1.0 / a.rate)):
        xs = ping(s, a.size, a.count, interval)
        result[way] = {"p50": round(pct(xs, 0.5), 1), "p99": round(pct(xs, 0.99), 1), "n": len(xs)}
        print(f"rtt {way}: p50 {result[way]['p50']} p99 {result[way]['p99']} µs (n {len(xs)})")
    s.close()
    os.waitpid(pid, 0)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
