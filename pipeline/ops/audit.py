"""The conservation audit: every pushed group is in exactly one place.

Places: the prompt list, one worker's in-flight hash, the requeue stream, the results
stream (undelivered or pending), the dead-letter stream, or settled (committed,
dropped by a filter or the staleness check, discarded from dead letters). The counts
come from one atomic snapshot (lua/audit.lua), so they are exact on a busy pipeline;
the places that grow with a dataset (the prompt list, the dead letters) are read in
pages, each a bounded step (lua/audit_page.lua), so auditing a namespace of millions
of queued groups never holds the server for long (a long hold answers BUSY to every
other client); a group the pages suggest is in two places, or committed and still
queued, is re-checked atomically. Result payload keys are checked in a further
atomic step (lua/check_results.lua). In-flight checkpoints are counted in the snapshot,
and one left without its group's payload is reported (nothing would ever delete it).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

import redis

from pipeline import scripts
from pipeline.keys import CONSUMER_GROUP
from pipeline.queue import Queue, text
from pipeline.server_checks import read_facts

#: The keys of AuditReport.to_dict(), documented in docs/cli.md (`rollout audit --json`).
AUDIT_JSON_KEYS = (
    "pushed", "prompts", "inflight", "inflight_by_worker", "requeue", "results_undelivered", "results_pending",
    "dead", "dropped", "committed", "discarded", "duplicates_discarded", "accounted", "lost", "extra",
    "in_two_places", "committed_and_live", "orphan_payloads", "missing_payloads", "unregistered_inflight",
    "checkpoints", "checkpoint_bytes", "orphan_checkpoints", "evicted_keys", "eviction_policy", "ok",
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
    checkpoints: int = 0  # groups with an in-flight checkpoint (queued or in flight)
    checkpoint_bytes: int = 0  # their records' bytes
    orphan_checkpoints: int = 0  # checkpoints (or records) of groups with no payload: nothing deletes them
    evicted_keys: int = 0  # keys the server evicted since it started (INFO stats)
    eviction_policy: str = ""  # its maxmemory-policy now

    @property
    def eviction_damage(self) -> bool:
        """Evictions that may have taken this namespace's keys: under an allkeys-* policy any
        key may go; under a volatile-* one only keys with a TTL, which the pipeline leaves
        none of, unless the counts are off too."""
        return self.evicted_keys > 0 and (self.eviction_policy.startswith("allkeys-") or self._conservation_broken)

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
    def _conservation_broken(self) -> bool:
        return bool(self.lost or self.extra or self.in_two_places or self.committed_and_live
                    or self.orphan_payloads or self.missing_payloads or self.orphan_checkpoints)

    @property
    def ok(self) -> bool:
        return not (self._conservation_broken or self.eviction_damage)

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
        if self.checkpoints:
            line += f"; {self.checkpoints} checkpoints ({self.checkpoint_bytes:,} bytes)"
        evicted = (f"Redis evicted {self.evicted_keys} keys since it started (maxmemory-policy "
                   f"{self.eviction_policy})") if self.evicted_keys else ""
        if self.ok:
            return line + ": OK" + (f" ({evicted}, none of them this namespace's as far as the counts show)"
                                    if evicted else "")
        problems = []
        if self.eviction_damage:
            problems.append(f"{evicted}: keys of this namespace may be among them, losing groups without a trace "
                            "(set maxmemory-policy noeviction; every writer now refuses such a server)")
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
        if self.orphan_checkpoints:
            problems.append(f"{self.orphan_checkpoints} orphan checkpoints (or records) of groups with no payload")
        return line + ": PROBLEM: " + "; ".join(problems)


#: Groups per page of the prompt list (one audit_page.lua step each) and entries per page
#: of the dead-letter stream (one XRANGE each, with their data): each page holds the server
#: for a few milliseconds whatever the namespace's size (docs/performance.md: the audit of
#: 1,000,000 queued groups).
PROMPT_PAGE = 500
DEAD_PAGE = 100
#: Candidates re-checked per atomic step; each costs an LPOS over the prompt list.
VERIFY_BATCH = 8


def _snapshot(queue: Queue) -> dict:
    """lua/audit.lua with the in-flight key of every worker, retried while workers
    register between listing them and the script."""
    r, k = queue.redis, queue.keys
    script = scripts.load(r, "audit")["audit"]
    while True:
        ordered = sorted({text(w) for w in r.zrange(k.workers, 0, -1)} | queue.inflight_holders())
        reply = script(keys=[k.prompts, k.payloads, k.workers, k.requeue, k.results, k.dead, k.stats, k.committed,
                             k.checkpoints, k.checkpoint_records, *(k.inflight(w) for w in ordered)],
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


@dataclass
class _PromptScan:
    seen: Counter = field(default_factory=Counter)  # group id -> times read in the prompt list
    missing_payload: set[str] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)


def _scan_prompts(queue: Queue, page: int) -> _PromptScan:
    """Every group that stays in the prompt list while the audit runs, read once, page by
    page from the tail. Rows pushed meanwhile (at the tail) shift the pages toward the
    head: each read is widened by the pushes since the previous one (the 'pushed'
    counter bounds them), and the rows it reads again, the previous page's head end,
    are recognised and skipped."""
    k = queue.keys
    script = scripts.load(queue.redis, "audit_page")["audit_page"]
    scan, offset, previous, pushed_before = _PromptScan(), 0, [], None
    while True:
        widen = 0
        if pushed_before is not None:
            widen = max(0, int(queue.redis.hget(k.stats, "pushed") or 0) - pushed_before)
        reply = script(keys=[k.prompts, k.payloads, k.committed, k.stats], args=[offset, page + widen])
        pushed, flat = int(reply[0]), reply[1:]
        rows = [(text(gid), int(flags)) for gid, flags in zip(flat[::2], flat[1::2])]
        again = _read_again([g for g, _ in rows], previous, pushed - pushed_before) if previous else 0
        fresh = rows[:len(rows) - again]
        for gid, flags in fresh:
            scan.seen[gid] += 1
            if flags & 1:
                scan.missing_payload.add(gid)
            if flags & 2:
                scan.committed.add(gid)
        if len(rows) < page + widen:
            return scan
        offset += len(rows)
        previous, pushed_before = [g for g, _ in rows], pushed


def _read_again(rows: list[str], previous: list[str], pushed: int) -> int:
    """How many rows at the tail end of this page the previous page read already. Rows
    pushed in between moved the previous page's head end (its first `pushed` rows at
    most) into this page's tail end; claims may have taken some of them from the head
    of the list since, so what repeats is a run of `previous` that ends where the last
    row of this page is found."""
    where = {gid: i for i, gid in enumerate(previous[:pushed])}
    end = where.get(rows[-1]) if rows else None
    if end is None:
        return 0
    n = 1
    while n < len(rows) and end - n >= 0 and rows[-1 - n] == previous[end - n]:
        n += 1
    return n


def _scan_dead(queue: Queue, page: int) -> dict[str, list[str]]:
    """Group id -> its entry ids in the dead-letter stream, page by page (entry ids are
    stable: an entry that stays is read exactly once)."""
    out: dict[str, list[str]] = {}
    start = "-"
    while True:
        rows = queue.redis.xrange(queue.keys.dead, start, "+", count=page)
        for eid, fields in rows:
            gid = fields.get(b"gid")
            if gid is not None:
                out.setdefault(text(gid), []).append(text(eid))
        if len(rows) < page:
            return out
        start = "(" + text(rows[-1][0])


def _verify(queue: Queue, gids: list[str], dead: dict[str, list[str]]) -> tuple[set[str], set[str]]:
    """Re-check suspects in atomic steps (the pages were read at other moments than the
    snapshot, so a group that moved meanwhile looks doubled): (in two places now,
    committed and still somewhere now)."""
    r, k = queue.redis, queue.keys
    twice, committed_too = set(), set()
    for i in range(0, len(gids), VERIFY_BATCH):
        batch = gids[i:i + VERIFY_BATCH]
        holders = sorted({text(w) for w in r.zrange(k.workers, 0, -1)} | queue.inflight_holders())
        pipe = r.pipeline(transaction=True)
        for gid in batch:
            pipe.lpos(k.prompts, gid, count=0)
        for w in holders:
            pipe.hmget(k.inflight(w), batch)
        pipe.xrange(k.requeue, "-", "+")
        pipe.xrange(k.results, "-", "+")
        for gid in batch:
            for eid in dead.get(gid, []):
                pipe.xrange(k.dead, eid, eid)
        pipe.zmscore(k.committed, batch)
        replies = pipe.execute()
        places = Counter()
        for gid, positions in zip(batch, replies):
            places[gid] += len(positions or [])
        at = len(batch)
        for held in replies[at:at + len(holders)]:
            for gid, token in zip(batch, held):
                places[gid] += token is not None
        at += len(holders)
        for entries in replies[at:at + 2]:
            for _, fields in entries:
                gid = text(fields.get(b"gid", b""))
                if gid in places or gid in batch:
                    places[gid] += 1
        at += 2
        for gid in batch:
            for _ in dead.get(gid, []):
                places[gid] += bool(replies[at])
                at += 1
        for gid, score in zip(batch, replies[at]):
            if places[gid] > 1:
                twice.add(gid)
            if score is not None and places[gid] > 0:
                committed_too.add(gid)
    return twice, committed_too


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


def audit(queue: Queue, prompt_page: int = PROMPT_PAGE, dead_page: int = DEAD_PAGE) -> AuditReport:
    """Where every pushed group is. The counts come from one atomic snapshot; the prompt
    list and the dead-letter stream, which grow with a dataset, are read page by page
    (bounded steps), and whatever those pages suggest is in two places is re-checked
    atomically before it is reported."""
    snap = _snapshot(queue)
    prompts = _scan_prompts(queue, prompt_page)
    dead = _scan_dead(queue, dead_page)
    placed = snap["placed"] or []
    seen = Counter(placed[::2]) + prompts.seen + Counter({gid: len(ids) for gid, ids in dead.items()})
    suspects = {gid for gid, n in seen.items() if n > 1} | prompts.committed
    if dead:
        dead_ids = list(dead)
        for i in range(0, len(dead_ids), 1000):
            scores = queue.redis.zmscore(queue.keys.committed, dead_ids[i:i + 1000])
            suspects |= {gid for gid, score in zip(dead_ids[i:i + 1000], scores) if score is not None}
    twice, committed_too = _verify(queue, sorted(suspects - set(snap["in_two_places"] or [])), dead)
    # cjson turns empty tables into {} whatever they held: `or` covers the lists.
    stats = {key: _counter(v) for key, v in (snap["stats"] or {}).items()}
    inflight = snap["inflight"] or {}
    missing_results, orphan_results = _check_result_payloads(queue, snap["result_rows"] or [])
    # Every queued or in-flight group has one stored payload: what the snapshot's counts
    # leave over is orphaned (the pages' groups without payload and second copies add back).
    extra_copies = sum(n - 1 for gid, n in prompts.seen.items() if n > 1 and gid in twice)
    orphans = snap["payloads"] - snap["prompts"] - snap["inflight_payloads"] + len(prompts.missing_payload) \
        + extra_copies
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
        in_two_places=sorted(set(snap["in_two_places"] or []) | twice),
        committed_and_live=sorted(set(snap["committed_too"] or []) | committed_too),
        orphan_payloads=max(0, orphans) + orphan_results,
        missing_payloads=snap["missing_payloads"] + len(prompts.missing_payload) + missing_results,
        unregistered_inflight=sorted(snap["unregistered"] or []),
        checkpoints=snap["checkpoints"],
        checkpoint_bytes=snap["checkpoint_bytes"],
        orphan_checkpoints=snap["orphan_checkpoints"],
        **_evictions(queue),
    )


def _evictions(queue: Queue) -> dict:
    """What the server evicted since it started, and its policy (nothing for a cluster
    client, whose INFO answers per node)."""
    try:
        facts = read_facts(queue.redis)
    except (redis.RedisError, TypeError, ValueError, AttributeError, KeyError):
        return {}
    return {"evicted_keys": facts.evicted_keys, "eviction_policy": facts.policy}
