"""Async client for SGLang's native HTTP API, plus router discovery.

The protocol is described in /work/shared/SGLANG_API.md. Two layers:

* ``EngineClient`` talks to one URL (an engine, or a router for ``/generate``).
* ``EngineSet`` takes the URLs a worker was configured with (engines and/or
  routers): generation goes through those URLs, control calls go to every
  engine *behind* them, because the router answers 404 to ``/pause_generation``,
  ``/abort_request``, ``/update_weights_*`` and friends.

Error taxonomy (what callers branch on):

* ``EngineUnavailable``: connection refused/reset/dropped, timeouts, HTTP 5xx,
  408 and 429. Retriable: the same request may succeed later or elsewhere.
* ``EngineRequestError``: any other 4xx. The request itself is bad; retrying it
  unchanged is pointless (poison input → dead letters).
* ``EngineProtocolError`` (an ``EngineUnavailable``): a 200 answer that breaks
  the protocol: not JSON, no ``meta_info``, an unknown finish reason, token ids
  outside the vocabulary or int32, log-probs that are not finite floats or not one
  per token, ``completion_tokens`` disagreeing with the tokens, ``output_ids``
  disagreeing with the ids in ``output_token_logprobs``, more tokens than
  ``max_new_tokens`` asked for, a body larger than ``answer_limit`` after
  decompression, a redirect (never followed). Retriable like
  ``EngineUnavailable`` (the same request may reach a healthy engine), but it is a
  protocol error, never a sample; ``head`` holds the answer's first bytes.
* ``EngineError``: the base class.
* ``EngineControlError``: an ``EngineSet`` control call failed on some engines;
  lists each failing engine URL with its error.

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
import base64
import contextlib
import itertools
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, Sequence, TypeVar

import aiohttp
from yarl import URL

from pipeline.connection import redact
from pipeline.types import PauseMode, choices

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Discovery, health and similar metadata calls should not inherit the long
# generation timeout: a hung router must not stall a weight update for 10 min.
META_TIMEOUT_S = 10.0
# The router's /workers lists a DP-aware engine once per rank as "url@rank";
# control calls must go to the engine's base URL, once.
_DP_RANK_SUFFIX = re.compile(r"@\d+$")
FINISH_TYPES = ("stop", "length", "abort")
#: Characters of a bad answer kept in an EngineProtocolError (and so in dead letters).
HEAD_CHARS = 200
#: Token ids travel as int32 on the wire (pipeline/codec.py).
INT32_MAX = 2**31 - 1
#: Log-probs travel as float32: a finite float64 beyond this would arrive as inf.
FLOAT32_MAX = 3.4028234663852886e38
_MISSING = object()
#: SGLang's default max_new_tokens, for a request that does not say.
DEFAULT_MAX_NEW_TOKENS = 128
#: Bytes a /generate answer may take per token asked for, after decompression. An answer
#: carries per token an output_token_logprobs entry, an output id and the token's text:
#: 24 bytes from the simulator (measured), a few tens from SGLang with real vocabularies;
#: 1 KiB leaves room for long tokens written as \u escapes.
ANSWER_BYTES_PER_TOKEN = 1024
#: Bytes any answer may take whatever was asked (meta_info, a router's worker list).
ANSWER_BASE_BYTES = 1 << 20
#: Bytes read from the network at a time while an answer is bounded.
_READ_CHUNK = 1 << 16


def answer_limit(max_new_tokens: int | None) -> int:
    """The most bytes (after decompression) a /generate answer for `max_new_tokens`
    may take: ANSWER_BASE_BYTES + ANSWER_BYTES_PER_TOKEN per token; 33 MiB for 32k
    tokens. A larger answer is refused while it is read, before it is parsed."""
    tokens = max_new_tokens if isinstance(max_new_tokens, int) and max_new_tokens > 0 else DEFAULT_MAX_NEW_TOKENS
    return ANSWER_BASE_BYTES + ANSWER_BYTES_PER_TOKEN * tokens


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


# --------------------------------------------------------------------------- errors


class EngineError(Exception):
    """Base class for everything this module raises about an engine."""

    def __init__(self, message: str, url: str | None = None, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status


class EngineUnavailable(EngineError):
    """The engine could not answer (network, timeout, 5xx). Retriable."""


class EngineRequestError(EngineError):
    """The engine rejected the request (4xx). Not retriable as is."""


class EngineProtocolError(EngineUnavailable):
    """A 200 answer that is not a valid SGLang answer. Retriable; never a sample.
    `head` is the answer's first HEAD_CHARS characters, for the dead letter."""

    def __init__(self, message: str, url: str | None = None, head: str = ""):
        super().__init__(f"{message}; the answer began {head!r}" if head else message, url=url)
        self.head = head


