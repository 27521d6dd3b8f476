"""The faults of a fault campaign that strike the data nodes: kill -9 of the primary,
every node down past the lease, Sentinel failovers (every other one losing writes), and a
large audit beside the pipeline (chaos/fault_base.py says how a fault runs)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pipeline.connection import STARTUP_WAIT_S, ConnectionFailed, connect
from pipeline.keys import CONSUMER_GROUP
from pipeline.ops.admin import purge
from pipeline.ops.audit import audit
from pipeline.queue import Queue
from pipeline.retry import Reconnect
from pipeline.types import Group

from .fault_base import Campaign, Fault, FaultKind, _release_redis, _take_redis

log = logging.getLogger(__name__)


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


