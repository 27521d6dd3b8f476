"""Engine answers are untrusted input (issue 26): a real HTTP server in the test answers
the way a hostile or broken engine would, and the SGLang client (workers/engine.py)
refuses each answer with an error naming what was wrong, before it becomes a sample."""
from __future__ import annotations

import asyncio
import base64
import gzip
import json

import pytest
from aiohttp import web

from pipeline.control import set_weight_version
from pipeline.ops.audit import audit
from pipeline.queue import Queue
from pipeline.types import Group
from tests.helpers import GenerateServer, WorkerThread, wait_for
from tests.test_engine_client import BODY, FakeEngine, engines, gen_body, run
from workers.engine import EngineClient
from workers.engine_answers import ANSWER_BASE_BYTES, answer_limit
from workers.engine_errors import EngineError, EngineProtocolError
from workers.engine_set import EngineSet
from workers.sampling import SamplingSettings
from workers.tokenizer import ByteTokenizer
from workers.worker import WorkerSettings

SECRET = "s3cret-engine-pass"


async def generate_once(url: str, max_new_tokens: int = 8, timeout_s: float = 600.0):
    client = EngineClient(url, timeout_s=timeout_s)
    try:
        return await client.generate([1, 2, 3], {"max_new_tokens": max_new_tokens})
    finally:
        await client.close()


def test_a_redirect_is_refused_and_the_other_host_never_sees_the_prompt():
    other = FakeEngine()

    async def scenario():
        async with engines(other) as (other_url,):
            async def redirect(request):
                raise web.HTTPTemporaryRedirect(f"{other_url}/generate")

            async with engines(FakeEngine({("POST", "/generate"): redirect})) as (url,):
                with pytest.raises(EngineProtocolError, match="HTTP 307 redirect to .*never followed"):
                    await generate_once(url)

    run(scenario())
    assert other.calls == []  # the prompt never left for the host the worker was not given


def _padded_answer(pad_bytes: int) -> bytes:
    # A valid answer followed by whitespace (still valid JSON): only its size is wrong.
    return json.dumps(gen_body("r", [5, 6], {"type": "length", "length": 2})).encode() + b" " * pad_bytes


def test_a_gzip_bomb_is_refused_past_the_limit_derived_from_max_new_tokens():
    limit = answer_limit(8)
    bomb = gzip.compress(_padded_answer(40 * limit), compresslevel=9)
    assert len(bomb) < limit // 8  # small on the wire, 40 times the limit once inflated

    async def gzipped(request):
        return web.Response(body=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    async def scenario():
        async with engines(FakeEngine({("POST", "/generate"): gzipped})) as (url,):
            with pytest.raises(EngineProtocolError, match=f"more than the {limit} allowed"):
                await generate_once(url)

    run(scenario())
    assert limit == ANSWER_BASE_BYTES + 1024 * 8


def test_an_endless_chunked_answer_is_cut_at_the_limit():
    async def endless(request):
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b'{"text": "')
        while True:  # until the client hangs up
            await resp.write(b"a" * 65536)

    async def scenario():
        async with engines(FakeEngine({("POST", "/generate"): endless})) as (url,):
            with pytest.raises(EngineProtocolError, match=f"more than the {answer_limit(8)} allowed"):
                await asyncio.wait_for(generate_once(url), 120)

    run(scenario())


def test_a_large_honest_answer_within_the_limit_is_accepted():
    n = 4096
    answer = gen_body("r", list(range(n)), {"type": "length", "length": n}, text="\\u00e9" * n)

    async def big(request):
        return web.json_response(answer)

    async def scenario():
        async with engines(FakeEngine({("POST", "/generate"): big})) as (url,):
            return await generate_once(url, max_new_tokens=n)

    assert len(run(scenario()).output_ids) == n


def test_more_tokens_than_asked_for_are_refused():
    fake = FakeEngine()
    fake.gen_response = lambda b: gen_body("r", [7] * 200, {"type": "length", "length": 200})

    async def scenario():
        async with engines(fake) as (url,):
            with pytest.raises(EngineProtocolError, match="200 output tokens, more than the 8 asked for"):
                await generate_once(url, max_new_tokens=8)

    run(scenario())


def test_output_ids_that_disagree_with_the_log_prob_ids_are_refused():
    def answer(body):
        out = gen_body("r", [11, 12], {"type": "stop", "matched": 12})
        out["output_ids"] = [11, 13]
        return out

    fake = FakeEngine()
    fake.gen_response = answer

    async def scenario():
        async with engines(fake) as (url,):
            with pytest.raises(EngineProtocolError, match="output_ids .* disagree with the 2 token ids"):
                await generate_once(url)

    run(scenario())


