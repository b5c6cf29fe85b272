"""Subscriptions: the `Consumer` the broker delivers to, the bounded queue it fills, async
iteration over deliveries, and `ack`/`nack`/`touch` (optionally grouped).

Back-pressure is the protocol's: `Consumer.deliver` does not return until its whole batch fits
in the subscription's local queue (bounded by `queue_size`), so a consumer that stops reading
stops the broker from sending to it; the broker then gives the group's messages to others.

A subscription lives on one connection to the leader of its topic's shard (an *attachment*).
When that ends while the connection is up (the broker released the `Consumer`: its shard
changed leader) or the connection drops, a subscription that follows (the default) subscribes
again through the client, which finds the shard's leader; deliveries the old attachment still
had queued are dropped, since their copies are redelivered (at-least-once). A delivery must be
settled on the attachment it came from: after a failover its `ack` is refused with
`subscriptionClosed` or fails with `ConnectionLost`, and the copy comes again.
"""

from __future__ import annotations

import asyncio
import weakref

from ._schema import ACK_LEVELS, schema
from .errors import ConnectionLost, PinqError, SubscriptionEnded, refusal_from_reply

# Local queue length when the broker's default is asked for (`queue_size` 0); the broker's
# default `delivery.consumerQueueSize`.
LOCAL_QUEUE_LEN_DEFAULT = 1024
# Upper bound of the local queue, whatever the caller asks for.
LOCAL_QUEUE_LEN_MAX = 1 << 20
# Most tags one grouped ACK carries (the Rust client's ACK_GROUP_TAGS_MAX).
ACK_GROUP_TAGS_MAX = 4096


def _check_level(level: str) -> str:
    if level not in ACK_LEVELS:
        raise ValueError(f"ack level {level!r} is not one of {', '.join(ACK_LEVELS)}")
    return level


def _delay_ms(seconds) -> int:
    """Seconds (int, float or timedelta) as whole milliseconds; negative is refused."""
    if hasattr(seconds, "total_seconds"):
        seconds = seconds.total_seconds()
    ms = round(float(seconds) * 1000)
    if ms < 0:
        raise ValueError(f"a delay cannot be negative ({seconds!r} s)")
    return ms


class Delivery:
    """One message delivered to this consumer. Settle it with `ack`, `nack`, or keep it longer
    with `touch`; otherwise the broker redelivers it after `delivery.inFlightTimeout`.

    `payload` and `tag` are bytes, `attempt` counts deliveries to this recipient (1 first),
    `headers` is a list of (key: str, value: bytes) in published order (keys may repeat),
    `enqueued_at_ms` the broker's clock when it was accepted, `delay_ms` its publish delay."""

    # Slots: a consumer makes one per message, and this is its hot path.
    __slots__ = ("topic", "payload", "tag", "attempt", "headers", "enqueued_at_ms", "delay_ms",
                 "_attachment")

    def __init__(self, reader, attachment: "_Attachment"):
        self.topic = reader.topic
        self.payload = reader.payload
        self.tag = reader.tag
        self.attempt = reader.attempt
        headers = reader.headers
        self.headers = [(h.key, h.value) for h in headers] if len(headers) else []
        self.enqueued_at_ms = reader.enqueuedAtMs
        self.delay_ms = reader.delayMs
        self._attachment = attachment

    def __repr__(self) -> str:
        return (f"Delivery(topic={self.topic!r}, payload={self.payload[:32]!r}, "
                f"attempt={self.attempt}, tag={self.tag.hex()})")

    async def ack(self, level: str = "durable") -> str:
        """Acknowledges this copy; returns the broker's `TagResult` name ("ok", or
        "unknownTag" when its lease ran out and it went back for redelivery, ...)."""
        return (await self._attachment.ack([self.tag], level))[0]

    async def nack(self, delay: float = 0, level: str = "durable") -> str:
        """Hands this copy back for redelivery after `delay` seconds (0: at once, or the
        group's backoff). Returns the `TagResult` name."""
        return (await self._attachment.settle("nack", [self.tag], _delay_ms(delay), level))[0]

    async def touch(self) -> str:
        """Extends this copy's lease: its in-flight timeout starts again now."""
        return (await self._attachment.settle("touch", [self.tag], 0, "durable"))[0]


class _Consumer(schema.Consumer.Server):
    """The `Consumer` capability of one attachment. It holds the attachment weakly: when the
    broker (or the connection) releases this object, the attachment learns it has ended."""

    def __init__(self, attachment: "_Attachment"):
        self._attachment = weakref.ref(attachment)

    async def deliver(self, deliveries, **kwargs):
        attachment = self._attachment()
        if attachment is None or attachment.ended.is_set():
            raise ConnectionLost("the subscription was closed by the consumer")
        queue = attachment.queue
        # Not returning until the whole batch is queued is the flow control (see module doc).
        for d in deliveries:
            if queue.full():
                await queue.put(attachment.delivery(d))
            else:
                queue.put_nowait(attachment.delivery(d))


