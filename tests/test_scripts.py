"""Every Lua script through `Queue`, against a real redis-server: register, claim (and
its fencing token, its retry after a lost reply, its claim count), publish (and the
zombie case), heartbeat, reap and leave, hand-back, release, settle and the push cursor."""
from __future__ import annotations

import json

import pytest
import redis

from pipeline import scripts
from pipeline.ops.audit import audit
from pipeline.codec import decode_group, encode_group
from pipeline.control import (DEFAULT_LEASE_S, configure, read_control, set_paused, set_weight_version,
                              staleness_limit)
from pipeline.keys import CONSUMER_GROUP
from pipeline.queue import ClaimStatus, Place, Publish, Published, Queue, Settle
from pipeline.writer import SessionFenced, TrainerSession
from pipeline.retry import Reconnect
from pipeline.types import Group, Status
from tests.helpers import LoseReplies
from tests.groups import assert_audit_ok, claim, expire, finish, fresh, inflight, produce, prompts, publish


def ids(c) -> list[str]:
    return [x.group_id for x in c.groups]


# -- register and claim ---------------------------------------------------------------


def test_claim_takes_from_head_up_to_max_groups(queue):
    queue.push_groups(fresh(5))
    c = claim(queue, "w1", 2)
    assert (c.status, ids(c)) == (ClaimStatus.OK, ["g0", "g1"])
    assert queue.held("w1") == {"g0": c.groups[0].token, "g1": c.groups[0].token}
    assert prompts(queue) == ["g2", "g3", "g4"]
    c = claim(queue, "w2", 10)
    assert (c.status, ids(c)) == (ClaimStatus.OK, ["g2", "g3", "g4"])
    assert claim(queue, "w2", 10).status == ClaimStatus.EMPTY
    assert claim(queue, "w3", 1).groups == []
    assert_audit_ok(queue)


def test_claim_returns_decoded_groups_with_admitted_version(queue):
    queue.push_groups(fresh(1, samples=3))
    set_weight_version(queue.redis, queue.keys, 4)
    c = claim(queue, "w", 1)
    assert c.weight_version == 4
    got = c.groups[0].group
    assert got.group_id == "g0" and got.n_samples == 3 and got.samples[0].prompt == "prompt 0"
    assert got.admitted_version == 4
    assert queue.redis.hget(queue.keys.admitted, "g0") == b"4"
    assert read_control(queue.redis, queue.keys).admitted == 1


def test_claim_never_registers_a_worker(queue):
    """Issue 8 #5: a claim from an id that is not registered (reaped, or never) takes
    nothing and does not put the id back among the workers."""
    queue.push_groups(fresh(2))
    c = queue.claim("stranger", "stranger:1", 2)
    assert (c.status, c.groups) == (ClaimStatus.UNREGISTERED, [])
    assert queue.redis.zscore(queue.keys.workers, "stranger") is None
    assert prompts(queue) == ["g0", "g1"]


def test_register_once_with_the_namespace_lease(queue):
    configure(queue.redis, queue.keys, lease_s=12)
    assert queue.register("w", '{"pid": 1}') == 12
    deadline = queue.redis.zscore(queue.keys.workers, "w")
    assert 11_000 < deadline - queue.now_ms() <= 12_000
    with pytest.raises(ValueError, match="registered already"):
        queue.register("w", '{"pid": 2}')


def test_a_registration_whose_reply_was_lost_succeeds_when_retried(queue):
    """Found by `rollout chaos`: a worker whose registration reply was lost retried it, was
    told its own id was registered already, and exited."""
    queue._scripts["register"] = LoseReplies(queue._scripts["register"], armed=1)
    assert Reconnect("test").call(queue.register, "w#1", '{"pid": 1}') == DEFAULT_LEASE_S
    assert queue.live_workers() == ["w#1"]
    with pytest.raises(ValueError, match="registered already"):  # another process under that id
        queue.register("w#1", '{"pid": 2}')


def test_claim_by_an_expired_worker_takes_nothing(queue):
    queue.push_groups(fresh(2))
    queue.register("w")
    expire(queue, "w")
    assert queue.claim("w", "w:1", 2).status == ClaimStatus.EXPIRED
    assert prompts(queue) == ["g0", "g1"]
    # A heartbeat renews the lease of a worker nobody reaped yet.
    assert queue.heartbeat("w", "{}").reaped is False
    assert ids(queue.claim("w", "w:2", 2)) == ["g0", "g1"]


def test_retried_claim_returns_the_same_groups(queue):
    """Issue 8 #4: the same claim id again (a retry after a lost reply) hands back what
    the first run took, and takes nothing more."""
    queue.push_groups(fresh(5))
    queue.register("w")
    first = queue.claim("w", "w:7", 2)
    again = queue.claim("w", "w:7", 2)
    assert ids(first) == ids(again) == ["g0", "g1"]
    assert [g.group for g in again.groups] == [g.group for g in first.groups]
    assert prompts(queue) == ["g2", "g3", "g4"]
    assert ids(queue.claim("w", "w:8", 2)) == ["g2", "g3"]
    # A group published since is not handed out again by an old claim id.
    publish(queue, "w", first.groups[0], group=finish(first.groups[0].group))
    assert queue.claim("w", "w:8", 2).groups[0].group_id == "g2"
    assert_audit_ok(queue)