class EngineControlError(EngineError):
    """A fanned-out control call failed on at least one engine.

    ``errors`` maps each failing engine URL to its exception, ``results`` holds
    the answers of the engines that succeeded (so the caller can see exactly
    which engines already paused / loaded the new weights).
    """

    def __init__(self, operation: str, errors: dict[str, BaseException], results: dict[str, Any]):
        total = len(errors) + len(results)
        details = "; ".join(f"engine {url} failed: {err}" for url, err in errors.items())
        super().__init__(
            f"{operation} failed on {len(errors)} of {total} engine(s): {details}",
            url=next(iter(errors), None),
        )
        self.operation = operation
        self.errors = errors
        self.results = results


# --------------------------------------------------------------------------- results


@dataclass
class GenerateResult:
    output_ids: list[int]
    output_log_probs: list[float]
    text: str
    finish_type: str  # "stop" | "length" | "abort"
    finish_reason: dict | None  # raw meta_info.finish_reason
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    rid: str
    e2e_latency: float | None
    url: str | None = None  # the URL that answered (without credentials)


def _head(data: Any) -> str:
    """The first characters of an answer, as the engine sent them (near enough)."""
    if isinstance(data, str):
        return data[:HEAD_CHARS]
    try:
        return json.dumps(data)[:HEAD_CHARS]
    except (TypeError, ValueError, RecursionError):
        return f"<{type(data).__name__}>"


def _check_token_ids(ids: list, vocab_size: int | None) -> str | None:
    """Why `ids` are not token ids of this vocabulary, or None."""
    if not ids:
        return None
    if not set(map(type, ids)) <= {int}:
        return "has token ids that are not integers"
    limit = vocab_size if vocab_size is not None else INT32_MAX + 1
    low, high = min(ids), max(ids)
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        where = f"the vocabulary of {vocab_size}" if vocab_size is not None else "int32"
        return f"has token id {bad}, outside {where}"
    return None


def _check_log_probs(log_probs: list) -> str | None:
    """Why `log_probs` are not finite float32-sized numbers, or None."""
    if not log_probs:
        return None
    if not set(map(type, log_probs)) <= {float, int}:
        return "has log-probs that are not numbers"
    # NaN fails every comparison; ints compare exactly, however large.
    bad = next((x for x in log_probs if not -FLOAT32_MAX <= x <= FLOAT32_MAX), None)
    if bad is not None:
        return f"has log-prob {bad!r:.40}, not a finite float32"
    return None


def _count(value: Any) -> str:
    return f"{len(value)} ids" if isinstance(value, list) else f"a {type(value).__name__}"


