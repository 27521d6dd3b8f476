"""Shared set-up of the repro scripts, adapted to the fenced API (run from the project
root: `python scripts/repro/r1_two_trainers.py`). The originals are in ../shared/repro/;
what changed in the API is listed in scripts/repro/README.md."""
import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())

from pipeline.audit import audit  # noqa: E402,F401
from pipeline.connection import connect  # noqa: E402,F401
from pipeline.consumer import Consumer  # noqa: E402,F401
from pipeline.queue import Place, Queue  # noqa: E402,F401
from pipeline.redis_server import RedisServer, free_port  # noqa: E402
from pipeline.types import Group, Status  # noqa: E402,F401
from tests.groups import claim, finish, produce, publish  # noqa: E402,F401


def server() -> RedisServer:
    s = RedisServer(tempfile.mkdtemp(prefix="repro-redis-"), port=free_port(), aof=False)
    s.start()
    return s