class _AckGroup:
    """ACKs of one attachment given within `window` seconds, sent as one call per ack level
    (or as soon as `max_tags` tags or callers wait). Each caller gets its own results."""

    def __init__(self, attachment: "_Attachment", window: float, max_tags: int):
        self._attachment = attachment
        self._window = window
        self._max_tags = min(max_tags or ACK_GROUP_TAGS_MAX, ACK_GROUP_TAGS_MAX)
        # level -> (tags, [(start, len, future)], timer handle)
        self._open: dict[str, tuple[list, list, asyncio.TimerHandle | None]] = {}

    async def ack(self, tags: list, level: str) -> list:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        group_tags, waiters, timer = self._open.get(level, ([], [], None))
        waiters.append((len(group_tags), len(tags), future))
        group_tags.extend(tags)
        if timer is None:
            timer = loop.call_later(self._window, self.flush, level)
        self._open[level] = (group_tags, waiters, timer)
        if len(group_tags) >= self._max_tags or len(waiters) >= self._max_tags:
            self.flush(level)
        return await future

    def flush(self, level: str | None = None) -> None:
        """Sends the open group of `level` (every level when None) now."""
        for lvl in [level] if level is not None else list(self._open):
            group = self._open.pop(lvl, None)
            if group is None:
                continue
            tags, waiters, timer = group
            if timer is not None:
                timer.cancel()
            asyncio.ensure_future(self._send(tags, waiters, lvl))

    async def _send(self, tags, waiters, level):
        try:
            results = await self._attachment.settle("ack", tags, 0, level)
        except PinqError as e:
            for _, _, future in waiters:
                if not future.done():
                    future.set_exception(_share(e))
            return
        for start, count, future in waiters:
            if not future.done():
                future.set_result(results[start : start + count])


def _share(error: PinqError) -> PinqError:
    """A group's failure as each caller sees it; a refusal's index is not the caller's own."""
    if getattr(error, "index", None) is not None:
        return type(error)(error.code, None, error.message, error.retryable)
    return error


class _Attachment:
    """One `subscribe` on one connection: its `Subscription` capability, its `Consumer`, and
    whether it has ended. Deliveries keep it so they are settled where they came from."""

    def __init__(self, conn, queue: asyncio.Queue, topic: str):
        self.conn = conn
        self.queue = queue
        self.topic = topic
        self.ended = asyncio.Event()
        self.capability = None
        self.consumer_id = b""
        self.queue_size = 0
        self.max_unacked = 0
        self.grouper: _AckGroup | None = None

    def delivery(self, d) -> Delivery:
        return Delivery(d, self)

    def consumer(self) -> _Consumer:
        """A new `Consumer` for this attachment; its release ends the attachment."""
        consumer = _Consumer(self)
        loop = asyncio.get_running_loop()
        ended = self.ended
        weakref.finalize(consumer, loop.call_soon_threadsafe, ended.set)
        return consumer

    async def ack(self, tags: list, level: str) -> list:
        _check_level(level)
        if self.grouper is not None:
            return await self.grouper.ack(list(tags), level)
        return await self.settle("ack", tags, 0, level)

    async def settle(self, method: str, tags: list, delay_ms: int, level: str) -> list:
        """One `ack`, `nack` or `touch` call: one `TagResult` name per tag, or `Refused`."""
        request = getattr(self.capability, f"{method}_request")()
        tag_list = request.init("tags", len(tags))
        for i, tag in enumerate(tags):
            tag_list[i] = bytes(tag)
        if method == "nack":
            request.delayMs = delay_ms
        if method in ("ack", "nack"):
            request.level = _check_level(level)
        reply = await self.conn.call(request.send(), self.conn_timeout)
        refused = refusal_from_reply(reply.refusal)
        if refused is not None:
            raise refused
        results = [str(r) for r in reply.results]
        if len(results) != len(tags):
            raise ConnectionLost(f"{method} answered {len(results)} results for {len(tags)} tags")
        return results

    conn_timeout = 30.0


