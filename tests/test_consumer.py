"""The trainer's consumer: exact batches, surplus left undelivered, sessions fenced by
an id never reissued, recovery of an uncommitted batch, hand-back of a failed one, deduplication,
filters, staleness and timeout diagnostics."""
from __future__ import annotations

import json
import threading
import time

import pytest

from pipeline.ops.audit import audit
from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer, SessionFenced
from pipeline.control import configure, set_paused, set_weight_version
from pipeline.filters import DynamicFilterOutput
from pipeline.keys import CONSUMER_GROUP
from pipeline.queue import Place, Queue
from tests.groups import assert_audit_ok, claim, finish, fresh, produce, publish
from tests.helpers import LoseReplies


@pytest.fixture
def consumer(client, namespace):
    return Consumer(client, namespace, block_s=0.2)


# -- exactness ------------------------------------------------------------------------


def test_exact_batch_leaves_surplus_undelivered(queue, consumer):
    gids = produce(queue, 10)
    batch = consumer.next_batch(4, timeout=5)
    assert len(batch) == 4 and len(batch.entry_ids) == 4 and batch.batch_id == f"{consumer.session.consumer}/1"
    assert [g.group_id for g in batch.groups] == gids[:4]
    k = queue.keys
    pending = queue.redis.xpending(k.results, CONSUMER_GROUP)
    assert pending["pending"] == 4
    [info] = queue.redis.xinfo_groups(k.results)
    assert info["pending"] == 4
    assert info["last-delivered-id"].decode() == batch.entry_ids[-1]  # nothing past the batch was read
    assert queue.redis.xlen(k.results) == 10
    report = assert_audit_ok(queue)
    assert (report.results_undelivered, report.results_pending) == (6, 4)

    assert consumer.commit(batch) == 4
    assert queue.redis.xlen(k.results) == 6
    assert queue.redis.xpending(k.results, CONSUMER_GROUP)["pending"] == 0
    batch2 = consumer.next_batch(6, timeout=5)
    assert [g.group_id for g in batch2.groups] == gids[4:]
    consumer.commit(batch2)
    report = assert_audit_ok(queue)
    assert report.committed == 10 and queue.redis.xlen(k.results) == 0


def test_batch_groups_are_decoded_and_versioned(queue, consumer):
    set_weight_version(queue.redis, queue.keys, 3)
    produce(queue, 2, version=2)
    batch = consumer.next_batch(2, timeout=5)
    assert batch.weight_version == 3
    assert batch.groups[0].samples[1].tokens == [1, 2, 101, 101, 101]
    assert batch.metrics.kept == 2 and batch.metrics.staleness == {1: 2}


def test_batch_waits_for_groups_that_arrive_later(queue, consumer):
    produce(queue, 1)
    queue.push_groups(fresh(2, "late"))

    waiting = threading.Event()
    real_wait = consumer._wait_for_new

    def wait(*args, **kwargs):  # the consumer is blocked: now the groups arrive
        waiting.set()
        return real_wait(*args, **kwargs)

    def later():
        waiting.wait(10)
        for c in claim(queue, "w2", 2).groups:
            publish(queue, "w2", c, group=finish(c.group))

    consumer._wait_for_new = wait
    t = threading.Thread(target=later)
    t.start()
    batch = consumer.next_batch(3, timeout=10)
    t.join()
    assert waiting.is_set()
    assert [g.group_id for g in batch.groups] == ["g0", "late0", "late1"]


def test_zero_timeout_takes_groups_that_are_there(queue, consumer):
    produce(queue, 3)
    batch = consumer.next_batch(2, timeout=0)  # a poll: no waiting, but no false timeout either
    assert [g.group_id for g in batch.groups] == ["g0", "g1"]
    with pytest.raises(BatchTimeout, match="with 1 of 2 groups"):
        consumer.next_batch(2, timeout=0)
    assert [g.group_id for g in consumer.next_batch(1, timeout=0).groups] == ["g2"]


def test_invalid_arguments(client, namespace):
    c = Consumer(client, namespace)
    with pytest.raises(ValueError):
        c.next_batch(0)
    with pytest.raises(ValueError, match="stale_policy"):
        Consumer(client, namespace, stale_policy="ignore")


