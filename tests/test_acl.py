"""Least-privilege ACL roles against a real Redis 7 (selectors need 7.0; Debian's
redis-server, which scripts/test installs).

Each role runs its whole cycle under the ACL user `rollout acl` prints, and ends with
an empty ACL log for that user: a command missing from pipeline/ops/acl.py fails here,
including one a background loop would only log (the worker's maintenance).
"""
from __future__ import annotations

import asyncio
import re
import shlex

import pytest
from click.testing import CliRunner

from cli import main
from pipeline import scripts
from pipeline.ops.acl import Role, default_user, script_grants, script_keys, setuser_line
from pipeline.permissions import SCRIPT_CALL, PermissionDenied
from pipeline.ops.audit import audit
from pipeline.connection import connect
from pipeline.consumer import BatchTimeout, Consumer
from pipeline.controller import Controller
from pipeline.producer import PushOptions, push_dataset
from pipeline.checkpoints import CheckpointOutcome
from pipeline.queue import Place, Published, Queue, Settle
from pipeline.redis_server import RedisServer, free_port
from pipeline.types import Group, Status
from tests.conftest import CORE_REDIS_BINARIES
from tests.groups import claim, publish, write_checkpoint
from tests.helpers import WorkerThread, wait_for
from workers.engine_set import EngineSet
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings


def _redis7() -> str | None:
    versions = sorted((tuple(int(p) for p in v.split(".")), path) for v, path in CORE_REDIS_BINARIES.items())
    return next((path for v, path in reversed(versions) if v >= (7, 0)), None)


