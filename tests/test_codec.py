"""The wire format: msgpack maps with a schema version, validated on decode."""
from __future__ import annotations

import pickle
import struct
import zlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.codec import SCHEMA_VERSION, DecodeError, decode_group, encode_group
from pipeline.types import Group, Sample, SamplingRecord, Status


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def raw(group: Group) -> dict:
    return msgpack.unpackb(encode_group(group), raw=False)


def pack(m: dict) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def full_group(prompt="What is 2+2?") -> Group:
    prompt_ids = [101, 2054, 2003, 1016, 1009, 1016, 1029]
    samples = [
        # shares the prompt prefix, mask with zeros, log-probs exact in float32, float reward
        Sample(group_index=7, index=28, prompt=prompt, label="4", metadata={"src": "gsm8k", "k": [1, 2]},
               tokens=prompt_ids + [10, 11, 12, 13], response_length=4, response="four",
               reward=1.0, loss_mask=[1, 0, 1, 1], rollout_log_probs=[-0.5, -0.25, -1.0, -2.0],
               weight_versions=["3", "4"], status=Status.COMPLETED),
        # does not share the prefix (e.g. re-tokenized), all-ones mask, dict reward
        Sample(group_index=7, index=29, prompt=prompt, label="4", metadata={},
               tokens=[5, 6, 7, 8, 9], response_length=2, response="x" * 40,
               reward={"score": 0.5, "acc": True}, loss_mask=[1, 1], rollout_log_probs=[-0.125, 0.0],
               weight_versions=["4"], status=Status.TRUNCATED),
        # nothing generated yet: empty tokens, no mask, no log-probs, no reward
        Sample(group_index=7, index=30, prompt=prompt, label=None, metadata={"nested": {"a": None}},
               tokens=[], response_length=0, response="", reward=None, loss_mask=None,
               rollout_log_probs=None, weight_versions=[], status=Status.PENDING),
        # all-zero mask, negative and large token ids, aborted
        Sample(group_index=7, index=31, prompt=prompt, label="4", metadata={},
               tokens=prompt_ids + [2**31 - 1, -(2**31), 0], response_length=3, response="ab",
               reward=-1.5, loss_mask=[0, 0, 0], rollout_log_probs=[-3.0, -4.0, -5.0],
               weight_versions=["default"], status=Status.ABORTED),
    ]
    return Group(group_id="gsm8k:0:7", samples=samples, prompt_ids=prompt_ids, attempts=2, restarts=1,
                 admitted_version=3, dataset="gsm8k", epoch=0, row=7, created_at=1700000000.25,
                 claimed_at=1700000001.5, finished_at=1700000002.75, worker="host-1:1234", error=None)


# -- round trips ----------------------------------------------------------------------


def test_round_trip_every_field():
    g = full_group()
    assert decode_group(encode_group(g)) == g


def test_round_trip_chat_prompt_and_error():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    g = full_group(prompt=chat)
    g.error = "engine failed 3 times"
    g.admitted_version = None
    g.claimed_at = g.finished_at = g.worker = None
    back = decode_group(encode_group(g))
    assert back == g
    assert back.samples[0].prompt == chat


@pytest.mark.parametrize("status", list(Status))
def test_every_status(status):
    g = full_group()
    for s in g.samples:
        s.status = status
    back = decode_group(encode_group(g))
    assert [s.status for s in back.samples] == [status] * 4
    assert all(isinstance(s.status, Status) for s in back.samples)
    assert back.samples[0].to_dict()["status"] == status.value


@pytest.mark.parametrize("mask", [None, [1] * 9, [0] * 9, [1, 0] * 5 + [1], [0], [1], []])
def test_loss_masks(mask):
    g = full_group()
    s = g.samples[1]
    s.tokens = list(range(9 if mask is None else len(mask)))
    s.response_length = len(s.tokens)
    s.loss_mask, s.rollout_log_probs = mask, None
    assert decode_group(encode_group(g)).samples[1].loss_mask == mask


def test_all_ones_mask_is_compact():
    g = full_group()
    n = 4096
    s = g.samples[1]
    s.tokens, s.response_length, s.rollout_log_probs = list(range(n)), n, None
    s.loss_mask = [1] * n
    ones = len(encode_group(g))
    s.loss_mask = None
    none = len(encode_group(g))
    s.loss_mask = [0] + [1] * (n - 1)
    bits = len(encode_group(g))
    assert ones - none <= 8  # length + empty bits
    assert n // 8 <= bits - none <= n // 8 + 16  # one bit per token


@pytest.mark.parametrize("reward", [1.0, 0.0, -0.75, None, {"score": 1.0, "format": 0.5}, {"nested": {"x": [1]}}])
def test_rewards(reward):
    g = full_group()
    g.samples[0].reward = reward
    assert decode_group(encode_group(g)).samples[0].reward == reward


