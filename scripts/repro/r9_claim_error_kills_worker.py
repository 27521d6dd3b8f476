# r9: one failed claim round trip (a failover, a reset connection). Correct: the worker
# retries with backoff and carries on; its generations go on. Test:
# tests/test_worker_faults.py (Issue 8 #4).
import logging

import redis

from common import Group, Queue, audit, connect, server

import pipeline.queue as pq  # noqa: E402 (common puts the project on sys.path)
from tests.helpers import WorkerThread, wait_for
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings

logging.basicConfig(level=logging.CRITICAL)
s = server(); ns = "r9"; c = connect(s.url); q = Queue(c, ns)
sim = start_simulator(SimConfig(seed=1, decode_tokens_per_s=50.0, length_median=200, length_p99=400, prefill_s=0.001))
q.push_groups([Group.fresh(f"g{i}", f"What is {i} + 1?", 2, label=str(i + 1), row=i) for i in range(40)])
orig = pq.Queue.claim; n = {"calls": 0}


def flaky(self, *a, **k):
    n["calls"] += 1
    if n["calls"] == 2:
        raise redis.ConnectionError("Connection reset by peer")
    return orig(self, *a, **k)


pq.Queue.claim = flaky
w = WorkerThread(WorkerSettings(redis_url=s.url, engine_urls=[sim.url], namespace=ns, concurrency_per_engine=8,
                                sampling=SamplingSettings(max_new_tokens=256)))
wait_for(lambda: n["calls"] >= 3, timeout=30, what="a claim after the failed one")
print("claims tried:", n["calls"], "| worker thread alive:", w._thread.is_alive(), "| error:", repr(w.error))
print("in flight now:", sum(audit(q).inflight.values()), "| prompts:", c.llen(q.keys.prompts))
w.stop(); sim.stop(); s.stop()
