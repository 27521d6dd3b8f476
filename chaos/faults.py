"""The faults of a fault campaign (`rollout chaos`), one class per kind.

Each fault runs as a small state machine driven by the campaign's loop: `begin()`
injects it (False: not possible right now, e.g. another trainer fault is under way; the
loop asks again), `step()` says whether it is over, `lift()` ends a window early (the
drain). Each fills its FaultRecord: when it was injected and over, what it hit, and any
problem (a fault whose promise did not hold fails the campaign).
"""
from __future__ import annotations

import json
import logging
import random
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from enum import StrEnum
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pipeline.connection import STARTUP_WAIT_S, ConnectionFailed, connect
from pipeline.keys import CONSUMER_GROUP
from pipeline.ops.admin import purge
from pipeline.ops.audit import audit
from pipeline.queue import Queue
from pipeline.retry import Reconnect
from pipeline.types import Group

from .fault_proxy import LinkFaults
from .fleet import Fleet, FleetSettings, Proc
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


def _pick_worker(c: Campaign) -> tuple[int, Proc, str] | None:
    """A running worker no other fault works on, with its registered id."""
    ids = c.worker_ids()
    slots = [(i, w) for i, w in enumerate(c.fleet.workers) if w.alive and not w.busy and w.pid in ids]
    if not slots:
        return None
    i, w = c.rng.choice(slots)
    return i, w, ids[w.pid]


class WorkerKill(Fault):
    kind = FaultKind.WORKER_KILL

    def begin(self, c: Campaign) -> bool:
        picked = _pick_worker(c)
        if picked is None:
            return False
        i, proc, wid = picked
        held = sorted(c.call(c.queue.held, wid))
        proc.kill()
        r = self.record
        r.started = r.ended = time.time()
        r.target, r.affected, r.groups = f"worker {wid}", len(held), held
        c.fleet.respawn_worker(i)
        return True


class WorkerStop(Fault):
    """SIGSTOP until the worker is reaped (its lease ran out and another process returned
    its groups), then SIGCONT: it must notice, publish none of the groups it lost (the
    claim tokens refuse them) and register anew. The publishes are checked at the end
    from the groups' histories (Campaign.check_stopped_worker)."""

    kind = FaultKind.WORKER_STOP
    refused = 0  # its publishes refused after SIGCONT (set by the campaign's check)

    def begin(self, c: Campaign) -> bool:
        picked = _pick_worker(c)
        if picked is None:
            return False
        _, self.proc, self.wid = picked
        held = sorted(c.call(c.queue.held, self.wid))
        self.proc.busy = True
        self.proc.signal(signal.SIGSTOP)
        self.proc.stopped = True
        r = self.record
        r.started = time.time()
        r.target, r.affected, r.groups = f"worker {self.wid}", len(held), held
        self.deadline = r.started + 5 * c.settings.lease_s
        return True

    def step(self, c: Campaign) -> bool:
        r, now = self.record, time.time()
        if self.proc.stopped:
            reaped = self.wid not in c.call(c.queue.workers)
            # A Redis fault meanwhile moves the reap on: after a restart or a failover
            # every worker gets a lease to renew first, and a failover can forget a reap;
            # so 5 leases count from the last such fault's end as well.
            later = c.fleet.redis_fault_ended + 5 * c.settings.lease_s
            if not reaped and (now < max(self.deadline, later) or c.fleet.redis_busy):
                return False
            if not reaped:
                r.problem = (f"worker {self.wid} was not reaped within {5 * c.settings.lease_s:g}s of SIGSTOP or of "
                             "the last Redis fault")
            self._continue()
            self.deadline = now + REREGISTER_S
            return False
        new_id = c.worker_ids().get(self.proc.pid)
        if new_id is not None and new_id != self.wid:
            r.note = f"re-registered as {new_id} {time.time() - r.ended:.1f}s after SIGCONT"
            self.proc.busy = False
            return True
        if not self.proc.alive or now > self.deadline:
            r.problem = r.problem or (f"worker {self.wid} did not register anew within {REREGISTER_S:g}s of SIGCONT"
                                      if self.proc.alive else f"worker {self.wid} died after SIGCONT")
            self.proc.busy = False
            return True
        return False

    def _continue(self) -> None:
        self.proc.signal(signal.SIGCONT)
        self.proc.stopped = False
        self.record.ended = time.time()

    def lift(self, c: Campaign) -> None:
        if self.proc.stopped:
            self._continue()
        self.proc.busy = False


