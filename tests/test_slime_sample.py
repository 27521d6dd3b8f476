"""One sample, slime's shape: the project's Sample declares every field slime's declares
(names, order, defaults), carries attributes user code sets through to_dict/from_dict, the
wire format and slime's own Sample; decoded samples copy completely; labels are any JSON
value and rewards a number or a dict whose --reward-key value is a finite number."""
from __future__ import annotations

import asyncio
import copy
import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.codec import MAX_ATTRIBUTE_BYTES, EncodeError, PackedSample, decode_group, encode_group
from pipeline.producer import PushOptions, push_dataset
from pipeline.trainers.slime_types import from_slime_sample, slime_types, to_slime_sample
from pipeline.types import SAMPLE_FIELDS, Group, PrefixCacheInfo, Sample, SpecInfo, Status
from tests import fake_slime
from tests.groups import claim, finish, publish
from workers.rewards import Reward, RewardError, validate_reward

#: slime/utils/types.py at 624b824 (v0.3.1 the same): every field of Sample, in order, with its default.
SLIME_FIELDS = [
    ("group_index", None), ("index", None), ("rollout_id", None), ("prompt", ""), ("tokens", []),
    ("multimodal_inputs", None), ("multimodal_train_inputs", None), ("multimodal_train_input_id", None),
    ("apply_chat_template_kwargs", {}), ("response", ""), ("response_length", 0), ("label", None), ("reward", None),
    ("loss_mask", None), ("weight_versions", []), ("rollout_log_probs", None), ("rollout_top_p_token_ids", None),
    ("rollout_top_p_token_offsets", None), ("rollout_routed_experts", None), ("remove_sample", False),
    ("teacher_log_probs", None), ("status", Status.PENDING), ("metadata", {}), ("generate_function_path", None),
    ("custom_rm_path", None), ("train_metadata", None), ("session_id", None), ("non_generation_time", 0.0),
    ("spec_info", SpecInfo()), ("prefix_cache_info", PrefixCacheInfo()),
]
#: What retool's reward_func returns (slime's math_dapo compute_score, adjusted for tool calls).
RETOOL_REWARD = {"score": -1.0, "acc": False, "pred": "5"}


def test_sample_declares_every_field_slimes_sample_declares_in_its_order_with_its_defaults():
    fresh = Sample()
    assert [(name, getattr(fresh, name)) for name in SAMPLE_FIELDS] == SLIME_FIELDS
    assert Sample.Status.ABORTED is Status.ABORTED and fresh.spec_info.spec_accept_rate == 0.0


def finished_group(prompt_ids: list[int], **attributes) -> Group:
    group = Group.fresh("ds:0:7", "What is 2 + 3?", 2, label={"ground_truth": {"target": ["5"]}}, row=7)
    group.prompt_ids = prompt_ids
    for i, s in enumerate(group.samples):
        s.tokens = prompt_ids + [40 + i, 41, 42]
        s.response_length, s.response = 3, "abc"
        s.loss_mask, s.rollout_log_probs = [1, 0, 1], [-0.5, 0.0, -0.25]
        s.weight_versions, s.status, s.reward = ["3"], Status.COMPLETED, dict(RETOOL_REWARD, score=float(i))
        s.rollout_id, s.session_id = s.index, f"session-{i}"
        for name, value in attributes.items():
            setattr(s, name, value)
    return group


def every_field(s: Sample) -> dict:
    return {**{name: getattr(s, name) for name in SAMPLE_FIELDS}, **s.extras()}


@pytest.mark.parametrize("how", ["deepcopy", "copy", "to_dict/from_dict", "pickle", "slime"])
def test_a_copy_of_a_decoded_sample_is_complete(how):
    """Failure 2: codec's lazy marker made copy.deepcopy of an unread decoded sample hold a
    bare object() for tokens and log-probs (TypeError: object of type 'object' has no len())."""
    original = finished_group([1, 2, 3, 4], tool_call_count=2)
    for s in decode_group(encode_group(original)).samples:
        assert isinstance(s, PackedSample)
        copied = {
            "deepcopy": copy.deepcopy, "copy": copy.copy,
            "to_dict/from_dict": lambda x: Sample.from_dict(x.to_dict()),
            "pickle": lambda x: pickle.loads(pickle.dumps(x)),
            "slime": lambda x: from_slime_sample(to_slime_sample(x)),
        }[how](s)
        made = original.samples[s.index - 14]
        assert every_field(copied) == every_field(s) == every_field(made)
        assert copied.tokens == made.tokens and len(copied.rollout_log_probs) == 3
        assert copied.tool_call_count == 2


