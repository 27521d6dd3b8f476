"""The generation worker against the simulator over real HTTP and a real Redis."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.ops.audit import audit
from pipeline.consumer import Consumer
from pipeline.control import configure
from pipeline.controller import Controller
from pipeline.queue import Queue
from pipeline.types import Group, Status
from tests.helpers import WorkerThread, consume_all, http_json, wait_for
from workers.engine_set import EngineSet
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings

REPO = Path(__file__).resolve().parent.parent
FAST = dict(decode_tokens_per_s=20000.0, length_median=24, length_p99=240, prefill_s=0.001)


@pytest.fixture
def sim():
    handle = start_simulator(SimConfig(seed=1, **FAST))
    yield handle
    handle.stop()


def settings(redis_url, namespace, engine_urls, **kw) -> WorkerSettings:
    kw.setdefault("sampling", SamplingSettings(max_new_tokens=128))
    kw.setdefault("heartbeat_s", 0.5)
    return WorkerSettings(redis_url=redis_url, engine_urls=list(engine_urls), namespace=namespace, **kw)


def push(queue: Queue, n_groups: int, n_samples: int, prefix: str = "g") -> list[str]:
    groups = []
    for i in range(n_groups):
        a, b = i % 50 + 2, i % 7 + 3
        groups.append(Group.fresh(f"{prefix}{i}", f"What is {a} + {b}?", n_samples, label=str(a + b), row=i))
    queue.push_groups(groups)
    return [g.group_id for g in groups]


def check_sample_consistent(group: Group) -> None:
    for s in group.samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.status
        assert s.tokens[: len(group.prompt_ids)] == group.prompt_ids
        assert len(s.tokens) == len(group.prompt_ids) + s.response_length
        assert len(s.rollout_log_probs) == s.response_length
        assert all(lp <= 0 for lp in s.rollout_log_probs)
        assert sum(s.metadata["rollout_segments"]) == s.response_length
        assert len(s.metadata["rollout_segments"]) == len(s.weight_versions)
        assert isinstance(s.reward, float)


def test_200_groups_of_8_end_to_end(redis_url, queue, namespace, sim):
    ids = push(queue, 200, 8)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], concurrency_per_engine=256))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 200, 32)
    finally:
        worker.stop()
    assert sorted(g.group_id for g in got) == sorted(ids)
    for g in got:
        assert g.n_samples == 8
        check_sample_consistent(g)
    rewards = [s.reward for g in got for s in g.samples]
    assert 0 < sum(rewards) < len(rewards)  # the simulator answers some right, some wrong
    report = audit(queue)
    assert report.ok and report.committed == 200, report.summary()


def test_capacity_is_counted_in_samples(redis_url, queue, namespace):
    # A slow engine: nothing finishes while we look, so in-flight = what was claimed.
    slow = start_simulator(SimConfig(seed=2, decode_tokens_per_s=5.0, length_median=500, length_p99=600))
    push(queue, 40, 8)
    worker = WorkerThread(settings(redis_url, namespace, [slow.url], concurrency_per_engine=32))
    try:
        # Full: 32 sample slots / 8 samples per group = 4 groups, not 32; then it waits.
        wait_for(lambda: worker.worker.state().startswith("full"), what="a full worker")
        assert sum(audit(queue).inflight.values()) == 4
        assert worker.worker.state() == "full: 32 of 32 sample slots"
    finally:
        worker.stop()
        slow.stop()
    report = audit(queue)
    assert report.ok and report.prompts == 40, report.summary()  # handed back on stop


def test_partial_rollout_continues_after_abort(redis_url, queue, namespace):
    # Long outputs at a slow decode rate, so the pause lands mid-generation.
    sim = start_simulator(SimConfig(seed=3, decode_tokens_per_s=200.0, length_median=400, length_p99=800))
    max_new = 300
    push(queue, 6, 4)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], sampling=SamplingSettings(max_new_tokens=max_new),
                                   mask_offpolicy_prefix=True))
    controller = Controller(queue, EngineSet([sim.url]))
    try:
        wait_for(lambda: sum(audit(queue).inflight.values()) == 6, what="all groups in flight")
        def used() -> int:
            return http_json(sim.url + "/sim/stats")["load"]["num_used_tokens"]

        start = used()
        wait_for(lambda: used() > start + 6 * 4 * 20, what="some tokens generated")

        async def update():
            pause = await controller.pause("abort")
            await controller.engines.update_weight_version("1", abort_all_requests=False)
            return pause, await controller.resume(weight_version=1)

        pause, resume = asyncio.run(update())
        assert pause.requeued == 6
        assert resume.released == 6
        got = consume_all(Consumer(queue.redis, namespace), 6, 6)
    finally:
        worker.stop()
        sim.stop()
    for g in got:
        check_sample_consistent(g)
        for s in g.samples:
            assert s.weight_versions[0] == "default" and s.weight_versions[-1] == "1"
            first = s.metadata["rollout_segments"][0]
            assert 0 < first < s.response_length
            # max_new_tokens was lowered on the continuation: never more than the limit in total
            assert s.response_length <= max_new
            # tokens from the old weights are masked, the rest trained on
            assert s.loss_mask == [0] * first + [1] * (s.response_length - first)
    assert audit(queue).ok


def test_kill_9_worker_mid_run_loses_nothing(redis_url, queue, namespace, sim):
    ids = push(queue, 60, 4)
    configure(queue.redis, queue.keys, lease_s=2)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "cli", "--redis-url", redis_url, "--namespace", namespace, "worker",
           "--engine-url", sim.url, "--heartbeat", "0.5", "--concurrency", "16", "--max-new-tokens", "128"]
    victim = subprocess.Popen(cmd, env=env, cwd=REPO)
    consumer = Consumer(queue.redis, namespace)
    got: list[Group] = []
    try:
        # Train on a few batches, then kill the worker while it holds groups.
        while len(got) < 12:
            b = consumer.next_batch(4, timeout=60)
            got += b.groups
            consumer.commit(b)
        wait_for(lambda: sum(audit(queue).inflight.values()) > 0, what="groups in flight")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        held = sum(audit(queue).inflight.values())
        assert held > 0
        survivor = subprocess.Popen(cmd, env=env, cwd=REPO)
        try:
            got += consume_all(consumer, 60 - len(got), 8)
        finally:
            survivor.send_signal(signal.SIGTERM)
            survivor.wait(30)
    finally:
        if victim.poll() is None:
            victim.kill()
    trained = [g.group_id for g in got]
    assert len(trained) == len(set(trained)) == 60
    assert sorted(trained) == sorted(ids)
    report = audit(queue)
    assert report.ok and report.committed == 60, report.summary()
    assert queue.stats().get("reaped", 0) >= held


@pytest.mark.slow
def test_engine_faults_retry_dead_letter_and_recover(redis_url, queue, namespace, sim):
    # Some failures: retried, every group still completes.
    http_json(sim.url + "/sim/faults", {"error_rate": 0.2, "drop_rate": 0.05})
    push(queue, 30, 4, prefix="flaky")
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], max_attempts=50, backoff_s=0.01,
                                   backoff_max_s=0.05, engine_down_after=1000))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 30, 10)
        assert worker.worker.counters.engine_errors > 0
        for g in got:
            check_sample_consistent(g)
    finally:
        worker.stop()

    # Every request fails: groups go to dead letters with the error, never to results.
    http_json(sim.url + "/sim/faults", {"error_rate": 1.0, "drop_rate": 0.0})
    push(queue, 5, 2, prefix="doomed")
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], max_attempts=3, backoff_s=0.01,
                                   engine_down_after=1000))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 5, what="5 dead letters")
    finally:
        worker.stop()
    dead = queue.read_stream(queue.keys.dead)
    assert {e.group_id for e in dead} == {f"doomed{i}" for i in range(5)}
    for e in dead:
        assert "engine failed 3 times" in e.error and ("500" in e.error or "503" in e.error), e.error
    assert queue.redis.xlen(queue.keys.results) == 0  # no zero-reward groups published

    # The engine goes down (every endpoint 503 for a while): the worker stops claiming,
    # hands on what it holds, says so, and resumes by itself once /health answers.
    slow = start_simulator(SimConfig(seed=5, decode_tokens_per_s=100.0, length_median=60, length_p99=120))
    push(queue, 10, 2, prefix="later")
    worker = WorkerThread(settings(redis_url, namespace, [slow.url], max_attempts=3, backoff_s=0.01,
                                   engine_down_after=3, heartbeat_s=0.2))
    try:
        wait_for(lambda: audit(queue).inflight, what="a claim")
        http_json(slow.url + "/sim/restart", {"restart_s": 4.0})
        wait_for(lambda: worker.worker.state().startswith("engine-down: "), what="engine-down state")
        wait_for(lambda: json.loads(queue.redis.hget(queue.keys.worker_info, worker.worker.id))["state"]
                 .startswith("engine-down: "), what="engine-down in the heartbeat")
        wait_for(lambda: not audit(queue).inflight, what="the down worker's groups handed on")
        claims = queue.stats()["claims"]
        wait_for(lambda: queue.stats().get("released", 0) > 0, what="the requeued groups released")
        still_down = worker.worker.state().startswith("engine-down")
        assert queue.stats()["claims"] == claims or not still_down  # no claims while down
        got = consume_all(Consumer(queue.redis, namespace), 10, 5)
    finally:
        worker.stop()
        slow.stop()
    assert {g.group_id for g in got} == {f"later{i}" for i in range(10)}
    report = audit(queue)
    assert report.ok, report.summary()


def test_bad_request_is_dead_lettered_at_once(redis_url, queue, namespace):
    # A prompt longer than the engine's context is answered 400: not retried, dead-lettered
    # with the engine's message; the other groups are unaffected.
    small = start_simulator(SimConfig(seed=4, context_length=200, **FAST))
    queue.push_groups([Group.fresh("too-long", "x" * 500, 2)])
    push(queue, 3, 2)
    worker = WorkerThread(settings(redis_url, namespace, [small.url], sampling=SamplingSettings(max_new_tokens=32)))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 3, 3)
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1, what="the dead letter")
    finally:
        worker.stop()
        small.stop()
    assert len(got) == 3
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "too-long"
    assert dead.error.startswith("engine rejected the request") and "context" in dead.error
    assert worker.worker.counters.requests <= 3 * 2 + 2  # the bad one was sent once per sample, not retried
    assert audit(queue).ok


def test_a_group_continued_with_other_sampling_settings_starts_over(redis_url, namespace):
    """One sample's tokens must come from one distribution: a group a worker with other
    settings started is generated again from its prompt, and records the new settings."""
    from pipeline.types import SamplingRecord
    from workers.worker import Worker

    worker = Worker(settings(redis_url, namespace, ["http://127.0.0.1:9"],
                             sampling=SamplingSettings(max_new_tokens=128, temperature=0.7)))
    group = Group.fresh("g", "What is 1 + 1?", 2, label="2")
    worker.runner._stamp_sampling(group)
    assert group.sampling == SamplingRecord(0.7, 1.0, -1, 128, skip_special_tokens=True)
    group.prompt_ids = [1, 2]
    for s in group.samples:
        s.tokens, s.response_length, s.status, s.weight_versions = [1, 2, 3], 1, Status.ABORTED, ["0"]
    worker.runner._stamp_sampling(group)  # the same settings: continued as it is
    assert group.samples[0].tokens == [1, 2, 3]
    group.sampling = SamplingRecord(1.0, 1.0, -1, 128)
    worker.runner._stamp_sampling(group)
    assert [s.tokens for s in group.samples] == [[], []] and group.prompt_ids == []
    assert group.sampling == SamplingRecord(0.7, 1.0, -1, 128, skip_special_tokens=True)
