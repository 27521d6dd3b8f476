"""An SGLang-compatible inference server simulator (aiohttp, no GPU).

It answers like SGLang 0.5.15's native HTTP server (see shared/SGLANG_API.md) so
the workers, the demo, the tests and the benchmarks can run without an engine:
`/generate` (single, batch, ``n > 1``, SSE streaming), `/abort_request`,
`/pause_generation` (modes abort / retract / in_place), `/continue_generation`,
the weight-update and weight-version endpoints, `/get_model_info`,
`/get_server_info`, `/health`, `/health_generate`, `/flush_cache`, `/v1/models`
and `/v1/loads`.

What it "generates" (byte tokens, see `workers.tokenizer.ByteTokenizer`): filler
text whose total length is log-normal (settable median and p99), then EOS. When the
prompt asks ``What is A + B?`` (``+ - *``) the response ends with
``The answer is \\boxed{N}``, correct with probability `SimConfig.skill`, so a
response cut by ``max_new_tokens`` loses its answer. Everything is seeded: the same
seed and request give the same output (see `_sample_key` for what "same" means).

Timing: at most `max_running_requests` decode at once, the rest wait FIFO. A
running request pays `prefill_s`, then produces `decode_tokens_per_s` tokens per
second. No task runs per request: each has one timer for its completion time, and
partial progress (for aborts, pauses, streaming) is computed from elapsed time.

Simulator-only endpoints (not SGLang's): ``GET|POST /sim/faults`` reads or sets the
fault-injection knobs (`FAULT_FIELDS`), ``POST /sim/restart`` drops every
connection in flight and answers 503 for ``restart_s`` seconds (weights back to
the startup version, like a real restart), ``GET /sim/stats`` returns counters.

Deliberate simplifications, each documented where it happens: streaming chunks are
emitted every `stream_interval_s` seconds rather than every token; a streamed
request that hits an injected 500/503 gets the error status before the stream
starts; unknown sampling parameters are a 400.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import re
import statistics
import threading
import time
import uuid
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

from aiohttp import web

from workers.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.15.post1"  # the release whose HTTP answers this imitates

# Fields of SimConfig that `POST /sim/faults` may change at runtime.
FAULT_FIELDS = (
    "error_rate",
    "error_statuses",
    "latency_spike_rate",
    "latency_spike_s",
    "hang_rate",
    "drop_rate",
    "restart_s",
    "weight_update_fail_rate",
)

_Z99 = 2.3263478740408408  # standard normal quantile at 0.99
_ARITHMETIC = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)\?")
_FILLER_WORDS = (
    "let", "me", "think", "about", "this", "step", "by", "first", "we", "note", "that",
    "the", "problem", "asks", "for", "a", "value", "so", "consider", "each", "term",
    "carefully", "then", "combine", "them", "and", "check", "result", "again", "hence",
    "it", "follows", "which", "is", "consistent", "with", "what", "expect", "now",
)
_CACHE_ENTRIES = 100_000  # bound on the simulated prefix cache and per-prompt counters
# Token log-probs are drawn by indexing random bytes into this table: 256 quantiles of
# -|N(0, 0.8)|, rounded (short floats encode to JSON faster). One randbytes() call per
# request instead of one gauss() per token.
_LOGPROB_TABLE = tuple(round(-0.8 * statistics.NormalDist().inv_cdf(0.5 + 0.5 * (i + 0.5) / 256), 4)
                       for i in range(256))
_SUFFIXES, _SUFFIX_CUM_WEIGHTS = ("", ",", ".\n"), (80, 92, 100)


@dataclass
class SimConfig:
    """Everything the simulator does is set here; all randomness derives from `seed`."""

    seed: int = 0
    model_path: str = "sim/byte-lm"
    served_model_name: str | None = None  # defaults to model_path
    weight_version: str = "default"
    context_length: int = 32768
    max_total_num_tokens: int = 1_000_000  # KV capacity reported by /v1/loads
    # Scheduling and timing.
    max_running_requests: int = 256
    decode_tokens_per_s: float = 2000.0  # per running request
    prefill_s: float = 0.005
    stream_interval_s: float = 0.02  # how often a stream emits a chunk while progressing
    startup_s: float = 0.0  # /health answers 503 this long after start
    weight_update_s: float = 0.0  # time an update_weights_* call takes
    # What it generates.
    length_median: float = 64.0  # total response tokens, EOS included
    length_p99: float = 640.0
    skill: float = 0.5  # probability that an arithmetic answer is right
    skill_gain_per_version: float = 0.0  # added per numeric weight version (demo: rewards rise)
    # Fault injection (settable at runtime through POST /sim/faults).
    error_rate: float = 0.0  # /generate answered with one of error_statuses
    error_statuses: tuple[int, ...] = (500, 503)
    latency_spike_rate: float = 0.0  # /generate delayed by latency_spike_s first
    latency_spike_s: float = 1.0
    hang_rate: float = 0.0  # /generate never answers (until the client disconnects)
    drop_rate: float = 0.0  # /generate connection closed without any response
    restart_s: float = 2.0  # downtime of POST /sim/restart
    weight_update_fail_rate: float = 0.0  # update_weights_* answer success=false, 400

    def __post_init__(self) -> None:
        self.error_statuses = tuple(self.error_statuses)
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        if self.decode_tokens_per_s <= 0:
            raise ValueError("decode_tokens_per_s must be positive")
        if not 0 < self.length_median <= self.length_p99:
            raise ValueError("need 0 < length_median <= length_p99")
        if self.context_length < 2:
            raise ValueError("context_length must be at least 2")
        validate_faults({name: getattr(self, name) for name in FAULT_FIELDS})


def validate_faults(values: dict[str, Any]) -> dict[str, Any]:
    """Check fault settings (from SimConfig or /sim/faults); returns them normalized."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in FAULT_FIELDS:
            raise ValueError(f"unknown fault setting {name!r}; known: {', '.join(FAULT_FIELDS)}")
        if name == "error_statuses":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(v, int) and not isinstance(v, bool) and 400 <= v <= 599 for v in value)):
                raise ValueError("error_statuses must be a non-empty list of HTTP error codes (400-599)")
            out[name] = tuple(value)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number")
        if name.endswith("_rate") and not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
        if name.endswith("_s") and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        out[name] = float(value)
    return out


# --------------------------------------------------------------------------------------
# Request parsing and validation
# --------------------------------------------------------------------------------------


class SchemaError(Exception):
    """The body does not have the request's shape. SGLang's FastAPI layer answers
    these 400 with its ErrorResponse body, not the `{"error": ...}` one."""


_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
})


