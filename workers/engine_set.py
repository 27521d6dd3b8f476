"""The engines a worker or trainer uses, given as engine and/or router URLs: router
discovery, the choice of URL for each request, and control calls fanned out to every
engine (the router answers 404 to ``/pause_generation``, ``/abort_request``,
``/update_weights_*`` and friends).

What the real router (sglang-router 0.3.x, Rust) does, as verified by
tests/test_engine_client.py and by hand:

* ``GET /workers`` -> ``{"workers": [{"id", "url", "model_id", "is_healthy",
  "load", ...}], "total", "stats"}``; ``/list_workers`` is gone (404). With
  ``--dp-aware`` each DP rank is listed as ``"<url>@<rank>"`` (stripped here).
  ``POST /workers {"url"}`` answers 202 and registers in the background.
* Forwarded: ``/generate`` (re-serialized through a typed struct: ``rid`` is kept,
  unknown fields and ``sampling_params.spaces_between_special_tokens`` are
  dropped) and ``GET /get_model_info`` (one worker's answer). ``/v1/models`` is
  answered by the router itself; ``/v1/loads`` is 404.
  ``POST /flush_cache`` is fanned out by the router itself. ``/pause_generation``,
  ``/continue_generation``, ``/abort_request``, ``/update_weight*`` and
  ``/model_info`` answer 404.
* 4xx from an engine are passed through unchanged; 5xx are retried (5 attempts
  by default) and count towards a per-engine circuit breaker; with every circuit
  open it answers 503 ``no_available_workers``. Its own JSON type errors are 422
  with a plain-text body.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
from typing import AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

import aiohttp

from pipeline.types import PauseMode, choices

from .engine import META_TIMEOUT_S, EngineClient, make_session, split_credentials
from .engine_answers import GenerateResult
from .engine_errors import EngineControlError, EngineError, EngineRequestError
from .engine_stream import DEFAULT_STREAM_INTERVAL, StreamProgress

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The router's /workers lists a DP-aware engine once per rank as "url@rank";
# control calls must go to the engine's base URL, once.
_DP_RANK_SUFFIX = re.compile(r"@\d+$")


def _normalize_engine_url(url: str) -> str:
    return _DP_RANK_SUFFIX.sub("", url.strip()).rstrip("/")


def _dedupe(urls: list[str]) -> list[str]:
    return list(dict.fromkeys(urls))


async def discover_engines(url: str, session: aiohttp.ClientSession | None) -> list[str]:
    """Engine base URLs behind ``url``: the router's workers, or ``[url]`` for an engine.

    Current routers answer ``GET /workers`` with ``{"workers": [{"id", "url", ...}]}``,
    older ones ``GET /list_workers`` with ``{"urls": [...]}``; an engine answers 404
    to both. A router that has not registered its workers yet returns ``[]``.
    """
    client = EngineClient(url, session, timeout_s=META_TIMEOUT_S)
    base = client.url  # without credentials
    try:
        statuses: list[int | None] = []
        for path in ("/workers", "/list_workers"):
            try:
                body = await client._request("GET", path)
            except EngineRequestError as exc:
                statuses.append(exc.status)
                continue
            if isinstance(body, dict) and isinstance(body.get("workers"), list):
                workers = [w for w in body["workers"] if isinstance(w, dict) and w.get("url")]
                for w in workers:
                    if w.get("is_healthy") is False:
                        # Still listed: it may come back with stale weights, so it
                        # must receive control calls too (their failure is reported).
                        logger.warning("router %s reports engine %s unhealthy", base, w["url"])
                engines = _dedupe([_normalize_engine_url(w["url"]) for w in workers])
            elif isinstance(body, dict) and isinstance(body.get("urls"), list):
                engines = _dedupe([_normalize_engine_url(str(u)) for u in body["urls"]])
            else:
                statuses.append(None)  # answered, but not a worker list
                continue
            if not engines:
                logger.warning("router %s has no registered engines (yet)", base)
            logger.debug("router %s -> engines %s", base, engines)
            return engines
        if statuses == [404, 404]:
            return [base]
        # Neither 404 nor a worker list: accept the URL as an engine only if it
        # answers like one (raises EngineError otherwise).
        await client.model_info()
        return [base]
    finally:
        await client.close()




class EngineSet:
    """The engines a worker or trainer uses, given as engine and/or router URLs.

    ``generate`` goes through the given URLs (when several, to the one with the fewest
    requests in flight from this set, round-robin among ties, skipping those in
    ``draining`` while another is left; a router balances by itself). Control calls go to every discovered engine directly and
    concurrently; they return ``{engine_url: result}`` or raise
    ``EngineControlError`` naming each failing engine.
    """

    def __init__(
        self,
        urls: Sequence[str],
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 600.0,
        refresh_before_control: bool = True,
        vocab_size: int | None = None,
        api_key: str | None = None,
        stream: bool = False,
        stream_interval: int | None = DEFAULT_STREAM_INTERVAL,
    ):
        """`api_key`: the engines' and routers' SGLang `--api-key`, sent with every request
        (through the session this set makes; a given `session` carries its own headers).
        `stream`: `generate` reads the answer as a stream (`generate_stream`) and returns it
        whole; `stream_interval`: tokens per chunk asked of the engines when streaming."""
        if isinstance(urls, str):
            urls = [urls]
        given = _dedupe([u.rstrip("/") for u in urls])
        # The URLs as given (maybe with credentials), by the bare URL everything else uses:
        # credentials go only to the URL they came with, never to engines a router names.
        self._with_credentials = {split_credentials(u)[0]: u for u in given}
        self.urls = list(self._with_credentials)
        if not self.urls:
            raise ValueError("EngineSet needs at least one engine or router URL")
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.vocab_size = vocab_size  # bounds token ids in /generate answers; None: unknown
        self.stream = stream
        self.stream_interval = stream_interval
        # Re-discover before each control call so an engine that joined the router
        # since the last call is not left out of a pause or weight update.
        self.refresh_before_control = refresh_before_control
        self._session = session
        self._owns_session = session is None
        self._rr = itertools.count()
        self._gen_clients: list[EngineClient] | None = None
        self._in_flight = [0] * len(self.urls)  # generate requests (and function calls) per given URL
        self._by_source: dict[str, list[str]] = {}  # given URL -> engines behind it
        self._engine_clients: dict[str, EngineClient] = {}
        # Given URLs out of rotation (a rolling weight update is updating them): new
        # requests go elsewhere. Set by the worker from the control hash.
        self.draining: frozenset[str] = frozenset()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = make_session(self.timeout_s, self.api_key)
            self._owns_session = True
        return self._session

    def _client(self, url: str, vocab_size: int | None = None) -> EngineClient:
        return EngineClient(self._with_credentials.get(url, url), self._get_session(), self.timeout_s, vocab_size)

    @property
    def engines(self) -> list[str]:
        """Engine URLs found by the last refresh()."""
        return list(self._engine_clients)

    async def refresh(self) -> list[str]:
        """Re-discover the engines behind every given URL. A URL that answered as an
        engine itself is not asked again: only routers gain and lose engines.

        A source that fails discovery keeps its previously known engines (they
        can still be reached directly while a router restarts); one never
        discovered raises EngineControlError.
        """
        session = self._get_session()
        sources = [u for u in self.urls if self._by_source.get(u) != [u]]
        found = await asyncio.gather(
            *(discover_engines(self._with_credentials[u], session) for u in sources), return_exceptions=True
        )
        errors: dict[str, BaseException] = {}
        for source, res in zip(sources, found):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                if source in self._by_source:
                    logger.warning(
                        "discovery via %s failed (%s); keeping engines %s",
                        source, res, self._by_source[source],
                    )
                else:
                    errors[source] = res
            else:
                self._by_source[source] = res
        engines = _dedupe([e for src in self.urls for e in self._by_source.get(src, [])])
        clients = {}
        for e in engines:
            # Reuse clients so per-engine state (the pause fallback) survives refreshes.
            clients[e] = self._engine_clients.get(e) or self._client(e)
        self._engine_clients = clients
        if errors:
            raise EngineControlError("discovery", errors, {})
        return engines

    # -- generation -------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        if self.stream:
            progress = None
            async for progress in self.generate_stream(input_ids, sampling_params, rid, return_logprob):
                pass
            return progress.result
        with self.next_url() as i:
            return await self._generation_client(i).generate(input_ids, sampling_params, rid, return_logprob)

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> AsyncIterator[StreamProgress]:
        """`EngineClient.generate_stream` on the URL `next_url` chooses, counted in flight
        until the stream ends."""
        with self.next_url() as i:
            async for progress in self._generation_client(i).generate_stream(
                    input_ids, sampling_params, rid, return_logprob, self.stream_interval):
                yield progress

    def _generation_client(self, i: int) -> EngineClient:
        if self._gen_clients is None:
            self._gen_clients = [self._client(u, self.vocab_size) for u in self.urls]
        return self._gen_clients[i]

    @contextlib.contextmanager
    def next_url(self) -> Iterator[int]:
        """The given URL (its index) a new request goes to, counted in flight while the
        block runs: engines in rotation first (a rolling update drains one), then the
        fewest requests in flight, not plain round-robin: request times vary a lot, so
        round-robin queues requests at one engine while another has free slots. Generate
        functions, which make their own calls, get their address here too."""
        n, start = len(self.urls), next(self._rr)
        i = min(range(n), key=lambda j: (self.urls[j] in self.draining, self._in_flight[j], (j - start) % n))
        self._in_flight[i] += 1
        try:
            yield i
        finally:
            self._in_flight[i] -= 1

    # -- control fan-out --------------------------------------------------------------

    def only(self, engine_url: str) -> EngineSet:
        """The control calls of one engine (found by refresh()), on this set's session."""
        one = EngineSet([self._with_credentials.get(engine_url, engine_url)], self._get_session(), self.timeout_s,
                        refresh_before_control=False, api_key=self.api_key)
        one._by_source = {engine_url: [engine_url]}  # an engine, not a router: nothing to discover
        one._engine_clients = {engine_url: self._engine_clients.get(engine_url) or self._client(engine_url)}
        return one

    async def _fanout(
        self, operation: str, call: Callable[[EngineClient], Awaitable[T]]
    ) -> dict[str, T]:
        if self.refresh_before_control or not self._engine_clients:
            await self.refresh()
        if not self._engine_clients:
            raise EngineControlError(
                operation,
                {u: EngineError("no engines discovered", url=u) for u in self.urls},
                {},
            )
        clients = list(self._engine_clients.values())
        outcomes = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
        results: dict[str, T] = {}
        errors: dict[str, BaseException] = {}
        for client, out in zip(clients, outcomes):
            if isinstance(out, BaseException):
                if not isinstance(out, Exception):
                    raise out  # CancelledError / KeyboardInterrupt must propagate
                # Reported by the EngineControlError raised below, to the caller who decides.
                logger.debug("%s on engine %s failed: %s", operation, client.url, out)
                errors[client.url] = out
            else:
                results[client.url] = out
        if errors:
            raise EngineControlError(operation, errors, results)
        return results

    async def pause_generation(self, mode: str = "abort") -> dict[str, None]:
        if mode not in choices(PauseMode):
            raise ValueError(f"pause mode must be one of {choices(PauseMode)}, got {mode!r}")
        return await self._fanout("pause_generation", lambda c: c.pause_generation(mode))

    async def continue_generation(self) -> dict[str, None]:
        return await self._fanout("continue_generation", lambda c: c.continue_generation())

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> dict[str, None]:
        # Even a single rid goes to every engine: behind a router we do not know
        # which engine holds it, and the router does not route /abort_request.
        if not abort_all and not rid:
            raise ValueError("abort() needs a rid or abort_all=True")
        return await self._fanout("abort", lambda c: c.abort(rid, abort_all))

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict[str, dict]:
        return await self._fanout(
            "update_weights_from_disk",
            lambda c: c.update_weights_from_disk(model_path, weight_version, abort_all_requests, flush_cache),
        )

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> dict[str, dict]:
        return await self._fanout(
            "update_weight_version",
            lambda c: c.update_weight_version(new_version, abort_all_requests),
        )

    async def model_info(self) -> dict[str, dict]:
        return await self._fanout("model_info", lambda c: c.model_info())

    async def weight_versions(self) -> dict[str, str]:
        return await self._fanout("weight_version", lambda c: c.weight_version())

    async def weight_version_at(self, url: str) -> str:
        """The weight version one given URL (an engine, or a router's) reports now."""
        return await EngineClient(url, self._get_session(), self.timeout_s).weight_version()

    async def flush_cache(self) -> dict[str, bool]:
        return await self._fanout("flush_cache", lambda c: c.flush_cache())

    async def health(self) -> dict[str, bool]:
        """Health of the generation path: every given URL (routers included, since
        generation goes through them) and every discovered engine. Never raises:
        anything unreachable or undiscoverable maps to False."""
        try:
            await self.refresh()
        except EngineError as exc:
            logger.warning("engine discovery failed during health check: %s", exc)
        urls = _dedupe(self.urls + list(self._engine_clients))
        clients = [self._engine_clients.get(u) or self._client(u) for u in urls]
        healthy = await asyncio.gather(*(c.health() for c in clients))
        out = dict(zip(urls, healthy))
        for source in self.urls:
            if source not in self._by_source:
                out[source] = False  # never discovered: its engines are unknown
        return out

    async def close(self) -> None:
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()
