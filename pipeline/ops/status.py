"""A point-in-time picture of one pipeline, for `rollout status` and the `rollout up`
dashboard: depths, workers, control state, throughput, staleness, backlog age, the
workers reaped or departed lately and the groups claimed again and again. Drawing it
is pipeline/ops/status_render.py's job.

Everything is read with a handful of round trips; nothing is written.

Liveness. A worker is alive while its lease deadline (its score in `workers`, set
by each heartbeat to now + the namespace's lease) has not passed, so a worker killed
with SIGKILL shows as dead at most one lease after its last heartbeat. Its in-flight
hash stays until someone reaps it; the reap is logged in `reaped` and shown here.
In-flight hashes of workers not registered at all (left by an older version, or
written by hand) are counted too, as the audit counts them (`unregistered_inflight`).

Throughput. Two sources, both over the last minute:
  * committed groups: exact, from the `committed` sorted set, whose scores are the
    Redis server time (ms) at which each group was committed: ZCOUNT over
    [now - 60 s, now].
  * published (groups finished to the results stream) and claimed groups: from the
    monotonic `results` and `claims` counters of the stats hash, sampled by a
    `RateTracker` against the Redis server clock; the rate is the counter delta over
    the span of the samples kept (at most the last 60 s), scaled to per minute. One
    `rollout status` takes two samples `--sample` seconds apart; `--watch` and the
    dashboard keep sampling, so their window grows to the full minute.

Staleness of waiting groups: the oldest results entries (up to `staleness_sample`)
are decoded and each group's lag is `weight_version - oldest token version`
(`Group.oldest_version`), as the consumer will judge it.

Backlog age: results entry ids are `<ms>-<seq>` Redis server timestamps, so the
age of the oldest waiting result is `now - id_ms` of the stream's first entry.

Foreign or corrupt values (a counter or control setting that is not a number, a
worker name or group id that is not UTF-8) are shown as alerts, never a traceback:
status is what an operator runs to find out what is wrong.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import redis

from pipeline.checkpoints import CheckpointHeader
from pipeline.codec import DecodeError
from pipeline.control import read_control
from pipeline.keys import CONSUMER_GROUP
from pipeline.namespaces import namespace_is_empty
from pipeline.queue import Queue, text
from pipeline.retry import DEFAULT_RETRY_MAX_S
from pipeline.server_checks import SAFE_POLICY, ServerFacts, read_facts, server_alerts

WINDOW_S = 60.0
STALENESS_SAMPLE = 200  # results entries decoded for the staleness figures
#: Reaps (not clean departures) within this window, this many or more: an alert, a worker crash loop.
REAP_ALERT_WINDOW_S = 300.0
REAP_ALERT_COUNT = 2
#: Most-claimed groups listed by name (the count covers them all).
MOST_CLAIMED_SHOWN = 10
#: Dead (not yet reaped) workers named in the alerts, each with its state.
DEAD_WORKERS_NAMED = 5


class EmptyNamespace(LookupError):
    """The namespace holds no keys at all: nothing was ever pushed (or it was purged)."""


# -- throughput -----------------------------------------------------------------------


class RateTracker:
    """Samples of the stats counters over time (Redis server clock), for rates."""

    COUNTERS = ("results", "claims", "committed")

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.samples: deque[tuple[float, dict[str, int]]] = deque()

    def add(self, now_s: float, counters: dict[str, int]) -> None:
        # A counter that went down means the namespace was purged: start over.
        if self.samples and any(counters.get(c, 0) < self.samples[-1][1].get(c, 0) for c in self.COUNTERS):
            self.samples.clear()
        self.samples.append((now_s, {c: counters.get(c, 0) for c in self.COUNTERS}))
        while len(self.samples) > 2 and now_s - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def span_s(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if len(self.samples) > 1 else 0.0

    def per_min(self, counter: str) -> float | None:
        span = self.span_s()
        if span < 0.2:
            return None
        delta = self.samples[-1][1][counter] - self.samples[0][1][counter]
        return delta * 60.0 / span


@dataclass
class Throughput:
    window_s: float  # the committed figure's window
    committed: int  # groups committed in that window (exact)
    committed_per_min: float
    published_per_min: float | None  # from counter samples; None: not sampled yet
    claimed_per_min: float | None
    sampled_s: float  # span of the counter samples behind the two rates above


# -- snapshot -------------------------------------------------------------------------


@dataclass
class WorkerStatus:
    worker: str  # its id, `<name>#<incarnation>`
    alive: bool  # its lease deadline has not passed
    last_heartbeat_s: float  # seconds since its last heartbeat
    lease_left_s: float  # seconds until its lease deadline; negative: overdue by that much
    inflight_groups: int  # size of its in-flight hash in Redis
    state: str = "unknown"  # what the worker says it is doing
    engines: list[str] = field(default_factory=list)
    capacity: int | None = None  # samples
    inflight_samples: int | None = None
    host: str | None = None
    pid: int | None = None
    lease_s: float | None = None  # the lease it last heard of (None: it did not say)
    heartbeat_s: float | None = None  # its heartbeat interval
    counters: dict[str, int] = field(default_factory=dict)


class Departure(StrEnum):
    """How a worker left, as lua/reap.lua logs it in `reaped`."""

    REAPED = "reaped"  # its lease ran out: a crash or a stall; its claims count against its groups
    HANDED_BACK = "handed_back"  # it left cleanly (SIGTERM) and gave its groups back


@dataclass
class DepartedWorker:
    """One record of the `reaped` log."""

    worker: str
    how: Departure
    groups: int  # in-flight groups that went back to the prompt list
    age_s: float  # seconds ago
    overdue_s: float  # how long past its lease deadline it was reaped (0 for a clean departure)


@dataclass
class Staleness:
    checked: int  # waiting results decoded
    waiting: int  # waiting results in all
    by_lag: dict[int, int]  # lag in versions -> groups
    max: int | None
    mean: float | None
    over_limit: int  # groups past max_staleness (they will be restarted or dropped)
    malformed: int  # entries that did not decode (they will be dead-lettered)


@dataclass
class CheckpointStatus:
    """In-flight checkpoints (pipeline/checkpoints.py): those held now, what the scripts
    counted, and what the workers say they resumed and lost."""

    groups: int = 0  # queued or in-flight groups with a checkpoint now
    bytes: int = 0  # their records
    tokens: int = 0  # response tokens they hold
    oldest_write_age_s: float | None = None  # since the least recently written one was last written
    written: int = 0  # writes Redis accepted, since the namespace began (stats `checkpoints`)
    refused: int = 0  # writes of holders that no longer held their group (stats `checkpoints_refused`)
    claimed: int = 0  # claims that handed a checkpoint to the group's next holder (stats `checkpoints_claimed`)
    tokens_claimed: int = 0  # the tokens those held (stats `checkpoint_tokens_claimed`)
    tokens_resumed: int = 0  # tokens the live workers took from checkpoints instead of generating them
    tokens_lost: int = 0  # tokens the live workers generated and could not keep (a checkpoint too stale)


@dataclass
class StatusSnapshot:
    namespace: str
    time: float  # Redis server time, unix seconds
    empty: bool
    prompts: int
    inflight: int  # groups in all workers' in-flight sets
    inflight_by_worker: dict[str, int]
    results_ready: int  # in the results stream, not yet delivered to a trainer
    results_pending: int  # delivered to a trainer, not yet committed
    requeue: int
    dead: int
    workers_alive: int
    workers: list[WorkerStatus]
    weight_version: int
    paused: bool
    max_staleness: int | None
    batch_size: int | None
    max_ready: int | None
    admitted: int
    counters: dict[str, int]
    throughput: Throughput
    staleness: Staleness
    backlog_age_s: float | None  # age of the oldest entry in the results stream
    requeue_age_s: float | None
    lease_s: float = 0.0  # the namespace's lease
    max_claims: int = 0  # the namespace's claims per group before it is dead-lettered
    unregistered_inflight: list[str] = field(default_factory=list)  # in-flight hashes of unregistered workers
    departed: list[DepartedWorker] = field(default_factory=list)  # the `reaped` log, newest first
    claimed_repeatedly: int = 0  # groups claimed 2+ times without finishing (a holder was reaped or lost it)
    most_claimed: dict[str, int] = field(default_factory=dict)  # group id -> claims, most first
    checkpoints: CheckpointStatus = field(default_factory=CheckpointStatus)
    alerts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["staleness"]["by_lag"] = {str(k): v for k, v in sorted(self.staleness.by_lag.items())}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)


def _id_ms(entry_id: bytes | str) -> int:
    return int(text(entry_id).split("-", 1)[0])


def _numbers(raw: dict, where: str, alerts: list[str]) -> dict[str, int]:
    """The integer fields of a hash; each other one becomes an alert."""
    out = {}
    for name, value in raw.items():
        try:
            out[text(name)] = int(value)
        except ValueError:
            alerts.append(f"{where} field {text(name)!r} holds {text(value)[:40]!r}, not a number")
    return out


def server_time(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def snapshot(queue: Queue, tracker: RateTracker | None = None,
             staleness_sample: int = STALENESS_SAMPLE) -> StatusSnapshot:
    r, k = queue.redis, queue.keys
    now = server_time(r)
    now_ms = int(now * 1000)

    pipe = r.pipeline(transaction=False)
    pipe.llen(k.prompts)
    pipe.xlen(k.results)
    pipe.xlen(k.requeue)
    pipe.xlen(k.dead)
    pipe.zrange(k.workers, 0, -1, withscores=True)
    pipe.hgetall(k.worker_info)
    pipe.hgetall(k.stats)
    pipe.zcount(k.committed, now_ms - int(WINDOW_S * 1000), "+inf")
    pipe.xrange(k.results, "-", "+", count=max(1, staleness_sample))
    pipe.xrange(k.requeue, "-", "+", count=1)
    pipe.hgetall(k.control)
    pipe.lrange(k.reaped, 0, -1)
    pipe.hgetall(k.claims)
    pipe.hgetall(k.checkpoints)
    (prompts, results, requeue, dead, workers, info, stats, committed_recent, oldest, oldest_requeue,
     control_raw, reaped_log, claims, checkpoint_headers) = pipe.execute()
    poison: list[str] = []
    counters = _numbers(stats, "stats", poison)
    _numbers({f: v for f, v in control_raw.items() if f in _NUMERIC_CONTROL}, "control", poison)
    control = read_control(r, k)
    try:
        pending = int(r.xpending(k.results, CONSUMER_GROUP)["pending"])
    except redis.ResponseError:  # no consumer group yet
        pending = 0

    names = [text(w) for w, _ in workers]
    unregistered = sorted(queue.inflight_holders() - set(names))
    sizes = []
    if names or unregistered:
        pipe = r.pipeline(transaction=False)
        for w in names + unregistered:
            pipe.hlen(k.inflight(w))
        sizes = pipe.execute()
    worker_rows = [_worker_row(name, deadline, int(size), info.get(raw_name), now_ms, control.lease_s)
                   for (raw_name, deadline), name, size in zip(workers, names, sizes)]
    worker_rows.sort(key=lambda w: (not w.alive, w.worker))
    stray = {w: int(n) for w, n in zip(unregistered, sizes[len(names):]) if n}

    # Staleness of the oldest waiting results.
    by_lag: dict[int, int] = {}
    utf8 = [(eid, fields) for eid, fields in oldest if _utf8_fields(fields)]
    malformed, over = len(oldest) - len(utf8), 0
    for entry in queue.entries(k.results, utf8):
        try:
            group = entry.decode()
        except DecodeError:
            malformed += 1
            continue
        lag = control.lag(group)
        by_lag[lag] = by_lag.get(lag, 0) + 1
        if control.max_staleness is not None and lag > control.max_staleness:
            over += 1
    checked = sum(by_lag.values())
    staleness = Staleness(
        checked=checked, waiting=results, by_lag=by_lag, max=max(by_lag) if by_lag else None,
        mean=round(sum(l * c for l, c in by_lag.items()) / checked, 3) if checked else None,
        over_limit=over, malformed=malformed)

    if tracker is not None:
        tracker.add(now, counters)
    throughput = Throughput(
        window_s=WINDOW_S, committed=int(committed_recent), committed_per_min=float(committed_recent),
        published_per_min=_round(tracker.per_min("results")) if tracker else None,
        claimed_per_min=_round(tracker.per_min("claims")) if tracker else None,
        sampled_s=round(tracker.span_s(), 3) if tracker else 0.0)

    inflight_by_worker = {w.worker: w.inflight_groups for w in worker_rows if w.inflight_groups} | stray
    snap = StatusSnapshot(
        namespace=k.namespace,
        time=round(now, 3),
        empty=False,
        prompts=int(prompts),
        inflight=sum(inflight_by_worker.values()),
        inflight_by_worker=inflight_by_worker,
        results_ready=max(0, int(results) - pending),
        results_pending=pending,
        requeue=int(requeue),
        dead=int(dead),
        workers_alive=sum(w.alive for w in worker_rows),
        workers=worker_rows,
        weight_version=control.weight_version,
        paused=control.paused,
        max_staleness=control.max_staleness,
        batch_size=control.batch_size,
        max_ready=control.max_ready,
        admitted=control.admitted,
        counters=counters,
        throughput=throughput,
        staleness=staleness,
        backlog_age_s=round((now_ms - _id_ms(oldest[0][0])) / 1000, 3) if oldest else None,
        requeue_age_s=round((now_ms - _id_ms(oldest_requeue[0][0])) / 1000, 3) if oldest_requeue else None,
        lease_s=control.lease_s,
        max_claims=control.max_claims,
        unregistered_inflight=sorted(stray),
        departed=_departed(reaped_log, now_ms, poison),
    )
    snap.checkpoints = _checkpoints(list(checkpoint_headers.values()), counters, worker_rows, now_ms, poison)
    repeated = sorted(((n, text(g)) for g, n in _numbers(claims, "claims", poison).items() if n >= 2), reverse=True)
    snap.claimed_repeatedly = len(repeated)
    snap.most_claimed = {gid: n for n, gid in repeated[:MOST_CLAIMED_SHOWN]}
    snap.empty = (not counters and not names and not stray and not any((snap.prompts, results, snap.requeue,
                                                                       snap.dead))
                  and namespace_is_empty(r, k))
    snap.alerts = poison + _server_alerts(r) + alerts(snap)
    return snap


def _server_alerts(r) -> list[str]:
    """What the server itself says: full, may evict keys, a replica (pipeline/server_checks.py,
    the same findings every writer's connection refuses)."""
    try:
        facts = read_facts(r)
    except (redis.RedisError, TypeError, ValueError, AttributeError, KeyError):
        return []  # a cluster answers per node, or INFO is not allowed: nothing to say
    return _memory_alert(facts) + server_alerts(facts)


def _memory_alert(facts: ServerFacts) -> list[str]:
    """Redis at maxmemory with noeviction refuses every write: say so first, since the
    workers' heartbeats (their state in this report) are among the writes refused."""
    used, limit = facts.used_memory, facts.maxmemory
    if not limit or used < limit or facts.policy != SAFE_POLICY:
        return []
    return [f"Redis is full ({used / 2**20:.1f} MiB used of maxmemory {limit / 2**20:.1f} MiB, noeviction): every "
            f"write is refused; workers hold the groups they finished and retry publishing them (every "
            f"{DEFAULT_RETRY_MAX_S:g}s at most) until the trainer commits or maxmemory is raised"]


def _checkpoints(headers: list[bytes], counters: dict[str, int], workers: list[WorkerStatus], now_ms: int,
                 alerts: list[str]) -> CheckpointStatus:
    out = CheckpointStatus(written=counters.get("checkpoints", 0), refused=counters.get("checkpoints_refused", 0),
                           claimed=counters.get("checkpoints_claimed", 0),
                           tokens_claimed=counters.get("checkpoint_tokens_claimed", 0),
                           tokens_resumed=sum(w.counters.get("checkpoint_tokens_resumed", 0) for w in workers),
                           tokens_lost=sum(w.counters.get("checkpoint_tokens_lost", 0) for w in workers))
    last_writes = []
    for raw in headers:
        try:
            header = CheckpointHeader.parse(raw)
        except DecodeError as exc:
            alerts.append(f"an in-flight checkpoint is unreadable: {exc}")
            continue
        out.groups, out.bytes, out.tokens = out.groups + 1, out.bytes + header.bytes, out.tokens + header.tokens
        last_writes.append(max(header.written_ms, default=now_ms))
    if last_writes:
        out.oldest_write_age_s = round(max(0, now_ms - min(last_writes)) / 1000, 3)
    return out


def _worker_row(name: str, deadline: float, size: int, raw_info: bytes | None, now_ms: int,
                namespace_lease_s: float) -> WorkerStatus:
    row = WorkerStatus(worker=name, alive=deadline >= now_ms, last_heartbeat_s=0.0,
                       lease_left_s=round((deadline - now_ms) / 1000, 3), inflight_groups=size)
    if raw_info:
        try:
            d = json.loads(raw_info)
            row.state = str(d.get("state", "unknown"))
            row.engines = [str(e) for e in d.get("engines") or []]
            row.capacity = d.get("capacity")
            row.inflight_samples = d.get("inflight_samples")
            row.host = d.get("host")
            row.pid = d.get("pid")
            row.lease_s = _seconds(d.get("lease_s"))
            row.heartbeat_s = _seconds(d.get("heartbeat_s"))
            row.counters = {str(a): b for a, b in (d.get("counters") or {}).items() if isinstance(b, int)}
        except (ValueError, AttributeError, TypeError, RecursionError):
            row.state = "unreadable info"
    # The deadline is the last heartbeat plus the lease that heartbeat was given.
    lease_ms = (row.lease_s or namespace_lease_s) * 1000
    row.last_heartbeat_s = round(max(0.0, (now_ms - (deadline - lease_ms)) / 1000), 3)
    if not row.alive:
        row.state = f"dead (no heartbeat for {row.last_heartbeat_s:.0f}s; its groups return at the next reap)"
    return row


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _departed(records: list[bytes], now_ms: int, alerts: list[str]) -> list[DepartedWorker]:
    """The `reaped` log (JSON records from lua/reap.lua, newest first); a foreign record is an alert."""
    out = []
    for raw in records:
        try:
            d = json.loads(raw)
            out.append(DepartedWorker(worker=str(d["worker"]), how=Departure(d["how"]), groups=int(d["groups"]),
                                      age_s=round(max(0.0, (now_ms - int(d["at_ms"])) / 1000), 3),
                                      overdue_s=round(int(d.get("overdue_ms") or 0) / 1000, 3)))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            alerts.append(f"reaped log record {text(raw)[:60]!r} is not one rollout wrote")
    return out


_NUMERIC_CONTROL = {b"paused", b"weight_version", b"max_staleness", b"batch_size", b"max_ready"}


def _utf8_fields(fields: dict) -> bool:
    try:
        for value in (fields.get(b"gid"), fields.get(b"error")):
            if value is not None:
                value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def alerts(s: StatusSnapshot) -> list[str]:
    """What an operator should look at first, one line each."""
    out: list[str] = []
    if s.empty:
        return [f"namespace {s.namespace!r} is empty: nothing has been pushed"]
    if s.paused:
        out.append("admission is paused (`rollout resume` reopens it)")
    if s.workers_alive == 0 and (s.prompts or s.requeue):
        out.append(f"no live workers, {s.prompts + s.requeue} groups waiting (start `rollout worker`)")
    expired = [w for w in s.workers if not w.alive]
    for w in expired[:DEAD_WORKERS_NAMED]:
        out.append(f"worker {w.worker} missed its lease: {w.state}")
    if len(expired) > DEAD_WORKERS_NAMED:
        out.append(f"... and {len(expired) - DEAD_WORKERS_NAMED} more workers missed their lease")
    down = [w for w in s.workers if w.alive and w.state.startswith("engine-down")]
    for w in down:
        out.append(f"worker {w.worker}: {w.state}")
    if s.unregistered_inflight:
        held = sum(s.inflight_by_worker.get(w, 0) for w in s.unregistered_inflight)
        out.append(f"{held} groups sit in the in-flight hashes of workers that are not registered "
                   f"({', '.join(s.unregistered_inflight[:3])}); a live worker gives back those its claims recorded, "
                   f"`rollout audit --reap-orphans` (an admin) all of them")
    reaps = [d for d in s.departed if d.how == Departure.REAPED and d.age_s <= REAP_ALERT_WINDOW_S]
    if len(reaps) >= REAP_ALERT_COUNT:
        out.append(f"workers are being reaped repeatedly: {len(reaps)} in the last {REAP_ALERT_WINDOW_S / 60:.0f} "
                   f"min ({sum(d.groups for d in reaps)} groups back to the queue); are they crashing?")
    if s.claimed_repeatedly:
        gid, n = next(iter(s.most_claimed.items()))
        out.append(f"{s.claimed_repeatedly} groups were claimed 2+ times without finishing (their workers died "
                   f"holding them); past {s.max_claims} claims a group is dead-lettered; most: {gid} ({n} claims, "
                   f"`rollout inspect {gid}`)")
    if s.dead:
        out.append(f"{s.dead} dead letter{'' if s.dead == 1 else 's'} (`rollout dead list`)")
    if s.max_ready is not None and s.results_ready >= s.max_ready:
        out.append(f"results backlog full ({s.results_ready}/{s.max_ready}): workers wait for the trainer")
    if s.max_staleness is not None and s.batch_size:
        budget = (s.max_staleness + s.weight_version + 1) * s.batch_size
        if s.admitted >= budget and s.prompts:
            out.append(f"staleness budget spent ({s.admitted}/{budget} admitted at version {s.weight_version}): "
                       "admission waits for a new weight version")
    if s.staleness.over_limit:
        out.append(f"{s.staleness.over_limit} waiting groups are past max_staleness {s.max_staleness}")
    if s.staleness.malformed:
        out.append(f"{s.staleness.malformed} waiting results do not decode (they will be dead-lettered)")
    if s.prompts == 0 and s.inflight == 0 and s.requeue == 0 and s.results_ready == 0 and s.results_pending == 0:
        out.append("nothing queued: push prompts with `rollout push FILE`")
    return out
