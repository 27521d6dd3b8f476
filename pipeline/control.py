"""Pipeline-wide settings and state kept in the `control` hash."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import redis

from .keys import Keys

if TYPE_CHECKING:
    from .queue import Queue

log = logging.getLogger(__name__)


@dataclass
class ControlState:
    paused: bool = False
    weight_version: int = 0
    max_staleness: int | None = None  # η; None: no staleness bound
    batch_size: int | None = None  # B, for admission pacing
    max_ready: int | None = None  # results backlog at which workers stop claiming
    # Groups counting against the staleness budget: committed, plus admitted (first
    # claimed) and not settled yet. Dropped and discarded groups give their slot back.
    admitted: int = 0
    release_policy: str = "continue"  # what happens to aborted groups on release


RELEASE_POLICIES = ("continue", "restart", "drop")


_warned: set[tuple[str, bytes]] = set()  # corrupt values already logged (readers poll every second)


def _int(value: bytes | None, name: str) -> int | None:
    """An integer field; a corrupt one counts as unset (logged once), so no reader of
    the control hash crashes on it. `rollout status` shows it as an alert."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        if (name, value) not in _warned:
            _warned.add((name, value))
            log.error("control field %s holds %r, not an integer; ignoring it", name, value[:40])
        return None


def read_control(client: redis.Redis, keys: Keys) -> ControlState:
    fields = ("paused", "weight_version", "max_staleness", "batch_size", "max_ready", "release_policy")
    pipe = client.pipeline(transaction=True)
    pipe.hmget(keys.control, fields)
    pipe.hget(keys.stats, "committed")
    pipe.hlen(keys.admitted)
    (paused, version, eta, batch, ready, policy), committed, live = pipe.execute()
    policy = policy.decode("utf-8", "replace") if policy else "continue"
    return ControlState(
        paused=paused == b"1",
        weight_version=_int(version, "weight_version") or 0,
        max_staleness=_int(eta, "max_staleness"),
        batch_size=_int(batch, "batch_size"),
        max_ready=_int(ready, "max_ready"),
        admitted=(_int(committed, "stats committed") or 0) + live,  # as lua/claim.lua counts it
        release_policy=policy if policy in RELEASE_POLICIES else "continue",
    )


def configure(client: redis.Redis, keys: Keys, *, max_staleness: int | None = None,
              batch_size: int | None = None, max_ready: int | None = None) -> None:
    """Set the limits the claim script enforces. A value of None leaves it unchanged;
    a negative value removes the limit."""
    for name, value in (("max_staleness", max_staleness), ("batch_size", batch_size), ("max_ready", max_ready)):
        if value is None:
            continue
        if value < 0:
            client.hdel(keys.control, name)
        else:
            client.hset(keys.control, name, value)


def _announce(client: redis.Redis, keys: Keys, state: ControlState) -> None:
    # Workers subscribed to the events channel react at once instead of at their next poll.
    client.publish(keys.events, json.dumps(asdict(state)))


def set_paused(client: redis.Redis, keys: Keys, paused: bool) -> None:
    client.hset(keys.control, "paused", 1 if paused else 0)
    _announce(client, keys, read_control(client, keys))


def set_weight_version(client: redis.Redis, keys: Keys, version: int) -> None:
    client.hset(keys.control, "weight_version", version)
    _announce(client, keys, read_control(client, keys))


# -- the weight-update protocol (trainer side) -------------------------------------------


class EngineControl(Protocol):
    """What the controller needs from the engines; workers.engine.EngineSet is one.
    (pipeline/ owns Redis state and never imports the HTTP client.)"""

    async def pause_generation(self, mode: str = "abort") -> Any: ...

    async def continue_generation(self) -> Any: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> Any: ...


class WeightUpdateError(RuntimeError):
    """A weight update failed; the pipeline stays paused. The message names the engines."""


PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class PauseReport:
    mode: str
    quiesce_s: float  # pause() to every in-flight group settled (abort) or frozen
    requeued: int  # groups in the requeue stream after the pause
    # abort mode: groups still held by workers when pause() returned. Their requests
    # reached the engines after the engines paused (claimed just before admission
    # stopped), so the abort never saw them: they wait at the engine, generate nothing,
    # and start under the new weights on resume.
    still_inflight: int = 0


