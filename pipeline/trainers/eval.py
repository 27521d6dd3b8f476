"""Evaluation passes through a companion namespace, `<ns>.eval`.

An eval pass pushes its prompts to `<ns>.eval` (its own prompt list, results stream,
trainer session and audit) and reads back exactly the groups it pushed. Workers of
`<ns>` register in both namespaces and claim from `.eval` first whenever it has
prompts, so an eval pass is served ahead of training without taking a training group
or touching the training namespace's books (docs/architecture.md, "Evaluation").
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import redis

from pipeline.consumer import BatchTimeout, Consumer
from pipeline.keys import eval_namespace
from pipeline.producer import PushOptions, group_id, load_dataset, push_dataset
from pipeline.queue import Queue
from pipeline.types import Group, Status

log = logging.getLogger(__name__)

EVAL_CONSUMER = "eval"
EVAL_POLL_S = 1.0  # while waiting for a pass, look for its groups that cannot come back this often


@dataclass
class EvalResult:
    """One dataset's finished eval groups, samples in index order."""

    name: str
    groups: list[Group] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # group id -> why it could not be evaluated

    @cached_property
    def samples(self) -> list:  # read_eval fills `groups` before anyone reads this
        return sorted((s for g in self.groups for s in g.samples), key=lambda s: (s.index is None, s.index or 0))

    def rewards(self, reward_key: str | None = None) -> list:
        return [s.reward[reward_key] if reward_key and isinstance(s.reward, dict) else s.reward
                for s in self.samples]

    def truncated(self) -> list[bool]:
        return [s.status == Status.TRUNCATED for s in self.samples]

    def to_dict(self, reward_key: str | None = None) -> dict:
        """The stable `rollout eval results --json` object of one dataset."""
        rewards = [r for r in self.rewards(reward_key) if isinstance(r, (int, float))]
        return {"groups": len(self.groups), "samples": len(self.samples),
                "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                "truncated": sum(self.truncated())}


def pass_name(dataset: str, tag: str) -> str:
    """The producer's dataset name of one pass over `dataset`: each pass pushes every row
    again (a dataset's cursor is per name) and its groups carry the name."""
    return f"{dataset}@{tag}"


def dataset_of(group: Group) -> str:
    return group.dataset.rpartition("@")[0] or group.dataset


@dataclass
class EvalPass:
    """One pass over an eval dataset, as pushed: the groups to wait for."""

    name: str  # the pass's dataset name, `<dataset>@<tag>`
    group_ids: list[str]
    pushed: int  # pushed now (0: pushed already, e.g. by a trainer that died before reading it)


def _read_before(client: redis.Redis, queue: Queue, group_ids: list[str]) -> list[str]:
    """The ids committed already: read by an earlier reader of the same pass."""
    pipe = client.pipeline(transaction=False)
    for gid in group_ids:
        pipe.zscore(queue.keys.committed, gid)
    return [gid for gid, score in zip(group_ids, pipe.execute()) if score is not None]


def push_eval(client: redis.Redis, namespace: str, path: str | Path, name: str, tag: str,
              opts: PushOptions | None = None) -> EvalPass:
    """Push one pass over an eval dataset. A pass pushed before and not read yet (a trainer
    died before reading it) is read as it is; one that was read already (slime re-runs the
    eval of a rollout id after resuming from an older checkpoint) is pushed again under
    `<tag>~<n>`: group ids are pushed once, and those were committed."""
    opts = opts or PushOptions()
    queue = Queue(client, eval_namespace(namespace))
    data = load_dataset(path, opts)
    for attempt in itertools.count():
        opts.dataset_name = pass_name(name, tag if attempt == 0 else f"{tag}~{attempt}")
        ids = [group_id(opts.dataset_name, 0, epoch, row.index) for epoch in range(opts.epochs) for row in data.rows]
        if not _read_before(client, queue, ids):
            break
        log.info("eval pass %s was read already; pushing it again under a new tag", opts.dataset_name)
    report = push_dataset(queue, data, opts)
    log.info("eval pass %s: %d groups pushed to %s", opts.dataset_name, report.pushed, eval_namespace(namespace))
    return EvalPass(opts.dataset_name, ids, report.pushed)


def read_eval(client: redis.Redis, namespace: str, passes: list[EvalPass] | None,
              timeout: float | None = None) -> dict[str, EvalResult]:
    """Finished eval groups, committed once read, by dataset. With `passes`, until every
    group of those passes is back or cannot come back: dead-lettered, or read by an
    earlier reader (each named in `EvalResult.failed`); after `timeout` (for all of them)
    the ones still out are named too. Groups of other passes met meanwhile (an earlier
    pass nobody read) are committed and left out. Without `passes`, take what is
    finished, waiting up to `timeout` for each next group."""
    reader = Consumer(client, eval_namespace(namespace), consumer=EVAL_CONSUMER)
    if passes is None:
        return _read_finished(client, reader, timeout)
    wanted = {gid: p.name for p in passes for gid in p.group_ids}
    out: dict[str, EvalResult] = {}

    def result(pass_name_: str) -> EvalResult:
        name = pass_name_.rpartition("@")[0] or pass_name_
        return out.setdefault(name, EvalResult(name))

    for p in passes:
        result(p.name)
    deadline = None if timeout is None else time.monotonic() + timeout
    while wanted:
        ready = reader.call(client.xlen, reader.keys.results)
        want = max(1, min(len(wanted), ready))
        left = EVAL_POLL_S if deadline is None else max(0.0, min(EVAL_POLL_S, deadline - time.monotonic()))
        try:
            batch = reader.next_batch(want, timeout=left)
        except BatchTimeout:
            for gid, why in _cannot_come_back(client, reader.queue, list(wanted)).items():
                result(wanted.pop(gid)).failed[gid] = why
            if deadline is not None and time.monotonic() >= deadline:
                for gid in list(wanted):
                    result(wanted.pop(gid)).failed[gid] = f"not finished within {timeout:g}s"
            continue
        for group in batch.groups:
            if group.group_id not in wanted:
                log.warning("eval group %s belongs to no pass being read; committing it unread", group.group_id)
                continue
            result(wanted.pop(group.group_id)).groups.append(group)
        reader.commit(batch)
    return out


def _cannot_come_back(client: redis.Redis, queue: Queue, group_ids: list[str]) -> dict[str, str]:
    """group id -> why, for the groups that will never reach the results stream."""
    out = {gid: "read and committed by an earlier eval read" for gid in _read_before(client, queue, group_ids)}
    wanted = set(group_ids) - set(out)
    for entry in queue.iter_stream(queue.keys.dead, with_data=False):
        if entry.group_id in wanted:
            out[entry.group_id] = f"dead-lettered: {entry.error}"
    return out


def _read_finished(client: redis.Redis, reader: Consumer, timeout: float | None) -> dict[str, EvalResult]:
    out: dict[str, EvalResult] = {}
    while reader.call(client.xlen, reader.keys.results):
        try:
            batch = reader.next_batch(1, timeout=timeout)
        except BatchTimeout:
            return out
        for group in batch.groups:
            name = dataset_of(group)
            out.setdefault(name, EvalResult(name)).groups.append(group)
        reader.commit(batch)
    return out
