#!/bin/sh
# Issue 22's "a 1 GiB snapshot sent and installed at >= 200 MB/s with peak RSS of either side
# <= 256 MiB above its steady state": a three-node cluster, one follower stopped while the
# shard fills with SIZE_MIB of live messages (16 KiB each, published durably in 1 MiB
# commands by `pinq publish`, never consumed), the leader's log compacted past the follower;
# then the follower starts again and catches up by snapshot. Printed: the leader's build time,
# the pull, the install, bytes/s of pull + install, and each side's RSS before the restart
# (steady state) and its peak while the snapshot moves (sampled every 50 ms from /proc).
#
# Placement: nodes 1 and 3 on CPU 0, node 2 on CPU 1 (one shard each); everything shares the
# machine's two cores and one disk.
#
# usage: perf/snapshot-1g.sh [size_mib]   (default 1024)
set -eu
cd "$(dirname "$0")/.."
SIZE_MIB=${1:-1024}
cargo build --release --quiet --bin pinq
BIN=${CARGO_TARGET_DIR:-target}/release/pinq
BASE=$(mktemp -d -p /var/tmp)
PEERS="1=127.0.0.1:18201,2=127.0.0.1:18202,3=127.0.0.1:18203"
cleanup() { for f in "$BASE"/*/pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true; done; [ -n "${KEEP:-}" ] || rm -rf "$BASE"; }
trap cleanup EXIT INT TERM
export PINQ_CLUSTER_LOG_RETAIN_ENTRIES=1 RUST_LOG=${RUST_LOG:-warn,pinq::cluster::driver=info}
start() { # id
    i=$1
    mkdir -p "$BASE/n$i"
    "$BIN" serve --cpus $(( (i + 1) % 2 )) --node-id "$i" --raft-listen "127.0.0.1:1820$i" \
        --peers "$PEERS" --listen "127.0.0.1:182${i}0" --metrics-listen "127.0.0.1:192${i}1" \
        --data-dir "$BASE/n$i/data" >> "$BASE/n$i/log" 2>&1 &
    echo $! > "$BASE/n$i/pid"
}
rss_kib() { v=$(awk '/VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null); echo "${v:-0}"; }
for i in 1 2 3; do start "$i"; done
sleep 3
LEADER=$("$BIN" cluster status --server 127.0.0.1:18210 --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["shards"][0]["leader"])')
FOLLOWER=$(( LEADER % 3 + 1 ))
kill -9 "$(cat "$BASE/n$FOLLOWER/pid")"
echo "leader node $LEADER, follower node $FOLLOWER stopped; publishing $SIZE_MIB MiB"
python3 -c "
import sys
line = 'x' * (16 * 1024 - 16)
sys.stdout.write(''.join('%06d-%s\n' % (i, line) for i in range(64)))
" > "$BASE/batch"
t0=$(date +%s.%N)
n=0
while [ "$n" -lt "$SIZE_MIB" ]; do
    "$BIN" publish --server "127.0.0.1:182${LEADER}0" --topic big --ack durable < "$BASE/batch" > /dev/null
    n=$((n + 1))
done
t1=$(date +%s.%N)
echo "published $SIZE_MIB MiB in $(echo "$t1 - $t0" | bc) s"
sleep 5
LPID=$(cat "$BASE/n$LEADER/pid")
LEADER_STEADY=$(rss_kib "$LPID")
start "$FOLLOWER"
FPID=$(cat "$BASE/n$FOLLOWER/pid")
sleep 0.3
FOLLOWER_START=$(rss_kib "$FPID")
LPEAK=0; FPEAK=0
deadline=$(( $(date +%s) + 600 ))
while ! grep -q "installed a snapshot" "$BASE/n$FOLLOWER/log"; do
    l=$(rss_kib "$LPID"); f=$(rss_kib "$FPID")
    [ "$l" -gt "$LPEAK" ] && LPEAK=$l
    [ "$f" -gt "$FPEAK" ] && FPEAK=$f
    [ "$(date +%s)" -lt "$deadline" ] || { echo "no install within 600 s"; tail -5 "$BASE/n$FOLLOWER/log"; exit 1; }
    sleep 0.05
done
sleep 2
FOLLOWER_AFTER=$(rss_kib "$FPID")
grep -h "snapshot built" "$BASE/n$LEADER/log" | tail -1 | sed 's/.*\(index=.*\)/leader: built \1/'
grep -h "pulling a snapshot\|snapshot pulled\|installed a snapshot" "$BASE/n$FOLLOWER/log" | cut -c1-230
ts() { grep -h "$1" "$2" | tail -1 | sed 's/^\[pinq\] //; s/^\([^ ]*\) .*/\1/' | xargs -I{} date -d {} +%s.%N; }
BYTES=$(grep -h "snapshot pulled" "$BASE/n$FOLLOWER/log" | tail -1 | sed 's/.* bytes=\([0-9]*\).*/\1/')
T_PULL=$(ts "pulling a snapshot" "$BASE/n$FOLLOWER/log")
T_DONE=$(ts "installed a snapshot" "$BASE/n$FOLLOWER/log")
SECS=$(echo "$T_DONE - $T_PULL" | bc)
echo "pull + install: $BYTES bytes in $SECS s = $(echo "$BYTES / $SECS / 1000000" | bc) MB/s"
echo "leader RSS: steady $((LEADER_STEADY / 1024)) MiB, peak $((LPEAK / 1024)) MiB (+$(( (LPEAK - LEADER_STEADY) / 1024 )) MiB)"
for i in 1 2 3; do curl -s "127.0.0.1:192${i}1/metrics" | grep "raft_messages_dropped" | grep -v " 0$" | sed "s/^/node $i: /"; done
echo "follower RSS: at start $((FOLLOWER_START / 1024)) MiB, peak $((FPEAK / 1024)) MiB (+$(( (FPEAK - FOLLOWER_START) / 1024 )) MiB), 2 s after the install $((FOLLOWER_AFTER / 1024)) MiB"
