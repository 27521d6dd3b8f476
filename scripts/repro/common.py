"""Shared set-up of the repro scripts, adapted to the fenced API (run from the project
root: `python scripts/repro/r1_two_trainers.py`). The originals are in ../shared/repro/;
what changed in the API is listed in scripts/repro/README.md."""
import os
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
from tests.helpers import Forwarder, wait_replicated  # noqa: E402,F401


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
    client = connect(r.url, read_only=True)  # an admin's: it stays connected to the replica
    client.replicaof("127.0.0.1", primary.port)
    wait_replicated(connect(primary.url), client)
    return r