def _take_trainer(c: Campaign, fault: Fault) -> Proc | None:
    """The running trainer, reserved for `fault`: one trainer fault at a time."""
    trainer = c.fleet.current_trainer
    if c.trainer_fault is not None or trainer is None or not trainer.alive:
        return None
    c.trainer_fault = fault
    return trainer


class TrainerKill(Fault):
    """Waits for the trainer's next batch in the ledger, then kill -9: between next_batch
    and commit (its step takes FleetSettings.step_s). A new trainer replaces it."""

    kind = FaultKind.TRAINER_KILL

    def begin(self, c: Campaign) -> bool:
        trainer = _take_trainer(c, self)
        if trainer is None:
            return False
        self.trainer, self.armed = trainer, time.time()
        trainer.busy = True
        return True

    def step(self, c: Campaign) -> bool:
        batch = c.last_batch(self.trainer.pid, after=self.armed)
        if batch is None:
            if self.trainer.alive and time.time() < self.armed + TRAINER_WAIT_S:
                return False
            self.record.problem = f"no batch to interrupt within {TRAINER_WAIT_S:g}s"
            return self._done(c)
        self.trainer.kill()
        r = self.record
        r.started = r.ended = time.time()
        r.target = f"trainer pid {self.trainer.pid}, batch {batch.fields['batch']}"
        r.groups = list(batch.fields["groups"])
        r.affected = len(r.groups)
        c.read_ledger()
        if batch.fields["batch"] in c.committed_batch_ids:
            r.note = "the kill landed after the commit"
        c.fleet.spawn_trainer()
        return self._done(c)

    def _done(self, c: Campaign) -> bool:
        self.trainer.busy = False
        c.trainer_fault = None
        return True

    def lift(self, c: Campaign) -> None:
        self._done(c)


class TrainerRolling(Fault):
    """A second trainer while the first runs: the newer session fences the older, which
    must exit by itself, cleanly (`fenced` in the ledger, exit code 0)."""

    kind = FaultKind.TRAINER_ROLLING

    def begin(self, c: Campaign) -> bool:
        old = _take_trainer(c, self)
        if old is None:
            return False
        if c.last_batch(old.pid, after=0) is None:
            # Its session may not have started yet (a trainer just replaced, waiting out an
            # outage): the newer one could start first and fence it, the other way round.
            c.trainer_fault = None
            return False
        self.old = old
        self.new = new = c.fleet.spawn_trainer()
        r = self.record
        r.started = time.time()
        r.target = f"trainer pid {old.pid} replaced by pid {new.pid}"
        return True

    def step(self, c: Campaign) -> bool:
        r = self.record
        if self.old.alive:
            if time.time() < r.started + TRAINER_WAIT_S:
                return False
            r.problem = f"the older trainer (pid {self.old.pid}) still ran {TRAINER_WAIT_S:g}s after a newer one started"
            self.old.busy = True
            self.old.kill()
        elif (self.old.popen.returncode != 0 or self.old.pid not in c.fenced_pids) and not self._read_fence(c):
            r.problem = (f"the older trainer (pid {self.old.pid}) exited with code {self.old.popen.returncode} "
                         f"{'after' if self.old.pid in c.fenced_pids else 'without'} recording that it was fenced")
        r.ended = time.time()
        # What the newer session took over from the older: its Consumer says so.
        taken = re.search(r"took over (\d+) entries", self.new.log_path.read_text(errors="replace"))
        r.affected = int(taken.group(1)) if taken else 0
        c.trainer_fault = None
        return True

    def _read_fence(self, c: Campaign) -> bool:
        """Whether the older trainer exited cleanly after recording its fence, reading the
        ledger again: it may have written the record after the campaign's last read."""
        c.read_ledger()
        return self.old.popen.returncode == 0 and self.old.pid in c.fenced_pids

    def lift(self, c: Campaign) -> None:
        c.trainer_fault = None


