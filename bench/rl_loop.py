"""What every row of bench/async_vs_sync.py shares: the settings, the prompts, the
simulated trainer and the loop that measures it.

One trainer loop drives every system (sync, in-memory async, this pipeline) through
a `BatchSource`: take exactly B groups, train (a sleep whose length grows with the
tokens in the batch), update the weights through the source's pause protocol, and
record per step how long it waited, trained and updated.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Protocol

from engines.profiles import CALIBRATED, CALIBRATED_T1_S, PROFILES, engine_profile
from engines.simulator import SimConfig
from pipeline.types import Group, parse_version

from .sim_fleet import SimFleet, Window
from .waterfall import Waterfall, group_tokens

Z99 = 2.3263478740408408  # standard normal quantile at 0.99, as the simulator uses
PAUSE_MODES = ("in_place", "retract", "abort")
#: What a weight update costs on real hardware, in seconds (scaled like the engines' steps):
#: an NCCL broadcast of a 7B model from the trainer, or a reload of it from disk.
WEIGHT_UPDATES = {"nccl": 0.05, "disk": 5.0}
PROMPT_TOKENS = 16  # about the length of the arithmetic prompts, for the KV estimate


def update_cost_s(weight_update: str) -> float:
    """Real seconds of a weight update given as a WEIGHT_UPDATES preset or a number."""
    if weight_update in WEIGHT_UPDATES:
        return WEIGHT_UPDATES[weight_update]
    try:
        cost = float(weight_update)
    except ValueError:
        cost = math.nan
    if not math.isfinite(cost) or cost < 0:
        raise ValueError(f"weight update must be one of {', '.join(WEIGHT_UPDATES)} or a cost in seconds >= 0, "
                         f"got {weight_update!r}")
    return cost


@dataclass(frozen=True)
class Settings:
    engines: int = 4
    slots_per_engine: int = 32  # the simulators' max_running_requests; clients use as many
    # One request decoding alone (1 / the step at batch 1); how a step slows with the
    # batch and the cache is the profile's (engines/profiles.py). 400 tok/s runs the
    # calibrated H100 engine CALIBRATED_T1_S · 400 ≈ 2.5 times faster than real time.
    decode_tokens_per_s: float = 400.0
    engine_profile: str = CALIBRATED
    median_tokens: float = 128.0
    p99_tokens: float = 1280.0  # default 10 x median
    max_new_tokens: int = 2048
    n_samples: int = 8
    batch_groups: int = 32  # B
    steps: int = 10  # measured steps
    warmup_steps: int = 2  # not measured (process start-up, filling the pipeline)
    # The trainer's tokens/s as a multiple of what the engines generate at full load.
    # Above 1, generation is the bottleneck (as in most RL post-training), so engine
    # utilization measures how well a design keeps the engines fed; at 1 or below the
    # trainer's speed caps it whatever the design.
    trainer_speed: float = 2.0
    weight_update: str = "nccl"  # a WEIGHT_UPDATES preset, or a cost in real seconds ("0.2")
    # abort: the project's default protocol; requests are aborted and continued after the
    # update (the simulator continues a seeded sample exactly where it stopped).
    pause_mode: str = "abort"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.engine_profile not in PROFILES:
            raise ValueError(f"engine profile must be one of {', '.join(PROFILES)}, got {self.engine_profile!r}")
        update_cost_s(self.weight_update)  # ValueError naming the presets
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {self.pause_mode!r}")
        if not 0 < self.median_tokens <= self.p99_tokens:
            raise ValueError(f"need 0 < median ({self.median_tokens}) <= p99 ({self.p99_tokens})")
        if min(self.engines, self.slots_per_engine, self.n_samples, self.batch_groups, self.steps) < 1:
            raise ValueError("engines, slots, samples, batch size and steps must be at least 1")

    @property
    def capacity(self) -> int:
        """Sample slots across all engines (equal in every row)."""
        return self.engines * self.slots_per_engine

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def tail_ratio(self) -> float:
        return self.p99_tokens / self.median_tokens

    @property
    def mean_tokens(self) -> float:
        """Mean of the log-normal output length (before the max_new_tokens cap)."""
        sigma = math.log(self.tail_ratio) / Z99
        return self.median_tokens * math.exp(sigma * sigma / 2)

    @property
    def time_scale(self) -> float:
        """Real seconds per benchmark second: the calibrated engine's t1 against ours."""
        return CALIBRATED_T1_S * self.decode_tokens_per_s

    @property
    def update_cost_s(self) -> float:
        """The weight update's cost in real seconds."""
        return update_cost_s(self.weight_update)

    @property
    def weight_update_s(self) -> float:
        """The same in benchmark seconds (scaled like the engines' steps)."""
        return self.update_cost_s / self.time_scale

    @property
    def engine_limit_tokens_per_s(self) -> float:
        """What the engines generate with every slot decoding (the engine-bound limit),
        the cache holding a full batch of prompts and outputs part-way through."""
        kv = self.slots_per_engine * (PROMPT_TOKENS + self.inflight_output_tokens)
        step_s = engine_profile(self.engine_profile).step_factor(self.slots_per_engine, round(kv)) \
            / self.decode_tokens_per_s
        return self.capacity / step_s

    @property
    def slowdown(self) -> float:
        """r: the step at a full batch against the step of one request alone."""
        kv = self.slots_per_engine * (PROMPT_TOKENS + self.inflight_output_tokens)
        return engine_profile(self.engine_profile).slowdown(self.slots_per_engine, round(kv))

    @property
    def inflight_output_tokens(self) -> float:
        """Mean output so far of a request caught in flight: E[L²] / 2E[L] (long
        requests are in flight longer), L log-normal and capped at max_new_tokens."""
        rng = random.Random(0)
        sigma = math.log(self.tail_ratio) / Z99
        lengths = [min(self.max_new_tokens, rng.lognormvariate(math.log(self.median_tokens), sigma))
                   for _ in range(20_000)]
        return sum(x * x for x in lengths) / (2 * sum(lengths))

    @property
    def trainer_tokens_per_s(self) -> float:
        return self.trainer_speed * self.engine_limit_tokens_per_s

    def train_s(self, tokens: int) -> float:
        """The simulated training step: time proportional to the generated tokens."""
        return tokens / self.trainer_tokens_per_s

    def with_tail(self, ratio: float) -> Settings:
        """Same mean output length, p99/median = ratio (so the trainer's work is the same)."""
        sigma = math.log(ratio) / Z99
        median = self.mean_tokens / math.exp(sigma * sigma / 2)
        return replace(self, median_tokens=median, p99_tokens=median * ratio)

    def sim_config(self) -> SimConfig:
        return SimConfig(seed=self.seed, max_running_requests=self.slots_per_engine,
                         decode_tokens_per_s=self.decode_tokens_per_s, engine_profile=self.engine_profile,
                         length_median=self.median_tokens, length_p99=self.p99_tokens,
                         weight_update_s=self.weight_update_s)

    def groups_needed(self, eta: int) -> int:
        """Enough prompts that admission never runs dry: (η + steps + 1)·B can be admitted."""
        return (eta + self.total_steps + 2) * self.batch_groups


