"""The trainer's side: exact-size batches from the results stream.

`next_batch(n)` loops `XREADGROUP COUNT n-have BLOCK`, so it never takes more than
it needs: the surplus stays undelivered for the next step. Entries that were
delivered to this consumer but not committed (the trainer died mid-step) are read
again first. `commit()` acknowledges and deletes in one script.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from . import metrics as prom
from .codec import encode_group
from .connection import socket_timeout_of
from .control import ControlState, read_control
from .filters import FilterFn, apply_filter, load_filter
from .keys import CONSUMER_GROUP
from .queue import DEFAULT_LEASE_S, Queue, Settle, StreamEntry, reset_group
from .types import Group

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3


class BatchTimeout(TimeoutError):
    """next_batch gave up; the message says what the pipeline looked like."""


@dataclass
class BatchMetrics:
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> count
    restarted: int = 0  # too stale, sent back to the prompt list
    dead: int = 0  # malformed, or too stale too often
    duplicates: int = 0
    wait_s: float = 0.0
    staleness: dict[int, int] = field(default_factory=dict)  # lag in versions -> groups

    @property
    def drop_ratio(self) -> float:
        dropped = sum(self.dropped.values())
        return dropped / (dropped + self.kept) if dropped + self.kept else 0.0


@dataclass
class Batch:
    groups: list[Group]
    entry_ids: list[str]
    weight_version: int
    metrics: BatchMetrics

    def __len__(self) -> int:
        return len(self.groups)


class Consumer:
    """Reads exact batches for one trainer. Use one consumer name per trainer; a new
    session under the same name first gets back what the last one left uncommitted."""

    def __init__(self, client: redis.Redis, namespace: str, consumer: str = "trainer",
                 lease_s: float = DEFAULT_LEASE_S, filter: FilterFn | str | None = None,
                 filter_args: Any = None, stale_policy: str = "restart",
                 max_restarts: int = DEFAULT_MAX_RESTARTS, block_s: float = 1.0):
        if stale_policy not in ("restart", "drop"):
            raise ValueError(f"unknown stale_policy {stale_policy!r}: use restart or drop")
        self.queue = Queue(client, namespace, lease_s=lease_s)
        self.redis = client
        self.keys = self.queue.keys
        self.consumer = consumer
        self.filter = load_filter(filter) if isinstance(filter, str) else filter
        self.filter_args = filter_args
        self.stale_policy = stale_policy
        self.max_restarts = max_restarts
        # Stay under the socket timeout, or a long BLOCK reads as a dead connection.
        sock = socket_timeout_of(client)
        self.block_s = min(block_s, sock / 2) if sock else block_s
        self._held: list[tuple[StreamEntry, Group]] = []  # delivered to us, not yet in a batch
        self._uncommitted: dict[str, str] = {}  # entry id -> group id, handed out in a batch
        self._recovered = False
        self._held_version: int | None = None  # weight version _held was last screened at
        self.queue.ensure_consumer_group()

    # -- reading ---------------------------------------------------------------------

    def _read(self, start: str, count: int, block_ms: int | None) -> list[StreamEntry]:
        reply = self.redis.xreadgroup(CONSUMER_GROUP, self.consumer, {self.keys.results: start},
                                      count=count, block=block_ms)
        if not reply:
            return []
        _stream, rows = reply[0]
        # Pending entries deleted meanwhile come back with empty fields: entries() skips them.
        return self.queue.entries(self.keys.results, rows)

    def _recover(self) -> list[StreamEntry]:
        """Everything pending in the consumer group becomes ours: this consumer's own
        uncommitted entries and those of an earlier trainer under another name."""
        start = "0-0"
        while True:
            # Not JUSTID: redis-py drops the next cursor from JUSTID replies.
            next_start, _claimed, *_ = self.redis.xautoclaim(
                self.keys.results, CONSUMER_GROUP, self.consumer, min_idle_time=0, start_id=start, count=100)
            next_start = next_start.decode() if isinstance(next_start, bytes) else next_start
            if next_start == "0-0":
                break
            start = next_start
        entries, start = [], "0"
        while True:
            page = self._read(start, 500, None)
            if not page:
                return entries
            entries += page
            start = page[-1].entry_id

    def _screen(self, entries: list[StreamEntry], control: ControlState, metrics: BatchMetrics) -> None:
        """Keep what may be trained on; settle the rest (malformed, duplicate, stale, filtered)."""
        settle: list[Settle] = []
        scores = self.redis.zmscore(self.keys.committed, [e.group_id or "?" for e in entries]) if entries else []
        held_ids = {g.group_id for _, g in self._held} | set(self._uncommitted.values())
        for entry, committed_at in zip(entries, scores):
            if committed_at is not None or entry.group_id in held_ids:
                log.warning("group %s: already trained on or held; dropping duplicate entry %s",
                            entry.group_id, entry.entry_id)
                settle.append(Settle("duplicate", entry.entry_id, entry.group_id))
                metrics.duplicates += 1
                continue
            group, dead = entry.decode_or_dead("results")
            if dead:
                settle.append(dead)
                metrics.dead += 1
                continue
            lag = control.weight_version - (group.oldest_version() or 0)
            if control.max_staleness is not None and lag > control.max_staleness:
                settle.append(self._stale(entry, group, lag, control, metrics))
                continue
            if self.filter is not None:
                keep, reason = apply_filter(self.filter, self.filter_args, group)
                if not keep:
                    settle.append(Settle("drop", entry.entry_id, group.group_id, reason))
                    metrics.dropped[reason] = metrics.dropped.get(reason, 0) + 1
                    continue
            held_ids.add(group.group_id)
            self._held.append((entry, group))
        self.queue.settle(self.keys.results, settle, CONSUMER_GROUP)

    def _stale(self, entry: StreamEntry, group: Group, lag: int, control: ControlState,
               metrics: BatchMetrics) -> Settle:
        reason = f"stale: {lag} versions behind (max {control.max_staleness})"
        if self.stale_policy == "drop":
            metrics.dropped["stale"] = metrics.dropped.get("stale", 0) + 1
            return Settle("drop", entry.entry_id, group.group_id, reason)
        if group.restarts >= self.max_restarts:
            log.error("group %s: %s after %d restarts; dead-lettering it", group.group_id, reason, group.restarts)
            metrics.dead += 1
            group.error = f"{reason}; restarted {group.restarts} times"
            return Settle("dead", entry.entry_id, group.group_id, group.error, encode_group(group))
        log.info("group %s: %s; restarting it from its prompt", group.group_id, reason)
        metrics.restarted += 1
        reset_group(group)
        group.restarts += 1
        # Generated again from the prompt, under at least the current version. (None would
        # let claim fill in the first admission's version from the admitted hash, and a
        # group whose samples carry no weight versions would be judged stale forever.)
        group.admitted_version = control.weight_version
        return Settle("prompt", entry.entry_id, group.group_id, payload=encode_group(group))

    def _recheck_held(self, control: ControlState, metrics: BatchMetrics) -> None:
        """Held groups were screened at an earlier weight version (a recovered surplus, or
        groups read before a timeout): if the version moved on, check staleness again
        before delivering them."""
        if control.weight_version == self._held_version:
            return
        self._held_version = control.weight_version
        if control.max_staleness is None or not self._held:
            return
        keep, settle = [], []
        for entry, group in self._held:
            lag = control.weight_version - (group.oldest_version() or 0)
            if lag > control.max_staleness:
                settle.append(self._stale(entry, group, lag, control, metrics))
            else:
                keep.append((entry, group))
        if settle:
            self._held = keep
            self.queue.settle(self.keys.results, settle, CONSUMER_GROUP)

    def next_batch(self, n: int, timeout: float | None = None) -> Batch:
        """Exactly `n` groups, or BatchTimeout after `timeout` seconds (None: wait forever).
        Groups read before a timeout stay with this consumer for the next call."""
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        metrics = BatchMetrics()
        control = read_control(self.redis, self.keys)
        if not self._recovered:
            self._screen(self._recover(), control, metrics)
            self._recovered = True
            self._held_version = control.weight_version
        self._recheck_held(control, metrics)
        while len(self._held) < n:
            remaining = None if deadline is None else deadline - time.monotonic()
            # Out of time: one last look without blocking, so groups that are already
            # there are taken (timeout=0 polls) rather than reported missing.
            expired = remaining is not None and remaining <= 0
            block = self.block_s if remaining is None else max(0.001, min(self.block_s, remaining))
            entries = self._read(">", n - len(self._held), None if expired else int(block * 1000))
            if entries:
                control = read_control(self.redis, self.keys)
                self._recheck_held(control, metrics)
                self._screen(entries, control, metrics)
            if expired and len(self._held) < n:
                raise BatchTimeout(self.diagnose(n, len(self._held), timeout))
        taken, self._held = self._held[:n], self._held[n:]
        metrics.kept = n
        metrics.wait_s = time.monotonic() - started
        prom.TRAINER_WAIT.observe(metrics.wait_s)
        for reason, count in metrics.dropped.items():
            prom.FILTER_DROPS.labels(reason).inc(count)
        for entry, group in taken:
            self._uncommitted[entry.entry_id] = group.group_id
            lag = control.weight_version - (group.oldest_version() or 0)
            metrics.staleness[lag] = metrics.staleness.get(lag, 0) + 1
            prom.STALENESS.observe(lag)
        return Batch([g for _, g in taken], [e.entry_id for e, _ in taken], control.weight_version, metrics)

    def commit(self, batch: Batch) -> int:
        """Acknowledge and delete a batch after the training step succeeded."""
        items = [Settle("commit", eid, g.group_id) for eid, g in zip(batch.entry_ids, batch.groups)]
        done = self.queue.settle(self.keys.results, items, CONSUMER_GROUP)
        for eid in batch.entry_ids:
            self._uncommitted.pop(eid, None)
        if done != len(items):
            log.warning("commit: %d of %d entries were already settled", len(items) - done, len(items))
        return done

    # -- diagnosis -------------------------------------------------------------------

    def diagnose(self, n: int, have: int, timeout: float | None) -> str:
        """Why no batch: one line a person at 3 a.m. can act on."""
        k = self.keys
        control = read_control(self.redis, k)
        workers = self.queue.live_workers()
        prompts = self.redis.llen(k.prompts)
        requeue = self.redis.xlen(k.requeue)
        dead = self.redis.xlen(k.dead)
        reasons = []
        if control.paused:
            reasons.append("admission is paused (run `rollout resume`)")
        if not workers:
            last = self.redis.zrevrange(k.workers, 0, 0, withscores=True)
            if last:
                seconds, micros = self.redis.time()
                ago = (seconds * 1000 + micros // 1000 - last[0][1]) / 1000
                reasons.append(f"no live workers (last heartbeat {ago:.0f}s ago)")
            else:
                reasons.append("no live workers (none has ever registered)")
        else:
            states = Counter()
            for raw in self.redis.hmget(k.worker_info, list(workers)):
                try:
                    states[json.loads(raw).get("state", "unknown") if raw else "unknown"] += 1
                except (ValueError, AttributeError):
                    states["unknown"] += 1
            reasons.append(f"{len(workers)} live workers (" + ", ".join(f"{c} {s}" for s, c in states.items()) + ")")
        if prompts == 0:
            reasons.append("the prompt list is empty (push more with `rollout push`)")
        else:
            reasons.append(f"{prompts} prompts queued")
        if requeue:
            reasons.append(f"{requeue} aborted groups wait in the requeue stream")
        if dead:
            reasons.append(f"{dead} dead letters")
        if control.max_staleness is not None and control.batch_size:
            budget = (control.max_staleness + control.weight_version + 1) * control.batch_size
            if control.admitted >= budget:
                reasons.append(f"the staleness budget is spent ({control.admitted}/{budget} admitted at "
                               f"version {control.weight_version}; bump the weight version)")
        waited = "" if timeout is None else f" after {timeout:g}s"
        return f"next_batch({n}) timed out{waited} with {have} of {n} groups: " + "; ".join(reasons)
