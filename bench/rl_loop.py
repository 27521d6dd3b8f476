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
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Protocol

from pipeline.types import Group
from engines.simulator import SimConfig

from .sim_fleet import SimFleet, Window

Z99 = 2.3263478740408408  # standard normal quantile at 0.99, as the simulator uses
PAUSE_MODES = ("in_place", "retract", "abort")


@dataclass(frozen=True)
class Settings:
    engines: int = 4
    slots_per_engine: int = 32  # the simulators' max_running_requests; clients use as many
    decode_tokens_per_s: float = 400.0  # per running request
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
    # Time the engines take to load new weights: ~2% of a step, as an NCCL broadcast of
    # a 7B model (1-2 s) against a step of one to two minutes.
    weight_update_s: float = 0.02
    # in_place: requests freeze during the update and go on after it. Not abort (the
    # project's default protocol, a --pause-mode away): the simulator draws a fresh
    # length for a continued request, which changes the length distribution for the
    # asynchronous rows only (at p99/median = 30 their trained samples averaged 125
    # tokens with abort, 150 with in_place, 196 in sync).
    pause_mode: str = "in_place"
    seed: int = 0

    def __post_init__(self) -> None:
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
    def trainer_tokens_per_s(self) -> float:
        return self.trainer_speed * self.capacity * self.decode_tokens_per_s

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
                         decode_tokens_per_s=self.decode_tokens_per_s, length_median=self.median_tokens,
                         length_p99=self.p99_tokens, weight_update_s=self.weight_update_s)

    def groups_needed(self, eta: int) -> int:
        """Enough prompts that admission never runs dry: (η + steps + 1)·B can be admitted."""
        return (eta + self.total_steps + 2) * self.batch_groups


# -- prompts ------------------------------------------------------------------------------


def make_group(settings: Settings, row: int) -> Group:
    """Group `row` of the seeded arithmetic dataset (the same prompts in every row)."""
    rng = random.Random(f"{settings.seed}|{row}")
    a, b = rng.randrange(2, 1000), rng.randrange(2, 1000)
    return Group.fresh(f"g{row}", f"What is {a} + {b}?", settings.n_samples, label=str(a + b), row=row)


def make_groups(settings: Settings, count: int) -> list[Group]:
    return [make_group(settings, row) for row in range(count)]


def group_tokens(group: Group) -> int:
    """Generated tokens a group holds."""
    return sum(s.response_length for s in group.samples)


# -- the trainer --------------------------------------------------------------------------


@dataclass
class TrainedBatch:
    groups: list[Group]
    staleness: list[int]  # per group: trainer version - oldest version of its tokens
    restarted: int = 0  # groups found too stale and restarted while this batch was taken


@dataclass
class Tokens:
    """Where every generated token went; generated = trained + left + wasted."""

    generated: int
    trained: int
    left: int  # still held at the end (queued, in flight, finished but not trained)
    wasted: int  # thrown away: restarted as stale, dropped, lost


class BatchSource(Protocol):
    async def next_batch(self, n: int) -> TrainedBatch: ...

    async def weight_update(self, version: int) -> None: ...


@dataclass
class TrainerLog:
    wait_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    staleness: Counter = field(default_factory=Counter)
    restarted: int = 0
    trained_tokens: int = 0  # every step, warm-up included
    window_s: float = 0.0
    window: Window | None = None


async def run_trainer(settings: Settings, source: BatchSource, fleet: SimFleet) -> TrainerLog:
    """B groups, train, weight update; repeated. Measured after the warm-up steps."""
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
        await asyncio.sleep(settings.train_s(tokens))
        t2 = time.monotonic()
        await source.weight_update(step + 1)
        t3 = time.monotonic()
        if measured:
            log.wait_s.append(t1 - t0)
            log.train_s.append(t2 - t1)
            log.update_s.append(t3 - t2)
            log.tokens.append(tokens)
            log.staleness.update(batch.staleness)
            log.restarted += batch.restarted
    log.window_s = time.monotonic() - start
    log.window = fleet.stop_window()
    return log


# -- a row of the table -------------------------------------------------------------------


@dataclass
class Row:
    name: str
    system: str  # sync, in-memory, pipeline
    eta: int | None
    tail_ratio: float
    samples_per_s: float
    tokens_per_s: float
    trainer_idle: float  # fraction of the window the trainer waited for its batch
    update_fraction: float  # fraction of the window spent in weight updates
    utilization: float  # engine slots decoding, time-averaged, ÷ capacity
    free_slots: float  # engine slots holding no request, time-averaged, ÷ capacity
    engines_paused: float  # fraction of the window the engines were paused
    engine_queue: float  # requests waiting inside the engines, time-averaged
    staleness: dict[int, int]  # version lag of trained groups -> count
    restarted: int  # groups restarted as too stale during the measured steps
    tokens: Tokens
    window_s: float
    mean_wait_s: float
    mean_train_s: float
    mean_update_s: float
    ratio_to_sync: float | None = None
    audit: str | None = None  # pipeline rows: the conservation audit at the end


def make_row(name: str, system: str, eta: int | None, settings: Settings, log: TrainerLog, tokens: Tokens,
             audit: str | None = None) -> Row:
    window = log.window_s
    return Row(
        name=name, system=system, eta=eta, tail_ratio=round(settings.tail_ratio, 3),
        samples_per_s=settings.steps * settings.batch_groups * settings.n_samples / window,
        tokens_per_s=sum(log.tokens) / window,
        trainer_idle=sum(log.wait_s) / window,
        update_fraction=sum(log.update_s) / window,
        utilization=log.window.utilization,
        free_slots=log.window.free_slots,
        engines_paused=log.window.paused,
        engine_queue=log.window.waiting,
        staleness=dict(sorted(log.staleness.items())),
        restarted=log.restarted,
        tokens=tokens,
        window_s=window,
        mean_wait_s=statistics.fmean(log.wait_s),
        mean_train_s=statistics.fmean(log.train_s),
        mean_update_s=statistics.fmean(log.update_s),
        audit=audit,
    )
