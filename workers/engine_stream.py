"""Streamed /generate answers (`"stream": true`): SGLang's server-sent events read chunk by
chunk, each chunk held to the rules a whole answer is held to (workers/engine_answers.py)
as it arrives, so that a stream cut half-way leaves every token received so far, checked.

SGLang sends chunks in two styles, and both are read here, told apart by
`completion_tokens` (the count of every token so far, in every chunk):

* cumulative (the default of 0.5.x): every chunk carries all the ids and log-probs so far
  (its `output_ids` may instead be only its new ids, as older releases' `--stream-output`
  sends them, or, in the chunk of a request aborted in the waiting queue, the last id);
* incremental (`--incremental-streaming-output`): every chunk carries only its new tokens.

A cumulative chunk grows with the answer, and parsing all of it every time would cost the
square of the answer's length in Python objects. So its log-prob entries are cut out of the
chunk's text (C string search), the rest is parsed as JSON, and only the entries after
those already received are parsed: the text of the earlier ones is skipped by its length,
known from the chunk before (a server writes the same entries the same way every time; if
one does not, the whole array is parsed, which is as correct, only slower). The bytes still
cross the network every time: against real SGLang, set its `--stream-interval` (tokens per
chunk), or send `stream_interval` per request where no router drops it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, AsyncIterator

import aiohttp

from .engine_answers import (GenerateResult, answer_limit, answer_meta, check_tokens, count_field, error_message,
                             finish_reason, finished_result, parse_generate_response, protocol_error, split_entries,
                             weight_version)
from .engine_errors import EngineError, EngineProtocolError, EngineRequestError, EngineUnavailable

#: Tokens per chunk the client asks for (sampling_params.stream_interval, SGLang's per-request
#: --stream-interval): a chunk costs the worker ~50 us whatever it holds (docs/performance.md),
#: and a second or two of decoding between chunks is all a checkpoint or a cut stream needs.
#: sglang-router drops the field: behind a router, set --stream-interval on the engines.
DEFAULT_STREAM_INTERVAL = 64
#: A finished stream whose chunks held fewer tokens than this on average (over at least
#: FEW_TOKENS_CHUNKS chunks) makes the client say once that its engines stream too often.
FEW_TOKENS_PER_CHUNK = 4
FEW_TOKENS_CHUNKS = 16
#: Chunks in a row that bring no token and do not finish: past this the stream is refused
#: (every honest chunk but the last brings tokens; this bounds the work an engine can cause).
MAX_IDLE_CHUNKS = 64

_DONE = b"[DONE]"
_ENTRIES_KEY = '"output_token_logprobs"'
_IDS_KEY = '"output_ids"'
_AFTER_KEY = re.compile(r"\s*:\s*")
_EMPTY_ARRAY = re.compile(r"\[\s*\]")
_NESTED_END = re.compile(r"\]\s*\]")  # the end of an array of arrays ([logprob, id, null] entries)
_SPACE = " \t\r\n"
#: Below this many bytes a chunk is parsed whole: cutting its arrays out costs more than it saves.
_CUT_OVER_BYTES = 4096


class ChunkStyle(StrEnum):
    CUMULATIVE = "cumulative"  # every chunk carries all the tokens so far
    INCREMENTAL = "incremental"  # every chunk carries its new tokens only


@dataclass(eq=False)
class StreamProgress:
    """What a streamed answer has produced so far: one object, updated chunk by chunk."""

    url: str | None
    rid: str
    output_ids: list[int] = field(default_factory=list)  # every token so far, checked
    output_log_probs: list[float] = field(default_factory=list)  # one per token (empty without return_logprob)
    weight_version: str | None = None  # the engine's, as the last chunk said ("default": it said none)
    new_tokens: int = 0  # how many the last chunk added
    chunks: int = 0
    style: ChunkStyle | None = None  # known from the first chunk after one with tokens
    result: GenerateResult | None = None  # the whole answer, once its final chunk came


class StreamAssembler:
    """Reads one streamed answer's chunks (the data of each event, `[DONE]` excluded)."""

    def __init__(self, url: str | None, rid: str, return_logprob: bool = True, vocab_size: int | None = None,
                 max_new_tokens: int | None = None):
        self.progress = StreamProgress(url, rid)
        self.return_logprob = return_logprob
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        #: A chunk carries at most a whole answer (a cumulative one is the answer so far).
        self.max_chunk_bytes = answer_limit(max_new_tokens)
        self._prefix = 0  # characters of the primary array's text covering the entries received
        self._ids_prefix = 0  # the same for output_ids, when they are all the ids so far
        self._raw_version: Any = None  # weight_version as the last chunk wrote it
        self._texts: list[str] = []  # incremental chunks' text, joined at the end
        self._idle = 0

    @property
    def _primary(self) -> str:
        return "output_token_logprobs" if self.return_logprob else "output_ids"

    def feed(self, data: bytes) -> bool:
        """Take one chunk; True when it brought tokens or finished the answer. Raises
        EngineProtocolError (a chunk that breaks the protocol), or EngineRequestError /
        EngineUnavailable for an error chunk (SGLang's `{"error": {...}}`)."""
        p = self.progress
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise protocol_error(p.url, data[:400].decode("utf-8", "replace"))(
                f"a chunk that is not UTF-8 ({exc})") from None
        bad = protocol_error(p.url, text)  # its first characters go in the error
        if p.result is not None:
            raise bad("a chunk after the final one")
        if len(data) > self.max_chunk_bytes:
            raise bad(f"a chunk of {len(data)} bytes, more than the {self.max_chunk_bytes} allowed "
                      "(workers.engine_answers.answer_limit)")
        p.chunks += 1
        chunk, primary, ids_field = self._parse(text, bad)
        if isinstance(chunk, dict) and "error" in chunk and "meta_info" not in chunk:
            raise self._error(chunk)
        meta = answer_meta(chunk, bad)
        finish_type, raw_reason = finish_reason(meta, bad, final=False)
        count = count_field(meta, "completion_tokens", bad)
        received = len(p.output_ids)
        if primary is None:  # no such key, or null
            if self.return_logprob and finish_type != "abort":
                raise bad(f"a chunk {'with finish_reason ' + repr(finish_type) if finish_type else ''} "
                          "without output_token_logprobs")
            entries: list = []
        else:
            entries = self._entries(primary, count, bad)
        if self.return_logprob:
            ids, log_probs = split_entries(entries, bad)
        else:
            ids, log_probs = entries, []
        check_tokens(ids, log_probs, self.vocab_size, self.return_logprob, bad)
        if self.max_new_tokens is not None and received + len(ids) > self.max_new_tokens:
            raise bad(f"{received + len(ids)} output tokens, more than the {self.max_new_tokens} asked for "
                      "(max_new_tokens)")
        p.output_ids += ids
        p.output_log_probs += log_probs
        try:  # the rest of the chunk's checks: a chunk that fails one adds nothing
            self._check_rest(chunk, meta, ids, ids_field, count, finish_type, raw_reason, bad)
        except EngineError:
            del p.output_ids[received:], p.output_log_probs[received:]
            raise
        p.new_tokens = len(ids)
        if finish_type is not None:
            return True
        self._idle = 0 if ids else self._idle + 1
        if self._idle > MAX_IDLE_CHUNKS:
            raise bad(f"{self._idle} chunks in a row without a new token")
        return bool(ids)

    def _check_rest(self, chunk: dict, meta: dict, ids: list, ids_field: tuple[str | None, Any] | None,
                    count: int | None, finish_type: str | None, raw_reason: dict | None, bad) -> None:
        """A chunk's checks after its tokens were added to the progress (which they read);
        the final chunk's answer made here."""
        p = self.progress
        if ids_field is not None:
            self._check_output_ids(ids_field, ids, finish_type, bad)
        if count is not None and count != len(p.output_ids):
            raise bad(f"completion_tokens {count} but {len(p.output_ids)} output tokens")
        raw_version, version = meta.get("weight_version"), p.weight_version
        if version is None or raw_version != self._raw_version:
            version = weight_version(raw_version, bad)
        text = chunk.get("text")
        if text is not None and not isinstance(text, str):
            raise bad(f"text is a {type(text).__name__}, not a string")
        if p.style is not ChunkStyle.CUMULATIVE and text is not None:
            self._texts.append(text)
        if finish_type is not None:
            text = "".join(self._texts) if p.style is ChunkStyle.INCREMENTAL else text
            p.result = finished_result(chunk, meta, finish_type, raw_reason, p.output_ids, p.output_log_probs,
                                       text, p.url, bad)
        p.weight_version, self._raw_version = version, raw_version

    def whole(self, body: Any) -> None:
        """An answer that did not stream (a server that ignored `stream`): checked as one."""
        p = self.progress
        result = parse_generate_response(body, p.url, self.return_logprob, self.vocab_size, self.max_new_tokens)
        p.output_ids, p.output_log_probs = result.output_ids, result.output_log_probs
        p.new_tokens, p.weight_version, p.result = len(result.output_ids), result.weight_version, result
        p.chunks += 1

    # -- one chunk -------------------------------------------------------------------

    def _parse(self, text: str, bad) -> tuple[Any, tuple[str | None, Any] | None, tuple[str | None, Any] | None]:
        """(the chunk parsed with its token arrays emptied, the primary array, the output_ids
        array), each array as (its text, None) or, parsed whole, (None, its value); None
        where the chunk has none. A small chunk, or one whose arrays cannot be cut out, is
        parsed whole."""
        if len(text) < _CUT_OVER_BYTES or self.progress.style is ChunkStyle.INCREMENTAL:
            return self._parse_whole(text, bad)
        primary_span = _array_span(text, _ENTRIES_KEY if self.return_logprob else _IDS_KEY, self.return_logprob)
        ids_span = _array_span(text, _IDS_KEY, False) if self.return_logprob else None
        spans = sorted(s for s in (primary_span, ids_span) if s is not None)
        if len(spans) == 2 and spans[0][1] > spans[1][0]:
            spans = []  # overlapping: not what they seemed; parse the whole chunk
        if spans:
            pieces, at = [], 0
            for start, end in spans:
                pieces += [text[at:start], "[]"]
                at = end
            pieces.append(text[at:])
            try:
                chunk = json.loads("".join(pieces))
            except (ValueError, RecursionError):
                chunk = None
            meta = chunk.get("meta_info") if isinstance(chunk, dict) else None
            cut_right = isinstance(meta, dict) and (
                primary_span is None or (meta if self.return_logprob else chunk).get(self._primary) == []) and (
                ids_span is None or chunk.get("output_ids") == [])
            if cut_right:
                primary = None if primary_span is None else (text[primary_span[0]:primary_span[1]], None)
                ids_field = None if ids_span is None else (text[ids_span[0]:ids_span[1]], None)
                if primary_span is None and (meta if self.return_logprob else chunk).get(self._primary) is not None:
                    primary = (None, (meta if self.return_logprob else chunk)[self._primary])
                if ids_span is None and self.return_logprob and chunk.get("output_ids") is not None:
                    ids_field = (None, chunk["output_ids"])
                return chunk, primary, ids_field
        return self._parse_whole(text, bad)

    def _parse_whole(self, text: str, bad) -> tuple[Any, tuple[str | None, Any] | None, tuple[str | None, Any] | None]:
        try:
            chunk = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise bad(f"a chunk that is not JSON ({exc})") from None
        if not isinstance(chunk, dict):
            return chunk, None, None
        meta = chunk.get("meta_info")
        holder = meta if self.return_logprob else chunk
        value = holder.get(self._primary) if isinstance(holder, dict) else None
        ids_value = chunk.get("output_ids") if self.return_logprob else None
        return (chunk, None if value is None else (None, value),
                None if ids_value is None else (None, ids_value))

    def _entries(self, primary: tuple[str | None, Any], count: int | None, bad) -> list:
        """The chunk's new entries (log-prob entries, or ids without return_logprob)."""
        p = self.progress
        received = len(p.output_ids)
        array_text, value = primary
        if array_text is not None and received and p.style is not ChunkStyle.INCREMENTAL:
            tail = _tail(array_text, self._prefix, self.return_logprob)
            # Where the entries received end, the new ones begin: a cumulative chunk, if its count agrees
            # (without one, only in a stream known to be cumulative: an incremental chunk can fit by chance).
            fits = tail is not None and (received + len(tail) == count if count is not None
                                         else p.style is ChunkStyle.CUMULATIVE)
            if fits:
                self._set_style(ChunkStyle.CUMULATIVE, bad)
                self._prefix = _after_last_entry(array_text)
                return tail
        if value is None:
            try:
                value = json.loads(array_text)
            except (ValueError, RecursionError) as exc:
                raise bad(f"{self._primary} is not JSON ({exc})") from None
        if type(value) is not list:
            raise bad(f"{self._primary} is a {type(value).__name__}, not a list")
        n = len(value)
        if array_text is not None:
            self._prefix = _after_last_entry(array_text)
        if not received:
            return value  # the first tokens: both styles agree
        if count is None:
            if p.style is ChunkStyle.INCREMENTAL:
                return value
            if p.style is ChunkStyle.CUMULATIVE and n >= received:
                return value[received:]
            raise bad("a chunk without completion_tokens: its entries cannot be told to be all the tokens so far "
                      "or only the new ones")
        if n == count:
            self._set_style(ChunkStyle.CUMULATIVE, bad)
            return value[received:]
        if received + n == count:
            self._set_style(ChunkStyle.INCREMENTAL, bad)
            return value
        raise bad(f"{self._primary} has {n} entries: neither all {count} tokens so far (completion_tokens) nor "
                  f"the {count - received} after the {received} received")

    def _set_style(self, style: ChunkStyle, bad) -> None:
        p = self.progress
        if p.style is not None and p.style is not style:
            raise bad(f"a chunk of {style.value} tokens in a stream of {p.style.value} ones")
        p.style = style

    def _check_output_ids(self, ids_field: tuple[str | None, Any], new_ids: list, finish_type: str | None,
                          bad) -> None:
        """`output_ids`, when a chunk carries them, are its new ids, or all the ids so far
        (of which only those after the last chunk's are read, as for the log-probs), or the
        last id (SGLang's chunk for a request aborted in its waiting queue)."""
        array_text, value = ids_field
        total = self.progress.output_ids
        if value is not None:
            if type(value) is not list:
                raise bad(f"output_ids is a {type(value).__name__}, not a list")
            m = len(value)
        else:
            inner = array_text[1:-1].strip(_SPACE)
            m = inner.count(",") + 1 if inner else 0

        def ids() -> Any:
            if value is not None:
                return value
            try:
                return json.loads(array_text)
            except (ValueError, RecursionError) as exc:
                raise bad(f"output_ids is not JSON ({exc})") from None

        if m == len(new_ids):
            agree = ids() == new_ids
        elif m == len(total):
            tail = None if value is not None else _tail(array_text, self._ids_prefix, False)
            if tail is None or len(tail) != len(new_ids):
                tail = ids()[len(total) - len(new_ids):]
            agree = tail == new_ids
        else:
            agree = m == 1 and finish_type == "abort" and ids() == total[-1:]
        if not agree:
            raise bad(f"output_ids ({m} ids) disagree with the {len(total)} token ids of output_token_logprobs "
                      f"({len(new_ids)} new in this chunk)")
        if array_text is not None:
            self._ids_prefix = _after_last_entry(array_text)

    def _error(self, chunk: dict) -> EngineError:
        """SGLang's error chunk (`{"error": {"message", "code"?}}`; a ValueError while
        generating: a bad request), as the HTTP status it would have answered."""
        url = self.progress.url
        err = chunk.get("error")
        code = err.get("code") if isinstance(err, dict) else None
        status = code if type(code) is int else 400
        message = f"POST {url}/generate -> error in the stream (status {status}): {error_message(chunk)}"
        if status >= 500 or status in (408, 429):
            return EngineUnavailable(message, url=url, status=status)
        return EngineRequestError(message, url=url, status=status)


