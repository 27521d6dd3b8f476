"""What every fault of a fault campaign (`rollout chaos`) shares: the kinds, what a fault
sees of the campaign, the state machine each fault is, and the reservations that keep two
faults off one resource (the data nodes, the trainer).

Each fault runs as a small state machine driven by the campaign's loop: `begin()`
injects it (False: not possible right now, e.g. another trainer fault is under way; the
loop asks again), `step()` says whether it is over, `lift()` ends a window early (the
drain). Each fills its FaultRecord: when it was injected and over, what it hit, and any
problem (a fault whose promise did not hold fails the campaign). The faults themselves:
chaos/faults.py (processes, links, engines) and chaos/redis_faults.py (the data nodes).
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from pipeline.queue import Queue

from .fleet import Fleet, FleetSettings
from .ledger import Record
from .report import FaultRecord

T = TypeVar("T")

log = logging.getLogger(__name__)


class Campaign(Protocol):
    """What a fault sees of the campaign that drives it (chaos/campaign.py): the fleet, the
    ledger, and the one trainer fault and one engine window allowed at a time."""

    settings: FleetSettings
    fleet: Fleet
    rng: random.Random
    committed_batch_ids: set[str]
    records: list[Record]  # the ledger read so far
    fenced_pids: set[int]
    trainer_fault: Fault | None
    engine_fault: Fault | None

    @property
    def queue(self) -> Queue: ...
    def call(self, fn: Callable[..., T], *args) -> T: ...
    def worker_ids(self) -> dict[int, str]: ...
    def read_ledger(self) -> None: ...
    def last_batch(self, pid: int, after: float) -> Record | None: ...

#: How long a link or engine fault window lasts.
WINDOW_S = 3.0
#: A stopped worker that has not re-registered this long after SIGCONT is a failure.
REREGISTER_S = 30.0
#: A trainer fault that found no batch to interrupt, or an older trainer still running,
#: this long after it began is given up.
TRAINER_WAIT_S = 60.0


class FaultKind(StrEnum):
    WORKER_KILL = "worker_kill"  # kill -9 of a generation worker; a new one replaces it
    WORKER_STOP = "worker_stop"  # SIGSTOP past its lease, then SIGCONT
    TRAINER_KILL = "trainer_kill"  # kill -9 of the trainer between next_batch and commit
    TRAINER_ROLLING = "trainer_rolling"  # a second trainer while the first runs
    SIM_KILL = "sim_kill"  # kill -9 of a simulator, restarted on its port
    REDIS_KILL = "redis_kill"  # kill -9 of the primary, restarted from its AOF (no failover)
    LONG_OUTAGE = "long_outage"  # every data node down for 1.5-3 leases, then restarted from their AOFs
    FAILOVER = "failover"  # kill -9 of the primary: Sentinel promotes the replica (every other one lagging)
    AUDIT_LOAD = "audit_load"  # a large namespace on the same server audited while the pipeline runs
    REDIS_DROP_REPLY = "redis_drop_reply"  # worker <-> Redis: requests done, replies lost
    REDIS_RESET = "redis_reset"  # worker <-> Redis: connections reset
    REDIS_LATENCY = "redis_latency"  # worker <-> Redis: every chunk delayed
    ROUTER_DROP_REPLY = "router_drop_reply"  # worker <-> router: the same for HTTP
    ROUTER_RESET = "router_reset"
    ROUTER_LATENCY = "router_latency"
    ENGINE_5XX = "engine_5xx"  # every engine answers /generate with 500/503
    ENGINE_HANG = "engine_hang"  # engines never answer some /generate (past the request timeout)
    EVICTION = "eviction"  # the primary's maxmemory-policy turned to allkeys-lru, every connection cut
    CLOCK_STEP = "clock_step"  # the server's clock steps back a minute, then forward a second
    FENCED_TRAINER = "fenced_trainer"  # a second trainer; the first keeps running its update loop
    ABORT_STORM = "abort_storm"  # every engine aborts every request after a few tokens


def _http(url: str, body: dict | None = None, timeout: float = 2.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


class Fault:
    kind: FaultKind

    def __init__(self, record: FaultRecord):
        self.record = record

    def begin(self, c: Campaign) -> bool:
        raise NotImplementedError

    def step(self, c: Campaign) -> bool:
        return True

    def lift(self, c: Campaign) -> None:
        """End the fault now (the campaign is draining)."""


class WindowFault(Fault):
    """A fault that holds for WINDOW_S: `_open` starts it (False: not now), `lift` ends it."""

    def _open(self, c: Campaign) -> bool:
        raise NotImplementedError

    def begin(self, c: Campaign) -> bool:
        if not self._open(c):
            return False
        self.record.started = time.time()
        self.until = self.record.started + WINDOW_S
        return True

    def step(self, c: Campaign) -> bool:
        if time.time() < self.until:
            return False
        self.lift(c)
        return True


class ThreadFault(Fault):
    """A fault whose work runs on a thread of its own, so the campaign's loop goes on (its
    own Redis calls waiting out what the fault does): `_start(work)`; over when the work
    returned; `_finish()` then fills the record. What the work raises is the problem."""

    def _start(self, work: Callable[[], None]) -> None:
        self.error = ""

        def run() -> None:
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - the fault's problem, reported by step()
                log.exception("%s", self.record.kind)
                self.error = f"{type(exc).__name__}: {exc}"

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def step(self, c: Campaign) -> bool:
        if self.thread.is_alive():
            return False
        self.record.problem = self.record.problem or self.error
        self._finish(c)
        return True

    def _finish(self, c: Campaign) -> None:
        """The record, once the work is over."""

    def lift(self, c: Campaign) -> None:
        self.thread.join()


def _take_redis(c: Campaign) -> bool:
    """Reserve the data nodes for one fault that kills them or moves the primary."""
    if c.fleet.redis_busy:
        return False
    c.fleet.redis_busy = True
    return True


def _release_redis(c: Campaign) -> None:
    c.fleet.redis_busy = False
    c.fleet.redis_fault_ended = time.time()


