"""The faults of a fault campaign (`rollout chaos`) on processes, links and engines, the
registry of every kind and the schedule (chaos/fault_base.py says how a fault runs; the
data nodes' faults are chaos/redis_faults.py)."""
from __future__ import annotations

import logging
import random
import re
import signal
import time


from .fault_base import REREGISTER_S, TRAINER_WAIT_S, Campaign, Fault, FaultKind, WindowFault, _http
from .fault_proxy import LinkFaults
from .fleet import Proc
from .report import FaultRecord
from .ledger import LedgerEvent
from .redis_faults import AuditLoad, ClockStep, Eviction, Failover, LongOutage, RedisKill

log = logging.getLogger(__name__)


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
        picked = None if c.fleet.refusing_writers else _pick_worker(c)  # its replacement would be refused
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
        self._before_replacing(c)
        self.new = new = c.fleet.spawn_trainer()
        r = self.record
        r.started = time.time()
        r.target = f"trainer pid {old.pid} replaced by pid {new.pid}"
        return True

    def _before_replacing(self, c: Campaign) -> None:
        """What the older trainer is told before the newer one starts."""

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
        self._check_older(c)
        c.trainer_fault = None
        return True

    def _check_older(self, c: Campaign) -> None:
        """What else must hold of the older trainer once it is gone."""

    def _read_fence(self, c: Campaign) -> bool:
        """Whether the older trainer exited cleanly after recording its fence, reading the
        ledger again: it may have written the record after the campaign's last read."""
        c.read_ledger()
        return self.old.popen.returncode == 0 and self.old.pid in c.fenced_pids

    def lift(self, c: Campaign) -> None:
        c.trainer_fault = None


class FencedTrainer(TrainerRolling):
    """A second trainer while the first runs, and the first one's weight-update loop runs
    on after the newer session fenced it (chaos/trainer.py, FENCED_UPDATES), with the
    versions it would have used. Its control writes must be refused like its reads and
    commits: an old trainer that pauses the pipeline and is killed before it resumes leaves
    the newer one waiting for good, and its versions set the newer one's back."""

    kind = FaultKind.FENCED_TRAINER

    def _before_replacing(self, c: Campaign) -> None:
        (c.fleet.run_dir / f"fenced-loop-{self.old.pid}").touch()

    def _check_older(self, c: Campaign) -> None:
        r = self.record
        c.read_ledger()
        writes = [w.fields for w in c.records if w.pid == self.old.pid and w.event == LedgerEvent.FENCED_WRITE]
        accepted = [w["version"] for w in writes if w["outcome"] == "accepted"]
        refused = sum(w["outcome"] == "refused" for w in writes)
        r.affected, r.unit = len(writes), "control writes"
        if not writes:
            r.problem = r.problem or f"the older trainer (pid {self.old.pid}) tried no weight update after its fence"
        elif accepted:
            r.problem = r.problem or (f"{len(accepted)} of {len(writes)} weight updates of the fenced trainer (pid "
                                      f"{self.old.pid}) went through (versions {accepted})")
        else:
            r.note = f"{refused} of {len(writes)} weight updates of the fenced trainer refused (SessionFenced)"


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
    """A window in which every simulator answers some /generate with an error, never, or
    aborted after a few tokens (its fault knobs, POST /sim/faults)."""

    def __init__(self, record: FaultRecord, kind: FaultKind, knobs: dict[str, float], counter: str):
        super().__init__(record)
        self.kind, self.knobs, self.counter = kind, knobs, counter
        self.record.unit = "requests"

    def _set(self, c: Campaign, knobs: dict[str, float]) -> dict[str, int]:
        """Set the knobs on every simulator; returns their counters."""
        counts = {}
        for url in c.fleet.sim_urls:
            try:
                _http(url + "/sim/faults", knobs)
                counts[url] = int(_http(url + "/sim/stats")["stats"].get(self.counter, 0))
            except (OSError, ValueError, KeyError, TypeError) as exc:  # restarting: it comes back without faults
                log.info("simulator %s: %s not set (%s)", url, knobs, exc)
        return counts

    def _open(self, c: Campaign) -> bool:
        if c.engine_fault is not None:
            return False
        c.engine_fault = self
        self.before = self._set(c, self.knobs)
        self.record.target = f"{', '.join(f'{k}={v:g}' for k, v in self.knobs.items())} on {len(self.before)} engines"
        return True

    def lift(self, c: Campaign) -> None:
        after = self._set(c, {k: 0.0 for k in self.knobs if k.endswith("_rate")})
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
    FaultKind.ENGINE_5XX: ({"error_rate": 1.0}, "errors"),
    FaultKind.ENGINE_HANG: ({"hang_rate": 0.3}, "hangs"),
    # Past the workers' preemption budget (chaos/fleet.py MAX_PREEMPTIONS) within the window.
    FaultKind.ABORT_STORM: ({"abort_rate": 1.0, "abort_after_tokens": 2}, "storm_aborts"),
}
PROCESS_FAULTS = {FaultKind.WORKER_KILL: WorkerKill, FaultKind.WORKER_STOP: WorkerStop,
                  FaultKind.TRAINER_KILL: TrainerKill, FaultKind.TRAINER_ROLLING: TrainerRolling,
                  FaultKind.FENCED_TRAINER: FencedTrainer, FaultKind.SIM_KILL: SimKill,
                  FaultKind.REDIS_KILL: RedisKill, FaultKind.LONG_OUTAGE: LongOutage, FaultKind.FAILOVER: Failover,
                  FaultKind.AUDIT_LOAD: AuditLoad, FaultKind.EVICTION: Eviction, FaultKind.CLOCK_STEP: ClockStep}


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
