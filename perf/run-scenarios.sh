#!/usr/bin/env bash
# Runs the standard scenarios of issue 5 with `pinq bench` and writes the results under
# perf/results/<date>-<host>-scenarios/: machine.txt, and per scenario the JSON summary, the
# .hgrm files, latency.svg and report.txt; then prints one table.
#
#   perf/run-scenarios.sh [SCENARIO...]        (default: A A-lsm B C D E E-lsm)
#
# Environment: PINQ (binary, default target/release/pinq, built if missing with
# CARGO_TARGET_DIR), DURATION (measured time of A-D, default 10s), BROKER_CPUS (default 0:
# one shard), CLIENT_CPUS (default 1: the load generator kept off the broker's core; empty:
# not pinned).
#
# Scenarios:
#   A      max rate, 100-byte messages, 2 producers, 2 consumers, one group, in-memory store
#   A-lsm  A with --storage lsm
#   B      A with 1 KiB messages
#   C      fixed 10,000 msgs/s, 100 B: end-to-end p50/p99/p99.9
#   D      one group of 2 plus 3 universal consumers (fan-out)
#   E      1,000,000 messages delayed 1-10 s with consumers attached (100,000 msgs/s for 10 s):
#          lateness p50/p99 (end to end is measured from the due time), broker CPU and peak RSS
#          while they wait
#   E-lsm  E with --storage lsm: the waiting messages live in the LSM (memtable bounded by
#          storage.memtableBytes), so resident memory should not grow with their number
set -euo pipefail
cd "$(dirname "$0")/.."
PINQ="${PINQ:-${CARGO_TARGET_DIR:-target}/release/pinq}"
DURATION="${DURATION:-10s}"
BROKER_CPUS="${BROKER_CPUS:-0}"
CLIENT_CPUS="${CLIENT_CPUS-1}"
if [ ! -x "$PINQ" ]; then
    cargo build --release
fi
scenarios=("$@")
[ ${#scenarios[@]} -eq 0 ] && scenarios=(A A-lsm B C D E E-lsm)

out="perf/results/$(date -u +%Y%m%d-%H%M)-$(hostname)-scenarios"
mkdir -p "$out"
bash perf/machine.sh > "$out/machine.txt"
echo "broker cpus: $BROKER_CPUS; client cpus: ${CLIENT_CPUS:-not pinned}; duration: $DURATION" >> "$out/machine.txt"
cat "$out/machine.txt"

common=(--producers 2 --broker-cpus "$BROKER_CPUS")
[ -n "$CLIENT_CPUS" ] && common+=(--client-cpus "$CLIENT_CPUS")
args_of() {
    case "$1" in
        A) echo "--consumers 2 --size 100 --duration $DURATION" ;;
        A-lsm) echo "--consumers 2 --size 100 --duration $DURATION --storage lsm" ;;
        B) echo "--consumers 2 --size 1024 --duration $DURATION" ;;
        C) echo "--consumers 2 --size 100 --duration $DURATION --rate 10000" ;;
        D) echo "--consumers 2 --universal 3 --size 100 --duration $DURATION" ;;
        E) echo "--consumers 2 --size 100 --warmup 0s --duration 10s --rate 100000 --delay-mix 1s:1,2s:1,3s:1,4s:1,5s:1,6s:1,7s:1,8s:1,9s:1,10s:1" ;;
        E-lsm) echo "$(args_of E) --storage lsm" ;;
        *) echo "unknown scenario $1" >&2; exit 2 ;;
    esac
}

for s in "${scenarios[@]}"; do
    # shellcheck disable=SC2046
    set -- $(args_of "$s")
    echo "== scenario $s: pinq bench ${common[*]} $*" | tee "$out/$s.cmd"
    if "$PINQ" bench "${common[@]}" "$@" --json "$out/$s.json" --out-dir "$out/$s" \
        2> "$out/$s.log"; then :; else echo "scenario $s FAILED (see $out/$s.log)"; fi
done

echo
{
printf '%-6s %12s %9s %10s %8s %10s %10s %10s %10s\n' scen msgs/s MB/s sent missing e2e_p50us e2e_p99us e2e_p999us pub_p99us
for s in "${scenarios[@]}"; do
    f="$out/$s.json"
    [ -f "$f" ] || { echo "$s: no result"; continue; }
    python3 - "$s" "$f" <<'PY'
import json, sys
s, f = sys.argv[1], sys.argv[2]
j = json.load(open(f))
print(f"{s:<6} {j['msgs_per_sec']:>12.0f} {j['mb_per_sec']:>9.2f} {j['sent']:>10} {j['missing']:>8} "
      f"{j['e2e_us']['p50']:>10} {j['e2e_us']['p99']:>10} {j['e2e_us']['p999']:>10} {j['publish_ack_us']['p99']:>10}")
PY
done
} | tee "$out/table.txt"
echo "results in $out"
