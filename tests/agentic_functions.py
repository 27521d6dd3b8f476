"""Generate functions and rewards that do what slime's examples/retool and examples/search-r1
do and rely on (written here, not copied; tests/test_agentic_examples.py runs them through
the worker against tests/scripted_engine.py):

- retool: its own chat template around sample.prompt, token-in/token-out engine calls,
  code run by an "interpreter" between turns (it blocks its event loop, as retool's sandbox
  does), tokens appended with slime's append_response_tokens semantics, the state of a
  retried sample cleared, undeclared attributes set (`tool_call_count`, `payload_text`) and
  read by its reward, which returns math_dapo's dict {"score", "acc": bool, "pred": str}.
- search-r1: text-in engine calls with stop tags, `<search>` answered by a search backend in
  an `<information>` block, tokens and loss_mask reset on entry but not response_length nor
  rollout_log_probs (so a partial sample makes append_response_tokens raise), and a reward
  reading the dict label's label["ground_truth"]["target"].

Both refuse partial rollouts (`assert not args.partial_rollout`), as slime's do.
"""
from __future__ import annotations

import functools
import re
import time
from typing import Any

import aiohttp

from tests.scripted_engine import FACTS

MAX_TURNS = 4
#: What the interpreter blocks its loop for per run (retool's sandbox: subprocess.communicate).
INTERPRETER_BLOCKS_S = 0.05
_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_PRINT_SUM = re.compile(r"print\((\d+) \+ (\d+)\)")
_BOXED = re.compile(r"Answer:\s*\\boxed\{([^{}]*)\}")
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


