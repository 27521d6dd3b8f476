"""The rows of bench/async_vs_sync.py against external SGLang engines (`--engine-urls`).

A real model decides its own output lengths; the benchmark's must follow the seeded
distribution so that the rows of one seed compare the same work. One `LengthOracle`
(an HTTP proxy in this process, one port per engine) stands between every system and
the engines:

- `/generate`: the sample's total length is drawn from its `sampling_seed` exactly as
  the simulator draws it (engines.sim_model.draw_output_length); the request is sent
  with `max_new_tokens` = that length minus what the sample already generated and
  `ignore_eos: true`, so the model writes exactly the drawn length. What a sample
  already generated is its input beyond the first input seen for that seed (a
  continued request sends prompt + partial output), kept across all engines.
- `/update_weights_from_disk`: emulated (no checkpoint to load): a sleep of the
  update-cost preset, then SGLang's `/update_weight_version` with the new version.
- everything else is passed through.

The generation figures come from what the proxy sees, not from the engines:
tokens generated (`meta_info.completion_tokens` of every answer), requests in flight
(time-averaged ÷ slots: queued inside the engine counts as in flight) and paused time
(between `/pause_generation` and `/continue_generation`).
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import aiohttp
from aiohttp import web

from engines.sim_model import draw_output_length

from .sim_fleet import Window

HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class _Engine:
    """Per-engine counters: requests in flight integrated over time, paused time."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.inflight = 0
        self.inflight_area = 0.0  # ∫ in-flight requests dt
        self.paused_since: float | None = None
        self.paused_s = 0.0
        self.last = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        self.inflight_area += self.inflight * (now - self.last)
        if self.paused_since is not None:
            self.paused_s += now - max(self.paused_since, self.last)
        self.last = now


class LengthOracle:
    """Proxies for `engine_urls`; `urls` are the proxies'. Also a fleet for run_trainer
    (start_window / stop_window). Context manager."""

    def __init__(self, engine_urls: list[str], slots: int, median: float, p99: float, weight_update_s: float):
        self.slots, self.median, self.p99, self.weight_update_s = slots, median, p99, weight_update_s
        self.engines = [_Engine(u) for u in engine_urls]
        self.first_input: dict[int, int] = {}  # sampling_seed -> input length of its first request
        self.generated = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="length-oracle", daemon=True)
        self._thread.start()
        self.urls = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    # -- the proxy -----------------------------------------------------------------------

    async def _start(self) -> list[str]:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._runners, urls = [], []
        for engine in self.engines:
            app = web.Application(client_max_size=256 * 1024 * 1024)
            async def handle(request: web.Request, engine: _Engine = engine) -> web.StreamResponse:
                return await self._handle(engine, request)
            app.router.add_route("*", "/{path:.*}", handle)
            # As engines/server.py: a client that disconnects cancels its proxied request,
            # and stopping waits 1 s for requests still out (aiohttp's default, 60 s, outlasted
            # stop()'s 30 s when a request was still waiting at an engine).
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        return urls

    async def _handle(self, engine: _Engine, request: web.Request) -> web.StreamResponse:
        path = request.path
        body = await request.read()
        if path == "/update_weights_from_disk":
            return await self._update(engine, json.loads(body))
        if path == "/generate":
            body = json.dumps(self._oracle(json.loads(body))).encode()
        engine.tick()
        if path == "/pause_generation" and engine.paused_since is None:
            engine.paused_since = time.monotonic()
        elif path == "/continue_generation" and engine.paused_since is not None:
            engine.paused_since = None
        engine.inflight += path == "/generate"
        try:
            async with self._session.request(request.method, engine.url + path, params=request.query,
                                              data=body or None,
                                              headers={"Content-Type": "application/json"} if body else None) as up:
                reply = await up.read()
                status, headers = up.status, {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
        finally:
            engine.tick()
            engine.inflight -= path == "/generate"
        if path == "/generate" and status == 200:
            answers = json.loads(reply)
            for answer in answers if isinstance(answers, list) else [answers]:
                self.generated += int(answer.get("meta_info", {}).get("completion_tokens", 0))
        return web.Response(body=reply, status=status, headers=headers)

    def _oracle(self, request: dict) -> dict:
        """max_new_tokens = the sample's drawn length minus what it generated, ignore_eos."""
        params = request.get("sampling_params") or {}
        seed = params.get("sampling_seed")
        if seed is None or not isinstance(request.get("input_ids"), list):
            raise web.HTTPBadRequest(text="the length oracle needs input_ids and sampling_params.sampling_seed")
        length = len(request["input_ids"])
        produced = length - self.first_input.setdefault(seed, length)
        total = draw_output_length(random.Random(f"sample:{seed}|length"), self.median, self.p99)
        limit = params.get("max_new_tokens", total)
        # A continued sample always has some of its length left (a finished one is not
        # continued; a stale restart has a new seed): the floor of 1 only keeps the request valid.
        params = {**params, "max_new_tokens": max(1, min(limit, total - produced)), "ignore_eos": True}
        return {**request, "sampling_params": params}

    async def _update(self, engine: _Engine, body: dict) -> web.Response:
        """What a real update costs, then the version SGLang tags its answers with."""
        await asyncio.sleep(self.weight_update_s)
        version = body.get("weight_version")
        if version is not None:
            async with self._session.post(engine.url + "/update_weight_version",
                                          json={"new_version": version, "abort_all_requests": False}) as up:
                if up.status != 200:
                    return web.json_response({"success": False, "message": f"/update_weight_version: "
                                              f"{up.status} {await up.text()}"}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update model weights (emulated).",
                                  "num_paused_requests": 0})

    # -- the fleet interface of run_trainer ------------------------------------------------

    def _snapshot(self) -> tuple[float, int, list[float], float]:
        def read():
            for e in self.engines:
                e.tick()
            return time.monotonic(), self.generated, [e.inflight_area for e in self.engines], \
                sum(e.paused_s for e in self.engines)

        async def on_loop():  # the counters belong to the proxy's loop
            return read()
        return asyncio.run_coroutine_threadsafe(on_loop(), self._loop).result(10)

    def start_window(self) -> None:
        self._window_start = self._snapshot()

    def stop_window(self) -> Window:
        (t0, gen0, area0, paused0), (t1, gen1, area1, paused1) = self._window_start, self._snapshot()
        span = t1 - t0
        per_engine = [min(1.0, (b - a) / span / self.slots) for a, b in zip(area0, area1)]
        n = len(self.engines)
        return Window(utilization=sum(per_engine) / n, per_engine=per_engine,
                      free_slots=1 - sum(per_engine) / n, paused=(paused1 - paused0) / span / n,
                      waiting=0.0, polls=0, generated_tokens=gen1 - gen0)

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        async def close():
            for runner in self._runners:
                await runner.cleanup()
            await self._session.close()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> LengthOracle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
