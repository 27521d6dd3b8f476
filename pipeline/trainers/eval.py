"""Evaluation passes through a companion namespace, `<ns>.eval`.

An eval pass pushes its prompts to `<ns>.eval` (its own prompt list, results stream,
trainer session and audit) and reads back exactly the groups it pushed. Workers of
`<ns>` register in both namespaces and claim from `.eval` first whenever it has
prompts, so an eval pass is served ahead of training without taking a training group
or touching the training namespace's books (docs/architecture.md, "Evaluation").
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import redis

from pipeline.consumer import BatchTimeout, Consumer
from pipeline.keys import eval_namespace
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Queue
from pipeline.types import Group, Status

log = logging.getLogger(__name__)

EVAL_CONSUMER = "eval"


@dataclass
class EvalResult:
    """One dataset's finished eval groups, samples in index order."""

    name: str
    groups: list[Group] = field(default_factory=list)

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


def push_eval(client: redis.Redis, namespace: str, path: str | Path, name: str, tag: str,
              opts: PushOptions | None = None) -> int:
    """Push one pass over an eval dataset; returns the groups pushed (0 when this pass was
    pushed already, e.g. by a trainer that died before reading it)."""
    opts = opts or PushOptions()
    opts.dataset_name = pass_name(name, tag)
    report = push_dataset(Queue(client, eval_namespace(namespace)), path, opts)
    log.info("eval pass %s: %d groups pushed to %s", opts.dataset_name, report.pushed, eval_namespace(namespace))
    return report.pushed + report.already


def read_eval(client: redis.Redis, namespace: str, passes: dict[str, int] | None,
              timeout: float | None = None) -> dict[str, EvalResult]:
    """Finished eval groups, committed once read, by dataset. With `passes` (pass name ->
    groups pushed), wait until every group of those passes is back; groups of other passes
    met meanwhile (an earlier pass nobody read) are committed and left out; `timeout` is
    for all of them. Without, take what is finished, waiting up to `timeout` for each next
    group."""
    reader = Consumer(client, eval_namespace(namespace), consumer=EVAL_CONSUMER)
    wanted = dict(passes or {})
    out: dict[str, EvalResult] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if passes is None:
            if not reader.call(client.xlen, reader.keys.results):
                return out
            want = 1
        else:
            want = sum(wanted.values())
            if want <= 0:
                return out
        left = timeout if passes is None else None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            batch = reader.next_batch(want, timeout=left)
        except BatchTimeout:
            if passes is None:
                return out
            raise
        for group in batch.groups:
            if passes is not None and wanted.get(group.dataset, 0) <= 0:
                log.warning("eval group %s belongs to no pass being read; committing it unread", group.group_id)
                continue
            if passes is not None:
                wanted[group.dataset] -= 1
            name = dataset_of(group)
            out.setdefault(name, EvalResult(name)).groups.append(group)
        reader.commit(batch)
