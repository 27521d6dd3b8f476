#!/usr/bin/env python
"""Training throughput: synchronous RL vs in-memory asynchronous rollouts vs this
pipeline, at equal engine capacity under long-tailed output lengths.

Every row trains the same number of groups from the same seeded prompts on fresh
simulators (each its own process) with the same slots, timed by an engine profile
(engines/profiles.py: a step slows as the batch and its cache grow), and updates the
weights after every step through pause → update_weights_from_disk → resume:

  sync               B groups per step, wait for all, train, update (in memory)
  in-memory async    one process: a fixed pool of slots, an asyncio.Queue of results,
                     aborted groups kept in memory (bench/in_memory.py), η = 2
  pipeline η         this project: a redis-server (AOF, fsync always), a `rollout worker`
                     process, the trainer taking exact batches with Consumer and
                     updating through Controller; η = 0, 1, 2, 4

then sweeps at η = 2 against sync: the tail (p99/median = 1, 3, 10, 30 at the same mean
length), the engine profile (r = t(full batch) / t(1): flat, calibrated, heavy), the
pause mode (abort, in_place) and the weight-update cost under each pause mode (0.02 s to
20 s real, scaled like the engines; `breakeven_update_s`: the cost at which the speed-up
in trained tokens/s falls to 1). Every row runs once per seed (at least 5 by default)
and reports the median and range; the rows of one seed see the same prompts and the
same per-sample lengths (the simulator draws a whole response from the sample's seed,
Group.sampling_seed, which every system sends; a stale restart draws a new one).

The headline is trained tokens per second (samples/s beside it: asynchrony trains
shorter samples). Staleness of trained groups on two clocks: the version its oldest
request ended under (the one the bound is enforced on) and its last. Utilization:
generated and trained tokens ÷ the engine-bound limit (every slot decoding at a full
batch); the gap between the two is the waterfall of bench/waterfall.py: every generated
token trained, thrown away as stale, aborted and not continued, left over at the end, or
lost with a crashed worker, each counted where it happens, and their sum checked against
what was generated on every run. Every run also checks every trained group against the
bound (none older than η on the oldest-token clock). The simulator's engine model is
checked against a published t(b) table at the end (bench/engine_table.py, seconds).

    python bench/async_vs_sync.py --quick --json    # a few minutes: η = 2, 3 seeds, no sweeps
    python bench/async_vs_sync.py                   # everything, 5 seeds (long: see docs/performance.md)
    python bench/async_vs_sync.py --engine-urls http://gpu:30000,http://gpu:30001   # real engines: bench/gpu.md
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.in_memory import InMemoryRollout  # noqa: E402
from bench import engine_table  # noqa: E402
from bench.report import run_bench  # noqa: E402
from bench.rl_loop import (PAUSE_MODES, WEIGHT_UPDATES, Row, Settings, TrainedBatch,  # noqa: E402
                           make_groups, make_row, run_trainer, update_cost_s)
from bench.waterfall import Waterfall, add_waterfalls, group_tokens  # noqa: E402
from bench.engine_oracle import LengthOracle  # noqa: E402
from bench.sim_fleet import SimFleet  # noqa: E402
from engines.profiles import PROFILES  # noqa: E402
from pipeline.ops.audit import audit  # noqa: E402
from pipeline.codec import decode_group  # noqa: E402
from pipeline.connection import connect  # noqa: E402
from pipeline.consumer import Consumer  # noqa: E402
from pipeline.control import configure  # noqa: E402
from pipeline.controller import Controller  # noqa: E402
from pipeline.queue import Queue  # noqa: E402
from pipeline.redis_server import RedisServer, free_port  # noqa: E402
from workers.engine_set import EngineSet
from local.processes import start_worker_process, stop_processes  # noqa: E402

NAMESPACE = "asyncbench"
BATCH_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 60.0  # at the end, for the worker to finish what the pause could not reach
ETA_KEY = 2  # the η the JSON's headline figures are about
TARGETS = {"speedup_tokens_eta2": 2.5, "vs_inmemory_eta2": 0.95, "trained_utilization_eta2": 0.8}
#: Update costs swept by default, real seconds: from a checkpoint-engine broadcast of a 7B
#: model (0.02 s) to the 20 s median of a run whose asynchrony ended slower than sync.
UPDATE_SWEEP = "0.02,0.2,2,20"
#: Per-row figures summarized over seeds (median and range).
FIGURES = ("trained_tokens_per_s", "samples_per_s", "tokens_x_sync", "samples_x_sync", "trained_utilization",
           "generated_utilization", "trainer_idle", "slot_utilization", "engines_paused", "restarted")
log = logging.getLogger("bench.async_vs_sync")


class CountingConsumer(Consumer):
    """The trainer's Consumer, counting the tokens of every group it throws away as stale
    (restarted or dead-lettered) before the group is reset."""

    def __init__(self, *args, waterfall: Waterfall, **kwargs):
        super().__init__(*args, **kwargs)
        self.waterfall = waterfall

    def _stale(self, entry, group, lag, control, metrics):
        self.waterfall.discard_stale(group, lag)
        return super()._stale(entry, group, lag, control, metrics)


class PipelineRollout:
    """This project as a BatchSource: redis-server, one `rollout worker` process with the
    engines' capacity, the trainer's Consumer and Controller."""

    def __init__(self, settings: Settings, engine_urls: list[str], eta: int, workdir: Path,
                 worker_args: list[str] = ()):
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
             "--metrics-port", str(self.metrics_port), *worker_args])
        self.waterfall = Waterfall()
        self.consumer = CountingConsumer(self.queue.redis, NAMESPACE, waterfall=self.waterfall)
        self.engines = EngineSet(engine_urls)
        # Aborted groups are continued (the default release policy): a path that dropped
        # their partial output would show as unaccounted tokens in the waterfall's check.
        self.controller = Controller(self.queue, self.engines, writer=self.consumer.writer)

    async def next_batch(self, n: int) -> TrainedBatch:
        batch = await asyncio.to_thread(self.consumer.next_batch, n, BATCH_TIMEOUT_S)
        # Committed before the simulated step rather than after: nothing measured changes
        # (delivered groups count against the staleness budget either way).
        await asyncio.to_thread(self.consumer.commit, batch)
        self.waterfall.trained += sum(group_tokens(g) for g in batch.groups)
        return TrainedBatch(batch.groups, batch.metrics.restarted)

    async def weight_update(self, version: int) -> None:
        await self.controller.update_weights_from_disk(f"/checkpoints/step-{version}", version,
                                                       mode=self.settings.pause_mode)

    async def finish(self) -> tuple[Waterfall, str]:
        """Abort what is in flight (partial output goes to the requeue stream), drain what
        the pause could not reach, read how many tokens the worker received, stop it, and
        count what Redis still holds (queued and in-flight payloads, the requeue and
        results streams)."""
        try:
            await self.controller.pause("abort")
            drained = await self._drain()
            metrics = self._worker_metrics()
        finally:
            stop_processes([self.worker])
            await self.engines.close()
        w = self.waterfall
        w.generated = int(metrics["rollout_output_tokens_sum"])
        w.left = sum(group_tokens(decode_group(p)) for p in self.queue.redis.hvals(self.queue.keys.payloads))
        for stream in (self.queue.keys.requeue, self.queue.keys.results):
            w.left += sum(group_tokens(e.decode()) for e in self.queue.iter_stream(stream))
        if (not drained or self.queue.stats().get("reaped", 0)
                or metrics.get('rollout_groups_total{place="lost"}', 0)):
            w.infer_crashed()
        report = audit(self.queue)
        self.server.stop()
        return w, report.summary()

    async def _drain(self) -> bool:
        """Requests that reached an engine after the pause wait there, and their groups'
        earlier output lives only in the worker's memory: a worker that stops loses it (it
        hands its groups back as claimed). So the engines continue, admission stays closed,
        and the worker finishes or requeues what it holds. False if it still held groups
        after DRAIN_TIMEOUT_S."""
        await self.engines.continue_generation()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while sum(audit(self.queue).inflight.values()):
            if time.monotonic() > deadline:
                log.warning("the worker still holds groups %.0fs after the end: their output in its memory "
                            "is counted as lost with it", DRAIN_TIMEOUT_S)
                return False
            await asyncio.sleep(0.1)
        return True

    def close(self) -> None:
        stop_processes([self.worker])
        self.server.stop()

    def _worker_metrics(self) -> dict[str, float]:
        """The worker's Prometheus samples, by name with labels."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            samples = dict(line.rsplit(" ", 1) for line in resp.read().decode().splitlines()
                           if line and not line.startswith("#"))
        if "rollout_output_tokens_sum" not in samples:
            raise RuntimeError("the worker's metrics have no rollout_output_tokens_sum")
        return {name: float(value) for name, value in samples.items()}

    def worker_log_tail(self) -> str:
        return (self.workdir / "worker.log").read_text()[-3000:]


