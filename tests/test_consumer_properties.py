"""The trainer's side under any order of calls a trainer can make (hypothesis stateful test),
against a primary and a replica that fail over and lose what the replica had not applied.

A trainer with replicas=1 takes batches, trains and commits them, hands them back, trains
some without committing them before a checkpoint and dies (its successor commits what the
checkpoint trained with commit_trained, as slime's load() does), commits a batch it handed
back or another Consumer's (refused), and keeps going after it was replaced (fenced). Replies
of its writes are lost (the write ran, the reply did not come). The primary fails over in the
middle of a write: the replica was told to stop applying, the write is made on the primary,
the replica is promoted (dropping what it had not applied) and the old primary resyncs from
it, losing the write: a write that returned before a replica had it is gone. Clients reach
the pair through one address (a forwarder) that follows the primary.

After every batch: no group in it was trained before. At the end, with everything left
drained: every produced group was trained exactly once, and the audit adds up.
tests/test_conservation.py is the model (it covers the workers' side with every operation).
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from pipeline.connection import connect
from pipeline.consumer import Batch, BatchTimeout, Consumer, SessionFenced, UncommittableBatch
from pipeline.queue import Queue
from tests.conftest import CORE_REDIS_BINARIES
from tests.groups import assert_audit_ok, produce
from tests.helpers import Forwarder, LoseReplies, primary_and_replica, wait_for, wait_replicated

#: Examples per CI run; CONSUMER_PROPERTY_EXAMPLES overrides (each runs up to STEPS calls).
EXAMPLES = int(os.environ.get("CONSUMER_PROPERTY_EXAMPLES", "40"))
STEPS = 14


class Pair:
    """A primary and a replica behind one address (the forwarder follows the primary)."""

    def __init__(self, primary, replica):
        self.primary, self.replica = primary, replica
        self.forwarder = Forwarder(primary.port)
        # The test's own admin connections (configuration, pauses, promotions): unchecked, as either
        # node may be the replica.
        self._clients = {node.port: connect(node.url, socket_timeout=5, read_only=True) for node in (primary, replica)}
        for node in (primary, replica):  # a resync at once, not after the default 5 s of waiting for more replicas
            self.client(node).config_set("repl-diskless-sync-delay", 0)

    def client(self, node):
        return self._clients[node.port]

    def synced(self) -> None:
        wait_replicated(self.client(self.primary), self.client(self.replica))

    def offset(self) -> int:
        """How far the primary's replication stream has gone (it grows with every write)."""
        return int(self.client(self.primary).info("replication")["master_repl_offset"])

    def pause_replica(self) -> int:
        """The replica stops applying; returns the primary's offset at that moment."""
        self.synced()
        self.client(self.replica).execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        return self.offset()

    def fail_over(self) -> None:
        """Promote the replica (it drops what it had not applied), then make the old primary
        its replica (a full resync: its own newer writes are gone)."""
        old, new = self.primary, self.replica
        promoted = self.client(new)
        promoted.replicaof("NO", "ONE")
        promoted.execute_command("CLIENT", "UNPAUSE")
        self.forwarder.switch(new.port)
        self.client(old).replicaof("127.0.0.1", new.port)
        self.primary, self.replica = new, old
        self.synced()


class PauseBefore:
    """Stops the replica applying right before a script's next call (direct, or queued on a
    pipeline), once; `written` once the primary has gone past that point."""

    def __init__(self, pair: Pair):
        self.pair = pair
        self.paused_at: int | None = None

    def pause(self) -> None:
        if self.paused_at is None:
            self.paused_at = self.pair.pause_replica()

    def written(self) -> bool:
        return self.paused_at is not None and self.pair.offset() > self.paused_at

    def wrap(self, script):
        cut = self

        class Paused:
            def __call__(self, *args, **kwargs):
                cut.pause()
                return script(*args, **kwargs)

            def queue(self, pipe, keys=(), args=()):
                cut.pause()
                script.queue(pipe, keys, args)

            def __getattr__(self, name):
                return getattr(script, name)

        return Paused()


