"""The KJ event loop pycapnp needs beside asyncio's, started on demand.

pycapnp runs Cap'n Proto's own event loop inside the asyncio loop, opened with
`capnp.kj_loop()` (or `capnp.run(coro)`). An application that already opened one keeps it and
the client uses it; otherwise the first client on an asyncio loop opens it and the last one
closed on that loop closes it, so `asyncio.run(main())` is all an application needs.
"""

from __future__ import annotations

import asyncio
import weakref

import capnp


class _Owned:
    """A KJ loop this module opened on one asyncio loop, and how many clients use it."""

    def __init__(self, manager):
        self.manager = manager
        self.users = 0


_owned: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Owned]" = (
    weakref.WeakKeyDictionary()
)


async def acquire() -> None:
    """Makes sure a KJ loop runs on the current asyncio loop, for one more client."""
    loop = asyncio.get_running_loop()
    owned = _owned.get(loop)
    if owned is None:
        if getattr(loop, "_kj_loop", None) is not None:
            return  # the application runs its own (capnp.run / capnp.kj_loop)
        owned = _Owned(capnp.kj_loop())
        await owned.manager.__aenter__()
        _owned[loop] = owned
    owned.users += 1


async def release() -> None:
    """One client fewer; closes the KJ loop this module opened once none is left."""
    loop = asyncio.get_running_loop()
    owned = _owned.get(loop)
    if owned is None:
        return
    owned.users -= 1
    if owned.users <= 0:
        del _owned[loop]
        await owned.manager.__aexit__(None, None, None)