async def _run(name: str, system: str, eta: int, settings: Settings, fleet: SimFleet | LengthOracle,
               workdir: Path) -> Row:
    if system == "pipeline":
        source = PipelineRollout(settings, fleet.urls, eta, workdir)
        try:
            trainer = await run_trainer(settings, source, fleet, eta)
            tokens, summary = await source.finish()
        except BaseException:
            log.error("pipeline row %s failed; worker log:\n%s", name, source.worker_log_tail())
            source.close()
            raise
        return make_row(name, system, eta, settings, trainer, tokens, audit=summary)
    source = InMemoryRollout(settings, fleet.urls, eta, make_groups(settings, settings.groups_needed(eta)))
    try:
        trainer = await run_trainer(settings, source, fleet, eta)
    finally:
        tokens = await source.finish()
    return make_row(name, system, eta, settings, trainer, tokens)


def run_row(name: str, system: str, eta: int, settings: Settings, workdir: Path,
            engine_urls: list[str] | None = None) -> Row:
    """On fresh simulators, or on `engine_urls` through a length oracle (a real engine's
    update costs its preset in real seconds: it runs in real time)."""
    started = time.monotonic()
    fleet = (LengthOracle(engine_urls, settings.slots_per_engine, settings.median_tokens, settings.p99_tokens,
                          WEIGHT_UPDATES[settings.weight_update])
             if engine_urls else SimFleet(settings.sim_config(), settings.engines))
    with fleet:
        row = asyncio.run(_run(name, system, eta, settings, fleet, workdir))
    log.info("%s seed %d (%s, p99/median %.0f, %s, %s): %.0f trained tok/s, %.1f samples/s, %.0fs", name,
             settings.seed, settings.engine_profile, settings.tail_ratio, settings.pause_mode,
             settings.weight_update, row.trained_tokens_per_s, row.samples_per_s, time.monotonic() - started)
    return row