REDIS7 = _redis7()
pytestmark = pytest.mark.skipif(REDIS7 is None, reason="ACL selectors need redis-server >= 7.0 "
                                "(apt-get install redis-server; scripts/test does)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("acl-redis"), port=free_port(), aof=False, binary=REDIS7)
    s.start()
    yield s
    s.kill()


@pytest.fixture
def admin(server):
    """The unrestricted default user: sets up state and reads the ACL log."""
    c = connect(server.url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sim():
    s = start_simulator(SimConfig(seed=3))
    yield s
    s.stop()


def role_url(admin, server: RedisServer, role: Role, namespace: str) -> str:
    """Create the role's user from the line `rollout acl` prints; its URL."""
    user, password = default_user(role, namespace), f"pw-{namespace}"
    admin.execute_command(*shlex.split(setuser_line(role, namespace, user, password)))
    return f"redis://{user}:{password}@127.0.0.1:{server.port}"


def refusals(admin, role: Role, namespace: str) -> list[str]:
    user = default_user(role, namespace)
    return [f"{e['reason']} {e['object']}" for e in admin.acl_log(count=128) if e["username"] == user]


def finished(group: Group) -> Group:
    group.prompt_ids = [1, 2]
    for i, s in enumerate(group.samples):
        s.tokens, s.response_length, s.rollout_log_probs = [1, 2, 7 + i], 1, [-0.5]
        s.weight_versions, s.reward, s.status = ["0"], 1.0, Status.COMPLETED
    return group


def fresh(n: int, prefix: str) -> list[Group]:
    return [Group.fresh(f"{prefix}{i}", f"What is {i} + 1?", 2, label=str(i + 1), row=i) for i in range(n)]


def assert_audit_ok(queue: Queue) -> None:
    report = audit(queue)
    assert report.ok, report.summary()


# -- each role's whole cycle -------------------------------------------------------------


def test_worker_role_claims_publishes_reaps_and_releases(admin, server, sim, namespace):
    url = role_url(admin, server, Role.WORKER, namespace)
    setup = Queue(admin, namespace)
    setup.push_groups(fresh(6, "g"))
    # A dead worker holding a group (reaped), and an aborted group in the requeue stream (released).
    assert len(claim(setup, "ghost", 1).groups) == 1
    admin.zadd(setup.keys.workers, {"ghost": 0}, xx=True)  # its lease ran out
    [aborted] = claim(setup, "quitter", 1).groups
    assert publish(setup, "quitter", aborted.group, Place.REQUEUE)
    setup.leave("quitter")

    worker = WorkerThread(WorkerSettings(redis_url=url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=16), heartbeat_s=0.2,
                                         reward="exact_match"))
    try:
        wait_for(lambda: admin.xlen(setup.keys.results) == 6, what="every group in the results stream")
    finally:
        worker.stop()  # leaving hands back nothing, but runs the reap script with lease 0
    stats = setup.stats()
    assert stats["reaped"] == 1 and stats["released"] == 1, stats
    assert refusals(admin, Role.WORKER, namespace) == []
    assert_audit_ok(setup)


def test_worker_role_checkpoints_hands_checkpoints_on_and_publishes_them_away(admin, server, namespace):
    worker = Queue(connect(role_url(admin, server, Role.WORKER, namespace)), namespace)
    setup = Queue(admin, namespace)
    setup.push_groups(fresh(2, "g"))
    held = claim(worker, "A", 2).groups
    for c in held:
        assert write_checkpoint(worker, "A", c, tokens=3) == CheckpointOutcome.OK
    worker.redis.zadd(worker.keys.workers, {"A": 0}, xx=True)  # as if A died: its lease is past
    assert worker.reap_expired() == 2
    again = claim(worker, "B", 2).groups
    assert all(c.checkpoint is not None for c in again)
    assert publish(worker, "B", again[0], group=finished(again[0].group)) == Published.OK
    assert publish(worker, "B", again[1], Place.DEAD, error="engine failed") == Published.OK
    assert admin.hlen(setup.keys.checkpoints) == 0 and admin.hlen(setup.keys.checkpoint_records) == 0
    assert refusals(admin, Role.WORKER, namespace) == []
    assert_audit_ok(setup)
    worker.redis.close()


def test_trainer_role_pushes_consumes_commits_pauses_and_resumes(admin, server, sim, namespace, tmp_path):
    url = role_url(admin, server, Role.TRAINER, namespace)
    trainer = connect(url)
    queue = Queue(trainer, namespace)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"input": "What is {i} + 1?", "label": "{i + 1}"}}\n' for i in range(4)))
    assert push_dataset(queue, rows, PushOptions(n_samples_per_prompt=2)).pushed == 4
    queue.push_groups(fresh(2, "back"))  # slime hands partial groups back as prompts

    # Stand-in workers (the default user) finish every group; one results payload is broken.
    setup = Queue(admin, namespace)
    claimed = claim(setup, "w", 6).groups
    for c in claimed:
        assert publish(setup, "w", finished(c.group), Place.RESULTS)
    [*_, last] = setup.read_stream(setup.keys.results)
    admin.set(setup.keys.result(last.group_id, last.token), b"not msgpack")

    consumer = Consumer(trainer, namespace, block_s=0.2)
    batch = consumer.next_batch(4, timeout=10)
    assert consumer.commit(batch) == 4
    with pytest.raises(BatchTimeout):  # one left: the broken one was dead-lettered on the way
        consumer.next_batch(2, timeout=0.5)
    assert admin.xlen(setup.keys.dead) == 1

    engines = EngineSet([sim.url])
    controller = Controller(queue, engines, writer=consumer.writer)  # fenced by the trainer session

    async def update() -> int:
        try:
            await controller.pause("abort", timeout_s=5)
            assert claim(setup, "w2", 1).status == "paused"
            return (await controller.resume(weight_version=1)).weight_version
        finally:
            await engines.close()

    setup.push_groups(fresh(1, "late"))
    [late] = claim(Queue(admin, namespace), "w3", 1).groups
    assert publish(setup, "w3", late.group, Place.REQUEUE)  # aborted: released on resume
    assert asyncio.run(update()) == 1
    assert admin.lindex(setup.keys.prompts, 0) == b"late0"
    assert refusals(admin, Role.TRAINER, namespace) == []
    assert_audit_ok(setup)
    trainer.close()


