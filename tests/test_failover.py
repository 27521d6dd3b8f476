"""Redis as it really runs (issue 21): replicas and failover, errors a failover answers
with, outages longer than a lease. Real redis-server processes: a primary and a replica
on loopback ports, demoted and promoted with REPLICAOF."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import redis
from redis._parsers.base import BaseParser

from pipeline import scripts
from pipeline.connection import connect
from pipeline.consumer import Consumer
from pipeline.control import configure
from pipeline.controller import Controller
from pipeline.queue import Place, Published, Queue, text
from pipeline.retry import Reconnect, RedisUnavailable, is_transient
from pipeline.redis_server import free_port
from tests.groups import assert_audit_ok, claim, finish, fresh, produce
from tests.helpers import cluster_port, outage, primary_and_replica, wait_for

SPIN = ("local t0=redis.call('TIME') local s=tonumber(t0[1])+tonumber(t0[2])/1e6 while true do "
        "local t=redis.call('TIME') if tonumber(t[1])+tonumber(t[2])/1e6-s > tonumber(ARGV[1]) then break end "
        "end return 1")


def _error(fn) -> redis.RedisError:
    with pytest.raises(redis.RedisError) as info:
        fn()
    return info.value


# -- o6: which errors a failover answers with, recognised by class -------------------------


def test_a_read_only_replica_is_transient_for_commands_and_scripts(redis_factory, redis_binary):
    """Issue 21 o6: redis-py strips READONLY from the message (ReadOnlyError); Redis 6
    wraps a script's failed write as 'ERR Error running script ... -READONLY'. Both are
    waited out; each binary installed answers one of the two ways."""
    _, replica = primary_and_replica(redis_factory, redis_binary)
    # A client left on a demoted primary: its connections were checked when it was the primary.
    client = connect(replica.url, read_only=True)
    plain = _error(lambda: client.set("k", 1))
    assert isinstance(plain, redis.exceptions.ReadOnlyError) and is_transient(plain)
    scripted = _error(lambda: Queue(client, "ro").register("w"))  # one of the pipeline's own scripts
    assert "READONLY" in str(scripted) or isinstance(scripted, redis.exceptions.ReadOnlyError)
    assert is_transient(scripted)


def test_masterdown_clusterdown_and_busy_are_transient(redis_factory):
    stale = redis_factory("stale", aof=False, extra_config=["replica-serve-stale-data no"])
    connect(stale.url).replicaof("127.0.0.1", free_port())  # a primary that is gone
    masterdown = _error(lambda: connect(stale.url).get("k"))
    assert isinstance(masterdown, redis.exceptions.MasterDownError) and is_transient(masterdown)

    no_slots = redis_factory("cluster", aof=False, port=cluster_port(), extra_config=["cluster-enabled yes"])
    clusterdown = _error(lambda: redis.Redis.from_url(no_slots.url).get("k"))
    assert isinstance(clusterdown, redis.exceptions.ClusterDownError) and is_transient(clusterdown)

    busy_server = redis_factory("busy", aof=False, extra_config=["lua-time-limit 50"])
    probe, spinner = connect(busy_server.url), connect(busy_server.url)
    spinning = threading.Thread(target=lambda: spinner.eval(SPIN, 0, 1.0))
    spinning.start()
    busy = wait_for(lambda: _busy_reply(probe), what="a BUSY reply")
    spinning.join()
    assert str(busy).startswith("BUSY ") and is_transient(busy)


def _busy_reply(client) -> redis.ResponseError | None:
    try:
        client.get("k")
    except redis.ResponseError as exc:
        return exc
    except redis.ConnectionError:  # seen once on a loaded machine while the script spun: ask again
        pass
    return None


@pytest.mark.parametrize("reply, transient", [
    ("TRYAGAIN Multiple keys request during rehashing of slot", True),  # a cluster slot migrating
    ("NOREPLICAS Not enough good replicas to write.", True),
    ("UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)", True),
    ("BUSYGROUP Consumer Group name already exists", False),
    ("Command # 1 (HMGET {ns}:control paused) of pipeline caused error: BUSY Redis is busy running a script.", True),
    ("ERR unknown command 'FOO'", False),
    ("NOPERM this user has no permissions to run the 'eval' command", False),
    ("WRONGPASS invalid username-password pair or user is disabled.", False),
])
def test_replies_are_classified_as_redis_py_raises_them(reply, transient):
    """The replies no single server here gives on demand, through redis-py's own parser."""
    assert is_transient(BaseParser.parse_error(reply)) is transient
    assert is_transient(redis.ResponseError(reply)) is transient


