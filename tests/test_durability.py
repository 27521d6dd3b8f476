"""Faults with real processes: `kill -9` of a worker holding claimed groups, `kill -9`
of redis-server itself followed by a restart from its AOF, and a worker and a trainer
riding out a Redis restart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.ops.audit import audit
from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.control import configure, read_control, set_weight_version
from pipeline.keys import CONSUMER_GROUP
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Place, Queue
from pipeline.types import Group, Status
from tests.groups import claim, publish
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# A worker that claims groups, reports them, then keeps heartbeating while it
# "generates" until it is killed.
HOLDING_WORKER = r"""
import sys, time
from pipeline.connection import connect
from pipeline.queue import Queue
url, ns, worker, n = sys.argv[1:5]
q = Queue(connect(url), ns)
q.register(worker)
claim = q.claim(worker, worker + ":1", int(n))
print(" ".join(c.group_id for c in claim.groups), flush=True)
while True:
    q.heartbeat(worker, '{"state": "generating"}')
    time.sleep(0.1)
"""

# A worker that claims and completes as fast as it can, to be killed at a random instant.
BUSY_WORKER = r"""
import itertools, sys, time
from pipeline.connection import connect
from pipeline.queue import Place, Queue
url, ns, worker = sys.argv[1:4]
q = Queue(connect(url), ns)
q.register(worker)
print("ready", flush=True)
for n in itertools.count():
    claim = q.claim(worker, f"{worker}:{n}", 3)
    for i, c in enumerate(claim.groups):
        g = c.group
        for s in g.samples:
            s.tokens, s.response_length, s.reward = [1, 2, 3], 2, float(s.index % 2)
        place = Place.REQUEUE if int(c.group_id[1:]) % 7 == 0 and g.attempts == 0 else Place.RESULTS
        g.attempts += 1
        q.publish_group(worker, g, c.token, place)
    if not claim.groups:
        q.release("continue")
        q.heartbeat(worker, "{}")
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
        for c in claim(q, worker, 50).groups:
            publish(q, worker, c, group=fill(c.group))
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
    q = Queue(client, namespace)
    configure(client, q.keys, lease_s=lease)
    q.push_groups([Group.fresh(f"g{i}", f"p{i}", 2, row=i) for i in range(5)])
    proc = spawn(HOLDING_WORKER, redis_url, namespace, "doomed", 3)
    try:
        held = first_line(proc).split()
        assert held == ["g0", "g1", "g2"]
        assert set(q.held("doomed")) == set(held)
        # Alive and heartbeating: not reaped even after a whole lease has gone by.
        first_deadline = client.zscore(q.keys.workers, "doomed")
        wait_for(lambda: client.zscore(q.keys.workers, "doomed") > first_deadline + lease * 1000,
                 what="a lease's worth of heartbeats")
        assert q.reap_expired() == 0
        assert "doomed" in q.live_workers()
    finally:
        kill9(proc)
    deadline_ms = client.zscore(q.keys.workers, "doomed")
    assert q.reap_expired() == 0  # its lease runs on after the crash
    assert_audit_ok(q)  # nothing lost at the instant of the crash: the groups sit in its in-flight hash

    wait_for(lambda: q.reap_expired() > 0, timeout=lease + 5, what="the reaper returning the groups")
    assert q.now_ms() >= deadline_ms  # not before the lease ran out
    assert q.held("doomed") == {}
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
    q = Queue(client, namespace)
    configure(client, q.keys, lease_s=1.0)  # no shorter than the upkeep period (control.UPKEEP_S)
    n = 150
    q.push_groups([Group.fresh(f"g{i}", f"p{i}", 2, row=i) for i in range(n)])
    proc = spawn(BUSY_WORKER, redis_url, namespace, "busy")
    try:
        assert first_line(proc) == "ready"
        deadline = time.monotonic() + 20
        while client.xlen(q.keys.results) < 30:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.005)
    finally:
        kill9(proc)
    assert_audit_ok(q)
    wait_for(lambda: q.reap_expired() >= 0 and "busy" not in q.workers(), what="the dead worker reaped")
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
        "inflight": c.hgetall(k.inflight("A")),
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


