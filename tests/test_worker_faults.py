"""The worker under the faults that used to lose, strand or duplicate work (issue 8, 15):
a task that dies without publishing, a claim whose reply is lost or whose connection
drops, a stall past the lease, slow and hung rewards, request timeouts, groups larger
than the capacity, engines that answer `abort` for no reason, and a reward that kills
every worker that scores one particular prompt."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from aiohttp import web

from pipeline.ops.audit import audit
from pipeline.consumer import Consumer
from pipeline.control import configure
from pipeline.queue import Queue
from pipeline.types import Group
from tests.groups import assert_audit_ok
from tests.helpers import WorkerThread, consume_all, http_json, wait_for
from workers.rewards import Reward
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings

REPO = Path(__file__).resolve().parent.parent
FAST = dict(decode_tokens_per_s=20000.0, length_median=24, length_p99=120, prefill_s=0.001)


@pytest.fixture
def sim():
    handle = start_simulator(SimConfig(seed=11, **FAST))
    yield handle
    handle.stop()


def settings(redis_url, namespace, engine_urls, **kw) -> WorkerSettings:
    kw.setdefault("sampling", SamplingSettings(max_new_tokens=64))
    kw.setdefault("heartbeat_s", 0.2)
    return WorkerSettings(redis_url=redis_url, engine_urls=list(engine_urls), namespace=namespace, **kw)


def push(queue: Queue, n: int, samples: int = 2, prefix: str = "g", prompt: str = "What is {i} + 1?") -> list[str]:
    groups = [Group.fresh(f"{prefix}{i}", prompt.format(i=i), samples, label=str(i + 1), row=i) for i in range(n)]
    queue.push_groups(groups)
    return [g.group_id for g in groups]


def settled(queue: Queue, n: int) -> bool:
    """Every one of n pushed groups is in results or dead letters, none in flight or queued."""
    r = audit(queue)
    return r.ok and r.results_undelivered + r.results_pending + r.dead + r.committed == n and not r.inflight


# -- a task that cannot publish -------------------------------------------------------


def test_a_reward_value_that_cannot_be_stored_strands_nothing(redis_url, queue, namespace, sim):
    """Issue 8 #3 (r6): numpy values in a dict reward. Whatever the reward layer makes of
    them, the group ends in results or dead letters, never held by a live worker."""
    np = pytest.importorskip("numpy")

    async def judge(args, sample):
        return {"score": np.float32(1.0), "format": np.float32(0.5)}

    push(queue, 3)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], reward_key="score"), reward=Reward(judge))
    try:
        wait_for(lambda: settled(queue, 3), what="every group published or dead-lettered")
    finally:
        worker.stop()


def test_a_task_that_dies_without_publishing_is_reconciled(redis_url, queue, namespace, sim, monkeypatch):
    """Issue 8 #3: the publish and its fallback dead letter both fail (a bug, a Redis
    error). The group stays held in Redis with no task; the next reconciliation gives it
    back, and a group that keeps doing it reaches max_claims."""
    configure(queue.redis, queue.keys, max_claims=3)
    push(queue, 2)
    real = Queue.publish_many

    def broken(self, worker, items):
        if any(it.group_id == "g0" for it in items):
            raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")  # a bug: not transient
        return real(self, worker, items)

    monkeypatch.setattr(Queue, "publish_many", broken)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url]))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1 and queue.redis.xlen(queue.keys.results) == 1,
                 what="g1 published, g0 dead after max_claims")
        assert worker.worker.counters.handed_back >= 3
    finally:
        worker.stop()
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "g0" and dead.error.startswith("claimed 3 times without finishing")
    assert "(reconciled)" in dead.error
    assert_audit_ok(queue)


def test_a_group_redis_no_longer_gives_this_worker_is_cancelled(redis_url, queue, namespace):
    """Reconciliation, the other way: a task whose claim is gone from Redis stops."""
    slow = start_simulator(SimConfig(seed=12, decode_tokens_per_s=20.0, length_median=400, length_p99=500))
    push(queue, 1)
    worker = WorkerThread(settings(redis_url, namespace, [slow.url]))
    try:
        wait_for(lambda: worker.worker.runner.running, what="a task")
        queue.redis.delete(queue.keys.inflight(worker.worker.id))  # an operator, a bug, a split brain
        queue.redis.rpush(queue.keys.prompts, "g0")
        wait_for(lambda: worker.worker.counters.cancelled >= 1, what="the task cancelled")
    finally:
        worker.stop()
        slow.stop()


# -- Redis trouble at the claim ---------------------------------------------------------


def test_a_failed_claim_round_trip_does_not_end_the_worker(redis_url, queue, namespace, sim, monkeypatch):
    """Issue 8 #4 (r9): one ConnectionError in the claim loop used to end the worker."""
    push(queue, 20)
    real, calls = Queue.claim, {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise redis.ConnectionError("Connection reset by peer")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Queue, "claim", flaky)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], concurrency_per_engine=8))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 20, 5)
    finally:
        worker.stop()
    assert len({g.group_id for g in got}) == 20 and worker.worker.reconnect.outages >= 1
    assert_audit_ok(queue)


