"""The lease clock (issue 31 items 9, 10): a grace for every worker only after an outage the
server itself shows (another run id or replication id: a restart, a failover), never after
a mere silence (the only worker died); and a server clock that went back (an NTP step, a
failover to a replica whose clock is behind) rebases every deadline instead of delaying
every reap by the step. The step is made with chaos.clock.step_server_clock: what a clock
step leaves behind, as every script sees it."""
from __future__ import annotations

import time

import pytest

from chaos.clock import step_server_clock
from pipeline.connection import connect
from pipeline.control import configure
from pipeline.ops.status import snapshot
from pipeline.queue import Queue
from pipeline.redis_sentinel import SentinelDeployment
from tests.groups import assert_audit_ok, claim, fresh
from tests.helpers import outage, wait_for, wait_replicated

LEASE_S = 1.0
STEP_MS = 60_000  # far longer than any test here waits


@pytest.fixture
def q(queue):
    configure(queue.redis, queue.keys, lease_s=LEASE_S)
    queue.push_groups(fresh(2))
    claim(queue, "dead", 1)
    assert not queue.heartbeat("dead", "{}").reaped  # the lease clock has seen this server
    return queue


def _silence(q: Queue, lease_ms: int = int(LEASE_S * 1000)) -> None:
    """Nobody renewed for 3 leases (forced, not waited for); the server never went away."""
    now = q.now_ms()
    q.redis.hset(q.keys.beats, "seen_ms", now - 3 * lease_ms)
    q.redis.zadd(q.keys.workers, {"dead": now - 2 * lease_ms}, xx=True)


def test_a_lone_dead_worker_is_reaped_on_time_when_a_new_one_starts(q):
    """Item 10: kill -9 the only worker, start a new one: its first heartbeat found nobody
    renewed for longer than a lease and gave every worker a grace, so status showed the dead
    one alive again and its group stayed held another lease."""
    _silence(q)
    claim(q, "new", 1)
    assert not q.heartbeat("new", "{}").reaped
    rows = {w.worker: w for w in snapshot(q).workers}
    assert not rows["dead"].alive and rows["new"].alive
    assert q.reap("dead") == 1
    assert_audit_ok(q)


def test_a_reaper_after_a_silence_reaps_the_dead_at_once(q):
    _silence(q)
    assert q.reap_expired() == 1 and q.live_workers() == []


def test_a_restart_still_gives_every_worker_a_grace(redis_factory):
    """The other direction, through a real restart (a new run id): workers that could not
    renew while Redis was down are not reaped for it."""
    server = redis_factory("restart", aof=True)
    queue = Queue(connect(server.url), "grace")
    configure(queue.redis, queue.keys, lease_s=LEASE_S)
    queue.push_groups(fresh(1))
    claim(queue, "live", 1)
    assert not queue.heartbeat("live", "{}").reaped
    down = time.monotonic()
    outage(server, lambda: time.monotonic() - down > 2 * LEASE_S).join()
    reaper = Queue(connect(server.url), "grace")
    assert reaper.reap_expired() == 0 and reaper.live_workers() == ["live"]
    assert not reaper.heartbeat("live", "{}").reaped
    assert_audit_ok(reaper)


def test_a_clock_that_went_back_does_not_delay_reaping(q):
    """Item 9: deadlines are server time; after a step back every deadline lies the step
    further in the future, so a worker that died was reaped a minute late."""
    step_server_clock(q.redis, q.keys, -STEP_MS)
    started = time.monotonic()
    wait_for(lambda: q.reap("dead") >= 0, timeout=10 * LEASE_S, what="the dead worker reaped")
    assert time.monotonic() - started < 5 * LEASE_S
    assert_audit_ok(q)


def test_after_a_step_back_live_workers_keep_their_leases(q):
    claim(q, "live", 1)
    step_server_clock(q.redis, q.keys, -STEP_MS)
    assert q.reap_expired() == 0  # the first reap rebases: nobody is overdue yet
    assert 0 < q.workers()["live"] <= LEASE_S
    assert not q.heartbeat("live", "{}").reaped
    assert q.register("newcomer") == LEASE_S  # registered after the step, on the new clock
    assert 0 < q.workers()["newcomer"] <= LEASE_S
    q.redis.zadd(q.keys.workers, {"dead": q.now_ms() - 1}, xx=True)
    assert q.reap_expired() == 1 and set(q.live_workers()) == {"live", "newcomer"}


def test_a_registration_first_after_a_step_back_is_not_rebased_away(q):
    step_server_clock(q.redis, q.keys, -STEP_MS)
    q.register("newcomer")
    assert q.reap_expired() == 0
    assert q.workers()["newcomer"] > LEASE_S / 2


@pytest.mark.slow
def test_a_failover_to_a_replica_whose_clock_is_behind_reaps_on_time(tmp_path):
    """Item 9 through Sentinel: the primary's clock ran a minute ahead of its replica's
    (the stored deadlines and last-seen time are a minute ahead on the replica), the primary
    dies, Sentinel promotes the replica: a worker that died with it is reaped a grace (one
    lease, for the outage) after the failover, not a minute later."""
    d = SentinelDeployment(tmp_path).start()
    try:
        queue = Queue(connect(d.url, socket_timeout=5), "skew")
        configure(queue.redis, queue.keys, lease_s=LEASE_S)
        queue.push_groups(fresh(1))
        claim(queue, "dead", 1)
        assert not queue.heartbeat("dead", "{}").reaped
        step_server_clock(queue.redis, queue.keys, -STEP_MS)  # the primary's clock is a minute ahead
        primary = d.primary_node()
        wait_replicated(connect(primary.url, read_only=True), connect(d.other(primary).url, read_only=True))
        d.kill_primary()
        d.wait_promoted(d.other(primary), timeout_s=60)
        started = time.monotonic()
        reaper = Queue(connect(d.url, socket_timeout=5), "skew")
        wait_for(lambda: reaper.reap("dead") >= 0, timeout=30, what="the dead worker reaped")
        assert time.monotonic() - started < 10 * LEASE_S
        assert_audit_ok(reaper)
    finally:
        d.stop()
