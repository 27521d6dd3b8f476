"""The worker's standing in Redis: registration, heartbeats, reincarnation, reconciliation, upkeep, control events."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, Callable

from pipeline import metrics
from pipeline.control import HEARTBEATS_PER_LEASE, read_control
from pipeline.permissions import PermissionDenied
from pipeline.queue import Queue

from .context import WorkerContext
from .engine_health import EngineHealth
from .group_run import GroupRunner

log = logging.getLogger("workers.worker")  # the worker's log: its lines read as they always did


class Liveness:
    """Keeps this process and Redis in agreement. A worker is registered explicitly and
    extends its lease with heartbeats; one that was reaped (it stalled past its lease)
    learns it at its next contact, cancels its tasks and registers under a new id. Every
    heartbeat reconciles: a group Redis says this worker holds with no task here goes
    back to the prompt list; a task whose group it no longer holds is cancelled."""

    def __init__(self, ctx: WorkerContext, name: str, runner: GroupRunner, engine_health: EngineHealth,
                 info: Callable[[], dict[str, Any]]):
        self.ctx = ctx
        self.name = name
        self.incarnation = 1
        self.runner = runner
        self.engine_health = engine_health
        self.info = info  # what the worker says about itself, stored with each heartbeat
        self._last_reap = 0.0
        self._last_orphan_reap = 0.0
        # Redis outages of this process's connection (ctx.reconnect.outages) that a heartbeat
        # has renewed the lease after: upkeep reaps only when it is current, so a worker
        # whose own link was down longer than the lease renews before it reaps anyone
        # (itself included).
        self._renewed_outages = 0
        self.registration = ""  # this incarnation's registration nonce (register())

    # -- registration ----------------------------------------------------------------

    async def register(self) -> None:
        ctx = self.ctx
        # In the info of every heartbeat of this incarnation: a registration retried after
        # its reply was lost is recognised even if a heartbeat rewrote the info meanwhile.
        self.registration = uuid.uuid4().hex
        info = json.dumps(self.info())
        ctx.lease_s = await ctx.redis(ctx.queue.register, ctx.id, info)
        if ctx.eval_queue:
            await ctx.redis(ctx.eval_queue.register, ctx.id, info)

    async def leave(self, deadline: float | None = None) -> int:
        returned = 0
        for queue in self.ctx.queues:
            returned += await self.ctx.redis(queue.leave, self.ctx.id, deadline=deadline)
        return returned

    async def reincarnate(self, reaped: str) -> None:
        """We were reaped (stalled past the lease): another worker may have our groups.
        Cancel everything and register as a new worker. `reaped` is the id Redis refused:
        the claim loop, the heartbeat and the control listener can learn it at once, and
        only the first registers anew."""
        ctx = self.ctx
        async with ctx.claim_lock:
            if ctx.reconnect.down or ctx.id != reaped:
                return
            old, old_lease = ctx.id, ctx.lease_s
            # Asked, not assumed: a purge deletes registrations with every other key.
            reaped = any([await ctx.redis(queue.reap_logged, old) for queue in ctx.queues])
            if reaped:
                log.error("worker %s was reaped (no heartbeat within its %gs lease); cancelling its %d group tasks "
                          "(their publishes would be refused) and registering anew", old, ctx.lease_s,
                          len(self.runner.running))
            else:
                log.warning("worker %s: its registration was deleted without a reap (the namespace was purged, or "
                            "it was deleted by hand); cancelling its %d group tasks and registering anew", old,
                            len(self.runner.running))
            await self.runner.cancel_all(f"worker {old} was reaped" if reaped else f"worker {old} was unregistered")
            for queue in ctx.queues:  # in case its lease ran out and nobody reaped it yet
                await ctx.redis(queue.reap, old)
            self.incarnation += 1
            ctx.counters.reincarnations += 1
            ctx.id = f"{self.name}#{self.incarnation}"
            ctx.reconnect.what = f"worker {ctx.id}"
            await self.register()
            log.warning("worker %s registered as %s", old, ctx.id)
            if ctx.lease_s != old_lease:  # a purge takes the namespace's settings too
                log.warning("worker %s: the namespace's lease is now %gs (was %gs)", ctx.id, ctx.lease_s, old_lease)

    # -- heartbeat and reconciliation ------------------------------------------------

    async def heartbeat(self) -> None:
        ctx = self.ctx
        metrics.INFLIGHT_SAMPLES.set(self.runner.inflight_samples)
        worker_id = ctx.id
        info = json.dumps(self.info())
        outages = ctx.reconnect.outages
        beat = await ctx.redis(ctx.queue.heartbeat, worker_id, info)
        if beat.reaped or (ctx.eval_queue and (await ctx.redis(ctx.eval_queue.heartbeat, worker_id, info)).reaped):
            await self.reincarnate(worker_id)
            return
        self._renewed_outages = outages
        ctx.paused = beat.paused  # a missed event: the heartbeat carries the truth
        ctx.queue_version = beat.weight_version
        ctx.version_clock = beat.version_clock
        if beat.lease_s != ctx.lease_s:
            log.warning("worker %s: the namespace's lease is now %gs (was %gs)", ctx.id, beat.lease_s, ctx.lease_s)
            if beat.lease_s < HEARTBEATS_PER_LEASE * ctx.settings.heartbeat_s:
                log.error("worker %s: a %gs lease is shorter than %d of this worker's %gs heartbeats; it may be "
                          "reaped while alive", ctx.id, beat.lease_s, HEARTBEATS_PER_LEASE, ctx.settings.heartbeat_s)
            ctx.lease_s = beat.lease_s

    async def reconcile(self) -> None:
        """Make this process and Redis agree on what it holds."""
        async with self.ctx.claim_lock:
            for queue in self.ctx.queues:
                await self._reconcile_with(queue)

    async def _reconcile_with(self, queue: Queue) -> None:
        """Agree with one namespace on what this worker holds there."""
        ctx, running = self.ctx, self.runner.running
        held = await ctx.redis(queue.held, ctx.id)
        for (_, gid), run in list(running.items()):
            if run.queue is queue and held.get(gid) != run.token and not run.publishing:
                log.warning("group %s: worker %s no longer holds it in Redis (claim %s); cancelling its task",
                            gid, ctx.id, run.token)
                run.task.cancel()
        stray = {gid: token for gid, token in held.items()
                 if (run := running.get((queue.keys.namespace, gid))) is None or run.token != token}
        if stray:
            n = await ctx.redis(queue.hand_back, ctx.id, stray)
            ctx.counters.handed_back += n
            log.warning("worker %s: %d groups held in Redis with no task here (a lost claim reply, or a task "
                        "that failed to publish) went back to the prompt list: %s", ctx.id, n,
                        ", ".join(list(stray)[:5]))

    # -- background loops ------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.settings.heartbeat_s)
            try:
                await self.heartbeat()
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except PermissionDenied as exc:
                self.ctx.refused(exc)
            except Exception as exc:
                log.warning("worker %s: heartbeat failed: %s", self.ctx.id, exc)

    async def maintenance_loop(self) -> None:
        """Reap dead workers and release aborted groups while admission is open, so
        nothing waits on one process being alive; watch the engines."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.ctx.redis(self._upkeep)
                await self.engine_health.watch()
            except asyncio.CancelledError:
                raise
            except PermissionDenied as exc:
                self.ctx.refused(exc)
            except Exception as exc:
                log.warning("worker %s: maintenance failed: %s", self.ctx.id, exc)

    def _upkeep(self) -> None:
        main = self.ctx.queue
        depths = main.depths()
        metrics.sample_namespace(depths, main.stats() if self.ctx.settings.metrics_port else {})
        now = time.monotonic()
        reap = now - self._last_reap >= self.ctx.lease_s / 4 and self._renewed_outages == self.ctx.reconnect.outages
        orphans = now - self._last_orphan_reap >= 10 * self.ctx.lease_s
        if reap:
            self._last_reap = now
        if orphans:
            self._last_orphan_reap = now
        control = None  # the training namespace's: its pause (a weight update) holds eval groups back too
        for queue in self.ctx.queues:
            if reap:
                queue.reap_expired()
            if orphans:
                queue.reap_orphans()
            requeued = depths["requeue"] if queue is main else queue.redis.xlen(queue.keys.requeue)
            if requeued:
                control = control or read_control(main.redis, main.keys)
                if not control.paused:
                    queue.release(control.release_policy)

    async def listen_for_control(self) -> None:
        """Pause and resume are published on the events channel: wake the claim loop
        at once, so admission follows control changes within milliseconds. The
        heartbeat carries the same state, should an event be missed."""
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        while True:
            pubsub = ctx.queue.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await loop.run_in_executor(ctx.redis_pool, pubsub.subscribe, ctx.queue.keys.events)
                while True:
                    message = await loop.run_in_executor(ctx.redis_pool, lambda: pubsub.get_message(timeout=1.0))
                    if message is None:
                        continue
                    try:
                        event = json.loads(message["data"])
                        paused, draining = bool(event["paused"]), frozenset(event.get("draining", ()))
                    except (ValueError, KeyError, TypeError, AttributeError):
                        log.warning("worker %s: ignoring malformed control event %r", ctx.id, message["data"])
                        continue
                    ctx.paused = paused
                    self.engine_health.engines.draining = draining
                    ctx.wake.set()
                    await self.heartbeat()  # so status shows the new state at once
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: the heartbeat carries the state meanwhile
                log.debug("worker %s: control events interrupted (%s); resubscribing", ctx.id, exc)
                await asyncio.sleep(1.0)
            finally:
                await loop.run_in_executor(ctx.redis_pool, pubsub.close)