def test_a_lost_claim_reply_strands_nothing(redis_url, queue, namespace, sim):
    """Issue 8 #4 (r5): the claim ran, its reply was lost; the worker's retry presents the
    same claim id and gets the same groups."""
    push(queue, 10)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], concurrency_per_engine=4))
    real = worker.worker.queue._scripts["claim"]
    lost = {"n": 2}

    def claim(*args, **kwargs):
        reply = real(*args, **kwargs)
        if lost["n"] and reply[2:]:
            lost["n"] -= 1
            raise redis.ConnectionError("reply lost")
        return reply

    worker.worker.queue._scripts["claim"] = claim
    try:
        got = consume_all(Consumer(queue.redis, namespace), 10, 5)
    finally:
        worker.stop()
    assert not lost["n"] and sorted(g.group_id for g in got) == sorted(f"g{i}" for i in range(10))
    assert worker.worker.counters.handed_back == 0  # nothing was left behind to reconcile
    assert_audit_ok(queue)


# -- a stall past the lease -------------------------------------------------------------


def test_a_reaped_worker_cancels_its_work_and_registers_anew(redis_url, queue, namespace):
    """Issue 8 #5 (r4): presumed dead while it stalled, the worker learns so at its next
    heartbeat, cancels every task, and comes back as a new incarnation; every group is
    trained exactly once."""
    slow = start_simulator(SimConfig(seed=13, decode_tokens_per_s=200.0, length_median=100, length_p99=200))
    push(queue, 8)
    worker = WorkerThread(settings(redis_url, namespace, [slow.url], concurrency_per_engine=8))
    try:
        wait_for(lambda: len(worker.worker.runner.running) == 4, what="4 groups in flight")
        first = worker.worker.id
        queue.redis.zadd(queue.keys.workers, {first: 0}, xx=True)  # a stall past the lease...
        assert queue.reap(first) == 4  # ...and another worker reaped it
        wait_for(lambda: worker.worker.id != first, what="the worker registered anew")
        assert worker.worker.id == first.replace("#1", "#2") and worker.worker.counters.reincarnations == 1
        got = consume_all(Consumer(queue.redis, namespace), 8, 4)
    finally:
        worker.stop()
        slow.stop()
    trained = [g.group_id for g in got]
    assert len(trained) == len(set(trained)) == 8
    assert worker.worker.counters.cancelled >= 4
    report = assert_audit_ok(queue)
    assert report.committed == 8 and queue.stats()["reaped"] == 4


def test_a_worker_that_learns_twice_at_once_that_it_was_reaped_registers_anew_once(redis_url, queue, namespace,
                                                                                     sim):
    """Found by `rollout chaos`: a worker continued after a SIGSTOP past its lease learned
    it was reaped from its claim, its heartbeat and its control listener at once, and
    registered anew three times (#2, #3, #4), leaving two abandoned ids listed as live."""
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], heartbeat_s=10.0))
    w, first = worker.worker, worker.worker.id

    async def reaped_then_two_heartbeats():
        # Blocking calls in the worker's own loop: nothing of it runs in between.
        queue.redis.zadd(queue.keys.workers, {first: 0}, xx=True)
        assert queue.reap(first) == 0
        await asyncio.gather(w.liveness.heartbeat(), w.liveness.heartbeat())

    try:
        asyncio.run_coroutine_threadsafe(reaped_then_two_heartbeats(), worker._loop).result(30)
        assert (w.id, w.counters.reincarnations) == (first.replace("#1", "#2"), 1)
        assert list(queue.workers()) == [w.id]
    finally:
        worker.stop()
    assert_audit_ok(queue)