@dataclass
class GenSpec:
    """One normalized sub-request: a single prompt and a single sample."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int  # effective limit (SGLang clamps to the context length)
    min_new_tokens: int
    greedy: bool
    stop_strs: list[str]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    sampling_seed: int | None
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    client_rid: bool  # rid chosen by the client (seeds the sample, see _sample_key)


@dataclass
class ParsedGenerate:
    specs: list[GenSpec]
    single: bool  # answer one object instead of a list
    stream: bool
    n: int  # samples per prompt


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _param(params: dict, name: str, default: Any) -> Any:
    """SGLang treats an explicit null as "use the default"."""
    value = params.get(name)
    return default if value is None else value


def _number(params: dict, name: str, default: float) -> float:
    value = _param(params, name, default)
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    return float(value)


def _integer(params: dict, name: str, default: int) -> int:
    value = _param(params, name, default)
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    return value


def _check_sampling(params: dict) -> dict:
    """SGLang's SamplingParams.verify(), same messages; returns normalized values."""
    unknown = set(params) - _SAMPLING_KEYS
    if unknown:
        raise ValueError(f"Unknown sampling parameter(s): {', '.join(sorted(unknown))}.")
    temperature = _number(params, "temperature", 1.0)
    top_p = _number(params, "top_p", 1.0)
    top_k = _integer(params, "top_k", -1)
    min_p = _number(params, "min_p", 0.0)
    frequency_penalty = _number(params, "frequency_penalty", 0.0)
    presence_penalty = _number(params, "presence_penalty", 0.0)
    repetition_penalty = _number(params, "repetition_penalty", 1.0)
    min_new_tokens = _integer(params, "min_new_tokens", 0)
    n = _integer(params, "n", 1)
    max_new_tokens = params.get("max_new_tokens", 128)  # null: up to the context length
    if max_new_tokens is not None and not _is_int(max_new_tokens):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}.")

    if not math.isfinite(temperature) or temperature < 0.0:
        raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 and top_k != -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not -2.0 <= frequency_penalty <= 2.0:
        raise ValueError(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
    if not -2.0 <= presence_penalty <= 2.0:
        raise ValueError(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
    if not 0.0 < repetition_penalty <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}.")
    if min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.")
    if max_new_tokens is not None:
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if min_new_tokens > max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}.")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}.")
    if [params.get("json_schema"), params.get("regex"), params.get("ebnf")].count(None) < 2:
        raise ValueError("Only one of regex, json_schema, or ebnf can be set.")

    stop = params.get("stop")
    if stop is None:
        stop_strs: list[str] = []
    elif isinstance(stop, str):
        stop_strs = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_strs = list(stop)
    else:
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}.")
    stop_token_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise ValueError(f"stop_token_ids must be a list of integers, got {stop_token_ids!r}.")
    sampling_seed = params.get("sampling_seed")
    if sampling_seed is not None and not _is_int(sampling_seed):
        raise ValueError(f"sampling_seed must be an integer, got {sampling_seed!r}.")
    flags = {}
    for name, default in (("ignore_eos", False), ("skip_special_tokens", True), ("no_stop_trim", False),
                          ("spaces_between_special_tokens", True)):
        value = _param(params, name, default)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean, got {value!r}.")
        flags[name] = value
    return {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": min_new_tokens,
        "greedy": temperature < 1e-6,  # SGLang turns temperature ~0 into top_k=1
        "stop_strs": stop_strs,
        "stop_token_ids": frozenset(stop_token_ids),
        "sampling_seed": sampling_seed,
        "n": n,
        **flags,
    }


def _per_item(value: Any, name: str, batch: int, kind: type | tuple[type, ...], default: Any) -> list:
    """A request field that is either one value for all prompts or a list per prompt."""
    if value is None:
        return [default] * batch
    if isinstance(value, list):
        if len(value) != batch:
            raise ValueError(f"The length of {name} should be equal to the batch size.")
        for item in value:
            if not isinstance(item, kind) or isinstance(item, bool) and kind is int:
                raise SchemaError(f"{name} has an item of the wrong type: {item!r}")
        return list(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise SchemaError(f"{name} has the wrong type: {value!r}")
    return [value] * batch


def parse_generate(body: Any, tokenizer: ByteTokenizer, config: SimConfig) -> ParsedGenerate:
    """Normalize a /generate body like SGLang's GenerateReqInput + TokenizerManager.

    Raises SchemaError for a body of the wrong shape and ValueError for a request
    SGLang rejects (its message)."""
    if not isinstance(body, dict):
        raise SchemaError("The request body must be a JSON object.")
    text, input_ids = body.get("text"), body.get("input_ids")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise SchemaError("stream must be a boolean")

    # Shape checks first (FastAPI validates types before SGLang's code runs).
    if text is not None and not (isinstance(text, str) or isinstance(text, list)
                                 and all(isinstance(t, str) for t in text)):
        raise SchemaError("text must be a string or a list of strings")
    if input_ids is not None:
        ok = isinstance(input_ids, list) and (
            all(_is_int(t) for t in input_ids)
            or all(isinstance(row, list) and all(_is_int(t) for t in row) for row in input_ids))
        if not ok:
            raise SchemaError("input_ids must be a list of integers or a list of lists of integers")
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, str) or isinstance(rid, list)
                                and all(isinstance(r, str) for r in rid)):
        raise SchemaError("rid must be a string or a list of strings")
    sampling = body.get("sampling_params")
    if sampling is not None and not (isinstance(sampling, dict) or isinstance(sampling, list)
                                     and all(isinstance(s, dict) for s in sampling)):
        raise SchemaError("sampling_params must be an object or a list of objects")

    # GenerateReqInput.normalize_batch_and_arguments
    if (text is None) == (input_ids is None):
        raise ValueError("Either text or input_ids should be provided.")
    if text is not None:
        single = isinstance(text, str)
        prompts = [tokenizer.encode(t) for t in ([text] if single else text)]
    else:
        if len(input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        single = _is_int(input_ids[0])
        prompts = [list(input_ids)] if single else [list(row) for row in input_ids]
    batch = len(prompts)
    if isinstance(sampling, list):
        if single:
            raise ValueError("sampling_params must be an object for a single request.")
        if len(sampling) != batch:
            raise ValueError("The length of sampling_params should be equal to the batch size.")
        raw_params = sampling
    else:
        raw_params = [sampling or {}] * batch
    checked = [_check_sampling(p) for p in raw_params]
    n = checked[0]["n"] if checked else 1
    if any(c["n"] != n for c in checked):
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")

    return_logprob = _per_item(body.get("return_logprob"), "return_logprob", batch, bool, False)
    logprob_start_len = _per_item(body.get("logprob_start_len"), "logprob_start_len", batch, int, -1)
    top_logprobs_num = _per_item(body.get("top_logprobs_num"), "top_logprobs_num", batch, int, 0)
    text_in_logprobs = body.get("return_text_in_logprobs", False)
    if not isinstance(text_in_logprobs, bool):
        raise SchemaError("return_text_in_logprobs must be a boolean")
    if n > 1 and any(isinstance(body.get(k), list) for k in ("return_logprob", "logprob_start_len",
                                                             "top_logprobs_num")):
        raise ValueError("Cannot use list logprob parameters with parallel_sample_num > 1")

    # Request ids (GenerateReqInput._normalize_rid); n > 1 children always get new ones.
    if single and n == 1:
        if isinstance(rid, list):
            raise ValueError("The rid should be a string for a single request.")
        rids = [rid if rid is not None else uuid.uuid4().hex]
    elif n > 1:
        if isinstance(rid, list) and len(rid) != batch:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        rids = [uuid.uuid4().hex for _ in range(batch * n)]
    elif rid is None:
        rids = [uuid.uuid4().hex for _ in range(batch)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(batch)]
    else:
        if len(rid) != batch:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        rids = list(rid)
    client_rid = rid is not None and n == 1
    if len(set(rids)) != len(rids):
        raise ValueError(f"Duplicate request IDs in one batch: {rids}")

    specs = []
    for i in range(batch):  # prompt-major: all samples of prompt i, then prompt i + 1
        ids, params = prompts[i], checked[i]
        _check_prompt(ids, params["max_new_tokens"], tokenizer, config)
        limit = params["max_new_tokens"]
        limit = config.context_length - len(ids) - 1 if limit is None else min(
            limit, config.context_length - len(ids) - 1)
        if top_logprobs_num[i] < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num[i]}.")
        for j in range(n):
            specs.append(GenSpec(
                rid=rids[i * n + j], input_ids=ids, max_new_tokens=limit,
                min_new_tokens=params["min_new_tokens"], greedy=params["greedy"],
                stop_strs=params["stop_strs"], stop_token_ids=params["stop_token_ids"],
                ignore_eos=params["ignore_eos"], skip_special_tokens=params["skip_special_tokens"],
                no_stop_trim=params["no_stop_trim"], sampling_seed=params["sampling_seed"],
                return_logprob=return_logprob[i], logprob_start_len=logprob_start_len[i],
                top_logprobs_num=top_logprobs_num[i], return_text_in_logprobs=text_in_logprobs,
                client_rid=client_rid,
            ))
    return ParsedGenerate(specs=specs, single=single and n == 1, stream=stream, n=n)


