# o4: trainer-side calls outside Reconnect (Consumer._reap and diagnose, the slime
# adapter, every Controller call) crashed on a Redis outage. Correct: a Consumer waiting
# for a batch and slime's data source asking for the next rollout wait out a 4 s outage
# (AOF always: nothing acknowledged is lost) and carry on; past the stated limit
# (TRAINER_OUTAGE_LIMIT_S) they raise RedisUnavailable.
# Tests: tests/test_failover.py (test_next_batch_rides_out_..., test_the_slime_data_source_...).
import logging
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

from common import Consumer, Queue, audit, connect, produce
from pipeline.redis_server import RedisServer, free_port
from tests.helpers import outage

logging.disable(logging.CRITICAL)
OUTAGE_S = 4.0

S = RedisServer(tempfile.mkdtemp(prefix="repro-redis-"), port=free_port())  # AOF, fsync always
S.start()
try:
    admin = Queue(connect(S.url), "o4")
    consumer = Consumer(connect(S.url, socket_timeout=5), "o4", block_s=0.5)
    read, fired = consumer._scripts["read"], []

    def read_then_outage(*args, **kwargs):
        reply = read(*args, **kwargs)
        if not fired:  # Redis goes away right after answering this read (nothing ready)
            fired.append(time.monotonic())
            back = outage(S, lambda: time.monotonic() - fired[0] >= OUTAGE_S)
            threading.Thread(target=lambda: (back.join(), produce(Queue(connect(S.url), "o4"), 1, prefix="a")),
                             daemon=True).start()
        return reply

    consumer._scripts["read"] = read_then_outage
    batch = consumer.next_batch(1, timeout=60)
    print(f"case A (Consumer.next_batch, {OUTAGE_S:g}s outage right after a read): got "
          f"{[g.group_id for g in batch.groups]}")
    consumer.commit(batch)

    class _MP:  # what fake_slime.install needs of pytest's monkeypatch
        @staticmethod
        def setitem(d, k, v):
            d[k] = v

        @staticmethod
        def setattr(obj, name, value):
            setattr(obj, name, value)

    sys.modules["slime"] = None
    from tests import fake_slime  # noqa: E402
    fake_slime.install(_MP())
    from pipeline.trainers import slime_adapter as sa  # noqa: E402
    from pipeline.trainers import slime_types as st  # noqa: E402
    from tests.slime_helpers import publish_results  # noqa: E402
    st.slime_types.cache_clear()
    q = Queue(admin.redis, "o4s")
    publish_results(q, [0, 1])
    args = SimpleNamespace(rollout_batch_size=1, n_samples_per_prompt=2, rollout_redis_url=S.url,
                           rollout_namespace="o4s", reward_key=None, rollout_max_response_len=64)
    source = sa.RedisDataSource(args)
    source.get_samples(1)
    t0 = time.monotonic()
    outage(S, lambda: time.monotonic() - t0 >= OUTAGE_S)
    second = source.get_samples(1)
    print(f"case B (RedisDataSource.get_samples during a {OUTAGE_S:g}s outage): got {len(second)} group after "
          f"waiting it out ({source.consumer.reconnect.outages} outage)")
    source.commit_pending()
    print("audit o4:", audit(Queue(connect(S.url), "o4")).summary())
    print("audit o4s:", audit(Queue(connect(S.url), "o4s")).summary())
finally:
    S.kill()
