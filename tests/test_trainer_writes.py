"""Every write of the trainer's side goes through one primitive (pipeline/writer.py): it is
made under the writer's trainer session (a fenced session writes nothing, control state
included) and, with replicas=N, returns once N replicas have it. The batch ledger of a
Consumer (a released batch, or another Consumer's, is not committed through it), batch sizes
the backlog limit cannot hold, and consumer names the session records cannot carry are
refused at the call."""
from __future__ import annotations

import ast
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer, SessionFenced, UncommittableBatch
from pipeline.control import WeightVersionBehind, configure, read_control, set_weight_version
from pipeline.controller import Controller
from pipeline.queue import Queue
from pipeline.retry import RedisUnavailable
from pipeline.trainers import slime_adapter as sa
from pipeline.trainers import slime_types as st
from tests.groups import assert_audit_ok, produce
from tests.helpers import one_error_line, pause_replication, primary_and_replica, resume_replication, wait_for

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def consumer(client, namespace):
    return Consumer(client, namespace, block_s=0.05)


def _waits_for_the_replica(consumer: Consumer, work) -> threading.Thread:
    """Run `work` in a thread; return it once it finished or its writer is waiting for a
    replica (recorded as an outage: 'reached 0 of 1 replicas')."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    wait_for(lambda: not thread.is_alive() or consumer.reconnect.down, what="the write to return or wait")
    return thread


# -- every trainer-side write goes through the writer (by construction) ---------------------------

#: Modules of the trainer's side: whatever Redis state they change, they change through their
#: Consumer's or Controller's writer.
TRAINER_SIDE = ("pipeline/consumer.py", "pipeline/controller.py", "pipeline/control.py",
                "pipeline/trainers/slime_adapter.py", "pipeline/trainers/eval.py",
                "pipeline/trainers/torch_adapter.py")
#: Redis commands and Queue operations that change state.
WRITES = {"hset", "hdel", "hsetnx", "hincrby", "set", "delete", "unlink", "expire", "xadd", "xack", "xdel",
          "xclaim", "xautoclaim", "xgroup_create", "zadd", "zrem", "lpush", "rpush", "lrem", "sadd", "srem",
          "settle", "push_groups", "push", "publish_many", "publish_group", "release", "hand_back"}


def _writes_outside_the_writer(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        # A write command named anywhere (called, or handed to a retry wrapper) on anything but
        # a writer or a Consumer (whose own release/commit go through its writer).
        if isinstance(node, ast.Attribute) and node.attr in WRITES:
            receiver = ast.unparse(node.value)
            if not receiver.endswith(("writer", "consumer", "reader")):
                found.append(f"{path.name}:{node.lineno} {receiver}.{node.attr}")
        # A script called directly instead of handed to the writer.
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and ast.unparse(node.func.value).endswith("_scripts")):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}(...)")
    return found


def test_the_trainer_side_writes_to_redis_only_through_its_writer():
    """A new settle action, control write or record of an adapter cannot lack the fence or
    the replica wait: there is no other way to write from these modules."""
    found = [w for name in TRAINER_SIDE for w in _writes_outside_the_writer(REPO / name)]
    assert found == []


# -- durability (replicas=N) of every write, commit_trained and the adapters' records included ------


def test_commit_trained_returns_once_the_replica_has_the_commits(redis_factory, namespace):
    """What slime's load() calls: the commit of what a checkpoint trained must not return
    while only the primary has it (a failover would deliver those groups again)."""
    primary, replica = primary_and_replica(redis_factory)
    queue = Queue(connect(primary.url), namespace)
    produce(queue, 3)
    died = Consumer(connect(primary.url), namespace, block_s=0.05).next_batch(2, timeout=5)  # trained, not committed
    client = connect(primary.url, socket_timeout=5)
    pending = client.xpending_range

    def pending_then_cut(*args, **kwargs):  # the session has started (and a replica has that)
        pause_replication(replica)
        client.xpending_range = pending
        return pending(*args, **kwargs)

    client.xpending_range = pending_then_cut
    restarted = Consumer(client, namespace, block_s=0.05, replicas=1, replica_timeout_s=0.1)
    done: list[int] = []
    committing = _waits_for_the_replica(
        restarted, lambda: done.append(restarted.commit_trained(set(died.entry_ids), "checkpoint 0")))
    try:
        assert committing.is_alive() and not done, "commit_trained returned with the commits on the primary only"
    finally:
        resume_replication(replica)
    committing.join(30)
    assert done == [2]
    assert sorted(m.decode() for m in connect(replica.url, read_only=True).zrange(queue.keys.committed, 0, -1)) == ["g0", "g1"]
    assert [g.group_id for g in restarted.next_batch(1, timeout=5).groups] == ["g2"]


@pytest.fixture
def stand_in_slime(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)  # the adapter's stand-in types
    st.slime_types.cache_clear()
    sa.reset_default_sources()
    yield
    sa.reset_default_sources()
    st.slime_types.cache_clear()


@pytest.mark.slow
def test_the_slime_adapters_records_wait_for_the_replica(redis_factory, namespace, stand_in_slime):
    """Which rollout read an entry decides, at load(), whether it is committed as trained:
    a record a failover brings back (a given-back group's) would commit an untrained group."""
    from tests.test_slime_adapter import make_args, publish_results

    primary, replica = primary_and_replica(redis_factory)
    queue = Queue(connect(primary.url), namespace)
    publish_results(queue, [0, 1])
    source = sa.RedisDataSource(make_args(primary.url, namespace, rollout_replicas=1),
                                client=connect(primary.url, socket_timeout=10))
    groups = source.read_rollout(0, 2)
    assert queue.redis.hlen(queue.keys.slime_rollouts) == 2
    pause_replication(replica)
    given_back = _waits_for_the_replica(source.consumer, lambda: source.add_samples([groups[1]]))
    try:
        assert given_back.is_alive(), "the record of a given-back group was deleted on the primary only"
    finally:
        resume_replication(replica)
    given_back.join(30)
    assert connect(replica.url, read_only=True).hlen(queue.keys.slime_rollouts) == 1


def test_a_write_whose_replica_never_answers_gives_up_with_backoff(client, namespace, queue):
    """No replica at all: the write (here a batch's delivery) is retried with backoff until
    the call's deadline, then says why (a confirmation loop used to spin without a bound)."""
    produce(queue, 1)
    trainer = Consumer(client, namespace, block_s=0.05, replicas=1, replica_timeout_s=0.05)
    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match="reached 0 of 1 replicas"):
        trainer.next_batch(1, timeout=1.0)
    assert time.monotonic() - started < 10
    assert trainer.reconnect.outages == 1


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["my trainer", "a/b", "", "x" * 65, "tab\there", "new\nline", "ünï"])
def test_a_consumer_name_outside_the_allowed_characters_is_refused_at_once(client, namespace, name):
    with pytest.raises(ValueError, match=r"letters, digits and \. _ - : @ #"):
        Consumer(client, namespace, consumer=name)


