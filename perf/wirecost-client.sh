#!/usr/bin/env bash
# The client side of perf/wirecost.sh: instructions per message of the load generator and the
# client library (`pinq bench`, one client thread: two glommio executors hang under valgrind)
# under callgrind, against a broker running normally on CPU 0.
#
#   RATE=200 perf/wirecost-client.sh --batch 1 --ack leader --ack-level leader
#
# Environment: PINQ, RATE (default 200), DURATION (5), WARMUP (2), OUT
# (perf/results/tmp/wirecost-client). Prints total Ir per delivered message and the client
# library's entry points (producer, subscription) by inclusive Ir.
set -euo pipefail
cd "$(dirname "$0")/.."
PINQ="${PINQ:-${CARGO_TARGET_DIR:-target}/release/pinq}"
RATE="${RATE:-200}"
DURATION="${DURATION:-5}"
WARMUP="${WARMUP:-2}"
OUT="${OUT:-perf/results/tmp/wirecost-client}"
mkdir -p "$OUT"
data=$(mktemp -d)
RUST_LOG=warn "$PINQ" serve --cpus 0 --storage memory --listen 127.0.0.1:0 \
    --metrics-listen 127.0.0.1:0 --data-dir "$data" > "$OUT/broker.log" 2>&1 < /dev/null &
broker=$!
cleanup() { kill "$broker" 2>/dev/null || true; wait "$broker" 2>/dev/null || true; rm -rf "$data"; }
trap cleanup EXIT
addr=""
for _ in $(seq 1 100); do
    addr=$(sed -n 's/^pinq listening on \([^ ]*\) .*/\1/p' "$OUT/broker.log" | head -1)
    [ -n "$addr" ] && break
    sleep 0.1
done
[ -n "$addr" ] || { cat "$OUT/broker.log"; exit 1; }
rm -f "$OUT"/callgrind.out.*
taskset -c 1 valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out.%p" \
    "$PINQ" bench --server "$addr" --producers 1 --consumers 1 --rate "$RATE" \
    --client-threads 1 --warmup "${WARMUP}s" --duration "${DURATION}s" --json "$OUT/bench.json" \
    --out-dir "$OUT/bench" "$@" > "$OUT/bench.txt" 2>&1 &
vg=$!
sleep $((WARMUP + 3))   # valgrind's own start-up, then the warm-up
callgrind_control -z "$vg" > /dev/null
sleep "$DURATION"
callgrind_control -d "$vg" > /dev/null
wait "$vg" || true
dump=$(ls -t "$OUT"/callgrind.out.*.1 | head -1)
msgs=$(python3 -c "import json; print(json.load(open('$OUT/bench.json'))['msgs_per_sec'] * $DURATION)")
echo "dump $dump, messages (bench msgs/s × DURATION): $msgs"
callgrind_annotate --threshold=100 --inclusive=yes "$dump" > "$OUT/inclusive.txt" 2>/dev/null
python3 - "$OUT/inclusive.txt" "$msgs" <<'PY'
import re, sys
from collections import Counter
path, msgs = sys.argv[1], float(sys.argv[2])
inc, total = Counter(), 0
# With --batch 1 one `Client::publish` call is one message: count the window's messages by it
# (the bench's own window and callgrind's differ by valgrind's start-up).
calls = [int(m.group(1).replace(",", "")) for m in re.finditer(r"pinq::client::Client::publish \(([\d,]+)x\)", open(path, errors="replace").read())]
if calls:
    msgs = float(max(calls))
print(f"messages in the window: {msgs:,.0f}")
for line in open(path, errors="replace"):
    m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
    if not m:
        continue
    n, rest = int(m.group(1).replace(",", "")), re.sub(r" \[[^]]*\]$", "", m.group(2))
    if "PROGRAM TOTALS" in rest:
        total = n
        continue
    fn = rest.split(":", 1)[1] if ":" in rest else rest
    inc[fn] = max(inc[fn], n)
print(f"total Ir per message (load generator + client library): {total / msgs:,.0f}")
for f, n in inc.most_common(400):
    if re.search(r"^(<)?pinq::client::|pinq::bench::", f) and n / total > 0.02:
        print(f"  {n / msgs:>9,.0f}  {f[:140]}")
PY