# -- prompts ------------------------------------------------------------------------------


def make_group(settings: Settings, row: int) -> Group:
    """Group `row` of the seeded arithmetic dataset (the same prompts in every row)."""
    rng = random.Random(f"{settings.seed}|{row}")
    a, b = rng.randrange(2, 1000), rng.randrange(2, 1000)
    # The dataset name carries the seed: it is part of every sample's sampling seed.
    return Group.fresh(f"g{row}", f"What is {a} + {b}?", settings.n_samples, label=str(a + b), row=row,
                       dataset=f"bench-seed{settings.seed}")


def make_groups(settings: Settings, count: int) -> list[Group]:
    return [make_group(settings, row) for row in range(count)]


# -- the trainer --------------------------------------------------------------------------


@dataclass
class TrainedBatch:
    groups: list[Group]
    restarted: int = 0  # groups found too stale and restarted while this batch was taken


def version_lags(group: Group, version: int) -> tuple[int, int]:
    """(oldest, completion): how many versions behind `version` the oldest request of
    the group ended (with abort pauses no request spans an update, so that is the
    version of its oldest token), and its last one."""
    versions = [parse_version(v) or 0 for s in group.samples for v in s.weight_versions] or [version]
    return version - min(versions), version - max(versions)


class BatchSource(Protocol):
    async def next_batch(self, n: int) -> TrainedBatch: ...

    async def weight_update(self, version: int) -> None: ...


@dataclass
class TrainerLog:
    wait_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    staleness_oldest: Counter = field(default_factory=Counter)  # lag -> groups
    staleness_completion: Counter = field(default_factory=Counter)
    restarted: int = 0
    trained_tokens: int = 0  # every step, warm-up included
    window_s: float = 0.0
    window: Window | None = None