def _tail(array_text: str, prefix: int, nested: bool) -> list | None:
    """The entries of an array's text after its first `prefix` characters (those of the
    entries already received), or None when the text there is not the boundary of an
    entry (the caller then parses the whole array)."""
    if not 0 < prefix < len(array_text) or (nested and array_text[prefix - 1] != "]"):
        return None
    rest = array_text[prefix:].lstrip(_SPACE)
    if rest.startswith("]"):
        return []
    if not rest.startswith(","):
        return None
    try:
        tail = json.loads("[" + rest[1:])
    except (ValueError, RecursionError):
        return None
    return tail if type(tail) is list else None


def _array_span(text: str, key: str, nested: bool) -> tuple[int, int] | None:
    """(start, end) of the JSON array after `key` in `text` (text[start] is its `[`,
    text[end - 1] its `]`), or None: no such key, or not followed by an array. `nested`:
    an array of arrays, which ends at the first `]` after a `]` (entries hold no strings
    here: return_text_in_logprobs is never asked for; a wrong cut is caught by the caller)."""
    at = text.find(key)
    colon = _AFTER_KEY.match(text, at + len(key)) if at >= 0 else None
    if colon is None:
        return None
    start = colon.end()
    if start >= len(text) or text[start] != "[":
        return None
    if nested:
        empty = _EMPTY_ARRAY.match(text, start)
        if empty:
            return start, empty.end()
        end = _NESTED_END.search(text, start)
        return (start, end.end()) if end else None
    end = text.find("]", start)
    return (start, end + 1) if end >= 0 else None