def test_copying_a_decoded_sample_leaves_it_packed_and_complete():
    [s, _] = decode_group(encode_group(finished_group([5, 6]))).samples
    deep = copy.deepcopy(s)
    assert deep.packed_tokens() == ([5, 6], s.packed_tokens()[1])  # still packed: copying read nothing
    assert deep.tokens == [5, 6, 40, 41, 42] and deep.packed_tokens() is None and s.packed_tokens() is not None


def test_attributes_a_function_sets_travel_through_the_wire_and_slimes_sample(monkeypatch):
    """Failure 3: from_slime_sample kept the 13 fields of the old Sample."""
    group = finished_group([1, 2], tool_call_count=2, payload_text="<|im_start|>...", payload_has_tools=True)
    decoded = decode_group(encode_group(group))
    assert decoded == group and decoded.samples[0].tool_call_count == 2
    assert decoded.samples[0].extras() == {"tool_call_count": 2, "payload_text": "<|im_start|>...",
                                           "payload_has_tools": True}
    fake_slime.install(monkeypatch)
    slime_types.cache_clear()
    try:
        theirs = to_slime_sample(decoded.samples[1])
        assert isinstance(theirs, fake_slime.Sample) and theirs.tool_call_count == 2
        assert theirs.label == {"ground_truth": {"target": ["5"]}} and theirs.reward == dict(RETOOL_REWARD, score=1.0)
        theirs.tool_iters = 3  # set on slime's sample: comes back to ours
        back = from_slime_sample(theirs)
    finally:
        monkeypatch.undo()
        slime_types.cache_clear()
    assert back.tool_iters == 3 and back.tool_call_count == 2 and back.tokens == group.samples[1].tokens


def test_declared_fields_beyond_the_core_ones_travel_too():
    group = finished_group([1])
    s = group.samples[0]
    s.rollout_top_p_token_ids, s.rollout_top_p_token_offsets = [4, 5, 6], [0, 1, 2, 3]
    s.remove_sample, s.train_metadata, s.non_generation_time = True, {"loss": "sft"}, 1.5
    s.spec_info.spec_accept_token_num, s.prefix_cache_info.cached_tokens = 7, 9
    decoded = decode_group(encode_group(group)).samples[0]
    assert every_field(decoded) == every_field(s)
    assert isinstance(decoded.spec_info, SpecInfo) and decoded.spec_info.spec_accept_token_num == 7


@pytest.mark.parametrize("value,error", [
    (object(), "attribute tool_state is a builtins.object, not a JSON value"),
    ({"a": float("nan")}, "attribute tool_state['a'] is nan, which JSON cannot hold"),
    ({1: "x"}, "attribute tool_state has a int key 1"),
    (b"raw", "attribute tool_state is a builtins.bytes"),
])
def test_an_attribute_that_is_not_json_is_an_encode_error_naming_it(value, error):
    group = finished_group([1], tool_state=value)
    with pytest.raises(EncodeError, match="sample 14: " + error.replace("[", r"\[").replace("(", r"\(")):
        encode_group(group)


def test_attributes_past_the_size_limit_are_an_encode_error_naming_the_attribute():
    group = finished_group([1], small=1, transcript="x" * MAX_ATTRIBUTE_BYTES)
    with pytest.raises(EncodeError, match=r"attribute 'transcript' takes the sample's attributes to [\d,]+ bytes, "
                                          r"over the limit of 1,048,576"):
        encode_group(group)
    encode_group(finished_group([1], transcript="x" * (MAX_ATTRIBUTE_BYTES - 100)))


@pytest.mark.parametrize("label", [{"ground_truth": {"target": ["Paris", "paris"]}}, ["a", "b"], 5, 3.5, True,
                                   "text"])