def test_integer_reward_comes_back_float():
    g = full_group()
    g.samples[0].reward = 1
    back = decode_group(encode_group(g)).samples[0].reward
    assert back == 1.0 and isinstance(back, float)


def test_log_probs_float32_precision():
    g = full_group()
    lps = [-0.1, -1e-7, -12.3456789, -0.333333333, 0.0, -1e30]
    s = g.samples[0]
    s.tokens = g.prompt_ids + list(range(len(lps)))
    s.response_length = len(lps)
    s.loss_mask = None
    s.rollout_log_probs = lps
    back = decode_group(encode_group(g)).samples[0].rollout_log_probs
    assert back == [f32(x) for x in lps]
    assert back != lps  # really stored as float32, 4 bytes each
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(back, lps))


def test_prompt_prefix_stored_once():
    g = full_group()
    m = raw(g)
    assert len(m["pid"]) == 4 * len(g.prompt_ids)
    shared, unshared = m["s"][0], m["s"][1]
    assert shared["sp"] is True
    assert len(shared["t"]) == 4 * (len(g.samples[0].tokens) - len(g.prompt_ids))
    assert unshared["sp"] is False
    assert len(unshared["t"]) == 4 * len(g.samples[1].tokens)
    back = decode_group(encode_group(g))
    assert back.samples[0].tokens == g.samples[0].tokens
    assert back.samples[1].tokens == g.samples[1].tokens
    assert back.samples[0].response_tokens == [10, 11, 12, 13]


def test_tokens_shorter_than_prompt_do_not_share():
    g = full_group()
    g.samples[0].tokens = g.prompt_ids[:3]
    g.samples[0].response_length = 0
    g.samples[0].loss_mask = None
    g.samples[0].rollout_log_probs = None
    assert raw(g)["s"][0]["sp"] is False
    assert decode_group(encode_group(g)).samples[0].tokens == g.prompt_ids[:3]


def test_long_response_text_is_compressed():
    g = full_group()
    text = "Let me think step by step. " * 400 + "ünïcödé ✓ 答案是 4"
    g.samples[0].response = text
    m = raw(g)
    assert m["s"][0]["rz"] is True
    assert len(m["s"][0]["r"]) < len(text.encode()) // 5
    assert zlib.decompress(m["s"][0]["r"]).decode() == text
    assert m["s"][1]["rz"] is False  # short text stays plain
    assert decode_group(encode_group(g)).samples[0].response == text


#: Any JSON value: what labels, the entries of a dict reward and attributes may hold.
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8)


@st.composite
def samples(draw, prompt_ids):
    n = draw(st.integers(0, 40))
    share = draw(st.booleans()) and bool(prompt_ids)
    tail = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
    tokens = (prompt_ids + tail) if share else tail
    rl = draw(st.integers(0, len(tokens)))
    mask = draw(st.one_of(st.none(), st.lists(st.sampled_from([0, 1]), min_size=rl, max_size=rl)))
    lps = draw(st.one_of(st.none(), st.lists(st.floats(width=32, allow_nan=False), min_size=rl, max_size=rl)))
    reward = draw(st.one_of(st.none(), st.floats(allow_nan=False),
                            st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3)))
    sample = Sample(
        group_index=draw(st.one_of(st.none(), st.integers(0, 10**6))),
        index=draw(st.one_of(st.none(), st.integers(0, 10**6))),
        prompt=draw(st.one_of(st.text(max_size=30), st.just([{"role": "user", "content": "q"}]))),
        label=draw(JSON_VALUES),
        metadata=draw(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-5, 5), st.text(max_size=5)),
                                      max_size=3)),
        tokens=tokens, response_length=rl,
        response=draw(st.one_of(st.text(max_size=20), st.text(min_size=600, max_size=700))),
        reward=reward, loss_mask=mask, rollout_log_probs=lps,
        weight_versions=draw(st.lists(st.text(max_size=4), max_size=3)),
        status=draw(st.sampled_from(list(Status))),
        rollout_id=draw(st.one_of(st.none(), st.integers(0, 10))), remove_sample=draw(st.booleans()),
    )
    for name, value in draw(st.dictionaries(st.sampled_from(["tool_call_count", "pred", "payload_text"]),
                                            JSON_VALUES, max_size=2)).items():
        setattr(sample, name, value)  # attributes a generate function set
    return sample


