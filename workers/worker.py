"""The stateless generation worker.

One asyncio process keeps a fixed pool of samples in flight: capacity is counted in
samples (`concurrency_per_engine` × engines, like slime's sglang_server_concurrency),
and a group of n samples takes n slots. Everything it holds is also in Redis (its
in-flight hash, each group under the token of the claim that took it, and the stored
payloads), so `kill -9` loses nothing: the reaper gives its groups back after the lease.

Per group: tokenize, call /generate for every unfinished sample (continuing aborted
ones from their partial tokens), then either requeue (a pause interrupted it, or the
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
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import queue as threadqueue
import random
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from types import SimpleNamespace
from typing import Any, Callable

from pipeline import metrics
from pipeline.codec import EncodeError, encode_group
from pipeline.connection import connect
from pipeline.control import DEFAULT_HEARTBEAT_S, HEARTBEATS_PER_LEASE, read_control
from pipeline.keys import eval_namespace
from pipeline.queue import Claim, ClaimedGroup, ClaimStatus, Place, Published, Queue
from pipeline.retry import Reconnect
from pipeline.types import SEGMENTS_KEY, Group, Sample, Status, VersionClock, parse_version

from .engine import EngineError, EngineProtocolError, EngineRequestError, EngineSet, GenerateResult
from .rewards import BUILTIN_REWARDS, MissingLabel, Reward, RewardError
from .sampling import SamplingSettings
from .tokenizer import ByteTokenizer, encode_prompt, load_tokenizer

log = logging.getLogger(__name__)

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
#: Requests outstanding with no engine answer for this long: the state says "waiting on engine".
WAITING_ON_ENGINE_S = 10.0
#: How often a worker looks for engines joining or leaving behind its router URLs.
REDISCOVER_S = 30.0


@dataclass
class WorkerSettings:
    redis_url: str
    engine_urls: list[str]
    namespace: str = "rollout"
    concurrency_per_engine: int = 512  # samples, as slime's sglang_server_concurrency
    tokenizer: str | None = None  # None: the byte-level tokenizer; else a HF path
    apply_chat_template: bool = False
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    reward: str = "math_boxed"  # built-in name or dotted path
    group_reward: bool = False  # slime's --group-rm
    reward_key: str | None = None
    rm_url: str | None = None  # for the remote_rm built-in
    rm_type: str | None = None  # slime's --rm-type, for a reward that reads it (slime's async_rm)
    reward_queue: str | None = None  # rq queue name: score in rq workers instead of here
    reward_timeout_s: float = 300.0  # a reward call running longer is abandoned and retried
    reward_threads: int = 16  # threads for synchronous reward functions
    max_attempts: int = 3  # engine or reward failures per group before dead-lettering
    backoff_s: float = 0.5  # first retry delay; doubles up to backoff_max_s
    backoff_max_s: float = 30.0
    engine_down_after: int = 5  # consecutive engine failures that stop claiming
    request_timeout_s: float = 600.0
    heartbeat_s: float = DEFAULT_HEARTBEAT_S  # the namespace's lease must cover three
    mask_offpolicy_prefix: bool = False  # slime's --mask-offpolicy-in-partial-rollout
    metrics_port: int | None = None  # serve Prometheus metrics here
    metrics_host: str = metrics.DEFAULT_HOST  # the address metrics_port listens on
    keep_response_text: bool = False  # include response texts in results (tokens are always there)
    serve_eval: bool = True  # also serve `<namespace>.eval` (pipeline/trainers/eval.py), ahead of training
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")


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


@dataclass
class WorkerCounters:
    groups_completed: int = 0
    groups_requeued: int = 0
    groups_dead: int = 0
    groups_lost: int = 0  # publish refused: reaped or handed back while we worked on them
    handed_back: int = 0  # held in Redis with no task here, given back by reconciliation
    cancelled: int = 0  # tasks cancelled because Redis no longer gave us their group
    reincarnations: int = 0  # times this process was reaped and registered anew
    requests: int = 0
    engine_errors: int = 0
    reward_errors: int = 0
    versions_ahead: int = 0  # engine answers with a weight version newer than the queue's


class GroupFailed(Exception):
    """A group cannot be finished; it goes to dead letters with this message."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason  # short category: engine, bad_request, reward, missing_label, input, encode


class DaemonPool(Executor):
    """A fixed set of daemon threads. A call stuck in code we do not control (a reward
    in an endless loop) is abandoned instead of hanging the process at exit, as a
    ThreadPoolExecutor would (it joins its threads)."""

    def __init__(self, size: int, name: str):
        self._work: threadqueue.SimpleQueue = threadqueue.SimpleQueue()
        for i in range(size):
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._work.get()
            if future is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._work.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # daemon threads: nothing to wait for


