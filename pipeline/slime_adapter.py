"""slime plug points backed by the Redis queue, without slime installed.

Two entry points, both built on `RedisDataSource` (one `Consumer` per trainer):

- `--rollout-function-path pipeline.slime_adapter.generate_rollout`: each call
  returns exactly `args.rollout_batch_size` finished groups from the results stream,
  sorted by sample `index`, as `RolloutFnTrainOutput(samples, metrics)`.
- `--data-source-path pipeline.slime_adapter.RedisDataSource`: slime's
  `DataSource` methods (`get_samples`, `add_samples`, `save`, `load`, `__len__`).

Commit rule: slime calls the rollout function once per step and trains on what it
returns, so a batch is committed when a later one is requested (its step finished).
`commit_lag` batches stay uncommitted: 1 for slime's `train.py`; 2 for
`train_async.py`, which requests rollout k+1 *before* training on rollout k.
A crash leaves those batches pending and the next trainer session gets them first.

slime's real types are used when importable (`slime.utils.types.Sample`,
`slime.rollout.base_types.RolloutFnTrainOutput`); otherwise the stand-ins below,
with the same field names, and our own `Sample`. See docs/trainers.md.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .connection import connect
from .consumer import Batch, BatchMetrics, BatchTimeout, Consumer
from .control import ControlState, read_control
from .filters import BUILTIN_FILTERS, load_object
from .queue import Settle, StreamEntry
from .types import Group, Sample, Status

log = logging.getLogger(__name__)

URL_ENV = "ROLLOUT_REDIS_URL"  # the CLI reads the same variables
NAMESPACE_ENV = "ROLLOUT_NAMESPACE"
DEFAULT_NAMESPACE = "rollout"
WAIT_LOG_EVERY_S = 60.0  # while waiting for a batch, say why this often


# -- slime's types, or stand-ins with the same fields ----------------------------------


@dataclass
class RolloutFnTrainOutput:
    """Stand-in for slime.rollout.base_types.RolloutFnTrainOutput."""

    samples: list[list[Any]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """Stand-in for slime.rollout.base_types.RolloutFnEvalOutput."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


@dataclass(frozen=True)
class SlimeTypes:
    sample: type  # slime's Sample, or ours
    train_output: type
    eval_output: type
    real: bool  # True when imported from slime


@functools.lru_cache(maxsize=1)
def slime_types() -> SlimeTypes:
    """slime's classes when slime is importable, else ours. Cached; tests that inject a
    fake `slime` into sys.modules call `slime_types.cache_clear()`."""
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput as EvalOut
        from slime.rollout.base_types import RolloutFnTrainOutput as TrainOut
        from slime.utils.types import Sample as SlimeSample
    except ImportError:
        return SlimeTypes(Sample, RolloutFnTrainOutput, RolloutFnEvalOutput, real=False)
    return SlimeTypes(SlimeSample, TrainOut, EvalOut, real=True)


def to_slime_sample(sample: Sample, types: SlimeTypes | None = None) -> Any:
    """slime's `Sample.from_dict(ours.to_dict())`: same field names, status as its string
    value. Without slime, our own Sample unchanged."""
    types = types or slime_types()
    if not types.real:
        return sample
    return types.sample.from_dict(sample.to_dict())


_OUR_FIELDS = set(Sample.__dataclass_fields__)


def from_slime_sample(sample: Any) -> Sample:
    """Our Sample from slime's (or from ours): the fields both share."""
    data = sample.to_dict() if hasattr(sample, "to_dict") else dict(vars(sample))
    kept = {k: v for k, v in data.items() if k in _OUR_FIELDS}
    status = kept.get("status", Status.PENDING)
    kept["status"] = Status(getattr(status, "value", status))
    return Sample(**kept)


# -- settings ------------------------------------------------------------------------