def _utf8_text(value: Any) -> bool:
    """A str the wire format can store (no lone surrogates)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_generate_response(
    data: Any, url: str | None = None, return_logprob: bool = True, vocab_size: int | None = None,
    max_new_tokens: int | None = None,
) -> GenerateResult:
    """Turn one non-streaming ``/generate`` answer into a ``GenerateResult``, or raise
    ``EngineProtocolError`` saying what is wrong with it.

    Token ids and log-probs come from ``meta_info.output_token_logprobs``
    (``[logprob, token_id, text_or_null]``), as slime does. A missing key means
    zero tokens, but only for an abort: SGLang 0.4.10-0.5.2 omit it for "Abort
    before prefill"; a finished answer without it would become a sample with no
    tokens. `vocab_size` (None: unknown) bounds the token ids; int32 always does.
    `max_new_tokens` (None: unchecked) bounds their number: an engine that ignores
    it must not put tokens the trainer never asked for into a sample. When the answer
    also carries ``output_ids`` they must be the same ids: two versions of the output
    means neither can be trusted.
    """

    def bad(why: str) -> EngineProtocolError:
        return EngineProtocolError(f"malformed /generate answer from {url}: {why}", url=url, head=_head(data))

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("no meta_info object")

    raw_reason = meta.get("finish_reason")
    if isinstance(raw_reason, dict):
        finish_type = raw_reason.get("type")
    elif isinstance(raw_reason, str):  # tolerate a bare string, never seen in 0.4+
        finish_type, raw_reason = raw_reason, {"type": raw_reason}
    else:
        finish_type = None
    if finish_type not in FINISH_TYPES:
        # Fail loudly: an unknown finish state must not be published as a sample.
        raise bad(f"unknown finish_reason {raw_reason!r:.100}")

    completion_tokens = meta.get("completion_tokens", _MISSING)
    if completion_tokens is not _MISSING and (type(completion_tokens) is not int or completion_tokens < 0):
        raise bad(f"completion_tokens is {completion_tokens!r:.50}, not a count")
    ids: list = []
    log_probs: list = []
    if return_logprob:
        entries = meta.get("output_token_logprobs", _MISSING)
        if entries is _MISSING or entries is None:
            if finish_type != "abort":
                raise bad(f"finish_reason {finish_type!r} without output_token_logprobs")
        elif type(entries) is not list:
            raise bad(f"output_token_logprobs is a {type(entries).__name__}, not a list")
        else:
            try:  # comprehensions: this runs once per response token, thousands per second
                log_probs = [entry[0] for entry in entries]
                ids = [entry[1] for entry in entries]
            except (TypeError, KeyError, IndexError):
                raise bad("an output_token_logprobs entry is not [logprob, token_id, text]") from None
            why = _check_log_probs(log_probs)
            if why:
                raise bad(f"output_token_logprobs {why}")
        output_ids = data.get("output_ids", _MISSING)
        if output_ids is not _MISSING and output_ids is not None and output_ids != ids:
            raise bad(f"output_ids ({_count(output_ids)}) disagree with the {len(ids)} token ids of "
                      "output_token_logprobs")
    else:
        ids = data.get("output_ids") or []
        if type(ids) is not list:
            raise bad(f"output_ids is a {type(ids).__name__}, not a list")
    why = _check_token_ids(ids, vocab_size)
    if why:
        raise bad(f"{'output_token_logprobs' if return_logprob else 'output_ids'} {why}")
    if max_new_tokens is not None and len(ids) > max_new_tokens:
        raise bad(f"{len(ids)} output tokens, more than the {max_new_tokens} asked for (max_new_tokens)")
    if completion_tokens is _MISSING:
        completion_tokens = len(ids)
    elif completion_tokens != len(ids):
        raise bad(f"completion_tokens {completion_tokens} but {len(ids)} output tokens")

    text = data.get("text")
    text = "" if text is None else text
    version = meta.get("weight_version")
    # Engines before 0.5.2 have no weight versions; "default" is SGLang's own default.
    version = "default" if version is None or version == "" else version
    if type(version) is int:
        version = str(version)
    rid = meta.get("id")
    rid = "" if rid is None else rid
    for name, value in (("text", text), ("weight_version", version), ("id", rid)):
        if not _utf8_text(value):
            raise bad(f"{name} is not a UTF-8 string: {value!r:.50}")
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None and (type(prompt_tokens) is not int or prompt_tokens < 0):
        raise bad(f"prompt_tokens is {prompt_tokens!r:.50}, not a count")
    e2e = meta.get("e2e_latency")
    if e2e is not None and (type(e2e) not in (int, float) or not abs(e2e) < 1e300):  # NaN fails too
        raise bad(f"e2e_latency is {e2e!r:.50}, not a number of seconds")
    return GenerateResult(
        output_ids=ids,
        output_log_probs=log_probs,
        text=text,
        finish_type=finish_type,
        finish_reason=raw_reason,
        weight_version=version,
        prompt_tokens=prompt_tokens or 0,
        completion_tokens=completion_tokens,
        rid=rid,
        e2e_latency=None if e2e is None else float(e2e),
        url=url,
    )


def decode_body(raw: bytes) -> Any:
    """An HTTP answer's body: its JSON value, its text when it is not JSON (plain-text
    answers: router 422s, "Cache flushed.", a wrong service's HTML), None when empty."""
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply
        return text