def _demote_until_noticed(client, reconnect: Reconnect) -> threading.Thread:
    """Demote the server behind `client` (every write answers READONLY) and promote it
    again once `reconnect` has seen the outage: a failover as a client on the old
    primary lives it, the address reaching a writable primary again."""
    client.replicaof("127.0.0.1", free_port())

    def promote():
        wait_for(lambda: reconnect.down, what="a READONLY reply")
        client.replicaof("NO", "ONE")

    thread = threading.Thread(target=promote)
    thread.start()
    return thread


def test_a_publish_and_a_batch_wait_out_a_demoted_primary(redis_factory):
    """Issue 21 o6: a failover leaves clients on the old primary, now a replica, until
    they move on: the worker's publish and the trainer's next_batch wait it out."""
    primary, _ = primary_and_replica(redis_factory)
    q = Queue(connect(primary.url, socket_timeout=5), "o6")
    produce(q, 1, prefix="r")  # a result ready for the trainer
    q.push_groups(fresh(1))
    [held] = claim(q, "w", 1).groups
    admin = connect(primary.url)

    worker = Reconnect("worker w")
    promoted = _demote_until_noticed(admin, worker)
    assert worker.call(q.publish_group, "w", finish(held.group), held.token, Place.RESULTS) == Published.OK
    promoted.join()
    assert worker.outages == 1 and worker.last_error.startswith("ReadOnlyError")

    consumer = Consumer(connect(primary.url, socket_timeout=5), "o6", block_s=0.2)
    promoted = _demote_until_noticed(admin, consumer.reconnect)
    batch = consumer.next_batch(2, timeout=60)
    promoted.join()
    assert sorted(g.group_id for g in batch.groups) == ["g0", "r0"]
    assert consumer.reconnect.outages == 1
    assert consumer.commit(batch) == 2
    assert assert_audit_ok(q).committed == 2


# -- o4: every trainer-side call rides out an outage longer than the lease ------------------

LEASE_S = 1.0


def _lived(reconnect: Reconnect, since: float, seconds: float = 2 * LEASE_S):
    """The outage's end: `reconnect` has met it and it has lasted `seconds`."""
    return lambda: reconnect.down and time.monotonic() - since >= seconds


@pytest.fixture
def durable(redis_factory):
    """A server that loses nothing acknowledged across kill -9 (AOF, fsync always)."""
    return redis_factory("durable")


def test_next_batch_rides_out_an_outage_after_a_read_that_found_nothing(durable):
    """Issue 21 o4 (case A): Redis goes away right after the read script answered; the
    consumer's reap and diagnosis went to Redis outside Reconnect and raised. Now the
    batch arrives once Redis is back with a group, two leases later."""
    q = Queue(connect(durable.url), "o4")
    configure(q.redis, q.keys, lease_s=LEASE_S)
    consumer = Consumer(connect(durable.url, socket_timeout=5), "o4", block_s=0.2)
    read = consumer._scripts["read"]
    down: list[threading.Thread] = []

    def read_then_outage(*args, **kwargs):
        reply = read(*args, **kwargs)
        if not down:
            down.append(outage(durable, _lived(consumer.reconnect, time.monotonic())))
            threading.Thread(target=lambda: (down[0].join(), produce(Queue(connect(durable.url), "o4"), 1)),
                             daemon=True).start()
        return reply

    consumer._scripts["read"] = read_then_outage
    batch = consumer.next_batch(1, timeout=120)
    assert [g.group_id for g in batch.groups] == ["g0"] and consumer.reconnect.outages >= 1
    assert consumer.commit(batch) == 1
    assert_audit_ok(Queue(connect(durable.url), "o4"))


