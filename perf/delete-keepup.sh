#!/usr/bin/env bash
# Do deletes keep up with durable load, and does memory follow configuration? Starts
# `pinq serve --storage lsm` on BROKER_CPUS, drives it with `pinq bench --server` from
# CLIENT_CPUS at max rate, samples /metrics once a second, and prints per second: ACKed,
# deleted, deleted/ACKed, delete backlog, in flight, dispatch pauses, RSS; then the peak RSS
# (VmHWM), the bench summary, and table bytes written (flushes + compactions) against the bytes
# published.
#
#   perf/delete-keepup.sh [extra pinq bench flags...]      e.g.  --ack leader
#
# Environment: PINQ (binary, default target/release/pinq), DURATION (default 20s),
# BROKER_CPUS (default 0), CLIENT_CPUS (default 1), SIZE (payload bytes, default 100), and any
# PINQ_* configuration variable for the broker (PINQ_STORAGE_MEMTABLE_BYTES=16MiB ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PINQ="${PINQ:-target/release/pinq}"
DURATION="${DURATION:-20s}"
BROKER_CPUS="${BROKER_CPUS:-0}"
CLIENT_CPUS="${CLIENT_CPUS:-1}"
SIZE="${SIZE:-100}"
[ -x "$PINQ" ] || cargo build --release

data=$(mktemp -d)
out=$(mktemp -d)
port=$((20000 + RANDOM % 20000))
metrics_port=$((port + 1000))
"$PINQ" serve --storage lsm --cpus "$BROKER_CPUS" --listen "127.0.0.1:$port" \
    --metrics-listen "127.0.0.1:$metrics_port" --data-dir "$data" >"$out/serve.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$data"' EXIT
for _ in $(seq 100); do
    curl -sf "127.0.0.1:$metrics_port/metrics" >/dev/null 2>&1 && break
    sleep 0.1
done

# Sum of a metric over shards (and labels matching $2, if given).
metric() {
    grep "^$1" "$3" | grep -- "${2:-}" | awk '{s += $NF} END {printf "%d", s}'
}

sample() {
    local t=0
    printf "%4s %10s %10s %8s %9s %9s %7s %8s\n" s acked deleted del/ack backlog inflight pauses rss_mib
    while kill -0 "$pid" 2>/dev/null && [ -e "$out/sampling" ]; do
        if ! curl -sf -m 1 "127.0.0.1:$metrics_port/metrics" >"$out/m" 2>/dev/null; then
            sleep 0.2
            continue
        fi
        local acked deleted backlog inflight pauses rss
        acked=$(metric pinq_consumer_ack_total 'result="acked"' "$out/m")
        deleted=$(metric pinq_deleted_keys_total '' "$out/m")
        backlog=$(metric pinq_delete_backlog_keys '' "$out/m")
        inflight=$(metric pinq_messages_in_flight '' "$out/m")
        pauses=$(metric pinq_dispatch_paused_delete_backlog_total '' "$out/m")
        rss=$(awk '/VmRSS/ {printf "%d", $2 / 1024}' "/proc/$pid/status")
        ratio=$(awk -v a="$acked" -v d="$deleted" 'BEGIN {if (a > 0) printf "%.3f", d / a; else print "-"}')
        printf "%4d %10d %10d %8s %9d %9d %7d %8d\n" "$t" "$acked" "$deleted" "$ratio" "$backlog" "$inflight" "$pauses" "$rss"
        t=$((t + 1))
        sleep 1
    done
}

touch "$out/sampling"
sample &
sampler=$!
"$PINQ" bench --server "127.0.0.1:$port" --broker-pid "$pid" --client-cpus "$CLIENT_CPUS" \
    --producers 2 --consumers 2 --size "$SIZE" --duration "$DURATION" \
    --json "$out/bench.json" --out-dir "$out/bench" "$@" >"$out/bench.txt" 2>&1 || {
    cat "$out/bench.txt"
    exit 1
}
rm -f "$out/sampling"
wait "$sampler" || true
curl -sf "127.0.0.1:$metrics_port/metrics" >"$out/m"
published=$(metric pinq_messages_published_total '' "$out/m")
flushed=$(metric pinq_storage_flush_bytes_written_total '' "$out/m")
compacted=$(metric pinq_storage_compaction_bytes_written_total '' "$out/m")
echo "peak RSS (VmHWM): $(awk '/VmHWM/ {printf "%.1f MiB", $2 / 1024}' "/proc/$pid/status")"
awk -v p="$published" -v s="$SIZE" -v f="$flushed" -v c="$compacted" 'BEGIN {
    pub = p * (s + 24);
    printf "published %d messages (%.1f MiB of keys+payloads); table bytes written: flushes %.1f MiB + compactions %.1f MiB = %.2f %% of published\n",
        p, pub / 1048576, f / 1048576, c / 1048576, 100 * (f + c) / (pub > 0 ? pub : 1) }'
grep -E 'throughput|received|missing|duplicates|peak|e2e|end-to-end' "$out/bench.txt" || cat "$out/bench.txt"