def _check_prompt(ids: list[int], max_new_tokens: int | None, tokenizer: ByteTokenizer,
                  config: SimConfig) -> None:
    """TokenizerManager._validate_one_request: vocabulary and context length."""
    if not ids:
        raise ValueError("input_ids cannot be empty.")
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise ValueError(f"The input_ids {bad[:8]} contain values outside the vocab size ({tokenizer.vocab_size}).")
    ctx, length = config.context_length, len(ids)
    if length >= ctx:
        raise ValueError(f"The input ({length} tokens) is longer than the model's context length ({ctx} tokens).")
    if max_new_tokens is not None and max_new_tokens + length >= ctx:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
            f"You requested a total of {max_new_tokens + length} tokens: {length} tokens from the input "
            f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens "
            f"in the input messages or the completion to fit within the limit.")


# --------------------------------------------------------------------------------------
# What the "model" writes
# --------------------------------------------------------------------------------------


def draw_output_length(rng: random.Random, median: float, p99: float) -> int:
    """Total response length in tokens (EOS included), log-normal with this median and p99."""
    sigma = math.log(p99 / median) / _Z99
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


def _filler(rng: random.Random, length: int) -> str:
    """`length` characters of plausible-looking ASCII reasoning text."""
    if length <= 0:
        return ""
    words: list[str] = []
    size = 0
    while size <= length:  # the joined text is size - 1 long
        k = length // 5 + 4  # words average ~5.7 characters with their space: usually one round
        batch = [w + e for w, e in zip(rng.choices(_FILLER_WORDS, k=k),
                                       rng.choices(_SUFFIXES, cum_weights=_SUFFIX_CUM_WEIGHTS, k=k))]
        words.extend(batch)
        size += sum(map(len, batch)) + len(batch)
    return " ".join(words)[:length]


def _answer_line(prompt_text: str, rng: random.Random, skill: float) -> str | None:
    matches = _ARITHMETIC.findall(prompt_text)
    if not matches:
        return None
    a, op, b = matches[-1]  # the question is the last one (earlier ones may be examples)
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    if rng.random() >= skill:
        value += rng.choice((-3, -2, -1, 1, 2, 3))
    return f"The answer is \\boxed{{{value}}}"


@dataclass
class Plan:
    """The whole output a request will produce if nothing interrupts it."""

    tokens: list[int]
    logprobs: list[float]
    finish: dict  # finish_reason once all `tokens` are out


def plan_generation(spec: GenSpec, rng: random.Random, tokenizer: ByteTokenizer, config: SimConfig,
                    skill: float) -> Plan:
    """Deterministic given `rng`: draw the natural response, then apply SGLang's
    stopping rules (length first, then EOS / stop token ids, then stop strings)."""
    prompt_text = tokenizer.decode(spec.input_ids)
    total = max(draw_output_length(rng, config.length_median, config.length_p99), spec.min_new_tokens + 1)
    answer = _answer_line(prompt_text, rng, skill)
    if answer is None:
        body = _filler(rng, total - 1)
    else:
        room = total - 1 - len(answer)
        body = (_filler(rng, room - 1) + "\n" if room > 0 else "") + answer
    eos = tokenizer.eos_token_id
    if spec.ignore_eos:
        # The model keeps talking past where it would have stopped.
        extra = spec.max_new_tokens - len(body)
        data = (body + (" " + _filler(rng, extra - 1) if extra > 0 else "")).encode("utf-8")
        tokens = list(data)
    else:
        data = body.encode("utf-8")
        tokens = list(data) + [eos]

    # The earliest token that stops generation. SGLang checks, after each token: the
    # length limit, then stop token ids (EOS included, unless ignore_eos), then stop
    # strings; so a tie goes to the token id and reaching the limit beats both.
    stop_at: int | None = None
    matched: int | str | None = None
    if not spec.ignore_eos:
        stop_at, matched = len(data), eos
        for token in spec.stop_token_ids:
            pos = data.find(bytes((token,))) if 0 <= token < 256 else -1
            if pos != -1 and pos < stop_at:
                stop_at, matched = pos, token
    for stop in spec.stop_strs:
        encoded = stop.encode("utf-8")
        pos = data.find(encoded) if encoded else -1
        if pos != -1 and (stop_at is None or pos + len(encoded) - 1 < stop_at):
            stop_at, matched = pos + len(encoded) - 1, stop
    limit = spec.max_new_tokens
    if stop_at is not None and stop_at + 1 < limit:
        count, finish = stop_at + 1, {"type": "stop", "matched": matched}
    else:
        count, finish = min(limit, len(tokens)), {"type": "length", "length": limit}
    tokens = tokens[:count]
    logprobs = [_LOGPROB_TABLE[b] for b in rng.randbytes(len(tokens))]
    return Plan(tokens=tokens, logprobs=logprobs, finish=finish)


