"""Async client for one SGLang engine's native HTTP API (or a router's, for /generate).

The protocol is described in /work/shared/SGLANG_API.md. ``EngineClient`` talks to one
URL; ``workers/engine_set.py`` fans control calls out to every engine behind the URLs a
worker was given; ``workers/engine_answers.py`` checks answers; the errors and which are
retriable are in ``workers/engine_errors.py``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any, AsyncIterator

import aiohttp
from yarl import URL

from pipeline.connection import redact
from pipeline.types import PauseMode, choices

from .engine_answers import (ANSWER_BASE_BYTES, DEFAULT_MAX_NEW_TOKENS, GenerateResult, answer_head, answer_limit,
                             decode_body, error_message, parse_generate_response, read_bounded)
from .engine_errors import EngineError, EngineProtocolError, EngineRequestError, EngineStreamCut, EngineUnavailable
from .engine_stream import (DEFAULT_STREAM_INTERVAL, FEW_TOKENS_CHUNKS, FEW_TOKENS_PER_CHUNK, StreamAssembler,
                            StreamProgress, is_done, sse_data)

logger = logging.getLogger(__name__)

# Discovery, health and similar metadata calls should not inherit the long
# generation timeout: a hung router must not stall a weight update for 10 min.
META_TIMEOUT_S = 10.0


def split_credentials(url: str) -> tuple[str, str | None]:
    """`url` without its user and password, and those as a basic-auth Authorization
    header value (None: none given).
    The bare URL is the one shown anywhere (logs, errors, worker info, dead letters);
    the credentials go only in the Authorization header of requests to that URL."""
    try:
        parsed = URL(url)
    except ValueError:  # not a URL (a malformed port): nothing to send it to, nothing to show of it
        return redact(url), None
    if parsed.user is None and parsed.password is None:
        return url, None
    pair = f"{parsed.user or ''}:{parsed.password or ''}".encode()
    return str(parsed.with_user(None)), "Basic " + base64.b64encode(pair).decode("ascii")


def _generate_payload(input_ids: list[int], sampling_params: dict, rid: str | None,
                      return_logprob: bool) -> dict[str, Any]:
    """The /generate body of one sample (what slime sends; SGLANG_API.md)."""
    payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling_params,
                               "return_logprob": return_logprob}
    if rid is not None:
        payload["rid"] = rid
    return payload


def _partial(exc: EngineError, stream: StreamAssembler) -> EngineError:
    """`exc` carrying what the stream delivered before it."""
    exc.partial = stream.progress
    return exc


def make_session(timeout_s: float = 600.0, api_key: str | None = None) -> aiohttp.ClientSession:
    """One session for thousands of concurrent requests; with `api_key`, every request
    carries it as SGLang's `--api-key` expects (`Authorization: Bearer KEY`).

    limit=0 removes aiohttp's default cap of 100 connections, which would
    otherwise silently queue the worker's >= 4,096 in-flight generations.
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers
    )