def _after_last_entry(array_text: str) -> int:
    """The index just after the last entry of an array's text (1 for an empty array)."""
    j = len(array_text) - 2  # before the closing bracket
    while j > 0 and array_text[j] in _SPACE:
        j -= 1
    return j + 1


async def sse_data(content: aiohttp.StreamReader, max_event_bytes: int, url: str | None) -> AsyncIterator[bytes]:
    """The data of each server-sent event read from `content` as it arrives (its `data:`
    lines joined by newlines; comments and other fields skipped). An event larger than
    `max_event_bytes` is refused while it is read. An event cut off by the end of the body
    is dropped, but a last `data: [DONE]` without its blank line is taken."""
    buf = bytearray()
    scan = 0  # where to look for the next blank line
    async for piece in content.iter_any():
        if b"\r" in piece:  # CRLF lines; a CR is only ever whitespace in JSON, never inside a string
            piece = piece.replace(b"\r", b"")
        buf += piece
        start = 0  # the events of this piece are cut from the buffer once, after them
        while (end := buf.find(b"\n\n", max(scan, start))) >= 0:
            data = _event_data(buf, start, end)
            start = end + 2
            if data is not None:
                yield data
        del buf[:start]
        if len(buf) > max_event_bytes:
            raise EngineProtocolError(f"a stream event from {url} is over {max_event_bytes} bytes "
                                      "(workers.engine_answers.answer_limit)", url=url)
        scan = max(0, len(buf) - 1)
    if _event_data(buf, 0, len(buf)) == _DONE:
        yield _DONE


def _event_data(buf: bytearray, start: int, end: int) -> bytes | None:
    if buf.startswith(b"data: ", start) and buf.find(b"\n", start, end) < 0:  # the usual one-line event
        return bytes(buf[start + 6:end])
    lines = [line for line in bytes(buf[start:end]).split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:] for line in lines)


def is_done(data: bytes) -> bool:
    """The event that ends a stream (`data: [DONE]`)."""
    return data == _DONE
