#!/usr/bin/env python
"""The simulator against a published t(b) table: vLLM serving Llama-2-7B on one H100.

The measurement (FerranAgulloLopez/vLLMBatchingMemoryGap at a918634,
benchmarks/definitive_results/advisor/output_length/_260/llama-2-7b/_<b>__2000/openai-infqps-*.json):
vLLM 0.6 with chunked prefill (512 tokens per step), `--max-num-seqs` b, 2,000 requests
sent at once, each 250 prompt tokens and 261 output tokens; per b the median time per
output token (TPOT) and the output tokens/s. Past b = 128 a batch of 511-token contexts
no longer fits the KV cache (90,624 tokens), and throughput stops growing.

Here the same experiment runs on a real simulator (`start_simulator`, profile
`h100-llama2-7b`, its KV capacity, max_running_requests = b) through real HTTP: every
request queued before the first step (the simulator held until all have arrived, as the
published run queued its 2,000), each answered with the model times of its first and
last token (`SimConfig.model_times`: when the engine's own step schedule made them, not
when the client saw them, so the figures do not depend on the machine's load). TPOT
per request = (last - first) ÷ (tokens - 1), as vLLM's benchmark computes it, median
over the rounds measured; throughput over whole rounds of requests after the first. The
simulator runs `speedup` times faster than real time (decode_tokens_per_s = speedup / t1);
its times are scaled back before they are compared, and only the run's length depends on it.

    python bench/engine_table.py            # every batch of the table, ~20 s
    python bench/engine_table.py --json     # t_of_b_error_max, saturation_spread, rows
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/engine_table.py` from a clone
    sys.path.insert(0, str(REPO))

from bench.report import run_bench  # noqa: E402
from engines.profiles import LLAMA2_7B_KV_TOKENS, engine_profile  # noqa: E402
from engines.server import ServerHandle  # noqa: E402
from engines.simulator import SimConfig, start_simulator  # noqa: E402

PROFILE = "h100-llama2-7b"
SOURCE = ("FerranAgulloLopez/vLLMBatchingMemoryGap a9186347e6146b4547ed25674b4e9034eb1e9abf "
          "benchmarks/definitive_results/advisor/output_length/_260/llama-2-7b/_<b>__2000/openai-infqps-*.json")
PROMPT_TOKENS, OUTPUT_TOKENS = 250, 261
#: batch (max_num_seqs) -> (median TPOT ms, output tokens/s), as published.
PUBLISHED: dict[int, tuple[float, float]] = {
    1: (10.861, 91.8), 2: (11.299, 175.8), 4: (11.418, 346.7), 8: (12.134, 652.3), 16: (13.854, 1143.7),
    32: (16.651, 1886.6), 64: (22.085, 2810.4), 128: (33.844, 3695.8), 256: (51.493, 3987.5), 512: (49.959, 4073.4),
}
#: The largest batch whose contexts all fit the cache; past it the cache, not b, sets the batch.
KV_FULL_AFTER = max(b for b in PUBLISHED if b * (PROMPT_TOKENS + OUTPUT_TOKENS) <= LLAMA2_7B_KV_TOKENS)
DEFAULT_SPEEDUP = 50.0  # simulator time against real time
QUEUE_TIMEOUT_S = 120.0  # for every request of a batch size to reach the held simulator


@dataclass
class BatchRow:
    batch: int
    requests: int
    published_tpot_ms: float
    published_tokens_per_s: float
    tpot_ms: float  # median over the rounds measured, scaled back to real time
    tokens_per_s: float  # output tokens/s over the middle half of the completions, real time
    tpot_error: float  # relative to the published TPOT
    ratio_error: float  # of t(b)/t(1) against the published t(b)/t(1)
    tokens_per_s_error: float
    kv_full: bool  # the batch's contexts overflow the cache: throughput is what the cache holds


def held(batch: int) -> int:
    """Requests running at once: the batch, or as many whole contexts as the cache holds."""
    return min(batch, LLAMA2_7B_KV_TOKENS // (PROMPT_TOKENS + OUTPUT_TOKENS))


def rounds(batch: int) -> int:
    """Rounds of `held(batch)` requests measured: one, or two past the cache's limit,
    where requests are retracted and rounds blur (a longer window, less noise)."""
    return 1 if batch <= KV_FULL_AFTER else 4


def requests_for(batch: int) -> int:
    """A round of what runs at once, the rounds measured, and a round behind them so
    that the queue stays full throughout, as in the published run."""
    return (rounds(batch) + 2) * held(batch)


async def _one(session: aiohttp.ClientSession, url: str, ids: list[int]) -> tuple[float, float]:
    """(first token, last token) of one request, in the simulator's model time."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/generate answered {resp.status}: {(await resp.text())[:200]}")
        meta = (await resp.json())["meta_info"]
    if meta["completion_tokens"] != OUTPUT_TOKENS:
        raise RuntimeError(f"decoded {meta['completion_tokens']} tokens, not {OUTPUT_TOKENS}")
    times = meta["sim_model_time"]
    return times["first_token"], times["last_token"]


