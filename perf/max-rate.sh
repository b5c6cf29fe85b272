#!/usr/bin/env bash
# Issue 23's maximum-rate rows beside Redis: 2 producers, one group of 2 consumers, 100 B,
# publish batches of 256 (both load generators' default), producers held back only by the
# backlog bound (20,000 copies sent and not delivered, both), broker on BROKER_CPUS, load on
# CLIENT_CPUS. Rows interleaved so that noise from other work on the machine hits both sides:
#
#   redis-always  pinq-durable  redis-none  pinq-memory  redis-everysec  pinq-leader
#
# pinq `durable` is compared with Redis `appendfsync always` and with Redis without AOF (issue
# 23: >= 2x and >= 1.5x), `leader` with `everysec`, memory with no AOF. One table with the
# ratios per repetition at the end (perf/low-rate-table.py).
#
#   REPEAT=3 DURATION=8s perf/max-rate.sh
#
# Everything else as perf/low-rate.sh, which does the work (RATE=max PRODUCERS=2 CONSUMERS=2);
# no strace run by default (STRACE_SECS=0): a traced run at max rate says nothing per message.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-perf/results/$(date -u +%Y%m%d-%H%M)-$(hostname)-maxrate}"
OUT="$out" RATE=max PRODUCERS=2 CONSUMERS=2 STRACE_SECS="${STRACE_SECS:-0}" \
    ROWS="${ROWS:-redis-always pinq-durable redis-none pinq-memory redis-everysec pinq-leader}" \
    exec bash perf/low-rate.sh
