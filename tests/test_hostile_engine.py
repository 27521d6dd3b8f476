"""Engine answers are untrusted input (issue 26): a real HTTP server in the test answers
the way a hostile or broken engine would, and the SGLang client (workers/engine.py)
refuses each answer with an error naming what was wrong, before it becomes a sample."""
from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from aiohttp import web

from tests.test_engine_client import BODY, FakeEngine, engines, gen_body, run
from workers.engine import (
    ANSWER_BASE_BYTES,
    EngineClient,
    EngineError,
    EngineProtocolError,
    EngineSet,
    answer_limit,
)

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