def test_consume_refuses_a_bad_consumer_name_in_one_line(run, queue):
    produce(queue, 1)
    line = one_error_line(run("consume", "--consumer", "my trainer", "--batch-size", "1", "--steps", "1"))
    assert "'my trainer'" in line and "letters, digits" in line


def test_a_commit_confirmed_by_the_replica_takes_any_allowed_name(redis_factory, namespace):
    primary, _ = primary_and_replica(redis_factory)
    queue = Queue(connect(primary.url), namespace)
    produce(queue, 2)
    trainer = Consumer(connect(primary.url, socket_timeout=5), namespace, consumer="run.v2-a:b@c#1_x",
                       block_s=0.05, replicas=1)
    assert trainer.commit(trainer.next_batch(2, timeout=5)) == 2
    assert_audit_ok(queue)


# -- fencing of control writes ----------------------------------------------------------------------


def test_a_fenced_trainer_writes_no_control_state(queue, client, namespace):
    """Trainer B took the session over: old trainer A's pause, resume, weight version and
    settings are refused, so it can neither roll B's version back nor leave admission paused."""
    produce(queue, 2)
    a = Consumer(client, namespace, consumer="a", block_s=0.05)
    a_control = Controller(queue, writer=a.writer)
    a.commit(a.next_batch(1, timeout=5))
    b = Consumer(client, namespace, consumer="b", block_s=0.05)
    b.commit(b.next_batch(1, timeout=5))
    asyncio.run(Controller(queue, writer=b.writer).resume(7))
    for write in (lambda: asyncio.run(a_control.pause()), lambda: asyncio.run(a_control.resume(5)),
                  lambda: configure(client, queue.keys, max_ready=3, writer=a.writer),
                  lambda: set_weight_version(client, queue.keys, 8, writer=a.writer)):
        with pytest.raises(SessionFenced, match="replaced by session b"):
            write()
    control = read_control(client, queue.keys)
    assert (control.paused, control.weight_version, control.max_ready) == (False, 7, 4096)