def test_batch_size_must_be_the_one_admission_is_paced_for(queue, consumer):
    """Issue 8 #15: pacing counts in batches of B; asking for another size would stop
    admission for good without an error."""
    configure(queue.redis, queue.keys, max_staleness=1, batch_size=4)
    with pytest.raises(ValueError, match=r"next_batch\(3\) but the namespace paces admission for batches of 4"):
        consumer.next_batch(3, timeout=1)
    produce(queue, 4)
    assert len(consumer.next_batch(4, timeout=5)) == 4


# -- recovery -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["trainer", "trainer-2"])
def test_uncommitted_batch_is_redelivered_first(queue, client, namespace, name):
    produce(queue, 8)
    first = Consumer(client, namespace, consumer="trainer", block_s=0.2)
    batch = first.next_batch(3, timeout=5)
    delivered = [g.group_id for g in batch.groups]
    del first  # the trainer died mid-step: nothing committed

    again = Consumer(client, namespace, consumer=name, block_s=0.2)
    b2 = again.next_batch(3, timeout=5)
    assert [g.group_id for g in b2.groups] == delivered
    pending = queue.redis.xpending(queue.keys.results, CONSUMER_GROUP)
    assert {c["name"].decode() for c in pending["consumers"]} == {again.session.consumer}
    assert again.session.consumer == f"{name}.2-{again.session.id}"
    again.commit(b2)
    b3 = again.next_batch(5, timeout=5)
    assert [g.group_id for g in b3.groups] == [f"g{i}" for i in range(3, 8)]
    again.commit(b3)
    report = assert_audit_ok(queue)
    assert report.committed == 8
    assert queue.stats().get("duplicates", 0) == 0


def test_recovered_surplus_is_kept_for_the_next_batch(queue, client, namespace):
    produce(queue, 6)
    first = Consumer(client, namespace, block_s=0.2)
    b = first.next_batch(4, timeout=5)
    del first
    again = Consumer(client, namespace, block_s=0.2)
    b1 = again.next_batch(2, timeout=5)
    b2 = again.next_batch(3, timeout=5)
    assert [g.group_id for g in b1.groups + b2.groups] == [g.group_id for g in b.groups] + ["g4"]
    again.commit(b1)
    again.commit(b2)
    assert queue.redis.xlen(queue.keys.results) == 1
    assert_audit_ok(queue)


def test_two_trainer_sessions_never_train_a_group_twice(queue, client, namespace):
    """Issue 8 #1 (r1): a second trainer starts while the first holds a batch. The new
    session fences the old one: the old one's commit and reads fail naming the new one,
    and the batch is the new session's to train and commit."""
    produce(queue, 6)
    a = Consumer(client, namespace, consumer="trainer-A", block_s=0.1)
    batch_a = a.next_batch(3, timeout=5)
    b = Consumer(client, namespace, consumer="trainer-B", block_s=0.1)
    batch_b = b.next_batch(3, timeout=5)
    assert [g.group_id for g in batch_b.groups] == [g.group_id for g in batch_a.groups]
    with pytest.raises(SessionFenced, match=r"trainer-A\.1-[0-9a-f]+ was replaced by session trainer-B\.2-"):
        a.commit(batch_a)
    with pytest.raises(SessionFenced):
        a.next_batch(3, timeout=1)
    assert b.commit(batch_b) == 3
    assert [g.group_id for g in b.next_batch(3, timeout=5).groups] == ["g3", "g4", "g5"]
    report = assert_audit_ok(queue)
    assert report.committed == 3 and queue.stats().get("duplicates", 0) == 0


def test_a_fenced_session_cannot_take_new_entries(queue, client, namespace):
    produce(queue, 2)
    a = Consumer(client, namespace, consumer="A", block_s=0.1)
    a.next_batch(1, timeout=5)
    b = Consumer(client, namespace, consumer="B", block_s=0.1)
    b.next_batch(1, timeout=5)
    produce(queue, 2, prefix="n")
    with pytest.raises(SessionFenced):
        a.next_batch(1, timeout=2)
    pending = queue.redis.xpending(queue.keys.results, CONSUMER_GROUP)
    assert {c["name"].decode() for c in pending["consumers"]} == {b.session.consumer}


