"""The status snapshot, dead-letter handling and purge, against a real Redis."""
from __future__ import annotations

import io
import json
import re

import pytest

from pipeline.ops import deadletters
from pipeline.ops.admin import namespace_pattern, purge
from pipeline.ops.audit import audit
from pipeline.consumer import Consumer
from pipeline.control import configure, set_paused, set_weight_version
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Place, Queue
from pipeline.namespaces import empty_message, namespace_is_empty
from pipeline.ops.status import RateTracker, snapshot
from pipeline.ops.status_render import Outage, render
from pipeline.ops.status_watch import StatusWatch
from pipeline.types import Group, Status
from tests.groups import claim, publish
from tests.helpers import wait_for

STABLE_KEYS = {"prompts", "inflight", "results_ready", "results_pending", "requeue", "dead", "workers_alive",
               "weight_version", "paused"}


def make_groups(n: int, prefix: str = "g", n_samples: int = 2) -> list[Group]:
    return [Group.fresh(f"{prefix}{i}", f"What is {i} + 1?", n_samples, label=str(i + 1)) for i in range(n)]


def finish(group: Group, version: str = "0", reward: float = 1.0) -> Group:
    for s in group.samples:
        s.tokens = [1, 2, 3]
        s.response_length = 2
        s.response = "ok"
        s.status = Status.COMPLETED
        s.reward = reward
        s.weight_versions = [version]
        s.rollout_log_probs = [-0.5, -0.25]
    return group


def claim_all(queue: Queue, worker: str, n: int) -> list[Group]:
    claimed = claim(queue, worker, n)
    assert claimed.status == "ok", claimed.status
    return [c.group for c in claimed.groups]


def test_empty_namespace_is_reported(queue, client, namespace):
    assert namespace_is_empty(client, queue.keys)
    snap = snapshot(queue)
    assert snap.empty and snap.prompts == 0
    assert snap.alerts == [f"namespace {namespace!r} is empty: nothing has been pushed"]
    other = Queue(client, namespace + "-other")
    other.push_groups(make_groups(1))
    msg = empty_message(client, namespace)
    assert msg.startswith(f"namespace {namespace!r} is empty: nothing has been pushed")
    assert f"did you mean '{namespace}-other'" in msg  # a typo'd namespace shows the likely one
    assert not snapshot(other).empty


def test_snapshot_counts_every_place(queue, client):
    queue.push_groups(make_groups(10))
    queue.register("w1", json.dumps({"engines": ["http://e1:30000"], "state": "running", "capacity": 64,
                                      "inflight_samples": 8, "counters": {"groups_completed": 3}}))
    held = claim_all(queue, "w1", 6)
    publish(queue, "w1", finish(held[0]), Place.RESULTS)
    publish(queue, "w1", finish(held[1]), Place.RESULTS)
    publish(queue, "w1", finish(held[2]), Place.RESULTS)
    publish(queue, "w1", held[3], Place.REQUEUE)
    publish(queue, "w1", held[4], Place.DEAD, error="engine failed 3 times")
    consumer = Consumer(client, queue.keys.namespace)
    consumer.next_batch(1, timeout=5)  # delivered, not committed: pending
    set_weight_version(client, queue.keys, 4)
    set_paused(client, queue.keys, True)

    snap = snapshot(queue)
    assert not snap.empty
    assert (snap.prompts, snap.inflight, snap.results_ready, snap.results_pending, snap.requeue, snap.dead) == \
        (4, 1, 2, 1, 1, 1)
    assert snap.inflight_by_worker == {"w1": 1}
    assert snap.workers_alive == 1
    w = snap.workers[0]
    assert (w.worker, w.alive, w.state, w.engines, w.capacity, w.inflight_samples, w.inflight_groups) == \
        ("w1", True, "running", ["http://e1:30000"], 64, 8, 1)
    assert w.counters == {"groups_completed": 3}
    assert 0 <= w.last_heartbeat_s < 5
    assert snap.weight_version == 4 and snap.paused
    # Every waiting result was produced at version 0: four versions behind.
    assert snap.staleness.by_lag == {4: 3} and snap.staleness.max == 4 and snap.staleness.checked == 3
    assert 0 <= snap.backlog_age_s < 10 and snap.requeue_age_s is not None
    assert any("paused" in a for a in snap.alerts) and any("1 dead letter " in a for a in snap.alerts)
    d = json.loads(snap.to_json())
    assert STABLE_KEYS <= set(d)
    assert d["inflight"] == 1 and d["staleness"]["by_lag"] == {"4": 3}
    # The audit agrees with the snapshot.
    report = audit(queue)
    assert report.ok and report.prompts == 4 and report.results_pending == 1


