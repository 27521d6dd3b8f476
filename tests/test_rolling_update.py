"""Rolling weight updates (Controller.rolling_update): one engine at a time leaves the
workers' rotation and updates while the others keep generating. Two real simulators, a
real worker given both engines' URLs, real Redis."""
from __future__ import annotations

import asyncio

import pytest

from engines.simulator import SimConfig, start_simulator
from pipeline.consumer import Consumer
from pipeline.control import read_control
from pipeline.controller import Controller, WeightUpdateError
from pipeline.ops.audit import audit
from pipeline.queue import Queue
from tests import generate_functions as fns
from tests.helpers import WorkerThread, consume_all, http_json, wait_for
from tests.test_weight_update import SLOW, check_sample, push, worker_settings
from workers.engine_set import EngineSet
from workers.sampling import SamplingSettings

GROUPS = 24


@pytest.fixture
def sims():
    started = [start_simulator(SimConfig(seed=30 + i, **SLOW)) for i in range(2)]
    try:
        yield started
    finally:
        for s in started:
            s.stop()


class WatchedEngines(EngineSet):
    """EngineSet whose per-engine weight load first waits until the pipeline finished
    `more` groups: generation goes on elsewhere while this engine is out (or the wait
    times out and the test fails). It also records what the control hash said then."""

    def __init__(self, urls: list[str], queue: Queue, more: int = 2):
        super().__init__(urls)
        self.queue, self.more = queue, more
        self.seen: list[tuple[str, tuple[str, ...], bool, int]] = []  # engine, draining, paused, version

    def only(self, engine_url: str) -> EngineSet:
        one = super().only(engine_url)
        load = one.update_weights_from_disk

        async def watched_load(*args, **kwargs):
            control = read_control(self.queue.redis, self.queue.keys)
            self.seen.append((engine_url, control.draining, control.paused, control.weight_version))
            finished = self.queue.redis.xlen(self.queue.keys.results)
            await asyncio.to_thread(wait_for, lambda: self.queue.redis.xlen(self.queue.keys.results)
                                    >= finished + self.more, 30, 0.05,
                                    f"{self.more} groups finished while {engine_url} is out of rotation")
            return await load(*args, **kwargs)

        one.update_weights_from_disk = watched_load
        return one


def test_draining_engine_gets_no_new_requests(sims):
    async def main():
        engines = EngineSet([s.url for s in sims])
        engines.draining = frozenset([sims[0].url])
        try:
            answers = await asyncio.gather(*(engines.generate([1, 2, 3], {"max_new_tokens": 4}) for _ in range(6)))
        finally:
            await engines.close()
        return {a.url for a in answers}

    assert asyncio.run(main()) == {sims[1].url}


def test_rolling_update_never_stops_generation_and_loses_nothing(sims, redis_url, queue, namespace):
    ids = push(queue, GROUPS)
    urls = [s.url for s in sims]
    worker = WorkerThread(worker_settings(redis_url, namespace, urls))
    engines = WatchedEngines(urls, queue)
    controller = Controller(queue, engines)

    async def update():
        try:
            return await controller.rolling_update("/ckpt/step1", 1)
        finally:
            await engines.close()

    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.results) >= 1, what="a first group finished")
        report = asyncio.run(update())
        got = consume_all(Consumer(queue.redis, namespace), GROUPS, 4)
    finally:
        worker.stop()

    # Each engine was out alone, admission never paused, groups finished meanwhile, and
    # the trainer's version was recorded before the first engine left.
    assert engines.seen == [(url, (url,), False, 1) for url in urls]
    assert set(report.out_of_rotation_s) == set(urls) and report.weight_version == 1
    control = read_control(queue.redis, queue.keys)
    assert control.draining == () and control.weight_version == 1
    assert {http_json(u + "/get_model_info")["weight_version"] for u in urls} == {"1"}
    # Aborted requests continued at once on the other engine in the worker, not as
    # preemptions (which wait a beat) and not through the requeue stream.
    counters = worker.worker.ctx.counters
    assert counters.drained > 0 and counters.preempted == 0
    assert queue.stats().get("requeue", 0) == 0
    assert sorted(g.group_id for g in got) == sorted(ids)
    for g in got:
        for s in g.samples:
            check_sample(g, s)
    report_audit = audit(queue)
    assert report_audit.ok and report_audit.committed == GROUPS, report_audit.summary()


def test_an_engine_failing_its_rolling_update_stays_out_and_is_named(sims, queue):
    http_json(sims[1].url + "/sim/faults", {"weight_update_fail_rate": 1.0})
    engines = EngineSet([s.url for s in sims])

    async def update():
        try:
            await Controller(queue, engines).rolling_update("/ckpt/step1", 1)
        finally:
            await engines.close()

    with pytest.raises(WeightUpdateError, match=f"failed at engine {sims[1].url}; it stays paused"):
        asyncio.run(update())
    assert read_control(queue.redis, queue.keys).draining == (sims[1].url,)
    assert http_json(sims[0].url + "/get_model_info")["weight_version"] == "1"


def test_a_rolling_update_moves_generate_function_samples_to_the_other_engine_at_once(sims, redis_url, queue,
                                                                                     namespace):
    fns.reset()
    fns.LONG_TURNS = True  # each call may run to the whole budget: the drain lands mid-call
    try:
        ids = push(queue, GROUPS // 2, samples=2)
        urls = [s.url for s in sims]
        worker = WorkerThread(worker_settings(redis_url, namespace, urls, sampling=SamplingSettings(max_new_tokens=1200),
                                              generate_function="tests.generate_functions:three_turns"))
        engines = WatchedEngines(urls, queue, more=1)

        async def update():
            try:
                return await Controller(queue, engines).rolling_update("/ckpt/step1", 1)
            finally:
                await engines.close()

        try:
            wait_for(lambda: worker.worker.ctx.counters.function_calls >= 4, what="function calls under way")
            asyncio.run(update())
            got = consume_all(Consumer(queue.redis, namespace), len(ids), 4)
        finally:
            worker.stop()
    finally:
        fns.LONG_TURNS = False
    # The calls the drain aborted were continued on the engine left in rotation at once:
    # not waited on as preemptions, not requeued.
    counters = worker.worker.ctx.counters
    assert counters.drained > 0 and counters.preempted == 0
    assert queue.stats().get("requeue", 0) == 0
    assert sorted(g.group_id for g in got) == sorted(ids)
    assert all(s.metadata["turns"] == fns.TURNS for g in got for s in g.samples)
    assert audit(queue).ok