def test_a_fenced_session_does_not_hand_out_groups_it_read_before_the_fence(queue, client, namespace):
    """Found by the conservation machine: a session's batch timed out with one group read
    (held in its memory for the next call); a newer session took that group over. The old
    session's next call must not hand the held group out without asking Redis."""
    produce(queue, 1)
    a = Consumer(client, namespace, consumer="A", block_s=0.01)
    with pytest.raises(BatchTimeout):
        a.next_batch(2, timeout=0.05)
    b = Consumer(client, namespace, consumer="B", block_s=0.01)
    batch = b.next_batch(1, timeout=5)
    assert [g.group_id for g in batch.groups] == ["g0"]
    with pytest.raises(SessionFenced, match=r"A\.1-[0-9a-f]+ was replaced by session B\.2-"):
        a.next_batch(1, timeout=1)
    assert b.commit(batch) == 1
    assert assert_audit_ok(queue).committed == 1


def test_a_session_lost_in_a_failover_is_fenced_by_the_next_one(queue, client, namespace):
    """Issue 21 o1: a failover to a replica that missed session A's start and read rolls
    the trainer hash and the stream back. The next session gets A's generation number
    again, but not A's identity: A's commit and reads are refused, and the group both
    were delivered is trained by the new session alone."""
    produce(queue, 3)
    k = queue.keys
    b = Consumer(client, namespace, consumer="trainer", block_s=0.05)
    assert b.commit(b.next_batch(1, timeout=5)) == 1
    # What the replica that will be promoted holds: everything up to here.
    replica = {key: client.dump(key) for key in (k.trainer, k.results)}
    a = Consumer(client, namespace, consumer="trainer", block_s=0.05)
    batch_a = a.next_batch(1, timeout=5)
    for key, dumped in replica.items():  # the failover: A's writes are gone
        client.restore(key, 0, dumped, replace=True)
    c = Consumer(client, namespace, consumer="trainer", block_s=0.05)
    batch_c = c.next_batch(1, timeout=5)
    assert c.session.generation == a.session.generation  # the counter was rolled back ...
    assert c.session.consumer != a.session.consumer  # ... the identity was not
    assert [g.group_id for g in batch_c.groups] == [g.group_id for g in batch_a.groups] == ["g1"]
    with pytest.raises(SessionFenced, match=f"{a.session.consumer} was replaced by session {c.session.consumer}"):
        a.commit(batch_a)
    with pytest.raises(SessionFenced):
        a.next_batch(1, timeout=1)
    assert c.commit(batch_c) == 1
    assert assert_audit_ok(queue).committed == 2


def test_a_retried_session_start_finds_its_own_session(queue, client, namespace):
    """The session script ran, its reply was lost: the retry (same session id) returns
    the session it started instead of starting another."""
    produce(queue, 1)
    a = Consumer(client, namespace, consumer="trainer", block_s=0.05)
    a._scripts["session"] = LoseReplies(a._scripts["session"], armed=1)
    batch = a.next_batch(1, timeout=5)
    assert a.session.generation == 1 and client.hget(queue.keys.trainer, "generation") == b"1"
    assert a.commit(batch) == 1
    assert_audit_ok(queue)


def test_lost_read_reply_strands_nothing(queue, consumer):
    """The read ran (entries delivered to the session), its reply was lost; the retry
    reads on, and the session notices the entries it does not know and takes them."""
    produce(queue, 5)
    read = consumer._scripts["read"] = LoseReplies(consumer._scripts["read"], armed=1)
    batch = consumer.next_batch(3, timeout=5)
    assert len(batch) == 3 and not read.armed
    more = consumer.next_batch(2, timeout=5)
    assert sorted(g.group_id for g in batch.groups + more.groups) == [f"g{i}" for i in range(5)]
    consumer.commit(batch)
    consumer.commit(more)
    assert queue.redis.xpending(queue.keys.results, CONSUMER_GROUP)["pending"] == 0
    assert assert_audit_ok(queue).committed == 5


def test_lost_commit_reply_then_retry_is_done_once(queue, consumer):
    produce(queue, 2)
    batch = consumer.next_batch(2, timeout=5)
    settle = consumer.writer._scripts["settle"] = LoseReplies(consumer.writer._scripts["settle"], armed=1)
    assert consumer.commit(batch) == 2 and not settle.armed
    assert queue.stats()["committed"] == 2
    assert_audit_ok(queue)


