"""In-flight checkpoints (pipeline/checkpoints.py, lua/checkpoint.lua) on real Redis: written
only under the claim that holds the group, handed to the group's next holder by the claim,
gone with the payload however the group leaves, safe to retry, bounded, and audited."""
from __future__ import annotations

import json
import random
import re

import msgpack
import pytest
import redis

from pipeline import scripts
from pipeline.checkpoints import (CHECKPOINT_MAX_RECORDS, CheckpointHeader, CheckpointLog, CheckpointOutcome,
                                  CheckpointWrite, GroupCheckpoint)
from pipeline.codec import DecodeError, EncodeError, SampleProgress, decode_checkpoint, encode_checkpoint_record
from pipeline.control import configure
from pipeline.ops.acl import script_keys
from pipeline.ops.audit import audit
from pipeline.ops.inspect import locate
from pipeline.ops.status import snapshot
from pipeline.queue import Place, Queue
from pipeline.types import SEGMENTS_KEY, Group, Sample, Status
from tests.groups import (assert_audit_ok, claim, expire, finish, fresh, generate, prompts, publish,
                          write_checkpoint)
from tests.helpers import LoseReplies


def stored(q: Queue, gid: str) -> tuple[bytes | None, list[bytes]]:
    """A group's checkpoint as Redis holds it: its header and its record fields."""
    fields = [f for f in q.redis.hkeys(q.keys.checkpoint_records) if f.startswith(gid.encode() + b"\n")]
    return q.redis.hget(q.keys.checkpoints, gid), fields


def progress_of(group: Group) -> dict[int, tuple]:
    """What a checkpoint must hold of a group's samples."""
    return {i: (s.response_tokens, s.rollout_log_probs, s.loss_mask, s.weight_versions,
                s.metadata.get(SEGMENTS_KEY), s.status)
            for i, s in enumerate(group.samples) if s.response_length or s.status != Status.PENDING}


def held_progress(checkpoint: GroupCheckpoint) -> dict[int, tuple]:
    return {i: (p.response_ids, p.log_probs, p.loss_mask, p.weight_versions, p.segments, p.status)
            for i, p in checkpoint.samples.items()}


def reclaim(q: Queue, worker: str, gid: str):
    """`worker` claims `gid` (at the head of the prompt list)."""
    assert prompts(q)[0] == gid
    [c] = claim(q, worker, 1).groups
    assert c.group_id == gid
    return c


# -- the claim that holds a group writes its checkpoint; the next claim gets it ---------------------


def test_a_reaped_holders_checkpoint_is_handed_to_the_next_claimer(queue):
    queue.push_groups(fresh(1, samples=3))
    [a] = claim(queue, "A", 1).groups
    log_a = CheckpointLog(a.group_id, a.token)
    assert write_checkpoint(queue, "A", a, tokens=4, log=log_a) == CheckpointOutcome.OK
    assert write_checkpoint(queue, "A", a, tokens=3, log=log_a) == CheckpointOutcome.OK  # appended: 7 a sample
    expire(queue, "A")
    assert queue.reap("A") == 1
    assert stored(queue, "g0")[0] is not None  # a reap leaves it for the next claim
    report = assert_audit_ok(queue)
    assert report.checkpoints == 1 and report.checkpoint_bytes > 0
    b = reclaim(queue, "B", "g0")
    assert b.checkpoint is not None and b.checkpoint.header.records == 2 and b.checkpoint.header.tokens == 21
    assert held_progress(b.checkpoint) == progress_of(a.group)
    assert queue.stats()["checkpoints_claimed"] == 1 and queue.stats()["checkpoint_tokens_claimed"] == 21
    # The next holder continues the same checkpoint, appending to the records it was handed.
    log = CheckpointLog(b.group_id, b.token, b.checkpoint)
    b.group.prompt_ids = a.group.prompt_ids
    for i, p in b.checkpoint.samples.items():
        p.apply_to(b.group.samples[i], b.group.prompt_ids)
    assert progress_of(b.group) == progress_of(a.group)
    log.resumed(b.group)  # its samples now hold what the checkpoint holds: only new tokens are written
    size_before = CheckpointHeader.parse(stored(queue, "g0")[0]).bytes
    assert write_checkpoint(queue, "B", b, tokens=2, log=log) == CheckpointOutcome.OK
    header = CheckpointHeader.parse(stored(queue, "g0")[0])
    assert header.records == 3 and header.writer == b.token and header.bytes - size_before < size_before / 2
    assert held_progress(read(queue, "g0")) == progress_of(b.group)
    assert_audit_ok(queue)