def test_admin_role_runs_status_audit_dead_retry_pause_resume_and_purge(admin, server, namespace):
    url = role_url(admin, server, Role.ADMIN, namespace)
    setup = Queue(admin, namespace)
    setup.push_groups(fresh(4, "g"))
    claimed = claim(setup, "w", 3).groups
    assert publish(setup, "w", finished(claimed[0].group), Place.RESULTS)
    assert publish(setup, "w", claimed[1].group, Place.DEAD, error="engine failed")
    assert publish(setup, "w", claimed[2].group, Place.DEAD, error="engine failed")

    runner = CliRunner()

    def rollout(*args: str, exit_code: int = 0) -> str:
        result = runner.invoke(main, ["--redis-url", url, "--namespace", namespace, *args])
        assert result.exit_code == exit_code, (args, result.output)
        return result.output

    assert '"dead": 2' in rollout("status", "--json", "--sample", "0")
    assert "worker w:" in rollout("status", "--worker", "w")
    assert "results: finished" in rollout("inspect", claimed[0].group_id)
    # The drop log searched too; an id never seen exits 1.
    assert '"place": "nowhere"' in rollout("inspect", "never-pushed", "--json", exit_code=1)
    rollout("audit")
    assert "engine failed" in rollout("dead", "list")
    rollout("dead", "show", claimed[1].group_id)
    assert "retried 1 " in rollout("dead", "retry", claimed[1].group_id)
    assert "dropped 1 " in rollout("dead", "drop", "--all")
    rollout("pause")
    rollout("resume", "--weight-version", "2")
    admin.hset(setup.keys.inflight("gone"), "g3", "gone:1")  # by hand: no claim recorded it
    admin.lrem(setup.keys.prompts, 0, "g3")
    result = runner.invoke(main, ["--redis-url", url, "--namespace", namespace, "audit", "--reap-orphans"])
    assert result.exit_code == 0 and "gave back 1 groups of unregistered workers" in result.stderr, result.output
    assert admin.lindex(setup.keys.prompts, 0) == b"g3"  # back at the head
    assert "purged" in rollout("purge", "--yes")
    assert not list(admin.scan_iter(match=f"{{{namespace}}}:*"))
    assert refusals(admin, Role.ADMIN, namespace) == []


# -- what a role may not do --------------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
def test_a_write_outside_the_namespace_is_refused_naming_the_command(admin, server, namespace, role):
    client = connect(role_url(admin, server, role, namespace))
    try:
        for key in ("{other}:control", "plain"):
            with pytest.raises(PermissionDenied, match=r"permission denied .*HSET.*keys"):
                client.hset(key, "paused", 1)
            with pytest.raises(PermissionDenied, match=rf"permission denied .*HSET '{re.escape(key)}': .*keys"):
                client.pipeline().hset(key, "paused", 1).execute()
            assert not admin.exists(key)
        own = f"{{{namespace}}}:history" if role == Role.WORKER else f"{{{namespace}}}:control"
        client.hset(own, "g0", 1)  # a key of its own namespace it writes is fine
    finally:
        client.close()


def test_a_worker_cannot_run_its_scripts_on_another_namespace(admin, server, namespace):
    client = connect(role_url(admin, server, Role.WORKER, namespace))
    other = Queue(admin, f"{namespace}-other")
    other.push_groups(fresh(1, "g"))
    with pytest.raises(PermissionDenied, match=r"permission denied .*EVALSHA of claim\.lua"):
        Queue(client, other.keys.namespace).claim("w", "w:1", 1)
    assert admin.llen(other.keys.prompts) == 1
    client.close()


def test_a_worker_cannot_settle_the_trainers_entries(admin, server, namespace):
    setup = Queue(admin, namespace)
    setup.push_groups(fresh(2, "g"))
    for c in claim(setup, "w", 2).groups:
        publish(setup, "w", finished(c.group), Place.RESULTS)
    trainer = Consumer(connect(role_url(admin, server, Role.TRAINER, namespace)), namespace)
    batch = trainer.next_batch(2, timeout=5)  # delivered, not committed

    worker = Queue(connect(role_url(admin, server, Role.WORKER, namespace)), namespace)
    entries = [Settle("commit", e.entry_id, g.group_id, token=e.token) for e, g in zip(batch.entries, batch.groups)]
    with pytest.raises(PermissionDenied, match=r"permission denied .*(XPENDING|XACK) in settle\.lua line \d+"):
        worker.settle(setup.keys.results, entries, trainer.session)  # even posing as the trainer's session
    assert admin.xlen(setup.keys.results) == 2
    assert trainer.commit(batch) == 2  # still the trainer's to settle
    assert_audit_ok(setup)


