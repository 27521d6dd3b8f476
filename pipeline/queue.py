"""The queue's state machine: the atomic operations every other part calls.

A group id is in exactly one place at a time: the prompt list, one worker's
in-flight set, the requeue stream, the results stream, the dead-letter stream, or
settled (committed, dropped, discarded). The encoded group rides along: in the
`payloads` hash while queued or in flight, inside the stream entry otherwise.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import redis

from .codec import DecodeError, decode_group, encode_group
from .control import RELEASE_POLICIES
from .keys import CONSUMER_GROUP, Keys
from .types import Group, Status

log = logging.getLogger(__name__)

_LUA = Path(__file__).with_name("lua")
DEFAULT_LEASE_S = 30.0
COMMITTED_IDS_KEPT = 200_000  # recent committed ids remembered for deduplication (~16 MB)
DEFAULT_MAX_READY = 4096  # results backlog at which workers stop claiming, unless configured
STAGED_TTL_S = 3600  # a staged result outlives its publish only if the worker died in between


class Place:
    """Where a finished group goes: the stream and the counter it bumps."""

    RESULTS = "results"
    REQUEUE = "requeue"
    DEAD = "dead"


@dataclass
class Claimed:
    group: Group | None  # None when the stored payload did not decode
    group_id: str
    error: str | None = None


@dataclass
class Claim:
    status: str  # ok, empty, paused, backlog, budget
    weight_version: int
    groups: list[Claimed] = field(default_factory=list)


@dataclass
class StreamEntry:
    entry_id: str
    group_id: str
    data: bytes
    error: str | None = None

    def decode(self) -> Group:
        return decode_group(self.data)

    def decode_or_dead(self, stream: str) -> tuple[Group | None, Settle | None]:
        """The entry's group, or (None, the Settle that dead-letters it) when it is malformed."""
        try:
            return self.decode(), None
        except DecodeError as exc:
            log.error("group %s: %s entry %s is malformed (%s); dead-lettering it",
                      self.group_id, stream, self.entry_id, exc)
            return None, Settle("dead", self.entry_id, self.group_id, f"malformed {stream} entry: {exc}", self.data)


@dataclass
class Settle:
    """One stream entry leaving its stream; see lua/settle.lua for the actions."""

    action: str
    entry_id: str
    group_id: str
    text: str = ""
    payload: bytes = b""


@dataclass
class Heartbeat:
    was_registered: bool
    paused: bool
    weight_version: int


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def reset_group(group: Group) -> Group:
    """The group as it was pushed: every generated token forgotten."""
    for s in group.samples:
        s.tokens, s.response_length, s.response = [], 0, ""
        s.reward, s.loss_mask, s.rollout_log_probs = None, None, None
        s.weight_versions, s.status = [], Status.PENDING
    group.prompt_ids = []
    return group