def test_a_stale_holders_late_checkpoint_write_is_refused(queue):
    queue.push_groups(fresh(1))
    [a] = claim(queue, "A", 1).groups
    log_a = CheckpointLog(a.group_id, a.token)
    assert write_checkpoint(queue, "A", a, tokens=2, log=log_a) == CheckpointOutcome.OK
    expire(queue, "A")
    queue.reap("A")
    late = log_a.next_write(generate(a.group, 5))
    assert queue.checkpoint("A", [late]) == [CheckpointOutcome.REFUSED]  # queued, not A's any more
    b = reclaim(queue, "B", "g0")
    assert write_checkpoint(queue, "B", b, tokens=1) == CheckpointOutcome.OK
    before = stored(queue, "g0")
    # A's write again, and a full one under its old token: neither touches B's checkpoint.
    assert queue.checkpoint("A", [late]) == [CheckpointOutcome.REFUSED]
    late.full = True
    assert queue.checkpoint("A", [late]) == [CheckpointOutcome.REFUSED]
    assert stored(queue, "g0") == before and CheckpointHeader.parse(before[0]).writer == b.token
    assert queue.stats()["checkpoints_refused"] == 3
    assert_audit_ok(queue)


def test_one_call_writes_several_groups_each_under_its_own_claim(queue):
    queue.push_groups(fresh(3))
    held = claim(queue, "A", 3).groups
    writes = [CheckpointLog(c.group_id, c.token).next_write(generate(c.group, 2)) for c in held]
    writes[1].token = "A:stolen"  # not the claim that holds it
    assert queue.checkpoint("A", writes) == [CheckpointOutcome.OK, CheckpointOutcome.REFUSED, CheckpointOutcome.OK]
    assert queue.redis.hlen(queue.keys.checkpoints) == 2
    assert_audit_ok(queue)


def test_a_retried_claim_hands_the_checkpoint_out_again(queue):
    queue.push_groups(fresh(1))
    [a] = claim(queue, "A", 1).groups
    write_checkpoint(queue, "A", a, tokens=3)
    expire(queue, "A")
    queue.reap("A")
    queue.register("B")
    first = queue.claim("B", "B:1", 1)
    again = queue.claim("B", "B:1", 1)  # the first reply was lost
    assert [c.group_id for c in again.groups] == ["g0"]
    assert held_progress(again.groups[0].checkpoint) == held_progress(first.groups[0].checkpoint)
    assert queue.stats()["checkpoints_claimed"] == 1  # counted once


# -- every way out of flight deletes it or carries it ---------------------------------------------


@pytest.mark.parametrize("place", list(Place))
def test_a_publish_leaves_no_checkpoint(queue, place):
    queue.push_groups(fresh(1))
    [a] = claim(queue, "A", 1).groups
    write_checkpoint(queue, "A", a, tokens=3)
    group = finish(a.group) if place == Place.RESULTS else a.group
    assert publish(queue, "A", a, place, group=group, error="engine failed" if place == Place.DEAD else None)
    assert stored(queue, "g0") == (None, [])
    assert_audit_ok(queue)


def test_a_dead_letter_by_max_claims_leaves_no_checkpoint(queue):
    configure(queue.redis, queue.keys, max_claims=2)
    queue.push_groups(fresh(1))
    for worker, tokens in (("A", 2), ("B", 3)):
        [held] = claim(queue, worker, 1).groups
        assert write_checkpoint(queue, worker, held, tokens=tokens) == CheckpointOutcome.OK
        expire(queue, worker)
        queue.reap(worker)
    assert stored(queue, "g0")[0] is not None
    claimed = claim(queue, "C", 1)
    assert claimed.groups == [] and queue.stats()["dead_max_claims"] == 1
    assert stored(queue, "g0") == (None, [])
    assert_audit_ok(queue)


def test_a_hand_back_and_a_departure_keep_the_checkpoint_for_the_next_claim(queue):
    queue.push_groups(fresh(2))
    [a, b] = claim(queue, "A", 2).groups
    write_checkpoint(queue, "A", a, tokens=2)
    write_checkpoint(queue, "A", b, tokens=5)
    assert queue.hand_back("A", {a.group_id: a.token}) == 1  # reconciliation: no task for it
    assert queue.leave("A") == 1  # a clean shutdown hands the other back
    assert_audit_ok(queue)
    got = {c.group_id: c.checkpoint.header.tokens for c in claim(queue, "B", 2).groups}
    assert got == {"g0": 4, "g1": 10}


