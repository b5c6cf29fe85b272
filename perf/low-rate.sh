#!/usr/bin/env bash
# Low rate, like beside like (issue 11): a fixed 10,000 msgs/s of 100-byte messages, 1 producer,
# 1 consumer, broker on BROKER_CPUS, load on CLIENT_CPUS, one row per broker configuration:
#
#   pinq-memory     pinq, in-memory store              beside  redis-none      Redis, no AOF
#   pinq-leader     pinq, LSM, publishes acked leader  beside  redis-everysec  AOF, fsync every second
#   pinq-durable    pinq, LSM, acked after fdatasync   beside  redis-always    AOF, fsync before reply
#
# Each row: one measured run (latency, broker CPU per message, for pinq the WAL fdatasyncs per
# message from /metrics), then, unless STRACE_SECS=0, a second run of the same load during which
# `strace -c -f -p <broker>` counts the broker's system calls for STRACE_SECS seconds (strace
# slows the broker down, so latency is never read from that run): calls per message = calls /
# (rate x STRACE_SECS), with the counts per kind kept in <row>.strace.
#
#   perf/low-rate.sh                      all six rows, REPEAT=1, DURATION=10s
#   ROWS="pinq-durable redis-always" REPEAT=3 perf/low-rate.sh
#   PINQ_B=/tmp/pinq-new ROWS="pinq-durable" perf/low-rate.sh    A/B: rows of both binaries, interleaved
#   PINQ_B_ARGS="--ack-group 1ms" perf/low-rate.sh     A/B: the B rows' bench gets these flags too
#   RATE=200 BATCH=1 RTT=1 ROWS="pinq-memory redis-none" STRACE_SECS=0 perf/low-rate.sh
#                                         issue 23's 200 msgs/s rows, with the loopback RTT
#   RATE=max PRODUCERS=2 CONSUMERS=2 perf/low-rate.sh    maximum rate (perf/max-rate.sh)
#
# Environment: PINQ, PEERS (binaries), OUT (result directory; default a new
# perf/results/<date>-<host>-lowrate/), RATE (10000, or max: no --rate, producers held back only
# by the backlog bound), PRODUCERS and CONSUMERS (1), BATCH (messages per publish batch, both
# load generators; default theirs, 256), RTT (1: perf/rtt.py before each repetition, the
# loopback round trip the 200 msgs/s target is set against), DURATION, BROKER_CPUS (0),
# CLIENT_CPUS (1), STRACE_SECS (3), PINQ_ENV (extra "KEY=VALUE ..." for `pinq serve`),
# CAPTURE_SECS (0; N: `tcpdump` of the broker's port for N s in the middle of each measured run,
# split by perf/wire-turnaround.py into the broker's turnaround per connection, <row>.wire.json).
# perf/compare.sh runs this as its scenario L. The table ends with pinq / Redis ratios per
# repetition: of e2e and publish-ack p50 at a fixed rate, of msgs/s at RATE=max.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
PINQ="${PINQ:-$CARGO_TARGET_DIR/release/pinq}"
PINQ_B="${PINQ_B:-}"
PINQ_B_ARGS="${PINQ_B_ARGS:-}"
[ -n "$PINQ_B_ARGS" ] && [ -z "$PINQ_B" ] && PINQ_B="$PINQ"
PEERS="${PEERS:-$CARGO_TARGET_DIR/peers/release/pinq-peers}"
RATE="${RATE:-10000}"
DURATION="${DURATION:-10s}"
REPEAT="${REPEAT:-1}"
PRODUCERS="${PRODUCERS:-1}"
CONSUMERS="${CONSUMERS:-1}"
BATCH="${BATCH:-}"
RTT="${RTT:-0}"
BROKER_CPUS="${BROKER_CPUS:-0}"
CLIENT_CPUS="${CLIENT_CPUS-1}"
STRACE_SECS="${STRACE_SECS:-3}"
CAPTURE_SECS="${CAPTURE_SECS:-0}"
ROWS="${ROWS:-pinq-memory redis-none pinq-leader redis-everysec pinq-durable redis-always}"
PINQ_PORT="${PINQ_PORT:-17400}"
METRICS_PORT="${METRICS_PORT:-19400}"
REDIS_PORT="${REDIS_PORT:-16379}"

[ -x "$PINQ" ] || cargo build --release
[ -x "$PEERS" ] || CARGO_TARGET_DIR="$CARGO_TARGET_DIR/peers" \
    cargo build --release --manifest-path perf/peers/Cargo.toml
case " $ROWS " in *redis*) command -v redis-server >/dev/null || {
    echo "redis-server missing: perf/compare.sh installs it" >&2; exit 2; } ;; esac
