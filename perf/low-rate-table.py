#!/usr/bin/env python3
"""The table of a perf/low-rate.sh run directory (perf/max-rate.sh's too), and pinq / Redis
ratios per repetition. perf/low-rate.sh calls it at the end; run it again on a directory with

    perf/low-rate-table.py DIR DURATION RATE STRACE_SECS      e.g. DIR 8s max 0

Reads <row>.<n>.json (the load generators' summaries), pinq's <row>.<n>/report.txt (broker CPU
and run-queue wait over the measured window), Redis's <row>.<n>.usage (CPU, elapsed, wait over
the whole run), <row>.<n>.fsyncs, <row>.<n>.strace, <row>.<n>.load and rtt.<n>.json.
"""
import glob
import json
import os
import re
import sys

# pinq row beside the Redis row it is compared with.
PAIRS = [
    ("pinq-memory", "redis-none"),
    ("pinq-leader", "redis-everysec"),
    ("pinq-durable", "redis-always"),
    ("pinq-durable", "redis-none"),
]


def read(out, name):
    try:
        with open(os.path.join(out, name)) as f:
            return f.read()
    except OSError:
        return None


def broker_usage(out, name, window, j):
    """(CPU µs per message, CPU % of a core, run-queue wait % of a core), or None."""
    if name.startswith("pinq"):
        text = read(out, os.path.join(name, "report.txt")) or ""
        cpu = re.search(r"broker: +([0-9.]+) CPU s", text)
        wait = re.search(r"waited ([0-9.]+) s for a CPU", text)
        if not cpu or not j["msgs_per_sec"]:
            return None
        c = float(cpu.group(1))
        w = float(wait.group(1)) if wait else float("nan")
        return 1e6 * c / (j["msgs_per_sec"] * window), 100 * c / window, 100 * w / window
    fields = (read(out, f"{name}.usage") or "").split()
    if len(fields) < 2 or not j["sent"]:
        return None
    c, elapsed = float(fields[0]), float(fields[1])
    w = float(fields[2]) if len(fields) > 2 else float("nan")
    # Redis is measured over its whole run (warm-up and drain included): per message sent.
    return 1e6 * c / j["sent"], 100 * c / elapsed, 100 * w / elapsed


def broker_publish_call_us(out, name):
    """pinq's own mean time in a publish call (`pinq_publish_call_seconds`: capnp-rpc started
    the call → its answer ready to write), over the run, from the /metrics kept at its end."""
    text = read(out, f"{name}.metrics")
    if text is None:
        return None
    total = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for kind in total:
            if line.startswith(f"pinq_publish_call_seconds_{kind}"):
                total[kind] += float(line.split()[-1])
    return 1e6 * total["sum"] / total["count"] if total["count"] else None


def strace(out, name, msgs):
    """(calls per message, the four largest kinds as 'name:per-message'), or None."""
    text = read(out, f"{name}.strace")
    if text is None or not msgs:
        return None
    kinds, total = [], None
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 5 and f[0] != "%" and not line.startswith("-"):
            try:
                calls = int(f[3])
            except ValueError:
                continue
            if f[-1] == "total":
                total = calls
            else:
                kinds.append((calls, f[-1]))
    if total is None:
        return None
    kinds.sort(reverse=True)
    return total / msgs, " ".join(f"{k}:{c / msgs:.2f}" for c, k in kinds[:4])


