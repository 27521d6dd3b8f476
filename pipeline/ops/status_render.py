"""Drawing a status snapshot (pipeline/ops/status.py) with rich, for `rollout status` and
the `rollout up` dashboard: laid out for 80 columns, the alerts last."""
from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.tables import Col, Facts, FittedTable, Hanging

from pipeline.wording import counted

from .status import DepartedWorker, Departure, StatusSnapshot

#: Departed workers listed under the workers table: the newest, within the last ten minutes.
DEPARTED_SHOWN = 5
DEPARTED_WINDOW_S = 600.0


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


@dataclass
class Outage:
    """Redis unreachable while watching (`rollout status --watch`): the numbers shown are
    those of the last good read. Times are wall-clock seconds (time.time())."""

    error: str  # the exception's class name
    since: float  # when reads started failing
    last_good: float | None  # the last good read; None before the first
    retry_s: float  # how often it is tried again
    now: float = 0.0  # when it was last checked
    ended: float | None = None  # when Redis answered again

    def banner(self) -> list[str]:
        """The lines that say it, each under 80 columns."""
        if self.ended is not None:
            return [f"Redis was unreachable for {age(self.ended - self.since)} ({self.error}), "
                    f"back since {time.strftime('%H:%M:%S', time.localtime(self.ended))}"]
        shown = ("no good read yet" if self.last_good is None
                 else f"the numbers below are from the last good read, {age(self.now - self.last_good)} ago")
        return [f"REDIS UNREACHABLE for {age(self.now - self.since)} ({self.error}), retrying every "
                f"{self.retry_s:g}s", shown]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}/min"


def render(s: StatusSnapshot, title: str | None = None, outage: Outage | None = None):
    """A rich renderable of the snapshot, laid out for 80 columns; under an `outage`, its
    banner first (the numbers are then the last good read's)."""
    from rich.console import Group as RichGroup
    from rich.text import Text

    parts: list = []
    if outage is not None:
        parts.append(Text("\n".join(outage.banner()), style="dim" if outage.ended is not None else "bold red"))
    head = Text()
    head.append(title or f"namespace {s.namespace}", style="bold")
    head.append(f"   weight version {s.weight_version}   admission ")
    head.append("PAUSED" if s.paused else "open", style="bold red" if s.paused else "green")
    parts.append(head)
    if s.empty:
        parts.append(Text(f"namespace {s.namespace!r} is empty: nothing has been pushed", style="yellow"))
        return RichGroup(*parts)

    facts: list[tuple[str, list[str]]] = [
        ("queue", [f"prompts {s.prompts:,}", f"in flight {s.inflight:,}", f"requeue {s.requeue:,}",
                   f"dead {s.dead:,}"]),
        ("results", [f"ready {s.results_ready:,}" + (f" (max {s.max_ready:,})" if s.max_ready is not None else ""),
                     f"pending {s.results_pending:,}", f"oldest {age(s.backlog_age_s)}"]),
    ]
    t = s.throughput
    window = (f"counter samples over the last {t.sampled_s:.0f}s" if t.sampled_s >= 0.2
              else "not sampled yet")
    facts.append(("rate", [f"committed {_rate(t.committed_per_min)} (last {t.window_s:.0f}s)",
                           f"published {_rate(t.published_per_min)}", f"claimed {_rate(t.claimed_per_min)}",
                           f"(published and claimed: {window})"]))
    st = s.staleness
    if st.checked:
        lags = " ".join(f"{lag}:{n}" for lag, n in sorted(st.by_lag.items()))
        of = f" of {st.waiting}" if st.waiting > st.checked else ""
        limit = f", limit {s.max_staleness}" if s.max_staleness is not None else ""
        facts.append(("staleness", [f"{st.checked}{of} waiting: max {st.max}, mean {st.mean:g}{limit}",
                                    f"lag:groups {lags}"]))
    else:
        facts.append(("staleness", ["no waiting results" + (f" (limit {s.max_staleness})"
                                                             if s.max_staleness is not None else "")]))
    c = s.counters
    facts.append(("totals", [f"{name} {c.get(key, 0):,}" for name, key in (
        ("pushed", "pushed"), ("committed", "committed"), ("dropped", "dropped"), ("requeued", "requeue"),
        ("reaped", "reaped"), ("handed back", "handed_back"))]))
    cp = s.checkpoints
    if cp.groups or cp.written:
        facts.append(("checkpoints", [f"{counted(cp.groups, 'group')} ({cp.tokens:,} tokens, {cp.bytes:,} bytes)",
                                      f"oldest written {age(cp.oldest_write_age_s)} ago", f"written {cp.written:,}",
                                      f"refused {cp.refused:,}", f"resumed {cp.tokens_resumed:,} tokens",
                                      f"lost {cp.tokens_lost:,} tokens"]))
    if s.batch_size or s.max_staleness is not None:
        facts.append(("pacing", [f"batch size {s.batch_size or '-'}",
                                 f"max staleness {'-' if s.max_staleness is None else s.max_staleness}",
                                 f"admitted {s.admitted:,}"]))
    parts.append(Facts(facts))

    if s.workers:
        parts.append(_workers_table(s))
        # A state's details under the table, whole (`full`'s are the samples column; an
        # alert may say them already).
        for w in s.workers:
            name, _, detail = w.state.partition(": ")
            if detail and name != "full" and not any(w.state in a for a in s.alerts):
                parts.append(Hanging(f"  {w.worker}: {w.state}", indent=4, style=None if w.alive else "dim"))
    else:
        parts.append(Text("workers: none registered", style="bold"))
    recent = [d for d in s.departed if d.age_s <= DEPARTED_WINDOW_S]
    for d in recent[:DEPARTED_SHOWN]:
        parts.append(Hanging(departure_line(d), style="yellow" if d.how == Departure.REAPED else None))
    if len(recent) > DEPARTED_SHOWN:
        parts.append(Text(f"... and {len(recent) - DEPARTED_SHOWN} more departures (`rollout status --json`: "
                          "departed)", style="dim"))
    for a in s.alerts:
        parts.append(Hanging("! " + a, style="yellow"))
    return RichGroup(*parts)


