"""Offload slow reward judges to rq workers.

`RQReward` has the same ``score(args, samples)`` interface as `workers.rewards.Reward`,
but instead of calling the function in the generation worker it enqueues one rq job
per group and awaits the result. The rq worker process loads the reward by path
(`score_group_job`), so judges with heavy dependencies (a verifier model, a
sandbox) live on their own hosts and scale independently.

No code from data (DESIGN.md invariant 8). A plain ``rq worker`` imports and calls
whatever function a job names, and `score_group_job` imports whatever reward path
the job carries: anyone who can write to Redis could run code there. So start the
workers with::

    rollout --redis-url redis://HOST:PORT reward-worker --allow math_boxed --allow my.pkg.judge

(`run_reward_worker`): they run only `score_group_job`, only with an allowlisted
reward path, and no job callbacks; any other job fails in rq's failed-job registry
with the reason, nothing of it imported.

No pickle anywhere: rq pickles job arguments and results by default, so both the
queue here and every rq worker use rq's ``JSONSerializer``. In rq >= 1.12 the
serializer given to the Queue is stored on the Job and used for the arguments (job
hash field ``data``, zlib-compressed JSON), ``meta``, and the return value (results
stream ``rq:results:<id>``, base64 of the serializer output). A worker left on the
pickle serializer fails to decode our jobs, loudly, instead of unpickling.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from redis import Redis, RedisError
from redis.cluster import RedisCluster
import rq
from rq import Queue, Worker
from rq.command import send_stop_job_command
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from pipeline.types import Sample
from workers.rewards import Reward, RewardError, RewardValue, load_reward, validate_reward

logger = logging.getLogger(__name__)

DEFAULT_QUEUE = "rollout-rewards"
#: The rq major version AllowlistedJob was checked against (pyproject pins it): a new major
#: can add job fields that run code or send requests (rq 3 added webhooks) it would let through.
RQ_CHECKED_MAJOR = 3

__all__ = ["DEFAULT_QUEUE", "AllowlistedJob", "JobRefused", "RQReward", "run_reward_worker",
           "score_group_job"]


# --------------------------------------------------------------------------- rq worker side


@functools.lru_cache(maxsize=64)
def _cached_reward(path: str, group: bool) -> Reward:
    return Reward.from_path(path, group=group)


def score_group_job(path: str, group: bool, args: dict[str, Any], samples: list[dict[str, Any]]) -> list[RewardValue]:
    """The rq job: score one group of plain sample dicts with the reward at `path`.

    Runs in the rq worker process; arguments and the return value travel as JSON.
    Exceptions propagate, so rq marks the job failed and stores the traceback text.
    """
    reward = _cached_reward(path, group)
    # each sample arrives as Sample.to_dict() JSON (the serializer is JSON, never pickle)
    return asyncio.run(reward.score(SimpleNamespace(**args), [Sample.from_dict(s) for s in samples]))


#: The only function a reward worker runs, as rq names it in a job.
SCORE_JOB = f"{__name__}.{score_group_job.__name__}"


class JobRefused(Exception):
    """A job a reward worker will not run; the message says why."""


def _same_path(path: str) -> str:
    return path.replace(":", ".")  # "pkg.mod:fn" and "pkg.mod.fn" name the same reward


class AllowlistedJob(Job):
    """A job that resolves to `score_group_job` with an allowlisted reward path, or
    raises JobRefused before anything it names is imported. Job callbacks (rq imports
    them by name too) never run, webhooks (rq 3: any URL, method and headers a job
    names) are never sent, refused jobs' included, and a job carrying either, or
    dependencies, is refused: RQReward sets none of them. Use `for_paths` to make the
    class for an allowlist."""

    allowed_paths: frozenset[str] = frozenset()

    @classmethod
    def for_paths(cls, paths: Sequence[str]) -> type[AllowlistedJob]:
        return type(cls.__name__, (cls,), {"allowed_paths": frozenset(_same_path(p) for p in paths)})

    def refusal(self) -> str | None:
        if self.func_name != SCORE_JOB:
            return f"this reward worker runs only {SCORE_JOB}, not {self.func_name!r}"
        if self.instance is not None:
            return "a job on an object instance is not a scoring job"
        callbacks = [n for n in (self._success_callback_name, self._failure_callback_name,
                                 self._stopped_callback_name) if n]
        if callbacks:
            return f"job callbacks are not run here ({', '.join(callbacks)})"
        webhooks = getattr(self, "webhooks", None)
        if webhooks:
            return f"job webhooks are not sent here ({len(webhooks)} given)"
        if self._dependency_ids:
            return f"a scoring job has no dependencies ({len(self._dependency_ids)} given)"
        if self.kwargs or len(self.args) != 4 or not isinstance(self.args[0], str):
            return "malformed scoring job: expected (path, group, args, samples)"
        if _same_path(self.args[0]) not in self.allowed_paths:
            return (f"reward {self.args[0]!r} is not allowlisted here (rollout reward-worker --allow): "
                    f"{', '.join(sorted(self.allowed_paths))}")
        return None

    @property
    def func(self):
        refusal = self.refusal()
        if refusal:
            raise JobRefused(f"refused job {self.id}: {refusal}")
        return score_group_job

    def send_webhooks(self, *args: Any, **kwargs: Any) -> None:
        """Never: a webhook is a request to a host the job names (refused jobs' too)."""

    @property
    def success_callback(self):
        return None

    @property
    def failure_callback(self):
        return None

    @property
    def stopped_callback(self):
        return None


def run_reward_worker(connection: Redis, allowed_paths: Sequence[str], queue_names: Sequence[str] = (DEFAULT_QUEUE,),
                      burst: bool = False) -> bool:
    """Run an rq worker (forking one process per job, as `rq worker` does) that scores
    groups with the allowlisted rewards only, until stopped (or, with `burst`, until
    its queues are empty). Returns whether it did any work."""
    if not allowed_paths:
        raise ValueError("a reward worker needs at least one allowed reward path")
    major = int(rq.__version__.split(".")[0])
    if major != RQ_CHECKED_MAJOR:
        raise ValueError(f"rq {rq.__version__} is installed, but the reward worker's job allowlist was checked "
                         f"against rq {RQ_CHECKED_MAJOR}.x only: install rq>={RQ_CHECKED_MAJOR},<{RQ_CHECKED_MAJOR + 1}")
    if isinstance(connection, RedisCluster):
        raise ValueError("a reward worker needs a plain Redis connection; rq does not support Redis Cluster")
    for path in allowed_paths:  # a path that does not load fails here, not on the first job
        load_reward(path)
    worker = Worker(list(queue_names), connection=connection, serializer=JSONSerializer,
                    job_class=AllowlistedJob.for_paths(allowed_paths))
    return worker.work(burst=burst)


# --------------------------------------------------------------------------- client side


def _plain_args(args: Any) -> dict[str, Any]:
    """The JSON-safe part of slime's args Namespace (it also holds objects that JSON
    cannot carry; those are dropped, and a reward that needs them must not be offloaded)."""
    if args is None:
        return {}
    items = vars(args).items() if hasattr(args, "__dict__") else dict(args).items()
    plain: dict[str, Any] = {}
    for key, value in items:
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            logger.debug("not sending args.%s (%s) to the rq reward worker: not JSON", key, type(value).__name__)
            continue
        plain[key] = value
    return plain


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no exception text"


@dataclass
class RQReward:
    """Score groups on rq workers: one job per group on `queue_name`.

    `timeout` bounds the wait for the result (queueing included) and is also rq's
    execution limit for the job (`job_timeout`, unless given). `delete_jobs` removes
    the job and its result from Redis once read (results are consumed exactly once).
    """

    path: str
    redis: Redis  # a sync client (rq is sync); decode_responses=False
    group: bool = False
    queue_name: str = DEFAULT_QUEUE
    timeout: float = 300.0
    job_timeout: int | None = None
    poll_interval: float = 0.02
    max_poll_interval: float = 0.5
    result_ttl: int = 600  # seconds a result lives if nobody reads it
    failure_ttl: int = 3600
    delete_jobs: bool = True
    queue: Queue = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.redis, RedisCluster):
            # rq's multi-key commands and registries assume one node
            raise ValueError("RQReward needs a plain Redis connection; rq does not support Redis Cluster")
        if self.redis.get_connection_kwargs().get("decode_responses"):
            # rq reads binary job data (zlib) and breaks on str responses
            raise ValueError("RQReward needs a Redis connection with decode_responses=False")
        self.queue = Queue(self.queue_name, connection=self.redis, serializer=JSONSerializer)
        self.name = f"rq:{self.queue_name}:{self.path}"

    async def score(self, args: Any, samples: Sequence[Sample]) -> list[RewardValue]:
        """Enqueue one job for the group and wait for its rewards. Raises RewardError."""
        samples = list(samples)
        if not samples:
            return []
        payload = [s.to_dict() for s in samples]
        job_timeout = self.job_timeout or max(1, int(self.timeout))
        description = f"reward {self.path} for group_index={samples[0].group_index}"

        def enqueue() -> Job:
            return self.queue.enqueue(
                score_group_job,
                self.path,
                self.group,
                _plain_args(args),
                payload,
                job_timeout=job_timeout,
                result_ttl=self.result_ttl,
                failure_ttl=self.failure_ttl,
                description=description,
            )

        # rq and the sync redis client block: keep the event loop free
        try:
            job = await self._enqueue_cancellable(enqueue)
        except RedisError as exc:
            raise RewardError(f"reward queue {self.queue_name!r}: cannot enqueue: {type(exc).__name__}: {exc}") from exc
        logger.debug("enqueued reward job %s (%s, %d samples)", job.id, self.path, len(samples))
        try:
            values = await self._wait(job)
        except BaseException as exc:
            # timeout, failure or cancellation of the caller (e.g. an aborted group)
            await asyncio.to_thread(self._abandon, job)
            if isinstance(exc, RedisError):
                raise RewardError(f"reward job {job.id} ({self.path}): lost Redis: {type(exc).__name__}: {exc}") from exc
            raise
        if self.delete_jobs:
            await asyncio.to_thread(self._delete, job)

        if not isinstance(values, list) or len(values) != len(samples):
            raise RewardError(f"reward job {job.id} ({self.path}) returned {values!r:.200}; expected {len(samples)} values")
        reward_key = getattr(args, "reward_key", None)
        return [validate_reward(v, reward_key, name=self.path) for v in values]

    async def _enqueue_cancellable(self, enqueue: Callable[[], Job]) -> Job:
        """Run `enqueue` in a thread. A thread cannot be interrupted, so if the caller
        is cancelled meanwhile, whichever side learns of the job last withdraws it
        (otherwise an orphan job would be scored for nobody)."""
        lock = threading.Lock()
        cancelled = False
        enqueued: Job | None = None

        def run() -> Job:
            nonlocal enqueued
            job = enqueue()
            with lock:
                if not cancelled:
                    enqueued = job
                    return job
            self._abandon(job)  # the caller is gone already
            return job

        try:
            return await asyncio.to_thread(run)
        except asyncio.CancelledError:
            with lock:
                cancelled = True
                job = enqueued
            if job is not None:  # enqueued, but we were cancelled before resuming
                await asyncio.to_thread(self._abandon, job)
            raise

    async def _wait(self, job: Job) -> Any:
        deadline = time.monotonic() + self.timeout
        interval = self.poll_interval
        while True:
            status = await asyncio.to_thread(self._status, job)
            if status == JobStatus.FINISHED:
                result = await asyncio.to_thread(Result.fetch_latest, job, JSONSerializer)
                if result is None or result.type != Result.Type.SUCCESSFUL:
                    raise RewardError(f"reward job {job.id} ({self.path}) finished but its result is missing")
                return result.return_value
            if status == JobStatus.FAILED:
                result = await asyncio.to_thread(Result.fetch_latest, job, JSONSerializer)
                text = result.exc_string if result is not None else None
                if text:
                    logger.warning("reward job %s (%s) failed:\n%s", job.id, self.path, text)
                hint = ""
                if text and "DeserializationError" in text:
                    hint = " (the rq worker could not decode the job: start it with `rollout reward-worker`)"
                raise RewardError(f"reward job {job.id} ({self.path}) failed: {_last_line(text)}{hint}")
            if status in (JobStatus.STOPPED, JobStatus.CANCELED, None):
                raise RewardError(f"reward job {job.id} ({self.path}) ended without a result (status={status})")
            if time.monotonic() >= deadline:
                raise RewardError(
                    f"reward job {job.id} ({self.path}) timed out after {self.timeout:g}s "
                    f"(status={status.value}; is `rollout reward-worker --allow {self.path}` running "
                    f"on queue {self.queue_name!r}?)"
                )
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(interval * 1.5, self.max_poll_interval)

    @staticmethod
    def _status(job: Job) -> JobStatus | None:
        try:
            return job.get_status(refresh=True)
        except NoSuchJobError:  # expired or deleted
            return None

    def _abandon(self, job: Job) -> None:
        """Best effort: do not leave an unwanted job running or queued."""
        try:
            status = self._status(job)
            if status in (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED):
                job.cancel()
            elif status == JobStatus.STARTED:
                send_stop_job_command(self.redis, job.id, serializer=JSONSerializer)
            if self.delete_jobs and status not in (JobStatus.STARTED, None):
                job.delete()
        except Exception:  # noqa: BLE001 - cleanup must not mask the real error
            logger.warning("could not clean up reward job %s", job.id, exc_info=True)

    def _delete(self, job: Job) -> None:
        try:
            job.delete()
        except Exception:  # noqa: BLE001
            logger.warning("could not delete reward job %s", job.id, exc_info=True)