def test_expired_worker_is_shown_dead(queue):
    configure(queue.redis, queue.keys, lease_s=10)
    queue.push_groups(make_groups(2))
    claim_all(queue, "gone", 1)
    queue.redis.zadd(queue.keys.workers, {"gone": queue.now_ms() - 3000}, xx=True)  # its lease ran out 3 s ago
    snap = snapshot(queue)
    assert snap.workers_alive == 0 and not snap.workers[0].alive
    assert snap.workers[0].state == "dead (no heartbeat for 13s; its groups return at the next reap)"
    assert "worker gone missed its lease: dead (no heartbeat for 13s; its groups return at the next reap)" in \
        snap.alerts


def test_throughput_committed_is_exact_and_counters_give_rates(queue, client):
    queue.push_groups(make_groups(8))
    tracker = RateTracker()
    first = snapshot(queue, tracker)
    assert first.throughput.published_per_min is None  # one sample: no rate yet
    for g in claim_all(queue, "w", 8):
        publish(queue, "w", finish(g), Place.RESULTS)
    consumer = Consumer(client, queue.keys.namespace)
    consumer.commit(consumer.next_batch(5, timeout=5))
    start = queue.now_ms()  # the tracker samples the Redis clock: let it move on 0.3 s
    wait_for(lambda: queue.now_ms() - start >= 300, what="0.3 s of server time")
    snap = snapshot(queue, tracker)
    t = snap.throughput
    assert t.committed == 5 and t.committed_per_min == 5.0 and t.window_s == 60
    assert t.sampled_s >= 0.3
    assert t.published_per_min == pytest.approx(8 * 60 / t.sampled_s, rel=0.01)
    assert t.claimed_per_min == pytest.approx(8 * 60 / t.sampled_s, rel=0.01)


