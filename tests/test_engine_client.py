"""SGLang client (workers/engine.py): parsing, error taxonomy, pause fallback,
router discovery, EngineSet fan-out; plus tests against the real sglang-router
in front of two simulators (marked slow)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from typing import Any, AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import ROUTER_STARTUP_TIMEOUT_S, RouterProcess, http_json, router_engine_urls
from workers.engine import EngineClient, make_session
from workers.engine_answers import GenerateResult, parse_generate_response
from workers.engine_errors import EngineControlError, EngineError, EngineRequestError, EngineUnavailable
from workers.engine_set import EngineSet, discover_engines


def run(coro):
    return asyncio.run(coro)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- a tiny fake engine

Handler = Callable[[web.Request], Any]
BODY = web.RequestKey("body", object)  # the parsed JSON body, stored by FakeEngine.dispatch


class FakeEngine:
    """Minimal SGLang-shaped server. Unknown paths get aiohttp's plain 404, like an
    engine answering a router-only path."""

    def __init__(self, routes: dict[tuple[str, str], Handler] | None = None):
        self.calls: list[tuple[str, str, Any]] = []  # (method, path, parsed body or None)
        self.weight_version = "default"
        self.gen_response: Callable[[dict], Any] = self.default_generate
        self.routes = {
            ("GET", "/health"): self.health,
            ("GET", "/get_model_info"): self.get_model_info,
            ("POST", "/generate"): self.generate,
            ("POST", "/pause_generation"): self.ok_status("Generation paused successfully."),
            ("POST", "/continue_generation"): self.ok_status("Generation continued successfully."),
            ("POST", "/abort_request"): self.empty_200,
            ("POST", "/update_weight_version"): self.update_weight_version,
            ("POST", "/update_weights_from_disk"): self.update_weights_from_disk,
            ("POST", "/flush_cache"): self.empty_200,
        }
        self.routes.update(routes or {})
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.calls.append((request.method, request.path, body))
        handler = self.routes.get((request.method, request.path))
        if handler is None:
            raise web.HTTPNotFound()
        request[BODY] = body
        return await handler(request)

    def paths(self, path: str) -> list[Any]:
        return [b for (_, p, b) in self.calls if p == path]

    # default handlers
    async def health(self, request):
        return web.Response(status=200)

    async def get_model_info(self, request):
        return web.json_response(
            {"model_path": "fake", "tokenizer_path": "fake", "is_generation": True,
             "weight_version": self.weight_version}
        )

    async def generate(self, request):
        return web.json_response(self.gen_response(request[BODY]))

    def default_generate(self, body: dict) -> dict:
        return gen_body(rid=body.get("rid") or "auto", ids=[5, 6], reason={"type": "length", "length": 2},
                        version=self.weight_version)

    def ok_status(self, message: str) -> Handler:
        async def handler(request):
            return web.json_response({"message": message, "status": "ok"})
        return handler

    async def empty_200(self, request):
        return web.Response(status=200)

    async def update_weight_version(self, request):
        self.weight_version = request[BODY]["new_version"]
        return web.json_response({"success": True, "message": "ok", "new_version": self.weight_version})

    async def update_weights_from_disk(self, request):
        body = request[BODY]
        if body["model_path"] == "/missing":
            return web.json_response(
                {"success": False, "message": "Failed to get weights iterator: /missing", "num_paused_requests": 0},
                status=400)
        if body.get("weight_version"):
            self.weight_version = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})


def gen_body(rid: str, ids: list[int], reason: dict | None, version: str = "default",
             with_logprobs: bool = True, text: str = "hi") -> dict:
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": reason, "prompt_tokens": 3, "completion_tokens": len(ids),
        "cached_tokens": 0, "weight_version": version, "e2e_latency": 0.25,
    }
    if with_logprobs:
        meta["output_token_logprobs"] = [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


@contextlib.asynccontextmanager
async def engines(*fakes: FakeEngine) -> AsyncIterator[list[str]]:
    urls = [await f.start() for f in fakes]
    try:
        yield urls
    finally:
        for f in fakes:
            await f.stop()


async def generate_with(fake: FakeEngine, **kw) -> GenerateResult:
    async with engines(fake) as (url,):
        client = EngineClient(url)
        try:
            return await client.generate([1, 2, 3], {"max_new_tokens": 8}, **kw)
        finally:
            await client.close()


# ----------------------------------------------------------------------------- generate parsing


def test_generate_stop_sends_slime_request_and_parses_logprobs():
    fake = FakeEngine()
    fake.gen_response = lambda b: gen_body(b["rid"], [11, 12, 2], {"type": "stop", "matched": 2}, "v3")
    res = run(generate_with(fake, rid="rid-1"))
    assert fake.paths("/generate") == [
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}, "return_logprob": True, "rid": "rid-1"}
    ]
    assert res.finish_type == "stop"
    assert res.finish_reason == {"type": "stop", "matched": 2}
    assert res.output_ids == [11, 12, 2]
    assert res.output_log_probs == pytest.approx([-0.1, -0.2, -0.3])
    assert (res.weight_version, res.rid, res.text) == ("v3", "rid-1", "hi")
    assert (res.prompt_tokens, res.completion_tokens, res.e2e_latency) == (3, 3, 0.25)


def test_generate_length():
    fake = FakeEngine()
    fake.gen_response = lambda b: gen_body("r", [7] * 8, {"type": "length", "length": 8})
    res = run(generate_with(fake))
    assert res.finish_type == "length" and res.finish_reason["length"] == 8
    assert len(res.output_ids) == len(res.output_log_probs) == 8
    assert "rid" not in fake.paths("/generate")[0]  # the engine picks one


def test_generate_abort_keeps_partial_output():
    fake = FakeEngine()
    reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    fake.gen_response = lambda b: gen_body("r", [4, 5], reason)
    res = run(generate_with(fake))
    assert res.finish_type == "abort" and res.finish_reason == reason
    assert res.output_ids == [4, 5]


def test_generate_abort_in_waiting_queue_empty_output():
    fake = FakeEngine()
    reason = {"type": "abort", "message": "Abort in waiting queue"}
    fake.gen_response = lambda b: gen_body("r", [], reason)
    res = run(generate_with(fake))
    assert (res.finish_type, res.output_ids, res.output_log_probs) == ("abort", [], [])


def test_generate_abort_before_prefill_without_logprob_key_is_zero_tokens():
    # SGLang 0.4.10-0.5.2: no output_token_logprobs key at all.
    fake = FakeEngine()
    fake.gen_response = lambda b: {
        "text": "", "output_ids": [],
        "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                      "prompt_tokens": 3, "completion_tokens": 0},
    }
    res = run(generate_with(fake))
    assert (res.finish_type, res.output_ids, res.output_log_probs) == ("abort", [], [])
    assert res.weight_version == "default" and res.e2e_latency is None


def test_parse_rejects_unknown_or_missing_finish_reason():
    with pytest.raises(EngineError, match="finish_reason"):
        parse_generate_response(gen_body("r", [1], None), "http://x")
    with pytest.raises(EngineError, match="finish_reason"):
        parse_generate_response(gen_body("r", [1], {"type": "weird"}), "http://x")
    with pytest.raises(EngineError, match="malformed"):
        parse_generate_response({"text": "no meta"}, "http://x")


def test_generate_list_answer_is_an_error():
    fake = FakeEngine()
    fake.gen_response = lambda b: [gen_body("a", [1], {"type": "length"}), gen_body("b", [1], {"type": "length"})]
    with pytest.raises(EngineError, match="expected one"):
        run(generate_with(fake))


# ----------------------------------------------------------------------------- error taxonomy


def fixed(status: int, body: Any = None, text: str | None = None) -> Handler:
    async def handler(request):
        if text is not None:
            return web.Response(status=status, text=text)
        return web.json_response(body, status=status)
    return handler


@pytest.mark.parametrize(
    "body, message",
    [
        ({"error": {"message": "top_p must be in (0, 1], got 2.0.", "type": "BadRequestError"}},
         "top_p must be in (0, 1], got 2.0."),
        ({"error": "input_ids cannot be empty"}, "input_ids cannot be empty"),  # 0.5.23
    ],
)
def test_400_error_shapes(body, message):
    fake = FakeEngine({("POST", "/generate"): fixed(400, body)})
    with pytest.raises(EngineRequestError) as info:
        run(generate_with(fake))
    assert message in str(info.value)
    assert info.value.status == 400 and info.value.url == fake.url
    assert not isinstance(info.value, EngineUnavailable)


def test_plain_text_4xx_from_router():
    text = "Failed to deserialize the JSON body into the target type: sampling_params.max_new_tokens"
    fake = FakeEngine({("POST", "/generate"): fixed(422, text=text)})
    with pytest.raises(EngineRequestError, match="deserialize") as info:
        run(generate_with(fake))
    assert info.value.status == 422


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_5xx_and_429_are_unavailable(status):
    fake = FakeEngine({("POST", "/generate"): fixed(status, {"error": {"message": "overloaded"}})})
    with pytest.raises(EngineUnavailable, match="overloaded") as info:
        run(generate_with(fake))
    assert info.value.status == status and info.value.url == fake.url


def test_connection_refused_is_unavailable():
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        client = EngineClient(url)
        try:
            await client.generate([1], {})
        finally:
            await client.close()

    with pytest.raises(EngineUnavailable) as info:
        run(go())
    assert info.value.url == url and info.value.status is None


def test_dropped_connection_is_unavailable():
    async def drop(request):
        request.transport.close()  # the engine process died mid-request
        await asyncio.sleep(1)
        return web.Response()

    fake = FakeEngine({("POST", "/generate"): drop})
    with pytest.raises(EngineUnavailable):
        run(generate_with(fake))


def test_timeout_is_unavailable():
    async def slow(request):
        await asyncio.sleep(5)
        return web.json_response({})

    fake = FakeEngine({("POST", "/generate"): slow})

    async def go():
        async with engines(fake) as (url,):
            client = EngineClient(url, timeout_s=0.3)
            t0 = time.monotonic()
            try:
                with pytest.raises(EngineUnavailable, match="timed out"):
                    await client.generate([1], {})
            finally:
                await client.close()
            return time.monotonic() - t0

    assert run(go()) < 3


def test_thousands_of_concurrent_requests_share_one_session():
    # aiohttp's default connector caps at 100 connections; the worker needs thousands.
    n = 600
    arrived = 0
    all_here = asyncio.Event()

    async def barrier(request):
        nonlocal arrived
        arrived += 1
        if arrived == n:
            all_here.set()
        await asyncio.wait_for(all_here.wait(), 10)  # only returns once all n are in flight
        return web.json_response(gen_body("r", [1], {"type": "length", "length": 1}))

    fake = FakeEngine({("POST", "/generate"): barrier})

    async def go():
        nonlocal all_here
        all_here = asyncio.Event()
        async with engines(fake) as (url,):
            session = make_session()
            client = EngineClient(url, session)
            try:
                results = await asyncio.gather(*(client.generate([1], {}) for _ in range(n)))
            finally:
                await session.close()
            return results

    assert len(run(go())) == n


# ----------------------------------------------------------------------------- control calls


def test_pause_sends_mode_on_new_engines():
    fake = FakeEngine()

    async def go():
        async with engines(fake) as (url,):
            client = EngineClient(url)
            await client.pause_generation("retract")
            await client.continue_generation()
            await client.pause_generation("in_place")
            await client.close()

    run(go())
    assert fake.paths("/pause_generation") == [{"mode": "retract"}, {"mode": "in_place"}]
    assert fake.paths("/continue_generation") == [{}]


def test_pause_falls_back_to_no_body_on_old_engines(caplog):
    async def old_pause(request):
        if request[BODY] is not None:  # pre-0.5.6: no request model, a body is rejected
            return web.json_response({"error": {"message": "unexpected body"}}, status=400)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    fake = FakeEngine({("POST", "/pause_generation"): old_pause})

    async def go():
        async with engines(fake) as (url,):
            client = EngineClient(url)
            await client.pause_generation("abort")
            await client.pause_generation("retract")  # fallback remembered: no body sent
            await client.close()

    with caplog.at_level(logging.WARNING, logger="workers.engine"):
        run(go())
    assert fake.paths("/pause_generation") == [{"mode": "abort"}, None, None]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # only the non-abort call warns
    assert "only supports pause mode 'abort'" in warnings[0] and fake.url in warnings[0]


def test_pause_rejects_unknown_mode_locally():
    with pytest.raises(ValueError):
        run(EngineClient("http://127.0.0.1:1").pause_generation("freeze"))


def test_abort_bodies():
    fake = FakeEngine()

    async def go():
        async with engines(fake) as (url,):
            client = EngineClient(url)
            await client.abort(rid="grp-1")
            await client.abort(abort_all=True)
            with pytest.raises(ValueError):
                await client.abort()
            await client.close()

    run(go())
    assert fake.paths("/abort_request") == [{"rid": "grp-1"}, {"abort_all": True}]


def test_update_weights_success_and_failure():
    async def ok_but_failed(request):
        return web.json_response({"success": False, "message": "model busy"})

    fake = FakeEngine()
    other = FakeEngine({("POST", "/update_weights_from_disk"): ok_but_failed})

    async def go():
        async with engines(fake, other) as (url, url2):
            client = EngineClient(url)
            out = await client.update_weights_from_disk("/ckpt/step5", weight_version="5")
            assert out["success"] is True
            assert await client.weight_version() == "5"
            with pytest.raises(EngineRequestError, match="Failed to get weights iterator") as info:
                await client.update_weights_from_disk("/missing")
            assert info.value.status == 400
            with pytest.raises(EngineRequestError, match="model busy"):  # 200 + success false
                await EngineClient(url2, client._get_session()).update_weights_from_disk("/x")
            out = await client.update_weight_version("6")
            assert out["success"] is True and await client.weight_version() == "6"
            await client.close()

    run(go())
    assert fake.paths("/update_weights_from_disk")[0] == {
        "model_path": "/ckpt/step5", "abort_all_requests": False, "flush_cache": True, "weight_version": "5"}
    assert fake.paths("/update_weight_version") == [{"new_version": "6", "abort_all_requests": True}]


def test_model_info_falls_back_to_model_info_alias():
    async def alias(request):
        return web.json_response({"model_path": "m", "weight_version": "w7"})

    fake = FakeEngine({("GET", "/model_info"): alias})
    del fake.routes[("GET", "/get_model_info")]

    async def go():
        async with engines(fake) as (url,):
            client = EngineClient(url)
            try:
                return await client.model_info(), await client.weight_version()
            finally:
                await client.close()

    info, version = run(go())
    assert info["model_path"] == "m" and version == "w7"


def test_health_and_flush_cache():
    fake = FakeEngine()
    busy = FakeEngine({("GET", "/health"): fixed(503, text=""),
                       ("POST", "/flush_cache"): fixed(400, text="Cache not flushed: requests running")})

    async def go():
        async with engines(fake, busy) as (u1, u2):
            session = make_session()
            a, b = EngineClient(u1, session), EngineClient(u2, session)
            dead = EngineClient(f"http://127.0.0.1:{free_port()}", session)
            out = (await a.health(), await b.health(), await dead.health(),
                   await a.flush_cache(), await b.flush_cache())
            await session.close()
            return out

    assert run(go()) == (True, False, False, True, False)


# ----------------------------------------------------------------------------- discovery


def router_workers(*urls: str) -> Handler:
    async def handler(request):
        return web.json_response({
            "workers": [{"id": f"id-{i}", "url": u, "model_id": "m", "worker_type": "regular",
                         "is_healthy": True, "load": 0} for i, u in enumerate(urls)],
            "total": len(urls), "stats": {}})
    return handler


def test_discovery_via_workers_strips_dp_rank_suffix():
    router = FakeEngine({("GET", "/workers"): router_workers(
        "http://10.0.0.1:30000", "http://10.0.0.2:30000@0", "http://10.0.0.2:30000@1")})

    async def go():
        async with engines(router) as (url,), aiohttp.ClientSession() as s:
            return await discover_engines(url, s)

    assert run(go()) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]


def test_discovery_via_list_workers():
    router = FakeEngine({("GET", "/list_workers"): fixed(200, {"urls": ["http://a:1", "http://b:2/"]})})

    async def go():
        async with engines(router) as (url,), aiohttp.ClientSession() as s:
            return await discover_engines(url, s)

    assert run(go()) == ["http://a:1", "http://b:2"]
    assert [p for (_, p, _) in router.calls] == ["/workers", "/list_workers"]


def test_discovery_of_a_plain_engine():
    fake = FakeEngine()

    async def go():
        async with engines(fake) as (url,), aiohttp.ClientSession() as s:
            return url, await discover_engines(url + "/", s)

    url, found = run(go())
    assert found == [url]


def test_discovery_odd_answers_fall_back_to_model_info():
    odd = FakeEngine({("GET", "/workers"): fixed(405, text="Method Not Allowed")})
    broken = FakeEngine({("GET", "/workers"): fixed(405, text="no")})
    del broken.routes[("GET", "/get_model_info")]

    async def go():
        async with engines(odd, broken) as (u1, u2), aiohttp.ClientSession() as s:
            assert await discover_engines(u1, s) == [u1]
            with pytest.raises(EngineRequestError):
                await discover_engines(u2, s)
            with pytest.raises(EngineUnavailable):
                await discover_engines(f"http://127.0.0.1:{free_port()}", s)

    run(go())


# ----------------------------------------------------------------------------- EngineSet


def test_engine_set_direct_engines_round_robin_and_fanout():
    a, b = FakeEngine(), FakeEngine()

    async def go():
        async with engines(a, b) as urls:
            es = EngineSet(urls)
            try:
                for _ in range(4):
                    await es.generate([1], {"max_new_tokens": 2})
                assert await es.pause_generation("retract") == {urls[0]: None, urls[1]: None}
                out = await es.update_weight_version("v2")
                assert set(out) == set(urls)
                assert await es.weight_versions() == {urls[0]: "v2", urls[1]: "v2"}
                await es.abort(abort_all=True)
                await es.continue_generation()
                assert es.engines == urls
            finally:
                await es.close()

    run(go())
    assert len(a.paths("/generate")) == len(b.paths("/generate")) == 2
    for f in (a, b):
        assert f.paths("/pause_generation") == [{"mode": "retract"}]
        assert f.paths("/abort_request") == [{"abort_all": True}]


def test_engine_set_discovers_a_plain_engine_once():
    # Only a router gains and loses engines: asking an engine again before every
    # control call costs two round trips (404s) per engine per call.
    fake = FakeEngine()

    async def go():
        async with engines(fake) as (url,):
            es = EngineSet([url])
            try:
                await es.pause_generation("in_place")
                await es.update_weight_version("v1")
                await es.continue_generation()
            finally:
                await es.close()

    run(go())
    assert len(fake.paths("/workers")) == 1
    assert len(fake.paths("/continue_generation")) == 1


def test_engine_set_sends_each_request_to_the_engine_with_the_fewest_in_flight():
    # Round-robin would send the third request to the slow engine, where it queues
    # behind the first while the fast engine is free.
    release = asyncio.Event()

    async def slow_generate(request):
        await release.wait()
        return web.json_response(slow.default_generate(request[BODY]))

    slow = FakeEngine({("POST", "/generate"): slow_generate})
    fast = FakeEngine()

    async def go():
        async with engines(slow, fast) as urls:
            es = EngineSet(urls)
            try:
                first = asyncio.create_task(es.generate([1], {"max_new_tokens": 2}))
                while not slow.paths("/generate"):
                    await asyncio.sleep(0.005)
                for ids in ([2], [3]):  # a request queued behind the slow one would time out
                    await asyncio.wait_for(es.generate(ids, {"max_new_tokens": 2}), timeout=5)
            finally:
                release.set()
                await first
                await es.close()

    run(go())
    assert len(slow.paths("/generate")) == 1
    assert len(fast.paths("/generate")) == 2


def test_engine_set_behind_fake_router_reports_each_failing_engine():
    good = FakeEngine()
    bad = FakeEngine({("POST", "/pause_generation"): fixed(500, {"error": {"message": "scheduler died"}})})

    async def go():
        async with engines(good, bad) as (ug, ub):
            router = FakeEngine({("GET", "/workers"): router_workers(ug, ub),
                                 ("POST", "/generate"): good.generate})
            del router.routes[("POST", "/pause_generation")]  # a router 404s control calls
            async with engines(router) as (ur,):
                es = EngineSet([ur])
                try:
                    await es.generate([1], {})
                    with pytest.raises(EngineControlError) as info:
                        await es.pause_generation()
                    err = info.value
                    assert set(err.errors) == {ub} and set(err.results) == {ug}
                    assert isinstance(err.errors[ub], EngineUnavailable)
                    assert f"engine {ub} failed:" in str(err) and "scheduler died" in str(err)
                    assert es.engines == [ug, ub]
                finally:
                    await es.close()
            return router

    router = run(go())
    assert len(router.paths("/generate")) == 1  # generation went through the router
    assert router.paths("/pause_generation") == []  # control never did
    assert good.paths("/pause_generation") == [{"mode": "abort"}]


def test_engine_set_refresh_failures():
    async def go():
        dead = f"http://127.0.0.1:{free_port()}"
        es = EngineSet([dead])
        try:
            with pytest.raises(EngineControlError, match=f"engine {dead} failed"):
                await es.pause_generation()
        finally:
            await es.close()
        # A router with no registered workers yet: clear error, not a silent no-op.
        empty = FakeEngine({("GET", "/workers"): router_workers()})
        async with engines(empty) as (ur,):
            es = EngineSet([ur])
            try:
                with pytest.raises(EngineControlError, match="no engines discovered"):
                    await es.update_weight_version("v1")
            finally:
                await es.close()

    run(go())


def test_engine_set_health_never_raises():
    a = FakeEngine()

    async def go():
        async with engines(a) as (ua,):
            router = FakeEngine({("GET", "/workers"): router_workers(ua, f"http://127.0.0.1:{free_port()}")})
            async with engines(router) as (ur,):
                dead = f"http://127.0.0.1:{free_port()}"
                es = EngineSet([ur, dead])
                try:
                    return ur, ua, dead, await es.health()
                finally:
                    await es.close()

    ur, ua, dead, health = run(go())
    assert health[ur] is True and health[ua] is True
    assert health[dead] is False  # unreachable and never discovered
    assert list(health.values()).count(False) == 2  # plus the router's dead engine


# ----------------------------------------------------------------------------- real router + simulators
#
# These run the real Rust router (`python -m sglang_router.launch_router`) as a
# subprocess in front of two in-process simulators. What they pin down about
# sglang-router 0.3.x (see also the module docstring of workers/engine.py):
#   * startup: /health answers ~1-2 s after launch, but the --worker-urls are
#     registered asynchronously ("Router ready | workers: []"), so readiness means
#     "GET /workers lists every engine", not "/health is 200";
#   * GET /workers -> {"workers": [{"id", "url", "is_healthy", "load", ...}], "total", "stats"};
#     /list_workers is gone (404); POST /workers {"url"} answers 202 and registers
#     in the background; DELETE /workers/{id} removes;
#   * /generate is forwarded (rid preserved); control endpoints answer 404;
#   * the default policy (cache_aware) may send all unloaded traffic to one engine,
#     so these tests use --policy round_robin to make "both engines get traffic"
#     deterministic.

@pytest.fixture(scope="module")
def router_env(tmp_path_factory):
    from engines.simulator import SimConfig, start_simulator

    sims = [start_simulator(SimConfig(seed=i, decode_tokens_per_s=400.0, length_median=16.0,
                                      length_p99=64.0)) for i in range(2)]
    router = None
    try:
        router = RouterProcess([s.url for s in sims], str(tmp_path_factory.mktemp("router") / "router.log"),
                               ["--policy", "round_robin"])
        router.wait_ready([s.url for s in sims])
        logging.getLogger(__name__).info("router ready after %.2fs", router.startup_s)
        yield router, sims
    finally:
        if router is not None:
            router.stop()
        for s in sims:
            s.stop()


def _submitted(sim) -> int:
    return http_json(sim.url + "/sim/stats")["stats"].get("submitted", 0)


def _running(sims) -> int:
    return sum(http_json(s.url + "/v1/loads")["aggregate"]["total_reqs"] for s in sims)


PROMPT = list(b"What is 2 + 3?")


@pytest.mark.slow
def test_router_startup_and_discovery(router_env):
    router, sims = router_env
    assert router.startup_s is not None and router.startup_s < ROUTER_STARTUP_TIMEOUT_S

    async def go():
        async with aiohttp.ClientSession() as s:
            return await discover_engines(router.url, s), await discover_engines(sims[0].url, s)

    behind_router, direct = run(go())
    assert sorted(behind_router) == sorted(s.url for s in sims)
    assert direct == [sims[0].url]


@pytest.mark.slow
def test_router_forwards_generate_to_both_engines(router_env):
    router, sims = router_env
    before = [_submitted(s) for s in sims]

    async def go():
        es = EngineSet([router.url])
        try:
            return await asyncio.gather(*(
                es.generate(PROMPT, {"max_new_tokens": 32, "temperature": 1.0, "no_stop_trim": True,
                                     "spaces_between_special_tokens": False}, rid=f"via-router-{i}")
                for i in range(8)))
        finally:
            await es.close()

    results = run(go())
    assert [r.rid for r in results] == [f"via-router-{i}" for i in range(8)]  # rid survives the router
    for r in results:
        assert r.finish_type in ("stop", "length")
        assert 0 < len(r.output_ids) == len(r.output_log_probs) == r.completion_tokens <= 32
        assert r.prompt_tokens == len(PROMPT)
    gained = [_submitted(s) - b for s, b in zip(sims, before)]
    assert sum(gained) == 8 and all(g > 0 for g in gained), gained


@pytest.mark.slow
def test_router_answers_404_to_control_calls(router_env):
    """The protocol: control endpoints must be called on each engine, never the router."""
    router, _ = router_env

    async def go():
        client = EngineClient(router.url)
        try:
            calls = {
                "pause_generation": client.pause_generation("abort"),
                "continue_generation": client.continue_generation(),
                "abort_request": client.abort(abort_all=True),
                "update_weight_version": client.update_weight_version("nope"),
                "update_weights_from_disk": client.update_weights_from_disk("/nope"),
            }
            statuses = {}
            for name, coro in calls.items():
                with pytest.raises(EngineRequestError) as info:
                    await coro
                statuses[name] = info.value.status
            # /flush_cache is the exception: the router fans it out itself.
            flushed = await client.flush_cache()
            return statuses, flushed
        finally:
            await client.close()

    statuses, flushed = run(go())
    assert set(statuses.values()) == {404}, statuses
    assert flushed is True


@pytest.mark.slow
def test_engine_set_control_calls_reach_each_engine_behind_router(router_env):
    router, sims = router_env

    async def go():
        es = EngineSet([router.url])
        try:
            out = await es.update_weight_version("v-42")
            assert sorted(out) == sorted(s.url for s in sims)
            # each engine reports it directly ...
            for s in sims:
                client = EngineClient(s.url)
                assert await client.weight_version() == "v-42"
                await client.close()
            assert set((await es.weight_versions()).values()) == {"v-42"}
            # ... and generations through the router carry it
            results = await asyncio.gather(*(es.generate(PROMPT, {"max_new_tokens": 8}) for _ in range(4)))
            assert {r.weight_version for r in results} == {"v-42"}
            out = await es.update_weights_from_disk("/ckpt/step-43", weight_version="v-43")
            assert all(r["success"] for r in out.values())
            assert set((await es.weight_versions()).values()) == {"v-43"}
        finally:
            await es.close()

    run(go())


@pytest.mark.slow
def test_pause_and_abort_through_engine_set_end_requests_routed_by_router(router_env):
    router, sims = router_env
    long = {"max_new_tokens": 4000, "ignore_eos": True}  # ~10 s at 400 tok/s

    async def wait_running(n: int) -> None:
        for _ in range(200):
            if await asyncio.to_thread(_running, sims) >= n:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{n} requests never became active on the simulators")

    async def go():
        es = EngineSet([router.url])
        try:
            # abort by rid: the router does not route /abort_request, the set fans it out
            one = asyncio.create_task(es.generate(PROMPT, long, rid="abort-me-1"))
            await wait_running(1)
            await asyncio.sleep(0.1)
            assert set(await es.abort(rid="abort-me-1")) == {s.url for s in sims}
            single = await asyncio.wait_for(one, 5)
            assert single.finish_type == "abort" and 0 < len(single.output_ids) < 4000

            # pause(abort) on every engine ends all in-flight generations with partial output
            tasks = [asyncio.create_task(es.generate(PROMPT, long)) for _ in range(6)]
            await wait_running(6)
            await asyncio.sleep(0.1)
            await es.pause_generation("abort")
            results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
            assert {r.finish_type for r in results} == {"abort"}
            assert all(len(r.output_ids) == len(r.output_log_probs) > 0 for r in results)
            await es.continue_generation()
            after = await es.generate(PROMPT, {"max_new_tokens": 8})
            assert after.finish_type in ("stop", "length")
        finally:
            await es.close()

    run(go())


@pytest.mark.slow
def test_engine_set_refresh_sees_engine_added_to_router(router_env):
    from engines.simulator import start_simulator

    router, sims = router_env
    extra = start_simulator()
    try:
        answer = http_json(router.url + "/workers", {"url": extra.url})
        assert answer["status"] == "accepted"  # 202: registration happens in the background
        deadline = time.monotonic() + 15
        while extra.url not in router_engine_urls(router.url):
            assert time.monotonic() < deadline, "router never registered the new engine"
            time.sleep(0.05)

        async def go():
            es = EngineSet([router.url])
            try:
                out = await es.update_weight_version("v-added")
                return sorted(out), es.engines
            finally:
                await es.close()

        reached, engines_seen = run(go())
        assert reached == sorted([extra.url] + [s.url for s in sims])
        assert sorted(engines_seen) == reached
        assert http_json(extra.url + "/get_model_info")["weight_version"] == "v-added"
    finally:
        workers = http_json(router.url + "/workers")["workers"]
        for w in workers:
            if w["url"] == extra.url:
                http_json(f"{router.url}/workers/{w['id']}", method="DELETE")
        deadline = time.monotonic() + 15
        while extra.url in router_engine_urls(router.url) and time.monotonic() < deadline:
            time.sleep(0.05)
        extra.stop()

