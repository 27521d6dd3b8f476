"""User generate functions with slime's signature in the workers (--generate-function):
several engine calls per sample with tool output between, through push -> worker ->
trainer; preemption by a weight update mid-sample; functions that raise, hang, or return
junk dead-letter only their group."""
from __future__ import annotations

import asyncio
import re
import struct
from types import SimpleNamespace

import pytest

from engines.simulator import SimConfig, start_simulator
from pipeline.consumer import Consumer
from pipeline.controller import Controller
from pipeline.ops.audit import audit
from pipeline.keys import eval_namespace
from pipeline.queue import Queue
from pipeline.types import SEGMENTS_KEY, Group, Sample, Status
from pipeline.trainers.slime_types import slime_types
from pipeline.trainers.torch_adapter import batch_to_tensors
from tests import fake_slime
from tests import generate_functions as fns
from tests.helpers import WorkerThread, consume_all, http_json, wait_for
from workers.engine_set import EngineSet
from workers.worker import SamplingSettings, WorkerSettings

FAST = dict(decode_tokens_per_s=20000.0, length_median=24, length_p99=240, prefill_s=0.001)
# A call runs for about a second: a pause lands in the middle of one.
SLOW = dict(decode_tokens_per_s=200.0, length_median=200.0, length_p99=400.0, prefill_s=0.002)


@pytest.fixture(autouse=True)
def clean_records():
    fns.reset()
    fns.LONG_TURNS = False
    yield
    fns.LONG_TURNS = False


@pytest.fixture
def sim():
    handle = start_simulator(SimConfig(seed=3, **FAST))
    yield handle
    handle.stop()


def settings(redis_url, namespace, engine_urls, function, **kw) -> WorkerSettings:
    kw.setdefault("sampling", SamplingSettings(max_new_tokens=128))
    kw.setdefault("heartbeat_s", 0.5)
    return WorkerSettings(redis_url=redis_url, engine_urls=list(engine_urls), namespace=namespace,
                          generate_function=f"tests.generate_functions:{function}", **kw)


def push(queue: Queue, prompts: list[str], n_samples: int = 2) -> list[str]:
    groups = [Group.fresh(f"g{i}", p, n_samples, label="9", row=i) for i, p in enumerate(prompts)]
    queue.push_groups(groups)
    return [g.group_id for g in groups]


def float32(values: list[float]) -> list[float]:
    """Log-probs travel as float32 (the wire format): what the trainer gets of a float."""
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def tool_positions(sample: Sample) -> set[int]:
    """Response positions of the tool outputs three_turns put between its engine calls."""
    response = sample.response_tokens
    out: set[int] = set()
    for turn in range(1, fns.TURNS):
        tool = fns.tool_output(turn)
        for start in range(len(response) - len(tool) + 1):
            if response[start:start + len(tool)] == tool:
                out |= set(range(start, start + len(tool)))
    return out


def test_a_multi_turn_function_reaches_the_trainer_exactly_as_it_made_its_samples(redis_url, queue, namespace,
                                                                                 sim):
    ids = push(queue, [f"What is {i} + 2?" for i in range(4)])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "three_turns"))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 4, 2)
    finally:
        worker.stop()
    assert sorted(g.group_id for g in got) == sorted(ids)
    assert http_json(sim.url + "/sim/stats")["stats"]["submitted"] == 4 * 2 * fns.TURNS
    for group in got:
        for s in group.samples:
            made = fns.PRODUCED[s.index]
            assert s.tokens == made["tokens"] and s.response_length == made["response_length"]
            assert s.loss_mask == made["loss_mask"]
            assert s.rollout_log_probs == float32(made["rollout_log_probs"])
            assert s.weight_versions == made["weight_versions"] == ["default"] * fns.TURNS
            assert s.status == Status.COMPLETED and isinstance(s.reward, float)
            # tool output: loss mask 0, log-prob 0.0; everything the engine wrote: mask 1
            tools = tool_positions(s)
            assert len(tools) == sum(len(fns.tool_output(t)) for t in range(1, fns.TURNS))
            assert [i for i, m in enumerate(s.loss_mask) if m == 0] == sorted(tools)
            assert all(s.rollout_log_probs[i] == 0.0 for i in tools)
            assert sum(s.metadata[SEGMENTS_KEY]) == s.response_length
            assert fns.CALLS[s.index] == 1
    # the PyTorch adapter's tensors: the function's mask and log-probs at the response positions
    tensors = batch_to_tensors(got)
    for row, index in enumerate(tensors["sample_index"].tolist()):
        made = fns.PRODUCED[index]
        end, start = len(made["tokens"]), len(made["tokens"]) - made["response_length"]
        assert tensors["tokens"][row, :end].tolist() == made["tokens"]
        assert tensors["loss_mask"][row, start:end].tolist() == made["loss_mask"]
        assert tensors["loss_mask"][row, :start].sum() == 0
        assert tensors["rollout_log_probs"][row, start:end].tolist() == float32(made["rollout_log_probs"])
    report = audit(queue)
    assert report.ok and report.committed == 4, report.summary()


