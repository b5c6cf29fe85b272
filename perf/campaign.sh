#!/bin/bash
# The fault campaign of issue 21: three `pinq serve` in network namespaces joined by veth pairs,
# a client on each side of a partition, one fault every ~10 s (kill -9 / SIGSTOP / cut-off of
# the leader or a follower), then heal and drain. It checks and prints: acknowledged publishes
# lost, copies delivered after a `durable` ACK was answered ok, attempt decreases, the leader at
# the end, panics in the logs, and the longest gap between acknowledged publishes.
#
# The harness is the test tests/cluster_campaign.rs (60 s in the default suite); this script
# runs it longer. Needs root and `ip netns`; namespaces and processes are removed at the end.
#
# usage: perf/campaign.sh [seconds]     (default 300; PINQ_CAMPAIGN_SEED replays a run's choices)
# The report is also written to results/tmp/campaign-<date>.txt and the nodes' logs to
# results/tmp/campaign-<date>-logs/ (git ignores results/tmp/).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-300}
mkdir -p perf/results/tmp
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT="perf/results/tmp/campaign-$STAMP.txt"
PINQ_CAMPAIGN_LOG_DIR="$PWD/perf/results/tmp/campaign-$STAMP-logs" PINQ_CAMPAIGN_SECS="$SECS" cargo test --release --test cluster_campaign -- --nocapture --test-threads 1 2>&1 \
    | tee "$OUT" | grep -E "^fault campaign|^ +[0-9.]+ s |test result|panicked"
echo "full output: $OUT, node logs: perf/results/tmp/campaign-$STAMP-logs/"
