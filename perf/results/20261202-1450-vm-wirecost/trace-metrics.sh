#!/usr/bin/env bash
# One message's steps on the broker (the wire-step histograms on /metrics) beside what the load
# generator sees, at a fixed rate: `trace-metrics.sh RATE [bench flags]`. PINQ selects the binary.
# Prints the broker's mean per step over the whole run (warm-up included) and the bench's table.
set -u
rate=$1; shift
P=${PINQ:-/tmp/pinq-wc-trace}
data=$(mktemp -d); log=$(mktemp)
RUST_LOG=info $P serve --cpus 0 --storage memory --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --data-dir $data > $log 2>&1 &
pid=$!
for _ in $(seq 1 100); do
    addr=$(sed -n 's/^pinq listening on \([^ ]*\) .*/\1/p' $log | head -1)
    maddr=$(grep -o 'pinq metrics on [^ ]*' $log | awk '{print $4}')
    [ -n "$addr" ] && [ -n "$maddr" ] && break; sleep 0.1
done
echo "rate $rate, $(uptime)"
$P bench --server $addr --broker-pid $pid --producers 1 --consumers 1 --batch 1 --rate $rate \
    --client-cpus 1 --warmup 1s --duration 5s --out-dir $data/bench "$@" \
    | grep -E 'broker:|end to end|publish ack|^ack'
sleep 1.2   # the shards publish their snapshot once a second
curl -s http://$maddr/metrics | awk '
    /^pinq_(publish_latency|publish_call|deliver_round_trip|settle_call)_seconds_(sum|count)/ {
        name = $1; sub(/\{.*/, "", name); split(name, a, "_seconds_"); v[a[1] "_" a[2]] = $2 }
    END { for (k in v) if (k ~ /_sum$/) { n = substr(k, 1, length(k) - 4);
          printf "  broker %-28s mean %7.0f us over %d\n", n, 1e6 * v[k] / v[n "_count"], v[n "_count"] } }'
kill $pid; wait $pid 2>/dev/null; rm -rf $data $log
