# o8: a Redis restart longer than the lease reaped every live worker when Redis came
# back (deadlines are server time; the clock ran on while nobody could renew): in-flight
# generation cancelled, every group charged a claim, twice over two outages. Correct: the
# first heartbeat or reap after the silence gives every worker a lease to renew; the live
# worker is never reaped, and no group is charged for the outages.
# Tests: tests/test_failover.py (test_the_first_reap_after_a_long_silence_..., test_a_restart_longer_than_...).
import asyncio
import logging
import tempfile
import threading
import time

from common import Queue, audit, connect
from engines.simulator import SimConfig, start_simulator
from pipeline.control import configure
from pipeline.queue import text
from pipeline.redis_server import RedisServer, free_port
from pipeline.types import Group
from tests.helpers import outage, wait_for
from workers.worker import Worker, WorkerSettings

logging.disable(logging.CRITICAL)
LEASE_S, OUTAGE_S = 3.0, 5.0
S = RedisServer(tempfile.mkdtemp(prefix="repro-redis-"), port=free_port())  # AOF, fsync always
S.start()
state = {}
try:
    q = Queue(connect(S.url, socket_timeout=5), "o8")
    configure(q.redis, q.keys, lease_s=LEASE_S)
    q.push_groups([Group.fresh(f"g{i}", "What is 1 + 1?", 2, label="2", row=i) for i in range(200)])
    sim = start_simulator(SimConfig(length_median=400, length_p99=800, decode_tokens_per_s=40))

    def run_worker():
        async def main():
            state["w"] = Worker(WorkerSettings(redis_url=S.url, engine_urls=[sim.url], namespace="o8",
                                               concurrency_per_engine=8, reward="exact_match", serve_eval=False,
                                               heartbeat_s=0.5))
            await state["w"].run()
        asyncio.run(main())

    threading.Thread(target=run_worker, daemon=True).start()
    wait_for(lambda: q.redis.hlen(q.keys.claims) > 0, what="groups in flight")
    for n in (1, 2):
        held = {text(g) for w in q.redis.zrange(q.keys.workers, 0, -1) for g in q.redis.hkeys(q.keys.inflight(text(w)))}
        t0 = time.monotonic()
        outage(S, lambda: time.monotonic() - t0 >= OUTAGE_S).join()
        # Redis is back: another process's upkeep (a second worker's maintenance loop, the trainer) runs first.
        reaped = Queue(connect(S.url, socket_timeout=5), "o8").reap_expired()
        print(f"outage {n}: {len(held)} groups in flight, Redis down {OUTAGE_S:g}s (lease {LEASE_S:g}s); "
              f"another process's reap_expired() right after -> {reaped}")
    wait_for(lambda: state["w"].ctx.reconnect.down is False, what="the worker reconnected")
    claims = sorted({int(c) for c in q.redis.hvals(q.keys.claims)})
    w = state["w"]
    print(f"worker reincarnations: {w.counters.reincarnations}; claims per group in flight: {claims}")
    w.stop()
    print("audit:", audit(q).summary()[-40:])
finally:
    S.kill()
