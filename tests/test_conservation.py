"""Conservation under random interleavings (hypothesis stateful test).

Random sequences of push / claim (by one of three workers) / complete / abort / fail /
reap / release / next_batch / commit / a trainer restart / a zombie publish, against a
real redis-server. After every step the audit adds up (every pushed group in exactly
one place), each worker's in-flight set is what it was given, and no group id is ever
trained twice. At the end everything is drained: every pushed group reaches a
committed batch, the drop log or the dead-letter stream.
"""
from __future__ import annotations

import uuid

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from pipeline.audit import audit
from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.control import configure
from pipeline.queue import Place, Queue
from pipeline.types import Group, Status

WORKERS = ("w0", "w1", "w2")


def finish(group: Group, status: Status, reward_seed: int) -> Group:
    group.prompt_ids = [7, 8]
    for i, s in enumerate(group.samples):
        s.tokens = [7, 8, 100 + i]
        s.response_length = 1
        s.rollout_log_probs = [-0.5]
        s.weight_versions = ["0"]
        s.reward = float((reward_seed + i) % 2)
        s.status = status
    return group


class ConservationMachine(RuleBasedStateMachine):
    url: str = ""

    @initialize(use_filter=st.booleans(), max_ready=st.sampled_from([None, 3]))
    def setup(self, use_filter, max_ready):
        self.client = connect(self.url)
        self.namespace = f"cons-{uuid.uuid4().hex[:10]}"
        self.queue = Queue(self.client, self.namespace, lease_s=30)
        if max_ready is not None:
            configure(self.client, self.queue.keys, max_ready=max_ready)
        self.filter = "dapo" if use_filter else None
        self.consumer = self._consumer("trainer")
        self.next_id = 0
        self.held: dict[str, dict[str, Group]] = {w: {} for w in WORKERS}  # what each worker was given
        self.zombies: list[tuple[str, Group]] = []  # groups a worker held when it was reaped
        self.batches: list = []  # delivered, not committed
        self.committed: set[str] = set()

    def _consumer(self, name: str) -> Consumer:
        return Consumer(self.client, self.namespace, consumer=name, filter=self.filter, block_s=0.01)

    def teardown(self):
        if not hasattr(self, "queue"):
            return
        try:
            self._drain()
        finally:
            k = self.queue.keys
            self.client.delete(*k.all_fixed(), *(k.inflight(w) for w in WORKERS))
            self.client.close()

    def _drain(self):
        """Liveness: with every worker gone and the rest worked off, each pushed group
        is committed, dropped or dead."""
        q = self.queue
        for w in WORKERS:
            q.leave(w)
        self.batches.clear()
        consumer = self._consumer("drainer")  # a new trainer session: recovers what is pending
        for _ in range(200):
            q.release("continue")
            claimed = q.claim("w0", 50).groups
            for c in claimed:
                if c.group is not None:
                    q.publish_group("w0", finish(c.group, Status.COMPLETED, 0), Place.RESULTS)
            try:
                batch = consumer.next_batch(1, timeout=0.01)
            except BatchTimeout:
                if not claimed and not q.redis.llen(q.keys.prompts) and not q.redis.xlen(q.keys.requeue):
                    break
                continue
            self._check_new(batch)
            consumer.commit(batch)
            self.committed.update(g.group_id for g in batch.groups)
        report = audit(q)
        assert report.ok, report.summary()
        assert report.accounted == report.committed + report.dropped + report.dead, report.summary()
        assert report.committed == len(self.committed)

    def _check_new(self, batch):
        ids = [g.group_id for g in batch.groups]
        assert len(ids) == len(set(ids)), f"a batch holds a group twice: {ids}"
        assert not set(ids) & self.committed, f"trained twice: {set(ids) & self.committed}"
        for earlier in self.batches:
            assert not set(ids) & {g.group_id for g in earlier.groups}, "handed out twice"

    # -- producers and workers ----------------------------------------------------------

    @rule(n=st.integers(1, 4), samples=st.integers(1, 3))
    def push(self, n, samples):
        groups = [Group.fresh(f"g{self.next_id + i}", "p", samples, row=self.next_id + i) for i in range(n)]
        self.next_id += n
        self.queue.push_groups(groups)

    @rule(worker=st.sampled_from(WORKERS), n=st.integers(1, 3))
    def claim(self, worker, n):
        claim = self.queue.claim(worker, n)
        for c in claim.groups:
            assert c.group is not None, c.error
            assert c.group_id not in self.committed
            for w in WORKERS:
                assert c.group_id not in self.held[w], f"{c.group_id} claimed while {w} holds it"
            self.held[worker][c.group_id] = c.group

    def _publish(self, worker, data, place, status, error=None):
        gid = data.draw(st.sampled_from(sorted(self.held[worker])))
        group = self.held[worker].pop(gid)
        entry = self.queue.publish_group(worker, finish(group, status, data.draw(st.integers(0, 1))), place, error)
        assert entry is not None, f"{worker} could not publish {gid} it holds"

    def _holding(self):
        return [w for w in WORKERS if self.held[w]]

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def complete(self, data):
        self._publish(data.draw(st.sampled_from(self._holding())), data, Place.RESULTS, Status.COMPLETED)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def abort(self, data):
        self._publish(data.draw(st.sampled_from(self._holding())), data, Place.REQUEUE, Status.ABORTED)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def fail(self, data):
        self._publish(data.draw(st.sampled_from(self._holding())), data, Place.DEAD, Status.FAILED, "engine down")

    @rule(worker=st.sampled_from(WORKERS))
    def reap(self, worker):
        n = self.queue.reap(worker, lease_s=0)  # force expiry
        assert n == len(self.held[worker])
        self.zombies += [(worker, g) for g in self.held[worker].values()]
        self.held[worker] = {}

    @precondition(lambda self: self.zombies)
    @rule(data=st.data())
    def zombie_publish(self, data):
        worker, group = self.zombies.pop(data.draw(st.integers(0, len(self.zombies) - 1)))
        if group.group_id in self.held[worker]:
            return  # the same worker claimed it again since: not a zombie any more
        place = data.draw(st.sampled_from([Place.RESULTS, Place.REQUEUE, Place.DEAD]))
        assert self.queue.publish_group(worker, finish(group, Status.COMPLETED, 0), place, "late") is None

    @rule(policy=st.sampled_from(["continue", "continue", "restart", "drop"]))
    def release(self, policy):
        self.queue.release(policy)

    # -- trainer ------------------------------------------------------------------------

    @rule(n=st.integers(1, 3))
    def next_batch(self, n):
        try:
            batch = self.consumer.next_batch(n, timeout=0.01)
        except BatchTimeout:
            return
        assert len(batch) == n
        self._check_new(batch)
        self.batches.append(batch)

    @precondition(lambda self: self.batches)
    @rule()
    def commit(self, ):
        batch = self.batches.pop(0)
        assert self.consumer.commit(batch) == len(batch)
        ids = {g.group_id for g in batch.groups}
        assert not ids & self.committed
        self.committed |= ids

    @rule(same_name=st.booleans())
    def trainer_restart(self, same_name):
        """The trainer dies: uncommitted batches are redelivered to the next session."""
        self.batches.clear()
        self.consumer = self._consumer("trainer" if same_name else f"trainer-{uuid.uuid4().hex[:4]}")

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def audit_adds_up(self):
        if not hasattr(self, "queue"):
            return
        report = audit(self.queue)
        assert report.ok, report.summary()
        assert report.committed == len(self.committed)
        for w in WORKERS:
            actual = {g.decode() for g in self.client.smembers(self.queue.keys.inflight(w))}
            assert actual == set(self.held[w]), (w, actual, set(self.held[w]))


def test_conservation(redis_server):
    ConservationMachine.url = redis_server.url
    run_state_machine_as_test(
        ConservationMachine,
        settings=settings(max_examples=100, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    )
