"""The trainer's side: exact-size batches from the results stream.

A trainer session has a random id that is never reissued (a generation counter is not
enough: a failover that loses the last writes hands the same number out twice).
Starting one (the first `next_batch`) fences every earlier session, here or in another
process: their reads and commits are refused from then on, and the new session takes
over, oldest first, every entry they had been delivered and not committed. Reads and
commits check the id inside their scripts, and a commit settles only entries delivered to this session, so two
trainers on one namespace never train the same group twice: the older one gets
`SessionFenced` naming the newer one.

`next_batch(n)` reads `COUNT n-have` at a time, so it never takes more than it needs:
the surplus stays undelivered. `commit()` acknowledges and deletes in one script;
`release()` hands back a batch whose step failed. Redis outages are waited out.

Every group delivered to a session, whichever way (read, taken over, handed back, held
across a version change), is screened here and judged by one `Judge` (pipeline/screening.py):
from a timeline the trainer left, refused by the trainer's own `check`, or too stale, it
goes back to be generated again, once, counted in the batch's metrics; refusals then end
the read with one `GroupsRefused`, after every refused group in the stream went back.

Every write (the session's start, each delivery, hand-back and settle, commits included)
goes through the Consumer's one pipeline.writer.Writer: fenced by its session, and with
`replicas=N` on N replicas before the call returns. A Controller or an adapter built on the
Consumer writes through the same writer (`consumer.writer`). The Consumer keeps a ledger of
the batches it handed out: only those, as handed out and not handed back, are committed.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import redis

from . import metrics as prom
from . import scripts
from .connection import socket_timeout_of
from .control import ControlState, read_control, set_weight_version
from .filters import FilterFn, apply_filter, load_filter
from .keys import CONSUMER_GROUP, check_name
from .queue import Queue, Settle, StreamEntry, text
from .retry import TRAINER_OUTAGE_LIMIT_S, Durability, Reconnect, RedisUnavailable
from .rewind import Mark, mark_admitted, read_marks
from .screening import BatchMetrics, GroupCheck, GroupsRefused, Judge, Refusal
from .types import DeadReason, Group, VersionClock
from .writer import ScriptCall, SessionFenced, TrainerSession, Writer

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
#: Deliveries of one results entry to the trainer without a commit (sessions that died
#: holding it, releases) before it is dead-lettered: a group that crashes the trainer
#: must not crash it forever.
DEFAULT_MAX_DELIVERIES = 5
#: How long next_batch waits for groups the filter keeps before it fills the batch with
#: rejected groups marked keep_when_insufficient (slime's "with fallback" filters).
DEFAULT_FALLBACK_WAIT_S = 30.0
#: Entries read per round when every entry left in the results stream is screened at once
#: (after a refusal).
SWEEP_PAGE = 256
#: What became of an entry this Consumer handed out (StreamEntry.fate), to tell a second commit
#: of a batch (counted once) from a commit of a batch it handed back (refused).
COMMITTED, HANDED_BACK = "committed", "handed back"

__all__ = ["Batch", "BatchMetrics", "BatchTimeout", "Consumer", "GroupCheck", "GroupsRefused", "Refusal",
           "SessionFenced", "UncommittableBatch"]


class BatchTimeout(TimeoutError):
    """next_batch gave up; the message says what the pipeline looked like."""


class UncommittableBatch(ValueError):
    """commit() of a batch this Consumer did not hand out as it is now: handed back (release,
    restart), or delivered by another Consumer. Nothing was committed."""


@dataclass
class Batch:
    groups: list[Group]
    entries: list[StreamEntry]
    weight_version: int
    metrics: BatchMetrics
    batch_id: str = ""  # "<session>/<n>", recorded in each group's history at commit

    @property
    def entry_ids(self) -> list[str]:
        return [e.entry_id for e in self.entries]

    def __len__(self) -> int:
        return len(self.groups)


@dataclass
class _Held:
    entry: StreamEntry
    group: Group
    rejected: str = ""  # the filter's reason, for a group held only as a fallback


class Consumer:
    """Reads exact batches for one trainer. One session per Consumer, started by the
    first next_batch; a new session (this process restarted, or another trainer)
    gets back first what earlier ones left uncommitted."""

    def __init__(self, client: redis.Redis, namespace: str, consumer: str = "trainer",
                 filter: FilterFn | str | None = None, filter_args: Any = None, stale_policy: str = "restart",
                 max_restarts: int = DEFAULT_MAX_RESTARTS, max_deliveries: int = DEFAULT_MAX_DELIVERIES,
                 block_s: float = 1.0, fallback_wait_s: float = DEFAULT_FALLBACK_WAIT_S,
                 outage_limit_s: float | None = TRAINER_OUTAGE_LIMIT_S, replicas: int = 0,
                 replica_timeout_s: float = 5.0, check: GroupCheck | None = None):
        check_name("consumer name", consumer)  # part of every session's name, and of each group's history
        self.queue = Queue(client, namespace)
        self.redis = client
        self.keys = self.queue.keys
        self.name = consumer
        self.filter = load_filter(filter) if isinstance(filter, str) else filter
        self.filter_args = filter_args
        self.judge = Judge(stale_policy, max_restarts, check)
        # Counted by screens outside next_batch (hand-backs, commit_trained): in the next batch's metrics.
        self._screened = BatchMetrics()
        self.max_deliveries = max_deliveries
        self.fallback_wait_s = fallback_wait_s
        # Stay under the socket timeout, or a long BLOCK reads as a dead connection.
        sock = socket_timeout_of(client)
        self.block_s = min(block_s, sock / 2) if sock else block_s
        # Every Redis call of this consumer (and of the adapters built on it) goes through
        # here: outages up to outage_limit_s are waited out, then RedisUnavailable.
        self.reconnect = Reconnect(f"trainer {consumer}", limit_s=outage_limit_s)
        # Every write: fenced by this Consumer's session, and returned once `replicas`
        # replicas have it, so a failover cannot forget a delivery or a commit the trainer
        # acted on (docs/operations.md, Durability). 0: the primary's word is enough.
        self.writer = Writer(client, self.keys, Durability(replicas, replica_timeout_s), self.reconnect, consumer)
        self._scripts = scripts.load(client, "session", "read", "redeliver")
        self._held: list[_Held] = []  # delivered to this session, not yet in a batch
        self._fallback: list[_Held] = []  # rejected by the filter, kept if the batch cannot fill
        # The ledger: entry id -> the very entry handed out in a batch and not settled since (a
        # batch is committed only with these); what became of the others is on them (fate).
        self._uncommitted: dict[str, StreamEntry] = {}
        self._held_version: int | None = None  # weight version _held was last screened at
        self._batches = 0
        self._last_reap = 0.0

    # -- the session -------------------------------------------------------------------

    @property
    def session(self) -> TrainerSession | None:
        """This Consumer's trainer session (None before its first batch): its writer's fence."""
        return self.writer.session

    @property
    def durability(self) -> Durability:
        return self.writer.durability

    def _start_session(self, deadline: float | None, batch: int | None = None) -> None:
        # `batch`: what the trainer asks for, so `rollout configure --max-ready` can say when
        # a limit would hold its batches forever.
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "name": self.name, "batch": batch})
        session_id = TrainerSession.new_id()
        # A start a failover forgot would leave an earlier session current, which fences this
        # one: the writer waits for the replicas, and a retry under the same id finds it made.
        start = ScriptCall(self._scripts["session"], [self.keys.trainer, self.keys.results],
                           [CONSUMER_GROUP, self.name, info, session_id])
        generation, consumer, taken = self.writer.write(f"start of trainer session {session_id}", [start],
                                                        deadline)[0]
        self.writer.session = TrainerSession(text(consumer), int(generation), session_id)
        self.reconnect.what = f"trainer session {self.session.consumer}"
        if int(taken):
            log.info("trainer session %s: took over %d entries delivered to earlier sessions and not committed",
                     self.session.consumer, int(taken))

    def _own_pending(self, deadline: float | None) -> list[tuple[StreamEntry, int]]:
        """Every entry pending for this session, oldest first, with its delivery count."""
        out: list[tuple[StreamEntry, int]] = []
        start = "-"
        while True:
            rows = self.call(self.redis.xpending_range, self.keys.results, CONSUMER_GROUP, min=start, max="+",
                              count=500, consumername=self.session.consumer, deadline=deadline)
            if not rows:
                return out
            counts = {text(r["message_id"]): int(r["times_delivered"]) for r in rows}
            ids = list(counts)
            fetched = self.call(self._fetch, ids, deadline=deadline)
            out += [(e, counts[e.entry_id]) for e in fetched]
            if len(rows) < 500:
                return out
            start = "(" + ids[-1]

    def _fetch(self, ids: list[str]) -> list[StreamEntry]:
        pipe = self.redis.pipeline(transaction=False)
        for eid in ids:
            pipe.xrange(self.keys.results, eid, eid)
        rows = [r[0] for r in pipe.execute() if r]
        return self.queue.entries(self.keys.results, rows)

    def call(self, fn, *args, deadline: float | None = None, **kwargs):
        """fn(*args, **kwargs), a Redis read, retried through outages (up to `deadline` and
        the outage limit, then RedisUnavailable). The adapters built on a Consumer make their
        reads here; their writes go through `writer`."""
        return self.reconnect.call(fn, *args, deadline=deadline, **kwargs)

    # -- screening -----------------------------------------------------------------------

    def _settle(self, items: list[Settle], deadline: float | None = None) -> tuple[int, int]:
        return self.writer.settle(self.keys.results, items, deadline)

    def _screen(self, entries: list[tuple[StreamEntry, int]], control: ControlState, metrics: BatchMetrics,
                deadline: float | None) -> None:
        """Keep what may be trained on; settle the rest (malformed, duplicate, delivered too
        often, then as the judge says, then filtered). `entries` come with their delivery counts."""
        if not entries:
            return
        settle: list[Settle] = []
        counted = (metrics.abandoned, metrics.ahead)
        gids = [e.group_id or "?" for e, _ in entries]
        scores, marks = self.call(self._committed_and_marks, gids, deadline=deadline)
        seen = ({h.group.group_id for h in self._held + self._fallback}
                | {e.group_id for e in self._uncommitted.values()})
        candidates: list[tuple[StreamEntry, Group, Mark | None]] = []
        for (entry, deliveries), committed_at, mark in zip(entries, scores, marks):
            if committed_at is not None or entry.group_id in seen:
                log.warning("group %s: already trained on or held; dropping duplicate entry %s",
                            entry.group_id, entry.entry_id)
                settle.append(Settle("duplicate", entry.entry_id, entry.group_id, token=entry.token))
                metrics.duplicates += 1
                continue
            group, dead = entry.decode_or_dead("results")
            if dead:
                dead.token = entry.token
                settle.append(dead)
                metrics.dead += 1
                continue
            if deliveries > self.max_deliveries:
                error = (f"delivered {deliveries} times to the trainer without a commit (it may crash the "
                         f"trainer's step); `rollout dead retry` sends it back")
                log.error("group %s: %s; dead-lettering it", group.group_id, error)
                settle.append(Settle("dead", entry.entry_id, group.group_id, error, entry.data, entry.token,
                                     DeadReason.DELIVERIES))
                metrics.dead += 1
                continue
            seen.add(group.group_id)
            candidates.append((entry, group, mark))
        refusals = self.judge.refusals([g for _, g, _ in candidates])
        for (entry, group, mark), refusal in zip(candidates, refusals):
            judged = self.judge.judge(entry, group, mark, refusal, control, metrics)
            if judged is not None:
                settle.append(judged)
                continue
            if self.filter is not None:
                try:
                    verdict = apply_filter(self.filter, self.filter_args, group)
                except Exception as exc:  # the trainer's own code: one bad group must not stop training
                    error = f"filter raised {type(exc).__name__}: {exc}"
                    log.exception("group %s: %s; dead-lettering it", group.group_id, error)
                    settle.append(Settle("dead", entry.entry_id, group.group_id, error, entry.data, entry.token,
                                         DeadReason.FILTER))
                    metrics.dead += 1
                    continue
                if verdict.fallback:
                    self._fallback.append(_Held(entry, group, verdict.reason))
                    continue
                if not verdict.keep:
                    settle.append(Settle("drop", entry.entry_id, group.group_id, verdict.reason, token=entry.token))
                    metrics.dropped[verdict.reason] = metrics.dropped.get(verdict.reason, 0) + 1
                    continue
            self._held.append(_Held(entry, group))
        self._settle(settle, deadline)
        self._forget_marks([gid for gid, mark in zip(gids, marks) if mark is not None])
        self.judge.report(metrics.abandoned - counted[0], metrics.ahead - counted[1], control)

    def _committed_and_marks(self, group_ids: list[str]) -> tuple[list, list[Mark | None]]:
        """Which of these groups were committed already, and their rewind marks (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zmscore(self.keys.committed, group_ids)
        pipe.hmget(self.keys.abandoned, group_ids)
        scores, marks = pipe.execute()
        return scores, [Mark.decode(m) for m in marks]

    def _forget_marks(self, group_ids: list[str]) -> None:
        """The delivered copies of these marked groups were judged (after their settle: a
        crash in between regenerates a group once more, never trains it)."""
        self.writer.records(self.keys.abandoned, delete=group_ids, what="rewind marks judged")

    def _refuse(self, control: ControlState, metrics: BatchMetrics, deadline: float | None) -> None:
        """Groups were refused: screen every entry left in the results stream as well, so
        every group the same cause made goes back now (the rest stay held), then raise once."""
        while entries := self._read(SWEEP_PAGE, deadline)[0]:
            self._screen([(e, 1) for e in entries], control, metrics, deadline)
        refused, self.judge.refused = self.judge.refused, []
        raise GroupsRefused(refused, metrics)

    def _recheck_held(self, control: ControlState, metrics: BatchMetrics, deadline: float | None) -> None:
        """Held groups were judged at an earlier weight version (a recovered surplus, or
        groups read before a timeout): if the version moved on or went back, judge them again."""
        if control.weight_version == self._held_version:
            return
        self._held_version = control.weight_version
        if not self._held:
            return
        gids = [h.group.group_id for h in self._held]
        counted = (metrics.abandoned, metrics.ahead)
        marks = self.call(read_marks, self.redis, self.keys, gids, deadline=deadline)
        keep, settle = [], []
        for h, mark in zip(self._held, marks):
            judged = self.judge.judge(h.entry, h.group, mark, None, control, metrics)
            if judged is None:
                keep.append(h)
            else:
                settle.append(judged)
        self._held = keep
        self._settle(settle, deadline)
        self._forget_marks([gid for gid, mark in zip(gids, marks) if mark is not None])
        self.judge.report(metrics.abandoned - counted[0], metrics.ahead - counted[1], control)

    def set_weight_version(self, version: int, *, restart_budget: bool = False, rollback: bool = False) -> None:
        """The trainer's weight version (pipeline.control.set_weight_version, through this
        consumer's writer: fenced, on its replicas); behind the recorded one only with
        `rollback`. On the queue's clock, a trainer's (re)start (`restart_budget`) or a lower
        version than the last marks every group admitted so far: one admitted after `version`
        is from a timeline the trainer left (pipeline/rewind.py)."""
        before = self.call(read_control, self.redis, self.keys)
        set_weight_version(self.redis, self.keys, version, restart_budget=restart_budget, rollback=rollback,
                           writer=self.writer)
        if before.version_clock == VersionClock.QUEUE and (restart_budget or version < before.weight_version):
            marked = mark_admitted(self.redis, self.keys, version, self.writer, self.call)
            log.info("the queue's clock is at version %d (it was at %d): %d groups admitted so far are marked; a "
                     "copy admitted after %d is generated again when delivered", version, before.weight_version,
                     marked, version)

    # -- batches -------------------------------------------------------------------------

    def _check_batch_size(self, n: int, control: ControlState) -> None:
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        # A batch's groups all wait in the results stream until it is committed, and workers
        # stop claiming at max_ready results: a batch past that limit could never fill.
        if n > control.max_ready:
            raise ValueError(f"next_batch({n}) could never fill: workers stop claiming once max_ready "
                             f"({control.max_ready}) results wait, and a batch's groups all wait until it is "
                             f"committed; ask for at most {control.max_ready}, or `rollout configure --max-ready {n}`")
        outstanding = len(self._uncommitted)
        if outstanding and n + outstanding > control.max_ready:
            raise ValueError(f"next_batch({n}) could never fill: {outstanding} groups of earlier batches are delivered "
                             f"and not committed, and with this batch's {n} they pass max_ready "
                             f"({control.max_ready}), where workers stop claiming; commit (or release) them first, or "
                             f"`rollout configure --max-ready {n + outstanding}`")
        if control.max_staleness is not None and control.batch_size and n != control.batch_size:
            raise ValueError(
                f"next_batch({n}) but the namespace paces admission for batches of {control.batch_size} "
                f"(max_staleness {control.max_staleness}: (η + version + 1) · B groups admitted); ask for "
                f"{control.batch_size} groups, or `rollout configure --batch-size {n}`")

    def _read(self, count: int, deadline: float | None) -> tuple[list[StreamEntry], str, int]:
        # A delivery is a write: with replicas, it returns once they have it, so a failover
        # cannot forget the delivery of a batch the trainer trains (it would be delivered
        # again). A retry after a lost reply reads on; _lost finds what the lost read took.
        read = ScriptCall(self._scripts["read"], [self.keys.results, self.keys.trainer],
                          [CONSUMER_GROUP, self.session.consumer, self.session.id, count])
        newest, pending, *rows = self.writer.write(f"delivery of up to {count} entries", [read], deadline)[0]
        rows = [(eid, dict(zip(flat[::2], flat[1::2]))) for eid, flat in rows]
        return self.call(self.queue.entries, self.keys.results, rows, deadline=deadline), text(newest), int(pending)

    def _wait_for_new(self, newest: str, block_s: float, deadline: float | None) -> None:
        """Block until an entry newer than `newest` arrives, or `block_s` passes. A plain
        XREAD: it delivers nothing, the read script does that under the fence."""
        self.call(self.redis.xread, {self.keys.results: newest}, count=1, block=max(1, int(block_s * 1000)),
                   deadline=deadline)

    def _reap(self, control: ControlState, deadline: float | None) -> None:
        """The trainer reaps dead workers too, so their groups come back even when no
        worker is left alive to do it."""
        if time.monotonic() - self._last_reap >= control.lease_s / 4:
            self._last_reap = time.monotonic()
            self.call(self.queue.reap_expired, deadline=deadline)

    def next_batch(self, n: int, timeout: float | None = None) -> Batch:
        """Exactly `n` groups, or BatchTimeout after `timeout` seconds (None: wait forever).
        Groups read before a timeout stay with this session for the next call. Raises
        SessionFenced when a newer trainer session took over."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        metrics, self._screened = self._screened, BatchMetrics()
        control = self.call(read_control, self.redis, self.keys, deadline=deadline)
        self._check_batch_size(n, control)
        if self.session is None:
            self._start_session(deadline, n)
            self._screen(self._own_pending(deadline), control, metrics, deadline)
            self._held_version = control.weight_version
        self._recheck_held(control, metrics, deadline)
        # At least one read per call, even when groups held from an earlier call fill the
        # batch: the read script is what checks this session is still current, and a
        # fenced session must not hand out groups its successor has taken over.
        confirmed = False
        while len(self._held) < n or not confirmed:
            remaining = None if deadline is None else deadline - time.monotonic()
            # Out of time: one last look without blocking, so groups that are already
            # there are taken rather than reported missing.
            expired = remaining is not None and remaining <= 0
            entries, newest, pending = self._read(max(0, n - len(self._held)), deadline)
            confirmed = True
            delivered = [(e, 1) for e in entries]
            if pending > len(self._held) + len(self._fallback) + len(self._uncommitted) + len(entries):
                # Delivered by the lost read, before this read's entries: first in the batch.
                delivered = self._lost(entries, deadline) + delivered
            if delivered:
                control = self.call(read_control, self.redis, self.keys, deadline=deadline)
                self._recheck_held(control, metrics, deadline)
                self._screen(delivered, control, metrics, deadline)
            if self.judge.refused:
                self._refuse(control, metrics, deadline)
            # With no wait (slime's rule: kept at once when what was read cannot fill the
            # batch), once a read finds nothing more to screen.
            waited = time.monotonic() - started >= self.fallback_wait_s
            if len(self._held) < n and self._fallback and waited and (self.fallback_wait_s > 0 or not delivered):
                take = self._fallback[:n - len(self._held)]
                self._fallback = self._fallback[len(take):]
                log.info("batch of %d: the filter kept %d groups in %.0fs; keeping %d it rejected but marked "
                         "keep_when_insufficient", n, len(self._held), time.monotonic() - started, len(take))
                self._held += take
                metrics.kept_insufficient += len(take)
            if len(self._held) >= n:
                break
            if expired:
                raise BatchTimeout(self.diagnose(n, len(self._held), timeout))
            if delivered:
                continue
            self._reap(control, deadline)
            block = self.block_s if remaining is None else max(0.001, min(self.block_s, remaining))
            if self._fallback:  # wake when the fallback groups may be taken
                block = max(0.001, min(block, started + self.fallback_wait_s - time.monotonic()))
            self._wait_for_new(newest, block, deadline)
        taken, self._held = self._held[:n], self._held[n:]
        self._drop_fallback(metrics, deadline)
        metrics.kept = n
        metrics.wait_s = time.monotonic() - started
        prom.TRAINER_WAIT.observe(metrics.wait_s)
        for reason, count in metrics.dropped.items():
            prom.FILTER_DROPS.labels(reason).inc(count)
        for h in taken:
            self._uncommitted[h.entry.entry_id] = h.entry
            lag = control.lag(h.group)
            metrics.staleness[lag] = metrics.staleness.get(lag, 0) + 1
            prom.STALENESS.observe(lag)
        self._batches += 1
        return Batch([h.group for h in taken], [h.entry for h in taken], control.weight_version, metrics,
                     f"{self.session.consumer}/{self._batches}")

    def _drop_fallback(self, metrics: BatchMetrics, deadline: float | None) -> None:
        """The batch filled without the rejected groups held as a fallback: drop them, as
        slime does when enough groups pass its filter."""
        if not self._fallback:
            return
        for h in self._fallback:
            metrics.dropped[h.rejected] = metrics.dropped.get(h.rejected, 0) + 1
        items = [Settle("drop", h.entry.entry_id, h.group.group_id, h.rejected, token=h.entry.token)
                 for h in self._fallback]
        self._fallback = []
        self._settle(items, deadline)

    def _lost(self, entries: list[StreamEntry], deadline: float | None) -> list[tuple[StreamEntry, int]]:
        """More entries are pending for this session than it knows of: a read whose reply
        was lost delivered them. They are in the session's own pending list."""
        known = ({h.entry.entry_id for h in self._held + self._fallback} | set(self._uncommitted)
                 | {e.entry_id for e in entries})
        lost = [(e, count) for e, count in self._own_pending(deadline) if e.entry_id not in known]
        if lost:
            log.warning("trainer session %s: %d entries were delivered by a read whose reply was lost; "
                        "taking them now", self.session.consumer, len(lost))
        return lost

    def commit(self, batch: Batch, timeout: float | None = 300.0) -> int:
        """Acknowledge and delete a batch after the training step succeeded. Raises
        SessionFenced if a newer trainer session took over (it trains these groups), and
        UncommittableBatch for a batch this Consumer did not hand out as it is (released,
        sent back, or another Consumer's). A batch committed already counts again, once."""
        handed_out = self._handed_out(batch)
        if len(handed_out) < len(batch.entries) and not self._refuse_commit(batch, handed_out):
            return len(batch.entries)  # committed by an earlier call
        deadline = None if timeout is None else time.monotonic() + timeout
        # By the batch's own entries, never by `batch.groups`: a trainer may sort or filter
        # that list, and pairing it with the entries would settle one group's entry under
        # another's id (orphaning payloads in the audit).
        items = [Settle("commit", e.entry_id, e.group_id, batch.batch_id, token=e.token) for e in batch.entries]
        try:
            # The writer's reply is the confirmation: settled now or committed already, on
            # the primary its replica wait ran on (a commit a failover forgot is made again
            # there, or refused as FENCED if a newer session took the batch over).
            settled, already = self._settle(items, deadline)
        except RedisUnavailable as exc:
            raise RedisUnavailable(f"{exc}; batch {batch.batch_id} is not committed: call commit() with it again "
                                   f"once Redis is back (a commit is idempotent)") from exc
        self._forget(batch.entries, COMMITTED)
        if settled + already != len(items):
            raise RuntimeError(f"commit of batch {batch.batch_id}: {len(items) - settled - already} of "
                               f"{len(items)} entries are no longer this session's (settled elsewhere)")
        return settled + already

    def _handed_out(self, batch: Batch) -> list[StreamEntry]:
        """The batch's entries as this Consumer handed them out and has not settled since: the
        very objects (a batch handed back and delivered again is a new batch of new entries)."""
        return [e for e in batch.entries if self._uncommitted.get(e.entry_id) is e]

    def _refuse_commit(self, batch: Batch, handed_out: list[StreamEntry]) -> bool:
        """For a batch not all handed out now: raise UncommittableBatch unless every entry
        that is not was committed by this Consumer (then True: commit the rest)."""
        mine = {e.entry_id for e in handed_out}
        others = [e for e in batch.entries if e.entry_id not in mine]
        if {e.fate for e in others} == {COMMITTED}:
            return bool(handed_out)
        back = [e.group_id for e in others if e.fate == HANDED_BACK]
        if back:
            raise UncommittableBatch(
                f"batch {batch.batch_id}: {len(back)} of its groups ({', '.join(back[:3])}) were handed back "
                f"(release or restart), so it cannot be committed; they come again in a later batch: train and "
                f"commit that one")
        session = f"trainer session {self.session.consumer}" if self.session else "no batch delivered yet"
        raise UncommittableBatch(
            f"batch {batch.batch_id} was not delivered by this consumer ({session}): commit a batch through the "
            f"Consumer whose next_batch returned it; a batch of a replaced session is delivered again to its "
            f"successor")

    def _forget(self, entries: list[StreamEntry], fate: str) -> None:
        """Out of the ledger's handed-out entries, each marked with what became of it."""
        for e in entries:
            if self._uncommitted.get(e.entry_id) is e:
                del self._uncommitted[e.entry_id]
            e.fate = fate

    def commit_trained(self, entry_ids: set[str], batch_id: str) -> int:
        """Commit entries delivered to earlier sessions that their trainer did train (a
        checkpoint it saved includes them), instead of delivering them again. Call it before
        the first next_batch: it starts the session, which takes the rest over as usual."""
        if self.session is not None:
            raise ValueError("commit_trained: call it before this consumer's first batch")
        control = self.call(read_control, self.redis, self.keys)
        self._start_session(None)
        pending = self._own_pending(None)
        trained = [(e, n) for e, n in pending if e.entry_id in entry_ids]
        items = [Settle("commit", e.entry_id, e.group_id, batch_id, token=e.token) for e, _ in trained]
        settled, already = self._settle(items)
        self._screen([(e, n) for e, n in pending if e.entry_id not in entry_ids], control, self._screened, None)
        self._held_version = control.weight_version
        return settled + already

    def release(self, batch: Batch, error: str = "") -> None:
        """Hand back a batch whose training step failed: its groups come first in the
        next batches of this session (or of the next session, if this one dies). Each
        release counts as a delivery; an entry past max_deliveries is dead-lettered. The
        batch cannot be committed any more; the groups' next batch can."""
        if self.session is None:
            raise ValueError("release: this consumer has not delivered any batch")
        handed_out = self._handed_out(batch)
        ids = [e.entry_id for e in handed_out]
        if not ids:
            return
        log.warning("trainer session %s: batch %s handed back%s", self.session.consumer, batch.batch_id,
                    f" ({error})" if error else "")
        # Claimed again by this session, which counts the delivery: a batch that keeps
        # failing ends in dead letters instead of failing the trainer forever.
        redeliver = ScriptCall(self._scripts["redeliver"], [self.keys.results, self.keys.trainer],
                               [CONSUMER_GROUP, self.session.consumer, self.session.id, *ids])
        counts = self.writer.write(f"hand-back of batch {batch.batch_id}", [redeliver])[0]
        # Copies: the next batch holds other objects than the batch handed back, which stays
        # uncommittable (_handed_out compares the very entries).
        released = [(replace(e), int(c)) for e, c in zip(handed_out, counts) if int(c)]
        self._forget(handed_out, HANDED_BACK)
        held, self._held = self._held, []
        control = self.call(read_control, self.redis, self.keys)
        self._screen(released, control, self._screened, None)
        self._held += held

    # -- diagnosis -------------------------------------------------------------------

    def diagnose(self, n: int, have: int, timeout: float | None) -> str:
        """Why no batch: one line a person at 3 a.m. can act on."""
        return self.call(self._diagnose, n, have, timeout)

    def _diagnose(self, n: int, have: int, timeout: float | None) -> str:
        k = self.keys
        control = read_control(self.redis, k)
        workers = self.queue.workers()
        live = [w for w, left in workers.items() if left >= 0]
        prompts = self.redis.llen(k.prompts)
        requeue = self.redis.xlen(k.requeue)
        dead = self.redis.xlen(k.dead)
        ready = self.redis.xlen(k.results)
        reasons = []
        if control.paused:
            reasons.append("admission is paused (run `rollout resume`)")
        if n > control.max_ready:
            reasons.append(f"the batch of {n} is larger than max_ready ({control.max_ready}), where workers stop "
                           f"claiming: it can never fill (`rollout configure --max-ready {n}`)")
        elif ready >= control.max_ready:
            reasons.append(f"the results backlog is at max_ready ({ready} of {control.max_ready} results waiting, "
                           f"{len(self._uncommitted)} of them delivered to this trainer and not committed): workers "
                           f"claim nothing until batches are committed, or `rollout configure --max-ready` raises it")
        if not live:
            if workers:
                reasons.append(f"no live workers ({len(workers)} registered, lease expired)")
            else:
                reasons.append("no live workers (none registered)")
        else:
            states = Counter()
            for raw in self.redis.hmget(k.worker_info, live):
                try:
                    states[json.loads(raw).get("state", "unknown") if raw else "unknown"] += 1
                except (ValueError, AttributeError):
                    states["unknown"] += 1
            reasons.append(f"{len(live)} live workers (" + ", ".join(f"{c} {s}" for s, c in states.items()) + ")")
        if prompts == 0:
            reasons.append("the prompt list is empty (push more with `rollout push`)")
        else:
            reasons.append(f"{prompts} prompts queued")
        if requeue:
            reasons.append(f"{requeue} aborted group{'' if requeue == 1 else 's'} wait{'s' if requeue == 1 else ''} "
                           "in the requeue stream")
        if dead:
            reasons.append(f"{dead} dead letter{'' if dead == 1 else 's'}")
        limit = control.staleness_limit
        if limit is not None and control.admitted >= limit:
            bump = ("the slime adapter sets it to the rollout id it reads" if control.version_clock == VersionClock.QUEUE
                    else "Controller.resume(weight_version=...) after each step")
            reasons.append(
                f"the staleness budget is spent ({control.admitted}/{limit} admitted at version "
                f"{control.weight_version}, {control.committed} committed): admission reopens when the weight "
                f"version moves on, one bump per {control.batch_size} committed groups ({bump})")
        waited = "" if timeout is None else f" after {timeout:g}s"
        return f"next_batch({n}) timed out{waited} with {have} of {n} groups: " + "; ".join(reasons)
