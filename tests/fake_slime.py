"""A stand-in `slime` package for the adapter's tests (slime needs Megatron and GPUs).

It mirrors the signatures and types of slime 0.3.1 / main 624b824 that the adapter
meets, written from their documented behaviour (not copied): `Sample` with
`rollout_id` and the top-p replay fields, `RolloutFnTrainOutput`,
`RolloutFnEvalOutput`, `DynamicFilterOutput` with `keep_when_insufficient` and the
rule that applies it, the nonzero-std filters, the data-source calls of
`sglang_rollout.generate_rollout` (over finished groups), the abstract `DataSource`, slime's
`load_tokenizer`, and the checks of `RolloutManager._convert_samples_to_train_data`
that a batch must pass. `install(monkeypatch)` puts it in sys.modules.
"""
from __future__ import annotations

import statistics
import sys
import types
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from workers.tokenizer import load_tokenizer as _our_tokenizer


@dataclass
class Sample:
    """slime/utils/types.py: nested Status enum, fields ours lacks."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    custom_rm_path: str | None = None

    def to_dict(self):
        value = self.__dict__.copy()
        value["status"] = self.status.value
        return value

    @staticmethod
    def from_dict(data: dict):
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        names = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for k, v in data.items():
            if k not in names:
                setattr(sample, k, v)
        return sample

    def get_reward_value(self, args):
        return self.reward if not args.reward_key else self.reward[args.reward_key]


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] = None


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def should_drop_dynamic_filter_output(output, *, remaining_batch_size: int, target_data_size: int) -> bool:
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


def check_reward_nonzero_std(args, samples, **kwargs):
    rewards = [s.get_reward_value(args) for s in samples]
    keep = statistics.stdev(rewards) > 1e-6 if len(rewards) > 1 else False
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args, samples, **kwargs):
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output


class DataSource:
    """slime.rollout.data_source.DataSource (0.2.1+): the methods slime calls."""

    def get_samples(self, num_samples): raise NotImplementedError
    def add_samples(self, samples): raise NotImplementedError
    def save(self, rollout_id): raise NotImplementedError
    def load(self, rollout_id=None): raise NotImplementedError
    def __len__(self): raise NotImplementedError


def load_tokenizer(name_or_path: str, **kwargs):
    """slime.utils.processing_utils.load_tokenizer; here the byte-level tokenizer."""
    return _our_tokenizer(None)


def convert_samples_to_train_data(args, samples: list[Sample]) -> dict:
    """The checks of RolloutManager._convert_samples_to_train_data a batch must pass."""
    for s in samples:
        mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_length
        assert len(mask) == s.response_length, "loss mask length != response length"
        if getattr(args, "rollout_top_p", 1.0) != 1.0:
            assert s.rollout_top_p_token_ids is not None and s.rollout_top_p_token_offsets is not None
    return {"tokens": [s.tokens for s in samples], "rewards": [s.get_reward_value(args) for s in samples]}


class HttpUtils:
    """slime/utils/http_utils.py: `post` goes through the client `init_http_client(args)` made."""

    client_args = None

    @classmethod
    def init_http_client(cls, args) -> None:
        cls.client_args = args

    @classmethod
    async def post(cls, url, payload, max_retries=60, headers=None):
        assert cls.client_args is not None, "http client not initialized; call init_http_client first"
        import aiohttp

        async with aiohttp.ClientSession() as session, session.post(url, json=payload, headers=headers) as r:
            r.raise_for_status()
            return await r.json()


async def async_rm(args, sample, **kwargs):
    """slime.rollout.rm_hub.async_rm's dispatch: args.custom_rm_path first, then rm_type."""
    if args.custom_rm_path is not None:
        module, _, name = args.custom_rm_path.rpartition(".")
        return await getattr(sys.modules[module], name)(args, sample, **kwargs)
    if args.rm_type == "math":
        return 1 if sample.response.strip() == str(sample.label).strip() else 0
    raise NotImplementedError(f"Rule-based RM for {args.rm_type} is not implemented.")


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime.rollout.sglang_rollout.generate_rollout (generate_rollout_async) over a data
    source of finished groups, in slime's order: read --over-sampling-batch-size groups
    while fewer than the batch are outstanding, screen each finished group with the dynamic
    filter (a drop makes it read again), keep the first --rollout-batch-size; what is still
    outstanding then is aborted, never trained (given back with add_samples under
    --partial-rollout). The kept groups, sorted by index, go to --rollout-sample-filter-path
    and are returned. Groups finish here in the order they were read."""
    from pipeline.filters import load_object

    dynamic_filter = load_object(args.dynamic_sampling_filter_path) if args.dynamic_sampling_filter_path else None
    target = args.rollout_batch_size
    outstanding: list[list[Sample]] = []
    remaining, data = 0, []
    while len(data) < target:
        while remaining < target:
            samples = data_source.get_samples(args.over_sampling_batch_size)
            outstanding += samples
            remaining += len(samples)
        group = outstanding.pop(0)
        output = dynamic_filter(args, group) if dynamic_filter else DynamicFilterOutput(keep=True)
        if not isinstance(output, DynamicFilterOutput):
            output = DynamicFilterOutput(keep=output)
        if should_drop_dynamic_filter_output(output, remaining_batch_size=remaining, target_data_size=target):
            remaining -= 1
            continue
        data.append(group)
    data.sort(key=lambda group: group[0].index)
    if getattr(args, "rollout_sample_filter_path", None):
        load_object(args.rollout_sample_filter_path)(args, data)
    if getattr(args, "partial_rollout", False) and outstanding:
        data_source.add_samples(outstanding)
    return RolloutFnTrainOutput(samples=data, metrics={})


_current_rollout_id: int | None = None


def set_current_rollout_id(rollout_id: int | None) -> None:
    """slime.rollout.sample_hooks.set_current_rollout_id (RolloutManager.generate calls it)."""
    sys.modules["slime.rollout.sample_hooks"]._current_rollout_id = rollout_id


def install(monkeypatch, *, version_features: bool = True) -> None:
    """Put the stand-in into sys.modules (`version_features=False`: a slime older than
    0.2.0, without RolloutFnTrainOutput)."""
    tree = {
        "slime": {}, "slime.utils": {}, "slime.rollout": {}, "slime.rollout.filter_hub": {},
        "slime.utils.types": {"Sample": Sample},
        "slime.utils.processing_utils": {"load_tokenizer": load_tokenizer},
        "slime.utils.http_utils": {"init_http_client": HttpUtils.init_http_client, "post": HttpUtils.post},
        "slime.rollout.base_types": ({"RolloutFnTrainOutput": RolloutFnTrainOutput,
                                      "RolloutFnEvalOutput": RolloutFnEvalOutput} if version_features else {}),
        "slime.rollout.data_source": {"DataSource": DataSource} if version_features else {},
        "slime.rollout.rm_hub": {"async_rm": async_rm},
        "slime.rollout.sglang_rollout": {"generate_rollout": generate_rollout},
        "slime.rollout.sample_hooks": {"_current_rollout_id": None, "set_current_rollout_id": set_current_rollout_id},
        "slime.rollout.filter_hub.base_types": {
            "DynamicFilterOutput": DynamicFilterOutput,
            "should_drop_dynamic_filter_output": should_drop_dynamic_filter_output},
        "slime.rollout.filter_hub.dynamic_sampling_filters": {
            "check_reward_nonzero_std": check_reward_nonzero_std,
            "check_reward_nonzero_std_with_fallback": check_reward_nonzero_std_with_fallback},
    }
    monkeypatch.setattr(HttpUtils, "client_args", None)
    for name, attrs in tree.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
