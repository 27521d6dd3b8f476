# o7: `rollout audit` was one script over the whole namespace (~7 us per queued group):
# past the busy threshold every other client got BUSY, which was not transient, and
# workers and trainers exited. Correct: the audit of 150,000 queued groups (busy
# threshold lowered to 200 ms, i.e. the default 5 s with a namespace ~25x larger) holds
# the server only in short steps, and is right; a worker's publish and a trainer's batch
# during it succeed; a BUSY reply (a long script of someone else's) is waited out.
# Tests: tests/test_failover.py (paged audit tests, test_masterdown_clusterdown_and_busy_are_transient).
import logging
import threading
import time

from common import Consumer, Place, Queue, audit, busy, claim, connect, finish, produce, server
from pipeline.retry import Reconnect
from pipeline.types import Group

logging.disable(logging.CRITICAL)
N = 150_000
S = server()
try:
    admin = connect(S.url)
    admin.config_set("lua-time-limit", 200)  # busy-reply-threshold
    q = Queue(connect(S.url, socket_timeout=30), "o7")
    produce(q, 2, prefix="r")  # two results ready for the trainer
    q.push_groups([Group.fresh("held", "p", 2, row=0)])
    [held] = claim(q, "w#1", 1).groups
    for start in range(0, N, 5000):
        q.push_groups([Group.fresh(f"ds:0:{i}", "What is 1 + 1?", 4, row=i) for i in range(start, start + 5000)])
    consumer = Consumer(connect(S.url, socket_timeout=30), "o7", block_s=0.2)
    admin.config_set("slowlog-log-slower-than", 100_000)  # record every step of 100 ms or more
    admin.slowlog_reset()
    spent = {}

    def operator():
        t = time.monotonic()
        report = audit(Queue(connect(S.url, socket_timeout=60), "o7"))
        spent["audit"] = (time.monotonic() - t, report)

    t = threading.Thread(target=operator)
    t.start()
    worker = Reconnect("worker w#1")
    outcome = worker.call(q.publish_group, "w#1", finish(held.group), held.token, Place.RESULTS)
    batch = consumer.next_batch(2, timeout=20)  # r0, and the group published meanwhile
    t.join()
    print(f"audit of {N:,} queued groups: ok={spent['audit'][1].ok} ({spent['audit'][1].prompts:,} queued)")
    print(f"server steps of 100 ms or more meanwhile: {len(admin.slowlog_get(1000))}")
    print(f"worker publish during the audit: {outcome.value}; trainer next_batch: "
          f"{sorted(g.group_id for g in batch.groups)}; commit -> {consumer.commit(batch)}")
    spinning = busy(S.url, 1.0)  # someone else's long script: BUSY for everyone else
    batch = consumer.next_batch(1, timeout=30)
    spinning.join()
    print(f"next_batch while another script ran past the busy threshold: {[g.group_id for g in batch.groups]} "
          f"(waited out: {'BUSY' in consumer.reconnect.last_error})")
    consumer.commit(batch)
    print("audit:", audit(q).summary()[-60:])
finally:
    S.kill()
