"""Drawing a status snapshot (pipeline/ops/status.py) with rich, for `rollout status` and
the `rollout up` dashboard: laid out for 80 columns, the alerts last."""
from __future__ import annotations

import time

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
                            f"oldest {age(s.backlog_age_s)}")
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
    grid.add_row("totals", f"pushed {c.get('pushed', 0):,}  committed {c.get('committed', 0):,}  "
                           f"dropped {c.get('dropped', 0):,}  requeued {c.get('requeue', 0):,}  "
                           f"reaped {c.get('reaped', 0):,}  handed back {c.get('handed_back', 0):,}")
    cp = s.checkpoints
    if cp.groups or cp.written:
        grid.add_row("checkpoints", f"{counted(cp.groups, 'group')} ({cp.tokens:,} tokens, {cp.bytes:,} bytes), oldest "
                                    f"written {age(cp.oldest_write_age_s)} ago   written {cp.written:,}   refused "
                                    f"{cp.refused:,}   resumed {cp.tokens_resumed:,} tokens   lost "
                                    f"{cp.tokens_lost:,}")
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
    workers.add_column("beat/lease", justify="right", no_wrap=True)
    for w in s.workers:
        engines = w.engines[0] if len(w.engines) == 1 else (f"{len(w.engines)} engines" if w.engines else "-")
        engines = engines.replace("http://", "")
        samples = "-" if w.inflight_samples is None else (
            f"{w.inflight_samples}/{w.capacity}" if w.capacity else str(w.inflight_samples))
        workers.add_row(w.worker, w.state, engines, str(w.inflight_groups), samples,
                        str(w.counters.get("groups_completed", "-")),
                        f"{age(w.last_heartbeat_s)}/{age(w.lease_s or s.lease_s)}", style=None if w.alive else "dim")
    if s.workers:
        parts.append(workers)
    else:
        parts.append(Text("workers: none registered", style="bold"))
    recent = [d for d in s.departed if d.age_s <= DEPARTED_WINDOW_S]
    for d in recent[:DEPARTED_SHOWN]:
        parts.append(Text(departure_line(d), style="yellow" if d.how == Departure.REAPED else None))
    if len(recent) > DEPARTED_SHOWN:
        parts.append(Text(f"... and {len(recent) - DEPARTED_SHOWN} more departures (`rollout status --json`: "
                          "departed)", style="dim"))
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


def departure_line(d: DepartedWorker) -> str:
    """`reaped worker X 12.0s ago: 9 groups back to the queue`."""
    if d.how == Departure.REAPED:
        return f"reaped worker {d.worker} {age(d.age_s)} ago: {d.groups} groups back to the queue"
    return f"worker {d.worker} left {age(d.age_s)} ago: handed {d.groups} groups back"
