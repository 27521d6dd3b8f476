"""Conservation under random interleavings (hypothesis stateful test).

Random sequences of push / claim (by one of three workers) / complete / abort / fail /
an in-flight checkpoint (by the holder, or too late by a reaped incarnation) / reap (after
which the same worker process registers anew and may claim the same groups again) / a
zombie publish / release / next_batch / commit / release of a batch / a new
trainer session overlapping the old one / lost replies (the script runs, its reply is
lost, the caller retries) / a Redis restart (dataset reloaded, every connection and
script dropped) / a weight version bump, against a real redis-server, with or without
a dynamic-sampling filter, a results backlog limit and a staleness bound.

After every step the audit adds up (every pushed group in exactly one place), each
worker's in-flight hash is what it was given, admission stayed within
(max_staleness + version + 1) * batch_size, and no group id is ever committed twice or
delivered too stale; a claim hands out exactly the checkpoint the group's last holder
wrote, and none once the group was published (the audit finds no checkpoint without its
group). At the end everything is drained: every pushed group reaches a committed batch,
the drop log or the dead-letter stream.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from pipeline.checkpoints import CheckpointLog, CheckpointOutcome
from pipeline.ops.audit import audit
from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer, SessionFenced
from pipeline.control import DEFAULT_MAX_READY, configure, read_control, set_weight_version, staleness_limit
from pipeline.queue import ClaimStatus, Place, Published, Queue, text
from pipeline.types import Group, Status
from tests.groups import generate
from tests.helpers import LoseReplies

ROOT = Path(__file__).resolve().parent.parent  # where `python -m tests.test_conservation` runs
WORKERS = ("w0", "w1", "w2")
#: Examples per CI run (issue 8 asks for at least 2,000); CONSERVATION_EXAMPLES overrides.
EXAMPLES = int(os.environ.get("CONSERVATION_EXAMPLES", "2000"))


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
    can_reload: bool = True

    @initialize(use_filter=st.booleans(), max_ready=st.sampled_from([None, 3]), initial=st.integers(0, 8),
                max_staleness=st.sampled_from([None, 0, 1]), batch_size=st.integers(1, 3))
    def setup(self, use_filter, max_ready, initial, max_staleness, batch_size):
        self.client = connect(self.url)
        self.namespace = f"cons-{uuid.uuid4().hex[:10]}"
        self.queue = Queue(self.client, self.namespace)
        self.lossy = {name: LoseReplies(self.queue._scripts[name])
                      for name in ("claim", "publish", "settle", "checkpoint")}
        self.queue._scripts.update(self.lossy)
        self.max_ready = DEFAULT_MAX_READY if max_ready is None else max_ready
        if max_ready is not None:
            configure(self.client, self.queue.keys, max_ready=max_ready)
        self.eta, self.batch_size, self.version = max_staleness, batch_size, 0
        if max_staleness is not None:
            configure(self.client, self.queue.keys, max_staleness=max_staleness, batch_size=batch_size)
        self.filter = "dapo" if use_filter else None
        self.ids = {w: f"{w}#1" for w in WORKERS}  # each worker process's current registered id
        for w in WORKERS:
            self.queue.register(self.ids[w])
        self.claims = 0
        self.consumer = self._consumer()
        self.old_sessions: list[tuple[Consumer, list]] = []  # fenced sessions and what they held
        self.next_id = 0
        self.held: dict[str, dict[str, tuple[Group, str]]] = {w: {} for w in WORKERS}  # gid -> (group, token)
        self.zombies: list[tuple[str, Group, str]] = []  # (old id, group, token) of reaped incarnations
        self.batches: list = []  # delivered to the current session, not committed
        self.committed: set[str] = set()
        self.claimed_at: dict[str, int] = {}  # group id -> weight version of its last claim
        self.logs: dict[str, CheckpointLog] = {}  # group id -> its holder's checkpoint log (this claim's)
        self.saved: dict[str, dict] = {}  # group id -> what its checkpoint holds (the last write that went in)
        if initial:
            self.push(initial, 2)
        self._measure()

    def _measure(self) -> dict[str, dict[str, str]]:
        """Sizes the preconditions look at and what each worker holds in Redis (group id
        -> claim token), read once per step in one round trip."""
        k = self.queue.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.llen(k.prompts).xlen(k.results).xlen(k.requeue)
        for w in WORKERS:
            pipe.hgetall(k.inflight(self.ids[w]))
        replies = pipe.execute()
        self.sizes = dict(zip(("prompts", "results", "requeue"), replies[:3]))
        return {w: {text(g): text(t) for g, t in held.items()} for w, held in zip(WORKERS, replies[3:])}

    def _consumer(self) -> Consumer:
        consumer = Consumer(self.client, self.namespace, filter=self.filter, block_s=0.01)
        consumer.reconnect.first_s = 0.001  # lost replies are retried at once
        consumer.writer._scripts["settle"] = self.lossy["settle"]  # the consumer's settles go through its writer
        return consumer

    def _retrying(self, fn, *args):
        """What the worker's Reconnect does: the same call again after a lost reply."""
        try:
            return fn(*args)
        except redis.ConnectionError:
            return fn(*args)

    def teardown(self):
        if not hasattr(self, "queue"):
            return
        try:
            self._drain()
        finally:
            self.client.delete(*self.queue.keys.all_fixed(),
                               *(self.queue.keys.inflight(w) for w in self.queue.workers()))
            self.client.close()

    def _drain(self):
        """Liveness: with every worker gone and the rest worked off, each pushed group
        is committed, dropped or dead."""
        q = self.queue
        for lossy in self.lossy.values():
            lossy.armed = 0
        for w in WORKERS:
            q.leave(self.ids[w])
        self.batches.clear()
        # The run is over: the last groups need not fill a whole batch of B.
        configure(self.client, q.keys, max_staleness=-1, batch_size=-1)
        self.eta = None
        consumer = self._consumer()  # a new trainer session: takes over what is pending
        k = q.keys
        q.register("drainer")
        for n in range(500):
            q.release("continue")
            claim = q.claim("drainer", f"drainer:{n}", 50)
            for c in claim.groups:
                assert c.group is not None
                assert q.publish_group("drainer", finish(c.group, Status.COMPLETED, 0, claim.weight_version),
                                       c.token, Place.RESULTS) == Published.OK
            if claim.status == ClaimStatus.BUDGET:  # the trainer steps on
                self.bump_version()
            pipe = q.redis.pipeline(transaction=False)
            ready, queued, requeued = pipe.xlen(k.results).llen(k.prompts).xlen(k.requeue).execute()
            if not (ready or queued or requeued):
                break
            try:  # all that is left; if the filter drops some, the rest stays held for the next try
                batch = consumer.next_batch(max(1, min(ready, self.max_ready)), timeout=0.01)
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
        assert self.queue.push_groups(groups) == n

    @precondition(lambda self: self.sizes["prompts"])
    @rule(worker=st.sampled_from(WORKERS), n=st.integers(1, 3), lose_reply=st.booleans())
    def claim(self, worker, n, lose_reply):
        self.claims += 1
        self.lossy["claim"].armed = int(lose_reply)
        claim = self._retrying(self.queue.claim, self.ids[worker], f"{self.ids[worker]}:{self.claims}", n)
        for c in claim.groups:
            assert c.group is not None
            assert c.group_id not in self.committed
            for w in WORKERS:
                assert c.group_id not in self.held[w], f"{c.group_id} claimed while {w} holds it"
            self.held[worker][c.group_id] = (c.group, c.token)
            self.claimed_at[c.group_id] = claim.weight_version
            # The checkpoint the last holder wrote comes with the claim; none after a publish.
            got = None if c.checkpoint is None else held_progress(c.checkpoint)
            assert got == self.saved.get(c.group_id), (c.group_id, got, self.saved.get(c.group_id))
            self.logs[c.group_id] = CheckpointLog(c.group_id, c.token, c.checkpoint)

    def _publish(self, worker, data, place, status, error=None):
        gid = data.draw(st.sampled_from(sorted(self.held[worker])))
        group, token = self.held[worker].pop(gid)
        version = self.claimed_at[gid]  # generated under the weights of its claim
        self.lossy["publish"].armed = int(data.draw(st.booleans()))
        outcome = self._retrying(self.queue.publish_group, self.ids[worker],
                                 finish(group, status, data.draw(st.integers(0, 1)), version), token, place, error)
        assert outcome in (Published.OK, Published.ALREADY), f"{worker} could not publish {gid} it holds"
        self.saved.pop(gid, None)  # its checkpoint went with it

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
        """A worker stalls past its lease and is reaped; the same process then learns it
        at its next contact and registers as a new incarnation."""
        worker = data.draw(st.sampled_from(self._holding()))
        old = self.ids[worker]
        self.client.zadd(self.queue.keys.workers, {old: 0}, xx=True)  # its lease ran out
        assert self.queue.reap(old) == len(self.held[worker])
        assert self.queue.heartbeat(old, "{}").reaped
        assert self.queue.claim(old, f"{old}:late", 1).status == ClaimStatus.UNREGISTERED
        reaped, self.held[worker] = list(self.held[worker].values()), {}
        incarnation = int(old.split("#")[1]) + 1
        self.ids[worker] = f"{worker}#{incarnation}"
        self.queue.register(self.ids[worker])
        if late_publish:  # the presumed-dead incarnation was only slow: it tries to publish now
            for group, token in reaped:
                late = finish(group, Status.COMPLETED, 0, self.version)
                assert self.queue.publish_group(old, late, token, Place.RESULTS) == Published.REFUSED
        else:  # or later, perhaps after its own new incarnation claimed the same groups
            self.zombies += [(old, g, t) for g, t in reaped]

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), tokens=st.integers(0, 3), lose_reply=st.booleans())
    def checkpoint(self, data, tokens, lose_reply):
        """The holder saves a group's progress (a lost reply is retried, as Reconnect does)."""
        worker = data.draw(st.sampled_from(self._holding()))
        gid = data.draw(st.sampled_from(sorted(self.held[worker])))
        group, token = self.held[worker][gid]
        log = self.logs[gid]
        write = log.next_write(generate(group, tokens) if tokens else group)
        if write is None:
            return
        self.lossy["checkpoint"].armed = int(lose_reply)
        [outcome] = self._retrying(self.queue.checkpoint, self.ids[worker], [write])
        assert outcome in (CheckpointOutcome.OK, CheckpointOutcome.ALREADY), outcome
        log.settle(write, outcome)
        self.saved[gid] = {i: (s.response_tokens, list(s.rollout_log_probs or []) or s.rollout_log_probs,
                               list(s.weight_versions), s.status)
                           for i, s in enumerate(group.samples) if s.response_length or s.status != Status.PENDING}

    @precondition(lambda self: self.zombies)
    @rule(data=st.data())
    def zombie_checkpoint(self, data):
        """A reaped incarnation, only slow, saves its progress: refused, whoever holds the group now."""
        old, group, token = data.draw(st.sampled_from(self.zombies))
        progress = generate(Group.fresh(group.group_id, "p", group.n_samples), 1)  # what it made since: any
        write = CheckpointLog(group.group_id, token).next_write(progress)
        assert self.queue.checkpoint(old, [write]) == [CheckpointOutcome.REFUSED]

    @precondition(lambda self: self.zombies)
    @rule(data=st.data())
    def zombie_publish(self, data):
        old, group, token = self.zombies.pop(data.draw(st.integers(0, len(self.zombies) - 1)))
        place = data.draw(st.sampled_from([Place.RESULTS, Place.REQUEUE, Place.DEAD]))
        late = finish(group, Status.COMPLETED, 0, self.version)
        assert self.queue.publish_group(old, late, token, place, "late") == Published.REFUSED

    @precondition(lambda self: self.sizes["requeue"])
    @rule(policy=st.sampled_from(["continue", "continue", "restart", "drop"]))
    def release(self, policy):
        self.queue.release(policy)

    # -- trainer ------------------------------------------------------------------------

    @precondition(lambda self: self.sizes["results"])
    @rule(n=st.integers(1, 3), lose_reply=st.booleans())
    def next_batch(self, n, lose_reply):
        if self.eta is not None:
            n = self.batch_size  # pacing counts in batches of B: next_batch asks for exactly B
        if n + sum(len(b) for b in self.batches) > self.max_ready:  # could never fill: refused at the call
            with pytest.raises(ValueError, match="max_ready"):
                self.consumer.next_batch(n, timeout=0.01)
            return
        self.lossy["settle"].armed = int(lose_reply)  # a lost reply while screening settles entries
        try:
            batch = self.consumer.next_batch(n, timeout=0.01)
        except BatchTimeout:
            return
        finally:
            self.lossy["settle"].armed = 0
        assert len(batch) == n
        self._check_new(batch)
        self.batches.append(batch)

    @precondition(lambda self: self.batches)
    @rule(lose_reply=st.booleans())
    def commit(self, lose_reply):
        batch = self.batches.pop(0)
        self.lossy["settle"].armed = int(lose_reply)
        assert self.consumer.commit(batch) == len(batch)
        ids = {g.group_id for g in batch.groups}
        assert not ids & self.committed
        self.committed |= ids

    @precondition(lambda self: self.batches)
    @rule()
    def release_batch(self):
        """The training step failed: the batch is handed back and comes first again."""
        self.consumer.release(self.batches.pop(0))

    @rule()
    def bump_version(self):
        """A training step finished and the new weights are out."""
        self.version += 1
        set_weight_version(self.client, self.queue.keys, self.version)

    @rule()
    def new_trainer_session(self):
        """A second trainer starts while the first still holds batches (a rolling
        restart, or a trainer that died mid-step): the new session fences the old one."""
        self.old_sessions.append((self.consumer, self.batches))
        self.batches = []
        self.consumer = self._consumer()

    @precondition(lambda self: self.old_sessions and self.consumer.session is not None)
    @rule(data=st.data())
    def fenced_session_acts(self, data):
        """The replaced session tries to go on: every read and commit is refused."""
        old, held = data.draw(st.sampled_from(self.old_sessions))
        if old.session is None:
            return  # it never started: nothing to fence
        try:
            if held and data.draw(st.booleans()):
                old.commit(held[0])
            else:
                old.next_batch(self.batch_size if self.eta is not None else 1, timeout=0.01)
        except SessionFenced:
            return
        raise AssertionError("a fenced trainer session read or committed")

    @precondition(lambda self: ConservationMachine.can_reload)
    @rule()
    def redis_restart(self):
        """The dataset is written out and loaded back, every client connection is cut and
        every script forgotten: what a restart from disk does to its clients."""
        admin = connect(self.url)
        admin.execute_command("DEBUG", "RELOAD")
        admin.script_flush()
        admin.client_kill_filter(_type="normal", skipme=True)
        admin.close()

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
            assert admitted <= staleness_limit(self.eta, self.version, self.batch_size)
        for w, actual in self._measure().items():
            assert actual == {gid: token for gid, (_, token) in self.held[w].items()}, (w, actual)