def test_any_json_label_is_pushed_kept_as_it_is_and_decoded(queue, tmp_path, label):
    """Failure 4: `rollout push` answered "'label' must be a string or number, got dict"."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"input": "Capital of France?", "label": label}) + "\n")
    push_dataset(queue, path)
    [s] = decode_group(queue.redis.hget(queue.keys.payloads, "rows.jsonl:0:0")).samples
    assert s.label == label and type(s.label) is type(label)


def test_a_parquet_struct_label_is_kept(queue, tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"input": ["q?"], "reward_model": [{"ground_truth": {"target": ["x"]}}]}), path)
    push_dataset(queue, path, PushOptions(label_key="reward_model"))
    [s] = decode_group(queue.redis.hget(queue.keys.payloads, "rows.parquet:0:0")).samples
    assert s.label == {"ground_truth": {"target": ["x"]}}


def test_push_of_a_dict_label_through_the_cli(run, queue, tmp_path):
    path = tmp_path / "search.jsonl"
    path.write_text(json.dumps({"question": "Who?", "reward_model": {"ground_truth": {"target": ["Ada"]}}}) + "\n")
    result = run("push", str(path), "--input-key", "question", "--label-key", "reward_model")
    assert result.exit_code == 0, result.output
    [s] = decode_group(queue.redis.hget(queue.keys.payloads, "search.jsonl:0:0")).samples
    assert s.label["ground_truth"]["target"] == ["Ada"]


def test_a_label_that_is_not_json_is_a_bad_row(queue, tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"input": ["a?"], "label": [float("nan")]}), path)
    with pytest.raises(ValueError, match=r"'label' is nan, which JSON cannot hold: a label must be a JSON value"):
        push_dataset(queue, path)


def test_a_dict_reward_keeps_its_non_numeric_values_and_trains_on_the_reward_key():
    """Failure 1: every value of a dict reward had to be a finite number."""
    assert validate_reward({"score": 1, "acc": True, "pred": "5"}, "score") == {"score": 1.0, "acc": True, "pred": "5"}
    assert validate_reward({"score": -1.0, "acc": False, "pred": None}, "score")["pred"] is None
    with pytest.raises(RewardError, match="under reward_key 'score'; expected a number"):
        validate_reward({"score": "high"}, "score")
    with pytest.raises(RewardError, match="returned a bool under reward_key 'acc'"):
        validate_reward({"score": 1.0, "acc": True}, "acc")
    with pytest.raises(RewardError, match="the value under key 'pred' is a builtins.object"):
        validate_reward({"score": 1.0, "pred": object()}, "score")
    with pytest.raises(RewardError, match=r"under key 'acc' \(True\); return float.* \(no --reward-key names the value"):
        validate_reward({"score": 1.0, "acc": True}, None)
    assert validate_reward({"a": 1, "b": 0.5}, None) == {"a": 1.0, "b": 0.5}


async def retool_like_reward(args, sample):
    """As slime's retool reward_func: math_dapo's dict, adjusted by an attribute generate set."""
    result = dict(RETOOL_REWARD)
    result["score"] = min(-0.6, result["score"] + (getattr(sample, "tool_call_count", 0) - 2) / 2 * 0.1)
    return result


def test_a_reward_gets_the_attributes_and_its_dict_is_kept():
    reward = Reward(retool_like_reward)
    group = finished_group([1], tool_call_count=1)
    decoded = decode_group(encode_group(group))
    [first, second] = asyncio.run(reward.score(type("Args", (), {"reward_key": "score"})(), decoded.samples))
    assert first == second == {"score": -1.05, "acc": False, "pred": "5"}
    decoded.samples[0].reward = first
    assert decode_group(encode_group(decoded)).samples[0].reward == first


def test_inspect_shows_the_label_the_rewards_and_the_attributes(run, queue):
    queue.push_groups([Group.fresh("g0", "Who wrote Hamlet?", 2, label={"ground_truth": {"target": ["Shakespeare"]}})])
    [held] = claim(queue, "w", 1).groups
    group = finish(held.group)
    for s in group.samples:
        s.reward, s.tool_call_count = dict(RETOOL_REWARD), 2
    publish(queue, "w", held, group=group)
    result = run("inspect", "g0", "--json")
    report = json.loads(result.output)
    assert report["label"] == {"ground_truth": {"target": ["Shakespeare"]}}
    assert [(s["reward"], s["attributes"]) for s in report["samples"]] == [(RETOOL_REWARD, ["tool_call_count"])] * 2
    text = " ".join(run("inspect", "g0").output.split())  # lines wrap at the terminal's width
    assert 'label {"ground_truth": {"target": ["Shakespeare"]}}' in text
    assert 'reward {"score": -1.0, "acc": false, "pred": "5"} attributes tool_call_count' in text