def test_a_lost_settle_reply_is_retried_even_when_the_wait_is_over(queue, client, namespace):
    """Found by the conservation test under load: next_batch's timeout had run out when
    the reply to a settle made while screening (a DAPO drop) was lost, and next_batch
    failed with RedisUnavailable instead of finishing: one lost reply always gets a retry."""
    c = Consumer(client, namespace, filter="dapo", block_s=0.1)
    produce(queue, 1, prefix="flat", rewards=[0.0, 0.0])
    produce(queue, 1, prefix="k", rewards=[0.0, 2.0])
    settle = c.writer._scripts["settle"] = LoseReplies(c.writer._scripts["settle"], armed=1)
    try:
        batch = c.next_batch(1, timeout=0)  # the wait is over before the settle's reply is lost
    except BatchTimeout:  # what was screened stays screened; the next call goes on
        batch = c.next_batch(1, timeout=5)
    assert not settle.armed and [e.group_id for e in queue.read_stream(queue.keys.dropped)] == ["flat0"]
    assert [g.group_id for g in batch.groups] == ["k0"]
    c.commit(batch)
    assert_audit_ok(queue)


def test_released_batch_comes_first_and_a_poison_batch_ends_in_dead_letters(queue, client, namespace):
    """Issue 8 #12: a step that failed hands its batch back; one that keeps failing
    (it crashes the trainer) is dead-lettered after max_deliveries."""
    produce(queue, 4)
    c = Consumer(client, namespace, block_s=0.1, max_deliveries=3)
    first = c.next_batch(2, timeout=5)
    c.release(first, "CUDA OOM")
    again = c.next_batch(2, timeout=5)
    assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups]
    c.release(again)  # delivered 3 times now: still within max_deliveries
    third = c.next_batch(2, timeout=5)
    assert [g.group_id for g in third.groups] == ["g0", "g1"]
    c.release(third)  # the fourth delivery is one too many
    fourth = c.next_batch(2, timeout=5)
    assert [g.group_id for g in fourth.groups] == ["g2", "g3"]
    dead = queue.read_stream(queue.keys.dead)
    assert [d.group_id for d in dead] == ["g0", "g1"]
    assert dead[0].error.startswith("delivered 4 times to the trainer without a commit")
    c.commit(fourth)
    assert_audit_ok(queue)


def test_a_batch_that_crashes_trainers_ends_in_dead_letters(queue, client, namespace):
    produce(queue, 2)
    for _ in range(2):  # each session dies holding the batch: two deliveries
        Consumer(client, namespace, block_s=0.1, max_deliveries=2).next_batch(2, timeout=5)
    with pytest.raises(BatchTimeout):  # a third would be one too many
        Consumer(client, namespace, block_s=0.1, max_deliveries=2).next_batch(2, timeout=0.5)
    assert queue.redis.xlen(queue.keys.dead) == 2
    assert_audit_ok(queue)


def test_a_duplicate_entry_cannot_delete_the_payload_of_the_held_copy(queue, client, namespace):
    """Issue 8 #2 (r2): two results entries for one group id (a bug, a foreign writer)
    each name their own payload key: discarding one leaves the other intact."""
    produce(queue, 1)
    [entry] = queue.read_stream(queue.keys.results)
    queue.redis.set(queue.keys.result("g0", "copy"), entry.data)
    queue.redis.xadd(queue.keys.results, {"gid": "g0", "tok": "copy"})
    c = Consumer(client, namespace, block_s=0.1)
    [g] = c.next_batch(1, timeout=5).groups
    with pytest.raises(BatchTimeout):
        c.next_batch(1, timeout=0.3)  # reads the copy: a duplicate, settled
    assert queue.stats()["duplicates"] == 1
    del c  # the trainer dies before committing
    again = Consumer(client, namespace, block_s=0.1)
    b = again.next_batch(1, timeout=5)
    assert b.groups[0] == g and queue.redis.xlen(queue.keys.dead) == 0
    again.commit(b)
    assert_audit_ok(queue)


