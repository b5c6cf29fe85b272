#!/usr/bin/env bash
# Syscalls per message of a standalone broker under strace -c -f for SECS s of a fixed-rate run.
# Usage: strace.sh LABEL RATE [env assignments...]; PINQ selects the binary.
set -u
RATEARGS="--batch 1 --rate $2"; [ "$2" = max ] && RATEARGS=""
label=$1; rate=$2; shift 2
P=${PINQ:-/tmp/pinq-wc-idle}
out=/work/wt-wirecost/perf/results/tmp/ab/strace; mkdir -p $out
data=$(mktemp -d)
env "$@" RUST_LOG=warn $P serve --cpus 0 --storage memory --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data-dir $data > $out/$label.serve.log 2>&1 &
pid=$!
for _ in $(seq 1 100); do addr=$(sed -n 's/^pinq listening on \([^ ]*\) .*/\1/p' $out/$label.serve.log | head -1); [ -n "$addr" ] && break; sleep 0.1; done
$P bench --server $addr --broker-pid $pid --producers 1 --consumers 1 $RATEARGS --client-cpus 1 --warmup 1s --duration ${DUR:-6s} --ack ${ACK:-durable} --out-dir $out/$label > $out/$label.bench.txt 2>&1 &
b=$!
sleep 2
timeout -s INT ${SECS:-3} strace -c -f -p $pid -o $out/$label.strace 2>/dev/null
wait $b
kill $pid; wait $pid 2>/dev/null; rm -rf $data
msgs=$(( ${MSGS_PER_SEC:-$rate} * ${SECS:-3} ))
echo "== $label rate $rate: syscalls per message (over $msgs msgs)"
awk -v m=$msgs '/^[ ]*[0-9.]+ +[0-9.]+ +[0-9]+ +[0-9]+/ {n=$4; name=$NF; if (name!="total") printf "  %-20s %.2f\n", name, n/m} /total/ {printf "  %-20s %.2f\n", "TOTAL", $3/m}' $out/$label.strace
grep -E 'broker:|end to end|publish ack' $out/$label.bench.txt
