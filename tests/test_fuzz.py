"""Hypothesis fuzzing of the parsers that read data from outside: the group decoder
(pipeline/codec.py), the results-entry decoder (Queue.entries + decode_or_dead, as the
consumer and status read a stream), the /generate answer parser (workers/engine_answers.py)
and the streamed answer reader (workers/engine_stream.py).

Each may raise only the project's own error type, and whatever it accepts must meet
the schema: nothing malformed is ever decoded into a sample or a generation result.
"""
from __future__ import annotations

import json
import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.codec import DecodeError, decode_group, encode_group
from pipeline.queue import Queue
from pipeline.types import Group, Sample, SamplingRecord, Status
from workers.engine_answers import FINISH_TYPES, FLOAT32_MAX, INT32_MAX, decode_body, parse_generate_response
from workers.engine_errors import EngineProtocolError, EngineRequestError, EngineUnavailable
from workers.engine_stream import StreamAssembler

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any value msgpack or JSON can carry, nested a little.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
                    st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                      max_leaves=12)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**1100), 2**1100), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)


# -- the group decoder --------------------------------------------------------------------


def valid_group() -> Group:
    samples = [Sample(group_index=0, index=i, prompt="What is 1+1?", label="2", metadata={"k": [1, "x"]},
                      tokens=[5, 6, 7, 8 + i], response_length=2, response="ok", reward={"score": 1.0},
                      loss_mask=[1, 0], rollout_log_probs=[-0.5, -0.25], weight_versions=["3"],
                      status=Status.COMPLETED) for i in range(2)]
    return Group("ds:0:0", samples, prompt_ids=[5, 6], dataset="ds", attempts=1,
                 sampling=SamplingRecord(temperature=0.7, top_p=1.0, top_k=-1, max_new_tokens=64))


def assert_schema(group: Group) -> None:
    """What every decoded group promises its readers (trainer, adapters, status)."""
    assert isinstance(group.group_id, str)
    assert all(type(t) is int and -(2**31) <= t <= INT32_MAX for t in group.prompt_ids)
    for s in group.samples:
        assert isinstance(s.status, Status)
        assert isinstance(s.prompt, (str, list))
        assert all(type(t) is int and -(2**31) <= t <= INT32_MAX for t in s.tokens)
        assert 0 <= s.response_length <= len(s.tokens)
        assert s.loss_mask is None or (len(s.loss_mask) == s.response_length and set(s.loss_mask) <= {0, 1})
        lps = s.rollout_log_probs
        assert lps is None or (len(lps) == s.response_length and all(type(x) is float for x in lps))
        assert all(type(v) is str for v in s.weight_versions)
        assert s.reward is None or type(s.reward) in (float, dict)
    encode_group(group)  # what was decoded can be stored again


def decodes_or_refuses(data: bytes) -> None:
    try:
        group = decode_group(data)
    except DecodeError:
        return
    assert_schema(group)


@FUZZ
@given(st.binary(max_size=300))
def test_decode_group_random_bytes(data):
    decodes_or_refuses(data)


@st.composite
def mutated_groups(draw) -> bytes:
    """A valid encoding with one field, at the group or a sample level, replaced."""
    m = msgpack.unpackb(encode_group(valid_group()), raw=False)
    target = m if draw(st.booleans()) else m["s"][draw(st.integers(0, 1))]
    key = draw(st.sampled_from(sorted(target) + ["extra"]))
    if draw(st.integers(0, 9)) == 0:
        target.pop(key, None)
    else:
        target[key] = draw(values)
    return msgpack.packb(m, use_bin_type=True)


@FUZZ
@given(mutated_groups())
def test_decode_group_mutated_fields(data):
    decodes_or_refuses(data)


@FUZZ
@given(st.binary(max_size=40), st.integers(1, 3))
def test_decode_group_packed_arrays_of_any_length(blob, field_len):
    """Token and log-prob bytes of wrong lengths, for a response of 1-3 tokens."""
    m = msgpack.unpackb(encode_group(valid_group()), raw=False)
    sample = m["s"][0]
    sample["rl"], sample["lm"] = field_len, [field_len, b""]
    sample["lp"] = blob
    decodes_or_refuses(msgpack.packb(m, use_bin_type=True))