def test_redis_restarted_from_aof_keeps_everything(redis_factory, redis_binary, tmp_path):
    server = redis_factory("aof", binary=redis_binary)
    assert (server.data_dir / "redis.conf").read_text().count("appendfsync always") == 1  # the default
    c = connect(server.url)
    q = Queue(c, "durable")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(12)))
    push_dataset(q, data, PushOptions(n_samples_per_prompt=2))
    set_weight_version(c, q.keys, 3)
    configure(c, q.keys, max_ready=100)

    # Worker A: one done, one aborted, one failed, two still in flight.
    a = claim(q, "A", 5).groups
    publish(q, "A", a[0], group=fill(a[0].group))
    publish(q, "A", a[1], Place.REQUEUE)
    publish(q, "A", a[2], Place.DEAD, error="engine exploded")
    # Worker B: three done.
    for x in claim(q, "B", 3).groups:
        publish(q, "B", x, group=fill(x.group))
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

    server.kill()  # a process crash: with appendfsync always every acknowledged write is on disk
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


# -- a Redis restart under a running worker and trainer -------------------------------


def test_worker_and_trainer_ride_out_a_redis_restart(redis_factory, tmp_path):
    """Issue 8 #9: a 2 s restart of redis-server (from its AOF) under a live `rollout
    worker` and `rollout consume`: both reconnect, carry on, and the run ends with every
    group trained once and a clean audit."""
    from engines.simulator import SimConfig, start_simulator

    server = redis_factory("restart")
    c = connect(server.url)
    q = Queue(c, "ride")
    q.push_groups([Group.fresh(f"g{i}", f"What is {i} + 1?", 2, label=str(i + 1), row=i) for i in range(40)])
    sim = start_simulator(SimConfig(seed=7, decode_tokens_per_s=300.0, length_median=150, length_p99=300))
    env = dict(os.environ, PYTHONPATH=str(ROOT), ROLLOUT_REDIS_URL=server.url, ROLLOUT_NAMESPACE="ride")
    worker_log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([sys.executable, "-m", "cli", "-v", "worker", "--engine-url", sim.url,
                               "--concurrency", "16", "--max-new-tokens", "256"],
                              env=env, cwd=ROOT, stdout=worker_log, stderr=subprocess.STDOUT)
    trainer = subprocess.Popen([sys.executable, "-m", "cli", "consume", "--batch-size", "4", "--steps", "10",
                                "--json", "--timeout", "120"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: q.stats().get("committed", 0) >= 8, timeout=60, what="two batches trained")
        c.close()
        server.kill()
        time.sleep(2.0)  # the outage itself: nothing answers on the port for 2 s
        restarted = redis_factory(data_dir=server.data_dir, port=server.port)
        out, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, err
        assert worker.poll() is None, "the worker exited"
        batches = [json.loads(line) for line in out.splitlines()]
        trained = [gid for b in batches for gid in b["group_ids"]]
        assert len(batches) == 10 and sorted(trained) == sorted(f"g{i}" for i in range(40))
        c = connect(restarted.url)
        q = Queue(c, "ride")
        info = json.loads(next(iter(c.hgetall(q.keys.worker_info).values())))
        assert info["redis_outages"] >= 1  # status shows it
        worker.terminate()
        assert worker.wait(30) == 0
        report = assert_audit_ok(q)
        assert report.committed == 40
        log = (tmp_path / "worker.log").read_text()
        assert "Redis unreachable" in log and "Redis is back after" in log
    finally:
        for proc in (worker, trainer):
            if proc.poll() is None:
                proc.kill()
        worker_log.close()
        sim.stop()


def test_a_feeder_rides_out_a_redis_restart(redis_factory, tmp_path):
    """A feeder (`rollout push --max-queued`) runs for the whole training run: a 2 s
    restart of redis-server under it must not end it (as it did: "push stopped by a
    Redis error"). It waits, resumes from the cursor, and pushes every row once."""
    server = redis_factory("feeder")
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"input": f"What is {i} + 1?", "label": str(i + 1)}) + "\n"
                               for i in range(60)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), ROLLOUT_REDIS_URL=server.url, ROLLOUT_NAMESPACE="feed")
    feeder = subprocess.Popen([sys.executable, "-m", "cli", "push", str(dataset), "--max-queued", "10", "--json"],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    c = connect(server.url)
    q = Queue(c, "feed")
    taken: list[bytes] = []  # what a "worker" took off the prompt list, so the feeder keeps pushing
    try:
        wait_for(lambda: c.llen(q.keys.prompts) >= 10, timeout=30, what="the feeder filled the list")
        taken += c.lpop(q.keys.prompts, 5)
        wait_for(lambda: c.llen(q.keys.prompts) >= 10, timeout=30, what="the feeder topped the list up")
        c.close()
        server.kill()
        time.sleep(2.0)  # the outage itself: nothing answers on the port for 2 s
        restarted = redis_factory(data_dir=server.data_dir, port=server.port)
        c = connect(restarted.url)
        q = Queue(c, "feed")
        while feeder.poll() is None and len(taken) + c.llen(q.keys.prompts) < 60:
            taken += c.lpop(q.keys.prompts, 5) or []
            time.sleep(0.05)
        out, err = feeder.communicate(timeout=60)
        assert feeder.returncode == 0, err
        assert "Redis unreachable" in err and "Redis is back after" in err
        report = json.loads(out)
        assert report["pushed"] + report["already"] <= 60
        taken += c.lrange(q.keys.prompts, 0, -1)
        ids = [gid.decode() for gid in taken]
        assert sorted(ids) == sorted(f"rows.jsonl:0:{i}" for i in range(60))  # every row, each once
    finally:
        if feeder.poll() is None:
            feeder.kill()


# -- operators' views of a busy pipeline ------------------------------------------------


def test_the_audit_is_exact_on_a_busy_pipeline(redis_url, client, namespace):
    """Issue 8 #13: 100 audits while three workers claim, publish, requeue and a trainer
    commits: every one adds up (the old audit read place after place and reported groups
    missing or twice as they moved)."""
    from tests.helpers import WorkerThread
    from engines.simulator import SimConfig, start_simulator
    from workers.worker import SamplingSettings, WorkerSettings

    q = Queue(client, namespace)
    q.push_groups([Group.fresh(f"g{i}", f"What is {i} + 1?", 2, label=str(i + 1), row=i) for i in range(400)])
    sim = start_simulator(SimConfig(seed=9, decode_tokens_per_s=3000.0, length_median=32, length_p99=200))
    workers = [WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                           heartbeat_s=0.2, concurrency_per_engine=16,
                                           sampling=SamplingSettings(max_new_tokens=64))) for _ in range(3)]
    consumer = Consumer(connect(redis_url), namespace, block_s=0.05)
    stop = threading.Event()

    def train():
        while not stop.is_set():
            try:
                consumer.commit(consumer.next_batch(4, timeout=0.5))
            except BatchTimeout:
                pass

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    reports = []
    try:
        wait_for(lambda: q.stats().get("committed", 0) >= 8, what="the pipeline under way")
        for _ in range(100):
            reports.append(audit(q))
        moving = q.stats().get("committed", 0)
    finally:
        stop.set()
        trainer.join(10)
        for w in workers:
            w.stop()
        sim.stop()
    bad = [r.summary() for r in reports if not r.ok]
    assert not bad, bad[:3]
    assert reports[0].committed < moving  # it was busy while audited
    assert len({(r.prompts, r.committed) for r in reports}) > 10


