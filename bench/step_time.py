#!/usr/bin/env python
"""t(b): an engine's decode step time at batch b, measured through SGLang's /generate.

For each b, b concurrent requests (distinct prompts, so no prefix is shared) decode a
fixed number of tokens with `ignore_eos`, then b requests decode one token; the step
time is the difference over the extra tokens, which leaves out prefill and HTTP:

    t(b) = (T(b, tokens) - T(b, 1)) / (tokens - 1)

b / t(b) is the engine's decode throughput at that batch, and r = t(largest b)/t(1) is
the slowdown the simulator's profiles model (engines/profiles.py, docs/performance.md).

    python bench/step_time.py --engine-url http://127.0.0.1:30000
    python bench/step_time.py --engine-url http://127.0.0.1:30000 --batches 1,8,64 --tokens 128 --json
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/step_time.py` from a clone
    sys.path.insert(0, str(REPO))

from bench.report import run_bench  # noqa: E402

DEFAULT_BATCHES = "1,2,4,8,16,32,64,128"


async def _round(session: aiohttp.ClientSession, url: str, prompts: list[list[int]], tokens: int) -> float:
    """Seconds until all of `prompts` have decoded `tokens` tokens each."""

    async def one(ids: list[int]) -> None:
        params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0}
        async with session.post(url + "/generate", json={"input_ids": ids, "sampling_params": params}) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200:
                raise RuntimeError(f"{url}/generate answered {resp.status}: {body}")
        got = body["meta_info"]["completion_tokens"]
        if got != tokens:  # without ignore_eos honoured the timing would mean nothing
            raise RuntimeError(f"{url} decoded {got} tokens, not the {tokens} asked for (ignore_eos ignored?)")

    start = time.monotonic()
    await asyncio.gather(*(one(ids) for ids in prompts))
    return time.monotonic() - start


async def measure(url: str, batches: list[int], tokens: int, prompt_tokens: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    url = url.rstrip("/")
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await _round(session, url, [[rng.randrange(32, 127) for _ in range(prompt_tokens)]], 2)  # warm-up
        for b in batches:
            # Fresh prompts for each round: a cached prefix would make the short round cheaper.
            def prompts() -> list[list[int]]:
                return [[rng.randrange(32, 127) for _ in range(prompt_tokens)] for _ in range(b)]
            long_s = await _round(session, url, prompts(), tokens)
            short_s = await _round(session, url, prompts(), 1)
            if long_s <= short_s:
                raise RuntimeError(f"at b = {b}, {tokens} tokens took no longer than 1 ({long_s:.3f}s against "
                                   f"{short_s:.3f}s): the decoding is lost in the overhead, raise --tokens")
            step_s = (long_s - short_s) / (tokens - 1)
            rows.append({"batch": b, "step_ms": round(step_s * 1000, 4), "tokens_per_s": round(b / step_s, 1),
                         "long_s": round(long_s, 4), "short_s": round(short_s, 4)})
    first, last = rows[0]["step_ms"], rows[-1]["step_ms"]
    return {"engine_url": url, "tokens": tokens, "prompt_tokens": prompt_tokens, "rows": rows,
            "r": round(last / first, 3)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-url", required=True, help="an SGLang-compatible engine, e.g. http://127.0.0.1:30000")
    p.add_argument("--batches", default=DEFAULT_BATCHES, help=f"batch sizes b (default {DEFAULT_BATCHES})")
    p.add_argument("--tokens", type=int, default=256, help="tokens each request decodes (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",") if x]
    if args.tokens < 2 or not batches or min(batches) < 1:
        p.error("need --tokens >= 2 and batch sizes >= 1")
    result = asyncio.run(measure(args.engine_url, batches, args.tokens, args.prompt_tokens))
    if args.json:
        return result
    print(f"{result['engine_url']}: {args.tokens} tokens per request, {args.prompt_tokens}-token prompts")
    print("| b | t(b) ms | tokens/s |\n|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['batch']} | {row['step_ms']:.3f} | {row['tokens_per_s']} |")
    print(f"r = t({batches[-1]}) / t({batches[0]}) = {result['r']}")
    return result


if __name__ == "__main__":
    run_bench(main)