def test_the_only_scripts_that_delete_a_payload_do_it_with_drop_payload():
    """The checkpoint goes with the payload by construction: a script that deleted a payload
    by itself would leave its group's checkpoint behind."""
    for name in scripts.names():
        entries, _ = script_keys(name)
        payload_refs = [str(i + 1) for i, e in enumerate(entries) if "payloads" in e.split("|")]
        body = scripts.body(name)
        for ref in payload_refs:
            assert not re.search(rf"'HDEL',\s*KEYS\[{ref}\]", body), f"lua/{name}.lua deletes a payload itself"


# -- retried, bounded, checked -----------------------------------------------------------------


def test_a_checkpoint_write_whose_reply_was_lost_is_retried_safely(queue):
    queue.push_groups(fresh(2))
    held = claim(queue, "A", 2).groups
    logs = {c.group_id: CheckpointLog(c.group_id, c.token) for c in held}
    lossy = LoseReplies(queue._scripts["checkpoint"])
    queue._scripts["checkpoint"] = lossy
    for round_ in range(3):  # a full write, then appends; every reply lost once
        writes = [logs[c.group_id].next_write(generate(c.group, 2 + round_)) for c in held]
        lossy.armed = 1
        with pytest.raises(redis.ConnectionError):
            queue.checkpoint("A", writes)
        assert queue.checkpoint("A", writes) == [CheckpointOutcome.ALREADY] * 2  # the retry: nothing twice
        for w in writes:
            logs[w.group_id].settle(w, CheckpointOutcome.ALREADY)
    for c in held:
        header, records = stored(queue, c.group_id)
        assert CheckpointHeader.parse(header).records == 3 and len(records) == 3
    expire(queue, "A")
    queue.reap("A")
    for c in claim(queue, "B", 2).groups:
        assert held_progress(c.checkpoint) == progress_of(next(h.group for h in held if h.group_id == c.group_id))
    assert_audit_ok(queue)


def test_an_append_to_a_checkpoint_the_writer_did_not_see_is_written_whole(queue):
    queue.push_groups(fresh(1))
    [a] = claim(queue, "A", 1).groups
    log = CheckpointLog(a.group_id, a.token)
    write_checkpoint(queue, "A", a, tokens=2, log=log)
    write_checkpoint(queue, "A", a, tokens=2, log=log)
    log.records = 1  # the writer lost count (a process that forgot what it wrote)
    write = log.next_write(generate(a.group, 1))
    [outcome] = queue.checkpoint("A", [write])
    assert outcome == CheckpointOutcome.RESYNC
    log.settle(write, outcome)
    write = log.next_write(a.group)
    assert write.full and queue.checkpoint("A", [write]) == [CheckpointOutcome.OK]
    log.settle(write, CheckpointOutcome.OK)
    header, records = stored(queue, "g0")
    assert CheckpointHeader.parse(header).records == 1 and len(records) == 1
    assert held_progress(read(queue, "g0")) == progress_of(a.group)


def read(q: Queue, gid: str) -> GroupCheckpoint:
    header, fields = stored(q, gid)
    count = CheckpointHeader.parse(header).records
    return GroupCheckpoint.from_reply([header] + [q.redis.hget(q.keys.checkpoint_records, f"{gid}\n{k}")
                                                 for k in range(1, count + 1)])


def test_a_checkpoint_never_holds_more_records_than_its_bound(queue):
    queue.push_groups(fresh(1))
    [a] = claim(queue, "A", 1).groups
    log = CheckpointLog(a.group_id, a.token)
    for _ in range(CHECKPOINT_MAX_RECORDS * 2 + 3):
        assert write_checkpoint(queue, "A", a, tokens=1, log=log) == CheckpointOutcome.OK
        header, records = stored(queue, "g0")
        assert CheckpointHeader.parse(header).records == len(records) <= CHECKPOINT_MAX_RECORDS
    assert held_progress(read(queue, "g0")) == progress_of(a.group)
    assert_audit_ok(queue)


