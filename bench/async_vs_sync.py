#!/usr/bin/env python
"""Training throughput: synchronous RL vs in-memory asynchronous rollouts vs this
pipeline, at equal engine capacity under long-tailed output lengths.

Every row trains the same number of groups from the same seeded prompts on fresh
simulators (each its own process) with the same slots, and updates the weights after
every step through pause → update_weights_from_disk → resume:

  sync               B groups per step, wait for all, train, update (in memory)
  in-memory async    one process: a fixed pool of slots, an asyncio.Queue of results,
                     aborted groups kept in memory (bench/in_memory.py), η = 2
  pipeline η         this project: a redis-server (AOF, fsync always), a `rollout worker`
                     process, the trainer taking exact batches with Consumer and
                     updating through Controller; η = 0, 1, 2, 4

Then a sweep over the tail (p99/median = 1, 3, 10, 30 at the same mean length): sync
against the pipeline at η = 2. The trainer step sleeps tokens ÷ trainer tokens/s
(bench/rl_loop.py). Per row: trained samples/s and tokens/s, the ratio to sync, the
trainer's idle fraction (waiting for its batch), engine slot utilization read from
the simulators (bench/sim_fleet.py), the staleness of trained groups, and where every
generated token went (trained, left over at the end, wasted).

    python bench/async_vs_sync.py             # about 7 minutes on 2 quiet cores
    python bench/async_vs_sync.py --quick     # under 2 minutes: 2 steps per row, η = 2 only
    python bench/async_vs_sync.py --json      # one JSON object on stdout
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.in_memory import InMemoryRollout  # noqa: E402
from bench.rl_loop import (PAUSE_MODES, Row, Settings, Tokens, TrainedBatch, group_tokens,  # noqa: E402
                           make_groups, make_row, run_trainer)
from bench.sim_fleet import SimFleet  # noqa: E402
from pipeline.ops.audit import audit  # noqa: E402
from pipeline.codec import decode_group  # noqa: E402
from pipeline.connection import connect  # noqa: E402
from pipeline.consumer import Consumer  # noqa: E402
from pipeline.control import configure  # noqa: E402
from pipeline.controller import Controller  # noqa: E402
from pipeline.queue import Queue  # noqa: E402
from pipeline.redis_server import RedisServer, free_port  # noqa: E402
from workers.engine import EngineSet  # noqa: E402
from local.processes import start_worker_process, stop_processes  # noqa: E402

NAMESPACE = "asyncbench"
BATCH_TIMEOUT_S = 120.0
ETA_KEY = 2  # the η the JSON's headline figures are about
TARGETS = {"speedup_eta2": 2.5, "vs_inmemory_eta2": 0.95, "utilization_eta2": 0.9}
log = logging.getLogger("bench.async_vs_sync")


class PipelineRollout:
    """This project as a BatchSource: redis-server, one `rollout worker` process with the
    engines' capacity, the trainer's Consumer and Controller."""

    def __init__(self, settings: Settings, engine_urls: list[str], eta: int, workdir: Path):
        self.settings = settings
        self.workdir = workdir
        self.server = RedisServer(workdir / "redis", port=free_port())  # AOF, fsync always: the default
        url = self.server.start()
        self.queue = Queue(connect(url), NAMESPACE)
        configure(self.queue.redis, self.queue.keys, max_staleness=eta, batch_size=settings.batch_groups)
        self.queue.push_groups(make_groups(settings, settings.groups_needed(eta)))
        self.metrics_port = free_port()
        self.worker = start_worker_process(
            url, NAMESPACE, engine_urls, workdir / "worker.log",
            ["--concurrency", str(settings.slots_per_engine), "--max-new-tokens", str(settings.max_new_tokens),
             "--metrics-port", str(self.metrics_port)])
        self.consumer = Consumer(self.queue.redis, NAMESPACE)
        self.engines = EngineSet(engine_urls)
        self.controller = Controller(self.queue, self.engines)
        self.trained = 0

    async def next_batch(self, n: int) -> TrainedBatch:
        batch = await asyncio.to_thread(self.consumer.next_batch, n, BATCH_TIMEOUT_S)
        # Committed before the simulated step rather than after: nothing measured changes
        # (delivered groups count against the staleness budget either way).
        await asyncio.to_thread(self.consumer.commit, batch)
        self.trained += sum(group_tokens(g) for g in batch.groups)
        lags = [lag for lag, count in batch.metrics.staleness.items() for _ in range(count)]
        return TrainedBatch(batch.groups, lags, batch.metrics.restarted)

    async def weight_update(self, version: int) -> None:
        await self.controller.update_weights_from_disk(f"/checkpoints/step-{version}", version,
                                                       mode=self.settings.pause_mode)

    async def finish(self) -> tuple[Tokens, str]:
        """Abort what is in flight (partial output goes to the requeue stream), read how
        many tokens the worker received, stop it, count what Redis still holds."""
        try:
            await self.controller.pause("abort")
            generated = self._worker_output_tokens()
        finally:
            stop_processes([self.worker])
            await self.engines.close()
        left = sum(group_tokens(decode_group(p)) for p in self.queue.redis.hvals(self.queue.keys.payloads))
        for stream in (self.queue.keys.requeue, self.queue.keys.results):
            left += sum(group_tokens(e.decode()) for e in self.queue.iter_stream(stream))
        report = audit(self.queue)
        self.server.stop()
        return Tokens(generated, self.trained, left, generated - self.trained - left), report.summary()

    def close(self) -> None:
        stop_processes([self.worker])
        self.server.stop()

    def _worker_output_tokens(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("rollout_output_tokens_sum "):
                    return int(float(line.split()[1]))
        raise RuntimeError("the worker's metrics have no rollout_output_tokens_sum")

    def worker_log_tail(self) -> str:
        return (self.workdir / "worker.log").read_text()[-3000:]


async def _run(name: str, system: str, eta: int, settings: Settings, fleet: SimFleet, workdir: Path) -> Row:
    if system == "pipeline":
        source = PipelineRollout(settings, fleet.urls, eta, workdir)
        try:
            trainer = await run_trainer(settings, source, fleet)
            tokens, summary = await source.finish()
        except BaseException:
            log.error("pipeline row %s failed; worker log:\n%s", name, source.worker_log_tail())
            source.close()
            raise
        return make_row(name, system, eta, settings, trainer, tokens, audit=summary)
    source = InMemoryRollout(settings, fleet.urls, eta, make_groups(settings, settings.groups_needed(eta)))
    try:
        trainer = await run_trainer(settings, source, fleet)
    finally:
        tokens = await source.finish()
    return make_row(name, system, eta, settings, trainer, tokens)


def run_row(name: str, system: str, eta: int, settings: Settings, workdir: Path) -> Row:
    started = time.monotonic()
    with SimFleet(settings.sim_config(), settings.engines) as fleet:
        row = asyncio.run(_run(name, system, eta, settings, fleet, workdir))
    log.info("%s (p99/median %.0f): %.1f samples/s, utilization %.2f, %.0fs", name, settings.tail_ratio,
             row.samples_per_s, row.utilization, time.monotonic() - started)
    return row


def run_all(settings: Settings, etas: list[int], tails: list[float]) -> dict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="asyncbench-") as tmp:
        workdirs = (Path(tmp) / f"row{i}" for i in itertools.count())

        def row(name: str, system: str, eta: int, s: Settings) -> Row:
            workdir = next(workdirs)
            workdir.mkdir()
            return run_row(name, system, eta, s, workdir)

        rows: list[Row] = []
        sync = row("sync", "sync", 0, settings)
        rows.append(sync)
        rows.append(row(f"in-memory async η={ETA_KEY}", "in-memory", ETA_KEY, settings))
        for eta in etas:
            rows.append(row(f"pipeline η={eta}", "pipeline", eta, settings))
        for r in rows:
            r.ratio_to_sync = r.samples_per_s / sync.samples_per_s
        for ratio in tails:
            if math.isclose(ratio, settings.tail_ratio):
                continue
            tail = settings.with_tail(ratio)
            tail_sync = row("sync", "sync", 0, tail)
            tail_pipe = row(f"pipeline η={ETA_KEY}", "pipeline", ETA_KEY, tail)
            tail_sync.ratio_to_sync = 1.0
            tail_pipe.ratio_to_sync = tail_pipe.samples_per_s / tail_sync.samples_per_s
            rows += [tail_sync, tail_pipe]
    pipe = next(r for r in rows if r.system == "pipeline" and r.eta == ETA_KEY
                and math.isclose(r.tail_ratio, round(settings.tail_ratio, 3)))
    memory = next(r for r in rows if r.system == "in-memory")
    return {
        "speedup_eta2": round(pipe.ratio_to_sync, 3),
        "vs_inmemory_eta2": round(pipe.samples_per_s / memory.samples_per_s, 3),
        "utilization_eta2": round(pipe.utilization, 3),
        "rows": [_row_dict(r) for r in rows],
        "settings": {
            **asdict(settings),
            "capacity_slots": settings.capacity,
            "mean_tokens": round(settings.mean_tokens, 1),
            "trainer_tokens_per_s": settings.trainer_tokens_per_s,
            "etas": etas,
            "tail_ratios": tails,
            "targets": TARGETS,
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
                       f"Python {platform.python_version()}",
            "command": " ".join(["python", "bench/async_vs_sync.py"] + sys.argv[1:]),
            "elapsed_s": round(time.monotonic() - started, 1),
        },
    }


def _row_dict(r: Row) -> dict:
    d = asdict(r)
    for key in ("samples_per_s", "tokens_per_s", "trainer_idle", "update_fraction", "utilization", "free_slots",
                "engines_paused", "engine_queue", "window_s", "mean_wait_s", "mean_train_s", "mean_update_s",
                "ratio_to_sync"):
        if d[key] is not None:
            d[key] = round(d[key], 4)
    return d


def print_table(result: dict) -> None:
    s = result["settings"]
    print(f"engines {s['engines']} x {s['slots_per_engine']} slots at {s['decode_tokens_per_s']:g} tok/s per "
          f"request; output median {s['median_tokens']:g}, p99 {s['p99_tokens']:g} (mean {s['mean_tokens']:g}), "
          f"max {s['max_new_tokens']}; B = {s['batch_groups']} groups x {s['n_samples']}; trainer "
          f"{s['trainer_tokens_per_s']:g} tok/s; {s['steps']} steps measured after {s['warmup_steps']}; "
          f"pause mode {s['pause_mode']}, weight load {s['weight_update_s']:g}s; {s['machine']}")
    print()
    print("| row | p99/median | samples/s | tokens/s | x sync | trainer idle | engine utilization (slots free, time paused) "
          "| staleness (lag: groups) | restarted | tokens wasted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        stale = ", ".join(f"{k}: {v}" for k, v in r["staleness"].items())
        wasted = r["tokens"]["wasted"]
        share = wasted / r["tokens"]["generated"] if r["tokens"]["generated"] else 0.0
        print(f"| {r['name']} | {r['tail_ratio']:g} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} "
              f"| {r['ratio_to_sync']:.2f} | {r['trainer_idle']:.0%} | {r['utilization']:.0%} (free "
              f"{r['free_slots']:.0%}, paused {r['engines_paused']:.0%}) | {stale} "
              f"| {r['restarted']} | {wasted} ({share:.1%}) |")
    print()
    for key, target in TARGETS.items():
        print(f"{key} = {result[key]} (target >= {target})")
    for r in result["rows"]:
        if r["audit"]:
            print(f"audit {r['name']} p99/median {r['tail_ratio']:g}: {r['audit']}")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps, pipeline at η = 2 only (under 2 minutes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--steps", type=int, help=f"measured steps per row (default {d.steps}, --quick 2)")
    p.add_argument("--warmup", type=int, help=f"unmeasured steps first (default {d.warmup_steps}, --quick 1)")
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--slots", type=int, default=d.slots_per_engine, help="running requests per engine")
    p.add_argument("--decode-rate", type=float, default=d.decode_tokens_per_s, help="tokens/s per request")
    p.add_argument("--median", type=float, default=d.median_tokens, help="median output tokens")
    p.add_argument("--p99", type=float, help="p99 output tokens (default 10 x median)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--n-samples", type=int, default=d.n_samples)
    p.add_argument("--batch", type=int, default=d.batch_groups, help="groups per step (B)")
    p.add_argument("--trainer-speed", type=float, default=d.trainer_speed,
                   help="trainer tokens/s as a fraction of the engines' tokens/s at full load")
    p.add_argument("--weight-update-s", type=float, default=d.weight_update_s)
    p.add_argument("--pause-mode", choices=PAUSE_MODES, default=d.pause_mode)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--etas", help="pipeline staleness bounds, must include 2 (default 0,1,2,4; --quick 2)")
    p.add_argument("--tails", default="1,3,10,30", help="p99/median ratios of the sweep (η = 2)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.etas = sorted({int(x) for x in (args.etas or ("2" if args.quick else "0,1,2,4")).split(",")})
    args.tails = [float(x) for x in args.tails.split(",")]
    if ETA_KEY not in args.etas:
        p.error(f"--etas must include {ETA_KEY}")
    steps = args.steps or (2 if args.quick else d.steps)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else d.warmup_steps)
    try:
        settings = Settings(engines=args.engines, slots_per_engine=args.slots, decode_tokens_per_s=args.decode_rate,
                            median_tokens=args.median, p99_tokens=args.p99 or 10 * args.median,
                            max_new_tokens=args.max_new_tokens, n_samples=args.n_samples, batch_groups=args.batch,
                            steps=steps, warmup_steps=warmup, trainer_speed=args.trainer_speed,
                            weight_update_s=args.weight_update_s, pause_mode=args.pause_mode, seed=args.seed)
    except ValueError as exc:
        p.error(str(exc))
    return args, settings


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run_all(settings, args.etas, args.tails)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
