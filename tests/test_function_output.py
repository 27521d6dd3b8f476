"""What a generate function returns is the sample the reward scores and the trainer gets
(slime's rule), through a real worker, simulator and Redis: dict rewards with non-JSON-number
values, attributes the function set, partial samples only under --partial-rollout, prompts
rendered as slime's Dataset renders them, and output that is not this group's
dead-lettered naming the rule it broke."""
from __future__ import annotations

import asyncio

import pytest

from engines.simulator import SimConfig, start_simulator
from pipeline.consumer import Consumer
from pipeline.control import configure
from pipeline.controller import Controller
from pipeline.ops.audit import audit
from pipeline.types import Group, Status
from tests import generate_functions as fns
from tests.helpers import WorkerThread, consume_all, http_json, wait_for
from tests.test_generate_function import SLOW, push, settings, sim  # noqa: F401 - sim is a fixture
from workers.engine_set import EngineSet
from workers.sampling import SamplingSettings
from workers.tokenizer import ByteTokenizer
from workers.worker import WorkerSettings

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 4 + 5?"}]


@pytest.fixture(autouse=True)
def clean_records():
    fns.reset()
    fns.reset_data_model_records()
    fns.LONG_TURNS = False
    yield
    fns.LONG_TURNS = False


def dapo_score(sample, tool_calls: int) -> float:
    """dapo_like_reward's score, recomputed from what the trainer got."""
    return min(-0.6, -1.0 + (tool_calls - 2) / 2 * 0.1) + sum(sample.response_tokens) % 7 / 100


def test_a_dict_reward_with_non_numbers_and_the_attributes_the_function_set_reach_the_trainer(
        redis_url, queue, namespace, sim):
    """Failures 1 and 3: {"score", "acc": bool, "pred": str} was refused (every group retried
    and dead-lettered), and tool_call_count never reached the reward (-1.1, not -1.05)."""
    push(queue, ["What is 4 + 5?", "What is 1 + 2?"])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "counts_tool_calls",
                                   reward="tests.generate_functions:dapo_like_reward", reward_key="score"))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 2, 2)
    finally:
        worker.stop()
    for s in (s for g in got for s in g.samples):
        assert s.tool_call_count == fns.TURNS - 1 and s.payload_has_tools is True
        assert s.reward == {"score": pytest.approx(dapo_score(s, fns.TURNS - 1)), "acc": False, "pred": "5"}
        assert s.get_reward_value(type("Args", (), {"reward_key": "score"})) == s.reward["score"]
    assert queue.redis.xlen(queue.keys.dead) == 0
    report = audit(queue)
    assert report.ok and report.committed == 2, report.summary()


