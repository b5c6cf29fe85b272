#!/bin/bash
# CPU seconds per thread of one broker under the low-rate durable load (10,000 msgs/s, 1
# producer, 1 consumer, 100 B, durable publishes and ACKs, 1 s warm-up + 6 s), with the
# bench's end-to-end and ACK percentiles: tells the shard thread's CPU from io_uring's workers
# (iou-wrk-*, which run the fdatasyncs). Broker on CPU 0, load on CPU 1.
#
# usage: perf/wal-thread-cpu.sh BINARY LABEL      (run it for each binary in turn, interleaved)
set -u
BIN=$1; L=$2
W=$(mktemp -d)
"$BIN" serve --cpus 0 --storage lsm --data-dir "$W/data" --listen 127.0.0.1:17480 \
    --metrics-listen 127.0.0.1:19480 > "$W/serve.log" 2>&1 &
S=$!
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/17480) 2>/dev/null && break; sleep 0.05; done
"$BIN" bench --server 127.0.0.1:17480 --rate 10000 --producers 1 --consumers 1 --size 100 \
    --warmup 1s --duration 6s --ack durable --client-cpus 1 --out-dir "$W/out" > "$W/bench.txt" 2>&1
echo "== $L: $(grep -E '^end to end|^ack ' "$W/bench.txt" | tr -s ' ' | tr '\n' ';')"
for t in /proc/$S/task/*; do awk '{printf "%s %d\n", $2, $14+$15}' "$t/stat"; done \
    | awk '{a[$1]+=$2} END {for (k in a) if (a[k] > 0) print "  ", k, a[k]/100 " s"}'
awk '{printf "   process total %.2f s\n", ($14+$15)/100}' /proc/$S/stat
kill $S; wait $S 2>/dev/null; rm -rf "$W"
