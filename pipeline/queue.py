"""The queue's state machine: the atomic operations every other part calls.

A group id is in exactly one place at a time: the prompt list, one worker's in-flight
hash, the requeue stream, the results stream, the dead-letter stream, or settled
(committed, dropped, discarded). The encoded group rides along: in the `payloads`
hash while queued or in flight, inside the stream entry (or, for results, in a key
named by the entry) otherwise.

Ownership is fenced: a worker holds each group under the id of the claim that took
it (its token), and publishing or handing it back checks that token in the same
script that moves it. Workers register explicitly with a lease deadline; one that
was reaped learns so at its next contact and registers anew.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Iterator

import redis

from . import scripts
from .checkpoints import (CHECKPOINT_MAX_BYTES, CHECKPOINT_MAX_RECORDS, CheckpointOutcome, CheckpointWrite,
                          GroupCheckpoint)
from .codec import DecodeError, decode_group, encode_group
from .control import DEFAULT_LEASE_S, DEFAULT_MAX_CLAIMS, DEFAULT_MAX_READY
from .keys import Keys
from .types import DeadReason, Group, ReleasePolicy, VersionClock
from .writer import ScriptCall, TrainerSession, fenced, settle_arguments

log = logging.getLogger(__name__)

STAGED_TTL_S = 3600  # a staged result outlives its MULTI only if the publish script failed (NOSCRIPT twice)
#: The payload bytes one publish MULTI carries at most (a group larger than that goes
#: alone): Redis counts a transaction's queued arguments against maxmemory until EXEC.
PUBLISH_MULTI_BYTES = 8 << 20
#: Outcomes remembered for the retry of a publish_many that raised (Queue._landed).
LANDED_KEPT = 10_000
#: A dead letter larger than this keeps only its first DEAD_LETTER_HEAD bytes and its size:
#: a 50 MB poison row must not become a 50 MB dead letter.
DEAD_LETTER_MAX_BYTES = 1 << 20
DEAD_LETTER_HEAD = 4096


class ClaimStatus(StrEnum):
    OK = "ok"
    EMPTY = "empty"  # nothing queued
    PAUSED = "paused"  # admission paused for a weight update
    BACKLOG = "backlog"  # max_ready results wait for the trainer
    BUDGET = "budget"  # the staleness budget is spent until the weight version moves
    ISOLATING = "isolating"  # a group whose holders died twice runs alone (see lua/claim.lua)
    UNREGISTERED = "unregistered"  # this worker id was reaped (or never registered)
    EXPIRED = "expired"  # its lease ran out; a heartbeat renews it unless it was reaped meanwhile


class Place(StrEnum):
    """Where a finished group goes: the stream, and the stats counter it bumps."""

    RESULTS = "results"
    REQUEUE = "requeue"
    DEAD = "dead"


class Published(StrEnum):
    OK = "ok"
    ALREADY = "already"  # a retry of a publish whose reply was lost: it went through
    REFUSED = "refused"  # the worker no longer holds the group under this token


@dataclass
class ClaimedGroup:
    group_id: str
    token: str  # the claim id: publish and hand-back must present it
    payload: bytes  # as stored: what a dead letter keeps if the group cannot be encoded again
    group: Group | None  # None when the stored payload did not decode (it was dead-lettered)
    checkpoint: GroupCheckpoint | None = None  # what an earlier holder saved of its samples (pipeline/checkpoints.py)


@dataclass
class Claim:
    status: ClaimStatus
    weight_version: int
    groups: list[ClaimedGroup] = field(default_factory=list)


@dataclass
class Heartbeat:
    reaped: bool  # this worker id is no longer registered: cancel its work, register anew
    paused: bool
    weight_version: int
    lease_s: float
    version_clock: VersionClock = VersionClock.ENGINE


@dataclass
class StreamEntry:
    entry_id: str
    group_id: str
    data: bytes
    error: str | None = None
    token: str = ""  # results entries: the claim token naming the payload key
    reason: str | None = None  # dead letters: the short category (max_claims, missing_label, engine, ...)
    fate: str = ""  # results entries a Consumer handed out: committed or handed back (its ledger)

    def decode(self) -> Group:
        return decode_group(self.data)

    def decode_or_dead(self, stream: str) -> tuple[Group | None, Settle | None]:
        """The entry's group, or (None, the Settle that dead-letters it) when it is malformed."""
        try:
            return self.decode(), None
        except DecodeError as exc:
            log.error("group %s: %s entry %s is malformed (%s); dead-lettering it",
                      self.group_id, stream, self.entry_id, exc)
            return None, Settle("dead", self.entry_id, self.group_id, f"malformed {stream} entry: {exc}",
                                bounded_dead_letter(self.data)[0], reason=DeadReason.MALFORMED)


