"""Riding out Redis restarts and failovers instead of exiting.

Every long-running process (worker, trainer consumer) runs its Redis calls through a
`Reconnect`: on a transient error (`is_transient`: the connection, a restart loading,
a failover's READONLY / MASTERDOWN / CLUSTERDOWN, a long script's BUSY) it waits with
capped exponential backoff and tries again, logging one line when Redis goes away and one when it is back. Retrying is safe
because every script is idempotent for its caller: a retried claim carries the same
claim id, a retried publish finds its own earlier publish, a retried commit finds the
entries committed.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import redis

from .server_checks import UnsafeServer

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What redis-py raises for "not now" rather than "no": the connection went away or timed
#: out, a restart loads its data (BusyLoadingError is a ConnectionError), a failover is
#: under way or left this client on a demoted primary (READONLY), a cluster slot moves
#: (TRYAGAIN) or its shard has no primary (CLUSTERDOWN, MASTERDOWN). redis-py strips the
#: code from these replies' text, so they are recognised by class, never by text. Memory
#: full (maxmemory with noeviction, OutOfMemoryError) too: writes are refused until the
#: trainer commits or an operator makes room; a worker holds what it finished and retries
#: the publish, never dead-letters it for this. A reconnect that reached a server a writer
#: must not use (UnsafeServer: it may evict keys, or it is a replica) waits until it is fixed.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,  # MasterDownError is one
    redis.exceptions.OutOfMemoryError, UnsafeServer,
)
#: Wrong credentials are ConnectionErrors to redis-py, but waiting never fixes them.
PERMANENT_ERRORS: tuple[type[Exception], ...] = (redis.exceptions.AuthenticationError,
                                                  redis.exceptions.AuthorizationError)
#: Transient replies redis-py has no class for, so they keep their code: BUSY (a script
#: or module command past busy-reply-threshold; it ends), NOREPLICAS (min-replicas-to-write
#: while replicas reconnect), UNBLOCKED (a blocked read cut short when the primary was
#: demoted). Redis 6 also wraps a script's failed call as "ERR Error running script ...
#: -READONLY ...", and redis-py a pipeline's as "Command # 1 (...) of pipeline caused
#: error: BUSY ...": the codes are matched there too (a script's write refused for memory,
#: "-OOM command not allowed", comes only before the script wrote anything: it changed
#: nothing, and is retried like the rest).
_TRANSIENT_CODES = re.compile(r"(?:^|: -|caused error: )(?:BUSY|NOREPLICAS|UNBLOCKED|READONLY|TRYAGAIN|CLUSTERDOWN|MASTERDOWN|"
                              r"LOADING|OOM)\b")


def is_transient(exc: BaseException) -> bool:
    """Whether waiting and trying again can succeed (the docstring above each tuple says why)."""
    if isinstance(exc, PERMANENT_ERRORS):
        return False
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    return isinstance(exc, redis.ResponseError) and bool(_TRANSIENT_CODES.search(str(exc)))


#: How long a trainer-side call (Consumer, slime adapter, Controller) waits out one Redis
#: outage before it raises RedisUnavailable: past a Sentinel failover (down-after 30 s by
#: default, then the election) and the load of a large AOF, short enough that a trainer
#: whose Redis is gone for good says so. Workers and the feeder wait forever.
TRAINER_OUTAGE_LIMIT_S = 300.0


class NotReplicated(redis.exceptions.ConnectionError):
    """A write reached fewer replicas than the caller asked for (WAIT): retried like an
    outage, since a replica catching up or reconnecting is one."""


@dataclass(frozen=True)
class Durability:
    """How many replicas must have a write before it counts as done (WAIT): a failover to
    one of them cannot forget it. WAIT counts the writes of the connection it runs on, so
    it goes in the same pipeline as a write of the caller's. 0: the primary's word is enough."""
    replicas: int = 0
    timeout_s: float = 5.0

    def queue_wait(self, pipe: redis.client.Pipeline) -> None:
        pipe.wait(self.replicas, int(self.timeout_s * 1000))

    def check(self, acked: int, what: str) -> None:
        if acked < self.replicas:
            raise NotReplicated(f"{what} reached {acked} of {self.replicas} replicas within {self.timeout_s:g}s")


class RedisUnavailable(ConnectionError):
    """Redis stayed unreachable past the caller's deadline or the outage limit."""


#: The longest wait between two tries of a call through an outage.
DEFAULT_RETRY_MAX_S = 5.0


class Reconnect:
    """Retries Redis calls through outages; records them for status. With `limit_s`, an
    outage that lasts longer raises RedisUnavailable whatever the call's deadline."""

    def __init__(self, what: str, first_s: float = 0.05, max_s: float = DEFAULT_RETRY_MAX_S,
                 limit_s: float | None = None):
        self.what = what  # who is waiting, for the log lines: "worker w1", "trainer session t.3"
        self.first_s = first_s
        self.max_s = max_s
        self.limit_s = limit_s
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
        now = time.monotonic()
        if self.limit_s is not None and now + delay > self.down_since + self.limit_s:
            raise RedisUnavailable(f"{self.what}: Redis unreachable for {now - self.down_since:.1f}s, past the "
                                   f"limit of {self.limit_s:g}s: {self.last_error}") from exc
        if deadline is not None and now + delay > deadline:
            raise RedisUnavailable(f"{self.what}: Redis unreachable for "
                                   f"{now - self.down_since:.1f}s: {self.last_error}") from exc
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