@pytest.mark.parametrize("partial_rollout", [False, True])
def test_an_aborted_sample_restarts_unless_partial_rollouts_were_asked_for(redis_url, queue, namespace,
                                                                           partial_rollout):
    """Failure 5: after a weight update aborted turn 2, search-r1's generate was called again
    with the partial sample and slime's append_response_tokens raised (4 of 16 groups dead)."""
    fns.LONG_TURNS = True
    slow = start_simulator(SimConfig(seed=4, **SLOW))
    engines = EngineSet([slow.url])
    loop = asyncio.new_event_loop()
    controller = Controller(queue, engines)
    function = "three_turns" if partial_rollout else "resets_like_search_r1"
    [gid] = push(queue, ["What is 4 + 5?"], n_samples=2)
    worker = WorkerThread(settings(redis_url, namespace, [slow.url], function, partial_rollout=partial_rollout,
                                   sampling=SamplingSettings(max_new_tokens=1200)))
    try:
        wait_for(fns.SECOND_CALL_SENT.is_set, what="a sample's second engine call")
        used = lambda: http_json(slow.url + "/sim/stats")["load"]["num_used_tokens"]  # noqa: E731
        start = used()
        wait_for(lambda: used() > start + 10, what="the second call generating")
        loop.run_until_complete(controller.pause("abort"))
        loop.run_until_complete(engines.update_weights_from_disk("/ckpt/step1", weight_version="1"))
        loop.run_until_complete(controller.resume(weight_version=1))
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
        restarted = worker.worker.counters.restarted
    finally:
        worker.stop()
        loop.run_until_complete(engines.close())
        loop.close()
        slow.stop()
    assert group.group_id == gid and queue.redis.xlen(queue.keys.dead) == 0
    aborted = [i for i in fns.ABORTED]
    assert aborted, "no sample was aborted by the weight update"
    for s in group.samples:
        assert s.tokens == fns.PRODUCED[s.index]["tokens"] and s.status == Status.COMPLETED
        if s.index not in aborted:
            continue
        if partial_rollout:  # handed back as it was left, and continued
            assert s.tokens[:len(fns.ABORTED[s.index]["tokens"])] == fns.ABORTED[s.index]["tokens"]
        else:  # a fresh sample: nothing the old weights wrote, and the function was told the truth
            [first, again] = fns.GIVEN[s.index]
            assert (again["tokens"], again["response_length"], again["status"]) == ([], 0, "pending")
            assert again["rollout_log_probs"] is None and again["weight_versions"] == []
            assert fns.PARTIAL_FLAGS[s.index] == [False, False] and s.weight_versions == ["1"] * fns.TURNS
    assert restarted == (0 if partial_rollout else len(aborted))
    report = audit(queue)
    assert report.ok and report.committed == 1, report.summary()


@pytest.mark.parametrize("prompt", [CHAT, "What is 4 + 5?"])
def test_under_apply_chat_template_the_function_and_the_reward_get_the_rendered_prompt(
        redis_url, queue, namespace, sim, prompt):
    """Failure 6: the function got the raw list of messages (retool embedded its repr)."""
    queue.push_groups([Group.fresh("g0", prompt, 2, label="9")])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "records_its_prompt", apply_chat_template=True,
                                   apply_chat_template_kwargs={"enable_thinking": False}))
    try:
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
    finally:
        worker.stop()
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    rendered = ByteTokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert [g[0]["prompt"] for g in fns.GIVEN.values()] == [rendered, rendered]
    assert [s.prompt for s in group.samples] == [rendered, rendered]  # as slime's trainer has it
    assert group.pushed_prompt == prompt


def test_under_apply_chat_template_the_built_in_path_sends_the_same_rendering(redis_url, queue, namespace, sim):
    queue.push_groups([Group.fresh("g0", CHAT, 1, label="9")])
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         heartbeat_s=0.5, apply_chat_template=True, reward="exact_match",
                                         sampling=SamplingSettings(max_new_tokens=64)))
    try:
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
    finally:
        worker.stop()
    rendered = ByteTokenizer().apply_chat_template(CHAT, add_generation_prompt=True)
    [s] = group.samples
    assert s.prompt == rendered and s.tokens[:len(s.tokens) - s.response_length] == list(rendered.encode())


def test_a_restarted_group_gets_its_pushed_prompt_back():
    group = Group.fresh("g0", CHAT, 2)
    for s in group.samples:
        s.prompt, s.tokens, s.response_length = "<rendered>", [1, 2], 1
    group.pushed_prompt = CHAT
    group.reset()
    assert [s.prompt for s in group.samples] == [CHAT, CHAT] and group.pushed_prompt is None