def test_a_checkpoint_over_its_byte_bound_is_refused_as_too_large(queue, monkeypatch):
    monkeypatch.setattr("pipeline.queue.CHECKPOINT_MAX_BYTES", 400)
    queue.push_groups(fresh(1))
    [a] = claim(queue, "A", 1).groups
    log = CheckpointLog(a.group_id, a.token)
    assert write_checkpoint(queue, "A", a, tokens=4, log=log) == CheckpointOutcome.OK
    assert write_checkpoint(queue, "A", a, tokens=200, log=log) == CheckpointOutcome.TOO_LARGE
    assert log.full and not log.stopped  # an append that did not fit: the next is tried whole
    assert write_checkpoint(queue, "A", a, tokens=1, log=log) == CheckpointOutcome.TOO_LARGE
    assert log.stopped and log.next_write(generate(a.group, 1)) is None  # whole, it does not fit either
    assert CheckpointHeader.parse(stored(queue, "g0")[0]).tokens == 8  # what fitted stays
    assert_audit_ok(queue)


def test_bad_arguments_are_refused_before_any_write(queue):
    queue.push_groups(fresh(2))
    held = claim(queue, "A", 2).groups
    good = CheckpointLog(held[0].group_id, held[0].token).next_write(generate(held[0].group, 2))
    bad = CheckpointWrite(held[1].group_id, "has a space", b"x", True, 0, 2)
    with pytest.raises(redis.ResponseError, match="bad arguments for group g1"):
        queue.checkpoint("A", [good, bad])
    assert queue.redis.hlen(queue.keys.checkpoints) == 0


# -- the audit ----------------------------------------------------------------------------------------


def test_the_audit_reports_a_checkpoint_left_without_its_group(queue):
    queue.push_groups(fresh(1))
    [a] = claim(queue, "A", 1).groups
    write_checkpoint(queue, "A", a, tokens=2)
    queue.redis.hdel(queue.keys.payloads, "g0")  # by hand: what no script does
    report = audit(queue)
    assert not report.ok and report.orphan_checkpoints == 1 and "orphan checkpoints" in report.summary()


def test_the_audit_reports_a_record_no_header_names(queue):
    queue.push_groups(fresh(1))
    [a] = claim(queue, "A", 1).groups
    write_checkpoint(queue, "A", a, tokens=2)
    queue.redis.hset(queue.keys.checkpoint_records, "g0\n7", b"x")
    assert audit(queue).orphan_checkpoints == 1


def test_inspect_shows_what_the_checkpoint_holds_of_each_sample(queue):
    queue.push_groups(fresh(1, samples=2))
    [a] = claim(queue, "A", 1).groups
    log = CheckpointLog(a.group_id, a.token)
    write_checkpoint(queue, "A", a, tokens=4, log=log)
    write_checkpoint(queue, "A", a, tokens=3, log=log)
    report = locate(queue, "g0")
    c = report.checkpoint
    assert (c.writer, c.records, c.tokens) == (a.token, 2, 14)
    assert [(s.position, s.tokens, s.weight_versions, s.status) for s in c.samples] == \
        [(0, 7, ["0", "0"], "aborted"), (1, 7, ["0", "0"], "aborted")]
    text = "\n".join(report.lines())
    assert "checkpoint 14 tokens in 2 records" in text and "sample 0         7 tokens  aborted" in text


# -- the encoding -------------------------------------------------------------------------------------


def random_sample(rng: random.Random, prompt: list[int]) -> Sample:
    n = rng.randrange(0, 40)
    s = Sample(index=0, tokens=prompt + [rng.randrange(50_000) for _ in range(n)], response_length=n,
               rollout_log_probs=[-rng.randrange(64) / 8 for _ in range(n)] if rng.random() < 0.9 else None,
               weight_versions=[str(rng.randrange(5)) for _ in range(rng.randrange(3))],
               status=rng.choice(list(Status)))
    if rng.random() < 0.3:
        s.loss_mask = [rng.randrange(2) for _ in range(n)]
    if rng.random() < 0.5:
        s.metadata[SEGMENTS_KEY] = [n]
    return s


