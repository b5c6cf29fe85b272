#!/bin/sh
# Issue 21's ACK targets in one run, pairs interleaved:
#  1. the `ok` of a durable ACK at 10,000 msgs/s (1 producer, 1 consumer, batch 1): its p50
#     against one fdatasync of 4 KiB on the same disk (measured in the same run), standalone,
#     then in a three-node cluster on this machine, beside standalone (and both again at
#     2,000 msgs/s, a rate the cluster on one core keeps);
#  2. standalone A-lsm (2 producers, 2 consumers, 100 B, max rate): throughput with durable ACKs
#     against leader ACKs.
#
# Placement: the broker (or all three cluster nodes, one shard each) on CPU 0, the load on CPU 1.
# The three nodes share one core and one disk.
#
# usage: perf/ack-latency.sh [duration] [repetitions]    (defaults 8s and 2)
set -eu
cd "$(dirname "$0")/.."
D=${1:-8s}
REPS=${2:-2}
cargo build --release --quiet --bin pinq
BIN=target/release/pinq
BASE=$(mktemp -d)
cleanup() { for f in "$BASE"/*/pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true; done; rm -rf "$BASE"; }
trap cleanup EXIT INT TERM

fdatasync_us() { # p50 and p99 of 300 fdatasyncs of a 4 KiB write, in this directory's file system
    python3 - "$BASE" <<'EOF'
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
EOF
}

row() { # name, bench args...
    name=$1; shift
    out=$("$BIN" bench --ack durable --duration "$D" --warmup 1s --client-cpus 1 --out-dir "$BASE/out" "$@" 2>&1) \
        || { echo "$name: the bench failed: $(echo "$out" | tail -2)"; return 0; }
    thr=$(echo "$out" | sed -n 's/^throughput: \([0-9]*\) msgs.*/\1/p')
    ack=$(echo "$out" | sed -n 's/^ack  *\([0-9]*\) *\([0-9]*\) *\([0-9]*\).*/p50 \1 p99 \3/p')
    pub=$(echo "$out" | sed -n 's/^publish ack *\([0-9]*\) *\([0-9]*\) *\([0-9]*\).*/p50 \1 p99 \3/p')
    echo "$name: $thr msgs/s, ACK call µs $ack, publish ack µs $pub"
}

echo "load: $(uptime)"
echo "fdatasync of 4 KiB, µs: $(fdatasync_us)"
LOW="--producers 1 --consumers 1 --batch 1 --rate 10000 --size 100"
i=0
while [ $i -lt "$REPS" ]; do
    row "standalone, durable ACKs, 10000 msgs/s" --storage lsm --broker-cpus 0 $LOW --ack-level durable
    row "standalone, leader ACKs,  10000 msgs/s" --storage lsm --broker-cpus 0 $LOW --ack-level leader
    i=$((i + 1))
done
i=0
while [ $i -lt "$REPS" ]; do
    row "standalone, durable ACKs, max rate" --storage lsm --broker-cpus 0 --producers 2 --consumers 2 --size 100 --ack-level durable
    row "standalone, leader ACKs,  max rate" --storage lsm --broker-cpus 0 --producers 2 --consumers 2 --size 100 --ack-level leader
    i=$((i + 1))
done

PEERS="1=127.0.0.1:17201,2=127.0.0.1:17202,3=127.0.0.1:17203"
for n in 1 2 3; do
    mkdir -p "$BASE/n$n"
    "$BIN" serve --cpus 0 --node-id $n --raft-listen 127.0.0.1:1720$n --peers "$PEERS" \
        --listen 127.0.0.1:175${n}0 --metrics-listen 127.0.0.1:195${n}0 \
        --data-dir "$BASE/n$n/data" > "$BASE/n$n/log" 2>&1 &
    echo $! > "$BASE/n$n/pid"
done
for _ in $(seq 50); do # until a leader answers
    "$BIN" cluster status --server 127.0.0.1:17510 2>/dev/null | grep -q "leader" && break
    sleep 0.2
done
i=0
while [ $i -lt "$REPS" ]; do
    for rate in 10000 2000; do
        LOW="--producers 1 --consumers 1 --batch 1 --rate $rate --size 100"
        row "cluster,    durable ACKs, $rate msgs/s" --server 127.0.0.1:17510 $LOW --ack-level durable
        row "standalone, durable ACKs, $rate msgs/s" --storage lsm --broker-cpus 0 $LOW --ack-level durable
    done
    i=$((i + 1))
done
echo "fdatasync of 4 KiB, µs: $(fdatasync_us)"
echo "load: $(uptime)"
