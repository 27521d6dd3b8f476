"""The SGLang `/generate` request contract: parse and validate a body into one
`GenSpec` per (prompt, sample), as SGLang's GenerateReqInput, SamplingParams.verify()
and TokenizerManager do, with their error messages. Shared by every engine backend
behind engines/server.py.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from workers.tokenizer import ByteTokenizer


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


# Sampling parameters that constrain or bias decoding beyond temperature/top-p/top-k.
_CONSTRAINT_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "logit_bias", "custom_params")


@dataclass
class GenSpec:
    """One normalized sub-request: a single prompt and a single sample."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int  # effective limit (SGLang clamps to the context length)
    min_new_tokens: int
    greedy: bool
    temperature: float  # as given; a greedy request samples at 1.0 with top_k 1, as SGLang
    top_p: float
    top_k: int  # -1: no limit
    min_p: float
    penalized: bool  # a frequency, presence or repetition penalty is set
    constrained: list[str]  # constraint and logit parameters set (regex, json_schema, logit_bias, ...)
    stop_strs: list[str]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    sampling_seed: int | None
    stream_interval: int | None  # tokens between stream chunks; None: the server's (--stream-interval)
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    client_rid: bool  # rid chosen by the client (seeds the sample, see Engine.sample_key)


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
    stream_interval = params.get("stream_interval")
    if stream_interval is not None and (not _is_int(stream_interval) or stream_interval < 1):
        raise ValueError(f"stream_interval must be a positive integer, got {stream_interval!r}.")
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
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "penalized": (frequency_penalty, presence_penalty, repetition_penalty) != (0.0, 0.0, 1.0),
        "constrained": sorted(k for k in _CONSTRAINT_KEYS if params.get(k) is not None),
        "stop_strs": stop_strs,
        "stop_token_ids": frozenset(stop_token_ids),
        "sampling_seed": sampling_seed,
        "stream_interval": stream_interval,
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


def parse_generate(body: Any, tokenizer: ByteTokenizer, context_length: int,
                   vocab_size: int | None = None) -> ParsedGenerate:
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
        _check_prompt(ids, params["max_new_tokens"], vocab_size or tokenizer.vocab_size, context_length)
        limit = params["max_new_tokens"]
        limit = context_length - len(ids) - 1 if limit is None else min(limit, context_length - len(ids) - 1)
        if top_logprobs_num[i] < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num[i]}.")
        for j in range(n):
            specs.append(GenSpec(
                rid=rids[i * n + j], input_ids=ids, max_new_tokens=limit,
                min_new_tokens=params["min_new_tokens"], greedy=params["greedy"],
                temperature=params["temperature"], top_p=params["top_p"], top_k=params["top_k"],
                min_p=params["min_p"], penalized=params["penalized"], constrained=params["constrained"],
                stop_strs=params["stop_strs"], stop_token_ids=params["stop_token_ids"],
                ignore_eos=params["ignore_eos"], skip_special_tokens=params["skip_special_tokens"],
                no_stop_trim=params["no_stop_trim"], sampling_seed=params["sampling_seed"],
                stream_interval=params["stream_interval"], return_logprob=return_logprob[i], logprob_start_len=logprob_start_len[i],
                top_logprobs_num=top_logprobs_num[i], return_text_in_logprobs=text_in_logprobs,
                client_rid=client_rid,
            ))
    return ParsedGenerate(specs=specs, single=single and n == 1, stream=stream, n=n)


def _check_prompt(ids: list[int], max_new_tokens: int | None, vocab_size: int, context_length: int) -> None:
    """TokenizerManager._validate_one_request: vocabulary and context length."""
    if not ids:
        raise ValueError("input_ids cannot be empty.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"The input_ids {bad[:8]} contain values outside the vocab size ({vocab_size}).")
    ctx, length = context_length, len(ids)
    if length >= ctx:
        raise ValueError(f"The input ({length} tokens) is longer than the model's context length ({ctx} tokens).")
    if max_new_tokens is not None and max_new_tokens + length >= ctx:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
            f"You requested a total of {max_new_tokens + length} tokens: {length} tokens from the input "
            f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens "
            f"in the input messages or the completion to fit within the limit.")
