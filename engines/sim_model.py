"""What the simulated model writes (engines/simulator.py runs it): a response whose
length is log-normal (median and p99 of the settings), filler text, then for an
arithmetic question the answer line (right with probability `skill`) or, at a
`tool_call_rate`, a calculator call; SGLang's stopping rules on top. Everything follows
from a sample's key, so a request continued after an abort produces the rest of the
same response (`split_continuation`)."""
from __future__ import annotations

import math
import random
import re
import statistics
from dataclasses import dataclass
from typing import Protocol

from workers.tokenizer import ByteTokenizer

from .generate_request import GenSpec

_Z99 = 2.3263478740408408  # standard normal quantile at 0.99
_ARITHMETIC = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)\?")
_FILLER_WORDS = (
    "let", "me", "think", "about", "this", "step", "by", "first", "we", "note", "that",
    "the", "problem", "asks", "for", "a", "value", "so", "consider", "each", "term",
    "carefully", "then", "combine", "them", "and", "check", "result", "again", "hence",
    "it", "follows", "which", "is", "consistent", "with", "what", "expect", "now",
)
# Token log-probs are drawn by indexing random bytes into this table: 256 quantiles of
# -|N(0, 0.8)|, rounded (short floats encode to JSON faster). One randbytes() call per
# request instead of one gauss() per token.
_LOGPROB_TABLE = tuple(round(-0.8 * statistics.NormalDist().inv_cdf(0.5 + 0.5 * (i + 0.5) / 256), 4)
                       for i in range(256))
_SUFFIXES, _SUFFIX_CUM_WEIGHTS = ("", ",", ".\n"), (80, 92, 100)


class OutputSettings(Protocol):
    """What the output depends on among the simulator's settings (SimConfig)."""

    length_median: float
    length_p99: float
    tool_call_rate: float


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


def _tool_call(prompt_text: str, rng: random.Random, rate: float) -> str | None:
    """With probability `rate`, a calculator call for the question asked (None: answer)."""
    matches = _ARITHMETIC.findall(prompt_text) if rate else []
    if not matches or rng.random() >= rate:
        return None
    a, op, b = matches[-1]
    return f"<tool>{a} {op} {b}</tool>"


@dataclass
class Plan:
    """The whole output a request will produce if nothing interrupts it."""

    tokens: list[int]
    logprobs: list[float]
    finish: dict  # finish_reason once all `tokens` are out


def _response(key: str, prompt_text: str, tokenizer: ByteTokenizer, config: OutputSettings, skill: float,
              min_new_tokens: int) -> bytes:
    """The natural response of sample `key` to this prompt (EOS not included). Its length
    and text depend on `key` alone, its answer line also on the prompt."""
    total = max(draw_output_length(random.Random(f"{key}|length"), config.length_median, config.length_p99),
                min_new_tokens + 1)
    # With tool_call_rate, a calculator call instead, drawn anew at each turn (from the whole
    # conversation so far); after a calculator result the "model" copies it: right every time.
    answer = (_tool_call(prompt_text, random.Random(f"{key}|tool|{prompt_text}"), config.tool_call_rate)
              or _answer_line(prompt_text, random.Random(f"{key}|answer"),
                              1.0 if "<result>" in prompt_text else skill))
    filler = _filler(random.Random(f"{key}|text"), total - 1)
    if answer is None:
        return filler.encode("utf-8")
    room = total - 1 - len(answer)
    return ((filler[:room - 1] + "\n" if room > 0 else "") + answer).encode("utf-8")


def split_continuation(key: str, input_ids: list[int], tokenizer: ByteTokenizer, config: OutputSettings,
                       skill: float, min_new_tokens: int) -> int:
    """How many of `input_ids` are sample `key`'s own response already (a request
    continued after an abort sends prompt + partial output): the longest tail of the
    input that starts that sample's response to the rest. 0 for a fresh request (a
    prompt that happens to end with the first bytes of its own response reads as one)."""
    data = bytes(t if 0 <= t < 256 else 0 for t in input_ids)  # special tokens never start a response
    filler_only = _response(key, "", tokenizer, config, skill, min_new_tokens)  # shares the response's start
    if not filler_only:
        return 0
    pos = data.find(filler_only[:1], max(1, len(data) - len(filler_only) - 64))
    while pos != -1:
        head = data[pos:pos + 8]
        if filler_only.startswith(head) or len(head) < 8:
            body = _response(key, tokenizer.decode(input_ids[:pos]), tokenizer, config, skill, min_new_tokens)
            if body.startswith(data[pos:]):
                return len(data) - pos
        pos = data.find(filler_only[:1], pos + 1)
    return 0


def plan_generation(spec: GenSpec, key: str, tokenizer: ByteTokenizer, config: OutputSettings, skill: float,
                    produced: int = 0) -> Plan:
    """Deterministic given `key`: the natural response, then SGLang's stopping rules
    (on one token: stop strings first, then EOS / stop token ids, then the length). `produced`: how many
    tokens at the end of the input are this sample's earlier output; the plan is then
    the rest of the response the uninterrupted request would have given."""
    prompt_ids = spec.input_ids[:len(spec.input_ids) - produced]
    body = _response(key, tokenizer.decode(prompt_ids), tokenizer, config, skill, spec.min_new_tokens)
    eos = tokenizer.eos_token_id
    if spec.ignore_eos:
        # The model keeps talking past where it would have stopped.
        extra = produced + spec.max_new_tokens - len(body)
        data = body + ((" " + _filler(random.Random(f"{key}|more"), extra - 1)).encode("utf-8") if extra > 0 else b"")
        tokens = list(data)
    else:
        data = body
        tokens = list(data) + [eos]
    data, tokens = data[produced:], tokens[produced:]

    # The earliest token that stops generation. SGLang (0.5.20 to 0.5.23) checks, after each token,
    # stop strings, then stop token ids (EOS included, unless ignore_eos), then the length
    # limit: a tie goes to the string, and a stop on the last allowed token beats the limit.
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
        if pos != -1 and (stop_at is None or pos + len(encoded) - 1 <= stop_at):
            stop_at, matched = pos + len(encoded) - 1, stop
    limit = spec.max_new_tokens
    if stop_at is not None and stop_at + 1 <= limit:
        count, finish = stop_at + 1, {"type": "stop", "matched": matched}
    else:
        count, finish = min(limit, len(tokens)), {"type": "length", "length": limit}
    tokens = tokens[:count]
    logprobs = [_LOGPROB_TABLE[b] for b in random.Random(f"{key}|logprobs").randbytes(produced + len(tokens))]
    return Plan(tokens=tokens, logprobs=logprobs[produced:], finish=finish)