async def run_trainer(settings: Settings, source: BatchSource, fleet: SimFleet, eta: int) -> TrainerLog:
    """B groups, train, weight update; repeated. Measured after the warm-up steps. Every
    trained group of every step is checked against the bound: none older than η
    versions on the oldest-token clock (AssertionError otherwise)."""
    log = TrainerLog()
    start = 0.0
    for step in range(settings.total_steps):
        measured = step >= settings.warmup_steps
        if step == settings.warmup_steps:
            fleet.start_window()
            start = time.monotonic()
        t0 = time.monotonic()
        batch = await source.next_batch(settings.batch_groups)
        t1 = time.monotonic()
        tokens = sum(group_tokens(g) for g in batch.groups)
        log.trained_tokens += tokens
        too_old = [(g.group_id, lag) for g in batch.groups if (lag := version_lags(g, step)[0]) > eta]
        if too_old:
            raise AssertionError(f"step {step}: trained groups older than η = {eta} versions on the oldest-token "
                                 f"clock (group, lag): {too_old[:5]}")
        await asyncio.sleep(settings.train_s(tokens))
        t2 = time.monotonic()
        await source.weight_update(step + 1)
        t3 = time.monotonic()
        if measured:
            log.wait_s.append(t1 - t0)
            log.train_s.append(t2 - t1)
            log.update_s.append(t3 - t2)
            log.tokens.append(tokens)
            for group in batch.groups:
                oldest, completion = version_lags(group, step)
                log.staleness_oldest[oldest] += 1
                log.staleness_completion[completion] += 1
            log.restarted += batch.restarted
    log.window_s = time.monotonic() - start
    log.window = fleet.stop_window()
    return log


# -- a row of the table -------------------------------------------------------------------


@dataclass
class Row:
    """One system at one setting, one seed."""

    name: str
    system: str  # sync, in-memory, pipeline
    eta: int | None
    seed: int
    engine_profile: str
    slowdown: float  # r of the profile at this batch (engines/profiles.py)
    tail_ratio: float
    pause_mode: str
    weight_update: str
    trained_tokens_per_s: float  # the headline
    samples_per_s: float
    generated_tokens_per_s: float
    engine_limit_tokens_per_s: float  # every slot decoding at a full batch
    trained_utilization: float  # trained tokens ÷ the engine-bound limit
    generated_utilization: float  # generated tokens ÷ the engine-bound limit
    trainer_idle: float  # fraction of the window the trainer waited for its batch
    update_fraction: float  # fraction of the window spent in weight updates
    slot_utilization: float  # engine slots decoding, time-averaged, ÷ capacity
    engines_paused: float  # fraction of the window the engines were paused
    staleness_oldest: dict[int, int]  # version lag of the oldest request of each trained group -> groups
    staleness_completion: dict[int, int]  # version lag of the last request -> groups
    restarted: int  # groups restarted as too stale during the measured steps
    waterfall: dict  # where every generated token went, over the whole run (bench/waterfall.py)
    window_s: float
    audit: str | None = None  # pipeline rows: the conservation audit at the end


def make_row(name: str, system: str, eta: int | None, settings: Settings, log: TrainerLog, waterfall: Waterfall,
             audit: str | None = None) -> Row:
    waterfall.check(f"{name} seed {settings.seed}")
    window = log.window_s
    limit = settings.engine_limit_tokens_per_s
    generated = log.window.generated_tokens / window
    trained = sum(log.tokens) / window
    return Row(
        name=name, system=system, eta=eta, seed=settings.seed, engine_profile=settings.engine_profile,
        slowdown=round(settings.slowdown, 3), tail_ratio=round(settings.tail_ratio, 3),
        pause_mode=settings.pause_mode, weight_update=settings.weight_update,
        trained_tokens_per_s=trained,
        samples_per_s=settings.steps * settings.batch_groups * settings.n_samples / window,
        generated_tokens_per_s=generated,
        engine_limit_tokens_per_s=limit,
        trained_utilization=trained / limit,
        generated_utilization=generated / limit,
        trainer_idle=sum(log.wait_s) / window,
        update_fraction=sum(log.update_s) / window,
        slot_utilization=log.window.utilization,
        engines_paused=log.window.paused,
        staleness_oldest=dict(sorted(log.staleness_oldest.items())),
        staleness_completion=dict(sorted(log.staleness_completion.items())),
        restarted=log.restarted,
        waterfall=waterfall.as_dict(),
        window_s=window,
        audit=audit,
    )
