#!/bin/sh
# Where a three-node cluster's time goes under one `pinq bench` load: the nodes as in
# perf/cluster-compare.sh (all on CPU 0, one shard each; the load generator on CPU 1), and for
# each node the change over the run of its CPU time (utime, stime: clock ticks), WAL writes and
# fdatasyncs, entries per appended record, and the leader's mean commit latency (proposal →
# committed by a quorum and applied).
#
# usage: perf/cluster-probe.sh bench-args...   e.g. perf/cluster-probe.sh --rate 2000 --batch 1 --duration 5s
set -eu
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin pinq
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
snap() { for i in 1 2 3; do curl -s 127.0.0.1:194${i}0/metrics | grep -E '^pinq_(raft_commit_latency_seconds_(sum|count)|raft_append_batch_entries_(sum|count)|storage_wal_(fsyncs|writes)_total|raft_leader|raft_messages_dropped)' | sed "s/^/n$i /"; awk '{print "n'$i' utime", $14; print "n'$i' stime", $15}' /proc/$(cat $BASE/n$i/pid)/stat; done; }
snap > "$BASE/before"
"$BIN" bench --ack durable --warmup 1s --client-cpus 1 --out-dir "$BASE/out" --server 127.0.0.1:17410 "$@" 2>&1 | grep -E "^(throughput|publish ack|missing)"
snap > "$BASE/after"
python3 - "$BASE/before" "$BASE/after" <<'PY'
import sys,re
def load(p):
    d={}
    for l in open(p):
        parts=l.split()
        d[(parts[0],parts[1])]=float(parts[-1])
    return d
b=load(sys.argv[1]); a=load(sys.argv[2])
for k in sorted(a):
    dv=a[k]-b.get(k,0)
    if dv or 'leader' in k[1]: print(k[0],k[1],round(dv,4))
for n in ('n1','n2','n3'):
    cs=[k for k in a if k[0]==n and 'commit_latency_seconds_sum' in k[1]]
    cc=[k for k in a if k[0]==n and 'commit_latency_seconds_count' in k[1]]
    if cs and cc:
        c=a[cc[0]]-b.get(cc[0],0)
        if c: print(n,'mean commit latency us',round((a[cs[0]]-b.get(cs[0],0))/c*1e6))
PY