# --------------------------------------------------------------------------------------
# The engine: scheduling, abort, pause, weights
# --------------------------------------------------------------------------------------

FINISHED, ABORTED, DROPPED = "finished", "aborted", "dropped"
_ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
_ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


class SimRequest:
    """One sub-request inside the engine. States: waiting → running ⇄ frozen → done."""

    __slots__ = ("spec", "plan", "created", "future", "state", "done_tokens", "run_start",
                 "rate", "timer", "retractions", "cached_tokens", "outcome", "finish",
                 "final_tokens", "finished_at", "weight_version", "in_queue_abort", "seed_material")

    def __init__(self, spec: GenSpec, plan: Plan, created: float, future: asyncio.Future,
                 rate: float, cached_tokens: int, seed_material: str) -> None:
        self.spec = spec
        self.plan = plan
        self.created = created
        self.future = future
        self.state = "waiting"
        self.done_tokens = 0  # tokens produced before the current run segment
        self.run_start = 0.0  # loop time at which the current segment starts decoding
        self.rate = rate
        self.timer: asyncio.TimerHandle | None = None
        self.retractions = 0
        self.cached_tokens = cached_tokens
        self.outcome: str | None = None
        self.finish: dict | None = None
        self.final_tokens = 0
        self.finished_at = 0.0
        self.weight_version = ""  # the server's version when the request ended
        self.in_queue_abort = False
        self.seed_material = seed_material

    @property
    def rid(self) -> str:
        return self.spec.rid

    def progress(self, now: float) -> int:
        """Tokens produced so far."""
        if self.outcome is not None:
            return self.final_tokens
        if self.state != "running" or now <= self.run_start:
            return self.done_tokens
        return min(len(self.plan.tokens), self.done_tokens + int((now - self.run_start) * self.rate))


class Restarted(Exception):
    """The simulated engine restarted (or shut down) while a call was waiting."""


