"""Shared set-up of the repro scripts, adapted to the fenced API (run from the project
root: `python scripts/repro/r1_two_trainers.py`). The originals are in ../shared/repro/;
what changed in the API is listed in scripts/repro/README.md."""
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.getcwd())

from pipeline.ops.audit import audit  # noqa: E402,F401
from pipeline.connection import connect  # noqa: E402,F401
from pipeline.consumer import Consumer  # noqa: E402,F401
from pipeline.queue import Place, Queue  # noqa: E402,F401
from pipeline.redis_server import RedisServer, free_port  # noqa: E402
from pipeline.types import Group, Status  # noqa: E402,F401
from tests.groups import claim, finish, produce, publish  # noqa: E402,F401


def busy(url: str, seconds: float = 0.5) -> threading.Thread:
    """Keep Redis busy in a script for `seconds` (a slow command, a failover), from a
    thread of its own: a client with a shorter socket timeout loses its reply meanwhile."""
    spin = ("local t0=redis.call('TIME') local s=tonumber(t0[1])+tonumber(t0[2])/1e6 while true do "
            "local t=redis.call('TIME') if tonumber(t[1])+tonumber(t[2])/1e6-s > tonumber(ARGV[1]) then break end "
            "end return 1")
    thread = threading.Thread(target=lambda: connect(url, socket_timeout=seconds + 5).eval(spin, 0, seconds))
    thread.start()
    time.sleep(0.05)  # the script is running
    return thread


def server() -> RedisServer:
    s = RedisServer(tempfile.mkdtemp(prefix="repro-redis-"), port=free_port(), aof=False)
    s.start()
    return s


def replica_of(primary: RedisServer) -> RedisServer:
    """A second server replicating `primary`, caught up before it returns."""
    r = server()
    client = connect(r.url)
    client.replicaof("127.0.0.1", primary.port)
    wait_replicated(connect(primary.url), client)
    return r


def wait_replicated(primary, replica, timeout: float = 10) -> None:
    """Until the replica has applied everything the primary wrote so far."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        offset = primary.info("replication").get("master_repl_offset", 0)
        info = replica.info("replication")
        if info.get("master_link_status") == "up" and info.get("slave_repl_offset", -1) >= offset:
            return
        time.sleep(0.02)
    raise RuntimeError("replica did not catch up")


class Forwarder:
    """A TCP forwarder on a fixed port to a switchable upstream port: clients keep one
    address while the server behind it changes (a failover behind a VIP or DNS name).
    `switch(port)` cuts every open connection; new ones go to the new upstream;
    `switch(None)` refuses them (the server is down)."""

    def __init__(self, upstream: int | None):
        self.upstream = upstream
        self.port = free_port()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                if self.upstream is None:
                    raise OSError("down")
                upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def switch(self, upstream: int | None) -> None:
        self.upstream = upstream
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