def test_lost_claim_reply_then_retry_strands_nothing(queue):
    """Issue 8 #4 (r5): the claim ran, its reply was lost, the caller retries."""
    queue.push_groups(fresh(4))
    queue.register("w")
    queue._scripts["claim"] = LoseReplies(queue._scripts["claim"], armed=1)
    with pytest.raises(redis.ConnectionError):
        queue.claim("w", "w:1", 2)
    c = queue.claim("w", "w:1", 2)
    assert ids(c) == ["g0", "g1"] and set(queue.held("w")) == {"g0", "g1"}
    assert_audit_ok(queue)


def test_claim_paused(queue):
    queue.push_groups(fresh(3))
    set_paused(queue.redis, queue.keys, True)
    c = claim(queue, "w", 2)
    assert (c.status, c.groups) == (ClaimStatus.PAUSED, [])
    assert prompts(queue) == ["g0", "g1", "g2"] and inflight(queue, "w") == set()
    set_paused(queue.redis, queue.keys, False)
    assert ids(claim(queue, "w", 2)) == ["g0", "g1"]


def test_claim_backlog_limit(queue):
    queue.push_groups(fresh(6))
    configure(queue.redis, queue.keys, max_ready=3)
    for cl in claim(queue, "w", 2).groups:
        publish(queue, "w", cl, group=finish(cl.group))
    # Two wait in results: room for one more, whatever max_groups says.
    c = claim(queue, "w", 5)
    assert ids(c) == ["g2"]
    publish(queue, "w", c.groups[0], group=finish(c.groups[0].group))
    c = claim(queue, "w", 5)
    assert (c.status, c.groups) == (ClaimStatus.BACKLOG, [])
    assert prompts(queue)[0] == "g3"
    configure(queue.redis, queue.keys, max_ready=-1)  # back to the default
    assert ids(claim(queue, "w", 5)) == ["g3", "g4", "g5"]


def test_claim_staleness_budget_paces_admission(queue):
    """admitted <= (max_staleness + version + 1) * batch_size at every version."""
    eta, batch = 1, 3
    queue.push_groups(fresh(30))
    configure(queue.redis, queue.keys, max_staleness=eta, batch_size=batch)
    for version in range(4):
        set_weight_version(queue.redis, queue.keys, version)
        while True:
            c = claim(queue, "w", 4)
            if not c.groups:
                break
        assert c.status == ClaimStatus.BUDGET
        assert read_control(queue.redis, queue.keys).admitted == staleness_limit(eta, version, batch)
        assert len(inflight(queue, "w")) == staleness_limit(eta, version, batch)
        # The group refused is still at the head of the list, not admitted.
        assert queue.redis.hget(queue.keys.admitted, prompts(queue)[0]) is None
        assert_audit_ok(queue)


def test_staleness_formula_is_the_same_in_lua_and_python(queue):
    prelude = scripts.source("claim").split("-- Claim up to")[0]
    probe = prelude + "\nreturn staleness_limit(tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]))"
    for eta, version, batch in [(0, 0, 1), (1, 3, 8), (4, 17, 64), (2, 0, 5)]:
        assert queue.redis.eval(probe, 0, eta, version, batch) == staleness_limit(eta, version, batch)


def test_budget_does_not_count_reaped_or_requeued_groups_twice(queue, client, namespace):
    from pipeline.consumer import Consumer

    queue.push_groups(fresh(4))
    configure(queue.redis, queue.keys, max_staleness=0, batch_size=2)  # limit 2 at version 0
    assert ids(claim(queue, "a", 2)) == ["g0", "g1"]
    assert claim(queue, "b", 1).status == ClaimStatus.BUDGET
    # a dies: its groups go back to the head and may be claimed again although the
    # budget is spent, because they were admitted already.
    expire(queue, "a")
    assert queue.reap("a") == 2
    c = claim(queue, "b", 5)
    assert sorted(ids(c)) == ["g0", "g1"] and c.status == ClaimStatus.OK
    # b aborts one: requeued, released, claimed again: still not counted.
    g0 = next(x for x in c.groups if x.group_id == "g0")
    assert publish(queue, "b", g0, Place.REQUEUE, group=finish(g0.group)) == Published.OK
    assert queue.release("continue") == 1
    c = claim(queue, "c", 5)
    assert ids(c) == ["g0"]
    assert read_control(queue.redis, queue.keys).admitted == 2
    assert claim(queue, "c", 5).status == ClaimStatus.BUDGET
    assert prompts(queue) == ["g2", "g3"]
    # Trained-on groups keep counting: committing them frees no budget.
    publish(queue, "c", c.groups[0], group=finish(c.groups[0].group))
    consumer = Consumer(client, namespace, block_s=0.05)
    configure(queue.redis, queue.keys, batch_size=1)  # next_batch must ask for the configured size
    consumer.commit(consumer.next_batch(1, timeout=5))
    assert read_control(queue.redis, queue.keys).admitted == 2
    configure(queue.redis, queue.keys, batch_size=2)
    assert claim(queue, "c", 5).status == ClaimStatus.BUDGET
    set_weight_version(queue.redis, queue.keys, 1)  # the trainer moved on: room for two more
    assert ids(claim(queue, "c", 5)) == ["g2", "g3"]