@dataclass
class QueueSettings:
    """Where the queue is and how to read it. From `args` attributes first (set them
    with slime's `--custom-config-path` YAML), then the environment."""

    redis_url: str
    namespace: str = DEFAULT_NAMESPACE
    consumer: str = "trainer"
    timeout: float | None = None  # give up on a batch after this long (None: keep waiting)
    commit_lag: int = 1  # batches left uncommitted: 1 for train.py, 2 for train_async.py
    filter_path: str | None = None  # slime's --dynamic-sampling-filter-path

    @classmethod
    def from_args(cls, args: Any) -> QueueSettings:
        url = getattr(args, "rollout_redis_url", None) or os.environ.get(URL_ENV)
        if not url:
            from .redis_server import local_redis_url

            url = local_redis_url()
        if not url:
            raise ValueError(f"no Redis for the rollout queue: set {URL_ENV} (or `rollout_redis_url` in "
                             "--custom-config-path), or start a local stack with `rollout up`")
        lag = int(getattr(args, "rollout_commit_lag", None) or 1)
        if lag < 1:
            raise ValueError(f"rollout_commit_lag must be at least 1, got {lag}")
        return cls(
            redis_url=url,
            namespace=getattr(args, "rollout_namespace", None) or os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE,
            consumer=getattr(args, "rollout_consumer", None) or "trainer",
            timeout=getattr(args, "rollout_batch_timeout", None),
            commit_lag=lag,
            filter_path=getattr(args, "dynamic_sampling_filter_path", None),
        )


def _slime_filter(path: str | None) -> Any:
    """slime's filters call slime's Sample methods (`get_reward_value`): hand them
    slime Samples. Built-in names go to the Consumer as they are."""
    if path is None or path in BUILTIN_FILTERS:
        return path
    fn = load_object(path)

    def call(args: Any, samples: list[Sample]) -> Any:
        types = slime_types()
        return fn(args, [to_slime_sample(s, types) for s in samples])

    call.__name__ = getattr(fn, "__name__", "slime_filter")
    return call


# -- metrics -------------------------------------------------------------------------