class SimEngine:
    """Scheduler state machine. All methods run on the server's event loop."""

    def __init__(self, config: SimConfig, tokenizer: ByteTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.weight_version = config.weight_version
        self.model_path = config.model_path
        self.paused = False
        self.requests: dict[str, SimRequest] = {}  # every live request, by rid
        self.running: dict[str, SimRequest] = {}  # running or frozen (in_place pause)
        self.waiting: deque[SimRequest] = deque()
        self.unavailable_until = 0.0  # loop time; 503 before it (startup, restart)
        self.stats: Counter[str] = Counter()
        self._writers = 0  # weight updates holding SGLang's model_update_lock
        self._gate: asyncio.Future | None = None  # resolved when admission reopens
        self._epoch: asyncio.Future | None = None  # resolved on restart / shutdown
        self._idle: asyncio.Future | None = None  # resolved when no request is live
        self._occurrences: OrderedDict[bytes, int] = OrderedDict()
        self._prefix_cache: OrderedDict[bytes, None] = OrderedDict()

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop().time()

    def unavailable(self) -> bool:
        return self.unavailable_until > 0 and self.now() < self.unavailable_until

    def epoch(self) -> asyncio.Future:
        if self._epoch is None or self._epoch.done():
            self._epoch = self._loop().create_future()
        return self._epoch

    def skill(self) -> float:
        version = self.weight_version
        steps = int(version) if version.isdigit() else 0
        return min(1.0, max(0.0, self.config.skill + self.config.skill_gain_per_version * steps))

    async def wait(self, fut: asyncio.Future, epoch: asyncio.Future) -> None:
        """Wait for `fut`; raise Restarted if the engine restarts first."""
        await asyncio.wait((fut, epoch), return_when=asyncio.FIRST_COMPLETED)
        if epoch.done():
            raise Restarted()

    async def sleep(self, seconds: float, epoch: asyncio.Future) -> None:
        """asyncio.sleep that raises Restarted if the engine restarts meanwhile."""
        task = asyncio.ensure_future(asyncio.sleep(seconds))
        try:
            await self.wait(task, epoch)
        finally:
            task.cancel()

    async def wait_admission(self) -> None:
        """SGLang blocks new /generate calls while paused or during a weight update."""
        epoch = self.epoch()
        while self.paused or self._writers:
            if self._gate is None or self._gate.done():
                self._gate = self._loop().create_future()
            await self.wait(self._gate, epoch)

    def _open_gate(self) -> None:
        if not self.paused and not self._writers and self._gate is not None and not self._gate.done():
            self._gate.set_result(None)

    # -- seeding and caching ---------------------------------------------------------

    def _sample_key(self, spec: GenSpec, digest: bytes) -> str:
        """What makes two samples of one prompt differ, reproducibly:
        greedy → nothing; `sampling_seed` → that seed; a client-chosen rid → the rid;
        otherwise the k-th request for this exact prompt on this server gets draw k."""
        if spec.greedy:
            return "greedy"
        if spec.sampling_seed is not None:
            return f"seed:{spec.sampling_seed}"
        if spec.client_rid:
            return f"rid:{spec.rid}"
        count = self._occurrences.pop(digest, 0)
        self._occurrences[digest] = count + 1
        if len(self._occurrences) > _CACHE_ENTRIES:
            self._occurrences.popitem(last=False)
        return f"draw:{count}"

    def _cached_tokens(self, digest: bytes, length: int) -> int:
        """Exact-prompt prefix cache: a repeated prompt reuses all but its last token."""
        hit = digest in self._prefix_cache
        self._prefix_cache[digest] = None
        self._prefix_cache.move_to_end(digest)
        if len(self._prefix_cache) > _CACHE_ENTRIES:
            self._prefix_cache.popitem(last=False)
        return length - 1 if hit else 0

    # -- submission and scheduling ---------------------------------------------------

    def submit(self, specs: list[GenSpec], created: float, parallel: bool = False) -> list[SimRequest]:
        """Queue sub-requests; `parallel` marks the samples of n > 1 prompts."""
        duplicate = next((s.rid for s in specs if s.rid in self.requests), None)
        if duplicate is not None:
            raise ValueError(f"Duplicate request ID detected: {duplicate}")
        loop = self._loop()
        reqs = []
        for spec in specs:
            digest = hashlib.blake2b(array("i", spec.input_ids).tobytes(), digest_size=16).digest()
            if parallel and digest not in self._prefix_cache:
                # SGLang prefills an n > 1 prompt once before its samples: they all hit the cache.
                self._prefix_cache[digest] = None
            seed_material = f"{self.config.seed}|{digest.hex()}|{self._sample_key(spec, digest)}"
            plan = plan_generation(spec, random.Random(seed_material), self.tokenizer, self.config, self.skill())
            req = SimRequest(spec, plan, created, loop.create_future(), self.config.decode_tokens_per_s,
                             self._cached_tokens(digest, len(spec.input_ids)), seed_material)
            self.requests[spec.rid] = req
            self.waiting.append(req)
            reqs.append(req)
        self.stats["submitted"] += len(reqs)
        self._admit()
        return reqs

    def _admit(self) -> None:
        while not self.paused and self.waiting and len(self.running) < self.config.max_running_requests:
            self._run(self.waiting.popleft(), prefill=True)

    def _run(self, req: SimRequest, prefill: bool) -> None:
        now = self.now()
        req.state = "running"
        self.running[req.rid] = req
        req.run_start = now + (self.config.prefill_s if prefill else 0.0)
        finish_at = req.run_start + (len(req.plan.tokens) - req.done_tokens) / req.rate
        req.timer = self._loop().call_at(finish_at, self._on_finished, req)

    def _freeze(self, req: SimRequest, now: float) -> None:
        """Stop the clock of a running request, keeping what it produced so far."""
        req.done_tokens = req.progress(now)
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None

    def _on_finished(self, req: SimRequest) -> None:
        req.timer = None
        self.running.pop(req.rid, None)
        self._complete(req, FINISHED, req.plan.finish, len(req.plan.tokens))
        self._admit()

    def _complete(self, req: SimRequest, outcome: str, finish: dict | None, tokens: int) -> None:
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        req.state = "done"
        req.outcome, req.finish, req.final_tokens = outcome, finish, tokens
        req.finished_at = self.now()
        req.weight_version = self.weight_version
        self.requests.pop(req.rid, None)
        self.stats[outcome] += 1
        if not req.future.done():
            req.future.set_result(outcome)
        if not self.requests and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    # -- abort, pause, continue ------------------------------------------------------

    def _abort(self, req: SimRequest, now: float) -> None:
        if req.state == "waiting":
            self.waiting.remove(req)
            req.in_queue_abort = True  # a retracted request keeps its partial output
            self._complete(req, ABORTED, dict(_ABORT_WAITING), req.done_tokens)
        else:
            self._freeze(req, now)
            self.running.pop(req.rid, None)
            self._complete(req, ABORTED, dict(_ABORT_RUNNING), req.done_tokens)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's semantics: the rid must be a live request's exact id (else
        nothing happens); then every live rid starting with it is aborted."""
        if abort_all:
            targets = list(self.requests.values())
        elif not rid or rid not in self.requests:
            return 0
        else:
            targets = [r for key, r in self.requests.items() if key.startswith(rid)]
        now = self.now()
        for req in targets:
            self._abort(req, now)
        self._admit()
        return len(targets)

    def cancel(self, reqs: Iterable[SimRequest]) -> None:
        """The client went away: free the slots (SGLang aborts on disconnect)."""
        now = self.now()
        for req in reqs:
            if req.outcome is None:
                self._abort(req, now)
        self._admit()

    def pause(self, mode: str) -> None:
        now = self.now()
        self.paused = True
        if mode == "abort":
            for req in list(self.requests.values()):
                self._abort(req, now)
        elif mode == "retract":
            # Running requests go back to the head of the queue; their KV is recomputed later.
            retracted = [r for r in self.running.values()]
            for req in retracted:
                self._freeze(req, now)
                req.state = "waiting"
                req.retractions += 1
            self.running.clear()
            self.waiting.extendleft(reversed(retracted))
        else:  # in_place: requests keep their slot and KV, and continue on resume
            for req in self.running.values():
                if req.state == "running":
                    self._freeze(req, now)
                    req.state = "frozen"
        logger.info("generation paused (mode=%s): %d running, %d waiting", mode,
                    len(self.running), len(self.waiting))

    def resume(self) -> None:
        self.paused = False
        for req in list(self.running.values()):
            if req.state == "frozen":
                self._run(req, prefill=False)
        self._admit()
        self._open_gate()
        logger.info("generation continued")

    # -- weights and cache -----------------------------------------------------------

    def flush_cache(self) -> bool:
        if self.requests:
            return False
        self._prefix_cache.clear()
        return True

    async def update_weights(self, abort_all: bool, flush: bool) -> int:
        """Take SGLang's model_update_lock as writer: unless paused, wait for every
        live request to finish while new ones are held back. Returns the number of
        requests that sat paused during the update."""
        epoch = self.epoch()
        if abort_all:
            self.abort_request(abort_all=True)
        paused_requests = len(self.requests) if self.paused else 0
        if not self.paused:
            self._writers += 1
            try:
                while self.requests:
                    if self._idle is None or self._idle.done():
                        self._idle = self._loop().create_future()
                    await self.wait(self._idle, epoch)
                if self.config.weight_update_s:
                    await self.sleep(self.config.weight_update_s, epoch)
            finally:
                self._writers -= 1
                self._open_gate()
        elif self.config.weight_update_s:
            await self.sleep(self.config.weight_update_s, epoch)
        if flush and not self.requests:
            self._prefix_cache.clear()
        return paused_requests

    # -- restart and load ------------------------------------------------------------

    def drop_all(self) -> int:
        """Lose every request and wake every waiting handler, which then drops its
        connection (used by restart and by server shutdown)."""
        dropped = list(self.requests.values())
        now = self.now()
        for req in dropped:
            self._complete(req, DROPPED, None, req.progress(now))
        self.running.clear()
        self.waiting.clear()
        self.paused = False
        if self._epoch is not None and not self._epoch.done():
            self._epoch.set_result(None)
        self._epoch = None
        self._open_gate()
        return len(dropped)

    def restart(self, downtime: float) -> int:
        """Lose everything in flight; unavailable for `downtime` seconds."""
        dropped = self.drop_all()
        self.weight_version = self.config.weight_version  # a restart reloads the startup weights
        self.model_path = self.config.model_path
        self._prefix_cache.clear()
        self.unavailable_until = self.now() + downtime if downtime > 0 else 0.0
        self.stats["restarts"] += 1
        logger.warning("simulated engine restart: %d requests dropped, down for %.2fs", dropped, downtime)
        return dropped

    def load(self) -> dict[str, Any]:
        now = self.now()
        used = sum(len(r.spec.input_ids) + r.progress(now) for r in self.running.values())
        decoding = sum(1 for r in self.running.values() if r.state == "running" and now >= r.run_start)
        total = self.config.max_total_num_tokens
        usage = round(min(1.0, used / total), 4)
        return {
            "dp_rank": 0,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_waiting_uncached_tokens": sum(len(r.spec.input_ids) - r.cached_tokens for r in self.waiting),
            "num_used_tokens": used,
            "num_total_tokens": total,
            "max_total_num_tokens": total,
            "max_running_requests": self.config.max_running_requests,
            "token_usage": usage,
            "gen_throughput": round(decoding * self.config.decode_tokens_per_s, 2),
            "cache_hit_rate": 0.0,
            "utilization": usage,
        }


# --------------------------------------------------------------------------------------
# HTTP layer
# --------------------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    """SGLang's `_create_error_response` body (validation errors from its own code)."""
    return _json({"error": {"message": message}}, status)


def _error_response(message: str, status: int) -> web.Response:
    """FastAPI's ErrorResponse body, used by SGLang for HTTPException and for
    request-schema errors (its RequestValidationError handler)."""
    phrase = "Bad Request" if status == 400 else str(status)
    return _json({"object": "error", "message": message, "type": phrase, "param": None, "code": status}, status)


def _drop(request: web.Request, resp: web.StreamResponse | None = None) -> web.StreamResponse:
    """Close the connection without (the rest of) an answer; the client sees a
    disconnect. The returned response never reaches it."""
    if request.transport is not None:
        request.transport.abort()
    return resp if resp is not None else web.Response(status=500)


class SimServer:
    """Holds the engine and the fault RNG, and answers HTTP."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.tokenizer = ByteTokenizer()
        self.engine = SimEngine(self.config, self.tokenizer)
        self._fault_rng = random.Random(f"{self.config.seed}|faults")

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.engine.model_path

    # -- request body helpers --------------------------------------------------------

    @staticmethod
    async def _body(request: web.Request, optional: bool = False) -> dict:
        raw = await request.read()
        if not raw.strip():
            if optional:
                return {}
            raise SchemaError("A JSON request body is required.")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SchemaError(f"JSON decode error: {exc}") from None
        if not isinstance(body, dict):
            raise SchemaError("The request body must be a JSON object.")
        return body

    # -- /generate -------------------------------------------------------------------

    def _draw_fault(self) -> tuple[str | None, bool]:
        """One draw per fault kind, in a fixed order, so runs are reproducible."""
        rng, cfg = self._fault_rng, self.config
        hang, drop, error, spike = (rng.random() for _ in range(4))
        kind = None
        if hang < cfg.hang_rate:
            kind = "hang"
        elif drop < cfg.drop_rate:
            kind = "drop"
        elif error < cfg.error_rate:
            kind = "error"
        return kind, spike < cfg.latency_spike_rate

    async def generate(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        created = engine.now()
        try:
            body = await self._body(request)
            parsed = parse_generate(body, self.tokenizer, self.config)
        except SchemaError as exc:
            return _error_response(str(exc), 400)
        except ValueError as exc:
            # SGLang validates inside the response generator, after a stream has started.
            if body.get("stream") is True:
                return await self._stream_error(request, str(exc))
            return _error(str(exc))

        fault, spike = self._draw_fault()
        epoch = engine.epoch()
        try:
            if spike:
                engine.stats["latency_spikes"] += 1
                await engine.sleep(self.config.latency_spike_s, epoch)
            if fault == "hang":
                engine.stats["hangs"] += 1
                await engine.wait(self._loop_future(), epoch)  # until disconnect or restart
            if fault == "drop":
                engine.stats["drops"] += 1
                return _drop(request)
            if fault == "error":
                engine.stats["errors"] += 1
                status = self._fault_rng.choice(self.config.error_statuses)
                message = ("Simulated engine failure (fault injection)." if status != 503
                           else "Simulated: the engine is overloaded, retry later (fault injection).")
                return _error_response(message, status)
            await engine.wait_admission()
        except Restarted:
            return _drop(request)
        try:
            reqs = engine.submit(parsed.specs, created, parallel=parsed.n > 1)
        except ValueError as exc:  # duplicate rid
            return await self._stream_error(request, str(exc)) if parsed.stream else _error(str(exc))
        if parsed.stream:
            return await self._stream(request, reqs, batch=not parsed.single)
        try:
            if reqs:  # asyncio.wait, not gather: a cancelled handler must not cancel the futures
                await asyncio.wait([r.future for r in reqs])
        except asyncio.CancelledError:  # the client disconnected
            engine.cancel(reqs)
            raise
        if any(r.outcome == DROPPED for r in reqs):
            return _drop(request)
        outputs = [self._render(r, final=True, stream=False) for r in reqs]
        return _json(outputs[0] if parsed.single else outputs)

    @staticmethod
    def _loop_future() -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        resp = await self._start_stream(request)
        await resp.write(b"data: " + _dumps({"error": {"message": message}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    async def _start_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def _stream(self, request: web.Request, reqs: list[SimRequest], batch: bool) -> web.StreamResponse:
        """SSE: a cumulative chunk whenever a request progressed (checked every
        stream_interval_s), its final chunk when it ends, then `data: [DONE]`."""
        try:
            return await self._stream_loop(request, reqs, batch)
        except asyncio.CancelledError:
            self.engine.cancel(reqs)
            raise
        except ConnectionError:  # the client went away mid-stream
            self.engine.cancel(reqs)
            return web.Response(status=499)  # never reaches the client

    async def _stream_loop(self, request: web.Request, reqs: list[SimRequest], batch: bool) -> web.StreamResponse:
        resp = await self._start_stream(request)
        sent = [0] * len(reqs)
        final = [False] * len(reqs)
        while True:
            now = self.engine.now()
            for i, req in enumerate(reqs):
                if final[i]:
                    continue
                if req.outcome == DROPPED:
                    return _drop(request, resp)
                if req.outcome is not None:
                    chunk, final[i] = self._render(req, final=True, stream=True), True
                else:
                    # The last token arrives together with the finish reason.
                    produced = min(req.progress(now), len(req.plan.tokens) - 1)
                    if produced <= sent[i]:
                        continue
                    chunk, sent[i] = self._render(req, final=False, stream=True, produced=produced), produced
                if batch:
                    chunk["index"] = i
                await resp.write(b"data: " + _dumps(chunk).encode() + b"\n\n")
            if all(final):
                break
            pending = [r.future for r, done in zip(reqs, final) if not done]
            await asyncio.wait(pending, timeout=self.config.stream_interval_s, return_when=asyncio.FIRST_COMPLETED)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _render(self, req: SimRequest, final: bool, stream: bool, produced: int | None = None) -> dict:
        """The JSON SGLang returns for one request (cumulative, in 0.5.15's key order)."""
        spec, engine = req.spec, self.engine
        count = req.final_tokens if final else (produced if produced is not None else req.progress(engine.now()))
        version = req.weight_version if final else engine.weight_version
        ids = req.plan.tokens[:count]
        finish = req.finish if final else None

        text_ids = ids
        if finish and finish.get("type") == "stop" and not spec.no_stop_trim and isinstance(finish["matched"], int):
            text_ids = ids[:-1]  # the detokenizer trims a matched stop token from the text
        text = self.tokenizer.decode(text_ids, skip_special_tokens=spec.skip_special_tokens)
        if finish and finish.get("type") == "stop" and not spec.no_stop_trim and isinstance(finish["matched"], str):
            pos = text.find(finish["matched"])
            text = text[:pos] if pos != -1 else text

        if req.in_queue_abort:
            # TokenizerManager._handle_abort_req: a smaller meta_info, built there.
            meta: dict[str, Any] = {"id": spec.rid, "finish_reason": finish, "weight_version": version,
                                    "e2e_latency": req.finished_at - req.created}
            if spec.return_logprob:
                self._add_logprobs(meta, req, count)
            meta["completion_tokens"] = count
            output_ids = ids[-1:] if stream else list(ids)
            return {"text": text, "output_ids": output_ids, "meta_info": meta}

        meta = {"id": spec.rid, "finish_reason": finish, "prompt_tokens": len(spec.input_ids),
                "weight_version": version, "total_retractions": req.retractions}
        if spec.return_logprob:
            self._add_logprobs(meta, req, count)
        meta["completion_tokens"] = count
        meta["cached_tokens"] = req.cached_tokens
        if final:
            meta["e2e_latency"] = req.finished_at - req.created
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    def _token_text(self, token: int, wanted: bool) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) if wanted else None

    def _add_logprobs(self, meta: dict, req: SimRequest, count: int) -> None:
        """`[logprob, token_id, text_or_null]` entries, as SGLang's convert_logprob_style."""
        spec, plan = req.spec, req.plan
        with_text = spec.return_text_in_logprobs
        start = spec.logprob_start_len
        # -1 (the default) means output logprobs only.
        prompt_rng = random.Random(req.seed_material + "|input")
        input_lp = []
        if start >= 0:
            for pos in range(min(start, len(spec.input_ids)), len(spec.input_ids)):
                lp = None if pos == 0 else -abs(prompt_rng.gauss(0.0, 2.0))
                input_lp.append([lp, spec.input_ids[pos], self._token_text(spec.input_ids[pos], with_text)])
        meta["input_token_logprobs"] = input_lp
        if with_text:
            meta["output_token_logprobs"] = [[lp, t, self._token_text(t, True)]
                                             for lp, t in zip(plan.logprobs[:count], plan.tokens[:count])]
        else:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(plan.logprobs[:count], plan.tokens[:count])]
        if spec.top_logprobs_num > 0:
            k = spec.top_logprobs_num
            meta["input_top_logprobs"] = [None if e[0] is None else [[e[0], e[1], e[2]]] for e in input_lp]
            meta["output_top_logprobs"] = [
                self._top_entries(req, i, k, with_text) for i in range(count)
            ]

    def _top_entries(self, req: SimRequest, index: int, k: int, with_text: bool) -> list:
        """The sampled token first, then k-1 less likely alternatives (deterministic)."""
        rng = random.Random(f"{req.seed_material}|top|{index}")
        sampled_lp, sampled = req.plan.logprobs[index], req.plan.tokens[index]
        entries = [[sampled_lp, sampled, self._token_text(sampled, with_text)]]
        lp = sampled_lp
        for _ in range(k - 1):
            lp -= abs(rng.gauss(0.0, 1.0)) + 0.01
            token = rng.randrange(256)
            entries.append([lp, token, self._token_text(token, with_text)])
        return entries

    # -- control endpoints -----------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except SchemaError as exc:
            return _error_response(str(exc), 400)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return _error_response("rid must be a string and abort_all a boolean", 400)
        count = self.engine.abort_request(rid=rid, abort_all=abort_all)
        logger.debug("abort_request rid=%r abort_all=%s: %d aborted", rid, abort_all, count)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, optional=True)
        except SchemaError as exc:
            return _error_response(str(exc), 400)
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            return _error_response(f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}", 400)
        self.engine.pause(mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    def _update_fails(self) -> bool:
        return self._fault_rng.random() < self.config.weight_update_fail_rate

    async def _weights_update(self, request: web.Request, kind: str) -> web.Response:
        """The update_weights_* family: success, then the optional weight_version applies."""
        try:
            body = await self._body(request)
        except SchemaError as exc:
            return _error_response(str(exc), 400)
        model_path = body.get("model_path")
        if kind == "disk" and not isinstance(model_path, str):
            return _error_response("model_path (a string) is required", 400)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            return _error_response("weight_version must be a string", 400)
        abort_all = body.get("abort_all_requests", False) is True
        try:
            paused = await self.engine.update_weights(abort_all=abort_all, flush=body.get("flush_cache", True) is not False)
        except Restarted:
            return _drop(request)
        if self._update_fails() or (kind == "disk" and not model_path):
            message = "Failed to update weights: simulated failure (fault injection)."
            if kind == "disk" and not model_path:
                message = "Failed to update weights: model_path is empty."
            body_out: dict[str, Any] = {"success": False, "message": message}
            if kind == "disk":
                body_out["num_paused_requests"] = paused
            return _json(body_out, 400)
        message = "Succeeded to update model weights."
        if kind == "disk":
            self.engine.model_path = model_path
        if version is not None:
            self.engine.weight_version = version
            message += f" Weight version updated to {version}."
        self.engine.stats["weight_updates"] += 1
        logger.info("weights updated (%s), version=%s", kind, self.engine.weight_version)
        out: dict[str, Any] = {"success": True, "message": message}
        if kind == "disk":
            out["num_paused_requests"] = paused
        return _json(out)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        return await self._weights_update(request, "disk")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        return await self._weights_update(request, "tensor")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._weights_update(request, "distributed")

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        return _json({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except SchemaError as exc:
            return _error_response(str(exc), 400)
        version = body.get("new_version")
        if not isinstance(version, str):
            return _error_response("new_version (a string) is required", 400)
        if body.get("abort_all_requests", True) is not False:
            self.engine.abort_request(abort_all=True)
        self.engine.weight_version = version
        return _json({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    # -- information endpoints -------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)  # 503 comes from the availability middleware

    async def get_model_info(self, request: web.Request) -> web.Response:
        return _json({
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "sim-byte-lm",
            "architectures": ["SimulatedByteLM"],
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        cfg = self.config
        load = self.engine.load()
        return _json({
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "served_model_name": self.served_model_name,
            "context_length": cfg.context_length,
            "max_running_requests": cfg.max_running_requests,
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "skip_tokenizer_init": False,
            "dp_size": 1,
            "tp_size": 1,
            "random_seed": cfg.seed,
            "weight_version": self.engine.weight_version,
            "internal_states": [{"num_running_reqs": load["num_running_reqs"],
                                 "num_waiting_reqs": load["num_waiting_reqs"],
                                 "paused": self.engine.paused}],
            "version": SGLANG_VERSION,
            "simulator": True,
        })

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.engine.flush_cache()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                 "waiting requests, the operation will not be performed.)\n",
            status=200 if ok else 400)

    async def v1_models(self, request: web.Request) -> web.Response:
        name = self.served_model_name
        return _json({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": self.config.context_length}]})

    async def v1_loads(self, request: web.Request) -> web.Response:
        dp_rank = request.query.get("dp_rank")
        loads = [] if dp_rank not in (None, "0") else [self.engine.load()]
        for load in loads:
            load["num_total_reqs"] = load["num_running_reqs"] + load["num_waiting_reqs"]
        n = len(loads) or 1
        aggregate = {
            "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
            "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
            "total_reqs": sum(d["num_total_reqs"] for d in loads),
            "total_used_tokens": sum(d["num_used_tokens"] for d in loads),
            "total_tokens": sum(d["num_total_tokens"] for d in loads),
            "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
            "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2),
            "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4),
        }
        return _json({"timestamp": datetime.now(timezone.utc).isoformat(), "version": SGLANG_VERSION,
                      "dp_rank_count": len(loads), "loads": loads, "aggregate": aggregate})

    # -- simulator-only endpoints ----------------------------------------------------

    def faults(self) -> dict[str, Any]:
        return {name: (list(v) if isinstance(v := getattr(self.config, name), tuple) else v)
                for name in FAULT_FIELDS}

    async def sim_faults(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                updates = validate_faults(await self._body(request))
            except (SchemaError, ValueError) as exc:
                return _error(str(exc))
            for name, value in updates.items():
                setattr(self.config, name, value)
            logger.info("fault settings changed: %s", updates)
        return _json(self.faults())

    async def sim_restart(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, optional=True)
            downtime = validate_faults({"restart_s": body.get("restart_s", self.config.restart_s)})["restart_s"]
        except (SchemaError, ValueError) as exc:
            return _error(str(exc))
        dropped = self.engine.restart(downtime)
        return _json({"status": "restarting", "restart_s": downtime, "dropped_requests": dropped})

    async def sim_stats(self, request: web.Request) -> web.Response:
        return _json({"stats": dict(self.engine.stats), "load": self.engine.load(),
                      "paused": self.engine.paused, "weight_version": self.engine.weight_version})

    # -- wiring ----------------------------------------------------------------------

    @web.middleware
    async def _availability(self, request: web.Request, handler) -> web.StreamResponse:
        """While starting or restarting every SGLang endpoint answers 503."""
        if not request.path.startswith("/sim/") and self.engine.unavailable():
            if request.path in ("/health", "/health_generate"):
                return web.Response(status=503)
            return _error_response("The server is not ready (starting or restarting).", 503)
        return await handler(request)

    async def _on_startup(self, app: web.Application) -> None:
        if self.config.startup_s > 0:
            self.engine.unavailable_until = self.engine.now() + self.config.startup_s

    async def _on_shutdown(self, app: web.Application) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Drop everything in flight so handlers end before the server closes."""
        self.engine.drop_all()

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self._availability])
        app[SERVER_KEY] = self
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.get_model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.get_server_info)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_get("/v1/models", self.v1_models)
        r.add_get("/v1/loads", self.v1_loads)
        r.add_route("GET", "/sim/faults", self.sim_faults)
        r.add_route("POST", "/sim/faults", self.sim_faults)
        r.add_post("/sim/restart", self.sim_restart)
        r.add_get("/sim/stats", self.sim_stats)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app


SERVER_KEY = web.AppKey("sglang_simulator", SimServer)


def build_app(config: SimConfig | None = None) -> web.Application:
    """The aiohttp application of a fresh simulator (its SimServer is app[SERVER_KEY])."""
    return SimServer(config).build_app()


async def _start(config: SimConfig | None, host: str, port: int) -> tuple[web.AppRunner, int, SimServer]:
    app = build_app(config)
    # handler_cancellation: a client that disconnects cancels its handler, which
    # aborts its requests (SGLang aborts on disconnect too) instead of leaking slots.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    actual_port = runner.addresses[0][1]
    return runner, actual_port, app[SERVER_KEY]


async def serve(config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Run a simulator until cancelled."""
    runner, actual_port, server = await _start(config, host, port)
    logger.info("SGLang simulator listening on http://%s:%d (seed=%d)", host, actual_port, server.config.seed)
    try:
        await asyncio.Event().wait()
    finally:
        server.shutdown()
        await runner.cleanup()


class SimulatorHandle:
    """A simulator running in a background thread with its own event loop."""

    def __init__(self, server: SimServer, runner: web.AppRunner, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread, host: str, port: int) -> None:
        self.server = server
        self.config = server.config
        self.host = host
        self.port = port
        self._runner = runner
        self._loop = loop
        self._thread = thread
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def call(self, fn, *args) -> Any:
        """Run `fn(*args)` on the simulator's loop (engine state is not thread-safe)."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True

        async def cleanup():
            self.server.shutdown()
            await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(timeout=timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout)

    def __enter__(self) -> "SimulatorHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"SimulatorHandle({self.url})"


def start_simulator(config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> SimulatorHandle:
    """Start a simulator in a daemon thread; port 0 picks a free port (see `.url`)."""
    ready = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            result["started"] = loop.run_until_complete(_start(config, host, port))
        except BaseException as exc:  # report startup failures to the caller
            result["error"] = exc
            ready.set()
            loop.close()
            return
        result["loop"] = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="sglang-simulator", daemon=True)
    thread.start()
    if not ready.wait(timeout=30):
        raise RuntimeError("the simulator did not start within 30 s")
    if "error" in result:
        raise RuntimeError(f"the simulator failed to start: {result['error']}") from result["error"]
    runner, actual_port, server = result["started"]
    return SimulatorHandle(server, runner, result["loop"], thread, host, actual_port)