def test_the_weight_version_moves_back_only_when_asked(queue, client):
    set_weight_version(client, queue.keys, 7)
    with pytest.raises(ValueError, match=r"weight version 5 is behind the recorded 7.*rollback"):
        set_weight_version(client, queue.keys, 5)
    with pytest.raises(ValueError, match="rollback"):
        asyncio.run(Controller(queue).resume(4))
    assert read_control(client, queue.keys).weight_version == 7
    set_weight_version(client, queue.keys, 5, rollback=True)
    assert read_control(client, queue.keys).weight_version == 5


def test_an_operators_control_writes_are_not_fenced_and_a_rollback_says_so(run, queue, client, namespace, consumer):
    """`rollout pause/resume/configure` are no trainer session: they act while one runs (an
    operator must be able to resume a pipeline whose trainer died paused) and are recorded;
    moving the weight version back takes --rollback."""
    produce(queue, 1)
    consumer.commit(consumer.next_batch(1, timeout=5))
    set_weight_version(client, queue.keys, 7, writer=consumer.writer)
    assert run("pause", "--mode", "in_place").exit_code == 0
    line = one_error_line(run("resume", "--weight-version", "3"))
    assert "behind the recorded 7" in line and "--rollback" in line
    assert read_control(client, queue.keys).paused  # nothing was done
    result = run("resume", "--weight-version", "3", "--rollback")
    assert result.exit_code == 0, result.output
    control = read_control(client, queue.keys)
    assert (control.paused, control.weight_version) == (False, 3)
    assert client.hget(queue.keys.trainer, "unfenced_write").endswith(b" operator resume")


# -- the consumer's own ledger -----------------------------------------------------------------


def test_a_released_batch_cannot_be_committed(queue, consumer):
    produce(queue, 2)
    batch = consumer.next_batch(2, timeout=5)
    consumer.release(batch, "the step failed")
    with pytest.raises(UncommittableBatch, match="handed back"):
        consumer.commit(batch)
    again = consumer.next_batch(2, timeout=5)
    assert [g.group_id for g in again.groups] == ["g0", "g1"]
    assert consumer.commit(again) == 2
    with pytest.raises(BatchTimeout):
        consumer.next_batch(1, timeout=0.2)  # nothing is delivered a second time
    assert assert_audit_ok(queue).committed == 2


def test_a_batch_delivered_by_another_consumer_is_not_committed_through_this_one(queue, client, namespace):
    produce(queue, 3)
    first = Consumer(client, namespace, block_s=0.05)
    batch = first.next_batch(2, timeout=5)
    second = Consumer(client, namespace, block_s=0.05)  # takes the session and first's batch over
    with pytest.raises(UncommittableBatch, match="not delivered by this consumer"):
        second.commit(batch)
    mine = second.next_batch(3, timeout=5)
    assert sorted(g.group_id for g in mine.groups) == ["g0", "g1", "g2"]
    assert second.commit(mine) == 3
    assert assert_audit_ok(queue).committed == 3


def test_a_batch_committed_twice_counts_once(queue, consumer):
    produce(queue, 2)
    batch = consumer.next_batch(2, timeout=5)
    assert consumer.commit(batch) == 2 and consumer.commit(batch) == 2
    assert queue.stats()["committed"] == 2


