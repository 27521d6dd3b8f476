# r2: the same group id pushed twice. Correct: it is one copy (the push dedupes), so no
# settle of a duplicate can delete the payload of the copy being trained; the trainer
# gets it once. Tests: tests/test_scripts.py, tests/test_consumer.py (Issue 8 #2).
from common import Consumer, Group, audit, claim, connect, finish, publish, Queue, server

s = server(); c = connect(s.url); ns = "r2"
q = Queue(c, ns)
print("first push :", q.push_groups([Group.fresh("d:0:7", "p", 2, row=7)]), "group")
print("second push:", q.push_groups([Group.fresh("d:0:7", "p", 2, row=7)]), "groups (a duplicate id)")
g1 = claim(q, "wA", 1).groups[0]
print("second claim:", claim(q, "wB", 1).groups, "(nothing: one copy)")
print("publish:", publish(q, "wA", g1, group=finish(g1.group)).value)
t = Consumer(c, ns, block_s=0.1)
b = t.next_batch(1, timeout=2)
print("trained:", [g.group_id for g in b.groups], "commit ->", t.commit(b))
print(audit(q).summary())
s.stop()
