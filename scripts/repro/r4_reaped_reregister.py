# r4: a worker stalls past its lease and is reaped. Correct: its next claim is refused
# (claims never register), its heartbeat says it was reaped, its old claim's publish is
# refused by the token, and it registers anew as another incarnation.
# Tests: tests/test_scripts.py, tests/test_worker_faults.py (Issue 8 #5).
import time

from common import Group, Place, Queue, connect, finish, server
from pipeline.control import configure

s = server(); c = connect(s.url); ns = "r4"
q = Queue(c, ns)
configure(c, q.keys, lease_s=1.0)                 # no shorter than the upkeep period
q.push_groups([Group.fresh(f"g{i}", "p", 2, row=i) for i in range(3)])
q.register("W")
first = q.claim("W", "W:1", 1).groups[0]           # task T1 starts on g0
time.sleep(1.1)                                     # W stalls (GC, partition) past the lease
print("reaped:", q.reap_expired())
second = q.claim("W", "W:2", 1)                    # W's claim loop wakes first
print("claim after the reap:", second.status.value, [x.group_id for x in second.groups])
print("heartbeat says reaped:", q.heartbeat("W", "{}").reaped)
print("T1 publish (old token):", q.publish_group("W", finish(first.group), first.token, Place.RESULTS).value)
q.register("W#2")                                   # the same process, a new incarnation
again = q.claim("W#2", "W#2:1", 1).groups[0]
print("W#2 claims", again.group_id, "-> publish:",
      q.publish_group("W#2", finish(again.group), again.token, Place.RESULTS).value)
s.stop()