@dataclass
class ResumeReport:
    weight_version: int
    released: int  # aborted groups put back at the head of the prompt list
    first_claim_s: float | None  # resume() to the first claim by any worker (None: none seen)


class Controller:
    """pause → (update weights) → resume, for one pipeline and its engines."""

    def __init__(self, queue: "Queue", engines: EngineControl | None = None, release_policy: str = "continue",
                 settle_s: float = 0.25):
        self.queue = queue
        self.redis = queue.redis
        self.keys = queue.keys
        self.engines = engines
        if release_policy not in RELEASE_POLICIES:
            raise ValueError(f"unknown release policy {release_policy!r}: use one of {', '.join(RELEASE_POLICIES)}")
        self.release_policy = release_policy
        # abort mode: stop waiting for in-flight groups once their number has not moved
        # for this long after the engines paused (see PauseReport.still_inflight).
        self.settle_s = settle_s

    def _inflight(self) -> int:
        workers = [w.decode() for w in self.redis.zrange(self.keys.workers, 0, -1)]
        return sum(self.redis.scard(self.keys.inflight(w)) for w in workers)

    async def pause(self, mode: str = "abort", timeout_s: float = 60.0) -> PauseReport:
        """Stop admission, then pause every engine. With `abort`, wait until the
        workers have requeued every interrupted group."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}: use one of {', '.join(PAUSE_MODES)}")
        started = time.monotonic()
        set_paused(self.redis, self.keys, True)
        if self.engines is not None:
            await self.engines.pause_generation(mode)
        remaining = 0
        if mode == "abort":
            # Aborted requests return at once and their groups are requeued within
            # milliseconds. A group claimed just before admission stopped may send its
            # requests after the engines paused: they block at the engine (SGLang holds
            # new /generate calls while paused, where abort cannot reach them) and would
            # never settle. So: wait until nothing is in flight, or until the count has
            # stopped moving for settle_s.
            deadline = started + timeout_s
            remaining, last_change = self._inflight(), time.monotonic()
            while remaining > 0:
                await asyncio.sleep(0.005)
                now, count = time.monotonic(), self._inflight()
                if count != remaining:
                    remaining, last_change = count, now
                elif now - last_change >= self.settle_s:
                    log.info("pause: %d groups still in flight %.2fs after the engines paused; their "
                             "requests arrived after the pause and wait for resume", remaining, self.settle_s)
                    break
                if now > deadline:
                    raise TimeoutError(f"pause: {remaining} groups still in flight after {timeout_s:g}s")
        return PauseReport(mode, time.monotonic() - started, self.redis.xlen(self.keys.requeue), remaining)

    async def resume(self, weight_version: int | None = None, first_claim_timeout_s: float = 5.0) -> ResumeReport:
        """Record the new version, continue the engines, release aborted groups to the
        head of the prompt list, reopen admission."""
        if weight_version is not None:
            set_weight_version(self.redis, self.keys, weight_version)
        if self.engines is not None:
            await self.engines.continue_generation()
        # Recorded so the workers' own releases (of groups aborted later) follow it too.
        self.redis.hset(self.keys.control, "release_policy", self.release_policy)
        released = self.queue.release(self.release_policy)
        claims_before = int(self.redis.hget(self.keys.stats, "claims") or 0)
        started = time.monotonic()
        set_paused(self.redis, self.keys, False)
        first_claim = None
        if self.redis.llen(self.keys.prompts):
            while time.monotonic() - started < first_claim_timeout_s:
                if int(self.redis.hget(self.keys.stats, "claims") or 0) > claims_before:
                    first_claim = time.monotonic() - started
                    break
                await asyncio.sleep(0.002)
        return ResumeReport(read_control(self.redis, self.keys).weight_version, released, first_claim)

    async def update_weights_from_disk(self, model_path: str, weight_version: int,
                                       mode: str = "abort") -> tuple[PauseReport, ResumeReport]:
        """pause → every engine loads `model_path` as `weight_version` → resume. If an
        engine fails, the pipeline stays paused and the error names it."""
        if self.engines is None:
            raise WeightUpdateError("no engines configured for this controller")
        pause = await self.pause(mode)
        try:
            await self.engines.update_weights_from_disk(model_path, weight_version=str(weight_version))
        except Exception as exc:
            raise WeightUpdateError(f"weight update to version {weight_version} from {model_path} failed; "
                                    f"the pipeline stays paused: {exc}") from exc
        return pause, await self.resume(weight_version)
