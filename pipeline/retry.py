"""Riding out Redis restarts and failovers instead of exiting.

Every long-running process (worker, trainer consumer) runs its Redis calls through a
`Reconnect`: on a connection error it waits with capped exponential backoff and tries
again, logging one line when Redis goes away and one when it is back. Retrying is safe
because every script is idempotent for its caller: a retried claim carries the same
claim id, a retried publish finds its own earlier publish, a retried commit finds the
entries committed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from typing import Any, Callable, TypeVar

import redis

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Server replies that mean "not now" rather than "no": a restart loading its AOF, a
#: failover in progress, a replica promoted, memory full (maxmemory with noeviction:
#: writes are refused until the trainer commits or an operator makes room; a worker
#: holds what it finished and retries the publish, every max_s at most, never
#: dead-letters it for this).
_TRANSIENT_REPLIES = ("LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "READONLY", "OOM")


#: How a script's write refused for memory reads. Redis refuses a script's write only
#: while the script has written nothing yet, so such a script changed nothing: retry it.
_SCRIPT_OOM = "-OOM command not allowed"


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, redis.exceptions.OutOfMemoryError)):
        return True
    return isinstance(exc, redis.ResponseError) and (str(exc).startswith(_TRANSIENT_REPLIES)
                                                     or _SCRIPT_OOM in str(exc))


class RedisUnavailable(ConnectionError):
    """Redis stayed unreachable past the caller's deadline."""


#: The longest wait between two tries of a call through an outage.
DEFAULT_RETRY_MAX_S = 5.0


class Reconnect:
    """Retries Redis calls through outages; records them for status."""

    def __init__(self, what: str, first_s: float = 0.05, max_s: float = DEFAULT_RETRY_MAX_S):
        self.what = what  # who is waiting, for the log lines: "worker w1", "trainer session t.3"
        self.first_s = first_s
        self.max_s = max_s
        self.down_since: float | None = None  # monotonic time of the first failure of this outage
        self.last_error = ""
        self.outages = 0
        self.last_outage_s = 0.0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def _failed(self, exc: BaseException, delay: float, deadline: float | None) -> float:
        """Record a failure; how long to wait before the next try. Raises what is not a
        connection problem, and RedisUnavailable once the deadline would pass."""
        if not is_transient(exc):
            raise exc
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages += 1
            log.error("%s: Redis unreachable (%s: %s); retrying with backoff up to %gs", self.what,
                      type(exc).__name__, exc, self.max_s)
        self.last_error = f"{type(exc).__name__}: {exc}"
        if deadline is not None and time.monotonic() + delay > deadline:
            raise RedisUnavailable(f"{self.what}: Redis unreachable for "
                                   f"{time.monotonic() - self.down_since:.1f}s: {self.last_error}") from exc
        return delay

    def _succeeded(self) -> None:
        if self.down_since is not None:
            self.last_outage_s = time.monotonic() - self.down_since
            log.warning("%s: Redis is back after %.1fs", self.what, self.last_outage_s)
            self.down_since = None

    def call(self, fn: Callable[..., T], *args: Any, deadline: float | None = None, **kwargs: Any) -> T:
        """fn(*args, **kwargs), retried through connection errors until `deadline`
        (time.monotonic(); None: forever). Raises RedisUnavailable after it. The first
        failure is always retried once, whatever the deadline: a call is often the
        middle of an operation (a settle while screening a batch), and one lost reply
        must not leave it half done when a retry would finish it."""
        delay = self.first_s
        retried = False
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                time.sleep(self._failed(exc, delay, deadline if retried else None))
                delay, retried = min(self.max_s, delay * 2), True
                continue
            self._succeeded()
            return result

    async def acall(self, executor: Executor, fn: Callable[..., T], *args: Any,
                    deadline: float | None = None) -> T:
        """The same from asyncio: each attempt runs on `executor` (Redis calls get a pool
        of their own, so slow rewards can never delay a heartbeat)."""
        loop = asyncio.get_running_loop()
        delay = self.first_s
        retried = False
        while True:
            try:
                result = await loop.run_in_executor(executor, lambda: fn(*args))
            except Exception as exc:
                await asyncio.sleep(self._failed(exc, delay, deadline if retried else None))
                delay, retried = min(self.max_s, delay * 2), True
                continue
            self._succeeded()
            return result