class SimKill(Fault):
    """kill -9 of one simulator and a new one on the same port; over when it answers."""

    kind = FaultKind.SIM_KILL

    def begin(self, c: Campaign) -> bool:
        self.i = c.rng.randrange(len(c.fleet.sims))
        sim = c.fleet.sims[self.i]
        if sim.busy or not sim.alive:
            return False
        url = c.fleet.sim_urls[self.i]
        try:
            load = _http(url + "/sim/stats")["load"]
            requests = int(load["num_running_reqs"]) + int(load["num_waiting_reqs"])
        except (OSError, ValueError, KeyError, TypeError):
            requests = 0
        sim.kill()
        r = self.record
        r.started = r.ended = time.time()
        r.target, r.affected, r.unit = url, requests, "requests"
        self.sim = c.fleet.respawn_sim(self.i)
        self.sim.busy = True
        return True

    def step(self, c: Campaign) -> bool:
        try:
            _http(c.fleet.sim_urls[self.i] + "/health", timeout=1)
        except (OSError, ValueError):
            if time.time() < self.record.started + 30:
                return False
            self.record.problem = f"simulator {c.fleet.sim_urls[self.i]} did not come back within 30s"
        self.sim.busy = False
        return True


def _take_redis(c: Campaign) -> bool:
    """Reserve the data nodes for one fault that kills them or moves the primary."""
    if c.fleet.redis_busy:
        return False
    c.fleet.redis_busy = True
    return True


def _release_redis(c: Campaign) -> None:
    c.fleet.redis_busy = False
    c.fleet.redis_fault_ended = time.time()


class RedisKill(Fault):
    """kill -9 of the primary, then the same server again from its AOF: back before
    Sentinel's down-after, so it stays the primary (no failover)."""

    kind = FaultKind.REDIS_KILL

    def begin(self, c: Campaign) -> bool:
        if not _take_redis(c):
            return False
        try:
            self._kill(c)
        finally:
            _release_redis(c)
        return True

    def _kill(self, c: Campaign) -> None:
        q, k = c.queue, c.queue.keys
        inflight = c.call(q.inflight_count)
        try:
            pending = int(c.call(q.redis.xpending, k.results, CONSUMER_GROUP)["pending"])
        except Exception:  # noqa: BLE001 - no consumer group yet: nothing delivered
            pending = 0
        # Writes Redis held back from its AOF past 2 s behind a slow fsync (see the README's
        # durability paragraph): 0 means every acknowledged write had reached the file.
        self.delayed_fsyncs = int(c.call(q.redis.info, "persistence").get("aof_delayed_fsync", 0))
        r = self.record
        r.started = r.ended = time.time()
        port, self.downtime_s = c.fleet.restart_redis()
        r.target = f"primary 127.0.0.1:{port} ({c.settings.fsync.value})"
        r.affected = inflight + pending
        r.note = f"answered again after {self.downtime_s:.2f}s; aof_delayed_fsync was {self.delayed_fsyncs}"
        if (now := c.fleet.redis.primary_port()) != port:
            r.problem = f"Sentinel failed over to 127.0.0.1:{now} during the restart (down-after too short)"


