"""A Redis deployment behind Sentinel on loopback ports, for tests and the fault campaign:
two data nodes (a primary and its replica) and three Sentinels (quorum 2) watching them,
all started from the redis-server binary the project uses (`redis-server <conf>
--sentinel`: no package beyond redis-server).

Clients reach it through `url` (`redis+sentinel://...`, pipeline/connection.py). Sentinel
promotes the replica when the primary is down for `down_after_ms`; `start_node()` brings a
node back as the primary it still is, or as a replica of the primary Sentinel names now
(an old primary rejoining after a failover). `pause_replication()` makes a replica stop
applying the primary's writes (CLIENT PAUSE WRITE on it; Sentinel still sees it healthy,
the primary's WAIT sees it lagging): killing the primary then fails over to a replica
that missed the last writes, since a replica drops the part of the stream it had not
applied when its primary goes away.
"""
from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from .redis_server import Fsync, RedisServer, find_redis_server, free_port, replica_caught_up

log = logging.getLogger(__name__)

SERVICE = "rollout"


class DeploymentError(RuntimeError):
    pass


def _wait(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise DeploymentError(f"timed out after {timeout_s:g}s waiting for {what}")


def _client(port: int, timeout_s: float = 2.0) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


class SentinelDeployment:
    """A primary, a replica and three Sentinels (quorum 2) on loopback ports."""

    def __init__(self, root: Path, aof: bool = False, fsync: Fsync = Fsync.ALWAYS, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 10000, service: str = SERVICE):
        self.root = Path(root)
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        # The nodes' roles when started; Sentinel decides them afterwards (primary_node()).
        self.primary = RedisServer(self.root / "a", port=free_port(), aof=aof, fsync=fsync)
        self.replica = RedisServer(self.root / "b", port=free_port(), aof=aof, fsync=fsync,
                                   extra_config=[f"replicaof 127.0.0.1 {self.primary.port}"])
        self.nodes = [self.primary, self.replica]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []
        self._sentinel_clients = [_client(p, 1.0) for p in self.sentinel_ports]
        self._paused: RedisServer | None = None  # a replica told to stop applying writes

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{self.service}"

    def start(self) -> SentinelDeployment:
        self.primary.start()
        self.replica.start()
        self.wait_synced(self.primary, self.replica)
        for i, port in enumerate(self.sentinel_ports):
            folder = self.root / f"s{i}"
            folder.mkdir(parents=True, exist_ok=True)
            conf = folder / "sentinel.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {folder}", f"logfile {folder / 'sentinel.log'}",
                f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 2",
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
            ]) + "\n")
            self.sentinels.append(subprocess.Popen([find_redis_server(), str(conf), "--sentinel"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                   start_new_session=True))

        def agreed(s: redis.Redis) -> bool:  # each knows the replica and the other two
            master = s.sentinel_master(self.service)
            return int(master["num-other-sentinels"]) == 2 and int(master["num-slaves"]) == 1

        for s in self._sentinel_clients:
            _wait(lambda s=s: agreed(s), 30, "the Sentinels to agree")
        return self

    # -- who is who ------------------------------------------------------------------------

    def primary_address(self) -> tuple[str, int]:
        """The primary's (host, port) as the first Sentinel that answers names it."""
        last: Exception | None = None
        for s in self._sentinel_clients:
            try:
                addr = s.sentinel_get_master_addr_by_name(self.service)
            except (redis.RedisError, OSError) as exc:
                last = exc
                continue
            if addr:
                host = addr[0].decode() if isinstance(addr[0], bytes) else str(addr[0])
                return host, int(addr[1])
        raise DeploymentError(f"no Sentinel names the primary of {self.service!r}: {last}")

    def primary_port(self) -> int:
        return self.primary_address()[1]

    def node_at(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def primary_node(self) -> RedisServer:
        return self.node_at(self.primary_port())

    def other(self, node: RedisServer) -> RedisServer:
        return next(n for n in self.nodes if n is not node)

    def wait_promoted(self, node: RedisServer, timeout_s: float = 60.0) -> None:
        """Until every Sentinel names `node` the primary and it says it is one."""
        def done() -> bool:
            return (all(int(s.sentinel_get_master_addr_by_name(self.service)[1]) == node.port
                        for s in self._sentinel_clients)
                    and _client(node.port).info("replication")["role"] == "master")

        _wait(done, timeout_s, f"Sentinel to promote 127.0.0.1:{node.port}")

    def wait_synced(self, primary: RedisServer, replica: RedisServer, timeout_s: float = 30.0) -> None:
        """Until `replica` replicates `primary` and has applied everything it wrote so far."""
        p, r = _client(primary.port), _client(replica.port)
        _wait(lambda: replica_caught_up(p, r, primary.port), timeout_s,
              f"127.0.0.1:{replica.port} to replicate 127.0.0.1:{primary.port}")

    # -- faults ----------------------------------------------------------------------------

    def start_node(self, node: RedisServer, timeout_s: float = 60.0) -> None:
        """Start a stopped node from its data: as the primary when Sentinel still names it
        (a restart, or the first node back after both were down), else as a replica of the
        primary Sentinel names (an old primary rejoining after a failover)."""
        try:
            primary = self.primary_port()
        except DeploymentError:
            primary = node.port
        node.extra_config = [] if primary == node.port else [f"replicaof 127.0.0.1 {primary}"]
        node.start(timeout_s)

    def pause_replication(self, replica: RedisServer, ms: int = 60_000) -> None:
        """`replica` stops applying its primary's writes (for at most `ms`); the primary
        goes on acknowledging them."""
        _client(replica.port).execute_command("CLIENT", "PAUSE", ms, "WRITE")
        self._paused = replica

    def resume_replication(self, replica: RedisServer) -> None:
        _client(replica.port).execute_command("CLIENT", "UNPAUSE")
        self._paused = None

    def kill_primary(self) -> RedisServer:
        """kill -9 of the primary; returns its node. A replica paused by
        pause_replication() drops the writes it had not applied once it sees the primary
        gone, and is unpaused then (so it can be promoted and take writes)."""
        old = self.primary_node()
        old.kill()
        paused = self._paused
        if paused is not None and paused is not old:
            _wait(lambda: _client(paused.port).info("replication").get("master_link_status") == "down", 30,
                  f"127.0.0.1:{paused.port} to see its primary gone")
            self.resume_replication(paused)
        return old

    def missed_bytes(self, primary: RedisServer, replica: RedisServer) -> int:
        """How far `replica` lags `primary`, in bytes of the replication stream."""
        offset = int(_client(primary.port).info("replication").get("master_repl_offset", 0))
        return max(0, offset - int(_client(replica.port).info("replication").get("slave_repl_offset", 0)))

    def stop(self) -> None:
        for p in self.sentinels:
            p.kill()
            p.wait()
        for node in self.nodes:
            node.kill()
        for c in self._sentinel_clients:
            c.close()
