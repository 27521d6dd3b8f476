"""The data that moves through the pipeline: samples, groups and their status.

`Sample` is slime's Sample (every field slime declares, attributes user code sets
carried along), so a slime Sample can be built from ours without loss and back.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import time
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any


class Status(StrEnum):
    """slime's sample status values; a StrEnum, so they serialize as their value."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class PauseMode(StrEnum):
    """How SGLang's /pause_generation treats running requests (SGLANG_API.md)."""

    ABORT = "abort"  # running requests return at once with finish_reason abort
    RETRACT = "retract"  # requests go back to the engine's waiting queue, KV cache dropped
    IN_PLACE = "in_place"  # requests freeze where they are and continue on resume


class ReleasePolicy(StrEnum):
    """What happens to an aborted (requeued) group when admission reopens."""

    CONTINUE = "continue"  # back to the prompt list with its partial output
    RESTART = "restart"  # back to the prompt list from its prompt
    DROP = "drop"  # dropped, logged


class VersionClock(StrEnum):
    """What a group's age in weight versions is measured with (control `version_clock`)."""

    # The engines' weight_version in each answer (Sample.weight_versions): for trainers that
    # bump the queue's version with every weight update they push (Controller.resume).
    ENGINE = "engine"
    # The queue's version when the group was first claimed (Group.admitted_version): for
    # trainers whose engines count versions their own way, like slime (its updater numbers
    # weights from 1 in every run; the queue's version is slime's rollout id).
    QUEUE = "queue"


class DeadReason(StrEnum):
    """A dead letter's category (its stream entry's `reason`, the `dead_<reason>` counter,
    `dead list`): why a group failed for good, in a word."""

    ENGINE = "engine"  # engine failures past the attempt limit
    BAD_REQUEST = "bad_request"  # the engine refused the request (4xx)
    REWARD = "reward"  # the reward failed past the attempt limit
    MISSING_LABEL = "missing_label"  # the reward needs a label the row does not have
    INPUT = "input"  # a prompt the worker cannot tokenize or send
    ENCODE = "encode"  # the generated group cannot be stored
    GENERATE_FUNCTION = "generate_function"  # the user's generate function failed
    WORKER_ERROR = "worker_error"  # a bug in the worker itself
    MALFORMED = "malformed"  # an entry or payload that does not decode
    MAX_CLAIMS = "max_claims"  # claimed again and again without finishing (it kills its workers)
    BAD_ROW = "bad_row"  # a dataset row pushed with --skip-bad
    STALE = "stale"  # too stale at consumption, restarted from its prompt max_restarts times already
    FILTER = "filter"  # the trainer's filter raised on it
    DELIVERIES = "deliveries"  # delivered to the trainer max_deliveries times without a commit


def choices(enum: type[Enum]) -> list[str]:
    """The values of a closed vocabulary, for click.Choice and error messages."""
    return [m.value for m in enum]


