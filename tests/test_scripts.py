"""Every Lua script through `Queue`, against a real redis-server: claim, publish (and
the zombie case), heartbeat, reap, release, settle, commit and the push cursor."""
from __future__ import annotations

import json
import time

import pytest
import redis

from pipeline.audit import audit
from pipeline.codec import decode_group, encode_group
from pipeline.control import configure, read_control, set_paused, set_weight_version
from pipeline.keys import CONSUMER_GROUP
from pipeline.queue import Place, Queue, Settle
from pipeline.types import Group, Status


def fresh(n: int, prefix: str = "g", samples: int = 2) -> list[Group]:
    return [Group.fresh(f"{prefix}{i}", f"prompt {i}", samples, label=str(i), row=i) for i in range(n)]


def finish(group: Group, version: int = 0, status: Status = Status.COMPLETED, n_tokens: int = 3) -> Group:
    group.prompt_ids = [1, 2]
    for i, s in enumerate(group.samples):
        s.tokens = [1, 2] + [100 + i] * n_tokens
        s.response_length = n_tokens
        s.response = "r" * n_tokens
        s.rollout_log_probs = [-0.5] * n_tokens
        s.weight_versions = [str(version)] * n_tokens
        s.reward = float(i)
        s.status = status
    return group


def ids(claim) -> list[str]:
    return [c.group_id for c in claim.groups]


def prompts(q: Queue) -> list[str]:
    return [g.decode() for g in q.redis.lrange(q.keys.prompts, 0, -1)]


def inflight(q: Queue, worker: str) -> set[str]:
    return {g.decode() for g in q.redis.smembers(q.keys.inflight(worker))}


def assert_audit_ok(q: Queue):
    report = audit(q)
    assert report.ok, report.summary()
    return report


# -- claim ----------------------------------------------------------------------------


def test_claim_takes_from_head_up_to_max_groups(queue):
    queue.push_groups(fresh(5))
    c = queue.claim("w1", 2)
    assert (c.status, ids(c)) == ("ok", ["g0", "g1"])
    assert inflight(queue, "w1") == {"g0", "g1"}
    assert prompts(queue) == ["g2", "g3", "g4"]
    c = queue.claim("w2", 10)
    assert (c.status, ids(c)) == ("ok", ["g2", "g3", "g4"])
    assert queue.claim("w2", 10).status == "empty"
    assert queue.claim("w3", 1).groups == []
    assert_audit_ok(queue)


def test_claim_returns_decoded_groups_with_admitted_version(queue):
    pushed = fresh(1, samples=3)[0]
    queue.push_groups([pushed])
    set_weight_version(queue.redis, queue.keys, 4)
    c = queue.claim("w", 1)
    assert c.weight_version == 4
    got = c.groups[0].group
    assert got.group_id == "g0" and got.n_samples == 3 and got.samples[0].prompt == "prompt 0"
    assert got.admitted_version == 4
    assert queue.redis.hget(queue.keys.admitted, "g0") == b"4"
    assert read_control(queue.redis, queue.keys).admitted == 1


def test_claim_registers_a_heartbeat(queue):
    queue.push_groups(fresh(1))
    assert queue.live_workers() == {}
    queue.claim("w1", 1)
    assert queue.redis.zscore(queue.keys.workers, "w1") is not None
    assert list(queue.live_workers()) == ["w1"]
    # Even a claim that finds nothing counts as a heartbeat.
    queue.claim("w2", 1)
    assert set(queue.live_workers()) == {"w1", "w2"}


def test_claim_paused(queue):
    queue.push_groups(fresh(3))
    set_paused(queue.redis, queue.keys, True)
    c = queue.claim("w", 2)
    assert (c.status, c.groups) == ("paused", [])
    assert prompts(queue) == ["g0", "g1", "g2"] and inflight(queue, "w") == set()
    set_paused(queue.redis, queue.keys, False)
    assert ids(queue.claim("w", 2)) == ["g0", "g1"]


def test_claim_backlog_limit(queue):
    queue.push_groups(fresh(6))
    configure(queue.redis, queue.keys, max_ready=3)
    c = queue.claim("w", 2)
    for cl in c.groups:
        queue.publish_group("w", finish(cl.group), Place.RESULTS)
    # Two wait in results: room for one more, whatever max_groups says.
    c = queue.claim("w", 5)
    assert ids(c) == ["g2"]
    queue.publish_group("w", finish(c.groups[0].group), Place.RESULTS)
    c = queue.claim("w", 5)
    assert (c.status, c.groups) == ("backlog", [])
    assert prompts(queue)[0] == "g3"
    configure(queue.redis, queue.keys, max_ready=-1)  # limit removed
    assert ids(queue.claim("w", 5)) == ["g3", "g4", "g5"]


