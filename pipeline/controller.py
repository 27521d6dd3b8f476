"""The weight-update protocol, trainer side: pause → update weights → resume.

pause(mode): admission stops (`paused=1`: the claim script refuses at once; workers
hear it on the events channel), then every engine pauses. In `abort` mode it waits
until the interrupted groups are in the requeue stream. resume(v): record version v,
continue the engines, release the requeue stream to the head of the prompt list,
reopen admission.

rolling_update(path, v): Laminar's idea, generation never stops globally. One engine at
a time leaves the workers' rotation (`draining` in the control hash, set before it
pauses), is paused in abort mode (its requests continue at once on the other engines,
with their partial output), loads the weights, continues and rejoins. The version is
recorded first (the trainer has those weights now: the staleness bound and admission
pacing count from it), and admission stays open throughout. Workers must be
given the engines' own URLs: behind a router they cannot steer around one engine.

Every Redis write goes through one pipeline.writer.Writer. A trainer passes its Consumer's
(`Controller(queue, engines, writer=consumer.writer)`): its pauses, versions, releases and
resumes are then fenced by its trainer session, like its reads and commits (a trainer that
a newer one replaced can neither pause the pipeline nor roll its version back), and wait for
the Consumer's replicas. Without one (`rollout pause`/`resume`, a script), the writes are an
operator's: not fenced, recorded, with `replicas` for their replica wait.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .control import WeightVersionBehind, read_control, set_draining, set_paused, set_weight_version
from .retry import TRAINER_OUTAGE_LIMIT_S, Durability, Reconnect
from .types import PauseMode, ReleasePolicy, member
from .writer import Writer

if TYPE_CHECKING:
    from .queue import Queue

log = logging.getLogger(__name__)


class EngineControl(Protocol):
    """What the controller needs from the engines; workers.engine.EngineSet is one.
    (pipeline/ owns Redis state and never imports the HTTP client.)"""

    async def pause_generation(self, mode: str = "abort") -> Any: ...

    async def continue_generation(self) -> Any: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False, flush_cache: bool = True) -> Any: ...

    async def refresh(self) -> list[str]: ...

    def only(self, engine_url: str) -> EngineControl: ...


class WeightUpdateError(RuntimeError):
    """A weight update failed; the pipeline stays paused. The message names the engines."""


@dataclass
class PauseReport:
    mode: PauseMode
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


@dataclass
class RollingReport:
    weight_version: int
    total_s: float  # the whole rolling update; admission was open throughout
    out_of_rotation_s: dict[str, float]  # per engine: drained, paused, updated, continued


class Controller:
    """pause → (update weights) → resume, for one pipeline and its engines."""

    def __init__(self, queue: "Queue", engines: EngineControl | None = None,
                 release_policy: ReleasePolicy | str = ReleasePolicy.CONTINUE, settle_s: float = 0.25,
                 outage_limit_s: float | None = TRAINER_OUTAGE_LIMIT_S, replicas: int | None = None,
                 replica_timeout_s: float = 5.0, writer: Writer | None = None):
        self.queue = queue
        self.redis = queue.redis
        self.keys = queue.keys
        self.engines = engines
        self.release_policy = member(ReleasePolicy, release_policy, "release policy")
        # abort mode: stop waiting for in-flight groups once their number has not moved
        # for this long after the engines paused (see PauseReport.still_inflight).
        self.settle_s = settle_s
        # Every Redis call goes through here: a restart or failover is waited out up to
        # outage_limit_s, then RedisUnavailable. (Each step is idempotent: setting a flag or
        # a version, counting, releasing what the requeue stream holds.)
        self.reconnect = Reconnect(f"controller {queue.keys.namespace}", limit_s=outage_limit_s)
        self._call = self.reconnect.call
        # Every write (pause, version, release, resume, draining): a trainer's writer fences
        # them by its session and waits for its replicas; an operator's waits for `replicas`
        # (behind Sentinel, so a failover cannot roll the pipeline's state back).
        if writer is not None and replicas is not None:
            raise ValueError("a Controller given a writer waits for that writer's replicas: pass replicas to the "
                             "Consumer the writer belongs to")
        self.writer = writer or Writer(queue.redis, queue.keys, Durability(replicas or 0, replica_timeout_s),
                                       self.reconnect)

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT, timeout_s: float = 60.0) -> PauseReport:
        """Stop admission, then pause every engine. With `abort`, wait until the
        workers have requeued every interrupted group."""
        mode = member(PauseMode, mode, "pause mode")
        started = time.monotonic()
        self._call(set_paused, self.redis, self.keys, True, writer=self.writer)
        if self.engines is not None:
            await self.engines.pause_generation(mode.value)
        remaining = 0
        if mode == PauseMode.ABORT:
            # Aborted requests return at once and their groups are requeued within
            # milliseconds. A group claimed just before admission stopped may send its
            # requests after the engines paused: they block at the engine (SGLang holds
            # new /generate calls while paused, where abort cannot reach them) and would
            # never settle. So: wait until nothing is in flight, or until the count has
            # stopped moving for settle_s.
            deadline = started + timeout_s
            remaining, last_change = self._call(self.queue.inflight_count), time.monotonic()
            while remaining > 0:
                await asyncio.sleep(0.005)
                count = self._call(self.queue.inflight_count)
                now = time.monotonic()
                if count != remaining:
                    remaining, last_change = count, now
                elif now - last_change >= self.settle_s:
                    log.info("pause: %d groups still in flight %.2fs after the engines paused; their "
                             "requests arrived after the pause and wait for resume", remaining, self.settle_s)
                    break
                if now > deadline:
                    raise TimeoutError(f"pause: {remaining} groups still in flight after {timeout_s:g}s")
        return PauseReport(mode, time.monotonic() - started, self._call(self.redis.xlen, self.keys.requeue), remaining)

    async def resume(self, weight_version: int | None = None, rollback: bool = False) -> ResumeReport:
        """Record the new version, continue the engines, release aborted groups to the
        head of the prompt list, reopen admission. Returns at once: timing the first
        claim after a resume is the benchmark's business (bench/pause.py). A version behind
        the recorded one is refused (WeightVersionBehind, nothing done) unless `rollback`."""
        if weight_version is not None:
            self._call(set_weight_version, self.redis, self.keys, weight_version, rollback=rollback,
                       writer=self.writer)
        if self.engines is not None:
            await self.engines.continue_generation()
        released = self.writer.settle(self.keys.requeue, self._call(self.queue.release_items, self.release_policy))[0]
        # The policy in the same write that reopens admission: the workers' own releases (of
        # groups aborted later) follow it from then on.
        self._call(set_paused, self.redis, self.keys, False, writer=self.writer, release_policy=self.release_policy)
        return ResumeReport(self._call(read_control, self.redis, self.keys).weight_version, released)

    async def update_weights_from_disk(self, model_path: str, weight_version: int,
                                       mode: PauseMode | str = PauseMode.ABORT) -> tuple[PauseReport, ResumeReport]:
        """pause → every engine loads `model_path` as `weight_version` → resume. If an
        engine fails, the pipeline stays paused and the error names it."""
        if self.engines is None:
            raise WeightUpdateError("no engines configured for this controller")
        pause = await self.pause(mode)
        try:
            # Requests paused in retract or in_place mode are still live on the engine, and
            # SGLang refuses to flush its cache under them (0.5.20 then asserts, killing its
            # scheduler; 0.5.23 fails the update).
            await self.engines.update_weights_from_disk(model_path, weight_version=str(weight_version),
                                                        flush_cache=pause.mode == PauseMode.ABORT)
        except Exception as exc:
            raise WeightUpdateError(f"weight update to version {weight_version} from {model_path} failed; "
                                    f"the pipeline stays paused: {exc}") from exc
        return pause, await self.resume(weight_version)

    async def rolling_update(self, model_path: str, weight_version: int) -> RollingReport:
        """Update the engines one at a time while the others keep generating (see the
        module's docstring). If an engine fails, it stays out of rotation and paused, and
        the error names it. A version older than the recorded one is not recorded (a
        trainer that moved on while the update waited its turn)."""
        if self.engines is None:
            raise WeightUpdateError("no engines configured for this controller")
        started = time.monotonic()
        try:
            self._call(set_weight_version, self.redis, self.keys, weight_version, writer=self.writer)
        except WeightVersionBehind:
            log.info("rolling update to version %d: a newer version is recorded already; not recording it",
                     weight_version)
        urls = await self.engines.refresh()
        out_of_rotation: dict[str, float] = {}
        for url in urls:
            since = time.monotonic()
            # Listed before the pause, so a worker answered by an abort finds it in Redis.
            self._call(set_draining, self.redis, self.keys, [url], writer=self.writer)
            engine = self.engines.only(url)
            try:
                await engine.pause_generation(PauseMode.ABORT.value)
                await engine.update_weights_from_disk(model_path, weight_version=str(weight_version))
                await engine.continue_generation()
            except Exception as exc:
                raise WeightUpdateError(f"rolling weight update to version {weight_version} from {model_path} "
                                        f"failed at engine {url}; it stays paused and out of rotation, the "
                                        f"engines before it serve version {weight_version}: {exc}") from exc
            self._call(set_draining, self.redis, self.keys, [], writer=self.writer)
            out_of_rotation[url] = time.monotonic() - since
        return RollingReport(weight_version, time.monotonic() - started, out_of_rotation)
