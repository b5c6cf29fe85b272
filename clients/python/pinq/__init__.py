"""pinq: the official Python client of the pinq message broker (asyncio, pycapnp).

    import asyncio, pinq

    async def main():
        async with await pinq.connect("127.0.0.1:7400") as client:
            tags = await client.publish("jobs", [b"one", b"two"])
            sub = await client.subscribe("jobs", group="workers")
            async for d in sub:
                print(d.payload, d.attempt)
                await d.ack()

    asyncio.run(main())

See README.md beside this package for the whole contract.
"""

from ._schema import PROTOCOL_VERSION, TAG_BYTES
from .client import (
    Client,
    ClusterStatus,
    GroupPolicy,
    GroupStats,
    Message,
    ShardInfo,
    ShardStats,
    Stats,
    TopicStats,
    connect,
    topic_shard,
)
from .errors import (
    BadReply,
    CallFailed,
    ConnectionLost,
    NotLeader,
    PinqError,
    Refused,
    SubscriptionEnded,
    VersionMismatch,
)
from .subscription import Delivery, Subscription

__all__ = [
    "BadReply",
    "CallFailed",
    "Client",
    "ClusterStatus",
    "ConnectionLost",
    "Delivery",
    "GroupPolicy",
    "GroupStats",
    "Message",
    "NotLeader",
    "PROTOCOL_VERSION",
    "PinqError",
    "Refused",
    "ShardInfo",
    "ShardStats",
    "Stats",
    "Subscription",
    "SubscriptionEnded",
    "TAG_BYTES",
    "TopicStats",
    "VersionMismatch",
    "connect",
    "topic_shard",
]