def test_the_trainer_reaps_dead_workers(queue, client, namespace):
    """Issue 14 #3: with no live worker left, the trainer returns a dead one's groups."""
    queue.push_groups(fresh(2))
    claim(queue, "dead-worker", 2)
    queue.redis.zadd(queue.keys.workers, {"dead-worker": 0}, xx=True)
    c = Consumer(client, namespace, block_s=0.05)
    with pytest.raises(BatchTimeout):
        c.next_batch(1, timeout=0.3)
    assert queue.redis.llen(queue.keys.prompts) == 2
    assert queue.stats()["reaped"] == 2


def test_groups_read_before_a_timeout_stay_with_the_consumer(queue, consumer):
    produce(queue, 2)
    with pytest.raises(BatchTimeout, match="with 2 of 3 groups"):
        consumer.next_batch(3, timeout=0.3)
    assert queue.redis.xpending(queue.keys.results, CONSUMER_GROUP)["pending"] == 2
    assert_audit_ok(queue)
    produce(queue, 1, prefix="x")
    batch = consumer.next_batch(3, timeout=5)
    assert [g.group_id for g in batch.groups] == ["g0", "g1", "x0"]


# -- duplicates and malformed entries -------------------------------------------------


def test_duplicate_of_committed_group_is_dropped(queue, consumer):
    produce(queue, 1)
    b = consumer.next_batch(1, timeout=5)
    consumer.commit(b)
    # A second copy of g0 shows up (a redelivery, a bug elsewhere): never trained twice.
    queue.redis.xadd(queue.keys.results, {"gid": "g0", "tok": "x"})
    produce(queue, 1, prefix="n")
    b2 = consumer.next_batch(1, timeout=5)
    assert [g.group_id for g in b2.groups] == ["n0"]
    assert b2.metrics.duplicates == 1
    assert queue.stats()["duplicates"] == 1
    consumer.commit(b2)
    assert queue.redis.xlen(queue.keys.results) == 0
    assert_audit_ok(queue)


def test_duplicate_of_held_group_is_dropped(queue, consumer):
    produce(queue, 2)
    queue.redis.xadd(queue.keys.results, {"gid": "g0", "tok": "x"})  # g0 again, read with it
    produce(queue, 1, prefix="n")
    b = consumer.next_batch(3, timeout=5)
    assert [g.group_id for g in b.groups] == ["g0", "g1", "n0"]
    assert b.metrics.duplicates == 1
    # g0 is handed out but not committed yet: a copy arriving now is a duplicate too.
    queue.redis.xadd(queue.keys.results, {"gid": "g0", "tok": "y"})
    produce(queue, 1, prefix="m")
    b2 = consumer.next_batch(1, timeout=5)
    assert [g.group_id for g in b2.groups] == ["m0"]
    assert b2.metrics.duplicates == 1
    assert queue.stats()["duplicates"] == 2
    consumer.commit(b)
    consumer.commit(b2)
    assert queue.redis.xlen(queue.keys.results) == 0
    assert_audit_ok(queue)


def test_malformed_results_entry_goes_dead(queue, consumer):
    produce(queue, 2)
    queue.push_groups(fresh(1, "bad"))
    c = claim(queue, "w", 1).groups[0]
    queue.publish("w", "bad0", c.token, b"\x81\xa1v\x09", Place.RESULTS)  # msgpack, wrong schema version
    produce(queue, 1, prefix="z")
    b = consumer.next_batch(3, timeout=5)
    assert [g.group_id for g in b.groups] == ["g0", "g1", "z0"]
    assert b.metrics.dead == 1
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "bad0" and dead.error.startswith("malformed results entry: schema version 9")
    consumer.commit(b)
    report = assert_audit_ok(queue)
    assert (report.dead, report.committed) == (1, 3)


def test_results_entry_without_its_payload_goes_dead(queue, consumer):
    produce(queue, 3)
    g1 = queue.read_stream(queue.keys.results)[1]
    queue.redis.delete(queue.keys.result("g1", g1.token))  # the payload key is gone (an operator, a bug)
    report = audit(queue)
    assert report.missing_payloads == 1 and not report.ok  # the audit notices
    produce(queue, 1, prefix="z")
    b = consumer.next_batch(3, timeout=5)
    assert [g.group_id for g in b.groups] == ["g0", "g2", "z0"]
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "g1" and dead.error.startswith("malformed results entry")
    consumer.commit(b)
    assert_audit_ok(queue)