def grants(role: Role, namespace: str = "exp1") -> dict[str, set[str]]:
    """Command -> the key patterns a role's line allows it on (`*` for its root permissions)."""
    line = setuser_line(role, namespace, "u", "pw", functions=True)
    root, *selectors = line.split(" (")
    out: dict[str, set[str]] = {}
    for word in root.split():
        if word.startswith("+"):
            out.setdefault(word[1:], set()).add("*")
    for selector in selectors:
        words = selector.rstrip(")").split()
        for command in (w[1:] for w in words if w.startswith("+")):
            out.setdefault(command, set()).update(w for w in words if "~" in w)
    return out


def test_every_scripts_keys_are_named_in_its_header_and_every_call_is_on_named_keys():
    for name in scripts.names():
        assert script_keys(name)[0]  # raises for a header naming no Keys attribute
        found = script_grants(name)  # raises for a KEYS[i] the header does not name
        commands = {command for command, _ in found}
        assert {c.lower() for c in SCRIPT_CALL.findall(scripts.body(name))} <= commands
        assert commands <= {c.lower() for c in SCRIPT_CALL.findall(scripts.source(name))}
    assert ("hset", ("beats",)) in script_grants("heartbeat")  # through the prelude's grace_after_silence
    assert ("time", ()) in script_grants("claim") and ("hset", ("history",)) in script_grants("claim")  # now_ms, record
    assert ("rename", ("staged", "result")) in script_grants("publish")
    assert ("xadd", ("results|requeue|dead",)) in script_grants("publish")


def test_settling_is_allowed_only_on_a_roles_own_streams():
    for role, streams in ((Role.WORKER, {"requeue"}), (Role.TRAINER, {"requeue", "results"}),
                          (Role.ADMIN, {"requeue", "results", "dead"})):
        for command in ("xack", "xdel"):
            assert grants(role)[command] == {f"~{{{ns}}}:{s}" for ns in ("exp1", "exp1.eval") for s in streams}


# -- the command ---------------------------------------------------------------------------


def test_rollout_acl_prints_a_line_redis_accepts_without_the_password(admin, server, namespace):
    result = CliRunner().invoke(main, ["acl", "--role", "trainer", "--namespace", namespace],
                                                env={"ROLLOUT_ACL_PASSWORD": "s3cret-pw"})
    assert result.exit_code == 0, result.output + result.stderr
    line = result.stdout.strip()
    assert line.startswith("ACL SETUSER ") and "s3cret-pw" not in line
    assert admin.execute_command(*shlex.split(line)) == b"OK"
    user = admin.acl_getuser(default_user(Role.TRAINER, namespace))
    # the namespace and its evaluation companion (pipeline/trainers/eval.py)
    assert (user["keys"], user["channels"]) == ([f"~{{{namespace}}}:*", f"~{{{namespace}.eval}}:*"],
                                                [f"&{{{namespace}}}:events", f"&{{{namespace}.eval}}:events"])
    client = connect(f"redis://{default_user(Role.TRAINER, namespace)}:s3cret-pw@127.0.0.1:{server.port}")
    assert Consumer(client, namespace).queue.depths()["prompts"] == 0
    client.close()


def test_rollout_acl_without_a_password_makes_one_and_shows_it_once_on_stderr(namespace):
    result = CliRunner().invoke(main, ["--namespace", namespace, "acl", "--role", "worker"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"ACL SETUSER {namespace}-worker reset on #")
    assert "password" in result.stderr and f"redis://{namespace}-worker:" in result.stderr


def test_the_cli_says_permission_denied_and_names_the_command(admin, server, namespace):
    Queue(admin, namespace).push_groups(fresh(1, "g"))
    url = role_url(admin, server, Role.WORKER, namespace)
    result = CliRunner().invoke(main, ["--redis-url", url, "--namespace", namespace, "purge", "--yes"])
    assert result.exit_code == 1
    assert "permission denied" in result.output and "SCAN" in result.output, result.output  # purge lists keys first
    assert f"pw-{namespace}" not in result.output
    assert admin.llen(Queue(admin, namespace).keys.prompts) == 1