if [ "$CAPTURE_SECS" != 0 ] && ! command -v tcpdump >/dev/null; then
    echo "installing tcpdump from the Debian packages"
    DEBIAN_FRONTEND=noninteractive apt-get install -y tcpdump >/dev/null
fi
if [ "$STRACE_SECS" != 0 ] && ! command -v strace >/dev/null; then
    echo "installing strace from the Debian packages"
    DEBIAN_FRONTEND=noninteractive apt-get install -y strace >/dev/null
fi

out="${OUT:-perf/results/$(date -u +%Y%m%d-%H%M)-$(hostname)-lowrate}"
mkdir -p "$out"
if [ ! -e "$out/machine.txt" ]; then
    bash perf/machine.sh > "$out/machine.txt"
    echo "rate: $RATE msgs/s, $PRODUCERS producer(s), $CONSUMERS consumer(s), 100 B, batch ${BATCH:-default}; broker cpus $BROKER_CPUS, client cpus ${CLIENT_CPUS:-not pinned}; duration $DURATION" >> "$out/machine.txt"
fi
pin=()
pinq_pin=()
if [ -n "$CLIENT_CPUS" ]; then
    pin=(taskset -c "$CLIENT_CPUS")
    pinq_pin=(--client-cpus "$CLIENT_CPUS")
fi
load=(--producers "$PRODUCERS" --consumers "$CONSUMERS" --size 100 --warmup 1s)
[ "$RATE" != max ] && load+=(--rate "$RATE")
[ -n "$BATCH" ] && load+=(--batch "$BATCH")

work=$(mktemp -d)
server=""
stop_server() {
    if [ -n "$server" ]; then
        kill "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
        server=""
    fi
}
trap 'stop_server; rm -rf "$work"' EXIT

