"""Roles that really limit (issue 26): with the Redis 7 Functions library loaded, the
pipeline's scripts run by FCALL, and users made with `rollout acl --functions` run their
whole cycle without EVAL, EVALSHA, SCRIPT or FUNCTION, which they are refused. Redis 6.2
(no Functions) falls back to EVALSHA and says so."""
from __future__ import annotations

import logging
import shlex

import pytest
import redis
from click.testing import CliRunner

from cli import main
from pipeline import scripts
from pipeline.checkpoints import CheckpointOutcome
from pipeline.connection import connect
from pipeline.consumer import Consumer
from pipeline.ops.acl import Role, default_user, setuser_line
from pipeline.ops.audit import audit
from pipeline.permissions import PermissionDenied
from pipeline.queue import Place, Queue
from pipeline.redis_server import RedisServer, free_port
from tests.conftest import CORE_REDIS_BINARIES
from tests.groups import claim, publish, write_checkpoint
from tests.helpers import WorkerThread, wait_for
from tests.test_acl import REDIS7, finished, fresh, refusals, sim  # noqa: F401 (fixture)
from workers.worker import SamplingSettings, WorkerSettings

pytestmark = pytest.mark.skipif(REDIS7 is None, reason="Functions and ACL selectors need redis-server >= 7.0")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("functions-redis"), port=free_port(), aof=False, binary=REDIS7)
    s.start()
    result = CliRunner().invoke(main, ["--redis-url", s.url, "functions", "load"])
    assert result.exit_code == 0 and f"loaded ({len(scripts.names())} scripts)" in result.output, result.output
    yield s
    s.kill()


@pytest.fixture
def admin(server):
    c = connect(server.url)
    yield c
    c.close()


def functions_url(admin, server: RedisServer, role: Role, namespace: str) -> str:
    user, password = default_user(role, namespace), f"pw-{namespace}"
    admin.execute_command(*shlex.split(setuser_line(role, namespace, user, password, functions=True)))
    return f"redis://{user}:{password}@127.0.0.1:{server.port}"


ANY_LUA = [("EVAL", "return 1", 0), ("SCRIPT", "LOAD", "return 1"), ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0),
           ("FUNCTION", "LIST"), ("FUNCTION", "DELETE", "rollout"),
           ("FUNCTION", "LOAD", "#!lua name=evil\nredis.register_function('spin', function() while true do end end)")]


@pytest.mark.parametrize("role", list(Role))
def test_a_functions_role_may_run_no_lua_of_its_own(admin, server, namespace, role):
    user = connect(functions_url(admin, server, role, namespace))
    for command in ANY_LUA:
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command(*command)
    assert scripts.uses_functions(user)
    user.close()


def test_a_functions_worker_runs_its_whole_cycle_by_fcall(admin, server, sim, namespace):
    url = functions_url(admin, server, Role.WORKER, namespace)
    setup = Queue(admin, namespace)
    setup.push_groups(fresh(4, "g"))
    worker = WorkerThread(WorkerSettings(redis_url=url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=16), heartbeat_s=0.2,
                                         reward="exact_match"))
    try:
        wait_for(lambda: admin.xlen(setup.keys.results) == 4, what="every group in the results stream")
        assert isinstance(worker.worker.queue._scripts["claim"]._run, scripts.FunctionScript)  # decided at its first claim
    finally:
        worker.stop()
    assert refusals(admin, Role.WORKER, namespace) == []
    assert audit(setup).ok


def test_a_functions_worker_writes_and_is_handed_checkpoints_by_fcall(admin, server, namespace):
    worker = Queue(connect(functions_url(admin, server, Role.WORKER, namespace)), namespace)
    Queue(admin, namespace).push_groups(fresh(1, "g"))
    [held] = claim(worker, "A", 1).groups
    assert write_checkpoint(worker, "A", held, tokens=3) == CheckpointOutcome.OK
    assert isinstance(worker._scripts["checkpoint"]._run, scripts.FunctionScript)
    assert worker.leave("A") == 1
    [again] = claim(worker, "B", 1).groups
    assert again.checkpoint is not None and again.checkpoint.header.tokens == 6
    assert refusals(admin, Role.WORKER, namespace) == []
    worker.redis.close()


