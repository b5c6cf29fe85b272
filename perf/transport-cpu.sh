#!/bin/bash
# CPU seconds per shard thread of three two-shard nodes under durable load spread over both
# shards: tells whether one shard's core carries the node's Raft traffic for both (the funnel
# through shard 0) or each shard carries its own. Every node runs shard 0 on CPU 0 and shard 1
# on CPU 1; the load generator is on CPU 1 too. The load goes to the node that leads both shards.
# Run it for each binary in turn, interleaved, and compare within one run.
#
# usage: perf/transport-cpu.sh BINARY LABEL [RATE] [DURATION]   (default 4000 msgs/s, 8s)
set -u
BIN=$1; L=$2; RATE=${3:-4000}; D=${4:-8s}
W=$(mktemp -d)
PEERS="1=127.0.0.1:17201,2=127.0.0.1:17202,3=127.0.0.1:17203"
cleanup() { for f in "$W"/n*/pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done; rm -rf "$W"; }
trap cleanup EXIT INT TERM
start() {
    for i in 1 2 3; do
        mkdir -p "$W/n$i"
        "$BIN" serve --cpus 0,1 --node-id $i --raft-listen 127.0.0.1:1720$i --peers "$PEERS" \
            --listen 127.0.0.1:175${i}0 --metrics-listen 127.0.0.1:195${i}0 \
            --data-dir "$W/n$i/data" > "$W/n$i/log" 2>&1 &
        disown
        echo $! > "$W/n$i/pid"
    done
    sleep 3
}
leads_both() { # node: leads shards 0 and 1
    [ "$(curl -s "127.0.0.1:195${1}0/metrics" | grep -c '^pinq_raft_leader{shard="[01]"} 1')" = 2 ]
}
# The bench subscribes through one node and does not follow a shard's leader elsewhere: start
# the cluster again (fresh) until one node leads both shards, and load that node.
N=
for _ in $(seq 20); do
    start
    for i in 1 2 3; do leads_both $i && N=$i; done
    [ -n "$N" ] && break
    for f in "$W"/n*/pid; do kill -9 "$(cat "$f")" 2>/dev/null; done; sleep 0.5; rm -rf "$W"/n*
done
[ -n "$N" ] || { echo "no node led both shards in 20 starts"; exit 1; }
# The CPU each shard thread used before the load: elections and the first heartbeats.
snap() { for i in 1 2 3; do P=$(cat "$W/n$i/pid"); for t in /proc/$P/task/*; do
    awk -v n=$i '{printf "n%s %s %d\n", n, $2, $14+$15}' "$t/stat"; done; done; }
snap > "$W/before"
"$BIN" bench --server 127.0.0.1:175${N}0 --rate "$RATE" --producers 2 --consumers 1 --topics "${TOPICS:-8}" \
    --size 100 --warmup 1s --duration "$D" --ack durable --client-cpus 1 --out-dir "$W/out" \
    > "$W/bench.txt" 2>&1
snap > "$W/after"
grep -q "^throughput" "$W/bench.txt" || { echo "== $L: the bench failed:"; tail -5 "$W/bench.txt"; }
echo "== $L: $(grep -E '^throughput|^publish ack|^end to end' "$W/bench.txt" | tr -s ' ' | tr '\n' ';')"
# Per node and shard thread: CPU seconds spent during the bench (threads of the same name summed).
awk 'NR==FNR {b[$1" "$2]+=$3; next} {a[$1" "$2]+=$3}
     END {for (k in a) if (k ~ /pinq-shard/) printf "   %s %.2f s\n", k, (a[k]-b[k])/100}' \
    "$W/before" "$W/after" | sort
for i in 1 2 3; do
    echo "   n$i leads: $(curl -s "127.0.0.1:195${i}0/metrics" | grep -E '^pinq_raft_leader[{ ]' | tr '\n' ' ')"
done