def test_basic_auth_in_an_engine_url_is_sent_but_never_shown():
    seen_auth: list[str | None] = []

    async def guarded(request):
        seen_auth.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") is None:
            return web.json_response({"error": "auth needed"}, status=401)
        if request[BODY]["sampling_params"]["max_new_tokens"] == 3:
            return web.json_response({"error": {"message": "engine exploded"}}, status=500)
        return web.json_response(gen_body("r", [5, 6], {"type": "length", "length": 2}))

    async def scenario():
        async with engines(FakeEngine({("POST", "/generate"): guarded})) as (url,):
            with_auth = url.replace("http://", f"http://operator:{SECRET}@")
            es = EngineSet([with_auth])
            try:
                result = await es.generate([1], {"max_new_tokens": 2})
                with pytest.raises(EngineError) as failed:
                    await es.generate([1], {"max_new_tokens": 3})
                return es.urls, result, failed.value
            finally:
                await es.close()

    urls, result, error = run(scenario())
    assert result.output_ids == [5, 6] and all(a and a.startswith("Basic ") for a in seen_auth)
    assert SECRET not in str(urls) and SECRET not in str(error) and SECRET not in (error.url or "")
    assert "engine exploded" in str(error)


# -- the same, seen by a real worker over real Redis ---------------------------------------------


class ScriptedEngine(GenerateServer):
    """SGLang's /generate in a thread of its own; `answer(prompt_text, body) -> (status, json)`."""

    def __init__(self, answer, require_auth: str | None = None):
        self.tokenizer = ByteTokenizer()
        self.answer = answer
        self.require_auth = require_auth
        super().__init__()

    async def generate(self, request: web.Request) -> web.Response:
        if self.require_auth and request.headers.get("Authorization") != self.require_auth:
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        body = await request.json()
        status, answer = self.answer(self.tokenizer.decode(body["input_ids"]), body)
        return web.json_response(answer, status=status)


def worker_settings(redis_url: str, queue: Queue, url: str, **kw) -> WorkerSettings:
    return WorkerSettings(redis_url=redis_url, engine_urls=[url], namespace=queue.keys.namespace, max_attempts=2,
                          backoff_s=0.01, backoff_max_s=0.05, heartbeat_s=0.2,
                          sampling=SamplingSettings(max_new_tokens=16), **kw)


def settled(queue: Queue) -> int:
    return queue.redis.xlen(queue.keys.results) + queue.redis.xlen(queue.keys.dead)


def test_the_reward_scores_the_text_of_the_tokens_not_the_engines_text(redis_url, queue):
    tokens = list(b"so \\boxed{7}")

    def liar(prompt, body):  # tokens spell 7, the text says 2 (the label)
        return 200, gen_body("r", tokens, {"type": "stop", "matched": tokens[-1]}, text="so \\boxed{2}")

    engine = ScriptedEngine(liar)
    queue.push_groups([Group.fresh("g", "What is 1 + 1?", 2, label="2")])
    worker = WorkerThread(worker_settings(redis_url, queue, engine.url, keep_response_text=True))
    try:
        wait_for(lambda: settled(queue) == 1, timeout=60, what="the group published")
    finally:
        worker.stop()
        engine.stop()
    (group,) = [e.decode() for e in queue.read_stream(queue.keys.results, 10)]
    for s in group.samples:
        assert s.response == "so \\boxed{7}" and s.reward == 0.0
        assert s.tokens[len(group.prompt_ids):] == tokens


def test_a_weight_version_that_is_not_an_integer_is_refused_saying_why(redis_url, queue):
    engine = ScriptedEngine(lambda prompt, body: (200, gen_body("r", [104, 105], {"type": "length", "length": 2},
                                                                  version="v3")))
    queue.push_groups([Group.fresh(f"g{i}", f"q{i}", 2, label="1") for i in range(3)])
    set_weight_version(queue.redis, queue.keys, 3)
    worker = WorkerThread(worker_settings(redis_url, queue, engine.url, engine_down_after=2))
    try:
        state = wait_for(lambda: (s := worker.worker.state()).startswith("engine-down") and s, timeout=60,
                         what="the worker saying the engines are unusable")
    finally:
        worker.stop()
        engine.stop()
    assert "weight version 'v3', not an integer" in state and "version clock 'engine'" in state
    assert settled(queue) == 0  # nothing published to be judged stale and restarted forever
    assert audit(queue).ok


def test_an_engine_password_never_reaches_status_dead_letters_or_logs(redis_url, queue, run, caplog):
    auth = "Basic " + base64.b64encode(f"op:{SECRET}".encode()).decode()

    def answer(prompt, body):
        if prompt.startswith("fail"):
            return 500, {"error": {"message": "engine exploded"}}
        return 200, gen_body("r", [104, 105], {"type": "length", "length": 2})

    engine = ScriptedEngine(answer, require_auth=auth)
    queue.push_groups([Group.fresh("fail", "fail", 1, label="1"), Group.fresh("good", "good", 1, label="1")])
    url = engine.url.replace("http://", f"http://op:{SECRET}@")
    worker = WorkerThread(worker_settings(redis_url, queue, url, engine_down_after=100))
    try:
        wait_for(lambda: settled(queue) == 2, timeout=60, what="both groups settled")
        shown = run("status", "--json", "--sample", "0").output
    finally:
        worker.stop()
        engine.stop()
    dead = {e.group_id: e.error for e in queue.read_stream(queue.keys.dead, 10)}
    assert "engine exploded" in dead["fail"] and SECRET not in dead["fail"]
    assert [e.decode().group_id for e in queue.read_stream(queue.keys.results, 10)] == ["good"]  # auth was sent
    assert engine.url in shown and SECRET not in shown
    assert SECRET not in caplog.text
