"""Rewards are user code, contained (issue 26): a reward cannot change what is trained,
cannot end the worker whatever it raises, and a hung one cannot starve the groups after
it. Real worker, real Redis, real HTTP to the simulator."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import workers.rewards as rewards_module
from engines.simulator import SimConfig, start_simulator
from pipeline.consumer import Consumer
from pipeline.ops.audit import audit
from pipeline.queue import Queue
from pipeline.types import Group, Sample, Status
from tests.helpers import WorkerThread, consume_all, wait_for
from workers.rewards import Reward, RewardError, extract_boxed, math_boxed
from workers.worker import SamplingSettings, WorkerConfigError, WorkerSettings

FAST = dict(decode_tokens_per_s=20000.0, length_median=24, length_p99=120, prefill_s=0.001)
ARGS = SimpleNamespace(reward_key=None)


@pytest.fixture
def sim():
    handle = start_simulator(SimConfig(seed=3, **FAST))
    yield handle
    handle.stop()


def settings(redis_url, namespace, sim, **kw) -> WorkerSettings:
    kw.setdefault("sampling", SamplingSettings(max_new_tokens=64))
    return WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace, heartbeat_s=0.5,
                          backoff_s=0.01, backoff_max_s=0.05, **kw)


def push(queue: Queue, prompts: dict[str, str], n_samples: int = 2) -> None:
    queue.push_groups([Group.fresh(gid, prompt, n_samples, label="5") for gid, prompt in prompts.items()])


def dead_errors(queue: Queue) -> dict[str, str]:
    return {e.group_id: e.error for e in queue.read_stream(queue.keys.dead, 1000)}


def results(queue: Queue) -> dict[str, Group]:
    return {g.group_id: g for g in (e.decode() for e in queue.read_stream(queue.keys.results, 1000))}


def test_a_reward_that_edits_its_samples_changes_nothing_that_is_trained(redis_url, queue, namespace, sim):
    def vandal(args, sample: Sample) -> float:
        sample.tokens[:] = [0] * len(sample.tokens)
        sample.rollout_log_probs = [0.0] * len(sample.rollout_log_probs or [])
        sample.loss_mask = [0] * sample.response_length
        sample.response = "vandalized"
        sample.status = Status.COMPLETED
        sample.metadata["rollout_segments"].append(999)
        return 1.0

    push(queue, {f"g{i}": f"What is {i} + 2?" for i in range(4)})
    worker = WorkerThread(settings(redis_url, namespace, sim), reward=Reward(vandal))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 4, 4)
    finally:
        worker.stop()
    for group in got:
        for s in group.samples:
            assert s.reward == 1.0 and s.response != "vandalized" and s.loss_mask is None
            assert s.tokens[:len(group.prompt_ids)] == group.prompt_ids and any(s.tokens)
            assert len(s.rollout_log_probs) == s.response_length and all(lp < 0 for lp in s.rollout_log_probs)
            assert sum(s.metadata["rollout_segments"]) == s.response_length
    assert audit(queue).ok


class NotAnException(BaseException):
    pass


async def fatal_when_asked(args, sample: Sample) -> float:
    kind = sample.prompt.split(":")[0]
    if kind == "exit":
        raise SystemExit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "base":
        raise NotAnException("odd")
    return 0.5


def sync_fatal_when_asked(args, sample: Sample) -> float:
    return asyncio.run(fatal_when_asked(args, sample))


@pytest.mark.parametrize("reward", [fatal_when_asked, sync_fatal_when_asked], ids=["async", "sync"])
def test_a_reward_raising_base_exceptions_fails_its_group_not_the_worker(reward, redis_url, queue, namespace, sim):
    prompts = {"exit": "exit: 1+1", "interrupt": "interrupt: 1+1", "base": "base: 1+1"}
    prompts |= {f"good{i}": f"good: {i}+1" for i in range(4)}
    push(queue, prompts)
    worker = WorkerThread(settings(redis_url, namespace, sim, max_attempts=2), reward=Reward(reward))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.results) + queue.redis.xlen(queue.keys.dead) == len(prompts),
                 timeout=60, what="every group published or dead-lettered")
        assert worker._thread.is_alive() and worker.error is None
    finally:
        worker.stop()
    dead = dead_errors(queue)
    assert sorted(dead) == ["base", "exit", "interrupt"]
    assert "reward failed 2 times" in dead["exit"] and "raised SystemExit(3)" in dead["exit"]
    assert "raised KeyboardInterrupt" in dead["interrupt"] and "raised NotAnException(odd)" in dead["base"]
    assert sorted(results(queue)) == [f"good{i}" for i in range(4)]
    assert audit(queue).ok


def test_hung_sync_rewards_do_not_starve_the_groups_after_them(redis_url, queue, namespace, sim):
    release = threading.Event()

    def judge(args, sample: Sample) -> float:
        if sample.prompt.startswith("hang"):
            release.wait()  # a judge stuck forever (until the test ends)
        return 1.0

    def settled() -> int:
        return queue.redis.xlen(queue.keys.results) + queue.redis.xlen(queue.keys.dead)

    reward = Reward(judge)
    worker = WorkerThread(settings(redis_url, namespace, sim, reward_threads=2, reward_timeout_s=1.0,
                                   max_attempts=1), reward=reward)
    try:
        push(queue, {f"hang{i}": f"hang {i}" for i in range(2)}, n_samples=1)  # as many as there are threads
        wait_for(lambda: settled() == 2, timeout=60, what="the hung groups dead-lettered")
        push(queue, {f"good{i}": f"good {i}" for i in range(6)})
        wait_for(lambda: settled() == 8, timeout=60, what="every later group published or dead-lettered")
    finally:
        worker.stop()
        release.set()
    dead = dead_errors(queue)
    assert sorted(dead) == ["hang0", "hang1"] and "(--reward-timeout); abandoned" in dead["hang0"]
    assert sorted(results(queue)) == [f"good{i}" for i in range(6)]  # the two stuck threads held no place
    assert reward.threads.abandoned == 2
    assert audit(queue).ok


def test_a_worker_whose_reward_keeps_hanging_stops_and_hands_back_instead_of_leaking_threads(
        redis_url, queue, namespace, sim):
    release = threading.Event()

    def judge(args, sample: Sample) -> float:
        release.wait()  # every call stuck (until the test ends)
        return 1.0

    reward = Reward(judge)
    worker = WorkerThread(settings(redis_url, namespace, sim, reward_threads=1, reward_timeout_s=0.5,
                                   max_attempts=1, concurrency_per_engine=1), reward=reward)
    try:
        push(queue, {f"hang{i}": f"hang {i}" for i in range(4)}, n_samples=1)
        wait_for(lambda: not worker._thread.is_alive(), timeout=60, what="the worker stopping on its own")
    finally:
        release.set()
    assert reward.threads.abandoned == reward.threads.max_hung == 2  # never a third stuck thread
    assert isinstance(worker.error, WorkerConfigError)
    assert "reward-hung" not in str(worker.error) and "the reward function hangs" in str(worker.error)
    assert "fix the reward function" in str(worker.error)
    dead = dead_errors(queue)
    assert sorted(dead) == ["hang0", "hang1"]  # the two abandoned calls' groups, each at its timeout
    assert queue.redis.llen(queue.keys.prompts) == 2
    assert queue.redis.xlen(queue.keys.results) == 0
    assert audit(queue).ok  # the group it held was handed back, not dead-lettered


@pytest.mark.timeout(120)  # quadratic would take hours here; linear takes milliseconds
def test_math_boxed_is_linear_in_a_degenerate_answer():
    degenerate = "\\boxed{" * 200_000 + "7"
    assert extract_boxed(degenerate) is None
    assert extract_boxed(degenerate + "}") == "7"
    assert extract_boxed("\\boxed{1} " + "\\boxed{{" * 100_000) == "1"


def test_math_boxed_runs_off_the_event_loop(monkeypatch):
    threads = []
    real = rewards_module.extract_boxed

    def recording(text):
        threads.append(threading.current_thread())
        return real(text)

    monkeypatch.setattr(rewards_module, "extract_boxed", recording)
    sample = Sample(prompt="q", response="\\boxed{5}", label="5")
    assert asyncio.run(Reward.from_path("math_boxed").score(ARGS, [sample])) == [1.0]
    assert threads and threads[0] is not threading.main_thread()


def test_a_5000_digit_boxed_answer_is_scored_not_refused():
    digits = "9" * 5000
    right = Sample(prompt="q", response=f"\\boxed{{{digits}}}", label=digits)
    wrong = Sample(prompt="q", response=f"\\boxed{{{digits[:-1]}8}}", label=digits)
    assert asyncio.run(Reward.from_path("math_boxed").score(ARGS, [right, wrong])) == [1.0, 0.0]
    assert math_boxed(ARGS, Sample(prompt="q", response=f"\\boxed{{{digits}.0}}", label=digits)) == 1.0
    with pytest.raises(RewardError, match="label is None"):  # a data error still is one
        asyncio.run(Reward.from_path("math_boxed").score(ARGS, [Sample(prompt="q", response="x")]))