class EngineClient:
    """Client for one SGLang engine (or a router, for /generate only). `vocab_size`
    (None: unknown) bounds the token ids accepted in /generate answers."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 600.0,
        vocab_size: int | None = None,
        api_key: str | None = None,
    ):
        # Credentials in the URL are kept out of self.url, which errors and logs show.
        self.url, self._auth = split_credentials(url.rstrip("/"))
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        self.api_key = api_key  # for a session of its own; a given session carries its headers
        self._session = session
        self._owns_session = session is None
        # None = unknown; False = engine predates 0.5.6 and takes no pause body.
        self._pause_takes_body: bool | None = None
        self._warned_chunks = False  # said once that the engine streams too often (_check_chunk_size)

    def _get_session(self) -> aiohttp.ClientSession:
        # Created lazily so the client can be built outside a running loop.
        if self._session is None or self._session.closed:
            self._session = make_session(self.timeout_s, self.api_key)
            self._owns_session = True
        return self._session

    async def close(self) -> None:
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()

    async def _request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        timeout_s: float | None = None,
        send_body: bool = True,
        max_bytes: int = ANSWER_BASE_BYTES,
    ) -> Any:
        """Send one request; return the decoded body (JSON, text or None).

        The answer is untrusted: a redirect is refused, never followed (it would send
        the prompt to a host the worker was never given), and the body is read in
        chunks and refused past `max_bytes` after decompression, before it is parsed.
        Raises EngineUnavailable / EngineRequestError according to the taxonomy
        in the module docstring.
        """
        url = self.url + path
        timeout_s = timeout_s or self.timeout_s
        try:
            async with self._get_session().request(method, url, **self._request_kwargs(payload, timeout_s,
                                                                                      send_body)) as resp:
                self._refuse_redirect(resp, method, url)
                raw = await read_bounded(resp, max_bytes, f"{method} {url}", self.url)
        except asyncio.TimeoutError as exc:
            raise EngineUnavailable(f"{method} {url} timed out after {timeout_s:g}s", url=self.url) from exc
        except aiohttp.ClientError as exc:
            # Refused, reset, server disconnected, payload cut short: all transient.
            raise EngineUnavailable(
                f"{method} {url} failed: {type(exc).__name__}: {exc}", url=self.url
            ) from exc
        body = decode_body(raw)
        if resp.status < 400:
            return body
        raise self._status_error(method, url, resp.status, body)

    def _request_kwargs(self, payload: Any, timeout_s: float, send_body: bool = True) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout_s), "allow_redirects": False}
        if self._auth is not None:
            kwargs["headers"] = {"Authorization": self._auth}
        if send_body and payload is not None:
            kwargs["json"] = payload
        return kwargs

    def _refuse_redirect(self, resp: aiohttp.ClientResponse, method: str, url: str) -> None:
        if 300 <= resp.status < 400:
            location, _ = split_credentials(resp.headers.get("Location", "(no Location)"))
            raise EngineProtocolError(
                f"{method} {url} -> HTTP {resp.status} redirect to {location:.200}; redirects are never "
                "followed: give the worker the URL that answers", url=self.url)

    def _status_error(self, method: str, url: str, status: int, body: Any) -> EngineError:
        message = f"{method} {url} -> HTTP {status}: {error_message(body)}"
        # 408/429 are the router's queue timeout / rate limit: load, not a bad request.
        if status >= 500 or status in (408, 429):
            return EngineUnavailable(message, url=self.url, status=status)
        return EngineRequestError(message, url=self.url, status=status)

    # -- generation -------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        payload = _generate_payload(input_ids, sampling_params, rid, return_logprob)
        max_new_tokens = sampling_params.get("max_new_tokens")
        body = await self._request("POST", "/generate", payload, max_bytes=answer_limit(max_new_tokens))
        if isinstance(body, list):
            # A list answer means a batch or n > 1: this client is single-sample only.
            raise EngineProtocolError(
                f"malformed /generate answer from {self.url}: {len(body)} results; "
                "expected one (is sampling_params.n > 1?)",
                url=self.url,
                head=answer_head(body),
            )
        result = parse_generate_response(body, self.url, return_logprob, self.vocab_size,
                                         max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS)
        if not result.rid and rid is not None:
            result.rid = rid
        return result

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str | None = None,
        return_logprob: bool = True,
        stream_interval: int | None = DEFAULT_STREAM_INTERVAL,
    ) -> AsyncIterator[StreamProgress]:
        """`/generate` with `"stream": true`. Yields its StreamProgress (one object, updated)
        after each chunk that brought tokens, every chunk checked as it came
        (workers/engine_stream.py); the last time with `result`, the answer as `generate`
        would return it. `stream_interval` (tokens per chunk) goes in the sampling params
        unless they name one (None: the engine's). Whatever ends the stream early raises
        an EngineError (EngineStreamCut when it just stopped) whose `partial` is the progress
        so far: every token received, checked. Leaving the loop early closes the connection
        (SGLang then aborts the request)."""
        params = dict(sampling_params)
        if stream_interval is not None:
            params.setdefault("stream_interval", stream_interval)
        payload = _generate_payload(input_ids, params, rid, return_logprob) | {"stream": True}
        max_new_tokens = sampling_params.get("max_new_tokens")
        stream = StreamAssembler(self.url, rid or "", return_logprob, self.vocab_size,
                                 max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS)
        url = self.url + "/generate"
        answered = False
        try:
            async with self._get_session().post(url, **self._request_kwargs(payload, self.timeout_s)) as resp:
                answered = True
                self._refuse_redirect(resp, "POST", url)
                if resp.status >= 400 or resp.content_type != "text/event-stream":
                    # An error, or an answer that did not stream (a server that ignores `stream`).
                    body = decode_body(await read_bounded(resp, stream.max_chunk_bytes, f"POST {url}", self.url))
                    if resp.status >= 400:
                        raise self._status_error("POST", url, resp.status, body)
                    stream.whole(body)
                    yield stream.progress
                    return
                async for data in sse_data(resp.content, stream.max_chunk_bytes, self.url):
                    if is_done(data):
                        break
                    if stream.feed(data) and stream.progress.result is None:
                        yield stream.progress
                # After [DONE] (or the end of the body), so the connection goes back to the pool.
                if stream.progress.result is None:
                    raise EngineStreamCut(f"POST {url}: the stream ended after {len(stream.progress.output_ids)} "
                                          f"tokens without its final chunk", url=self.url)
                self._check_chunk_size(stream.progress, params.get("stream_interval"))
                yield stream.progress
        except asyncio.TimeoutError as exc:
            raise _partial(EngineUnavailable(f"POST {url} timed out after {self.timeout_s:g}s", url=self.url),
                           stream) from exc
        except aiohttp.ClientError as exc:
            # Refused before an answer; or reset, the server gone, the body cut short: what came is kept.
            what = (f"broke off after {len(stream.progress.output_ids)} tokens" if answered else "failed")
            cls = EngineStreamCut if answered else EngineUnavailable
            raise _partial(cls(f"POST {url} {what}: {type(exc).__name__}: {exc}", url=self.url), stream) from exc
        except EngineError as exc:
            raise _partial(exc, stream)

    def _check_chunk_size(self, progress: StreamProgress, asked: Any) -> None:
        """Say once when the engine streams far more often than asked: a router dropped the
        request's stream_interval and the engines stream every token (SGLang's default)."""
        chunks, tokens = progress.chunks, len(progress.output_ids)
        if self._warned_chunks or chunks < FEW_TOKENS_CHUNKS or tokens >= FEW_TOKENS_PER_CHUNK * chunks:
            return
        self._warned_chunks = True
        logger.warning("engine %s streams a chunk every %.1f tokens (asked for every %s): each costs the worker "
                       "a chunk's work; behind sglang-router, which drops the request's stream_interval, start the "
                       "engines with --stream-interval %s", self.url, tokens / chunks, asked,
                       asked or DEFAULT_STREAM_INTERVAL)

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        if abort_all:
            payload: dict[str, Any] = {"abort_all": True}
        elif rid:
            payload = {"rid": rid}  # the engine matches rids by prefix
        else:
            raise ValueError("abort() needs a rid or abort_all=True")
        await self._request("POST", "/abort_request", payload)

    # -- pause / resume ---------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in choices(PauseMode):
            # Validate here: an invalid mode would be answered 400 and trigger
            # the old-engine fallback, silently turning a typo into an abort.
            raise ValueError(f"pause mode must be one of {choices(PauseMode)}, got {mode!r}")
        if self._pause_takes_body is not False:
            try:
                await self._request("POST", "/pause_generation", {"mode": mode})
                self._pause_takes_body = True
                return
            except EngineRequestError as exc:
                if self._pause_takes_body:
                    raise  # it accepted a body before: this is a real error
                logger.info(
                    "engine %s rejected a pause body (%s); retrying without one", self.url, exc
                )
        await self._request("POST", "/pause_generation", send_body=False)
        if self._pause_takes_body is None:
            self._pause_takes_body = False
            logger.info("engine %s takes /pause_generation without a body (pre-0.5.6)", self.url)
        if mode != "abort":
            logger.warning(
                "engine %s only supports pause mode 'abort' (SGLang < 0.5.6); requested %r, "
                "so its in-flight requests were aborted instead",
                self.url,
                mode,
            )

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    # -- weights ----------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict:
        """`flush_cache=False` when requests stay paused on the engine (retract,
        in_place): SGLang 0.5.23 fails the call otherwise, 0.5.15 and 0.5.20 crash their scheduler."""
        payload: dict[str, Any] = {
            "model_path": model_path,
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        body = await self._request("POST", "/update_weights_from_disk", payload)
        return self._check_success(body, "update_weights_from_disk")

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> dict:
        body = await self._request(
            "POST",
            "/update_weight_version",
            {"new_version": new_version, "abort_all_requests": abort_all_requests},
        )
        return self._check_success(body, "update_weight_version")

    def _check_success(self, body: Any, operation: str) -> dict:
        # Failures can also come back as 200 {"success": false}; never treat that as done.
        if not isinstance(body, dict):
            return {"success": True, "message": body}
        if body.get("success") is False:
            raise EngineRequestError(
                f"{operation} on {self.url} failed: {error_message(body)}", url=self.url
            )
        return body

    # -- metadata ---------------------------------------------------------------------

    async def model_info(self) -> dict:
        try:
            body = await self._request("GET", "/get_model_info", timeout_s=META_TIMEOUT_S)
        except EngineRequestError as exc:
            if exc.status != 404:
                raise
            body = await self._request("GET", "/model_info", timeout_s=META_TIMEOUT_S)
        if not isinstance(body, dict):
            raise EngineError(f"malformed model_info from {self.url}: {body!r:.200}", url=self.url)
        return body

    async def weight_version(self) -> str:
        info = await self.model_info()
        return str(info.get("weight_version") or "default")

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", timeout_s=META_TIMEOUT_S)
            return True
        except EngineError as exc:
            logger.debug("engine %s unhealthy: %s", self.url, exc)
            return False

    async def flush_cache(self) -> bool:
        """True when flushed; False when the engine refused (requests still running)."""
        try:
            await self._request("POST", "/flush_cache", send_body=False)
            return True
        except EngineRequestError as exc:
            logger.info("engine %s did not flush its cache: %s", self.url, exc)
            return False