def test_rate_tracker_window_and_reset():
    tr = RateTracker(window_s=60)
    for i in range(0, 130, 10):  # one sample every 10 s, 6 groups each
        tr.add(float(i), {"results": i * 6 // 10, "claims": 0, "committed": 0})
    assert 60 <= tr.span_s() <= 70
    assert tr.per_min("results") == pytest.approx(36.0)
    tr.add(131.0, {"results": 0})  # counters went down: purged, start over
    assert tr.per_min("results") is None


def test_render_fits_80_columns(queue):
    from rich.console import Console

    queue.push_groups(make_groups(3))
    name = "a-very-long-hostname.example.internal-123456-abcdef"
    queue.register(name, json.dumps({"engines": ["http://engine-with-a-long-name.cluster.local:30000"],
                                      "state": "engine-down: connection refused to engine-with-a-long-name",
                                      "capacity": 512, "inflight_samples": 0}))
    configure(queue.redis, queue.keys, max_staleness=2, batch_size=8, max_ready=64)
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(render(snapshot(queue, RateTracker())))
    lines = out.getvalue().splitlines()
    assert lines and max(len(l.rstrip()) for l in lines) <= 80
    text = out.getvalue()
    for word in ("prompts 3", "workers: 1 alive", "staleness", "committed", "engine-down"):
        assert word in text


def _outage_text(renderable, **console) -> str:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, color_system=None, **{"width": 80, **console}).print(renderable)
    return out.getvalue()


def test_render_under_an_outage_shows_a_banner_and_the_age_of_the_last_good_read(queue):
    queue.push_groups(make_groups(2))
    snap = snapshot(queue, RateTracker())
    outage = Outage("ConnectionError", since=1000.0, last_good=998.0, retry_s=2.0, now=1012.0)
    text = _outage_text(render(snap, outage=outage))
    assert text.startswith("REDIS UNREACHABLE for 12.0s (ConnectionError), retrying every 2s")
    assert "the numbers below are from the last good read, 14.0s ago" in " ".join(text.split())
    assert "prompts 2" in text  # the last good numbers, under the banner
    outage.ended = 1020.0
    back = _outage_text(render(snap, outage=outage))
    assert back.startswith("Redis was unreachable for 20.0s (ConnectionError), back since ")
    assert "REDIS UNREACHABLE" not in back


def _watched(redis_factory, name: str):
    from pipeline.connection import connect

    server = redis_factory(name)
    queue = Queue(connect(server.url), "w")
    queue.push_groups(make_groups(2))
    return server, StatusWatch(queue, RateTracker(), interval=0.01)


def test_watch_on_a_terminal_draws_a_redis_outage_in_the_live_view(redis_factory):
    from rich.console import Console

    server, watch = _watched(redis_factory, "tty")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    watch.run_live(console, reads=1)
    assert "prompts 2" in out.getvalue() and "UNREACHABLE" not in out.getvalue()
    server.kill()
    seen = len(out.getvalue())
    watch.run_live(console, reads=2)
    during = out.getvalue()[seen:]
    assert "REDIS UNREACHABLE for" in during and "(ConnectionError)" in during
    assert "the numbers below are from the last good read" in during and "prompts 2" in during
    redis_factory("tty", data_dir=server.data_dir, port=server.port)
    seen = len(out.getvalue())
    watch.run_live(console, reads=1)
    after = out.getvalue()[seen:]
    assert after.rfind("Redis was unreachable for") > after.rfind("REDIS UNREACHABLE")  # the last frame says it


def test_watch_piped_prints_a_redis_outage_in_its_output(redis_factory):
    from rich.console import Console

    server, watch = _watched(redis_factory, "piped")
    out = io.StringIO()
    console = Console(file=out, width=80, color_system=None)
    assert not console.is_terminal
    watch.run_piped(console, reads=1)
    server.kill()
    watch.run_piped(console, reads=2)
    banners = [l for l in out.getvalue().splitlines() if "REDIS UNREACHABLE" in l]
    assert len(banners) == 2 and all("the numbers below are from the last good read" in l for l in banners)
    assert re.match(r"\d\d:\d\d:\d\d REDIS UNREACHABLE for ", banners[0]), banners[0]
    redis_factory("piped", data_dir=server.data_dir, port=server.port)
    seen = len(out.getvalue())
    watch.run_piped(console, reads=1)
    after = out.getvalue()[seen:]
    assert after.startswith("Redis was unreachable for") and "prompts 2" in after


# -- dead letters -----------------------------------------------------------------------


def dead_letter_setup(queue: Queue, tmp_path) -> dict[str, str]:
    """Two failed generations, one bad dataset row, one undecodable entry."""
    queue.push_groups(make_groups(3, prefix="fail"))
    held = claim_all(queue, "w", 3)
    held[0].attempts = 3
    held[0].error = "engine failed 3 times; last error: 503"
    publish(queue, "w", held[0], Place.DEAD, error=held[0].error)
    publish(queue, "w", finish(held[1]), Place.DEAD, error="reward failed 3 times")
    publish(queue, "w", finish(held[2]), Place.RESULTS)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input": "What is 1 + 1?", "label": "2"}\n{"prompt": "no input key"}\n')
    push_dataset(queue, data, PushOptions(skip_bad=True))
    garbage = queue.redis.xadd(queue.keys.dead, {"gid": "junk:0:0", "data": b"\x00not msgpack", "error": "bad"})
    entries = {e.group_id: e.entry_id for e in queue.iter_stream(queue.keys.dead)}
    entries["garbage"] = garbage.decode()
    return entries


def test_list_and_find_dead_letters(queue, tmp_path):
    ids = dead_letter_setup(queue, tmp_path)
    letters = deadletters.list_dead(queue)
    assert [l.group_id for l in letters] == ["fail0", "fail1", "rows.jsonl:0:1", "junk:0:0"]
    by_gid = {l.group_id: l for l in letters}
    assert by_gid["fail0"].error.startswith("engine failed 3 times")
    assert by_gid["fail0"].not_retriable is None and by_gid["fail0"].group.attempts == 3
    assert by_gid["rows.jsonl:0:1"].bad_row and by_gid["rows.jsonl:0:1"].not_retriable is None
    assert "missing key 'input'" in by_gid["rows.jsonl:0:1"].error
    assert "does not decode" in by_gid["junk:0:0"].not_retriable
    assert deadletters.list_dead(queue, limit=2)[1].group_id == "fail1"
    found, missing = deadletters.find(queue, [ids["fail1"], "fail0", "nope", "1-1"])
    assert [l.group_id for l in found] == ["fail1", "fail0"] and missing == ["nope", "1-1"]
    details = by_gid["rows.jsonl:0:1"].details([], queue.now_ms())
    assert "no input key" in details["raw_row"] and details["bad_row"] is True
    json.dumps([l.details(queue.history(l.group_id), queue.now_ms()) for l in letters])  # every field serializes


def test_retry_resets_and_returns_groups_to_the_head(queue, tmp_path):
    ids = dead_letter_setup(queue, tmp_path)
    queue.push_groups(make_groups(1, prefix="later"))
    result = deadletters.retry(queue, [ids["fail0"], "fail1"])
    assert result.settled == 2 and not result.skipped
    prompts = [p.decode() for p in queue.redis.lrange(queue.keys.prompts, 0, -1)]
    assert prompts[:2] == ["fail0", "fail1"] and prompts[-1] == "later0"  # oldest first, at the head
    groups = claim_all(queue, "w2", 2)
    assert [g.group_id for g in groups] == ["fail0", "fail1"]
    assert all(g.attempts == 0 and g.error is None for g in groups)
    # fail1's samples were complete (a reward failure): their output is kept
    assert all(s.status == Status.COMPLETED for s in groups[1].samples)
    assert audit(queue).missing_payloads == 0


def test_retry_restart_forgets_output(queue, tmp_path):
    dead_letter_setup(queue, tmp_path)
    deadletters.retry(queue, ["fail1"], restart=True)
    group = claim_all(queue, "w2", 1)[0]
    assert all(s.status == Status.PENDING and not s.tokens for s in group.samples)


def test_retry_refuses_bad_rows_and_garbage_naming_them(queue, tmp_path):
    ids = dead_letter_setup(queue, tmp_path)
    with pytest.raises(deadletters.DeadLetterError) as info:
        deadletters.retry(queue, ["fail0", ids["rows.jsonl:0:1"], ids["garbage"]])
    msg = str(info.value)
    assert "rows.jsonl:0:1" in msg and "bad dataset row" in msg
    assert ids["garbage"] in msg and "does not decode" in msg
    assert queue.redis.xlen(queue.keys.dead) == 4  # all or nothing: fail0 stays too
    with pytest.raises(deadletters.DeadLetterError, match="not in the dead-letter stream.*nope"):
        deadletters.retry(queue, ["nope"])
    with pytest.raises(deadletters.DeadLetterError, match="or --all"):
        deadletters.retry(queue, [])
    result = deadletters.retry(queue, all_=True)
    assert result.settled == 2 and {l.group_id for l, _ in result.skipped} == {"rows.jsonl:0:1", "junk:0:0"}
    assert queue.redis.xlen(queue.keys.dead) == 2


def test_drop_discards_and_the_audit_balances(queue, tmp_path):
    dead_letter_setup(queue, tmp_path)
    queue.redis.xdel(queue.keys.dead, *[e.entry_id for e in queue.iter_stream(queue.keys.dead)
                                         if e.group_id == "junk:0:0"])  # not pushed: keep the books right
    letters, n = deadletters.drop(queue, ["fail0"])
    assert n == 1 and letters[0].group_id == "fail0"
    letters, n = deadletters.drop(queue, all_=True)
    assert n == 2 and queue.redis.xlen(queue.keys.dead) == 0
    report = audit(queue)
    assert report.discarded == 3 and report.ok, report.summary()


# -- purge ------------------------------------------------------------------------------


def test_purge_only_touches_its_namespace(client, namespace):
    mine = Queue(client, namespace)
    neighbour = Queue(client, namespace + "x")  # shares the prefix, not the hash tag
    unrelated = f"plain:{namespace}:key"
    client.set(unrelated, 1)
    client.set(f"{{{namespace}x}}:extra", 1)
    for q in (mine, neighbour):
        q.push_groups(make_groups(4))
        q.register("w", "{}")
        held = claim_all(q, "w", 3)
        publish(q, "w", finish(held[0]), Place.RESULTS)
        publish(q, "w", held[1], Place.DEAD, error="x")
        configure(client, q.keys, max_ready=10)
    before = sorted(client.scan_iter(match=namespace_pattern(namespace + "x")))
    assert client.exists(mine.keys.inflight("w"))
    deleted = purge(client, namespace)
    assert deleted >= 7
    assert list(client.scan_iter(match=namespace_pattern(namespace))) == []
    assert namespace_is_empty(client, mine.keys)
    assert sorted(client.scan_iter(match=namespace_pattern(namespace + "x"))) == before
    assert client.get(unrelated) == b"1"
    assert audit(neighbour).ok
    assert purge(client, namespace) == 0
    with pytest.raises(ValueError):
        namespace_pattern("bad*ns")