wait_port() {
    for _ in $(seq 1 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    echo "nothing listens on port $1" >&2
    return 1
}
# "<cpu ticks> <uptime s> <run-queue wait ns>" of a process: its user+system time, and the time
# its threads were runnable but not running (other work on the machine held it back).
usage() {
    local wait=0 w t
    for t in /proc/"$1"/task/*/schedstat; do
        w=$(cut -d' ' -f2 "$t" 2>/dev/null || echo 0)
        wait=$((wait + w))
    done
    echo "$(awk '{print $14 + $15}' /proc/"$1"/stat) $(cut -d' ' -f1 /proc/uptime) $wait"
}
wal_fsyncs() {
    curl -s "http://127.0.0.1:$METRICS_PORT/metrics" \
        | awk '/^pinq_storage_wal_fsyncs_total/ {s += $2} END {print s + 0}'
}
# strace -c of process $1 for STRACE_SECS while the load runs: writes $2.
strace_window() {
    [ "$STRACE_SECS" = 0 ] && return 0
    timeout -s INT "$STRACE_SECS" strace -c -f -p "$1" -o "$2" > /dev/null 2>&1 || true
}

# Captures the packets of port $1 for CAPTURE_SECS from 2 s on, in the background; then
# capture_done splits them (perf/wire-turnaround.py) into $out/$2.wire.json.
capture_start() {
    capture=""
    [ "$CAPTURE_SECS" = 0 ] && return 0
    # On the load's CPUs, away from the broker's.
    (sleep 2; timeout -s INT "$CAPTURE_SECS" ${pin[@]+"${pin[@]}"} tcpdump -i lo -tt -nn -q "tcp port $1" \
        > "$work/capture.txt" 2> /dev/null) &
    capture=$!
}
capture_done() {
    [ -z "$capture" ] && return 0
    wait "$capture" || true
    python3 perf/wire-turnaround.py --port "$1" --json "$out/$2.wire.json" "$work/capture.txt" \
        > "$out/$2.wire.txt" || true
}

# run_pinq NAME BINARY STORAGE ACK [BENCH FLAGS...]
run_pinq() {
    local name=$1 bin=$2 storage=$3 ack=$4
    shift 4
    local extra=("$@")
    rm -rf "$work/data"
    # shellcheck disable=SC2086
    env ${PINQ_ENV:-} RUST_LOG=warn "$bin" serve --cpus "$BROKER_CPUS" --storage "$storage" \
        --data-dir "$work/data" --listen "127.0.0.1:$PINQ_PORT" \
        --metrics-listen "127.0.0.1:$METRICS_PORT" > "$out/$name.serve.log" 2>&1 < /dev/null &
    server=$!
    wait_port "$PINQ_PORT"
    wait_port "$METRICS_PORT"
    local before after
    before=$(wal_fsyncs)
    capture_start "$PINQ_PORT"
    "$bin" bench --server "127.0.0.1:$PINQ_PORT" --broker-pid "$server" "${load[@]}" \
        --duration "$DURATION" --ack "$ack" "${pinq_pin[@]}" ${extra[@]+"${extra[@]}"} \
        --json "$out/$name.json" --out-dir "$out/$name" > /dev/null 2> "$out/$name.log" \
        || echo "pinq $name failed (see $out/$name.log)"
    capture_done "$PINQ_PORT" "$name"
    after=$(wal_fsyncs)
    echo "$((after - before))" > "$out/$name.fsyncs"
    # Kept for what the table leaves out (delete batches, WAL writes, dispatch counters).
    curl -s "http://127.0.0.1:$METRICS_PORT/metrics" > "$out/$name.metrics" || true
    if [ "$STRACE_SECS" != 0 ]; then
        "$bin" bench --server "127.0.0.1:$PINQ_PORT" "${load[@]}" \
            --duration "$((STRACE_SECS + 2))s" --ack "$ack" "${pinq_pin[@]}" ${extra[@]+"${extra[@]}"} \
            --out-dir "$work/strace-out" > /dev/null 2>&1 &
        local bench=$!
        sleep 1.5
        strace_window "$server" "$out/$name.strace"
        wait "$bench" || true
    fi
    stop_server
}

# run_redis NAME AOF-MODE(none|everysec|always)
run_redis() {
    local name=$1 mode=$2 aof
    rm -rf "$work/redis"
    mkdir -p "$work/redis"
    if [ "$mode" = none ]; then aof=(--appendonly no); else aof=(--appendonly yes --appendfsync "$mode"); fi
    setsid taskset -c "$BROKER_CPUS" redis-server --bind 127.0.0.1 --port "$REDIS_PORT" \
        --dir "$work/redis" "${aof[@]}" --save "" --protected-mode no \
        > "$out/$name.serve.log" 2>&1 < /dev/null &
    server=$!
    wait_port "$REDIS_PORT"
    local before
    before=$(usage "$server")
    capture_start "$REDIS_PORT"
    "${pin[@]}" "$PEERS" redis --server "127.0.0.1:$REDIS_PORT" "${load[@]}" --duration "$DURATION" \
        --json "$out/$name.json" > /dev/null 2> "$out/$name.log" || echo "redis $name failed"
    capture_done "$REDIS_PORT" "$name"
    echo "$before $(usage "$server")" \
        | awk '{printf "%.2f %.2f %.2f\n", ($4-$1)/100, $5-$2, ($6-$3)/1e9}' > "$out/$name.usage"
    if [ "$STRACE_SECS" != 0 ]; then
        "${pin[@]}" "$PEERS" redis --server "127.0.0.1:$REDIS_PORT" "${load[@]}" \
            --duration "$((STRACE_SECS + 2))s" --json "$work/strace.json" > /dev/null 2>&1 &
        local bench=$!
        sleep 1.5
        strace_window "$server" "$out/$name.strace"
        wait "$bench" || true
    fi
    stop_server
}

# run_row ROW BINARY NAME [BENCH FLAGS...]
run_row() {
    local row=$1 bin=$2 name=$3
    shift 3
    case "$row" in
        pinq-memory) run_pinq "$name" "$bin" memory durable "$@" ;;
        pinq-leader) run_pinq "$name" "$bin" lsm leader "$@" ;;
        pinq-durable) run_pinq "$name" "$bin" lsm durable "$@" ;;
        redis-none) run_redis "$name" none ;;
        redis-everysec) run_redis "$name" everysec ;;
        redis-always) run_redis "$name" always ;;
        *) echo "unknown row $row" >&2; exit 2 ;;
    esac
}

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/loadavg.txt"
for r in $(seq 1 "$REPEAT"); do
    if [ "$RTT" = 1 ]; then
        rtt_rate=$RATE
        [ "$rtt_rate" = max ] && rtt_rate=200
        python3 perf/rtt.py --rate "$rtt_rate" --server-cpu "${BROKER_CPUS%%[,-]*}" \
            --client-cpu "$(c=${CLIENT_CPUS:-1}; echo "${c%%[,-]*}")" --json "$out/rtt.$r.json" | tee -a "$out/rtt.txt"
    fi
    for row in $ROWS; do
        echo "== $row (run $r)"
        cut -d' ' -f1 /proc/loadavg > "$out/$row.$r.load"
        run_row "$row" "$PINQ" "$row.$r"
        if [ -n "$PINQ_B" ] && [ "${row#pinq}" != "$row" ]; then
            echo "== $row B (run $r)"
            # shellcheck disable=SC2086
            run_row "$row" "$PINQ_B" "$row-B.$r" $PINQ_B_ARGS
        fi
    done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/loadavg.txt"

python3 perf/low-rate-table.py "$out" "$DURATION" "$RATE" "$STRACE_SECS" | tee "$out/lowrate.txt"
echo "results in $out"
