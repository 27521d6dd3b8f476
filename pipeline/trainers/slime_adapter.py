"""slime plug points backed by the Redis queue.

- `--rollout-function-path pipeline.trainers.slime_adapter.generate_rollout`: rollout r returns
  exactly `args.rollout_batch_size` finished groups from the results stream, sorted by
  sample `index`, as `RolloutFnTrainOutput(samples, metrics)`; with `evaluation=True`
  it runs an eval pass through `<ns>.eval` (pipeline/trainers/eval.py) and returns
  `RolloutFnEvalOutput`.
- `--data-source-path pipeline.trainers.slime_adapter.RedisDataSource`: slime's `DataSource`
  (`get_samples`, `add_samples`, `save`, `load`, `__len__`) over the same queue.
- `--rollout-sample-filter-path pipeline.trainers.slime_adapter.record_trained`: with
  slime's own rollout over the data source, which groups it trained (after a refill).

What keeps slime from training on the wrong data (docs/trainers.md):
* the queue's weight version is slime's rollout id, set before each rollout is read,
  and groups are aged on the queue's clock (slime's engines number their weights from 1
  in every run); a trainer's first rollout may set it back (slime resumed from an earlier
  checkpoint), and says so: the rollback is explicit, every later version moves forward;
* every write (records, versions, settings, commits) goes through the Consumer's writer:
  refused once a newer trainer session took over, on the replicas before it returns;
* a batch is committed when the checkpoint that includes its step is saved
  (`save(rollout_id)`); after a restart and `load`, the uncommitted batches come back
  first, in order;
* groups admitted before slime went back to an earlier rollout id (a resume from an older
  checkpoint, a new run) at a later version are generated again (pipeline/rewind.py);
* groups sampled with settings other than slime's, and groups of workers on engines slime
  does not update, are refused when read: every such group in the stream goes back to be
  generated again, then one error (pipeline/trainers/slime_checks.py, slime_engines.py);
  workers on foreign engines are refused at start too, and batches whose weight versions
  lag slime's engines are reported.
"""
from __future__ import annotations

import functools
import logging
import os
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pipeline.connection import connect
from pipeline.consumer import (
    Batch,
    BatchMetrics,
    BatchTimeout,
    Consumer,
    GroupsRefused,
    Refusal,
)
from pipeline.control import configure, read_control
from .eval import push_eval, read_eval
from pipeline.filters import BUILTIN_FILTERS, load_object
from pipeline.producer import PushOptions
from pipeline.queue import StreamEntry
from .slime_checks import (
    SAMPLING,
    SamplingMismatch,
    SlimeConfigError,
    check_backlog,
    check_data_source_use,
    check_ignored_flags,
    check_top_p,
    records_trained,
    sampling_refusals,
    uses_our_rollout,
)
from .slime_engines import EngineCheck
from .slime_metrics import slime_metrics
from .slime_types import (
    MIN_DATA_SOURCE,
    MIN_ROLLOUT_FUNCTION,
    SlimeTypes,
    current_rollout_id,
    from_slime_sample,
    require,
    slime_types,
    to_slime_sample,
)
from pipeline.types import Group, Sample, VersionClock

log = logging.getLogger(__name__)

URL_ENV = "ROLLOUT_REDIS_URL"  # the CLI reads the same variables
NAMESPACE_ENV = "ROLLOUT_NAMESPACE"
DEFAULT_NAMESPACE = "rollout"
WAIT_LOG_EVERY_S = 60.0  # while waiting for a batch, say why this often
#: Rollouts after which a batch is committed when slime saves no checkpoints: by rollout
#: r + 2 its step has run under train.py and train_async.py alike.
COMMIT_AFTER_ROLLOUTS = 2
#: slime keeps keep_when_insufficient groups as soon as the groups it read cannot fill the
#: batch: the Consumer keeps them once the results stream has nothing more to screen.
SLIME_FALLBACK_WAIT_S = 0.0
#: slime_rollouts field naming the run that saved a checkpoint: "checkpoint <rollout id>" -> run id.
CHECKPOINT_FIELD = "checkpoint "


# -- settings ------------------------------------------------------------------------