def test_dead_letters_free_their_budget_slot(queue):
    """A failed group is never trained on: it must not hold a slot of the staleness
    budget, or (max_staleness + 1) * batch_size failures would stop admission for good."""
    queue.push_groups(fresh(4))
    configure(queue.redis, queue.keys, max_staleness=0, batch_size=2)
    c = claim(queue, "w", 2)
    assert claim(queue, "w", 1).status == ClaimStatus.BUDGET
    for x in c.groups:
        publish(queue, "w", x, Place.DEAD, error="engine down")
    assert read_control(queue.redis, queue.keys).admitted == 0
    assert ids(claim(queue, "w", 5)) == ["g2", "g3"]
    assert_audit_ok(queue)


def test_claim_malformed_payload_is_dead_lettered(queue):
    queue.push_groups(fresh(3))
    queue.redis.hset(queue.keys.payloads, "g1", b"\xc1garbage")
    queue.redis.hdel(queue.keys.payloads, "g2")  # and one with no payload at all
    c = claim(queue, "w", 3)
    assert [(x.group_id, x.group is None) for x in c.groups] == [("g0", False), ("g1", True), ("g2", True)]
    dead = queue.read_stream(queue.keys.dead)
    assert [(e.group_id, e.error.split(":")[0]) for e in dead] == [("g1", "malformed payload"),
                                                                    ("g2", "malformed payload")]
    assert "not msgpack" in dead[0].error and "no payload" in dead[1].error
    assert dead[0].data == b"\xc1garbage"
    assert inflight(queue, "w") == {"g0"}
    assert_audit_ok(queue)


def test_claim_of_a_non_utf8_group_id_dead_letters_it(queue):
    """Poison data: a foreign id in the prompt list must not stop every worker."""
    queue.push_groups(fresh(1))
    queue.redis.lpush(queue.keys.prompts, b"\xff\xfebad")
    c = claim(queue, "w", 2)
    assert [x.group is None for x in c.groups] == [True, False]
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.error.startswith("group id is not UTF-8") and queue.redis.hlen(queue.keys.inflight("w")) == 1


def test_claim_payload_for_another_group_is_dead_lettered(queue):
    a, b = fresh(2)
    queue.push_groups([a, b])
    queue.redis.hset(queue.keys.payloads, "g0", encode_group(b))
    c = claim(queue, "w", 1)
    assert c.groups[0].group is None
    assert "payload is for group 'g1'" in queue.read_stream(queue.keys.dead)[0].error


# -- claim counts (issue 15) -----------------------------------------------------------


def test_reaps_count_and_a_group_that_kills_its_workers_is_dead_lettered(queue):
    configure(queue.redis, queue.keys, max_claims=3)
    queue.push_groups(fresh(2))
    for n in range(3):  # three workers die holding g0
        c = claim(queue, f"w{n}", 1)
        assert ids(c) == ["g0"]
        expire(queue, f"w{n}")
        assert queue.reap(f"w{n}") == 1
    assert int(queue.redis.hget(queue.keys.claims, "g0")) == 3
    c = claim(queue, "w3", 1)
    assert ids(c) == ["g1"]  # g0 went to dead letters instead
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "g0"
    assert dead.error == "claimed 3 times without finishing; held by w0 (reaped), w1 (reaped), w2 (reaped)"
    assert dead.decode().group_id == "g0"  # the pushed group: `dead retry` can send it back
    assert queue.redis.hget(queue.keys.claims, "g0") is None
    assert queue.stats()["dead_max_claims"] == 1
    assert_audit_ok(queue)


def test_clean_hand_backs_requeues_and_finishing_do_not_count(queue):
    configure(queue.redis, queue.keys, max_claims=2)
    queue.push_groups(fresh(1))
    for n in range(4):  # SIGTERM hand-backs: not the group's doing
        assert ids(claim(queue, f"leaver{n}", 1)) == ["g0"]
        assert queue.leave(f"leaver{n}") == 1
    c = claim(queue, "p", 1)
    for _ in range(4):  # a pause requeues it, a release puts it back
        assert publish(queue, "p", c.groups[0], Place.REQUEUE, group=finish(c.groups[0].group,
                                                                             status=Status.ABORTED)) == Published.OK
        queue.release()
        c = claim(queue, "p", 1)
    assert int(queue.redis.hget(queue.keys.claims, "g0")) == 1
    history = [event for _, event, _, _ in queue.history("g0")]
    assert history.count("handed_back") == 4 and history.count("claimed") == 9
    publish(queue, "p", c.groups[0], group=finish(c.groups[0].group))
    assert queue.redis.hget(queue.keys.claims, "g0") is None  # finished: the count is over
    assert_audit_ok(queue)


def test_dead_retry_resets_the_claim_count(queue):
    from pipeline.ops.deadletters import retry

    configure(queue.redis, queue.keys, max_claims=1)
    queue.push_groups(fresh(1))
    claim(queue, "a", 1)
    expire(queue, "a")
    queue.reap("a")
    assert claim(queue, "b", 1).groups == []
    assert retry(queue, all_=True).settled == 1
    assert ids(claim(queue, "b", 1)) == ["g0"]
    assert_audit_ok(queue)