async def _queued(session: aiohttp.ClientSession, url: str, n: int) -> None:
    """Wait until the simulator has queued `n` requests."""
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    while True:
        async with session.get(url + "/sim/stats") as resp:
            if (await resp.json())["stats"].get("submitted", 0) >= n:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not queue {n} requests within {QUEUE_TIMEOUT_S:g} s")
        await asyncio.sleep(0.01)


async def _drive(sim: ServerHandle, batch: int, seed: int) -> list[tuple[float, float]]:
    """Every request queued on the held simulator, then released, as the published run
    queued its 2,000; returns each request's (first token, last token) in model time."""
    n = requests_for(batch)
    rng = random.Random(f"{seed}|{batch}")
    timeout = aiohttp.ClientTimeout(total=600)
    sim.call(sim.server.engine.hold, True)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        # Distinct prompts of one length (the published run had no prefix caching): the
        # schedule is the same whatever order they arrive in.
        tasks = [asyncio.create_task(_one(session, sim.url, [rng.randrange(32, 127) for _ in range(PROMPT_TOKENS)]))
                 for _ in range(n)]
        try:
            await _queued(session, sim.url, n)
        finally:
            sim.call(sim.server.engine.hold, False)
        return await asyncio.gather(*tasks)


def measure_batch(batch: int, speedup: float, seed: int = 0) -> tuple[float, float, int]:
    """(TPOT in real seconds, output tokens/s in real time, requests) at max_running_requests = batch."""
    t1 = engine_profile(PROFILE).t1_s
    config = SimConfig(seed=seed, engine_profile=PROFILE, decode_tokens_per_s=speedup / t1,
                       max_running_requests=batch, max_total_num_tokens=LLAMA2_7B_KV_TOKENS, model_times=True)
    with start_simulator(config) as sim:
        times = sorted(asyncio.run(_drive(sim, batch, seed)), key=lambda t: t[1])
    # Whole rounds, from the end of the first round's last request. (Requests of equal
    # length run in rounds; a window cutting rounds unevenly would be biased.)
    lo, hi = held(batch) - 1, (1 + rounds(batch)) * held(batch) - 1
    done = [last for _, last in times]
    tokens_per_s = (hi - lo) * OUTPUT_TOKENS / (done[hi] - done[lo]) if done[hi] > done[lo] else 0.0
    tpot = statistics.median((last - first) / (OUTPUT_TOKENS - 1) for first, last in times[lo + 1:hi + 1])
    return tpot * speedup, tokens_per_s / speedup, len(times)


