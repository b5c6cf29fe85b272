#!/usr/bin/env bash
# Interleaved A/B of server.idlePoll: A off, B $SPIN; bench starts the broker (env inherited).
set -u
P=${PINQ:-/tmp/pinq-wc-idle}
SPIN=${SPIN:-200us}
out=${OUT:-/work/wt-wirecost/perf/results/tmp/ab/idle}
mkdir -p $out
for rate in ${RATES:-200 10000}; do
  for i in ${REPS:-1 2}; do
    for v in A B; do
      env=""; [ $v = B ] && env="PINQ_SERVER_IDLE_POLL=$SPIN"
      echo "== rate $rate rep $i $v ($env) $(uptime)"
      env $env $P bench --storage memory --producers 1 --consumers 1 --batch 1 --rate $rate \
        --broker-cpus 0 --client-cpus 1 --warmup 1s --duration ${DUR:-5s} --ack ${ACK:-durable} \
        --json $out/$rate-$i-$v.json --out-dir $out/$rate-$i-$v > $out/$rate-$i-$v.txt 2>&1
      grep -E 'throughput|broker:|end to end|publish ack|^ack' $out/$rate-$i-$v.txt
    done
  done
done
