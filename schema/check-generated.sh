#!/bin/sh
# Fails (exit 1) when the committed Rust code of a schema (src/rpc/pinq_capnp.rs from
# schema/pinq.capnp, src/rpc/replication_capnp.rs from schema/replication.capnp) is not what the
# schema generates. Needs the `capnp` program (Debian: apt-get install capnproto).
#
# build.rs does the generating: with PINQ_CAPNP_CHECK_DIR set it writes the fresh code there and
# leaves src/ alone. Without it, build.rs refreshes the files in src/rpc/ in place, so a stale
# copy may already have been rewritten by an earlier build: the check therefore also fails when a
# file differs from what git has staged or committed.
set -eu
cd "$(dirname "$0")/.."

if ! command -v capnp >/dev/null 2>&1; then
    echo "check-generated: the capnp program is not installed (apt-get install capnproto)" >&2
    exit 2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM
PINQ_CAPNP_CHECK_DIR="$tmp" cargo check --lib --quiet

for generated in src/rpc/pinq_capnp.rs src/rpc/replication_capnp.rs; do
    name=$(basename "$generated")
    if [ ! -f "$tmp/$name" ]; then
        echo "check-generated: build.rs did not regenerate $generated" >&2
        exit 1
    fi
    # The tool's version line may differ between machines without the code differing.
    if ! diff -u -I '^// capnp binary version:' "$generated" "$tmp/$name"; then
        echo "check-generated: $generated is stale: build pinq with capnp installed and commit it" >&2
        exit 1
    fi
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1 \
        && ! git diff --quiet -- "$generated"; then
        echo "check-generated: $generated was regenerated but the change is not committed" >&2
        exit 1
    fi
    echo "check-generated: $generated is up to date"
done
