# r5: the claim script ran but its reply was lost (the client timed out while Redis was
# busy); the caller retries. Correct: the retry presents the same claim id and gets the
# same groups; nothing else is held. Tests: tests/test_scripts.py,
# tests/test_worker_faults.py (Issue 8 #4).
import time

import redis

from common import Group, Queue, audit, busy, connect, server

s = server(); ns = "r5"
admin = connect(s.url)
q0 = Queue(admin, ns); q0.push_groups([Group.fresh(f"g{i}", "p", 2, row=i) for i in range(5)])
q = Queue(connect(s.url, socket_timeout=0.2), ns)
q.register("W")
q.claim("W", "W:0", 0)  # load the script
th = busy(s.url)
claim = None
while claim is None:   # what the worker's Reconnect does: the same call again
    try:
        claim = q.claim("W", "W:1", 1)
    except (redis.TimeoutError, redis.ConnectionError) as e:
        print("claim reply lost:", type(e).__name__, "-> retried with the same claim id")
        time.sleep(0.2)
th.join()
print("worker was handed:", [x.group_id for x in claim.groups])
print("in-flight hash   :", sorted(q0.held("W")))
print(audit(q0).summary())
s.stop()