class LongOutage(Fault):
    """kill -9 of every data node, the same servers again from their AOFs 1.5-3 leases
    later (the primary first, then its replica): the server's clock ran on while nobody
    could renew, and no live worker may be reaped for it (issue 21, o8). Sentinel sees the
    primary down past its down-after but has no replica to promote. The restart runs on a
    thread of its own: the campaign's own calls wait Redis out meanwhile."""

    kind = FaultKind.LONG_OUTAGE

    def begin(self, c: Campaign) -> bool:
        if not _take_redis(c):
            return False
        inflight = c.call(c.queue.inflight_count)
        leases = c.rng.uniform(1.5, 3.0)
        self.down_s = leases * c.settings.lease_s
        r = self.record
        r.started = time.time()
        r.target = f"every data node, {self.down_s:.1f}s ({leases:.1f} leases)"
        r.affected, r.unit = inflight, "groups in flight"
        c.fleet.stop_redis()

        def back() -> None:
            time.sleep(self.down_s)
            try:
                c.fleet.start_redis()
            except Exception as exc:  # noqa: BLE001 - the fault's problem, reported by step()
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                _release_redis(c)

        self.error = ""
        self.restart = threading.Thread(target=back, daemon=True)
        self.restart.start()
        return True

    def step(self, c: Campaign) -> bool:
        if self.restart.is_alive():
            return False
        self.record.ended = time.time()
        self.record.problem = self.error
        return True

    def lift(self, c: Campaign) -> None:
        self.restart.join()


#: How long a lossy failover lets the primary acknowledge writes its replica does not apply.
LAG_S = 1.5


class Failover(Fault):
    """kill -9 of the primary; Sentinel promotes the replica (after its down-after), and
    the old primary is started again from its AOF as the new primary's replica, so the next
    failover has a replica too. Every other failover (`lossy`, the first one seeded) goes
    to a replica that missed the last writes: for LAG_S it stops applying the primary's
    writes (CLIENT PAUSE WRITE on it), which the primary goes on acknowledging, and drops
    them when the primary dies. Workers' publishes and claims, the feeder's pushes and
    heartbeats are lost with them; the trainer's deliveries and commits are not (they wait
    for the replica: Consumer(replicas=1)). Runs on a thread of its own; `ended` is the
    kill."""

    kind = FaultKind.FAILOVER
    lossy = False  # set by schedule()
    promoted_s = rejoined_s = 0.0

    def begin(self, c: Campaign) -> bool:
        if not _take_redis(c):
            return False
        d = c.fleet.redis
        old = d.primary_node()
        new = d.other(old)
        r = self.record
        r.started = time.time()
        r.unit = "bytes lost"  # of writes the promoted replica never had
        r.target = (f"primary 127.0.0.1:{old.port} -> 127.0.0.1:{new.port}"
                    + (f", which missed the last {LAG_S:g}s of writes" if self.lossy else ""))
        self.error = ""

        def run() -> None:
            try:
                if self.lossy:
                    d.pause_replication(new)
                    time.sleep(LAG_S)
                    r.affected = d.missed_bytes(old, new)
                r.ended = time.time()
                d.kill_primary()
                d.wait_promoted(new, timeout_s=60)
                self.promoted_s = time.time() - r.ended
                d.start_node(old)
                d.wait_synced(new, old, timeout_s=60)
                self.rejoined_s = time.time() - r.ended
            except Exception as exc:  # noqa: BLE001 - the fault's problem, reported by step()
                log.exception("failover")
                self.error = f"{type(exc).__name__}: {exc}"
                if self.lossy:  # never leave a node refusing writes behind
                    try:
                        d.resume_replication(new)
                    except Exception:  # noqa: BLE001 - down: a restart has no pause
                        pass
            finally:
                _release_redis(c)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return True

    def step(self, c: Campaign) -> bool:
        if self.thread.is_alive():
            return False
        r = self.record
        r.problem = self.error
        if not self.error:
            r.note = (f"promoted after {self.promoted_s:.1f}s; the old primary rejoined as its replica after "
                      f"{self.rejoined_s:.1f}s")
        return True

    def lift(self, c: Campaign) -> None:
        self.thread.join()


#: Queued groups of the namespace an `audit_load` fault audits (on the campaign's server).
AUDIT_LOAD_GROUPS = 50_000


