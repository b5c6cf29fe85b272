#!/usr/bin/env python3
"""Splits a call's latency into the broker's side and the client's, from a packet capture on
the loopback: `tcpdump -i lo -tt -nn -q 'tcp port PORT'` text on stdin (or a file).

For each connection (by client port), every packet with data from the client followed by a
packet with data from the broker, before the client's next one, is a request and its answer:
the gap is the broker's turnaround as the wire sees it (frame in → answer out: the broker's
wake-up, reading, handling, writing), with no client library and no load-generator lateness
in it. Prints, per connection, the number of such pairs, the mean bytes each way and the
p50/p90/p99 of the gap in µs; writes them to --json.

    perf/wire-turnaround.py --port 17400 capture.txt [--json out.json]

`perf/wire-turnaround.sh` takes the captures during a 200 msgs/s load.
"""
import argparse
import json
import re
import sys

LINE = re.compile(
    r"^(\d+\.\d+) IP (\S+)\.(\d+) > (\S+)\.(\d+): tcp (\d+)"
)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def connections(lines, port):
    """{client port: [(time s, from client?, bytes)]} of the packets with data."""
    conns = {}
    for line in lines:
        m = LINE.match(line)
        if not m or int(m.group(6)) == 0:
            continue
        t, sport, dport, n = float(m.group(1)), int(m.group(3)), int(m.group(5)), int(m.group(6))
        if dport == port:
            conns.setdefault(sport, []).append((t, True, n))
        elif sport == port:
            conns.setdefault(dport, []).append((t, False, n))
    return conns


def turnarounds(packets):
    """Gaps (µs) from a client packet to the broker's next one, and the mean sizes."""
    gaps, asked = [], None
    sizes = {True: [], False: []}
    for t, from_client, n in packets:
        sizes[from_client].append(n)
        if from_client:
            asked = t
        elif asked is not None:
            gaps.append((t - asked) * 1e6)
            asked = None
    mean = {k: (sum(v) / len(v) if v else 0) for k, v in sizes.items()}
    return gaps, mean


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--json")
    ap.add_argument("capture", nargs="?")
    a = ap.parse_args()
    lines = open(a.capture) if a.capture else sys.stdin
    result = {}
    for cport, packets in sorted(connections(lines, a.port).items()):
        gaps, mean = turnarounds(packets)
        if not gaps:
            continue
        r = {"pairs": len(gaps), "client_bytes": round(mean[True]), "broker_bytes": round(mean[False]),
             "p50": round(pct(gaps, 0.5), 1), "p90": round(pct(gaps, 0.9), 1),
             "p99": round(pct(gaps, 0.99), 1)}
        result[str(cport)] = r
        print(f"connection :{cport}: {r['pairs']} request/answer pairs, "
              f"{r['client_bytes']} B in / {r['broker_bytes']} B out on average; broker turnaround "
              f"p50 {r['p50']} p90 {r['p90']} p99 {r['p99']} µs")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
