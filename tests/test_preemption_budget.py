"""Every sample's preemption budget (issue 31 item 5): an engine that aborts every request
after a token was never a fault, because "preemption or fault" was decided by local
progress alone. On the built-in path a sample ended only at max_new_tokens (hours at the
real beat) and its fragments were published as truncated; on the generate-function path
the function was called again and again, each call given the whole token budget (a
16-token budget grew without end). Now an abort counts as a preemption only when something
explains it (a pause, a drain, a weight update seen in the engine's version), each sample
has a budget of unexplained ones (count and time), and the function path keeps to the
token budget as the built-in one does. Real simulator over HTTP, real Redis."""
from __future__ import annotations

import aiohttp
import pytest

from engines.simulator import SimConfig, start_simulator
from pipeline.consumer import Consumer
from pipeline.types import Group, Status
from tests.helpers import WorkerThread, consume_all, wait_for
from workers.sample_budget import SampleBudget
from workers.tokenizer import ByteTokenizer
from workers.worker import SamplingSettings, WorkerSettings

CALLS: list[int] = []  # max_new_tokens of every call of one_turn


@pytest.fixture(autouse=True)
def short_beat(monkeypatch):
    """The beat before a preempted sample continues, shortened: these engines never pause."""
    from workers import group_run

    monkeypatch.setattr(group_run, "PREEMPTED_RETRY_S", 0.02)


@pytest.fixture
def storm():
    """An engine that aborts every request after one new token (nothing paused)."""
    handle = start_simulator(SimConfig(seed=5, decode_tokens_per_s=20000.0, length_median=200, length_p99=400,
                                       prefill_s=0.001, abort_rate=1.0, abort_after_tokens=1))
    CALLS.clear()
    yield handle
    handle.stop()


def _settings(redis_url, namespace, url, **kw) -> WorkerSettings:
    kw.setdefault("sampling", SamplingSettings(max_new_tokens=16))
    return WorkerSettings(redis_url=redis_url, engine_urls=[url], namespace=namespace, heartbeat_s=0.5,
                          max_attempts=2, backoff_s=0.01, engine_down_after=1000, **kw)


async def one_turn(args, sample, sampling_params):
    """slime's default generate in short: one engine call with the given sampling params;
    an aborted answer leaves the sample ABORTED with what it made."""
    CALLS.append(sampling_params["max_new_tokens"])
    if not sample.tokens:
        sample.tokens = ByteTokenizer().encode(sample.prompt)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={"input_ids": sample.tokens, "sampling_params": sampling_params,
                                           "return_logprob": True}) as r:
            out = await r.json()
    meta = out["meta_info"]
    pairs = meta["output_token_logprobs"]
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                  meta_info=meta, text=out["text"])
    finish = meta["finish_reason"]["type"]
    sample.status = type(sample.status)({"abort": "aborted", "length": "truncated"}.get(finish, "completed"))
    return sample


FUNCTION = "tests.test_preemption_budget:one_turn"


def _dead_letter_under_the_storm(redis_url, queue, namespace, url, **kw):
    """One group of one sample through a worker on the storming engine: its dead letter,
    which says the aborts were the engine's fault; nothing published."""
    queue.push_groups([Group.fresh("g0", "What is 1 + 1?", 1, label="2")])
    worker = WorkerThread(_settings(redis_url, namespace, url, max_preemptions=3, **kw))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1, timeout=20, what="the group dead-lettered")
    finally:
        worker.stop()
    [dead] = queue.read_stream(queue.keys.dead)
    assert "aborted" in dead.error and "nothing explained" in dead.error, dead.error
    assert queue.redis.xlen(queue.keys.results) == 0  # never published as truncated fragments
    return dead


def test_an_engine_that_aborts_after_every_token_is_a_fault_on_the_built_in_path(redis_url, queue, namespace,
                                                                                   storm):
    dead = _dead_letter_under_the_storm(redis_url, queue, namespace, storm.url)
    assert len(dead.decode().samples[0].weight_versions) < 16


def test_an_engine_that_aborts_after_every_token_is_a_fault_on_the_function_path(redis_url, queue, namespace,
                                                                                  storm):
    _dead_letter_under_the_storm(redis_url, queue, namespace, storm.url, generate_function=FUNCTION,
                                 sampling=SamplingSettings(max_new_tokens=100))
    assert len(CALLS) <= 3 + 2 + 1  # the budget, then max_attempts failures


def test_the_function_path_keeps_to_the_token_budget_across_aborts(redis_url, queue, namespace, storm):
    """Each call is given what is left of max_new_tokens, and a sample that reached it is
    truncated without another call, as on the built-in path (the function continues its
    partial sample: slime's --partial-rollout)."""
    queue.push_groups([Group.fresh("g0", "What is 1 + 1?", 1, label="2")])
    worker = WorkerThread(_settings(redis_url, namespace, storm.url, max_preemptions=1000,
                                    generate_function=FUNCTION, partial_rollout=True))
    try:
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1, timeout=60)
    finally:
        worker.stop()
    [s] = group.samples
    assert s.response_length == 16 and s.status == Status.TRUNCATED
    assert CALLS == list(range(16, 0, -1))


def test_an_abort_a_weight_update_explains_costs_nothing():
    """The primitive both paths use: the charges are refunded when the engine's version
    moves (slime's update pauses with abort, loads, continues: the next answer is newer)."""
    budget = SampleBudget(max_new_tokens=100, max_preemptions=2, preemption_s=600.0)
    budget.observe("3")
    assert budget.charge(progressed=True) is None and budget.charge(progressed=True) is None
    budget.observe("4")  # the next answer came from newer weights: both were the update's doing
    assert budget.charge(progressed=True) is None and budget.charge(progressed=True) is None
    assert "nothing explained" in budget.charge(progressed=True)
    stalled = SampleBudget(max_new_tokens=100, max_preemptions=10, preemption_s=600.0)
    assert stalled.charge(progressed=False) is None and "no token" in stalled.charge(progressed=False)
    timed = SampleBudget(max_new_tokens=100, max_preemptions=10, preemption_s=0.0)
    assert timed.charge(progressed=True) is None and "--preemption-budget" in timed.charge(progressed=True)
    assert SampleBudget(max_new_tokens=16, max_preemptions=1, preemption_s=1.0).tokens_left(10) == 6
