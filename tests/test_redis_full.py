"""Redis full (maxmemory with noeviction), issue 26: a worker holds what it finished and
retries the publish until there is room; status says why; nothing is dead-lettered."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engines.simulator import SimConfig, start_simulator
from pipeline.connection import connect
from pipeline.ops.audit import audit
from pipeline.ops.status import snapshot
from pipeline.queue import Published, Queue
from pipeline.redis_server import Fsync
from pipeline.retry import is_transient
from pipeline.types import Group
from tests.helpers import WorkerThread, wait_for
from workers.rewards import Reward
from workers.worker import SamplingSettings, WorkerSettings


@pytest.fixture
def sim():
    handle = start_simulator(SimConfig(seed=5, decode_tokens_per_s=20000.0, length_median=16, length_p99=64,
                                       prefill_s=0.001))
    yield handle
    handle.stop()


def test_a_full_redis_holds_finished_groups_and_publishes_them_when_room_returns(redis_factory, sim):
    server = redis_factory("full", fsync=Fsync.EVERYSEC)
    client = connect(server.url)
    queue = Queue(client, "full")
    release, scored = threading.Event(), []

    def judge(args, sample) -> float:
        scored.append(sample.group_index)
        release.wait()  # every group finished generating; its reward waits until Redis is full
        return 1.0

    queue.push_groups([Group.fresh(f"g{i}", f"What is {i} + 1?", 2, label=str(i + 1)) for i in range(3)])
    worker = WorkerThread(WorkerSettings(redis_url=server.url, engine_urls=[sim.url], namespace="full",
                                         heartbeat_s=0.5, sampling=SamplingSettings(max_new_tokens=32),
                                         reward_timeout_s=600), reward=Reward(judge))
    try:
        wait_for(lambda: len(scored) == 6, timeout=60, what="every sample waiting for its reward")
        client.config_set("maxmemory", 1)  # noeviction is the default policy
        release.set()
        reconnect = worker.worker.ctx.reconnect
        wait_for(lambda: reconnect.down and "maxmemory" in reconnect.last_error, timeout=60,
                 what="the worker retrying its publishes")
        alerts = snapshot(queue).alerts
        assert alerts[0].startswith("Redis is full") and "retry publishing" in alerts[0], alerts
        assert client.xlen(queue.keys.results) == client.xlen(queue.keys.dead) == 0
        client.config_set("maxmemory", 0)
        wait_for(lambda: client.xlen(queue.keys.results) == 3, timeout=60, what="the held groups published")
    finally:
        release.set()
        client.config_set("maxmemory", 0)
        worker.stop()
    assert client.xlen(queue.keys.dead) == 0 and not any("Redis is full" in a for a in snapshot(queue).alerts)
    assert audit(queue).ok
    client.close()


def test_an_oom_reply_is_transient():
    import redis

    assert is_transient(redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'."))
    assert not is_transient(redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"))


MARKER = b"PAYLOAD-BYTES-NEVER-LOGGED"


def test_a_publish_batch_refused_for_its_size_splits_and_lands_what_fits(redis_factory, caplog):
    """Issue 31 item 3: Redis holds a MULTI's queued arguments in memory until EXEC, so a
    batch of finished groups can pass maxmemory where each alone fits. The batch was
    refused (OOM, EXECABORT), OOM is transient, and the same batch was retried whole,
    forever: nothing landed although most would have. Now it splits; what fits lands; the
    rest waits for room; the retry log quotes no payload bytes."""
    from pipeline.queue import Place, Publish
    from tests.groups import claim, fresh
    from tests.test_publisher import context
    from workers.publisher import Publisher

    server = redis_factory("split", fsync=Fsync.EVERYSEC)
    admin = connect(server.url, read_only=True)
    queue = Queue(connect(server.url), "split")
    queue.push_groups(fresh(8))
    items = [Publish(c.group_id, c.token, MARKER + bytes(2 << 20), Place.RESULTS) for c in claim(queue, "w", 8).groups]
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", used + (12 << 20))  # room for 4 groups of 2 MB, not for a MULTI of 7
    publisher = Publisher(context(queue))
    done: list = []

    async def main():
        first = asyncio.create_task(publisher.publish(queue, items[0]))
        rest = [asyncio.create_task(publisher.publish(queue, it)) for it in items[1:]]  # behind the first: one MULTI
        return await asyncio.gather(first, *rest)

    thread = threading.Thread(target=lambda: done.append(asyncio.run(main())), daemon=True)
    thread.start()
    try:
        wait_for(lambda: admin.xlen(queue.keys.results) >= 4, timeout=30, what="the groups that fit published")
        wait_for(lambda: publisher.ctx.reconnect.down, what="the rest waiting for room")
    finally:
        admin.config_set("maxmemory", 0)  # the trainer's commits made room
    thread.join(60)
    assert done == [[Published.OK] * 8]
    assert admin.xlen(queue.keys.results) == 8
    logged = "\n".join(r.getMessage() for r in caplog.records) + publisher.ctx.reconnect.last_error
    assert "maxmemory" in logged and MARKER.decode() not in logged and "\\x00\\x00" not in logged
    assert audit(queue).ok