class AuditLoad(Fault):
    """An operator audits a large namespace on the pipeline's server while it runs: the
    audit holds the server only in short steps, so no process sees BUSY (issue 21, o7).
    Filled and audited on a thread of its own, through Reconnect (a Redis fault may
    overlap); the namespace is deleted afterwards."""

    kind = FaultKind.AUDIT_LOAD

    def begin(self, c: Campaign) -> bool:
        r = self.record
        r.started = time.time()
        namespace = f"chaos-audit-{int(r.at_s)}"
        r.target, r.affected, r.unit = f"namespace {namespace}", AUDIT_LOAD_GROUPS, "groups queued"
        self.outcome: dict[str, Any] = {}

        def load() -> None:
            reconnect = Reconnect(f"audit load {namespace}")
            try:  # another fault may hold Redis down as this one starts
                client = connect(c.fleet.redis_url, socket_timeout=60, wait_s=STARTUP_WAIT_S)
            except ConnectionFailed as exc:
                self.outcome["error"] = str(exc)
                return
            try:
                q = reconnect.call(Queue, client, namespace)  # (asks the server which scripts it has)
                for start in range(0, AUDIT_LOAD_GROUPS, 5000):
                    groups = [Group.fresh(f"load:{i}", "What is 1 + 1?", 4, row=i)
                              for i in range(start, min(AUDIT_LOAD_GROUPS, start + 5000))]
                    reconnect.call(q.push_groups, groups)
                started = time.monotonic()
                report = reconnect.call(audit, q)
                self.outcome.update(ok=report.ok, summary=report.summary(), audit_s=time.monotonic() - started)
                reconnect.call(purge, client, namespace)
            except Exception as exc:  # noqa: BLE001 - the fault's problem, reported by step()
                self.outcome["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                client.close()

        self.thread = threading.Thread(target=load, daemon=True)
        self.thread.start()
        return True

    def step(self, c: Campaign) -> bool:
        if self.thread.is_alive():
            return False
        r = self.record
        r.ended = time.time()
        if "error" in self.outcome:
            r.problem = self.outcome["error"]
        elif not self.outcome.get("ok"):
            r.problem = f"the audit of the loaded namespace: {self.outcome.get('summary', 'did not run')}"
        else:
            r.note = f"audited in {self.outcome['audit_s']:.1f}s while the pipeline ran"
        return True

    def lift(self, c: Campaign) -> None:
        self.thread.join()


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


class LinkFault(WindowFault):
    """A window of faults on one proxied link (workers <-> Redis or router)."""

    def __init__(self, record: FaultRecord, kind: FaultKind, link: str, faults: LinkFaults, counter: str,
                 unit: str, reset_now: bool):
        super().__init__(record)
        self.kind, self.link, self.faults, self.counter = kind, link, faults, counter
        self.record.unit = unit
        self.reset_now = reset_now

    def _open(self, c: Campaign) -> bool:
        proxy = c.fleet.redis_proxy if self.link == "redis" else c.fleet.router_proxy
        if proxy.faults != LinkFaults():
            return False  # another window on this link
        self.proxy = proxy
        self.before = getattr(proxy.stats, self.counter)
        proxy.faults = self.faults
        if self.reset_now:
            c.fleet.proxies.reset_all(proxy)
        self.record.target = f"workers <-> {self.link} ({proxy.address})"
        return True

    def lift(self, c: Campaign) -> None:
        self.proxy.faults = LinkFaults()
        self.record.ended = time.time()
        self.record.affected = getattr(self.proxy.stats, self.counter) - self.before


class EngineFault(WindowFault):
    """A window in which every simulator answers some /generate with an error or never."""

    def __init__(self, record: FaultRecord, kind: FaultKind, knob: str, rate: float, counter: str):
        super().__init__(record)
        self.kind, self.knob, self.rate, self.counter = kind, knob, rate, counter
        self.record.unit = "requests"

    def _set(self, c: Campaign, rate: float) -> dict[str, int]:
        """Set the knob on every simulator; returns their counters."""
        counts = {}
        for url in c.fleet.sim_urls:
            try:
                _http(url + "/sim/faults", {self.knob: rate})
                counts[url] = int(_http(url + "/sim/stats")["stats"].get(self.counter, 0))
            except (OSError, ValueError, KeyError, TypeError) as exc:  # restarting: it comes back without faults
                log.info("simulator %s: %s not set (%s)", url, self.knob, exc)
        return counts

    def _open(self, c: Campaign) -> bool:
        if c.engine_fault is not None:
            return False
        c.engine_fault = self
        self.before = self._set(c, self.rate)
        self.record.target = f"{self.knob}={self.rate:g} on {len(self.before)} engines"
        return True

    def lift(self, c: Campaign) -> None:
        after = self._set(c, 0.0)
        # A simulator restarted meanwhile counts from zero again.
        self.record.affected = sum(n - b if n >= (b := self.before.get(u, 0)) else n for u, n in after.items())
        self.record.ended = time.time()
        c.engine_fault = None


#: Each link fault: the link, what goes wrong on it, the proxy counter that measures it and
#: its unit, and whether the open connections are reset first.
LINK_FAULTS = {
    FaultKind.REDIS_DROP_REPLY: ("redis", LinkFaults(drop_reply_rate=0.05), "replies_dropped", "replies dropped",
                                 False),
    FaultKind.REDIS_RESET: ("redis", LinkFaults(reset_rate=0.02), "resets", "connections reset", True),
    FaultKind.REDIS_LATENCY: ("redis", LinkFaults(latency_s=0.05), "chunks_delayed", "chunks delayed", False),
    FaultKind.ROUTER_DROP_REPLY: ("router", LinkFaults(drop_reply_rate=0.1), "replies_dropped", "replies dropped",
                                  False),
    FaultKind.ROUTER_RESET: ("router", LinkFaults(reset_rate=0.05), "resets", "connections reset", True),
    FaultKind.ROUTER_LATENCY: ("router", LinkFaults(latency_s=0.2), "chunks_delayed", "chunks delayed", False),
}
#: Each engine fault: the simulator's knob (POST /sim/faults), its rate, the counter in /sim/stats.
ENGINE_FAULTS = {
    FaultKind.ENGINE_5XX: ("error_rate", 1.0, "errors"),
    FaultKind.ENGINE_HANG: ("hang_rate", 0.3, "hangs"),
}
PROCESS_FAULTS = {FaultKind.WORKER_KILL: WorkerKill, FaultKind.WORKER_STOP: WorkerStop,
                  FaultKind.TRAINER_KILL: TrainerKill, FaultKind.TRAINER_ROLLING: TrainerRolling,
                  FaultKind.SIM_KILL: SimKill, FaultKind.REDIS_KILL: RedisKill,
                  FaultKind.LONG_OUTAGE: LongOutage, FaultKind.FAILOVER: Failover, FaultKind.AUDIT_LOAD: AuditLoad}


def make_fault(kind: FaultKind, record: FaultRecord) -> Fault:
    if kind in LINK_FAULTS:
        return LinkFault(record, kind, *LINK_FAULTS[kind])
    if kind in ENGINE_FAULTS:
        return EngineFault(record, kind, *ENGINE_FAULTS[kind])
    return PROCESS_FAULTS[kind](record)


def schedule(minutes: float, seed: int) -> list[Fault]:
    """Every kind once per minute of run (ceil(minutes) windows of equal length), each at a
    seeded random moment in the first three quarters of its window."""
    rng = random.Random(f"{seed}|schedule")
    windows = max(1, int(-(-minutes // 1)))
    length = minutes * 60 / windows
    faults = [make_fault(kind, FaultRecord(kind.value, round(w * length + rng.uniform(0.02, 0.75) * length, 2)))
              for w in range(windows) for kind in FaultKind]
    faults.sort(key=lambda f: f.record.at_s)
    # Every other failover loses writes, the first one chosen by the seed: a run of two
    # minutes or more has both.
    first = rng.randrange(2)
    for i, f in enumerate(f for f in faults if isinstance(f, Failover)):
        f.lossy = (i + first) % 2 == 1
    return faults
