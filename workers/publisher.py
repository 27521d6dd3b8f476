"""Publishing finished groups: those finished while a publish is on its way go together.

Under `appendfsync always` a round trip costs Redis an event-loop pass, an AOF write
and an fsync whatever it carries, so a worker publishing each group as it finishes
pays them per group. The Publisher sends the first finished group at once and, while
that call is out, gathers the groups finishing meanwhile into the next
`Queue.publish_many` (one MULTI): no group waits for a batch to fill, and under load
the calls carry several groups each (group commit).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pipeline.queue import Publish, Published, Queue

from .context import WorkerContext

log = logging.getLogger("workers.worker")

#: Groups per publish_many at most (Queue.publish_many also caps a MULTI's bytes, and splits
#: one Redis refuses for memory).
MAX_BATCH = 32


@dataclass
class _Waiting:
    item: Publish
    done: asyncio.Future


class Publisher:
    """`await publish(queue, item)`: the group's outcome, or the exception its own
    publish raised. A batch the server refused as a whole (a script error, not an
    outage: outages are waited out by the worker's Reconnect) is published again group by
    group, so each caller gets its own answer; a retry is safe, what went through answers
    `already`."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self._waiting: dict[tuple[Queue, str], list[_Waiting]] = {}  # by queue and worker id
        self._senders: set[asyncio.Task] = set()
        self.calls = 0  # publish_many calls made (fewer than groups when they went together)

    async def publish(self, queue: Queue, item: Publish) -> Published:
        done = asyncio.get_running_loop().create_future()
        key = (queue, self.ctx.id)  # the id changes if the worker registers anew
        waiting = self._waiting.get(key)
        if waiting is None:  # no call out for this queue: this one starts them
            waiting = self._waiting[key] = []
            sender = asyncio.create_task(self._send(key))
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        waiting.append(_Waiting(item, done))
        # Shielded: a group task cancelled now (the worker stopping) leaves its publish to
        # finish; Redis decides either way, and reconciliation reads what it decided.
        return await asyncio.shield(done)

    async def _send(self, key: tuple[Queue, str]) -> None:
        queue, worker = key
        try:
            while self._waiting[key]:
                waiting = self._waiting[key]
                batch, self._waiting[key] = waiting[:MAX_BATCH], waiting[MAX_BATCH:]
                self.calls += 1
                try:
                    outcomes = await self.ctx.redis(queue.publish_many, worker, [w.item for w in batch])
                except Exception as exc:
                    if len(batch) == 1:
                        _settle(batch[0], exc=exc)
                        continue
                    log.warning("worker %s: a publish of %d groups failed (%s); publishing them one by one",
                                worker, len(batch), exc)
                    await self._one_by_one(queue, worker, batch)
                    continue
                for w, outcome in zip(batch, outcomes):
                    _settle(w, outcome)
        finally:
            for w in self._waiting.pop(key, []):  # only if this task itself was cancelled
                _settle(w, exc=asyncio.CancelledError())

    async def _one_by_one(self, queue: Queue, worker: str, batch: list[_Waiting]) -> None:
        for w in batch:
            try:
                [outcome] = await self.ctx.redis(queue.publish_many, worker, [w.item])
                _settle(w, outcome)
            except Exception as exc:
                _settle(w, exc=exc)


def _settle(waiting: _Waiting, outcome: Published | None = None, exc: BaseException | None = None) -> None:
    if waiting.done.done():
        return
    if exc is None:
        waiting.done.set_result(outcome)
        return
    waiting.done.set_exception(exc)
    waiting.done.exception()  # retrieved: its caller may have been cancelled (asyncio would log it)
