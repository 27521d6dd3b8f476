"""A TCP fault proxy, for the fault campaign (`rollout chaos`): it sits between the
workers and Redis, and between the workers and the router, and breaks their connections
in the ways networks do.

It knows nothing of what it carries (RESP, HTTP): faults act on the chunks of bytes of
one connection, as they arrive. Set at runtime (`LinkFaults`):

* `latency_s`: every chunk, either way, waits this long before it is forwarded;
* `drop_reply_rate`: a chunk from the client is forwarded and the connection is cut as
  soon as the server answers: the request took effect, its reply is lost (a partition
  right after a write, a client's socket timeout). Retried requests must be idempotent;
* `reset_rate`: a chunk from the client is not forwarded; the connection is reset (RST).

`reset_all()` resets every open connection at once. A connection whose upstream cannot
be reached (Redis restarting) is reset.

The upstream is fixed, or found by `resolve()` (a callable returning host, port) for each
new connection: the campaign's Redis proxy asks Sentinel for the current primary, so
proxied workers follow a failover as a `redis+sentinel://` client does. Every
FOLLOW_S the proxy asks again and resets the connections still open to a server that is no
longer the answer (a Sentinel client drops a connection to a demoted primary on its
READONLY reply); those are counted as `rerouted`, not as `resets`. It lives in workers/ beside its only user, the
campaign; pipeline/ owns Redis state, which this does not touch.
"""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 16
#: How often a proxy with a resolver asks where its upstream is now.
FOLLOW_S = 0.5


@dataclass(frozen=True)
class LinkFaults:
    latency_s: float = 0.0
    drop_reply_rate: float = 0.0
    reset_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        for name in ("drop_reply_rate", "reset_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass
class ProxyStats:
    connections: int = 0
    resets: int = 0  # connections reset: by reset_rate, reset_all() or an unreachable upstream
    replies_dropped: int = 0
    chunks_delayed: int = 0
    rerouted: int = 0  # connections reset because their upstream is no longer the resolver's answer


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with RST rather than FIN (SO_LINGER 0): the peer sees 'connection reset'."""
    if writer is None or writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    address: tuple[str, int] | None = None  # the upstream it reached
    reply_doomed: bool = False  # a request went through under drop_reply: its reply will be cut

    def reset(self) -> None:
        _reset(self.client)
        _reset(self.upstream)


@dataclass(eq=False)
class FaultProxy:
    """One listening port forwarding to one upstream host:port."""

    name: str
    upstream_host: str
    upstream_port: int
    seed: int = 0
    faults: LinkFaults = field(default_factory=LinkFaults)  # replaced whole, from any thread
    stats: ProxyStats = field(default_factory=ProxyStats)
    port: int = 0  # the listening port, once started
    #: Where the upstream is now (host, port), asked for each new connection (on a thread:
    #: it may block); None: upstream_host:upstream_port.
    resolve: Callable[[], tuple[str, int]] | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(f"{self.seed}|{self.name}")
        self._open: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._follow: asyncio.Task | None = None

    async def _upstream(self) -> tuple[str, int]:
        if self.resolve is None:
            return self.upstream_host, self.upstream_port
        return await asyncio.get_running_loop().run_in_executor(None, self.resolve)

    async def _follow_upstream(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                current = await self._upstream()
            except Exception as exc:  # noqa: BLE001 - nobody answers now: ask again later
                log.debug("proxy %s: upstream unknown (%s)", self.name, exc)
                continue
            stale = [c for c in self._open if c.address is not None and c.address != current]
            for conn in stale:
                conn.reset()
            self.stats.rerouted += len(stale)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.resolve is not None:
            self._follow = asyncio.create_task(self._follow_upstream())

    async def close(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
        if self._server is not None:
            self._server.close()
        self.reset_all()

    def reset_all(self) -> int:
        """Reset every open connection; returns how many."""
        conns = list(self._open)
        for conn in conns:
            conn.reset()
        self.stats.resets += len(conns)
        return len(conns)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(writer)
        self.stats.connections += 1
        self._open.add(conn)
        try:
            try:
                conn.address = await self._upstream()
                up_reader, conn.upstream = await asyncio.open_connection(*conn.address)
            except Exception as exc:  # noqa: BLE001 - unreachable, or the resolver has no answer
                log.debug("proxy %s: upstream %s unreachable (%s)", self.name, conn.address, exc)
                self.stats.resets += 1
                conn.reset()
                return
            await asyncio.gather(self._pump(conn, reader, conn.upstream, from_client=True),
                                 self._pump(conn, up_reader, writer, from_client=False))
        finally:
            self._open.discard(conn)

    async def _pump(self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    from_client: bool) -> None:
        """Forward one direction until its end (then close the other side gracefully, as
        the peer did) or a fault (then reset both)."""
        try:
            while data := await reader.read(CHUNK_BYTES):
                faults = self.faults
                if faults.latency_s:
                    self.stats.chunks_delayed += 1
                    await asyncio.sleep(faults.latency_s)
                if from_client and faults.reset_rate and self._rng.random() < faults.reset_rate:
                    self.stats.resets += 1
                    conn.reset()
                    return
                if from_client and faults.drop_reply_rate and self._rng.random() < faults.drop_reply_rate:
                    conn.reply_doomed = True
                elif not from_client and conn.reply_doomed:
                    self.stats.replies_dropped += 1
                    conn.reset()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            conn.reset()
            return
        writer.close()


class ProxyThread:
    """An event loop in a daemon thread hosting fault proxies, for synchronous callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self.proxies: list[FaultProxy] = []

    def _run(self, coro: Coroutine) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=10)

    def start(self, name: str, upstream_host: str = "", upstream_port: int = 0, seed: int = 0,
              resolve: Callable[[], tuple[str, int]] | None = None) -> FaultProxy:
        proxy = FaultProxy(name, upstream_host, upstream_port, seed, resolve=resolve)
        self._run(proxy.start())
        self.proxies.append(proxy)
        return proxy

    def reset_all(self, proxy: FaultProxy) -> int:
        async def reset() -> int:
            return proxy.reset_all()

        return self._run(reset())

    def close(self) -> None:
        for proxy in self.proxies:
            self._run(proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