@pytest.mark.parametrize("mask_offpolicy", [False, True])
def test_under_partial_rollout_a_weight_update_mid_sample_requeues_it_and_the_function_continues_it(redis_url, queue, namespace,
                                                                             mask_offpolicy):
    fns.LONG_TURNS = True
    slow = start_simulator(SimConfig(seed=4, **SLOW))
    engines = EngineSet([slow.url])
    loop = asyncio.new_event_loop()
    controller = Controller(queue, engines)
    [gid] = push(queue, ["What is 4 + 5?"], n_samples=2)
    worker = WorkerThread(settings(redis_url, namespace, [slow.url], "three_turns", partial_rollout=True,
                                   mask_offpolicy_prefix=mask_offpolicy, sampling=SamplingSettings(max_new_tokens=1200)))
    try:
        wait_for(fns.SECOND_CALL_SENT.is_set, what="a sample's second engine call")
        used = lambda: http_json(slow.url + "/sim/stats")["load"]["num_used_tokens"]  # noqa: E731
        start = used()
        wait_for(lambda: used() > start + 10, what="the second call generating")
        pause = loop.run_until_complete(controller.pause("abort"))
        loop.run_until_complete(engines.update_weights_from_disk("/ckpt/step1", weight_version="1"))
        loop.run_until_complete(controller.resume(weight_version=1))
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
    finally:
        worker.stop()
        loop.run_until_complete(engines.close())
        loop.close()
        slow.stop()
    assert group.group_id == gid and pause.requeued == 1
    assert fns.ABORTED, "no sample was aborted by the pause"
    for s in group.samples:
        made = fns.PRODUCED[s.index]
        assert s.tokens == made["tokens"] and s.loss_mask == made["loss_mask"]
        assert s.rollout_log_probs == float32(made["rollout_log_probs"])
        assert s.weight_versions == made["weight_versions"]
        partial = fns.ABORTED.get(s.index)
        if partial is None:
            continue
        # nothing lost: what was generated before the pause is the start of what was trained on
        assert fns.CALLS[s.index] == 2
        assert s.tokens[:len(partial["tokens"])] == partial["tokens"]
        # --mask-offpolicy-prefix: what the old weights wrote is masked before the function continues
        assert s.loss_mask[:partial["response_length"]] == \
            ([0] * partial["response_length"] if mask_offpolicy else partial["loss_mask"])
        assert 1 in s.loss_mask[partial["response_length"]:]
        assert s.rollout_log_probs[:partial["response_length"]] == float32(partial["rollout_log_probs"])
        assert s.weight_versions[:len(partial["weight_versions"])] == partial["weight_versions"]
        assert partial["weight_versions"][-1] == "default" and s.weight_versions[-1] == "1"
        assert queue.stats().get("requeue", 0) >= 1
    report = audit(queue)
    assert report.ok and report.committed == 1, report.summary()


@pytest.mark.parametrize("prompt,error", [
    ("boom: What is 1 + 2?", "raised RuntimeError: boom in sample"),
    ("hang: What is 1 + 2?", "did not return within 1s (--sample-timeout)"),
    ("junk: What is 1 + 2?", "returned str 'not a sample', not a Sample or a list of Samples"),
])
def test_a_function_that_raises_hangs_or_returns_junk_dead_letters_only_its_group(redis_url, queue, namespace,
                                                                                   sim, prompt, error):
    push(queue, ["What is 1 + 1?", prompt, "What is 2 + 2?"])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "boom_or_three_turns", sample_timeout_s=1.0))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1, what="the bad group dead-lettered")
        got = consume_all(Consumer(queue.redis, namespace), 2, 2)
        assert worker.worker.counters.function_errors >= 1
    finally:
        worker.stop()
    assert sorted(g.group_id for g in got) == ["g0", "g2"]
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "g1" and error in dead.error, dead.error
    if "junk" not in prompt:  # the last frames: where it raised, or where it hung
        assert "generate_functions.py" in dead.error and "boom_or_three_turns" in dead.error, dead.error
    report = audit(queue)
    assert report.ok and report.committed == 2 and report.dead == 1, report.summary()