@dataclass(frozen=True)
class Arm:
    """A row of the tables: one system at one setting, run once per seed."""

    name: str
    system: str
    eta: int
    settings: Settings  # its seed is replaced by each run's
    sweep: str  # main, tail, profile, pause, update


def baseline_key(settings: Settings) -> Settings:
    """The sync row a row is compared with: same settings (sync has nothing in flight
    at an update, so its pause mode does not matter)."""
    return replace(settings, seed=0, pause_mode=Settings.pause_mode)


def build_arms(base: Settings, etas: list[int], tails: list[float], profiles: list[str], pauses: list[str],
               updates: list[str]) -> list[Arm]:
    arms = [Arm("sync", "sync", 0, base, "main"), Arm(f"in-memory async η={ETA_KEY}", "in-memory", ETA_KEY, base, "main")]
    arms += [Arm(f"pipeline η={eta}", "pipeline", eta, base, "main") for eta in etas]
    # The update cost is swept under every pause mode shown: break-even per mode.
    modes = [base.pause_mode] + [m for m in pauses if m != base.pause_mode]
    variants = ([("tail", base.with_tail(t)) for t in tails if not math.isclose(t, base.tail_ratio)]
                + [("profile", replace(base, engine_profile=p)) for p in profiles]
                + [("pause", replace(base, pause_mode=m)) for m in pauses]
                + [("update", replace(base, weight_update=u, pause_mode=m)) for u in updates for m in modes])

    def identity(arm: Arm) -> tuple:
        return arm.system, arm.eta, baseline_key(arm.settings) if arm.system == "sync" else arm.settings

    seen = {identity(a) for a in arms}
    for sweep, settings in variants:
        for arm in (Arm("sync", "sync", 0, settings, sweep),
                    Arm(f"pipeline η={ETA_KEY}", "pipeline", ETA_KEY, settings, sweep)):
            if identity(arm) not in seen:
                seen.add(identity(arm))
                arms.append(arm)
    return arms