@dataclass
class QueueSettings:
    """Where the queue is and how to read it. From `args` attributes first (set them
    with slime's `--custom-config-path` YAML), then the environment."""

    redis_url: str
    namespace: str = DEFAULT_NAMESPACE
    consumer: str = "trainer"
    timeout: float | None = None  # give up on a batch after this long (None: keep waiting)
    filter_path: str | None = None  # slime's --dynamic-sampling-filter-path
    fallback_wait_s: float = SLIME_FALLBACK_WAIT_S  # before keeping keep_when_insufficient groups
    max_staleness: int | None = None  # η, configured on the namespace at start when given
    #: Without checkpoints: commit each batch as slime reads it (at most once: a crash in
    #: that step loses its groups) instead of two rollouts later (the last two batches of
    #: a run are then never committed, and the next run trains them again).
    commit_on_read: bool = False
    #: Redis behind Sentinel: session starts, deliveries, commits and weight versions return
    #: once this many replicas have them (docs/operations.md, Durability).
    replicas: int = 0

    @classmethod
    def from_args(cls, args: Any) -> QueueSettings:
        url = getattr(args, "rollout_redis_url", None) or os.environ.get(URL_ENV)
        if not url:
            from pipeline.redis_server import local_redis_url

            url = local_redis_url()
        if not url:
            raise ValueError(f"no Redis for the rollout queue: set {URL_ENV} (or `rollout_redis_url` in "
                             "--custom-config-path), or start a local stack with `rollout up`")
        if getattr(args, "rollout_commit_lag", None) is not None:
            raise ValueError("rollout_commit_lag is gone: batches are committed when slime saves the checkpoint "
                             "that includes their step (docs/trainers.md); remove it from the config")
        fallback = getattr(args, "rollout_filter_fallback_wait", None)
        return cls(
            redis_url=url,
            namespace=getattr(args, "rollout_namespace", None) or os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE,
            consumer=getattr(args, "rollout_consumer", None) or "trainer",
            timeout=getattr(args, "rollout_batch_timeout", None),
            filter_path=getattr(args, "dynamic_sampling_filter_path", None),
            fallback_wait_s=SLIME_FALLBACK_WAIT_S if fallback is None else float(fallback),
            max_staleness=getattr(args, "rollout_max_staleness", None),
            commit_on_read=bool(getattr(args, "rollout_commit_on_read", False)),
            replicas=int(getattr(args, "rollout_replicas", None) or 0),
        )


def saves_checkpoints(args: Any) -> bool:
    """Whether slime will call `save(rollout_id)` (train.py: at --save-interval, with
    --save, on the global dataset)."""
    return (getattr(args, "rollout_global_dataset", True) and bool(getattr(args, "save", None))
            and getattr(args, "save_interval", None) is not None)


def _slime_filter(path: str | None, fill_responses: Any) -> Any:
    """slime's filters call slime's Sample methods (`get_reward_value`) and may read
    `Sample.response`: hand them slime Samples, with the response text filled in
    (`fill_responses`). Built-in names go to the Consumer as they are."""
    if path is None or path in BUILTIN_FILTERS:
        return path
    fn = load_object(path)

    def call(args: Any, samples: list[Sample]) -> Any:
        types = slime_types()
        fill_responses(samples)
        return fn(args, [to_slime_sample(s, types) for s in samples])

    call.__name__ = getattr(fn, "__name__", "slime_filter")
    return call


# -- the data source -----------------------------------------------------------------


@dataclass
class _Item:
    entry: StreamEntry
    group: Group  # ours, as decoded
    slime_group: list  # what slime got
    returned: bool = False  # given back (add_samples, or not in what slime trained): not committed with this delivery


@dataclass
class _Delivery:
    rollout_id: int
    items: list[_Item]
    weight_version: int
    metrics: BatchMetrics = field(default_factory=BatchMetrics)


def _read_record(value: str) -> tuple[str | None, int]:
    """(run, rollout id) of a slime_rollouts record; a bare rollout id (older adapter): run None."""
    run, _, rollout = value.rpartition(" ")
    return run or None, int(rollout)


def _index_key(group: list) -> tuple:
    index = group[0].index if group else None
    return (index is None, index if index is not None else 0)