def test_an_outage_past_the_limit_is_a_clear_error(durable):
    consumer = Consumer(connect(durable.url, socket_timeout=5), "o4", block_s=0.2, outage_limit_s=0.5)
    durable.kill()
    with pytest.raises(RedisUnavailable, match=r"trainer trainer: Redis unreachable for [0-9.]+s, past the limit "
                                               r"of 0.5s: ConnectionError"):
        consumer.next_batch(1, timeout=None)


def test_the_controller_rides_out_outages(durable):
    q = Queue(connect(durable.url), "o4c")
    controller = Controller(Queue(connect(durable.url, socket_timeout=5), "o4c"))
    outage(durable, _lived(controller.reconnect, time.monotonic()))
    report = asyncio.run(controller.pause())
    assert report.requeued == 0 and controller.reconnect.outages == 1
    outage(durable, _lived(controller.reconnect, time.monotonic()))
    assert asyncio.run(controller.resume(weight_version=3)).weight_version == 3
    assert controller.reconnect.outages == 2
    assert q.redis.hget(q.keys.control, "paused") in (b"0", None)
    assert_audit_ok(q)


def test_the_slime_data_source_rides_out_outages(durable, monkeypatch):
    """Issue 21 o4 (case B): slime asks for the next rollout, saves, counts and loads while
    Redis is away for two leases; every call waits and carries on."""
    from pipeline.trainers import slime_adapter as sa
    from pipeline.trainers import slime_types as st
    from tests import fake_slime
    from tests.slime_helpers import publish_results

    monkeypatch.setitem(sys.modules, "slime", None)
    fake_slime.install(monkeypatch)
    st.slime_types.cache_clear()
    try:
        q = Queue(connect(durable.url), "o4s")
        configure(q.redis, q.keys, lease_s=LEASE_S)
        publish_results(q, [0, 1, 2, 3])
        args = SimpleNamespace(rollout_batch_size=2, n_samples_per_prompt=2, rollout_redis_url=durable.url,
                               rollout_namespace="o4s", reward_key=None, rollout_max_response_len=64,
                               save_interval=1)
        source = sa.RedisDataSource(args)
        reconnect = source.consumer.reconnect
        assert len(source.get_samples(2)) == 2
        for step in (lambda: source.get_samples(2), lambda: source.save(1), lambda: len(source)):
            outage(durable, _lived(reconnect, time.monotonic()))
            step()
        assert reconnect.outages == 3
        assert q.stats().get("committed") == 4
        assert_audit_ok(q)
    finally:
        st.slime_types.cache_clear()


def test_the_torch_adapter_rides_out_an_outage(durable):
    pytest.importorskip("torch")
    from pipeline.trainers.torch_adapter import RolloutIterable

    q = Queue(connect(durable.url), "o4t")
    configure(q.redis, q.keys, lease_s=LEASE_S)
    produce(q, 4)
    consumer = Consumer(connect(durable.url, socket_timeout=5), "o4t", block_s=0.2)
    steps = RolloutIterable(consumer, batch_size=2, timeout=120, steps=2)
    next(steps)
    outage(durable, _lived(consumer.reconnect, time.monotonic()))
    assert [g.group_id for g in (next(steps), steps.batch)[1].groups] == ["g2", "g3"]  # commits step 1 first
    assert list(steps) == [] and consumer.reconnect.outages == 1
    assert assert_audit_ok(q).committed == 4


# -- o8: an outage longer than the lease is not every worker's death ------------------------

_servers = iter(range(1, 1000))


def _silence(q: Queue, workers: list[str], lease_ms: int) -> None:
    """What an outage longer than the lease leaves behind: no renewal for 3 leases, every
    deadline passed (forced, not waited for), and another server process answering now
    (a restart's new run id: the server's own evidence of the outage, lua/_prelude.lua
    lease_clock; a silence without it is a lone death: tests/test_lease_clock.py)."""
    now = q.now_ms()
    q.redis.hset(q.keys.beats, mapping={"seen_ms": now - 3 * lease_ms, "server": f"before-restart-{next(_servers)}"})
    q.redis.zadd(q.keys.workers, {w: now - 2 * lease_ms for w in workers}, xx=True)


