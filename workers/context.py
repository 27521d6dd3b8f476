"""What the worker's collaborators share: its id, Redis access, counters, and what Redis last said about admission."""
from __future__ import annotations

import asyncio
import logging
import queue as threadqueue
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.queue import Queue
from pipeline.retry import Reconnect
from pipeline.types import VersionClock

from .settings import WorkerSettings

log = logging.getLogger("workers.worker")


@dataclass(frozen=True)
class Halt:
    """Why a worker stopped on its own: its configuration, not a group, is at fault."""

    state: str  # the state it shows until it exits ("permission-denied", "reward-hung")
    reason: str
    remedy: str  # what the operator does about it


@dataclass
class WorkerCounters:
    groups_claimed: int = 0
    groups_completed: int = 0
    samples_completed: int = 0  # samples of the groups published to the results
    groups_requeued: int = 0
    groups_dead: int = 0
    groups_lost: int = 0  # publish refused: reaped or handed back while we worked on them
    handed_back: int = 0  # held in Redis with no task here, given back by reconciliation
    cancelled: int = 0  # tasks cancelled because Redis no longer gave us their group
    reincarnations: int = 0  # times this process was reaped and registered anew
    requests: int = 0
    engine_errors: int = 0
    preempted: int = 0  # aborts by a pause, a weight update or an abort_all: continued, not failures
    drained: int = 0  # aborts by a rolling weight update: continued at once on another engine
    reward_errors: int = 0
    function_calls: int = 0  # calls of the user's generate function
    function_errors: int = 0  # of which raised, hung or returned no usable sample
    restarted: int = 0  # samples a weight update aborted mid-call, started again from their prompt (no --partial-rollout)
    versions_ahead: int = 0  # engine answers with a weight version newer than the queue's
    # In-flight checkpoints (pipeline/checkpoints.py; `rollout status` sums them over the workers).
    checkpoints_written: int = 0  # group checkpoints Redis accepted from this worker
    checkpoint_tokens_resumed: int = 0  # tokens a claimed group's checkpoint gave back instead of generating them
    checkpoint_tokens_lost: int = 0  # tokens generated and then not kept (a checkpoint too stale to resume)


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


class WorkerContext:
    """The state more than one of the worker's collaborators reads or writes. Each
    collaborator keeps the rest of its state to itself."""

    def __init__(self, settings: WorkerSettings, queue: Queue, eval_queue: Queue | None, worker_id: str):
        self.settings = settings
        self.id = worker_id  # changes when the worker registers anew (Liveness.reincarnate)
        self.queue = queue
        # Eval passes go through a companion namespace with books of their own: claimed
        # first whenever it has prompts, so evaluation never waits behind training.
        self.eval_queue = eval_queue
        self.queues = [queue] + ([eval_queue] if eval_queue else [])
        self.counters = WorkerCounters()
        self.reconnect = Reconnect(f"worker {self.id}")
        self.lease_s = 0.0  # the namespace's, learned at registration and with every heartbeat
        self.capacity = settings.concurrency_per_engine * len(settings.engine_urls)  # in samples
        self.paused = False  # admission paused (a weight update is under way)
        self.queue_version = 0  # the trainer's weight version, as the last claim or heartbeat said
        # On the queue clock (slime) the engines number versions their own way: no warnings.
        self.version_clock = VersionClock.ENGINE
        self.wake = asyncio.Event()  # wakes the claim loop: a slot freed, control changed
        self.stopping = asyncio.Event()
        self.claim_lock = asyncio.Lock()  # a claim and its tasks' start, vs reconciliation
        self.redis_pool = DaemonPool(6, "redis")  # one of them waits on control events
        self.halted: Halt | None = None  # the first configuration error that stopped it

    def refused(self, exc: Exception) -> None:
        """Redis refused a command under this worker's ACL."""
        self.halt(Halt("permission-denied", str(exc), "grant the Redis user that command (`rollout acl --role "
                                                       "worker` prints a user with everything a worker needs)"))

    def halt(self, halt: Halt) -> None:
        """A configuration error, not a group's fault: stop claiming and stop (shutdown
        hands back what is held) rather than run every group only to dead-letter it."""
        if self.halted is None:
            self.halted = halt
            log.error("worker %s: %s; this is a configuration error: it stops claiming and hands back the groups "
                      "it holds; %s", self.id, halt.reason, halt.remedy)
        self.stopping.set()
        self.wake.set()

    async def redis(self, fn: Callable, *args: Any, deadline: float | None = None) -> Any:
        """A Redis call on the Redis pool, retried through outages."""
        return await self.reconnect.acall(self.redis_pool, fn, *args, deadline=deadline)