# -- publish and the zombie case ------------------------------------------------------


@pytest.mark.parametrize("place,stream,counter", [
    (Place.RESULTS, "results", "results"), (Place.REQUEUE, "requeue", "requeue"), (Place.DEAD, "dead", "dead"),
])
def test_publish_while_held(queue, place, stream, counter):
    queue.push_groups(fresh(2))
    c = claim(queue, "w", 1).groups[0]
    error = "engine failed" if place == Place.DEAD else None
    g = finish(c.group)
    assert publish(queue, "w", c, place, group=g, error=error, keep_response_text=True) == Published.OK
    [entry] = queue.read_stream(getattr(queue.keys, stream))
    assert (entry.group_id, entry.error) == ("g0", error)
    assert entry.decode() == g
    assert inflight(queue, "w") == set()
    assert not queue.redis.hexists(queue.keys.payloads, "g0")  # the payload rides with the entry now
    assert queue.stats()[counter] == 1
    # A retry of the same publish (its reply was lost) is told it went through.
    assert publish(queue, "w", c, place, group=g, error=error) == Published.ALREADY
    assert queue.redis.xlen(getattr(queue.keys, stream)) == 1
    assert_audit_ok(queue)


def test_publish_many_moves_each_group_in_one_round_trip_and_refuses_only_the_stale_one(queue, monkeypatch):
    """Several finished groups go in one MULTI (their staged SETs and publish scripts: one
    event-loop pass, one fsync under appendfsync always); a group held under another token
    is refused on its own, the others are published."""
    import redis.connection

    queue.push_groups(fresh(5))
    first, *held = claim(queue, "w", 5).groups
    assert publish(queue, "w", first, group=finish(first.group)) == Published.OK  # the script is loaded now
    items = [Publish(c.group_id, c.token, encode_group(finish(c.group), False), Place.RESULTS) for c in held[:2]]
    items.append(Publish(held[2].group_id, "w:other", encode_group(finish(held[2].group), False), Place.RESULTS))
    items.append(Publish(held[3].group_id, held[3].token, held[3].payload, Place.DEAD, "engine failed", "engine"))
    sent = []
    send = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        lambda self, *a, **kw: sent.append(1) or send(self, *a, **kw))
    assert queue.publish_many("w", items) == [Published.OK, Published.OK, Published.REFUSED, Published.OK]
    assert len(sent) == 1
    monkeypatch.undo()
    assert [e.group_id for e in queue.read_stream(queue.keys.results)] == ["g0", "g1", "g2"]
    assert [(e.group_id, e.reason) for e in queue.read_stream(queue.keys.dead)] == [("g4", "engine")]
    assert inflight(queue, "w") == {"g3"}
    assert not list(queue.redis.scan_iter(match=queue.keys.staged("*", "*")))  # the refused one's staging too
    # Retried whole (its reply was lost): what went through answers already.
    assert queue.publish_many("w", items) == [Published.ALREADY, Published.ALREADY, Published.REFUSED,
                                              Published.ALREADY]
    assert queue.redis.xlen(queue.keys.results) == 3
    assert_audit_ok(queue)


def test_a_publish_after_the_server_forgot_its_scripts_loads_them_again(queue):
    """A restarted (or SCRIPT FLUSHed) server answers the MULTI's EVALSHA with NOSCRIPT,
    after the staged SET ran: the script is loaded and the whole MULTI sent again."""
    queue.push_groups(fresh(2))
    held = claim(queue, "w", 2).groups
    assert publish(queue, "w", held[0], group=finish(held[0].group)) == Published.OK
    queue.redis.script_flush()
    if not scripts.uses_functions(queue.redis):
        with pytest.raises(redis.exceptions.NoScriptError):
            queue.redis.evalsha(queue._scripts["publish"]._run.sha, 0)
    assert publish(queue, "w", held[1], group=finish(held[1].group)) == Published.OK
    assert [e.group_id for e in queue.read_stream(queue.keys.results)] == ["g0", "g1"]
    assert not list(queue.redis.scan_iter(match=queue.keys.staged("*", "*")))
    assert_audit_ok(queue)


def test_lost_publish_reply_then_retry(queue):
    queue.push_groups(fresh(1))
    c = claim(queue, "w", 1).groups[0]
    queue._scripts["publish"] = LoseReplies(queue._scripts["publish"], armed=1)
    with pytest.raises(redis.ConnectionError):
        publish(queue, "w", c, group=finish(c.group))
    assert publish(queue, "w", c, group=finish(c.group)) == Published.ALREADY
    assert queue.redis.xlen(queue.keys.results) == 1
    assert not list(queue.redis.scan_iter(match=queue.keys.staged("*", "*")))  # the retry's staging is gone
    assert_audit_ok(queue)


