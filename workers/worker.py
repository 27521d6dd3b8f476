"""The stateless generation worker.

One asyncio process keeps a fixed pool of samples in flight: capacity is counted in
samples (`concurrency_per_engine` × engines, like slime's sglang_server_concurrency),
and a group of n samples takes n slots. Everything it holds is also in Redis (its
in-flight set and the stored payloads), so `kill -9` loses nothing: the reaper gives
its groups back after the lease.

Per group: tokenize, call /generate for every unfinished sample (continuing aborted
ones from their partial tokens), then either requeue (some sample was aborted by a
pause), score with the reward and publish to results, or dead-letter (engine or
reward failures past the attempt limit; bad requests at once).
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import random
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

from pipeline import metrics
from pipeline.connection import connect
from pipeline.control import read_control
from pipeline.queue import DEFAULT_LEASE_S, Place, Queue
from pipeline.types import Group, Sample, Status

from .engine import EngineRequestError, EngineSet, EngineUnavailable, GenerateResult
from .rewards import Reward, RewardError
from .tokenizer import encode_prompt, load_tokenizer

log = logging.getLogger(__name__)

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
SEGMENTS_KEY = "rollout_segments"  # sample.metadata: tokens produced by each engine call


@dataclass
class SamplingSettings:
    """slime's rollout_* arguments, sent as SGLang sampling_params."""

    max_new_tokens: int = 1024  # rollout_max_response_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def params(self, max_new_tokens: int) -> dict[str, Any]:
        p: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            # As slime: keep stop tokens in the output so tokens and text line up.
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        if self.stop:
            p["stop"] = self.stop
        if self.stop_token_ids:
            p["stop_token_ids"] = self.stop_token_ids
        return p


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
    reward_queue: str | None = None  # rq queue name: score in rq workers instead of here
    max_attempts: int = 3  # engine or reward failures per group before dead-lettering
    backoff_s: float = 0.5  # first retry delay; doubles up to backoff_max_s
    backoff_max_s: float = 30.0
    engine_down_after: int = 5  # consecutive engine failures that stop claiming
    request_timeout_s: float = 600.0
    lease_s: float = DEFAULT_LEASE_S
    heartbeat_s: float = 2.0
    mask_offpolicy_prefix: bool = False  # slime's --mask-offpolicy-in-partial-rollout
    metrics_port: int | None = None  # serve Prometheus metrics here
    metrics_host: str = metrics.DEFAULT_HOST  # the address metrics_port listens on
    keep_response_text: bool = False  # include response texts in results (tokens are always there)
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")


@dataclass
class WorkerCounters:
    groups_completed: int = 0
    groups_requeued: int = 0
    groups_dead: int = 0
    groups_lost: int = 0  # reaped while we worked on them
    requests: int = 0
    engine_errors: int = 0
    reward_errors: int = 0