@pytest.fixture
def fleet(queue):
    """Two workers holding a group each, both renewed once."""
    configure(queue.redis, queue.keys, lease_s=LEASE_S)
    queue.push_groups(fresh(2))
    for w in ("w1", "w2"):
        claim(queue, w, 1)
        assert not queue.heartbeat(w, "{}").reaped
    return queue


def test_the_first_reap_after_a_long_silence_gives_every_worker_a_grace(fleet):
    """Issue 21 o8: when Redis is back after an outage longer than the lease, the first
    reaper found every lease expired and reaped the whole fleet, charging each group a
    claim. Now every worker gets a lease to renew; one that does not is reaped after it."""
    q = fleet
    _silence(q, ["w1", "w2"], 1000)
    assert q.reap_expired() == 0
    assert set(q.live_workers()) == {"w1", "w2"}
    assert not q.heartbeat("w1", "{}").reaped  # w1 is alive and renews; w2 died in the outage
    q.redis.zadd(q.keys.workers, {"w2": q.now_ms() - 1}, xx=True)  # its grace ran out
    assert q.reap_expired() == 1 and q.live_workers() == ["w1"]
    assert {w: int(c) for w, c in q.redis.hgetall(q.keys.claims).items()} == {b"g0": 1, b"g1": 1}
    assert_audit_ok(q)


def test_a_heartbeat_first_after_a_long_silence_gives_the_others_a_grace(fleet):
    """The first to reach Redis is one worker's heartbeat: its renewal must not make the
    next reaper take every other worker."""
    q = fleet
    _silence(q, ["w1", "w2"], 1000)
    assert not q.heartbeat("w1", "{}").reaped
    assert q.reap_expired() == 0 and set(q.live_workers()) == {"w1", "w2"}
    assert_audit_ok(q)


def test_workers_that_really_died_are_reaped_one_lease_after_the_silence(fleet):
    q = fleet
    _silence(q, ["w1", "w2"], 1000)
    assert q.reap_expired() == 0  # the grace, once per silence
    q.redis.zadd(q.keys.workers, {"w1": q.now_ms() - 1, "w2": q.now_ms() - 1}, xx=True)  # nobody renewed
    assert q.reap_expired() == 2 and q.live_workers() == []
    assert q.redis.llen(q.keys.prompts) == 2
    assert_audit_ok(q)


def test_a_second_silence_before_anyone_renewed_gets_a_grace_too(fleet):
    """Two outages back to back (the grace of the first ran out during the second): the
    reaper after the second still reaps nobody."""
    q = fleet
    _silence(q, ["w1", "w2"], 1000)
    assert q.reap_expired() == 0
    _silence(q, ["w1", "w2"], 1000)
    assert q.reap_expired() == 0 and set(q.live_workers()) == {"w1", "w2"}


def test_a_reaper_polling_through_the_grace_ends_it(fleet):
    """Dead workers with a live reaper: its polls are signs of life, so when the grace
    runs out the dead are reaped, not given another grace."""
    q = fleet
    _silence(q, ["w1", "w2"], 1000)
    assert q.reap_expired() == 0  # the grace
    assert q.reap_expired() == 0  # a poll during it: nobody expired
    q.redis.zadd(q.keys.workers, {"w1": q.now_ms() - 1, "w2": q.now_ms() - 1}, xx=True)
    assert q.reap_expired() == 2