class RedisDataSource:
    """slime's DataSource over the queue: `get_samples(n)` returns n *finished* groups
    from the results stream (not prompts to generate). Prompts are pushed with
    `rollout push`; workers generate them."""

    def __init__(self, args: Any, *, client: Any = None):
        self.args = args
        self.types: SlimeTypes = require(MIN_ROLLOUT_FUNCTION if uses_our_rollout(args) else MIN_DATA_SOURCE,
                                         "pipeline.trainers.slime_adapter")
        check_top_p(args)
        check_data_source_use(args)
        check_ignored_flags(args)
        self.settings = QueueSettings.from_args(args)
        self._own_client = client is None
        self.client = client or connect(self.settings.redis_url)
        self.consumer = Consumer(self.client, self.settings.namespace, consumer=self.settings.consumer,
                                 filter=_slime_filter(self.settings.filter_path, self._fill_texts),
                                 filter_args=args, check=self._refusals,
                                 fallback_wait_s=self.settings.fallback_wait_s, replicas=self.settings.replicas)
        self.queue = self.consumer.queue
        self.checkpoints = saves_checkpoints(args)
        if self.checkpoints and self.settings.commit_on_read:
            raise SlimeConfigError("rollout_commit_on_read is for runs without checkpoints: with --save-interval, "
                                   "batches are committed when the checkpoint that trained them is saved; remove it")
        self._configure()
        self.engine_check = EngineCheck(args, self.queue, self.settings.max_staleness)
        self.engine_check.start()
        self._pending: deque[_Delivery] = deque()  # delivered, not committed, oldest first
        self._origin: dict[int, _Item] = {}  # id(a delivered slime sample) -> its group's item
        self._next_rollout = 0  # the rollout id of the next get_samples (set by load)
        self.run_id = uuid.uuid4().hex[:12]  # names this trainer's reads and saves in slime_rollouts
        self._last_save: int | None = None  # the rollout id of the last save(); with --async-save, not durable yet
        self._budget_restarted: int | None = None  # the first rollout read, where the staleness budget restarted
        self.last_metrics: dict[str, Any] = {}
        _LIVE.add(self)  # for record_trained, which slime calls without the data source

    def _configure(self) -> None:
        """Groups age on the queue's clock; with `rollout_max_staleness` (or an η set with
        `rollout configure`) admission paces against slime's batch size."""
        batch = getattr(self.args, "rollout_batch_size", None)
        call = self.consumer.call
        control = call(read_control, self.client, self.queue.keys)
        eta = self.settings.max_staleness
        if eta is not None:
            control = call(configure, self.client, self.queue.keys, version_clock=VersionClock.QUEUE,
                           max_staleness=int(eta), batch_size=batch, writer=self.consumer.writer)
        elif control.max_staleness is not None and not control.batch_size and batch:
            control = call(configure, self.client, self.queue.keys, version_clock=VersionClock.QUEUE, batch_size=batch,
                           writer=self.consumer.writer)
        elif control.version_clock != VersionClock.QUEUE:
            control = call(configure, self.client, self.queue.keys, version_clock=VersionClock.QUEUE,
                           writer=self.consumer.writer)
        if self.checkpoints and batch:
            # With --async-save a checkpoint is durable (and its batches committed) one save later.
            intervals = 2 if getattr(self.args, "async_save", False) else 1
            check_backlog((intervals * int(self.args.save_interval) + COMMIT_AFTER_ROLLOUTS) * batch,
                          control.max_ready)

    # -- slime's DataSource interface ----------------------------------------------------

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """One step's `num_samples` finished groups (slime's rollout calls this once per
        step: --over-sampling-batch-size equal to --rollout-batch-size is checked at start)."""
        batch = getattr(self.args, "rollout_batch_size", None)
        if batch is not None and num_samples != batch:
            raise SlimeConfigError(
                f"get_samples({num_samples}) but --rollout-batch-size is {batch}: each call must be one step's "
                f"batch, trained whole (slime calls it again within a step when its own filter drops groups; the "
                f"queue's Consumer applies --dynamic-sampling-filter-path first, so slime's keeps them all)")
        # slime's own rollout id when it says (its filter may drop a group and call again
        # within one rollout: those groups belong to the same rollout, not the next).
        current = current_rollout_id()
        rollout_id = self._next_rollout if current is None else current
        if self._pending and self._pending[-1].rollout_id == rollout_id:
            if not records_trained(self.args):
                raise SlimeConfigError(
                    f"get_samples called again within rollout {rollout_id}: the rollout trains only part of what "
                    f"it reads, and nothing tells the queue which; set --rollout-sample-filter-path "
                    f"pipeline.trainers.slime_adapter.record_trained (slime's rollout calls it with the groups it "
                    f"trains), or read one batch per rollout")
            log.info("get_samples called again within rollout %d (slime's filter dropped groups): only the groups "
                     "slime trains are committed with it", rollout_id)
        self._next_rollout = rollout_id + 1
        return self.read_rollout(rollout_id, num_samples)

    def add_samples(self, samples: list[list[Any]]) -> None:
        """Groups given back. Ours (from get_samples, e.g. slime's partial-rollout abort)
        are handed back to the Consumer, uncommitted, and come first in the next rollout
        (screened again for staleness); foreign groups (partial generations from slime
        itself) are pushed as prompts for the workers to continue."""
        if not samples:
            return
        foreign, ours = [], []
        for group in samples:
            if not isinstance(group, list) or not group:
                raise ValueError(f"add_samples takes a list of non-empty groups (lists), got {type(group).__name__}")
            item = next((self._origin[id(s)] for s in group if id(s) in self._origin), None)
            if item is None:
                foreign.append(group)
            elif not item.returned:  # (given back twice before being served again: once is enough)
                item.returned = True
                self._track(item, forget=True)
                ours.append(item)
        if ours:
            self._records(delete=[it.entry.entry_id for it in ours], what="records of groups given back")  # not trained
            self.consumer.release(Batch([it.group for it in ours], [it.entry for it in ours], 0, BatchMetrics(),
                                        "given back by slime"), "given back by slime")
        if foreign:
            self._check_group_sizes(foreign, [f"given back #{i}" for i in range(len(foreign))])
            groups = [Group(group_id=f"slime:{uuid.uuid4().hex}", samples=[from_slime_sample(s) for s in g],
                            dataset="slime", row=g[0].group_index or 0) for g in foreign]
            self.consumer.writer.write("push of groups given back by slime",
                                       [self.queue.push_call("", 0, self.queue.group_items(groups))])
            log.info("pushed %d groups given back by slime as prompts", len(groups))

    def trained(self, samples: list[Any]) -> None:
        """slime's rollout trains exactly `samples` (see `record_trained`): the groups this
        source handed out for that rollout and not among them (its filter dropped them after
        the Consumer kept them, or a refill read more than it took) go back to the Consumer,
        uncommitted, screened again and first in the next rollout, like add_samples'. They
        stay known, so slime's add_samples of the same groups after the rollout does nothing."""
        ids = {id(s) for s in samples}
        rollouts = {d.rollout_id for d in self._pending for it in d.items if any(id(s) in ids for s in it.slime_group)}
        left_out = [it for d in self._pending if d.rollout_id in rollouts for it in d.items
                    if not it.returned and not any(id(s) in ids for s in it.slime_group)]
        if not left_out:
            return
        for it in left_out:
            it.returned = True
        log.info("slime's rollout %s left out %d groups it read: handed back, not committed",
                 "/".join(map(str, sorted(rollouts))), len(left_out))
        self._records(delete=[it.entry.entry_id for it in left_out], what="records of groups not trained")
        why = "read by slime's rollout and not trained"
        self.consumer.release(Batch([it.group for it in left_out], [it.entry for it in left_out], 0, BatchMetrics(),
                                    why), why)

    def save(self, rollout_id: int) -> None:
        """slime saved the checkpoint of every step up to `rollout_id` (it calls this after
        the model's save): the batches of those rollouts are committed now, not before,
        so a run resumed from this checkpoint neither skips nor repeats one. Which run
        saved it is recorded first, for `load`."""
        self._records({f"{CHECKPOINT_FIELD}{rollout_id}": self.run_id}, what=f"checkpoint {rollout_id}")
        num_rollout = getattr(self.args, "num_rollout", None)
        # train_async.py saves synchronously (force_sync) with --release-train and at the last rollout.
        forced = bool(getattr(self.args, "release_train", False)) or rollout_id == (num_rollout or 0) - 1
        if getattr(self.args, "async_save", False) and not forced:
            # --async-save: Megatron is still writing this checkpoint; slime's save_model
            # finalized the previous one before starting it, so that one is durable.
            durable, self._last_save = self._last_save, rollout_id
            if durable is not None:
                self._commit_through(durable)
            return
        self._last_save = rollout_id
        self._commit_through(rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        """slime resumes after the checkpoint of `rollout_id` (it calls `load(start - 1)`):
        the next rollout is `rollout_id + 1`. Batches of rollouts up to `rollout_id` still
        uncommitted (the trainer died between saving the model and save() here) are in
        that checkpoint: committed now, if the run that saved it read them (another run's
        reads, e.g. of a dead run in a used namespace, are in no checkpoint of this one).
        The rest come back first, in order, from the Consumer's new session."""
        self._next_rollout = 0 if rollout_id is None else rollout_id + 1
        if self.consumer.session is not None or rollout_id is None or rollout_id < 0:
            return
        # The queue's clock at the rollout slime resumes at, before anything is screened:
        # groups of the run it left are judged against it, not against that run's last.
        self._restart_clock(rollout_id + 1)
        recorded = self.consumer.call(self.client.hgetall, self.queue.keys.slime_rollouts)
        records = {k.decode(): v.decode() for k, v in recorded.items()}
        reads = {eid: _read_record(value) for eid, value in records.items() if not eid.startswith(CHECKPOINT_FIELD)}
        saver = records.get(f"{CHECKPOINT_FIELD}{rollout_id}")
        if saver is None:  # died between the model's save and save(): the run that read that rollout saved it
            saver = next((run for run, r in reads.values() if r == rollout_id), None)
        trained = {eid for eid, (run, r) in reads.items() if r <= rollout_id and run in (saver, None)}
        ignored = sum(1 for run, r in reads.values() if r <= rollout_id and run not in (saver, None))
        if ignored:
            log.warning("load(%d): %d groups read by another run than the one that saved this checkpoint are "
                        "not in it: they are trained again", rollout_id, ignored)
        committed = self.consumer.commit_trained(trained, f"slime checkpoint {rollout_id}")
        self._records(delete=sorted(trained), what=f"records committed with checkpoint {rollout_id}")
        if committed:
            log.info("load(%d): committed %d groups read before that checkpoint and saved in it", rollout_id,
                     committed)

    def __len__(self) -> int:
        """Finished groups ready in the results stream (not handed out, or given back)."""
        outstanding = sum(1 for d in self._pending for it in d.items if not it.returned)
        return max(0, self.consumer.call(self.client.xlen, self.queue.keys.results) - outstanding)

    # -- reading a rollout ---------------------------------------------------------------

    def read_rollout(self, rollout_id: int, n: int) -> list[list[Any]]:
        """Rollout `rollout_id`: `n` finished groups, sorted by sample index, screened at
        queue version `rollout_id`."""
        if n <= 0:
            raise ValueError(f"a rollout needs a positive number of groups, got {n}")
        started = time.monotonic()
        if self._budget_restarted is None:
            self._restart_clock(rollout_id)
        elif self.consumer.call(read_control, self.client, self.queue.keys).weight_version != rollout_id:
            # slime updates the weights once per rollout: its rollout id is the version.
            self.consumer.set_weight_version(rollout_id)
        if not self.checkpoints:
            self._commit_through(rollout_id - COMMIT_AFTER_ROLLOUTS)
        try:
            batch = self._next_batch(n)
        except GroupsRefused as exc:
            error = SamplingMismatch if {r.kind for r in exc.refusals} == {SAMPLING} else SlimeConfigError
            raise error(str(exc)) from exc
        self._fill_responses(batch.groups)
        items = [_Item(entry, group, [to_slime_sample(s, self.types) for s in group.samples])
                 for entry, group in zip(batch.entries, batch.groups)]
        metrics, version = batch.metrics, batch.weight_version
        metrics.wait_s = time.monotonic() - started
        self._check_group_sizes([it.slime_group for it in items], [it.group.group_id for it in items])
        items.sort(key=lambda it: _index_key(it.slime_group))
        self._pending.append(_Delivery(rollout_id, items, version, metrics))
        # Durable, for load(): which rollout read each entry, so a checkpoint that includes
        # that rollout commits it even when this process died before save() reached it.
        self._records({it.entry.entry_id: f"{self.run_id} {rollout_id}" for it in items},
                      what=f"records of rollout {rollout_id}")
        for it in items:
            self._track(it)
        if self.settings.commit_on_read:
            self._commit_through(rollout_id)
        self.last_metrics = {**slime_metrics(metrics, version), **self.engine_check.rollout(batch.groups)}
        return [it.slime_group for it in items]

    def _restart_clock(self, rollout_id: int) -> None:
        """This trainer's first rollout: resumed from an older checkpoint than the queue last
        saw, or a new run in a used namespace. The staleness budget counts from here, groups
        admitted after it were made by weights of a run slime left (pipeline/rewind.py), and
        the version may go back: an explicit rollback, the one this trainer makes."""
        recorded = self.consumer.call(read_control, self.client, self.queue.keys).weight_version
        if recorded > rollout_id:
            log.warning("slime starts at rollout %d: the queue's weight version goes back from %d to %d (resumed "
                        "from an earlier checkpoint, or a new run in a used namespace)", rollout_id, recorded,
                        rollout_id)
        self.consumer.set_weight_version(rollout_id, restart_budget=True, rollback=True)
        self._budget_restarted = rollout_id

    def _refusals(self, groups: list[Group]) -> list[Refusal | None]:
        """The Consumer's check of every group delivered: sampled with slime's settings, on
        the engines slime updates."""
        sampling = sampling_refusals(self.args, groups)
        engines = self.consumer.call(self.engine_check.refusals, groups)
        return [s or e for s, e in zip(sampling, engines)]

    def _fill_texts(self, samples: list[Sample]) -> None:
        """Response texts for the filter and eval: decoded with slime's tokenizer when
        there is one (else they stay as the workers published them)."""
        missing = [s for s in samples if s.response_length and not s.response]
        if missing and self.tokenizer is not None:
            skip = bool(getattr(self.args, "rollout_skip_special_tokens", False))
            for s in missing:
                s.response = self.tokenizer.decode(s.response_tokens, skip_special_tokens=skip)

    def _fill_responses(self, groups: list[Group]) -> None:
        """Results carry tokens, not text (unless workers keep it), and slime re-scores a
        group from `Sample.response` (--group-rm with its own rollout): decode the text
        with slime's tokenizer, as the engine did (skip_special_tokens as slime asks)."""
        samples = [s for g in groups for s in g.samples]
        if self.tokenizer is None and not uses_our_rollout(self.args) and any(
                s.response_length and not s.response for s in samples):
            raise SlimeConfigError(
                "results carry no response text and there is no tokenizer to decode it (slime's rollout scores "
                "Sample.response): set --hf-checkpoint, or start the workers with --keep-response-text")
        self._fill_texts(samples)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """slime's tokenizer of --hf-checkpoint, or None without slime or the flag."""
        path = getattr(self.args, "hf_checkpoint", None)
        if not path or self.types.load_tokenizer is None:
            return None
        return self.types.load_tokenizer(path, trust_remote_code=True)

    # -- commits -------------------------------------------------------------------------

    def commit_pending(self) -> int:
        """Commit every delivered batch now (e.g. after the last training step)."""
        return self._commit_through(None)

    @property
    def pending_batches(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Drop the connection (if this source opened it) without committing anything."""
        if self._own_client:
            self.client.close()

    def _commit_through(self, rollout_id: int | None) -> int:
        """Commit the deliveries of rollouts up to `rollout_id` (None: all)."""
        done = 0
        while self._pending and (rollout_id is None or self._pending[0].rollout_id <= rollout_id):
            delivery = self._pending[0]
            items = [it for it in delivery.items if not it.returned]
            if items:
                batch = Batch([it.group for it in items], [it.entry for it in items],
                              delivery.weight_version, delivery.metrics, f"slime rollout {delivery.rollout_id}")
                # Forgotten only once committed: a commit that raised (Redis gone past the
                # outage limit) is tried again by the next save, not left to a new session.
                done += self.consumer.commit(batch)
                self._records(delete=[it.entry.entry_id for it in items],
                              what=f"records of rollout {delivery.rollout_id}, committed")
            for it in delivery.items:
                self._track(it, forget=True)
            self._pending.popleft()
        return done

    # -- helpers -------------------------------------------------------------------------

    def _records(self, set_fields: dict[str, str] | None = None, delete: list[str] | None = None,
                 what: str = "records") -> None:
        """Write `slime_rollouts` through the Consumer's writer: fenced by its session, on its
        replicas before returning (a record a failover brought back would make load() commit
        a group given back as trained)."""
        self.consumer.writer.records(self.queue.keys.slime_rollouts, set_fields, delete, what)

    def _track(self, item: _Item, forget: bool = False) -> None:
        """Remember which delivered group each slime sample belongs to (add_samples gets
        the same objects back), or forget it once settled."""
        for s in item.slime_group:
            if forget:
                self._origin.pop(id(s), None)
            else:
                self._origin[id(s)] = item

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
_LIVE: weakref.WeakSet[RedisDataSource] = weakref.WeakSet()  # every data source of this process


def record_trained(args: Any, samples: list) -> None:
    """slime's `--rollout-sample-filter-path` when its own rollout runs over
    RedisDataSource: slime's `generate_rollout_async` calls it with exactly the groups it
    trains for the rollout (after its dynamic filter and any refill, before it returns).
    The data source that handed them out commits only those; the rest of what that
    rollout read goes back to the queue. Sets no `remove_sample` (every sample trains).
    A sample filter of your own can call this first."""
    flat = [s for g in samples for s in (g if isinstance(g, list) else [g])]
    for source in list(_LIVE):
        source.trained(flat)


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
    """slime's `--rollout-function-path` (and, by default, `--eval-function-path`):
    rollout `rollout_id` from the queue, exactly `args.rollout_batch_size` groups. Uses
    `data_source` when it is a RedisDataSource, else one built from `args` / the
    environment (which also picks up slime's `save`/`load` only through ours)."""
    types = require(MIN_ROLLOUT_FUNCTION, "pipeline.trainers.slime_adapter.generate_rollout")
    if not isinstance(data_source, RedisDataSource) and saves_checkpoints(args):
        raise SlimeConfigError(
            "slime saves checkpoints (--save-interval) to its own data source, so the queue could not tie its "
            "commits to them: pass --data-source-path pipeline.trainers.slime_adapter.RedisDataSource")
    source = data_source if isinstance(data_source, RedisDataSource) else default_source(args)
    if evaluation:
        return evaluate(args, rollout_id, source)
    groups = source.read_rollout(rollout_id, args.rollout_batch_size)
    return types.train_output(samples=groups, metrics=dict(source.last_metrics))


def eval_datasets(args: Any) -> list[tuple[str, str]]:
    """(name, path) of slime's eval datasets: `args.eval_datasets` (slime >= 0.3) or the
    name/path pairs of --eval-prompt-data."""
    configs = getattr(args, "eval_datasets", None)
    if configs:
        return [(c.name, c.path) for c in configs]
    values = list(getattr(args, "eval_prompt_data", None) or [])
    if len(values) == 1:
        values = ["aime", values[0]]  # slime's legacy single path
    return [(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]


def evaluate(args: Any, rollout_id: int, source: RedisDataSource) -> Any:
    """An eval pass at `rollout_id` through `<ns>.eval`: push every eval dataset (once per
    rollout id; again when that pass was read already, as after a resume), wait for its
    groups, return slime's RolloutFnEvalOutput. It always returns: groups that were
    dead-lettered (or out past --rollout-batch-timeout) are left out, named in the log and
    counted in `eval/<name>/failed_groups`. Training groups are neither read nor committed;
    workers serve the eval prompts first."""
    datasets = eval_datasets(args)
    if not datasets:
        raise SlimeConfigError("evaluation needs eval datasets: --eval-prompt-data NAME PATH (or --eval-config)")
    n = int(getattr(args, "n_samples_per_eval_prompt", 1) or 1)
    passes = []
    for name, path in datasets:
        opts = PushOptions(input_key=getattr(args, "eval_input_key", None) or getattr(args, "input_key", "input"),
                           label_key=getattr(args, "eval_label_key", None) or getattr(args, "label_key", None),
                           metadata_key=getattr(args, "metadata_key", "metadata"), n_samples_per_prompt=n)
        passes.append(push_eval(source.client, source.settings.namespace, path, name, f"rollout{rollout_id}", opts))
    results = read_eval(source.client, source.settings.namespace, passes, timeout=source.settings.timeout)
    reward_key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
    types = source.types
    data, metrics = {}, {}
    for name, _ in datasets:
        result = results[name]
        source._fill_texts(result.samples)  # the workers keep eval texts; a tokenizer fills older ones
        data[name] = {"rewards": result.rewards(reward_key), "truncated": result.truncated(),
                      "samples": [to_slime_sample(s, types) for s in result.samples]}
        metrics[f"eval/{name}/failed_groups"] = len(result.failed)
        if result.failed:
            named = "; ".join(f"{gid}: {why}" for gid, why in sorted(result.failed.items())[:5])
            log.error("eval %s at rollout %d: %d of %d groups could not be evaluated (%s)", name, rollout_id,
                      len(result.failed), len(result.failed) + len(result.groups), named)
    return types.eval_output(data=data, metrics=metrics)