def test_a_function_may_turn_one_sample_into_several(redis_url, queue, namespace, sim):
    push(queue, ["What is 4 + 5?"])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "two_agents"))
    try:
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
    finally:
        worker.stop()
    assert [(s.index, s.rollout_id, s.metadata.get("agent", 1)) for s in group.samples] == \
        [(0, 0, 1), (0, 0, 2), (1, 1, 1), (1, 1, 2)]
    for s in group.samples:
        made = fns.PRODUCED[(s.index, s.metadata.get("agent", 1))]
        assert s.tokens == made["tokens"] and s.loss_mask == made["loss_mask"] and isinstance(s.reward, float)


def test_a_reward_the_function_set_is_not_scored_again(redis_url, queue, namespace, sim):
    push(queue, ["What is 4 + 5?"])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "sets_its_reward"))
    try:
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
    finally:
        worker.stop()
    assert [s.reward for s in group.samples] == [0.25, 0.25]


def test_the_function_gets_slimes_args_and_evaluation_flag(redis_url, queue, namespace, sim):
    push(queue, ["What is 4 + 5?"], n_samples=3)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "with_evaluation", max_context_len=4096))
    try:
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
    finally:
        worker.stop()
    host_port = sim.url.removeprefix("http://")
    for s in group.samples:
        assert s.metadata["evaluation"] is False
        assert s.metadata["args"] == {"router": host_port, "n_samples_per_prompt": 3,
                                      "rollout_max_response_len": 128, "hf_checkpoint": None,
                                      "rollout_max_context_len": 4096, "rollout_temperature": 1.0}


def test_append_response_tokens_keeps_masks_log_probs_versions_and_segments_aligned():
    s = Sample(tokens=[1, 2])
    meta = {"finish_reason": {"type": "stop"}, "weight_version": "3"}
    s.append_response_tokens(None, tokens=[5, 6], log_probs=[-0.5, -0.25], meta_info=meta, text="ab")
    s.append_response_tokens(None, tokens=[7, 8, 9], trainable=False, text="tool")
    s.append_response_tokens(None, tokens=[10], log_probs=[-1.0],
                             meta_info={"finish_reason": {"type": "abort"}, "weight_version": "4"})
    assert s.tokens == [1, 2, 5, 6, 7, 8, 9, 10] and s.response_length == 6 and s.response == "abtool"
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert s.weight_versions == ["3", "4"] and s.metadata[SEGMENTS_KEY] == [5, 1]
    assert s.status == Sample.Status.ABORTED == Status.ABORTED
    with pytest.raises(ValueError, match="require rollout log probabilities"):
        s.append_response_tokens(None, tokens=[1])


def test_the_calculator_example_runs_multi_turn_against_the_simulator(redis_url, queue, namespace):
    tool_sim = start_simulator(SimConfig(seed=5, tool_call_rate=0.5, **FAST))
    queue.push_groups([Group.fresh(f"g{i}", f"What is {i} * 3?", 4, label=str(i * 3), row=i) for i in range(6)])
    worker = WorkerThread(WorkerSettings(
        redis_url=redis_url, engine_urls=[tool_sim.url], namespace=namespace, heartbeat_s=0.5,
        sampling=SamplingSettings(max_new_tokens=256), generate_function="examples.calculator_tools:generate",
        reward="examples.calculator_tools:reward"))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 6, 3)
    finally:
        worker.stop()
        tool_sim.stop()
    samples = [s for g in got for s in g.samples]
    with_tool = [s for s in samples if s.metadata["tool_turns"] > 1]
    assert with_tool and len(with_tool) < len(samples)  # some called the calculator, some answered at once
    for s in samples:
        text = bytes(t for t in s.response_tokens if t < 256).decode()  # 256: EOS
        # the calculator's output, and only it, is masked out of the loss
        masked = bytes(t for t, m in zip(s.response_tokens, s.loss_mask) if m == 0).decode()
        assert masked == "".join(re.findall(r"<result>.*?</result>\n", text))
        assert len(s.weight_versions) == s.metadata["tool_turns"]
        assert s.reward in (0.0, 1.0)
    # the simulated model copies the calculator's result: every sample that used it and answered is right
    answered = [s for s in with_tool if s.status == Status.COMPLETED]
    assert answered and all(s.reward == 1.0 for s in answered)