def measure(batches: list[int], speedup: float, seed: int = 0) -> dict:
    """Every batch of `batches` (each a key of PUBLISHED, 1 first) against the table."""
    if batches[0] != 1 or any(b not in PUBLISHED for b in batches):
        raise ValueError(f"batches must start at 1 and come from the table: {sorted(PUBLISHED)}")
    started = time.monotonic()
    measured = {b: measure_batch(b, speedup, seed) for b in batches}
    rows = []
    t_1, pub_1 = measured[1][0], PUBLISHED[1][0] / 1000
    for b, (tpot, tokens_per_s, n) in measured.items():
        pub_tpot, pub_tps = PUBLISHED[b]
        rows.append(BatchRow(
            batch=b, requests=n, published_tpot_ms=pub_tpot, published_tokens_per_s=pub_tps,
            tpot_ms=round(tpot * 1000, 3), tokens_per_s=round(tokens_per_s, 1),
            tpot_error=round(tpot * 1000 / pub_tpot - 1, 4),
            ratio_error=round((tpot / t_1) / (pub_tpot / 1000 / pub_1) - 1, 4),
            tokens_per_s_error=round(tokens_per_s / pub_tps - 1, 4), kv_full=b > KV_FULL_AFTER))
    table = [r for r in rows if not r.kv_full]
    full = [r.tokens_per_s for r in rows if r.kv_full]
    return {
        # The worst relative error of a TPOT point (b up to the cache's limit) against the table.
        "t_of_b_error_max": max(abs(r.tpot_error) for r in table),
        "ratio_error_max": max(abs(r.ratio_error) for r in table),
        # Past the cache's limit: (max - min) / min of the throughputs, and each against the table.
        "saturation_spread": round(max(full) / min(full) - 1, 4) if full else None,
        "saturation_error_max": max((abs(r.tokens_per_s_error) for r in rows if r.kv_full), default=None),
        "kv_full_after": KV_FULL_AFTER,
        "rows": [asdict(r) for r in rows],
        "settings": {"profile": PROFILE, "kv_tokens": LLAMA2_7B_KV_TOKENS, "prompt_tokens": PROMPT_TOKENS,
                     "output_tokens": OUTPUT_TOKENS, "speedup": speedup, "seed": seed, "source": SOURCE,
                     "elapsed_s": round(time.monotonic() - started, 1)},
    }


def print_table(result: dict) -> None:
    s = result["settings"]
    print(f"profile {s['profile']}, KV {s['kv_tokens']:,} tokens, {s['prompt_tokens']} prompt + {s['output_tokens']} "
          f"output tokens, simulator x{s['speedup']:g} real time; published: {s['source']}\n")
    print("| b | TPOT published (ms) | TPOT simulator (ms) | error | t(b)/t(1) error | tokens/s published "
          "| tokens/s simulator | error |\n|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        full = " (cache full)" if r["kv_full"] else ""
        print(f"| {r['batch']}{full} | {r['published_tpot_ms']:.2f} | {r['tpot_ms']:.2f} | {r['tpot_error']:+.1%} "
              f"| {r['ratio_error']:+.1%} | {r['published_tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} "
              f"| {r['tokens_per_s_error']:+.1%} |")
    print(f"\nt_of_b_error_max = {result['t_of_b_error_max']:.1%} (b <= {result['kv_full_after']}); "
          f"throughput past the cache's limit spread {result['saturation_spread']:.1%}, "
          f"worst against the table {result['saturation_error_max']:.1%}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=",".join(map(str, PUBLISHED)),
                   help="batch sizes from the table, 1 first (default: all); e.g. --batches 1,8,128,256,512")
    p.add_argument("--speedup", type=float, default=DEFAULT_SPEEDUP,
                   help=f"simulator time against real time (default {DEFAULT_SPEEDUP:g}; the figures do not depend on it, "
                        "the run's length does)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        batches = [int(x) for x in args.batches.split(",") if x]
    except ValueError:
        p.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    if not batches or batches[0] != 1 or any(b not in PUBLISHED for b in batches):
        p.error(f"--batches must start with 1 and come from {','.join(map(str, PUBLISHED))}")
    if args.speedup <= 0:
        p.error("--speedup must be positive")
    result = measure(batches, args.speedup, args.seed)
    if not args.json:
        print_table(result)
    return result


if __name__ == "__main__":
    run_bench(main)
