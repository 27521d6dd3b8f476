"""Least privilege, measured (issue 26): namespaces that cannot collide, a trainer role
that can run its own commands, and a worker whose missing permission stops it instead of
dead-lettering the queue. Roles run against a real Redis 7 ACL (tests/test_acl.py's server)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli import main
from pipeline.connection import connect
from pipeline.keys import Keys, check_namespace, eval_namespace
from pipeline.ops.acl import Role, default_user
from pipeline.ops.audit import audit
from pipeline.permissions import PermissionDenied
from pipeline.queue import Queue
from tests.helpers import WorkerThread, wait_for
from tests.test_acl import REDIS7, admin, fresh, refusals, role_url, server, sim  # noqa: F401 (fixtures)
from workers.worker import SamplingSettings, WorkerConfigError, WorkerSettings

needs_redis7 = pytest.mark.skipif(REDIS7 is None, reason="ACL selectors need redis-server >= 7.0")


@pytest.mark.parametrize("name, says", [
    ("exp1.eval", "is the evaluation companion of namespace 'exp1'"),
    ("exp1\n", "is invalid: use 1-64 letters"),
    ("exp1\r", "is invalid: use 1-64 letters"),
])
def test_a_namespace_that_would_collide_is_refused(name, says, run):
    with pytest.raises(ValueError, match=says):
        check_namespace(name)
    with pytest.raises(ValueError, match=says):
        Keys(name)
    result = run("status", ns=name)
    assert result.exit_code == 2 and says in result.output.replace("\n", " ").replace("  ", " ")
    result = run("acl", "--role", "worker", "--namespace", name, ns=None)
    assert result.exit_code == 2, result.output


def test_the_companion_namespace_is_made_only_by_eval_namespace():
    assert Keys(eval_namespace("exp1")).prompts == "{exp1.eval}:prompts"
    assert Keys(eval_namespace("n" * 64)).namespace == "n" * 64 + ".eval"  # the longest name has one too


@needs_redis7
def test_trainer_role_runs_consume_pause_and_resume_from_the_cli(admin, server, namespace, tmp_path):
    url = role_url(admin, server, Role.TRAINER, namespace)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"input": "What is {i} + 1?", "label": "{i + 1}"}}\n' for i in range(2)))
    runner = CliRunner()

    def rollout(*args: str, code: int = 0) -> str:
        result = runner.invoke(main, ["--redis-url", url, "--namespace", namespace, *args])
        assert result.exit_code == code, (args, result.output)
        assert "permission denied" not in result.output, result.output
        return result.output

    rollout("push", str(rows))
    rollout("pause")
    rollout("resume", "--weight-version", "1")
    assert "no live workers (none registered); 2 prompts queued" in rollout("consume", "--batch-size", "1",
                                                                            "--timeout", "0.5", code=1)
    assert refusals(admin, Role.TRAINER, namespace) == []


@needs_redis7
def test_a_worker_refused_a_command_stops_and_hands_back_instead_of_dead_lettering(admin, server, sim,
                                                                                    namespace):
    url = role_url(admin, server, Role.WORKER, namespace)
    admin.execute_command("ACL", "SETUSER", default_user(Role.WORKER, namespace), "-set")  # publish stages with SET
    setup = Queue(admin, namespace)
    setup.push_groups(fresh(4, "g"))
    worker = WorkerThread(WorkerSettings(redis_url=url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=8), heartbeat_s=0.2,
                                         reward="exact_match"))
    wait_for(lambda: not worker._thread.is_alive(), timeout=60, what="the worker stopping by itself")
    with pytest.raises(WorkerConfigError, match="permission denied .* SET") as stopped:
        worker.stop()
    assert "grant the Redis user that command" in str(stopped.value)
    assert admin.xlen(setup.keys.dead) == 0 and admin.xlen(setup.keys.results) == 0
    assert sorted(g.decode() for g in admin.lrange(setup.keys.prompts, 0, -1)) == [f"g{i}" for i in range(4)]
    assert audit(Queue(connect(server.url), namespace)).ok


@needs_redis7
def test_a_refused_key_is_named(admin, server, namespace):
    url = role_url(admin, server, Role.WORKER, namespace)
    worker = connect(url)
    with pytest.raises(PermissionDenied, match=r"SET '\{someone-else\}:results': this user has no permissions "
                                               r"to access one of the keys"):
        worker.set("{someone-else}:results", b"x")
    worker.close()
