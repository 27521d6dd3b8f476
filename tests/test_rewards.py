"""Reward loading, validation, built-ins (exact_match, math_boxed, remote_rm)."""
from __future__ import annotations

import asyncio
import math
import threading
from types import SimpleNamespace

import pytest
from aiohttp import web

from pipeline.types import Sample
from workers.rewards import (
    Reward,
    RewardError,
    extract_boxed,
    load_reward,
    math_boxed,
    math_equal,
    normalize_answer,
    validate_reward,
)


def make_group(responses: list[str], label: str | None = "42", prompt: str = "What is 6*7?") -> list[Sample]:
    return [
        Sample(group_index=3, index=10 + i, prompt=prompt, label=label, response=r)
        for i, r in enumerate(responses)
    ]


ARGS = SimpleNamespace(rm_url=None, reward_key=None)


def run(coro):
    return asyncio.run(coro)


# ----------------------------------------------------------------------------- reward functions
# used through dotted paths: tests is a package, so "tests.test_rewards.<name>" imports


CONCURRENCY = {"now": 0, "max": 0}


async def async_len_reward(args, sample):
    CONCURRENCY["now"] += 1
    CONCURRENCY["max"] = max(CONCURRENCY["max"], CONCURRENCY["now"])
    try:
        await asyncio.sleep(0.01)
        return len(sample.response)
    finally:
        CONCURRENCY["now"] -= 1


def sync_upper_reward(args, sample):
    return 1.0 if sample.response.isupper() else 0.0


async def dict_reward(args, sample):
    return {"acc": 1.0, "format": 0.5}


async def raising_reward(args, sample):
    if sample.index == 11:
        raise ValueError("judge exploded on purpose")
    return 1.0


async def group_rank_reward(args, samples):
    # rank by length: a reward that only makes sense per group
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
    ranks = [0.0] * len(samples)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def sync_group_reward(args, samples):
    return [1.0 for _ in samples]


async def short_group_reward(args, samples):
    return [1.0]


async def nan_reward(args, sample):
    return float("nan")


async def bool_reward(args, sample):
    return True


async def str_reward(args, sample):
    return "1.0"


NOT_CALLABLE = 3


# ----------------------------------------------------------------------------- load_reward


def test_load_builtin_names():
    for name in ("exact_match", "math_boxed", "remote_rm"):
        assert callable(load_reward(name))


@pytest.mark.parametrize(
    "path", ["tests.test_rewards.async_len_reward", "tests.test_rewards:async_len_reward"]
)
def test_load_dotted_and_colon_paths(path):
    assert load_reward(path) is async_len_reward


def test_load_missing_module_names_path():
    with pytest.raises(ValueError, match="no_such_pkg.mod.fn"):
        load_reward("no_such_pkg.mod.fn")


def test_load_missing_attribute_names_path():
    with pytest.raises(ValueError, match=r"tests\.test_rewards\.does_not_exist.*no attribute"):
        load_reward("tests.test_rewards.does_not_exist")


def test_load_not_callable():
    with pytest.raises(ValueError, match="not callable"):
        load_reward("tests.test_rewards:NOT_CALLABLE")


def test_load_bare_unknown_name():
    with pytest.raises(ValueError, match="'nope'.*neither a built-in"):
        load_reward("nope")


# ----------------------------------------------------------------------------- Reward.score


def test_per_sample_async_runs_concurrently():
    reward = Reward.from_path("tests.test_rewards.async_len_reward")
    group = make_group(["a", "bb", "ccc"] * 10)
    CONCURRENCY["max"] = 0
    values = run(reward.score(ARGS, group))
    assert CONCURRENCY["max"] == 30  # every sample's call was in flight at once
    assert values == [1.0, 2.0, 3.0] * 10
    assert all(type(v) is float for v in values)


def test_sync_per_sample_runs_in_thread():
    seen_threads: set[int] = set()

    def sync_reward(args, sample):
        seen_threads.add(threading.get_ident())
        return sync_upper_reward(args, sample)

    values = run(Reward(sync_reward).score(ARGS, make_group(["ABC", "abc"])))
    assert values == [1.0, 0.0]
    assert threading.get_ident() not in seen_threads


def test_group_reward_async_and_sync():
    group = make_group(["ccc", "a", "bb"])
    assert run(Reward.from_path("tests.test_rewards.group_rank_reward", group=True).score(ARGS, group)) == [2.0, 0.0, 1.0]
    assert run(Reward.from_path("tests.test_rewards.sync_group_reward", group=True).score(ARGS, group)) == [1.0] * 3