# -- the results-entry decoder ----------------------------------------------------------------


@pytest.fixture(scope="module")
def entry_queue(redis_server):
    from pipeline.connection import connect

    client = connect(redis_server.url)
    yield Queue(client, "fuzz")
    client.close()


utf8_bytes = st.text(max_size=12).map(lambda t: t.encode("utf-8"))
entry_fields = st.dictionaries(st.sampled_from([b"gid", b"data", b"error", b"other"]),
                               st.one_of(utf8_bytes, st.binary(max_size=40),
                                         st.just(encode_group(valid_group()))), max_size=4)


def _utf8(value: bytes | None) -> bool:
    try:
        if value is not None:
            value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@FUZZ
@given(rows=st.lists(st.tuples(st.just(b"1-1"), entry_fields), max_size=4))
def test_results_entries_decode_or_go_to_dead_letters(entry_queue, rows):
    # Non-UTF-8 group ids are the core rewrite's (test_non_utf8_gid_in_a_stream_entry_is_not_a_crash).
    rows = [(eid, f) for eid, f in rows if _utf8(f.get(b"gid")) and _utf8(f.get(b"error"))]
    for entry in entry_queue.entries(entry_queue.keys.requeue, rows):
        group, dead = entry.decode_or_dead("requeue")
        if group is None:
            assert dead.action == "dead" and dead.text.startswith("malformed requeue entry")
        else:
            assert_schema(group)


def test_non_utf8_gid_in_a_stream_entry_is_not_a_crash(entry_queue):
    [entry] = entry_queue.entries(entry_queue.keys.requeue, [(b"1-1", {b"gid": b"\xff\xfe", b"data": b"x"})])
    group, dead = entry.decode_or_dead("requeue")
    assert group is None and dead.action == "dead"


# -- the /generate answer parser ------------------------------------------------------------