@pytest.mark.parametrize("function,n_groups,dead,error", [
    ("returns_one_object_twice", 1, ["g0"], "returned one sample object several times"),
    ("changes_the_prompt_of_odd_samples", 1, ["g0"],
     "returned sample 1 whose tokens before its response (14 ids) are not the prompt ids sample 0 of its group "
     "starts with (14 ids)"),
    ("returns_a_cached_sample", 2, ["g1"], "returned sample 0 of group_index 0 for a call made for sample 1 of "
                                           "group_index 1"),
])
def test_output_that_is_not_this_groups_is_dead_lettered_naming_the_rule(redis_url, queue, namespace, sim, function,
                                                                         n_groups, dead, error):
    """Failure 7: each of these was trained, with no dead letter."""
    # One sample per group for the cache: its first group is then the cache's own.
    ids = push(queue, [f"What is {i} + 5?" for i in range(n_groups)], n_samples=1 if n_groups > 1 else 2)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], function))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == len(dead), what="the bad groups dead-lettered")
        good = consume_all(Consumer(queue.redis, namespace), len(ids) - len(dead), 1) if len(ids) > len(dead) else []
        assert worker.worker.counters.function_errors >= 1
    finally:
        worker.stop()
    letters = queue.read_stream(queue.keys.dead)
    assert sorted(d.group_id for d in letters) == dead and all(error in d.error for d in letters), \
        [d.error for d in letters]
    assert sorted(g.group_id for g in good) == sorted(set(ids) - set(dead))
    report = audit(queue)
    assert report.ok and report.dead == len(dead), report.summary()


def test_a_task_the_function_left_running_cannot_change_what_was_scored_and_published(redis_url, queue, namespace,
                                                                                    sim):
    """Failure 7: a background task rewrote the tokens while the reward ran, and the
    reward was published for tokens it never scored."""
    push(queue, ["What is 4 + 5?", "What is 1 + 2?"])
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "rewrites_after_returning",
                                   reward="tests.generate_functions:token_sum_reward"))
    try:
        got = consume_all(Consumer(queue.redis, namespace), 2, 2)
        wait_for(lambda: all(t.done() for t in fns.BACKGROUND), what="the function's background tasks ran")
    finally:
        worker.stop()
    for s in (s for g in got for s in g.samples):
        assert s.reward == sum(s.response_tokens) % 7, "the reward did not score the published tokens"
        assert not hasattr(s, "tool_call_count") and s.tokens == fns.PRODUCED[s.index]["tokens"]


def test_a_function_that_blocks_its_event_loop_does_not_stop_the_heartbeat(redis_url, queue, namespace, sim):
    """retool's sandbox blocks its loop up to 120 s (subprocess.communicate): user code runs
    on a loop of its own, so the worker keeps renewing its lease and is never reaped."""
    lease_s = 1.2  # the shortest a namespace takes is the upkeep period (1 s)
    configure(queue.redis, queue.keys, lease_s=lease_s)
    push(queue, ["What is 4 + 5?"], n_samples=1)
    worker = WorkerThread(settings(redis_url, namespace, [sim.url], "blocks_its_loop", heartbeat_s=0.15))
    try:
        wait_for(fns.BLOCKING.is_set, what="the function blocking its loop")
        blocked_at, reaped = queue.now_ms(), []

        def three_leases_reaping() -> bool:  # a reaper at work all along, as a trainer waiting for a batch
            reaped.append(queue.reap_expired())
            return queue.now_ms() > blocked_at + 3 * lease_s * 1000

        wait_for(three_leases_reaping, what="three leases")
        assert sum(reaped) == 0, "the worker's lease ran out while user code blocked"
        fns.RELEASE.set()
        [group] = consume_all(Consumer(queue.redis, namespace), 1, 1)
        counters = worker.worker.counters
        assert (counters.reincarnations, counters.groups_lost, counters.groups_claimed) == (0, 0, 1)
    finally:
        fns.RELEASE.set()
        worker.stop()
    report = audit(queue)
    assert report.ok and report.committed == 1, report.summary()


@pytest.mark.parametrize("value,error", [("[1]", "expected a JSON object, got list"), ("{nope", "not JSON")])
def test_the_chat_template_options_must_be_a_json_object(run, value, error):
    result = run("worker", "--engine-url", "http://127.0.0.1:1", "--apply-chat-template-kwargs", value)
    assert result.exit_code == 2 and error in result.output, result.output
