"""Where groups are and what happened to them: `rollout inspect GROUP_ID` and
`rollout status --worker W`.

`locate` reads every place a group can be in one atomic script (lua/locate.lua), with
its in-flight checkpoint while it is queued or in flight (per sample: tokens saved,
weight versions, status, age), then,
only if it is in none of them, searches the drop log newest first (a drop is final, so
that second step cannot race). Its history comes from the `history` hash: claims (with
their tokens), reaps, hand-backs, publishes, releases and the batch that trained it;
the label and each sample's status, reward (a dict reward as its function returned it) and
the attributes its generate function set come from the stored group
the last HISTORY_BYTES of it (lua/_prelude.lua), and dropped with the group when it is
dropped or discarded.

`worker_groups` lists what one worker (or every incarnation of it) holds: its in-flight
hash, how long each group has been held (the claim in its history), its claim count
and the attempts and restarts its stored payload carries.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from pipeline import scripts
from pipeline.checkpoints import CheckpointHeader, GroupCheckpoint
from pipeline.codec import DecodeError, decode_group
from pipeline.control import read_control
from pipeline.keys import CONSUMER_GROUP
from pipeline.queue import Queue, parse_history, text
from pipeline.types import Group
from pipeline.wording import counted

#: Entries of the drop log read per round trip while searching it.
DROP_LOG_PAGE = 1000


class GroupPlace(StrEnum):
    """Where `rollout inspect` finds a group."""

    PROMPTS = "prompts"  # queued, waiting for a worker
    INFLIGHT = "inflight"  # held by a worker
    REQUEUE = "requeue"  # aborted by a pause, partial output kept, back at the next resume
    RESULTS = "results"  # finished, waiting for (or delivered to) the trainer
    DEAD = "dead"  # a dead letter
    COMMITTED = "committed"  # trained on
    DROPPED = "dropped"  # dropped on purpose (filter, staleness), in the drop log
    NOWHERE = "nowhere"  # never pushed, or settled so long ago that nothing remembers it
    SEVERAL = "several"  # in more than one place: a conservation problem (`rollout audit`)


@dataclass
class Whereabouts:
    """One place a group is in; the fields that do not apply to the place are None."""

    place: GroupPlace
    age_s: float | None = None  # since it got there, where that is known
    position: int | None = None  # prompts: 0 is the next claimed
    worker: str | None = None  # inflight: its holder
    alive: bool | None = None  # inflight: whether the holder's lease still runs
    token: str | None = None  # inflight, results: the claim it is held or was published under
    entry_id: str | None = None  # requeue, results, dead, dropped: the stream entry
    session: str | None = None  # results: the trainer session it was delivered to (None: not delivered yet)
    current_session: bool | None = None  # results: whether that session is the trainer's current one
    deliveries: int | None = None  # results: times delivered to a trainer
    error: str | None = None  # dead: why
    reason: str | None = None  # dead, dropped: the short category (max_claims, missing_label, filter, ...)
    batch: str | None = None  # committed: the batch that trained it (from its history)


@dataclass
class Event:
    at_ms: int  # Redis server time
    age_s: float
    event: str  # claimed, reaped, handed_back, reconciled, published, released, committed, dead
    who: str  # the worker or trainer session
    detail: str  # claimed: the token; published: the place and token; committed: the batch


@dataclass
class SampleSummary:
    """One sample of the stored group: what `rollout inspect` shows of it."""

    index: int | None
    status: str
    response_length: int
    reward: Any  # a number, or the reward function's dict as it returned it
    attributes: list[str]  # names of the attributes its generate function set

    @classmethod
    def of(cls, s: Any) -> SampleSummary:
        return cls(s.index, s.status.value, s.response_length, s.reward, sorted(s.extras()))


@dataclass
class SampleCheckpoint:
    """One sample as the group's in-flight checkpoint holds it."""

    position: int  # in the group
    tokens: int  # response tokens saved
    weight_versions: list[str]  # of its engine calls so far
    status: str
    age_s: float  # since the write that last changed it


@dataclass
class CheckpointReport:
    """What an earlier or the current holder saved of a group while generating it."""

    writer: str  # the claim token of its last write
    records: int
    bytes: int
    tokens: int
    age_s: float  # since its last write
    samples: list[SampleCheckpoint]
    error: str | None = None  # its records do not decode (then no samples are shown)


