#!/usr/bin/env python
"""Multi-turn rows of the speed-up table: agentic samples, sync vs this pipeline at equal engines.

Every sample makes `turns` engine calls with a tool call between consecutive ones; the
tool's latency is log-normal (median `tool_median_s`, p99 `tool_p99_s`: a long tail, as
code execution and search have), seeded per sample and turn, so every row waits on the
same tools. The tool's output (`tool_tokens` tokens) joins the response with loss mask 0.
The engine calls and tool calls are made by `generate`, a generate function with slime's
signature: the pipeline row runs it in a `rollout worker --generate-function` process,
the sync row (bench/in_memory.py at η = 0) calls it in process. A sample holds one slot
across all its turns in both, so tool time is slot time: utilization counts only slots
decoding. Everything else as bench/async_vs_sync.py (its Settings, trainer, pause
protocol, simulators); per-turn output lengths are the simulators' log-normal.

    python bench/multi_turn.py              # sync and pipeline η = 2 (two --concurrency), ~4 minutes on 2 cores
    python bench/multi_turn.py --json
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.async_vs_sync import PipelineRollout  # noqa: E402
from bench.report import run_bench  # noqa: E402
from bench.in_memory import InMemoryRollout  # noqa: E402
from bench.rl_loop import Z99, Settings, make_groups, run_trainer  # noqa: E402
from bench.sim_fleet import SimFleet  # noqa: E402
from pipeline.types import Sample, Status  # noqa: E402

log = logging.getLogger("bench.multi_turn")
#: The tool settings reach the worker process through this environment variable (JSON).
TOOLS_ENV = "ROLLOUT_BENCH_TOOLS"
GENERATE_FUNCTION = "bench.multi_turn:generate"
ETA = 2


@dataclass(frozen=True)
class ToolSettings:
    turns: int = 4  # engine calls per sample
    tool_median_s: float = 0.3
    tool_p99_s: float = 3.0  # 10 x the median
    tool_tokens: int = 16  # tool output per call, loss mask 0
    seed: int = 0

    def latency(self, index: int, turn: int) -> float:
        """The tool call after `turn` of sample `index`: the same in every row."""
        sigma = math.log(self.tool_p99_s / self.tool_median_s) / Z99
        return random.Random(f"{self.seed}|{index}|{turn}").lognormvariate(math.log(self.tool_median_s), sigma)

    @classmethod
    def from_env(cls) -> ToolSettings:
        return cls(**json.loads(os.environ.get(TOOLS_ENV, "{}")))


_session: aiohttp.ClientSession | None = None


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """slime's signature: `turns` engine calls, a tool call between; continues an aborted
    sample from where it stopped (its turns so far are in metadata)."""
    global _session
    tools = ToolSettings.from_env()
    if _session is None or _session.closed:
        _session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    if not sample.tokens:
        sample.tokens = list(sample.prompt.encode())
    turn = sample.metadata.setdefault("turn", 0)
    while turn < tools.turns:
        remaining = sampling_params["max_new_tokens"] - sample.response_length
        if remaining <= 0:
            sample.status = Status.TRUNCATED
            return sample
        body = {"input_ids": sample.tokens, "return_logprob": True,
                "sampling_params": dict(sampling_params, max_new_tokens=remaining)}
        async with _session.post(url, json=body) as response:
            response.raise_for_status()
            output = await response.json()
        meta = output["meta_info"]
        pairs = meta["output_token_logprobs"]
        sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                      meta_info=meta)
        if meta["finish_reason"]["type"] == "abort":
            return sample
        turn = sample.metadata["turn"] = turn + 1
        if turn < tools.turns:
            await asyncio.sleep(tools.latency(sample.index, turn))
            sample.append_response_tokens(args, tokens=[32] * tools.tool_tokens, trainable=False)
    sample.status = Status.COMPLETED
    return sample


class SyncMultiTurn(InMemoryRollout):
    """bench/in_memory.py at η = 0 (the synchronous loop), each sample through `generate`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._urls = itertools.cycle(self.engines.urls)

    async def _generate(self, group, sample: Sample) -> None:
        if self.paused:
            sample.status = Status.ABORTED
            return
        host, port = next(self._urls).removeprefix("http://").rsplit(":", 1)
        before = sample.response_length
        await generate(SimpleNamespace(sglang_router_ip=host, sglang_router_port=int(port)), sample,
                       self.sampling.params(self.settings.max_new_tokens))
        self.waterfall.generated += sample.response_length - before

    async def finish(self):
        tokens = await super().finish()
        if _session is not None:
            await _session.close()
        return tokens