def _figure(row: Row, name: str, sync: Row) -> float:
    if name == "tokens_x_sync":
        return row.trained_tokens_per_s / sync.trained_tokens_per_s
    if name == "samples_x_sync":
        return row.samples_per_s / sync.samples_per_s
    return float(getattr(row, name))


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "range": [round(min(values), 4), round(max(values), 4)]}


def run_all(base: Settings, seeds: list[int], arms: list[Arm], engine_urls: list[str] | None = None) -> dict:
    started = time.monotonic()
    runs: dict[tuple[int, int], Row] = {}  # (arm index, seed) -> row
    with tempfile.TemporaryDirectory(prefix="asyncbench-") as tmp:
        workdirs = (Path(tmp) / f"row{i}" for i in itertools.count())
        for seed in seeds:  # seed-major: a machine that gets busier hits every row alike
            for i, arm in enumerate(arms):
                workdir = next(workdirs)
                workdir.mkdir()
                runs[i, seed] = run_row(arm.name, arm.system, arm.eta, replace(arm.settings, seed=seed), workdir,
                                        engine_urls)
    sync_of = {baseline_key(a.settings): i for i, a in enumerate(arms) if a.system == "sync"}
    rows = []
    for i, arm in enumerate(arms):
        baseline = sync_of[baseline_key(arm.settings)]
        per_seed = []
        for seed in seeds:
            row, sync = runs[i, seed], runs[baseline, seed]
            per_seed.append({**_row_dict(row), **{f: round(_figure(row, f, sync), 4) for f in FIGURES}})
        s = arm.settings
        rows.append({
            "name": arm.name, "system": arm.system, "eta": arm.eta, "sweep": arm.sweep,
            "engine_profile": s.engine_profile, "slowdown": round(s.slowdown, 3), "tail_ratio": round(s.tail_ratio, 3),
            "pause_mode": s.pause_mode, "weight_update": s.weight_update,
            **{f: _summary([p[f] for p in per_seed]) for f in FIGURES},
            "per_seed": per_seed,
        })
    for row in rows:
        row["waterfall"] = add_waterfalls([p["waterfall"] for p in row["per_seed"]])
    main = {r["system"] + str(r["eta"]): r for r in rows if r["sweep"] == "main"}
    pipe, memory = main[f"pipeline{ETA_KEY}"], main[f"in-memory{ETA_KEY}"]
    vs_memory = [p["trained_tokens_per_s"] / m["trained_tokens_per_s"]
                 for p, m in zip(pipe["per_seed"], memory["per_seed"])]
    headline = {
        "speedup_tokens_eta2": pipe["tokens_x_sync"],
        "speedup_samples_eta2": pipe["samples_x_sync"],
        "vs_inmemory_eta2": _summary(vs_memory),
        "trained_utilization_eta2": pipe["trained_utilization"],
    }
    sweep = update_sweep(base, arms, rows)
    return {
        **{key: value["median"] for key, value in headline.items()},
        "ranges": {key: value["range"] for key, value in headline.items()},
        # Where every generated token went, summed over the seeds (bench/waterfall.py).
        "waterfall_eta2": pipe["waterfall"],
        "waterfall_inmemory_eta2": memory["waterfall"],
        "breakeven_update_s": {mode: curve["breakeven_s"] for mode, curve in sweep.items()},
        "update_sweep": sweep,
        "seeds": seeds,
        "profile": base.engine_profile,
        "rows": rows,
        "settings": {
            **asdict(base),
            "capacity_slots": base.capacity,
            "mean_tokens": round(base.mean_tokens, 1),
            "slowdown": round(base.slowdown, 3),
            "engine_limit_tokens_per_s": round(base.engine_limit_tokens_per_s, 1),
            "trainer_tokens_per_s": round(base.trainer_tokens_per_s, 1),
            "weight_update_s": round(base.weight_update_s, 4),
            "time_scale": round(base.time_scale, 3),
            "targets": TARGETS,
            "engine_urls": engine_urls,  # None: the bench's own simulators
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
                       f"Python {platform.python_version()}",
            "command": " ".join(["python", "bench/async_vs_sync.py"] + sys.argv[1:]),
            "elapsed_s": round(time.monotonic() - started, 1),
        },
    }