def _error_message(body: Any) -> str:
    """Extract the human message from any of the error shapes engines/routers use."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])  # SGLang <= 0.5.22, router
        if isinstance(err, str):
            return err  # SGLang 0.5.23
        for key in ("message", "detail"):  # update_weights {"success": false, ...}; FastAPI
            if body.get(key):
                return str(body[key])
    if body in (None, ""):
        return "(empty body)"
    return str(body)[:500]


async def _read_bounded(resp: aiohttp.ClientResponse, max_bytes: int, what: str, url: str) -> bytes:
    """The body of `resp`, decompressed, refused past `max_bytes` (a gzip bomb or an
    endless chunked answer costs at most that much memory)."""
    def too_large(size: str) -> EngineProtocolError:
        return EngineProtocolError(f"{what}: the answer is {size} bytes, more than the {max_bytes} allowed "
                                   "(workers.engine.answer_limit)", url=url)
    declared = resp.content_length
    if declared is not None and declared > max_bytes and not resp.headers.get("Content-Encoding"):
        raise too_large(str(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(_READ_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise too_large(f"over {max_bytes}")
        chunks.append(chunk)
    return b"".join(chunks)


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


# --------------------------------------------------------------------------- one URL


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
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        kwargs: dict[str, Any] = {"timeout": timeout, "allow_redirects": False}
        if self._auth is not None:
            kwargs["headers"] = {"Authorization": self._auth}
        if send_body and payload is not None:
            kwargs["json"] = payload
        try:
            async with self._get_session().request(method, url, **kwargs) as resp:
                status = resp.status
                if 300 <= status < 400:
                    location, _ = split_credentials(resp.headers.get("Location", "(no Location)"))
                    raise EngineProtocolError(
                        f"{method} {url} -> HTTP {status} redirect to {location:.200}; redirects are never "
                        "followed: give the worker the URL that answers", url=self.url)
                raw = await _read_bounded(resp, max_bytes, f"{method} {url}", self.url)
        except asyncio.TimeoutError as exc:
            raise EngineUnavailable(
                f"{method} {url} timed out after {timeout.total:g}s", url=self.url
            ) from exc
        except aiohttp.ClientError as exc:
            # Refused, reset, server disconnected, payload cut short: all transient.
            raise EngineUnavailable(
                f"{method} {url} failed: {type(exc).__name__}: {exc}", url=self.url
            ) from exc

        body = decode_body(raw)
        if status < 400:
            return body
        message = f"{method} {url} -> HTTP {status}: {_error_message(body)}"
        # 408/429 are the router's queue timeout / rate limit: load, not a bad request.
        if status >= 500 or status in (408, 429):
            raise EngineUnavailable(message, url=self.url, status=status)
        raise EngineRequestError(message, url=self.url, status=status)

    # -- generation -------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if rid is not None:
            payload["rid"] = rid
        max_new_tokens = sampling_params.get("max_new_tokens")
        body = await self._request("POST", "/generate", payload, max_bytes=answer_limit(max_new_tokens))
        if isinstance(body, list):
            # A list answer means a batch or n > 1: this client is single-sample only.
            raise EngineProtocolError(
                f"malformed /generate answer from {self.url}: {len(body)} results; "
                "expected one (is sampling_params.n > 1?)",
                url=self.url,
                head=_head(body),
            )
        result = parse_generate_response(body, self.url, return_logprob, self.vocab_size,
                                         max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS)
        if not result.rid and rid is not None:
            result.rid = rid
        return result

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
        in_place): SGLang 0.5.23 fails the call otherwise, 0.5.15 crashes its scheduler."""
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
                f"{operation} on {self.url} failed: {_error_message(body)}", url=self.url
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


# --------------------------------------------------------------------------- discovery


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


# --------------------------------------------------------------------------- many URLs


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
    ):
        """`api_key`: the engines' and routers' SGLang `--api-key`, sent with every request
        (through the session this set makes; a given `session` carries its own headers)."""
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
        if self._gen_clients is None:
            self._gen_clients = [self._client(u, self.vocab_size) for u in self.urls]
        with self.next_url() as i:
            return await self._gen_clients[i].generate(input_ids, sampling_params, rid, return_logprob)

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
