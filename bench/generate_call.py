#!/usr/bin/env python
"""What one generate-function call costs the worker, beside the function's own work.

`GenerateFunction.call` hands the function a copy of its sample, runs it on the loop of
user code (a thread of its own, so a function that blocks cannot starve the heartbeat),
snapshots what it returns (a deep copy) and checks it (lengths, storable fields). This
times that call, with a function that returns at once, against awaiting the same
function directly on the worker's loop (what the worker did before), for samples that
already hold `tokens` response tokens (the copy grows with them; a fresh sample is the
first turn's case, `--tokens 0`).

    python bench/generate_call.py                 # 0 and 2,048 response tokens
    python bench/generate_call.py --tokens 16384 --calls 200 --json
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.types import Sample, Status  # noqa: E402
from workers.generate_function import GenerateFunction, generate_args  # noqa: E402
from workers.settings import WorkerSettings  # noqa: E402
from workers.worker import reward_args  # noqa: E402
from bench.report import run_bench  # noqa: E402


async def returns_at_once(args, sample, sampling_params):
    sample.status = Sample.Status.COMPLETED
    return sample


def sample_with(tokens: int) -> Sample:
    s = Sample(group_index=0, index=0, prompt="What is 2 + 3?", label="5", tokens=list(range(100 + tokens)),
               response_length=tokens, loss_mask=[1] * tokens, rollout_log_probs=[-0.5] * tokens,
               weight_versions=["1"] if tokens else [], status=Status.ABORTED if tokens else Status.PENDING)
    s.tool_call_count = 2
    return s


async def measure(tokens: int, calls: int) -> dict:
    settings = WorkerSettings(redis_url="redis://unused", engine_urls=["http://127.0.0.1:1"],
                              generate_function="bench.generate_call:returns_at_once")
    function = GenerateFunction.from_path(settings.generate_function)
    args = generate_args(settings, settings.engine_urls[0], 1, reward_args(settings))
    params = settings.sampling.params(settings.sampling.max_new_tokens)
    sample = sample_with(tokens)
    direct, through = [], []
    for _ in range(calls):
        start = time.perf_counter()
        await returns_at_once(args, sample, dict(params))
        direct.append(time.perf_counter() - start)
        start = time.perf_counter()
        await function.call(args, sample, dict(params), evaluation=False, timeout_s=60)
        through.append(time.perf_counter() - start)
    function.loop.close()
    us = lambda values: round(statistics.median(values) * 1e6, 1)  # noqa: E731
    return {"response_tokens": tokens, "calls": calls, "direct_us": us(direct), "call_us": us(through),
            "overhead_us": round(us(through) - us(direct), 1),
            "call_p99_us": round(sorted(through)[int(0.99 * (len(through) - 1))] * 1e6, 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, action="append", help="response tokens the sample holds (repeat)")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    rows = [asyncio.run(measure(t, opts.calls)) for t in (opts.tokens or [0, 2048])]
    if opts.json:
        return {"rows": rows}
    print("| response tokens held | direct await (µs) | GenerateFunction.call (µs) | overhead (µs) | call p99 (µs) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['response_tokens']:,} | {r['direct_us']} | {r['call_us']} | {r['overhead_us']} | "
              f"{r['call_p99_us']} |")
    return {"rows": rows}


if __name__ == "__main__":
    run_bench(main)