def test_a_restart_longer_than_the_lease_reaps_no_live_worker(durable):
    """The same through a real restart: workers renew in threads through their Reconnect;
    Redis is down for two leases; another process reaps the moment it is back."""
    q = Queue(connect(durable.url), "o8")
    configure(q.redis, q.keys, lease_s=LEASE_S)
    q.push_groups(fresh(4))
    stop = threading.Event()
    renewers = []
    for w in ("w1", "w2"):
        claim(q, w, 2)
        reconnect, mine = Reconnect(f"worker {w}"), Queue(connect(durable.url, socket_timeout=2), "o8")

        def renew(w=w, reconnect=reconnect, mine=mine):
            while not stop.wait(LEASE_S / 4):
                assert not reconnect.call(mine.heartbeat, w, "{}").reaped, f"{w} was reaped"
        renewers.append(threading.Thread(target=renew, daemon=True))
        renewers[-1].start()
    wait_for(lambda: q.redis.hget(q.keys.beats, "seen_ms"), what="a renewal")
    killed = time.monotonic()
    outage(durable, lambda: time.monotonic() - killed >= 2 * LEASE_S).join()
    reaper = Queue(connect(durable.url), "o8")
    assert reaper.reap_expired() == 0
    wait_for(lambda: all(left > LEASE_S / 2 for left in reaper.workers().values()), what="both renewed")
    assert reaper.reap_expired() == 0
    stop.set()
    for t in renewers:
        t.join()
    assert q.redis.hlen(q.keys.claims) == 4 and all(int(c) == 1 for c in q.redis.hvals(q.keys.claims))
    assert_audit_ok(q)


# -- o7: the audit of a namespace too big to read in one step -------------------------------


def test_the_paged_audit_finds_what_the_atomic_one_found(queue):
    """Pages of 3 over 10 queued groups and 2 dead letters: a group queued twice (in two
    pages), one without payload, one committed yet queued, one dead and queued."""
    from pipeline.ops.audit import audit

    queue.push_groups(fresh(10))
    assert audit(queue, prompt_page=3, dead_page=2).ok
    k = queue.keys
    queue.redis.rpush(k.prompts, "g0")  # g0 at the head and at the tail
    queue.redis.hdel(k.payloads, "g4")
    queue.redis.zadd(k.committed, {"g5": 1})
    queue.redis.xadd(k.dead, {"gid": "g6", "data": b"", "error": "test"})
    queue.redis.xadd(k.dead, {"gid": "x", "data": b"", "error": "test"})
    report = audit(queue, prompt_page=3, dead_page=2)
    assert report.in_two_places == ["g0", "g6"] and report.committed_and_live == ["g5"]
    assert report.missing_payloads == 1 and report.dead == 2 and report.prompts == 11
    assert not report.ok


def test_the_paged_audit_is_exact_while_groups_are_pushed_and_claimed(queue, monkeypatch):
    """Between every two pages a feeder pushes rows at the tail (shifting the pages toward
    the head) and a worker claims at the head: every group that stays queued is read
    exactly once, and the audit adds up with nothing in two places."""
    from pipeline.ops import audit as audit_module

    queue.push_groups(fresh(40))
    queue.register("w")
    load, moves = scripts.load, iter(range(1000))

    def load_with_moves(client, *names):
        loaded = load(client, *names)
        if "audit_page" in loaded:
            page = loaded["audit_page"]

            def page_then_move(*args, **kwargs):
                reply = page(*args, **kwargs)
                n = next(moves)
                queue.push_groups(fresh(1 + n % 7, prefix=f"n{n}-"))  # up to 7: more than a page
                queue.claim("w", f"w:{n}", 2)
                return reply
            loaded["audit_page"] = page_then_move
        return loaded

    monkeypatch.setattr(audit_module.scripts, "load", load_with_moves)
    scan = audit_module._scan_prompts(queue, page=5)
    stayed = set(text(g) for g in queue.redis.lrange(queue.keys.prompts, 0, -1)) & {f"g{i}" for i in range(40)}
    assert stayed and stayed <= set(scan.seen)
    assert max(scan.seen.values()) == 1
    report = audit_module.audit(queue, prompt_page=5)
    assert report.ok and report.in_two_places == [], report.summary()


# -- the "also examine" list of issue 21 -------------------------------------------------------


def test_entries_recovered_after_a_lost_read_reply_come_in_stream_order(queue, client, namespace):
    """The lost read delivered g0..g2; the retry delivered g3, g4: the batch is g0..g2."""
    from tests.helpers import LoseReplies

    produce(queue, 5)
    consumer = Consumer(client, namespace, block_s=0.2)
    consumer._scripts["read"] = LoseReplies(consumer._scripts["read"], armed=1)
    batch = consumer.next_batch(3, timeout=5)
    assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
    assert [g.group_id for g in consumer.next_batch(2, timeout=5).groups] == ["g3", "g4"]