def held_progress(checkpoint) -> dict:
    return {i: (p.response_ids, p.log_probs, p.weight_versions, p.status) for i, p in checkpoint.samples.items()}


def _server(redis_factory, name: str):
    """A server of its own, with a finer timer (hz) so the short blocking reads of
    next_batch end on time instead of on the default 100 ms tick; DEBUG RELOAD for the
    restart rule (Redis 7 refuses DEBUG unless enabled)."""
    server = redis_factory(name, aof=False, port=None, extra_config=["hz 100"])
    probe = connect(server.url)
    version = probe.info("server")["redis_version"]
    probe.close()
    if int(version.split(".")[0]) >= 7:
        server.stop()
        server = redis_factory(f"{name}-7", aof=False, port=None, extra_config=["hz 100", "enable-debug-command yes"])
    return server


def run_examples(url: str, examples: int) -> None:
    ConservationMachine.url = url
    run_state_machine_as_test(
        ConservationMachine,
        settings=settings(max_examples=examples, stateful_step_count=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    )


@pytest.mark.timeout(900)  # 2,000 examples: ~2.5 minutes on a quiet CI machine, several on a loaded one
def test_conservation(redis_factory):
    """EXAMPLES in all, split between this process and a child process (each with its
    own server and its own random seed) so that both cores of a CI machine work."""
    shards = min(2, os.cpu_count() or 1)
    urls = [_server(redis_factory, f"conservation{i}").url for i in range(shards)]
    share = EXAMPLES // shards
    children = [subprocess.Popen([sys.executable, "-m", "tests.test_conservation", url, str(share)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for url in urls[1:]]
    try:
        run_examples(urls[0], EXAMPLES - share * len(children))
        outputs = [child.communicate()[0] for child in children]
    finally:  # a failure here, or the test's timeout: no child outlives the test
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    for child, output in zip(children, outputs):
        assert child.returncode == 0, f"the conservation machine failed in the child process:\n{output}"


if __name__ == "__main__":  # a shard of test_conservation, run by it in a child process
    logging.disable(logging.WARNING)  # the reaps and refusals the machine provokes; a failure prints its example
    run_examples(sys.argv[1], int(sys.argv[2]))
