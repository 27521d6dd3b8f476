"""Redis behind Sentinel (issue 21): a primary, a replica and three Sentinels on loopback
ports; the primary is killed and Sentinel promotes the replica. A worker, the feeder and a
trainer connected through `redis+sentinel://` carry on against the new primary, and the
audit is clean."""
from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
import redis

from pipeline.connection import ConnectionFailed, connect, sentinel_target
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.control import configure
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Queue
from pipeline.redis_server import RedisServer, find_redis_server, free_port
from pipeline.retry import Reconnect
from pipeline.ops.audit import audit
from tests.groups import produce
from tests.helpers import Forwarder, wait_for, wait_replicated

SERVICE = "rollout"


class SentinelDeployment:
    """A primary, a replica and three Sentinels (quorum 2) watching them, started from the
    redis-server binary the project uses (`redis-server <conf> --sentinel`)."""

    def __init__(self, root: Path):
        self.root = root
        self.primary = RedisServer(root / "a", port=free_port(), aof=False)
        # The replication link runs through a forwarder, so a test can cut it (a partition,
        # or a replica lagging behind) while Sentinel still sees both servers.
        self.link = Forwarder(self.primary.port)
        self.replica = RedisServer(root / "b", port=free_port(), aof=False,
                                   extra_config=[f"replicaof 127.0.0.1 {self.link.port}"])
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{SERVICE}"

    def start(self) -> SentinelDeployment:
        self.primary.start()
        self.replica.start()
        wait_replicated(redis.Redis(port=self.primary.port), redis.Redis(port=self.replica.port))
        for i, port in enumerate(self.sentinel_ports):
            folder = self.root / f"s{i}"
            folder.mkdir(parents=True)
            conf = folder / "sentinel.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {folder}", f"logfile {folder / 'sentinel.log'}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2",
                f"sentinel down-after-milliseconds {SERVICE} 1000",
                f"sentinel failover-timeout {SERVICE} 10000",
            ]) + "\n")
            self.sentinels.append(subprocess.Popen([find_redis_server(), str(conf), "--sentinel"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in self.sentinel_ports:  # each knows the replica and the other two
            s = redis.Redis(port=port, socket_timeout=2)
            wait_for(lambda s=s: _answers(s) and int(s.sentinel_master(SERVICE)["num-other-sentinels"]) == 2
                     and int(s.sentinel_master(SERVICE)["num-slaves"]) == 1, what="Sentinels in agreement")
        return self

    def primary_port(self) -> int:
        host, port = redis.Redis(port=self.sentinel_ports[0]).sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def stop(self) -> None:
        self.link.switch(None)
        for p in self.sentinels:
            p.kill()
            p.wait()
        self.primary.kill()
        self.replica.kill()


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


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
    redis+sentinel URL, every group of the dataset is trained once, the audit is clean."""
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
    consumer = Consumer(connect(url, socket_timeout=5), ns, block_s=0.2)
    trained: list[str] = []
    old_primary = deployment.primary_port()
    try:
        while len(trained) < total:
            if len(trained) >= total // 3 and deployment.primary.process.poll() is None:
                deployment.primary.kill()  # the failover, mid-run
            try:
                batch = consumer.next_batch(4 if total - len(trained) >= 4 else total - len(trained), timeout=60)
            except BatchTimeout:
                continue
            consumer.commit(batch)
            trained += [g.group_id for g in batch.groups]
        feeder.join(60)
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
    deployment.link.switch(None)  # the replica misses everything from here on
    second = trainer.next_batch(2, timeout=10)
    assert trainer.commit(second) == 2  # acknowledged by the primary only
    old_primary = deployment.primary_port()
    deployment.primary.kill()
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
    deployment.link.switch(None)  # the replica misses everything from here on ...
    second = trainer.next_batch(2, timeout=10)
    restored = threading.Thread(target=lambda: (wait_for(lambda: trainer.reconnect.down, what="an unreplicated commit"),
                                                deployment.link.switch(deployment.primary.port)))
    restored.start()  # ... until the commit has waited for it
    assert trainer.commit(second) == 2
    restored.join()
    assert "reached 0 of 1 replicas" in trainer.reconnect.last_error
    produce(q, 1, prefix="after")
    wait_replicated(redis.Redis(port=deployment.primary.port), redis.Redis(port=deployment.replica.port))
    deployment.primary.kill()
    batch = trainer.next_batch(1, timeout=60)
    assert [g.group_id for g in batch.groups] == ["after0"]  # not the second batch again
    trainer.replicas = 0  # the promoted replica has no replica of its own: no commit could be confirmed
    assert trainer.commit(batch) == 1
    report = audit(Queue(connect(url), ns))
    assert report.ok and report.committed == 5, report.summary()