@st.composite
def groups(draw):
    prompt_ids = draw(st.lists(st.integers(0, 200_000), max_size=10))
    return Group(
        group_id=draw(st.text(min_size=1, max_size=20)),
        samples=draw(st.lists(samples(prompt_ids), max_size=4)),
        prompt_ids=prompt_ids,
        attempts=draw(st.integers(0, 10)), restarts=draw(st.integers(0, 10)),
        admitted_version=draw(st.one_of(st.none(), st.integers(0, 1000))),
        dataset=draw(st.text(max_size=10)), epoch=draw(st.integers(0, 5)), row=draw(st.integers(0, 10**7)),
        created_at=draw(st.floats(0, 2e9)), claimed_at=draw(st.one_of(st.none(), st.floats(0, 2e9))),
        finished_at=None, worker=draw(st.one_of(st.none(), st.text(max_size=8))),
        error=draw(st.one_of(st.none(), st.text(max_size=20))),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_round_trip_property(g):
    assert decode_group(encode_group(g)) == g


# -- sizes ----------------------------------------------------------------------------


def _big_group(response: str = "") -> tuple[Group, int]:
    n_samples, n_gen, prompt_ids = 8, 2048, list(range(1000, 1200))
    samples_ = [
        Sample(group_index=0, index=i, prompt="p" * 100, tokens=prompt_ids + [(7 * j + i) % 150_000 for j in range(n_gen)],
               response_length=n_gen, response=response, reward=1.0,
               rollout_log_probs=[-0.01 * (j % 300) for j in range(n_gen)], weight_versions=["5"],
               status=Status.COMPLETED)
        for i in range(n_samples)
    ]
    return Group("ds:0:0", samples_, prompt_ids=prompt_ids, dataset="ds"), n_samples * n_gen


def test_size_about_8_bytes_per_generated_token():
    g, tokens = _big_group()
    size = len(encode_group(g))
    per_token = (size - 4 * len(g.prompt_ids)) / tokens
    assert 8.0 <= per_token <= 8.1, per_token  # int32 id + float32 log-prob, little else
    assert size < 134_000  # DESIGN.md: ~134 KB for 8 x 2048 tokens


def test_size_with_text_is_tokens_plus_compressed_text():
    text = " ".join(f"step {i}: carry the {i % 10}" for i in range(700))  # ~14 KB of response text
    g, tokens = _big_group(text)
    size = len(encode_group(g))
    compressed = len(zlib.compress(text.encode(), 1))
    expected = 8 * tokens + 4 * len(g.prompt_ids) + 8 * compressed
    assert expected <= size <= expected + 2000, (size, expected)


# -- decode errors --------------------------------------------------------------------


def _bad(mutate) -> str:
    m = raw(full_group())
    mutate(m)
    with pytest.raises(DecodeError) as info:
        decode_group(pack(m))
    return str(info.value)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all", b"\x92\x01"])
def test_not_msgpack(data):
    with pytest.raises(DecodeError):
        decode_group(data)


def test_not_msgpack_message():
    with pytest.raises(DecodeError, match="not msgpack"):
        decode_group(b"\xc1\xc1\xc1")


def test_pickle_is_never_unpickled():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    with pytest.raises(DecodeError):
        decode_group(pickle.dumps(Boom()))


def test_not_a_map():
    with pytest.raises(DecodeError, match="expected a map, got list"):
        decode_group(pack([1, 2, 3]))


def test_sampling_settings_round_trip_and_are_optional():
    group = full_group()
    group.sampling = SamplingRecord(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=512)
    assert decode_group(encode_group(group)).sampling == group.sampling
    group.sampling = SamplingRecord(0.6, 0.95, 20, 512, ("</answer>",), (151643,), False)
    assert decode_group(encode_group(group)).sampling == group.sampling
    m = raw(group)
    m["smp"] = m["smp"][:4]  # a worker before stop strings were recorded
    assert decode_group(pack(m)).sampling == SamplingRecord(0.6, 0.95, 20, 512)
    group.sampling = None
    m = raw(group)
    assert "smp" not in m  # a group without them is encoded as before this field existed
    assert decode_group(pack(m)).sampling is None


@pytest.mark.parametrize("value, expect", [
    ([1.0, 1.0, -1], "list of 4"), ("x", "list of 4"), ([True, 1.0, -1, 8], "numbers"),
    ([1.0, "1", -1, 8], "numbers"), ([1.0, 1.0, 1.5, 8], "integers"), ([1.0, 1.0, -1, None], "integers"),
    ([1.0, 1.0, -1, 8, [1], [], True], "list of strings"), ([1.0, 1.0, -1, 8, [], ["x"], True], "integers"),
    ([1.0, 1.0, -1, 8, [], [], 1], "boolean"),
])
def test_bad_sampling_settings(value, expect):
    assert expect in _bad(lambda m: m.update(smp=value))


def test_wrong_schema_version():
    msg = _bad(lambda m: m.update(v=SCHEMA_VERSION + 1))
    assert "schema version 2" in msg and str(SCHEMA_VERSION) in msg
    assert "schema version None" in _bad(lambda m: m.pop("v"))


@pytest.mark.parametrize("key", ["id", "pid", "s", "att", "rst", "ds", "ep", "row", "ct"])
def test_missing_group_field(key):
    assert f"missing field {key!r}" in _bad(lambda m: m.pop(key))


@pytest.mark.parametrize("key", ["t", "sp", "r", "rz", "rl", "rw", "st", "wv", "p", "m", "lp", "lm"])
def test_missing_sample_field(key):
    msg = _bad(lambda m: m["s"][2].pop(key))
    assert msg.startswith("sample 2:") and repr(key) in msg


@pytest.mark.parametrize("key,value,expect", [
    ("id", 42, "field 'id' should be str, got int"),
    ("att", "2", "field 'att' should be int, got str"),
    ("att", True, "field 'att' is a bool"),
    ("row", 1.5, "field 'row' should be int, got float"),
    ("s", {"a": 1}, "field 's' should be list, got dict"),
    ("ct", "yesterday", "field 'ct'"),
    ("pid", [1, 2, 3], "field 'pid' should be bytes, got list"),
    ("pid", b"\x01\x02\x03", "prompt_ids: expected a byte string of 4-byte items"),
    ("adm", "3", "field 'adm'"),
])
def test_wrong_group_types(key, value, expect):
    assert expect in _bad(lambda m: m.__setitem__(key, value))


@pytest.mark.parametrize("key,value,expect", [
    ("t", [1, 2, 3], "field 't' should be bytes, got list"),
    ("t", b"\x00" * 5, "sample 1 tokens: expected a byte string of 4-byte items"),
    ("lp", b"\x00" * 3, "sample 1 log-probs"),
    ("rw", "good", "field 'rw' should be int/float/dict, got str"),
    ("rw", True, "field 'rw' is a bool"),
    ("st", "done", "unknown status 'done'"),
    ("st", 1, "field 'st' should be str"),
    ("rl", 999, "response_length 999 outside 0..5"),
    ("rl", -1, "response_length -1 outside"),
    ("wv", [4], "weight_versions must be strings"),
    ("wv", "4", "field 'wv' should be list"),
    ("p", 7, "field 'p' should be str/list"),
    ("m", [], "field 'm' should be dict"),
    ("sp", 1, "field 'sp' should be bool"),
    ("gi", "x", "field 'gi' should be int"),
])
def test_wrong_sample_types(key, value, expect):
    msg = _bad(lambda m: m["s"][1].__setitem__(key, value))
    assert msg.startswith("sample 1") and expect in msg, msg


def test_sample_not_a_map():
    assert "sample 0: expected a map, got int" in _bad(lambda m: m["s"].__setitem__(0, 5))


@pytest.mark.parametrize("mask,expect", [
    ([4, b"\x01\x02"], "2 bytes cannot hold 4 bits"),
    ([20, b"\x01"], "1 bytes cannot hold 20 bits"),
    ("ones", "loss_mask: expected [length >= 0, bits]"),
    ([4], "loss_mask: expected [length >= 0, bits]"),
    (["4", b"\x01"], "loss_mask: expected [length >= 0, bits]"),
    ([-1, b""], "loss_mask: expected [length >= 0, bits]"),
    ([True, b""], "loss_mask: expected [length >= 0, bits]"),
])
def test_bad_mask(mask, expect):
    def corrupt(m):
        m["s"][0]["lm"] = mask
        if isinstance(mask, list) and len(mask) == 2 and type(mask[0]) is int and mask[0] > 0:
            m["s"][0]["rl"] = mask[0]  # so the length matches and the bits are what is wrong
            m["s"][0]["t"] = b"\x00" * 4 * mask[0]
            m["s"][0]["sp"] = False
            m["s"][0]["lp"] = None
    msg = _bad(corrupt)
    assert "loss_mask" in msg and expect in msg


def test_log_probs_must_be_one_per_response_token():
    msg = _bad(lambda m: m["s"][0].__setitem__("lp", m["s"][0]["lp"][:4]))
    assert "1 log-probs for 4 response tokens" in msg


def test_mask_length_must_match_the_response():
    msg = _bad(lambda m: m["s"][0].__setitem__("lm", [3, b""]))
    assert "loss_mask has 3 entries for" in msg and "response tokens" in msg


def test_bad_compressed_text():
    def corrupt(m):
        m["s"][0]["rz"] = True
        m["s"][0]["r"] = b"definitely not zlib"

    assert "sample 0: response text does not decompress" in _bad(corrupt)


@pytest.mark.parametrize("cut", [1, 2, 10, 100])
def test_truncated_bytes(cut):
    data = encode_group(full_group())
    with pytest.raises(DecodeError, match="not msgpack"):
        decode_group(data[:-cut])


def test_trailing_garbage():
    with pytest.raises(DecodeError, match="not msgpack"):
        decode_group(encode_group(full_group()) + b"\x00")


def test_decode_error_is_a_value_error():
    assert issubclass(DecodeError, ValueError)