def test_claim_staleness_budget_paces_admission(queue):
    """admitted <= (max_staleness + version + 1) * batch_size at every version."""
    eta, batch = 1, 3
    queue.push_groups(fresh(30))
    configure(queue.redis, queue.keys, max_staleness=eta, batch_size=batch)
    for version in range(4):
        set_weight_version(queue.redis, queue.keys, version)
        limit = (eta + version + 1) * batch
        got = []
        while True:
            c = queue.claim("w", 4)
            if not c.groups:
                break
            got += ids(c)
        assert c.status == "budget"
        admitted = read_control(queue.redis, queue.keys).admitted
        assert admitted == limit
        assert len(inflight(queue, "w")) == limit
        # The group refused is still at the head of the list, not admitted.
        head = prompts(queue)[0]
        assert queue.redis.hget(queue.keys.admitted, head) is None
        assert_audit_ok(queue)


def test_budget_does_not_count_reaped_or_requeued_groups_twice(queue):
    queue.push_groups(fresh(4))
    configure(queue.redis, queue.keys, max_staleness=0, batch_size=2)  # limit 2 at version 0
    c = queue.claim("a", 2)
    assert ids(c) == ["g0", "g1"]
    assert queue.claim("b", 1).status == "budget"
    # a dies: its groups go back to the head and may be claimed again although the
    # budget is spent, because they were admitted already.
    assert queue.reap("a", lease_s=0) == 2
    c = queue.claim("b", 5)
    assert sorted(ids(c)) == ["g0", "g1"]
    assert c.status == "ok"
    # b aborts one: requeued, released, claimed again: still not counted.
    g0 = next(x.group for x in c.groups if x.group_id == "g0")
    assert queue.publish_group("b", finish(g0), Place.REQUEUE)
    assert queue.release("continue") == 1
    assert ids(queue.claim("c", 5)) == ["g0"]
    assert read_control(queue.redis, queue.keys).admitted == 2
    assert queue.claim("c", 5).status == "budget"
    assert prompts(queue) == ["g2", "g3"]
    # Trained-on groups keep counting: committing them frees no budget.
    c_group = decode_group(queue.redis.hget(queue.keys.payloads, "g0"))
    queue.publish_group("c", finish(c_group), Place.RESULTS)
    queue.ensure_consumer_group()
    [(eid, _)] = queue.redis.xreadgroup(CONSUMER_GROUP, "t", {queue.keys.results: ">"})[0][1]
    assert queue.settle(queue.keys.results, [Settle("commit", eid.decode(), "g0")], CONSUMER_GROUP) == 1
    assert read_control(queue.redis, queue.keys).admitted == 2
    assert queue.claim("c", 5).status == "budget"
    set_weight_version(queue.redis, queue.keys, 1)  # the trainer moved on: room for two more
    assert ids(queue.claim("c", 5)) == ["g2", "g3"]


def test_dead_letters_free_their_budget_slot(queue):
    """A failed group is never trained on: it must not hold a slot of the staleness
    budget, or (max_staleness + 1) * batch_size failures would stop admission for good."""
    queue.push_groups(fresh(4))
    configure(queue.redis, queue.keys, max_staleness=0, batch_size=2)
    c = queue.claim("w", 2)
    assert queue.claim("w", 1).status == "budget"
    for x in c.groups:
        queue.publish_group("w", x.group, Place.DEAD, error="engine down")
    assert read_control(queue.redis, queue.keys).admitted == 0
    assert ids(queue.claim("w", 5)) == ["g2", "g3"]
    assert_audit_ok(queue)


def test_claim_malformed_payload_is_dead_lettered(queue):
    queue.push_groups(fresh(3))
    queue.redis.hset(queue.keys.payloads, "g1", b"\xc1garbage")
    queue.redis.hdel(queue.keys.payloads, "g2")  # and one with no payload at all
    c = queue.claim("w", 3)
    assert [(x.group_id, x.group is None) for x in c.groups] == [("g0", False), ("g1", True), ("g2", True)]
    assert "not msgpack" in c.groups[1].error
    assert "no payload" in c.groups[2].error
    dead = queue.read_stream(queue.keys.dead)
    assert [(e.group_id, e.error.split(":")[0]) for e in dead] == [("g1", "malformed payload"), ("g2", "malformed payload")]
    assert dead[0].data == b"\xc1garbage"
    assert inflight(queue, "w") == {"g0"}
    assert_audit_ok(queue)