def rows_table(out, window, rate, strace_secs):
    runs = {}
    print(f"{'row':<22} {'msgs/s':>8} {'missing':>7} {'e2e p50':>8} {'e2e p99':>8} "
          f"{'pub p50':>8} {'pub p99':>8} {'cpu µs/msg':>10} {'cpu %':>6} {'wait %':>6} "
          f"{'load':>5} {'fsync/msg':>9} {'sys/msg':>7}  syscalls per message by kind")
    for f in sorted(glob.glob(os.path.join(out, "*.json"))):
        name = os.path.basename(f)[:-5]
        if name.startswith("rtt.") or name.endswith(".wire"):
            continue
        j = json.load(open(f))
        runs[name] = j
        e, p = j["e2e_us"], j["publish_ack_us"]
        u = broker_usage(out, name, window, j)
        cpu, pct, wait = (f"{u[0]:.1f}", f"{u[1]:.0f}", f"{u[2]:.0f}") if u else ("?", "?", "?")
        fs = "n/a"
        try:
            fs = f"{int(read(out, name + '.fsyncs')) / max(j['sent'], 1):.3f}"
        except (TypeError, ValueError):
            pass
        load = (read(out, f"{name}.load") or "?").strip()
        msgs = rate * strace_secs if rate else None
        s = strace(out, name, msgs)
        sysm, kinds = (f"{s[0]:.1f}", s[1]) if s else ("?", "")
        print(f"{name:<22} {j['msgs_per_sec']:>8.0f} {j['missing']:>7} {e['p50']:>8} "
              f"{e['p99']:>8} {p['p50']:>8} {p['p99']:>8} {cpu:>10} {pct:>6} {wait:>6} "
              f"{load:>5} {fs:>9} {sysm:>7}  {kinds}")
    return runs


def ratios(out, runs, rate):
    reps = sorted({n.rsplit(".", 1)[1] for n in runs if "." in n}, key=int)
    lines = []
    for pinq, redis in PAIRS:
        for r in reps:
            a, b = runs.get(f"{pinq}.{r}"), runs.get(f"{redis}.{r}")
            if not a or not b:
                continue
            if rate is None:
                ratio = a["msgs_per_sec"] / max(b["msgs_per_sec"], 1e-9)
                lines.append(f"{pinq:<13} / {redis:<15} run {r}: msgs/s "
                             f"{a['msgs_per_sec']:.0f} / {b['msgs_per_sec']:.0f} = {ratio:.2f}")
            else:
                e = a["e2e_us"]["p50"] / max(b["e2e_us"]["p50"], 1)
                p = a["publish_ack_us"]["p50"] / max(b["publish_ack_us"]["p50"], 1)
                lines.append(f"{pinq:<13} / {redis:<15} run {r}: e2e p50 {e:.2f}, "
                             f"publish-ack p50 {p:.2f}")
    for r in reps:
        rtt = read(out, f"rtt.{r}.json")
        if rtt is None:
            continue
        rtt = json.loads(rtt)
        line = (f"run {r}: loopback RTT p50 back-to-back {rtt['back-to-back']['p50']} µs, "
                f"paced {rtt['paced']['p50']} µs")
        for row in ("pinq-memory", "redis-none"):
            j = runs.get(f"{row}.{r}")
            if j:
                line += f"; {row} publish-ack p50 {j['publish_ack_us']['p50']} µs"
                if "publish_call_us" in j:
                    line += f" (call from its write: p50 {j['publish_call_us']['p50']} µs)"
                call = broker_publish_call_us(out, f"{row}.{r}")
                if call is not None:
                    line += f" (broker's publish call, mean: {call:.0f} µs)"
        lines.append(line)
    for name in sorted(runs):
        wire = read(out, f"{name}.wire.txt")
        if wire:
            lines.append(f"{name}: the broker's turnaround on the wire (perf/wire-turnaround.py):")
            lines.extend("  " + w for w in wire.strip().splitlines())
    if lines:
        print()
        print("pinq / Redis, each repetition with its own (> 1: pinq higher)")
        print("\n".join(lines))


def main():
    out, duration, rate_arg, strace_secs = sys.argv[1:5]
    window = float(re.sub(r"s$", "", duration))
    rate = None if rate_arg == "max" else float(rate_arg)
    runs = rows_table(out, window, rate, float(strace_secs))
    print("latency in µs; at a fixed rate from each message's intended send time, at max rate from")
    print("its send; cpu: the broker's user+system time (pinq: over the measured window, per message")
    print("delivered in it; Redis: over the whole run, per message sent); wait %: the broker's")
    print("run-queue wait (runnable, not running) as % of a core; load: 1-minute load average at")
    print("the row's start; fsync/msg: WAL fdatasyncs (pinq_storage_wal_fsyncs_total) per message")
    print("sent; sys/msg: strace -c -f of the broker over a separate run of the same load")
    ratios(out, runs, rate)


if __name__ == "__main__":
    main()
