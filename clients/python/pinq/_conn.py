"""One connection to one broker address: TCP (or TLS), the two-party RPC session, `hello`.

A `Connection` knows nothing of shards or leaders: `client.Client` decides where a request
goes and keeps one connection per address it talks to. Each connection watches its transport
and sets `lost` the moment it drops, which ends the subscriptions made on it.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

import capnp

from ._schema import PROTOCOL_VERSION, schema
from .errors import ConnectionLost, PinqError, VersionMismatch, from_kj

ANY_SHARD = int(schema.anyShard)


@dataclass(frozen=True)
class Security:
    """TLS and token settings shared by every connection of a client."""

    context: ssl.SSLContext | None
    # The name the broker's certificate is checked against; None: the host of each address.
    server_name: str | None
    token: bytes

    @staticmethod
    def of(tls, token, server_name) -> "Security":
        return Security(_tls_context(tls), server_name, _token_bytes(token))


def _tls_context(tls) -> ssl.SSLContext | None:
    """`tls` as an SSL context: None (plain TCP), True (the system's CAs), a CA file path, or an
    `ssl.SSLContext` made by the application (client certificates, pinned CAs)."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return ssl.create_default_context()
    if isinstance(tls, ssl.SSLContext):
        return tls
    if isinstance(tls, (str, bytes)) or hasattr(tls, "__fspath__"):
        return ssl.create_default_context(cafile=tls)
    raise TypeError(f"tls must be None, True, a CA file path or an ssl.SSLContext, not {tls!r}")


def _token_bytes(token) -> bytes:
    if token is None:
        return b""
    if isinstance(token, str):
        return token.strip().encode()
    if isinstance(token, (bytes, bytearray)):
        return bytes(token).strip()
    raise TypeError(f"token must be str or bytes, not {type(token).__name__}")


def split_address(addr: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) as (host, port); a clear ValueError otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"broker address {addr!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Connection:
    """An open, greeted connection to one address. Use `Connection.open`."""

    def __init__(self, addr, rpc, broker, hello, server_name):
        self.addr = addr
        self.broker = broker
        self.shard_count = max(1, int(hello.shardCount))
        # The shard whose own port this is; None on the shared client port.
        self.shard_id = None if hello.shardId == ANY_SHARD else int(hello.shardId)
        self.server_name = server_name
        self.lost = asyncio.Event()
        self._rpc = rpc
        self._watch = asyncio.ensure_future(self._watch_disconnect())

    @staticmethod
    async def open(addr: str, security: Security, timeout: float, server_name=None):
        """Connects to `addr`, says `hello` with the token, and checks the protocol version.
        `server_name` overrides the name the certificate is checked against (a shard port
        reached by IP is checked against its node's name)."""
        host, port = split_address(addr)
        name = server_name or security.server_name or host
        tls = {}
        if security.context is not None:
            tls = {"ssl": security.context, "server_hostname": name}
        try:
            stream = await asyncio.wait_for(
                capnp.AsyncIoStream.create_connection(host=host, port=port, **tls), timeout
            )
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            raise ConnectionLost(f"could not connect to the broker at {addr}: {e!r}") from e
        rpc = capnp.TwoPartyClient(stream)
        broker = rpc.bootstrap().cast_as(schema.Broker)
        try:
            hello = await asyncio.wait_for(
                broker.hello(PROTOCOL_VERSION, security.token), timeout
            )
        except asyncio.TimeoutError as e:
            rpc.close()
            raise ConnectionLost(f"{addr} did not answer hello within {timeout} s") from e
        except Exception as e:  # noqa: BLE001 - every failure of hello is mapped and re-raised
            rpc.close()
            raise from_kj(e) from e
        if hello.serverVersion != PROTOCOL_VERSION:
            rpc.close()
            raise VersionMismatch(
                f"the broker at {addr} speaks protocol {hello.serverVersion}, "
                f"this client {PROTOCOL_VERSION}"
            )
        return Connection(addr, rpc, broker, hello, name)

    async def _watch_disconnect(self):
        try:
            await self._rpc.on_disconnect()
        except Exception:  # noqa: BLE001 - any end of the session is a disconnect
            pass
        self.lost.set()

    async def call(self, awaitable, timeout: float):
        """Awaits one RPC reply for at most `timeout` seconds, mapping failures onto
        `PinqError`s (a node that does not answer in time is `ConnectionLost`)."""
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError as e:
            raise ConnectionLost(f"no answer from {self.addr} within {timeout} s") from e
        except PinqError:
            raise
        except capnp.KjException as e:
            raise from_kj(e) from e

    def close(self) -> None:
        """Closes the connection at once; the broker redelivers what its consumers held."""
        self.lost.set()
        self._watch.cancel()
        try:
            self._rpc.close()
        except Exception:  # noqa: BLE001 - closing twice, or after the loop ended, is harmless
            pass