def test_a_purge_under_a_running_worker_is_not_called_a_reap(redis_url, queue, namespace, sim, caplog):
    """`rollout purge` deletes the worker's registration with the rest: it registers anew,
    saying its registration was deleted (not that it was reaped, which nobody did), and
    that the namespace's lease went back to the default with the settings."""
    import logging

    from pipeline.ops.admin import purge

    configure(queue.redis, queue.keys, lease_s=10)
    caplog.set_level(logging.INFO, logger="workers.worker")
    worker = WorkerThread(settings(redis_url, namespace, [sim.url]))
    try:
        first = worker.worker.id
        assert worker.worker.lease_s == 10
        purge(queue.redis, namespace)
        wait_for(lambda: worker.worker.id != first and worker.worker.id in queue.workers(),
                 what="the worker registered anew")
    finally:
        worker.stop()
    said = caplog.text
    assert "was reaped" not in said
    assert f"worker {first}: its registration was deleted without a reap" in said
    assert "the namespace's lease is now 30s (was 10s)" in said


# -- rewards ----------------------------------------------------------------------------


@pytest.mark.slow
def test_slow_sync_rewards_do_not_starve_heartbeats(redis_url, queue, namespace, sim):
    """Issue 8 #6 (r8): 0.3 s sync judges on every sample of 12 groups of 8 (far more
    calls than threads) must not delay a heartbeat past a 1.5 s lease."""
    from tests.reward_fixtures import slow_judge

    configure(queue.redis, queue.keys, lease_s=1.5)
    push(queue, 12, samples=8)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], heartbeat_s=0.25, concurrency_per_engine=96,
                                   reward_threads=4), reward=Reward(slow_judge))
    other = Queue(queue.redis, namespace)  # another worker's reaper
    latest = 0.0
    try:
        while queue.redis.xlen(queue.keys.results) < 12:
            other.reap_expired()
            deadline = queue.redis.zscore(queue.keys.workers, worker.worker.id)
            assert deadline is not None, "the live worker was reaped"
            latest = max(latest, (queue.now_ms() - (deadline - 1500)) / 1000)  # seconds since its heartbeat
            time.sleep(0.05)
    finally:
        worker.stop()
    assert latest < 1.5 and queue.stats().get("reaped", 0) == 0 and worker.worker.counters.groups_lost == 0


def test_a_hung_reward_times_out_and_the_group_is_dead_lettered(redis_url, queue, namespace, sim):
    async def judge(args, sample):
        if sample.label == "1":  # g0
            await asyncio.Event().wait()
        return 1.0

    push(queue, 3)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], reward_timeout_s=0.3, max_attempts=2,
                                   backoff_s=0.01), reward=Reward(judge))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 2, 2)
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1, what="g0 dead-lettered")
    finally:
        worker.stop()
    assert sorted(g.group_id for g in got) == ["g1", "g2"]
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "g0" and "reward took longer than 0.3s (--reward-timeout)" in dead.error


@pytest.mark.slow
def test_sigterm_ends_a_worker_whose_sync_reward_hangs(redis_url, queue, namespace, sim, tmp_path):
    push(queue, 2)
    env = dict(os.environ, PYTHONPATH=str(REPO), ROLLOUT_REDIS_URL=redis_url, ROLLOUT_NAMESPACE=namespace)
    proc = subprocess.Popen([sys.executable, "-m", "cli", "worker", "--engine-url", sim.url, "--max-new-tokens", "32",
                             "--reward", "tests.reward_fixtures.hang_forever", "--reward-timeout", "600"],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: audit(queue).inflight, what="groups claimed (their rewards hang)")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    report = assert_audit_ok(queue)
    assert report.prompts == 2  # handed back on the way out


# -- engines ----------------------------------------------------------------------------


def test_each_attempt_has_its_own_request_id_and_timeouts_abort_on_the_engine(redis_url, queue, namespace):
    """Issue 8 #8: a retry after a client timeout must not reuse the request id the engine
    still holds (SGLang answers 400 "Duplicate request ID", which used to dead-letter the
    group as a bad request), and the timed-out request is aborted on the engine."""
    slow = start_simulator(SimConfig(seed=14, decode_tokens_per_s=50.0, length_median=400, length_p99=500))
    push(queue, 1, samples=1)
    worker = WorkerThread(settings(redis_url, namespace, [slow.url], request_timeout_s=0.5, max_attempts=3,
                                   backoff_s=0.01, sampling=SamplingSettings(max_new_tokens=400)))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1, what="the group dead-lettered")
        stats = http_json(slow.url + "/sim/stats")["stats"]
    finally:
        worker.stop()
        slow.stop()
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.error.startswith("engine failed 3 times") and "Duplicate" not in dead.error
    assert stats.get("aborted", 0) >= 2  # each timed-out attempt was aborted on the engine


