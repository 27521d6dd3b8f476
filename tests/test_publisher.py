"""The worker's Publisher (workers/publisher.py): groups finished while a publish is on
its way go to Redis together, each caller gets its own outcome, and a caller cancelled
meanwhile does not cancel its publish. Real Redis, the worker's own context."""
from __future__ import annotations

import asyncio
import threading

import redis

from pipeline.codec import encode_group
from pipeline.queue import Place, Publish, Published, Queue
from tests.groups import assert_audit_ok, claim, finish, fresh
from workers.context import WorkerContext
from workers.publisher import Publisher
from workers.settings import WorkerSettings


def held(queue: Queue, n: int) -> list[Publish]:
    queue.push_groups(fresh(n))
    return [Publish(c.group_id, c.token, encode_group(finish(c.group)), Place.RESULTS)
            for c in claim(queue, "w", n).groups]


def context(queue: Queue) -> WorkerContext:
    settings = WorkerSettings(redis_url="redis://unused", engine_urls=["http://unused"],
                              namespace=queue.keys.namespace)
    return WorkerContext(settings, queue, None, "w")


class GatedQueue:
    """The queue, whose first publish_many waits until the test opens the gate."""

    def __init__(self, queue: Queue):
        self.queue, self.gate, self.sizes = queue, threading.Event(), []

    def publish_many(self, worker, items):
        self.sizes.append(len(items))
        if len(self.sizes) == 1:
            assert self.gate.wait(30)
        return self.queue.publish_many(worker, items)


def test_groups_finished_while_a_publish_is_out_go_together(queue):
    items = held(queue, 6)
    gated = GatedQueue(queue)
    publisher = Publisher(context(queue))

    async def main():
        first = asyncio.create_task(publisher.publish(gated, items[0]))
        while not gated.sizes:  # the first call is out
            await asyncio.sleep(0.001)
        rest = [asyncio.create_task(publisher.publish(gated, it)) for it in items[1:]]
        await asyncio.sleep(0)  # the rest are waiting behind it
        gated.gate.set()
        return await asyncio.gather(first, *rest)

    assert asyncio.run(main()) == [Published.OK] * 6
    assert gated.sizes == [1, 5] and publisher.calls == 2
    assert queue.redis.xlen(queue.keys.results) == 6
    assert_audit_ok(queue)


def test_a_batch_refused_as_a_whole_is_published_group_by_group(queue, monkeypatch):
    items = held(queue, 3)
    items[1] = Publish(items[1].group_id, "not-its-token", items[1].payload, Place.RESULTS)
    real = queue.publish_many
    sizes = []

    def refuse_batches(worker, batch):
        sizes.append(len(batch))
        if len(batch) > 1:
            raise redis.ResponseError("a script error in the batch")
        return real(worker, batch)

    monkeypatch.setattr(queue, "publish_many", refuse_batches)
    publisher = Publisher(context(queue))
    gated = GatedQueue(queue)

    async def main():
        first = asyncio.create_task(publisher.publish(gated, items[0]))
        while not gated.sizes:
            await asyncio.sleep(0.001)
        rest = [asyncio.create_task(publisher.publish(gated, it)) for it in items[1:]]
        await asyncio.sleep(0)
        gated.gate.set()
        return await asyncio.gather(first, *rest)

    # Each caller its own answer: the group held under another token is refused, alone.
    assert asyncio.run(main()) == [Published.OK, Published.REFUSED, Published.OK]
    assert sizes == [1, 2, 1, 1]
    assert queue.redis.xlen(queue.keys.results) == 2


def test_a_caller_cancelled_while_its_publish_is_out_leaves_it_to_land(queue):
    [item] = held(queue, 1)
    gated = GatedQueue(queue)
    publisher = Publisher(context(queue))

    async def main():
        caller = asyncio.create_task(publisher.publish(gated, item))
        while not gated.sizes:
            await asyncio.sleep(0.001)
        caller.cancel()  # the worker stopping: its group tasks are cancelled
        await asyncio.gather(caller, return_exceptions=True)
        gated.gate.set()
        while publisher._senders:
            await asyncio.sleep(0.001)
        return caller.cancelled()

    assert asyncio.run(main())
    assert queue.redis.xlen(queue.keys.results) == 1
    assert_audit_ok(queue)
