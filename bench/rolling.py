#!/usr/bin/env python
"""Rolling weight updates against the global pause: trained tokens/s and staleness over
the cost of one engine's weight update.

Both arms are this pipeline at η = 2 on the rows' settings of bench/async_vs_sync.py
(simulators timed by the calibrated profile, a `rollout worker` process, the trainer
taking exact batches):

  global    after every step the trainer pauses every engine (abort), they update at
            once, it resumes (Controller.update_weights_from_disk): the trainer and
            every engine wait one update cost.
  rolling   after every step the trainer records its version and goes on training;
            in the background the engines update one at a time while the others keep
            generating (Controller.rolling_update). One cycle takes engines × cost; a
            cycle that ends behind the trainer starts again at its newest version, so
            engines skip versions, and staleness grows with the cost. The bound η is
            enforced as in every row: a group too stale when taken is restarted (waste).

The cost is one engine's update in real seconds (0.05: an NCCL broadcast of a 7B model;
5: a reload from disk), scaled like the engines' steps.

    python bench/rolling.py --quick --json    # 1 seed, 4 measured steps, costs 0.05, 0.5, 2, 10 s
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.async_vs_sync import ETA_KEY, PipelineRollout  # noqa: E402
from bench.report import run_bench  # noqa: E402
from bench.rl_loop import Settings, make_row, run_trainer  # noqa: E402
from bench.sim_fleet import SimFleet  # noqa: E402
from pipeline.control import set_weight_version  # noqa: E402

#: One engine's weight-update cost in real seconds, the sweep's points.
COSTS_S = (0.05, 0.5, 2.0, 10.0)
ARMS = ("global", "rolling")
log = logging.getLogger("bench.rolling")


class RollingPipeline(PipelineRollout):
    """The pipeline with rolling updates: the trainer never waits for the engines."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.target = 0  # the trainer's newest version
        self.applied = 0  # the version every engine serves
        self.cycles = 0  # rolling updates run (fewer than steps: versions skipped)
        self.updater: asyncio.Task | None = None

    async def weight_update(self, version: int) -> None:
        await asyncio.to_thread(set_weight_version, self.queue.redis, self.queue.keys, version)
        self.target = version
        if self.updater is not None and self.updater.done():
            self.updater.result()  # a failed update stops the row here, with its error
        if self.updater is None or self.updater.done():
            self.updater = asyncio.create_task(self._roll())

    async def _roll(self) -> None:
        while self.applied < self.target:
            version = self.target
            await self.controller.rolling_update(f"/checkpoints/step-{version}", version)
            self.applied = version
            self.cycles += 1

    async def finish(self):
        if self.updater is not None:
            await self.updater
        return await super().finish()


async def _run(arm: str, settings: Settings, fleet: SimFleet, workdir: Path) -> dict:
    source = (RollingPipeline if arm == "rolling" else PipelineRollout)(settings, fleet.urls, ETA_KEY, workdir)
    try:
        trainer = await run_trainer(settings, source, fleet, ETA_KEY)
        tokens, summary = await source.finish()
    except BaseException:
        log.error("%s row failed; worker log:\n%s", arm, source.worker_log_tail())
        source.close()
        raise
    row = make_row(arm, "pipeline", ETA_KEY, settings, trainer, tokens, audit=summary)
    lags = [lag for lag, count in row.staleness_oldest.items() for _ in range(count)]
    return {
        "arm": arm, "update_cost_s": settings.update_cost_s, "seed": settings.seed,
        "trained_tokens_per_s": round(row.trained_tokens_per_s, 1),
        "trained_utilization": round(row.trained_utilization, 3),
        "staleness_oldest_mean": round(statistics.fmean(lags), 3),
        "staleness_oldest_max": max(lags),
        "staleness_oldest": row.staleness_oldest,
        "restarted": row.restarted,
        "engines_paused": round(row.engines_paused, 3),
        "trainer_idle": round(row.trainer_idle, 3),
        "update_fraction": round(row.update_fraction, 3),
        "rolling_cycles": source.cycles if isinstance(source, RollingPipeline) else None,
        "audit": row.audit,
    }


def run_all(base: Settings, costs: list[float], seeds: list[int]) -> dict:
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollingbench-") as tmp:
        for seed in seeds:
            for cost in costs:
                for arm in ARMS:
                    settings = replace(base, weight_update=repr(cost), seed=seed)
                    workdir = Path(tmp) / f"{arm}-{cost:g}-{seed}"
                    workdir.mkdir()
                    with SimFleet(settings.sim_config(), settings.engines) as fleet:
                        row = asyncio.run(_run(arm, settings, fleet, workdir))
                    log.info("%s cost %gs seed %d: %.0f trained tok/s, staleness mean %.2f", arm, cost, seed,
                             row["trained_tokens_per_s"], row["staleness_oldest_mean"])
                    rows.append(row)
    return {"eta": ETA_KEY, "costs_s": costs, "seeds": seeds, "rows": rows,
            "settings": {**asdict(base), "time_scale": round(base.time_scale, 3),
                         "command": " ".join(["python", "bench/rolling.py"] + sys.argv[1:]),
                         "elapsed_s": round(time.monotonic() - started, 1)}}


def print_table(result: dict) -> None:
    s = result["settings"]
    print(f"engines {s['engines']} x {s['slots_per_engine']} slots, profile {s['engine_profile']}, η = "
          f"{result['eta']}, {s['steps']} steps measured after {s['warmup_steps']}, seeds {result['seeds']}\n")
    print("| update cost (s, real) | arm | trained tok/s | trained ÷ limit | staleness, oldest: mean (max) "
          "| restarted | engines paused | trainer idle | trainer in updates | rolling cycles |")
    print("|---" * 10 + "|")
    for r in result["rows"]:
        print(f"| {r['update_cost_s']:g} | {r['arm']} | {r['trained_tokens_per_s']:.0f} "
              f"| {r['trained_utilization']:.2f} | {r['staleness_oldest_mean']:.2f} ({r['staleness_oldest_max']}) "
              f"| {r['restarted']} | {r['engines_paused']:.0%} | {r['trainer_idle']:.0%} "
              f"| {r['update_fraction']:.0%} | {r['rolling_cycles'] if r['rolling_cycles'] is not None else ''} |")
    for r in result["rows"]:
        if r["audit"]:
            print(f"audit {r['arm']} cost {r['update_cost_s']:g}s seed {r['seed']}: {r['audit']}")


def main(argv: list[str] | None = None) -> dict:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 measured steps after 1, 1 seed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--costs", default=",".join(f"{c:g}" for c in COSTS_S),
                   help="one engine's update cost, real seconds, comma-separated")
    p.add_argument("--steps", type=int, help=f"measured steps per row (default {d.steps}, --quick 4)")
    p.add_argument("--seeds", type=int, help="seeds per row (default 5, --quick 1)")
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    costs = [float(c) for c in args.costs.split(",") if c]
    if not costs or min(costs) < 0:
        p.error("--costs needs at least one cost, none negative")
    base = Settings(engines=args.engines, steps=args.steps or (4 if args.quick else d.steps),
                    warmup_steps=1 if args.quick else d.warmup_steps)
    result = run_all(base, costs, list(range(args.seeds or (1 if args.quick else 5))))
    if not args.json:
        print_table(result)
    return result


if __name__ == "__main__":
    run_bench(main)
