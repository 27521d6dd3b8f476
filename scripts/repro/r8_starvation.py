# r8: slow sync reward functions (a judge, sympy, a sandbox) on every sample. Correct:
# rewards run on a pool of their own, the heartbeat keeps the lease fresh, nothing is
# reaped and no publish is lost. Test: tests/test_worker_faults.py (Issue 8 #6).
import logging
import os
import time

from common import Group, Queue, connect, server
from pipeline.control import configure
from tests.helpers import WorkerThread
from workers.rewards import Reward
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings

logging.basicConfig(level=logging.CRITICAL)


def judge(args, sample):       # a sync judge, 0.5 s per sample
    time.sleep(0.5); return 1.0


print("cpus", os.cpu_count())
s = server(); ns = "r8"; c = connect(s.url); q = Queue(c, ns)
configure(c, q.keys, lease_s=3)
sim = start_simulator(SimConfig(seed=1, decode_tokens_per_s=20000.0, length_median=16, length_p99=64, prefill_s=0.001))
q.push_groups([Group.fresh(f"g{i}", f"What is {i} + 1?", 8, label=str(i + 1), row=i) for i in range(12)])
w = WorkerThread(WorkerSettings(redis_url=s.url, engine_urls=[sim.url], namespace=ns, heartbeat_s=0.5,
                                concurrency_per_engine=96, sampling=SamplingSettings(max_new_tokens=32)),
                 reward=Reward(judge))
other = Queue(connect(s.url), ns)   # another worker's reaper
t0 = time.time(); max_left = None
while time.time() - t0 < 10:
    now = q.now_ms(); deadline = c.zscore(q.keys.workers, w.worker.id)
    if deadline:  # the workers ZSET holds each lease's deadline
        left = (deadline - now) / 1000
        max_left = left if max_left is None else min(max_left, left)
    other.reap_expired(); time.sleep(0.2)
print(f"least lease left seen {max_left:.1f}s (lease 3 s); reaped: {q.stats().get('reaped', 0)}; "
      f"lost publishes: {w.worker.counters.groups_lost}")
w.stop(); sim.stop(); s.stop()
