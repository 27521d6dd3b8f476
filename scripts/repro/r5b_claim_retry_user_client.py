# r5b: the same with a client built the ordinary way (redis.Redis(...)), which retries
# on its own, and the same for the trainer's read. Correct: the retried claim returns
# the same groups; the trainer's batch is exactly what it asked for and nothing else is
# left pending for it. Tests: tests/test_scripts.py (Issue 8 #4), tests/test_consumer.py.

import redis

from common import Consumer, Group, Queue, audit, busy, connect, produce, server
from pipeline.keys import CONSUMER_GROUP

s = server(); ns = "r5b"
admin = connect(s.url)
q0 = Queue(admin, ns); q0.push_groups([Group.fresh(f"g{i}", "p", 2, row=i) for i in range(5)])
q = Queue(redis.Redis(host="127.0.0.1", port=s.port, socket_timeout=0.2), ns)
q.register("W")
q.claim("W", "W:0", 0)
th = busy(s.url)
claim = q.claim("W", "W:1", 1); th.join()
print("worker was handed:", [x.group_id for x in claim.groups])
print("in-flight hash   :", sorted(q0.held("W")))
q0.leave("W")  # the worker goes: its group back to the prompts
produce(q0, 4, prefix="r")
t = Consumer(redis.Redis(host="127.0.0.1", port=s.port, socket_timeout=0.2), ns, block_s=0.05)
th = busy(s.url)
b = t.next_batch(1, timeout=5); th.join()
print("batch:", [g.group_id for g in b.groups], " pending:", admin.xpending(q0.keys.results, CONSUMER_GROUP)["pending"])
print("commit ->", t.commit(b)); print(audit(q0).summary())
s.stop()
