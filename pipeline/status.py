"""A point-in-time picture of one pipeline, for `rollout status` and the `rollout up`
dashboard: depths, workers, control state, throughput, staleness, backlog age.

Everything is read with a handful of round trips; nothing is written.

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
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from .codec import DecodeError
from .control import read_control
from .keys import CONSUMER_GROUP, Keys
from .queue import Queue, text

WINDOW_S = 60.0
STALENESS_SAMPLE = 200  # results entries decoded for the staleness figures


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
    name: str
    alive: bool  # heartbeat within the lease
    last_heartbeat_s: float  # seconds since its last heartbeat
    inflight_groups: int  # size of its in-flight set in Redis
    state: str = "unknown"  # what the worker says it is doing
    engines: list[str] = field(default_factory=list)
    capacity: int | None = None  # samples
    inflight_samples: int | None = None
    host: str | None = None
    pid: int | None = None
    counters: dict[str, int] = field(default_factory=dict)


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


def namespace_is_empty(client: redis.Redis, keys: Keys) -> bool:
    if client.exists(*keys.all_fixed()):
        return False
    for _ in client.scan_iter(match=keys.inflight_pattern, count=1000):
        return False
    return True


def known_namespaces(client: redis.Redis, max_names: int = 1000, max_keys: int = 200_000) -> list[str]:
    """Namespaces found on this server (from their `{ns}:...` keys), for hints. Scans at
    most `max_keys` keys: an error path on a big shared server must stay quick."""
    found: set[str] = set()
    for seen, key in enumerate(client.scan_iter(match="{*}:*", count=1000)):
        name = text(key)
        if name.startswith("{") and "}:" in name:
            found.add(name[1:name.index("}:")])
        if len(found) >= max_names or seen >= max_keys:
            break
    return sorted(found)


def empty_message(client: redis.Redis, namespace: str, shown: int = 8) -> str:
    """`namespace 'x' is empty: nothing has been pushed`, with the likeliest intended names."""
    import difflib

    others = [n for n in known_namespaces(client) if n != namespace]
    if not others:
        return f"namespace {namespace!r} is empty: nothing has been pushed (this server holds no pipeline)"
    close = difflib.get_close_matches(namespace, others, n=3, cutoff=0.6)
    rest = [n for n in others if n not in close]
    listed = close + rest[:max(0, shown - len(close))]
    more = f" and {len(others) - len(listed)} more" if len(others) > len(listed) else ""
    guess = f"did you mean {' or '.join(repr(n) for n in close)}? " if close else ""
    return (f"namespace {namespace!r} is empty: nothing has been pushed ({guess}namespaces on this server: "
            f"{', '.join(listed)}{more})")


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
    (prompts, results, requeue, dead, workers, info, stats, committed_recent, oldest, oldest_requeue,
     control_raw) = pipe.execute()
    poison: list[str] = []
    counters = _numbers(stats, "stats", poison)
    _numbers({f: v for f, v in control_raw.items() if f in _NUMERIC_CONTROL}, "control", poison)
    control = read_control(r, k)
    try:
        pending = int(r.xpending(k.results, CONSUMER_GROUP)["pending"])
    except redis.ResponseError:  # no consumer group yet
        pending = 0

    names = [text(w) for w, _ in workers]
    sizes = []
    if names:
        pipe = r.pipeline(transaction=False)
        for w in names:
            pipe.hlen(k.inflight(w))
        sizes = pipe.execute()
    worker_rows: list[WorkerStatus] = []
    lease_ms = int(control.lease_s * 1000)
    for (raw_name, deadline), name, size in zip(workers, names, sizes):
        # Scores are lease deadlines: the last heartbeat was one lease before.
        row = WorkerStatus(name=name, alive=deadline >= now_ms,
                           last_heartbeat_s=max(0.0, (now_ms - (deadline - lease_ms)) / 1000),
                           inflight_groups=int(size))
        raw = info.get(raw_name) or info.get(name.encode())
        if raw:
            try:
                d = json.loads(raw)
                row.state = str(d.get("state", "unknown"))
                row.engines = [str(e) for e in d.get("engines") or []]
                row.capacity = d.get("capacity")
                row.inflight_samples = d.get("inflight_samples")
                row.host = d.get("host")
                row.pid = d.get("pid")
                row.counters = {str(a): b for a, b in (d.get("counters") or {}).items() if isinstance(b, int)}
            except (ValueError, AttributeError, TypeError, RecursionError):
                row.state = "unreadable info"
        if not row.alive:
            row.state = (f"dead (no heartbeat for {row.last_heartbeat_s:.0f}s; its groups return at the next "
                         f"reap)")
        worker_rows.append(row)
    worker_rows.sort(key=lambda w: (not w.alive, w.name))

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
        lag = control.weight_version - (group.oldest_version(control.version_clock) or 0)
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

    inflight_by_worker = {w.name: w.inflight_groups for w in worker_rows if w.inflight_groups}
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
    )
    snap.empty = (not counters and not names and not any((snap.prompts, results, snap.requeue, snap.dead))
                  and namespace_is_empty(r, k))
    snap.alerts = poison + alerts(snap)
    return snap


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
    expired = [w.name for w in s.workers if not w.alive]
    if expired:
        out.append(f"{len(expired)} workers missed their lease; their groups return at the next reap")
    down = [w for w in s.workers if w.alive and w.state.startswith("engine-down")]
    for w in down:
        out.append(f"worker {w.name}: {w.state}")
    if s.dead:
        out.append(f"{s.dead} dead letters (`rollout dead list`)")
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


# -- rendering (rich) --------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}/min"


def render(s: StatusSnapshot, title: str | None = None):
    """A rich renderable of the snapshot, laid out for 80 columns."""
    from rich.console import Group as RichGroup
    from rich.table import Table
    from rich.text import Text

    parts: list = []
    head = Text()
    head.append(title or f"namespace {s.namespace}", style="bold")
    head.append(f"   weight version {s.weight_version}   admission ")
    head.append("PAUSED" if s.paused else "open", style="bold red" if s.paused else "green")
    parts.append(head)
    if s.empty:
        parts.append(Text(f"namespace {s.namespace!r} is empty: nothing has been pushed", style="yellow"))
        return RichGroup(*parts)

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("queue", f"prompts {s.prompts:,}   in flight {s.inflight:,}   requeue {s.requeue:,}   "
                          f"dead {s.dead:,}")
    limit = f" (max {s.max_ready:,})" if s.max_ready is not None else ""
    grid.add_row("results", f"ready {s.results_ready:,}{limit}   pending {s.results_pending:,}   "
                            f"oldest {_age(s.backlog_age_s)}")
    t = s.throughput
    window = (f"counter samples over the last {t.sampled_s:.0f}s" if t.sampled_s >= 0.2
              else "not sampled yet")
    grid.add_row("rate", f"committed {_rate(t.committed_per_min)} (last {t.window_s:.0f}s)   "
                         f"published {_rate(t.published_per_min)}   claimed {_rate(t.claimed_per_min)}")
    grid.add_row("", f"(published and claimed: {window})")
    st = s.staleness
    if st.checked:
        lags = " ".join(f"{lag}:{n}" for lag, n in sorted(st.by_lag.items()))
        of = f" of {st.waiting}" if st.waiting > st.checked else ""
        limit = f", limit {s.max_staleness}" if s.max_staleness is not None else ""
        grid.add_row("staleness", f"{st.checked}{of} waiting: max {st.max}, mean {st.mean:g}{limit}   lag:groups {lags}")
    else:
        grid.add_row("staleness", "no waiting results" + (f" (limit {s.max_staleness})" if s.max_staleness is not None
                                                        else ""))
    c = s.counters
    grid.add_row("totals", f"pushed {c.get('pushed', 0):,}   committed {c.get('committed', 0):,}   "
                           f"dropped {c.get('dropped', 0):,}   requeued {c.get('requeue', 0):,}   "
                           f"reaped {c.get('reaped', 0):,}")
    if s.batch_size or s.max_staleness is not None:
        grid.add_row("pacing", f"batch size {s.batch_size or '-'}   max staleness "
                               f"{'-' if s.max_staleness is None else s.max_staleness}   admitted {s.admitted:,}")
    parts.append(grid)

    workers = Table(title=f"workers: {s.workers_alive} alive" + (f", {len(s.workers) - s.workers_alive} expired"
                                                                 if len(s.workers) > s.workers_alive else ""),
                    title_justify="left", box=None, padding=(0, 1), header_style="bold")
    workers.add_column("worker", overflow="ellipsis", no_wrap=True, max_width=24)
    workers.add_column("state", overflow="ellipsis", no_wrap=True, max_width=16)
    workers.add_column("engines", overflow="ellipsis", no_wrap=True, max_width=18)
    workers.add_column("groups", justify="right")
    workers.add_column("samples", justify="right", no_wrap=True)
    workers.add_column("done", justify="right")
    workers.add_column("beat", justify="right")
    for w in s.workers:
        engines = w.engines[0] if len(w.engines) == 1 else (f"{len(w.engines)} engines" if w.engines else "-")
        engines = engines.replace("http://", "")
        samples = "-" if w.inflight_samples is None else (
            f"{w.inflight_samples}/{w.capacity}" if w.capacity else str(w.inflight_samples))
        workers.add_row(w.name, w.state, engines, str(w.inflight_groups), samples,
                        str(w.counters.get("groups_completed", "-")), _age(w.last_heartbeat_s),
                        style=None if w.alive else "dim")
    if s.workers:
        parts.append(workers)
    else:
        parts.append(Text("workers: none registered", style="bold"))
    for a in s.alerts:
        parts.append(Text("! " + a, style="yellow"))
    return RichGroup(*parts)


def one_line(s: StatusSnapshot) -> str:
    """A compact line for logs (the dashboard when stdout is not a terminal)."""
    if s.empty:
        return f"{time.strftime('%H:%M:%S')} {s.namespace}: empty (nothing pushed yet)"
    t = s.throughput
    return (f"{time.strftime('%H:%M:%S')} {s.namespace}: prompts {s.prompts} in flight {s.inflight} "
            f"results {s.results_ready}+{s.results_pending} requeue {s.requeue} dead {s.dead} "
            f"workers {s.workers_alive} v{s.weight_version}{' PAUSED' if s.paused else ''} "
            f"committed {t.committed_per_min:.0f}/min")