# -- timeouts -------------------------------------------------------------------------


def _timeout(consumer: Consumer, n: int = 1, timeout: float = 0.3) -> str:
    started = time.monotonic()
    with pytest.raises(BatchTimeout) as info:
        consumer.next_batch(n, timeout=timeout)
    elapsed = time.monotonic() - started
    assert timeout <= elapsed < timeout + 3.0
    return str(info.value)


def test_timeout_no_worker_ever(consumer):
    msg = _timeout(consumer, 2)
    assert msg.startswith("next_batch(2) timed out after 0.3s with 0 of 2 groups")
    assert "no live workers (none registered)" in msg
    assert "the prompt list is empty" in msg
    assert isinstance(BatchTimeout("x"), TimeoutError)


def test_timeout_workers_dead(queue, client, namespace, monkeypatch):
    queue.push_groups(fresh(3))
    queue.register("w")
    queue.redis.zadd(queue.keys.workers, {"w": 0}, xx=True)
    c = Consumer(client, namespace, block_s=0.2)
    monkeypatch.setattr(c, "_reap", lambda control, deadline: None)  # keep the dead worker for the message
    msg = _timeout(c)
    assert "no live workers (1 registered, lease expired)" in msg
    assert "3 prompts queued" in msg


def test_timeout_live_workers_but_prompts_empty(queue, consumer):
    queue.register("w1", json.dumps({"state": "generating"}))
    queue.register("w2", json.dumps({"state": "engine-unreachable"}))
    msg = _timeout(consumer)
    assert "2 live workers (" in msg and "1 generating" in msg and "1 engine-unreachable" in msg
    assert "the prompt list is empty (push more" in msg
    assert "no live workers" not in msg


def test_timeout_paused(queue, consumer):
    queue.push_groups(fresh(1))
    queue.register("w")
    set_paused(queue.redis, queue.keys, True)
    msg = _timeout(consumer)
    assert "admission is paused" in msg
    assert "1 prompts queued" in msg


def test_timeout_staleness_budget_spent(queue, consumer):
    queue.push_groups(fresh(3))
    configure(queue.redis, queue.keys, max_staleness=0, batch_size=1)
    assert len(claim(queue, "w", 3).groups) == 1
    assert claim(queue, "w", 3).status == "budget"
    msg = _timeout(consumer)
    assert ("the staleness budget is spent (1/1 admitted at version 0, 0 committed): admission reopens when the "
            "weight version moves on, one bump per 1 committed groups") in msg


def test_timeout_mentions_requeue_and_dead(queue, consumer):
    queue.push_groups(fresh(2))
    cs = claim(queue, "w", 2).groups
    publish(queue, "w", cs[0], Place.REQUEUE)
    publish(queue, "w", cs[1], Place.DEAD, error="boom")
    msg = _timeout(consumer)
    assert "1 aborted group waits in the requeue stream" in msg and "1 dead letter" in msg


def test_blocking_stays_below_socket_timeout(redis_url, queue, namespace):
    short = connect(redis_url, socket_timeout=0.5)
    try:
        c = Consumer(short, namespace, block_s=5.0)
        assert 0 < c.block_s <= 0.25
        # Waiting 1.5 s through a client that gives up on a silent socket after 0.5 s:
        # a clean BatchTimeout, not a redis TimeoutError.
        with pytest.raises(BatchTimeout):
            c.next_batch(1, timeout=1.5)
        produce(queue, 1)
        assert len(c.next_batch(1, timeout=2)) == 1
    finally:
        short.close()


def test_wait_forever_returns_when_groups_arrive(queue, client, namespace):
    c = Consumer(client, namespace, block_s=0.1)
    queue.push_groups(fresh(1))
    t = threading.Timer(0.5, lambda: [publish(queue, "w", x, group=finish(x.group))
                                      for x in claim(queue, "w", 1).groups])
    t.start()
    batch = c.next_batch(1, timeout=None)
    t.join()
    assert [g.group_id for g in batch.groups] == ["g0"]


# -- filters --------------------------------------------------------------------------


