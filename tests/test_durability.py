"""Faults with real processes: `kill -9` of a worker holding claimed groups, and
`kill -9` of redis-server itself followed by a restart from its AOF."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.audit import audit
from pipeline.connection import connect
from pipeline.consumer import Consumer
from pipeline.control import configure, read_control, set_weight_version
from pipeline.keys import CONSUMER_GROUP
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Place, Queue
from pipeline.types import Group, Status

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# A worker that claims groups, reports them, then keeps heartbeating while it
# "generates" until it is killed.
HOLDING_WORKER = r"""
import sys, time
from pipeline.connection import connect
from pipeline.queue import Queue
url, ns, lease, worker, n = sys.argv[1:6]
q = Queue(connect(url), ns, lease_s=float(lease))
claim = q.claim(worker, int(n))
print(" ".join(c.group_id for c in claim.groups), flush=True)
while True:
    q.heartbeat(worker, '{"state": "generating"}')
    time.sleep(0.1)
"""

# A worker that claims and completes as fast as it can, to be killed at a random instant.
BUSY_WORKER = r"""
import sys, time
from pipeline.connection import connect
from pipeline.queue import Place, Queue
url, ns, lease, worker = sys.argv[1:5]
q = Queue(connect(url), ns, lease_s=float(lease))
print("ready", flush=True)
while True:
    claim = q.claim(worker, 3)
    for i, c in enumerate(claim.groups):
        g = c.group
        for s in g.samples:
            s.tokens, s.response_length, s.reward = [1, 2, 3], 2, float(s.index % 2)
        place = Place.REQUEUE if int(c.group_id[1:]) % 7 == 0 and g.attempts == 0 else Place.RESULTS
        g.attempts += 1
        q.publish_group(worker, g, place)
    if not claim.groups:
        q.release("continue")
        time.sleep(0.01)