def test_a_functions_trainer_and_admin_run_their_cycles_by_fcall(admin, server, namespace):
    trainer = connect(functions_url(admin, server, Role.TRAINER, namespace))
    queue = Queue(trainer, namespace)
    queue.push_groups(fresh(3, "g"))
    setup = Queue(admin, namespace)
    for c in claim(setup, "w", 3).groups:
        assert publish(setup, "w", finished(c.group), Place.RESULTS)
    consumer = Consumer(trainer, namespace, block_s=0.2)
    batch = consumer.next_batch(3, timeout=10)
    assert consumer.commit(batch) == 3
    assert refusals(admin, Role.TRAINER, namespace) == []
    url = functions_url(admin, server, Role.ADMIN, namespace)
    for args in (["status", "--sample", "0"], ["audit"], ["inspect", "g0"], ["dead", "list"]):
        result = CliRunner().invoke(main, ["--redis-url", url, "--namespace", namespace, *args])
        assert result.exit_code == 0, (args, result.output)
    assert refusals(admin, Role.ADMIN, namespace) == []
    trainer.close()


@pytest.mark.skipif(not any(v.startswith("6.") for v in CORE_REDIS_BINARIES), reason="no Redis 6 binary here")
def test_redis_6_runs_the_scripts_by_evalsha_and_says_so(tmp_path):
    binary = next(p for v, p in CORE_REDIS_BINARIES.items() if v.startswith("6."))
    old = RedisServer(tmp_path / "r6", port=free_port(), aof=False, binary=binary)
    old.start()
    try:
        client = connect(old.url)
        queue = Queue(client, "old")
        assert scripts.fallback_reason(client) == "this Redis has no Functions (6.2 or older)"
        queue.push_groups(fresh(1, "g"))
        assert [c.group_id for c in claim(queue, "w", 1).groups] == ["g0"]
        assert not isinstance(queue._scripts["claim"]._run, scripts.FunctionScript)
        client.close()
    finally:
        old.kill()


def test_a_refused_fcall_names_the_script(admin, server, namespace):
    worker = Queue(connect(functions_url(admin, server, Role.WORKER, namespace)), namespace)
    other = Queue(admin, "someone-else").keys
    with pytest.raises(PermissionDenied, match="FCALL of register.lua: this user has no permissions to access one "
                                               "of the keys"):
        worker._scripts["register"](keys=[other.workers, other.worker_info, other.control], args=["w1", "{}", "1"])


def test_a_worker_without_the_library_says_loudly_that_roles_cannot_be_limited(redis_url, namespace, sim, caplog):
    Queue(connect(redis_url), namespace).push_groups(fresh(1, "g"))
    with caplog.at_level(logging.WARNING, logger="workers.worker"):
        worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                             sampling=SamplingSettings(max_new_tokens=8), reward="exact_match"))
        worker.stop()
    assert "Lua scripts run by EVALSHA, not FCALL: " in caplog.text
    assert "ACL roles cannot be limited to the pipeline's own" in caplog.text


def test_a_queue_built_while_redis_is_down_asks_about_functions_at_its_first_call(tmp_path, namespace):
    """Which way the scripts run is decided at the first script call, which callers retry
    through outages (Reconnect), not when a Queue or Consumer is built: a worker or a
    trainer started during an outage waits like any other call."""
    s = RedisServer(tmp_path / "down", port=free_port(), aof=False, binary=REDIS7)
    client = redis.Redis.from_url(s.url)  # connects at its first command
    queue = Queue(client, namespace)  # nothing listens yet: must not raise
    s.start()
    try:
        CliRunner().invoke(main, ["--redis-url", s.url, "functions", "load"])
        queue.push_groups(fresh(1, "g"))
        queue.register("w")
        assert queue.claim("w", "w:1", 1).groups and scripts.uses_functions(client)
    finally:
        client.close()
        s.kill()


def test_a_transient_reply_to_the_functions_probe_is_not_taken_for_an_answer(admin, server, monkeypatch):
    """A READONLY or BUSY reply while a failover or a long script is under way says nothing
    about Functions: it is raised for the caller to retry, and the next call asks again."""
    client = connect(server.url)
    real = client.fcall
    replies = iter([redis.exceptions.ReadOnlyError("You can't write against a read only replica.")])

    def fcall(*args):
        for exc in replies:
            raise exc
        return real(*args)

    monkeypatch.setattr(client, "fcall", fcall)
    try:
        with pytest.raises(redis.exceptions.ReadOnlyError):
            scripts.uses_functions(client)
        assert scripts.uses_functions(client)  # asked again, and the library is there
    finally:
        client.close()
