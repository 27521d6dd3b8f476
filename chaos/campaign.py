"""`rollout chaos --minutes N --seed S`: a fault campaign against a real pipeline on this
machine, and the proof of what happened.

The fleet (chaos/fleet.py) runs Redis behind Sentinel (a primary and a replica with their
AOFs, three Sentinels), simulators behind the
real sglang-router, three or more workers (reaching Redis and the router through fault
proxies), a feeder and a trainer process that writes every batch to a ledger before it
commits and updates weights through Controller after every step. The campaign injects
every fault kind (chaos/faults.py) once per minute of run, each at a seeded
random moment; then it drains: faults off, the feeder stopped, the trainer takes what
is left. The report (chaos/report.py) counts every pushed group as trained
once, trained twice, dead, dropped or lost, and each fault's recovery: from its end
to the trainer's next batch.
"""
from __future__ import annotations

import json
import logging
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pipeline.ops.audit import audit
from pipeline.ops.status import snapshot
from pipeline.producer import PushOptions, epoch_order, group_id, read_cursor
from pipeline.queue import Queue, text
from pipeline.retry import Reconnect

from .fault_base import Fault, FaultKind
from .faults import WorkerStop, schedule
from .fleet import DATASET, DATASET_ROWS, DIRECT_WORKERS, Fleet, FleetSettings
from .report import ChaosReport, Tally, committed_batches, kind_rows, reason_of, set_recovery
from .ledger import LedgerEvent, Record, read_ledger

log = logging.getLogger(__name__)

T = TypeVar("T")

TICK_S = 0.05
#: Faults still under way, or not yet injected, this long after the campaign's end are
#: lifted or given up (and the campaign fails).
GRACE_S = 60.0


class ChaosError(RuntimeError):
    """The campaign could not run (the stack did not start, nothing was trained)."""


@dataclass
class ChaosSettings(FleetSettings):
    warmup_timeout_s: float = 120.0  # until the trainer's first batch
    drain_timeout_s: float = 180.0
    work_dir: Path | None = None  # default: a new temporary directory
    keep: bool = False  # keep the run directory (logs, ledger, Redis data) even when ok