@functools.lru_cache(maxsize=2)
def tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def _call(url: str, payload: dict) -> tuple[dict, list[int], list[float]]:
    """One /generate: the answer, its token ids and their log-probs."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=payload) as response:
            response.raise_for_status()
            output = await response.json()
    pairs = output["meta_info"].get("output_token_logprobs") or []
    return output, [p[1] for p in pairs], [p[0] for p in pairs]


def retool_prompt(question: str) -> str:
    """retool's own template around the question (under --apply-chat-template the question
    is already the model's chat rendering: templated twice, as slime's retool does)."""
    return (f"<|im_start|>system\nYou can run Python between <code> and </code>.<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def interpreter(code: str) -> str:
    """Runs the code the model wrote; blocks the event loop while it does (as retool's sandbox)."""
    time.sleep(INTERPRETER_BLOCKS_S)
    match = _PRINT_SUM.search(code)
    return str(int(match.group(1)) + int(match.group(2))) if match else "SyntaxError"


async def retool_generate(args: Any, sample: Any, sampling_params: dict) -> Any:
    assert not args.partial_rollout, "Partial rollout is not supported for this function at the moment."
    # A retried sample arrives with the state of its first attempt: cleared, as retool does.
    sample.rollout_log_probs = None
    sample.response, sample.response_length, sample.loss_mask = "", 0, []
    tok = tokenizer(args.hf_checkpoint)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = retool_prompt(sample.prompt)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)
    response, response_ids, tool_calls = "", [], 0
    output: dict = {}
    for _ in range(MAX_TURNS):
        output, ids, log_probs = await _call(url, {"input_ids": prompt_ids + response_ids, "return_logprob": True,
                                                   "sampling_params": dict(sampling_params)})
        meta = output["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            sample.status = type(sample.status)("aborted")
            return sample
        text = tok.decode(ids)
        response += text
        response_ids += ids
        sample.append_response_tokens(args, tokens=ids, log_probs=log_probs, trainable=True, meta_info=meta)
        if meta["finish_reason"]["type"] == "length" or _BOXED.search(text):
            break
        code = _CODE.search(text)
        observation = (f"\n\n<interpreter>\n{interpreter(code.group(1))}\n</interpreter>\n\n" if code else
                       "\nMy previous action is invalid. Let me try again.\n")
        tool_calls += bool(code)
        observation_ids = tok(observation, add_special_tokens=False)["input_ids"]
        response += observation
        response_ids += observation_ids
        sample.append_response_tokens(args, tokens=observation_ids, trainable=False)
    sample.tokens = prompt_ids + response_ids
    sample.response_length, sample.response = len(response_ids), response
    sample.payload_text = prompt + response  # attributes slime's Sample does not declare
    sample.tool_call_count = tool_calls
    if sample.status.value == "pending":
        finish = output["meta_info"]["finish_reason"]["type"]
        sample.status = type(sample.status)({"length": "truncated", "stop": "completed"}.get(finish, "completed"))
    return sample


async def retool_reward(args: Any, sample: Any) -> dict:
    """math_dapo's dict for the last boxed answer, the score raised by the tool calls."""
    solution = sample.prompt + sample.response
    answers = _BOXED.findall(solution[-300:])
    pred = answers[-1].strip() if answers else None
    correct = pred is not None and pred == str(sample.label)
    result = {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
    if result["score"] < 0:
        result["score"] = min(-0.6, result["score"] + (getattr(sample, "tool_call_count", 0) - 2) / 2 * 0.1)
    if result["pred"] is None:
        result["pred"] = ""
    return result


def search(query: str) -> str:
    answer = FACTS.get(query.strip(), "nobody knows")
    return f"Doc 1(Title: {query.strip()}) It was {answer}.\n"


async def search_r1_generate(args: Any, sample: Any, sampling_params: dict) -> Any:
    assert not args.partial_rollout, "Partial rollout is not supported for this function at the moment."
    tok = tokenizer(args.hf_checkpoint)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_text = sample.prompt
    prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)  # reset on entry; response_length and rollout_log_probs are not
    sample.loss_mask = []
    response, response_ids, loss_mask, log_probs = "", [], [], []
    stop = list(dict.fromkeys([*(sampling_params.get("stop") or []), "</search>", "</answer>"]))
    params = {**sampling_params, "stop": stop}
    output: dict = {}
    for _ in range(2):
        output, ids, lps = await _call(url, {"text": prompt_text + response, "sampling_params": params,
                                             "return_logprob": True})
        meta = output["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            sample.status = type(sample.status)("aborted")
            return sample
        response += output["text"]
        response_ids += ids
        loss_mask += [1] * len(ids)
        log_probs += lps
        sample.append_response_tokens(args, tokens=ids, log_probs=lps, trainable=True, meta_info=meta)
        if meta["finish_reason"]["type"] == "length":
            break
        action = _ACTION.search(output["text"])
        if action is not None and action.group(1) == "answer":
            break
        observation = (f"\n\n<information>{search(action.group(2)).strip()}</information>\n\n"
                       if action is not None else "\nMy previous action is invalid. Let me try again.\n")
        observation_ids = tok(observation, add_special_tokens=False)["input_ids"]
        response += observation
        response_ids += observation_ids
        loss_mask += [0] * len(observation_ids)
        log_probs += [0.0] * len(observation_ids)
        sample.append_response_tokens(args, tokens=observation_ids, trainable=False)
    sample.tokens = prompt_ids + response_ids
    sample.response_length, sample.response = len(response_ids), response
    sample.loss_mask, sample.rollout_log_probs = loss_mask, log_probs or None
    sample.prompt = prompt_text
    finish = output["meta_info"]["finish_reason"]["type"]
    sample.status = type(sample.status)({"length": "truncated", "abort": "aborted"}.get(finish, "completed"))
    return sample


async def search_r1_reward(args: Any, sample: Any) -> float:
    """Exact match of the last <answer> against label["ground_truth"]["target"]; 0.2 for a
    well-formed wrong answer."""
    targets = sample.label["ground_truth"]["target"]
    answers = re.findall(r"<answer>(.*?)</answer>", sample.response, re.DOTALL)
    if not answers:
        return 0.0
    return 1.0 if answers[-1].strip().lower() in [t.lower() for t in targets] else 0.2