@dataclass
class GroupReport:
    namespace: str
    group_id: str
    place: GroupPlace
    where: list[Whereabouts]
    claims: int  # claims since it last finished (a reap counts, a clean hand-back does not)
    max_claims: int
    admitted_version: int | None  # the weight version at its first claim, while it counts against the budget
    attempts: int | None  # engine and reward failures, from the stored group (None: not stored or unreadable)
    restarts: int | None
    n_samples: int | None
    label: Any = None  # the samples' label (any JSON value), from the stored group
    samples: list[SampleSummary] = field(default_factory=list)  # from the stored group (none once trained)
    history: list[Event] = field(default_factory=list)
    checkpoint: CheckpointReport | None = None  # its in-flight checkpoint, while queued or in flight

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The report as text, one line per fact, for `rollout inspect`."""
        from .status_render import age

        out = [f"group {self.group_id} (namespace {self.namespace})"]
        for w in self.where:
            out.append(f"  where      {_describe(w, age)}")
        if not self.where:
            out.append("  where      nowhere: never pushed to this namespace, or settled so long ago that nothing "
                       "remembers it")
        if len(self.where) > 1:
            out.append("  PROBLEM    it is in more than one place: run `rollout audit`")
        if self.claims or self.place in (GroupPlace.PROMPTS, GroupPlace.INFLIGHT, GroupPlace.REQUEUE):
            # Only of a group still to finish: a finished one's count starts again from 0.
            out.append(f"  claims     {self.claims} since it last finished (dead-lettered past {self.max_claims})")
        if self.attempts is not None:
            out.append(f"  attempts   {self.attempts}   restarts {self.restarts}   samples {self.n_samples}")
            out.append(f"  label      {_json(self.label)}")
        for s in self.samples:
            extra = f"   attributes {', '.join(s.attributes)}" if s.attributes else ""
            out.append(f"  sample {s.index}  {s.status}, {s.response_length} response tokens, reward "
                       f"{_json(s.reward)}{extra}")
        if self.checkpoint is not None:
            c = self.checkpoint
            out.append(f"  checkpoint {c.tokens:,} tokens in {c.records} records ({c.bytes:,} bytes), written "
                       f"{age(c.age_s)} ago under claim {c.writer}")
            if c.error:
                out.append(f"    unreadable: {c.error}")
            for sc in c.samples:
                versions = ",".join(sc.weight_versions) or "-"
                out.append(f"    sample {sc.position:<3} {sc.tokens:>7,} tokens  {sc.status:<10} versions {versions}  "
                           f"{age(sc.age_s)} ago")
        if self.history:
            out.append("  history")
            for e in self.history:
                out.append(f"    {age(e.age_s):>7} ago  {e.event:<11} {e.who}{'  ' + e.detail if e.detail else ''}")
        else:
            out.append("  history    none kept")
        return out


def _json(value: Any, limit: int = 200) -> str:
    """A label or reward on one line, as JSON, cut at `limit` characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _describe(w: Whereabouts, age) -> str:
    since = f" for {age(w.age_s)}" if w.age_s is not None else ""
    match w.place:
        case GroupPlace.PROMPTS:
            return f"prompts: queued, position {w.position} (0 is claimed next)"
        case GroupPlace.INFLIGHT:
            state = "alive" if w.alive else "not alive: its groups return at the next reap"
            return f"in flight: worker {w.worker} ({state}) holds it under claim {w.token}{since}"
        case GroupPlace.REQUEUE:
            return (f"requeue: aborted by a pause{since}; back to the prompts when admission reopens "
                    f"(entry {w.entry_id})")
        case GroupPlace.RESULTS:
            if w.session is None:
                return f"results: finished{since}, not delivered to a trainer yet (entry {w.entry_id})"
            current = "the current session" if w.current_session else "an earlier session"
            return (f"results: finished{since}, delivered {counted(w.deliveries or 0, 'time')}, pending with "
                    f"trainer session "
                    f"{w.session} ({current}), not committed yet (entry {w.entry_id})")
        case GroupPlace.DEAD:
            return f"dead letter{since} (entry {w.entry_id}): {w.error}"
        case GroupPlace.COMMITTED:
            return f"committed {age(w.age_s)} ago, in batch {w.batch or '(not recorded)'}"
        case _:
            return f"dropped {age(w.age_s)} ago: {w.reason} (entry {w.entry_id})"


