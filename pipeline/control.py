"""The `control` hash: pipeline-wide settings and state, read by the scripts that act
on them (claim.lua reads `paused` in the same step that admits).

Settings (`rollout configure`): the lease, max_claims, max_ready, and the staleness
bound (max_staleness η with the batch size B it paces against). State: `paused`, the
trainer's `weight_version` and the clock groups' versions are read on (`version_clock`:
the engines' versions, or the queue's at first claim), the release policy of aborted groups,
the engines `draining` for a rolling weight update.

Every write goes through a pipeline.writer.Writer (lua/control.lua): a trainer passes its
Consumer's (`writer=consumer.writer`), so a fenced trainer writes no control state and its
writes wait for its replicas; without one, the write is an operator's (not fenced,
recorded), with `durability` for its replica wait. The weight version only moves forward
unless the write says `rollback`.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

import redis

from .keys import Keys
from .retry import Durability
from .types import Group, ReleasePolicy, VersionClock, member
from .writer import Writer

log = logging.getLogger(__name__)

#: A worker whose lease deadline passed is presumed dead: any worker (or the trainer)
#: returns its groups to the prompt list. Workers extend it with every heartbeat.
DEFAULT_LEASE_S = 30.0
#: How often a worker heartbeats by default; a lease must cover at least three.
DEFAULT_HEARTBEAT_S = 2.0
HEARTBEATS_PER_LEASE = 3
#: How often a reaper runs at most: a worker's maintenance loop ticks once a second, and a
#: waiting trainer reaps between blocking reads of up to a second. Heartbeats and reaps are
#: what tells a silence (lua/_prelude.lua) from a quiet pipeline: a lease shorter than the
#: gap between them makes every reap look like a silence, so nobody is ever reaped.
UPKEEP_S = 1.0
#: Claims of one group without it finishing (each reap counts) before it is dead-lettered.
DEFAULT_MAX_CLAIMS = 5
#: Results waiting for the trainer at which workers stop claiming.
DEFAULT_MAX_READY = 4096


def staleness_limit(max_staleness: int, weight_version: int, batch_size: int) -> int:
    """AReaL's admission pacing: groups admitted so far (committed + in the pipeline)
    may not exceed (η + version + 1) · B. lua/_prelude.lua has the same formula."""
    return (max_staleness + weight_version + 1) * batch_size


@dataclass
class ControlState:
    paused: bool = False
    weight_version: int = 0
    max_staleness: int | None = None  # η; None: no staleness bound
    batch_size: int | None = None  # B, for admission pacing
    max_ready: int = DEFAULT_MAX_READY
    lease_s: float = DEFAULT_LEASE_S
    max_claims: int = DEFAULT_MAX_CLAIMS
    release_policy: ReleasePolicy = ReleasePolicy.CONTINUE
    version_clock: VersionClock = VersionClock.ENGINE  # what a group's age is measured with
    # Groups counting against the staleness budget: committed since version 0 (the
    # lifetime count less `budget_base`), plus admitted (first claimed) and not settled
    # yet. Dropped and dead groups give their slot back.
    admitted: int = 0
    committed: int = 0
    budget_base: int = 0  # stats.committed at the clock's version 0 (set_weight_version(restart_budget=True))
    # Engines out of rotation for a rolling weight update (pipeline/controller.py): workers
    # send them no new requests, and an abort from one is continued on another engine.
    draining: tuple[str, ...] = ()

    @property
    def staleness_limit(self) -> int | None:
        if self.max_staleness is None or not self.batch_size:
            return None
        return staleness_limit(self.max_staleness, self.weight_version, self.batch_size)

    def lag(self, group: Group) -> int:
        """How many weight versions `group` is behind the trainer's, on this namespace's clock."""
        return self.weight_version - (group.oldest_version(self.version_clock) or 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(release_policy=self.release_policy.value, version_clock=self.version_clock.value,
                 staleness_limit=self.staleness_limit)
        return d


_FIELDS = ("paused", "weight_version", "max_staleness", "batch_size", "max_ready", "lease_ms", "max_claims",
           "release_policy", "version_clock", "budget_base", "draining")


_warned: set[tuple[str, bytes]] = set()  # corrupt values already logged (readers poll every second)


def _number(raw: bytes | None, name: str, keys: Keys) -> int | None:
    """A stored integer, or None (unset). A foreign value is reported (once) and read as
    unset: one bad field must not stop status, the trainer or the workers."""
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        if (name, raw) not in _warned:
            _warned.add((name, raw))
            log.error("%s field %r holds %r, not an integer; ignoring it (fix with `rollout configure`)",
                      keys.control, name, raw[:40])
        return None


def read_control(client: redis.Redis, keys: Keys) -> ControlState:
    def read(transaction: bool) -> list:
        pipe = client.pipeline(transaction=transaction)
        pipe.hmget(keys.control, _FIELDS)
        pipe.hget(keys.stats, "committed")
        pipe.hlen(keys.admitted)
        return pipe.execute()

    try:
        replies = read(transaction=True)
    except redis.exceptions.OutOfMemoryError:
        # A full Redis (maxmemory, noeviction) refuses anything queued in MULTI, reads
        # too; the three reads one by one still tell status and the workers what is going on.
        replies = read(transaction=False)
    (paused, version, eta, batch, ready, lease_ms, max_claims, policy, clock, base, draining), committed, live = replies
    committed = _number(committed, "stats.committed", keys) or 0
    lease_ms = _number(lease_ms, "lease_ms", keys)
    try:
        release_policy = ReleasePolicy(policy.decode()) if policy else ReleasePolicy.CONTINUE
    except (ValueError, UnicodeDecodeError):
        log.error("%s release_policy %r is unknown; using continue", keys.control, policy[:40])
        release_policy = ReleasePolicy.CONTINUE
    try:
        version_clock = VersionClock(clock.decode()) if clock else VersionClock.ENGINE
    except (ValueError, UnicodeDecodeError):
        log.error("%s version_clock %r is unknown; using engine", keys.control, clock[:40])
        version_clock = VersionClock.ENGINE
    ready = _number(ready, "max_ready", keys)
    claims = _number(max_claims, "max_claims", keys)
    return ControlState(
        paused=paused == b"1",
        weight_version=_number(version, "weight_version", keys) or 0,
        max_staleness=_number(eta, "max_staleness", keys),
        batch_size=_number(batch, "batch_size", keys),
        max_ready=DEFAULT_MAX_READY if ready is None else ready,
        lease_s=DEFAULT_LEASE_S if lease_ms is None else lease_ms / 1000,
        max_claims=DEFAULT_MAX_CLAIMS if claims is None else claims,
        release_policy=release_policy,
        version_clock=version_clock,
        admitted=committed - (_number(base, "budget_base", keys) or 0) + live,  # as lua/claim.lua counts it
        committed=committed,
        budget_base=_number(base, "budget_base", keys) or 0,
        draining=tuple(draining.decode(errors="replace").split()) if draining else (),
    )


def configure(client: redis.Redis, keys: Keys, *, max_staleness: int | None = None,
              batch_size: int | None = None, max_ready: int | None = None, lease_s: float | None = None,
              max_claims: int | None = None, release_policy: ReleasePolicy | str | None = None,
              version_clock: VersionClock | str | None = None, durability: Durability | None = None,
              writer: Writer | None = None) -> ControlState:
    """Set pipeline-wide settings. None leaves a setting unchanged; a negative
    max_staleness, batch_size or max_ready removes it (back to the default). Written by
    `writer` (a trainer's), else as an operator's write with `durability` (see _write)."""
    updates: dict[str, int | str] = {}
    removals: list[str] = []
    for name, value in (("max_staleness", max_staleness), ("batch_size", batch_size), ("max_ready", max_ready)):
        if value is None:
            continue
        if value < 0:
            removals.append(name)
        elif name == "batch_size" and value == 0:
            raise ValueError("batch_size must be at least 1 (or negative to remove it)")
        else:
            updates[name] = int(value)
    if lease_s is not None:
        check_lease(client, keys, lease_s)
        updates["lease_ms"] = int(lease_s * 1000)
    if max_claims is not None:
        if max_claims < 1:
            raise ValueError(f"max_claims must be at least 1, got {max_claims}")
        updates["max_claims"] = int(max_claims)
    if release_policy is not None:
        updates["release_policy"] = member(ReleasePolicy, release_policy, "release policy").value
    if version_clock is not None:
        updates["version_clock"] = member(VersionClock, version_clock, "version clock").value
    if not updates and not removals:  # only reading them: nothing to write, no key made
        return read_control(client, keys)
    return _write(client, keys, "settings", durability, writer, updates, removals)


def check_lease(client: redis.Redis, keys: Keys, lease_s: float) -> None:
    """Refuse a lease the reapers and live workers cannot keep: shorter than the upkeep
    period, or than a heartbeat and an upkeep period of a live worker (by the heartbeat it
    reports), every reap would find a silence longer than the lease (see UPKEEP_S)."""
    if not lease_s >= UPKEEP_S:
        raise ValueError(f"a lease of {lease_s:g}s is shorter than the upkeep period ({UPKEEP_S:g}s: workers and the "
                         f"trainer reap at most that often), so every reap would look like a silence and reap nobody; "
                         f"use at least {HEARTBEATS_PER_LEASE * DEFAULT_HEARTBEAT_S:g}s (three heartbeats)")
    now_ms = int(client.time()[0]) * 1000
    live = [w for w, deadline in client.zrange(keys.workers, 0, -1, withscores=True) if deadline >= now_ms]
    beats = []
    for worker, raw in zip(live, client.hmget(keys.worker_info, live) if live else []):
        try:
            beats.append((float(json.loads(raw)["heartbeat_s"]), worker.decode(errors="replace")))
        except (TypeError, ValueError, KeyError, AttributeError):
            continue  # no heartbeat reported (an older worker): nothing to check it against
    if beats:
        heartbeat_s, worker = max(beats)
        if lease_s < heartbeat_s + UPKEEP_S:
            raise ValueError(f"a lease of {lease_s:g}s is shorter than a heartbeat and an upkeep period: worker "
                             f"{worker} heartbeats every {heartbeat_s:g}s, so it would be reaped while alive or every "
                             f"reap look like a silence; use at least {HEARTBEATS_PER_LEASE * heartbeat_s:g}s")


def running_batch(client: redis.Redis, keys: Keys) -> tuple[str, int] | None:
    """The current trainer session's consumer name and the batch size it asked for when it
    started (its info), if there is one that said."""
    session, info = client.hmget(keys.trainer, "session", "info")
    try:
        batch = int(json.loads(info)["batch"]) if info else None
    except (TypeError, ValueError, KeyError):
        batch = None
    return (session.decode(errors="replace"), batch) if session and batch else None


class WeightVersionBehind(ValueError):
    """A weight version behind the recorded one, written without saying it is a rollback."""


def _announce(client: redis.Redis, keys: Keys, state: ControlState) -> None:
    # Workers subscribed to the events channel react at once instead of at their next poll.
    client.publish(keys.events, json.dumps(state.to_dict()))


def _write(client: redis.Redis, keys: Keys, what: str, durability: Durability | None, writer: Writer | None,
           fields: dict[str, int | str] | None = None, remove: list[str] | None = None, *,
           rollback: bool = False, restart_budget: bool = False) -> ControlState:
    """One write of control state through `writer` (fenced by its trainer session, on its
    replicas before it returns: control state must not roll back in a failover, or a lost
    resume leaves the pipeline paused with nobody to resume it), or an operator's write with
    `durability`; then announced. Returns the state it announced."""
    if writer is None:
        writer = Writer(client, keys, durability)
    elif durability is not None and durability != writer.durability:
        raise ValueError("durability comes with the writer: give one or the other")
    try:
        writer.control(what, fields, remove, rollback=rollback, restart_budget=restart_budget)
    except redis.ResponseError as exc:
        if not str(exc).startswith("BEHIND "):
            raise
        asked, recorded = str(exc).split()[1:3]
        raise WeightVersionBehind(
            f"weight version {asked} is behind the recorded {recorded}: the weight version only moves forward, "
            f"unless the write says it is a rollback (a trainer resumed from an earlier checkpoint: "
            f"set_weight_version(..., rollback=True), `rollout resume --weight-version {asked} --rollback`)") from None
    if writer.session is None:
        log.info("%s of namespace %s by %s (no trainer session: not fenced)", what, keys.namespace, writer.who)
    state = read_control(client, keys)
    _announce(client, keys, state)
    return state


def set_paused(client: redis.Redis, keys: Keys, paused: bool, durability: Durability | None = None,
               writer: Writer | None = None, release_policy: ReleasePolicy | None = None) -> None:
    """Pause or reopen admission; with `release_policy`, what aborted groups follow from then
    on, in the same write."""
    fields: dict[str, int | str] = {"paused": 1 if paused else 0}
    if release_policy is not None:
        fields["release_policy"] = member(ReleasePolicy, release_policy, "release policy").value
    _write(client, keys, "pause" if paused else "resume", durability, writer, fields)


def set_draining(client: redis.Redis, keys: Keys, engine_urls: list[str], durability: Durability | None = None,
                 writer: Writer | None = None) -> None:
    """Take these engines out of the workers' rotation (none: every engine back in).
    Stored space-separated: a URL has no spaces."""
    if engine_urls:
        _write(client, keys, "draining", durability, writer, {"draining": " ".join(engine_urls)})
    else:
        _write(client, keys, "draining", durability, writer, remove=["draining"])


def set_weight_version(client: redis.Redis, keys: Keys, version: int, *, restart_budget: bool = False,
                       rollback: bool = False, durability: Durability | None = None, writer: Writer | None = None,
                       fields: dict[str, int | str] | None = None) -> None:
    """Set the trainer's weight version (with other `fields`, in the same write). It only
    moves forward (WeightVersionBehind) unless `rollback`: a trainer resumed from an
    earlier checkpoint says so. `restart_budget`: a trainer (re)starts at `version`, e.g.
    resumed from an older checkpoint or a new run in a used namespace: the staleness budget
    counts as if `version` batches had been committed since version 0, not the namespace's
    lifetime count (which would block admission for good)."""
    _write(client, keys, f"weight version {version}" + (" (rollback)" if rollback else ""), durability, writer,
           {**(fields or {}), "weight_version": version}, rollback=rollback, restart_budget=restart_budget)
