"""The conservation audit: every pushed group is in exactly one place.

Places: the prompt list, one worker's in-flight set, the requeue stream, the results
stream (undelivered or pending), the dead-letter stream, or settled (committed,
dropped by a filter or the staleness check, discarded from dead letters). The audit
counts each, lists group ids found in two places at once, and checks the counts add
up to what was pushed. It reads whole streams, so it is an operator's tool, not a
hot-path call.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import redis

from .keys import CONSUMER_GROUP
from .queue import Queue, _text


@dataclass
class AuditReport:
    pushed: int
    prompts: int
    inflight: dict[str, int]
    requeue: int
    results_undelivered: int
    results_pending: int
    dead: int
    dropped: int
    committed: int
    discarded: int
    duplicates: list[str] = field(default_factory=list)  # group ids in more than one place
    orphan_payloads: int = 0  # stored payloads of groups neither queued nor in flight
    missing_payloads: int = 0  # queued or in-flight group ids with no payload

    @property
    def accounted(self) -> int:
        return (self.prompts + sum(self.inflight.values()) + self.requeue + self.results_undelivered
                + self.results_pending + self.dead + self.dropped + self.committed + self.discarded)

    @property
    def missing(self) -> int:
        """Pushed but found nowhere (negative: found more than pushed)."""
        return self.pushed - self.accounted

    @property
    def ok(self) -> bool:
        return (self.missing == 0 and not self.duplicates and not self.orphan_payloads
                and not self.missing_payloads)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(accounted=self.accounted, missing=self.missing, ok=self.ok)
        return d

    def summary(self) -> str:
        inflight = sum(self.inflight.values())
        line = (f"pushed {self.pushed} = prompts {self.prompts} + in flight {inflight} + requeue {self.requeue}"
                f" + results {self.results_undelivered}+{self.results_pending} pending + dead {self.dead}"
                f" + dropped {self.dropped} + committed {self.committed} + discarded {self.discarded}")
        if self.ok:
            return line + ": OK"
        problems = []
        if self.missing:
            problems.append(f"{self.missing} missing" if self.missing > 0 else f"{-self.missing} extra")
        if self.duplicates:
            problems.append(f"{len(self.duplicates)} in two places: {', '.join(self.duplicates[:5])}")
        if self.orphan_payloads:
            problems.append(f"{self.orphan_payloads} orphan payloads")
        if self.missing_payloads:
            problems.append(f"{self.missing_payloads} groups without payload")
        return line + ": PROBLEM: " + "; ".join(problems)


def audit(queue: Queue) -> AuditReport:
    r, k = queue.redis, queue.keys
    places: Counter[str] = Counter()

    prompts = [_text(g) for g in r.lrange(k.prompts, 0, -1)]
    places.update(set(prompts))
    # Workers are registered in the workers set; also find in-flight sets of workers
    # that are not (they should not exist, but an audit looks everywhere).
    workers = {_text(w) for w in r.zrange(k.workers, 0, -1)}
    workers |= {_text(key).split(":inflight:", 1)[1] for key in r.scan_iter(match=k.inflight_pattern, count=1000)}
    inflight: dict[str, int] = {}
    inflight_ids: list[str] = []
    for w in sorted(workers):
        ids = [_text(g) for g in r.smembers(k.inflight(w))]
        if ids:
            inflight[w] = len(ids)
            inflight_ids += ids
    places.update(inflight_ids)

    def stream_ids(stream: str) -> list[str]:
        return [e.group_id for e in queue.iter_stream(stream, with_data=False)]

    requeue_ids = stream_ids(k.requeue)
    results_ids = stream_ids(k.results)
    dead_ids = stream_ids(k.dead)
    for ids in (requeue_ids, results_ids, dead_ids):
        places.update(ids)
    pending = 0
    try:
        pending = int(r.xpending(k.results, CONSUMER_GROUP)["pending"])
    except redis.ResponseError:  # no consumer group yet: nothing is pending
        pending = 0
    # Group ids that repeat within a list count as duplicates too.
    duplicates = sorted({g for g, c in places.items() if c > 1}
                        | {g for g, c in Counter(prompts).items() if c > 1}
                        | {g for ids in (requeue_ids, results_ids, dead_ids) for g, c in Counter(ids).items() if c > 1})
    committed_live = r.zmscore(k.committed, list(places)) if places else []
    duplicates += sorted(g for g, score in zip(places, committed_live) if score is not None and g not in duplicates)

    live = set(prompts) | set(inflight_ids)
    stored = {_text(g) for g in r.hkeys(k.payloads)}
    prefix = len(k.result(""))
    result_payloads = {_text(key)[prefix:] for key in r.scan_iter(match=k.result_pattern, count=1000)}
    stats = queue.stats()
    return AuditReport(
        pushed=stats.get("pushed", 0),
        prompts=len(prompts),
        inflight=inflight,
        requeue=len(requeue_ids),
        results_undelivered=len(results_ids) - pending,
        results_pending=pending,
        dead=len(dead_ids),
        dropped=stats.get("dropped", 0),
        committed=stats.get("committed", 0),
        discarded=stats.get("discarded", 0),
        duplicates=duplicates,
        orphan_payloads=len(stored - live) + len(result_payloads - set(results_ids)),
        missing_payloads=len(live - stored) + len(set(results_ids) - result_payloads),
    )