# -- batch sizes the backlog limit cannot hold ------------------------------------------------------


def test_a_batch_larger_than_max_ready_is_refused_at_the_call(queue, consumer):
    configure(queue.redis, queue.keys, max_ready=4)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"next_batch\(5\).*max_ready.*4"):
        consumer.next_batch(5, timeout=30)
    assert time.monotonic() - started < 5


def test_a_batch_that_cannot_fill_beside_the_uncommitted_ones_is_refused(queue, consumer):
    configure(queue.redis, queue.keys, max_ready=4)
    produce(queue, 3)
    consumer.next_batch(3, timeout=5)
    with pytest.raises(ValueError, match=r"3 groups of earlier batches.*not committed.*max_ready"):
        consumer.next_batch(2, timeout=30)


def test_the_timeout_names_max_ready_when_the_backlog_holds_admission(queue, consumer):
    configure(queue.redis, queue.keys, max_ready=2)
    produce(queue, 2)
    consumer.next_batch(2, timeout=5)
    why = consumer.diagnose(1, 0, 1.0)
    assert "max_ready (2 of 2 results waiting, 2 of them delivered to this trainer and not committed)" in why


def test_configure_max_ready_below_a_running_trainers_batch_warns(run, queue, consumer):
    produce(queue, 4)
    consumer.commit(consumer.next_batch(4, timeout=5))
    result = run("configure", "--max-ready", "2")
    assert result.exit_code == 0, result.output
    assert "warning" in result.output and "batches of 4" in result.output and "--max-ready 2" in result.output


# -- the lease ----------------------------------------------------------------------------------


def test_configure_refuses_a_lease_shorter_than_the_heartbeat_and_upkeep(client, queue):
    with pytest.raises(ValueError, match=r"lease of 0.5s.*upkeep"):
        configure(client, queue.keys, lease_s=0.5)
    queue.register("w", json.dumps({"heartbeat_s": 2.0}))
    with pytest.raises(ValueError, match=r"lease of 2.5s.*worker w heartbeats every 2s"):
        configure(client, queue.keys, lease_s=2.5)
    assert configure(client, queue.keys, lease_s=3.5).lease_s == 3.5


# -- the slime adapter: its one rollback, and no write once fenced --------------------------------


def test_the_slime_adapters_first_rollout_is_its_one_rollback(stand_in_slime, queue, redis_url, namespace, caplog):
    """slime resumed from an earlier checkpoint: the adapter's first rollout sets the queue's
    version back, and says so; any later version behind the recorded one is refused."""
    from tests.test_slime_adapter import make_args, publish_results

    publish_results(queue, [0, 1, 2, 3])
    set_weight_version(queue.redis, queue.keys, 7)
    source = sa.RedisDataSource(make_args(redis_url, namespace))
    source.read_rollout(3, 2)
    assert read_control(queue.redis, queue.keys).weight_version == 3
    assert "the queue's weight version goes back from 7 to 3" in caplog.text
    with pytest.raises(WeightVersionBehind, match="behind the recorded 3"):
        source.read_rollout(2, 2)
    assert read_control(queue.redis, queue.keys).weight_version == 3


def test_a_replaced_slime_trainer_records_and_commits_nothing(stand_in_slime, queue, redis_url, namespace):
    from tests.test_slime_adapter import make_args, publish_results

    publish_results(queue, [0, 1, 2, 3])
    old = sa.RedisDataSource(make_args(redis_url, namespace, save="/ckpt", save_interval=1))
    old.read_rollout(0, 2)
    new = sa.RedisDataSource(make_args(redis_url, namespace, save="/ckpt", save_interval=1))
    new.read_rollout(0, 2)  # its session fences the old one (and takes its batch over)
    records = queue.redis.hgetall(queue.keys.slime_rollouts)
    with pytest.raises(SessionFenced):
        old.save(0)
    assert queue.redis.hgetall(queue.keys.slime_rollouts) == records and queue.stats().get("committed", 0) == 0
