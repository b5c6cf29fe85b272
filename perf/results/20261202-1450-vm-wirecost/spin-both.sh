#!/usr/bin/env bash
# 200 msgs/s, batch 1: spin before sleeping on neither side, the client's, the broker's, both;
# interleaved, REPS times. Uses trace-metrics.sh (broker steps beside the bench's latencies).
cd "$(dirname "$0")"
for rep in $(seq 1 ${REPS:-2}); do
  for mode in none client broker both; do
    echo "== rep $rep: spin on $mode"
    case $mode in
      none)   PINQ_SERVER_IDLE_POLL=0us   ./trace-metrics.sh 200 ;;
      client) PINQ_SERVER_IDLE_POLL=0us   ./trace-metrics.sh 200 --client-idle-poll 200us ;;
      broker) PINQ_SERVER_IDLE_POLL=200us ./trace-metrics.sh 200 ;;
      both)   PINQ_SERVER_IDLE_POLL=200us ./trace-metrics.sh 200 --client-idle-poll 200us ;;
    esac
  done
done