def _inflight_workers(queue: Queue) -> tuple[dict[str, float], list[str]]:
    """Registered workers -> lease deadline (ms), and every worker id with an in-flight
    hash or a registration."""
    deadlines = {text(w): d for w, d in queue.redis.zrange(queue.keys.workers, 0, -1, withscores=True)}
    return deadlines, sorted(queue.inflight_holders() | set(deadlines))


def locate(queue: Queue, group_id: str) -> GroupReport:
    r, k = queue.redis, queue.keys
    script = scripts.load(r, "locate")["locate"]
    while True:
        deadlines, workers = _inflight_workers(queue)
        reply = script(keys=[k.prompts, k.payloads, k.workers, k.requeue, k.results, k.dead, k.committed, k.claims,
                             k.history, k.admitted, k.trainer, k.checkpoints, k.checkpoint_records,
                             *(k.inflight(w) for w in workers)],
                       args=[group_id, CONSUMER_GROUP, *workers])
        if text(reply) != "retry":
            break
    found = json.loads(reply[0].decode("utf-8", "replace"))
    now_ms = int(found["now_ms"])
    history = [Event(ms, round(max(0.0, now_ms - ms) / 1000, 3), event, who, detail)
               for ms, event, who, detail in parse_history(found["history"])]
    where = [_whereabouts(w, now_ms, deadlines, history, found["session"] or None) for w in found["where"] or []]
    payload = reply[1] or None
    results = [w for w in where if w.place == GroupPlace.RESULTS]
    if payload is None and results:
        payload = r.get(k.result(group_id, results[0].token or ""))
    if not where:
        dropped = _search_drop_log(queue, group_id, now_ms)
        where = [dropped] if dropped else []
    group = _decode(payload, group_id)
    admitted = found["admitted"]
    place = where[0].place if len(where) == 1 else GroupPlace.SEVERAL if where else GroupPlace.NOWHERE
    return GroupReport(
        namespace=k.namespace, group_id=group_id, place=place, where=where, claims=int(found["claims"]),
        max_claims=read_control(r, k).max_claims,
        admitted_version=int(admitted) if admitted else None,
        attempts=group.attempts if group else None, restarts=group.restarts if group else None,
        n_samples=group.n_samples if group else None,
        label=group.samples[0].label if group and group.samples else None,
        samples=[SampleSummary.of(s) for s in group.samples] if group else [], history=history,
        checkpoint=_checkpoint_report(reply[2], now_ms) if reply[2] else None)


def _whereabouts(raw: dict, now_ms: int, deadlines: dict[str, float], history: list[Event],
                 session: str | None) -> Whereabouts:
    place = GroupPlace(raw["place"])
    w = Whereabouts(place=place, token=raw.get("token"), entry_id=raw.get("entry_id"), error=raw.get("error"),
                    reason=raw.get("reason"))
    if w.entry_id:
        w.age_s = _age_s(now_ms, int(w.entry_id.split("-", 1)[0]))
    if place == GroupPlace.PROMPTS:
        w.position = int(raw["position"])
    elif place == GroupPlace.INFLIGHT:
        w.worker = raw["worker"]
        w.alive = deadlines.get(w.worker, -1) >= now_ms
        claimed = [e for e in history if e.event == "claimed" and e.who == w.worker and e.detail == w.token]
        w.age_s = claimed[-1].age_s if claimed else None
    elif place == GroupPlace.RESULTS and raw.get("session"):
        w.session, w.deliveries = raw["session"], int(raw["deliveries"])
        w.current_session = w.session == session
    elif place == GroupPlace.COMMITTED:
        w.age_s = _age_s(now_ms, int(raw["at_ms"]))
        batches = [e.detail for e in history if e.event == "committed"]
        w.batch = batches[-1] if batches else None
    return w


