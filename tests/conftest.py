"""Shared fixtures: real redis-server processes, one namespace per test."""
from __future__ import annotations

import itertools
import uuid

import pytest

from pipeline.connection import connect
from pipeline.queue import Queue
from pipeline.redis_server import RedisServer, free_port


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"), port=free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture
def client(redis_server):
    c = connect(redis_server.url)
    yield c
    c.close()


_counter = itertools.count()


@pytest.fixture
def namespace():
    return f"t{next(_counter)}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def queue(client, namespace):
    return Queue(client, namespace, lease_s=30.0)