def update_sweep(base: Settings, arms: list[Arm], rows: list[dict]) -> dict:
    """Per pause mode: the pipeline's speed-up over sync (trained tokens/s, median over
    seeds) at each update cost run, and the break-even cost where it falls to 1:
    interpolated in log(cost) between the two costs run around it, or, when every cost
    run is above 1, extrapolated from the largest (`breakeven_from` says which; None
    with fewer than two costs, or when asynchrony trains as many tokens per step as sync).

    The extrapolation: both systems pay the update once per step, so a step takes
    T = T0 + U, T0 (generation, training, the pause protocol's own cost) measured at that
    cost, and each system trains its tokens per step whatever U. With ρ = the pipeline's
    tokens per step ÷ sync's, the speed-up ρ (Ts0 + U) / (Ta0 + U) falls to 1 at
    U = (ρ Ts0 − Ta0) / (1 − ρ). (It reproduces the speed-ups measured at the other costs
    within a few percent: docs/performance.md.)"""
    sync_row = {baseline_key(a.settings): row for a, row in zip(arms, rows) if a.system == "sync"}
    curves: dict[str, list[tuple[float, float, float, dict, dict]]] = {}
    for arm, row in zip(arms, rows):
        s = arm.settings
        if (arm.system == "pipeline" and arm.eta == ETA_KEY
                and replace(s, weight_update=base.weight_update, pause_mode=base.pause_mode) == base):
            curves.setdefault(s.pause_mode, []).append(
                (s.update_cost_s, row["tokens_x_sync"]["median"], row["samples_x_sync"]["median"], row,
                 sync_row[baseline_key(s)]))
    out = {}
    for mode, points in curves.items():
        points.sort(key=lambda p: p[0])
        breakeven, source = None, None
        if len(points) >= 2:
            for (c1, x1, *_), (c2, x2, *_) in zip(points, points[1:]):
                if x1 >= 1 > x2:
                    lo, hi = math.log(max(c1, 1e-3)), math.log(c2)
                    breakeven = round(math.exp(lo + (x1 - 1) / (x1 - x2) * (hi - lo)), 3)
                    source = f"measured: between {c1:g} s and {c2:g} s"
                    break
            else:
                if points[0][1] < 1:
                    source = f"speed-up below 1 from {points[0][0]:g} s, the smallest cost run"
                else:
                    cost, _, _, pipe, sync = points[-1]
                    breakeven = _extrapolated_breakeven(pipe, sync, cost, base)
                    source = f"extrapolated from the {cost:g} s rows (speed-up above 1 at every cost run)"
        out[mode] = {"breakeven_s": breakeven, "breakeven_from": source,
                     "points": [{"update_s": c, "tokens_x_sync": x, "samples_x_sync": y} for c, x, y, *_ in points]}
    return out


