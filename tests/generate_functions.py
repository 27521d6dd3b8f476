"""Generate functions with slime's signature, for tests/test_generate_function.py. They run
in a WorkerThread of the test process, so what they record here the test can read."""
from __future__ import annotations

import asyncio
import copy
import threading

import aiohttp

from workers.tokenizer import ByteTokenizer

TURNS = 3  # engine calls per sample
TURN_TOKENS = 12  # max_new_tokens of each call, for the fast tests
#: sample index -> the sample as the function returned it (finished, or aborted)
PRODUCED: dict[int, dict] = {}
ABORTED: dict[int, dict] = {}
CALLS: dict[int, int] = {}  # sample index -> calls of the function
#: set just before a sample sends its second engine call (the preemption test pauses then)
SECOND_CALL_SENT = threading.Event()
LONG_TURNS = False  # the preemption test: each call may run to the whole budget
_bytes = ByteTokenizer()


def reset() -> None:
    PRODUCED.clear(), ABORTED.clear(), CALLS.clear()
    ACTIVE.update(now=0, max=0)
    SECOND_CALL_SENT.clear()


def tool_output(turn: int) -> list[int]:
    return _bytes.encode(f"<result>{turn * 7}</result>")


async def _post(session: aiohttp.ClientSession, args, body: dict) -> dict:
    async with session.post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate", json=body) as r:
        r.raise_for_status()
        return await r.json()


async def three_turns(args, sample, sampling_params):
    """TURNS engine calls per sample, tool output (loss mask 0) between them; continues
    an aborted sample from its tokens (its turns so far are in metadata)."""
    CALLS[sample.index] = CALLS.get(sample.index, 0) + 1
    if not sample.tokens:
        sample.tokens = _bytes.encode(sample.prompt)
    turns = sample.metadata.setdefault("turns", 0)
    async with aiohttp.ClientSession() as session:
        while turns < TURNS:
            remaining = sampling_params["max_new_tokens"] - sample.response_length
            params = dict(sampling_params, max_new_tokens=remaining if LONG_TURNS else min(TURN_TOKENS, remaining))
            if turns == 1:
                SECOND_CALL_SENT.set()
            output = await _post(session, args, {"input_ids": sample.tokens, "sampling_params": params,
                                                 "return_logprob": True})
            meta = output["meta_info"]
            pairs = meta["output_token_logprobs"]
            sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                          meta_info=meta, text=output["text"])
            if meta["finish_reason"]["type"] == "abort":
                ABORTED[sample.index] = copy.deepcopy(sample.to_dict())
                return sample
            turns = sample.metadata["turns"] = turns + 1
            if turns < TURNS:
                if sample.metadata.get("tool_pause"):
                    await asyncio.sleep(0.05)  # the tool's own latency
                sample.append_response_tokens(args, tokens=tool_output(turns), trainable=False)
    sample.status = type(sample.status)("completed")
    PRODUCED[sample.index] = copy.deepcopy(sample.to_dict())
    return sample


async def sets_its_reward(args, sample, sampling_params):
    await three_turns(args, sample, sampling_params)
    sample.reward = 0.25
    return sample


async def boom_or_three_turns(args, sample, sampling_params):
    """Raises for prompts that say boom, hangs for prompts that say hang, returns a
    string for prompts that say junk; else three_turns."""
    if "boom" in sample.prompt:
        raise RuntimeError(f"boom in sample {sample.index}")
    if "hang" in sample.prompt:
        await asyncio.Event().wait()
    if "junk" in sample.prompt:
        return "not a sample"
    return await three_turns(args, sample, sampling_params)


async def with_evaluation(args, sample, sampling_params, evaluation=False):
    sample.metadata["evaluation"] = evaluation
    sample.metadata["args"] = {"router": f"{args.sglang_router_ip}:{args.sglang_router_port}",
                               "n_samples_per_prompt": args.n_samples_per_prompt,
                               "rollout_max_response_len": args.rollout_max_response_len,
                               "hf_checkpoint": args.hf_checkpoint,
                               "rollout_max_context_len": args.rollout_max_context_len,
                               "rollout_temperature": args.rollout_temperature}
    return await three_turns(args, sample, sampling_params)


async def search_r1_style(args, sample, sampling_params):
    """As slime's examples/search-r1 writes its sample: fields set directly, slime's own
    Sample and Status, no weight versions recorded (the worker stamps them)."""
    from slime.utils.http_utils import post
    from slime.utils.types import Sample as SlimeSample

    assert isinstance(sample, SlimeSample), type(sample)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = _bytes.encode(sample.prompt)
    response, log_probs, mask = [], [], []
    for turn in range(2):
        output = await post(url, {"input_ids": prompt + response, "return_logprob": True,
                                  "sampling_params": dict(sampling_params, max_new_tokens=8)})
        pairs = output["meta_info"]["output_token_logprobs"]
        response += [p[1] for p in pairs]
        log_probs += [p[0] for p in pairs]
        mask += [1] * len(pairs)
        if turn == 0:
            response += tool_output(1)
            log_probs += [0.0] * len(tool_output(1))
            mask += [0] * len(tool_output(1))
    sample.tokens, sample.response_length = prompt + response, len(response)
    sample.loss_mask, sample.rollout_log_probs = mask, log_probs
    sample.status = SlimeSample.Status.COMPLETED
    PRODUCED[sample.index] = copy.deepcopy(sample.to_dict())
    return sample


async def two_agents(args, sample, sampling_params):
    """A multi-agent function: the sample, and a second agent's sample beside it."""
    from pipeline.types import Sample

    second = Sample(group_index=sample.group_index, index=sample.index + 1000, prompt=sample.prompt,
                    label=sample.label)
    await three_turns(args, sample, sampling_params)
    await three_turns(args, second, sampling_params)
    return [sample, second]


async def one_long_call(args, sample, sampling_params):
    """One engine call that runs for seconds (the hang is in the engine call)."""
    async with aiohttp.ClientSession() as session:
        await _post(session, args, {"input_ids": _bytes.encode(sample.prompt), "return_logprob": True,
                                    "sampling_params": dict(sampling_params, max_new_tokens=2000,
                                                            ignore_eos=True)})
    return sample


ACTIVE = {"now": 0, "max": 0}  # calls of counting_turns running at once


async def counting_turns(args, sample, sampling_params):
    """three_turns with a tool that takes a moment between turns, counting calls in flight."""
    ACTIVE["now"] += 1
    ACTIVE["max"] = max(ACTIVE["max"], ACTIVE["now"])
    try:
        sample.metadata["tool_pause"] = True
        return await three_turns(args, sample, sampling_params)
    finally:
        ACTIVE["now"] -= 1
