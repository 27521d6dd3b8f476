"""What an operator sees must be true (issues 14 and 15): a worker killed with SIGKILL
shown dead within its lease, reaps and departures in status, where a group is and what
happened to it, one worker's groups, repeated reaps and claims as alerts, missing
labels, global options after the command, the namespace's dead letters by reason."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from rich.console import Console

from pipeline import metrics
from pipeline.ops.audit import audit
from pipeline.consumer import Consumer
from pipeline.control import configure
from pipeline.ops.inspect import GroupPlace, UnknownWorker, locate, worker_groups
from pipeline.queue import Place
from pipeline.ops.status import snapshot
from pipeline.ops.status_render import render
from pipeline.types import Group, ReleasePolicy
from tests.groups import assert_audit_ok, claim, die_holding, expire, finish, fresh, publish
from tests.helpers import WorkerThread, http_json, one_error_line, wait_for
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings

REPO = Path(__file__).resolve().parent.parent


def text_of(snap) -> str:
    """The status as `rollout status` draws it at 80 columns, lines joined."""
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(render(snap))
    assert max(len(line) for line in out.getvalue().splitlines()) <= 80
    return " ".join(out.getvalue().split())


# -- status: departures, repeated reaps and claims, unregistered in-flight hashes -------------


def test_status_shows_reaped_and_departed_workers_and_alerts_on_repeated_reaps(queue):
    queue.push_groups(fresh(6))
    claim(queue, "crashed-1", 2)
    claim(queue, "crashed-2", 1)
    claim(queue, "stopped", 1)
    expire(queue, "crashed-1")
    expire(queue, "crashed-2")
    assert queue.reap_expired() == 3
    assert queue.leave("stopped") == 1
    snap = snapshot(queue)
    assert [(d.worker, d.how, d.groups) for d in snap.departed] == [
        ("stopped", "handed_back", 1), ("crashed-2", "reaped", 1), ("crashed-1", "reaped", 2)]
    assert all(0 <= d.age_s < 5 for d in snap.departed) and snap.departed[1].overdue_s > 0
    shown = text_of(snap)
    assert "reaped worker crashed-1" in shown and "2 groups back to the queue" in shown
    assert "worker stopped left" in shown and "handed 1 groups back" in shown
    assert any(a.startswith("workers are being reaped repeatedly: 2 in the last 5 min (3 groups back") for a in
               snap.alerts)
    # Clean departures are no crash loop, and neither is one reap.
    queue.redis.ltrim(queue.keys.reaped, 0, 1)
    assert not any("reaped repeatedly" in a for a in snapshot(queue).alerts)


def test_status_alerts_on_groups_claimed_again_and_again(queue):
    configure(queue.redis, queue.keys, max_claims=5)
    queue.push_groups(fresh(2))
    for n in range(3):  # g0's holders keep dying
        assert die_holding(queue, f"w{n}") == ["g0"]
    claim(queue, "w9", 1)
    snap = snapshot(queue)
    assert snap.claimed_repeatedly == 1 and snap.most_claimed == {"g0": 4}
    [alert] = [a for a in snap.alerts if "claimed 2+ times" in a]
    assert "past 5 claims a group is dead-lettered" in alert and "`rollout inspect g0`" in alert


def test_status_and_audit_agree_about_an_unregistered_workers_inflight_hash(queue):
    queue.push_groups(fresh(3))
    claim(queue, "w", 1)
    queue.redis.hset(queue.keys.inflight("ghost"), mapping={"stray0": "t", "stray1": "t"})
    snap, report = snapshot(queue), audit(queue)
    assert snap.unregistered_inflight == report.unregistered_inflight == ["ghost"]
    assert snap.inflight == sum(report.inflight.values()) == 3
    assert snap.inflight_by_worker == report.inflight == {"w": 1, "ghost": 2}
    assert any(a.startswith("2 groups sit in the in-flight hashes of workers that are not registered (ghost)")
               for a in snap.alerts)


# -- where a group is --------------------------------------------------------------------------


def test_inspect_finds_a_group_in_every_place_with_its_history(queue, client):
    configure(queue.redis, queue.keys, max_claims=4)
    queue.push_groups(fresh(8))
    held = {c.group_id: c for c in claim(queue, "w1", 6).groups}
    publish(queue, "w1", held["g0"], group=finish(held["g0"].group))
    publish(queue, "w1", held["g1"], group=finish(held["g1"].group))
    publish(queue, "w1", held["g2"], Place.REQUEUE)
    publish(queue, "w1", held["g3"], Place.DEAD, error="engine failed 3 times; last error: 503")
    consumer = Consumer(client, queue.keys.namespace)
    batch = consumer.next_batch(1, timeout=5)
    consumer.commit(batch)
    consumer.next_batch(1, timeout=5)  # g1: delivered, not committed
    expire(queue, "w1")
    queue.reap("w1")  # g4, g5 back to the head of the prompt list
    [again] = claim(queue, "w2", 1).groups
    waiting = ({"g4", "g5"} - {again.group_id}).pop()

    g0 = locate(queue, "g0")
    assert g0.place == GroupPlace.COMMITTED and g0.where[0].batch == batch.batch_id
    assert [e.event for e in g0.history] == ["claimed", "published", "committed"]
    g1 = locate(queue, "g1").where[0]
    assert (g1.place, g1.session, g1.current_session, g1.deliveries) == (
        GroupPlace.RESULTS, consumer.session.consumer, True, 1)
    assert locate(queue, "g2").place == GroupPlace.REQUEUE
    g3 = locate(queue, "g3")
    assert g3.place == GroupPlace.DEAD and "engine failed 3 times" in g3.where[0].error
    reclaimed = locate(queue, again.group_id)
    w = reclaimed.where[0]
    assert (reclaimed.place, w.worker, w.alive, reclaimed.claims, reclaimed.attempts, reclaimed.n_samples) == (
        GroupPlace.INFLIGHT, "w2", True, 2, 0, 2)
    assert 0 <= w.age_s < 5
    assert [(e.event, e.who) for e in reclaimed.history] == [("claimed", "w1"), ("reaped", "w1"),
                                                             ("claimed", "w2")]
    queued = locate(queue, waiting)
    assert (queued.place, queued.where[0].position, queued.claims) == (GroupPlace.PROMPTS, 0, 1)
    assert locate(queue, "g7").where[0].position == 2  # behind the reaped one and g6
    queue.release(ReleasePolicy.DROP)
    dropped = locate(queue, "g2")
    assert dropped.place == GroupPlace.DROPPED and dropped.where[0].reason == "requeue-drop"
    assert locate(queue, "nope").place == GroupPlace.NOWHERE
    assert_audit_ok(queue)


def test_status_worker_lists_held_groups_with_age_claims_and_attempts(queue):
    retried = Group.fresh("tried", "p", 2, label="1")
    retried.attempts = 2
    queue.push_groups([retried, *fresh(3)])
    die_holding(queue, "host-9-ab#1", 2)
    claim(queue, "host-9-ab#2", 3)
    [w] = worker_groups(queue, "host-9-ab")  # the reaped incarnation holds nothing any more
    assert (w.worker, w.registered, w.alive) == ("host-9-ab#2", True, True)
    by_gid = {g.group_id: g for g in w.groups}
    assert set(by_gid) == {"tried", "g0", "g1"}
    assert (by_gid["tried"].attempts, by_gid["tried"].claims, by_gid["g1"].claims) == (2, 2, 1)
    assert all(0 <= g.held_s < 5 for g in w.groups)
    with pytest.raises(UnknownWorker, match="no worker 'nobody'.*host-9-ab#2"):
        worker_groups(queue, "nobody")


def test_inspect_and_status_worker_through_the_cli(run, queue):
    queue.push_groups(fresh(2))
    claim(queue, "w-1#1", 1)
    shown = run("inspect", "g0")
    assert shown.exit_code == 0, shown.output
    assert "in flight: worker w-1#1 (alive) holds it under claim" in shown.output
    assert "claimed     w-1#1" in shown.output
    assert "prompts: queued, position 0" in run("inspect", "g1").output
    listed = run("status", "--worker", "w-1")
    assert listed.exit_code == 0 and "worker w-1#1: alive" in listed.output and "  g0\n      held " in listed.output
    assert "no worker 'x'" in one_error_line(run("status", "--worker", "x"))


# -- dead letters: holders, retry, reasons --------------------------------------------------


def test_dead_show_names_the_holders_of_a_group_that_killed_them_and_retry_resets_its_count(run, queue):
    configure(queue.redis, queue.keys, max_claims=2)
    queue.push_groups(fresh(1))
    for n in range(2):
        die_holding(queue, f"w{n}")
    assert claim(queue, "w2", 1).groups == []  # the third claim dead-letters it
    shown = run("dead", "show", "g0")
    assert shown.exit_code == 0, shown.output
    assert "held by w0 (reaped), w1 (reaped)" in shown.output and "  reason     max_claims\n" in shown.output
    assert "reaped      w0" in shown.output and "reaped      w1" in shown.output
    [d] = [json.loads(line) for line in run("dead", "show", "g0", "--json").stdout.splitlines()]
    assert d["reason"] == "max_claims"
    assert [(e["event"], e["who"]) for e in d["history"]][:4] == [("claimed", "w0"), ("reaped", "w0"),
                                                                  ("claimed", "w1"), ("reaped", "w1")]
    assert run("dead", "retry", "g0").exit_code == 0
    assert locate(queue, "g0").claims == 0
    for n in range(3, 5):  # a fresh count: it takes max_claims deaths again
        assert die_holding(queue, f"w{n}") == ["g0"]
    assert claim(queue, "w5", 1).groups == [] and queue.redis.xlen(queue.keys.dead) == 1
    assert_audit_ok(queue)


def test_namespace_dead_letters_by_reason_include_the_claim_scripts(queue):
    configure(queue.redis, queue.keys, max_claims=1)
    queue.push_groups(fresh(3))
    die_holding(queue, "a")
    claim(queue, "b", 1)  # g0 dead: max_claims; b takes g1
    publish(queue, "b", fresh(2)[1], Place.DEAD, error="no label")  # without a reason
    [c] = claim(queue, "b", 1).groups
    queue.publish("b", c.group_id, c.token, c.payload, Place.DEAD, "math_boxed needs a label", "missing_label")
    metrics.sample_namespace(queue.depths(), queue.stats())

    def value(reason: str) -> float:
        return REGISTRY.get_sample_value("rollout_namespace_dead_letters", {"reason": reason})

    assert (value("max_claims"), value("missing_label"), value("other")) == (1, 1, 1)
    assert REGISTRY.get_sample_value("rollout_queue_depth", {"place": "dead"}) == 3
    reasons = [letter.reason for letter in queue.read_stream(queue.keys.dead)]
    assert reasons == ["max_claims", None, "missing_label"]


@pytest.fixture
def sim():
    handle = start_simulator(SimConfig(seed=4, decode_tokens_per_s=20000.0, length_median=16, length_p99=64))
    yield handle
    handle.stop()


def test_a_group_without_the_label_its_reward_needs_is_dead_lettered_at_once(redis_url, queue, namespace, sim):
    queue.push_groups([Group.fresh("labelled", "What is 1 + 1?", 2, label="2"),
                       Group.fresh("unlabelled", "What is 2 + 2?", 2)])
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=32), heartbeat_s=0.5,
                                         backoff_s=5.0))  # a retry would take seconds: none must happen
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.dead) == 1 and queue.redis.xlen(queue.keys.results) == 1,
                 timeout=10, what="one result, one dead letter")
        assert worker.worker.counters.reward_errors == 1
    finally:
        worker.stop()
    [dead] = queue.read_stream(queue.keys.dead)
    assert (dead.group_id, dead.reason, dead.decode().attempts) == ("unlabelled", "missing_label", 0)
    assert "math_boxed needs a label" in dead.error and "not retried" in dead.error
    assert queue.stats()["dead_missing_label"] == 1
    assert_audit_ok(queue)


def test_push_warns_about_rows_without_a_label(run, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input": "1 + 1?", "label": "2"}\n{"input": "2 + 2?"}\n{"input": "3 + 3?", "answer": "6"}\n')
    result = run("push", str(data))
    assert result.exit_code == 0, result.output
    assert ("warning: 2 of 3 rows have no 'label' field: the default reward math_boxed (and exact_match) needs a "
            "label and dead-letters their groups on the first attempt") in result.stderr
    assert "pushed 3 groups" in result.stdout


# -- the command line --------------------------------------------------------------------------


@pytest.mark.parametrize("args,fixed", [
    # A masked password would make the suggested command fail: the environment variable gives the URL.
    (["push", "data.jsonl", "--redis-url", "redis://u:secret@h:1", "--n-samples", "2"],
     "rollout push data.jsonl --n-samples 2"),
    (["push", "data.jsonl", "--redis-url", "redis://h:1", "--namespace", "x"],
     "rollout --redis-url redis://h:1 --namespace x push data.jsonl"),
    (["worker", "-v", "--engine-url", "http://e:1"], "rollout -v worker --engine-url http://e:1"),
    (["dead", "list", "--namespace=exp1", "-vv"], "rollout --namespace=exp1 -vv dead list"),
])
def test_a_global_option_after_the_command_says_where_it_goes(args, fixed):
    from click.testing import CliRunner

    from cli import main

    result = CliRunner().invoke(main, args, prog_name="rollout")
    assert result.exit_code == 2 and "secret" not in result.output and "***" not in result.output
    assert f"is a global option: it goes before the command, as in `{fixed}`" in result.output
    assert ("export ROLLOUT_REDIS_URL=URL" in result.output) == ("secret" in " ".join(args))


def test_an_unknown_option_is_still_unknown_and_a_commands_own_namespace_is_its_own(run):
    assert "No such option '--bogus'" in run("status", "--bogus").output
    result = run("acl", "--role", "worker", "--namespace", "exp1", "--password", "pw")
    assert result.exit_code == 0 and "~{exp1}:*" in result.output


def test_sim_engine_help_mentions_its_stats_endpoint(run):
    assert "GET /sim/stats" in run("sim-engine", "--help").output


# -- a real worker killed with SIGKILL ----------------------------------------------------------


@pytest.mark.slow
def test_a_worker_killed_with_sigkill_is_shown_dead_within_its_lease_and_its_reap_afterwards(
        run, redis_url, queue, namespace):
    """A live pipeline: the simulator hangs every request, so the worker holds its groups
    until it is killed. Status shows it dead within its lease plus one heartbeat; a
    second worker reaps it, and status, inspect and status --worker say so."""
    lease_s, heartbeat_s = 1.5, 0.5
    configure(queue.redis, queue.keys, lease_s=lease_s)
    sim = start_simulator(SimConfig(seed=6, hang_rate=1.0))
    queue.push_groups([Group.fresh(f"k{i}", f"What is {i} + 1?", 2, label=str(i + 1)) for i in range(6)])
    cmd = [sys.executable, "-m", "cli", "--redis-url", redis_url, "--namespace", namespace, "worker",
           "--engine-url", sim.url, "--heartbeat", str(heartbeat_s), "--concurrency", "4"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    victim = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    survivor = None
    try:
        name = wait_for(lambda: next((w.worker for w in snapshot(queue).workers if w.inflight_groups), None),
                        timeout=30, what="the worker holding groups")
        held = snapshot(queue).inflight_by_worker[name]
        listed = run("status", "--worker", name)
        assert f"worker {name}: alive" in listed.output and f"holds {held} groups" in listed.output
        gid = worker_groups(queue, name)[0].groups[0].group_id
        assert f"in flight: worker {name} (alive)" in run("inspect", gid).output

        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed = time.monotonic()
        wait_for(lambda: not snapshot(queue).workers[0].alive, timeout=10, interval=0.02, what="shown dead")
        shown_dead_s = time.monotonic() - killed
        # Its last heartbeat was at most one heartbeat before the kill (0.2-0.3 s for polling,
        # scheduling and a late beat): dead neither later than that nor while its lease ran.
        assert lease_s - heartbeat_s - 0.2 <= shown_dead_s <= lease_s + heartbeat_s + 0.3, shown_dead_s
        status = run("status", "--sample", "0")
        assert f"worker {name} missed its lease: dead (no heartbeat for" in " ".join(status.output.split())

        survivor = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: any(d.worker == name for d in snapshot(queue).departed), timeout=30, what="the reap")
        [d] = [d for d in snapshot(queue).departed if d.worker == name]
        assert (d.how, d.groups) == ("reaped", held)
        assert f"reaped worker {name}" in run("status", "--sample", "0").output
        history = [(e.event, e.who) for e in locate(queue, gid).history]
        assert ("claimed", name) in history and ("reaped", name) in history
        print(f"\nshown dead {shown_dead_s:.2f}s after SIGKILL (lease {lease_s}s, heartbeat {heartbeat_s}s)")
    finally:
        for proc in (victim, survivor):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        http_json(sim.url + "/sim/faults", {"hang_rate": 0.0})
        sim.stop()
    assert_audit_ok(queue)