def test_group_reward_wrong_length_names_function():
    reward = Reward.from_path("tests.test_rewards.short_group_reward", group=True)
    with pytest.raises(RewardError, match=r"short_group_reward.*3 values, got 1 values"):
        run(reward.score(ARGS, make_group(["a", "b", "c"])))


def test_group_reward_not_a_list():
    reward = Reward(lambda args, samples: 1.0, group=True, name="scalar_group")
    with pytest.raises(RewardError, match=r"scalar_group.*got float"):
        run(reward.score(ARGS, make_group(["a", "b"])))


def test_builtin_in_group_mode_scores_each_sample():
    reward = Reward.from_path("exact_match", group=True)
    assert run(reward.score(ARGS, make_group(["42", "41"]))) == [1.0, 0.0]


def test_raising_reward_propagates_with_message():
    reward = Reward.from_path("tests.test_rewards.raising_reward")
    with pytest.raises(RewardError, match=r"raising_reward.*index=11.*ValueError: judge exploded on purpose") as info:
        run(reward.score(ARGS, make_group(["a", "b", "c"])))
    assert isinstance(info.value.__cause__, ValueError)


def test_raising_group_reward_propagates():
    def bad_group(args, samples):
        raise KeyError("missing verifier")

    with pytest.raises(RewardError, match="missing verifier"):
        run(Reward(bad_group, group=True).score(ARGS, make_group(["a"])))


def test_empty_group():
    assert run(Reward.from_path("exact_match").score(ARGS, [])) == []


@pytest.mark.parametrize(
    "path, match",
    [
        ("tests.test_rewards.nan_reward", "not a finite number"),
        ("tests.test_rewards.bool_reward", "bool"),
        ("tests.test_rewards.str_reward", "expected a number or a dict"),
    ],
)
def test_invalid_values_rejected(path, match):
    with pytest.raises(RewardError, match=match):
        run(Reward.from_path(path).score(ARGS, make_group(["x"])))


def test_dict_reward_and_reward_key():
    group = make_group(["x"])
    reward = Reward.from_path("tests.test_rewards.dict_reward")
    assert run(reward.score(ARGS, group)) == [{"acc": 1.0, "format": 0.5}]
    assert run(reward.score(SimpleNamespace(reward_key="acc"), group)) == [{"acc": 1.0, "format": 0.5}]
    with pytest.raises(RewardError, match="reward_key 'score'"):
        run(reward.score(SimpleNamespace(reward_key="score"), group))


def test_validate_reward_cases():
    assert validate_reward(1) == 1.0 and type(validate_reward(1)) is float
    assert validate_reward(0.25) == 0.25
    for bad in (math.inf, -math.inf, math.nan, None, [1.0], False):
        with pytest.raises(RewardError):
            validate_reward(bad)
    with pytest.raises(RewardError, match="not a finite number"):
        validate_reward({"r": math.nan}, reward_key="r")
    with pytest.raises(RewardError, match="non-string keys"):
        validate_reward({1: 1.0})


# ----------------------------------------------------------------------------- exact_match


def test_exact_match():
    reward = Reward.from_path("exact_match")
    assert run(reward.score(ARGS, make_group(["  42\n", "42.0", "4 2"], label=" 42 "))) == [1.0, 0.0, 0.0]


def test_exact_match_without_label_raises():
    with pytest.raises(RewardError, match="label is None"):
        run(Reward.from_path("exact_match").score(ARGS, make_group(["42"], label=None)))


# ----------------------------------------------------------------------------- math_boxed


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}", "42"),
        (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),  # nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{a_{b_{c}}} done", "a_{b_{c}}"),
        (r"first \boxed{1} then \boxed{2}", "2"),  # last wins
        (r"\boxed{1} and a truncated \boxed{2", "1"),  # unterminated last box is skipped
        ("no box here", None),
        (r"\boxed{}", ""),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "answer, label, equal",
    [
        (r"\frac{3}{4}", "0.75", True),  # \frac is supported
        (r"\dfrac{3}{4}", "3/4", True),
        (r"-\frac{1}{2}", "-0.5", True),
        ("3/4", "0.75", True),
        ("6/8", "3/4", True),
        ("0.333", "1/3", False),  # exact rational comparison, no tolerance
        ("42", "42.0", True),
        ("42.", "42", True),  # trailing period stripped
        ("$42$", "42", True),
        (" 1 000 ", "1000", True),  # spaces are stripped everywhere
        ("1,000", "1000", False),  # thousands separators are not understood
        ("x+1", "x + 1", True),  # strings compare after whitespace removal
        ("x+1", "1+x", False),  # no symbolic algebra
        ("1/0", "1/0", True),  # not a number: compared as strings
        ("42", r"\boxed{42}", True),  # boxed label is unboxed
        ("+5", "5", True),
    ],
)
def test_math_equal(answer, label, equal):
    assert math_equal(answer, label) is equal