def test_results_leave_response_text_out_unless_asked(queue):
    queue.push_groups(fresh(3))
    cs = claim(queue, "w", 3).groups
    gs = [finish(c.group) for c in cs]
    publish(queue, "w", cs[0], group=gs[0])
    publish(queue, "w", cs[1], group=gs[1], keep_response_text=True)
    publish(queue, "w", cs[2], Place.REQUEUE, group=gs[2])  # a continuation appends to the text: kept
    plain, kept = (e.decode() for e in queue.read_stream(queue.keys.results))
    assert [s.response for s in plain.samples] == ["", ""]
    assert plain.samples[0].tokens == gs[0].samples[0].tokens
    assert [s.response for s in kept.samples] == ["rrr", "rrr"]
    assert [s.response for s in queue.read_stream(queue.keys.requeue)[0].decode().samples] == ["rrr", "rrr"]


def test_publish_not_held_is_refused(queue):
    queue.push_groups(fresh(2))
    c = claim(queue, "w", 1).groups[0]
    g1 = decode_group(queue.redis.hget(queue.keys.payloads, "g1"))
    assert queue.publish_group("w", g1, c.token, Place.RESULTS) == Published.REFUSED  # queued, not claimed
    assert queue.publish_group("other", c.group, c.token, Place.RESULTS) == Published.REFUSED
    assert queue.publish_group("w", c.group, "w:forged", Place.RESULTS) == Published.REFUSED  # wrong token
    for stream in (queue.keys.results, queue.keys.requeue, queue.keys.dead):
        assert queue.redis.xlen(stream) == 0
    assert prompts(queue) == ["g1"] and inflight(queue, "w") == {"g0"}
    assert_audit_ok(queue)


def test_zombie_cannot_publish(queue):
    queue.push_groups(fresh(2))
    a = claim(queue, "A", 1).groups[0]
    assert a.group_id == "g0"
    assert queue.reap("A") == -1  # lease not over yet: A is alive
    expire(queue, "A")
    assert queue.reap("A") == 1  # presumed dead
    assert prompts(queue) == ["g0", "g1"]  # back at the head
    b = claim(queue, "B", 1).groups[0]
    assert b.group_id == "g0"
    # A was only slow: its late publish must not land anywhere.
    for place in (Place.RESULTS, Place.REQUEUE, Place.DEAD):
        assert publish(queue, "A", a, place, group=finish(a.group), error="x") == Published.REFUSED
    for stream in (queue.keys.results, queue.keys.requeue, queue.keys.dead):
        assert queue.redis.xlen(stream) == 0
    assert inflight(queue, "B") == {"g0"} and inflight(queue, "A") == set()
    assert_audit_ok(queue)
    assert queue.heartbeat("A", "{}").reaped  # A's next heartbeat tells it
    assert publish(queue, "B", b, group=finish(b.group)) == Published.OK
    assert [e.group_id for e in queue.read_stream(queue.keys.results)] == ["g0"]
    assert_audit_ok(queue)


def test_a_reaped_worker_that_reclaims_its_group_cannot_publish_the_old_copy(queue):
    """Issue 8 #5 (r4): reaped during a stall, the same worker process re-registers and
    happens to claim the same group again: only the new claim's task may publish it."""
    queue.push_groups(fresh(2))
    old = claim(queue, "W#1", 1).groups[0]
    expire(queue, "W#1")
    assert queue.reap_expired() == 1
    assert queue.heartbeat("W#1", "{}").reaped
    assert queue.claim("W#1", "W#1:9", 1).status == ClaimStatus.UNREGISTERED
    new = claim(queue, "W#2", 1).groups[0]
    assert new.group_id == old.group_id == "g0" and new.token != old.token
    assert publish(queue, "W#1", old, group=finish(old.group)) == Published.REFUSED
    assert publish(queue, "W#2", new, group=finish(new.group)) == Published.OK
    assert_audit_ok(queue)


def test_publish_of_a_group_that_cannot_be_encoded_moves_nothing(queue):
    """r6 / r7: a value msgpack cannot pack, or a mask of the wrong length, is refused
    before anything moves: the group stays held (and the worker dead-letters its claimed copy)."""
    from pipeline.codec import EncodeError

    queue.push_groups(fresh(1))
    c = claim(queue, "w", 1).groups[0]
    g = finish(c.group)
    g.samples[0].reward = {"score": object()}
    with pytest.raises(EncodeError):
        publish(queue, "w", c, group=g)
    g = finish(c.group)
    g.samples[0].loss_mask = [1] * 50  # three response tokens
    with pytest.raises(EncodeError, match="loss_mask has 50 entries for 3 response tokens"):
        publish(queue, "w", c, group=g)
    g = finish(c.group)
    g.samples[0].loss_mask = None
    g.samples[0].tokens[-1] = 2 ** 40
    with pytest.raises(EncodeError, match="token ids"):
        publish(queue, "w", c, group=g)
    assert inflight(queue, "w") == {"g0"}
    assert queue.publish("w", "g0", c.token, c.payload, Place.DEAD, "cannot store it") == Published.OK
    assert queue.read_stream(queue.keys.dead)[0].decode().group_id == "g0"
    assert_audit_ok(queue)