def test_claim_payload_for_another_group_is_dead_lettered(queue):
    a, b = fresh(2)
    queue.push_groups([a, b])
    queue.redis.hset(queue.keys.payloads, "g0", encode_group(b))
    c = queue.claim("w", 1)
    assert c.groups[0].group is None and "payload is for group 'g1'" in c.groups[0].error
    assert queue.redis.xlen(queue.keys.dead) == 1


# -- publish and the zombie case ------------------------------------------------------


@pytest.mark.parametrize("place,stream,counter", [
    (Place.RESULTS, "results", "results"), (Place.REQUEUE, "requeue", "requeue"), (Place.DEAD, "dead", "dead"),
])
def test_publish_while_held(queue, place, stream, counter):
    queue.push_groups(fresh(2))
    g = queue.claim("w", 1).groups[0].group
    error = "engine failed" if place == Place.DEAD else None
    entry_id = queue.publish_group("w", finish(g), place, error=error, keep_response_text=True)
    assert entry_id
    [entry] = queue.read_stream(getattr(queue.keys, stream))
    assert (entry.entry_id, entry.group_id, entry.error) == (entry_id, "g0", error)
    assert entry.decode() == g
    assert inflight(queue, "w") == set()
    assert not queue.redis.hexists(queue.keys.payloads, "g0")  # the payload rides in the entry now
    assert queue.stats()[counter] == 1
    # Published once: the second publish of the same group finds it no longer held.
    assert queue.publish_group("w", g, place, error=error) is None
    assert queue.redis.xlen(getattr(queue.keys, stream)) == 1
    assert_audit_ok(queue)


def test_results_leave_response_text_out_unless_asked(queue):
    queue.push_groups(fresh(3))
    gs = [finish(c.group) for c in queue.claim("w", 3).groups]
    queue.publish_group("w", gs[0], Place.RESULTS)
    queue.publish_group("w", gs[1], Place.RESULTS, keep_response_text=True)
    queue.publish_group("w", gs[2], Place.REQUEUE)  # a continuation appends to the text: kept
    plain, kept = (e.decode() for e in queue.read_stream(queue.keys.results))
    assert [s.response for s in plain.samples] == ["", ""]
    assert plain.samples[0].tokens == gs[0].samples[0].tokens
    assert [s.response for s in kept.samples] == ["rrr", "rrr"]
    assert [s.response for s in queue.read_stream(queue.keys.requeue)[0].decode().samples] == ["rrr", "rrr"]


def test_publish_not_held_is_refused(queue):
    queue.push_groups(fresh(2))
    queue.claim("w", 1)
    g1 = decode_group(queue.redis.hget(queue.keys.payloads, "g1"))
    assert queue.publish_group("w", g1, Place.RESULTS) is None  # queued, not claimed
    assert queue.publish_group("other", g1, Place.RESULTS) is None
    assert queue.publish("w", "nope", b"x", Place.DEAD, error="x") is None
    for stream in (queue.keys.results, queue.keys.requeue, queue.keys.dead):
        assert queue.redis.xlen(stream) == 0
    assert prompts(queue) == ["g1"] and inflight(queue, "w") == {"g0"}
    assert_audit_ok(queue)


def test_zombie_cannot_publish(make_queue):
    q = make_queue(lease_s=0.5)
    q.push_groups(fresh(2))
    a_group = q.claim("A", 1).groups[0].group
    assert a_group.group_id == "g0"
    assert q.reap("A") == -1  # lease not over yet: A is alive
    time.sleep(0.6)
    assert q.reap("A") == 1  # presumed dead
    assert prompts(q) == ["g0", "g1"]  # back at the head
    b_group = q.claim("B", 1).groups[0].group
    assert b_group.group_id == "g0"
    # A was only slow: its late publish must not land anywhere.
    for place in (Place.RESULTS, Place.REQUEUE, Place.DEAD):
        assert q.publish_group("A", finish(a_group, status=Status.COMPLETED), place, error="x") is None
    for stream in (q.keys.results, q.keys.requeue, q.keys.dead):
        assert q.redis.xlen(stream) == 0
    assert inflight(q, "B") == {"g0"} and inflight(q, "A") == set()
    assert_audit_ok(q)
    # A's next heartbeat tells it it had been reaped.
    assert q.heartbeat("A", "{}").was_registered is False
    assert q.publish_group("B", finish(b_group), Place.RESULTS)
    assert [e.group_id for e in q.read_stream(q.keys.results)] == ["g0"]
    assert q.stats()["results"] == 1
    assert_audit_ok(q)