def test_two_consume_processes_never_train_a_group_twice(redis_url, client, namespace, tmp_path):
    """Issue 8, done-when: a second `rollout consume` on the namespace fences the first,
    which stops with a clear error; no group is committed by both."""
    q = Queue(client, namespace)
    env = dict(os.environ, PYTHONPATH=str(ROOT), ROLLOUT_REDIS_URL=redis_url, ROLLOUT_NAMESPACE=namespace)
    q.push_groups([Group.fresh(f"g{i}", f"p{i}", 2, row=i) for i in range(80)])
    c = claim(q, "w", 80)
    for x in c.groups[:12]:
        publish(q, "w", x, group=fill(x.group))
    cmd = [sys.executable, "-m", "cli", "consume", "--batch-size", "4", "--steps", "10", "--json", "--timeout", "60"]
    first = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: q.stats().get("committed", 0) >= 8, what="the first trainer under way")
        second = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: client.hget(q.keys.trainer, "generation") == b"2", what="the second trainer's session")
        for x in c.groups[12:]:  # the rest arrives while both run
            publish(q, "w", x, group=fill(x.group))
        out1, err1 = first.communicate(timeout=60)
        out2, err2 = second.communicate(timeout=60)
    finally:
        for proc in (first,):
            if proc.poll() is None:
                proc.kill()
    assert first.returncode == 1 and "another trainer took over this namespace" in err1, err1
    assert second.returncode == 0, err2
    trained1 = [gid for line in out1.splitlines() for gid in json.loads(line)["group_ids"]]
    trained2 = [gid for line in out2.splitlines() for gid in json.loads(line)["group_ids"]]
    assert not set(trained1) & set(trained2) and len(trained2) == 40
    assert q.stats()["committed"] == len(trained1) + len(trained2)  # the fenced batch was redone, not doubled
    assert_audit_ok(q)