def valid_answer() -> dict:
    return {"text": "hi", "output_ids": [5, 6],
            "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 6}, "prompt_tokens": 3,
                          "completion_tokens": 2, "weight_version": "1", "e2e_latency": 0.5,
                          "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}}


def parses_or_refuses(data, return_logprob: bool = True, vocab_size: int | None = None) -> None:
    try:
        result = parse_generate_response(data, "http://fuzz", return_logprob, vocab_size)
    except EngineProtocolError as exc:
        assert isinstance(exc.head, str) and len(exc.head) <= 200
        return
    limit = vocab_size if vocab_size is not None else INT32_MAX + 1
    assert all(type(t) is int and 0 <= t < limit for t in result.output_ids)
    assert result.completion_tokens == len(result.output_ids)
    if return_logprob:
        assert len(result.output_log_probs) == len(result.output_ids)
        assert all(math.isfinite(x) and abs(x) <= FLOAT32_MAX for x in result.output_log_probs)
    assert result.finish_type in FINISH_TYPES
    if result.finish_type != "abort":
        assert result.output_ids or result.completion_tokens == 0
    for text in (result.text, result.weight_version, result.rid):
        text.encode("utf-8")


@FUZZ
@given(json_values)
def test_parse_any_json_value(data):
    parses_or_refuses(data)


@FUZZ
@given(st.binary(max_size=200))
def test_parse_any_body_bytes(raw):
    parses_or_refuses(decode_body(raw))


def mutate_answer(draw, answer: dict, where: str) -> None:
    """Replace or remove one field of an answer (or chunk): at the top, in meta_info, or in a
    log-prob entry."""
    meta = answer["meta_info"]
    if where == "top":
        answer[draw(st.sampled_from(["text", "output_ids", "meta_info"]))] = draw(json_values)
    elif where == "meta":
        key = draw(st.sampled_from(sorted(meta)))
        if draw(st.booleans()):
            del meta[key]
        else:
            meta[key] = draw(json_values)
    elif where == "entry" and meta["output_token_logprobs"]:
        entry = meta["output_token_logprobs"][draw(st.integers(0, len(meta["output_token_logprobs"]) - 1))]
        entry[draw(st.integers(0, 2))] = draw(json_values)


@st.composite
def mutated_answers(draw) -> tuple[dict, bool]:
    answer = valid_answer()
    mutate_answer(draw, answer, draw(st.sampled_from(["top", "meta", "entry"])))
    return answer, draw(st.booleans())


@FUZZ
@given(mutated_answers(), st.one_of(st.none(), st.integers(1, 10)))
def test_parse_mutated_answers(answer_and_mode, vocab_size):
    answer, return_logprob = answer_and_mode
    parses_or_refuses(answer, return_logprob, vocab_size)


# -- the streamed answer reader (workers/engine_stream.py) -----------------------------------------


def valid_stream(incremental: bool, pad: bool) -> list[dict]:
    """A streamed answer of 5 tokens in three chunks; `pad` makes its chunks large enough to
    be cut apart rather than parsed whole."""
    ids, lps = [5, 6, 7, 8, 9], [-0.5, -0.25, -1.0, -2.0, -0.125]
    out, sent = [], 0
    for i, upto in enumerate((2, 4, 5)):
        start = sent if incremental else 0
        final = {"type": "stop", "matched": 9} if i == 2 else None
        out.append({"text": "y" * (5000 if pad else 2), "output_ids": ids[start:upto], "meta_info": {
            "id": "r", "finish_reason": final, "weight_version": "1", "completion_tokens": upto,
            "output_token_logprobs": [[lps[k], ids[k], None] for k in range(start, upto)]}})
        sent = upto
    return out


def streams_or_refuses(chunks: list[bytes], return_logprob: bool = True, vocab_size: int | None = None) -> None:
    """Feeding the chunks raises only the engine errors; what was taken meets the schema."""
    assembler = StreamAssembler("http://fuzz", "r", return_logprob, vocab_size, max_new_tokens=16)
    try:
        for data in chunks:
            assembler.feed(data)
    except (EngineProtocolError, EngineRequestError, EngineUnavailable) as exc:
        assert len(str(exc)) < 2000
    p = assembler.progress
    limit = vocab_size if vocab_size is not None else INT32_MAX + 1
    assert all(type(t) is int and 0 <= t < limit for t in p.output_ids) and len(p.output_ids) <= 16
    if return_logprob:
        assert len(p.output_log_probs) == len(p.output_ids)
        assert all(type(x) in (int, float) and math.isfinite(x) and abs(x) <= FLOAT32_MAX
                   for x in p.output_log_probs)
    if p.result is not None:
        assert p.result.output_ids == p.output_ids and p.result.finish_type in FINISH_TYPES
        for text in (p.result.text, p.result.weight_version, p.result.rid):
            text.encode("utf-8")


@FUZZ
@given(st.lists(json_values, min_size=1, max_size=4), st.booleans())
def test_stream_of_any_json_values(values, return_logprob):
    streams_or_refuses([json.dumps(v).encode() for v in values], return_logprob)


@st.composite
def mutated_streams(draw) -> list[bytes]:
    chunks = valid_stream(draw(st.booleans()), draw(st.booleans()))
    where = draw(st.sampled_from(["top", "meta", "entry", "bytes"]))
    mutate_answer(draw, chunks[draw(st.integers(0, len(chunks) - 1))], where)
    raw = [json.dumps(x, separators=(",", ":")).encode() for x in chunks]
    if where == "bytes":  # a byte of the text replaced: structure the cutter must not be fooled by
        i = draw(st.integers(0, len(raw) - 1))
        at = draw(st.integers(0, len(raw[i]) - 1))
        raw[i] = raw[i][:at] + bytes([draw(st.integers(0, 255))]) + raw[i][at + 1:]
    return raw


@FUZZ
@given(mutated_streams(), st.one_of(st.none(), st.integers(1, 10)))
def test_stream_of_mutated_chunks(chunks, vocab_size):
    streams_or_refuses(chunks, True, vocab_size)
