"""The AOF fsync setting of the embedded Redis (`rollout up --fsync`): with `always` a
crash of redis-server loses no acknowledged write; with `everysec` it can lose a tail
of them (writes held back while a background fsync is slow), never reorder them."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli import main
from pipeline.connection import connect
from pipeline.redis_server import Fsync


@pytest.mark.parametrize("fsync", list(Fsync))
def test_kill_9_of_redis_and_what_survives(redis_factory, fsync):
    server = redis_factory("aof", fsync=fsync)
    client = connect(server.url)
    assert client.config_get("appendfsync") == {"appendfsync": fsync.value}
    pipe = client.pipeline(transaction=False)
    for i in range(2000):
        pipe.rpush("acknowledged", i)
    pipe.execute()
    client.close()
    server.kill()  # at once: no time for everysec's background fsync
    restarted = redis_factory(data_dir=server.data_dir, port=server.port, fsync=fsync)
    survived = [int(x) for x in connect(restarted.url).lrange("acknowledged", 0, -1)]
    if fsync == Fsync.ALWAYS:
        assert len(survived) == 2000
    else:
        assert survived == list(range(len(survived)))  # maybe a tail lost, nothing out of order


def test_rollout_up_passes_fsync_to_its_redis(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(main, ["up", "--workers", "0", "--engine-url", "http://127.0.0.1:9",
                                       "--fsync", "always", "--data-dir", str(tmp_path / "stack"),
                                       "--duration", "0", "--refresh", "0.1"])
    assert result.exit_code == 0, result.output
    assert "fsync always" in result.output
    assert "appendfsync always" in (tmp_path / "stack" / "redis" / "redis.conf").read_text().splitlines()
