"""Dynamic sampling: `next_batch(n, filter=...)` with real workers and rewards. Rejected
groups never reach a batch, batches stay exactly n, drops are counted by reason and
logged for the audit, and drops do not spend the staleness budget."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.ops.audit import audit
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.control import configure, read_control, set_weight_version
from pipeline.filters import DynamicFilterOutput
from pipeline.queue import Place, Queue
from pipeline.types import Group, Status
from tests.helpers import WorkerThread, wait_for
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings
from tests.groups import claim, publish

FAST = dict(decode_tokens_per_s=5000.0, length_median=32.0, length_p99=200.0, prefill_s=0.001)
REASON = "all rewards equal"  # the built-in "dapo" filter's reason


# -- the reward and filters the tests load by dotted path ------------------------------------


async def my_reward(args, samples):
    """Group reward (group_reward=True): all 1.0 for groups on an even row (no advantage
    signal: DAPO drops them), 0/1 alternating otherwise."""
    if samples[0].group_index % 2 == 0:
        return [1.0] * len(samples)
    return [float(i % 2) for i in range(len(samples))]


def keep_odd_rows(args, samples):
    """A legacy filter: a bare bool."""
    return samples[0].group_index % 2 == 1


def nonzero_std(args, samples):
    """slime's legacy check_reward_nonzero_std, with numpy in place of torch: the
    "bare bool" is a numpy.bool_, not a bool."""
    return np.array([s.reward for s in samples], dtype=float).std() > 0.0


def min_reward_sum(args, samples):
    total = sum(s.reward for s in samples)
    return DynamicFilterOutput(total >= args["min"], f"reward sum below {args['min']}")


# -- helpers ------------------------------------------------------------------------------


@pytest.fixture
def sim():
    handle = start_simulator(SimConfig(seed=30, **FAST))
    yield handle
    handle.stop()


def workers_for(redis_url, namespace, url, n=2) -> list[WorkerThread]:
    return [WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[url], namespace=namespace,
                                       reward="tests.test_dynamic_filter:my_reward", group_reward=True,
                                       concurrency_per_engine=16, heartbeat_s=0.2,
                                       sampling=SamplingSettings(max_new_tokens=64)))
            for _ in range(n)]


def push(queue: Queue, n: int, samples: int = 4) -> list[str]:
    groups = [Group.fresh(f"g{i}", f"What is {i} + 1?", samples, label=str(i + 1), row=i) for i in range(n)]
    queue.push_groups(groups)
    return [g.group_id for g in groups]


def even(gid: str) -> bool:
    return int(gid[1:]) % 2 == 0


def dropped_log(queue: Queue) -> list[tuple[str, str]]:
    return [(f[b"gid"].decode(), f[b"reason"].decode()) for _, f in queue.redis.xrange(queue.keys.dropped)]


# -- with workers ------------------------------------------------------------------------------


@pytest.mark.slow
def test_dapo_filter_with_workers(redis_url, queue, namespace, sim):
    ids = push(queue, 24)
    workers = workers_for(redis_url, namespace, sim.url)
    consumer = Consumer(queue.redis, namespace, filter="dapo", block_s=0.2)
    kept: list[Group] = []
    dropped_in_metrics = 0
    try:
        for _ in range(3):
            b = consumer.next_batch(4, timeout=30)
            assert len(b) == 4 and b.metrics.kept == 4
            assert not any(even(g.group_id) for g in b.groups)
            for g in b.groups:
                assert len({s.reward for s in g.samples}) > 1
            assert set(b.metrics.dropped) <= {REASON}
            n_dropped = b.metrics.dropped.get(REASON, 0)
            assert b.metrics.drop_ratio == pytest.approx(n_dropped / (n_dropped + 4))
            dropped_in_metrics += n_dropped
            kept += b.groups
            consumer.commit(b)
        # Everything generated: the rest of the stream is all-equal groups, dropped too.
        wait_for(lambda: queue.stats().get("results", 0) == 24, what="all 24 groups published")
        with pytest.raises(BatchTimeout):
            consumer.next_batch(1, timeout=0.5)
    finally:
        for w in workers:
            w.stop()
    assert sorted(g.group_id for g in kept) == sorted(i for i in ids if not even(i))
    log = dropped_log(queue)
    assert sorted(gid for gid, _ in log) == sorted(i for i in ids if even(i))
    assert {reason for _, reason in log} == {REASON}
    assert 0 < dropped_in_metrics <= 12
    report = audit(queue)
    assert report.ok and (report.dropped, report.committed) == (12, 12), report.summary()


@pytest.mark.slow
def test_filter_drops_do_not_spend_the_staleness_budget(redis_url, queue, namespace, sim):
    """η = 0, B = 4, half the groups dropped by the filter: every step still gets 4 kept
    groups, all generated at the trainer's version. (With a counter of first claims the
    budget of 4 per version went to groups that were then dropped, and next_batch waited
    forever.)"""
    batch = 4
    configure(queue.redis, queue.keys, max_staleness=0, batch_size=batch)
    push(queue, 40)
    workers = workers_for(redis_url, namespace, sim.url)
    consumer = Consumer(queue.redis, namespace, filter="dapo", block_s=0.2)
    try:
        for version in range(3):
            b = consumer.next_batch(batch, timeout=20)
            assert len(b) == batch and not any(even(g.group_id) for g in b.groups)
            assert b.metrics.dropped.get(REASON, 0) >= 1
            assert b.metrics.staleness == {0: batch}
            assert all(g.admitted_version == version for g in b.groups)
            consumer.commit(b)
            assert read_control(queue.redis, queue.keys).admitted <= (version + 1) * batch
            sim.call(setattr, sim.server.engine, "weight_version", str(version + 1))
            set_weight_version(queue.redis, queue.keys, version + 1)
    finally:
        for w in workers:
            w.stop()
    report = audit(queue)
    assert report.ok and report.committed == 3 * batch, report.summary()


# -- filter forms, on planted groups --------------------------------------------------------------


def plant(queue: Queue, n: int, rewards) -> None:
    """Push n groups and publish each as generated, group i with rewards(i)."""
    groups = [Group.fresh(f"g{i}", f"p{i}", 2, row=i) for i in range(n)]
    queue.push_groups(groups)
    for c in claim(queue, "planter", n).groups:
        g = c.group
        g.prompt_ids = [1]
        for s, r in zip(g.samples, rewards(g.row)):
            s.tokens, s.response_length, s.rollout_log_probs = [1, 7], 1, [-0.2]
            s.weight_versions, s.reward, s.status = ["default"], r, Status.COMPLETED
        publish(queue, "planter", g, Place.RESULTS)


@pytest.mark.parametrize("spec", [keep_odd_rows, "tests.test_dynamic_filter:keep_odd_rows",
                                  "tests.test_dynamic_filter.keep_odd_rows",
                                  lambda args, samples: np.bool_(samples[0].group_index % 2)])
def test_bare_bool_filter_as_callable_or_dotted_path(queue, client, namespace, spec):
    plant(queue, 8, lambda row: [0.0, 1.0])
    consumer = Consumer(client, namespace, filter=spec, block_s=0.1)
    b1 = consumer.next_batch(2, timeout=5)
    b2 = consumer.next_batch(2, timeout=5)
    assert [g.group_id for g in b1.groups + b2.groups] == ["g1", "g3", "g5", "g7"]
    assert b1.metrics.dropped == {"filtered": 2} and b2.metrics.dropped == {"filtered": 2}
    assert dropped_log(queue) == [("g0", "filtered"), ("g2", "filtered"), ("g4", "filtered"), ("g6", "filtered")]
    consumer.commit(b1)
    consumer.commit(b2)
    report = audit(queue)
    assert report.ok and (report.dropped, report.committed) == (4, 4), report.summary()


def test_dotted_path_filter_with_reason_and_args(queue, client, namespace):
    plant(queue, 6, lambda row: [float(row), 1.0])  # sums 1, 2, 3, 4, 5, 6
    consumer = Consumer(client, namespace, filter="tests.test_dynamic_filter:min_reward_sum",
                        filter_args={"min": 4}, block_s=0.1)
    b = consumer.next_batch(3, timeout=5)
    assert [g.group_id for g in b.groups] == ["g3", "g4", "g5"]
    assert b.metrics.dropped == {"reward sum below 4": 3} and b.metrics.drop_ratio == 0.5
    assert [gid for gid, _ in dropped_log(queue)] == ["g0", "g1", "g2"]


def test_dapo_with_dict_rewards_and_reward_key(queue, client, namespace):
    plant(queue, 4, lambda row: [{"acc": 1.0, "len": float(row)}, {"acc": float(row % 2), "len": 0.0}])
    # by "acc": g0 (1, 0) and g2 (1, 0) vary, g1 and g3 (1, 1) are all equal
    consumer = Consumer(client, namespace, filter="dapo", filter_args=type("A", (), {"reward_key": "acc"})(),
                        block_s=0.1)
    b = consumer.next_batch(2, timeout=5)
    assert [g.group_id for g in b.groups] == ["g0", "g2"] and b.metrics.dropped == {REASON: 1}  # g1
    with pytest.raises(BatchTimeout):
        consumer.next_batch(1, timeout=0.2)  # g3 is dropped as well
    assert [gid for gid, _ in dropped_log(queue)] == ["g1", "g3"]


def test_legacy_array_bool_filter(queue, client, namespace):
    plant(queue, 4, lambda row: [1.0, 1.0] if row % 2 else [0.0, 1.0])
    consumer = Consumer(client, namespace, filter="tests.test_dynamic_filter:nonzero_std", block_s=0.1)
    b = consumer.next_batch(2, timeout=5)
    assert [g.group_id for g in b.groups] == ["g0", "g2"] and b.metrics.dropped == {"filtered": 1}
