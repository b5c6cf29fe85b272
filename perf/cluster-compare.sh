#!/bin/sh
# Standalone against a three-node cluster on this machine, in one run: durable publish latency
# at fixed rates and durable throughput at max rate, then the failover gap
# (perf/cluster-failover.sh).
#
# Placement: every broker process on CPU 0 (the standalone broker, or all three cluster nodes,
# one shard each), the load generator on CPU 1. The three nodes share one core and one disk,
# so the cluster pays three fdatasyncs per commit on the same device.
#
# usage: perf/cluster-compare.sh [duration]   (default 5s per row)
set -eu
cd "$(dirname "$0")/.."
D=${1:-5s}
cargo build --release --quiet --bin pinq --example failover_probe
BIN=${CARGO_TARGET_DIR:-target}/release/pinq
BASE=$(mktemp -d)
PEERS="1=127.0.0.1:17101,2=127.0.0.1:17102,3=127.0.0.1:17103"
cleanup() { for f in "$BASE"/*/pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true; done; rm -rf "$BASE"; }
trap cleanup EXIT INT TERM
for i in 1 2 3; do
    mkdir -p "$BASE/n$i"
    "$BIN" serve --cpus 0 --node-id $i --raft-listen 127.0.0.1:1710$i --peers "$PEERS" \
        --listen 127.0.0.1:174${i}0 --metrics-listen 127.0.0.1:194${i}0 \
        --data-dir "$BASE/n$i/data" > "$BASE/n$i/log" 2>&1 &
    echo $! > "$BASE/n$i/pid"
done
sleep 2
row() { # name, args...
    name=$1; shift
    out=$("$BIN" bench --ack durable --duration "$D" --warmup 1s --client-cpus 1 --out-dir "$BASE/out" "$@" 2>&1)
    thr=$(echo "$out" | sed -n 's/^throughput: \([0-9]*\) msgs.*/\1/p')
    pub=$(echo "$out" | sed -n 's/^publish ack *\([0-9]*\) *\([0-9]*\) *\([0-9]*\).*/p50 \1 p99 \3/p')
    miss=$(echo "$out" | sed -n 's/.*missing \([0-9]*\).*/\1/p')
    echo "$name: $thr msgs/s, publish ack µs $pub, missing $miss"
}
for rate in 200 2000 10000; do
    # One message per publish; 64 publishes in flight so that at 10,000 msgs/s the load
    # generator's window (8 by default: 800 µs of latency at that rate) is not what limits.
    row "standalone durable, $rate msgs/s, batch 1" --storage lsm --rate $rate --batch 1 --window 64
    row "cluster    durable, $rate msgs/s, batch 1" --server 127.0.0.1:17410 --rate $rate --batch 1 --window 64
done
row "standalone durable, max rate" --storage lsm
row "cluster    durable, max rate" --server 127.0.0.1:17410
cleanup
trap - EXIT
perf/cluster-failover.sh 3
