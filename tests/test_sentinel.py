"""Redis behind Sentinel (issue 21): a primary, a replica and three Sentinels on loopback
ports; the primary is killed and Sentinel promotes the replica. A worker, the feeder and a
trainer connected through `redis+sentinel://` carry on against the new primary, and the
audit is clean."""
from __future__ import annotations

import asyncio
import threading

import pytest
import redis
from click.testing import CliRunner

from cli import main
from pipeline.connection import ConnectionFailed, connect, sentinel_target
from pipeline.consumer import BatchTimeout, Consumer, SessionFenced
from pipeline.control import configure, read_control
from pipeline.controller import Controller
from pipeline.producer import PushOptions, push_dataset
from pipeline.keys import Keys
from pipeline.queue import Queue
from pipeline.redis_server import free_port
from pipeline.redis_sentinel import SentinelDeployment
from pipeline.retry import Reconnect
from pipeline.types import PauseMode
from pipeline.ops.audit import audit
from tests.groups import produce
from tests.helpers import wait_for, wait_replicated

@pytest.fixture
def deployment(tmp_path):
    d = SentinelDeployment(tmp_path).start()
    yield d
    d.stop()


def test_sentinel_urls_are_parsed_and_checked():
    t = sentinel_target("redis+sentinel://:pw@h1:26380,h2,[::1]:5/mymaster/2")
    assert t.sentinels == [("h1", 26380), ("h2", 26379), ("::1", 5)]
    assert (t.service, t.db, t.username, t.password) == ("mymaster", 2, None, "pw")
    with pytest.raises(ConnectionFailed, match="name the service"):
        connect("redis+sentinel://127.0.0.1:1")
    with pytest.raises(ConnectionFailed, match=r"'h:x' is not host:port"):
        connect("redis+sentinel://:secret@h:x/s")
    with pytest.raises(ConnectionFailed, match=r"cannot reach Redis at redis\+sentinel://\*\*\*@127.0.0.1") as info:
        connect(f"redis+sentinel://:secret@127.0.0.1:{free_port()}/s")
    assert "secret" not in str(info.value)


@pytest.mark.slow
def test_a_worker_feeder_and_trainer_carry_on_through_a_sentinel_failover(deployment, tmp_path):
    """Kill the primary while a worker generates, the feeder tops the queue up and the
    trainer commits: Sentinel promotes the replica, everyone follows it through the
    redis+sentinel URL, every group of the dataset is trained once, the audit is clean.
    The trainer waits for the replica (replicas=1): replication is asynchronous, so
    without it a kill -9 of the primary can take its last commit along, and that batch is
    delivered again (CI once saw 4 groups trained twice); the old primary rejoins as the
    replica the commits after the failover wait for."""
    from engines.simulator import SimConfig, start_simulator
    from tests.helpers import WorkerThread
    from workers.worker import SamplingSettings, WorkerSettings

    url, ns, total = deployment.url, "sentinel", 60
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"input": "What is {i} + 1?", "label": "{i + 1}"}}\n' for i in range(total)))
    q = Queue(connect(url), ns)
    configure(q.redis, q.keys, lease_s=3.0)
    sim = start_simulator(SimConfig(seed=3, decode_tokens_per_s=400.0, length_median=16, length_p99=64))
    worker = WorkerThread(WorkerSettings(redis_url=url, engine_urls=[sim.url], namespace=ns, heartbeat_s=0.3,
                                         concurrency_per_engine=8, sampling=SamplingSettings(max_new_tokens=32)))
    feeder_error: list[BaseException] = []

    def feed():
        try:
            push_dataset(Queue(connect(url), ns), data, PushOptions(n_samples_per_prompt=2, chunk_size=5,
                                                                    max_queued=10), reconnect=Reconnect("feeder"))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            feeder_error.append(exc)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    consumer = Consumer(connect(url, socket_timeout=5), ns, block_s=0.2, replicas=1, replica_timeout_s=0.2)
    trained: list[str] = []
    old_primary = deployment.primary_port()

    def failover() -> None:
        old = deployment.kill_primary()
        deployment.wait_promoted(deployment.other(old))
        deployment.start_node(old)

    failing = threading.Thread(target=failover, daemon=True)
    try:
        while len(trained) < total:
            if len(trained) >= total // 3 and failing.ident is None:
                failing.start()  # the failover, mid-run
            try:
                batch = consumer.next_batch(4 if total - len(trained) >= 4 else total - len(trained), timeout=60)
            except BatchTimeout:
                continue
            consumer.commit(batch)
            trained += [g.group_id for g in batch.groups]
        feeder.join(60)
        failing.join(60)
    finally:
        worker.stop()
        sim.stop()
    assert not feeder_error, feeder_error
    assert deployment.primary_port() != old_primary  # the replica was promoted
    assert len(trained) == len(set(trained)) == total
    assert consumer.reconnect.outages >= 1
    report = audit(Queue(connect(url), ns))
    assert report.ok and report.committed == total, report.summary()


