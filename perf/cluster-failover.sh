#!/bin/sh
# Unavailability after kill -9 of a shard's leader, in a three-node cluster on this machine.
#
# Starts three `pinq serve` on 127.0.0.1 (all pinned to CPU 0; the probe on CPU 1), runs
# examples/failover_probe.rs (one durable publish every 5 ms through the leader-following
# client), kills the leader with SIGKILL after KILL_AFTER seconds, and prints the probe's JSON:
# the longest gap between two acknowledged publishes is the unavailability a client saw.
#
# usage: perf/cluster-failover.sh [runs]     (default 3; each run takes about 8 s)
set -eu
cd "$(dirname "$0")/.."
RUNS=${1:-3}
KILL_AFTER=${KILL_AFTER:-3}
cargo build --release --quiet --bin pinq --example failover_probe
BIN=${CARGO_TARGET_DIR:-target}/release/pinq
PROBE=${CARGO_TARGET_DIR:-target}/release/examples/failover_probe
BASE=$(mktemp -d)
PEERS="1=127.0.0.1:17101,2=127.0.0.1:17102,3=127.0.0.1:17103"
cleanup() { for f in "$BASE"/*/pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true; done; rm -rf "$BASE"; }
trap cleanup EXIT INT TERM
for run in $(seq 1 "$RUNS"); do
    for i in 1 2 3; do
        mkdir -p "$BASE/n$i"; rm -rf "$BASE/n$i/data"
        "$BIN" serve --cpus 0 --node-id $i --raft-listen 127.0.0.1:1710$i --peers "$PEERS" \
            --listen 127.0.0.1:174${i}0 --metrics-listen 127.0.0.1:194${i}0 \
            --data-dir "$BASE/n$i/data" > "$BASE/n$i/log" 2>&1 &
        echo $! > "$BASE/n$i/pid"
    done
    sleep 2
    taskset -c 1 "$PROBE" --server 127.0.0.1:17410 --duration 8s > "$BASE/probe.json" 2> "$BASE/probe.err" &
    probe=$!
    sleep "$KILL_AFTER"
    leader=$("$BIN" cluster status --server 127.0.0.1:17410 --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["shards"][0]["leader"])')
    kill -9 "$(cat "$BASE/n$leader/pid")"
    wait $probe
    echo "run $run: killed leader node $leader at ${KILL_AFTER}s: $(cat "$BASE/probe.json")"
    for i in 1 2 3; do kill -9 "$(cat "$BASE/n$i/pid")" 2>/dev/null || true; done
    sleep 0.5
done
