#!/usr/bin/env bash
# Instructions per message of a one-shard broker (memory store), by step, under callgrind
# (issue 23 part 1). Deterministic enough to A/B two builds while the machine is busy, where
# timings are not.
#
#   RATE=200 perf/wirecost.sh            # a fixed rate; RATE=max: no --rate (max rate)
#   PINQ=/tmp/pinq-a RATE=10000 perf/wirecost.sh --batch 1
#
# The broker runs under `valgrind --tool=callgrind` with one executor (--cpus 0: two glommio
# executors hang under valgrind). `pinq bench --server` drives it with 1 producer and 1
# consumer (extra arguments go to the bench). Counting starts after WARMUP seconds
# (`callgrind_control -z`) and ends when the bench's measured window ends (`callgrind_control
# -d`); the dump's instructions are divided by the deliveries of that window (the bench's
# `received`). Under valgrind the broker runs some 50× slower: at 10,000 msgs/s it falls behind
# and batches, so read that row as "offered 10k", not as the cost at 10k on real hardware.
# Prints total Ir per message and, per step, the inclusive Ir per message of the functions that
# carry it (a function called from two steps counts in both). Environment: PINQ, RATE,
# DURATION (default 5), WARMUP (default 2), OUT (default perf/results/tmp/wirecost), STORAGE
# (memory, or lsm: then pass the bench `--ack durable` for durable publishes).
set -euo pipefail
cd "$(dirname "$0")/.."
PINQ="${PINQ:-${CARGO_TARGET_DIR:-target}/release/pinq}"
RATE="${RATE:-200}"
DURATION="${DURATION:-5}"
WARMUP="${WARMUP:-2}"
OUT="${OUT:-perf/results/tmp/wirecost}"
STORAGE="${STORAGE:-memory}"
mkdir -p "$OUT"
data=$(mktemp -d)
log="$OUT/broker.log"
RUST_LOG=warn setsid valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out.%p" \
    "$PINQ" serve --cpus 0 --storage "$STORAGE" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --data-dir "$data" ${PINQ_SERVE_ARGS:-} > "$log" 2>&1 < /dev/null &
vg=$!
cleanup() { kill "$vg" 2>/dev/null || true; wait "$vg" 2>/dev/null || true; rm -rf "$data"; }
trap cleanup EXIT
addr=""
for _ in $(seq 1 600); do
    addr=$(sed -n 's/^pinq listening on \([^ ]*\) .*/\1/p' "$log" | head -1)
    [ -n "$addr" ] && break
    kill -0 "$vg" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.2
done
[ -n "$addr" ] || { echo "the broker did not start under valgrind"; cat "$log"; exit 1; }
rate=(--rate "$RATE")
[ "$RATE" = max ] && rate=()
"$PINQ" bench --server "$addr" --producers 1 --consumers 1 "${rate[@]}" --warmup "${WARMUP}s" \
    --duration "${DURATION}s" --client-cpus 1 --json "$OUT/bench.json" --out-dir "$OUT/bench" \
    "$@" > "$OUT/bench.txt" 2>&1 &
bench=$!
sleep "$WARMUP"
callgrind_control -z "$vg" > /dev/null
sleep "$DURATION"
callgrind_control -d "$vg" > /dev/null
wait "$bench" || true
kill -TERM "$vg"; wait "$vg" 2>/dev/null || true
trap - EXIT
rm -rf "$data"
dump=$(ls -t "$OUT"/callgrind.out.*.1 2>/dev/null | head -1)
[ -n "$dump" ] || { echo "no callgrind dump in $OUT"; exit 1; }
# The bench's own window is not exactly callgrind's: count its delivery rate over ours.
msgs=$(python3 -c "import json; print(json.load(open('$OUT/bench.json'))['msgs_per_sec'] * $DURATION)")
echo "dump $dump, messages in the window (bench msgs/s × DURATION): $msgs (rate $RATE)"
callgrind_annotate --threshold=100 --inclusive=yes "$dump" > "$OUT/inclusive.txt" 2>/dev/null
callgrind_annotate --threshold=100 --inclusive=no "$dump" > "$OUT/self.txt" 2>/dev/null
python3 perf/wirecost-steps.py "$OUT/inclusive.txt" "$OUT/self.txt" "$msgs"
