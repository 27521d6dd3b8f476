"""What a fault campaign proves, from the trainers' ledger and Redis after the drain.

A group counts as trained once per committed batch that held it: a batch is committed
when its trainer recorded the commit, or, for a trainer killed between its commit and
the record, when the groups' history in Redis shows the commit of that batch. Every
pushed group (read back from the dataset cursors) must be trained exactly once, or be
a dead letter or a drop, each with its reason; none trained twice, none lost; the
conservation audit clean.
"""
from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from .ledger import LedgerEvent, Record

#: The keys of ChaosReport.to_dict() (`rollout chaos --json`), documented in the README.
REPORT_JSON_KEYS = (
    "pushed", "trained_once", "trained_twice", "lost", "dead", "dropped", "faults", "ok",
    "seed", "minutes", "batches", "dead_reasons", "dropped_reasons", "by_kind", "audit_ok", "checks", "problems",
)


@dataclass
class FaultRecord:
    """One injected fault. `ended` is when it was over: for a kill, the kill itself (the
    restart is part of the recovery); for a window (a stopped worker, a burst of engine
    errors, a faulty link), the moment it was lifted."""

    kind: str
    at_s: float  # scheduled: seconds into the campaign
    started: float | None = None  # time.time(); None: never injected
    ended: float | None = None
    target: str = ""
    affected: int = 0
    unit: str = "groups"  # what `affected` counts
    note: str = ""
    problem: str = ""  # what went wrong, if anything (makes the campaign fail)
    recovery_s: float | None = None  # `ended` to the trainer's next batch
    groups: list[str] = field(default_factory=list)  # the groups it hit, where known


@dataclass
class KindRow:
    kind: str
    injected: int
    affected: int
    unit: str
    recovery_p50_s: float | None
    recovery_max_s: float | None


@dataclass
class ChaosReport:
    pushed: int
    trained_once: int
    trained_twice: int
    lost: int
    dead: int
    dropped: int
    faults: dict[str, int]
    ok: bool
    seed: int
    minutes: float
    batches: int  # committed batches
    dead_reasons: dict[str, int]
    dropped_reasons: dict[str, int]
    by_kind: list[KindRow]
    audit_ok: bool
    audit_summary: str
    checks: list[str]  # what each fault kind promised, and the evidence
    problems: list[str]
    twice_ids: list[str] = field(default_factory=list)
    lost_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["by_kind"] = {r.kind: {k: v for k, v in asdict(r).items() if k != "kind"} for r in self.by_kind}
        return {k: d[k] for k in REPORT_JSON_KEYS}

    def render(self) -> str:
        lines = [f"{'fault':<18} {'injected':>8}  {'affected':<24} {'recovery p50':>12} {'max':>7}"]
        for r in self.by_kind:
            lines.append(f"{r.kind:<18} {r.injected:>8}  {f'{r.affected} {r.unit}':<24} "
                         f"{_seconds(r.recovery_p50_s):>12} {_seconds(r.recovery_max_s):>7}")
        lines.append(f"pushed {self.pushed}, trained once {self.trained_once}, trained twice {self.trained_twice}, "
                     f"lost {self.lost}, dead {self.dead}{_reasons(self.dead_reasons)}, "
                     f"dropped {self.dropped}{_reasons(self.dropped_reasons)}; {self.batches} batches committed")
        lines.append(f"audit: {self.audit_summary}")
        lines += self.checks
        if self.twice_ids:
            lines.append(f"trained twice: {', '.join(self.twice_ids[:10])}")
        if self.lost_ids:
            lines.append(f"lost: {', '.join(self.lost_ids[:10])}")
        lines += [f"problem: {p}" for p in self.problems]
        lines.append("ok" if self.ok else "NOT OK")
        return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _reasons(counts: dict[str, int]) -> str:
    return f" ({', '.join(f'{reason}: {n}' for reason, n in counts.items())})" if counts else ""


def committed_batches(records: Iterable[Record], committed_in_redis: Callable[[str, list[str]], bool]
                      ) -> dict[str, list[str]]:
    """Batch id -> its groups, for every batch whose commit succeeded. A batch with no
    commit record (its trainer was killed or fenced after `train`) is asked about:
    `committed_in_redis(batch, groups)`."""
    trained: dict[str, list[str]] = {}
    recorded: set[str] = set()
    for r in records:
        if r.event == LedgerEvent.TRAIN:
            trained[r.fields["batch"]] = list(r.fields["groups"])
        elif r.event == LedgerEvent.COMMIT:
            recorded.add(r.fields["batch"])
    return {batch: groups for batch, groups in trained.items()
            if batch in recorded or committed_in_redis(batch, groups)}


def set_recovery(faults: list[FaultRecord], batch_times: list[float]) -> None:
    """Each fault's recovery: from its end to the first batch any trainer took after it."""
    times = sorted(batch_times)
    for f in faults:
        if f.ended is None:
            continue
        after = next((t for t in times if t >= f.ended), None)
        f.recovery_s = None if after is None else after - f.ended


def kind_rows(kinds: Iterable[str], faults: list[FaultRecord]) -> list[KindRow]:
    rows = []
    for kind in kinds:
        done = [f for f in faults if f.kind == kind and f.started is not None]
        recoveries = [f.recovery_s for f in done if f.recovery_s is not None]
        rows.append(KindRow(kind, len(done), sum(f.affected for f in done), done[0].unit if done else "",
                            round(statistics.median(recoveries), 3) if recoveries else None,
                            round(max(recoveries), 3) if recoveries else None))
    return rows


_NUMBER = re.compile(r"\d+")


def reason_of(error: str) -> str:
    """A dead letter's error cut to its kind: 'engine failed 3 times; last error: ...' ->
    'engine failed N times'."""
    head = re.split(r"[;:(]", error, maxsplit=1)[0].strip()
    return _NUMBER.sub("N", head) or "unknown"


@dataclass
class Tally:
    """Per pushed group: how often trained, and whether dead or dropped (with why)."""

    trained: Counter
    dead: dict[str, str]  # group id -> error
    dropped: dict[str, str]  # group id -> reason

    def classify(self, pushed: list[str]) -> tuple[list[str], list[str], list[str], list[str]]:
        """(trained once, trained twice or more, lost, trained although never pushed)."""
        once = [g for g in pushed if self.trained[g] == 1]
        twice = [g for g in pushed if self.trained[g] > 1]
        lost = [g for g in pushed if not self.trained[g] and g not in self.dead and g not in self.dropped]
        pushed_set = set(pushed)
        strangers = sorted(g for g in self.trained if g not in pushed_set)
        return once, twice, lost, strangers
