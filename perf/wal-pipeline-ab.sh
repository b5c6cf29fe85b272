#!/bin/sh
# The pipelined WAL group commit against the code before it, interleaved A/B in one run (the
# rows of perf/ack-latency.sh that a WAL commit decides, each binary in turn):
#  1. standalone, 1 producer and 1 consumer, batch 1, 100 B, 10,000 msgs/s, durable publishes:
#     the `ok` of a durable ACK (p50 against one fdatasync of 4 KiB measured in the same run)
#     and the publish ack;
#  2. standalone A-lsm (2 producers, 2 consumers, 100 B, max rate, durable publishes and ACKs):
#     throughput, so a latency gain that costs throughput shows.
# Broker on CPU 0, load on CPU 1. Binaries are given, not built.
#
# usage: A=path/to/pinq-before B=path/to/pinq-after perf/wal-pipeline-ab.sh [duration] [reps]
#        (defaults 8s and 3)
set -eu
cd "$(dirname "$0")/.."
D=${1:-8s}
REPS=${2:-3}
: "${A:?A=path to the binary before}" "${B:?B=path to the binary after}"
BASE=$(mktemp -d)
trap 'rm -rf "$BASE"' EXIT INT TERM

fdatasync_us() { # p50 and p99 of 300 fdatasyncs of a 4 KiB write, in this directory's file system
    python3 - "$BASE" <<'PY'
import os, sys, time
path = os.path.join(sys.argv[1], "fsync-probe")
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
block = b"x" * 4096
samples = []
for i in range(300):
    os.pwrite(fd, block, (i % 64) * 4096)
    t = time.perf_counter()
    os.fdatasync(fd)
    samples.append((time.perf_counter() - t) * 1e6)
os.close(fd)
samples.sort()
print(f"p50 {samples[150]:.0f} p99 {samples[297]:.0f}")
PY
}

row() { # label, binary, bench args...
    name=$1; bin=$2; shift 2
    out=$("$bin" bench --ack durable --duration "$D" --warmup 1s --client-cpus 1 --out-dir "$BASE/out" "$@" 2>&1) \
        || { echo "$name: the bench failed: $(echo "$out" | tail -2)"; return 0; }
    thr=$(echo "$out" | sed -n 's/^throughput: \([0-9]*\) msgs.*/\1/p')
    ack=$(echo "$out" | sed -n 's/^ack  *\([0-9]*\) *\([0-9]*\) *\([0-9]*\).*/p50 \1 p99 \3/p')
    pub=$(echo "$out" | sed -n 's/^publish ack *\([0-9]*\) *\([0-9]*\) *\([0-9]*\).*/p50 \1 p99 \3/p')
    e2e=$(echo "$out" | sed -n 's/^end to end *\([0-9]*\) *\([0-9]*\) *\([0-9]*\).*/p50 \1 p99 \3/p')
    cpu=$(echo "$out" | sed -n 's/^broker: *\([0-9.]*\) CPU s.*/\1/p')
    sent=$(echo "$out" | sed -n 's/^messages: *sent \([0-9]*\),.*/\1/p')
    waited=$(echo "$out" | sed -n 's/^ *waited \([0-9.]*\) s for a CPU.*/\1/p')
    per=$(awk -v c="${cpu:-0}" -v n="${sent:-0}" 'BEGIN { if (n > 0) printf "%.1f", c * 1e6 / n; else print "?" }')
    echo "$name: $thr msgs/s, ACK call µs $ack, publish ack µs $pub, e2e µs $e2e, broker CPU $per µs/msg (waited ${waited:-?} s for a CPU)"
}

echo "load: $(uptime)"
echo "fdatasync of 4 KiB, µs: $(fdatasync_us)"
LOW="--producers 1 --consumers 1 --batch 1 --rate 10000 --size 100"
i=0
while [ $i -lt "$REPS" ]; do
    row "A durable ACKs, 10000 msgs/s" "$A" --storage lsm --broker-cpus 0 $LOW --ack-level durable
    row "B durable ACKs, 10000 msgs/s" "$B" --storage lsm --broker-cpus 0 $LOW --ack-level durable
    i=$((i + 1))
done
i=0
while [ $i -lt "$REPS" ]; do
    row "A durable ACKs, max rate" "$A" --storage lsm --broker-cpus 0 --producers 2 --consumers 2 --size 100 --ack-level durable
    row "B durable ACKs, max rate" "$B" --storage lsm --broker-cpus 0 --producers 2 --consumers 2 --size 100 --ack-level durable
    i=$((i + 1))
done
echo "fdatasync of 4 KiB, µs: $(fdatasync_us)"
echo "load: $(uptime)"