class GroupFailed(Exception):
    """A group cannot be finished; it goes to dead letters with this message."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason  # short category for metrics: engine, bad_request, reward, input


class Worker:
    def __init__(self, settings: WorkerSettings, reward: Reward | Any | None = None):
        self.settings = settings
        self.id = settings.worker_id
        self.queue = Queue(connect(settings.redis_url), settings.namespace, lease_s=settings.lease_s)
        self.engines = EngineSet(settings.engine_urls, timeout_s=settings.request_timeout_s)
        self.tokenizer = load_tokenizer(settings.tokenizer)
        self.reward = reward or self._load_reward()
        self.reward_args = SimpleNamespace(rm_url=settings.rm_url, reward_key=settings.reward_key,
                                           **asdict(settings.sampling))
        self.counters = WorkerCounters()
        self.state = "starting"  # running, paused, backlog, budget, idle, engine-down: ..., stopping
        self.capacity = settings.concurrency_per_engine * len(settings.engine_urls)
        self.inflight_samples = 0
        self._tasks: dict[str, asyncio.Task] = {}  # group id -> its task
        self._slots: dict[str, int] = {}  # group id -> sample slots it holds
        self._consecutive_engine_failures = 0
        self._engine_down_since: float | None = None
        # Samples per group, to size claims; unknown until the first claim, so that one
        # takes a single group (slime over-prefetched n-fold by guessing 1).
        self._group_size = self.capacity
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._last_reap = 0.0
        self._paused = False  # admission paused (a weight update is under way)
        self._engine_back = asyncio.Event()  # set while engines are considered healthy
        self._engine_back.set()

    def _load_reward(self):
        s = self.settings
        if s.reward_queue:
            from .reward_queue import RQReward

            return RQReward(redis=self.queue.redis, path=s.reward, group=s.group_reward, queue_name=s.reward_queue)
        return Reward.from_path(s.reward, group=s.group_reward)

    # -- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        """Work until stop() is called; then hand back whatever is unfinished."""
        try:
            await self.engines.refresh()
            engines = self.engines.engines
            self.capacity = self.settings.concurrency_per_engine * max(1, len(engines))
        except Exception as exc:  # keep going: generation goes through the given URLs
            log.warning("engine discovery failed (%s); using %s as given", exc, self.settings.engine_urls)
        if self.settings.metrics_port:
            metrics.serve_metrics(self.settings.metrics_port, self.settings.metrics_host)
        log.info("worker %s: capacity %d samples, engines %s, namespace %s", self.id, self.capacity,
                 self.engines.engines or self.settings.engine_urls, self.settings.namespace)
        await self._heartbeat()
        background = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._maintenance_loop()),
                      asyncio.create_task(self._listen_for_control())]
        try:
            await self._claim_loop()
        finally:
            for t in background:
                t.cancel()
            await self._shutdown()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def _shutdown(self) -> None:
        self.state = "stopping"
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        returned = await asyncio.to_thread(self.queue.leave, self.id)
        log.info("worker %s stopped; %d unfinished groups back to the prompt list", self.id, returned)
        await self.engines.close()

    # -- claiming --------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        idle_wait = 0.01
        while not self._stopping.is_set():
            if self._engine_down_since is not None:
                await self._sleep(1.0)
                continue
            free = self.capacity - self.inflight_samples
            if free < self._group_size:
                await self._sleep(1.0)  # woken when a group finishes
                continue
            claim = await asyncio.to_thread(self.queue.claim, self.id, max(1, free // self._group_size))
            self._paused = claim.status == "paused"
            if self._stopping.is_set():
                break  # what this claim took goes back with leave() in _shutdown
            for claimed in claim.groups:
                if claimed.group is not None:
                    self._start(claimed.group)
            if claim.groups:
                self.state, idle_wait = "running", 0.01
                continue
            self.state = {"empty": "idle"}.get(claim.status, claim.status)
            # Control changes arrive as events (pub/sub) and wake us; this wait is the
            # fallback, short at first so a trickle of prompts is picked up quickly.
            await self._sleep(idle_wait)
            idle_wait = min(idle_wait * 2, 0.1)

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _start(self, group: Group) -> None:
        group.worker = self.id
        group.claimed_at = time.time()
        self._group_size = max(1, group.n_samples)
        # A slot per sample to generate, given back as each request finishes: a group
        # waiting on its slowest sample holds one slot, not n (the engine sees the rest free).
        slots = max(1, sum(s.status in (Status.PENDING, Status.ABORTED) for s in group.samples))
        self._slots[group.group_id] = slots
        self.inflight_samples += slots
        task = asyncio.create_task(self._process(group))
        self._tasks[group.group_id] = task
        # A done callback, not a finally: it also runs for a task cancelled before it started.
        task.add_done_callback(lambda _t, gid=group.group_id: self._finished(gid))

    def _finished(self, group_id: str) -> None:
        self.inflight_samples -= self._slots.pop(group_id, 0)
        self._tasks.pop(group_id, None)
        self._wake.set()

    # -- one group -------------------------------------------------------------------

    async def _process(self, group: Group) -> None:
        gid = group.group_id
        try:
            place, error = await self._generate_group(group)
            group.finished_at = time.time()
            group.error = error
            entry = await asyncio.to_thread(self.queue.publish_group, self.id, group, place, error,
                                            self.settings.keep_response_text)
            metrics.GROUPS_PUBLISHED.labels(place if entry else "lost").inc()
            if entry is None:
                self.counters.groups_lost += 1
            elif place == Place.RESULTS:
                self.counters.groups_completed += 1
            elif place == Place.REQUEUE:
                self.counters.groups_requeued += 1
                log.info("group %s: aborted mid-generation; partial output requeued", gid)
            else:
                self.counters.groups_dead += 1
                log.error("group %s: dead-lettered: %s", gid, error)
        except Exception as exc:  # one bad group must never take the worker down
            log.exception("group %s: unexpected error; dead-lettering it", gid)
            metrics.DEAD_LETTERS.labels("worker_error").inc()
            await asyncio.to_thread(self.queue.publish_group, self.id, group, Place.DEAD,
                                    f"worker error: {type(exc).__name__}: {exc}")
            self.counters.groups_dead += 1

    async def _generate_group(self, group: Group) -> tuple[str, str | None]:
        """Returns where the group goes and, for dead letters, why."""
        try:
            if not group.prompt_ids:
                group.prompt_ids = encode_prompt(self.tokenizer, group.samples[0].prompt,
                                                 self.settings.apply_chat_template)
            if not group.samples:
                raise GroupFailed("group has no samples", "input")
            await asyncio.gather(*(self._generate_sample_in_slot(group, s) for s in group.samples
                                   if s.status in (Status.PENDING, Status.ABORTED)))
            if any(s.status == Status.ABORTED for s in group.samples):
                return Place.REQUEUE, None
            await self._score(group)
            return Place.RESULTS, None
        except GroupFailed as exc:
            metrics.DEAD_LETTERS.labels(exc.reason).inc()
            return Place.DEAD, str(exc)
        except ValueError as exc:  # the tokenizer refused the prompt
            metrics.DEAD_LETTERS.labels("input").inc()
            return Place.DEAD, f"bad prompt: {exc}"

    async def _generate_sample_in_slot(self, group: Group, sample: Sample) -> None:
        try:
            await self._generate_sample(group, sample)
        finally:
            if self._slots.get(group.group_id, 0) > 1:  # the group's last slot goes with the group
                self._slots[group.group_id] -= 1
                self.inflight_samples -= 1
                self._wake.set()

    async def _generate_sample(self, group: Group, sample: Sample) -> None:
        s = self.settings
        if not sample.tokens:
            sample.tokens = list(group.prompt_ids)
        remaining = s.sampling.max_new_tokens - sample.response_length
        if remaining <= 0:
            sample.status = Status.TRUNCATED  # nothing left to generate: no request
            return
        rid = f"{group.group_id}/{sample.index}/{uuid.uuid4().hex[:8]}"
        failures = group.attempts  # carried over from earlier claims of this group
        while True:
            if self._paused:
                # A weight update is under way: a request sent now would wait at the
                # paused engine where an abort cannot reach it. Requeue the sample as
                # it is; it continues after the resume, under the new weights.
                sample.status = Status.ABORTED
                return
            try:
                self.counters.requests += 1
                started = time.monotonic()
                result = await self.engines.generate(sample.tokens, s.sampling.params(remaining), rid=rid)
                metrics.GENERATION_LATENCY.observe(time.monotonic() - started)
                metrics.OUTPUT_TOKENS.observe(len(result.output_ids))
                self._engine_ok()
                break
            except EngineRequestError as exc:
                metrics.ENGINE_ERRORS.labels("bad_request").inc()
                raise GroupFailed(f"engine rejected the request: {exc}", "bad_request") from None
            except EngineUnavailable as exc:
                self._engine_failed(exc)
                if self._engine_down_since is not None:
                    # The engine is down, not this group's fault: wait for it without
                    # spending the group's attempts, then try again.
                    await self._engine_back.wait()
                    continue
                # Attempts count per sample: the n samples of a group failing in the same
                # moment are one bad moment, not n. The group keeps its worst count.
                failures += 1
                group.attempts = max(group.attempts, failures)
                if failures >= s.max_attempts:
                    raise GroupFailed(f"engine failed {failures} times; last error: {exc}", "engine") from None
                delay = min(s.backoff_max_s, s.backoff_s * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)
                log.warning("group %s: engine error (%s); retry %d in %.1fs", group.group_id, exc,
                            failures, delay)
                await asyncio.sleep(delay)
        self._append(sample, result)

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
        sample.status = FINISH_STATUS[result.finish_type]
        if sample.status == Status.ABORTED:
            metrics.SAMPLES_ABORTED.inc()
        if previous_mask is not None:
            sample.loss_mask = previous_mask + [1] * n_new
        if self.settings.mask_offpolicy_prefix and sample.status != Status.ABORTED:
            sample.loss_mask = offpolicy_mask(sample.weight_versions, segments)

    async def _score(self, group: Group) -> None:
        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                rewards = await self.reward.score(self.reward_args, group.samples)
                for s, r in zip(group.samples, rewards):
                    s.reward = r
                return
            except RewardError as exc:
                self.counters.reward_errors += 1
                if attempt == self.settings.max_attempts:
                    raise GroupFailed(f"reward failed {attempt} times; last error: {exc}", "reward") from None
                log.warning("group %s: reward error (%s); retry %d", group.group_id, exc, attempt)
                await asyncio.sleep(min(self.settings.backoff_max_s, self.settings.backoff_s * 2 ** (attempt - 1)))

    # -- engine health ---------------------------------------------------------------

    def _engine_ok(self) -> None:
        self._consecutive_engine_failures = 0

    def _engine_failed(self, exc: EngineUnavailable) -> None:
        metrics.ENGINE_ERRORS.labels("unavailable" if exc.status is None else str(exc.status)).inc()
        self.counters.engine_errors += 1
        self._consecutive_engine_failures += 1
        if self._consecutive_engine_failures >= self.settings.engine_down_after and self._engine_down_since is None:
            self._engine_down_since = time.monotonic()
            self._engine_back.clear()
            self.state = f"engine-down: {exc}"
            log.error("worker %s: %d engine failures in a row (%s); stopped claiming until the engine is back",
                      self.id, self._consecutive_engine_failures, exc)

    async def _probe_engines(self) -> None:
        if self._engine_down_since is None:
            return
        healthy = await self.engines.health()
        if healthy and all(healthy.values()):
            down = time.monotonic() - self._engine_down_since
            log.warning("worker %s: engines healthy again after %.0fs; claiming again", self.id, down)
            self._engine_down_since = None
            self._consecutive_engine_failures = 0
            self.state = "running"
            self._engine_back.set()
            self._wake.set()

    # -- heartbeat and upkeep ----------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "engines": self.engines.engines or self.settings.engine_urls,
            "state": self.state,
            "capacity": self.capacity,
            "inflight_samples": self.inflight_samples,
            "inflight_groups": len(self._tasks),
            "counters": asdict(self.counters),
        }

    async def _listen_for_control(self) -> None:
        """Pause and resume are published on the events channel: wake the claim loop
        at once, so admission follows control changes within milliseconds."""
        loop = asyncio.get_running_loop()
        pubsub = self.queue.redis.pubsub(ignore_subscribe_messages=True)
        await asyncio.to_thread(pubsub.subscribe, self.queue.keys.events)
        try:
            while True:
                message = await asyncio.to_thread(pubsub.get_message, timeout=1.0)
                if message is None:
                    continue
                try:
                    paused = bool(json.loads(message["data"])["paused"])
                except (ValueError, KeyError, TypeError):
                    log.warning("worker %s: ignoring malformed control event %r", self.id, message["data"])
                    continue
                self._set_paused(paused)
                loop.call_soon_threadsafe(self._wake.set)
                await self._heartbeat()  # so status shows the new state at once
        finally:
            await asyncio.to_thread(pubsub.close)

    def _set_paused(self, paused: bool) -> None:
        if paused:
            self.state = "paused"
        elif self.state == "paused":
            self.state = "running"
        self._paused = paused

    async def _heartbeat(self) -> None:
        metrics.INFLIGHT_SAMPLES.set(self.inflight_samples)
        beat = await asyncio.to_thread(self.queue.heartbeat, self.id, json.dumps(self.info()))
        if beat.paused != self._paused:  # a missed event: the heartbeat carries the truth
            self._set_paused(beat.paused)
        if not beat.was_registered and self._tasks:
            # We were presumed dead and our groups went back to the queue; another
            # worker may have them now, and publish would refuse ours anyway.
            log.error("worker %s was reaped (heartbeat late); abandoning %d groups now owned by the queue",
                      self.id, len(self._tasks))
            for t in list(self._tasks.values()):
                t.cancel()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self._heartbeat()
                await self._probe_engines()
            except Exception as exc:  # Redis blips must not kill the worker
                log.warning("worker %s: heartbeat failed: %s", self.id, exc)

    async def _maintenance_loop(self) -> None:
        """Reap dead workers and release aborted groups while admission is open, so
        nothing waits on one process being alive."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await asyncio.to_thread(self._upkeep)
            except Exception as exc:
                log.warning("worker %s: maintenance failed: %s", self.id, exc)

    def _upkeep(self) -> None:
        depths = self.queue.depths()
        for place, depth in depths.items():
            metrics.QUEUE_DEPTH.labels(place).set(depth)
        if time.monotonic() - self._last_reap >= self.settings.lease_s / 4:
            self._last_reap = time.monotonic()
            self.queue.reap_expired()
        if depths["requeue"]:
            control = read_control(self.queue.redis, self.queue.keys)
            if not control.paused:
                self.queue.release(control.release_policy)


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
    await worker.run()
