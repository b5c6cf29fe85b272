#!/usr/bin/env bash
# Side by side: pinq, NATS JetStream and Redis Streams on this host, scenarios A, B and C of
# issue 5, one table at the end. Installs nats-server and redis-server from the Debian packages
# if missing, starts them on 127.0.0.1 (ephemeral data directories), runs the scenarios, stops
# them. Results: perf/results/<date>-<host>-compare/ (machine.txt, one JSON per run, table.txt).
#
#   perf/compare.sh                      DURATION=10s BROKER_CPUS=0 CLIENT_CPUS=1 by default
#   SCENARIOS="L" perf/compare.sh        only the like-beside-like low-rate rows
#
# Scenario L (perf/low-rate.sh, after A, B, C): like beside like at a fixed 10,000 msgs/s,
# 1 producer, 1 consumer, 100 B: pinq `durable` beside Redis `appendfsync always`, pinq `leader`
# beside `appendfsync everysec`, pinq's memory store beside Redis without AOF, with broker CPU,
# WAL fdatasyncs and system calls (strace -c) per message. Its table is appended to table.txt.
#
# Fairness: every broker is confined to the same CPUs (BROKER_CPUS, with taskset; pinq by its
# own --broker-cpus), and every load generator to CLIENT_CPUS. Same workload: 2 producers, one group
# of 2 competing consumers with explicit per-message acks, publish batches of 256 in flight with
# a window, max rate bounded by a backlog of 20,000 copies (A, B) or a fixed 10,000 msgs/s (C).
# Durability differs and is stated in the table's header: pinq runs its in-memory store (the
# issue's scenario A; perf/run-scenarios.sh has the LSM variants), NATS JetStream a file
# store (written through the OS page cache, fsynced by the server's own interval), Redis an
# append-only file fsynced every second.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
PINQ="${PINQ:-$CARGO_TARGET_DIR/release/pinq}"
PEERS="${PEERS:-$CARGO_TARGET_DIR/peers/release/pinq-peers}"
DURATION="${DURATION:-10s}"
BROKER_CPUS="${BROKER_CPUS:-0}"
# The load generators' CPUs (pinq bench --client-cpus, taskset for pinq-peers); empty: not pinned.
CLIENT_CPUS="${CLIENT_CPUS-1}"
NATS_PORT="${NATS_PORT:-14222}"
REDIS_PORT="${REDIS_PORT:-16379}"
SCENARIOS="${SCENARIOS:-A B C L}"

[ -x "$PINQ" ] || cargo build --release
[ -x "$PEERS" ] || CARGO_TARGET_DIR="$CARGO_TARGET_DIR/peers" \
    cargo build --release --manifest-path perf/peers/Cargo.toml

missing=()
command -v nats-server >/dev/null || missing+=(nats-server)
command -v redis-server >/dev/null || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} from the Debian packages"
    as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
    # Install without starting the distribution's own service instances.
    created_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
        as_root chmod +x /usr/sbin/policy-rc.d
        created_policy=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
    [ "$created_policy" = 1 ] && as_root rm -f /usr/sbin/policy-rc.d
fi

out="perf/results/$(date -u +%Y%m%d-%H%M)-$(hostname)-compare"
mkdir -p "$out"
bash perf/machine.sh > "$out/machine.txt"
{
    echo "nats-server: $(nats-server --version 2>&1 | head -1)"
    echo "redis-server: $(redis-server --version | head -1)"
    echo "broker cpus: $BROKER_CPUS; client cpus: ${CLIENT_CPUS:-not pinned}; duration: $DURATION"
} >> "$out/machine.txt"
cat "$out/machine.txt"

work=$(mktemp -d)
pids=()
stop_servers() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
    rm -rf "$work"
}
trap stop_servers EXIT

mkdir -p "$work/nats" "$work/redis"
setsid taskset -c "$BROKER_CPUS" nats-server -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$work/nats" \
    > "$out/nats-server.log" 2>&1 < /dev/null &
pids+=($!)
setsid taskset -c "$BROKER_CPUS" redis-server --bind 127.0.0.1 --port "$REDIS_PORT" \
    --dir "$work/redis" --appendonly yes --appendfsync everysec --save "" \
    --protected-mode no > "$out/redis-server.log" 2>&1 < /dev/null &
