#!/usr/bin/env python3
"""Instructions per message by step from callgrind_annotate's listings (perf/wirecost.sh).

Usage: wirecost-steps.py INCLUSIVE.txt SELF.txt MESSAGES (the estimate, used only when the
dump has no call count of `UnstampedValue::encode`)
"""
import re, sys
from collections import Counter
incl, selfp, msgs = sys.argv[1], sys.argv[2], float(sys.argv[3])
def by_function(path, merge):
    """Ir by function name over the files callgrind splits it into (inlined code): `merge` is
    `sum` for self cost; for inclusive cost the entries overlap (each counts the calls made from
    its part), so the largest entry is taken, a lower bound."""
    out, total = Counter(), 0
    for line in open(path, errors="replace"):
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
        if not m:
            continue
        n, rest = int(m.group(1).replace(",", "")), m.group(2)
        if "PROGRAM TOTALS" in rest:
            total = n
            continue
        rest = re.sub(r" \[[^]]*\]$", "", rest)
        rest = re.sub(r" \([\d,]+x\)$", "", rest)
        fn = rest.split(":", 1)[1] if ":" in rest else rest
        out[fn] = merge(out[fn], n)
    return out, total
inc, total = by_function(incl, max)
# Messages stored in the window: `UnstampedValue::encode` runs once per message (exact, unlike
# the bench's window, which valgrind's slowness shifts against callgrind's).
stored = re.findall(r"UnstampedValue::encode \(([\d,]+)x\)", open(incl, errors="replace").read())
if stored:
    msgs = float(max(int(n.replace(",", "")) for n in stored))
print(f"messages in the window: {msgs:,.0f}")
own, _ = by_function(selfp, lambda a, b: a + b)
print(f"total Ir per message: {total / msgs:,.0f}")
# pinq's entry points that survive inlining; capnp-rpc's message loop (`handle_message`), the
# deliver path (`DeliverStream::forward`/`returned`) and capnp-futures' writer are inlined into
# futures combinators and cannot be told apart by name: they are in the rest.
steps = [
    ("publish call (decode, admit, store, reply)", r"BrokerImpl as pinq::rpc::pinq_capnp::broker::Server>::publish::\{\{closure\}\}$"),
    ("  of it: shard store (Shard::handle)", r"^pinq::server::shard::Shard::handle::\{\{closure\}\}$"),
    ("dispatch (Shard::dispatch_loop: to the sinks)", r"^pinq::server::shard::Shard::dispatch_loop::\{\{closure\}\}$"),
    ("ack call (SubscriptionImpl::ack)", r"SubscriptionImpl as pinq::rpc::pinq_capnp::subscription::Server>::ack::\{\{closure\}\}$"),
    ("deleter loop (ACKed keys deleted)", r"^pinq::server::shard::Shard::deleter_loop::\{\{closure\}\}$"),
    ("metrics loop (per second, not per message)", r"^pinq::server::shard::Shard::metrics_loop::\{\{closure\}\}$"),
    ("glommio park (sleep: membarrier, io_uring_enter)", r"^glommio::parking::Parker::park$"),
]
named = 0
for name, pat in steps:
    best = max((n for f, n in inc.items() if re.search(pat, f)), default=0)
    if not name.startswith("  "):
        named += best
    print(f"  {name:52s} {best / msgs:>10,.0f}")
print(f"  {'rest (capnp-rpc loop, deliver calls, executor)':52s} {(total - named) / msgs:>10,.0f}")
alloc = sum(n for f, n in own.items() if re.search(r"^(malloc|free|realloc|calloc|_int_malloc|_int_free|_int_realloc|cfree|malloc_consolidate|unlink_chunk.*|tcache.*)$", f))
print(f"  {'malloc/free family (self)':52s} {alloc / msgs:>10,.0f}")
calls = {}
print("== top 20 functions by self Ir per message")
# A zeroed dump charges the threads' entry frames with everything: leave them out.
try:
  for f, n in [(f, n) for f, n in own.most_common(40) if n < 0.99 * total][:20]:
    print(f"  {n / msgs:>9,.0f}  {f[:150]}")
except BrokenPipeError:
    pass
