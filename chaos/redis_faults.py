"""The faults of a fault campaign that strike the data nodes: kill -9 of the primary,
every node down past the lease, Sentinel failovers (every other one losing writes), and a
large audit beside the pipeline (chaos/fault_base.py says how a fault runs)."""
from __future__ import annotations

import logging
import time
from typing import Any

from pipeline.connection import STARTUP_WAIT_S, connect
from pipeline.keys import CONSUMER_GROUP
from pipeline.ops.admin import purge
from pipeline.ops.audit import audit
from pipeline.queue import Queue
from pipeline.retry import Reconnect
from pipeline.types import Group

from .clock import step_server_clock
from .ledger import LedgerEvent
from .fault_base import WINDOW_S, Campaign, Fault, FaultKind, ThreadFault, _release_redis, _take_redis

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


class LongOutage(ThreadFault):
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
            finally:
                _release_redis(c)

        self._start(back)
        return True

    def _finish(self, c: Campaign) -> None:
        self.record.ended = time.time()


#: How long a lossy failover lets the primary acknowledge writes its replica does not apply.
LAG_S = 1.5


class Failover(ThreadFault):
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
            except Exception:
                if self.lossy:  # never leave a node refusing writes behind
                    try:
                        d.resume_replication(new)
                    except Exception:  # noqa: BLE001 - down: a restart has no pause
                        pass
                raise
            finally:
                _release_redis(c)

        self._start(run)
        return True

    def _finish(self, c: Campaign) -> None:
        if not self.error:
            self.record.note = (f"promoted after {self.promoted_s:.1f}s; the old primary rejoined as its replica "
                                f"after {self.rejoined_s:.1f}s")


#: Queued groups of the namespace an `audit_load` fault audits (on the campaign's server).
AUDIT_LOAD_GROUPS = 50_000


class AuditLoad(ThreadFault):
    """An operator audits a large namespace on the pipeline's server while it runs: the
    audit holds the server only in short steps, so no process sees BUSY (issue 21, o7).
    Filled and audited on a thread of its own, through Reconnect (a Redis fault may
    overlap); the namespace is deleted afterwards."""

    kind = FaultKind.AUDIT_LOAD

    def begin(self, c: Campaign) -> bool:
        if c.fleet.refusing_writers:  # its client would be refused as it starts (eviction)
            return False
        r = self.record
        r.started = time.time()
        namespace = f"chaos-audit-{int(r.at_s)}"
        r.target, r.affected, r.unit = f"namespace {namespace}", AUDIT_LOAD_GROUPS, "groups queued"
        self.outcome: dict[str, Any] = {}

        def load() -> None:
            reconnect = Reconnect(f"audit load {namespace}")
            # Another fault may hold Redis down as this one starts.
            client = connect(c.fleet.redis_url, socket_timeout=60, wait_s=STARTUP_WAIT_S)
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
            finally:
                client.close()

        self._start(load)
        return True

    def _finish(self, c: Campaign) -> None:
        r = self.record
        r.ended = time.time()
        if r.problem:
            return
        if not self.outcome.get("ok"):
            r.problem = f"the audit of the loaded namespace: {self.outcome.get('summary', 'did not run')}"
        else:
            r.note = f"audited in {self.outcome['audit_s']:.1f}s while the pipeline ran"


#: Commands that write, as INFO commandstats names them: none may reach the primary while
#: its policy may evict (the scripts run by EVALSHA or FCALL; MULTI/EXEC around publishes).
WRITE_COMMANDS = ("evalsha", "eval", "fcall", "exec", "set", "hset", "hdel", "hincrby", "hsetnx", "zadd", "zrem",
                  "xadd", "xack", "xdel", "xgroup", "del", "unlink", "rename", "lpush", "rpush", "lpop", "lmove",
                  "sadd", "srem", "incr", "expire")


def _writes(client) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in WRITE_COMMANDS)


