#!/usr/bin/env bash
# Prints a description of this machine for a results directory: CPU model and count, kernel,
# memory, load, and the pinq commit. Sourced by the other perf scripts; also runnable alone.
set -uo pipefail
echo "date:     $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "host:     $(hostname)"
echo "nproc:    $(nproc)"
echo "cpu:      $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "kernel:   $(uname -srm)"
echo "memory:   $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
echo "load:     $(cut -d' ' -f1-3 /proc/loadavg) (1, 5, 15 min, before the run)"
echo "commit:   $(git -C "$(dirname "$0")/.." rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$(dirname "$0")/.." diff --quiet 2>/dev/null || echo ' (dirty)')"
