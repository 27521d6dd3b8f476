# o6: a failover leaves clients on the demoted primary (now a replica) for a while; every
# write answers READONLY, which redis-py raises as ReadOnlyError without the code in its
# text. Before, it was taken as permanent: the worker's publish and the trainer's
# next_batch raised. Correct: both wait the failover out (3 s here) and carry on.
# Test: tests/test_failover.py::test_a_publish_and_a_batch_wait_out_a_demoted_primary.
import logging
import threading
import time

from common import Consumer, Forwarder, Place, Queue, audit, claim, connect, finish, produce, replica_of, server
from pipeline.retry import Reconnect
from pipeline.types import Group

logging.disable(logging.CRITICAL)
P = server(); R = replica_of(P); fwd = Forwarder(P.port); ns = "o6"
try:
    q = Queue(connect(fwd.url, socket_timeout=5), ns)
    produce(q, 1, prefix="r")  # one result ready for the trainer
    q.push_groups([Group.fresh("g0", "p", 2, row=0)])
    [held] = claim(q, "w#1", 1).groups
    consumer = Consumer(connect(fwd.url, socket_timeout=5), ns, block_s=0.2)
    # Failover: R becomes the primary, P a replica of R; the address reaches P for 3 s more.
    connect(R.url, read_only=True).replicaof("NO", "ONE"); connect(P.url).replicaof("127.0.0.1", R.port)
    threading.Timer(3.0, lambda: fwd.switch(R.port)).start()
    t0 = time.monotonic()
    worker = Reconnect("worker w#1")
    outcome = worker.call(q.publish_group, "w#1", finish(held.group), held.token, Place.RESULTS)
    print(f"worker publish: {outcome.value} after {time.monotonic() - t0:.1f}s (waited out: {worker.last_error[:40]})")
    batch = consumer.next_batch(2, timeout=30)
    print(f"trainer next_batch: got {sorted(g.group_id for g in batch.groups)}")
    print("commit ->", consumer.commit(batch))
    print("audit:", audit(Queue(connect(fwd.url), ns)).summary())
finally:
    fwd.switch(None); P.kill(); R.kill()