@dataclass
class Publish:
    """One finished group for Queue.publish_many: where it goes and, for a dead letter,
    why (`reason` is the short category: `dead list`, the `dead_<reason>` counter)."""

    group_id: str | bytes
    token: str
    payload: bytes
    place: Place
    error: str | None = None
    reason: str = ""


@dataclass
class Settle:
    """One stream entry leaving its stream; see lua/settle.lua for the actions."""

    action: str
    entry_id: str
    group_id: str
    text: str = ""
    payload: bytes = b""
    token: str = ""  # results entries: names the payload key deleted with the entry
    reason: str = ""  # dead: the dead letter's category (DeadReason)


def text(value: bytes | str | None) -> str | None:
    """A Redis value as text. Never raises: a foreign non-UTF-8 value is shown escaped."""
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def bounded_dead_letter(payload: bytes) -> tuple[bytes, str]:
    """What a dead letter stores of a payload, and a note when it was cut."""
    if len(payload) <= DEAD_LETTER_MAX_BYTES:
        return payload, ""
    return payload[:DEAD_LETTER_HEAD], f" [payload of {len(payload):,} bytes cut to its first {DEAD_LETTER_HEAD}]"


class Queue:
    """Atomic operations on one pipeline namespace."""

    def __init__(self, client: redis.Redis, namespace: str):
        self.redis = client
        self.keys = Keys(namespace)
        self._scripts = scripts.load(client, "claim", "register", "heartbeat", "reap", "handback", "publish",
                                     "push", "settle", "checkpoint")
        #: (worker, group id, token) -> outcome of a group a publish_many call moved before it
        #: raised: its retry answers them without sending their payloads again.
        self._landed: dict[tuple[str, str, str], Published] = {}

    # -- workers -----------------------------------------------------------------

    def register(self, worker: str, info: str = "{}") -> float:
        """Register a worker id with a lease; returns the lease in seconds. An id is
        registered once: a worker that was reaped registers under a new one."""
        k = self.keys
        status, lease_ms = self._scripts["register"](keys=[k.workers, k.worker_info, k.control, k.beats],
                                                     args=[worker, info, int(DEFAULT_LEASE_S * 1000)])
        if text(status) != "ok":
            raise ValueError(f"worker id {worker!r} is registered already")
        return int(lease_ms) / 1000

    def claim(self, worker: str, claim_id: str, max_groups: int) -> Claim:
        """Claim up to `max_groups` groups under `claim_id`, their fencing token. Calling
        again with the same claim id returns the same groups (a retry after a lost reply).
        Each comes with the checkpoint an earlier holder saved of it, if any."""
        k = self.keys
        reply = self._scripts["claim"](
            keys=[k.prompts, k.payloads, k.inflight(worker), k.workers, k.control, k.results, k.admitted,
                  k.stats, k.claims, k.history, k.dead, k.last_claim, k.isolated, k.holders, k.checkpoints,
                  k.checkpoint_records],
            args=[worker, claim_id, max_groups, DEFAULT_MAX_READY, DEFAULT_MAX_CLAIMS],
        )
        claim = Claim(status=ClaimStatus(text(reply[0])), weight_version=int(reply[1]))
        for i in range(2, len(reply), 4):
            raw_gid, payload, admitted, checkpoint = reply[i], reply[i + 1] or b"", reply[i + 2], reply[i + 3]
            claimed = self._claimed(worker, claim_id, raw_gid, payload, admitted)
            if claimed.group is not None and checkpoint:
                claimed.checkpoint = _checkpoint(claimed.group_id, checkpoint)
            claim.groups.append(claimed)
        return claim

    def _claimed(self, worker: str, token: str, raw_gid: bytes, payload: bytes, admitted) -> ClaimedGroup:
        """Decode one claimed group; a foreign or corrupt one is dead-lettered right here."""
        gid = text(raw_gid)
        try:
            raw_gid.decode("utf-8")
            if not payload:
                raise DecodeError("no payload stored for this group id")
            group = decode_group(payload)
            if group.group_id != gid:
                raise DecodeError(f"payload is for group {group.group_id!r}")
        except (DecodeError, UnicodeDecodeError) as exc:
            error = "group id is not UTF-8" if isinstance(exc, UnicodeDecodeError) else f"malformed payload: {exc}"
            log.error("group %s: %s; dead-lettering it", gid, error)
            self.publish(worker, raw_gid, token, payload, Place.DEAD, error=error, reason=DeadReason.MALFORMED)
            return ClaimedGroup(gid, token, payload, None)
        if group.admitted_version is None and admitted is not None:
            group.admitted_version = int(admitted)
        return ClaimedGroup(gid, token, payload, group)

    def checkpoint(self, worker: str, writes: list[CheckpointWrite]) -> list[CheckpointOutcome]:
        """Save the checkpoints of groups `worker` holds, in one script call (lua/checkpoint.lua):
        each only under the token it holds its group under. A retry of the whole call is safe
        (what went through answers `already`). Returns an outcome per write, in order."""
        if not writes:
            return []
        k = self.keys
        args: list = [worker, CHECKPOINT_MAX_RECORDS, CHECKPOINT_MAX_BYTES]
        for w in writes:
            args += [w.group_id, w.token, "full" if w.full else "append", w.records_before, w.tokens, w.write_id,
                     w.record]
        reply = self._scripts["checkpoint"](
            keys=[k.inflight(worker), k.checkpoints, k.checkpoint_records, k.stats], args=args)
        outcomes = [CheckpointOutcome(text(r)) for r in reply]
        for w, outcome in zip(writes, outcomes):
            if outcome == CheckpointOutcome.REFUSED:
                log.info("group %s: worker %s no longer holds it under claim %s; its checkpoint was not written",
                         w.group_id, worker, w.token)
        return outcomes

    def publish(self, worker: str, group_id: str | bytes, token: str, payload: bytes, place: Place,
                error: str | None = None, reason: str = "") -> Published:
        """Move a group out of `worker`'s in-flight hash into a stream, if the worker
        still holds it under `token`. A dead letter's `reason` is its short category
        (for `dead list` and the `dead_<reason>` counter behind the metrics)."""
        return self.publish_many(worker, [Publish(group_id, token, payload, place, error, reason)])[0]

    def publish_many(self, worker: str, items: list[Publish]) -> list[Published]:
        """Publish several groups of `worker`: per group, the staged SET of a result and the
        publish script (lua/publish.lua) in one MULTI, so Redis runs them in one event-loop
        pass, one AOF write and, under appendfsync always, one fsync for all. Each group is
        checked and moved on its own (a refused one does not stop the others). Returns an
        outcome per item, in order.

        A MULTI carries at most PUBLISH_MULTI_BYTES of payloads: Redis holds a transaction's
        queued arguments in memory until EXEC, so a batch can pass maxmemory where its groups
        one by one fit. A MULTI refused for memory is split (each part at most half the
        headroom INFO reports) down to single groups; a single group refused for memory
        raises OutOfMemoryError, transient: the caller's Reconnect waits for room. A retry of
        the whole call is safe, and cheap: groups that landed before it raised are answered
        from `_landed` without their payloads being sent again (what went through answers
        `already` anyway). Errors never quote payload bytes (redis-py's text of a failed
        pipeline command quotes its arguments)."""
        calls = [self._publish_call(worker, it) for it in items]
        keys = [(worker, text(it.group_id), it.token) for it in items]
        outcomes: list[Published | None] = [self._landed.get(key) for key in keys]
        sizes = [len(payload) for _, payload, _, _ in calls]
        parts = _parts([i for i, o in enumerate(outcomes) if o is None], sizes, PUBLISH_MULTI_BYTES)
        while parts:
            part = parts.pop(0)
            try:
                replies = self._publish_multi([calls[i] for i in part], sum(sizes[i] for i in part))
            except redis.exceptions.OutOfMemoryError:
                if len(part) == 1:
                    raise
                cap = min(PUBLISH_MULTI_BYTES, max(1, self._headroom() // 2))
                split = _parts(part, sizes, cap)
                parts[:0] = split if len(split) > 1 else [part[:len(part) // 2], part[len(part) // 2:]]
                continue
            if len(self._landed) > LANDED_KEPT:  # calls that raised and were never retried
                self._landed.clear()
            failed = [(i, reply) for i, reply in zip(part, replies) if isinstance(reply, Exception)]
            for i, reply in zip(part, replies):
                if isinstance(reply, Exception):
                    continue
                outcomes[i] = self._landed[keys[i]] = Published(text(reply[0]))
                if outcomes[i] == Published.REFUSED:
                    log.warning("group %s: worker %s no longer holds it under claim %s (reaped or handed back); "
                                "not publishing", keys[i][1], worker, keys[i][2])
            if failed:
                i, reply = failed[0]
                raise _without_arguments(reply, 1, sizes[i])
        for key in keys:
            self._landed.pop(key, None)
        return outcomes

    def _publish_call(self, worker: str, it: Publish) -> tuple[str | None, bytes, list, list]:
        """(staged key or None, payload, script keys, script args) of one group's publish."""
        k = self.keys
        stream = {Place.RESULTS: k.results, Place.REQUEUE: k.requeue, Place.DEAD: k.dead}[it.place]
        keys = [k.inflight(worker), k.payloads, stream, k.stats, k.admitted, k.claims, k.history, k.checkpoints,
                k.checkpoint_records]
        payload, error = it.payload, it.error
        if it.place == Place.DEAD:
            payload, note = bounded_dead_letter(payload)
            error = (error or "dead") + note
        args = [it.group_id, it.token, payload, it.place.value, error or "", worker, it.reason]
        staged = None
        if it.place == Place.RESULTS:
            # Staged with a plain SET in the same MULTI, then renamed by the script: see
            # lua/publish.lua. Its expiry matters only if the script call fails (NOSCRIPT).
            staged = k.staged(text(it.group_id), it.token)
            keys += [staged, k.result(text(it.group_id), it.token)]
            args[2] = b""
        return staged, payload, keys, args

    def _publish_multi(self, calls: list, size: int) -> list:
        """One MULTI of publishes: the script's reply (or error) per call."""
        replies = self._publish_once(calls, size)
        if any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
            self._scripts["publish"].load()  # a restarted or flushed server forgot it: the SETs went through
            replies = self._publish_once(calls, size)
        return replies

    def _publish_once(self, calls: list, size: int) -> list:
        script = self._scripts["publish"]
        pipe = self.redis.pipeline(transaction=True)
        for staged, payload, keys, args in calls:
            if staged is not None:
                pipe.set(staged, payload, ex=STAGED_TTL_S)
            script.queue(pipe, keys, args)
        try:
            return _script_replies(pipe.execute(raise_on_error=False), calls)
        except redis.ResponseError as exc:  # Redis's refusals: redis-py quotes the command's arguments
            raise _without_arguments(exc, len(calls), size) from None

    def _headroom(self) -> int:
        """Bytes left below maxmemory (0 when unknown: the refused MULTI is halved)."""
        try:
            info = self.redis.info("memory")
            return max(0, int(info.get("maxmemory", 0)) - int(info.get("used_memory", 0)))
        except (redis.RedisError, TypeError, ValueError, AttributeError):
            return 0

    def publish_group(self, worker: str, group: Group, token: str, place: Place, error: str | None = None,
                      keep_response_text: bool = False, reason: str = "") -> Published:
        """Encode and publish. Results leave out the response texts unless asked: the
        trainer trains on tokens, and text is ~20% of a finished group's bytes. Requeued
        and dead-lettered groups keep them (a continuation appends to the text).
        Raises EncodeError for a group that breaks the schema (nothing is moved)."""
        with_text = keep_response_text or place != Place.RESULTS
        return self.publish(worker, group.group_id, token, encode_group(group, with_text), place, error, reason)

    def heartbeat(self, worker: str, info: str) -> Heartbeat:
        k = self.keys
        status, paused, version, lease_ms, clock = self._scripts["heartbeat"](
            keys=[k.workers, k.worker_info, k.control, k.beats], args=[worker, info, int(DEFAULT_LEASE_S * 1000)])
        try:
            version_clock = VersionClock(text(clock) or VersionClock.ENGINE)
        except ValueError:  # a foreign value: read_control reports it
            version_clock = VersionClock.ENGINE
        return Heartbeat(text(status) == "reaped", bool(paused), int(version), int(lease_ms) / 1000, version_clock)

    def reap_logged(self, worker: str) -> bool:
        """Whether the `reaped` log (lua/reap.lua's last 50 departures) names `worker`: a
        worker that finds itself unregistered was reaped, or else its registration was
        deleted (a purge, or by hand)."""
        for raw in self.redis.lrange(self.keys.reaped, 0, -1):
            try:
                if json.loads(raw).get("worker") == worker:
                    return True
            except (ValueError, AttributeError):  # a foreign record: status reports it
                continue
        return False

    def held(self, worker: str) -> dict[str, str]:
        """The groups `worker` holds in Redis: group id -> claim token."""
        return {text(g): text(t) for g, t in self.redis.hgetall(self.keys.inflight(worker)).items()}

    def hand_back(self, worker: str, tokens: dict[str, str]) -> int:
        """Return groups `worker` holds but no longer works on to the head of the prompt
        list, each only if still held under the given token (reconciliation)."""
        if not tokens:
            return 0
        k = self.keys
        args: list = [worker]
        for gid, token in tokens.items():
            args += [gid, token]
        return int(self._scripts["handback"](keys=[k.inflight(worker), k.prompts, k.history, k.stats], args=args))

    def _reap(self, worker: str, mode: str) -> int:
        k = self.keys
        return int(self._scripts["reap"](
            keys=[k.workers, k.inflight(worker), k.prompts, k.worker_info, k.stats, k.claims, k.history,
                  k.last_claim, k.reaped, k.isolated, k.control, k.holders, k.beats],
            args=[worker, mode, int(DEFAULT_LEASE_S * 1000)]))

    def reap(self, worker: str) -> int:
        """Return `worker`'s groups to the prompt list if its lease expired. Returns
        how many, or -1 if the worker is alive."""
        n = self._reap(worker, "expired")
        if n > 0:
            log.warning("reaped worker %s (lease expired): %d in-flight groups back to the prompt list", worker, n)
        return n

    def leave(self, worker: str) -> int:
        """A worker shutting down hands its in-flight groups back right away; the
        claims do not count against the groups."""
        n = self._reap(worker, "leave")
        if n > 0:
            log.info("worker %s left: handed %d in-flight groups back to the prompt list", worker, n)
        return n

    def now_ms(self) -> int:
        seconds, micros = self.redis.time()
        return seconds * 1000 + micros // 1000

    def reap_expired(self) -> int:
        """Reap every worker whose lease deadline has passed, and in-flight hashes left
        by workers that are not registered at all."""
        total = 0
        expired = self.redis.zrangebyscore(self.keys.workers, "-inf", f"({self.now_ms()}")
        for worker in expired:
            total += max(0, self.reap(text(worker)))
        if not expired:  # the lease clock still looks at the server (lua/_prelude.lua lease_clock)
            self._reap("", "expired")
        return total

    def inflight_holders(self) -> set[str]:
        """Every worker id with an in-flight hash, registered or not, including hashes no
        claim wrote (by hand, or by a version before the holders set). By SCAN over the
        server's keys: for operators' tools (an admin's ACL user), not for workers."""
        prefix = len(self.keys.inflight(""))
        return {text(key)[prefix:] for key in self.redis.scan_iter(match=self.keys.inflight_pattern, count=1000)}

    def reap_orphans(self, scan: bool = False) -> int:
        """Give back the in-flight groups of workers that hold some and are not registered.
        Those a claim recorded in the holders set are found without SCAN (a worker's user
        has none: SCAN lists every namespace's key names); `scan` (an admin) finds the rest."""
        registered = {text(w) for w in self.redis.zrange(self.keys.workers, 0, -1)}
        holders = self.inflight_holders() if scan else {text(w) for w in self.redis.smembers(self.keys.holders)}
        return sum(max(0, self.reap(worker)) for worker in sorted(holders - registered))

    def workers(self) -> dict[str, float]:
        """Registered workers -> seconds until their lease deadline (negative: overdue)."""
        now = self.now_ms()
        return {text(w): (deadline - now) / 1000
                for w, deadline in self.redis.zrange(self.keys.workers, 0, -1, withscores=True)}

    def live_workers(self) -> list[str]:
        """Registered workers whose lease has not expired."""
        return [w for w, left in self.workers().items() if left >= 0]

    def has_prompts(self) -> bool:
        return self.redis.llen(self.keys.prompts) > 0

    def inflight_count(self) -> int:
        """Groups held by registered workers, in one round trip."""
        workers = [text(w) for w in self.redis.zrange(self.keys.workers, 0, -1)]
        pipe = self.redis.pipeline(transaction=False)
        for w in workers:
            pipe.hlen(self.keys.inflight(w))
        return sum(pipe.execute()) if workers else 0

    # -- producer ----------------------------------------------------------------

    def push_call(self, cursor_field: str, expected_cursor: int, items: list[tuple[str, str, bytes]]) -> ScriptCall:
        """The push script's call for (destination, group id, payload) items (see `push`)."""
        k = self.keys
        args: list = [cursor_field, expected_cursor]
        for dest, gid, payload in items:
            args += [dest, gid, payload]
        return ScriptCall(self._scripts["push"], [k.prompts, k.payloads, k.stats, k.dataset, k.dead], args)

    def pushed(self, reply: list) -> tuple[bool, int, int]:
        """(pushed, cursor after, duplicates skipped) from the push script's reply."""
        duplicates = int(reply[2]) if len(reply) > 2 else 0
        if duplicates:
            log.warning("push: %d group ids were queued or in flight already; not pushed again", duplicates)
        return text(reply[0]) == "ok", int(reply[1]), duplicates

    def _push(self, cursor_field: str, expected_cursor: int, items: list[tuple[str, str, bytes]]) -> tuple[bool, int, int]:
        call = self.push_call(cursor_field, expected_cursor, items)
        return self.pushed(call.script(keys=call.keys, args=call.args))

    def push(self, cursor_field: str, expected_cursor: int, items: list[tuple[str, str, bytes]]) -> tuple[bool, int]:
        """Push (destination, group id, payload) items if the cursor is where the caller
        expects; destination is 'prompt' or an error text (the row is dead-lettered).
        A group id already queued or in flight is skipped. Returns (pushed, cursor after)."""
        ok, cursor, _ = self._push(cursor_field, expected_cursor, items)
        return ok, cursor

    def push_groups(self, groups: list[Group]) -> int:
        """Push groups without a dataset cursor (tests, retries, tools). A group id
        already queued or in flight is skipped. Returns how many were pushed."""
        _, _, duplicates = self._push("", 0, self.group_items(groups))
        return len(groups) - duplicates

    @staticmethod
    def group_items(groups: list[Group]) -> list[tuple[str, str, bytes]]:
        """Groups as push items (to the prompt list), for push_call."""
        return [("prompt", g.group_id, encode_group(g)) for g in groups]

    # -- streams -----------------------------------------------------------------

    def settle(self, stream: str, items: list[Settle], session: TrainerSession | None = None) -> tuple[int, int]:
        """Settle stream entries (lua/settle.lua), as workers (requeue) and operators (dead
        letters) do; a trainer settles through its pipeline.writer.Writer, which adds its
        fence and the replica wait. On the results stream, `session` is the trainer session
        that was delivered them; raises SessionFenced when a newer session took over.
        Returns (settled, already committed before)."""
        if not items:
            return 0, 0
        keys, args = settle_arguments(self.keys, stream, items, session)
        try:
            settled, already = self._scripts["settle"](keys=keys, args=args)
        except redis.ResponseError as exc:
            refusal = fenced(exc)
            if refusal is not None:
                raise refusal from None
            raise
        return int(settled), int(already)

    def entries(self, stream: str, rows: list, with_data: bool = True) -> list[StreamEntry]:
        """StreamEntry objects from XRANGE/XREADGROUP rows. Results entries carry only
        the group id and token: their payloads come from the result keys, in one MGET."""
        entries = [_entry(eid, fields) for eid, fields in rows if fields]
        if stream == self.keys.results and with_data and entries:
            payloads = self.redis.mget([self.keys.result(e.group_id, e.token) for e in entries])
            for e, payload in zip(entries, payloads):
                e.data = payload or b""  # missing: decodes as malformed and is dead-lettered
        return entries

    def read_stream(self, stream: str, count: int = 100, start: str = "-", with_data: bool = True) -> list[StreamEntry]:
        return self.entries(stream, self.redis.xrange(stream, start, "+", count=count), with_data)

    def iter_stream(self, stream: str, page: int = 200, with_data: bool = True) -> Iterator[StreamEntry]:
        start = "-"
        while True:
            rows = self.redis.xrange(stream, start, "+", count=page)
            yield from self.entries(stream, rows, with_data)
            if len(rows) < page:
                return
            start = "(" + text(rows[-1][0])

    def release(self, policy: ReleasePolicy | str = ReleasePolicy.CONTINUE, max_count: int = 1000) -> int:
        """Move aborted groups from the requeue stream back to the head of the prompt
        list. `continue` keeps their partial output, `restart` forgets it, `drop`
        drops them (counted, logged). Malformed entries go to dead letters."""
        return self.settle(self.keys.requeue, self.release_items(policy, max_count))[0]

    def release_items(self, policy: ReleasePolicy | str = ReleasePolicy.CONTINUE,
                      max_count: int = 1000) -> list[Settle]:
        """What `release` settles, oldest last (each goes to the head of the prompt list)."""
        policy = ReleasePolicy(policy)
        items = []
        for entry in self.read_stream(self.keys.requeue, max_count):
            group, dead = entry.decode_or_dead("requeue")
            if dead:
                items.append(dead)
            elif policy == ReleasePolicy.DROP:
                items.append(Settle("drop", entry.entry_id, group.group_id, "requeue-drop"))
            elif policy == ReleasePolicy.RESTART:
                items.append(Settle("prompt", entry.entry_id, group.group_id, "restart",
                                    encode_group(group.reset())))
            else:  # continue: as the worker left it, already validated
                items.append(Settle("prompt", entry.entry_id, group.group_id, "continue", entry.data))
        # Reversed: each item goes to the head, so the oldest ends up first.
        return items[::-1]

    # -- state ---------------------------------------------------------------------

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
        """The stats counters; a foreign non-numeric value reads as 0 (and is logged)."""
        out: dict[str, int] = {}
        for key, value in self.redis.hgetall(self.keys.stats).items():
            try:
                out[text(key)] = int(value)
            except ValueError:
                log.error("%s field %s holds %r, not a counter; reading it as 0", self.keys.stats, text(key),
                          value[:40])
                out[text(key)] = 0
        return out

    def history(self, group_id: str) -> list[tuple[int, str, str, str]]:
        """A group's recent events: (server ms, event, who, detail), oldest first."""
        return parse_history(text(self.redis.hget(self.keys.history, group_id)) or "")


def parse_history(lines: str) -> list[tuple[int, str, str, str]]:
    """The lines of a `history` field (lua/_prelude.lua `record`) as (server ms, event,
    who, detail); a line that is not one is skipped."""
    out = []
    for line in lines.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1], parts[2], parts[3] if len(parts) > 3 else ""))
    return out


def _checkpoint(group_id: str, reply: list) -> GroupCheckpoint | None:
    """A claimed group's checkpoint; one that does not decode is ignored (its samples start
    over; the holder's first write replaces it)."""
    try:
        return GroupCheckpoint.from_reply(reply)
    except DecodeError as exc:
        log.warning("group %s: its checkpoint is unreadable (%s); its samples start over", group_id, exc)
        return None


def _parts(indices: list[int], sizes: list[int], cap: int) -> list[list[int]]:
    """`indices` in order, cut into runs whose payloads add up to at most `cap` (a group
    larger than that alone)."""
    parts: list[list[int]] = []
    total = 0
    for i in indices:
        if not parts or total + sizes[i] > cap:
            parts.append([])
            total = 0
        parts[-1].append(i)
        total += sizes[i]
    return parts


#: redis-py's text of a failed pipeline command: "Command # 3 (SET key <payload...>) of
#: pipeline caused error: <Redis's reply>".
_PIPELINE_COMMAND = re.compile(r"Command # \d+ \(.*?\) of pipeline caused error: ", re.DOTALL)


def _without_arguments(exc: redis.ResponseError, groups: int, size: int) -> redis.ResponseError:
    """`exc` of the same class (is_transient decides by class and code), its text without
    the command arguments redis-py quotes (a payload's bytes, for a staged SET), saying
    what was refused instead. Redis's reply stays first: its code is matched there."""
    reply = _PIPELINE_COMMAND.sub("", str(exc))
    try:
        return type(exc)(f"{reply} (a publish of {groups} group{'s' * (groups != 1)}, {size:,} bytes)")
    except TypeError:  # an exception class with another signature: the generic one
        return redis.ResponseError(f"{reply} (a publish of {groups} groups, {size:,} bytes)")


def _script_replies(replies: list, calls: list) -> list:
    """The publish scripts' replies from a publish_many MULTI's (a staged SET before some)."""
    out, i = [], 0
    for staged, *_ in calls:
        i += staged is not None
        out.append(replies[i])
        i += 1
    return out


def _entry(entry_id, fields: dict) -> StreamEntry:
    return StreamEntry(
        entry_id=text(entry_id),
        group_id=text(fields.get(b"gid", b"")),
        data=fields.get(b"data", b""),
        error=text(fields.get(b"error")),
        token=text(fields.get(b"tok", b"")),
        reason=text(fields.get(b"reason")),
    )