def test_a_claim_retried_after_its_lease_ran_out_returns_its_groups(queue):
    """The claim went through, its reply was lost, and the lease ran out before the retry:
    the retry returns the groups held under that claim (before, 'expired', and the groups
    sat in the in-flight hash with no task until reconciliation charged them a claim)."""
    queue.push_groups(fresh(2))
    queue.register("w")
    first = queue.claim("w", "w:1", 2)
    queue.redis.zadd(queue.keys.workers, {"w": 0}, xx=True)  # the lease ran out
    again = queue.claim("w", "w:1", 2)
    assert again.status.value == "ok" and [c.group_id for c in again.groups] == [c.group_id for c in first.groups]
    assert queue.claim("w", "w:2", 1).status.value == "expired"  # a new claim is still refused
    assert_audit_ok(queue)


def test_a_token_that_prefixes_another_is_not_taken_for_its_publish(queue):
    """publish.lua recognised a retried publish by a substring of the history: the zombie
    publish of claim w:1 matched the real publish of claim w:10 and said 'already'."""
    queue.push_groups(fresh(1))
    queue.register("w")
    [held] = queue.claim("w", "w:10", 1).groups
    assert queue.publish_group("w", finish(held.group), "w:10", Place.RESULTS) == Published.OK
    assert queue.publish_group("w", finish(held.group), "w:10", Place.RESULTS) == Published.ALREADY
    assert queue.publish_group("w", finish(held.group), "w:1", Place.RESULTS) == Published.REFUSED
    assert_audit_ok(queue)


def test_a_worker_cut_off_longer_than_its_lease_renews_before_it_reaps(redis_factory):
    """Issue 21 o8, worker side: the worker's own link is down past its lease while Redis
    and the rest of the fleet are fine (no silence, so no grace). When the link is back,
    its maintenance loop must not reap before a heartbeat renewed its lease: it would
    reap itself and cancel its own work."""
    from engines.simulator import SimConfig, start_simulator
    from tests.helpers import Forwarder, WorkerThread
    from workers.worker import SamplingSettings, WorkerSettings

    server = redis_factory("link", aof=False)
    q = Queue(connect(server.url), "cut")
    configure(q.redis, q.keys, lease_s=LEASE_S)
    q.push_groups(fresh(8))
    q.register("other")
    link = Forwarder(server.port)
    sim = start_simulator(SimConfig(seed=1, decode_tokens_per_s=20.0, length_median=400, length_p99=800))
    worker = WorkerThread(WorkerSettings(redis_url=link.url, engine_urls=[sim.url], namespace="cut",
                                         heartbeat_s=0.2, concurrency_per_engine=4,
                                         sampling=SamplingSettings(max_new_tokens=800)))
    stop = threading.Event()
    others = threading.Thread(target=lambda: [q.heartbeat("other", "{}") for _ in iter(lambda: stop.wait(0.2), True)],
                              daemon=True)
    others.start()  # the rest of the fleet renews all along: no silence
    try:
        me = worker.worker.id
        wait_for(lambda: q.redis.hlen(q.keys.inflight(me)) > 0, what="groups in flight")
        link.switch(None)
        wait_for(lambda: worker.worker.ctx.reconnect.down and q.workers()[me] < 0, what="its lease to run out")
        link.switch(server.port)
        wait_for(lambda: not worker.worker.ctx.reconnect.down and q.workers().get(me, -1) > 0,
                 what="the worker back and renewed")
        assert worker.worker.counters.reincarnations == 0 and worker.worker.id == me
        assert all(int(c) == 1 for c in q.redis.hvals(q.keys.claims))
    finally:
        stop.set()
        worker.stop()
        sim.stop()
        link.switch(None)