async def _run(system: str, settings: Settings, fleet: SimFleet, workdir: Path, concurrency: int) -> dict:
    if system == "pipeline":
        source = PipelineRollout(settings, fleet.urls, ETA, workdir,
                                 # It continues aborted samples (as the sync row's in-process loop does):
                                 # slime's --partial-rollout, which hands them back to it.
                                 ["--generate-function", GENERATE_FUNCTION, "--partial-rollout",
                                  "--concurrency", str(concurrency)])
        try:
            trainer = await run_trainer(settings, source, fleet, ETA)
        except BaseException:
            log.error("pipeline row failed; worker log:\n%s", source.worker_log_tail())
            raise
        finally:
            await source.finish()
    else:
        source = SyncMultiTurn(settings, fleet.urls, 0, make_groups(settings, settings.groups_needed(0)))
        try:
            trainer = await run_trainer(settings, source, fleet, 0)
        finally:
            await source.finish()
    window = trainer.window_s
    return {"name": "sync" if system == "sync" else f"pipeline η={ETA}", "system": system,
            "concurrency": concurrency,
            "samples_per_s": round(settings.steps * settings.batch_groups * settings.n_samples / window, 2),
            "tokens_per_s": round(sum(trainer.tokens) / window, 1),
            "trainer_idle": round(sum(trainer.wait_s) / window, 4),
            "utilization": round(trainer.window.utilization, 4),
            "free_slots": round(trainer.window.free_slots, 4),
            "engines_paused": round(trainer.window.paused, 4),
            # lag of each trained group's oldest token (rl_loop.version_lags)
            "staleness": dict(sorted(trainer.staleness_oldest.items())), "restarted": trainer.restarted,
            "window_s": round(window, 2)}


def run_all(settings: Settings, tools: ToolSettings, concurrency_factors: list[float]) -> dict:
    """sync, then the pipeline with `--concurrency` = slots per engine × each factor (a
    sample holds its slot through its tool calls: above 1, the engines' queues cover them)."""
    os.environ[TOOLS_ENV] = json.dumps(asdict(tools))  # the worker processes inherit it
    rows = []
    started = time.monotonic()
    runs = [("sync", settings.slots_per_engine)] + [
        ("pipeline", round(settings.slots_per_engine * f)) for f in concurrency_factors]
    with tempfile.TemporaryDirectory(prefix="multiturn-") as tmp:
        for i, (system, concurrency) in enumerate(runs):
            workdir = Path(tmp) / f"row{i}"
            workdir.mkdir()
            with SimFleet(settings.sim_config(), settings.engines) as fleet:
                rows.append(asyncio.run(_run(system, settings, fleet, workdir, concurrency)))
            log.info("%s: %s", system, rows[-1])
    sync = rows[0]
    for row in rows:
        row["ratio_to_sync"] = round(row["samples_per_s"] / sync["samples_per_s"], 3)
    return {"rows": rows, "speedup": rows[1]["ratio_to_sync"],
            "settings": {**asdict(settings), **asdict(tools), "capacity_slots": settings.capacity,
                         "command": " ".join(["python", "bench/multi_turn.py"] + sys.argv[1:]),
                         "elapsed_s": round(time.monotonic() - started, 1)}}


def print_table(result: dict) -> None:
    s = result["settings"]
    print(f"engines {s['engines']} x {s['slots_per_engine']} slots at {s['decode_tokens_per_s']:g} tok/s per request; "
          f"{s['turns']} turns per sample, output per turn median {s['median_tokens']:g} p99 {s['p99_tokens']:g}; "
          f"tool latency log-normal median {s['tool_median_s']:g}s p99 {s['tool_p99_s']:g}s, "
          f"{s['tool_tokens']} tool tokens; B = {s['batch_groups']} x {s['n_samples']}; "
          f"{s['steps']} steps after {s['warmup_steps']}; engine profile {s['engine_profile']}, pause mode "
          f"{s['pause_mode']}, weight update {s['weight_update']}")
    print()
    print("| row | turns | samples in flight per engine | samples/s | trained tokens/s | x sync | trainer idle "
          "| engine utilization (slots free, time paused) | staleness (lag: groups) | restarted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        stale = ", ".join(f"{k}: {v}" for k, v in r["staleness"].items())
        print(f"| {r['name']} | {s['turns']} | {r['concurrency']} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} "
              f"| {r['ratio_to_sync']:.2f} | {r['trainer_idle']:.0%} | {r['utilization']:.0%} (free "
              f"{r['free_slots']:.0%}, paused {r['engines_paused']:.0%}) | {stale} | {r['restarted']} |")


def main(argv: list[str] | None = None) -> dict:
    d, t = Settings(engines=2, median_tokens=64.0, p99_tokens=640.0, batch_groups=16, steps=5), ToolSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup_steps)
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--slots", type=int, default=d.slots_per_engine)
    p.add_argument("--batch", type=int, default=d.batch_groups)
    p.add_argument("--n-samples", type=int, default=d.n_samples)
    p.add_argument("--median", type=float, default=d.median_tokens, help="median output tokens per turn")
    p.add_argument("--p99", type=float, default=d.p99_tokens, help="p99 output tokens per turn")
    p.add_argument("--turns", type=int, default=t.turns)
    p.add_argument("--tool-median-s", type=float, default=t.tool_median_s)
    p.add_argument("--tool-p99-s", type=float, default=t.tool_p99_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--concurrency-factors", default="1,2",
                   help="pipeline rows: --concurrency as multiples of --slots (default 1,2)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(engines=a.engines, slots_per_engine=a.slots, median_tokens=a.median, p99_tokens=a.p99,
                        batch_groups=a.batch, n_samples=a.n_samples, steps=a.steps, warmup_steps=a.warmup,
                        seed=a.seed)
    tools = ToolSettings(turns=a.turns, tool_median_s=a.tool_median_s, tool_p99_s=a.tool_p99_s, seed=a.seed)
    result = run_all(settings, tools, [float(x) for x in a.concurrency_factors.split(",")])
    if not a.json:
        print_table(result)
    return result


if __name__ == "__main__":
    run_bench(main)