class Eviction(ThreadFault):
    """For WINDOW_S the primary may evict keys (maxmemory-policy allkeys-lru, maxmemory just
    above what it holds) and every client connection is cut: every writer reconnects,
    finds a server that may evict and waits (the server check on each writing connection,
    pipeline/server_checks.py), then carries on once the policy is noeviction again. The
    promise: no write reached the server while it could evict, and nothing was evicted. No
    process starts meanwhile (a refusal at start is a configuration error and exits): the
    fault holds the trainer faults and WorkerKill off (Fleet.refusing_writers)."""

    kind = FaultKind.EVICTION

    def begin(self, c: Campaign) -> bool:
        if c.trainer_fault is not None or c.fleet.redis_busy or _starting(c):
            return False
        node = c.fleet.redis.primary_node()
        admin = connect(node.url, read_only=True)  # the operator's own: reads and CONFIG, no check
        _take_redis(c)
        c.trainer_fault = self
        c.fleet.refusing_writers = True
        r = self.record
        r.started = time.time()
        r.target, r.unit = f"primary 127.0.0.1:{node.port}", "reconnects"

        def run() -> None:
            try:
                before = admin.info("stats")
                admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + (1 << 20))
                admin.config_set("maxmemory-policy", "allkeys-lru")
                for kind in ("normal", "pubsub"):
                    admin.client_kill_filter(_type=kind, skipme=True)
                writes = _writes(admin)
                time.sleep(WINDOW_S)
                self.writes = _writes(admin) - writes
                after = admin.info("stats")
                r.affected = int(after["total_connections_received"]) - int(before["total_connections_received"])
                self.evicted = int(after["evicted_keys"]) - int(before["evicted_keys"])
            finally:
                try:
                    admin.config_set("maxmemory-policy", "noeviction")
                    admin.config_set("maxmemory", 0)
                finally:
                    r.ended = time.time()
                    admin.close()
                    c.fleet.refusing_writers = False
                    c.trainer_fault = None
                    _release_redis(c)

        self.writes = self.evicted = 0
        self._start(run)
        return True

    def _finish(self, c: Campaign) -> None:
        r = self.record
        if self.writes or self.evicted:
            r.problem = r.problem or (f"{self.writes} writes reached the primary while it could evict keys, "
                                      f"{self.evicted} keys evicted")
        elif not r.problem:
            r.note = "no write reached it while it could evict; nothing evicted"



def _starting(c: Campaign) -> bool:
    """Whether a worker or a trainer is still starting (not registered, no `start` in the
    ledger): it would meet the refusal at start, which exits by design."""
    registered = c.worker_ids()
    started = {r.pid for r in c.records if r.event == LedgerEvent.START}
    return (any(w.alive and w.pid not in registered for w in c.fleet.workers)
            or any(t.alive and t.pid not in started for t in c.fleet.trainers))


#: How far the clock_step fault moves the server's clock back (then forward by FORWARD_MS):
#: a failover to a replica whose clock is ten leases behind; and an NTP-sized step forward.
BACK_LEASES = 10
FORWARD_MS = 1000


class ClockStep(Fault):
    """The server's clock steps back ten leases, as every lease script sees it (the stored
    deadlines and last-seen time moved: chaos/clock.py), then forward a second. The promise
    (lua/_prelude.lua lease_clock): the first heartbeat or reap after the step back rebases
    every deadline, so no worker that dies is reaped ten leases late; the step forward
    reaps nobody alive (heartbeats every second against a 6 s lease)."""

    kind = FaultKind.CLOCK_STEP

    def begin(self, c: Campaign) -> bool:
        if not _take_redis(c):
            return False
        q = c.queue
        self.back_ms = int(BACK_LEASES * c.settings.lease_s * 1000)
        self.rebased_before = int(c.call(q.redis.hget, q.keys.beats, "clock_back_ms") or 0)
        r = self.record
        r.started = time.time()
        r.target = f"server clock {self.back_ms / 1000:g}s back, then {FORWARD_MS / 1000:g}s forward"
        r.affected, r.unit = len(c.call(q.workers)), "leases rebased"
        c.call(step_server_clock, q.redis, q.keys, -self.back_ms)
        return True

    def step(self, c: Campaign) -> bool:
        q, r = c.queue, self.record
        # Rebased by the step less the time since the last lease script before it (that much
        # more lease for everyone: seconds while heartbeats come, more after an outage).
        rebased = int(c.call(q.redis.hget, q.keys.beats, "clock_back_ms") or 0) - self.rebased_before
        if not rebased and time.time() < r.started + 3 * c.settings.lease_s:
            return False
        ahead = max(c.call(q.workers).values(), default=0.0) - c.settings.lease_s
        if not rebased:
            r.problem = "the step back was not rebased within 3 leases"
        elif ahead > 1.0:
            r.problem = f"a lease deadline is still {ahead:.1f}s further away than a lease after the rebase"
        else:
            r.note = f"rebased {time.time() - r.started:.2f}s after the step back"
        c.call(step_server_clock, q.redis, q.keys, FORWARD_MS)
        r.ended = time.time()
        _release_redis(c)
        return True

    def lift(self, c: Campaign) -> None:
        if self.record.ended is None:
            self.record.ended = time.time()
            _release_redis(c)
