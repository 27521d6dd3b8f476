"""Conservation under random interleavings (hypothesis stateful test).

Random sequences of push / claim (by one of three workers) / complete / abort / fail /
reap / release / next_batch / commit / a trainer restart / a zombie publish / a weight
version bump, against a real redis-server, with or without a dynamic-sampling filter,
a results backlog limit and a staleness bound. After every step the audit adds up
(every pushed group in exactly one place), each worker's in-flight set is what it was
given, admission stayed within (max_staleness + version + 1) * batch_size, and no
group id is ever trained twice or delivered too stale. At the end everything is
drained: every pushed group reaches a committed batch, the drop log or the
dead-letter stream.
"""
from __future__ import annotations

import uuid

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from pipeline.audit import audit
from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.control import configure, read_control, set_weight_version
from pipeline.queue import Place, Queue
from pipeline.types import Group, Status

WORKERS = ("w0", "w1", "w2")


def finish(group: Group, status: Status, reward_seed: int, version: int) -> Group:
    """One more token per sample, generated at `version`; a continued group keeps the
    tokens (and versions) it had when it was aborted."""
    group.prompt_ids = [7, 8]
    for i, s in enumerate(group.samples):
        if not s.tokens:
            s.tokens, s.response_length, s.rollout_log_probs, s.weight_versions = [7, 8], 0, [], []
        s.tokens = s.tokens + [100 + i]
        s.response_length += 1
        s.rollout_log_probs = (s.rollout_log_probs or []) + [-0.5]
        s.weight_versions = s.weight_versions + [str(version)]
        s.reward = float((reward_seed + i) % 2)
        s.status = status
    return group