@dataclass(eq=False)
class Running:
    """A group this worker works on, with the token of the claim that took it."""

    group: Group
    token: str
    payload: bytes  # as claimed: what a dead letter keeps if the group cannot be encoded
    serial: int  # unique in this process; request ids start with "<worker id>/<serial>/"
    slots: int
    queue: Queue  # the namespace it was claimed from (training, or its eval companion)
    task: asyncio.Task | None = None
    publishing: bool = False


class Worker:
    def __init__(self, settings: WorkerSettings, reward: Reward | Any | None = None):
        self.settings = settings
        self.name = settings.worker_id
        self.incarnation = 1
        self.id = f"{self.name}#{self.incarnation}"
        self.queue = Queue(connect(settings.redis_url), settings.namespace)
        # Eval passes go through a companion namespace with books of their own: claimed
        # first whenever it has prompts, so evaluation never waits behind training.
        self.eval_queue = Queue(self.queue.redis, eval_namespace(settings.namespace)) if settings.serve_eval else None
        self.queues = [self.queue] + ([self.eval_queue] if self.eval_queue else [])
        self.tokenizer = load_tokenizer(settings.tokenizer)
        # The worker re-discovers engines itself (REDISCOVER_S), so control calls
        # (aborts on cancel) need not discover first. Answers' token ids are checked
        # against the vocabulary where it is exact: the byte tokenizer's. (A Hugging
        # Face tokenizer can be smaller than the model's padded vocabulary.)
        self.engines = EngineSet(settings.engine_urls, timeout_s=settings.request_timeout_s,
                                 refresh_before_control=False,
                                 vocab_size=ByteTokenizer.vocab_size if isinstance(self.tokenizer, ByteTokenizer)
                                 else None)
        self.reward = reward or self._load_reward()
        # Synchronous rewards run on threads of their own, never on the ones Redis calls
        # use: a slow judge cannot delay a heartbeat, a hung one cannot hold up exit.
        self._reward_pool = DaemonPool(settings.reward_threads, "reward")
        if isinstance(self.reward, Reward):
            self.reward.executor = self._reward_pool
        self.reward_args = reward_args(settings)
        self.counters = WorkerCounters()
        self.reconnect = Reconnect(f"worker {self.id}")
        self.lease_s = 0.0  # the namespace's, learned at registration and with every heartbeat
        self.capacity = settings.concurrency_per_engine * len(settings.engine_urls)
        self.inflight_samples = 0
        self._running: dict[str, Running] = {}  # group id -> what works on it
        self._serial = 0
        self._claims = 0
        self._claim_status = ClaimStatus.OK
        self._consecutive_engine_failures = 0
        self._engine_down: str | None = None  # why, while the breaker is open
        self._engine_down_since = 0.0
        # After /health says an engine is back, the first failure opens the breaker again
        # (half-open), and each reopening doubles the wait before the next probe.
        self._engine_trial = False
        self._engine_probe_s = 1.0
        self._engine_next_probe = 0.0
        self._outstanding = 0  # engine requests in flight
        self._last_answer = time.monotonic()
        # Samples per group, to size claims; unknown until the first claim, so that one
        # takes a single group (slime over-prefetched n-fold by guessing 1).
        self._group_size = self.capacity
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._claim_lock = asyncio.Lock()  # a claim and its tasks' start, vs reconciliation
        self._paused = False  # admission paused (a weight update is under way)
        self._queue_version = 0  # the trainer's weight version, as the last claim or heartbeat said
        # On the queue clock (slime) the engines number versions their own way: no warnings.
        self._version_clock = VersionClock.ENGINE
        self._versions_ahead_seen: set[str] = set()
        self.ready = asyncio.Event()  # set once registered
        self._last_reap = 0.0
        self._last_orphan_reap = 0.0
        self._last_discovery = time.monotonic()
        self._aborts: set[asyncio.Task] = set()
        self._abort_slots = asyncio.Semaphore(16)  # aborts in flight at once
        self._redis_pool = DaemonPool(6, "redis")  # one of them waits on control events

    def _load_reward(self):
        s = self.settings
        if s.reward_queue:
            from .reward_queue import RQReward

            return RQReward(redis=self.queue.redis, path=s.reward, group=s.group_reward, queue_name=s.reward_queue)
        return Reward.from_path(s.reward, group=s.group_reward)

    async def _redis(self, fn: Callable, *args: Any, deadline: float | None = None) -> Any:
        """A Redis call on the Redis pool, retried through outages."""
        return await self.reconnect.acall(self._redis_pool, fn, *args, deadline=deadline)

    # -- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        """Work until stop() is called; then hand back whatever is unfinished."""
        await self._discover_engines()
        await self._register()
        await self._heartbeat()  # learns the namespace's control state before the first answer
        if self.lease_s < HEARTBEATS_PER_LEASE * self.settings.heartbeat_s:
            await self._leave()
            raise ValueError(f"the namespace's lease ({self.lease_s:g}s) is shorter than {HEARTBEATS_PER_LEASE} "
                             f"heartbeats of this worker ({self.settings.heartbeat_s:g}s each): raise it with "
                             f"`rollout configure --lease`")
        if self.settings.metrics_port:
            metrics.serve_metrics(self.settings.metrics_port, self.settings.metrics_host)
        log.info("%s", self.describe())
        self.ready.set()
        background = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._maintenance_loop()),
                      asyncio.create_task(self._listen_for_control())]
        try:
            await self._claim_loop()
        finally:
            for t in background:
                t.cancel()
            await self._shutdown()

    def describe(self) -> str:
        """The one line a worker prints when it starts."""
        engines = self.engines.engines or self.settings.engine_urls
        reward = getattr(self.reward, "name", self.settings.reward)
        if self.settings.reward_queue:
            reward += f" (rq queue {self.settings.reward_queue})"
        return (f"worker {self.id}: namespace {self.settings.namespace}, {len(engines)} engines "
                f"({', '.join(engines)}), capacity {self.capacity} samples, lease {self.lease_s:g}s "
                f"(heartbeat every {self.settings.heartbeat_s:g}s), reward {reward}")

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def _register(self) -> None:
        info = json.dumps(self.info())
        self.lease_s = await self._redis(self.queue.register, self.id, info)
        if self.eval_queue:
            await self._redis(self.eval_queue.register, self.id, info)

    async def _leave(self, deadline: float | None = None) -> int:
        returned = 0
        for queue in self.queues:
            returned += await self._redis(queue.leave, self.id, deadline=deadline)
        return returned

    async def _shutdown(self) -> None:
        await self._cancel_all(f"worker {self.id} is stopping")
        # Give up after a lease: if Redis stays away, the reaper returns the groups anyway.
        try:
            returned = await self._leave(deadline=time.monotonic() + max(self.lease_s, 1.0))
            log.info("worker %s stopped; %d unfinished groups back to the prompt list", self.id, returned)
        except ConnectionError as exc:
            log.error("worker %s stopped without handing its groups back (%s); they return when its lease "
                      "expires", self.id, exc)
        if self._aborts:  # a short grace for the aborts of what was cancelled
            await asyncio.wait(self._aborts, timeout=5.0)
        await self.engines.close()

    async def _cancel_all(self, why: str) -> None:
        """Cancel every group task (each aborts its requests on the engines)."""
        runs = list(self._running.values())
        if not runs:
            return
        log.info("%s: cancelling %d group tasks", why, len(runs))
        for run in runs:
            run.task.cancel()
        await asyncio.gather(*(r.task for r in runs), return_exceptions=True)

    def _abort_request(self, rid: str) -> None:
        """Best effort, in the background: a request the engines would otherwise finish
        for nobody. (SGLang only aborts a rid it knows, so one at a time, every engine:
        behind a router nobody knows which engine has it.)"""
        async def abort() -> None:
            async with self._abort_slots:
                try:
                    await self.engines.abort(rid=rid)
                except Exception as exc:
                    log.debug("abort of request %s failed: %s", rid, exc)

        task = asyncio.create_task(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _reincarnate(self, reaped: str) -> None:
        """We were reaped (stalled past the lease): another worker may have our groups.
        Cancel everything and register as a new worker. `reaped` is the id Redis refused:
        the claim loop, the heartbeat and the control listener can learn it at once, and
        only the first registers anew."""
        async with self._claim_lock:
            if self.reconnect.down or self.id != reaped:
                return
            old = self.id
            log.error("worker %s was reaped (no heartbeat within its %gs lease); cancelling its %d group tasks "
                      "(their publishes would be refused) and registering anew", old, self.lease_s,
                      len(self._running))
            await self._cancel_all(f"worker {old} was reaped")
            for queue in self.queues:  # in case its lease ran out and nobody reaped it yet
                await self._redis(queue.reap, old)
            self.incarnation += 1
            self.counters.reincarnations += 1
            self.id = f"{self.name}#{self.incarnation}"
            self.reconnect.what = f"worker {self.id}"
            await self._register()
            log.warning("worker %s registered as %s", old, self.id)

    # -- claiming --------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        idle_wait = 0.01
        while not self._stopping.is_set():
            if self._engine_down is not None:
                await self._sleep(1.0)
                continue
            free = self.capacity - self.inflight_samples
            # A group larger than the whole capacity is still claimed, alone.
            if free < self._group_size and self._running:
                await self._sleep(1.0)  # woken when a sample slot frees
                continue
            claim = await self._claim(max(1, free // self._group_size))
            if claim is None:
                continue
            if claim.groups:
                idle_wait = 0.01
                continue
            # Control changes arrive as events (pub/sub) and wake us; this wait is the
            # fallback, short at first so a trickle of prompts is picked up quickly.
            await self._sleep(idle_wait)
            idle_wait = min(idle_wait * 2, 0.1)

    async def _claim_eval(self, worker_id: str, want: int) -> Claim | None:
        """Eval prompts first, while admission is open (a weight update pauses them too)."""
        if self.eval_queue is None or self._paused or not await self._redis(self.eval_queue.has_prompts):
            return None
        self._claims += 1
        claim = await self._redis(self.eval_queue.claim, worker_id, f"{worker_id}:{self._claims}", want)
        if not self._stopping.is_set():
            for claimed in claim.groups:
                self._start(claimed, self.eval_queue)
        return claim if claim.groups or claim.status in (ClaimStatus.UNREGISTERED, ClaimStatus.EXPIRED) else None

    async def _claim(self, want: int) -> Claim | None:
        async with self._claim_lock:
            worker_id = self.id
            claim = await self._claim_eval(worker_id, want)
            if claim is None:
                self._claims += 1
                # The claim id is the groups' fencing token; a retry after a lost reply
                # presents the same id and gets the same groups.
                claim = await self._redis(self.queue.claim, worker_id, f"{worker_id}:{self._claims}", want)
                self._claim_status = claim.status
                self._queue_version = claim.weight_version
                if claim.status not in (ClaimStatus.UNREGISTERED, ClaimStatus.EXPIRED):  # answered before `paused`
                    self._paused = claim.status == ClaimStatus.PAUSED
                if self._stopping.is_set():
                    return claim  # what this claim took goes back with leave() in _shutdown
                for claimed in claim.groups:
                    self._start(claimed, self.queue)
        if claim.status == ClaimStatus.UNREGISTERED:
            await self._reincarnate(worker_id)
            return None
        if claim.status == ClaimStatus.EXPIRED:
            await self._heartbeat()  # renews the lease, or finds we were reaped meanwhile
            return None
        return claim

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _start(self, claimed: ClaimedGroup, queue: Queue) -> None:
        group = claimed.group
        if group is None:
            return  # malformed: the queue dead-lettered it
        old = self._running.get(group.group_id)
        if old is not None:  # claimed again while an old task lingers: that one's token is stale
            old.task.cancel()
            self._release_slots(old)
        group.worker = self.id
        group.claimed_at = time.time()
        if group.n_samples > self.capacity:
            log.warning("group %s has %d samples, more than this worker's capacity of %d: running it alone",
                        group.group_id, group.n_samples, self.capacity)
        self._group_size = max(1, group.n_samples)
        # A slot per sample to generate, given back as each request finishes: a group
        # waiting on its slowest sample holds one slot, not n (the engine sees the rest free).
        slots = max(1, sum(s.status in (Status.PENDING, Status.ABORTED) for s in group.samples))
        self._serial += 1
        run = Running(group, claimed.token, claimed.payload, self._serial, slots, queue)
        self._running[group.group_id] = run
        self.inflight_samples += slots
        run.task = asyncio.create_task(self._process(run))
        # A done callback, not a finally: it also runs for a task cancelled before it started.
        run.task.add_done_callback(lambda _t, r=run: self._finished(r))

    def _release_slots(self, run: Running) -> None:
        self.inflight_samples -= run.slots
        run.slots = 0

    def _finished(self, run: Running) -> None:
        self._release_slots(run)
        if self._running.get(run.group.group_id) is run:
            del self._running[run.group.group_id]
        self._wake.set()

    # -- one group -------------------------------------------------------------------

    async def _process(self, run: Running) -> None:
        group = run.group
        try:
            place, failure = await self._generate_group(run)
            group.finished_at = time.time()
            group.error = None if failure is None else str(failure)
            await self._publish(run, place, failure)
        except asyncio.CancelledError:
            self.counters.cancelled += 1
            raise
        except Exception as exc:  # one bad group must never take the worker down
            log.exception("group %s: unexpected error; dead-lettering it", group.group_id)
            metrics.DEAD_LETTERS.labels("worker_error").inc()
            # What was claimed, not the group as generated: that may be what cannot be stored.
            # If even this fails, the group stays held in Redis with no task, and the next
            # reconciliation gives it back (and max_claims ends a group that keeps doing it).
            run.publishing = True
            try:
                outcome = await self._redis(run.queue.publish, self.id, group.group_id, run.token, run.payload,
                                            Place.DEAD, f"worker error: {type(exc).__name__}: {exc}", "worker_error")
            except Exception as again:
                log.error("group %s: could not dead-letter it either (%s); reconciliation gives it back",
                          group.group_id, again)
                return
            if outcome != Published.REFUSED:
                self.counters.groups_dead += 1

    async def _publish(self, run: Running, place: Place, failure: GroupFailed | None) -> None:
        group = run.group
        try:
            payload = encode_group(group, self.settings.keep_response_text or place != Place.RESULTS)
        except EncodeError as exc:
            # What was generated breaks the schema: it must not reach the trainer.
            log.error("group %s: cannot store it as generated (%s); dead-lettering it as claimed",
                      group.group_id, exc)
            place, payload = Place.DEAD, run.payload
            failure = GroupFailed(f"cannot store the generated group: {exc}", "encode")
        if failure is not None:
            metrics.DEAD_LETTERS.labels(failure.reason).inc()
        error, reason = (None, "") if failure is None else (str(failure), failure.reason)
        run.publishing = True
        outcome = await self._redis(run.queue.publish, self.id, group.group_id, run.token, payload, place, error,
                                    reason)
        metrics.GROUPS_PUBLISHED.labels(place.value if outcome != Published.REFUSED else "lost").inc()
        if outcome == Published.REFUSED:
            self.counters.groups_lost += 1
        elif place == Place.RESULTS:
            self.counters.groups_completed += 1
        elif place == Place.REQUEUE:
            self.counters.groups_requeued += 1
            log.info("group %s: unfinished (paused or engines down); partial output requeued", group.group_id)
        else:
            self.counters.groups_dead += 1
            log.error("group %s: dead-lettered: %s", group.group_id, error)

    async def _generate_group(self, run: Running) -> tuple[Place, GroupFailed | None]:
        """Returns where the group goes and, for dead letters, why."""
        group = run.group
        try:
            if not group.samples:
                raise GroupFailed("group has no samples", "input")
            self._stamp_sampling(group)
            if not group.prompt_ids:
                group.prompt_ids = encode_prompt(self.tokenizer, group.samples[0].prompt,
                                                 self.settings.apply_chat_template)
            await asyncio.gather(*(self._generate_sample_in_slot(run, s) for s in group.samples
                                   if s.status in (Status.PENDING, Status.ABORTED)))
            if any(s.status in (Status.PENDING, Status.ABORTED) for s in group.samples):
                return Place.REQUEUE, None
            await self._score(group)
            return Place.RESULTS, None
        except GroupFailed as exc:
            return Place.DEAD, exc
        except ValueError as exc:  # the tokenizer refused the prompt
            return Place.DEAD, GroupFailed(f"bad prompt: {exc}", "input")

    def _stamp_sampling(self, group: Group) -> None:
        """Record the settings this worker samples with. A group continued here after a
        worker with other settings started it starts over: one sample's tokens must come
        from one distribution, the one the trainer computes probabilities with."""
        mine = self.settings.sampling.record()
        if group.sampling is not None and group.sampling != mine:
            log.warning("group %s: started with %s, this worker samples with %s; generating it again from its "
                        "prompt", group.group_id, group.sampling, mine)
            group.reset()
        group.sampling = mine

    async def _generate_sample_in_slot(self, run: Running, sample: Sample) -> None:
        try:
            await self._generate_sample(run, sample)
        finally:
            if run.slots > 1:  # the group's last slot goes with the group
                run.slots -= 1
                self.inflight_samples -= 1
                self._wake.set()

    async def _generate_sample(self, run: Running, sample: Sample) -> None:
        s, group = self.settings, run.group
        if not sample.tokens:
            sample.tokens = list(group.prompt_ids)
        failures = group.attempts  # carried over from earlier claims of this group
        attempt = 0
        while True:
            remaining = s.sampling.max_new_tokens - sample.response_length
            if remaining <= 0:
                sample.status = Status.TRUNCATED  # nothing left to generate: no request
                return
            if self._paused or self._engine_down is not None:
                # A weight update is under way (a request sent now would wait at the paused
                # engine where an abort cannot reach it), or the engines are down: leave the
                # sample as it is; the group is requeued and continues later, maybe elsewhere.
                return
            attempt += 1
            # A new request id per attempt: an engine still holding the first would refuse a
            # duplicate.
            rid = f"{self.id}/{run.serial}/{sample.index}/{attempt}"
            try:
                result = await self._request(rid, sample.tokens, s.sampling.params(remaining))
                self._append(sample, result)
                if result.finish_type != "abort":
                    self._engine_ok()
                    return
                if await self._pause_explains_abort():
                    return  # requeued with its partial output; continues after the resume
                error = EngineError(f"engine aborted request {rid} while nothing was paused "
                                    f"({(result.finish_reason or {}).get('message', 'no message')})")
            except EngineRequestError as exc:
                metrics.ENGINE_ERRORS.labels("bad_request").inc()
                raise GroupFailed(f"engine rejected the request: {exc}", "bad_request") from None
            except EngineError as exc:  # unavailable, timed out, or an answer that breaks the protocol
                error = exc
            self._engine_failed(error)
            if self._engine_down is not None:
                return  # not this group's fault: it is requeued for a worker with engines
            # Attempts count per sample: the n samples of a group failing in the same
            # moment are one bad moment, not n. The group keeps its worst count.
            failures += 1
            group.attempts = max(group.attempts, failures)
            if failures >= s.max_attempts:
                raise GroupFailed(f"engine failed {failures} times; last error: {error}", "engine") from None
            delay = min(s.backoff_max_s, s.backoff_s * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)
            log.debug("group %s: engine error (%s); retry %d in %.1fs", group.group_id, error, failures, delay)
            await asyncio.sleep(delay)

    async def _request(self, rid: str, tokens: list[int], params: dict) -> GenerateResult:
        self.counters.requests += 1
        self._outstanding += 1
        started = time.monotonic()
        try:
            result = await self.engines.generate(tokens, params, rid=rid)
        except asyncio.CancelledError:  # reaped, shutting down, or the group is no longer ours
            self._abort_request(rid)
            raise
        except EngineError as exc:
            if exc.status is None and not isinstance(exc, EngineProtocolError):
                self._abort_request(rid)  # timed out or cut off: the engine may still be generating it
            raise
        finally:
            self._outstanding -= 1
        self._last_answer = time.monotonic()
        metrics.GENERATION_LATENCY.observe(self._last_answer - started)
        metrics.OUTPUT_TOKENS.observe(len(result.output_ids))
        return result

    async def _pause_explains_abort(self) -> bool:
        """An abort answer is a pause's doing when admission is paused. The controller
        sets `paused` in Redis before it pauses the engines, so Redis knows first."""
        if self._paused:
            return True
        self._paused = (await self._redis(read_control, self.queue.redis, self.queue.keys)).paused
        return self._paused

    def _append(self, sample: Sample, result: GenerateResult) -> None:
        """Add one engine answer to a sample; a continuation extends the previous one."""
        n_new = len(result.output_ids)
        previous_mask = sample.loss_mask
        sample.tokens += result.output_ids
        sample.response_length += n_new
        sample.response += result.text
        sample.rollout_log_probs = (sample.rollout_log_probs or []) + result.output_log_probs
        segments = sample.metadata.setdefault(SEGMENTS_KEY, [])
        if n_new:  # a call that produced nothing (aborted while queued) adds no version
            sample.weight_versions.append(result.weight_version)
            segments.append(n_new)
            self._check_version(result.weight_version)
        sample.status = FINISH_STATUS[result.finish_type]
        if sample.status == Status.ABORTED:
            metrics.SAMPLES_ABORTED.inc()
        if previous_mask is not None:
            sample.loss_mask = previous_mask + [1] * n_new
        if self.settings.mask_offpolicy_prefix and sample.status != Status.ABORTED:
            sample.loss_mask = offpolicy_mask(sample.weight_versions, segments)

    def _check_version(self, version: str) -> None:
        """An engine ahead of the queue's weight version means the trainer updates the
        engines without telling the queue: staleness checks would be off. Say so."""
        v = parse_version(version)
        if v is None or v <= self._queue_version or self._version_clock == VersionClock.QUEUE:
            return
        self.counters.versions_ahead += 1
        if version not in self._versions_ahead_seen:
            self._versions_ahead_seen.add(version)
            log.warning("worker %s: an engine generates with weight version %s, ahead of the queue's %d: bump "
                        "the queue's version with every weight update (Controller.resume(weight_version=...), "
                        "`rollout resume --weight-version`)", self.id, version, self._queue_version)

    async def _score(self, group: Group) -> None:
        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                rewards = await asyncio.wait_for(self.reward.score(self.reward_args, group.samples),
                                                 self.settings.reward_timeout_s)
                for s, r in zip(group.samples, rewards):
                    s.reward = r
                return
            except MissingLabel as exc:
                self.counters.reward_errors += 1
                raise GroupFailed(f"{exc}; not retried: give the rows a label (push --label-key), or use a reward "
                                  f"that needs none", "missing_label") from None
            except (RewardError, asyncio.TimeoutError) as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    # A synchronous reward keeps its thread until it returns; the pool has
                    # others, and the group is retried or dead-lettered meanwhile.
                    exc = RewardError(f"reward took longer than {self.settings.reward_timeout_s:g}s "
                                      f"(--reward-timeout); abandoned")
                self.counters.reward_errors += 1
                if attempt == self.settings.max_attempts:
                    raise GroupFailed(f"reward failed {attempt} times; last error: {exc}", "reward") from None
                log.warning("group %s: reward error (%s); retry %d", group.group_id, exc, attempt)
                await asyncio.sleep(min(self.settings.backoff_max_s, self.settings.backoff_s * 2 ** (attempt - 1)))

    # -- engine health ---------------------------------------------------------------

    def _engine_ok(self) -> None:
        self._consecutive_engine_failures = 0
        if self._engine_trial:
            self._engine_trial, self._engine_probe_s = False, 1.0

    def _engine_failed(self, exc: EngineError) -> None:
        metrics.ENGINE_ERRORS.labels("unavailable" if exc.status is None else str(exc.status)).inc()
        self.counters.engine_errors += 1
        self._consecutive_engine_failures += 1
        if self._engine_down is not None:
            return
        if self._engine_trial:  # back too early: wait twice as long before the next probe
            self._engine_probe_s = min(30.0, self._engine_probe_s * 2)
        elif self._consecutive_engine_failures < self.settings.engine_down_after:
            return
        self._engine_down, self._engine_trial = str(exc), False
        self._engine_down_since = time.monotonic()
        self._engine_next_probe = self._engine_down_since + self._engine_probe_s
        log.error("worker %s: engine-down after %d failures in a row (last: %s); stopped claiming and handing "
                  "unfinished groups on; next /health probe in %gs", self.id, self._consecutive_engine_failures,
                  exc, self._engine_probe_s)

    async def _check_engines(self) -> None:
        """While down: any engine answering /health brings the worker back (one
        decommissioned engine behind a router must not keep it down), on trial."""
        if self._engine_down is None or time.monotonic() < self._engine_next_probe:
            return
        healthy = await self.engines.health()
        if any(healthy.values()):
            log.warning("worker %s: engines answer /health again after %.0fs (%s); claiming again", self.id,
                        time.monotonic() - self._engine_down_since, ", ".join(u for u, ok in healthy.items() if ok))
            self._engine_down, self._engine_trial = None, True
            self._consecutive_engine_failures = 0
            self._wake.set()
        else:
            self._engine_next_probe = time.monotonic() + self._engine_probe_s

    async def _discover_engines(self) -> None:
        """Engines behind the given router URLs come and go: capacity follows them."""
        try:
            engines = await self.engines.refresh()
        except EngineError as exc:  # keep going: generation goes through the given URLs
            log.warning("engine discovery failed (%s); using %s as given", exc, self.settings.engine_urls)
            return
        capacity = self.settings.concurrency_per_engine * max(1, len(engines))
        if capacity != self.capacity and self.lease_s:
            log.warning("worker %s: %d engines now (%s); capacity %d -> %d samples", self.id, len(engines),
                        ", ".join(engines), self.capacity, capacity)
        self.capacity = capacity
        self._wake.set()

    # -- heartbeat, reconciliation and upkeep ------------------------------------------

    def state(self) -> str:
        """What the worker does or waits on, for status (one line)."""
        if self._stopping.is_set():
            return WorkerState.STOPPING.value
        if self.reconnect.down:
            return f"{WorkerState.REDIS_DOWN.value}: {self.reconnect.last_error}"
        if self._engine_down is not None:
            return f"{WorkerState.ENGINE_DOWN.value}: {self._engine_down}"
        if self._paused:
            return WorkerState.PAUSED.value
        silent = time.monotonic() - self._last_answer
        if self._outstanding and silent > WAITING_ON_ENGINE_S:
            return (f"{WorkerState.WAITING_ON_ENGINE.value}: {self._outstanding} requests out, "
                    f"no answer for {silent:.0f}s")
        if self._claim_status == ClaimStatus.BACKLOG:
            return WorkerState.BACKLOG.value
        if self._claim_status == ClaimStatus.BUDGET:
            return WorkerState.BUDGET.value
        if self._claim_status == ClaimStatus.ISOLATING:
            return (f"{WorkerState.ISOLATING.value}: a group whose workers died twice runs alone"
                    + ("; finishing the groups held first" if self._running else ""))
        if self._running and self.capacity - self.inflight_samples < self._group_size:
            return f"{WorkerState.FULL.value}: {self.inflight_samples} of {self.capacity} sample slots"
        if self._running:
            return WorkerState.RUNNING.value
        if self._claim_status == ClaimStatus.EMPTY:
            return WorkerState.IDLE.value
        return WorkerState.STARTING.value if not self._claims else WorkerState.RUNNING.value

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "engines": self.engines.engines or self.settings.engine_urls,
            "state": self.state(),
            "capacity": self.capacity,
            "inflight_samples": self.inflight_samples,
            "inflight_groups": len(self._running),
            "lease_s": self.lease_s,
            "heartbeat_s": self.settings.heartbeat_s,
            "redis_outages": self.reconnect.outages,
            "last_redis_outage_s": round(self.reconnect.last_outage_s, 3),
            "counters": asdict(self.counters),
        }

    async def _listen_for_control(self) -> None:
        """Pause and resume are published on the events channel: wake the claim loop
        at once, so admission follows control changes within milliseconds. The
        heartbeat carries the same state, should an event be missed."""
        loop = asyncio.get_running_loop()
        while True:
            pubsub = self.queue.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await loop.run_in_executor(self._redis_pool, pubsub.subscribe, self.queue.keys.events)
                while True:
                    message = await loop.run_in_executor(self._redis_pool, lambda: pubsub.get_message(timeout=1.0))
                    if message is None:
                        continue
                    try:
                        paused = bool(json.loads(message["data"])["paused"])
                    except (ValueError, KeyError, TypeError):
                        log.warning("worker %s: ignoring malformed control event %r", self.id, message["data"])
                        continue
                    self._paused = paused
                    self._wake.set()
                    await self._heartbeat()  # so status shows the new state at once
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: the heartbeat carries the state meanwhile
                log.debug("worker %s: control events interrupted (%s); resubscribing", self.id, exc)
                await asyncio.sleep(1.0)
            finally:
                await loop.run_in_executor(self._redis_pool, pubsub.close)

    async def _heartbeat(self) -> None:
        metrics.INFLIGHT_SAMPLES.set(self.inflight_samples)
        worker_id = self.id
        info = json.dumps(self.info())
        beat = await self._redis(self.queue.heartbeat, worker_id, info)
        if beat.reaped or (self.eval_queue and (await self._redis(self.eval_queue.heartbeat, worker_id, info)).reaped):
            await self._reincarnate(worker_id)
            return
        self._paused = beat.paused  # a missed event: the heartbeat carries the truth
        self._queue_version = beat.weight_version
        self._version_clock = beat.version_clock
        if beat.lease_s != self.lease_s:
            log.warning("worker %s: the namespace's lease is now %gs (was %gs)", self.id, beat.lease_s, self.lease_s)
            if beat.lease_s < HEARTBEATS_PER_LEASE * self.settings.heartbeat_s:
                log.error("worker %s: a %gs lease is shorter than %d of this worker's %gs heartbeats; it may be "
                          "reaped while alive", self.id, beat.lease_s, HEARTBEATS_PER_LEASE, self.settings.heartbeat_s)
            self.lease_s = beat.lease_s

    async def _reconcile(self) -> None:
        """Make this process and Redis agree on what it holds."""
        async with self._claim_lock:
            for queue in self.queues:
                await self._reconcile_with(queue)

    async def _reconcile_with(self, queue: Queue) -> None:
        """Agree with one namespace on what this worker holds there."""
        held = await self._redis(queue.held, self.id)
        for gid, run in list(self._running.items()):
            if run.queue is queue and held.get(gid) != run.token and not run.publishing:
                log.warning("group %s: worker %s no longer holds it in Redis (claim %s); cancelling its task",
                            gid, self.id, run.token)
                run.task.cancel()
        stray = {gid: token for gid, token in held.items()
                 if (run := self._running.get(gid)) is None or run.token != token}
        if stray:
            n = await self._redis(queue.hand_back, self.id, stray)
            self.counters.handed_back += n
            log.warning("worker %s: %d groups held in Redis with no task here (a lost claim reply, or a task "
                        "that failed to publish) went back to the prompt list: %s", self.id, n,
                        ", ".join(list(stray)[:5]))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self._heartbeat()
                await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("worker %s: heartbeat failed: %s", self.id, exc)

    async def _maintenance_loop(self) -> None:
        """Reap dead workers and release aborted groups while admission is open, so
        nothing waits on one process being alive; watch the engines."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._redis(self._upkeep)
                await self._check_engines()
                if time.monotonic() - self._last_discovery >= REDISCOVER_S or self._engine_down is not None:
                    self._last_discovery = time.monotonic()
                    await self._discover_engines()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("worker %s: maintenance failed: %s", self.id, exc)

    def _upkeep(self) -> None:
        depths = self.queue.depths()
        metrics.sample_namespace(depths, self.queue.stats() if self.settings.metrics_port else {})
        now = time.monotonic()
        reap = now - self._last_reap >= self.lease_s / 4
        orphans = now - self._last_orphan_reap >= 10 * self.lease_s
        if reap:
            self._last_reap = now
        if orphans:
            self._last_orphan_reap = now
        control = None  # the training namespace's: its pause (a weight update) holds eval groups back too
        for queue in self.queues:
            if reap:
                queue.reap_expired()
            if orphans:
                queue.reap_orphans()
            requeued = depths["requeue"] if queue is self.queue else queue.redis.xlen(queue.keys.requeue)
            if requeued:
                control = control or read_control(self.queue.redis, self.queue.keys)
                if not control.paused:
                    queue.release(control.release_policy)


def reward_args(settings: WorkerSettings) -> SimpleNamespace:
    """The `args` a reward gets: the worker's settings, also under slime's names (a slime
    reward reads args.rm_type, args.rm_url, args.rollout_max_response_len, ...)."""
    sp = settings.sampling
    return SimpleNamespace(
        rm_url=settings.rm_url, reward_key=settings.reward_key, rm_type=settings.rm_type,
        group_rm=settings.group_reward, custom_rm_path=None if settings.reward in BUILTIN_REWARDS else settings.reward,
        rollout_temperature=sp.temperature, rollout_top_p=sp.top_p, rollout_top_k=sp.top_k,
        rollout_max_response_len=sp.max_new_tokens, rollout_stop=sp.stop or None,
        rollout_stop_token_ids=sp.stop_token_ids or None, **asdict(sp))


def offpolicy_mask(weight_versions: list[str], segment_lengths: list[int]) -> list[int]:
    """loss_mask 0 for tokens from engine calls whose weight version is not the one that
    finished the sample (slime's --mask-offpolicy-in-partial-rollout)."""
    final = weight_versions[-1]
    mask: list[int] = []
    for version, n in zip(weight_versions, segment_lengths):
        mask += [1 if version == final else 0] * n
    return mask


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