class Campaign:
    def __init__(self, settings: ChaosSettings, say: Callable[[str], None] = lambda _msg: None):
        self.settings = settings
        self.say = say
        self.rng = random.Random(f"{settings.seed}|targets")
        self.run_dir = Path(settings.work_dir or tempfile.mkdtemp(prefix="rollout-chaos-"))
        self.fleet = Fleet(settings, self.run_dir)
        self.reconnect = Reconnect("chaos campaign")
        self.records: list[Record] = []
        self._ledger_offset = 0
        self.committed_batch_ids: set[str] = set()
        self.fenced_pids: set[int] = set()
        self.ended_cleanly: set[int] = set()
        self.drained = False
        self.trainer_fault: Fault | None = None  # one trainer fault at a time
        self.engine_fault: Fault | None = None  # one engine window at a time
        self.faults: list[Fault] = []
        self.problems: list[str] = []
        self.t0 = time.time()

    @property
    def queue(self) -> Queue:
        return self.fleet.queue

    def call(self, fn: Callable[..., T], *args) -> T:
        """A Redis call of the campaign's own, retried while Redis restarts."""
        return self.reconnect.call(fn, *args, deadline=time.monotonic() + 30)

    # -- what the fleet is doing ---------------------------------------------------------------

    def worker_ids(self) -> dict[int, str]:
        """pid -> registered worker id (a reaped worker's entry is gone until it registers anew)."""
        out = {}
        for wid, raw in self.call(self.queue.redis.hgetall, self.queue.keys.worker_info).items():
            try:
                out[int(json.loads(raw)["pid"])] = text(wid)
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def read_ledger(self) -> None:
        new, self._ledger_offset = read_ledger(self.fleet.ledger_path, self._ledger_offset)
        for r in new:
            if r.event == LedgerEvent.COMMIT:
                self.committed_batch_ids.add(r.fields["batch"])
            elif r.event == LedgerEvent.FENCED:
                self.fenced_pids.add(r.pid)
                self.ended_cleanly.add(r.pid)
            elif r.event == LedgerEvent.DRAINED:
                self.ended_cleanly.add(r.pid)
                self.drained = True
        self.records += new

    def last_batch(self, pid: int, after: float) -> Record | None:
        return next((r for r in reversed(self.records)
                     if r.event == LedgerEvent.TRAIN and r.pid == pid and r.t >= after), None)

    def _tick(self) -> None:
        self.read_ledger()
        def ledger() -> tuple[set[int], bool]:
            self.read_ledger()
            return self.ended_cleanly, self.drained

        for event in self.fleet.supervise(ledger):
            self.say(f"[{time.time() - self.t0:7.1f}s] {event}")

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> ChaosReport:
        s = self.settings
        self.say(f"fault campaign: {s.minutes:g} min, seed {s.seed}, fsync {s.fsync.value}; run directory "
                 f"{self.run_dir}")
        ok = False
        try:
            self.fleet.start()
            d = self.fleet.redis
            self.say(f"redis {self.fleet.redis_url} (primary :{d.primary.port}, replica :{d.replica.port}) | engines "
                     f"{' '.join(self.fleet.sim_urls)} behind router {self.fleet.router.url} | {s.workers} workers "
                     f"({DIRECT_WORKERS} through the Sentinel URL) via proxies {self.fleet.redis_proxy.address}, "
                     f"{self.fleet.router_proxy.address}")
            self._warm_up()
            self._inject()
            self._drain()
            self.fleet.stop_processes()
            report = self._report()
            ok = report.ok
            return report
        finally:
            self.fleet.close()
            if ok and not s.keep and s.work_dir is None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            else:
                self.say(f"run directory kept: {self.run_dir} (logs/, ledger.jsonl, redis/)")

    def _warm_up(self) -> None:
        deadline = time.time() + self.settings.warmup_timeout_s
        while not any(r.event == LedgerEvent.TRAIN for r in self.records):
            if time.time() > deadline:
                raise ChaosError(f"the pipeline trained nothing within {self.settings.warmup_timeout_s:g}s; "
                                 f"see the logs in {self.fleet.logs}")
            self._tick()
            time.sleep(TICK_S)
        self.t0 = time.time()
        self.say("[    0.0s] first batch trained; injecting faults")

    def _inject(self) -> None:
        pending = schedule(self.settings.minutes, self.settings.seed)
        self.faults = list(pending)
        active: list[Fault] = []
        end = self.t0 + self.settings.minutes * 60
        while True:
            now = time.time()
            if now >= end and not pending and not active:
                return
            if now >= end + GRACE_S:
                for f in active:
                    f.lift(self)
                    f.record.problem = f.record.problem or f"still under way {GRACE_S:g}s after the campaign's end"
                for f in pending:
                    f.record.problem = f"could not be injected within {GRACE_S:g}s after the campaign's end"
                return
            self._tick()
            for f in list(pending):
                if self.t0 + f.record.at_s > now:
                    break
                begun = self._guarded(f, f.begin)
                if begun is not False:
                    pending.remove(f)
                    if begun is True:
                        active.append(f)
            for f in list(active):
                if self._guarded(f, f.step) is not False:
                    active.remove(f)
                    self._announce(f)
            time.sleep(TICK_S)

    def _guarded(self, fault: Fault, fn: Callable) -> bool | None:
        """fn(self); an exception is the fault's problem (None), never the campaign's end."""
        try:
            return bool(fn(self))
        except Exception as exc:
            log.exception("fault %s failed", fault.record.kind)
            fault.record.problem = f"{type(exc).__name__}: {exc}"
            self._announce(fault)
            return None

    def _announce(self, f: Fault) -> None:
        r = f.record
        at = (r.started or time.time()) - self.t0
        line = f"[{at:7.1f}s] {r.kind:<17} {r.target}: {r.affected} {r.unit}"
        if r.started is None:
            line = f"[{at:7.1f}s] {r.kind:<17} not injected"
        if r.note:
            line += f"; {r.note}"
        if r.problem:
            line += f"; PROBLEM: {r.problem}"
        self.say(line)

    def _drain(self) -> None:
        self.fleet.stop_feeder()
        self.fleet.drain_file.touch()
        self.say(f"[{time.time() - self.t0:7.1f}s] drain: faults over, feeder stopped; the trainer takes what is left")
        deadline = time.time() + self.settings.drain_timeout_s
        while not self.drained:
            if time.time() > deadline:
                self.problems.append(f"the drain did not finish within {self.settings.drain_timeout_s:g}s: "
                                     f"{self.call(audit, self.queue).summary()}; {self._stuck()}")
                return
            self._tick()
            time.sleep(TICK_S)
        self.say(f"[{time.time() - self.t0:7.1f}s] drained")

    def _stuck(self) -> str:
        """Why nothing moves, for the problem line: admission, each worker's state as it
        reports it, and each live process's last log line."""
        snap = self.call(snapshot, self.queue)
        states = "; ".join(f"{w.worker}: {w.state}" for w in snap.workers) or "no workers registered"
        procs = [p for p in self.fleet.workers + self.fleet.trainers if p.alive]
        lines = " | ".join(f"{p.role} (pid {p.pid}): {p.last_line()}" for p in procs)
        return (f"paused {snap.paused}, weight version {snap.weight_version}; workers: {states}; "
                f"last log lines: {lines}")

    # -- the proof -----------------------------------------------------------------------------

    def _committed_in_redis(self, batch: str, groups: list[str]) -> bool:
        """Did this batch's commit go through, its trainer dying before it recorded so?"""
        return any(event == "committed" and detail == batch
                   for gid in groups for _, event, _, detail in self.queue.history(gid))

    def _pushed_ids(self) -> list[str]:
        ids = []
        for epoch in range(self.fleet.epochs):
            order = epoch_order(DATASET_ROWS, epoch, PushOptions())
            ids += [group_id(DATASET, 0, epoch, row) for row in order[:read_cursor(self.queue, DATASET, epoch)]]
        return ids

    def _dropped(self) -> dict[str, str]:
        q = self.queue
        return {e.group_id: e.reason or "" for e in q.iter_stream(q.keys.dropped, with_data=False)}

    def check_stopped_worker(self, fault: WorkerStop) -> str:
        """A problem if the stopped worker published a group after it was reaped; else ""
        (and fault.refused: its publishes the claim tokens refused, from its log)."""
        old = fault.wid
        for gid in fault.record.groups:
            events = self.queue.history(gid)
            reaped = next((i for i, (_, event, who, _) in enumerate(events) if event == "reaped" and who == old), None)
            if reaped is None:  # its publish got through before the reap
                continue
            if any(event == "published" and who == old for _, event, who, _ in events[reaped + 1:]):
                return f"worker {old} published group {gid} after it was reaped"
        fault.refused = fault.proc.log_path.read_text(errors="replace").count(f"worker {old} no longer holds it")
        return ""

    def _checks(self) -> list[str]:
        """One line per promise a fault kind tests, with its evidence."""
        def injected(kind: FaultKind) -> list:
            return [f for f in self.faults if f.kind == kind and f.record.started is not None]

        lines = []
        if stops := injected(FaultKind.WORKER_STOP):
            lines.append(f"worker_stop: {len(stops)} workers stopped past their lease; the reaper took back the "
                         f"{sum(f.record.affected for f in stops)} groups they held; "
                         f"{sum(f.refused for f in stops)} of their publishes refused, none got through; "
                         f"{sum(1 for f in stops if 'registered as' in f.record.note)} registered anew")
        if kills := injected(FaultKind.TRAINER_KILL):
            after = sum(1 for f in kills if "after the commit" in f.record.note)
            lines.append(f"trainer_kill: {len(kills) - after} of {len(kills)} kills between next_batch and commit; "
                         f"their {sum(f.record.affected for f in kills)} groups went to the next session")
        if rolls := injected(FaultKind.TRAINER_ROLLING):
            clean = sum(1 for f in rolls if not f.record.problem)
            lines.append(f"trainer_rolling: {clean} of {len(rolls)} older trainers fenced and exited cleanly "
                         f"(SessionFenced, exit code 0); {sum(f.record.affected for f in rolls)} entries taken over")
        if redis_kills := injected(FaultKind.REDIS_KILL):
            downtimes = [f.downtime_s for f in redis_kills]
            lines.append(f"redis_kill: {len(redis_kills)} kill -9, each restarted from its AOF and answering again "
                         f"after {statistics.median(downtimes):.2f}s (median), {max(downtimes):.2f}s at most; "
                         f"aof_delayed_fsync at most {max(f.delayed_fsyncs for f in redis_kills)} before a kill")
        if failovers := injected(FaultKind.FAILOVER):
            lossy = [f for f in failovers if f.lossy]
            promoted = [f.promoted_s for f in failovers if f.promoted_s]
            lines.append(f"failover: {len(failovers)} promotions by Sentinel ({len(lossy)} to a replica that missed "
                         f"{sum(f.record.affected for f in lossy)} bytes of writes), the new primary named after "
                         + (f"{statistics.median(promoted):.2f}s (median), {max(promoted):.2f}s at most; "
                            if promoted else "-; ")
                         + f"{sum(1 for f in failovers if f.rejoined_s)} old primaries rejoined as replicas; the "
                         "trainer's deliveries, commits and weight updates waited for the replica (WAIT)")
        if evictions := injected(FaultKind.EVICTION):
            lines.append(f"eviction: {len(evictions)} windows in which the primary could evict keys; "
                         f"{sum(f.record.affected for f in evictions)} reconnects meanwhile, {sum(f.writes for f in evictions)}"
                         f" writes reached it, {sum(f.evicted for f in evictions)} keys evicted")
        if steps := injected(FaultKind.CLOCK_STEP):
            lines.append(f"clock_step: {len(steps)} steps of the server's clock back and forward; "
                         f"{sum('rebased' in f.record.note for f in steps)} rebased at the next heartbeat, "
                         f"{sum(f.record.affected for f in steps)} leases moved back")
        if fenced := injected(FaultKind.FENCED_TRAINER):
            lines.append(f"fenced_trainer: {len(fenced)} older trainers kept updating weights after the newer one "
                         f"started: {'; '.join(f.record.note or f.record.problem for f in fenced)}")
        if storms := injected(FaultKind.ABORT_STORM):
            dead = sum("nothing explained" in e.error for e in self.queue.iter_stream(self.queue.keys.dead,
                                                                                     with_data=False) if e.error)
            lines.append(f"abort_storm: {sum(f.record.affected for f in storms)} requests aborted after 2 tokens in "
                         f"{len(storms)} storms; samples past their preemption budget counted them as engine "
                         f"failures ({dead} groups dead-lettered for it)")
        return lines

    def _report(self) -> ChaosReport:
        q = self.queue
        self.read_ledger()
        batches = committed_batches(self.records, self._committed_in_redis)
        trained = Counter(g for groups in batches.values() for g in groups)
        dead = {e.group_id: e.error or "" for e in q.iter_stream(q.keys.dead, with_data=False)}
        dropped = self._dropped()
        pushed = self._pushed_ids()
        once, twice, lost, strangers = Tally(trained, dead, dropped).classify(pushed)
        problems = list(self.fleet.incidents) + self.problems
        if strangers:
            problems.append(f"{len(strangers)} groups trained that were never pushed: {', '.join(strangers[:5])}")
        both = sorted(g for g in trained if g in dead or g in dropped)
        if both:
            problems.append(f"{len(both)} groups trained and also dead or dropped: {', '.join(both[:5])}")
        stats_pushed = q.stats().get("pushed", 0)
        if stats_pushed != len(pushed):
            problems.append(f"the dataset cursors say {len(pushed)} groups pushed, the counters {stats_pushed}")
        report = audit(q)
        records = [f.record for f in self.faults]
        set_recovery(records, [r.t for r in self.records if r.event == LedgerEvent.TRAIN])
        for f in self.faults:
            if isinstance(f, WorkerStop) and f.record.started is not None and not f.record.problem:
                f.record.problem = self.check_stopped_worker(f)
        problems += [f"{r.kind} at {r.at_s:g}s: {r.problem}" for r in records if r.problem]
        injected = Counter(r.kind for r in records if r.started is not None)
        planned = Counter(r.kind for r in records)
        problems += [f"{kind}: injected {injected[kind]} of {n} planned" for kind, n in planned.items()
                     if injected[kind] < n]
        if not self.drained:
            problems.append("the trainer never finished the drain")
        pushed_set = set(pushed)
        dead_pushed = {g: e for g, e in dead.items() if g in pushed_set}
        dropped_pushed = {g: r for g, r in dropped.items() if g in pushed_set}
        return ChaosReport(
            pushed=len(pushed), trained_once=len(once), trained_twice=len(twice), lost=len(lost),
            dead=len(dead_pushed), dropped=len(dropped_pushed),
            faults={kind.value: injected[kind.value] for kind in FaultKind},
            ok=not (twice or lost or problems) and report.ok,
            seed=self.settings.seed, minutes=self.settings.minutes, batches=len(batches),
            dead_reasons=dict(Counter(reason_of(e) for e in dead_pushed.values()).most_common()),
            dropped_reasons=dict(Counter(dropped_pushed.values()).most_common()),
            by_kind=kind_rows([k.value for k in FaultKind], records),
            audit_ok=report.ok, audit_summary=report.summary(), checks=self._checks(), problems=problems,
            twice_ids=twice, lost_ids=lost)


def run_campaign(settings: ChaosSettings, say: Callable[[str], None] = lambda _msg: None) -> ChaosReport:
    return Campaign(settings, say).run()