def _extrapolated_breakeven(pipe: dict, sync: dict, cost_s: float, base: Settings) -> float | None:
    """update_sweep's extrapolation, in real seconds, from one cost's rows."""
    update = cost_s / base.time_scale  # benchmark seconds

    def per_step(row: dict) -> tuple[float, float]:
        """(T0: a step's seconds but the update's cost, trained tokens per step), seed medians."""
        steps = [p["window_s"] / base.steps for p in row["per_seed"]]
        return (statistics.median(t - update for t in steps),
                statistics.median(p["trained_tokens_per_s"] * t for p, t in zip(row["per_seed"], steps)))

    (pipe_t0, pipe_tokens), (sync_t0, sync_tokens) = per_step(pipe), per_step(sync)
    rho = pipe_tokens / sync_tokens
    if rho >= 1:
        return None
    return round(max(0.0, (rho * sync_t0 - pipe_t0) / (1 - rho)) * base.time_scale, 1)


def _row_dict(r: Row) -> dict:
    d = asdict(r)
    for key, value in d.items():
        if isinstance(value, float):
            d[key] = round(value, 4)
    return d


def _cell(summary: dict, fmt: str) -> str:
    lo, hi = summary["range"]
    return f"{summary['median']:{fmt}} ({lo:{fmt}}–{hi:{fmt}})"


def _staleness(row: dict, clock: str) -> str:
    total: dict[str, int] = {}
    for p in row["per_seed"]:
        for lag, count in p[f"staleness_{clock}"].items():
            total[str(lag)] = total.get(str(lag), 0) + count
    return ", ".join(f"{k}: {v}" for k, v in sorted(total.items(), key=lambda kv: int(kv[0])))