def _checkpoint_report(reply: list, now_ms: int) -> CheckpointReport:
    try:
        header = CheckpointHeader.parse(reply[0])
    except DecodeError as exc:
        return CheckpointReport("", 0, 0, 0, 0.0, [], error=str(exc))
    report = CheckpointReport(header.writer, header.records, header.bytes, header.tokens,
                              _age_s(now_ms, max(header.written_ms, default=now_ms)), [])
    try:
        checkpoint = GroupCheckpoint.from_reply(reply)
    except DecodeError as exc:
        report.error = str(exc)
        return report
    report.samples = [SampleCheckpoint(i, len(p.response_ids), list(p.weight_versions), p.status.value,
                                       _age_s(now_ms, p.updated_ms))
                      for i, p in sorted(checkpoint.samples.items())]
    return report


def _age_s(now_ms: int, then_ms: int) -> float:
    return round(max(0, now_ms - then_ms) / 1000, 3)


def _search_drop_log(queue: Queue, group_id: str, now_ms: int) -> Whereabouts | None:
    """The newest drop-log entry of the group, searched newest first."""
    r, key = queue.redis, queue.keys.dropped
    end = "+"
    while True:
        rows = r.xrevrange(key, end, "-", count=DROP_LOG_PAGE)
        for entry_id, fields in rows:
            if text(fields.get(b"gid")) == group_id:
                eid = text(entry_id)
                return Whereabouts(place=GroupPlace.DROPPED, entry_id=eid, reason=text(fields.get(b"reason")),
                                   age_s=_age_s(now_ms, int(eid.split("-", 1)[0])))
        if len(rows) < DROP_LOG_PAGE:
            return None
        end = "(" + text(rows[-1][0])


def _decode(payload: bytes | None, group_id: str) -> Group | None:
    if not payload:
        return None
    try:
        group = decode_group(payload)
    except DecodeError:
        return None
    return group if group.group_id == group_id else None


# -- one worker's groups ------------------------------------------------------------------


@dataclass
class HeldGroup:
    group_id: str
    token: str  # the claim it is held under
    held_s: float | None  # since that claim (None: its history no longer says)
    claims: int  # claims since it last finished
    attempts: int | None  # engine and reward failures so far, from its stored payload (None: unreadable)
    restarts: int | None
    n_samples: int | None


@dataclass
class WorkerGroups:
    worker: str
    registered: bool  # False: an in-flight hash left by a worker that is not registered
    alive: bool  # registered and its lease deadline has not passed
    lease_left_s: float | None  # negative: overdue; None: not registered
    groups: list[HeldGroup]


class UnknownWorker(LookupError):
    """No registered worker and no in-flight hash matches the name given."""


def worker_groups(queue: Queue, name: str) -> list[WorkerGroups]:
    """The groups held by the worker `name`: an exact worker id, or the start of ids
    (`host-123-ab12` matches its incarnations `host-123-ab12#1`, `#2`)."""
    r, k = queue.redis, queue.keys
    deadlines, workers = _inflight_workers(queue)
    chosen = [name] if name in workers else [w for w in workers if w.startswith(name)]
    if not chosen:
        known = ", ".join(workers[:10]) + (f" and {len(workers) - 10} more" if len(workers) > 10 else "")
        raise UnknownWorker(f"no worker {name!r} in namespace {k.namespace!r} (workers: {known or 'none'})")
    now_ms = queue.now_ms()
    out = []
    for worker in chosen:
        held = queue.held(worker)
        gids = sorted(held)
        pipe = r.pipeline(transaction=False)
        pipe.hmget(k.payloads, gids)
        pipe.hmget(k.history, gids)
        pipe.hmget(k.claims, gids)
        payloads, histories, claims = pipe.execute() if gids else ([], [], [])
        groups = []
        for gid, payload, lines, n in zip(gids, payloads, histories, claims):
            token = held[gid]
            claimed = [ms for ms, event, who, detail in parse_history(text(lines) or "")
                       if event == "claimed" and who == worker and detail == token]
            group = _decode(payload, gid)
            groups.append(HeldGroup(
                group_id=gid, token=token, held_s=_age_s(now_ms, claimed[-1]) if claimed else None,
                claims=int(n or 0), attempts=group.attempts if group else None,
                restarts=group.restarts if group else None, n_samples=group.n_samples if group else None))
        groups.sort(key=lambda g: -(g.held_s or 0))
        deadline = deadlines.get(worker)
        out.append(WorkerGroups(worker=worker, registered=deadline is not None,
                                alive=deadline is not None and deadline >= now_ms,
                                lease_left_s=None if deadline is None else round((deadline - now_ms) / 1000, 3),
                                groups=groups))
    return out