def test_a_huge_dead_letter_keeps_its_head_and_size(queue):
    queue.push_groups(fresh(1))
    c = claim(queue, "w", 1).groups[0]
    assert queue.publish("w", "g0", c.token, b"x" * (3 << 20), Place.DEAD, "too big") == Published.OK
    [dead] = queue.read_stream(queue.keys.dead)
    assert len(dead.data) == 4096 and "3,145,728 bytes" in dead.error


# -- heartbeat ------------------------------------------------------------------------


def test_heartbeat(queue):
    assert queue.heartbeat("w", "{}").reaped  # never registered: never registered by a heartbeat
    assert queue.redis.zscore(queue.keys.workers, "w") is None
    queue.register("w")
    set_paused(queue.redis, queue.keys, True)
    set_weight_version(queue.redis, queue.keys, 7)
    hb = queue.heartbeat("w", json.dumps({"state": "paused"}))
    assert (hb.reaped, hb.paused, hb.weight_version, hb.lease_s) == (False, True, 7, 30.0)
    assert json.loads(queue.redis.hget(queue.keys.worker_info, "w")) == {"state": "paused"}
    expire(queue, "w")
    queue.heartbeat("w", "{}")
    assert queue.redis.zscore(queue.keys.workers, "w") > queue.now_ms()  # a deadline, a lease ahead
    assert queue.leave("w") == 0
    assert queue.heartbeat("w", "{}").reaped


# -- reap, leave, hand back -----------------------------------------------------------


def test_reap_only_expired_workers(queue):
    queue.push_groups(fresh(6))
    claim(queue, "old", 2)
    claim(queue, "young", 2)
    expire(queue, "old")
    assert queue.reap("young") == -1
    assert queue.reap_expired() == 2
    assert inflight(queue, "old") == set() and inflight(queue, "young") == {"g2", "g3"}
    assert set(prompts(queue)[:2]) == {"g0", "g1"} and prompts(queue)[2:] == ["g4", "g5"]
    assert queue.live_workers() == ["young"]
    assert queue.stats()["reaped"] == 2 and "handed_back" not in queue.stats()
    [record] = [json.loads(r) for r in queue.redis.lrange(queue.keys.reaped, 0, -1)]
    assert (record["worker"], record["groups"], record["how"]) == ("old", 2, "reaped")
    assert queue.reap_expired() == 0
    assert_audit_ok(queue)


def test_leave_returns_groups_at_once_and_is_counted_apart(queue):
    queue.push_groups(fresh(3))
    claim(queue, "w", 2)
    assert queue.reap("w") == -1  # lease is fresh
    assert queue.leave("w") == 2
    assert inflight(queue, "w") == set() and len(prompts(queue)) == 3
    assert queue.redis.hget(queue.keys.worker_info, "w") is None
    assert queue.workers() == {}
    assert queue.stats()["handed_back"] == 2 and "reaped" not in queue.stats()
    assert json.loads(queue.redis.lindex(queue.keys.reaped, 0))["how"] == "handed_back"
    assert_audit_ok(queue)


def test_reap_unknown_worker_is_harmless(queue):
    assert queue.reap("ghost") == 0
    assert queue.leave("ghost") == 0


def test_orphan_inflight_hash_of_an_unregistered_worker_is_reaped_without_scan(queue):
    queue.push_groups(fresh(2))
    claim(queue, "w", 1)
    queue.redis.zrem(queue.keys.workers, "w")  # its registration lost by hand, or by an older version
    report = audit(queue)
    assert report.ok and report.unregistered_inflight == ["w"]
    queue.redis.scan_iter = None  # a worker's ACL user has no SCAN: the holders set finds it
    assert queue.reap_orphans() == 1
    assert prompts(queue) == ["g0", "g1"]
    assert queue.redis.smembers(queue.keys.holders) == set()
    del queue.redis.scan_iter
    assert_audit_ok(queue)


def test_a_hand_written_inflight_hash_is_reaped_by_an_admin_scan(queue):
    queue.push_groups(fresh(2))
    queue.redis.lpop(queue.keys.prompts)
    queue.redis.hset(queue.keys.inflight("gone"), "g0", "gone:1")  # foreign: no claim recorded it
    assert audit(queue).unregistered_inflight == ["gone"]
    assert queue.reap_orphans() == 0
    assert queue.reap_orphans(scan=True) == 1
    assert prompts(queue) == ["g0", "g1"]


def test_hand_back_checks_each_token(queue):
    queue.push_groups(fresh(3))
    c = claim(queue, "w", 3)
    token = c.groups[0].token
    assert queue.hand_back("w", {"g0": token, "g1": "w:stale", "g2": token}) == 2
    assert inflight(queue, "w") == {"g1"}
    assert set(prompts(queue)) == {"g0", "g2"}
    assert queue.stats()["reconciled"] == 2
    assert publish(queue, "w", c.groups[0], group=finish(c.groups[0].group)) == Published.REFUSED
    assert_audit_ok(queue)


# -- release --------------------------------------------------------------------------


def _abort(q: Queue, n: int, worker: str = "w") -> list[Group]:
    out = []
    for c in claim(q, worker, n).groups:
        g = finish(c.group, version=2, status=Status.ABORTED, n_tokens=2)
        assert publish(q, worker, c, Place.REQUEUE, group=g) == Published.OK
        out.append(g)
    return out