# -- heartbeat ------------------------------------------------------------------------


def test_heartbeat(queue):
    hb = queue.heartbeat("w", json.dumps({"state": "generating"}))
    assert (hb.was_registered, hb.paused, hb.weight_version) == (False, False, 0)
    set_paused(queue.redis, queue.keys, True)
    set_weight_version(queue.redis, queue.keys, 7)
    hb = queue.heartbeat("w", json.dumps({"state": "paused"}))
    assert (hb.was_registered, hb.paused, hb.weight_version) == (True, True, 7)
    assert json.loads(queue.redis.hget(queue.keys.worker_info, "w")) == {"state": "paused"}
    before = queue.redis.zscore(queue.keys.workers, "w")
    time.sleep(0.01)
    queue.heartbeat("w", "{}")
    assert queue.redis.zscore(queue.keys.workers, "w") > before
    assert queue.leave("w") == 0
    assert queue.heartbeat("w", "{}").was_registered is False  # reaped meanwhile


# -- reap -----------------------------------------------------------------------------


def test_reap_only_expired_workers(make_queue):
    q = make_queue(lease_s=0.6)
    q.push_groups(fresh(6))
    q.claim("old", 2)
    time.sleep(0.4)
    q.claim("young", 2)
    time.sleep(0.3)
    # old: 0.7 s since its heartbeat, young: 0.3 s.
    assert q.reap("young") == -1
    assert inflight(q, "young") == {"g2", "g3"}
    assert q.reap_expired() == 2
    assert inflight(q, "old") == set() and inflight(q, "young") == {"g2", "g3"}
    assert set(prompts(q)[:2]) == {"g0", "g1"} and prompts(q)[2:] == ["g4", "g5"]
    assert set(q.live_workers()) == {"young"}
    assert q.redis.zscore(q.keys.workers, "old") is None
    assert q.stats()["reaped"] == 2
    assert q.reap_expired() == 0
    assert_audit_ok(q)


def test_reaped_groups_go_to_the_head(queue):
    queue.push_groups(fresh(5))
    queue.claim("w", 3)
    assert queue.reap("w", lease_s=0) == 3
    assert set(prompts(queue)[:3]) == {"g0", "g1", "g2"}
    assert prompts(queue)[3:] == ["g3", "g4"]
    assert sorted(ids(queue.claim("x", 3))) == ["g0", "g1", "g2"]


def test_leave_returns_groups_at_once(queue):
    queue.push_groups(fresh(3))
    queue.heartbeat("w", json.dumps({"state": "generating"}))
    queue.claim("w", 2)
    assert queue.reap("w") == -1  # heartbeat is fresh
    assert queue.leave("w") == 2
    assert inflight(queue, "w") == set()
    assert len(prompts(queue)) == 3
    assert queue.redis.hget(queue.keys.worker_info, "w") is None
    assert queue.live_workers() == {}
    assert_audit_ok(queue)


def test_reap_unknown_worker_is_harmless(queue):
    assert queue.reap("ghost") == 0
    assert queue.leave("ghost") == 0


# -- release --------------------------------------------------------------------------


def _abort(q: Queue, n: int, worker: str = "w") -> list[Group]:
    out = []
    for c in q.claim(worker, n).groups:
        g = finish(c.group, version=2, status=Status.ABORTED, n_tokens=2)
        assert q.publish_group(worker, g, Place.REQUEUE)
        out.append(g)
    return out


def test_release_continue_keeps_partial_output(queue):
    queue.push_groups(fresh(4))
    aborted = _abort(queue, 2)
    assert queue.release("continue") == 2
    # Oldest first, ahead of what was queued.
    assert prompts(queue) == ["g0", "g1", "g2", "g3"]
    assert queue.redis.xlen(queue.keys.requeue) == 0
    back = [c.group for c in queue.claim("w2", 2).groups]
    for got, want in zip(back, aborted):
        assert got.samples == want.samples and got.prompt_ids == want.prompt_ids
        assert got.samples[0].weight_versions == ["2", "2"]
        assert got.samples[0].status == Status.ABORTED
    assert queue.stats()["released"] == 2
    assert_audit_ok(queue)