def test_bare_bool_filter_keeps_batches_exact(queue, client, namespace):
    def positive_first(args, samples):
        return samples[0].reward > 0

    c = Consumer(client, namespace, filter=positive_first, block_s=0.2)
    q = queue
    q.push_groups(fresh(6))
    for i, cl in enumerate(claim(q, "w", 6).groups):
        r = 1.0 if i % 2 else 0.0  # g1, g3, g5 kept
        publish(q, "w", cl, group=finish(cl.group, rewards=[r, r]))
    b = c.next_batch(3, timeout=5)
    assert [g.group_id for g in b.groups] == ["g1", "g3", "g5"]
    assert b.metrics.dropped == {"filtered": 3}
    assert b.metrics.drop_ratio == 0.5
    log = q.redis.xrange(q.keys.dropped)
    assert [(f[b"gid"], f[b"reason"]) for _, f in log] == [(b"g0", b"filtered"), (b"g2", b"filtered"), (b"g4", b"filtered")]
    c.commit(b)
    report = assert_audit_ok(q)
    assert (report.dropped, report.committed) == (3, 3)


@pytest.mark.parametrize("spec", ["dapo", "pipeline.filters:keep_varied_rewards", "pipeline.filters.keep_varied_rewards"])
def test_dapo_filter_drops_groups_with_equal_rewards(queue, client, namespace, spec):
    c = Consumer(client, namespace, filter=spec, block_s=0.2)
    queue.push_groups(fresh(7))
    rewards = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.5],
               [{"score": 1.0}, {"score": 0.0}], [{"score": 1.0}, {"score": 1.0}]]
    for cl, r in zip(claim(queue, "w", 7).groups, rewards):
        publish(queue, "w", cl, group=finish(cl.group, rewards=r))
    b = c.next_batch(3, timeout=5)
    assert [g.group_id for g in b.groups] == ["g1", "g3", "g5"]
    assert b.metrics.dropped == {"all rewards equal": 3}
    assert queue.stats()["dropped"] == 3
    with pytest.raises(BatchTimeout):
        c.next_batch(1, timeout=0.3)  # g6 dropped as well, nothing left
    assert queue.stats()["dropped"] == 4
    c.commit(b)
    assert_audit_ok(queue)


def test_a_filter_that_raises_dead_letters_that_group_only(queue, client, namespace):
    """Issue 8 #12: the trainer's own filter raising on one group strands nothing and
    stops nothing: that group is dead-lettered with the error."""
    def picky(args, samples):
        if samples[0].reward == 7.0:
            raise KeyError("score")
        return True

    c = Consumer(client, namespace, filter=picky, block_s=0.1)
    produce(queue, 1, prefix="a")
    produce(queue, 1, prefix="bad", rewards=[7.0, 7.0])
    produce(queue, 1, prefix="b")
    batch = c.next_batch(2, timeout=5)
    assert [g.group_id for g in batch.groups] == ["a0", "b0"] and batch.metrics.dead == 1
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "bad0" and dead.error == "filter raised KeyError: 'score'"
    c.commit(batch)
    assert_audit_ok(queue)


def test_filter_output_reason_is_recorded(queue, client, namespace):
    c = Consumer(client, namespace, block_s=0.2, filter_args={"min": 1},
                 filter=lambda args, samples: DynamicFilterOutput(samples[1].reward >= args["min"], "too easy"))
    produce(queue, 2, rewards=[0.0, 0.0])
    produce(queue, 1, prefix="k", rewards=[0.0, 2.0])
    b = c.next_batch(1, timeout=5)
    assert [g.group_id for g in b.groups] == ["k0"] and b.metrics.dropped == {"too easy": 2}
    assert {f[b"reason"] for _, f in queue.redis.xrange(queue.keys.dropped)} == {b"too easy"}


def test_bad_filter_path(client, namespace):
    with pytest.raises(ValueError, match="no attribute"):
        Consumer(client, namespace, filter="pipeline.filters:nope")


# -- staleness ------------------------------------------------------------------------


def _stale_setup(queue: Queue, eta: int = 1):
    configure(queue.redis, queue.keys, max_staleness=eta)
    produce(queue, 1, prefix="old", version=0)
    produce(queue, 2, prefix="ok", version=1)
    set_weight_version(queue.redis, queue.keys, 2)  # old0 is 2 behind, ok* 1 behind