pids+=($!)
for port in "$NATS_PORT" "$REDIS_PORT"; do
    for _ in $(seq 1 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.1
    done
done

nats_pid=${pids[0]}
redis_pid=${pids[1]}
# "<cpu ticks> <run-queue wait ns> <uptime s>" of a process: its user+system time and the time
# its threads were runnable but not running (other work on the machine held it back).
usage() {
    local pid=$1 wait=0 w
    for t in /proc/"$pid"/task/*/schedstat; do
        w=$(cut -d' ' -f2 "$t" 2>/dev/null || echo 0)
        wait=$((wait + w))
    done
    echo "$(awk '{print $14 + $15}' /proc/"$pid"/stat) $wait $(cut -d' ' -f1 /proc/uptime)"
}
# Writes "<cpu s> <wait s> <elapsed s>" between two usage samples.
usage_delta() {
    echo "$1 $2" | awk '{printf "%.2f %.2f %.2f\n", ($4-$1)/100, ($5-$2)/1e9, $6-$3}'
}

scenario_args() {
    case "$1" in
        A) echo "--size 100" ;;
        B) echo "--size 1024" ;;
        C) echo "--size 100 --rate 10000" ;;
    esac
}
common=(--producers 2 --consumers 2 --warmup 1s --duration "$DURATION")
pin=()
pinq_pin=()
if [ -n "$CLIENT_CPUS" ]; then
    pin=(taskset -c "$CLIENT_CPUS")
    pinq_pin=(--client-cpus "$CLIENT_CPUS")
fi
for s in A B C; do
    case " $SCENARIOS " in *" $s "*) ;; *) continue ;; esac
    # shellcheck disable=SC2046
    set -- $(scenario_args "$s")
    echo "== $s pinq"
    "$PINQ" bench "${common[@]}" "$@" --broker-cpus "$BROKER_CPUS" "${pinq_pin[@]}" \
        --json "$out/$s-pinq.json" --out-dir "$out/$s-pinq" 2> "$out/$s-pinq.log" \
        || echo "pinq $s failed (see $out/$s-pinq.log)"
    echo "== $s nats"
    before=$(usage "$nats_pid")
    "${pin[@]}" "$PEERS" nats --server "127.0.0.1:$NATS_PORT" "${common[@]}" "$@" \
        --json "$out/$s-nats.json" > /dev/null 2> "$out/$s-nats.log" \
        || echo "nats $s failed (see $out/$s-nats.log)"
    usage_delta "$before" "$(usage "$nats_pid")" > "$out/$s-nats.usage"
    echo "== $s redis"
    before=$(usage "$redis_pid")
    "${pin[@]}" "$PEERS" redis --server "127.0.0.1:$REDIS_PORT" "${common[@]}" "$@" \
        --json "$out/$s-redis.json" > /dev/null 2> "$out/$s-redis.log" \
        || echo "redis $s failed (see $out/$s-redis.log)"
    usage_delta "$before" "$(usage "$redis_pid")" > "$out/$s-redis.usage"
done
stop_servers
trap - EXIT
if [ "${SCENARIOS#*L}" != "$SCENARIOS" ]; then
    echo "== L: like beside like at a fixed 10,000 msgs/s (perf/low-rate.sh)"
    OUT="$out/L" PINQ="$PINQ" PEERS="$PEERS" BROKER_CPUS="$BROKER_CPUS" CLIENT_CPUS="$CLIENT_CPUS" \
        DURATION="$DURATION" REDIS_PORT="$REDIS_PORT" bash perf/low-rate.sh > "$out/L.log" 2>&1 \
        || echo "scenario L failed (see $out/L.log)"
fi

python3 - "$out" "$DURATION" "${SCENARIOS// /}" <<'PY' | tee "$out/table.txt"
import json, os, re, sys
out, duration = sys.argv[1], sys.argv[2]
window = float(re.sub(r"s$", "", duration))

def usage(s, b):
    """Broker CPU and run-queue wait, as % of one core over the period sampled."""
    if b == "pinq":
        # pinq bench measures its child broker over the measured window.
        try:
            text = open(os.path.join(out, f"{s}-pinq", "report.txt")).read()
            cpu = float(re.search(r"broker: +([0-9.]+) CPU s", text).group(1))
            wait = float(re.search(r"waited ([0-9.]+) s", text).group(1))
            return 100 * cpu / window, 100 * wait / window
        except (OSError, AttributeError):
            return None
    try:
        cpu, wait, elapsed = map(float, open(os.path.join(out, f"{s}-{b}.usage")).read().split())
        return 100 * cpu / elapsed, 100 * wait / elapsed
    except (OSError, ValueError, ZeroDivisionError):
        return None

print("durability: pinq in-memory store | NATS JetStream file store | Redis AOF everysec")
print(f"{'scenario':<10} {'broker':<7} {'msgs/s':>9} {'MB/s':>7} {'sent':>9} {'missing':>7} "
      f"{'e2e p50':>9} {'e2e p99':>9} {'e2e p99.9':>9} {'pub p99':>9} {'ack p99':>9} {'cpu%':>5} {'wait%':>5}")
names = {"A": "A 100B", "B": "B 1KiB", "C": "C 10k/s"}
for s in [c for c in sys.argv[3] if c in "ABC"]:
    for b in ("pinq", "nats", "redis"):
        f = os.path.join(out, f"{s}-{b}.json")
        if not os.path.exists(f):
            print(f"{names[s]:<10} {b:<7} (no result)")
            continue
        j = json.load(open(f))
        e, p, a = j["e2e_us"], j["publish_ack_us"], j["ack_us"]
        ack = "n/a" if b == "nats" else f"{a['p99']}"
        u = usage(s, b)
        cpu, wait = (f"{u[0]:.0f}", f"{u[1]:.0f}") if u else ("?", "?")
        print(f"{names[s]:<10} {b:<7} {j['msgs_per_sec']:>9.0f} {j['mb_per_sec']:>7.2f} {j['sent']:>9} "
              f"{j['missing']:>7} {e['p50']:>9} {e['p99']:>9} {e['p999']:>9} {p['p99']:>9} {ack:>9} {cpu:>5} {wait:>5}")
print("latencies in microseconds; cpu% and wait%: the broker's CPU time and run-queue wait (runnable,")
print("not running: the machine was busy elsewhere) as % of one core, over pinq's measured window and")
print("over the whole run (warm-up, window, drain) for NATS and Redis")
PY
if [ -e "$out/L/lowrate.txt" ]; then
    { echo; echo "L: like beside like, fixed 10,000 msgs/s, 1 producer, 1 consumer, 100 B"; cat "$out/L/lowrate.txt"; } \
        | tee -a "$out/table.txt"
fi
echo "results in $out"
