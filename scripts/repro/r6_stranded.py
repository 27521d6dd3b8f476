# r6: a reward dict with numpy values (a common judge output). Correct: nothing is
# stranded in the live worker; every group is published or dead-lettered with the
# error, and the audit adds up. Test: tests/test_worker_faults.py (Issue 8 #3).
import logging

import numpy as np

from common import Group, Queue, audit, connect, server
from tests.helpers import WorkerThread, wait_for
from workers.rewards import Reward
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings

logging.basicConfig(level=logging.CRITICAL)


async def judge(args, sample):
    return {"score": np.float32(1.0), "format": np.float32(0.5)}


s = server(); ns = "r6"; c = connect(s.url); q = Queue(c, ns)
sim = start_simulator(SimConfig(seed=1, decode_tokens_per_s=20000.0, length_median=16, length_p99=64, prefill_s=0.001))
q.push_groups([Group.fresh(f"g{i}", f"What is {i} + 1?", 2, label=str(i + 1), row=i) for i in range(3)])
w = WorkerThread(WorkerSettings(redis_url=s.url, engine_urls=[sim.url], namespace=ns, reward_key="score",
                                heartbeat_s=0.2, sampling=SamplingSettings(max_new_tokens=32)),
                 reward=Reward(judge))
wait_for(lambda: c.xlen(q.keys.results) + c.xlen(q.keys.dead) == 3, timeout=30, what="every group out")
print("results/dead:", c.xlen(q.keys.results), c.xlen(q.keys.dead), "| worker state:", w.worker.state())
print("in-flight in Redis:", sorted(q.held(w.worker.id)))
print(audit(q).summary())
w.stop(); sim.stop(); s.stop()