def test_normalize_answer():
    assert normalize_answer(" $\\frac{3}{4}$. ") == "\\frac{3}{4}"


def test_math_boxed_reward():
    group = make_group(
        [
            r"6*7 = \boxed{42}.",
            r"I think \boxed{41}, no wait, \boxed{42}",  # last wins
            r"\boxed{42} hmm actually \boxed{43}",
            "The answer is 42",  # no boxed answer
            r"\boxed{\frac{84}{2}}",
        ],
        label="42",
    )
    assert run(Reward.from_path("math_boxed").score(ARGS, group)) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_math_boxed_fraction_vs_decimal_label():
    sample = make_group([r"\boxed{\frac{3}{4}}"], label="0.75")[0]
    assert math_boxed(ARGS, sample) == 1.0


def test_math_boxed_without_label_raises():
    with pytest.raises(RewardError, match="label is None"):
        run(Reward.from_path("math_boxed").score(ARGS, make_group([r"\boxed{1}"], label=None)))


# ----------------------------------------------------------------------------- remote_rm


class RMServer:
    """A tiny aiohttp reward model on a free port; the handler is chosen per path."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    async def start(self) -> str:
        self.release = asyncio.Event()  # lets /slow finish at shutdown instead of after its sleep
        app = web.Application()
        app.router.add_post("/number", self.number)
        app.router.add_post("/dict", self.dict_answer)
        app.router.add_post("/error", self.error)
        app.router.add_post("/slow", self.slow)
        app.router.add_post("/garbage", self.garbage)
        app.router.add_post("/nonnumber", self.nonnumber)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()

    async def number(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        return web.json_response(1.0 if body["response"] == body["label"] else 0.0)

    async def dict_answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        return web.json_response({"reward": 0.5, "extra": "ignored"})

    async def error(self, request: web.Request) -> web.Response:
        return web.Response(status=500, text="judge is down")

    async def slow(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self.release.wait(), 5)
        except asyncio.TimeoutError:
            pass
        return web.json_response(1.0)

    async def garbage(self, request: web.Request) -> web.Response:
        return web.Response(text="not json")

    async def nonnumber(self, request: web.Request) -> web.Response:
        return web.json_response({"score": 1})


async def _with_rm(route: str, samples: list[Sample], **extra):
    server = RMServer()
    base = await server.start()
    try:
        args = SimpleNamespace(rm_url=f"{base}/{route}", reward_key=None, **extra)
        return await Reward.from_path("remote_rm").score(args, samples), server.requests
    finally:
        await server.stop()


def test_remote_rm_number_and_payload():
    values, requests = run(_with_rm("number", make_group(["42", "41"], label="42")))
    assert values == [1.0, 0.0]
    assert sorted(requests, key=lambda r: r["response"]) == [
        {"prompt": "What is 6*7?", "response": "41", "label": "42"},
        {"prompt": "What is 6*7?", "response": "42", "label": "42"},
    ]


def test_remote_rm_chat_prompt_is_sent_as_json():
    samples = make_group(["42"], prompt=[{"role": "user", "content": "6*7?"}])
    _, requests = run(_with_rm("number", samples))
    assert requests[0]["prompt"] == [{"role": "user", "content": "6*7?"}]


def test_remote_rm_dict_answer():
    values, _ = run(_with_rm("dict", make_group(["x"])))
    assert values == [0.5]


@pytest.mark.parametrize(
    "route, match",
    [
        ("error", "HTTP 500: judge is down"),
        ("garbage", "invalid JSON"),
        ("nonnumber", "without 'reward'"),
        ("missing", "HTTP 404"),
    ],
)
def test_remote_rm_errors(route, match):
    with pytest.raises(RewardError, match=match):
        run(_with_rm(route, make_group(["x"])))


def test_remote_rm_timeout():
    with pytest.raises(RewardError, match="timed out after 0.2s"):
        run(_with_rm("slow", make_group(["x"]), rm_timeout=0.2))


def test_remote_rm_connection_refused():
    # bind then close a port so nothing listens on it
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = SimpleNamespace(rm_url=f"http://127.0.0.1:{port}/", reward_key=None)
    with pytest.raises(RewardError, match="request failed"):
        run(Reward.from_path("remote_rm").score(args, make_group(["x"])))


def test_remote_rm_without_url():
    with pytest.raises(RewardError, match="rm_url"):
        run(Reward.from_path("remote_rm").score(SimpleNamespace(rm_url=None), make_group(["x"])))