def member(enum: type[Enum], value: object, what: str) -> Enum:
    """`value` as a member of `enum`, or a ValueError that names `what` and the choices."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(choices(enum))}") from None


# sample.metadata key: tokens produced by each engine call, in order (one entry per
# weight_versions entry), for masking off-policy prefixes.
SEGMENTS_KEY = "rollout_segments"
_SEED_MASK = 2**63 - 1  #: sampling seeds are non-negative int64, as torch generators take
#: How deep a JSON value (a label, a reward, an attribute a function set) may nest.
MAX_JSON_DEPTH = 64


def json_problem(value: Any, where: str, depth: int = 0) -> str | None:
    """What makes `value` not a JSON value (None, bool, int, finite float, str, lists and
    objects with string keys of those), naming where in it, or None. Tuples count as lists."""
    if value is None or type(value) in (bool, int, str):
        return None
    if type(value) is float:
        return None if math.isfinite(value) else f"{where} is {value}, which JSON cannot hold"
    if depth >= MAX_JSON_DEPTH:
        return f"{where} nests deeper than {MAX_JSON_DEPTH} levels"
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            problem = json_problem(item, f"{where}[{i}]", depth + 1)
            if problem:
                return problem
        return None
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                return f"{where} has a {type(key).__name__} key {key!r:.40}; JSON keys are strings"
            problem = json_problem(item, f"{where}[{key!r}]", depth + 1)
            if problem:
                return problem
        return None
    hint = " (convert it with int() or float())" if isinstance(value, numbers.Number) else ""
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}{hint}, not a JSON value"


@dataclass
class SpecInfo:
    """slime's Sample.SpecInfo: speculative-decoding counts of a sample's engine calls."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

    @property
    def spec_accept_length(self) -> float:
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

    def add(self, meta_info: dict) -> None:
        self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        self.completion_token_num += meta_info.get("completion_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return dict(vars(self))

    @staticmethod
    def from_dict(data: dict) -> SpecInfo:
        return SpecInfo(**{f.name: data.get(f.name, 0) for f in fields(SpecInfo)})


@dataclass
class PrefixCacheInfo:
    """slime's Sample.PrefixCacheInfo: prompt tokens the engines found cached."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

    def add(self, meta_info: dict) -> None:
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return dict(vars(self))

    @staticmethod
    def from_dict(data: dict) -> PrefixCacheInfo:
        return PrefixCacheInfo(**{f.name: data.get(f.name, 0) for f in fields(PrefixCacheInfo)})


@dataclass(eq=False)
class Sample:
    """slime's `Sample` (slime/utils/types.py): every field it declares, in its order, with its
    defaults and meaning, and its methods. Like slime's, an instance takes any attribute user
    code sets (`sample.tool_call_count = 2`); `to_dict`/`from_dict` carry those too, and so does
    the wire format (JSON values, pipeline/codec.py)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None  # slime: siblings of one rollout share it; None falls back to index
    prompt: str | list[dict] = ""
    tokens: list[int] = field(default_factory=list)  # prompt + response ids
    multimodal_inputs: dict | None = None
    multimodal_train_inputs: dict | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0  # how many of `tokens` at the end are the response
    label: Any = None  # any JSON value: slime's Dataset keeps data[label_key] as it is
    reward: float | dict | None = None  # a number, or a dict whose --reward-key value is one
    loss_mask: list[int] | None = None  # None means all ones
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None  # ids of response token i: ids[offsets[i]:offsets[i + 1]]
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: list | None = None
    remove_sample: bool = False  # slime trains it with its loss mask zeroed
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def __eq__(self, other: object) -> bool:
        # Everything, attributes user code set included, so a codec.PackedSample equals the
        # Sample it was encoded from.
        if not isinstance(other, Sample):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length:] if self.response_length else []

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def extras(self) -> dict[str, Any]:
        """The attributes user code set that slime's Sample does not declare."""
        return {k: v for k, v in vars(self).items() if k not in SAMPLE_FIELDS}

    def reset(self) -> None:
        """Forget everything generated: the sample as it was pushed."""
        for name in SAMPLE_FIELDS.keys() - _KEPT_ON_RESET:
            setattr(self, name, _default(name))
        for name in self.extras():
            delattr(self, name)
        self.metadata.pop(SEGMENTS_KEY, None)

    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """slime's method, for generate functions written for slime: engine tokens
        (`trainable`, with their log-probs and the answer's `meta_info`) or tool and
        observation tokens (loss mask 0, log-prob 0.0). An answer's meta_info adds its
        weight version (one per engine call, as slime) and sets the status from its finish
        reason; an engine call's tokens and the tool tokens after them are one segment
        (`SEGMENTS_KEY`)."""
        tokens = [int(t) for t in _as_list(tokens) or []]
        log_probs = None if log_probs is None else [float(lp) for lp in _as_list(log_probs)]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        previous = self.response_length
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * previous
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and previous:
                    raise ValueError("cannot append trainable log probabilities to a sample with response tokens "
                                     "but no rollout_log_probs")
                self.rollout_log_probs = [0.0] * previous
            self.rollout_log_probs += log_probs
        if tokens and not trainable and self.rollout_top_p_token_offsets is not None:
            # slime: tool tokens get empty top-p spans while replay is on
            offsets = _as_list(self.rollout_top_p_token_offsets)
            self.rollout_top_p_token_offsets = offsets + [offsets[-1]] * len(tokens)
        segments = self.metadata.setdefault(SEGMENTS_KEY, [])
        meta_info = meta_info or {}
        terminal = update_terminal_info and "finish_reason" in meta_info
        if terminal and "weight_version" in meta_info:
            self.weight_versions.append(str(meta_info["weight_version"]))
            segments.append(len(tokens))
        elif segments:
            segments[-1] += len(tokens)  # tool output counts with the engine call before it
        if terminal:
            if getattr(args, "sglang_speculative_algorithm", False):
                self.spec_info.add(meta_info)
            self.prefix_cache_info.add(meta_info)
            finish = (meta_info["finish_reason"] or {}).get("type")
            self.status = {"length": Status.TRUNCATED, "abort": Status.ABORTED,
                           "stop": Status.COMPLETED}.get(finish, self.status)
        problem = self.length_problem()
        if problem:
            raise ValueError(problem)

    def length_problem(self) -> str | None:
        """What makes the response fields disagree on its length (slime's
        `_validate_response_metadata_lengths`, and tokens holding the response), or None."""
        n = self.response_length
        if not 0 <= n <= len(self.tokens):
            return f"response_length {n} for {len(self.tokens)} tokens"
        if self.loss_mask is not None and len(self.loss_mask) != n:
            return f"{len(self.loss_mask)} loss_mask entries for {n} response tokens"
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != n:
            return f"{len(self.rollout_log_probs)} rollout_log_probs for {n} response tokens"
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if (ids is None) != (offsets is None):
            return "rollout top-p replay needs both token ids and offsets"
        if offsets is not None:
            offsets, ids = _as_list(offsets), _as_list(ids)
            if len(offsets) != n + 1:
                return f"{len(offsets)} rollout_top_p_token_offsets for {n} response tokens (needs {n + 1})"
            if offsets[-1] != len(ids):
                return f"rollout_top_p_token_offsets end at {offsets[-1]} for {len(ids)} top-p token ids"
        return None

    def get_reward_value(self, args: Any) -> Any:
        """slime's accessor: with `--reward-key`, the reward is a dict and that key wins."""
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of `to_dict` (ours or slime's): declared fields as fields, every other key
        as an attribute (slime's rule). `status` may be a string or any enum with our values;
        tensors (slime's top-p and routing replay) become lists."""
        data = dict(data)
        if "status" in data:
            data["status"] = Status(getattr(data["status"], "value", data["status"]))
        for name, kind in (("spec_info", SpecInfo), ("prefix_cache_info", PrefixCacheInfo)):
            value = data.get(name)
            if value is not None and not isinstance(value, kind):
                data[name] = kind.from_dict(value if isinstance(value, dict) else value.to_dict())
        for name in _TENSOR_FIELDS:
            if data.get(name) is not None:
                data[name] = _as_list(data[name])
        sample = cls(**{k: v for k, v in data.items() if k in SAMPLE_FIELDS})
        for key, value in data.items():
            if key not in SAMPLE_FIELDS:
                setattr(sample, key, value)
        return sample

    def to_dict(self) -> dict[str, Any]:
        """slime's `Sample.to_dict` shape: every field and attribute (a shallow copy), status
        as its string value, spec_info and prefix_cache_info as dicts."""
        value = {name: getattr(self, name) for name in SAMPLE_FIELDS}
        value.update(self.extras())
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value


#: Every field slime's Sample declares, in its order.
SAMPLE_FIELDS = {f.name: f for f in fields(Sample)}
#: What `Sample.reset` keeps: the sample as the dataset gave it.
_KEPT_ON_RESET = frozenset({"group_index", "index", "prompt", "label", "metadata", "multimodal_inputs",
                            "apply_chat_template_kwargs", "generate_function_path", "custom_rm_path"})
#: Fields slime fills with torch tensors; ours hold lists.
_TENSOR_FIELDS = ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts")


def _default(name: str) -> Any:
    f = SAMPLE_FIELDS[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _as_list(value: Any) -> Any:
    """A tensor or array as a list (slime's fields may hold torch tensors); anything else as is."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, list) else value


# slime's spellings, `Sample.Status.ABORTED` and friends, for functions written against slime's Sample.
Sample.Status = Status  # type: ignore[attr-defined]
Sample.SpecInfo = SpecInfo  # type: ignore[attr-defined]
Sample.PrefixCacheInfo = PrefixCacheInfo  # type: ignore[attr-defined]


def parse_version(version: str | int | None) -> int | None:
    """Weight versions are strings on the engine side ("default" before any
    update); the pipeline counts them as integers. Non-numeric means 0."""
    if version is None:
        return None
    if isinstance(version, int):
        return version
    try:
        return int(version)
    except ValueError:
        return 0


@dataclass(frozen=True)
class SamplingRecord:
    """The sampling settings a group's tokens were drawn with, stored with the group so a
    trainer can check they are the ones it computes the policy's probabilities with."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool | None = None  # None: recorded by a worker that did not say


@dataclass
class Group:
    """`n_samples_per_prompt` copies of one prompt; the unit of work and of training."""

    group_id: str  # stable across requeues: "<dataset>:<epoch>:<row>"
    samples: list[Sample]
    prompt_ids: list[int] = field(default_factory=list)  # tokenized prompt, shared by samples
    attempts: int = 0  # engine/reward failures so far
    restarts: int = 0  # times restarted from the prompt because too stale
    admitted_version: int | None = None  # trainer weight version at first claim
    dataset: str = ""
    epoch: int = 0
    row: int = 0
    created_at: float = field(default_factory=time.time)
    claimed_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None  # last worker that held it
    error: str | None = None  # why it was dead-lettered
    sampling: SamplingRecord | None = None  # set by the worker that generated it
    # The prompt as pushed, kept while the samples' `prompt` holds its chat-template
    # rendering (a worker with --apply-chat-template renders once, as slime's Dataset does);
    # None: the samples' prompts are as pushed.
    pushed_prompt: str | list[dict] | None = None

    @classmethod
    def fresh(cls, group_id: str, prompt: str | list[dict], n_samples: int, label: Any = None,
              metadata: dict | None = None, dataset: str = "", epoch: int = 0, row: int = 0,
              group_index: int | None = None) -> Group:
        """A new group of `n_samples` copies of one prompt, as the producer pushes it.
        `group_index` (default: the row) numbers groups; sample indices follow from it."""
        group_index = row if group_index is None else group_index
        samples = [
            Sample(group_index=group_index, index=group_index * n_samples + i, prompt=prompt, label=label,
                   metadata=dict(metadata or {}))
            for i in range(n_samples)
        ]
        return cls(group_id=group_id, samples=samples, dataset=dataset, epoch=epoch, row=row)

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    def reset(self) -> Group:
        """The group as it was pushed: every generated token forgotten."""
        for s in self.samples:
            s.reset()
            if self.pushed_prompt is not None:
                s.prompt = self.pushed_prompt
        self.pushed_prompt = None
        self.prompt_ids = []
        self.sampling = None
        return self

    def sampling_seed(self, sample: Sample) -> int:
        """The seed `sample` is generated with (SGLang's sampling_seed): fixed by the
        dataset, epoch, sample index and restarts, so a request continued after an abort
        draws from the same stream, and two systems given the same data draw the same
        responses from the simulator (whose whole response follows from the seed)."""
        key = f"{self.dataset}|{self.epoch}|{sample.index}|{self.restarts}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _SEED_MASK

    def oldest_version(self, clock: VersionClock = VersionClock.ENGINE) -> int | None:
        """The oldest weight version that produced any token of this group, on `clock`."""
        if clock == VersionClock.QUEUE:
            return self.admitted_version
        versions = [parse_version(v) for s in self.samples for v in s.weight_versions]
        versions = [v for v in versions if v is not None]
        if versions:
            return min(versions)
        return self.admitted_version