def print_table(result: dict) -> None:
    s = result["settings"]
    print(f"engines {s['engines']} x {s['slots_per_engine']} slots, profile {s['engine_profile']} (r = "
          f"{s['slowdown']:g} at a full batch), {s['decode_tokens_per_s']:g} tok/s for one request alone "
          f"(x{s['time_scale']:g} real time); output median {s['median_tokens']:g}, p99 {s['p99_tokens']:g} "
          f"(mean {s['mean_tokens']:g}), max {s['max_new_tokens']}; B = {s['batch_groups']} groups x "
          f"{s['n_samples']}; trainer {s['trainer_tokens_per_s']:g} tok/s; {s['steps']} steps measured after "
          f"{s['warmup_steps']}; pause {s['pause_mode']}, weight update {s['weight_update']} "
          f"({s['weight_update_s']:g}s); seeds {result['seeds']}; {s['machine']}")
    print("\nMedian (range) over seeds.\n")
    print("| row | sweep | profile (r) | p99/median | pause | update | trained tok/s | x sync (tokens) "
          "| samples/s | x sync (samples) | trained ÷ limit | generated ÷ limit | trainer idle "
          "| staleness, oldest (lag: groups) | staleness, completion | restarted |")
    print("|---" * 16 + "|")
    for r in result["rows"]:
        print(f"| {r['name']} | {r['sweep']} | {r['engine_profile']} ({r['slowdown']:g}) | {r['tail_ratio']:g} "
              f"| {r['pause_mode']} | {r['weight_update']} | {_cell(r['trained_tokens_per_s'], '.0f')} "
              f"| {_cell(r['tokens_x_sync'], '.2f')} | {_cell(r['samples_per_s'], '.1f')} "
              f"| {_cell(r['samples_x_sync'], '.2f')} | {_cell(r['trained_utilization'], '.2f')} "
              f"| {_cell(r['generated_utilization'], '.2f')} | {_cell(r['trainer_idle'], '.0%')} "
              f"| {_staleness(r, 'oldest')} | {_staleness(r, 'completion')} | {_cell(r['restarted'], '.0f')} |")
    print("\nWhere every generated token went (summed over seeds; shares of generated):\n")
    print("| row | sweep | pause | update | generated | trained | stale | aborted, not continued | left at the end "
          "| crashed | stale by lag (versions: tokens) | stale by response length | stale after a pause |")
    print("|---" * 13 + "|")
    for r in result["rows"]:
        w = r["waterfall"]
        share = lambda fate: f"{w[fate]:,} ({w['shares'][fate]:.0%})"  # noqa: E731
        print(f"| {r['name']} | {r['sweep']} | {r['pause_mode']} | {r['weight_update']} | {w['generated']:,} "
              f"| {share('trained')} | {share('stale')} | {share('aborted')} | {share('left')} | {share('crashed')} "
              f"| {', '.join(f'{k}: {v:,}' for k, v in w['stale_by_lag'].items())} "
              f"| {', '.join(f'{k}: {v:,}' for k, v in w['stale_by_length'].items())} | {w['stale_interrupted']:,} |")
    print()
    for mode, curve in result["update_sweep"].items():
        points = ", ".join(f"{p['update_s']:g} s: {p['tokens_x_sync']:.2f}x" for p in curve["points"])
        where = f"{curve['breakeven_s']:g} s" if curve["breakeven_s"] is not None else "n/a"
        print(f"update cost ({mode}): {points}; break-even {where} ({curve['breakeven_from'] or 'one cost run'})")
    if "t_of_b_error_max" in result:
        print(f"t_of_b_error_max = {result['t_of_b_error_max']:.1%} (bench/engine_table.py)")
    for key, target in TARGETS.items():
        lo, hi = result["ranges"][key]
        print(f"{key} = {result[key]} (range {lo}–{hi}; target >= {target})")
    for r in result["rows"]:
        for p in r["per_seed"]:
            if p["audit"]:
                print(f"audit {r['name']} ({r['sweep']}) seed {p['seed']}: {p['audit']}")