def test_release_restart_resets(queue):
    queue.push_groups(fresh(2))
    _abort(queue, 1)
    assert queue.release("restart") == 1
    g = queue.claim("w2", 1).groups[0].group
    assert g.group_id == "g0" and g.prompt_ids == []
    for s in g.samples:
        assert (s.tokens, s.response_length, s.response, s.reward) == ([], 0, "", None)
        assert (s.loss_mask, s.rollout_log_probs, s.weight_versions) == (None, None, [])
        assert s.status == Status.PENDING
        assert s.prompt == "prompt 0" and s.label == "0"
    assert_audit_ok(queue)


def test_release_drop_counts_and_logs(queue):
    queue.push_groups(fresh(3))
    _abort(queue, 2)
    assert queue.release("drop") == 2
    assert prompts(queue) == ["g2"]
    assert queue.stats()["dropped"] == 2
    log = queue.redis.xrange(queue.keys.dropped)
    assert sorted((f[b"gid"], f[b"reason"]) for _, f in log) == [(b"g0", b"requeue-drop"), (b"g1", b"requeue-drop")]
    assert queue.redis.hget(queue.keys.admitted, "g0") is None
    report = assert_audit_ok(queue)
    assert report.dropped == 2


def test_release_malformed_entry_goes_dead(queue):
    queue.push_groups(fresh(3))
    good = _abort(queue, 1)[0]
    queue.claim("w", 1)
    queue.publish("w", "g1", b"\x93corrupt", Place.REQUEUE)
    assert queue.release("continue") == 2
    assert prompts(queue) == ["g0", "g2"]
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "g1" and dead.data == b"\x93corrupt"
    assert dead.error.startswith("malformed requeue entry: not msgpack")
    assert decode_group(queue.redis.hget(queue.keys.payloads, "g0")).samples == good.samples
    assert_audit_ok(queue)


def test_release_max_count_and_policy_check(queue):
    queue.push_groups(fresh(5))
    _abort(queue, 4)
    assert queue.release("continue", max_count=3) == 3
    assert prompts(queue) == ["g0", "g1", "g2", "g4"]
    assert queue.redis.xlen(queue.keys.requeue) == 1
    with pytest.raises(ValueError, match="unknown release policy 'later'"):
        queue.release("later")
    assert queue.release() == 1
    assert queue.release() == 0
    assert_audit_ok(queue)


# -- settle and commit ----------------------------------------------------------------


def _results(q: Queue, n: int) -> list:
    q.push_groups(fresh(n))
    for c in q.claim("w", n).groups:
        q.publish_group("w", finish(c.group), Place.RESULTS)
    q.ensure_consumer_group()
    rows = q.redis.xreadgroup(CONSUMER_GROUP, "t", {q.keys.results: ">"}, count=n)[0][1]
    return [(e.entry_id, e.group_id, e.data) for e in q.entries(q.keys.results, rows)]


def test_commit_acks_deletes_and_counts(queue):
    rows = _results(queue, 3)
    k = queue.keys
    assert queue.redis.xpending(k.results, CONSUMER_GROUP)["pending"] == 3
    n = queue.settle(k.results, [Settle("commit", eid, gid) for eid, gid, _ in rows[:2]], CONSUMER_GROUP)
    assert n == 2
    assert queue.redis.xlen(k.results) == 1
    assert queue.redis.xpending(k.results, CONSUMER_GROUP)["pending"] == 1
    assert queue.stats()["committed"] == 2
    assert {m.decode() for m in queue.redis.zrange(k.committed, 0, -1)} == {"g0", "g1"}
    assert queue.redis.hmget(k.admitted, ["g0", "g1", "g2"]) == [None, None, b"0"]
    # Settling again does nothing: already gone.
    assert queue.settle(k.results, [Settle("commit", eid, gid) for eid, gid, _ in rows[:2]], CONSUMER_GROUP) == 0
    assert queue.stats()["committed"] == 2
    assert_audit_ok(queue)