def test_one_group_id_in_the_training_and_the_eval_namespace_runs_twice(redis_url, client, namespace):
    """Issue 21, also examine: the worker keyed its running tasks by group id alone, so the
    same id claimed from `<ns>` and `<ns>.eval` cancelled one task for the other (and
    reconciliation handed that group back). Each namespace's copy is generated and published."""
    from engines.simulator import SimConfig, start_simulator
    from pipeline.keys import eval_namespace
    from tests.helpers import WorkerThread
    from workers.worker import SamplingSettings, WorkerSettings

    training, evaluation = Queue(client, namespace), Queue(client, eval_namespace(namespace))
    training.push_groups(fresh(1))
    evaluation.push_groups(fresh(1))
    sim = start_simulator(SimConfig(seed=2, decode_tokens_per_s=200.0, length_median=16, length_p99=32))
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         heartbeat_s=0.2, concurrency_per_engine=8,
                                         sampling=SamplingSettings(max_new_tokens=32)))
    try:
        wait_for(lambda: training.redis.xlen(training.keys.results) == 1
                 and evaluation.redis.xlen(evaluation.keys.results) == 1, what="both copies published")
        counters = worker.worker.counters
        assert counters.handed_back == 0 and counters.cancelled == 0
    finally:
        worker.stop()
        sim.stop()
    assert_audit_ok(training)
    assert_audit_ok(evaluation)


def test_a_commit_past_the_outage_limit_is_tried_again_not_stranded(durable):
    """Issue 21, also examine: a commit that raised RedisUnavailable left its entries
    pending for this session, which never delivers them again (the PyTorch adapter had
    already forgotten the batch). Now the error says the batch is not committed, and the
    adapter commits it with its next step once Redis is back."""
    pytest.importorskip("torch")
    from pipeline.trainers.torch_adapter import RolloutIterable

    q = Queue(connect(durable.url), "o4x")
    produce(q, 4)
    consumer = Consumer(connect(durable.url, socket_timeout=5), "o4x", block_s=0.2, outage_limit_s=0.3)
    steps = RolloutIterable(consumer, batch_size=2, timeout=30)
    next(steps)
    durable.kill()
    with pytest.raises(RedisUnavailable, match=r"batch trainer\.1-[0-9a-f]+/1 is not committed: call commit\(\)"):
        next(steps)
    durable.start()
    next(steps)  # commits the first batch, then the second step
    assert steps.commit() == 2
    assert assert_audit_ok(Queue(connect(durable.url), "o4x")).committed == 4


def test_a_registration_retried_after_a_heartbeat_rewrote_the_info_is_its_own(queue):
    """Issue 21, also examine: the registration went through, its reply was lost, and a
    heartbeat of the new incarnation rewrote the stored info before the retry: the retry
    was refused ('registered already'). The registration nonce in the info recognises it;
    another process's registration of the id is still refused."""
    import json

    from tests.helpers import LoseReplies

    queue._scripts["register"] = LoseReplies(queue._scripts["register"], armed=1)
    info = json.dumps({"state": "starting", "registration": "n1"})
    with pytest.raises(redis.ConnectionError):
        queue.register("w#2", info)
    assert not queue.heartbeat("w#2", json.dumps({"state": "running", "registration": "n1"})).reaped
    assert queue.register("w#2", info) > 0  # the retry
    with pytest.raises(ValueError, match="registered already"):
        queue.register("w#2", json.dumps({"state": "starting", "registration": "n2"}))
    with pytest.raises(ValueError, match="registered already"):
        queue.register("w#2", "{}")


def test_connect_waits_for_a_redis_that_is_not_up_yet_and_not_for_a_wrong_url(tmp_path):
    """A worker, the feeder or the trainer started while Redis is down (a failover, a
    long outage) waits for it (issue 21: a worker started into a reset exited); a URL that
    can never work fails at once."""
    import threading

    from pipeline.connection import ConnectionFailed, connect
    from pipeline.redis_server import RedisServer, free_port

    server = RedisServer(tmp_path / "late", port=free_port(), aof=False)
    with pytest.raises(ConnectionFailed, match="cannot reach Redis"):
        connect(server.url)  # without wait_s: at once, as one-shot commands do
    later = threading.Timer(1.0, server.start)
    later.start()
    try:
        started = time.monotonic()
        assert connect(server.url, wait_s=60).ping()
        assert 0.9 <= time.monotonic() - started < 30
        started = time.monotonic()
        with pytest.raises(ConnectionFailed, match="port must be a number"):
            connect("redis://127.0.0.1:0", wait_s=60)
        assert time.monotonic() - started < 1
    finally:
        later.join()
        server.stop()