def test_a_slime_function_gets_slimes_sample_and_unrecorded_versions_are_stamped(redis_url, queue, namespace, sim,
                                                                                 monkeypatch):
    fake_slime.install(monkeypatch)
    slime_types.cache_clear()
    http_json(sim.url + "/update_weight_version", {"new_version": "7", "abort_all_requests": True})
    push(queue, ["What is 4 + 5?"])
    try:
        worker = WorkerThread(settings(redis_url, namespace, [sim.url], "search_r1_style"))
        try:
            [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
        finally:
            worker.stop()
        http_client_args = fake_slime.HttpUtils.client_args
    finally:
        monkeypatch.undo()
        slime_types.cache_clear()
    for s in group.samples:
        made = fns.PRODUCED[s.index]
        assert s.tokens == made["tokens"] and s.loss_mask == made["loss_mask"] and 0 in s.loss_mask
        assert s.rollout_log_probs == float32(made["rollout_log_probs"])
        assert made["weight_versions"] == [] and s.weight_versions == ["7"]  # from the engine
        assert s.status == Status.COMPLETED
    assert http_client_args.rollout_num_engines == 1  # slime's post was made ready (init_http_client)


def test_the_generate_function_can_come_from_the_environment(run, monkeypatch):
    monkeypatch.setenv("ROLLOUT_GENERATE_FUNCTION", "tests.no_such:generate")
    result = run("worker", "--engine-url", "http://127.0.0.1:1")
    assert result.exit_code == 2 and "generate function path 'tests.no_such:generate'" in result.output


def test_the_calculator_example_runs_against_the_torch_engine(redis_url, queue, namespace):
    """A real model's answers (an untrained byte model: it never writes a tool call, so
    one turn per sample): tokens, log-probs and versions as the engine gave them."""
    torch = pytest.importorskip("torch")
    from engines.byte_lm import ModelConfig
    from engines.torch_engine import TorchEngineConfig, start_torch_engine

    torch.set_num_threads(1)
    queue.push_groups([Group.fresh("g0", "What is 1 + 2?", 2, label="3")])
    with start_torch_engine(TorchEngineConfig(seed=0, model=ModelConfig(context_length=128),
                                              max_running_requests=4)) as engine:
        worker = WorkerThread(WorkerSettings(
            redis_url=redis_url, engine_urls=[engine.url], namespace=namespace, heartbeat_s=0.5,
            sampling=SamplingSettings(max_new_tokens=24), generate_function="examples.calculator_tools:generate",
            reward="examples.calculator_tools:reward"))
        try:
            [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
        finally:
            worker.stop()
    for s in group.samples:
        assert s.tokens[:14] == list(b"What is 1 + 2?") and 0 < s.response_length <= 24
        assert s.metadata["tool_turns"] == 1 and s.loss_mask == [1] * s.response_length
        assert len(s.rollout_log_probs) == s.response_length and all(lp <= 0 for lp in s.rollout_log_probs)
        assert s.weight_versions == [s.weight_versions[0]] and s.reward == 0.0


def test_the_slime_adapter_hands_slime_the_functions_samples(redis_url, queue, namespace, sim, monkeypatch):
    from pipeline.trainers import slime_adapter

    push(queue, ["What is 1 + 1?", "What is 2 + 2?"])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "three_turns"))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.results) == 2, what="both groups published")
    finally:
        worker.stop()
    fake_slime.install(monkeypatch)
    slime_types.cache_clear()
    try:
        out = slime_adapter.generate_rollout(SimpleNamespace(
            rollout_batch_size=2, n_samples_per_prompt=2, rollout_redis_url=redis_url, rollout_namespace=namespace,
            reward_key=None), 0, data_source=None)
    finally:
        monkeypatch.undo()
        slime_types.cache_clear()
    samples = [s for group in out.samples for s in group]
    assert len(samples) == 4
    for s in samples:
        made = fns.PRODUCED[s.index]
        assert isinstance(s, fake_slime.Sample) and s.status is fake_slime.Sample.Status.COMPLETED
        assert (s.tokens, s.loss_mask, s.weight_versions) == (made["tokens"], made["loss_mask"],
                                                              made["weight_versions"])
        assert s.rollout_log_probs == float32(made["rollout_log_probs"]) and 0 in s.loss_mask