"""


def spawn(script: str, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def first_line(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        proc.kill()
        raise AssertionError(f"worker printed nothing in {timeout}s: {proc.stderr.read()}")
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise AssertionError(f"worker exited ({proc.returncode}): {proc.stderr.read()}")
    return line.strip()


def kill9(proc: subprocess.Popen) -> None:
    proc.kill()  # SIGKILL: no cleanup, no leave()
    proc.wait(10)
    assert proc.returncode == -9


def fill(group: Group) -> Group:
    for i, s in enumerate(group.samples):
        s.tokens, s.response_length, s.reward, s.status = [1, 2, 3], 2, float(i), Status.COMPLETED
    return group


def drain(q: Queue, consumer: Consumer, worker: str = "rescuer", deadline_s: float = 30) -> list[str]:
    """Work off everything left and commit it; the committed group ids in order."""
    committed = []
    deadline = time.monotonic() + deadline_s
    k = q.keys
    while time.monotonic() < deadline:
        q.release("continue")
        for c in q.claim(worker, 50).groups:
            q.publish_group(worker, fill(c.group), Place.RESULTS)
        ready = q.redis.xlen(k.results)
        if not (ready or q.redis.llen(k.prompts) or q.redis.xlen(k.requeue)):
            return committed
        batch = consumer.next_batch(max(1, ready), timeout=5)
        consumer.commit(batch)
        committed += [g.group_id for g in batch.groups]
    raise AssertionError("could not drain the queue")


def assert_audit_ok(q: Queue):
    report = audit(q)
    assert report.ok, report.summary()
    return report


# -- kill -9 of a worker --------------------------------------------------------------


def test_killed_worker_groups_come_back_after_the_lease(redis_url, client, namespace):
    lease = 1.5
    q = Queue(client, namespace, lease_s=lease)
    q.push_groups([Group.fresh(f"g{i}", f"p{i}", 2, row=i) for i in range(5)])
    proc = spawn(HOLDING_WORKER, redis_url, namespace, lease, "doomed", 3)
    try:
        held = first_line(proc).split()
        assert held == ["g0", "g1", "g2"]
        assert {g.decode() for g in client.smembers(q.keys.inflight("doomed"))} == set(held)
        # Alive and heartbeating: not reaped even after a whole lease.
        time.sleep(lease + 0.3)
        assert q.reap_expired() == 0
        assert "doomed" in q.live_workers()
    finally:
        kill9(proc)
    killed_at = time.monotonic()
    seconds, micros = client.time()
    heartbeat_age = (seconds * 1000 + micros // 1000 - client.zscore(q.keys.workers, "doomed")) / 1000
    assert q.reap_expired() == 0  # its last heartbeat is still fresh
    assert_audit_ok(q)  # nothing lost at the instant of the crash: the groups sit in its in-flight set

    while q.reap_expired() == 0:
        assert time.monotonic() - killed_at < lease + 3, "the reaper never returned the groups"
        time.sleep(0.05)
    waited = time.monotonic() - killed_at
    assert lease - heartbeat_age - 0.05 <= waited <= lease + 2.0  # not before the lease, soon after it
    assert client.smembers(q.keys.inflight("doomed")) == set()
    prompts = [g.decode() for g in client.lrange(q.keys.prompts, 0, -1)]
    assert set(prompts[:3]) == set(held) and prompts[3:] == ["g3", "g4"]  # at the head
    assert q.stats()["reaped"] == 3
    assert "doomed" not in q.live_workers()

    consumer = Consumer(client, namespace, block_s=0.2)
    committed = drain(q, consumer)
    assert sorted(committed) == [f"g{i}" for i in range(5)]
    report = assert_audit_ok(q)
    assert report.committed == 5


def test_kill_at_a_random_instant_loses_nothing(redis_url, client, namespace):
    lease = 0.8
    q = Queue(client, namespace, lease_s=lease)
    n = 150
    q.push_groups([Group.fresh(f"g{i}", f"p{i}", 2, row=i) for i in range(n)])
    proc = spawn(BUSY_WORKER, redis_url, namespace, lease, "busy")
    try:
        assert first_line(proc) == "ready"
        deadline = time.monotonic() + 20
        while client.xlen(q.keys.results) < 30:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.005)
    finally:
        kill9(proc)
    assert_audit_ok(q)
    time.sleep(lease + 0.1)
    q.reap_expired()
    consumer = Consumer(client, namespace, block_s=0.2)
    committed = drain(q, consumer)
    assert len(committed) == len(set(committed)) == n
    report = assert_audit_ok(q)
    assert (report.committed, report.dead, report.dropped) == (n, 0, 0)


# -- kill -9 of redis-server and restart from the AOF ---------------------------------


def _snapshot(c, q: Queue) -> dict:
    k = q.keys
    return {
        "prompts": c.lrange(k.prompts, 0, -1),
        "inflight": c.smembers(k.inflight("A")),
        "payloads": c.hgetall(k.payloads),
        "results": c.xrange(k.results),
        "requeue": c.xrange(k.requeue),
        "dead": c.xrange(k.dead),
        "pending": [(p["message_id"], p["consumer"], p["times_delivered"])
                    for p in c.xpending_range(k.results, CONSUMER_GROUP, "-", "+", 100)],
        "committed": c.zrange(k.committed, 0, -1),
        "dataset": c.hgetall(k.dataset),
        "stats": c.hgetall(k.stats),
        "admitted": c.hgetall(k.admitted),
        "workers": c.zrange(k.workers, 0, -1),
    }


def test_embedded_redis_fsyncs_as_configured(redis_factory):
    default, always = redis_factory("default"), redis_factory("always", appendfsync="always")
    assert connect(default.url).config_get("appendfsync") == {"appendfsync": "everysec"}
    assert connect(always.url).config_get("appendfsync") == {"appendfsync": "always"}


def test_redis_restarted_from_aof_keeps_everything(redis_factory, redis_binary, tmp_path):
    server = redis_factory("aof", binary=redis_binary)
    assert (server.data_dir / "redis.conf").read_text().count("appendfsync everysec") == 1
    c = connect(server.url)
    q = Queue(c, "durable")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(12)))
    push_dataset(q, data, PushOptions(n_samples_per_prompt=2))
    set_weight_version(c, q.keys, 3)
    configure(c, q.keys, max_ready=100)

    # Worker A: one done, one aborted, one failed, two still in flight.
    a = q.claim("A", 5).groups
    q.publish_group("A", fill(a[0].group), Place.RESULTS)
    q.publish_group("A", a[1].group, Place.REQUEUE)
    q.publish_group("A", a[2].group, Place.DEAD, error="engine exploded")
    # Worker B: three done.
    for x in q.claim("B", 3).groups:
        q.publish_group("B", fill(x.group), Place.RESULTS)
    # Trainer: commits two, holds one uncommitted; one result undelivered.
    trainer = Consumer(c, "durable", block_s=0.2)
    trainer.commit(trainer.next_batch(2, timeout=5))
    in_step = trainer.next_batch(1, timeout=5)
    before = audit(q)
    assert before.ok, before.summary()
    assert (before.prompts, sum(before.inflight.values()), before.requeue, before.dead) == (4, 2, 1, 1)
    assert (before.results_undelivered, before.results_pending, before.committed) == (1, 1, 2)
    snap = _snapshot(c, q)
    c.close()

    time.sleep(1.5)  # appendfsync everysec: let the last second reach the disk
    server.kill()
    assert server.process.returncode == -9
    # What comes back comes from the AOF: RDB snapshots are off and a kill -9 writes none.
    assert not (server.data_dir / "dump.rdb").exists()
    assert list(server.data_dir.glob("appendonly*"))
    restarted = redis_factory(data_dir=server.data_dir, port=server.port, binary=redis_binary)
    c = connect(restarted.url)
    q = Queue(c, "durable")
    after = audit(q)
    assert after.to_dict() == before.to_dict()
    assert _snapshot(c, q) == snap
    control = read_control(c, q.keys)
    assert (control.weight_version, control.max_ready) == (3, 100)

    # The uncommitted batch is redelivered first to the next trainer session.
    trainer = Consumer(c, "durable", block_s=0.2)
    again = trainer.next_batch(1, timeout=5)
    assert [g.group_id for g in again.groups] == [g.group_id for g in in_step.groups]
    trainer.commit(again)
    # A died with the server; its groups come back when reaped.
    assert q.leave("A") == 2
    committed = drain(q, trainer)
    report = assert_audit_ok(q)
    assert (report.committed, report.dead) == (11, 1)
    assert len(set(committed)) == len(committed) == 8
    # The producer's cursor survived too: pushing again adds nothing.
    rep = push_dataset(q, data, PushOptions(n_samples_per_prompt=2))
    assert (rep.pushed, rep.already) == (0, 12)
    c.close()