class Queue:
    """Atomic operations on one pipeline namespace."""

    def __init__(self, client: redis.Redis, namespace: str, lease_s: float = DEFAULT_LEASE_S):
        self.redis = client
        self.keys = Keys(namespace)
        self.lease_s = lease_s
        self._scripts = {
            name: client.register_script((_LUA / f"{name}.lua").read_text())
            for name in ("claim", "publish", "heartbeat", "reap", "push", "settle")
        }

    # -- workers -----------------------------------------------------------------

    def claim(self, worker: str, max_groups: int) -> Claim:
        k = self.keys
        reply = self._scripts["claim"](
            keys=[k.prompts, k.payloads, k.inflight(worker), k.workers, k.control, k.results, k.admitted, k.stats],
            args=[worker, max_groups, DEFAULT_MAX_READY],
        )
        claim = Claim(status=_text(reply[0]), weight_version=int(reply[1]))
        for i in range(2, len(reply), 3):
            gid, payload, admitted = _text(reply[i]), reply[i + 1], reply[i + 2]
            try:
                if not payload:
                    raise DecodeError("no payload stored for this group id")
                group = decode_group(payload)
                if group.group_id != gid:
                    raise DecodeError(f"payload is for group {group.group_id!r}")
            except DecodeError as exc:
                log.error("group %s: stored payload is malformed (%s); dead-lettering it", gid, exc)
                self.publish(worker, gid, payload or b"", Place.DEAD, error=f"malformed payload: {exc}")
                claim.groups.append(Claimed(None, gid, str(exc)))
                continue
            if group.admitted_version is None and admitted is not None:
                group.admitted_version = int(admitted)
            claim.groups.append(Claimed(group, gid))
        return claim

    def publish(self, worker: str, group_id: str, payload: bytes, place: str, error: str | None = None) -> str | None:
        """Move a group out of `worker`'s in-flight set into a stream. Returns the
        entry id, or None when the worker no longer holds the group (it was reaped)."""
        k = self.keys
        stream = {Place.RESULTS: k.results, Place.REQUEUE: k.requeue, Place.DEAD: k.dead}[place]
        keys = [k.inflight(worker), k.payloads, stream, k.stats, k.admitted]
        if place == Place.RESULTS:
            # Staged with a plain SET, then renamed by the script: see lua/publish.lua.
            # It expires if this process dies before the script runs.
            staged = k.staged(worker, group_id)
            self.redis.set(staged, payload, ex=STAGED_TTL_S)
            keys += [staged, k.result(group_id)]
            payload = b""
        entry_id = self._scripts["publish"](keys=keys, args=[group_id, payload, place, error or ""])
        if entry_id is None:
            log.warning("group %s: worker %s no longer holds it (reaped); not publishing", group_id, worker)
            return None
        return _text(entry_id)

    def publish_group(self, worker: str, group: Group, place: str, error: str | None = None,
                      keep_response_text: bool = False) -> str | None:
        """Encode and publish. Results leave out the response texts unless asked: the
        trainer trains on tokens, and text is ~20% of a finished group's bytes. Requeued
        and dead-lettered groups keep them (a continuation appends to the text)."""
        with_text = keep_response_text or place != Place.RESULTS
        return self.publish(worker, group.group_id, encode_group(group, with_text), place, error)

    def heartbeat(self, worker: str, info: str) -> Heartbeat:
        k = self.keys
        was, paused, version = self._scripts["heartbeat"](keys=[k.workers, k.worker_info, k.control],
                                                          args=[worker, info])
        return Heartbeat(bool(was), bool(paused), int(version))

    def reap(self, worker: str, lease_s: float | None = None) -> int:
        """Return `worker`'s groups to the prompt list if its lease expired (lease 0:
        unconditionally). Returns how many, or -1 if the worker is alive."""
        k = self.keys
        lease_ms = int(1000 * (self.lease_s if lease_s is None else lease_s))
        n = int(self._scripts["reap"](keys=[k.workers, k.inflight(worker), k.prompts, k.worker_info, k.stats],
                                      args=[worker, lease_ms]))
        if n > 0:
            log.warning("reaped worker %s: %d in-flight groups back to the prompt list", worker, n)
        return n

    def reap_expired(self) -> int:
        """Reap every worker whose heartbeat is older than the lease."""
        seconds, micros = self.redis.time()
        cutoff = seconds * 1000 + micros // 1000 - int(self.lease_s * 1000)
        total = 0
        for worker in self.redis.zrangebyscore(self.keys.workers, "-inf", cutoff):
            total += max(0, self.reap(_text(worker)))
        return total

    def leave(self, worker: str) -> int:
        """A worker shutting down hands its in-flight groups back right away."""
        return self.reap(worker, lease_s=0)

    # -- producer ----------------------------------------------------------------

    def push(self, cursor_field: str, expected_cursor: int, items: list[tuple[str, str, bytes]]) -> tuple[bool, int]:
        """Push (destination, group id, payload) items if the cursor is where the caller
        expects; destination is 'prompt' or an error text (the row is dead-lettered).
        Returns (pushed, cursor after)."""
        k = self.keys
        args: list = [cursor_field, expected_cursor]
        for dest, gid, payload in items:
            args += [dest, gid, payload]
        status, cursor = self._scripts["push"](keys=[k.prompts, k.payloads, k.stats, k.dataset, k.dead], args=args)
        return _text(status) == "ok", int(cursor)

    def push_groups(self, groups: list[Group]) -> None:
        """Push groups without a dataset cursor (tests, retries, tools)."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=True)
        for g in groups:
            pipe.hset(k.payloads, g.group_id, encode_group(g))
            pipe.rpush(k.prompts, g.group_id)
        pipe.hincrby(k.stats, "pushed", len(groups))
        pipe.execute()

    # -- streams -----------------------------------------------------------------

    def settle(self, stream: str, items: list[Settle], consumer_group: str = "") -> int:
        if not items:
            return 0
        k = self.keys
        args: list = [consumer_group, COMMITTED_IDS_KEPT]
        for it in items:
            args += [it.action, it.entry_id, it.group_id, it.text, it.payload]
        keys = [stream, k.prompts, k.payloads, k.dead, k.dropped, k.committed, k.stats, k.admitted]
        if stream == k.results:
            keys += [k.result(it.group_id) for it in items]
        return int(self._scripts["settle"](keys=keys, args=args))

    def entries(self, stream: str, rows: list, with_data: bool = True) -> list[StreamEntry]:
        """StreamEntry objects from XRANGE/XREADGROUP rows. Results entries carry only
        the group id: their payloads come from the result keys, in one MGET."""
        entries = [_entry(eid, fields) for eid, fields in rows if fields]
        if stream == self.keys.results and with_data and entries:
            payloads = self.redis.mget([self.keys.result(e.group_id) for e in entries])
            for e, payload in zip(entries, payloads):
                e.data = payload or b""  # missing: decodes as malformed and is dead-lettered
        return entries

    def read_stream(self, stream: str, count: int = 100, start: str = "-", with_data: bool = True) -> list[StreamEntry]:
        return self.entries(stream, self.redis.xrange(stream, start, "+", count=count), with_data)

    def iter_stream(self, stream: str, page: int = 200, with_data: bool = True):
        start = "-"
        while True:
            entries = self.read_stream(stream, page, start, with_data)
            yield from entries
            if len(entries) < page:
                return
            start = "(" + entries[-1].entry_id

    def release(self, policy: str = "continue", max_count: int = 1000) -> int:
        """Move aborted groups from the requeue stream back to the head of the prompt
        list. `continue` keeps their partial output, `restart` forgets it, `drop`
        drops them (counted, logged). Malformed entries go to dead letters."""
        if policy not in RELEASE_POLICIES:
            raise ValueError(f"unknown release policy {policy!r}: use one of {', '.join(RELEASE_POLICIES)}")
        items = []
        for entry in self.read_stream(self.keys.requeue, max_count):
            group, dead = entry.decode_or_dead("requeue")
            if dead:
                items.append(dead)
                continue
            if policy == "drop":
                items.append(Settle("drop", entry.entry_id, group.group_id, "requeue-drop"))
                continue
            if policy == "restart":
                payload = encode_group(reset_group(group))
            else:
                payload = entry.data  # continue: as the worker left it, already validated
            items.append(Settle("prompt", entry.entry_id, group.group_id, payload=payload))
        # Reversed: each item goes to the head, so the oldest ends up first.
        return self.settle(self.keys.requeue, items[::-1])

    def ensure_consumer_group(self) -> None:
        try:
            self.redis.xgroup_create(self.keys.results, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- state ---------------------------------------------------------------------

    def live_workers(self) -> dict[str, float]:
        """Workers whose lease has not expired, with seconds since their heartbeat."""
        seconds, micros = self.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        rows = self.redis.zrangebyscore(self.keys.workers, now_ms - int(self.lease_s * 1000), "+inf", withscores=True)
        return {_text(w): (now_ms - score) / 1000 for w, score in rows}

    def depths(self) -> dict[str, int]:
        """Groups queued, waiting in each stream; one round trip."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(k.prompts)
        pipe.xlen(k.results)
        pipe.xlen(k.requeue)
        pipe.xlen(k.dead)
        prompts, results, requeue, dead = pipe.execute()
        return {"prompts": prompts, "results": results, "requeue": requeue, "dead": dead}

    def stats(self) -> dict[str, int]:
        return {_text(k): int(v) for k, v in self.redis.hgetall(self.keys.stats).items()}


def _entry(entry_id, fields: dict) -> StreamEntry:
    return StreamEntry(
        entry_id=_text(entry_id),
        group_id=_text(fields.get(b"gid", b"")),
        data=fields.get(b"data", b""),
        error=_text(fields.get(b"error")),
    )

