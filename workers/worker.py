"""The stateless generation worker.

One asyncio process keeps a fixed pool of samples in flight: capacity is counted in
samples (`concurrency_per_engine` × engines, like slime's sglang_server_concurrency),
and a group of n samples takes n slots. Everything it holds is also in Redis (its
in-flight hash, each group under the token of the claim that took it, and the stored
payloads), so `kill -9` loses nothing: the reaper gives its groups back after the lease.

Per group: tokenize, call /generate for every unfinished sample (continuing aborted
ones from their partial tokens), or hand each to the user's generate function
(`--generate-function`, slime's signature: it makes the engine calls, holding the
sample's one slot across all its turns), then either requeue (a pause interrupted it, or the
engines went down), score with the reward and publish to results, or dead-letter
(engine or reward failures past the attempt limit; bad requests at once).

What keeps Redis and this process in agreement:
* a worker is registered explicitly and extends its lease with heartbeats; one that
  was reaped (it stalled past its lease) learns it at its next contact, cancels its
  tasks (their publishes would be refused anyway) and registers under a new id;
* every heartbeat reconciles: a group Redis says this worker holds with no task here
  goes back to the prompt list; a task whose group it no longer holds is cancelled;
* Redis calls run on a thread pool of their own, retried through outages
  (pipeline/retry.py); rewards run on another, under a time limit.

The Worker owns four collaborators, one per job, which share a WorkerContext
(workers/context.py: the id, Redis access, counters, admission state):
* Claimer (workers/claiming.py): the claim loop, eval prompts first;
* GroupRunner (workers/group_run.py): one task per group, its slots, requests,
  scoring and publish;
* EngineHealth (workers/engine_health.py): the engine-down breaker, /health probes,
  rediscovery;
* Liveness (workers/liveness.py): registration, heartbeats, reincarnation,
  reconciliation, upkeep and control events.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from types import SimpleNamespace
from typing import Any

from pipeline import metrics, scripts
from pipeline.connection import STARTUP_WAIT_S, connect
from pipeline.control import HEARTBEATS_PER_LEASE
from pipeline.keys import eval_namespace
from pipeline.permissions import PermissionDenied
from pipeline.queue import ClaimStatus, Queue
from pipeline.wording import counted

from .claiming import Claimer
from .context import WorkerContext
from .engine_set import EngineSet
from .engine_health import EngineHealth
from .generate_function import GenerateFunction
from .group_run import GroupRunner
from .liveness import Liveness
from .rewards import Reward, RewardThreads
from .sampling import SamplingSettings  # noqa: F401 - re-exported: callers build WorkerSettings from here
from .settings import WorkerSettings
from .tokenizer import ByteTokenizer, load_tokenizer

log = logging.getLogger(__name__)

#: Requests outstanding with no engine answer for this long: the state says "waiting on engine".
WAITING_ON_ENGINE_S = 10.0


class WorkerState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    FULL = "full"  # every sample slot busy
    IDLE = "idle"  # nothing queued, nothing in flight
    PAUSED = "paused"  # a weight update is under way
    BACKLOG = "backlog"  # max_ready results wait for the trainer
    BUDGET = "budget"  # the staleness budget is spent
    ISOLATING = "isolating"  # a group whose holders died twice runs alone: claiming waits
    WAITING_ON_ENGINE = "waiting on engine"  # requests out, no answer for a while
    ENGINE_DOWN = "engine-down"  # stopped claiming until an engine answers /health
    REDIS_DOWN = "redis-down"  # retrying Redis; generation goes on
    STOPPING = "stopping"
    # Stopped on a configuration error (workers.context.Halt): "permission-denied" (Redis
    # refused a command under the worker's ACL), "reward-hung" (too many reward calls stuck).


@dataclass
class Starting:
    """A worker's /health before it registers (compose's healthcheck reads it while a model
    loads, up to 20 minutes on a first GPU start): not ready, and what it does or waits for."""

    state: str = "starting"

    def say(self, state: str) -> None:
        self.state = state

    def __call__(self) -> tuple[bool, str]:
        return False, f"starting: {self.state}"


class WorkerConfigError(RuntimeError):
    """The worker cannot work as configured (its Redis user lacks a command, its reward
    function hangs); it stopped after handing back what it held."""


class Worker:
    """Builds the collaborators, runs them, and says what the worker does (state, info)."""

    def __init__(self, settings: WorkerSettings, reward: Reward | Any | None = None):
        self.settings = settings
        # Started while Redis is down, restarting or failing over: wait for it, as every
        # later call does (up to STARTUP_WAIT_S, then a clear error), rather than exit.
        queue = Queue(connect(settings.redis_url, wait_s=STARTUP_WAIT_S), settings.namespace)
        # Eval passes go through a companion namespace with books of their own: claimed
        # first whenever it has prompts, so evaluation never waits behind training.
        eval_queue = Queue(queue.redis, eval_namespace(settings.namespace)) if settings.serve_eval else None
        self.ctx = WorkerContext(settings, queue, eval_queue, f"{settings.worker_id}#1")  # incarnation 1 (Liveness)
        self.queue, self.eval_queue, self.queues = queue, eval_queue, self.ctx.queues
        self.counters = self.ctx.counters
        self.reconnect = self.ctx.reconnect
        self.tokenizer = load_tokenizer(settings.tokenizer)
        # The worker re-discovers engines itself (REDISCOVER_S), so control calls
        # (aborts on cancel) need not discover first. Answers' token ids are checked
        # against the vocabulary where it is exact: the byte tokenizer's. (A Hugging
        # Face tokenizer can be smaller than the model's padded vocabulary.)
        self.engines = EngineSet(settings.engine_urls, timeout_s=settings.request_timeout_s,
                                 refresh_before_control=False, api_key=settings.engine_api_key,
                                 stream=settings.stream, stream_interval=settings.stream_interval,
                                 vocab_size=ByteTokenizer.vocab_size if isinstance(self.tokenizer, ByteTokenizer)
                                 else None)
        self.reward = reward or self._load_reward()
        # Synchronous rewards run on threads of their own, never on the ones Redis calls
        # use: a slow judge cannot delay a heartbeat; a hung one is abandoned at its
        # timeout and gives its place back.
        if isinstance(self.reward, Reward):
            self.reward.threads = RewardThreads(settings.reward_threads)
        self.reward_args = reward_args(settings)
        self.engine_health = EngineHealth(self.ctx, self.engines)
        generate_function = (GenerateFunction.from_path(settings.generate_function)
                             if settings.generate_function else None)
        self.runner = GroupRunner(self.ctx, self.engines, self.engine_health, self.tokenizer, self.reward,
                                  self.reward_args, generate_function)
        self.liveness = Liveness(self.ctx, settings.worker_id, self.runner, self.engine_health, self.info)
        self.claimer = Claimer(self.ctx, self.runner, self.engine_health, self.liveness)
        self.ready = asyncio.Event()  # set once registered
        self.starting = Starting()

    def _load_reward(self):
        s = self.settings
        if s.reward_queue:
            from .reward_queue import RQReward

            return RQReward(redis=self.queue.redis, path=s.reward, group=s.group_reward, queue_name=s.reward_queue)
        return Reward.from_path(s.reward, group=s.group_reward)

    @property
    def id(self) -> str:
        """`<worker_id>#<incarnation>`: a new one each time the worker registers anew."""
        return self.ctx.id

    @property
    def lease_s(self) -> float:
        return self.ctx.lease_s

    @property
    def capacity(self) -> int:
        return self.ctx.capacity

    @property
    def inflight_samples(self) -> int:
        return self.runner.inflight_samples

    # -- lifecycle -------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """/health: ready once registered, with its state; before that, what it starts."""
        return (True, self.state()) if self.ready.is_set() else self.starting()

    async def run(self) -> None:
        """Work until stop() is called; then hand back whatever is unfinished."""
        if self.settings.metrics_port:  # from the start: /health says what it waits for
            metrics.serve_metrics(self.settings.metrics_port, self.settings.metrics_host, health=self.health)
        self.starting.say("finding the engines (behind a router: asking it for them)")
        await self.engine_health.discover()
        self.starting.say("registering in Redis")
        await self.liveness.register()
        await self.liveness.heartbeat()  # learns the namespace's control state before the first answer
        if self.lease_s < HEARTBEATS_PER_LEASE * self.settings.heartbeat_s:
            await self.liveness.leave()
            raise ValueError(f"the namespace's lease ({self.lease_s:g}s) is shorter than {HEARTBEATS_PER_LEASE} "
                             f"heartbeats of this worker ({self.settings.heartbeat_s:g}s each): raise it with "
                             f"`rollout configure --lease`")
        log.info("%s", self.describe())
        fallback = scripts.fallback_reason(self.queue.redis)
        if fallback:  # said loudly where it matters: a long-running process holding a role's password
            log.warning("worker %s: %s", self.id, scripts.fallback_warning(fallback))
        self.ready.set()
        background = [asyncio.create_task(self.liveness.heartbeat_loop()),
                      asyncio.create_task(self.liveness.maintenance_loop()),
                      asyncio.create_task(self.liveness.listen_for_control())]
        if self.settings.progress_s > 0:
            background.append(asyncio.create_task(self._progress_loop()))
        try:
            await self.claimer.loop()
        except PermissionDenied as exc:
            self.ctx.refused(exc)
        finally:
            for t in background:
                t.cancel()
            await self._shutdown()
        if self.ctx.halted:
            raise WorkerConfigError(f"worker {self.id} stopped: {self.ctx.halted.reason}; {self.ctx.halted.remedy}")

    async def _progress_loop(self) -> None:
        """A line every `progress_s`: what was done since the last one, and what the worker
        does or waits on now (a worker runs for hours; silence must not hide a stall)."""
        c = self.counters
        last = (time.monotonic(), c.groups_claimed, c.groups_completed, c.samples_completed, c.groups_requeued)
        while True:
            await asyncio.sleep(self.settings.progress_s)
            now = time.monotonic()
            claimed, published, samples, requeued = (c.groups_claimed - last[1], c.groups_completed - last[2],
                                                     c.samples_completed - last[3], c.groups_requeued - last[4])
            rate = samples / max(now - last[0], 1e-9)
            last = (now, c.groups_claimed, c.groups_completed, c.samples_completed, c.groups_requeued)
            engines = self.engines.engines or self.engines.urls
            up = 0 if self.engine_health.down is not None else len(engines)
            log.info("worker %s: last %.0fs: claimed %d groups, published %d (%.1f samples/s), requeued %d; %d of "
                     "%d sample slots in flight; engines up %d of %d; %s", self.id, self.settings.progress_s,
                     claimed, published, rate, requeued, self.inflight_samples, self.capacity, up, len(engines),
                     self.state())

    def describe(self) -> str:
        """The one line a worker prints when it starts."""
        engines = self.engines.engines or self.engines.urls
        reward = getattr(self.reward, "name", self.settings.reward)
        if self.settings.reward_queue:
            reward += f" (rq queue {self.settings.reward_queue})"
        generate = f", generate function {self.settings.generate_function}" if self.settings.generate_function else ""
        return (f"worker {self.id}: namespace {self.settings.namespace}, {counted(len(engines), 'engine')} "
                f"({', '.join(engines)}), capacity {self.capacity} samples, lease {self.lease_s:g}s "
                f"(heartbeat every {self.settings.heartbeat_s:g}s), reward {reward}{generate}")

    def stop(self) -> None:
        self.ctx.stopping.set()
        self.ctx.wake.set()

    async def _shutdown(self) -> None:
        await self.runner.cancel_all(f"worker {self.id} is stopping")
        self.runner.close()
        # Give up after a lease: if Redis stays away, the reaper returns the groups anyway.
        try:
            returned = await self.liveness.leave(deadline=time.monotonic() + max(self.lease_s, 1.0))
            log.info("worker %s stopped; %d unfinished groups back to the prompt list", self.id, returned)
        except ConnectionError as exc:
            log.error("worker %s stopped without handing its groups back (%s); they return when its lease "
                      "expires", self.id, exc)
        if self.runner.aborts:  # a short grace for the aborts of what was cancelled
            await asyncio.wait(self.runner.aborts, timeout=5.0)
        await self.engines.close()

    # -- what it does ----------------------------------------------------------------

    def state(self) -> str:
        """What the worker does or waits on, for status (one line)."""
        runner, claimer = self.runner, self.claimer
        if self.ctx.halted:
            return f"{self.ctx.halted.state}: {self.ctx.halted.reason}"
        if self.ctx.stopping.is_set():
            return WorkerState.STOPPING.value
        if self.reconnect.down:
            return f"{WorkerState.REDIS_DOWN.value}: {self.reconnect.last_error}"
        if self.engine_health.down is not None:
            return f"{WorkerState.ENGINE_DOWN.value}: {self.engine_health.down}"
        if self.ctx.paused:
            return WorkerState.PAUSED.value
        silent = time.monotonic() - runner.last_answer
        if runner.outstanding and silent > WAITING_ON_ENGINE_S:
            return (f"{WorkerState.WAITING_ON_ENGINE.value}: {runner.outstanding} requests out, "
                    f"no answer for {silent:.0f}s")
        if claimer.status == ClaimStatus.BACKLOG:
            return WorkerState.BACKLOG.value
        if claimer.status == ClaimStatus.BUDGET:
            return WorkerState.BUDGET.value
        if claimer.status == ClaimStatus.ISOLATING:
            return (f"{WorkerState.ISOLATING.value}: a group whose workers died twice runs alone"
                    + ("; finishing the groups held first" if runner.running else ""))
        if runner.running and self.capacity - runner.inflight_samples < runner.group_size:
            return f"{WorkerState.FULL.value}: {runner.inflight_samples} of {self.capacity} sample slots"
        if runner.running:
            return WorkerState.RUNNING.value
        if claimer.status == ClaimStatus.EMPTY:
            return WorkerState.IDLE.value
        return WorkerState.STARTING.value if not claimer.claims else WorkerState.RUNNING.value

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "engines": self.engines.engines or self.engines.urls,
            "state": self.state(),
            "capacity": self.capacity,
            "inflight_samples": self.inflight_samples,
            "inflight_groups": len(self.runner.running),
            "lease_s": self.lease_s,
            "heartbeat_s": self.settings.heartbeat_s,
            "redis_outages": self.reconnect.outages,
            "last_redis_outage_s": round(self.reconnect.last_outage_s, 3),
            "counters": asdict(self.counters),
            "registration": self.liveness.registration,
        }


def reward_args(settings: WorkerSettings) -> SimpleNamespace:
    """The `args` a reward gets: the worker's settings, also under slime's names (a slime
    reward reads args.rm_type, args.rm_url, args.rollout_max_response_len, ...)."""
    sp = settings.sampling
    # custom_rm_path stays None: the worker calls its reward itself, and slime's
    # dispatchers (rm_hub.async_rm) call args.custom_rm_path first, so naming the reward
    # there makes `--reward slime.rollout.rm_hub.async_rm --rm-type math` call itself forever.
    return SimpleNamespace(
        rm_url=settings.rm_url, reward_key=settings.reward_key, rm_type=settings.rm_type,
        group_rm=settings.group_reward, custom_rm_path=None, partial_rollout=settings.partial_rollout,
        rollout_temperature=sp.temperature, rollout_top_p=sp.top_p, rollout_top_k=sp.top_k,
        rollout_max_response_len=sp.max_new_tokens, rollout_stop=sp.stop or None,
        rollout_stop_token_ids=sp.stop_token_ids or None, **asdict(sp))


async def run_worker(settings: WorkerSettings) -> None:
    """Run one worker until SIGINT/SIGTERM."""
    import signal

    # Hundreds of thousands of long-lived objects (requests in flight) made full
    # collections take ~1 s each and ~45% of the worker's CPU (bench/inflight.py);
    # freezing the startup heap and collecting less often brought that to ~6%.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    worker = Worker(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    running = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    await asyncio.wait([running, ready], return_when=asyncio.FIRST_COMPLETED)
    if worker.ready.is_set():
        print(worker.describe(), file=sys.stderr, flush=True)
    ready.cancel()
    await running
