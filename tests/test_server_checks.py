"""A server the pipeline must not write to (issue 31): one whose maxmemory-policy can evict
the namespace's keys (items 1: groups vanished without a trace), and a replica named by a
plain URL (item 11: every writer hung on READONLY). Every writing connection is checked
where it is made (pipeline/connection.py), at start and after every reconnect; read-only
commands keep working; the audit names eviction damage."""
from __future__ import annotations

import time

import pytest
import redis

from pipeline.connection import ConnectionFailed, connect
from pipeline.ops.audit import audit
from pipeline.ops.status import snapshot
from pipeline.queue import Queue
from pipeline.retry import Reconnect, RedisUnavailable
from tests.groups import fresh, produce
from tests.helpers import one_error_line, wait_for, wait_replicated


def _evicting(redis_factory, policy: str = "allkeys-lru", maxmemory: str = "200mb"):
    return redis_factory(policy, aof=False, extra_config=[f"maxmemory {maxmemory}", f"maxmemory-policy {policy}"])


def test_a_server_that_can_evict_keys_is_refused_by_every_writer_at_once(redis_factory, run, tmp_path):
    server = _evicting(redis_factory)
    started = time.monotonic()
    with pytest.raises(ConnectionFailed) as info:
        connect(server.url, wait_s=300)  # a worker's or a feeder's start: refused at once, not waited on
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "allkeys-lru" in message and "CONFIG SET maxmemory-policy noeviction" in message and "\n" not in message
    assert not info.value.transient

    data = tmp_path / "rows.jsonl"
    data.write_text('{"input": "What is 1 + 1?", "label": "2"}\n')
    for args in (["push", str(data)], ["push", str(data), "--max-queued", "4"], ["configure", "--max-claims", "3"],
                 ["consume", "--batch-size", "1", "--steps", "1", "--timeout", "1"], ["pause"]):
        line = one_error_line(run(*args, url=server.url))
        assert "allkeys-lru" in line and "noeviction" in line, (args, line)


def test_read_only_commands_keep_working_on_an_evicting_server_and_say_why(redis_factory, run):
    server = _evicting(redis_factory)
    reader = connect(server.url, read_only=True)
    Queue(reader, "ev").push_groups(fresh(2))  # what an older version wrote there
    status = run("status", url=server.url, ns="ev")
    assert status.exit_code == 0, status.output
    assert "allkeys-lru" in status.output
    assert any("allkeys-lru" in a for a in snapshot(Queue(reader, "ev")).alerts)
    assert run("audit", url=server.url, ns="ev").exit_code == 0


def test_a_volatile_policy_is_refused_only_when_keys_carry_a_ttl(redis_factory):
    server = _evicting(redis_factory, "volatile-lru")
    connect(server.url).close()  # nothing has a TTL: nothing can be evicted
    connect(server.url, read_only=True).set("someone:cache", "x", ex=600)
    with pytest.raises(ConnectionFailed, match="volatile-lru.*1 key.*TTL"):
        connect(server.url)


def test_a_writer_that_reconnects_to_an_evicting_server_waits_saying_how_to_fix_it(redis_factory):
    """A failover can land on a replica configured differently: every new connection is
    checked, so the first call after the reconnect waits (as for an outage) and says why."""
    server = redis_factory("flip", aof=False)
    admin = connect(server.url, read_only=True)
    q = Queue(connect(server.url), "flip")
    q.push_groups(fresh(1))
    admin.config_set("maxmemory", "200mb")
    admin.config_set("maxmemory-policy", "allkeys-lru")
    admin.client_kill_filter(_type="normal", skipme=True)  # the writer's connection goes: it reconnects
    reconnect = Reconnect("worker w", max_s=0.1)
    with pytest.raises(RedisUnavailable, match="allkeys-lru.*noeviction"):
        reconnect.call(q.register, "w", deadline=time.monotonic() + 1)
    assert admin.zcard(q.keys.workers) == 0  # nothing written
    admin.config_set("maxmemory-policy", "noeviction")
    assert reconnect.call(q.register, "w") > 0


def test_the_audit_names_eviction_as_the_cause_of_lost_groups(redis_factory):
    server = _evicting(redis_factory, maxmemory="4mb")
    reader = connect(server.url, read_only=True)  # a writer of an older version
    q = Queue(reader, "ev")
    produce(q, 1)
    filler = "x" * 100_000
    pipe = reader.pipeline(transaction=False)
    for i in range(200):
        pipe.set(f"other:{i}", filler)
    pipe.execute()
    wait_for(lambda: int(reader.info("stats")["evicted_keys"]) > 0, what="an eviction")
    report = audit(Queue(reader, "ev"))
    assert report.evicted_keys > 0 and report.eviction_policy == "allkeys-lru"
    assert "evicted" in report.summary() and "allkeys-lru" in report.summary()
    assert "evicted_keys" in report.to_dict()


# -- item 11: a plain URL naming a replica ----------------------------------------------------


@pytest.fixture
def pair(redis_factory):
    primary = redis_factory("primary", aof=False)
    replica = redis_factory("replica", aof=False, extra_config=[f"replicaof 127.0.0.1 {primary.port}"])
    wait_for(lambda: connect(replica.url, read_only=True).info("replication")["master_link_status"] == "up",
             what="the replica's link")
    return primary, replica


def test_a_url_naming_a_replica_is_refused_at_once_naming_the_primary(pair, run, tmp_path):
    primary, replica = pair
    started = time.monotonic()
    with pytest.raises(ConnectionFailed) as info:
        connect(replica.url, wait_s=300)
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert f"127.0.0.1:{primary.port}" in message and "redis+sentinel://" in message and "\n" not in message

    data = tmp_path / "rows.jsonl"
    data.write_text('{"input": "What is 1 + 1?", "label": "2"}\n')
    for args in (["push", str(data)], ["configure", "--max-claims", "3"], ["pause"], ["purge", "--yes"],
                 ["consume", "--batch-size", "1", "--steps", "1", "--timeout", "5"]):
        started = time.monotonic()
        line = one_error_line(run(*args, url=replica.url))
        assert f"127.0.0.1:{primary.port}" in line and time.monotonic() - started < 10, (args, line)


def test_read_only_commands_work_on_a_replica(pair, run):
    primary, replica = pair
    q = Queue(connect(primary.url), "ro")
    produce(q, 2)
    wait_replicated(connect(primary.url), connect(replica.url, read_only=True))
    for args in (["status"], ["audit"], ["dead", "list"]):
        result = run(*args, url=replica.url, ns="ro")
        assert result.exit_code == 0, (args, result.output)


def test_a_sentinel_url_never_calls_a_replica_a_configuration_error():
    """Through Sentinel a replica answering is a failover under way: the check leaves
    that to READONLY, which stays transient (tests/test_failover.py)."""
    from pipeline.server_checks import ServerFacts, unsafe_for_writes

    facts = ServerFacts(role="slave", master="127.0.0.1:6379", link_up=True)
    assert unsafe_for_writes(facts, "redis+sentinel://127.0.0.1:26379/rollout") is None
    assert "127.0.0.1:6379" in unsafe_for_writes(facts, "redis://127.0.0.1:6380")
    assert unsafe_for_writes(ServerFacts(role="slave", master="127.0.0.1:6379", link_up=False),
                             "redis://127.0.0.1:6380") is None  # a failover under way: READONLY, transient