@pytest.mark.slow
def test_a_failover_to_a_replica_that_missed_writes_redelivers_and_stays_consistent(deployment):
    """The replica stops receiving (its link cut), the trainer commits a batch on the
    primary, the primary dies, Sentinel promotes the replica: the commit is gone with the
    primary, so that batch is delivered again (trained twice unless commits wait for a
    replica: docs/operations.md, Durability), and everything else holds: the trainer
    session goes on, the books are a consistent earlier state, the audit is clean."""
    url, ns = deployment.url, "lost"
    q = Queue(connect(url, socket_timeout=5), ns)
    produce(q, 4)
    trainer = Consumer(connect(url, socket_timeout=5), ns, block_s=0.2)
    first = trainer.next_batch(2, timeout=10)
    assert trainer.commit(first) == 2
    wait_replicated(redis.Redis(port=deployment.primary.port), redis.Redis(port=deployment.replica.port))
    deployment.pause_replication(deployment.replica)  # the replica misses everything from here on
    second = trainer.next_batch(2, timeout=10)
    assert trainer.commit(second) == 2  # acknowledged by the primary only
    old_primary = deployment.primary_port()
    deployment.kill_primary()
    again = trainer.next_batch(2, timeout=60)  # waits out the failover
    assert deployment.primary_port() == deployment.replica.port != old_primary
    assert [g.group_id for g in again.groups] == [g.group_id for g in second.groups]  # the lost commit
    assert trainer.commit(again) == 2
    report = audit(Queue(connect(url), ns))
    assert report.ok and report.committed == 4, report.summary()


@pytest.mark.slow
def test_commits_that_wait_for_the_replica_survive_a_lost_write_failover(deployment):
    """The same failover, with Consumer(replicas=1): the commit made while the replica's
    link is cut does not return until the link is back and the replica has it, so the
    promoted replica knows the batch is committed and it is never delivered again."""
    url, ns = deployment.url, "waited"
    q = Queue(connect(url, socket_timeout=5), ns)
    produce(q, 4)
    trainer = Consumer(connect(url, socket_timeout=5), ns, block_s=0.2, replicas=1, replica_timeout_s=0.2)
    assert trainer.commit(trainer.next_batch(2, timeout=10)) == 2
    second = trainer.next_batch(2, timeout=10)
    deployment.pause_replication(deployment.replica)  # the replica misses everything from here on ...
    restored = threading.Thread(target=lambda: (wait_for(lambda: trainer.reconnect.down, what="an unreplicated commit"),
                                                deployment.resume_replication(deployment.replica)))
    restored.start()  # ... until the commit has waited for it
    assert trainer.commit(second) == 2
    restored.join()
    assert "reached 0 of 1 replicas" in trainer.reconnect.last_error
    produce(q, 1, prefix="after")
    wait_replicated(redis.Redis(port=deployment.primary.port), redis.Redis(port=deployment.replica.port))
    old = deployment.kill_primary()
    deployment.wait_promoted(deployment.replica)
    deployment.start_node(old)  # rejoins as the replica: batches are handed out once a replica has them
    batch = trainer.next_batch(1, timeout=60)
    assert [g.group_id for g in batch.groups] == ["after0"]  # not the second batch again
    assert trainer.commit(batch) == 1
    report = audit(Queue(connect(url), ns))
    assert report.ok and report.committed == 5, report.summary()