def test_records_replay_to_the_samples_they_were_written_from():
    """A log of random changes (growth, restarts, masks, finishes), written as CheckpointLog
    writes them: replaying the records always gives the samples as they stand."""
    rng = random.Random(7)
    prompt = [1, 2, 3]
    group = Group("g", [Sample(index=i) for i in range(4)], prompt_ids=prompt)
    log = CheckpointLog("g", "t")
    records: list[bytes] = []
    nothing = ([], [], [], [], Status.PENDING)

    def as_held(ids, lps, mask, versions, status):
        return ids, lps or [], mask or [1] * len(ids), versions, status

    for _ in range(300):
        s = group.samples[rng.randrange(4)]
        if rng.random() < 0.7 and s.response_length and s.rollout_log_probs is not None:
            grow = rng.randrange(1, 6)  # more tokens, as a stream brings them
            s.tokens += [rng.randrange(50_000) for _ in range(grow)]
            s.rollout_log_probs += [-rng.randrange(64) / 8 for _ in range(grow)]
            if s.loss_mask is not None:
                s.loss_mask += [1] * grow
            s.response_length += grow
        else:
            group.samples[group.samples.index(s)] = random_sample(rng, prompt)
        write = log.next_write(group)
        if write is None:
            continue
        records = [write.record] if write.full else records + [write.record]
        log.settle(write, CheckpointOutcome.OK)
        held = decode_checkpoint(records)
        for i, s in enumerate(group.samples):
            p = held.get(i)
            got = nothing if p is None else as_held(p.response_ids, p.log_probs, p.loss_mask, p.weight_versions,
                                                   p.status)
            assert got == as_held(s.response_tokens, s.rollout_log_probs, s.loss_mask, s.weight_versions, s.status)
        assert len(records) <= CHECKPOINT_MAX_RECORDS


def test_whole_samples_keep_their_prompt_text_metadata_and_reward():
    s = Sample(index=3, tokens=[9, 9, 5, 6], response_length=2, response="hi", rollout_log_probs=[-0.5, -1.0],
               loss_mask=[1, 0], weight_versions=["2"], status=Status.COMPLETED, reward={"score": 1.0},
               metadata={"turns": 2})
    record = encode_checkpoint_record([(0, 0, SampleProgress.of(s, [1, 2], whole=True))])
    [(position, p)] = decode_checkpoint([record]).items()
    assert (position, p.prompt_ids, p.response_ids, p.loss_mask, p.response, p.metadata, p.reward) == \
        (0, [9, 9], [5, 6], [1, 0], "hi", {"turns": 2}, {"score": 1.0})
    resumed = Sample(index=3)
    p.apply_to(resumed, [1, 2])
    assert resumed == s  # every field


@pytest.mark.parametrize("bad, says", [
    (b"\x00junk", "not a checkpoint record|not msgpack"),
    ("gap", "continues at token 5 of 0"),
    ("lp", "log-probs for 2 tokens"),
    ("schema", "not a checkpoint record of schema"),
])
def test_a_record_that_does_not_follow_is_refused(bad, says):
    entry = {"i": 0, "o": 0, "t": b"\x01\x00\x00\x00\x02\x00\x00\x00", "lp": None, "lm": None, "wv": [], "sg": None,
             "st": "aborted"}
    if bad == "gap":
        entry["o"] = 5
    elif bad == "lp":
        entry["lp"] = b"\x00\x00\x00\x00"
    data = bad if isinstance(bad, bytes) else msgpack.packb({"v": 2 if bad == "schema" else 1, "s": [entry]})
    with pytest.raises(DecodeError, match=says):
        decode_checkpoint([data])


def test_an_id_beyond_int32_cannot_be_checkpointed():
    p = SampleProgress([2**31], None, None, [], None, Status.ABORTED)
    with pytest.raises(EncodeError, match="token ids"):
        encode_checkpoint_record([(0, 0, p)])


# -- the operator's view -----------------------------------------------------------------------------


def test_status_counts_the_checkpoints_held_and_the_workers_resumed_and_lost_tokens(queue):
    queue.push_groups(fresh(3))
    held = claim(queue, "A", 3).groups
    log = CheckpointLog(held[0].group_id, held[0].token)
    write_checkpoint(queue, "A", held[0], tokens=4, log=log)
    write_checkpoint(queue, "A", held[0], tokens=1, log=log)
    write_checkpoint(queue, "A", held[1], tokens=2)
    queue.register("B", json.dumps({"counters": {"checkpoint_tokens_resumed": 7, "checkpoint_tokens_lost": 2}}))
    queue.register("C", json.dumps({"counters": {"checkpoint_tokens_resumed": 5}}))
    c = snapshot(queue).checkpoints
    assert (c.groups, c.tokens, c.written, c.refused) == (2, 14, 3, 0)
    assert (c.tokens_resumed, c.tokens_lost) == (12, 2) and c.bytes > 0 and c.oldest_write_age_s is not None
    expire(queue, "A")
    queue.reap("A")
    claim(queue, "D", 3)
    c = snapshot(queue).checkpoints
    assert (c.claimed, c.tokens_claimed) == (2, 14)
