# r1: two trainer sessions overlap (rolling restart, two consumers). Correct: the newer
# session takes over the older one's batch, and the older one's commit is refused with
# SessionFenced; the batch is trained once. Test: tests/test_consumer.py (Issue 8 #1).
from common import Consumer, audit, connect, produce, Queue, server
from pipeline.consumer import SessionFenced

s = server(); c = connect(s.url); ns = "r1"
q = Queue(c, ns); produce(q, 6)
a = Consumer(c, ns, consumer="trainer-A", block_s=0.1)
ba = a.next_batch(3, timeout=5)                         # A is training on g0..g2
b = Consumer(c, ns, consumer="trainer-B", block_s=0.1)  # B starts (new pod) while A still runs
bb = b.next_batch(3, timeout=5)
print("A got", [g.group_id for g in ba.groups]); print("B got", [g.group_id for g in bb.groups])
try:
    a.commit(ba)
    print("A commit went through: WRONG")
except SessionFenced as e:
    print("A commit refused:", e)
print("B commit ->", b.commit(bb))
print("audit:", audit(q).summary())
s.stop()
