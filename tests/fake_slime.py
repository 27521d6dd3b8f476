"""A stand-in `slime` package for the adapter's tests (slime needs Megatron and GPUs).

It mirrors the signatures and types of slime 0.3.1 / main 624b824 that the adapter
meets, written from their documented behaviour (not copied): `Sample` with
`rollout_id` and the top-p replay fields, `RolloutFnTrainOutput`,
`RolloutFnEvalOutput`, `DynamicFilterOutput` with `keep_when_insufficient` and the
rule that applies it, the nonzero-std filters, the abstract `DataSource` and slime's
`load_tokenizer`. slime's own rollout path (its default rollout, rewards, sample hooks,
RolloutManager with the checks a batch must pass, train_async.py) is in
tests/fake_slime_rollout.py, step by step as slime's code runs it.
`install(monkeypatch)` puts both in sys.modules.
"""
from __future__ import annotations

import statistics
import sys
import types
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from tests import fake_slime_rollout as rollout
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
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    session_id: str | None = None

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
                                      "RolloutFnEvalOutput": RolloutFnEvalOutput, "call_rollout_fn": rollout.call_rollout_fn}
                                     if version_features else {}),
        "slime.rollout.data_source": {"DataSource": DataSource} if version_features else {},
        "slime.utils.misc": {"load_function": rollout.load_function},
        "slime.rollout.rm_hub": {"async_rm": rollout.async_rm, "batched_async_rm": rollout.batched_async_rm},
        "slime.rollout.sglang_rollout": {"generate_rollout": rollout.generate_rollout,
                                         "generate_and_rm": rollout.generate_and_rm, "abort": rollout.abort},
        "slime.rollout.sample_hooks": {"_current_rollout_id": None, "set_current_rollout_id": set_current_rollout_id,
                                       "apply_rollout_sample_hooks": rollout.apply_rollout_sample_hooks},
        "slime.ray": {}, "slime.ray.rollout": {"RolloutManager": rollout.RolloutManager},
        "slime.rollout.filter_hub.base_types": {
            "DynamicFilterOutput": DynamicFilterOutput, "call_dynamic_filter": rollout.call_dynamic_filter,
            "should_drop_dynamic_filter_output": should_drop_dynamic_filter_output},
        "slime.rollout.filter_hub.dynamic_sampling_filters": {
            "check_reward_nonzero_std": check_reward_nonzero_std,
            "check_reward_nonzero_std_with_fallback": check_reward_nonzero_std_with_fallback},
    }
    monkeypatch.setattr(HttpUtils, "client_args", None)
    monkeypatch.setattr(rollout.GenerateState, "instance", None)  # slime's singleton: one per process
    for name, attrs in tree.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