#: The workers table's columns: the names and engines share what the numbers leave.
WORKER_COLUMNS = [Col("worker", flex=True, min_width=14), Col("state", flex=True, min_width=17),
                  Col("engines", flex=True, min_width=12), Col("groups", "right"), Col("samples", "right"),
                  Col("done", "right"), Col("beat", "right")]


def _workers_table(s: StatusSnapshot) -> FittedTable:
    """One row a worker: its state's name (the details go under the table), its first engine,
    groups and sample slots in flight, groups completed, its last heartbeat's age."""
    rows, styles = [], []
    for w in s.workers:
        engines = w.engines[0] if len(w.engines) == 1 else (f"{len(w.engines)} engines" if w.engines else "-")
        samples = "-" if w.inflight_samples is None else (
            f"{w.inflight_samples}/{w.capacity}" if w.capacity else str(w.inflight_samples))
        rows.append((w.worker, w.state.partition(": ")[0], engines.replace("http://", ""), str(w.inflight_groups),
                     samples, str(w.counters.get("groups_completed", "-")), age(w.last_heartbeat_s)))
        styles.append(None if w.alive else "dim")
    leases = sorted({w.lease_s or s.lease_s for w in s.workers} - {None})
    lease = (f", lease {age(leases[0])}" if len(leases) == 1 else
             f", leases {age(leases[0])} to {age(leases[-1])}" if leases else "")
    expired = len(s.workers) - s.workers_alive
    title = f"workers: {s.workers_alive} alive" + (f", {expired} expired" if expired else "") + lease
    return FittedTable(WORKER_COLUMNS, rows, title=title, row_styles=styles)


def one_line(s: StatusSnapshot) -> str:
    """A compact line for logs (the dashboard when stdout is not a terminal)."""
    if s.empty:
        return f"{time.strftime('%H:%M:%S')} {s.namespace}: empty (nothing pushed yet)"
    t = s.throughput
    return (f"{time.strftime('%H:%M:%S')} {s.namespace}: prompts {s.prompts} in flight {s.inflight} "
            f"results {s.results_ready}+{s.results_pending} requeue {s.requeue} dead {s.dead} "
            f"workers {s.workers_alive} v{s.weight_version}{' PAUSED' if s.paused else ''} "
            f"committed {t.committed_per_min:.0f}/min")


def departure_line(d: DepartedWorker) -> str:
    """`reaped worker X 12.0s ago: 9 groups back to the queue`."""
    if d.how == Departure.REAPED:
        return f"reaped worker {d.worker} {age(d.age_s)} ago: {d.groups} groups back to the queue"
    return f"worker {d.worker} left {age(d.age_s)} ago: handed {d.groups} groups back"
