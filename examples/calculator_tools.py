"""A multi-turn tool task for the workers: arithmetic with a calculator.

The model may write ``<tool>A op B</tool>``; the function runs the calculator, appends
``<result>N</result>`` to the response with loss mask 0 (the trainer learns only from
what the model wrote) and lets the model go on, until it answers (``\\boxed{N}``), runs
out of `MAX_TURNS` engine calls, or of ``max_new_tokens`` for the whole response.

It is written against slime's contract and runs unchanged under slime
(``--custom-generate-function-path examples.calculator_tools.generate
--custom-rm-path examples.calculator_tools.reward``) or in the queue's workers:

    rollout sim-engine --tool-call-rate 0.5 &
    rollout worker --engine-url http://127.0.0.1:30000 \\
        --generate-function examples.calculator_tools:generate --reward examples.calculator_tools:reward

The simulator writes the tool call with the probability `--tool-call-rate` at each turn;
`rollout demo --task tools` runs the whole loop. A sample aborted by a weight update is
continued from its partial output: its turns so far are in `sample.metadata`.
"""
from __future__ import annotations

import functools
import re
from fractions import Fraction
from typing import Any

import aiohttp

from workers.rewards import extract_boxed, math_equal
from workers.tokenizer import encode_prompt, load_tokenizer

#: Engine calls per sample at most (the last one may still ask for the tool: truncated).
MAX_TURNS = 4
TOOL_CALL = re.compile(r"<tool>\s*(-?\d+)\s*([+\-*/])\s*(-?\d+)\s*</tool>")
TOOL_END = "</tool>"
#: sample.metadata keys: engine calls so far, and where the current turn's response began.
TURNS_KEY, TURN_START_KEY = "tool_turns", "tool_turn_start"


@functools.lru_cache(maxsize=4)
def _tokenizer(name_or_path: str | None) -> Any:
    return load_tokenizer(name_or_path)


def calculate(a: str, op: str, b: str) -> str:
    """The calculator: exact (fractions), never eval."""
    x, y = Fraction(int(a)), Fraction(int(b))
    if op == "/" and y == 0:
        return "error: division by zero"
    value = {"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else x}[op]
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


async def generate(args: Any, sample: Any, sampling_params: dict) -> Any:
    """slime's signature. Each engine call's tokens go in with their log-probs and the
    answer's meta_info (its weight version, its finish reason); tool results go in with
    loss mask 0."""
    tokenizer = _tokenizer(args.hf_checkpoint)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    if not sample.tokens:  # a fresh sample; a continued one goes on from its tokens
        # The worker renders the prompt under --apply-chat-template (slime's Dataset does); messages
        # pushed without it still need the template.
        sample.tokens = encode_prompt(tokenizer, sample.prompt, False)
        sample.metadata[TURNS_KEY], sample.metadata[TURN_START_KEY] = 0, 0
    budget = sampling_params["max_new_tokens"]
    stop = list(dict.fromkeys([*(sampling_params.get("stop") or []), TOOL_END]))
    async with aiohttp.ClientSession() as session:
        while True:
            remaining = budget - sample.response_length
            if remaining <= 0 or sample.metadata[TURNS_KEY] >= MAX_TURNS:
                sample.status = type(sample.status)("truncated")
                return sample
            params = dict(sampling_params, max_new_tokens=remaining, stop=stop)
            async with session.post(url, json={"input_ids": sample.tokens, "sampling_params": params,
                                               "return_logprob": True}) as response:
                response.raise_for_status()
                output = await response.json()
            meta = output["meta_info"]
            pairs = meta.get("output_token_logprobs") or []
            sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                          trainable=True, meta_info=meta, text=output.get("text", ""))
            finish = meta["finish_reason"]["type"]
            if finish == "abort":  # a weight update: the worker calls again with this partial sample
                return sample
            sample.metadata[TURNS_KEY] += 1
            turn = tokenizer.decode(sample.tokens[len(sample.tokens) - sample.response_length
                                                  + sample.metadata[TURN_START_KEY]:])
            call = TOOL_CALL.search(turn)
            if finish == "length" or call is None:
                return sample  # answered (or cut by the length limit): status from the finish reason
            observation = f"<result>{calculate(*call.groups())}</result>\n"
            sample.append_response_tokens(args, tokens=tokenizer.encode(observation), trainable=False,
                                          text=observation)
            sample.metadata[TURN_START_KEY] = sample.response_length


async def reward(args: Any, sample: Any) -> float:
    """1 for a right final answer (the last ``\\boxed{}``), 0 otherwise; a tool call
    that the model never followed with an answer earns nothing."""
    answer = extract_boxed(sample.response or "")
    return float(answer is not None and sample.label is not None and math_equal(answer, str(sample.label)))