def test_release_continue_keeps_partial_output(queue):
    queue.push_groups(fresh(4))
    aborted = _abort(queue, 2)
    assert queue.release("continue") == 2
    assert prompts(queue) == ["g0", "g1", "g2", "g3"]  # oldest first, ahead of what was queued
    assert queue.redis.xlen(queue.keys.requeue) == 0
    back = [c.group for c in claim(queue, "w2", 2).groups]
    for got, want in zip(back, aborted):
        assert got.samples == want.samples and got.prompt_ids == want.prompt_ids
        assert got.samples[0].weight_versions == ["2"] and got.samples[0].status == Status.ABORTED
    assert queue.stats()["released"] == 2
    assert_audit_ok(queue)


def test_release_restart_resets_everything_generated(queue):
    queue.push_groups(fresh(2))
    _abort(queue, 1)
    assert queue.release("restart") == 1
    g = claim(queue, "w2", 1).groups[0].group
    assert g.group_id == "g0" and g.prompt_ids == []
    for s in g.samples:
        assert (s.tokens, s.response_length, s.response, s.reward) == ([], 0, "", None)
        assert (s.loss_mask, s.rollout_log_probs, s.weight_versions) == (None, None, [])
        assert s.status == Status.PENDING and "rollout_segments" not in s.metadata
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
    assert assert_audit_ok(queue).dropped == 2


def test_release_malformed_entry_goes_dead(queue):
    queue.push_groups(fresh(3))
    good = _abort(queue, 1)[0]
    c = claim(queue, "w", 1).groups[0]
    queue.publish("w", "g1", c.token, b"\x93corrupt", Place.REQUEUE)
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
    with pytest.raises(ValueError, match="'later' is not a valid ReleasePolicy"):
        queue.release("later")
    assert queue.release() == 1
    assert queue.release() == 0
    assert_audit_ok(queue)


# -- settle ---------------------------------------------------------------------------


def _session(q: Queue, name: str = "t") -> TrainerSession:
    session_id = TrainerSession.new_id()
    generation, consumer, _ = scripts.load(q.redis, "session")["session"](
        keys=[q.keys.trainer, q.keys.results], args=[CONSUMER_GROUP, name, "{}", session_id])
    return TrainerSession(consumer.decode(), int(generation), session_id)


def _delivered(q: Queue, n: int, session: TrainerSession) -> list[Settle]:
    rows = q.redis.xreadgroup(CONSUMER_GROUP, session.consumer, {q.keys.results: ">"}, count=n)[0][1]
    return [Settle("commit", e.entry_id, e.group_id, token=e.token, payload=e.data)
            for e in q.entries(q.keys.results, rows)]


def test_commit_acks_deletes_and_counts(queue):
    produce(queue, 3)
    session = _session(queue)
    items = _delivered(queue, 3, session)
    k = queue.keys
    assert queue.settle(k.results, items[:2], session) == (2, 0)
    assert queue.redis.xlen(k.results) == 1
    assert queue.redis.xpending(k.results, CONSUMER_GROUP)["pending"] == 1
    assert queue.stats()["committed"] == 2
    assert {m.decode() for m in queue.redis.zrange(k.committed, 0, -1)} == {"g0", "g1"}
    assert queue.redis.hmget(k.admitted, ["g0", "g1", "g2"]) == [None, None, b"0"]
    assert not queue.redis.exists(k.result("g0", items[0].token))  # the payload went with the entry
    # A retried commit (its reply was lost) finds them committed: done, not double-counted.
    assert queue.settle(k.results, items[:2], session) == (0, 2)
    assert queue.stats()["committed"] == 2
    assert_audit_ok(queue)


def test_settle_actions(queue):
    produce(queue, 4)
    session = _session(queue)
    i0, i1, i2, i3 = _delivered(queue, 4, session)
    k = queue.keys
    assert queue.settle(k.results, [
        Settle("drop", i0.entry_id, "g0", "all rewards equal", token=i0.token),
        Settle("prompt", i1.entry_id, "g1", payload=encode_group(Group.fresh("g1", "p", 1)), token=i1.token),
        Settle("dead", i2.entry_id, "g2", "bad reward", i2.payload, i2.token),
        Settle("duplicate", i3.entry_id, "g3", token=i3.token),
    ], session) == (4, 0)
    assert queue.redis.xlen(k.results) == 0
    assert not list(queue.redis.scan_iter(match=k.result_pattern))
    assert [(f[b"gid"], f[b"reason"]) for _, f in queue.redis.xrange(k.dropped)] == [(b"g0", b"all rewards equal")]
    assert prompts(queue) == ["g1"] and decode_group(queue.redis.hget(k.payloads, "g1")).n_samples == 1
    [dead] = queue.read_stream(k.dead)
    assert (dead.group_id, dead.error, dead.data) == ("g2", "bad reward", i2.payload)
    stats = queue.stats()
    assert (stats["dropped"], stats["released"], stats["dead"], stats["duplicates"]) == (1, 1, 1, 1)
    assert queue.settle(k.dead, [Settle("discard", dead.entry_id, "g2")]) == (1, 0)
    assert queue.redis.xlen(k.dead) == 0 and queue.stats()["discarded"] == 1
    # The duplicate was a planted extra: pushed 4, one of them (g3) now nowhere.
    report = audit(queue)
    assert (report.lost, report.accounted, report.duplicates_discarded) == (1, 3, 1)