class Subscription:
    """A consumer of one topic, as a group member (`group` non-empty) or a universal consumer.

    `async for delivery in sub` yields `Delivery` objects until `close()`. Made by
    `Client.subscribe`; see the module doc for failover.
    """

    def __init__(self, client, topic, group, queue_size, ack_window, ack_max_tags, follow):
        self._client = client
        self.topic = topic
        self.group = group
        self._queue_size_asked = queue_size
        local_len = LOCAL_QUEUE_LEN_DEFAULT if queue_size == 0 else queue_size
        self._queue_len = min(local_len, LOCAL_QUEUE_LEN_MAX)
        self._ack_window = ack_window
        self._ack_max_tags = ack_max_tags
        self._follow = follow
        self._current: _Attachment | None = None
        self._closed = False

    @property
    def queue_size(self) -> int:
        """The `queueSize` in force, as the broker answered."""
        return self._current.queue_size if self._current else 0

    @property
    def max_unacked(self) -> int:
        """The unacknowledged copies the broker lets this consumer hold."""
        return self._current.max_unacked if self._current else 0

    @property
    def consumer_id(self) -> bytes:
        """The consumer's 16-byte UUID, as the broker assigned it (changes on failover)."""
        return self._current.consumer_id if self._current else b""

    async def _attach(self) -> None:
        """Subscribes on the leader of the topic's shard (through the client's routing)."""
        attachment = await self._client._subscribe_once(self)
        if self._ack_window > 0:
            attachment.grouper = _AckGroup(attachment, self._ack_window, self._ack_max_tags)
        self._current = attachment

    def _attachment_for(self, conn, topic) -> _Attachment:
        attachment = _Attachment(conn, asyncio.Queue(self._queue_len), topic)
        attachment.conn_timeout = self._client._request_timeout
        return attachment

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delivery:
        while True:
            if self._closed:
                raise StopAsyncIteration
            current = self._current
            delivery = await self._next_of(current)
            if delivery is not None:
                return delivery
            if self._closed:
                raise StopAsyncIteration
            if not self._follow:
                raise await self._why_ended(current)
            await self._attach()

    async def _next_of(self, current: _Attachment) -> Delivery | None:
        """The next delivery of `current`, or None once it has ended (queued deliveries of an
        ended attachment are dropped: the broker redelivers their copies)."""
        if not current.queue.empty() and not current.ended.is_set():
            if not current.conn.lost.is_set():
                return current.queue.get_nowait()
        get = asyncio.ensure_future(current.queue.get())
        ended = asyncio.ensure_future(current.ended.wait())
        lost = asyncio.ensure_future(current.conn.lost.wait())
        try:
            await asyncio.wait({get, ended, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            lost.cancel()
            get.cancel()  # a no-op when done; a cancelled get takes nothing off the queue
        if current.ended.is_set() or current.conn.lost.is_set():
            current.ended.set()
            return None
        return get.result()

    async def _why_ended(self, current: _Attachment) -> PinqError:
        if current.conn.lost.is_set():
            return ConnectionLost(f"the connection of the subscription to {self.topic} dropped")
        return SubscriptionEnded(
            f"the broker ended the subscription to {self.topic} (leader change or shutdown)"
        )

    async def recv(self, timeout: float | None = None) -> Delivery:
        """The next delivery, waiting at most `timeout` seconds (asyncio.TimeoutError). Raises
        `StopAsyncIteration` once the subscription is closed."""
        current = self._current
        if timeout is None or (current is not None and not current.queue.empty()):
            return await self.__anext__()
        return await asyncio.wait_for(self.__anext__(), timeout)

    async def recv_batch(self, max_count: int, timeout: float | None = None) -> list:
        """Waits for one delivery (at most `timeout` seconds), then takes whatever else is
        queued already, up to `max_count` in all: the way to settle many with one `ack`."""
        batch = [await self.recv(timeout)]
        current = self._current
        while len(batch) < max_count and not current.queue.empty():
            if current.ended.is_set() or current.conn.lost.is_set():
                break
            batch.append(current.queue.get_nowait())
        return batch

    async def ack(self, tags, level: str = "durable") -> list:
        """Acknowledges delivered copies by tag, in one call (or the open ACK group)."""
        return await self._current.ack(list(tags), level)

    async def nack(self, tags, delay: float = 0, level: str = "durable") -> list:
        """Hands delivered copies back for redelivery after `delay` seconds."""
        return await self._current.settle("nack", list(tags), _delay_ms(delay), _check_level(level))

    async def touch(self, tags) -> list:
        """Extends the lease of delivered copies."""
        return await self._current.settle("touch", list(tags), 0, "durable")

    def flush_acks(self) -> None:
        """Sends the ACKs waiting in the open group now (no-op without ACK grouping)."""
        if self._current is not None and self._current.grouper is not None:
            self._current.grouper.flush()

    async def close(self) -> None:
        """Ends the subscription; the broker redelivers every copy not acknowledged. ACKs
        still waiting in a group are sent first."""
        if self._closed:
            return
        self._closed = True
        current = self._current
        if current is None:
            return
        if current.grouper is not None:
            current.grouper.flush()
            await asyncio.sleep(0)
        current.ended.set()
        if current.conn.lost.is_set():
            return
        try:
            await current.conn.call(current.capability.close(), self._client._request_timeout)
        except PinqError:
            pass  # the connection or the subscription is gone already: the same end

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
