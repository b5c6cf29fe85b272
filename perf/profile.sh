#!/usr/bin/env bash
# Profiles a one-shard broker under load with callgrind and prints the top functions by
# instructions (self and inclusive).
#
#   perf/profile.sh [extra pinq bench flags]      e.g. perf/profile.sh --size 1024
#
# The broker runs under valgrind with one executor (--cpus 0: two glommio executors hang under
# valgrind); `pinq bench --server` drives it at a fixed rate valgrind can keep up with (RATE,
# default 5000 msgs/s, for DURATION, default 10s). Output: perf/results/tmp/callgrind.out.<pid>
# and the annotated top list. Environment: PINQ as in run-scenarios.sh, TOP (default 30).
set -euo pipefail
cd "$(dirname "$0")/.."
PINQ="${PINQ:-${CARGO_TARGET_DIR:-target}/release/pinq}"
RATE="${RATE:-5000}"
DURATION="${DURATION:-10s}"
TOP="${TOP:-30}"
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)"; exit 1; }
[ -x "$PINQ" ] || cargo build --release

tmp=perf/results/tmp
mkdir -p "$tmp"
data=$(mktemp -d)
log="$tmp/profile-broker.log"
RUST_LOG=warn setsid valgrind --tool=callgrind --callgrind-out-file="$tmp/callgrind.out.%p" \
    "$PINQ" serve --cpus 0 --storage memory --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --data-dir "$data" > "$log" 2>&1 < /dev/null &
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
echo "broker under callgrind at $addr (pid $vg)"
"$PINQ" bench --server "$addr" --producers 1 --consumers 1 --rate "$RATE" --warmup 1s \
    --duration "$DURATION" --out-dir "$tmp/profile-bench" "$@" || true
# SIGTERM ends valgrind's guest; callgrind writes its profile on the way out.
kill -TERM "$vg"; wait "$vg" 2>/dev/null || true
trap - EXIT
rm -rf "$data"
out=$(ls -t "$tmp"/callgrind.out.* | head -1)
echo "profile: $out"
echo "== top $TOP functions by instructions (self)"
# `head` closes the pipe early; that SIGPIPE is not a failure.
callgrind_annotate "$out" 2>/dev/null | sed -n '/^Ir/,$p' | head -$((TOP + 3)) || true
# Inclusive totals of the executor's future combinators exceed 100 % (recursion) and say
# little; pinq's own functions, inclusive, show where the work goes by subsystem.
echo "== top $TOP pinq functions by instructions (inclusive)"
callgrind_annotate --inclusive=yes "$out" 2>/dev/null | grep -E ':<?pinq::' \
    | sed -E 's|/root/.cargo/registry/src/[^/]*/||; s| \[/[^]]*\]$||' | head -"$TOP" || true
