"""The conservation audit: every pushed group is in exactly one place.

Places: the prompt list, one worker's in-flight hash, the requeue stream, the results
stream (undelivered or pending), the dead-letter stream, or settled (committed,
dropped by a filter or the staleness check, discarded from dead letters). The counts
come from one atomic snapshot (lua/audit.lua), so the audit is exact on a busy
pipeline; result payload keys are checked in a second atomic step (lua/check_results.lua).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pipeline import scripts
from pipeline.keys import CONSUMER_GROUP
from pipeline.queue import Queue, text

#: The keys of AuditReport.to_dict(), documented in docs/cli.md (`rollout audit --json`).
AUDIT_JSON_KEYS = (
    "pushed", "prompts", "inflight", "inflight_by_worker", "requeue", "results_undelivered", "results_pending",
    "dead", "dropped", "committed", "discarded", "duplicates_discarded", "accounted", "lost", "extra",
    "in_two_places", "committed_and_live", "orphan_payloads", "missing_payloads", "unregistered_inflight", "ok",
)


@dataclass
class AuditReport:
    pushed: int
    prompts: int
    inflight: dict[str, int]  # worker -> groups it holds
    requeue: int
    results_undelivered: int
    results_pending: int
    dead: int
    dropped: int
    committed: int
    discarded: int
    duplicates_discarded: int = 0  # second copies of a group the trainer threw away (not pushed groups)
    in_two_places: list[str] = field(default_factory=list)  # group ids found in more than one place
    committed_and_live: list[str] = field(default_factory=list)  # committed, yet still somewhere
    orphan_payloads: int = 0  # stored payloads of groups in no place
    missing_payloads: int = 0  # groups in a place with no payload
    unregistered_inflight: list[str] = field(default_factory=list)  # in-flight hashes of unregistered workers

    @property
    def accounted(self) -> int:
        return (self.prompts + sum(self.inflight.values()) + self.requeue + self.results_undelivered
                + self.results_pending + self.dead + self.dropped + self.committed + self.discarded)

    @property
    def lost(self) -> int:
        """Pushed but found nowhere."""
        return max(0, self.pushed - self.accounted)

    @property
    def extra(self) -> int:
        """Found more often than pushed."""
        return max(0, self.accounted - self.pushed)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.extra or self.in_two_places or self.committed_and_live
                    or self.orphan_payloads or self.missing_payloads)

    def to_dict(self) -> dict:
        d = asdict(self)
        # As `rollout status --json` names them: inflight the total, inflight_by_worker the split.
        d.update(inflight=sum(self.inflight.values()), inflight_by_worker=d["inflight"], accounted=self.accounted,
                 lost=self.lost, extra=self.extra, ok=self.ok)
        return {k: d[k] for k in AUDIT_JSON_KEYS}

    def summary(self) -> str:
        inflight = sum(self.inflight.values())
        line = (f"pushed {self.pushed} = prompts {self.prompts} + in flight {inflight} + requeue {self.requeue}"
                f" + results {self.results_undelivered}+{self.results_pending} pending + dead {self.dead}"
                f" + dropped {self.dropped} + committed {self.committed} + discarded {self.discarded}")
        if self.duplicates_discarded:
            line += f" ({self.duplicates_discarded} duplicate copies discarded)"
        if self.ok:
            return line + ": OK"
        problems = []
        if self.lost:
            problems.append(f"{self.lost} lost")
        if self.extra:
            problems.append(f"{self.extra} extra")
        if self.in_two_places:
            problems.append(f"{len(self.in_two_places)} in two places: {', '.join(self.in_two_places[:5])}")
        if self.committed_and_live:
            problems.append(f"{len(self.committed_and_live)} committed yet still queued: "
                            f"{', '.join(self.committed_and_live[:5])}")
        if self.orphan_payloads:
            problems.append(f"{self.orphan_payloads} orphan payloads")
        if self.missing_payloads:
            problems.append(f"{self.missing_payloads} groups without payload")
        return line + ": PROBLEM: " + "; ".join(problems)


def _snapshot(queue: Queue) -> dict:
    """lua/audit.lua with the in-flight key of every worker, retried while workers
    register between listing them and the script."""
    r, k = queue.redis, queue.keys
    script = scripts.load(r, "audit")["audit"]
    while True:
        ordered = sorted({text(w) for w in r.zrange(k.workers, 0, -1)} | queue.inflight_holders())
        reply = script(keys=[k.prompts, k.payloads, k.workers, k.requeue, k.results, k.dead, k.stats, k.committed,
                             *(k.inflight(w) for w in ordered)],
                       args=[CONSUMER_GROUP, *ordered])
        if text(reply) != "retry":
            # cjson copies ids byte for byte: a foreign id that is not UTF-8 must not break the
            # audit, it is counted and shown escaped (b"\xff" as "\\xff"), as everywhere else.
            raw = reply.decode("utf-8", "surrogateescape") if isinstance(reply, bytes) else reply
            return _escaped(json.loads(raw))


def _escaped(value):
    """`value` (parsed JSON) with every string that held non-UTF-8 bytes escaped."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    return value


def _check_result_payloads(queue: Queue, rows: list) -> tuple[int, int]:
    """(entries whose payload key is missing, payload keys no entry names)."""
    r, k = queue.redis, queue.keys
    candidates = list(r.scan_iter(match=k.result_pattern, count=1000))
    if not rows and not candidates:
        return 0, 0
    script = scripts.load(r, "check_results")["check_results"]
    prefix = k.result("", "")[:-1]  # "{ns}:result:"
    missing, orphans = script(keys=[k.results, *(k.result(gid, tok) for _, gid, tok in rows), *candidates],
                              args=[len(rows), *(eid for eid, _, _ in rows), prefix])
    return int(missing), int(orphans)


def _counter(value: str) -> int:
    try:
        return int(value)
    except ValueError:  # a foreign value: Queue.stats() logs it; the audit reads it as 0
        return 0


def audit(queue: Queue) -> AuditReport:
    snap = _snapshot(queue)
    # cjson turns empty tables into {} whatever they held: `or` covers the lists.
    stats = {key: _counter(v) for key, v in (snap["stats"] or {}).items()}
    inflight = snap["inflight"] or {}
    missing_results, orphan_results = _check_result_payloads(queue, snap["result_rows"] or [])
    return AuditReport(
        pushed=stats.get("pushed", 0),
        prompts=snap["prompts"],
        inflight={w: int(n) for w, n in sorted(inflight.items())},
        requeue=snap["requeue"],
        results_undelivered=snap["results"] - snap["pending"],
        results_pending=snap["pending"],
        dead=snap["dead"],
        dropped=stats.get("dropped", 0),
        committed=stats.get("committed", 0),
        discarded=stats.get("discarded", 0),
        duplicates_discarded=stats.get("duplicates", 0),
        in_two_places=sorted(snap["in_two_places"] or []),
        committed_and_live=sorted(snap["committed_too"] or []),
        orphan_payloads=snap["orphan_payloads"] + orphan_results,
        missing_payloads=snap["missing_payloads"] + missing_results,
        unregistered_inflight=sorted(snap["unregistered"] or []),
    )