def test_too_stale_group_is_restarted(queue, client, namespace):
    _stale_setup(queue)
    c = Consumer(client, namespace, block_s=0.2)
    b = c.next_batch(2, timeout=5)
    assert [g.group_id for g in b.groups] == ["ok0", "ok1"]  # lag == max_staleness is fine
    assert b.metrics.restarted == 1 and b.metrics.staleness == {1: 2}
    assert queue.redis.lrange(queue.keys.prompts, 0, -1) == [b"old0"]
    c.commit(b)
    assert_audit_ok(queue)
    # It comes back reset, counted, and is generated again at the current version.
    x = claim(queue, "w", 1).groups[0]
    claimed = x.group
    assert claimed.group_id == "old0" and claimed.restarts == 1
    assert claimed.prompt_ids == [] and all(s.tokens == [] and s.weight_versions == [] for s in claimed.samples)
    assert claimed.admitted_version == 2
    publish(queue, "w", x, group=finish(claimed, version=2))
    b2 = c.next_batch(1, timeout=5)
    assert [g.group_id for g in b2.groups] == ["old0"] and b2.metrics.restarted == 0
    c.commit(b2)
    assert_audit_ok(queue)


def test_restarted_group_without_token_versions_is_not_stale_again(queue, client, namespace):
    """A restarted group is judged by the version it was restarted under, not its
    first admission (an engine that reports no weight versions falls back to it)."""
    _stale_setup(queue)
    c = Consumer(client, namespace, block_s=0.2)
    c.commit(c.next_batch(2, timeout=5))
    x = claim(queue, "w", 1).groups[0]
    publish(queue, "w", x, group=finish(x.group, version=None))
    b = c.next_batch(1, timeout=5)
    assert [g.group_id for g in b.groups] == ["old0"] and b.metrics.restarted == 0


def test_too_stale_too_often_is_dead_lettered(queue, client, namespace):
    configure(queue.redis, queue.keys, max_staleness=0)
    queue.push_groups(fresh(1, "s"))
    c = Consumer(client, namespace, block_s=0.2, max_restarts=2)
    for round_ in range(3):
        x = claim(queue, "w", 1).groups[0]
        assert x.group.restarts == round_
        publish(queue, "w", x, group=finish(x.group, version=round_))
        set_weight_version(queue.redis, queue.keys, round_ + 1)
        with pytest.raises(BatchTimeout):
            c.next_batch(1, timeout=0.3)
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "s0"
    assert dead.error == "stale: 1 versions behind (max 0); restarted 2 times"
    assert dead.decode().restarts == 2
    assert queue.redis.llen(queue.keys.prompts) == 0
    assert queue.stats()["released"] == 2 and queue.stats()["dead"] == 1
    assert_audit_ok(queue)


def test_stale_policy_drop(queue, client, namespace):
    _stale_setup(queue)
    c = Consumer(client, namespace, block_s=0.2, stale_policy="drop")
    b = c.next_batch(2, timeout=5)
    assert [g.group_id for g in b.groups] == ["ok0", "ok1"]
    assert b.metrics.dropped == {"stale": 1}
    [(_, fields)] = queue.redis.xrange(queue.keys.dropped)
    assert fields[b"gid"] == b"old0" and fields[b"reason"] == b"stale: 2 versions behind (max 1)"
    assert queue.redis.llen(queue.keys.prompts) == 0
    c.commit(b)
    report = assert_audit_ok(queue)
    assert (report.dropped, report.committed) == (1, 2)


def test_no_staleness_bound_delivers_everything(queue, consumer):
    produce(queue, 1, version=0)
    set_weight_version(queue.redis, queue.keys, 100)
    b = consumer.next_batch(1, timeout=5)
    assert b.metrics.staleness == {100: 1}


def test_stale_check_also_applies_to_recovered_entries(queue, client, namespace):
    produce(queue, 2, version=0)
    first = Consumer(client, namespace, block_s=0.2)
    first.next_batch(2, timeout=5)
    del first
    configure(queue.redis, queue.keys, max_staleness=0)
    set_weight_version(queue.redis, queue.keys, 1)
    again = Consumer(client, namespace, block_s=0.2, stale_policy="drop")
    with pytest.raises(BatchTimeout):
        again.next_batch(1, timeout=0.3)
    assert queue.stats()["dropped"] == 2
    assert_audit_ok(queue)