def test_a_group_larger_than_the_capacity_is_still_generated(redis_url, queue, namespace, sim):
    """Issue 8 #10: 16 samples with 8 slots: claimed alone, not stalled forever."""
    push(queue, 3, samples=16)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], concurrency_per_engine=8))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 3, 1)
    finally:
        worker.stop()
    assert [g.n_samples for g in got] == [16, 16, 16]


class AbortingEngine:
    """An SGLang-shaped server whose /generate always answers `abort` with no tokens,
    although nothing is paused."""

    def __init__(self):
        self.calls = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _serve(self):
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.calls += 1
            return web.json_response({"text": "", "meta_info": {
                "id": body.get("rid"), "finish_reason": {"type": "abort", "message": "Aborted by the scheduler"},
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": 0, "output_token_logprobs": [],
                "weight_version": "default"}})

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="")

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()


def test_an_engine_that_aborts_while_nothing_is_paused_is_failing(redis_url, queue, namespace):
    """Issue 15: an `abort` answer with no pause behind it is an engine error (it counts
    towards the group's attempts and the breaker), not a requeue that bounces forever."""
    engine = AbortingEngine()
    push(queue, 1)
    worker = WorkerThread(settings(redis_url, namespace, [engine.url], max_attempts=3, backoff_s=0.01,
                                   engine_down_after=1000))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1, what="the group dead-lettered")
    finally:
        worker.stop()
    [dead] = queue.read_stream(queue.keys.dead)
    assert "engine failed 3 times" in dead.error and "while nothing was paused" in dead.error
    assert queue.stats().get("requeue", 0) == 0
    # With the breaker on, the worker says why it stopped.
    push(queue, 1, prefix="b")
    worker = WorkerThread(settings(redis_url, namespace, [engine.url], engine_down_after=2, backoff_s=0.01))
    try:
        wait_for(lambda: worker.worker.state().startswith("engine-down: engine aborted request"),
                 what="engine-down, with the reason")
    finally:
        worker.stop()


# -- a group that kills its workers (issue 15) -------------------------------------------


@pytest.mark.slow
def test_a_group_that_kills_every_worker_is_dead_lettered_after_max_claims(redis_url, queue, namespace, sim,
                                                                              tmp_path):
    """A reward that calls os._exit(1) on one prompt, worker processes restarted by a
    supervising loop: that group is dead-lettered after max_claims deaths with the workers
    that held it; every other group is trained; the audit is clean."""
    configure(queue.redis, queue.keys, max_claims=3, lease_s=1.5)
    push(queue, 6)
    queue.push_groups([Group.fresh("poison", "What is poison + 1?", 2, label="1", row=99)])
    env = dict(os.environ, PYTHONPATH=str(REPO), ROLLOUT_REDIS_URL=redis_url, ROLLOUT_NAMESPACE=namespace)
    cmd = [sys.executable, "-m", "cli", "worker", "--engine-url", sim.url, "--max-new-tokens", "32",
           "--heartbeat", "0.3", "--reward", "tests.reward_fixtures.exit_on_poison"]
    deaths = 0
    consumer = Consumer(queue.redis, namespace, block_s=0.1)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while queue.redis.xlen(queue.keys.dead) == 0:
            assert time.monotonic() < deadline, f"no dead letter after {deaths} worker deaths"
            if proc.poll() is not None:  # the supervisor restarts what died
                deaths += 1
                proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
            queue.reap_expired()  # (the trainer does this too; here the test plays it)
            time.sleep(0.05)
        got = consume_all(consumer, 6, 3)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert sorted(g.group_id for g in got) == [f"g{i}" for i in range(6)]
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "poison" and deaths == 3
    assert dead.error.startswith("claimed 3 times without finishing; held by ")
    assert dead.error.count("(reaped)") == 3
    report = assert_audit_ok(queue)
    assert report.committed == 6 and report.dead == 1