class ConsumerMachine(RuleBasedStateMachine):
    pair: Pair

    @initialize()
    def setup(self):
        self.ns = f"prop-{uuid.uuid4().hex[:10]}"
        self.names = itertools.count()
        self.consumer = self._consumer()
        self.old: list[tuple[Consumer, list[Batch]]] = []  # replaced trainers and what they held
        self.batches: list[Batch] = []  # handed out by the current trainer, not trained
        self.checkpointed: list[Batch] = []  # trained by the current trainer, not committed
        self.released: list[Batch] = []  # handed back: never committable
        self.trained: set[str] = set()  # groups whose training step ran (committed or in a checkpoint)
        self.produced: list[str] = []

    def _consumer(self) -> Consumer:
        # Deliveries are not capped here (a batch redelivered by every restart would end in dead
        # letters, which test_consumer.py covers): every produced group must end up trained.
        consumer = Consumer(connect(self.pair.forwarder.url, socket_timeout=5), self.ns, block_s=0.01,
                            replicas=1, replica_timeout_s=0.05, consumer=f"t{next(self.names)}",
                            max_deliveries=1 << 30)
        consumer.reconnect.first_s, consumer.reconnect.max_s = 0.002, 0.05
        return consumer

    def _lose_next_reply(self, name: str) -> None:
        """The next call of script `name` runs and its reply is lost (the writer settles; the
        Consumer starts its session, reads and hands back)."""
        scripts = self.consumer.writer._scripts if name == "settle" else self.consumer._scripts
        scripts[name] = LoseReplies(scripts[name], armed=1)

    def _check_new(self, batch: Batch) -> None:
        ids = [g.group_id for g in batch.groups]
        assert len(ids) == len(set(ids)), f"a batch holds a group twice: {ids}"
        assert not set(ids) & self.trained, f"trained twice: {sorted(set(ids) & self.trained)}"
        held = {g.group_id for b in self.batches + self.checkpointed for g in b.groups}
        assert not set(ids) & held, f"handed out twice: {sorted(set(ids) & held)}"

    def _trained(self, batch: Batch) -> None:
        ids = {g.group_id for g in batch.groups}
        assert not ids & self.trained, f"trained twice: {sorted(ids & self.trained)}"
        self.trained |= ids

    # -- workers (their writes are on the replica before the next rule: only the trainer's can be lost)

    @rule(n=st.integers(1, 3))
    def produce(self, n):
        prefix = f"g{len(self.produced)}."
        self.produced += produce(Queue(self.pair.client(self.pair.primary), self.ns), n, prefix=prefix)
        self.pair.synced()

    # -- the trainer ---------------------------------------------------------------------------

    def _available(self) -> int:
        """Groups the trainer can be handed now: produced, not trained, not in its hands."""
        return len(self.produced) - len(self.trained) - sum(len(b) for b in self.batches)

    @precondition(lambda self: self._available())
    @rule(n=st.integers(1, 3), lose=st.sampled_from([None, "session", "read", "settle"]))
    def next_batch(self, n, lose):
        """Only as many as there are (a wait that times out would make the runs differ)."""
        n = min(n, self._available())
        if lose:
            self._lose_next_reply(lose)
        batch = self.consumer.next_batch(n, timeout=30)
        assert len(batch) == n
        self._check_new(batch)
        self.batches.append(batch)

    @precondition(lambda self: self.batches)
    @rule(lose=st.booleans())
    def train_and_commit(self, lose):
        batch = self.batches.pop(0)
        if lose:
            self._lose_next_reply("settle")
        self._trained(batch)
        assert self.consumer.commit(batch) == len(batch)

    @precondition(lambda self: self.batches)
    @rule()
    def train_without_committing(self):
        """Trained, in the checkpoint the trainer saves next; committed later, or by the next
        trainer's commit_trained."""
        batch = self.batches.pop(0)
        self._trained(batch)
        self.checkpointed.append(batch)

    @precondition(lambda self: self.checkpointed)
    @rule()
    def commit_checkpointed(self):
        batch = self.checkpointed.pop(0)
        assert self.consumer.commit(batch) == len(batch)

    @precondition(lambda self: self.batches)
    @rule(lose=st.booleans())
    def release(self, lose):
        batch = self.batches.pop(0)
        if lose:
            self._lose_next_reply("redeliver")
        self.consumer.release(batch, "the step failed")
        self.released.append(batch)

    @precondition(lambda self: self.released or self.batches)
    @rule(data=st.data())
    def commit_what_is_not_this_consumers(self, data):
        """A batch it handed back, or one another Consumer object of the process delivered."""
        if self.released and (not self.batches or data.draw(st.booleans())):
            consumer, batch = self.consumer, data.draw(st.sampled_from(self.released))
        else:
            consumer, batch = self._consumer(), self.batches[0]
        with pytest.raises(UncommittableBatch):
            consumer.commit(batch)

    @rule(lose=st.booleans())
    def restart(self, lose):
        """The trainer dies; the next one commits what the checkpoint trained, and gets the
        rest (batches handed out and not trained) delivered again."""
        self._replace_trainer()
        if lose:
            self._lose_next_reply("session")
        self._commit_checkpoint()

    def _replace_trainer(self) -> None:
        self.old.append((self.consumer, self.batches))
        self.consumer = self._consumer()

    def _commit_checkpoint(self) -> None:
        entries = {eid for b in self.checkpointed for eid in b.entry_ids}
        assert self.consumer.commit_trained(entries, "checkpoint") == len(entries)
        self.batches, self.checkpointed, self.released = [], [], []

    @precondition(lambda self: any(held for _, held in self.old))
    @rule(data=st.data())
    def a_replaced_trainer_goes_on(self, data):
        old, held = data.draw(st.sampled_from([(c, h) for c, h in self.old if h]))
        with pytest.raises(SessionFenced):
            if data.draw(st.booleans()):
                old.commit(held[0])
            else:
                old.next_batch(1, timeout=30)

    # -- failovers -----------------------------------------------------------------------------

    @precondition(lambda self: self.batches)
    @rule()
    def failover_during_a_commit(self):
        self._lossy("settle", lambda: self.train_and_commit(False))

    @precondition(lambda self: self._available())
    @rule()
    def failover_during_a_delivery(self):
        self._lossy("read", lambda: self.next_batch(1, None))

    @precondition(lambda self: self.batches)
    @rule()
    def failover_during_a_hand_back(self):
        self._lossy("redeliver", lambda: self.release(False))

    @precondition(lambda self: self.checkpointed)
    @rule()
    def failover_during_a_restarts_commit_of_its_checkpoint(self):
        self._replace_trainer()
        self._lossy("settle", self._commit_checkpoint)

    def _lossy(self, script: str, work) -> None:
        """Right before the trainer's next call of `script` the replica stops applying; once
        the primary has that write, it fails over. A write that returned before a replica had
        it is gone: its batch would be trained twice, or a hand-back forgotten."""
        cut = PauseBefore(self.pair)
        # A settle is the writer's; the queue's too, for one that would bypass it (as
        # commit_trained's did before issue 31: the machine finds that).
        holders = [self.consumer.writer._scripts, self.consumer.queue._scripts] if script == "settle" else [
            self.consumer._scripts]
        real = [h[script] for h in holders]
        for h in holders:
            h[script] = cut.wrap(h[script])
        errors: list[BaseException] = []

        def run():
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        writing = threading.Thread(target=run, daemon=True)
        writing.start()
        wait_for(lambda: not writing.is_alive() or cut.written(), timeout=30, interval=0.005,
                 what="the trainer to write or return")
        for h, script_before in zip(holders, real):
            h[script] = script_before
        cut.pause()  # (once: a step that made no such write fails over without a loss)
        self.pair.fail_over()
        writing.join(60)
        assert not writing.is_alive(), "the trainer did not finish after the failover"
        if errors:
            raise errors[0]

    # -- the end -------------------------------------------------------------------------------

    def teardown(self):
        if not hasattr(self, "consumer"):
            return
        last = self._consumer()  # a new trainer: commits what the checkpoint trained, takes the rest over
        last.commit_trained({eid for b in self.checkpointed for eid in b.entry_ids}, "checkpoint")
        self.batches, self.checkpointed = [], []  # the last trainer's, untrained: delivered again
        while len(self.trained) < len(self.produced):
            batch = last.next_batch(1, timeout=10)
            self._check_new(batch)
            self._trained(batch)
            last.commit(batch)
        with pytest.raises(BatchTimeout):  # nothing is delivered again (a lost commit would be)
            batch = last.next_batch(1, timeout=0.2)
            self._check_new(batch)
        assert sorted(self.trained) == sorted(self.produced)
        queue = Queue(self.pair.client(self.pair.primary), self.ns)
        report = assert_audit_ok(queue)
        assert report.committed == len(self.produced)
        queue.redis.delete(*queue.keys.all_fixed())


@pytest.mark.slow
def test_the_consumer_trains_every_group_once_through_any_calls_and_lossy_failovers(redis_factory):
    binary = CORE_REDIS_BINARIES[max(CORE_REDIS_BINARIES, key=lambda v: tuple(map(int, v.split("."))))]
    ConsumerMachine.pair = Pair(*primary_and_replica(redis_factory, binary))
    logging.disable(logging.WARNING)  # the outages and refusals the machine provokes
    try:
        run_state_machine_as_test(
            ConsumerMachine,
            settings=settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow]))
    finally:
        logging.disable(logging.NOTSET)
        ConsumerMachine.pair.forwarder.switch(None)