def test_settle_unknown_action_changes_nothing(queue):
    produce(queue, 2)
    session = _session(queue)
    a, b = _delivered(queue, 2, session)
    b.action = "explode"
    with pytest.raises(redis.ResponseError, match="unknown action explode"):
        queue.settle(queue.keys.results, [a, b], session)
    assert queue.redis.xlen(queue.keys.results) == 2
    assert queue.settle(queue.keys.results, [], session) == (0, 0)


def test_settle_only_what_was_delivered_to_this_session(queue):
    produce(queue, 2)
    first = _session(queue, "t")
    [item] = _delivered(queue, 1, first)
    second = _session(queue, "t")  # takes over, fences the first
    assert second.generation == first.generation + 1
    with pytest.raises(SessionFenced, match=f"{first.consumer} was replaced by session {second.consumer}"):
        queue.settle(queue.keys.results, [item], first)
    # The newer session got the entry when it started; one never delivered it cannot settle.
    assert queue.settle(queue.keys.results, [item], second) == (1, 0)
    undelivered = queue.read_stream(queue.keys.results)[0]
    assert queue.settle(queue.keys.results, [Settle("commit", undelivered.entry_id, undelivered.group_id,
                                                     token=undelivered.token)], second) == (0, 0)
    with pytest.raises(ValueError, match="needs the trainer session"):
        queue.settle(queue.keys.results, [item])


def test_committed_ids_are_trimmed_with_their_history(queue, monkeypatch):
    import pipeline.writer as writer

    monkeypatch.setattr(writer, "COMMITTED_IDS_KEPT", 3)
    produce(queue, 5)
    session = _session(queue)
    queue.settle(queue.keys.results, _delivered(queue, 5, session), session)
    assert queue.redis.zcard(queue.keys.committed) == 3
    assert queue.stats()["committed"] == 5
    assert queue.redis.hlen(queue.keys.history) == 3


# -- push -----------------------------------------------------------------------------


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
    assert_audit_ok(queue)


def test_a_group_id_is_queued_once(queue):
    """Issue 8 #2 (r2): the same group id pushed twice is one copy, so no settle of a
    second copy can delete the payload the first one needs."""
    assert queue.push_groups(fresh(2)) == 2
    assert queue.push_groups(fresh(3)) == 1
    assert prompts(queue) == ["g0", "g1", "g2"]
    assert queue.stats()["pushed"] == 3
    assert_audit_ok(queue)


def test_a_group_whose_holders_died_twice_runs_alone(queue):
    """A worker that dies takes every group it holds down with it; a group reaped twice
    is retried on its own, so a poison group cannot drag its neighbours to max_claims."""
    queue.push_groups(fresh(4))
    for n in range(2):  # two workers die holding g0 and g1
        assert sorted(ids(claim(queue, f"dead{n}", 2))) == ["g0", "g1"]
        expire(queue, f"dead{n}")
        queue.reap(f"dead{n}")
    busy = claim(queue, "busy", 3)  # a suspect, and this worker holds nothing: it alone
    assert len(busy.groups) == 1 and ids(busy)[0] in ("g0", "g1")
    assert claim(queue, "busy", 3).status == ClaimStatus.ISOLATING  # nothing more while it runs
    c = claim(queue, "other", 3)  # another worker holds nothing: the other suspect, alone
    assert sorted(ids(busy) + ids(c)) == ["g0", "g1"]
    third = claim(queue, "third", 1)
    assert ids(third) == ["g2"]  # suspects are not at the head any more
    publish(queue, "busy", busy.groups[0], group=finish(busy.groups[0].group))
    assert ids(claim(queue, "busy", 3)) == ["g3"]  # done: it claims normally again
    # A worker holding something does not take a suspect: it waits at the head.
    queue.push_groups(fresh(1, prefix="s"))
    claim(queue, "w5", 1)
    expire(queue, "w5")
    queue.reap("w5")
    queue.redis.hset(queue.keys.claims, "s0", 2)
    assert claim(queue, "third", 1).status == ClaimStatus.ISOLATING
    assert prompts(queue) == ["s0"]
    assert_audit_ok(queue)


def test_heartbeat_carries_the_version_clock(queue):
    from pipeline.types import VersionClock

    queue.register("w")
    assert queue.heartbeat("w", "{}").version_clock == VersionClock.ENGINE
    assert configure(queue.redis, queue.keys, version_clock="queue").version_clock == VersionClock.QUEUE
    assert queue.heartbeat("w", "{}").version_clock == VersionClock.QUEUE
    with pytest.raises(ValueError, match="unknown version clock 'wall': use one of engine, queue"):
        configure(queue.redis, queue.keys, version_clock="wall")
    queue.redis.hset(queue.keys.control, "version_clock", "wall")  # a foreign value reads as the default
    assert read_control(queue.redis, queue.keys).version_clock == VersionClock.ENGINE
    assert queue.heartbeat("w", "{}").version_clock == VersionClock.ENGINE