class ConservationMachine(RuleBasedStateMachine):
    url: str = ""

    @initialize(use_filter=st.booleans(), max_ready=st.sampled_from([None, 3]), initial=st.integers(0, 8),
                max_staleness=st.sampled_from([None, 0, 1]), batch_size=st.integers(1, 3))
    def setup(self, use_filter, max_ready, initial, max_staleness, batch_size):
        self.client = connect(self.url)
        self.namespace = f"cons-{uuid.uuid4().hex[:10]}"
        self.queue = Queue(self.client, self.namespace, lease_s=30)
        if max_ready is not None:
            configure(self.client, self.queue.keys, max_ready=max_ready)
        self.eta, self.batch_size, self.version = max_staleness, batch_size, 0
        if max_staleness is not None:
            configure(self.client, self.queue.keys, max_staleness=max_staleness, batch_size=batch_size)
        self.filter = "dapo" if use_filter else None
        self.consumer = self._consumer("trainer")
        self.next_id = 0
        self.held: dict[str, dict[str, Group]] = {w: {} for w in WORKERS}  # what each worker was given
        self.zombies: list[tuple[str, Group]] = []  # groups a worker held when it was reaped
        self.batches: list = []  # delivered, not committed
        self.committed: set[str] = set()
        self.claimed_at: dict[str, int] = {}  # group id -> weight version of its last claim
        if initial:
            self.push(initial, 2)
        self._measure()

    def _measure(self):
        """Sizes the preconditions look at, read once per step (one round trip)."""
        k = self.queue.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.llen(k.prompts).xlen(k.results).xlen(k.requeue)
        self.sizes = dict(zip(("prompts", "results", "requeue"), pipe.execute()))

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
        k = q.keys
        for _ in range(500):
            q.release("continue")
            claim = q.claim("w0", 50)
            for c in claim.groups:
                assert c.group is not None, c.error
                q.publish_group("w0", finish(c.group, Status.COMPLETED, 0, claim.weight_version), Place.RESULTS)
            if claim.status == "budget":  # the trainer steps on
                self.bump_version()
            pipe = q.redis.pipeline(transaction=False)
            ready, queued, requeued = pipe.xlen(k.results).llen(k.prompts).xlen(k.requeue).execute()
            if not (ready or queued or requeued):
                break
            try:  # all that is left; if the filter drops some, the rest stays held for the next try
                batch = consumer.next_batch(max(1, ready), timeout=0.01)
            except BatchTimeout:
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
        if self.eta is not None:
            for g in batch.groups:
                lag = batch.weight_version - g.oldest_version()
                assert lag <= self.eta, f"{g.group_id} delivered {lag} versions behind (max {self.eta})"

    # -- producers and workers ----------------------------------------------------------

    @rule(n=st.integers(1, 4), samples=st.integers(1, 3))
    def push(self, n, samples):
        groups = [Group.fresh(f"g{self.next_id + i}", "p", samples, row=self.next_id + i) for i in range(n)]
        self.next_id += n
        self.queue.push_groups(groups)

    @precondition(lambda self: self.sizes["prompts"])
    @rule(worker=st.sampled_from(WORKERS), n=st.integers(1, 3))
    def claim(self, worker, n):
        claim = self.queue.claim(worker, n)
        for c in claim.groups:
            assert c.group is not None, c.error
            assert c.group_id not in self.committed
            for w in WORKERS:
                assert c.group_id not in self.held[w], f"{c.group_id} claimed while {w} holds it"
            self.held[worker][c.group_id] = c.group
            self.claimed_at[c.group_id] = claim.weight_version

    def _publish(self, worker, data, place, status, error=None):
        gid = data.draw(st.sampled_from(sorted(self.held[worker])))
        group = self.held[worker].pop(gid)
        version = self.claimed_at[gid]  # generated under the weights of its claim
        entry = self.queue.publish_group(worker, finish(group, status, data.draw(st.integers(0, 1)), version),
                                         place, error)
        assert entry is not None, f"{worker} could not publish {gid} it holds"

    def _holding(self):
        return [w for w in WORKERS if self.held[w]]

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def complete(self, data):
        self._publish(data.draw(st.sampled_from(self._holding())), data, Place.RESULTS, Status.COMPLETED)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), release=st.sampled_from([None, "continue", "restart", "drop"]))
    def abort(self, data, release):
        self._publish(data.draw(st.sampled_from(self._holding())), data, Place.REQUEUE, Status.ABORTED)
        if release:  # often released right away, as a worker resuming after a weight update does
            assert self.queue.release(release) >= 1

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def fail(self, data):
        self._publish(data.draw(st.sampled_from(self._holding())), data, Place.DEAD, Status.FAILED, "engine down")

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), late_publish=st.booleans())
    def reap(self, data, late_publish):
        worker = data.draw(st.sampled_from(self._holding()))
        n = self.queue.reap(worker, lease_s=0)  # force expiry
        assert n == len(self.held[worker])
        reaped, self.held[worker] = list(self.held[worker].values()), {}
        if late_publish:  # the presumed-dead worker was only slow: it tries to publish now
            for group in reaped:
                late = finish(group, Status.COMPLETED, 0, self.version)
                assert self.queue.publish_group(worker, late, Place.RESULTS) is None
        else:  # or later, perhaps after another worker claimed the same groups
            self.zombies += [(worker, g) for g in reaped]

    @precondition(lambda self: self.zombies)
    @rule(data=st.data())
    def zombie_publish(self, data):
        worker, group = self.zombies.pop(data.draw(st.integers(0, len(self.zombies) - 1)))
        if group.group_id in self.held[worker]:
            return  # the same worker claimed it again since: not a zombie any more
        place = data.draw(st.sampled_from([Place.RESULTS, Place.REQUEUE, Place.DEAD]))
        assert self.queue.publish_group(worker, finish(group, Status.COMPLETED, 0, self.version), place, "late") is None

    @precondition(lambda self: self.sizes["requeue"])
    @rule(policy=st.sampled_from(["continue", "continue", "restart", "drop"]))
    def release(self, policy):
        self.queue.release(policy)

    # -- trainer ------------------------------------------------------------------------

    @precondition(lambda self: self.sizes["results"])
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
    def commit(self):
        batch = self.batches.pop(0)
        assert self.consumer.commit(batch) == len(batch)
        ids = {g.group_id for g in batch.groups}
        assert not ids & self.committed
        self.committed |= ids

    @rule()
    def bump_version(self):
        """A training step finished and the new weights are out."""
        self.version += 1
        set_weight_version(self.client, self.queue.keys, self.version)

    @precondition(lambda self: self.batches)
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
        if self.eta is not None:
            admitted = read_control(self.client, self.queue.keys).admitted
            assert admitted <= (self.eta + self.version + 1) * self.batch_size
        pipe = self.client.pipeline(transaction=False)
        for w in WORKERS:
            pipe.smembers(self.queue.keys.inflight(w))
        for w, members in zip(WORKERS, pipe.execute()):
            actual = {g.decode() for g in members}
            assert actual == set(self.held[w]), (w, actual, set(self.held[w]))
        self._measure()


def test_conservation(redis_factory):
    # A server of its own, with a finer timer (hz) so the short blocking reads of
    # next_batch end on time instead of on the default 100 ms tick.
    server = redis_factory("conservation", aof=False, extra_config=["hz 100"])
    ConservationMachine.url = server.url
    run_state_machine_as_test(
        ConservationMachine,
        settings=settings(max_examples=100, stateful_step_count=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    )
