"""Taking work: the claim loop sizes each claim to the free sample slots, eval prompts first, and sleeps until woken."""
from __future__ import annotations

import asyncio

from pipeline.queue import Claim, ClaimStatus

from .context import WorkerContext
from .engine_health import EngineHealth
from .group_run import GroupRunner
from .liveness import Liveness


class Claimer:
    """Claims groups while there is room and hands each to the runner. What Redis answers
    about admission (paused, backlog, budget, isolating) is kept for the worker's state."""

    def __init__(self, ctx: WorkerContext, runner: GroupRunner, engine_health: EngineHealth, liveness: Liveness):
        self.ctx = ctx
        self.runner = runner
        self.engine_health = engine_health
        self.liveness = liveness
        self.claims = 0  # claims made; with the worker id, each one's fencing token
        self.status = ClaimStatus.OK  # the last training claim's answer

    async def loop(self) -> None:
        ctx, runner = self.ctx, self.runner
        idle_wait = 0.01
        while not ctx.stopping.is_set():
            if self.engine_health.down is not None:
                await self.sleep(1.0)
                continue
            free = ctx.capacity - runner.inflight_samples
            # A group larger than the whole capacity is still claimed, alone.
            if free < runner.group_size and runner.running:
                await self.sleep(1.0)  # woken when a sample slot frees
                continue
            claim = await self._claim(max(1, free // runner.group_size))
            if claim is None:
                continue
            if claim.groups:
                idle_wait = 0.01
                continue
            # Control changes arrive as events (pub/sub) and wake us; this wait is the
            # fallback, short at first so a trickle of prompts is picked up quickly.
            await self.sleep(idle_wait)
            idle_wait = min(idle_wait * 2, 0.1)

    async def _claim_eval(self, worker_id: str, want: int) -> Claim | None:
        """Eval prompts first, while admission is open (a weight update pauses them too)."""
        ctx = self.ctx
        if ctx.eval_queue is None or ctx.paused or not await ctx.redis(ctx.eval_queue.has_prompts):
            return None
        self.claims += 1
        claim = await ctx.redis(ctx.eval_queue.claim, worker_id, f"{worker_id}:{self.claims}", want)
        if not ctx.stopping.is_set():
            for claimed in claim.groups:
                self.runner.start(claimed, ctx.eval_queue)
        return claim if claim.groups or claim.status in (ClaimStatus.UNREGISTERED, ClaimStatus.EXPIRED) else None

    async def _claim(self, want: int) -> Claim | None:
        ctx = self.ctx
        async with ctx.claim_lock:
            worker_id = ctx.id
            claim = await self._claim_eval(worker_id, want)
            if claim is None:
                self.claims += 1
                # The claim id is the groups' fencing token; a retry after a lost reply
                # presents the same id and gets the same groups.
                claim = await ctx.redis(ctx.queue.claim, worker_id, f"{worker_id}:{self.claims}", want)
                self.status = claim.status
                ctx.queue_version = claim.weight_version
                if claim.status not in (ClaimStatus.UNREGISTERED, ClaimStatus.EXPIRED):  # answered before `paused`
                    ctx.paused = claim.status == ClaimStatus.PAUSED
                if ctx.stopping.is_set():
                    return claim  # what this claim took goes back with leave() in the worker's shutdown
                for claimed in claim.groups:
                    self.runner.start(claimed, ctx.queue)
        if claim.status == ClaimStatus.UNREGISTERED:
            await self.liveness.reincarnate(worker_id)
            return None
        if claim.status == ClaimStatus.EXPIRED:
            await self.liveness.heartbeat()  # renews the lease, or finds we were reaped meanwhile
            return None
        return claim

    async def sleep(self, seconds: float) -> None:
        self.ctx.wake.clear()
        try:
            await asyncio.wait_for(self.ctx.wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass
