# o1: a failover to a replica that missed the last trainer session start. Before, the
# next session got the same generation AND consumer name as the live one; both passed
# every fence and trained the same group. Correct: the new session has another identity,
# the older one's commit and reads are refused with SessionFenced, the group is trained
# once. Test: tests/test_consumer.py::test_a_session_lost_in_a_failover_is_fenced_by_the_next_one.
import logging

from common import Consumer, Forwarder, Queue, audit, connect, produce, replica_of, server, wait_replicated
from pipeline.consumer import SessionFenced

logging.disable(logging.CRITICAL)
P = server(); R = replica_of(P); fwd = Forwarder(P.port); ns = "o1"
try:
    q = Queue(connect(fwd.url, socket_timeout=5), ns); produce(q, 3)
    B = Consumer(connect(fwd.url, socket_timeout=5), ns, consumer="trainer", block_s=0.05)
    B.commit(B.next_batch(1, timeout=5))
    wait_replicated(connect(P.url), connect(R.url, read_only=True))
    connect(R.url, read_only=True).replicaof("NO", "ONE")  # the replica to be promoted stops receiving (partition, lag)
    A = Consumer(connect(fwd.url, socket_timeout=5), ns, consumer="trainer", block_s=0.05)
    a = A.next_batch(1, timeout=5)
    print(f"A: session {A.session.consumer} got {[g.group_id for g in a.groups]}; training ...")
    P.kill(); fwd.switch(R.port)  # failover: the promoted replica never saw A's session start or read
    C = Consumer(connect(fwd.url, socket_timeout=5), ns, consumer="trainer", block_s=0.05)
    c = C.next_batch(1, timeout=5)
    print(f"C: session {C.session.consumer} got {[g.group_id for g in c.groups]}")
    print("same generation:", A.session.generation == C.session.generation,
          "| same identity:", A.session.consumer == C.session.consumer)
    try:
        A.commit(a)
        print("A commit went through: WRONG")
    except SessionFenced as e:
        print("A commit refused:", e)
    try:
        A.next_batch(1, timeout=1)
        print("A read on: WRONG")
    except SessionFenced:
        print("A next_batch refused: SessionFenced")
    print("C commit ->", C.commit(c))
    print("audit:", audit(Queue(connect(fwd.url), ns)).summary())
finally:
    fwd.switch(None); P.kill(); R.kill()