def _metric_name(reason: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", reason).strip("_") or "filtered"


def slime_metrics(metrics: BatchMetrics, weight_version: int) -> dict[str, Any]:
    """Batch metrics under slime-style keys. Filter drops use slime's own
    `rollout/dynamic_filter/drop_<reason>` so existing dashboards keep working."""
    out: dict[str, Any] = {
        "rollout/queue/kept": metrics.kept,
        "rollout/queue/dropped": sum(metrics.dropped.values()),
        "rollout/queue/drop_ratio": metrics.drop_ratio,
        "rollout/queue/restarted": metrics.restarted,
        "rollout/queue/dead": metrics.dead,
        "rollout/queue/duplicates": metrics.duplicates,
        "rollout/queue/wait_time": metrics.wait_s,
        "rollout/queue/weight_version": weight_version,
    }
    for reason, count in metrics.dropped.items():
        key = "rollout/queue/drop_stale" if reason == "stale" else f"rollout/dynamic_filter/drop_{_metric_name(reason)}"
        out[key] = out.get(key, 0) + count
    if metrics.staleness:
        total = sum(metrics.staleness.values())
        out["rollout/queue/staleness_mean"] = sum(lag * n for lag, n in metrics.staleness.items()) / total
        out["rollout/queue/staleness_max"] = max(metrics.staleness)
        for lag, count in sorted(metrics.staleness.items()):
            out[f"rollout/queue/staleness/{lag}"] = count
    return out


# -- the data source -----------------------------------------------------------------


@dataclass
class _Item:
    entry: StreamEntry
    group: Group  # ours, as decoded
    slime_group: list  # what slime got
    returned: bool = False  # given back through add_samples: not to be committed with this delivery


@dataclass
class _Delivery:
    items: list[_Item]
    weight_version: int
    metrics: BatchMetrics = field(default_factory=BatchMetrics)


def _index_key(group: list) -> tuple:
    index = group[0].index if group else None
    return (index is None, index if index is not None else 0)


class RedisDataSource:
    """slime's DataSource over the queue: `get_samples(n)` returns n *finished* groups
    from the results stream (not prompts to generate). Prompts are pushed with
    `rollout push`; workers generate them."""

    def __init__(self, args: Any, *, client: Any = None):
        self.args = args
        self.settings = QueueSettings.from_args(args)
        self._own_client = client is None
        self.client = client or connect(self.settings.redis_url)
        self.consumer = Consumer(self.client, self.settings.namespace, consumer=self.settings.consumer,
                                 filter=_slime_filter(self.settings.filter_path), filter_args=args)
        self.queue = self.consumer.queue
        self._pending: deque[_Delivery] = deque()  # delivered, not committed, oldest first
        self._origin: dict[int, _Item] = {}  # id(a delivered slime sample) -> its group's item
        self._redeliver: list[_Item] = []  # given back with add_samples: served first
        self.last_metrics: dict[str, Any] = {}

    # -- slime's DataSource interface ----------------------------------------------------

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """`num_samples` finished groups, sorted by sample index. Commits what earlier calls
        delivered except the newest `commit_lag - 1` batches: call it once per step."""
        if num_samples <= 0:
            raise ValueError(f"get_samples needs a positive number of groups, got {num_samples}")
        self._commit_keeping(self.settings.commit_lag - 1)
        started = time.monotonic()
        control = read_control(self.client, self.queue.keys)
        items = self._take_given_back(num_samples, control)
        metrics, version = BatchMetrics(kept=len(items)), control.weight_version
        if len(items) < num_samples:
            batch = self._next_batch(num_samples - len(items))
            types = slime_types()
            for entry, group in zip(batch.entries, batch.groups):
                items.append(_Item(entry, group, [to_slime_sample(s, types) for s in group.samples]))
            metrics, version = batch.metrics, batch.weight_version
            metrics.kept = num_samples
        metrics.wait_s = time.monotonic() - started
        self._check_group_sizes([it.slime_group for it in items], [it.group.group_id for it in items])
        items.sort(key=lambda it: _index_key(it.slime_group))
        self._pending.append(_Delivery(items, version, metrics))
        for it in items:
            self._track(it)
        self.last_metrics = slime_metrics(metrics, version)
        return [it.slime_group for it in items]

    def add_samples(self, samples: list[list[Any]]) -> None:
        """Groups given back. Ours (from get_samples, e.g. slime's over-sampling surplus)
        are kept uncommitted and served first by the next get_samples; foreign groups
        (partial generations from slime itself) are pushed as prompts for the workers
        to continue."""
        if not samples:
            return
        foreign = []
        for group in samples:
            if not isinstance(group, list) or not group:
                raise ValueError(f"add_samples takes a list of non-empty groups (lists), got {type(group).__name__}")
            item = next((self._origin[id(s)] for s in group if id(s) in self._origin), None)
            if item is None:
                foreign.append(group)
            elif not item.returned:  # (given back twice before being served again: once is enough)
                item.returned, item.slime_group = True, group
                self._redeliver.append(item)
        if foreign:
            self._check_group_sizes(foreign, [f"given back #{i}" for i in range(len(foreign))])
            groups = [Group(group_id=f"slime:{uuid.uuid4().hex}", samples=[from_slime_sample(s) for s in g],
                            dataset="slime", row=g[0].group_index or 0) for g in foreign]
            self.queue.push_groups(groups)
            log.info("pushed %d groups given back by slime as prompts", len(groups))

    def save(self, rollout_id: int) -> None:
        """Nothing to write: the queue, its cursor and every group live in Redis. slime
        saves after the step's training, so batches older than `commit_lag - 1` are
        committed here (the last step of a run would otherwise stay pending)."""
        self._commit_keeping(self.settings.commit_lag - 1)

    def load(self, rollout_id: int | None = None) -> None:
        """Nothing to read: uncommitted batches of an earlier session come back first
        from the Consumer on the first get_samples."""
        return None

    def __len__(self) -> int:
        """Finished groups ready in the results stream (not handed out, or given back)."""
        outstanding = sum(1 for d in self._pending for it in d.items if not it.returned)
        return max(0, self.client.xlen(self.queue.keys.results) - outstanding)

    # -- commits -------------------------------------------------------------------------

    def commit_pending(self) -> int:
        """Commit every delivered batch now (e.g. after the last training step)."""
        return self._commit_keeping(0)

    @property
    def pending_batches(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Drop the connection (if this source opened it) without committing anything."""
        if self._own_client:
            self.client.close()

    def _commit_keeping(self, keep: int) -> int:
        done = 0
        while len(self._pending) > keep:
            delivery = self._pending.popleft()
            items = [it for it in delivery.items if not it.returned]
            for it in items:
                self._track(it, forget=True)
            if items:
                batch = Batch([it.group for it in items], [it.entry for it in items],
                              delivery.weight_version, delivery.metrics)
                done += self.consumer.commit(batch)
        return done

    # -- helpers -------------------------------------------------------------------------

    def _track(self, item: _Item, forget: bool = False) -> None:
        """Remember which delivered group each slime sample belongs to (add_samples gets
        the same objects back), or forget it once settled."""
        for s in item.slime_group:
            if forget:
                self._origin.pop(id(s), None)
            else:
                self._origin[id(s)] = item

    def _take_given_back(self, n: int, control: ControlState) -> list[_Item]:
        """Up to n given-back groups, as fresh items (the delivery they came from keeps them
        marked `returned`). One that grew too stale since it was screened is dropped (logged
        in the drop log), so no group beyond max_staleness is delivered."""
        taken, stale = [], []
        while self._redeliver and len(taken) < n:
            it = self._redeliver.pop(0)
            lag = control.weight_version - (it.group.oldest_version(control.version_clock) or 0)
            if control.max_staleness is not None and lag > control.max_staleness:
                self._track(it, forget=True)
                reason = f"stale: given back, then {lag} versions behind (max {control.max_staleness})"
                stale.append(Settle("drop", it.entry.entry_id, it.group.group_id, reason, token=it.entry.token))
                continue
            taken.append(_Item(it.entry, it.group, it.slime_group))
        if stale:
            log.warning("dropping %d given-back groups that grew too stale", len(stale))
            self.queue.settle(self.queue.keys.results, stale, self.consumer.session)
        return taken

    def _next_batch(self, n: int) -> Batch:
        """Wait for n groups, saying why every WAIT_LOG_EVERY_S; give up after
        `timeout` (None: never). Groups read before a timeout stay with the Consumer."""
        timeout = self.settings.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            slice_s = WAIT_LOG_EVERY_S if left is None else max(0.0, min(WAIT_LOG_EVERY_S, left))
            try:
                return self.consumer.next_batch(n, timeout=slice_s)
            except BatchTimeout as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                log.warning("still waiting for a batch: %s", exc)

    def _check_group_sizes(self, groups: list[list], names: list[str]) -> None:
        """slime's GRPO normalization reshapes rewards by n_samples_per_prompt; a group of
        another size would be normalized against its neighbours without an error."""
        n = getattr(self.args, "n_samples_per_prompt", None)
        wrong = [(name, len(g)) for name, g in zip(names, groups) if n is not None and len(g) != n]
        if wrong:
            sizes = ", ".join(f"{name}: {size}" for name, size in wrong[:5])
            raise ValueError(f"groups of the wrong size for n_samples_per_prompt={n} ({sizes}); push prompts "
                             f"with `rollout push --n-samples {n}` or set --n-samples-per-prompt to match")


# -- the rollout function --------------------------------------------------------------

_SOURCES: dict[tuple[str, str, str], RedisDataSource] = {}


def default_source(args: Any) -> RedisDataSource:
    """One RedisDataSource per (Redis URL, namespace, consumer) in this process, for when
    slime's data source is not ours."""
    s = QueueSettings.from_args(args)
    key = (s.redis_url, s.namespace, s.consumer)
    if key not in _SOURCES:
        _SOURCES[key] = RedisDataSource(args)
    return _SOURCES[key]


def reset_default_sources() -> None:
    """Close and forget the cached sources without committing (tests; a "restart")."""
    for source in _SOURCES.values():
        source.close()
    _SOURCES.clear()


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's `--rollout-function-path`: exactly `args.rollout_batch_size` finished
    groups from the queue. Uses `data_source` when it is a RedisDataSource, else one
    built from `args` / the environment."""
    if evaluation:
        raise NotImplementedError(
            "pipeline.slime_adapter.generate_rollout serves training batches from the rollout queue; "
            "evaluation runs are not served from it (they would consume training groups). slime uses the "
            "rollout function for evaluation unless told otherwise: pass "
            "--eval-function-path slime.rollout.sglang_rollout.generate_rollout to evaluate with slime's "
            "own rollout against the engines, or drop --eval-interval.")
    source = data_source if isinstance(data_source, RedisDataSource) else default_source(args)
    groups = source.get_samples(args.rollout_batch_size)
    return slime_types().train_output(samples=groups, metrics=dict(source.last_metrics))