@pytest.mark.slow
def test_a_commit_waiting_for_the_replica_when_the_primary_dies_is_made_again_on_the_new_primary(deployment):
    """Consumer(replicas=1), and the primary dies while a commit waits for the replica,
    which never got it: the promoted replica has the batch's delivery (a batch is handed
    out only once a replica has it) but not its commit. The commit, its mark and WAIT go
    in one pipeline, so the retry on the new primary commits again there (its settle finds
    the entries still delivered to the session) rather than returning on that primary's WAIT
    alone. The batch is never delivered again (it would be trained twice)."""
    url, ns = deployment.url, "again"
    q = Queue(connect(url, socket_timeout=5), ns)
    produce(q, 4)
    trainer = Consumer(connect(url, socket_timeout=5), ns, block_s=0.2, replicas=1, replica_timeout_s=0.2)
    first = trainer.next_batch(2, timeout=10)
    deployment.pause_replication(deployment.replica)
    committed: list[int] = []
    commit = threading.Thread(target=lambda: committed.append(trainer.commit(first)))
    commit.start()
    wait_for(lambda: trainer.reconnect.down, what="the commit waiting for the replica")
    old = deployment.kill_primary()  # the replica drops the commit it had not applied
    deployment.wait_promoted(deployment.replica)
    assert not committed  # no replica of the new primary yet: nothing can be confirmed
    deployment.start_node(old)
    commit.join(60)
    assert committed == [2]
    history = Queue(connect(url), ns).history(first.groups[0].group_id)
    assert [detail for _, event, _, detail in history if event == "committed"] == [first.batch_id]  # once, here
    second = trainer.next_batch(2, timeout=30)
    assert {g.group_id for g in second.groups}.isdisjoint(g.group_id for g in first.groups)
    assert trainer.commit(second) == 2
    report = audit(Queue(connect(url), ns))
    assert report.ok and report.committed == 4, report.summary()


@pytest.mark.slow
def test_commit_trained_survives_a_lost_write_failover_without_training_twice(deployment):
    """What slime's load() calls: a restarted trainer commits the batch its checkpoint
    trained. The replica misses that commit and the primary dies: with replicas=1 the
    commit does not return before a replica has it (it is made again on the promoted
    replica), so the batch is never delivered again; it used to return at once, and the
    failover handed the checkpoint's groups out a second time."""
    url, ns = deployment.url, "checkpointed"
    produce(Queue(connect(url, socket_timeout=5), ns), 4)
    died = Consumer(connect(url, socket_timeout=5), ns, block_s=0.2, replicas=1, replica_timeout_s=0.2)
    trained = died.next_batch(2, timeout=10)  # in the checkpoint; the trainer died before committing
    client = connect(url, socket_timeout=5)
    pending = client.xpending_range

    def pending_then_cut(*args, **kwargs):  # the new session has started, and the replica has that
        deployment.pause_replication(deployment.replica)
        client.xpending_range = pending
        return pending(*args, **kwargs)

    client.xpending_range = pending_then_cut
    restarted = Consumer(client, ns, block_s=0.2, replicas=1, replica_timeout_s=0.2)
    done: list[int] = []
    committing = threading.Thread(target=lambda: done.append(
        restarted.commit_trained(set(trained.entry_ids), "slime checkpoint 0")))
    committing.start()
    wait_for(lambda: not committing.is_alive() or restarted.reconnect.down, what="the commit to return or wait")
    old = deployment.kill_primary()  # the replica drops the commit it had not applied
    deployment.wait_promoted(deployment.replica)
    deployment.start_node(old)  # rejoins as the replica the commit waits for
    committing.join(60)
    assert done == [2]
    batch = restarted.next_batch(2, timeout=30)
    assert {g.group_id for g in batch.groups}.isdisjoint(g.group_id for g in trained.groups), "trained twice"
    assert restarted.commit(batch) == 2
    report = audit(Queue(connect(url), ns))
    assert report.ok and report.committed == 4, report.summary()


