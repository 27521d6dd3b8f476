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
    """A multi-agent function, as slime documents a fan-out: a copy of the sample per agent
    (same index and group_index), one rollout_id for both."""
    second = copy.deepcopy(sample)
    second.metadata["agent"] = 2
    sample.rollout_id = second.rollout_id = sample.index
    await three_turns(args, sample, sampling_params)
    first = copy.deepcopy(sample.to_dict())
    await three_turns(args, second, sampling_params)
    PRODUCED[(sample.index, 1)], PRODUCED[(sample.index, 2)] = first, PRODUCED[sample.index]
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


# -- slime's data model through the worker (tests/test_function_output.py) -------------------

#: sample index -> each sample the function was handed, as it was handed (to_dict)
GIVEN: dict[int, list[dict]] = {}
#: sample index -> args.partial_rollout as each call saw it
PARTIAL_FLAGS: dict[int, list[bool]] = {}
#: set when a reward started scoring (a background task of the function waits for it)
REWARD_STARTED = threading.Event()
_CACHED: list = []


def _record_given(args, sample) -> None:
    GIVEN.setdefault(sample.index, []).append(copy.deepcopy(sample.to_dict()))
    PARTIAL_FLAGS.setdefault(sample.index, []).append(args.partial_rollout)


async def counts_tool_calls(args, sample, sampling_params):
    """As retool: an attribute slime's Sample does not declare, read by the reward."""
    _record_given(args, sample)
    await three_turns(args, sample, sampling_params)
    sample.tool_call_count = TURNS - 1
    sample.payload_has_tools = True
    return sample


async def dapo_like_reward(args, sample):
    """As retool's reward_func: math_dapo's dict (a bool and a string beside the score),
    the score adjusted by the tool calls the generate function counted."""
    REWARD_STARTED.set()
    await asyncio.sleep(0.02)  # a judge's latency: whatever else runs meanwhile must not matter
    num_turns = getattr(sample, "tool_call_count", 0)
    result = {"score": -1.0, "acc": False, "pred": "5"}
    result["score"] = min(-0.6, result["score"] + (num_turns - 2) / 2 * 0.1) + sum(sample.response_tokens) % 7 / 100
    return result


async def token_sum_reward(args, sample):
    """A number that follows from the response tokens, scored after a judge's latency."""
    REWARD_STARTED.set()
    await asyncio.sleep(0.02)
    return float(sum(sample.response_tokens) % 7)


async def resets_like_search_r1(args, sample, sampling_params):
    """As slime's search-r1 generate: refuses partial rollouts, and given a sample anyway
    resets tokens and loss_mask but not response_length nor rollout_log_probs, so slime's
    append_response_tokens raises on a partial sample."""
    assert not args.partial_rollout, "Partial rollout is not supported for this function at the moment."
    _record_given(args, sample)
    CALLS[sample.index] = CALLS.get(sample.index, 0) + 1
    prompt = _bytes.encode(sample.prompt)
    sample.tokens = list(prompt)
    sample.loss_mask = []
    async with aiohttp.ClientSession() as session:
        for turn in range(TURNS):
            if turn == 1:
                SECOND_CALL_SENT.set()
            params = dict(sampling_params, max_new_tokens=sampling_params["max_new_tokens"] if LONG_TURNS
                          else TURN_TOKENS)
            output = await _post(session, args, {"input_ids": sample.tokens, "sampling_params": params,
                                                 "return_logprob": True})
            meta = output["meta_info"]
            if meta["finish_reason"]["type"] == "abort":
                pairs = meta["output_token_logprobs"]
                sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                              meta_info=meta)
                ABORTED[sample.index] = copy.deepcopy(sample.to_dict())
                return sample
            pairs = meta["output_token_logprobs"]
            sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                          meta_info=meta)
            if turn < TURNS - 1:
                sample.append_response_tokens(args, tokens=tool_output(turn + 1), trainable=False)
    sample.status = type(sample.status)("completed")
    PRODUCED[sample.index] = copy.deepcopy(sample.to_dict())
    return sample


async def records_its_prompt(args, sample, sampling_params):
    _record_given(args, sample)
    return await three_turns(args, sample, sampling_params)


async def returns_one_object_twice(args, sample, sampling_params):
    await three_turns(args, sample, sampling_params)
    sample.rollout_id = sample.index
    return [sample, sample]


async def changes_the_prompt_of_odd_samples(args, sample, sampling_params):
    await three_turns(args, sample, sampling_params)
    if sample.index % 2:
        sample.tokens = [ord("X")] + sample.tokens[1:]  # not the prompt's ids any more
    return sample


async def returns_a_cached_sample(args, sample, sampling_params):
    """Returns the first sample it ever made, whatever it is called for (a cache keyed wrong)."""
    if not _CACHED:
        _CACHED.append(await three_turns(args, sample, sampling_params))
    return _CACHED[0]


async def rewrites_after_returning(args, sample, sampling_params):
    """Leaves a task running that rewrites the returned sample's tokens once the reward
    started scoring it."""
    await three_turns(args, sample, sampling_params)

    async def rewrite():
        while not REWARD_STARTED.is_set():
            await asyncio.sleep(0.005)
        sample.tokens[-1] = 7 if sample.tokens[-1] != 7 else 8
        sample.tool_call_count = 99

    BACKGROUND.add(asyncio.get_running_loop().create_task(rewrite()))
    return sample


BACKGROUND: set = set()


def reset_data_model_records() -> None:
    GIVEN.clear(), PARTIAL_FLAGS.clear(), _CACHED.clear(), BACKGROUND.clear()
    REWARD_STARTED.clear(), BLOCKING.clear(), RELEASE.clear()


#: blocks_its_loop: set while it blocks; it blocks until RELEASE is set (or 60 s).
BLOCKING = threading.Event()
RELEASE = threading.Event()


async def blocks_its_loop(args, sample, sampling_params):
    """Holds its event loop as retool's sandbox does (subprocess.communicate, up to 120 s)."""
    BLOCKING.set()
    RELEASE.wait(60)  # not awaited: nothing else on this loop runs meanwhile
    return await three_turns(args, sample, sampling_params)