def test_a_function_past_its_timeout_releases_its_engine_slot(redis_url, queue, namespace):
    # 2,000 tokens at 20 tokens/s: unreleased, the request would outlast every wait below
    slow = start_simulator(SimConfig(seed=6, **dict(SLOW, decode_tokens_per_s=20.0)))
    running = lambda: http_json(slow.url + "/sim/stats")["load"]["num_running_reqs"]  # noqa: E731
    push(queue, ["What is 1 + 1?"], n_samples=1)
    worker = WorkerThread(settings(redis_url, namespace, [slow.url], "one_long_call", sample_timeout_s=2.0,
                                   sampling=SamplingSettings(max_new_tokens=2000)))
    try:
        wait_for(lambda: running() == 1, what="the function's request decoding")
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1, what="the group dead-lettered")
        wait_for(lambda: running() == 0, what="the engine slot released")  # the function's request was dropped
    finally:
        worker.stop()
        slow.stop()
    [dead] = queue.read_stream(queue.keys.dead)
    assert "did not return within 2s" in dead.error and "one_long_call" in dead.error


def test_eval_passes_call_the_function_with_evaluation_true(redis_url, queue, namespace, sim):
    evals = Queue(queue.redis, eval_namespace(namespace))
    evals.push_groups([Group.fresh("e0", "What is 4 + 5?", 2, label="9")])
    push(queue, ["What is 1 + 1?"])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "with_evaluation"))
    try:
        [trained] = consume_all(Consumer(queue.redis, namespace), 1, 1)
        [evaluated] = consume_all(Consumer(queue.redis, evals.keys.namespace), 1, 1)
    finally:
        worker.stop()
    assert [s.metadata["evaluation"] for s in evaluated.samples] == [True, True]
    assert [s.metadata["evaluation"] for s in trained.samples] == [False, False]


def test_under_partial_rollout_an_unannounced_abort_all_mid_sample_is_a_preemption_and_the_function_continues(redis_url, queue,
                                                                                         namespace):
    """slime ends each rollout with abort_all, without telling the queue: the aborted
    sample made progress, so the function is called again with it (no pause, no requeue)."""
    fns.LONG_TURNS = True
    slow = start_simulator(SimConfig(seed=7, **SLOW))
    push(queue, ["What is 4 + 5?"], n_samples=1)
    worker = WorkerThread(settings(redis_url, namespace, [slow.url], "three_turns", partial_rollout=True,
                                   sampling=SamplingSettings(max_new_tokens=1200)))
    try:
        wait_for(fns.SECOND_CALL_SENT.is_set, what="the second engine call")
        used = lambda: http_json(slow.url + "/sim/stats")["load"]["num_used_tokens"]  # noqa: E731
        start = used()
        wait_for(lambda: used() > start + 10, what="the second call generating")
        http_json(slow.url + "/abort_request", {"abort_all": True})
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
        assert worker.worker.counters.preempted >= 1
    finally:
        worker.stop()
        slow.stop()
    [s] = group.samples
    partial = fns.ABORTED[s.index]
    assert fns.CALLS[s.index] == 2 and s.tokens[:len(partial["tokens"])] == partial["tokens"]
    assert s.tokens == fns.PRODUCED[s.index]["tokens"] and queue.stats().get("requeue", 0) == 0
    assert queue.redis.xlen(queue.keys.dead) == 0


def test_a_multi_turn_sample_holds_one_slot_across_its_turns(redis_url, queue, namespace, sim):
    """--concurrency counts samples: with 2 slots, never more than 2 calls run at once,
    tool time included, whatever number of engine requests each makes."""
    push(queue, [f"What is {i} + 1?" for i in range(6)], n_samples=1)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "counting_turns", concurrency_per_engine=2))
    try:
        consume_all(Consumer(queue.redis, namespace), 6, 3)
    finally:
        worker.stop()
    assert 1 <= fns.ACTIVE["max"] <= 2
    assert http_json(sim.url + "/sim/stats")["stats"]["submitted"] == 6 * fns.TURNS
