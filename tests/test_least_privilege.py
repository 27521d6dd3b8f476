"""Least privilege, measured (issue 26): namespaces that cannot collide, a trainer role
that can run its own commands, and a worker whose missing permission stops it instead of
dead-lettering the queue. Roles run against a real Redis 7 ACL (tests/test_acl.py's server)."""
from __future__ import annotations

import re
import shlex

import pytest
from click.testing import CliRunner

from cli import main
from pipeline.connection import connect
from pipeline.keys import Keys, check_namespace, eval_namespace
from pipeline.ops.acl import Role, default_user, setuser_line
from pipeline.ops.audit import audit
from pipeline.permissions import PermissionDenied
from pipeline.queue import Place, Queue
from tests.groups import claim, publish
from tests.helpers import WorkerThread, wait_for
from tests.test_acl import (REDIS7, admin, finished, fresh, grants, refusals, role_url, server,  # noqa: F401
                            sim)
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
    user = default_user(Role.WORKER, namespace)
    line = re.sub(r" \+set\b", "", setuser_line(Role.WORKER, namespace, user, "pw"))  # publish stages with SET
    admin.execute_command(*shlex.split(line))
    url = f"redis://{user}:pw@127.0.0.1:{server.port}"
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


@needs_redis7
def test_a_workers_password_cannot_delete_results_trim_prompts_rewrite_control_or_list_keys(admin, server,
                                                                                             namespace):
    setup = Queue(admin, namespace)
    setup.push_groups(fresh(3, "g"))
    worker = Queue(connect(role_url(admin, server, Role.WORKER, namespace)), namespace)
    [held] = claim(worker, "w", 1).groups
    assert publish(worker, "w", finished(held.group), Place.RESULTS)  # XADD and RENAME inside its publish
    [entry] = setup.read_stream(setup.keys.results)
    k, result = setup.keys, setup.keys.result(entry.group_id, entry.token)
    refused = [
        ("DEL", k.results), ("XTRIM", k.results, "MAXLEN", 0), ("XDEL", k.results, entry.entry_id),
        ("LTRIM", k.prompts, 1, 0), ("DEL", k.prompts), ("LSET", k.prompts, 0, "x"),
        ("HSET", k.control, "paused", 1), ("HSET", k.control, "weight_version", 99), ("DEL", k.control),
        ("SCAN", 0), ("KEYS", "*"),
        ("DEL", k.payloads), ("HSET", k.stats, "committed", 0), ("DEL", k.workers),
        ("RENAME", result, k.staged("g", "t")),  # a payload's key is written by RENAME only: %W~
        ("GET", result),
    ]
    for command in refused:
        with pytest.raises(PermissionDenied, match=f"permission denied .*{command[0]}"):
            worker.redis.execute_command(*command)
    logged = set(refusals(admin, Role.WORKER, namespace))  # Redis logs one entry per reason and object
    assert all(f"command {c[0].lower()}" in logged or f"key {c[1]}" in logged for c in refused), sorted(logged)
    assert (admin.xlen(k.results), admin.llen(k.prompts), admin.hgetall(k.control)) == (1, 2, {})
    assert admin.exists(result) and audit(setup).ok
    worker.redis.close()


def test_a_workers_commands_are_granted_only_on_the_keys_its_scripts_and_calls_name():
    worker = grants(Role.WORKER)
    on = {command: {p.split("}:")[1] for p in patterns if "{exp1}" in p} for command, patterns in worker.items()}
    assert "scan" not in worker and "keys" not in worker and "ltrim" not in on.get("prompts", set())
    assert on["hset"] >= {"history", "beats"} and "control" not in on["hset"]
    assert on["del"] == {"inflight:*", "result:*:*", "staged:*:*"} and on["xadd"] >= {"results", "requeue", "dead"}
    assert on["ltrim"] == {"reaped"} and on["lpop"] == {"prompts"}
    assert on["rename"] == {"staged:*:*", "result:*:*"}
    # Checkpoints are written and deleted field by field, by its scripts, never as keys.
    assert {"checkpoints", "checkpoint_records"} <= on["hset"] & on["hdel"]
    assert not any(c in worker for c in ("unlink", "expire")) and "checkpoints" not in on.get("get", set())
    assert "%W~{exp1}:result:*:*" in worker["rename"] and "~{exp1}:staged:*:*" in worker["rename"]


@needs_redis7
def test_a_trainers_password_cannot_delete_the_streams_or_the_prompt_list_or_list_keys(admin, server, namespace):
    setup = Queue(admin, namespace)
    setup.push_groups(fresh(2, "g"))
    trainer = connect(role_url(admin, server, Role.TRAINER, namespace))
    k = setup.keys
    for command in [("DEL", k.results), ("DEL", k.prompts), ("LTRIM", k.prompts, 1, 0), ("DEL", k.dead),
                    ("SCAN", 0), ("XACK", k.dead, "g", "0-1")]:
        with pytest.raises(PermissionDenied, match=f"permission denied .*{command[0]}"):
            trainer.execute_command(*command)
    assert admin.llen(k.prompts) == 2
    trainer.hset(k.control, "paused", 1)  # the control hash is the trainer's
    trainer.close()
