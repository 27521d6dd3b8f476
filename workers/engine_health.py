"""Whether the engines can take work: the breaker that stops claiming, /health probes, rediscovery behind routers."""
from __future__ import annotations

import logging
import time

from pipeline import metrics
from pipeline.control import read_control

from .context import WorkerContext
from .engine_errors import EngineError
from .engine_set import EngineSet

log = logging.getLogger("workers.worker")  # the worker's log: its lines read as they always did

#: How often a worker looks for engines joining or leaving behind its router URLs.
REDISCOVER_S = 30.0


class EngineHealth:
    """A breaker over engine failures: `engine_down_after` in a row stop claiming
    (`down` says why); a /health probe brings the worker back on trial."""

    def __init__(self, ctx: WorkerContext, engines: EngineSet):
        self.ctx = ctx
        self.engines = engines
        self.consecutive_failures = 0
        self.down: str | None = None  # why, while the breaker is open
        self.down_since = 0.0
        # After /health says an engine is back, the first failure opens the breaker again
        # (half-open), and each reopening doubles the wait before the next probe.
        self.trial = False
        self.probe_s = 1.0
        self.next_probe = 0.0
        self.last_discovery = time.monotonic()

    def ok(self) -> None:
        self.consecutive_failures = 0
        if self.trial:
            self.trial, self.probe_s = False, 1.0

    def failed(self, exc: EngineError) -> None:
        metrics.ENGINE_ERRORS.labels("unavailable" if exc.status is None else str(exc.status)).inc()
        self.ctx.counters.engine_errors += 1
        self.consecutive_failures += 1
        if self.down is not None:
            return
        if self.trial:  # back too early: wait twice as long before the next probe
            self.probe_s = min(30.0, self.probe_s * 2)
        elif self.consecutive_failures < self.ctx.settings.engine_down_after:
            return
        self.down, self.trial = str(exc), False
        self.down_since = time.monotonic()
        self.next_probe = self.down_since + self.probe_s
        log.error("worker %s: engine-down after %d failures in a row (last: %s); stopped claiming and handing "
                  "unfinished groups on; next /health probe in %gs", self.ctx.id, self.consecutive_failures,
                  exc, self.probe_s)

    async def check(self) -> None:
        """While down: any engine answering /health brings the worker back (one
        decommissioned engine behind a router must not keep it down), on trial."""
        if self.down is None or time.monotonic() < self.next_probe:
            return
        healthy = await self.engines.health()
        if any(healthy.values()):
            log.warning("worker %s: engines answer /health again after %.0fs (%s); claiming again", self.ctx.id,
                        time.monotonic() - self.down_since, ", ".join(u for u, ok in healthy.items() if ok))
            self.down, self.trial = None, True
            self.consecutive_failures = 0
            self.ctx.wake.set()
        else:
            self.next_probe = time.monotonic() + self.probe_s

    async def discover(self) -> None:
        """Engines behind the given router URLs come and go: capacity follows them."""
        try:
            engines = await self.engines.refresh()
        except EngineError as exc:  # keep going: generation goes through the given URLs
            log.warning("engine discovery failed (%s); using %s as given", exc, self.engines.urls)
            return
        capacity = self.ctx.settings.concurrency_per_engine * max(1, len(engines))
        if capacity != self.ctx.capacity and self.ctx.lease_s:
            log.warning("worker %s: %d engines now (%s); capacity %d -> %d samples", self.ctx.id, len(engines),
                        ", ".join(engines), self.ctx.capacity, capacity)
        self.ctx.capacity = capacity
        self.ctx.wake.set()

    async def watch(self) -> None:
        """Every second, from the maintenance loop: probe while down, and look for engines
        joining or leaving (every REDISCOVER_S, and every time while down)."""
        await self.check()
        if self.engines.draining:  # so a missed event cannot keep an engine out of rotation
            await self.refresh_control()
        if time.monotonic() - self.last_discovery >= REDISCOVER_S or self.down is not None:
            self.last_discovery = time.monotonic()
            await self.discover()

    async def pause_explains_abort(self) -> bool:
        """An abort answer is a pause's doing when admission is paused. The controller
        sets `paused` in Redis before it pauses the engines, so Redis knows first. (The
        engines draining are read on the way: see drained().)"""
        if self.ctx.paused:
            return True
        await self.refresh_control()
        return self.ctx.paused

    async def refresh_control(self) -> None:
        """Read what the control hash says of admission (paused) and of the engines (draining)."""
        control = await self.ctx.redis(read_control, self.ctx.queue.redis, self.ctx.queue.keys)
        self.ctx.paused = control.paused
        self.engines.draining = frozenset(control.draining)

    def drained(self, url: str | None) -> bool:
        """Whether `url` is out of rotation for a rolling weight update: its aborts are the
        update's doing (the controller lists the engine in Redis before it pauses it), and
        the sample continues at once on another engine."""
        return url in self.engines.draining
