"""What a /generate answer must be: the checks every answer passes before it becomes
part of a sample (token ids, log-probs, counts, finish reason, strings, size), and
reading an answer's body within a bound. A violation is an ``EngineProtocolError``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from .engine_errors import EngineProtocolError

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


def answer_head(data: Any) -> str:
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
    means neither can be trusted. (A streamed answer is checked by the same rules, chunk
    by chunk: workers/engine_stream.py.)
    """
    bad = protocol_error(url, data)
    meta = answer_meta(data, bad)
    finish_type, raw_reason = finish_reason(meta, bad)
    completion_tokens = count_field(meta, "completion_tokens", bad)
    ids: list = []
    log_probs: list = []
    if return_logprob:
        entries = meta.get("output_token_logprobs", _MISSING)
        if entries is _MISSING or entries is None:
            if finish_type != "abort":
                raise bad(f"finish_reason {finish_type!r} without output_token_logprobs")
        else:
            ids, log_probs = split_entries(entries, bad)
        output_ids = data.get("output_ids", _MISSING)
        if output_ids is not _MISSING and output_ids is not None and output_ids != ids:
            raise bad(f"output_ids ({_count(output_ids)}) disagree with the {len(ids)} token ids of "
                      "output_token_logprobs")
    else:
        ids = data.get("output_ids") or []
        if type(ids) is not list:
            raise bad(f"output_ids is a {type(ids).__name__}, not a list")
    check_tokens(ids, log_probs, vocab_size, return_logprob, bad)
    if max_new_tokens is not None and len(ids) > max_new_tokens:
        raise bad(f"{len(ids)} output tokens, more than the {max_new_tokens} asked for (max_new_tokens)")
    if completion_tokens is not None and completion_tokens != len(ids):
        raise bad(f"completion_tokens {completion_tokens} but {len(ids)} output tokens")
    return finished_result(data, meta, finish_type, raw_reason, ids, log_probs, data.get("text"), url, bad)


def protocol_error(url: str | None, data: Any):
    """The factory of the EngineProtocolError for one answer (or chunk): its URL and first bytes."""
    def bad(why: str) -> EngineProtocolError:
        return EngineProtocolError(f"malformed /generate answer from {url}: {why}", url=url, head=answer_head(data))
    return bad


def answer_meta(data: Any, bad) -> dict:
    """An answer's meta_info, once it is a JSON object with one."""
    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("no meta_info object")
    return meta


def finish_reason(meta: dict, bad, final: bool = True) -> tuple[str | None, dict | None]:
    """(finish type, the raw finish_reason): one of FINISH_TYPES; (None, None) for an
    unfinished stream chunk when not `final`. Fail loudly: an unknown finish state must
    not be published as a sample."""
    raw_reason = meta.get("finish_reason")
    if isinstance(raw_reason, dict):
        finish_type = raw_reason.get("type")
    elif isinstance(raw_reason, str):  # tolerate a bare string, never seen in 0.4+
        finish_type, raw_reason = raw_reason, {"type": raw_reason}
    elif raw_reason is None and not final:
        return None, None
    else:
        finish_type = None
    if finish_type not in FINISH_TYPES:
        raise bad(f"unknown finish_reason {raw_reason!r:.100}")
    return finish_type, raw_reason


def count_field(meta: dict, name: str, bad) -> int | None:
    """A count in meta_info (completion_tokens, prompt_tokens); None when absent."""
    value = meta.get(name)
    if value is not None and (type(value) is not int or value < 0):
        raise bad(f"{name} is {value!r:.50}, not a count")
    return value


def split_entries(entries: Any, bad) -> tuple[list, list]:
    """(token ids, log-probs) of output_token_logprobs entries `[logprob, token_id, text]`."""
    if type(entries) is not list:
        raise bad(f"output_token_logprobs is a {type(entries).__name__}, not a list")
    try:  # comprehensions: this runs once per response token, thousands per second
        return [entry[1] for entry in entries], [entry[0] for entry in entries]
    except (TypeError, KeyError, IndexError):
        raise bad("an output_token_logprobs entry is not [logprob, token_id, text]") from None


def check_tokens(ids: list, log_probs: list, vocab_size: int | None, return_logprob: bool, bad) -> None:
    """Token ids in the vocabulary (int32 at least) and finite float32 log-probs."""
    why = _check_log_probs(log_probs)
    if why:
        raise bad(f"output_token_logprobs {why}")
    why = _check_token_ids(ids, vocab_size)
    if why:
        raise bad(f"{'output_token_logprobs' if return_logprob else 'output_ids'} {why}")


def weight_version(value: Any, bad) -> str:
    """meta_info.weight_version as the string SGLang means: "default" when absent (engines
    before 0.5.2 have none; it is SGLang's own default)."""
    version = "default" if value is None or value == "" else value
    if type(version) is int:
        version = str(version)
    if not _utf8_text(version):
        raise bad(f"weight_version is not a UTF-8 string: {version!r:.50}")
    return version


def finished_result(data: dict, meta: dict, finish_type: str, raw_reason: dict, ids: list, log_probs: list,
                    text: Any, url: str | None, bad) -> GenerateResult:
    """The GenerateResult of a finished answer whose tokens were checked: its strings and
    numbers checked here."""
    text = "" if text is None else text
    version = weight_version(meta.get("weight_version"), bad)
    rid = meta.get("id")
    rid = "" if rid is None else rid
    for name, value in (("text", text), ("id", rid)):
        if not _utf8_text(value):
            raise bad(f"{name} is not a UTF-8 string: {value!r:.50}")
    prompt_tokens = count_field(meta, "prompt_tokens", bad)
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
        completion_tokens=len(ids),
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


def error_message(body: Any) -> str:
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


async def read_bounded(resp: aiohttp.ClientResponse, max_bytes: int, what: str, url: str) -> bytes:
    """The body of `resp`, decompressed, refused past `max_bytes` (a gzip bomb or an
    endless chunked answer costs at most that much memory)."""
    def too_large(size: str) -> EngineProtocolError:
        return EngineProtocolError(f"{what}: the answer is {size} bytes, more than the {max_bytes} allowed "
                                   "(workers.engine_answers.answer_limit)", url=url)
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
