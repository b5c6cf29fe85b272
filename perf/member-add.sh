#!/bin/sh
# Issue 22's "a member added under 10,000 msgs/s load without any publish taking more than
# 1 s": a three-node cluster takes durable publishes (and durable ACKs) at a fixed rate from
# `pinq bench`; a few seconds in, a fourth node starts with --join and `pinq cluster add-node`
# adds it (a learner, a snapshot, then a voter). The bench's publish-ack maximum covers the
# whole change; the add-node time is printed beside it.
#
# Placement: nodes 1 and 3 on CPU 0, nodes 2 and 4 on CPU 1 (one shard each), the load
# generator unpinned: everything shares the machine's two cores and one disk.
#
# usage: perf/member-add.sh [rate] [duration]   (defaults 10000 and 15s)
set -eu
cd "$(dirname "$0")/.."
RATE=${1:-10000}
D=${2:-15s}
cargo build --release --quiet --bin pinq
BIN=target/release/pinq
BASE=$(mktemp -d)
PEERS="1=127.0.0.1:18101,2=127.0.0.1:18102,3=127.0.0.1:18103"
cleanup() { for f in "$BASE"/*/pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true; done; rm -rf "$BASE"; }
trap cleanup EXIT INT TERM
start() { # id, membership flags...
    i=$1; shift
    mkdir -p "$BASE/n$i"
    "$BIN" serve --cpus $(( (i + 1) % 2 )) --node-id "$i" --raft-listen "127.0.0.1:1810$i" "$@" \
        --listen "127.0.0.1:184${i}0" --metrics-listen "127.0.0.1:194${i}1" \
        --data-dir "$BASE/n$i/data" > "$BASE/n$i/log" 2>&1 &
    echo $! > "$BASE/n$i/pid"
}
for i in 1 2 3; do start "$i" --peers "$PEERS"; done
sleep 3
"$BIN" bench --server 127.0.0.1:18410 --ack durable --ack-level durable --rate "$RATE" \
    --duration "$D" --warmup 1s --json "$BASE/bench.json" --out-dir "$BASE/out" \
    > "$BASE/bench.txt" 2>&1 &
bench=$!
sleep 5
start 4 --join 127.0.0.1:18410
sleep 1
t0=$(date +%s.%N)
"$BIN" cluster add-node --server 127.0.0.1:18410 --node-id 4 --raft 127.0.0.1:18104 \
    --client 127.0.0.1:18440 --json
t1=$(date +%s.%N)
echo "add-node took $(echo "$t1 - $t0" | bc) s"
wait "$bench" || true
grep -E "^(throughput|publish ack|latency|end-to-end|missing)" "$BASE/bench.txt" || cat "$BASE/bench.txt"
python3 - "$BASE/bench.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
def find(d, path=""):
    if isinstance(d, dict):
        for k, v in d.items():
            if k == "max":
                print(f"{path}.max = {v}")
            find(v, f"{path}.{k}")
find(j)
PY
"$BIN" cluster status --server 127.0.0.1:18410