def test_settle_actions(queue):
    rows = _results(queue, 4)
    k = queue.keys
    (e0, g0, _), (e1, g1, _), (e2, g2, d2), (e3, g3, d3) = rows
    n = queue.settle(k.results, [
        Settle("drop", e0, g0, "all rewards equal"),
        Settle("prompt", e1, g1, payload=encode_group(Group.fresh(g1, "p", 1))),
        Settle("dead", e2, g2, "bad reward", d2),
        Settle("duplicate", e3, g3),
    ], CONSUMER_GROUP)
    assert n == 4
    assert queue.redis.xlen(k.results) == 0
    assert queue.redis.xpending(k.results, CONSUMER_GROUP)["pending"] == 0
    assert [(f[b"gid"], f[b"reason"]) for _, f in queue.redis.xrange(k.dropped)] == [(b"g0", b"all rewards equal")]
    assert prompts(queue) == ["g1"] and decode_group(queue.redis.hget(k.payloads, "g1")).n_samples == 1
    [dead] = queue.read_stream(k.dead)
    assert (dead.group_id, dead.error, dead.data) == ("g2", "bad reward", d2)
    stats = queue.stats()
    assert (stats["dropped"], stats["released"], stats["dead"], stats["duplicates"]) == (1, 1, 1, 1)
    assert "committed" not in stats
    # discard: an operator throws the dead letter away (a stream without consumer group).
    assert queue.settle(k.dead, [Settle("discard", dead.entry_id, "g2")]) == 1
    assert queue.redis.xlen(k.dead) == 0 and queue.stats()["discarded"] == 1
    # The duplicate was a planted extra: pushed 4, one of them (g3) now nowhere.
    report = audit(queue)
    assert report.missing == 1 and report.accounted == 3


def test_settle_unknown_action_changes_nothing(queue):
    rows = _results(queue, 2)
    with pytest.raises(redis.ResponseError, match="unknown action explode"):
        queue.settle(queue.keys.results, [Settle("commit", rows[0][0], rows[0][1]),
                                          Settle("explode", rows[1][0], rows[1][1])], CONSUMER_GROUP)
    assert queue.redis.xlen(queue.keys.results) == 2
    assert queue.redis.xpending(queue.keys.results, CONSUMER_GROUP)["pending"] == 2
    assert queue.settle(queue.keys.results, [], CONSUMER_GROUP) == 0


def test_settle_needs_delivery_to_the_group(queue):
    """With a consumer group, only entries delivered to it (XACK succeeds) are settled."""
    queue.push_groups(fresh(1))
    queue.claim("w", 1)
    eid = queue.publish_group("w", finish(decode_group(queue.redis.hget(queue.keys.payloads, "g0"))), Place.RESULTS)
    queue.ensure_consumer_group()
    assert queue.settle(queue.keys.results, [Settle("commit", eid, "g0")], CONSUMER_GROUP) == 0
    assert queue.redis.xlen(queue.keys.results) == 1


def test_committed_ids_are_trimmed(queue, monkeypatch):
    import pipeline.queue as qmod

    monkeypatch.setattr(qmod, "COMMITTED_IDS_KEPT", 3)
    rows = _results(queue, 5)
    queue.settle(queue.keys.results, [Settle("commit", e, g) for e, g, _ in rows], CONSUMER_GROUP)
    assert queue.redis.zcard(queue.keys.committed) == 3
    assert queue.stats()["committed"] == 5


def test_ensure_consumer_group_is_idempotent(queue):
    queue.ensure_consumer_group()
    queue.ensure_consumer_group()
    groups = queue.redis.xinfo_groups(queue.keys.results)
    assert [g["name"] for g in groups] == [CONSUMER_GROUP.encode()]


# -- push cursor ----------------------------------------------------------------------


def test_push_advances_cursor_atomically(queue):
    items = [("prompt", f"d:0:{i}", encode_group(Group.fresh(f"d:0:{i}", "p", 1))) for i in range(3)]
    assert queue.push("d:0", 0, items) == (True, 3)
    assert queue.redis.hget(queue.keys.dataset, "d:0") == b"3"
    assert prompts(queue) == ["d:0:0", "d:0:1", "d:0:2"]
    # A second producer that still thinks the cursor is at 0 is told where it is.
    assert queue.push("d:0", 0, items) == (False, 3)
    assert prompts(queue) == ["d:0:0", "d:0:1", "d:0:2"]
    assert queue.stats()["pushed"] == 3
    more = [("prompt", "d:0:3", encode_group(Group.fresh("d:0:3", "p", 1))),
            ("d.jsonl:5: missing key 'input'", "d:0:4", b"raw")]
    assert queue.push("d:0", 3, more) == (True, 5)
    [dead] = queue.read_stream(queue.keys.dead)
    assert (dead.group_id, dead.error) == ("d:0:4", "d.jsonl:5: missing key 'input'")
    assert queue.stats()["pushed"] == 5 and queue.stats()["dead"] == 1
    assert queue.redis.hget(queue.keys.dataset, "d:0") == b"5"
    assert_audit_ok(queue)