def _names(text: str, known, what: str, p: argparse.ArgumentParser) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in known]
    if unknown:
        p.error(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 steps per row, η = 2 only, 3 seeds, no sweeps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--steps", type=int, help=f"measured steps per row (default {d.steps}, --quick 2)")
    p.add_argument("--warmup", type=int, help=f"unmeasured steps first (default {d.warmup_steps}, --quick 1)")
    p.add_argument("--seeds", type=int, help="seeds per row (default 5, --quick 3)")
    p.add_argument("--first-seed", type=int, default=d.seed)
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--slots", type=int, default=d.slots_per_engine, help="running requests per engine")
    p.add_argument("--decode-rate", type=float, default=d.decode_tokens_per_s,
                   help="tokens/s of one request decoding alone")
    p.add_argument("--engine-profile", choices=list(PROFILES), default=d.engine_profile)
    p.add_argument("--median", type=float, default=d.median_tokens, help="median output tokens")
    p.add_argument("--p99", type=float, help="p99 output tokens (default 10 x median)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--n-samples", type=int, default=d.n_samples)
    p.add_argument("--batch", type=int, default=d.batch_groups, help="groups per step (B)")
    p.add_argument("--trainer-speed", type=float, default=d.trainer_speed,
                   help="trainer tokens/s as a multiple of the engine-bound limit")
    p.add_argument("--weight-update", default=d.weight_update,
                   help="the update after every step: a preset (" + ", ".join(
                       f"{k}: {v:g}s" for k, v in WEIGHT_UPDATES.items()) + ") or its cost in real seconds, e.g. 0.5")
    p.add_argument("--pause-mode", choices=PAUSE_MODES, default=d.pause_mode)
    p.add_argument("--etas", help="pipeline staleness bounds, must include 2 (default 0,1,2,4; --quick 2)")
    p.add_argument("--tails", help="p99/median ratios of the tail sweep (default 1,3,10,30; --quick none)")
    p.add_argument("--profiles", help=f"engine profiles of the r sweep (default {','.join(PROFILES)}; --quick none)")
    p.add_argument("--pauses", help="pause modes shown (default abort,in_place; --quick none)")
    p.add_argument("--updates", help=f"weight-update costs swept, presets or real seconds, under every pause mode "
                                     f"of --pauses (default {UPDATE_SWEEP}; --quick none); e.g. --updates 0.02,2,20")
    p.add_argument("--engine-urls", help="URL[,URL...]: run against these SGLang-compatible engines (one per "
                                         "engine, --engines ignored) instead of starting simulators; lengths "
                                         "through a length oracle, see bench/engine_oracle.py and bench/gpu.md; "
                                         "no profile sweep (the engines are what they are)")
    p.add_argument("--no-engine-table", action="store_true",
                   help="skip the check of the simulator against the published t(b) table (bench/engine_table.py)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)

    def listed(value: str | None, full: str) -> str:
        return value if value is not None else ("" if args.quick else full)

    args.etas = sorted({int(x) for x in (args.etas or ("2" if args.quick else "0,1,2,4")).split(",")})
    args.tails = [float(x) for x in listed(args.tails, "1,3,10,30").split(",") if x]
    args.engine_urls = [u for u in (args.engine_urls or "").split(",") if u] or None
    if args.engine_urls:
        args.engines = len(args.engine_urls)
        if args.profiles:
            p.error("--profiles sweeps the simulator's engine model: not with --engine-urls")
        args.profiles = ""
    args.profiles = _names(listed(args.profiles, ",".join(PROFILES)), PROFILES, "profile", p)
    args.pauses = _names(listed(args.pauses, "abort,in_place"), PAUSE_MODES, "pause mode", p)
    args.updates = [x for x in listed(args.updates, UPDATE_SWEEP).split(",") if x]
    for value in [args.weight_update, *args.updates]:
        try:
            update_cost_s(value)
        except ValueError as exc:
            p.error(str(exc))
    if ETA_KEY not in args.etas:
        p.error(f"--etas must include {ETA_KEY}")
    seeds = args.seeds or (3 if args.quick else 5)
    args.seed_list = list(range(args.first_seed, args.first_seed + seeds))
    steps = args.steps or (2 if args.quick else d.steps)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else d.warmup_steps)
    try:
        settings = Settings(engines=args.engines, slots_per_engine=args.slots, decode_tokens_per_s=args.decode_rate,
                            engine_profile=args.engine_profile, median_tokens=args.median,
                            p99_tokens=args.p99 or 10 * args.median, max_new_tokens=args.max_new_tokens,
                            n_samples=args.n_samples, batch_groups=args.batch, steps=steps, warmup_steps=warmup,
                            trainer_speed=args.trainer_speed, weight_update=args.weight_update,
                            pause_mode=args.pause_mode, seed=args.first_seed)
    except ValueError as exc:
        p.error(str(exc))
    return args, settings


def main(argv: list[str] | None = None) -> dict:
    args, settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    arms = build_arms(settings, args.etas, args.tails, args.profiles, args.pauses, args.updates)
    result = run_all(settings, args.seed_list, arms, args.engine_urls)
    if not args.engine_urls and not args.no_engine_table:  # the simulator's engine model, checked
        table = engine_table.measure(sorted(engine_table.PUBLISHED), engine_table.DEFAULT_SPEEDUP)
        result["t_of_b_error_max"] = table["t_of_b_error_max"]
        result["engine_table"] = table
    if not args.json:
        print_table(result)
    return result


if __name__ == "__main__":
    run_bench(main)
