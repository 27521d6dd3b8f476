"""Redis full (maxmemory with noeviction), issue 26: a worker holds what it finished and
retries the publish until there is room; status says why; nothing is dead-lettered."""
from __future__ import annotations

import threading

import pytest

from engines.simulator import SimConfig, start_simulator
from pipeline.connection import connect
from pipeline.ops.audit import audit
from pipeline.ops.status import snapshot
from pipeline.queue import Queue
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