@pytest.mark.slow
def test_a_forgotten_commit_is_not_confirmed_by_the_newer_session_that_committed_the_batch(deployment):
    """Found by rollout chaos: a commit waits for the replica, the primary dies, the
    promoted replica never saw the commit; a newer trainer session starts there, takes the
    batch over and commits it. The older commit must not then return because the groups
    read as committed (the batch would count as trained by both): it is refused as fenced."""
    url, ns = deployment.url, "taken"
    produce(Queue(connect(url, socket_timeout=5), ns), 2)
    older = Consumer(connect(url, socket_timeout=5), ns, block_s=0.2, replicas=1, replica_timeout_s=0.2)
    batch = older.next_batch(2, timeout=10)
    deployment.pause_replication(deployment.replica)
    outcome: list[object] = []

    def commit() -> None:
        try:
            outcome.append(older.commit(batch))
        except SessionFenced as exc:
            outcome.append(exc)

    committing = threading.Thread(target=commit)
    committing.start()
    wait_for(lambda: older.reconnect.down, what="the commit waiting for the replica")
    old = deployment.kill_primary()
    deployment.wait_promoted(deployment.replica)
    newer = Consumer(connect(url, socket_timeout=5), ns, block_s=0.2)  # no replica to wait for yet
    again = newer.next_batch(2, timeout=30)
    assert [g.group_id for g in again.groups] == [g.group_id for g in batch.groups]
    assert newer.commit(again) == 2
    deployment.start_node(old)
    committing.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], SessionFenced), outcome
    report = audit(Queue(connect(url), ns))
    assert report.ok and report.committed == 2, report.summary()


@pytest.mark.slow
def test_a_resume_a_failover_forgot_is_made_again_on_the_new_primary(deployment):
    """Found by rollout chaos: a weight update's resume (`paused=0`, the new version)
    acknowledged by the primary alone, then a failover to a replica that never saw it.
    The pipeline stayed paused with nobody to resume it: the trainer, waiting for a batch
    the paused workers never made, had no next update. Controller(replicas=1) returns from
    resume only once a replica has it, writing it again on the new primary if the
    failover forgot it."""
    url, ns = deployment.url, "resumed"
    queue = Queue(connect(url, socket_timeout=5), ns)
    controller = Controller(queue, replicas=1, replica_timeout_s=0.2)
    asyncio.run(controller.pause(PauseMode.IN_PLACE))
    assert read_control(queue.redis, queue.keys).paused
    deployment.pause_replication(deployment.replica)  # the replica misses everything from here on
    resumed = threading.Thread(target=lambda: asyncio.run(controller.resume(4)))
    resumed.start()
    wait_for(lambda: controller.reconnect.down, what="the resume waiting for the replica")
    old = deployment.kill_primary()  # the replica never applied the resume
    deployment.wait_promoted(deployment.replica)
    assert resumed.is_alive()  # no replica of the new primary yet: nothing can be confirmed
    deployment.start_node(old)
    resumed.join(60)
    assert not resumed.is_alive()
    control = read_control(connect(url), queue.keys)
    assert (control.paused, control.weight_version) == (False, 4)
    # ... and on the replica too: another failover cannot take it back.
    wait_replicated(redis.Redis(port=deployment.primary_port()), redis.Redis(port=old.port))
    assert redis.Redis(port=old.port).hmget(queue.keys.control, "paused", "weight_version") == [b"0", b"4"]


@pytest.mark.slow
@pytest.mark.parametrize("command, field, value", [
    (["resume", "--weight-version", "3"], "weight_version", b"3"),
    (["configure", "--max-staleness", "2", "--batch-size", "8"], "max_staleness", b"2"),
])
def test_the_operators_control_commands_with_replicas_return_once_the_replica_has_them(deployment, command, field,
                                                                                        value):
    """`rollout pause/resume/configure --replicas 1`: the same wait, from the shell."""
    url, ns = deployment.url, "operator"
    produce(Queue(connect(url), ns), 1)
    cli = ["--redis-url", url, "--namespace", ns]
    paused = CliRunner().invoke(main, [*cli, "pause", "--replicas", "1"])
    assert paused.exit_code == 0, paused.output
    deployment.pause_replication(deployment.replica)
    outcome: list = []
    running = threading.Thread(target=lambda: outcome.append(
        CliRunner().invoke(main, [*cli, *command, "--replicas", "1"])))
    running.start()
    # It waits while the replica has not applied the change (for resume, its first write) ...
    wait_for(lambda: redis.Redis(port=deployment.primary.port).hget(Keys(ns).control, field) == value,
             what=f"{field} on the primary")
    running.join(1.5)
    assert running.is_alive() and not outcome
    deployment.resume_replication(deployment.replica)  # ... and returns once it has
    running.join(60)
    assert outcome and outcome[0].exit_code == 0, outcome and outcome[0].output
    assert redis.Redis(port=deployment.replica.port).hget(Keys(ns).control, field) == value
