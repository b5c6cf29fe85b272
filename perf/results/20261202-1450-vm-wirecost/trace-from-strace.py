#!/usr/bin/env python3
"""Per-message steps on the broker from `strace -f -tt` of a 1-producer, 1-consumer run at a low
fixed rate (one message in flight at a time): the producer's connection is the first fd that
receives, the consumer's the other. For each publish received: reply written, deliver written,
deliver answer + ACK received, ACK reply written, and the system calls in between.
Usage: trace-from-strace.py seq200.txt"""
import re, statistics, sys
from datetime import datetime
from collections import Counter
raw = []
for line in open(sys.argv[1]):
    m = re.match(r"(\d+) +([\d:.]+) (\w+)\((\d+)?", line)
    if not m:
        continue
    t = datetime.strptime(m.group(2), "%H:%M:%S.%f")
    raw.append((m.group(1), t.timestamp() * 1e6, m.group(3), m.group(4)))
# The shard's thread makes most of the calls (the metrics thread and others are left out).
shard = Counter(r[0] for r in raw).most_common(1)[0][0]
ev = [r[1:] for r in raw if r[0] == shard]
fds = [fd for _, call, fd in ev if call == "recvfrom"]
prod = fds[0] if fds else None
cons = next(fd for fd in fds if fd != prod)
steps = {"publish received -> reply written": [], "reply -> deliver written": [],
         "deliver written -> deliver answer + ACK received": [], "ACK received -> ACK reply written": [],
         "publish received -> ACK reply written": []}
calls = []
i = 0
while i < len(ev):
    t0, call, fd = ev[i]
    if call == "recvfrom" and fd == prod:
        want = [("sendto", prod), ("sendto", cons), ("recvfrom", cons), ("sendto", cons)]
        times, j, n = [t0], i + 1, 0
        while j < len(ev) and want:
            if (ev[j][1], ev[j][2]) == want[0]:
                times.append(ev[j][0]); want.pop(0)
            elif ev[j][1] == "recvfrom" and ev[j][2] == prod:
                break
            j += 1
        if not want:
            names = list(steps)
            for k in range(4):
                steps[names[k]].append(times[k + 1] - times[k])
            steps[names[4]].append(times[4] - times[0])
            calls.append(sum(1 for e in ev[i:j] if e[1] == "io_uring_enter"))
            i = j
            continue
    i += 1
print(f"messages traced: {len(calls)}")
for name, xs in steps.items():
    if xs:
        print(f"  {name:52s} p50 {statistics.median(xs):7.0f} us")
if calls:
    print(f"  io_uring_enter within one message's steps: p50 {statistics.median(calls):.0f}")
